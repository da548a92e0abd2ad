#!/usr/bin/env bash
# Where a GEMM's time goes in fugu-gemm and in OpenBLAS, measured in one process.
#
#   scripts/gemm-profile.sh [--threads N] [--budget SECONDS] [--isa ISA] SHAPE...
#   OPENBLAS_CORETYPE=Haswell scripts/gemm-profile.sh --isa avx2 1024x768x3072 2048x2048x2048
#
# SHAPE is `fugu bench gemm --shape` syntax (MxNxK[xBATCH][:ta][:tb]). For each shape it runs
# `fugu bench gemm` (which interleaves fugu-gemm and OpenBLAS on the same operands) under
# `perf record` (cpu-clock sampling, so it works in VMs without PMU counters) and prints, as %
# of all samples of that run, each library's micro-kernel, its packing routines and the rest of
# its GEMM code, beside the bench's own GFLOP/s and median ratio. What it is for is the split
# (kernel against packing, each library against the other in the same process): that is how
# docs/KERNELS.md, "Measured (Zen 4, 2026-11-26)", found the packing gap of issue 14. Both the
# medians and the sample shares move with bursts of load from other tenants of a shared VM
# (the kernel-to-kernel share by ±5% between runs there), so compare several runs.
#
# Needs perf (Debian: linux-perf) and python3, and builds `fugu` with --features openblas (libopenblas-dev).
set -euo pipefail
cd "$(dirname "$0")/.."

threads=1 budget=4 isa=()
shapes=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --threads) threads=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        --isa) isa=(--isa "$2"); shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        -*) echo "gemm-profile.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) shapes+=("$1"); shift ;;
    esac
done
[[ ${#shapes[@]} -gt 0 ]] || { echo "gemm-profile.sh: give at least one SHAPE (see --help)" >&2; exit 2; }
command -v perf >/dev/null || { echo "gemm-profile.sh: perf is missing (apt-get install linux-perf)" >&2; exit 1; }

cargo build --release --locked --features openblas >&2
fugu=$PWD/target/release/fugu
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

printf '%-22s %8s %8s %6s | %7s %7s %7s | %7s %7s %7s\n' shape fugu_GF oblas_GF ratio \
    f.kern f.pack f.other o.kern o.pack o.other
for s in "${shapes[@]}"; do
    perf record -q -F 4000 -o "$work/perf.data" -- "$fugu" bench gemm --shape "$s" \
        --threads "$threads" --budget "$budget" --no-baseline --format json "${isa[@]}" \
        >"$work/bench.json" 2>"$work/bench.err" ||
        { cat "$work/bench.err" >&2; exit 1; }
    # The bench's own JSON row (the fields `fugu bench gemm --format json` documents).
    row=$(python3 -c 'import json, sys
r = json.loads(sys.stdin.readline())
print("%.1f %.1f %.2f" % (r["gflops"], r["openblas_gflops"], r["openblas_ratio"]))' <"$work/bench.json")
    perf report -i "$work/perf.data" --no-children --sort symbol 2>/dev/null |
        awk -v shape="$s" -v row="$row" '
            /^#/ || NF < 3 { next }
            { pct = $1 + 0; sym = $0 }
            sym ~ /fugu_gemm::(pack::|arch::transpose::)/ { fp += pct; next }
            sym ~ /fugu_gemm::arch::|fugu_(neon|sve)_/ && sym !~ /fma_peak/ { fk += pct; next }
            sym ~ /fugu_gemm::(driver|runtime|buffer)::/ { fo += pct; next }
            sym ~ /sgemm_kernel_/ { ok += pct; next }
            sym ~ /sgemm_.*copy_/ { op += pct; next }
            sym ~ /sgemm_|gemm_driver|blas_/ { oo += pct; next }
            END {
                split(row, r, " ")
                printf "%-22s %8s %8s %6s | %6.2f%% %6.2f%% %6.2f%% | %6.2f%% %6.2f%% %6.2f%%\n",
                    shape, r[1], r[2], r[3], fk, fp, fo, ok, op, oo
            }'
done

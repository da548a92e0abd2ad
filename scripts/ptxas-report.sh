#!/usr/bin/env bash
# Registers, spills and shared memory of every CUDA kernel as ptxas assembles it: a static
# check of the kernels on a machine without a GPU (the A64FX kernels have llvm-mca, these have
# ptxas). The PTX is NVRTC's, as the backend compiles it at start-up (`examples/kernels_ptx.rs`;
# the backend then has NVRTC assemble it into the cubin it loads).
#
#   scripts/ptxas-report.sh             # sm_90 (H100, H200), every kernel
#   scripts/ptxas-report.sh 8 0 flash   # sm_80, kernels whose name contains "flash"
#
# ptxas comes from NVIDIA's `nvidia-cuda-nvcc` wheel (PyPI), unpacked once into
# FUGU_PTXAS_DIR (default target/ptxas); NVRTC from scripts/install-deps.sh. Registers are the
# per-thread count under each kernel's __launch_bounds__; spills are bytes per thread.
set -euo pipefail
cd "$(dirname "$0")/.."

MAJOR="${1:-9}"
MINOR="${2:-0}"
FILTER="${3:-}"
DIR="${FUGU_PTXAS_DIR:-target/ptxas}"
PTXAS="$DIR/nvidia/cu13/bin/ptxas"
if [ ! -x "$PTXAS" ]; then
    mkdir -p "$DIR"
    python3 -m pip download --quiet --no-deps nvidia-cuda-nvcc==13.5.37 -d "$DIR"
    python3 -m zipfile -e "$DIR"/nvidia_cuda_nvcc-13.5.37-*.whl "$DIR"
    chmod +x "$PTXAS"
fi
NVRTC_LIB=$(ls -d /opt/fugu-nvrtc/nvidia/cu13/lib 2>/dev/null || true)
export LD_LIBRARY_PATH="${NVRTC_LIB:+$NVRTC_LIB:}${LD_LIBRARY_PATH:-}"
cargo run --quiet --release --features cuda --example kernels_ptx -- "$MAJOR" "$MINOR" \
    > "$DIR/kernels.ptx"
FEATURES=""; [ "$MAJOR$MINOR" = 90 ] && FEATURES=a  # the backend compiles for sm_90a there (arch_name)
"$PTXAS" -arch="sm_$MAJOR$MINOR$FEATURES" -v "$DIR/kernels.ptx" -o "$DIR/kernels.cubin" \
    > "$DIR/ptxas.txt" 2>&1
# ptxas's performance notes (e.g. C7512: wgmma instructions serialized for want of registers).
grep "Potential Performance Loss" "$DIR/ptxas.txt" || true
awk -v filter="$FILTER" '
        /Compiling entry function/ { name = $7; gsub(/[^A-Za-z0-9_]/, "", name); spill = ""; next }
        /spill stores/ { spill = $5 " B spilled (stores), " $9 " B (loads)"; next }
        /Used [0-9]+ registers/ {
            if (filter == "" || index(name, filter)) {
                regs = $5; smem = "0"
                for (i = 1; i <= NF; i++) if ($(i + 1) == "bytes" && $(i + 2) == "smem") smem = $i
                printf "%-36s %4s registers  %6s B smem  %s\n", name, regs, smem, spill
            }
        }' "$DIR/ptxas.txt"

#!/usr/bin/env bash
# The low-precision accuracy evidence of docs/KERNELS.md ("Low precision"): gpt2-tiny trained
# on the bundled corpus in fp32, bf16, fp16 (f16 operands, f32 accumulation) and fp16 with f16
# sums in chunks (A64FX's arithmetic: its SVE kernel, or the portable emulation on any other
# CPU, `FUGU_GEMM_F16=chunked`), then `fugu report` over the four runs (loss.svg, loss.csv)
# and a check that every evaluation of every low-precision run is within 2% of fp32.
#
#   scripts/precision-curves.sh [OUT_DIR]        # default target/precision-curves
#
# Env: FUGU_CURVE_STEPS (300), FUGU_CURVE_EVAL_EVERY (25), FUGU_CURVE_TOLERANCE (0.02).
# On 2 Zen 4 cores: about 1 minute per run, 10 for the emulated f16 chunks.
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${1:-target/precision-curves}"
STEPS="${FUGU_CURVE_STEPS:-300}"
EVAL="${FUGU_CURVE_EVAL_EVERY:-25}"
TOL="${FUGU_CURVE_TOLERANCE:-0.02}"

cargo build --release --bin fugu
FUGU=target/release/fugu
rm -rf "$OUT"
mkdir -p "$OUT"
"$FUGU" prepare --out "$OUT/data"

run() { # name precision [env...]
    local name=$1 precision=$2
    shift 2
    echo "== $name: --precision $precision $*"
    env "$@" "$FUGU" train --config gpt2-tiny --data "$OUT/data/manifest.json" \
        --out "$OUT/$name" --steps "$STEPS" --eval-every "$EVAL" --ckpt-every 0 \
        --precision "$precision"
}
run fp32 fp32
run bf16 bf16
run fp16 fp16 FUGU_GEMM_F16=f32
run fp16-f16-chunks fp16 FUGU_GEMM_F16=chunked

"$FUGU" report "$OUT/fp32" "$OUT/bf16" "$OUT/fp16" "$OUT/fp16-f16-chunks" --out "$OUT/report"
python3 - "$OUT/report/loss.csv" "$TOL" <<'PY'
import csv
import sys

path, tol = sys.argv[1], float(sys.argv[2])
rows = list(csv.DictReader(open(path)))
col = "max |Δ| vs reference (%)"
bad = []
for r in rows:
    dev = r[col]
    print(f"{r['run']:<18} {r['precision']:<5} last val loss {float(r['last val loss']):.4f}  "
          f"max deviation from fp32 {dev}%")
    if dev == "" or float(dev) > 100 * tol:
        bad.append(r["run"])
if bad:
    sys.exit(f"precision-curves: beyond {100 * tol:g}% of fp32 (or not comparable): {bad}")
print(f"every evaluation within {100 * tol:g}% of fp32")
PY
echo "chart: $OUT/report/loss.svg"

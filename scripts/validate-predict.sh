#!/usr/bin/env bash
# Records the measurements `fugu predict` is validated against on this machine, into
#   tests/fixtures/predict/<name>/   (default name: vm-zen4)
# then runs the validation test, which prints predicted against measured step times.
#
#   scripts/validate-predict.sh [NAME]
#
# What it records (release build with --features mpi, gpt2-tiny, T = 128, global batch 8,
# 16 steps, one thread per rank, fine timers, no evaluation or checkpoints):
#   ref/      one process: the reference run whose per-op times the model scales
#   comm-1n2r.json  `fugu bench comm` on 2 ranks (4 B .. 64 MiB): the intra-node link
#   gemm-1t.json    `fugu bench gemm` of every GEMM shape the layouts make, 1 thread
#   dp2 tp2 dp2z   2 ranks: data parallel, tensor parallel, data parallel with ZeRO-1
#   pp2            2 ranks: two pipeline stages, 4 micro-batches
#   dp4 tp2dp2 tp4 pp2dp2  4 ranks (oversubscribed on a 2-core machine)
# Each run's metrics.jsonl keeps its header and step lines (per-rank min/max maps dropped).
# Takes about a minute on 2 cores. Needs mpirun (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

name=${1:-vm-zen4}
out=tests/fixtures/predict/$name
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none

cargo build --release --locked --features mpi
fugu=$PWD/target/release/fugu
common=(--config gpt2-tiny --seq-len 128 --steps 16 --eval-every 0 --ckpt-every 0 --timers fine --threads 1)
run() { # name ranks args...
  local run=$1 np=$2
  shift 2
  echo "== $run ($np rank(s)): $*" >&2
  if [ "$np" = 1 ]; then
    "$fugu" train "${common[@]}" --out "$work/$run" "$@" >"$work/$run.log" 2>&1
  else
    mpirun -np "$np" --oversubscribe --bind-to none "$fugu" train "${common[@]}" --out "$work/$run" "$@" \
      >"$work/$run.log" 2>&1
  fi || { tail -20 "$work/$run.log" >&2; exit 1; }
}
run ref 1 --batch-size 8
echo "== fugu bench comm (2 ranks)" >&2
mpirun -np 2 --oversubscribe --bind-to none "$fugu" bench comm --max-size 64MiB --repeats 3 --format json \
  >"$work/comm-1n2r.json"
echo "== fugu bench gemm (the layouts' GEMM shapes, 1 thread)" >&2
# shellcheck disable=SC2046 # one --shape argument per word
"$fugu" bench gemm $("$fugu" predict gemm-shapes --config gpt2-tiny --seq-len 128 \
  --micro-batch-size 2,4,8 --tp 1,2,4 --pp 1,2) --threads 1 --no-baseline --format json \
  >"$work/gemm-1t.json"
run dp2 2 --batch-size 4
run tp2 2 --tp 2 --batch-size 8
run dp2z 2 --zero 1 --batch-size 4
run pp2 2 --pp 2 --micro-batches 4 --batch-size 8
run dp4 4 --batch-size 2
run tp2dp2 4 --tp 2 --batch-size 4
run tp4 4 --tp 4 --batch-size 8
run pp2dp2 4 --pp 2 --micro-batches 2 --batch-size 4

rm -rf "$out"
mkdir -p "$out"
cp "$work/comm-1n2r.json" "$work/gemm-1t.json" "$out/"
for r in ref dp2 tp2 dp2z pp2 dp4 tp2dp2 tp4 pp2dp2; do
  mkdir -p "$out/$r"
  python3 - "$work/$r/metrics.jsonl" "$out/$r/metrics.jsonl" <<'PY'
import json, sys
src, dst = sys.argv[1], sys.argv[2]
out = []
for line in open(src):
    j = json.loads(line)
    if j.get("type") not in ("header", "step"):
        continue
    j.pop("timers_min", None)
    j.pop("timers_max", None)
    out.append(json.dumps(j, separators=(",", ":")))
open(dst, "w").write("\n".join(out) + "\n")
PY
done
echo "recorded $out ($(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores)" >&2
cargo test --release --locked --test predict_cli layouts_measured_here -- --nocapture

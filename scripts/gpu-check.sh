#!/usr/bin/env bash
# One call of the device tool, prepared by scripts/gpu-pack.sh: the GPU checks no CPU can do,
# then speed, most valuable first, inside a time budget (a session gets about 15 minutes of
# device time in all, the machine's start included):
#
#   run(command="bash scripts/gpu-check.sh", carry=["gpu"], timeout_s=570), then give_back
#
#   0. whether HEAD's kernels compile and load on this GPU (its NVRTC may be older than the
#      one here: a kernels.cu it refuses ends the call at once instead of every stage failing),
#   1. the CUDA tests (tests/cuda.rs on the GPU: every kernel against the CPU, cuBLASLt's
#      epilogues, the fused attention kernels, training against the CPU),
#  10. (run after stage 1: cheap, and what the attention kernels are measured by) attention
#      alone: `fugu bench attention` (every fused form and the three-step path, forward and
#      backward, each checked against the three steps, ms and TFLOP/s) on GPT-2 124M's and two
#      head-128 shapes, and PyTorch's scaled-dot-product attention (flash, efficient, cuDNN,
#      math) on the same shapes (dev/bench_attention.py); the fastest forms alone
#      (scripts/attention-best.py), whose settings stage 2 then times in the step as variants
#      (FUGU_GPU_ATTENTION_VARIANTS=0: not),
#   2. the train benchmark (GPT-2 124M, B=16 T=1024, bf16, `--timers coarse`) in two
#      alternating rounds over the variants: each gpu/base-*/ binary (older commits), HEAD,
#      HEAD under each setting of FUGU_GPU_VARIANTS (default below), and HEAD with
#      --loss-chunk FUGU_GPU_LOSS_CHUNK (default 4096; empty: not run),
#   3. PyTorch eager + autocast bf16 on the same shape (dev/bench_pytorch.py),
#   4. per-op breakdowns (fine timers: each op's ms, TFLOP/s and TB/s) of HEAD and with
#      32-row attention kernels,
#   5. the GPU mixed-precision tests (200-step bf16 and fp16 curves against fp32, exact
#      resume), 6. HEAD in fp16, 7. cuBLAS alone on GPT-2's GEMMs,
#   8. Nsight Compute's speed of light for the row and attention kernels (where ncu works),
#   9. Llama: llama-124m (each gpu/base-* binary against HEAD) and llama-d128 (B=8 T=2048,
#      heads of 128: fused attention, the _d128 kernels, against the three-step path, and
#      with the stored-dS backward on wgmma) in two rounds, and HEAD's breakdown of each.
#
# FUGU_GPU_STAGES picks stages (e.g. "1 2"; default all; stage 0 always runs), and
# FUGU_GPU_BREAKDOWN_ENV stage 4's second setting (default FUGU_FLASH_WARP_ROWS=32).
# Each stage runs under `timeout` within what is left of FUGU_GPU_BUDGET (seconds, default
# 540), so a hang costs its own stage only. Everything goes to $OUT/check.log; the benchmark
# rows are printed again as one table at the end (the device tool returns the output's tail).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
OUT="${OUT:-/tmp/fugu-gpu-check}"
mkdir -p "$OUT"
LOG="$OUT/check.log"
ROWS="$OUT/bench-rows.txt"
: > "$LOG"
: > "$ROWS"
BUDGET="${FUGU_GPU_BUDGET:-540}"
SHAPE="${FUGU_GPU_SHAPE:-16x1024}"
STEPS="${FUGU_GPU_STEPS:-10}"
# HEAD's speed settings to compare (environment assignments, space-separated per variant):
# each setting's other form, which checks its default (docs/TRAINING.md has the 2026-11-28 A/B
# on an H200; the one-kernel attention backward, 19% slower there, is left out).
# The LM head and loss in chunks of this many rows, timed in stage 2 (empty: not timed).
LOSS_CHUNK="${FUGU_GPU_LOSS_CHUNK-4096}"
VARIANTS="${FUGU_GPU_VARIANTS:-FUGU_MLP_GELU=separate;FUGU_LAYERNORM_BACKWARD=split;FUGU_RESIDUAL=separate;FUGU_BIAS_GRAD=epilogue;FUGU_FLASH_WARP_ROWS=32;FUGU_CROSS_ENTROPY=fused}"

# The stages to run (numbers, space-separated; default all): stage 0 always runs.
STAGES="${FUGU_GPU_STAGES:-1 10 2 3 4 5 6 7 8 9}"
# Stage 4's second breakdown: HEAD under these settings.
BREAKDOWN_ENV="${FUGU_GPU_BREAKDOWN_ENV:-FUGU_FLASH_WARP_ROWS=32}"

# shellcheck source=scripts/gpu-lib.sh
. scripts/gpu-lib.sh
# want N: whether stage N is asked for.
want() { [[ " $STAGES " == *" $1 "* ]]; }

[ -f gpu/MANIFEST ] || { say "no gpu/MANIFEST: run scripts/gpu-pack.sh here first and carry gpu"; exit 2; }
tee -a "$LOG" < gpu/MANIFEST

# CUDA 13 libraries from the Python wheels (cuBLAS, cuBLASLt, NVRTC), else wherever they are.
lib=$(python3 -c '
import glob, os, nvidia
for p in nvidia.__path__:
    d = os.path.join(p, "cu13", "lib")
    if glob.glob(os.path.join(d, "libcublasLt.so.13*")):
        print(d)
        break' 2>/dev/null)
[ -n "$lib" ] || lib=$(find / -name 'libcublasLt.so.13*' -printf '%h\n' 2>/dev/null | head -1)
if [ -n "$lib" ]; then
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    say "CUDA libraries: $lib"
else
    say "CUDA libraries: libcublasLt.so.13 not found; the runs below will say what is missing"
fi

# The test binaries run `fugu` and read data by the paths they were built at (gpu-pack.sh).
built_at=$(sed -n 's/^root: //p' gpu/MANIFEST)
if [ -n "$built_at" ] && [ "$built_at" != "$(pwd)" ] && [ ! -e "$built_at" ]; then
    mkdir -p "$(dirname "$built_at")" && ln -s "$(pwd)" "$built_at"
fi
mkdir -p target/release && cp gpu/head/fugu target/release/fugu

stage "device"
limited 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv
# Whether this machine has an MPI, and a CUDA-aware one (FUGU_CUDA_AWARE_MPI=auto asks
# Open MPI's MPIX_Query_cuda_support): what a later call could test the device buckets with.
if command -v mpirun >/dev/null; then
    say "MPI: $(mpirun --version 2>&1 | head -1); built with CUDA: $(ompi_info --parsable --all \
        2>/dev/null | sed -n 's/^mca:opal:base:param:opal_built_with_cuda_support:value://p')"
else
    say "MPI: no mpirun on this machine"
fi

stage "0. HEAD's kernels on this GPU"
limited 120 gpu/head/bench-train --device cuda --precision bf16 --shape 1x64 --steps 1 \
    --timers off > "$OUT/run.txt" 2>&1
rc=$?
if [ "$rc" -ne 0 ]; then
    tail -20 "$OUT/run.txt"
    say "HEAD does not run on this GPU (exit $rc; above): nothing else is worth this call's time"
    exit 1
fi
say "HEAD runs on this GPU"

if want 1; then
stage "1. CUDA tests on the GPU"
# (the compile and kernel-cache tests need NVRTC alone, no GPU: CI runs them)
limited 180 gpu/head/cuda-tests --skip kernels_compile --skip compiled_kernels_are_cached \
    --skip fused_attention_one_kernel_backward --skip wgmma --skip head_128 \
    --skip timed_attention_forms
say "cuda tests: exit $?"
# The head-128 kernels in their own process (first run on a GPU: 102 KB of dynamic shared
# memory each).
limited 60 gpu/head/cuda-tests head_128
say "head-128 attention test: exit $?"
# The one-kernel attention backward in its own process: its blocks wait for each other's
# turns, and a kernel that traps takes its process's CUDA context with it.
limited 60 gpu/head/cuda-tests fused_attention_one_kernel_backward
say "one-kernel attention backward test: exit $?"
# The warpgroup-MMA tests in their own (first run on a GPU: a wrong descriptor can fault, which
# also takes the context): the layouts alone, then the attention forward.
limited 60 gpu/head/cuda-tests wgmma_layouts
say "wgmma layouts test: exit $?"
limited 60 gpu/head/cuda-tests fused_attention_wgmma_forward
say "wgmma attention forward test: exit $?"
limited 60 gpu/head/cuda-tests fused_attention_wgmma_backward
say "wgmma attention backward test: exit $?"
# Timing every attention form runs the wgmma ones too.
limited 60 gpu/head/cuda-tests timed_attention_forms
say "timed attention forms test: exit $?"
limited 120 gpu/head/cuda-tests timed_and_wgmma_attention_forms_train_as_the_defaults
say "timed and wgmma training test: exit $?"
fi

if want 10; then
stage "10. attention alone: fugu's forms and the three-step path, then PyTorch SDPA, bf16"
# The warpgroup-MMA forms in a process of their own (their first run on a GPU: a kernel that
# faults takes its process's CUDA context, and the other forms' rows, with it).
limited 120 target/release/fugu bench attention --device cuda --set gpt2,llama --budget 0.3 \
    --rounds 3 --skip wgmma --format json > "$OUT/attention-sync.jsonl"
limited 60 target/release/fugu bench attention --device cuda --set gpt2,llama --budget 0.3 \
    --rounds 3 --only wgmma --format json > "$OUT/attention-wgmma.jsonl"
say "fastest fused forms (every row: $OUT/attention-*.jsonl):"
python3 scripts/attention-best.py "$OUT"/attention-*.jsonl 2>&1 | tee -a "$LOG"
# Stage 2 then times the step with the fastest forms (forward, backward, both) as variants.
if [ "${FUGU_GPU_ATTENTION_VARIANTS:-1}" = 1 ]; then
    best=$(python3 scripts/attention-best.py --variants gpt2-124m --known "$VARIANTS" \
        "$OUT"/attention-*.jsonl)
    [ -n "$best" ] && VARIANTS="$VARIANTS;$best" && say "stage 2 variants added: $best"
fi
PYTHONUNBUFFERED=1 limited 120 python3 dev/bench_attention.py --device cuda --set gpt2,llama \
    --budget 0.3 --rounds 3
fi

# bench LABEL BINARY [ENV...]: one run of the train benchmark (CONFIG, default gpt2-124m, at
# SHAPE, with BENCH_ARGS if set); its result row goes to $ROWS.
bench() {
    local label=$1 bin=$2
    shift 2
    say "--- $label"
    local config=${CONFIG:-gpt2-124m}
    # shellcheck disable=SC2086 # BENCH_ARGS is a list of arguments
    limited 90 env "$@" "$bin" --config "$config" --device cuda --precision "${PRECISION:-bf16}" \
        --shape "$SHAPE" --steps "$STEPS" --timers coarse ${BENCH_ARGS:-} > "$OUT/run.txt"
    local row
    row=$(grep -E "^$config +$SHAPE " "$OUT/run.txt" | head -1)
    cat "$OUT/run.txt"
    printf '%-44s %s\n' "$label" "${row:-(no result)}" >> "$ROWS"
}

if want 2; then
stage "2. train benchmark, bf16 $SHAPE, two rounds"
for round in 1 2; do
    for base in gpu/base-*; do
        [ -x "$base/bench-train" ] && bench "$(basename "$base") r$round" "$base/bench-train"
    done
    bench "head r$round" gpu/head/bench-train
    IFS=';' read -ra vs <<< "$VARIANTS"
    for v in "${vs[@]}"; do
        # shellcheck disable=SC2086 # a variant is a list of assignments
        bench "head $v r$round" gpu/head/bench-train $v
    done
    if [ -n "$LOSS_CHUNK" ]; then
        BENCH_ARGS="--loss-chunk $LOSS_CHUNK" bench "head --loss-chunk $LOSS_CHUNK r$round" \
            gpu/head/bench-train
    fi
done
fi

if want 3; then
stage "3. PyTorch eager, autocast bf16"
PYTHONUNBUFFERED=1 limited 120 python3 dev/bench_pytorch.py --device cuda --shape "$SHAPE" \
    --steps "$STEPS" --autocast bf16
fi

if want 4; then
stage "4. per-op breakdowns (fine timers): HEAD, and HEAD with $BREAKDOWN_ENV"
# (the attention timers show which of the three kernels gains or loses with 32 rows; each
# op's GFLOP/s and GB/s against the device's memory peak printed above the table show which
# is furthest from its limit)
limited 90 gpu/head/bench-train --device cuda --precision bf16 --shape "$SHAPE" \
    --steps "$STEPS" --breakdown
# shellcheck disable=SC2086 # a list of assignments
limited 90 env $BREAKDOWN_ENV gpu/head/bench-train --device cuda --precision bf16 \
    --shape "$SHAPE" --steps "$STEPS" --breakdown
fi

if want 5; then
stage "5. mixed-precision tests on the GPU (200-step curves, exact resume)"
limited 150 gpu/head/mp-tests gpu --test-threads 1
say "mixed-precision tests: exit $?"
fi

if want 6; then
stage "6. fp16"
PRECISION=fp16 bench "head fp16" gpu/head/bench-train
fi

if want 7; then
stage "7. cuBLAS alone on GPT-2's GEMMs, bf16"
limited 90 target/release/fugu bench gemm --device cuda --set gpt2 --dtype bf16
fi

if want 8; then
stage "8. Nsight Compute on the row and attention kernels of one step (where ncu works)"
# Speed of light per kernel (duration, DRAM and SM throughput as % of peak), averaged over the
# launches it profiles; the first matching launches (the warm-up step) are skipped.
limited 120 ncu --clock-control none --section SpeedOfLight --print-summary per-kernel \
    --kernel-name "regex:layernorm|column|ce_|gelu|residual|add_inplace|flash|adamw|sum_of" \
    --launch-skip 100 --launch-count 120 \
    gpu/head/bench-train --device cuda --precision bf16 --shape "$SHAPE" --steps 2 \
    --timers off > "$OUT/ncu.txt"
grep -E "^  [a-z_0-9]+|Duration|DRAM Throughput|Compute \(SM\) Throughput" "$OUT/ncu.txt" |
    head -150 | tee -a "$LOG"
fi

if want 9; then
stage "9. Llama: llama-124m bf16 $SHAPE (each gpu/base-* against HEAD), llama-d128 8x2048 fused against three-step"
# (the packed Llama row kernels against a base build's; the _d128 kernels' first run on a GPU:
# the attention timers of the two paths side by side)
for round in 1 2; do
    for base in gpu/base-*; do
        [ -x "$base/bench-train" ] &&
            CONFIG=llama-124m bench "$(basename "$base") llama-124m r$round" "$base/bench-train"
    done
    CONFIG=llama-124m bench "head llama-124m r$round" gpu/head/bench-train
    for path in fused materialized; do
        CONFIG=llama-d128 SHAPE=8x2048 bench "llama-d128 $path r$round" gpu/head/bench-train \
            FUGU_ATTENTION=$path
    done
    # The head-128 kernels on warpgroup MMA (the forward and the stored-dS backward).
    CONFIG=llama-d128 SHAPE=8x2048 bench "llama-d128 stored wgmma r$round" gpu/head/bench-train \
        FUGU_FLASH_BACKWARD=stored FUGU_FLASH_MMA=wgmma
done
limited 90 gpu/head/bench-train --config llama-124m --device cuda --precision bf16 \
    --shape "$SHAPE" --steps "$STEPS" --breakdown
limited 90 gpu/head/bench-train --config llama-d128 --device cuda --precision bf16 \
    --shape 8x2048 --steps "$STEPS" --breakdown
fi

stage "summary (median ms/step of $STEPS steps; config BxT ms/step tokens/s TFLOP/s MFU non-GEMM)"
tee -a "$LOG" < "$ROWS"
say ""
say "mean of the rounds per build and setting, against HEAD's:"
# A row: LABEL (ending in " rN" for a round), then the benchmark's "gpt2-124m BxT ms/step ...".
awk '
    { i = index($0, "gpt2-124m "); if (!i) next
      label = substr($0, 1, i - 1); sub(/ +$/, "", label); sub(/ r[0-9]+$/, "", label)
      split(substr($0, i), f, " "); ms[label] += f[3]; n[label]++
      if (!(label in ms_seen)) { ms_seen[label] = 1; order[++k] = label } }
    END { base = ("head" in ms) ? ms["head"] / n["head"] : 0
      for (j = 1; j <= k; j++) {
          l = order[j]; m = ms[l] / n[l]
          d = base ? sprintf("  %+6.1f%% vs head", (m / base - 1) * 100) : ""
          printf "%-44s %8.2f ms/step (%d runs)%s\n", l, m, n[l], d } }' "$ROWS" | tee -a "$LOG"
say "log: $LOG; $SECONDS s"

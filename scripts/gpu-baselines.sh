#!/usr/bin/env bash
# One device call: fugu against the strongest baselines on one GPU, GPT-2 124M B=16 T=1024,
# alternating in rounds so that clock and thermal drift fall on all of them alike:
#
#   run(command="bash scripts/gpu-baselines.sh", carry=["gpu"], timeout_s=560), then give_back
#
# (gpu/ from scripts/gpu-pack.sh; with FUGU_LLMC_SRC it also builds llm.c there, nvcc needing
# no GPU.) Per round, in each precision:
#   bf16:        fugu --precision bf16 | PyTorch compiled + autocast bf16 + fused AdamW | llm.c
#   fp32 strict: fugu                  | PyTorch compiled, fp32
#   TF32:        fugu --tf32           | PyTorch compiled, fp32 with TF32
# llm.c's train_gpt2cu (bf16, its default settings: recompute of GELU, fused classifier, TF32
# where fp32) is initialised from scratch (`-e d12`, no download) and fed random tokens in its
# shard format. The summary gives each one's median ms/step and MFU (989 TFLOP/s bf16
# dense, H100/H200 SXM; TF32 494.5; fp32 strict on CUDA cores 66.9), and fugu's ratio to each.
#
# The budget (FUGU_GPU_BUDGET, default 520 s) is shared: torch.compile's first step per
# precision takes ~1 minute and is not timed (--warmup 3).
#
# FUGU_GPU_CONFIG=llama-124m (or llama-d128, with FUGU_GPU_B/FUGU_GPU_T) times that config
# instead, fugu against the same Llama-family model in compiled PyTorch (no llm.c, which
# trains GPT-2 only; no MFU column, whose FLOP formula is GPT-2's: the ratios say it), and
# FUGU_GPU_PRECISIONS (default "bf16 fp32 tf32") picks the precisions.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
OUT="${OUT:-/tmp/fugu-gpu-baselines}"
mkdir -p "$OUT"
LOG="$OUT/baselines.log"
ROWS="$OUT/rows.txt"
: > "$LOG"
: > "$ROWS"
BUDGET="${FUGU_GPU_BUDGET:-520}"
B="${FUGU_GPU_B:-16}"
T="${FUGU_GPU_T:-1024}"
STEPS="${FUGU_GPU_STEPS:-10}"
ROUNDS="${FUGU_GPU_ROUNDS:-2}"
CONFIG="${FUGU_GPU_CONFIG:-gpt2-124m}"
PRECISIONS="${FUGU_GPU_PRECISIONS:-bf16 fp32 tf32}"

# shellcheck source=scripts/gpu-lib.sh
. scripts/gpu-lib.sh
# row LABEL MS: one result.
row() { printf '%-34s %s\n' "$1" "${2:-(no result)}" >> "$ROWS"; }

[ -x gpu/head/bench-train ] || { say "no gpu/head/bench-train: run scripts/gpu-pack.sh here first and carry gpu"; exit 2; }
nv=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null)
if [ -n "$nv" ] && [ -d "$nv/lib" ]; then
    export LD_LIBRARY_PATH="$nv/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
say "CUDA wheel directory: ${nv:-not found}"
limited 20 nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv

# llm.c: the binary gpu-pack.sh built (FUGU_LLMC_SRC), and random tokens in its shard format
# (a 256-int32 header: magic, version, count; then u16 tokens).
llmc=""
if [ -x gpu/llmc/train_gpt2cu ]; then
    llmc=gpu/llmc/train_gpt2cu
    python3 - "$OUT" <<'PY'
import random, struct, sys
out = sys.argv[1]
rng = random.Random(7)
for name, n in (("train", 4_000_000), ("val", 200_000)):
    with open(f"{out}/llmc_{name}.bin", "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, n, *([0] * 253)))
        f.write(struct.pack(f"<{n}H", *(rng.randrange(50257) for _ in range(n))))
PY
else
    say "llm.c: no gpu/llmc/train_gpt2cu (scripts/gpu-pack.sh with FUGU_LLMC_SRC builds it): skipped"
fi

fugu() { # LABEL ARGS...: the train benchmark, its median ms/step
    local label=$1
    shift
    limited 90 gpu/head/bench-train --config "$CONFIG" --device cuda --shape "${B}x${T}" \
        --steps "$STEPS" --timers coarse "$@" > "$OUT/run.txt"
    cat "$OUT/run.txt" >> "$LOG"
    row "$label" "$(ms_of "$OUT/run.txt")"
}
ms_of() { # FILE: the ms/step of CONFIG's row at BxT in a benchmark's output
    awk -v c="$CONFIG" -v s="${B}x${T}" '$1 == c && $2 == s { print $3; exit }' "$1"
}
torch_() { # LABEL ARGS...: dev/bench_pytorch.py --compile, its median ms/step
    local label=$1
    shift
    PYTHONUNBUFFERED=1 limited 150 python3 dev/bench_pytorch.py --device cuda --compile \
        --config "$CONFIG" --shape "${B}x${T}" --steps "$STEPS" "$@" > "$OUT/run.txt"
    cat "$OUT/run.txt" >> "$LOG"
    row "$label" "$(ms_of "$OUT/run.txt")"
}
llmc_() { # LABEL: llm.c's median step time over steps 4.. (its own timing per step)
    [ -n "$llmc" ] && [ "$CONFIG" = gpt2-124m ] || return 0
    limited 120 "$llmc" -i "$OUT/llmc_train.bin" -j "$OUT/llmc_val.bin" -e d12 -b "$B" -t "$T" \
        -x $((STEPS + 3)) -v 100000 -m 1 -s 0 -n 0 -c 0.1 -l 1e-4 > "$OUT/run.txt"
    cat "$OUT/run.txt" >> "$LOG"
    row "$1" "$(awk '/^step / { for (i = 1; i < NF; i++) if ($(i + 1) == "ms") print $i }' "$OUT/run.txt" |
        tail -n +4 | sort -g | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }')"
}

for r in $(seq 1 "$ROUNDS"); do
    say "=== round $r ($(left) s left)"
    for p in $PRECISIONS; do
        case $p in
        bf16)
            fugu "fugu bf16" --precision bf16
            torch_ "pytorch-compile bf16" --autocast bf16
            llmc_ "llm.c bf16" ;;
        fp32)
            fugu "fugu fp32" --precision fp32
            torch_ "pytorch-compile fp32" ;;
        tf32)
            fugu "fugu tf32" --precision fp32 --tf32
            torch_ "pytorch-compile tf32" --tf32 ;;
        *) say "unknown precision $p in FUGU_GPU_PRECISIONS (bf16, fp32, tf32)" ;;
        esac
    done
done

say ""
say "=== summary ($CONFIG ${B}x${T}): median ms/step per run; mean over rounds, MFU, fugu / baseline"
tee -a "$LOG" < "$ROWS"
awk -v b="$B" -v t="$T" -v c="$CONFIG" '
    function peak(l) { return l ~ /bf16/ ? 989e12 : (l ~ /tf32/ ? 494.5e12 : 66.9e12) }
    $NF ~ /^[0-9.]+$/ { l = $0; sub(/ +[0-9.]+$/, "", l); ms[l] += $NF; n[l]++; if (!(l in seen)) { seen[l] = 1; ord[++k] = l } }
    END {
        f = 72 * b * t * 12 * 768 * 768 * (1 + t / (6 * 768) + 50257 / (12 * 12 * 768))
        for (i = 1; i <= k; i++) { l = ord[i]; m = ms[l] / n[l]
            printf "%-34s %8.2f ms", l, m
            if (c == "gpt2-124m") printf "  MFU %5.1f%%", 100 * f / (m / 1e3) / peak(l)
            split(l, w, " "); p = w[2]; fl = "fugu " p
            if (l != fl && (fl in ms)) printf "  fugu is %.2fx", m / (ms[fl] / n[fl])
            printf "\n" } }' "$ROWS" | tee -a "$LOG"
say "log: $LOG; $SECONDS s"

#!/usr/bin/env bash
# One short device call: the CUDA tests, HEAD against each gpu/base-* (3 alternating rounds),
# HEAD's breakdown, the mixed-precision curves, fp16, ncu on the layernorm kernels.
set -uo pipefail
cd "$(dirname "$0")/.." || exit
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"; LOG="$OUT/final.log"; : > "$LOG"
lib=$(python3 -c 'import nvidia,os;print([os.path.join(p,"cu13","lib") for p in nvidia.__path__][0])')
export LD_LIBRARY_PATH="$lib"
built_at=$(sed -n 's/^root: //p' gpu/MANIFEST)
if [ -n "$built_at" ] && [ "$built_at" != "$(pwd)" ] && [ ! -e "$built_at" ]; then
    mkdir -p "$(dirname "$built_at")" && ln -s "$(pwd)" "$built_at"
fi
mkdir -p target/release && cp gpu/head/fugu target/release/fugu
say() { printf '%s\n' "$*" | tee -a "$LOG"; }
cat gpu/MANIFEST | tee -a "$LOG"
say "=== cuda tests $SECONDS"
timeout 150 gpu/head/cuda-tests --skip kernels_compile --skip compiled_kernels_are_cached 2>&1 | grep -E "^test |test result|panicked|^thread|error" | tee -a "$LOG"
A="--device cuda --precision bf16 --shape 16x1024 --steps 10 --timers coarse"
say "=== A/B $SECONDS"
for r in 1 2; do
  for b in gpu/base-*/bench-train gpu/head/bench-train; do
    row=$(timeout 60 $b $A 2>&1 | grep -E "^gpt2-124m")
    say "$(printf '%-32s r%s %s' "$b" "$r" "$row")"
  done
done
say "=== breakdown head $SECONDS"
timeout 60 gpu/head/bench-train --device cuda --precision bf16 --shape 16x1024 --steps 10 --breakdown 2>&1 | tail -45 | tee -a "$LOG"
say "=== breakdown base-79abc2b $SECONDS"
timeout 60 gpu/base-79abc2b/bench-train --device cuda --precision bf16 --shape 16x1024 --steps 10 --breakdown 2>&1 | grep -E "layernorm|loss|^step|^gpt2|clip|adamw" | tee -a "$LOG"
say "=== mixed-precision tests $SECONDS"
timeout 120 gpu/head/mp-tests gpu --test-threads 1 2>&1 | grep -E "^test |test result|panicked" | tee -a "$LOG"
say "=== fp16 $SECONDS"
timeout 60 gpu/head/bench-train --device cuda --precision fp16 --shape 16x1024 --steps 10 --timers coarse 2>&1 | grep -E "^gpt2|kernels|activations" | tee -a "$LOG"
say "=== ncu layernorm $SECONDS"
timeout 90 ncu --clock-control none --section SpeedOfLight --section Occupancy --kernel-name "regex:layernorm|ce_|column_finish" --launch-skip 60 --launch-count 12 gpu/head/bench-train --device cuda --precision bf16 --shape 16x1024 --steps 2 --timers off > "$OUT/ncu.txt" 2>&1
grep -E "^  [a-z_0-9]+ |Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers" "$OUT/ncu.txt" | tee -a "$LOG"
say "=== done $SECONDS"

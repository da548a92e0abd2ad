#!/usr/bin/env bash
# The training step quiet and beside a busy loop, fugu and PyTorch alternated in one run
# (issue 46, "speed under load"):
#
#   scripts/bench-under-load.sh [ROUNDS=3] [SHAPE=4x64]
#
# Each round times `cargo bench --bench train -- --threads 2 --shape SHAPE` quiet, then beside
# one `nice -n 19` busy loop, then the same for `dev/bench_pytorch.py` (when $FUGU_PYTHON, else
# python3, imports torch), and prints every median ms/step, the busy loop's CPU time during each
# loaded run, and each side's loaded/quiet ratio (median over rounds). The busy loop runs at the
# lowest priority, so a scheduler that favoured the benchmark fully would leave the step as it was
# quiet: the ratio measures how much of that is lost.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shape=${2:-4x64}
py=${FUGU_PYTHON:-python3}
cargo bench --bench train --no-run >/dev/null 2>&1
bench=(cargo bench -q --bench train -- --threads 2 --shape "$shape" --timers coarse)
torch=("$py" dev/bench_pytorch.py --threads 2 --shape "$shape")
have_torch=1
"$py" -c 'import torch' 2>/dev/null || { have_torch=0; echo "skipped: PyTorch ($py cannot import torch)"; }

# ms/step of one run: the row whose first column is the config and second the shape.
ms_of() { awk -v s="$shape" '$2 == s && $3 ~ /^[0-9.]+$/ { print $3; exit }'; }
hog_start() { nice -n 19 sh -c 'while :; do :; done' & hog=$!; sleep 0.3; }
hog_ms() { awk '{ print ($14 + $15) * 10 }' "/proc/$hog/stat"; }
hog_stop() { kill "$hog"; wait "$hog" 2>/dev/null || true; }

declare -A runs
for r in $(seq 1 "$rounds"); do
    for who in fugu torch; do
        [[ $who == torch && $have_torch == 0 ]] && continue
        if [[ $who == fugu ]]; then cmd=("${bench[@]}"); else cmd=("${torch[@]}"); fi
        quiet=$("${cmd[@]}" 2>/dev/null | ms_of)
        hog_start
        t0=$(hog_ms)
        loaded=$("${cmd[@]}" 2>/dev/null | ms_of)
        busy=$(($(hog_ms) - t0))
        hog_stop
        ratio=$(awk -v a="$loaded" -v b="$quiet" 'BEGIN { printf "%.3f", a / b }')
        printf 'round %d  %-5s quiet %8.1f ms  loaded %8.1f ms  (busy loop ran %5d ms)  loaded/quiet %s\n' \
            "$r" "$who" "$quiet" "$loaded" "$busy" "$ratio"
        runs[$who]+="$ratio "
    done
done
for who in fugu torch; do
    [[ -n ${runs[$who]:-} ]] || continue
    echo "$who loaded/quiet median over $rounds rounds: $(tr ' ' '\n' <<<"${runs[$who]}" | grep . | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')"
done

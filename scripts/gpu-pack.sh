#!/usr/bin/env bash
# Builds, on this machine, what one call of the GPU check (scripts/gpu-check.sh) runs, into
# gpu/ (ignored by git; the device tool carries it: `carry=["gpu"]`):
#
#   gpu/head/fugu, cuda-tests, mp-tests, bench-train   this checkout, release, --features cuda
#   gpu/base-<rev>/bench-train                         the train benchmark of each REV given
#   gpu/MANIFEST                                       what each binary was built from
#   gpu/llmc/train_gpt2cu                              llm.c, built here (FUGU_LLMC_SRC), for
#                                                      scripts/gpu-baselines.sh
#
#   scripts/gpu-pack.sh [REV ...]      # e.g. scripts/gpu-pack.sh 3fdd6f4
#
# A GPU machine has no Rust toolchain: everything is built here (no CUDA needed to build) and
# stripped. Each REV is built in its own worktree and target directory under
# FUGU_GPU_BUILD_DIR (default target/gpu-revs), so HEAD's build stays warm. The test binaries
# find the `fugu` binary and the repository by the absolute paths they were built at
# (CARGO_BIN_EXE_fugu, CARGO_MANIFEST_DIR): gpu-check.sh recreates them on the device.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_INCREMENTAL=0

root=$(pwd)
builds="${FUGU_GPU_BUILD_DIR:-$root/target/gpu-revs}"

# Executables that `cargo <args> --message-format=json` builds, one per line as "name path".
executables() {
    cargo "$@" --message-format=json |
        python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])'
}

# Copies $2 to $1, stripped of symbols (the test binaries carry ~100 MB of them).
put() {
    mkdir -p "$(dirname "$1")"
    strip -o "$1" "$2"
}

rm -rf gpu
mkdir -p gpu/head
echo "built $(date -u +%FT%TZ) on $(uname -m), $(git describe --always --dirty)" > gpu/MANIFEST
echo "root: $root" >> gpu/MANIFEST

cargo build --locked --release --features cuda --bin fugu
put gpu/head/fugu target/release/fugu
while read -r name path; do
    case "$name" in
        cuda) put gpu/head/cuda-tests "$path" ;;
        mixed_precision) put gpu/head/mp-tests "$path" ;;
    esac
done < <(executables test --locked --release --features cuda --test cuda --test mixed_precision --no-run)
while read -r name path; do
    [ "$name" = train ] && put gpu/head/bench-train "$path"
done < <(executables bench --locked --features cuda --bench train --no-run)
echo "head: $(git describe --always --dirty) ($(git log -1 --format=%s | cut -c1-80))" >> gpu/MANIFEST

for rev in "$@"; do
    sha=$(git rev-parse --short "$rev^{commit}")
    tree="$builds/$sha"
    if [ ! -d "$tree/src" ]; then
        git worktree add --force --detach "$tree" "$sha"
    fi
    while read -r name path; do
        [ "$name" = train ] && put "gpu/base-$sha/bench-train" "$path"
    done < <(cd "$tree" && CARGO_TARGET_DIR="$tree/target" executables bench --locked \
        --features cuda --bench train --no-run)
    echo "base-$sha: $(git log -1 --format=%s "$sha" | cut -c1-80)" >> gpu/MANIFEST
done

# llm.c's train_gpt2cu, the baseline of scripts/gpu-baselines.sh, built here (nvcc needs no
# GPU) for sm_90 (H100/H200) from FUGU_LLMC_SRC (a git repository of karpathy/llm.c, a bare
# snapshot will do, or a checkout), with the nvcc of FUGU_NVCC or of a Python's
# nvidia-cuda-nvcc wheel (plus nvidia-cuda-profiler-api's header). CUDA 13 takes a
# cudaMemLocation where llm.c (written for CUDA 12) passes cudaCpuDeviceId: patched in the copy.
if [ -n "${FUGU_LLMC_SRC:-}" ]; then
    src=$(mktemp -d)
    if git -C "$FUGU_LLMC_SRC" rev-parse --git-dir >/dev/null 2>&1; then
        git -C "$FUGU_LLMC_SRC" archive HEAD train_gpt2.cu llmc | tar -x -C "$src"
        llmc_rev=$(git -C "$FUGU_LLMC_SRC" log -1 --format=%h)
    else
        cp -r "$FUGU_LLMC_SRC/train_gpt2.cu" "$FUGU_LLMC_SRC/llmc" "$src/"
        llmc_rev="a checkout"
    fi
    sed -i 's/cudaMemAdviseSetPreferredLocation, cudaCpuDeviceId)/cudaMemAdviseSetPreferredLocation, cudaMemLocation{cudaMemLocationTypeHost, 0})/' \
        "$src/llmc/cuda_utils.cuh"
    nvcc="${FUGU_NVCC:-}"
    if [ -z "$nvcc" ]; then
        for py in python3 /opt/torchenv/bin/python; do
            d=$("$py" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null) || continue
            [ -x "$d/bin/nvcc" ] && nvcc="$d/bin/nvcc" && break
        done
    fi
    [ -n "$nvcc" ] || { echo "gpu-pack: FUGU_LLMC_SRC given but no nvcc (FUGU_NVCC, or pip install nvidia-cuda-nvcc nvidia-cuda-profiler-api)" >&2; exit 1; }
    nv=$(dirname "$(dirname "$nvcc")")
    mkdir -p gpu/llmc
    (cd "$src" && "$nvcc" -O3 -t=0 --use_fast_math -std=c++17 -DENABLE_BF16 \
        --generate-code "arch=compute_90,code=[compute_90,sm_90]" -I"$nv/include" -L"$nv/lib" \
        train_gpt2.cu -l:libcublas.so.13 -l:libcublasLt.so.13 -o "$root/gpu/llmc/train_gpt2cu")
    rm -rf "$src"
    echo "llmc: train_gpt2cu (bf16, sm_90) from $FUGU_LLMC_SRC at $llmc_rev, $("$nvcc" --version | tail -1)" >> gpu/MANIFEST
fi

for f in gpu/*/*; do
    [ -f "$f" ] || continue
    [ -x "$f" ] || { echo "gpu-pack: $f is not executable" >&2; exit 1; }
done
for f in fugu cuda-tests mp-tests bench-train; do
    [ -f "gpu/head/$f" ] || { echo "gpu-pack: gpu/head/$f was not built" >&2; exit 1; }
done
cat gpu/MANIFEST
du -sh gpu | awk '{ print "gpu/: " $1 " to carry (the device tool takes at most 64 MiB in all)" }'

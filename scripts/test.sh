#!/usr/bin/env bash
# The project's test command (README, CI): installs what it needs, then runs
#   1. formatting check,
#   2. the host test suite (x86-64: portable, AVX2 and AVX-512 kernels, driver, CLI),
#   2b. the MPI tests (`--features "mpi cuda"`, one build shared with 2c: dp, tp, tp x dp and
#       ZeRO-1 against one process, checkpoint resharding, failure on one rank) with Open MPI,
#   2c. the CUDA backend (same features): clippy, then tests/cuda.rs and the float64 golden
#       test on the CUDA backend: on a GPU when there is one, otherwise on the host emulator of
#       the device (src/backend/cuda/emu.rs); the kernels are also compiled by the real NVRTC
#       (installed by install-deps.sh, no GPU needed); the CUDA module's unit tests,
#   3. fugu-gemm and fugu-rows tests on aarch64 under QEMU (the kernels on the A64FX CPU model;
#      every test at 512, 128, 256 and 2048-bit SVE) and fugu's unit tests at 512 and 128,
#   4. the A64FX speed prediction of the SVE micro-kernels with llvm-mca (fails below 90%: the
#      f32 k loop, and the f16 kernel over whole chunks),
#   5. the batch job scripts (jobscripts/, docs/JOBS.md) for real: Slurm jobs submitted to a
#      local single-node Slurm (jobscripts/local-slurm.sh, needs root) and the pjsub scripts
#      under jobscripts/pjsub/local-pjsub.sh, with the MPI stage's build of fugu (its
#      features, no second build). Not root: skipped with a message.
# Skip stages with FUGU_TEST_SKIP="fmt host mpi cuda aarch64 mca jobs" (space-separated) for quick loops.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$HOME/.cargo/bin:$PATH"

# Disk: with full debuginfo and incremental state, one run left about 10 GB under target/
# (debug 6.8 GB of it: each test binary 90-240 MB) and CI failed once with "No space left on
# device" while linking. Line tables keep file:line in panics and backtraces; incremental state
# only pays off across edits, which a CI run never makes. With both, a fresh clone's run peaked
# at 4.4 GB (debug 2.3, aarch64 1.3, release 0.8) and took 1359 s instead of about 1500.
export CARGO_INCREMENTAL=0
export CARGO_PROFILE_DEV_DEBUG=line-tables-only
df -h . | awk 'NR == 2 { print "disk: " $4 " free on " $6 " before the build" }'

# Tests write their scratch folders under the temporary directory; a run gets its own, removed
# when everything passed (kept for a look when something failed). Repeated local runs had left
# 41 GB in /tmp.
export TMPDIR="$(mktemp -d "${TMPDIR:-/tmp}/fugu-test.XXXXXX")"
scratch_cleanup() {
  if [ "$1" -eq 0 ]; then rm -rf "$TMPDIR"; else echo "test scratch kept in $TMPDIR"; fi
}
trap 'scratch_cleanup $?' EXIT

skip() { case " ${FUGU_TEST_SKIP:-} " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
# Each stage's wall time, printed when it ends and again as a table at the end (CI must stay
# well under its 90-minute limit: see which stage to trim).
start=$(date +%s)
stage_name=""
stage_start=$start
stage_times=()
end_stage() {
  [ -n "$stage_name" ] || return 0
  local took=$(( $(date +%s) - stage_start ))
  printf '=== %s: %d s ===\n' "$stage_name" "$took"
  stage_times+=("$(printf '%6d s  %s' "$took" "$stage_name")")
  stage_name=""
}
stage() {
  end_stage
  stage_name="$*"
  stage_start=$(date +%s)
  printf '\n=== %s ===\n' "$*"
}

stage "dependencies"
scripts/install-deps.sh

if ! skip fmt; then
  stage "cargo fmt --check"
  cargo fmt --all -- --check
fi

if ! skip host; then
  stage "host tests ($(uname -m))"
  cargo test --workspace --locked -j2
fi

# The MPI and CUDA stages build fugu once, with both features (a second feature set would
# rebuild the crate, its binary and test harnesses: minutes on two cores), and without the
# Parquet/Arrow readers (`formats`, tested by the host stage), whose crates would otherwise be
# compiled again for this feature set.
parallel_features="mpi cuda"
no_formats="--no-default-features"

if ! skip mpi; then
  stage "MPI tests (mpirun -np 2 and 4 --oversubscribe)"
  # Open MPI refuses to run as root without these; CI runs as root.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  cargo test --locked -j2 $no_formats --features "$parallel_features" --test mpi_cli -- --test-threads 1
fi

if ! skip cuda; then
  stage "CUDA backend (--features \"$parallel_features\"; GPU tests skip without a GPU)"
  cargo clippy --locked -j2 $no_formats --features "$parallel_features" --all-targets -- -D warnings
  LD_LIBRARY_PATH="/opt/fugu-nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked -j2 $no_formats --features "$parallel_features" --test cuda --test model_golden
  # The CUDA module's own unit tests (its disk caches), which the host stage's build leaves out.
  cargo test --locked -j2 $no_formats --features "$parallel_features" --lib backend::cuda::
  # The kernels also under the oldest CUDA 13 NVRTC (13.0), as a GPU machine may have it.
  LD_LIBRARY_PATH="/opt/fugu-nvrtc-13.0/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    cargo test --locked -j2 $no_formats --features "$parallel_features" --test cuda -- kernels_compile_with_nvrtc
fi

if ! skip aarch64; then
  stage "aarch64 tests under QEMU"
  scripts/test-aarch64.sh
fi

if ! skip mca; then
  stage "A64FX prediction (llvm-mca)"
  scripts/predict-a64fx.sh
  # The f16 kernel over a whole chunk of its F16_CHUNK steps (k loop, zeroing, fold into f32),
  # chunks back to back; the build above is reused.
  f16_chunk=$(sed -n 's/^pub const F16_CHUNK: usize = \([0-9]*\);$/\1/p' gemm/src/kernel.rs)
  [ -n "$f16_chunk" ] || { echo "F16_CHUNK not found in gemm/src/kernel.rs" >&2; exit 1; }
  FUGU_MCA_FUNC=fugu_sve_hgemm_2vx10 FUGU_MCA_CHUNK="$f16_chunk" scripts/predict-a64fx.sh
fi

if ! skip jobs; then
  stage "batch job scripts: local Slurm and local pjsub"
  if [ "$(id -u)" -ne 0 ]; then
    echo "skipped: the job-script tests start a local Slurm (jobscripts/local-slurm.sh) and need root;"
    echo "         the unprivileged ones (shellcheck, directive lint, local-pjsub) ran with the host tests"
  else
    export LOCAL_SLURM_DIR=${LOCAL_SLURM_DIR:-/tmp/fugu-test-slurm}
    export LOCAL_SLURM_CPUS=${LOCAL_SLURM_CPUS:-4}
    # start first: it also installs Open MPI (libopenmpi-dev), which the MPI build needs
    jobscripts/local-slurm.sh start >/dev/null
    trap 'rc=$?; jobscripts/local-slurm.sh stop --purge >/dev/null 2>&1 || true; scratch_cleanup $rc' EXIT
    # The jobs run the fugu binary of the MPI and CUDA stages' build (same features, so only
    # this test file is compiled here; fugu itself is optimised in that profile: Cargo.toml).
    # A release build of its own cost about 240 s of this stage's 390.
    FUGU_SLURM_TESTS=1 cargo test --locked -j2 $no_formats --features "$parallel_features" \
      --test jobscripts
    jobscripts/local-slurm.sh stop --purge
    trap 'scratch_cleanup $?' EXIT
  fi
fi

end_stage
printf '\n=== stage times ===\n'
printf '%s\n' "${stage_times[@]}"
printf '\n=== all tests passed in %d s ===\n' "$(( $(date +%s) - start ))"

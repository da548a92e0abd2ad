#!/usr/bin/env bash
# Builds the tests of fugu-gemm (GEMM kernels) and fugu-rows (SVE row kernels) for aarch64 and
# runs them under QEMU at several SVE vector lengths.
#
#   scripts/test-aarch64.sh [extra cargo test args, e.g. `--test kernel_contract`]
#
# Recipe: shared docs AARCH64-TESTING.md. Debian's rustc (/usr/bin/rustc, with its aarch64 std)
# does the cross build, statically linked (+crt-static: dynamically linked binaries hang under
# qemu-user as soon as they start a second thread), into target/aarch64 so host builds are kept
# apart. Packages: scripts/install-deps.sh.
#
# Runs (each must pass):
#   qemu-aarch64 -cpu a64fx            the A64FX's own instruction set (SVE without SVE2, ...):
#                                      every kernel's contract (fugu-gemm tests/kernel_contract.rs),
#                                      fugu-gemm's unit tests (packing, peak loops) and the fugu-rows
#                                      tests, so an instruction the A64FX lacks fails here
#   qemu-aarch64 -cpu max,sve512=on    512-bit: every test, portable and SVE kernels
#   qemu-aarch64 -cpu max,sve128=on    128-bit: every test, SVE kernels
#   qemu-aarch64 -cpu max,sve256=on    256-bit: every test, SVE kernels
#   qemu-aarch64 -cpu max,sve2048=on   2048-bit: every test, SVE kernels
#   qemu-aarch64 -cpu max,sve512=on    with FUGU_GEMM_ISA=neon: every test, the NEON kernel (also
#                                      as the default runtime)
# The kernels pick their code by the `sve` and `neon` features alone, so `max` runs the code
# the A64FX runs; QEMU emulates the a64fx CPU model 2.5-5x slower (fugu's unit tests: 261 s
# against 52 s at 128 bits on `max`, on 2 Sapphire Rapids cores), so only the instruction-set
# check runs on it. Each `max` run also sets sve-default-vector-length (in bytes): qemu-user
# starts a process at that default (64 bytes = 512 bits), not at the largest enabled length, so
# `sve2048=on` alone runs at 512 bits. Each run checks the vector length the kernels see.
# Then fugu's own unit tests (`cargo test -p fugu --lib --no-default-features`, without the
# Parquet/Arrow readers, which have no SVE code and cost minutes to cross-compile: the ops with the SVE row kernels
# dispatched, the model, the checkpoints) at 512 and 128 bits (the sve512 and sve128 runs).
# The first of the two pays for cross-building them (about 370 s of its ~430 s on 2 Sapphire
# Rapids vCPUs: running only the ops and backend tests at 512 bits saved ~55 s, so every test
# runs at both lengths).
#
# Env: FUGU_QEMU_RUNS="a64fx sve512 ..." limits the runs (names: a64fx sve512 sve128 sve256
#      sve2048 neon); CARGO_BUILD_JOBS as usual (default 2 here). Each run prints its time.
set -euo pipefail

cd "$(dirname "$0")/.."

die() {
    echo "test-aarch64.sh: $*" >&2
    exit 1
}

[[ -x /usr/bin/rustc ]] || die "/usr/bin/rustc (Debian rustc-web) is missing; run scripts/install-deps.sh"
[[ -x /usr/bin/rustdoc ]] || die "/usr/bin/rustdoc (Debian rustc-web) is missing; run scripts/install-deps.sh"
command -v qemu-aarch64 >/dev/null || die "qemu-aarch64 is missing (apt-get install -t bookworm-backports qemu-user); run scripts/install-deps.sh"
command -v aarch64-linux-gnu-gcc >/dev/null || die "aarch64-linux-gnu-gcc is missing (gcc-aarch64-linux-gnu); run scripts/install-deps.sh"
libdir=$(/usr/bin/rustc --print target-libdir --target aarch64-unknown-linux-gnu 2>/dev/null || true)
if [[ -z "$libdir" ]] || ! compgen -G "$libdir/libstd-*.rlib" >/dev/null; then
    die "no aarch64 std for /usr/bin/rustc (libstd-rust-web-dev:arm64); run scripts/install-deps.sh"
fi

TARGET=aarch64-unknown-linux-gnu
export RUSTC=/usr/bin/rustc RUSTDOC=/usr/bin/rustdoc
export CARGO_TARGET_DIR=target/aarch64
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static"
# Doctests are linked by rustdoc, which does not see the target RUSTFLAGS.
export RUSTDOCFLAGS="-C target-feature=+crt-static -C linker=aarch64-linux-gnu-gcc"
# Debug code is very slow under QEMU; optimise the test profile (debug assertions stay on).
export CARGO_PROFILE_TEST_OPT_LEVEL=2
export CARGO_PROFILE_DEV_OPT_LEVEL=2
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
export FUGU_NUM_THREADS=2
export RUST_BACKTRACE=1

# The max runs stand in for the A64FX because the code chooses its kernels by the sve and neon
# features alone: code that detects another feature would run other code on max than on the
# A64FX, so it is refused here until its paths are tested on -cpu a64fx.
others=$(grep -rhoE 'is_aarch64_feature_detected!\("[a-z0-9_]+"\)' gemm/src rows/src src |
    grep -vE '"(sve|neon)"' | sort -u || true)
[[ -z "$others" ]] || die "the code detects CPU features other than sve and neon (${others//$'\n'/ }): the -cpu max runs would not run the A64FX's code paths; test them on -cpu a64fx"

echo "== building fugu-gemm and fugu-rows tests for $TARGET (rustc: $(/usr/bin/rustc --version))"
CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu a64fx" \
    cargo test -p fugu-gemm -p fugu-rows --target "$TARGET" "$@" --no-run

RUNS="${FUGU_QEMU_RUNS:-a64fx sve512 sve128 sve256 sve2048 neon}"
max512="max,sve512=on,sve-default-vector-length=64"
failed=()
for run in $RUNS; do
    run_start=$SECONDS
    isa_env=()
    # What the run tests (cargo test arguments, one suite per entry, split on spaces).
    suites=("-p fugu-gemm -p fugu-rows")
    case "$run" in
        # Each kernel runs on the A64FX CPU model in its contract test; the max runs test the
        # rest, each kernel once at 512 bits (portable and SVE; NEON in the neon run), the SVE
        # kernels again at the other vector lengths: the portable and NEON kernels do not
        # depend on it, and each run of all of them under QEMU costs minutes.
        a64fx) cpu="a64fx" bits=512 suites=("-p fugu-gemm --lib --test kernel_contract" "-p fugu-rows") ;;
        sve512) cpu="$max512" bits=512 isa_env=("FUGU_TEST_ISAS=portable,sve") ;;
        sve128) cpu="max,sve128=on,sve-default-vector-length=16" bits=128 isa_env=(FUGU_TEST_ISAS=sve) ;;
        sve256) cpu="max,sve256=on,sve-default-vector-length=32" bits=256 isa_env=(FUGU_TEST_ISAS=sve) ;;
        sve2048) cpu="max,sve2048=on,sve-default-vector-length=256" bits=2048 isa_env=(FUGU_TEST_ISAS=sve) ;;
        neon) cpu="$max512" bits=512 isa_env=(FUGU_GEMM_ISA=neon FUGU_TEST_ISAS=neon) ;;
        *) die "unknown run '$run' in FUGU_QEMU_RUNS" ;;
    esac
    runner="qemu-aarch64 -cpu $cpu"
    echo
    echo "== run '$run': $runner (SVE $bits bits)${isa_env[*]:+ ${isa_env[*]}}"
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$runner"
    # Show the vector length the kernels actually see.
    report=$(env "${isa_env[@]}" cargo test -q -p fugu-gemm --target "$TARGET" \
        --test kernel_contract -- --exact report_kernels --nocapture 2>&1 | grep '^kernel ' || true)
    if [[ -z "$report" ]]; then
        echo "   (could not run report_kernels)"
    else
        while IFS= read -r line; do echo "   $line"; done <<<"$report"
    fi
    if [[ "$run" != neon ]] && ! grep -q "vector length $bits bits" <<<"$report"; then
        echo "!! run '$run': expected an SVE kernel with a $bits-bit vector length" >&2
        failed+=("$run(vector length)")
    fi
    ok=1
    for suite in "${suites[@]}"; do
        # shellcheck disable=SC2086 # a suite is several arguments
        env "${isa_env[@]}" cargo test $suite --target "$TARGET" "$@" || ok=0
    done
    if ((ok)); then
        echo "== run '$run': passed in $((SECONDS - run_start)) s"
    else
        echo "!! run '$run': FAILED" >&2
        failed+=("$run")
    fi
done

for run in sve512 sve128; do
    [[ " $RUNS " == *" $run "* ]] || continue
    case "$run" in
        sve512) cpu="$max512" ;;
        sve128) cpu="max,sve128=on,sve-default-vector-length=16" ;;
    esac
    run_start=$SECONDS
    echo
    echo "== fugu unit tests, run '$run': qemu-aarch64 -cpu $cpu"
    if CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu" \
        cargo test -q -p fugu --lib --no-default-features --target "$TARGET" -- --test-threads 2; then
        echo "== fugu unit tests, run '$run': passed in $((SECONDS - run_start)) s"
    else
        echo "!! fugu unit tests, run '$run': FAILED" >&2
        failed+=("fugu-$run")
    fi
done

echo
if ((${#failed[@]})); then
    echo "test-aarch64.sh: FAILED runs: ${failed[*]}" >&2
    exit 1
fi
echo "test-aarch64.sh: all runs passed ($RUNS)"

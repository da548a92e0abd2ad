#!/usr/bin/env bash
# scripts/build-fugaku.sh: build fugu with MPI for Fugaku's A64FX compute nodes (docs/JOBS.md,
# "Building on Fugaku"). Not run by CI (there is no Fujitsu MPI there); CI only checks `bash -n`.
#
#   scripts/build-fugaku.sh              # on a compute node (native aarch64; the tested way)
#   scripts/build-fugaku.sh --cross      # on the x86 login node: cross-build (unverified)
#   scripts/build-fugaku.sh --check      # only check the tools and print what would run
#
# Native (a compute node, e.g. in `pjsub --interact -L node=1 -L rscgrp=int -L elapse=1:00:00`):
#   MPICC=mpifcc, so that rsmpi's build finds the Fujitsu MPI through `mpifcc -show` (Fugaku has
#   no `mpicc`); RUSTFLAGS="-C target-cpu=a64fx"; cargo build --release --features mpi.
# Cross (the login node): target aarch64-unknown-linux-gnu, MPICC=mpifccpx (the login node's
#   cross wrapper), mpifccpx as the linker, bindgen told the target. Nothing public confirms
#   that this links and runs: prefer the native build.
#
# Settings (environment):
#   MPICC            the MPI C wrapper (default: mpifcc native, mpifccpx cross)
#   LIBCLANG_PATH    folder with libclang.so for bindgen (rsmpi generates its MPI bindings with
#                    it); default: found with llvm-config, ldconfig, or a pip-installed
#                    `libclang` package (`python3 -m pip install --user libclang`)
#   FUGU_RUSTFLAGS   extra rustc flags (default "-C target-cpu=a64fx")
#   FUGU_FEATURES    cargo features (default "mpi")
#   CARGO_TARGET_DIR where cargo builds (default: target/ in the checkout)
# Exit status: 0 built (prints the binary's path), 2 a tool is missing (the message says which
# and where to get it), else cargo's.
set -euo pipefail
cd "$(dirname -- "$0")/.."

mode=native
check=0
for a in "$@"; do
  case "$a" in
    --cross) mode=cross ;;
    --native) mode=native ;;
    --check) check=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-fugaku: unknown argument '$a' (--native, --cross, --check)" >&2; exit 2 ;;
  esac
done

die() { printf 'build-fugaku: ERROR: %s\n' "$*" >&2; exit 2; }
say() { printf 'build-fugaku: %s\n' "$*" >&2; }

arch=$(uname -m)
if [ "$mode" = native ] && [ "$arch" != aarch64 ]; then
  die "this is a $arch machine: build natively on an A64FX compute node (pjsub --interact ...), or pass --cross on the login node (unverified)"
fi

# --- Rust
export PATH="$HOME/.cargo/bin:$PATH"
command -v cargo >/dev/null 2>&1 ||
  die "cargo not found: install Rust with rustup into your home or data volume (https://rustup.rs; the login nodes reach the internet, compute nodes may not), then run this again"

# --- the MPI wrapper
if [ "$mode" = native ]; then : "${MPICC:=mpifcc}"; else : "${MPICC:=mpifccpx}"; fi
command -v "$MPICC" >/dev/null 2>&1 ||
  die "$MPICC not found in PATH: it is the Fujitsu MPI C wrapper ($( [ "$mode" = native ] && echo 'compute node: mpifcc' || echo 'login node, cross: mpifccpx')); is the Fujitsu compiler environment (tcsds) in PATH? Set MPICC to its full path"
show=$("$MPICC" -show 2>/dev/null || true)
case " $show " in
  *" -lmpi"*) ;;
  *)
    # rsmpi reads `$MPICC -show`; Open MPI-based wrappers also know -showme.
    show2=$("$MPICC" -showme 2>/dev/null || true)
    case " $show2 " in
      *" -lmpi"*) die "'$MPICC -show' names no MPI library but '-showme' does ($show2): rsmpi only reads -show; write a pkg-config file with those -I/-L/-l flags and set MPI_PKG_CONFIG=/path/to/it.pc" ;;
      *) die "'$MPICC -show' printed no -lmpi (got: '${show:-nothing}'): rsmpi cannot find the MPI library from it; check MPICC, or give the flags as a pkg-config file in MPI_PKG_CONFIG" ;;
    esac ;;
esac
export MPICC
say "MPICC=$MPICC: $show"

# --- libclang for bindgen
find_libclang() {
  local d
  if command -v llvm-config >/dev/null 2>&1; then
    d=$(llvm-config --libdir 2>/dev/null || true)
    if [ -n "$d" ] && compgen -G "$d/libclang*.so*" >/dev/null; then echo "$d"; return 0; fi
  fi
  d=$(ldconfig -p 2>/dev/null | awk '/libclang(-[0-9.]+)?\.so/ {print $NF; exit}')
  if [ -n "$d" ]; then dirname -- "$d"; return 0; fi
  if command -v python3 >/dev/null 2>&1; then
    d=$(python3 -c 'import clang, os; p = os.path.join(os.path.dirname(clang.__file__), "native"); print(p if os.path.isdir(p) else "")' 2>/dev/null || true)
    if [ -n "$d" ] && compgen -G "$d/libclang*.so*" >/dev/null; then echo "$d"; return 0; fi
  fi
  return 1
}
if [ -n "${LIBCLANG_PATH:-}" ]; then
  compgen -G "$LIBCLANG_PATH/libclang*.so*" >/dev/null || die "LIBCLANG_PATH=$LIBCLANG_PATH holds no libclang*.so"
else
  LIBCLANG_PATH=$(find_libclang) ||
    die "no libclang found for bindgen (rsmpi needs it): load an LLVM (e.g. a Spack 'llvm' package: spack load llvm), or 'python3 -m pip install --user libclang' (a wheel with libclang.so for $( [ "$mode" = native ] && echo aarch64 || echo x86_64)), or set LIBCLANG_PATH to a folder with libclang.so"
fi
export LIBCLANG_PATH
say "LIBCLANG_PATH=$LIBCLANG_PATH"

# --- the build
features=${FUGU_FEATURES-mpi}
export RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }${FUGU_RUSTFLAGS--C target-cpu=a64fx}"
cmd=(cargo build --release ${features:+--features "$features"})
if [ "$mode" = cross ]; then
  target=aarch64-unknown-linux-gnu
  if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    die "the Rust standard library for $target is not installed: rustup target add $target"
  fi
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=$MPICC
  export CC_aarch64_unknown_linux_gnu=${CC_aarch64_unknown_linux_gnu:-fccpx}
  export BINDGEN_EXTRA_CLANG_ARGS="${BINDGEN_EXTRA_CLANG_ARGS:+$BINDGEN_EXTRA_CLANG_ARGS }--target=$target"
  cmd+=(--target "$target")
  bin=${CARGO_TARGET_DIR:-target}/$target/release/fugu
  say "cross-building for $target with $MPICC as the linker (unverified on Fugaku)"
else
  bin=${CARGO_TARGET_DIR:-target}/release/fugu
fi
say "RUSTFLAGS=$RUSTFLAGS"
say "${cmd[*]}"
if [ "$check" = 1 ]; then
  say "--check: tools found; not building"
  exit 0
fi
"${cmd[@]}"
[ -x "$bin" ] || die "cargo finished but $bin is not there"
say "built $bin; the job scripts use it as FUGU_BIN (default: \$FUGU_HOME/target/release/fugu)"
echo "$bin"

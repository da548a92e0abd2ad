#!/usr/bin/env bash
# Installs what the test suite needs on Debian 12, idempotently: the aarch64 cross toolchain
# (Debian's rustc-web with its arm64 std, gcc-aarch64-linux-gnu), QEMU user mode from
# bookworm-backports, llvm-14 (llvm-mca, llvm-objdump), python3, Open MPI with its headers and
# libclang (for the `mpi` feature: rsmpi generates its bindings with bindgen) and shellcheck
# (job scripts), and NVRTC (CUDA 13, from PyPI's nvidia-cuda-nvrtc wheel, into
# /opt/fugu-nvrtc) so the `cuda` feature's kernels are compiled by the real NVRTC without a GPU.
# (Slurm and munge for the job-script tests come from jobscripts/local-slurm.sh.)
# Run as root (CI) or with sudo. Already-installed packages are not touched, so a second run
# takes well under a second.
set -euo pipefail

need=()
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

for p in rustc-web libstd-rust-web-dev:arm64 gcc-aarch64-linux-gnu libc6-dev-arm64-cross llvm-14 python3 libopenmpi-dev openmpi-bin libclang-dev shellcheck; do
  have "$p" || need+=("$p")
done
need_qemu=0
command -v qemu-aarch64 >/dev/null 2>&1 || need_qemu=1

# NVRTC needs no GPU; the wheel is 58 MB. Not fatal: without it the NVRTC test says "skipped".
# Two of them: the newest CUDA 13 (/opt/fugu-nvrtc) and the oldest (13.0, /opt/fugu-nvrtc-13.0),
# which a GPU machine's CUDA 13 image may carry and which refuses source the newer one takes
# (a generic lambda inside a kernel compiled with 13.5 and failed on an H200's NVRTC).
install_nvrtc() {  # DIR SPEC
  local dir=$1 spec=$2
  if [ ! -e "$dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    if python3 -m pip install -q --no-deps --target "$dir" "$spec" 2>&1 | tail -3; then
      [ -e "$dir/nvidia/cu13/lib/libnvrtc.so.13" ] && echo "install-deps: NVRTC ($spec) in $dir"
    fi
    [ -e "$dir/nvidia/cu13/lib/libnvrtc.so.13" ] || echo "install-deps: warning: could not install NVRTC ($spec) from PyPI; the kernel compile test with it will be skipped"
  fi
}
install_nvrtc /opt/fugu-nvrtc "nvidia-cuda-nvrtc>=13,<14"
install_nvrtc /opt/fugu-nvrtc-13.0 "nvidia-cuda-nvrtc==13.0.88"

if [ ${#need[@]} -eq 0 ] && [ $need_qemu -eq 0 ]; then
  echo "install-deps: everything already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install-deps: missing ${need[*]} (and qemu-user); run as root" >&2; exit 1; }
  SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive

if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $SUDO dpkg --add-architecture arm64
fi
bp=/etc/apt/sources.list.d/backports.list
if ! grep -qs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null; then
  echo "deb http://deb.debian.org/debian bookworm-backports main" | $SUDO tee "$bp" >/dev/null
fi
echo "install-deps: installing ${need[*]} $( [ $need_qemu -eq 1 ] && echo qemu-user)"
$SUDO apt-get update -qq
if [ ${#need[@]} -gt 0 ]; then
  $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ $need_qemu -eq 1 ]; then
  $SUDO apt-get install -y -qq -t bookworm-backports qemu-user >/dev/null
fi
echo "install-deps: done"

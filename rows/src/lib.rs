//! Row kernels written by hand for instruction sets that fugu's portable loops do not reach.
//!
//! fugu's non-GEMM operations (`src/ops/`) are plain loops that the compiler vectorises for
//! the build target, and `ops::row_isa` compiles them again for AVX2 and AVX-512 and picks one
//! at start-up. That does not work for SVE: under LLVM's generic aarch64 tuning a function with
//! `#[target_feature(enable = "sve")]` keeps 128-bit NEON vectors, and even the A64FX build
//! (`-C target-cpu=a64fx`) leaves the exponential as one long dependency chain per vector. This
//! crate holds the SVE versions, written as `asm!` (SVE intrinsics are not stable in Rust),
//! vector-length agnostic, tested under QEMU at 128 to 2048 bits like fugu-gemm's kernels
//! (`scripts/test-aarch64.sh`), and predicted for A64FX with llvm-mca
//! (`scripts/predict-a64fx-rows.sh`).
//!
//! The arithmetic differs from the portable loops where SVE has a faster way (the `fexpa`
//! exponential, fused multiply-adds, reciprocal estimates refined by Newton steps, a lane
//! structure that follows the vector length), so results agree with them to a few ulp, not bit
//! for bit; each kernel's bound is stated on it and tested against an f64 reference.
//!
//! On other architectures the crate is empty.

#[cfg(target_arch = "aarch64")]
pub mod sve;

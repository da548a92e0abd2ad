//! # fugu-gemm
//!
//! A BLIS-style single-precision GEMM library for CPUs with many cores in several NUMA domains
//! (the four CMGs of a Fujitsu A64FX, the CCDs of an AMD EPYC), with strided-batched and
//! pointer-array batched GEMM for attention.
//!
//! * Data enters through strided views ([`MatRef`], [`MatMut`], [`BatchRef`], [`BatchMut`]):
//!   any row and column stride, so transposes and sub-matrices are free. Views are checked when
//!   built; a GEMM on mismatched shapes returns a [`GemmError`] and never touches memory it
//!   should not.
//! * One micro-kernel per ISA (SVE, NEON, AVX-512, AVX2+FMA, portable Rust), chosen once at run
//!   time; `FUGU_GEMM_ISA` forces one. The kernel contract is in `docs/KERNELS.md`.
//! * Low precision ([`Runtime::at`], [`Precision`]): bf16 and f16 GEMMs with f32 C, on
//!   `f32` views or on `half::f16`/`half::bf16` views ([`Element`]); native kernels where the
//!   CPU has them (AVX-512 BF16, SVE f16 with f16 chunks), the f32 kernel on rounded operands
//!   elsewhere.
//! * Threads are grouped by NUMA domain (one team of pinned workers per domain, from sysfs, or
//!   simulated with `FUGU_CMGS=4x12`). Large GEMMs split across domains; batched GEMMs hand
//!   whole problems to domains and threads by cost.
//!
//! ```
//! use fugu_gemm::{gemm, MatMut, MatRef};
//! let a = vec![1.0f32; 6]; // 2x3
//! let b = vec![2.0f32; 12]; // 3x4
//! let mut c = vec![0.0f32; 8]; // 2x4
//! gemm(
//!     1.0,
//!     MatRef::row_major(&a, 2, 3).unwrap(),
//!     MatRef::row_major(&b, 3, 4).unwrap(),
//!     0.0,
//!     MatMut::row_major(&mut c, 2, 4).unwrap(),
//! )
//! .unwrap();
//! assert_eq!(c, vec![6.0; 8]);
//! ```

pub mod arch;
pub mod convert;
mod error;
pub mod kernel;
pub mod precision;
mod view;

pub use error::GemmError;
pub use half;
pub use kernel::{Isa, Kernel, Operand};
pub use precision::{Element, Precision};
pub use view::{BatchMut, BatchRef, MatMut, MatRef};
mod blocking;
mod buffer;
mod driver;
mod into;
mod pack;
pub mod peak;
mod raw;
pub mod reference;
mod runtime;
mod team;
pub mod topology;

pub use blocking::{Blocking, CacheInfo};
pub use driver::SplitMode;
pub use runtime::{PrecisionGemm, Runtime, RuntimeConfig, Start};
pub use topology::{Topology, TopologyRequest};

/// `C := alpha·A·B + beta·C` on the process-wide runtime ([`Runtime::global`]).
///
/// A is m×k, B is k×n, C is m×n, each with any strides. When `beta == 0`, C is not read.
pub fn gemm(
    alpha: f32,
    a: MatRef<'_, f32>,
    b: MatRef<'_, f32>,
    beta: f32,
    c: MatMut<'_, f32>,
) -> Result<(), GemmError> {
    Runtime::global()?.gemm(alpha, a, b, beta, c)
}

/// Strided batched GEMM (`baddbmm`/`bmm`) on the process-wide runtime.
pub fn gemm_strided_batched(
    alpha: f32,
    a: BatchRef<'_, f32>,
    b: BatchRef<'_, f32>,
    beta: f32,
    c: BatchMut<'_, f32>,
) -> Result<(), GemmError> {
    Runtime::global()?.gemm_strided_batched(alpha, a, b, beta, c)
}

/// Pointer-array batched GEMM on the process-wide runtime.
pub fn gemm_batched(
    alpha: f32,
    a: &[MatRef<'_, f32>],
    b: &[MatRef<'_, f32>],
    beta: f32,
    c: &mut [MatMut<'_, f32>],
) -> Result<(), GemmError> {
    Runtime::global()?.gemm_batched(alpha, a, b, beta, c)
}

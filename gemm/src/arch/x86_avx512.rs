//! x86-64 AVX-512F micro-kernel: a 32 × 12 tile in 24 zmm accumulators.
//!
//! Per k step: two 16-float loads of Ã, twelve broadcasts of B̃ (folded into the FMAs as
//! embedded-broadcast memory operands by the compiler) and 24 FMAs. Zen 4 retires one 512-bit
//! FMA per cycle per core (two 256-bit pipes), so the 24 independent accumulators cover its
//! 4-cycle FMA latency six times over and leave registers for the A operands.

use crate::kernel::{Isa, KernelF32};
use std::arch::x86_64::*;

const MR: usize = 32;
const NR: usize = 12;

/// The AVX-512 kernel, if this CPU has AVX-512F.
pub fn kernel() -> Option<KernelF32> {
    is_x86_feature_detected!("avx512f").then_some(KernelF32 {
        isa: Isa::Avx512,
        mr: MR,
        nr: NR,
        func: kernel_32x12,
    })
}

/// # Safety
/// The caller upholds the contract in `docs/KERNELS.md` for `mr = 32`, `nr = 12`, and the CPU
/// supports AVX-512F (checked by [`kernel`]).
unsafe fn kernel_32x12(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: forwarded contract; `kernel` only hands this out when avx512f is present.
    unsafe { inner(k, alpha, a, b, beta, c, ldc) }
}

#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn inner(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; NR];
    // Warm the C tile while the k loop runs; it is read or written at the end.
    for j in 0..NR {
        // SAFETY: prefetch is a hint and never faults; the address is inside the C tile.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(c.add(j * ldc) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(c.add(j * ldc + 16) as *const i8);
        }
    }
    let (mut ap, mut bp) = (a, b);
    for _ in 0..k {
        // SAFETY: the contract guarantees k*MR floats at `a` and k*NR floats at `b`; each
        // iteration reads one MR-column of Ã and one NR-row of B̃ and advances past them.
        unsafe {
            let a0 = _mm512_loadu_ps(ap);
            let a1 = _mm512_loadu_ps(ap.add(16));
            for (j, accj) in acc.iter_mut().enumerate() {
                let bj = _mm512_set1_ps(*bp.add(j));
                accj[0] = _mm512_fmadd_ps(a0, bj, accj[0]);
                accj[1] = _mm512_fmadd_ps(a1, bj, accj[1]);
            }
            ap = ap.add(MR);
            bp = bp.add(NR);
        }
    }
    let va = _mm512_set1_ps(alpha);
    let vb = _mm512_set1_ps(beta);
    for (j, accj) in acc.iter().enumerate() {
        for (h, &v) in accj.iter().enumerate() {
            // SAFETY: column j of the tile is c[j*ldc .. j*ldc + MR], inside the C view.
            unsafe {
                let p = c.add(j * ldc + 16 * h);
                let r = if beta == 0.0 {
                    _mm512_mul_ps(va, v)
                } else {
                    _mm512_fmadd_ps(vb, _mm512_loadu_ps(p), _mm512_mul_ps(va, v))
                };
                _mm512_storeu_ps(p, r);
            }
        }
    }
}

//! x86-64 AVX2+FMA micro-kernel: a 16 × 6 tile in 12 ymm accumulators (2 A vectors and one
//! broadcast register complete the 16 ymm registers).

use crate::kernel::{Isa, KernelF32};
use std::arch::x86_64::*;

const MR: usize = 16;
const NR: usize = 6;

/// The AVX2 kernel, if this CPU has AVX2 and FMA.
pub fn kernel() -> Option<KernelF32> {
    (is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")).then_some(KernelF32 {
        isa: Isa::Avx2,
        mr: MR,
        nr: NR,
        func: kernel_16x6,
    })
}

/// # Safety
/// The caller upholds the contract in `docs/KERNELS.md` for `mr = 16`, `nr = 6`, and the CPU
/// supports AVX2 and FMA (checked by [`kernel`]).
unsafe fn kernel_16x6(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: forwarded contract; `kernel` only hands this out when avx2+fma are present.
    unsafe { inner(k, alpha, a, b, beta, c, ldc) }
}

#[target_feature(enable = "avx2,fma")]
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
    let mut acc = [[_mm256_setzero_ps(); 2]; NR];
    let (mut ap, mut bp) = (a, b);
    for _ in 0..k {
        // SAFETY: the contract guarantees k*MR floats at `a` and k*NR floats at `b`.
        unsafe {
            let a0 = _mm256_loadu_ps(ap);
            let a1 = _mm256_loadu_ps(ap.add(8));
            for (j, accj) in acc.iter_mut().enumerate() {
                let bj = _mm256_broadcast_ss(&*bp.add(j));
                accj[0] = _mm256_fmadd_ps(a0, bj, accj[0]);
                accj[1] = _mm256_fmadd_ps(a1, bj, accj[1]);
            }
            ap = ap.add(MR);
            bp = bp.add(NR);
        }
    }
    let va = _mm256_set1_ps(alpha);
    let vb = _mm256_set1_ps(beta);
    for (j, accj) in acc.iter().enumerate() {
        for (h, &v) in accj.iter().enumerate() {
            // SAFETY: column j of the tile is c[j*ldc .. j*ldc + MR], inside the C view.
            unsafe {
                let p = c.add(j * ldc + 8 * h);
                let r = if beta == 0.0 {
                    _mm256_mul_ps(va, v)
                } else {
                    _mm256_fmadd_ps(vb, _mm256_loadu_ps(p), _mm256_mul_ps(va, v))
                };
                _mm256_storeu_ps(p, r);
            }
        }
    }
}

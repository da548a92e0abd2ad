//! x86-64 AVX-512F micro-kernels: a 32 × 12 tile in 24 zmm accumulators, for `f32` and for
//! `bf16` pairs.
//!
//! f32, per k step: two 16-float loads of Ã, twelve broadcasts of B̃ (folded into the FMAs as
//! embedded-broadcast memory operands by the compiler) and 24 FMAs. Zen 4 retires one 512-bit
//! FMA per cycle per core (two 256-bit pipes), so the 24 independent accumulators cover its
//! 4-cycle FMA latency six times over and leave registers for the A operands.
//!
//! bf16 (AVX512_BF16), per k *pair*: the same two loads and twelve 32-bit broadcasts, now of
//! bf16 pairs ([`Operand::Bf16Pairs`]), and 24 `vdpbf16ps`, each of which adds two products per
//! lane (`acc += a[2i]·b[2i] + a[2i+1]·b[2i+1]`, fp32 accumulation): twice the multiply-adds of
//! an FMA for the same register traffic. The same tile and epilogue as f32, so the blocking
//! derived for f32 words fits (a word is one f32 or one bf16 pair). `vdpbf16ps` flushes
//! denormal inputs and outputs to zero and ignores MXCSR (Intel SDM); nothing in a GPT's
//! operands lives in bf16's denormal range (below 1.2e-38).

use crate::kernel::{Accumulation, Isa, Kernel, Operand, Side};
use std::arch::x86_64::*;

const MR: usize = 32;
const NR: usize = 12;

/// The AVX-512 kernel, if this CPU has AVX-512F.
pub fn kernel() -> Option<Kernel> {
    is_x86_feature_detected!("avx512f").then_some(Kernel {
        operand: Operand::F32,
        accumulation: Accumulation::F32,
        isa: Isa::Avx512,
        mr: MR,
        nr: NR,
        l1_panel: Side::B,
        func: kernel_32x12,
    })
}

/// The AVX-512 BF16 kernel, if this CPU has AVX-512F and AVX512_BF16.
pub fn bf16_kernel() -> Option<Kernel> {
    (is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")).then_some(
        Kernel {
            operand: Operand::Bf16Pairs,
            accumulation: Accumulation::F32,
            isa: Isa::Avx512,
            mr: MR,
            nr: NR,
            l1_panel: Side::B,
            func: kernel_bf16_32x12,
        },
    )
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
    prefetch_tile(c, ldc);
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
    // SAFETY: forwarded contract (the C tile).
    unsafe { store_tile(&acc, alpha, beta, c, ldc) }
}

/// # Safety
/// The caller upholds the contract in `docs/KERNELS.md` for `mr = 32`, `nr = 12` with packed
/// words holding bf16 pairs (`k` counts pairs), and the CPU supports AVX-512F and AVX512_BF16
/// (checked by [`bf16_kernel`]).
unsafe fn kernel_bf16_32x12(
    kp: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: forwarded contract; `bf16_kernel` only hands this out when both features exist.
    unsafe { inner_bf16(kp, alpha, a as *const u32, b as *const u32, beta, c, ldc) }
}

#[target_feature(enable = "avx512f,avx512bf16")]
#[inline]
unsafe fn inner_bf16(
    kp: usize,
    alpha: f32,
    a: *const u32,
    b: *const u32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; NR];
    prefetch_tile(c, ldc);
    let (mut ap, mut bp) = (a, b);
    for _ in 0..kp {
        // SAFETY: the contract guarantees kp*MR words at `a` and kp*NR words at `b`; each
        // iteration reads one MR-column of Ã pairs and one NR-row of B̃ pairs and advances past
        // them. A word of two bf16 is a lane of a 512-bit bf16 vector as `vdpbf16ps` reads it
        // (element 2i in the low half of dword i), so the casts only rename bits.
        unsafe {
            let a0: __m512bh = std::mem::transmute(_mm512_loadu_si512(ap as *const __m512i));
            let a1: __m512bh =
                std::mem::transmute(_mm512_loadu_si512(ap.add(16) as *const __m512i));
            for (j, accj) in acc.iter_mut().enumerate() {
                let bj: __m512bh = std::mem::transmute(_mm512_set1_epi32(*bp.add(j) as i32));
                accj[0] = _mm512_dpbf16_ps(accj[0], a0, bj);
                accj[1] = _mm512_dpbf16_ps(accj[1], a1, bj);
            }
            ap = ap.add(MR);
            bp = bp.add(NR);
        }
    }
    // SAFETY: forwarded contract (the C tile).
    unsafe { store_tile(&acc, alpha, beta, c, ldc) }
}

/// Warms the C tile while the k loop runs; it is read or written at the end.
#[inline(always)]
fn prefetch_tile(c: *mut f32, ldc: usize) {
    for j in 0..NR {
        let col = c.wrapping_add(j * ldc);
        // SAFETY: prefetch is a hint and never faults, whatever the address.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(col as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(col.wrapping_add(16) as *const i8);
        }
    }
}

/// The shared epilogue: `C := alpha·acc + beta·C` over the 32 × 12 tile (C not read when
/// `beta == 0`).
///
/// # Safety
/// `c` is the tile of the kernel contract (column j at `c[j*ldc .. j*ldc + MR]`) and the CPU
/// supports AVX-512F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_tile(acc: &[[__m512; 2]; NR], alpha: f32, beta: f32, c: *mut f32, ldc: usize) {
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

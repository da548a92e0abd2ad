//! aarch64 Advanced SIMD (NEON) f32 micro-kernel, written with the stable
//! `std::arch::aarch64` intrinsics.
//!
//! Tile: `mr = 16` rows (4 q registers) by `nr = 6` columns: 24 q accumulators, 4 q registers
//! for the A column and the 6 B values in one q and one d register, used through by-element
//! FMLA (`vfmaq_laneq_f32`): 30 of the 32 registers, no spills. By-element FMLA runs at full
//! rate on the Neoverse/Cortex cores this kernel is for (aarch64 without SVE). LLVM folds
//! `ld1r` broadcasts into by-element FMLA anyway, so broadcasting would only cost registers.
//! On the A64FX this kernel caps near a quarter of the SVE peak; there it is only a forced
//! fallback (`FUGU_GEMM_ISA=neon`).

use crate::kernel::{Accumulation, Isa, Kernel, Operand, Side};
use std::arch::aarch64::{
    float32x4_t, vdupq_n_f32, vfmaq_f32, vfmaq_lane_f32, vfmaq_laneq_f32, vld1_f32, vld1q_f32,
    vmulq_f32, vst1q_f32,
};

const MR: usize = 16;
const NR: usize = 6;

/// The NEON kernel descriptor, or `None` when the CPU has no Advanced SIMD.
pub fn kernel() -> Option<Kernel> {
    if std::arch::is_aarch64_feature_detected!("neon") {
        Some(Kernel {
            operand: Operand::F32,
            accumulation: Accumulation::F32,
            isa: Isa::Neon,
            mr: MR,
            nr: NR,
            l1_panel: Side::B,
            func: fugu_neon_sgemm_16x6,
        })
    } else {
        None
    }
}

/// One k step: `acc[j][i] += a[i] · b[j]` for the 16×6 tile.
///
/// # Safety
/// `a` must point to 16 readable floats and `b` to 6.
#[inline(always)]
unsafe fn step(acc: &mut [[float32x4_t; 4]; NR], a: *const f32, b: *const f32) {
    // SAFETY: the caller guarantees a[0..16] and b[0..6] are readable (b[0..4] as one q load,
    // b[4..6] as one d load); NEON is baseline on aarch64 (and checked by `kernel()`).
    unsafe {
        let av = [
            vld1q_f32(a),
            vld1q_f32(a.add(4)),
            vld1q_f32(a.add(8)),
            vld1q_f32(a.add(12)),
        ];
        let b03 = vld1q_f32(b);
        let b45 = vld1_f32(b.add(4));
        for (i, &ai) in av.iter().enumerate() {
            acc[0][i] = vfmaq_laneq_f32::<0>(acc[0][i], ai, b03);
            acc[1][i] = vfmaq_laneq_f32::<1>(acc[1][i], ai, b03);
            acc[2][i] = vfmaq_laneq_f32::<2>(acc[2][i], ai, b03);
            acc[3][i] = vfmaq_laneq_f32::<3>(acc[3][i], ai, b03);
            acc[4][i] = vfmaq_lane_f32::<0>(acc[4][i], ai, b45);
            acc[5][i] = vfmaq_lane_f32::<1>(acc[5][i], ai, b45);
        }
    }
}

/// The NEON micro-kernel: `C := alpha·Ã·B̃ + beta·C` on a 16×6 column-major tile.
///
/// # Safety
/// The caller upholds the contract in `docs/KERNELS.md` with `mr = 16`, `nr = 6`.
#[inline(never)]
#[target_feature(enable = "neon")]
unsafe fn fugu_neon_sgemm_16x6(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: `a` holds k*MR floats and `b` k*NR floats (contract), so every step below reads
    // inside them; the tile stores write c[r + j*ldc] for r < 16, j < 6 only, and C is read only
    // when beta != 0.
    unsafe {
        let mut acc = [[vdupq_n_f32(0.0); 4]; NR];
        for p in 0..k {
            step(&mut acc, a.add(p * MR), b.add(p * NR));
        }
        let va = vdupq_n_f32(alpha);
        if beta == 0.0 {
            for (j, col) in acc.iter().enumerate() {
                let cj = c.add(j * ldc);
                for (i, &v) in col.iter().enumerate() {
                    vst1q_f32(cj.add(4 * i), vmulq_f32(v, va));
                }
            }
        } else {
            let vb = vdupq_n_f32(beta);
            for (j, col) in acc.iter().enumerate() {
                let cj = c.add(j * ldc);
                for (i, &v) in col.iter().enumerate() {
                    let old = vld1q_f32(cj.add(4 * i));
                    vst1q_f32(cj.add(4 * i), vfmaq_f32(vmulq_f32(v, va), old, vb));
                }
            }
        }
    }
}

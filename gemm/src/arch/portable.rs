//! Portable micro-kernel: plain Rust over fixed-size arrays, which the compiler auto-vectorises
//! for whatever baseline the target has. Always available; also the fallback for unknown CPUs.

use crate::kernel::{Accumulation, Isa, Kernel, Operand, Side, F16_CHUNK};
use crate::precision::round_f16;

const MR: usize = 16;
const NR: usize = 4;

/// The portable kernel descriptor.
pub fn kernel() -> Kernel {
    Kernel {
        operand: Operand::F32,
        accumulation: Accumulation::F32,
        isa: Isa::Portable,
        mr: MR,
        nr: NR,
        l1_panel: Side::B,
        func: kernel_16x4,
    }
}

/// The portable emulation of A64FX's f16 GEMM arithmetic: f32 words holding f16 values (the
/// f16 rounding pack), products summed in f16 over chunks of [`F16_CHUNK`] and then in f32,
/// like the SVE f16 kernel, so that any CPU can train with the numbers an A64FX would get.
/// (Each f16 step is `round_f16(acc + a·b)` with the f32 sum rounded first: the product of two
/// f16 is exact, but the sum is rounded twice where FMLA rounds once, which can differ in the
/// last f16 bit at exact ties of the f32 sum.)
pub fn f16_chunked_kernel() -> Kernel {
    Kernel {
        operand: Operand::F32,
        accumulation: Accumulation::F16Chunks(F16_CHUNK),
        isa: Isa::Portable,
        mr: MR,
        nr: NR,
        l1_panel: Side::B,
        func: kernel_f16_chunked_16x4,
    }
}

/// # Safety
/// The caller upholds the contract in `docs/KERNELS.md` for `mr = 16`, `nr = 4`.
unsafe fn kernel_f16_chunked_16x4(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: forwarded contract (k*MR floats at `a`, k*NR at `b`).
    let (a, b) = unsafe { panels(k, a, b) };
    let acc = f16_chunks(a, b);
    // SAFETY: forwarded contract (the C tile).
    unsafe { store_tile(&acc, alpha, beta, c, ldc) }
}

/// The chunked f16 sums of the tile, compiled for the widest vectors this CPU has (the same
/// code either way; the emulation is only usable for training runs when it vectorises).
fn f16_chunks(a: &[f32], b: &[f32]) -> [[f32; MR]; NR] {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        #[target_feature(enable = "avx512f")]
        fn wide(a: &[f32], b: &[f32]) -> [[f32; MR]; NR] {
            f16_chunks_body(a, b)
        }
        // SAFETY: avx512f checked just above.
        return unsafe { wide(a, b) };
    }
    f16_chunks_body(a, b)
}

#[inline(always)]
fn f16_chunks_body(a: &[f32], b: &[f32]) -> [[f32; MR]; NR] {
    let mut acc = [[0.0f32; MR]; NR];
    for (ac, bc) in a.chunks(MR * F16_CHUNK).zip(b.chunks(NR * F16_CHUNK)) {
        let mut part = [[0.0f32; MR]; NR];
        for (ap, bp) in ac.chunks_exact(MR).zip(bc.chunks_exact(NR)) {
            let ap: &[f32; MR] = ap.try_into().expect("MR floats");
            for (partj, &bj) in part.iter_mut().zip(bp) {
                for (x, &ar) in partj.iter_mut().zip(ap) {
                    *x = round_f16(*x + ar * bj);
                }
            }
        }
        for (accj, partj) in acc.iter_mut().zip(&part) {
            for (x, p) in accj.iter_mut().zip(partj) {
                *x += p;
            }
        }
    }
    acc
}

/// # Safety
/// The caller upholds the contract in `docs/KERNELS.md` for `mr = 16`, `nr = 4`.
unsafe fn kernel_16x4(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: forwarded contract (k*MR floats at `a`, k*NR at `b`).
    let (a, b) = unsafe { panels(k, a, b) };
    let mut acc = [[0.0f32; MR]; NR];
    for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
        for j in 0..NR {
            let bj = bp[j];
            for r in 0..MR {
                acc[j][r] += ap[r] * bj;
            }
        }
    }
    // SAFETY: forwarded contract (the C tile).
    unsafe { store_tile(&acc, alpha, beta, c, ldc) }
}

/// The packed panels as slices.
///
/// # Safety
/// The contract of `docs/KERNELS.md`: `a` holds `k*MR` floats and `b` holds `k*NR` floats.
unsafe fn panels<'a>(k: usize, a: *const f32, b: *const f32) -> (&'a [f32], &'a [f32]) {
    // SAFETY: as the caller guarantees.
    unsafe {
        (
            std::slice::from_raw_parts(a, k * MR),
            std::slice::from_raw_parts(b, k * NR),
        )
    }
}

/// `C := alpha·acc + beta·C` over the 16 × 4 tile (C not read when `beta == 0`).
///
/// # Safety
/// Column j of the tile, `c[j*ldc .. j*ldc + MR]`, is writable for every `j < NR`.
unsafe fn store_tile(acc: &[[f32; MR]; NR], alpha: f32, beta: f32, c: *mut f32, ldc: usize) {
    for (j, col) in acc.iter().enumerate() {
        // SAFETY: the contract guarantees column j of the tile is c[j*ldc .. j*ldc + MR].
        let cj = unsafe { std::slice::from_raw_parts_mut(c.add(j * ldc), MR) };
        if beta == 0.0 {
            for (cr, &v) in cj.iter_mut().zip(col) {
                *cr = alpha * v;
            }
        } else {
            for (cr, &v) in cj.iter_mut().zip(col) {
                *cr = alpha * v + beta * *cr;
            }
        }
    }
}

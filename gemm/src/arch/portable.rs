//! Portable micro-kernel: plain Rust over fixed-size arrays, which the compiler auto-vectorises
//! for whatever baseline the target has. Always available; also the fallback for unknown CPUs.

use crate::kernel::{Isa, Kernel, Operand};

const MR: usize = 16;
const NR: usize = 4;

/// The portable kernel descriptor.
pub fn kernel() -> Kernel {
    Kernel {
        operand: Operand::F32,
        isa: Isa::Portable,
        mr: MR,
        nr: NR,
        func: kernel_16x4,
    }
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
    // SAFETY: the contract guarantees `a` holds k*MR floats and `b` holds k*NR floats.
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(a, k * MR),
            std::slice::from_raw_parts(b, k * NR),
        )
    };
    let mut acc = [[0.0f32; MR]; NR];
    for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)) {
        for j in 0..NR {
            let bj = bp[j];
            for r in 0..MR {
                acc[j][r] += ap[r] * bj;
            }
        }
    }
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

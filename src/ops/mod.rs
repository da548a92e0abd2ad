//! The model's compute kernels, one op per file, in the style of llm.c's `train_gpt2.c`: each op
//! is a pair of plain `*_forward` / `*_backward` functions over flat row-major slices plus their
//! dimensions.
//!
//! * Generic over [`Float`]: the same code runs in `f32` (production; matrix products on
//!   fugu-gemm) and `f64` (finite-difference tests; matrix products as a plain loop).
//! * Matrix products go through [`Float::gemm`] / [`Float::gemm_strided_batched`] with strided
//!   views, so transposes, heads and the fused qkv layout cost no copies.
//! * Everything else is parallel over rows (`B*T`, or `(b, head, row)`) with rayon; each row's
//!   arithmetic is sequential, so results never depend on the number of threads. Reductions
//!   over rows into parameter gradients (layernorm `dw`/`db`, bias gradients, `dwte`/`dwpe`)
//!   give every output element to one task that sums in a fixed row order.
//! * Each function documents which outputs it overwrites and which it accumulates (`+=`).
//!   Slice lengths are asserted on entry; these are internal APIs and callers validate user
//!   input. No `unsafe`.
//!
//! | file | ops |
//! |---|---|
//! | `float.rs` | [`Float`], GEMM views [`Mat`], [`MatMutT`], [`BatchMat`], [`BatchMatMut`] |
//! | `encoder.rs` | token + position embedding (vocabulary-sharded `wte`) |
//! | `layernorm.rs` | layer norm (eps [`LN_EPS`], biased variance) |
//! | `linear.rs` | `y = x·W + b`, W in Conv1D (in, out) or (out, in) layout |
//! | `attention.rs` | causal attention on fused qkv: scores, softmax, values (+ backward) |
//! | `gelu.rs` | GELU, tanh approximation |
//! | `residual.rs` | residual add |
//! | `crossentropy.rs` | fused softmax + cross-entropy in phases (vocabulary-parallel ready) |
//! | `adamw.rs` | PyTorch AdamW step, sum of squares for gradient clipping |
//! | `row_isa.rs` | [`row_isa::row_isa`]: the instruction set of the row kernels (exp, GELU, layernorm rows, softmax backward, AdamW), chosen once: AVX-512/AVX2 compilations of the portable bodies, or fugu-rows' SVE kernels |

pub mod adamw;
pub mod attention;
pub mod crossentropy;
pub mod encoder;
pub mod fastmath;
pub mod float;
pub mod gelu;
pub mod layernorm;
pub mod linear;
pub mod residual;
pub mod row_isa;
#[cfg(test)]
pub(crate) mod testutil;

pub use adamw::{adamw_update, sum_of_squares, AdamWStep};
pub use attention::{
    attention_scores, attention_scores_backward, attention_softmax, attention_softmax_backward,
    attention_values, attention_values_backward,
};
pub use crossentropy::{
    ce_finish, ce_rescale_sums, ce_row_stats, ce_target_logit, crossentropy_forward,
    crossentropy_forward_backward,
};
pub use encoder::{encoder_backward, encoder_forward};
pub use float::{BatchMat, BatchMatMut, Float, Mat, MatMutT, Precision};
pub use gelu::{gelu_backward, gelu_forward};
pub use layernorm::{layernorm_backward, layernorm_forward, LN_EPS};
pub use linear::{linear_backward, linear_forward, WeightLayout};
pub use residual::{add_inplace, residual_backward, residual_forward};

use rayon::prelude::*;

/// Elements per rayon task in elementwise ops (fixed, so work splitting never depends on the
/// thread count; elementwise results would not anyway).
pub(crate) const ELEM_CHUNK: usize = 8192;

/// Columns per task in the column-split reductions (one 64-byte line of `f32`).
pub(crate) const COL_CHUNK: usize = 16;

/// `dst[j] += Σ_i src[i*width + j]` over rows `i = 0..n` in increasing order, for every column
/// `j < width` (`dst.len() == width`). Parallel over blocks of columns, so each element is
/// summed in the same fixed order whatever the number of threads.
pub(crate) fn add_column_sums<T: Float>(dst: &mut [T], src: &[T], n: usize) {
    let width = dst.len();
    assert_eq!(src.len(), n * width, "add_column_sums: src length");
    if width == 0 {
        return;
    }
    dst.par_chunks_mut(COL_CHUNK)
        .enumerate()
        .for_each(|(blk, d)| {
            let j0 = blk * COL_CHUNK;
            for i in 0..n {
                let row = &src[i * width + j0..i * width + j0 + d.len()];
                for (x, &y) in d.iter_mut().zip(row) {
                    *x += y;
                }
            }
        });
}

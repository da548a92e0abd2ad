//! The model's compute kernels, one op per file, in the style of llm.c's `train_gpt2.c`: each op
//! is a pair of plain `*_forward` / `*_backward` functions over flat row-major slices plus their
//! dimensions.
//!
//! * Generic over [`Float`]: the same code runs in `f32` (production; matrix products on
//!   fugu-gemm) and `f64` (finite-difference tests; matrix products as a plain loop).
//! * Matrix products go through [`Float::gemm`] / [`GemmOperand::gemm_strided_batched`] with
//!   strided views, so transposes, heads and the fused qkv layout cost no copies.
//! * Everything else is parallel over rows (`B*T`, or `(b, head, row)`) with rayon; each row's
//!   arithmetic is sequential, so results never depend on the number of threads. Reductions
//!   over rows into parameter gradients (layernorm `dw`/`db`, bias gradients) sum fixed blocks
//!   of rows into partial vectors, then the partials in block order ([`ROW_BLOCK`]); `dwte`/
//!   `dwpe` give every output element to one task that sums in a fixed row order.
//! * Each function documents which outputs it overwrites and which it accumulates (`+=`).
//!   Slice lengths are asserted on entry; these are internal APIs and callers validate user
//!   input. No `unsafe`.
//!
//! | file | ops |
//! |---|---|
//! | `float.rs` | [`Float`], GEMM views [`Mat`], [`MatMutT`], [`BatchMat`], [`BatchMatMut`] |
//! | `encoder.rs` | token + position embedding (vocabulary-sharded `wte`) |
//! | `layernorm.rs` | layer norm (eps [`LN_EPS`], biased variance) |
//! | `rmsnorm.rs` | RMS norm (Llama; no mean, no bias) |
//! | `rope.rs` | rotary position embeddings, `rotate_half` convention, in place on the q/k heads |
//! | `swiglu.rs` | SwiGLU gate `silu(gate)·up` on fused `[gate | up]` rows |
//! | `linear.rs` | `y = x·W + b`, W in Conv1D (in, out) or (out, in) layout |
//! | `attention.rs` | causal attention on fused qkv: scores, softmax, values (+ backward) |
//! | `gelu.rs` | GELU, tanh approximation |
//! | `half_rows.rs` | rows stored in 16 bits: conversions to and from f32, and the ops with 16-bit kernels (GELU; fugu-rows' SVE `*_half` kernels) |
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
pub mod half_rows;
pub mod layernorm;
pub mod linear;
pub mod residual;
pub mod rmsnorm;
pub mod rope;
pub mod row_isa;
pub mod swiglu;
#[cfg(test)]
pub(crate) mod testutil;

pub use adamw::{adamw_update, sum_of_squares, AdamWStep};
pub use attention::{
    attention_scores, attention_scores_backward, attention_softmax, attention_softmax_backward,
    attention_values, attention_values_backward,
};
pub use crossentropy::{
    ce_finish, ce_fused, ce_fused_losses, ce_rescale_sums, ce_row_stats, ce_target_logit,
    crossentropy_forward, crossentropy_forward_backward, CeStats,
};
pub use encoder::{encoder_backward, encoder_forward};
pub use float::{BatchMat, BatchMatMut, Float, GemmOperand, Mat, MatMutT, Precision, TableRow};
pub use gelu::{gelu_backward, gelu_forward};
pub use layernorm::{layernorm_backward, layernorm_forward, LN_EPS};
pub use linear::{linear_backward, linear_forward, WeightLayout};
pub use residual::{add_inplace, residual_backward, residual_forward, scale_inplace};
pub use rmsnorm::{rmsnorm_backward, rmsnorm_forward};
pub use rope::{rope_backward, rope_forward, RopeTable, RopeView};
pub use swiglu::{swiglu_backward, swiglu_forward};

use rayon::prelude::*;

/// Elements per rayon task in elementwise ops (fixed, so work splitting never depends on the
/// thread count; elementwise results would not anyway).
pub(crate) const ELEM_CHUNK: usize = 8192;

/// Rows per block of the reductions over rows into column vectors (bias and layernorm
/// parameter gradients, [`add_column_sums`]): each block's rows are summed in order into the
/// block's own partial vector, reading whole rows (contiguous), then the blocks' partials are
/// added in block order. Fixed, so the grouping, and with it every bit of the result, never
/// depends on the number of threads.
pub(crate) const ROW_BLOCK: usize = 64;

/// Columns per task when the blocks' partials are added ([`add_block_partials`]).
const PARTIAL_COLUMNS: usize = 1024;

/// Zeroed partial vectors, `per_block` elements for each [`ROW_BLOCK`]-row block of `n` rows.
pub(crate) fn block_partials<T: Float>(n: usize, per_block: usize) -> Vec<T> {
    vec![T::ZERO; n.div_ceil(ROW_BLOCK) * per_block]
}

/// `dst[j] += Σ_b partials[b·stride + offset + j]`, the blocks `b` added in increasing order
/// (after the sum of the blocks' own rows, see [`ROW_BLOCK`]). Parallel over columns.
pub(crate) fn add_block_partials<T: Float>(
    dst: &mut [T],
    partials: &[T],
    stride: usize,
    offset: usize,
) {
    assert!(
        offset + dst.len() <= stride && partials.len().is_multiple_of(stride.max(1)),
        "add_block_partials: {} columns at {offset} of {stride}-wide partials",
        dst.len()
    );
    if dst.is_empty() {
        return;
    }
    dst.par_chunks_mut(PARTIAL_COLUMNS)
        .enumerate()
        .for_each(|(blk, d)| {
            let j0 = offset + blk * PARTIAL_COLUMNS;
            let mut sum = vec![T::ZERO; d.len()];
            for p in partials.chunks_exact(stride) {
                for (s, &v) in sum.iter_mut().zip(&p[j0..j0 + d.len()]) {
                    *s += v;
                }
            }
            for (x, s) in d.iter_mut().zip(sum) {
                *x += s;
            }
        });
}

/// `dst[j] += Σ_i src[i*width + j]` over rows `i = 0..n` for every column `j < width`
/// (`dst.len() == width`): the rows in [`ROW_BLOCK`]-row blocks, each summed in row order,
/// then the blocks in order, so the result is the same whatever the number of threads. `src`
/// is read as stored (a 16-bit row is widened into a row of `T` as it is added).
pub(crate) fn add_column_sums<T: Float, E: TableRow<T>>(dst: &mut [T], src: &[E], n: usize) {
    let width = dst.len();
    assert_eq!(src.len(), n * width, "add_column_sums: src length");
    if width == 0 {
        return;
    }
    let mut partials = block_partials::<T>(n, width);
    partials
        .par_chunks_mut(width)
        .zip(src.par_chunks(ROW_BLOCK * width))
        .for_each(|(p, rows)| {
            let mut wide = vec![T::ZERO; width];
            for row in rows.chunks_exact(width) {
                E::add_row(p, row, &mut wide);
            }
        });
    add_block_partials(dst, &partials, width, 0);
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;

    /// Column sums against a plain f64 sum on row counts around the block size and widths
    /// around the partials' column chunk, accumulated into what `dst` held, and the same bits
    /// whatever the number of threads.
    #[test]
    fn column_sums_add_every_row_whatever_the_threads() {
        let mut rng = Rng::new(31);
        for (n, width) in [
            (0, 5),
            (1, 1),
            (63, 17),
            (64, 3),
            (65, 17),
            (130, 1030),
            (200, 1),
        ] {
            let src = round_f32(&rng.vec(n * width));
            let start = round_f32(&rng.vec(width));
            let want: Vec<f64> = (0..width)
                .map(|j| start[j] + (0..n).map(|i| src[i * width + j]).sum::<f64>())
                .collect();
            let run = |threads| {
                with_threads(threads, || {
                    let mut dst = to_f32(&start);
                    add_column_sums(&mut dst, &to_f32(&src), n);
                    dst
                })
            };
            let got = run(1);
            // f32 sums of up to 200 terms of magnitude <= 1: well inside 1e-4.
            assert_close_f32(&format!("{n}x{width}"), &got, &want, 1e-4);
            assert_eq!(got, run(2), "{n}x{width}: threads change the bits");
        }
    }

    /// The partials of the blocks are added in order at the requested offset of each block's
    /// vector, and nothing else is read.
    #[test]
    fn block_partials_add_the_requested_columns() {
        // Three blocks of 5-wide partials; columns 2..4 of each.
        let partials: Vec<f32> = (0..15).map(|v| v as f32).collect();
        let mut dst = vec![100.0f32, 200.0];
        add_block_partials(&mut dst, &partials, 5, 2);
        assert_eq!(dst, [100.0 + 2.0 + 7.0 + 12.0, 200.0 + 3.0 + 8.0 + 13.0]);
        assert_eq!(block_partials::<f32>(129, 3).len(), 3 * 3);
        assert!(block_partials::<f32>(0, 3).is_empty());
    }
}

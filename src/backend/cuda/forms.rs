//! The kernel forms a CUDA backend can run for the same op, and the environment settings that
//! pick them (`FUGU_FLASH_WARP_ROWS`, `FUGU_FLASH_QUERY_ROWS`, `FUGU_FLASH_MMA`,
//! `FUGU_FLASH_OVERLAP`, `FUGU_LAYERNORM_BACKWARD`, `FUGU_CROSS_ENTROPY`,
//! `FUGU_FLASH_BACKWARD`, `FUGU_BIAS_GRAD`): the form measured fastest on a GPU is each one's
//! default, the others are for A/B runs. The run header records which ran
//! ([`super::CudaBackend`]'s `kernel_settings`). With `FUGU_FLASH_SELECT=timed` the fused
//! attention's form ([`FlashForm`]) is instead timed per shape (`attention_select.rs`).

use super::attention::{FLASH_LDS, FLASH_ROWS, FLASH_THREADS};
use super::{InGemm, K, WARP};
pub use crate::backend::knobs::{
    parse_in_gemm, FlashBackward, FlashMma, FlashOverlap, FlashQueryRows, FlashWarpRows,
    KernelForm, BIAS_GRAD_ENV, CROSS_ENTROPY_ENV, FLASH_BACKWARD_ENV, FLASH_MMA_ENV,
    FLASH_OVERLAP_ENV, FLASH_QUERY_ROWS_ENV, FLASH_WARP_ROWS_ENV, LAYERNORM_BACKWARD_ENV,
};

// `FUGU_FLASH_WARP_ROWS` (read by `backend/knobs.rs`): rows per warp of the fused attention kernels, `16` (the default) or
// `32` (the `_wide` kernels: each fragment a warp loads from shared memory feeds two
// products), for all three kernels or as `F,Q,KV` for the forward, dQ and dK/dV kernels
// ([`FlashWarpRows`]). Measured on one H200, GPT-2 124M B=16 T=1024 bf16 (2026-11-28): 32
// rows everywhere 37.2 ms/step against 36.55 for 16 (forward 2.26 ms against 2.03, backward
// 6.93 against 6.53): half the warps per SM hide less latency than the fragments save.

impl FlashWarpRows {
    /// A kernel's narrow (16 rows per warp, [`FLASH_THREADS`]) or wide (32 rows, half the
    /// threads) form.
    pub(super) fn pick(rows: usize, narrow: K, wide: K) -> (K, u32) {
        if rows == 32 {
            (wide, FLASH_THREADS / 2)
        } else {
            (narrow, FLASH_THREADS)
        }
    }
}

// `FUGU_FLASH_QUERY_ROWS`: query rows per block of the forward and dQ kernels, `64` (the
// default: 4 warps of 16 rows, or 2 of 32) or `128` (the `_q128` kernels: 8 warps of 16, or 4
// of 32, FlashAttention-2's block for heads of 64), which load each key and value tile once
// for twice the rows: half the tile traffic from L2, twice the warps at each barrier, and in
// a causal block's last key tile the warps whose rows all come before it skip it.

/// The four forms of a kernel over query blocks (the forward, dQ): 16 or 32 rows per warp,
/// 64 or 128 rows per block.
pub(super) struct QueryKernels {
    pub narrow: K,
    pub wide: K,
    pub narrow_q128: K,
    pub wide_q128: K,
}

impl FlashQueryRows {
    /// The form of `k` for `warp_rows` rows per warp and this many per block, with its
    /// threads per block.
    pub(super) fn pick(self, warp_rows: usize, k: QueryKernels) -> (K, u32) {
        let kernel = match (warp_rows == 32, self.0 == 128) {
            (false, false) => k.narrow,
            (true, false) => k.wide,
            (false, true) => k.narrow_q128,
            (true, true) => k.wide_q128,
        };
        (kernel, (self.0 / warp_rows) as u32 * WARP)
    }

    /// Dynamic shared memory of the dQ kernel: Q and dO tiles of this many rows where they do
    /// not fit in a key block's two tiles or are read again on every key block (32 rows per
    /// warp), else none (`QDO_DYNAMIC` in `kernels.cu`).
    pub(super) fn dq_shmem(self, warp_rows: usize) -> u32 {
        if warp_rows == 32 || self.0 > FLASH_ROWS {
            2 * self.0 as u32 * FLASH_LDS * 2
        } else {
            0
        }
    }
}

// `FUGU_FLASH_MMA`: the fused attention kernels' tensor-core instruction, `sync` (the default:
// `mma.sync` per warp, every kernel and form above) or `wgmma` (compute capability 9.0 only:
// each block's warpgroup multiplies with Hopper's warpgroup MMA, the tensor cores reading the
// K, V (forward), Q and dO (dK/dV) or K (dQ) tiles from swizzled shared memory themselves:
// `flash_forward_wgmma`, and with `FUGU_FLASH_BACKWARD=stored` `flash_backward_dkv_store_wgmma`
// and `flash_backward_dq_stored_wgmma`; the split and one-kernel backward passes have no wgmma
// form and keep mma.sync; 16 rows per warp; the forward with 64 or 128 query rows per block,
// one warpgroup or two, as `FUGU_FLASH_QUERY_ROWS` says (`flash_forward_wgmma_q128`), the
// backward's with 64; heads of 65 to 128 the `_wgmma_d128` forms of the three, 64 rows per
// block, the forward with 128 too (`flash_forward_wgmma_d128_q128`); not yet run on a GPU)
// ([`FlashMma`]).

impl FlashMma {
    /// The reason this form cannot run on a device (`wgmma`: whether it has warpgroup MMA)
    /// with these rows per warp, if it cannot.
    pub fn refusal(self, wgmma: bool, warp_rows: FlashWarpRows) -> Option<String> {
        let FlashWarpRows { forward, dq, dkv } = warp_rows;
        match self {
            FlashMma::Sync => None,
            FlashMma::Wgmma if !wgmma => Some(format!(
                "{FLASH_MMA_ENV}=wgmma needs a GPU of compute capability 9.0 (H100, H200); \
                 this device has no warpgroup MMA"
            )),
            FlashMma::Wgmma if [forward, dq, dkv] != [16; 3] => Some(format!(
                "{FLASH_MMA_ENV}=wgmma runs 16 rows per warp, not {forward},{dq},{dkv}: leave \
                 {FLASH_WARP_ROWS_ENV} at 16"
            )),
            FlashMma::Wgmma => None,
        }
    }
}

// `FUGU_FLASH_OVERLAP`: whether the wgmma forward kernels overlap each key block's softmax
// with the previous block's P·V product (`on`: the `flash_forward_wgmma_overlap` forms,
// FlashAttention-3's intra-warpgroup pipelining: S of block kb and P·V of block kb - 1 issued
// together, the softmax run while the second is in flight; the same sums in the same order,
// so the same bits) or not (`off`, the default). Needs `FUGU_FLASH_MMA=wgmma`; not yet run on
// a GPU ([`FlashOverlap`]).

impl FlashOverlap {
    /// Why this form cannot run with the kernels' instruction `mma`, if it cannot.
    pub fn refusal(self, mma: FlashMma) -> Option<String> {
        (self == FlashOverlap::On && mma != FlashMma::Wgmma).then(|| {
            format!(
                "{FLASH_OVERLAP_ENV}=on overlaps warpgroup MMA products: it needs \
                 {FLASH_MMA_ENV}=wgmma"
            )
        })
    }
}

/// One form of the fused attention: every setting that picks its kernels
/// (`FUGU_FLASH_WARP_ROWS`, `FUGU_FLASH_QUERY_ROWS`, `FUGU_FLASH_MMA`, `FUGU_FLASH_OVERLAP`,
/// `FUGU_FLASH_BACKWARD`). The backend runs the one its settings give, and `fugu bench
/// attention` each of [`FlashForm::every`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashForm {
    pub warp_rows: FlashWarpRows,
    pub query_rows: FlashQueryRows,
    pub mma: FlashMma,
    pub overlap: FlashOverlap,
    pub backward: FlashBackward,
}

impl Default for FlashForm {
    fn default() -> Self {
        FlashForm {
            warp_rows: FlashWarpRows::default(),
            query_rows: FlashQueryRows::default(),
            mma: FlashMma::default(),
            overlap: FlashOverlap::default(),
            backward: FLASH_BACKWARD_DEFAULT,
        }
    }
}

impl FlashForm {
    /// Why this form cannot run on a device (`wgmma`: whether it has warpgroup MMA), if it
    /// cannot: the instruction's refusal first, then the overlap's.
    pub fn refusal(&self, wgmma: bool) -> Option<String> {
        self.mma
            .refusal(wgmma, self.warp_rows)
            .or_else(|| self.overlap.refusal(self.mma))
    }

    /// The environment settings that select this form (those that differ from the
    /// defaults, rows per warp as one number where the three kernels share it), or `default`.
    pub fn label(&self) -> String {
        let d = FlashForm::default();
        let mut s = Vec::new();
        if self.mma != d.mma {
            s.push(format!("{FLASH_MMA_ENV}={}", self.mma.name()));
        }
        if self.overlap != d.overlap {
            s.push(format!("{FLASH_OVERLAP_ENV}={}", self.overlap.name()));
        }
        if self.backward != d.backward {
            s.push(format!("{FLASH_BACKWARD_ENV}={}", self.backward.name()));
        }
        if self.query_rows != d.query_rows {
            s.push(format!("{FLASH_QUERY_ROWS_ENV}={}", self.query_rows.0));
        }
        let FlashWarpRows { forward, dq, dkv } = self.warp_rows;
        if self.warp_rows != d.warp_rows {
            s.push(if forward == dq && dq == dkv {
                format!("{FLASH_WARP_ROWS_ENV}={forward}")
            } else {
                format!("{FLASH_WARP_ROWS_ENV}={forward},{dq},{dkv}")
            });
        }
        if s.is_empty() {
            "default".into()
        } else {
            s.join(" ")
        }
    }

    /// Every form a device runs (`wgmma`: whether it has warpgroup MMA): each `FUGU_FLASH_MMA`
    /// (wgmma with `FUGU_FLASH_OVERLAP` off and on), `FUGU_FLASH_BACKWARD`,
    /// `FUGU_FLASH_QUERY_ROWS` and `FUGU_FLASH_WARP_ROWS` the others allow, the default first;
    /// the rows per warp as 16 or 32 for every kernel, or the dK/dV kernel's apart from the
    /// forward and dQ kernels' (so that the backward pass, timed apart from the forward, meets
    /// every pairing of its two kernels' rows). Forms may launch the same kernels for a pass
    /// and head size (the head-128 kernels have fewer forms; the forward reads only its own
    /// rows).
    pub fn every(wgmma: bool) -> Vec<FlashForm> {
        let mut forms = vec![FlashForm::default()];
        let mmas: &[(FlashMma, FlashOverlap)] = if wgmma {
            &[
                (FlashMma::Sync, FlashOverlap::Off),
                (FlashMma::Wgmma, FlashOverlap::Off),
                (FlashMma::Wgmma, FlashOverlap::On),
            ]
        } else {
            &[(FlashMma::Sync, FlashOverlap::Off)]
        };
        for &(mma, overlap) in mmas {
            for backward in [
                FlashBackward::Split,
                FlashBackward::Stored,
                FlashBackward::Fused,
            ] {
                for query_rows in [64, 128] {
                    for (r, dkv) in [(16, 16), (32, 32), (16, 32), (32, 16)] {
                        let f = FlashForm {
                            warp_rows: FlashWarpRows {
                                forward: r,
                                dq: r,
                                dkv,
                            },
                            query_rows: FlashQueryRows(query_rows),
                            mma,
                            overlap,
                            backward,
                        };
                        if f.refusal(wgmma).is_none() && !forms.contains(&f) {
                            forms.push(f);
                        }
                    }
                }
            }
        }
        forms
    }
}

// `FUGU_LAYERNORM_BACKWARD`: how the layernorm backward pass runs, and the RMS norm's,
// `fused` (the default: the input gradient and the weight gradients' column sums in one pass
// over dout and the input; `layernorm_backward`, `rmsnorm_backward`: the same kernel, its RMS
// form without the mean and the bias) or `split` (the input gradient, then the column sums,
// which read dout and the input a second time) ([`LayernormBackward`]).

/// The layernorm backward's form where [`LAYERNORM_BACKWARD_ENV`] is unset: fused. Measured on
/// one H200, GPT-2 124M B=16 T=1024 bf16, two alternating rounds (2026-11-28): 35.8 ms/step
/// against 36.6 for split; the layernorm backward's timers 1.79 ms against 2.67.
pub const LAYERNORM_BACKWARD_DEFAULT: LayernormBackward = KernelForm::Fused;

/// The form of the layernorm backward kernels ([`LAYERNORM_BACKWARD_ENV`]): `Split`,
/// `layernorm_backward_dinp`, then `column_partials` and `column_finish`; `Fused`,
/// `layernorm_backward` (input gradient and the column sums' first stage), then
/// `column_finish` (the split form where C is too wide for its shared memory,
/// [`LN_FUSED_SHMEM`]).
pub type LayernormBackward = KernelForm;

// `FUGU_CROSS_ENTROPY`: how the cross-entropy runs where the logits hold the whole vocabulary
// (no tensor parallelism, `Backend::ce_whole_vocab`): `split` (the default: its phases' kernels,
// `ce_row_stats` reading the logits, `ce_target_logit`, then `ce_finish` reading them again
// and writing the gradient) or `fused` (`ce_fused`: one kernel whose block finishes a row
// straight after its statistics, rereading it while it may still be in L2). The same bits.

/// The one-shard cross-entropy's form where [`CROSS_ENTROPY_ENV`] is unset: split, the form
/// measured on an H200 (2.23 ms of a GPT-2 124M B=16 T=1024 bf16 step, 2026-11-30, at 2.2 TB/s
/// over its three passes). `fused` has not run on a GPU: whether its rereads hit L2 (5 blocks
/// per SM at its 46-48 registers: 660 rows of 100 KB in flight against 50-60 MB) is what the
/// A/B measures. An earlier
/// one-kernel form that kept each row in shared memory (b538c39, reverted) was slower, 3.21
/// ms: at 2 blocks per SM too few loads were in flight.
pub const CROSS_ENTROPY_DEFAULT: CrossEntropyForm = KernelForm::Split;

/// The form of the one-shard cross-entropy ([`CROSS_ENTROPY_ENV`]).
pub type CrossEntropyForm = KernelForm;

// `FUGU_FLASH_BACKWARD`: how the fused attention's backward pass runs ([`FlashBackward`]):
// `split` (the default: a kernel for dQ, then one for dK and dV, seven tensor-core products
// per tile), `fused` (one kernel, five products, dQ added across key blocks in a fixed order)
// or `stored` (five products: the dK/dV kernel stores each tile's dS, a kernel for dQ reads it
// back).

/// The attention backward's form where [`FLASH_BACKWARD_ENV`] is unset: split. Measured on one
/// H200, GPT-2 124M B=16 T=1024 bf16, two alternating rounds (2026-11-28): 36.6 ms/step
/// against 43.6 for the one kernel (its attention backward 14.2 ms against 6.5: the blocks
/// waiting for their turns to add dQ cost more than the two products it saves). `stored` has
/// not run on a GPU yet.
///
/// What each form launches: `Split`, `flash_backward_dq` (which also computes Δ = rowsum(dO
/// ∘ O)), then `flash_backward_dkv`; `Fused`, `flash_backward_prep` (Δ), then
/// `flash_backward_fused`: dK and dV as the dK/dV kernel computes them, and each tile's share
/// of dQ from the dS it computes anyway (dQ's f32 shares added in another order); `Stored`,
/// `flash_backward_prep`, then per chunk of sequences (so that the tiles of dS, T's size each,
/// stay within [`super::attention::FLASH_DS_BUDGET`]) `flash_backward_dkv_store` and
/// `flash_backward_dq_stored` (64 query rows per block whatever `FUGU_FLASH_QUERY_ROWS`; 16 or
/// 32 per warp as `FUGU_FLASH_WARP_ROWS` says for dQ): the same products as `Split` on the
/// same dS values, summed in the same order.
pub const FLASH_BACKWARD_DEFAULT: FlashBackward = FlashBackward::Split;

// `FUGU_BIAS_GRAD`: how a linear layer's bias gradient is computed, `separate` (the
// default: column-sum kernels reading the output gradient again after the weight-gradient
// GEMM) or `epilogue` (by that GEMM, from the output gradient it reads anyway) ([`BiasGrad`]).
// Measured on one H200, GPT-2 124M B=16 T=1024 bf16 (2026-11-28): level, 36.55 ms/step either
// way (two rounds each), so the default stays the form with fewer cuBLASLt epilogues.

/// How a linear layer's bias gradient is computed ([`BIAS_GRAD_ENV`]): `Separate`,
/// `column_partials` and `column_finish` over the output gradient; `Epilogue`, the
/// weight-gradient GEMM's epilogue (cuBLASLt's `BGRADA`/`BGRADB`, [`Epilogue::BiasGrad`]) into
/// a scratch vector, added to the gradient (the column sums where the engine has no such
/// epilogue for the shape). Both sum the same values in f32, in different orders.
pub type BiasGrad = InGemm;

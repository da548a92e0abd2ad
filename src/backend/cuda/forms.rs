//! The kernel forms a CUDA backend can run for the same op, and the environment settings that
//! pick them (`FUGU_FLASH_WARP_ROWS`, `FUGU_LAYERNORM_BACKWARD`, `FUGU_FLASH_BACKWARD`,
//! `FUGU_BIAS_GRAD`): the form measured fastest on a GPU is each one's default, the others
//! are for A/B runs. The run header records which ran ([`super::CudaBackend`]'s `kernel_settings`).

use super::attention::FLASH_THREADS;
use super::{InGemm, K};
use anyhow::Result;

/// Environment variable: rows per warp of the fused attention kernels, `16` (the default) or
/// `32` (the `_wide` kernels: each fragment a warp loads from shared memory feeds two
/// products), for all three kernels or as `F,Q,KV` for the forward, dQ and dK/dV kernels
/// ([`FlashWarpRows`]). Measured on one H200, GPT-2 124M B=16 T=1024 bf16 (2026-11-28): 32
/// rows everywhere 37.2 ms/step against 36.55 for 16 (forward 2.26 ms against 2.03, backward
/// 6.93 against 6.53): half the warps per SM hide less latency than the fragments save.
pub const FLASH_WARP_ROWS_ENV: &str = "FUGU_FLASH_WARP_ROWS";

/// Rows per warp (16 or 32) of each fused attention kernel: query rows for the forward and dQ
/// kernels, keys for the dK/dV kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashWarpRows {
    pub forward: usize,
    pub dq: usize,
    pub dkv: usize,
}

impl Default for FlashWarpRows {
    fn default() -> Self {
        FlashWarpRows {
            forward: 16,
            dq: 16,
            dkv: 16,
        }
    }
}

impl FlashWarpRows {
    /// [`FLASH_WARP_ROWS_ENV`]'s value: empty (the default), `R`, or `F,Q,KV`.
    pub fn parse(v: &str) -> Result<FlashWarpRows> {
        let bad = || {
            anyhow::anyhow!(
                "{FLASH_WARP_ROWS_ENV}={v}: expected 16 or 32, or three of them separated by \
                 commas (forward, dQ, dK/dV kernels)"
            )
        };
        if v.is_empty() {
            return Ok(Self::default());
        }
        let rows: Vec<usize> = v
            .split(',')
            .map(|x| match x.trim() {
                "16" => Ok(16),
                "32" => Ok(32),
                _ => Err(bad()),
            })
            .collect::<Result<_>>()?;
        match rows[..] {
            [r] => Ok(FlashWarpRows {
                forward: r,
                dq: r,
                dkv: r,
            }),
            [forward, dq, dkv] => Ok(FlashWarpRows { forward, dq, dkv }),
            _ => Err(bad()),
        }
    }

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

/// Environment variable: how the layernorm backward pass runs, `fused` (the default: the
/// input gradient and the weight gradients' column sums in one pass over dout and the input)
/// or `split` (the input gradient, then the column sums, which read dout and the input a
/// second time) ([`LayernormBackward`]).
pub const LAYERNORM_BACKWARD_ENV: &str = "FUGU_LAYERNORM_BACKWARD";

/// The layernorm backward's form where [`LAYERNORM_BACKWARD_ENV`] is unset: fused. Measured on
/// one H200, GPT-2 124M B=16 T=1024 bf16, two alternating rounds (2026-11-28): 35.8 ms/step
/// against 36.6 for split; the layernorm backward's timers 1.79 ms against 2.67.
pub const LAYERNORM_BACKWARD_DEFAULT: LayernormBackward = KernelForm::Fused;

/// A kernel setting's two forms: the work in more kernels or passes, or fused into fewer.
/// Each setting declares its measured default beside it ([`LAYERNORM_BACKWARD_DEFAULT`],
/// [`FLASH_BACKWARD_DEFAULT`]). Both forms compute the same values up to the order of f32
/// sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelForm {
    Split,
    Fused,
}

impl KernelForm {
    /// The setting's value for this form (what [`Self::parse`] reads and the run header shows).
    pub fn name(self) -> &'static str {
        match self {
            KernelForm::Split => "split",
            KernelForm::Fused => "fused",
        }
    }

    /// The value `v` of setting `env`: empty (the setting's `default`), `split` or `fused`.
    pub fn parse(env: &str, v: &str, default: KernelForm) -> Result<KernelForm> {
        parse_form(
            env,
            v,
            default,
            &[KernelForm::Split, KernelForm::Fused],
            Self::name,
        )
    }
}

/// The form of the layernorm backward kernels ([`LAYERNORM_BACKWARD_ENV`]): `Split`,
/// `layernorm_backward_dinp`, then `column_partials` and `column_finish`; `Fused`,
/// `layernorm_backward` (input gradient and the column sums' first stage), then
/// `column_finish` (the split form where C is too wide for its shared memory,
/// [`LN_FUSED_SHMEM`]).
pub type LayernormBackward = KernelForm;

/// Environment variable: how the fused attention's backward pass runs, `split` (the default:
/// a kernel for dQ, then one for dK and dV, seven tensor-core products per tile) or `fused`
/// (one kernel, five products, dQ added across key blocks in a fixed order) ([`FlashBackward`]).
pub const FLASH_BACKWARD_ENV: &str = "FUGU_FLASH_BACKWARD";

/// The attention backward's form where [`FLASH_BACKWARD_ENV`] is unset: split. Measured on one
/// H200, GPT-2 124M B=16 T=1024 bf16, two alternating rounds (2026-11-28): 36.6 ms/step
/// against 43.6 for the one kernel (its attention backward 14.2 ms against 6.5: the blocks
/// waiting for their turns to add dQ cost more than the two products it saves).
pub const FLASH_BACKWARD_DEFAULT: FlashBackward = KernelForm::Split;

/// How the fused attention's backward pass runs ([`FLASH_BACKWARD_ENV`]): `Split`,
/// `flash_backward_dq` (which also computes Δ = rowsum(dO ∘ O)), then `flash_backward_dkv`;
/// `Fused`, `flash_backward_prep` (Δ), then `flash_backward_fused`: dK and dV as the dK/dV
/// kernel computes them, and each tile's share of dQ from the dS it computes anyway (dQ's f32
/// shares added in another order).
pub type FlashBackward = KernelForm;

/// Environment variable: how a linear layer's bias gradient is computed, `separate` (the
/// default: column-sum kernels reading the output gradient again after the weight-gradient
/// GEMM) or `epilogue` (by that GEMM, from the output gradient it reads anyway) ([`BiasGrad`]).
/// Measured on one H200, GPT-2 124M B=16 T=1024 bf16 (2026-11-28): level, 36.55 ms/step either
/// way (two rounds each), so the default stays the form with fewer cuBLASLt epilogues.
pub const BIAS_GRAD_ENV: &str = "FUGU_BIAS_GRAD";

/// How a linear layer's bias gradient is computed ([`BIAS_GRAD_ENV`]): `Separate`,
/// `column_partials` and `column_finish` over the output gradient; `Epilogue`, the
/// weight-gradient GEMM's epilogue (cuBLASLt's `BGRADA`/`BGRADB`, [`Epilogue::BiasGrad`]) into
/// a scratch vector, added to the gradient (the column sums where the engine has no such
/// epilogue for the shape). Both sum the same values in f32, in different orders.
pub type BiasGrad = InGemm;

/// The value `v` of setting `env` that says whether an op runs in a GEMM's epilogue: empty
/// (the default: separate), `separate` or `epilogue`.
pub fn parse_in_gemm(env: &str, v: &str) -> Result<InGemm> {
    parse_form(
        env,
        v,
        InGemm::Separate,
        &[InGemm::Separate, InGemm::Epilogue],
        InGemm::name,
    )
}

/// `v`, the value of kernel setting `env`, as the one of `forms` that `name` calls so (empty:
/// `default`); an error naming the setting and the values it takes otherwise.
fn parse_form<F: Copy>(
    env: &str,
    v: &str,
    default: F,
    forms: &[F],
    name: fn(F) -> &'static str,
) -> Result<F> {
    if v.is_empty() {
        return Ok(default);
    }
    forms
        .iter()
        .copied()
        .find(|&f| name(f) == v)
        .ok_or_else(|| {
            let names: Vec<&str> = forms.iter().map(|&f| name(f)).collect();
            anyhow::anyhow!("{env}={v}: expected {}", names.join(" or "))
        })
}

//! Which form of an op a model runs where a backend has more than one (a fused kernel, work
//! in a GEMM's epilogue): the backend says what it has for the run's compute type, a setting
//! may override it (benchmarks and tests; [`Knobs`], read from the environment by
//! `backend/knobs.rs`), and the choice is made once, when the model is built, and recorded in
//! the run header.

use super::acts::AttnKeep;
use crate::backend::knobs::AttentionAsk;
pub use crate::backend::knobs::{Knobs, ATTENTION_ENV, MLP_GELU_ENV, RESIDUAL_ENV};
use crate::backend::{Backend, Dtype, FusedAttention};
use anyhow::{bail, Result};

/// Whether a model with heads of size `hs` stored as `compute` keeps attention probabilities
/// (the three-step path) or log-sum-exps (fused): the backend's preference, unless `ask`
/// ([`ATTENTION_ENV`]) says otherwise.
pub(super) fn attention_path(
    be: &impl Backend,
    hs: usize,
    compute: Dtype,
    ask: AttentionAsk,
) -> Result<AttnKeep> {
    let support = be.fused_attention(hs, compute);
    Ok(match (ask, support) {
        (AttentionAsk::Auto, FusedAttention::Preferred)
        | (AttentionAsk::Fused, FusedAttention::Available | FusedAttention::Preferred) => {
            AttnKeep::LogSumExp
        }
        (AttentionAsk::Auto | AttentionAsk::Materialized, _) => AttnKeep::Probabilities,
        (AttentionAsk::Fused, FusedAttention::Unsupported) => bail!(
            "{ATTENTION_ENV}=fused: the {} backend has no fused attention for heads of size \
             {hs} stored as {}",
            be.name(),
            compute.name()
        ),
    })
}

pub use crate::backend::InGemm;

/// Where the MLP's GELU runs ([`mlp_gelu_path`]): `Separate`, its own op between the two
/// GEMMs, forward and backward (timed as `mlp:gelu`); `Epilogue`, in the GEMMs' epilogues
/// ([`Backend::gelu_epilogue`]): the fc GEMM writes its output and GELU of it, the
/// fc-projection's input-gradient GEMM multiplies by GELU's derivative (timed as `mlp:mm`).
pub type MlpGelu = InGemm;

/// Where a model whose activations are stored as `compute` runs the MLP's GELU: in the GEMMs'
/// epilogues where the backend has them, unless `ask` ([`MLP_GELU_ENV`]) says otherwise.
pub(super) fn mlp_gelu_path(
    be: &impl Backend,
    compute: Dtype,
    ask: Option<InGemm>,
) -> Result<MlpGelu> {
    let has = be.gelu_epilogue(compute);
    in_gemm((MLP_GELU_ENV, ask), "GELU", has, true, be, compute)
}

/// How a projection's output joins the residual stream ([`residual_path`]): `Separate`, the
/// projection into a scratch buffer, then its own op adding it to the stream (timed as
/// `residual`); `Epilogue`, in the projection's GEMM ([`Backend::residual_epilogue`]), which
/// reads the stream and writes the new one (timed as the projection).
pub type Residual = InGemm;

/// How a model whose activations are stored as `compute` adds its projections to the
/// residual stream: in the GEMM where the backend has it and the activations are 16-bit (one
/// rounding of the f32 sum instead of two; measured on one H200, GPT-2 124M B=16 T=1024 bf16,
/// 2026-11-28: 36.2 ms/step against 36.55 alone, 35.65 against 36.0 with the fused
/// layernorm backward, two rounds each; on 2 Zen 3 cores, GPT-2 124M 1×512 bf16, it drops the residual
/// op's 12-13 ms of a 3.9 s step, the projections' time unchanged within the runs' noise),
/// unless `ask` ([`RESIDUAL_ENV`]) says otherwise. f32 runs, the references, keep the
/// separate op.
pub(super) fn residual_path(
    be: &impl Backend,
    compute: Dtype,
    ask: Option<InGemm>,
) -> Result<Residual> {
    let has = be.residual_epilogue(compute);
    in_gemm(
        (RESIDUAL_ENV, ask),
        "residual",
        has,
        compute != Dtype::F32,
        be,
        compute,
    )
}

/// Whether an op (`what`) runs in a GEMM's epilogue, as setting `env` asks (`None`: auto):
/// `epilogue` where the backend `has` one (refused by name where it has not), `separate`
/// never, `auto` where it has one and `auto_takes` it.
fn in_gemm(
    (env, ask): (&str, Option<InGemm>),
    what: &str,
    has: bool,
    auto_takes: bool,
    be: &impl Backend,
    compute: Dtype,
) -> Result<InGemm> {
    Ok(match (ask, has) {
        (None, true) if auto_takes => InGemm::Epilogue,
        (Some(InGemm::Epilogue), true) => InGemm::Epilogue,
        (None | Some(InGemm::Separate), _) => InGemm::Separate,
        (Some(InGemm::Epilogue), false) => bail!(
            "{env}=epilogue: the {} backend has no {what} epilogue for activations stored as {}",
            be.name(),
            compute.name()
        ),
    })
}

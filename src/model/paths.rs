//! Which form of an op a model runs where a backend has more than one (a fused kernel, work
//! in a GEMM's epilogue): the backend says what it has for the run's compute type, an
//! environment variable may override it (benchmarks and tests), and the choice is made once,
//! when the model is built, and recorded in the run header.

use super::acts::AttnKeep;
use crate::backend::{Backend, Dtype, FusedAttention};
use anyhow::{bail, Result};

/// Environment variable that overrides the backend's attention path: `fused` or
/// `materialized` (benchmarks and tests; default `auto`).
pub const ATTENTION_ENV: &str = "FUGU_ATTENTION";

/// Whether a model with heads of size `hs` stored as `compute` keeps attention probabilities
/// (the three-step path) or log-sum-exps (fused): the backend's preference, unless
/// [`ATTENTION_ENV`] says otherwise.
pub(super) fn attention_path(be: &impl Backend, hs: usize, compute: Dtype) -> Result<AttnKeep> {
    let support = be.fused_attention(hs, compute);
    let asked = std::env::var(ATTENTION_ENV).unwrap_or_default();
    Ok(match (asked.as_str(), support) {
        ("" | "auto", FusedAttention::Preferred)
        | ("fused", FusedAttention::Available | FusedAttention::Preferred) => AttnKeep::LogSumExp,
        ("" | "auto" | "materialized", _) => AttnKeep::Probabilities,
        ("fused", FusedAttention::Unsupported) => bail!(
            "{ATTENTION_ENV}=fused: the {} backend has no fused attention for heads of size \
             {hs} stored as {}",
            be.name(),
            compute.name()
        ),
        (other, _) => bail!("{ATTENTION_ENV}={other}: expected auto, fused or materialized"),
    })
}

pub use crate::backend::InGemm;

/// Where the MLP's GELU runs ([`mlp_gelu_path`]): `Separate`, its own op between the two
/// GEMMs, forward and backward (timed as `mlp:gelu`); `Epilogue`, in the GEMMs' epilogues
/// ([`Backend::gelu_epilogue`]): the fc GEMM writes its output and GELU of it, the
/// fc-projection's input-gradient GEMM multiplies by GELU's derivative (timed as `mlp:mm`).
pub type MlpGelu = InGemm;

/// Environment variable that overrides where the MLP's GELU runs: `epilogue` or `separate`
/// (benchmarks and tests; default `auto`: in the epilogues where the backend has them).
pub const MLP_GELU_ENV: &str = "FUGU_MLP_GELU";

/// Where a model whose activations are stored as `compute` runs the MLP's GELU: in the GEMMs'
/// epilogues where the backend has them, unless [`MLP_GELU_ENV`] says otherwise.
pub(super) fn mlp_gelu_path(be: &impl Backend, compute: Dtype) -> Result<MlpGelu> {
    let has = be.gelu_epilogue(compute);
    in_gemm(MLP_GELU_ENV, "GELU", has, true, be, compute)
}

/// How a projection's output joins the residual stream ([`residual_path`]): `Separate`, the
/// projection into a scratch buffer, then its own op adding it to the stream (timed as
/// `residual`); `Epilogue`, in the projection's GEMM ([`Backend::residual_epilogue`]), which
/// reads the stream and writes the new one (timed as the projection).
pub type Residual = InGemm;

/// Environment variable that picks how projections join the residual stream: `epilogue` or
/// `separate` (default `auto`: in the GEMM for 16-bit activations where the backend has it).
pub const RESIDUAL_ENV: &str = "FUGU_RESIDUAL";

/// How a model whose activations are stored as `compute` adds its projections to the
/// residual stream: in the GEMM where the backend has it and the activations are 16-bit (one
/// rounding of the f32 sum instead of two; measured on one H200, GPT-2 124M B=16 T=1024 bf16,
/// 2026-11-28: 36.2 ms/step against 36.55 alone, 35.65 against 36.0 with the fused
/// layernorm backward, two rounds each; on 2 Zen 3 cores, GPT-2 124M 1×512 bf16, it drops the residual
/// op's 12-13 ms of a 3.9 s step, the projections' time unchanged within the runs' noise),
/// unless [`RESIDUAL_ENV`] says otherwise. f32 runs, the references, keep the separate op.
pub(super) fn residual_path(be: &impl Backend, compute: Dtype) -> Result<Residual> {
    let has = be.residual_epilogue(compute);
    in_gemm(
        RESIDUAL_ENV,
        "residual",
        has,
        compute != Dtype::F32,
        be,
        compute,
    )
}

/// Whether an op (`what`) runs in a GEMM's epilogue, as environment variable `env` says:
/// `epilogue` where the backend `has` one (refused by name where it has not), `separate`
/// never, `auto` or unset where it has one and `auto_takes` it.
fn in_gemm(
    env: &str,
    what: &str,
    has: bool,
    auto_takes: bool,
    be: &impl Backend,
    compute: Dtype,
) -> Result<InGemm> {
    let asked = std::env::var(env).unwrap_or_default();
    Ok(match (asked.as_str(), has) {
        ("" | "auto", true) if auto_takes => InGemm::Epilogue,
        ("epilogue", true) => InGemm::Epilogue,
        ("" | "auto" | "separate", _) => InGemm::Separate,
        ("epilogue", false) => bail!(
            "{env}=epilogue: the {} backend has no {what} epilogue for activations stored as {}",
            be.name(),
            compute.name()
        ),
        (other, _) => bail!("{env}={other}: expected auto, epilogue or separate"),
    })
}

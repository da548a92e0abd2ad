//! The `FUGU_*` environment settings that choose among equivalent forms of an op (for
//! benchmarks, A/B runs and tests; every one has a default measured or reasoned where it is
//! used): read here and nowhere else, into one typed [`Knobs`], when a model or a backend is
//! built. A value a setting does not take is an error naming the setting and its values. The
//! forms that ran are recorded in the run header (`attention`, `mlp_gelu`, `residual`; the
//! backend's `kernels`).
//!
//! | setting | values | who reads it |
//! |---|---|---|
//! | `FUGU_ATTENTION` | `auto`, `fused`, `materialized` | the model (`model/paths.rs`) |
//! | `FUGU_MLP_GELU` | `auto`, `epilogue`, `separate` | the model |
//! | `FUGU_RESIDUAL` | `auto`, `epilogue`, `separate` | the model |
//! | `FUGU_FLASH_WARP_ROWS` | `16`, `32`, or `F,Q,KV` | the CUDA backend (`backend/cuda/forms.rs`) |
//! | `FUGU_FLASH_QUERY_ROWS` | `64`, `128` | the CUDA backend |
//! | `FUGU_LAYERNORM_BACKWARD` | `split`, `fused` | the CUDA backend |
//! | `FUGU_CROSS_ENTROPY` | `split`, `fused` | the CUDA backend (the cross-entropy without TP) |
//! | `FUGU_FLASH_MMA` | `sync`, `wgmma` | the CUDA backend |
//! | `FUGU_FLASH_BACKWARD` | `split`, `fused`, `stored` | the CUDA backend |
//! | `FUGU_BIAS_GRAD` | `separate`, `epilogue` | the CUDA backend |
//! | `FUGU_FLASH_SELECT` | `settings`, `timed` | the CUDA backend's fused attention (`backend/cuda/attention_select.rs`) |
//! | `FUGU_GEMM_SELECT` | `first`, `timed` | the CUDA backend's cuBLASLt calls (`backend/cuda/lt.rs`) |
//!
//! Not op forms, and read where they apply: `FUGU_CUDA_AWARE_MPI` (`off`, `auto`, `on`; the
//! data-parallel buckets' memory, `parallel/grad_sync.rs`), `FUGU_GEMM_CACHE` (the timed
//! cuBLASLt choices' directory, `backend/cuda/algo_cache.rs`), `FUGU_ATTENTION_CACHE` (the
//! timed attention forms', `backend/cuda/attention_select.rs`).

use anyhow::{anyhow, Result};

/// Whether an op runs on its own or inside a GEMM's epilogue: the model's choices for the
/// MLP's GELU and a projection's residual add (`model::paths`), a backend's for a linear
/// layer's bias gradient (the CUDA backend's `FUGU_BIAS_GRAD`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InGemm {
    /// Its own op, timed under its own name.
    #[default]
    Separate,
    /// In a GEMM's epilogue, timed as the GEMM it is part of.
    Epilogue,
}

impl InGemm {
    /// The name in the run header (`"mlp_gelu"`, `"residual"`, `"kernels"`) and logs, and
    /// the settings' value.
    pub fn name(self) -> &'static str {
        match self {
            InGemm::Separate => "separate",
            InGemm::Epilogue => "epilogue",
        }
    }
}

/// A kernel setting's two forms: the work in more kernels or passes, or fused into fewer.
/// Each setting declares its measured default beside it (`backend/cuda/forms.rs`). Both forms
/// compute the same values up to the order of f32 sums.
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

/// The tensor-core instruction of the fused attention kernels that have a form for each
/// (`FUGU_FLASH_MMA`): `mma.sync` per warp (every sm_80+ GPU), or Hopper's warpgroup `wgmma`
/// (compute capability 9.0 only; 16 rows per warp): the forward kernel, and the
/// backward pass's with stored dS (`FUGU_FLASH_BACKWARD=stored`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlashMma {
    #[default]
    Sync,
    Wgmma,
}

impl FlashMma {
    /// The setting's value for this form (the run header shows it).
    pub fn name(self) -> &'static str {
        match self {
            FlashMma::Sync => "sync",
            FlashMma::Wgmma => "wgmma",
        }
    }
}

/// Whether the warpgroup-MMA forward overlaps each key block's softmax with the previous
/// block's P·V product (`FUGU_FLASH_OVERLAP`; the CUDA backend's `forms.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlashOverlap {
    #[default]
    Off,
    On,
}

impl FlashOverlap {
    /// The setting's value for this form (the run header shows it).
    pub fn name(self) -> &'static str {
        match self {
            FlashOverlap::Off => "off",
            FlashOverlap::On => "on",
        }
    }
}

/// How the fused attention's backward pass runs (`FUGU_FLASH_BACKWARD`; the CUDA backend's
/// `forms.rs` says what each form launches and which is the default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashBackward {
    /// A dQ kernel, then a dK/dV kernel: each computes the tiles' probabilities and dS.
    Split,
    /// One kernel: dQ's shares added across key blocks in a fixed order.
    Fused,
    /// The dK/dV kernel stores dS; a dQ kernel multiplies it by K.
    Stored,
}

impl FlashBackward {
    /// The setting's value for this form (the run header shows it).
    pub fn name(self) -> &'static str {
        match self {
            FlashBackward::Split => "split",
            FlashBackward::Fused => "fused",
            FlashBackward::Stored => "stored",
        }
    }

    /// The value `v` of setting `env`: empty (`default`), `split`, `fused` or `stored`.
    pub fn parse(env: &str, v: &str, default: FlashBackward) -> Result<FlashBackward> {
        parse_form(
            env,
            v,
            default,
            &[
                FlashBackward::Split,
                FlashBackward::Fused,
                FlashBackward::Stored,
            ],
            Self::name,
        )
    }
}

/// Rows per warp (16 or 32) of each fused attention kernel: query rows for the forward and dQ
/// kernels, keys for the dK/dV kernel (`FUGU_FLASH_WARP_ROWS`).
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
            anyhow!(
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
}

/// Query rows per block of the fused attention's forward and dQ kernels
/// (`FUGU_FLASH_QUERY_ROWS`): 64 (the default) or 128, each block then loading every key and
/// value tile once for twice the rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashQueryRows(pub usize);

impl Default for FlashQueryRows {
    fn default() -> Self {
        FlashQueryRows(64)
    }
}

impl FlashQueryRows {
    /// [`FLASH_QUERY_ROWS_ENV`]'s value: empty (the default), `64` or `128`.
    pub fn parse(v: &str) -> Result<FlashQueryRows> {
        match v.trim() {
            "" => Ok(Self::default()),
            "64" => Ok(FlashQueryRows(64)),
            "128" => Ok(FlashQueryRows(128)),
            _ => Err(anyhow!(
                "{FLASH_QUERY_ROWS_ENV}={v}: expected 64 or 128 (query rows per block of the \
                 forward and dQ attention kernels)"
            )),
        }
    }
}

/// How a GPU GEMM's algorithm is chosen (`FUGU_GEMM_SELECT`): the fastest of cuBLASLt's
/// candidates, timed once per shape and kept on disk (the default: 1.4% faster per GPT-2 124M
/// step on an H200, docs/TRAINING.md), or cuBLAS's/cuBLASLt's first heuristic choice.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmSelect {
    First,
    #[default]
    Timed,
}

impl GemmSelect {
    /// The setting's value for this choice.
    pub fn name(self) -> &'static str {
        match self {
            GemmSelect::First => "first",
            GemmSelect::Timed => "timed",
        }
    }
}

/// How the fused attention's form is chosen on a GPU (`FUGU_FLASH_SELECT`): as the
/// `FUGU_FLASH_*` form settings give it (the default: their measured defaults where unset), or
/// the fastest of every form the device runs, timed once per shape and pass and kept on disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlashSelect {
    #[default]
    Settings,
    Timed,
}

impl FlashSelect {
    /// The setting's value for this choice.
    pub fn name(self) -> &'static str {
        match self {
            FlashSelect::Settings => "settings",
            FlashSelect::Timed => "timed",
        }
    }
}

/// The attention path asked for (`FUGU_ATTENTION`); the backend's support decides `Auto`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionAsk {
    #[default]
    Auto,
    Fused,
    Materialized,
}

/// Environment variable that overrides the backend's attention path: `fused` or
/// `materialized` (default `auto`).
pub const ATTENTION_ENV: &str = "FUGU_ATTENTION";
/// Environment variable that overrides where the MLP's GELU runs: `epilogue` or `separate`
/// (default `auto`: in the epilogues where the backend has them).
pub const MLP_GELU_ENV: &str = "FUGU_MLP_GELU";
/// Environment variable that picks how projections join the residual stream: `epilogue` or
/// `separate` (default `auto`: in the GEMM for 16-bit activations where the backend has it).
pub const RESIDUAL_ENV: &str = "FUGU_RESIDUAL";
/// Environment variable: rows per warp of the fused attention kernels ([`FlashWarpRows`]).
pub const FLASH_WARP_ROWS_ENV: &str = "FUGU_FLASH_WARP_ROWS";
/// Environment variable: query rows per block of the fused attention's forward and dQ kernels
/// ([`FlashQueryRows`]).
pub const FLASH_QUERY_ROWS_ENV: &str = "FUGU_FLASH_QUERY_ROWS";
/// Environment variable: the layernorm backward's form, `fused` or `split`.
pub const LAYERNORM_BACKWARD_ENV: &str = "FUGU_LAYERNORM_BACKWARD";
/// Environment variable: the one-shard cross-entropy's form, `split` (its phases' kernels) or
/// `fused` (one kernel).
pub const CROSS_ENTROPY_ENV: &str = "FUGU_CROSS_ENTROPY";
/// Environment variable: the fused attention kernels' tensor-core instruction, `sync` or
/// `wgmma` ([`FlashMma`]).
pub const FLASH_MMA_ENV: &str = "FUGU_FLASH_MMA";
/// Environment variable: whether the wgmma attention forward overlaps softmax with the last
/// block's product, `off` or `on` ([`FlashOverlap`]).
pub const FLASH_OVERLAP_ENV: &str = "FUGU_FLASH_OVERLAP";
/// Environment variable: the fused attention backward's form, `split`, `fused` or `stored`.
pub const FLASH_BACKWARD_ENV: &str = "FUGU_FLASH_BACKWARD";
/// Environment variable: a linear layer's bias gradient, `separate` or `epilogue`.
pub const BIAS_GRAD_ENV: &str = "FUGU_BIAS_GRAD";
/// Environment variable: how a GPU GEMM's algorithm is chosen, `first` or `timed`
/// ([`GemmSelect`]).
pub const GEMM_SELECT_ENV: &str = "FUGU_GEMM_SELECT";
/// Environment variable: how the fused attention's form is chosen, `settings` or `timed`
/// ([`FlashSelect`]).
pub const FLASH_SELECT_ENV: &str = "FUGU_FLASH_SELECT";
/// The settings that pick the fused attention's form, which [`FlashSelect::Timed`] chooses
/// itself.
pub const FLASH_FORM_ENVS: [&str; 5] = [
    FLASH_WARP_ROWS_ENV,
    FLASH_QUERY_ROWS_ENV,
    FLASH_MMA_ENV,
    FLASH_OVERLAP_ENV,
    FLASH_BACKWARD_ENV,
];

/// Every op-form setting, as asked (module docs): `None` / `Auto` where unset, for the code
/// that builds the model or backend to decide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Knobs {
    pub attention: AttentionAsk,
    /// `None`: `auto`.
    pub mlp_gelu: Option<InGemm>,
    /// `None`: `auto`.
    pub residual: Option<InGemm>,
    pub flash_warp_rows: FlashWarpRows,
    pub flash_query_rows: FlashQueryRows,
    pub flash_mma: FlashMma,
    pub flash_overlap: FlashOverlap,
    /// `None`: the backend's measured default.
    pub layernorm_backward: Option<KernelForm>,
    /// `None`: the backend's measured default.
    pub cross_entropy: Option<KernelForm>,
    /// `None`: the backend's measured default.
    pub flash_backward: Option<FlashBackward>,
    pub bias_grad: InGemm,
    pub gemm_select: GemmSelect,
    pub flash_select: FlashSelect,
}

impl Knobs {
    /// The settings in this process's environment.
    pub fn from_env() -> Result<Knobs> {
        Knobs::read(|k| std::env::var(k).ok())
    }

    /// The settings `get` gives (an unset or empty setting is its default); a form setting of
    /// the fused attention beside `FUGU_FLASH_SELECT=timed` is an error naming both.
    pub fn read(get: impl Fn(&str) -> Option<String>) -> Result<Knobs> {
        let var = |k: &str| get(k).unwrap_or_default();
        let flash_select = parse_form(
            FLASH_SELECT_ENV,
            &var(FLASH_SELECT_ENV),
            FlashSelect::Settings,
            &[FlashSelect::Settings, FlashSelect::Timed],
            FlashSelect::name,
        )?;
        if flash_select == FlashSelect::Timed {
            if let Some(k) = FLASH_FORM_ENVS.iter().find(|k| !var(k).is_empty()) {
                return Err(anyhow!(
                    "{FLASH_SELECT_ENV}=timed chooses the attention's form by timing every                      form, so {k}={} would be ignored: unset one of the two",
                    var(k)
                ));
            }
        }
        Ok(Knobs {
            flash_select,
            attention: parse_attention(&var(ATTENTION_ENV))?,
            mlp_gelu: parse_in_gemm_auto(MLP_GELU_ENV, &var(MLP_GELU_ENV))?,
            residual: parse_in_gemm_auto(RESIDUAL_ENV, &var(RESIDUAL_ENV))?,
            flash_warp_rows: FlashWarpRows::parse(&var(FLASH_WARP_ROWS_ENV))?,
            flash_query_rows: FlashQueryRows::parse(&var(FLASH_QUERY_ROWS_ENV))?,
            flash_mma: parse_form(
                FLASH_MMA_ENV,
                &var(FLASH_MMA_ENV),
                FlashMma::Sync,
                &[FlashMma::Sync, FlashMma::Wgmma],
                FlashMma::name,
            )?,
            flash_overlap: parse_form(
                FLASH_OVERLAP_ENV,
                &var(FLASH_OVERLAP_ENV),
                FlashOverlap::Off,
                &[FlashOverlap::Off, FlashOverlap::On],
                FlashOverlap::name,
            )?,
            layernorm_backward: unset_or(
                LAYERNORM_BACKWARD_ENV,
                &var(LAYERNORM_BACKWARD_ENV),
                |k, v| KernelForm::parse(k, v, KernelForm::Split),
            )?,
            cross_entropy: unset_or(CROSS_ENTROPY_ENV, &var(CROSS_ENTROPY_ENV), |k, v| {
                KernelForm::parse(k, v, KernelForm::Split)
            })?,
            flash_backward: unset_or(FLASH_BACKWARD_ENV, &var(FLASH_BACKWARD_ENV), |k, v| {
                FlashBackward::parse(k, v, FlashBackward::Split)
            })?,
            bias_grad: parse_in_gemm(BIAS_GRAD_ENV, &var(BIAS_GRAD_ENV))?,
            gemm_select: parse_form(
                GEMM_SELECT_ENV,
                &var(GEMM_SELECT_ENV),
                GemmSelect::Timed,
                &[GemmSelect::Timed, GemmSelect::First],
                GemmSelect::name,
            )?,
        })
    }
}

/// `None` where setting `env` is unset or empty (the user of the setting decides), else its
/// value `v` as `parse` reads it.
fn unset_or<F>(env: &str, v: &str, parse: impl Fn(&str, &str) -> Result<F>) -> Result<Option<F>> {
    (!v.is_empty()).then(|| parse(env, v)).transpose()
}

fn parse_attention(v: &str) -> Result<AttentionAsk> {
    Ok(match v {
        "" | "auto" => AttentionAsk::Auto,
        "fused" => AttentionAsk::Fused,
        "materialized" => AttentionAsk::Materialized,
        other => {
            return Err(anyhow!(
                "{ATTENTION_ENV}={other}: expected auto, fused or materialized"
            ))
        }
    })
}

/// `auto` (or empty: `None`), `epilogue` or `separate`.
fn parse_in_gemm_auto(env: &str, v: &str) -> Result<Option<InGemm>> {
    match v {
        "" | "auto" => Ok(None),
        "epilogue" => Ok(Some(InGemm::Epilogue)),
        "separate" => Ok(Some(InGemm::Separate)),
        other => Err(anyhow!(
            "{env}={other}: expected auto, epilogue or separate"
        )),
    }
}

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

/// `v`, the value of setting `env`, as the one of `forms` that `name` calls so (empty:
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
            let (last, rest) = names.split_last().expect("a setting has forms");
            let listed = if rest.is_empty() {
                last.to_string()
            } else {
                format!("{} or {last}", rest.join(", "))
            };
            anyhow!("{env}={v}: expected {listed}")
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn read(pairs: &[(&str, &str)]) -> Result<Knobs> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Knobs::read(|k| m.get(k).cloned())
    }

    #[test]
    fn unset_is_every_default_and_values_are_typed() {
        assert_eq!(read(&[]).unwrap(), Knobs::default());
        let k = read(&[
            (ATTENTION_ENV, "fused"),
            (MLP_GELU_ENV, "separate"),
            (RESIDUAL_ENV, "auto"),
            (FLASH_WARP_ROWS_ENV, "32,16,32"),
            (FLASH_QUERY_ROWS_ENV, "128"),
            (FLASH_MMA_ENV, "wgmma"),
            (FLASH_OVERLAP_ENV, "on"),
            (LAYERNORM_BACKWARD_ENV, "split"),
            (CROSS_ENTROPY_ENV, "fused"),
            (FLASH_BACKWARD_ENV, "stored"),
            (BIAS_GRAD_ENV, "epilogue"),
            (GEMM_SELECT_ENV, "first"),
        ])
        .unwrap();
        assert_eq!(k.flash_select, FlashSelect::Settings);
        let timed = read(&[(FLASH_SELECT_ENV, "timed"), (FLASH_MMA_ENV, "")]).unwrap();
        assert_eq!(timed.flash_select, FlashSelect::Timed);
        assert_eq!(k.attention, AttentionAsk::Fused);
        assert_eq!(k.mlp_gelu, Some(InGemm::Separate));
        assert_eq!(k.residual, None);
        assert_eq!(k.flash_warp_rows.dq, 16);
        assert_eq!(k.flash_query_rows, FlashQueryRows(128));
        assert_eq!(k.flash_mma, FlashMma::Wgmma);
        assert_eq!(k.flash_overlap, FlashOverlap::On);
        assert_eq!(k.layernorm_backward, Some(KernelForm::Split));
        assert_eq!(k.cross_entropy, Some(KernelForm::Fused));
        assert_eq!(k.flash_backward, Some(FlashBackward::Stored));
        assert_eq!(k.bias_grad, InGemm::Epilogue);
        assert_eq!(k.gemm_select, GemmSelect::First);
    }

    #[test]
    fn a_bad_value_names_the_setting_and_its_values() {
        for (k, v, want) in [
            (
                ATTENTION_ENV,
                "flash",
                "FUGU_ATTENTION=flash: expected auto, fused or materialized",
            ),
            (
                RESIDUAL_ENV,
                "yes",
                "FUGU_RESIDUAL=yes: expected auto, epilogue or separate",
            ),
            (
                FLASH_BACKWARD_ENV,
                "one",
                "FUGU_FLASH_BACKWARD=one: expected split, fused or stored",
            ),
            (
                BIAS_GRAD_ENV,
                "auto",
                "FUGU_BIAS_GRAD=auto: expected separate or epilogue",
            ),
            (
                GEMM_SELECT_ENV,
                "best",
                "FUGU_GEMM_SELECT=best: expected timed or first",
            ),
            (
                FLASH_MMA_ENV,
                "tma",
                "FUGU_FLASH_MMA=tma: expected sync or wgmma",
            ),
            (
                FLASH_OVERLAP_ENV,
                "yes",
                "FUGU_FLASH_OVERLAP=yes: expected off or on",
            ),
            (
                FLASH_SELECT_ENV,
                "fastest",
                "FUGU_FLASH_SELECT=fastest: expected settings or timed",
            ),
            (
                FLASH_QUERY_ROWS_ENV,
                "96",
                "FUGU_FLASH_QUERY_ROWS=96: expected 64 or 128 (query rows per block of the \
                 forward and dQ attention kernels)",
            ),
        ] {
            let e = read(&[(k, v)]).unwrap_err().to_string();
            assert_eq!(e, want);
        }
    }

    #[test]
    fn timed_attention_forms_refuse_a_form_setting_beside_them() {
        for k in FLASH_FORM_ENVS {
            let e = read(&[(FLASH_SELECT_ENV, "timed"), (k, "16")])
                .unwrap_err()
                .to_string();
            assert!(
                e.starts_with("FUGU_FLASH_SELECT=timed chooses the attention's form")
                    && e.contains(&format!("{k}=16 would be ignored")),
                "{e}"
            );
        }
    }
}

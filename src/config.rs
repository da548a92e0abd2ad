//! Model and training configuration: TOML files in `configs/` (also built into the binary, so
//! `--config gpt2-124m` works anywhere), with every field overridable from the command line.
//! Unknown keys are errors, and validation names the offending field.

use crate::dtype::Dtype;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// A model family (`arch` in `[model]`): which model `crate::model::registry` builds from
/// a [`ModelConfig`].
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-2: pre-LN, tanh-GELU MLP, learned positions, tied embeddings, biases.
    #[default]
    Gpt2,
    /// The Llama family: pre-RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention,
    /// no biases, tied or untied LM head.
    Llama,
}

impl Arch {
    /// Every architecture fugu builds.
    pub const ALL: [Arch; 2] = [Arch::Gpt2, Arch::Llama];

    /// The name in configs (`arch = "gpt2"`) and in Hugging Face's `model_type`.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Gpt2 => "gpt2",
            Arch::Llama => "llama",
        }
    }

    /// The architecture whose name (or Hugging Face `model_type`) is `name`.
    pub fn from_name(name: &str) -> Option<Arch> {
        Arch::ALL.into_iter().find(|a| a.name() == name)
    }

    /// GPT-2 is the default and is left out of serialised configs, so that every config,
    /// `state.json` and checkpoint written before `arch` existed reads the same and a GPT-2
    /// run writes the same bytes as before.
    fn is_default(&self) -> bool {
        *self == Arch::default()
    }
}

/// Largest model width, head count, head size, MLP width or context a config may give.
pub const MAX_DIM: usize = 1 << 20;
/// Most transformer blocks a config may give.
pub const MAX_LAYERS: usize = 10_000;
/// Most weights a model may have (10¹³: 40 TB in f32, beyond any machine fugu runs on).
pub const MAX_PARAMS: f64 = 1e13;

/// A model's shape: the architecture and its dimensions.
///
/// The fields after `n_layer` are the Llama family's (absent for GPT-2, whose files then read
/// and write the same bytes as before they existed); read them through the accessors
/// ([`ModelConfig::kv_heads`], ...), which give the architecture's defaults.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model family (default GPT-2).
    #[serde(default, skip_serializing_if = "Arch::is_default")]
    pub arch: Arch,
    /// Vocabulary size as stored in files (padded to a multiple of 128 inside the model).
    pub vocab_size: usize,
    /// Maximum sequence length (rows of the position embedding).
    pub n_positions: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Key/value heads (grouped-query attention; default `n_head`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n_kv_head: Option<usize>,
    /// Size of one attention head (default `n_embd / n_head`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Width of the MLP's hidden layer (GPT-2: `4 * n_embd`; Llama: required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intermediate_size: Option<usize>,
    /// Base of the rotary embeddings' frequencies (default 10000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Epsilon of the RMS norms (default 1e-6, as `LlamaConfig`'s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_eps: Option<f64>,
    /// Whether the LM head is the token embedding (default false for Llama).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_embeddings: Option<bool>,
}

/// The Llama family's settings, named as in `[model]`, for the messages that refuse them on
/// another architecture.
const LLAMA_FIELDS: [&str; 6] = [
    "n_kv_head",
    "head_dim",
    "intermediate_size",
    "rope_theta",
    "norm_eps",
    "tie_embeddings",
];

/// The token ids a checkpoint's `config.json` (`bos_token_id`, `eos_token_id`) and
/// `generation_config.json` name: the tokenizer's when the run's data records one (a Llama
/// tokenizer's `<s>`/`</s>` are 1/2), else [`ModelConfig::special_ids`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecialIds {
    /// Beginning of text.
    pub bos: usize,
    /// End of text (where generation stops; also the padding id).
    pub eos: usize,
}

impl ModelConfig {
    /// The special ids a checkpoint's `config.json` names when no tokenizer says otherwise
    /// (see [`SpecialIds`]): GPT-2's `<|endoftext|>` (50256) as both when the vocabulary has
    /// it, else the last id (where fugu's trained tokenizers put `<|endoftext|>`).
    pub fn special_ids(&self) -> SpecialIds {
        let eot = 50256.min(self.vocab_size.saturating_sub(1));
        SpecialIds { bos: eot, eos: eot }
    }

    /// Key/value heads (`n_head` without grouped-query attention).
    pub fn kv_heads(&self) -> usize {
        self.n_kv_head.unwrap_or(self.n_head)
    }

    /// Size of one attention head.
    pub fn head_size(&self) -> usize {
        self.head_dim.unwrap_or(self.n_embd / self.n_head.max(1))
    }

    /// Width of the MLP's hidden layer.
    pub fn mlp_width(&self) -> usize {
        self.intermediate_size.unwrap_or(4 * self.n_embd)
    }

    /// Base of the rotary embeddings' frequencies.
    pub fn rope_base(&self) -> f64 {
        self.rope_theta.unwrap_or(10000.0)
    }

    /// Epsilon of the model's norms (GPT-2's layernorms: 1e-5).
    pub fn norm_epsilon(&self) -> f64 {
        match self.arch {
            Arch::Gpt2 => 1e-5,
            Arch::Llama => self.norm_eps.unwrap_or(1e-6),
        }
    }

    /// Whether the LM head is the token embedding.
    pub fn tied(&self) -> bool {
        match self.arch {
            Arch::Gpt2 => true,
            Arch::Llama => self.tie_embeddings.unwrap_or(false),
        }
    }

    /// The same model with every field its architecture has written out (a Llama config's
    /// defaults filled in), so that two configs of one model compare equal whether they came
    /// from a TOML file that left fields out or from a Hugging Face `config.json`. GPT-2's has
    /// none of the Llama fields (its files' bytes stay as they were).
    pub fn normalized(&self) -> ModelConfig {
        match self.arch {
            Arch::Gpt2 => self.clone(),
            Arch::Llama => ModelConfig {
                n_kv_head: Some(self.kv_heads()),
                head_dim: Some(self.head_size()),
                intermediate_size: self.intermediate_size,
                rope_theta: Some(self.rope_base()),
                norm_eps: Some(self.norm_epsilon()),
                tie_embeddings: Some(self.tied()),
                ..self.clone()
            },
        }
    }

    /// The names of the Llama-family fields this config sets.
    fn llama_fields_set(&self) -> Vec<&'static str> {
        let set = [
            self.n_kv_head.is_some(),
            self.head_dim.is_some(),
            self.intermediate_size.is_some(),
            self.rope_theta.is_some(),
            self.norm_eps.is_some(),
            self.tie_embeddings.is_some(),
        ];
        LLAMA_FIELDS
            .into_iter()
            .zip(set)
            .filter_map(|(n, s)| s.then_some(n))
            .collect()
    }

    /// Refuses shapes beyond any machine fugu runs on before a table of them is built (a
    /// `--set model.n_layer=2147483648` would list two billion layers' tensors): each size
    /// within [`MAX_DIM`] (layers within [`MAX_LAYERS`]), and the weights, counted in f64 so that
    /// nothing overflows, at most [`MAX_PARAMS`].
    fn check_scale(&self) -> Result<()> {
        let m = self;
        for (name, v) in [
            ("model.n_positions", m.n_positions),
            ("model.n_embd", m.n_embd),
            ("model.n_head", m.n_head),
            ("model.n_kv_head", m.kv_heads()),
            ("model.head_dim", m.head_dim.unwrap_or(1)),
            ("model.intermediate_size", m.intermediate_size.unwrap_or(1)),
        ] {
            if v > MAX_DIM {
                bail!("{name} = {v}: expected at most {MAX_DIM}");
            }
        }
        if m.n_layer > MAX_LAYERS {
            bail!(
                "model.n_layer = {}: expected at most {MAX_LAYERS}",
                m.n_layer
            );
        }
        let (e, l) = (m.n_embd as f64, m.n_layer as f64);
        let attn = (m.n_head + 2 * m.kv_heads()) as f64 * m.head_size() as f64 * e * 2.0;
        let mlp = 3.0 * e * m.mlp_width() as f64;
        let params = l * (attn + mlp) + 2.0 * m.vocab_size as f64 * e + m.n_positions as f64 * e;
        if params > MAX_PARAMS {
            bail!(
                "model: about {params:.3e} weights (n_layer {}, n_embd {}, vocab {}): more than \
                 fugu can hold ({MAX_PARAMS:.0e})",
                m.n_layer,
                m.n_embd,
                m.vocab_size
            );
        }
        Ok(())
    }

    /// Checks the shape: sizes at least 1, heads that divide what they split, and only the
    /// fields the architecture has; errors name the field (`model.` + its name).
    pub fn validate(&self) -> Result<()> {
        let m = self;
        let positive = [
            ("model.vocab_size", m.vocab_size),
            ("model.n_positions", m.n_positions),
            ("model.n_embd", m.n_embd),
            ("model.n_head", m.n_head),
            ("model.n_layer", m.n_layer),
            ("model.n_kv_head", m.kv_heads()),
            ("model.head_dim", m.head_dim.unwrap_or(1)),
            ("model.intermediate_size", m.intermediate_size.unwrap_or(1)),
        ];
        for (name, v) in positive {
            if v == 0 {
                bail!("{name} = 0: must be at least 1");
            }
        }
        if m.vocab_size > u32::MAX as usize / 2 {
            bail!("model.vocab_size = {} is too large", m.vocab_size);
        }
        m.check_scale()?;
        match m.arch {
            Arch::Gpt2 => {
                if let Some(f) = m.llama_fields_set().first() {
                    bail!(
                        "model.{f} is a Llama setting: GPT-2 has no such field (arch = \"gpt2\")"
                    );
                }
                if !m.n_embd.is_multiple_of(m.n_head) {
                    bail!(
                        "model.n_embd = {} is not divisible by model.n_head = {}",
                        m.n_embd,
                        m.n_head
                    );
                }
            }
            Arch::Llama => {
                if m.intermediate_size.is_none() {
                    bail!(
                        "model.intermediate_size is missing: the Llama family needs the MLP width"
                    );
                }
                if m.head_dim.is_none() && !m.n_embd.is_multiple_of(m.n_head) {
                    bail!(
                        "model.n_embd = {} is not divisible by model.n_head = {} (or set model.head_dim)",
                        m.n_embd,
                        m.n_head
                    );
                }
                if !m.n_head.is_multiple_of(m.kv_heads()) {
                    bail!(
                        "model.n_kv_head = {} does not divide model.n_head = {}",
                        m.kv_heads(),
                        m.n_head
                    );
                }
                if !m.head_size().is_multiple_of(2) {
                    bail!(
                        "model.head_dim = {}: rotary embeddings need an even head size",
                        m.head_size()
                    );
                }
                if !(m.rope_base().is_finite() && m.rope_base() > 1.0) {
                    bail!(
                        "model.rope_theta = {}: expected a number above 1",
                        m.rope_base()
                    );
                }
                let eps = m.norm_epsilon();
                if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
                    bail!("model.norm_eps = {eps}: expected a positive number below 1");
                }
            }
        }
        Ok(())
    }
}

/// Learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// Linear warmup, then cosine decay to `min_lr` at the last step.
    Cosine,
    /// Linear warmup, then constant `lr`.
    Constant,
}

/// Numeric precision of a training run (`--precision`): what activations and the parameters
/// the passes read are stored in. Master weights, gradients, AdamW moments, the optimizer step
/// and every reduction stay f32 in all three.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Everything f32.
    #[default]
    Fp32,
    /// bfloat16 activations and GEMM operands (f32 range: no loss scaling).
    Bf16,
    /// IEEE half activations and GEMM operands, with dynamic loss scaling.
    Fp16,
}

impl Precision {
    /// Storage type of activations and of the parameters' compute copy.
    pub fn compute_dtype(self) -> Dtype {
        match self {
            Precision::Fp32 => Dtype::F32,
            Precision::Bf16 => Dtype::Bf16,
            Precision::Fp16 => Dtype::F16,
        }
    }

    /// The name used in configs, flags and logs.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

/// Optimisation and run-length settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfig {
    pub batch_size: usize,
    pub seq_len: usize,
    pub steps: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: usize,
    pub lr_schedule: LrSchedule,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    /// Global-norm gradient clipping; 0 turns it off.
    pub grad_clip: f64,
    pub seed: u64,
    /// Evaluate on the validation split every N steps (0 = never).
    pub eval_every: usize,
    /// Checkpoint every N steps (0 = only at the end).
    pub ckpt_every: usize,
    /// Numeric precision (fp32 when absent: configs and checkpoints from before it existed).
    #[serde(default)]
    pub precision: Precision,
}

/// Command-line overrides of [`TrainConfig`] fields (`fugu train --batch-size 4 ...`): `None`
/// keeps the config's value. Field names are [`TrainConfig`]'s, so one serde map relates the two
/// (no second list of fields): [`TrainOverrides::apply`] and [`TrainOverrides::given`].
#[derive(Clone, Debug, Default, Serialize, clap::Args)]
pub struct TrainOverrides {
    /// Sequences per step on each data-parallel rank.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<usize>,
    /// Tokens per sequence (at most the model's n_positions).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<usize>,
    /// Optimizer steps of the whole run (a resumed run may extend it).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<usize>,
    /// Peak learning rate.
    #[arg(long, value_parser = finite_f64)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// Learning rate at the end of the cosine decay.
    #[arg(long, value_parser = finite_f64)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_lr: Option<f64>,
    /// Steps of linear warmup from 0 to --lr.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup_steps: Option<usize>,
    /// After warmup: cosine decay to --min-lr at the last step, or constant --lr.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lr_schedule: Option<LrSchedule>,
    /// AdamW decoupled weight decay (2-D tensors only: matrices and embeddings).
    #[arg(long, value_parser = finite_f64)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// AdamW first-moment decay.
    #[arg(long, value_parser = finite_f64)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta1: Option<f64>,
    /// AdamW second-moment decay.
    #[arg(long, value_parser = finite_f64)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub beta2: Option<f64>,
    /// AdamW epsilon.
    #[arg(long, value_parser = finite_f64)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
    /// Global-norm gradient clipping (0 = off).
    #[arg(long, value_parser = finite_f64)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_clip: Option<f64>,
    /// Seed of the random init and of the data order.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Evaluate on the validation data every N steps (0 = never).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_every: Option<usize>,
    /// Checkpoint every N steps (0 = only at the end).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ckpt_every: Option<usize>,
    /// Numeric precision: fp32, or mixed precision with bf16 or fp16 activations and GEMM
    /// operands (f32 master weights, gradients and optimizer; fp16 adds dynamic loss scaling).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub precision: Option<Precision>,
}

/// Parses a flag's number, refusing NaN and infinities (which no setting means, and which
/// JSON, where settings are stored, cannot hold).
pub fn finite_f64(s: &str) -> std::result::Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(v) => Err(format!("{v} is not a finite number")),
        Err(_) => Err(format!("`{s}` is not a number")),
    }
}

impl TrainOverrides {
    /// The given fields, by [`TrainConfig`] field name.
    pub fn given(&self) -> serde_json::Map<String, serde_json::Value> {
        match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => unreachable!("TrainOverrides serialises to a JSON object"),
        }
    }

    /// `t` with every given field replaced.
    pub fn apply(&self, t: &TrainConfig) -> TrainConfig {
        with_train_fields(t, self.given())
    }
}

/// `t` with the fields in `changes` (values of [`train_fields`]' types) replaced.
pub fn with_train_fields(
    t: &TrainConfig,
    changes: serde_json::Map<String, serde_json::Value>,
) -> TrainConfig {
    let mut fields = train_fields(t);
    fields.extend(changes);
    serde_json::from_value(serde_json::Value::Object(fields))
        .expect("changes have TrainConfig's field names and types")
}

/// `t` as a map from field name to value.
pub fn train_fields(t: &TrainConfig) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::to_value(t) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => unreachable!("TrainConfig serialises to a JSON object"),
    }
}

/// The command-line flag of a [`TrainConfig`] field (`batch_size` → `--batch-size`).
pub fn train_flag(field: &str) -> String {
    format!("--{}", field.replace('_', "-"))
}

/// A whole config file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    pub model: ModelConfig,
    pub train: TrainConfig,
}

/// Configs shipped with fugu, by name.
pub const BUILTIN: [(&str, &str); 14] = [
    ("gpt2-tiny-4k", include_str!("../configs/gpt2-tiny-4k.toml")),
    ("gpt2-tiny", include_str!("../configs/gpt2-tiny.toml")),
    ("gpt2-124m", include_str!("../configs/gpt2-124m.toml")),
    ("gpt2-350m", include_str!("../configs/gpt2-350m.toml")),
    ("gpt2-774m", include_str!("../configs/gpt2-774m.toml")),
    ("gpt2-1.5b", include_str!("../configs/gpt2-1.5b.toml")),
    ("gpt-1.3b", include_str!("../configs/gpt-1.3b.toml")),
    ("gpt-30b", include_str!("../configs/gpt-30b.toml")),
    (
        "fugaku-llm-13b",
        include_str!("../configs/fugaku-llm-13b.toml"),
    ),
    (
        "llama-tiny-4k",
        include_str!("../configs/llama-tiny-4k.toml"),
    ),
    ("llama-124m", include_str!("../configs/llama-124m.toml")),
    ("llama-d128", include_str!("../configs/llama-d128.toml")),
    (
        "tinyllama-1.1b",
        include_str!("../configs/tinyllama-1.1b.toml"),
    ),
    ("llm-jp-3-13b", include_str!("../configs/llm-jp-3-13b.toml")),
];

/// Puts `over`'s values into `base`: tables merged key by key, anything else replaced.
fn merge_toml(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge_toml(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Applies one `--set SECTION.FIELD=VALUE`.
fn apply_set(table: &mut toml::Table, set: &str) -> Result<()> {
    let Some((key, value)) = set.split_once('=') else {
        bail!("--set {set:?}: expected SECTION.FIELD=VALUE, e.g. train.lr=3e-4");
    };
    let Some((section, field)) = key.trim().split_once('.') else {
        bail!("--set {set:?}: name the section, e.g. train.{key} or model.{key}");
    };
    let value = value.trim();
    let parsed = toml::from_str::<toml::Table>(&format!("v = {value}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(value.to_string()));
    match table.get_mut(section) {
        Some(toml::Value::Table(t)) => {
            t.insert(field.to_string(), parsed);
            Ok(())
        }
        _ => bail!(
            "--set {set:?}: the config has no [{section}] section (it has [model] and [train])"
        ),
    }
}

/// How many `base =` links a config may follow.
const MAX_BASE_DEPTH: usize = 8;

impl RunConfig {
    /// Parses TOML text; `origin` names the file in errors. A `base` names a built-in config
    /// or a file (relative to the working directory) whose fields this text overrides.
    pub fn parse(text: &str, origin: &str) -> Result<RunConfig> {
        Self::from_table(Self::table(text, origin, Path::new("."), 0)?, origin)
    }

    fn from_table(table: toml::Table, origin: &str) -> Result<RunConfig> {
        let mut cfg: RunConfig = toml::Value::Table(table)
            .try_into()
            .with_context(|| format!("invalid config {origin}"))?;
        cfg.model = cfg.model.normalized();
        cfg.check_finite()
            .with_context(|| format!("invalid config {origin}"))?;
        Ok(cfg)
    }

    /// Refuses NaN and infinite numbers, which no setting means (and which `state.json` and
    /// the metrics header, JSON, cannot hold), naming the field.
    fn check_finite(&self) -> Result<()> {
        let (m, t) = (&self.model, &self.train);
        let floats = [
            ("model.rope_theta", m.rope_theta),
            ("model.norm_eps", m.norm_eps),
            ("train.lr", Some(t.lr)),
            ("train.min_lr", Some(t.min_lr)),
            ("train.weight_decay", Some(t.weight_decay)),
            ("train.beta1", Some(t.beta1)),
            ("train.beta2", Some(t.beta2)),
            ("train.eps", Some(t.eps)),
            ("train.grad_clip", Some(t.grad_clip)),
        ];
        match floats
            .iter()
            .find(|(_, v)| v.is_some_and(|v| !v.is_finite()))
        {
            Some((name, Some(v))) => bail!("{name} = {v}: expected a finite number"),
            _ => Ok(()),
        }
    }

    /// The TOML table of `text` with its `base` chain merged under it: tables key by key, the
    /// derived file's values winning.
    fn table(text: &str, origin: &str, dir: &Path, depth: usize) -> Result<toml::Table> {
        let mut table: toml::Table =
            toml::from_str(text).with_context(|| format!("invalid config {origin}"))?;
        let Some(base) = table.remove("base") else {
            return Ok(table);
        };
        let Some(base) = base.as_str() else {
            bail!("config {origin}: `base` must be a string (a built-in config's name or a file)");
        };
        if depth >= MAX_BASE_DEPTH {
            bail!(
                "config {origin}: `base = {base:?}` is more than {MAX_BASE_DEPTH} bases deep \
                 (a cycle?)"
            );
        }
        let (base_text, base_origin, base_dir) = Self::source(base, dir)
            .with_context(|| format!("config {origin}: `base = {base:?}`"))?;
        let mut merged = Self::table(&base_text, &base_origin, &base_dir, depth + 1)?;
        merge_toml(&mut merged, table);
        Ok(merged)
    }

    /// The text of a config by path (relative to `dir`) or built-in name, with the name errors
    /// use and the folder its own `base` is relative to.
    fn source(name_or_path: &str, dir: &Path) -> Result<(String, String, PathBuf)> {
        let path = dir.join(name_or_path);
        if path.is_file() {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading config {}", path.display()))?;
            let parent = path
                .parent()
                .map_or_else(|| PathBuf::from("."), Path::to_path_buf);
            return Ok((text, path.display().to_string(), parent));
        }
        let stem = name_or_path.trim_end_matches(".toml");
        let stem = Path::new(stem)
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        match BUILTIN.iter().find(|(n, _)| *n == stem) {
            Some((n, text)) => Ok((text.to_string(), format!("(built-in {n})"), dir.into())),
            None => bail!(
                "config {name_or_path:?} is neither a file nor a built-in config ({})",
                BUILTIN
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    /// Loads a config by path, or by built-in name (`gpt2-tiny`, `gpt2-124m`, ...).
    pub fn load(name_or_path: &str) -> Result<RunConfig> {
        Self::load_with(name_or_path, &[])
    }

    /// [`Self::load`], then `sets`: `SECTION.FIELD=VALUE` overrides (`train.lr=3e-4`,
    /// `model.n_layer=4`, `train.lr_schedule=cosine`), the value read as TOML (a bare word as
    /// a string). An unknown section or field is refused by name.
    pub fn load_with(name_or_path: &str, sets: &[String]) -> Result<RunConfig> {
        let (text, origin, dir) = Self::source(name_or_path, Path::new("."))?;
        let mut table = Self::table(&text, &origin, &dir, 0)?;
        for set in sets {
            apply_set(&mut table, set)?;
        }
        Self::from_table(table, &origin)
    }

    /// Checks consistency; the error names the field and the expectation.
    pub fn validate(&self) -> Result<()> {
        let (m, t) = (&self.model, &self.train);
        m.validate()?;
        t.validate()?;
        if t.seq_len > m.n_positions {
            bail!(
                "train.seq_len = {} exceeds model.n_positions = {}",
                t.seq_len,
                m.n_positions
            );
        }
        Ok(())
    }
}

impl TrainConfig {
    /// The training settings' own checks (those that need no model); the error names the
    /// field and the expectation.
    pub fn validate(&self) -> Result<()> {
        let t = self;
        let positive = [
            ("train.batch_size", t.batch_size),
            ("train.seq_len", t.seq_len),
        ];
        for (name, v) in positive {
            if v == 0 {
                bail!("{name} = 0: must be at least 1");
            }
        }
        if t.steps == 0 {
            bail!(
                "train.steps = 0: nothing to train (`fugu eval CHECKPOINT` evaluates a model \
                 without training it)"
            );
        }
        let checks = [
            ("train.lr", t.lr, t.lr > 0.0),
            (
                "train.min_lr",
                t.min_lr,
                t.min_lr >= 0.0 && t.min_lr <= t.lr,
            ),
            ("train.weight_decay", t.weight_decay, t.weight_decay >= 0.0),
            ("train.beta1", t.beta1, (0.0..1.0).contains(&t.beta1)),
            ("train.beta2", t.beta2, (0.0..1.0).contains(&t.beta2)),
            ("train.eps", t.eps, t.eps > 0.0),
            ("train.grad_clip", t.grad_clip, t.grad_clip >= 0.0),
        ];
        for (name, v, ok) in checks {
            if !ok || !v.is_finite() {
                let want = match name {
                    "train.min_lr" => "0 <= min_lr <= lr",
                    "train.beta1" | "train.beta2" => "0 <= beta < 1",
                    "train.lr" | "train.eps" => "a positive number",
                    _ => "a non-negative number",
                };
                bail!("{name} = {v}: expected {want}");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_states_what_differs_from_its_base_and_set_overrides_fields() {
        let dir = std::env::temp_dir().join(format!("fugu-config-base-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        // A built-in base, then a file base (relative to the file naming it), then --set.
        std::fs::write(
            dir.join("sub/mid.toml"),
            "base = \"gpt2-124m\"\n[train]\nlr = 1e-4\nsteps = 50\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("top.toml"),
            "base = \"sub/mid.toml\"\n[model]\nn_layer = 4\n[train]\nsteps = 70\n",
        )
        .unwrap();
        let top = dir.join("top.toml");
        let c = RunConfig::load(top.to_str().unwrap()).unwrap();
        let base = RunConfig::load("gpt2-124m").unwrap();
        assert_eq!((c.model.n_layer, c.model.n_embd), (4, base.model.n_embd));
        assert_eq!((c.train.lr, c.train.steps), (1e-4, 70));
        assert_eq!(c.train.batch_size, base.train.batch_size);
        let sets = [
            "train.lr=3e-4",
            "train.lr_schedule=constant",
            "model.n_layer = 2",
        ]
        .map(String::from);
        let c = RunConfig::load_with(top.to_str().unwrap(), &sets).unwrap();
        assert_eq!((c.train.lr, c.model.n_layer), (3e-4, 2));
        assert_eq!(c.train.lr_schedule, LrSchedule::Constant);
        // Refusals name the problem.
        for (set, want) in [
            ("train.lrr=1", "lrr"),
            ("lr=1", "name the section"),
            ("optim.lr=1", "no [optim] section"),
            ("train.lr", "SECTION.FIELD=VALUE"),
            ("train.steps=many", "steps"),
        ] {
            let e = RunConfig::load_with(top.to_str().unwrap(), &[set.to_string()]).unwrap_err();
            assert!(format!("{e:#}").contains(want), "{set}: {e:#}");
        }
        std::fs::write(dir.join("loop.toml"), "base = \"loop.toml\"\n").unwrap();
        let e = RunConfig::load(dir.join("loop.toml").to_str().unwrap()).unwrap_err();
        assert!(format!("{e:#}").contains("a cycle?"), "{e:#}");
        std::fs::write(dir.join("nobase.toml"), "base = \"nothing-like-it\"\n").unwrap();
        let e = RunConfig::load(dir.join("nobase.toml").to_str().unwrap()).unwrap_err();
        assert!(format!("{e:#}").contains("nothing-like-it"), "{e:#}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn builtins_parse_and_validate() {
        for (name, _) in BUILTIN {
            let c = RunConfig::load(name).unwrap();
            c.validate().unwrap();
        }
        let c = RunConfig::load("gpt-1.3b").unwrap();
        assert_eq!(
            (c.model.n_layer, c.model.n_embd, c.model.n_head),
            (24, 2048, 16)
        );
        let c = RunConfig::load("configs/gpt2-124m.toml").unwrap();
        assert_eq!(
            (c.model.n_layer, c.model.n_embd, c.model.n_head),
            (12, 768, 12)
        );
    }

    #[test]
    fn errors_name_the_field() {
        let base = BUILTIN[0].1;
        let e = RunConfig::parse(
            &base.replace("n_head = 4", "n_head = 4\nn_heads = 3"),
            "x.toml",
        )
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("x.toml") && msg.contains("n_heads"), "{msg}");
        let c = RunConfig::parse(&base.replace("n_head = 4", "n_head = 5"), "x").unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(
            msg.contains("n_embd = 128 is not divisible by model.n_head = 5"),
            "{msg}"
        );
        let c = RunConfig::parse(&base.replace("seq_len = 128", "seq_len = 512"), "x").unwrap();
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("exceeds model.n_positions"));
        assert!(RunConfig::load("no-such-config").is_err());
    }

    #[test]
    fn gpt2_refuses_llama_fields_by_name_and_writes_none_of_them() {
        let base = BUILTIN[0].1;
        let c = RunConfig::parse(
            &base.replace("n_head = 4", "n_head = 4\nn_kv_head = 2"),
            "x",
        )
        .unwrap();
        let msg = c.validate().unwrap_err().to_string();
        assert!(msg.contains("model.n_kv_head is a Llama setting"), "{msg}");
        // A GPT-2 config serialises with none of them (the bytes of files written before).
        let c = RunConfig::parse(base, "x").unwrap();
        let toml = toml::to_string(&c.model).unwrap();
        for f in LLAMA_FIELDS {
            assert!(!toml.contains(f), "{toml}");
        }
        assert_eq!(
            (c.model.kv_heads(), c.model.head_size(), c.model.mlp_width()),
            (4, 32, 512)
        );
    }
}

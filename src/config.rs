//! Model and training configuration: TOML files in `configs/` (also built into the binary, so
//! `--config gpt2-124m` works anywhere), with every field overridable from the command line.
//! Unknown keys are errors, and validation names the offending field.

use crate::dtype::Dtype;
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

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
}

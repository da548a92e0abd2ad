//! A model's shape (`[model]` in a run config): its architecture and dimensions, the
//! defaults each architecture gives the fields it leaves out, and the checks that refuse a
//! shape before any table of it is built.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{RunConfig, BUILTIN};

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

//! The Llama family's Hugging Face files: `config.json` (a `LlamaConfig`) written and read, in
//! the forms of transformers 5 (`rope_parameters`) and 4 (`rope_theta` at the top level,
//! `head_dim` and `num_key_value_heads` optional), and how `LlamaForCausalLM` names its
//! tensors (the table's names are the files' keys).

use super::hf_fields::HfFields;
use super::hf_layout::{HfLayout, TiedHead};
use super::llama_params::{EMBED, LM_HEAD};
use crate::model::{Arch, ModelConfig};
use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

/// Untied: the embedding and the LM head both have the vocabulary as rows.
const UNTIED: HfLayout = HfLayout {
    title: "Llama",
    key_prefix: "",
    vocab_rows: &[EMBED, LM_HEAD],
    tied_head: None,
    is_buffer,
};

/// Tied: files may still carry `lm_head.weight`; it must equal the embedding.
const TIED: HfLayout = HfLayout {
    title: "Llama",
    key_prefix: "",
    vocab_rows: &[EMBED],
    tied_head: Some(TiedHead {
        file_name: LM_HEAD,
        table_name: EMBED,
    }),
    is_buffer,
};

/// The layout of model `cfg`'s files.
pub fn layout(cfg: &ModelConfig) -> HfLayout {
    if cfg.tied() {
        TIED
    } else {
        UNTIED
    }
}

/// `model.layers.N.self_attn.rotary_emb.inv_freq`: a buffer older files carry.
fn is_buffer(name: &str) -> bool {
    name.starts_with("model.layers.") && name.ends_with(".self_attn.rotary_emb.inv_freq")
}

/// Writes `cfg`'s sizes into a `config.json` object read from a file (its other fields kept).
pub fn update_config(obj: &mut Map<String, Value>, cfg: &ModelConfig) {
    for (k, x) in [
        ("vocab_size", cfg.vocab_size),
        ("max_position_embeddings", cfg.n_positions),
        ("hidden_size", cfg.n_embd),
        ("num_attention_heads", cfg.n_head),
        ("num_key_value_heads", cfg.kv_heads()),
        ("head_dim", cfg.head_size()),
        ("intermediate_size", cfg.mlp_width()),
        ("num_hidden_layers", cfg.n_layer),
    ] {
        obj.insert(k.into(), x.into());
    }
}

/// The `config.json` of a `LlamaForCausalLM` for `cfg`, as fugu trains it (no dropout, no
/// biases, SiLU, no RoPE scaling), keys sorted like `save_pretrained` writes them. The rotary
/// base is written both as transformers 5 reads it (`rope_parameters`) and as 4 does
/// (`rope_theta`).
pub fn config_json(cfg: &ModelConfig) -> Value {
    let ids = cfg.special_ids();
    json!({
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": ids.bos,
        "dtype": "float32",
        "eos_token_id": ids.eos,
        "head_dim": cfg.head_size(),
        "hidden_act": "silu",
        "hidden_size": cfg.n_embd,
        "initializer_range": 0.02,
        "intermediate_size": cfg.mlp_width(),
        "max_position_embeddings": cfg.n_positions,
        "mlp_bias": false,
        "model_type": "llama",
        "num_attention_heads": cfg.n_head,
        "num_hidden_layers": cfg.n_layer,
        "num_key_value_heads": cfg.kv_heads(),
        "pretraining_tp": 1,
        "rms_norm_eps": cfg.norm_epsilon(),
        "rope_parameters": {"rope_theta": cfg.rope_base(), "rope_type": "default"},
        "rope_theta": cfg.rope_base(),
        "tie_word_embeddings": cfg.tied(),
        "use_cache": true,
        "vocab_size": cfg.vocab_size,
    })
}

/// A positive finite number field, `default` when absent.
fn number(f: &HfFields, k: &str, default: f64) -> Result<f64> {
    match f.get(k) {
        None => Ok(default),
        Some(x) => match x.as_f64() {
            Some(v) if v.is_finite() && v > 0.0 => Ok(v),
            _ => bail!("{}: field `{k}` = {x}: expected a positive number", f.path),
        },
    }
}

/// The rotary base: `rope_parameters.rope_theta` (transformers 5) or `rope_theta` (4); any
/// scaling (`rope_type` other than `default`, a non-null `rope_scaling`) refused by name.
fn rope_theta(f: &HfFields) -> Result<f64> {
    let p = f.path;
    let scaling_type = |x: &Value| -> Option<String> {
        x.get("rope_type")
            .or_else(|| x.get("type"))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    if let Some(x) = f.get("rope_scaling").filter(|x| !x.is_null()) {
        match scaling_type(x).as_deref() {
            Some("default") => {}
            t => bail!(
                "{p}: field `rope_scaling` = {x} is not supported by fugu (RoPE scaling{}; only none)",
                t.map(|t| format!(" of type \"{t}\"")).unwrap_or_default()
            ),
        }
    }
    let top = number(f, "rope_theta", 10000.0)?;
    match f.get("rope_parameters") {
        None | Some(Value::Null) => Ok(top),
        Some(Value::Object(o)) => {
            match scaling_type(&Value::Object(o.clone())).as_deref() {
                None | Some("default") => {}
                Some(t) => bail!(
                    "{p}: field `rope_parameters.rope_type` = \"{t}\" is not supported by fugu (only \"default\")"
                ),
            }
            let inner = HfFields { obj: o, path: p };
            let theta = number(&inner, "rope_theta", top)?;
            if f.get("rope_theta").is_some() && theta != top {
                bail!(
                    "{p}: field `rope_parameters.rope_theta` = {theta} differs from `rope_theta` = {top}"
                );
            }
            Ok(theta)
        }
        Some(x) => bail!("{p}: field `rope_parameters` = {x}: expected an object"),
    }
}

/// The Llama config in `f` as fugu can run it (`LlamaConfig`'s defaults for absent fields);
/// what fugu does not run is refused by field name.
pub fn parse_config(f: &HfFields) -> Result<ModelConfig> {
    let p = f.path;
    let n_embd = f.int("hidden_size", 4096)?;
    let n_head = f.int("num_attention_heads", 32)?;
    let cfg = ModelConfig {
        arch: Arch::Llama,
        vocab_size: f.int("vocab_size", 32000)?,
        n_positions: f.int("max_position_embeddings", 2048)?,
        n_embd,
        n_head,
        n_layer: f.int("num_hidden_layers", 32)?,
        n_kv_head: Some(f.int("num_key_value_heads", n_head)?),
        head_dim: match f.get("head_dim") {
            None | Some(Value::Null) => {
                if !n_embd.is_multiple_of(n_head) {
                    bail!("{p}: field `hidden_size` = {n_embd} is not divisible by `num_attention_heads` = {n_head} (and no `head_dim`)");
                }
                Some(n_embd / n_head)
            }
            Some(_) => Some(f.int("head_dim", 0)?),
        },
        intermediate_size: Some(f.int("intermediate_size", 11008)?),
        rope_theta: Some(rope_theta(f)?),
        norm_eps: Some(number(f, "rms_norm_eps", 1e-6)?),
        tie_embeddings: Some(match f.get("tie_word_embeddings") {
            None => false,
            Some(x) => x.as_bool().ok_or_else(|| {
                anyhow::anyhow!("{p}: field `tie_word_embeddings` = {x}: expected true or false")
            })?,
        }),
    };
    match f.get("hidden_act") {
        None => {}
        Some(Value::String(s)) if s == "silu" => {}
        Some(x) => {
            bail!("{p}: field `hidden_act` = {x} is not supported by fugu (only \"silu\")")
        }
    }
    f.flag("attention_bias", false, false)?;
    f.flag("mlp_bias", false, false)?;
    if let Some(x) = f.get("pretraining_tp") {
        if x.as_u64() != Some(1) {
            bail!("{p}: field `pretraining_tp` = {x} is not supported by fugu (only 1)");
        }
    }
    if let Err(e) = cfg.validate() {
        bail!("{p}: {e}");
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ModelConfig> {
        let obj = v.as_object().unwrap().clone();
        parse_config(&HfFields {
            obj: &obj,
            path: "c.json",
        })
    }

    fn tiny() -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 300,
            n_positions: 64,
            n_embd: 64,
            n_head: 4,
            n_layer: 2,
            n_kv_head: Some(2),
            head_dim: Some(16),
            intermediate_size: Some(96),
            rope_theta: Some(500000.0),
            norm_eps: Some(1e-5),
            tie_embeddings: Some(false),
        }
    }

    #[test]
    fn written_config_reads_back_the_same() {
        let m = tiny();
        assert_eq!(parse(config_json(&m)).unwrap(), m);
    }

    #[test]
    fn transformers_4_files_read_with_defaults() {
        // No head_dim, no num_key_value_heads, rope_theta at the top level.
        let m = parse(json!({
            "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 96, "num_hidden_layers": 2, "vocab_size": 300,
            "max_position_embeddings": 64, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
            "rope_scaling": null, "tie_word_embeddings": true
        }))
        .unwrap();
        assert_eq!((m.kv_heads(), m.head_size(), m.tied()), (4, 16, true));
        assert_eq!(m.rope_base(), 10000.0);
    }

    #[test]
    fn unsupported_fields_are_refused_by_name() {
        let base = config_json(&tiny());
        let with = |k: &str, v: Value| {
            let mut o = base.clone();
            o[k] = v;
            parse(o).unwrap_err().to_string()
        };
        assert!(with("attention_bias", json!(true)).contains("`attention_bias`"));
        assert!(with("mlp_bias", json!(true)).contains("`mlp_bias`"));
        assert!(with("hidden_act", json!("gelu")).contains("`hidden_act`"));
        assert!(with("pretraining_tp", json!(2)).contains("`pretraining_tp`"));
        let e = with(
            "rope_scaling",
            json!({"rope_type": "llama3", "factor": 8.0}),
        );
        assert!(e.contains("`rope_scaling`") && e.contains("llama3"), "{e}");
        let e = with(
            "rope_parameters",
            json!({"rope_type": "yarn", "rope_theta": 1e4}),
        );
        assert!(e.contains("rope_parameters.rope_type"), "{e}");
        let e = with("num_key_value_heads", json!(3));
        assert!(e.contains("n_kv_head = 3"), "{e}");
    }
}

//! GPT-2's Hugging Face files: `config.json` (a `GPT2Config`), written and read, and how
//! `GPT2LMHeadModel` names its tensors.

use super::hf_fields::HfFields;
use super::hf_layout::{HfLayout, TiedHead};
use crate::model::{Arch, ModelConfig};
use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

/// `GPT2LMHeadModel`'s tensors: the body under `transformer.` (the original hub files have no
/// prefix), `wte.weight` with `vocab_size` rows, `lm_head.weight` tied to it, and the
/// `h.N.attn.bias` / `h.N.attn.masked_bias` causal-mask buffers of old files.
pub const LAYOUT: HfLayout = HfLayout {
    title: "GPT-2",
    key_prefix: "transformer.",
    vocab_rows: &["wte.weight"],
    tied_head: Some(TiedHead {
        file_name: "lm_head.weight",
        table_name: "wte.weight",
    }),
    is_buffer,
};

/// `h.N.attn.bias` / `h.N.attn.masked_bias`: causal-mask buffers of old GPT-2 files.
fn is_buffer(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("h.") else {
        return false;
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return false;
    };
    !layer.is_empty()
        && layer.bytes().all(|b| b.is_ascii_digit())
        && (tail == "attn.bias" || tail == "attn.masked_bias")
}

/// Writes `cfg`'s sizes into a `config.json` object read from a file (its other fields kept):
/// `n_ctx` too where the file has it.
pub fn update_config(obj: &mut Map<String, Value>, cfg: &ModelConfig) {
    for (k, x) in [
        ("vocab_size", cfg.vocab_size),
        ("n_positions", cfg.n_positions),
        ("n_embd", cfg.n_embd),
        ("n_head", cfg.n_head),
        ("n_layer", cfg.n_layer),
    ] {
        obj.insert(k.into(), x.into());
    }
    if obj.contains_key("n_ctx") {
        obj.insert("n_ctx".into(), cfg.n_positions.into());
    }
}

/// The `config.json` of a `GPT2LMHeadModel` for `cfg`, as fugu trains it (no dropout, tied
/// embeddings, tanh GELU). Keys are sorted, like `save_pretrained` writes them.
///
/// `bos_token_id` / `eos_token_id` are [`ModelConfig::special_ids`]; a checkpoint writes its
/// tokenizer's over them ([`crate::checkpoint::write_model_config`]).
pub fn config_json(cfg: &ModelConfig) -> Value {
    let ids = cfg.special_ids();
    json!({
        "activation_function": "gelu_new",
        "add_cross_attention": false,
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "bos_token_id": ids.bos,
        "dtype": "float32",
        "embd_pdrop": 0.0,
        "eos_token_id": ids.eos,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-5,
        "model_type": "gpt2",
        "n_ctx": cfg.n_positions,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "n_inner": null,
        "n_layer": cfg.n_layer,
        "n_positions": cfg.n_positions,
        "reorder_and_upcast_attn": false,
        "resid_pdrop": 0.0,
        "scale_attn_by_inverse_layer_idx": false,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "use_cache": true,
        "vocab_size": cfg.vocab_size,
    })
}

/// The GPT-2 config in `f` as fugu can run it (fields `transformers` would default may be
/// absent); what fugu does not run is refused by field name.
pub fn parse_config(f: &HfFields) -> Result<ModelConfig> {
    let p = f.path;
    let cfg = ModelConfig {
        arch: Arch::Gpt2,
        vocab_size: f.int("vocab_size", 50257)?,
        n_positions: f.int("n_positions", 1024)?,
        n_embd: f.int("n_embd", 768)?,
        n_head: f.int("n_head", 12)?,
        n_layer: f.int("n_layer", 12)?,
        ..Default::default()
    };
    if !cfg.n_embd.is_multiple_of(cfg.n_head) {
        bail!(
            "{p}: field `n_embd` = {} is not divisible by `n_head` = {}",
            cfg.n_embd,
            cfg.n_head
        );
    }
    match f.get("activation_function") {
        None => {}
        Some(Value::String(s)) if s == "gelu_new" || s == "gelu_pytorch_tanh" => {}
        Some(x) => bail!(
            "{p}: field `activation_function` = {x} is not supported by fugu (only \"gelu_new\" or \"gelu_pytorch_tanh\")"
        ),
    }
    match f.get("n_inner") {
        None | Some(Value::Null) => {}
        Some(x) if x.as_u64() == Some(4 * cfg.n_embd as u64) => {}
        Some(x) => bail!(
            "{p}: field `n_inner` = {x} is not supported by fugu (only null or 4 * n_embd = {})",
            4 * cfg.n_embd
        ),
    }
    if let Some(x) = f.get("layer_norm_epsilon") {
        match x.as_f64() {
            Some(e) if (e - 1e-5).abs() <= 1e-12 => {}
            _ => {
                bail!("{p}: field `layer_norm_epsilon` = {x} is not supported by fugu (only 1e-5)")
            }
        }
    }
    f.flag("scale_attn_weights", true, true)?;
    f.flag("scale_attn_by_inverse_layer_idx", false, false)?;
    f.flag("reorder_and_upcast_attn", false, false)?;
    f.flag("tie_word_embeddings", true, true)?;
    f.flag("add_cross_attention", false, false)?;
    Ok(cfg)
}

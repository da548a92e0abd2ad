//! The Llama family's parameters: the table of one pipeline stage of one tensor-parallel rank
//! (Hugging Face `LlamaForCausalLM` names, each tensor's split declared where it is pushed),
//! its named spans, and the initialisation.

use super::init::{normal_tensor, INIT_STD};
use super::stage::Stage;
use super::table::{padded_vocab, Split, Table};
use crate::backend::{BufId, Span};
use crate::model::ModelConfig;
use anyhow::{bail, Result};

/// The token embedding (also the LM head when tied).
pub const EMBED: &str = "model.embed_tokens.weight";
/// The final RMS norm.
pub const NORM: &str = "model.norm.weight";
/// The untied LM head.
pub const LM_HEAD: &str = "lm_head.weight";

/// Block `l`'s tensor `part` (`self_attn.q_proj`, `mlp.down_proj`, `input_layernorm`, ...).
fn layer(l: usize, part: &str) -> String {
    format!("model.layers.{l}.{part}.weight")
}

/// The parameter table of one pipeline stage of a Llama model for tensor-parallel degree `tp`.
///
/// Weights are `(out, in)`, as `nn.Linear` stores them. Splits (Megatron's layout): q, k and
/// v by heads (rows; pushed back to back so that they are one `(q + 2·kv heads) × C` GEMM
/// operand per rank), gate and up by MLP units (rows; one `2F × C` operand), the output and
/// down projections by input columns (row-parallel), the embedding and the LM head by
/// vocabulary rows; the RMS norms replicated. `tp` must divide `n_kv_head`: every rank keeps
/// whole key/value heads with the query heads that read them (replicating key/value heads is
/// not supported).
///
/// The first stage holds the embedding; the last the final norm and the LM head, or with tied
/// embeddings a copy of the embedding (first in its table, as GPT-2's `wte`; the two copies'
/// gradients are summed by the caller).
pub fn llama_stage_params(m: &ModelConfig, tp: usize, stage: &Stage) -> Result<Table> {
    let (nh, kv, hs, f, c) = (
        m.n_head,
        m.kv_heads(),
        m.head_size(),
        m.mlp_width(),
        m.n_embd,
    );
    if tp == 0 || !kv.is_multiple_of(tp) {
        bail!(
            "tensor parallel degree {tp} does not divide model.n_kv_head = {kv} (each rank keeps whole key/value heads; replicating them is not supported)"
        );
    }
    if !f.is_multiple_of(tp) {
        bail!("tensor parallel degree {tp} does not divide model.intermediate_size = {f}");
    }
    let vp = padded_vocab(m.vocab_size);
    if !vp.is_multiple_of(tp) {
        bail!("tensor parallel degree {tp} does not divide the padded vocabulary {vp}");
    }
    let (rows, cols) = (Split::Rows, Split::Cols { parts: 1 });
    let tied = m.tied();
    let mut t = Table::default();
    if stage.is_first() || (stage.is_last() && tied) {
        t.push_split(EMBED, &[vp, c], rows, tp);
    }
    for l in stage.layers.clone() {
        t.push(layer(l, "input_layernorm"), &[c]);
        let qkv = [
            (layer(l, "self_attn.q_proj"), vec![nh * hs, c]),
            (layer(l, "self_attn.k_proj"), vec![kv * hs, c]),
            (layer(l, "self_attn.v_proj"), vec![kv * hs, c]),
        ];
        t.push_joined(&qkv, rows, tp);
        t.push_split(layer(l, "self_attn.o_proj"), &[c, nh * hs], cols, tp);
        t.push(layer(l, "post_attention_layernorm"), &[c]);
        let gate_up = [
            (layer(l, "mlp.gate_proj"), vec![f, c]),
            (layer(l, "mlp.up_proj"), vec![f, c]),
        ];
        t.push_joined(&gate_up, rows, tp);
        t.push_split(layer(l, "mlp.down_proj"), &[c, f], cols, tp);
    }
    if stage.is_last() {
        t.push(NORM, &[c]);
        if !tied {
            t.push_split(LM_HEAD, &[vp, c], rows, tp);
        }
    }
    Ok(t)
}

/// The initial value of the full tensor `name` (`LlamaPreTrainedModel._init_weights`):
/// weights and the embedding ~ N(0, 0.02) (the vocabulary's real rows only), norms 1.
pub fn init_tensor(cfg: &ModelConfig, name: &str, seed: u64, dst: &mut [f32]) {
    if name.ends_with("layernorm.weight") || name == NORM {
        dst.fill(1.0);
        return;
    }
    let real = match name {
        EMBED | LM_HEAD => cfg.vocab_size * cfg.n_embd,
        _ => dst.len(),
    };
    normal_tensor(name, seed, dst, INIT_STD, real);
}

/// One block's parameters (or, rebased, their gradients): the fused operands as one span.
#[derive(Clone, Copy, Debug)]
pub struct LlamaLayerParams {
    pub attn_norm: Span,
    /// q, k and v weights back to back: ((nh + 2·kv)·hs, C).
    pub qkv: Span,
    pub o: Span,
    pub mlp_norm: Span,
    /// gate and up weights back to back: (2F, C).
    pub gate_up: Span,
    pub down: Span,
}

/// Every parameter of one stage as spans of one buffer.
#[derive(Clone, Debug)]
pub struct LlamaSpans {
    /// The token embedding, on the first stage.
    pub embed: Option<Span>,
    pub layers: Vec<LlamaLayerParams>,
    /// The final norm and the LM head (the embedding's copy when tied), on the last stage.
    pub head: Option<(Span, Span)>,
}

impl LlamaSpans {
    /// Resolves the names of `table` (from [`llama_stage_params`]) in `buf`.
    pub fn new(table: &Table, buf: BufId, stage: &Stage, tied: bool) -> LlamaSpans {
        let s = |name: &str| {
            let t = table
                .get(name)
                .unwrap_or_else(|| panic!("parameter {name} missing from the table"));
            Span {
                buf,
                offset: t.offset,
                len: t.len(),
            }
        };
        // Tensors pushed back to back, as one span.
        let joined = |first: &str, last: &str| {
            let (a, b) = (s(first), s(last));
            Span {
                len: b.offset + b.len - a.offset,
                ..a
            }
        };
        let layers = stage
            .layers
            .clone()
            .map(|l| LlamaLayerParams {
                attn_norm: s(&layer(l, "input_layernorm")),
                qkv: joined(&layer(l, "self_attn.q_proj"), &layer(l, "self_attn.v_proj")),
                o: s(&layer(l, "self_attn.o_proj")),
                mlp_norm: s(&layer(l, "post_attention_layernorm")),
                gate_up: joined(&layer(l, "mlp.gate_proj"), &layer(l, "mlp.up_proj")),
                down: s(&layer(l, "mlp.down_proj")),
            })
            .collect();
        let head_w = if tied { EMBED } else { LM_HEAD };
        LlamaSpans {
            embed: stage.is_first().then(|| s(EMBED)),
            layers,
            head: stage.is_last().then(|| (s(NORM), s(head_w))),
        }
    }

    /// The same tensors in another buffer carved by the same table (gradients, moments).
    pub fn on(&self, buf: BufId) -> LlamaSpans {
        let r = |s: Span| Span { buf, ..s };
        LlamaSpans {
            embed: self.embed.map(r),
            layers: self
                .layers
                .iter()
                .map(|l| LlamaLayerParams {
                    attn_norm: r(l.attn_norm),
                    qkv: r(l.qkv),
                    o: r(l.o),
                    mlp_norm: r(l.mlp_norm),
                    gate_up: r(l.gate_up),
                    down: r(l.down),
                })
                .collect(),
            head: self.head.map(|(n, w)| (r(n), r(w))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(tied: bool) -> ModelConfig {
        ModelConfig {
            arch: crate::model::Arch::Llama,
            vocab_size: 300,
            n_positions: 32,
            n_embd: 64,
            n_head: 4,
            n_layer: 3,
            n_kv_head: Some(2),
            intermediate_size: Some(96),
            tie_embeddings: Some(tied),
            ..Default::default()
        }
    }

    #[test]
    fn shards_keep_whole_kv_heads_and_fused_parts_are_contiguous() {
        let m = cfg(false);
        let t = llama_stage_params(&m, 2, &Stage::whole(3)).unwrap();
        let shape = |n: &str| t.get(n).unwrap().shape.clone();
        assert_eq!(shape("model.layers.0.self_attn.q_proj.weight"), [32, 64]);
        assert_eq!(shape("model.layers.0.self_attn.k_proj.weight"), [16, 64]);
        assert_eq!(shape("model.layers.0.self_attn.o_proj.weight"), [64, 32]);
        assert_eq!(shape("model.layers.2.mlp.down_proj.weight"), [64, 48]);
        assert_eq!(shape(LM_HEAD), [384 / 2, 64]); // 300 padded to 384
        assert!(!t.get(NORM).unwrap().decay && t.get(LM_HEAD).unwrap().decay);
        let end = |n: &str| t.get(n).unwrap().range().end;
        let start = |n: &str| t.get(n).unwrap().offset;
        let l = |p: &str| layer(1, p);
        assert_eq!(end(&l("self_attn.q_proj")), start(&l("self_attn.k_proj")));
        assert_eq!(end(&l("self_attn.k_proj")), start(&l("self_attn.v_proj")));
        assert_eq!(end(&l("mlp.gate_proj")), start(&l("mlp.up_proj")));
        let e = llama_stage_params(&m, 4, &Stage::whole(3)).unwrap_err();
        assert!(e.to_string().contains("model.n_kv_head = 2"), "{e}");
        // The whole model: 9 tensors per block, the embedding, the norm and the head.
        let whole = llama_stage_params(&m, 1, &Stage::whole(3)).unwrap();
        assert_eq!(whole.specs().len(), 3 * 9 + 3);
        assert_eq!(whole.specs()[0].name, EMBED);
    }

    #[test]
    fn a_tied_last_stage_holds_the_embedding_first_and_no_head() {
        let m = cfg(true);
        let last = Stage {
            index: 1,
            count: 2,
            layers: 2..3,
        };
        let t = llama_stage_params(&m, 1, &last).unwrap();
        assert_eq!(t.specs()[0].name, EMBED);
        assert!(t.get(LM_HEAD).is_none());
        let p = LlamaSpans::new(&t, BufId(0), &last, true);
        assert!(p.embed.is_none());
        assert_eq!(p.head.unwrap().1.offset, 0);
        let untied = llama_stage_params(&cfg(false), 1, &last).unwrap();
        assert!(untied.get(EMBED).is_none() && untied.get(LM_HEAD).is_some());
    }
}

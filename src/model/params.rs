//! Named spans of the GPT-2 parameter table. The same offsets address parameters, gradients and
//! both AdamW moments: [`ParamSpans::on`] rebases them onto another buffer.

use super::stage::Stage;
use super::table::Table;
use crate::backend::{BufId, Span};

/// Parameters of one transformer block.
#[derive(Clone, Copy, Debug)]
pub struct LayerParams {
    pub ln1_w: Span,
    pub ln1_b: Span,
    pub qkv_w: Span,
    pub qkv_b: Span,
    pub attproj_w: Span,
    pub attproj_b: Span,
    pub ln2_w: Span,
    pub ln2_b: Span,
    pub fc_w: Span,
    pub fc_b: Span,
    pub fcproj_w: Span,
    pub fcproj_b: Span,
}

/// The first stage's embeddings.
#[derive(Clone, Copy, Debug)]
pub struct EmbedParams {
    pub wte: Span,
    pub wpe: Span,
}

/// The last stage's final layernorm and LM head (the tied `wte`).
#[derive(Clone, Copy, Debug)]
pub struct HeadParams {
    pub wte: Span,
    pub lnf_w: Span,
    pub lnf_b: Span,
}

/// Every parameter tensor of one pipeline stage as a span of one buffer (with one stage, the
/// embedding's and the head's `wte` are the same span).
#[derive(Clone, Debug)]
pub struct ParamSpans {
    /// On the first stage.
    pub embed: Option<EmbedParams>,
    /// The stage's blocks, in order.
    pub layers: Vec<LayerParams>,
    /// On the last stage.
    pub head: Option<HeadParams>,
}

fn rebase(s: Span, buf: BufId) -> Span {
    Span { buf, ..s }
}

impl ParamSpans {
    /// Resolves the GPT-2 names of `table` (from [`super::table::gpt2_stage_params`] for
    /// `stage`) in `buf`.
    pub fn new(table: &Table, buf: BufId, stage: &Stage) -> ParamSpans {
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
        let layers = stage
            .layers
            .clone()
            .map(|l| {
                let p = |x: &str| s(&format!("h.{l}.{x}"));
                LayerParams {
                    ln1_w: p("ln_1.weight"),
                    ln1_b: p("ln_1.bias"),
                    qkv_w: p("attn.c_attn.weight"),
                    qkv_b: p("attn.c_attn.bias"),
                    attproj_w: p("attn.c_proj.weight"),
                    attproj_b: p("attn.c_proj.bias"),
                    ln2_w: p("ln_2.weight"),
                    ln2_b: p("ln_2.bias"),
                    fc_w: p("mlp.c_fc.weight"),
                    fc_b: p("mlp.c_fc.bias"),
                    fcproj_w: p("mlp.c_proj.weight"),
                    fcproj_b: p("mlp.c_proj.bias"),
                }
            })
            .collect();
        ParamSpans {
            embed: stage.is_first().then(|| EmbedParams {
                wte: s("wte.weight"),
                wpe: s("wpe.weight"),
            }),
            layers,
            head: stage.is_last().then(|| HeadParams {
                wte: s("wte.weight"),
                lnf_w: s("ln_f.weight"),
                lnf_b: s("ln_f.bias"),
            }),
        }
    }

    /// The same tensors in another buffer carved by the same table (gradients, moments).
    pub fn on(&self, buf: BufId) -> ParamSpans {
        let r = |s: Span| rebase(s, buf);
        ParamSpans {
            embed: self.embed.map(|e| EmbedParams {
                wte: r(e.wte),
                wpe: r(e.wpe),
            }),
            layers: self
                .layers
                .iter()
                .map(|l| LayerParams {
                    ln1_w: r(l.ln1_w),
                    ln1_b: r(l.ln1_b),
                    qkv_w: r(l.qkv_w),
                    qkv_b: r(l.qkv_b),
                    attproj_w: r(l.attproj_w),
                    attproj_b: r(l.attproj_b),
                    ln2_w: r(l.ln2_w),
                    ln2_b: r(l.ln2_b),
                    fc_w: r(l.fc_w),
                    fc_b: r(l.fc_b),
                    fcproj_w: r(l.fcproj_w),
                    fcproj_b: r(l.fcproj_b),
                })
                .collect(),
            head: self.head.map(|h| HeadParams {
                wte: r(h.wte),
                lnf_w: r(h.lnf_w),
                lnf_b: r(h.lnf_b),
            }),
        }
    }
}

//! The pieces of a forward or backward pass that every decoder architecture runs the same
//! way: the token embedding (vocabulary-parallel), attention (three steps, fused, or one token
//! over the key/value cache), a row-parallel projection joining the residual stream, and the
//! vocabulary-parallel cross-entropy. Each is a short list of [`Layers`] and backend calls
//! under the timers of [`super::decoder_ops`].

use super::acts::{AttnActs, AttnGrads, AttnKeep, AttnKept, LossActs, Recompute, StepDims};
use super::contract::OpForm;
use super::decoder_ops::{backward as bwd, forward as fwd};
use super::kv::KvCache;
use super::layers::Layers;
use super::paths::Residual;
use super::work;
use crate::backend::{
    Backend, CeDims, CeRows, Embedding, FusedOut, KvRows, Linear, LinearGrads, Rope, Span, TokSpan,
};
use crate::comm::ReduceOp;
use crate::metrics::ops::trainer::phase;
use crate::metrics::timers::TimerLevel::{Coarse, Fine};

/// Where a forward pass's tokens come from and what attention looks at.
#[derive(Clone, Copy)]
pub enum Pass<'c> {
    /// Micro-batch `micro` of a step's batches: causal attention within each sequence.
    Batch { micro: usize },
    /// One token at position `pos` (a batch of 1×1), attending to `cache`.
    Decode { cache: &'c KvCache, pos: usize },
}

impl Pass<'_> {
    /// The micro-batch whose activations the pass uses (a decoded token: the one set).
    pub fn micro(self) -> usize {
        match self {
            Pass::Batch { micro } => micro,
            Pass::Decode { .. } => 0,
        }
    }
}

/// What a block's pass needs besides its activations and parameters.
pub struct BlockCtx<'a, 'c> {
    pub d: &'a StepDims,
    /// Tensor-parallel rank 0 (adds the replicated row-parallel biases, and in the residual
    /// epilogue the stream).
    pub tp_first: bool,
    pub residual: Residual,
    pub pass: Pass<'c>,
    /// The block's index within the stage (its key/value cache layer when decoding).
    pub layer: usize,
    /// Scratch for a projection's output before it joins the residual stream.
    pub proj: Span,
}

/// The embedding of a step (this rank's vocabulary rows; `wpe` where this rank adds it), or
/// with the gradients' spans, its backward pass's outputs.
pub fn embedding(wte: Span, wpe: Option<Span>, tp_rank: usize, d: &StepDims) -> Embedding {
    Embedding {
        wte,
        wpe,
        vocab_start: tp_rank * d.vp,
        b: d.b,
        t: d.t,
        c: d.c,
    }
}

/// The token (and position) embedding into `out`. TP: vocabulary-parallel, so each rank's
/// rows are partial sums, all-reduced (the positions added on one rank).
pub fn embedding_forward<B: Backend>(x: &mut Layers<B>, e: &Embedding, out: Span, tokens: TokSpan) {
    // The all-reduce is timed inside the embedding's scope (its timer is the embedding's
    // child).
    let timers = x.timers;
    let _t = {
        let be = &*x.be;
        timers.scope(fwd::EMBEDDING, Fine).with_work(|| {
            // The rows of the tokens (an upper bound: a repeated token's row is counted
            // again) and the positions' rows (on the first TP rank).
            let rows = Span {
                len: e.b * e.t * e.c,
                ..e.wte
            };
            let wpe = e.wpe.map(|w| w.sub(0, e.t * e.c));
            let read: Vec<Span> = [Some(rows), wpe].into_iter().flatten().collect();
            work::traffic(be, &read, &[out], &[])
        })
    };
    x.be.encoder_forward(e, out, tokens);
    x.allreduce(fwd::EMBEDDING_ALLREDUCE, out, ReduceOp::Sum);
}

/// The embedding's backward pass: its gradients (`de`'s tables) accumulate from `dout`.
pub fn embedding_backward<B: Backend>(
    x: &mut Layers<B>,
    de: &Embedding,
    dout: Span,
    tokens: TokSpan,
) {
    let be = &mut *x.be;
    let _t = x.timers.scope(bwd::EMBEDDING, Fine).with_work(|| {
        // Added into: the rows of the tokens (an upper bound, as in the forward pass) and the
        // positions' rows.
        let rows = Span {
            len: de.b * de.t * de.c,
            ..de.wte
        };
        let wpe = de.wpe.map(|w| w.sub(0, de.t * de.c));
        let added: Vec<Span> = [Some(rows), wpe].into_iter().flatten().collect();
        work::traffic(&*be, &[dout], &[], &added)
    });
    be.encoder_backward(de, dout, tokens);
}

/// A block's attention from its `qkv` into `atty`: in three steps (probabilities kept), fused,
/// or for one token over the key/value cache.
pub fn attention_forward<B: Backend>(x: &mut Layers<B>, la: &AttnActs, bp: &BlockCtx) {
    let (d, timers) = (bp.d, x.timers);
    let lc = d.local_c();
    let ad = d.attn();
    let be = &mut *x.be;
    match bp.pass {
        Pass::Batch { .. } => match la.att {
            AttnKept::Probabilities(att) => {
                let (q, k, v) = work::qkv_parts(la.qkv, ad);
                {
                    let _t = timers
                        .scope(fwd::BADDBMM, Fine)
                        .with_work(|| work::attention(&*be, ad, 1, &[q, k], &[att]));
                    be.attention_scores(att, la.qkv, ad);
                }
                {
                    let _t = timers
                        .scope(fwd::SOFTMAX, Fine)
                        .with_work(|| work::traffic(&*be, &[], &[], &[att]));
                    be.attention_softmax(att, ad);
                }
                let _t = timers
                    .scope(fwd::BMM, Fine)
                    .with_work(|| work::attention(&*be, ad, 1, &[att, v], &[la.atty]));
                be.attention_values(la.atty, att, la.qkv, ad);
            }
            AttnKept::LogSumExp(lse) => {
                let _t = timers
                    .scope(fwd::FUSED, Fine)
                    .with_work(|| work::attention(&*be, ad, 2, &[la.qkv], &[la.atty, lse]));
                be.attention_forward(la.atty, lse, la.qkv, ad);
            }
        },
        Pass::Decode { cache, pos } => {
            let _t = timers.scope(fwd::DECODE, Fine);
            let (k, v) = (cache.k(bp.layer), cache.v(bp.layer));
            let kw = d.kv_width();
            be.copy(k.sub(pos * kw, kw), la.qkv.sub(lc, kw));
            be.copy(v.sub(pos * kw, kw), la.qkv.sub(lc + kw, kw));
            let kv = KvRows { k, v, len: pos + 1 };
            be.attention_decode(la.atty, la.qkv.sub(0, lc), kv, ad);
        }
    }
}

/// A block's attention backward from `ga.datty` into `ga.dqkv`: three steps over the kept
/// (or, with `recompute`, recomputed) probabilities, or fused from the log-sum-exp. With
/// `rope` (the rotary embedding the q and k heads went through), the gradients of q and k
/// are then rotated back: in the fused backward's own stores where the backend does that
/// ([`Backend::rope_in_attention_backward`]: no pass over them of its own), else by the rope
/// op (timed as `rope`).
pub fn attention_backward<B: Backend>(
    x: &mut Layers<B>,
    d: &StepDims,
    la: &AttnActs,
    ga: &AttnGrads,
    recompute: bool,
    rope: Option<&Rope>,
) {
    let (timers, ad) = (x.timers, d.attn());
    let be = &mut *x.be;
    let keep = la.att.keep();
    let inside = rope.filter(|_| rope_in_attention(&*be, keep, ad.hs));
    let rope_left = if inside.is_some() { None } else { rope };
    match la.att {
        AttnKept::Probabilities(att) => {
            let datt = ga.datt.expect("datt exists with kept probabilities");
            if recompute {
                // The probabilities of this layer, as the forward pass computed them.
                let _t = timers.scope(bwd::ATTENTION_RECOMPUTE, Fine);
                be.attention_scores(att, la.qkv, ad);
                be.attention_softmax(att, ad);
            }
            let (q, k, v) = work::qkv_parts(la.qkv, ad);
            let (dq, dk, dv) = work::qkv_parts(ga.dqkv, ad);
            {
                let _t = timers
                    .scope(bwd::BMM, Fine)
                    .with_work(|| work::attention(&*be, ad, 2, &[ga.datty, att, v], &[datt, dv]));
                be.attention_values_backward(datt, ga.dqkv, ga.datty, att, la.qkv, ad);
            }
            {
                let _t = timers
                    .scope(bwd::SOFTMAX, Fine)
                    .with_work(|| work::traffic(&*be, &[att], &[], &[datt]));
                be.attention_softmax_backward(datt, att, ad);
            }
            let _t = timers
                .scope(bwd::BADDBMM, Fine)
                .with_work(|| work::attention(&*be, ad, 2, &[datt, q, k], &[dq, dk]));
            be.attention_scores_backward(ga.dqkv, datt, la.qkv, ad);
        }
        AttnKept::LogSumExp(lse) => {
            let _t = timers.scope(bwd::FUSED, Fine).with_work(|| {
                let read = [ga.datty, la.atty, lse, la.qkv];
                work::attention(&*be, ad, 4, &read, &[ga.dqkv])
            });
            let fwd = FusedOut { out: la.atty, lse };
            be.attention_backward(ga.dqkv, ga.datty, fwd, la.qkv, ad, inside);
        }
    }
    if let Some(r) = rope_left {
        x.rope(bwd::ROPE, r, ga.dqkv, true);
    }
}

/// A block's row-parallel projection `l` whose output joins the residual stream: `out =
/// resid + inp·W + b`, in the projection's GEMM or by its own op as `bp.residual` says, the
/// GEMM timed as `names.0`. TP: each rank's product is a partial sum over its share of the
/// input width; the first rank adds the bias (`l.bias` is `None` on the others) and, in the
/// epilogue, the stream; the all-reduce (timed as `names.1`) sums them.
pub fn project_into_residual<B: Backend>(
    x: &mut Layers<B>,
    bp: &BlockCtx,
    names: (&'static str, &'static str),
    l: &Linear,
    (out, resid, inp): (Span, Span, Span),
) {
    match bp.residual {
        Residual::Separate => {
            x.linear(names.0, l, bp.proj, inp);
            x.allreduce(names.1, bp.proj, ReduceOp::Sum);
            let be = &mut *x.be;
            let _t = x
                .timers
                .scope(fwd::RESIDUAL, Fine)
                .with_work(|| work::traffic(&*be, &[resid, bp.proj], &[out], &[]));
            be.residual_forward(out, resid, bp.proj);
        }
        Residual::Epilogue => {
            if bp.tp_first {
                x.linear_residual(names.0, l, out, resid, bp.proj, inp);
            } else {
                x.linear(names.0, l, out, inp);
            }
            x.allreduce(names.1, out, ReduceOp::Sum);
        }
    }
}

/// The LM head's logits of a micro-batch and their cross-entropy against `targets` (per-row
/// losses into `h.losses`); returns the mean loss. `head` is the whole micro-batch's head
/// (`head.n` rows) on `inp`, the final norm's output. With `dloss` the logits are replaced by
/// their gradient (times `dloss`) for the head's backward pass.
///
/// With a loss chunk (`h.logits` holding fewer rows than the micro-batch,
/// [`super::acts::StepDims::loss_rows`]) the head runs chunk by chunk, so the logits of the
/// whole micro-batch are never held: each chunk's logits and loss, and with `dloss` the
/// head's backward pass at once (its input gradient into `h.head_dinp`, its weight gradient
/// added to `dw`; timed in the backward phase), the gradient of the chunk's logits being
/// consumed before the next chunk overwrites them.
pub fn head_and_loss<B: Backend>(
    x: &mut Layers<B>,
    (head, inp, dw): (&Linear, Span, Option<Span>),
    h: &LossActs,
    targets: TokSpan,
    (cd, dloss): (CeDims, Option<f32>),
) -> f32 {
    let timers = x.timers;
    let rows = h.logits.len / cd.vp;
    if rows >= cd.n {
        let _fwd = timers.scope(phase::FORWARD, Coarse);
        x.linear(fwd::LM_HEAD, head, h.logits, inp);
        loss_rows(x, h, targets, cd, dloss);
    } else {
        // With a gradient to carry back: where the head's input and weight gradients go.
        let grads = dloss.map(|_| match (h.head_dinp, dw) {
            (Some(dinp), Some(dw)) => (dinp, dw),
            _ => panic!("a loss chunk's backward pass needs the head's input and weight gradients"),
        });
        let c = head.ic;
        for r0 in (0..cd.n).step_by(rows) {
            let m = rows.min(cd.n - r0);
            let l = Linear { n: m, ..*head };
            let (logits, rows_in) = (h.logits.sub(0, m * cd.vp), inp.sub(r0 * c, m * c));
            {
                let _fwd = timers.scope(phase::FORWARD, Coarse);
                x.linear(fwd::LM_HEAD, &l, logits, rows_in);
                let part = h.rows(logits, r0, m);
                let targets = TokSpan {
                    offset: targets.offset + r0,
                    len: m,
                };
                loss_rows(x, &part, targets, CeDims { n: m, ..cd }, dloss);
            }
            if let Some((dinp, dw)) = grads {
                let _bwd = timers.scope(phase::BACKWARD, Coarse);
                let g = LinearGrads {
                    dinp: Some(dinp.sub(r0 * c, m * c)),
                    dw,
                    dbias: None,
                };
                x.linear_backward((bwd::LM_HEAD, None), &l, &g, logits, rows_in);
            }
        }
    }
    let mut losses = vec![0.0f32; cd.n];
    x.be.download(h.losses, &mut losses);
    (losses.iter().map(|&x| x as f64).sum::<f64>() / cd.n as f64) as f32
}

/// The LM head's backward pass on `inp` after [`head_and_loss`] left the loss gradient in
/// `h.logits`: its input gradient into `dinp` (scratch), its weight gradient added to `dw`;
/// or, with a loss chunk, where that already ran, nothing but the all-reduce. Returns the
/// span holding the head's input gradient, all-reduced across TP ranks.
pub fn lm_head_backward<B: Backend>(
    x: &mut Layers<B>,
    (head, inp): (&Linear, Span),
    h: &LossActs,
    (dinp, dw): (Span, Span),
) -> Span {
    if let Some(kept) = h.head_dinp {
        x.allreduce(bwd::LM_HEAD_ALLREDUCE, kept, ReduceOp::Sum);
        return kept;
    }
    let names = (bwd::LM_HEAD, Some(bwd::LM_HEAD_ALLREDUCE));
    let grads = LinearGrads {
        dinp: Some(dinp),
        dw,
        dbias: None,
    };
    x.linear_backward(names, head, &grads, h.logits, inp);
    dinp
}

/// The per-row cross-entropy of `h.logits` against `targets` into `h.losses` and, with
/// `dloss`, the logits replaced by their gradient (times `dloss`). Without TP as one op
/// ([`Backend::ce_whole_vocab`]); with TP the logits are vocabulary-parallel, and the row
/// maxima, sums of exponentials and target logits are all-reduced across the shards between
/// the phases.
fn loss_rows<B: Backend>(
    x: &mut Layers<B>,
    h: &LossActs,
    targets: TokSpan,
    cd: CeDims,
    dloss: Option<f32>,
) {
    let ar = fwd::LOSS_ALLREDUCE;
    let timers = x.timers;
    let _t = {
        let be = &*x.be;
        timers.scope(fwd::LOSS, Fine).with_work(|| {
            let dlogits = dloss.map(|_| h.logits);
            let written: Vec<Span> = [h.losses].into_iter().chain(dlogits).collect();
            work::traffic(be, &[h.logits], &written, &[])
        })
    };
    let rows = CeRows {
        maxes: h.ce_max,
        sums: h.ce_sum,
        tl: h.ce_tl,
    };
    if x.comm.size() == 1 {
        x.be.ce_whole_vocab(h.losses, h.logits, rows, targets, dloss, cd);
    } else {
        x.be.ce_row_stats(h.ce_local_max, h.ce_sum, h.logits, cd);
        x.be.copy(h.ce_max, h.ce_local_max);
        x.allreduce(ar, h.ce_max, ReduceOp::Max);
        x.be.ce_rescale_sums(h.ce_sum, h.ce_local_max, h.ce_max);
        x.be.ce_target_logit(h.ce_tl, h.logits, targets, cd);
        x.allreduce(ar, h.ce_sum, ReduceOp::Sum);
        x.allreduce(ar, h.ce_tl, ReduceOp::Sum);
        x.be.ce_finish(h.losses, h.logits, rows, targets, dloss, cd);
    }
}

/// The cross-entropy's dimensions on this rank: its share of the (padded) vocabulary.
pub fn ce_dims(d: &StepDims, tp_rank: usize, vocab_size: usize) -> CeDims {
    let vocab_start = tp_rank * d.vp;
    CeDims {
        n: d.n(),
        vp: d.vp,
        v_valid: vocab_size.saturating_sub(vocab_start).min(d.vp),
        vocab_start,
    }
}

/// The run header's record of the attention form (`key: attention`).
pub fn attention_form(keep: AttnKeep, recompute: Recompute) -> OpForm {
    let note = (keep == AttnKeep::LogSumExp).then(|| {
        let recompute = if recompute == Recompute::Attention {
            " (--recompute attention has nothing to recompute)"
        } else {
            ""
        };
        format!("attention: fused (FlashAttention: one log-sum-exp per row kept, no T x T probabilities){recompute}")
    });
    OpForm {
        key: "attention",
        form: keep.name(),
        note,
    }
}

/// Whether the attention backward of heads of `hs` kept as `keep` rotates the gradients of
/// rotary-embedded q and k back in its own stores ([`Backend::rope_in_attention_backward`]:
/// the fused backward only), instead of the rope op after it.
pub fn rope_in_attention(be: &impl Backend, keep: AttnKeep, hs: usize) -> bool {
    keep == AttnKeep::LogSumExp && be.rope_in_attention_backward(hs)
}

/// The run header's record of where the rotary embedding's backward runs (`key:
/// rope_backward`): `attention`, in the fused attention backward's stores
/// ([`rope_in_attention`]); `separate`, its own op.
pub fn rope_backward_form(in_attention: bool) -> OpForm {
    OpForm {
        key: "rope_backward",
        form: if in_attention {
            "attention"
        } else {
            "separate"
        },
        note: in_attention.then(|| {
            "rope backward: in the fused attention backward's stores of dQ and dK".to_string()
        }),
    }
}

/// The run header's record of how the projections join the residual stream
/// (`key: residual`).
pub fn residual_form(residual: Residual) -> OpForm {
    let note = (residual == Residual::Epilogue).then(|| {
        "residual: the projections' GEMMs read the residual stream and write the next one"
            .to_string()
    });
    OpForm {
        key: "residual",
        form: residual.name(),
        note,
    }
}

//! What the Llama family's compute ops cost per micro-batch on one rank ([`COST`]), in the
//! terms of `gpt2_cost.rs`: the fused q/k/v projection (`(nh + 2·kv)·hs` outputs), the output
//! projection, the MLP's fused gate/up projection (`2F` outputs) and down projection, all with
//! `(out, in)` weights; attention's batched products over the query heads (a key/value head
//! serves `nh / kv` of them, the products are the same); the LM head; and the elements of
//! the RMS norms, rotary embeddings, SwiGLU, residual adds, embedding and loss.

use super::decoder_cost::{attention, embedding_bytes, linear, streams, tp_allreduces, Weight};
use super::decoder_ops::{backward as bwd, forward as fwd};
use crate::metrics::ops::trainer;
use crate::model::cost::{ComputeOp, CostModel, OpWork, Pass, Slice};

/// The Llama family's compute ops and their cost (module docs).
pub static COST: CostModel = CostModel {
    ops: &OPS,
    work,
    streams,
    tp_allreduces,
    tied_bytes,
};

const OPS: [ComputeOp; 14] = [
    ComputeOp::both(fwd::QKV, bwd::QKV),
    ComputeOp::both(fwd::ROPE, bwd::ROPE),
    ComputeOp::both(fwd::PROJ, bwd::PROJ),
    ComputeOp::both(fwd::BMM, bwd::BMM),
    ComputeOp::both(fwd::BADDBMM, bwd::BADDBMM),
    ComputeOp::both(fwd::SOFTMAX, bwd::SOFTMAX),
    ComputeOp::both(fwd::MLP_MM, bwd::MLP_MM),
    ComputeOp::both(fwd::SWIGLU, bwd::SWIGLU),
    ComputeOp::both(fwd::RMSNORM, bwd::RMSNORM),
    ComputeOp::both(fwd::RESIDUAL, bwd::RESIDUAL),
    ComputeOp::both(fwd::EMBEDDING, bwd::EMBEDDING),
    ComputeOp::both(fwd::LM_HEAD, bwd::LM_HEAD),
    ComputeOp::both(fwd::LOSS, bwd::LOSS),
    ComputeOp {
        forward: trainer::data::BATCH_GENERATOR,
        backward: None,
    },
];

/// This rank's shapes of slice `s`: tokens, query and key/value heads, head size, MLP units
/// and vocabulary rows.
struct Local {
    n: usize,
    nh: usize,
    kv: usize,
    hs: usize,
    f: usize,
    vp: usize,
}

fn local(s: &Slice) -> Local {
    let (m, tp) = (s.model, s.tp);
    Local {
        n: s.mb * s.seq_len,
        nh: m.n_head / tp,
        kv: m.kv_heads() / tp,
        hs: m.head_size(),
        f: m.mlp_width() / tp,
        vp: s.vocab / tp,
    }
}

/// The work of op `op` (forward timer name) in `pass` on slice `s`.
fn work(op: &str, pass: Pass, s: &Slice) -> Option<OpWork> {
    let (c, layers) = (s.model.n_embd, s.layers);
    let Local {
        n,
        nh,
        kv,
        hs,
        f,
        vp,
    } = local(s);
    let w = Weight::OutIn;
    let gemms = match op {
        fwd::QKV => linear(pass, n, c, (nh + 2 * kv) * hs, w, layers),
        fwd::PROJ => linear(pass, n, nh * hs, c, w, layers),
        fwd::MLP_MM => {
            let mut v = linear(pass, n, c, 2 * f, w, layers);
            v.extend(linear(pass, n, f, c, w, layers));
            v
        }
        fwd::LM_HEAD if s.last => linear(pass, n, c, vp, w, 1),
        fwd::LM_HEAD => Vec::new(),
        fwd::BADDBMM | fwd::BMM => attention(op, pass, (s.seq_len, hs, nh), s.mb * layers),
        _ => return elements(op, s).map(OpWork::Elements),
    };
    Some(OpWork::Gemms(gemms))
}

/// Elements of the ops that are not GEMMs, per micro-batch.
fn elements(op: &str, s: &Slice) -> Option<f64> {
    let l = local(s);
    let (n, c, layers) = (l.n as f64, s.model.n_embd as f64, s.layers as f64);
    let t = s.seq_len as f64;
    let on = |b: bool| if b { 1.0 } else { 0.0 };
    Some(match op {
        fwd::SOFTMAX => s.mb as f64 * l.nh as f64 * t * t * layers,
        fwd::ROPE => n * ((l.nh + l.kv) * l.hs) as f64 * layers,
        fwd::SWIGLU => n * l.f as f64 * layers,
        fwd::RMSNORM => n * c * (2.0 * layers + on(s.last)),
        fwd::RESIDUAL => 2.0 * n * c * layers,
        fwd::EMBEDDING => n * c * on(s.first),
        fwd::LOSS => n * l.vp as f64 * on(s.last),
        trainer::data::BATCH_GENERATOR => n * on(s.first),
        _ => return None,
    })
}

/// A tied embedding's copy on the last stage (this rank's vocabulary rows); none untied.
fn tied_bytes(s: &Slice) -> Option<f64> {
    s.model.tied().then(|| embedding_bytes(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Arch, ModelConfig};

    /// FLOPs per step worked by hand for a GQA model with an untied head: per token and
    /// block, 2·C·(nh + 2·kv)·hs (q, k, v), 2·nh·hs·C (o), 2·3·C·F (gate, up, down), and
    /// attention's 2·2·T·nh·hs (scores and values over every pair); the LM head 2·C·V; the
    /// backward pass twice the forward.
    #[test]
    fn calls_add_up_to_the_hand_count() {
        let m = ModelConfig {
            arch: Arch::Llama,
            vocab_size: 1000,
            n_positions: 64,
            n_embd: 96,
            n_head: 6,
            n_kv_head: Some(2),
            head_dim: Some(16),
            intermediate_size: Some(256),
            n_layer: 3,
            ..Default::default()
        };
        let (t, mb, v) = (64, 3, 1024);
        let (c, nh, kv, hs, f) = (96.0, 6.0, 2.0, 16.0, 256.0);
        let per_token_block = 2.0 * c * (nh + 2.0 * kv) * hs
            + 2.0 * nh * hs * c
            + 6.0 * c * f
            + 4.0 * t as f64 * nh * hs;
        let forward = (mb * t) as f64 * (3.0 * per_token_block + 2.0 * c * v as f64);
        for tp in [1, 2] {
            let s = Slice {
                model: &m,
                seq_len: t,
                mb,
                tp,
                layers: 3,
                first: true,
                last: true,
                vocab: v,
            };
            let fwd = COST.gemm_flops(Pass::Forward, &s);
            let bwd = COST.gemm_flops(Pass::Backward, &s);
            let want = forward / tp as f64;
            assert!(
                (fwd - want).abs() <= 1e-9 * want,
                "tp {tp}: {fwd} vs {want}"
            );
            assert!((bwd - 2.0 * want).abs() <= 1e-9 * want, "tp {tp}");
            assert!((COST.model_flops(&s) - 3.0 * want).abs() <= 1e-9 * want);
            assert!(tied_bytes(&s).is_none());
        }
        for op in COST.ops {
            for pass in [Pass::Forward, Pass::Backward] {
                let s = Slice {
                    model: &m,
                    seq_len: t,
                    mb,
                    tp: 1,
                    layers: 3,
                    first: true,
                    last: true,
                    vocab: v,
                };
                assert!(work(op.forward, pass, &s).is_some(), "{}", op.forward);
            }
        }
    }
}

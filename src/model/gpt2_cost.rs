//! What GPT-2's compute ops cost per micro-batch on one rank ([`COST`]): each linear layer's
//! and attention's GEMM calls, in `fugu bench gemm`'s terms (C = A·B, row-major, `ta`/`tb`
//! when A/B is stored transposed), and the elements of the other ops.
//!
//! * a linear layer of `n` tokens, `ic → oc` (`ops/linear.rs`): forward `n × oc × ic`;
//!   backward data `n × ic × oc` (`tb` for the `InOut` weights of the blocks, none for the
//!   `OutIn` LM head, which is `tb` forward), backward weight `ic × oc × n` (`OutIn`:
//!   `oc × ic × n`), both with `ta`;
//! * attention (`ops/attention.rs`), per sequence a batch of `nh` heads: scores Q·Kᵀ
//!   (`attention:baddbmm`, `T × T × hs`, `tb`) and values P·V (`attention:bmm`, `T × hs × T`);
//!   backward, dP = dO·Vᵀ (`T × T × hs`, `tb`) and dV = Pᵀ·dO (`T × hs × T`, `ta`) under
//!   `attention:bmm`, dQ = dS·K and dK = dSᵀ·Q (`T × hs × T`, plain and `ta`) under
//!   `attention:baddbmm`. Every (query, key) pair is counted, as Megatron's formula does.
//!
//! The real attention operands are strided views into the fused QKV buffer; the benchmark's
//! are contiguous, so their rates are an approximation there.

use super::decoder_cost::{attention, embedding_bytes, linear, streams, tp_allreduces, Weight};
use super::decoder_ops::{backward as bwd, forward as fwd};
use crate::metrics::ops::trainer;
use crate::model::cost::{ComputeOp, CostModel, OpWork, Pass, Slice};

/// GPT-2's compute ops and their cost (module docs).
pub static COST: CostModel = CostModel {
    ops: &OPS,
    work,
    streams,
    tp_allreduces,
    tied_bytes,
};

const OPS: [ComputeOp; 13] = [
    ComputeOp::both(fwd::QKV, bwd::QKV),
    ComputeOp::both(fwd::PROJ, bwd::PROJ),
    ComputeOp::both(fwd::BMM, bwd::BMM),
    ComputeOp::both(fwd::BADDBMM, bwd::BADDBMM),
    ComputeOp::both(fwd::SOFTMAX, bwd::SOFTMAX),
    ComputeOp::both(fwd::MLP_MM, bwd::MLP_MM),
    ComputeOp::both(fwd::GELU, bwd::GELU),
    ComputeOp::both(fwd::LAYERNORM, bwd::LAYERNORM),
    ComputeOp::both(fwd::RESIDUAL, bwd::RESIDUAL),
    ComputeOp::both(fwd::EMBEDDING, bwd::EMBEDDING),
    ComputeOp::both(fwd::LM_HEAD, bwd::LM_HEAD),
    ComputeOp::both(fwd::LOSS, bwd::LOSS),
    ComputeOp {
        forward: trainer::data::BATCH_GENERATOR,
        backward: None,
    },
];

/// The work of op `op` (forward timer name) in `pass` on slice `s`.
fn work(op: &str, pass: Pass, s: &Slice) -> Option<OpWork> {
    let m = s.model;
    let (c, t, tp, layers) = (m.n_embd, s.seq_len, s.tp, s.layers);
    let (n, nh, hs) = (s.mb * t, m.n_head / tp, m.n_embd / m.n_head);
    let (f, vp) = (4 * m.n_embd / tp, s.vocab / tp);
    let per_seq = s.mb * layers;
    let gemms = match op {
        fwd::QKV => linear(pass, n, c, 3 * (c / tp), Weight::InOut, layers),
        fwd::PROJ => linear(pass, n, c / tp, c, Weight::InOut, layers),
        fwd::MLP_MM => {
            let mut v = linear(pass, n, c, f, Weight::InOut, layers);
            v.extend(linear(pass, n, f, c, Weight::InOut, layers));
            v
        }
        fwd::LM_HEAD if s.last => linear(pass, n, c, vp, Weight::OutIn, 1),
        fwd::LM_HEAD => Vec::new(),
        fwd::BADDBMM | fwd::BMM => attention(op, pass, (t, hs, nh), per_seq),
        _ => return elements(op, s).map(OpWork::Elements),
    };
    Some(OpWork::Gemms(gemms))
}

/// Elements of the ops that are not GEMMs, per micro-batch.
fn elements(op: &str, s: &Slice) -> Option<f64> {
    let m = s.model;
    let n = (s.mb * s.seq_len) as f64;
    let (c, l) = (m.n_embd as f64, s.layers as f64);
    let nh = (m.n_head / s.tp) as f64;
    let t = s.seq_len as f64;
    let (f, vp) = ((4 * m.n_embd / s.tp) as f64, (s.vocab / s.tp) as f64);
    let on = |b: bool| if b { 1.0 } else { 0.0 };
    Some(match op {
        fwd::SOFTMAX => s.mb as f64 * nh * t * t * l,
        fwd::GELU => n * f * l,
        fwd::LAYERNORM => n * c * (2.0 * l + on(s.last)),
        fwd::RESIDUAL => 2.0 * n * c * l,
        fwd::EMBEDDING => n * c * on(s.first),
        fwd::LOSS => n * vp * on(s.last),
        trainer::data::BATCH_GENERATOR => n * on(s.first),
        _ => return None,
    })
}

/// The tied `wte` (this rank's vocabulary rows), all-reduced between the first and last stage.
fn tied_bytes(s: &Slice) -> Option<f64> {
    Some(embedding_bytes(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::flops::megatron_flops_per_step;
    use crate::model::table::padded_vocab;
    use crate::model::{Arch, ModelConfig};

    fn slice(m: &ModelConfig, t: usize, mb: usize, tp: usize, vocab: usize) -> Slice<'_> {
        Slice {
            model: m,
            seq_len: t,
            mb,
            tp,
            layers: m.n_layer,
            first: true,
            last: true,
            vocab,
        }
    }

    /// The calls of every op, forward and backward, add up to Megatron's FLOPs formula (every
    /// GEMM of the model, the LM head's vocabulary included), at tp 1 and per TP rank; model
    /// FLOPs are three times the forward's.
    #[test]
    fn calls_add_up_to_megatrons_formula() {
        let m = ModelConfig {
            arch: Arch::Gpt2,
            vocab_size: 1000,
            n_positions: 64,
            n_embd: 96,
            n_head: 4,
            n_layer: 3,
            ..Default::default()
        };
        let (t, mb) = (64, 3);
        let vp = padded_vocab(m.vocab_size);
        for tp in [1, 2, 4] {
            let s = slice(&m, t, mb, tp, vp);
            let flops = COST.gemm_flops(Pass::Forward, &s) + COST.gemm_flops(Pass::Backward, &s);
            let want = megatron_flops_per_step(mb, t, m.n_layer, m.n_embd, vp) / tp as f64;
            assert!(
                (flops - want).abs() <= 1e-9 * want,
                "tp {tp}: {flops} vs {want}"
            );
            assert!((COST.model_flops(&s) - want).abs() <= 1e-9 * want);
        }
    }

    /// GPT-2 124M at B = 8, s = 1024 with its file vocabulary (MFU's count): Megatron's
    /// 6 999 559 372 800 FLOPs per step (`metrics/flops.rs` works it by hand).
    #[test]
    fn gpt2_124m_model_flops() {
        let m = crate::config::RunConfig::load("gpt2-124m").unwrap().model;
        let f = COST.model_flops(&slice(&m, 1024, 8, 1, m.vocab_size));
        assert!((f - 6_999_559_372_800.0).abs() < 1.0, "{f}");
    }

    /// Every op is costed in both passes it runs in, and nothing else is.
    #[test]
    fn every_op_has_a_cost() {
        let m = crate::config::RunConfig::load("gpt2-tiny").unwrap().model;
        let s = slice(&m, 64, 2, 2, padded_vocab(m.vocab_size));
        for op in COST.ops {
            assert!(
                work(op.forward, Pass::Forward, &s).is_some(),
                "{}",
                op.forward
            );
            assert!(
                work(op.forward, Pass::Backward, &s).is_some(),
                "{}",
                op.forward
            );
        }
        assert!(work("forward:nonsense", Pass::Forward, &s).is_none());
    }
}

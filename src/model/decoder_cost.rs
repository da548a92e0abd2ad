//! The GEMM calls and collectives the decoder architectures' cost models share
//! (`gpt2_cost.rs`, `llama_cost.rs`): linear layers, attention's batched products (counted
//! over every (query, key) pair, as Megatron's formula does), the tensor-parallel all-reduces
//! of Megatron's layout.

use super::decoder_ops::{backward as bwd, forward as fwd};
use crate::metrics::cost::{Collective, GemmCall, Pass, Slice};

/// How a linear layer stores its weight (`ops/linear.rs`).
#[derive(Clone, Copy)]
pub enum Weight {
    /// (in, out): GPT-2's Conv1D weights.
    InOut,
    /// (out, in): `nn.Linear`'s, and an embedding as the LM head.
    OutIn,
}

pub fn call(
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
    ta: bool,
    tb: bool,
    count: usize,
) -> GemmCall {
    GemmCall::new([m, n, k], batch, (ta, tb), count)
}

/// The GEMMs of `count` linear layers of `n` tokens, `ic → oc`, in one pass.
pub fn linear(
    pass: Pass,
    n: usize,
    ic: usize,
    oc: usize,
    w: Weight,
    count: usize,
) -> Vec<GemmCall> {
    match (pass, w) {
        (Pass::Forward, Weight::InOut) => vec![call(n, oc, ic, 1, false, false, count)],
        (Pass::Forward, Weight::OutIn) => vec![call(n, oc, ic, 1, false, true, count)],
        (Pass::Backward, Weight::InOut) => vec![
            call(n, ic, oc, 1, false, true, count),
            call(ic, oc, n, 1, true, false, count),
        ],
        (Pass::Backward, Weight::OutIn) => vec![
            call(n, ic, oc, 1, false, false, count),
            call(oc, ic, n, 1, true, false, count),
        ],
    }
}

/// Attention's batched products of op `op` (`attention:baddbmm` or `attention:bmm`) in
/// `pass`, `per_seq` times a batch of `nh` heads of size `hs` over `t` positions: scores Q·Kᵀ
/// (`T × T × hs`, `tb`) and values P·V (`T × hs × T`); backward, dP = dO·Vᵀ (`tb`) and
/// dV = Pᵀ·dO (`ta`) under `bmm`, dQ = dS·K and dK = dSᵀ·Q (plain and `ta`) under
/// `baddbmm`.
pub fn attention(
    op: &str,
    pass: Pass,
    (t, hs, nh): (usize, usize, usize),
    per_seq: usize,
) -> Vec<GemmCall> {
    let forward = pass == Pass::Forward;
    match op {
        fwd::BADDBMM if forward => vec![call(t, t, hs, nh, false, true, per_seq)],
        fwd::BADDBMM => vec![
            call(t, hs, t, nh, false, false, per_seq),
            call(t, hs, t, nh, true, false, per_seq),
        ],
        fwd::BMM if forward => vec![call(t, hs, t, nh, false, false, per_seq)],
        _ => vec![
            call(t, t, hs, nh, false, true, per_seq),
            call(t, hs, t, nh, true, false, per_seq),
        ],
    }
}

/// Megatron's tensor-parallel all-reduces (`model/layers.rs`): per block and micro-batch, the
/// attention and MLP outputs (forward) and their input gradients (backward), B·T·C floats
/// each; the vocabulary-parallel embedding (first stage) and LM head (last) theirs; the
/// vocabulary-parallel cross-entropy's row maxima, sums and target logits (B·T floats each).
pub fn tp_allreduces(s: &Slice) -> Vec<Collective> {
    let (mb, t, c) = (s.mb as f64, s.seq_len as f64, s.model.n_embd as f64);
    let stream = 4.0 * mb * t * c;
    let on = |b: bool| if b { 1.0 } else { 0.0 };
    let layers = s.layers as f64;
    let mut v: Vec<Collective> = [
        (fwd::ATTENTION_ALLREDUCE, layers),
        (fwd::MLP_ALLREDUCE, layers),
        (bwd::ATTENTION_ALLREDUCE, layers),
        (bwd::MLP_ALLREDUCE, layers),
        (fwd::EMBEDDING_ALLREDUCE, on(s.first)),
        (bwd::LM_HEAD_ALLREDUCE, on(s.last)),
    ]
    .into_iter()
    .map(|(name, calls)| Collective {
        name,
        bytes: stream,
        calls,
    })
    .collect();
    v.push(Collective {
        name: fwd::LOSS_ALLREDUCE,
        bytes: 4.0 * mb * t,
        calls: 3.0 * on(s.last),
    });
    v
}

/// Bytes of this rank's vocabulary rows of the embedding (f32): what a tied embedding's
/// two copies all-reduce once per step.
pub fn embedding_bytes(s: &Slice) -> f64 {
    4.0 * (s.vocab / s.tp * s.model.n_embd) as f64
}

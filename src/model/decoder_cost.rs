//! The GEMM calls and collectives the decoder architectures' cost models share
//! (`gpt2_cost.rs`, `llama_cost.rs`): linear layers, attention's batched products (counted
//! over every (query, key) pair, as Megatron's formula does), the tensor-parallel all-reduces
//! of Megatron's layout.

use super::decoder_ops::{backward as bwd, forward as fwd};
use crate::metrics::ops::trainer;
use crate::model::cost::{Collective, GemmCall, Pass, Slice, Streams};

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

/// What the non-GEMM ops of both architectures read and write per element of their
/// `elements` count, as the CPU backend runs them (`backend/cpu.rs`, `ops/`): a row op reads
/// its inputs and writes its output once (a row stays in cache between a kernel's passes);
/// a backward op that accumulates into a gradient reads it too. Parameter gradients and
/// statistics are f32, a norm's per-column sums and per-row statistics are left out (one
/// value per row or column, not per element).
pub fn streams(op: &str, pass: Pass) -> Option<Streams> {
    let forward = pass == Pass::Forward;
    let act = |act: f64| Some(Streams { act, f32: 0.0 });
    match op {
        // Scores in, probabilities out; backward: probabilities and their gradient in, the
        // scores' gradient out.
        fwd::SOFTMAX if forward => act(2.0),
        fwd::SOFTMAX => act(3.0),
        // Input in, output out; backward: input and output gradient in, input gradient out.
        fwd::GELU if forward => act(2.0),
        fwd::GELU => act(3.0),
        // Gate and up in, product out; backward: gate, up and the output gradient in, both
        // inputs' gradients out.
        fwd::SWIGLU if forward => act(3.0),
        fwd::SWIGLU => act(5.0),
        // Row in, normalised row out; backward: the row, the output gradient and the residual
        // stream's gradient in, that gradient out (accumulated).
        fwd::LAYERNORM | fwd::RMSNORM if forward => act(2.0),
        fwd::LAYERNORM | fwd::RMSNORM => act(4.0),
        // Two streams in, their sum out (forward); the gradient added into the stream's.
        fwd::RESIDUAL => act(3.0),
        // q and k rotated in place, forward and backward.
        fwd::ROPE => act(2.0),
        // Token and position rows (the compute copy) in, their sum out; backward: the output
        // gradient in, the two tables' f32 gradients read and written.
        fwd::EMBEDDING if forward => act(3.0),
        fwd::EMBEDDING => Some(Streams { act: 1.0, f32: 4.0 }),
        // Logits read twice (row maximum, then the sum of exponentials); backward: logits in,
        // their gradient out.
        fwd::LOSS => act(2.0),
        // Token ids in, inputs and targets out (32-bit each).
        trainer::data::BATCH_GENERATOR => Some(Streams { act: 0.0, f32: 3.0 }),
        _ => None,
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

#[cfg(test)]
mod tests {
    use crate::model::cost::{OpWork, Pass, Slice};
    use crate::model::registry;
    use crate::model::{Arch, ModelConfig};

    /// Every op of both architectures is either GEMMs or has its memory traffic declared, in
    /// each pass it runs: a machine known by its kernels' rates times every op.
    #[test]
    fn every_non_gemm_op_declares_its_streams() {
        for arch in [Arch::Gpt2, Arch::Llama] {
            let m = ModelConfig {
                arch,
                vocab_size: 1000,
                n_positions: 64,
                n_embd: 96,
                n_head: 4,
                n_layer: 3,
                ..Default::default()
            };
            let s = Slice {
                model: &m,
                seq_len: 64,
                mb: 2,
                tp: 1,
                layers: 3,
                first: true,
                last: true,
                vocab: 1024,
            };
            let cost = registry::cost(arch);
            for op in cost.ops {
                for pass in [Pass::Forward, Pass::Backward] {
                    if op.name(pass).is_none() {
                        continue;
                    }
                    let work = (cost.work)(op.forward, pass, &s);
                    let streams = (cost.streams)(op.forward, pass);
                    match work {
                        Some(OpWork::Gemms(_)) => assert!(streams.is_none(), "{}", op.forward),
                        Some(OpWork::Elements(_)) => {
                            let st =
                                streams.unwrap_or_else(|| panic!("{}: no streams", op.forward));
                            assert!(st.act + st.f32 > 0.0, "{}", op.forward);
                        }
                        None => panic!("{arch:?} {}: no work", op.forward),
                    }
                }
            }
        }
    }
}

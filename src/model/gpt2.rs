//! GPT-2 forward and backward passes over a [`Backend`], llm.c style: one parameter buffer,
//! one gradient buffer, two AdamW moment buffers (all carved by the parameter table) and one
//! activation buffer (carved by the activation table).
//!
//! Tensor parallelism: the parameter table already holds this rank's shards (`gpt2_params(cfg,
//! tp)`), and the activation shapes use the local head count, MLP width and vocabulary rows.
//! The Megatron f/g all-reduces go through the tensor-parallel communicator (`TP:` below); with
//! [`SerialComm`] they are no-ops.
//!
//! Pipeline parallelism: the model is one [`Stage`] (the whole model when there is one): its
//! parameter table holds the stage's blocks, plus the embeddings on the first stage and the
//! final layernorm and LM head on the last. A step's micro-batches are loaded together
//! ([`Gpt2::set_batches`]) and each runs forward and backward by index
//! ([`Gpt2::forward_micro`], [`Gpt2::backward_micro`]) in whatever order the schedule says,
//! with up to [`Gpt2::set_in_flight`] micro-batches' activations kept at once. Between stages
//! the caller moves [`Gpt2::stage_output`] / [`Gpt2::stage_input`] forward and
//! [`Gpt2::input_grad`] / [`Gpt2::output_grad`] back. The first and the last stage each hold
//! a copy of the tied `wte`; the caller sums their gradients ([`Gpt2::tied_grad`]).
//!
//! Data parallelism and ZeRO-1 live outside the model: [`Gpt2::backward_micro`] reports when a
//! suffix of the gradient buffer is final (so the trainer can start bucket all-reduces while
//! backward goes on), and [`Gpt2::set_owned`] restricts the optimizer (and the AdamW moments)
//! to the parameter ranges this rank updates.

use super::acts::{
    acts_table, grad_acts_table, stats_table, Acts, AttnKeep, AttnKept, GradActs, HeadActs,
    LayerActs, Recompute, StepDims,
};
use super::contract::{GradsReady, Model, ModelBuffers, OpForm, OptimStep, TpRank};
use super::gpt2_ops::{backward as bwd, forward as fwd};
use super::kv::KvCache;
use super::layers::Layers;
use super::params::{HeadParams, LayerParams, ParamSpans};
use super::paths::{attention_path, mlp_gelu_path, residual_path, Knobs, MlpGelu, Residual};
use super::stage::Stage;
use super::table::{gpt2_stage_params, padded_vocab, OwnedRange, Split, Table};
use super::work;
use crate::backend::{
    AdamWPart, AdamWStep, Backend, BufId, CeDims, CeRows, Dtype, Embedding, KvRows, LayerNorm,
    LayerNormGrads, Linear, LinearGrads, Span, TokSpan, WeightLayout,
};
use crate::comm::{Comm, ReduceOp, SerialComm};
use crate::config::ModelConfig;
use crate::metrics::ops::trainer;
use crate::metrics::timers::{TimerLevel, Timers, Work};
use anyhow::{bail, Result};
use std::ops::Range;
use std::rc::Rc;

use TimerLevel::{Coarse, Fine};

/// Where a forward pass's tokens come from and what attention looks at.
#[derive(Clone, Copy)]
enum Pass<'c> {
    /// Micro-batch `micro` of [`Gpt2::set_batches`]: causal attention within each sequence.
    Batch { micro: usize },
    /// One token at position `pos` (a batch of 1×1), attending to `cache`.
    Decode { cache: &'c KvCache, pos: usize },
}

/// The model on a backend.
///
/// Mixed precision: `compute` is the storage type of every activation, activation gradient
/// and of the parameters the forward and backward passes read. With a 16-bit type the model
/// keeps a second, rounded copy of the parameters in it (`compute_params`, refreshed from the
/// f32 master after every update); the master, the gradients, the AdamW moments and all
/// statistics (layernorm mean/rstd, cross-entropy maxima, sums and losses) stay f32.
pub struct Gpt2<B: Backend> {
    pub cfg: ModelConfig,
    pub tp: TpRank,
    /// The pipeline stage this model runs (the whole model with one stage).
    pub stage: Stage,
    pub be: B,
    /// Parameter table (this rank's shards); also carves gradients and moments.
    pub table: Table,
    /// The f32 master parameters (what the optimizer updates and checkpoints hold).
    pub params: BufId,
    pub grads: BufId,
    pub m: BufId,
    pub v: BufId,
    /// Storage type of activations and of the parameters the passes read.
    compute: Dtype,
    /// The parameters in `compute` (the same buffer as `params` when that is f32).
    compute_params: BufId,
    /// Multiplies the loss gradient (fp16 dynamic loss scaling); the gradient norm and the
    /// optimizer divide it out again.
    loss_scale: f32,
    /// Micro-batches per optimizer step (gradient accumulation): each backward pass adds
    /// 1/accumulation of its micro-batch's mean gradient.
    accumulation: usize,
    /// Activations the backward pass recomputes instead of keeping.
    recompute: Recompute,
    /// Three-step or fused attention ([`attention_path`]).
    attn_keep: AttnKeep,
    /// Where the MLP's GELU runs ([`mlp_gelu_path`]).
    mlp_gelu: MlpGelu,
    /// How the projections join the residual stream ([`residual_path`]).
    residual: Residual,
    /// Micro-batches whose activations are kept at once (pipeline schedules run several
    /// forward passes before the first backward pass); micro-batch `j` uses set `j % in_flight`.
    in_flight: usize,
    /// Micro-batches loaded by the last [`Self::set_batches`].
    micro_batches: usize,
    p: ParamSpans,
    g: ParamSpans,
    /// One activation set per in-flight micro-batch, and the gradient scratch they share.
    acts: Option<(Vec<Acts>, GradActs)>,
    tp_comm: Rc<dyn Comm>,
    owned: Vec<OwnedRange>,
}

impl<B: Backend> Gpt2<B> {
    /// Allocates parameters (zeroed), gradients and moments for `cfg` on `be`, with
    /// activations in `compute` (f32, or bf16/f16 for mixed precision).
    pub fn new(cfg: &ModelConfig, tp: TpRank, compute: Dtype, be: B) -> Result<Gpt2<B>> {
        Self::build(cfg, tp, &Stage::whole(cfg.n_layer), be, true, compute)
    }

    /// [`Self::new`] for one pipeline stage: only the stage's parameters.
    pub fn new_stage(
        cfg: &ModelConfig,
        tp: TpRank,
        stage: &Stage,
        compute: Dtype,
        be: B,
    ) -> Result<Gpt2<B>> {
        Self::build(cfg, tp, stage, be, true, compute)
    }

    /// Parameters only, no gradients or AdamW moments (a quarter of the memory), for
    /// [`Self::decode`] and evaluation; the training methods ([`Self::backward`],
    /// [`Self::apply_optimizer`]) must not be called on it.
    pub fn for_inference(cfg: &ModelConfig, be: B) -> Result<Gpt2<B>> {
        Self::build(
            cfg,
            TpRank::SERIAL,
            &Stage::whole(cfg.n_layer),
            be,
            false,
            Dtype::F32,
        )
    }

    fn build(
        cfg: &ModelConfig,
        tp: TpRank,
        stage: &Stage,
        mut be: B,
        trainable: bool,
        compute: Dtype,
    ) -> Result<Gpt2<B>> {
        let table = gpt2_stage_params(cfg, tp.size, stage)?;
        let n = table.total();
        let params = be.alloc(n, Dtype::F32)?;
        let compute_params = match compute {
            Dtype::F32 => params,
            low => be.alloc(n, low)?,
        };
        let state_n = if trainable { n } else { 0 };
        let grads = be.alloc(state_n, Dtype::F32)?;
        let m = be.alloc(state_n, Dtype::F32)?;
        let v = be.alloc(state_n, Dtype::F32)?;
        let p = ParamSpans::new(&table, compute_params, stage);
        let g = p.on(grads);
        let knobs = Knobs::from_env()?;
        let attn_keep = attention_path(&be, cfg.n_embd / cfg.n_head, compute, knobs.attention)?;
        let mlp_gelu = mlp_gelu_path(&be, compute, knobs.mlp_gelu)?;
        let residual = residual_path(&be, compute, knobs.residual)?;
        Ok(Gpt2 {
            cfg: cfg.clone(),
            tp,
            stage: stage.clone(),
            be,
            table,
            params,
            grads,
            m,
            v,
            compute,
            compute_params,
            loss_scale: 1.0,
            accumulation: 1,
            recompute: Recompute::None,
            attn_keep,
            mlp_gelu,
            residual,
            in_flight: 1,
            micro_batches: 0,
            p,
            g,
            acts: None,
            tp_comm: Rc::new(SerialComm::new()),
            owned: vec![OwnedRange {
                flat: 0..state_n,
                moment_offset: 0,
            }],
        })
    }

    /// Panics (a bug in the caller) when the model was built by [`Self::for_inference`].
    fn assert_trainable(&self) {
        assert!(
            self.be.buf_len(self.grads) == self.table.total(),
            "training method called on a model built for inference"
        );
    }

    /// Uses `comm` (this rank's tensor-parallel group, of size `tp.size`) for the TP
    /// all-reduces.
    pub fn set_tp_comm(&mut self, comm: Rc<dyn Comm>) -> Result<()> {
        if comm.size() != self.tp.size || comm.rank() != self.tp.rank {
            bail!(
                "tensor-parallel communicator is rank {} of {}, the model was built as rank {} of {}",
                comm.rank(),
                comm.size(),
                self.tp.rank,
                self.tp.size
            );
        }
        self.tp_comm = comm;
        Ok(())
    }

    /// The gradient of `wte` when this stage holds one of its two tied copies (the first and
    /// the last of several stages): the caller sums it with the other stage's after the
    /// step's last backward pass. `None` with one stage (one copy) or in a middle stage.
    pub fn tied_grad(&self) -> Option<Span> {
        if self.stage.count == 1 {
            return None;
        }
        self.g.embed.map(|e| e.wte).or(self.g.head.map(|h| h.wte))
    }

    /// Restricts the optimizer to `owned` parameter ranges (ZeRO-1) and reallocates the AdamW
    /// moments to hold just those (zeroed).
    pub fn set_owned(&mut self, owned: Vec<OwnedRange>) -> Result<()> {
        let total = self.table.total();
        let mut next = 0;
        for o in &owned {
            if o.flat.end > total || o.moment_offset != next {
                bail!("owned parameter ranges must lie in 0..{total} with packed moment offsets");
            }
            next += o.flat.len();
        }
        self.be.free(self.m);
        self.be.free(self.v);
        self.m = self.be.alloc(next, Dtype::F32)?;
        self.v = self.be.alloc(next, Dtype::F32)?;
        self.owned = owned;
        Ok(())
    }

    /// The parameter ranges this rank's optimizer updates.
    pub fn owned(&self) -> &[OwnedRange] {
        &self.owned
    }
    /// Copies a host parameter buffer (laid out by [`Self::table`]) onto the backend.
    pub fn load_params(&mut self, host: &[f32]) -> Result<()> {
        if host.len() != self.table.total() {
            bail!(
                "parameter buffer has {} floats, the model needs {}",
                host.len(),
                self.table.total()
            );
        }
        let s = self.be.whole(self.params);
        self.be.upload(s, host);
        self.refresh_compute_params();
        Ok(())
    }

    /// Whether attention runs in three steps (probabilities kept) or fused.
    pub fn attention(&self) -> AttnKeep {
        self.attn_keep
    }

    /// Whether the MLP's GELU runs on its own or in the GEMMs' epilogues.
    pub fn mlp_gelu(&self) -> MlpGelu {
        self.mlp_gelu
    }

    /// Whether the projections join the residual stream in their GEMMs or by their own op.
    pub fn residual(&self) -> Residual {
        self.residual
    }

    /// Sets how the projections join the residual stream (tests; runs choose by
    /// [`residual_path`] when the model is built). Fails if the backend has no residual
    /// epilogue for the model's activations.
    pub fn set_residual(&mut self, r: Residual) -> Result<()> {
        if r == Residual::Epilogue && !self.be.residual_epilogue(self.compute) {
            bail!(
                "the {} backend has no residual epilogue for activations stored as {}",
                self.be.name(),
                self.compute.name()
            );
        }
        self.residual = r;
        Ok(())
    }

    /// Storage type of activations and of the parameters the passes read.
    pub fn compute_dtype(&self) -> Dtype {
        self.compute
    }

    /// Bytes of the low-precision parameter copy (0 when computing in f32).
    pub fn compute_params_bytes(&self) -> usize {
        match self.compute {
            Dtype::F32 => 0,
            low => low.bytes() * self.table.total(),
        }
    }

    /// Rounds the whole f32 master into the compute copy (a no-op in f32). The optimizer
    /// refreshes what it updates; call this after changing the master any other way (a ZeRO-1
    /// all-gather of the parameters).
    pub fn refresh_compute_params(&mut self) {
        if self.compute_params != self.params {
            let (dst, src) = (
                self.be.whole(self.compute_params),
                self.be.whole(self.params),
            );
            self.be.copy(dst, src);
        }
    }

    /// Frees the activation and gradient-scratch buffers (reallocated at the next batch).
    fn free_acts(&mut self) {
        if let Some((sets, g)) = self.acts.take() {
            for a in sets {
                self.be.free(a.buf);
                self.be.free(a.stats_buf);
            }
            self.be.free(g.buf);
        }
    }

    /// Keeps the activations of `k` micro-batches at once (at least 1; a pipeline schedule's
    /// largest number of forward passes awaiting their backward pass). Takes effect at the
    /// next batch.
    pub fn set_in_flight(&mut self, k: usize) {
        let k = k.max(1);
        if k != self.in_flight {
            self.in_flight = k;
            self.free_acts();
        }
    }

    /// Sets the loss scale (fp16 dynamic loss scaling): the next backward pass computes
    /// `scale ×` the gradients; [`Self::grad_sq_sum`] and [`Self::apply_optimizer`] divide
    /// it out.
    pub fn set_loss_scale(&mut self, scale: f32) {
        self.loss_scale = scale;
    }

    /// Gradient accumulation over `m` micro-batches: each backward pass (after
    /// `forward(.., true)`) adds 1/m of its micro-batch's mean-loss gradient, so `m` equal
    /// micro-batches accumulate the gradient of their union's mean loss.
    pub fn set_accumulation(&mut self, m: usize) {
        self.accumulation = m.max(1);
    }

    /// Activation recomputation (changes memory and time only: the recomputed activations are
    /// bit-identical to the kept ones, so are the gradients). Takes effect at the next batch.
    pub fn set_recompute(&mut self, r: Recompute) {
        if r != self.recompute {
            self.recompute = r;
            self.free_acts();
        }
    }

    /// Parameters, gradients or a moment buffer as a host copy.
    pub fn download(&self, buf: BufId) -> Vec<f32> {
        let s = self.be.whole(buf);
        let mut out = vec![0.0; s.len];
        self.be.download(s, &mut out);
        out
    }

    /// Bytes of the activations (with their f32 statistics) of every in-flight micro-batch of
    /// `b`×`t`, and of the gradient scratch (for the memory report).
    pub fn activation_bytes(&self, b: usize, t: usize) -> (usize, usize) {
        let d = self.dims(b, t);
        let el = self.compute.bytes();
        (
            self.in_flight
                * (el * acts_table(&d, &self.stage, self.recompute, self.attn_keep).total()
                    + Dtype::F32.bytes() * stats_table(&d, &self.stage, self.attn_keep).total()),
            el * grad_acts_table(&d, self.attn_keep).total(),
        )
    }

    fn dims(&self, b: usize, t: usize) -> StepDims {
        StepDims {
            b,
            t,
            c: self.cfg.n_embd,
            nh: self.cfg.n_head / self.tp.size,
            hs: self.cfg.n_embd / self.cfg.n_head,
            f: 4 * self.cfg.n_embd / self.tp.size,
            vp: padded_vocab(self.cfg.vocab_size) / self.tp.size,
        }
    }

    /// Makes sure activation buffers for `b`×`t` exist (allocated once, reused every step).
    fn ensure_acts(&mut self, b: usize, t: usize) -> Result<()> {
        if self
            .acts
            .as_ref()
            .is_some_and(|(a, _)| a[0].dims.b == b && a[0].dims.t == t)
        {
            return Ok(());
        }
        if t > self.cfg.n_positions {
            bail!(
                "sequence length {t} exceeds model.n_positions = {}",
                self.cfg.n_positions
            );
        }
        let d = self.dims(b, t);
        self.free_acts();
        let mut sets = Vec::with_capacity(self.in_flight);
        for _ in 0..self.in_flight {
            let at = acts_table(&d, &self.stage, self.recompute, self.attn_keep);
            let st = stats_table(&d, &self.stage, self.attn_keep);
            let ab = self.be.alloc(at.total(), self.compute)?;
            let sb = self.be.alloc(st.total(), Dtype::F32)?;
            sets.push(Acts::new(d, &self.stage, (at, ab), (st, sb)));
        }
        let gt = grad_acts_table(&d, self.attn_keep);
        let gb = self.be.alloc(gt.total(), self.compute)?;
        self.acts = Some((sets, GradActs::new(gt, gb)));
        Ok(())
    }

    /// Loads a batch window of `b` rows of `t + 1` tokens (inputs are the first `t`, targets
    /// the last `t` of each row) as micro-batch 0. Token ids must be below the vocabulary size.
    pub fn set_batch(&mut self, window: &[u32], b: usize, t: usize) -> Result<()> {
        self.set_batches(window, 1, b, t)
    }

    /// Loads a step's window of `micro × b` rows of `t + 1` tokens as `micro` micro-batches of
    /// `b` rows (micro-batch `j` is rows `j·b..(j+1)·b`), for [`Self::forward_micro`] and
    /// [`Self::backward_micro`]. Token ids must be below the vocabulary size.
    pub fn set_batches(&mut self, window: &[u32], micro: usize, b: usize, t: usize) -> Result<()> {
        if micro == 0 || window.len() != micro * b * (t + 1) {
            bail!(
                "batch has {} tokens, expected {micro} micro-batches of {b} x ({t} + 1)",
                window.len()
            );
        }
        if let Some((i, &bad)) = window
            .iter()
            .enumerate()
            .find(|(_, &x)| x as usize >= self.cfg.vocab_size)
        {
            bail!(
                "token id {bad} at position {i} of the batch is not below model.vocab_size = {}",
                self.cfg.vocab_size
            );
        }
        self.ensure_acts(b, t)?;
        // Per micro-batch: its inputs, then its targets ([`Self::tokens`]).
        let mut toks = Vec::with_capacity(2 * micro * b * t);
        for mb in window.chunks(b * (t + 1)) {
            for row in mb.chunks(t + 1) {
                toks.extend_from_slice(&row[..t]);
            }
            for row in mb.chunks(t + 1) {
                toks.extend_from_slice(&row[1..]);
            }
        }
        self.be.set_tokens(&toks);
        self.micro_batches = micro;
        Ok(())
    }

    /// Micro-batch `micro`'s input and target tokens (B·T each).
    fn tokens(&self, micro: usize) -> (TokSpan, TokSpan) {
        assert!(
            micro < self.micro_batches,
            "micro-batch {micro} of {} loaded",
            self.micro_batches
        );
        let n = self.acts_of(micro).dims.n();
        (
            TokSpan {
                offset: 2 * n * micro,
                len: n,
            },
            TokSpan {
                offset: 2 * n * micro + n,
                len: n,
            },
        )
    }

    /// The activation set of micro-batch `micro`.
    fn acts_of(&self, micro: usize) -> &Acts {
        slot(&self.acts, micro).0
    }

    fn grad_acts(&self) -> &GradActs {
        slot(&self.acts, 0).1
    }

    /// Where micro-batch `micro`'s input residual stream (B·T, C) lies: a stage after the
    /// first receives the previous stage's [`Self::stage_output`] here before
    /// [`Self::forward_micro`].
    pub fn stage_input(&self, micro: usize) -> Span {
        self.acts_of(micro).encoded
    }

    /// Micro-batch `micro`'s output residual stream (B·T, C) after [`Self::forward_micro`]: the
    /// next stage's input.
    pub fn stage_output(&self, micro: usize) -> Span {
        let a = self.acts_of(micro);
        a.layers.last().map_or(a.encoded, |l| l.resid3)
    }

    /// Where a stage before the last receives the gradient of its [`Self::stage_output`]
    /// before [`Self::backward_micro`].
    pub fn output_grad(&self) -> Span {
        self.grad_acts().dres
    }

    /// The gradient of the stage's input after [`Self::backward_micro`]: sent to the previous
    /// stage (its [`Self::output_grad`]).
    pub fn input_grad(&self) -> Span {
        self.grad_acts().dres
    }

    /// Forward pass on micro-batch 0 of the whole model (see [`Self::forward_micro`]).
    /// Returns the mean loss.
    pub fn forward(&mut self, timers: &Timers, for_backward: bool) -> f32 {
        self.forward_micro(0, timers, for_backward)
            .expect("forward on a model without the loss (a pipeline stage before the last)")
    }

    /// Forward pass of this stage on micro-batch `micro` of [`Self::set_batches`] (after
    /// [`Self::stage_input`] received it, on a stage after the first). On the last stage,
    /// returns the micro-batch's mean loss, and with `for_backward` replaces the logits by the
    /// loss gradient (mean over B·T, divided by the accumulation count and multiplied by the
    /// loss scale), ready for [`Self::backward_micro`]; `None` on other stages.
    pub fn forward_micro(
        &mut self,
        micro: usize,
        timers: &Timers,
        for_backward: bool,
    ) -> Option<f32> {
        let _fwd = timers.scope(trainer::phase::FORWARD, Coarse);
        self.forward_logits(timers, Pass::Batch { micro });
        let (_, targets) = self.tokens(micro);
        let a = slot(&self.acts, micro).0;
        let h = a.head?;
        let d = a.dims;
        let n = d.n();
        let vocab_start = self.tp.rank * d.vp;
        let cd = CeDims {
            n,
            vp: d.vp,
            v_valid: self.cfg.vocab_size.saturating_sub(vocab_start).min(d.vp),
            vocab_start,
        };
        let dloss = for_backward.then_some(self.loss_scale / (n * self.accumulation) as f32);
        let x = &mut Layers {
            be: &mut self.be,
            comm: &*self.tp_comm,
            timers,
        };
        Some(loss_forward(x, &h, targets, cd, dloss))
    }

    /// Next-token logits (real vocabulary only) after feeding `token` at position `pos`, its
    /// key and value appended to `cache` (which must hold positions `0..pos` from earlier
    /// calls). The same forward pass as training ([`Self::forward`]) on a batch of one token,
    /// with attention over the cache ([`Backend::attention_decode`]).
    pub fn decode(
        &mut self,
        cache: &KvCache,
        token: u32,
        pos: usize,
        timers: &Timers,
    ) -> Result<Vec<f32>> {
        if self.tp.size != 1 || self.stage.count != 1 {
            bail!("decoding needs the whole model on one rank (tp = 1, one pipeline stage)");
        }
        if pos >= cache.positions() || pos >= self.cfg.n_positions {
            bail!(
                "context full: the model accepts at most n_positions = {} tokens",
                self.cfg.n_positions
            );
        }
        if token as usize >= self.cfg.vocab_size {
            bail!(
                "token id {token} is not below vocab_size {}",
                self.cfg.vocab_size
            );
        }
        self.ensure_acts(1, 1)?;
        self.be.set_tokens(&[token]);
        self.forward_logits(timers, Pass::Decode { cache, pos });
        let h = self.acts_of(0).head.expect("the whole model has the head");
        let logits = h.logits.sub(0, self.cfg.vocab_size);
        let mut out = vec![0.0; logits.len];
        self.be.download(logits, &mut out);
        Ok(out)
    }

    /// A key/value cache for [`Self::decode`] on this model's backend (all positions).
    pub fn kv_cache(&mut self) -> Result<KvCache> {
        let d = self.dims(1, 1);
        KvCache::new(
            &mut self.be,
            self.cfg.n_layer,
            self.cfg.n_positions,
            d.local_c(),
            self.compute,
        )
    }

    /// Releases a cache's memory.
    pub fn free_kv_cache(&mut self, cache: KvCache) {
        self.be.free(cache.buf());
    }

    /// This stage's forward pass from tokens (first stage) or its input (other stages) to
    /// its output (the logits on the last stage; everything but the loss), shared by training
    /// and decoding; `pass` says where the tokens and attention's keys and values come from.
    fn forward_logits(&mut self, timers: &Timers, pass: Pass) {
        let (inputs, micro) = match pass {
            Pass::Batch { micro } => (self.tokens(micro).0, micro),
            Pass::Decode { .. } => (TokSpan { offset: 0, len: 1 }, 0),
        };
        let a = slot(&self.acts, micro).0;
        let d = a.dims;
        let p = &self.p;
        let x = &mut Layers {
            be: &mut self.be,
            comm: &*self.tp_comm,
            timers,
        };
        // Replicated additions (position embedding, row-parallel biases) happen on one rank,
        // before the all-reduce sums the shards.
        let first = self.tp.rank == 0;
        // A stage after the first finds its input in `encoded` already.
        if let Some(e) = p.embed {
            let wpe = first.then_some(match pass {
                Pass::Batch { .. } => e.wpe,
                Pass::Decode { pos, .. } => e.wpe.sub(pos * d.c, d.c),
            });
            let emb = embedding(e.wte, wpe, self.tp.rank, &d);
            embedding_forward(x, &emb, a.encoded, inputs);
        }
        let mut resid = a.encoded;
        for (l, (la, lp)) in a.layers.iter().zip(&p.layers).enumerate() {
            let bp = BlockPass {
                d: &d,
                tp_first: first,
                gelu: self.mlp_gelu,
                residual: self.residual,
                pass,
                layer: l,
                proj: a.proj,
            };
            block_forward(x, la, lp, resid, &bp);
            resid = la.resid3;
        }
        let (Some(h), Some(hp)) = (a.head, p.head) else {
            return;
        };
        let (lnf, lm_head) = head_layers(&hp, &d);
        let stats = h.lnf_stats();
        x.layernorm(fwd::LAYERNORM, &lnf, h.lnf, stats, resid);
        x.linear(fwd::LM_HEAD, &lm_head, h.logits, h.lnf);
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) {
        self.assert_trainable();
        let s = self.be.whole(self.grads);
        self.be.zero(s);
    }

    /// Backward pass of micro-batch 0 after `forward(.., true)`: accumulates into the
    /// gradient buffer.
    pub fn backward(&mut self, timers: &Timers) {
        self.backward_micro(0, timers, &mut |_, _| {});
    }

    /// Backward pass of this stage for micro-batch `micro` after
    /// `forward_micro(micro, .., true)` (and, on a stage before the last, after
    /// [`Self::output_grad`] received the gradient of its output): accumulates into the
    /// gradient buffer and leaves the gradient of the stage's input in [`Self::input_grad`].
    /// Calls `ready(backend, from)` whenever the gradients at flat offsets `from..` have their
    /// final value for this micro-batch (after each block, in reverse order, and with
    /// `from = 0` at the end), so that after the step's last micro-batch their all-reduce can
    /// start early.
    pub fn backward_micro(&mut self, micro: usize, timers: &Timers, ready: &mut GradsReady<B>) {
        self.assert_trainable();
        let (inputs, _) = self.tokens(micro);
        let (a, ga) = slot(&self.acts, micro);
        let d = a.dims;
        let (p, g) = (&self.p, &self.g);
        let x = &mut Layers {
            be: &mut self.be,
            comm: &*self.tp_comm,
            timers,
        };
        let _bwd = timers.scope(trainer::phase::BACKWARD, Coarse);
        // A stage before the last finds the gradient of its output in `dres` already.
        if let (Some(h), Some(hp), Some(hg)) = (a.head, p.head, g.head) {
            let last = a.layers.last().map_or(a.encoded, |l| l.resid3);
            head_backward(x, &d, (&h, &hp, &hg), ga, last);
        }
        for l in (0..a.layers.len()).rev() {
            let (la, lp) = (&a.layers[l], &p.layers[l]);
            let resid = if l == 0 {
                a.encoded
            } else {
                a.layers[l - 1].resid3
            };
            let bp = BlockPass {
                d: &d,
                tp_first: self.tp.rank == 0,
                gelu: self.mlp_gelu,
                residual: self.residual,
                pass: Pass::Batch { micro },
                layer: l,
                proj: a.proj,
            };
            if self.recompute == Recompute::Full && l + 1 < a.layers.len() {
                // This block's activations, as the forward pass computed them, into the set
                // all blocks share (the last block's are still there). Its inner op timers
                // (and TP all-reduces) count as this one.
                let _t = timers.scope(bwd::RECOMPUTE, Fine);
                let _quiet = timers.pause();
                block_forward(x, la, lp, resid, &bp);
            }
            let recompute_attention = self.recompute == Recompute::Attention;
            block_backward(
                x,
                &bp,
                (la, lp, &g.layers[l]),
                ga,
                resid,
                recompute_attention,
            );
            ready(x.be, lp.ln1_w.offset);
        }
        if let Some(e) = g.embed {
            let de = embedding(e.wte, Some(e.wpe), self.tp.rank, &d);
            embedding_backward(x, &de, ga.dres, inputs);
        }
        ready(x.be, 0);
    }

    /// Global L2 norm of the gradients (one process; parallel runs all-reduce
    /// [`Self::grad_sq_sum`] instead).
    pub fn grad_norm(&mut self, timers: &Timers) -> f64 {
        self.grad_sq_sum(timers).sqrt()
    }

    /// This rank's share of the squared gradient norm: the owned ranges of every tensor, with
    /// replicated (not tensor-parallel) tensors counted on TP rank 0 only and the tied `wte`
    /// on the first pipeline stage only, so the sum over all ranks is the squared norm of the
    /// logical model's gradient.
    pub fn grad_sq_sum(&mut self, timers: &Timers) -> f64 {
        let mut spans = Vec::new();
        let tied = self.tied_grad();
        for spec in self.table.specs() {
            if self.tp.rank != 0 && spec.split == Split::Replicated {
                continue;
            }
            // The tied `wte` has a copy on the first and on the last stage: counted once.
            if !self.stage.is_first() && tied.is_some_and(|g| g.offset == spec.offset) {
                continue;
            }
            for (r, _) in owned_parts(&self.owned, spec.range()) {
                spans.push(Span {
                    buf: self.grads,
                    offset: r.start,
                    len: r.len(),
                });
            }
        }
        let _c = timers
            .scope(trainer::optimizer::CLIP, Fine)
            .with_work(|| work::traffic(&self.be, &spans, &[], &[]));
        // Summed in table order, as before; the loss scale divided out.
        let scale = self.loss_scale as f64;
        self.be.sum_of_squares(&spans).iter().sum::<f64>() / (scale * scale)
    }

    /// Clipping (PyTorch `clip_grad_norm_`: scale by clip/(norm+1e-6) when that is below 1) and
    /// one AdamW step on every tensor; weight decay only on 2-D tensors. `norm` is the pre-clip
    /// global gradient norm from [`Self::grad_sq_sum`] (loss scale already divided out). The
    /// gradients are multiplied by the clip factor over the loss scale, and the update rewrites
    /// the compute copy of every range it updates (`AdamWPart::compute`).
    pub fn apply_optimizer(&mut self, o: &OptimStep, norm: f64, timers: &Timers) {
        self.assert_trainable();
        let mut scale = 1.0f64;
        if o.grad_clip > 0.0 {
            let coef = o.grad_clip / (norm + 1e-6);
            if coef < 1.0 {
                scale = coef;
            }
        }
        let scale = scale / self.loss_scale as f64;
        let hp = AdamWStep {
            lr: o.lr as f32,
            beta1: o.beta1 as f32,
            beta2: o.beta2 as f32,
            eps: o.eps as f32,
            weight_decay: o.weight_decay as f32,
            step: o.step,
            grad_scale: scale as f32,
        };
        let mut parts = Vec::new();
        for spec in self.table.specs() {
            for (r, moment) in owned_parts(&self.owned, spec.range()) {
                let span = |buf, offset| Span {
                    buf,
                    offset,
                    len: r.len(),
                };
                parts.push(AdamWPart {
                    params: span(self.params, r.start),
                    grads: span(self.grads, r.start),
                    m: span(self.m, moment),
                    v: span(self.v, moment),
                    compute: (self.compute_params != self.params)
                        .then(|| span(self.compute_params, r.start)),
                    decay: spec.decay,
                });
            }
        }
        let _t = timers.scope(trainer::optimizer::ADAMW, Fine).with_work(|| {
            let mut w = Work::default();
            for p in &parts {
                let copy: Vec<Span> = p.compute.into_iter().collect();
                w += work::traffic(&self.be, &[p.grads], &copy, &[p.params, p.m, p.v]);
            }
            w
        });
        self.be.adamw(&parts, &hp);
    }

    /// Logits of the last forward pass without the loss gradient (host copy, padded columns
    /// included). Only meaningful after `forward(.., false)`.
    pub fn last_logits(&self) -> Vec<f32> {
        let h = self
            .acts_of(0)
            .head
            .expect("logits on the last pipeline stage only");
        let mut out = vec![0.0; h.logits.len];
        self.be.download(h.logits, &mut out);
        out
    }
}

impl<B: Backend> Model<B> for Gpt2<B> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn tp(&self) -> TpRank {
        self.tp
    }

    fn stage(&self) -> &Stage {
        &self.stage
    }

    fn table(&self) -> &Table {
        &self.table
    }

    fn buffers(&self) -> ModelBuffers {
        ModelBuffers {
            params: self.params,
            grads: self.grads,
            m: self.m,
            v: self.v,
        }
    }

    fn backend(&self) -> &B {
        &self.be
    }

    fn backend_mut(&mut self) -> &mut B {
        &mut self.be
    }

    fn forms(&self) -> Vec<OpForm> {
        let attention_note = (self.attn_keep == AttnKeep::LogSumExp).then(|| {
            let recompute = if self.recompute == Recompute::Attention {
                " (--recompute attention has nothing to recompute)"
            } else {
                ""
            };
            format!("attention: fused (FlashAttention: one log-sum-exp per row kept, no T x T probabilities){recompute}")
        });
        let mlp_note = (self.mlp_gelu == MlpGelu::Epilogue).then(|| {
            "MLP: GELU in the fc GEMM's epilogue, its derivative in the fc projection's input-gradient GEMM's".to_string()
        });
        let residual_note = (self.residual == Residual::Epilogue).then(|| {
            "residual: the projections' GEMMs read the residual stream and write the next one"
                .to_string()
        });
        vec![
            OpForm {
                key: "attention",
                form: self.attn_keep.name(),
                note: attention_note,
            },
            OpForm {
                key: "mlp_gelu",
                form: self.mlp_gelu.name(),
                note: mlp_note,
            },
            OpForm {
                key: "residual",
                form: self.residual.name(),
                note: residual_note,
            },
        ]
    }

    fn set_tp_comm(&mut self, comm: Rc<dyn Comm>) -> Result<()> {
        Gpt2::set_tp_comm(self, comm)
    }

    fn set_owned(&mut self, owned: Vec<OwnedRange>) -> Result<()> {
        Gpt2::set_owned(self, owned)
    }

    fn owned(&self) -> &[OwnedRange] {
        Gpt2::owned(self)
    }

    fn set_in_flight(&mut self, k: usize) {
        Gpt2::set_in_flight(self, k)
    }

    fn set_accumulation(&mut self, m: usize) {
        Gpt2::set_accumulation(self, m)
    }

    fn set_recompute(&mut self, r: Recompute) {
        Gpt2::set_recompute(self, r)
    }

    fn set_loss_scale(&mut self, scale: f32) {
        Gpt2::set_loss_scale(self, scale)
    }

    fn load_params(&mut self, host: &[f32]) -> Result<()> {
        Gpt2::load_params(self, host)
    }

    fn refresh_compute_params(&mut self) {
        Gpt2::refresh_compute_params(self)
    }

    fn compute_params_bytes(&self) -> usize {
        Gpt2::compute_params_bytes(self)
    }

    fn activation_bytes(&self, b: usize, t: usize) -> (usize, usize) {
        Gpt2::activation_bytes(self, b, t)
    }

    fn download(&self, buf: BufId) -> Vec<f32> {
        Gpt2::download(self, buf)
    }

    fn set_batches(&mut self, window: &[u32], micro: usize, b: usize, t: usize) -> Result<()> {
        Gpt2::set_batches(self, window, micro, b, t)
    }

    fn stage_input(&self, micro: usize) -> Span {
        Gpt2::stage_input(self, micro)
    }

    fn stage_output(&self, micro: usize) -> Span {
        Gpt2::stage_output(self, micro)
    }

    fn output_grad(&self) -> Span {
        Gpt2::output_grad(self)
    }

    fn input_grad(&self) -> Span {
        Gpt2::input_grad(self)
    }

    fn tied_grad(&self) -> Option<Span> {
        Gpt2::tied_grad(self)
    }

    fn zero_grad(&mut self) {
        Gpt2::zero_grad(self)
    }

    fn forward_micro(&mut self, micro: usize, timers: &Timers, for_backward: bool) -> Option<f32> {
        Gpt2::forward_micro(self, micro, timers, for_backward)
    }

    fn backward_micro(&mut self, micro: usize, timers: &Timers, ready: &mut GradsReady<B>) {
        Gpt2::backward_micro(self, micro, timers, ready)
    }

    fn grad_sq_sum(&mut self, timers: &Timers) -> f64 {
        Gpt2::grad_sq_sum(self, timers)
    }

    fn apply_optimizer(&mut self, o: &OptimStep, norm: f64, timers: &Timers) {
        Gpt2::apply_optimizer(self, o, norm, timers)
    }

    fn kv_cache(&mut self) -> Result<KvCache> {
        Gpt2::kv_cache(self)
    }

    fn free_kv_cache(&mut self, cache: KvCache) {
        Gpt2::free_kv_cache(self, cache)
    }

    fn decode(
        &mut self,
        cache: &KvCache,
        token: u32,
        pos: usize,
        timers: &Timers,
    ) -> Result<Vec<f32>> {
        Gpt2::decode(self, cache, token, pos, timers)
    }
}

/// What a block's forward pass needs besides its activations and parameters.
struct BlockPass<'a, 'c> {
    d: &'a StepDims,
    /// Tensor-parallel rank 0 (adds the replicated row-parallel biases, and in the residual
    /// epilogue the stream).
    tp_first: bool,
    gelu: MlpGelu,
    residual: Residual,
    pass: Pass<'c>,
    /// The block's index within the stage (its key/value cache layer when decoding).
    layer: usize,
    /// Scratch for a projection's output before it joins the residual stream.
    proj: Span,
}

/// A block's layers at a step's dims: its parameters' spans (or, built from the gradient
/// table, its gradients' spans at the same places) with their shapes. The row-parallel
/// projections' biases are added on the first tensor-parallel rank only (`tp_first`).
struct BlockLayers {
    ln1: LayerNorm,
    qkv: Linear,
    attproj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    fcproj: Linear,
}

impl BlockLayers {
    fn new(lp: &LayerParams, d: &StepDims, tp_first: bool) -> BlockLayers {
        let (n, c, f, lc) = (d.n(), d.c, d.f, d.local_c());
        let ln = |w, bias| LayerNorm { w, bias, n, c };
        let lin = |w, bias, ic, oc| Linear {
            w,
            layout: WeightLayout::InOut,
            bias,
            n,
            ic,
            oc,
        };
        BlockLayers {
            ln1: ln(lp.ln1_w, lp.ln1_b),
            qkv: lin(lp.qkv_w, Some(lp.qkv_b), c, 3 * lc),
            attproj: lin(lp.attproj_w, tp_first.then_some(lp.attproj_b), lc, c),
            ln2: ln(lp.ln2_w, lp.ln2_b),
            fc: lin(lp.fc_w, Some(lp.fc_b), c, f),
            fcproj: lin(lp.fcproj_w, tp_first.then_some(lp.fcproj_b), f, c),
        }
    }
}

/// The embedding of a step (this rank's vocabulary rows; `wpe` where this rank adds it), or
/// with the gradients' spans, its backward pass's outputs.
fn embedding(wte: Span, wpe: Option<Span>, tp_rank: usize, d: &StepDims) -> Embedding {
    Embedding {
        wte,
        wpe,
        vocab_start: tp_rank * d.vp,
        b: d.b,
        t: d.t,
        c: d.c,
    }
}

/// The final layernorm and the LM head (the tied `wte`, vocabulary-parallel under TP).
fn head_layers(hp: &HeadParams, d: &StepDims) -> (LayerNorm, Linear) {
    let (n, c) = (d.n(), d.c);
    let lnf = LayerNorm {
        w: hp.lnf_w,
        bias: hp.lnf_b,
        n,
        c,
    };
    let lm_head = Linear {
        w: hp.wte,
        layout: WeightLayout::OutIn,
        bias: None,
        n,
        ic: c,
        oc: d.vp,
    };
    (lnf, lm_head)
}

/// The token (and position) embedding into `out`. TP: vocabulary-parallel, so each rank's
/// rows are partial sums, all-reduced (the positions added on one rank).
fn embedding_forward<B: Backend>(x: &mut Layers<B>, e: &Embedding, out: Span, tokens: TokSpan) {
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

/// One transformer block's forward pass from its input `resid` (the residual stream) into its
/// activations `la`, ending with its output in `la.resid3`: the one block forward, run by the
/// forward pass and again by the backward pass under [`Recompute::Full`].
fn block_forward<B: Backend>(
    x: &mut Layers<B>,
    la: &LayerActs,
    lp: &LayerParams,
    resid: Span,
    bp: &BlockPass,
) {
    let ly = BlockLayers::new(lp, bp.d, bp.tp_first);
    let stats1 = la.ln1_stats();
    x.layernorm(fwd::LAYERNORM, &ly.ln1, la.ln1, stats1, resid);
    x.linear(fwd::QKV, &ly.qkv, la.qkv, la.ln1);
    attention_forward(x, la, bp);
    let names = (fwd::PROJ, fwd::ATTENTION_ALLREDUCE);
    project_into_residual(x, bp, names, &ly.attproj, (la.resid2, resid, la.atty));
    let stats2 = la.ln2_stats();
    x.layernorm(fwd::LAYERNORM, &ly.ln2, la.ln2, stats2, la.resid2);
    match bp.gelu {
        MlpGelu::Separate => {
            x.linear(fwd::MLP_MM, &ly.fc, la.fch, la.ln2);
            let be = &mut *x.be;
            let _t = x
                .timers
                .scope(fwd::GELU, Fine)
                .with_work(|| work::traffic(&*be, &[la.fch], &[la.fch_gelu], &[]));
            be.gelu_forward(la.fch_gelu, la.fch);
        }
        MlpGelu::Epilogue => x.linear_gelu(fwd::MLP_MM, &ly.fc, la.fch_gelu, la.fch, la.ln2),
    }
    let names = (fwd::MLP_MM, fwd::MLP_ALLREDUCE);
    project_into_residual(
        x,
        bp,
        names,
        &ly.fcproj,
        (la.resid3, la.resid2, la.fch_gelu),
    );
}

/// A block's attention from its `qkv` into `atty`: in three steps (probabilities kept), fused,
/// or for one token over the key/value cache.
fn attention_forward<B: Backend>(x: &mut Layers<B>, la: &LayerActs, bp: &BlockPass) {
    let (d, timers) = (bp.d, x.timers);
    let lc = d.local_c();
    let ad = d.attn();
    let be = &mut *x.be;
    match bp.pass {
        Pass::Batch { .. } => match la.att {
            AttnKept::Probabilities(att) => {
                let (q, k, v) = work::qkv_parts(la.qkv);
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
            be.copy(k.sub(pos * lc, lc), la.qkv.sub(lc, lc));
            be.copy(v.sub(pos * lc, lc), la.qkv.sub(2 * lc, lc));
            let kv = KvRows { k, v, len: pos + 1 };
            be.attention_decode(la.atty, la.qkv.sub(0, lc), kv, d.nh, d.hs);
        }
    }
}

/// A block's row-parallel projection `l` whose output joins the residual stream: `out =
/// resid + inp·W + b`, in the projection's GEMM or by its own op as `bp.residual` says, the
/// GEMM timed as `names.0`. TP: each rank's product is a partial sum over its share of the
/// input width; the first rank adds the bias (`l.bias` is `None` on the others) and, in the
/// epilogue, the stream; the all-reduce (timed as `names.1`) sums them.
fn project_into_residual<B: Backend>(
    x: &mut Layers<B>,
    bp: &BlockPass,
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

/// The per-row cross-entropy of the logits against `targets` into `h.losses` and, with
/// `dloss`, the logits replaced by their gradient (times `dloss`); returns the mean loss. TP:
/// the logits are vocabulary-parallel; the row maxima, sums of exponentials and target
/// logits are all-reduced across the shards.
fn loss_forward<B: Backend>(
    x: &mut Layers<B>,
    h: &HeadActs,
    targets: TokSpan,
    cd: CeDims,
    dloss: Option<f32>,
) -> f32 {
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
    x.be.ce_row_stats(h.ce_local_max, h.ce_sum, h.logits, cd);
    x.be.copy(h.ce_max, h.ce_local_max);
    x.allreduce(ar, h.ce_max, ReduceOp::Max);
    x.be.ce_rescale_sums(h.ce_sum, h.ce_local_max, h.ce_max);
    x.be.ce_target_logit(h.ce_tl, h.logits, targets, cd);
    x.allreduce(ar, h.ce_sum, ReduceOp::Sum);
    x.allreduce(ar, h.ce_tl, ReduceOp::Sum);
    let rows = CeRows {
        maxes: h.ce_max,
        sums: h.ce_sum,
        tl: h.ce_tl,
    };
    x.be.ce_finish(h.losses, h.logits, rows, targets, dloss, cd);
    let mut losses = vec![0.0f32; cd.n];
    x.be.download(h.losses, &mut losses);
    (losses.iter().map(|&x| x as f64).sum::<f64>() / cd.n as f64) as f32
}

/// The last stage's backward pass from the loss gradient (in the logits) to the gradient of
/// its last block's output (`ga.dres`): the LM head (TP: vocabulary-parallel, its input
/// gradient all-reduced), then the final layernorm.
fn head_backward<B: Backend>(
    x: &mut Layers<B>,
    d: &StepDims,
    (h, hp, hg): (&HeadActs, &HeadParams, &HeadParams),
    ga: &GradActs,
    last: Span,
) {
    let (lnf, lm_head) = head_layers(hp, d);
    let names = (bwd::LM_HEAD, Some(bwd::LM_HEAD_ALLREDUCE));
    let grads = LinearGrads {
        dinp: Some(ga.dln),
        dw: hg.wte,
        dbias: None,
    };
    x.linear_backward(names, &lm_head, &grads, h.logits, h.lnf);
    let grads = LayerNormGrads {
        dinp: ga.dres,
        dw: hg.lnf_w,
        dbias: hg.lnf_b,
    };
    let stats = h.lnf_stats();
    x.layernorm_backward(bwd::LAYERNORM, &lnf, &grads, (ga.dln, last, stats), true);
}

/// One block's backward pass: `ga.dres` holds the gradient of its output on entry and of its
/// input `resid` on return; its parameter gradients (`lg`) accumulate. TP: the column-parallel
/// layers' input gradients are all-reduced.
fn block_backward<B: Backend>(
    x: &mut Layers<B>,
    bp: &BlockPass,
    (la, lp, lg): (&LayerActs, &LayerParams, &LayerParams),
    ga: &GradActs,
    resid: Span,
    recompute_attention: bool,
) {
    let ly = BlockLayers::new(lp, bp.d, bp.tp_first);
    let grads = |dinp, dw, dbias| LinearGrads {
        dinp: Some(dinp),
        dw,
        dbias: Some(dbias),
    };
    // MLP: dres is the gradient of the block output (= resid2 + fcproj).
    let fcproj_g = |dinp| grads(dinp, lg.fcproj_w, lg.fcproj_b);
    match bp.gelu {
        MlpGelu::Separate => {
            let names = (bwd::MLP_MM, None);
            x.linear_backward(
                names,
                &ly.fcproj,
                &fcproj_g(ga.dfch_gelu),
                ga.dres,
                la.fch_gelu,
            );
            let be = &mut *x.be;
            let _t = x
                .timers
                .scope(bwd::GELU, Fine)
                .with_work(|| work::traffic(&*be, &[la.fch, ga.dfch_gelu], &[ga.dfch], &[]));
            be.gelu_backward(ga.dfch, la.fch, ga.dfch_gelu);
        }
        MlpGelu::Epilogue => {
            let spans = (ga.dfch_gelu, ga.dres, la.fch_gelu, la.fch);
            x.gelu_linear_backward(bwd::MLP_MM, &ly.fcproj, &fcproj_g(ga.dfch), spans);
        }
    }
    let names = (bwd::MLP_MM, Some(bwd::MLP_ALLREDUCE));
    let fc_g = grads(ga.dln, lg.fc_w, lg.fc_b);
    x.linear_backward(names, &ly.fc, &fc_g, ga.dfch, la.ln2);
    let ln2_g = LayerNormGrads {
        dinp: ga.dres,
        dw: lg.ln2_w,
        dbias: lg.ln2_b,
    };
    let stats2 = la.ln2_stats();
    let ln2_in = (ga.dln, la.resid2, stats2);
    x.layernorm_backward(bwd::LAYERNORM, &ly.ln2, &ln2_g, ln2_in, false);
    // Attention: dres is now the gradient of resid2 (= resid + attproj).
    let names = (bwd::PROJ, None);
    let attproj_g = grads(ga.datty, lg.attproj_w, lg.attproj_b);
    x.linear_backward(names, &ly.attproj, &attproj_g, ga.dres, la.atty);
    attention_backward(x, bp.d, la, ga, recompute_attention);
    let names = (bwd::QKV, Some(bwd::ATTENTION_ALLREDUCE));
    let qkv_g = grads(ga.dln, lg.qkv_w, lg.qkv_b);
    x.linear_backward(names, &ly.qkv, &qkv_g, ga.dqkv, la.ln1);
    let ln1_g = LayerNormGrads {
        dinp: ga.dres,
        dw: lg.ln1_w,
        dbias: lg.ln1_b,
    };
    let stats1 = la.ln1_stats();
    x.layernorm_backward(
        bwd::LAYERNORM,
        &ly.ln1,
        &ln1_g,
        (ga.dln, resid, stats1),
        false,
    );
}

/// A block's attention backward from `ga.datty` into `ga.dqkv`: three steps over the kept
/// (or, with `recompute`, recomputed) probabilities, or fused from the log-sum-exp.
fn attention_backward<B: Backend>(
    x: &mut Layers<B>,
    d: &StepDims,
    la: &LayerActs,
    ga: &GradActs,
    recompute: bool,
) {
    let (timers, ad) = (x.timers, d.attn());
    let be = &mut *x.be;
    match la.att {
        AttnKept::Probabilities(att) => {
            let datt = ga.datt.expect("datt exists with kept probabilities");
            if recompute {
                // The probabilities of this layer, as the forward pass computed them.
                let _t = timers.scope(bwd::ATTENTION_RECOMPUTE, Fine);
                be.attention_scores(att, la.qkv, ad);
                be.attention_softmax(att, ad);
            }
            let (q, k, v) = work::qkv_parts(la.qkv);
            let (dq, dk, dv) = work::qkv_parts(ga.dqkv);
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
            be.attention_backward(ga.dqkv, ga.datty, la.atty, lse, la.qkv, ad);
        }
    }
}

/// The embedding's backward pass: its gradients (`de`'s tables) accumulate from `dout`.
fn embedding_backward<B: Backend>(x: &mut Layers<B>, de: &Embedding, dout: Span, tokens: TokSpan) {
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

/// The activation set of micro-batch `micro` and the shared gradient scratch.
fn slot(acts: &Option<(Vec<Acts>, GradActs)>, micro: usize) -> (&Acts, &GradActs) {
    let (sets, ga) = acts
        .as_ref()
        .expect("set_batches before forward or backward");
    (&sets[micro % sets.len()], ga)
}

/// The parts of `range` (flat offsets) inside the owned ranges, each with the moment offset of
/// its first element.
fn owned_parts(owned: &[OwnedRange], range: Range<usize>) -> Vec<(Range<usize>, usize)> {
    owned
        .iter()
        .filter_map(|o| {
            let lo = o.flat.start.max(range.start);
            let hi = o.flat.end.min(range.end);
            (lo < hi).then(|| (lo..hi, o.moment_offset + (lo - o.flat.start)))
        })
        .collect()
}

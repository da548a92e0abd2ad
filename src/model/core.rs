//! What every architecture's model holds and does the same way, llm.c style: one parameter
//! buffer, one gradient buffer, two AdamW moment buffers (all carved by the parameter table),
//! the compute copy of the parameters under mixed precision, the step's tokens, the
//! tensor-parallel communicator, the ZeRO-1 owned ranges, the gradient norm and the optimizer.
//! An architecture ([`super::gpt2::Gpt2`]) holds a [`Core`] beside its own parameter spans,
//! activations and passes; [`super::contract::Model`]'s methods that only touch the core are
//! implemented once, over [`super::contract::Model::core`].

use super::acts::{LossActs, Recompute, StepDims};
use super::contract::{OptimStep, TpRank};
use super::kv::KvCache;
use super::layers::Layers;
use super::passes::{ce_dims, head_and_loss};
use super::stage::Stage;
use super::table::{OwnedRange, Split, Table};
use super::work;
use crate::backend::{AdamWPart, AdamWStep, Backend, BufId, Dtype, Linear, Span, TokSpan};
use crate::comm::{Comm, SerialComm};
use crate::metrics::ops::trainer;
use crate::metrics::timers::{TimerLevel, Timers, Work};
use crate::model::ModelConfig;
use anyhow::{bail, Result};
use std::ops::Range;
use std::rc::Rc;

/// A model's state on a backend, whatever its architecture.
///
/// Mixed precision: `compute` is the storage type of every activation, activation gradient
/// and of the parameters the forward and backward passes read. With a 16-bit type the model
/// keeps a second, rounded copy of the parameters in it (`compute_params`, refreshed from the
/// f32 master after every update); the master, the gradients, the AdamW moments and all
/// statistics (norm statistics, cross-entropy maxima, sums and losses) stay f32.
pub struct Core<B: Backend> {
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
    pub compute: Dtype,
    /// The parameters in `compute` (the same buffer as `params` when that is f32).
    pub compute_params: BufId,
    /// Multiplies the loss gradient (fp16 dynamic loss scaling); the gradient norm and the
    /// optimizer divide it out again.
    pub loss_scale: f32,
    /// Micro-batches per optimizer step (gradient accumulation): each backward pass adds
    /// 1/accumulation of its micro-batch's mean gradient.
    pub accumulation: usize,
    /// Activations the backward pass recomputes instead of keeping.
    pub recompute: Recompute,
    /// Rows of logits per LM head chunk (`None`: the whole micro-batch at once).
    pub loss_chunk: Option<usize>,
    /// Micro-batches whose activations are kept at once (pipeline schedules run several
    /// forward passes before the first backward pass); micro-batch `j` uses set `j % in_flight`.
    pub in_flight: usize,
    /// Micro-batches loaded by the last [`Self::load_batches`].
    micro_batches: usize,
    pub tp_comm: Rc<dyn Comm>,
    owned: Vec<OwnedRange>,
}

impl<B: Backend> Core<B> {
    /// Allocates the buffers `table` carves on `be`: parameters (zeroed), and with `trainable`
    /// gradients and moments; the compute copy when `compute` is 16-bit.
    pub fn new(
        cfg: &ModelConfig,
        (tp, stage): (TpRank, &Stage),
        table: Table,
        mut be: B,
        trainable: bool,
        compute: Dtype,
    ) -> Result<Core<B>> {
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
        Ok(Core {
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
            loss_chunk: None,
            in_flight: 1,
            micro_batches: 0,
            tp_comm: Rc::new(SerialComm::new()),
            owned: vec![OwnedRange {
                flat: 0..state_n,
                moment_offset: 0,
            }],
        })
    }

    /// Panics (a bug in the caller) when the model was built for inference.
    pub fn assert_trainable(&self) {
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

    /// Copies a host parameter buffer (laid out by the table) onto the backend.
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

    /// Parameters, gradients or a moment buffer as a host copy.
    pub fn download(&self, buf: BufId) -> Vec<f32> {
        self.download_span(self.be.whole(buf))
    }

    /// A span as a host copy.
    pub fn download_span(&self, s: Span) -> Vec<f32> {
        let mut out = vec![0.0; s.len];
        self.be.download(s, &mut out);
        out
    }

    /// Sets every gradient to zero.
    pub fn zero_grad(&mut self) {
        self.assert_trainable();
        let s = self.be.whole(self.grads);
        self.be.zero(s);
    }

    /// Keeps the activations of `k` micro-batches at once (at least 1); when that changes,
    /// `acts` are freed (reallocated at the next batch).
    pub fn set_in_flight<A: StepActs, G: ActSet>(
        &mut self,
        k: usize,
        acts: &mut Option<ActSets<A, G>>,
    ) {
        let k = k.max(1);
        if k != self.in_flight {
            self.in_flight = k;
            ActSets::free(acts, &mut self.be);
        }
    }

    /// Sets activation recomputation (memory and time only: the recomputed activations are
    /// bit-identical to the kept ones, so are the gradients); when that changes, `acts` are
    /// freed.
    pub fn set_recompute<A: StepActs, G: ActSet>(
        &mut self,
        r: Recompute,
        acts: &mut Option<ActSets<A, G>>,
    ) {
        if r != self.recompute {
            self.recompute = r;
            ActSets::free(acts, &mut self.be);
        }
    }

    /// The LM head and the cross-entropy of a micro-batch of shape `d` against `targets` (the
    /// last stage's; `head`, its input and its weight's gradient as
    /// [`super::passes::head_and_loss`] takes them): the mean loss, and with `for_backward`
    /// the loss gradient ([`Self::dloss`]) in the logits, or with a loss chunk carried through
    /// the head already.
    pub fn head_loss(
        &mut self,
        (loss, d): (&LossActs, &StepDims),
        head: (&Linear, Span, Option<Span>),
        targets: TokSpan,
        timers: &Timers,
        for_backward: bool,
    ) -> f32 {
        let cd = ce_dims(d, self.tp.rank, self.cfg.vocab_size);
        let dloss = self.dloss(cd.n, for_backward);
        let x = &mut Layers {
            be: &mut self.be,
            comm: &*self.tp_comm,
            timers,
        };
        head_and_loss(x, head, loss, targets, (cd, dloss))
    }

    /// Rows of logits per LM head chunk (`None`: the whole micro-batch at once); when that
    /// changes, `acts` are freed.
    pub fn set_loss_chunk<A: StepActs, G: ActSet>(
        &mut self,
        rows: Option<usize>,
        acts: &mut Option<ActSets<A, G>>,
    ) {
        if rows != self.loss_chunk {
            self.loss_chunk = rows;
            ActSets::free(acts, &mut self.be);
        }
    }

    /// The shapes of a step of `b`×`t` on this rank (with the loss chunk).
    pub fn dims(&self, b: usize, t: usize) -> StepDims {
        StepDims::new(&self.cfg, b, t, self.tp.size).with_loss_chunk(self.loss_chunk)
    }

    /// A key/value cache for decoding: every layer and position, rows of `kv_width` (this
    /// rank's key/value heads).
    pub fn kv_cache(&mut self, kv_width: usize) -> Result<KvCache> {
        let (layers, positions) = (self.cfg.n_layer, self.cfg.n_positions);
        KvCache::new(&mut self.be, layers, positions, kv_width, self.compute)
    }

    /// The real vocabulary's logits of one decoded token (host copy).
    pub fn decoded_logits(&self, loss: &LossActs) -> Vec<f32> {
        self.download_span(loss.logits.sub(0, self.cfg.vocab_size))
    }

    /// Checks a step's window of `micro × b` rows of `t + 1` tokens (every id below the
    /// vocabulary size) and uploads it as `micro` micro-batches of `b` rows: per micro-batch
    /// its inputs, then its targets ([`Self::tokens`]).
    pub fn load_batches(&mut self, window: &[u32], micro: usize, b: usize, t: usize) -> Result<()> {
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

    /// Fails unless a sequence of `t` tokens fits the model's positions.
    pub fn check_seq_len(&self, t: usize) -> Result<()> {
        if t > self.cfg.n_positions {
            bail!(
                "sequence length {t} exceeds model.n_positions = {}",
                self.cfg.n_positions
            );
        }
        Ok(())
    }

    /// Micro-batch `micro`'s input and target tokens (`n` = B·T each).
    pub fn tokens(&self, micro: usize, n: usize) -> (TokSpan, TokSpan) {
        assert!(
            micro < self.micro_batches,
            "micro-batch {micro} of {} loaded",
            self.micro_batches
        );
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

    /// The loss gradient's factor for a micro-batch of `n` tokens when the forward pass is
    /// `for_backward`: the mean over its tokens, divided by the accumulation count and
    /// multiplied by the loss scale.
    pub fn dloss(&self, n: usize, for_backward: bool) -> Option<f32> {
        for_backward.then_some(self.loss_scale / (n * self.accumulation) as f32)
    }

    /// Fails unless `token` at `pos` can be decoded over `cache` (the whole model on one
    /// rank, a free position, a real token id), then uploads the token.
    pub fn load_decode_token(&mut self, cache: &KvCache, token: u32, pos: usize) -> Result<()> {
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
        self.be.set_tokens(&[token]);
        Ok(())
    }

    /// This rank's share of the squared gradient norm: the owned ranges of every tensor, with
    /// replicated (not tensor-parallel) tensors counted on TP rank 0 only and a tensor held by
    /// two stages (`tied`, the gradient of this stage's copy) on the first pipeline stage
    /// only, so the sum over all ranks is the squared norm of the logical model's gradient.
    pub fn grad_sq_sum(&mut self, tied: Option<Span>, timers: &Timers) -> f64 {
        let mut spans = Vec::new();
        for spec in self.table.specs() {
            if self.tp.rank != 0 && spec.split == Split::Replicated {
                continue;
            }
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
            .scope(trainer::optimizer::CLIP, TimerLevel::Fine)
            .with_work(|| work::traffic(&self.be, &spans, &[], &[]));
        // Summed in table order, as before; the loss scale divided out.
        let scale = self.loss_scale as f64;
        self.be.sum_of_squares(&spans).iter().sum::<f64>() / (scale * scale)
    }

    /// Clipping (PyTorch `clip_grad_norm_`: scale by clip/(norm+1e-6) when that is below 1) and
    /// one AdamW step on every tensor; weight decay where the table says (2-D tensors). `norm`
    /// is the pre-clip global gradient norm from [`Self::grad_sq_sum`] (loss scale already
    /// divided out). The gradients are multiplied by the clip factor over the loss scale, and
    /// the update rewrites the compute copy of every range it updates (`AdamWPart::compute`).
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
        let _t = timers
            .scope(trainer::optimizer::ADAMW, TimerLevel::Fine)
            .with_work(|| {
                let mut w = Work::default();
                for p in &parts {
                    let copy: Vec<Span> = p.compute.into_iter().collect();
                    w += work::traffic(&self.be, &[p.grads], &copy, &[p.params, p.m, p.v]);
                }
                w
            });
        self.be.adamw(&parts, &hp);
    }
}

/// An activation set or gradient scratch: the buffers it owns.
pub trait ActSet {
    fn bufs(&self) -> Vec<BufId>;
}

/// A micro-batch's activation set: also the step shape it was carved for.
pub trait StepActs: ActSet {
    fn dims(&self) -> StepDims;
}

/// The activation sets of the in-flight micro-batches and the gradient scratch they share.
pub struct ActSets<A, G> {
    pub sets: Vec<A>,
    pub grad: G,
}

impl<A: StepActs, G: ActSet> ActSets<A, G> {
    /// The activation set of micro-batch `micro` and the shared gradient scratch.
    pub fn slot(acts: &Option<ActSets<A, G>>, micro: usize) -> (&A, &G) {
        let s = acts
            .as_ref()
            .expect("set_batches before forward or backward");
        (&s.sets[micro % s.sets.len()], &s.grad)
    }

    /// True when `acts` exist for steps of `b`×`t`.
    pub fn fit(acts: &Option<ActSets<A, G>>, b: usize, t: usize) -> bool {
        acts.as_ref().is_some_and(|a| {
            let d = a.sets[0].dims();
            d.b == b && d.t == t
        })
    }

    /// Frees every buffer of `acts` (reallocated at the next batch).
    pub fn free<B: Backend>(acts: &mut Option<ActSets<A, G>>, be: &mut B) {
        if let Some(a) = acts.take() {
            for buf in a.sets.iter().flat_map(A::bufs).chain(a.grad.bufs()) {
                be.free(buf);
            }
        }
    }
}

impl<B: Backend> Core<B> {
    /// `in_flight` activation sets: each an activation table's buffer in the compute type and
    /// a statistics table's in f32, from `tables`, made into sets by `set`; and the gradient
    /// scratch `grad` (a table in the compute type) made by `scratch`.
    pub fn alloc_acts<A, G>(
        &mut self,
        tables: impl Fn(&Core<B>) -> (Table, Table),
        set: impl Fn((Table, BufId), (Table, BufId)) -> A,
        (grad, scratch): (Table, impl FnOnce(Table, BufId) -> G),
    ) -> Result<ActSets<A, G>> {
        let mut sets = Vec::with_capacity(self.in_flight);
        for _ in 0..self.in_flight {
            let (at, st) = tables(self);
            let ab = self.be.alloc(at.total(), self.compute)?;
            let sb = self.be.alloc(st.total(), Dtype::F32)?;
            sets.push(set((at, ab), (st, sb)));
        }
        let gb = self.be.alloc(grad.total(), self.compute)?;
        Ok(ActSets {
            sets,
            grad: scratch(grad, gb),
        })
    }

    /// Bytes of `in_flight` activation sets of `tables` (compute type, f32 statistics) and
    /// of the gradient scratch table `grad` (the memory report).
    pub fn act_bytes(&self, (acts, stats): (Table, Table), grad: Table) -> (usize, usize) {
        let el = self.compute.bytes();
        (
            self.in_flight * (el * acts.total() + Dtype::F32.bytes() * stats.total()),
            el * grad.total(),
        )
    }
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

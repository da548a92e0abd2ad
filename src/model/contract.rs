//! The contract between a model architecture and the code that trains, saves and samples it.
//!
//! The trainer, the pipeline executor, checkpoint save/load and the sampler hold a
//! `Box<dyn Model<B>>` built by [`super::registry`] from the run's [`ModelConfig`]; nothing
//! above `src/model/` names an architecture. A model is one pipeline stage of one
//! tensor-parallel rank (the whole model with one of each) on a backend `B`:
//!
//! - its state is four flat buffers carved by one parameter [`Table`] (parameters, gradients,
//!   the two AdamW moments: [`ModelBuffers`]), which checkpoints, gradient buckets and ZeRO-1
//!   address as slices;
//! - a step loads its micro-batches ([`Model::set_batches`]) and runs each forward and
//!   backward by index in the order a schedule says; between pipeline stages the caller moves
//!   [`Model::stage_output`] → [`Model::stage_input`] forward and [`Model::input_grad`] →
//!   [`Model::output_grad`] back;
//! - sampling decodes one token at a time over a [`KvCache`].

use super::acts::Recompute;
use super::core::Core;
use super::kv::KvCache;
use super::stage::Stage;
use super::table::{OwnedRange, Table};
use crate::backend::{Backend, BufId, Span};
use crate::comm::Comm;
use crate::metrics::timers::Timers;
use crate::model::ModelConfig;
use anyhow::Result;
use std::rc::Rc;

/// This rank's place in the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpRank {
    pub rank: usize,
    pub size: usize,
}

impl TpRank {
    /// No tensor parallelism.
    pub const SERIAL: TpRank = TpRank { rank: 0, size: 1 };
}

/// AdamW and clipping settings of one optimizer step.
#[derive(Clone, Copy, Debug)]
pub struct OptimStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Global-norm clipping threshold (0 = off).
    pub grad_clip: f64,
    /// 1-based step count for the bias corrections.
    pub step: u64,
}

/// The four buffers a model's parameter table carves: the f32 master parameters (what the
/// optimizer updates and checkpoints hold), their gradients, and the AdamW moments (only the
/// owned ranges under ZeRO-1, packed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelBuffers {
    pub params: BufId,
    pub grads: BufId,
    pub m: BufId,
    pub v: BufId,
}

/// Which form of an op a model runs where a backend offers several (recorded in the run
/// header as `key: form`; `note`, when there is one, is printed under the header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpForm {
    pub key: &'static str,
    pub form: &'static str,
    pub note: Option<String>,
}

/// Called as `ready(backend, from)` when the gradients at flat offsets `from..` are final
/// (see [`Model::backward_micro`]).
pub type GradsReady<'a, B> = dyn FnMut(&B, usize) + 'a;

/// One pipeline stage of one tensor-parallel rank of a model, on backend `B`.
///
/// What every architecture does the same way is implemented here once over its [`Core`]; an
/// architecture implements its activations, its passes and decoding.
pub trait Model<B: Backend> {
    /// The state every architecture shares.
    fn core(&self) -> &Core<B>;
    fn core_mut(&mut self) -> &mut Core<B>;

    // --- What it is and where it lives.

    /// The model's configuration (the whole model's, not the stage's).
    fn config(&self) -> &ModelConfig {
        &self.core().cfg
    }
    /// This rank's tensor-parallel place.
    fn tp(&self) -> TpRank {
        self.core().tp
    }
    /// The pipeline stage this model runs.
    fn stage(&self) -> &Stage {
        &self.core().stage
    }
    /// The parameter table of this rank's share (stage and shard).
    fn table(&self) -> &Table {
        &self.core().table
    }
    /// The buffers the table carves.
    fn buffers(&self) -> ModelBuffers {
        let c = self.core();
        ModelBuffers {
            params: c.params,
            grads: c.grads,
            m: c.m,
            v: c.v,
        }
    }
    fn backend(&self) -> &B {
        &self.core().be
    }
    fn backend_mut(&mut self) -> &mut B {
        &mut self.core_mut().be
    }
    /// The op forms this model runs on its backend, for the run header.
    fn forms(&self) -> Vec<OpForm>;

    // --- Settings, before the first step.

    /// Uses `comm` (this rank's tensor-parallel group) for the tensor-parallel collectives.
    fn set_tp_comm(&mut self, comm: Rc<dyn Comm>) -> Result<()> {
        self.core_mut().set_tp_comm(comm)
    }
    /// Restricts the optimizer to `owned` parameter ranges (ZeRO-1) and reallocates the AdamW
    /// moments to hold just those (zeroed).
    fn set_owned(&mut self, owned: Vec<OwnedRange>) -> Result<()> {
        self.core_mut().set_owned(owned)
    }
    /// The parameter ranges this rank's optimizer updates.
    fn owned(&self) -> &[OwnedRange] {
        self.core().owned()
    }
    /// Keeps the activations of `k` micro-batches at once (a pipeline schedule's most
    /// forward passes awaiting their backward pass).
    fn set_in_flight(&mut self, k: usize);
    /// Gradient accumulation over `m` micro-batches (each backward pass adds 1/m).
    fn set_accumulation(&mut self, m: usize) {
        self.core_mut().accumulation = m.max(1);
    }
    /// Activation recomputation (memory and time only; the same bits).
    fn set_recompute(&mut self, r: Recompute);
    /// The LM head and the loss in chunks of `rows` rows (`None`: the whole micro-batch at
    /// once): the logits of one chunk held instead of the micro-batch's, the head's backward
    /// pass run with the loss in the forward pass (memory; the head's weight gradient is
    /// summed chunk by chunk, so it may differ in the last bits).
    fn set_loss_chunk(&mut self, rows: Option<usize>);
    /// Multiplies the next backward pass's loss gradient (fp16 loss scaling); the gradient
    /// norm and the optimizer divide it out.
    fn set_loss_scale(&mut self, scale: f32) {
        self.core_mut().loss_scale = scale;
    }

    // --- Parameters.

    /// Copies a host parameter buffer (laid out by [`Self::table`]) onto the backend.
    fn load_params(&mut self, host: &[f32]) -> Result<()> {
        self.core_mut().load_params(host)
    }
    /// Rounds the whole f32 master into the compute copy (a no-op in f32), after the master
    /// changed other than by the optimizer (a ZeRO-1 all-gather).
    fn refresh_compute_params(&mut self) {
        self.core_mut().refresh_compute_params()
    }
    /// Bytes of the low-precision parameter copy (0 when computing in f32).
    fn compute_params_bytes(&self) -> usize {
        self.core().compute_params_bytes()
    }
    /// Bytes of the activations of every in-flight micro-batch of `b`×`t`, and of the
    /// gradient scratch (the memory report).
    fn activation_bytes(&self, b: usize, t: usize) -> (usize, usize);
    /// The shapes of a step of `b`×`t` that size the backend's working memory
    /// ([`crate::backend::Backend::workspace_bound`]).
    fn step_shapes(&self, b: usize, t: usize) -> crate::backend::StepShapes;
    /// A whole buffer as a host copy.
    fn download(&self, buf: BufId) -> Vec<f32> {
        self.core().download(buf)
    }

    // --- One step.

    /// Loads a step's window of `micro × b` rows of `t + 1` tokens as `micro` micro-batches.
    fn set_batches(&mut self, window: &[u32], micro: usize, b: usize, t: usize) -> Result<()>;
    /// Loads one window of `b` rows of `t + 1` tokens as micro-batch 0.
    fn set_batch(&mut self, window: &[u32], b: usize, t: usize) -> Result<()> {
        self.set_batches(window, 1, b, t)
    }
    /// Where micro-batch `micro`'s input activations go on a stage after the first.
    fn stage_input(&self, micro: usize) -> Span;
    /// Micro-batch `micro`'s output after [`Self::forward_micro`]: the next stage's input.
    fn stage_output(&self, micro: usize) -> Span;
    /// Where a stage before the last receives the gradient of its output.
    fn output_grad(&self) -> Span;
    /// The gradient of the stage's input after [`Self::backward_micro`].
    fn input_grad(&self) -> Span;
    /// The gradient of a tensor held by two stages (tied embeddings) that the caller sums
    /// over them after the step's last backward pass; `None` where there is none.
    fn tied_grad(&self) -> Option<Span>;
    /// Sets every gradient to zero.
    fn zero_grad(&mut self) {
        self.core_mut().zero_grad()
    }
    /// The forward pass of micro-batch `micro`; the mean loss on the last stage (with
    /// `for_backward`, the logits replaced by the loss gradient, or with a loss chunk
    /// ([`Self::set_loss_chunk`]) the LM head's backward pass run already: its weight
    /// gradient accumulated, its input gradient kept for [`Self::backward_micro`]), `None`
    /// elsewhere.
    fn forward_micro(&mut self, micro: usize, timers: &Timers, for_backward: bool) -> Option<f32>;
    /// The backward pass of micro-batch `micro`, accumulating into the gradients; calls
    /// `ready(backend, from)` whenever the gradients at flat offsets `from..` are final for
    /// this micro-batch (with `from = 0` at the end).
    fn backward_micro(&mut self, micro: usize, timers: &Timers, ready: &mut GradsReady<B>);
    /// This rank's share of the squared gradient norm (summed over all ranks: the logical
    /// model's), the loss scale divided out.
    fn grad_sq_sum(&mut self, timers: &Timers) -> f64 {
        let tied = self.tied_grad();
        self.core_mut().grad_sq_sum(tied, timers)
    }
    /// Global L2 norm of the gradients (one process; parallel runs all-reduce
    /// [`Self::grad_sq_sum`] instead).
    fn grad_norm(&mut self, timers: &Timers) -> f64 {
        self.grad_sq_sum(timers).sqrt()
    }
    /// Clipping against the global pre-clip `norm`, then one AdamW step.
    fn apply_optimizer(&mut self, o: &OptimStep, norm: f64, timers: &Timers) {
        self.core_mut().apply_optimizer(o, norm, timers)
    }
    /// Logits of the last forward pass without the loss gradient (host copy, padded columns
    /// included; the last stage only). Only meaningful after a forward pass not for backward.
    fn last_logits(&self) -> Vec<f32>;

    // --- Decoding (the whole model on one rank).

    /// A key/value cache for [`Self::decode`] on this model's backend.
    fn kv_cache(&mut self) -> Result<KvCache>;
    /// Releases a cache's memory.
    fn free_kv_cache(&mut self, cache: KvCache) {
        self.core_mut().be.free(cache.buf());
    }
    /// Next-token logits (real vocabulary only) after feeding `token` at position `pos`.
    fn decode(
        &mut self,
        cache: &KvCache,
        token: u32,
        pos: usize,
        timers: &Timers,
    ) -> Result<Vec<f32>>;
}

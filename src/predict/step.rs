//! One training step of a layout, predicted op by op under the same timer names as a real run.
//!
//! **Compute.** Either a reference run's per-op times, each scaled by the op's work in the new
//! layout ([`op_work`]: the model's declared cost, [`crate::model::cost`]: FLOPs for the
//! GEMMs, elements for the rest, per rank and per step; with measured GEMM rates, the GEMMs'
//! predicted time: [`super::gemm`]), or one effective
//! rate for the model's FLOPs ([`Compute::Rate`], for machines known only by a published
//! figure). **Communication** comes from the [`Network`] model with the group
//! placement of fugu's grid (TP innermost, then DP, then PP: `parallel/grid.rs`), each kind of
//! traffic on its class's links ([`Traffic`]: a profile may give tensor-parallel, pipeline and
//! data-parallel traffic links of their own):
//!
//! * tensor parallelism: per block and micro-batch, the all-reduces after the attention and
//!   MLP outputs (forward) and of their input gradients (backward), B·T·C floats each; the
//!   vocabulary-parallel embedding, LM head and loss add theirs on the first and last stage;
//! * pipeline: 1F1B, each micro-batch's activation and its gradient once per stage boundary,
//!   and the bubble `(p − 1)·(f + b)` of the slowest stage;
//! * data parallelism: fugu's gradient buckets ([`bucket_ranges`]), each started when the last
//!   micro-batch's backward pass has made its gradients final (offsets are final in reverse
//!   order, linearly in time) and run one after another; `allreduce-params` is what is left
//!   after the backward pass. ZeRO-1 reduce-scatters instead and all-gathers the parameters
//!   after the optimizer (`allgather-params`, not overlapped).

use super::gemm::{GemmCall, GemmRates, Pass};
use super::network::{Group, Network, Traffic};
use crate::config::Precision;
use crate::metrics::ops::trainer::{grads, optimizer, phase, pipeline};
pub use crate::metrics::prediction::{Layout, Prediction};
use crate::model::acts::{AttnKeep, Recompute, StepDims};
use crate::model::cost::{CostModel, OpWork, Slice};
use crate::model::decoder_ops::{backward as bwd, forward as fwd};
use crate::model::registry;
use crate::model::stage::{PartCosts, Stage};
use crate::model::ModelConfig;
use crate::parallel::grad_sync::{bucket_ranges, DEFAULT_BUCKET_FLOATS};
use crate::parallel::grid::Grid;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// What is trained: the model, the sequence length, the global batch (sequences per step),
/// what the backward pass recomputes instead of keeping (`--recompute`: time and memory) and
/// the precision (`--precision`: the activations' bytes; the time of GEMMs and row ops on a
/// machine known by its kernels' rates).
#[derive(Clone, Debug)]
pub struct Workload {
    pub model: ModelConfig,
    pub seq_len: usize,
    pub global_batch: usize,
    pub recompute: Recompute,
    /// Rows of logits per LM head chunk (`--loss-chunk`); `None`: a whole micro-batch's.
    pub loss_chunk: Option<usize>,
    pub precision: Precision,
    /// Blocks per pipeline stage (`--pp-layers`); `None`: stages balanced by predicted time.
    pub pp_layers: Option<Vec<usize>>,
}

impl Layout {
    /// Ranks in the job.
    pub fn world(&self) -> usize {
        self.nodes * self.ranks_per_node
    }

    /// Sequences per micro-batch: the global batch over dp replicas and micro-batches
    /// ([`check_layout`] checks that it divides).
    pub fn micro_batch_size(&self, w: &Workload) -> usize {
        w.global_batch / self.dp / self.micro_batches
    }
}

/// A reference run: one layout's measured per-op times (ms per step).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Reference {
    pub model: ModelConfig,
    pub seq_len: usize,
    /// Sequences per rank per step, and micro-batches they were split into.
    pub batch_per_rank: usize,
    #[serde(default = "one")]
    pub micro_batches: usize,
    pub threads_per_rank: usize,
    /// Mean ms per step of each timer of the run (leaf ops and their parents).
    pub ops_ms: BTreeMap<String, f64>,
    /// The run's mean step time, ms (for the record; the prediction sums the ops).
    pub step_ms: f64,
    /// Where it was measured (run directory, command).
    #[serde(default)]
    pub source: String,
}

fn one() -> usize {
    1
}

/// How compute time is predicted.
#[derive(Clone, Debug)]
pub enum Compute {
    /// A reference run's per-op times, and the machine's measured GEMM rates (maybe none:
    /// then GEMM time scales with FLOPs).
    Reference {
        run: Box<Reference>,
        gemm: GemmRates,
    },
    /// The model FLOPs (Megatron's formula) at this rate per node, optimizer included.
    Rate { model_tflops_per_node: f64 },
    /// Each GEMM at the machine's GEMM rate in the step's precision, each other op (and the
    /// optimizer) its bytes at the node's memory bandwidth: for a machine fugu has not run on,
    /// from its kernels' predicted rates.
    Kernels(KernelRates),
}

/// A machine's compute from its kernels (`[compute.kernels]` in a profile): GEMM GFLOP/s per
/// core in each precision it has a kernel for, and the node's memory bandwidth. A roofline:
/// GEMMs at their rate, everything else at the bandwidth, nothing overlapped.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelRates {
    pub gemm_gflops_per_core: PrecisionRates,
    /// Memory bandwidth of one node (GB/s), shared by its ranks.
    pub memory_gbs_per_node: f64,
}

/// One rate per precision; a precision the machine has no kernel for is left out.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrecisionRates {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16: Option<f64>,
}

impl PrecisionRates {
    pub fn get(&self, p: Precision) -> Option<f64> {
        match p {
            Precision::Fp32 => self.fp32,
            Precision::Bf16 => self.bf16,
            Precision::Fp16 => self.fp16,
        }
    }
}

impl KernelRates {
    /// Checks the numbers (`what` names the section in errors).
    pub fn validate(&self, what: &str) -> Result<()> {
        let r = &self.gemm_gflops_per_core;
        let given = [("fp32", r.fp32), ("bf16", r.bf16), ("fp16", r.fp16)];
        if given.iter().all(|(_, v)| v.is_none()) {
            bail!("{what}.gemm_gflops_per_core: give a rate for at least one of fp32, bf16, fp16");
        }
        for (name, v) in given {
            if let Some(v) = v.filter(|v| !(*v > 0.0 && v.is_finite())) {
                bail!("{what}.gemm_gflops_per_core.{name} = {v}: expected a positive number");
            }
        }
        let bw = self.memory_gbs_per_node;
        if !(bw > 0.0 && bw.is_finite()) {
            bail!("{what}.memory_gbs_per_node = {bw}: expected a positive number");
        }
        Ok(())
    }

    /// The GEMM rate in `p`, or an error naming the missing field.
    fn gemm_rate(&self, p: Precision) -> Result<f64> {
        self.gemm_gflops_per_core.get(p).with_context(|| {
            format!(
                "--precision {}: the profile has no {} GEMM rate (compute.kernels.gemm_gflops_per_core.{}): the machine has no kernel for it",
                p.name(),
                p.name(),
                p.name()
            )
        })
    }
}

/// The machine: compute, network, node size.
#[derive(Clone, Debug)]
pub struct Machine {
    pub compute: Compute,
    pub network: Network,
    pub cores_per_node: usize,
    pub peak_gflops_per_core: f64,
    /// Memory of one node (GiB): a layout's ranks on a node share it (the fits check).
    pub memory_gib_per_node: f64,
}

/// The work of one compute op (by its forward timer name) in one pass of a micro-batch on one
/// rank, as `cost` declares it: for the GEMMs their FLOPs, or their seconds at the measured
/// rates on the given threads when `gemm` has rates; elements for the rest. Only ratios of it
/// are used.
fn op_work(
    cost: &CostModel,
    (op, pass): (&str, Pass),
    s: &Slice,
    gemm: Option<(&GemmRates, usize)>,
) -> Option<f64> {
    Some(match (cost.work)(op, pass, s)? {
        OpWork::Gemms(calls) => match gemm {
            Some((rates, threads)) => return rates.seconds(&calls, threads),
            None => calls.iter().map(|c| c.flops()).sum(),
        },
        OpWork::Elements(n) => n,
    })
}

/// Every GEMM call one rank of each pipeline stage makes per micro-batch, forward and
/// backward (duplicates merged), for `fugu predict gemm-shapes` and the rate check.
pub fn layout_gemms(w: &Workload, l: &Layout) -> Result<Vec<GemmCall>> {
    check_layout(w, l)?;
    let mb = l.micro_batch_size(w);
    let mut calls = BTreeSet::new();
    for stage in Stage::split(&w.model, l.pp, w.seq_len)? {
        calls.extend(shape_gemms(&stage.slice(&w.model, w.seq_len, mb, l.tp)));
    }
    Ok(calls.into_iter().collect())
}

/// The GEMM shapes of the layout and of the reference run that the machine's rates do not
/// cover exactly (at their thread counts), in `fugu bench gemm --shape` syntax; empty when the
/// machine has no GEMM rates (GEMM time then scales with FLOPs).
pub fn unmeasured_gemms(w: &Workload, l: &Layout, m: &Machine) -> Result<BTreeSet<String>> {
    let Compute::Reference { run, gemm } = &m.compute else {
        return Ok(BTreeSet::new());
    };
    if gemm.0.is_empty() {
        return Ok(BTreeSet::new());
    }
    let mut missing = gemm.missing(&layout_gemms(w, l)?, l.threads_per_rank);
    missing.extend(gemm.missing(&reference_gemms(run), run.threads_per_rank));
    Ok(missing)
}

/// The micro-batch shape of a reference run (one process, the whole model).
fn reference_shape(r: &Reference) -> Slice<'_> {
    let mb = r.batch_per_rank / r.micro_batches.max(1);
    Stage::whole(r.model.n_layer).slice(&r.model, r.seq_len, mb, 1)
}

/// The GEMM calls of a reference run.
pub fn reference_gemms(r: &Reference) -> Vec<GemmCall> {
    shape_gemms(&reference_shape(r)).into_iter().collect()
}

/// The distinct GEMM shapes of every op and pass at one micro-batch shape (call counts
/// dropped: only the shapes matter for rates).
fn shape_gemms(s: &Slice) -> BTreeSet<GemmCall> {
    let cost = registry::cost(s.model.arch);
    let mut calls = BTreeSet::new();
    for op in cost.ops {
        for pass in [Pass::Forward, Pass::Backward] {
            for c in cost.gemms(op.forward, pass, s).unwrap_or_default() {
                calls.insert(GemmCall { count: 1, ..c });
            }
        }
    }
    calls
}

/// The layout checked against the workload and the grid's rules; the grid of rank 0, whose
/// `world_rank_of` places every group.
pub fn check_layout(w: &Workload, l: &Layout) -> Result<Grid> {
    let grid = Grid::new(0, l.world(), l.tp, l.pp, &w.model)?;
    if l.tp * l.pp * l.dp != l.world() {
        bail!(
            "tp {} x pp {} x dp {} = {} but {} nodes x {} ranks = {} ranks",
            l.tp,
            l.pp,
            l.dp,
            l.tp * l.pp * l.dp,
            l.nodes,
            l.ranks_per_node,
            l.world()
        );
    }
    if l.micro_batches == 0 || !w.global_batch.is_multiple_of(l.dp * l.micro_batches) {
        bail!(
            "the global batch of {} sequences does not split into dp {} x {} micro-batch(es)",
            w.global_batch,
            l.dp,
            l.micro_batches
        );
    }
    Ok(grid)
}

/// Refuses a workload whose step the tables cannot count in machine words: the step's tokens
/// times the widest row (hidden, MLP or vocabulary) and a micro-batch's attention scores of
/// every layer, each with a margin of 64 (bytes and per-tensor factors), must fit in a `u64`.
/// (A billion sequences of a 1024-token GPT-2 are far inside; 10^17 sequences are not.)
fn check_sizes(w: &Workload, l: &Layout) -> Result<()> {
    let m = &w.model;
    let widest = m.n_embd.max(m.mlp_width()).max(m.vocab_size) as u128;
    let tokens = w.global_batch as u128 * w.seq_len as u128;
    let scores = l.micro_batch_size(w) as u128
        * m.n_head as u128
        * (w.seq_len as u128).pow(2)
        * m.n_layer as u128;
    if (tokens * widest).max(scores) * 64 > u64::MAX as u128 {
        bail!(
            "a global batch of {} sequences of {} tokens (micro-batches of {}) on this model is too \
             large to count: give a smaller --batch or --seq-len",
            w.global_batch,
            w.seq_len,
            l.micro_batch_size(w)
        );
    }
    Ok(())
}

/// The number of nodes the world ranks `start + i·stride` (i < `count`) sit on (block placement:
/// rank r on node r / ranks_per_node).
fn nodes_spanned(start: usize, stride: usize, count: usize, ranks_per_node: usize) -> usize {
    // Ranks `start + i·stride`, i < count, on nodes of `ranks_per_node` consecutive ranks:
    // a stride of a node or more puts every rank on its own node; a shorter one cannot skip a
    // node, so the ranks cover every node from the first rank's to the last's. Arithmetic, not a
    // list: a million-node layout has a million data-parallel ranks.
    if count == 0 {
        return 0;
    }
    let rpn = ranks_per_node.max(1);
    if stride >= rpn {
        return count;
    }
    let last = start + (count - 1) * stride;
    last / rpn - start / rpn + 1
}

/// What every stage's prediction shares: the workload, the layout, the machine, the
/// micro-batch shape and the TP and DP groups' placement.
struct StepCtx<'a> {
    w: &'a Workload,
    l: &'a Layout,
    m: &'a Machine,
    /// Sequences per rank per step, and per micro-batch.
    per_rank: usize,
    mb: usize,
    /// The tensor- and data-parallel groups of rank 0, placed by the grid.
    tp_group: Group,
    dp_group: Group,
    /// Whether the next pipeline stage, and the last one, are on another node than stage 0.
    next_stage_across: bool,
    last_stage_across: bool,
}

impl StepCtx<'_> {
    fn mbf(&self) -> f64 {
        self.l.micro_batches as f64
    }

    /// One stage's timers (ms per step, without its bubble) and memory per rank, every rank
    /// getting `1/oversub` of the cores it asks for (compute and the shared-memory transfers
    /// slow down alike).
    fn stage(&self, stage: &Stage, oversub: f64) -> Result<(BTreeMap<String, f64>, f64)> {
        let (w, l) = (self.w, self.l);
        let s = stage.slice(&w.model, w.seq_len, self.mb, l.tp);
        let table = registry::stage_params(&w.model, l.tp, stage)?;
        let params = table.total();
        let owned = if l.zero {
            params.div_ceil(l.dp)
        } else {
            params
        };
        let net = |c: Traffic| self.m.network.class(c).oversubscribed(oversub);
        let mut t = self.compute_timers(&s, oversub);
        match &self.m.compute {
            Compute::Reference { .. } => self.reference_rest(&s, params, owned, oversub, &mut t)?,
            Compute::Kernels(k) => self.kernel_optimizer(k, params, owned, &mut t),
            Compute::Rate { .. } => {}
        }
        if l.tp > 1 {
            self.tp_allreduces(&net(Traffic::Tp), &s, &mut t);
        }
        self.recomputation(&net(Traffic::Tp), &s, oversub, &mut t);
        let fwd = sum_prefix(&t, "forward:");
        let bwd = sum_prefix(&t, "backward:");
        if l.pp > 1 {
            self.pipeline_transfers(&net(Traffic::Pp), &s, stage, &mut t);
        }
        if l.dp > 1 {
            self.gradient_sync(&net(Traffic::Dp), &table, bwd / self.mbf(), &mut t);
        }
        t.insert(phase::FORWARD.into(), fwd);
        t.insert(phase::BACKWARD.into(), bwd);
        let opt = sum_prefix(&t, "optimizer:");
        t.insert(phase::OPTIMIZER.into(), opt);
        let mem = memory_gib(w, self.mb, l, stage, params, owned);
        Ok((t, mem))
    }

    /// What a block, the first stage's embeddings and the last stage's head and loss take per
    /// step (ms: compute and tensor-parallel all-reduces, forward and backward), to balance the
    /// stages by.
    fn part_costs(&self) -> PartCosts {
        let (w, l) = (self.w, self.l);
        let cost = |layers: usize, first: bool, last: bool| -> f64 {
            let s = Slice {
                layers,
                first,
                last,
                ..Stage::whole(1).slice(&w.model, w.seq_len, self.mb, l.tp)
            };
            let mut t = self.compute_timers(&s, 1.0);
            if l.tp > 1 {
                self.tp_allreduces(&self.m.network.class(Traffic::Tp), &s, &mut t);
            }
            t.values().sum()
        };
        PartCosts {
            block: cost(1, false, false),
            first: cost(0, true, false),
            last: cost(0, false, true),
        }
    }

    /// Every compute op of slice `s`, forward and backward, as timers (ms per step).
    fn compute_timers(&self, s: &Slice, oversub: f64) -> BTreeMap<String, f64> {
        let mut t = BTreeMap::new();
        for pass in [Pass::Forward, Pass::Backward] {
            for (name, ms) in self.compute_ops(s, pass, None, oversub) {
                *t.entry(name.to_owned()).or_default() += ms;
            }
        }
        t
    }

    /// The compute ops of `pass` on slice `s` (all of them, or those named in `only`), ms per
    /// step: a reference run's per-op times, each scaled by the op's work here over there (for
    /// the GEMMs with measured rates, their predicted time at each side's thread count, so
    /// only the oversubscription is applied on top); or, at a rate, the slice's GEMM FLOPs as
    /// one `compute` timer per pass.
    fn compute_ops(
        &self,
        s: &Slice,
        pass: Pass,
        only: Option<&[&str]>,
        oversub: f64,
    ) -> Vec<(&'static str, f64)> {
        let l = self.l;
        let (r, gemm) = match &self.m.compute {
            Compute::Reference { run, gemm } => (run, gemm),
            Compute::Kernels(k) => return self.kernel_ops(k, s, pass, only, oversub),
            Compute::Rate {
                model_tflops_per_node,
            } => {
                // Megatron's FLOPs (the unpadded vocabulary, the whole layer ÷ tp) at the rate.
                let cost = registry::cost(s.model.arch);
                let whole = Slice {
                    tp: 1,
                    vocab: s.model.vocab_size,
                    ..*s
                };
                let flops: f64 = cost
                    .ops
                    .iter()
                    .filter(|op| only.is_none_or(|o| o.contains(&op.forward)))
                    .flat_map(|op| cost.gemms(op.forward, pass, &whole).unwrap_or_default())
                    .map(|c| c.flops())
                    .sum();
                let per_rank = model_tflops_per_node * 1e12 / l.ranks_per_node as f64;
                let ms = flops / l.tp as f64 * self.mbf() / per_rank * 1e3 * oversub;
                let name = match pass {
                    Pass::Forward => "forward:compute",
                    Pass::Backward => "backward:compute",
                };
                return vec![(name, ms)];
            }
        };
        let rs = reference_shape(r);
        let rmb = r.micro_batches.max(1) as f64;
        let scale = r.threads_per_rank as f64 / l.threads_per_rank as f64 * oversub;
        let (cost, rcost) = (registry::cost(s.model.arch), registry::cost(r.model.arch));
        let mut out = Vec::new();
        for op in cost.ops {
            if only.is_some_and(|o| !o.contains(&op.forward)) {
                continue;
            }
            let Some(name) = op.name(pass) else {
                continue;
            };
            let Some(&ms) = r.ops_ms.get(name) else {
                continue;
            };
            // With measured rates a GEMM op's work is its time on each side's threads.
            let op = op.forward;
            let is_gemm = cost.gemms(op, pass, s).is_some();
            let rates = (!gemm.0.is_empty() && is_gemm).then_some(gemm);
            let wn = op_work(cost, (op, pass), s, rates.map(|g| (g, l.threads_per_rank)));
            let wr = op_work(
                rcost,
                (op, pass),
                &rs,
                rates.map(|g| (g, r.threads_per_rank)),
            );
            let by = if rates.is_some() { oversub } else { scale };
            let (wn, wr) = (wn.unwrap_or(0.0), wr.unwrap_or(0.0));
            if wr > 0.0 && wn > 0.0 {
                out.push((name, ms * (wn * self.mbf()) / (wr * rmb) * by));
            }
        }
        out
    }

    /// The compute ops of `pass` on slice `s` (all, or those in `only`), ms per step, on a
    /// machine known by its kernels: a GEMM op its FLOPs at the rate of the step's precision
    /// on the rank's threads, any other op its bytes ([`crate::model::cost::Streams`]) at the
    /// rank's share of the node's memory bandwidth (which oversubscribed cores do not change).
    fn kernel_ops(
        &self,
        k: &KernelRates,
        s: &Slice,
        pass: Pass,
        only: Option<&[&str]>,
        oversub: f64,
    ) -> Vec<(&'static str, f64)> {
        let (l, prec) = (self.l, self.w.precision);
        let gemm_rate = k.gemm_rate(prec).unwrap_or(f64::NAN) * 1e9 * l.threads_per_rank as f64;
        let act = prec.compute_dtype().bytes() as f64;
        let cost = registry::cost(s.model.arch);
        let mut out = Vec::new();
        for op in cost.ops {
            let Some(name) = op.name(pass) else {
                continue;
            };
            if only.is_some_and(|o| !o.contains(&op.forward)) {
                continue;
            }
            let seconds = match (cost.work)(op.forward, pass, s) {
                Some(OpWork::Gemms(calls)) => {
                    calls.iter().map(|c| c.flops()).sum::<f64>() / gemm_rate * oversub
                }
                Some(OpWork::Elements(n)) => match (cost.streams)(op.forward, pass) {
                    Some(st) => st.bytes(n, act) / self.bandwidth(k),
                    None => continue,
                },
                None => continue,
            };
            if seconds > 0.0 {
                out.push((name, seconds * 1e3 * self.mbf()));
            }
        }
        out
    }

    /// One rank's share of the node's memory bandwidth, bytes per second.
    fn bandwidth(&self, k: &KernelRates) -> f64 {
        k.memory_gbs_per_node * 1e9 / self.l.ranks_per_node as f64
    }

    /// The optimizer on a machine known by its kernels, ms per step: the gradient norm reads
    /// every gradient the rank holds (f32); AdamW reads the parameter, gradient and two
    /// moments and writes the parameter and moments (f32) of each one it owns, and the compute
    /// copy in a 16-bit precision.
    fn kernel_optimizer(
        &self,
        k: &KernelRates,
        params: usize,
        owned: usize,
        t: &mut BTreeMap<String, f64>,
    ) {
        let copy = match self.w.precision {
            Precision::Fp32 => 0.0,
            p => p.compute_dtype().bytes() as f64,
        };
        let bw = self.bandwidth(k);
        t.insert(optimizer::CLIP.into(), 4.0 * params as f64 / bw * 1e3);
        t.insert(
            "optimizer:update".into(),
            (28.0 + copy) * owned as f64 / bw * 1e3,
        );
    }

    /// What a reference run's named ops leave of `forward` and `backward` (scaled by tokens
    /// and blocks), and its optimizer (the update by the parameters a rank owns, the clipping
    /// by those it holds); at a rate, the optimizer is inside the rate.
    fn reference_rest(
        &self,
        s: &Slice,
        params: usize,
        owned: usize,
        oversub: f64,
        t: &mut BTreeMap<String, f64>,
    ) -> Result<()> {
        let Compute::Reference { run: r, .. } = &self.m.compute else {
            unreachable!("a reference run's rest without a reference run");
        };
        let scale = r.threads_per_rank as f64 / self.l.threads_per_rank as f64 * oversub;
        for (dir, pass) in [
            (phase::FORWARD, Pass::Forward),
            (phase::BACKWARD, Pass::Backward),
        ] {
            let known: f64 = registry::cost(r.model.arch)
                .ops
                .iter()
                .filter_map(|op| r.ops_ms.get(op.name(pass)?))
                .sum();
            let rest = r.ops_ms.get(dir).copied().unwrap_or(0.0) - known;
            if rest > 0.0 {
                let tokens = self.per_rank as f64 / r.batch_per_rank as f64;
                let frac = s.layers as f64 / r.model.n_layer as f64;
                t.insert(format!("{dir}:other"), rest * tokens * frac * scale);
            }
        }
        let whole = Stage::whole(r.model.n_layer);
        let rparams = registry::stage_params(&r.model, 1, &whole)?.total() as f64;
        let clip = r.ops_ms.get(optimizer::CLIP).copied().unwrap_or(0.0);
        let update = r.ops_ms.get(phase::OPTIMIZER).copied().unwrap_or(0.0) - clip;
        t.insert(
            optimizer::CLIP.into(),
            clip * params as f64 / rparams * scale,
        );
        t.insert(
            "optimizer:update".into(),
            update.max(0.0) * owned as f64 / rparams * scale,
        );
        Ok(())
    }

    /// What the backward pass computes again (`--recompute`), as the trainer times it:
    /// `attention` reruns each layer's scores GEMM and softmax (`backward:attention:recompute`);
    /// `full` reruns the forward pass of every block but the stage's last, tensor-parallel
    /// all-reduces included (`backward:recompute`).
    fn recomputation(&self, net: &Network, s: &Slice, oversub: f64, t: &mut BTreeMap<String, f64>) {
        let (name, ms) = match self.w.recompute {
            Recompute::None => return,
            Recompute::Attention => {
                let ops = [fwd::BADDBMM, fwd::SOFTMAX];
                let again = self.compute_ops(s, Pass::Forward, Some(&ops), oversub);
                (bwd::ATTENTION_RECOMPUTE, again.iter().map(|o| o.1).sum())
            }
            Recompute::Full => {
                let blocks = Slice {
                    layers: s.layers.saturating_sub(1),
                    first: false,
                    last: false,
                    ..*s
                };
                if blocks.layers == 0 {
                    return;
                }
                let compute: f64 = self
                    .compute_ops(&blocks, Pass::Forward, None, oversub)
                    .iter()
                    .map(|o| o.1)
                    .sum();
                let mut tp = BTreeMap::new();
                if self.l.tp > 1 {
                    self.tp_allreduces(net, &blocks, &mut tp);
                }
                (bwd::RECOMPUTE, compute + sum_prefix(&tp, "forward:"))
            }
        };
        t.insert(name.into(), ms);
    }

    /// Tensor-parallel all-reduces, as the architecture declares them.
    fn tp_allreduces(&self, net: &Network, s: &Slice, t: &mut BTreeMap<String, f64>) {
        let cost = registry::cost(s.model.arch);
        for c in (cost.tp_allreduces)(s) {
            if c.calls > 0.0 {
                let one = net.allreduce(self.tp_group, c.bytes) * 1e3 * self.mbf();
                t.insert(c.name.into(), one * c.calls);
            }
        }
    }

    /// Pipeline: each micro-batch's activation and gradient across the stage's boundaries,
    /// and the tied embedding's gradient (GPT-2's `wte`) between the first and last stage.
    fn pipeline_transfers(
        &self,
        net: &Network,
        s: &Slice,
        stage: &Stage,
        t: &mut BTreeMap<String, f64>,
    ) {
        let (mb, seq, c) = (s.mb as f64, s.seq_len as f64, s.model.n_embd as f64);
        let msg = net.sendrecv(self.next_stage_across, 4.0 * mb * seq * c) * 1e3;
        let boundaries = (!s.first) as usize + (!s.last) as usize;
        t.insert(pipeline::RECV.into(), msg * self.mbf() * boundaries as f64);
        let tied = (registry::cost(s.model.arch).tied_bytes)(s);
        if let (Some(bytes), true) = (tied, stage.is_first() || stage.is_last()) {
            let g = Group {
                ranks: 2,
                nodes: if self.last_stage_across { 2 } else { 1 },
            };
            t.insert(
                pipeline::TIED_ALLREDUCE.into(),
                net.allreduce(g, bytes) * 1e3,
            );
        }
    }

    /// Data-parallel gradient synchronisation of the stage's `table` in fugu's buckets, each
    /// started when the last backward pass (`last_bwd` ms) has made it final, run one after
    /// another; what is left after that pass is `allreduce-params`. ZeRO-1 reduce-scatters and
    /// all-gathers the parameters after the optimizer (`allgather-params`).
    fn gradient_sync(
        &self,
        net: &Network,
        table: &crate::model::table::Table,
        last_bwd: f64,
        t: &mut BTreeMap<String, f64>,
    ) {
        let (g, zero) = (self.dp_group, self.l.zero);
        let buckets = bucket_ranges(table, DEFAULT_BUCKET_FLOATS);
        let total = table.total() as f64;
        let mut finish = 0.0f64; // ms after the last backward pass started
        for b in buckets.iter().rev() {
            let ready = last_bwd * (1.0 - b.start as f64 / total);
            let bytes = 4.0 * b.len() as f64;
            let cost = if zero {
                net.reduce_scatter(g, bytes)
            } else {
                net.allreduce(g, bytes)
            } * 1e3;
            finish = finish.max(ready) + cost;
        }
        t.insert(grads::ALLREDUCE_PARAMS.into(), (finish - last_bwd).max(0.0));
        if zero {
            let gather = buckets
                .iter()
                .fold(0.0, |a, b| a + net.allgather(g, 4.0 * b.len() as f64) * 1e3);
            t.insert(grads::ALLGATHER_PARAMS.into(), gather);
        }
    }
}

/// Predicts one step of `w` on `l` on machine `m`.
pub fn predict(w: &Workload, l: &Layout, m: &Machine) -> Result<Prediction> {
    let grid = check_layout(w, l)?;
    check_sizes(w, l)?;
    if let Compute::Kernels(k) = &m.compute {
        k.gemm_rate(w.precision)?;
    }
    let cfg = &w.model;
    if l.pp > cfg.n_layer {
        bail!(
            "--pp {}: more stages than model.n_layer = {} blocks",
            l.pp,
            cfg.n_layer
        );
    }
    let per_rank = w.global_batch / l.dp;
    let rpn = l.ranks_per_node;
    let ctx = StepCtx {
        w,
        l,
        m,
        per_rank,
        mb: l.micro_batch_size(w),
        tp_group: Group {
            ranks: l.tp,
            nodes: nodes_spanned(grid.world_rank_of(0, 0, 0), 1, l.tp, rpn),
        },
        dp_group: Group {
            ranks: l.dp,
            nodes: nodes_spanned(grid.world_rank_of(0, 0, 0), l.tp, l.dp, rpn),
        },
        next_stage_across: l.pp > 1 && grid.world_rank_of(1, 0, 0) / rpn != 0,
        last_stage_across: grid.world_rank_of(l.pp - 1, 0, 0) / rpn != 0,
    };
    let stages = match &w.pp_layers {
        Some(counts) => Stage::layout(cfg, l.pp, w.seq_len, Some(counts))?,
        None => Stage::balanced(cfg.n_layer, l.pp, ctx.part_costs())?,
    };
    let pass = |oversub: f64| -> Result<Vec<(BTreeMap<String, f64>, f64)>> {
        stages.iter().map(|s| ctx.stage(s, oversub)).collect()
    };
    // A node's ranks × threads over its cores, weighted by how busy each rank is: pipeline
    // stages that wait leave their cores to the others (equal stages: the plain ratio).
    let nominal = (rpn * l.threads_per_rank) as f64 / m.cores_per_node as f64;
    let oversub = if nominal <= 1.0 {
        1.0
    } else {
        let compute: Vec<f64> = pass(1.0)?.iter().map(|(t, _)| compute_ms(t)).collect();
        let max = compute.iter().cloned().fold(0.0, f64::max).max(1e-30);
        let mean = compute.iter().sum::<f64>() / compute.len() as f64;
        (nominal * mean / max).max(1.0)
    };
    let per_stage = pass(oversub)?;
    // 1F1B: a stage waits while the other stages fill and drain the pipeline, one
    // micro-batch's forward and backward pass each ((p − 1)·(f + b) for equal stages). The
    // slowest stage's step is the step.
    let mbf = ctx.mbf();
    let per_micro: Vec<f64> = per_stage
        .iter()
        .map(|(t, _)| (t["forward"] + t["backward"]) / mbf)
        .collect();
    // Memory: the fullest stage (1F1B keeps the most micro-batches in flight on the first).
    let memory_gib_per_stage: Vec<f64> = per_stage.iter().map(|(_, mem)| *mem).collect();
    let (memory_stage, mem) = memory_gib_per_stage
        .iter()
        .copied()
        .enumerate()
        .fold((0, 0.0f64), |a, (i, m)| if m > a.1 { (i, m) } else { a });
    let mut best: Option<(f64, BTreeMap<String, f64>)> = None;
    for (i, (mut t, _)) in per_stage.into_iter().enumerate() {
        if l.pp > 1 {
            let others = per_micro
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != i)
                .fold(0.0, |a, (_, v)| a + v);
            t.insert(pipeline::BUBBLE.into(), others);
        }
        let step = t
            .iter()
            .filter(|(k, _)| !k.contains(':') || k.starts_with("pipeline:"))
            .fold(0.0, |a, (_, v)| a + v);
        if best.as_ref().is_none_or(|b| step > b.0) {
            best = Some((step, t));
        }
    }
    let (step_ms, timers_ms) = best.expect("at least one stage");
    let available = m.memory_gib_per_node / rpn as f64;
    let whole = Slice {
        vocab: cfg.vocab_size,
        ..Stage::whole(cfg.n_layer).slice(cfg, w.seq_len, w.global_batch, 1)
    };
    let flops = registry::cost(cfg.arch).model_flops(&whole);
    let tflops_per_node = flops / (step_ms * 1e-3) / l.nodes as f64 / 1e12;
    let peak_node = m.peak_gflops_per_core * m.cores_per_node as f64 / 1e3;
    Ok(Prediction {
        layout: *l,
        micro_batch_size: l.micro_batch_size(w),
        step_ms,
        tokens_per_s: (w.global_batch * w.seq_len) as f64 / (step_ms * 1e-3),
        tflops_per_node,
        peak_pct: 100.0 * tflops_per_node / peak_node,
        timers_ms,
        memory_gib_per_rank: mem,
        memory_stage,
        memory_gib_per_stage,
        pp_layers: Stage::counts(&stages),
        memory_gib_available: available,
        fits: mem <= available,
    })
}

/// A stage's compute (forward, backward and optimizer ops, no communication), ms.
fn compute_ms(t: &BTreeMap<String, f64>) -> f64 {
    t.iter()
        .filter(|(k, _)| {
            (k.starts_with("forward:") || k.starts_with("backward:") || k.starts_with("optimizer:"))
                && !k.ends_with(":allreduce")
        })
        .fold(0.0, |a, (_, v)| a + v)
}

fn sum_prefix(t: &BTreeMap<String, f64>, prefix: &str) -> f64 {
    t.iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .fold(0.0, |a, (_, v)| a + v)
}

/// Memory per rank (GiB), the run header's accounting: parameters and gradients (f32) and, in
/// a 16-bit precision, the parameters' compute copy; AdamW moments (the owned share under
/// ZeRO-1); the in-flight micro-batches' activations (in the precision's type) and statistics
/// (f32) as `--recompute` and `--loss-chunk` keep them; and the backward scratch (the precision's type; the
/// CPU's three-step attention keeps probabilities). Stage `s` of `p` holds `min(p − s, m)`
/// micro-batches in flight under 1F1B: the first stage the most.
fn memory_gib(
    w: &Workload,
    mb: usize,
    l: &Layout,
    stage: &Stage,
    params: usize,
    owned: usize,
) -> f64 {
    let d = StepDims::new(&w.model, mb, w.seq_len, l.tp).with_loss_chunk(w.loss_chunk);
    let in_flight = (stage.count - stage.index).min(l.micro_batches);
    let keep = (w.recompute, AttnKeep::Probabilities);
    let [acts, stats, grad] = registry::activation_tables(&w.model, &d, stage, keep);
    let el = w.precision.compute_dtype().bytes();
    let copy = match w.precision {
        Precision::Fp32 => 0,
        _ => el * params,
    };
    let acts = in_flight * (el * acts.total() + 4 * stats.total());
    let bytes = 8 * params + copy + 8 * owned + acts + el * grad.total();
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::nodes_spanned;

    /// The arithmetic count equals the count of a listed set, for strides below, at and above a
    /// node, and it answers for a billion ranks without listing them.
    #[test]
    fn nodes_spanned_counts_without_listing_ranks() {
        for rpn in 1..7 {
            for start in 0..9 {
                for stride in 1..10 {
                    for count in 0..12 {
                        let listed = (0..count)
                            .map(|i| (start + i * stride) / rpn)
                            .collect::<std::collections::BTreeSet<_>>()
                            .len();
                        assert_eq!(nodes_spanned(start, stride, count, rpn), listed);
                    }
                }
            }
        }
        assert_eq!(nodes_spanned(0, 1, 4_000_000_000, 48), 83_333_334);
        assert_eq!(nodes_spanned(0, 48, 1_000_000_000, 48), 1_000_000_000);
    }
}

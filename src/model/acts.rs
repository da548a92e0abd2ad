//! Activation layout: every tensor the forward pass keeps for the backward pass, and the
//! per-layer gradient scratch the backward pass reuses, each carved from one allocation by a
//! [`Table`] (the llm.c `ActivationTensors` idea). The per-row statistics (layernorm mean and
//! rstd, cross-entropy maxima, sums, target logits and losses) have a table and buffer of their
//! own, because they stay f32 when the activations are 16-bit (mixed precision).

use super::stage::Stage;
use super::table::{padded_vocab, Table};
use crate::backend::{AttnDims, BufId, Dtype, NormStats, Span, StepShapes};
use crate::model::ModelConfig;

/// Which activations the backward pass recomputes instead of keeping from the forward pass
/// (`--recompute`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Recompute {
    /// Keep every activation.
    #[default]
    None,
    /// Megatron's selective recomputation: the attention probabilities (B, NH, T, T) of every
    /// layer share one buffer, and the backward pass recomputes a layer's scores and softmax
    /// from its kept q, k (the largest activation at long sequences, for two cheap ops).
    Attention,
    /// Full recomputation: only each block's output (the next block's input, B·T·C) is kept
    /// per layer; every other block activation lives in one set shared by all layers, and the
    /// backward pass reruns each block's forward pass from its input before its backward pass
    /// (the stage's last block excepted: its activations are still in the shared set). About
    /// one more forward pass of the blocks in time, the least activation memory.
    Full,
}

impl Recompute {
    /// Every choice, least recomputation first.
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Attention, Recompute::Full];

    /// The name on the command line (`--recompute attention`), in the run header and logs.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Attention => "attention",
            Recompute::Full => "full",
        }
    }
}

/// What the forward pass keeps of attention for the backward pass (chosen per backend and
/// compute type by each model, `FUGU_ATTENTION` overriding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnKeep {
    /// The probabilities (B, NH, T, T) in the compute type: the three-step path (scores GEMM,
    /// softmax, values GEMM) and its three backward steps.
    Probabilities,
    /// The log-sum-exp of each row of scaled scores (B, NH, T) in f32: the fused path
    /// ([`crate::backend::Backend::attention_forward`]); the backward pass recomputes the
    /// probabilities tile by tile, and no (T, T) tensor exists.
    LogSumExp,
}

impl AttnKeep {
    /// The name in the run header (`"attention"`) and logs.
    pub fn name(self) -> &'static str {
        match self {
            AttnKeep::Probabilities => "three-step",
            AttnKeep::LogSumExp => "fused",
        }
    }
}

/// Shapes of one step: `b` sequences of `t` tokens, hidden `c`, and this rank's share of heads,
/// MLP width and (padded) vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepDims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    /// Local attention heads (n_head / tp).
    pub nh: usize,
    /// Local key/value heads (n_kv_head / tp; `nh` without grouped-query attention).
    pub kv: usize,
    /// Head size (GPT-2: c / n_head).
    pub hs: usize,
    /// Local MLP width (GPT-2: 4·c / tp).
    pub f: usize,
    /// Local padded vocabulary rows (padded_vocab / tp).
    pub vp: usize,
    /// Rows of logits the LM head computes at once: `b·t`, or fewer with a loss chunk
    /// ([`Self::with_loss_chunk`]; the last stage then runs the head, the loss and the head's
    /// backward chunk by chunk in the forward pass, `passes::head_and_loss`).
    pub loss_rows: usize,
}

impl StepDims {
    /// The shapes of a step of `b` sequences of `t` tokens of model `cfg` on one of `tp`
    /// tensor-parallel ranks.
    pub fn new(cfg: &ModelConfig, b: usize, t: usize, tp: usize) -> StepDims {
        StepDims {
            b,
            t,
            c: cfg.n_embd,
            nh: cfg.n_head / tp,
            kv: cfg.kv_heads() / tp,
            hs: cfg.head_size(),
            f: cfg.mlp_width() / tp,
            vp: padded_vocab(cfg.vocab_size) / tp,
            loss_rows: b * t,
        }
    }

    /// These shapes with the LM head's logits `chunk` rows at a time (`None`, or a chunk of
    /// at least `b·t` rows: the whole micro-batch at once).
    pub fn with_loss_chunk(self, chunk: Option<usize>) -> StepDims {
        let n = self.n();
        StepDims {
            loss_rows: chunk.map_or(n, |rows| rows.clamp(1, n)),
            ..self
        }
    }

    /// Whether the LM head and the loss run in chunks of rows ([`Self::loss_rows`]).
    pub fn loss_chunked(&self) -> bool {
        self.loss_rows < self.n()
    }

    /// The head's tensors after the final norm's output `norm` (rows of `c`): the logits
    /// ([`Self::loss_rows`] rows of this rank's vocabulary), and with a loss chunk the
    /// gradient of the head's input (`head_dinp`), kept from the forward pass for the
    /// backward.
    pub fn head_tensors(&self, norm: &'static str) -> Vec<(&'static str, Vec<usize>)> {
        let n = self.n();
        let mut head = vec![
            (norm, vec![n, self.c]),
            ("logits", vec![self.loss_rows, self.vp]),
        ];
        if self.loss_chunked() {
            head.push(("head_dinp", vec![n, self.c]));
        }
        head
    }

    /// Tokens per step (B·T), the row count of every 2-D activation.
    pub fn n(&self) -> usize {
        self.b * self.t
    }
    /// The attention ops' dimensions.
    pub fn attn(&self) -> AttnDims {
        AttnDims {
            b: self.b,
            t: self.t,
            nh: self.nh,
            kv: self.kv,
            hs: self.hs,
        }
    }
    /// The step's shapes that size a backend's working memory ([`crate::backend::StepShapes`]):
    /// activations of type `act` and the attention path's per-sequence tensors (`rope`: rotary
    /// embeddings on q, k rows).
    pub fn step_shapes(&self, act: Dtype, keep: AttnKeep, rope: bool) -> StepShapes {
        let c = self.c;
        let scores = match keep {
            AttnKeep::Probabilities => self.nh * self.t * self.t,
            AttnKeep::LogSumExp => 0,
        };
        StepShapes {
            act,
            rows: self.n(),
            width: c,
            scores_per_sequence: scores,
            qkv_width: self.qkv_width(),
            t: self.t,
            sequence_width: if rope { self.qkv_width() } else { c },
        }
    }
    /// Width of this rank's attention heads (nh·hs = c / tp).
    pub fn local_c(&self) -> usize {
        self.nh * self.hs
    }
    /// Width of this rank's keys (and of its values): kv·hs.
    pub fn kv_width(&self) -> usize {
        self.kv * self.hs
    }
    /// Width of a row of the fused q, k, v projection: (nh + 2·kv)·hs.
    pub fn qkv_width(&self) -> usize {
        self.local_c() + 2 * self.kv_width()
    }
}

/// Activations of one transformer block.
#[derive(Clone, Copy, Debug)]
pub struct LayerActs {
    pub ln1: Span,
    pub ln1_mean: Span,
    pub ln1_rstd: Span,
    pub qkv: Span,
    /// What the backward pass needs of the attention step besides q, k, v and its output.
    pub att: AttnKept,
    /// Attention output before the projection (B, T, C/tp).
    pub atty: Span,
    pub resid2: Span,
    pub ln2: Span,
    pub ln2_mean: Span,
    pub ln2_rstd: Span,
    pub fch: Span,
    pub fch_gelu: Span,
    /// Block output (residual stream after the MLP).
    pub resid3: Span,
}

impl LayerActs {
    /// The first layernorm's row statistics.
    pub fn ln1_stats(&self) -> NormStats {
        NormStats {
            mean: self.ln1_mean,
            rstd: self.ln1_rstd,
        }
    }

    /// The second layernorm's row statistics.
    pub fn ln2_stats(&self) -> NormStats {
        NormStats {
            mean: self.ln2_mean,
            rstd: self.ln2_rstd,
        }
    }

    /// The block's attention activations.
    pub fn attn(&self) -> AttnActs {
        AttnActs {
            qkv: self.qkv,
            att: self.att,
            atty: self.atty,
        }
    }
}

/// A block's attention activations: the fused q, k, v rows, what is kept for the backward
/// pass, and the output before the projection.
#[derive(Clone, Copy, Debug)]
pub struct AttnActs {
    pub qkv: Span,
    pub att: AttnKept,
    pub atty: Span,
}

/// The attention's gradient scratch: of q, k, v, of the probabilities (three-step path only)
/// and of the output.
#[derive(Clone, Copy, Debug)]
pub struct AttnGrads {
    pub dqkv: Span,
    pub datt: Option<Span>,
    pub datty: Span,
}

/// [`AttnKeep`]'s tensor of one block.
#[derive(Clone, Copy, Debug)]
pub enum AttnKept {
    /// Attention probabilities (B, NH, T, T), written by the scores GEMM and softmaxed in
    /// place (one buffer shared by all layers under [`Recompute::Attention`]).
    Probabilities(Span),
    /// Log-sum-exp of each row of scaled scores (B, NH, T), f32.
    LogSumExp(Span),
}

impl AttnKept {
    /// Which of the two is kept.
    pub fn keep(&self) -> AttnKeep {
        match self {
            AttnKept::Probabilities(_) => AttnKeep::Probabilities,
            AttnKept::LogSumExp(_) => AttnKeep::LogSumExp,
        }
    }
}

/// The last stage's activations: final layernorm, logits and the loss statistics.
#[derive(Clone, Copy, Debug)]
pub struct HeadActs {
    pub lnf: Span,
    pub lnf_mean: Span,
    pub lnf_rstd: Span,
    pub loss: LossActs,
}

/// What the LM head and the cross-entropy read and write (`passes::head_and_loss`), on the
/// last stage.
#[derive(Clone, Copy, Debug)]
pub struct LossActs {
    /// Logits ([`StepDims::loss_rows`], Vp/tp); the cross-entropy overwrites them with their
    /// gradient.
    pub logits: Span,
    /// With a loss chunk: the gradient of the LM head's input (B·T, C), from the forward pass.
    pub head_dinp: Option<Span>,
    pub losses: Span,
    /// Cross-entropy row statistics (ops/crossentropy.rs): this shard's maxima, the
    /// all-reduced maxima, the sums of exponentials and the target logits.
    pub ce_local_max: Span,
    pub ce_max: Span,
    pub ce_sum: Span,
    pub ce_tl: Span,
}

impl LossActs {
    /// What the loss of rows `r0..r0 + m` reads and writes: `logits` (a chunk's, `m` rows)
    /// and those rows of the losses and statistics (no head gradient: the loss has none).
    pub fn rows(&self, logits: Span, r0: usize, m: usize) -> LossActs {
        LossActs {
            logits,
            head_dinp: None,
            losses: self.losses.sub(r0, m),
            ce_local_max: self.ce_local_max.sub(r0, m),
            ce_max: self.ce_max.sub(r0, m),
            ce_sum: self.ce_sum.sub(r0, m),
            ce_tl: self.ce_tl.sub(r0, m),
        }
    }
}

impl HeadActs {
    /// The final layernorm's row statistics.
    pub fn lnf_stats(&self) -> NormStats {
        NormStats {
            mean: self.lnf_mean,
            rstd: self.lnf_rstd,
        }
    }
}

/// All activations of one micro-batch on one pipeline stage.
#[derive(Clone, Debug)]
pub struct Acts {
    pub dims: StepDims,
    pub table: Table,
    /// The activations ([`acts_table`], in the compute type).
    pub buf: BufId,
    /// The f32 statistics ([`stats_table`]).
    pub stats_buf: BufId,
    /// The stage's input residual stream: the embeddings on the first stage, the previous
    /// stage's output elsewhere.
    pub encoded: Span,
    /// The stage's blocks.
    pub layers: Vec<LayerActs>,
    /// Output of a projection before it joins the residual stream (attention and MLP share it).
    pub proj: Span,
    /// On the last stage.
    pub head: Option<HeadActs>,
}

/// Gradient scratch reused by every block during the backward pass.
#[derive(Clone, Debug)]
pub struct GradActs {
    pub table: Table,
    pub buf: BufId,
    /// Gradient of the loss with respect to the residual stream at the current depth.
    pub dres: Span,
    /// Gradient with respect to a LayerNorm output (ln_1, ln_2 or ln_f).
    pub dln: Span,
    pub dqkv: Span,
    /// Gradient of the attention probabilities ([`AttnKeep::Probabilities`] only).
    pub datt: Option<Span>,
    pub datty: Span,
    pub dfch: Span,
    pub dfch_gelu: Span,
}

/// Tensor `name` of `table` as a span of `buf` (the activation, statistics and gradient-scratch
/// tables of every architecture).
pub fn span(table: &Table, buf: BufId, name: &str) -> Span {
    let s = table
        .get(name)
        .unwrap_or_else(|| panic!("activation {name} missing"));
    Span {
        buf,
        offset: s.offset,
        len: s.len(),
    }
}

/// A decoder architecture's activations of one micro-batch, by name: one block's tensors in
/// the compute type (`att` and `resid3`, the block output, among them) and its per-row f32
/// statistics, and the head's (the loss's statistics are added to every head). The tables
/// below carve them; each architecture resolves the names into its own structs
/// ([`Carved`]).
pub struct ActLayout {
    pub block: Vec<(&'static str, Vec<usize>)>,
    pub block_stats: Vec<&'static str>,
    pub head: Vec<(&'static str, Vec<usize>)>,
    pub head_stats: Vec<&'static str>,
}

/// The loss's per-row statistics, after the head's own.
const LOSS_STATS: [&str; 5] = ["losses", "ce_local_max", "ce_max", "ce_sum", "ce_tl"];

/// The activation table of `stage`'s blocks (and, on the last stage, the head) in the compute
/// type's buffer. A tensor shared by all layers has no `h.L.` prefix: `att` under
/// [`Recompute::Attention`], all but `resid3` under [`Recompute::Full`]. `att` exists only
/// under [`AttnKeep::Probabilities`].
pub fn layered_acts_table(
    d: &StepDims,
    stage: &Stage,
    (recompute, keep): (Recompute, AttnKeep),
    layout: &ActLayout,
) -> Table {
    let n = d.n();
    let shared = |name: &str| match recompute {
        Recompute::None => false,
        Recompute::Attention => name == "att",
        Recompute::Full => name != "resid3",
    };
    let mut t = Table::default();
    t.push("encoded", &[n, d.c]);
    let kept = |name: &str| name != "att" || keep == AttnKeep::Probabilities;
    let block: Vec<_> = layout.block.iter().filter(|(name, _)| kept(name)).collect();
    for (name, shape) in block.iter().filter(|(name, _)| shared(name)) {
        t.push(*name, shape);
    }
    for l in 0..stage.layers.len() {
        for (name, shape) in block.iter().filter(|(name, _)| !shared(name)) {
            t.push(format!("h.{l}.{name}"), shape);
        }
    }
    t.push("proj", &[n, d.c]);
    if stage.is_last() {
        for (name, shape) in &layout.head {
            t.push(*name, shape);
        }
    }
    t
}

/// The per-row statistics of one micro-batch on `stage` (always f32), with each block's
/// attention log-sum-exp under [`AttnKeep::LogSumExp`].
pub fn layered_stats_table(
    d: &StepDims,
    stage: &Stage,
    keep: AttnKeep,
    layout: &ActLayout,
) -> Table {
    let n = d.n();
    let mut t = Table::default();
    for l in 0..stage.layers.len() {
        for s in &layout.block_stats {
            t.push(format!("h.{l}.{s}"), &[n]);
        }
        if keep == AttnKeep::LogSumExp {
            t.push(format!("h.{l}.att_lse"), &[d.b, d.nh, d.t]);
        }
    }
    if stage.is_last() {
        for s in layout.head_stats.iter().chain(&LOSS_STATS) {
            t.push(*s, &[n]);
        }
    }
    t
}

/// GPT-2's activations: layernorm outputs and statistics, the MLP's pre- and post-GELU rows.
fn gpt2_layout(d: &StepDims) -> ActLayout {
    let n = d.n();
    ActLayout {
        block: vec![
            ("ln1", vec![n, d.c]),
            ("qkv", vec![n, d.qkv_width()]),
            ("att", vec![d.b, d.nh, d.t, d.t]),
            ("atty", vec![n, d.local_c()]),
            ("resid2", vec![n, d.c]),
            ("ln2", vec![n, d.c]),
            ("fch", vec![n, d.f]),
            ("fch_gelu", vec![n, d.f]),
            ("resid3", vec![n, d.c]),
        ],
        block_stats: vec!["ln1_mean", "ln1_rstd", "ln2_mean", "ln2_rstd"],
        head: d.head_tensors("lnf"),
        head_stats: vec!["lnf_mean", "lnf_rstd"],
    }
}

/// GPT-2's activation table ([`layered_acts_table`]).
pub fn acts_table(d: &StepDims, stage: &Stage, recompute: Recompute, keep: AttnKeep) -> Table {
    layered_acts_table(d, stage, (recompute, keep), &gpt2_layout(d))
}

/// GPT-2's statistics table ([`layered_stats_table`]).
pub fn stats_table(d: &StepDims, stage: &Stage, keep: AttnKeep) -> Table {
    layered_stats_table(d, stage, keep, &gpt2_layout(d))
}

/// An activation table and a statistics table resolved into spans of their buffers: what an
/// architecture's activation struct is built from.
pub struct Carved<'a> {
    pub acts: (&'a Table, BufId),
    pub stats: (&'a Table, BufId),
}

impl Carved<'_> {
    /// The tensor `name` (activation or statistic).
    pub fn get(&self, name: &str) -> Span {
        let (t, buf) = if self.acts.0.get(name).is_some() {
            self.acts
        } else {
            self.stats
        };
        span(t, buf, name)
    }

    /// Block `l`'s tensor `name`: its own, or the one all blocks share.
    pub fn layer(&self, l: usize, name: &str) -> Span {
        match self.acts.0.get(name) {
            Some(_) => self.get(name),
            None => self.get(&format!("h.{l}.{name}")),
        }
    }

    /// What block `l` keeps of attention.
    pub fn att(&self, l: usize) -> AttnKept {
        match self.stats.0.get(&format!("h.{l}.att_lse")) {
            Some(_) => AttnKept::LogSumExp(self.layer(l, "att_lse")),
            None => AttnKept::Probabilities(self.layer(l, "att")),
        }
    }

    /// The loss's tensors (on the last stage).
    pub fn loss(&self) -> LossActs {
        LossActs {
            logits: self.get("logits"),
            head_dinp: self.acts.0.get("head_dinp").map(|_| self.get("head_dinp")),
            losses: self.get("losses"),
            ce_local_max: self.get("ce_local_max"),
            ce_max: self.get("ce_max"),
            ce_sum: self.get("ce_sum"),
            ce_tl: self.get("ce_tl"),
        }
    }
}

impl crate::model::core::ActSet for Acts {
    fn bufs(&self) -> Vec<BufId> {
        vec![self.buf, self.stats_buf]
    }
}

impl crate::model::core::StepActs for Acts {
    fn dims(&self) -> StepDims {
        self.dims
    }
}

impl crate::model::core::ActSet for GradActs {
    fn bufs(&self) -> Vec<BufId> {
        vec![self.buf]
    }
}

impl Acts {
    /// Resolves the named spans of `table` (from [`acts_table`]) in buffer `buf` and of
    /// `stats` (from [`stats_table`]) in `stats_buf`.
    pub fn new(
        dims: StepDims,
        stage: &Stage,
        (table, buf): (Table, BufId),
        (stats, stats_buf): (Table, BufId),
    ) -> Acts {
        let c = Carved {
            acts: (&table, buf),
            stats: (&stats, stats_buf),
        };
        let layers = (0..stage.layers.len())
            .map(|l| {
                let p = |x: &str| c.layer(l, x);
                LayerActs {
                    ln1: p("ln1"),
                    ln1_mean: p("ln1_mean"),
                    ln1_rstd: p("ln1_rstd"),
                    qkv: p("qkv"),
                    att: c.att(l),
                    atty: p("atty"),
                    resid2: p("resid2"),
                    ln2: p("ln2"),
                    ln2_mean: p("ln2_mean"),
                    ln2_rstd: p("ln2_rstd"),
                    fch: p("fch"),
                    fch_gelu: p("fch_gelu"),
                    resid3: p("resid3"),
                }
            })
            .collect();
        let (encoded, proj) = (c.get("encoded"), c.get("proj"));
        let head = stage.is_last().then(|| HeadActs {
            lnf: c.get("lnf"),
            lnf_mean: c.get("lnf_mean"),
            lnf_rstd: c.get("lnf_rstd"),
            loss: c.loss(),
        });
        Acts {
            dims,
            encoded,
            layers,
            proj,
            head,
            table,
            buf,
            stats_buf,
        }
    }
}

/// The gradient-scratch table (`datt` only under [`AttnKeep::Probabilities`]).
pub fn grad_acts_table(d: &StepDims, keep: AttnKeep) -> Table {
    let n = d.n();
    let local_c = d.local_c();
    let mut t = Table::default();
    t.push("dres", &[n, d.c]);
    t.push("dln", &[n, d.c]);
    t.push("dqkv", &[n, d.qkv_width()]);
    if keep == AttnKeep::Probabilities {
        t.push("datt", &[d.b, d.nh, d.t, d.t]);
    }
    t.push("datty", &[n, local_c]);
    t.push("dfch", &[n, d.f]);
    t.push("dfch_gelu", &[n, d.f]);
    t
}

impl GradActs {
    /// The attention's share of the scratch.
    pub fn attn(&self) -> AttnGrads {
        AttnGrads {
            dqkv: self.dqkv,
            datt: self.datt,
            datty: self.datty,
        }
    }

    pub fn new(table: Table, buf: BufId) -> GradActs {
        let s = |name: &str| span(&table, buf, name);
        GradActs {
            dres: s("dres"),
            dln: s("dln"),
            dqkv: s("dqkv"),
            datt: table.get("datt").map(|_| s("datt")),
            datty: s("datty"),
            dfch: s("dfch"),
            dfch_gelu: s("dfch_gelu"),
            table,
            buf,
        }
    }
}

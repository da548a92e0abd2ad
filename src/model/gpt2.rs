//! GPT-2 forward and backward passes over a [`Backend`], llm.c style: its state is a [`Core`]
//! (one parameter buffer, one gradient buffer, two AdamW moment buffers, all carved by the
//! parameter table) and one activation buffer per in-flight micro-batch (carved by the
//! activation table).
//!
//! Tensor parallelism: the parameter table already holds this rank's shards (`gpt2_params(cfg,
//! tp)`), and the activation shapes use the local head count, MLP width and vocabulary rows.
//! The Megatron f/g all-reduces go through the tensor-parallel communicator (`TP:` below); with
//! [`crate::comm::SerialComm`] they are no-ops.
//!
//! Pipeline parallelism: the model is one [`Stage`] (the whole model when there is one): its
//! parameter table holds the stage's blocks, plus the embeddings on the first stage and the
//! final layernorm and LM head on the last. A step's micro-batches are loaded together
//! ([`Model::set_batches`]) and each runs forward and backward by index
//! ([`Model::forward_micro`], [`Model::backward_micro`]) in whatever order the schedule says,
//! with up to [`Model::set_in_flight`] micro-batches' activations kept at once. Between stages
//! the caller moves [`Model::stage_output`] / [`Model::stage_input`] forward and
//! [`Model::input_grad`] / [`Model::output_grad`] back. The first and the last stage each hold
//! a copy of the tied `wte`; the caller sums their gradients ([`Model::tied_grad`]).
//!
//! Data parallelism and ZeRO-1 live outside the model: [`Model::backward_micro`] reports when a
//! suffix of the gradient buffer is final (so the trainer can start bucket all-reduces while
//! backward goes on), and [`Model::set_owned`] restricts the optimizer (and the AdamW moments)
//! to the parameter ranges this rank updates.

use super::acts::{
    acts_table, grad_acts_table, stats_table, Acts, AttnKeep, GradActs, HeadActs, LayerActs,
    Recompute, StepDims,
};
use super::contract::{GradsReady, Model, OpForm, TpRank};
use super::core::{ActSets, Core};
use super::decoder::{self, Blocks};
use super::decoder_ops::{backward as bwd, forward as fwd};
use super::kv::KvCache;
use super::layers::Layers;
use super::params::{HeadParams, LayerParams, ParamSpans};
use super::passes::{
    attention_backward, attention_form, attention_forward, embedding, embedding_backward,
    embedding_forward, lm_head_backward, project_into_residual, residual_form, BlockCtx, Pass,
};
use super::paths::{attention_path, mlp_gelu_path, residual_path, Knobs, MlpGelu, Residual};
use super::stage::Stage;
use super::table::gpt2_stage_params;
use super::work;
use crate::backend::{
    Backend, Dtype, LayerNorm, LayerNormGrads, Linear, LinearGrads, Span, TokSpan, WeightLayout,
};
use crate::metrics::ops::trainer;
use crate::metrics::timers::{TimerLevel, Timers};
use crate::model::ModelConfig;
use anyhow::{bail, Result};

use TimerLevel::{Coarse, Fine};

/// GPT-2 on a backend: the shared [`Core`] (buffers, tokens, optimizer), its parameter spans,
/// its activations and the op forms it runs.
pub struct Gpt2<B: Backend> {
    pub core: Core<B>,
    /// Three-step or fused attention ([`attention_path`]).
    attn_keep: AttnKeep,
    /// Where the MLP's GELU runs ([`mlp_gelu_path`]).
    mlp_gelu: MlpGelu,
    /// How the projections join the residual stream ([`residual_path`]).
    residual: Residual,
    p: ParamSpans,
    g: ParamSpans,
    /// One activation set per in-flight micro-batch, and the gradient scratch they share.
    acts: Option<ActSets<Acts, GradActs>>,
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
    /// [`Model::decode`] and evaluation; the training methods must not be called on it.
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
        be: B,
        trainable: bool,
        compute: Dtype,
    ) -> Result<Gpt2<B>> {
        let table = gpt2_stage_params(cfg, tp.size, stage)?;
        let core = Core::new(cfg, (tp, stage), table, be, trainable, compute)?;
        let p = ParamSpans::new(&core.table, core.compute_params, stage);
        let g = p.on(core.grads);
        let knobs = Knobs::from_env()?;
        let be = &core.be;
        let attn_keep = attention_path(be, cfg.n_embd / cfg.n_head, compute, knobs.attention)?;
        let mlp_gelu = mlp_gelu_path(be, compute, knobs.mlp_gelu)?;
        let residual = residual_path(be, compute, knobs.residual)?;
        Ok(Gpt2 {
            core,
            attn_keep,
            mlp_gelu,
            residual,
            p,
            g,
            acts: None,
        })
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
        let c = &self.core;
        if r == Residual::Epilogue && !c.be.residual_epilogue(c.compute) {
            bail!(
                "the {} backend has no residual epilogue for activations stored as {}",
                c.be.name(),
                c.compute.name()
            );
        }
        self.residual = r;
        Ok(())
    }

    /// Storage type of activations and of the parameters the passes read.
    pub fn compute_dtype(&self) -> Dtype {
        self.core.compute
    }

    fn dims(&self, b: usize, t: usize) -> StepDims {
        self.core.dims(b, t)
    }

    /// Makes sure activation buffers for `b`×`t` exist (allocated once, reused every step).
    fn ensure_acts(&mut self, b: usize, t: usize) -> Result<()> {
        if ActSets::fit(&self.acts, b, t) {
            return Ok(());
        }
        self.core.check_seq_len(t)?;
        let d = self.dims(b, t);
        ActSets::free(&mut self.acts, &mut self.core.be);
        let keep = self.attn_keep;
        let stage = self.core.stage.clone();
        let grad = (grad_acts_table(&d, keep), GradActs::new);
        let acts = self.core.alloc_acts(
            |c| {
                (
                    acts_table(&d, &c.stage, c.recompute, keep),
                    stats_table(&d, &c.stage, keep),
                )
            },
            |a, s| Acts::new(d, &stage, a, s),
            grad,
        )?;
        self.acts = Some(acts);
        Ok(())
    }

    /// The activation set of micro-batch `micro`.
    fn acts_of(&self, micro: usize) -> &Acts {
        ActSets::slot(&self.acts, micro).0
    }

    fn grad_acts(&self) -> &GradActs {
        ActSets::slot(&self.acts, 0).1
    }

    /// Micro-batch `micro`'s input and target tokens (B·T each).
    fn tokens(&self, micro: usize) -> (TokSpan, TokSpan) {
        self.core.tokens(micro, self.acts_of(micro).dims.n())
    }

    /// Forward pass on micro-batch 0 of the whole model (see [`Model::forward_micro`]).
    /// Returns the mean loss.
    pub fn forward(&mut self, timers: &Timers, for_backward: bool) -> f32 {
        self.forward_micro(0, timers, for_backward)
            .expect("forward on a model without the loss (a pipeline stage before the last)")
    }

    /// Backward pass of micro-batch 0 after `forward(.., true)`: accumulates into the
    /// gradient buffer.
    pub fn backward(&mut self, timers: &Timers) {
        self.backward_micro(0, timers, &mut |_, _| {});
    }

    /// This stage's forward pass from tokens (first stage) or its input (other stages) to
    /// its output (on the last stage the final layernorm's, and when decoding the logits; a
    /// batch's LM head runs with its loss, [`Core::head_loss`]), shared by training and
    /// decoding; `pass` says where the tokens and attention's keys and values come from.
    fn forward_stage(&mut self, timers: &Timers, pass: Pass) {
        let inputs = match pass {
            Pass::Batch { micro } => self.tokens(micro).0,
            Pass::Decode { .. } => TokSpan { offset: 0, len: 1 },
        };
        self.on_blocks(pass, timers, |x, s, _| decoder::forward_stage(x, s, inputs));
    }

    /// Runs `f` with this model's layers, its pieces of `pass` ([`Blocks`]) and the
    /// recomputation setting.
    fn on_blocks<R>(
        &mut self,
        pass: Pass,
        timers: &Timers,
        f: impl FnOnce(&mut Layers<B>, &Gpt2Pass, Recompute) -> R,
    ) -> R {
        let (a, ga) = ActSets::slot(&self.acts, pass.micro());
        let c = &mut self.core;
        let s = Gpt2Pass {
            a,
            ga,
            p: &self.p,
            g: &self.g,
            tp_rank: c.tp.rank,
            residual: self.residual,
            gelu: self.mlp_gelu,
            pass,
        };
        let x = &mut Layers {
            be: &mut c.be,
            comm: &*c.tp_comm,
            timers,
        };
        f(x, &s, c.recompute)
    }
}

impl<B: Backend> Model<B> for Gpt2<B> {
    fn core(&self) -> &Core<B> {
        &self.core
    }

    fn core_mut(&mut self) -> &mut Core<B> {
        &mut self.core
    }

    fn forms(&self) -> Vec<OpForm> {
        let mlp_note = (self.mlp_gelu == MlpGelu::Epilogue).then(|| {
            "MLP: GELU in the fc GEMM's epilogue, its derivative in the fc projection's input-gradient GEMM's".to_string()
        });
        vec![
            attention_form(self.attn_keep, self.core.recompute),
            OpForm {
                key: "mlp_gelu",
                form: self.mlp_gelu.name(),
                note: mlp_note,
            },
            residual_form(self.residual),
        ]
    }

    /// Takes effect at the next batch.
    fn set_in_flight(&mut self, k: usize) {
        self.core.set_in_flight(k, &mut self.acts);
    }

    /// Changes memory and time only: the recomputed activations are bit-identical to the
    /// kept ones, so are the gradients. Takes effect at the next batch.
    fn set_recompute(&mut self, r: Recompute) {
        self.core.set_recompute(r, &mut self.acts);
    }

    /// Takes effect at the next batch.
    fn set_loss_chunk(&mut self, rows: Option<usize>) {
        self.core.set_loss_chunk(rows, &mut self.acts);
    }

    fn step_shapes(&self, b: usize, t: usize) -> crate::backend::StepShapes {
        let d = self.dims(b, t);
        d.step_shapes(self.core.compute, self.attn_keep, false)
    }

    /// Bytes of the activations (with their f32 statistics) of every in-flight micro-batch of
    /// `b`×`t`, and of the gradient scratch (for the memory report).
    fn activation_bytes(&self, b: usize, t: usize) -> (usize, usize) {
        let d = self.dims(b, t);
        let c = &self.core;
        let tables = (
            acts_table(&d, &c.stage, c.recompute, self.attn_keep),
            stats_table(&d, &c.stage, self.attn_keep),
        );
        c.act_bytes(tables, grad_acts_table(&d, self.attn_keep))
    }

    /// Micro-batch `j` is rows `j·b..(j+1)·b` of the window; token ids must be below the
    /// vocabulary size.
    fn set_batches(&mut self, window: &[u32], micro: usize, b: usize, t: usize) -> Result<()> {
        self.core.load_batches(window, micro, b, t)?;
        self.ensure_acts(b, t)
    }

    /// The micro-batch's input residual stream (B·T, C).
    fn stage_input(&self, micro: usize) -> Span {
        self.acts_of(micro).encoded
    }

    fn stage_output(&self, micro: usize) -> Span {
        let a = self.acts_of(micro);
        a.layers.last().map_or(a.encoded, |l| l.resid3)
    }

    fn output_grad(&self) -> Span {
        self.grad_acts().dres
    }

    fn input_grad(&self) -> Span {
        self.grad_acts().dres
    }

    /// The gradient of `wte` when this stage holds one of its two tied copies (the first and
    /// the last of several stages). `None` with one stage (one copy) or in a middle stage.
    fn tied_grad(&self) -> Option<Span> {
        if self.core.stage.count == 1 {
            return None;
        }
        self.g.embed.map(|e| e.wte).or(self.g.head.map(|h| h.wte))
    }

    /// On the last stage, the micro-batch's mean loss, and with `for_backward` the logits
    /// replaced by the loss gradient (mean over B·T, divided by the accumulation count and
    /// multiplied by the loss scale; with a loss chunk carried through the LM head already),
    /// ready for [`Model::backward_micro`]; `None` on other stages.
    fn forward_micro(&mut self, micro: usize, timers: &Timers, for_backward: bool) -> Option<f32> {
        {
            let _fwd = timers.scope(trainer::phase::FORWARD, Coarse);
            self.forward_stage(timers, Pass::Batch { micro });
        }
        let (_, targets) = self.tokens(micro);
        let a = ActSets::slot(&self.acts, micro).0;
        let (h, hp) = (a.head?, self.p.head?);
        let (_, lm_head) = head_layers(&hp, &a.dims);
        let head = (&lm_head, h.lnf, self.g.head.map(|g| g.wte));
        let loss = (&h.loss, &a.dims);
        Some(
            self.core
                .head_loss(loss, head, targets, timers, for_backward),
        )
    }

    /// After `forward_micro(micro, .., true)` (and, on a stage before the last, after
    /// [`Model::output_grad`] received the gradient of its output): `ready` is called after
    /// each block, in reverse order, and with `from = 0` at the end.
    fn backward_micro(&mut self, micro: usize, timers: &Timers, ready: &mut GradsReady<B>) {
        self.core.assert_trainable();
        let (inputs, _) = self.tokens(micro);
        self.on_blocks(Pass::Batch { micro }, timers, |x, s, recompute| {
            let _bwd = timers.scope(trainer::phase::BACKWARD, Coarse);
            // A stage before the last finds the gradient of its output in `dres` already.
            decoder::backward_stage(x, s, recompute, inputs, ready);
        });
    }

    fn last_logits(&self) -> Vec<f32> {
        let h = self
            .acts_of(0)
            .head
            .expect("logits on the last pipeline stage only");
        self.core.download_span(h.loss.logits)
    }

    /// All positions, each layer's keys and values of this rank's heads.
    fn kv_cache(&mut self) -> Result<KvCache> {
        let kv_width = self.dims(1, 1).kv_width();
        self.core.kv_cache(kv_width)
    }

    /// The same forward pass as training on a batch of one token, with attention over the
    /// cache ([`Backend::attention_decode`]); `cache` must hold positions `0..pos` from
    /// earlier calls, and gets this token's key and value.
    fn decode(
        &mut self,
        cache: &KvCache,
        token: u32,
        pos: usize,
        timers: &Timers,
    ) -> Result<Vec<f32>> {
        self.core.load_decode_token(cache, token, pos)?;
        self.ensure_acts(1, 1)?;
        self.forward_stage(timers, Pass::Decode { cache, pos });
        let h = self.acts_of(0).head.expect("the whole model has the head");
        Ok(self.core.decoded_logits(&h.loss))
    }
}

/// GPT-2's pieces of a pass over one micro-batch ([`Blocks`]): its activations, gradient
/// scratch, parameter and gradient spans, and the pass's settings.
struct Gpt2Pass<'a, 'c> {
    a: &'a Acts,
    ga: &'a GradActs,
    p: &'a ParamSpans,
    g: &'a ParamSpans,
    tp_rank: usize,
    residual: Residual,
    gelu: MlpGelu,
    pass: Pass<'c>,
}

impl<'c> Gpt2Pass<'_, 'c> {
    fn block_pass(&self, layer: usize) -> BlockPass<'_, 'c> {
        BlockPass {
            cx: BlockCtx {
                d: &self.a.dims,
                // Replicated additions (position embedding, row-parallel biases) happen on
                // one rank, before the all-reduce sums the shards.
                tp_first: self.tp_rank == 0,
                residual: self.residual,
                pass: self.pass,
                layer,
                proj: self.a.proj,
            },
            gelu: self.gelu,
        }
    }
}

impl<B: Backend> Blocks<B> for Gpt2Pass<'_, '_> {
    fn layers(&self) -> usize {
        self.a.layers.len()
    }

    fn encoded(&self) -> Span {
        self.a.encoded
    }

    fn block_output(&self, l: usize) -> Span {
        self.a.layers[l].resid3
    }

    fn block_grads_start(&self, l: usize) -> usize {
        self.p.layers[l].ln1_w.offset
    }

    fn embed_forward(&self, x: &mut Layers<B>, inputs: TokSpan) {
        // A stage after the first finds its input in `encoded` already.
        let Some(e) = self.p.embed else {
            return;
        };
        let d = &self.a.dims;
        let wpe = (self.tp_rank == 0).then_some(match self.pass {
            Pass::Batch { .. } => e.wpe,
            Pass::Decode { pos, .. } => e.wpe.sub(pos * d.c, d.c),
        });
        let emb = embedding(e.wte, wpe, self.tp_rank, d);
        embedding_forward(x, &emb, self.a.encoded, inputs);
    }

    fn block_forward(&self, x: &mut Layers<B>, l: usize, resid: Span) {
        let bp = self.block_pass(l);
        block_forward(x, &self.a.layers[l], &self.p.layers[l], resid, &bp);
    }

    fn head_forward(&self, x: &mut Layers<B>, resid: Span) {
        let (Some(h), Some(hp)) = (self.a.head, self.p.head) else {
            return;
        };
        let (lnf, lm_head) = head_layers(&hp, &self.a.dims);
        let stats = h.lnf_stats();
        x.layernorm(fwd::LAYERNORM, &lnf, h.lnf, stats, resid);
        if let Pass::Decode { .. } = self.pass {
            x.linear(fwd::LM_HEAD, &lm_head, h.loss.logits, h.lnf);
        }
    }

    fn head_backward(&self, x: &mut Layers<B>, last: Span) {
        if let (Some(h), Some(hp), Some(hg)) = (self.a.head, self.p.head, self.g.head) {
            head_backward(x, &self.a.dims, (&h, &hp, &hg), self.ga, last);
        }
    }

    fn block_backward(&self, x: &mut Layers<B>, l: usize, resid: Span, recompute_attention: bool) {
        let bp = self.block_pass(l);
        let (la, lp, lg) = (&self.a.layers[l], &self.p.layers[l], &self.g.layers[l]);
        block_backward(x, &bp, (la, lp, lg), self.ga, resid, recompute_attention);
    }

    fn embed_backward(&self, x: &mut Layers<B>, inputs: TokSpan) {
        if let Some(e) = self.g.embed {
            let de = embedding(e.wte, Some(e.wpe), self.tp_rank, &self.a.dims);
            embedding_backward(x, &de, self.ga.dres, inputs);
        }
    }
}

/// What a block's pass needs besides its activations and parameters: the shared context and
/// where the MLP's GELU runs.
struct BlockPass<'a, 'c> {
    cx: BlockCtx<'a, 'c>,
    gelu: MlpGelu,
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
    let ly = BlockLayers::new(lp, bp.cx.d, bp.cx.tp_first);
    let stats1 = la.ln1_stats();
    x.layernorm(fwd::LAYERNORM, &ly.ln1, la.ln1, stats1, resid);
    x.linear(fwd::QKV, &ly.qkv, la.qkv, la.ln1);
    attention_forward(x, &la.attn(), &bp.cx);
    let names = (fwd::PROJ, fwd::ATTENTION_ALLREDUCE);
    project_into_residual(x, &bp.cx, names, &ly.attproj, (la.resid2, resid, la.atty));
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
        &bp.cx,
        names,
        &ly.fcproj,
        (la.resid3, la.resid2, la.fch_gelu),
    );
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
    let dln = lm_head_backward(x, (&lm_head, h.lnf), &h.loss, (ga.dln, hg.wte));
    let grads = LayerNormGrads {
        dinp: ga.dres,
        dw: hg.lnf_w,
        dbias: hg.lnf_b,
    };
    let stats = h.lnf_stats();
    x.layernorm_backward(bwd::LAYERNORM, &lnf, &grads, (dln, last, stats), true);
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
    let ly = BlockLayers::new(lp, bp.cx.d, bp.cx.tp_first);
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
    attention_backward(
        x,
        bp.cx.d,
        &la.attn(),
        &ga.attn(),
        recompute_attention,
        None,
    );
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

//! The Llama family (`LlamaForCausalLM`) over a [`Backend`]: pre-RMSNorm blocks, rotary
//! position embeddings on q and k (`rotate_half`), grouped-query attention, a SwiGLU MLP, no
//! biases, a tied or untied LM head. Its state is a [`Core`] like GPT-2's; its passes are
//! lists of [`Layers`] calls and the shared pieces of [`super::passes`].
//!
//! Fused operands: each block's q, k and v weights lie back to back in the parameter table
//! (`llama_params.rs`), so one GEMM writes `[q | k | v]` rows (the layout the attention ops
//! read, key/value heads after the query heads); gate and up likewise give the `[gate | up]`
//! rows SwiGLU reads. RoPE rotates the q and k heads of those rows in place after the GEMM (the
//! backward pass rotates their gradients back before the GEMM's backward), so the kept `qkv`
//! holds the rotated q and k attention used.
//!
//! Tensor parallelism (Megatron's layout, the splits declared in `llama_params.rs`): each rank
//! holds whole query heads with the key/value heads they read, its share of the MLP units and
//! of the vocabulary; the output and down projections are row-parallel and all-reduced, the
//! column-parallel layers' input gradients all-reduced, as GPT-2's.

use super::acts::{
    layered_acts_table, layered_stats_table, span, ActLayout, AttnActs, AttnGrads, AttnKeep,
    AttnKept, Carved, LossActs, Recompute, StepDims,
};
use super::contract::{GradsReady, Model, OpForm, TpRank};
use super::core::{ActSet, ActSets, Core, StepActs};
use super::decoder::{self, Blocks};
use super::decoder_ops::{backward as bwd, forward as fwd};
use super::kv::KvCache;
use super::layers::Layers;
use super::llama_params::{llama_stage_params, LlamaLayerParams, LlamaSpans};
use super::passes::{
    attention_backward, attention_form, attention_forward, embedding, embedding_backward,
    embedding_forward, lm_head_backward, project_into_residual, residual_form, rope_backward_form,
    rope_in_attention, BlockCtx, Pass,
};
use super::paths::{attention_path, residual_path, Knobs, Residual};
use super::stage::Stage;
use super::table::Table;
use crate::backend::{
    Backend, BufId, Dtype, Linear, LinearGrads, RmsNorm, RmsNormGrads, Rope, Span, TokSpan,
    WeightLayout,
};
use crate::metrics::ops::trainer;
use crate::metrics::timers::{TimerLevel, Timers};
use crate::model::ModelConfig;
use crate::ops::rope::RopeTable;
use anyhow::Result;

use TimerLevel::Coarse;

/// A Llama model on a backend: the shared [`Core`], its parameter spans, the rotary table,
/// its activations and the op forms it runs.
pub struct Llama<B: Backend> {
    pub core: Core<B>,
    attn_keep: AttnKeep,
    residual: Residual,
    p: LlamaSpans,
    g: LlamaSpans,
    /// Cosines then sines of every position (f32, `n_positions × head_size/2` each).
    rope_table: Span,
    /// One position's cosines and sines, for decoding.
    rope_one: Span,
    acts: Option<ActSets<LlamaActs, LlamaGrads>>,
}

impl<B: Backend> Llama<B> {
    /// This rank's share (`tp`, `stage`) of model `cfg` on `be` with parameters zeroed,
    /// gradients, AdamW moments, and activations in `compute`.
    pub fn new_stage(
        cfg: &ModelConfig,
        tp: TpRank,
        stage: &Stage,
        compute: Dtype,
        be: B,
    ) -> Result<Llama<B>> {
        Self::build(cfg, (tp, stage), be, true, compute)
    }

    /// The whole model with parameters only (no gradients or moments), for decoding.
    pub fn for_inference(cfg: &ModelConfig, be: B) -> Result<Llama<B>> {
        let whole = Stage::whole(cfg.n_layer);
        Self::build(cfg, (TpRank::SERIAL, &whole), be, false, Dtype::F32)
    }

    fn build(
        cfg: &ModelConfig,
        (tp, stage): (TpRank, &Stage),
        be: B,
        trainable: bool,
        compute: Dtype,
    ) -> Result<Llama<B>> {
        cfg.validate()?;
        let table = llama_stage_params(cfg, tp.size, stage)?;
        let mut core = Core::new(cfg, (tp, stage), table, be, trainable, compute)?;
        let p = LlamaSpans::new(&core.table, core.compute_params, stage, cfg.tied());
        let g = p.on(core.grads);
        let knobs = Knobs::from_env()?;
        let attn_keep = attention_path(&core.be, cfg.head_size(), compute, knobs.attention)?;
        let residual = residual_path(&core.be, compute, knobs.residual)?;
        let rope = RopeTable::<f32>::new(cfg.head_size(), cfg.n_positions, cfg.rope_base());
        let host: Vec<f32> = rope.cos.iter().chain(&rope.sin).copied().collect();
        let rope_table = core.be.alloc(host.len(), Dtype::F32)?;
        let rope_table = core.be.whole(rope_table);
        core.be.upload(rope_table, &host);
        let rope_one = core.be.alloc(2 * rope.half, Dtype::F32)?;
        let rope_one = core.be.whole(rope_one);
        Ok(Llama {
            core,
            attn_keep,
            residual,
            p,
            g,
            rope_table,
            rope_one,
            acts: None,
        })
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
        let grad = (grad_table(&d, keep), LlamaGrads::new);
        let acts = self.core.alloc_acts(
            |c| act_tables(&d, c.stage.clone(), (c.recompute, keep)),
            |a, s| LlamaActs::new(d, &stage, a, s),
            grad,
        )?;
        self.acts = Some(acts);
        Ok(())
    }

    fn acts_of(&self, micro: usize) -> &LlamaActs {
        ActSets::slot(&self.acts, micro).0
    }

    fn tokens(&self, micro: usize) -> (TokSpan, TokSpan) {
        self.core.tokens(micro, self.acts_of(micro).dims.n())
    }

    /// The rotary embedding of a pass over `d`: every position of the batch, or for one
    /// decoded token its position's angles (copied into `rope_one`).
    fn rope_for(&mut self, d: &StepDims, pass: Pass) -> Rope {
        let half = d.hs / 2;
        let heads = d.nh + d.kv;
        let table = match pass {
            Pass::Batch { .. } => self.rope_table,
            Pass::Decode { pos, .. } => {
                let sines = self.rope_table.len / 2;
                let be = &mut self.core.be;
                be.copy(
                    self.rope_one.sub(0, half),
                    self.rope_table.sub(pos * half, half),
                );
                let sin = self.rope_table.sub(sines + pos * half, half);
                be.copy(self.rope_one.sub(half, half), sin);
                self.rope_one
            }
        };
        Rope {
            table,
            n: d.n(),
            width: d.qkv_width(),
            heads,
            half,
            t: match pass {
                Pass::Batch { .. } => d.t,
                Pass::Decode { .. } => 1,
            },
        }
    }

    /// This stage's forward pass from tokens (first stage) or its input to its output (on
    /// the last stage the final norm's, and when decoding the logits; a batch's LM head runs
    /// with its loss, [`Core::head_loss`]), shared by training and decoding.
    fn forward_stage(&mut self, timers: &Timers, pass: Pass) {
        let inputs = match pass {
            Pass::Batch { micro } => self.tokens(micro).0,
            Pass::Decode { .. } => TokSpan { offset: 0, len: 1 },
        };
        self.on_blocks(pass, timers, |x, s, _| decoder::forward_stage(x, s, inputs));
    }

    /// Runs `f` with this model's layers, its pieces of `pass` ([`Blocks`]: the pass's rotary
    /// embedding, [`Self::rope_for`], among them) and the recomputation setting.
    fn on_blocks<R>(
        &mut self,
        pass: Pass,
        timers: &Timers,
        f: impl FnOnce(&mut Layers<B>, &LlamaPass, Recompute) -> R,
    ) -> R {
        let d = self.acts_of(pass.micro()).dims;
        let rope = self.rope_for(&d, pass);
        let (a, ga) = ActSets::slot(&self.acts, pass.micro());
        let c = &mut self.core;
        let s = LlamaPass {
            a,
            ga,
            p: &self.p,
            g: &self.g,
            tp_rank: c.tp.rank,
            residual: self.residual,
            pass,
            rope,
            eps: c.cfg.norm_epsilon(),
        };
        let x = &mut Layers {
            be: &mut c.be,
            comm: &*c.tp_comm,
            timers,
        };
        f(x, &s, c.recompute)
    }
}

impl<B: Backend> Model<B> for Llama<B> {
    fn core(&self) -> &Core<B> {
        &self.core
    }

    fn core_mut(&mut self) -> &mut Core<B> {
        &mut self.core
    }

    fn forms(&self) -> Vec<OpForm> {
        vec![
            attention_form(self.attn_keep, self.core.recompute),
            residual_form(self.residual),
            rope_backward_form(rope_in_attention(
                &self.core.be,
                self.attn_keep,
                self.core.cfg.head_size(),
            )),
        ]
    }

    fn set_in_flight(&mut self, k: usize) {
        self.core.set_in_flight(k, &mut self.acts);
    }

    fn set_recompute(&mut self, r: Recompute) {
        self.core.set_recompute(r, &mut self.acts);
    }

    fn set_loss_chunk(&mut self, rows: Option<usize>) {
        self.core.set_loss_chunk(rows, &mut self.acts);
    }

    fn step_shapes(&self, b: usize, t: usize) -> crate::backend::StepShapes {
        let d = self.dims(b, t);
        d.step_shapes(self.core.compute, self.attn_keep, true)
    }

    fn activation_bytes(&self, b: usize, t: usize) -> (usize, usize) {
        let d = self.dims(b, t);
        let c = &self.core;
        let tables = act_tables(&d, c.stage.clone(), (c.recompute, self.attn_keep));
        c.act_bytes(tables, grad_table(&d, self.attn_keep))
    }

    fn set_batches(&mut self, window: &[u32], micro: usize, b: usize, t: usize) -> Result<()> {
        self.core.load_batches(window, micro, b, t)?;
        self.ensure_acts(b, t)
    }

    fn stage_input(&self, micro: usize) -> Span {
        self.acts_of(micro).encoded
    }

    fn stage_output(&self, micro: usize) -> Span {
        let a = self.acts_of(micro);
        a.layers.last().map_or(a.encoded, |l| l.resid3)
    }

    fn output_grad(&self) -> Span {
        ActSets::slot(&self.acts, 0).1.dres
    }

    fn input_grad(&self) -> Span {
        ActSets::slot(&self.acts, 0).1.dres
    }

    /// With tied embeddings and several stages, the first and the last stage each hold a copy
    /// of the embedding.
    fn tied_grad(&self) -> Option<Span> {
        if self.core.stage.count == 1 || !self.core.cfg.tied() {
            return None;
        }
        self.g.embed.or(self.g.head.map(|(_, w)| w))
    }

    fn forward_micro(&mut self, micro: usize, timers: &Timers, for_backward: bool) -> Option<f32> {
        {
            let _fwd = timers.scope(trainer::phase::FORWARD, Coarse);
            self.forward_stage(timers, Pass::Batch { micro });
        }
        let (_, targets) = self.tokens(micro);
        let a = ActSets::slot(&self.acts, micro).0;
        let (h, hp) = (a.head?, self.p.head?);
        let (_, lm_head) = head_layers(hp, &a.dims, self.core.cfg.norm_epsilon());
        let head = (&lm_head, h.nf, self.g.head.map(|(_, w)| w));
        let loss = (&h.loss, &a.dims);
        Some(
            self.core
                .head_loss(loss, head, targets, timers, for_backward),
        )
    }

    fn backward_micro(&mut self, micro: usize, timers: &Timers, ready: &mut GradsReady<B>) {
        self.core.assert_trainable();
        let (inputs, _) = self.tokens(micro);
        self.on_blocks(Pass::Batch { micro }, timers, |x, s, recompute| {
            let _bwd = timers.scope(trainer::phase::BACKWARD, Coarse);
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

    /// All positions, each layer's keys and values of this rank's key/value heads only.
    fn kv_cache(&mut self) -> Result<KvCache> {
        let kv_width = self.dims(1, 1).kv_width();
        self.core.kv_cache(kv_width)
    }

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

/// The Llama family's pieces of a pass over one micro-batch ([`Blocks`]): its activations,
/// gradient scratch, parameter and gradient spans, and the pass's settings, rotary embedding
/// and norms' epsilon.
struct LlamaPass<'a, 'c> {
    a: &'a LlamaActs,
    ga: &'a LlamaGrads,
    p: &'a LlamaSpans,
    g: &'a LlamaSpans,
    tp_rank: usize,
    residual: Residual,
    pass: Pass<'c>,
    rope: Rope,
    eps: f64,
}

impl<'c> LlamaPass<'_, 'c> {
    fn block_pass(&self, layer: usize) -> BlockPass<'_, 'c> {
        BlockPass {
            cx: BlockCtx {
                d: &self.a.dims,
                tp_first: self.tp_rank == 0,
                residual: self.residual,
                pass: self.pass,
                layer,
                proj: self.a.proj,
            },
            rope: self.rope,
            eps: self.eps,
        }
    }
}

impl<B: Backend> Blocks<B> for LlamaPass<'_, '_> {
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
        self.p.layers[l].attn_norm.offset
    }

    fn embed_forward(&self, x: &mut Layers<B>, inputs: TokSpan) {
        if let Some(e) = self.p.embed {
            let emb = embedding(e, None, self.tp_rank, &self.a.dims);
            embedding_forward(x, &emb, self.a.encoded, inputs);
        }
    }

    fn block_forward(&self, x: &mut Layers<B>, l: usize, resid: Span) {
        let bp = self.block_pass(l);
        block_forward(x, &self.a.layers[l], &self.p.layers[l], resid, &bp);
    }

    fn head_forward(&self, x: &mut Layers<B>, resid: Span) {
        let (Some(h), Some(hp)) = (self.a.head, self.p.head) else {
            return;
        };
        let (norm, head) = head_layers(hp, &self.a.dims, self.eps);
        x.rmsnorm(fwd::RMSNORM, &norm, h.nf, h.nf_rstd, resid);
        if let Pass::Decode { .. } = self.pass {
            x.linear(fwd::LM_HEAD, &head, h.loss.logits, h.nf);
        }
    }

    fn head_backward(&self, x: &mut Layers<B>, last: Span) {
        if let (Some(h), Some(hp), Some(hg)) = (self.a.head, self.p.head, self.g.head) {
            head_backward(x, (&self.a.dims, self.eps), (&h, hp, hg), self.ga, last);
        }
    }

    fn block_backward(&self, x: &mut Layers<B>, l: usize, resid: Span, recompute_attention: bool) {
        let bp = self.block_pass(l);
        let (la, lp, lg) = (&self.a.layers[l], &self.p.layers[l], &self.g.layers[l]);
        block_backward(x, &bp, (la, lp, lg), self.ga, resid, recompute_attention);
    }

    fn embed_backward(&self, x: &mut Layers<B>, inputs: TokSpan) {
        if let Some(e) = self.g.embed {
            let de = embedding(e, None, self.tp_rank, &self.a.dims);
            embedding_backward(x, &de, self.ga.dres, inputs);
        }
    }
}

/// What a block's pass needs: the shared context, the rotary embedding of the pass and the
/// norms' epsilon.
struct BlockPass<'a, 'c> {
    cx: BlockCtx<'a, 'c>,
    rope: Rope,
    eps: f64,
}

/// A block's layers at a step's dims (parameter spans, or gradient spans in the same places).
struct BlockLayers {
    attn_norm: RmsNorm,
    qkv: Linear,
    o: Linear,
    mlp_norm: RmsNorm,
    gate_up: Linear,
    down: Linear,
}

impl BlockLayers {
    fn new(lp: &LlamaLayerParams, d: &StepDims, eps: f64) -> BlockLayers {
        let (n, c, f) = (d.n(), d.c, d.f);
        let norm = |w| RmsNorm { w, n, c, eps };
        let lin = |w, ic, oc| Linear {
            w,
            layout: WeightLayout::OutIn,
            bias: None,
            n,
            ic,
            oc,
        };
        BlockLayers {
            attn_norm: norm(lp.attn_norm),
            qkv: lin(lp.qkv, c, d.qkv_width()),
            o: lin(lp.o, d.local_c(), c),
            mlp_norm: norm(lp.mlp_norm),
            gate_up: lin(lp.gate_up, c, 2 * f),
            down: lin(lp.down, f, c),
        }
    }
}

/// The final norm and the LM head (vocabulary-parallel under TP).
fn head_layers((norm, w): (Span, Span), d: &StepDims, eps: f64) -> (RmsNorm, Linear) {
    let (n, c) = (d.n(), d.c);
    (
        RmsNorm { w: norm, n, c, eps },
        Linear {
            w,
            layout: WeightLayout::OutIn,
            bias: None,
            n,
            ic: c,
            oc: d.vp,
        },
    )
}

/// One block's forward pass from `resid` into `la`, its output in `la.resid3` (run again by
/// the backward pass under [`Recompute::Full`]).
fn block_forward<B: Backend>(
    x: &mut Layers<B>,
    la: &LayerActs,
    lp: &LlamaLayerParams,
    resid: Span,
    bp: &BlockPass,
) {
    let ly = BlockLayers::new(lp, bp.cx.d, bp.eps);
    x.rmsnorm(fwd::RMSNORM, &ly.attn_norm, la.n1, la.n1_rstd, resid);
    x.linear(fwd::QKV, &ly.qkv, la.qkv, la.n1);
    x.rope(fwd::ROPE, &bp.rope, la.qkv, false);
    attention_forward(x, &la.attn(), &bp.cx);
    let names = (fwd::PROJ, fwd::ATTENTION_ALLREDUCE);
    project_into_residual(x, &bp.cx, names, &ly.o, (la.resid2, resid, la.atty));
    x.rmsnorm(fwd::RMSNORM, &ly.mlp_norm, la.n2, la.n2_rstd, la.resid2);
    x.linear(fwd::MLP_MM, &ly.gate_up, la.gu, la.n2);
    x.swiglu(fwd::SWIGLU, la.h, la.gu, bp.cx.d.f);
    let names = (fwd::MLP_MM, fwd::MLP_ALLREDUCE);
    project_into_residual(x, &bp.cx, names, &ly.down, (la.resid3, la.resid2, la.h));
}

/// The last stage's backward pass from the loss gradient (in the logits) to the gradient of
/// its last block's output (`ga.dres`): the LM head, then the final norm.
fn head_backward<B: Backend>(
    x: &mut Layers<B>,
    (d, eps): (&StepDims, f64),
    (h, hp, hg): (&HeadActs, (Span, Span), (Span, Span)),
    ga: &LlamaGrads,
    last: Span,
) {
    let (norm, head) = head_layers(hp, d, eps);
    let dn = lm_head_backward(x, (&head, h.nf), &h.loss, (ga.dn, hg.1));
    let grads = RmsNormGrads {
        dinp: ga.dres,
        dw: hg.0,
    };
    x.rmsnorm_backward(bwd::RMSNORM, &norm, &grads, (dn, last, h.nf_rstd), true);
}

/// One block's backward pass: `ga.dres` holds the gradient of its output on entry and of its
/// input `resid` on return; its parameter gradients (`lg`) accumulate.
fn block_backward<B: Backend>(
    x: &mut Layers<B>,
    bp: &BlockPass,
    (la, lp, lg): (&LayerActs, &LlamaLayerParams, &LlamaLayerParams),
    ga: &LlamaGrads,
    resid: Span,
    recompute_attention: bool,
) {
    let d = bp.cx.d;
    let ly = BlockLayers::new(lp, d, bp.eps);
    let grads = |dinp, dw| LinearGrads {
        dinp: Some(dinp),
        dw,
        dbias: None,
    };
    // MLP: dres is the gradient of the block output (= resid2 + down).
    x.linear_backward(
        (bwd::MLP_MM, None),
        &ly.down,
        &grads(ga.dh, lg.down),
        ga.dres,
        la.h,
    );
    x.swiglu_backward(bwd::SWIGLU, (ga.dgu, ga.dh, la.gu), d.f);
    let names = (bwd::MLP_MM, Some(bwd::MLP_ALLREDUCE));
    x.linear_backward(names, &ly.gate_up, &grads(ga.dn, lg.gate_up), ga.dgu, la.n2);
    let norm_g = RmsNormGrads {
        dinp: ga.dres,
        dw: lg.mlp_norm,
    };
    let input = (ga.dn, la.resid2, la.n2_rstd);
    x.rmsnorm_backward(bwd::RMSNORM, &ly.mlp_norm, &norm_g, input, false);
    // Attention: dres is now the gradient of resid2 (= resid + o).
    x.linear_backward(
        (bwd::PROJ, None),
        &ly.o,
        &grads(ga.datty, lg.o),
        ga.dres,
        la.atty,
    );
    let rope = Some(&bp.rope);
    attention_backward(x, d, &la.attn(), &ga.attn(), recompute_attention, rope);
    let names = (bwd::QKV, Some(bwd::ATTENTION_ALLREDUCE));
    x.linear_backward(names, &ly.qkv, &grads(ga.dn, lg.qkv), ga.dqkv, la.n1);
    let norm_g = RmsNormGrads {
        dinp: ga.dres,
        dw: lg.attn_norm,
    };
    let input = (ga.dn, resid, la.n1_rstd);
    x.rmsnorm_backward(bwd::RMSNORM, &ly.attn_norm, &norm_g, input, false);
}

/// The Llama family's activations by name ([`ActLayout`]).
fn layout(d: &StepDims) -> ActLayout {
    let n = d.n();
    ActLayout {
        block: vec![
            ("n1", vec![n, d.c]),
            ("qkv", vec![n, d.qkv_width()]),
            ("att", vec![d.b, d.nh, d.t, d.t]),
            ("atty", vec![n, d.local_c()]),
            ("resid2", vec![n, d.c]),
            ("n2", vec![n, d.c]),
            ("gu", vec![n, 2 * d.f]),
            ("h", vec![n, d.f]),
            ("resid3", vec![n, d.c]),
        ],
        block_stats: vec!["n1_rstd", "n2_rstd"],
        head: d.head_tensors("nf"),
        head_stats: vec!["nf_rstd"],
    }
}

/// The activation and statistics tables of a step of `d` on `stage`.
pub fn act_tables(d: &StepDims, stage: Stage, (r, keep): (Recompute, AttnKeep)) -> (Table, Table) {
    let l = layout(d);
    (
        layered_acts_table(d, &stage, (r, keep), &l),
        layered_stats_table(d, &stage, keep, &l),
    )
}

/// The gradient scratch every block reuses (`datt` only with kept probabilities).
pub fn grad_table(d: &StepDims, keep: AttnKeep) -> Table {
    let n = d.n();
    let mut t = Table::default();
    t.push("dres", &[n, d.c]);
    t.push("dn", &[n, d.c]);
    t.push("dqkv", &[n, d.qkv_width()]);
    if keep == AttnKeep::Probabilities {
        t.push("datt", &[d.b, d.nh, d.t, d.t]);
    }
    t.push("datty", &[n, d.local_c()]);
    t.push("dgu", &[n, 2 * d.f]);
    t.push("dh", &[n, d.f]);
    t
}

/// One block's activations.
#[derive(Clone, Copy, Debug)]
struct LayerActs {
    n1: Span,
    n1_rstd: Span,
    /// `[q | k | v]` rows, q and k rotated.
    qkv: Span,
    att: AttnKept,
    atty: Span,
    resid2: Span,
    n2: Span,
    n2_rstd: Span,
    /// `[gate | up]` rows.
    gu: Span,
    /// `silu(gate)·up`.
    h: Span,
    resid3: Span,
}

impl LayerActs {
    fn attn(&self) -> AttnActs {
        AttnActs {
            qkv: self.qkv,
            att: self.att,
            atty: self.atty,
        }
    }
}

/// The last stage's final norm and loss tensors.
#[derive(Clone, Copy, Debug)]
struct HeadActs {
    nf: Span,
    nf_rstd: Span,
    loss: LossActs,
}

/// All activations of one micro-batch on one stage.
struct LlamaActs {
    dims: StepDims,
    bufs: [BufId; 2],
    encoded: Span,
    layers: Vec<LayerActs>,
    proj: Span,
    head: Option<HeadActs>,
}

impl LlamaActs {
    fn new(
        dims: StepDims,
        stage: &Stage,
        (table, buf): (Table, BufId),
        (stats, stats_buf): (Table, BufId),
    ) -> LlamaActs {
        let c = Carved {
            acts: (&table, buf),
            stats: (&stats, stats_buf),
        };
        let layers = (0..stage.layers.len())
            .map(|l| {
                let p = |x: &str| c.layer(l, x);
                LayerActs {
                    n1: p("n1"),
                    n1_rstd: p("n1_rstd"),
                    qkv: p("qkv"),
                    att: c.att(l),
                    atty: p("atty"),
                    resid2: p("resid2"),
                    n2: p("n2"),
                    n2_rstd: p("n2_rstd"),
                    gu: p("gu"),
                    h: p("h"),
                    resid3: p("resid3"),
                }
            })
            .collect();
        LlamaActs {
            dims,
            bufs: [buf, stats_buf],
            encoded: c.get("encoded"),
            layers,
            proj: c.get("proj"),
            head: stage.is_last().then(|| HeadActs {
                nf: c.get("nf"),
                nf_rstd: c.get("nf_rstd"),
                loss: c.loss(),
            }),
        }
    }
}

impl ActSet for LlamaActs {
    fn bufs(&self) -> Vec<BufId> {
        self.bufs.to_vec()
    }
}

impl StepActs for LlamaActs {
    fn dims(&self) -> StepDims {
        self.dims
    }
}

/// The gradient scratch.
struct LlamaGrads {
    buf: BufId,
    /// Gradient of the residual stream at the current depth.
    dres: Span,
    /// Gradient of a norm's output.
    dn: Span,
    dqkv: Span,
    datt: Option<Span>,
    datty: Span,
    dgu: Span,
    dh: Span,
}

impl LlamaGrads {
    fn new(table: Table, buf: BufId) -> LlamaGrads {
        let s = |name: &str| span(&table, buf, name);
        LlamaGrads {
            buf,
            dres: s("dres"),
            dn: s("dn"),
            dqkv: s("dqkv"),
            datt: table.get("datt").map(|_| s("datt")),
            datty: s("datty"),
            dgu: s("dgu"),
            dh: s("dh"),
        }
    }

    fn attn(&self) -> AttnGrads {
        AttnGrads {
            dqkv: self.dqkv,
            datt: self.datt,
            datty: self.datty,
        }
    }
}

impl ActSet for LlamaGrads {
    fn bufs(&self) -> Vec<BufId> {
        vec![self.buf]
    }
}

//! Compute backends: where the model's buffers live and how its ops run.
//!
//! The model never touches memory directly. It owns a few large buffers (parameters, gradients,
//! AdamW moments, activations), each one allocation carved by a [`crate::model::table::Table`],
//! and hands the backend [`Span`]s: (buffer, offset, length) triples, the llm.c pointer-into-one-
//! allocation style made explicit. A span is a plain `Copy` handle, so it means the same thing
//! for host memory (the CPU backend) and device memory (a CUDA backend: a device pointer plus an
//! offset), and the model code is identical for both.
//!
//! Ops follow the `*_forward` / `*_backward` pairs of [`crate::ops`]; the CPU backend is a thin
//! layer over them. Every op documents which outputs are overwritten and which accumulate.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
mod host_buf;
mod host_store;
pub mod knobs;

pub use crate::dtype::Dtype;
pub use crate::ops::adamw::AdamWStep;
pub use crate::ops::linear::WeightLayout;
pub use cpu::CpuBackend;
pub use device::{CudaSettings, Device};
pub use knobs::InGemm;

/// One buffer owned by a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufId(pub u32);

/// A contiguous range of elements inside one backend buffer (offset and length in elements of
/// the buffer's [`Dtype`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub buf: BufId,
    pub offset: usize,
    pub len: usize,
}

impl Span {
    /// The first `len` elements after `offset` (relative to this span).
    pub fn sub(self, offset: usize, len: usize) -> Span {
        assert!(offset + len <= self.len, "sub-span out of range");
        Span {
            buf: self.buf,
            offset: self.offset + offset,
            len,
        }
    }

    /// True when both spans touch a common element.
    /// The span's elements in its buffer.
    pub fn range(self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }

    pub fn overlaps(self, other: Span) -> bool {
        self.buf == other.buf
            && self.len > 0
            && other.len > 0
            && self.offset < other.offset + other.len
            && other.offset < self.offset + self.len
    }
}

/// One tensor (or this rank's range of one) of an AdamW step: its parameters, gradients and
/// both moments, all of one length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdamWPart {
    pub params: Span,
    pub grads: Span,
    pub m: Span,
    pub v: Span,
    /// The parameters' 16-bit compute copy (mixed precision), overwritten with the updated
    /// parameters rounded to its type, as [`Backend::copy`] would: the update writes it
    /// instead of a second pass reading the parameters again. `None` in f32 runs.
    pub compute: Option<Span>,
    /// Whether the step's weight decay applies (2-D tensors; not biases or layernorms).
    pub decay: bool,
}

impl AdamWPart {
    /// The step's hyperparameters for this part: `hp` without weight decay unless `decay`.
    pub fn step(&self, hp: &AdamWStep) -> AdamWStep {
        AdamWStep {
            weight_decay: if self.decay { hp.weight_decay } else { 0.0 },
            ..*hp
        }
    }
}

/// A range of the backend's token buffer (`u32` token ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokSpan {
    pub offset: usize,
    pub len: usize,
}

/// What sizes a backend's working memory in a training step ([`Backend::workspace_bound`]):
/// the activations' type, their `rows` (B·T) and residual `width`, and the attention's
/// per-sequence tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepShapes {
    pub act: Dtype,
    pub rows: usize,
    pub width: usize,
    /// Elements of one sequence's attention probabilities (heads·T·T; 0 when fused).
    pub scores_per_sequence: usize,
    /// Columns of one sequence's q, k, v rows.
    pub qkv_width: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Columns of the widest activation a row op takes a whole sequence of at a time (the
    /// embedding's output, C; rotary embeddings' q, k, v rows).
    pub sequence_width: usize,
}

/// Dimensions of one attention call: `b` sequences of `t` tokens, `nh` local heads of size `hs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnDims {
    pub b: usize,
    pub t: usize,
    /// Query heads.
    pub nh: usize,
    /// Key/value heads (`nh` for multi-head attention; fewer, dividing it, for grouped-query
    /// attention).
    pub kv: usize,
    pub hs: usize,
}

impl AttnDims {
    /// Multi-head attention: a key/value head per query head.
    pub fn mha(b: usize, t: usize, nh: usize, hs: usize) -> AttnDims {
        AttnDims {
            b,
            t,
            nh,
            kv: nh,
            hs,
        }
    }

    /// The ops' shape of these dimensions.
    pub fn shape(self) -> crate::ops::attention::AttnShape {
        crate::ops::attention::AttnShape {
            b: self.b,
            t: self.t,
            nh: self.nh,
            kv: self.kv,
            hs: self.hs,
        }
    }
}

/// What [`Backend::attention_forward`] wrote and its backward pass reads: `out` (B, T, NH·hs)
/// and `lse` (B, NH, T), f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusedOut {
    pub out: Span,
    pub lse: Span,
}

/// Whether a backend runs training attention fused ([`Backend::fused_attention`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedAttention {
    /// No fused kernels for this head size and type: the three-step path only.
    Unsupported,
    /// Fused attention works (a reference, or slower here): used when asked for
    /// (`FUGU_ATTENTION=fused`).
    Available,
    /// Fused attention is this backend's fast path: used unless `FUGU_ATTENTION=materialized`.
    Preferred,
}

/// Dimensions of one cross-entropy call: `n` rows of `vp` logits (in memory) of which the
/// first `v_valid` are real vocabulary, this shard starting at vocabulary id `vocab_start`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CeDims {
    pub n: usize,
    pub vp: usize,
    pub v_valid: usize,
    pub vocab_start: usize,
}

/// A linear layer as the backend runs it: `out (N, OC) = inp (N, IC) · W (+ bias)`, `W` laid
/// out as `layout` says (this rank's shard: the model passes local widths).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Linear {
    pub w: Span,
    pub layout: WeightLayout,
    pub bias: Option<Span>,
    pub n: usize,
    pub ic: usize,
    pub oc: usize,
}

/// What a linear layer's backward pass writes: `dinp` (N, IC) overwritten (`None`: not
/// needed), `dw` and `dbias` accumulated (`dbias` only for a layer with a bias).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearGrads {
    pub dinp: Option<Span>,
    pub dw: Span,
    pub dbias: Option<Span>,
}

/// A layernorm over `n` rows of `c`: its weight and bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerNorm {
    pub w: Span,
    pub bias: Span,
    pub n: usize,
    pub c: usize,
}

/// A layernorm's per-row statistics (f32, `n` each), written by the forward pass and read by
/// the backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NormStats {
    pub mean: Span,
    pub rstd: Span,
}

/// What a layernorm's backward pass accumulates: the input, weight and bias gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerNormGrads {
    pub dinp: Span,
    pub dw: Span,
    pub dbias: Span,
}

/// An RMS norm (the Llama family's): `n` rows of `c`, weight `w` (`c`), `eps` added to the
/// mean square.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNorm {
    pub w: Span,
    pub n: usize,
    pub c: usize,
    pub eps: f64,
}

/// What an RMS norm's backward pass accumulates: the input and weight gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmsNormGrads {
    pub dinp: Span,
    pub dw: Span,
}

/// Rotary embeddings (`rotate_half`, `ops/rope.rs`) of the first `heads` heads (of size
/// `2·half`) of each of `n` rows of `width` elements, row `r` at position `r % t`, by the angles
/// of `table` (f32: the cosines (positions, half), then the sines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rope {
    pub table: Span,
    pub n: usize,
    pub width: usize,
    pub heads: usize,
    pub half: usize,
    pub t: usize,
}

impl Rope {
    /// Positions the table covers.
    pub fn positions(&self) -> usize {
        self.table.len / (2 * self.half.max(1))
    }

    /// Panics unless the shapes agree: the heads fit the rows, the table covers `t`.
    pub fn check(&self, x: Span, op: &str) {
        assert!(
            x.len == self.n * self.width
                && self.heads * 2 * self.half <= self.width
                && self.t <= self.positions()
                && self.table.len == 2 * self.positions() * self.half,
            "{op}: {self:?} does not fit x of {} elements",
            x.len
        );
    }
}

/// The embedding of `b` sequences of `t` tokens into width `c`: the token table `wte` (this
/// rank's vocabulary rows from `vocab_start`) and the position table `wpe` (on one rank of a
/// tensor-parallel group; `None` on the others). The backward pass takes the gradients'
/// spans in the same places.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Embedding {
    pub wte: Span,
    pub wpe: Option<Span>,
    pub vocab_start: usize,
    pub b: usize,
    pub t: usize,
    pub c: usize,
}

/// The per-row statistics of the cross-entropy (f32, N each): the all-reduced row maxima, the
/// sums of exponentials relative to them, and the target logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CeRows {
    pub maxes: Span,
    pub sums: Span,
    pub tl: Span,
}

/// A key/value cache as one decoding step reads it: (P ≥ len, nh·hs) keys and values, the new
/// token's own at row `len - 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRows {
    pub k: Span,
    pub v: Span,
    pub len: usize,
}

/// The operations a GPT-2 training step needs. Shapes are row-major; see [`crate::ops`] for the
/// exact semantics of each op, which every backend must reproduce.
pub trait Backend: 'static {
    /// Short name for logs (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// Allocates a zero-filled buffer of `len` elements of type `dtype`.
    fn alloc(&mut self, len: usize, dtype: Dtype) -> anyhow::Result<BufId>;
    /// Releases a buffer's memory; its id must not be used again.
    fn free(&mut self, buf: BufId);
    /// Length of a buffer in elements.
    fn buf_len(&self, buf: BufId) -> usize;
    /// Element type of a buffer.
    fn buf_dtype(&self, buf: BufId) -> Dtype;
    /// The whole buffer as a span.
    fn whole(&self, buf: BufId) -> Span {
        Span {
            buf,
            offset: 0,
            len: self.buf_len(buf),
        }
    }
    /// Copies host data into a span (`src.len() == dst.len`), rounded to the span's type.
    fn upload(&mut self, dst: Span, src: &[f32]);
    /// Copies a span to host memory (`dst.len() == src.len`), widened to `f32` (exact).
    fn download(&self, src: Span, dst: &mut [f32]);
    /// Runs `f` on a host view of `s` that it may read and write (used to hand buffers to
    /// MPI). Host backends lend their memory; the default stages through a host copy.
    fn with_host(&mut self, s: Span, f: &mut dyn FnMut(&mut [f32])) {
        let mut tmp = vec![0.0; s.len];
        self.download(s, &mut tmp);
        f(&mut tmp);
        self.upload(s, &tmp);
    }
    /// The address of f32 span `s` in the device's memory, for a collective that reads and
    /// writes it there (a CUDA-aware MPI; wait for the work queued before with [`Self::sync`]
    /// first); `None` where buffers are host memory (lent by [`Self::with_host`]).
    fn device_address(&self, _s: Span) -> Option<u64> {
        None
    }
    /// Sets a span to zero.
    fn zero(&mut self, s: Span);
    /// `dst = src` (same length, not overlapping), converted to `dst`'s type when the two
    /// buffers' types differ (the master → compute-copy refresh of mixed precision).
    fn copy(&mut self, dst: Span, src: Span);
    /// Replaces the token buffer (inputs and targets of a step).
    fn set_tokens(&mut self, tokens: &[u32]);
    /// The device in words, for logs and the metrics header.
    fn describe(&self) -> String {
        self.name().to_string()
    }
    /// Settings that pick between kernels for the same op (name, value), for the metrics
    /// header (`"kernels"`): a run records which ran, since the forms may differ by rounding.
    fn kernel_settings(&self) -> Vec<(&'static str, String)> {
        Vec::new()
    }
    /// The device's peak in GFLOP/s for GEMMs whose operands are stored in `compute` (f32,
    /// or the 16-bit type of mixed precision), and where it comes from, for MFU; `None` for
    /// the host CPU, whose peak [`crate::metrics::machine::MachineInfo`] measures.
    fn peak_gflops(&self, _compute: Dtype) -> Option<(f64, String)> {
        None
    }
    /// The device's peak memory bandwidth in GB/s and where it comes from, the breakdown's
    /// roof for its per-op GB/s (the CPU's is measured: may take half a second); `None` when
    /// unknown.
    fn peak_gbs(&self) -> Option<(f64, String)> {
        None
    }
    /// Bytes this backend can still allocate, if known (checked before large allocations so
    /// that an impossible batch is refused up front).
    fn free_memory(&self) -> Option<u64> {
        None
    }
    /// Bytes of working memory the backend holds beside its buffers (the CPU's stage for
    /// 16-bit spans, `backend/host_store.rs`), for the end-of-run memory line.
    fn workspace_bytes(&self) -> u64 {
        0
    }
    /// The most [`Self::workspace_bytes`] a step of these shapes can make the backend hold,
    /// for the up-front memory check and the header (0: none beside its buffers).
    fn workspace_bound(&self, _step: &StepShapes) -> u64 {
        0
    }
    /// Waits for queued work (no-op on the CPU).
    fn sync(&self) {}
    /// The device's clock, for fine timers to time ops on the device's timeline instead of
    /// the host's ([`crate::metrics::timers::Timers::set_device_clock`]): kernel times, not
    /// launch times. `None` when ops complete before they return (CPU).
    fn device_clock(&self) -> Option<Box<dyn crate::metrics::timers::DeviceClock>> {
        None
    }

    // --- embedding -----------------------------------------------------------------------
    /// `out (B,T,C) = wte[tokens] (+ wpe[t])`; tokens outside this vocabulary shard give 0.
    fn encoder_forward(&mut self, e: &Embedding, out: Span, tokens: TokSpan);
    /// Accumulates embedding gradients into `de`'s tables (the gradients' spans).
    fn encoder_backward(&mut self, de: &Embedding, dout: Span, tokens: TokSpan);

    // --- layernorm -----------------------------------------------------------------------
    /// `out` and `stats` overwritten.
    fn layernorm_forward(&mut self, ln: &LayerNorm, out: Span, stats: NormStats, inp: Span);
    /// `g.dinp`, `g.dw`, `g.dbias` accumulate.
    fn layernorm_backward(
        &mut self,
        ln: &LayerNorm,
        g: &LayerNormGrads,
        dout: Span,
        inp: Span,
        stats: NormStats,
    );

    // --- linear --------------------------------------------------------------------------
    /// `out` overwritten.
    fn linear_forward(&mut self, l: &Linear, out: Span, inp: Span);
    /// `g.dinp` is overwritten; `g.dw` and `g.dbias` accumulate.
    fn linear_backward(&mut self, l: &Linear, g: &LinearGrads, dout: Span, inp: Span);

    /// Whether this backend can add a linear layer's output to the residual stream inside
    /// its GEMM for activations stored as `dt` (cuBLASLt reading the stream as its C matrix):
    /// [`Self::linear_residual_forward`] then costs the GEMM's pass alone.
    fn residual_epilogue(&self, _dt: Dtype) -> bool {
        false
    }
    /// A linear layer whose output joins the residual stream: `out (N, OC) = resid + inp·W
    /// (+ bias)`, overwritten (`out` and `resid` apart). By default two ops through `scratch`
    /// (N·OC of the activation type, overwritten: [`linear_then_residual`]); in a residual
    /// epilogue ([`Self::residual_epilogue`]) the f32 sum is rounded once, so a 16-bit `out`
    /// may differ from the two ops' by a step of its type.
    fn linear_residual_forward(
        &mut self,
        l: &Linear,
        out: Span,
        resid: Span,
        scratch: Span,
        inp: Span,
    ) {
        linear_then_residual(self, l, out, resid, scratch, inp);
    }

    /// Whether this backend computes the MLP's GELU inside its GEMMs for activations stored
    /// as `dt` (cuBLASLt's epilogues): [`Self::linear_gelu_forward`] and
    /// [`Self::gelu_linear_backward`] then each cost one GEMM's pass over the activations,
    /// and the model times them as the GEMM they are.
    fn gelu_epilogue(&self, _dt: Dtype) -> bool {
        false
    }
    /// A linear layer and the GELU after it (the MLP's first half): `pre (N, OC) = inp·W
    /// (+ bias)` and `out = gelu(pre)`, both overwritten. By default the two ops
    /// ([`linear_then_gelu`]); in a GELU epilogue ([`Self::gelu_epilogue`]) GELU reads the f32
    /// sum before it is rounded into `pre`, so a 16-bit `out` may differ from the two ops'
    /// by a step of its type.
    fn linear_gelu_forward(&mut self, l: &Linear, out: Span, pre: Span, inp: Span) {
        linear_then_gelu(self, l, out, pre, inp);
    }
    /// [`Self::linear_backward`] of a layer whose input is `inp = gelu(pre)` (N, IC), carried
    /// back through the GELU: `dpre = (dout·Wᵀ) ⊙ gelu'(pre)` overwritten (`g.dinp`, which
    /// must be given), `g.dw` and `g.dbias` accumulate. `scratch` (N·IC of the activation type) may be overwritten: by default the
    /// gradient at GELU's output goes there between the two ops
    /// ([`linear_then_gelu_backward`]); a GELU epilogue never stores it (and rounds `dpre`
    /// once instead of twice).
    fn gelu_linear_backward(
        &mut self,
        l: &Linear,
        g: &LinearGrads,
        scratch: Span,
        dout: Span,
        inp: Span,
        pre: Span,
    ) {
        linear_then_gelu_backward(self, l, g, scratch, dout, inp, pre);
    }

    // --- attention -----------------------------------------------------------------------
    /// `att (B,NH,T,T) = QKᵀ/√hs` (the Megatron `baddbmm`) on and below the diagonal; entries
    /// above it (key after query) may be left unwritten: a backend may skip that work.
    fn attention_scores(&mut self, att: Span, qkv: Span, d: AttnDims);
    /// Causal softmax of each row of `att`, in place: reads only entries on and below the
    /// diagonal and writes them; above it, writes the zeros its own [`Self::attention_values`]
    /// and backward GEMMs read (the CPU: the whole row; CUDA: up to the end of its causal
    /// block; entries beyond are unspecified).
    fn attention_softmax(&mut self, att: Span, d: AttnDims);
    /// `out (B,T,NH·hs) = att·V` (the Megatron `bmm`).
    fn attention_values(&mut self, out: Span, att: Span, qkv: Span, d: AttnDims);
    /// `datt` overwritten on and below the diagonal (above it may be left unwritten, as in
    /// [`Self::attention_scores`]); the V columns of `dqkv` overwritten.
    fn attention_values_backward(
        &mut self,
        datt: Span,
        dqkv: Span,
        dout: Span,
        att: Span,
        qkv: Span,
        d: AttnDims,
    );
    /// Turns d(att) into d(pre-softmax scores), in place: reads entries on and below the
    /// diagonal; above it, zeros as [`Self::attention_softmax`] writes them.
    fn attention_softmax_backward(&mut self, datt: Span, att: Span, d: AttnDims);
    /// The Q and K columns of `dqkv` overwritten.
    fn attention_scores_backward(&mut self, dqkv: Span, datt: Span, qkv: Span, d: AttnDims);
    /// Whether (and how willingly) this backend runs causal attention fused for heads of size
    /// `hs` stored as `dt`: [`Self::attention_forward`] and [`Self::attention_backward`], which
    /// keep a log-sum-exp per row instead of the (B, NH, T, T) probabilities.
    fn fused_attention(&self, hs: usize, dt: Dtype) -> FusedAttention;
    /// Fused causal attention (FlashAttention): `out (B,T,NH·hs) = softmax(QKᵀ/√hs)·V`
    /// overwritten, as [`Self::attention_scores`], [`Self::attention_softmax`] and
    /// [`Self::attention_values`] compute it, and `lse (B,NH,T)` (f32) overwritten with each
    /// row's `log Σ_{j≤i} exp(s_ij)` of the scaled scores `s`. Only where
    /// [`Self::fused_attention`] is not `Unsupported`.
    fn attention_forward(&mut self, out: Span, lse: Span, qkv: Span, d: AttnDims);
    /// Backward of [`Self::attention_forward`] from its `out` and `lse`: the Q, K and V columns
    /// of `dqkv` overwritten (the probabilities recomputed as `exp(s_ij − lse_i)`). With
    /// `rope` (the rotary embedding `qkv`'s q and k heads went through), the Q and K columns
    /// then rotated back as [`Self::rope_backward`] would: the gradients of the heads before
    /// rotation, the same values.
    fn attention_backward(
        &mut self,
        dqkv: Span,
        dout: Span,
        fwd: FusedOut,
        qkv: Span,
        d: AttnDims,
        rope: Option<&Rope>,
    );
    /// Whether [`Self::attention_backward`] rotates the gradients back in its own stores (no
    /// pass of their own over dQ and dK) for heads of `hs`: a model then hands it the rotary
    /// embedding instead of running [`Self::rope_backward`] after it.
    fn rope_in_attention_backward(&self, _hs: usize) -> bool {
        false
    }
    /// One new token attending over a key/value cache (incremental decoding): `out (nh·hs)`
    /// overwritten with `softmax(q·K[0..len]ᵀ/√hs)·V[0..len]` per head ([`KvRows`]: the
    /// new token's own key and value already at row `len - 1`; `kv·hs` wide rows, query head
    /// `h` reading key/value head `h / (nh / kv)`); `d` gives the heads (`b = t = 1`).
    fn attention_decode(&mut self, out: Span, q: Span, kv: KvRows, d: AttnDims);

    // --- the Llama family: RMS norm, rotary embeddings, SwiGLU ----------------------------
    /// `out` (n, c) and `rstd` (n, f32) overwritten (`ops/rmsnorm.rs`).
    fn rmsnorm_forward(&mut self, r: &RmsNorm, out: Span, rstd: Span, inp: Span);
    /// `g.dinp` and `g.dw` accumulate.
    fn rmsnorm_backward(
        &mut self,
        r: &RmsNorm,
        g: &RmsNormGrads,
        dout: Span,
        inp: Span,
        rstd: Span,
    );
    /// Rotates `x`'s heads in place (`ops/rope.rs`).
    fn rope_forward(&mut self, r: &Rope, x: Span);
    /// Rotates the gradient `dx` of rotated heads back in place.
    fn rope_backward(&mut self, r: &Rope, dx: Span);
    /// `out (n, f) = silu(gate)·up` of `inp (n, 2f)` rows `[gate | up]`, overwritten.
    fn swiglu_forward(&mut self, out: Span, inp: Span, f: usize);
    /// `dinp (n, 2f)` overwritten with `[dgate | dup]`.
    fn swiglu_backward(&mut self, dinp: Span, dout: Span, inp: Span, f: usize);

    // --- pointwise -----------------------------------------------------------------------
    fn gelu_forward(&mut self, out: Span, inp: Span);
    /// `dinp` overwritten.
    fn gelu_backward(&mut self, dinp: Span, inp: Span, dout: Span);
    /// `out = a + b`.
    fn residual_forward(&mut self, out: Span, a: Span, b: Span);
    /// `acc += x`.
    fn add_inplace(&mut self, acc: Span, x: Span);
    /// `x *= factor`, each element rounded once to its type (in f32: the host's `*x *= factor`).
    fn scale_inplace(&mut self, x: Span, factor: f32);

    // --- fused softmax cross-entropy, in phases (vocabulary-parallel TP all-reduces between),
    // or as one op for one shard ---
    /// This shard's row maxima and sums of exponentials relative to them (one pass on a GPU).
    fn ce_row_stats(&mut self, maxes: Span, sums: Span, logits: Span, d: CeDims);
    /// `sums` from this shard's `local_maxes` to the all-reduced `maxes` (N each).
    fn ce_rescale_sums(&mut self, sums: Span, local_maxes: Span, maxes: Span);
    fn ce_target_logit(&mut self, tl: Span, logits: Span, targets: TokSpan, d: CeDims);
    /// Per-row losses, and (when `dloss` is `Some`) the logits overwritten by their gradient.
    fn ce_finish(
        &mut self,
        losses: Span,
        logits: Span,
        rows: CeRows,
        targets: TokSpan,
        dloss: Option<f32>,
        d: CeDims,
    );
    /// The phases as one op where the logits hold the whole vocabulary (`d.vocab_start` 0,
    /// no tensor parallelism: nothing to all-reduce between phases): `rows` **overwritten**
    /// with the row statistics, the per-row losses, and with `dloss` the logits overwritten by
    /// their gradient. The same values, bit for bit, as [`Self::ce_row_stats`],
    /// [`Self::ce_target_logit`] and [`Self::ce_finish`] in turn, which a backend may run;
    /// one op lets it finish each row while the row is in cache instead (the CPU backend;
    /// the CUDA backend's `FUGU_CROSS_ENTROPY=fused`), reading the logits from memory once.
    fn ce_whole_vocab(
        &mut self,
        losses: Span,
        logits: Span,
        rows: CeRows,
        targets: TokSpan,
        dloss: Option<f32>,
        d: CeDims,
    );

    // --- optimizer -----------------------------------------------------------------------
    /// Σ x² of each span, in f64, deterministic (all spans in one call, so a device backend
    /// synchronises once per gradient norm).
    fn sum_of_squares(&mut self, xs: &[Span]) -> Vec<f64>;
    /// One AdamW step on every part (a device backend updates them all in one launch), each
    /// part's compute copy refreshed; `hp.weight_decay` applies to the parts marked `decay`.
    /// Parameters, gradients and moments are f32.
    fn adamw(&mut self, parts: &[AdamWPart], hp: &AdamWStep);
}

/// [`Backend::linear_residual_forward`] as two ops: [`Backend::linear_forward`] into
/// `scratch`, then [`Backend::residual_forward`].
pub fn linear_then_residual<B: Backend + ?Sized>(
    be: &mut B,
    l: &Linear,
    out: Span,
    resid: Span,
    scratch: Span,
    inp: Span,
) {
    be.linear_forward(l, scratch, inp);
    be.residual_forward(out, resid, scratch);
}

/// [`Backend::linear_gelu_forward`] as two ops: [`Backend::linear_forward`] into `pre`, then
/// [`Backend::gelu_forward`].
pub fn linear_then_gelu<B: Backend + ?Sized>(
    be: &mut B,
    l: &Linear,
    out: Span,
    pre: Span,
    inp: Span,
) {
    be.linear_forward(l, pre, inp);
    be.gelu_forward(out, pre);
}

/// [`Backend::gelu_linear_backward`] as two ops: [`Backend::linear_backward`] with the input
/// gradient into `scratch`, then [`Backend::gelu_backward`] from it into `g.dinp`.
pub fn linear_then_gelu_backward<B: Backend + ?Sized>(
    be: &mut B,
    l: &Linear,
    g: &LinearGrads,
    scratch: Span,
    dout: Span,
    inp: Span,
    pre: Span,
) {
    let dpre = g
        .dinp
        .expect("gelu_linear_backward writes the GELU's input gradient");
    let to_scratch = LinearGrads {
        dinp: Some(scratch),
        ..*g
    };
    be.linear_backward(l, &to_scratch, dout, inp);
    be.gelu_backward(dpre, pre, scratch);
}

//! The CPU backend: buffers are host memory on cache-line boundaries in their own type
//! ([`HostStore`]: `f32`, or 16-bit floats in half the bytes), GEMMs go to fugu-gemm, the
//! other ops to the rayon kernels of [`crate::ops`], all on `f32` views.

use super::host_store::{Chunks, HostStore, Rows, Stored, StoredMut, ROW_CHUNK};
use super::{
    AdamWPart, AdamWStep, AttnDims, Backend, BufId, CeDims, CeRows, Dtype, Embedding,
    FusedAttention, FusedOut, KvRows, LayerNorm, LayerNormGrads, Linear, LinearGrads, NormStats,
    RmsNorm, RmsNormGrads, Rope, Span, StepShapes, TokSpan,
};
use crate::ops;
use anyhow::Result;

/// `$body` with each `$x` bound to the slice of its [`Stored`] operand, all of one type (a
/// GEMM's operands share their 16-bit type: `CpuBackend::gemm_precision`; one operand, any).
macro_rules! same_stored {
    (($($s:expr),+), |$($x:ident),+| $body:expr) => {{
        // A block, so that the macro is an expression wherever it is used (a closure's body).
        #[allow(unreachable_patterns)]
        let out = match ($($s,)+) {
            ($(Stored::F32($x),)+) => $body,
            ($(Stored::Bf16($x),)+) => $body,
            ($(Stored::F16($x),)+) => $body,
            _ => unreachable!("GEMM operands of one type (gemm_precision)"),
        };
        out
    }};
}

/// `$body` with each `$o` bound to the slice of a written [`StoredMut`] and each `$x` to that
/// of a [`Stored`] operand, all of one type (checked by the caller: `one_type`).
macro_rules! same_stored_mut {
    (($($o:expr),+), ($($s:expr),+), |($($ox:ident),+), $($x:ident),+| $body:expr) => {{
        #[allow(unreachable_patterns)]
        let out = match ($($o,)+ $($s,)+) {
            ($(StoredMut::F32($ox),)+ $(Stored::F32($x),)+) => $body,
            ($(StoredMut::Bf16($ox),)+ $(Stored::Bf16($x),)+) => $body,
            ($(StoredMut::F16($ox),)+ $(Stored::F16($x),)+) => $body,
            _ => unreachable!("operands of one type (one_type)"),
        };
        out
    }};
}

/// Host-memory backend.
#[derive(Default)]
pub struct CpuBackend {
    /// Every buffer in its type; a `bf16`/`f16` one is stored in 16 bits and seen by the ops
    /// as `f32`s, what they write rounded to the type, so low-precision runs compute in `f32`
    /// on exactly the values a device would store (the reference for the CUDA backend's
    /// low-precision kernels) and keep 16-bit activations in half the memory.
    mem: HostStore,
    tokens: Vec<u32>,
}

impl CpuBackend {
    pub fn new() -> CpuBackend {
        CpuBackend::default()
    }

    /// The arithmetic of a GEMM on these operand spans: their 16-bit type when they all share
    /// one (the operands are then values of that type, so fugu-gemm's bf16 kernel runs them
    /// exactly as a tensor core would: exact products, f32 sums), otherwise f32.
    fn gemm_precision(&self, operands: &[Span]) -> ops::Precision {
        let mut dts = operands.iter().map(|s| self.mem.dtype(s.buf));
        let first = dts.next().unwrap_or(Dtype::F32);
        if dts.all(|d| d == first) {
            first.precision()
        } else {
            ops::Precision::F32
        }
    }

    /// The type every span is of, if they share one.
    fn one_type(&self, spans: &[Span]) -> Option<Dtype> {
        let first = spans.first().map_or(Dtype::F32, |s| self.mem.dtype(s.buf));
        spans
            .iter()
            .all(|s| self.mem.dtype(s.buf) == first)
            .then_some(first)
    }

    /// Whether every span is of one 16-bit type.
    fn one_16bit_type(&self, spans: &[Span]) -> bool {
        self.one_type(spans).is_some_and(|d| d != Dtype::F32)
    }

    /// `out = resid + inp·W + bias`, `resid` and `bias` each optional: the linear layers
    /// ([`ops::linear::linear_forward`], or its residual form).
    fn linear_onto(&mut self, l: &Linear, out: Span, resid: Option<Span>, inp: Span) {
        let Linear {
            w,
            layout,
            bias,
            n,
            ic,
            oc,
        } = *l;
        let prec = self.gemm_precision(&[inp, w]);
        // An absent span goes to the op as an empty one (of `out`'s buffer).
        let none = out.sub(0, 0);
        let (r, b) = (resid.unwrap_or(none), bias.unwrap_or(none));
        if self.one_type(&[out, r, inp, w, b]).is_some() {
            // Every operand as stored; `out` written once, each element rounded from its f32
            // sum in fugu-gemm's tile (a 16-bit `out` has no f32 copy: the LM head's logits
            // are the largest tensor of a step; an f32 one is written to memory once, not
            // once per k block).
            return self
                .mem
                .run_stored([out], [r, inp, w, b], |[o], [r, i, w, b]| {
                    same_stored_mut!((o), (r, i, w, b), |(o), r, i, w, b| {
                        let (r, b) = (resid.map(|_| &*r), bias.map(|_| &*b));
                        ops::linear::linear_into(prec, o, r, i, w, layout, b, n, ic, oc)
                    })
                });
        }
        self.mem.run([out], [r, inp, w, b], |[o], [r, i, w, b]| {
            let b = bias.map(|_| &*b);
            match resid {
                Some(_) => {
                    ops::linear::linear_residual_forward(prec, o, r, i, w, layout, b, n, ic, oc)
                }
                None => ops::linear::linear_forward(prec, o, i, w, layout, b, n, ic, oc),
            }
        });
    }

    /// [`Backend::rope_forward`] (`forward`) or its backward, in place on `x`.
    fn rope(&mut self, r: &Rope, x: Span, forward: bool) {
        r.check(x, "rope");
        // Chunks of whole sequences: a row's position is its index within one.
        let seq = if r.n.is_multiple_of(r.t.max(1)) {
            r.t.max(1)
        } else {
            r.n.max(1)
        };
        let (units, width) = (r.n / seq, seq * r.width);
        self.mem.run_rows(
            Chunks::Cache,
            units,
            [Rows::of(x, width)],
            [Rows::whole(r.table)],
            |_, [x_], [table]| {
                let (cos, sin) = table.split_at(table.len() / 2);
                let view = ops::RopeView {
                    half: r.half,
                    cos,
                    sin,
                };
                if forward {
                    ops::rope_forward(x_, r.width, r.heads, r.t, view);
                } else {
                    ops::rope_backward(x_, r.width, r.heads, r.t, view);
                }
            },
        );
    }

    /// A norm's backward pass over `n` rows in [`ops::ROW_BLOCK`]-row blocks (16-bit rows staged
    /// a block at a time, in cache): `op` accumulates the input gradient `dinp` of its rows and
    /// overwrites their blocks' partial parameter gradients (`per_block` each); returns every
    /// block's partials, for the caller to add in block order (`ops::add_block_partials`), so
    /// the sums are those of one call on every row.
    fn norm_backward_blocks<const R: usize>(
        &mut self,
        n: usize,
        per_block: usize,
        dinp: Rows,
        read: [Rows; R],
        op: impl for<'a> Fn(&'a mut [f32], &'a mut [f32], [&'a [f32]; R]) + Sync,
    ) -> Vec<f32> {
        let partials = std::sync::Mutex::new(ops::block_partials::<f32>(n, per_block));
        let block = ops::ROW_BLOCK;
        self.mem
            .run_rows(Chunks::Rows(block), n, [dinp], read, |rows, [di], r| {
                // The rows start a block (f32 spans: all of them in one call).
                let blocks = rows.start / block..rows.end.div_ceil(block);
                let mut own = ops::block_partials::<f32>(rows.len(), per_block);
                op(di, &mut own, r);
                let mut all = partials.lock().unwrap_or_else(|e| e.into_inner());
                all[blocks.start * per_block..blocks.end * per_block].copy_from_slice(&own);
            });
        partials.into_inner().unwrap_or_else(|e| e.into_inner())
    }

    /// The three-step attention's batched GEMMs where they cannot write as stored (f32, mixed
    /// types, or grouped keys' gradients, summed over a group in f32), one sequence at a time:
    /// their operands `g` read as stored when they share a 16-bit type (`prec`), so only what
    /// they write is staged; otherwise on `f32` views of every operand, in one call.
    fn attention_gemms<const W: usize, const G: usize>(
        &mut self,
        prec: ops::Precision,
        d: AttnDims,
        w: [Rows; W],
        g: [Rows; G],
        op: impl for<'a> Fn(std::ops::Range<usize>, [&'a mut [f32]; W], [Stored<'a>; G]) + Sync,
    ) {
        if prec != ops::Precision::F32 {
            return self.mem.run_rows_stored(
                Chunks::Serial(1),
                d.b,
                w,
                [],
                g,
                |rows, wv, [], gv| op(rows, wv, gv),
            );
        }
        self.mem
            .run_rows(Chunks::Serial(1), d.b, w, g, |rows, wv, rv| {
                op(rows, wv, rv.map(Stored::F32))
            });
    }
}

/// An attention tensor (B sequences of anything) in rows of one sequence each: attention is
/// computed per sequence, so the ops run on chunks of whole sequences.
fn per_sequence(s: Span, d: AttnDims) -> Rows {
    Rows::of(s, s.len / d.b.max(1))
}

/// The shape of attention over `rows` of the sequences of `d`.
fn sequences(d: AttnDims, rows: std::ops::Range<usize>) -> ops::attention::AttnShape {
    ops::attention::AttnShape {
        b: rows.len(),
        ..d.shape()
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    /// The peak of fugu-gemm's native kernel for `compute` (the AVX-512 BF16 kernel does two
    /// multiply-adds per lane and instruction), measured now; `None` where GEMMs of that type
    /// run on the f32 FMAs, whose peak the caller already has.
    fn peak_gflops(&self, compute: Dtype) -> Option<(f64, String)> {
        let rt = fugu_gemm::Runtime::global().ok()?;
        let prec = compute.precision();
        let peak = fugu_gemm::peak::measured_native_peak(&rt.kernel_at(prec), prec, rt.threads())?;
        Some((peak.total_gflops(), peak.describe()))
    }

    /// The in-place triad bandwidth of the threads the ops run on, cached per machine.
    fn peak_gbs(&self) -> Option<(f64, String)> {
        crate::metrics::machine::memory_bandwidth()
    }

    fn alloc(&mut self, len: usize, dtype: Dtype) -> Result<BufId> {
        self.mem.alloc(len, dtype)
    }

    fn free(&mut self, buf: BufId) {
        self.mem.free(buf);
    }

    fn buf_len(&self, buf: BufId) -> usize {
        self.mem.len(buf)
    }

    fn buf_dtype(&self, buf: BufId) -> Dtype {
        self.mem.dtype(buf)
    }

    fn free_memory(&self) -> Option<u64> {
        crate::metrics::machine::host_memory_available()
    }

    fn workspace_bytes(&self) -> u64 {
        self.mem.stage_bytes() as u64
    }

    /// The stages 16-bit activations need (`host_store.rs`), in f32s: one sequence's
    /// attention probabilities with its q, k, v gradient (the three-step attention's backward
    /// GEMMs with grouped keys and values, a sequence at a time), plus the largest span staged whole (the embedding's output
    /// gradient, a tensor-parallel all-reduce: rows × width), plus the row chunks in flight
    /// (each at most six row spans of `ROW_CHUNK` elements, a norm's block of rows, or one
    /// sequence's rows; twice the threads, for the rayon tasks a waiting thread may start).
    /// None with f32 activations. The linear layers stage nothing (fugu-gemm writes their
    /// 16-bit outputs from f32 tiles of its own, which, like its packing buffers, are not
    /// counted here).
    fn workspace_bound(&self, s: &StepShapes) -> u64 {
        if s.act == Dtype::F32 {
            return 0;
        }
        let attention = s.scores_per_sequence + s.t * s.qkv_width;
        let whole = s.rows * s.width;
        let row_chunk = (6 * ROW_CHUNK)
            .max(3 * ops::ROW_BLOCK * s.width)
            .max(s.t * s.sequence_width);
        let in_flight = 2 * rayon::current_num_threads() * row_chunk;
        4 * (attention + whole + in_flight) as u64
    }

    fn upload(&mut self, dst: Span, src: &[f32]) {
        self.mem.upload(dst, src);
    }

    fn download(&self, src: Span, dst: &mut [f32]) {
        self.mem.download(src, dst);
    }

    fn with_host(&mut self, s: Span, f: &mut dyn FnMut(&mut [f32])) {
        self.mem.run([s], [], |[x], []| f(x));
    }

    fn zero(&mut self, s: Span) {
        self.mem.zero(s);
    }

    fn copy(&mut self, dst: Span, src: Span) {
        self.mem.copy(dst, src);
    }

    fn set_tokens(&mut self, tokens: &[u32]) {
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
    }

    fn encoder_forward(&mut self, e: &Embedding, out: Span, tokens: TokSpan) {
        let Embedding {
            wte,
            wpe,
            vocab_start,
            b,
            t,
            c,
        } = *e;
        let toks = &self.tokens[tokens.offset..tokens.offset + tokens.len];
        // Chunks of whole sequences (a position's embedding depends on its index in one).
        let toks = |rows: &std::ops::Range<usize>| &toks[rows.start * t..rows.end * t];
        // The token table read as stored (its rows widened as they are gathered: a 16-bit
        // table is not staged whole).
        let (o, table) = ([Rows::of(out, t * c)], [Rows::whole(wte)]);
        match wpe {
            Some(wpe) => self.mem.run_rows_stored(
                Chunks::Cache,
                b,
                o,
                [Rows::whole(wpe)],
                table,
                |rows, [o], [p], [e]| {
                    let (tk, n) = (toks(&rows), rows.len());
                    same_stored!((e), |e| {
                        ops::encoder::encoder_forward(o, tk, e, vocab_start, Some(p), n, t, c)
                    })
                },
            ),
            None => {
                self.mem
                    .run_rows_stored(Chunks::Cache, b, o, [], table, |rows, [o], [], [e]| {
                        let (tk, n) = (toks(&rows), rows.len());
                        same_stored!((e), |e| {
                            ops::encoder::encoder_forward(o, tk, e, vocab_start, None, n, t, c)
                        })
                    })
            }
        }
    }

    fn encoder_backward(&mut self, de: &Embedding, dout: Span, tokens: TokSpan) {
        let Embedding {
            wte: dwte,
            wpe: dwpe,
            vocab_start,
            b,
            t,
            c,
        } = *de;
        let toks = &self.tokens[tokens.offset..tokens.offset + tokens.len];
        match dwpe {
            Some(dwpe) => self.mem.run([dwte, dwpe], [dout], |[de, dp], [d]| {
                ops::encoder::encoder_backward(de, Some(dp), d, toks, vocab_start, b, t, c)
            }),
            None => self.mem.run([dwte], [dout], |[de], [d]| {
                ops::encoder::encoder_backward(de, None, d, toks, vocab_start, b, t, c)
            }),
        }
    }

    fn layernorm_forward(&mut self, ln: &LayerNorm, out: Span, stats: NormStats, inp: Span) {
        let LayerNorm { w, bias, n, c } = *ln;
        let NormStats { mean, rstd } = stats;
        self.mem.run_rows(
            Chunks::Cache,
            n,
            [Rows::of(out, c), Rows::of(mean, 1), Rows::of(rstd, 1)],
            [Rows::of(inp, c), Rows::whole(w), Rows::whole(bias)],
            |rows, [o, m, r], [i, w, bi]| {
                ops::layernorm::layernorm_forward(o, m, r, i, w, bi, rows.len(), c)
            },
        );
    }

    fn layernorm_backward(
        &mut self,
        ln: &LayerNorm,
        g: &LayerNormGrads,
        dout: Span,
        inp: Span,
        stats: NormStats,
    ) {
        let LayerNorm { w, n, c, .. } = *ln;
        let LayerNormGrads { dinp, dw, dbias } = *g;
        let NormStats { mean, rstd } = stats;
        let read = [
            Rows::of(dout, c),
            Rows::of(inp, c),
            Rows::whole(w),
            Rows::of(mean, 1),
            Rows::of(rstd, 1),
        ];
        let partials = self.norm_backward_blocks(n, 2 * c, Rows::of(dinp, c), read, |di, p, r| {
            let [d, i, w, m, rs] = r;
            ops::layernorm::layernorm_backward_blocks(di, p, d, i, w, m, rs, c)
        });
        self.mem.run([dw, dbias], [], |[dw, db], []| {
            ops::add_block_partials(dw, &partials, 2 * c, 0);
            ops::add_block_partials(db, &partials, 2 * c, c);
        });
    }

    fn linear_forward(&mut self, l: &Linear, out: Span, inp: Span) {
        self.linear_onto(l, out, None, inp);
    }

    fn residual_epilogue(&self, _dt: Dtype) -> bool {
        true
    }

    fn linear_residual_forward(
        &mut self,
        l: &Linear,
        out: Span,
        resid: Span,
        _scratch: Span,
        inp: Span,
    ) {
        self.linear_onto(l, out, Some(resid), inp);
    }

    fn linear_backward(&mut self, l: &Linear, g: &LinearGrads, dout: Span, inp: Span) {
        let Linear {
            w,
            layout,
            n,
            ic,
            oc,
            ..
        } = *l;
        let LinearGrads { dinp, dw, dbias } = *g;
        let r = [dout, inp, w];
        let prec = self.gemm_precision(&r);
        let grad_types = [dout, inp, w, dinp.unwrap_or(dout)];
        if self.one_type(&grad_types).is_some() {
            // Operands read as stored: the input gradient written once (rounded from
            // fugu-gemm's tiles), the weight gradient (a sum over every row) in one GEMM, the
            // bias gradient's column sums row by row.
            if let Some(di) = dinp {
                self.mem.run_stored([di], [dout, w], |[di], [d, w]| {
                    same_stored_mut!((di), (d, w), |(di), d, w| {
                        ops::linear::linear_backward_input_into(prec, di, d, w, layout, n, ic, oc)
                    })
                });
            }
            let whole = |s: Span| Rows::of(s, s.len);
            self.mem.run_rows_stored(
                Chunks::Serial(1),
                1,
                [whole(dw)],
                [],
                [whole(dout), whole(inp)],
                |_, [dw], [], [d, i]| {
                    same_stored!((d, i), |d, i| {
                        ops::linear::linear_backward_weight_stored(
                            prec, dw, d, i, layout, n, ic, oc,
                        )
                    })
                },
            );
            if let Some(db) = dbias {
                self.mem.run_rows_stored(
                    Chunks::Serial(1),
                    1,
                    [whole(db)],
                    [],
                    [whole(dout)],
                    |_, [db], [], [d]| same_stored!((d), |d| ops::add_column_sums(db, d, n)),
                );
            }
            return;
        }
        use ops::linear::linear_backward as lb;
        match (dinp, dbias) {
            (Some(di), Some(db)) => self.mem.run([di, dw, db], r, |[di, dw, db], [d, i, w]| {
                lb(prec, Some(di), dw, Some(db), d, i, w, layout, n, ic, oc)
            }),
            (Some(di), None) => self.mem.run([di, dw], r, |[di, dw], [d, i, w]| {
                lb(prec, Some(di), dw, None, d, i, w, layout, n, ic, oc)
            }),
            (None, Some(db)) => self.mem.run([dw, db], r, |[dw, db], [d, i, w]| {
                lb(prec, None, dw, Some(db), d, i, w, layout, n, ic, oc)
            }),
            (None, None) => self.mem.run([dw], r, |[dw], [d, i, w]| {
                lb(prec, None, dw, None, d, i, w, layout, n, ic, oc)
            }),
        }
    }

    fn attention_scores(&mut self, att: Span, qkv: Span, d: AttnDims) {
        let prec = self.gemm_precision(&[qkv]);
        if self.one_16bit_type(&[att, qkv]) {
            return self.mem.run_stored([att], [qkv], |[a], [q]| {
                same_stored_mut!((a), (q), |(a), q| {
                    ops::attention::attention_scores(prec, a, q, d.shape())
                })
            });
        }
        let seq = |s| per_sequence(s, d);
        // Written up to each row's causal block; the softmax sets the rest before reading it.
        let (w, g) = ([Rows::overwritten(att, att.len / d.b.max(1))], [seq(qkv)]);
        self.attention_gemms(prec, d, w, g, |rows, [a], [q]| {
            let shape = sequences(d, rows);
            same_stored!((q), |q| ops::attention::attention_scores(prec, a, q, shape))
        });
    }

    fn attention_softmax(&mut self, att: Span, d: AttnDims) {
        // 16-bit: each row read and written as stored, up to its causal length.
        let rows = [Rows::of(att, d.t)];
        if self
            .mem
            .run_rows_bits(d.b * d.nh * d.t, rows, [], |rows, dt, [a], []| {
                ops::half_rows::attention_softmax(dt, a, rows.start, d.t)
            })
        {
            return;
        }
        // Chunks of whole (T, T) blocks: a row's causal length is its index within one.
        let block = d.t * d.t;
        let blocks = [Rows::of(att, block)];
        self.mem
            .run_rows(Chunks::Cache, d.b * d.nh, blocks, [], |rows, [a], []| {
                ops::attention::attention_softmax(a, 1, d.t, rows.len())
            });
    }

    fn attention_values(&mut self, out: Span, att: Span, qkv: Span, d: AttnDims) {
        let prec = self.gemm_precision(&[att, qkv]);
        if self.one_16bit_type(&[out, att, qkv]) {
            return self.mem.run_stored([out], [att, qkv], |[o], [a, q]| {
                same_stored_mut!((o), (a, q), |(o), a, q| {
                    ops::attention::attention_values(prec, o, a, q, d.shape())
                })
            });
        }
        let seq = |s| per_sequence(s, d);
        let (w, g) = ([seq(out)], [seq(att), seq(qkv)]);
        self.attention_gemms(prec, d, w, g, |rows, [o], [a, q]| {
            let shape = sequences(d, rows);
            same_stored!((a, q), |a, q| {
                ops::attention::attention_values(prec, o, a, q, shape)
            })
        });
    }

    fn attention_values_backward(
        &mut self,
        datt: Span,
        dqkv: Span,
        dout: Span,
        att: Span,
        qkv: Span,
        d: AttnDims,
    ) {
        let prec = self.gemm_precision(&[dout, att, qkv]);
        // With grouped keys and values, dV sums over each group in f32: staged.
        if d.kv == d.nh && self.one_16bit_type(&[datt, dqkv, dout, att, qkv]) {
            let (w, r) = ([datt, dqkv], [dout, att, qkv]);
            return self.mem.run_stored(w, r, |[da, dq], [dout, a, q]| {
                same_stored_mut!((da, dq), (dout, a, q), |(da, dq), dout, a, q| {
                    ops::attention::attention_values_backward(prec, da, dq, dout, a, q, d.shape())
                })
            });
        }
        let seq = |s| per_sequence(s, d);
        // datt as att in the forward pass (its softmax backward sets the rest); dqkv's Q and K
        // columns are kept.
        let datt_rows = Rows::overwritten(datt, datt.len / d.b.max(1));
        let (w, g) = ([datt_rows, seq(dqkv)], [seq(dout), seq(att), seq(qkv)]);
        self.attention_gemms(prec, d, w, g, |rows, [da, dq], [dout, a, q]| {
            let shape = sequences(d, rows);
            same_stored!((dout, a, q), |dout, a, q| {
                ops::attention::attention_values_backward(prec, da, dq, dout, a, q, shape)
            })
        });
    }

    fn attention_softmax_backward(&mut self, datt: Span, att: Span, d: AttnDims) {
        // 16-bit: each row read and written as stored, up to its causal length.
        let (w, r) = ([Rows::of(datt, d.t)], [Rows::of(att, d.t)]);
        if self
            .mem
            .run_rows_bits(d.b * d.nh * d.t, w, r, |rows, dt, [da], [a]| {
                ops::half_rows::attention_softmax_backward(dt, da, a, rows.start, d.t)
            })
        {
            return;
        }
        let block = d.t * d.t;
        let (w, r) = ([Rows::of(datt, block)], [Rows::of(att, block)]);
        self.mem
            .run_rows(Chunks::Cache, d.b * d.nh, w, r, |rows, [da], [a]| {
                ops::attention::attention_softmax_backward(da, a, 1, d.t, rows.len())
            });
    }

    fn attention_scores_backward(&mut self, dqkv: Span, datt: Span, qkv: Span, d: AttnDims) {
        let prec = self.gemm_precision(&[datt, qkv]);
        // With grouped keys and values, dK sums over each group in f32: staged.
        if d.kv == d.nh && self.one_16bit_type(&[dqkv, datt, qkv]) {
            return self.mem.run_stored([dqkv], [datt, qkv], |[dq], [da, q]| {
                same_stored_mut!((dq), (da, q), |(dq), da, q| {
                    ops::attention::attention_scores_backward(prec, dq, da, q, d.shape())
                })
            });
        }
        let seq = |s| per_sequence(s, d);
        let (w, g) = ([seq(dqkv)], [seq(datt), seq(qkv)]);
        self.attention_gemms(prec, d, w, g, |rows, [dq], [da, q]| {
            let shape = sequences(d, rows);
            same_stored!((da, q), |da, q| {
                ops::attention::attention_scores_backward(prec, dq, da, q, shape)
            })
        });
    }

    fn fused_attention(&self, _hs: usize, _dt: Dtype) -> FusedAttention {
        // A plain-loop reference: the batched GEMMs of the three-step path are faster here.
        FusedAttention::Available
    }

    fn attention_forward(&mut self, out: Span, lse: Span, qkv: Span, d: AttnDims) {
        let seq = |s| per_sequence(s, d);
        let written = [seq(out), seq(lse)];
        self.mem.run_rows(
            Chunks::Cache,
            d.b,
            written,
            [seq(qkv)],
            |rows, [o, l], [q]| {
                ops::attention::attention_forward_fused(o, l, q, sequences(d, rows))
            },
        );
    }

    fn attention_backward(
        &mut self,
        dqkv: Span,
        dout: Span,
        FusedOut { out, lse }: FusedOut,
        qkv: Span,
        d: AttnDims,
        rope: Option<&Rope>,
    ) {
        let seq = |s| per_sequence(s, d);
        self.mem.run_rows(
            Chunks::Cache,
            d.b,
            [seq(dqkv)],
            [seq(dout), seq(out), seq(lse), seq(qkv)],
            |rows, [dq], [dy, y, l, q]| {
                ops::attention::attention_backward_fused(dq, dy, y, l, q, sequences(d, rows))
            },
        );
        if let Some(r) = rope {
            self.rope_backward(r, dqkv);
        }
    }

    fn attention_decode(&mut self, out: Span, q: Span, kv: KvRows, d: AttnDims) {
        self.mem.run([out], [q, kv.k, kv.v], |[o], [q, k, v]| {
            ops::attention::attention_decode(o, q, k, v, kv.len, (d.nh, d.kv), d.hs)
        });
    }

    fn rmsnorm_forward(&mut self, r: &RmsNorm, out: Span, rstd: Span, inp: Span) {
        assert!(out.len == r.n * r.c && inp.len == r.n * r.c && rstd.len == r.n && r.w.len == r.c);
        self.mem.run_rows(
            Chunks::Cache,
            r.n,
            [Rows::of(out, r.c), Rows::of(rstd, 1)],
            [Rows::of(inp, r.c), Rows::whole(r.w)],
            |_, [o, rs], [i, w]| ops::rmsnorm::rmsnorm_forward(o, rs, i, w, r.eps),
        );
    }

    fn rmsnorm_backward(
        &mut self,
        r: &RmsNorm,
        g: &RmsNormGrads,
        dout: Span,
        inp: Span,
        rstd: Span,
    ) {
        let (n, c) = (r.n, r.c);
        assert!(g.dinp.len == n * c && dout.len == n * c && inp.len == n * c);
        assert!(g.dw.len == c && r.w.len == c && rstd.len == n);
        let read = [
            Rows::of(dout, c),
            Rows::of(inp, c),
            Rows::whole(r.w),
            Rows::of(rstd, 1),
        ];
        let partials = self.norm_backward_blocks(n, c, Rows::of(g.dinp, c), read, |di, p, r| {
            let [d, i, w, rs] = r;
            ops::rmsnorm::rmsnorm_backward_blocks(di, p, d, i, w, rs)
        });
        self.mem.run([g.dw], [], |[dw], []| {
            ops::add_block_partials(dw, &partials, c, 0)
        });
    }

    fn rope_forward(&mut self, r: &Rope, x: Span) {
        self.rope(r, x, true);
    }

    fn rope_backward(&mut self, r: &Rope, dx: Span) {
        self.rope(r, dx, false);
    }

    fn swiglu_forward(&mut self, out: Span, inp: Span, f: usize) {
        self.mem.run_rows(
            Chunks::Cache,
            out.len / f.max(1),
            [Rows::of(out, f)],
            [Rows::of(inp, 2 * f)],
            |_, [o], [i]| ops::swiglu::swiglu_forward(o, i, f),
        );
    }

    fn swiglu_backward(&mut self, dinp: Span, dout: Span, inp: Span, f: usize) {
        self.mem.run_rows(
            Chunks::Cache,
            dout.len / f.max(1),
            [Rows::of(dinp, 2 * f)],
            [Rows::of(dout, f), Rows::of(inp, 2 * f)],
            |_, [di], [d, i]| ops::swiglu::swiglu_backward(di, d, i, f),
        );
    }

    fn gelu_forward(&mut self, out: Span, inp: Span) {
        // 16-bit spans: the 16-bit kernel on the stored bits.
        // Elementwise: rows of one element.
        let each = |s| Rows::of(s, 1);
        if self
            .mem
            .run_rows_bits(out.len, [each(out)], [each(inp)], |_, dt, [o], [i]| {
                ops::half_rows::gelu_forward(dt, o, i)
            })
        {
            return;
        }
        self.mem.run_rows(
            Chunks::Cache,
            out.len,
            [each(out)],
            [each(inp)],
            |_, [o], [i]| ops::gelu::gelu_forward(o, i),
        );
    }

    fn gelu_backward(&mut self, dinp: Span, inp: Span, dout: Span) {
        // 16-bit spans: the 16-bit kernel on the stored bits.
        // Elementwise: rows of one element.
        let each = |s| Rows::of(s, 1);
        let read = [each(inp), each(dout)];
        if self
            .mem
            .run_rows_bits(dinp.len, [each(dinp)], read, |_, dt, [di], [i, d]| {
                ops::half_rows::gelu_backward(dt, di, i, d)
            })
        {
            return;
        }
        self.mem.run_rows(
            Chunks::Cache,
            dinp.len,
            [each(dinp)],
            read,
            |_, [di], [i, d]| ops::gelu::gelu_backward(di, i, d),
        );
    }

    fn residual_forward(&mut self, out: Span, a: Span, b: Span) {
        // Elementwise: rows of one element.
        let each = |s| Rows::of(s, 1);
        let read = [each(a), each(b)];
        self.mem.run_rows(
            Chunks::Cache,
            out.len,
            [each(out)],
            read,
            |_, [o], [a, b]| ops::residual::residual_forward(o, a, b),
        );
    }

    fn add_inplace(&mut self, acc: Span, x: Span) {
        // Elementwise: rows of one element.
        let each = |s| Rows::of(s, 1);
        self.mem.run_rows(
            Chunks::Cache,
            acc.len,
            [each(acc)],
            [each(x)],
            |_, [a], [x]| ops::residual::add_inplace(a, x),
        );
    }

    fn scale_inplace(&mut self, x: Span, factor: f32) {
        self.mem
            .run_rows(Chunks::Cache, x.len, [Rows::of(x, 1)], [], |_, [x], []| {
                ops::scale_inplace(x, factor)
            });
    }

    fn ce_row_stats(&mut self, maxes: Span, sums: Span, logits: Span, d: CeDims) {
        self.mem.run_rows(
            Chunks::Cache,
            d.n,
            [Rows::of(maxes, 1), Rows::of(sums, 1)],
            [Rows::of(logits, d.vp)],
            |rows, [m, s], [l]| {
                ops::crossentropy::ce_row_stats(m, s, l, rows.len(), d.vp, d.v_valid)
            },
        );
    }

    fn ce_rescale_sums(&mut self, sums: Span, local_maxes: Span, maxes: Span) {
        self.mem.run([sums], [local_maxes, maxes], |[s], [l, m]| {
            ops::crossentropy::ce_rescale_sums(s, l, m)
        });
    }

    fn ce_target_logit(&mut self, tl: Span, logits: Span, targets: TokSpan, d: CeDims) {
        let tg = &self.tokens[targets.offset..targets.offset + targets.len];
        self.mem.run_rows(
            Chunks::Cache,
            d.n,
            [Rows::of(tl, 1)],
            [Rows::of(logits, d.vp)],
            |rows, [t], [l]| {
                let (tg, n) = (&tg[rows.clone()], rows.len());
                ops::crossentropy::ce_target_logit(t, l, tg, d.vocab_start, n, d.vp, d.v_valid)
            },
        );
    }

    fn ce_finish(
        &mut self,
        losses: Span,
        logits: Span,
        rows: CeRows,
        targets: TokSpan,
        dloss: Option<f32>,
        d: CeDims,
    ) {
        let CeRows { maxes, sums, tl } = rows;
        let tg = &self.tokens[targets.offset..targets.offset + targets.len];
        let stats = [Rows::of(maxes, 1), Rows::of(sums, 1), Rows::of(tl, 1)];
        match dloss {
            Some(dl) => self.mem.run_rows(
                Chunks::Cache,
                d.n,
                [Rows::of(losses, 1), Rows::of(logits, d.vp)],
                stats,
                |rows, [lo, lg], [m, s, t]| {
                    let (tg, n) = (&tg[rows.clone()], rows.len());
                    let (v0, vp, vv) = (d.vocab_start, d.vp, d.v_valid);
                    ops::crossentropy::ce_finish(lo, lg, m, s, t, tg, v0, dl, n, vp, vv)
                },
            ),
            None => self
                .mem
                .run([losses], [maxes, sums, tl], |[lo], [m, s, t]| {
                    for i in 0..d.n {
                        lo[i] = s[i].ln() + m[i] - t[i];
                    }
                }),
        }
    }

    fn ce_whole_vocab(
        &mut self,
        losses: Span,
        logits: Span,
        rows: CeRows,
        targets: TokSpan,
        dloss: Option<f32>,
        d: CeDims,
    ) {
        assert_eq!(
            d.vocab_start, 0,
            "ce_whole_vocab: logits split across ranks"
        );
        let CeRows { maxes, sums, tl } = rows;
        let tg = &self.tokens[targets.offset..targets.offset + targets.len];
        let (vp, vv) = (d.vp, d.v_valid);
        let [losses, maxes, sums, tl] = [losses, maxes, sums, tl].map(|s| Rows::of(s, 1));
        let lg = Rows::of(logits, vp);
        match dloss {
            Some(dl) => self.mem.run_rows(
                Chunks::Cache,
                d.n,
                [losses, lg, maxes, sums, tl],
                [],
                |rows, [lo, lg, maxes, sums, tl], []| {
                    let stats = ops::CeStats { maxes, sums, tl };
                    let (tg, n) = (&tg[rows.clone()], rows.len());
                    ops::ce_fused(lo, lg, stats, tg, dl, n, vp, vv)
                },
            ),
            None => self.mem.run_rows(
                Chunks::Cache,
                d.n,
                [losses, maxes, sums, tl],
                [lg],
                |rows, [lo, maxes, sums, tl], [lg]| {
                    let stats = ops::CeStats { maxes, sums, tl };
                    let (tg, n) = (&tg[rows.clone()], rows.len());
                    ops::ce_fused_losses(lo, lg, stats, tg, (n, vp, vv))
                },
            ),
        }
    }

    fn sum_of_squares(&mut self, xs: &[Span]) -> Vec<f64> {
        xs.iter()
            .map(|&x| {
                self.mem
                    .run([], [x], |[], [x]| ops::adamw::sum_of_squares(x))
            })
            .collect()
    }

    fn adamw(&mut self, parts: &[AdamWPart], hp: &AdamWStep) {
        for part in parts {
            let step = part.step(hp);
            self.mem.run(
                [part.params, part.m, part.v],
                [part.grads],
                |[p, m, v], [g]| ops::adamw::adamw_update(p, g, m, v, &step),
            );
            if let Some(c) = part.compute {
                self.copy(c, part.params);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GEMM operands that all hold one 16-bit type run at that precision (exact products,
    /// f32 sums, as on a tensor core); any mix runs in f32. And a bf16 linear layer equals the
    /// f32 one on the same (bf16) values up to the order of the f32 sums.
    #[test]
    fn gemms_run_at_the_operands_common_precision() {
        let mut be = CpuBackend::new();
        let span = |buf, len| Span {
            buf,
            offset: 0,
            len,
        };
        let (n, ic, oc) = (5, 37, 9);
        let mut bufs = Vec::new();
        for dt in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            bufs.push((
                dt,
                be.alloc(n * ic, dt).unwrap(),
                be.alloc(ic * oc, dt).unwrap(),
            ));
        }
        let p = |be: &CpuBackend, x: &[Span]| be.gemm_precision(x);
        let (x32, w32) = (span(bufs[0].1, n * ic), span(bufs[0].2, ic * oc));
        let (xb, wb) = (span(bufs[1].1, n * ic), span(bufs[1].2, ic * oc));
        let xh = span(bufs[2].1, n * ic);
        assert_eq!(p(&be, &[x32, w32]), ops::Precision::F32);
        assert_eq!(p(&be, &[xb, wb]), ops::Precision::Bf16);
        assert_eq!(p(&be, &[xh]), ops::Precision::F16);
        assert_eq!(p(&be, &[xb, w32]), ops::Precision::F32);
        assert_eq!(p(&be, &[xb, xh]), ops::Precision::F32);

        let x: Vec<f32> = (0..n * ic)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 31.0)
            .collect();
        let w: Vec<f32> = (0..ic * oc)
            .map(|i| ((i * 13 % 89) as f32 - 44.0) / 57.0)
            .collect();
        let get = |be: &CpuBackend, s: Span| {
            let mut v = vec![0.0; s.len];
            be.download(s, &mut v);
            v
        };
        be.upload(xb, &x);
        be.upload(wb, &w);
        let (xr, wr) = (get(&be, xb), get(&be, wb));
        assert_ne!(xr, x, "the bf16 buffer holds rounded values");
        be.upload(x32, &xr);
        be.upload(w32, &wr);
        let out32 = be.alloc(n * oc, Dtype::F32).unwrap();
        let outb = be.alloc(n * oc, Dtype::F32).unwrap();
        let (o32, ob) = (span(out32, n * oc), span(outb, n * oc));
        let linear = |w| Linear {
            w,
            layout: crate::backend::WeightLayout::InOut,
            bias: None,
            n,
            ic,
            oc,
        };
        be.linear_forward(&linear(w32), o32, x32);
        be.linear_forward(&linear(wb), ob, xb);
        let (y32, yb) = (get(&be, o32), get(&be, ob));
        for (a, b) in y32.iter().zip(&yb) {
            // |error| of a k-term f32 sum <= k·u·Σ|products|; Σ|products| < k·1.7·0.8 here.
            let tol = ic as f32 * f32::EPSILON * ic as f32 * 2.0;
            assert!((a - b).abs() <= tol, "{a} vs {b}");
        }
    }

    /// A linear layer whose spans all hold one 16-bit type writes its output (and its input's
    /// gradient) once from fugu-gemm's f32 tiles: the values of the same GEMMs on f32 views
    /// (an f32 output, the operands' precision), rounded once, bit for bit; the weight and
    /// bias gradients equal too.
    #[test]
    fn a_16_bit_linear_is_the_f32_views_result_rounded_once() {
        let (n, ic, oc) = (70, 37, 29);
        let values = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| ((i * seed % 101) as f32 - 50.0) / 23.0)
                .collect()
        };
        for dt in [Dtype::Bf16, Dtype::F16] {
            let mut be = CpuBackend::new();
            let mut new = |len: usize, dt: Dtype, seed: usize| {
                let buf = be.alloc(len, dt).unwrap();
                (buf, len, seed)
            };
            let bufs = [
                new(n * ic, dt, 37),
                new(ic * oc, dt, 13),
                new(oc, dt, 7),
                new(n * oc, dt, 17),
                new(n * oc, dt, 0),
                new(n * oc, Dtype::F32, 0),
                new(n * ic, dt, 0),
                new(n * ic, Dtype::F32, 0),
                new(ic * oc, Dtype::F32, 0),
                new(ic * oc, Dtype::F32, 0),
                new(oc, Dtype::F32, 0),
                new(oc, Dtype::F32, 0),
            ];
            let spans = bufs.map(|(buf, len, seed)| {
                let s = Span {
                    buf,
                    offset: 0,
                    len,
                };
                be.upload(s, &values(len, seed));
                s
            });
            let [x, w, bias, resid, out16, out32, dx16, dx32, dw16, dw32, db16, db32] = spans;
            let linear = Linear {
                w,
                layout: crate::backend::WeightLayout::OutIn,
                bias: Some(bias),
                n,
                ic,
                oc,
            };
            be.linear_residual_forward(&linear, out16, resid, out16, x);
            be.linear_residual_forward(&linear, out32, resid, out32, x);
            // The gradient of `out` is `resid`'s values (any 16-bit values do).
            let grads = |dinp, dw, dbias| LinearGrads {
                dinp: Some(dinp),
                dw,
                dbias: Some(dbias),
            };
            be.linear_backward(&linear, &grads(dx16, dw16, db16), resid, x);
            be.linear_backward(&linear, &grads(dx32, dw32, db32), resid, x);
            let get = |s: Span| {
                let mut v = vec![0.0; s.len];
                be.download(s, &mut v);
                v
            };
            let rounded = |v: Vec<f32>| v.into_iter().map(|x| dt.round(x)).collect::<Vec<_>>();
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert_eq!(bits(get(out16)), bits(rounded(get(out32))), "{dt:?} out");
            assert_eq!(bits(get(dx16)), bits(rounded(get(dx32))), "{dt:?} dinp");
            assert_eq!(bits(get(dw16)), bits(get(dw32)), "{dt:?} dw");
            assert_eq!(bits(get(db16)), bits(get(db32)), "{dt:?} dbias");
            assert!(get(out16).iter().any(|&v| v != 0.0));
        }
    }

    /// The attention GEMMs on 16-bit spans (multi-head: no group sums) write their results once
    /// from fugu-gemm's f32 tiles: the values of the same GEMMs with f32 outputs (the staged
    /// path), rounded once, bit for bit.
    #[test]
    fn attention_gemms_into_16_bits_are_the_f32_results_rounded_once() {
        let d = AttnDims {
            b: 2,
            t: 19,
            nh: 3,
            kv: 3,
            hs: 8,
        };
        let c = d.nh * d.hs;
        let (qkv_len, att_len, y_len) = (d.b * d.t * 3 * c, d.b * d.nh * d.t * d.t, d.b * d.t * c);
        for dt in [Dtype::Bf16, Dtype::F16] {
            let mut be = CpuBackend::new();
            let mut span = |len: usize, dtype: Dtype, seed: usize| {
                let s = Span {
                    buf: be.alloc(len, dtype).unwrap(),
                    offset: 0,
                    len,
                };
                let v: Vec<f32> = (0..len)
                    .map(|i| ((i * seed % 97) as f32 - 48.0) / 41.0)
                    .collect();
                if seed > 0 {
                    be.upload(s, &v);
                }
                s
            };
            let (qkv, att, dout, datt_in) = (
                span(qkv_len, dt, 31),
                span(att_len, dt, 17),
                span(y_len, dt, 11),
                span(att_len, dt, 23),
            );
            // Outputs: 16-bit, and f32 (the staged path on the same 16-bit inputs).
            let outs = |be: &mut CpuBackend, ty: Dtype| {
                let mut zero = |len: usize| {
                    let s = Span {
                        buf: be.alloc(len, ty).unwrap(),
                        offset: 0,
                        len,
                    };
                    be.zero(s);
                    s
                };
                [zero(att_len), zero(y_len), zero(att_len), zero(qkv_len)]
            };
            let (o16, o32) = (outs(&mut be, dt), outs(&mut be, Dtype::F32));
            for [scores, y, datt, dqkv] in [o16, o32] {
                be.attention_scores(scores, qkv, d);
                be.attention_values(y, att, qkv, d);
                be.attention_values_backward(datt, dqkv, dout, att, qkv, d);
                be.attention_scores_backward(dqkv, datt_in, qkv, d);
            }
            let get = |s: Span| {
                let mut v = vec![0.0; s.len];
                be.download(s, &mut v);
                v
            };
            for (name, (s16, s32)) in ["scores", "values", "datt", "dqkv"]
                .iter()
                .zip(o16.into_iter().zip(o32))
            {
                let want: Vec<u32> = get(s32).iter().map(|&x| dt.round(x).to_bits()).collect();
                let got: Vec<u32> = get(s16).iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "{dt:?} {name}");
                assert!(get(s16).iter().any(|&x| x != 0.0), "{dt:?} {name}: written");
            }
        }
    }
}

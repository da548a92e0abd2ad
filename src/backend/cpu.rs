//! The CPU backend: buffers are host `f32`s on cache-line boundaries ([`HostBuf`]), GEMMs go
//! to fugu-gemm, the other ops to the rayon kernels of [`crate::ops`].

use super::host_buf::HostBuf;
use super::{
    AdamWPart, AdamWStep, AttnDims, Backend, BufId, CeDims, CeRows, Dtype, Embedding,
    FusedAttention, KvRows, LayerNorm, LayerNormGrads, Linear, LinearGrads, NormStats, RmsNorm,
    RmsNormGrads, Rope, Span, TokSpan,
};
use crate::ops;
use anyhow::Result;

/// Host-memory backend.
#[derive(Default)]
pub struct CpuBackend {
    /// Every buffer is host `f32`s; a buffer allocated as `bf16`/`f16` holds only values of
    /// that type ([`CpuBackend::stored`] rounds what each op writes), so low-precision runs
    /// compute in `f32` on exactly the values a device would store: the reference for the
    /// CUDA backend's low-precision kernels, not a memory saving.
    bufs: Vec<HostBuf>,
    dtypes: Vec<Dtype>,
    tokens: Vec<u32>,
}

impl CpuBackend {
    pub fn new() -> CpuBackend {
        CpuBackend::default()
    }

    /// Read-only host view of a span (zero-copy). Private: code above the backend reaches
    /// memory through `download`/`upload`/`with_host`, which every backend has.
    fn host(&self, s: Span) -> &[f32] {
        &self.bufs[s.buf.0 as usize].as_slice()[s.offset..s.offset + s.len]
    }

    /// Mutable host view of a span.
    fn host_mut(&mut self, s: Span) -> &mut [f32] {
        &mut self.bufs[s.buf.0 as usize].as_mut_slice()[s.offset..s.offset + s.len]
    }

    /// The arithmetic of a GEMM on these operand spans: their 16-bit type when they all share
    /// one (the operands are then values of that type, so fugu-gemm's bf16 kernel runs them
    /// exactly as a tensor core would: exact products, f32 sums), otherwise f32.
    fn gemm_precision(&self, operands: &[Span]) -> ops::Precision {
        let mut dts = operands.iter().map(|s| self.dtypes[s.buf.0 as usize]);
        let first = dts.next().unwrap_or(Dtype::F32);
        if dts.all(|d| d == first) {
            first.precision()
        } else {
            ops::Precision::F32
        }
    }

    /// `out = resid + inp·W + bias`, `resid` and `bias` each optional: the linear layers
    /// ([`ops::linear::linear_forward`], or its residual form). An absent span goes to
    /// `views` as an empty one.
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
        let none = out.sub(0, 0);
        let read = [resid.unwrap_or(none), inp, w, bias.unwrap_or(none)];
        let ([o], [r, i, w, b]) = views(&mut self.bufs, [out], read);
        let b = bias.map(|_| b);
        match resid {
            Some(_) => ops::linear::linear_residual_forward(prec, o, r, i, w, layout, b, n, ic, oc),
            None => ops::linear::linear_forward(prec, o, i, w, layout, b, n, ic, oc),
        }
        self.stored(&[out]);
    }

    /// Rounds what an op wrote to `written` to each span's buffer type (a no-op for `f32`
    /// buffers). Every op that writes calls it for every span it writes.
    fn stored(&mut self, written: &[Span]) {
        for &w in written {
            let dt = self.dtypes[w.buf.0 as usize];
            dt.round_slice(self.host_mut(w));
        }
    }

    /// [`Backend::rope_forward`] (`forward`) or its backward, in place on `x`.
    fn rope(&mut self, r: &Rope, x: Span, forward: bool) {
        r.check(x, "rope");
        let ([x_], [table]) = views(&mut self.bufs, [x], [r.table]);
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
        self.stored(&[x]);
    }
}

/// Borrows `W` spans mutably and `R` spans immutably from `bufs` at once.
///
/// Panics (an internal bug, never user input) if a span is out of bounds or a written span
/// overlaps any other span of the call.
fn views<const W: usize, const R: usize>(
    bufs: &mut [HostBuf],
    w: [Span; W],
    r: [Span; R],
) -> ([&mut [f32]; W], [&[f32]; R]) {
    for s in w.iter().chain(r.iter()) {
        let len = bufs.get(s.buf.0 as usize).map_or(0, HostBuf::len);
        assert!(
            s.offset.checked_add(s.len).is_some_and(|end| end <= len),
            "span {s:?} outside its buffer of {len} floats"
        );
    }
    for (i, a) in w.iter().enumerate() {
        for b in w.iter().skip(i + 1).chain(r.iter()) {
            assert!(!a.overlaps(*b), "written span {a:?} overlaps {b:?}");
        }
    }
    let ptrs: Vec<*mut f32> = bufs
        .iter_mut()
        .map(|v| v.as_mut_slice().as_mut_ptr())
        .collect();
    // SAFETY: every span was checked above to lie inside its buffer, and no written span
    // overlaps another span of this call, so the mutable slices are disjoint from each other
    // and from the shared ones. Shared spans may overlap each other (both are reads). The
    // slices borrow `bufs` mutably for 'a, so no buffer can be reallocated or accessed
    // elsewhere while they live.
    let wm = w.map(|s| unsafe {
        std::slice::from_raw_parts_mut(ptrs[s.buf.0 as usize].add(s.offset), s.len)
    });
    // SAFETY: as above.
    let rm = r.map(|s| unsafe {
        std::slice::from_raw_parts(ptrs[s.buf.0 as usize].add(s.offset) as *const f32, s.len)
    });
    (wm, rm)
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
        self.bufs.push(HostBuf::zeroed(len)?);
        self.dtypes.push(dtype);
        Ok(BufId(self.bufs.len() as u32 - 1))
    }

    fn free(&mut self, buf: BufId) {
        self.bufs[buf.0 as usize] = HostBuf::default();
    }

    fn buf_len(&self, buf: BufId) -> usize {
        self.bufs[buf.0 as usize].len()
    }

    fn buf_dtype(&self, buf: BufId) -> Dtype {
        self.dtypes[buf.0 as usize]
    }

    fn free_memory(&self) -> Option<u64> {
        crate::metrics::machine::host_memory_available()
    }

    fn upload(&mut self, dst: Span, src: &[f32]) {
        self.host_mut(dst).copy_from_slice(src);
        self.stored(&[dst]);
    }

    fn download(&self, src: Span, dst: &mut [f32]) {
        dst.copy_from_slice(self.host(src));
    }

    fn with_host(&mut self, s: Span, f: &mut dyn FnMut(&mut [f32])) {
        f(self.host_mut(s));
        self.stored(&[s]);
    }

    fn zero(&mut self, s: Span) {
        self.host_mut(s).fill(0.0);
    }

    fn copy(&mut self, dst: Span, src: Span) {
        assert_eq!(dst.len, src.len, "copy: span lengths differ");
        let ([d], [s]) = views(&mut self.bufs, [dst], [src]);
        d.copy_from_slice(s);
        self.stored(&[dst]);
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
        match wpe {
            Some(wpe) => {
                let ([o], [e, p]) = views(&mut self.bufs, [out], [wte, wpe]);
                ops::encoder::encoder_forward(o, toks, e, vocab_start, Some(p), b, t, c);
            }
            None => {
                let ([o], [e]) = views(&mut self.bufs, [out], [wte]);
                ops::encoder::encoder_forward(o, toks, e, vocab_start, None, b, t, c);
            }
        }
        self.stored(&[out]);
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
            Some(dwpe) => {
                let ([de, dp], [d]) = views(&mut self.bufs, [dwte, dwpe], [dout]);
                ops::encoder::encoder_backward(de, Some(dp), d, toks, vocab_start, b, t, c);
            }
            None => {
                let ([de], [d]) = views(&mut self.bufs, [dwte], [dout]);
                ops::encoder::encoder_backward(de, None, d, toks, vocab_start, b, t, c);
            }
        }
        self.stored(&[Some(dwte), dwpe].into_iter().flatten().collect::<Vec<_>>());
    }

    fn layernorm_forward(&mut self, ln: &LayerNorm, out: Span, stats: NormStats, inp: Span) {
        let LayerNorm { w, bias, n, c } = *ln;
        let NormStats { mean, rstd } = stats;
        let ([o, m, r], [i, w, bi]) = views(&mut self.bufs, [out, mean, rstd], [inp, w, bias]);
        ops::layernorm::layernorm_forward(o, m, r, i, w, bi, n, c);
        self.stored(&[out, mean, rstd]);
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
        let written = [dinp, dw, dbias];
        let ([di, dw, db], [d, i, w, m, r]) =
            views(&mut self.bufs, written, [dout, inp, w, mean, rstd]);
        ops::layernorm::layernorm_backward(di, dw, db, d, i, w, m, r, n, c);
        self.stored(&written);
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
        use ops::linear::linear_backward as lb;
        let r = [dout, inp, w];
        let prec = self.gemm_precision(&r);
        match (dinp, dbias) {
            (Some(di), Some(db)) => {
                let ([di, dw, db], [d, i, w]) = views(&mut self.bufs, [di, dw, db], r);
                lb(prec, Some(di), dw, Some(db), d, i, w, layout, n, ic, oc);
            }
            (Some(di), None) => {
                let ([di, dw], [d, i, w]) = views(&mut self.bufs, [di, dw], r);
                lb(prec, Some(di), dw, None, d, i, w, layout, n, ic, oc);
            }
            (None, Some(db)) => {
                let ([dw, db], [d, i, w]) = views(&mut self.bufs, [dw, db], r);
                lb(prec, None, dw, Some(db), d, i, w, layout, n, ic, oc);
            }
            (None, None) => {
                let ([dw], [d, i, w]) = views(&mut self.bufs, [dw], r);
                lb(prec, None, dw, None, d, i, w, layout, n, ic, oc);
            }
        }
        self.stored(
            &[dinp, Some(dw), dbias]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>(),
        );
    }

    fn attention_scores(&mut self, att: Span, qkv: Span, d: AttnDims) {
        let prec = self.gemm_precision(&[qkv]);
        let ([a], [q]) = views(&mut self.bufs, [att], [qkv]);
        ops::attention::attention_scores(prec, a, q, d.shape());
        self.stored(&[att]);
    }

    fn attention_softmax(&mut self, att: Span, d: AttnDims) {
        let ([a], []) = views(&mut self.bufs, [att], []);
        ops::attention::attention_softmax(a, d.b, d.t, d.nh);
        self.stored(&[att]);
    }

    fn attention_values(&mut self, out: Span, att: Span, qkv: Span, d: AttnDims) {
        let prec = self.gemm_precision(&[att, qkv]);
        let ([o], [a, q]) = views(&mut self.bufs, [out], [att, qkv]);
        ops::attention::attention_values(prec, o, a, q, d.shape());
        self.stored(&[out]);
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
        let ([da, dq], [dout, a, q]) = views(&mut self.bufs, [datt, dqkv], [dout, att, qkv]);
        ops::attention::attention_values_backward(prec, da, dq, dout, a, q, d.shape());
        self.stored(&[datt, dqkv]);
    }

    fn attention_softmax_backward(&mut self, datt: Span, att: Span, d: AttnDims) {
        let ([da], [a]) = views(&mut self.bufs, [datt], [att]);
        ops::attention::attention_softmax_backward(da, a, d.b, d.t, d.nh);
        self.stored(&[datt]);
    }

    fn attention_scores_backward(&mut self, dqkv: Span, datt: Span, qkv: Span, d: AttnDims) {
        let prec = self.gemm_precision(&[datt, qkv]);
        let ([dq], [da, q]) = views(&mut self.bufs, [dqkv], [datt, qkv]);
        ops::attention::attention_scores_backward(prec, dq, da, q, d.shape());
        self.stored(&[dqkv]);
    }

    fn fused_attention(&self, _hs: usize, _dt: Dtype) -> FusedAttention {
        // A plain-loop reference: the batched GEMMs of the three-step path are faster here.
        FusedAttention::Available
    }

    fn attention_forward(&mut self, out: Span, lse: Span, qkv: Span, d: AttnDims) {
        let ([o, l], [q]) = views(&mut self.bufs, [out, lse], [qkv]);
        ops::attention::attention_forward_fused(o, l, q, d.shape());
        self.stored(&[out, lse]);
    }

    fn attention_backward(
        &mut self,
        dqkv: Span,
        dout: Span,
        out: Span,
        lse: Span,
        qkv: Span,
        d: AttnDims,
    ) {
        let ([dq], [dy, y, l, q]) = views(&mut self.bufs, [dqkv], [dout, out, lse, qkv]);
        ops::attention::attention_backward_fused(dq, dy, y, l, q, d.shape());
        self.stored(&[dqkv]);
    }

    fn attention_decode(&mut self, out: Span, q: Span, kv: KvRows, d: AttnDims) {
        let ([o], [q, k, v]) = views(&mut self.bufs, [out], [q, kv.k, kv.v]);
        ops::attention::attention_decode(o, q, k, v, kv.len, (d.nh, d.kv), d.hs);
        self.stored(&[out]);
    }

    fn rmsnorm_forward(&mut self, r: &RmsNorm, out: Span, rstd: Span, inp: Span) {
        assert!(out.len == r.n * r.c && inp.len == r.n * r.c && rstd.len == r.n && r.w.len == r.c);
        let ([o, rs], [i, w]) = views(&mut self.bufs, [out, rstd], [inp, r.w]);
        ops::rmsnorm::rmsnorm_forward(o, rs, i, w, r.eps);
        self.stored(&[out, rstd]);
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
        let written = [g.dinp, g.dw];
        let ([di, dw], [d, i, w, rs]) = views(&mut self.bufs, written, [dout, inp, r.w, rstd]);
        ops::rmsnorm::rmsnorm_backward(di, dw, d, i, w, rs);
        self.stored(&written);
    }

    fn rope_forward(&mut self, r: &Rope, x: Span) {
        self.rope(r, x, true);
    }

    fn rope_backward(&mut self, r: &Rope, dx: Span) {
        self.rope(r, dx, false);
    }

    fn swiglu_forward(&mut self, out: Span, inp: Span, f: usize) {
        let ([o], [i]) = views(&mut self.bufs, [out], [inp]);
        ops::swiglu::swiglu_forward(o, i, f);
        self.stored(&[out]);
    }

    fn swiglu_backward(&mut self, dinp: Span, dout: Span, inp: Span, f: usize) {
        let ([di], [d, i]) = views(&mut self.bufs, [dinp], [dout, inp]);
        ops::swiglu::swiglu_backward(di, d, i, f);
        self.stored(&[dinp]);
    }

    fn gelu_forward(&mut self, out: Span, inp: Span) {
        let ([o], [i]) = views(&mut self.bufs, [out], [inp]);
        ops::gelu::gelu_forward(o, i);
        self.stored(&[out]);
    }

    fn gelu_backward(&mut self, dinp: Span, inp: Span, dout: Span) {
        let ([di], [i, d]) = views(&mut self.bufs, [dinp], [inp, dout]);
        ops::gelu::gelu_backward(di, i, d);
        self.stored(&[dinp]);
    }

    fn residual_forward(&mut self, out: Span, a: Span, b: Span) {
        let ([o], [a, b]) = views(&mut self.bufs, [out], [a, b]);
        ops::residual::residual_forward(o, a, b);
        self.stored(&[out]);
    }

    fn add_inplace(&mut self, acc: Span, x: Span) {
        let ([a], [x]) = views(&mut self.bufs, [acc], [x]);
        ops::residual::add_inplace(a, x);
        self.stored(&[acc]);
    }

    fn ce_row_stats(&mut self, maxes: Span, sums: Span, logits: Span, d: CeDims) {
        let ([m, s], [l]) = views(&mut self.bufs, [maxes, sums], [logits]);
        ops::crossentropy::ce_row_stats(m, s, l, d.n, d.vp, d.v_valid);
        self.stored(&[maxes, sums]);
    }

    fn ce_rescale_sums(&mut self, sums: Span, local_maxes: Span, maxes: Span) {
        let ([s], [l, m]) = views(&mut self.bufs, [sums], [local_maxes, maxes]);
        ops::crossentropy::ce_rescale_sums(s, l, m);
        self.stored(&[sums]);
    }

    fn ce_target_logit(&mut self, tl: Span, logits: Span, targets: TokSpan, d: CeDims) {
        let tg = &self.tokens[targets.offset..targets.offset + targets.len];
        let ([t], [l]) = views(&mut self.bufs, [tl], [logits]);
        ops::crossentropy::ce_target_logit(t, l, tg, d.vocab_start, d.n, d.vp, d.v_valid);
        self.stored(&[tl]);
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
        match dloss {
            Some(dl) => {
                let ([lo, lg], [m, s, t]) =
                    views(&mut self.bufs, [losses, logits], [maxes, sums, tl]);
                ops::crossentropy::ce_finish(
                    lo,
                    lg,
                    m,
                    s,
                    t,
                    tg,
                    d.vocab_start,
                    dl,
                    d.n,
                    d.vp,
                    d.v_valid,
                );
            }
            None => {
                let ([lo], [m, s, t]) = views(&mut self.bufs, [losses], [maxes, sums, tl]);
                for i in 0..d.n {
                    lo[i] = s[i].ln() + m[i] - t[i];
                }
            }
        }
        self.stored(&[losses, logits]);
    }

    fn sum_of_squares(&mut self, xs: &[Span]) -> Vec<f64> {
        xs.iter()
            .map(|&x| ops::adamw::sum_of_squares(self.host(x)))
            .collect()
    }

    fn adamw(&mut self, parts: &[AdamWPart], hp: &AdamWStep) {
        for part in parts {
            let written = [part.params, part.m, part.v];
            let ([p, m, v], [g]) = views(&mut self.bufs, written, [part.grads]);
            ops::adamw::adamw_update(p, g, m, v, &part.step(hp));
            self.stored(&written);
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

    #[test]
    fn views_are_checked() {
        let mut be = CpuBackend::new();
        let a = be.alloc(10, Dtype::F32).unwrap();
        let s = |o, l| Span {
            buf: a,
            offset: o,
            len: l,
        };
        let ([w], [r]) = views(&mut be.bufs, [s(0, 5)], [s(5, 5)]);
        w[0] = 1.0;
        assert_eq!(r.len(), 5);
        let overl = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = views(&mut be.bufs, [s(0, 5)], [s(4, 2)]);
        }));
        assert!(overl.is_err());
        let oob = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = views(&mut be.bufs, [s(8, 5)], []);
        }));
        assert!(oob.is_err());
        assert_eq!(be.host(s(0, 1)), &[1.0]);
    }
}

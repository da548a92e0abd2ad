//! The layer calls a model's passes are lists of, as llm.c's `gpt2_forward` is a list of op
//! calls: each call times itself under the timer name it is given, declares its work (model
//! FLOPs and compulsory bytes, [`super::work`]) for the breakdown's rates, and runs on the
//! backend; a tensor-parallel layer does its own all-reduce (Megatron's `f`/`g`).

use super::work;
use crate::backend::{
    Backend, LayerNorm, LayerNormGrads, Linear, LinearGrads, NormStats, RmsNorm, RmsNormGrads,
    Rope, Span,
};
use crate::comm::{Comm, ReduceOp};
use crate::metrics::timers::{parent_of, TimerLevel, Timers};

/// What every layer call needs: the backend, this rank's tensor-parallel group and the timers.
pub struct Layers<'a, B: Backend> {
    pub be: &'a mut B,
    pub comm: &'a dyn Comm,
    pub timers: &'a Timers,
}

impl<B: Backend> Layers<'_, B> {
    /// A tensor-parallel all-reduce of `s` (a no-op without tensor parallelism), timed as
    /// `name`.
    pub fn allreduce(&mut self, name: &'static str, s: Span, op: ReduceOp) {
        let comm = self.comm;
        if comm.size() > 1 {
            let _t = self.timers.scope(name, TimerLevel::Coarse);
            self.be.with_host(s, &mut |x| comm.allreduce_f32(x, op));
        }
    }

    /// `out = inp·W (+ bias)`, timed as `name`.
    pub fn linear(&mut self, name: &'static str, l: &Linear, out: Span, inp: Span) {
        let be = &mut *self.be;
        let _t = self.timers.scope(name, TimerLevel::Fine).with_work(|| {
            let read = linear_reads(l, inp, None);
            work::linear_forward(&*be, (l.n, l.ic, l.oc), &read, &[out])
        });
        be.linear_forward(l, out, inp);
    }

    /// `pre = inp·W + bias`, `out = gelu(pre)` in one call (the backend's epilogue or two
    /// ops), timed as `name`.
    pub fn linear_gelu(&mut self, name: &'static str, l: &Linear, out: Span, pre: Span, inp: Span) {
        let be = &mut *self.be;
        let _t = self.timers.scope(name, TimerLevel::Fine).with_work(|| {
            let read = linear_reads(l, inp, None);
            work::linear_forward(&*be, (l.n, l.ic, l.oc), &read, &[pre, out])
        });
        be.linear_gelu_forward(l, out, pre, inp);
    }

    /// `out = resid + inp·W (+ bias)` in the GEMM (the residual epilogue), timed as `name`;
    /// `scratch` as [`Backend::linear_residual_forward`] takes it.
    pub fn linear_residual(
        &mut self,
        name: &'static str,
        l: &Linear,
        out: Span,
        resid: Span,
        scratch: Span,
        inp: Span,
    ) {
        let be = &mut *self.be;
        let _t = self.timers.scope(name, TimerLevel::Fine).with_work(|| {
            let read = linear_reads(l, inp, Some(resid));
            work::linear_forward(&*be, (l.n, l.ic, l.oc), &read, &[out])
        });
        be.linear_residual_forward(l, out, resid, scratch, inp);
    }

    /// A linear layer's backward pass, timed as `name`; with `allreduce`, the layer is
    /// column-parallel (or vocabulary-parallel) and its input gradient, a partial sum over
    /// the shards, is all-reduced under that name.
    pub fn linear_backward(
        &mut self,
        (name, allreduce): (&'static str, Option<&'static str>),
        l: &Linear,
        g: &LinearGrads,
        dout: Span,
        inp: Span,
    ) {
        let timers = self.timers;
        let t = {
            let be = &*self.be;
            timers.scope(name, TimerLevel::Fine).with_work(|| {
                let read = [dout, inp, l.w];
                work::linear_backward(be, (l.n, l.ic, l.oc), g.dinp, g.dw, g.dbias, &read)
            })
        };
        self.be.linear_backward(l, g, dout, inp);
        // An all-reduce whose timer is the layer's child runs inside the layer's scope.
        let nested = allreduce.is_some_and(|ar| parent_of(ar) == Some(name));
        if !nested {
            drop(t);
        }
        if let (Some(ar), Some(dinp)) = (allreduce, g.dinp) {
            self.allreduce(ar, dinp, ReduceOp::Sum);
        }
    }

    /// The backward pass of a linear layer whose input is `gelu(pre)`, carried back through
    /// the GELU into `g.dinp` (one call: the backend's epilogue or two ops), timed as `name`.
    pub fn gelu_linear_backward(
        &mut self,
        name: &'static str,
        l: &Linear,
        g: &LinearGrads,
        (scratch, dout, inp, pre): (Span, Span, Span, Span),
    ) {
        let be = &mut *self.be;
        let _t = self.timers.scope(name, TimerLevel::Fine).with_work(|| {
            let read = [dout, inp, pre, l.w];
            work::linear_backward(&*be, (l.n, l.ic, l.oc), g.dinp, g.dw, g.dbias, &read)
        });
        be.gelu_linear_backward(l, g, scratch, dout, inp, pre);
    }

    /// A layernorm's forward pass, timed as `name`.
    pub fn layernorm(
        &mut self,
        name: &'static str,
        ln: &LayerNorm,
        out: Span,
        stats: NormStats,
        inp: Span,
    ) {
        let be = &mut *self.be;
        let _t = self.timers.scope(name, TimerLevel::Fine).with_work(|| {
            let read = [inp, ln.w, ln.bias];
            work::traffic(&*be, &read, &[out, stats.mean, stats.rstd], &[])
        });
        be.layernorm_forward(ln, out, stats, inp);
    }

    /// A layernorm's backward pass, timed as `name`: the parameter gradients accumulate; the
    /// input gradient too, unless `fresh` (then it is zeroed first: written, not added into).
    pub fn layernorm_backward(
        &mut self,
        name: &'static str,
        ln: &LayerNorm,
        g: &LayerNormGrads,
        (dout, inp, stats): (Span, Span, NormStats),
        fresh: bool,
    ) {
        let be = &mut *self.be;
        let _t = self.timers.scope(name, TimerLevel::Fine).with_work(|| {
            let read = [dout, inp, ln.w, stats.mean, stats.rstd];
            if fresh {
                work::traffic(&*be, &read, &[g.dinp], &[g.dw, g.dbias])
            } else {
                work::traffic(&*be, &read, &[], &[g.dinp, g.dw, g.dbias])
            }
        });
        if fresh {
            be.zero(g.dinp);
        }
        be.layernorm_backward(ln, g, dout, inp, stats);
    }
    /// An RMS norm's forward pass (`rstd`: its f32 row statistics), timed as `name`.
    pub fn rmsnorm(&mut self, name: &'static str, r: &RmsNorm, out: Span, rstd: Span, inp: Span) {
        let be = &mut *self.be;
        let _t = self
            .timers
            .scope(name, TimerLevel::Fine)
            .with_work(|| work::traffic(&*be, &[inp, r.w], &[out, rstd], &[]));
        be.rmsnorm_forward(r, out, rstd, inp);
    }

    /// An RMS norm's backward pass, timed as `name`: the input and weight gradients
    /// accumulate, or with `fresh` the input gradient is zeroed first (written, not added
    /// into).
    pub fn rmsnorm_backward(
        &mut self,
        name: &'static str,
        r: &RmsNorm,
        g: &RmsNormGrads,
        (dout, inp, rstd): (Span, Span, Span),
        fresh: bool,
    ) {
        let be = &mut *self.be;
        let _t = self.timers.scope(name, TimerLevel::Fine).with_work(|| {
            let read = [dout, inp, r.w, rstd];
            if fresh {
                work::traffic(&*be, &read, &[g.dinp], &[g.dw])
            } else {
                work::traffic(&*be, &read, &[], &[g.dinp, g.dw])
            }
        });
        if fresh {
            be.zero(g.dinp);
        }
        be.rmsnorm_backward(r, g, dout, inp, rstd);
    }

    /// Rotary embeddings of `x`'s leading heads in place (`backward`: the gradient rotated
    /// back), timed as `name`.
    pub fn rope(&mut self, name: &'static str, r: &Rope, x: Span, backward: bool) {
        let be = &mut *self.be;
        let _t = self.timers.scope(name, TimerLevel::Fine).with_work(|| {
            // The rotated heads are read and written; the table's rows once.
            let heads = Span {
                len: r.n * r.heads * 2 * r.half,
                ..x
            };
            let table = r.table.sub(0, (2 * r.t * r.half).min(r.table.len));
            work::traffic(&*be, &[heads, table], &[heads], &[])
        });
        if backward {
            be.rope_backward(r, x);
        } else {
            be.rope_forward(r, x);
        }
    }

    /// `out = silu(gate)·up` of the `[gate | up]` rows `inp`, timed as `name`.
    pub fn swiglu(&mut self, name: &'static str, out: Span, inp: Span, f: usize) {
        let be = &mut *self.be;
        let _t = self
            .timers
            .scope(name, TimerLevel::Fine)
            .with_work(|| work::traffic(&*be, &[inp], &[out], &[]));
        be.swiglu_forward(out, inp, f);
    }

    /// SwiGLU's backward pass: `dinp` (`[dgate | dup]` rows) written, timed as `name`.
    pub fn swiglu_backward(
        &mut self,
        name: &'static str,
        (dinp, dout, inp): (Span, Span, Span),
        f: usize,
    ) {
        let be = &mut *self.be;
        let _t = self
            .timers
            .scope(name, TimerLevel::Fine)
            .with_work(|| work::traffic(&*be, &[dout, inp], &[dinp], &[]));
        be.swiglu_backward(dinp, dout, inp, f);
    }
}

/// What a linear layer's forward pass reads: its input, weight, bias and (in a residual
/// epilogue) the stream.
fn linear_reads(l: &Linear, inp: Span, stream: Option<Span>) -> Vec<Span> {
    [Some(inp), Some(l.w), l.bias, stream]
        .into_iter()
        .flatten()
        .collect()
}

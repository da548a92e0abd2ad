//! The GEMMs of the CUDA backend: row-major calls mapped onto cuBLAS's column-major ones
//! ([`column_major`]), a linear layer's forward, input-gradient and parameter-gradient GEMMs
//! (with cuBLASLt epilogues where they pay: bias, GELU, residual, bias gradient), batches
//! given as pointer arrays (the attention heads), and the uploaded problems of
//! `fugu bench gemm --device cuda`.

use super::engine::{Arg, Epilogue, GemmCall, NoEpilogue};
use super::{Backend, BiasGrad, CudaBackend, Dtype, Linear, Span, WeightLayout, K};
use anyhow::Result;

/// A GEMM operand: device address, leading dimension, batch stride (elements) and type.
pub(super) type Mat = (u64, usize, usize, Dtype);

/// The cuBLAS (column-major) call computing the row-major `C = alpha·op(A)·op(B) + beta·C`
/// (C m×n, `ta`/`tb`: A stored k×m, B stored n×k): `Cᵀ = op(B)ᵀ·op(A)ᵀ`, so A and B swap
/// places and m and n swap.
pub(super) fn column_major(
    p: Problem,
    (a, lda, sa, at): Mat,
    (b, ldb, sb, bt): Mat,
    (c, ldc, sc, ct): Mat,
    batch: usize,
) -> GemmCall {
    let Problem {
        trans: (ta, tb),
        mnk: (m, n, k),
        alpha,
        beta,
    } = p;
    GemmCall {
        a_type: bt,
        b_type: at,
        c_type: ct,
        trans_a: tb,
        trans_b: ta,
        m: n,
        n: m,
        k,
        alpha,
        a: b,
        lda: ldb,
        stride_a: sb,
        b: a,
        ldb: lda,
        stride_b: sa,
        beta,
        c,
        ldc,
        stride_c: sc,
        batch,
        epilogue: Epilogue::None,
    }
}

/// A row-major GEMM's shape and scalars: `C = alpha·op(A)·op(B) + beta·C` with C m×n and
/// `op(A)` m×k; `trans` says that A/B are stored transposed (A as k×m, B as n×k).
#[derive(Clone, Copy, Debug)]
pub(super) struct Problem {
    pub(super) trans: (bool, bool),
    pub(super) mnk: (usize, usize, usize),
    pub(super) alpha: f32,
    pub(super) beta: f32,
}

/// [`Problem`] from its parts, in the order of the formula.
pub(super) fn problem(
    trans: (bool, bool),
    mnk: (usize, usize, usize),
    alpha: f32,
    beta: f32,
) -> Problem {
    Problem {
        trans,
        mnk,
        alpha,
        beta,
    }
}

/// GEMM operands given one pointer per matrix: device addresses, leading dimension, type.
pub(super) type Ptrs = (Vec<u64>, usize, Dtype);

impl CudaBackend {
    /// A span as a GEMM operand with leading dimension `ld` (not batched).
    pub(super) fn mat(&self, s: Span, ld: usize) -> Mat {
        (self.ptr(s), ld, 0, self.dt(s))
    }

    /// Row-major GEMM, batched with strides: `C_i = alpha·op(A_i)·op(B_i) + beta·C_i`, where
    /// `C_i` is m×n (leading dimension `ldc`), `op(A_i)` m×k and `op(B_i)` k×n; `ta`/`tb` say
    /// that A/B are stored transposed (A as k×m, B as n×k, row-major). cuBLAS is column-major,
    /// so this computes `C_iᵀ = op(B_i)ᵀ·op(A_i)ᵀ`.
    pub(super) fn gemm(&self, what: &str, p: Problem, a: Mat, b: Mat, c: Mat, batch: usize) {
        let call = column_major(p, a, b, c, batch);
        self.queue_gemm(what, &call);
    }

    /// A linear layer's forward GEMM: `out (N, OC) = inp·W`, W the (IC, OC) matrix of
    /// y = x·W stored so (InOut) or transposed (OutIn).
    pub(super) fn linear_call(&self, l: &Linear, out: Span, inp: Span) -> GemmCall {
        let Linear {
            w,
            layout,
            n,
            ic,
            oc,
            ..
        } = *l;
        assert!(
            out.len == n * oc && inp.len == n * ic && w.len == ic * oc,
            "linear_forward"
        );
        let (tw, ldw) = match layout {
            WeightLayout::InOut => (false, oc),
            WeightLayout::OutIn => (true, ic),
        };
        let (a, b, c) = (self.mat(inp, ic), self.mat(w, ldw), self.mat(out, oc));
        column_major(problem((false, tw), (n, oc, ic), 1.0, 0.0), a, b, c, 1)
    }

    /// Panics (a bug in the model) unless `bias`, where given, has `oc` values of `out`'s type
    /// (or a bias gradient, of the weight gradient's).
    pub(super) fn check_bias(&self, what: &str, bias: Option<Span>, out: Span, oc: usize) {
        if let Some(b) = bias {
            assert!(
                b.len == oc && self.dt(b) == self.dt(out),
                "{what}: bias of {} {:?} values for {oc} outputs of {:?}",
                b.len,
                self.dt(b),
                self.dt(out)
            );
        }
    }

    /// A linear layer's input-gradient GEMM: `dinp (N, IC) = dout·Wᵀ`, the forward GEMM of
    /// a layer whose weight is W read transposed.
    pub(super) fn input_grad_call(&self, l: &Linear, dinp: Span, dout: Span) -> GemmCall {
        let back = Linear {
            layout: l.layout.transposed(),
            bias: None,
            ic: l.oc,
            oc: l.ic,
            ..*l
        };
        self.linear_call(&back, dinp, dout)
    }

    /// A linear layer's parameter gradients: `dw += inpᵀ·dout` (in W's layout) and `dbias +=`
    /// the column sums of `dout`.
    pub(super) fn linear_param_grads(
        &mut self,
        l: &Linear,
        (dw, dbias): (Span, Option<Span>),
        dout: Span,
        inp: Span,
    ) {
        let Linear {
            w,
            layout,
            n,
            ic,
            oc,
            ..
        } = *l;
        assert!(
            dout.len == n * oc && inp.len == n * ic && w.len == ic * oc,
            "linear_backward"
        );
        assert_eq!(dw.len, ic * oc, "linear_backward: dw length");
        let (i, d) = (self.mat(inp, ic), self.mat(dout, oc));
        let call = match layout {
            // dW (IC, OC) += inpᵀ·dout
            WeightLayout::InOut => column_major(
                problem((true, false), (ic, oc, n), 1.0, 1.0),
                i,
                d,
                self.mat(dw, oc),
                1,
            ),
            // dW (OC, IC) += doutᵀ·inp
            WeightLayout::OutIn => column_major(
                problem((true, false), (oc, ic, n), 1.0, 1.0),
                d,
                i,
                self.mat(dw, ic),
                1,
            ),
        };
        let Some(dbias) = dbias else {
            return self.queue_gemm("linear_backward", &call);
        };
        self.check_bias("linear_backward", Some(dbias), dw, oc);
        if self.bias_grad == BiasGrad::Epilogue {
            // The bias gradient (the sums of dout over its rows) into a scratch vector by the
            // GEMM, which reads dout as cuBLAS's A (its rows the output features) for InOut and
            // as B for OutIn ([`column_major`] swaps the operands); then added, as gradients
            // accumulate.
            let sums = self.scratch(|s| &mut s.bias_grad_sums, self.dt(dbias).bytes() * oc);
            let of_a = layout == WeightLayout::InOut;
            if self.try_epilogue(&call, Epilogue::BiasGrad { grad: sums, of_a }) {
                let args = [
                    Arg::Ptr(self.ptr(dbias)),
                    Arg::Ptr(sums),
                    Arg::I64(oc as i64),
                ];
                return self.launch_packs(K::add_inplace, self.dt(dbias), oc, &args);
            }
        }
        self.queue_gemm("linear_backward", &call);
        self.column_sums(dbias, None, dout, n, oc);
    }

    /// Queues `call` with `epilogue` if the engine runs it: false (nothing queued) where the
    /// call does not meet the epilogue's alignment ([`GemmCall::check_epilogue`]), the
    /// product is empty, or the engine has no such epilogue for the shape (noted on stderr
    /// once, and remembered: the caller does the epilogue's work with kernels).
    pub(super) fn try_epilogue(&mut self, call: &GemmCall, epilogue: Epilogue) -> bool {
        let call = GemmCall { epilogue, ..*call };
        let shape = (
            epilogue.name(),
            (call.m, call.n, call.k),
            (call.trans_a, call.trans_b),
            (call.a_type, call.c_type),
        );
        if call.is_empty() || call.check_epilogue().is_err() || self.no_epilogue.contains(&shape) {
            return false;
        }
        match self.eng.gemm(&call) {
            Ok(()) => true,
            Err(e) if e.is::<NoEpilogue>() => {
                eprintln!(
                    "note: a linear layer's GEMM (cuBLAS m {}, n {}, k {}, {} → {}): {e:#}; its \
                     {} epilogue is done by kernels instead",
                    call.m,
                    call.n,
                    call.k,
                    call.a_type.name(),
                    call.c_type.name(),
                    epilogue.name()
                );
                self.no_epilogue.insert(shape);
                false
            }
            Err(e) => self.fail("linear layer", e),
        }
    }

    /// Queues `call` (nothing for an empty product).
    pub(super) fn queue_gemm(&self, what: &str, call: &GemmCall) {
        if call.is_empty() {
            return;
        }
        if let Err(e) = self.eng.gemm(call) {
            self.fail(what, e);
        }
    }

    /// [`Self::gemm`] over matrices given one pointer each (`Ptrs`: pointers, leading
    /// dimension, type), for batches whose strides are not uniform (the attention heads of
    /// every sequence at once). The pointer arrays are uploaded once and cached by content.
    pub(super) fn gemm_ptrs(&mut self, what: &str, p: Problem, a: &Ptrs, b: &Ptrs, c: &Ptrs) {
        let (m, n) = (p.mnk.0, p.mnk.1);
        let batch = c.0.len();
        assert!(
            a.0.len() == batch && b.0.len() == batch,
            "{what}: pointer counts"
        );
        if m == 0 || n == 0 || batch == 0 {
            return;
        }
        // cuBLAS cannot see the alignment of pointers in an array and assumes 16 bytes (a
        // misaligned one faults). Odd shapes (head sizes or row offsets that are not a
        // multiple of 16 bytes) run one plain GEMM per matrix instead.
        let aligned =
            |(p, ld, dt): &Ptrs| p.iter().all(|x| x % 16 == 0) && (ld * dt.bytes()) % 16 == 0;
        if ![a, b, c].into_iter().all(aligned) {
            for i in 0..batch {
                self.gemm(
                    what,
                    p,
                    (a.0[i], a.1, 0, a.2),
                    (b.0[i], b.1, 0, b.2),
                    (c.0[i], c.1, 0, c.2),
                    1,
                );
            }
            return;
        }
        // Column-major: C_iᵀ = op(B_i)ᵀ·op(A_i)ᵀ, as in `gemm`.
        let key: Vec<u64> = b.0.iter().chain(&a.0).chain(&c.0).copied().collect();
        let base = self.table(key, "pointer arrays");
        // The matrices come from the arrays; addresses and strides in the call are unused.
        let call = column_major(
            p,
            (0, a.1, 0, a.2),
            (0, b.1, 0, b.2),
            (0, c.1, 0, c.2),
            batch,
        );
        let arrays = [base, base + 8 * batch as u64, base + 16 * batch as u64];
        if let Err(e) = self.eng.gemm_ptr_arrays(&call, arrays) {
            self.fail(what, e);
        }
    }

    /// Uploads a row-major strided-batched GEMM problem `C_i (m×n) = A_i·B_i` for the GEMM
    /// benchmark (`fugu bench gemm --device cuda`): `ta`/`tb` store A as k×m and B as n×k,
    /// as the benchmark's shapes do; A and B are stored as `operands` (rounded to it), C as
    /// `out`. Run it with [`Self::run_gemm`], read C and free it with [`Self::finish_gemm`].
    pub fn upload_gemm(
        &mut self,
        a: &[f32],
        b: &[f32],
        (m, n, k, batch): (usize, usize, usize, usize),
        (ta, tb): (bool, bool),
        (operands, out): (Dtype, Dtype),
    ) -> Result<DeviceGemm> {
        anyhow::ensure!(
            a.len() == batch * m * k && b.len() == batch * k * n,
            "upload_gemm: operand lengths"
        );
        let (ab, bb, cb) = (
            self.alloc(a.len(), operands)?,
            self.alloc(b.len(), operands)?,
            self.alloc(batch * m * n, out)?,
        );
        let spans = [self.whole(ab), self.whole(bb), self.whole(cb)];
        self.upload(spans[0], a);
        self.upload(spans[1], b);
        Ok(DeviceGemm {
            spans,
            dims: (m, n, k, batch),
            trans: (ta, tb),
        })
    }

    /// Queues one run of an uploaded GEMM.
    pub fn run_gemm(&self, g: &DeviceGemm) {
        let (m, n, k, batch) = g.dims;
        let (ta, tb) = g.trans;
        let [a, b, c] = g.spans;
        let lda = if ta { m } else { k };
        let ldb = if tb { k } else { n };
        self.gemm(
            "bench gemm",
            problem(g.trans, (m, n, k), 1.0, 0.0),
            (self.ptr(a), lda, m * k, self.dt(a)),
            (self.ptr(b), ldb, k * n, self.dt(b)),
            (self.ptr(c), n, m * n, self.dt(c)),
            batch,
        );
    }

    /// C of an uploaded GEMM (after all queued runs), and its buffers freed.
    pub fn finish_gemm(&mut self, g: DeviceGemm) -> Vec<f32> {
        let c = g.spans[2];
        let mut out = vec![0.0f32; c.len];
        self.download(c, &mut out);
        for s in g.spans {
            self.free(s.buf);
        }
        out
    }
}

/// A GEMM problem on the device for the GEMM benchmark ([`CudaBackend::upload_gemm`]).
pub struct DeviceGemm {
    /// A, B, C.
    spans: [Span; 3],
    dims: (usize, usize, usize, usize),
    trans: (bool, bool),
}

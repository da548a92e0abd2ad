//! Fully connected layer `y = x·W + bias` on the GEMM hooks.

use super::float::{gemm_into_stored, gemm_stored};
use super::{add_column_sums, Float, Mat, MatMutT, Precision};
use rayon::prelude::*;

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `W` is (in, out) row-major: `y = x·W` (Hugging Face GPT-2 `Conv1D`).
    InOut,
    /// `W` is (out, in) row-major: `y = x·Wᵀ` (`nn.Linear`; the tied `wte` as LM head).
    OutIn,
}

impl WeightLayout {
    /// The same storage read as the transposed weight (OC, IC): the layout of `Wᵀ` in
    /// `dx = dy·Wᵀ`, a linear layer's input gradient.
    pub fn transposed(self) -> WeightLayout {
        match self {
            WeightLayout::InOut => WeightLayout::OutIn,
            WeightLayout::OutIn => WeightLayout::InOut,
        }
    }
}

/// `W` as the (IC, OC) matrix of `y = x·W`, whatever its storage.
fn w_view<T>(w: &[T], layout: WeightLayout, ic: usize, oc: usize) -> Mat<'_, T> {
    match layout {
        WeightLayout::InOut => Mat::row_major(w, ic, oc),
        WeightLayout::OutIn => Mat::row_major(w, oc, ic).t(),
    }
}

/// `out = inp·W + bias`.
///
/// * `out`: (N, OC), **overwritten**; `inp`: (N, IC); `w`: IC·OC elements in `layout`;
///   `bias`: (OC) or `None`.
///
/// With a bias, the rows of `out` are first set to it and the GEMM adds with `beta = 1`.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward<T: Float>(
    prec: Precision,
    out: &mut [T],
    inp: &[T],
    w: &[T],
    layout: WeightLayout,
    bias: Option<&[T]>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    linear_onto(prec, out, None, inp, w, layout, bias, n, ic, oc);
}

/// `out = resid + inp·W + bias`: a linear layer whose output joins the residual stream.
///
/// * `out`: (N, OC), **overwritten**; `resid`: (N, OC); the rest as in [`linear_forward`].
///
/// The rows of `out` are first set to `resid` (plus the bias) and the GEMM adds with
/// `beta = 1`: one pass over the output instead of the two of [`linear_forward`] then
/// [`crate::ops::residual::residual_forward`].
#[allow(clippy::too_many_arguments)]
pub fn linear_residual_forward<T: Float>(
    prec: Precision,
    out: &mut [T],
    resid: &[T],
    inp: &[T],
    w: &[T],
    layout: WeightLayout,
    bias: Option<&[T]>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    assert_eq!(resid.len(), n * oc, "linear_residual_forward: resid length");
    linear_onto(prec, out, Some(resid), inp, w, layout, bias, n, ic, oc);
}

/// `out = start + inp·W`, where `start` is `resid` plus `bias` (each optional, zero when
/// both are absent): the rows of `out` are set to it and the GEMM adds with `beta = 1`.
#[allow(clippy::too_many_arguments)]
fn linear_onto<T: Float>(
    prec: Precision,
    out: &mut [T],
    resid: Option<&[T]>,
    inp: &[T],
    w: &[T],
    layout: WeightLayout,
    bias: Option<&[T]>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    check_forward(
        out.len(),
        inp.len(),
        w.len(),
        bias.map(<[T]>::len),
        (n, ic, oc),
    );
    let beta = start_rows(out, resid, bias, oc);
    T::gemm(
        prec,
        T::ONE,
        Mat::row_major(inp, n, ic),
        w_view(w, layout, ic, oc),
        beta,
        MatMutT::row_major(out, n, oc),
    );
}

/// Panics unless a linear layer's output, input, weight and bias lengths fit (N, IC, OC).
fn check_forward(
    out: usize,
    inp: usize,
    w: usize,
    bias: Option<usize>,
    (n, ic, oc): (usize, usize, usize),
) {
    assert_eq!(out, n * oc, "linear_forward: out length");
    assert_eq!(inp, n * ic, "linear_forward: inp length");
    assert_eq!(w, ic * oc, "linear_forward: weight length");
    if let Some(bias) = bias {
        assert_eq!(bias, oc, "linear_forward: bias length");
    }
}

/// Sets the rows of `out` (N, OC) to `resid + bias` (each optional) and returns the GEMM's
/// `beta`: 1 when it is to add onto them, 0 when there is nothing to add onto.
fn start_rows<T: Float>(out: &mut [T], resid: Option<&[T]>, bias: Option<&[T]>, oc: usize) -> T {
    match (resid, bias) {
        (None, None) => T::ZERO,
        _ if oc == 0 => T::ONE,
        (Some(resid), _) => {
            out.par_chunks_mut(oc)
                .zip(resid.par_chunks(oc))
                .for_each(|(row, r)| {
                    row.copy_from_slice(r);
                    if let Some(bias) = bias {
                        row.iter_mut().zip(bias).for_each(|(o, &b)| *o += b);
                    }
                });
            T::ONE
        }
        (None, Some(bias)) => {
            out.par_chunks_mut(oc)
                .for_each(|row| row.copy_from_slice(bias));
            T::ONE
        }
    }
}

/// [`linear_forward`] / [`linear_residual_forward`] (`resid`) on buffers as they are stored,
/// all of one type `E` (f32, or 16-bit values): `out` is written once, each element's f32 sum
/// (`resid + bias`, then `inp·W`) rounded to `E` ([`gemm_into_stored`]), the values of the f32
/// op on the same values rounded once, with no f32 copy of `out`.
#[allow(clippy::too_many_arguments)]
pub fn linear_into<E: fugu_gemm::Element>(
    prec: Precision,
    out: &mut [E],
    resid: Option<&[E]>,
    inp: &[E],
    w: &[E],
    layout: WeightLayout,
    bias: Option<&[E]>,
    n: usize,
    ic: usize,
    oc: usize,
) {
    check_forward(
        out.len(),
        inp.len(),
        w.len(),
        bias.map(<[E]>::len),
        (n, ic, oc),
    );
    if let Some(r) = resid {
        assert_eq!(r.len(), n * oc, "linear_forward: resid length");
    }
    let (a, b) = (Mat::row_major(inp, n, ic), w_view(w, layout, ic, oc));
    let c = resid.map(|r| Mat::row_major(r, n, oc));
    let d = MatMutT::row_major(out, n, oc);
    gemm_into_stored(prec, 1.0, a, b, 1.0, c, bias, d);
}

/// The input gradient's GEMM operands, `dout` (N, OC) and `Wᵀ` (OC, IC).
fn input_grad_operands<'a, T>(
    dout: &'a [T],
    w: &'a [T],
    layout: WeightLayout,
    n: usize,
    ic: usize,
    oc: usize,
) -> (Mat<'a, T>, Mat<'a, T>) {
    (Mat::row_major(dout, n, oc), w_view(w, layout, ic, oc).t())
}

/// The weight gradient's GEMM operands in the weight's layout: `inpᵀ`, `dout` for `InOut`
/// ((IC, OC) += (IC, N)·(N, OC)), `doutᵀ`, `inp` for `OutIn`; and the gradient's rows and
/// columns.
fn weight_grad_operands<'a, T>(
    dout: &'a [T],
    inp: &'a [T],
    layout: WeightLayout,
    n: usize,
    ic: usize,
    oc: usize,
) -> (Mat<'a, T>, Mat<'a, T>, usize, usize) {
    match layout {
        WeightLayout::InOut => (
            Mat::row_major(inp, n, ic).t(),
            Mat::row_major(dout, n, oc),
            ic,
            oc,
        ),
        WeightLayout::OutIn => (
            Mat::row_major(dout, n, oc).t(),
            Mat::row_major(inp, n, ic),
            oc,
            ic,
        ),
    }
}

/// [`linear_backward`]'s input gradient (`dinp`, overwritten) on buffers as they are stored,
/// all of one type: written once, rounded once ([`gemm_into_stored`]).
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_input_into<E: fugu_gemm::Element>(
    prec: Precision,
    dinp: &mut [E],
    dout: &[E],
    w: &[E],
    layout: WeightLayout,
    n: usize,
    ic: usize,
    oc: usize,
) {
    assert_eq!(dinp.len(), n * ic, "linear_backward: dinp length");
    let (a, b) = input_grad_operands(dout, w, layout, n, ic, oc);
    let d = MatMutT::row_major(dinp, n, ic);
    gemm_into_stored(prec, 1.0, a, b, 0.0, None, None, d);
}

/// [`linear_backward`]'s weight gradient (`dw`, accumulated) with `dout` and `inp` as stored.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward_weight_stored<E: fugu_gemm::Element>(
    prec: Precision,
    dw: &mut [f32],
    dout: &[E],
    inp: &[E],
    layout: WeightLayout,
    n: usize,
    ic: usize,
    oc: usize,
) {
    assert_eq!(dw.len(), ic * oc, "linear_backward: dw length");
    let (a, b, rows, cols) = weight_grad_operands(dout, inp, layout, n, ic, oc);
    gemm_stored(prec, 1.0, a, b, 1.0, MatMutT::row_major(dw, rows, cols));
}

/// Backward of [`linear_forward`].
///
/// * `dinp`: (N, IC), **overwritten** with `dout·Wᵀ` (GEMM `beta = 0`); skipped when `None`
///   (e.g. the first layer's input needs no gradient).
/// * `dw`: same layout and size as `w`, **accumulated** (`beta = 1`): `+= inpᵀ·dout` for
///   `InOut`, `+= doutᵀ·inp` for `OutIn`.
/// * `dbias`: (OC), **accumulated** with the column sums of `dout` (fixed blocks of rows summed
///   in order, then the blocks in order: `ops::add_column_sums`).
/// * `dout`: (N, OC); `inp`: (N, IC); `w` as in the forward pass.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<T: Float>(
    prec: Precision,
    dinp: Option<&mut [T]>,
    dw: &mut [T],
    dbias: Option<&mut [T]>,
    dout: &[T],
    inp: &[T],
    w: &[T],
    layout: WeightLayout,
    n: usize,
    ic: usize,
    oc: usize,
) {
    assert_eq!(dout.len(), n * oc, "linear_backward: dout length");
    assert_eq!(inp.len(), n * ic, "linear_backward: inp length");
    assert_eq!(w.len(), ic * oc, "linear_backward: weight length");
    assert_eq!(dw.len(), ic * oc, "linear_backward: dw length");
    if let Some(dinp) = dinp {
        assert_eq!(dinp.len(), n * ic, "linear_backward: dinp length");
        let (a, b) = input_grad_operands(dout, w, layout, n, ic, oc);
        T::gemm(prec, T::ONE, a, b, T::ZERO, MatMutT::row_major(dinp, n, ic));
    }
    let (a, b, rows, cols) = weight_grad_operands(dout, inp, layout, n, ic, oc);
    T::gemm(
        prec,
        T::ONE,
        a,
        b,
        T::ONE,
        MatMutT::row_major(dw, rows, cols),
    );
    if let Some(dbias) = dbias {
        assert_eq!(dbias.len(), oc, "linear_backward: dbias length");
        add_column_sums(dbias, dout, n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;
    use WeightLayout::*;

    #[allow(clippy::too_many_arguments)]
    fn forward(
        x: &[f64],
        w: &[f64],
        b: Option<&[f64]>,
        l: WeightLayout,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> Vec<f64> {
        let mut out = vec![f64::NAN; n * oc];
        linear_forward(Precision::F32, &mut out, x, w, l, b, n, ic, oc);
        out
    }

    /// `linear_residual_forward` is the stream plus `linear_forward` (f64: equal to
    /// rounding), with and without a bias, on shapes with one row or one output feature.
    #[test]
    fn residual_form_adds_the_stream() {
        for (n, ic, oc) in [(7, 5, 6), (1, 3, 9), (4, 6, 1)] {
            for layout in [InOut, OutIn] {
                let mut rng = Rng::new(31);
                let (x, w, b, r) = (
                    rng.vec(n * ic),
                    rng.vec(ic * oc),
                    rng.vec(oc),
                    rng.vec(n * oc),
                );
                for bias in [None, Some(&b[..])] {
                    let plain = forward(&x, &w, bias, layout, n, ic, oc);
                    let mut out = vec![f64::NAN; n * oc];
                    linear_residual_forward(
                        Precision::F32,
                        &mut out,
                        &r,
                        &x,
                        &w,
                        layout,
                        bias,
                        n,
                        ic,
                        oc,
                    );
                    for ((o, p), r) in out.iter().zip(&plain).zip(&r) {
                        assert!((o - (p + r)).abs() < 1e-12, "{o} vs {p} + {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (n, ic, oc) = (7, 5, 6);
        for layout in [InOut, OutIn] {
            let mut rng = Rng::new(30);
            let x = rng.vec(n * ic);
            let w = rng.vec(ic * oc);
            let b = rng.vec(oc);
            let dout = rng.vec(n * oc);
            // Forward against the definition.
            let out = forward(&x, &w, Some(&b), layout, n, ic, oc);
            for i in 0..n {
                for o in 0..oc {
                    let wio = |k: usize| match layout {
                        InOut => w[k * oc + o],
                        OutIn => w[o * ic + k],
                    };
                    let want: f64 = b[o] + (0..ic).map(|k| x[i * ic + k] * wio(k)).sum::<f64>();
                    assert!((out[i * oc + o] - want).abs() < 1e-12);
                }
            }
            let mut dx = vec![f64::NAN; n * ic]; // overwritten: NaN must not leak
            let (mut dw, mut db) = (vec![0.0; ic * oc], vec![0.0; oc]);
            linear_backward(
                Precision::F32,
                Some(&mut dx),
                &mut dw,
                Some(&mut db),
                &dout,
                &x,
                &w,
                layout,
                n,
                ic,
                oc,
            );
            check_grad("dinp", &x, &dx, |v| {
                dot(&dout, &forward(v, &w, Some(&b), layout, n, ic, oc))
            });
            check_grad("dw", &w, &dw, |v| {
                dot(&dout, &forward(&x, v, Some(&b), layout, n, ic, oc))
            });
            check_grad("dbias", &b, &db, |v| {
                dot(&dout, &forward(&x, &w, Some(v), layout, n, ic, oc))
            });
            // No bias.
            let nb = forward(&x, &w, None, layout, n, ic, oc);
            for i in 0..n * oc {
                assert!((nb[i] + b[i % oc] - out[i]).abs() < 1e-12);
            }
            // Second call: dinp overwritten (same), dw and dbias doubled.
            let (x1, w1, b1) = (dx.clone(), dw.clone(), db.clone());
            linear_backward(
                Precision::F32,
                Some(&mut dx),
                &mut dw,
                Some(&mut db),
                &dout,
                &x,
                &w,
                layout,
                n,
                ic,
                oc,
            );
            assert_eq!(dx, x1);
            assert!(dw.iter().zip(&w1).all(|(a, b)| (a - 2.0 * b).abs() < 1e-12));
            assert!(db.iter().zip(&b1).all(|(a, b)| (a - 2.0 * b).abs() < 1e-12));
            // Without dinp/dbias only dw moves.
            linear_backward(
                Precision::F32,
                None,
                &mut dw,
                None,
                &dout,
                &x,
                &w,
                layout,
                n,
                ic,
                oc,
            );
            assert!(dw.iter().zip(&w1).all(|(a, b)| (a - 3.0 * b).abs() < 1e-12));
        }
    }

    /// The f32 path (fugu-gemm, transposed and strided views) against the f64 loop, on shapes
    /// past the micro-tile edges.
    #[test]
    fn f32_matches_f64() {
        let (n, ic, oc) = (67, 40, 72);
        for layout in [InOut, OutIn] {
            let mut rng = Rng::new(31);
            let x = round_f32(&rng.vec(n * ic));
            let w = round_f32(&rng.vec(ic * oc));
            let b = round_f32(&rng.vec(oc));
            let dout = round_f32(&rng.vec(n * oc));
            let dw0 = round_f32(&rng.vec(ic * oc));
            let db0 = round_f32(&rng.vec(oc));

            let out64 = forward(&x, &w, Some(&b), layout, n, ic, oc);
            let mut out32 = vec![f32::NAN; n * oc];
            linear_forward(
                Precision::F32,
                &mut out32,
                &to_f32(&x),
                &to_f32(&w),
                layout,
                Some(&to_f32(&b)),
                n,
                ic,
                oc,
            );
            assert_close_f32("out", &out32, &out64, 2e-6);

            let (mut dx64, mut dw64, mut db64) = (vec![f64::NAN; n * ic], dw0.clone(), db0.clone());
            linear_backward(
                Precision::F32,
                Some(&mut dx64),
                &mut dw64,
                Some(&mut db64),
                &dout,
                &x,
                &w,
                layout,
                n,
                ic,
                oc,
            );
            let (mut dx32, mut dw32, mut db32) =
                (vec![f32::NAN; n * ic], to_f32(&dw0), to_f32(&db0));
            let (x32, w32, d32) = (to_f32(&x), to_f32(&w), to_f32(&dout));
            linear_backward(
                Precision::F32,
                Some(&mut dx32),
                &mut dw32,
                Some(&mut db32),
                &d32,
                &x32,
                &w32,
                layout,
                n,
                ic,
                oc,
            );
            assert_close_f32("dinp", &dx32, &dx64, 2e-6);
            assert_close_f32("dw", &dw32, &dw64, 2e-6);
            assert_close_f32("dbias", &db32, &db64, 2e-6);
        }
    }
}

//! SwiGLU, the gate of Llama's MLP: `out = silu(gate) · up`, `silu(x) = x·σ(x)`, on the fused
//! output of the gate and up projections: each row of the input is `[gate (F) | up (F)]`.

use super::{Float, ELEM_CHUNK};
use rayon::prelude::*;

/// `σ(x)` and `e^{−x}·σ(x)` (`1 − σ(x)` without the cancellation), the exponent capped at 80 so
/// that it stays finite in every type (past it, x below −80, σ is below 2e-35: 0 in the result).
#[inline(always)]
fn sigmoid<T: Float>(x: T) -> (T, T) {
    let cap = T::from_f64(80.0);
    let z = -x;
    let past = z > cap;
    let e = (if past { cap } else { z }).exp();
    let s = if past { T::ZERO } else { T::ONE / (T::ONE + e) };
    (s, e * s)
}

/// Rows of `inp` (`[gate | up]`, 2F wide) and of `out` (F wide) as parallel tasks of whole rows.
fn rows_per_task(f: usize) -> usize {
    (ELEM_CHUNK / f.max(1)).max(1)
}

/// `out = silu(gate) · up` per row: `out` (N, F) **overwritten**, `inp` (N, 2F).
pub fn swiglu_forward<T: Float>(out: &mut [T], inp: &[T], f: usize) {
    assert!(f > 0, "swiglu_forward: F must be positive");
    assert_eq!(inp.len(), 2 * out.len(), "swiglu_forward: inp length");
    assert!(out.len().is_multiple_of(f), "swiglu_forward: out length");
    let rows = rows_per_task(f);
    out.par_chunks_mut(rows * f)
        .zip(inp.par_chunks(rows * 2 * f))
        .for_each(|(o, x)| {
            for (o, x) in o.chunks_exact_mut(f).zip(x.chunks_exact(2 * f)) {
                let (gate, up) = x.split_at(f);
                T::swiglu_row(o, gate, up);
            }
        });
}

/// Backward of [`swiglu_forward`]: `dinp` (N, 2F) **overwritten** with `[dgate | dup]`,
/// `dgate = dout·up·silu'(gate)` with `silu' = σ·(1 + x·(1 − σ))`, `dup = dout·silu(gate)`;
/// `dout` (N, F), `inp` (N, 2F) the forward's input.
pub fn swiglu_backward<T: Float>(dinp: &mut [T], dout: &[T], inp: &[T], f: usize) {
    assert!(f > 0, "swiglu_backward: F must be positive");
    assert_eq!(inp.len(), 2 * dout.len(), "swiglu_backward: inp length");
    assert_eq!(dinp.len(), inp.len(), "swiglu_backward: dinp length");
    assert!(dout.len().is_multiple_of(f), "swiglu_backward: dout length");
    let rows = rows_per_task(f);
    dinp.par_chunks_mut(rows * 2 * f)
        .zip(dout.par_chunks(rows * f))
        .zip(inp.par_chunks(rows * 2 * f))
        .for_each(|((d, g), x)| {
            for ((d, g), x) in d
                .chunks_exact_mut(2 * f)
                .zip(g.chunks_exact(f))
                .zip(x.chunks_exact(2 * f))
            {
                let (gate, up) = x.split_at(f);
                let (dgate, dup) = d.split_at_mut(f);
                T::swiglu_backward_row((dgate, dup), g, gate, up);
            }
        });
}

/// One row's `out = silu(gate) · up` (`Float::swiglu_row` runs it, vectorised for the CPU in
/// f32).
#[inline(always)]
pub(crate) fn swiglu_row<T: Float>(out: &mut [T], gate: &[T], up: &[T]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = g * sigmoid(g).0 * u;
    }
}

/// One row's backward pass ([`swiglu_backward`]'s formulas).
#[inline(always)]
pub(crate) fn swiglu_backward_row<T: Float>(
    (dgate, dup): (&mut [T], &mut [T]),
    dout: &[T],
    gate: &[T],
    up: &[T],
) {
    for ((((dg, du), &go), &a), &u) in dgate.iter_mut().zip(dup).zip(dout).zip(gate).zip(up) {
        let (s, one_minus_s) = sigmoid(a);
        let silu = a * s;
        *dg = go * u * (s * (T::ONE + a * one_minus_s));
        *du = go * silu;
    }
}

super::row_isa::dispatch_rows! {
    /// [`swiglu_row`] in f32 with the widest vectors the CPU has (no SVE kernel yet).
    pub(crate) fn swiglu_row_f32(out: &mut [f32], gate: &[f32], up: &[f32]) = swiglu_row::<f32>;
}

super::row_isa::dispatch_rows! {
    /// [`swiglu_backward_row`] in f32 with the widest vectors the CPU has (no SVE kernel yet).
    pub(crate) fn swiglu_backward_row_f32(
        d: (&mut [f32], &mut [f32]),
        dout: &[f32],
        gate: &[f32],
        up: &[f32],
    ) = swiglu_backward_row::<f32>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    fn forward(inp: &[f64], f: usize) -> Vec<f64> {
        let mut out = vec![f64::NAN; inp.len() / 2];
        swiglu_forward(&mut out, inp, f);
        out
    }

    /// Against the definition and central differences, with gates from −6 to 6 and two very
    /// negative ones (the capped exponent).
    #[test]
    fn matches_the_definition_and_finite_differences() {
        let (n, f) = (5, 7);
        let mut rng = Rng::new(60);
        let mut inp: Vec<f64> = rng.vec(n * 2 * f).iter().map(|x| 6.0 * x).collect();
        inp[0] = -200.0;
        inp[2 * f + 1] = -90.0;
        let out = forward(&inp, f);
        for r in 0..n {
            for j in 0..f {
                let (g, u) = (inp[r * 2 * f + j], inp[r * 2 * f + f + j]);
                let want = g / (1.0 + (-g).exp()) * u;
                assert!((out[r * f + j] - want).abs() < 1e-14, "[{r}, {j}]");
            }
        }
        let dout = rng.vec(n * f);
        let mut dinp = vec![f64::NAN; inp.len()];
        swiglu_backward(&mut dinp, &dout, &inp, f);
        check_grad("dinp", &inp, &dinp, |x| dot(&dout, &forward(x, f)));
    }

    /// f32 within rounding of f64 over many rows (several tasks), whatever the threads.
    #[test]
    fn f32_matches_f64_and_is_thread_count_independent() {
        let (n, f) = (70, 200);
        let mut rng = Rng::new(61);
        let inp = round_f32(
            &rng.vec(n * 2 * f)
                .iter()
                .map(|x| 8.0 * x)
                .collect::<Vec<_>>(),
        );
        let dout = round_f32(&rng.vec(n * f));
        let out = forward(&inp, f);
        let mut dinp = vec![0.0; inp.len()];
        swiglu_backward(&mut dinp, &dout, &inp, f);
        let run = |threads| {
            with_threads(threads, || {
                let (inp, dout) = (to_f32(&inp), to_f32(&dout));
                let mut out = vec![0.0f32; n * f];
                swiglu_forward(&mut out, &inp, f);
                let mut dinp = vec![0.0f32; inp.len()];
                swiglu_backward(&mut dinp, &dout, &inp, f);
                (out, dinp)
            })
        };
        let (o32, d32) = run(1);
        assert_close_f32("out", &o32, &out, 1e-6);
        assert_close_f32("dinp", &d32, &dinp, 1e-6);
        assert_eq!(run(2), (o32, d32));
    }
}

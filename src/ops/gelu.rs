//! GELU, tanh approximation (GPT-2; PyTorch `gelu(approximate="tanh")`):
//! `gelu(x) = 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³)))`.

use super::{Float, ELEM_CHUNK};
use rayon::prelude::*;

const GELU_COEFF: f64 = 0.044715;

fn sqrt_2_over_pi<T: Float>() -> T {
    T::from_f64((2.0 / std::f64::consts::PI).sqrt())
}

/// `out = gelu(inp)` elementwise; `out` (any length, equal to `inp`'s) is **overwritten**.
pub fn gelu_forward<T: Float>(out: &mut [T], inp: &[T]) {
    assert_eq!(out.len(), inp.len(), "gelu_forward: lengths differ");
    out.par_chunks_mut(ELEM_CHUNK)
        .zip(inp.par_chunks(ELEM_CHUNK))
        .for_each(|(o, x)| T::gelu_rows(o, x));
}

/// `dinp = dout · gelu'(inp)` elementwise; `dinp` is **overwritten** (not accumulated).
pub fn gelu_backward<T: Float>(dinp: &mut [T], inp: &[T], dout: &[T]) {
    assert_eq!(dinp.len(), inp.len(), "gelu_backward: dinp length");
    assert_eq!(dout.len(), inp.len(), "gelu_backward: dout length");
    dinp.par_chunks_mut(ELEM_CHUNK)
        .zip(inp.par_chunks(ELEM_CHUNK))
        .zip(dout.par_chunks(ELEM_CHUNK))
        .for_each(|((d, x), g)| T::gelu_backward_rows(d, x, g));
}

/// `σ(2u)` and `e^{−2u}·σ(2u)` (which is `1 − σ(2u)` without the cancellation) of
/// `gelu(x) = x·σ(2u)`, `u = sqrt(2/π)·(x + 0.044715·x³)`. The exponent is capped at 80 so that
/// `e^{−2u}` stays finite in every type; past the cap (x below about −9.5, σ(2u) < 1.8e-35) both are
/// exactly 0, so GELU and its derivative are 0 there however large |x|.
#[inline(always)]
fn sigma_2u<T: Float>(x: T) -> (T, T) {
    let z = T::from_f64(-2.0) * sqrt_2_over_pi::<T>() * (x + T::from_f64(GELU_COEFF) * x * x * x);
    let cap = T::from_f64(80.0);
    let past = z > cap;
    let e = (if past { cap } else { z }).exp();
    let s = if past { T::ZERO } else { T::ONE / (T::ONE + e) };
    (s, e * s)
}

/// The forward loop over one chunk (`Float::gelu_rows` runs it, vectorised for the CPU), as
/// `x·σ(2u)`: the tanh form's function (`(1 + tanh u)/2 = σ(2u)`) with one exponential and one
/// division, nothing that cancels (fugu-rows' SVE kernel computes the same form).
#[inline(always)]
pub(crate) fn gelu_rows<T: Float>(out: &mut [T], inp: &[T]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        *o = x * sigma_2u(x).0;
    }
}

/// The backward loop over one chunk (`Float::gelu_backward_rows`): with `s = σ(2u) = 1/(1 + e)`,
/// `e = e^{−2u}`, `gelu' = s + x·s·(1 − s)·2u'` and `1 − s = e·s` (not `1 − s`, which cancels
/// for large x), `2u' = 2·sqrt(2/π)·(1 + 3·0.044715·x²)`.
#[inline(always)]
pub(crate) fn gelu_backward_rows<T: Float>(dinp: &mut [T], inp: &[T], dout: &[T]) {
    let two_k = T::from_f64(2.0) * sqrt_2_over_pi::<T>();
    let a3 = T::from_f64(3.0 * GELU_COEFF);
    for ((d, &x), &g) in dinp.iter_mut().zip(inp).zip(dout) {
        let (s, es) = sigma_2u(x);
        let du2 = two_k * (T::ONE + a3 * x * x);
        *d = g * (s + x * s * es * du2);
    }
}

super::row_isa::dispatch_rows! {
    /// [`gelu_rows`] in f32 with the widest vectors the CPU has.
    pub(crate) fn gelu_rows_f32(out: &mut [f32], inp: &[f32]) = gelu_rows::<f32>;
    sve = fugu_rows::sve::Sve::gelu;
}

super::row_isa::dispatch_rows! {
    /// [`gelu_backward_rows`] in f32 with the widest vectors the CPU has.
    pub(crate) fn gelu_backward_rows_f32(dinp: &mut [f32], inp: &[f32], dout: &[f32]) =
        gelu_backward_rows::<f32>;
    sve = fugu_rows::sve::Sve::gelu_backward;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    #[test]
    fn gradient_matches_finite_differences() {
        let mut rng = Rng::new(50);
        let x: Vec<f64> = rng.vec(37).iter().map(|v| 4.0 * v).collect();
        let dout = rng.vec(37);
        let f = |x: &[f64]| {
            let mut y = vec![0.0; x.len()];
            gelu_forward(&mut y, x);
            y
        };
        // Known values: gelu(0) = 0, gelu(±1) from Python math (tanh form).
        let y = f(&[0.0, 1.0, -1.0]);
        assert_eq!(y[0], 0.0);
        assert!((y[1] - 0.841_191_990_608_276_8).abs() < 1e-12);
        assert!((y[2] + 0.158_808_009_391_723_24).abs() < 1e-12);
        let mut dx = vec![f64::NAN; 37];
        gelu_backward(&mut dx, &x, &dout);
        check_grad("dinp", &x, &dx, |v| dot(&dout, &f(v)));
    }

    #[test]
    fn f32_matches_f64() {
        let mut rng = Rng::new(51);
        let n = 3 * ELEM_CHUNK + 5;
        let x = round_f32(&rng.vec(n).iter().map(|v| 5.0 * v).collect::<Vec<_>>());
        let g = round_f32(&rng.vec(n));
        let (mut y64, mut d64) = (vec![0.0; n], vec![0.0; n]);
        gelu_forward(&mut y64, &x);
        gelu_backward(&mut d64, &x, &g);
        let (mut y32, mut d32) = (vec![0.0f32; n], vec![0.0f32; n]);
        gelu_forward(&mut y32, &to_f32(&x));
        gelu_backward(&mut d32, &to_f32(&x), &to_f32(&g));
        assert_close_f32("out", &y32, &y64, 1e-6);
        assert_close_f32("dinp", &d32, &d64, 1e-6);
    }

    /// Far from 0 the σ form neither overflows nor cancels: GELU is x above and 0 below, its
    /// derivative 1 and 0, in f32 and f64 alike, and the tanh form agrees in between (f64, the
    /// definition GPT-2 uses).
    #[test]
    fn tails_are_finite_and_the_form_is_the_tanh_form() {
        let x = [-1e4, -300.0, -30.0, -13.0, 12.0, 30.0, 300.0, 1e4];
        let want_y = [0.0, 0.0, 0.0, 0.0, 12.0, 30.0, 300.0, 1e4];
        let want_d = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let (mut y, mut d) = (vec![0.0f64; x.len()], vec![0.0f64; x.len()]);
        gelu_forward(&mut y, &x);
        gelu_backward(&mut d, &x, &[1.0; 8]);
        let x32 = x.map(|v| v as f32);
        let (mut y32, mut d32) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
        gelu_forward(&mut y32, &x32);
        gelu_backward(&mut d32, &x32, &[1.0; 8]);
        for i in 0..x.len() {
            for (what, got, want) in [
                ("gelu f64", y[i], want_y[i]),
                ("gelu' f64", d[i], want_d[i]),
                ("gelu f32", y32[i] as f64, want_y[i]),
                ("gelu' f32", d32[i] as f64, want_d[i]),
            ] {
                assert!(
                    (got - want).abs() <= 1e-6 * want.abs().max(1e-20),
                    "{what}({}) = {got:e}, want {want:e}",
                    x[i]
                );
            }
        }
        let k = (2.0 / std::f64::consts::PI).sqrt();
        for i in 0..=200 {
            let x = -8.0 + 0.08 * i as f64;
            let tanh_form = 0.5 * x * (1.0 + (k * (x + GELU_COEFF * x * x * x)).tanh());
            let mut y = [0.0f64];
            gelu_forward(&mut y, &[x]);
            assert!(
                (y[0] - tanh_form).abs() <= 1e-15,
                "gelu({x}): {} vs {tanh_form}",
                y[0]
            );
        }
    }

    /// The dispatched f32 loops give the portable loops' results (bit for bit where
    /// [`RowIsa::bit_identical_to_portable`](crate::ops::row_isa::RowIsa)).
    #[test]
    fn dispatched_rows_match_the_portable_loops() {
        let x: Vec<f32> = (0..1001).map(|i| (i as f32 - 500.0) * 0.013).collect();
        let g: Vec<f32> = (0..1001)
            .map(|i| ((i * 37) % 101) as f32 * 0.01 - 0.5)
            .collect();
        let (mut a, mut b) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
        gelu_rows_f32(&mut a, &x);
        gelu_rows::<f32>(&mut b, &x);
        assert_rows_match(&a, &b);
        gelu_backward_rows_f32(&mut a, &x, &g);
        gelu_backward_rows::<f32>(&mut b, &x, &g);
        assert_rows_match(&a, &b);
    }
}

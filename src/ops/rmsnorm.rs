//! Root-mean-square normalisation over the last dimension (Llama's `LlamaRMSNorm`):
//! `out = w · (x · rstd)`, `rstd = 1/sqrt(mean(x²) + eps)`, no mean subtracted, no bias.

use super::layernorm::{lane_sum, SUM_LANES};
use super::Float;
use rayon::prelude::*;

/// `out = w · (inp · rstd)` per row.
///
/// * `out`: (N, C), **overwritten**; `rstd`: (N), **overwritten** (kept for the backward
///   pass); `inp`: (N, C); `w`: (C); `eps` the config's `rms_norm_eps`.
///
/// The mean square is accumulated in f64 (in fixed lanes), `rstd` rounded to `T`, and the
/// normalisation uses the rounded `rstd`, so the backward pass sees what the forward used. The
/// order of the products is `transformers`': `x·rstd` first, then the weight. Parallel over
/// rows.
pub fn rmsnorm_forward<T: Float>(out: &mut [T], rstd: &mut [T], inp: &[T], w: &[T], eps: f64) {
    let c = w.len();
    assert!(c > 0, "rmsnorm_forward: C must be positive");
    let n = rstd.len();
    assert_eq!(out.len(), n * c, "rmsnorm_forward: out length");
    assert_eq!(inp.len(), n * c, "rmsnorm_forward: inp length");
    out.par_chunks_mut(c)
        .zip(rstd.par_iter_mut())
        .zip(inp.par_chunks(c))
        .for_each(|((o, r), x)| {
            let ms = lane_sum(x, |v| v.to_f64() * v.to_f64()) / c as f64;
            *r = T::from_f64(1.0 / (ms + eps).sqrt());
            for ((o, &v), &wj) in o.iter_mut().zip(x).zip(w) {
                *o = wj * (v * *r);
            }
        });
}

/// Backward of [`rmsnorm_forward`].
///
/// * `dinp`: (N, C), **accumulated** (`+=`; it is the residual stream's gradient).
/// * `dw`: (C), **accumulated**: `Σ_rows dout·x̂`.
/// * `dout`, `inp`: (N, C); `w`: (C); `rstd`: (N) from the forward pass.
///
/// Per row, with `x̂ = inp·rstd` and `g = dout·w`: `dinp += rstd·(g − x̂·mean(g·x̂))`, the mean
/// accumulated in f64 lanes. `dw` is summed over each block of rows in order, then over the
/// blocks in order (`ops::ROW_BLOCK`), so the result is independent of the thread count.
pub fn rmsnorm_backward<T: Float>(
    dinp: &mut [T],
    dw: &mut [T],
    dout: &[T],
    inp: &[T],
    w: &[T],
    rstd: &[T],
) {
    let c = w.len();
    assert!(c > 0, "rmsnorm_backward: C must be positive");
    let n = rstd.len();
    assert_eq!(dinp.len(), n * c, "rmsnorm_backward: dinp length");
    assert_eq!(dout.len(), n * c, "rmsnorm_backward: dout length");
    assert_eq!(inp.len(), n * c, "rmsnorm_backward: inp length");
    assert_eq!(dw.len(), c, "rmsnorm_backward: dw length");
    let mut partials = super::block_partials::<T>(n, c);
    rmsnorm_backward_blocks(dinp, &mut partials, dout, inp, w, rstd);
    super::add_block_partials(dw, &partials, c, 0);
}

/// The rows' part of [`rmsnorm_backward`], for rows that start a [`super::ROW_BLOCK`] block:
/// `dinp` accumulated as there, and each block's partial `dw` (C) **overwritten** in
/// `partials`, to be added in block order ([`super::add_block_partials`]).
pub fn rmsnorm_backward_blocks<T: Float>(
    dinp: &mut [T],
    partials: &mut [T],
    dout: &[T],
    inp: &[T],
    w: &[T],
    rstd: &[T],
) {
    let (c, n, rows) = (w.len(), rstd.len(), super::ROW_BLOCK);
    assert_eq!(
        partials.len(),
        n.div_ceil(rows) * c,
        "rmsnorm_backward: partials length"
    );
    partials
        .par_chunks_mut(c)
        .zip(dinp.par_chunks_mut(rows * c))
        .zip(dout.par_chunks(rows * c))
        .zip(inp.par_chunks(rows * c))
        .zip(rstd.par_chunks(rows))
        .for_each(|((((pw, di), g), x), rs)| {
            pw.fill(T::ZERO);
            for (((di, g), x), &rs) in di
                .chunks_exact_mut(c)
                .zip(g.chunks_exact(c))
                .zip(x.chunks_exact(c))
                .zip(rs)
            {
                let mut lanes = [0.0f64; SUM_LANES];
                for (j, ((&gj, &xj), &wj)) in g.iter().zip(x).zip(w).enumerate() {
                    lanes[j % SUM_LANES] += (gj * wj * (xj * rs)).to_f64();
                }
                let m = T::from_f64(lanes.iter().sum::<f64>() / c as f64);
                for ((((d, &gj), &xj), &wj), pwj) in
                    di.iter_mut().zip(g).zip(x).zip(w).zip(pw.iter_mut())
                {
                    let xhat = xj * rs;
                    *d += (gj * wj - xhat * m) * rs;
                    *pwj += gj * xhat;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    const EPS: f64 = 1e-6;

    fn forward(inp: &[f64], w: &[f64], n: usize) -> Vec<f64> {
        let mut out = vec![f64::NAN; inp.len()];
        let mut r = vec![0.0; n];
        rmsnorm_forward(&mut out, &mut r, inp, w, EPS);
        out
    }

    /// Against the definition, and every gradient element against central differences; the
    /// backward accumulates.
    #[test]
    fn gradients_match_finite_differences() {
        let (n, c) = (7, 13);
        let mut rng = Rng::new(40);
        let inp: Vec<f64> = rng.vec(n * c).iter().map(|x| 2.0 * x + 0.3).collect();
        let w = rng.vec(c);
        let dout = rng.vec(n * c);
        let mut out = vec![0.0; n * c];
        let mut rstd = vec![0.0; n];
        rmsnorm_forward(&mut out, &mut rstd, &inp, &w, EPS);
        for i in 0..n {
            let x = &inp[i * c..(i + 1) * c];
            let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / c as f64 + EPS).sqrt();
            assert!((rstd[i] - r).abs() < 1e-13);
            for j in 0..c {
                assert!((out[i * c + j] - w[j] * x[j] * r).abs() < 1e-13);
            }
        }
        let base = rng.vec(n * c);
        let mut dinp = base.clone();
        let mut dw = vec![0.0; c];
        rmsnorm_backward(&mut dinp, &mut dw, &dout, &inp, &w, &rstd);
        let dx: Vec<f64> = dinp.iter().zip(&base).map(|(a, b)| a - b).collect();
        check_grad("dinp", &inp, &dx, |x| dot(&dout, &forward(x, &w, n)));
        check_grad("dw", &w, &dw, |x| dot(&dout, &forward(&inp, x, n)));
        let (d1, w1) = (dinp.clone(), dw.clone());
        rmsnorm_backward(&mut dinp, &mut dw, &dout, &inp, &w, &rstd);
        for i in 0..n * c {
            assert!((dinp[i] - (d1[i] + dx[i])).abs() < 1e-12);
        }
        assert!(dw.iter().zip(&w1).all(|(a, b)| (a - 2.0 * b).abs() < 1e-12));
    }

    /// f32 within rounding of f64 on rows past one block (`ROW_BLOCK`), and the same bits on 1
    /// and 2 threads.
    #[test]
    fn f32_matches_f64_and_is_thread_count_independent() {
        let (n, c) = (130, 40);
        let mut rng = Rng::new(41);
        let inp: Vec<f64> = rng.vec(n * c).iter().map(|x| 3.0 * x + 1.0).collect();
        let inp = round_f32(&inp);
        let w = round_f32(&rng.vec(c));
        let dout = round_f32(&rng.vec(n * c));
        let mut out = vec![0.0; n * c];
        let mut r = vec![0.0; n];
        rmsnorm_forward(&mut out, &mut r, &inp, &w, EPS);
        let (mut di, mut dw) = (vec![0.0; n * c], vec![0.0; c]);
        rmsnorm_backward(&mut di, &mut dw, &dout, &inp, &w, &r);
        let run32 = |threads| {
            with_threads(threads, || {
                let (inp, w, dout) = (to_f32(&inp), to_f32(&w), to_f32(&dout));
                let mut out = vec![0.0f32; n * c];
                let mut r = vec![0.0f32; n];
                rmsnorm_forward(&mut out, &mut r, &inp, &w, EPS);
                let (mut di, mut dw) = (vec![0.0f32; n * c], vec![0.0f32; c]);
                rmsnorm_backward(&mut di, &mut dw, &dout, &inp, &w, &r);
                (out, di, dw)
            })
        };
        let (o32, di32, dw32) = run32(1);
        // Each output a few f32 roundings of O(1) values; dw sums 130 terms of O(1).
        assert_close_f32("out", &o32, &out, 1e-5);
        assert_close_f32("dinp", &di32, &di, 1e-5);
        assert_close_f32("dw", &dw32, &dw, 1e-4);
        assert_eq!(run32(2), (o32, di32, dw32), "threads change the bits");
    }
}

//! Layer normalisation over the last dimension (PyTorch `nn.LayerNorm`: biased variance).

use super::Float;
use rayon::prelude::*;

/// The epsilon added to the variance (PyTorch's and GPT-2's default).
pub const LN_EPS: f64 = 1e-5;

/// `out = (inp - mean) * rstd * w + bias` per row.
///
/// * `out`: (N, C), **overwritten**; `mean`, `rstd`: (N), **overwritten** (kept for the
///   backward pass); `inp`: (N, C); `w`, `bias`: (C).
///
/// Mean and (biased) variance are accumulated in `f64` with two passes over the row, then
/// rounded to `T`; the normalisation itself uses the rounded `mean`/`rstd`, so the backward pass
/// sees exactly what the forward used. Parallel over rows.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward<T: Float>(
    out: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
    inp: &[T],
    w: &[T],
    bias: &[T],
    n: usize,
    c: usize,
) {
    assert!(c > 0, "layernorm_forward: C must be positive");
    assert_eq!(out.len(), n * c, "layernorm_forward: out length");
    assert_eq!(inp.len(), n * c, "layernorm_forward: inp length");
    assert_eq!(mean.len(), n, "layernorm_forward: mean length");
    assert_eq!(rstd.len(), n, "layernorm_forward: rstd length");
    assert_eq!(w.len(), c, "layernorm_forward: weight length");
    assert_eq!(bias.len(), c, "layernorm_forward: bias length");
    let inv_c = 1.0 / c as f64;
    out.par_chunks_mut(c)
        .zip(mean.par_iter_mut())
        .zip(rstd.par_iter_mut())
        .zip(inp.par_chunks(c))
        .for_each(|(((o, m), r), x)| {
            let mut s = 0.0f64;
            for &v in x {
                s += v.to_f64();
            }
            let mu = s * inv_c;
            let mut ss = 0.0f64;
            for &v in x {
                let d = v.to_f64() - mu;
                ss += d * d;
            }
            let var = ss * inv_c;
            let mu_t = T::from_f64(mu);
            let rs_t = T::from_f64(1.0 / (var + LN_EPS).sqrt());
            *m = mu_t;
            *r = rs_t;
            for (((o, &v), &wj), &bj) in o.iter_mut().zip(x).zip(w).zip(bias) {
                *o = (v - mu_t) * rs_t * wj + bj;
            }
        });
}

/// Backward of [`layernorm_forward`].
///
/// * `dinp`: (N, C), **accumulated** (`+=`; it is the residual stream's gradient).
/// * `dw`, `dbias`: (C), **accumulated**: `Σ_rows dout·x̂` and `Σ_rows dout`.
/// * `dout`, `inp`: (N, C); `w`: (C); `mean`, `rstd`: (N) from the forward pass.
///
/// Per row, with `x̂ = (inp - mean)·rstd` and `g = dout·w`:
/// `dinp += rstd·(g - mean(g) - x̂·mean(g·x̂))`, the two row means accumulated in `f64`.
/// `dinp` is parallel over rows; `dw`/`dbias` are parallel over blocks of columns, each element
/// summed over rows in order (in `T`), so the result is independent of the thread count.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward<T: Float>(
    dinp: &mut [T],
    dw: &mut [T],
    dbias: &mut [T],
    dout: &[T],
    inp: &[T],
    w: &[T],
    mean: &[T],
    rstd: &[T],
    n: usize,
    c: usize,
) {
    assert!(c > 0, "layernorm_backward: C must be positive");
    assert_eq!(dinp.len(), n * c, "layernorm_backward: dinp length");
    assert_eq!(dout.len(), n * c, "layernorm_backward: dout length");
    assert_eq!(inp.len(), n * c, "layernorm_backward: inp length");
    assert_eq!(w.len(), c, "layernorm_backward: weight length");
    assert_eq!(dw.len(), c, "layernorm_backward: dw length");
    assert_eq!(dbias.len(), c, "layernorm_backward: dbias length");
    assert_eq!(mean.len(), n, "layernorm_backward: mean length");
    assert_eq!(rstd.len(), n, "layernorm_backward: rstd length");
    let inv_c = 1.0 / c as f64;

    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c))
        .zip(inp.par_chunks(c))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .for_each(|(((di, g), x), (&mu, &rs))| {
            let mut s1 = 0.0f64;
            let mut s2 = 0.0f64;
            for ((&gj, &xj), &wj) in g.iter().zip(x).zip(w) {
                let xhat = (xj - mu) * rs;
                let dn = gj * wj;
                s1 += dn.to_f64();
                s2 += (dn * xhat).to_f64();
            }
            let m1 = T::from_f64(s1 * inv_c);
            let m2 = T::from_f64(s2 * inv_c);
            for (((d, &gj), &xj), &wj) in di.iter_mut().zip(g).zip(x).zip(w) {
                let xhat = (xj - mu) * rs;
                *d += (gj * wj - m1 - xhat * m2) * rs;
            }
        });

    // Parameter gradients: columns split across tasks, rows summed in order.
    const CW: usize = super::COL_CHUNK;
    dw.par_chunks_mut(CW)
        .zip(dbias.par_chunks_mut(CW))
        .enumerate()
        .for_each(|(blk, (dwc, dbc))| {
            let j0 = blk * CW;
            let j1 = j0 + dwc.len();
            for i in 0..n {
                let (mu, rs) = (mean[i], rstd[i]);
                let g = &dout[i * c + j0..i * c + j1];
                let x = &inp[i * c + j0..i * c + j1];
                for (((dwj, dbj), &gj), &xj) in dwc.iter_mut().zip(dbc.iter_mut()).zip(g).zip(x) {
                    *dwj += gj * ((xj - mu) * rs);
                    *dbj += gj;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    fn forward(inp: &[f64], w: &[f64], b: &[f64], n: usize, c: usize) -> Vec<f64> {
        let mut out = vec![f64::NAN; n * c];
        let (mut m, mut r) = (vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut out, &mut m, &mut r, inp, w, b, n, c);
        out
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (n, c) = (7, 8);
        let mut rng = Rng::new(20);
        let inp: Vec<f64> = rng.vec(n * c).iter().map(|x| 2.0 * x + 0.3).collect();
        let w = rng.vec(c);
        let b = rng.vec(c);
        let dout = rng.vec(n * c);
        let mut out = vec![0.0; n * c];
        let (mut mean, mut rstd) = (vec![0.0; n], vec![0.0; n]);
        layernorm_forward(&mut out, &mut mean, &mut rstd, &inp, &w, &b, n, c);
        // Against the definition (biased variance, eps inside the square root).
        for i in 0..n {
            let x = &inp[i * c..(i + 1) * c];
            let mu = x.iter().sum::<f64>() / c as f64;
            let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / c as f64;
            assert!((mean[i] - mu).abs() < 1e-14);
            assert!((rstd[i] - 1.0 / (var + 1e-5).sqrt()).abs() < 1e-12);
        }
        // dinp starts non-zero: it must be accumulated into.
        let base = rng.vec(n * c);
        let mut dinp = base.clone();
        let (mut dw, mut db) = (vec![0.0; c], vec![0.0; c]);
        layernorm_backward(
            &mut dinp, &mut dw, &mut db, &dout, &inp, &w, &mean, &rstd, n, c,
        );
        let dx: Vec<f64> = dinp.iter().zip(&base).map(|(a, b)| a - b).collect();
        check_grad("dinp", &inp, &dx, |x| dot(&dout, &forward(x, &w, &b, n, c)));
        check_grad("dw", &w, &dw, |x| dot(&dout, &forward(&inp, x, &b, n, c)));
        check_grad("dbias", &b, &db, |x| {
            dot(&dout, &forward(&inp, &w, x, n, c))
        });

        // A second call adds the same amounts again.
        let (d1, w1, b1) = (dinp.clone(), dw.clone(), db.clone());
        layernorm_backward(
            &mut dinp, &mut dw, &mut db, &dout, &inp, &w, &mean, &rstd, n, c,
        );
        for i in 0..n * c {
            assert!((dinp[i] - (d1[i] + dx[i])).abs() < 1e-12);
        }
        assert!(dw.iter().zip(&w1).all(|(a, b)| (a - 2.0 * b).abs() < 1e-12));
        assert!(db.iter().zip(&b1).all(|(a, b)| (a - 2.0 * b).abs() < 1e-12));
    }

    #[test]
    fn f32_matches_f64_and_is_thread_count_independent() {
        let (n, c) = (67, 40);
        let mut rng = Rng::new(21);
        let inp = round_f32(
            &rng.vec(n * c)
                .iter()
                .map(|x| 3.0 * x + 1.0)
                .collect::<Vec<_>>(),
        );
        let w = round_f32(&rng.vec(c));
        let b = round_f32(&rng.vec(c));
        let dout = round_f32(&rng.vec(n * c));
        let run64 = || {
            let mut out = vec![0.0; n * c];
            let (mut m, mut r) = (vec![0.0; n], vec![0.0; n]);
            layernorm_forward(&mut out, &mut m, &mut r, &inp, &w, &b, n, c);
            let (mut di, mut dw, mut db) = (vec![0.0; n * c], vec![0.0; c], vec![0.0; c]);
            layernorm_backward(&mut di, &mut dw, &mut db, &dout, &inp, &w, &m, &r, n, c);
            (out, di, dw, db)
        };
        let run32 = |threads| {
            with_threads(threads, || {
                let (inp, w, b, dout) = (to_f32(&inp), to_f32(&w), to_f32(&b), to_f32(&dout));
                let mut out = vec![0.0f32; n * c];
                let (mut m, mut r) = (vec![0.0f32; n], vec![0.0f32; n]);
                layernorm_forward(&mut out, &mut m, &mut r, &inp, &w, &b, n, c);
                let (mut di, mut dw, mut db) =
                    (vec![0.0f32; n * c], vec![0.0f32; c], vec![0.0f32; c]);
                layernorm_backward(&mut di, &mut dw, &mut db, &dout, &inp, &w, &m, &r, n, c);
                (out, di, dw, db)
            })
        };
        let (o, di, dw, db) = run64();
        let r1 = run32(1);
        assert_close_f32("out", &r1.0, &o, 1e-6);
        assert_close_f32("dinp", &r1.1, &di, 1e-5);
        assert_close_f32("dw", &r1.2, &dw, 1e-5);
        assert_close_f32("dbias", &r1.3, &db, 1e-5);
        let r3 = run32(3);
        assert_eq!(r1, r3);
    }
}

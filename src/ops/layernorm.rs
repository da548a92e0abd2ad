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
/// Mean and (biased) variance are accumulated in `f64` with two passes over the row (in
/// [`SUM_LANES`] fixed lanes, so they vectorise), then rounded to `T`; the normalisation itself uses the rounded `mean`/`rstd`, so the backward pass
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
    out.par_chunks_mut(c)
        .zip(mean.par_iter_mut())
        .zip(rstd.par_iter_mut())
        .zip(inp.par_chunks(c))
        .for_each(|(((o, m), r), x)| (*m, *r) = T::layernorm_row(o, x, w, bias));
}

/// Lanes of the row sums: element `j` goes to lane `j % SUM_LANES`, the lanes are added in
/// order at the end (and the tail after them), a fixed order the compiler can vectorise (also
/// the RMS norm's, `rmsnorm.rs`).
pub(crate) const SUM_LANES: usize = 8;

/// `Σ f(v)` over `x` in f64, in [`SUM_LANES`] lanes.
#[inline(always)]
pub(crate) fn lane_sum<T: Copy>(x: &[T], f: impl Fn(T) -> f64) -> f64 {
    let mut acc = [0.0f64; SUM_LANES];
    let mut it = x.chunks_exact(SUM_LANES);
    for chunk in &mut it {
        for (a, &v) in acc.iter_mut().zip(chunk) {
            *a += f(v);
        }
    }
    let tail: f64 = it.remainder().iter().map(|&v| f(v)).sum();
    acc.iter().sum::<f64>() + tail
}

/// One row of [`layernorm_forward`]: writes `out`, returns `(mean, rstd)` rounded to `T`
/// (`Float::layernorm_row` runs it, vectorised for the CPU).
#[inline(always)]
pub(crate) fn layernorm_row<T: Float>(out: &mut [T], x: &[T], w: &[T], bias: &[T]) -> (T, T) {
    let inv_c = 1.0 / x.len() as f64;
    let mu = lane_sum(x, |v| v.to_f64()) * inv_c;
    let var = lane_sum(x, |v| {
        let d = v.to_f64() - mu;
        d * d
    }) * inv_c;
    let mu_t = T::from_f64(mu);
    let rs_t = T::from_f64(1.0 / (var + LN_EPS).sqrt());
    for (((o, &v), &wj), &bj) in out.iter_mut().zip(x).zip(w).zip(bias) {
        *o = (v - mu_t) * rs_t * wj + bj;
    }
    (mu_t, rs_t)
}

/// One row of [`layernorm_backward`]'s input gradient (`Float::layernorm_backward_row`):
/// `dinp += rstd·(g - mean(g) - x̂·mean(g·x̂))` with `g = dout·w`, the means in f64 lanes.
#[inline(always)]
pub(crate) fn layernorm_backward_row<T: Float>(
    dinp: &mut [T],
    dout: &[T],
    x: &[T],
    w: &[T],
    mu: T,
    rs: T,
) {
    let inv_c = 1.0 / x.len() as f64;
    let (mut a1, mut a2) = ([0.0f64; SUM_LANES], [0.0f64; SUM_LANES]);
    let terms = |gj: T, xj: T, wj: T| {
        let dn = gj * wj;
        (dn.to_f64(), (dn * ((xj - mu) * rs)).to_f64())
    };
    let (mut gi, mut xi, mut wi) = (
        dout.chunks_exact(SUM_LANES),
        x.chunks_exact(SUM_LANES),
        w.chunks_exact(SUM_LANES),
    );
    for ((g8, x8), w8) in (&mut gi).zip(&mut xi).zip(&mut wi) {
        for l in 0..SUM_LANES {
            let (t1, t2) = terms(g8[l], x8[l], w8[l]);
            a1[l] += t1;
            a2[l] += t2;
        }
    }
    let (mut s1, mut s2) = (a1.iter().sum::<f64>(), a2.iter().sum::<f64>());
    for ((&gj, &xj), &wj) in gi
        .remainder()
        .iter()
        .zip(xi.remainder())
        .zip(wi.remainder())
    {
        let (t1, t2) = terms(gj, xj, wj);
        s1 += t1;
        s2 += t2;
    }
    let m1 = T::from_f64(s1 * inv_c);
    let m2 = T::from_f64(s2 * inv_c);
    for (((d, &gj), &xj), &wj) in dinp.iter_mut().zip(dout).zip(x).zip(w) {
        let xhat = (xj - mu) * rs;
        *d += (gj * wj - m1 - xhat * m2) * rs;
    }
}

super::row_isa::dispatch_rows! {
    /// [`layernorm_row`] in f32 with the widest vectors the CPU has.
    pub(crate) fn layernorm_row_f32(out: &mut [f32], x: &[f32], w: &[f32], bias: &[f32]) -> (f32, f32) =
        layernorm_row::<f32>;
    sve = sve_layernorm_row;
}

/// [`layernorm_row`] on SVE (`fugu-rows`, with [`LN_EPS`]).
#[cfg(target_arch = "aarch64")]
fn sve_layernorm_row(
    sve: &fugu_rows::sve::Sve,
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: &[f32],
) -> (f32, f32) {
    sve.layernorm_row(out, x, w, bias, LN_EPS)
}

super::row_isa::dispatch_rows! {
    /// [`layernorm_backward_row`] in f32 with the widest vectors the CPU has.
    pub(crate) fn layernorm_backward_row_f32(
        dinp: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        mu: f32,
        rs: f32,
    ) = layernorm_backward_row::<f32>;
    sve = fugu_rows::sve::Sve::layernorm_backward_row;
}

/// Backward of [`layernorm_forward`].
///
/// * `dinp`: (N, C), **accumulated** (`+=`; it is the residual stream's gradient).
/// * `dw`, `dbias`: (C), **accumulated**: `Σ_rows dout·x̂` and `Σ_rows dout`.
/// * `dout`, `inp`: (N, C); `w`: (C); `mean`, `rstd`: (N) from the forward pass.
///
/// Per row, with `x̂ = (inp - mean)·rstd` and `g = dout·w`:
/// `dinp += rstd·(g - mean(g) - x̂·mean(g·x̂))`, the two row means accumulated in `f64` lanes.
/// Parallel over blocks of rows; `dw`/`dbias` are summed over each block's rows in order, then
/// over the blocks in order (in `T`, `ops::ROW_BLOCK`), so the result is independent of the
/// thread count.
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
    let mut partials = super::block_partials::<T>(n, 2 * c);
    layernorm_backward_blocks(dinp, &mut partials, dout, inp, w, mean, rstd, c);
    super::add_block_partials(dw, &partials, 2 * c, 0);
    super::add_block_partials(dbias, &partials, 2 * c, c);
}

/// The rows' part of [`layernorm_backward`], for rows that start a [`super::ROW_BLOCK`] block:
/// `dinp` accumulated as there, and each block's partials `[dw (C) | dbias (C)]`
/// **overwritten** in `partials` (`2·C` per block), to be added in block order
/// ([`super::add_block_partials`]). One pass over each block of rows, the parameter
/// gradients' shares taken while the rows are in cache.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_backward_blocks<T: Float>(
    dinp: &mut [T],
    partials: &mut [T],
    dout: &[T],
    inp: &[T],
    w: &[T],
    mean: &[T],
    rstd: &[T],
    c: usize,
) {
    let rows = super::ROW_BLOCK;
    let n = mean.len();
    assert_eq!(
        partials.len(),
        n.div_ceil(rows) * 2 * c,
        "layernorm_backward: partials length"
    );
    partials
        .par_chunks_mut(2 * c)
        .zip(dinp.par_chunks_mut(rows * c))
        .zip(dout.par_chunks(rows * c))
        .zip(inp.par_chunks(rows * c))
        .zip(mean.par_chunks(rows).zip(rstd.par_chunks(rows)))
        .for_each(|((((p, di), g), x), (mu, rs))| {
            p.fill(T::ZERO);
            let (pw, pb) = p.split_at_mut(c);
            for ((((di, g), x), &mu), &rs) in di
                .chunks_exact_mut(c)
                .zip(g.chunks_exact(c))
                .zip(x.chunks_exact(c))
                .zip(mu)
                .zip(rs)
            {
                T::layernorm_backward_row(di, g, x, w, mu, rs);
                for (((pwj, pbj), &gj), &xj) in pw.iter_mut().zip(pb.iter_mut()).zip(g).zip(x) {
                    *pwj += gj * ((xj - mu) * rs);
                    *pbj += gj;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    /// The dispatched f32 rows give the portable rows' results (C = 771: lanes and a tail), bit
    /// for bit where the dispatched kernels are compiled from the portable bodies.
    #[test]
    fn dispatched_rows_match_the_portable_rows() {
        let c = 771;
        let f = |s: usize| -> Vec<f32> {
            (0..c)
                .map(|i| ((i * s) % 97) as f32 * 0.021 - 1.0)
                .collect()
        };
        let (x, w, b, g) = (f(7), f(11), f(13), f(17));
        let (mut o1, mut o2) = (vec![0.0f32; c], vec![0.0f32; c]);
        let r1 = layernorm_row_f32(&mut o1, &x, &w, &b);
        let r2 = layernorm_row::<f32>(&mut o2, &x, &w, &b);
        assert_rows_match(&[r1.0, r1.1], &[r2.0, r2.1]);
        assert_rows_match(&o1, &o2);
        let (mut d1, mut d2) = (f(19), f(19));
        layernorm_backward_row_f32(&mut d1, &g, &x, &w, r1.0, r1.1);
        layernorm_backward_row::<f32>(&mut d2, &g, &x, &w, r1.0, r1.1);
        assert_rows_match(&d1, &d2);
    }

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

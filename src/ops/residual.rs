//! Residual connections (`out = a + b`) and the other elementwise updates in place.

use super::{Float, ELEM_CHUNK};
use rayon::prelude::*;

/// `out = a + b` elementwise; `out` is **overwritten**.
pub fn residual_forward<T: Float>(out: &mut [T], a: &[T], b: &[T]) {
    assert_eq!(out.len(), a.len(), "residual_forward: a length");
    assert_eq!(out.len(), b.len(), "residual_forward: b length");
    out.par_chunks_mut(ELEM_CHUNK)
        .zip(a.par_chunks(ELEM_CHUNK))
        .zip(b.par_chunks(ELEM_CHUNK))
        .for_each(|((o, a), b)| {
            for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
                *o = x + y;
            }
        });
}

/// Backward of [`residual_forward`]: `da += dout`, `db += dout` (both **accumulated**).
pub fn residual_backward<T: Float>(da: &mut [T], db: &mut [T], dout: &[T]) {
    add_inplace(da, dout);
    add_inplace(db, dout);
}

/// `acc += x` elementwise.
pub fn add_inplace<T: Float>(acc: &mut [T], x: &[T]) {
    assert_eq!(acc.len(), x.len(), "add_inplace: lengths differ");
    acc.par_chunks_mut(ELEM_CHUNK)
        .zip(x.par_chunks(ELEM_CHUNK))
        .for_each(|(a, x)| {
            for (a, &v) in a.iter_mut().zip(x) {
                *a += v;
            }
        });
}

/// `x *= factor` elementwise (data parallelism's gradient average), rounded once per element.
pub fn scale_inplace<T: Float>(x: &mut [T], factor: T) {
    x.par_chunks_mut(ELEM_CHUNK).for_each(|x| {
        for v in x {
            *v *= factor;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    #[test]
    fn forward_backward() {
        let mut rng = Rng::new(60);
        let n = ELEM_CHUNK + 3;
        let (a, b, g) = (rng.vec(n), rng.vec(n), rng.vec(n));
        let mut out = vec![f64::NAN; n];
        residual_forward(&mut out, &a, &b);
        assert!((0..n).all(|i| out[i] == a[i] + b[i]));
        // Accumulated: starting from non-zero gradients, twice.
        let (mut da, mut db) = (a.clone(), b.clone());
        residual_backward(&mut da, &mut db, &g);
        residual_backward(&mut da, &mut db, &g);
        assert!((0..n).all(|i| da[i] == a[i] + g[i] + g[i] && db[i] == b[i] + g[i] + g[i]));
        // Gradient check on a short prefix (linear, so exact up to round-off).
        let k = 9;
        let f = |x: &[f64]| {
            let mut o = vec![0.0; k];
            residual_forward(&mut o, x, &b[..k]);
            dot(&g[..k], &o)
        };
        check_grad("da", &a[..k], &g[..k], f);
    }
}

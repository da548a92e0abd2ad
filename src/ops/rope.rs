//! Rotary position embeddings in Hugging Face's `rotate_half` convention (Llama, Mistral,
//! Qwen): a head of size `hs` is two halves, element `i` of the first paired with element
//! `i + hs/2` of the second (not adjacent pairs, as in the original RoFormer), rotated by the
//! angle `p·θ^(−2i/hs)` at position `p`:
//!
//! ```text
//! y[i]        = x[i]·cos − x[i + hs/2]·sin
//! y[i + hs/2] = x[i + hs/2]·cos + x[i]·sin
//! ```
//!
//! The rotation is applied in place to the query and key heads of the fused QKV rows, and its
//! backward rotates the gradients back (the transpose: the same with `−sin`), also in place, so
//! attention reads and its backward writes the rotated values with no extra buffer.

use super::{Float, ELEM_CHUNK};
use rayon::prelude::*;

/// The cosines and sines of every position and frequency: (positions, hs/2) each.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeTable<T> {
    /// Half the head size: the number of frequencies.
    pub half: usize,
    pub cos: Vec<T>,
    pub sin: Vec<T>,
}

impl<T: Float> RopeTable<T> {
    /// The table for heads of size `hs` (even) over `positions` positions with base `theta`
    /// (`rope_theta`), computed in f64 and rounded once to `T`.
    pub fn new(hs: usize, positions: usize, theta: f64) -> RopeTable<T> {
        assert!(
            hs > 0 && hs.is_multiple_of(2),
            "RopeTable: head size {hs} must be even"
        );
        let half = hs / 2;
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for i in 0..half {
                let inv_freq = theta.powf(-((2 * i) as f64) / hs as f64);
                let (s, c) = (p as f64 * inv_freq).sin_cos();
                cos.push(T::from_f64(c));
                sin.push(T::from_f64(s));
            }
        }
        RopeTable { half, cos, sin }
    }

    /// The table as slices.
    pub fn view(&self) -> RopeView<'_, T> {
        RopeView {
            half: self.half,
            cos: &self.cos,
            sin: &self.sin,
        }
    }
}

/// A [`RopeTable`] as slices: `cos` and `sin` (positions, `half`) each (a backend's table is
/// one buffer, the cosines then the sines).
#[derive(Clone, Copy, Debug)]
pub struct RopeView<'a, T> {
    pub half: usize,
    pub cos: &'a [T],
    pub sin: &'a [T],
}

impl<T> RopeView<'_, T> {
    /// Positions the table covers.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half
    }
}

/// Rotates, in place, the first `heads` heads (of size `2·table.half`) of every row of `x`,
/// rows of `width` elements, row `r` at position `r % t` (rows are (batch, position)).
/// `direction` +1 is the forward rotation, −1 its transpose.
fn rotate<T: Float>(
    x: &mut [T],
    width: usize,
    heads: usize,
    t: usize,
    table: RopeView<T>,
    direction: T,
) {
    let half = table.half;
    assert!(
        heads * 2 * half <= width,
        "rope: {heads} heads of {} do not fit rows of {width}",
        2 * half
    );
    assert!(
        t <= table.positions(),
        "rope: sequence length {t} past the table's {} positions",
        table.positions()
    );
    assert!(x.len().is_multiple_of(width.max(1)), "rope: x length");
    assert_eq!(table.cos.len(), table.sin.len(), "rope: table lengths");
    let rows_per_task = (ELEM_CHUNK / width.max(1)).max(1);
    x.par_chunks_mut(rows_per_task * width)
        .enumerate()
        .for_each(|(task, rows)| {
            for (k, row) in rows.chunks_exact_mut(width).enumerate() {
                let p = (task * rows_per_task + k) % t;
                let (cos, sin) = (
                    &table.cos[p * half..(p + 1) * half],
                    &table.sin[p * half..(p + 1) * half],
                );
                for head in row[..heads * 2 * half].chunks_exact_mut(2 * half) {
                    let (a, b) = head.split_at_mut(half);
                    for (((a, b), &c), &s) in a.iter_mut().zip(b).zip(cos).zip(sin) {
                        let s = direction * s;
                        let (x0, x1) = (*a, *b);
                        *a = x0 * c - x1 * s;
                        *b = x1 * c + x0 * s;
                    }
                }
            }
        });
}

/// Rotates the first `heads` heads of each row of `x` (N rows of `width`, row `r` at position
/// `r % t`) by their positions' angles, **in place**.
pub fn rope_forward<T: Float>(
    x: &mut [T],
    width: usize,
    heads: usize,
    t: usize,
    table: RopeView<T>,
) {
    rotate(x, width, heads, t, table, T::ONE);
}

/// Backward of [`rope_forward`]: `dx` holds the gradient of the rotated values and is
/// rotated back **in place** into the gradient of the inputs.
pub fn rope_backward<T: Float>(
    dx: &mut [T],
    width: usize,
    heads: usize,
    t: usize,
    table: RopeView<T>,
) {
    rotate(dx, width, heads, t, table, -T::ONE);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    /// Against `rotate_half` written out from its definition, on rows of 2 sequences × 5
    /// positions with 3 rotated heads of 6 and 4 columns left alone; every gradient element
    /// against central differences.
    #[test]
    fn matches_rotate_half_and_finite_differences() {
        let (b, t, hs, heads, width) = (2, 5, 6, 3, 3 * 6 + 4);
        let theta = 10_000.0;
        let table = RopeTable::<f64>::new(hs, 8, theta);
        let mut rng = Rng::new(50);
        let x = rng.vec(b * t * width);
        let mut y = x.clone();
        rope_forward(&mut y, width, heads, t, table.view());
        for r in 0..b * t {
            let p = (r % t) as f64;
            for h in 0..heads {
                for i in 0..hs {
                    let j = i % (hs / 2);
                    let ang = p * theta.powf(-(2.0 * j as f64) / hs as f64);
                    let at = |k: usize| x[r * width + h * hs + k];
                    let rot = if i < hs / 2 {
                        -at(i + hs / 2)
                    } else {
                        at(i - hs / 2)
                    };
                    let want = at(i) * ang.cos() + rot * ang.sin();
                    let got = y[r * width + h * hs + i];
                    assert!((got - want).abs() < 1e-14, "row {r} head {h} [{i}]");
                }
            }
            assert_eq!(
                y[r * width + heads * hs..(r + 1) * width],
                x[r * width + heads * hs..(r + 1) * width]
            );
        }
        let dout = rng.vec(b * t * width);
        let mut dx = dout.clone();
        rope_backward(&mut dx, width, heads, t, table.view());
        check_grad("dx", &x, &dx, |x| {
            let mut y = x.to_vec();
            rope_forward(&mut y, width, heads, t, table.view());
            dot(&dout, &y)
        });
    }

    /// The f32 table is the f64 one rounded; f32 rotation within rounding of f64 on many rows
    /// (several tasks), whatever the threads.
    #[test]
    fn f32_matches_f64_and_is_thread_count_independent() {
        let (t, hs, heads, width) = (300, 64, 3, 4 * 64);
        let t64 = RopeTable::<f64>::new(hs, t, 500_000.0);
        let t32 = RopeTable::<f32>::new(hs, t, 500_000.0);
        assert!(t32.cos.iter().zip(&t64.cos).all(|(a, b)| *a == *b as f32));
        let mut rng = Rng::new(51);
        let x = round_f32(&rng.vec(2 * t * width));
        let mut y = x.clone();
        rope_forward(&mut y, width, heads, t, t64.view());
        let run = |threads| {
            with_threads(threads, || {
                let mut y = to_f32(&x);
                rope_forward(&mut y, width, heads, t, t32.view());
                y
            })
        };
        let y32 = run(1);
        assert_close_f32("y", &y32, &y, 1e-6);
        assert_eq!(run(2), y32);
    }
}

//! The AdamW optimizer step (PyTorch `torch.optim.AdamW`, single-tensor path) and the sum of
//! squares behind gradient-norm clipping. `f32` only: these run on the master parameters.

use super::ELEM_CHUNK;
use rayon::prelude::*;

/// Hyperparameters of one AdamW step (shared by all elements it updates).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate of this step (after the schedule).
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay; 0 for tensors that are not decayed (biases, layernorms).
    pub weight_decay: f32,
    /// 1-based step count (the bias corrections use it).
    pub step: u64,
    /// Multiplied into every gradient first (the gradient-clipping factor; 1.0 = none).
    pub grad_scale: f32,
}

/// One AdamW step over a slice of parameters, in place, following PyTorch's order:
///
/// ```text
/// g  = grad · grad_scale
/// p *= 1 - lr·wd                          (only when wd ≠ 0)
/// m  = β1·m + (1-β1)·g
/// v  = β2·v + (1-β2)·g·g
/// bias_correction1 = 1 - β1^step,  bias_correction2 = 1 - β2^step
/// step_size = lr / bias_correction1
/// denom = sqrt(v) / sqrt(bias_correction2) + eps
/// p += (-step_size)·m / denom
/// ```
///
/// The per-step scalars (`1 - lr·wd`, `1-β1`, `1-β2`, `step_size`, `sqrt(bias_correction2)`)
/// are computed in `f64` from the `f32` hyperparameters and rounded once to `f32`, as PyTorch
/// does with its Python-float hyperparameters; the elementwise arithmetic is `f32`. (PyTorch
/// writes the `m` update as `lerp`, which can differ from `β1·m + (1-β1)·g` in the last bit.)
///
/// `params`, `m`, `v` are updated in place; `grads` is read. All four have the same length.
/// Elementwise and parallel over fixed chunks, so deterministic.
pub fn adamw_update(
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    hp: &AdamWStep,
) {
    assert_eq!(grads.len(), params.len(), "adamw_update: grads length");
    assert_eq!(m.len(), params.len(), "adamw_update: m length");
    assert_eq!(v.len(), params.len(), "adamw_update: v length");
    let k = step_scalars(hp);
    params
        .par_chunks_mut(ELEM_CHUNK)
        .zip(grads.par_chunks(ELEM_CHUNK))
        .zip(m.par_chunks_mut(ELEM_CHUNK))
        .zip(v.par_chunks_mut(ELEM_CHUNK))
        .for_each(|(((p, g), m), v)| update_chunk(p, g, m, v, &k));
}

/// The per-step scalars of [`adamw_update`] (see there), shared with device backends so that
/// every backend applies the same rounded constants.
pub fn step_scalars(hp: &AdamWStep) -> StepScalars {
    assert!(hp.step >= 1, "adamw_update: step is 1-based");
    let (lr, b1, b2) = (hp.lr as f64, hp.beta1 as f64, hp.beta2 as f64);
    let bias_correction1 = 1.0 - b1.powf(hp.step as f64);
    let bias_correction2 = 1.0 - b2.powf(hp.step as f64);
    let neg_step_size = (-(lr / bias_correction1)) as f32;
    let bc2_sqrt = bias_correction2.sqrt() as f32;
    let decay = (hp.weight_decay != 0.0).then_some((1.0 - lr * hp.weight_decay as f64) as f32);
    let (beta1, beta2, eps, scale) = (hp.beta1, hp.beta2, hp.eps, hp.grad_scale);
    let one_m_b1 = (1.0 - b1) as f32;
    let one_m_b2 = (1.0 - b2) as f32;
    StepScalars {
        beta1,
        beta2,
        eps,
        scale,
        one_m_b1,
        one_m_b2,
        neg_step_size,
        bc2_sqrt,
        decay: decay.unwrap_or(1.0),
    }
}

/// Per-step scalars of the update.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub scale: f32,
    pub one_m_b1: f32,
    pub one_m_b2: f32,
    pub neg_step_size: f32,
    pub bc2_sqrt: f32,
    /// `1 − lr·wd`, or exactly 1 without decay (multiplying by 1.0 is exact).
    pub decay: f32,
}

#[inline(always)]
fn update_body(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: &StepScalars) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g * k.scale;
        *p *= k.decay;
        *m = k.beta1 * *m + k.one_m_b1 * g;
        *v = k.beta2 * *v + k.one_m_b2 * g * g;
        let denom = v.sqrt() / k.bc2_sqrt + k.eps;
        *p += k.neg_step_size * *m / denom;
    }
}

super::row_isa::dispatch_rows! {
    /// One chunk of the update, with the widest vectors the CPU has (the same arithmetic, no
    /// FMA contraction, so results are identical on every path).
    fn update_chunk(
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        k: &StepScalars,
    ) = update_body;
    sve = sve_update;
}

/// [`update_body`] on SVE (`fugu-rows`, the same per-step scalars).
#[cfg(target_arch = "aarch64")]
fn sve_update(
    sve: &fugu_rows::sve::Sve,
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &StepScalars,
) {
    let k = fugu_rows::sve::AdamWScalars {
        scale: k.scale,
        decay: k.decay,
        beta1: k.beta1,
        one_m_b1: k.one_m_b1,
        beta2: k.beta2,
        one_m_b2: k.one_m_b2,
        neg_step_size: k.neg_step_size,
        bc2_sqrt: k.bc2_sqrt,
        eps: k.eps,
    };
    sve.adamw(p, g, m, v, &k)
}

/// Elements per partial sum of [`sum_of_squares`].
const SOS_CHUNK: usize = 1 << 14;

/// `Σ x²` in `f64`: partial sums over fixed chunks of 16384 elements (in parallel), combined in
/// chunk order, so the result does not depend on the number of threads.
pub fn sum_of_squares(x: &[f32]) -> f64 {
    let parts: Vec<f64> = x.par_chunks(SOS_CHUNK).map(chunk_sum_of_squares).collect();
    parts.iter().sum()
}

super::row_isa::dispatch_rows! {
    /// Σ x² of one chunk, with the widest vectors the CPU has.
    fn chunk_sum_of_squares(c: &[f32]) -> f64 = sum_of_squares_body;
    sve = sve_sum_of_squares;
}

/// [`sum_of_squares_body`] on SVE (`fugu-rows`: Σ (x − 0)² in f64 lanes).
#[cfg(target_arch = "aarch64")]
fn sve_sum_of_squares(sve: &fugu_rows::sve::Sve, c: &[f32]) -> f64 {
    sve.sum_sq_dev_f64(c, 0.0)
}

/// Σ x² of one chunk in eight f64 lanes (vectorisable), lanes added in order.
#[inline(always)]
fn sum_of_squares_body(c: &[f32]) -> f64 {
    const LANES: usize = 8;
    let mut acc = [0.0f64; LANES];
    let mut it = c.chunks_exact(LANES);
    for w in &mut it {
        for l in 0..LANES {
            acc[l] += (w[l] as f64) * (w[l] as f64);
        }
    }
    let tail: f64 = it
        .remainder()
        .iter()
        .map(|&v| (v as f64) * (v as f64))
        .sum();
    acc.iter().sum::<f64>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched chunk kernels (AVX-512/AVX2 where the CPU has them, SVE) give the
    /// portable bodies' results (bit for bit except on SVE).
    #[test]
    fn dispatched_chunks_match_the_portable_bodies() {
        use crate::ops::testutil::assert_rows_match;
        let n = 1237;
        let mk = |s: u32| -> Vec<f32> {
            (0..n as u32)
                .map(|i| ((i.wrapping_mul(2_654_435_761) ^ s) % 2000) as f32 * 1e-3 - 1.0)
                .collect()
        };
        let (g, p0, m0) = (mk(1), mk(2), mk(3));
        let v0: Vec<f32> = mk(4).iter().map(|x| x.abs()).collect();
        let k = step_scalars(&AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 7,
            grad_scale: 0.5,
        });
        let (mut p1, mut m1, mut v1) = (p0.clone(), m0.clone(), v0.clone());
        let (mut p2, mut m2, mut v2) = (p0, m0, v0);
        update_chunk(&mut p1, &g, &mut m1, &mut v1, &k);
        update_body(&mut p2, &g, &mut m2, &mut v2, &k);
        assert_rows_match(&p1, &p2);
        assert_rows_match(&m1, &m2);
        assert_rows_match(&v1, &v2);
        assert_rows_match(&[chunk_sum_of_squares(&g)], &[sum_of_squares_body(&g)]);
    }
    use crate::ops::testutil::*;

    /// Straightforward scalar f64 AdamW (the same formula as dev/gpt2_ref.py).
    fn reference(p: &mut f64, m: &mut f64, v: &mut f64, g: f64, hp: &AdamWStep) {
        let (lr, b1, b2) = (hp.lr as f64, hp.beta1 as f64, hp.beta2 as f64);
        let g = g * hp.grad_scale as f64;
        *p *= 1.0 - lr * hp.weight_decay as f64;
        *m = b1 * *m + (1.0 - b1) * g;
        *v = b2 * *v + (1.0 - b2) * g * g;
        let bc1 = 1.0 - b1.powi(hp.step as i32);
        let bc2 = 1.0 - b2.powi(hp.step as i32);
        let denom = v.sqrt() / bc2.sqrt() + hp.eps as f64;
        *p -= lr / bc1 * (*m / denom);
    }

    fn hp(step: u64, weight_decay: f32, grad_scale: f32) -> AdamWStep {
        AdamWStep {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay,
            step,
            grad_scale,
        }
    }

    fn rel(a: f32, b: f64) -> f64 {
        (a as f64 - b).abs() / b.abs().max(1e-30)
    }

    /// Two steps on two elements against numbers worked out by hand in f64 (Python):
    /// element 0: p = 0.5, grads 0.2 then -0.1, wd 0.1; element 1: p = -1.25, grads 0.3 then
    /// 0.7 scaled by 0.5, wd 0. After step 1 the update is ≈ lr·sign(g) (m̂/sqrt(v̂) = ±1).
    #[test]
    fn two_steps_by_hand() {
        let expect = [
            // (p, m, v) after step 1 and step 2
            [
                (0.4895000005, 0.02, 0.002),
                (0.48632680618971424, 0.008, 0.0024),
            ],
            [
                (-1.2599999993333333, 0.015, 0.001125),
                (-1.269397508521872, 0.0485, 0.00719375),
            ],
        ];
        let grads = [[0.2f32, -0.1], [0.3, 0.7]];
        let settings = [(0.1f32, 1.0f32), (0.0, 0.5)];
        for e in 0..2 {
            let mut p = [[0.5f32, -1.25][e]];
            let (mut m, mut v) = ([0.0f32], [0.0f32]);
            for s in 0..2 {
                let h = hp(s as u64 + 1, settings[e].0, settings[e].1);
                adamw_update(&mut p, &[grads[e][s]], &mut m, &mut v, &h);
                let (ep, em, ev) = expect[e][s];
                assert!(
                    rel(p[0], ep) < 1e-6,
                    "element {e} step {}: p {} vs {ep}",
                    s + 1,
                    p[0]
                );
                assert!(
                    rel(m[0], em) < 1e-6,
                    "element {e} step {}: m {} vs {em}",
                    s + 1,
                    m[0]
                );
                assert!(
                    rel(v[0], ev) < 1e-6,
                    "element {e} step {}: v {} vs {ev}",
                    s + 1,
                    v[0]
                );
            }
        }
    }

    /// Many elements (several chunks), three steps, against the scalar f64 reference.
    #[test]
    fn matches_scalar_reference() {
        let n = 2 * ELEM_CHUNK + 17;
        let mut rng = Rng::new(80);
        let p0 = to_f32(&rng.vec(n));
        let mut p = p0.clone();
        let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
        let mut r: Vec<(f64, f64, f64)> = p0.iter().map(|&x| (x as f64, 0.0, 0.0)).collect();
        for step in 1..=3 {
            let g = to_f32(&rng.vec(n).iter().map(|x| x * 0.01).collect::<Vec<_>>());
            let h = hp(step, 0.1, 0.8);
            adamw_update(&mut p, &g, &mut m, &mut v, &h);
            for (i, (rp, rm, rv)) in r.iter_mut().enumerate() {
                reference(rp, rm, rv, g[i] as f64, &h);
            }
        }
        for i in 0..n {
            let (rp, rm, rv) = r[i];
            assert!(
                (p[i] as f64 - rp).abs() < 1e-6 * rp.abs().max(1e-2),
                "p[{i}]: {} vs {rp}",
                p[i]
            );
            assert!(
                // m sums gradients of size ~1e-2 with cancellation: absolute floor.
                (m[i] as f64 - rm).abs() < 1e-6 * rm.abs() + 1e-9,
                "m[{i}]: {} vs {rm}",
                m[i]
            );
            assert!(
                (v[i] as f64 - rv).abs() < 1e-6 * rv.abs() + 1e-14,
                "v[{i}]: {} vs {rv}",
                v[i]
            );
        }
    }

    #[test]
    fn sum_of_squares_is_exact_enough_and_thread_independent() {
        let n = 3 * SOS_CHUNK + 5;
        let x = to_f32(&Rng::new(81).vec(n));
        let naive: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let s1 = with_threads(1, || sum_of_squares(&x));
        let s3 = with_threads(3, || sum_of_squares(&x));
        assert_eq!(s1.to_bits(), s3.to_bits());
        assert!((s1 - naive).abs() < 1e-12 * naive);
        assert_eq!(sum_of_squares(&[]), 0.0);
        assert_eq!(sum_of_squares(&[3.0, 4.0]), 25.0);
    }
}

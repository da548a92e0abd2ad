//! Branch-free `f32` exp and tanh that the compiler vectorises inside the ops' loops (libm's
//! scalar calls do not vectorise and dominated the cross-entropy and GELU time).
//!
//! `exp`: Cody-Waite range reduction x = n·ln2 + r with |r| ≤ ln2/2, a degree-7 polynomial
//! for e^r (the Cephes `expf` coefficients), and 2^n assembled in the exponent bits. The
//! rounding of x/ln2 uses the 1.5·2^23 "magic number" add, so it needs no `round`
//! instruction. Inputs are clamped to [-87.3, 88.7], so the result is always a normal finite
//! number for finite input (e^-87.3 ≈ 1.2e-38 stands in for underflow, which is harmless in
//! softmax sums); NaN propagates. Accuracy: within 2 ulp of the correctly rounded result
//! (tested below against f64).

#[cfg(doc)]
use super::row_isa::row_isa;

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23

/// e^x.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // n is in [-126, 128] here; the integer sits in t's low mantissa bits. (Wrapping
    // arithmetic, which never wraps for these n: an overflow check would keep the loops that
    // inline this from vectorising in builds that check, the test and dev builds.)
    let ni = (t.to_bits() as i32).wrapping_sub(0x4B40_0000);
    // 2^n as two factors so that n = 128 (x near 88.7) does not overflow the exponent field.
    let half = ni >> 1;
    let s1 = f32::from_bits((half.wrapping_add(127) << 23) as u32);
    let s2 = f32::from_bits((ni.wrapping_sub(half).wrapping_add(127) << 23) as u32);
    er * s1 * s2
}

/// tanh(x) = 1 − 2/(e^{2x} + 1); odd symmetry keeps the small-|x| end accurate.
#[inline(always)]
pub fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    let e = exp_f32(2.0 * a);
    let t = 1.0 - 2.0 / (e + 1.0);
    // For |x| < 0.25 the subtraction cancels: use the odd Taylor series to x⁹ there.
    let x2 = x * x;
    let series = a
        * (1.0
            + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))));
    let t = if a < 0.25 { series } else { t };
    t.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f64) -> f64 {
        let bf = b as f32;
        let ulp = (f32::from_bits(bf.abs().to_bits() + 1) - bf.abs()) as f64;
        (a as f64 - b).abs() / ulp
    }

    #[test]
    fn exp_is_within_2_ulp() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.5 {
            worst = worst.max(ulps(exp_f32(x), (x as f64).exp()));
            x += 0.000_731;
        }
        assert!(worst <= 2.0, "exp worst {worst} ulp");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(-1e30) >= 0.0 && exp_f32(-1e30) < 1e-37);
        assert!(exp_f32(1e30).is_finite());
    }

    #[test]
    fn tanh_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -12.0f32;
        while x < 12.0 {
            let want = (x as f64).tanh();
            let err = (tanh_f32(x) as f64 - want).abs() / want.abs().max(1e-30);
            worst = worst.max(err);
            x += 0.000_917;
        }
        assert!(worst < 5e-7, "tanh worst rel err {worst:e}");
        assert_eq!(tanh_f32(0.0), 0.0);
        assert_eq!(tanh_f32(30.0), 1.0);
        assert_eq!(tanh_f32(-30.0), -1.0);
    }
}

/// Rows of the cross-entropy: `Σ exp(x − max)` in 16 f32 lanes per 512-element block, blocks
/// added in order in f64 (deterministic, ~1e-7 relative).
#[inline(always)]
fn sum_exp_body(row: &[f32], max: f32) -> f64 {
    const LANES: usize = 16;
    let mut total = 0.0f64;
    for block in row.chunks(512) {
        let mut acc = [0.0f32; LANES];
        let mut it = block.chunks_exact(LANES);
        for c in &mut it {
            for l in 0..LANES {
                acc[l] += exp_f32(c[l] - max);
            }
        }
        for (l, &x) in it.remainder().iter().enumerate() {
            acc[l] += exp_f32(x - max);
        }
        total += acc.iter().map(|&a| a as f64).sum::<f64>();
    }
    total
}

/// `row[j] = exp(row[j] − max)` in place, returning their sum: [`sum_exp_body`]'s lanes and
/// order (the same bits), with each exponential stored.
#[inline(always)]
fn exp_sum_body(row: &mut [f32], max: f32) -> f64 {
    const LANES: usize = 16;
    let mut total = 0.0f64;
    for block in row.chunks_mut(512) {
        let mut acc = [0.0f32; LANES];
        let mut it = block.chunks_exact_mut(LANES);
        for c in &mut it {
            for l in 0..LANES {
                c[l] = exp_f32(c[l] - max);
                acc[l] += c[l];
            }
        }
        for (l, x) in it.into_remainder().iter_mut().enumerate() {
            *x = exp_f32(*x - max);
            acc[l] += *x;
        }
        total += acc.iter().map(|&a| a as f64).sum::<f64>();
    }
    total
}

/// `row[j] *= scale` in place.
#[inline(always)]
fn scale_body(row: &mut [f32], scale: f32) {
    for x in row.iter_mut() {
        *x *= scale;
    }
}

/// `row[j] = scale · exp(row[j] − max)` in place.
#[inline(always)]
fn exp_scale_body(row: &mut [f32], max: f32, scale: f32) {
    for x in row.iter_mut() {
        *x = scale * exp_f32(*x - max);
    }
}

super::row_isa::dispatch_rows! {
    /// `Σ exp(x − max)` over a row, using the widest vectors the CPU has ([`row_isa`]).
    pub fn sum_exp_f32(row: &[f32], max: f32) -> f64 = sum_exp_body;
    sve = fugu_rows::sve::Sve::sum_exp;
}

super::row_isa::dispatch_rows! {
    /// `row[j] = scale · exp(row[j] − max)`, using the widest vectors the CPU has ([`row_isa`]).
    pub fn exp_scale_f32(row: &mut [f32], max: f32, scale: f32) = exp_scale_body;
    sve = fugu_rows::sve::Sve::exp_scale;
}

super::row_isa::dispatch_rows! {
    /// `row[j] = exp(row[j] − max)`, returning their sum ([`sum_exp_f32`]'s), using the widest
    /// vectors the CPU has ([`row_isa`]).
    pub fn exp_sum_f32(row: &mut [f32], max: f32) -> f64 = exp_sum_body;
    sve = fugu_rows::sve::Sve::exp_sum;
}

super::row_isa::dispatch_rows! {
    /// `row[j] *= scale`, using the widest vectors the CPU has ([`row_isa`]).
    pub fn scale_f32(row: &mut [f32], scale: f32) = scale_body;
    sve = fugu_rows::sve::Sve::scale;
}

#[cfg(test)]
mod row_tests {
    use super::*;
    use crate::ops::testutil::assert_rows_match;

    #[test]
    fn dispatched_rows_match_the_portable_body() {
        let row: Vec<f32> = (0..1237)
            .map(|i| ((i * 7919) % 1000) as f32 * 0.013 - 6.0)
            .collect();
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        assert_rows_match(&[sum_exp_f32(&row, m)], &[sum_exp_body(&row, m)]);
        let want: f64 = row.iter().map(|&x| ((x - m) as f64).exp()).sum();
        assert!((sum_exp_f32(&row, m) - want).abs() / want < 1e-6);
        let (mut a, mut b) = (row.clone(), row.clone());
        exp_scale_f32(&mut a, m, 0.5);
        exp_scale_body(&mut b, m, 0.5);
        assert_rows_match(&a, &b);
        // One pass: the same exponentials (scale 1) and the same sum as the two kernels.
        let (mut e, mut want) = (row.clone(), row.clone());
        let sum = exp_sum_f32(&mut e, m);
        exp_scale_f32(&mut want, m, 1.0);
        assert_rows_match(&e, &want);
        assert_rows_match(&[sum], &[sum_exp_f32(&row, m)]);
        let mut e2 = row.clone();
        assert_rows_match(&[exp_sum_body(&mut e2, m)], &[sum]);
        assert_rows_match(&e2, &e);
        // Scaling the exponentials is the two-pass kernel's product, bit for bit.
        scale_f32(&mut e, 0.5);
        scale_body(&mut e2, 0.5);
        assert_rows_match(&e, &a);
        assert_rows_match(&e2, &a);
    }
}

//! Test helpers: a small deterministic RNG, central finite differences, comparisons.

/// SplitMix64: deterministic, good enough for test data.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    /// `n` values uniform in [-1, 1).
    pub fn vec(&mut self, n: usize) -> Vec<f64> {
        (0..n).map(|_| self.uniform()).collect()
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn tokens(&mut self, len: usize, n: usize) -> Vec<u32> {
        (0..len).map(|_| self.below(n) as u32).collect()
    }
}

/// Finite-difference step.
pub const FD_H: f64 = 1e-6;
/// Relative tolerance of the finite-difference checks.
pub const FD_RTOL: f64 = 1e-6;
/// Absolute floor of the finite-difference checks (round-off of `L(x±h)` divided by `2h`).
pub const FD_ATOL: f64 = 1e-8;

/// Checks `analytic` against central differences `(L(x+h) - L(x-h)) / 2h` for every element
/// of `x`: `|a - n| <= FD_RTOL * max(|a|, |n|) + FD_ATOL`.
pub fn check_grad(name: &str, x: &[f64], analytic: &[f64], mut loss: impl FnMut(&[f64]) -> f64) {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient length");
    let mut xp = x.to_vec();
    for i in 0..x.len() {
        let orig = xp[i];
        xp[i] = orig + FD_H;
        let lp = loss(&xp);
        xp[i] = orig - FD_H;
        let lm = loss(&xp);
        xp[i] = orig;
        let num = (lp - lm) / (2.0 * FD_H);
        let a = analytic[i];
        let err = (a - num).abs();
        assert!(
            err <= FD_RTOL * a.abs().max(num.abs()) + FD_ATOL,
            "{name}[{i}]: analytic {a:e}, finite difference {num:e}, error {err:e}"
        );
    }
}

/// `Σ w ⊙ y`: the scalar objective of the gradient checks.
pub fn dot(w: &[f64], y: &[f64]) -> f64 {
    assert_eq!(w.len(), y.len());
    w.iter().zip(y).map(|(a, b)| a * b).sum()
}

pub fn to_f32(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// The `f64` values of `x` rounded to `f32` (so both precisions see identical inputs).
pub fn round_f32(x: &[f64]) -> Vec<f64> {
    x.iter().map(|&v| v as f32 as f64).collect()
}

/// Normwise agreement of an `f32` result with the `f64` one:
/// `max |a - b| <= tol * max(max |b|, 1e-30)`.
pub fn assert_close_f32(name: &str, a: &[f32], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{name}: length");
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-30);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let err = (*x as f64 - y).abs();
        assert!(
            err <= tol * scale,
            "{name}[{i}]: f32 {x:e} vs f64 {y:e} (error {err:e}, scale {scale:e})"
        );
    }
}

/// Elementwise closeness: `|a - b| <= tol * max(1, |b|)`.
pub fn assert_close(name: &str, a: &[f64], b: &[f64], tol: f64) {
    assert_eq!(a.len(), b.len(), "{name}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * y.abs().max(1.0),
            "{name}[{i}]: {x:e} vs {y:e}"
        );
    }
}

/// Runs `f` on a dedicated rayon pool of `threads` threads.
pub fn with_threads<R: Send>(threads: usize, f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
        .install(f)
}

/// The dispatched row kernels' results against the portable bodies': bit for bit where the
/// kernels are the portable bodies compiled for wider vectors, within 2·10⁻⁶ relative (of the
/// row's largest magnitude) where they are fugu-rows' hand-written SVE kernels, whose own
/// tighter bounds against f64 are tested there (`rows/tests/sve.rs`); here it checks that the
/// dispatch calls the kernel of the same function.
pub fn assert_rows_match<T: Copy + Into<f64> + PartialEq + std::fmt::Debug>(got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len());
    if crate::ops::row_isa::row_isa().bit_identical_to_portable() {
        assert_eq!(got, want);
        return;
    }
    let scale = want
        .iter()
        .map(|&w| w.into().abs())
        .fold(f64::MIN_POSITIVE, f64::max);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.into(), w.into());
        assert!((g - w).abs() <= 2e-6 * scale, "element {i}: {g} vs {w}");
    }
}

//! The measured GEMM rates (`fugu bench gemm --format json`) that turn the GEMM calls a model
//! declares per op ([`crate::model::cost`]; GPT-2's in `model/gpt2_cost.rs`) into time.
//!
//! **The rates** ([`GemmRates`]): a row measured at the same shape, transposes and thread count
//! is used as is. Otherwise the nearest row in shape (the sum of |ln x − ln x'| over m, n, k
//! and batch, plus 1 per differing transpose flag) among those at the nearest thread count,
//! its rate scaled by the ratio of thread counts. `fugu predict gemm-shapes` prints the shapes
//! a set of layouts makes, so that they can all be measured exactly.

use crate::bench::gemm::GemmShape;
pub use crate::model::cost::{GemmCall, Pass};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::Path;

/// One measured GEMM rate: a `fugu bench gemm --format json` row, reduced to what the model
/// reads (`[[compute.gemm]]` in a profile: `m`, `n`, `k`, `batch`, `ta`, `tb`, `threads`,
/// `gflops`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GemmRate {
    #[serde(flatten)]
    pub shape: GemmShape,
    pub threads: usize,
    pub gflops: f64,
}

/// The fields of a [`GemmRate`] (its shape is flattened into it, which serde cannot combine
/// with `deny_unknown_fields`: [`super::profile::Profile::load`] checks them with this list).
pub const GEMM_RATE_FIELDS: [&str; 8] = ["m", "n", "k", "batch", "ta", "tb", "threads", "gflops"];

/// The measured rates of one machine.
#[derive(Clone, Debug, Default)]
pub struct GemmRates(pub Vec<GemmRate>);

impl GemmRates {
    /// GFLOP/s of `c` on `threads` threads, and whether a row measured exactly that; `None`
    /// without rows.
    pub fn rate(&self, c: &GemmShape, threads: usize) -> Option<(f64, bool)> {
        let ln = |x: usize| (x.max(1) as f64).ln();
        let near_threads = self
            .0
            .iter()
            .map(|r| r.threads)
            .min_by_key(|&t| (t.abs_diff(threads), t))?;
        let dist = |r: &GemmShape| {
            (ln(r.m) - ln(c.m)).abs()
                + (ln(r.n) - ln(c.n)).abs()
                + (ln(r.k) - ln(c.k)).abs()
                + (ln(r.batch) - ln(c.batch)).abs()
                + f64::from(u8::from(r.ta != c.ta) + u8::from(r.tb != c.tb))
        };
        let dist = |r: &GemmRate| dist(&r.shape);
        let best = self
            .0
            .iter()
            .filter(|r| r.threads == near_threads)
            .min_by(|a, b| dist(a).total_cmp(&dist(b)))?;
        let exact = near_threads == threads && dist(best) == 0.0;
        Some((best.gflops * threads as f64 / near_threads as f64, exact))
    }

    /// Seconds of the calls on `threads` threads; `None` without rows.
    pub fn seconds(&self, calls: &[GemmCall], threads: usize) -> Option<f64> {
        calls.iter().try_fold(0.0, |acc, c| {
            self.rate(&c.shape, threads)
                .map(|(g, _)| acc + c.flops() / (g * 1e9))
        })
    }

    /// The calls' shapes with no row measured at exactly that shape and thread count, in
    /// `fugu bench gemm --shape` syntax.
    pub fn missing(&self, calls: &[GemmCall], threads: usize) -> BTreeSet<String> {
        calls
            .iter()
            .filter(|c| !matches!(self.rate(&c.shape, threads), Some((_, true))))
            .map(|c| c.shape.arg())
            .collect()
    }

    /// Checks the rows.
    pub fn validate(&self) -> Result<()> {
        for (i, r) in self.0.iter().enumerate() {
            let d = &r.shape;
            if d.m == 0 || d.n == 0 || d.k == 0 || d.batch == 0 || r.threads == 0 {
                bail!("compute.gemm[{i}]: m, n, k, batch and threads must be at least 1");
            }
            if !(r.gflops > 0.0 && r.gflops.is_finite()) {
                bail!(
                    "compute.gemm[{i}]: gflops = {}: expected a positive number",
                    r.gflops
                );
            }
        }
        Ok(())
    }
}

/// The f32 rows of a `fugu bench gemm --format json` file (one JSON object per line), fugu's
/// own rates.
pub fn read_bench_gemm(path: &Path) -> Result<Vec<GemmRate>> {
    #[derive(Deserialize)]
    struct Row {
        #[serde(flatten)]
        shape: GemmShape,
        threads: usize,
        dtype: String,
        gflops: f64,
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the GEMM benchmark {}", path.display()))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let r: Row = serde_json::from_str(line).with_context(|| {
            format!(
                "{} line {}: expected a `fugu bench gemm --format json` row",
                path.display(),
                i + 1
            )
        })?;
        if r.dtype == "f32" {
            rows.push(GemmRate {
                shape: r.shape,
                threads: r.threads,
                gflops: r.gflops,
            });
        }
    }
    if rows.is_empty() {
        bail!(
            "{}: no f32 rows of `fugu bench gemm --format json`",
            path.display()
        );
    }
    let rates = GemmRates(rows);
    rates
        .validate()
        .with_context(|| format!("in {}", path.display()))?;
    Ok(rates.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(
        m: usize,
        n: usize,
        k: usize,
        batch: usize,
        ta: bool,
        tb: bool,
        count: usize,
    ) -> GemmCall {
        GemmCall::new([m, n, k], batch, (ta, tb), count)
    }

    fn rate(m: usize, n: usize, k: usize, threads: usize, gflops: f64) -> GemmRate {
        GemmRate {
            shape: call(m, n, k, 1, false, false, 1).shape,
            threads,
            gflops,
        }
    }

    #[test]
    fn exact_nearest_and_thread_fallback() {
        let r = GemmRates(vec![
            rate(1024, 384, 128, 1, 50.0),
            rate(1024, 96, 128, 1, 20.0),
            rate(1024, 384, 128, 2, 90.0),
        ]);
        let c = call(1024, 384, 128, 1, false, false, 4);
        assert_eq!(r.rate(&c.shape, 1), Some((50.0, true)));
        assert_eq!(r.rate(&c.shape, 2), Some((90.0, true)));
        // Nearest shape: n = 100 is closer to 96 than to 384.
        let near = call(1024, 100, 128, 1, false, false, 1);
        assert_eq!(r.rate(&near.shape, 1), Some((20.0, false)));
        // A transpose flag counts as a distance of 1: still the same shape's row.
        let tb = call(1024, 384, 128, 1, false, true, 1);
        assert_eq!(r.rate(&tb.shape, 1), Some((50.0, false)));
        // No 4-thread rows: the 2-thread ones, scaled by 4/2.
        assert_eq!(r.rate(&c.shape, 4), Some((180.0, false)));
        let secs = r.seconds(&[c], 1).unwrap();
        assert!((secs - c.flops() / 50e9).abs() < 1e-15);
        assert_eq!(
            r.missing(&[c, near], 1).into_iter().collect::<Vec<_>>(),
            vec!["1024x100x128".to_string()]
        );
        assert!(GemmRates::default().rate(&c.shape, 1).is_none());
    }

    #[test]
    fn bench_args_read_back() {
        for c in [
            call(8, 4, 2, 1, false, true, 1),
            call(8, 4, 2, 3, true, true, 1),
        ] {
            let arg = c.shape.arg();
            assert_eq!(
                crate::bench::gemm::parse_shape(&arg).unwrap().shape,
                c.shape
            );
        }
        assert_eq!(call(8, 4, 2, 3, true, true, 1).shape.arg(), "8x4x2x3:ta:tb");
    }

    #[test]
    fn bad_rows_are_named() {
        let bad = GemmRates(vec![rate(0, 1, 1, 1, 1.0)]);
        assert!(bad.validate().unwrap_err().to_string().contains("gemm[0]"));
        let bad = GemmRates(vec![rate(1, 1, 1, 1, f64::NAN)]);
        assert!(bad.validate().unwrap_err().to_string().contains("gflops"));
    }
}

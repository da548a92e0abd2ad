//! The GEMMs one rank makes per micro-batch, per compute op and pass, and the measured GEMM
//! rates (`fugu bench gemm --format json`) that turn them into time.
//!
//! **The calls** ([`op_gemms`]) are those of the ops, in `fugu bench gemm`'s terms (C = A·B,
//! row-major, `ta`/`tb` when A/B is stored transposed):
//!
//! * a linear layer of `n` tokens, `ic → oc` (`ops/linear.rs`): forward `n × oc × ic`;
//!   backward data `n × ic × oc` (`tb` for the `InOut` weights of the blocks, none for the
//!   `OutIn` LM head, which is `tb` forward), backward weight `ic × oc × n` (`OutIn`:
//!   `oc × ic × n`), both with `ta`;
//! * attention (`ops/attention.rs`), per sequence a batch of `nh` heads: scores Q·Kᵀ
//!   (`attention:baddbmm`, `T × T × hs`, `tb`) and values P·V (`attention:bmm`, `T × hs × T`);
//!   backward, dP = dO·Vᵀ (`T × T × hs`, `tb`) and dV = Pᵀ·dO (`T × hs × T`, `ta`) under
//!   `attention:bmm`, dQ = dS·K and dK = dSᵀ·Q (`T × hs × T`, plain and `ta`) under
//!   `attention:baddbmm`.
//!
//! The real attention operands are strided views into the fused QKV buffer; the benchmark's
//! are contiguous, so their rates are an approximation there.
//!
//! **The rates** ([`GemmRates`]): a row measured at the same shape, transposes and thread count
//! is used as is. Otherwise the nearest row in shape (the sum of |ln x − ln x'| over m, n, k
//! and batch, plus 1 per differing transpose flag) among those at the nearest thread count,
//! its rate scaled by the ratio of thread counts. `fugu predict gemm-shapes` prints the shapes
//! a set of layouts makes, so that they can all be measured exactly.

use super::step::Shape;
use crate::bench::gemm::GemmShape;
use crate::model::gpt2_ops::forward as fwd;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::Path;

/// A forward or backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
}

/// One GEMM shape, called `count` times per micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct GemmCall {
    pub shape: GemmShape,
    pub count: usize,
}

impl GemmCall {
    /// FLOPs of all `count` calls.
    pub fn flops(&self) -> f64 {
        self.shape.flops() * self.count as f64
    }
}

/// How a linear layer stores its weight (`ops/linear.rs`).
#[derive(Clone, Copy)]
enum Weight {
    /// (in, out): the blocks' Conv1D weights.
    InOut,
    /// (out, in): the tied `wte` as the LM head.
    OutIn,
}

fn call(m: usize, n: usize, k: usize, batch: usize, ta: bool, tb: bool, count: usize) -> GemmCall {
    GemmCall {
        shape: GemmShape {
            m,
            n,
            k,
            batch,
            ta,
            tb,
        },
        count,
    }
}

/// The GEMMs of `count` linear layers of `n` tokens, `ic → oc`, in one pass.
fn linear(pass: Pass, n: usize, ic: usize, oc: usize, w: Weight, count: usize) -> Vec<GemmCall> {
    match (pass, w) {
        (Pass::Forward, Weight::InOut) => vec![call(n, oc, ic, 1, false, false, count)],
        (Pass::Forward, Weight::OutIn) => vec![call(n, oc, ic, 1, false, true, count)],
        (Pass::Backward, Weight::InOut) => vec![
            call(n, ic, oc, 1, false, true, count),
            call(ic, oc, n, 1, true, false, count),
        ],
        (Pass::Backward, Weight::OutIn) => vec![
            call(n, ic, oc, 1, false, false, count),
            call(oc, ic, n, 1, true, false, count),
        ],
    }
}

/// The GEMMs of a compute op (a `COMPUTE_OPS` entry, by its forward timer name) in one pass of one micro-batch on one
/// rank; `None` for the ops that are not GEMMs.
pub(super) fn op_gemms(op: &str, pass: Pass, s: &Shape) -> Option<Vec<GemmCall>> {
    let u = |x: f64| x as usize;
    let (n, c, t, hs, nh, layers) = (u(s.mb * s.t), u(s.c), u(s.t), u(s.hs), u(s.nh), u(s.layers));
    let ctp = u(s.c / s.tp);
    let per_seq = u(s.mb) * layers;
    let forward = pass == Pass::Forward;
    Some(match op {
        fwd::QKV => linear(pass, n, c, 3 * ctp, Weight::InOut, layers),
        fwd::PROJ => linear(pass, n, ctp, c, Weight::InOut, layers),
        fwd::MLP_MM => {
            let mut v = linear(pass, n, c, u(s.f), Weight::InOut, layers);
            v.extend(linear(pass, n, u(s.f), c, Weight::InOut, layers));
            v
        }
        fwd::LM_HEAD if s.last => linear(pass, n, c, u(s.vp), Weight::OutIn, 1),
        fwd::LM_HEAD => Vec::new(),
        fwd::BADDBMM if forward => vec![call(t, t, hs, nh, false, true, per_seq)],
        fwd::BADDBMM => vec![
            call(t, hs, t, nh, false, false, per_seq),
            call(t, hs, t, nh, true, false, per_seq),
        ],
        fwd::BMM if forward => vec![call(t, hs, t, nh, false, false, per_seq)],
        fwd::BMM => vec![
            call(t, t, hs, nh, false, true, per_seq),
            call(t, hs, t, nh, true, false, per_seq),
        ],
        _ => return None,
    })
}

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

    /// The calls of every op, forward and backward, add up to Megatron's FLOPs formula (every
    /// GEMM of the model, the LM head's padded vocabulary included), at tp 1 and per TP rank.
    #[test]
    fn calls_add_up_to_the_model_flops() {
        use crate::config::ModelConfig;
        use crate::metrics::flops::megatron_flops_per_step;
        use crate::model::stage::Stage;
        use crate::model::table::padded_vocab;
        use crate::predict::step::COMPUTE_OPS;
        let m = ModelConfig {
            arch: crate::config::Arch::Gpt2,
            vocab_size: 1000,
            n_positions: 64,
            n_embd: 96,
            n_head: 4,
            n_layer: 3,
        };
        let (t, mb) = (64, 3);
        for tp in [1, 2, 4] {
            let s = Shape::new(&m, t, mb, tp, &Stage::whole(m.n_layer));
            let mut flops = 0.0;
            for op in COMPUTE_OPS {
                for pass in [Pass::Forward, Pass::Backward] {
                    let calls = op_gemms(op.forward, pass, &s).unwrap_or_default();
                    flops += calls.iter().map(GemmCall::flops).sum::<f64>();
                }
            }
            let want =
                megatron_flops_per_step(mb, t, m.n_layer, m.n_embd, padded_vocab(m.vocab_size))
                    / tp as f64;
            assert!(
                (flops - want).abs() <= 1e-9 * want,
                "tp {tp}: {flops} vs {want}"
            );
        }
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

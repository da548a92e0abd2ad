//! The machine's FP32 peak: cores × FMA width × 2 × clock, measured with a tight FMA loop
//! (so the clock and the number of FMA pipes need not be known), or given by
//! `FUGU_PEAK_GFLOPS_PER_CORE`. Benchmarks and the trainer's
//! `peak_pct` both come from here.

use crate::arch::fma_peak::{fma_loop, native_loop};
use crate::kernel::{Isa, Kernel, Operand};
use crate::precision::Precision;
use std::time::Instant;

/// How a peak figure was obtained.
#[derive(Clone, Debug, PartialEq)]
pub enum PeakSource {
    /// Measured with an FMA loop of this ISA on one core, times the thread count.
    Measured { isa: Isa },
    /// Measured like [`PeakSource::Measured`] by an earlier run on this machine, higher than
    /// this run's measurement, and read back from a per-machine cache (kept by the `fugu`
    /// binary).
    Cached { isa: Isa },
    /// Measured like [`PeakSource::Measured`] with the loop of a native `prec` kernel
    /// (`vdpbf16ps` for bf16 on AVX-512 BF16).
    MeasuredNative { isa: Isa, prec: Precision },
    /// Set by the user (`FUGU_PEAK_GFLOPS_PER_CORE` or a flag).
    Given,
}

/// What users read (`metrics.jsonl`'s and `fugu bench gemm`'s `peak_source`, reports):
/// `measured (avx2 FMA loop)`, `cached (avx512 FMA loop, an earlier run)`,
/// `measured (bf16 avx512 loop)`, `given`.
impl std::fmt::Display for PeakSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeakSource::Measured { isa } => write!(f, "measured ({isa} FMA loop)"),
            PeakSource::Cached { isa } => write!(f, "cached ({isa} FMA loop, an earlier run)"),
            PeakSource::MeasuredNative { isa, prec } => {
                write!(f, "measured ({} {isa} loop)", prec.name())
            }
            PeakSource::Given => f.write_str("given"),
        }
    }
}

/// An FP32 peak for a number of threads.
#[derive(Clone, Debug, PartialEq)]
pub struct Peak {
    /// GFLOP/s of one core.
    pub per_core_gflops: f64,
    /// Threads (cores) the peak counts.
    pub threads: usize,
    pub source: PeakSource,
}

impl Peak {
    /// Peak of all counted threads, GFLOP/s.
    pub fn total_gflops(&self) -> f64 {
        self.per_core_gflops * self.threads as f64
    }

    /// The same per-core peak for another thread count.
    pub fn for_threads(&self, threads: usize) -> Peak {
        Peak {
            threads,
            ..self.clone()
        }
    }

    /// One line saying how the figure was derived.
    pub fn describe(&self) -> String {
        match &self.source {
            PeakSource::Measured { isa } => format!(
                "peak {:.1} GFLOP/s = {} cores x {:.1} GFLOP/s/core (measured: {} FMA loop on 1 core, best of 5)",
                self.total_gflops(),
                self.threads,
                self.per_core_gflops,
                isa
            ),
            PeakSource::Cached { isa } => format!(
                "peak {:.1} GFLOP/s = {} cores x {:.1} GFLOP/s/core (cached: best {} FMA loop on 1 core measured on this machine)",
                self.total_gflops(),
                self.threads,
                self.per_core_gflops,
                isa
            ),
            PeakSource::MeasuredNative { isa, prec } => format!(
                "{prec} peak {:.1} GFLOP/s = {} cores x {:.1} GFLOP/s/core (measured: {isa} native {prec} dot-product loop on 1 core, best of 5)",
                self.total_gflops(),
                self.threads,
                self.per_core_gflops,
            ),
            PeakSource::Given => format!(
                "peak {:.1} GFLOP/s = {} cores x {:.1} GFLOP/s/core (given by FUGU_PEAK_GFLOPS_PER_CORE or --peak-per-core)",
                self.total_gflops(),
                self.threads,
                self.per_core_gflops
            ),
        }
    }
}

/// Measures one core's FP32 FMA throughput (GFLOP/s) with `isa`'s widest FMA, on the calling
/// thread: the best of five ~20 ms runs after a warm-up (which also lets the clock settle).
pub fn measure_core_gflops(isa: Isa) -> Option<f64> {
    best_rate(|iters| fma_loop(isa, iters))
}

/// Like [`measure_core_gflops`], with the loop of `isa`'s native kernel at `prec`; `None` when
/// there is none (then `prec` runs on the f32 FMAs, whose peak is the one to use).
pub fn measure_native_core_gflops(isa: Isa, prec: Precision) -> Option<f64> {
    best_rate(|iters| native_loop(isa, prec, iters))
}

/// The best of five ~20 ms runs of `run(iters)` (which returns its FLOPs), in GFLOP/s.
fn best_rate(run: impl Fn(u64) -> Option<f64>) -> Option<f64> {
    let _ = run(1 << 16)?;
    // Calibrate the iteration count to about 20 ms.
    let mut iters: u64 = 1 << 16;
    loop {
        let t = Instant::now();
        run(iters)?;
        if t.elapsed().as_secs_f64() > 0.005 || iters > 1 << 34 {
            break;
        }
        iters *= 2;
    }
    iters *= 4;
    let mut rates: Vec<f64> = (0..5)
        .map(|_| {
            let t = Instant::now();
            let flops = run(iters).unwrap_or(0.0);
            flops / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    // Interference from other processes only ever slows the loop down, so the best run is
    // the closest to the hardware ceiling.
    rates.sort_by(f64::total_cmp);
    Some(rates[4])
}

/// The peak of `threads` threads running `kernel`, the kernel of a GEMM at `prec`, measured
/// now with the loop of its instructions; `None` when `kernel` reads f32 words (an f32 kernel,
/// or the f16 emulation: they run on the f32 FMAs, whose peak [`machine_peak`] gives).
pub fn measured_native_peak(kernel: &Kernel, prec: Precision, threads: usize) -> Option<Peak> {
    if kernel.operand == Operand::F32 {
        return None;
    }
    let isa = kernel.isa;
    Some(Peak {
        per_core_gflops: measure_native_core_gflops(isa, prec)?,
        threads,
        source: PeakSource::MeasuredNative { isa, prec },
    })
}

/// The peak for `threads` threads running `isa`: `FUGU_PEAK_GFLOPS_PER_CORE` × threads
/// if set, otherwise measured on one core and multiplied by the thread count.
pub fn machine_peak(isa: Isa, threads: usize) -> Result<Peak, crate::GemmError> {
    if let Ok(v) = std::env::var("FUGU_PEAK_GFLOPS_PER_CORE") {
        let total: f64 = v
            .trim()
            .parse()
            .ok()
            .filter(|x: &f64| *x > 0.0 && x.is_finite())
            .ok_or_else(|| crate::GemmError::Config {
                what: "FUGU_PEAK_GFLOPS_PER_CORE".into(),
                value: v.clone(),
                expected: "a positive number of GFLOP/s for one core".into(),
            })?;
        return Ok(Peak {
            per_core_gflops: total,
            threads,
            source: PeakSource::Given,
        });
    }
    Ok(measured_peak(isa, threads))
}

/// The peak for `threads` threads measured now with `isa`'s FMA loop on one core (the
/// portable loop when `isa`'s is unavailable here, which the source then names).
pub fn measured_peak(isa: Isa, threads: usize) -> Peak {
    let (per_core, used) = match measure_core_gflops(isa) {
        Some(g) => (g, isa),
        None => (
            measure_core_gflops(Isa::Portable).unwrap_or(1.0),
            Isa::Portable,
        ),
    };
    Peak {
        per_core_gflops: per_core,
        threads,
        source: PeakSource::Measured { isa: used },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::kernel_for_precision;

    /// A native peak exists exactly where a native kernel does, and is positive; where the
    /// CPU has none it says so (the precision then runs on the f32 FMAs).
    #[test]
    fn native_peak_exists_where_a_native_kernel_does() {
        for isa in Isa::ALL {
            for prec in [Precision::Bf16, Precision::F16] {
                let Some(kernel) = kernel_for_precision(isa, prec) else {
                    continue;
                };
                let native = kernel.operand != Operand::F32;
                let peak = measured_native_peak(&kernel, prec, 2);
                assert_eq!(peak.is_some(), native, "{isa} {prec}");
                match peak {
                    Some(p) => {
                        assert!(p.per_core_gflops > 0.0 && p.total_gflops() > p.per_core_gflops);
                        assert!(p.describe().contains("native"), "{}", p.describe());
                    }
                    None if isa == Isa::Avx512 && prec == Precision::Bf16 => {
                        eprintln!("skipped: this CPU has no AVX512_BF16 (no native bf16 peak)")
                    }
                    None => {}
                }
            }
        }
    }
}

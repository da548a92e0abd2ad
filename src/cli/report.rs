//! `fugu report`: REPORT.md, SVG charts and CSV tables from training runs and GEMM benchmarks.

use crate::report::{generate, ReportOptions};
use anyhow::Result;
use std::path::PathBuf;

/// Arguments of `fugu report`.
#[derive(clap::Args, Debug)]
#[command(after_long_help = "\
INPUTS:
  A directory with metrics.jsonl     a `fugu train` run (its breakdown.json is used when the
                                     step records carry no timers)
  metrics.jsonl, or a .json/.jsonl   a run, when its lines are metrics records
  file whose lines are metrics
  A .json file with                  `fugu bench comm --format json` output
  \"benchmark\": \"comm\"
  Any other .json/.jsonl file        `fugu bench gemm --format json` output
  A directory with bench-gemm*.jsonl every such file in it (a run directory may hold them too),
  or comm-*.json                     and every comm-*.json / bench-comm*.json

OUTPUTS (in --out):
  REPORT.md                          every table and chart with a line on how to read it
  breakdown.svg, breakdown-pct.svg   per-op time per step, stacked per run
  scaling-throughput.svg,            strong/weak scaling: tokens/s and speedup against ideal
  scaling-speedup.svg
  tflops.svg                         model TFLOP/s per process and % of peak
  gemm-<T>t.svg, gemm-peak-pct.svg   GEMM GFLOP/s against size per ISA and thread count
  comm-<OP>-time.svg,                communication time and bus bandwidth against message
  comm-<OP>-busbw.svg                size per operation, one line per benchmark file
  predict-tflops.svg, predict-step.svg,  `fugu predict` output against nodes, measured runs
  predict-breakdown.svg              overlaid; the predicted per-op breakdown
  *.csv                              one per table

Inputs that cannot be used (missing or malformed metrics, no step records) are listed in
REPORT.md under \"Skipped inputs\"; the exit status is non-zero only when none is usable.

EXAMPLE:
  fugu bench gemm --set square --threads 1,2 --format json > bench/bench-gemm.jsonl
  fugu report runs/n1 runs/n2 runs/n4 bench/ --out report/")]
pub struct ReportArgs {
    /// Run directories, metrics files, GEMM benchmark files (.json/.jsonl) or directories
    /// holding bench-gemm*.jsonl (see below).
    #[arg(value_name = "INPUT")]
    pub inputs: Vec<PathBuf>,
    /// A `fugu bench gemm --format json` output file whatever its name, or a directory of
    /// bench-gemm*.jsonl (repeatable).
    #[arg(long, value_name = "FILE")]
    pub gemm: Vec<PathBuf>,
    /// A `fugu bench comm --format json` output file whatever its name, or a directory of
    /// comm-*.json (repeatable).
    #[arg(long, value_name = "FILE")]
    pub comm: Vec<PathBuf>,
    /// A `fugu predict --format json` output file whatever its name (repeatable): predicted
    /// TFLOP/s, step time and breakdown against nodes, the measured runs overlaid.
    #[arg(long, value_name = "FILE")]
    pub predict: Vec<PathBuf>,
    /// Output directory for REPORT.md, the SVG charts and the CSV tables (created if missing;
    /// files of the same names are replaced).
    #[arg(long, short, value_name = "DIR")]
    pub out: PathBuf,
}

/// Runs `fugu report`.
pub fn run(args: ReportArgs) -> Result<()> {
    if args.inputs.is_empty()
        && args.gemm.is_empty()
        && args.comm.is_empty()
        && args.predict.is_empty()
    {
        anyhow::bail!("nothing to report on: give run directories and/or benchmark files");
    }
    let o = generate(&ReportOptions {
        inputs: args.inputs,
        gemm: args.gemm,
        comm: args.comm,
        predict: args.predict,
        out: args.out,
    })?;
    for s in &o.skipped {
        eprintln!("skipped {}: {}", s.input, s.reason);
    }
    eprintln!(
        "fugu report: {} run{}, {} GEMM row{}, {} skipped; wrote {} files",
        o.runs,
        if o.runs == 1 { "" } else { "s" },
        o.gemm_rows,
        if o.gemm_rows == 1 { "" } else { "s" },
        o.skipped.len(),
        o.files.len()
    );
    if let Some(r) = o.files.first() {
        println!("{}", r.display());
    }
    Ok(())
}

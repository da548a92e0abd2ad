//! `fugu bench attention`: the three-step path and each fused attention form of a device,
//! forward and backward, on named model shapes or custom ones (`bench/attention.rs`).

use crate::backend::{Backend, CudaSettings, Device, Dtype};
use crate::bench::attention::{
    case_header, case_set, format_row, parse_case, run_case, table_header, AttentionForms,
    AttnBenchOptions, AttnCase,
};
use anyhow::{bail, Result};

/// Arguments of `fugu bench attention`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchAttentionArgs {
    /// Shape sets: gpt2 (GPT-2 124M, B=16 T=1024), llama (heads of 128 with grouped-query
    /// attention: llama-d128 B=8 T=2048, a Llama 3 8B layer B=8 T=2048), all.
    #[arg(long = "set", value_delimiter = ',', default_value = "gpt2")]
    pub sets: Vec<String>,
    /// Custom shape BxTxHxHS or BxTxHxHSxKV (sequences, tokens, query heads, head size,
    /// key/value heads; repeatable); replaces the sets unless --set is given.
    #[arg(long = "shape")]
    pub shapes: Vec<String>,
    /// Storage type of q, k, v, the output and the gradients: bf16, fp16 or f32 (a GPU's
    /// fused kernels take 16-bit types only; in f32 it times the three-step path).
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    pub dtype: Dtype,
    /// Where attention runs: cpu, or cuda / cuda:N (needs a build with --features cuda).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda|cuda:N")]
    pub device: Device,
    /// Seconds of timed calls per contender and pass.
    #[arg(long, default_value_t = 0.5)]
    pub budget: f64,
    /// Rounds over the contenders (each timed once per round; the median is reported).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Time only the fused forms whose settings contain this text (e.g. `wgmma`; the
    /// default form's settings read `default`); the three-step path always runs, as the
    /// reference.
    #[arg(long)]
    pub only: Option<String>,
    /// Leave out the fused forms whose settings contain this text (e.g. `wgmma`, to time the
    /// others in a process a faulting kernel cannot take down).
    #[arg(long)]
    pub skip: Option<String>,
    /// Output format.
    #[arg(long, default_value = "table", value_parser = ["table", "json"])]
    pub format: String,
}

fn parse_dtype(s: &str) -> Result<Dtype, String> {
    fugu_gemm::Precision::parse(s)
        .map(Dtype::of_precision)
        .map_err(|e| e.to_string())
}

/// Runs the benchmark.
pub fn run(args: BenchAttentionArgs) -> Result<()> {
    crate::backend::device::check_settings(args.device, CudaSettings::default())?;
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if !args.budget.is_finite() || args.budget < 0.0 {
        bail!("--budget {}: expected seconds, at least 0", args.budget);
    }
    let explicit_sets = std::env::args().any(|a| a == "--set" || a.starts_with("--set="));
    let mut cases = Vec::new();
    if args.shapes.is_empty() || explicit_sets {
        for s in &args.sets {
            cases.extend(case_set(s.trim())?);
        }
    }
    for s in &args.shapes {
        cases.push(parse_case(s)?);
    }
    match args.device {
        Device::Cpu => {
            let mut be = crate::backend::cpu::CpuBackend::new();
            // Where f32 FMAs run the type's GEMMs the backend has no peak of its own: the
            // machine's FP32 peak, as the trainer's MFU and `fugu bench gemm` use.
            let peak = match be.peak_gflops(args.dtype) {
                Some(p) => Some(p),
                None => {
                    let rt = fugu_gemm::Runtime::global()?;
                    let p = crate::metrics::machine::machine_peak(
                        rt.kernel_at(args.dtype.precision()).isa,
                        rt.threads(),
                        None,
                    )?;
                    Some((p.total_gflops(), p.describe()))
                }
            };
            run_cases(&mut be, &args, &cases, peak)
        }
        Device::Cuda(ordinal) => run_on_cuda(ordinal, &args, &cases),
    }
}

/// Every case on `be`, rates against `peak` (GFLOP/s and where it comes from).
fn run_cases<B: AttentionForms>(
    be: &mut B,
    args: &BenchAttentionArgs,
    cases: &[AttnCase],
    peak: Option<(f64, String)>,
) -> Result<()> {
    eprintln!("device: {}", be.describe());
    let opts = AttnBenchOptions {
        budget_s: args.budget,
        rounds: args.rounds,
        only: args.only.clone(),
        skip: args.skip.clone(),
    };
    let json = args.format == "json";
    for case in cases {
        let header = case_header(case, args.dtype, peak.as_ref());
        // JSON rows go to stdout alone; the header is progress on stderr.
        if json {
            eprintln!("{header}");
        }
        let rows = run_case(be, case, args.dtype, &opts, peak.as_ref().map(|p| p.0))?;
        if !json {
            println!("{header}\n{}", table_header());
        }
        for r in &rows {
            if json {
                println!("{}", serde_json::to_string(r)?);
            } else {
                println!("{}", format_row(r));
            }
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn run_on_cuda(
    ordinal: Option<usize>,
    args: &BenchAttentionArgs,
    cases: &[AttnCase],
) -> Result<()> {
    let mut be = crate::backend::cuda::CudaBackend::new(ordinal, CudaSettings::default())?;
    let peak = be.peak_gflops(args.dtype);
    run_cases(&mut be, args, cases, peak)
}

#[cfg(not(feature = "cuda"))]
fn run_on_cuda(ordinal: Option<usize>, _: &BenchAttentionArgs, _: &[AttnCase]) -> Result<()> {
    Err(crate::backend::device::no_cuda_build(Device::Cuda(ordinal)))
}

//! `fugu bench gemm`: fugu-gemm against matrixmultiply (and OpenBLAS with the `openblas`
//! feature) on named shape sets or custom shapes.

use crate::backend::{CudaSettings, Device};
use crate::bench::gemm::{
    format_row, parse_shape, run_shape, shape_set, table_header, BenchOptions,
};
use anyhow::{bail, Context, Result};
use fugu_gemm::{Isa, Precision, Runtime, RuntimeConfig};

/// Arguments of `fugu bench gemm`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchGemmArgs {
    /// Shape sets: square, gpt2, attention, fugaku, all (comma-separated or repeated).
    #[arg(long = "set", value_delimiter = ',', default_value = "gpt2")]
    pub sets: Vec<String>,
    /// Custom shape MxNxK or MxNxKxBATCH, with `:ta` / `:tb` when A / B is stored transposed
    /// (repeatable; `fugu predict gemm-shapes` prints a model's); replaces the sets unless --set
    /// is given.
    #[arg(long = "shape")]
    pub shapes: Vec<String>,
    /// Thread counts (comma-separated); each runs in its own process so that the baseline
    /// uses the same count. Default: all threads fugu-gemm would use.
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// Force a micro-kernel: portable, avx2, avx512, neon, sve.
    #[arg(long)]
    pub isa: Option<String>,
    /// Precision of the GEMMs' operands: f32, bf16 (on a CPU, the AVX-512 BF16 kernel where
    /// it has one) or f16. Below f32 every contender gets the same rounded operands, and % of
    /// peak is of that type's peak; on a CPU fugu-gemm's f32 GEMM is timed beside it, on a
    /// device cuBLAS accumulates in f32 (the tensor cores for 16-bit operands).
    #[arg(long, default_value = "f32", value_parser = parse_precision)]
    pub dtype: Precision,
    /// With --device cuda: the type cuBLAS writes C in (default: the operands'; f32 with
    /// 16-bit operands is what mixed-precision training's weight-gradient GEMMs do).
    #[arg(long, value_parser = parse_precision)]
    pub out_dtype: Option<Precision>,
    /// Output format.
    #[arg(long, default_value = "table", value_parser = ["table", "json"])]
    pub format: String,
    /// Seconds spent timing each implementation per row (median over the repeats).
    #[arg(long, default_value_t = 0.5)]
    pub budget: f64,
    /// Skip the matrixmultiply baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// FP32 peak of one core in GFLOP/s, instead of measuring it.
    #[arg(long)]
    pub peak_per_core: Option<f64>,
    /// Where the GEMMs run: cpu (fugu-gemm and the baselines), or cuda / cuda:N (cuBLAS,
    /// checked against fugu-gemm; needs a build with --features cuda).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda|cuda:N")]
    pub device: Device,
    /// With --device cuda: TF32 tensor cores (default: strict fp32).
    #[arg(long)]
    pub tf32: bool,
}

fn parse_precision(s: &str) -> Result<Precision, String> {
    Precision::parse(s).map_err(|e| e.to_string())
}

/// Runs the benchmark.
pub fn run(args: BenchGemmArgs) -> Result<()> {
    crate::backend::device::check_settings(args.device, CudaSettings { tf32: args.tf32 })?;
    if args.device == Device::Cpu && args.out_dtype.is_some() {
        bail!("--out-dtype applies to --device cuda only (fugu-gemm writes f32)");
    }
    if args.tf32 && args.dtype != Precision::F32 {
        bail!("--tf32 applies to f32 operands, not --dtype {}", args.dtype);
    }
    if args.device != Device::Cpu && args.threads.len() > 1 {
        bail!("--threads with several counts applies to --device cpu only");
    }
    if args.threads.len() > 1 {
        return run_each_thread_count(&args);
    }
    let explicit_sets = std::env::args().any(|a| a == "--set" || a.starts_with("--set="));
    let mut shapes = Vec::new();
    if args.shapes.is_empty() || explicit_sets {
        for s in &args.sets {
            shapes.extend(shape_set(s.trim())?);
        }
    }
    for s in &args.shapes {
        shapes.push(parse_shape(s)?);
    }
    let mut cfg = RuntimeConfig::from_env().context("reading FUGU_* settings")?;
    if let Some(isa) = &args.isa {
        cfg.isa = Some(Isa::parse(isa)?);
    }
    if let Some(&t) = args.threads.first() {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        cfg.topology.max_threads = Some(t);
    }
    // A benchmark owns the machine: pin the worker threads to their cores (FUGU_PIN=0 turns it
    // off). Unpinned, this VM's scheduler sometimes stacks both workers on one core for a while.
    cfg.topology.pin.get_or_insert(true);
    let rt = Runtime::new(cfg)?;
    let opts = BenchOptions {
        budget_s: args.budget.max(0.0),
        baseline: !args.no_baseline,
        prec: args.dtype,
        ..Default::default()
    };
    if args.device != Device::Cpu {
        return run_on_device(&args, &shapes, &rt, &opts);
    }
    // matrixmultiply reads its thread count once, at its first call (it caps it at 4).
    std::env::set_var("MATMUL_NUM_THREADS", rt.threads().to_string());
    // The same peak the trainer divides by (`MachineInfo::for_runtime`), or the native
    // kernel's at a lower precision.
    let kernel = rt.kernel_at(args.dtype);
    let native_peak = match args.peak_per_core {
        None => fugu_gemm::peak::measured_native_peak(&kernel, args.dtype, rt.threads()),
        Some(_) => None,
    };
    let peak = match native_peak {
        Some(p) => p,
        None => {
            crate::metrics::machine::machine_peak(kernel.isa, rt.threads(), args.peak_per_core)?
        }
    };
    eprintln!("fugu-gemm: {}", rt.describe());
    eprintln!("kernels: {}", rt.describe_kernels());
    eprintln!("{}", peak.describe());
    eprintln!(
        "baseline: matrixmultiply 0.3 with {} thread(s){}",
        rt.threads().min(4),
        if cfg!(feature = "openblas") {
            "; OpenBLAS (system) side by side"
        } else {
            ""
        }
    );
    let json = args.format == "json";
    if !json {
        println!("{}", table_header(args.dtype));
    }
    let total = shapes.len();
    for (i, s) in shapes.iter().enumerate() {
        if json {
            eprintln!(
                "[{}/{}] {} {}x{}x{} batch {}",
                i + 1,
                total,
                s.name,
                s.m,
                s.n,
                s.k,
                s.batch
            );
        }
        let row = run_shape(&rt, &peak, s, &opts)?;
        if json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            println!("{}", format_row(&row));
        }
        let what = format!("GEMM {} ({}x{}x{})", s.name, s.m, s.n, s.k);
        let peak_name = format!("peak of {:.1} GFLOP/s", peak.total_gflops());
        if let Some(w) =
            crate::metrics::peak_cache::above_peak_warning(&what, row.peak_pct, &peak_name)
        {
            eprintln!("{w}");
        }
    }
    Ok(())
}

/// Re-runs this command once per thread count, in a child process each.
fn run_each_thread_count(args: &BenchGemmArgs) -> Result<()> {
    let exe = std::env::current_exe().context("locating the fugu executable")?;
    let mut rest: Vec<String> = Vec::new();
    let mut it = std::env::args().skip(1).peekable();
    while let Some(a) = it.next() {
        if a == "--threads" {
            it.next();
        } else if !a.starts_with("--threads=") {
            rest.push(a);
        }
    }
    for &t in &args.threads {
        let status = std::process::Command::new(&exe)
            .args(&rest)
            .arg(format!("--threads={t}"))
            .status()
            .with_context(|| format!("running {} for {t} threads", exe.display()))?;
        if !status.success() {
            bail!("benchmark with {t} threads failed ({status})");
        }
    }
    Ok(())
}

/// `--device cuda`: cuBLAS on every shape, one row each (same columns and JSON fields as the
/// CPU rows; `isa` is `cublas` or `cublas-tf32`, no baseline columns).
#[cfg(feature = "cuda")]
fn run_on_device(
    args: &BenchGemmArgs,
    shapes: &[crate::bench::gemm::BenchShape],
    rt: &Runtime,
    opts: &BenchOptions,
) -> Result<()> {
    use crate::backend::Backend;
    let Device::Cuda(ordinal) = args.device else {
        bail!("run_on_device called for {}", args.device);
    };
    let mut be = crate::backend::cuda::CudaBackend::new(ordinal, CudaSettings { tf32: args.tf32 })?;
    let isa = if args.tf32 { "cublas-tf32" } else { "cublas" };
    eprintln!("device: {} (cuBLAS, {isa})", be.describe());
    let operands = crate::backend::Dtype::of_precision(args.dtype);
    let out = crate::backend::Dtype::of_precision(args.out_dtype.unwrap_or(args.dtype));
    if let Some((peak, source)) = be.peak_gflops(operands) {
        eprintln!("peak {peak:.0} GFLOP/s ({source})");
    }
    let json = args.format == "json";
    if !json {
        // Device rows have no fugu-gemm f32 columns.
        println!("{}", table_header(Precision::F32));
    }
    for s in shapes {
        let row = crate::bench::gemm::run_shape_cuda(&mut be, rt, s, opts, isa, out)?;
        if json {
            println!("{}", serde_json::to_string(&row)?);
        } else {
            println!("{}", format_row(&row));
        }
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn run_on_device(
    args: &BenchGemmArgs,
    _: &[crate::bench::gemm::BenchShape],
    _: &Runtime,
    _: &BenchOptions,
) -> Result<()> {
    Err(crate::backend::device::no_cuda_build(args.device))
}

//! `cargo bench --bench train -- [--config gpt2-124m [--config llama-124m]] [--shape 4x64] [--steps 5] [--threads 2]
//! [--device cpu|cuda|cuda:N] [--tf32] [--precision fp32|bf16|fp16] [--recompute ..] [--loss-chunk ROWS]
//! [--breakdown]`
//! (`FUGU_ATTENTION=materialized|fused` picks the attention path; the activations line names it)
//!
//! Times full training steps (forward, backward, clip, AdamW) on random tokens, for each
//! `--config` in turn (any architecture, built by the registry as runs build it), and prints the
//! median step time, tokens/s, model TFLOP/s (Megatron formula) and MFU against the device's
//! peak for the run's precision (the CPU's as `fugu bench gemm` measures it; on a GPU the
//! FP32 CUDA-core peak, or the tensor-core peak with `--tf32` or bf16/fp16), plus the
//! share of non-GEMM ops in the per-op breakdown (`--breakdown` prints the whole table, each
//! op's GFLOP/s and GB/s beside its time, from the work the model declares for it:
//! `model/work.rs`, and its `roof%` against the peak and the memory bandwidth: the driver's on
//! a GPU, an in-place triad on a CPU, measured before the first step and cached). Timers
//! are fine-grained by default (on a GPU, CUDA events around every op, read after each step;
//! `--timers coarse` for throughput comparisons). The comparison (PyTorch) is not measured
//! here: run `dev/bench_pytorch.py` (with `--device cuda` on a GPU) side by side.
//! `--device cuda` needs `--features cuda`.

use clap::Parser;
use fugu::backend::{Backend, CudaSettings, Device};
use fugu::config::{Precision, RunConfig};
use fugu::metrics::machine::MachineInfo;
use fugu::metrics::ops::trainer;
use fugu::metrics::timers::{Breakdown, Roofs, TimerLevel, Timers};
use fugu::model::acts::Recompute;
use fugu::model::cost::Slice;
use fugu::model::ModelConfig;
use fugu::model::{registry, OptimStep, Stage, TpRank};
use std::time::Instant;

#[path = "train/host_only.rs"]
mod host_only;

#[derive(Parser)]
struct Args {
    /// Configs to time (built-in names or files; repeatable: each in turn, same shapes).
    #[arg(long, default_values_t = ["gpt2-124m".to_string()])]
    config: Vec<String>,
    /// Batch shapes BxT (repeatable). Default: the 4x64 and 4x256.
    #[arg(long)]
    shape: Vec<String>,
    /// Timed steps per shape (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    #[arg(long)]
    threads: Option<usize>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// With --device cuda: TF32 tensor cores for the GEMMs.
    #[arg(long)]
    tf32: bool,
    /// Numeric precision of the step (mixed precision keeps f32 master weights and optimizer;
    /// fp16 runs with a fixed loss scale of 1024 here, the trainer's scaler is not exercised).
    #[arg(long, value_enum, default_value = "fp32")]
    precision: Precision,
    /// Activation recomputation (`attention`: one shared attention-probability buffer,
    /// recomputed per layer in the backward pass; `full`: block outputs kept, each block's
    /// forward pass rerun in the backward pass); the activation memory is printed per shape.
    #[arg(long, value_enum, default_value = "none")]
    recompute: Recompute,
    /// The LM head and the loss this many rows at a time (`fugu train --loss-chunk`).
    #[arg(long, value_name = "ROWS", value_parser = clap::value_parser!(u64).range(1..))]
    loss_chunk: Option<u64>,
    /// Timer detail: fine times every op (on a GPU with CUDA events, read after each step;
    /// recording them costs a little host time: use coarse or off for throughput
    /// comparisons).
    #[arg(long, default_value = "fine", value_name = "off|coarse|fine")]
    timers: TimerLevel,
    /// Print the per-op breakdown of every shape.
    #[arg(long)]
    breakdown: bool,
    /// With `--device cuda`: run the CUDA backend's host code on an engine that executes
    /// nothing (no GPU needed), and report what one step queues (kernel launches, GEMMs,
    /// copies) and the host time it takes to queue them. The time excludes the CUDA driver's
    /// and cuBLAS's own host work.
    #[arg(long)]
    host_only: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let threads = fugu::train::set_threads(args.threads)?;
    let machine = MachineInfo::detect(threads)?;
    println!(
        "host: {} | {} threads | CPU peak {:.0} GFLOP/s ({}) | precision {}",
        machine.cpu_model,
        threads,
        machine.peak_gflops,
        machine.peak_description,
        args.precision.name()
    );
    let shapes = if args.shape.is_empty() {
        vec!["4x64".to_string(), "4x256".to_string()]
    } else {
        args.shape.clone()
    };
    println!(
        "{:<14} {:>7} {:>10} {:>10} {:>9} {:>7} {:>9}  device",
        "config", "BxT", "ms/step", "tokens/s", "TFLOP/s", "MFU", "non-GEMM"
    );
    for name in &args.config {
        let cfg = RunConfig::load(name)?.model;
        let table = registry::full_params(&cfg)?;
        let mut params = vec![0.0f32; table.total()];
        for spec in table.specs() {
            registry::init_tensor(&cfg, &spec.name, 1, &mut params[spec.range()]);
        }
        time_config(&args, (name, &cfg), &params, &shapes, machine.peak_gflops)?;
    }
    Ok(())
}

/// Every shape of config `name` (`cfg`, initial parameters `params`): one row each, and the
/// breakdown when asked.
fn time_config(
    args: &Args,
    (name, cfg): (&str, &ModelConfig),
    params: &[f32],
    shapes: &[String],
    cpu_peak: f64,
) -> anyhow::Result<()> {
    for s in shapes {
        let (b, t) = s
            .split_once('x')
            .and_then(|(b, t)| Some((b.parse::<usize>().ok()?, t.parse::<usize>().ok()?)))
            .ok_or_else(|| anyhow::anyhow!("--shape {s}: expected BxT, e.g. 4x64"))?;
        let cuda = CudaSettings { tf32: args.tf32 };
        let memory = (args.recompute, args.loss_chunk.map(|r| r as usize));
        let run = (args.steps, args.timers, args.precision, memory);
        if args.host_only {
            host_only::report(args, cfg, params, (b, t), run)?;
            continue;
        }
        let (times, bd, peak, memory, device) = fugu::with_backend!(args.device, cuda, |be| {
            time_steps(be, cfg, params, (b, t), run)
        })?;
        if let Some((_, source)) = &peak {
            println!("device peak: {source}");
        }
        let peak = peak.map(|p| p.0);
        let peak = peak.unwrap_or(cpu_peak);
        let mut bd = bd;
        bd.set_roofs(Roofs {
            gflops: Some(peak),
            gbs: memory,
        });
        let mut times = times;
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        let whole = Slice {
            vocab: cfg.vocab_size,
            ..Stage::whole(cfg.n_layer).slice(cfg, t, b, 1)
        };
        let flops = registry::cost(cfg.arch).model_flops(&whole);
        let tflops = flops / (med / 1e3) / 1e12;
        println!(
            "{:<14} {:>7} {:>10.1} {:>10.1} {:>9.3} {:>6.1}% {:>8.1}%  {device}",
            name,
            s,
            med,
            (b * t) as f64 / (med / 1e3),
            tflops,
            100.0 * tflops * 1e3 / peak,
            bd.non_gemm_pct
        );
        if args.breakdown {
            println!("{}", bd.to_table());
        }
    }
    Ok(())
}

/// Step times (ms), the per-op breakdown, the device's peak and its source, its memory
/// bandwidth (GB/s, measured or known at fine timers), the device.
type Timed = (
    Vec<f64>,
    Breakdown,
    Option<(f64, String)>,
    Option<f64>,
    String,
);

/// Timed steps, timer detail, precision, recomputation.
/// Timed steps, timer level, precision, and what trades time for memory: recomputation and
/// the loss chunk.
type Run = (usize, TimerLevel, Precision, (Recompute, Option<usize>));

/// One warm-up step and `steps` timed steps of B×T on `be`: the step times (ms), the per-op
/// breakdown, the device's peak (GFLOP/s, when it has its own), its memory bandwidth (at fine
/// timers) and its description.
fn time_steps<B: Backend>(
    be: B,
    cfg: &ModelConfig,
    params: &[f32],
    (b, t): (usize, usize),
    (steps, level, precision, (recompute, loss_chunk)): Run,
) -> anyhow::Result<Timed> {
    let device = be.describe();
    let dtype = precision.compute_dtype();
    let peak = be.peak_gflops(dtype);
    // The memory roof of the fine breakdown's rates (on a CPU a triad measured now, before
    // the model takes its memory).
    let memory = (level == TimerLevel::Fine).then(|| be.peak_gbs()).flatten();
    if let Some((gbs, source)) = &memory {
        println!("memory: {gbs:.1} GB/s ({source})");
    }
    let whole = Stage::whole(cfg.n_layer);
    let mut model = registry::build(cfg, TpRank::SERIAL, &whole, dtype, be)?;
    model.load_params(params)?;
    model.set_recompute(recompute);
    model.set_loss_chunk(loss_chunk);
    let (fwd, bwd) = model.activation_bytes(b, t);
    let forms: Vec<String> = model
        .forms()
        .iter()
        .map(|f| format!("{} {}", f.key, f.form))
        .collect();
    println!(
        "activations {b}x{t} (--recompute {recompute:?}, --loss-chunk {loss_chunk:?}, {}): {:.1} MiB forward + {:.1} MiB backward scratch",
        forms.join(", "),
        fwd as f64 / (1 << 20) as f64,
        bwd as f64 / (1 << 20) as f64
    );
    let kernels = model.backend().kernel_settings();
    if !kernels.is_empty() {
        let kv: Vec<String> = kernels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("kernels: {}", kv.join(" "));
    }
    if precision == Precision::Fp16 {
        model.set_loss_scale(1024.0);
    }
    let timers = Timers::new(level);
    if let Some(clock) = model.backend().device_clock() {
        timers.set_device_clock(clock);
    }
    let mut times = Vec::new();
    let mut rng = fugu_io::rng::SplitMix64(7);
    for step in 0..=steps {
        let window: Vec<u32> = (0..b * (t + 1))
            .map(|_| rng.below(cfg.vocab_size as u64) as u32)
            .collect();
        let t0 = Instant::now();
        model.set_batch(&window, b, t)?;
        model.zero_grad();
        model.forward_micro(0, &timers, true);
        model.backward_micro(0, &timers, &mut |_, _| {});
        // As `fugu train` times it: the gradient norm and the update under "optimizer".
        let optimizer = timers.scope("optimizer", TimerLevel::Coarse);
        let norm = model.grad_norm(&timers);
        model.apply_optimizer(
            &OptimStep {
                lr: 1e-4,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                grad_clip: 1.0,
                step: step as u64 + 1,
            },
            norm,
            &timers,
        );
        drop(optimizer);
        model.backend_mut().sync();
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        timers.take_step();
        if step == 0 {
            timers.reset_totals();
        } else {
            times.push(ms);
        }
    }
    let total: f64 = times.iter().sum();
    let ops = [registry::ops(cfg.arch), &trainer::OPS];
    let bd = timers.breakdown(total, times.len() as u64, &ops);
    Ok((times, bd, peak, memory.map(|m| m.0), device))
}

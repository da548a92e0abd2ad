//! `cargo bench --bench train -- [--config gpt2-124m] [--shape 4x64] [--steps 5] [--threads 2]`
//!
//! Times full training steps (forward, backward, clip, AdamW) on random tokens and prints the
//! median step time, tokens/s, model TFLOP/s (Megatron formula) and MFU against the peak that
//! `fugu bench gemm` measures, plus the share of non-GEMM ops in the per-op breakdown. The
//! issue's comparison numbers (llm.c, PyTorch) are not measured here: run
//! `dev/bench_pytorch.py` for PyTorch side by side.

use clap::Parser;
use fugu::backend::CpuBackend;
use fugu::config::RunConfig;
use fugu::metrics::flops::megatron_flops_per_step;
use fugu::metrics::machine::MachineInfo;
use fugu::metrics::timers::{TimerLevel, Timers};
use fugu::model::init::init_params;
use fugu::model::table::gpt2_params;
use fugu::model::{Gpt2, OptimStep, TpRank};
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Configs to time (built-in names or files).
    #[arg(long, default_value = "gpt2-124m")]
    config: String,
    /// Batch shapes BxT (repeatable). Default: the 4x64 and 4x256.
    #[arg(long)]
    shape: Vec<String>,
    /// Timed steps per shape (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    #[arg(long)]
    threads: Option<usize>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let threads = fugu::train::set_threads(args.threads)?;
    let cfg = RunConfig::load(&args.config)?.model;
    let machine = MachineInfo::detect(threads)?;
    println!(
        "{} | {} threads | peak {:.0} GFLOP/s ({})",
        machine.cpu_model, threads, machine.peak_gflops, machine.peak_description
    );
    let shapes = if args.shape.is_empty() {
        vec!["4x64".to_string(), "4x256".to_string()]
    } else {
        args.shape.clone()
    };
    let table = gpt2_params(&cfg, 1)?;
    let params = init_params(&cfg, &table, 1);
    println!(
        "{:<12} {:>7} {:>10} {:>10} {:>9} {:>7} {:>9}",
        "config", "BxT", "ms/step", "tokens/s", "TFLOP/s", "MFU", "non-GEMM"
    );
    for s in &shapes {
        let (b, t) = s
            .split_once('x')
            .and_then(|(b, t)| Some((b.parse::<usize>().ok()?, t.parse::<usize>().ok()?)))
            .ok_or_else(|| anyhow::anyhow!("--shape {s}: expected BxT, e.g. 4x64"))?;
        let mut model = Gpt2::new(&cfg, TpRank::SERIAL, CpuBackend::new())?;
        model.load_params(&params)?;
        let timers = Timers::new(TimerLevel::Fine);
        let mut times = Vec::new();
        let mut rng = fugu_io::rng::SplitMix64(7);
        for step in 0..=args.steps {
            let window: Vec<u32> = (0..b * (t + 1))
                .map(|_| rng.below(cfg.vocab_size as u64) as u32)
                .collect();
            let t0 = Instant::now();
            model.set_batch(&window, b, t)?;
            model.zero_grad();
            model.forward(&timers, true);
            model.backward(&timers);
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
            );
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            timers.take_step();
            if step == 0 {
                timers.reset_totals();
            } else {
                times.push(ms);
            }
        }
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        let flops = megatron_flops_per_step(b, t, cfg.n_layer, cfg.n_embd, cfg.vocab_size);
        let tflops = flops / (med / 1e3) / 1e12;
        let total: f64 = times.iter().sum();
        let bd = timers.breakdown(total, times.len() as u64);
        println!(
            "{:<12} {:>7} {:>10.1} {:>10.1} {:>9.3} {:>6.1}% {:>8.1}%",
            args.config,
            s,
            med,
            (b * t) as f64 / (med / 1e3),
            tflops,
            100.0 * tflops * 1e3 / machine.peak_gflops,
            bd.non_gemm_pct
        );
    }
    Ok(())
}

//! The work the model's ops declare for the breakdown's rates (`model/work.rs`): over one
//! training step the declared FLOPs add up to the model FLOPs that MFU divides by (Megatron's
//! formula with causal attention's pairs), every op timer that runs says its work, and one op's
//! bytes are its tensors' sizes. On the CPU, for the three-step and the fused attention and
//! both residual forms, in f32 and bf16; one test, since the forms are picked by environment variables.

mod common;

use fugu::backend::CpuBackend;
use fugu::dtype::Dtype;
use fugu::metrics::timers::{TimerLevel, Timers};
use fugu::model::table::padded_vocab;
use fugu::model::ModelConfig;
use fugu::model::{Gpt2, Model, OptimStep, TpRank};

fn step_work(cfg: &ModelConfig, (b, t): (usize, usize), compute: Dtype) -> Timers {
    let mut m = Gpt2::new(cfg, TpRank::SERIAL, compute, CpuBackend::new()).unwrap();
    let window: Vec<u32> = (0..b * (t + 1)).map(|i| (i * 7 % 50) as u32).collect();
    let timers = Timers::new(TimerLevel::Fine);
    m.set_batch(&window, b, t).unwrap();
    m.zero_grad();
    m.forward(&timers, true);
    m.backward(&timers);
    let norm = m.grad_norm(&timers);
    let hp = OptimStep {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        grad_clip: 1.0,
        step: 1,
    };
    m.apply_optimizer(&hp, norm, &timers);
    timers.take_step();
    timers
}

#[test]
fn declared_work_adds_up_to_the_model_flops_on_every_path() {
    let cfg = ModelConfig {
        arch: fugu::model::Arch::Gpt2,
        vocab_size: 50,
        n_positions: 16,
        n_embd: 32,
        n_head: 4,
        n_layer: 2,
        ..Default::default()
    };
    let (b, t) = (2, 12);
    let (h, l, vp) = (cfg.n_embd, cfg.n_layer, padded_vocab(cfg.vocab_size));
    let want = common::causal_model_flops(b, t, l, h, vp);
    for (attn, residual, compute) in [
        ("materialized", "separate", Dtype::F32),
        ("fused", "separate", Dtype::F32),
        ("materialized", "epilogue", Dtype::F32),
        ("materialized", "separate", Dtype::Bf16),
    ] {
        std::env::set_var("FUGU_ATTENTION", attn);
        std::env::set_var("FUGU_RESIDUAL", residual);
        let timers = step_work(&cfg, (b, t), compute);
        let work = timers.work_totals();
        let flops: f64 = work.values().map(|w| w.flops).sum();
        assert_eq!(
            flops, want,
            "{attn} attention, residual {residual}: {work:?}"
        );
        // Every op timed said its work; the phases, all-reduces (none here) and
        // recomputation (its ops not timed) do not.
        for name in timers.totals().keys() {
            let phase = ["forward", "backward", "optimizer"].contains(&name.as_str());
            if !phase && !name.contains("allreduce") && !name.contains("recompute") {
                let w = work.get(name);
                assert!(w.is_some_and(|w| w.bytes > 0.0), "{name}: no work ({attn})");
            }
        }
        assert_eq!(
            work.contains_key("forward:residual"),
            residual == "separate"
        );
        assert_eq!(
            work.contains_key("forward:attention:fused"),
            attn == "fused"
        );
        // The qkv GEMM of each layer: reads its input (n, h), weight (h, 3h) and bias, and
        // writes (n, 3h), all of the compute type.
        let n = b * t;
        let qkv = (n * h + h * 3 * h + 3 * h + n * 3 * h) * compute.bytes() * l;
        assert_eq!(work["forward:attention:qkv"].bytes, qkv as f64);
        // AdamW: f32 parameters, m and v read and written, gradients read, and the 16-bit
        // compute copy written.
        let params = work["optimizer:clip"].bytes / 4.0;
        let copy = if compute == Dtype::F32 { 0 } else { 2 };
        assert_eq!(work["optimizer:adamw"].bytes, (28 + copy) as f64 * params);
    }
    std::env::remove_var("FUGU_ATTENTION");
    std::env::remove_var("FUGU_RESIDUAL");
}

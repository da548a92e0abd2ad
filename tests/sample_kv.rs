//! The KV-cache sampler gives the same next-token logits as a full forward pass over the
//! prefix, at every position.

use fugu::backend::CpuBackend;
use fugu::config::ModelConfig;
use fugu::metrics::timers::{TimerLevel, Timers};
use fugu::model::init::init_params;
use fugu::model::table::{gpt2_params, padded_vocab};
use fugu::model::{registry, Stage, TpRank};
use fugu::sample::{generate, pick, Generator, SampleOptions};

fn cfg() -> ModelConfig {
    ModelConfig {
        arch: fugu::config::Arch::Gpt2,
        vocab_size: 300,
        n_positions: 24,
        n_embd: 32,
        n_head: 4,
        n_layer: 2,
        ..Default::default()
    }
}

/// A Llama model: grouped-query attention (the cache holds the 2 key/value heads only) with
/// an untied head, or one key/value head per query head with a tied one.
fn llama(kv: usize, tied: bool) -> ModelConfig {
    ModelConfig {
        arch: fugu::config::Arch::Llama,
        vocab_size: 300,
        n_positions: 24,
        n_embd: 32,
        n_head: 4,
        n_layer: 2,
        n_kv_head: Some(kv),
        intermediate_size: Some(48),
        rope_theta: Some(100.0),
        tie_embeddings: Some(tied),
        ..Default::default()
    }
    .normalized()
}

/// Every position's next-token logits from the cache against one forward pass over the
/// prefix, with parameters from the architecture's own init.
fn check_kv_cache(cfg: &ModelConfig) {
    let table = registry::full_params(cfg).unwrap();
    let mut params = vec![0.0f32; table.total()];
    for spec in table.specs() {
        registry::init_tensor(cfg, &spec.name, 3, &mut params[spec.range()]);
    }
    let t = 17;
    let window: Vec<u32> = (0..=t as u32).map(|i| (i * 37 + 5) % 300).collect();
    let whole = Stage::whole(cfg.n_layer);
    let f32 = fugu::backend::Dtype::F32;
    let mut model = registry::build(cfg, TpRank::SERIAL, &whole, f32, CpuBackend::new()).unwrap();
    model.load_params(&params).unwrap();
    model.set_batch(&window, 1, t).unwrap();
    model.forward_micro(0, &Timers::new(TimerLevel::Off), false);
    let full = model.last_logits();
    let vp = padded_vocab(cfg.vocab_size);
    let mut g = Generator::new(cfg, &params, CpuBackend::new()).unwrap();
    let mut worst = 0.0f32;
    for (pos, &tok) in window[..t].iter().enumerate() {
        let got = g.step(tok).unwrap();
        let want = &full[pos * vp..pos * vp + cfg.vocab_size];
        let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        for (a, b) in got.iter().zip(want) {
            worst = worst.max((a - b).abs() / scale);
        }
    }
    assert!(
        worst < 1e-5,
        "{:?}: KV-cache logits differ from the full forward: {worst:.2e}",
        cfg.arch
    );
}

#[test]
fn kv_cache_matches_full_forward() {
    check_kv_cache(&cfg());
    check_kv_cache(&llama(2, false));
    check_kv_cache(&llama(4, true));
}

#[test]
fn generation_is_deterministic_and_stops_at_the_context() {
    let cfg = cfg();
    let table = gpt2_params(&cfg, 1).unwrap();
    let params = init_params(&cfg, &table, 3);
    let o = SampleOptions {
        max_tokens: 100,
        temperature: 0.9,
        top_k: 20,
        seed: 5,
    };
    let run = || {
        let mut g = Generator::new(&cfg, &params, CpuBackend::new()).unwrap();
        generate(&mut g, &[1, 2, 3], &o, |_| {}).unwrap()
    };
    let a = run();
    assert_eq!(a, run());
    // 24 positions, 3 used by the prompt: at most 22 new tokens (the last needs no step).
    assert!(a.len() <= 22 && !a.is_empty(), "{}", a.len());
    assert!(a.iter().all(|&x| (x as usize) < cfg.vocab_size));
    // Greedy picks the argmax; top-k 1 is greedy too.
    let logits = [0.1f32, 2.0, -1.0, 1.9];
    let mut rng = fugu_io::rng::SplitMix64(1);
    let greedy = SampleOptions {
        temperature: 0.0,
        ..o.clone()
    };
    assert_eq!(pick(&logits, &greedy, &mut rng), 1);
    let k1 = SampleOptions { top_k: 1, ..o };
    for _ in 0..10 {
        assert_eq!(pick(&logits, &k1, &mut rng), 1);
    }
}

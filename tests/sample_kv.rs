//! The KV-cache sampler gives the same next-token logits as a full forward pass over the
//! prefix, at every position.

use fugu::backend::CpuBackend;
use fugu::metrics::timers::{TimerLevel, Timers};
use fugu::model::init::init_params;
use fugu::model::table::{gpt2_params, padded_vocab};
use fugu::model::ModelConfig;
use fugu::model::{registry, Stage, TpRank};
use fugu::sample::{generate, pick, Generator, SampleOptions, Stop};

fn cfg() -> ModelConfig {
    ModelConfig {
        arch: fugu::model::Arch::Gpt2,
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
        arch: fugu::model::Arch::Llama,
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

/// Generation is deterministic for a seed; it stops at the context (and says so), and at the
/// stop token (returned last, not passed on); a restarted generator gives the same text again
/// (`-n`); top-k 1 and top-p near 0 are greedy, and top-p keeps the smallest most likely set.
#[test]
fn generation_is_deterministic_and_stops_at_the_context() {
    let cfg = cfg();
    let table = gpt2_params(&cfg, 1).unwrap();
    let params = init_params(&cfg, &table, 3);
    let o = SampleOptions {
        max_tokens: 100,
        temperature: 0.9,
        top_k: 20,
        top_p: 1.0,
        seed: 5,
        stop: None,
    };
    let mut g = Generator::new(&cfg, &params, CpuBackend::new()).unwrap();
    let mut passed = Vec::new();
    let (a, why) = generate(&mut g, &[1, 2, 3], &o, |t| passed.push(t)).unwrap();
    assert_eq!(passed, a);
    // The same generator again (as `fugu sample -n 2` reuses it): the same tokens.
    assert_eq!(
        generate(&mut g, &[1, 2, 3], &o, |_| {}).unwrap(),
        (a.clone(), why)
    );
    // 24 positions, 3 used by the prompt: 22 new tokens (the last needs no step).
    assert_eq!((a.len(), why), (22, Stop::Context));
    assert!(a.iter().all(|&x| (x as usize) < cfg.vocab_size));
    let (short, why) = generate(
        &mut g,
        &[1, 2, 3],
        &SampleOptions {
            max_tokens: 5,
            ..o.clone()
        },
        |_| {},
    )
    .unwrap();
    assert_eq!((short.as_slice(), why), (&a[..5], Stop::MaxTokens));
    // A stop token: generation ends at its first occurrence, which is not passed on.
    let stop = SampleOptions {
        stop: Some(a[4]),
        ..o.clone()
    };
    let first = a.iter().position(|&t| t == a[4]).unwrap();
    let mut passed = Vec::new();
    let (s, why) = generate(&mut g, &[1, 2, 3], &stop, |t| passed.push(t)).unwrap();
    assert_eq!((s.as_slice(), why), (&a[..=first], Stop::EndOfText));
    assert_eq!(passed, &a[..first]);
    // Greedy picks the argmax; top-k 1 is greedy too.
    let logits = [0.1f32, 2.0, -1.0, 1.9];
    let mut rng = fugu_io::rng::SplitMix64(1);
    let greedy = SampleOptions {
        temperature: 0.0,
        ..o.clone()
    };
    assert_eq!(pick(&logits, &greedy, &mut rng), 1);
    let k1 = SampleOptions {
        top_k: 1,
        ..o.clone()
    };
    let p0 = SampleOptions {
        top_p: 1e-9,
        ..o.clone()
    };
    for _ in 0..10 {
        assert_eq!(pick(&logits, &k1, &mut rng), 1);
        assert_eq!(pick(&logits, &p0, &mut rng), 1);
    }
    // At T = 1 the two best (2.0 and 1.9) hold 0.47 + 0.43 = 0.90 of the probability: top-p 0.85
    // samples only those two, and both.
    let p = SampleOptions {
        temperature: 1.0,
        top_k: 0,
        top_p: 0.85,
        ..o
    };
    let mut seen = [0usize; 4];
    for _ in 0..400 {
        seen[pick(&logits, &p, &mut rng) as usize] += 1;
    }
    assert!(
        seen[0] == 0 && seen[2] == 0 && seen[1] > 100 && seen[3] > 100,
        "{seen:?}"
    );
}

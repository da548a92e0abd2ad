//! `fugu sample`: text generation from a checkpoint with a KV cache.
//!
//! Generation runs one token at a time through the model's own forward pass
//! ([`Model::decode`]): each new token's keys and values are appended to a per-layer cache in
//! backend memory, so a step costs O(position) attention work instead of re-running the whole
//! prefix. Only the logits come back to the host, where [`pick`] chooses the next token.

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::metrics::timers::{TimerLevel, Timers};
use crate::model::kv::KvCache;
use crate::model::{registry, Model};
use anyhow::{bail, Result};
use fugu_io::rng::SplitMix64;

/// Sampling settings.
#[derive(Clone, Debug)]
pub struct SampleOptions {
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    pub seed: u64,
}

/// A model ready for incremental decoding: an inference-only model and its cache.
pub struct Generator<B: Backend> {
    model: Box<dyn Model<B>>,
    cache: Option<KvCache>,
    pos: usize,
    timers: Timers,
}

impl<B: Backend> Generator<B> {
    /// Loads a full (tp = 1) parameter buffer onto `be` and allocates the cache.
    pub fn new(cfg: &ModelConfig, params: &[f32], be: B) -> Result<Generator<B>> {
        let mut model = registry::build_for_inference(cfg, be)?;
        model.load_params(params)?;
        let cache = Some(model.kv_cache()?);
        Ok(Generator {
            model,
            cache,
            pos: 0,
            timers: Timers::new(TimerLevel::Off),
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    /// Positions consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Feeds one token; returns the next-token logits (real vocabulary only).
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let cache = self
            .cache
            .as_ref()
            .expect("cache lives as long as the generator");
        let logits = self.model.decode(cache, token, self.pos, &self.timers)?;
        self.pos += 1;
        Ok(logits)
    }
}

impl<B: Backend> Drop for Generator<B> {
    fn drop(&mut self) {
        if let Some(c) = self.cache.take() {
            self.model.free_kv_cache(c);
        }
    }
}

/// Picks a token from logits: greedy at temperature 0, else softmax(logits/T) over the top k.
pub fn pick(logits: &[f32], o: &SampleOptions, rng: &mut SplitMix64) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |best, (i, &x)| {
                if x > best.1 {
                    (i, x)
                } else {
                    best
                }
            })
            .0 as u32
    };
    if o.temperature <= 0.0 {
        return argmax();
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    if o.top_k > 0 && o.top_k < idx.len() {
        idx.select_nth_unstable_by(o.top_k - 1, |&a, &b| logits[b].total_cmp(&logits[a]));
        idx.truncate(o.top_k);
    }
    let mx = idx
        .iter()
        .map(|&i| logits[i])
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i] as f64 - mx) / o.temperature).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut r = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (k, &wi) in w.iter().enumerate() {
        if r < wi {
            return idx[k] as u32;
        }
        r -= wi;
    }
    idx[idx.len() - 1] as u32
}

/// Runs the prompt through the model and generates up to `max_tokens` more tokens (stopping
/// early at the context limit). Returns the generated ids.
pub fn generate<B: Backend>(
    g: &mut Generator<B>,
    prompt: &[u32],
    o: &SampleOptions,
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenisation");
    }
    if prompt.len() > g.config().n_positions {
        bail!(
            "the prompt has {} tokens but the model accepts at most n_positions = {}",
            prompt.len(),
            g.config().n_positions
        );
    }
    let mut rng = SplitMix64::from_parts(&[o.seed, 0x5a3b1e]);
    let mut logits = Vec::new();
    for &tok in prompt {
        logits = g.step(tok)?;
    }
    let mut out = Vec::new();
    for _ in 0..o.max_tokens {
        let next = pick(&logits, o, &mut rng);
        out.push(next);
        on_token(next);
        if g.position() >= g.config().n_positions {
            break;
        }
        logits = g.step(next)?;
    }
    Ok(out)
}

//! `fugu sample`: text generation from a checkpoint with a KV cache.
//!
//! Generation runs one token at a time through the model's own forward pass
//! ([`Model::decode`]): each new token's keys and values are appended to a per-layer cache in
//! backend memory, so a step costs O(position) attention work instead of re-running the whole
//! prefix. Only the logits come back to the host, where [`pick`] chooses the next token.

use crate::backend::Backend;
use crate::metrics::timers::{TimerLevel, Timers};
use crate::model::kv::KvCache;
use crate::model::ModelConfig;
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
    /// Then keep only the most likely tokens whose probabilities add up to at least p
    /// (nucleus sampling; 1 = all).
    pub top_p: f64,
    pub seed: u64,
    /// Stop after this token (the end-of-text id), which is returned but not passed on.
    pub stop: Option<u32>,
}

/// Why [`generate`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// `max_tokens` were generated.
    MaxTokens,
    /// The stop token came.
    EndOfText,
    /// The context (`n_positions`) is full.
    Context,
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

    /// Starts a new sequence: the cache's entries are overwritten from position 0 on.
    pub fn restart(&mut self) {
        self.pos = 0;
    }

    /// Continues from position `pos` (at most the current one): the cache keeps positions
    /// before it, later ones are overwritten (a shared prefix is decoded once).
    pub fn rewind_to(&mut self, pos: usize) {
        self.pos = pos.min(self.pos);
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

/// Picks a token from logits: greedy at temperature 0, else softmax(logits/T) over the top k,
/// then over the smallest set of most likely tokens holding probability top_p.
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
    let mut total: f64 = w.iter().sum();
    let (idx, w) = if o.top_p < 1.0 {
        let mut order: Vec<usize> = (0..idx.len()).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(idx[a].cmp(&idx[b])));
        let mut kept = 0.0;
        let mut n = 0;
        while n < order.len() && (n == 0 || kept < o.top_p * total) {
            kept += w[order[n]];
            n += 1;
        }
        total = kept;
        let keep = &order[..n];
        (
            keep.iter().map(|&k| idx[k]).collect::<Vec<_>>(),
            keep.iter().map(|&k| w[k]).collect::<Vec<_>>(),
        )
    } else {
        (idx, w)
    };
    let mut r = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * total;
    for (k, &wi) in w.iter().enumerate() {
        if r < wi {
            return idx[k] as u32;
        }
        r -= wi;
    }
    idx[idx.len() - 1] as u32
}

/// Runs the prompt through the model (from position 0) and generates up to `max_tokens` more
/// tokens, stopping early at the stop token or the context limit. Returns the generated ids
/// (the stop token last, when it came; it is not passed to `on_token`) and why it stopped.
pub fn generate<B: Backend>(
    g: &mut Generator<B>,
    prompt: &[u32],
    o: &SampleOptions,
    mut on_token: impl FnMut(u32),
) -> Result<(Vec<u32>, Stop)> {
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
    g.restart();
    let mut logits = Vec::new();
    for &tok in prompt {
        logits = g.step(tok)?;
    }
    let mut out = Vec::new();
    while out.len() < o.max_tokens {
        let next = pick(&logits, o, &mut rng);
        out.push(next);
        if o.stop == Some(next) {
            return Ok((out, Stop::EndOfText));
        }
        on_token(next);
        if out.len() == o.max_tokens {
            break;
        }
        if g.position() >= g.config().n_positions {
            return Ok((out, Stop::Context));
        }
        logits = g.step(next)?;
    }
    Ok((out, Stop::MaxTokens))
}

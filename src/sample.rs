//! `fugu sample`: text generation from a checkpoint with a KV cache.
//!
//! Generation runs one token at a time: each new token's keys and values are appended to a
//! per-layer cache, so a step costs O(position) attention work instead of re-running the whole
//! prefix. It uses the same op kernels as training (on the host, in f32).

use crate::backend::{BufId, Span};
use crate::config::ModelConfig;
use crate::model::params::ParamSpans;
use crate::model::table::{gpt2_params, padded_vocab};
use crate::ops;
use crate::ops::linear::WeightLayout;
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

/// A model ready for incremental decoding.
pub struct Generator {
    cfg: ModelConfig,
    /// Where each tensor lives in `params` (the trainer's parameter spans; the buffer id is
    /// unused here).
    spans: ParamSpans,
    params: Vec<f32>,
    /// Per layer: keys and values of the positions seen so far, (n_positions, C) each.
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    pos: usize,
    scratch: Scratch,
}

/// Per-token work buffers, allocated once.
struct Scratch {
    x: Vec<f32>,
    ln: Vec<f32>,
    qkv: Vec<f32>,
    y: Vec<f32>,
    proj: Vec<f32>,
    fch: Vec<f32>,
    fcg: Vec<f32>,
    att: Vec<f32>,
    logits: Vec<f32>,
}

impl Generator {
    /// Wraps a full (tp = 1) parameter buffer.
    pub fn new(cfg: &ModelConfig, params: Vec<f32>) -> Result<Generator> {
        let table = gpt2_params(cfg, 1)?;
        if params.len() != table.total() {
            bail!(
                "parameter buffer has {} floats, expected {}",
                params.len(),
                table.total()
            );
        }
        let c = cfg.n_embd;
        let cache = vec![vec![0.0f32; cfg.n_positions * c]; cfg.n_layer];
        Ok(Generator {
            cfg: cfg.clone(),
            spans: ParamSpans::new(&table, BufId(0), cfg.n_layer),
            params,
            k_cache: cache.clone(),
            v_cache: cache,
            pos: 0,
            scratch: Scratch {
                x: vec![0.0; c],
                ln: vec![0.0; c],
                qkv: vec![0.0; 3 * c],
                y: vec![0.0; c],
                proj: vec![0.0; c],
                fch: vec![0.0; 4 * c],
                fcg: vec![0.0; 4 * c],
                att: vec![0.0; cfg.n_positions],
                logits: vec![0.0; padded_vocab(cfg.vocab_size)],
            },
        })
    }

    /// Positions consumed so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Feeds one token; returns the next-token logits (real vocabulary only).
    pub fn step(&mut self, token: u32) -> Result<Vec<f32>> {
        let (c, nh) = (self.cfg.n_embd, self.cfg.n_head);
        let hs = c / nh;
        if self.pos >= self.cfg.n_positions {
            bail!(
                "context full: the model accepts at most n_positions = {} tokens",
                self.cfg.n_positions
            );
        }
        if token as usize >= self.cfg.vocab_size {
            bail!(
                "token id {token} is not below vocab_size {}",
                self.cfg.vocab_size
            );
        }
        let t = self.pos;
        let params = &self.params;
        let at = |s: Span| &params[s.offset..s.offset + s.len];
        let sp = &self.spans;
        let Scratch {
            x,
            ln,
            qkv,
            y,
            proj,
            fch,
            fcg,
            att,
            logits,
        } = &mut self.scratch;
        let (mut mean, mut rstd) = ([0.0f32], [0.0f32]);
        // Embedding of one token at position t: a (B=1, T=1) call with wpe shifted to row t.
        let wpe_row = &at(sp.wpe)[t * c..(t + 1) * c];
        ops::encoder::encoder_forward(x, &[token], at(sp.wte), 0, Some(wpe_row), 1, 1, c);
        let scale = 1.0 / (hs as f32).sqrt();
        let linear = |out: &mut [f32], inp: &[f32], w: Span, b: Span, ic: usize, oc: usize| {
            ops::linear::linear_forward(
                out,
                inp,
                at(w),
                WeightLayout::InOut,
                Some(at(b)),
                1,
                ic,
                oc,
            )
        };
        for (l, lp) in sp.layers.iter().enumerate() {
            ops::layernorm::layernorm_forward(
                ln,
                &mut mean,
                &mut rstd,
                x,
                at(lp.ln1_w),
                at(lp.ln1_b),
                1,
                c,
            );
            linear(qkv, ln, lp.qkv_w, lp.qkv_b, c, 3 * c);
            self.k_cache[l][t * c..(t + 1) * c].copy_from_slice(&qkv[c..2 * c]);
            self.v_cache[l][t * c..(t + 1) * c].copy_from_slice(&qkv[2 * c..]);
            let (kc, vc) = (&self.k_cache[l], &self.v_cache[l]);
            let att = &mut att[..=t];
            for h in 0..nh {
                let q = &qkv[h * hs..(h + 1) * hs];
                for (s, a) in att.iter_mut().enumerate() {
                    let k = &kc[s * c + h * hs..s * c + (h + 1) * hs];
                    *a = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
                }
                let mx = att.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for a in att.iter_mut() {
                    *a = (*a - mx).exp();
                    sum += *a;
                }
                let out = &mut y[h * hs..(h + 1) * hs];
                out.fill(0.0);
                for (s, a) in att.iter().enumerate() {
                    let v = &vc[s * c + h * hs..s * c + (h + 1) * hs];
                    for (o, vv) in out.iter_mut().zip(v) {
                        *o += a / sum * vv;
                    }
                }
            }
            linear(proj, y, lp.attproj_w, lp.attproj_b, c, c);
            ops::residual::add_inplace(x, proj);
            ops::layernorm::layernorm_forward(
                ln,
                &mut mean,
                &mut rstd,
                x,
                at(lp.ln2_w),
                at(lp.ln2_b),
                1,
                c,
            );
            linear(fch, ln, lp.fc_w, lp.fc_b, c, 4 * c);
            ops::gelu::gelu_forward(fcg, fch);
            linear(proj, fcg, lp.fcproj_w, lp.fcproj_b, 4 * c, c);
            ops::residual::add_inplace(x, proj);
        }
        ops::layernorm::layernorm_forward(
            ln,
            &mut mean,
            &mut rstd,
            x,
            at(sp.lnf_w),
            at(sp.lnf_b),
            1,
            c,
        );
        let vp = logits.len();
        ops::linear::linear_forward(logits, ln, at(sp.wte), WeightLayout::OutIn, None, 1, c, vp);
        self.pos += 1;
        Ok(logits[..self.cfg.vocab_size].to_vec())
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
pub fn generate(
    g: &mut Generator,
    prompt: &[u32],
    o: &SampleOptions,
    mut on_token: impl FnMut(u32),
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenisation");
    }
    if prompt.len() > g.cfg.n_positions {
        bail!(
            "the prompt has {} tokens but the model accepts at most n_positions = {}",
            prompt.len(),
            g.cfg.n_positions
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
        if g.position() >= g.cfg.n_positions {
            break;
        }
        logits = g.step(next)?;
    }
    Ok(out)
}

//! Deterministic GPT-2 initialisation (the Hugging Face `GPT2PreTrainedModel._init_weights`
//! scheme): weights and embeddings ~ N(0, 0.02), the two residual projections (`c_proj`)
//! ~ N(0, 0.02/√(2·n_layer)), biases 0, LayerNorm weights 1.
//!
//! Each tensor draws from its own stream keyed by (seed, tensor name), so the logical model is
//! the same whatever the tensor-parallel layout or the order tensors are created in.

use super::table::Table;
use crate::model::ModelConfig;
use fugu_io::rng::SplitMix64;

/// Standard deviation of the ordinary weights.
pub const INIT_STD: f64 = 0.02;

fn name_key(name: &str) -> u64 {
    // FNV-1a: a stable hash (std's hasher is randomised per process).
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Fills `out` with N(0, std²) samples (Box-Muller over 53-bit uniforms).
fn fill_normal(out: &mut [f32], rng: &mut SplitMix64, std: f64) {
    let uniform =
        |rng: &mut SplitMix64| ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    for pair in out.chunks_mut(2) {
        let (u1, u2) = (uniform(rng), uniform(rng));
        let r = (-2.0 * u1.ln()).sqrt() * std;
        let th = std::f64::consts::TAU * u2;
        pair[0] = (r * th.cos()) as f32;
        if pair.len() > 1 {
            pair[1] = (r * th.sin()) as f32;
        }
    }
}

/// Fills the first `real` elements of `dst` with N(0, std²) samples from the stream of
/// tensor `name` under `seed`, and zeroes the rest (the padded vocabulary rows).
pub fn normal_tensor(name: &str, seed: u64, dst: &mut [f32], std: f64, real: usize) {
    let mut rng = SplitMix64::from_parts(&[seed, name_key(name)]);
    fill_normal(&mut dst[..real], &mut rng, std);
    dst[real..].fill(0.0);
}

/// Initialises the full (tp = 1) parameter buffer described by `table`.
pub fn init_params(cfg: &ModelConfig, table: &Table, seed: u64) -> Vec<f32> {
    let mut buf = vec![0.0f32; table.total()];
    for spec in table.specs() {
        init_tensor(cfg, &spec.name, seed, &mut buf[spec.range()]);
    }
    buf
}

/// The initial value of the full (tp = 1) tensor `name` into `dst` (its elements, zeroed):
/// [`init_params`] one tensor at a time.
pub fn init_tensor(cfg: &ModelConfig, name: &str, seed: u64, dst: &mut [f32]) {
    if name.ends_with(".bias") {
        dst.fill(0.0);
        return;
    }
    if name.starts_with("ln_") || name.contains(".ln_") {
        dst.fill(1.0);
        return;
    }
    let std = if name.ends_with("c_proj.weight") {
        INIT_STD / ((2 * cfg.n_layer) as f64).sqrt()
    } else {
        INIT_STD
    };
    // Only the real vocabulary rows of `wte`; padded rows stay zero.
    let real = match name {
        "wte.weight" => cfg.vocab_size * cfg.n_embd,
        _ => dst.len(),
    };
    normal_tensor(name, seed, dst, std, real);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::model::table::gpt2_params;

    #[test]
    fn init_statistics_and_padding() {
        let cfg = RunConfig::load("gpt2-tiny").unwrap().model;
        let t = gpt2_params(&cfg, 1).unwrap();
        let p = init_params(&cfg, &t, 7);
        let wte = t.get("wte.weight").unwrap();
        let w = &p[wte.range()];
        let real = cfg.vocab_size * cfg.n_embd;
        assert!(w[real..].iter().all(|&x| x == 0.0));
        let n = real as f64;
        let mean = w[..real].iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = w[..real]
            .iter()
            .map(|&x| (x as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 1e-4, "{mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "{}", var.sqrt());
        let ln = t.get("h.1.ln_2.weight").unwrap();
        assert!(p[ln.range()].iter().all(|&x| x == 1.0));
        let b = t.get("h.1.mlp.c_fc.bias").unwrap();
        assert!(p[b.range()].iter().all(|&x| x == 0.0));
        // Deterministic, and seed-dependent.
        assert_eq!(p, init_params(&cfg, &t, 7));
        assert_ne!(p, init_params(&cfg, &t, 8));
    }
}

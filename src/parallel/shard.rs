//! Tensor-parallel sharding: the copies between a full (tp = 1) buffer and one rank's shard,
//! following each tensor's [`Split`] as the parameter table declares it
//! ([`crate::model::table::gpt2_params`]).
//!
//! The same mapping shards optimizer moments and gradients, and gathers them back for a
//! checkpoint, which is what lets a checkpoint move between layouts.

use crate::model::table::{Split, Table, TensorSpec};
use anyhow::{bail, Result};

/// Calls `f(full_offset, local_offset, len)` for every contiguous run of elements that rank
/// `r` of `tp` holds of tensor `full` (offsets relative to each tensor's start).
fn segments(
    full: &TensorSpec,
    local: &TensorSpec,
    r: usize,
    tp: usize,
    mut f: impl FnMut(usize, usize, usize),
) {
    let split = full.split;
    let local_len = match split {
        Split::Replicated => full.len(),
        _ => full.len() / tp,
    };
    debug_assert_eq!(local.len(), local_len, "shard shape of {}", full.name);
    match split {
        Split::Replicated => f(0, 0, full.len()),
        Split::Rows => {
            let rows = full.shape[0] / tp;
            let row_len: usize = full.shape[1..].iter().product();
            f(r * rows * row_len, 0, rows * row_len)
        }
        Split::Cols { parts } => {
            let cols = *full.shape.last().expect("a tensor has a shape");
            let rows = full.len() / cols;
            let block = cols / parts / tp;
            let local_cols = block * parts;
            for i in 0..rows {
                for p in 0..parts {
                    f(
                        i * cols + p * (cols / parts) + r * block,
                        i * local_cols + p * block,
                        block,
                    );
                }
            }
        }
    }
}

/// Each tensor of `local` (one stage's shard table) with the tensor of the same name in `full`
/// (the whole model); an error names a tensor `full` lacks.
fn pairs<'t>(full: &'t Table, local: &'t Table) -> Result<Vec<(&'t TensorSpec, &'t TensorSpec)>> {
    local
        .specs()
        .iter()
        .map(|l| match full.get(&l.name) {
            Some(f) => Ok((f, l)),
            None => bail!(
                "parameter tables differ: {} is not in the full model",
                l.name
            ),
        })
        .collect()
}

/// Copies rank `r`'s part of a full buffer (laid out by `full_table`) into `out` (laid out by
/// `local_table`, the table of one of `tp` shards of the whole model or of a pipeline stage).
pub fn shard(
    full_table: &Table,
    full: &[f32],
    local_table: &Table,
    r: usize,
    tp: usize,
    out: &mut [f32],
) -> Result<()> {
    for (fs, ls) in pairs(full_table, local_table)? {
        shard_tensor(fs, ls, r, tp, &full[fs.range()], &mut out[ls.range()]);
    }
    Ok(())
}

/// One tensor of [`shard`]: rank `r`'s part (`dst`, the elements of `local`) of the full
/// tensor `full` (`src`, its elements).
pub fn shard_tensor(
    full: &TensorSpec,
    local: &TensorSpec,
    r: usize,
    tp: usize,
    src: &[f32],
    dst: &mut [f32],
) {
    segments(full, local, r, tp, |fo, lo, n| {
        dst[lo..lo + n].copy_from_slice(&src[fo..fo + n])
    });
}

/// The inverse of [`shard`]: assembles the tensors of `local_table` in a full buffer from all
/// `tp` shards (replicated tensors are taken from shard 0); other tensors of `out` are left
/// as they are.
pub fn unshard(
    full_table: &Table,
    local_table: &Table,
    shards: &[&[f32]],
    out: &mut [f32],
) -> Result<()> {
    for (fs, ls) in pairs(full_table, local_table)? {
        let parts: Vec<&[f32]> = shards.iter().map(|sh| &sh[ls.range()]).collect();
        unshard_tensor(fs, ls, &parts, &mut out[fs.range()]);
    }
    Ok(())
}

/// One tensor of [`unshard`]: the full tensor `full` (`out`, its elements) from every rank's
/// shard of it (`shards[r]`, the elements of `local` on rank `r`).
pub fn unshard_tensor(full: &TensorSpec, local: &TensorSpec, shards: &[&[f32]], out: &mut [f32]) {
    let tp = shards.len();
    for (r, src) in shards.iter().enumerate() {
        if r > 0 && full.split == Split::Replicated {
            continue;
        }
        segments(full, local, r, tp, |fo, lo, n| {
            out[fo..fo + n].copy_from_slice(&src[lo..lo + n])
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::model::table::gpt2_params;

    #[test]
    fn shard_then_unshard_is_the_identity_and_shards_partition_the_model() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model;
        let full_t = gpt2_params(&m, 1).unwrap();
        let full: Vec<f32> = (0..full_t.total()).map(|i| i as f32).collect();
        for tp in [1, 2, 4] {
            let lt = gpt2_params(&m, tp).unwrap();
            let shards: Vec<Vec<f32>> = (0..tp)
                .map(|r| {
                    let mut s = vec![-1.0; lt.total()];
                    shard(&full_t, &full, &lt, r, tp, &mut s).unwrap();
                    s
                })
                .collect();
            let refs: Vec<&[f32]> = shards.iter().map(|s| &s[..]).collect();
            let mut back = vec![0.0; full_t.total()];
            unshard(&full_t, &lt, &refs, &mut back).unwrap();
            for s in full_t.specs() {
                assert_eq!(&back[s.range()], &full[s.range()], "tp={tp} {}", s.name);
            }
            // Sharded tensors: every element lives on exactly one rank.
            let qkv = full_t.get("h.1.attn.c_attn.weight").unwrap();
            let mut seen = std::collections::HashSet::new();
            for (r, sh) in shards.iter().enumerate() {
                let ls = lt.get("h.1.attn.c_attn.weight").unwrap();
                for &x in &sh[ls.range()] {
                    assert!(seen.insert(x as usize), "tp={tp} rank {r} holds {x} twice");
                }
            }
            assert_eq!(seen.len(), qkv.len());
        }
    }

    #[test]
    fn qkv_shard_takes_the_ranks_heads_of_q_k_and_v() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model; // C = 128, 4 heads of 32
        let full_t = gpt2_params(&m, 1).unwrap();
        let lt = gpt2_params(&m, 2).unwrap();
        let full: Vec<f32> = (0..full_t.total()).map(|i| i as f32).collect();
        let mut s = vec![0.0; lt.total()];
        shard(&full_t, &full, &lt, 1, 2, &mut s).unwrap();
        let fb = full_t.get("h.0.attn.c_attn.bias").unwrap().offset as f32;
        let lb = &s[lt.get("h.0.attn.c_attn.bias").unwrap().range()];
        // Rank 1 holds heads 2-3: q columns 64..128, k 192..256, v 320..384.
        assert_eq!(lb[0], fb + 64.0);
        assert_eq!(lb[64], fb + 192.0);
        assert_eq!(lb[191], fb + 383.0);
    }

    #[test]
    fn stages_shard_and_unshard_by_name() {
        use crate::model::stage::Stage;
        use crate::model::table::gpt2_stage_params;
        let m = RunConfig::load("gpt2-tiny").unwrap().model;
        let full_t = gpt2_params(&m, 1).unwrap();
        let full: Vec<f32> = (0..full_t.total()).map(|i| i as f32).collect();
        let mut back = vec![-1.0f32; full_t.total()];
        for st in Stage::split(&m, 2, 64).unwrap() {
            let lt = gpt2_stage_params(&m, 2, &st).unwrap();
            let shards: Vec<Vec<f32>> = (0..2)
                .map(|r| {
                    let mut s = vec![0.0; lt.total()];
                    shard(&full_t, &full, &lt, r, 2, &mut s).unwrap();
                    s
                })
                .collect();
            let refs: Vec<&[f32]> = shards.iter().map(|s| &s[..]).collect();
            unshard(&full_t, &lt, &refs, &mut back).unwrap();
        }
        // The stages together hold every tensor (wte twice, identically).
        for spec in full_t.specs() {
            assert_eq!(back[spec.range()], full[spec.range()], "{}", spec.name);
        }
        let other = RunConfig::load("gpt2-124m").unwrap().model;
        let big = gpt2_stage_params(&other, 1, &Stage::split(&other, 2, 256).unwrap()[1]).unwrap();
        let e = shard(&full_t, &full, &big, 0, 1, &mut vec![0.0; big.total()]).unwrap_err();
        assert!(e.to_string().contains("h.9.ln_1.weight is not in"), "{e}");
    }
}

//! Writing a checkpoint from every rank's share of the model, as sharded files
//! ([`crate::checkpoint::sharded`]), so that no rank ever holds the whole model.
//!
//! Every rank walks the planned tensors of its pipeline stage in plan order, one tensor at a
//! time, for the parameters and both AdamW moments:
//! 1. with ZeRO-1, the data-parallel ranks send the parts of the moments they own to
//!    data-parallel rank 0 (a gather of a few pieces per tensor);
//! 2. in the tensor-parallel group of data-parallel rank 0, every rank sends its shard of the
//!    tensor to the rank the plan names as the writer;
//! 3. the writer appends it to its shard file: a row-split tensor (the vocabulary-parallel
//!    `wte`, the largest) shard by shard as they arrive, since rank r's rows follow rank
//!    r−1's; a column-split or replicated one (a block's, small) assembled whole first.
//!
//! So a rank holds at most one shard of a large tensor, or one small tensor, beyond its
//! training state, the writers are the `pp × tp` ranks of data-parallel replica 0, and they
//! write at the same time. Rank 0 adds the indexes, configuration and state and renames the folder into place
//! once every writer is done ([`crate::checkpoint::finish_checkpoint`]).

use super::dist::Dist;
use crate::backend::{Backend, BufId, Span};
use crate::checkpoint::sharded::{self, Kind, Planned, ShardWriter};
use crate::model::registry;
use crate::model::table::{Split, TensorSpec};
use crate::model::Model;
use crate::parallel::shard::unshard_tensor;
use anyhow::{Context, Result};
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

/// Writes this rank's part of the sharded weights and optimizer state of `model` into `dir`
/// following `plan` ([`sharded::plan`] of the run's stages; every rank calls it, with the same
/// `dir`). The optimizer files carry `opt_step`.
pub fn write_shards<B: Backend>(
    model: &dyn Model<B>,
    plan: &[Planned],
    dist: &Dist,
    dir: &Path,
    opt_step: u64,
) -> Result<()> {
    let g = dist.grid;
    let cfg = model.config();
    let n = g.pp * g.tp;
    let mine: Vec<&Planned> = plan
        .iter()
        .filter(|p| p.shard / g.tp == g.pp_rank)
        .collect();
    let shard = g.pp_rank * g.tp + g.tp_rank;
    let writing = g.dp_rank == 0;
    let mut writers = if writing {
        Some(open_writers(plan, shard, n, dir, opt_step)?)
    } else {
        None
    };
    let full_table = registry::full_params(cfg)?;
    let bufs = model.buffers();
    for p in mine {
        let local = model
            .table()
            .get(&p.name)
            .with_context(|| format!("internal: {} is not in this stage's table", p.name))?;
        let full = full_table
            .get(&p.name)
            .expect("planned tensors are the model's");
        let mut keys = sharded::keys(Kind::Model, p);
        keys.extend(sharded::keys(Kind::Optimizer, p));
        for (k, key) in keys.iter().enumerate() {
            let values = match k {
                0 => writing.then(|| download(model, bufs.params, local.offset, local.len())),
                _ => moment(model, dist, if k == 1 { bufs.m } else { bufs.v }, local),
            };
            // Tensor-parallel group of data-parallel replica 0 only.
            let (Some(values), Some(w)) = (values, writers.as_mut()) else {
                continue;
            };
            let writer = p.shard % g.tp;
            if g.tp_rank != writer {
                dist.tp.start_send(writer, 0, values).wait();
                continue;
            }
            let file = if k == 0 { &mut w.0 } else { &mut w.1 };
            // Every rank's shard in rank order: the writer's own, the others received one at
            // a time.
            let shard_of = |r: usize| -> Cow<[f32]> {
                if r == writer {
                    Cow::Borrowed(&values)
                } else {
                    Cow::Owned(dist.tp.start_recv(r, 0, vec![0.0; values.len()]).wait().0)
                }
            };
            if local.split == Split::Rows || g.tp == 1 {
                // Rank r's rows follow rank r-1's: each shard goes to the file as it comes
                // (the padding rows of `wte` at the end are left out).
                let mut left = p.numel();
                for r in 0..g.tp {
                    let part = shard_of(r);
                    let n = part.len().min(left);
                    file.append(key, &part[..n])?;
                    left -= n;
                }
            } else {
                // Column-split or replicated: small tensors, assembled whole.
                let parts: Vec<Cow<[f32]>> = (0..g.tp).map(shard_of).collect();
                let refs: Vec<&[f32]> = parts.iter().map(|x| &x[..]).collect();
                let mut whole = vec![0.0f32; full.len()];
                unshard_tensor(full, local, &refs, &mut whole);
                file.append(key, &whole[..p.numel()])?;
            }
        }
    }
    if let Some((m, o)) = writers {
        m.finish()?;
        o.finish()?;
    }
    Ok(())
}

/// The model and optimizer files of shard `shard`, headers written.
fn open_writers(
    plan: &[Planned],
    shard: usize,
    n: usize,
    dir: &Path,
    opt_step: u64,
) -> Result<(ShardWriter, ShardWriter)> {
    let ours: Vec<&Planned> = plan.iter().filter(|p| p.shard == shard).collect();
    let tensors = |kind: Kind| -> Vec<(String, Vec<usize>)> {
        ours.iter()
            .flat_map(|p| {
                sharded::keys(kind, p)
                    .into_iter()
                    .map(|k| (k, p.shape.clone()))
            })
            .collect()
    };
    let pt = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let mut opt = pt.clone();
    opt.insert("optimizer".into(), "adamw".into());
    opt.insert("step".into(), opt_step.to_string());
    let path = |kind| dir.join(sharded::shard_file(kind, shard, n));
    Ok((
        ShardWriter::create(&path(Kind::Model), &pt, &tensors(Kind::Model))?,
        ShardWriter::create(&path(Kind::Optimizer), &opt, &tensors(Kind::Optimizer))?,
    ))
}

fn download<B: Backend>(model: &dyn Model<B>, buf: BufId, offset: usize, len: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; len];
    model
        .backend()
        .download(Span { buf, offset, len }, &mut out);
    out
}

/// This rank's shard of tensor `spec` of moment buffer `buf` on data-parallel rank 0 (`None`
/// elsewhere). Under ZeRO-1 the data-parallel ranks each own parts of it (their owned
/// ranges), gathered here; without it every rank holds it all and rank 0 reads its own.
fn moment<B: Backend>(
    model: &dyn Model<B>,
    dist: &Dist,
    buf: BufId,
    spec: &TensorSpec,
) -> Option<Vec<f32>> {
    let range = spec.range();
    let owned = model.owned();
    let everything = owned.len() == 1 && owned[0].flat == (0..model.table().total());
    if everything {
        let o = &owned[0];
        return (dist.grid.dp_rank == 0)
            .then(|| download(model, buf, o.moment_offset + range.start, range.len()));
    }
    // The number of pieces, then (start within the tensor, length, values) of each owned
    // piece, as bytes (never empty: MPI implementations reject some empty gathers).
    let mut msg = Vec::new();
    let mut pieces = 0u64;
    for o in owned {
        let (lo, hi) = (o.flat.start.max(range.start), o.flat.end.min(range.end));
        if lo >= hi {
            continue;
        }
        let vals = download(model, buf, o.moment_offset + (lo - o.flat.start), hi - lo);
        msg.extend(((lo - range.start) as u64).to_le_bytes());
        msg.extend((vals.len() as u64).to_le_bytes());
        msg.extend(vals.iter().flat_map(|x| x.to_le_bytes()));
        pieces += 1;
    }
    let mut framed = pieces.to_le_bytes().to_vec();
    framed.extend(msg);
    let all = dist.dp.gather_bytes(&framed)?;
    let mut out = vec![0.0f32; range.len()];
    for m in all {
        let mut rest = &m[8..];
        while !rest.is_empty() {
            let word = |b: &[u8]| u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize;
            let (start, len) = (word(rest), word(&rest[8..]));
            let vals = &rest[16..16 + 4 * len];
            for (x, b) in out[start..start + len].iter_mut().zip(vals.chunks_exact(4)) {
                *x = f32::from_le_bytes(b.try_into().expect("4 bytes"));
            }
            rest = &rest[16 + 4 * len..];
        }
    }
    Some(out)
}

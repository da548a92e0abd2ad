//! Moving the model between its logical form (one full tp = 1 table, as in checkpoints) and
//! this rank's share of it (its pipeline stage's tensors, a tensor-parallel shard of them, and
//! with ZeRO-1 a block of the moments).
//! This is what lets a checkpoint written under one layout resume under another.

use super::dist::Dist;
use crate::backend::Backend;
use crate::model::table::{gpt2_stage_params, Table};
use crate::model::{Gpt2, Stage};
use crate::parallel::grad_sync::{pack_owned, GradSync};
use crate::parallel::shard::{shard, unshard};
use anyhow::Result;

/// This rank's shard of a full buffer.
fn local_of<B: Backend>(model: &Gpt2<B>, full_table: &Table, full: &[f32]) -> Result<Vec<f32>> {
    let mut local = vec![0.0f32; model.table.total()];
    shard(
        full_table,
        full,
        &model.table,
        model.tp.rank,
        model.tp.size,
        &mut local,
    )?;
    Ok(local)
}

/// Loads full parameters (and full AdamW moments, when resuming) into this rank's model.
pub fn load_full<B: Backend>(
    model: &mut Gpt2<B>,
    full_table: &Table,
    params: &[f32],
    moments: Option<(&[f32], &[f32])>,
) -> Result<()> {
    let local = local_of(model, full_table, params)?;
    model.load_params(&local)?;
    if let Some((m, v)) = moments {
        for (full, buf) in [(m, model.m), (v, model.v)] {
            let packed = pack_owned(&local_of(model, full_table, full)?, model.owned());
            let s = model.be.whole(buf);
            model.be.upload(s, &packed);
        }
    }
    Ok(())
}

/// The full parameters and moments on world rank 0 (`None` elsewhere). Every rank must call
/// it: ZeRO-1 gathers moment blocks over the data-parallel group, then data-parallel rank 0
/// of each tensor-parallel group gathers the shards, then (with several pipeline stages)
/// world rank 0 gathers every stage's tensors from the stage's data- and tensor-parallel
/// rank 0. Rank 0 then holds the whole model: sharded checkpoints will remove that.
pub fn gather_full<B: Backend>(
    model: &Gpt2<B>,
    sync: &GradSync,
    dist: &Dist,
    full_table: &Table,
) -> Result<Option<[Vec<f32>; 3]>> {
    let total = model.table.total();
    let m = sync.gather_moments(&model.download(model.m), total);
    let v = sync.gather_moments(&model.download(model.v), total);
    let (Some(m), Some(v)) = (m, v) else {
        return Ok(None);
    };
    let locals = [model.download(model.params), m, v];
    let tp = dist.tp.size();
    if tp == 1 && dist.grid.pp == 1 {
        return Ok(Some(locals));
    }
    let root = dist.tp.rank() == 0;
    let mut out: Vec<Vec<f32>> = Vec::with_capacity(3);
    for local in &locals {
        if !root {
            dist.tp.gather_f32(local, None);
            continue;
        }
        let mut all = vec![0.0f32; total * tp];
        dist.tp.gather_f32(local, Some(&mut all));
        let shards: Vec<&[f32]> = all.chunks(total).collect();
        let mut full = vec![0.0f32; full_table.total()];
        unshard(full_table, &model.table, &shards, &mut full)?;
        out.push(full);
    }
    if !root {
        return Ok(None);
    }
    let out: [Vec<f32>; 3] = out.try_into().expect("params, m and v were gathered");
    if dist.grid.pp == 1 {
        return Ok(Some(out));
    }
    gather_stages(model, dist, full_table, out)
}

/// With several pipeline stages: each stage's tensors (in `full`, full buffers holding this
/// stage's tensors) onto world rank 0, called by data- and tensor-parallel rank 0 of every
/// stage (one pipeline). Rank 0 returns the whole model.
fn gather_stages<B: Backend>(
    model: &Gpt2<B>,
    dist: &Dist,
    full_table: &Table,
    full: [Vec<f32>; 3],
) -> Result<Option<[Vec<f32>; 3]>> {
    // This stage's tensors, packed in its table's order, for params, m and v in turn.
    let mut bytes = Vec::new();
    for buf in &full {
        for spec in model.table.specs() {
            let fs = full_table
                .get(&spec.name)
                .expect("a stage's tensor is in the model");
            bytes.extend(buf[fs.range()].iter().flat_map(|x| x.to_le_bytes()));
        }
    }
    let Some(all) = dist.pp.gather_bytes(&bytes) else {
        return Ok(None);
    };
    let mut out = full;
    for (s, bytes) in all.iter().enumerate().skip(1) {
        let stage = Stage::of(&model.cfg, dist.grid.pp, s)?;
        let table = gpt2_stage_params(&model.cfg, 1, &stage)?;
        let mut floats = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")));
        for buf in out.iter_mut() {
            for spec in table.specs() {
                let fs = full_table
                    .get(&spec.name)
                    .expect("a stage's tensor is in the model");
                for x in &mut buf[fs.range()] {
                    *x = floats.next().expect("a stage sent all its tensors");
                }
            }
        }
    }
    Ok(Some(out))
}

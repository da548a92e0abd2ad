//! Loading the model's logical form (one full tp = 1 table, as in checkpoints) into this
//! rank's share of it (its pipeline stage's tensors, a tensor-parallel shard of them, and with
//! ZeRO-1 a block of the moments). With [`super::save`], which writes the logical form from
//! the shares, this is what lets a checkpoint written under one layout resume under another.

use crate::backend::Backend;
use crate::model::table::Table;
use crate::model::Gpt2;
use crate::parallel::grad_sync::pack_owned;
use crate::parallel::shard::shard;
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

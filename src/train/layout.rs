//! Loading the model's logical form (full tp = 1 tensors, as in checkpoints) into this rank's
//! share of it (its pipeline stage's tensors, a tensor-parallel shard of them, and with
//! ZeRO-1 a block of the moments), one full tensor at a time, so a rank never holds the whole
//! model. With [`super::save`], which writes the logical form from the shares, this is what
//! lets a checkpoint written under one layout resume under another.

use crate::backend::Backend;
use crate::model::table::{Table, TensorSpec};
use crate::model::Model;
use crate::parallel::grad_sync::pack_owned;
use crate::parallel::shard::shard_tensor;
use anyhow::{Context, Result};

/// Reads the full tensor of `spec` (a tensor of the full table) into the slice (its length).
pub type ReadTensor<'a> = dyn FnMut(&TensorSpec, &mut [f32]) -> Result<()> + 'a;

/// Loads this rank's parameters from full tensors supplied by `params`, and with `moments`
/// (resuming) its AdamW moments from full tensors supplied by `moments[0]` (m) and `[1]` (v).
/// Only the tensors of this rank's stage are asked for, each once.
pub fn load_tensors<B: Backend>(
    model: &mut dyn Model<B>,
    full_table: &Table,
    params: &mut ReadTensor,
    moments: Option<[&mut ReadTensor; 2]>,
) -> Result<()> {
    let local = local_of(model, full_table, params)?;
    model.load_params(&local)?;
    if let Some(moments) = moments {
        let bufs = [model.buffers().m, model.buffers().v];
        for (read, buf) in moments.into_iter().zip(bufs) {
            let packed = pack_owned(&local_of(model, full_table, read)?, model.owned());
            let be = model.backend_mut();
            let s = be.whole(buf);
            be.upload(s, &packed);
        }
    }
    Ok(())
}

/// This rank's share of a buffer laid out by the model's (stage, shard) table, from full
/// tensors read one at a time.
fn local_of<B: Backend>(
    model: &dyn Model<B>,
    full_table: &Table,
    read: &mut ReadTensor,
) -> Result<Vec<f32>> {
    let mut local = vec![0.0f32; model.table().total()];
    let mut full = Vec::new();
    for ls in model.table().specs() {
        let fs = full_table
            .get(&ls.name)
            .with_context(|| format!("internal: {} is not in the full model", ls.name))?;
        full.clear();
        full.resize(fs.len(), 0.0);
        read(fs, &mut full)?;
        let (r, tp) = (model.tp().rank, model.tp().size);
        shard_tensor(fs, ls, r, tp, &full, &mut local[ls.range()]);
    }
    Ok(local)
}

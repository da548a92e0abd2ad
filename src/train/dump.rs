//! `--dump-grads FILE`: the first step's gradients as a safetensors file under Hugging Face
//! GPT-2 names (unprefixed, `wte.weight` unpadded), for comparison with other implementations.

use crate::checkpoint;
use crate::model::table::Table;
use crate::model::ModelConfig;
use anyhow::Result;
use std::collections::BTreeMap;
use std::path::Path;

/// Writes `grads` (laid out by `table`) to `path`, atomically.
pub fn dump_grads(path: &Path, cfg: &ModelConfig, table: &Table, grads: &[f32]) -> Result<()> {
    let meta = BTreeMap::from([("format".to_string(), "fugu-grads-v1".to_string())]);
    checkpoint::save_table_tensors(path, cfg, table, &[("", grads)], &meta)
}

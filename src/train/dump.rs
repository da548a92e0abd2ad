//! `--dump-grads FILE`: the first step's gradients as a safetensors file under Hugging Face
//! GPT-2 names (unprefixed, `wte.weight` unpadded), for comparison with other implementations.

use crate::config::ModelConfig;
use crate::model::table::Table;
use anyhow::{Context, Result};
use safetensors::tensor::{Dtype, TensorView};
use std::collections::HashMap;
use std::path::Path;

/// Writes `grads` (laid out by `table`) to `path`, atomically (temporary file + rename).
pub fn dump_grads(path: &Path, cfg: &ModelConfig, table: &Table, grads: &[f32]) -> Result<()> {
    let mut bytes: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for spec in table.specs() {
        let mut shape = spec.shape.clone();
        let mut data = &grads[spec.range()];
        if spec.name == "wte.weight" {
            shape[0] = cfg.vocab_size;
            data = &data[..cfg.vocab_size * cfg.n_embd];
        }
        let raw: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        bytes.push((spec.name.clone(), shape, raw));
    }
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| {
            TensorView::new(Dtype::F32, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| anyhow::anyhow!("tensor {n}: {e:?}"))
        })
        .collect::<Result<_>>()?;
    let meta: HashMap<String, String> =
        [("format".to_string(), "fugu-grads-v1".to_string())].into();
    let tmp = path.with_extension("safetensors.tmp");
    safetensors::serialize_to_file(views, &Some(meta), &tmp)
        .map_err(|e| anyhow::anyhow!("{e:?}"))
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    Ok(())
}

//! AdamW moments: `optimizer.safetensors` with F32 tensors `exp_avg.<key>` and
//! `exp_avg_sq.<key>`, where `<key>` is the parameter's key in `model.safetensors`
//! (`transformer.h.0.attn.c_attn.weight`), in the same unpadded shapes. Metadata:
//! `{"format": "pt", "optimizer": "adamw", "step": "<optimizer step>"}`.

use super::hf::{self, check_full_table, check_len, list, read_hf_config};
use super::st::{self, Data, Dtype, OutTensor};
use crate::atomic_write as atomic;
use crate::model::hf_layout::HfLayout;
use crate::model::registry;
use crate::model::table::{padded_vocab, Table};
use crate::model::ModelConfig;
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::Path;

/// The optimizer-state file of a checkpoint.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

use super::sharded::{MOMENT_PREFIXES as MOMENTS, OPTIMIZER_INDEX_FILE};

/// Writes `dir/optimizer.safetensors` (atomically) with the first (`m`) and second (`v`)
/// moments laid out by `table`, which must be the full table of `cfg`.
pub fn save_optimizer(
    dir: &Path,
    cfg: &ModelConfig,
    table: &Table,
    m: &[f32],
    v: &[f32],
    step: u64,
) -> Result<()> {
    check_len("first-moment (m)", m, table)?;
    check_len("second-moment (v)", v, table)?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let prefixes = MOMENTS.map(|m| format!("{m}{}", registry::hf_layout(cfg).key_prefix));
    let meta = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("optimizer".to_string(), "adamw".to_string()),
        ("step".to_string(), step.to_string()),
    ]);
    save_table_tensors(
        &dir.join(OPTIMIZER_FILE),
        cfg,
        table,
        &[(&prefixes[0], m), (&prefixes[1], v)],
        &meta,
    )
}

/// Writes buffers laid out by the full `table` of `cfg` as one safetensors file (atomically):
/// each tensor of each buffer as F32 under `prefix + name`, in its file shape (the vocabulary
/// tensors without the padding rows). Used for the optimizer state and for
/// `fugu train --dump-grads`.
pub fn save_table_tensors(
    path: &Path,
    cfg: &ModelConfig,
    table: &Table,
    buffers: &[(&str, &[f32])],
    meta: &BTreeMap<String, String>,
) -> Result<()> {
    check_full_table(cfg, table)?;
    let layout = registry::hf_layout(cfg);
    let mut tensors = Vec::with_capacity(buffers.len() * table.specs().len());
    for (prefix, buf) in buffers {
        check_len(&format!("buffer for keys {prefix:?}"), buf, table)?;
        for s in table.specs() {
            let shape = layout.file_shape(s, cfg.vocab_size);
            let n = shape.iter().product::<usize>();
            tensors.push(OutTensor {
                key: format!("{prefix}{}", s.name),
                dtype: Dtype::F32,
                shape,
                data: Data::F32(&buf[s.offset..s.offset + n]),
            });
        }
    }
    st::sort_tensors(&mut tensors);
    let header = st::build_header(Some(meta), &tensors);
    atomic::write_file(path, |w| st::write_body(w, &header, &tensors))
}

/// Reads `dir/optimizer.safetensors`, or the shards named by
/// `dir/optimizer.safetensors.index.json`, into `m` and `v` (laid out by `table`) and returns
/// the optimizer step from the metadata (every shard must carry the same). `layout` is the
/// architecture's. The vocabulary size is `dir/config.json`'s where that exists, else the
/// stored embedding's row count (which must pad to the table's). Every table tensor must be
/// present with its shape, and nothing else; keys with or without the layout's prefix
/// (`transformer.`) are accepted. The padding rows of the vocabulary tensors are zeroed.
pub fn load_optimizer(
    dir: &Path,
    layout: &HfLayout,
    table: &Table,
    m: &mut [f32],
    v: &mut [f32],
) -> Result<u64> {
    check_len("first-moment (m)", m, table)?;
    check_len("second-moment (v)", v, table)?;
    let files = OptimizerFiles::open(dir, layout, table)?;
    for s in table.specs() {
        files.read(table, 0, &s.name, &mut m[s.range()])?;
        files.read(table, 1, &s.name, &mut v[s.range()])?;
    }
    Ok(files.step)
}

/// The AdamW moments of a checkpoint (one file or shards), checked against a parameter table
/// when opened ([`load_optimizer`]'s rules), then read tensor by tensor.
pub struct OptimizerFiles {
    /// The optimizer step from the metadata.
    pub step: u64,
    shards: Vec<st::Header>,
    /// (moment, table name) → (shard, entry).
    index: HashMap<(usize, String), (usize, usize)>,
    vocab: usize,
    layout: HfLayout,
}

impl OptimizerFiles {
    /// Opens and checks the optimizer state of checkpoint `dir` against `table`, whose
    /// architecture names its tensors by `layout`.
    pub fn open(dir: &Path, layout: &HfLayout, table: &Table) -> Result<OptimizerFiles> {
        let (source, shards) = hf::read_tensor_files(
            dir,
            OPTIMIZER_FILE,
            OPTIMIZER_INDEX_FILE,
            "a checkpoint with optimizer state",
        )?;
        let p = source.display();
        let mut step = None;
        for h in &shards {
            let hp = h.path.display();
            let s = h
                .metadata
                .as_ref()
                .and_then(|md| md.get("step"))
                .ok_or_else(|| anyhow!("{hp}: no `step` in the safetensors metadata"))?;
            let s: u64 = s
                .parse()
                .map_err(|_| anyhow!("{hp}: metadata `step` = {s:?} is not an integer"))?;
            if step.is_some_and(|x| x != s) {
                bail!("{p}: the shards disagree on the optimizer step ({hp} says {s})");
            }
            step = Some(s);
        }
        let step = step.ok_or_else(|| anyhow!("{p}: no optimizer shards"))?;
        // (moment index, table name) for each key: (shard, entry).
        let mut index: HashMap<(usize, &str), (usize, usize)> = HashMap::new();
        let mut unknown = Vec::new();
        for (si, h) in shards.iter().enumerate() {
            for (i, e) in h.entries.iter().enumerate() {
                let found = MOMENTS.iter().enumerate().find_map(|(k, pre)| {
                    let name = e.key.strip_prefix(pre)?;
                    let name = layout.strip(name);
                    table.get(name).map(|s| (k, s.name.as_str()))
                });
                match found {
                    Some(id) => {
                        if index.insert(id, (si, i)).is_some() {
                            bail!("{p}: the moment `{}` is stored twice", e.key);
                        }
                    }
                    None => unknown.push(e.key.as_str()),
                }
            }
        }
        if !unknown.is_empty() {
            bail!(
                "{p}: {} tensor(s) that are not AdamW moments of the model's parameters: {}",
                unknown.len(),
                list(&unknown)
            );
        }
        let mut missing = Vec::new();
        for (k, pre) in MOMENTS.iter().enumerate() {
            for s in table.specs() {
                if !index.contains_key(&(k, s.name.as_str())) {
                    missing.push(format!("{pre}{}", layout.key(&s.name)));
                }
            }
        }
        if !missing.is_empty() {
            let names: Vec<&str> = missing.iter().map(String::as_str).collect();
            bail!("{p}: {} tensor(s) missing: {}", names.len(), list(&names));
        }
        let entry = |id: &(usize, usize)| (&shards[id.0], &shards[id.0].entries[id.1]);
        let vocab = match table.get(layout.embedding()) {
            None => 0,
            Some(w) => {
                if dir.join(hf::CONFIG_FILE).exists() {
                    let vocab = read_hf_config(dir)?.vocab_size;
                    hf::check_vocab(layout, table, vocab, &dir.join(hf::CONFIG_FILE))?;
                    vocab
                } else {
                    let (_, e) = entry(&index[&(0, layout.embedding())]);
                    let rows = e.shape.first().copied().unwrap_or(0);
                    if padded_vocab(rows) != w.shape[0] {
                        bail!(
                            "{p}: tensor `{}` has shape {:?}, expected {} rows padding to {}",
                            e.key,
                            e.shape,
                            w.shape[0],
                            w.shape[0]
                        );
                    }
                    rows
                }
            }
        };
        for ((k, name), id) in &index {
            let (h, e) = entry(id);
            hf::check_shape(h, e, layout.file_shape(table.get(name).unwrap(), vocab))
                .with_context(|| format!("moment {k} of {name}"))?;
        }
        let index = index
            .into_iter()
            .map(|((k, name), id)| ((k, name.to_string()), id))
            .collect();
        Ok(OptimizerFiles {
            step,
            shards,
            index,
            vocab,
            layout: *layout,
        })
    }

    /// Reads moment `k` (0: `exp_avg`, 1: `exp_avg_sq`) of the table tensor `name` into `out`
    /// (its length in the table); only that tensor's bytes are read. The padding rows of the
    /// vocabulary tensors are zeroed.
    pub fn read(&self, table: &Table, k: usize, name: &str, out: &mut [f32]) -> Result<()> {
        let spec = table
            .get(name)
            .ok_or_else(|| anyhow!("internal: {name} is not a table tensor"))?;
        let &(si, ei) = self
            .index
            .get(&(k, name.to_string()))
            .ok_or_else(|| anyhow!("internal: moment {k} of {name} was not indexed"))?;
        let h = &self.shards[si];
        let mut files = hf::ShardFiles::new(&self.shards);
        let want = self.layout.file_shape(spec, self.vocab);
        hf::read_into(files.get(si)?, h, &h.entries[ei], want, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::hf::save_model;
    use crate::checkpoint::testutil::{tiny, TestDir};
    use crate::model::gpt2_hf::LAYOUT;

    #[test]
    fn moments_round_trip_and_errors() {
        let d = TestDir::new("optim");
        let (cfg, table, params) = tiny();
        let m: Vec<f32> = params.iter().map(|x| x * 0.5).collect();
        let v: Vec<f32> = params.iter().map(|x| x * x).collect();
        save_optimizer(&d.0, &cfg, &table, &m, &v, 1234).unwrap();
        let h = st::read_header(&d.0.join(OPTIMIZER_FILE)).unwrap();
        assert_eq!(
            h.find("exp_avg_sq.transformer.wte.weight").unwrap().shape,
            vec![101, 32]
        );
        assert_eq!(h.entries.len(), 2 * table.specs().len());
        assert_eq!(h.metadata.as_ref().unwrap()["step"], "1234");
        // Without config.json (vocabulary from the file) and with it.
        for with_config in [false, true] {
            if with_config {
                save_model(&d.0, &cfg, &table, &params).unwrap();
            }
            let mut m2 = vec![f32::NAN; table.total()];
            let mut v2 = vec![f32::NAN; table.total()];
            assert_eq!(
                load_optimizer(&d.0, &LAYOUT, &table, &mut m2, &mut v2).unwrap(),
                1234
            );
            for s in table.specs() {
                assert_eq!(m2[s.range()], m[s.range()], "{}", s.name);
                assert_eq!(v2[s.range()], v[s.range()], "{}", s.name);
            }
        }
        // A model file is not an optimizer file.
        fs::copy(d.0.join(hf::MODEL_FILE), d.0.join(OPTIMIZER_FILE)).unwrap();
        let (mut m2, mut v2) = (vec![0f32; table.total()], vec![0f32; table.total()]);
        let e = format!(
            "{:#}",
            load_optimizer(&d.0, &LAYOUT, &table, &mut m2, &mut v2).unwrap_err()
        );
        assert!(e.contains("no `step`"), "{e}");
        // Wrong shape: a different model's moments.
        let cfg2 = ModelConfig {
            n_positions: 8,
            ..cfg.clone()
        };
        let t2 = crate::model::table::gpt2_params(&cfg2, 1).unwrap();
        let z = vec![0f32; t2.total()];
        save_optimizer(&d.0, &cfg2, &t2, &z, &z, 1).unwrap();
        let e = format!(
            "{:#}",
            load_optimizer(&d.0, &LAYOUT, &table, &mut m2, &mut v2).unwrap_err()
        );
        assert!(
            e.contains("`exp_avg.transformer.wpe.weight` has shape [8, 32], expected [16, 32]")
                || e.contains(
                    "`exp_avg_sq.transformer.wpe.weight` has shape [8, 32], expected [16, 32]"
                ),
            "{e}"
        );
        // Unknown and missing moments: a 1-layer model's file for the 2-layer table and back.
        let cfg1 = ModelConfig {
            n_layer: 1,
            ..cfg.clone()
        };
        let t1 = crate::model::table::gpt2_params(&cfg1, 1).unwrap();
        let z1 = vec![0f32; t1.total()];
        save_optimizer(&d.0, &cfg1, &t1, &z1, &z1, 1).unwrap();
        let e = format!(
            "{:#}",
            load_optimizer(&d.0, &LAYOUT, &table, &mut m2, &mut v2).unwrap_err()
        );
        assert!(
            e.contains("24 tensor(s) missing") && e.contains("exp_avg.transformer.h.1."),
            "{e}"
        );
        save_optimizer(&d.0, &cfg, &table, &m, &v, 1).unwrap();
        let (mut a, mut b) = (z1.clone(), z1.clone());
        let e = format!(
            "{:#}",
            load_optimizer(&d.0, &LAYOUT, &t1, &mut a, &mut b).unwrap_err()
        );
        assert!(
            e.contains("24 tensor(s) that are not AdamW moments") && e.contains("h.1."),
            "{e}"
        );
    }
}

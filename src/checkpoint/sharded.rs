//! Sharded checkpoints, written by many ranks at once.
//!
//! A checkpoint of a parallel run is the same logical checkpoint as a serial one (full
//! tensors in the Hugging Face layout, f32), split over `pp × tp` shard files
//! `model-0000i-of-0000N.safetensors` and `optimizer-0000i-of-0000N.safetensors`, with
//! `model.safetensors.index.json` (the Hugging Face index, so `transformers` loads the folder
//! as it is) and `optimizer.safetensors.index.json` (the same format for the moments). With
//! one shard the files are the single `model.safetensors` and `optimizer.safetensors`.
//!
//! [`plan`] decides which shard holds each tensor: shard `s·tp + w` belongs to tensor-parallel
//! rank `w` of data-parallel replica 0 of pipeline stage `s`; a stage's tensors are spread over
//! its `tp` shards by size (largest first, each to the least-filled shard), and a tensor two
//! stages hold (GPT-2's tied `wte`) is written by the first. Every rank can compute the whole plan from the model and the
//! layout, so rank 0 writes the indexes without hearing from the writers.
//!
//! [`ShardWriter`] writes one file as the tensors arrive: the header (every tensor's name,
//! shape and offsets, known from the plan) first, then each tensor's data in plan order (in
//! parts, if the caller likes), so a writer holds at most one tensor at a time, never its
//! whole shard.

use super::st::{self, Data, Dtype, OutTensor};
use crate::model::registry;
use crate::model::stage::Stage;
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// The Hugging Face index of a sharded model.
pub use super::hf::INDEX_FILE as MODEL_INDEX_FILE;

/// The index of sharded optimizer moments (the format of [`MODEL_INDEX_FILE`]).
pub const OPTIMIZER_INDEX_FILE: &str = "optimizer.safetensors.index.json";

/// The key prefixes of the two AdamW moments in optimizer files.
pub const MOMENT_PREFIXES: [&str; 2] = ["exp_avg.", "exp_avg_sq."];

/// What a shard file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Model,
    Optimizer,
}

impl Kind {
    fn stem(self) -> &'static str {
        match self {
            Kind::Model => "model",
            Kind::Optimizer => "optimizer",
        }
    }
}

/// The file name of shard `i` (0-based) of `n`: `model-00002-of-00004.safetensors`, or
/// `model.safetensors` when `n` is 1.
pub fn shard_file(kind: Kind, i: usize, n: usize) -> String {
    if n == 1 {
        format!("{}.safetensors", kind.stem())
    } else {
        format!("{}-{:05}-of-{n:05}.safetensors", kind.stem(), i + 1)
    }
}

/// One tensor of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    /// The model's name (`h.0.attn.c_attn.weight`).
    pub name: String,
    /// The key in model files (`transformer.h.0.attn.c_attn.weight`).
    pub key: String,
    /// The shape in the files (`wte` without the vocabulary padding).
    pub shape: Vec<usize>,
    /// The shard that holds it.
    pub shard: usize,
}

impl Planned {
    /// Number of elements in the file.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Which shard holds each tensor of `cfg` under pipeline `stages` and `tp`-way tensor
/// parallelism (module docs), stage by stage in each stage's table order.
/// `stages.len() · tp` shards.
pub fn plan(cfg: &ModelConfig, stages: &[Stage], tp: usize) -> Result<Vec<Planned>> {
    if tp == 0 {
        bail!("tensor-parallel degree 0");
    }
    let layout = registry::hf_layout(cfg);
    let mut out = Vec::new();
    let mut planned = HashSet::new();
    for stage in stages {
        let table = registry::stage_params(cfg, 1, stage)?;
        let specs: Vec<_> = table
            .specs()
            .iter()
            .filter(|s| planned.insert(s.name.clone()))
            .collect();
        let mut order: Vec<usize> = (0..specs.len()).collect();
        // Largest first (ties by table order), each to the least-filled shard (ties: lowest).
        order.sort_by_key(|&i| (std::cmp::Reverse(specs[i].len()), i));
        let mut fill = vec![0usize; tp];
        let mut shard_of = vec![0usize; specs.len()];
        for i in order {
            let w = (0..tp).min_by_key(|&w| (fill[w], w)).expect("tp >= 1");
            fill[w] += specs[i].len();
            shard_of[i] = stage.index * tp + w;
        }
        for (s, shard) in specs.iter().zip(shard_of) {
            out.push(Planned {
                name: s.name.clone(),
                key: layout.key(&s.name),
                shape: layout.file_shape(s, cfg.vocab_size),
                shard,
            });
        }
    }
    Ok(out)
}

/// The keys of `p` in a file of `kind`: its key (`transformer.NAME`) in the model, each
/// moment's prefix before that in the optimizer.
pub fn keys(kind: Kind, p: &Planned) -> Vec<String> {
    match kind {
        Kind::Model => vec![p.key.clone()],
        Kind::Optimizer => MOMENT_PREFIXES
            .iter()
            .map(|m| format!("{m}{}", p.key))
            .collect(),
    }
}

/// One shard file being written, tensor by tensor, in the order of its header.
pub struct ShardWriter {
    path: PathBuf,
    w: BufWriter<File>,
    /// Keys still to come, with their element counts, in data order.
    pending: VecDeque<(String, usize)>,
    buf: Vec<u8>,
}

impl ShardWriter {
    /// Creates `path` and writes the header of `tensors` (key, shape; F32, in this data order)
    /// with `metadata`.
    pub fn create(
        path: &Path,
        metadata: &BTreeMap<String, String>,
        tensors: &[(String, Vec<usize>)],
    ) -> Result<ShardWriter> {
        let out: Vec<OutTensor> = tensors
            .iter()
            .map(|(key, shape)| OutTensor {
                key: key.clone(),
                dtype: Dtype::F32,
                shape: shape.clone(),
                data: Data::F32(&[]),
            })
            .collect();
        let header = st::build_header(Some(metadata), &out);
        let f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        w.write_all(&header)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(ShardWriter {
            path: path.to_path_buf(),
            w,
            pending: tensors
                .iter()
                .map(|(k, s)| (k.clone(), s.iter().product()))
                .collect(),
            buf: Vec::new(),
        })
    }

    /// Appends data of the next tensor, which must be `key`: all of it at once, or in parts
    /// in order until its header's length is reached.
    pub fn append(&mut self, key: &str, data: &[f32]) -> Result<()> {
        match self.pending.front_mut() {
            Some((k, n)) if k == key && data.len() <= *n => {
                *n -= data.len();
                if *n == 0 {
                    self.pending.pop_front();
                }
            }
            Some((k, n)) => bail!(
                "{}: internal error: got `{key}` ({} values), the header expects `{k}` ({n} more)",
                self.path.display(),
                data.len()
            ),
            None => bail!(
                "{}: internal error: `{key}` after the last tensor",
                self.path.display()
            ),
        }
        for c in data.chunks(1 << 16) {
            self.buf.clear();
            self.buf.extend(c.iter().flat_map(|x| x.to_le_bytes()));
            self.w
                .write_all(&self.buf)
                .with_context(|| format!("writing {}", self.path.display()))?;
        }
        Ok(())
    }

    /// Flushes and fsyncs the file; every tensor of the header must have been appended.
    pub fn finish(self) -> Result<()> {
        if let Some((k, _)) = self.pending.front() {
            bail!(
                "{}: internal error: finished before `{k}`",
                self.path.display()
            );
        }
        let f = self
            .w
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("writing {}", self.path.display()))?;
        f.sync_all()
            .with_context(|| format!("fsync of {}", self.path.display()))
    }
}

/// The index of the `n`-shard files of `kind` (`None` for one shard): the Hugging Face format,
/// `{"metadata": {"total_size": BYTES}, "weight_map": {key: file}}`, keys sorted.
pub fn index_json(kind: Kind, plan: &[Planned], n: usize) -> Option<String> {
    if n == 1 {
        return None;
    }
    let mut map = BTreeMap::new();
    let mut bytes = 0usize;
    for p in plan {
        for k in keys(kind, p) {
            bytes += 4 * p.numel();
            map.insert(k, shard_file(kind, p.shard, n));
        }
    }
    let v = json!({"metadata": {"total_size": bytes}, "weight_map": map});
    let mut s = serde_json::to_string_pretty(&v).expect("JSON values serialize");
    s.push('\n');
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::model::table::gpt2_params;

    #[test]
    fn the_plan_covers_every_tensor_once_and_balances_bytes() {
        let m = RunConfig::load("gpt2-124m").unwrap().model;
        let full = gpt2_params(&m, 1).unwrap();
        for (pp, tp) in [(1, 1), (1, 2), (2, 2), (4, 1), (3, 4)] {
            let p = plan(&m, &Stage::split(&m, pp, 1024).unwrap(), tp).unwrap();
            let mut names: Vec<&str> = p.iter().map(|x| x.name.as_str()).collect();
            names.sort();
            let mut want: Vec<&str> = full.specs().iter().map(|s| s.name.as_str()).collect();
            want.sort();
            assert_eq!(names, want, "pp {pp} tp {tp}: every tensor exactly once");
            assert!(p.iter().all(|x| x.shard < pp * tp));
            assert_eq!(
                p.iter().find(|x| x.name == "wte.weight").unwrap().shard / tp,
                0
            );
            assert_eq!(
                p.iter().find(|x| x.name == "wte.weight").unwrap().shape,
                vec![50257, 768]
            );
            // Within a stage, no shard exceeds another by more than its largest tensor.
            for s in 0..pp {
                let bytes: Vec<usize> = (0..tp)
                    .map(|w| {
                        p.iter()
                            .filter(|x| x.shard == s * tp + w)
                            .map(Planned::numel)
                            .sum()
                    })
                    .collect();
                let biggest = p
                    .iter()
                    .filter(|x| x.shard / tp == s)
                    .map(Planned::numel)
                    .max()
                    .unwrap();
                let (lo, hi) = (bytes.iter().min().unwrap(), bytes.iter().max().unwrap());
                assert!(hi - lo <= biggest, "pp {pp} tp {tp} stage {s}: {bytes:?}");
            }
        }
        assert_eq!(shard_file(Kind::Model, 0, 1), "model.safetensors");
        assert_eq!(
            shard_file(Kind::Optimizer, 2, 4),
            "optimizer-00003-of-00004.safetensors"
        );
    }

    #[test]
    fn a_shard_is_written_in_header_order_and_reads_back() {
        let dir = std::env::temp_dir().join(format!("fugu-shard-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("s.safetensors");
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let t = vec![("a".to_string(), vec![2, 3]), ("b".to_string(), vec![4])];
        let mut w = ShardWriter::create(&path, &meta, &t).unwrap();
        let e = w.append("b", &[0.0; 4]).unwrap_err().to_string();
        assert!(e.contains("expects `a`"), "{e}");
        let mut w = ShardWriter::create(&path, &meta, &t).unwrap();
        w.append("a", &[1.0, 2.0]).unwrap();
        w.append("a", &[3.0, 4.0, 5.0, 6.0]).unwrap();
        assert!(w.append("a", &[0.0]).is_err(), "past the end of `a`");
        let mut w = ShardWriter::create(&path, &meta, &t).unwrap();
        w.append("a", &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        w.append("b", &[7.0, 8.0, 9.0, 10.0]).unwrap();
        w.finish().unwrap();
        let h = st::read_header(&path).unwrap();
        let mut f = File::open(&path).unwrap();
        let mut b = vec![0.0f32; 4];
        st::read_f32(&mut f, &h, h.find("b").unwrap(), &mut b).unwrap();
        assert_eq!(b, vec![7.0, 8.0, 9.0, 10.0]);
        let w = ShardWriter::create(&path, &meta, &t).unwrap();
        assert!(w.finish().unwrap_err().to_string().contains("before `a`"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

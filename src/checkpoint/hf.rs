//! Hugging Face GPT-2 directories: `config.json` (a `GPT2Config`) and `model.safetensors`.
//!
//! fugu writes what `transformers` `save_pretrained` writes for a `GPT2LMHeadModel`: keys
//! `transformer.<name>` with `<name>` the table's name (`transformer.h.0.attn.c_attn.weight`),
//! F32, Conv1D weights as (in, out), `wte.weight` with `vocab_size` rows (the model's padding
//! rows are not stored), no `lm_head.weight` (tied to `wte`), metadata `{"format": "pt"}`,
//! tensors ordered by name. It reads that, the unprefixed layout of the original hub `gpt2`
//! files (whose `h.N.attn.bias` / `h.N.attn.masked_bias` causal-mask buffers are ignored), and
//! F16/BF16 tensors.

use super::st::{self, Data, Dtype, Entry, Header, OutTensor};
use crate::atomic_write as atomic;
use crate::config::{Arch, ModelConfig};
use crate::model::registry;
use crate::model::table::{padded_vocab, Table, TensorSpec};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::path::Path;

/// The weights file of a Hugging Face model directory.
pub const MODEL_FILE: &str = "model.safetensors";
/// The `GPT2Config` file of a Hugging Face model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The generation defaults `transformers` reads next to `config.json`.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// The key prefix `transformers` gives the body of `GPT2LMHeadModel`.
pub const KEY_PREFIX: &str = "transformer.";

/// The Hugging Face `config.json` of the model `cfg` names, as fugu trains it (its
/// architecture writes it: [`crate::model::registry::hf_config_json`]). Keys are sorted, like
/// `save_pretrained` writes them.
pub fn hf_config_json(cfg: &ModelConfig) -> Value {
    registry::hf_config_json(cfg)
}

/// `generation_config.json` for `cfg`: the end-of-text token as bos, eos and padding, so that
/// `generate` and `pipeline("text-generation")` stop at it and do not warn.
pub fn generation_config_json(cfg: &ModelConfig) -> Value {
    let eot = cfg.eot_id();
    json!({
        "_from_model_config": true,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
    })
}

fn json_text(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("JSON values serialize");
    s.push('\n');
    s
}

/// Reads `dir/config.json` as a GPT-2 config fugu can run; fields `transformers` would default
/// may be absent. Errors name the file and the field.
pub fn read_hf_config(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join(CONFIG_FILE);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    parse_hf_config(&text, &path)
}

fn parse_hf_config(text: &str, path: &Path) -> Result<ModelConfig> {
    let p = path.display();
    let v: Value = serde_json::from_str(text).map_err(|e| anyhow!("{p}: invalid JSON: {e}"))?;
    let obj = v
        .as_object()
        .ok_or_else(|| anyhow!("{p}: expected a JSON object"))?;
    // transformers' own default for a config.json without `model_type` is GPT-2's.
    let arch = match obj.get("model_type") {
        None => Arch::default(),
        Some(t) => t.as_str().and_then(Arch::from_name).ok_or_else(|| {
            anyhow!(
                "{p}: field `model_type` = {t}: only {} is supported",
                supported_archs()
            )
        })?,
    };
    registry::parse_hf_config(arch, obj, &p.to_string())
}

/// The architectures fugu reads, quoted, for messages.
fn supported_archs() -> String {
    let names: Vec<String> = Arch::ALL
        .iter()
        .map(|a| format!("\"{}\"", a.name()))
        .collect();
    names.join(" or ")
}

/// The shape a table tensor has in files: the table's shape, except `wte.weight`, which has
/// `vocab` rows (the padding rows are not stored).
pub(crate) fn file_shape(spec: &TensorSpec, vocab: usize) -> Vec<usize> {
    if spec.name == "wte.weight" {
        let mut s = spec.shape.clone();
        s[0] = vocab;
        s
    } else {
        spec.shape.clone()
    }
}

/// Checks that `table` is the whole (tensor-parallel degree 1) table of `cfg`.
pub(crate) fn check_full_table(cfg: &ModelConfig, table: &Table) -> Result<()> {
    let want = registry::full_params(cfg)?;
    let same = want.specs().len() == table.specs().len()
        && want
            .specs()
            .iter()
            .zip(table.specs())
            .all(|(a, b)| a.name == b.name && a.shape == b.shape);
    if !same {
        bail!(
            "the parameter table is not the full GPT-2 table of the model config {cfg:?} \
             (a tensor-parallel shard or another model's table?)"
        );
    }
    Ok(())
}

/// Checks that the table's `wte.weight` is the padded vocabulary of `vocab`.
pub(crate) fn check_vocab(table: &Table, vocab: usize, origin: &Path) -> Result<()> {
    if let Some(w) = table.get("wte.weight") {
        if w.shape.first() != Some(&padded_vocab(vocab)) {
            bail!(
                "{}: vocab_size {vocab} pads to {} rows, but the table's wte.weight has shape {:?}",
                origin.display(),
                padded_vocab(vocab),
                w.shape
            );
        }
    }
    Ok(())
}

pub(crate) fn check_len(what: &str, buf: &[f32], table: &Table) -> Result<()> {
    if buf.len() < table.total() {
        bail!(
            "{what} buffer holds {} floats, the table needs {}",
            buf.len(),
            table.total()
        );
    }
    Ok(())
}

/// Reads the file tensor `e` into `dst`, the elements of the table tensor `spec`: checks the
/// shape against [`file_shape`] and zeroes the padding rows.
pub(crate) fn read_into(
    f: &mut File,
    h: &Header,
    e: &Entry,
    spec: &TensorSpec,
    vocab: usize,
    dst: &mut [f32],
) -> Result<()> {
    check_shape(h, e, spec, vocab)?;
    let n = e.numel();
    st::read_f32(f, h, e, &mut dst[..n])?;
    dst[n..].fill(0.0);
    Ok(())
}

pub(crate) fn check_shape(h: &Header, e: &Entry, spec: &TensorSpec, vocab: usize) -> Result<()> {
    let want = file_shape(spec, vocab);
    if e.shape != want {
        bail!(
            "{}: tensor `{}` has shape {:?}, expected {:?}",
            h.path.display(),
            e.key,
            e.shape,
            want
        );
    }
    if !e.dtype.is_float() {
        bail!(
            "{}: tensor `{}` has dtype {}, expected F32, F16 or BF16",
            h.path.display(),
            e.key,
            e.dtype
        );
    }
    Ok(())
}

/// A file key without the `transformer.` prefix.
fn strip(key: &str) -> &str {
    key.strip_prefix(KEY_PREFIX).unwrap_or(key)
}

/// `h.N.attn.bias` / `h.N.attn.masked_bias`: causal-mask buffers of old GPT-2 files.
fn is_buffer(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("h.") else {
        return false;
    };
    let Some((layer, tail)) = rest.split_once('.') else {
        return false;
    };
    !layer.is_empty()
        && layer.bytes().all(|b| b.is_ascii_digit())
        && (tail == "attn.bias" || tail == "attn.masked_bias")
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Role {
    /// A parameter, by table name.
    Param(String),
    /// `lm_head.weight`: must equal `wte.weight` (tied); rewritten from it.
    Tied,
    /// An attention-mask buffer: ignored, written back as it was.
    Buffer,
}

/// The index of a sharded Hugging Face checkpoint: `{"weight_map": {tensor: shard file}}`.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One tensor as stored: its shard, its header entry, and what it is to fugu.
#[derive(Clone, Debug)]
struct Stored {
    shard: usize,
    entry: Entry,
    role: Role,
}

/// A Hugging Face GPT-2 directory as loaded, remembering how it was stored (key prefix, dtype
/// of each tensor, metadata, tensor order, the original `config.json` text and the ignored
/// buffers) so that [`HfModel::save`] of unchanged weights writes identical files.
#[derive(Clone, Debug)]
pub struct HfModel {
    /// The model, from `config.json`.
    pub config: ModelConfig,
    config_text: String,
    /// `model.safetensors`, or the index of a sharded checkpoint.
    source: std::path::PathBuf,
    /// The headers of `model.safetensors`, or of the index's shards (sorted by file name).
    shards: Vec<Header>,
    /// Every stored tensor, shard by shard in data order.
    tensors: Vec<Stored>,
    /// Raw bytes of the [`Role::Buffer`] tensors, by index into `tensors`.
    buffers: HashMap<usize, Vec<u8>>,
}

/// Loads `dir/config.json` and the header of `dir/model.safetensors`, or of every shard named
/// by `dir/model.safetensors.index.json` (the weights are read by [`HfModel::copy_into`]). The
/// headers, file sizes and the index's agreement with the shards are checked here.
pub fn load_hf(dir: &Path) -> Result<HfModel> {
    let cpath = dir.join(CONFIG_FILE);
    let config_text =
        fs::read_to_string(&cpath).with_context(|| format!("reading {}", cpath.display()))?;
    let config = parse_hf_config(&config_text, &cpath)?;
    let (source, shards) = read_weights(dir)?;
    let mut tensors = Vec::new();
    let mut seen: HashMap<&str, &Path> = HashMap::new();
    for (si, h) in shards.iter().enumerate() {
        for e in &h.entries {
            let name = strip(&e.key);
            if let Some(other) = seen.insert(name, &h.path) {
                bail!(
                    "{}: tensor `{name}` is stored twice (also in {})",
                    h.path.display(),
                    other.display()
                );
            }
            let role = if name == "lm_head.weight" {
                Role::Tied
            } else if is_buffer(name) {
                Role::Buffer
            } else {
                Role::Param(name.to_string())
            };
            tensors.push(Stored {
                shard: si,
                entry: e.clone(),
                role,
            });
        }
    }
    let mut buffers = HashMap::new();
    let mut files = ShardFiles::new(&shards);
    for (i, t) in tensors.iter().enumerate() {
        if t.role == Role::Buffer {
            let h = &shards[t.shard];
            buffers.insert(i, st::read_raw(files.get(t.shard)?, h, &t.entry)?);
        }
    }
    Ok(HfModel {
        config,
        config_text,
        source,
        shards,
        tensors,
        buffers,
    })
}

/// The weight files of `dir`: `model.safetensors`, or (when there is none) the shards of
/// `model.safetensors.index.json`, with the file describing them.
fn read_weights(dir: &Path) -> Result<(std::path::PathBuf, Vec<Header>)> {
    read_tensor_files(
        dir,
        MODEL_FILE,
        INDEX_FILE,
        "a Hugging Face model directory",
    )
}

/// The headers of `dir/single`, or (when there is none) of the shards named by `dir/index`
/// (`{"weight_map": {key: file}}`, files in `dir`), sorted by file name, with the file
/// describing them. Every shard's tensors must be the index's, and in the file it names.
/// `what` names the folder in the error when neither exists.
pub(crate) fn read_tensor_files(
    dir: &Path,
    single: &str,
    index: &str,
    what: &str,
) -> Result<(std::path::PathBuf, Vec<Header>)> {
    let single = dir.join(single);
    let index = dir.join(index);
    if single.exists() || !index.exists() {
        if !single.exists() {
            bail!(
                "{}: no {} (nor a sharded {}): not {what}",
                dir.display(),
                path_file(&single),
                path_file(&index)
            );
        }
        let h = st::read_header(&single)?;
        return Ok((single, vec![h]));
    }
    let p = index.display();
    let text = fs::read_to_string(&index).with_context(|| format!("reading {p}"))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| anyhow!("{p}: invalid JSON: {e}"))?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| anyhow!("{p}: no `weight_map` object"))?;
    let mut wanted: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| anyhow!("{p}: weight_map[{key:?}] = {file}: expected a file name"))?;
        if file.is_empty() || file.contains(['/', '\\']) || file == ".." || file == "." {
            bail!("{p}: weight_map[{key:?}] = {file:?}: expected a file in the same folder");
        }
        wanted.insert(key, file);
    }
    let files: std::collections::BTreeSet<&str> = wanted.values().copied().collect();
    let shards = files
        .iter()
        .map(|f| st::read_header(&dir.join(f)))
        .collect::<Result<Vec<_>>>()?;
    for h in &shards {
        let file = h.path.file_name().and_then(|f| f.to_str()).unwrap_or("");
        for e in &h.entries {
            match wanted.get(e.key.as_str()) {
                Some(f) if *f == file => {}
                Some(f) => bail!(
                    "{}: holds tensor `{}`, which {p} places in {f}",
                    h.path.display(),
                    e.key
                ),
                None => bail!(
                    "{}: holds tensor `{}`, which {p} does not list",
                    h.path.display(),
                    e.key
                ),
            }
        }
    }
    for (key, file) in &wanted {
        let h = &shards[files
            .iter()
            .position(|f| f == file)
            .expect("a shard per file")];
        if h.find(key).is_none() {
            bail!("{p}: lists tensor `{key}` in {file}, which does not hold it");
        }
    }
    Ok((index, shards))
}

fn path_file(p: &Path) -> String {
    p.file_name()
        .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into())
}

/// The shard files of a model, opened on first use.
pub(crate) struct ShardFiles<'a> {
    shards: &'a [Header],
    files: Vec<Option<File>>,
}

impl<'a> ShardFiles<'a> {
    pub(crate) fn new(shards: &'a [Header]) -> Self {
        Self {
            shards,
            files: shards.iter().map(|_| None).collect(),
        }
    }

    pub(crate) fn get(&mut self, shard: usize) -> Result<&mut File> {
        let path = &self.shards[shard].path;
        let slot = &mut self.files[shard];
        if slot.is_none() {
            *slot = Some(File::open(path).with_context(|| format!("opening {}", path.display()))?);
        }
        Ok(slot.as_mut().expect("opened above"))
    }
}

/// [`load_hf`] + [`HfModel::copy_into`]: loads the weights of a Hugging Face GPT-2 directory
/// into `params` (laid out by `table`) and returns its config.
pub fn load_model(dir: &Path, table: &Table, params: &mut [f32]) -> Result<ModelConfig> {
    let m = load_hf(dir)?;
    m.copy_into(table, params)?;
    Ok(m.config)
}

impl HfModel {
    /// The `model.safetensors` this was loaded from (the index, for a sharded checkpoint).
    pub fn path(&self) -> &Path {
        &self.source
    }

    /// Weight files: 1 for `model.safetensors`, else the index's shard count.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// `"transformer."` or `""`: how the file names its tensors.
    pub fn key_prefix(&self) -> &str {
        let wte = self
            .tensors
            .iter()
            .find(|t| strip(&t.entry.key) == "wte.weight");
        match wte {
            Some(t) if t.entry.key.starts_with(KEY_PREFIX) => KEY_PREFIX,
            _ => "",
        }
    }

    /// The stored dtype of the table tensor `name` (e.g. `h.0.ln_1.weight`).
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.entry(name).map(|(_, t)| t.entry.dtype)
    }

    /// The `__metadata__` of the (first) weight file.
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.shards[0].metadata.as_ref()
    }

    /// Keys that are not parameters: causal-mask buffers and a tied `lm_head.weight`.
    pub fn ignored_tensors(&self) -> Vec<&str> {
        self.tensors
            .iter()
            .filter(|t| !matches!(t.role, Role::Param(_)))
            .map(|t| t.entry.key.as_str())
            .collect()
    }

    fn entry(&self, name: &str) -> Option<(usize, &Stored)> {
        self.tensors
            .iter()
            .enumerate()
            .find(|(_, t)| matches!(&t.role, Role::Param(n) if n == name))
    }

    fn tied(&self) -> Option<&Stored> {
        self.tensors.iter().find(|t| t.role == Role::Tied)
    }

    fn header(&self, t: &Stored) -> &Header {
        &self.shards[t.shard]
    }

    /// Table tensors paired with their stored tensors; errors for unknown and missing tensors.
    fn pair<'a>(&'a self, table: &'a Table) -> Result<Vec<(&'a TensorSpec, &'a Stored)>> {
        let p = self.path().display();
        let unknown: Vec<&str> = self
            .tensors
            .iter()
            .filter(|t| matches!(&t.role, Role::Param(n) if table.get(n).is_none()))
            .map(|t| t.entry.key.as_str())
            .collect();
        if !unknown.is_empty() {
            bail!(
                "{p}: {} tensor(s) that fugu's GPT-2 model does not have: {}",
                unknown.len(),
                list(&unknown)
            );
        }
        let mut pairs = Vec::with_capacity(table.specs().len());
        let mut missing = Vec::new();
        for s in table.specs() {
            match self.entry(&s.name) {
                Some((_, t)) => pairs.push((s, t)),
                None => missing.push(s.name.as_str()),
            }
        }
        if !missing.is_empty() {
            bail!(
                "{p}: {} tensor(s) missing: {} (looked for names with and without `{KEY_PREFIX}`)",
                missing.len(),
                list(&missing)
            );
        }
        Ok(pairs)
    }

    /// Copies the weights into `params` (laid out by `table`, which must be the table of
    /// `self.config`): [`Self::check`], then [`Self::read_tensor`] for every table tensor. A
    /// read error midway leaves `params` partly written.
    pub fn copy_into(&self, table: &Table, params: &mut [f32]) -> Result<()> {
        check_len("parameter", params, table)?;
        self.check(table)?;
        for s in table.specs() {
            self.read_tensor(table, &s.name, &mut params[s.range()])?;
        }
        Ok(())
    }

    /// Checks the stored tensors against `table` (the table of `self.config`) before anything
    /// is read: every table tensor must be stored with its shape (`wte.weight` unpadded), and
    /// every stored tensor must be a table tensor, a causal-mask buffer or an
    /// `lm_head.weight` of `wte`'s shape.
    pub fn check(&self, table: &Table) -> Result<()> {
        let vocab = self.config.vocab_size;
        check_vocab(table, vocab, &self.path().with_file_name(CONFIG_FILE))?;
        let pairs = self.pair(table)?;
        for (s, t) in &pairs {
            check_shape(self.header(t), &t.entry, s, vocab)?;
        }
        if let (Some(t), Some(w)) = (self.tied(), table.get("wte.weight")) {
            check_shape(self.header(t), &t.entry, w, vocab)?;
        }
        Ok(())
    }

    /// Reads the table tensor `name` into `out` (its length in `table`; after
    /// [`Self::check`]): only that tensor's bytes are read. The padding rows of `wte` are
    /// zeroed, and a stored `lm_head.weight` must equal `wte.weight` (fugu ties the two).
    pub fn read_tensor(&self, table: &Table, name: &str, out: &mut [f32]) -> Result<()> {
        let spec = table
            .get(name)
            .ok_or_else(|| anyhow!("internal: {name} is not a table tensor"))?;
        let (_, t) = self
            .entry(name)
            .ok_or_else(|| anyhow!("{}: tensor `{name}` missing", self.path().display()))?;
        let vocab = self.config.vocab_size;
        let mut files = ShardFiles::new(&self.shards);
        read_into(
            files.get(t.shard)?,
            self.header(t),
            &t.entry,
            spec,
            vocab,
            out,
        )?;
        if let (Some(t), "wte.weight") = (self.tied(), name) {
            let mut head = vec![0f32; t.entry.numel()];
            st::read_f32(files.get(t.shard)?, self.header(t), &t.entry, &mut head)?;
            if head
                .iter()
                .zip(out.iter())
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                bail!(
                    "{}: `{}` differs from `wte.weight`, but fugu ties the two (tie_word_embeddings)",
                    self.header(t).path.display(),
                    t.entry.key
                );
            }
        }
        Ok(())
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` in this model's own layout (key
    /// prefix, dtypes, metadata, tensor order, buffers) with the weights from `params`. If the
    /// weights and config are unchanged since loading, both files are byte-identical to the
    /// originals. If `self.config` was changed, `config.json` is the original with the size
    /// fields replaced; if the tensor shapes changed or the model was sharded, the file is
    /// laid out afresh as one `model.safetensors` (sorted like `save_pretrained`, dtypes kept
    /// by name, new tensors F32, buffers dropped).
    pub fn save(&self, dir: &Path, table: &Table, params: &[f32]) -> Result<()> {
        check_len("parameter", params, table)?;
        let vocab = self.config.vocab_size;
        check_vocab(table, vocab, &dir.join(CONFIG_FILE))?;
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let wte = table.get("wte.weight");
        let wte_data = |n: usize| wte.map(|w| &params[w.offset..w.offset + n]);
        let same_layout = self.shards.len() == 1
            && self.pair(table).is_ok_and(|pairs| {
                pairs
                    .iter()
                    .all(|(s, t)| check_shape(self.header(t), &t.entry, s, vocab).is_ok())
            })
            && self.tied().is_none_or(|t| {
                wte.is_some_and(|w| check_shape(self.header(t), &t.entry, w, vocab).is_ok())
            });
        let (header, tensors) = if same_layout {
            let mut tensors = Vec::with_capacity(self.tensors.len());
            for (i, t) in self.tensors.iter().enumerate() {
                let e = &t.entry;
                let data = match &t.role {
                    Role::Param(n) => {
                        let s = table.get(n).expect("paired above");
                        Data::F32(&params[s.offset..s.offset + e.numel()])
                    }
                    Role::Tied => Data::F32(wte_data(e.numel()).expect("checked above")),
                    Role::Buffer => Data::Raw(&self.buffers[&i]),
                };
                tensors.push(OutTensor {
                    key: e.key.clone(),
                    dtype: e.dtype,
                    shape: e.shape.clone(),
                    data,
                });
            }
            (self.shards[0].raw.clone(), tensors)
        } else {
            let prefix = self.key_prefix();
            let mut tensors: Vec<OutTensor> = table
                .specs()
                .iter()
                .map(|s| {
                    let shape = file_shape(s, vocab);
                    let n = shape.iter().product::<usize>();
                    OutTensor {
                        key: format!("{prefix}{}", s.name),
                        dtype: self
                            .dtype(&s.name)
                            .filter(|d| d.is_float())
                            .unwrap_or(Dtype::F32),
                        shape,
                        data: Data::F32(&params[s.offset..s.offset + n]),
                    }
                })
                .collect();
            if let (Some(t), Some(w)) = (self.tied(), wte) {
                let shape = file_shape(w, vocab);
                let n = shape.iter().product();
                tensors.push(OutTensor {
                    key: t.entry.key.clone(),
                    dtype: t.entry.dtype,
                    shape,
                    data: Data::F32(wte_data(n).expect("wte present")),
                });
            }
            st::sort_tensors(&mut tensors);
            let meta = self.metadata().cloned().unwrap_or_else(pt_metadata);
            (st::build_header(Some(&meta), &tensors), tensors)
        };
        atomic::write_file(&dir.join(MODEL_FILE), |w| {
            st::write_body(w, &header, &tensors)
        })?;
        let origin = self.path().with_file_name(CONFIG_FILE);
        let text = if parse_hf_config(&self.config_text, &origin)? == self.config {
            self.config_text.clone()
        } else {
            let mut v: Value = serde_json::from_str(&self.config_text)?;
            let c = &self.config;
            let obj = v.as_object_mut().expect("checked when loaded");
            for (k, x) in [
                ("vocab_size", c.vocab_size),
                ("n_positions", c.n_positions),
                ("n_embd", c.n_embd),
                ("n_head", c.n_head),
                ("n_layer", c.n_layer),
            ] {
                obj.insert(k.into(), x.into());
            }
            if obj.contains_key("n_ctx") {
                obj.insert("n_ctx".into(), c.n_positions.into());
            }
            json_text(&v)
        };
        atomic::write_bytes(&dir.join(CONFIG_FILE), text.as_bytes())
    }
}

fn pt_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([("format".to_string(), "pt".to_string())])
}

/// Up to 8 names, then a count.
pub(crate) fn list(names: &[&str]) -> String {
    let mut s = names
        .iter()
        .take(8)
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > 8 {
        s.push_str(&format!(" and {} more", names.len() - 8));
    }
    s
}

/// Writes `dir/config.json`, `dir/generation_config.json` and `dir/model.safetensors` in the
/// layout `transformers` `save_pretrained` uses for `GPT2LMHeadModel` (see the module docs). `table` must be the full
/// table of `cfg`. Each file is written atomically.
pub fn save_model(dir: &Path, cfg: &ModelConfig, table: &Table, params: &[f32]) -> Result<()> {
    check_full_table(cfg, table)?;
    check_len("parameter", params, table)?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tensors: Vec<OutTensor> = table
        .specs()
        .iter()
        .map(|s| {
            let shape = file_shape(s, cfg.vocab_size);
            let n = shape.iter().product::<usize>();
            OutTensor {
                key: format!("{KEY_PREFIX}{}", s.name),
                dtype: Dtype::F32,
                shape,
                data: Data::F32(&params[s.offset..s.offset + n]),
            }
        })
        .collect();
    st::sort_tensors(&mut tensors);
    let header = st::build_header(Some(&pt_metadata()), &tensors);
    atomic::write_file(&dir.join(MODEL_FILE), |w| {
        st::write_body(w, &header, &tensors)
    })?;
    write_model_config(dir, cfg)
}

/// Writes `dir/config.json` and `dir/generation_config.json` for `cfg` (atomically), as
/// [`save_model`] does beside the weights.
pub fn write_model_config(dir: &Path, cfg: &ModelConfig) -> Result<()> {
    atomic::write_bytes(
        &dir.join(CONFIG_FILE),
        json_text(&hf_config_json(cfg)).as_bytes(),
    )?;
    atomic::write_bytes(
        &dir.join(GENERATION_CONFIG_FILE),
        json_text(&generation_config_json(cfg)).as_bytes(),
    )
}

#[cfg(test)]
#[path = "hf_tests.rs"]
mod tests;

//! Hugging Face model directories: `config.json` and `model.safetensors` (or shards with an
//! index).
//!
//! fugu writes what `transformers` `save_pretrained` writes for the architecture's
//! `...ForCausalLM`: each table tensor under its file key (the architecture's
//! [`HfLayout`]: for GPT-2 `transformer.<name>`, `transformer.h.0.attn.c_attn.weight`), F32,
//! in the table's layout (GPT-2's Conv1D weights as (in, out)), the vocabulary tensors with
//! `vocab_size` rows (the model's padding rows are not stored), no tied head, metadata
//! `{"format": "pt"}`, tensors ordered by name. It reads that, files without the key prefix
//! (the original hub `gpt2` files), the buffers old files carry (ignored, written back), and
//! F16/BF16 tensors.

use super::st::{self, Data, Dtype, Entry, Header, OutTensor};
use crate::atomic_write as atomic;
use crate::model::hf_layout::HfLayout;
use crate::model::registry;
use crate::model::table::{padded_vocab, Table, TensorSpec};
use crate::model::{Arch, ModelConfig, SpecialIds};
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
/// The Hugging Face `config.json` of the model `cfg` names, as fugu trains it (its
/// architecture writes it: [`crate::model::registry::hf_config_json`]). Keys are sorted, like
/// `save_pretrained` writes them.
pub fn hf_config_json(cfg: &ModelConfig) -> Value {
    registry::hf_config_json(cfg)
}

/// `generation_config.json`: the beginning- and end-of-text ids, and the end of text as
/// padding, so that `generate` and `pipeline("text-generation")` stop at it and do not warn.
pub fn generation_config_json(ids: SpecialIds) -> Value {
    json!({
        "_from_model_config": true,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.eos,
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

/// The dropout probabilities `dir/config.json` sets above zero (`resid_pdrop`, `embd_pdrop`,
/// `attn_pdrop`, `attention_dropout`, `hidden_dropout`, ...): fugu trains without dropout, so a
/// run starting from such a model says so instead of dropping them in silence.
pub fn dropout_settings(dir: &Path) -> Vec<(String, f64)> {
    let Ok(text) = fs::read_to_string(dir.join(CONFIG_FILE)) else {
        return Vec::new();
    };
    let Ok(Value::Object(obj)) = serde_json::from_str::<Value>(&text) else {
        return Vec::new();
    };
    obj.iter()
        .filter(|(k, _)| k.ends_with("pdrop") || k.ends_with("dropout"))
        .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
        .filter(|(_, p)| *p > 0.0)
        .collect()
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
            "the parameter table is not the full {} table of the model config {cfg:?} \
             (a tensor-parallel shard or another model's table?)",
            registry::hf_layout(cfg).title
        );
    }
    Ok(())
}

/// Checks that the table's vocabulary tensors (`wte.weight`) have the padded vocabulary of
/// `vocab` as rows.
pub(crate) fn check_vocab(
    layout: &HfLayout,
    table: &Table,
    vocab: usize,
    origin: &Path,
) -> Result<()> {
    for w in layout.vocab_rows.iter().filter_map(|n| table.get(n)) {
        if w.shape.first() != Some(&padded_vocab(vocab)) {
            bail!(
                "{}: vocab_size {vocab} pads to {} rows, but the table's {} has shape {:?}",
                origin.display(),
                padded_vocab(vocab),
                w.name,
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

/// Reads the file tensor `e` into `dst`, the elements of a table tensor whose file shape is
/// `want` ([`HfLayout::file_shape`]): checks the shape and zeroes the padding rows.
pub(crate) fn read_into(
    f: &mut File,
    h: &Header,
    e: &Entry,
    want: Vec<usize>,
    dst: &mut [f32],
) -> Result<()> {
    check_shape(h, e, want)?;
    let n = e.numel();
    st::read_f32(f, h, e, &mut dst[..n])?;
    dst[n..].fill(0.0);
    Ok(())
}

/// Checks that the file tensor `e` is a float tensor of shape `want`.
pub(crate) fn check_shape(h: &Header, e: &Entry, want: Vec<usize>) -> Result<()> {
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

#[derive(Clone, Debug, PartialEq, Eq)]
enum Role {
    /// A parameter, by table name.
    Param(String),
    /// A tied head (GPT-2's `lm_head.weight`): must equal the tensor it is tied to
    /// (`wte.weight`); rewritten from it.
    Tied,
    /// A buffer (GPT-2's attention masks): ignored, written back as it was.
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

/// A Hugging Face model directory as loaded, remembering how it was stored (key prefix, dtype
/// of each tensor, metadata, tensor order, the original `config.json` text and the ignored
/// buffers) so that [`HfModel::save`] of unchanged weights writes identical files.
#[derive(Clone, Debug)]
pub struct HfModel {
    /// The model, from `config.json`.
    pub config: ModelConfig,
    config_text: String,
    /// How the architecture names its tensors in files.
    layout: HfLayout,
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
    let layout = registry::hf_layout(&config);
    let (source, shards) = read_weights(dir)?;
    let mut tensors = Vec::new();
    let mut seen: HashMap<&str, &Path> = HashMap::new();
    for (si, h) in shards.iter().enumerate() {
        for e in &h.entries {
            let name = layout.strip(&e.key);
            if let Some(other) = seen.insert(name, &h.path) {
                bail!(
                    "{}: tensor `{name}` is stored twice (also in {})",
                    h.path.display(),
                    other.display()
                );
            }
            let role = if layout.tied_head.is_some_and(|t| t.file_name == name) {
                Role::Tied
            } else if (layout.is_buffer)(name) {
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
        layout,
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

/// [`load_hf`] + [`HfModel::copy_into`]: loads the weights of a Hugging Face model directory
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

    /// The architecture's key prefix (GPT-2's `"transformer."`) or `""`: how the file names
    /// its tensors (as it names the token embedding).
    pub fn key_prefix(&self) -> &'static str {
        let l = &self.layout;
        let embedding = self
            .tensors
            .iter()
            .find(|t| l.strip(&t.entry.key) == l.embedding());
        match embedding {
            Some(t) if t.entry.key.starts_with(l.key_prefix) => l.key_prefix,
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

    /// Keys that are not parameters: buffers and a tied head.
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
                "{p}: {} tensor(s) that fugu's {} model does not have: {}",
                unknown.len(),
                self.layout.title,
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
            let prefix = self.layout.key_prefix;
            let looked = if prefix.is_empty() {
                String::new()
            } else {
                format!(" (looked for names with and without `{prefix}`)")
            };
            bail!(
                "{p}: {} tensor(s) missing: {}{looked}",
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
    /// is read: every table tensor must be stored with its shape (the vocabulary tensors
    /// unpadded), and every stored tensor must be a table tensor, a buffer or a tied head of
    /// its source's shape.
    pub fn check(&self, table: &Table) -> Result<()> {
        let vocab = self.config.vocab_size;
        let l = &self.layout;
        check_vocab(l, table, vocab, &self.path().with_file_name(CONFIG_FILE))?;
        let pairs = self.pair(table)?;
        for (s, t) in &pairs {
            check_shape(self.header(t), &t.entry, l.file_shape(s, vocab))?;
        }
        if let (Some(t), Some(w)) = (self.tied(), l.tied_source(table)) {
            check_shape(self.header(t), &t.entry, l.file_shape(w, vocab))?;
        }
        Ok(())
    }

    /// True when the stored tensor `t` has the file shape of table tensor `spec`.
    fn same_shape(&self, t: &Stored, spec: &TensorSpec) -> bool {
        let want = self.layout.file_shape(spec, self.config.vocab_size);
        check_shape(self.header(t), &t.entry, want).is_ok()
    }

    /// Reads the table tensor `name` into `out` (its length in `table`; after
    /// [`Self::check`]): only that tensor's bytes are read. The padding rows of the vocabulary
    /// tensors are zeroed, and a stored tied head (`lm_head.weight`) must equal its source
    /// (`wte.weight`).
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
            self.layout.file_shape(spec, vocab),
            out,
        )?;
        let tied_to = self.layout.tied_head.map(|h| h.table_name);
        if let (Some(t), true) = (self.tied(), tied_to == Some(name)) {
            let mut head = vec![0f32; t.entry.numel()];
            st::read_f32(files.get(t.shard)?, self.header(t), &t.entry, &mut head)?;
            if head
                .iter()
                .zip(out.iter())
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                bail!(
                    "{}: `{}` differs from `{name}`, but fugu ties the two (tie_word_embeddings)",
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
        let l = &self.layout;
        check_vocab(l, table, vocab, &dir.join(CONFIG_FILE))?;
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let tied_source = l.tied_source(table);
        let tied_data = |n: usize| tied_source.map(|w| &params[w.offset..w.offset + n]);
        let same_layout = self.shards.len() == 1
            && self
                .pair(table)
                .is_ok_and(|pairs| pairs.iter().all(|(s, t)| self.same_shape(t, s)))
            && self
                .tied()
                .is_none_or(|t| tied_source.is_some_and(|w| self.same_shape(t, w)));
        let (header, tensors) = if same_layout {
            let mut tensors = Vec::with_capacity(self.tensors.len());
            for (i, t) in self.tensors.iter().enumerate() {
                let e = &t.entry;
                let data = match &t.role {
                    Role::Param(n) => {
                        let s = table.get(n).expect("paired above");
                        Data::F32(&params[s.offset..s.offset + e.numel()])
                    }
                    Role::Tied => Data::F32(tied_data(e.numel()).expect("checked above")),
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
                    let shape = l.file_shape(s, vocab);
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
            if let (Some(t), Some(w)) = (self.tied(), tied_source) {
                let shape = l.file_shape(w, vocab);
                let n = shape.iter().product();
                tensors.push(OutTensor {
                    key: t.entry.key.clone(),
                    dtype: t.entry.dtype,
                    shape,
                    data: Data::F32(tied_data(n).expect("tied source present")),
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
            let obj = v.as_object_mut().expect("checked when loaded");
            registry::update_hf_config(obj, &self.config);
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
/// layout `transformers` `save_pretrained` uses for the architecture (see the module docs).
/// `table` must be the full table of `cfg`. Each file is written atomically.
pub fn save_model(dir: &Path, cfg: &ModelConfig, table: &Table, params: &[f32]) -> Result<()> {
    check_full_table(cfg, table)?;
    check_len("parameter", params, table)?;
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let layout = registry::hf_layout(cfg);
    let mut tensors: Vec<OutTensor> = table
        .specs()
        .iter()
        .map(|s| {
            let shape = layout.file_shape(s, cfg.vocab_size);
            let n = shape.iter().product::<usize>();
            OutTensor {
                key: layout.key(&s.name),
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
    write_model_config(dir, cfg, cfg.special_ids())
}

/// Writes `dir/config.json` and `dir/generation_config.json` for `cfg` (atomically) naming the
/// special token ids `ids` (the tokenizer's), as [`save_model`] does beside the weights.
pub fn write_model_config(dir: &Path, cfg: &ModelConfig, ids: SpecialIds) -> Result<()> {
    let mut config = hf_config_json(cfg);
    config["bos_token_id"] = ids.bos.into();
    config["eos_token_id"] = ids.eos.into();
    atomic::write_bytes(&dir.join(CONFIG_FILE), json_text(&config).as_bytes())?;
    atomic::write_bytes(
        &dir.join(GENERATION_CONFIG_FILE),
        json_text(&generation_config_json(ids)).as_bytes(),
    )
}

#[cfg(test)]
#[path = "hf_tests.rs"]
mod tests;

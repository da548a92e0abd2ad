//! Hugging Face GPT-2 directories: `config.json` (a `GPT2Config`) and `model.safetensors`.
//!
//! fugu writes what `transformers` `save_pretrained` writes for a `GPT2LMHeadModel`: keys
//! `transformer.<name>` with `<name>` the table's name (`transformer.h.0.attn.c_attn.weight`),
//! F32, Conv1D weights as (in, out), `wte.weight` with `vocab_size` rows (the model's padding
//! rows are not stored), no `lm_head.weight` (tied to `wte`), metadata `{"format": "pt"}`,
//! tensors ordered by name. It reads that, the unprefixed layout of the original hub `gpt2`
//! files (whose `h.N.attn.bias` / `h.N.attn.masked_bias` causal-mask buffers are ignored), and
//! F16/BF16 tensors.

use super::atomic;
use super::st::{self, Data, Dtype, Entry, Header, OutTensor};
use crate::config::ModelConfig;
use crate::model::table::{gpt2_params, padded_vocab, Table, TensorSpec};
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::path::{Path, PathBuf};

/// The weights file of a Hugging Face model directory.
pub const MODEL_FILE: &str = "model.safetensors";
/// The `GPT2Config` file of a Hugging Face model directory.
pub const CONFIG_FILE: &str = "config.json";
/// The key prefix `transformers` gives the body of `GPT2LMHeadModel`.
pub const KEY_PREFIX: &str = "transformer.";

/// The `config.json` of a `GPT2LMHeadModel` for `cfg`, as fugu trains it (no dropout, tied
/// embeddings, tanh GELU). Keys are sorted, like `save_pretrained` writes them.
///
/// `bos_token_id` / `eos_token_id` are GPT-2's `<|endoftext|>` (50256) when the vocabulary
/// contains it, else the last token.
pub fn hf_config_json(cfg: &ModelConfig) -> Value {
    let eot = 50256.min(cfg.vocab_size.saturating_sub(1));
    json!({
        "activation_function": "gelu_new",
        "add_cross_attention": false,
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.0,
        "bos_token_id": eot,
        "dtype": "float32",
        "embd_pdrop": 0.0,
        "eos_token_id": eot,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-5,
        "model_type": "gpt2",
        "n_ctx": cfg.n_positions,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "n_inner": null,
        "n_layer": cfg.n_layer,
        "n_positions": cfg.n_positions,
        "reorder_and_upcast_attn": false,
        "resid_pdrop": 0.0,
        "scale_attn_by_inverse_layer_idx": false,
        "scale_attn_weights": true,
        "tie_word_embeddings": true,
        "use_cache": true,
        "vocab_size": cfg.vocab_size,
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
    let field = |k: &str| obj.get(k);
    let int = |k: &str, default: usize| -> Result<usize> {
        match field(k) {
            None => Ok(default),
            Some(x) => match x.as_u64() {
                Some(n) if n > 0 && n <= u32::MAX as u64 => Ok(n as usize),
                _ => bail!("{p}: field `{k}` = {x}: expected a positive integer"),
            },
        }
    };
    let flag = |k: &str, default: bool, supported: bool| -> Result<()> {
        let b = match field(k) {
            None => default,
            Some(x) => x
                .as_bool()
                .ok_or_else(|| anyhow!("{p}: field `{k}` = {x}: expected true or false"))?,
        };
        if b != supported {
            bail!("{p}: field `{k}` = {b} is not supported by fugu (only {supported})");
        }
        Ok(())
    };
    if let Some(t) = field("model_type") {
        if t.as_str() != Some("gpt2") {
            bail!("{p}: field `model_type` = {t}: only \"gpt2\" is supported");
        }
    }
    let cfg = ModelConfig {
        vocab_size: int("vocab_size", 50257)?,
        n_positions: int("n_positions", 1024)?,
        n_embd: int("n_embd", 768)?,
        n_head: int("n_head", 12)?,
        n_layer: int("n_layer", 12)?,
    };
    if !cfg.n_embd.is_multiple_of(cfg.n_head) {
        bail!(
            "{p}: field `n_embd` = {} is not divisible by `n_head` = {}",
            cfg.n_embd,
            cfg.n_head
        );
    }
    match field("activation_function") {
        None => {}
        Some(Value::String(s)) if s == "gelu_new" || s == "gelu_pytorch_tanh" => {}
        Some(x) => bail!(
            "{p}: field `activation_function` = {x} is not supported by fugu (only \"gelu_new\" or \"gelu_pytorch_tanh\")"
        ),
    }
    match field("n_inner") {
        None | Some(Value::Null) => {}
        Some(x) if x.as_u64() == Some(4 * cfg.n_embd as u64) => {}
        Some(x) => bail!(
            "{p}: field `n_inner` = {x} is not supported by fugu (only null or 4 * n_embd = {})",
            4 * cfg.n_embd
        ),
    }
    if let Some(x) = field("layer_norm_epsilon") {
        match x.as_f64() {
            Some(e) if (e - 1e-5).abs() <= 1e-12 => {}
            _ => {
                bail!("{p}: field `layer_norm_epsilon` = {x} is not supported by fugu (only 1e-5)")
            }
        }
    }
    flag("scale_attn_weights", true, true)?;
    flag("scale_attn_by_inverse_layer_idx", false, false)?;
    flag("reorder_and_upcast_attn", false, false)?;
    flag("tie_word_embeddings", true, true)?;
    flag("add_cross_attention", false, false)?;
    Ok(cfg)
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

/// Checks that `table` is the whole (tensor-parallel degree 1) GPT-2 table of `cfg`.
pub(crate) fn check_full_table(cfg: &ModelConfig, table: &Table) -> Result<()> {
    let want = gpt2_params(cfg, 1)?;
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

/// Reads the file tensor `e` into the table tensor `spec` of `out`: checks the shape against
/// [`file_shape`] and zeroes the padding rows.
pub(crate) fn read_into(
    f: &mut File,
    h: &Header,
    e: &Entry,
    spec: &TensorSpec,
    vocab: usize,
    out: &mut [f32],
) -> Result<()> {
    check_shape(h, e, spec, vocab)?;
    let dst = &mut out[spec.range()];
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

/// A Hugging Face GPT-2 directory as loaded, remembering how it was stored (key prefix, dtype
/// of each tensor, metadata, tensor order, the original `config.json` text and the ignored
/// buffers) so that [`HfModel::save`] of unchanged weights writes identical files.
#[derive(Clone, Debug)]
pub struct HfModel {
    /// The model, from `config.json`.
    pub config: ModelConfig,
    config_text: String,
    header: Header,
    roles: Vec<Role>,
    buffers: HashMap<usize, Vec<u8>>,
}

/// Loads `dir/config.json` and the header of `dir/model.safetensors` (the weights are read by
/// [`HfModel::copy_into`]). The header and file size are checked here.
pub fn load_hf(dir: &Path) -> Result<HfModel> {
    let cpath = dir.join(CONFIG_FILE);
    let config_text =
        fs::read_to_string(&cpath).with_context(|| format!("reading {}", cpath.display()))?;
    let config = parse_hf_config(&config_text, &cpath)?;
    let mpath = dir.join(MODEL_FILE);
    if !mpath.exists() && dir.join("model.safetensors.index.json").exists() {
        bail!(
            "{}: sharded checkpoints (model.safetensors.index.json) are not supported",
            dir.display()
        );
    }
    let header = st::read_header(&mpath)?;
    let mut roles = Vec::with_capacity(header.entries.len());
    let mut seen: HashMap<&str, &str> = HashMap::new();
    for e in &header.entries {
        let name = strip(&e.key);
        if let Some(other) = seen.insert(name, &e.key) {
            bail!(
                "{}: tensor `{name}` is stored twice (as `{other}` and `{}`)",
                mpath.display(),
                e.key
            );
        }
        roles.push(if name == "lm_head.weight" {
            Role::Tied
        } else if is_buffer(name) {
            Role::Buffer
        } else {
            Role::Param(name.to_string())
        });
    }
    let mut buffers = HashMap::new();
    if roles.contains(&Role::Buffer) {
        let mut f = File::open(&mpath).with_context(|| format!("opening {}", mpath.display()))?;
        for (i, e) in header.entries.iter().enumerate() {
            if roles[i] == Role::Buffer {
                buffers.insert(i, st::read_raw(&mut f, &header, e)?);
            }
        }
    }
    Ok(HfModel {
        config,
        config_text,
        header,
        roles,
        buffers,
    })
}

/// [`load_hf`] + [`HfModel::copy_into`]: loads the weights of a Hugging Face GPT-2 directory
/// into `params` (laid out by `table`) and returns its config.
pub fn load_model(dir: &Path, table: &Table, params: &mut [f32]) -> Result<ModelConfig> {
    let m = load_hf(dir)?;
    m.copy_into(table, params)?;
    Ok(m.config)
}

impl HfModel {
    /// The `model.safetensors` this was loaded from.
    pub fn path(&self) -> &Path {
        &self.header.path
    }

    /// `"transformer."` or `""`: how the file names its tensors.
    pub fn key_prefix(&self) -> &str {
        let wte = self
            .header
            .entries
            .iter()
            .find(|e| strip(&e.key) == "wte.weight");
        match wte {
            Some(e) if e.key.starts_with(KEY_PREFIX) => KEY_PREFIX,
            _ => "",
        }
    }

    /// The stored dtype of the table tensor `name` (e.g. `h.0.ln_1.weight`).
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.entry(name).map(|(_, e)| e.dtype)
    }

    /// The file's `__metadata__`.
    pub fn metadata(&self) -> Option<&BTreeMap<String, String>> {
        self.header.metadata.as_ref()
    }

    /// Keys that are not parameters: causal-mask buffers and a tied `lm_head.weight`.
    pub fn ignored_tensors(&self) -> Vec<&str> {
        self.header
            .entries
            .iter()
            .zip(&self.roles)
            .filter(|(_, r)| !matches!(r, Role::Param(_)))
            .map(|(e, _)| e.key.as_str())
            .collect()
    }

    fn entry(&self, name: &str) -> Option<(usize, &Entry)> {
        self.roles
            .iter()
            .position(|r| matches!(r, Role::Param(n) if n == name))
            .map(|i| (i, &self.header.entries[i]))
    }

    fn tied(&self) -> Option<&Entry> {
        self.roles
            .iter()
            .position(|r| *r == Role::Tied)
            .map(|i| &self.header.entries[i])
    }

    /// Table tensors paired with their file entries; errors for unknown and missing tensors.
    fn pair<'a>(&'a self, table: &'a Table) -> Result<Vec<(&'a TensorSpec, &'a Entry)>> {
        let p = self.path().display();
        let unknown: Vec<&str> = self
            .roles
            .iter()
            .zip(&self.header.entries)
            .filter(|(r, _)| matches!(r, Role::Param(n) if table.get(n).is_none()))
            .map(|(_, e)| e.key.as_str())
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
                Some((_, e)) => pairs.push((s, e)),
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
    /// `self.config`): every table tensor must be in the file with its shape (`wte.weight`
    /// unpadded), and every file tensor must be a table tensor, a causal-mask buffer or an
    /// `lm_head.weight` equal to `wte.weight`. The padding rows of `wte` are zeroed. Shapes
    /// and names are checked before anything is written; a read error midway leaves `params`
    /// partly written.
    pub fn copy_into(&self, table: &Table, params: &mut [f32]) -> Result<()> {
        check_len("parameter", params, table)?;
        let vocab = self.config.vocab_size;
        check_vocab(table, vocab, &self.path().with_file_name(CONFIG_FILE))?;
        let pairs = self.pair(table)?;
        for (s, e) in &pairs {
            check_shape(&self.header, e, s, vocab)?;
        }
        let tied = self.tied();
        let wte = table.get("wte.weight");
        if let (Some(t), Some(w)) = (tied, wte) {
            check_shape(&self.header, t, w, vocab)?;
        }
        let p = self.path();
        let mut f = File::open(p).with_context(|| format!("opening {}", p.display()))?;
        for (s, e) in pairs {
            read_into(&mut f, &self.header, e, s, vocab, params)?;
        }
        if let (Some(t), Some(w)) = (tied, wte) {
            let mut head = vec![0f32; t.numel()];
            st::read_f32(&mut f, &self.header, t, &mut head)?;
            let emb = &params[w.offset..w.offset + head.len()];
            if head
                .iter()
                .zip(emb)
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                bail!(
                    "{}: `{}` differs from `wte.weight`, but fugu ties the two (tie_word_embeddings)",
                    p.display(),
                    t.key
                );
            }
        }
        Ok(())
    }

    /// Writes `dir/config.json` and `dir/model.safetensors` in this model's own layout (key
    /// prefix, dtypes, metadata, tensor order, buffers) with the weights from `params`. If the
    /// weights and config are unchanged since loading, both files are byte-identical to the
    /// originals. If `self.config` was changed, `config.json` is the original with the size
    /// fields replaced; if the tensor shapes changed, the file is laid out afresh (sorted like
    /// `save_pretrained`, dtypes kept by name, new tensors F32, buffers dropped).
    pub fn save(&self, dir: &Path, table: &Table, params: &[f32]) -> Result<()> {
        check_len("parameter", params, table)?;
        let vocab = self.config.vocab_size;
        check_vocab(table, vocab, &dir.join(CONFIG_FILE))?;
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let wte = table.get("wte.weight");
        let wte_data = |n: usize| wte.map(|w| &params[w.offset..w.offset + n]);
        let same_layout = self.pair(table).is_ok_and(|pairs| {
            pairs
                .iter()
                .all(|(s, e)| check_shape(&self.header, e, s, vocab).is_ok())
        }) && self
            .tied()
            .is_none_or(|t| wte.is_some_and(|w| check_shape(&self.header, t, w, vocab).is_ok()));
        let (header, tensors) = if same_layout {
            let mut tensors = Vec::with_capacity(self.roles.len());
            for (i, (e, r)) in self.header.entries.iter().zip(&self.roles).enumerate() {
                let data = match r {
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
            (self.header.raw.clone(), tensors)
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
                    key: t.key.clone(),
                    dtype: t.dtype,
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

/// Writes `dir/config.json` and `dir/model.safetensors` in the layout `transformers`
/// `save_pretrained` uses for `GPT2LMHeadModel` (see the module docs). `table` must be the full
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
    atomic::write_bytes(
        &dir.join(CONFIG_FILE),
        json_text(&hf_config_json(cfg)).as_bytes(),
    )
}

/// A directory for tests, removed when dropped.
#[cfg(test)]
pub(crate) struct TestDir(pub PathBuf);

#[cfg(test)]
impl TestDir {
    pub fn new(name: &str) -> TestDir {
        let d = std::env::temp_dir().join(format!("fugu-ckpt-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        TestDir(d)
    }
}

#[cfg(test)]
impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A tiny config (vocabulary 101 → 128 rows) and deterministic non-zero parameters.
#[cfg(test)]
pub(crate) fn tiny() -> (ModelConfig, Table, Vec<f32>) {
    let cfg = ModelConfig {
        vocab_size: 101,
        n_positions: 16,
        n_embd: 32,
        n_head: 4,
        n_layer: 2,
    };
    let table = gpt2_params(&cfg, 1).unwrap();
    let mut params = vec![0f32; table.total()];
    for s in table.specs() {
        let n = file_shape(s, cfg.vocab_size).iter().product::<usize>();
        for (i, x) in params[s.offset..s.offset + n].iter_mut().enumerate() {
            *x = ((s.offset + i) as f32 * 0.618).sin() * 0.1;
        }
    }
    (cfg, table, params)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    fn err<T: std::fmt::Debug>(r: Result<T>) -> String {
        format!("{:#}", r.unwrap_err())
    }

    #[test]
    fn save_load_round_trip_and_identical_resave() {
        let d = TestDir::new("hf-round-trip");
        let (cfg, table, params) = tiny();
        let a = d.0.join("a");
        save_model(&a, &cfg, &table, &params).unwrap();
        let m = load_hf(&a).unwrap();
        assert_eq!(m.config, cfg);
        assert_eq!(m.key_prefix(), KEY_PREFIX);
        assert_eq!(m.dtype("h.1.mlp.c_fc.weight"), Some(Dtype::F32));
        assert_eq!(
            m.metadata().unwrap().get("format").map(String::as_str),
            Some("pt")
        );
        let mut back = vec![f32::NAN; table.total()];
        m.copy_into(&table, &mut back).unwrap();
        for s in table.specs() {
            assert_eq!(back[s.range()], params[s.range()], "{}", s.name);
        }
        let wte = table.get("wte.weight").unwrap();
        assert!(back[wte.offset + 101 * 32..wte.offset + 128 * 32]
            .iter()
            .all(|&x| x == 0.0));
        let b = d.0.join("b");
        m.save(&b, &table, &back).unwrap();
        for f in [MODEL_FILE, CONFIG_FILE] {
            assert_eq!(
                fs::read(a.join(f)).unwrap(),
                fs::read(b.join(f)).unwrap(),
                "{f}"
            );
        }
        // wte is stored unpadded, lm_head is not stored, config.json is a GPT2Config.
        let h = st::read_header(&a.join(MODEL_FILE)).unwrap();
        assert_eq!(
            h.find("transformer.wte.weight").unwrap().shape,
            vec![101, 32]
        );
        assert!(h.entries.iter().all(|e| !e.key.contains("lm_head")));
        assert_eq!(h.entries.len(), table.specs().len());
        let v: Value = serde_json::from_slice(&fs::read(a.join(CONFIG_FILE)).unwrap()).unwrap();
        assert_eq!(v["architectures"][0], "GPT2LMHeadModel");
        assert_eq!(v["n_inner"], Value::Null);
        assert_eq!(v["tie_word_embeddings"], true);
        assert_eq!(v["eos_token_id"], 100);
    }

    #[test]
    fn hf_fixture_loads_and_saves_byte_identically() {
        let (cfg, table, _) = tiny();
        let d = TestDir::new("hf-fixture");
        let mut reference = None;
        for (name, prefix, dtype, ignored) in [
            ("hf-tiny", KEY_PREFIX, Dtype::F32, 0),
            ("hf-tiny-bf16", KEY_PREFIX, Dtype::Bf16, 0),
            ("hf-tiny-hub-f16", "", Dtype::F16, 4),
        ] {
            let dir = fixture(name);
            let m = load_hf(&dir).unwrap();
            assert_eq!(m.config, cfg, "{name}");
            assert_eq!(m.key_prefix(), prefix, "{name}");
            assert_eq!(m.dtype("wte.weight"), Some(dtype), "{name}");
            assert_eq!(m.ignored_tensors().len(), ignored, "{name}");
            let mut p = vec![f32::NAN; table.total()];
            m.copy_into(&table, &mut p).unwrap();
            let wte = table.get("wte.weight").unwrap();
            assert!(p[wte.offset + 101 * 32..wte.offset + 128 * 32]
                .iter()
                .all(|&x| x == 0.0));
            // LayerNorm weights are initialised to one, biases to zero.
            let ln = table.get("h.1.ln_2.weight").unwrap();
            assert!(p[ln.range()].iter().all(|&x| x == 1.0), "{name}");
            let out = d.0.join(name);
            m.save(&out, &table, &p).unwrap();
            for f in [MODEL_FILE, CONFIG_FILE] {
                assert_eq!(
                    fs::read(dir.join(f)).unwrap(),
                    fs::read(out.join(f)).unwrap(),
                    "{name}/{f} differs after load + save"
                );
            }
            // The low-precision variants hold the F32 fixture's weights rounded.
            match &reference {
                None => reference = Some(p),
                Some(r) => {
                    let tol = if dtype == Dtype::F16 { 1e-3 } else { 8e-3 };
                    for s in table.specs() {
                        for (a, b) in p[s.range()].iter().zip(&r[s.range()]) {
                            assert!(
                                (a - b).abs() <= tol * b.abs().max(0.01),
                                "{name} {}",
                                s.name
                            );
                        }
                    }
                }
            }
        }
        // fugu's own writer produces exactly what save_pretrained wrote.
        let out = d.0.join("fugu");
        save_model(&out, &cfg, &table, reference.as_ref().unwrap()).unwrap();
        assert_eq!(
            fs::read(fixture("hf-tiny").join(MODEL_FILE)).unwrap(),
            fs::read(out.join(MODEL_FILE)).unwrap(),
            "save_model differs from transformers' save_pretrained"
        );
        if let Some(dst) = std::env::var_os("FUGU_HF_EXPORT") {
            // For dev/make_hf_fixture.py --verify: a directory written by save_model.
            save_model(Path::new(&dst), &cfg, &table, reference.as_ref().unwrap()).unwrap();
        }
    }

    #[test]
    fn changed_config_and_layout() {
        let d = TestDir::new("hf-changed");
        let (cfg, table, params) = tiny();
        let m = load_hf(&fixture("hf-tiny-hub-f16")).unwrap();
        // Same layout, different weights: same header, F16 kept.
        let out = d.0.join("w");
        let mut p = params.clone();
        m.save(&out, &table, &p).unwrap();
        let m2 = load_hf(&out).unwrap();
        assert_eq!(m2.dtype("h.0.attn.c_attn.weight"), Some(Dtype::F16));
        assert_eq!(m2.ignored_tensors().len(), 4);
        m2.copy_into(&table, &mut p).unwrap();
        let s = table.get("h.0.attn.c_attn.weight").unwrap();
        assert!((p[s.offset + 5] - params[s.offset + 5]).abs() < 1e-4);
        // A bigger vocabulary: laid out afresh, prefix and dtypes kept, buffers dropped.
        let mut m3 = m.clone();
        m3.config.vocab_size = 200;
        let cfg3 = ModelConfig {
            vocab_size: 200,
            ..cfg
        };
        let t3 = gpt2_params(&cfg3, 1).unwrap();
        let p3 = vec![0.5f32; t3.total()];
        let out = d.0.join("v");
        m3.save(&out, &t3, &p3).unwrap();
        let m4 = load_hf(&out).unwrap();
        assert_eq!(m4.config, cfg3);
        assert_eq!(m4.key_prefix(), "");
        assert_eq!(m4.dtype("wte.weight"), Some(Dtype::F16));
        assert!(m4.ignored_tensors().is_empty());
        let mut back = vec![0f32; t3.total()];
        m4.copy_into(&t3, &mut back).unwrap();
        assert_eq!(back[t3.get("wte.weight").unwrap().offset + 199 * 32], 0.5);
    }

    #[test]
    fn tied_lm_head_is_checked_and_kept() {
        let d = TestDir::new("hf-tied");
        let (cfg, table, params) = tiny();
        let wte = table.get("wte.weight").unwrap();
        let n = 101 * 32;
        let write = |dir: &Path, head: &[f32]| {
            fs::create_dir_all(dir).unwrap();
            let mut t: Vec<OutTensor> = table
                .specs()
                .iter()
                .map(|s| {
                    let shape = file_shape(s, 101);
                    let k = shape.iter().product::<usize>();
                    OutTensor {
                        key: s.name.clone(),
                        dtype: Dtype::F32,
                        shape,
                        data: Data::F32(&params[s.offset..s.offset + k]),
                    }
                })
                .collect();
            t.push(OutTensor {
                key: "lm_head.weight".into(),
                dtype: Dtype::F32,
                shape: vec![101, 32],
                data: Data::F32(head),
            });
            let h = st::build_header(None, &t);
            let mut f = File::create(dir.join(MODEL_FILE)).unwrap();
            st::write_body(&mut f, &h, &t).unwrap();
            fs::write(dir.join(CONFIG_FILE), json_text(&hf_config_json(&cfg))).unwrap();
        };
        let same = d.0.join("same");
        write(&same, &params[wte.offset..wte.offset + n]);
        let m = load_hf(&same).unwrap();
        assert_eq!(m.ignored_tensors(), vec!["lm_head.weight"]);
        let mut p = vec![0f32; table.total()];
        m.copy_into(&table, &mut p).unwrap();
        let out = d.0.join("out");
        m.save(&out, &table, &p).unwrap();
        assert_eq!(
            fs::read(same.join(MODEL_FILE)).unwrap(),
            fs::read(out.join(MODEL_FILE)).unwrap()
        );
        let differs = d.0.join("differs");
        write(&differs, &vec![0.25; n]);
        let e = err(load_hf(&differs).unwrap().copy_into(&table, &mut p));
        assert!(
            e.contains("`lm_head.weight` differs from `wte.weight`"),
            "{e}"
        );
    }

    /// Writes the tiny model with `edit` applied to the tensor list.
    fn write_edited(dir: &Path, edit: impl FnOnce(&mut Vec<(String, Vec<usize>)>)) {
        let (cfg, table, _) = tiny();
        let mut list: Vec<(String, Vec<usize>)> = table
            .specs()
            .iter()
            .map(|s| (format!("{KEY_PREFIX}{}", s.name), file_shape(s, 101)))
            .collect();
        edit(&mut list);
        let data: Vec<Vec<f32>> = list
            .iter()
            .map(|(_, s)| vec![0.1; s.iter().product()])
            .collect();
        let t: Vec<OutTensor> = list
            .iter()
            .zip(&data)
            .map(|((k, s), x)| OutTensor {
                key: k.clone(),
                dtype: Dtype::F32,
                shape: s.clone(),
                data: Data::F32(x),
            })
            .collect();
        fs::create_dir_all(dir).unwrap();
        let h = st::build_header(Some(&pt_metadata()), &t);
        let mut f = File::create(dir.join(MODEL_FILE)).unwrap();
        st::write_body(&mut f, &h, &t).unwrap();
        fs::write(dir.join(CONFIG_FILE), json_text(&hf_config_json(&cfg))).unwrap();
    }

    #[test]
    fn missing_unknown_and_misshapen_tensors_are_named() {
        let d = TestDir::new("hf-errors");
        let (_, table, _) = tiny();
        let mut p = vec![0f32; table.total()];
        let load = |name: &str, edit: &dyn Fn(&mut Vec<(String, Vec<usize>)>)| {
            let dir = d.0.join(name);
            write_edited(&dir, edit);
            let r = load_hf(&dir).and_then(|m| m.copy_into(&table, &mut p.clone()));
            err(r)
        };
        let e = load("missing", &|l| {
            l.retain(|(k, _)| k != "transformer.h.1.mlp.c_fc.bias")
        });
        assert!(
            e.contains("missing: `h.1.mlp.c_fc.bias`") && e.contains(MODEL_FILE),
            "{e}"
        );
        let e = load("shape", &|l| l[4].1 = vec![32, 64]);
        let k = &l_key(4);
        assert!(
            e.contains(&format!("`{k}` has shape [32, 64], expected [32, 96]")),
            "{e}"
        );
        let e = load("vocab", &|l| l[0].1 = vec![100, 32]);
        assert!(
            e.contains("`transformer.wte.weight` has shape [100, 32], expected [101, 32]"),
            "{e}"
        );
        let e = load("unknown", &|l| {
            l.push(("transformer.h.2.ln_1.weight".into(), vec![32]));
            l.push(("score.weight".into(), vec![2, 32]));
        });
        assert!(
            e.contains("2 tensor(s) that fugu's GPT-2 model does not have")
                && e.contains("`transformer.h.2.ln_1.weight`")
                && e.contains("`score.weight`"),
            "{e}"
        );
        let e = load("dup", &|l| l.push(("wte.weight".into(), vec![101, 32])));
        assert!(e.contains("`wte.weight` is stored twice"), "{e}");
        // The right model loads, into a table of another model it does not.
        write_edited(&d.0.join("ok"), |_| {});
        load_hf(&d.0.join("ok"))
            .unwrap()
            .copy_into(&table, &mut p)
            .unwrap();
        let other = gpt2_params(
            &ModelConfig {
                vocab_size: 300,
                n_positions: 16,
                n_embd: 32,
                n_head: 4,
                n_layer: 2,
            },
            1,
        )
        .unwrap();
        let e = err(load_hf(&d.0.join("ok"))
            .unwrap()
            .copy_into(&other, &mut vec![0f32; other.total()]));
        assert!(e.contains("vocab_size 101 pads to 128 rows"), "{e}");
    }

    fn l_key(i: usize) -> String {
        let (_, table, _) = tiny();
        format!("{KEY_PREFIX}{}", table.specs()[i].name)
    }

    #[test]
    fn corrupt_and_truncated_files_fail_cleanly() {
        let d = TestDir::new("hf-corrupt");
        let good = d.0.join("good");
        let (cfg, table, params) = tiny();
        save_model(&good, &cfg, &table, &params).unwrap();
        let bytes = fs::read(good.join(MODEL_FILE)).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let mut huge = bytes.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut badjson = bytes.clone();
        badjson[8 + n / 2] = b'}';
        let mut badoff = bytes.clone();
        let h = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
        let h2 = h.replacen("\"data_offsets\":[0,", "\"data_offsets\":[4,", 1);
        badoff[8..8 + n].copy_from_slice(h2.as_bytes());
        let cases: Vec<(&str, Vec<u8>, &str)> = vec![
            ("empty", vec![], "shorter than the 8-byte header length"),
            ("short", bytes[..6].to_vec(), "shorter than the 8-byte"),
            ("header", bytes[..8 + n / 2].to_vec(), "header length"),
            (
                "data",
                bytes[..bytes.len() - 10].to_vec(),
                "truncated safetensors file",
            ),
            ("long", [&bytes[..], &[0u8; 4]].concat(), "the file holds"),
            ("huge", huge, "header length"),
            ("json", badjson, "corrupt safetensors header"),
            ("offsets", badoff, "data_offsets"),
        ];
        let mut p = vec![0f32; table.total()];
        for (name, b, want) in cases {
            let dir = d.0.join(name);
            fs::create_dir_all(&dir).unwrap();
            fs::copy(good.join(CONFIG_FILE), dir.join(CONFIG_FILE)).unwrap();
            fs::write(dir.join(MODEL_FILE), b).unwrap();
            let e = err(load_hf(&dir).and_then(|m| m.copy_into(&table, &mut p)));
            assert!(e.contains(want) && e.contains(MODEL_FILE), "{name}: {e}");
        }
        // Truncated after load_hf checked the size: the read fails, no panic.
        let dir = d.0.join("late");
        save_model(&dir, &cfg, &table, &params).unwrap();
        let m = load_hf(&dir).unwrap();
        fs::write(dir.join(MODEL_FILE), &bytes[..bytes.len() / 2]).unwrap();
        let e = err(m.copy_into(&table, &mut p));
        assert!(e.contains("file truncated?"), "{e}");
        let e = err(load_hf(&d.0.join("nothing-here")));
        assert!(e.contains(CONFIG_FILE), "{e}");
    }

    #[test]
    fn config_json_round_trip_and_rejections() {
        let (cfg, _, _) = tiny();
        let p = Path::new("x/config.json");
        let text = json_text(&hf_config_json(&cfg));
        assert_eq!(parse_hf_config(&text, p).unwrap(), cfg);
        // Fields transformers defaults may be missing; gelu_pytorch_tanh is the same GELU.
        let c = parse_hf_config(
            r#"{"model_type":"gpt2","activation_function":"gelu_pytorch_tanh","n_inner":3072}"#,
            p,
        )
        .unwrap();
        assert_eq!((c.vocab_size, c.n_embd, c.n_layer), (50257, 768, 12));
        let bad = |k: &str, v: Value, want: &str| {
            let mut j = hf_config_json(&cfg);
            j[k] = v;
            let e = err(parse_hf_config(&j.to_string(), p));
            assert!(
                e.contains("x/config.json") && e.contains(&format!("`{k}`")) && e.contains(want),
                "{k}: {e}"
            );
        };
        bad("activation_function", json!("relu"), "not supported");
        bad("n_inner", json!(100), "4 * n_embd = 128");
        bad(
            "scale_attn_by_inverse_layer_idx",
            json!(true),
            "not supported",
        );
        bad("reorder_and_upcast_attn", json!(true), "not supported");
        bad("tie_word_embeddings", json!(false), "not supported");
        bad("scale_attn_weights", json!(false), "not supported");
        bad("add_cross_attention", json!(true), "not supported");
        bad("layer_norm_epsilon", json!(1e-6), "only 1e-5");
        bad("model_type", json!("llama"), "only \"gpt2\"");
        bad("n_embd", json!("32"), "positive integer");
        bad("n_layer", json!(0), "positive integer");
        bad("n_head", json!(5), "not divisible");
        bad("tie_word_embeddings", json!("yes"), "true or false");
        let e = err(parse_hf_config("[1]", p));
        assert!(e.contains("JSON object"), "{e}");
        let e = err(parse_hf_config("{", p));
        assert!(e.contains("invalid JSON"), "{e}");
    }

    #[test]
    fn save_model_rejects_a_sharded_table() {
        let (cfg, _, _) = tiny();
        let t2 = gpt2_params(&cfg, 2).unwrap();
        let d = TestDir::new("hf-tp");
        let e = err(save_model(&d.0, &cfg, &t2, &vec![0f32; t2.total()]));
        assert!(e.contains("not the full GPT-2 table"), "{e}");
        let (_, t, _) = tiny();
        let e = err(save_model(&d.0, &cfg, &t, &[0f32; 10]));
        assert!(e.contains("parameter buffer holds 10 floats"), "{e}");
    }
}

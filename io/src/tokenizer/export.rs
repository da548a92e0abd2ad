//! The tokenizer files `transformers` and Python's `tokenizers` load from a
//! checkpoint directory, and GPT-2's `vocab.json`/`merges.txt` derived
//! offline from the tiktoken ranks.
//!
//! The derivation is the standard tiktoken -> Hugging Face conversion: token
//! strings are the token bytes through GPT-2's `bytes_to_unicode` table, and
//! the merge of the token of rank `r` is the pair of tokens that byte-level
//! BPE produces on its bytes using only the tokens of rank below `r` (always
//! exactly two, checked). Listing the merges by rank gives GPT-2's
//! `merges.txt`: 50000 merges, and 50257 tokens with `<|endoftext|>` = 50256.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{json, Value};
use tokenizers::models::bpe::{Vocab, BPE};

use super::hf::{add_eot, byte_level_pipeline, ByteEncoding, HfTokenizer, EOT_TOKEN};
use super::{Tokenizer, GPT2_EOT};
use crate::error::{Error, Result};

/// The files [`hf_tokenizer_files`] returns for a byte-level tokenizer, in
/// that order (a byte-fallback one has no `vocab.json` and `merges.txt`).
pub const HF_TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// GPT-2's reversible byte -> printable character table (`bytes_to_unicode`
/// in OpenAI's `encoder.py`): printable Latin-1 bytes map to themselves, the
/// others to U+0100 onwards in byte order (space is `Ġ`, newline `Ċ`).
pub fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        // Codes stay below 0x144: always valid scalar values.
        *slot = char::from_u32(code).unwrap_or('\u{fffd}');
    }
    table
}

fn to_symbols(bytes: &[u8], table: &[char; 256]) -> String {
    bytes.iter().map(|&b| table[b as usize]).collect()
}

/// A BPE vocabulary (token string by id) and its merges in rank order.
pub type VocabAndMerges = (Vec<String>, Vec<(String, String)>);

/// GPT-2's vocabulary (token string by id, 50257 entries, `<|endoftext|>`
/// last) and merges (50000 pairs in rank order), derived from the tiktoken
/// `r50k_base` ranks compiled into the binary. Takes ~0.1-0.5 s.
pub fn gpt2_vocab_and_merges() -> Result<VocabAndMerges> {
    derive_gpt2().map_err(|e| Error::Tokenizer(format!("deriving gpt2 vocab.json/merges.txt: {e}")))
}

fn derive_gpt2() -> std::result::Result<VocabAndMerges, String> {
    let bpe = tiktoken_rs::r50k_base_singleton();
    let mut tokens: Vec<Vec<u8>> = Vec::with_capacity(GPT2_EOT as usize);
    for r in 0..GPT2_EOT {
        tokens.push(
            bpe.decode_bytes(&[r])
                .map_err(|e| format!("rank {r}: {e}"))?,
        );
    }
    let ranks: HashMap<&[u8], u32> = tokens
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r as u32))
        .collect();
    if ranks.len() != tokens.len() {
        return Err("two ranks have the same bytes".into());
    }
    let table = bytes_to_unicode();
    // GPT-2's first 256 ids are the bytes in the order of their symbols.
    let mut symbols = table;
    symbols.sort_unstable();
    for (r, t) in tokens.iter().enumerate().take(256) {
        if t.len() != 1 || table[t[0] as usize] != symbols[r] {
            return Err(format!(
                "rank {r} is not the single byte of symbol {:?} (GPT-2's byte order)",
                symbols[r]
            ));
        }
    }
    let mut vocab: Vec<String> = tokens.iter().map(|t| to_symbols(t, &table)).collect();
    vocab.push(EOT_TOKEN.to_string());
    let mut merges = Vec::with_capacity(tokens.len() - 256);
    for (r, t) in tokens.iter().enumerate().skip(256) {
        let parts = bpe_split(t, &ranks, r as u32);
        if parts.len() != 2 {
            return Err(format!(
                "token {r} ({:?}) is made of {} lower-ranked tokens, expected 2",
                vocab[r],
                parts.len()
            ));
        }
        merges.push((to_symbols(parts[0], &table), to_symbols(parts[1], &table)));
    }
    Ok((vocab, merges))
}

/// Byte-level BPE of `piece` using only tokens of rank below `max_rank`
/// (tiktoken's algorithm: repeatedly merge the adjacent pair whose
/// concatenation has the lowest rank).
fn bpe_split<'a>(piece: &'a [u8], ranks: &HashMap<&[u8], u32>, max_rank: u32) -> Vec<&'a [u8]> {
    let mut bounds: Vec<usize> = (0..=piece.len()).collect();
    loop {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..bounds.len().saturating_sub(2) {
            if let Some(&r) = ranks.get(&piece[bounds[i]..bounds[i + 2]]) {
                if r < max_rank && best.is_none_or(|(b, _)| r < b) {
                    best = Some((r, i));
                }
            }
        }
        match best {
            Some((_, i)) => {
                bounds.remove(i + 1);
            }
            None => break,
        }
    }
    bounds.windows(2).map(|w| &piece[w[0]..w[1]]).collect()
}

/// GPT-2's `tokenizer.json`, built once per process with the `tokenizers`
/// crate from [`gpt2_vocab_and_merges`].
pub(crate) fn gpt2_tokenizer_json() -> Result<String> {
    static JSON: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    JSON.get_or_init(build_gpt2_json)
        .clone()
        .map_err(|e| Error::Tokenizer(format!("building gpt2 tokenizer.json: {e}")))
}

fn build_gpt2_json() -> std::result::Result<String, String> {
    let (vocab, merges) = derive_gpt2()?;
    let vocab: Vocab = vocab
        .into_iter()
        .enumerate()
        .map(|(i, t)| (t, i as u32))
        .collect();
    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| e.to_string())?;
    let mut t = byte_level_pipeline(model);
    add_eot(&mut t);
    t.to_string(true).map_err(|e| e.to_string())
}

/// The Hugging Face tokenizer files for `tok`, as `(file name, contents)` in
/// the order of [`HF_TOKENIZER_FILES`]: `tokenizer.json` (for
/// `PreTrainedTokenizerFast` and Python's `tokenizers`), `vocab.json` and
/// `merges.txt` (for the slow `GPT2Tokenizer`), `tokenizer_config.json`
/// (`GPT2Tokenizer` class, the end-of-text token as bos/eos/unk, no prefix
/// space, no clean-up of spaces on decode so that decoding round-trips, and
/// `model_max_length` when given) and `special_tokens_map.json`.
///
/// A byte-fallback tokenizer (Llama's kind) gets `tokenizer.json`, a
/// `tokenizer_config.json` of class `PreTrainedTokenizerFast` (which loads
/// `tokenizer.json` as it is; `<s>`/`<unk>` as bos/unk when the vocabulary
/// has them, no bos added) and `special_tokens_map.json`.
///
/// Works for [`Gpt2Tokenizer`](super::Gpt2Tokenizer) (derived offline) and
/// any [`HfTokenizer`]; other tokenizers give an error.
pub fn hf_tokenizer_files(
    tok: &dyn Tokenizer,
    model_max_length: Option<usize>,
) -> Result<Vec<(String, Vec<u8>)>> {
    let json = tok.hf_tokenizer_json()?;
    let name = tok.name();
    let err = |what: String| Error::Tokenizer(format!("{name}: tokenizer.json: {what}"));
    let hf = HfTokenizer::from_bytes(json.as_bytes())?;
    let value: Value =
        serde_json::from_str(&json).map_err(|e| err(format!("not valid JSON: {e}")))?;

    let eot = hf.eot_token();
    let byte_level = hf.byte_encoding() == ByteEncoding::ByteLevel;
    let bos = hf
        .inner()
        .id_to_token(hf.bos())
        .unwrap_or_else(|| eot.clone());
    let unk = match hf.inner().token_to_id("<unk>") {
        Some(_) if !byte_level => "<unk>".to_string(),
        _ => eot.clone(),
    };

    // The added tokens, as transformers' `added_tokens_decoder`.
    let mut added = serde_json::Map::new();
    for t in value["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (t["id"].as_u64(), t["content"].as_str()) else {
            return Err(err(format!("added token {t} has no id/content")));
        };
        let flag = |k: &str| t[k].as_bool().unwrap_or(false);
        added.insert(
            id.to_string(),
            json!({
                "content": content,
                "lstrip": flag("lstrip"),
                "normalized": flag("normalized"),
                "rstrip": flag("rstrip"),
                "single_word": flag("single_word"),
                "special": flag("special"),
            }),
        );
    }
    let mut config = json!({
        "tokenizer_class": if byte_level { "GPT2Tokenizer" } else { "PreTrainedTokenizerFast" },
        "add_bos_token": false,
        "add_eos_token": false,
        "added_tokens_decoder": added,
        "bos_token": bos,
        "eos_token": eot,
        "unk_token": unk,
        "clean_up_tokenization_spaces": false,
    });
    if byte_level {
        config["add_prefix_space"] = json!(false);
        config["errors"] = json!("replace");
    }
    if let Some(n) = model_max_length {
        config["model_max_length"] = json!(n);
    }
    let special = json!({
        "bos_token": bos,
        "eos_token": eot,
        "unk_token": unk,
    });
    let pretty = |v: &Value| -> Result<Vec<u8>> {
        let mut s = serde_json::to_string_pretty(v).map_err(|e| err(e.to_string()))?;
        s.push('\n');
        Ok(s.into_bytes())
    };
    let mut files = vec![(HF_TOKENIZER_FILES[0].into(), json.into_bytes())];
    if byte_level {
        let (vocab_json, merges_txt) = slow_gpt2_files(&hf, &value, &err)?;
        files.push((HF_TOKENIZER_FILES[1].into(), vocab_json.into_bytes()));
        files.push((HF_TOKENIZER_FILES[2].into(), merges_txt.into_bytes()));
    }
    files.push((HF_TOKENIZER_FILES[3].into(), pretty(&config)?));
    files.push((HF_TOKENIZER_FILES[4].into(), pretty(&special)?));
    Ok(files)
}

/// GPT-2's slow-tokenizer files for a byte-level tokenizer: `vocab.json`
/// (every token, model and added, by id) and `merges.txt`.
fn slow_gpt2_files(
    hf: &HfTokenizer,
    value: &Value,
    err: &dyn Fn(String) -> Error,
) -> Result<(String, String)> {
    let tokens = hf.id_to_token();
    let mut vocab_json = String::with_capacity(tokens.len() * 12);
    vocab_json.push('{');
    for (id, t) in tokens.iter().enumerate() {
        if id > 0 {
            vocab_json.push(',');
        }
        vocab_json.push_str(&serde_json::to_string(t).map_err(|e| err(e.to_string()))?);
        vocab_json.push(':');
        vocab_json.push_str(&id.to_string());
    }
    vocab_json.push_str("}\n");

    // merges.txt: a header line, then one merge a line (the slow tokenizer
    // drops the last line, so the file ends with a newline).
    let merges = value["model"]["merges"]
        .as_array()
        .ok_or_else(|| err("model.merges is not a list".into()))?;
    let mut merges_txt = String::from("#version: 0.2\n");
    for (i, m) in merges.iter().enumerate() {
        let (a, b): (&str, &str) = match m {
            Value::String(s) => s
                .split_once(' ')
                .ok_or_else(|| err(format!("merge {i} {s:?} is not `a b`")))?,
            Value::Array(p) if p.len() == 2 && p[0].is_string() && p[1].is_string() => (
                p[0].as_str().unwrap_or_default(),
                p[1].as_str().unwrap_or_default(),
            ),
            other => return Err(err(format!("merge {i} is {other}, expected a pair"))),
        };
        let bad = |t: &str| t.is_empty() || t.contains([' ', '\n', '\r']);
        if bad(a) || bad(b) {
            return Err(err(format!(
                "merge {i} {m} cannot be written to merges.txt (empty or contains whitespace)"
            )));
        }
        merges_txt.push_str(a);
        merges_txt.push(' ');
        merges_txt.push_str(b);
        merges_txt.push('\n');
    }
    Ok((vocab_json, merges_txt))
}

/// Writes [`hf_tokenizer_files`] into `dir` (created if missing); returns the
/// paths written.
pub fn write_hf_tokenizer_files(
    tok: &dyn Tokenizer,
    dir: impl AsRef<Path>,
    model_max_length: Option<usize>,
) -> Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create directory", e))?;
    let mut written = Vec::new();
    for (name, bytes) in hf_tokenizer_files(tok, model_max_length)? {
        let path = dir.join(name);
        std::fs::write(&path, bytes).map_err(|e| Error::io(&path, "write", e))?;
        written.push(path);
    }
    Ok(written)
}

//! Tokenizers behind a small object-safe trait, and the files the Python
//! ecosystem (`tokenizers`, `transformers`) loads.
//!
//! # Design
//!
//! * [`Tokenizer`] is what `prepare`, the loader, `train` and `sample` see: a
//!   name, the vocabulary size, the end-of-text id, `encode` (special-token
//!   strings in the text are plain text: documents are separated by the
//!   caller appending [`Tokenizer::eot`]) and `decode` (errors on ids outside
//!   the vocabulary). Everything is used as `Box<dyn Tokenizer>`
//!   ([`tokenizer_by_name`]).
//! * [`Gpt2Tokenizer`] is GPT-2's byte-level BPE (`r50k_base` from
//!   `tiktoken-rs`, whose ranks are compiled into the binary: it works
//!   offline). It is the fast path for the default tokenizer.
//! * [`HfTokenizer`] wraps a Hugging Face `tokenizers::Tokenizer` loaded from a
//!   `tokenizer.json` (a byte-level BPE as GPT-2's, or a byte-fallback BPE as
//!   Llama's and Mistral's, with an end-of-text token), or
//!   trained on a corpus with [`train_bpe`]: GPT-2's pre-tokenizer regex,
//!   the 256-symbol byte alphabet always present (so no text is ever unknown),
//!   `<|endoftext|>` as the last id, deterministic output.
//! * [`hf_tokenizer_files`] turns either tokenizer into the files that
//!   `transformers`' `AutoTokenizer` and Python's `tokenizers` load offline
//!   from a checkpoint directory: `tokenizer.json`, `vocab.json`,
//!   `merges.txt`, `tokenizer_config.json` and `special_tokens_map.json`
//!   (no `vocab.json`/`merges.txt` for a byte-fallback tokenizer: GPT-2's
//!   slow tokenizer could not read them). For
//!   [`Gpt2Tokenizer`] the `vocab.json`/`merges.txt` are derived from the
//!   tiktoken ranks ([`gpt2_vocab_and_merges`]: the standard tiktoken -> HF
//!   conversion), byte-for-byte the vocabulary OpenAI published, and the
//!   `tokenizers`-crate tokenizer built from them ([`HfTokenizer::gpt2`])
//!   gives the same ids as [`Gpt2Tokenizer`] (tested on the bundled
//!   Shakespeare corpus and on unicode, whitespace, digit, contraction and
//!   emoji cases).

use std::path::Path;

use crate::error::{Error, Result};

mod export;
mod hf;
mod train;

pub use export::{
    bytes_to_unicode, gpt2_vocab_and_merges, hf_tokenizer_files, write_hf_tokenizer_files,
    VocabAndMerges, HF_TOKENIZER_FILES,
};
pub use hf::{ByteEncoding, HfTokenizer, END_OF_TEXT_TOKENS, EOT_TOKEN};
pub use train::{train_bpe, train_bpe_with, BpeTrainOptions};

/// A text tokenizer. Implementations must be deterministic and thread-safe.
pub trait Tokenizer: Send + Sync {
    /// Name recorded in the manifest (e.g. `gpt2`).
    fn name(&self) -> &str;
    /// Number of token ids (ids are `0..vocab_size`).
    fn vocab_size(&self) -> u32;
    /// The end-of-text id that separates documents.
    fn eot(&self) -> u32;
    /// The beginning-of-text id a model's config names (`bos_token_id`); the end-of-text id
    /// when the tokenizer has none of its own (GPT-2).
    fn bos(&self) -> u32 {
        self.eot()
    }
    /// Encodes text; special-token strings in the text are encoded as plain text.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Decodes ids to text (invalid UTF-8 is replaced by U+FFFD).
    fn decode(&self, ids: &[u32]) -> Result<String>;
    /// True when a text may be cut at any newline where [`is_safe_cut`] holds
    /// and the parts encoded separately (the first with [`encode`], the
    /// others with [`encode_continuation`]), giving the ids of encoding it
    /// whole: GPT-2's pre-tokenizer regex, or a byte-fallback BPE whose
    /// tokens hold no newline. The default, `false`, means: encode each
    /// document whole.
    ///
    /// [`encode`]: Tokenizer::encode
    /// [`encode_continuation`]: Tokenizer::encode_continuation
    fn safe_newline_cuts(&self) -> bool {
        false
    }
    /// Encodes a part of a document that follows a cut (see
    /// [`safe_newline_cuts`](Tokenizer::safe_newline_cuts)): without what a
    /// tokenizer puts only in front of a whole text (SentencePiece's `▁`).
    /// The default is [`encode`](Tokenizer::encode).
    fn encode_continuation(&self, text: &str) -> Vec<u32> {
        self.encode(text)
    }
    /// This tokenizer as a Hugging Face `tokenizer.json` (the input of
    /// [`hf_tokenizer_files`]). The default says the tokenizer cannot be
    /// exported.
    fn hf_tokenizer_json(&self) -> Result<String> {
        Err(Error::Tokenizer(format!(
            "tokenizer `{}` cannot be written as Hugging Face tokenizer files",
            self.name()
        )))
    }
}

/// GPT-2 BPE (`r50k_base`): 50257 ids, `<|endoftext|>` = 50256.
pub struct Gpt2Tokenizer {
    bpe: &'static tiktoken_rs::CoreBPE,
}

/// GPT-2's end-of-text id.
pub const GPT2_EOT: u32 = 50256;
/// GPT-2's vocabulary size.
pub const GPT2_VOCAB: u32 = 50257;

impl Gpt2Tokenizer {
    /// The shared GPT-2 tokenizer (built once per process, ~100 ms).
    pub fn new() -> Self {
        Gpt2Tokenizer {
            bpe: tiktoken_rs::r50k_base_singleton(),
        }
    }
}

impl Default for Gpt2Tokenizer {
    fn default() -> Self {
        Self::new()
    }
}

impl Tokenizer for Gpt2Tokenizer {
    fn name(&self) -> &str {
        "gpt2"
    }
    fn vocab_size(&self) -> u32 {
        GPT2_VOCAB
    }
    fn eot(&self) -> u32 {
        GPT2_EOT
    }
    fn encode(&self, text: &str) -> Vec<u32> {
        // tiktoken-rs panics when its regex engine hits the backtracking
        // limit (a whitespace run of ~10^6 characters). Such text is encoded
        // by the tokenizers-crate GPT-2 instead, whose splitter keeps the
        // rest of the text as one piece at that point (the ids still decode
        // to the text). The panic message is still printed by the hook.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.bpe.encode_ordinary(text)
        }));
        match r {
            Ok(ids) => ids,
            Err(_) => gpt2_fallback_encode(text),
        }
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&t| t >= GPT2_VOCAB) {
            return Err(Error::Tokenizer(format!(
                "token id {bad} is outside the gpt2 vocabulary (size {GPT2_VOCAB})"
            )));
        }
        let bytes = self
            .bpe
            .decode_bytes(ids)
            .map_err(|e| Error::Tokenizer(format!("cannot decode: {e}")))?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
    fn hf_tokenizer_json(&self) -> Result<String> {
        export::gpt2_tokenizer_json()
    }
    fn safe_newline_cuts(&self) -> bool {
        true
    }
}

fn gpt2_fallback_encode(text: &str) -> Vec<u32> {
    static HF: std::sync::OnceLock<Option<HfTokenizer>> = std::sync::OnceLock::new();
    match HF.get_or_init(|| HfTokenizer::gpt2().ok()) {
        Some(hf) => hf.encode(text),
        None => {
            // One id per byte: GPT-2's first 256 ids are the bytes in the
            // order of their bytes_to_unicode symbols.
            let table = bytes_to_unicode();
            let mut sorted = table;
            sorted.sort_unstable();
            text.bytes()
                .map(|b| sorted.binary_search(&table[b as usize]).unwrap_or(0) as u32)
                .collect()
        }
    }
}

/// How two tokenizers differ (vocabulary size, end-of-text id, the text of every id, the ids
/// of a probe text), or `None` when they encode and decode alike.
pub fn difference(a: &dyn Tokenizer, b: &dyn Tokenizer) -> Option<String> {
    if a.vocab_size() != b.vocab_size() {
        return Some(format!("{} ids against {}", a.vocab_size(), b.vocab_size()));
    }
    if a.eot() != b.eot() {
        return Some(format!("end-of-text id {} against {}", a.eot(), b.eot()));
    }
    for id in 0..a.vocab_size() {
        let (x, y) = (a.decode(&[id]).ok(), b.decode(&[id]).ok());
        if x != y {
            return Some(format!(
                "token id {id} is {x:?} in one and {y:?} in the other"
            ));
        }
    }
    const PROBE: &str =
        "The quick brown fox, 1234 times: \"jumps\" over\n\tthe lazy dog's café 日本 🐟";
    let (x, y) = (a.encode(PROBE), b.encode(PROBE));
    (x != y).then(|| format!("{PROBE:?} encodes as {x:?} against {y:?}"))
}

/// Names accepted by [`tokenizer_by_name`] (besides a path to a `tokenizer.json`).
pub const TOKENIZER_NAMES: &[&str] = &["gpt2"];

/// Looks a tokenizer up by its manifest name: `gpt2` (alias `r50k_base`), or
/// a path to a Hugging Face `tokenizer.json` (or to a directory holding one,
/// e.g. a checkpoint), loaded as an [`HfTokenizer`].
pub fn tokenizer_by_name(name: &str) -> Result<Box<dyn Tokenizer>> {
    match name {
        "gpt2" | "r50k_base" => Ok(Box::new(Gpt2Tokenizer::new())),
        other => {
            let path = Path::new(other);
            if path.is_dir() {
                let file = path.join("tokenizer.json");
                if !file.is_file() {
                    return Err(Error::Input {
                        path: path.to_path_buf(),
                        what: "directory has no tokenizer.json (expected a Hugging Face tokenizer \
                               file, as written next to a fugu checkpoint)"
                            .into(),
                    });
                }
                Ok(Box::new(HfTokenizer::from_file(&file)?))
            } else if other.ends_with(".json") || path.is_file() {
                Ok(Box::new(HfTokenizer::from_file(path)?))
            } else {
                Err(Error::Tokenizer(format!(
                    "unknown tokenizer `{other}` (known: {}, or a path to a tokenizer.json)",
                    TOKENIZER_NAMES.join(", ")
                )))
            }
        }
    }
}

/// Vocabulary size of a named tokenizer without building it (`None` for
/// unknown names and for `tokenizer.json` paths).
pub fn vocab_size_of(name: &str) -> Option<u32> {
    match name {
        "gpt2" | "r50k_base" => Some(GPT2_VOCAB),
        _ => None,
    }
}

/// True when `text[..=i]` may end a tokenization chunk at the newline at byte
/// `i`: GPT-2's pre-tokenizer regex (used by [`Gpt2Tokenizer`] and by the
/// `ByteLevel` pre-tokenizer of [`train_bpe`]'s tokenizers) never joins a `\n` that has a
/// non-whitespace character on both sides with its neighbours, so encoding
/// the two halves separately gives exactly the ids of encoding the whole.
pub fn is_safe_cut(text: &[u8], i: usize) -> bool {
    if i == 0 || i + 1 >= text.len() || text[i] != b'\n' {
        return false;
    }
    let prev = last_char(&text[..i]);
    let next = first_char(&text[i + 1..]);
    matches!((prev, next), (Some(p), Some(n)) if !p.is_whitespace() && !n.is_whitespace())
}

fn last_char(b: &[u8]) -> Option<char> {
    let start = b.len().saturating_sub(4);
    for s in start..b.len() {
        if let Ok(s) = std::str::from_utf8(&b[s..]) {
            return s.chars().last();
        }
    }
    None
}

fn first_char(b: &[u8]) -> Option<char> {
    let end = b.len().min(4);
    for e in (1..=end).rev() {
        if let Ok(s) = std::str::from_utf8(&b[..e]) {
            return s.chars().next();
        }
    }
    None
}

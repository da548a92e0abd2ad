//! Tokenizers behind a small trait. The only implementation today is GPT-2's
//! byte-level BPE (`r50k_base` from `tiktoken-rs`, whose vocabulary is compiled
//! into the binary: it works offline).

use crate::error::{Error, Result};

/// A text tokenizer. Implementations must be deterministic and thread-safe.
pub trait Tokenizer: Send + Sync {
    /// Name recorded in the manifest (e.g. `gpt2`).
    fn name(&self) -> &str;
    /// Number of token ids (ids are `0..vocab_size`).
    fn vocab_size(&self) -> u32;
    /// The end-of-text id that separates documents.
    fn eot(&self) -> u32;
    /// Encodes text; special-token strings in the text are encoded as plain text.
    fn encode(&self, text: &str) -> Vec<u32>;
    /// Decodes ids to text (invalid UTF-8 is replaced by U+FFFD).
    fn decode(&self, ids: &[u32]) -> Result<String>;
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
        self.bpe.encode_ordinary(text)
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
}

/// Names accepted by [`tokenizer_by_name`].
pub const TOKENIZER_NAMES: &[&str] = &["gpt2"];

/// Looks a tokenizer up by its manifest name (`gpt2`, alias `r50k_base`).
pub fn tokenizer_by_name(name: &str) -> Result<Box<dyn Tokenizer>> {
    match name {
        "gpt2" | "r50k_base" => Ok(Box::new(Gpt2Tokenizer::new())),
        other => Err(Error::Tokenizer(format!(
            "unknown tokenizer `{other}` (known: {})",
            TOKENIZER_NAMES.join(", ")
        ))),
    }
}

/// Vocabulary size of a named tokenizer without building it.
pub fn vocab_size_of(name: &str) -> Option<u32> {
    match name {
        "gpt2" | "r50k_base" => Some(GPT2_VOCAB),
        _ => None,
    }
}

/// True when `text[..=i]` may end a tokenization chunk at the newline at byte
/// `i`: GPT-2's pre-tokenizer regex never joins a `\n` that has a
/// non-whitespace character on both sides with its neighbours, so encoding
/// the two halves separately gives exactly the ids of encoding the whole.
pub(crate) fn is_safe_cut(text: &[u8], i: usize) -> bool {
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

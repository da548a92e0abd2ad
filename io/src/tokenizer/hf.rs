//! [`HfTokenizer`]: a Hugging Face `tokenizers::Tokenizer` (a `tokenizer.json`)
//! behind fugu's [`Tokenizer`] trait.
//!
//! Only byte-level BPE tokenizers are accepted (BPE model, `ByteLevel`
//! decoder, every one of the 256 byte symbols in the vocabulary, contiguous
//! ids, an `<|endoftext|>` token): for those, every text has an encoding and
//! `decode(encode(text)) == text`. GPT-2's own `tokenizer.json`, the ones
//! [`train_bpe`](super::train_bpe) writes and those of most GPT-2-style models
//! qualify.

use std::path::Path;
use std::sync::OnceLock;

use tokenizers as hf;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::utils::SysRegex;
use tokenizers::{AddedToken, Model, PreTokenizerWrapper};

use super::export::bytes_to_unicode;
use super::Tokenizer;
use crate::error::{Error, Result};

/// GPT-2's pre-tokenizer regex (the `ByteLevel` pre-tokenizer's).
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The end-of-text token every fugu tokenizer has (GPT-2's).
pub const EOT_TOKEN: &str = "<|endoftext|>";

/// A byte-level BPE tokenizer from the Hugging Face `tokenizers` crate.
///
/// [`encode`](Tokenizer::encode) adds no special tokens and treats
/// special-token strings such as `<|endoftext|>` in the text as plain text,
/// like [`Gpt2Tokenizer::encode`](super::Gpt2Tokenizer) (the saved
/// `tokenizer.json` keeps the Hugging Face default, so Python's `tokenizers`
/// maps a literal `<|endoftext|>` in the text to the special id).
#[derive(Clone)]
pub struct HfTokenizer {
    inner: hf::Tokenizer,
    name: String,
    eot: u32,
    vocab_size: u32,
    /// GPT-2's pre-tokenization exactly (see [`Tokenizer::safe_newline_cuts`]).
    gpt2_split: bool,
    /// The id of each single-byte token (the lossless fallback encoding).
    byte_ids: Box<[u32; 256]>,
    /// `tokenizer.json`, pretty-printed, as the crate serialises it.
    json: String,
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("name", &self.name)
            .field("vocab_size", &self.vocab_size)
            .field("eot", &self.eot)
            .finish()
    }
}

impl HfTokenizer {
    /// Loads a `tokenizer.json`. Errors name the file and what was expected.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, "read tokenizer", e))?;
        Self::parse(&bytes).map_err(|what| Error::Input {
            path: path.to_path_buf(),
            what,
        })
    }

    /// Parses the contents of a `tokenizer.json`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        Self::parse(bytes).map_err(|what| Error::Tokenizer(format!("tokenizer.json: {what}")))
    }

    /// GPT-2's tokenizer as a `tokenizers`-crate tokenizer, built offline from
    /// the `vocab.json`/`merges.txt` derived from the tiktoken ranks
    /// ([`gpt2_vocab_and_merges`](super::gpt2_vocab_and_merges)). It encodes
    /// exactly like [`Gpt2Tokenizer`](super::Gpt2Tokenizer) (slower); named
    /// `gpt2`.
    pub fn gpt2() -> Result<Self> {
        Ok(Self::from_bytes(super::export::gpt2_tokenizer_json()?.as_bytes())?.with_name("gpt2"))
    }

    /// Replaces the name (default `bpe-<vocab size>`).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The `tokenizer.json` text (pretty-printed; deterministic).
    pub fn to_json(&self) -> String {
        self.json.clone()
    }

    /// Writes `tokenizer.json` to `path`.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.json.as_bytes()).map_err(|e| Error::io(path, "write", e))
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &hf::Tokenizer {
        &self.inner
    }

    /// Encodes with the crate's full pipeline (`encode_fast`, no special
    /// tokens added), returning its error instead of falling back to one id
    /// per byte. [`Tokenizer::encode`] gives the same ids, faster.
    pub fn try_encode(&self, text: &str) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error::Tokenizer(format!("{}: cannot encode: {e}", self.name)))
    }

    /// The GPT-2 pipeline done directly: split with the `ByteLevel`
    /// pre-tokenizer's regex (same regex engine, same handling of gaps), map
    /// bytes to symbols, BPE each piece with the model (and its cache). The
    /// same ids as the crate's `encode` (tested) at several times the speed:
    /// it skips the offset bookkeeping. `None` when it does not apply.
    fn encode_gpt2_pipeline(&self, text: &str) -> Option<Vec<u32>> {
        static RE: OnceLock<Option<SysRegex>> = OnceLock::new();
        let re = RE.get_or_init(|| SysRegex::new(GPT2_SPLIT).ok()).as_ref()?;
        let ModelWrapper::BPE(bpe) = self.inner.get_model() else {
            return None;
        };
        let table = bytes_to_unicode();
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        let mut symbols = String::new();
        let mut piece = |p: &str| -> Option<()> {
            symbols.clear();
            symbols.extend(p.bytes().map(|b| table[b as usize]));
            ids.extend(bpe.tokenize(&symbols).ok()?.into_iter().map(|t| t.id));
            Some(())
        };
        let mut prev = 0;
        for (start, end) in re.find_iter(text) {
            if prev != start {
                piece(&text[prev..start])?;
            }
            piece(&text[start..end])?;
            prev = end;
        }
        if prev != text.len() {
            piece(&text[prev..])?;
        }
        Some(ids)
    }

    fn parse(bytes: &[u8]) -> std::result::Result<Self, String> {
        let inner = hf::Tokenizer::from_bytes(bytes)
            .map_err(|e| format!("not a valid Hugging Face tokenizer.json: {e}"))?;
        Self::from_hf(inner)
    }

    /// Validates and wraps a `tokenizers` tokenizer (see the module doc for
    /// what is required).
    pub(crate) fn from_hf(mut inner: hf::Tokenizer) -> std::result::Result<Self, String> {
        if !matches!(inner.get_model(), ModelWrapper::BPE(_)) {
            return Err(format!(
                "expected a byte-level BPE tokenizer (model type `BPE`), found model {}",
                model_kind(inner.get_model())
            ));
        }
        if !matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return Err(
                "expected a byte-level BPE tokenizer (decoder type `ByteLevel`), found another \
                 decoder or none"
                    .into(),
            );
        }
        let vocab = inner.get_vocab(true);
        let n = vocab.len();
        let mut seen = vec![false; n];
        for (token, &id) in &vocab {
            match seen.get_mut(id as usize) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(format!(
                        "token ids must be 0..{n} with no gaps or duplicates; token {token:?} \
                         has id {id}"
                    ))
                }
            }
        }
        let vocab_size =
            u32::try_from(n).map_err(|_| format!("vocabulary of {n} tokens is too large"))?;
        let eot = inner.token_to_id(EOT_TOKEN).ok_or_else(|| {
            format!("has no `{EOT_TOKEN}` token (expected it as the end-of-text special token)")
        })?;
        let u = bytes_to_unicode();
        let mut byte_ids = Box::new([0u32; 256]);
        for (b, id) in byte_ids.iter_mut().enumerate() {
            let sym = u[b].to_string();
            *id = inner.token_to_id(&sym).ok_or_else(|| {
                format!(
                    "not a full byte-level vocabulary: byte 0x{b:02x} (symbol {sym:?}) has no \
                     token, so some text could not be encoded"
                )
            })?;
        }
        // Cutting at newlines is exact only with GPT-2's regex, no prefix
        // space (it would be added to every part), no normalizer and no
        // non-special added tokens (specials are plain text in `encode`).
        let gpt2_split = inner.get_normalizer().is_none()
            && matches!(
                inner.get_pre_tokenizer(),
                Some(PreTokenizerWrapper::ByteLevel(b)) if b.use_regex && !b.add_prefix_space
            )
            && inner.get_added_tokens_decoder().values().all(|t| t.special);
        let json = inner
            .to_string(true)
            .map_err(|e| format!("cannot serialise: {e}"))?;
        // Special-token strings in the text are plain text (as Gpt2Tokenizer).
        inner.set_encode_special_tokens(true);
        Ok(HfTokenizer {
            inner,
            name: format!("bpe-{vocab_size}"),
            eot,
            vocab_size,
            gpt2_split,
            byte_ids,
            json,
        })
    }

    /// The vocabulary by id (model vocabulary and added tokens).
    pub fn id_to_token(&self) -> Vec<String> {
        let mut out = vec![String::new(); self.vocab_size as usize];
        for (token, id) in self.inner.get_vocab(true) {
            out[id as usize] = token;
        }
        out
    }
}

fn model_kind(m: &ModelWrapper) -> &'static str {
    match m {
        ModelWrapper::BPE(_) => "BPE",
        ModelWrapper::WordPiece(_) => "WordPiece",
        ModelWrapper::WordLevel(_) => "WordLevel",
        ModelWrapper::Unigram(_) => "Unigram",
    }
}

/// A GPT-2-style pipeline around a BPE model: no normalizer, `ByteLevel`
/// pre-tokenizer (GPT-2's regex, no prefix space), post-processor and decoder
/// configured as in GPT-2's own `tokenizer.json`.
pub(crate) fn byte_level_pipeline(model: BPE) -> hf::Tokenizer {
    let mut t = hf::Tokenizer::new(model);
    t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    t.with_post_processor(Some(ByteLevel::new(true, false, true)));
    t.with_decoder(Some(ByteLevel::new(true, true, true)));
    t
}

/// Adds `<|endoftext|>` as a special token (the next id when the model does
/// not have it).
pub(crate) fn add_eot(t: &mut hf::Tokenizer) {
    t.add_special_tokens(&[AddedToken::from(EOT_TOKEN, true)]);
}

impl Tokenizer for HfTokenizer {
    fn name(&self) -> &str {
        &self.name
    }
    fn vocab_size(&self) -> u32 {
        self.vocab_size
    }
    fn eot(&self) -> u32 {
        self.eot
    }
    fn encode(&self, text: &str) -> Vec<u32> {
        if self.gpt2_split {
            if let Some(ids) = self.encode_gpt2_pipeline(text) {
                return ids;
            }
        }
        match self.try_encode(text) {
            Ok(ids) => ids,
            // Not expected for a validated byte-level BPE; one id per byte
            // still decodes to the same text.
            Err(_) => text.bytes().map(|b| self.byte_ids[b as usize]).collect(),
        }
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&t| t >= self.vocab_size) {
            return Err(Error::Tokenizer(format!(
                "token id {bad} is outside the {} vocabulary (size {})",
                self.name, self.vocab_size
            )));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(format!("{}: cannot decode: {e}", self.name)))
    }
    fn hf_tokenizer_json(&self) -> Result<String> {
        Ok(self.json.clone())
    }
    fn safe_newline_cuts(&self) -> bool {
        self.gpt2_split
    }
}

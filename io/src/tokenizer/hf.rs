//! [`HfTokenizer`]: a Hugging Face `tokenizers::Tokenizer` (a `tokenizer.json`)
//! behind fugu's [`Tokenizer`] trait.
//!
//! BPE tokenizers that can encode every text are accepted, in the two forms
//! models ship ([`ByteEncoding`]):
//!
//! * **byte-level** (GPT-2, Llama 3, Qwen, the ones
//!   [`train_bpe`](super::train_bpe) writes): a `ByteLevel` decoder and every
//!   one of the 256 byte symbols in the vocabulary;
//! * **byte fallback** (Llama 1/2, Mistral, LLM-jp, TinyLlama: SentencePiece
//!   BPE converted by transformers): `model.byte_fallback: true`, the 256
//!   `<0x00>`..`<0xFF>` tokens, a decoder with a `ByteFallback` step, and a
//!   `▁` space marker added by a `Metaspace` pre-tokenizer or a
//!   `Prepend`/`Replace` normalizer.
//!
//! Ids must be contiguous, one of [`END_OF_TEXT_TOKENS`] must be in the
//! vocabulary (the end-of-text id), and a probe text must decode back to
//! itself, but for a space in front (a normalizer that lowercases or strips
//! accents is refused: the training data would silently not be the text). A text that starts with a
//! space loses that space in a byte-fallback tokenizer's round trip (its
//! decoder strips the `▁` prefix that encoding adds), exactly as in Python.

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

/// The end-of-text token of GPT-2 and of the tokenizers fugu trains.
pub const EOT_TOKEN: &str = "<|endoftext|>";

/// The tokens taken as end-of-text, in order of preference: GPT-2's (also
/// Qwen's), SentencePiece's `</s>` (Llama 1/2, Mistral, LLM-jp), Llama 3's,
/// Gemma's.
pub const END_OF_TEXT_TOKENS: [&str; 4] = [EOT_TOKEN, "</s>", "<|end_of_text|>", "<eos>"];

/// The tokens taken as beginning-of-text, in order of preference
/// (SentencePiece's, Llama 3's, Gemma's); none: the end-of-text token.
pub const BEGIN_OF_TEXT_TOKENS: [&str; 3] = ["<s>", "<|begin_of_text|>", "<bos>"];

/// Text every accepted tokenizer must decode back to itself after encoding.
const ROUND_TRIP_PROBE: &str = "Round trip: A b  c\tD\n\nÉtude naïve 日本語 🎉 <0x41> 3.14 don't ";

/// How a tokenizer encodes text its merges do not cover: every text has an
/// encoding either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ByteEncoding {
    /// Text is mapped to 256 printable byte symbols before BPE (GPT-2's
    /// `bytes_to_unicode`); a `ByteLevel` decoder maps them back.
    ByteLevel,
    /// Unicode pieces, and a character missing from the vocabulary becomes
    /// its UTF-8 bytes as `<0xXX>` tokens (SentencePiece's byte fallback).
    ByteFallback,
}

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
    encoding: ByteEncoding,
    vocab_size: u32,
    /// GPT-2's pre-tokenization exactly (see [`Tokenizer::safe_newline_cuts`]).
    gpt2_split: bool,
    /// A byte-fallback tokenizer's pipeline without the `▁` it puts in front
    /// of a text, for the parts of a document after a newline cut (`None`
    /// when cuts would not be exact: see [`continuation_pipeline`]).
    continuation: Option<hf::Tokenizer>,
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
            .field("encoding", &self.encoding)
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

    /// How text outside the merges is encoded.
    pub fn byte_encoding(&self) -> ByteEncoding {
        self.encoding
    }

    /// The end-of-text token's string (one of [`END_OF_TEXT_TOKENS`]).
    pub fn eot_token(&self) -> String {
        self.inner.id_to_token(self.eot).unwrap_or_default()
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
        let ModelWrapper::BPE(bpe) = inner.get_model() else {
            return Err(format!(
                "expected a BPE tokenizer (model type `BPE`, byte-level as GPT-2's or with byte \
                 fallback as Llama's), found model {}",
                model_kind(inner.get_model())
            ));
        };
        let encoding = byte_encoding(&inner, bpe.byte_fallback)?;
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
        let eot = END_OF_TEXT_TOKENS
            .iter()
            .find_map(|t| inner.token_to_id(t))
            .ok_or_else(|| {
                format!(
                    "has no end-of-text token (expected one of {})",
                    END_OF_TEXT_TOKENS.map(|t| format!("`{t}`")).join(", ")
                )
            })?;
        let mut byte_ids = Box::new([0u32; 256]);
        let symbols = bytes_to_unicode();
        for (b, id) in byte_ids.iter_mut().enumerate() {
            let sym = match encoding {
                ByteEncoding::ByteLevel => symbols[b].to_string(),
                ByteEncoding::ByteFallback => format!("<0x{b:02X}>"),
            };
            *id = inner.token_to_id(&sym).ok_or_else(|| {
                format!(
                    "not a full byte vocabulary: byte 0x{b:02x} (token {sym:?}) has no id, so \
                     some text could not be encoded"
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
        let continuation = match encoding {
            ByteEncoding::ByteFallback => continuation_pipeline(&inner, &json),
            ByteEncoding::ByteLevel => None,
        };
        // Special-token strings in the text are plain text (as Gpt2Tokenizer).
        inner.set_encode_special_tokens(true);
        let tok = HfTokenizer {
            inner,
            name: format!("bpe-{vocab_size}"),
            eot,
            encoding,
            vocab_size,
            gpt2_split,
            continuation,
            byte_ids,
            json,
        };
        let back = tok
            .try_encode(ROUND_TRIP_PROBE)
            .and_then(|ids| tok.decode(&ids))
            .map_err(|e| e.to_string())?;
        // A byte-level pre-tokenizer with `add_prefix_space` gives a text
        // back with a space in front: every document starts with one.
        if back.strip_prefix(' ').unwrap_or(&back) != ROUND_TRIP_PROBE {
            return Err(format!(
                "does not give back the text it encodes ({ROUND_TRIP_PROBE:?} decodes as \
                 {back:?}): a normalizer that changes text (lowercasing, accents, \
                 whitespace) would train on text that is not the data's"
            ));
        }
        Ok(tok)
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

/// Which of the two accepted forms `t` has (see the module doc).
fn byte_encoding(
    t: &hf::Tokenizer,
    byte_fallback: bool,
) -> std::result::Result<ByteEncoding, String> {
    let has_byte_fallback_step = match t.get_decoder() {
        Some(DecoderWrapper::ByteFallback(_)) => true,
        Some(DecoderWrapper::Sequence(seq)) => seq
            .get_decoders()
            .iter()
            .any(|d| matches!(d, DecoderWrapper::ByteFallback(_))),
        _ => false,
    };
    match (t.get_decoder(), byte_fallback) {
        (Some(DecoderWrapper::ByteLevel(_)), false) => Ok(ByteEncoding::ByteLevel),
        (_, true) if has_byte_fallback_step => Ok(ByteEncoding::ByteFallback),
        (_, true) => Err(
            "model.byte_fallback is true but the decoder has no `ByteFallback` step, so \
             `<0xXX>` tokens would decode as their names"
                .into(),
        ),
        _ => Err(
            "expected a byte-level BPE (decoder type `ByteLevel`, as GPT-2's) or a BPE with \
             byte fallback (`model.byte_fallback: true` and a `ByteFallback` decoder step, as \
             Llama's), found neither: some text would have no encoding"
                .into(),
        ),
    }
}

/// For a byte-fallback tokenizer, the same pipeline minus the `▁` put in
/// front of a text (a `Prepend` normalizer step, or the `Metaspace`
/// pre-tokenizer's prepend scheme), so that a document cut after a newline
/// where [`is_safe_cut`](super::is_safe_cut) holds gives the ids of the whole
/// when its first part is encoded normally and the others with this. Exact
/// when no token contains a newline (byte fallback encodes `\n` as
/// `<0x0A>`): no merge then crosses the newline, and after a safe cut the next
/// part starts with a non-space character, which the whole text has no `▁`
/// before either. `None` for other normalizers and pre-tokenizers (documents
/// are then encoded whole).
fn continuation_pipeline(inner: &hf::Tokenizer, json: &str) -> Option<hf::Tokenizer> {
    if inner.get_vocab(true).keys().any(|t| t.contains('\n')) {
        return None;
    }
    let mut v: serde_json::Value = serde_json::from_str(json).ok()?;
    let is = |n: &serde_json::Value, kinds: &[&str]| {
        n["type"].as_str().is_some_and(|t| kinds.contains(&t))
    };
    let normalizer = &mut v["normalizer"];
    match normalizer["type"].as_str() {
        None => {}
        Some("Sequence") => {
            let steps = normalizer["normalizers"].as_array_mut()?;
            if !steps.iter().all(|n| is(n, &["Prepend", "Replace"])) {
                return None;
            }
            steps.retain(|n| !is(n, &["Prepend"]));
        }
        Some("Prepend") => *normalizer = serde_json::Value::Null,
        Some("Replace") => {}
        Some(_) => return None,
    }
    let pre = &mut v["pre_tokenizer"];
    match pre["type"].as_str() {
        None => {}
        Some("Metaspace") => pre["prepend_scheme"] = "never".into(),
        Some(_) => return None,
    }
    let mut t = hf::Tokenizer::from_bytes(v.to_string().as_bytes()).ok()?;
    t.set_encode_special_tokens(true);
    Some(t)
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
    fn bos(&self) -> u32 {
        BEGIN_OF_TEXT_TOKENS
            .iter()
            .find_map(|t| self.inner.token_to_id(t))
            .unwrap_or(self.eot)
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
        self.gpt2_split || self.continuation.is_some()
    }
    fn encode_continuation(&self, text: &str) -> Vec<u32> {
        let Some(t) = &self.continuation else {
            return self.encode(text);
        };
        match t.encode_fast(text, false) {
            Ok(e) => e.get_ids().to_vec(),
            Err(_) => text.bytes().map(|b| self.byte_ids[b as usize]).collect(),
        }
    }
}

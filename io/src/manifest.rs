//! `manifest.json`: what `prepare` wrote, read back by the loader.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Value of [`Manifest::format`].
pub const MANIFEST_FORMAT: &str = "fugu-webdataset";
/// Current [`Manifest::version`].
pub const MANIFEST_VERSION: u32 = 1;

/// The manifest written next to the shards.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Always [`MANIFEST_FORMAT`].
    pub format: String,
    /// Schema version, [`MANIFEST_VERSION`].
    pub version: u32,
    /// Tokenizer name (`gpt2`).
    pub tokenizer: String,
    /// Number of token ids; every stored id is below it.
    pub vocab_size: u32,
    /// End-of-text id that terminates each document.
    pub eot: u32,
    /// `u16` or `u32`: little-endian element type of `.tokens` members.
    pub dtype: String,
    /// Name and version of the writer.
    pub created_by: String,
    /// Inputs as given to `prepare`.
    pub inputs: Vec<String>,
    /// How documents were assigned to the validation split.
    pub split: SplitRule,
    /// Training split.
    pub train: SplitInfo,
    /// Held-out validation split.
    pub val: SplitInfo,
    /// Totals over both splits.
    pub totals: Totals,
}

/// The deterministic train/validation rule.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SplitRule {
    /// Requested fraction of documents held out.
    pub val_fraction: f64,
    /// Document `i` (0-based, in input order) is held out iff
    /// `val_every > 0 && i % val_every == val_every - 1`.
    pub val_every: u64,
}

/// One split's shards.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct SplitInfo {
    /// Documents in this split.
    pub documents: u64,
    /// Samples (documents or parts of long documents).
    pub samples: u64,
    /// Tokens, EOTs included.
    pub tokens: u64,
    /// Bytes of the split's input text (what bits per byte divide by; 0 in manifests written
    /// before fugu counted them).
    #[serde(default)]
    pub text_bytes: u64,
    /// The shards, in order.
    pub shards: Vec<ShardInfo>,
}

impl SplitInfo {
    /// Tokens per byte of input text: what turns a loss in nats per token into bits per byte
    /// (`loss / ln 2 × tokens / bytes`), comparable across tokenizers. `None` for manifests
    /// that predate text byte counts, or an empty split.
    pub fn tokens_per_byte(&self) -> Option<f64> {
        (self.text_bytes > 0 && self.tokens > 0)
            .then(|| self.tokens as f64 / self.text_bytes as f64)
    }
}

/// One shard file.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ShardInfo {
    /// File name, relative to the manifest's folder.
    pub file: String,
    /// Samples in the shard.
    pub samples: u64,
    /// Tokens in the shard.
    pub tokens: u64,
    /// File size in bytes.
    pub bytes: u64,
    /// Hex sha256 of the file.
    pub sha256: String,
}

/// Totals over both splits.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct Totals {
    /// Documents.
    pub documents: u64,
    /// Samples.
    pub samples: u64,
    /// Tokens.
    pub tokens: u64,
    /// Bytes of input text.
    pub text_bytes: u64,
    /// Shard bytes.
    pub shard_bytes: u64,
    /// Documents that were empty and left out.
    pub empty_documents: u64,
    /// Documents with invalid UTF-8 (replaced by U+FFFD).
    pub invalid_utf8_documents: u64,
    /// Bad inputs skipped under `--skip-bad-samples`.
    pub skipped_bad_inputs: u64,
}

impl Manifest {
    /// Bytes per stored token.
    pub fn token_bytes(&self) -> usize {
        if self.dtype == "u32" {
            4
        } else {
            2
        }
    }

    /// Parses and validates manifest bytes; `path` is used in messages.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Manifest> {
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| Error::Manifest {
            path: path.into(),
            what: format!("not valid manifest JSON: {e}"),
        })?;
        m.validate(path)?;
        Ok(m)
    }

    /// Reads `path` (a `manifest.json`, or a folder containing one).
    /// Returns the manifest and its folder.
    pub fn load(path: &Path) -> Result<(Manifest, PathBuf)> {
        let file = if path.is_dir() {
            path.join("manifest.json")
        } else {
            path.to_path_buf()
        };
        let mut bytes = Vec::new();
        std::fs::File::open(&file)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|e| Error::io(&file, "read manifest", e))?;
        let m = Manifest::parse(&bytes, &file)?;
        let dir = file
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        Ok((m, dir))
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |what: String| Error::Manifest {
            path: path.into(),
            what,
        };
        if self.format != MANIFEST_FORMAT {
            return Err(bad(format!(
                "format is `{}`, expected `{MANIFEST_FORMAT}`",
                self.format
            )));
        }
        if self.version != MANIFEST_VERSION {
            return Err(bad(format!(
                "version {} is not supported (expected {MANIFEST_VERSION})",
                self.version
            )));
        }
        match self.dtype.as_str() {
            "u16" if self.vocab_size <= 65536 => {}
            "u32" => {}
            d => {
                return Err(bad(format!(
                    "dtype `{d}` cannot hold vocab_size {} (expected u16 for vocabularies up to 65536, else u32)",
                    self.vocab_size
                )))
            }
        }
        if self.vocab_size == 0 || self.eot >= self.vocab_size {
            return Err(bad(format!(
                "eot {} must be below vocab_size {}",
                self.eot, self.vocab_size
            )));
        }
        for (name, split) in [("train", &self.train), ("val", &self.val)] {
            let (mut samples, mut tokens) = (0u64, 0u64);
            for s in &split.shards {
                if s.file.is_empty() || s.file.contains('\0') {
                    return Err(bad(format!("{name} shard with an empty file name")));
                }
                if s.sha256.len() != 64 || !s.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(bad(format!(
                        "shard {}: sha256 `{}` is not 64 hex digits",
                        s.file, s.sha256
                    )));
                }
                if s.tokens > s.bytes {
                    return Err(bad(format!(
                        "shard {}: {} tokens cannot fit in {} bytes",
                        s.file, s.tokens, s.bytes
                    )));
                }
                samples = samples
                    .checked_add(s.samples)
                    .ok_or_else(|| bad("overflow".into()))?;
                tokens = tokens
                    .checked_add(s.tokens)
                    .ok_or_else(|| bad("overflow".into()))?;
            }
            if samples != split.samples || tokens != split.tokens {
                return Err(bad(format!(
                    "{name}: shard sums ({samples} samples, {tokens} tokens) differ from the split totals ({} samples, {} tokens)",
                    split.samples, split.tokens
                )));
            }
        }
        Ok(())
    }

    /// A short fingerprint of one split's content (from shard checksums),
    /// stored in loader cursors to refuse resuming on other data.
    pub fn split_fingerprint(&self, split: &SplitInfo) -> String {
        let mut h = Sha256::new();
        for s in &split.shards {
            h.update(s.file.as_bytes());
            h.update(s.sha256.as_bytes());
        }
        hex(&h.finalize()[..8])
    }
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, "read", e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

/// Checks that a shard exists and has the manifest's size, and with `full`
/// also its sha256.
pub fn verify_shard(dir: &Path, info: &ShardInfo, manifest_path: &Path, full: bool) -> Result<()> {
    let path = dir.join(&info.file);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::MissingShard {
                path,
                listed_in: manifest_path.display().to_string(),
            })
        }
        Err(e) => return Err(Error::io(&path, "stat", e)),
    };
    if meta.len() != info.bytes {
        return Err(Error::ChecksumMismatch {
            path,
            what: "size",
            expected: format!("{} bytes", info.bytes),
            actual: format!("{} bytes", meta.len()),
        });
    }
    if full {
        check_sha256(&path, &info.sha256)?;
    }
    Ok(())
}

/// Checks that the file's sha256 is `expected` (hex, any case): reads all
/// of it. A difference is [`Error::ChecksumMismatch`] naming the file.
pub fn check_sha256(path: &Path, expected: &str) -> Result<()> {
    let actual = sha256_file(path)?;
    if actual.eq_ignore_ascii_case(expected) {
        return Ok(());
    }
    Err(Error::ChecksumMismatch {
        path: path.to_path_buf(),
        what: "sha256",
        expected: expected.to_string(),
        actual,
    })
}

//! Error type of fugu-io. Every message names the file, and where it applies
//! the tar member and the byte offset, plus what was expected.

use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the tokenizer, `prepare`, the shard readers and the loader.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system I/O error on a file.
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },

    /// A tar archive that is truncated or whose structure is invalid.
    #[error("{path}: corrupt tar at byte offset {offset}: {what}")]
    Tar {
        path: PathBuf,
        offset: u64,
        what: String,
    },

    /// A sample (tar member) whose content is invalid.
    #[error("{path}: member `{member}` at byte offset {offset}: {what}")]
    BadSample {
        path: PathBuf,
        member: String,
        offset: u64,
        what: String,
    },

    /// A shard listed in the manifest (or matched by a pattern) is absent.
    #[error("{path}: shard file is missing (listed in {listed_in})")]
    MissingShard { path: PathBuf, listed_in: String },

    /// A shard whose size or sha256 differs from the manifest.
    #[error("{path}: {what} mismatch: manifest says {expected}, file has {actual}")]
    ChecksumMismatch {
        path: PathBuf,
        what: &'static str,
        expected: String,
        actual: String,
    },

    /// A manifest that cannot be parsed or is inconsistent.
    #[error("{path}: invalid manifest: {what}")]
    Manifest { path: PathBuf, what: String },

    /// A bad input file given to `prepare`.
    #[error("{path}: {what}")]
    Input { path: PathBuf, what: String },

    /// `prepare` found no document in its inputs; `why` gives the likely
    /// reason.
    #[error("no documents found in {inputs}: {why}")]
    NoDocuments { inputs: String, why: String },

    /// A raw `.bin` token file that is invalid.
    #[error("{path}: byte offset {offset}: {what}")]
    BadTokenFile {
        path: PathBuf,
        offset: u64,
        what: String,
    },

    /// A shard-name pattern that cannot be expanded.
    #[error("invalid shard pattern `{pattern}`: {what}")]
    Pattern { pattern: String, what: String },

    /// Invalid loader or prepare configuration.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A saved cursor that does not belong to this data or configuration.
    #[error("cannot restore loader cursor: {0}")]
    Cursor(String),

    /// Tokenizer failures (unknown name, undecodable id).
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// The background prefetch thread stopped unexpectedly.
    #[error("loader thread stopped: {0}")]
    Thread(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            op,
            source,
        }
    }
}

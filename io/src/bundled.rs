//! The bundled corpus: the public-domain Shakespeare plays and poems (42
//! files, 5 MB of text), compiled into the binary so that `fugu prepare` and
//! the trainer work on a fresh checkout with no download.

/// Name used for the bundled corpus in manifests and messages.
pub const SHAKESPEARE_NAME: &str = "bundled:shakespeare.tar.gz";

/// The gzip-compressed tar of `shakespeare/*.txt` (`data/shakespeare.tar.gz`,
/// rebuilt reproducibly by `data/make_shakespeare_archive.sh`).
pub static SHAKESPEARE_TAR_GZ: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../data/shakespeare.tar.gz"
));

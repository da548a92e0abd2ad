//! The compiled kernels, kept on disk between runs.
//!
//! NVRTC takes seconds to compile `kernels.cu` to machine code (8 s to PTX on one Zen 3
//! core for sm_90, then about as long again to assemble it), which every `--device cuda`
//! process paid at start-up, and a test binary once per backend it built. The cubin is
//! stored under the SHA-256 of everything that determines it (the source, NVRTC's options,
//! the architecture and NVRTC's version), so a changed source or compiler is a miss, never a
//! stale hit. The file's first line holds the SHA-256 of the cubin after it: a damaged file
//! is compiled again and replaced. Files are written atomically (temporary name, fsync,
//! rename); ranks of one job that start together may each compile, and one that finds the
//! file stored meanwhile does not write it again.
//!
//! Where: `FUGU_KERNEL_CACHE` (a directory; `off` disables), else
//! `$XDG_CACHE_HOME/fugu/kernels`, else `$HOME/.cache/fugu/kernels`. A cache that cannot be
//! written costs a note on stderr, not the run.

use super::{kernels_cubin, nvrtc, KERNELS_SOURCE, NVRTC_OPTIONS};
use anyhow::Result;
use fugu_io::manifest::hex;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Environment variable: the kernel cache's directory, or `off`.
pub const KERNEL_CACHE_ENV: &str = "FUGU_KERNEL_CACHE";

/// The first line of a cache file, before the cubin's hash.
const HEADER: &[u8] = b"fugu kernels.cu cubin, sha256 ";

/// Where the kernels came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compiled {
    /// NVRTC compiled them now.
    Now,
    /// A cache file.
    Cached,
}

/// The kernel cache's directory as the environment says ([`KERNEL_CACHE_ENV`]), `None` when
/// disabled or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    crate::user_cache::cache_path(KERNEL_CACHE_ENV, "kernels")
}

/// The cache file of `kernels.cu` compiled for compute capability `major.minor` by this
/// NVRTC, in `dir`.
pub fn cache_file(dir: &Path, major: i32, minor: i32) -> Result<PathBuf> {
    let (nv_major, nv_minor) = nvrtc::version()?;
    let mut key = Sha256::new();
    for part in [
        KERNELS_SOURCE,
        &NVRTC_OPTIONS.join(" "),
        &format!("sm_{major}{minor} cubin"),
        &format!("nvrtc {nv_major}.{nv_minor}"),
    ] {
        key.update((part.len() as u64).to_le_bytes());
        key.update(part.as_bytes());
    }
    let name = format!("kernels-sm{major}{minor}-{}.cubin", hex(&key.finalize()));
    Ok(dir.join(name))
}

/// The cubin in cache file `file`, if it is there and whole (its header's hash matches).
fn read_whole(file: &Path) -> Option<Vec<u8>> {
    let mut bytes = std::fs::read(file).ok()?;
    let end = bytes.iter().position(|&b| b == b'\n')?;
    let want = bytes[..end].strip_prefix(HEADER)?;
    if hex(&Sha256::digest(&bytes[end + 1..])).as_bytes() != want {
        return None;
    }
    bytes.drain(..=end);
    Some(bytes)
}

/// `kernels.cu` as machine code for compute capability `major.minor` ([`kernels_cubin`]):
/// from the cache in `dir` when it holds a whole file for this source, architecture and
/// NVRTC, else compiled by NVRTC (and stored there; a note on stderr says so, and whether
/// storing failed). `dir: None` compiles every time. Call only when NVRTC is available.
pub fn kernels(dir: Option<&Path>, major: i32, minor: i32) -> Result<(Vec<u8>, Compiled)> {
    let Some(dir) = dir else {
        return Ok((kernels_cubin(major, minor)?, Compiled::Now));
    };
    let file = cache_file(dir, major, minor)?;
    if let Some(cubin) = read_whole(&file) {
        return Ok((cubin, Compiled::Cached));
    }
    eprintln!(
        "note: compiling the CUDA kernels for sm_{major}{minor} with NVRTC (seconds; kept in {} \
         for the next runs)",
        dir.display()
    );
    let cubin = kernels_cubin(major, minor)?;
    if read_whole(&file).is_some() {
        // Another process (a rank of the same job) stored it while this one compiled.
        return Ok((cubin, Compiled::Now));
    }
    let mut body = HEADER.to_vec();
    body.extend_from_slice(hex(&Sha256::digest(&cubin)).as_bytes());
    body.push(b'\n');
    body.extend_from_slice(&cubin);
    let stored = std::fs::create_dir_all(dir)
        .map_err(anyhow::Error::from)
        .and_then(|()| crate::checkpoint::atomic::write_bytes(&file, &body));
    if let Err(e) = stored {
        eprintln!(
            "note: could not keep the compiled kernels in {}: {e:#} (the next run compiles \
             them again; {KERNEL_CACHE_ENV}=DIR puts the cache elsewhere)",
            file.display()
        );
    }
    Ok((cubin, Compiled::Now))
}

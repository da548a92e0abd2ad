//! The compiled kernels, kept on disk between runs.
//!
//! NVRTC takes seconds to compile `kernels.cu` (8.4 s on one Zen 3 core for sm_90), which
//! every `--device cuda` process paid at start-up, and a test binary once per backend it
//! built. The PTX is stored under the SHA-256 of everything that determines it (the source,
//! NVRTC's options, the architecture and NVRTC's version), so a changed source or compiler
//! is a miss, never a stale hit. The file's first line holds the SHA-256 of the PTX after
//! it: a damaged file is compiled again and replaced. Files are written atomically
//! (temporary name, fsync, rename): ranks of one job that start together may each compile,
//! and the last rename puts the same bytes in place.
//!
//! Where: `FUGU_KERNEL_CACHE` (a directory; `off` disables), else
//! `$XDG_CACHE_HOME/fugu/kernels`, else `$HOME/.cache/fugu/kernels`. A cache that cannot be
//! written costs a note on stderr, not the run. (The driver's own compilation of the PTX for
//! the GPU at module load has its own cache, CUDA's `~/.nv/ComputeCache`.)

use super::{compile_kernels, KERNELS_SOURCE, NVRTC_OPTIONS};
use anyhow::Result;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Environment variable: the kernel cache's directory, or `off`.
pub const KERNEL_CACHE_ENV: &str = "FUGU_KERNEL_CACHE";

/// The first line of a cache file, before the PTX's hash.
const HEADER: &str = "// fugu kernels.cu PTX, sha256 ";

/// Where the PTX came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PtxFrom {
    /// NVRTC compiled it now.
    Compiled,
    /// A cache file.
    Cache,
}

/// The kernel cache's directory as the environment says ([`KERNEL_CACHE_ENV`]), `None` when
/// disabled or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    crate::user_cache::cache_path(KERNEL_CACHE_ENV, "kernels")
}

/// NVRTC's version (the library must be loadable: `super::nvrtc_available`).
fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers for the duration of the call; the library was found.
    let _ = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (major, minor)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The cache file of `kernels.cu` compiled for compute capability `major.minor` by this
/// NVRTC, in `dir`.
pub fn cache_file(dir: &Path, major: i32, minor: i32) -> PathBuf {
    let (nv_major, nv_minor) = nvrtc_version();
    let mut key = Sha256::new();
    for part in [
        KERNELS_SOURCE,
        &NVRTC_OPTIONS.join(" "),
        &format!("compute_{major}{minor}"),
        &format!("nvrtc {nv_major}.{nv_minor}"),
    ] {
        key.update((part.len() as u64).to_le_bytes());
        key.update(part.as_bytes());
    }
    dir.join(format!(
        "kernels-sm{major}{minor}-{}.ptx",
        hex(&key.finalize())
    ))
}

/// The PTX of `text`'s cache file if it is whole (its header's hash matches).
fn verified(text: &str) -> Option<&str> {
    let (first, ptx) = text.split_once('\n')?;
    let want = first.strip_prefix(HEADER)?;
    (hex(&Sha256::digest(ptx.as_bytes())) == want).then_some(ptx)
}

/// The PTX in cache file `file`, if it is there and whole.
fn read_whole(file: &Path) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    verified(&text).map(str::to_string)
}

/// `kernels.cu` as PTX for compute capability `major.minor`: from the cache in `dir` when it
/// holds a whole file for this source, architecture and NVRTC, else compiled by NVRTC (and
/// stored there; a note on stderr says so, and whether storing failed). `dir: None`
/// compiles every time. Call only when NVRTC is available.
pub fn kernels_ptx(dir: Option<&Path>, major: i32, minor: i32) -> Result<(String, PtxFrom)> {
    let Some(dir) = dir else {
        return Ok((compile_kernels(major, minor)?.to_src(), PtxFrom::Compiled));
    };
    let file = cache_file(dir, major, minor);
    if let Some(ptx) = read_whole(&file) {
        return Ok((ptx, PtxFrom::Cache));
    }
    eprintln!(
        "note: compiling the CUDA kernels for sm_{major}{minor} with NVRTC (seconds; kept in {} \
         for the next runs)",
        dir.display()
    );
    let ptx = compile_kernels(major, minor)?.to_src();
    if read_whole(&file).is_some() {
        // Another process (a rank of the same job) stored it while this one compiled.
        return Ok((ptx, PtxFrom::Compiled));
    }
    let body = format!("{HEADER}{}\n{ptx}", hex(&Sha256::digest(ptx.as_bytes())));
    let stored = std::fs::create_dir_all(dir)
        .map_err(anyhow::Error::from)
        .and_then(|()| crate::checkpoint::atomic::write_bytes(&file, body.as_bytes()));
    if let Err(e) = stored {
        eprintln!(
            "note: could not keep the compiled kernels in {}: {e:#} (the next run compiles \
             them again; {KERNEL_CACHE_ENV}=DIR puts the cache elsewhere)",
            file.display()
        );
    }
    Ok((ptx, PtxFrom::Compiled))
}

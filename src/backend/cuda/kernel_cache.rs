//! The compiled kernels, kept on disk between runs.
//!
//! NVRTC takes seconds to compile `kernels.cu` to machine code (8 s to PTX on one Zen 3
//! core for sm_90, then about as long again to assemble it), which every `--device cuda`
//! process paid at start-up, and a test binary once per backend it built. The cubin is
//! stored under the SHA-256 of everything that determines it (the source, NVRTC's options,
//! the architecture and NVRTC's version), so a changed source or compiler is a miss, never a
//! stale hit. The file's first line holds the SHA-256 of the cubin after it: a damaged file
//! is compiled again and replaced. Files are written atomically (temporary name, fsync,
//! rename).
//!
//! Ranks of one job start together and share the cache directory (a shared home): the first to
//! find the file missing compiles and stores it while the others wait for the file
//! ([`crate::make_once`]: a lock file beside it), instead of each compiling (seconds of a core
//! each) and each writing the same 1-2 MB to a shared file system.
//!
//! Where: `FUGU_KERNEL_CACHE` (a directory; `off` disables), else
//! `$XDG_CACHE_HOME/fugu/kernels`, else `$HOME/.cache/fugu/kernels`. A cache that cannot be
//! written costs a note on stderr, not the run.

use super::{kernels_cubin, nvrtc, KERNELS_SOURCE, NVRTC_OPTIONS};
pub use crate::make_once::LockTiming;
use crate::make_once::{found_or_made, Made};
use anyhow::Result;
use fugu_io::manifest::hex;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// Environment variable: the kernel cache's directory, or `off`.
pub const KERNEL_CACHE_ENV: &str = "FUGU_KERNEL_CACHE";

/// The first line of a cache file, before the cubin's hash.
const HEADER: &[u8] = b"fugu kernels.cu cubin, sha256 ";

/// Where the kernels came from: compiled now, a cache file, or a cache file that another
/// process (holding the lock) compiled and stored while this one waited.
pub type Compiled = Made;

/// The kernel cache's directory as the environment says ([`KERNEL_CACHE_ENV`]), `None` when
/// disabled or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    crate::user_cache::cache_path(KERNEL_CACHE_ENV, "kernels")
}

/// The cache file of `kernels.cu` compiled for compute capability `major.minor` by this
/// NVRTC, in `dir`.
pub fn cache_file(dir: &Path, major: i32, minor: i32) -> Result<PathBuf> {
    let key = build_key(major, minor)?;
    Ok(dir.join(format!("kernels-sm{major}{minor}-{key}.cubin")))
}

/// The SHA-256 (hex) of everything that determines the kernels' machine code for compute
/// capability `major.minor`: the source, NVRTC's options, the architecture and NVRTC's version.
pub fn build_key(major: i32, minor: i32) -> Result<String> {
    let (nv_major, nv_minor) = nvrtc::version()?;
    let mut key = Sha256::new();
    for part in [
        KERNELS_SOURCE,
        &NVRTC_OPTIONS.join(" "),
        &format!("sm_{} cubin", super::arch_name(major, minor)),
        &format!("nvrtc {nv_major}.{nv_minor}"),
    ] {
        key.update((part.len() as u64).to_le_bytes());
        key.update(part.as_bytes());
    }
    Ok(hex(&key.finalize()))
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
/// storing failed), or waited for where another process is compiling it. `dir: None` compiles
/// every time. Call only when NVRTC is available.
pub fn kernels(dir: Option<&Path>, major: i32, minor: i32) -> Result<(Vec<u8>, Compiled)> {
    let Some(dir) = dir else {
        return Ok((kernels_cubin(major, minor)?, Compiled::Now));
    };
    let file = cache_file(dir, major, minor)?;
    cached_or_compiled(&file, LockTiming::default(), || {
        eprintln!(
            "note: compiling the CUDA kernels for sm_{major}{minor} with NVRTC (seconds; kept \
             in {} for the next runs)",
            dir.display()
        );
        kernels_cubin(major, minor)
    })
}

/// The cubin in cache file `file` when it is whole; else, where another process holds the
/// file's lock, the file it stores (waiting as `timing` says); else `compile`'s, stored in
/// `file` (under the lock, unless the wait ran out or the holder failed).
pub fn cached_or_compiled(
    file: &Path,
    timing: LockTiming,
    compile: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<(Vec<u8>, Compiled)> {
    let what = "compiling the CUDA kernels";
    found_or_made(
        file,
        what,
        timing,
        || read_whole(file),
        || {
            let cubin = compile()?;
            if read_whole(file).is_some() {
                // Another process stored it while this one compiled (this one waited and gave up).
                return Ok(cubin);
            }
            if let Err(e) = store(file, &cubin) {
                eprintln!(
                "note: could not keep the compiled kernels in {}: {e:#} (the next run compiles \
                 them again; {KERNEL_CACHE_ENV}=DIR puts the cache elsewhere)",
                file.display()
            );
            }
            Ok(cubin)
        },
    )
}

/// Writes `cubin` to cache file `file` atomically, after its header line.
fn store(file: &Path, cubin: &[u8]) -> Result<()> {
    let mut body = HEADER.to_vec();
    body.extend_from_slice(hex(&Sha256::digest(cubin)).as_bytes());
    body.push(b'\n');
    body.extend_from_slice(cubin);
    crate::atomic_write::write_bytes(file, &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::make_once::lock_path;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    /// A fresh cache directory and the file of its kernels.
    fn cache(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fugu-kcache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("kernels-sm90-test.cubin")
    }

    const FAST: LockTiming = LockTiming {
        wait: Duration::from_secs(20),
        stale: Duration::from_secs(600),
        poll: Duration::from_millis(10),
    };

    /// A compile that counts its calls and returns `bytes`.
    fn compiler<'a>(
        calls: &'a AtomicUsize,
        bytes: &'a [u8],
    ) -> impl FnOnce() -> Result<Vec<u8>> + 'a {
        move || {
            calls.fetch_add(1, Ordering::Relaxed);
            Ok(bytes.to_vec())
        }
    }

    #[test]
    fn a_miss_compiles_and_stores_then_hits_and_leaves_no_lock() {
        let file = cache("miss");
        let calls = AtomicUsize::new(0);
        let got = cached_or_compiled(&file, FAST, compiler(&calls, b"cubin")).unwrap();
        assert_eq!(got, (b"cubin".to_vec(), Compiled::Now));
        assert!(!lock_path(&file).exists());
        let got = cached_or_compiled(&file, FAST, compiler(&calls, b"other")).unwrap();
        assert_eq!(got, (b"cubin".to_vec(), Compiled::Cached));
        assert_eq!(calls.load(Ordering::Relaxed), 1);
    }

    /// Where another process holds the lock, the file it stores is used: nothing compiled.
    #[test]
    fn a_held_lock_is_waited_for() {
        let file = cache("held");
        std::fs::File::create(lock_path(&file)).unwrap();
        let holder = {
            let file = file.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                store(&file, b"theirs").unwrap();
                std::fs::remove_file(lock_path(&file)).unwrap();
            })
        };
        let calls = AtomicUsize::new(0);
        let got = cached_or_compiled(&file, FAST, compiler(&calls, b"mine")).unwrap();
        holder.join().unwrap();
        assert_eq!(got, (b"theirs".to_vec(), Compiled::Waited));
        assert_eq!(calls.load(Ordering::Relaxed), 0);
    }

    /// A holder that goes without storing, a wait that runs out: this process compiles (and,
    /// holding no lock, leaves the other's in place).
    #[test]
    fn a_failed_or_slow_holder_means_compiling_here() {
        let file = cache("failed");
        std::fs::File::create(lock_path(&file)).unwrap();
        let holder = {
            let file = file.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                std::fs::remove_file(lock_path(&file)).unwrap();
            })
        };
        let calls = AtomicUsize::new(0);
        let got = cached_or_compiled(&file, FAST, compiler(&calls, b"mine")).unwrap();
        holder.join().unwrap();
        assert_eq!(got, (b"mine".to_vec(), Compiled::Now));
        assert_eq!(read_whole(&file), Some(b"mine".to_vec()));

        let file = cache("slow");
        std::fs::File::create(lock_path(&file)).unwrap();
        let short = LockTiming {
            wait: Duration::from_millis(100),
            ..FAST
        };
        let got = cached_or_compiled(&file, short, compiler(&calls, b"mine")).unwrap();
        assert_eq!(got, (b"mine".to_vec(), Compiled::Now));
        assert!(
            lock_path(&file).exists(),
            "the holder's lock is the holder's"
        );
        assert_eq!(calls.load(Ordering::Relaxed), 2);
    }

    /// A lock older than `stale` is taken over at once (and removed when done).
    #[test]
    fn a_stale_lock_is_taken_over() {
        let file = cache("stale");
        let lock = std::fs::File::create(lock_path(&file)).unwrap();
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        lock.set_modified(old).unwrap();
        let calls = AtomicUsize::new(0);
        let start = Instant::now();
        let got = cached_or_compiled(&file, FAST, compiler(&calls, b"mine")).unwrap();
        assert_eq!(got, (b"mine".to_vec(), Compiled::Now));
        assert!(start.elapsed() < FAST.wait, "waited for a stale lock");
        assert!(!lock_path(&file).exists());
    }
}

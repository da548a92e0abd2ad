//! A file that several processes may need at the same moment and only one should make: the
//! CUDA kernels' cubin in the kernel cache (`backend::cuda::kernel_cache`), the bundled
//! corpus `fugu train` prepares on first use (`train::data`).
//!
//! Ranks of one job (and jobs started together) find it missing together: the first takes a
//! lock file beside it (`<path>.lock`, created exclusively) and makes it; the others wait for
//! it instead of each making it (seconds to a minute of a core each) and getting in each
//! other's way (two writers of one folder, a clean-up removing another's temporary files). A
//! waiter makes it after all when the lock goes without the thing appearing (the holder
//! failed) or after [`LockTiming::wait`]; a lock older than [`LockTiming::stale`] (left by a
//! killed process) is taken over.

use anyhow::Result;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a process waits for another's work, and when a lock is left over.
#[derive(Clone, Copy, Debug)]
pub struct LockTiming {
    /// Longest wait for the lock holder's result before making it after all.
    pub wait: Duration,
    /// Age past which a lock file is taken to be left by a process that died.
    pub stale: Duration,
    /// How often a waiter looks for the result.
    pub poll: Duration,
}

impl Default for LockTiming {
    /// The work takes seconds to a minute (a slow or busy node): wait 3 minutes, take over a
    /// lock of 10.
    fn default() -> Self {
        LockTiming {
            wait: Duration::from_secs(180),
            stale: Duration::from_secs(600),
            poll: Duration::from_millis(250),
        }
    }
}

/// Where a result came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Made {
    /// This process made it now.
    Now,
    /// It was there already.
    Cached,
    /// Another process (holding the lock) made it while this one waited.
    Waited,
}

/// `found()` when it has the result; else, where another process holds `path`'s lock, the
/// result it makes (waiting as `timing` says); else `make()`'s, under the lock (unless the
/// wait ran out or the holder failed). `what` names the work in the notes on stderr
/// ("compiling the CUDA kernels").
pub fn found_or_made<T>(
    path: &Path,
    what: &str,
    timing: LockTiming,
    found: impl Fn() -> Option<T>,
    make: impl FnOnce() -> Result<T>,
) -> Result<(T, Made)> {
    if let Some(t) = found() {
        return Ok((t, Made::Cached));
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = std::fs::create_dir_all(dir);
    }
    let lock = Lock::take(path, timing.stale);
    if lock.is_none() {
        if let Some(t) = wait_for(path, what, timing, &found) {
            return Ok((t, Made::Waited));
        }
    } else if let Some(t) = found() {
        // Made by a holder that let the lock go between the first look and this one's take.
        return Ok((t, Made::Waited));
    }
    let t = make()?;
    drop(lock);
    Ok((t, Made::Now))
}

/// The lock file of `path`, held by this process while it makes it (removed on drop).
struct Lock(PathBuf);

impl Lock {
    /// The lock, or `None` where another process holds it. A lock older than `stale` is
    /// removed and taken; one that cannot be created for another reason (a read-only folder)
    /// is not needed: this process makes the result, and storing it fails there with its own
    /// error or note.
    fn take(path: &Path, stale: Duration) -> Option<Lock> {
        let lock = lock_path(path);
        for _ in 0..2 {
            match std::fs::File::create_new(&lock) {
                Ok(_) => return Some(Lock(lock)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let age = std::fs::metadata(&lock)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.elapsed().ok());
                    if age.is_none_or(|a| a < stale) {
                        return None;
                    }
                    eprintln!(
                        "note: taking over {} (older than {} s: left by a process that \
                         stopped)",
                        lock.display(),
                        stale.as_secs()
                    );
                    let _ = std::fs::remove_file(&lock);
                }
                Err(_) => return Some(Lock(PathBuf::new())),
            }
        }
        None
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        if !self.0.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

/// The lock file of `path`: `<path>.lock` beside it.
pub fn lock_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    PathBuf::from(name)
}

/// Waits for the holder of `path`'s lock: `found()` once it has the result; `None` when the
/// lock goes without a result (the holder failed) or the wait runs out.
fn wait_for<T>(
    path: &Path,
    what: &str,
    timing: LockTiming,
    found: &impl Fn() -> Option<T>,
) -> Option<T> {
    eprintln!(
        "note: waiting for another process {what} ({} exists; up to {} s)",
        lock_path(path).display(),
        timing.wait.as_secs()
    );
    let start = Instant::now();
    loop {
        if let Some(t) = found() {
            return Some(t);
        }
        if !lock_path(path).exists() {
            // Made just before the lock went, or never.
            return found();
        }
        if start.elapsed() >= timing.wait {
            eprintln!("note: gave up waiting; {what} in this process");
            return None;
        }
        std::thread::sleep(timing.poll);
    }
}

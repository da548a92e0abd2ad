//! One run per output directory: an advisory `flock(2)` on `OUT/.fugu.lock`, taken by rank 0
//! before it touches the directory and held until the process exits. A second `fugu train` on
//! the same `--out` (any `--resume` mode) is refused with the holder's host and pid, so two
//! runs can never delete each other's checkpoints or interleave `metrics.jsonl`.
//!
//! On a filesystem without `flock` support (some parallel filesystems are mounted that way) the
//! run goes on with a warning: concurrent runs on that folder are then not detected.

use anyhow::{bail, Context, Result};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::Path;

/// Name of the lock file inside the output directory.
pub const LOCK_FILE: &str = ".fugu.lock";

/// The held lock; released when dropped (or when the process ends, however it ends).
#[derive(Debug)]
pub struct RunLock {
    _file: Option<File>,
}

impl RunLock {
    /// Locks `dir` (which must exist) for this run, or fails naming the run that holds it.
    pub fn acquire(dir: &Path) -> Result<RunLock> {
        let path = dir.join(LOCK_FILE);
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening the run lock {}", path.display()))?;
        // SAFETY: flock on a file descriptor that `f` keeps open; it touches no memory.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EWOULDBLOCK) => {
                    let mut holder = String::new();
                    let _ = f.read_to_string(&mut holder);
                    let holder = match holder.trim() {
                        "" => "holder unknown".to_string(),
                        h => h.to_string(),
                    };
                    bail!(
                        "{} is in use by another fugu run ({holder}); wait for it to end, or \
                         give this run another --out",
                        dir.display()
                    );
                }
                Some(libc::ENOLCK | libc::EOPNOTSUPP | libc::ENOSYS) => {
                    eprintln!(
                        "warning: cannot lock {} ({err}): this filesystem does not support \
                         flock, so another run on the same --out would not be detected",
                        path.display()
                    );
                    return Ok(RunLock { _file: None });
                }
                _ => return Err(err).with_context(|| format!("locking {}", path.display())),
            }
        }
        f.set_len(0)?;
        f.rewind()?;
        writeln!(
            f,
            "host {} pid {}",
            super::dist::hostname(),
            std::process::id()
        )?;
        f.flush()?;
        Ok(RunLock { _file: Some(f) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_folder_is_refused_until_the_first_is_dropped() {
        let dir = std::env::temp_dir().join(format!("fugu-lock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = RunLock::acquire(&dir).unwrap();
        // flock locks belong to the open file description: a second open in this process
        // conflicts just as another process would.
        let e = RunLock::acquire(&dir).unwrap_err().to_string();
        assert!(e.contains("in use by another fugu run"), "{e}");
        assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
        drop(first);
        RunLock::acquire(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

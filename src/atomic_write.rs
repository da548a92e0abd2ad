//! Crash-safe file and directory writes: write under a temporary name, fsync, rename, fsync
//! the parent directory.

use anyhow::{Context, Result};
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::Path;

/// Prefix of every temporary name fugu leaves in a checkpoint or output directory.
pub const TMP_PREFIX: &str = ".tmp-";

/// fsyncs a directory, so that renames and creations inside it are durable.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("fsync of directory {}", dir.display()))
}

/// Writes `path` atomically: the content goes to `.tmp-NAME-PID` beside it, is flushed and
/// fsynced, renamed over `path`, and the directory is fsynced. On error the temporary file is
/// removed and `path` is untouched.
pub fn write_file(path: &Path, body: impl FnOnce(&mut dyn Write) -> Result<()>) -> Result<()> {
    let dir = parent(path);
    let name = path
        .file_name()
        .with_context(|| format!("{} has no file name", path.display()))?;
    let tmp = dir.join(format!(
        "{TMP_PREFIX}{}-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = BufWriter::with_capacity(1 << 20, f);
        body(&mut w).with_context(|| format!("writing {}", path.display()))?;
        let f = w
            .into_inner()
            .map_err(|e| e.into_error())
            .with_context(|| format!("writing {}", path.display()))?;
        f.sync_all()
            .with_context(|| format!("fsync of {}", tmp.display()))?;
        fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
        return result;
    }
    sync_dir(dir)
}

/// [`write_file`] for bytes already in memory.
pub fn write_bytes(path: &Path, bytes: &[u8]) -> Result<()> {
    write_file(path, |w| Ok(w.write_all(bytes)?))
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Moves the complete directory `src` to `dst`, atomically replacing an existing `dst`.
///
/// If `dst` exists, the two are swapped with `renameat2(RENAME_EXCHANGE)` (Linux) and the old
/// content, now at `src`, is deleted. Where the exchange is not supported, the old `dst` is
/// first renamed to `old` (a `.tmp-old-` name that [`super::clean_stale_tmp`] renames back if
/// the process dies before `src` takes its place). The parent directory is fsynced once
/// `dst` is in place. Any error before that leaves the old `dst` where it was.
pub fn replace_dir(src: &Path, dst: &Path, old: &Path) -> Result<()> {
    replace_dir_with(src, dst, old, true)
}

pub(crate) fn replace_dir_with(src: &Path, dst: &Path, old: &Path, exchange: bool) -> Result<()> {
    let dir = parent(dst);
    let move_err = || format!("renaming {} to {}", src.display(), dst.display());
    if fs::symlink_metadata(dst).is_err() {
        fs::rename(src, dst).with_context(move_err)?;
        return sync_dir(dir);
    }
    if exchange && exchange_paths(src, dst).with_context(move_err)? {
        sync_dir(dir)?;
        // `src` now holds the old checkpoint; a leftover is removed by clean_stale_tmp.
        let _ = fs::remove_dir_all(src);
        return Ok(());
    }
    fs::rename(dst, old).with_context(|| {
        format!(
            "moving the old {} aside to {}",
            dst.display(),
            old.display()
        )
    })?;
    if let Err(e) = fs::rename(src, dst) {
        let _ = fs::rename(old, dst);
        return Err(e).with_context(move_err);
    }
    sync_dir(dir)?;
    let _ = fs::remove_dir_all(old);
    Ok(())
}

/// Swaps two paths atomically. `Ok(false)` where the kernel or file system cannot.
#[cfg(target_os = "linux")]
fn exchange_paths(a: &Path, b: &Path) -> std::io::Result<bool> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let ca = CString::new(a.as_os_str().as_bytes())?;
    let cb = CString::new(b.as_os_str().as_bytes())?;
    // SAFETY: both arguments are valid NUL-terminated paths that outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOSYS) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) => Ok(false),
        _ => Err(e),
    }
}

#[cfg(not(target_os = "linux"))]
fn exchange_paths(_a: &Path, _b: &Path) -> std::io::Result<bool> {
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("fugu-atomic-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn write_file_replaces_and_cleans_up_on_error() {
        let d = scratch("write");
        let p = d.join("a.json");
        write_bytes(&p, b"one").unwrap();
        write_bytes(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        let e = write_file(&p, |w| {
            w.write_all(b"partial")?;
            anyhow::bail!("injected failure")
        })
        .unwrap_err();
        assert!(format!("{e:#}").contains("injected failure"), "{e:#}");
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(
            fs::read_dir(&d).unwrap().count(),
            1,
            "temporary file left behind"
        );
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn replace_dir_with_and_without_exchange() {
        for exchange in [true, false] {
            let d = scratch(&format!("replace-{exchange}"));
            let (src, dst, old) = (d.join(".tmp-new"), d.join("ckpt"), d.join(".tmp-old"));
            fs::create_dir(&src).unwrap();
            fs::write(src.join("f"), "new").unwrap();
            replace_dir_with(&src, &dst, &old, exchange).unwrap(); // dst absent
            assert_eq!(fs::read_to_string(dst.join("f")).unwrap(), "new");
            fs::create_dir(&src).unwrap();
            fs::write(src.join("f"), "newer").unwrap();
            replace_dir_with(&src, &dst, &old, exchange).unwrap(); // dst present
            assert_eq!(fs::read_to_string(dst.join("f")).unwrap(), "newer");
            assert!(!src.exists() && !old.exists());
            // A missing source fails and leaves dst alone.
            assert!(replace_dir_with(&src, &dst, &old, exchange).is_err());
            assert_eq!(fs::read_to_string(dst.join("f")).unwrap(), "newer");
            fs::remove_dir_all(&d).unwrap();
        }
    }
}

//! Replacing an output folder (a prepared dataset) atomically.
//!
//! [`Staging::begin`] checks the output folder, cleans up what a killed
//! earlier run left next to it, and creates an empty temporary sibling
//! `PARENT/.NAME.tmp-PID`. The caller writes everything there;
//! [`Staging::commit`] fsyncs it and swaps it in. Dropping a `Staging`
//! without committing removes the temporary folder (best effort).
//!
//! **Why a SIGKILL at any moment leaves a complete dataset.** The old
//! dataset is never written to: only renamed, as a whole, and deleted once
//! the new one is in place. At every instant one of these holds:
//!
//! 1. before the swap: `OUT` is the old dataset untouched, and a partial
//!    `.NAME.tmp-PID` may exist (the next run deletes it);
//! 2. between the two renames of the swap: `OUT` is missing and the old
//!    dataset, complete, is `.NAME.old-PID` (the next run renames it back
//!    before doing anything else: it is the only copy);
//! 3. after the swap: `OUT` is the new dataset, whose files and folder were
//!    fsynced before it was renamed in, and `.NAME.old-PID` may still exist,
//!    whole or partly deleted (the next run deletes it).
//!
//! Renames within one folder are atomic, so there is no fourth state. The
//! parent folder is fsynced after the renames, so after a power loss the
//! same states hold. Two `prepare` runs into the same folder at the same
//! time: the first holds an exclusive lock on `PARENT/.NAME.lock` from
//! before its clean-up until its `Staging` is dropped, and the second is
//! refused at once, naming the output folder.

use crate::error::{Error, Result};
use crate::manifest::MANIFEST_FORMAT;
use std::path::{Path, PathBuf};

/// A temporary folder that becomes the output folder on [`Staging::commit`].
pub(crate) struct Staging {
    /// The output folder to create or replace.
    out: PathBuf,
    /// Its parent folder (`.` for a bare name).
    parent: PathBuf,
    /// Its file name.
    name: String,
    /// The temporary folder `.NAME.tmp-PID`.
    dir: PathBuf,
    /// Set once the temporary folder has been renamed into place.
    committed: bool,
    /// `.NAME.lock`, locked for as long as this staging lives (dropped last).
    _lock: OutputLock,
}

/// Which kind of leftover a sibling of the output folder is.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Leftover {
    /// `.NAME.tmp-PID`: a new dataset that was never swapped in.
    Tmp,
    /// `.NAME.old-PID`: an old dataset moved aside for the swap.
    Old,
}

impl Staging {
    /// Checks `out_dir` (missing, an empty folder or a fugu dataset; a
    /// symbolic link is followed), creates its parent if missing, cleans up
    /// leftovers of killed earlier runs and creates the temporary folder.
    pub(crate) fn begin(out_dir: &Path) -> Result<Staging> {
        let out = resolve_link(out_dir)?;
        let name = out
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                Error::Config(format!(
                    "output folder `{}` must end in a folder name (UTF-8)",
                    out_dir.display()
                ))
            })?
            .to_string();
        let parent = match out.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        std::fs::create_dir_all(&parent)
            .map_err(|e| Error::io(&parent, "create output folder's parent", e))?;
        let lock = OutputLock::take(&parent, &name, out_dir)?;
        clean_leftovers(&parent, &name, &out)?;
        check_replaceable(&out)?;
        let dir = parent.join(sibling(&name, Leftover::Tmp, std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| Error::io(&dir, "create temporary folder", e))?;
        Ok(Staging {
            out,
            parent,
            name,
            dir,
            committed: false,
            _lock: lock,
        })
    }

    /// The temporary folder to write into.
    pub(crate) fn path(&self) -> &Path {
        &self.dir
    }

    /// Fsyncs the temporary folder and swaps it in for the output folder
    /// (see the module documentation for the order of the steps).
    pub(crate) fn commit(mut self) -> Result<()> {
        sync_dir(&self.dir)?;
        let exists = std::fs::symlink_metadata(&self.out).is_ok();
        if !exists {
            rename(&self.dir, &self.out, "rename the new dataset into place")?;
            self.committed = true;
            return sync_dir(&self.parent);
        }
        let old = self
            .parent
            .join(sibling(&self.name, Leftover::Old, std::process::id()));
        rename(&self.out, &old, "move the old dataset aside")?;
        if let Err(e) = rename(&self.dir, &self.out, "rename the new dataset into place") {
            // Put the old dataset back; if that fails too, the next run
            // restores it from `old`.
            let _ = std::fs::rename(&old, &self.out);
            return Err(e);
        }
        self.committed = true;
        sync_dir(&self.parent)?;
        if let Err(e) = remove_any(&old) {
            eprintln!(
                "warning: the new dataset is in place but the old one could not be deleted: {e}"
            );
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The exclusive lock `PARENT/.NAME.lock` of one output folder: held from before the clean-up
/// of leftovers until the staging ends (also when the process is killed: the kernel releases
/// it), and its file removed then, so that nothing is left beside the dataset.
struct OutputLock {
    path: PathBuf,
    /// Holds the lock until dropped.
    _file: std::fs::File,
}

impl OutputLock {
    /// Takes the lock, or refuses when another process holds it. A lock file removed by its
    /// previous holder between our open and our lock is not a lock: then it starts over.
    fn take(parent: &Path, name: &str, out_dir: &Path) -> Result<OutputLock> {
        use std::os::unix::fs::MetadataExt;
        let path = parent.join(format!(".{name}.lock"));
        loop {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(|e| Error::io(&path, "create the output folder's lock", e))?;
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(Error::Config(format!(
                        "another `fugu prepare` is writing {} now (it holds {}); wait for it to \
                         finish, or choose another --out",
                        out_dir.display(),
                        path.display()
                    )))
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(Error::io(&path, "lock", e)),
            }
            let same = match (file.metadata(), std::fs::metadata(&path)) {
                (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
                _ => false,
            };
            if same {
                return Ok(OutputLock { path, _file: file });
            }
        }
    }
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        // Removed while still held, then unlocked when `file` closes.
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `out_dir`, or the folder it points to when it is a symbolic link.
fn resolve_link(out_dir: &Path) -> Result<PathBuf> {
    match std::fs::symlink_metadata(out_dir) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(out_dir)
            .map_err(|e| Error::io(out_dir, "resolve the output folder's link", e)),
        _ => Ok(out_dir.to_path_buf()),
    }
}

/// Name of a leftover sibling: `.NAME.tmp-PID` or `.NAME.old-PID`.
fn sibling(name: &str, kind: Leftover, pid: u32) -> String {
    match kind {
        Leftover::Tmp => format!(".{name}.tmp-{pid}"),
        Leftover::Old => format!(".{name}.old-{pid}"),
    }
}

/// Whether `entry` is a leftover sibling of the output folder `name`.
fn leftover_kind(entry: &str, name: &str) -> Option<Leftover> {
    let rest = entry.strip_prefix('.')?.strip_prefix(name)?;
    let (kind, pid) = if let Some(pid) = rest.strip_prefix(".tmp-") {
        (Leftover::Tmp, pid)
    } else {
        (Leftover::Old, rest.strip_prefix(".old-")?)
    };
    (!pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit())).then_some(kind)
}

/// Deletes leftovers of killed earlier runs next to `out`. An `.old-*`
/// folder while `out` is missing is the only copy of the old dataset: it is
/// renamed back to `out` first.
fn clean_leftovers(parent: &Path, name: &str, out: &Path) -> Result<()> {
    let rd = std::fs::read_dir(parent).map_err(|e| Error::io(parent, "list folder", e))?;
    let mut found: Vec<(Leftover, PathBuf)> = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(parent, "list folder", e))?;
        if let Some(kind) = entry
            .file_name()
            .to_str()
            .and_then(|n| leftover_kind(n, name))
        {
            found.push((kind, entry.path()));
        }
    }
    found.sort();
    if std::fs::symlink_metadata(out).is_err() {
        // Prefer an old copy that still has its manifest.
        let pick = found
            .iter()
            .position(|(k, p)| *k == Leftover::Old && p.join("manifest.json").is_file())
            .or_else(|| found.iter().position(|(k, _)| *k == Leftover::Old));
        if let Some(i) = pick {
            let (_, old) = found.remove(i);
            rename(
                &old,
                out,
                "restore the dataset left aside by an interrupted run",
            )?;
            eprintln!(
                "warning: an earlier prepare was interrupted; restored {} from {}",
                out.display(),
                old.display()
            );
        }
    }
    for (_, p) in found {
        if let Err(e) = remove_any(&p) {
            eprintln!("warning: cannot remove the leftover of an interrupted prepare: {e}");
        }
    }
    Ok(())
}

/// Refuses an `out` that exists and is neither an empty folder nor a fugu
/// dataset, so that an unrelated folder is never deleted.
fn check_replaceable(out: &Path) -> Result<()> {
    let meta = match std::fs::symlink_metadata(out) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(out, "stat output folder", e)),
    };
    let refuse = |why: String| {
        Err(Error::Config(format!(
            "output folder {} {why}; refusing to replace it (choose another output folder or remove it)",
            out.display()
        )))
    };
    if !meta.is_dir() {
        return refuse("exists and is not a folder".into());
    }
    let mut names = Vec::new();
    let rd = std::fs::read_dir(out).map_err(|e| Error::io(out, "list folder", e))?;
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(out, "list folder", e))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    if names.is_empty() {
        return Ok(());
    }
    names.sort();
    if !is_fugu_manifest(&out.join("manifest.json")) {
        return refuse(format!(
            "is not empty and is not a fugu dataset (no fugu manifest.json; it holds `{}`)",
            names[0]
        ));
    }
    if let Some(other) = names.iter().find(|n| !is_dataset_file(n)) {
        return refuse(format!(
            "is a fugu dataset but also holds `{other}`, which prepare did not write"
        ));
    }
    Ok(())
}

/// Whether `path` is a JSON object whose `format` is [`MANIFEST_FORMAT`].
fn is_fugu_manifest(path: &Path) -> bool {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|v| v.get("format").and_then(|f| f.as_str()) == Some(MANIFEST_FORMAT))
}

/// Names `prepare` writes into a dataset folder: `manifest.json`, `tokenizer.json`,
/// `train-NNNNNN.tar`, `val-NNNNNN.tar`, and the `.NAME.tmp` files of
/// earlier versions.
fn is_dataset_file(name: &str) -> bool {
    let name = name
        .strip_prefix('.')
        .and_then(|n| n.strip_suffix(".tmp"))
        .unwrap_or(name);
    if name == "manifest.json" || name == crate::prepare::TOKENIZER_FILE {
        return true;
    }
    let Some(num) = name
        .strip_suffix(".tar")
        .and_then(|n| n.strip_prefix("train-").or_else(|| n.strip_prefix("val-")))
    else {
        return false;
    };
    num.len() >= 6 && num.bytes().all(|b| b.is_ascii_digit())
}

/// `std::fs::rename` with an error naming both paths.
fn rename(from: &Path, to: &Path, op: &'static str) -> Result<()> {
    std::fs::rename(from, to).map_err(|e| {
        Error::io(
            to,
            op,
            std::io::Error::new(e.kind(), format!("from {}: {e}", from.display())),
        )
    })
}

/// Removes a folder tree or a file.
fn remove_any(path: &Path) -> Result<()> {
    let res = match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    res.map_err(|e| Error::io(path, "remove", e))
}

/// Fsyncs a folder, so that renames and new entries in it are durable.
fn sync_dir(dir: &Path) -> Result<()> {
    // Other systems cannot open a folder as a file; there it is skipped.
    if cfg!(unix) {
        std::fs::File::open(dir)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io(dir, "sync folder", e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leftover_names() {
        assert_eq!(leftover_kind(".data.tmp-123", "data"), Some(Leftover::Tmp));
        assert_eq!(leftover_kind(".data.old-9", "data"), Some(Leftover::Old));
        for n in [
            ".data.tmp-",
            ".data.tmp-1x",
            ".data2.tmp-1",
            "data.tmp-1",
            ".data",
        ] {
            assert_eq!(leftover_kind(n, "data"), None, "{n}");
        }
        assert_eq!(
            leftover_kind(&sibling("a.b", Leftover::Old, 7), "a.b"),
            Some(Leftover::Old)
        );
    }

    #[test]
    fn dataset_file_names() {
        for n in [
            "manifest.json",
            "train-000000.tar",
            "val-001234.tar",
            ".train-000001.tar.tmp",
            ".manifest.json.tmp",
            "train-1234567.tar",
        ] {
            assert!(is_dataset_file(n), "{n}");
        }
        for n in [
            "notes.txt",
            "train-00.tar",
            "train-000000.tar.gz",
            "test-000000.tar",
            ".x.tmp",
        ] {
            assert!(!is_dataset_file(n), "{n}");
        }
    }
}

//! Timed choices kept on disk between runs: one file per identity (what makes a choice valid:
//! the GPU, the library or kernels that were timed), one line per shape. The cuBLASLt
//! algorithms (`algo_cache.rs`) and the fused attention's forms (`attention_select.rs`) are
//! kept so.
//!
//! Choices made once per process let two processes choose differently, so that a resumed run
//! was not bit-identical to an uninterrupted one; kept on disk, a later run takes the same.
//! Ranks of a job share the file: each adds its choices under a merge with what is on disk,
//! where an entry already there that the process can run wins (the first writer's choice),
//! and a process whose own timing lost takes the stored one, so that ranks and later runs
//! converge on one choice per shape. Files are written atomically (temporary name, fsync, rename) under an advisory lock
//! (`<file>.flock`), so that two processes storing different shapes at once keep both; a file
//! that does not parse is named in a note and replaced; one that cannot be written costs a note
//! on stderr once, not the run.
//!
//! [`ChoiceCache::choose`] times a shape once among the processes sharing the file: the first
//! to find it missing times it under a lock of that shape's (`crate::make_once`) and stores its
//! choice before letting the lock go; the others wait for that choice and take it.

use crate::make_once::{found_or_made, LockTiming};
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// What a cache holds: its file's first line, how notes name it, and one choice's text after
/// `SHAPE | ` on its line.
pub trait Entry: Copy {
    /// The first line of a cache file (the format's name and version).
    const HEADER: &'static str;
    /// The cache as notes name it ("the GEMM algorithm cache").
    const CACHE: &'static str;
    /// Its choices as notes name them ("timed GEMM algorithms").
    const CHOICES: &'static str;
    /// The environment variable that moves or disables the cache.
    const ENV: &'static str;
    /// The choice's fields, without newlines or ` | `.
    fn fields(&self) -> String;
    /// A choice from [`Self::fields`]' text; an error naming what is wrong.
    fn parse(fields: &str) -> Result<Self>;
}

/// The choices of one identity: those on disk when the process first looked, and its own.
pub struct ChoiceCache<E: Entry> {
    /// `None`: kept for the process only.
    file: Option<PathBuf>,
    /// The file's second line: what the choices are valid for.
    identity: String,
    entries: BTreeMap<String, E>,
    /// A failed store has been reported (once per process).
    store_failed: bool,
}

impl<E: Entry> ChoiceCache<E> {
    /// The cache of `identity` (its file `file_name`) in the directory the environment names
    /// ([`Entry::ENV`], else `subdir` of the user's fugu cache), or in memory only where
    /// disabled or no home is known.
    pub fn from_env(subdir: &str, file_name: &str, identity: String) -> ChoiceCache<E> {
        let dir = crate::user_cache::cache_path(E::ENV, subdir);
        ChoiceCache::open(dir.as_deref(), file_name, identity)
    }

    /// The cache of `identity` in `dir/file_name` (`dir` `None`: in memory only), with what
    /// its file holds; a file that does not parse is named in a note and left to be replaced.
    pub fn open(dir: Option<&Path>, file_name: &str, identity: String) -> ChoiceCache<E> {
        let file = dir.map(|d| d.join(file_name));
        let entries = match file.as_deref().map(|f| read(f, &identity)) {
            Some(Ok(entries)) => entries,
            Some(Err(e)) => {
                eprintln!("note: ignoring {}: {e:#} (it will be replaced)", E::CACHE);
                BTreeMap::new()
            }
            None => BTreeMap::new(),
        };
        ChoiceCache {
            file,
            identity,
            entries,
            store_failed: false,
        }
    }

    /// The file the choices are kept in, if any.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// How many shapes have a choice.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn get(&self, shape: &str) -> Option<E> {
        self.entries.get(shape).copied()
    }

    /// What the file holds for a shape, read again at each call (none in memory only, or where
    /// the file does not parse): for a process waiting for another's choice.
    pub fn reader(&self) -> impl Fn(&str) -> Option<E> {
        let (file, identity) = (self.file.clone(), self.identity.clone());
        move |shape| {
            read::<E>(file.as_deref()?, &identity)
                .ok()?
                .get(shape)
                .copied()
        }
    }

    /// The choice for `shape` that `accept` takes: this process's or the file's; else, where
    /// another process sharing the file is timing the shape (its lock, [`lock_path`]), the
    /// choice it stores, waited for; else `time()`'s, timed under the lock and stored before
    /// the lock goes (so that a waiter finds it, never a gap in which it times the shape too).
    /// A stored choice `accept` refuses (a library that no longer runs it) is timed again and
    /// replaced, with a note. `what` names the timing in the notes on stderr.
    pub fn choose(
        &mut self,
        shape: &str,
        what: &str,
        accept: impl Fn(&E) -> bool,
        time: impl FnOnce() -> Result<E>,
    ) -> Result<E> {
        match self.get(shape) {
            Some(c) if accept(&c) => return Ok(c),
            Some(_) => {
                eprintln!("note: the choice stored for {shape} does not run here; {what} again")
            }
            None => {}
        }
        let Some(lock) = self.file().map(|f| lock_path(f, shape)) else {
            return Ok(self.insert(shape, time()?, &accept));
        };
        let look = self.reader();
        let (choice, _) = found_or_made(
            &lock,
            what,
            LockTiming::default(),
            || look(shape).filter(&accept),
            // Timed under the lock, or without it after a long wait for another process,
            // whose choice, if it stored one meanwhile, wins (so that the two agree).
            || Ok(self.insert(shape, time()?, &accept)),
        )?;
        self.entries.insert(shape.to_string(), choice);
        Ok(choice)
    }

    /// Records `choice` for `shape` and stores it, unless the file holds an entry for `shape`
    /// that `keep` takes (one another process stored meanwhile): that one wins and is
    /// returned instead. An entry `keep` refuses (one the library no longer runs) is replaced.
    pub fn insert(&mut self, shape: &str, choice: E, keep: impl Fn(&E) -> bool) -> E {
        // Read, merge and write with no other process's store in between (one would lose
        // the other's new entries).
        let _writing = self.file.as_deref().and_then(WriteLock::take);
        let mut merged = match self.file.as_deref().map(|f| read(f, &self.identity)) {
            Some(Ok(on_disk)) => on_disk,
            _ => BTreeMap::new(),
        };
        // This process's earlier choices stand for it; the disk's others are taken in.
        for (k, v) in std::mem::take(&mut self.entries) {
            merged.entry(k).or_insert(v);
        }
        let kept = match merged.get(shape) {
            Some(&there) if keep(&there) => there,
            _ => choice,
        };
        merged.insert(shape.to_string(), kept);
        self.entries = merged;
        self.store();
        kept
    }

    /// Writes every entry to the file (atomically), reporting a failure once.
    fn store(&mut self) {
        let Some(file) = self.file.as_deref() else {
            return;
        };
        let result = file
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .with_context(|| format!("creating {}", file.display()))
            .and_then(|()| {
                crate::atomic_write::write_file(file, |w| write(w, &self.identity, &self.entries))
            });
        if let Err(e) = result {
            if !self.store_failed {
                eprintln!(
                    "note: could not keep the {} in {}: {e:#} (the next run times them again; \
                     {}=DIR puts the cache elsewhere)",
                    E::CHOICES,
                    file.display(),
                    E::ENV
                );
            }
            self.store_failed = true;
        }
    }
}

/// An advisory lock on `<file>.flock` while a process reads, merges and writes the file
/// (released when dropped, or when the process dies). Where the file system cannot lock, none
/// is taken: stores then only race as they did before.
struct WriteLock {
    _held: std::fs::File,
}

impl WriteLock {
    fn take(file: &Path) -> Option<WriteLock> {
        let mut name = file.as_os_str().to_owned();
        name.push(".flock");
        std::fs::create_dir_all(file.parent()?).ok()?;
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(PathBuf::from(name))
            .ok()?;
        f.lock().ok()?;
        Some(WriteLock { _held: f })
    }
}

/// The path whose lock (`<path>.lock`, [`crate::make_once`]) the processes sharing cache
/// file `file` take to time shape `shape`: the file's path and a hash of the shape.
pub fn lock_path(file: &Path, shape: &str) -> PathBuf {
    let mut p = file.as_os_str().to_owned();
    p.push(format!(".{}", short_sha(shape, 12)));
    PathBuf::from(p)
}

fn write<E: Entry>(w: &mut dyn Write, identity: &str, entries: &BTreeMap<String, E>) -> Result<()> {
    writeln!(w, "{}", E::HEADER)?;
    writeln!(w, "{identity}")?;
    for (shape, c) in entries {
        writeln!(w, "{shape} | {}", c.fields())?;
    }
    Ok(())
}

/// The entries of cache file `file`: none where it does not exist or holds another identity;
/// an error naming the file and line where it does not parse.
pub(super) fn read<E: Entry>(file: &Path, identity: &str) -> Result<BTreeMap<String, E>> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", file.display())),
    };
    let mut lines = text.lines();
    let where_ = |n: usize| format!("{} line {n}", file.display());
    if lines.next() != Some(E::HEADER) {
        bail!("{}: expected {:?}", where_(1), E::HEADER);
    }
    if lines.next() != Some(identity) {
        // Another identity under the same file name (names that differ in punctuation).
        return Ok(BTreeMap::new());
    }
    let mut entries = BTreeMap::new();
    for (i, line) in lines.enumerate() {
        let parsed = line
            .split_once(" | ")
            .context("expected `SHAPE | FIELDS`")
            .and_then(|(shape, fields)| Ok((shape, E::parse(fields)?)));
        let (shape, choice) = parsed.with_context(|| format!("{}: {line:?}", where_(i + 3)))?;
        entries.insert(shape.to_string(), choice);
    }
    Ok(entries)
}

/// A file name's part from free text (a GPU's name): `[A-Za-z0-9]` kept, anything else `-`
/// (the identity line inside tells apart names that differ only there).
pub fn file_part(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect()
}

/// The first `digits` hex digits of the SHA-256 of `text` (a file name's part that tells
/// identities or shapes apart).
pub fn short_sha(text: &str, digits: usize) -> String {
    use sha2::Digest;
    fugu_io::manifest::hex(&sha2::Sha256::digest(text))[..digits].to_string()
}

#[cfg(test)]
mod tests {
    use super::super::algo_cache::Choice;
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    const ID: &str = "identity test";

    fn open(dir: &Path) -> ChoiceCache<Choice> {
        ChoiceCache::open(Some(dir), "choices.txt", ID.to_string())
    }

    fn choice(seed: u64) -> Choice {
        Choice {
            algo: [seed; 8],
            first_ms: 1.0,
            chosen_ms: 0.5,
        }
    }

    fn fresh_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fugu-choices-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Two processes (here threads, each with its own view of the file) meet a shape: the
    /// first times it, the second waits and takes its choice without timing. The choice is on
    /// disk before the lock goes: a watcher that reads the file the moment the lock is gone
    /// finds it there (a holder storing after letting the lock go would leave a waiter a gap in
    /// which it finds neither, and times the shape too).
    #[test]
    fn a_shape_is_timed_once_and_stored_before_its_lock_goes() {
        let dir = fresh_dir("once");
        let file = dir.join("choices.txt");
        let lock = crate::make_once::lock_path(&lock_path(&file, "shape"));
        let seen_after_lock = {
            let (lock, look) = (lock.clone(), open(&dir).reader());
            std::thread::spawn(move || {
                // Spinning, to read the file the instant the lock goes; a minute at most.
                let start = std::time::Instant::now();
                let spin_while = |held: bool| {
                    while lock.exists() == held {
                        assert!(start.elapsed() < Duration::from_secs(60), "no lock seen");
                        std::hint::spin_loop();
                    }
                };
                spin_while(false);
                spin_while(true);
                look("shape")
            })
        };
        let timing = Arc::new(AtomicBool::new(false));
        let first = {
            let (dir, timing) = (dir.clone(), timing.clone());
            std::thread::spawn(move || {
                open(&dir).choose(
                    "shape",
                    "timing",
                    |_| true,
                    || {
                        timing.store(true, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(600));
                        Ok(choice(1))
                    },
                )
            })
        };
        while !timing.load(Ordering::SeqCst) {
            assert!(!first.is_finished(), "the first process never timed");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut second = open(&dir);
        let waited = second.choose("shape", "timing", |_| true, || panic!("timed twice"));
        assert_eq!(waited.unwrap(), choice(1));
        assert_eq!(second.get("shape"), Some(choice(1)));
        assert_eq!(first.join().unwrap().unwrap(), choice(1));
        assert_eq!(seen_after_lock.join().unwrap(), Some(choice(1)));
        assert!(!lock.exists());

        // A stored choice the caller refuses is timed again and replaced.
        let mut third = open(&dir);
        let retimed = third.choose("shape", "timing", |c| c.algo[0] != 1, || Ok(choice(2)));
        assert_eq!(retimed.unwrap(), choice(2));
        assert_eq!(open(&dir).get("shape"), Some(choice(2)));

        // A process timing a shape (without the lock, after a long wait) while another stores
        // a choice for it takes the stored one, so that the two run the same.
        let mut late = open(&dir);
        let stored_meanwhile = || {
            open(&dir).insert("new shape", choice(7), |_| true);
            Ok(choice(8))
        };
        let taken = late.choose("new shape", "timing", |_| true, stored_meanwhile);
        assert_eq!(taken.unwrap(), choice(7));
        assert_eq!(open(&dir).get("new shape"), Some(choice(7)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Processes storing different shapes at the same moment keep every one (each reads,
    /// merges and writes under the file's advisory lock; without it one's rename drops what
    /// another wrote since it read).
    #[test]
    fn stores_of_different_shapes_at_once_keep_them_all() {
        let dir = fresh_dir("stores");
        let writers: Vec<_> = (0..4u64)
            .map(|w| {
                let dir = dir.clone();
                std::thread::spawn(move || {
                    for i in 0..12 {
                        // A fresh view per store: nothing of its own to write back later.
                        open(&dir).insert(&format!("shape {w} {i}"), choice(w * 100 + i), |_| true);
                    }
                })
            })
            .collect();
        for w in writers {
            w.join().unwrap();
        }
        let all = open(&dir);
        for (w, i) in (0..4u64).flat_map(|w| (0..12).map(move |i| (w, i))) {
            assert_eq!(
                all.get(&format!("shape {w} {i}")),
                Some(choice(w * 100 + i))
            );
        }
        assert_eq!(all.len(), 48);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! cuBLASLt's timed algorithm choices (`FUGU_GEMM_SELECT=timed`), kept on disk between runs.
//!
//! Timing cuBLASLt's candidates costs about a second per process (GPT-2's ~20 GEMM shapes),
//! and, kept for the process only, let two processes choose differently, so that a resumed run
//! was not bit-identical to an uninterrupted one. cuBLASLt documents its algorithm structure
//! (`cublasLtMatmulAlgo_t`, eight 64-bit words) as one that "can be trivially serialized and
//! later restored for use with the same version of cuBLAS library": the choices are stored per
//! GPU model, compute capability, cuBLASLt version and workspace size (the file's identity
//! line; any change is another file, never a stale hit), one line per GEMM shape, and an entry
//! the library then refuses for its shape is timed again and replaced.
//!
//! Ranks of a job share the file: each adds its choices under a merge with what is on disk,
//! where the entry already there wins (the first writer's choice), and a process whose own
//! timing lost takes the stored one, so that ranks and later runs converge on one algorithm
//! per shape. Files are written atomically (temporary name, fsync, rename); a file that does
//! not parse is named in a note and replaced.
//!
//! Where: `FUGU_GEMM_CACHE` (a directory; `off` disables), else `$XDG_CACHE_HOME/fugu/gemm`,
//! else `$HOME/.cache/fugu/gemm`. A cache that cannot be written costs a note on stderr once,
//! not the run.

use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Environment variable: the GEMM algorithm cache's directory, or `off`.
pub const GEMM_CACHE_ENV: &str = "FUGU_GEMM_CACHE";

/// The first line of a cache file.
const HEADER: &str = "fugu cuBLASLt algorithms, format 1";

/// One stored choice: cuBLASLt's algorithm, and the times that chose it (for the reader).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    pub algo: [u64; 8],
    /// The heuristic's first candidate's time and the chosen one's, in ms per call.
    pub first_ms: f32,
    pub chosen_ms: f32,
}

/// What makes a stored algorithm valid: the same GPU model and compute capability, cuBLASLt
/// version and workspace size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub gpu: String,
    pub major: i32,
    pub minor: i32,
    pub lt_version: usize,
    pub workspace: usize,
}

impl Identity {
    fn line(&self) -> String {
        format!(
            "identity gpu={:?} sm={}{} cublaslt={} workspace={}",
            self.gpu, self.major, self.minor, self.lt_version, self.workspace
        )
    }

    /// The cache file's name: readable, and distinct for distinct identities up to the GPU
    /// name's characters outside `[A-Za-z0-9]` (the identity line inside tells them apart).
    fn file_name(&self) -> String {
        let gpu: String = self
            .gpu
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        format!(
            "cublaslt-{gpu}-sm{}{}-v{}-ws{}.txt",
            self.major, self.minor, self.lt_version, self.workspace
        )
    }
}

/// The choices of one identity: those on disk when the process first looked, and its own.
pub struct AlgoCache {
    /// `None`: kept for the process only.
    file: Option<PathBuf>,
    identity: Identity,
    entries: BTreeMap<String, Choice>,
    /// A failed store has been reported (once per process).
    store_failed: bool,
}

impl AlgoCache {
    /// The cache of `identity` in the directory the environment names ([`GEMM_CACHE_ENV`]),
    /// or in memory only where disabled or no home is known.
    pub fn from_env(identity: Identity) -> AlgoCache {
        let dir = crate::user_cache::cache_path(GEMM_CACHE_ENV, "gemm");
        AlgoCache::open(dir.as_deref(), identity)
    }

    /// The cache of `identity` in `dir` (`None`: in memory only), with what its file holds; a
    /// file that does not parse is named in a note and left to be replaced.
    pub fn open(dir: Option<&Path>, identity: Identity) -> AlgoCache {
        let file = dir.map(|d| d.join(identity.file_name()));
        let entries = match file.as_deref().map(|f| read(f, &identity)) {
            Some(Ok(entries)) => entries,
            Some(Err(e)) => {
                eprintln!("note: ignoring the GEMM algorithm cache: {e:#} (it will be replaced)");
                BTreeMap::new()
            }
            None => BTreeMap::new(),
        };
        AlgoCache {
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

    pub fn get(&self, shape: &str) -> Option<Choice> {
        self.entries.get(shape).copied()
    }

    /// Records `choice` for `shape` and stores it. With `replace` false (a shape timed because
    /// it had no entry), an entry another process stored meanwhile wins and is returned
    /// instead; with `replace` true (the stored one was refused) `choice` overwrites it.
    pub fn insert(&mut self, shape: &str, choice: Choice, replace: bool) -> Choice {
        let mut merged = match self.file.as_deref().map(|f| read(f, &self.identity)) {
            Some(Ok(on_disk)) => on_disk,
            _ => BTreeMap::new(),
        };
        // This process's earlier choices stand for it; the disk's others are taken in.
        for (k, v) in std::mem::take(&mut self.entries) {
            merged.entry(k).or_insert(v);
        }
        let kept = if replace {
            merged.insert(shape.to_string(), choice);
            choice
        } else {
            *merged.entry(shape.to_string()).or_insert(choice)
        };
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
                    "note: could not keep the timed GEMM algorithms in {}: {e:#} (the next run \
                     times them again; {GEMM_CACHE_ENV}=DIR puts the cache elsewhere)",
                    file.display()
                );
            }
            self.store_failed = true;
        }
    }
}

fn write(w: &mut dyn Write, identity: &Identity, entries: &BTreeMap<String, Choice>) -> Result<()> {
    writeln!(w, "{HEADER}")?;
    writeln!(w, "{}", identity.line())?;
    for (shape, c) in entries {
        let algo: Vec<String> = c.algo.iter().map(|x| format!("{x:016x}")).collect();
        writeln!(
            w,
            "{shape} | algo={} first_ms={} chosen_ms={}",
            algo.join(","),
            c.first_ms,
            c.chosen_ms
        )?;
    }
    Ok(())
}

/// The entries of cache file `file`: none where it does not exist or holds another identity;
/// an error naming the file and line where it does not parse.
fn read(file: &Path, identity: &Identity) -> Result<BTreeMap<String, Choice>> {
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", file.display())),
    };
    let mut lines = text.lines();
    let where_ = |n: usize| format!("{} line {n}", file.display());
    if lines.next() != Some(HEADER) {
        bail!("{}: expected {HEADER:?}", where_(1));
    }
    if lines.next() != Some(identity.line().as_str()) {
        // Another identity under the same file name (GPU names that differ in punctuation).
        return Ok(BTreeMap::new());
    }
    let mut entries = BTreeMap::new();
    for (i, line) in lines.enumerate() {
        let (shape, choice) =
            parse_entry(line).with_context(|| format!("{}: {line:?}", where_(i + 3)))?;
        entries.insert(shape.to_string(), choice);
    }
    Ok(entries)
}

/// `SHAPE | algo=W0,…,W7 first_ms=F chosen_ms=F`.
fn parse_entry(line: &str) -> Result<(&str, Choice)> {
    let (shape, rest) = line
        .split_once(" | ")
        .context("expected `SHAPE | algo=… first_ms=… chosen_ms=…`")?;
    let mut fields = rest.split(' ');
    let mut field = |name: &str| -> Result<&str> {
        fields
            .next()
            .and_then(|f| f.strip_prefix(name)?.strip_prefix('='))
            .with_context(|| format!("expected {name}=…"))
    };
    let words: Vec<u64> = field("algo")?
        .split(',')
        .map(|w| u64::from_str_radix(w, 16).with_context(|| format!("{w:?} is not hex")))
        .collect::<Result<_>>()?;
    let algo: [u64; 8] = words
        .try_into()
        .map_err(|w: Vec<u64>| anyhow::anyhow!("algo has {} words, not 8", w.len()))?;
    let first_ms = field("first_ms")?.parse().context("first_ms")?;
    let chosen_ms = field("chosen_ms")?.parse().context("chosen_ms")?;
    if fields.next().is_some() {
        bail!("unexpected text after chosen_ms");
    }
    Ok((
        shape,
        Choice {
            algo,
            first_ms,
            chosen_ms,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(lt_version: usize) -> Identity {
        Identity {
            gpu: "NVIDIA H200".into(),
            major: 9,
            minor: 0,
            lt_version,
            workspace: 32 << 20,
        }
    }

    fn choice(seed: u64) -> Choice {
        Choice {
            algo: std::array::from_fn(|i| seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i as u64),
            first_ms: 0.5,
            chosen_ms: 0.25 + seed as f32 / 1024.0,
        }
    }

    fn fresh_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fugu-algos-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    const SHAPE: &str = "a=bf16 b=bf16 c=bf16 ta=1 tb=0 m=768 n=16384 k=768";

    #[test]
    fn choices_survive_a_restart_exactly_and_only_for_their_identity() {
        let dir = fresh_dir("restart");
        let mut cache = AlgoCache::open(Some(&dir), identity(130100));
        assert!(cache.is_empty());
        assert_eq!(cache.insert(SHAPE, choice(1), false), choice(1));
        assert_eq!(cache.insert("other shape", choice(2), false), choice(2));

        let again = AlgoCache::open(Some(&dir), identity(130100));
        assert_eq!(again.len(), 2);
        assert_eq!(again.get(SHAPE), Some(choice(1)));
        assert_eq!(again.get("other shape"), Some(choice(2)));
        // Another cuBLASLt version is another file: nothing carried over.
        let newer = AlgoCache::open(Some(&dir), identity(130200));
        assert!(newer.is_empty());
        assert_ne!(newer.file(), again.file());
        // In memory only: nothing read, nothing written.
        let mut memory = AlgoCache::open(None, identity(130100));
        assert!(memory.is_empty());
        assert_eq!(memory.insert(SHAPE, choice(3), false), choice(3));
        assert_eq!(
            AlgoCache::open(Some(&dir), identity(130100)).get(SHAPE),
            Some(choice(1))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Two processes timing the same shape: the second to store takes the first's choice,
    /// keeps its own other entries, and a refused entry is replaced.
    #[test]
    fn the_first_writer_wins_and_a_refused_entry_is_replaced() {
        let dir = fresh_dir("merge");
        let mut first = AlgoCache::open(Some(&dir), identity(1));
        let mut second = AlgoCache::open(Some(&dir), identity(1));
        assert_eq!(
            second.insert("only the second's", choice(9), false),
            choice(9)
        );
        assert_eq!(first.insert(SHAPE, choice(1), false), choice(1));
        assert_eq!(second.insert(SHAPE, choice(2), false), choice(1));
        assert_eq!(second.get(SHAPE), Some(choice(1)));
        let on_disk = AlgoCache::open(Some(&dir), identity(1));
        assert_eq!(on_disk.get(SHAPE), Some(choice(1)));
        assert_eq!(on_disk.get("only the second's"), Some(choice(9)));

        assert_eq!(second.insert(SHAPE, choice(4), true), choice(4));
        assert_eq!(
            AlgoCache::open(Some(&dir), identity(1)).get(SHAPE),
            Some(choice(4))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_damaged_file_is_ignored_and_replaced() {
        let dir = fresh_dir("damaged");
        let mut cache = AlgoCache::open(Some(&dir), identity(1));
        cache.insert(SHAPE, choice(1), false);
        let file = cache.file().unwrap().to_path_buf();
        let good = std::fs::read_to_string(&file).unwrap();
        let line = good.lines().nth(2).unwrap();
        for damaged in [
            good.replacen("format 1", "format 0", 1),
            good.replacen(" chosen_ms=", " ", 1),
            good.replacen("algo=", "algo=x", 1),
            good.replacen(" | ", " ", 1),
            format!("{good}{line} extra\n"),
        ] {
            std::fs::write(&file, &damaged).unwrap();
            let err = read(&file, &identity(1)).unwrap_err();
            assert!(
                format!("{err:#}").contains(&file.display().to_string()),
                "{err:#}"
            );
            let mut cache = AlgoCache::open(Some(&dir), identity(1));
            assert!(cache.is_empty(), "{damaged}");
            cache.insert(SHAPE, choice(2), false);
            let replaced = read(&file, &identity(1)).unwrap();
            assert_eq!(replaced.len(), 1);
            assert_eq!(replaced.get(SHAPE), Some(&choice(2)));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

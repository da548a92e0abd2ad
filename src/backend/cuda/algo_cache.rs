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
//! Ranks of a job share the file: the first to find a shape missing times it while the others
//! wait for its choice and take it (`choice_cache.rs`).
//!
//! Where: `FUGU_GEMM_CACHE` (a directory; `off` disables), else `$XDG_CACHE_HOME/fugu/gemm`,
//! else `$HOME/.cache/fugu/gemm`. A cache that cannot be written costs a note on stderr once,
//! not the run.

use super::choice_cache::{file_part, ChoiceCache, Entry};
use anyhow::{Context, Result};

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
        format!(
            "cublaslt-{}-sm{}{}-v{}-ws{}.txt",
            file_part(&self.gpu),
            self.major,
            self.minor,
            self.lt_version,
            self.workspace
        )
    }
}

/// The timed cuBLASLt algorithms of one identity.
pub type AlgoCache = ChoiceCache<Choice>;

/// The cache of `identity` in the directory the environment names ([`GEMM_CACHE_ENV`]), or
/// in memory only where disabled or no home is known.
pub fn gemm_cache(identity: &Identity) -> AlgoCache {
    ChoiceCache::from_env("gemm", &identity.file_name(), identity.line())
}

impl Entry for Choice {
    const HEADER: &'static str = HEADER;
    const CACHE: &'static str = "the GEMM algorithm cache";
    const CHOICES: &'static str = "timed GEMM algorithms";
    const ENV: &'static str = GEMM_CACHE_ENV;

    /// `algo=W0,…,W7 first_ms=F chosen_ms=F`.
    fn fields(&self) -> String {
        let algo: Vec<String> = self.algo.iter().map(|x| format!("{x:016x}")).collect();
        format!(
            "algo={} first_ms={} chosen_ms={}",
            algo.join(","),
            self.first_ms,
            self.chosen_ms
        )
    }

    fn parse(text: &str) -> Result<Choice> {
        let mut fields = text.split(' ');
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
        anyhow::ensure!(fields.next().is_none(), "unexpected text after chosen_ms");
        Ok(Choice {
            algo,
            first_ms,
            chosen_ms,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn open(dir: &Path, id: Identity) -> AlgoCache {
        ChoiceCache::open(Some(dir), &id.file_name(), id.line())
    }

    fn read(file: &Path, id: &Identity) -> Result<std::collections::BTreeMap<String, Choice>> {
        super::super::choice_cache::read(file, &id.line())
    }

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
        let mut cache = open(&dir, identity(130100));
        assert!(cache.is_empty());
        assert_eq!(cache.insert(SHAPE, choice(1), |_| true), choice(1));
        assert_eq!(cache.insert("other shape", choice(2), |_| true), choice(2));

        let again = open(&dir, identity(130100));
        assert_eq!(again.len(), 2);
        assert_eq!(again.get(SHAPE), Some(choice(1)));
        assert_eq!(again.get("other shape"), Some(choice(2)));
        // Another cuBLASLt version is another file: nothing carried over.
        let newer = open(&dir, identity(130200));
        assert!(newer.is_empty());
        assert_ne!(newer.file(), again.file());
        // In memory only: nothing read, nothing written.
        let id = identity(130100);
        let mut memory = AlgoCache::open(None, &id.file_name(), id.line());
        assert!(memory.is_empty());
        assert_eq!(memory.insert(SHAPE, choice(3), |_| true), choice(3));
        assert_eq!(open(&dir, identity(130100)).get(SHAPE), Some(choice(1)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Two processes timing the same shape: the second to store takes the first's choice,
    /// keeps its own other entries, and a refused entry is replaced.
    #[test]
    fn the_first_writer_wins_and_a_refused_entry_is_replaced() {
        let dir = fresh_dir("merge");
        let mut first = open(&dir, identity(1));
        let mut second = open(&dir, identity(1));
        assert_eq!(
            second.insert("only the second's", choice(9), |_| true),
            choice(9)
        );
        assert_eq!(first.insert(SHAPE, choice(1), |_| true), choice(1));
        assert_eq!(second.insert(SHAPE, choice(2), |_| true), choice(1));
        assert_eq!(second.get(SHAPE), Some(choice(1)));
        let on_disk = open(&dir, identity(1));
        assert_eq!(on_disk.get(SHAPE), Some(choice(1)));
        assert_eq!(on_disk.get("only the second's"), Some(choice(9)));

        assert_eq!(second.insert(SHAPE, choice(4), |_| false), choice(4));
        assert_eq!(open(&dir, identity(1)).get(SHAPE), Some(choice(4)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_damaged_file_is_ignored_and_replaced() {
        let dir = fresh_dir("damaged");
        let mut cache = open(&dir, identity(1));
        cache.insert(SHAPE, choice(1), |_| true);
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
            let mut cache = open(&dir, identity(1));
            assert!(cache.is_empty(), "{damaged}");
            cache.insert(SHAPE, choice(2), |_| true);
            let replaced = read(&file, &identity(1)).unwrap();
            assert_eq!(replaced.len(), 1);
            assert_eq!(replaced.get(SHAPE), Some(&choice(2)));
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! The distributed, resumable training-data loader.
//!
//! A loader yields batches of `B` windows of `T + 1` consecutive tokens
//! (`[B, T+1]`, row-major, `u32`) from the concatenation of the samples'
//! token streams (each document already ends with `<|endoftext|>`).
//!
//! **Partition.** Per epoch, the split's shards are put in an order (shuffled
//! by `(seed, epoch)` unless `shuffle` is off) and their tokens form one
//! stream of `L` tokens = `N = L / (T+1)` windows. Each of the `world` ranks
//! gets `c = N / world` windows: rank `r` reads the contiguous token range
//! `[r·c·(T+1), (r+1)·c·(T+1))` of that stream, so ranks read disjoint data,
//! open only the shards their range overlaps, and all get exactly `c`
//! windows (at most `world - 1` windows and `T` tokens per epoch are left
//! out). Within its range a rank's samples pass through a bounded shuffle
//! buffer (seeded by `(seed, epoch, rank)`).
//!
//! **Cursor.** Every rank yields exactly `c` windows per epoch, so the
//! position after any batch is `(epoch, window)`, the same on every rank;
//! [`Cursor`] stores it plus the configuration that defines the stream. A
//! restored loader replays the epoch up to `window` reading tar headers only
//! (sample payloads are skipped with seeks), then reloads the payloads still
//! held in the shuffle buffer, and yields exactly the batches the original
//! would have produced.

use crate::error::{Error, Result};
use crate::manifest::{check_sha256, verify_shard, Manifest};
use crate::rng::{Permutation, SplitMix64};
use crate::tar::{EntryKind, FileSource, TarReader};
use crate::tokenizer::GPT2_VOCAB;
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::SystemTime;

/// Longest piece of a sample held in memory at once (tokens). Longer samples
/// are streamed as consecutive pieces of this size.
pub const MAX_PIECE_TOKENS: u64 = 32768;

/// Which split of a manifest to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// The training split.
    Train,
    /// The held-out validation split.
    Val,
}

/// How much of the data to check against the manifest, and when. Only
/// manifests carry checksums: shard patterns and `.bin` files are not
/// checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// At open, every shard of the split exists and has the manifest's size
    /// (cheap). Nothing else.
    Size,
    /// As `Size` at open, and each shard's sha256 is checked the first time
    /// this process reads samples from it, before any of them is returned:
    /// a corrupted shard never reaches training. The whole file is hashed
    /// once (it is then in the page cache for the reads that follow); later
    /// epochs, and later loaders of this process, do not hash it again
    /// unless its size or modification time changed. A mismatch is an
    /// error, also with `skip_bad_samples`. The default.
    FirstRead,
    /// At open, the sha256 of every shard of the split (reads all of it).
    Full,
}

/// Loader configuration.
#[derive(Clone, Debug)]
pub struct LoaderConfig {
    /// Windows per batch (`B`).
    pub batch_size: usize,
    /// Sequence length `T`; windows hold `T + 1` tokens.
    pub seq_len: usize,
    /// This process's data-parallel rank.
    pub rank: usize,
    /// Number of data-parallel ranks.
    pub world: usize,
    /// Shuffle seed.
    pub seed: u64,
    /// Shuffle shard order, samples (shards) or windows (`.bin`).
    pub shuffle: bool,
    /// Capacity of the sample shuffle buffer, in pieces (each at most
    /// [`MAX_PIECE_TOKENS`] tokens).
    pub shuffle_buffer: usize,
    /// Batches prepared ahead on the background thread; 0 runs on the
    /// calling thread.
    pub prefetch: usize,
    /// Log, count and skip bad samples instead of failing.
    pub skip_bad_samples: bool,
    /// Manifest checks, at open and at the first read of each shard.
    pub verify: Verify,
    /// Split to read (manifests only).
    pub split: Split,
    /// Vocabulary size for `.bin` files and shard patterns (manifests carry
    /// their own).
    pub vocab_size: u32,
    /// Read buffer per open file, bytes.
    pub read_buffer: usize,
}

impl LoaderConfig {
    /// Training defaults: shuffled, prefetch 4, split `train`, sha256 of
    /// each shard checked when first read ([`Verify::FirstRead`]).
    pub fn train(batch_size: usize, seq_len: usize, rank: usize, world: usize, seed: u64) -> Self {
        LoaderConfig {
            batch_size,
            seq_len,
            rank,
            world,
            seed,
            shuffle: true,
            shuffle_buffer: 256,
            prefetch: 4,
            skip_bad_samples: false,
            verify: Verify::FirstRead,
            split: Split::Train,
            vocab_size: GPT2_VOCAB,
            read_buffer: 1 << 20,
        }
    }

    /// Validation defaults: split `val`, no shuffle, deterministic.
    pub fn val(batch_size: usize, seq_len: usize, rank: usize, world: usize) -> Self {
        LoaderConfig {
            shuffle: false,
            split: Split::Val,
            ..Self::train(batch_size, seq_len, rank, world, 0)
        }
    }

    fn window(&self) -> u64 {
        self.seq_len as u64 + 1
    }

    fn check(&self) -> Result<()> {
        if self.batch_size == 0 || self.seq_len == 0 {
            return Err(Error::Config(
                "batch_size and seq_len must be positive".into(),
            ));
        }
        if self.world == 0 || self.rank >= self.world {
            return Err(Error::Config(format!(
                "rank {} is not in 0..{}",
                self.rank, self.world
            )));
        }
        if self.shuffle_buffer == 0 {
            return Err(Error::Config("shuffle_buffer must be at least 1".into()));
        }
        Ok(())
    }
}

/// A batch: `batch_size` rows of `seq_len + 1` tokens, row-major. Inputs of
/// row `b` are `row(b)[..T]`, targets `row(b)[1..]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// `batch_size * (seq_len + 1)` token ids.
    pub tokens: Vec<u32>,
    /// Rows.
    pub batch_size: usize,
    /// `T`.
    pub seq_len: usize,
}

impl Batch {
    /// Row `b` (`T + 1` tokens).
    pub fn row(&self, b: usize) -> &[u32] {
        let w = self.seq_len + 1;
        &self.tokens[b * w..(b + 1) * w]
    }
}

/// Saved loader position; serialise it into checkpoints (`state.json`).
/// It is the same on every rank, so one saved copy restores all ranks.
#[derive(Serialize, Deserialize, Clone, PartialEq, Debug)]
pub struct Cursor {
    /// Cursor schema version (1).
    pub version: u32,
    /// `shards` or `bin`.
    pub kind: String,
    /// Fingerprint of the data (shard checksums, or `.bin` size).
    pub data: String,
    /// Split read.
    pub split: Split,
    /// Shuffle seed of the stream.
    pub seed: u64,
    /// Whether the stream is shuffled.
    pub shuffle: bool,
    /// Shuffle buffer capacity (pieces).
    pub shuffle_buffer: usize,
    /// Data-parallel world size when saved.
    pub world: usize,
    /// `B` when saved.
    pub batch_size: usize,
    /// `T` when saved.
    pub seq_len: usize,
    /// Epoch of the next window.
    pub epoch: u64,
    /// Windows of `epoch` already yielded by each rank.
    pub window: u64,
    /// Windows per rank per epoch (`c`).
    pub windows_per_epoch: u64,
}

const CURSOR_VERSION: u32 = 1;

/// What a source looks like, for logs.
#[derive(Clone, Debug, PartialEq)]
pub struct LoaderInfo {
    /// `shards` or `bin`.
    pub kind: String,
    /// Files read by this loader's split (shards or the `.bin`).
    pub files: usize,
    /// Tokens in the split.
    pub tokens: u64,
    /// Windows per rank per epoch.
    pub windows_per_epoch: u64,
    /// Batches per rank per epoch (fractional batches span epochs).
    pub batches_per_epoch: f64,
}

// ---------------------------------------------------------------------------
// Data specifications.

/// Where data comes from.
#[derive(Clone, Debug)]
pub enum DataSpec {
    /// A `manifest.json` (or a folder holding one).
    Manifest(PathBuf),
    /// Explicit shard files (from a brace pattern or a single `.tar`).
    Shards(Vec<PathBuf>),
    /// A token file: raw little-endian `u16` (nanoGPT), llm.c's (a 1 KiB header), or
    /// Megatron-LM's `.bin` beside its `.idx` (u16 or i32 tokens).
    Bin(PathBuf),
}

impl DataSpec {
    /// Interprets a `--data` argument: a manifest or its folder, a brace
    /// pattern such as `data/train-{000000..000031}.tar`, a `.tar` shard, a
    /// `.bin` token file, or a Megatron-LM dataset (its `.bin`, its `.idx`, or the path prefix
    /// both share, as Megatron's `--data-path` names it).
    pub fn parse(s: &str) -> Result<DataSpec> {
        if s.contains('{') {
            let files = expand_braces(s)?;
            return Ok(DataSpec::Shards(
                files.into_iter().map(PathBuf::from).collect(),
            ));
        }
        let p = PathBuf::from(s);
        let lower = s.to_lowercase();
        let megatron_prefix = || {
            !p.exists()
                && PathBuf::from(format!("{s}.bin")).is_file()
                && PathBuf::from(format!("{s}.idx")).is_file()
        };
        if lower.ends_with(".bin") {
            Ok(DataSpec::Bin(p))
        } else if lower.ends_with(".idx") {
            Ok(DataSpec::Bin(p.with_extension("bin")))
        } else if megatron_prefix() {
            Ok(DataSpec::Bin(PathBuf::from(format!("{s}.bin"))))
        } else if lower.ends_with(".tar") {
            Ok(DataSpec::Shards(vec![p]))
        } else {
            Ok(DataSpec::Manifest(p))
        }
    }
}

/// Expands `{a..b}` numeric ranges (zero-padded to the width of `a`) and
/// `{x,y,z}` lists, left to right.
pub fn expand_braces(pattern: &str) -> Result<Vec<String>> {
    let bad = |what: &str| Error::Pattern {
        pattern: pattern.into(),
        what: what.into(),
    };
    let Some(open) = pattern.find('{') else {
        return Ok(vec![pattern.to_string()]);
    };
    let close = pattern[open..]
        .find('}')
        .map(|c| c + open)
        .ok_or_else(|| bad("unclosed `{`"))?;
    let (head, body, tail) = (
        &pattern[..open],
        &pattern[open + 1..close],
        &pattern[close + 1..],
    );
    let mut alts = Vec::new();
    if let Some((a, b)) = body.split_once("..") {
        let width = a.len();
        let lo: u64 = a.parse().map_err(|_| bad("range start is not a number"))?;
        let hi: u64 = b.parse().map_err(|_| bad("range end is not a number"))?;
        if hi < lo || hi - lo >= 1_000_000 {
            return Err(bad("range is empty or too large"));
        }
        for i in lo..=hi {
            alts.push(format!("{i:0width$}"));
        }
    } else {
        alts.extend(body.split(',').map(str::to_string));
    }
    let rests = expand_braces(tail).map_err(|_| bad("invalid pattern after the first brace"))?;
    if alts.len().saturating_mul(rests.len()) > 1_000_000 {
        return Err(bad("expands to more than 1000000 names"));
    }
    let mut out = Vec::with_capacity(alts.len() * rests.len());
    for a in &alts {
        for r in &rests {
            out.push(format!("{head}{a}{r}"));
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Shard source.

#[derive(Clone, Debug)]
struct Shard {
    path: PathBuf,
    tokens: u64,
    /// The manifest's hex sha256 (none for shard patterns).
    sha256: Option<String>,
}

#[derive(Clone)]
struct ShardSet {
    shards: Vec<Shard>,
    token_bytes: u64,
    vocab: u32,
    fingerprint: String,
    /// Whether shard token counts come from a manifest (then checked).
    from_manifest: bool,
    /// With [`Verify::FirstRead`]: which shards were checked already.
    first_read: Option<Arc<FirstRead>>,
}

/// The shards of one loader whose sha256 was checked
/// ([`Verify::FirstRead`]), indexed like [`ShardSet::shards`]; shared with
/// the loader's background thread.
struct FirstRead {
    checked: Vec<AtomicBool>,
}

/// A shard file whose sha256 matched in this process: path, expected
/// sha256 (lower case), size and modification time when hashed.
type VerifiedKey = (PathBuf, String, u64, Option<SystemTime>);

/// Shard files hashed by any loader of this process, so that a loader
/// built again (such as the validation loader at each evaluation) does not
/// hash them again. A file replaced since has another size or mtime.
static VERIFIED: Mutex<BTreeSet<VerifiedKey>> = Mutex::new(BTreeSet::new());

impl ShardSet {
    /// With [`Verify::FirstRead`], checks shard `i`'s sha256 unless this
    /// loader or process already did. Call before returning its samples.
    fn check_first_read(&self, i: usize) -> Result<()> {
        let Some(fr) = &self.first_read else {
            return Ok(());
        };
        if fr.checked[i].load(Ordering::Acquire) {
            return Ok(());
        }
        let sh = &self.shards[i];
        if let Some(expected) = &sh.sha256 {
            check_sha256_once(&sh.path, expected)?;
        }
        fr.checked[i].store(true, Ordering::Release);
        Ok(())
    }
}

/// [`check_sha256`], skipped when this process already hashed the same
/// file (path, size and mtime) and found `expected`.
fn check_sha256_once(path: &Path, expected: &str) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, "stat", e))?;
    let key: VerifiedKey = (
        path.to_path_buf(),
        expected.to_ascii_lowercase(),
        meta.len(),
        meta.modified().ok(),
    );
    // A poisoned lock only means the cache is not used.
    if VERIFIED.lock().is_ok_and(|v| v.contains(&key)) {
        return Ok(());
    }
    check_sha256(path, expected)?;
    if let Ok(mut v) = VERIFIED.lock() {
        v.insert(key);
    }
    Ok(())
}

fn open_shard_set(spec: &DataSpec, cfg: &LoaderConfig) -> Result<ShardSet> {
    match spec {
        DataSpec::Manifest(p) => {
            let (m, dir) = Manifest::load(p)?;
            let mpath = if p.is_dir() {
                p.join("manifest.json")
            } else {
                p.clone()
            };
            let split = match cfg.split {
                Split::Train => &m.train,
                Split::Val => &m.val,
            };
            for s in &split.shards {
                verify_shard(&dir, s, &mpath, cfg.verify == Verify::Full)?;
            }
            Ok(ShardSet {
                shards: split
                    .shards
                    .iter()
                    .map(|s| Shard {
                        path: dir.join(&s.file),
                        tokens: s.tokens,
                        sha256: Some(s.sha256.clone()),
                    })
                    .collect(),
                token_bytes: m.token_bytes() as u64,
                vocab: m.vocab_size,
                fingerprint: m.split_fingerprint(split),
                from_manifest: true,
                first_read: (cfg.verify == Verify::FirstRead).then(|| {
                    Arc::new(FirstRead {
                        checked: split
                            .shards
                            .iter()
                            .map(|_| AtomicBool::new(false))
                            .collect(),
                    })
                }),
            })
        }
        DataSpec::Shards(files) => {
            if cfg.split == Split::Val {
                return Err(Error::Config(
                    "a shard pattern has no validation split; pass a pattern of validation shards as the train split, or a manifest".into(),
                ));
            }
            let mut shards = Vec::new();
            let mut fp = sha2::Sha256::default();
            for f in files {
                if !f.exists() {
                    return Err(Error::MissingShard {
                        path: f.clone(),
                        listed_in: "the shard pattern".into(),
                    });
                }
                let tokens = count_tokens(f, 2, cfg.read_buffer)?;
                use sha2::Digest;
                fp.update(f.to_string_lossy().as_bytes());
                fp.update(tokens.to_le_bytes());
                shards.push(Shard {
                    path: f.clone(),
                    tokens,
                    sha256: None,
                });
            }
            use sha2::Digest;
            Ok(ShardSet {
                shards,
                token_bytes: 2,
                vocab: cfg.vocab_size,
                fingerprint: crate::manifest::hex(&fp.finalize()[..8]),
                from_manifest: false,
                first_read: None,
            })
        }
        DataSpec::Bin(_) => unreachable!("bin handled separately"),
    }
}

/// Tokens in a shard, from its headers (payloads are skipped).
fn count_tokens(path: &Path, token_bytes: u64, buf: usize) -> Result<u64> {
    let mut tar = TarReader::open(path, buf.min(64 << 10))?;
    let mut n = 0u64;
    while let Some(e) = tar.next_entry()? {
        if e.kind == EntryKind::File && e.name.ends_with(".tokens") {
            n += e.size / token_bytes;
        }
    }
    Ok(n)
}

/// A contiguous piece of one sample's tokens.
struct Piece {
    shard: usize,
    member: Arc<str>,
    /// File offset of the piece's first token.
    offset: u64,
    ntok: u64,
    data: Option<Vec<u8>>,
    /// Tokens already consumed.
    pos: u64,
}

struct Shared {
    skipped: AtomicU64,
}

/// Streams the pieces of the token range `[start, end)` of an epoch.
struct RangeReader {
    order: Vec<usize>,
    /// Global start offset of `order[i]`, plus the total at the end.
    cum: Vec<u64>,
    start: u64,
    end: u64,
    idx: usize,
    tar: Option<TarReader<FileSource>>,
    /// Global offset after the last member header seen.
    g: u64,
    /// Whether the current shard was scanned from its first member.
    from_shard_start: bool,
    scanned: u64,
    member: Option<Member>,
    done: bool,
}

struct Member {
    name: Arc<str>,
    data_offset: u64,
    g0: u64,
    ntok: u64,
    next: u64,
}

struct ShardStream {
    set: ShardSet,
    w: u64,
    rank: u64,
    seed: u64,
    shuffle: bool,
    cap: usize,
    skip_bad: bool,
    read_buffer: usize,
    c: u64,
    epoch: u64,
    k: u64,
    reader: RangeReader,
    reader_done: bool,
    buffer: Vec<Piece>,
    current: Option<Piece>,
    rng: SplitMix64,
    /// Pieces yielded in the current pass over the range (for wrap checks).
    pass_pieces: u64,
    /// When true, pieces are not loaded (replay).
    replay: bool,
    shared: Arc<Shared>,
    spare: Vec<Vec<u8>>,
}

fn log_skip(shared: &Shared, e: &Error) {
    let n = shared.skipped.fetch_add(1, Ordering::Relaxed) + 1;
    if n <= 100 || n.is_power_of_two() {
        eprintln!("warning: skipping bad sample ({n} so far): {e}");
    }
}

impl ShardStream {
    fn new(set: ShardSet, cfg: &LoaderConfig, shared: Arc<Shared>) -> Result<Self> {
        let w = cfg.window();
        let total: u64 = set.shards.iter().map(|s| s.tokens).sum();
        let n = total / w;
        let c = n / cfg.world as u64;
        if c == 0 {
            return Err(Error::Config(format!(
                "the {} split holds {total} tokens = {n} windows of {w} tokens, fewer than one per \
                 rank for {} ranks",
                match cfg.split {
                    Split::Train => "training",
                    Split::Val => "validation",
                },
                cfg.world
            )));
        }
        let mut s = ShardStream {
            set,
            w,
            rank: cfg.rank as u64,
            seed: cfg.seed,
            shuffle: cfg.shuffle,
            cap: cfg.shuffle_buffer,
            skip_bad: cfg.skip_bad_samples,
            read_buffer: cfg.read_buffer,
            c,
            epoch: 0,
            k: 0,
            reader: RangeReader::empty(),
            reader_done: false,
            buffer: Vec::new(),
            current: None,
            rng: SplitMix64(0),
            pass_pieces: 0,
            replay: false,
            shared,
            spare: Vec::new(),
        };
        s.start_epoch(0);
        Ok(s)
    }

    fn start_epoch(&mut self, epoch: u64) {
        let nshards = self.set.shards.len();
        let mut order: Vec<usize> = (0..nshards).collect();
        if self.shuffle {
            SplitMix64::from_parts(&[self.seed, epoch, 0x0053_4841_5244]).shuffle(&mut order);
        }
        let mut cum = Vec::with_capacity(nshards + 1);
        let mut acc = 0u64;
        for &i in &order {
            cum.push(acc);
            acc += self.set.shards[i].tokens;
        }
        cum.push(acc);
        let start = self.rank * self.c * self.w;
        let end = start + self.c * self.w;
        self.reader = RangeReader::new(order, cum, start, end);
        self.reader_done = false;
        self.buffer.clear();
        self.current = None;
        self.rng = SplitMix64::from_parts(&[self.seed, epoch, self.rank, 0x5341_4d50_4c45]);
        self.epoch = epoch;
        self.k = 0;
        self.pass_pieces = 0;
    }

    fn restart_range(&mut self) {
        let r = &self.reader;
        self.reader = RangeReader::new(r.order.clone(), r.cum.clone(), r.start, r.end);
        self.reader_done = false;
        self.pass_pieces = 0;
    }

    fn next_piece(&mut self) -> Result<Option<Piece>> {
        let load = !self.replay || self.skip_bad;
        if !self.shuffle {
            return self.reader_next(load);
        }
        while self.buffer.len() < self.cap && !self.reader_done {
            match self.reader_next(load)? {
                Some(p) => self.buffer.push(p),
                None => self.reader_done = true,
            }
        }
        if self.buffer.is_empty() {
            return Ok(None);
        }
        let i = self.rng.below(self.buffer.len() as u64) as usize;
        Ok(Some(self.buffer.swap_remove(i)))
    }

    fn reader_next(&mut self, load: bool) -> Result<Option<Piece>> {
        loop {
            let p = self
                .reader
                .next(&self.set, self.read_buffer, load, &mut self.spare);
            match p {
                Ok(Some(mut p)) => {
                    if p.data.is_some() {
                        if let Err(e) = self.validate(&p) {
                            if self.skip_bad {
                                log_skip(&self.shared, &e);
                                if let Some(d) = p.data.take() {
                                    self.spare.push(d);
                                }
                                continue;
                            }
                            return Err(e);
                        }
                    }
                    return Ok(Some(p));
                }
                Ok(None) => return Ok(None),
                Err(e @ Error::BadSample { .. }) if self.skip_bad => {
                    log_skip(&self.shared, &e);
                }
                Err(e @ Error::Tar { .. }) if self.skip_bad => {
                    // The rest of a corrupt or truncated shard is unreadable.
                    log_skip(&self.shared, &e);
                    self.reader.abandon_shard();
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn validate(&self, p: &Piece) -> Result<()> {
        let data = p.data.as_deref().unwrap_or(&[]);
        let vocab = self.set.vocab;
        let tb = self.set.token_bytes as usize;
        let bad = if tb == 2 {
            let mut max = 0u16;
            for c in data.chunks_exact(2) {
                max = max.max(u16::from_le_bytes([c[0], c[1]]));
            }
            (max as u32) >= vocab
        } else {
            let mut max = 0u32;
            for c in data.chunks_exact(4) {
                max = max.max(u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            }
            max >= vocab
        };
        if !bad {
            return Ok(());
        }
        let (i, v) = data
            .chunks_exact(tb)
            .map(|c| {
                if tb == 2 {
                    u16::from_le_bytes([c[0], c[1]]) as u32
                } else {
                    u32::from_le_bytes([c[0], c[1], c[2], c[3]])
                }
            })
            .enumerate()
            .find(|&(_, v)| v >= vocab)
            .unwrap_or((0, 0));
        Err(Error::BadSample {
            path: self.set.shards[p.shard].path.clone(),
            member: p.member.to_string(),
            offset: p.offset + (i * tb) as u64,
            what: format!("token id {v} is not below the vocabulary size {vocab}"),
        })
    }

    /// Loads the payloads of pieces restored by a replay.
    fn load_missing(&mut self) -> Result<()> {
        let tb = self.set.token_bytes;
        let mut todo: Vec<&mut Piece> = self.buffer.iter_mut().collect();
        if let Some(c) = self.current.as_mut() {
            todo.push(c);
        }
        for p in todo {
            if p.data.is_some() {
                continue;
            }
            self.set.check_first_read(p.shard)?;
            let path = &self.set.shards[p.shard].path;
            let mut f = FileSource::open(path, 1 << 16)?;
            f.seek_to(p.offset)
                .map_err(|e| Error::io(path, "seek", e))?;
            let mut d = vec![0u8; (p.ntok * tb) as usize];
            std::io::Read::read_exact(&mut f, &mut d).map_err(|e| Error::BadSample {
                path: path.clone(),
                member: p.member.to_string(),
                offset: p.offset,
                what: format!("cannot re-read {} bytes: {e}", d.len()),
            })?;
            p.data = Some(d);
        }
        let pieces: Vec<usize> = (0..self.buffer.len()).collect();
        for i in pieces {
            self.validate(&self.buffer[i])?;
        }
        if let Some(c) = &self.current {
            self.validate(c)?;
        }
        Ok(())
    }

    /// Produces the next window into `out` (or skips it when `None`).
    fn next_window(&mut self, mut out: Option<&mut [u32]>) -> Result<()> {
        if self.k == self.c {
            self.start_epoch(self.epoch + 1);
        }
        let w = self.w;
        let tb = self.set.token_bytes;
        let mut filled = 0u64;
        while filled < w {
            let need_piece = self.current.as_ref().is_none_or(|p| p.pos == p.ntok);
            if need_piece {
                if let Some(p) = self.current.take() {
                    if let Some(d) = p.data {
                        self.spare.push(d);
                    }
                }
                match self.next_piece()? {
                    Some(p) => {
                        self.pass_pieces += 1;
                        self.current = Some(p);
                    }
                    None => {
                        if self.skip_bad && self.pass_pieces > 0 {
                            // Bad samples were skipped: wrap to the start of
                            // this rank's range so every rank still yields
                            // exactly `c` windows per epoch.
                            self.restart_range();
                            continue;
                        }
                        return Err(Error::Config(format!(
                            "epoch {} rank {}: the shards ended after fewer tokens than the manifest or headers declare ({} of {} windows)",
                            self.epoch, self.rank, self.k, self.c
                        )));
                    }
                }
            }
            let p = self.current.as_mut().expect("current piece");
            let take = (w - filled).min(p.ntok - p.pos);
            if let (Some(o), Some(d)) = (out.as_deref_mut(), p.data.as_deref()) {
                let dst = &mut o[filled as usize..(filled + take) as usize];
                let src = &d[(p.pos * tb) as usize..((p.pos + take) * tb) as usize];
                if tb == 2 {
                    for (x, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                        *x = u16::from_le_bytes([s[0], s[1]]) as u32;
                    }
                } else {
                    for (x, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                        *x = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                    }
                }
            }
            p.pos += take;
            filled += take;
        }
        self.k += 1;
        Ok(())
    }

    fn seek(&mut self, epoch: u64, window: u64) -> Result<()> {
        self.start_epoch(epoch);
        self.replay = true;
        let res = (|| {
            for _ in 0..window {
                self.next_window(None)?;
            }
            Ok(())
        })();
        self.replay = false;
        res?;
        self.load_missing()
    }
}

impl RangeReader {
    fn empty() -> Self {
        RangeReader::new(Vec::new(), vec![0], 0, 0)
    }

    fn abandon_shard(&mut self) {
        self.tar = None;
        self.member = None;
        self.idx += 1;
        self.from_shard_start = true;
        self.g = self.cum[self.idx.min(self.cum.len() - 1)];
        if self.g >= self.end || self.idx >= self.order.len() {
            self.done = true;
        }
    }

    fn new(order: Vec<usize>, cum: Vec<u64>, start: u64, end: u64) -> Self {
        // First shard whose tokens reach past `start`.
        let idx = cum.partition_point(|&c| c <= start).saturating_sub(1);
        let g = cum.get(idx).copied().unwrap_or(0);
        RangeReader {
            order,
            cum,
            start,
            end,
            idx,
            tar: None,
            g,
            from_shard_start: true,
            scanned: 0,
            member: None,
            done: start >= end,
        }
    }

    fn next(
        &mut self,
        set: &ShardSet,
        bufsize: usize,
        load: bool,
        spare: &mut Vec<Vec<u8>>,
    ) -> Result<Option<Piece>> {
        let tb = set.token_bytes;
        loop {
            if let Some(m) = &mut self.member {
                let a = m.next;
                let b = m.ntok.min(a + MAX_PIECE_TOKENS).min(self.end - m.g0);
                let shard = self.order[self.idx];
                let tar = self.tar.as_mut().expect("open shard");
                let nbytes = (b - a) * tb;
                let data = if load {
                    // The shard may have been opened by a replay, which
                    // reads headers only.
                    set.check_first_read(shard)?;
                    let mut d = spare.pop().unwrap_or_default();
                    d.clear();
                    d.resize(nbytes as usize, 0);
                    let mut got = 0;
                    while got < d.len() {
                        let n = tar.read_some(&mut d[got..])?;
                        if n == 0 {
                            break;
                        }
                        got += n;
                    }
                    Some(d)
                } else {
                    tar.skip_data(nbytes)?;
                    None
                };
                let piece = Piece {
                    shard,
                    member: m.name.clone(),
                    offset: m.data_offset + a * tb,
                    ntok: b - a,
                    data,
                    pos: 0,
                };
                m.next = b;
                if m.g0 + b >= self.end {
                    self.done = true;
                    self.member = None;
                } else if b == m.ntok {
                    self.member = None;
                }
                return Ok(Some(piece));
            }
            if self.done {
                return Ok(None);
            }
            if self.tar.is_none() {
                if self.idx >= self.order.len() {
                    self.done = true;
                    return Ok(None);
                }
                if load {
                    set.check_first_read(self.order[self.idx])?;
                }
                let sh = &set.shards[self.order[self.idx]];
                self.tar = Some(TarReader::open(&sh.path, bufsize)?);
                self.g = self.cum[self.idx];
                self.scanned = 0;
            }
            let tar = self.tar.as_mut().expect("open shard");
            match tar.next_entry()? {
                None => {
                    let sh = &set.shards[self.order[self.idx]];
                    let declared = sh.tokens;
                    let scanned = self.scanned;
                    let path = sh.path.clone();
                    let full = self.from_shard_start;
                    self.tar = None;
                    self.idx += 1;
                    self.from_shard_start = true;
                    self.g = self.cum[self.idx.min(self.cum.len() - 1)];
                    if self.g >= self.end {
                        self.done = true;
                    }
                    if full && set.from_manifest && scanned != declared {
                        return Err(Error::BadSample {
                            path,
                            member: "(whole shard)".into(),
                            offset: 0,
                            what: format!(
                                "shard holds {scanned} tokens but the manifest declares {declared}"
                            ),
                        });
                    }
                }
                Some(e) => {
                    if e.kind != EntryKind::File || !e.name.ends_with(".tokens") {
                        continue;
                    }
                    let ntok = e.size / tb;
                    let g0 = self.g;
                    self.g += ntok;
                    self.scanned += ntok;
                    if e.size % tb != 0 {
                        return Err(Error::BadSample {
                            path: tar.path().to_path_buf(),
                            member: e.name,
                            offset: e.data_offset,
                            what: format!(
                                "{} bytes is not a multiple of the {tb}-byte token size",
                                e.size
                            ),
                        });
                    }
                    if g0 >= self.end {
                        self.done = true;
                        return Ok(None);
                    }
                    if self.g <= self.start || ntok == 0 {
                        continue;
                    }
                    let a0 = self.start.saturating_sub(g0);
                    tar.skip_data(a0 * tb)?;
                    self.member = Some(Member {
                        name: e.name.into(),
                        data_offset: e.data_offset,
                        g0,
                        ntok,
                        next: a0,
                    });
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Raw .bin source.

/// llm.c's token files (`dev/data/*.bin`): a 256 × i32 header (magic 20240520, version 1 = u16
/// tokens, the token count) before the tokens.
const LLMC_MAGIC: u32 = 20240520;
const LLMC_HEADER_BYTES: u64 = 1024;

/// Megatron-LM's index file (`MMIDIDX\0\0`, version 1): the dtype of the `.bin` beside it and
/// every sequence's size and byte offset.
const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
const MEGATRON_HEADER_BYTES: u64 = 9 + 8 + 1 + 8 + 8;

/// Where a token file's tokens start, how many there are and how wide each is.
#[derive(Clone, Copy, Debug, PartialEq)]
struct BinLayout {
    start: u64,
    tokens: u64,
    /// Bytes per token: 2 (u16) or 4 (Megatron's i32 for vocabularies past 65,500).
    width: u64,
}

/// A token file's layout: Megatron-LM's when an `.idx` lies beside it (dtype and size checked
/// against the index's last sequence), llm.c's after its header (version and token count
/// checked), else raw u16 from byte 0 (nanoGPT's `train.bin`/`val.bin`).
fn bin_layout(path: &Path, len: u64) -> Result<BinLayout> {
    let idx = path.with_extension("idx");
    if idx.is_file() {
        return megatron_layout(path, &idx, len);
    }
    let mut head = [0u8; 12];
    let bad = |offset: u64, what: String| Error::BadTokenFile {
        path: path.into(),
        offset,
        what,
    };
    let n = std::fs::File::open(path)
        .and_then(|mut f| {
            use std::io::Read;
            f.read(&mut head)
        })
        .map_err(|e| Error::io(path, "read", e))?;
    let word = |i: usize| {
        u32::from_le_bytes([
            head[4 * i],
            head[4 * i + 1],
            head[4 * i + 2],
            head[4 * i + 3],
        ])
    };
    if n == head.len() && word(0) == LLMC_MAGIC {
        if word(1) != 1 {
            return Err(bad(
                4,
                format!(
                    "an llm.c token file of version {} (fugu reads version 1: u16 tokens)",
                    word(1)
                ),
            ));
        }
        let tokens = word(2) as u64;
        if len != LLMC_HEADER_BYTES + 2 * tokens {
            return Err(bad(
                8,
                format!(
                    "an llm.c token file whose header says {tokens} tokens, but it holds {} bytes \
                     after the {LLMC_HEADER_BYTES}-byte header (truncated?)",
                    len.saturating_sub(LLMC_HEADER_BYTES)
                ),
            ));
        }
        return Ok(BinLayout {
            start: LLMC_HEADER_BYTES,
            tokens,
            width: 2,
        });
    }
    if !len.is_multiple_of(2) {
        return Err(bad(
            len - 1,
            format!("{len} bytes is not a whole number of u16 tokens"),
        ));
    }
    Ok(BinLayout {
        start: 0,
        tokens: len / 2,
        width: 2,
    })
}

/// The layout of Megatron-LM's `bin` (`len` bytes) from its index `idx`. The documents'
/// boundaries are not needed: the tokens are read as one stream, as nanoGPT's are (Megatron
/// ends each document with the end-of-text id too).
fn megatron_layout(bin: &Path, idx: &Path, len: u64) -> Result<BinLayout> {
    use std::io::{Read, Seek, SeekFrom};
    let bad = |offset: u64, what: String| Error::BadTokenFile {
        path: idx.into(),
        offset,
        what,
    };
    let mut f = std::fs::File::open(idx).map_err(|e| Error::io(idx, "open", e))?;
    let idx_len = f.metadata().map_err(|e| Error::io(idx, "stat", e))?.len();
    let mut head = [0u8; MEGATRON_HEADER_BYTES as usize];
    if idx_len < MEGATRON_HEADER_BYTES {
        return Err(bad(
            0,
            format!("{idx_len} bytes is shorter than a Megatron-LM index header"),
        ));
    }
    f.read_exact(&mut head)
        .map_err(|e| Error::io(idx, "read", e))?;
    if &head[..9] != MEGATRON_MAGIC {
        return Err(bad(
            0,
            format!(
                "lies beside {} but is not a Megatron-LM index (no MMIDIDX magic)",
                bin.display()
            ),
        ));
    }
    let u64_at = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
    let version = u64_at(&head[9..17]);
    if version != 1 {
        return Err(bad(
            9,
            format!("Megatron-LM index version {version} (fugu reads 1)"),
        ));
    }
    let width = match head[17] {
        8 => 2,
        4 => 4,
        code => {
            return Err(bad(
                17,
                format!(
                    "Megatron-LM dtype code {code}: fugu reads 8 (uint16) and 4 (int32) tokens"
                ),
            ))
        }
    };
    let sequences = u64_at(&head[18..26]);
    let sizes_at = MEGATRON_HEADER_BYTES;
    let pointers_at = sizes_at + 4 * sequences;
    if sequences == 0 || idx_len < pointers_at + 8 * sequences {
        return Err(bad(
            18,
            format!("{sequences} sequences do not fit the {idx_len}-byte index (truncated?)"),
        ));
    }
    let mut last = |at: u64, n: usize| -> Result<u64> {
        let mut b = [0u8; 8];
        f.seek(SeekFrom::Start(at))
            .and_then(|_| f.read_exact(&mut b[..n]))
            .map_err(|e| Error::io(idx, "read", e))?;
        Ok(u64::from_le_bytes(b))
    };
    let last_size = last(sizes_at + 4 * (sequences - 1), 4)?;
    let last_pointer = last(pointers_at + 8 * (sequences - 1), 8)?;
    let end = last_pointer + last_size * width;
    if end != len {
        return Err(Error::BadTokenFile {
            path: bin.into(),
            offset: len.min(end),
            what: format!(
                "holds {len} bytes, but its index {} ends its last sequence at byte {end} \
                 (truncated, or another dataset's index?)",
                idx.display()
            ),
        });
    }
    Ok(BinLayout {
        start: 0,
        tokens: len / width,
        width,
    })
}

struct BinStream {
    path: PathBuf,
    file: FileSource,
    file_pos: u64,
    /// Offset of the first token (after llm.c's header), the token count and width.
    start: u64,
    tokens: u64,
    width: u64,
    n_windows: u64,
    c: u64,
    w: u64,
    rank: u64,
    seed: u64,
    shuffle: bool,
    vocab: u32,
    epoch: u64,
    k: u64,
    perm: Option<Permutation>,
    buf: Vec<u8>,
    skip_bad: bool,
    shared: Arc<Shared>,
}

impl BinStream {
    fn new(path: &Path, cfg: &LoaderConfig, shared: Arc<Shared>) -> Result<Self> {
        let file = FileSource::open(path, cfg.read_buffer)?;
        let BinLayout {
            start,
            tokens,
            width,
        } = bin_layout(path, tar_len(&file))?;
        let w = cfg.window();
        let n_windows = tokens / w;
        let c = n_windows / cfg.world as u64;
        if c == 0 {
            return Err(Error::Config(format!(
                "{}: {} tokens = {n_windows} windows of {w}, fewer than one per rank for {} ranks",
                path.display(),
                tokens,
                cfg.world
            )));
        }
        let mut s = BinStream {
            path: path.into(),
            file,
            file_pos: 0,
            start,
            tokens,
            width,
            n_windows,
            c,
            w,
            rank: cfg.rank as u64,
            seed: cfg.seed,
            shuffle: cfg.shuffle,
            vocab: cfg.vocab_size,
            epoch: 0,
            k: 0,
            perm: None,
            buf: vec![0u8; (w * width) as usize],
            skip_bad: cfg.skip_bad_samples,
            shared,
        };
        s.set_epoch(0);
        Ok(s)
    }

    fn set_epoch(&mut self, e: u64) {
        self.epoch = e;
        self.k = 0;
        self.perm = self.shuffle.then(|| {
            Permutation::new(
                self.n_windows,
                SplitMix64::from_parts(&[self.seed, e, 0x42_494e]).next_u64(),
            )
        });
    }

    fn next_window(&mut self, out: Option<&mut [u32]>) -> Result<()> {
        let Some(out) = out else {
            self.advance();
            return Ok(());
        };
        let mut skipped_in_a_row = 0u64;
        loop {
            if self.k == self.c {
                self.set_epoch(self.epoch + 1);
            }
            let g = self.rank * self.c + self.k;
            let idx = match &self.perm {
                Some(p) => p.apply(g),
                None => g,
            };
            self.k += 1;
            let off = self.start + idx * self.w * self.width;
            if off != self.file_pos {
                let delta = off as i128 - self.file_pos as i128;
                if (0..(1 << 20)).contains(&delta) {
                    crate::tar::TarSource::skip_bytes(&mut self.file, delta as u64)
                } else {
                    self.file.seek_to(off)
                }
                .map_err(|e| Error::io(&self.path, "seek", e))?;
            }
            std::io::Read::read_exact(&mut self.file, &mut self.buf).map_err(|e| {
                Error::BadTokenFile {
                    path: self.path.clone(),
                    offset: off,
                    what: format!("cannot read a window of {} tokens: {e}", self.w),
                }
            })?;
            self.file_pos = off + self.w * self.width;
            let mut max = 0u32;
            if self.width == 2 {
                for (x, s) in out.iter_mut().zip(self.buf.chunks_exact(2)) {
                    *x = u16::from_le_bytes([s[0], s[1]]) as u32;
                    max = max.max(*x);
                }
            } else {
                // Megatron's i32: a negative id reads as a huge u32 and is refused below.
                for (x, s) in out.iter_mut().zip(self.buf.chunks_exact(4)) {
                    *x = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                    max = max.max(*x);
                }
            }
            if max < self.vocab {
                return Ok(());
            }
            let i = out.iter().position(|&v| v >= self.vocab).unwrap_or(0);
            let e = Error::BadTokenFile {
                path: self.path.clone(),
                offset: off + self.width * i as u64,
                what: format!(
                    "token id {} is not below the vocabulary size {}",
                    out[i], self.vocab
                ),
            };
            skipped_in_a_row += 1;
            if !self.skip_bad || skipped_in_a_row >= self.c {
                return Err(e);
            }
            log_skip(&self.shared, &e);
        }
    }

    fn advance(&mut self) {
        if self.k == self.c {
            self.set_epoch(self.epoch + 1);
        }
        self.k += 1;
    }
}

fn tar_len(f: &FileSource) -> u64 {
    crate::tar::TarSource::total_len(f).unwrap_or(0)
}

// ---------------------------------------------------------------------------
// Engine and the public loader.

enum Stream {
    Shards(Box<ShardStream>),
    Bin(Box<BinStream>),
}

struct Engine {
    stream: Stream,
    cfg: LoaderConfig,
    base: Cursor,
}

impl Engine {
    fn position(&self) -> (u64, u64) {
        match &self.stream {
            Stream::Shards(s) => (s.epoch, s.k),
            Stream::Bin(b) => (b.epoch, b.k),
        }
    }

    fn cursor(&self) -> Cursor {
        let (mut epoch, mut window) = self.position();
        if window == self.base.windows_per_epoch {
            epoch += 1;
            window = 0;
        }
        Cursor {
            epoch,
            window,
            ..self.base.clone()
        }
    }

    fn fill(&mut self, tokens: &mut Vec<u32>) -> Result<()> {
        let w = self.cfg.seq_len + 1;
        tokens.clear();
        tokens.resize(self.cfg.batch_size * w, 0);
        for row in tokens.chunks_exact_mut(w) {
            match &mut self.stream {
                Stream::Shards(s) => s.next_window(Some(row))?,
                Stream::Bin(b) => b.next_window(Some(row))?,
            }
        }
        Ok(())
    }

    fn batch(&mut self, mut tokens: Vec<u32>) -> Result<(Batch, Cursor)> {
        self.fill(&mut tokens)?;
        Ok((
            Batch {
                tokens,
                batch_size: self.cfg.batch_size,
                seq_len: self.cfg.seq_len,
            },
            self.cursor(),
        ))
    }
}

type Produced = Result<(Batch, Cursor)>;

enum Mode {
    Sync(Box<Engine>),
    Async {
        rx: Option<Receiver<Produced>>,
        recycle: Sender<Vec<u32>>,
        handle: Option<JoinHandle<()>>,
    },
}

/// The training/validation data loader. Create one per rank.
pub struct Loader {
    mode: Mode,
    cursor: Cursor,
    info: LoaderInfo,
    shared: Arc<Shared>,
    failed: bool,
}

impl Loader {
    /// Opens `data` (see [`DataSpec::parse`]) at the start of epoch 0.
    pub fn new(data: &str, cfg: &LoaderConfig) -> Result<Loader> {
        Self::open(&DataSpec::parse(data)?, cfg, None)
    }

    /// Opens `data` positioned at a saved cursor. The cursor's seed,
    /// shuffle flag and shuffle-buffer size replace the configuration's. If
    /// the world size, `B` or `T` changed, the position is converted (see
    /// `docs/DATA.md`).
    pub fn resume(data: &str, cfg: &LoaderConfig, cursor: &Cursor) -> Result<Loader> {
        Self::open(&DataSpec::parse(data)?, cfg, Some(cursor))
    }

    /// Opens a parsed [`DataSpec`], optionally at a cursor.
    pub fn open(spec: &DataSpec, cfg: &LoaderConfig, cursor: Option<&Cursor>) -> Result<Loader> {
        cfg.check()?;
        let mut cfg = cfg.clone();
        if let Some(c) = cursor {
            if c.version != CURSOR_VERSION {
                return Err(Error::Cursor(format!(
                    "cursor version {} is not supported",
                    c.version
                )));
            }
            if c.split != cfg.split {
                return Err(Error::Cursor(format!(
                    "cursor is for the {:?} split, loader reads {:?}",
                    c.split, cfg.split
                )));
            }
            cfg.seed = c.seed;
            cfg.shuffle = c.shuffle;
            cfg.shuffle_buffer = c.shuffle_buffer.max(1);
        }
        let shared = Arc::new(Shared {
            skipped: AtomicU64::new(0),
        });
        let (stream, kind, data, files, tokens, c) = match spec {
            DataSpec::Bin(p) => {
                if cfg.split == Split::Val {
                    return Err(Error::Config(format!(
                        "{}: a raw .bin file has no validation split (evaluate on a .bin file \
                         named as the validation data itself: fugu train --val-data val.bin)",
                        p.display()
                    )));
                }
                let b = BinStream::new(p, &cfg, shared.clone())?;
                let fp = format!("bin:{}", b.tokens);
                let (tokens, c) = (b.tokens, b.c);
                (Stream::Bin(Box::new(b)), "bin", fp, 1, tokens, c)
            }
            _ => {
                let set = open_shard_set(spec, &cfg)?;
                let files = set.shards.len();
                let tokens = set.shards.iter().map(|s| s.tokens).sum();
                let fp = set.fingerprint.clone();
                let s = ShardStream::new(set, &cfg, shared.clone())?;
                let c = s.c;
                (Stream::Shards(Box::new(s)), "shards", fp, files, tokens, c)
            }
        };
        let base = Cursor {
            version: CURSOR_VERSION,
            kind: kind.into(),
            data,
            split: cfg.split,
            seed: cfg.seed,
            shuffle: cfg.shuffle,
            shuffle_buffer: cfg.shuffle_buffer,
            world: cfg.world,
            batch_size: cfg.batch_size,
            seq_len: cfg.seq_len,
            epoch: 0,
            window: 0,
            windows_per_epoch: c,
        };
        let mut engine = Engine {
            stream,
            cfg: cfg.clone(),
            base,
        };
        if let Some(cur) = cursor {
            if cur.kind != engine.base.kind || cur.data != engine.base.data {
                return Err(Error::Cursor(format!(
                    "cursor was saved on other data ({} {}), this is {} {}",
                    cur.kind, cur.data, engine.base.kind, engine.base.data
                )));
            }
            if cur.window > cur.windows_per_epoch && cur.windows_per_epoch > 0 {
                return Err(Error::Cursor(format!(
                    "cursor position {} is beyond the {} windows per epoch the cursor itself \
                     records (an edited state.json?)",
                    cur.window, cur.windows_per_epoch
                )));
            }
            let (epoch, window) = convert_position(cur, c);
            match &mut engine.stream {
                Stream::Shards(s) => s.seek(epoch, window)?,
                Stream::Bin(b) => {
                    b.set_epoch(epoch);
                    b.k = window;
                }
            }
        }
        let cursor = engine.cursor();
        let info = LoaderInfo {
            kind: kind.into(),
            files,
            tokens,
            windows_per_epoch: c,
            batches_per_epoch: c as f64 / cfg.batch_size as f64,
        };
        let mode = if cfg.prefetch == 0 {
            Mode::Sync(Box::new(engine))
        } else {
            let (tx, rx) = mpsc::sync_channel::<Produced>(cfg.prefetch);
            let (rtx, rrx) = mpsc::channel::<Vec<u32>>();
            let handle = std::thread::Builder::new()
                .name(format!("fugu-loader-{}", cfg.rank))
                .spawn(move || producer(engine, tx, rrx))
                .map_err(|e| Error::Thread(format!("cannot start: {e}")))?;
            Mode::Async {
                rx: Some(rx),
                recycle: rtx,
                handle: Some(handle),
            }
        };
        Ok(Loader {
            mode,
            cursor,
            info,
            shared,
            failed: false,
        })
    }

    /// The next batch. After an error the loader stays failed.
    pub fn next_batch(&mut self) -> Result<Batch> {
        if self.failed {
            return Err(Error::Thread("the loader failed earlier".into()));
        }
        let res = match &mut self.mode {
            Mode::Sync(engine) => engine.batch(Vec::new()),
            Mode::Async { rx, handle, .. } => match rx.as_ref().map(|r| r.recv()) {
                Some(Ok(r)) => r,
                _ => {
                    let msg = match handle.take().map(|h| h.join()) {
                        Some(Err(p)) => p
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "panic".into()),
                        _ => "no more batches".into(),
                    };
                    Err(Error::Thread(msg))
                }
            },
        };
        match res {
            Ok((b, c)) => {
                self.cursor = c;
                Ok(b)
            }
            Err(e) => {
                self.failed = true;
                Err(e)
            }
        }
    }

    /// Gives a batch's buffer back for reuse (optional; saves allocations).
    pub fn recycle(&self, batch: Batch) {
        if let Mode::Async { recycle, .. } = &self.mode {
            let _ = recycle.send(batch.tokens);
        }
    }

    /// Position after the last batch returned (save it in checkpoints).
    pub fn cursor(&self) -> Cursor {
        self.cursor.clone()
    }

    /// Shape of the source.
    pub fn info(&self) -> &LoaderInfo {
        &self.info
    }

    /// Bad samples skipped so far (with `skip_bad_samples`), counted when
    /// read, which may be ahead of the batches returned.
    pub fn skipped_bad_samples(&self) -> u64 {
        self.shared.skipped.load(Ordering::Relaxed)
    }
}

/// Maps a saved position onto this loader's windows per epoch `c`: the
/// same position when `c` is unchanged, else the same fraction of the epoch.
fn convert_position(cur: &Cursor, c: u64) -> (u64, u64) {
    if cur.windows_per_epoch == c || cur.windows_per_epoch == 0 {
        return (cur.epoch, cur.window.min(c.saturating_sub(1)));
    }
    let w = (cur.window as u128 * c as u128 / cur.windows_per_epoch as u128) as u64;
    (cur.epoch, w.min(c - 1))
}

fn producer(mut engine: Engine, tx: SyncSender<Produced>, recycle: Receiver<Vec<u32>>) {
    loop {
        let buf = recycle.try_recv().unwrap_or_default();
        let r = engine.batch(buf);
        let failed = r.is_err();
        if tx.send(r).is_err() || failed {
            return;
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        if let Mode::Async { rx, handle, .. } = &mut self.mode {
            drop(rx.take());
            if let Some(h) = handle.take() {
                let _ = h.join();
            }
        }
    }
}

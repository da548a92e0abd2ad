//! `prepare`: text in, WebDataset-style token shards plus `manifest.json` out.
//!
//! Inputs are walked in a fixed order (arguments as given; folders sorted by
//! name; tar members and JSONL lines in file order). Text is cut into chunks
//! only where GPT-2's pre-tokenizer cannot join across the cut, tokenised in
//! parallel batches, and written in input order, so the output does not
//! depend on the thread count and a re-run is byte-identical.

use crate::bundled;
use crate::columnar;
use crate::error::{Error, Result};
use crate::loader::expand_braces;
use crate::manifest::{
    hex, Manifest, ShardInfo, SplitInfo, SplitRule, Totals, MANIFEST_FORMAT, MANIFEST_VERSION,
};
use crate::replace::Staging;
use crate::sniff::not_text;
use crate::tar::{EntryKind, StreamSource, TarReader, TarSource, TarWriter};
use crate::tokenizer::{is_safe_cut, tokenizer_by_name, train_bpe, Tokenizer};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Options of [`prepare`].
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// Text files, folders, `.tar` archives, JSONL (`.jsonl`, `.ndjson`; a `.json` file named
    /// here may also be one JSON array of records), Parquet, Arrow IPC and Hugging Face
    /// `save_to_disk` folders; any but Parquet and Arrow may be compressed (`.gz`, `.zst`).
    /// A path with braces (`shard-{000..009}.parquet`, `{a,b}.txt`) names every expansion.
    /// Empty: the bundled Shakespeare corpus.
    pub inputs: Vec<PathBuf>,
    /// The field (JSON) or column (Parquet, Arrow) holding each record's text.
    pub text_field: String,
    /// Output folder: created, or replaced as a whole once the new dataset
    /// is complete (see [`prepare`]).
    pub out_dir: PathBuf,
    /// Tokenizer: `gpt2`, or a Hugging Face `tokenizer.json` (a file, or a folder holding
    /// one) that is copied into the dataset as [`TOKENIZER_FILE`].
    pub tokenizer: String,
    /// Train a byte-level BPE of this many ids on the training documents of the inputs and
    /// shard with it instead of `tokenizer` (stored in the dataset as [`TOKENIZER_FILE`]).
    /// The training text is held in memory.
    pub train_tokenizer: Option<u32>,
    /// Target shard size in bytes (a shard holds at least one sample).
    pub shard_bytes: u64,
    /// Fraction of documents held out for validation (0 disables).
    pub val_fraction: f64,
    /// Also store `KEY.txt` (the decoded text of the sample).
    pub write_text: bool,
    /// Skip unreadable inputs / bad JSONL lines instead of failing.
    pub skip_bad: bool,
    /// Worker threads for tokenisation (`None`: all cores).
    pub threads: Option<usize>,
    /// Show a progress bar on stderr.
    pub progress: bool,
    /// Longest sample; longer documents are split into parts.
    pub max_sample_tokens: usize,
    /// Target size of a tokenisation chunk in bytes.
    pub chunk_bytes: usize,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions {
            inputs: Vec::new(),
            text_field: "text".into(),
            out_dir: PathBuf::from("data/shakespeare"),
            tokenizer: "gpt2".into(),
            train_tokenizer: None,
            shard_bytes: 256 << 20,
            val_fraction: 0.05,
            write_text: false,
            skip_bad: false,
            threads: None,
            progress: false,
            max_sample_tokens: 1 << 18,
            chunk_bytes: 256 << 10,
        }
    }
}

/// What [`prepare`] did.
#[derive(Clone, Debug)]
pub struct PrepareSummary {
    /// Path of the written `manifest.json`.
    pub manifest_path: PathBuf,
    /// The manifest itself.
    pub manifest: Manifest,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// Tokenises the inputs into shards. Usable without the CLI (the trainer
/// calls it to prepare the bundled corpus).
///
/// Everything is written into a temporary sibling of `out_dir`
/// (`.NAME.tmp-PID`), fsynced, and swapped in only at the end, so a failed
/// or killed run leaves an existing dataset in `out_dir` byte-identical.
/// Leftovers of a killed earlier run are cleaned up first. An `out_dir` that
/// exists, is not empty and is not a fugu dataset is refused, and so are
/// inputs that hold no document ([`Error::NoDocuments`]).
pub fn prepare(opts: &PrepareOptions) -> Result<PrepareSummary> {
    let start = Instant::now();
    if !(0.0..1.0).contains(&opts.val_fraction) {
        return Err(Error::Config(format!(
            "val_fraction must be in [0, 1), got {}",
            opts.val_fraction
        )));
    }
    if opts.max_sample_tokens < 2 || opts.chunk_bytes < 16 {
        return Err(Error::Config(
            "max_sample_tokens must be >= 2 and chunk_bytes >= 16".into(),
        ));
    }
    let staging = Staging::begin(&opts.out_dir)?;
    let (tok, name) = dataset_tokenizer(opts, staging.path())?;
    let manifest = write_dataset(opts, tok.as_ref(), &name, staging.path())?;
    staging.commit()?;
    Ok(PrepareSummary {
        manifest_path: opts.out_dir.join("manifest.json"),
        manifest,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// The tokenizer file a dataset holds when it was not tokenised with GPT-2's (the manifest's
/// `tokenizer` field then names it, relative to the dataset folder).
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// The tokenizer to shard with and the name the manifest records for it: `gpt2`, or
/// [`TOKENIZER_FILE`], written into `dir` (trained on the inputs, or copied from the given
/// file).
fn dataset_tokenizer(opts: &PrepareOptions, dir: &Path) -> Result<(Box<dyn Tokenizer>, String)> {
    let tok: Box<dyn Tokenizer> = match opts.train_tokenizer {
        Some(vocab) => {
            let docs = training_documents(opts)?;
            if docs.is_empty() {
                return Err(Error::Config(
                    "--train-tokenizer: the inputs hold no training document to learn from".into(),
                ));
            }
            Box::new(train_bpe(
                docs.into_iter().flat_map(training_pieces),
                vocab,
            )?)
        }
        None => {
            let tok = tokenizer_by_name(&opts.tokenizer)?;
            if tok.name() == "gpt2" {
                return Ok((tok, "gpt2".into()));
            }
            tok
        }
    };
    let path = dir.join(TOKENIZER_FILE);
    std::fs::write(&path, tok.hf_tokenizer_json()?).map_err(|e| Error::io(&path, "write", e))?;
    Ok((tok, TOKENIZER_FILE.into()))
}

/// Longest text handed to the BPE trainer at once: it holds working memory many times the size
/// of each text it is given (95× for one 100 MiB line), so longer documents go in pieces.
const TRAINING_PIECE_BYTES: usize = 1 << 20;

/// `doc` cut into pieces of at most [`TRAINING_PIECE_BYTES`], each cut at whitespace when
/// there is some in the last 4 KiB before the limit (else at a character boundary): only the
/// words at the cuts are counted differently.
fn training_pieces(doc: String) -> Vec<String> {
    if doc.len() <= TRAINING_PIECE_BYTES {
        return vec![doc];
    }
    let mut pieces = Vec::new();
    let mut rest = doc.as_str();
    while rest.len() > TRAINING_PIECE_BYTES {
        let mut cut = TRAINING_PIECE_BYTES;
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        let window = &rest[cut.saturating_sub(4096)..cut];
        if let Some(ws) = window.rfind(char::is_whitespace) {
            cut = cut - window.len() + ws;
        }
        let cut = cut.max(1);
        let cut = (cut..=rest.len())
            .find(|&c| rest.is_char_boundary(c))
            .unwrap_or(rest.len());
        pieces.push(rest[..cut].to_string());
        rest = &rest[cut..];
    }
    pieces.push(rest.to_string());
    pieces
}

/// Every input document that falls in the training split, as text (invalid UTF-8 replaced):
/// what a trained tokenizer learns from (never the validation documents).
fn training_documents(opts: &PrepareOptions) -> Result<Vec<String>> {
    let mut docs: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut walker = Walker {
        opts,
        cuts: true,
        seq: 0,
        skipped: 0,
        seen: Seen::default(),
    };
    let mut sink = |c: Chunk| -> Result<()> {
        match docs.last_mut() {
            Some((seq, text)) if *seq == c.seq => text.extend_from_slice(&c.bytes),
            _ => docs.push((c.seq, c.bytes)),
        }
        Ok(())
    };
    walk_inputs(opts, &mut walker, &mut sink)?;
    let val_every = val_every(opts);
    Ok(docs
        .into_iter()
        .filter(|(_, t)| !t.is_empty())
        .enumerate()
        .filter(|(i, _)| val_every == 0 || *i as u64 % val_every != val_every - 1)
        .map(|(_, (_, t))| String::from_utf8_lossy(&t).into_owned())
        .collect())
}

/// Tokenisation threads: the CPUs this process may use, or fewer when asked; more than that
/// only slows the work (and thousands exhaust the machine), so a larger count is capped with a
/// warning. `Some(0)` is refused.
fn worker_threads(asked: Option<usize>) -> Result<usize> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    match asked {
        None => Ok(cpus),
        Some(0) => Err(Error::Config("--threads 0: expected at least 1".into())),
        Some(n) if n > cpus => {
            eprintln!(
                "warning: --threads {n} is more than the {cpus} CPUs this process may use; \
                 using {cpus}"
            );
            Ok(cpus)
        }
        Some(n) => Ok(n),
    }
}

/// Every `val_every`-th document (1-based) goes to the validation split; 0: none.
fn val_every(opts: &PrepareOptions) -> u64 {
    if opts.val_fraction > 0.0 {
        ((1.0 / opts.val_fraction).round() as u64).max(2)
    } else {
        0
    }
}

/// Walks the inputs in order (the bundled corpus when there are none) into `sink`.
fn walk_inputs(opts: &PrepareOptions, walker: &mut Walker, sink: &mut Sink) -> Result<()> {
    if opts.inputs.is_empty() {
        let src = StreamSource(flate2::read::GzDecoder::new(bundled::SHAKESPEARE_TAR_GZ));
        walker.walk_tar(src, Path::new(bundled::SHAKESPEARE_NAME), sink)
    } else {
        for input in &opts.inputs {
            for path in expand_input(input)? {
                walker.walk_path(&path, true, sink)?;
            }
        }
        Ok(())
    }
}

/// The files an input names: itself, or the expansions of its brace pattern (when no file of
/// that literal name exists); a pattern that names a missing file is refused at the first.
fn expand_input(input: &Path) -> Result<Vec<PathBuf>> {
    let text = input.to_string_lossy();
    if !text.contains('{') || input.exists() {
        return Ok(vec![input.to_path_buf()]);
    }
    let paths: Vec<PathBuf> = expand_braces(&text)?
        .into_iter()
        .map(PathBuf::from)
        .collect();
    if let Some(missing) = paths.iter().find(|p| !p.exists()) {
        return Err(Error::Input {
            path: missing.clone(),
            what: format!(
                "does not exist (named by the pattern {text}, which expands to {} paths)",
                paths.len()
            ),
        });
    }
    Ok(paths)
}

/// Walks the inputs and writes the shards and `manifest.json` into `dir`
/// (the temporary folder), recording the tokenizer as `tok_name`. Fails when the inputs hold
/// no document.
fn write_dataset(
    opts: &PrepareOptions,
    tok: &dyn Tokenizer,
    tok_name: &str,
    dir: &Path,
) -> Result<Manifest> {
    let val_every = val_every(opts);
    let dtype = if tok.vocab_size() <= 65536 {
        "u16"
    } else {
        "u32"
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(worker_threads(opts.threads)?)
        .build()
        .map_err(|e| Error::Config(format!("thread pool: {e}")))?;

    let bar = if opts.progress {
        let b = indicatif::ProgressBar::new_spinner();
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {elapsed} {bytes} of text ({bytes_per_sec}) {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
        );
        b
    } else {
        indicatif::ProgressBar::hidden()
    };

    let mut state = Writer {
        tok,
        opts,
        val_every,
        dtype,
        splits: [SplitWriter::new(dir, "train"), SplitWriter::new(dir, "val")],
        totals: Totals::default(),
        doc: None,
        next_doc: 0,
        batch: Vec::new(),
        batch_bytes: 0,
        pool: &pool,
        bar: &bar,
    };

    let mut walker = Walker {
        opts,
        cuts: tok.safe_newline_cuts(),
        seq: 0,
        skipped: 0,
        seen: Seen::default(),
    };
    let mut sink = |c: Chunk| state.push(c);
    walk_inputs(opts, &mut walker, &mut sink)?;
    state.totals.skipped_bad_inputs = walker.skipped;
    state.flush_batch()?;
    state.end_doc()?;
    bar.finish_and_clear();
    if state.totals.documents == 0 {
        return Err(no_documents(&opts.inputs, &walker, &state.totals));
    }
    let Writer {
        splits, mut totals, ..
    } = state;
    let [train, val] = splits;
    let train = train.finish()?;
    let val = val.finish()?;
    totals.samples = train.samples + val.samples;
    totals.tokens = train.tokens + val.tokens;
    totals.shard_bytes = train
        .shards
        .iter()
        .chain(val.shards.iter())
        .map(|s| s.bytes)
        .sum();

    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: MANIFEST_VERSION,
        tokenizer: tok_name.into(),
        vocab_size: tok.vocab_size(),
        eot: tok.eot(),
        dtype: dtype.into(),
        created_by: concat!("fugu-io ", env!("CARGO_PKG_VERSION")).into(),
        inputs: if opts.inputs.is_empty() {
            vec![bundled::SHAKESPEARE_NAME.into()]
        } else {
            opts.inputs
                .iter()
                .map(|p| p.display().to_string())
                .collect()
        },
        split: SplitRule {
            val_fraction: opts.val_fraction,
            val_every,
        },
        train,
        val,
        totals,
    };
    let mut text = serde_json::to_string_pretty(&manifest)
        .map_err(|e| Error::Config(format!("serialising manifest: {e}")))?;
    text.push('\n');
    write_synced(&dir.join("manifest.json"), text.as_bytes())?;
    Ok(manifest)
}

/// Writes a file and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| Error::io(path, "create", e))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| Error::io(path, "write", e))
}

/// What the walker passed over without reading, for the message when no
/// document is found.
#[derive(Default)]
struct Seen {
    /// `.tokens` files or tar members: already prepared token ids.
    token_files: u64,
    /// `manifest.json` files found in folders.
    manifests: u64,
    /// Files of types prepare does not read.
    unsupported: u64,
    /// The first of them.
    first_unsupported: Option<String>,
}

/// A JSON value's type, for messages.
fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The error for inputs that hold no document, with the likely reason.
fn no_documents(inputs: &[PathBuf], walker: &Walker, totals: &Totals) -> Error {
    let shown: Vec<String> = inputs
        .iter()
        .take(5)
        .map(|p| p.display().to_string())
        .collect();
    let mut names = shown.join(", ");
    if inputs.len() > shown.len() {
        names.push_str(&format!(" and {} more", inputs.len() - shown.len()));
    }
    let seen = &walker.seen;
    let why = if seen.token_files > 0 || seen.manifests > 0 {
        let mut found = Vec::new();
        if seen.token_files > 0 {
            found.push(format!(
                "{} `.tokens` file(s) or tar member(s)",
                seen.token_files
            ));
        }
        if seen.manifests > 0 {
            found.push(format!("{} manifest.json", seen.manifests));
        }
        format!(
            "found {}: .tar shards of tokens are already prepared data; pass the dataset (its folder or manifest.json) to `fugu train --data`",
            found.join(" and ")
        )
    } else if totals.empty_documents > 0 {
        format!("every document is empty ({} empty)", totals.empty_documents)
    } else if walker.skipped > 0 {
        format!(
            "every input was bad and skipped ({} skipped)",
            walker.skipped
        )
    } else if let Some(first) = &seen.first_unsupported {
        format!(
            "only files of unsupported types ({} skipped, e.g. {first}); prepare reads .txt, .text, .md and extension-less text, .jsonl/.ndjson, .parquet, .arrow and .tar files (any but .parquet and .arrow may end in .gz or .zst), and .json files named as inputs",
            seen.unsupported
        )
    } else {
        "no input files (empty folders?)".into()
    };
    Error::NoDocuments { inputs: names, why }
}

/// A piece of one document's text.
struct Chunk {
    /// Walker's document sequence number (changes at each new document).
    seq: u64,
    source: String,
    bytes: Vec<u8>,
    /// The document's first chunk ([`Tokenizer::encode`]; the others:
    /// [`Tokenizer::encode_continuation`]).
    first: bool,
    last: bool,
}

struct Walker<'a> {
    opts: &'a PrepareOptions,
    /// Cut long documents at safe newlines (the tokenizer's
    /// [`Tokenizer::safe_newline_cuts`]); else each is one chunk.
    cuts: bool,
    seq: u64,
    skipped: u64,
    seen: Seen,
}

type Sink<'s> = dyn FnMut(Chunk) -> Result<()> + 's;

fn lower_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default()
}

/// What a file holds, from its name (after any compression suffix).
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Tar,
    /// One JSON object per line (`.jsonl`, `.ndjson`).
    Jsonl,
    /// `.json` named explicitly: JSON Lines (what `datasets`' `to_json` writes) or one array of
    /// records.
    Json,
    Parquet,
    /// Arrow IPC, stream or file format (`.arrow`).
    Arrow,
    /// Comma/tab-separated values: refused with a reason (which column, which quoting?).
    Csv,
    Text,
    /// Token ids of an already prepared dataset: never read as text.
    Tokens,
    Skip,
}

/// How a file's bytes are compressed.
#[derive(Clone, Copy, PartialEq)]
enum Codec {
    Plain,
    Gzip,
    Zstd,
}

fn kind_of(name: &str, explicit: bool) -> (Kind, Codec) {
    let (stem, codec) = if let Some(stem) = name.strip_suffix(".tgz") {
        (format!("{stem}.tar"), Codec::Gzip)
    } else if let Some(stem) = name.strip_suffix(".gz") {
        (stem.to_string(), Codec::Gzip)
    } else if let Some(stem) = name
        .strip_suffix(".zst")
        .or_else(|| name.strip_suffix(".zstd"))
    {
        (stem.to_string(), Codec::Zstd)
    } else {
        (name.to_string(), Codec::Plain)
    };
    let ends = |ext: &str| stem.ends_with(ext);
    let kind = if stem == "manifest.json" {
        // A prepared dataset's manifest, even when named: passed over and counted, so that
        // the error for inputs without documents says to give it to `fugu train --data`.
        Kind::Skip
    } else if ends(".tokens") {
        Kind::Tokens
    } else if ends(".tar") {
        Kind::Tar
    } else if ends(".jsonl") || ends(".ndjson") {
        Kind::Jsonl
    } else if ends(".json") {
        if explicit {
            Kind::Json
        } else {
            Kind::Skip
        }
    } else if ends(".parquet") && codec == Codec::Plain {
        Kind::Parquet
    } else if ends(".arrow") && codec == Codec::Plain {
        Kind::Arrow
    } else if ends(".csv") || ends(".tsv") {
        Kind::Csv
    } else if codec != Codec::Plain
        || explicit
        || ends(".txt")
        || ends(".text")
        || ends(".md")
        || !stem.contains('.')
    {
        Kind::Text
    } else {
        Kind::Skip
    };
    (kind, codec)
}

/// `r`'s bytes decompressed by `codec`.
fn decoded<'r, R: Read + 'r>(r: R, codec: Codec, source: &str) -> Result<Box<dyn Read + 'r>> {
    Ok(match codec {
        Codec::Plain => Box::new(r),
        Codec::Gzip => Box::new(flate2::read::GzDecoder::new(r)),
        #[cfg(feature = "formats")]
        Codec::Zstd => Box::new(
            zstd::stream::read::Decoder::new(r).map_err(|e| Error::Input {
                path: source.into(),
                what: format!("cannot start zstd decompression: {e}"),
            })?,
        ),
        #[cfg(not(feature = "formats"))]
        Codec::Zstd => {
            let _ = r;
            return Err(columnar::not_built(source, "zstd"));
        }
    })
}

impl Walker<'_> {
    /// Counts a file or member that is not read (token ids, manifests,
    /// unsupported types); returns whether it is passed over.
    fn passed_over(&mut self, kind: Kind, lower: &str, source: impl Fn() -> String) -> bool {
        match kind {
            Kind::Tokens => self.seen.token_files += 1,
            Kind::Skip if lower == "manifest.json" => self.seen.manifests += 1,
            Kind::Skip => {
                self.seen.unsupported += 1;
                if self.seen.first_unsupported.is_none() {
                    self.seen.first_unsupported = Some(source());
                }
            }
            _ => return false,
        }
        true
    }

    fn bad(&mut self, e: Error) -> Result<()> {
        if self.opts.skip_bad {
            eprintln!("warning: skipping bad input: {e}");
            self.skipped += 1;
            Ok(())
        } else {
            Err(e)
        }
    }

    fn walk_path(&mut self, path: &Path, explicit: bool, sink: &mut Sink) -> Result<()> {
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) => return self.bad(Error::io(path, "stat input", e)),
        };
        if meta.is_dir() {
            return self.walk_dir(path, sink);
        }
        if !explicit && !meta.is_file() {
            // A FIFO, socket or device in a folder: reading it could block forever.
            eprintln!(
                "notice: skipping {}: not a regular file (a FIFO, socket or device)",
                path.display()
            );
            return Ok(());
        }
        let (kind, codec) = kind_of(&lower_name(path), explicit);
        if self.passed_over(kind, &lower_name(path), || path.display().to_string()) {
            return Ok(());
        }
        let source = path.display().to_string();
        let res = match kind {
            Kind::Parquet => self.walk_columnar(path, columnar::parquet_texts, sink),
            Kind::Arrow => self.walk_columnar(path, columnar::arrow_texts, sink),
            Kind::Csv => Err(Error::Input {
                path: path.into(),
                what: "is CSV, which fugu prepare does not read (which column, which quoting?): \
                       convert it to JSONL or Parquet and name its text field with --text-field"
                    .into(),
            }),
            _ => match File::open(path) {
                Ok(file) => {
                    let r = BufReader::with_capacity(1 << 20, file);
                    decoded(r, codec, &source)
                        .and_then(|r| self.walk_stream(kind, r, &source, sink))
                }
                Err(e) => Err(Error::io(path, "open input", e)),
            },
        };
        match res {
            Err(e @ (Error::Input { .. } | Error::Io { .. } | Error::Tar { .. })) => self.bad(e),
            other => other,
        }
    }

    /// A folder: a Hugging Face `save_to_disk` folder's data files in `state.json`'s order,
    /// else every entry sorted by name (hidden ones left out).
    fn walk_dir(&mut self, path: &Path, sink: &mut Sink) -> Result<()> {
        match columnar::hf_dataset_files(path) {
            Ok(Some(files)) => {
                for f in files {
                    self.walk_path(&f, true, sink)?;
                }
                return Ok(());
            }
            Ok(None) => {}
            Err(e) => return self.bad(e),
        }
        let mut entries = Vec::new();
        let rd = match std::fs::read_dir(path) {
            Ok(r) => r,
            Err(e) => return self.bad(Error::io(path, "list folder", e)),
        };
        for e in rd {
            match e {
                Ok(e) => entries.push(e.path()),
                Err(e) => return self.bad(Error::io(path, "list folder", e)),
            }
        }
        entries.sort();
        for p in entries {
            if lower_name(&p).starts_with('.') {
                continue;
            }
            self.walk_path(&p, false, sink)?;
        }
        Ok(())
    }

    /// A stream of `kind` (a file or tar member, already decompressed).
    fn walk_stream<R: Read>(
        &mut self,
        kind: Kind,
        r: R,
        source: &str,
        sink: &mut Sink,
    ) -> Result<()> {
        match kind {
            Kind::Tar => self.walk_tar(StreamSource(r), Path::new(source), sink),
            Kind::Jsonl => self.walk_jsonl(BufReader::new(r), source, sink),
            Kind::Json => self.walk_json(BufReader::new(r), source, sink),
            Kind::Text => self.walk_text(r, source, true, sink),
            _ => Ok(()),
        }
    }

    /// The rows of a Parquet or Arrow file's `--text-field` column, each a document.
    fn walk_columnar(
        &mut self,
        path: &Path,
        read: fn(&Path, &str, &mut columnar::RowSink) -> Result<()>,
        sink: &mut Sink,
    ) -> Result<()> {
        let source = path.display().to_string();
        let field = self.opts.text_field.clone();
        read(path, &field, &mut |row, text| match text {
            Some(t) => self.walk_text(t.as_bytes(), &format!("{source}:row {row}"), false, sink),
            None => self.bad(Error::Input {
                path: format!("{source}:row {row}").into(),
                what: format!("column `{field}` is null"),
            }),
        })
    }

    fn walk_tar<S: TarSource>(&mut self, src: S, path: &Path, sink: &mut Sink) -> Result<()> {
        let mut tar = TarReader::new(src, path);
        while let Some(entry) = tar.next_entry()? {
            if entry.kind != EntryKind::File {
                continue;
            }
            let name = entry.name.to_lowercase();
            let base = name.rsplit('/').next().unwrap_or("");
            if base.starts_with('.') {
                continue;
            }
            let source = format!("{}:{}", path.display(), entry.name);
            let (kind, codec) = match kind_of(base, false) {
                // Random-access formats and archives in archives are not read from a stream.
                (Kind::Tar | Kind::Parquet | Kind::Arrow | Kind::Csv, _) => {
                    (Kind::Skip, Codec::Plain)
                }
                other => other,
            };
            if self.passed_over(kind, base, || source.clone()) {
                continue;
            }
            let r = decoded(tar.entry_reader(), codec, &source)?;
            self.walk_stream(kind, r, &source, sink)?;
        }
        Ok(())
    }

    /// The `--text-field` string of a JSON record, or what is wrong with it.
    fn record_text(&self, v: &serde_json::Value) -> std::result::Result<String, String> {
        let field = &self.opts.text_field;
        match v.get(field) {
            Some(serde_json::Value::String(t)) => Ok(t.clone()),
            Some(other) => Err(format!(
                "field `{field}` is not a string but {}",
                json_type(other)
            )),
            None => {
                let strings: Vec<&str> = v
                    .as_object()
                    .map(|o| {
                        o.iter()
                            .filter(|(_, x)| x.is_string())
                            .map(|(k, _)| k.as_str())
                            .collect()
                    })
                    .unwrap_or_default();
                Err(if v.is_object() {
                    format!(
                        "record has no field `{field}` (its string fields: [{}]; choose one with --text-field)",
                        strings.join(", ")
                    )
                } else {
                    format!("is {}, not a JSON object", json_type(v))
                })
            }
        }
    }

    fn walk_jsonl<R: BufRead>(&mut self, mut r: R, source: &str, sink: &mut Sink) -> Result<()> {
        let mut line = Vec::new();
        let mut lineno = 0u64;
        loop {
            line.clear();
            let n = r.read_until(b'\n', &mut line).map_err(|e| Error::Input {
                path: source.into(),
                what: format!("reading line {}: {e}", lineno + 1),
            })?;
            if n == 0 {
                return Ok(());
            }
            lineno += 1;
            if line.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            if lineno == 1 {
                if let Some(what) = not_text(&line) {
                    return Err(Error::Input {
                        path: source.into(),
                        what: format!("is {what}, not JSON Lines"),
                    });
                }
            }
            let at = format!("{source}:{lineno}");
            let text = match serde_json::from_slice::<serde_json::Value>(&line) {
                Ok(v) => self.record_text(&v),
                Err(e) => Err(format!("invalid JSON: {e}")),
            };
            match text {
                Ok(t) => self.walk_text(t.as_bytes(), &at, false, sink)?,
                Err(what) => self.bad(Error::Input {
                    path: at.into(),
                    what,
                })?,
            }
        }
    }

    /// A `.json` file: one array of records, or JSON Lines.
    fn walk_json<R: BufRead>(&mut self, mut r: R, source: &str, sink: &mut Sink) -> Result<()> {
        let head = r.fill_buf().map_err(|e| Error::Input {
            path: source.into(),
            what: format!("read: {e}"),
        })?;
        let array = head.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[');
        if !array {
            return self.walk_jsonl(r, source, sink);
        }
        let records: Vec<serde_json::Value> =
            serde_json::from_reader(r).map_err(|e| Error::Input {
                path: source.into(),
                what: format!("is not a JSON array of records: {e}"),
            })?;
        for (i, v) in records.iter().enumerate() {
            let at = format!("{source}:[{i}]");
            match self.record_text(v) {
                Ok(t) => self.walk_text(t.as_bytes(), &at, false, sink)?,
                Err(what) => self.bad(Error::Input {
                    path: at.into(),
                    what,
                })?,
            }
        }
        Ok(())
    }

    /// Cuts one document into chunks at safe newlines (one chunk when the
    /// tokenizer allows no cuts). With `sniff` (a file's content, not a JSONL
    /// string), content that is not text ([`not_text`]) is refused by name.
    fn walk_text<R: Read>(
        &mut self,
        mut r: R,
        source: &str,
        sniff: bool,
        sink: &mut Sink,
    ) -> Result<()> {
        let refuse_binary = |head: &[u8]| match not_text(head).filter(|_| sniff) {
            Some(what) => Err(Error::Input {
                path: source.into(),
                what: format!(
                    "is {what}, not text: fugu prepare reads text, JSON Lines, Parquet, Arrow \
                     and tar files by their names (see `fugu prepare --help`)"
                ),
            }),
            None => Ok(()),
        };
        self.seq += 1;
        let seq = self.seq;
        let mut first = true;
        let mut sink = |bytes: Vec<u8>, last: bool| {
            let chunk = Chunk {
                seq,
                source: source.into(),
                bytes,
                first,
                last,
            };
            first = false;
            sink(chunk)
        };
        if !self.cuts {
            let mut whole = Vec::new();
            r.read_to_end(&mut whole).map_err(|e| Error::Input {
                path: source.into(),
                what: format!("read: {e}"),
            })?;
            refuse_binary(&whole)?;
            return sink(whole, true);
        }
        let target = self.opts.chunk_bytes;
        let mut buf: Vec<u8> = Vec::with_capacity(target * 2);
        let mut scan_from = 0usize;
        let mut eof = false;
        let mut tmp = vec![0u8; 64 << 10];
        let mut sniffed = false;
        loop {
            while !eof && buf.len() < target * 2 {
                let n = r.read(&mut tmp).map_err(|e| Error::Input {
                    path: source.into(),
                    what: format!("read: {e}"),
                })?;
                if n == 0 {
                    eof = true;
                } else {
                    buf.extend_from_slice(&tmp[..n]);
                }
            }
            if !sniffed {
                refuse_binary(&buf)?;
                sniffed = true;
            }
            if eof && buf.len() <= target * 2 {
                return sink(std::mem::take(&mut buf), true);
            }
            // Find a safe cut at or after `target`.
            let from = scan_from.max(target);
            let mut cut = None;
            let mut i = from;
            while let Some(off) = buf[i..buf.len().saturating_sub(1)]
                .iter()
                .position(|&b| b == b'\n')
            {
                let p = i + off;
                if is_safe_cut(&buf, p) {
                    cut = Some(p + 1);
                    break;
                }
                i = p + 1;
            }
            let cut = match cut {
                Some(c) => c,
                None if buf.len() < target * 16 && !eof => {
                    // Read more and keep looking.
                    scan_from = buf.len().saturating_sub(8);
                    let n = r.read(&mut tmp).map_err(|e| Error::Input {
                        path: source.into(),
                        what: format!("read: {e}"),
                    })?;
                    if n == 0 {
                        eof = true;
                    } else {
                        buf.extend_from_slice(&tmp[..n]);
                    }
                    continue;
                }
                None if eof => return sink(std::mem::take(&mut buf), true),
                None => {
                    // No safe newline in a long stretch: cut at a UTF-8 boundary.
                    let mut c = target * 8;
                    while c > 0 && (buf[c] & 0xC0) == 0x80 {
                        c -= 1;
                    }
                    c.max(1)
                }
            };
            let rest = buf.split_off(cut);
            let chunk = std::mem::replace(&mut buf, rest);
            scan_from = 0;
            sink(chunk, false)?;
        }
    }
}

struct DocState {
    seq: u64,
    index: u64,
    split: usize,
    source: String,
    part: u64,
    part_bytes: u64,
    tokens: Vec<u32>,
    text_bytes: u64,
    any_text: bool,
}

struct Writer<'a> {
    tok: &'a dyn Tokenizer,
    opts: &'a PrepareOptions,
    val_every: u64,
    dtype: &'static str,
    splits: [SplitWriter; 2],
    totals: Totals,
    doc: Option<DocState>,
    next_doc: u64,
    batch: Vec<Chunk>,
    batch_bytes: usize,
    pool: &'a rayon::ThreadPool,
    bar: &'a indicatif::ProgressBar,
}

const BATCH_BYTES: usize = 8 << 20;

impl Writer<'_> {
    fn push(&mut self, c: Chunk) -> Result<()> {
        self.batch_bytes += c.bytes.len();
        self.batch.push(c);
        if self.batch_bytes >= BATCH_BYTES || self.batch.len() >= 1024 {
            self.flush_batch()?;
        }
        Ok(())
    }

    fn flush_batch(&mut self) -> Result<()> {
        let batch = std::mem::take(&mut self.batch);
        self.batch_bytes = 0;
        let tok = self.tok;
        let encoded: Vec<(Vec<u32>, bool)> = self.pool.install(|| {
            batch
                .par_iter()
                .map(|c| {
                    let encode = |s: &str| match c.first {
                        true => tok.encode(s),
                        false => tok.encode_continuation(s),
                    };
                    match std::str::from_utf8(&c.bytes) {
                        Ok(s) => (encode(s), false),
                        Err(_) => (encode(&String::from_utf8_lossy(&c.bytes)), true),
                    }
                })
                .collect()
        });
        for (c, (ids, invalid)) in batch.into_iter().zip(encoded) {
            self.bar.inc(c.bytes.len() as u64);
            self.consume(c, ids, invalid)?;
        }
        Ok(())
    }

    fn consume(&mut self, c: Chunk, ids: Vec<u32>, invalid: bool) -> Result<()> {
        if self.doc.as_ref().is_none_or(|d| d.seq != c.seq) {
            self.end_doc()?;
            self.doc = Some(DocState {
                seq: c.seq,
                index: 0,
                split: 0,
                source: c.source.clone(),
                part: 0,
                part_bytes: 0,
                tokens: Vec::new(),
                text_bytes: 0,
                any_text: false,
            });
        }
        let max = self.opts.max_sample_tokens;
        let mut d = self.doc.take().expect("document state");
        if !c.bytes.is_empty() && !d.any_text {
            d.any_text = true;
            d.index = self.next_doc;
            self.next_doc += 1;
            d.split =
                usize::from(self.val_every > 0 && d.index % self.val_every == self.val_every - 1);
            self.splits[d.split].documents += 1;
            self.totals.documents += 1;
            if invalid {
                self.totals.invalid_utf8_documents += 1;
            }
        }
        d.text_bytes += c.bytes.len() as u64;
        self.splits[d.split].text_bytes += c.bytes.len() as u64;
        d.part_bytes += c.bytes.len() as u64;
        self.totals.text_bytes += c.bytes.len() as u64;
        d.tokens.extend_from_slice(&ids);
        while d.tokens.len() > max {
            let rest = d.tokens.split_off(max);
            let part = std::mem::replace(&mut d.tokens, rest);
            self.write_sample(&d, &part, false)?;
            d.part += 1;
            d.part_bytes = 0;
        }
        self.doc = Some(d);
        if c.last {
            self.end_doc()?;
        }
        Ok(())
    }

    fn end_doc(&mut self) -> Result<()> {
        let Some(mut d) = self.doc.take() else {
            return Ok(());
        };
        if !d.any_text {
            self.totals.empty_documents += 1;
            return Ok(());
        }
        d.tokens.push(self.tok.eot());
        let tokens = std::mem::take(&mut d.tokens);
        self.write_sample(&d, &tokens, true)
    }

    fn write_sample(&mut self, d: &DocState, tokens: &[u32], last: bool) -> Result<()> {
        let sw = &mut self.splits[d.split];
        let key = format!("{:010}", sw.samples);
        let mut data = Vec::with_capacity(tokens.len() * 4);
        if self.dtype == "u16" {
            for &t in tokens {
                data.extend_from_slice(&(t as u16).to_le_bytes());
            }
        } else {
            for &t in tokens {
                data.extend_from_slice(&t.to_le_bytes());
            }
        }
        let meta = serde_json::json!({
            "source": d.source,
            "doc": d.index,
            "part": d.part,
            "last": last,
            "bytes": d.part_bytes,
            "tokens": tokens.len(),
        });
        let meta = serde_json::to_vec(&meta).unwrap_or_default();
        let text = if self.opts.write_text {
            let body = if last {
                &tokens[..tokens.len() - 1]
            } else {
                tokens
            };
            Some(self.tok.decode(body)?.into_bytes())
        } else {
            None
        };
        let size = TarWriter::<File>::member_size(data.len() as u64)
            + TarWriter::<File>::member_size(meta.len() as u64)
            + text
                .as_ref()
                .map_or(0, |t| TarWriter::<File>::member_size(t.len() as u64));
        sw.write(
            &key,
            &data,
            &meta,
            text.as_deref(),
            tokens.len() as u64,
            size,
            self.opts.shard_bytes,
        )
    }
}

/// Hashing, counting writer around the temporary shard file.
struct HashWriter {
    file: std::io::BufWriter<File>,
    hash: Sha256,
}

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

struct OpenShard {
    tar: TarWriter<HashWriter>,
    /// The shard's path in the temporary dataset folder.
    path: PathBuf,
    file: String,
    samples: u64,
    tokens: u64,
}

struct SplitWriter {
    dir: PathBuf,
    name: &'static str,
    open: Option<OpenShard>,
    shards: Vec<ShardInfo>,
    documents: u64,
    samples: u64,
    tokens: u64,
    text_bytes: u64,
}

impl SplitWriter {
    fn new(dir: &Path, name: &'static str) -> Self {
        SplitWriter {
            dir: dir.to_path_buf(),
            name,
            open: None,
            shards: Vec::new(),
            documents: 0,
            samples: 0,
            tokens: 0,
            text_bytes: 0,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn write(
        &mut self,
        key: &str,
        data: &[u8],
        meta: &[u8],
        text: Option<&[u8]>,
        ntok: u64,
        size: u64,
        shard_bytes: u64,
    ) -> Result<()> {
        if let Some(o) = &self.open {
            // 1024: the end-of-archive marker.
            if o.samples > 0 && o.tar.bytes_written() + size + 1024 > shard_bytes {
                self.close()?;
            }
        }
        if self.open.is_none() {
            let file = format!("{}-{:06}.tar", self.name, self.shards.len());
            let path = self.dir.join(&file);
            let f = File::create(&path).map_err(|e| Error::io(&path, "create", e))?;
            self.open = Some(OpenShard {
                tar: TarWriter::new(HashWriter {
                    file: std::io::BufWriter::with_capacity(1 << 20, f),
                    hash: Sha256::new(),
                }),
                path,
                file,
                samples: 0,
                tokens: 0,
            });
        }
        let o = self.open.as_mut().expect("open shard");
        let res = (|| {
            o.tar.append(&format!("{key}.tokens"), data)?;
            o.tar.append(&format!("{key}.json"), meta)?;
            if let Some(t) = text {
                o.tar.append(&format!("{key}.txt"), t)?;
            }
            Ok::<_, std::io::Error>(())
        })();
        res.map_err(|e| Error::io(&o.path, "write shard", e))?;
        o.samples += 1;
        o.tokens += ntok;
        self.samples += 1;
        self.tokens += ntok;
        Ok(())
    }

    fn close(&mut self) -> Result<()> {
        let Some(o) = self.open.take() else {
            return Ok(());
        };
        let bytes = o.tar.bytes_written() + 1024;
        let mut hw = o
            .tar
            .finish()
            .map_err(|e| Error::io(&o.path, "write shard", e))?;
        hw.flush()
            .map_err(|e| Error::io(&o.path, "write shard", e))?;
        hw.file
            .get_ref()
            .sync_all()
            .map_err(|e| Error::io(&o.path, "sync shard", e))?;
        let sha = hex(&hw.hash.finalize());
        self.shards.push(ShardInfo {
            file: o.file,
            samples: o.samples,
            tokens: o.tokens,
            bytes,
            sha256: sha,
        });
        Ok(())
    }

    fn finish(mut self) -> Result<SplitInfo> {
        self.close()?;
        Ok(SplitInfo {
            documents: self.documents,
            samples: self.samples,
            tokens: self.tokens,
            text_bytes: self.text_bytes,
            shards: self.shards,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_training_documents_go_to_the_trainer_in_pieces_cut_at_whitespace() {
        let word = "wörd ";
        let doc = word.repeat(3 * TRAINING_PIECE_BYTES / word.len());
        let pieces = training_pieces(doc.clone());
        assert_eq!(pieces.concat(), doc);
        assert!(pieces.len() >= 3);
        for p in &pieces[1..] {
            assert!(
                p.len() <= TRAINING_PIECE_BYTES && p.starts_with(' '),
                "{}",
                &p[..8]
            );
        }
        // No whitespace at all: cut at character boundaries.
        let solid = "é".repeat(TRAINING_PIECE_BYTES);
        let pieces = training_pieces(solid.clone());
        assert_eq!((pieces.concat() == solid, pieces.len()), (true, 2));
        assert_eq!(training_pieces("short".into()), vec!["short".to_string()]);
    }
}

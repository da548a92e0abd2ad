//! `fugu prepare`: tokenise text into WebDataset-style tar shards plus a
//! `manifest.json` (see docs/DATA.md).

use anyhow::Context;
use std::path::PathBuf;

/// Arguments of `fugu prepare`.
#[derive(clap::Args, Debug)]
pub struct PrepareArgs {
    /// Inputs: text files (.txt, .md, no extension), JSON Lines (.jsonl, .ndjson; a .json
    /// file named here may be one array of records), Parquet (.parquet), Arrow IPC (.arrow),
    /// Hugging Face `save_to_disk` folders, .tar archives of text and JSONL, and folders of all
    /// of these; any but Parquet and Arrow may be compressed (.gz, .zst). Brace patterns
    /// (`train-{00000..00099}.parquet`, `{a,b}.txt`) name every expansion. None: the bundled
    /// Shakespeare corpus.
    pub inputs: Vec<PathBuf>,
    /// The field of JSON records, or the column of Parquet/Arrow files, that holds the text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Output folder for the shards and manifest.json.
    #[arg(short, long, default_value = "data/shakespeare")]
    pub out: PathBuf,
    /// Target shard size (bytes; suffixes K, M, G).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    pub shard_size: u64,
    /// Fraction of documents held out for validation (every round(1/f)-th).
    #[arg(long, default_value_t = 0.05)]
    pub val_fraction: f64,
    /// Tokenizer: gpt2, or a Hugging Face tokenizer.json (file or folder; a byte-level BPE as
    /// GPT-2's or Llama 3's, or a byte-fallback BPE as Llama 2's, Mistral's or LLM-jp's), copied
    /// into the dataset.
    #[arg(long, default_value = "gpt2")]
    pub tokenizer: String,
    /// Train a byte-level BPE (Hugging Face tokenizers) on the training documents of the input
    /// and shard with it; stored in the dataset as tokenizer.json, which train and sample use.
    #[arg(long, conflicts_with = "tokenizer")]
    pub train_tokenizer: bool,
    /// Vocabulary size of --train-tokenizer, including the 256 byte tokens and <|endoftext|>.
    #[arg(long, default_value_t = 4096, requires = "train_tokenizer")]
    pub vocab_size: u32,
    /// Also store each sample's text as KEY.txt.
    #[arg(long)]
    pub write_text: bool,
    /// Log and skip unreadable inputs and bad JSONL lines instead of failing.
    #[arg(long)]
    pub skip_bad_samples: bool,
    /// Tokenisation threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Longest sample in tokens; longer documents are split into parts.
    #[arg(long, default_value_t = 1 << 18)]
    pub max_sample_tokens: usize,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Parses `123`, `64K`, `256M`, `1G` (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mul) = match t.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    let n: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 512K, 256M or 1G"))?;
    if !(n.is_finite() && n > 0.0) {
        return Err(format!("`{s}` must be positive"));
    }
    Ok((n * mul as f64) as u64)
}

/// Runs the subcommand.
pub fn run(args: PrepareArgs) -> anyhow::Result<()> {
    let opts = fugu_io::PrepareOptions {
        inputs: args.inputs,
        text_field: args.text_field,
        out_dir: args.out,
        tokenizer: args.tokenizer,
        train_tokenizer: args.train_tokenizer.then_some(args.vocab_size),
        shard_bytes: args.shard_size,
        val_fraction: args.val_fraction,
        write_text: args.write_text,
        skip_bad: args.skip_bad_samples,
        threads: args.threads,
        progress: !args.quiet,
        max_sample_tokens: args.max_sample_tokens,
        ..Default::default()
    };
    let s = fugu_io::prepare(&opts).context("fugu prepare failed")?;
    let m = &s.manifest;
    let t = &m.totals;
    println!(
        "prepared {} documents ({} text bytes) -> {} tokens in {:.2} s ({:.2} M tokens/s)",
        t.documents,
        t.text_bytes,
        t.tokens,
        s.seconds,
        t.tokens as f64 / s.seconds / 1e6
    );
    for (name, sp) in [("train", &m.train), ("val", &m.val)] {
        println!(
            "  {name:5}: {} documents, {} samples, {} tokens, {} shard(s)",
            sp.documents,
            sp.samples,
            sp.tokens,
            sp.shards.len()
        );
    }
    if t.empty_documents + t.invalid_utf8_documents + t.skipped_bad_inputs > 0 {
        println!(
            "  notes: {} empty documents left out, {} with invalid UTF-8, {} bad inputs skipped",
            t.empty_documents, t.invalid_utf8_documents, t.skipped_bad_inputs
        );
    }
    println!("tokenizer: {} ({} ids)", m.tokenizer, m.vocab_size);
    println!("manifest: {}", s.manifest_path.display());
    Ok(())
}

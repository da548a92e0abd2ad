//! `fugu bench io`: data-loader throughput from the page cache.

use anyhow::Context;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `fugu bench io`.
#[derive(clap::Args, Debug)]
pub struct BenchIoArgs {
    /// Data: manifest, shard pattern or .bin. Default: the bundled corpus,
    /// prepared into --prepare-dir first.
    #[arg(long)]
    pub data: Option<String>,
    /// Where the bundled corpus is prepared when --data is not given.
    #[arg(long, default_value = "target/fugu-bench-io")]
    pub prepare_dir: PathBuf,
    /// Batch size B.
    #[arg(short = 'b', long, default_value_t = 16)]
    pub batch: usize,
    /// Sequence length T (windows are T+1 tokens).
    #[arg(short = 't', long, default_value_t = 1024)]
    pub seq: usize,
    /// Tokens per timed repeat.
    #[arg(long, default_value_t = 200_000_000)]
    pub tokens: u64,
    /// Timed repeats (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Prefetch depth of the background thread (0: on the calling thread).
    #[arg(long, default_value_t = 4)]
    pub prefetch: usize,
    /// Read in order (no shard/sample shuffle).
    #[arg(long)]
    pub no_shuffle: bool,
}

/// Runs the subcommand.
pub fn run(args: BenchIoArgs) -> anyhow::Result<()> {
    let data = match &args.data {
        Some(d) => d.clone(),
        None => {
            let manifest = args.prepare_dir.join("manifest.json");
            if !manifest.exists() {
                eprintln!(
                    "preparing the bundled corpus into {}",
                    args.prepare_dir.display()
                );
                fugu_io::prepare(&fugu_io::PrepareOptions {
                    out_dir: args.prepare_dir.clone(),
                    ..Default::default()
                })
                .context("preparing the bundled corpus")?;
            }
            manifest.display().to_string()
        }
    };
    let mut cfg = fugu_io::LoaderConfig::train(args.batch, args.seq, 0, 1, 1234);
    cfg.prefetch = args.prefetch;
    cfg.shuffle = !args.no_shuffle;
    // Loader throughput only: the training default also hashes each shard once (docs/DATA.md).
    cfg.verify = fugu_io::Verify::Size;
    let tokens_per_batch = (args.batch * (args.seq + 1)) as u64;
    let batches = args.tokens.div_ceil(tokens_per_batch).max(1);
    let mut loader =
        fugu_io::Loader::new(&data, &cfg).with_context(|| format!("opening {data}"))?;
    let info = loader.info().clone();
    println!(
        "data {data}: {} {} file(s), {} tokens; B={} T={} prefetch={} shuffle={}; {} batches per repeat",
        info.kind, info.files, info.tokens, args.batch, args.seq, args.prefetch, cfg.shuffle, batches
    );
    // Warm-up: page cache and allocations.
    for _ in 0..batches.min(64) {
        let b = loader.next_batch()?;
        loader.recycle(b);
    }
    let mut rates = Vec::new();
    let mut checksum = 0u64;
    for r in 0..args.repeats.max(1) {
        let t0 = Instant::now();
        for _ in 0..batches {
            let b = loader.next_batch()?;
            checksum = checksum.wrapping_add(b.tokens[0] as u64);
            loader.recycle(b);
        }
        let s = t0.elapsed().as_secs_f64();
        let rate = (batches * tokens_per_batch) as f64 / s;
        println!(
            "repeat {r}: {:.1} M tokens/s ({:.1} us per batch)",
            rate / 1e6,
            s / batches as f64 * 1e6
        );
        rates.push(rate);
    }
    rates.sort_by(|a, b| a.total_cmp(b));
    let median = rates[rates.len() / 2];
    println!(
        "median: {:.1} M tokens/s ({:.1} us per batch of {} tokens; checksum {checksum})",
        median / 1e6,
        tokens_per_batch as f64 / median * 1e6,
        tokens_per_batch
    );
    Ok(())
}

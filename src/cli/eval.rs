//! `fugu eval`: a checkpoint's validation loss, perplexity and bits per byte (the trainer's own
//! evaluation, on any layout under MPI), or its accuracy on multiple-choice questions.

use super::sample::{check_finite_weights, checkpoint_tokenizer, resolve, RunOn};
use super::train::TrainArgs;
use crate::backend::CudaSettings;
use crate::checkpoint;
use crate::choices;
use crate::model::registry;
use crate::sample::Generator;
use crate::train::dist::Dist;
use crate::train::eval::{evaluate, EvalReport};
use crate::train::resume::is_checkpoint_dir;
use anyhow::{bail, Result};
use clap::{Args, Parser};
use std::path::{Path, PathBuf};

/// Evaluate a checkpoint: validation loss, perplexity and bits per byte, or multiple-choice
/// accuracy (--choices).
#[derive(Args, Debug, Clone)]
pub struct EvalArgs {
    /// A run folder (its newest whole checkpoint), a `ckpt-*` checkpoint, or a Hugging Face
    /// model folder.
    pub checkpoint: PathBuf,
    /// Data to evaluate on: a manifest or its folder (its validation split), or a token file
    /// or shard pattern (read whole). Default: the run's data (its validation split), or for
    /// a Hugging Face folder the bundled corpus.
    #[arg(long)]
    pub data: Option<String>,
    /// Batches to average the loss over (the first ones of the split, as `fugu train
    /// --eval-batches` reads them).
    #[arg(long, default_value_t = 8)]
    pub batches: usize,
    /// Sequences per batch and rank (Hugging Face folders only; a fugu checkpoint is
    /// evaluated at its run's settings, as its evaluations were).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Sequence length (Hugging Face folders only; default: the default config's, at most the
    /// model's n_positions).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Multiple-choice questions in HellaSwag's layout (JSONL: `ctx`, `endings`, `label`):
    /// report the accuracy instead of the loss.
    #[arg(long, value_name = "FILE")]
    pub choices: Option<PathBuf>,
    /// Check every shard's sha256 before reading.
    #[arg(long)]
    pub verify_data: bool,
    /// Tensor-parallel degree (under MPI).
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages (under MPI).
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Run each batch as N micro-batches (the activation memory of one).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub micro_batches: usize,
    /// The LM head and the loss ROWS rows at a time (as `fugu train --loss-chunk`): the
    /// logits of one chunk in memory instead of a micro-batch's.
    #[arg(long, value_name = "ROWS", value_parser = clap::value_parser!(u64).range(1..))]
    pub loss_chunk: Option<u64>,
    #[command(flatten)]
    pub run: RunOn,
    /// `text` (default) or `json` (one object on stdout).
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub format: String,
}

/// `fugu train`'s arguments with every default: what the evaluation's trainer options start
/// from, so that they cannot drift from a run's.
#[derive(Parser)]
struct TrainDefaults {
    #[command(flatten)]
    train: TrainArgs,
}

/// The trainer options that evaluate `args.checkpoint` as `fugu train` would.
fn train_options(args: &EvalArgs) -> Result<crate::train::TrainOptions> {
    let mut t = TrainDefaults::try_parse_from(["fugu-eval"])?.train;
    let p = &args.checkpoint;
    let fugu_checkpoint = is_checkpoint_dir(p)
        || !checkpoint::checkpoint_entries(p)
            .unwrap_or_default()
            .is_empty();
    if fugu_checkpoint {
        if args.batch_size.is_some() || args.seq_len.is_some() {
            bail!(
                "--batch-size/--seq-len: {} is a fugu checkpoint, evaluated at its run's batch \
                 size and sequence length (as its own evaluations were)",
                p.display()
            );
        }
        t.resume = Some(p.display().to_string());
    } else if p.join(checkpoint::MODEL_FILE).exists() || p.join(checkpoint::hf::INDEX_FILE).exists()
    {
        t.init_from = Some(p.clone());
        t.overrides.batch_size = args.batch_size;
        t.overrides.seq_len = args.seq_len;
    } else {
        bail!(
            "{}: not a fugu run or checkpoint (no state.json, no ckpt-*) and not a Hugging Face \
             model folder (no {} or {})",
            p.display(),
            checkpoint::MODEL_FILE,
            checkpoint::hf::INDEX_FILE
        );
    }
    t.val_data = args.data.clone();
    t.eval_batches = args.batches;
    t.verify_data = args.verify_data;
    t.tp = args.tp;
    t.pp = args.pp;
    t.micro_batches = args.micro_batches;
    t.loss_chunk = args.loss_chunk;
    t.threads = args.run.threads;
    t.options()
}

/// Runs `fugu eval`.
pub fn run(args: EvalArgs) -> Result<()> {
    if let Some(file) = &args.choices {
        return run_choices(&args, file);
    }
    let mut dist = Dist::init()?;
    let opts = train_options(&args)?;
    let cuda = CudaSettings {
        tf32: args.run.tf32,
    };
    let report = crate::with_backend!(args.run.device, cuda, |be| evaluate(opts, &mut dist, be));
    let report = match report {
        Err(e) if dist.is_parallel() => {
            // As `fugu train`: one rank's error ends the job, so no rank waits in a collective.
            let message = format!(
                "fugu eval: error on rank {} of {}: {e:#}\n",
                dist.grid.world_rank, dist.grid.world_size
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), message.as_bytes());
            dist.abort_job(1);
            return Err(e);
        }
        other => other?,
    };
    if dist.is_root() {
        print_report(&report, &args.format)?;
    }
    Ok(())
}

fn print_report(r: &EvalReport, format: &str) -> Result<()> {
    if format == "json" {
        println!("{}", serde_json::to_string(r)?);
        return Ok(());
    }
    let step = r.step.map_or(String::new(), |s| format!(" (step {s})"));
    println!("checkpoint: {}{step}", r.checkpoint.display());
    println!(
        "data: {} ({}), {} batches, {} tokens",
        r.data, r.split, r.batches, r.tokens
    );
    let bpb = r.bits_per_byte.map_or_else(
        || "n/a (the data does not count its text bytes: a token file, or a manifest from before fugu counted them)".to_string(),
        |b| format!("{b:.4}"),
    );
    println!(
        "loss {:.4} nats/token   perplexity {:.3}   bits/byte {bpb}",
        r.loss, r.perplexity
    );
    Ok(())
}

/// `--choices`: one process, through the KV-cache decoder of `fugu sample`.
fn run_choices(args: &EvalArgs, file: &Path) -> Result<()> {
    if args.tp != 1 || args.pp != 1 || args.data.is_some() {
        bail!("--choices runs in one process and reads only its questions: drop --tp/--pp/--data");
    }
    let questions = choices::read_questions(file)?;
    crate::train::set_threads(args.run.threads)?;
    let dir = resolve(Some(&args.checkpoint))?;
    let hf = checkpoint::load_hf(&dir)?;
    let table = registry::full_params(&hf.config)?;
    let mut params = vec![0.0f32; table.total()];
    hf.copy_into(&table, &mut params)?;
    check_finite_weights(&dir, &table, &params)?;
    let tok = checkpoint_tokenizer(&dir, &hf.config)?;
    let cuda = CudaSettings {
        tf32: args.run.tf32,
    };
    let score = crate::with_backend!(args.run.device, cuda, |be| {
        let mut g = Generator::new(&hf.config, &params, be)?;
        let n = questions.len();
        choices::score(&mut g, tok.as_ref(), &questions, |i| {
            if i > 0 && i % 100 == 0 {
                eprintln!("  {i}/{n} questions");
            }
        })
    })?;
    if args.format == "json" {
        let out = serde_json::json!({
            "checkpoint": dir, "choices": file, "score": score,
        });
        println!("{out}");
    } else {
        println!("checkpoint: {}", dir.display());
        println!(
            "{}: {} questions, accuracy {:.4} ({} right by mean loss per ending token), \
             {:.4} by summed loss",
            file.display(),
            score.questions,
            score.accuracy,
            score.correct,
            score.accuracy_by_sum
        );
    }
    Ok(())
}

//! `fugu train`: arguments and their mapping onto [`crate::train::TrainOptions`].

use crate::backend::{CudaSettings, Device};
use crate::config::{RunConfig, TrainOverrides};
use crate::metrics::timers::TimerLevel;
use crate::train::dist::Dist;
use crate::train::{self, ExitError, TrainOptions};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::IsTerminal;
use std::path::PathBuf;

/// The config of a run that names none.
pub const DEFAULT_CONFIG: &str = "gpt2-tiny-4k";

/// Train a GPT-2. With no arguments: `gpt2-tiny` on the bundled Shakespeare corpus.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Config file or built-in name (gpt2-tiny-4k, gpt2-tiny, gpt2-124m, gpt2-350m, gpt2-774m,
    /// gpt2-1.5b, gpt-1.3b). Default: gpt2-tiny-4k (a 4096-id BPE trained on the bundled
    /// corpus; gpt2-tiny is the same model with GPT-2's BPE), or with --init-from the model of
    /// its config.json; with --resume, the checkpoint's (a given config must agree with it).
    #[arg(long)]
    pub config: Option<String>,
    /// Training data: a shard manifest (or its folder), a brace pattern of .tar shards, or a
    /// token file (nanoGPT's or llm.c's .bin; Megatron-LM's .bin/.idx pair, or their prefix).
    /// Default: the bundled Shakespeare corpus.
    #[arg(long)]
    pub data: Option<String>,
    /// Validation data (default: the validation split of --data). Evaluating on data that
    /// cannot be read is an error at start.
    #[arg(long)]
    pub val_data: Option<String>,
    /// Train on when the validation split of --data cannot be read, has no window or is
    /// missing (a .bin file), with a warning and no evaluation (default: an error at start,
    /// naming the reason).
    #[arg(long)]
    pub allow_no_eval: bool,
    /// Read the data in file order (a .bin: consecutive windows, wrapping at the end).
    #[arg(long)]
    pub no_shuffle: bool,
    /// Check the sha256 of every shard of the data before the first step (reads all of it:
    /// about 1 GB/s). Default: each shard's sha256 the first time it is read, before any of
    /// its samples is used; sizes always at start.
    #[arg(long)]
    pub verify_data: bool,
    /// Log, count and skip bad samples (undecodable or out-of-vocabulary tokens, damaged tar
    /// members) instead of stopping. A shard whose sha256 differs is always an error.
    #[arg(long)]
    pub skip_bad_samples: bool,
    /// Start from a Hugging Face GPT-2 directory (config.json + model.safetensors, or sharded
    /// weights with model.safetensors.index.json); without --config its config.json gives the
    /// model's shape.
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// Continue a run: a checkpoint directory, a run directory, or `auto` (the newest whole
    /// checkpoint in --out, or a fresh start when it holds none). The run keeps its settings;
    /// only --steps, --eval-every, --ckpt-every and options outside state.json may change.
    #[arg(long, value_name = "DIR|auto")]
    pub resume: Option<String>,
    /// Output directory (metrics.jsonl, breakdown.json, ckpt-*). Default: runs/CONFIG-TIME.
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub overrides: TrainOverrides,
    /// Override one field of the config: SECTION.FIELD=VALUE (train.lr=3e-4,
    /// model.n_layer=4); repeatable. The flags above win over it.
    #[arg(long = "set", value_name = "SECTION.FIELD=VALUE")]
    pub set: Vec<String>,
    /// Validation batches per evaluation.
    #[arg(long, default_value_t = 8)]
    pub eval_batches: usize,
    /// Where to run: cpu, cuda (device 0) or cuda:N. CUDA needs a build with
    /// `--features cuda` and, at run time, the NVIDIA driver, cuBLAS and NVRTC (CUDA 13).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda|cuda:N")]
    pub device: Device,
    /// With --device cuda: let cuBLAS use TF32 tensor cores for the fp32 GEMMs (default:
    /// strict fp32).
    #[arg(long)]
    pub tf32: bool,
    /// Compute threads (GEMM and the other ops). Default: all CPUs this process may use.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Per-op timers: off, coarse (forward/backward/optimizer) or fine (every op).
    #[arg(long, default_value = "fine", value_name = "off|coarse|fine")]
    pub timers: TimerLevel,
    /// Keep only the newest K checkpoints (0 = keep all).
    #[arg(long, default_value_t = 3)]
    pub keep_last: usize,
    /// Write the first step's gradients (HF names, safetensors) to FILE.
    #[arg(long, value_name = "FILE")]
    pub dump_grads: Option<PathBuf>,
    /// Skip up to N steps whose loss or gradients are not finite (default: stop at the first).
    #[arg(long, default_value_t = 0)]
    pub skip_nonfinite: u64,
    /// Print a plain progress line every N steps (batch jobs; a TTY gets a progress bar).
    #[arg(long, default_value_t = 10)]
    pub log_every: usize,
    /// Tensor-parallel degree (MPI builds): ranks per tensor-parallel group, consecutive world
    /// ranks (one per CMG on A64FX). Must divide the rank count, n_head and 4*n_embd.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline-parallel stages (MPI builds): the model's blocks split into P contiguous
    /// stages (balanced by compute, the LM head counted), run with the 1F1B schedule over
    /// --micro-batches. The world is pp x dp x tp. At most n_layer; may change when resuming.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Blocks per pipeline stage, comma-separated (e.g. 8,4 for --pp 2 of a 12-block model),
    /// instead of the split that balances estimated compute. May change when resuming.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',')]
    pub pp_layers: Option<Vec<usize>>,
    /// ZeRO stage: 1 shards the AdamW moments across data-parallel ranks.
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Data-parallel gradient bucket size in MiB (all-reduces start as buckets fill), more
    /// than 0 and at most 65536.
    #[arg(long, default_value_t = 16.0, value_parser = bucket_mib)]
    pub bucket_mb: f64,
    /// Run each rank's --batch-size sequences as N equal micro-batches and accumulate their
    /// gradients before the optimizer step: the same training, the activation memory of
    /// batch-size/N sequences. May change when resuming.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub micro_batches: usize,
    /// Activation recomputation: `attention` keeps one attention-probability buffer for all
    /// layers and recomputes each layer's scores and softmax in the backward pass (less
    /// memory, a little more time); `full` keeps only each block's output and reruns each
    /// block's forward pass in the backward pass (the least memory, about one more forward
    /// pass of time). Identical gradients either way. May change when resuming.
    #[arg(long, value_enum, default_value = "none")]
    pub recompute: crate::model::acts::Recompute,
    /// Run the LM head and the loss ROWS rows at a time, each chunk's backward pass with it:
    /// the logits of one chunk in memory instead of a whole micro-batch's (B·T × vocabulary;
    /// the largest activation of a small model with a large vocabulary). The same losses;
    /// the head's weight gradient is summed chunk by chunk (its last bits may differ). May
    /// change when resuming.
    #[arg(long, value_name = "ROWS", value_parser = clap::value_parser!(u64).range(1..))]
    pub loss_chunk: Option<u64>,
    /// Read the global batch as N data streams (default: one per data-parallel rank, or the
    /// resumed checkpoint's). Keeping N fixed keeps the data order when dp changes.
    #[arg(long, value_name = "N")]
    pub data_ranks: Option<usize>,
    /// Write a checkpoint and stop (exit code 4) before this time: an RFC 3339 time, `+DURATION`
    /// or a duration from now (seconds, MM:SS, HH:MM:SS, D-HH:MM:SS), or a Unix time. Default: the Slurm job's
    /// end (SLURM_JOB_END_TIME) or PJM_ELAPSE_LIMIT from FUGU_JOB_START. SIGUSR1 and SIGTERM
    /// also stop the run with a checkpoint.
    #[arg(long, value_name = "WHEN")]
    pub deadline: Option<String>,
    /// Seconds kept free before the deadline, on top of twice the longest step + checkpoint.
    #[arg(long, default_value_t = 30.0, value_parser = seconds)]
    pub deadline_margin: f64,
}

/// `--bucket-mb`: a finite size in (0, 65536] MiB.
fn bucket_mib(s: &str) -> Result<f64, String> {
    let v = crate::config::finite_f64(s)?;
    if v > 0.0 && v <= 65536.0 {
        Ok(v)
    } else {
        Err(format!("{v} MiB: expected more than 0 and at most 65536"))
    }
}

/// A finite, non-negative number of seconds.
fn seconds(s: &str) -> Result<f64, String> {
    let v = crate::config::finite_f64(s)?;
    if v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("{v}: expected a number of seconds >= 0"))
    }
}

impl TrainArgs {
    fn config_name(&self) -> String {
        let name = self.config.as_deref().unwrap_or(DEFAULT_CONFIG);
        std::path::Path::new(name)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "run".into())
    }

    /// Converts to the trainer's options.
    pub fn options(&self) -> Result<TrainOptions> {
        crate::metrics::machine::check_peak_settings()?;
        if !self.set.is_empty() && self.resume.is_some() {
            bail!(
                "--set: a resumed run keeps its settings; the flags of the fields that may \
                 change (--steps, --eval-every, --ckpt-every) do that"
            );
        }
        if let (Some(dir), None) = (&self.init_from, &self.config) {
            if let Some(s) = self
                .set
                .iter()
                .find(|s| s.trim_start().starts_with("model."))
            {
                bail!(
                    "--set {s}: with --init-from {} and no --config the model's shape comes \
                     from its config.json",
                    dir.display()
                );
            }
        }
        let config = self.config.as_deref().unwrap_or(DEFAULT_CONFIG);
        let run_config = RunConfig::load_with(config, &self.set)
            .with_context(|| format!("--config {config}"))?;
        if self.resume.is_none() {
            // Before anything is created: settings no run can use.
            self.overrides.apply(&run_config.train).validate()?;
        }
        Ok(TrainOptions {
            config: run_config,
            config_name: self.config_name(),
            config_given: self.config.is_some(),
            overrides: self.overrides.clone(),
            data: self.data.clone(),
            val_data: self.val_data.clone(),
            allow_no_eval: self.allow_no_eval,
            shuffle: !self.no_shuffle,
            verify_data: self.verify_data,
            skip_bad_samples: self.skip_bad_samples,
            init_from: self.init_from.clone(),
            resume: self.resume.clone(),
            out: self.out.clone(),
            threads: self.threads,
            timers: self.timers,
            keep_last: self.keep_last,
            dump_grads: self.dump_grads.clone(),
            skip_nonfinite: self.skip_nonfinite,
            log_every: self.log_every,
            eval_batches: self.eval_batches,
            tty: std::io::stderr().is_terminal(),
            tp: self.tp,
            pp: self.pp,
            pp_layers: self.pp_layers.clone(),
            zero: self.zero,
            bucket_mb: self.bucket_mb,
            micro_batches: self.micro_batches,
            recompute: self.recompute,
            loss_chunk: self.loss_chunk.map(|r| r as usize),
            data_ranks: self.data_ranks,
            deadline: self.deadline.clone(),
            deadline_margin: self.deadline_margin,
        })
    }
}

/// `fugu train --help` with each config-backed flag's default: the value in the default config
/// (read from it, so the help cannot drift from the file).
pub fn with_config_defaults(mut cmd: clap::Command) -> clap::Command {
    let Ok(cfg) = RunConfig::load(DEFAULT_CONFIG) else {
        return cmd;
    };
    for (field, value) in crate::config::train_fields(&cfg.train) {
        let value = value
            .as_str()
            .map_or_else(|| value.to_string(), str::to_string);
        cmd = cmd.mut_arg(field.as_str(), |a| {
            let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
            a.help(format!(
                "{help} [default: the config's; {DEFAULT_CONFIG}: {value}]"
            ))
        });
    }
    cmd
}

/// Runs `fugu train`. Under MPI, an error on one rank ends the whole job (`MPI_Abort`) after
/// printing it, so no rank hangs in a collective; a non-finite loss is seen by every rank at
/// once and ends the job normally with its own exit code.
pub fn run(args: TrainArgs) -> Result<()> {
    let mut dist = Dist::init()?;
    let cuda = CudaSettings { tf32: args.tf32 };
    let res = args.options().and_then(|opts| {
        crate::with_backend!(args.device, cuda, |be| train::run(opts, &mut dist, be))
    });
    if let Err(e) = &res {
        if let Some(x) = e.downcast_ref::<ExitError>() {
            // Every rank stops here together; rank 0 alone explains why.
            if !dist.is_root() {
                return Err(ExitError {
                    code: x.code,
                    message: String::new(),
                }
                .into());
            }
        } else if dist.is_parallel() {
            // One write of the whole message: stderr is unbuffered, so a formatted eprintln!
            // goes out piece by piece, and the other ranks' output could land in between.
            let message = format!(
                "fugu train: error on rank {} of {}: {e:#}\nfugu train: aborting all ranks\n",
                dist.grid.world_rank, dist.grid.world_size
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), message.as_bytes());
            dist.abort_job(1);
        }
    }
    res.map(|_| ())
}

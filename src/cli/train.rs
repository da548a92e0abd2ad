//! `fugu train`: arguments and their mapping onto [`crate::train::TrainOptions`].

use crate::backend::{CudaSettings, Device};
use crate::config::{LrSchedule, RunConfig};
use crate::metrics::timers::TimerLevel;
use crate::train::dist::Dist;
use crate::train::{self, ExitError, TrainOptions};
use anyhow::Result;
use clap::Args;
use std::io::IsTerminal;
use std::path::PathBuf;

/// Train a GPT-2. With no arguments: `gpt2-tiny` on the bundled Shakespeare corpus.
#[derive(Args, Debug, Clone)]
pub struct TrainArgs {
    /// Config file or built-in name (gpt2-tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b,
    /// gpt-1.3b).
    #[arg(long, default_value = "gpt2-tiny")]
    pub config: String,
    /// Training data: a shard manifest (or its folder), a brace pattern of .tar shards, or a
    /// raw .bin token file. Default: the bundled Shakespeare corpus.
    #[arg(long)]
    pub data: Option<String>,
    /// Validation data (default: the validation split of --data, when it has one).
    #[arg(long)]
    pub val_data: Option<String>,
    /// Read the data in file order (a .bin: consecutive windows, wrapping at the end).
    #[arg(long)]
    pub no_shuffle: bool,
    /// Start from a Hugging Face GPT-2 checkpoint directory (config.json + model.safetensors).
    #[arg(long, value_name = "DIR")]
    pub init_from: Option<PathBuf>,
    /// Continue a run: a checkpoint directory, a run directory, or `auto` (the newest
    /// checkpoint in --out, or a fresh start when there is none).
    #[arg(long, value_name = "DIR|auto")]
    pub resume: Option<String>,
    /// Output directory (metrics.jsonl, breakdown.json, ckpt-*). Default: runs/CONFIG-TIME.
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long)]
    pub batch_size: Option<usize>,
    #[arg(long)]
    pub seq_len: Option<usize>,
    #[arg(long)]
    pub steps: Option<usize>,
    #[arg(long)]
    pub lr: Option<f64>,
    #[arg(long)]
    pub min_lr: Option<f64>,
    #[arg(long)]
    pub warmup_steps: Option<usize>,
    #[arg(long, value_enum)]
    pub lr_schedule: Option<LrSchedule>,
    #[arg(long)]
    pub weight_decay: Option<f64>,
    #[arg(long)]
    pub beta1: Option<f64>,
    #[arg(long)]
    pub beta2: Option<f64>,
    #[arg(long)]
    pub eps: Option<f64>,
    /// Global-norm gradient clipping (0 = off).
    #[arg(long)]
    pub grad_clip: Option<f64>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Evaluate every N steps (0 = never).
    #[arg(long)]
    pub eval_every: Option<usize>,
    /// Checkpoint every N steps (0 = only at the end).
    #[arg(long)]
    pub ckpt_every: Option<usize>,
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
    /// ZeRO stage: 1 shards the AdamW moments across data-parallel ranks.
    #[arg(long, default_value_t = 0)]
    pub zero: u8,
    /// Data-parallel gradient bucket size in MiB (all-reduces start as buckets fill).
    #[arg(long, default_value_t = 16.0)]
    pub bucket_mb: f64,
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
    #[arg(long, default_value_t = 30.0)]
    pub deadline_margin: f64,
}

impl TrainArgs {
    /// The config with every command-line override applied.
    pub fn run_config(&self) -> Result<RunConfig> {
        let mut c = RunConfig::load(&self.config)?;
        let t = &mut c.train;
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = self.$f { t.$f = v; } )* };
        }
        set!(
            batch_size,
            seq_len,
            steps,
            lr,
            min_lr,
            warmup_steps,
            lr_schedule,
            weight_decay,
            beta1,
            beta2,
            eps,
            grad_clip,
            seed,
            eval_every,
            ckpt_every
        );
        Ok(c)
    }

    fn config_name(&self) -> String {
        std::path::Path::new(&self.config)
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "run".into())
    }

    /// Converts to the trainer's options.
    pub fn options(&self) -> Result<TrainOptions> {
        Ok(TrainOptions {
            config: self.run_config()?,
            config_name: self.config_name(),
            data: self.data.clone(),
            val_data: self.val_data.clone(),
            shuffle: !self.no_shuffle,
            init_from: self.init_from.clone(),
            resume: self.resume.clone(),
            out: self.out.clone(),
            threads: self.threads,
            timers: self.timers,
            keep_last: self.keep_last,
            dump_grads: self.dump_grads.clone(),
            skip_nonfinite: self.skip_nonfinite,
            log_every: self.log_every,
            eval_batches: self.eval_batches.max(1),
            tty: std::io::stderr().is_terminal(),
            tp: self.tp,
            zero: self.zero,
            bucket_mb: self.bucket_mb,
            data_ranks: self.data_ranks,
            deadline: self.deadline.clone(),
            deadline_margin: self.deadline_margin,
        })
    }
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
            eprintln!(
                "fugu train: error on rank {} of {}: {e:#}\nfugu train: aborting all ranks",
                dist.grid.world_rank, dist.grid.world_size
            );
            dist.abort_job(1);
        }
    }
    res.map(|_| ())
}

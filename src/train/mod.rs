//! `fugu train`: the training loop, with metrics, timers, evaluation and checkpoints.

pub mod data;
pub mod dist;
pub mod dump;
pub mod eval;
pub mod layout;
pub mod lock;
pub mod loss_scale;
pub mod pipeline;
pub mod resume;
pub mod save;
pub mod schedule;
mod setup;
pub mod state;
pub mod stop;
pub mod trainer;

use crate::backend::Backend;
use crate::config::{RunConfig, TrainOverrides};
use crate::metrics::timers::TimerLevel;
use anyhow::{bail, Result};
use dist::Dist;
use std::path::PathBuf;
pub use trainer::Trainer;

/// Exit code of a run stopped because the loss or the gradients were not finite.
pub const EXIT_NONFINITE: u8 = 3;
/// Exit code of a run that wrote a checkpoint and stopped early because of a stop signal
/// (SIGUSR1, SIGTERM) or its deadline: resubmit with `--resume auto` to continue.
pub const EXIT_CHECKPOINTED: u8 = 4;

/// Everything `fugu train` was asked to do, after command-line parsing.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// The `--config` file (or built-in), before command-line overrides.
    pub config: RunConfig,
    /// Name of the config (for the default output folder).
    pub config_name: String,
    /// `--config` was given explicitly (a resumed run then checks it against the checkpoint).
    pub config_given: bool,
    /// The training settings given on the command line.
    pub overrides: TrainOverrides,
    /// `--data`; `None` = the bundled corpus.
    pub data: Option<String>,
    /// `--val-data`; `None` = the validation split of `data`.
    pub val_data: Option<String>,
    /// `--allow-no-eval`: a validation split that cannot be read turns evaluation off with a
    /// warning instead of failing at start.
    pub allow_no_eval: bool,
    pub shuffle: bool,
    /// `--verify-data`: check every shard's sha256 at start (default: each shard's the first
    /// time it is read).
    pub verify_data: bool,
    /// `--skip-bad-samples`: log, count and skip bad samples instead of failing.
    pub skip_bad_samples: bool,
    pub init_from: Option<PathBuf>,
    /// `--resume DIR|auto`.
    pub resume: Option<String>,
    pub out: Option<PathBuf>,
    pub threads: Option<usize>,
    pub timers: TimerLevel,
    pub keep_last: usize,
    pub dump_grads: Option<PathBuf>,
    pub skip_nonfinite: u64,
    pub log_every: usize,
    pub eval_batches: usize,
    /// stderr is a terminal: draw a progress bar instead of plain lines.
    pub tty: bool,
    /// Tensor-parallel degree (`--tp`).
    pub tp: usize,
    /// Pipeline stages (`--pp`).
    pub pp: usize,
    /// Blocks per stage (`--pp-layers`); `None`: the balanced split.
    pub pp_layers: Option<Vec<usize>>,
    /// ZeRO stage (0 or 1).
    pub zero: u8,
    /// Data-parallel gradient bucket size in MiB.
    pub bucket_mb: f64,
    /// `--micro-batches`: each rank's batch is run as this many equal micro-batches whose
    /// gradients accumulate before the optimizer step (activation memory of one micro-batch).
    pub micro_batches: usize,
    /// `--recompute`: activations the backward pass recomputes instead of keeping.
    pub recompute: crate::model::acts::Recompute,
    /// `--loss-chunk`: rows of logits per LM head chunk (`None`: a whole micro-batch).
    pub loss_chunk: Option<usize>,
    /// `--data-ranks` (default: the data-parallel size, or the checkpoint's).
    pub data_ranks: Option<usize>,
    /// `--deadline`: stop with a checkpoint before this time (see [`stop::find_deadline`]).
    pub deadline: Option<String>,
    /// Seconds kept free before the deadline, besides room for a step and a checkpoint.
    pub deadline_margin: f64,
}

/// How a run ended.
#[derive(Clone, Debug)]
pub struct TrainOutcome {
    pub out_dir: PathBuf,
    pub steps_done: u64,
    pub last_loss: f32,
    pub last_checkpoint: Option<PathBuf>,
    pub val_loss: Option<f64>,
}

/// An error that carries its own exit code (non-finite loss).
#[derive(Debug)]
pub struct ExitError {
    pub code: u8,
    pub message: String,
}

impl std::fmt::Display for ExitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ExitError {}

fn default_out(name: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    PathBuf::from("runs").join(format!("{name}-{secs}"))
}

fn mib(bytes: f64) -> String {
    format!("{:.1} MiB", bytes / (1u64 << 20) as f64)
}

/// Sets the compute thread count (fugu-gemm and rayon) before any parallel work starts.
pub fn set_threads(threads: Option<usize>) -> Result<usize> {
    if let Some(n) = threads {
        if n == 0 {
            bail!("--threads 0: expected at least 1");
        }
        // More compute threads than CPUs only makes every step slower (and a thousand of them
        // can stall a run past its signals), so the count is capped, with a warning.
        let avail = std::thread::available_parallelism().map_or(n, |a| a.get());
        let n = if n > avail {
            eprintln!(
                "warning: --threads {n} is more than the {avail} CPUs this process may use; \
                 using {avail}"
            );
            avail
        } else {
            n
        };
        // Set before fugu-gemm's runtime starts (it reads FUGU_NUM_THREADS once).
        std::env::set_var("FUGU_NUM_THREADS", n.to_string());
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .ok();
        return Ok(n);
    }
    Ok(rayon::current_num_threads())
}

/// Runs `fugu train` in the job described by `dist` (one process: [`Dist::serial`]) on
/// `backend` (see [`Trainer`]).
pub fn run<B: Backend>(opts: TrainOptions, dist: &mut Dist, backend: B) -> Result<TrainOutcome> {
    Trainer::setup(opts, dist, backend)?.run()
}

/// Rank 0's string on every rank.
fn broadcast_string(dist: &Dist, s: String) -> String {
    let mut b = s.into_bytes();
    dist.world.broadcast_bytes(&mut b);
    String::from_utf8(b).expect("rank 0 sent UTF-8")
}

//! `fugu eval`: a checkpoint's loss, perplexity and bits per byte on validation data, computed
//! by the trainer's own evaluation ([`super::trainer::validation_loss`]) on the same grid
//! (serial, or any `--tp`/`--pp`/data-parallel layout under MPI), so that it equals the
//! `val_loss` a run logged at that checkpoint for the same data and batches.

use super::data;
use super::dist::Dist;
use super::resume;
use super::setup;
use super::trainer::validation_loss;
use super::{broadcast_string, set_threads, TrainOptions};
use crate::backend::Backend;
use crate::metrics::timers::{TimerLevel, Timers};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// What `fugu eval` measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EvalReport {
    /// The checkpoint (or Hugging Face folder) evaluated.
    pub checkpoint: PathBuf,
    /// Its training step (fugu checkpoints only).
    pub step: Option<u64>,
    /// What was read, and which part of it.
    pub data: String,
    pub split: &'static str,
    pub batches: usize,
    /// Tokens whose next-token loss was averaged (batches × global batch × sequence length).
    pub tokens: u64,
    /// Mean next-token loss in nats.
    pub loss: f64,
    pub perplexity: f64,
    /// The loss in bits per byte of text (`None`: the data does not count its text bytes).
    pub bits_per_byte: Option<f64>,
}

/// Evaluates the model `opts` names (`resume`: a fugu run folder or checkpoint, read as a
/// resumed run reads it; else `init_from`: a Hugging Face folder) on `opts.val_data` (default:
/// the run's data, or the bundled corpus) over `opts.eval_batches` batches. Writes nothing.
pub fn evaluate<B: Backend>(
    mut opts: TrainOptions,
    dist: &mut Dist,
    backend: B,
) -> Result<EvalReport> {
    if opts.eval_batches == 0 {
        anyhow::bail!("--batches 0: an evaluation needs at least one batch");
    }
    set_threads(opts.threads)?;
    let start = resume::find(opts.resume.as_deref(), Path::new("."), dist.is_root())?;
    let (from, state) = match start {
        Some(r) => (Some(r.dir), Some(r.state)),
        None => (None, None),
    };
    let cfg = setup::run_config(&mut opts, dist, state.as_ref())?;
    setup::check_step_options(&opts, &cfg.train)?;
    dist.make_grid(opts.tp, opts.pp, &cfg.model)?;
    let dist: &Dist = dist;
    let t = &cfg.train;
    let data = match (&opts.val_data, &state) {
        (Some(v), _) => v.clone(),
        (None, Some(st)) => st.data.clone(),
        (None, None) if dist.is_root() => {
            data::resolve_data(opts.data.as_deref(), cfg.model.vocab_size, false)?
        }
        (None, None) => String::new(),
    };
    let data = broadcast_string(dist, data);
    // Data named on the command line is read as --val-data is (a manifest's validation split,
    // a token file or pattern whole); the run's own data (or the bundled corpus) by its
    // validation split, as the run's evaluations read it.
    let loader = setup::val_loader_config(&opts, dist, &cfg);
    data::check_val_data("the evaluation data", &data, &loader)?;
    let mut parts = setup::model(&opts, dist, &cfg, backend, from.as_deref())?;
    let timers = Timers::new(TimerLevel::Off);
    let loss = validation_loss(
        &mut *parts.model,
        &mut parts.pipeline,
        dist,
        &timers,
        (&data, &loader, opts.eval_batches),
        (opts.micro_batches, t.batch_size, t.seq_len),
    )
    .with_context(|| format!("evaluating on {data}"))?;
    let checkpoint = from.or_else(|| opts.init_from.clone()).unwrap_or_default();
    Ok(EvalReport {
        checkpoint,
        step: state.map(|s| s.step),
        split: match loader.split {
            fugu_io::Split::Val => "validation split",
            fugu_io::Split::Train => "whole",
        },
        batches: opts.eval_batches,
        tokens: (opts.eval_batches * t.batch_size * dist.grid.dp * t.seq_len) as u64,
        loss,
        perplexity: loss.exp(),
        bits_per_byte: data::bits_per_byte(loss, data::tokens_per_byte(&data, loader.split)),
        data,
    })
}

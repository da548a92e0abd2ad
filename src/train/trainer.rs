//! [`Trainer`]: `fugu train` over any [`Backend`], as a short list of named phases.
//!
//! ```text
//! setup ─► for each step: step ─► log ─► evaluate ─► checkpoint ─► stop? ─► finish
//! ```
//!
//! * [`Trainer::setup`]: output folder (locked for the run), resume point, configuration, grid, model on the given
//!   backend (random init, `--init-from` or a checkpoint), data streams, the metrics header.
//! * [`Trainer::step`]: one optimizer step (batch, forward, backward with overlapped
//!   data-parallel buckets, gradient norm, non-finite check, AdamW, ZeRO-1 all-gather).
//! * [`Trainer::log`]: `metrics.jsonl` and the progress line.
//! * [`Trainer::evaluate`], [`Trainer::checkpoint`], [`Trainer::stop`]: at their intervals.
//! * [`Trainer::finish`]: the per-op breakdown and the `end` event.
//!
//! The trainer never names a backend: the CLI builds one and hands it to [`Trainer::setup`].
//! Host access (checkpoints, `--dump-grads`, losses) goes through the backend's
//! `download`/`upload`, so buffers may live in device memory.

use super::data::{self, BatchSource};
use super::dist::Dist;
use super::lock::RunLock;
use super::loss_scale::{LossScaler, Verdict};
use super::pipeline::Pipeline;
use super::save;
use super::setup::{self, Memory};
use super::state::{SavedLayout, TrainState, STATE_FORMAT};
use super::{
    dump, mib, schedule, set_threads, stop, ExitError, TrainOptions, TrainOutcome,
    EXIT_CHECKPOINTED, EXIT_NONFINITE,
};
use crate::backend::Backend;
use crate::checkpoint;
use crate::checkpoint::sharded::{self, Kind};
use crate::config::{Precision, RunConfig};
use crate::metrics::jsonl::{EvalRecord, MetricsWriter, StepRecord};
use crate::metrics::machine::{peak_rss_bytes, MachineInfo};
use crate::metrics::ops::trainer;
use crate::metrics::progress::{Progress, StepLine};
use crate::metrics::tensorboard::TensorBoardWriter;
use crate::metrics::timers::{Breakdown, OutsideStep, Roofs, TimerLevel, Timers};
use crate::model::cost::Slice;
use crate::model::table::Table;
use crate::model::{registry, Model, OptimStep, Stage};
use crate::parallel::grad_sync::GradSync;
use crate::parallel::{timer_stats, Comm, ReduceOp};
use anyhow::{bail, Context, Result};
use fugu_io::LoaderConfig;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

/// What one completed optimizer step measured.
#[derive(Clone, Copy, Debug)]
pub struct StepResult {
    /// Steps done after this one (1-based).
    pub done: u64,
    /// Loss averaged over data-parallel ranks.
    pub loss: f32,
    pub lr: f64,
    /// Pre-clip global gradient norm.
    pub grad_norm: f64,
    pub step_ms: f64,
    /// Collective payload bytes of this step.
    pub comm_bytes: u64,
}

/// Totals kept for the end of the run.
#[derive(Default)]
struct RunTotals {
    tokens_seen: u64,
    skipped_nonfinite: u64,
    last_checkpoint: Option<PathBuf>,
    last_loss: f32,
    last_val: Option<f64>,
    step_ms: f64,
    timed_steps: u64,
    /// Rank 0: per-step mean, min and max over ranks of every timer, summed over steps.
    rank_timers: [BTreeMap<String, f64>; 3],
    /// Evaluation and checkpoint time (between steps, reported apart from them).
    outside: BTreeMap<String, OutsideStep>,
    /// A step above the peak was reported (once per run).
    warned_above_peak: bool,
}

impl RunTotals {
    fn add_outside(&mut self, name: &str, since: Instant) {
        let o = self.outside.entry(name.to_owned()).or_default();
        o.count += 1;
        o.total_ms += since.elapsed().as_secs_f64() * 1e3;
    }
}

/// One training run of `fugu train` on backend `B`.
pub struct Trainer<'d, B: Backend> {
    /// Rank 0: the output folder's lock, held until the trainer is dropped.
    _run_lock: Option<RunLock>,
    opts: TrainOptions,
    dist: &'d Dist,
    out: PathBuf,
    cfg: RunConfig,
    /// Resolved training data (manifest, pattern or `.bin`).
    data: String,
    /// Rank 0: the data's tokenizer files and special ids, written into every checkpoint.
    tokenizer: Option<data::CheckpointTokenizer>,
    /// What evaluations read; `None`: no evaluation (decided and warned about at start).
    val_data: Option<String>,
    val_loader: LoaderConfig,
    /// Tokens per byte of text of the training and validation data, for bits per byte.
    train_tokens_per_byte: Option<f64>,
    val_tokens_per_byte: Option<f64>,
    /// Declared (so dropped) before the model: buckets in flight in the device's memory are
    /// waited for before the buffers they address are freed.
    sync: GradSync,
    model: Box<dyn Model<B>>,
    /// This rank's stage of the pipeline (the whole model with `--pp 1`) and its schedule.
    pipeline: Pipeline,
    /// Every stage of the pipeline (one with `--pp 1`).
    stages: Vec<Stage>,
    /// The logical (tp = 1) parameter table, as in checkpoints.
    full_table: Table,
    source: BatchSource,
    timers: Timers,
    /// Rank 0 only.
    metrics: Option<MetricsWriter>,
    /// Rank 0 only: the same scalars for TensorBoard.
    tensorboard: Option<TensorBoardWriter>,
    progress: Progress,
    watch: stop::StopWatch,
    /// The group the squared gradient norm is summed over.
    norm_comm: Rc<dyn Comm>,
    saved_layout: SavedLayout,
    threads: usize,
    start_step: u64,
    tokens_per_step: u64,
    flops_per_rank: f64,
    peak_flops: f64,
    memory: Memory,
    window: Vec<u32>,
    totals: RunTotals,
    /// fp16 only: dynamic loss scaling.
    scaler: Option<LossScaler>,
}

impl<'d, B: Backend> Trainer<'d, B> {
    /// Everything before the first step: folders, resume point, configuration, grid, the
    /// model on `backend`, its initial state, data, and the run header.
    pub fn setup(mut opts: TrainOptions, dist: &'d mut Dist, backend: B) -> Result<Self> {
        let threads = set_threads(opts.threads)?;
        stop::install_handlers(dist.is_root());
        let watch = stop::StopWatch::new(
            stop::find_deadline(opts.deadline.as_deref())?,
            std::time::Duration::from_secs_f64(opts.deadline_margin.max(0.0)),
        );
        let output = setup::output(&opts, dist)?;
        let start_state = output.start_state.as_ref();
        let cfg = setup::run_config(&mut opts, dist, start_state)?;
        if let Some(st) = start_state {
            super::resume::check_threads(st.threads, threads, dist.is_root());
        }
        setup::check_step_options(&opts, &cfg.train)?;
        dist.make_grid(opts.tp, opts.pp, &cfg.model)?;
        let dist: &'d Dist = dist;
        if dist.is_root() {
            warn_if_oversubscribed(dist, threads);
        }
        let (grid, t) = (dist.grid, cfg.train.clone());
        let data = setup::data(&opts, dist, &output, &cfg.model)?;
        let parts = setup::model(&opts, dist, &cfg, backend, output.resume_from.as_deref())?;
        let loaders = setup::loaders(&opts, dist, &cfg, &*parts.model, &data, start_state)?;

        let machine = MachineInfo::detect(threads)?;
        let peak_gflops = parts
            .model
            .backend()
            .peak_gflops(t.precision.compute_dtype())
            .map_or(machine.peak_gflops, |p| p.0);
        let global_batch = t.batch_size * grid.dp;
        let m = &cfg.model;
        let whole = Slice {
            vocab: m.vocab_size,
            ..Stage::whole(m.n_layer).slice(m, t.seq_len, global_batch, 1)
        };
        let flops_step = registry::cost(m.arch).model_flops(&whole);
        let start_step = start_state.map_or(0, |s| s.step);
        let timers = Timers::new(opts.timers);
        if let Some(clock) = parts.model.backend().device_clock() {
            timers.set_device_clock(clock);
        }
        let mut progress = Progress::new(t.steps as u64, start_step, opts.tty && dist.is_root());
        if !dist.is_root() {
            progress = progress.silenced();
        }
        progress.set_log_every(opts.log_every.max(1) as u64);
        let norm_comm = if opts.zero == 1 {
            dist.world.clone()
        } else {
            dist.mp.clone()
        };
        // fp16: dynamic loss scaling, continued from the checkpoint when resuming.
        let scaler = match (t.precision, start_state.and_then(|s| s.loss_scaler)) {
            (Precision::Fp16, Some(saved)) => Some(saved),
            (Precision::Fp16, None) => Some(LossScaler::for_new_run()?),
            _ => None,
        };
        let totals = RunTotals {
            tokens_seen: start_state.map_or(0, |s| s.tokens_seen),
            skipped_nonfinite: start_state.map_or(0, |s| s.skipped_nonfinite),
            last_checkpoint: output.resume_from.clone(),
            last_loss: f32::NAN,
            ..Default::default()
        };
        let train_tokens_per_byte = data::tokens_per_byte(&data.path, fugu_io::Split::Train);
        let mut trainer = Trainer {
            _run_lock: output.run_lock,
            tokenizer: data.tokenizer,
            dist,
            out: output.out,
            data: data.path,
            train_tokens_per_byte,
            val_tokens_per_byte: loaders
                .val_data
                .as_deref()
                .and_then(|v| data::tokens_per_byte(v, loaders.val_loader.split)),
            val_data: loaders.val_data,
            val_loader: loaders.val_loader,
            sync: parts.sync,
            full_table: parts.full_table,
            source: loaders.source,
            timers,
            metrics: None,
            tensorboard: None,
            progress,
            watch,
            norm_comm,
            pipeline: parts.pipeline,
            stages: parts.stages,
            saved_layout: SavedLayout {
                pp: grid.pp,
                tp: grid.tp,
                dp: grid.dp,
                zero: opts.zero,
                data_ranks: data.ranks,
            },
            threads,
            start_step,
            tokens_per_step: (global_batch * t.seq_len) as u64,
            flops_per_rank: flops_step / grid.world_size as f64,
            peak_flops: peak_gflops * 1e9,
            memory: loaders.memory,
            window: Vec::new(),
            totals,
            scaler,
            model: parts.model,
            cfg,
            opts,
        };
        if trainer.dist.is_root() {
            trainer.write_header(&machine, &parts.init_desc, flops_step)?;
        }
        Ok(trainer)
    }

    /// Runs every remaining step, then [`Self::finish`]. An early stop (signal, deadline) or a
    /// non-finite loss ends with an [`ExitError`].
    pub fn run(mut self) -> Result<TrainOutcome> {
        let steps = self.cfg.train.steps as u64;
        for step in self.start_step..steps {
            // A step skipped as non-finite is not logged, but it counts as done: evaluation,
            // checkpoints (with the skip count) and stop checks happen at it as at any other.
            let done = step + 1;
            if let Some(r) = self.step(step)? {
                self.log(&r)?;
            }
            let is_last = done == steps;
            self.evaluate(done, is_last)?;
            let saved = self.checkpoint(done, is_last)?;
            self.stop(done, is_last, saved)?;
        }
        self.finish()
    }

    /// One optimizer step at 0-based `step`. `None` when a non-finite step was skipped
    /// (`--skip-nonfinite`); an [`ExitError`] when it was not allowed to be.
    pub fn step(&mut self, step: u64) -> Result<Option<StepResult>> {
        let t = &self.cfg.train;
        let timers = &self.timers;
        let model = &mut *self.model;
        let t0 = Instant::now();
        let bytes0 = self.dist.payload_bytes();
        {
            let _g = timers.scope(trainer::data::BATCH_GENERATOR, TimerLevel::Coarse);
            self.source
                .next_into(&mut self.window)
                .with_context(|| format!("reading training data {} at step {step}", self.data))?;
        }
        model.zero_grad();
        if let Some(sc) = &self.scaler {
            model.set_loss_scale(sc.scale);
        }
        // The window's rows as `micro` equal micro-batches through the pipeline schedule
        // (with one stage: gradient accumulation); the data-parallel buckets start during
        // the last one's backward pass.
        let micro = self.opts.micro_batches;
        let rows = t.batch_size / micro;
        model.set_batches(&self.window, micro, rows, t.seq_len)?;
        self.sync.begin_step();
        let grads = model.buffers().grads;
        let sync = &mut self.sync;
        let loss_sum = self
            .pipeline
            .train_step(model, micro, timers, &mut |be, from| {
                sync.ready(be, grads, from)
            });
        {
            let _g = timers.scope(trainer::grads::ALLREDUCE_PARAMS, TimerLevel::Coarse);
            sync.finish(model.backend_mut(), grads);
        }
        let local_loss = (last_stage_sum(self.dist, loss_sum) / micro as f64) as f32;
        let loss = self.dist.dp_mean(local_loss as f64) as f32;
        if step == self.start_step && self.start_step == 0 {
            if let Some(path) = &self.opts.dump_grads {
                if self.dist.is_parallel() {
                    bail!("--dump-grads works with one process only");
                }
                let g = model.download(grads);
                dump::dump_grads(path, &self.cfg.model, model.table(), &g)?;
                eprintln!("  wrote first-step gradients to {}", path.display());
            }
        }
        let optimizer_timer = timers.scope(trainer::phase::OPTIMIZER, TimerLevel::Coarse);
        let mut sq = [model.grad_sq_sum(timers)];
        self.norm_comm.allreduce_f64(&mut sq, ReduceOp::Sum);
        let norm = sq[0].sqrt();
        let lr = schedule::lr_at(t, step as usize);
        if let Some(sc) = self.scaler.as_mut() {
            if sc.update(norm) == Verdict::SkipOverflow {
                drop(optimizer_timer);
                return self.overflow(step, norm).map(|()| None);
            }
        }
        if !loss.is_finite() || !norm.is_finite() {
            drop(optimizer_timer);
            return self.nonfinite(step, loss, norm).map(|()| None);
        }
        model.apply_optimizer(
            &OptimStep {
                lr,
                beta1: t.beta1,
                beta2: t.beta2,
                eps: t.eps,
                weight_decay: t.weight_decay,
                grad_clip: t.grad_clip,
                step: step + 1,
            },
            norm,
            timers,
        );
        drop(optimizer_timer);
        if self.sync.active() && self.opts.zero == 1 {
            let _g = timers.scope(trainer::grads::ALLGATHER_PARAMS, TimerLevel::Coarse);
            let params = model.buffers().params;
            self.sync.gather_params(model.backend_mut(), params);
            model.refresh_compute_params();
        }
        self.watch.record_step(t0.elapsed());
        Ok(Some(StepResult {
            done: step + 1,
            loss,
            lr,
            grad_norm: norm,
            step_ms: t0.elapsed().as_secs_f64() * 1e3,
            comm_bytes: self.dist.payload_bytes() - bytes0,
        }))
    }

    /// A step whose loss or gradient norm is not finite: skip it while `--skip-nonfinite`
    /// allows, else stop with [`EXIT_NONFINITE`]. Loss and norm are reduced over all ranks, so
    /// every rank decides the same.
    fn nonfinite(&mut self, step: u64, loss: f32, norm: f64) -> Result<()> {
        // Steps are named 1-based everywhere the user sees them (progress, metrics, ckpt-N).
        let step = step + 1;
        if let Some(w) = self.metrics.as_mut() {
            w.event(
                "nonfinite",
                &json!({"step": step, "loss": loss, "grad_norm": norm}),
            )?;
        }
        let skipped = &mut self.totals.skipped_nonfinite;
        if *skipped < self.opts.skip_nonfinite {
            *skipped += 1;
            self.progress.message(&format!(
                "step {step}: non-finite loss {loss} / grad norm {norm}: update skipped ({skipped} of at most {})",
                self.opts.skip_nonfinite
            ));
            return Ok(());
        }
        self.progress.finish();
        let keep = match &self.totals.last_checkpoint {
            Some(c) => format!("the last good checkpoint is {}", c.display()),
            None => "no checkpoint was written yet".to_string(),
        };
        Err(ExitError {
            code: EXIT_NONFINITE,
            message: format!(
                "non-finite loss ({loss}) or gradient norm ({norm}) at step {step}; parameters were not updated and {keep}. \
                 Lower --lr, check the data, or pass --skip-nonfinite N to skip up to N such steps"
            ),
        }
        .into())
    }

    /// An fp16 step whose gradients overflowed: skipped, the loss scale already halved.
    fn overflow(&mut self, step: u64, norm: f64) -> Result<()> {
        let sc = self.scaler.expect("overflow only with a loss scaler");
        if let Some(w) = self.metrics.as_mut() {
            w.event(
                "overflow",
                &json!({"step": step + 1, "grad_norm": norm, "loss_scale": sc.scale,
                        "overflow_steps": sc.overflow_steps}),
            )?;
        }
        self.progress.message(&format!(
            "step {}: fp16 gradients overflowed: update skipped, loss scale now {} ({} such steps so far)",
            step + 1,
            sc.scale,
            sc.overflow_steps
        ));
        Ok(())
    }

    /// Records a completed step: run totals, `metrics.jsonl` (rank 0; timers as mean/min/max
    /// over ranks in parallel runs) and the progress line.
    pub fn log(&mut self, r: &StepResult) -> Result<()> {
        self.totals.last_loss = r.loss;
        self.totals.tokens_seen += self.tokens_per_step;
        let timer_map = self.timers.take_step();
        let stats = if self.dist.is_parallel() {
            timer_stats::gather(&*self.dist.world, &timer_map)
        } else {
            None
        };
        self.totals.step_ms += r.step_ms;
        self.totals.timed_steps += 1;
        let secs = r.step_ms / 1e3;
        let flops = self.flops_per_rank / secs;
        let pct = 100.0 * flops / self.peak_flops;
        if pct > 100.0 && !self.totals.warned_above_peak && self.dist.is_root() {
            self.totals.warned_above_peak = true;
            let peak = format!("peak of {:.1} GFLOP/s per rank", self.peak_flops / 1e9);
            if let Some(w) = crate::metrics::peak_cache::above_peak_warning(
                &format!("training step {}", r.done),
                pct,
                &peak,
            ) {
                self.progress.message(&w);
            }
        }
        let tokens_per_s = self.tokens_per_step as f64 / secs;
        if let Some(w) = self.metrics.as_mut() {
            let mut rec = StepRecord {
                step: r.done,
                loss: r.loss as f64,
                lr: r.lr,
                grad_norm: r.grad_norm,
                tokens: self.totals.tokens_seen,
                tokens_per_s,
                step_ms: r.step_ms,
                tflops_per_process: flops / 1e12,
                peak_pct: pct,
                timers: timer_map,
                bpb: data::bits_per_byte(r.loss as f64, self.train_tokens_per_byte),
                ..Default::default()
            };
            if let Some(st) = stats {
                for (tot, m) in self
                    .totals
                    .rank_timers
                    .iter_mut()
                    .zip([&st.mean, &st.min, &st.max])
                {
                    for (k, v) in m {
                        *tot.entry(k.clone()).or_default() += v;
                    }
                }
                rec.timers = st.mean;
                rec.timers_min = st.min;
                rec.timers_max = st.max;
                rec.comm_bytes = Some(r.comm_bytes);
            }
            w.step(&rec)?;
            if let Some(tb) = self.tensorboard.as_mut() {
                tb.step(&rec)?;
            }
        }
        self.progress.update(&StepLine {
            step: r.done,
            loss: r.loss as f64,
            lr: r.lr,
            tokens_per_s,
            step_ms: r.step_ms,
            tflops: flops / 1e12,
            eta_secs: None,
        });
        Ok(())
    }

    /// The validation loss every `eval_every` steps and at the end, averaged over
    /// data-parallel ranks.
    pub fn evaluate(&mut self, done: u64, is_last: bool) -> Result<()> {
        let t = &self.cfg.train;
        let Some(val_data) = &self.val_data else {
            return Ok(());
        };
        if t.eval_every == 0 || (!done.is_multiple_of(t.eval_every as u64) && !is_last) {
            return Ok(());
        }
        // Not part of any step: timed apart, with the op timers paused.
        let t0 = Instant::now();
        let _paused = self.timers.pause();
        let v = validation_loss(
            &mut *self.model,
            &mut self.pipeline,
            self.dist,
            &self.timers,
            (val_data, &self.val_loader, self.opts.eval_batches),
            (self.opts.micro_batches, t.batch_size, t.seq_len),
        )?;
        let bpb = data::bits_per_byte(v, self.val_tokens_per_byte);
        let rec = EvalRecord {
            step: done,
            val_loss: v,
            val_bpb: bpb,
        };
        if let Some(w) = self.metrics.as_mut() {
            w.eval(&rec)?;
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            tb.eval(&rec)?;
        }
        let bits = bpb.map_or(String::new(), |b| format!(" ({b:.4} bits/byte)"));
        self.progress
            .message(&format!("step {done}: val_loss {v:.4}{bits}"));
        self.totals.last_val = Some(v);
        self.totals.add_outside("eval", t0);
        Ok(())
    }

    /// Writes a checkpoint every `ckpt_every` steps and at the end. True when it wrote one.
    pub fn checkpoint(&mut self, done: u64, is_last: bool) -> Result<bool> {
        let every = self.cfg.train.ckpt_every as u64;
        if (every > 0 && done.is_multiple_of(every)) || is_last {
            self.save(done)?;
            return Ok(true);
        }
        Ok(false)
    }

    /// Writes `ckpt-DONE` from every rank (sharded files, [`save::write_shards`]); every rank
    /// returns once it is complete. The checkpoint event records the largest peak RSS over
    /// ranks before and after writing, and the largest growth of one rank's peak.
    fn save(&mut self, done: u64) -> Result<()> {
        let t0 = Instant::now();
        let _paused = self.timers.pause();
        let dist = self.dist;
        let rss_before = peak_rss_bytes().unwrap_or(0);
        // Rank 0 makes the temporary folder; every rank writes its shards into it.
        let mut tmp = Vec::new();
        if dist.is_root() {
            let dir = checkpoint::begin_checkpoint(&self.out, done)?;
            tmp = dir.to_string_lossy().into_owned().into_bytes();
        }
        dist.world.broadcast_bytes(&mut tmp);
        let tmp = PathBuf::from(String::from_utf8(tmp).context("checkpoint folder name")?);
        let g = dist.grid;
        let plan = sharded::plan(&self.cfg.model, &self.stages, g.tp)?;
        save::write_shards(&*self.model, &plan, dist, &tmp, done)?;
        // Every shard is complete and fsynced before rank 0 completes the checkpoint.
        dist.world.barrier();
        let mut path = None;
        if dist.is_root() {
            let state = TrainState {
                format: STATE_FORMAT.into(),
                step: done,
                config: self.cfg.clone(),
                data: self.data.clone(),
                cursor: self.source.cursor(),
                tokens_seen: self.totals.tokens_seen,
                skipped_nonfinite: self.totals.skipped_nonfinite,
                threads: self.threads,
                fugu_version: env!("CARGO_PKG_VERSION").into(),
                shuffle: Some(self.opts.shuffle),
                layout: Some(self.saved_layout),
                loss_scaler: self.scaler,
            };
            let (files, ids) = match &self.tokenizer {
                Some(t) => (t.files.as_slice(), t.ids),
                None => (&[][..], self.cfg.model.special_ids()),
            };
            checkpoint::write_model_config(&tmp, &self.cfg.model, ids)?;
            for (kind, name) in [
                (Kind::Model, sharded::MODEL_INDEX_FILE),
                (Kind::Optimizer, sharded::OPTIMIZER_INDEX_FILE),
            ] {
                if let Some(json) = sharded::index_json(kind, &plan, g.pp * g.tp) {
                    crate::atomic_write::write_bytes(&tmp.join(name), json.as_bytes())?;
                }
            }
            let written = checkpoint::finish_checkpoint(
                &self.out,
                &tmp,
                done,
                &state,
                files,
                self.opts.keep_last,
            )?;
            path = Some(written);
        }
        // No rank runs ahead of an incomplete checkpoint.
        dist.world.barrier();
        // Max over ranks of: peak before, peak after, and each rank's after/before ratio.
        let after = peak_rss_bytes().unwrap_or(0) as f64;
        let mut rss = [
            rss_before as f64,
            after,
            after / (rss_before as f64).max(1.0),
        ];
        dist.world.allreduce_f64(&mut rss, ReduceOp::Max);
        if let (Some(w), Some(p)) = (self.metrics.as_mut(), &path) {
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            w.event(
                "checkpoint",
                &json!({"step": done, "path": p, "ms": ms,
                        "peak_rss_before_bytes": rss[0], "peak_rss_after_bytes": rss[1],
                        "peak_rss_growth": rss[2]}),
            )?;
        }
        self.watch.record_checkpoint(t0.elapsed());
        self.totals.add_outside("checkpoint", t0);
        self.totals.last_checkpoint =
            Some(path.unwrap_or_else(|| self.out.join(checkpoint::checkpoint_dir_name(done))));
        Ok(())
    }

    /// Stops early when any rank was signalled or its deadline is near: writes a checkpoint
    /// (unless this step already did) and ends with [`EXIT_CHECKPOINTED`].
    pub fn stop(&mut self, done: u64, is_last: bool, checkpointed: bool) -> Result<()> {
        let reason = self.watch.should_stop();
        let mut flag = [reason.is_some() as u8 as f64];
        self.dist.world.allreduce_f64(&mut flag, ReduceOp::Max);
        if flag[0] == 0.0 || is_last {
            return Ok(());
        }
        if !checkpointed {
            self.save(done)?;
        }
        self.progress.finish();
        let why = reason.unwrap_or_else(|| "another rank was told to stop".into());
        let last = &self.totals.last_checkpoint;
        if let Some(w) = self.metrics.as_mut() {
            w.event(
                "stopped",
                &json!({"step": done, "reason": why, "checkpoint": last}),
            )?;
        }
        let ck = last
            .as_ref()
            .map(|c| c.display().to_string())
            .unwrap_or_default();
        Err(ExitError {
            code: EXIT_CHECKPOINTED,
            message: format!(
                "stopped after step {done} of {} ({why}); checkpoint {ck} is complete. \
                 Resubmit with --resume auto to continue",
                self.cfg.train.steps
            ),
        }
        .into())
    }

    /// The end of a completed run: the per-op breakdown (stderr and `breakdown.json`), peak
    /// RSS and the `end` event.
    pub fn finish(mut self) -> Result<TrainOutcome> {
        self.progress.finish();
        // The run's peak, read before the breakdown's roofs: on a CPU those time a memory
        // triad whose arrays (larger than the last-level cache) would count as the run's.
        let rss = crate::metrics::machine::peak_rss_bytes();
        let tot = &self.totals;
        let root = self.dist.is_root();
        if tot.timed_steps > 0 && root {
            let ops = [registry::ops(self.model.config().arch), &trainer::OPS];
            let mut b = if self.dist.is_parallel() {
                let mut b =
                    Breakdown::from_totals(&tot.rank_timers[0], tot.step_ms, tot.timed_steps, &ops);
                b.set_rank_spread(&tot.rank_timers[1], &tot.rank_timers[2]);
                // Every rank runs the same ops (tensor-parallel ones on its shard) unless
                // pipeline stages differ: this rank's work over the mean time is a rank's rate.
                if self.dist.grid.pp == 1 {
                    b.set_work(&self.timers.work_totals());
                }
                b
            } else {
                self.timers.breakdown(tot.step_ms, tot.timed_steps, &ops)
            };
            b.outside = tot.outside.clone();
            // Roofs for the rates (fine timers): the MFU peak and this rank's memory
            // bandwidth (on a CPU a triad measured now by this rank alone, the others
            // waiting: on a node shared by several ranks, more than each gets while all run).
            if b.rows.iter().any(|r| r.work.is_some()) {
                b.set_roofs(Roofs {
                    gflops: Some(self.peak_flops / 1e9),
                    gbs: self.model.backend().peak_gbs().map(|m| m.0),
                });
            }
            let whose = if self.dist.is_parallel() {
                format!("mean over {} ranks", self.dist.grid.world_size)
            } else {
                "one process".into()
            };
            eprintln!(
                "\nper-op breakdown (ms per step, {whose}, {} steps):\n{}",
                tot.timed_steps,
                b.to_table()
            );
            b.write_json(self.out.join("breakdown.json"))?;
        }
        if let Some(w) = self.metrics.as_mut() {
            if let Some(rss) = rss {
                let workspace = self.model.backend().workspace_bytes() as f64;
                let ws = if workspace > 0.0 {
                    format!(" + the backend's workspace {}", mib(workspace))
                } else {
                    String::new()
                };
                eprintln!(
                    "peak RSS {} = {:.2} x (params+grads+AdamW + activations{ws})",
                    mib(rss as f64),
                    rss as f64 / (self.memory.state() + self.memory.activations() + workspace)
                );
            }
            let skipped_bad = self.source.skipped_bad_samples();
            if skipped_bad > 0 {
                eprintln!(
                    "skipped {skipped_bad} bad samples (--skip-bad-samples; rank 0's streams)"
                );
            }
            w.event(
                "end",
                &json!({"steps": self.cfg.train.steps, "last_loss": tot.last_loss,
                        "val_loss": tot.last_val, "peak_rss_bytes": rss,
                        "workspace_bytes": self.model.backend().workspace_bytes(),
                        "checkpoint": tot.last_checkpoint,
                        "skipped_bad_samples": skipped_bad}),
            )?;
            if let Some(c) = &tot.last_checkpoint {
                eprintln!("checkpoint: {}", c.display());
            }
        }
        Ok(TrainOutcome {
            out_dir: self.out,
            steps_done: self.cfg.train.steps as u64,
            last_loss: tot.last_loss,
            last_checkpoint: tot.last_checkpoint.clone(),
            val_loss: tot.last_val,
        })
    }

    /// Rank 0: opens `metrics.jsonl` (appending when resuming), writes its header line and
    /// prints the run summary.
    fn write_header(
        &mut self,
        machine: &MachineInfo,
        init_desc: &str,
        flops_step: f64,
    ) -> Result<()> {
        // Appended, never truncated: a new run in a folder whose earlier run left metrics but
        // no checkpoint (killed before its first) keeps those lines, after a `restarted` event
        // that readers take as the start of a new history.
        let metrics_path = self.out.join("metrics.jsonl");
        let earlier = std::fs::metadata(&metrics_path).is_ok_and(|m| m.len() > 0);
        let mut w = MetricsWriter::append(&metrics_path)?;
        if earlier && self.start_step == 0 {
            eprintln!(
                "notice: {} holds an earlier run's lines (it wrote no checkpoint); this run \
                 starts over from step 0 and appends after a `restarted` event",
                metrics_path.display()
            );
            w.event(
                "restarted",
                &json!({"reason": "a new run from step 0 in a folder with earlier metrics"}),
            )?;
        }
        w.header(&self.header_json(machine, init_desc, flops_step))?;
        self.metrics = Some(w);
        self.tensorboard = Some(TensorBoardWriter::create(&self.out)?);
        self.print_summary(machine, init_desc);
        self.print_notes();
        Ok(())
    }

    /// The header line of `metrics.jsonl`: the configuration, layout, machine, the model's op
    /// forms and the memory and FLOP accounting.
    fn header_json(&self, machine: &MachineInfo, init_desc: &str, flops_step: f64) -> Value {
        let (opts, dist, t) = (&self.opts, self.dist, &self.cfg.train);
        let grid = dist.grid;
        let stages = &self.stages;
        let mem = self.memory;
        let global_batch = t.batch_size * grid.dp;
        let params_n = self.full_table.elements();
        let mut header = json!({
            "config": self.cfg,
            "config_name": opts.config_name,
            "data": self.data,
            "init": init_desc,
            "machine": machine,
            "layout": {
                "world": grid.world_size, "tp": grid.tp, "dp": grid.dp, "pp": grid.pp,
                "stage_layers": stages.iter().map(|s| [s.layers.start, s.layers.end]).collect::<Vec<_>>(),
                "nodes": dist.nodes,
                "ranks_per_node": grid.world_size / dist.nodes.max(1), "threads": self.threads,
                "zero": opts.zero, "data_ranks": self.saved_layout.data_ranks,
                "micro_batches": opts.micro_batches,
                "recompute": opts.recompute.name(),
                "loss_chunk": opts.loss_chunk,
                "global_batch": global_batch, "bucket_mb": opts.bucket_mb,
                "buckets": self.sync.buckets(),
                "bucket_memory": self.sync.staging(),
            },
            "backend": self.model.backend().name(),
            "precision": t.precision.name(),
            "kernels": self.model.backend().kernel_settings().into_iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "device": self.model.backend().describe(),
            "peak_gflops_per_rank": self.peak_flops / 1e9,
            "parameters": params_n,
            "memory": {
                "per_rank": true,
                "params_grads_bytes": mem.params_grads,
                "adam_moment_bytes": mem.moments,
                "params_grads_adam_bytes": mem.state(),
                "activation_bytes": mem.activations(),
                "workspace_bound_bytes": mem.workspace,
                "bucket_sums_bytes": self.sync.device_sums_bytes(),
            },
            "flops_per_step": flops_step,
            "flops_per_step_per_rank": self.flops_per_rank,
            "start_step": self.start_step,
            "fugu_version": env!("CARGO_PKG_VERSION"),
        });
        for f in self.model.forms() {
            header[f.key] = json!(f.form);
        }
        header
    }

    /// The run summary's first lines: model and batch, layout, machine, memory.
    fn print_summary(&self, machine: &MachineInfo, init_desc: &str) {
        let (opts, dist, t) = (&self.opts, self.dist, &self.cfg.train);
        let grid = dist.grid;
        let mem = self.memory;
        let global_batch = t.batch_size * grid.dp;
        let params_n = self.full_table.elements();
        // A model taken from a checkpoint (--init-from) is named by its architecture; the
        // config still gives the training settings.
        let model_name = if self.cfg.model == opts.config.model {
            opts.config_name.clone()
        } else {
            format!(
                "a {} model with {}'s training settings",
                self.cfg.model.arch.name(),
                opts.config_name
            )
        };
        eprintln!(
            "fugu train: {} ({:.2}M parameters), B={} per rank x dp {} = {} sequences of T={}, steps={} | {} | out {}",
            model_name,
            params_n as f64 / 1e6,
            t.batch_size,
            grid.dp,
            global_batch,
            t.seq_len,
            t.steps,
            init_desc,
            self.out.display()
        );
        if dist.is_parallel() {
            eprintln!(
                "  layout: {} ranks on {} node(s) = pp {} x dp {} x tp {}, ZeRO-{}, {} gradient buckets of {} MiB, {} data streams",
                grid.world_size, dist.nodes, grid.pp, grid.dp, grid.tp, opts.zero, self.sync.buckets(),
                opts.bucket_mb, self.saved_layout.data_ranks
            );
        }
        eprintln!(
            "  machine: {} | {} threads per rank ({}) | peak {:.0} GFLOP/s per rank ({})",
            machine.cpu_model,
            self.threads,
            machine.layout,
            machine.peak_gflops,
            machine.peak_source
        );
        eprintln!(
            "  memory per rank: params+grads 8 B x {:.2}M = {}, AdamW moments 8 B x {:.2}M = {}{}, activations {} (forward {} + backward scratch {}){}, expected total {}",
            mem.params_grads / 8e6,
            mib(mem.params_grads),
            mem.moments / 8e6,
            mib(mem.moments),
            if opts.zero == 1 && grid.dp > 1 { format!(" (ZeRO-1: 1/{} of the shard)", grid.dp) } else { String::new() },
            mib(mem.activations()),
            mib(mem.forward),
            mib(mem.backward),
            if mem.workspace > 0.0 { format!(", backend workspace at most {}", mib(mem.workspace)) } else { String::new() },
            mib(mem.state() + mem.step())
        );
    }

    /// The summary's notes on what this run does differently: pipeline stages, micro-batches,
    /// precision, the model's op forms, a deadline; then the data.
    fn print_notes(&self) {
        let (opts, grid, t) = (&self.opts, self.dist.grid, &self.cfg.train);
        let stages = &self.stages;
        if grid.pp > 1 {
            let (p, m) = (grid.pp as f64, opts.micro_batches as f64);
            let ranges: Vec<String> = stages
                .iter()
                .map(|s| format!("{}..{}", s.layers.start, s.layers.end))
                .collect();
            eprintln!(
                "  pipeline: {} stages, blocks {} (the first with the embeddings, the last with the LM head), 1F1B over {} micro-batches: ideal bubble (p-1)/(m+p-1) = {:.0}%; memory above is stage 0's",
                grid.pp,
                ranges.join(", "),
                opts.micro_batches,
                100.0 * (p - 1.0) / (m + p - 1.0)
            );
            if opts.micro_batches < grid.pp {
                eprintln!(
                    "  warning: --micro-batches {} < --pp {}: stages idle most of each step; use at least {} (4x as many keeps the bubble under 20%)",
                    opts.micro_batches, grid.pp, grid.pp
                );
            }
        }
        if opts.micro_batches > 1 {
            eprintln!(
                "  micro-batches: {} of {} sequences per rank, gradients accumulated before each optimizer step",
                opts.micro_batches,
                t.batch_size / opts.micro_batches
            );
        }
        if t.precision != Precision::Fp32 {
            let scaling = if t.precision == Precision::Fp16 {
                ", dynamic loss scaling"
            } else {
                ""
            };
            let cpu_note = if self.model.backend().name() == "cpu" {
                ": on the CPU backend stored in 16 bits, computed in f32 (the rounding reference for a GPU); faster than fp32 only where the CPU's 16-bit GEMM kernel is (machine.gemm_kernels in the metrics header)"
            } else {
                ""
            };
            eprintln!(
                "  precision: {} activations and GEMM operands, f32 master weights, gradients and optimizer{scaling}{cpu_note}",
                t.precision.name()
            );
        }
        for note in self.model.forms().into_iter().filter_map(|f| f.note) {
            eprintln!("  {note}");
        }
        if let Some(d) = self.watch.deadline() {
            eprintln!(
                "  deadline: {} (in {:.0} s): a checkpoint is written and the run stops (exit code {EXIT_CHECKPOINTED}) before it",
                d.source,
                d.at_unix - std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |x| x.as_secs_f64())
            );
        }
        eprintln!(
            "  data: {} ({} tokens, {:.1} batches/epoch per stream)",
            self.data,
            self.source.info().tokens,
            self.source.info().batches_per_epoch
        );
    }
}

/// A value only the last pipeline stage computes (the loss), on every stage: summed over the
/// pipeline, the other stages adding 0. With one stage, `x` itself.
/// Warns when the ranks on a node times their compute threads exceed its CPUs: a thread team
/// then waits at every barrier for members the kernel has descheduled, and steps slow down
/// several-fold.
fn warn_if_oversubscribed(dist: &Dist, threads: usize) {
    // SAFETY: sysconf reads a system constant; no memory is passed.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let Ok(cpus) = usize::try_from(online) else {
        return;
    };
    let per_node = dist.grid.world_size.div_ceil(dist.nodes.max(1));
    if cpus > 0 && per_node * threads > cpus {
        eprintln!(
            "warning: {per_node} rank(s) per node × {threads} compute threads = {} threads on \
             {cpus} CPUs: oversubscribed, each step waits for descheduled threads (use \
             --threads {})",
            per_node * threads,
            (cpus / per_node).max(1)
        );
    }
}

/// The mean loss over the first `batches` batches of `val_data` (read with `loader`), averaged
/// over data-parallel ranks: each batch run as `micro` micro-batches of `batch_size / micro`
/// rows of `seq_len` (the activations are sized for one) through the pipeline's forward pass.
/// What `fugu train` logs as `val_loss` and `fugu eval` prints.
pub(super) fn validation_loss<B: Backend>(
    model: &mut dyn Model<B>,
    pipeline: &mut Pipeline,
    dist: &Dist,
    timers: &Timers,
    (val_data, loader, batches): (&str, &LoaderConfig, usize),
    (micro, batch_size, seq_len): (usize, usize, usize),
) -> Result<f64> {
    let rows = batch_size / micro;
    let v = data::eval_loss(val_data, loader, batches, |w| {
        model.set_batches(w, micro, rows, seq_len)?;
        let sum = pipeline.forward_only(model, micro, timers);
        Ok((last_stage_sum(dist, sum) / micro as f64) as f32)
    })?;
    Ok(dist.dp_mean(v))
}

fn last_stage_sum(dist: &Dist, x: f64) -> f64 {
    if dist.grid.pp == 1 {
        return x;
    }
    let mut v = [x];
    dist.pp.allreduce_f64(&mut v, ReduceOp::Sum);
    v[0]
}

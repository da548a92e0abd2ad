//! `fugu train`: the training loop, with metrics, timers, evaluation and checkpoints.

pub mod data;
pub mod dist;
pub mod dump;
pub mod layout;
pub mod schedule;
pub mod state;
pub mod stop;

use crate::backend::{Backend, CpuBackend};
use crate::checkpoint;
use crate::config::RunConfig;
use crate::metrics::flops::megatron_flops_per_step;
use crate::metrics::jsonl::{MetricsWriter, StepRecord};
use crate::metrics::machine::MachineInfo;
use crate::metrics::progress::{Progress, StepLine};
use crate::metrics::timers::{Breakdown, TimerLevel, Timers};
use crate::model::init::init_params;
use crate::model::table::gpt2_params;
use crate::model::{Gpt2, OptimStep, TpRank};
use crate::parallel::grad_sync::GradSync;
use crate::parallel::{timer_stats, ReduceOp};
use anyhow::{bail, Context, Result};
use dist::Dist;
use fugu_io::LoaderConfig;
use serde_json::json;
use state::{SavedLayout, TrainState, STATE_FORMAT};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Exit code of a run stopped because the loss or the gradients were not finite.
pub const EXIT_NONFINITE: u8 = 3;
/// Exit code of a run that wrote a checkpoint and stopped early because of a stop signal
/// (SIGUSR1, SIGTERM) or its deadline: resubmit with `--resume auto` to continue.
pub const EXIT_CHECKPOINTED: u8 = 4;

/// Everything `fugu train` was asked to do, after command-line parsing.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    /// The configuration after overrides (ignored for the model when resuming).
    pub config: RunConfig,
    /// Name of the config (for the default output folder).
    pub config_name: String,
    /// `--data`; `None` = the bundled corpus.
    pub data: Option<String>,
    /// `--val-data`; `None` = the validation split of `data` when it has one.
    pub val_data: Option<String>,
    pub shuffle: bool,
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
    /// ZeRO stage (0 or 1).
    pub zero: u8,
    /// Data-parallel gradient bucket size in MiB.
    pub bucket_mb: f64,
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

/// True for a checkpoint directory itself (as opposed to a run directory holding `ckpt-*`).
fn is_checkpoint_dir(p: &Path) -> bool {
    p.join(checkpoint::STATE_FILE).exists()
}

/// Resolves `--resume`: a checkpoint directory, a run directory (its newest checkpoint), or
/// `auto` (the newest checkpoint in `out`, if any).
fn resume_point(resume: Option<&str>, out: &Path) -> Result<Option<PathBuf>> {
    let Some(r) = resume else { return Ok(None) };
    if r == "auto" {
        return checkpoint::latest_checkpoint(out);
    }
    let p = PathBuf::from(r);
    if is_checkpoint_dir(&p) {
        return Ok(Some(p));
    }
    match checkpoint::latest_checkpoint(&p)? {
        Some(c) => Ok(Some(c)),
        None => bail!(
            "--resume {r}: not a checkpoint directory (no state.json) and holds no ckpt-* checkpoints"
        ),
    }
}

fn default_out(name: &str) -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    PathBuf::from("runs").join(format!("{name}-{secs}"))
}

/// Peak resident set size of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
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

/// Runs `fugu train` in the job described by `dist` (one process: [`Dist::serial`]).
pub fn run(opts: TrainOptions, dist: &mut Dist) -> Result<TrainOutcome> {
    let threads = set_threads(opts.threads)?;
    let root = dist.is_root();
    stop::install_handlers();
    let mut watch = stop::StopWatch::new(
        stop::find_deadline(opts.deadline.as_deref())?,
        std::time::Duration::from_secs_f64(opts.deadline_margin.max(0.0)),
    );
    let out = match (&opts.out, &opts.resume) {
        (Some(o), _) => o.clone(),
        (None, Some(r)) if r != "auto" => {
            let p = PathBuf::from(r);
            if is_checkpoint_dir(&p) {
                p.parent().map(Path::to_path_buf).unwrap_or_default()
            } else {
                p
            }
        }
        _ if dist.is_parallel() => bail!(
            "--out is required with several MPI ranks (the default folder name contains the \
             start time, which differs between ranks)"
        ),
        _ => default_out(&opts.config_name),
    };
    let resume_from = resume_point(opts.resume.as_deref(), &out)?;
    if resume_from.is_none() && checkpoint::latest_checkpoint(&out)?.is_some() {
        bail!(
            "{} already holds checkpoints of another run; pass --resume auto to continue it \
             or --out to start a new one",
            out.display()
        );
    }
    // Everyone has looked at `out` before rank 0 changes it.
    dist.world.barrier();
    if root {
        std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        checkpoint::clean_stale_tmp(&out)?;
    }

    // Configuration: a resumed run keeps its model; run-length and optimiser fields come from
    // the command line when given there (they are already merged into opts.config).
    let mut cfg = opts.config.clone();
    let mut start_state: Option<TrainState> = None;
    if let Some(ck) = &resume_from {
        let st: TrainState = checkpoint::read_state(ck)?;
        if st.format != STATE_FORMAT {
            bail!(
                "{}: state.json format {:?}, expected {STATE_FORMAT:?}",
                ck.display(),
                st.format
            );
        }
        cfg.model = st.config.model.clone();
        start_state = Some(st);
    }
    cfg.validate()?;
    let m = cfg.model.clone();
    let t = cfg.train.clone();
    if opts.zero > 1 {
        bail!("--zero {}: only stages 0 and 1 exist", opts.zero);
    }
    dist.make_grid(opts.tp, &m)?;
    let grid = dist.grid;
    // The bundled corpus is tokenised once, by rank 0, before anyone reads it.
    let data = match &start_state {
        Some(st) if opts.data.is_none() => st.data.clone(),
        _ if root => data::resolve_data(opts.data.as_deref(), false)?,
        _ => String::new(),
    };
    let data = broadcast_string(dist, data);
    let data_ranks = opts
        .data_ranks
        .or_else(|| {
            let saved = start_state.as_ref()?.layout?.data_ranks;
            saved.is_multiple_of(grid.dp).then_some(saved)
        })
        .unwrap_or(grid.dp);

    // Model: this rank's tensor-parallel shard, its gradient buckets and (ZeRO-1) its block of
    // the AdamW moments.
    let mut model = Gpt2::new(
        &m,
        TpRank {
            rank: grid.tp_rank,
            size: grid.tp,
        },
        CpuBackend::new(),
    )?;
    model.set_tp_comm(dist.tp.clone())?;
    let bucket_floats = ((opts.bucket_mb * (1 << 20) as f64 / 4.0) as usize).max(1);
    let mut sync = GradSync::new(&model.table, dist.dp.clone(), bucket_floats, opts.zero == 1);
    model.set_owned(sync.owned(model.table.total()))?;
    let full_table = gpt2_params(&m, 1)?;
    let init_desc;
    if let Some(ck) = &resume_from {
        let mut host = vec![0.0f32; full_table.total()];
        checkpoint::load_hf(ck)?.copy_into(&full_table, &mut host)?;
        let mut mm = vec![0.0f32; full_table.total()];
        let mut vv = vec![0.0f32; full_table.total()];
        checkpoint::load_optimizer(ck, &full_table, &mut mm, &mut vv)?;
        layout::load_full(&mut model, &full_table, &host, Some((&mm, &vv)))?;
        init_desc = format!("resumed from {}", ck.display());
    } else if let Some(dir) = &opts.init_from {
        let hf = checkpoint::load_hf(dir)?;
        if hf.config != m {
            bail!(
                "--init-from {}: its config.json ({:?}) does not match the run's model ({:?}); \
                 use a config with the same model section",
                dir.display(),
                hf.config,
                m
            );
        }
        let mut host = vec![0.0f32; full_table.total()];
        hf.copy_into(&full_table, &mut host)?;
        layout::load_full(&mut model, &full_table, &host, None)?;
        init_desc = format!("initialised from {}", dir.display());
    } else {
        let host = init_params(&m, &full_table, t.seed);
        layout::load_full(&mut model, &full_table, &host, None)?;
        init_desc = format!("random init (seed {})", t.seed);
    }

    // Data: B rows per data-parallel rank.
    let mut lcfg = LoaderConfig::train(t.batch_size, t.seq_len, 0, 1, t.seed);
    lcfg.shuffle = opts.shuffle;
    lcfg.vocab_size = m.vocab_size as u32;
    let mut source = data::BatchSource::open(
        &data,
        &lcfg,
        grid.dp_rank,
        grid.dp,
        data_ranks,
        start_state.as_ref().map(|s| &s.cursor),
    )?;
    let val_data = opts.val_data.clone().unwrap_or_else(|| data.clone());
    let mut vcfg = LoaderConfig::val(t.batch_size, t.seq_len, grid.dp_rank, grid.dp);
    vcfg.vocab_size = m.vocab_size as u32;

    // Header: config, machine, layout, memory accounting.
    let machine = MachineInfo::detect(threads)?;
    let params_n = full_table.elements();
    let (act_f, gact_f) = model.activation_floats(t.batch_size, t.seq_len);
    let local_n = model.table.total() as f64;
    let moment_n: f64 = model.owned().iter().map(|o| o.flat.len() as f64).sum();
    let state_bytes = 8.0 * local_n + 8.0 * moment_n;
    let act_bytes = 4.0 * (act_f + gact_f) as f64;
    let global_batch = t.batch_size * grid.dp;
    let flops_step =
        megatron_flops_per_step(global_batch, t.seq_len, m.n_layer, m.n_embd, m.vocab_size);
    let flops_rank = flops_step / grid.world_size as f64;
    let start_step = start_state.as_ref().map_or(0, |s| s.step);
    let timers = Timers::new(opts.timers);
    let mut metrics = None;
    if root {
        let metrics_path = out.join("metrics.jsonl");
        let mut w = if start_step > 0 {
            MetricsWriter::append(&metrics_path)?
        } else {
            MetricsWriter::create(&metrics_path)?
        };
        let header = json!({
            "config": cfg,
            "config_name": opts.config_name,
            "data": data,
            "init": init_desc,
            "machine": machine,
            "layout": {
                "world": grid.world_size, "tp": grid.tp, "dp": grid.dp, "nodes": dist.nodes,
                "ranks_per_node": grid.world_size / dist.nodes.max(1), "threads": threads,
                "zero": opts.zero, "data_ranks": data_ranks, "global_batch": global_batch,
                "bucket_mb": opts.bucket_mb, "buckets": sync.buckets(),
            },
            "backend": model.be.name(),
            "parameters": params_n,
            "memory": {
                "per_rank": true,
                "params_grads_bytes": 8.0 * local_n,
                "adam_moment_bytes": 8.0 * moment_n,
                "params_grads_adam_bytes": state_bytes,
                "activation_bytes": act_bytes,
            },
            "flops_per_step": flops_step,
            "flops_per_step_per_rank": flops_rank,
            "start_step": start_step,
            "fugu_version": env!("CARGO_PKG_VERSION"),
        });
        w.header(&header)?;
        metrics = Some(w);
        eprintln!(
            "fugu train: {} ({:.2}M parameters), B={} per rank x dp {} = {} sequences of T={}, steps={} | {} | out {}",
            opts.config_name,
            params_n as f64 / 1e6,
            t.batch_size,
            grid.dp,
            global_batch,
            t.seq_len,
            t.steps,
            init_desc,
            out.display()
        );
        if dist.is_parallel() {
            eprintln!(
                "  layout: {} ranks on {} node(s) = dp {} x tp {}, ZeRO-{}, {} gradient buckets of {} MiB, {} data streams",
                grid.world_size, dist.nodes, grid.dp, grid.tp, opts.zero, sync.buckets(), opts.bucket_mb, data_ranks
            );
        }
        eprintln!(
            "  machine: {} | {} threads per rank ({}) | peak {:.0} GFLOP/s per rank ({})",
            machine.cpu_model, threads, machine.layout, machine.peak_gflops, machine.peak_source
        );
        eprintln!(
            "  memory per rank: params+grads 8 B x {:.2}M = {}, AdamW moments 8 B x {:.2}M = {}{}, activations {} (forward {} + backward scratch {}), expected total {}",
            local_n / 1e6,
            mib(8.0 * local_n),
            moment_n / 1e6,
            mib(8.0 * moment_n),
            if opts.zero == 1 && grid.dp > 1 { format!(" (ZeRO-1: 1/{} of the shard)", grid.dp) } else { String::new() },
            mib(act_bytes),
            mib(4.0 * act_f as f64),
            mib(4.0 * gact_f as f64),
            mib(state_bytes + act_bytes)
        );
        if let Some(d) = watch.deadline() {
            eprintln!(
                "  deadline: {} (in {:.0} s): a checkpoint is written and the run stops (exit code {EXIT_CHECKPOINTED}) before it",
                d.source,
                d.at_unix - std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |x| x.as_secs_f64())
            );
        }
        eprintln!(
            "  data: {} ({} tokens, {:.1} batches/epoch per stream)",
            data,
            source.info().tokens,
            source.info().batches_per_epoch
        );
    }

    let mut progress = Progress::new(t.steps as u64, start_step, opts.tty && root);
    if !root {
        progress = progress.silenced();
    }
    progress.set_log_every(opts.log_every.max(1) as u64);
    let mut tokens_seen = start_state.as_ref().map_or(0, |s| s.tokens_seen);
    let mut skipped = start_state.as_ref().map_or(0, |s| s.skipped_nonfinite);
    let mut last_ckpt: Option<PathBuf> = resume_from.clone();
    let mut last_loss = f32::NAN;
    let mut last_val = None;
    let mut total_ms = 0.0f64;
    let mut timed_steps = 0u64;
    let tokens_per_step = (global_batch * t.seq_len) as u64;
    let peak = machine.peak_gflops * 1e9;
    let saved_layout = SavedLayout {
        tp: grid.tp,
        dp: grid.dp,
        zero: opts.zero,
        data_ranks,
    };
    let norm_comm = if opts.zero == 1 {
        dist.world.clone()
    } else {
        dist.tp.clone()
    };
    let mut window = Vec::new();
    // Rank 0: run totals of the per-step mean, min and max over ranks of every timer.
    let mut rank_totals: [std::collections::BTreeMap<String, f64>; 3] = Default::default();

    // Writes ckpt-DONE (gathered on rank 0); every rank returns once it is complete.
    #[allow(clippy::too_many_arguments)]
    let write_ckpt = |model: &Gpt2<CpuBackend>,
                      sync: &GradSync,
                      done: u64,
                      cursor: fugu_io::Cursor,
                      tokens_seen: u64,
                      skipped: u64,
                      metrics: &mut Option<MetricsWriter>,
                      watch: &mut stop::StopWatch|
     -> Result<PathBuf> {
        let t0 = Instant::now();
        let _g = timers.scope("checkpoint", TimerLevel::Coarse);
        let full = layout::gather_full(model, sync, dist, &full_table)?;
        let mut path = None;
        if let Some([p, mm, vv]) = full {
            let state = TrainState {
                format: STATE_FORMAT.into(),
                step: done,
                config: cfg.clone(),
                data: data.clone(),
                cursor,
                tokens_seen,
                skipped_nonfinite: skipped,
                threads,
                fugu_version: env!("CARGO_PKG_VERSION").into(),
                layout: Some(saved_layout),
            };
            let written = checkpoint::write_checkpoint(
                &out,
                done,
                &m,
                &full_table,
                &p,
                Some((&mm, &vv)),
                done,
                &state,
                opts.keep_last,
            )?;
            if let Some(w) = metrics.as_mut() {
                w.event("checkpoint", &json!({"step": done, "path": written}))?;
            }
            path = Some(written);
        }
        // No rank runs ahead of an incomplete checkpoint.
        dist.world.barrier();
        watch.record_checkpoint(t0.elapsed());
        Ok(path.unwrap_or_else(|| out.join(checkpoint::checkpoint_dir_name(done))))
    };

    for step in start_step..t.steps as u64 {
        let t0 = Instant::now();
        let bytes0 = dist.payload_bytes();
        {
            let _g = timers.scope("forward:batch-generator", TimerLevel::Coarse);
            source
                .next_into(&mut window)
                .with_context(|| format!("reading training data {data} at step {step}"))?;
        }
        model.set_batch(&window, t.batch_size, t.seq_len)?;
        model.zero_grad();
        let local_loss = model.forward(&timers, true);
        sync.begin_step();
        let grads = model.grads;
        model.backward_with(&timers, &mut |be, from| sync.ready(be, grads, from));
        {
            let _g = timers.scope("allreduce-params", TimerLevel::Coarse);
            sync.finish(&mut model.be, model.grads);
        }
        let loss = dist.dp_mean(local_loss as f64) as f32;
        if step == start_step && start_step == 0 {
            if let Some(path) = &opts.dump_grads {
                if dist.is_parallel() {
                    bail!("--dump-grads works with one process only");
                }
                let g = model.be.host(model.be.whole(model.grads));
                dump::dump_grads(path, &m, &model.table, g)?;
                eprintln!("  wrote first-step gradients to {}", path.display());
            }
        }
        let optimizer_timer = timers.scope("optimizer", TimerLevel::Coarse);
        let mut sq = [model.grad_sq_sum(&timers)];
        norm_comm.allreduce_f64(&mut sq, ReduceOp::Sum);
        let norm = sq[0].sqrt();
        let lr = schedule::lr_at(&t, step as usize);
        if !loss.is_finite() || !norm.is_finite() {
            // Loss and norm are reduced over all ranks, so every rank takes this branch.
            if let Some(w) = metrics.as_mut() {
                w.event(
                    "nonfinite",
                    &json!({"step": step, "loss": loss, "grad_norm": norm}),
                )?;
            }
            if skipped < opts.skip_nonfinite {
                skipped += 1;
                progress.message(&format!(
                    "step {step}: non-finite loss {loss} / grad norm {norm}: update skipped ({skipped} of at most {})",
                    opts.skip_nonfinite
                ));
                continue;
            }
            progress.finish();
            let keep = match &last_ckpt {
                Some(c) => format!("the last good checkpoint is {}", c.display()),
                None => "no checkpoint was written yet".to_string(),
            };
            return Err(ExitError {
                code: EXIT_NONFINITE,
                message: format!(
                    "non-finite loss ({loss}) or gradient norm ({norm}) at step {step}; parameters were not updated and {keep}. \
                     Lower --lr, check the data, or pass --skip-nonfinite N to skip up to N such steps"
                ),
            }
            .into());
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
        );
        drop(optimizer_timer);
        if sync.active() && opts.zero == 1 {
            let _g = timers.scope("allgather-params", TimerLevel::Coarse);
            sync.gather_params(&mut model.be, model.params);
        }
        last_loss = loss;
        tokens_seen += tokens_per_step;
        let step_ms = t0.elapsed().as_secs_f64() * 1e3;
        watch.record_step(t0.elapsed());
        let done = step + 1;
        let step_bytes = dist.payload_bytes() - bytes0;
        let timer_map = timers.take_step();
        let stats = if dist.is_parallel() {
            timer_stats::gather(&*dist.world, &timer_map)
        } else {
            None
        };
        total_ms += step_ms;
        timed_steps += 1;
        let secs = step_ms / 1e3;
        let flops = flops_rank / secs;
        if let Some(w) = metrics.as_mut() {
            let mut rec = StepRecord {
                step: done,
                loss: loss as f64,
                lr,
                grad_norm: norm,
                tokens: tokens_seen,
                tokens_per_s: tokens_per_step as f64 / secs,
                step_ms,
                tflops_per_process: flops / 1e12,
                peak_pct: 100.0 * flops / peak,
                timers: timer_map,
                ..Default::default()
            };
            if let Some(st) = stats {
                for (tot, m) in rank_totals.iter_mut().zip([&st.mean, &st.min, &st.max]) {
                    for (k, v) in m {
                        *tot.entry(k.clone()).or_default() += v;
                    }
                }
                rec.timers = st.mean;
                rec.timers_min = st.min;
                rec.timers_max = st.max;
                rec.comm_bytes = Some(step_bytes);
            }
            w.step(&rec)?;
        }
        progress.update(&StepLine {
            step: done,
            loss: loss as f64,
            lr,
            tokens_per_s: tokens_per_step as f64 / secs,
            step_ms,
            tflops: flops / 1e12,
            eta_secs: None,
        });

        let is_last = done == t.steps as u64;
        if t.eval_every > 0 && (done % t.eval_every as u64 == 0 || is_last) {
            let _g = timers.scope("eval", TimerLevel::Coarse);
            let v = data::eval_loss(&val_data, &vcfg, opts.eval_batches, |w| {
                model.set_batch(w, t.batch_size, t.seq_len)?;
                Ok(model.forward(&timers, false))
            })?;
            if let Some(v) = v {
                let v = dist.dp_mean(v);
                if let Some(w) = metrics.as_mut() {
                    w.eval(done, v)?;
                }
                progress.message(&format!("step {done}: val_loss {v:.4}"));
                last_val = Some(v);
            }
        }
        let save_now = |metrics: &mut Option<MetricsWriter>, watch: &mut stop::StopWatch| {
            write_ckpt(
                &model,
                &sync,
                done,
                source.cursor(),
                tokens_seen,
                skipped,
                metrics,
                watch,
            )
        };
        let want_ckpt = (t.ckpt_every > 0 && done % t.ckpt_every as u64 == 0) || is_last;
        if want_ckpt {
            last_ckpt = Some(save_now(&mut metrics, &mut watch)?);
        }
        // Evaluation and checkpoint time count in the run totals, not in the next step.
        timers.fold_into_totals();
        // Stop early (signal or deadline) when any rank asks to.
        let reason = watch.should_stop();
        let mut flag = [reason.is_some() as u8 as f64];
        dist.world.allreduce_f64(&mut flag, ReduceOp::Max);
        if flag[0] > 0.0 && !is_last {
            if !want_ckpt {
                last_ckpt = Some(save_now(&mut metrics, &mut watch)?);
            }
            progress.finish();
            let why = reason.unwrap_or_else(|| "another rank was told to stop".into());
            if let Some(w) = metrics.as_mut() {
                w.event(
                    "stopped",
                    &json!({"step": done, "reason": why, "checkpoint": last_ckpt}),
                )?;
            }
            let ck = last_ckpt
                .as_ref()
                .map(|c| c.display().to_string())
                .unwrap_or_default();
            return Err(ExitError {
                code: EXIT_CHECKPOINTED,
                message: format!(
                    "stopped after step {done} of {} ({why}); checkpoint {ck} is complete. \
                     Resubmit with --resume auto to continue",
                    t.steps
                ),
            }
            .into());
        }
    }
    progress.finish();

    if timed_steps > 0 && root {
        let b = if dist.is_parallel() {
            let mut b = Breakdown::from_totals(&rank_totals[0], total_ms, timed_steps);
            b.set_rank_spread(&rank_totals[1], &rank_totals[2]);
            b
        } else {
            timers.breakdown(total_ms, timed_steps)
        };
        let whose = if dist.is_parallel() {
            format!("mean over {} ranks", grid.world_size)
        } else {
            "one process".into()
        };
        eprintln!(
            "\nper-op breakdown (ms per step, {whose}, {timed_steps} steps):\n{}",
            b.to_table()
        );
        b.write_json(out.join("breakdown.json"))?;
    }
    let rss = peak_rss_bytes();
    if let Some(w) = metrics.as_mut() {
        if let Some(rss) = rss {
            eprintln!(
                "peak RSS {} = {:.2} x (params+grads+AdamW + activations)",
                mib(rss as f64),
                rss as f64 / (state_bytes + act_bytes)
            );
        }
        w.event(
            "end",
            &json!({"steps": t.steps, "last_loss": last_loss, "val_loss": last_val,
                    "peak_rss_bytes": rss, "checkpoint": last_ckpt}),
        )?;
        if let Some(c) = &last_ckpt {
            eprintln!("checkpoint: {}", c.display());
        }
    }
    Ok(TrainOutcome {
        out_dir: out,
        steps_done: t.steps as u64,
        last_loss,
        last_checkpoint: last_ckpt,
        val_loss: last_val,
    })
}

/// Rank 0's string on every rank.
fn broadcast_string(dist: &Dist, s: String) -> String {
    let mut b = s.into_bytes();
    dist.world.broadcast_bytes(&mut b);
    String::from_utf8(b).expect("rank 0 sent UTF-8")
}

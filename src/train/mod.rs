//! `fugu train`: the training loop, with metrics, timers, evaluation and checkpoints.

pub mod data;
pub mod dump;
pub mod schedule;
pub mod state;

use crate::backend::{Backend, CpuBackend};
use crate::checkpoint;
use crate::config::RunConfig;
use crate::metrics::flops::megatron_flops_per_step;
use crate::metrics::jsonl::{MetricsWriter, StepRecord};
use crate::metrics::machine::MachineInfo;
use crate::metrics::progress::{Progress, StepLine};
use crate::metrics::timers::{TimerLevel, Timers};
use crate::model::init::init_params;
use crate::model::table::gpt2_params;
use crate::model::{Gpt2, OptimStep, TpRank};
use anyhow::{bail, Context, Result};
use fugu_io::LoaderConfig;
use serde_json::json;
use state::{TrainState, STATE_FORMAT};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Exit code of a run stopped because the loss or the gradients were not finite.
pub const EXIT_NONFINITE: u8 = 3;

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

/// Runs `fugu train`.
pub fn run(opts: TrainOptions) -> Result<TrainOutcome> {
    let threads = set_threads(opts.threads)?;
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
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    checkpoint::clean_stale_tmp(&out)?;

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
    let data = match &start_state {
        Some(st) if opts.data.is_none() => st.data.clone(),
        _ => data::resolve_data(opts.data.as_deref(), false)?,
    };

    // Model.
    let mut model = Gpt2::new(&m, TpRank::SERIAL, CpuBackend::new())?;
    let full_table = gpt2_params(&m, 1)?;
    let mut host = vec![0.0f32; full_table.total()];
    let init_desc;
    if let Some(ck) = &resume_from {
        let hf = checkpoint::load_hf(ck)?;
        hf.copy_into(&model.table, &mut host)?;
        model.load_params(&host)?;
        let mut mm = vec![0.0f32; model.table.total()];
        let mut vv = vec![0.0f32; model.table.total()];
        checkpoint::load_optimizer(ck, &model.table, &mut mm, &mut vv)?;
        let (sm, sv) = (model.be.whole(model.m), model.be.whole(model.v));
        model.be.upload(sm, &mm);
        model.be.upload(sv, &vv);
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
        hf.copy_into(&model.table, &mut host)?;
        model.load_params(&host)?;
        init_desc = format!("initialised from {}", dir.display());
    } else {
        host = init_params(&m, &full_table, t.seed);
        model.load_params(&host)?;
        init_desc = format!("random init (seed {})", t.seed);
    }
    drop(host);

    // Data.
    let mut lcfg = LoaderConfig::train(t.batch_size, t.seq_len, 0, 1, t.seed);
    lcfg.shuffle = opts.shuffle;
    lcfg.vocab_size = m.vocab_size as u32;
    let mut loader = data::train_loader(&data, &lcfg, start_state.as_ref().map(|s| &s.cursor))?;
    let val_data = opts.val_data.clone().unwrap_or_else(|| data.clone());
    let mut vcfg = LoaderConfig::val(t.batch_size, t.seq_len, 0, 1);
    vcfg.vocab_size = m.vocab_size as u32;

    // Header: config, machine, layout, memory accounting.
    let machine = MachineInfo::detect(threads)?;
    let params_n = model.table.elements();
    let (act_f, gact_f) = model.activation_floats(t.batch_size, t.seq_len);
    let state_bytes = 16.0 * model.table.total() as f64;
    let act_bytes = 4.0 * (act_f + gact_f) as f64;
    let flops_step =
        megatron_flops_per_step(t.batch_size, t.seq_len, m.n_layer, m.n_embd, m.vocab_size);
    let start_step = start_state.as_ref().map_or(0, |s| s.step);
    let metrics_path = out.join("metrics.jsonl");
    let mut metrics = if start_step > 0 {
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
        "layout": {"world": 1, "tp": 1, "dp": 1, "nodes": 1, "threads": threads},
        "backend": model.be.name(),
        "parameters": params_n,
        "memory": {
            "params_grads_adam_bytes": state_bytes,
            "activation_bytes": act_bytes,
        },
        "flops_per_step": flops_step,
        "start_step": start_step,
        "fugu_version": env!("CARGO_PKG_VERSION"),
    });
    metrics.header(&header)?;
    eprintln!(
        "fugu train: {} ({:.2}M parameters), B={} T={} steps={} | {} | out {}",
        opts.config_name,
        params_n as f64 / 1e6,
        t.batch_size,
        t.seq_len,
        t.steps,
        init_desc,
        out.display()
    );
    eprintln!(
        "  machine: {} | {} threads ({}) | peak {:.0} GFLOP/s ({})",
        machine.cpu_model, threads, machine.layout, machine.peak_gflops, machine.peak_source
    );
    eprintln!(
        "  memory: params+grads+AdamW 16 B x {:.2}M = {}, activations {} (forward {} + backward scratch {}), expected total {}",
        model.table.total() as f64 / 1e6,
        mib(state_bytes),
        mib(act_bytes),
        mib(4.0 * act_f as f64),
        mib(4.0 * gact_f as f64),
        mib(state_bytes + act_bytes)
    );
    eprintln!(
        "  data: {} ({} tokens, {:.1} batches/epoch)",
        data,
        loader.info().tokens,
        loader.info().batches_per_epoch
    );

    let timers = Timers::new(opts.timers);
    let mut progress = Progress::new(t.steps as u64, start_step, opts.tty);
    progress.set_log_every(opts.log_every.max(1) as u64);
    let mut tokens_seen = start_state.as_ref().map_or(0, |s| s.tokens_seen);
    let mut skipped = start_state.as_ref().map_or(0, |s| s.skipped_nonfinite);
    let mut last_ckpt: Option<PathBuf> = resume_from.clone();
    let mut last_loss = f32::NAN;
    let mut last_val = None;
    let mut total_ms = 0.0f64;
    let mut timed_steps = 0u64;
    let tokens_per_step = (t.batch_size * t.seq_len) as u64;
    let peak = machine.peak_gflops * 1e9;

    let save = |model: &Gpt2<CpuBackend>,
                step: u64,
                cursor: fugu_io::Cursor,
                tokens_seen: u64,
                skipped: u64|
     -> Result<PathBuf> {
        let state = TrainState {
            format: STATE_FORMAT.into(),
            step,
            config: cfg.clone(),
            data: data.clone(),
            cursor,
            tokens_seen,
            skipped_nonfinite: skipped,
            threads,
            fugu_version: env!("CARGO_PKG_VERSION").into(),
        };
        let p = model.be.host(model.be.whole(model.params));
        let mm = model.be.host(model.be.whole(model.m));
        let vv = model.be.host(model.be.whole(model.v));
        checkpoint::write_checkpoint(
            &out,
            step,
            &m,
            &model.table,
            p,
            Some((mm, vv)),
            step,
            &state,
            opts.keep_last,
        )
    };

    for step in start_step..t.steps as u64 {
        let t0 = Instant::now();
        let batch = {
            let _g = timers.scope("forward:batch-generator", TimerLevel::Coarse);
            loader
                .next_batch()
                .with_context(|| format!("reading training data {data} at step {step}"))?
        };
        model.set_batch(&batch.tokens, t.batch_size, t.seq_len)?;
        loader.recycle(batch);
        model.zero_grad();
        let loss = model.forward(&timers, true);
        model.backward(&timers);
        if step == start_step && start_step == 0 {
            if let Some(path) = &opts.dump_grads {
                let g = model.be.host(model.be.whole(model.grads));
                dump::dump_grads(path, &m, &model.table, g)?;
                eprintln!("  wrote first-step gradients to {}", path.display());
            }
        }
        let optimizer_timer = timers.scope("optimizer", TimerLevel::Coarse);
        let norm = model.grad_norm(&timers);
        let lr = schedule::lr_at(&t, step as usize);
        if !loss.is_finite() || !norm.is_finite() {
            metrics.event(
                "nonfinite",
                &json!({"step": step, "loss": loss, "grad_norm": norm}),
            )?;
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
        last_loss = loss;
        tokens_seen += tokens_per_step;
        let step_ms = t0.elapsed().as_secs_f64() * 1e3;
        let done = step + 1;
        let timer_map = timers.take_step();
        total_ms += step_ms;
        timed_steps += 1;
        let secs = step_ms / 1e3;
        let flops = flops_step / secs;
        metrics.step(&StepRecord {
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
        })?;
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
                metrics.eval(done, v)?;
                progress.message(&format!("step {done}: val_loss {v:.4}"));
                last_val = Some(v);
            }
        }
        if (t.ckpt_every > 0 && done % t.ckpt_every as u64 == 0) || is_last {
            let _g = timers.scope("checkpoint", TimerLevel::Coarse);
            let path = save(&model, done, loader.cursor(), tokens_seen, skipped)?;
            metrics.event("checkpoint", &json!({"step": done, "path": path}))?;
            last_ckpt = Some(path);
        }
    }
    progress.finish();

    if timed_steps > 0 {
        let b = timers.breakdown(total_ms, timed_steps);
        eprintln!(
            "\nper-op breakdown (ms per step, {timed_steps} steps):\n{}",
            b.to_table()
        );
        b.write_json(out.join("breakdown.json"))?;
    }
    let rss = peak_rss_bytes();
    if let Some(rss) = rss {
        eprintln!(
            "peak RSS {} = {:.2} x (params+grads+AdamW + activations)",
            mib(rss as f64),
            rss as f64 / (state_bytes + act_bytes)
        );
    }
    metrics.event(
        "end",
        &json!({"steps": t.steps, "last_loss": last_loss, "val_loss": last_val,
                "peak_rss_bytes": rss, "checkpoint": last_ckpt}),
    )?;
    if let Some(c) = &last_ckpt {
        eprintln!("checkpoint: {}", c.display());
    }
    Ok(TrainOutcome {
        out_dir: out,
        steps_done: t.steps as u64,
        last_loss,
        last_checkpoint: last_ckpt,
        val_loss: last_val,
    })
}

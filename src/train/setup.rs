//! [`super::trainer::Trainer::setup`]'s phases, in order: the output folder and resume
//! point, the run's configuration, the data, the model on its backend (with its starting
//! point), and the loaders.

use super::data::{self, BatchSource};
use super::dist::Dist;
use super::lock::RunLock;
use super::pipeline::{self, Pipeline};
use super::resume::{self, is_checkpoint_dir};
use super::state::TrainState;
use super::{broadcast_string, default_out, layout, TrainOptions};
use crate::backend::Backend;
use crate::checkpoint;
use crate::checkpoint::optim::OptimizerFiles;
use crate::config::{RunConfig, TrainConfig};
use crate::model::acts::Recompute;
use crate::model::registry;
use crate::model::stage::Stage;
use crate::model::table::{Table, TensorSpec};
use crate::model::ModelConfig;
use crate::model::{Model, TpRank};
use crate::parallel::grad_sync::{BucketMemory, GradSync};
use anyhow::{bail, Context, Result};
use fugu_io::{DataSpec, LoaderConfig, Split, Verify};
use std::path::{Path, PathBuf};

/// The run's folder (locked by rank 0) and where it starts from.
pub(super) struct Output {
    pub(super) out: PathBuf,
    /// The checkpoint a resumed run continues from, and its state.
    pub(super) resume_from: Option<PathBuf>,
    pub(super) start_state: Option<TrainState>,
    /// Rank 0: the folder's lock, held for the run.
    pub(super) run_lock: Option<RunLock>,
}

/// The output folder and resume point: a folder with another run's checkpoints is refused
/// unless resumed; rank 0 takes its lock and cleans leftovers of killed checkpoint writes.
pub(super) fn output(opts: &TrainOptions, dist: &Dist) -> Result<Output> {
    let out = output_dir(opts, dist)?;
    let resume = resume::find(opts.resume.as_deref(), &out, dist.is_root())?;
    if resume.is_none() && !checkpoint::checkpoint_entries(&out)?.is_empty() {
        bail!(
            "{} already holds checkpoints of another run; pass --resume auto to continue it \
             or --out to start a new one",
            out.display()
        );
    }
    if resume.is_some() && opts.init_from.is_some() {
        bail!("--init-from and --resume: a resumed run continues from its checkpoint; drop --init-from");
    }
    // Everyone has looked at `out` before rank 0 changes it.
    dist.world.barrier();
    // Rank 0 holds the folder's lock for the whole run, before it cleans anything there.
    let mut run_lock = None;
    if dist.is_root() {
        std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
        run_lock = Some(RunLock::acquire(&out)?);
        checkpoint::clean_stale_tmp(&out)?;
    }
    let (resume_from, start_state) = match resume {
        Some(r) => (Some(r.dir), Some(r.state)),
        None => (None, None),
    };
    Ok(Output {
        out,
        resume_from,
        start_state,
        run_lock,
    })
}

/// The run's configuration, validated: a resumed run continues with the settings it was
/// started with (see `resume`); a new one takes the config file with the command line's
/// overrides (and with `--init-from` and no `--config`, the directory's model).
pub(super) fn run_config(
    opts: &mut TrainOptions,
    dist: &Dist,
    start_state: Option<&TrainState>,
) -> Result<RunConfig> {
    let cfg = match start_state {
        Some(st) => {
            // Data-parallel ranks then and now (the world is split into pp × dp × tp).
            let dp = (
                st.layout.map_or(1, |l| l.dp),
                (dist.grid.world_size / (opts.tp.max(1) * opts.pp.max(1))).max(1),
            );
            let file = opts
                .config_given
                .then_some((opts.config_name.as_str(), &opts.config));
            let cfg = resume::settings(
                &st.config,
                st.step,
                dp,
                file,
                &opts.overrides,
                dist.is_root(),
            )?;
            opts.shuffle = resume::shuffle(st.shuffle, opts.shuffle)?;
            cfg
        }
        None => {
            let mut model = opts.config.model.clone();
            let mut train = opts.overrides.apply(&opts.config.train);
            if let (Some(dir), false) = (&opts.init_from, opts.config_given) {
                // The shape comes from the directory itself; training settings from the
                // default config and the flags.
                model = checkpoint::read_hf_config(dir)
                    .with_context(|| format!("--init-from {}", dir.display()))?;
                if opts.overrides.seq_len.is_none() && train.seq_len > model.n_positions {
                    // The default config's sequences may not fit a model it did not describe.
                    train.seq_len = model.n_positions;
                    if dist.is_root() {
                        eprintln!(
                            "--init-from: using --seq-len {} (the model's n_positions)",
                            train.seq_len
                        );
                    }
                }
            }
            if let (Some(dir), true) = (&opts.init_from, dist.is_root()) {
                let dropout = checkpoint::dropout_settings(dir);
                if !dropout.is_empty() {
                    let list: Vec<String> =
                        dropout.iter().map(|(k, p)| format!("{k} = {p}")).collect();
                    eprintln!(
                        "warning: --init-from {}: its config.json sets dropout ({}); fugu \
                         trains without dropout, so this run uses none",
                        dir.display(),
                        list.join(", ")
                    );
                }
            }
            RunConfig { model, train }
        }
    };
    cfg.validate()?;
    if dist.is_root() && start_state.is_none() && cfg.train.warmup_steps >= cfg.train.steps {
        eprintln!(
            "warning: train.warmup_steps = {} is not below train.steps = {}: the learning rate \
             never reaches train.lr = {}",
            cfg.train.warmup_steps, cfg.train.steps, cfg.train.lr
        );
    }
    Ok(cfg)
}

/// `--zero` and `--micro-batches` against the batch size.
pub(super) fn check_step_options(opts: &TrainOptions, t: &TrainConfig) -> Result<()> {
    if opts.zero > 1 {
        bail!("--zero {}: only stages 0 and 1 exist", opts.zero);
    }
    let micro = opts.micro_batches;
    if micro == 0 || !t.batch_size.is_multiple_of(micro) {
        bail!(
            "--micro-batches {micro}: must divide the batch size per rank ({}) into equal micro-batches",
            t.batch_size
        );
    }
    Ok(())
}

/// The training data as every rank reads it.
pub(super) struct Data {
    /// Resolved training data (manifest, pattern or `.bin`).
    pub(super) path: String,
    /// Rank 0: the data's tokenizer files and special ids, written into every checkpoint.
    pub(super) tokenizer: Option<data::CheckpointTokenizer>,
    /// Loader streams the global batch is read as (`--data-ranks`).
    pub(super) ranks: usize,
}

/// Resolves the data (the bundled corpus is tokenised once, by rank 0, before anyone reads
/// it) and the tokenizer files checkpoints carry.
pub(super) fn data(
    opts: &TrainOptions,
    dist: &Dist,
    output: &Output,
    m: &ModelConfig,
) -> Result<Data> {
    let start_state = output.start_state.as_ref();
    let grid = dist.grid;
    let path = match start_state {
        Some(st) => resume::data(&st.data, opts.data.as_deref(), dist.is_root())?,
        None if dist.is_root() => data::absolute_data(&data::resolve_data(
            opts.data.as_deref(),
            m.vocab_size,
            false,
        )?),
        None => String::new(),
    };
    let path = broadcast_string(dist, path);
    // What every checkpoint carries so that `transformers` tokenises like the data (rank 0
    // writes the checkpoints).
    let tokenizer = if dist.is_root() {
        // The model the run starts from must have been trained with the data's tokenizer.
        let model_dir = output.resume_from.as_deref().or(opts.init_from.as_deref());
        if let Some(dir) = model_dir {
            let flag = if output.resume_from.is_some() {
                "resuming"
            } else {
                "--init-from"
            };
            data::check_model_tokenizer(dir, flag, &path, m.vocab_size)?;
        }
        Some(data::checkpoint_tokenizer(&path, m, model_dir)?)
    } else {
        None
    };
    let ranks = opts
        .data_ranks
        .or_else(|| {
            let saved = start_state?.layout?.data_ranks;
            saved.is_multiple_of(grid.dp).then_some(saved)
        })
        .unwrap_or(grid.dp);
    let saved_ranks = start_state.and_then(|s| s.layout).map(|l| l.data_ranks);
    if let (Some(saved), true) = (saved_ranks, dist.is_root()) {
        if saved != ranks {
            eprintln!(
                "notice: the run read its global batch as {saved} data stream(s); it is now read \
                 as {ranks} (dp = {}): the same global batch size, but the batches from here on \
                 differ from an uninterrupted run's (keep them with --data-ranks {saved} and a \
                 dp that divides it)",
                grid.dp
            );
        }
    }
    Ok(Data {
        path,
        tokenizer,
        ranks,
    })
}

/// This rank's model and what runs it.
pub(super) struct ModelParts<B: Backend> {
    pub(super) model: Box<dyn Model<B>>,
    /// Every stage of the pipeline (one with `--pp 1`).
    pub(super) stages: Vec<Stage>,
    pub(super) pipeline: Pipeline,
    pub(super) sync: GradSync,
    /// The logical (tp = 1) parameter table, as in checkpoints.
    pub(super) full_table: Table,
    /// How the parameters were initialised, for the header.
    pub(super) init_desc: String,
}

/// This rank's pipeline stage and tensor-parallel shard of the model on `backend`, its
/// gradient buckets and (ZeRO-1) its block of the AdamW moments, loaded from its starting
/// point.
pub(super) fn model<B: Backend>(
    opts: &TrainOptions,
    dist: &Dist,
    cfg: &RunConfig,
    backend: B,
    resume_from: Option<&Path>,
) -> Result<ModelParts<B>> {
    let (grid, m, t) = (dist.grid, &cfg.model, &cfg.train);
    let micro = opts.micro_batches;
    let tp = TpRank {
        rank: grid.tp_rank,
        size: grid.tp,
    };
    let stages = Stage::layout(m, grid.pp, t.seq_len, opts.pp_layers.as_deref())?;
    let stage = stages[grid.pp_rank].clone();
    let mut model = registry::build(m, tp, &stage, t.precision.compute_dtype(), backend)?;
    model.set_tp_comm(dist.tp.clone())?;
    model.set_in_flight(pipeline::in_flight(stage.index, stage.count, micro));
    let pipeline = Pipeline::new(dist.pp.clone(), dist.tied.clone(), stage);
    let bucket_floats = ((opts.bucket_mb * (1 << 20) as f64 / 4.0) as usize).max(1);
    let mut sync = GradSync::new(
        model.table(),
        dist.dp.clone(),
        bucket_floats,
        opts.zero == 1,
    );
    let grads = model.buffers().grads;
    sync.place_buckets(BucketMemory::from_env()?, model.backend_mut(), grads)?;
    model.set_owned(sync.owned(model.table().total()))?;
    let full_table = registry::full_params(m)?;
    let init_desc = initialise(
        &mut *model,
        &full_table,
        resume_from,
        opts.init_from.as_deref(),
        cfg,
    )?;
    model.set_accumulation(micro);
    model.set_recompute(opts.recompute);
    model.set_loss_chunk(opts.loss_chunk);
    Ok(ModelParts {
        model,
        stages,
        pipeline,
        sync,
        full_table,
        init_desc,
    })
}

/// The training and validation streams, and the memory the model needs at the run's batch
/// shape (checked before anything that size is allocated).
pub(super) struct Loaders {
    pub(super) source: BatchSource,
    /// What evaluations read; `None`: no evaluation this run (`eval_every = 0`, or
    /// `--allow-no-eval` with an unreadable split, warned about at start).
    pub(super) val_data: Option<String>,
    pub(super) val_loader: LoaderConfig,
    pub(super) memory: Memory,
}

/// B rows per data-parallel rank, from the cursor when resuming; the validation data is opened
/// now, so that a bad one fails here and evaluation is never skipped in silence.
pub(super) fn loaders<B: Backend>(
    opts: &TrainOptions,
    dist: &Dist,
    cfg: &RunConfig,
    model: &dyn Model<B>,
    data: &Data,
    start_state: Option<&TrainState>,
) -> Result<Loaders> {
    let (grid, m, t) = (dist.grid, &cfg.model, &cfg.train);
    let mut lcfg = LoaderConfig::train(t.batch_size, t.seq_len, 0, 1, t.seed);
    lcfg.shuffle = opts.shuffle;
    lcfg.vocab_size = m.vocab_size as u32;
    lcfg.skip_bad_samples = opts.skip_bad_samples;
    if opts.verify_data {
        lcfg.verify = Verify::Full;
    }
    let memory = Memory::of(model, t.batch_size / opts.micro_batches, t.seq_len);
    check_memory(model.backend(), &memory, &lcfg, opts)?;
    let source = BatchSource::open(
        &data.path,
        &lcfg,
        grid.dp_rank,
        grid.dp,
        data.ranks,
        start_state.map(|s| &s.cursor),
    )
    .with_context(|| match start_state {
        Some(_) => format!(
            "resuming on {}: is it the dataset the run was trained on?",
            data.path
        ),
        None => format!("opening the training data {}", data.path),
    })?;
    let val_loader = val_loader_config(opts, dist, cfg);
    let val_data = validation_data(opts, dist, t, &data.path, &val_loader)?;
    Ok(Loaders {
        source,
        val_data,
        val_loader,
        memory,
    })
}

/// How evaluations read: `B` rows per data-parallel rank, from the validation split of a
/// manifest; a token file or shard pattern named by `--val-data` (nanoGPT's val.bin, llm.c's)
/// is read whole.
pub(super) fn val_loader_config(opts: &TrainOptions, dist: &Dist, cfg: &RunConfig) -> LoaderConfig {
    let (grid, m, t) = (dist.grid, &cfg.model, &cfg.train);
    let mut val_loader = LoaderConfig::val(t.batch_size, t.seq_len, grid.dp_rank, grid.dp);
    val_loader.vocab_size = m.vocab_size as u32;
    if opts.verify_data {
        val_loader.verify = Verify::Full;
    }
    if let Some(v) = &opts.val_data {
        if !matches!(DataSpec::parse(v), Ok(DataSpec::Manifest(_))) {
            val_loader.split = Split::Train;
        }
    }
    val_loader
}

/// The data evaluations read, checked now: `--val-data` (always checked when given), else the
/// validation split of `data`. One that cannot be read, or holds no window, is an error naming
/// the reason and the ways on, unless `--allow-no-eval` (then a warning and no evaluation).
fn validation_data(
    opts: &TrainOptions,
    dist: &Dist,
    t: &TrainConfig,
    data: &str,
    val_loader: &LoaderConfig,
) -> Result<Option<String>> {
    if opts.eval_batches == 0 {
        bail!("--eval-batches 0: an evaluation needs at least one batch (set train.eval_every = 0 for none)");
    }
    if let Some(v) = &opts.val_data {
        data::check_val_data("--val-data", v, val_loader)?;
        return Ok((t.eval_every > 0).then(|| v.clone()));
    }
    if t.eval_every == 0 {
        return Ok(None);
    }
    match data::check_val_data("--data", data, val_loader) {
        Ok(()) => Ok(Some(data.to_string())),
        Err(e) if opts.allow_no_eval => {
            if dist.is_root() {
                eprintln!("warning: --allow-no-eval: no evaluation this run: {e:#}");
            }
            Ok(None)
        }
        Err(e) => Err(e.context(format!(
            "train.eval_every = {} asks for evaluations, but --data has no usable validation \
             split: give --val-data, set train.eval_every = 0 (--eval-every 0), or pass \
             --allow-no-eval to train without evaluation",
            t.eval_every
        ))),
    }
}

/// Memory accounting for the up-front check, the header and the end-of-run RSS line (bytes
/// per rank), computed once from the model and the batch shape.
#[derive(Clone, Copy)]
pub(super) struct Memory {
    /// This rank's parameters + gradients, and its AdamW moments (fewer under ZeRO-1).
    pub(super) params_grads: f64,
    pub(super) moments: f64,
    /// Forward activations, and the backward pass's gradient scratch.
    pub(super) forward: f64,
    pub(super) backward: f64,
    /// The most working memory the backend holds beside its buffers in a step (the CPU's
    /// stage for 16-bit activations; 0 where none).
    pub(super) workspace: f64,
}

impl Memory {
    fn of<B: Backend>(model: &dyn Model<B>, b: usize, t: usize) -> Memory {
        let (act_b, gact_b) = model.activation_bytes(b, t);
        let moment_n: usize = model.owned().iter().map(|o| o.flat.len()).sum();
        Memory {
            params_grads: (8 * model.table().total() + model.compute_params_bytes()) as f64,
            moments: 8.0 * moment_n as f64,
            forward: act_b as f64,
            backward: gact_b as f64,
            workspace: model.backend().workspace_bound(&model.step_shapes(b, t)) as f64,
        }
    }

    pub(super) fn state(&self) -> f64 {
        self.params_grads + self.moments
    }

    pub(super) fn activations(&self) -> f64 {
        self.forward + self.backward
    }

    /// What a step adds to the state: activations, gradient scratch and the workspace.
    pub(super) fn step(&self) -> f64 {
        self.activations() + self.workspace
    }
}

/// Refuses a batch shape whose buffers cannot fit, before anything that size is allocated:
/// activations, backward scratch and the backend's workspace against its free memory, the loader's prefetched
/// batches against the host's (`MemAvailable`). Where a figure is unknown it is not checked.
fn check_memory<B: Backend>(
    be: &B,
    mem: &Memory,
    lcfg: &LoaderConfig,
    opts: &TrainOptions,
) -> Result<()> {
    let (b, t) = (lcfg.batch_size, lcfg.seq_len);
    let gib = |x: f64| x / (1u64 << 30) as f64;
    if let Some(free) = be.free_memory() {
        if mem.step() > free as f64 {
            let ws = if mem.workspace > 0.0 {
                format!(
                    " (and the backend's workspace {:.1} GiB)",
                    gib(mem.workspace)
                )
            } else {
                String::new()
            };
            bail!(
                "--batch-size {b} --seq-len {t}: activations need {:.1} GiB per rank{ws} on {}, which has {:.1} GiB free; {}",
                gib(mem.activations()),
                be.describe(),
                gib(free as f64),
                memory_remedies(opts, b)
            );
        }
    }
    // Each prefetched batch holds B·(T+1) u32 tokens; one more is being filled and one in use.
    let loader_bytes = 4.0 * (b * (t + 1)) as f64 * (lcfg.prefetch + 2) as f64;
    if let Some(free) = crate::metrics::machine::host_memory_available() {
        if loader_bytes > free as f64 {
            bail!(
                "--batch-size {b} --seq-len {t}: the data loader's {} prefetched batches need {:.1} GiB of host memory, {:.1} GiB is available; lower the batch size",
                lcfg.prefetch,
                gib(loader_bytes),
                gib(free as f64)
            );
        }
    }
    Ok(())
}

/// What a run whose activations do not fit can change: the batch shape, and each setting
/// that holds fewer activations and is not yet at its most (`b`: sequences per rank).
fn memory_remedies(opts: &TrainOptions, b: usize) -> String {
    let mut r = vec!["lower the batch size or the sequence length".to_string()];
    if opts.micro_batches < b {
        r.push("run the batch in more parts (--micro-batches, gradients accumulated)".into());
    }
    if opts.recompute != Recompute::Full {
        r.push(
            "keep fewer activations (--recompute full: the blocks' forward passes again)".into(),
        );
    }
    if opts.loss_chunk.is_none() {
        r.push("hold the logits a chunk at a time (--loss-chunk ROWS, e.g. 4096)".into());
    }
    r.join(", or ")
}

/// `--out`, or the run folder implied by `--resume DIR`, or a fresh `runs/CONFIG-TIME`.
fn output_dir(opts: &TrainOptions, dist: &Dist) -> Result<PathBuf> {
    Ok(match (&opts.out, &opts.resume) {
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
    })
}

/// Loads the model's starting point: a checkpoint (parameters and AdamW moments), a Hugging
/// Face directory (`--init-from`, parameters only) or the seeded random init. Returns how, for
/// the header.
/// Reads one tensor of a checkpoint, refusing NaN or infinite values by tensor and folder: a
/// diverged run's checkpoint would train on as NaN (and be reported as the last good one).
fn read_finite(
    hf: &checkpoint::HfModel,
    table: &Table,
    spec: &TensorSpec,
    out: &mut [f32],
    dir: &Path,
) -> Result<()> {
    hf.read_tensor(table, &spec.name, out)?;
    if let Some(x) = out.iter().find(|x| !x.is_finite()) {
        bail!(
            "{}: tensor `{}` holds non-finite values ({x}): the run diverged before this \
             checkpoint; resume from an earlier one (--resume PATH)",
            dir.display(),
            spec.name
        );
    }
    Ok(())
}

fn initialise<B: Backend>(
    model: &mut dyn Model<B>,
    full_table: &Table,
    resume_from: Option<&Path>,
    init_from: Option<&Path>,
    cfg: &RunConfig,
) -> Result<String> {
    let m = &cfg.model;
    // Every source is read one full tensor at a time, only this rank's stage's tensors.
    if let Some(ck) = resume_from {
        let hf = checkpoint::load_hf(ck)?;
        hf.check(full_table)?;
        let opt = OptimizerFiles::open(ck, &registry::hf_layout(m), full_table)?;
        let [mut m, mut v] = [0, 1].map(|k| {
            let opt = &opt;
            move |s: &TensorSpec, out: &mut [f32]| opt.read(full_table, k, &s.name, out)
        });
        layout::load_tensors(
            model,
            full_table,
            &mut |s, out| read_finite(&hf, full_table, s, out, ck),
            Some([&mut m, &mut v]),
        )?;
        return Ok(format!("resumed from {}", ck.display()));
    }
    if let Some(dir) = init_from {
        let hf = checkpoint::load_hf(dir)?;
        if &hf.config != m {
            bail!(
                "--init-from {}: its config.json ({:?}) does not match the run's model ({:?}); \
                 use a config with the same model section",
                dir.display(),
                hf.config,
                m
            );
        }
        hf.check(full_table)?;
        layout::load_tensors(
            model,
            full_table,
            &mut |s, out| read_finite(&hf, full_table, s, out, dir),
            None,
        )?;
        return Ok(format!("initialised from {}", dir.display()));
    }
    let seed = cfg.train.seed;
    layout::load_tensors(
        model,
        full_table,
        &mut |s, out| {
            registry::init_tensor(m, &s.name, seed, out);
            Ok(())
        },
        None,
    )?;
    Ok(format!("random init (seed {})", cfg.train.seed))
}

//! `fugu predict`: predicted step time, throughput, breakdown and memory of a model at several
//! node counts on a machine profile; `fugu predict profile` builds a profile from measurements.

use crate::config::{Precision, RunConfig};
use crate::metrics::ops::trainer::grads;
use crate::predict::fit::{fit, Fitted, Param, Runs};
use crate::predict::profile::{measure, Profile};
use crate::predict::search::{join, search, Space};
use crate::predict::step::{
    layout_gemms, predict, unmeasured_gemms, Layout, Machine, Prediction, Workload,
};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::path::PathBuf;

/// Arguments of `fugu predict`.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PredictArgs {
    #[command(subcommand)]
    pub command: Option<PredictCommand>,
    /// Machine profile (TOML; see docs/PREDICT.md and profiles/).
    #[arg(long, value_name = "FILE")]
    pub profile: Option<PathBuf>,
    /// Model config: a built-in name or a TOML file (its model and sequence length).
    #[arg(long, default_value = "gpt2-124m")]
    pub config: String,
    /// Node counts (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub nodes: Vec<usize>,
    /// Ranks per node (default: the profile's).
    #[arg(long)]
    pub ranks_per_node: Option<usize>,
    /// Compute threads per rank (default: the profile's).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Tensor-parallel degree.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Data-parallel degree: `auto` (the ranks left over by tp and pp) or a number, which must
    /// be that.
    #[arg(long, default_value = "auto")]
    pub dp: String,
    /// ZeRO stage: 0 or 1 (default 0; with --search: both, unless given).
    #[arg(long)]
    pub zero: Option<u8>,
    /// Global batch in sequences per step (default: the config's batch size at one node's dp,
    /// kept fixed over the node counts: strong scaling).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Sequence length (default: the config's).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Micro-batches per step per data-parallel replica.
    #[arg(long, default_value_t = 1, conflicts_with = "micro_batch_size")]
    pub micro_batches: usize,
    /// Sequences per micro-batch instead (Megatron's micro-batch size): the micro-batches per
    /// step follow from the global batch and dp at each node count.
    #[arg(long)]
    pub micro_batch_size: Option<usize>,
    /// Calibrate compute on a one-node measurement of this model: its model TFLOP/s per node
    /// (Megatron's FLOPs formula), replacing the profile's compute section.
    #[arg(long, value_name = "TFLOPS")]
    pub tflops_per_node: Option<f64>,
    /// Blocks per pipeline stage (comma-separated, as `fugu train --pp-layers`); default: the
    /// stages balanced by predicted time (the counts are printed, to give `fugu train`).
    #[arg(long, value_delimiter = ',')]
    pub pp_layers: Option<Vec<usize>>,
    /// Activations the backward pass recomputes instead of keeping (as `fugu train
    /// --recompute`): costs time, saves memory.
    /// Default none; with --search: all three, unless given.
    #[arg(long, value_enum)]
    pub recompute: Option<crate::model::acts::Recompute>,
    /// The LM head and the loss this many rows at a time (as `fugu train --loss-chunk`): the
    /// logits of one chunk in memory instead of a micro-batch's.
    #[arg(long, value_name = "ROWS", value_parser = clap::value_parser!(u64).range(1..))]
    pub loss_chunk: Option<u64>,
    /// Precision of the step (as `fugu train --precision`): the activations' bytes in memory;
    /// on a profile with `[compute.kernels]`, also the GEMM rate and the row ops' bytes.
    #[arg(long, value_enum, default_value = "fp32")]
    pub precision: Precision,
    /// Find the largest micro-batch (sequences) that fits in memory at each node count, and
    /// predict the step at it (global batch = micro-batch size x dp x --micro-batches).
    #[arg(long, conflicts_with_all = ["batch", "micro_batch_size", "search"])]
    pub largest_micro_batch: bool,
    /// Print layouts that do not fit in memory and exit 0 (otherwise such a layout is named on
    /// stderr and the exit status is 1).
    #[arg(long)]
    pub allow_oversubscribed_memory: bool,
    /// Search every layout of the model on each node count (ranks per node, tp, pp, dp,
    /// micro-batch size, recompute, ZeRO) within memory, and print the fastest with the
    /// `fugu train` flags and job-script settings that run them. Needs --batch.
    #[arg(long, conflicts_with_all = ["tp", "pp", "dp", "pp_layers", "micro_batches"])]
    pub search: bool,
    /// Layouts --search prints per node count.
    #[arg(long, default_value_t = 5, requires = "search")]
    pub top: usize,
    /// Output format.
    #[arg(long, default_value = "table", value_parser = ["table", "json"])]
    pub format: String,
}

/// `fugu predict profile`, `fugu predict gemm-shapes`.
#[derive(clap::Subcommand, Debug)]
pub enum PredictCommand {
    /// Build a machine profile from a one-process reference run and `fugu bench comm` (and
    /// optionally `fugu bench gemm`) output.
    Profile(ProfileArgs),
    /// Print the GEMM shapes a model makes per micro-batch at some tensor-parallel degrees, as
    /// `fugu bench gemm --shape` arguments (to measure the rates a profile's [[compute.gemm]]
    /// holds).
    GemmShapes(GemmShapesArgs),
}

/// Arguments of `fugu predict gemm-shapes`.
#[derive(clap::Args, Debug)]
pub struct GemmShapesArgs {
    /// Model config: a built-in name or a TOML file.
    #[arg(long, default_value = "gpt2-124m")]
    pub config: String,
    /// Sequence length (default: the config's).
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Sequences per micro-batch (comma-separated for several).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub micro_batch_size: Vec<usize>,
    /// Tensor-parallel degrees (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub tp: Vec<usize>,
    /// Pipeline stages (comma-separated): the first and last stages add the embedding and LM
    /// head.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub pp: Vec<usize>,
}

/// Arguments of `fugu predict profile`.
#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    /// The reference run: a one-process `fugu train` directory (or its metrics.jsonl) whose
    /// per-op timers the model scales.
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "base",
        requires = "comm"
    )]
    pub run: Option<PathBuf>,
    /// `fugu bench comm --format json` files: one node (the intra-node link) and optionally
    /// several nodes (the inter-node link).
    #[arg(long, value_name = "FILE", requires = "run")]
    pub comm: Vec<PathBuf>,
    /// `fugu bench gemm --format json` files measured on the same machine (e.g. of the shapes
    /// `fugu predict gemm-shapes` prints): GEMM ops then scale by their measured rates.
    #[arg(long, value_name = "FILE", requires = "run")]
    pub gemm: Vec<PathBuf>,
    /// Start from this profile instead of measurements (to fit it with --fit).
    #[arg(long, value_name = "FILE", conflicts_with = "run")]
    pub base: Option<PathBuf>,
    /// Measured multi-node runs (TOML, docs/PREDICT.md): the traffic-class links named by
    /// --fit-params are fitted to the runs marked `fit = true`, and every run's residual is
    /// printed (the others are out-of-sample checks).
    #[arg(long, value_name = "RUNS")]
    pub fit: Option<PathBuf>,
    /// The parameters to fit (comma-separated): `CLASS.intra|inter.alpha_us|beta_gbs` or
    /// `CLASS.reduce_gbs`, CLASS one of tp, pp, dp. None: only the residuals.
    #[arg(long, value_delimiter = ',', requires = "fit")]
    pub fit_params: Vec<String>,
    /// Profile name.
    #[arg(long, default_value = "measured")]
    pub name: String,
    /// Cores of one node.
    #[arg(long, requires = "run", required_unless_present = "base")]
    pub cores_per_node: Option<usize>,
    /// Memory of one node, GiB.
    #[arg(long, requires = "run", required_unless_present = "base")]
    pub memory_gib: Option<f64>,
    /// Where to write the profile (TOML).
    #[arg(long, short, value_name = "FILE")]
    pub out: PathBuf,
}

#[derive(Serialize)]
struct Output<'a> {
    profile: &'a str,
    estimate: bool,
    config: &'a str,
    precision: &'a str,
    seq_len: usize,
    /// The global batch of the first node count (with --largest-micro-batch each node count's
    /// is its prediction's micro-batch size x dp x micro-batches).
    global_batch: usize,
    predictions: &'a [Prediction],
}

/// Runs `fugu predict`.
pub fn run(args: PredictArgs) -> Result<()> {
    match args.command {
        Some(PredictCommand::Profile(p)) => return run_profile(p),
        Some(PredictCommand::GemmShapes(g)) => return run_gemm_shapes(g),
        None => {}
    }
    let path = args.profile.as_ref().context(
        "--profile FILE is needed (a machine profile: see profiles/ and docs/PREDICT.md)",
    )?;
    let profile = Profile::load(path)?;
    let mut machine = profile.machine();
    if let Some(r) = args.tflops_per_node {
        if !(r > 0.0 && r.is_finite()) {
            bail!("--tflops-per-node {r}: expected a positive number");
        }
        machine.compute = crate::predict::step::Compute::Rate {
            model_tflops_per_node: r,
        };
    }
    let cfg = RunConfig::load(&args.config)?;
    let rpn = args
        .ranks_per_node
        .unwrap_or(profile.machine.ranks_per_node);
    let threads = args.threads.unwrap_or(profile.machine.threads_per_rank);
    if rpn == 0 || threads == 0 {
        bail!("--ranks-per-node and --threads must be at least 1");
    }
    if let Some(z @ 2..) = args.zero {
        bail!("--zero {z}: fugu has ZeRO stages 0 and 1");
    }
    if args.nodes.is_empty() || args.nodes.contains(&0) {
        bail!("--nodes: give node counts of at least 1");
    }
    let seq_len = args.seq_len.unwrap_or(cfg.train.seq_len);
    if seq_len == 0 || seq_len > cfg.model.n_positions {
        bail!(
            "--seq-len {seq_len}: expected 1 to {} (the model's n_positions)",
            cfg.model.n_positions
        );
    }
    if args.batch == Some(0) {
        bail!("--batch 0: expected at least 1 sequence per step");
    }
    if args.micro_batches == 0 {
        bail!("--micro-batches 0: expected at least 1");
    }
    if args.search {
        return run_search(&args, &profile, &machine, &cfg, seq_len);
    }
    let model_parallel = args
        .tp
        .checked_mul(args.pp)
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--tp {} x --pp {}: expected positive degrees whose product fits",
                args.tp,
                args.pp
            )
        })?;
    let dp_of = |nodes: usize| -> Result<usize> {
        let world = nodes.checked_mul(rpn).ok_or_else(|| {
            anyhow::anyhow!("{nodes} node(s) x {rpn} ranks per node: too many ranks to count")
        })?;
        if !world.is_multiple_of(model_parallel) {
            bail!(
                "{nodes} node(s) x {rpn} ranks = {world} ranks is not a multiple of tp {} x pp {}",
                args.tp,
                args.pp
            );
        }
        let auto = world / model_parallel;
        if args.dp == "auto" {
            return Ok(auto);
        }
        let dp: usize = args
            .dp
            .parse()
            .map_err(|_| anyhow::anyhow!("--dp '{}': expected auto or a number", args.dp))?;
        if dp != auto {
            bail!(
                "--dp {dp}: {world} ranks with tp {} and pp {} leave dp = {auto}",
                args.tp,
                args.pp
            );
        }
        Ok(dp)
    };
    let global_batch = match args.batch {
        Some(b) => b,
        None => cfg
            .train
            .batch_size
            .checked_mul(dp_of(args.nodes[0])?)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "the global batch (batch size x dp) is too large to count: give --batch"
                )
            })?,
    };
    let w = Workload {
        model: cfg.model.clone(),
        seq_len,
        global_batch,
        recompute: args.recompute.unwrap_or_default(),
        loss_chunk: args.loss_chunk.map(|r| r as usize),
        precision: args.precision,
        pp_layers: args.pp_layers.clone(),
    };
    let mut out = Vec::new();
    let mut unmeasured = std::collections::BTreeSet::new();
    for &nodes in &args.nodes {
        let dp = dp_of(nodes)?;
        let micro_batches = match args.micro_batch_size {
            None => args.micro_batches,
            Some(0) => bail!("--micro-batch-size 0: expected at least 1"),
            Some(mbs) if !global_batch.is_multiple_of(dp * mbs) => bail!(
                "at {nodes} node(s): the global batch {global_batch} is not a multiple of dp {dp} x micro-batch size {mbs}"
            ),
            Some(mbs) => global_batch / (dp * mbs),
        };
        let l = Layout {
            nodes,
            ranks_per_node: rpn,
            threads_per_rank: threads,
            tp: args.tp,
            pp: args.pp,
            dp,
            zero: args.zero == Some(1),
            micro_batches,
        };
        let p = if args.largest_micro_batch {
            largest_micro_batch(&w, &l, &machine)
        } else {
            predict(&w, &l, &machine)
        };
        out.push(p.with_context(|| format!("at {nodes} node(s)"))?);
        unmeasured.extend(unmeasured_gemms(&w, &l, &machine)?);
    }
    if !unmeasured.is_empty() {
        eprintln!(
            "note: {} GEMM shape(s) have no rate measured at their thread count in the profile; the \
             nearest measured shape stands in. To measure them: fugu bench gemm --format json{}",
            unmeasured.len(),
            unmeasured
                .iter()
                .map(|s| format!(" --shape {s}"))
                .collect::<String>()
        );
    }
    if args.format == "json" {
        let o = Output {
            profile: &profile.machine.name,
            estimate: profile.machine.estimate,
            config: &args.config,
            precision: args.precision.name(),
            seq_len,
            global_batch,
            predictions: &out,
        };
        println!("{}", serde_json::to_string_pretty(&o)?);
    } else {
        let batch = if args.largest_micro_batch {
            "the largest micro-batch within memory".to_string()
        } else {
            format!("global batch {global_batch}")
        };
        println!(
            "# fugu predict: {} (T = {seq_len}, {batch}, recompute {}{}, {}) on profile '{}'{}",
            args.config,
            w.recompute.name(),
            w.loss_chunk
                .map(|r| format!(", loss chunk {r}"))
                .unwrap_or_default(),
            args.precision.name(),
            profile.machine.name,
            if profile.machine.estimate {
                " (estimates from published figures)"
            } else {
                ""
            }
        );
        print!("{}", format_table(&out));
        println!("{TABLE_UNITS}");
        if args.largest_micro_batch {
            for p in &out {
                println!(
                    "# {} node(s): largest micro-batch within memory: {} sequence(s) ({:.2} of {:.2} GiB per rank; global batch {})",
                    p.layout.nodes,
                    p.micro_batch_size,
                    p.memory_gib_per_rank,
                    p.memory_gib_available,
                    p.micro_batch_size * p.layout.dp * p.layout.micro_batches
                );
            }
        }
        for p in out.iter().filter(|p| p.layout.pp > 1) {
            println!(
                "# {} node(s): blocks per pipeline stage {} (fugu train --pp-layers {})",
                p.layout.nodes,
                join(&p.pp_layers),
                join(&p.pp_layers)
            );
        }
    }
    check_memory(
        &out,
        profile.machine.memory_gib_per_node,
        args.allow_oversubscribed_memory,
    )
}

/// The prediction at the largest micro-batch size that fits in memory on layout `l` (its
/// micro-batches per step kept): memory grows with the micro-batch, so doubling from one
/// sequence and then bisection find it. An error when even one sequence does not fit.
fn largest_micro_batch(w: &Workload, l: &Layout, m: &Machine) -> Result<Prediction> {
    let at = |mbs: usize| -> Result<Prediction> {
        let global_batch = mbs
            .checked_mul(l.dp * l.micro_batches)
            .context("the micro-batch is too large to count")?;
        predict(
            &Workload {
                global_batch,
                ..w.clone()
            },
            l,
            m,
        )
    };
    let one = at(1)?;
    if !one.fits {
        bail!(
            "not even one sequence per micro-batch fits: {:.2} GiB per rank needed, {:.2} GiB available \
             (use more tensor or pipeline parallelism, --recompute or fewer ranks per node)",
            one.memory_gib_per_rank,
            one.memory_gib_available
        );
    }
    // fits(lo), and hi is past the largest (or the count's limit).
    let (mut lo, mut best) = (1usize, one);
    let mut hi = loop {
        let next = lo * 2;
        if next > 1 << 24 {
            break next;
        }
        match at(next) {
            Ok(p) if p.fits => (lo, best) = (next, p),
            _ => break next,
        }
    };
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match at(mid) {
            Ok(p) if p.fits => (lo, best) = (mid, p),
            _ => hi = mid,
        }
    }
    Ok(best)
}

/// `fugu predict --search`: per node count, the fastest layouts within memory, each with its
/// breakdown, and the commands that run them.
fn run_search(
    args: &PredictArgs,
    profile: &Profile,
    machine: &crate::predict::step::Machine,
    cfg: &RunConfig,
    seq_len: usize,
) -> Result<()> {
    let global_batch = args
        .batch
        .context("--search needs --batch (the global batch in sequences: the layouts split it)")?;
    let mut ranks_per_node = vec![args
        .ranks_per_node
        .unwrap_or(profile.machine.ranks_per_node)];
    if args.ranks_per_node.is_none() && ranks_per_node[0] != 1 {
        ranks_per_node.push(1);
    }
    let recompute = match args.recompute {
        Some(r) => vec![r],
        None => crate::model::acts::Recompute::ALL.to_vec(),
    };
    let zero = match args.zero {
        Some(z) => vec![z == 1],
        None => vec![false, true],
    };
    if args.micro_batch_size == Some(0) {
        bail!("--micro-batch-size 0: expected at least 1");
    }
    let mut all = Vec::new();
    for &nodes in &args.nodes {
        let space = Space {
            model: cfg.model.clone(),
            seq_len,
            global_batch,
            nodes,
            ranks_per_node: ranks_per_node.clone(),
            threads: args.threads,
            micro_batch_sizes: args.micro_batch_size.map(|s| vec![s]),
            recompute: recompute.clone(),
            loss_chunk: args.loss_chunk.map(|r| r as usize),
            precision: args.precision,
            zero: zero.clone(),
        };
        let started = std::time::Instant::now();
        let found = search(&space, machine, profile.machine.cores_per_node)?;
        let secs = started.elapsed().as_secs_f64();
        let top: Vec<_> = found.ranked.iter().take(args.top).collect();
        if args.format == "json" {
            all.push(serde_json::json!({
                "nodes": nodes,
                "predicted": found.predicted,
                "refused": found.refused,
                "over_memory": found.over_memory,
                "first_refusal": found.first_refusal,
                "seconds": secs,
                "layouts": top.iter().map(|c| serde_json::json!({
                    "prediction": c.prediction,
                    "micro_batch_size": c.micro_batch_size,
                    "recompute": c.recompute.name(),
                    "loss_chunk": c.loss_chunk,
                    "train_flags": c.train_flags(seq_len),
                    "job_settings": c.job_settings(seq_len),
                })).collect::<Vec<_>>(),
            }));
            continue;
        }
        println!(
            "# fugu predict --search: {} (T = {seq_len}, global batch {global_batch}) on {nodes} node(s) of profile '{}'{}: {} layouts predicted in {secs:.2} s, {} within memory, {} over memory, {} refused (the trainer's rules, or too large to count)",
            args.config,
            profile.machine.name,
            if profile.machine.estimate { " (estimates)" } else { "" },
            found.predicted,
            found.ranked.len(),
            found.over_memory,
            found.refused
        );
        if top.is_empty() {
            match (&found.first_refusal, found.predicted) {
                (Some(why), 0) => println!("# no layout is possible; the first refused: {why}"),
                _ => println!("# no layout fits in memory"),
            }
            continue;
        }
        let rows: Vec<Prediction> = top.iter().map(|c| c.prediction.clone()).collect();
        let table = format_table(&rows);
        let mut lines = table.lines();
        println!(
            "{:>3} {:>10} {:>4} {:>9} {:>4} | {}",
            "#",
            "rpn x thr",
            "mbs",
            "recompute",
            "zero",
            lines.next().unwrap_or("")
        );
        for (i, (c, line)) in top.iter().zip(lines).enumerate() {
            let l = &c.prediction.layout;
            println!(
                "{:>3} {:>10} {:>4} {:>9} {:>4} | {line}",
                i + 1,
                format!("{}x{}", l.ranks_per_node, l.threads_per_rank),
                c.micro_batch_size,
                c.recompute.name(),
                if l.zero { "1" } else { "0" },
            );
        }
        for (i, c) in top.iter().enumerate() {
            let l = &c.prediction.layout;
            println!(
                "# {}: mpirun -np {} fugu train --config {} {}",
                i + 1,
                l.world(),
                args.config,
                c.train_flags(seq_len)
            );
            println!(
                "#    jobs: {} node(s), {} ranks per node: {}",
                l.nodes,
                l.ranks_per_node,
                c.job_settings(seq_len)
            );
        }
    }
    if args.format == "json" {
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        println!("{TABLE_UNITS}");
    }
    Ok(())
}

/// Names every layout that does not fit on stderr (which stage, how much, what a rank has);
/// an error unless `allow` (`--allow-oversubscribed-memory`).
pub fn check_memory(rows: &[Prediction], gib_per_node: f64, allow: bool) -> Result<()> {
    let over: Vec<&Prediction> = rows.iter().filter(|p| !p.fits).collect();
    for p in &over {
        let l = &p.layout;
        eprintln!(
            "does not fit: {} node(s), tp {} x pp {} x dp {}: pipeline stage {} needs {:.2} GiB per rank, \
             {:.2} GiB available ({gib_per_node} GiB per node / {} ranks per node)",
            l.nodes, l.tp, l.pp, l.dp, p.memory_stage, p.memory_gib_per_rank, p.memory_gib_available,
            l.ranks_per_node
        );
    }
    if !over.is_empty() && !allow {
        bail!(
            "{} layout(s) do not fit in memory (above): use fewer ranks per node, more tensor or \
             pipeline parallelism, --zero 1, --recompute attention|full or a smaller micro-batch; \
             --allow-oversubscribed-memory prints them without failing",
            over.len()
        );
    }
    Ok(())
}

/// What the table's columns measure, printed under it.
pub const TABLE_UNITS: &str = "# units: step ms and its parts (compute, tp comm, dp comm, pp = \
pipeline bubble and transfers, optim) in milliseconds per step; tokens/s for the whole job; \
TF/node = TFLOP/s per node (model FLOPs); %peak of the FP32 peak; GiB/rank = memory per rank of \
the fullest pipeline stage, stage = which; fits = within the node's memory over its ranks";

/// The prediction table: one line per node count, the step's parts in ms.
pub fn format_table(rows: &[Prediction]) -> String {
    let mut s = format!(
        "{:>6} {:>6} {:>9} {:>10} {:>10} {:>8} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>5} {:>4}\n",
        "nodes",
        "ranks",
        "tp/pp/dp",
        "step ms",
        "tokens/s",
        "TF/node",
        "%peak",
        "compute",
        "tp comm",
        "dp comm",
        "pp",
        "optim",
        "GiB/rank",
        "stage",
        "fits"
    );
    for p in rows {
        let t = |k: &str| p.timers_ms.get(k).copied().unwrap_or(0.0);
        let tp_comm: f64 = p
            .timers_ms
            .iter()
            .filter(|(k, _)| k.ends_with(":allreduce") && !k.starts_with("pipeline:"))
            .fold(0.0, |a, (_, v)| a + v);
        let dp = t(grads::ALLREDUCE_PARAMS) + t(grads::ALLGATHER_PARAMS);
        let pp = t("pipeline:bubble") + t("pipeline:recv") + t("pipeline:tied-wte:allreduce");
        let compute = t("forward") + t("backward") - tp_comm;
        let l = &p.layout;
        s += &format!(
            "{:>6} {:>6} {:>9} {:>10.1} {:>10.0} {:>8.3} {:>6.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>5} {:>4}\n",
            l.nodes,
            l.world(),
            format!("{}/{}/{}", l.tp, l.pp, l.dp),
            p.step_ms,
            p.tokens_per_s,
            p.tflops_per_node,
            p.peak_pct,
            compute,
            tp_comm,
            dp,
            pp,
            t("optimizer"),
            p.memory_gib_per_rank,
            p.memory_stage,
            if p.fits { "yes" } else { "NO" }
        );
    }
    s
}

fn run_profile(a: ProfileArgs) -> Result<()> {
    let mut profile = match (&a.base, &a.run, a.cores_per_node, a.memory_gib) {
        (Some(base), _, _, _) => Profile::load(base)?,
        (None, Some(run), Some(cores), Some(mem)) => {
            let m = measure(&a.name, run, &a.comm, &a.gemm, cores, mem)?;
            for n in &m.notes {
                eprintln!("{n}");
            }
            m.profile
        }
        _ => bail!("give --base PROFILE, or --run, --comm, --cores-per-node and --memory-gib"),
    };
    let mut header =
        "# fugu machine profile, written by `fugu predict profile` (docs/PREDICT.md)\n".to_string();
    if let Some(runs_path) = &a.fit {
        let runs = Runs::load(runs_path)?;
        let params = a
            .fit_params
            .iter()
            .map(|s| Param::parse(s.trim()))
            .collect::<Result<Vec<_>>>()?;
        let fitted = fit(&profile.machine(), &runs, &params)?;
        print!("{}", format_fit(&fitted));
        profile.network = fitted.network;
        profile.validate()?;
        header += &format!(
            "# network classes fitted to {} ({})\n",
            runs_path.display(),
            fitted
                .values
                .iter()
                .map(|(p, v)| format!("{} = {v:.4}", p.name()))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let text = toml::to_string(&profile)?;
    crate::atomic_write::write_file(&a.out, |w| {
        w.write_all(format!("{header}{text}").as_bytes())?;
        Ok(())
    })
    .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// The fitted values and every run's residual before and after, fitted runs marked.
pub fn format_fit(f: &Fitted) -> String {
    let mut s = String::new();
    for (p, v) in &f.values {
        s += &format!("fitted {} = {v:.4}\n", p.name());
    }
    let w = f
        .residuals
        .iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(3)
        .max(44);
    s += &format!(
        "{:<w$} {:>4} {:>10} {:>10} {:>8} {:>10} {:>8}\n",
        "run", "fit", "measured", "before", "error", "after", "error"
    );
    for r in &f.residuals {
        let err = |v: f64| 100.0 * (v - r.measured) / r.measured;
        s += &format!(
            "{:<w$} {:>4} {:>10.3} {:>10.3} {:>+7.0}% {:>10.3} {:>+7.0}%  {}\n",
            r.name,
            if r.fit { "yes" } else { "no" },
            r.measured,
            r.before,
            err(r.before),
            r.after,
            err(r.after),
            r.unit
        );
    }
    s
}

fn run_gemm_shapes(a: GemmShapesArgs) -> Result<()> {
    let cfg = RunConfig::load(&a.config)?;
    let seq_len = a.seq_len.unwrap_or(cfg.train.seq_len);
    let mut shapes = std::collections::BTreeSet::new();
    for &mbs in &a.micro_batch_size {
        for &tp in &a.tp {
            for &pp in &a.pp {
                if mbs == 0 || tp == 0 || pp == 0 {
                    bail!("--micro-batch-size, --tp and --pp must be at least 1");
                }
                let w = Workload {
                    model: cfg.model.clone(),
                    seq_len,
                    global_batch: mbs,
                    recompute: Default::default(),
                    loss_chunk: None,
                    // The shapes are the same in every precision.
                    precision: Default::default(),
                    pp_layers: None,
                };
                let l = Layout {
                    nodes: 1,
                    ranks_per_node: tp * pp,
                    threads_per_rank: 1,
                    tp,
                    pp,
                    dp: 1,
                    zero: false,
                    micro_batches: 1,
                };
                let calls = layout_gemms(&w, &l)
                    .with_context(|| format!("tp {tp}, pp {pp}, micro-batch size {mbs}"))?;
                shapes.extend(calls.iter().map(|c| c.shape.arg()));
            }
        }
    }
    let args: Vec<String> = shapes.iter().map(|s| format!("--shape {s}")).collect();
    println!("{}", args.join(" "));
    Ok(())
}

//! `fugu bench comm`: all-reduce, reduce-scatter, all-gather, broadcast and send/recv through
//! fugu's communicator over message sizes (`bench::comm`), run under an MPI launcher.

use crate::bench::comm::{format_table, parse_size, run as run_bench, CommOp, CommOptions};
use crate::train::dist::{count_hosts, hostname, Dist};
use anyhow::Result;
use serde::Serialize;

/// Arguments of `fugu bench comm`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchCommArgs {
    /// Operations (comma-separated): allreduce, reduce-scatter, allgather, broadcast,
    /// sendrecv. Default: all.
    #[arg(long = "op", value_delimiter = ',')]
    pub ops: Vec<String>,
    /// Smallest message (bytes; KiB, MiB, GiB suffixes).
    #[arg(long, default_value = "4")]
    pub min_size: String,
    /// Largest message; sizes are the powers of two in between.
    #[arg(long, default_value = "256MiB")]
    pub max_size: String,
    /// Timed samples per size (the median and the minimum are reported), after one
    /// warm-up sample whose result is checked.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Measure the communicators of one traffic class of a training layout instead of the
    /// whole job: `tp`, `pp` or `dp` groups of the trainer's grid for --tp and --pp (every
    /// group of the class runs at once, as in a step; the times are those of world rank 0's
    /// group). `fugu predict profile` fits that class's links from the result.
    #[arg(long, value_parser = ["tp", "pp", "dp"])]
    pub group: Option<String>,
    /// Tensor-parallel degree of the layout whose groups --group measures.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Pipeline stages of the layout whose groups --group measures.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Output format (only rank 0 prints).
    #[arg(long, default_value = "table", value_parser = ["table", "json"])]
    pub format: String,
}

/// The JSON document of `--format json`, read by `fugu report` and `fugu predict`.
#[derive(Serialize)]
struct CommReport<'a> {
    benchmark: &'static str,
    ranks: usize,
    nodes: usize,
    host: String,
    mpi_library: String,
    /// With --group: the class, and the whole job's ranks and nodes (`ranks` and `nodes` are
    /// then the measured group's).
    #[serde(skip_serializing_if = "Option::is_none")]
    group: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    job_ranks: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    job_nodes: Option<usize>,
    rows: &'a [crate::bench::comm::CommRow],
}

/// Runs the benchmark.
pub fn run(args: BenchCommArgs) -> Result<()> {
    let ops = if args.ops.is_empty() {
        CommOp::ALL.to_vec()
    } else {
        args.ops
            .iter()
            .map(|s| CommOp::parse(s.trim()))
            .collect::<Result<Vec<_>>>()?
    };
    let opts = CommOptions {
        ops,
        min_bytes: parse_size(&args.min_size)?,
        max_bytes: parse_size(&args.max_size)?,
        repeats: args.repeats,
        ..CommOptions::default()
    };
    let mut dist = Dist::init()?;
    let world = dist.world.clone();
    let comm = match args.group.as_deref() {
        None => world.clone(),
        Some(class) => {
            dist.make_grid(args.tp, args.pp, &layout_model(args.tp, args.pp))?;
            match class {
                "tp" => dist.tp.clone(),
                "pp" => dist.pp.clone(),
                _ => dist.dp.clone(),
            }
        }
    };
    if comm.size() < 2 {
        if let Some(class) = &args.group {
            anyhow::bail!(
                "--group {class}: the {class} groups of tp {} x pp {} on {} ranks have one rank each: nothing to measure",
                args.tp,
                args.pp,
                world.size()
            );
        }
    }
    let group_nodes = count_hosts(comm.as_ref());
    let rows = run_bench(comm.as_ref(), &opts)?;
    if world.rank() != 0 {
        return Ok(());
    }
    let mpi_library = mpi_library();
    let grouped = args.group.is_some();
    if args.format == "json" {
        let report = CommReport {
            benchmark: "comm",
            ranks: comm.size(),
            nodes: group_nodes,
            host: hostname(),
            mpi_library,
            group: args.group.clone(),
            job_ranks: grouped.then(|| world.size()),
            job_nodes: grouped.then_some(dist.nodes),
            rows: &rows,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let what = match &args.group {
            Some(c) => format!(
                "the {c} groups ({} ranks on {group_nodes} node(s) each) of tp {} x pp {} over {} ranks on {} node(s)",
                comm.size(),
                args.tp,
                args.pp,
                world.size(),
                dist.nodes
            ),
            None => format!("{} ranks on {} node(s)", world.size(), dist.nodes),
        };
        println!(
            "# fugu bench comm: {what}, {mpi_library}; time = median over {} samples of the slowest rank",
            opts.repeats
        );
        print!("{}", format_table(&rows));
    }
    Ok(())
}

/// A model shape any tp × pp grid accepts (the grid checks heads, blocks and widths): only the
/// communicators are used.
fn layout_model(tp: usize, pp: usize) -> crate::model::ModelConfig {
    crate::model::ModelConfig {
        n_head: tp.max(1),
        n_layer: pp.max(1),
        n_embd: 64 * tp.max(1),
        vocab_size: 128 * tp.max(1),
        n_positions: 64,
        ..Default::default()
    }
}

fn mpi_library() -> String {
    #[cfg(feature = "mpi")]
    {
        crate::parallel::mpi::MpiRuntime::library_version()
    }
    #[cfg(not(feature = "mpi"))]
    {
        "no MPI (built without --features mpi)".to_string()
    }
}

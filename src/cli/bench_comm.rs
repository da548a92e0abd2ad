//! `fugu bench comm`: all-reduce, reduce-scatter, all-gather, broadcast and send/recv through
//! fugu's communicator over message sizes (`bench::comm`), run under an MPI launcher.

use crate::bench::comm::{format_table, parse_size, run as run_bench, CommOp, CommOptions};
use crate::train::dist::{hostname, Dist};
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
    let dist = Dist::init()?;
    let world = dist.world.clone();
    let rows = run_bench(world.as_ref(), &opts)?;
    if world.rank() != 0 {
        return Ok(());
    }
    let mpi_library = mpi_library();
    if args.format == "json" {
        let report = CommReport {
            benchmark: "comm",
            ranks: world.size(),
            nodes: dist.nodes,
            host: hostname(),
            mpi_library,
            rows: &rows,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "# fugu bench comm: {} ranks on {} node(s), {mpi_library}; time = median over {} samples of the slowest rank",
            world.size(),
            dist.nodes,
            opts.repeats
        );
        print!("{}", format_table(&rows));
    }
    Ok(())
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

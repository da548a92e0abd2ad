//! The `fugu` command line: one module per subcommand.

mod bench_attention;
mod bench_comm;
mod bench_gemm;
pub use bench_gemm::{run as bench_gemm_run, BenchGemmArgs};
mod bench_io;
mod eval;
mod predict;
mod prepare;
mod report;
mod sample;
mod train;
pub use train::TrainArgs;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "fugu",
    version,
    about = "CPU-first GPT trainer for A64FX-class supercomputers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Tokenise text into WebDataset-style tar shards plus a manifest.
    Prepare(prepare::PrepareArgs),
    /// Train a GPT-2 (no arguments: gpt2-tiny on the bundled Shakespeare corpus).
    Train(Box<train::TrainArgs>),
    /// Generate text from a checkpoint.
    Sample(sample::SampleArgs),
    /// Evaluate a checkpoint: validation loss, perplexity and bits per byte, or accuracy on
    /// multiple-choice questions (HellaSwag's layout).
    Eval(Box<eval::EvalArgs>),
    /// Microbenchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// REPORT.md, SVG charts and CSV tables from training runs and GEMM benchmarks.
    Report(report::ReportArgs),
    /// Predict step time, throughput, breakdown and memory at any node count from a machine
    /// profile (`fugu predict profile` builds one from a run and `fugu bench comm`).
    Predict(Box<predict::PredictArgs>),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// GEMM throughput against matrixmultiply, as GFLOP/s and % of peak.
    Gemm(bench_gemm::BenchGemmArgs),
    /// Attention alone, forward and backward: the three-step path and each fused form, as
    /// ms, TFLOP/s and % of peak, each form checked against the three steps.
    Attention(bench_attention::BenchAttentionArgs),
    /// Data-loader throughput from the page cache.
    Io(bench_io::BenchIoArgs),
    /// Collectives and send/recv over message sizes: latency, algorithm and bus bandwidth
    /// (run it under an MPI launcher, at least 2 ranks).
    Comm(bench_comm::BenchCommArgs),
}

/// `fugu predict ... | head`: when the reader of stdout goes away, end as Unix tools do
/// (SIGPIPE's default action) instead of panicking in `println!`. Only for the commands that
/// print results and run in one process; MPI jobs keep their launcher's signal settings.
fn stop_quietly_on_a_closed_pipe() {
    // SAFETY: restores a signal's default disposition before any other thread exists; no
    // handler runs Rust code.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Entry point of the `fugu` binary.
pub fn main() -> ExitCode {
    let matches = Cli::command()
        .mut_subcommand("train", train::with_config_defaults)
        .get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if matches!(
        cli.command,
        Command::Prepare(_)
            | Command::Sample(_)
            | Command::Report(_)
            | Command::Predict(_)
            | Command::Bench(
                BenchCommand::Gemm(_) | BenchCommand::Attention(_) | BenchCommand::Io(_)
            )
    ) {
        stop_quietly_on_a_closed_pipe();
    }
    let result = match cli.command {
        Command::Prepare(args) => prepare::run(args),
        Command::Train(args) => train::run(*args),
        Command::Sample(args) => sample::run(args),
        Command::Eval(args) => eval::run(*args),
        Command::Bench(BenchCommand::Gemm(args)) => bench_gemm::run(args),
        Command::Bench(BenchCommand::Attention(args)) => bench_attention::run(args),
        Command::Bench(BenchCommand::Io(args)) => bench_io::run(args),
        Command::Bench(BenchCommand::Comm(args)) => bench_comm::run(args),
        Command::Report(args) => report::run(args),
        Command::Predict(args) => predict::run(*args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let msg = format!("{e:#}");
            if !msg.is_empty() {
                eprintln!("error: {msg}");
            }
            match e.downcast_ref::<crate::train::ExitError>() {
                Some(x) => ExitCode::from(x.code),
                None => ExitCode::FAILURE,
            }
        }
    }
}

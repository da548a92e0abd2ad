//! `cargo bench --bench gemm -- [fugu bench gemm options]`: the same benchmark as
//! `fugu bench gemm` (shape sets, baselines, JSON), built with the bench profile.

use clap::Parser;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    inner: fugu::cli::BenchGemmArgs,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() {
    let args = Args::parse();
    if let Err(e) = fugu::cli::bench_gemm_run(args.inner) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

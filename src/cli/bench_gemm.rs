//! `fugu bench gemm` (not implemented yet).

/// Arguments of `fugu bench gemm`.
#[derive(clap::Args, Debug)]
pub struct BenchGemmArgs {}

/// Runs the subcommand.
pub fn run(_args: BenchGemmArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

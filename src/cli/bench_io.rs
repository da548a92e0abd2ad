//! `fugu bench io` (not implemented yet).

/// Arguments of `fugu bench io`.
#[derive(clap::Args, Debug)]
pub struct BenchIoArgs {}

/// Runs the subcommand.
pub fn run(_args: BenchIoArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

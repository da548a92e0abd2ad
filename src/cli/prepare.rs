//! `fugu prepare` (not implemented yet).

/// Arguments of `fugu prepare`.
#[derive(clap::Args, Debug)]
pub struct PrepareArgs {}

/// Runs the subcommand.
pub fn run(_args: PrepareArgs) -> anyhow::Result<()> {
    anyhow::bail!("not implemented yet")
}

//! Benchmarks shared by the `fugu bench` subcommands and the `benches/` harnesses.

pub mod attention;
pub mod comm;
pub mod gemm;
#[cfg(feature = "openblas")]
pub mod openblas;
pub mod stats;

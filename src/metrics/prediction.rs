//! A predicted training step, as `fugu predict --format json` writes it and `fugu report
//! --predict` reads it back (the schema both sides share; `crate::predict` computes it).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A parallel layout: nodes, ranks and threads, and the parallel degrees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    pub nodes: usize,
    pub ranks_per_node: usize,
    pub threads_per_rank: usize,
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    pub zero: bool,
    /// Micro-batches per step per data-parallel replica.
    pub micro_batches: usize,
}

/// A predicted step (also read back by `fugu report --predict`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Prediction {
    pub layout: Layout,
    /// Sequences per micro-batch (the global batch over dp and the micro-batches).
    #[serde(default)]
    pub micro_batch_size: usize,
    pub step_ms: f64,
    pub tokens_per_s: f64,
    pub tflops_per_node: f64,
    pub peak_pct: f64,
    /// Per-timer ms per step, the same names a run records (parents are the sums of their
    /// children), for the slowest pipeline stage.
    pub timers_ms: BTreeMap<String, f64>,
    /// Blocks per pipeline stage (what `fugu train --pp-layers` takes to run this split).
    #[serde(default)]
    pub pp_layers: Vec<usize>,
    /// Memory per rank of the fullest pipeline stage (GiB), and which stage that is (0-based).
    pub memory_gib_per_rank: f64,
    #[serde(default)]
    pub memory_stage: usize,
    /// Memory per rank of every pipeline stage (GiB), first to last.
    #[serde(default)]
    pub memory_gib_per_stage: Vec<f64>,
    /// What one rank may use: the node's memory over the layout's ranks per node (GiB).
    #[serde(default)]
    pub memory_gib_available: f64,
    pub fits: bool,
}

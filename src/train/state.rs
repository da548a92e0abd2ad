//! `state.json`: everything besides tensors that a checkpoint needs for an exact resume.

use crate::config::RunConfig;
use serde::{Deserialize, Serialize};

/// Format tag of [`TrainState`].
pub const STATE_FORMAT: &str = "fugu-train-state-v1";

/// Saved next to `model.safetensors` and `optimizer.safetensors` in every checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainState {
    /// Always [`STATE_FORMAT`].
    pub format: String,
    /// Optimizer steps completed; training resumes at this 0-based step.
    pub step: u64,
    /// The run's full configuration (the model part must not change on resume).
    pub config: RunConfig,
    /// The `--data` argument the run reads.
    pub data: String,
    /// Position of the training data loader after `step` steps.
    pub cursor: fugu_io::Cursor,
    /// Training tokens consumed so far (all data-parallel ranks).
    pub tokens_seen: u64,
    /// Steps skipped because the loss or gradients were not finite.
    pub skipped_nonfinite: u64,
    /// Compute threads per process when written (resume is bit-exact for the same count).
    pub threads: usize,
    /// `fugu` version that wrote it.
    pub fugu_version: String,
    /// Whether the training data is read shuffled (absent in checkpoints of older versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shuffle: Option<bool>,
    /// The parallel layout that wrote it (absent in single-process checkpoints of older
    /// versions). The model files are layout-free; only the data streams depend on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<SavedLayout>,
    /// fp16 runs: the dynamic loss scaler's state (scale, clean-step count, overflows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scaler: Option<super::loss_scale::LossScaler>,
}

/// The parallel layout of the run that wrote a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedLayout {
    /// Pipeline stages (absent in checkpoints from before pipeline parallelism: 1).
    #[serde(default = "one")]
    pub pp: usize,
    pub tp: usize,
    pub dp: usize,
    pub zero: u8,
    /// Data streams the global batch is read as (`--data-ranks`).
    pub data_ranks: usize,
}

fn one() -> usize {
    1
}

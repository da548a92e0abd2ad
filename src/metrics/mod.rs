//! Observability for the trainer: per-op timers and the end-of-run breakdown
//! ([`timers`]), what ops cost ([`cost`], declared by each model), Megatron's FLOPs formula
//! ([`flops`]), the machine and its FP32 peak ([`machine`], the same
//! figure `fugu bench gemm` reports against; measured once per machine and cached by
//! [`peak_cache`]), its memory bandwidth ([`bandwidth`], cached the same way), `OUT/metrics.jsonl` ([`jsonl`]), the
//! same scalars as TensorBoard event files ([`tensorboard`]) and the step progress display
//! ([`progress`]).

pub mod bandwidth;
pub mod flops;
pub mod jsonl;
pub mod machine;
pub mod ops;
pub mod peak_cache;
pub mod prediction;
pub mod progress;
pub mod tensorboard;
pub mod timers;

pub use flops::megatron_flops_per_step;
pub use jsonl::{read_metrics, EvalRecord, MetricsWriter, Record, StepRecord};
pub use machine::MachineInfo;
pub use progress::{stderr_is_tty, Progress, StepLine};
pub use timers::{Breakdown, BreakdownRow, Roofs, TimerGuard, TimerLevel, Timers, Work};

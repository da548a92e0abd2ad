//! fugu: a CPU-first GPT trainer for A64FX-class supercomputers.

pub mod atomic_write;
pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod choices;
pub mod cli;
pub mod comm;
pub mod config;
pub mod dtype;
pub mod make_once;
pub mod metrics;
pub mod model;
pub mod ops;
pub mod parallel;
pub mod predict;
pub mod report;
pub mod sample;
pub mod train;
pub mod user_cache;

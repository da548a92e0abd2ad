//! fugu: a CPU-first GPT trainer for A64FX-class supercomputers.

pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod model;

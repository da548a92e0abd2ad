//! The models (GPT-2 and the Llama family; [`registry`] maps a config's [`shape::Arch`] to one)
//! behind one contract ([`contract::Model`]): tensor tables that carve parameters, gradients and
//! activations out of one allocation each (the llm.c way), deterministic initialisation, the
//! forward/backward passes over a [`crate::backend::Backend`], and what each op costs
//! ([`cost`]).

pub mod acts;
pub mod contract;
pub mod core;
pub mod cost;
pub mod decoder;
pub mod decoder_cost;
pub mod decoder_ops;
pub mod gpt2;
pub mod gpt2_cost;
pub mod gpt2_hf;
pub mod hf_fields;
pub mod hf_layout;
pub mod init;
pub mod kv;
pub mod layers;
pub mod llama;
pub mod llama_cost;
pub mod llama_hf;
pub mod llama_params;
pub mod params;
pub mod passes;
pub mod paths;
pub mod registry;
pub mod shape;
pub mod stage;
pub mod table;
pub mod work;

pub use contract::{Model, ModelBuffers, OpForm, OptimStep, TpRank};
pub use gpt2::Gpt2;
pub use shape::{Arch, ModelConfig, SpecialIds};
pub use stage::Stage;
pub use table::OwnedRange;

//! The GPT-2 model: tensor tables that carve parameters, gradients and activations out of one
//! allocation each (the llm.c way), deterministic initialisation, and the forward/backward
//! passes over a [`crate::backend::Backend`].

pub mod acts;
pub mod gpt2;
pub mod init;
pub mod kv;
pub mod params;
pub mod paths;
pub mod stage;
pub mod table;
pub mod work;

pub use gpt2::{Gpt2, OptimStep, TpRank};
pub use stage::Stage;
pub use table::OwnedRange;

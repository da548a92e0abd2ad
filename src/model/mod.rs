//! The GPT-2 model: the tensor tables that carve parameters, gradients and activations out of
//! one allocation each (the llm.c way), and (to come) the forward/backward passes.

pub mod table;

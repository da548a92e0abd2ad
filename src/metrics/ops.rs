//! Op catalogues: every timer name a run can write, each with its [`OpClass`], declared once
//! where the ops are run. A model declares its own ([`crate::model::registry::ops`]; GPT-2's
//! in `model/decoder_ops.rs`), the trainer the names of its phases ([`trainer`]). The breakdown's
//! GEMM share ([`super::Breakdown`]) and the report's categories read a timer's class here
//! instead of guessing it from its name; code that times an op names it through the constants
//! [`op_catalogue!`] makes, so a typo is a compile error.

/// What a timed op computes: the breakdown's GEMM / non-GEMM shares and the report's stacked
/// bars group timers by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// A linear layer's GEMM (forward: one; backward: the input and weight gradients).
    Gemm,
    /// Attention's batched matrix products: scores, context, both fused, or a decode step.
    AttentionMatmul,
    /// Attention's softmax (and its backward).
    AttentionSoftmax,
    /// Attention's scores and softmax computed again in the backward pass.
    AttentionRecompute,
    /// A normalisation layer (LayerNorm, RMSNorm).
    Norm,
    /// An activation function or a residual add: elementwise, memory-bound.
    Activation,
    /// The token (and position) embedding lookup and its gradient.
    Embedding,
    /// The cross-entropy loss.
    Loss,
    /// A collective (tensor- or data-parallel all-reduce, all-gather) or pipeline transfer.
    Communication,
    /// A pipeline stage waiting for its neighbour.
    Bubble,
    /// A block's forward pass computed again in the backward pass.
    Recompute,
    /// Gradient clipping and the parameter update.
    Optimizer,
    /// Batch generation.
    Data,
    /// A phase or layer that contains other timers (`forward`, `forward:attention`): its own
    /// time is what its children do not cover.
    Scope,
}

/// Which share of the step an op's time counts in ([`super::Breakdown::gemm_pct`] and
/// `non_gemm_pct`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Share {
    /// Matrix products: linear layers and attention's.
    Gemm,
    /// The rest of the model's compute, and the optimizer.
    NonGemm,
}

impl OpClass {
    /// The share this class's time counts in; `None` for communication, waiting, data,
    /// recomputation and scopes (a scope's time is its children's). A timer inside one that
    /// counts (`optimizer:clip` in `optimizer`) is not counted again.
    pub fn share(self) -> Option<Share> {
        use OpClass::*;
        match self {
            Gemm | AttentionMatmul => Some(Share::Gemm),
            AttentionSoftmax | Norm | Activation | Embedding | Loss | Optimizer => {
                Some(Share::NonGemm)
            }
            AttentionRecompute | Communication | Bubble | Recompute | Data | Scope => None,
        }
    }
}

/// One timed op: its full timer name (`forward:attention:qkv`) and class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    pub name: &'static str,
    pub class: OpClass,
}

/// The ops one part of the program times.
#[derive(Clone, Copy, Debug)]
pub struct OpCatalogue {
    pub ops: &'static [Op],
}

impl OpCatalogue {
    /// The class of a timer name, if this catalogue declares it.
    pub fn class_of(&self, name: &str) -> Option<OpClass> {
        self.ops
            .iter()
            .find(|op| op.name == name)
            .map(|op| op.class)
    }
}

/// Declares an op catalogue: for each group (`forward { ... }`) a module of name constants
/// (`forward::QKV`), and `static OPS`, the [`OpCatalogue`] of every name with its class.
///
/// ```ignore
/// op_catalogue! {
///     forward {
///         QKV = "forward:attention:qkv" => Gemm;
///     }
/// }
/// ```
macro_rules! op_catalogue {
    ($($group:ident { $($(#[$doc:meta])* $konst:ident = $name:literal => $class:ident;)* })*) => {
        $(
            #[allow(dead_code)]
            pub mod $group {
                $($(#[$doc])* pub const $konst: &str = $name;)*
            }
        )*
        /// Every timer name declared here, with its class.
        pub static OPS: $crate::metrics::ops::OpCatalogue = $crate::metrics::ops::OpCatalogue {
            ops: &[$($($crate::metrics::ops::Op {
                name: $name,
                class: $crate::metrics::ops::OpClass::$class,
            },)*)*],
        };
    };
}
pub(crate) use op_catalogue;

/// The timers of the trainer's phases and of its communication, around the model's ops, and
/// those of the optimizer step every model runs.
pub mod trainer {
    super::op_catalogue! {
        phase {
            FORWARD = "forward" => Scope;
            BACKWARD = "backward" => Scope;
            OPTIMIZER = "optimizer" => Optimizer;
        }
        data {
            BATCH_GENERATOR = "forward:batch-generator" => Data;
        }
        grads {
            /// The data-parallel gradient all-reduce (Megatron's name).
            ALLREDUCE_PARAMS = "allreduce-params" => Communication;
            /// ZeRO-1: the updated parameters gathered from their owners.
            ALLGATHER_PARAMS = "allgather-params" => Communication;
        }
        optimizer {
            /// Within a model's optimizer step: the gradient norm and clipping, then the update.
            CLIP = "optimizer:clip" => Optimizer;
            ADAMW = "optimizer:adamw" => Optimizer;
        }
        pipeline {
            BUBBLE = "pipeline:bubble" => Bubble;
            SEND = "pipeline:send" => Communication;
            RECV = "pipeline:recv" => Communication;
            TIED_ALLREDUCE = "pipeline:tied-wte:allreduce" => Communication;
        }
    }
}

/// The class of a timer name in the first of `catalogues` that declares it; a `P:(other)` row
/// (the part of timer `P` outside its children) takes `P`'s.
pub fn class_of(catalogues: &[&OpCatalogue], name: &str) -> Option<OpClass> {
    let name = name.strip_suffix(":(other)").unwrap_or(name);
    catalogues.iter().find_map(|c| c.class_of(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_rows_take_their_parents_class() {
        let cats = [&trainer::OPS];
        assert_eq!(
            class_of(&cats, "optimizer:(other)"),
            Some(OpClass::Optimizer)
        );
        assert_eq!(
            class_of(&cats, trainer::pipeline::BUBBLE),
            Some(OpClass::Bubble)
        );
        assert_eq!(class_of(&cats, "(other)"), None);
        assert_eq!(class_of(&cats, "forward:something-new"), None);
    }
}

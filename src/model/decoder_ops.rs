//! The op catalogue of the decoder-only transformers fugu builds: the timer name and class of
//! every op their passes run ([`crate::metrics::ops`]). The models (`gpt2.rs`, `passes.rs`)
//! name their timers through these constants; the breakdown and the report classify them
//! from [`OPS`]. An architecture runs the ops it has; the names say what an op is, not whose.

crate::metrics::ops::op_catalogue! {
    forward {
        EMBEDDING = "forward:embedding" => Embedding;
        /// Vocabulary-parallel embedding: the partial lookups summed over the TP group.
        EMBEDDING_ALLREDUCE = "forward:embedding:allreduce" => Communication;
        LAYERNORM = "forward:layernorm" => Norm;
        RMSNORM = "forward:rmsnorm" => Norm;
        ATTENTION = "forward:attention" => Scope;
        QKV = "forward:attention:qkv" => Gemm;
        /// Rotary embeddings of q and k, in place.
        ROPE = "forward:attention:rope" => Activation;
        BADDBMM = "forward:attention:baddbmm" => AttentionMatmul;
        SOFTMAX = "forward:attention:softmax" => AttentionSoftmax;
        BMM = "forward:attention:bmm" => AttentionMatmul;
        /// Scores, softmax and context in one kernel.
        FUSED = "forward:attention:fused" => AttentionMatmul;
        /// One token against the KV cache (sampling).
        DECODE = "forward:attention:decode" => AttentionMatmul;
        PROJ = "forward:attention:proj" => Gemm;
        ATTENTION_ALLREDUCE = "forward:attention:allreduce" => Communication;
        MLP = "forward:mlp" => Scope;
        MLP_MM = "forward:mlp:mm" => Gemm;
        GELU = "forward:mlp:gelu" => Activation;
        SWIGLU = "forward:mlp:swiglu" => Activation;
        MLP_ALLREDUCE = "forward:mlp:allreduce" => Communication;
        RESIDUAL = "forward:residual" => Activation;
        LM_HEAD = "forward:lm-head" => Gemm;
        LOSS = "forward:loss" => Loss;
        /// Vocabulary-parallel cross-entropy: row maxima and sums over the TP group.
        LOSS_ALLREDUCE = "forward:loss:allreduce" => Communication;
    }
    backward {
        EMBEDDING = "backward:embedding" => Embedding;
        LAYERNORM = "backward:layernorm" => Norm;
        RMSNORM = "backward:rmsnorm" => Norm;
        /// `--recompute full`: a block's forward pass again, its inner timers paused.
        RECOMPUTE = "backward:recompute" => Recompute;
        ATTENTION = "backward:attention" => Scope;
        QKV = "backward:attention:qkv" => Gemm;
        ROPE = "backward:attention:rope" => Activation;
        BADDBMM = "backward:attention:baddbmm" => AttentionMatmul;
        SOFTMAX = "backward:attention:softmax" => AttentionSoftmax;
        BMM = "backward:attention:bmm" => AttentionMatmul;
        FUSED = "backward:attention:fused" => AttentionMatmul;
        /// `--recompute attention`: the layer's probabilities again.
        ATTENTION_RECOMPUTE = "backward:attention:recompute" => AttentionRecompute;
        PROJ = "backward:attention:proj" => Gemm;
        ATTENTION_ALLREDUCE = "backward:attention:allreduce" => Communication;
        MLP = "backward:mlp" => Scope;
        MLP_MM = "backward:mlp:mm" => Gemm;
        GELU = "backward:mlp:gelu" => Activation;
        SWIGLU = "backward:mlp:swiglu" => Activation;
        MLP_ALLREDUCE = "backward:mlp:allreduce" => Communication;
        RESIDUAL = "backward:residual" => Activation;
        LM_HEAD = "backward:lm-head" => Gemm;
        LM_HEAD_ALLREDUCE = "backward:lm-head:allreduce" => Communication;
        LOSS = "backward:loss" => Loss;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::ops::Share;

    #[test]
    fn each_op_counts_in_the_share_its_last_word_gave_it() {
        // The words the breakdown's GEMM and non-GEMM shares went by before the catalogue (a
        // decode step was in neither; `:allreduce` children are communication).
        const GEMM: &[&str] = &["qkv", "baddbmm", "bmm", "fused", "proj", "mm", "lm-head"];
        const NON_GEMM: &[&str] = &[
            "softmax",
            "layernorm",
            "rmsnorm",
            "rope",
            "swiglu",
            "gelu",
            "residual",
            "embedding",
            "loss",
        ];
        for op in OPS.ops.iter().filter(|op| op.name != forward::DECODE) {
            let last = op.name.rsplit(':').next().unwrap();
            let want = if GEMM.contains(&last) {
                Some(Share::Gemm)
            } else if NON_GEMM.contains(&last) {
                Some(Share::NonGemm)
            } else {
                None
            };
            assert_eq!(op.class.share(), want, "{}", op.name);
        }
    }
}

//! Tensor tables: a list of (name, shape) carved out of one flat `f32` allocation.
//!
//! Parameters, gradients and optimizer moments share the parameter table, so a checkpoint, an
//! all-reduce bucket or a ZeRO shard is a slice of one buffer. Every tensor starts on a
//! 64-byte boundary. Each parameter's tensor-parallel [`Split`] is declared where the table is
//! built ([`gpt2_params`]); the shard shapes, the full ↔ shard copies (`parallel/shard.rs`)
//! and the gradient-norm rule for replicated tensors all follow from it.

use super::stage::Stage;
use crate::model::ModelConfig;
use anyhow::{bail, Result};
use std::collections::HashMap;

/// Floats per alignment unit (64 bytes).
const ALIGN: usize = 16;

/// How one tensor is split across tensor-parallel ranks (Megatron's layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it.
    Replicated,
    /// The first dimension is split into `tp` contiguous blocks (row-parallel weights, the
    /// vocabulary-parallel embedding).
    Rows,
    /// The last dimension is `parts` equal blocks (q, k, v for `c_attn`), each split into `tp`
    /// (column-parallel weights and biases).
    Cols { parts: usize },
}

impl Split {
    /// The shape one of `tp` ranks holds of a tensor of `full` shape.
    pub fn shard_shape(self, full: &[usize], tp: usize) -> Vec<usize> {
        let mut s = full.to_vec();
        match self {
            Split::Replicated => {}
            Split::Rows => s[0] /= tp,
            Split::Cols { .. } => *s.last_mut().expect("a split tensor has a shape") /= tp,
        }
        s
    }
}

/// A range of the flat parameter buffer that one rank's optimizer updates (ZeRO-1), and where
/// its AdamW moments start in the (possibly shorter) moment buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedRange {
    pub flat: std::ops::Range<usize>,
    pub moment_offset: usize,
}

/// One tensor of a table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Hugging Face GPT-2 name (e.g. `h.0.attn.c_attn.weight`).
    pub name: String,
    /// Shape in the model's own layout (Conv1D weights are (in, out), as in HF files): this
    /// rank's shard in a tensor-parallel table.
    pub shape: Vec<usize>,
    /// Offset of the first element in the flat buffer.
    pub offset: usize,
    /// AdamW weight decay applies (2-D tensors: matrices and embeddings).
    pub decay: bool,
    /// How the tensor is split across tensor-parallel ranks.
    pub split: Split,
}

impl TensorSpec {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    /// True for a tensor with no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The element range in the flat buffer.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// An ordered set of tensors in one flat buffer.
#[derive(Clone, Debug, Default)]
pub struct Table {
    specs: Vec<TensorSpec>,
    index: HashMap<String, usize>,
    total: usize,
}

impl Table {
    /// Appends a tensor (aligned to 64 bytes, not split) and returns its index.
    pub fn push(&mut self, name: impl Into<String>, shape: &[usize]) -> usize {
        self.push_split(name, shape, Split::Replicated, 1)
    }

    /// Appends rank-local shard of a tensor of `full` shape split by `split` over `tp` ranks.
    pub fn push_split(
        &mut self,
        name: impl Into<String>,
        full: &[usize],
        split: Split,
        tp: usize,
    ) -> usize {
        let offset = self.total.next_multiple_of(ALIGN);
        self.push_at(name.into(), full, (split, tp), offset)
    }

    /// Appends tensors back to back (the first aligned, each next one where the previous
    /// ends), each split by `split` over `tp` ranks: parts of one fused matrix (a layer's q,
    /// k and v weights as one (out, in) GEMM operand), which stay separate tensors in files.
    pub fn push_joined(&mut self, parts: &[(String, Vec<usize>)], split: Split, tp: usize) {
        let mut offset = self.total.next_multiple_of(ALIGN);
        for (name, full) in parts {
            let i = self.push_at(name.clone(), full, (split, tp), offset);
            offset = self.specs[i].range().end;
        }
    }

    fn push_at(
        &mut self,
        name: String,
        full: &[usize],
        (split, tp): (Split, usize),
        offset: usize,
    ) -> usize {
        let spec = TensorSpec {
            decay: full.len() == 2,
            name: name.clone(),
            shape: split.shard_shape(full, tp),
            offset,
            split,
        };
        self.total = offset + spec.len();
        self.index.insert(name, self.specs.len());
        self.specs.push(spec);
        self.specs.len() - 1
    }

    /// Floats the flat buffer needs.
    pub fn total(&self) -> usize {
        self.total.next_multiple_of(ALIGN)
    }

    /// All tensors in order.
    pub fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&TensorSpec> {
        self.index.get(name).map(|&i| &self.specs[i])
    }

    /// Number of elements over all tensors (without alignment padding).
    pub fn elements(&self) -> usize {
        self.specs.iter().map(TensorSpec::len).sum()
    }
}

/// The vocabulary size inside the model: padded up to a multiple of 128 so the LM-head GEMM
/// has friendly shapes. Padded rows of `wte` are zero and never written to files.
pub fn padded_vocab(vocab: usize) -> usize {
    vocab.next_multiple_of(128)
}

/// The parameter table of GPT-2 for tensor-parallel degree `tp` (this rank's shards; 1 = all):
/// the whole model as one pipeline stage ([`gpt2_stage_params`]).
pub fn gpt2_params(m: &ModelConfig, tp: usize) -> Result<Table> {
    gpt2_stage_params(m, tp, &Stage::whole(m.n_layer))
}

/// The parameter table of one pipeline stage of GPT-2 for tensor-parallel degree `tp`.
///
/// Names follow Hugging Face's `model.safetensors` for `gpt2`. Each tensor's split is declared
/// here (Megatron's layout; Conv1D weights are stored (in, out)): column-parallel `c_attn` (q,
/// k and v each split by heads) and `c_fc` (by MLP units), weights and biases; row-parallel
/// attention and MLP `c_proj` weights (by input rows; their biases are replicated and added
/// once, after the all-reduce); vocabulary-parallel `wte` (by vocabulary rows; it is also the
/// tied LM head); `wpe` and the LayerNorms replicated.
///
/// Which tensors a stage holds is declared here too: the first stage `wte` and `wpe`, its
/// blocks `h.L.*` for L in `stage.layers`, the last stage `ln_f` and `wte` again (the tied LM
/// head: the first and the last stage each hold a copy and all-reduce its gradient). `wte`
/// comes first in every table that has it, so its gradient is the last to be final in the
/// backward pass.
pub fn gpt2_stage_params(m: &ModelConfig, tp: usize, stage: &Stage) -> Result<Table> {
    if tp == 0 || !m.n_head.is_multiple_of(tp) {
        bail!(
            "tensor parallel degree {tp} does not divide model.n_head = {}",
            m.n_head
        );
    }
    if !(4 * m.n_embd).is_multiple_of(tp) {
        bail!(
            "tensor parallel degree {tp} does not divide the MLP width 4*n_embd = {}",
            4 * m.n_embd
        );
    }
    let c = m.n_embd;
    let vp = padded_vocab(m.vocab_size);
    if !vp.is_multiple_of(tp) {
        bail!("tensor parallel degree {tp} does not divide the padded vocabulary {vp}");
    }
    let (rows, qkv, units) = (
        Split::Rows,
        Split::Cols { parts: 3 },
        Split::Cols { parts: 1 },
    );
    let mut t = Table::default();
    if stage.is_first() || stage.is_last() {
        t.push_split("wte.weight", &[vp, c], rows, tp);
    }
    if stage.is_first() {
        t.push("wpe.weight", &[m.n_positions, c]);
    }
    for l in stage.layers.clone() {
        let p = |s: &str| format!("h.{l}.{s}");
        t.push(p("ln_1.weight"), &[c]);
        t.push(p("ln_1.bias"), &[c]);
        t.push_split(p("attn.c_attn.weight"), &[c, 3 * c], qkv, tp);
        t.push_split(p("attn.c_attn.bias"), &[3 * c], qkv, tp);
        t.push_split(p("attn.c_proj.weight"), &[c, c], rows, tp);
        t.push(p("attn.c_proj.bias"), &[c]);
        t.push(p("ln_2.weight"), &[c]);
        t.push(p("ln_2.bias"), &[c]);
        t.push_split(p("mlp.c_fc.weight"), &[c, 4 * c], units, tp);
        t.push_split(p("mlp.c_fc.bias"), &[4 * c], units, tp);
        t.push_split(p("mlp.c_proj.weight"), &[4 * c, c], rows, tp);
        t.push(p("mlp.c_proj.bias"), &[c]);
    }
    if stage.is_last() {
        t.push("ln_f.weight", &[c]);
        t.push("ln_f.bias", &[c]);
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;

    #[test]
    fn gpt2_124m_has_the_known_parameter_count() {
        let m = RunConfig::load("gpt2-124m").unwrap().model;
        let t = gpt2_params(&m, 1).unwrap();
        // 124,439,808 with the unpadded 50257 vocabulary (the published GPT-2 small count);
        // padding adds (50304 - 50257) * 768 rows inside the model.
        assert_eq!(t.elements(), 124_439_808 + (50304 - 50257) * 768);
        assert_eq!(t.get("wte.weight").unwrap().shape, vec![50304, 768]);
        assert_eq!(
            t.get("h.11.mlp.c_proj.weight").unwrap().shape,
            vec![3072, 768]
        );
        assert!(t.get("h.0.attn.c_attn.weight").unwrap().decay);
        assert!(!t.get("h.0.attn.c_attn.bias").unwrap().decay);
        assert!(t.specs().iter().all(|s| s.offset % 16 == 0));
        assert!(t.total() >= t.elements());
    }

    #[test]
    fn tensor_parallel_shards_and_errors() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model;
        let t = gpt2_params(&m, 2).unwrap();
        assert_eq!(
            t.get("h.0.attn.c_attn.weight").unwrap().shape,
            vec![128, 192]
        );
        assert_eq!(
            t.get("h.0.mlp.c_proj.weight").unwrap().shape,
            vec![256, 128]
        );
        // The split is declared with each tensor and gives the shard shape.
        let split = |n: &str| t.get(n).unwrap().split;
        assert_eq!(split("wte.weight"), Split::Rows);
        assert_eq!(split("h.1.attn.c_attn.bias"), Split::Cols { parts: 3 });
        assert_eq!(split("h.1.mlp.c_fc.weight"), Split::Cols { parts: 1 });
        assert_eq!(split("h.1.attn.c_proj.bias"), Split::Replicated);
        assert_eq!(split("ln_f.weight"), Split::Replicated);
        assert_eq!(t.get("wte.weight").unwrap().shape, vec![50304 / 2, 128]);
        let e = gpt2_params(&m, 3).unwrap_err().to_string();
        assert!(e.contains("n_head = 4"), "{e}");
    }

    #[test]
    fn a_stage_holds_its_blocks_and_its_ends() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model; // 4 blocks
        let names = |index: usize, layers: std::ops::Range<usize>| -> Vec<String> {
            let st = Stage {
                index,
                count: 3,
                layers,
            };
            let t = gpt2_stage_params(&m, 1, &st).unwrap();
            t.specs().iter().map(|s| s.name.clone()).collect()
        };
        let first = names(0, 0..1);
        assert_eq!(&first[..3], ["wte.weight", "wpe.weight", "h.0.ln_1.weight"]);
        assert!(!first
            .iter()
            .any(|n| n.starts_with("h.1.") || n == "ln_f.weight"));
        let mid = names(1, 1..3);
        assert_eq!(mid[0], "h.1.ln_1.weight");
        assert_eq!(mid.len(), 2 * 12);
        let last = names(2, 3..4);
        assert_eq!(&last[..2], ["wte.weight", "h.3.ln_1.weight"]);
        assert_eq!(last.last().unwrap(), "ln_f.bias");
        assert!(!last.contains(&"wpe.weight".to_string()));
        // The whole model is the one stage of a one-stage pipeline.
        let whole = gpt2_params(&m, 1).unwrap();
        assert_eq!(whole.specs().len(), 2 + 4 * 12 + 2);
    }

    #[test]
    fn vocab_padding() {
        assert_eq!(padded_vocab(50257), 50304);
        assert_eq!(padded_vocab(128), 128);
        assert_eq!(padded_vocab(101), 128);
    }
}

//! What a model's compute ops cost, per micro-batch on one rank, for work not run: the GEMM
//! calls of each op, or the elements it touches. Each architecture declares its [`CostModel`]
//! once, beside its op catalogue (`model/gpt2_cost.rs`); `fugu predict` scales a reference
//! run's op times by it, times GEMMs at measured rates with it, pipeline stages are balanced
//! by it, and model FLOPs (MFU) are summed from it.

use super::ModelConfig;
use serde::{Deserialize, Serialize};

/// `batch` GEMMs of C (m×n) = A (m×k) · B (k×n), row-major, with A stored transposed when
/// `ta` and B stored transposed when `tb` (as the trainer's backward pass uses them). Written
/// `MxNxK[xBATCH][:ta][:tb]` on the command line (`bench::gemm::parse_shape`,
/// [`GemmShape::arg`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GemmShape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub ta: bool,
    pub tb: bool,
}

impl GemmShape {
    /// FLOPs of the whole batch.
    pub fn flops(&self) -> f64 {
        // In f64: a layout of a billion ranks overflows the integer product.
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * self.batch as f64
    }

    /// The shape in `--shape` syntax (what `parse_shape` reads back).
    pub fn arg(&self) -> String {
        let mut s = format!("{}x{}x{}", self.m, self.n, self.k);
        if self.batch > 1 {
            s += &format!("x{}", self.batch);
        }
        if self.ta {
            s += ":ta";
        }
        if self.tb {
            s += ":tb";
        }
        s
    }
}

/// A forward or backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Backward,
}

/// One GEMM shape, called `count` times per micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct GemmCall {
    pub shape: GemmShape,
    pub count: usize,
}

impl GemmCall {
    /// `count` calls of `batch` GEMMs `m × n × k`, A and B transposed as `ta`, `tb`.
    pub fn new(
        [m, n, k]: [usize; 3],
        batch: usize,
        (ta, tb): (bool, bool),
        count: usize,
    ) -> GemmCall {
        GemmCall {
            shape: GemmShape {
                m,
                n,
                k,
                batch,
                ta,
                tb,
            },
            count,
        }
    }

    /// FLOPs of all `count` calls.
    pub fn flops(&self) -> f64 {
        self.shape.flops() * self.count as f64
    }
}

/// The work of one op in one pass: GEMM calls, or (for the rest) elements touched, whose
/// ratios between two layouts are all that is used.
#[derive(Clone, Debug, PartialEq)]
pub enum OpWork {
    Gemms(Vec<GemmCall>),
    Elements(f64),
}

/// The memory traffic of a non-GEMM op per element of its [`OpWork::Elements`]: how many
/// values it reads plus writes of the step's activation type (f32, or 16-bit under
/// `--precision bf16|fp16`) and of f32 (parameter gradients, statistics, tokens). What
/// `fugu predict` times such an op by on a machine known by its kernels' rates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Streams {
    pub act: f64,
    pub f32: f64,
}

impl Streams {
    /// Bytes moved over `elements` elements with activations of `act_bytes` bytes.
    pub fn bytes(self, elements: f64, act_bytes: f64) -> f64 {
        elements * (self.act * act_bytes + self.f32 * 4.0)
    }
}

/// The part of a model one rank works on per micro-batch.
#[derive(Clone, Copy, Debug)]
pub struct Slice<'a> {
    pub model: &'a ModelConfig,
    pub seq_len: usize,
    /// Sequences per micro-batch.
    pub mb: usize,
    /// Tensor-parallel degree.
    pub tp: usize,
    /// The blocks this rank runs, and whether it holds the embeddings (first pipeline stage)
    /// and the LM head and loss (last).
    pub layers: usize,
    pub first: bool,
    pub last: bool,
    /// Vocabulary rows the LM head computes: the padded vocabulary for time, the file's
    /// `vocab_size` for model FLOPs (MFU's convention).
    pub vocab: usize,
}

/// A compute op by its timer names (the model's op catalogue); its forward name identifies it
/// to [`CostModel::work`].
#[derive(Clone, Copy, Debug)]
pub struct ComputeOp {
    pub forward: &'static str,
    pub backward: Option<&'static str>,
}

impl ComputeOp {
    /// An op with a forward and a backward timer.
    pub const fn both(forward: &'static str, backward: &'static str) -> ComputeOp {
        ComputeOp {
            forward,
            backward: Some(backward),
        }
    }

    /// Its timer name in `pass`, if it runs there.
    pub fn name(self, pass: Pass) -> Option<&'static str> {
        match pass {
            Pass::Forward => Some(self.forward),
            Pass::Backward => self.backward,
        }
    }
}

/// A collective one rank makes per micro-batch: its timer name, bytes per call, calls.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Collective {
    pub name: &'static str,
    pub bytes: f64,
    pub calls: f64,
}

/// An architecture's compute ops and what each costs (module docs), and the communication its
/// layout implies.
pub struct CostModel {
    /// The compute ops, by timer name.
    pub ops: &'static [ComputeOp],
    /// The work of the op whose forward timer is `op`, in `pass`, on a slice; `None` for a name
    /// that is not one of [`Self::ops`].
    pub work: fn(op: &str, pass: Pass, s: &Slice) -> Option<OpWork>,
    /// The memory traffic per element of a non-GEMM op (forward timer name) in `pass`;
    /// `None` for a GEMM op or a name that is not one of [`Self::ops`].
    pub streams: fn(op: &str, pass: Pass) -> Option<Streams>,
    /// The tensor-parallel all-reduces one rank of a slice makes per micro-batch (with
    /// `s.tp > 1`), forward and backward.
    pub tp_allreduces: fn(s: &Slice) -> Vec<Collective>,
    /// Bytes of the tensor the first and last pipeline stages share and all-reduce once per
    /// step (a tied embedding), per tensor-parallel rank; `None` when there is none.
    pub tied_bytes: fn(s: &Slice) -> Option<f64>,
}

impl CostModel {
    /// The GEMM calls of op `op` (forward timer name) in `pass`; `None` for an op that is not
    /// GEMMs.
    pub fn gemms(&self, op: &str, pass: Pass, s: &Slice) -> Option<Vec<GemmCall>> {
        match (self.work)(op, pass, s)? {
            OpWork::Gemms(calls) => Some(calls),
            OpWork::Elements(_) => None,
        }
    }

    /// FLOPs of every GEMM of every op in `pass`.
    pub fn gemm_flops(&self, pass: Pass, s: &Slice) -> f64 {
        self.ops
            .iter()
            .flat_map(|op| self.gemms(op.forward, pass, s).unwrap_or_default())
            .map(|c| c.flops())
            .sum()
    }

    /// Model FLOPs of a forward and backward pass over `s` (MFU's convention: every GEMM, the
    /// backward twice the forward, recomputation not counted; `s.vocab` unpadded).
    pub fn model_flops(&self, s: &Slice) -> f64 {
        3.0 * self.gemm_flops(Pass::Forward, s)
    }
}

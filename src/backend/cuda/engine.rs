//! What [`super::CudaBackend`] needs from a device, as a small trait with two
//! implementations: [`super::driver::DriverEngine`] (a real GPU through cudarc) and
//! [`super::emu::Emulator`] (`kernels.cu` compiled for the host and run under a block/thread
//! emulator, so the backend's host code and kernels can be tested on a machine without a GPU).
//!
//! Device memory is addressed by raw `u64` pointers: allocations are zero-filled byte ranges
//! that stay valid while their [`DevAlloc`] lives.

use crate::backend::knobs::GemmSelect;
use crate::dtype::Dtype;
use crate::metrics::timers::DeviceClock;
use anyhow::Result;
use std::any::Any;

/// One kernel argument: device pointers travel as `u64`, sizes as `i64`, matching the
/// `float*` / `long long` / `int` / `float` parameters of `kernels.cu`.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
}

/// A zero-filled device allocation; the memory lives as long as this value.
pub struct DevAlloc {
    pub ptr: u64,
    pub bytes: usize,
    /// Whatever owns the memory (a cudarc slice, a host vector).
    pub _owner: Box<dyn Any>,
}

/// One column-major strided-batched GEMM, cuBLAS's `cublasGemmStridedBatchedEx` arguments:
/// `C_i = alpha·op(A_i)·op(B_i) + beta·C_i` with `C_i` m×n, products accumulated in f32
/// whatever the operand types (`cublasSgemmStridedBatched` when all three are f32), then the
/// call's [`Epilogue`] (cuBLASLt's) before C is rounded to its type.
#[derive(Clone, Copy, Debug)]
pub struct GemmCall {
    pub a_type: Dtype,
    pub b_type: Dtype,
    pub c_type: Dtype,
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub a: u64,
    pub lda: usize,
    pub stride_a: usize,
    pub b: u64,
    pub ldb: usize,
    pub stride_b: usize,
    pub beta: f32,
    pub c: u64,
    pub ldc: usize,
    pub stride_c: usize,
    pub batch: usize,
    pub epilogue: Epilogue,
}

/// What a GEMM does to its f32 result `v = alpha·op(A)·op(B)` before rounding it into C
/// (cuBLASLt's epilogues; one matrix, and beta 0 except for a bias gradient,
/// [`GemmCall::check_epilogue`]). Device addresses; a `bias` is C's m values of C's type,
/// added along C's columns (one per row of column-major C: one per output feature of a linear
/// layer), 0 for none. `aux` is an m×n column-major matrix of C's type with leading dimension
/// `ld_aux`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// C = v.
    None,
    /// C = v + bias (`CUBLASLT_EPILOGUE_BIAS`).
    Bias { bias: u64 },
    /// aux = v + bias, C = gelu(v + bias), GELU's tanh form from the f32 value
    /// (`CUBLASLT_EPILOGUE_GELU_AUX_BIAS`, or `_GELU_AUX` without a bias): a linear layer
    /// and the activation after it, keeping the activation's input for the backward pass.
    GeluAux { bias: u64, aux: u64, ld_aux: usize },
    /// C = v · gelu'(aux) (`CUBLASLT_EPILOGUE_DGELU`): an input gradient carried back
    /// through the GELU whose input `aux` is.
    GeluGrad { aux: u64, ld_aux: usize },
    /// C = v + bias + resid (bias 0 for none), `resid` an m×n matrix of C's type with C's
    /// leading dimension, read where C is written: a linear layer whose output joins the
    /// residual stream (cuBLASLt's own C operand with beta = 1 and D apart from it, plus
    /// `CUBLASLT_EPILOGUE_BIAS` with a bias). `resid` may not overlap C.
    Residual { bias: u64, resid: u64 },
    /// C = v (beta as the call says), and `grad` = the sums of op(A)'s rows over k (m values,
    /// `of_a`: `CUBLASLT_EPILOGUE_BGRADA`) or of op(B)'s columns over k (n values,
    /// `CUBLASLT_EPILOGUE_BGRADB`), f32 sums stored as C's type, overwriting `grad`: a
    /// weight-gradient GEMM computing its layer's bias gradient from the output gradient it
    /// reads anyway.
    BiasGrad { grad: u64, of_a: bool },
}

impl Epilogue {
    /// The epilogue in words (messages).
    pub fn name(&self) -> &'static str {
        match self {
            Epilogue::None => "none",
            Epilogue::Bias { .. } => "bias",
            Epilogue::GeluAux { .. } => "bias and GELU",
            Epilogue::GeluGrad { .. } => "GELU gradient",
            Epilogue::Residual { .. } => "residual",
            Epilogue::BiasGrad { .. } => "bias gradient",
        }
    }

    /// The bias's address, or 0 for none.
    pub fn bias(&self) -> u64 {
        match *self {
            Epilogue::Bias { bias }
            | Epilogue::GeluAux { bias, .. }
            | Epilogue::Residual { bias, .. } => bias,
            _ => 0,
        }
    }

    /// The residual matrix's address (C's leading dimension), if the epilogue has one.
    pub fn residual(&self) -> Option<u64> {
        match *self {
            Epilogue::Residual { resid, .. } => Some(resid),
            _ => None,
        }
    }

    /// The bias gradient's address and whether it sums op(A) (else op(B)), if the epilogue
    /// has one.
    pub fn bias_grad(&self) -> Option<(u64, bool)> {
        match *self {
            Epilogue::BiasGrad { grad, of_a } => Some((grad, of_a)),
            _ => None,
        }
    }

    /// The auxiliary matrix and its leading dimension, if the epilogue has one.
    pub fn aux(&self) -> Option<(u64, usize)> {
        match *self {
            Epilogue::GeluAux { aux, ld_aux, .. } | Epilogue::GeluGrad { aux, ld_aux } => {
                Some((aux, ld_aux))
            }
            _ => None,
        }
    }
}

/// The alignment a GEMM's bias and auxiliary matrix need (its address, and the auxiliary
/// matrix's column stride in bytes). cuBLASLt has no preference attribute for them (the other
/// operands' alignments are passed to its heuristic); Marian's cuBLASLt code found bias
/// vectors below 16 bytes failing on an A100.
pub const EPILOGUE_ALIGN: u64 = 16;

impl GemmCall {
    /// Whether the product has no elements (nothing to queue).
    pub fn is_empty(&self) -> bool {
        self.m == 0 || self.n == 0 || self.batch == 0
    }

    /// Fails unless a call with an epilogue is one that cuBLASLt's epilogues take: one
    /// matrix, beta 0 (any beta for a bias gradient, which does not touch C's values, or
    /// without an epilogue), and
    /// the bias, bias gradient and auxiliary matrix [`EPILOGUE_ALIGN`]-aligned, the latter
    /// with a leading dimension of at least m; a residual matrix must not overlap C.
    pub fn check_epilogue(&self) -> Result<()> {
        let aligned = |p: u64| p.is_multiple_of(EPILOGUE_ALIGN);
        let grad_ok = self.epilogue.bias_grad().is_none_or(|(g, _)| aligned(g));
        let beta_ok =
            self.beta == 0.0 || matches!(self.epilogue, Epilogue::None | Epilogue::BiasGrad { .. });
        let aux_ok = self.epilogue.aux().is_none_or(|(aux, ld)| {
            aligned(aux)
                && ld >= self.m
                && ((ld * self.c_type.bytes()) as u64).is_multiple_of(EPILOGUE_ALIGN)
        });
        // The residual is read where C is written: the two must be apart.
        let extent = (((self.n.max(1) - 1) * self.ldc + self.m) * self.c_type.bytes()) as u64;
        let resid_ok = self
            .epilogue
            .residual()
            .is_none_or(|r| r.abs_diff(self.c) >= extent);
        anyhow::ensure!(
            self.batch == 1
                && beta_ok
                && aligned(self.epilogue.bias())
                && grad_ok
                && aux_ok
                && resid_ok,
            "a GEMM with a {} epilogue needs one matrix, beta 0 (unless it computes a bias \
             gradient), a {EPILOGUE_ALIGN}-byte aligned bias, bias gradient and auxiliary \
             matrix (columns too) of at least m rows, and a residual apart from C (got batch \
             {}, beta {}, m {}, {:?})",
            self.epilogue.name(),
            self.batch,
            self.beta,
            self.m,
            self.epilogue
        );
        Ok(())
    }
}

/// What [`Engine::gemm`] fails with when it cannot run a call's [`Epilogue`] (cuBLASLt has no
/// algorithm for that epilogue, shape and types): the backend then does the epilogue's work
/// with its kernels, for that shape from then on. Any other error is fatal.
#[derive(Debug)]
pub struct NoEpilogue(pub String);

impl std::fmt::Display for NoEpilogue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no such epilogue: {}", self.0)
    }
}

impl std::error::Error for NoEpilogue {}

/// A device as the CUDA backend uses it. Work is ordered (one stream); `download` waits for it.
pub trait Engine {
    /// The device in words.
    fn describe(&self) -> String;
    /// Peak GFLOP/s for GEMM operands stored in `compute`, and how it was obtained, when
    /// known.
    fn peak_gflops(&self, compute: Dtype) -> Option<(f64, String)>;
    /// Peak memory bandwidth in GB/s, and how it was obtained, when known.
    fn peak_gbs(&self) -> Option<(f64, String)> {
        None
    }
    /// Most blocks per launch (every kernel is grid-stride, so any grid covers its work; the
    /// emulator keeps grids small because each block costs it 256 fiber starts).
    fn max_blocks(&self) -> u32;
    /// Whether the device runs `mma.m16n8k16` on bf16/f16 operands (sm_80 and newer; the
    /// emulator emulates it): the fused attention kernels need it.
    fn mma_16bit(&self) -> bool;
    /// Whether the device runs warpgroup MMA (`wgmma`, compute capability 9.0 exactly, for
    /// which the kernels are built as sm_90a; the emulator emulates it): the
    /// `flash_forward_wgmma` kernels need it.
    fn wgmma(&self) -> bool {
        false
    }
    /// The most dynamic shared memory a block may be given, in bytes (the device's opt-in
    /// limit: 227 KB on an H100, 163 KB on an A100, 99 KB on sm_86 and sm_89 GPUs): the
    /// head-128 attention kernels need up to 102 KB.
    fn max_dynamic_shared(&self) -> u32;
    /// Free device memory in bytes, when known (for out-of-memory messages).
    fn free_bytes(&self) -> Option<usize>;
    fn alloc(&mut self, bytes: usize) -> Result<DevAlloc>;
    /// Copies host bytes to `dst`; `src` may be reused when this returns.
    fn upload(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Copies `src` to host bytes after all queued work.
    fn download(&self, dst: &mut [u8], src: u64) -> Result<()>;
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    fn zero(&self, dst: u64, bytes: usize) -> Result<()>;
    /// Launches kernel `kernel` (an index into [`super::kernel_names`]) on `grid` blocks of
    /// `block` threads with `shmem` bytes of dynamic shared memory.
    fn launch(&self, kernel: usize, grid: u32, block: u32, shmem: u32, args: &[Arg]) -> Result<()>;
    /// Queues `g`; a call with an epilogue may fail with [`NoEpilogue`].
    fn gemm(&self, g: &GemmCall) -> Result<()>;
    /// How [`Self::gemm`] chooses its algorithm (`FUGU_GEMM_SELECT`); an engine with one
    /// algorithm per GEMM (the emulator) ignores it.
    fn set_gemm_select(&mut self, _select: GemmSelect) {}
    /// The choice [`Self::gemm`] makes (the emulator's: its one algorithm, `First`).
    fn gemm_select(&self) -> GemmSelect {
        GemmSelect::First
    }
    /// `g` on `g.batch` matrices given by pointer arrays instead of strides: `arrays` are the
    /// device addresses of three arrays of `g.batch` device pointers (A, B, C) in device
    /// memory (`cublasGemmBatchedEx`); `g.a`, `g.b`, `g.c` and the strides are ignored.
    fn gemm_ptr_arrays(&self, g: &GemmCall, arrays: [u64; 3]) -> Result<()>;
    fn sync(&self) -> Result<()>;
    /// The device's clock, for the timers (marks between the queued work).
    fn clock(&self) -> Box<dyn DeviceClock>;
    /// What makes a choice timed among the backend's kernels valid in a later process (the
    /// timed attention forms' cache, `attention_select.rs`): the device and the kernels'
    /// build. By default the device's description and the kernels' source; a GPU's engine
    /// names its compute capability and compiler too.
    fn kernels_identity(&self) -> String {
        format!(
            "device={:?} kernels={}",
            self.describe(),
            super::kernels_source_key()
        )
    }
}

/// The live marks of a device clock, one slot each; freed slots are reused (a GPU's events are
/// created once and recorded again).
pub struct MarkSlots<T> {
    items: Vec<T>,
    free: Vec<usize>,
}

impl<T> Default for MarkSlots<T> {
    fn default() -> Self {
        MarkSlots {
            items: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> MarkSlots<T> {
    /// A free slot (made by `new` when none is) and its index.
    pub fn acquire(&mut self, new: impl FnOnce() -> Result<T>) -> Result<(usize, &mut T)> {
        let i = match self.free.pop() {
            Some(i) => i,
            None => {
                self.items.push(new()?);
                self.items.len() - 1
            }
        };
        Ok((i, &mut self.items[i]))
    }

    pub fn get(&self, i: usize) -> &T {
        &self.items[i]
    }

    pub fn release(&mut self, i: usize) {
        debug_assert!(!self.free.contains(&i), "mark {i} released twice");
        self.free.push(i);
    }
}

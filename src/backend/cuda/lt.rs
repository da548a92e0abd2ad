//! cuBLASLt, for the GEMMs with an [`Epilogue`]: work on the f32 result before D is rounded
//! to its type, done as the GEMM writes D instead of by kernels passing over D again.
//!
//! - A linear layer's bias (`CUBLASLT_EPILOGUE_BIAS`), instead of a kernel first writing the
//!   bias into every row of D and the GEMM reading it back with beta = 1 (two extra passes
//!   over the output: 5.4 GB per GPT-2 124M B=16 T=1024 step). The numbers are the same:
//!   either way the bias value (of D's type) is added to the f32 accumulator and the sum
//!   rounded once.
//! - A linear layer's output joining the residual stream (`FUGU_RESIDUAL=epilogue`): the
//!   residual is cuBLASLt's C with beta = 1 and D is the new residual stream, instead of the
//!   GEMM writing its output and a kernel reading it back with the old stream (two extra
//!   passes over the (B·T, C) output, 1.2 GB per GPT-2 124M B=16 bf16 step). The sum is
//!   rounded once instead of twice.
//! - The MLP's GELU (`_GELU_AUX_BIAS`: D = gelu(v + bias), the aux matrix = v + bias, GELU's
//!   input for the backward pass) and its gradient (`_DGELU`: D = v · gelu'(aux)), each
//!   saving a kernel's pass over the (B·T, 4C) activations and one store of them. cuBLASLt's
//!   GELU is the tanh form GPT-2 uses (within 2e-4 in f32, fp64 within 1e-5, per a public
//!   test of these epilogues on an RTX 3060 with cuBLASLt 13.0); the backend uses it for
//!   16-bit activations only, where that is far below the type's rounding. The aux matrix
//!   must have D's type.
//! - A linear layer's bias gradient (`FUGU_BIAS_GRAD=epilogue`; `_BGRADA`/`_BGRADB`: the
//!   sums over k of the output gradient, the operand the weight-gradient GEMM reads anyway),
//!   instead of the column-sum kernels reading it again (2.7 GB per GPT-2 124M B=16 T=1024
//!   bf16 step). cuBLASLt overwrites the vector, so the backend has it write a scratch vector
//!   and adds that to the gradient (parameter gradients accumulate). With beta = 1: the
//!   weight gradient accumulates as without the epilogue.
//!
//! Descriptors are made per call (microseconds of host time, hidden behind the queued GPU
//! work), as PyTorch's `gemm_and_bias` does; the heuristic is told each pointer's alignment,
//! so it never picks an algorithm that needs more.

use super::engine::{Epilogue, GemmCall, NoEpilogue};
use crate::dtype::Dtype;
use anyhow::{Context, Result};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::ffi::c_void;
use std::mem::size_of_val;
use std::sync::Arc;

/// A cuBLASLt handle and its workspace, on the engine's stream.
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    /// f32 GEMMs may use TF32 tensor cores (`--tf32`), as the cuBLAS handle's math mode says.
    tf32: bool,
}

impl Lt {
    /// A handle on `stream` with NVIDIA's recommended workspace (32 MiB from Hopper, sm_90,
    /// on; 4 MiB before).
    pub fn new(stream: Arc<CudaStream>, major: i32, tf32: bool) -> Result<Lt> {
        let bytes = if major >= 9 { 32 << 20 } else { 4 << 20 };
        let workspace = stream
            .alloc_zeros::<u8>(bytes)
            .context("allocating the cuBLASLt workspace")?;
        let handle = lt::create_handle().context("creating the cuBLASLt handle")?;
        Ok(Lt {
            handle,
            workspace,
            stream,
            tf32,
        })
    }

    /// `g` with its epilogue (see [`Epilogue`]), D at `g.c`.
    pub fn gemm_epilogue(&self, g: &GemmCall) -> Result<()> {
        g.check_epilogue()?;
        let compute = if g.a_type == Dtype::F32 && g.b_type == Dtype::F32 && self.tf32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let desc = Desc::new(compute)?;
        use sys::cublasLtMatmulDescAttributes_t as D;
        let (ta, tb) = (g.trans_a as i32, g.trans_b as i32);
        use sys::cublasLtEpilogue_t as E;
        let bias = g.epilogue.bias();
        let epilogue = match g.epilogue {
            Epilogue::None => E::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias { .. } | Epilogue::Residual { .. } if bias != 0 => {
                E::CUBLASLT_EPILOGUE_BIAS
            }
            Epilogue::Bias { .. } | Epilogue::Residual { .. } => E::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::GeluAux { bias: 0, .. } => E::CUBLASLT_EPILOGUE_GELU_AUX,
            Epilogue::GeluAux { .. } => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::GeluGrad { .. } => E::CUBLASLT_EPILOGUE_DGELU,
            Epilogue::BiasGrad { of_a: true, .. } => E::CUBLASLT_EPILOGUE_BGRADA,
            Epilogue::BiasGrad { of_a: false, .. } => E::CUBLASLT_EPILOGUE_BGRADB,
        };
        desc.set(D::CUBLASLT_MATMUL_DESC_TRANSA, &ta)?;
        desc.set(D::CUBLASLT_MATMUL_DESC_TRANSB, &tb)?;
        desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
        // A bias, or the bias gradient the epilogue writes: C's type.
        let bias_ptr = g.epilogue.bias_grad().map_or(bias, |(grad, _)| grad);
        if bias_ptr != 0 {
            let bias_type = cuda_type(g.c_type);
            desc.set(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr)?;
            desc.set(D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type)?;
        }
        if let Some((aux, ld)) = g.epilogue.aux() {
            // The aux matrix has D's type (cuBLASLt's default; it refuses another for 16-bit D).
            let ld = ld as i64;
            desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux)?;
            desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld)?;
        }
        // Stored shapes: op(A) is m×k, so A is k×m when transposed; likewise B.
        let (ar, ac) = if g.trans_a { (g.k, g.m) } else { (g.m, g.k) };
        let (br, bc) = if g.trans_b { (g.n, g.k) } else { (g.k, g.n) };
        let a = Layout::new(g.a_type, ar, ac, g.lda)?;
        let b = Layout::new(g.b_type, br, bc, g.ldb)?;
        let c = Layout::new(g.c_type, g.m, g.n, g.ldc)?;
        // A residual is cuBLASLt's C (beta = 1) and D is `g.c`; otherwise C is D.
        let (c_in, beta) = match g.epilogue.residual() {
            Some(r) => (r, 1.0f32),
            None => (g.c, g.beta),
        };
        let pref = Pref::new()?;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let ws = self.workspace.len() as u64;
        pref.set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws)?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
            &alignment(g.a),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            &alignment(g.b),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
            &alignment(c_in),
        )?;
        pref.set(
            P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            &alignment(g.c),
        )?;
        // SAFETY: every descriptor is live (dropped at the end of this function) and
        // describes the matrices the backend passes: pointers inside live allocations covering
        // the m·n·k extents with these leading dimensions and types, a bias or bias gradient
        // of m values (n for BGRADB) of D's type, an aux matrix of D's type, m×n with its
        // leading dimension, and a residual C of D's type and layout apart from D (checked by
        // the backend and `check_epilogue`); alpha and beta are f32 host scalars, as
        // CUBLAS_COMPUTE_32F(_FAST_TF32) requires; the workspace lives as long as `self`, and
        // the stream orders its reuse.
        unsafe {
            let heur =
                lt::get_matmul_algo_heuristic(self.handle, desc.0, a.0, b.0, c.0, c.0, pref.0)
                    .map_err(|e| NoEpilogue(format!("cuBLASLt's heuristic: {e}")))?;
            let (w, _) = self.workspace.device_ptr(&self.stream);
            lt::matmul(
                self.handle,
                desc.0,
                (&g.alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                g.a as *const c_void,
                a.0,
                g.b as *const c_void,
                b.0,
                c_in as *const c_void,
                c.0,
                g.c as *mut c_void,
                c.0,
                &heur.algo,
                w as *mut c_void,
                self.workspace.len(),
                self.stream.cu_stream() as sys::cudaStream_t,
            )
            .map_err(|e| -> anyhow::Error {
                // Refused before anything was queued: the backend does the work with kernels.
                if e.0 == sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED {
                    NoEpilogue(format!("cuBLASLt's matmul: {e}")).into()
                } else {
                    e.into()
                }
            })?;
        }
        Ok(())
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: the handle was created in `new` and is destroyed once; queued work that
        // uses it is waited for by the engine's drop, which runs first.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// The largest power of two (at most 256, cuBLASLt's default assumption) dividing `ptr`.
fn alignment(ptr: u64) -> u32 {
    1u32 << ptr.trailing_zeros().min(8)
}

fn cuda_type(d: Dtype) -> sys::cudaDataType {
    match d {
        Dtype::F32 => sys::cudaDataType::CUDA_R_32F,
        Dtype::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        Dtype::F16 => sys::cudaDataType::CUDA_R_16F,
    }
}

/// A matmul descriptor, destroyed on drop.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Desc {
    fn new(compute: sys::cublasComputeType_t) -> Result<Desc> {
        Ok(Desc(lt::create_matmul_desc(
            compute,
            sys::cudaDataType::CUDA_R_32F,
        )?))
    }

    fn set<V>(&self, attr: sys::cublasLtMatmulDescAttributes_t, v: &V) -> Result<()> {
        // SAFETY: the descriptor is live; `v` is the attribute's documented type (i32 for the
        // transposes and the bias type, u32 for the epilogue, a device pointer for the bias
        // and the aux matrix, i64 for the aux's leading dimension) and cuBLASLt copies
        // `size_of_val(v)` bytes from it.
        unsafe {
            lt::set_matmul_desc_attribute(self.0, attr, (v as *const V).cast(), size_of_val(v))
        }?;
        Ok(())
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

/// A column-major matrix layout, destroyed on drop.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    fn new(dt: Dtype, rows: usize, cols: usize, ld: usize) -> Result<Layout> {
        Ok(Layout(lt::create_matrix_layout(
            cuda_type(dt),
            rows as u64,
            cols as u64,
            ld as i64,
        )?))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

/// Heuristic search preferences, destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Pref {
    fn new() -> Result<Pref> {
        Ok(Pref(lt::create_matmul_pref()?))
    }

    fn set<V>(&self, attr: sys::cublasLtMatmulPreferenceAttributes_t, v: &V) -> Result<()> {
        // SAFETY: the preference is live; `v` is the attribute's documented type (u64 for
        // the workspace size, u32 for the alignments), copied by cuBLASLt.
        unsafe {
            lt::set_matmul_pref_attribute(self.0, attr, (v as *const V).cast(), size_of_val(v))
        }?;
        Ok(())
    }
}

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

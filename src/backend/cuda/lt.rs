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
//!
//! The algorithm is the heuristic's first choice (as PyTorch and llm.c take it), or, with
//! `FUGU_GEMM_SELECT=timed`, the fastest of its first [`TIMED_CANDIDATES`] timed on the
//! device the first time a shape is seen (then every one-matrix GEMM comes here, not to
//! cuBLAS, which takes no algorithm choice). The choices are kept on disk per GPU model and
//! cuBLASLt version ([`super::algo_cache`]), so later runs and resumed ones take the same
//! algorithms without timing them again.

use super::algo_cache::{gemm_cache, AlgoCache, Choice, Identity};
use super::engine::{Epilogue, GemmCall, NoEpilogue};
use crate::backend::knobs::GemmSelect;
use crate::dtype::Dtype;
use anyhow::{Context, Result};
use cudarc::cublaslt::{result as lt, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of_val;
use std::sync::{Arc, Mutex};

/// The timed algorithms ([`GemmSelect::Timed`]), under one lock.
#[derive(Default)]
struct Choices {
    /// The algorithm this process runs per shape: timed here, or taken from the disk cache
    /// once cuBLASLt accepted it for the shape.
    chosen: HashMap<ShapeKey, sys::cublasLtMatmulAlgo_t>,
    /// The choices on disk: opened at the first timed GEMM.
    cache: Option<AlgoCache>,
}

/// A cuBLASLt handle and its workspace, on the engine's stream.
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    stream: Arc<CudaStream>,
    /// f32 GEMMs may use TF32 tensor cores (`--tf32`), as the cuBLAS handle's math mode says.
    tf32: bool,
    select: GemmSelect,
    /// [`GemmSelect::Timed`]'s choices.
    choices: Mutex<Choices>,
    /// What the cached choices are valid for.
    identity: Identity,
    /// Where timed candidates write, never the caller's outputs.
    scratch: Mutex<Option<CudaSlice<u8>>>,
}

impl Lt {
    /// A handle on `stream` with NVIDIA's recommended workspace (32 MiB from Hopper, sm_90,
    /// on; 4 MiB before), for GPU `gpu` of compute capability `major.minor`.
    pub fn new(
        stream: Arc<CudaStream>,
        gpu: &str,
        (major, minor): (i32, i32),
        tf32: bool,
    ) -> Result<Lt> {
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
            select: GemmSelect::default(),
            choices: Mutex::default(),
            identity: Identity {
                gpu: gpu.to_string(),
                major,
                minor,
                // SAFETY: takes no arguments; cuBLASLt is loaded (the handle above).
                lt_version: unsafe { sys::cublasLtGetVersion() },
                workspace: bytes,
            },
            scratch: Mutex::default(),
        })
    }

    /// How [`Self::gemm`] picks its algorithm (`FUGU_GEMM_SELECT`).
    pub fn select(&self) -> GemmSelect {
        self.select
    }

    pub fn set_select(&mut self, select: GemmSelect) {
        self.select = select;
    }

    /// `g` with its epilogue (see [`Epilogue`]), D at `g.c`, by cuBLASLt's first heuristic
    /// choice or, with [`GemmSelect::Timed`], the fastest of its candidates for this shape.
    pub fn gemm(&self, g: &GemmCall) -> Result<()> {
        g.check_epilogue()?;
        let call = Call::new(self, g)?;
        let algo = match self.select {
            GemmSelect::First => call.candidates(self, 1)?[0].algo,
            GemmSelect::Timed => self.timed_algo(g, &call)?,
        };
        call.run(self, &algo)
    }

    /// The algorithm timed fastest for `g`'s shape, types, epilogue and alignments: chosen
    /// before in this process, or stored on disk (and accepted by cuBLASLt for this call), or
    /// timed now ([`Self::time_candidates`]) and stored, by one of the processes sharing the
    /// cache while the others wait for its choice ([`super::choice_cache::ChoiceCache::choose`]).
    fn timed_algo(&self, g: &GemmCall, call: &Call) -> Result<sys::cublasLtMatmulAlgo_t> {
        let key = ShapeKey::of(g, self.tf32);
        let mut choices = self.choices.lock().unwrap_or_else(|e| e.into_inner());
        let Choices { chosen, cache } = &mut *choices;
        if let Some(algo) = chosen.get(&key) {
            return Ok(*algo);
        }
        let cache = cache.get_or_insert_with(|| {
            let cache = gemm_cache(&self.identity);
            if let (false, Some(file)) = (cache.is_empty(), cache.file()) {
                eprintln!(
                    "note: cuBLASLt algorithms timed before for {} GEMM shapes, from {}",
                    cache.len(),
                    file.display()
                );
            }
            cache
        });
        let shape = key.to_string();
        let algo_of = |c: &Choice| sys::cublasLtMatmulAlgo_t { data: c.algo };
        let accepted = |c: &Choice| call.accepts(self, &algo_of(c));
        let what = "timing cuBLASLt's algorithms";
        let algo =
            algo_of(&cache.choose(&shape, what, accepted, || self.time_candidates(g, call))?);
        chosen.insert(key, algo);
        Ok(algo)
    }

    /// The fastest of cuBLASLt's candidates ([`TIMED_CANDIDATES`]) for `g`, each run on
    /// scratch outputs (the caller's C, aux matrix and bias gradient are never written, so a
    /// GEMM that accumulates is run once, by the caller); reported on stderr.
    fn time_candidates(&self, g: &GemmCall, call: &Call) -> Result<Choice> {
        let candidates = call.candidates(self, TIMED_CANDIDATES)?;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let trial_g = redirect(g, &mut scratch, &self.stream)?;
        let trial = Call::new(self, &trial_g)?;
        let ctx = self.stream.context();
        let timed = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (start, end) = (ctx.new_event(timed)?, ctx.new_event(timed)?);
        let mut times = Vec::with_capacity(candidates.len());
        for c in &candidates {
            // A candidate the library then refuses is left out (NoEpilogue), not fatal.
            if trial.run(self, &c.algo).is_err() {
                times.push(f32::INFINITY);
                continue;
            }
            start.record(&self.stream)?;
            for _ in 0..TIMED_RUNS {
                trial.run(self, &c.algo)?;
            }
            end.record(&self.stream)?;
            times.push(start.elapsed_ms(&end)? / TIMED_RUNS as f32);
        }
        let best = (0..times.len())
            .min_by(|&i, &j| times[i].total_cmp(&times[j]))
            .expect("cuBLASLt returned at least one candidate");
        anyhow::ensure!(
            times[best].is_finite(),
            NoEpilogue("cuBLASLt ran none of its candidates".into())
        );
        eprintln!(
            "note: cuBLASLt m {} n {} k {} ({}{}·{}{} → {}, {}{}): {} candidates timed, the \
             heuristic's first {:.4} ms, #{best} {:.4} ms ({:+.1}%)",
            g.m,
            g.n,
            g.k,
            g.a_type.name(),
            if g.trans_a { "ᵀ" } else { "" },
            g.b_type.name(),
            if g.trans_b { "ᵀ" } else { "" },
            g.c_type.name(),
            g.epilogue.name(),
            if g.beta != 0.0 { ", accumulating" } else { "" },
            times.len(),
            times[0],
            times[best],
            (times[best] / times[0] - 1.0) * 100.0
        );
        Ok(Choice {
            algo: candidates[best].algo.data,
            first_ms: times[0],
            chosen_ms: times[best],
        })
    }
}

/// How many of cuBLASLt's heuristic candidates [`GemmSelect::Timed`] runs per shape, and how
/// often each (after one untimed run): 8 × 11 runs of each of GPT-2's ~20 GEMM shapes is
/// about a second, once.
const TIMED_CANDIDATES: usize = 8;
const TIMED_RUNS: usize = 10;

/// What identifies a GEMM to cuBLASLt's heuristic: everything but the addresses, and the
/// addresses' alignments. Its text is the disk cache's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct ShapeKey {
    types: [Dtype; 3],
    trans: [bool; 2],
    mnk: [usize; 3],
    /// lda, ldb, ldc, the aux matrix's.
    ld: [usize; 4],
    epilogue: u32,
    bias: bool,
    accumulates: bool,
    /// A, B, C (read), D.
    align: [u32; 4],
    tf32: bool,
}

impl ShapeKey {
    fn of(g: &GemmCall, tf32: bool) -> ShapeKey {
        let c_in = g.epilogue.residual().unwrap_or(g.c);
        ShapeKey {
            types: [g.a_type, g.b_type, g.c_type],
            trans: [g.trans_a, g.trans_b],
            mnk: [g.m, g.n, g.k],
            ld: [
                g.lda,
                g.ldb,
                g.ldc,
                g.epilogue.aux().map_or(0, |(_, ld)| ld),
            ],
            epilogue: lt_epilogue(&g.epilogue) as u32,
            bias: g.epilogue.bias() != 0,
            accumulates: g.beta != 0.0,
            align: [g.a, g.b, c_in, g.c].map(alignment),
            tf32,
        }
    }
}

impl std::fmt::Display for ShapeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [a, b, c] = self.types.map(Dtype::name);
        let [ta, tb] = self.trans.map(u8::from);
        let [m, n, k] = self.mnk;
        let [lda, ldb, ldc, ld_aux] = self.ld;
        let [al_a, al_b, al_c, al_d] = self.align;
        write!(
            f,
            "a={a} b={b} c={c} ta={ta} tb={tb} m={m} n={n} k={k} lda={lda} ldb={ldb} ldc={ldc} \
             ld_aux={ld_aux} epilogue={} bias={} accumulates={} align={al_a},{al_b},{al_c},{al_d} \
             tf32={}",
            self.epilogue,
            u8::from(self.bias),
            u8::from(self.accumulates),
            u8::from(self.tf32)
        )
    }
}

/// `g` writing into `scratch` instead of its own outputs (D, a GELU's aux matrix, a bias
/// gradient), reading C from there too when it accumulates; `scratch` grows to fit. The
/// operands it reads (A, B, a bias, a residual, a GELU gradient's aux) are `g`'s.
fn redirect(
    g: &GemmCall,
    scratch: &mut Option<CudaSlice<u8>>,
    stream: &Arc<CudaStream>,
) -> Result<GemmCall> {
    let round = |b: usize| b.div_ceil(256) * 256;
    let bytes = g.c_type.bytes();
    let d_bytes = round(((g.n.max(1) - 1) * g.ldc + g.m) * bytes);
    let aux_bytes = match g.epilogue {
        Epilogue::GeluAux { ld_aux, .. } => round(((g.n.max(1) - 1) * ld_aux + g.m) * bytes),
        _ => 0,
    };
    let grad_bytes = round(g.m.max(g.n) * bytes);
    let need = d_bytes + aux_bytes + grad_bytes;
    if scratch.as_ref().is_none_or(|s| s.len() < need) {
        *scratch = None;
        *scratch = Some(
            stream
                .alloc_zeros::<u8>(need)
                .context("allocating the scratch outputs of cuBLASLt's timed candidates")?,
        );
    }
    let s = scratch.as_ref().expect("allocated above");
    let (base, _) = s.device_ptr(stream);
    let mut t = *g;
    t.c = base;
    t.epilogue = match g.epilogue {
        Epilogue::GeluAux { bias, ld_aux, .. } => Epilogue::GeluAux {
            bias,
            aux: base + d_bytes as u64,
            ld_aux,
        },
        Epilogue::BiasGrad { of_a, .. } => Epilogue::BiasGrad {
            grad: base + (d_bytes + aux_bytes) as u64,
            of_a,
        },
        e => e,
    };
    Ok(t)
}

/// cuBLASLt's name for an epilogue.
fn lt_epilogue(e: &Epilogue) -> sys::cublasLtEpilogue_t {
    use sys::cublasLtEpilogue_t as E;
    let bias = e.bias() != 0;
    match e {
        Epilogue::None => E::CUBLASLT_EPILOGUE_DEFAULT,
        Epilogue::Bias { .. } | Epilogue::Residual { .. } if bias => E::CUBLASLT_EPILOGUE_BIAS,
        Epilogue::Bias { .. } | Epilogue::Residual { .. } => E::CUBLASLT_EPILOGUE_DEFAULT,
        Epilogue::GeluAux { .. } if bias => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
        Epilogue::GeluAux { .. } => E::CUBLASLT_EPILOGUE_GELU_AUX,
        Epilogue::GeluGrad { .. } => E::CUBLASLT_EPILOGUE_DGELU,
        Epilogue::BiasGrad { of_a: true, .. } => E::CUBLASLT_EPILOGUE_BGRADA,
        Epilogue::BiasGrad { of_a: false, .. } => E::CUBLASLT_EPILOGUE_BGRADB,
    }
}

/// One GEMM described to cuBLASLt: its descriptors and the addresses it reads and writes.
struct Call {
    desc: Desc,
    a: Layout,
    b: Layout,
    c: Layout,
    pref: Pref,
    alpha: f32,
    beta: f32,
    ptr_a: u64,
    ptr_b: u64,
    /// C as read (a residual, or D itself) and D.
    c_in: u64,
    d: u64,
}

impl Call {
    fn new(lt: &Lt, g: &GemmCall) -> Result<Call> {
        let compute = if g.a_type == Dtype::F32 && g.b_type == Dtype::F32 && lt.tf32 {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let desc = Desc::new(compute)?;
        use sys::cublasLtMatmulDescAttributes_t as D;
        let (ta, tb) = (g.trans_a as i32, g.trans_b as i32);
        desc.set(D::CUBLASLT_MATMUL_DESC_TRANSA, &ta)?;
        desc.set(D::CUBLASLT_MATMUL_DESC_TRANSB, &tb)?;
        desc.set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, &lt_epilogue(&g.epilogue))?;
        // A bias, or the bias gradient the epilogue writes: C's type.
        let bias_ptr = g
            .epilogue
            .bias_grad()
            .map_or(g.epilogue.bias(), |(grad, _)| grad);
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
        let ws = lt.workspace.len() as u64;
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
        Ok(Call {
            desc,
            a,
            b,
            c,
            pref,
            alpha: g.alpha,
            beta,
            ptr_a: g.a,
            ptr_b: g.b,
            c_in,
            d: g.c,
        })
    }

    /// Up to `n` of cuBLASLt's heuristic candidates, best first: at least one, or
    /// [`NoEpilogue`].
    fn candidates(&self, lt: &Lt, n: usize) -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
        let mut found = Vec::with_capacity(n);
        let mut count = 0i32;
        // SAFETY: the descriptors are live (owned by `self`); cuBLASLt writes at most `n`
        // results into the vector's spare capacity and their number into `count`, after
        // which they are initialised.
        unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                lt.handle,
                self.desc.0,
                self.a.0,
                self.b.0,
                self.c.0,
                self.c.0,
                self.pref.0,
                n as i32,
                found.as_mut_ptr(),
                &mut count,
            )
            .result()
            .map_err(|e| NoEpilogue(format!("cuBLASLt's heuristic: {e}")))?;
            found.set_len((count.max(0) as usize).min(n));
        }
        found.retain(|r: &sys::cublasLtMatmulHeuristicResult_t| {
            r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
        });
        if found.is_empty() {
            return Err(NoEpilogue("cuBLASLt's heuristic found no algorithm".into()).into());
        }
        Ok(found)
    }

    /// Whether cuBLASLt runs this call with `algo` (one stored by an earlier process), within
    /// the workspace.
    fn accepts(&self, lt: &Lt, algo: &sys::cublasLtMatmulAlgo_t) -> bool {
        // SAFETY: the descriptors are live (owned by `self`); cuBLASLt reads `algo` and writes
        // one result, which is plain data (zeroed is a valid value).
        let mut result: sys::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let status = unsafe {
            sys::cublasLtMatmulAlgoCheck(
                lt.handle,
                self.desc.0,
                self.a.0,
                self.b.0,
                self.c.0,
                self.c.0,
                algo,
                &mut result,
            )
        };
        status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && result.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && result.workspaceSize <= lt.workspace.len()
    }

    /// Queues the call with `algo`.
    fn run(&self, lt: &Lt, algo: &sys::cublasLtMatmulAlgo_t) -> Result<()> {
        let (w, _) = lt.workspace.device_ptr(&lt.stream);
        // SAFETY: every descriptor is live (owned by `self`) and describes the matrices the
        // backend passes: pointers inside live allocations covering the m·n·k extents with
        // these leading dimensions and types, a bias or bias gradient of m values (n for
        // BGRADB) of D's type, an aux matrix of D's type, m×n with its leading dimension, and
        // a residual C of D's type and layout apart from D (checked by the backend and
        // `check_epilogue`); alpha and beta are f32 host scalars, as
        // CUBLAS_COMPUTE_32F(_FAST_TF32) requires; `algo` came from the heuristic for these
        // descriptors and alignments no stricter than these pointers'; the workspace lives
        // as long as `lt`, and the stream orders its reuse.
        unsafe {
            lt::matmul(
                lt.handle,
                self.desc.0,
                (&self.alpha as *const f32).cast(),
                (&self.beta as *const f32).cast(),
                self.ptr_a as *const c_void,
                self.a.0,
                self.ptr_b as *const c_void,
                self.b.0,
                self.c_in as *const c_void,
                self.c.0,
                self.d as *mut c_void,
                self.c.0,
                algo,
                w as *mut c_void,
                lt.workspace.len(),
                lt.stream.cu_stream() as sys::cudaStream_t,
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

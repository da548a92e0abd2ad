//! The CUDA backend (cargo feature `cuda`): buffers in device memory, GEMMs through cuBLAS,
//! every other op a CUDA C kernel from `kernels.cu`, compiled at start-up by NVRTC.
//!
//! Nothing CUDA is needed to build: cudarc loads `libcuda.so.1`, cuBLAS and NVRTC at run time
//! (`dynamic-loading`). [`CudaBackend::new`] checks that each library is there before touching
//! it, so a machine without them gets an error naming the library, not a panic.
//!
//! Semantics are those of [`crate::ops`] (the CPU backend): same shapes, same overwrite-vs-`+=`
//! rules, reductions in `f64` where the CPU uses `f64`, multiply-adds not contracted into FMAs
//! (`--fmad=false`). The reduction trees differ from the CPU's summation order, so results
//! agree to rounding, not bit for bit; on one GPU a run is bit-reproducible (no atomics; cuBLAS
//! SGEMM is deterministic on a fixed stream and device).
//!
//! Memory: one `cuMemAlloc` per [`Backend::alloc`]. Spans become raw device pointers
//! ([`CudaBackend::ptr`] checks the span against its buffer first), which is what lets one op
//! read and write several spans of the same buffer, as the model's llm.c-style layout needs.
//! All work goes to the legacy default stream, so the synchronous copies of
//! [`Backend::upload`]/[`Backend::download`] are ordered with every kernel before them.
//!
//! Collectives (MPI data and tensor parallelism) stage through host memory
//! ([`Backend::with_host`]'s default and the gradient buckets' `download`), except data
//! parallelism's buckets with `FUGU_CUDA_AWARE_MPI` (`parallel::grad_sync`), which go to a
//! CUDA-aware MPI as device addresses ([`Backend::device_address`]).

pub mod algo_cache;
mod attention;
pub mod attention_select;
pub mod choice_cache;
mod columns;
mod driver;
pub mod emu;
pub mod engine;
mod forms;
mod gemm;
pub mod kernel_cache;
mod lt;
mod nvrtc;

pub use crate::backend::knobs::FlashSelect;
use crate::backend::knobs::{Knobs, FLASH_SELECT_ENV, GEMM_SELECT_ENV};
pub use driver::gpu_present;
pub use forms::{
    parse_in_gemm, BiasGrad, FlashBackward, FlashForm, FlashMma, FlashOverlap, FlashQueryRows,
    FlashWarpRows, KernelForm, LayernormBackward, BIAS_GRAD_ENV, FLASH_BACKWARD_DEFAULT,
    FLASH_BACKWARD_ENV, FLASH_MMA_ENV, FLASH_OVERLAP_ENV, FLASH_QUERY_ROWS_ENV,
    FLASH_WARP_ROWS_ENV, LAYERNORM_BACKWARD_DEFAULT, LAYERNORM_BACKWARD_ENV,
};
pub use forms::{CrossEntropyForm, CROSS_ENTROPY_DEFAULT, CROSS_ENTROPY_ENV};
use gemm::problem;
pub use gemm::DeviceGemm;

use attention::{
    attention_scale, causal_block_rows, causal_blocks, d128_shmem, rope_in_stores, Attn,
    FlashBackwardCall, D128_MOST_TILES, FLASH_HEAD_64, FLASH_MAX_HEAD, FLASH_ROWS, FLASH_THREADS,
};
use columns::COLUMN_CHUNK_ROWS;

use super::WeightLayout;
use super::{
    AdamWPart, AdamWStep, AttnDims, Backend, BufId, CeDims, CeRows, CudaSettings, Dtype, Embedding,
    FusedAttention, FusedOut, InGemm, KvRows, LayerNorm, LayerNormGrads, Linear, LinearGrads,
    NormStats, RmsNorm, RmsNormGrads, Rope, Span, TokSpan,
};
use anyhow::{bail, Context, Result};
use engine::{Arg, DevAlloc, Engine, Epilogue, GemmCall};

/// The kernels' CUDA C source (compiled by NVRTC when a backend is created).
pub const KERNELS_SOURCE: &str = include_str!("kernels.cu");

/// The first 16 hex digits of the SHA-256 of [`KERNELS_SOURCE`] (an engine's
/// [`Engine::kernels_identity`] where it has no compiler build to name).
pub fn kernels_source_key() -> String {
    choice_cache::short_sha(KERNELS_SOURCE, 16)
}

/// NVRTC options: no FMA contraction (the CPU reference has none), IEEE division and square
/// root (NVRTC's defaults, spelled out).
pub const NVRTC_OPTIONS: &[&str] = &["--fmad=false", "--prec-div=true", "--prec-sqrt=true"];

/// Environment variable that turns `--device cuda` into the host emulator (tests only).
pub const EMULATE_ENV: &str = "FUGU_CUDA_EMULATE";

/// Whether the environment asks for the emulator ([`EMULATE_ENV`]`=1`).
pub fn emulation_asked() -> bool {
    std::env::var_os(EMULATE_ENV).is_some_and(|v| v == "1")
}

/// Dynamic shared memory per block of the fused layernorm backward: 2·C floats per warp, so
/// 8 warps up to C = 768, fewer above and the split form past C = 6144. 48 KiB is what every
/// GPU allows a block without opting in.
const LN_FUSED_SHMEM: usize = 48 << 10;

/// The one-pass norm backward kernel's warps per block (0: rows too wide for it) and each
/// warp's bytes of shared memory for `sums` column sums of `c` floats, within
/// [`LN_FUSED_SHMEM`].
fn norm_backward_warps(sums: usize, c: usize) -> (usize, usize) {
    let warp_bytes = sums * std::mem::size_of::<f32>() * c.max(1);
    let warps = (LN_FUSED_SHMEM / warp_bytes).min((ROW_THREADS / WARP) as usize);
    (warps, warp_bytes)
}

/// Threads per block of the row kernels (`ROW_THREADS` in `kernels.cu`).
const ROW_THREADS: u32 = 256;
/// Threads per warp (`WARP` in `kernels.cu`).
const WARP: u32 = 32;
/// Threads per block of elementwise kernels.
const ELEM_THREADS: u32 = 256;
/// Most blocks of the sum-of-squares kernel per span (one per 256 elements up to this).
const SOS_BLOCKS: usize = 512;
/// Most cached device tables (a few per attention GEMM and layer) before the cache is reset.
const MAX_TABLES: usize = 4096;
/// Elements per virtual block of the AdamW kernel (`ADAMW_CHUNK` in `kernels.cu`).
const ADAMW_CHUNK: usize = 4096;

/// The storage types every kernel is instantiated for, in the order of their `_<type>` name
/// suffixes in [`kernel_names`] (`FOR_TYPES` in `kernels.cu`).
const KERNEL_TYPES: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];
/// The storage types of the tensor-core kernels (`FOR_HALF_TYPES`).
const HALF_KERNEL_TYPES: [Dtype; 2] = [Dtype::Bf16, Dtype::F16];

macro_rules! kernels {
    ($($name:ident),* $(,)?; half: $($half:ident),* $(,)?) => {
        /// The kernel templates of `kernels.cu` the backend launches, in the order of [`K`]:
        /// those instantiated for every type, then those for the 16-bit types only.
        const KERNEL_BASES: &[&str] = &[$(stringify!($name)),*];
        const HALF_KERNEL_BASES: &[&str] = &[$(stringify!($half)),*];

        /// Kernel templates; [`kernel_index`] picks an instantiation.
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug)]
        enum K {
            $($name,)*
            $($half,)*
        }
    };
}

/// Names of the `extern "C"` kernels of `kernels.cu`: every template of [`K`] once per
/// storage type it is instantiated for (`layernorm_forward_f32`, `layernorm_forward_bf16`,
/// ..., `flash_forward_bf16`, `flash_forward_f16`), indexed by [`kernel_index`].
pub fn kernel_names() -> Vec<String> {
    let each = |bases: &'static [&str], types: &'static [Dtype]| {
        bases
            .iter()
            .flat_map(move |k| types.iter().map(move |t| format!("{k}_{}", t.name())))
    };
    each(KERNEL_BASES, &KERNEL_TYPES)
        .chain(each(HALF_KERNEL_BASES, &HALF_KERNEL_TYPES))
        .collect()
}

/// Index into [`kernel_names`] of template `k` instantiated for storage type `dt`.
fn kernel_index(k: K, dt: Dtype) -> usize {
    let (i, types, first): (usize, &[Dtype], usize) =
        match (k as usize).checked_sub(KERNEL_BASES.len()) {
            None => (k as usize, &KERNEL_TYPES, 0),
            Some(h) => (
                h,
                &HALF_KERNEL_TYPES,
                KERNEL_BASES.len() * KERNEL_TYPES.len(),
            ),
        };
    let t = types
        .iter()
        .position(|&x| x == dt)
        .unwrap_or_else(|| panic!("kernel {k:?} has no {} instantiation", dt.name()));
    first + i * types.len() + t
}

kernels!(
    encoder_forward,
    encoder_backward_wte,
    encoder_backward_wpe,
    layernorm_forward,
    layernorm_backward_dinp,
    layernorm_backward,
    column_partials,
    column_finish,
    broadcast_rows,
    attention_softmax,
    attention_softmax_backward,
    attention_decode,
    convert,
    gelu_forward,
    gelu_backward,
    rmsnorm_forward,
    rmsnorm_backward,
    rmsnorm_backward_dinp,
    rmsnorm_dw_partials,
    rope,
    swiglu_forward,
    swiglu_backward,
    residual_forward,
    add_inplace,
    scale_inplace,
    ce_row_stats,
    ce_rescale_sums,
    ce_target_logit,
    ce_finish,
    ce_fused,
    adamw,
    sum_of_squares;
    half:
    flash_forward,
    flash_forward_wide,
    flash_forward_q128,
    flash_forward_wide_q128,
    flash_forward_wgmma,
    flash_forward_wgmma_q128,
    flash_forward_d128,
    flash_forward_wgmma_d128,
    flash_forward_wgmma_d128_q128,
    flash_forward_wgmma_overlap,
    flash_forward_wgmma_overlap_q128,
    flash_forward_wgmma_overlap_d128,
    flash_forward_wgmma_overlap_d128_q128,
    flash_backward_dq,
    flash_backward_dq_wide,
    flash_backward_dq_q128,
    flash_backward_dq_wide_q128,
    flash_backward_dq_d128,
    flash_backward_dkv,
    flash_backward_dkv_wide,
    flash_backward_dkv_d128,
    flash_backward_dkv_store_d128,
    flash_backward_dkv_store,
    flash_backward_dkv_store_wide,
    flash_backward_dkv_store_wgmma,
    flash_backward_dkv_store_wgmma_d128,
    flash_backward_dq_stored,
    flash_backward_dq_stored_wide,
    flash_backward_dq_stored_wgmma,
    flash_backward_dq_stored_d128,
    flash_backward_dq_stored_wgmma_d128,
    flash_backward_prep,
    flash_backward_prep_d128,
    flash_backward_fused,
    flash_backward_fused_wide,
    flash_wgmma_probe,
);

/// Device memory of one buffer (`None` for zero-length and freed buffers), its length in
/// elements and their type.
struct DeviceBuf {
    mem: Option<DevAlloc>,
    len: usize,
    dtype: Dtype,
}

impl DeviceBuf {
    fn ptr(&self) -> u64 {
        self.mem.as_ref().map_or(0, |m| m.ptr)
    }
}

/// A growable scratch allocation.
#[derive(Default)]
struct Scratch(Option<DevAlloc>);

/// A linear layer's GEMM with an epilogue: the epilogue's name, (m, n, k), (A, B transposed)
/// and (operand, output types).
type EpilogueShape = (
    &'static str,
    (usize, usize, usize),
    (bool, bool),
    (Dtype, Dtype),
);

/// The CUDA backend on one GPU (or on the host emulator, for tests).
pub struct CudaBackend {
    eng: Box<dyn Engine>,
    bufs: Vec<DeviceBuf>,
    /// Token ids on the device and their host copy (the embedding backward buckets positions
    /// by token on the host).
    tokens: Scratch,
    host_tokens: Vec<u32>,
    /// Column partial sums (floats), embedding-backward index lists (ints), sum-of-squares
    /// partials (doubles).
    partials: Scratch,
    indices: Scratch,
    sos: Scratch,
    /// Fused attention's row sums Δ = rowsum(dout ∘ out) (floats), between its two backward
    /// kernels.
    attn_delta: Scratch,
    /// Small device arrays of 64-bit words, by content: the matrix pointers of the batched
    /// attention GEMMs and the tensor tables of the optimizer kernels (buffers keep their
    /// addresses, so after the first step every lookup hits).
    tables: std::collections::HashMap<Vec<u64>, DevAlloc>,
    /// Linear-layer GEMMs whose epilogue the engine could not run ([`NoEpilogue`]): their
    /// bias or GELU is done by kernels from then on.
    no_epilogue: std::collections::HashSet<EpilogueShape>,
    /// The fused attention's form, as the settings give it.
    flash: FlashForm,
    /// Whether the fused attention runs [`Self::flash`] or forms timed per shape, and those.
    flash_select: FlashSelect,
    timed_forms: attention_select::TimedForms,
    /// Whether the note that the form settings do not apply to heads over 64 has been given.
    head_128_noted: bool,
    /// The most bytes of dS tiles at once with [`FlashBackward::Stored`].
    flash_ds_budget: usize,
    /// The one-kernel attention backward's dQ accumulators and counters
    /// ([`FlashBackward::Fused`]), or the tiles of dS ([`FlashBackward::Stored`]).
    attn_dq: Scratch,
    /// The form of the layernorm backward kernels.
    layernorm_backward: LayernormBackward,
    /// The form of the cross-entropy without tensor parallelism.
    cross_entropy: CrossEntropyForm,
    /// How linear layers' bias gradients are computed, and the vector cuBLASLt writes one to
    /// ([`BiasGrad::Epilogue`]).
    bias_grad: BiasGrad,
    bias_grad_sums: Scratch,
    /// The kernels launched since [`Self::log_launches`] (indices into [`kernel_names`],
    /// each once, in first-launch order); `None` when not logging.
    launch_log: std::cell::RefCell<Option<Vec<usize>>>,
}

impl CudaBackend {
    /// Opens GPU `ordinal` (`None`: the node-local MPI rank's, see
    /// [`crate::backend::device::local_gpu`]), compiles the kernels and creates the cuBLAS
    /// handle. Without a driver, GPU, cuBLAS or NVRTC: an error that names what is missing.
    ///
    /// With `FUGU_CUDA_EMULATE=1` in the environment it returns [`Self::emulated`] instead (a
    /// test hook: the end-to-end tests run `fugu --device cuda` on machines without a GPU);
    /// logs and the metrics header then name the emulator as the device.
    pub fn new(ordinal: Option<usize>, settings: CudaSettings) -> Result<CudaBackend> {
        // A setting with a value it does not take is refused before the kernels are compiled
        // (seconds; the device's own refusals, such as wgmma on another GPU, come after).
        let knobs = Knobs::from_env()?;
        let be = if emulation_asked() {
            Self::emulated()?
        } else {
            Self::with_engine(Box::new(driver::DriverEngine::new(ordinal, settings)?))
        };
        be.with_knobs(knobs)
    }

    /// This backend with the kernel settings the environment asks for ([`Knobs`]:
    /// [`FLASH_WARP_ROWS_ENV`], [`FLASH_QUERY_ROWS_ENV`], [`FLASH_MMA_ENV`],
    /// [`FLASH_BACKWARD_ENV`], [`LAYERNORM_BACKWARD_ENV`], [`CROSS_ENTROPY_ENV`], [`BIAS_GRAD_ENV`],
    /// [`GEMM_SELECT_ENV`]; [`Self::new`] applies them, and the host-only benchmark); a value a
    /// setting does not take, or `wgmma` where the device or the rows set cannot run it, is an
    /// error naming it.
    pub fn with_env_settings(self) -> Result<CudaBackend> {
        self.with_knobs(Knobs::from_env()?)
    }

    /// This backend with settings `k` ([`Self::with_env_settings`]).
    fn with_knobs(mut self, k: Knobs) -> Result<CudaBackend> {
        self.set_flash_form(FlashForm {
            warp_rows: k.flash_warp_rows,
            query_rows: k.flash_query_rows,
            mma: k.flash_mma,
            overlap: k.flash_overlap,
            backward: k.flash_backward.unwrap_or(FLASH_BACKWARD_DEFAULT),
        })?;
        self.set_layernorm_backward(k.layernorm_backward.unwrap_or(LAYERNORM_BACKWARD_DEFAULT));
        self.set_cross_entropy(k.cross_entropy.unwrap_or(CROSS_ENTROPY_DEFAULT));
        self.set_bias_grad(k.bias_grad);
        self.eng.set_gemm_select(k.gemm_select);
        self.set_flash_select(k.flash_select);
        Ok(self)
    }

    /// The fused attention's form, every setting at once; an error, and the form kept, where
    /// the device cannot run it ([`FlashForm::refusal`]).
    pub fn set_flash_form(&mut self, form: FlashForm) -> Result<()> {
        if let Some(why) = form.refusal(self.eng.wgmma()) {
            bail!("{why}");
        }
        self.set_flash_warp_rows(form.warp_rows);
        self.set_flash_query_rows(form.query_rows);
        self.flash = form;
        Ok(())
    }

    /// The fused attention's form as the settings give it.
    pub fn flash_form(&self) -> FlashForm {
        self.flash
    }

    /// Rows per warp of the fused attention kernels ([`FLASH_WARP_ROWS_ENV`]).
    pub fn set_flash_warp_rows(&mut self, rows: FlashWarpRows) {
        for r in [rows.forward, rows.dq, rows.dkv] {
            assert!(r == 16 || r == 32, "flash warp rows: 16 or 32, not {r}");
        }
        self.flash.warp_rows = rows;
    }

    /// Query rows per block of the fused attention's forward and dQ kernels
    /// ([`FLASH_QUERY_ROWS_ENV`]).
    pub fn set_flash_query_rows(&mut self, rows: FlashQueryRows) {
        assert!(
            rows.0 == 64 || rows.0 == 128,
            "flash query rows: 64 or 128, not {}",
            rows.0
        );
        self.flash.query_rows = rows;
    }

    /// The fused attention kernels' tensor-core instruction ([`FLASH_MMA_ENV`]); an error,
    /// and the setting kept, where the device or the rows per warp set do not allow it.
    pub fn set_flash_mma(&mut self, form: FlashMma) -> Result<()> {
        if let Some(why) = form.refusal(self.eng.wgmma(), self.flash.warp_rows) {
            bail!("{why}");
        }
        self.flash.mma = form;
        Ok(())
    }

    /// Whether the wgmma forward overlaps softmax with the last block's product
    /// ([`FLASH_OVERLAP_ENV`]); an error, and the setting kept, without wgmma kernels.
    pub fn set_flash_overlap(&mut self, form: FlashOverlap) -> Result<()> {
        if let Some(why) = form.refusal(self.flash.mma) {
            bail!("{why}");
        }
        self.flash.overlap = form;
        Ok(())
    }

    /// Whether the device runs the warpgroup-MMA kernels ([`FlashMma::Wgmma`]).
    pub fn has_wgmma(&self) -> bool {
        self.eng.wgmma()
    }

    /// The warpgroup-MMA layouts the wgmma kernels use, on their own (a test's probe): `d`
    /// (64 × 64, f32) = `a` · `b`ᵀ (`transposed` false: `b` read as the K tiles are) or `a` ·
    /// `b` (true: as the V tiles are); `a` and `b` 64 × 64 row-major, 16-bit, one type.
    /// Needs [`Self::has_wgmma`].
    pub fn wgmma_probe(&mut self, d: Span, a: Span, b: Span, transposed: bool) {
        self.wgmma_probe_mode(d, a, b, transposed as i32)
    }

    /// The emulator's check that a warpgroup product takes effect at its wait, not its issue
    /// (undefined on a GPU, so the emulator only): [`Self::wgmma_probe`]'s `a` · `b`ᵀ with the
    /// accumulators, set to -1 first, read between the issue and the wait: `d` all -1.
    pub fn wgmma_probe_read_before_wait(&mut self, d: Span, a: Span, b: Span) {
        self.wgmma_probe_mode(d, a, b, 2)
    }

    fn wgmma_probe_mode(&mut self, d: Span, a: Span, b: Span, mode: i32) {
        let n = FLASH_ROWS * FLASH_HEAD_64;
        assert!(
            d.len == n && a.len == n && b.len == n && self.dt(d) == Dtype::F32,
            "wgmma_probe: 64 × 64 operands and an f32 result"
        );
        let dt = self.dt(a);
        assert!(
            self.dt(b) == dt && dt != Dtype::F32 && self.eng.wgmma(),
            "wgmma_probe: {dt:?}"
        );
        let args = [
            Arg::Ptr(self.ptr(d)),
            Arg::Ptr(self.ptr(a)),
            Arg::Ptr(self.ptr(b)),
            Arg::I32(mode),
        ];
        self.launch(K::flash_wgmma_probe, dt, 1, FLASH_THREADS, 0, &args);
    }

    /// Starts noting which kernels the backend launches (a benchmark's labels:
    /// `fugu bench attention` names the kernels each form ran); [`Self::launched`] returns them.
    pub fn log_launches(&self) {
        *self.launch_log.borrow_mut() = Some(Vec::new());
    }

    /// The kernels launched since [`Self::log_launches`], each once, in the order of their
    /// first launch (their names in `kernels.cu`, with the storage type), and stops noting.
    pub fn launched(&self) -> Vec<String> {
        let names = kernel_names();
        let log = self.launch_log.borrow_mut().take().unwrap_or_default();
        log.into_iter().map(|i| names[i].clone()).collect()
    }

    /// The form of the fused attention's backward pass ([`FLASH_BACKWARD_ENV`]).
    pub fn set_flash_backward(&mut self, form: FlashBackward) {
        self.flash.backward = form;
    }

    /// The most bytes the tiles of dS take at once with [`FlashBackward::Stored`] (the
    /// sequences go through in chunks that fit, at least one at a time); the default is
    /// `FLASH_DS_BUDGET` (512 MiB). Tests set it small to run several chunks.
    pub fn set_flash_ds_budget(&mut self, bytes: usize) {
        self.flash_ds_budget = bytes;
    }

    /// The form of the layernorm backward kernels ([`LAYERNORM_BACKWARD_ENV`]).
    pub fn set_layernorm_backward(&mut self, form: LayernormBackward) {
        self.layernorm_backward = form;
    }

    /// The form of the cross-entropy without tensor parallelism ([`CROSS_ENTROPY_ENV`]).
    pub fn set_cross_entropy(&mut self, form: CrossEntropyForm) {
        self.cross_entropy = form;
    }

    /// How linear layers' bias gradients are computed ([`BIAS_GRAD_ENV`]).
    pub fn set_bias_grad(&mut self, form: BiasGrad) {
        self.bias_grad = form;
    }

    /// The same backend with `kernels.cu` compiled for the host and run by
    /// [`emu::Emulator`] (slow; for testing the backend where there is no GPU).
    pub fn emulated() -> Result<CudaBackend> {
        Ok(Self::with_engine(Box::new(emu::Emulator::new()?)))
    }

    /// The backend on a caller's [`Engine`] (benches: `cargo bench --bench train --
    /// --host-only` counts and times what a step queues on an engine that runs nothing).
    pub fn with_engine(eng: Box<dyn Engine>) -> CudaBackend {
        CudaBackend {
            eng,
            bufs: Vec::new(),
            tokens: Scratch::default(),
            host_tokens: Vec::new(),
            partials: Scratch::default(),
            indices: Scratch::default(),
            sos: Scratch::default(),
            attn_delta: Scratch::default(),
            tables: Default::default(),
            no_epilogue: Default::default(),
            flash: FlashForm::default(),
            flash_select: FlashSelect::default(),
            timed_forms: Default::default(),
            head_128_noted: false,
            flash_ds_budget: attention::FLASH_DS_BUDGET,
            attn_dq: Scratch::default(),
            layernorm_backward: LAYERNORM_BACKWARD_DEFAULT,
            cross_entropy: CROSS_ENTROPY_DEFAULT,
            bias_grad: BiasGrad::default(),
            bias_grad_sums: Scratch::default(),
            launch_log: Default::default(),
        }
    }

    /// `dst.len()` values of type `dt` at device address `ptr`, as f32 (after the work queued
    /// so far).
    fn download_raw(&self, ptr: u64, dt: Dtype, dst: &mut [f32]) {
        let r = match dt {
            Dtype::F32 => self.eng.download(as_bytes_mut(dst), ptr),
            dt => {
                let mut bytes = vec![0u8; dt.bytes() * dst.len()];
                let r = self.eng.download(&mut bytes, ptr);
                dt.decode(&bytes, dst);
                r
            }
        };
        if let Err(e) = r {
            self.fail("download", e);
        }
    }

    /// Device address of a span, after checking that it lies inside its buffer. Panics (a bug
    /// in the caller, as with the CPU backend's views) otherwise.
    fn ptr(&self, s: Span) -> u64 {
        let b = &self.bufs[s.buf.0 as usize];
        assert!(
            s.offset.checked_add(s.len).is_some_and(|end| end <= b.len),
            "span {s:?} outside its buffer of {} elements",
            b.len
        );
        b.ptr() + (b.dtype.bytes() * s.offset) as u64
    }

    /// Storage type of a span's buffer.
    fn dt(&self, s: Span) -> Dtype {
        self.bufs[s.buf.0 as usize].dtype
    }

    /// Device address of a span of the token buffer.
    fn tok_ptr(&self, t: TokSpan) -> u64 {
        assert!(
            t.offset + t.len <= self.host_tokens.len(),
            "token span outside the {} tokens set",
            self.host_tokens.len()
        );
        self.tokens.0.as_ref().map_or(0, |m| m.ptr) + 4 * t.offset as u64
    }

    fn fail(&self, what: &str, e: impl std::fmt::Display) -> ! {
        panic!("CUDA error in {what}: {e:#}");
    }

    /// Device address of at least `bytes` bytes of `which` scratch (grown on demand).
    fn scratch(&mut self, which: fn(&mut Self) -> &mut Scratch, bytes: usize) -> u64 {
        if which(self).0.as_ref().is_none_or(|a| a.bytes < bytes) {
            which(self).0 = None;
            let a = self
                .eng
                .alloc(bytes)
                .unwrap_or_else(|e| self.fail("scratch allocation", e));
            which(self).0 = Some(a);
        }
        which(self).0.as_ref().expect("allocated above").ptr
    }

    /// Device address of an array holding `words` (uploaded once, then found by content).
    fn table(&mut self, words: Vec<u64>, what: &str) -> u64 {
        if let Some(t) = self.tables.get(&words) {
            return t.ptr;
        }
        if self.tables.len() >= MAX_TABLES {
            // Queued work may still read the tables about to be freed.
            self.sync();
            self.tables.clear();
        }
        let mem = self
            .eng
            .alloc(8 * words.len().max(1))
            .unwrap_or_else(|e| self.fail(what, e));
        self.upload_bytes(mem.ptr, as_bytes(&words));
        let ptr = mem.ptr;
        self.tables.insert(words, mem);
        ptr
    }

    /// The table of a kernel over many parts (`part_of` in `kernels.cu`): per part its
    /// words, then the number of its first virtual block (the parts' blocks numbered in
    /// order). Returns the table's device address and the total of virtual blocks.
    fn part_table<const W: usize>(
        &mut self,
        parts: impl IntoIterator<Item = ([u64; W], usize)>,
        what: &str,
    ) -> (u64, usize) {
        let mut words = Vec::new();
        let mut first = 0;
        for (row, blocks) in parts {
            words.extend(row);
            words.push(first as u64);
            first += blocks;
        }
        (self.table(words, what), first)
    }

    fn upload_bytes(&self, dst: u64, src: &[u8]) {
        if let Err(e) = self.eng.upload(dst, src) {
            self.fail("upload", e);
        }
    }

    /// Launches kernel `k` for storage type `dt` on `grid` blocks (capped; the kernels loop
    /// grid-stride) of `block` threads with `args`.
    fn launch(&self, k: K, dt: Dtype, grid: u64, block: u32, shmem: u32, args: &[Arg]) {
        if grid == 0 {
            return;
        }
        let grid = grid.min(self.eng.max_blocks() as u64) as u32;
        let index = kernel_index(k, dt);
        if let Some(log) = self.launch_log.borrow_mut().as_mut() {
            if !log.contains(&index) {
                log.push(index);
            }
        }
        if let Err(e) = self.eng.launch(index, grid, block, shmem, args) {
            self.fail(&kernel_names()[index], e);
        }
    }

    /// An elementwise (grid-stride) launch over `n` items.
    fn launch_elems(&self, k: K, dt: Dtype, n: usize, args: &[Arg]) {
        self.launch(
            k,
            dt,
            (n as u64).div_ceil(ELEM_THREADS as u64),
            ELEM_THREADS,
            0,
            args,
        );
    }

    /// An elementwise launch of a kernel that works in 16-byte packs (`Pack` in `kernels.cu`):
    /// one thread per pack of `n` items of type `dt` (the kernels fall back to one item per
    /// step, grid-stride, where their pointers are not 16-byte aligned).
    fn launch_packs(&self, k: K, dt: Dtype, n: usize, args: &[Arg]) {
        self.launch_elems(k, dt, n.div_ceil(16 / dt.bytes()), args);
    }

    /// A row launch: one block of [`ROW_THREADS`] per row (grid-stride over `rows`).
    fn launch_rows(&self, k: K, dt: Dtype, rows: usize, shmem: u32, args: &[Arg]) {
        self.launch(k, dt, rows as u64, ROW_THREADS, shmem, args);
    }

    /// A warp-row launch: one warp per row, [`ROW_THREADS`] / 32 rows per block (grid-stride
    /// over `rows`), for rows of at most a few thousand elements.
    fn launch_warp_rows(&self, k: K, dt: Dtype, rows: usize, args: &[Arg]) {
        let per_block = (ROW_THREADS / WARP) as u64;
        self.launch(
            k,
            dt,
            (rows as u64).div_ceil(per_block),
            ROW_THREADS,
            0,
            args,
        );
    }

    /// `ce_finish` or `ce_fused` (the same arguments, a block per row): the losses, and
    /// with `dloss` the logits' gradient; `ce_fused` also writes `rows`' statistics.
    fn ce_launch(
        &self,
        k: K,
        (losses, logits, rows): (Span, Span, CeRows),
        targets: TokSpan,
        dloss: Option<f32>,
        d: CeDims,
    ) {
        let CeRows { maxes, sums, tl } = rows;
        check_ce(logits, d);
        assert!(losses.len == d.n && maxes.len == d.n && sums.len == d.n && tl.len == d.n);
        assert_eq!(targets.len, d.n, "{k:?}: targets length");
        let args = [
            Arg::Ptr(self.ptr(losses)),
            Arg::Ptr(self.ptr(logits)),
            Arg::Ptr(self.ptr(maxes)),
            Arg::Ptr(self.ptr(sums)),
            Arg::Ptr(self.ptr(tl)),
            Arg::Ptr(self.tok_ptr(targets)),
            Arg::I64(d.vocab_start as i64),
            Arg::F32(dloss.unwrap_or(0.0)),
            Arg::I32(dloss.is_some() as i32),
            Arg::I64(d.n as i64),
            Arg::I64(d.vp as i64),
            Arg::I64(d.v_valid as i64),
        ];
        self.launch_rows(k, self.dt(logits), d.n, 0, &args);
    }

    /// Rotary embeddings in place on `x`, `dir` +1 (forward) or −1 (backward).
    fn rope(&self, r: &Rope, x: Span, dir: f32) {
        r.check(x, "rope");
        assert_eq!(self.dt(r.table), Dtype::F32, "rope: the table is f32");
        let args = [
            Arg::Ptr(self.ptr(x)),
            Arg::Ptr(self.ptr(r.table)),
            Arg::I64(r.n as i64),
            Arg::I64(r.width as i64),
            Arg::I64(r.heads as i64),
            Arg::I64(r.half as i64),
            Arg::I64(r.t as i64),
            Arg::I64(r.positions() as i64),
            Arg::F32(dir),
        ];
        self.launch_packs(K::rope, self.dt(x), r.n * r.heads * r.half, &args);
    }

    /// Uploads `data` into the index scratch; returns its device address.
    fn upload_indices(&mut self, data: &[i32]) -> u64 {
        let p = self.scratch(|b| &mut b.indices, 4 * data.len());
        self.upload_bytes(p, as_bytes(data));
        p
    }
}

/// The bytes of a slice of plain numbers.
fn as_bytes<T: Copy>(x: &[T]) -> &[u8] {
    // SAFETY: `T` is a plain number type (f32, u32, i32, f64 here): every byte of it is
    // initialised and any alignment is valid for u8; the length covers exactly the slice.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

/// The bytes of a mutable slice of plain numbers (any byte pattern is a valid value).
fn as_bytes_mut<T: Copy>(x: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; additionally every byte pattern is a valid f32/f64, so writes
    // through the byte view cannot create an invalid value.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut u8, std::mem::size_of_val(x)) }
}

/// True when NVRTC (`libnvrtc.so.13`) can be loaded; it needs no GPU.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// `kernels.cu` compiled to PTX text for compute capability `major.minor`, exposed so that
/// the kernels can be checked on a machine with NVRTC but no GPU (the backend itself loads
/// [`kernels_cubin`]). Call only when [`nvrtc_available`].
pub fn kernels_ptx(major: i32, minor: i32) -> Result<String> {
    let ptx = compile_kernels(
        &format!("compute_{}", arch_name(major, minor)),
        nvrtc::Output::Ptx,
    )?;
    Ok(String::from_utf8_lossy(&ptx).into_owned())
}

/// `kernels.cu` compiled to machine code (a cubin) for compute capability `major.minor`:
/// what [`CudaBackend::new`] loads, through the on-disk cache ([`kernel_cache`]). Call only
/// when [`nvrtc_available`].
pub fn kernels_cubin(major: i32, minor: i32) -> Result<Vec<u8>> {
    compile_kernels(
        &format!("sm_{}", arch_name(major, minor)),
        nvrtc::Output::Cubin,
    )
}

/// The architecture the kernels are compiled for on a GPU of compute capability
/// `major.minor`: `XY`, or for 9.0 `90a`, Hopper's arch-specific features (wgmma, which the
/// `flash_forward_wgmma` kernels use; code built for it runs on 9.0 only, as it is loaded).
pub fn arch_name(major: i32, minor: i32) -> String {
    let features = if (major, minor) == (9, 0) { "a" } else { "" };
    format!("{major}{minor}{features}")
}

/// Compiles `kernels.cu` for architecture `arch` (`compute_XY` or `sm_XY`) into `out`.
fn compile_kernels(arch: &str, out: nvrtc::Output) -> Result<Vec<u8>> {
    let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    nvrtc::compile(KERNELS_SOURCE, "kernels.cu", &options, out)
        .context("compiling src/backend/cuda/kernels.cu")
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Free device memory only after queued work that may use it.
        let _ = self.eng.sync();
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn describe(&self) -> String {
        self.eng.describe()
    }

    /// The attention's form settings read `timed` where the forms are timed per shape (the
    /// notes on stderr name each choice).
    fn kernel_settings(&self) -> Vec<(&'static str, String)> {
        let f = self.flash;
        let r = f.warp_rows;
        let timed = self.flash_select == FlashSelect::Timed;
        let form = |v: String| if timed { "timed".to_string() } else { v };
        vec![
            (
                FLASH_WARP_ROWS_ENV,
                form(format!("{},{},{}", r.forward, r.dq, r.dkv)),
            ),
            (FLASH_QUERY_ROWS_ENV, form(f.query_rows.0.to_string())),
            (FLASH_MMA_ENV, form(f.mma.name().to_string())),
            (
                LAYERNORM_BACKWARD_ENV,
                self.layernorm_backward.name().to_string(),
            ),
            (CROSS_ENTROPY_ENV, self.cross_entropy.name().to_string()),
            (FLASH_OVERLAP_ENV, form(f.overlap.name().to_string())),
            (FLASH_BACKWARD_ENV, form(f.backward.name().to_string())),
            (FLASH_SELECT_ENV, self.flash_select.name().to_string()),
            (BIAS_GRAD_ENV, self.bias_grad.name().to_string()),
            (GEMM_SELECT_ENV, self.eng.gemm_select().name().to_string()),
        ]
    }

    fn peak_gflops(&self, compute: Dtype) -> Option<(f64, String)> {
        self.eng.peak_gflops(compute)
    }

    fn peak_gbs(&self) -> Option<(f64, String)> {
        self.eng.peak_gbs()
    }

    fn free_memory(&self) -> Option<u64> {
        self.eng.free_bytes().map(|b| b as u64)
    }

    fn alloc(&mut self, len: usize, dtype: Dtype) -> Result<BufId> {
        let mem = if len == 0 {
            None
        } else {
            let a = self.eng.alloc(dtype.bytes() * len).map_err(|e| {
                let free = self.eng.free_bytes().map_or(String::new(), |f| {
                    format!(", {:.1} MiB free", f as f64 / (1 << 20) as f64)
                });
                anyhow::anyhow!(
                    "out of GPU memory allocating {:.1} MiB on {}{free}: {e:#}",
                    (len * dtype.bytes()) as f64 / (1 << 20) as f64,
                    self.eng.describe(),
                )
            })?;
            Some(a)
        };
        self.bufs.push(DeviceBuf { mem, len, dtype });
        Ok(BufId(self.bufs.len() as u32 - 1))
    }

    fn free(&mut self, buf: BufId) {
        // Queued kernels may still use the memory.
        self.sync();
        let dtype = self.bufs[buf.0 as usize].dtype;
        self.bufs[buf.0 as usize] = DeviceBuf {
            mem: None,
            len: 0,
            dtype,
        };
    }

    fn buf_len(&self, buf: BufId) -> usize {
        self.bufs[buf.0 as usize].len
    }

    fn buf_dtype(&self, buf: BufId) -> Dtype {
        self.bufs[buf.0 as usize].dtype
    }

    fn upload(&mut self, dst: Span, src: &[f32]) {
        assert_eq!(dst.len, src.len(), "upload: length");
        if src.is_empty() {
            return;
        }
        match self.dt(dst) {
            Dtype::F32 => self.upload_bytes(self.ptr(dst), as_bytes(src)),
            dt => {
                let mut bytes = Vec::new();
                dt.encode(src, &mut bytes);
                self.upload_bytes(self.ptr(dst), &bytes);
            }
        }
    }

    fn download(&self, src: Span, dst: &mut [f32]) {
        assert_eq!(src.len, dst.len(), "download: length");
        if dst.is_empty() {
            return;
        }
        self.download_raw(self.ptr(src), self.dt(src), dst);
    }

    fn zero(&mut self, s: Span) {
        if s.len > 0 {
            if let Err(e) = self.eng.zero(self.ptr(s), self.dt(s).bytes() * s.len) {
                self.fail("zero", e);
            }
        }
    }

    fn copy(&mut self, dst: Span, src: Span) {
        assert_eq!(dst.len, src.len, "copy: span lengths differ");
        assert!(!dst.overlaps(src), "copy: spans overlap");
        if dst.len == 0 {
            return;
        }
        let (dt, st) = (self.dt(dst), self.dt(src));
        if dt == st {
            if let Err(e) = self
                .eng
                .copy(self.ptr(dst), self.ptr(src), dt.bytes() * dst.len)
            {
                self.fail("copy", e);
            }
        } else {
            assert_eq!(st, Dtype::F32, "copy: converts only from f32");
            let args = [
                Arg::Ptr(self.ptr(dst)),
                Arg::Ptr(self.ptr(src)),
                Arg::I64(dst.len as i64),
            ];
            self.launch_packs(K::convert, dt, dst.len, &args);
        }
    }

    fn set_tokens(&mut self, tokens: &[u32]) {
        self.host_tokens.clear();
        self.host_tokens.extend_from_slice(tokens);
        if !tokens.is_empty() {
            let p = self.scratch(|b| &mut b.tokens, 4 * tokens.len());
            self.upload_bytes(p, as_bytes(tokens));
        }
    }

    fn sync(&self) {
        if let Err(e) = self.eng.sync() {
            self.fail("synchronize", e);
        }
    }

    fn device_address(&self, s: Span) -> Option<u64> {
        assert_eq!(self.dt(s), Dtype::F32, "device_address: {s:?} is not f32");
        Some(self.ptr(s))
    }

    fn device_clock(&self) -> Option<Box<dyn crate::metrics::timers::DeviceClock>> {
        Some(self.eng.clock())
    }

    fn encoder_forward(&mut self, e: &Embedding, out: Span, tokens: TokSpan) {
        let Embedding {
            wte,
            wpe,
            vocab_start,
            b,
            t,
            c,
        } = *e;
        let n = b * t;
        assert!(
            out.len == n * c && tokens.len == n,
            "encoder_forward: shapes"
        );
        if let Some(w) = wpe {
            assert!(w.len >= t * c, "encoder_forward: wpe has fewer than T rows");
        }
        self.launch_elems(
            K::encoder_forward,
            self.dt(out),
            n * c,
            &[
                Arg::Ptr(self.ptr(out)),
                Arg::Ptr(self.tok_ptr(tokens)),
                Arg::Ptr(self.ptr(wte)),
                Arg::Ptr(wpe.map_or(0, |w| self.ptr(w))),
                Arg::I32(wpe.is_some() as i32),
                Arg::I64(vocab_start as i64),
                Arg::I64((wte.len / c) as i64),
                Arg::I64(t as i64),
                Arg::I64(c as i64),
                Arg::I64(n as i64),
            ],
        );
    }

    fn encoder_backward(&mut self, de: &Embedding, dout: Span, tokens: TokSpan) {
        let Embedding {
            wte: dwte,
            wpe: dwpe,
            vocab_start,
            b,
            t,
            c,
        } = *de;
        let n = b * t;
        assert!(
            dout.len == n * c && tokens.len == n,
            "encoder_backward: shapes"
        );
        // Positions bucketed by local row on the host, in the CPU op's order; only the rows
        // that occur are sent: [rows (U) | start (U + 1) | positions].
        let toks = &self.host_tokens[tokens.offset..tokens.offset + tokens.len];
        let (start, pos) = crate::ops::encoder::positions_by_row(toks, vocab_start, dwte.len / c);
        let mut uniq: Vec<i32> = Vec::new();
        let mut starts: Vec<i32> = Vec::new();
        for r in 0..start.len() - 1 {
            if start[r + 1] > start[r] {
                uniq.push(r as i32);
                starts.push(start[r] as i32);
            }
        }
        starts.push(pos.len() as i32);
        let u = uniq.len();
        let mut idx = uniq;
        idx.extend_from_slice(&starts);
        idx.extend(pos.iter().map(|&i| i as i32));
        if u > 0 {
            let base = self.upload_indices(&idx);
            self.launch(
                K::encoder_backward_wte,
                self.dt(dout),
                u as u64,
                ROW_THREADS,
                0,
                &[
                    Arg::Ptr(self.ptr(dwte)),
                    Arg::Ptr(self.ptr(dout)),
                    Arg::Ptr(base),
                    Arg::Ptr(base + 4 * u as u64),
                    Arg::Ptr(base + 4 * (2 * u + 1) as u64),
                    Arg::I32(u as i32),
                    Arg::I64(c as i64),
                ],
            );
        }
        if let Some(dwpe) = dwpe {
            assert!(
                dwpe.len >= t * c,
                "encoder_backward: dwpe has fewer than T rows"
            );
            self.launch_elems(
                K::encoder_backward_wpe,
                self.dt(dout),
                t * c,
                &[
                    Arg::Ptr(self.ptr(dwpe)),
                    Arg::Ptr(self.ptr(dout)),
                    Arg::I64(b as i64),
                    Arg::I64(t as i64),
                    Arg::I64(c as i64),
                ],
            );
        }
    }

    fn layernorm_forward(&mut self, ln: &LayerNorm, out: Span, stats: NormStats, inp: Span) {
        let LayerNorm { w, bias, n, c } = *ln;
        let NormStats { mean, rstd } = stats;
        assert!(out.len == n * c && inp.len == n * c && mean.len == n && rstd.len == n);
        assert!(
            w.len == c && bias.len == c,
            "layernorm_forward: parameter length"
        );
        self.launch_warp_rows(
            K::layernorm_forward,
            self.dt(out),
            n,
            &[
                Arg::Ptr(self.ptr(out)),
                Arg::Ptr(self.ptr(mean)),
                Arg::Ptr(self.ptr(rstd)),
                Arg::Ptr(self.ptr(inp)),
                Arg::Ptr(self.ptr(w)),
                Arg::Ptr(self.ptr(bias)),
                Arg::I64(n as i64),
                Arg::I64(c as i64),
            ],
        );
    }

    fn layernorm_backward(
        &mut self,
        ln: &LayerNorm,
        g: &LayerNormGrads,
        dout: Span,
        inp: Span,
        stats: NormStats,
    ) {
        let LayerNorm { w, n, c, .. } = *ln;
        let LayerNormGrads { dinp, dw, dbias } = *g;
        let NormStats { mean, rstd } = stats;
        assert!(dinp.len == n * c && dout.len == n * c && inp.len == n * c);
        assert!(w.len == c && dw.len == c && dbias.len == c && mean.len == n && rstd.len == n);
        // The one-pass kernel's shared memory: each warp's column sums of dout and dout·x̂.
        let (fused_warps, warp_bytes) = norm_backward_warps(2, c);
        if self.layernorm_backward == LayernormBackward::Fused && fused_warps > 0 {
            let chunks = n.div_ceil(COLUMN_CHUNK_ROWS).max(1);
            let (part, part2) = self.column_partial_sums(chunks, c);
            self.launch(
                K::layernorm_backward,
                self.dt(dinp),
                chunks as u64,
                fused_warps as u32 * WARP,
                (fused_warps * warp_bytes) as u32,
                &[
                    Arg::Ptr(self.ptr(dinp)),
                    Arg::Ptr(part),
                    Arg::Ptr(part2),
                    Arg::Ptr(self.ptr(dout)),
                    Arg::Ptr(self.ptr(inp)),
                    Arg::Ptr(self.ptr(w)),
                    Arg::Ptr(self.ptr(mean)),
                    Arg::Ptr(self.ptr(rstd)),
                    Arg::I64(n as i64),
                    Arg::I64(c as i64),
                    Arg::I64(COLUMN_CHUNK_ROWS as i64),
                    Arg::I64(chunks as i64),
                ],
            );
            self.column_finish(dbias, part, Some((dw, part2)), c, chunks);
            return;
        }
        self.launch_rows(
            K::layernorm_backward_dinp,
            self.dt(dinp),
            n,
            0,
            &[
                Arg::Ptr(self.ptr(dinp)),
                Arg::Ptr(self.ptr(dout)),
                Arg::Ptr(self.ptr(inp)),
                Arg::Ptr(self.ptr(w)),
                Arg::Ptr(self.ptr(mean)),
                Arg::Ptr(self.ptr(rstd)),
                Arg::I64(n as i64),
                Arg::I64(c as i64),
            ],
        );
        self.column_sums(dbias, Some((dw, inp, mean, rstd)), dout, n, c);
    }

    fn linear_forward(&mut self, l: &Linear, out: Span, inp: Span) {
        let Linear { bias, n, oc, .. } = *l;
        let call = self.linear_call(l, out, inp);
        let Some(bias) = bias else {
            return self.queue_gemm("linear_forward", &call);
        };
        self.check_bias("linear_forward", Some(bias), out, oc);
        // The bias goes in the GEMM's epilogue where the engine has one for it; otherwise a
        // kernel writes it into every row of `out` first and the GEMM adds to it (beta = 1).
        let at = self.ptr(bias);
        if self.try_epilogue(&call, Epilogue::Bias { bias: at }) {
            return;
        }
        self.launch_elems(
            K::broadcast_rows,
            self.dt(out),
            n * oc,
            &[
                Arg::Ptr(self.ptr(out)),
                Arg::Ptr(at),
                Arg::I64(n as i64),
                Arg::I64(oc as i64),
            ],
        );
        self.queue_gemm("linear_forward", &GemmCall { beta: 1.0, ..call });
    }

    fn linear_backward(&mut self, l: &Linear, g: &LinearGrads, dout: Span, inp: Span) {
        let LinearGrads { dinp, dw, dbias } = *g;
        if let Some(dinp) = dinp {
            let call = self.input_grad_call(l, dinp, dout);
            self.queue_gemm("linear_backward", &call);
        }
        self.linear_param_grads(l, (dw, dbias), dout, inp);
    }

    fn residual_epilogue(&self, _dt: Dtype) -> bool {
        true
    }

    fn linear_residual_forward(
        &mut self,
        l: &Linear,
        out: Span,
        resid: Span,
        scratch: Span,
        inp: Span,
    ) {
        let Linear { bias, oc, .. } = *l;
        assert!(
            resid.len == out.len && self.dt(resid) == self.dt(out) && !resid.overlaps(out),
            "linear_residual_forward: resid"
        );
        self.check_bias("linear_residual_forward", bias, out, oc);
        // The GEMM reads the stream as its C (beta = 1) and writes the new one, the bias in
        // its epilogue; where cuBLASLt has no algorithm for that (or the bias is not 16-byte
        // aligned), the two ops.
        let call = self.linear_call(l, out, inp);
        let epilogue = Epilogue::Residual {
            bias: bias.map_or(0, |b| self.ptr(b)),
            resid: self.ptr(resid),
        };
        if self.try_epilogue(&call, epilogue) {
            return;
        }
        crate::backend::linear_then_residual(self, l, out, resid, scratch, inp);
    }

    fn gelu_epilogue(&self, dt: Dtype) -> bool {
        // cuBLASLt's GELU is the tanh form within 2e-4 in f32 (lt.rs): far below a 16-bit
        // type's rounding, not below f32's, whose runs are the references.
        dt != Dtype::F32
    }

    fn linear_gelu_forward(&mut self, l: &Linear, out: Span, pre: Span, inp: Span) {
        let Linear { bias, n, oc, .. } = *l;
        assert!(
            pre.len == n * oc && self.dt(pre) == self.dt(out),
            "linear_gelu_forward: pre"
        );
        self.check_bias("linear_gelu_forward", bias, out, oc);
        if self.gelu_epilogue(self.dt(out)) {
            let call = self.linear_call(l, out, inp);
            let epilogue = Epilogue::GeluAux {
                bias: bias.map_or(0, |b| self.ptr(b)),
                aux: self.ptr(pre),
                ld_aux: oc,
            };
            if self.try_epilogue(&call, epilogue) {
                return;
            }
        }
        crate::backend::linear_then_gelu(self, l, out, pre, inp);
    }

    fn gelu_linear_backward(
        &mut self,
        l: &Linear,
        g: &LinearGrads,
        scratch: Span,
        dout: Span,
        inp: Span,
        pre: Span,
    ) {
        let Linear { n, ic, .. } = *l;
        let (dw, dbias) = (g.dw, g.dbias);
        let dpre = g
            .dinp
            .expect("gelu_linear_backward writes the GELU's input gradient");
        assert!(
            pre.len == n * ic && self.dt(pre) == self.dt(dpre),
            "gelu_linear_backward: pre"
        );
        if self.gelu_epilogue(self.dt(dpre)) {
            let call = self.input_grad_call(l, dpre, dout);
            let epilogue = Epilogue::GeluGrad {
                aux: self.ptr(pre),
                ld_aux: ic,
            };
            if self.try_epilogue(&call, epilogue) {
                return self.linear_param_grads(l, (dw, dbias), dout, inp);
            }
        }
        crate::backend::linear_then_gelu_backward(self, l, g, scratch, dout, inp, pre);
    }

    fn attention_scores(&mut self, att: Span, qkv: Span, d: AttnDims) {
        // att[b, h][r0..r1, 0..r1] = scale · Q_h[r0..r1] · K_h[0..r1]ᵀ per causal block;
        // entries right of the block's last row are left unwritten (the softmax ignores them).
        let a = Attn::new(self, att, qkv, d);
        for (r0, r1) in causal_blocks(d.t) {
            let (q, k, c) = (a.qkv(0, r0), a.qkv(1, 0), a.att_at(r0, 0));
            let m = (r1 - r0, r1, d.hs);
            self.gemm_ptrs(
                "attention_scores",
                problem((false, true), m, a.scale, 0.0),
                &q,
                &k,
                &c,
            );
        }
    }

    fn attention_softmax(&mut self, att: Span, d: AttnDims) {
        let rows = d.b * d.nh * d.t;
        assert_eq!(att.len, rows * d.t, "attention_softmax: att length");
        self.launch_warp_rows(
            K::attention_softmax,
            self.dt(att),
            rows,
            &[
                Arg::Ptr(self.ptr(att)),
                Arg::I64(rows as i64),
                Arg::I64(d.t as i64),
                Arg::I64(causal_block_rows(d.t) as i64),
            ],
        );
    }

    fn attention_values(&mut self, out: Span, att: Span, qkv: Span, d: AttnDims) {
        // out[b, r0..r1, h] = att[b, h][r0..r1, 0..r1] · V_h[0..r1] (the rest of the row is 0).
        let a = Attn::new(self, att, qkv, d);
        let o = a.btc(self, out);
        for (r0, r1) in causal_blocks(d.t) {
            let (p, v, y) = (a.att_at(r0, 0), a.qkv(2, 0), a.rows_of(&o, r0));
            let m = (r1 - r0, d.hs, r1);
            self.gemm_ptrs(
                "attention_values",
                problem((false, false), m, 1.0, 0.0),
                &p,
                &v,
                &y,
            );
        }
    }

    fn attention_values_backward(
        &mut self,
        datt: Span,
        dqkv: Span,
        dout: Span,
        att: Span,
        qkv: Span,
        d: AttnDims,
    ) {
        let a = Attn::new(self, att, qkv, d);
        let da = Attn::new(self, datt, dqkv, d);
        let g = a.btc(self, dout);
        for (r0, r1) in causal_blocks(d.t) {
            // datt[b, h][r0..r1, 0..r1] = dout_h[r0..r1] · V_h[0..r1]ᵀ (right of it unwritten:
            // the softmax backward ignores and zeroes it).
            let (dy, v, c) = (a.rows_of(&g, r0), a.qkv(2, 0), da.att_at(r0, 0));
            let m = (r1 - r0, r1, d.hs);
            let what = "attention_values_backward";
            self.gemm_ptrs(what, problem((false, true), m, 1.0, 0.0), &dy, &v, &c);
            // dV_h[r0..r1] = att[b, h][r0..T, r0..r1]ᵀ · dout_h[r0..T] (att is 0 above the
            // diagonal, so earlier rows add nothing); a key/value head's group members add
            // their shares in turn.
            let (p, dy, dv) = (a.att_at(r0, r0), a.rows_of(&g, r0), da.qkv(2, r0));
            let m = (r1 - r0, d.hs, d.t - r0);
            for i in 0..a.group() {
                let (p, dy, dv) = (a.members(&p, i), a.members(&dy, i), a.members(&dv, i));
                let beta = if i == 0 { 0.0 } else { 1.0 };
                self.gemm_ptrs(what, problem((true, false), m, 1.0, beta), &p, &dy, &dv);
            }
        }
    }

    fn attention_softmax_backward(&mut self, datt: Span, att: Span, d: AttnDims) {
        let rows = d.b * d.nh * d.t;
        assert!(
            att.len == rows * d.t && datt.len == rows * d.t,
            "attention_softmax_backward"
        );
        self.launch_warp_rows(
            K::attention_softmax_backward,
            self.dt(datt),
            rows,
            &[
                Arg::Ptr(self.ptr(datt)),
                Arg::Ptr(self.ptr(att)),
                Arg::I64(rows as i64),
                Arg::I64(d.t as i64),
                Arg::I64(causal_block_rows(d.t) as i64),
            ],
        );
    }

    fn attention_scores_backward(&mut self, dqkv: Span, datt: Span, qkv: Span, d: AttnDims) {
        let a = Attn::new(self, datt, qkv, d);
        let da = Attn::new(self, datt, dqkv, d);
        let what = "attention_scores_backward";
        for (r0, r1) in causal_blocks(d.t) {
            // dQ_h[r0..r1] = scale · datt[r0..r1, 0..r1] · K_h[0..r1]
            let (ds, k, dq) = (a.att_at(r0, 0), a.qkv(1, 0), da.qkv(0, r0));
            let m = (r1 - r0, d.hs, r1);
            self.gemm_ptrs(what, problem((false, false), m, a.scale, 0.0), &ds, &k, &dq);
            // dK_h[r0..r1] = scale · datt[r0..T, r0..r1]ᵀ · Q_h[r0..T], summed over the
            // key/value head's group members in turn.
            let (ds, q, dk) = (a.att_at(r0, r0), a.qkv(0, r0), da.qkv(1, r0));
            let m = (r1 - r0, d.hs, d.t - r0);
            for i in 0..a.group() {
                let (ds, q, dk) = (a.members(&ds, i), a.members(&q, i), a.members(&dk, i));
                let beta = if i == 0 { 0.0 } else { 1.0 };
                self.gemm_ptrs(what, problem((true, false), m, a.scale, beta), &ds, &q, &dk);
            }
        }
    }

    fn fused_attention(&self, hs: usize, dt: Dtype) -> FusedAttention {
        // The kernels hold a head in 64 or 128 columns of 16-bit values and multiply on the
        // tensor cores (flash_* in kernels.cu); the head-128 ones need more shared memory than
        // some GPUs give a block.
        let fits = hs <= FLASH_HEAD_64
            || (hs <= FLASH_MAX_HEAD
                && d128_shmem(D128_MOST_TILES) <= self.eng.max_dynamic_shared());
        if dt != Dtype::F32 && fits && self.eng.mma_16bit() {
            FusedAttention::Preferred
        } else {
            FusedAttention::Unsupported
        }
    }

    fn attention_forward(&mut self, out: Span, lse: Span, qkv: Span, d: AttnDims) {
        let dt = self.fused_dtype(d, &[out, qkv], "attention_forward");
        assert!(
            out.len == d.b * d.t * d.nh * d.hs && lse.len == d.b * d.nh * d.t,
            "attention_forward: out/lse length"
        );
        assert_eq!(self.dt(lse), Dtype::F32, "attention_forward: lse is f32");
        let form = self.forward_form(qkv, d, dt);
        let outs = (self.ptr(out), self.ptr(lse));
        self.flash_forward(form, outs, qkv, d, dt);
    }

    fn attention_backward(
        &mut self,
        dqkv: Span,
        dout: Span,
        FusedOut { out, lse }: FusedOut,
        qkv: Span,
        d: AttnDims,
        rope: Option<&Rope>,
    ) {
        let dt = self.fused_dtype(d, &[dqkv, dout, out, qkv], "attention_backward");
        assert!(
            dqkv.len == qkv.len && dout.len == out.len && lse.len == d.b * d.nh * d.t,
            "attention_backward: lengths"
        );
        let delta = self.scratch(|s| &mut s.attn_delta, 4 * lse.len);
        let (rope_args, rope_after) = self.rope_args(rope, dqkv, d);
        let mut call = FlashBackwardCall {
            form: self.flash,
            dt,
            delta,
            dqkv: self.ptr(dqkv),
            dout,
            out,
            lse,
            qkv,
            d,
            rope: rope_args,
        };
        call.form = self.backward_form_for(&call);
        self.flash_backward(&call);
        if let Some(r) = rope_after {
            self.rope(r, dqkv, -1.0);
        }
    }

    fn rope_in_attention_backward(&self, hs: usize) -> bool {
        rope_in_stores(hs)
    }

    fn attention_decode(&mut self, out: Span, q: Span, kv: KvRows, d: AttnDims) {
        let KvRows {
            k: k_cache,
            v: v_cache,
            len,
        } = kv;
        let (nh, hs) = (d.nh, d.hs);
        let (c, ckv) = (nh * hs, d.kv * hs);
        assert!(
            out.len == c && q.len == c && len >= 1 && d.kv > 0 && nh.is_multiple_of(d.kv),
            "attention_decode: shapes"
        );
        assert!(
            k_cache.len >= len * ckv && v_cache.len >= len * ckv,
            "attention_decode: cache"
        );
        self.launch(
            K::attention_decode,
            self.dt(out),
            nh as u64,
            ROW_THREADS,
            (4 * len) as u32,
            &[
                Arg::Ptr(self.ptr(out)),
                Arg::Ptr(self.ptr(q)),
                Arg::Ptr(self.ptr(k_cache)),
                Arg::Ptr(self.ptr(v_cache)),
                Arg::I64(len as i64),
                Arg::I64(nh as i64),
                Arg::I64(d.kv as i64),
                Arg::I64(hs as i64),
                Arg::F32(attention_scale(hs)),
            ],
        );
    }

    fn rmsnorm_forward(&mut self, r: &RmsNorm, out: Span, rstd: Span, inp: Span) {
        let (n, c) = (r.n, r.c);
        assert!(out.len == n * c && inp.len == n * c && rstd.len == n && r.w.len == c);
        self.launch_warp_rows(
            K::rmsnorm_forward,
            self.dt(out),
            n,
            &[
                Arg::Ptr(self.ptr(out)),
                Arg::Ptr(self.ptr(rstd)),
                Arg::Ptr(self.ptr(inp)),
                Arg::Ptr(self.ptr(r.w)),
                Arg::I64(n as i64),
                Arg::I64(c as i64),
                Arg::F32(r.eps as f32),
            ],
        );
    }

    fn rmsnorm_backward(
        &mut self,
        r: &RmsNorm,
        g: &RmsNormGrads,
        dout: Span,
        inp: Span,
        rstd: Span,
    ) {
        let (n, c) = (r.n, r.c);
        assert!(g.dinp.len == n * c && dout.len == n * c && inp.len == n * c);
        assert!(g.dw.len == c && r.w.len == c && rstd.len == n);
        let chunks = n.div_ceil(COLUMN_CHUNK_ROWS).max(1);
        // The one-pass kernel (layernorm_backward's RMS form, FUGU_LAYERNORM_BACKWARD): each
        // warp's column sums of dout·x̂ in shared memory.
        let (fused_warps, warp_bytes) = norm_backward_warps(1, c);
        // Both forms' kernels take the rows first.
        let rows = [
            Arg::Ptr(self.ptr(g.dinp)),
            Arg::Ptr(self.ptr(dout)),
            Arg::Ptr(self.ptr(inp)),
            Arg::Ptr(self.ptr(r.w)),
            Arg::Ptr(self.ptr(rstd)),
            Arg::I64(n as i64),
            Arg::I64(c as i64),
        ];
        if self.layernorm_backward == LayernormBackward::Fused && fused_warps > 0 {
            let (part, _) = self.column_partial_sums(chunks, c);
            let mut args = rows.to_vec();
            args.extend([
                Arg::Ptr(part),
                Arg::I64(COLUMN_CHUNK_ROWS as i64),
                Arg::I64(chunks as i64),
            ]);
            let (threads, shmem) = (fused_warps as u32 * WARP, (fused_warps * warp_bytes) as u32);
            let dt = self.dt(g.dinp);
            self.launch(
                K::rmsnorm_backward,
                dt,
                chunks as u64,
                threads,
                shmem,
                &args,
            );
            return self.column_finish(g.dw, part, None, c, chunks);
        }
        self.launch_rows(K::rmsnorm_backward_dinp, self.dt(g.dinp), n, 0, &rows);
        let (part, _) = self.column_partial_sums(chunks, c);
        self.launch_packs(
            K::rmsnorm_dw_partials,
            self.dt(dout),
            chunks * c,
            &[
                Arg::Ptr(part),
                Arg::Ptr(self.ptr(dout)),
                Arg::Ptr(self.ptr(inp)),
                Arg::Ptr(self.ptr(rstd)),
                Arg::I64(n as i64),
                Arg::I64(c as i64),
                Arg::I64(COLUMN_CHUNK_ROWS as i64),
                Arg::I64(chunks as i64),
            ],
        );
        self.column_finish(g.dw, part, None, c, chunks);
    }

    fn rope_forward(&mut self, r: &Rope, x: Span) {
        self.rope(r, x, 1.0);
    }

    fn rope_backward(&mut self, r: &Rope, dx: Span) {
        self.rope(r, dx, -1.0);
    }

    fn swiglu_forward(&mut self, out: Span, inp: Span, f: usize) {
        assert!(f > 0 && inp.len == 2 * out.len && out.len.is_multiple_of(f));
        let n = out.len / f;
        let args = [
            Arg::Ptr(self.ptr(out)),
            Arg::Ptr(self.ptr(inp)),
            Arg::I64(n as i64),
            Arg::I64(f as i64),
        ];
        self.launch_packs(K::swiglu_forward, self.dt(out), out.len, &args);
    }

    fn swiglu_backward(&mut self, dinp: Span, dout: Span, inp: Span, f: usize) {
        assert!(f > 0 && inp.len == 2 * dout.len && dinp.len == inp.len);
        assert!(dout.len.is_multiple_of(f));
        let n = dout.len / f;
        let args = [
            Arg::Ptr(self.ptr(dinp)),
            Arg::Ptr(self.ptr(dout)),
            Arg::Ptr(self.ptr(inp)),
            Arg::I64(n as i64),
            Arg::I64(f as i64),
        ];
        self.launch_packs(K::swiglu_backward, self.dt(dinp), dout.len, &args);
    }

    fn gelu_forward(&mut self, out: Span, inp: Span) {
        assert_eq!(out.len, inp.len, "gelu_forward: lengths differ");
        let args = [
            Arg::Ptr(self.ptr(out)),
            Arg::Ptr(self.ptr(inp)),
            Arg::I64(out.len as i64),
        ];
        self.launch_packs(K::gelu_forward, self.dt(out), out.len, &args);
    }

    fn gelu_backward(&mut self, dinp: Span, inp: Span, dout: Span) {
        assert!(
            dinp.len == inp.len && dout.len == inp.len,
            "gelu_backward: lengths"
        );
        let args = [
            Arg::Ptr(self.ptr(dinp)),
            Arg::Ptr(self.ptr(inp)),
            Arg::Ptr(self.ptr(dout)),
            Arg::I64(inp.len as i64),
        ];
        self.launch_packs(K::gelu_backward, self.dt(dinp), inp.len, &args);
    }

    fn residual_forward(&mut self, out: Span, a: Span, b: Span) {
        assert!(
            out.len == a.len && out.len == b.len,
            "residual_forward: lengths"
        );
        let args = [
            Arg::Ptr(self.ptr(out)),
            Arg::Ptr(self.ptr(a)),
            Arg::Ptr(self.ptr(b)),
            Arg::I64(out.len as i64),
        ];
        self.launch_packs(K::residual_forward, self.dt(out), out.len, &args);
    }

    fn add_inplace(&mut self, acc: Span, x: Span) {
        assert_eq!(acc.len, x.len, "add_inplace: lengths");
        let args = [
            Arg::Ptr(self.ptr(acc)),
            Arg::Ptr(self.ptr(x)),
            Arg::I64(acc.len as i64),
        ];
        self.launch_packs(K::add_inplace, self.dt(acc), acc.len, &args);
    }

    fn scale_inplace(&mut self, x: Span, factor: f32) {
        let args = [
            Arg::Ptr(self.ptr(x)),
            Arg::F32(factor),
            Arg::I64(x.len as i64),
        ];
        self.launch_packs(K::scale_inplace, self.dt(x), x.len, &args);
    }

    fn ce_row_stats(&mut self, maxes: Span, sums: Span, logits: Span, d: CeDims) {
        check_ce(logits, d);
        assert!(maxes.len == d.n && sums.len == d.n, "ce_row_stats: lengths");
        let args = [
            Arg::Ptr(self.ptr(maxes)),
            Arg::Ptr(self.ptr(sums)),
            Arg::Ptr(self.ptr(logits)),
            Arg::I64(d.n as i64),
            Arg::I64(d.vp as i64),
            Arg::I64(d.v_valid as i64),
        ];
        self.launch_rows(K::ce_row_stats, self.dt(logits), d.n, 0, &args);
    }

    fn ce_rescale_sums(&mut self, sums: Span, local_maxes: Span, maxes: Span) {
        assert!(
            local_maxes.len == sums.len && maxes.len == sums.len,
            "ce_rescale_sums: lengths"
        );
        let args = [
            Arg::Ptr(self.ptr(sums)),
            Arg::Ptr(self.ptr(local_maxes)),
            Arg::Ptr(self.ptr(maxes)),
            Arg::I64(sums.len as i64),
        ];
        self.launch_elems(K::ce_rescale_sums, self.dt(sums), sums.len, &args);
    }

    fn ce_target_logit(&mut self, tl: Span, logits: Span, targets: TokSpan, d: CeDims) {
        check_ce(logits, d);
        assert!(
            tl.len == d.n && targets.len == d.n,
            "ce_target_logit: lengths"
        );
        let args = [
            Arg::Ptr(self.ptr(tl)),
            Arg::Ptr(self.ptr(logits)),
            Arg::Ptr(self.tok_ptr(targets)),
            Arg::I64(d.vocab_start as i64),
            Arg::I64(d.n as i64),
            Arg::I64(d.vp as i64),
            Arg::I64(d.v_valid as i64),
        ];
        self.launch_elems(K::ce_target_logit, self.dt(logits), d.n, &args);
    }

    fn ce_finish(
        &mut self,
        losses: Span,
        logits: Span,
        rows: CeRows,
        targets: TokSpan,
        dloss: Option<f32>,
        d: CeDims,
    ) {
        self.ce_launch(K::ce_finish, (losses, logits, rows), targets, dloss, d);
    }

    fn ce_whole_vocab(
        &mut self,
        losses: Span,
        logits: Span,
        rows: CeRows,
        targets: TokSpan,
        dloss: Option<f32>,
        d: CeDims,
    ) {
        assert_eq!(
            d.vocab_start, 0,
            "ce_whole_vocab: logits split across ranks"
        );
        if self.cross_entropy == CrossEntropyForm::Split {
            self.ce_row_stats(rows.maxes, rows.sums, logits, d);
            self.ce_target_logit(rows.tl, logits, targets, d);
            return self.ce_finish(losses, logits, rows, targets, dloss, d);
        }
        self.ce_launch(K::ce_fused, (losses, logits, rows), targets, dloss, d);
    }

    fn sum_of_squares(&mut self, xs: &[Span]) -> Vec<f64> {
        // One launch for all spans, one download of the partials: a single host
        // synchronisation per gradient norm. A span's virtual blocks (each a partial) depend
        // only on its length, so the result is deterministic.
        if xs.is_empty() {
            return Vec::new();
        }
        let dt = self.dt(xs[0]);
        assert!(
            xs.iter().all(|&x| self.dt(x) == dt),
            "sum_of_squares: spans of one type"
        );
        let blocks: Vec<usize> = xs
            .iter()
            .map(|x| x.len.div_ceil(ROW_THREADS as usize).clamp(1, SOS_BLOCKS))
            .collect();
        let rows: Vec<_> = xs
            .iter()
            .zip(&blocks)
            .map(|(x, &nb)| ([self.ptr(*x), x.len as u64, nb as u64], nb))
            .collect();
        let (table, total) = self.part_table(rows, "sum_of_squares table");
        let sos = self.scratch(|b| &mut b.sos, 8 * total);
        let args = [
            Arg::Ptr(sos),
            Arg::Ptr(table),
            Arg::I32(xs.len() as i32),
            Arg::I64(total as i64),
        ];
        self.launch(K::sum_of_squares, dt, total as u64, ROW_THREADS, 0, &args);
        let mut parts = vec![0.0f64; total];
        if let Err(e) = self.eng.download(as_bytes_mut(&mut parts[..]), sos) {
            self.fail("sum_of_squares", e);
        }
        let mut at = 0;
        blocks
            .iter()
            .map(|&nb| {
                let s = parts[at..at + nb].iter().sum();
                at += nb;
                s
            })
            .collect()
    }

    fn adamw(&mut self, parts: &[AdamWPart], hp: &AdamWStep) {
        // One launch for all parts: a table row per part (addresses, length, whether decayed,
        // the compute copy, first virtual block of ADAMW_CHUNK elements). The table's content
        // does not change between steps (the learning rate and decay factor travel as
        // arguments). The kernel's type is the compute copy's (f32: none).
        let Some(first_part) = parts.first() else {
            return;
        };
        let dt = first_part.compute.map_or(Dtype::F32, |c| self.dt(c));
        let rows: Vec<_> = parts
            .iter()
            .map(|p| {
                let n = p.params.len;
                let f32s = [p.params, p.grads, p.m, p.v].map(|s| self.dt(s) == Dtype::F32);
                let copy = p.compute.map_or(Dtype::F32, |c| self.dt(c));
                assert!(
                    [p.grads, p.m, p.v].iter().all(|s| s.len == n)
                        && f32s.iter().all(|&f| f)
                        && p.compute.is_none_or(|c| c.len == n && copy != Dtype::F32)
                        && copy == dt,
                    "adamw: a part's spans differ in length or type (f32 and one 16-bit \
                     compute copy type for all parts, or none): {p:?}"
                );
                let row = [
                    self.ptr(p.params),
                    self.ptr(p.grads),
                    self.ptr(p.m),
                    self.ptr(p.v),
                    n as u64,
                    u64::from(p.decay),
                    p.compute.map_or(0, |c| self.ptr(c)),
                ];
                (row, n.div_ceil(ADAMW_CHUNK))
            })
            .collect();
        let (table, first) = self.part_table(rows, "adamw table");
        if first == 0 {
            return;
        }
        let k = crate::ops::adamw::step_scalars(hp);
        let args = [
            Arg::Ptr(table),
            Arg::I32(parts.len() as i32),
            Arg::I64(first as i64),
            Arg::F32(k.beta1),
            Arg::F32(k.beta2),
            Arg::F32(k.eps),
            Arg::F32(k.scale),
            Arg::F32(k.one_m_b1),
            Arg::F32(k.one_m_b2),
            Arg::F32(k.neg_step_size),
            Arg::F32(k.bc2_sqrt),
            Arg::F32(k.decay),
        ];
        self.launch(K::adamw, dt, first as u64, ELEM_THREADS, 0, &args);
    }
}

fn check_ce(logits: Span, d: CeDims) {
    assert!(
        d.vp > 0 && d.v_valid <= d.vp,
        "cross-entropy: bad vocabulary sizes {d:?}"
    );
    assert_eq!(logits.len, d.n * d.vp, "cross-entropy: logits length");
}

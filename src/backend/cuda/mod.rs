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
//! ([`Backend::with_host`]'s default and the gradient buckets' `download`). A CUDA-aware MPI or
//! NCCL would hand device pointers to the collective instead and save the two PCIe copies per
//! all-reduce.

use super::WeightLayout;
use super::{AdamWStep, AttnDims, Backend, BufId, CeDims, CudaSettings, Span, TokSpan};
use anyhow::{bail, Context, Result};
use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream,
    DevicePtr, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// The kernels' CUDA C source (compiled by NVRTC when a backend is created).
pub const KERNELS_SOURCE: &str = include_str!("kernels.cu");

/// NVRTC options: no FMA contraction (the CPU reference has none), IEEE division and square
/// root (NVRTC's defaults, spelled out).
pub const NVRTC_OPTIONS: &[&str] = &["--fmad=false", "--prec-div=true", "--prec-sqrt=true"];

/// Threads per block of the row kernels (`ROW_THREADS` in `kernels.cu`).
const ROW_THREADS: u32 = 256;
/// Threads per block of elementwise kernels.
const ELEM_THREADS: u32 = 256;
/// Grid-size cap of the grid-stride kernels.
const MAX_BLOCKS: u64 = 65_535;
/// Blocks of the sum-of-squares kernel (fixed, so the partial sums have a fixed shape).
const SOS_BLOCKS: usize = 512;
/// Rows per chunk of the two-stage column sums (dbias, layernorm dw/dbias).
const COLUMN_CHUNK_ROWS: usize = 64;

macro_rules! kernels {
    ($($name:ident),* $(,)?) => {
        /// The compiled kernels, one field per `extern "C"` kernel of `kernels.cu`.
        struct Kernels {
            $($name: CudaFunction,)*
        }

        impl Kernels {
            fn load(m: &Arc<CudaModule>) -> Result<Kernels> {
                Ok(Kernels {
                    $($name: m.load_function(stringify!($name)).with_context(|| {
                        format!("kernels.cu has no kernel {}", stringify!($name))
                    })?,)*
                })
            }
        }

        /// Names of the kernels [`CudaBackend`] loads from `kernels.cu`.
        pub const KERNEL_NAMES: &[&str] = &[$(stringify!($name)),*];
    };
}

kernels!(
    encoder_forward,
    encoder_backward_wte,
    encoder_backward_wpe,
    layernorm_forward,
    layernorm_backward_dinp,
    column_partials,
    column_finish,
    broadcast_rows,
    attention_softmax,
    attention_softmax_backward,
    attention_decode,
    gelu_forward,
    gelu_backward,
    residual_forward,
    add_inplace,
    ce_row_max,
    ce_row_sumexp,
    ce_target_logit,
    ce_finish,
    adamw,
    sum_of_squares,
);

/// One kernel argument (device pointers travel as `u64`, sizes as `i64`, matching the
/// `float*` / `long long` parameters of `kernels.cu`).
enum Arg {
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
}

/// Device memory of one buffer; `None` for zero-length and freed buffers.
struct DeviceBuf {
    /// Owns the allocation that `ptr` points into (freed on drop).
    _mem: Option<CudaSlice<f32>>,
    ptr: u64,
    len: usize,
}

/// A device-memory backend on one GPU.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    _module: Arc<CudaModule>,
    bufs: Vec<DeviceBuf>,
    /// Token ids on the device and their host copy (the embedding backward buckets positions
    /// by token on the host).
    tokens: Option<CudaSlice<u32>>,
    host_tokens: Vec<u32>,
    /// Scratch: column partial sums (floats), embedding-backward index lists (ints), and the
    /// sum-of-squares partials (doubles). Grown on demand, never shrunk.
    partials: Option<CudaSlice<f32>>,
    indices: Option<CudaSlice<i32>>,
    sos: CudaSlice<f64>,
    name: String,
}

/// Fails with a clear message unless the dynamic library behind `present` can be loaded.
fn require_lib(present: bool, what: &str) -> Result<()> {
    if !present {
        bail!(
            "{what} not found: install it, or put the folder that holds it on LD_LIBRARY_PATH \
             (CUDA 13 libraries, e.g. from the nvidia-cublas and nvidia-cuda-nvrtc Python \
             packages), or run with --device cpu"
        );
    }
    Ok(())
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles the kernels and creates the cuBLAS handle.
    pub fn new(ordinal: usize, settings: CudaSettings) -> Result<CudaBackend> {
        // SAFETY: these only try to dlopen the libraries (no CUDA call is made).
        let (driver, blas, nvrtc) = unsafe {
            (
                drv_sys::is_culib_present(),
                blas_sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
            )
        };
        if !driver {
            bail!(
                "no CUDA driver found (libcuda.so.1): this machine has no NVIDIA driver or GPU; \
                 run with --device cpu"
            );
        }
        require_lib(blas, "cuBLAS (libcublas.so.13)")?;
        require_lib(nvrtc, "NVRTC (libnvrtc.so.13)")?;
        let count = CudaContext::device_count().context("counting CUDA devices")? as usize;
        if ordinal >= count {
            bail!("--device cuda:{ordinal}: this machine has {count} CUDA device(s)");
        }
        let ctx =
            CudaContext::new(ordinal).with_context(|| format!("opening CUDA device {ordinal}"))?;
        // SAFETY: one stream only (the legacy default stream), so cudarc's cross-stream event
        // tracking has nothing to order.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let (major, minor) = ctx.compute_capability()?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let ptx = compile_kernels(major, minor)?;
        let module = ctx
            .load_module(ptx)
            .context("loading the compiled kernels")?;
        let k = Kernels::load(&module)?;
        let blas = CudaBlas::new(stream.clone()).context("creating the cuBLAS handle")?;
        let mode = if settings.tf32 {
            blas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            blas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        // SAFETY: the handle is live (owned by `blas`).
        unsafe { blas_sys::cublasSetMathMode(*blas.handle(), mode) }
            .result()
            .context("setting the cuBLAS math mode")?;
        let sos = stream.alloc_zeros::<f64>(SOS_BLOCKS)?;
        Ok(CudaBackend {
            ctx,
            stream,
            blas,
            k,
            _module: module,
            bufs: Vec::new(),
            tokens: None,
            host_tokens: Vec::new(),
            partials: None,
            indices: None,
            sos,
            name: format!(
                "{name} (sm_{major}{minor}{})",
                if settings.tf32 { ", TF32" } else { "" }
            ),
        })
    }

    /// FP32 CUDA-core peak: SMs × FP32 lanes per SM × 2 (FMA) × clock. TF32 tensor-core
    /// peaks are not modelled, so `--tf32` runs report MFU against the FP32 peak too.
    fn fp32_peak_gflops(&self) -> Option<f64> {
        use drv_sys::CUdevice_attribute::{
            CU_DEVICE_ATTRIBUTE_CLOCK_RATE, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        };
        let sms = self
            .ctx
            .attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .ok()? as f64;
        let khz = self.ctx.attribute(CU_DEVICE_ATTRIBUTE_CLOCK_RATE).ok()? as f64;
        let (major, minor) = self.ctx.compute_capability().ok()?;
        // FP32 lanes per SM: 64 on sm_60/70/75/80, 128 on sm_86/89/90 and later.
        let lanes = match (major, minor) {
            (8, 0) | (7, _) | (6, _) => 64.0,
            _ => 128.0,
        };
        Some(sms * lanes * 2.0 * khz / 1e6)
    }

    /// Device address of a span, after checking that it lies inside its buffer. Panics (a bug
    /// in the caller, as with the CPU backend's views) otherwise.
    fn ptr(&self, s: Span) -> u64 {
        let b = &self.bufs[s.buf.0 as usize];
        assert!(
            s.offset.checked_add(s.len).is_some_and(|end| end <= b.len),
            "span {s:?} outside its buffer of {} floats",
            b.len
        );
        b.ptr + 4 * s.offset as u64
    }

    /// Device address of a span of the token buffer.
    fn tok_ptr(&self, t: TokSpan) -> u64 {
        assert!(
            t.offset + t.len <= self.host_tokens.len(),
            "token span outside the {} tokens set",
            self.host_tokens.len()
        );
        let base = self
            .tokens
            .as_ref()
            .map_or(0, |m| m.device_ptr(&self.stream).0);
        base + 4 * t.offset as u64
    }

    fn fail(&self, what: &str, e: impl std::fmt::Display) -> ! {
        panic!("CUDA error in {what}: {e}");
    }

    /// Launches `f` on `grid` blocks of `block` threads with `args`.
    fn launch(
        &self,
        what: &str,
        f: &CudaFunction,
        grid: u64,
        block: u32,
        shmem: u32,
        args: &[Arg],
    ) {
        if grid == 0 {
            return;
        }
        let mut b = self.stream.launch_builder(f);
        for a in args {
            match a {
                Arg::Ptr(x) => b.arg(x),
                Arg::I64(x) => b.arg(x),
                Arg::I32(x) => b.arg(x),
                Arg::F32(x) => b.arg(x),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid.min(MAX_BLOCKS) as u32, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shmem,
        };
        // SAFETY: every pointer argument comes from `ptr`/`tok_ptr` (checked to lie in a live
        // buffer for the extent the kernel touches, which `kernels.cu` derives from the same
        // sizes passed alongside), and the argument list matches the kernel's parameters in
        // order and type (u64 for pointers, i64 for `long long`, i32 for `int`, f32 for
        // `float`).
        if let Err(e) = unsafe { b.launch(cfg) } {
            self.fail(what, e);
        }
    }

    /// An elementwise (grid-stride) launch over `n` items.
    fn launch_elems(&self, what: &str, f: &CudaFunction, n: usize, args: &[Arg]) {
        self.launch(
            what,
            f,
            (n as u64).div_ceil(ELEM_THREADS as u64),
            ELEM_THREADS,
            0,
            args,
        );
    }

    /// A row launch: one block of [`ROW_THREADS`] per row (grid-stride over `rows`).
    fn launch_rows(&self, what: &str, f: &CudaFunction, rows: usize, shmem: u32, args: &[Arg]) {
        self.launch(what, f, rows as u64, ROW_THREADS, shmem, args);
    }

    /// Row-major GEMM, batched with strides: `C_i = alpha·op(A_i)·op(B_i) + beta·C_i`, where
    /// `C_i` is m×n (leading dimension `ldc`), `op(A_i)` m×k and `op(B_i)` k×n; `ta`/`tb` say
    /// that A/B are stored transposed (A as k×m, B as n×k, row-major). cuBLAS is column-major,
    /// so this computes `C_iᵀ = op(B_i)ᵀ·op(A_i)ᵀ`.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        what: &str,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        (a, lda, sa): (u64, usize, usize),
        (b, ldb, sb): (u64, usize, usize),
        beta: f32,
        (c, ldc, sc): (u64, usize, usize),
        batch: usize,
    ) {
        if m == 0 || n == 0 || batch == 0 {
            return;
        }
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let i = |x: usize| x as i32;
        // SAFETY: the pointers come from `ptr` on spans whose lengths the callers check cover
        // the m·n·k extents with these leading dimensions and strides; alpha and beta are host
        // scalars (cuBLAS's default pointer mode).
        let r = unsafe {
            blas_result::sgemm_strided_batched(
                *self.blas.handle(),
                op(tb),
                op(ta),
                i(n),
                i(m),
                i(k),
                &alpha,
                b as *const f32,
                i(ldb),
                sb as i64,
                a as *const f32,
                i(lda),
                sa as i64,
                &beta,
                c as *mut f32,
                i(ldc),
                sc as i64,
                i(batch),
            )
        };
        if let Err(e) = r {
            self.fail(what, e);
        }
    }

    /// Adds the column sums of `rows`×`cols` `dout` into `dst` (and, for layernorm, the column
    /// sums of `dout·x̂` into `dst2`), in two fixed-shape stages.
    #[allow(clippy::too_many_arguments)]
    fn column_sums(
        &mut self,
        dst: Span,
        dst2: Option<(Span, Span, Span, Span)>,
        dout: Span,
        rows: usize,
        cols: usize,
    ) {
        let chunks = rows.div_ceil(COLUMN_CHUNK_ROWS).max(1);
        let need = 2 * chunks * cols;
        let part = self.scratch_f32(need);
        let part2 = part + 4 * (chunks * cols) as u64;
        let (inp, mean, rstd, with) = match dst2 {
            Some((_, inp, mean, rstd)) => (self.ptr(inp), self.ptr(mean), self.ptr(rstd), 1),
            None => (0, 0, 0, 0),
        };
        self.launch_elems(
            "column sums",
            &self.k.column_partials,
            chunks * cols,
            &[
                Arg::Ptr(part),
                Arg::Ptr(part2),
                Arg::Ptr(self.ptr(dout)),
                Arg::Ptr(inp),
                Arg::Ptr(mean),
                Arg::Ptr(rstd),
                Arg::I32(with),
                Arg::I64(rows as i64),
                Arg::I64(cols as i64),
                Arg::I64(COLUMN_CHUNK_ROWS as i64),
                Arg::I64(chunks as i64),
            ],
        );
        let finish = |dst: u64, part: u64| {
            self.launch_elems(
                "column sums",
                &self.k.column_finish,
                cols,
                &[
                    Arg::Ptr(dst),
                    Arg::Ptr(part),
                    Arg::I64(cols as i64),
                    Arg::I64(chunks as i64),
                ],
            )
        };
        finish(self.ptr(dst), part);
        if let Some((dw, ..)) = dst2 {
            finish(self.ptr(dw), part2);
        }
    }

    /// Device address of at least `n` floats of scratch.
    fn scratch_f32(&mut self, n: usize) -> u64 {
        if self.partials.as_ref().is_none_or(|p| p.len() < n) {
            self.partials = None;
            let m = self.stream.alloc_zeros::<f32>(n.max(1));
            self.partials = Some(m.unwrap_or_else(|e| self.fail("scratch allocation", e)));
        }
        let p = self.partials.as_ref().expect("allocated above");
        p.device_ptr(&self.stream).0
    }

    /// Uploads `data` into the index scratch; returns its device address.
    fn upload_indices(&mut self, data: &[i32]) -> u64 {
        if self.indices.as_ref().is_none_or(|p| p.len() < data.len()) {
            self.indices = None;
            let m = self.stream.alloc_zeros::<i32>(data.len().max(1));
            self.indices = Some(m.unwrap_or_else(|e| self.fail("index allocation", e)));
        }
        let p = self
            .indices
            .as_ref()
            .expect("allocated above")
            .device_ptr(&self.stream)
            .0;
        // SAFETY: the scratch holds at least `data.len()` ints (grown just above); a
        // synchronous copy on the legacy stream is ordered after every kernel that read the
        // previous contents.
        if let Err(e) = unsafe { drv::memcpy_htod_sync(p, data) } {
            self.fail("upload", e);
        }
        p
    }
}

/// True when NVRTC (`libnvrtc.so.13`) can be loaded; it needs no GPU.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// `kernels.cu` compiled to PTX text for compute capability `major.minor` (what
/// [`CudaBackend::new`] does, exposed so that the kernels can be checked on a machine with
/// NVRTC but no GPU). Call only when [`nvrtc_available`].
pub fn kernels_ptx(major: i32, minor: i32) -> Result<String> {
    Ok(compile_kernels(major, minor)?.to_src())
}

/// Compiles `kernels.cu` to PTX for compute capability `major.minor`.
fn compile_kernels(major: i32, minor: i32) -> Result<cudarc::nvrtc::Ptx> {
    let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture=compute_{major}{minor}"));
    let opts = cudarc::nvrtc::CompileOptions {
        options,
        name: Some("kernels.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(KERNELS_SOURCE, opts)
        .map_err(|e| anyhow::anyhow!("NVRTC could not compile src/backend/cuda/kernels.cu: {e:?}"))
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Free device memory only after queued work that may use it.
        let _ = self.stream.synchronize();
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn alloc(&mut self, len: usize) -> Result<BufId> {
        let (mem, ptr) = if len == 0 {
            (None, 0)
        } else {
            let m = self.stream.alloc_zeros::<f32>(len).map_err(|e| {
                let free = self.ctx.mem_get_info().map(|(f, _)| f).unwrap_or(0);
                anyhow::anyhow!(
                    "out of GPU memory allocating {:.1} MiB on {} ({:.1} MiB free): {e}",
                    len as f64 * 4.0 / (1 << 20) as f64,
                    self.name,
                    free as f64 / (1 << 20) as f64
                )
            })?;
            let p = m.device_ptr(&self.stream).0;
            (Some(m), p)
        };
        self.bufs.push(DeviceBuf {
            _mem: mem,
            ptr,
            len,
        });
        Ok(BufId(self.bufs.len() as u32 - 1))
    }

    fn free(&mut self, buf: BufId) {
        let _ = self.stream.synchronize();
        self.bufs[buf.0 as usize] = DeviceBuf {
            _mem: None,
            ptr: 0,
            len: 0,
        };
    }

    fn buf_len(&self, buf: BufId) -> usize {
        self.bufs[buf.0 as usize].len
    }

    fn upload(&mut self, dst: Span, src: &[f32]) {
        assert_eq!(dst.len, src.len(), "upload: length");
        if src.is_empty() {
            return;
        }
        let p = self.ptr(dst);
        // SAFETY: `p` covers `src.len()` floats (checked by `ptr`); the copy is synchronous.
        if let Err(e) = unsafe { drv::memcpy_htod_sync(p, src) } {
            self.fail("upload", e);
        }
    }

    fn download(&self, src: Span, dst: &mut [f32]) {
        assert_eq!(src.len, dst.len(), "download: length");
        if dst.is_empty() {
            return;
        }
        let p = self.ptr(src);
        // SAFETY: `p` covers `dst.len()` floats (checked by `ptr`); the copy is synchronous
        // and ordered after all queued work on the legacy stream.
        if let Err(e) = unsafe { drv::memcpy_dtoh_sync(dst, p) } {
            self.fail("download", e);
        }
    }

    fn zero(&mut self, s: Span) {
        if s.len == 0 {
            return;
        }
        let p = self.ptr(s);
        // SAFETY: `p` covers `s.len` floats (checked by `ptr`); all-zero bytes are 0.0f.
        if let Err(e) = unsafe { drv::memset_d8_async(p, 0, 4 * s.len, self.stream.cu_stream()) } {
            self.fail("zero", e);
        }
    }

    fn copy(&mut self, dst: Span, src: Span) {
        assert_eq!(dst.len, src.len, "copy: span lengths differ");
        assert!(!dst.overlaps(src), "copy: spans overlap");
        if dst.len == 0 {
            return;
        }
        let (d, s) = (self.ptr(dst), self.ptr(src));
        // SAFETY: both ranges lie in their buffers (checked by `ptr`) and do not overlap.
        if let Err(e) =
            unsafe { drv::memcpy_dtod_async(d, s, 4 * dst.len, self.stream.cu_stream()) }
        {
            self.fail("copy", e);
        }
    }

    fn set_tokens(&mut self, tokens: &[u32]) {
        self.host_tokens.clear();
        self.host_tokens.extend_from_slice(tokens);
        if tokens.is_empty() {
            return;
        }
        if self.tokens.as_ref().is_none_or(|t| t.len() < tokens.len()) {
            self.tokens = None;
            let m = self.stream.alloc_zeros::<u32>(tokens.len());
            self.tokens = Some(m.unwrap_or_else(|e| self.fail("token allocation", e)));
        }
        let p = self
            .tokens
            .as_ref()
            .expect("allocated above")
            .device_ptr(&self.stream)
            .0;
        // SAFETY: the token buffer holds at least `tokens.len()` ids; synchronous copy.
        if let Err(e) = unsafe { drv::memcpy_htod_sync(p, tokens) } {
            self.fail("token upload", e);
        }
    }

    fn describe(&self) -> String {
        self.name.clone()
    }

    fn peak_gflops(&self) -> Option<(f64, String)> {
        let p = self.fp32_peak_gflops()?;
        Some((
            p,
            format!(
                "FP32 CUDA-core peak of {} (SMs x lanes x 2 x clock)",
                self.name
            ),
        ))
    }

    fn sync(&self) {
        if let Err(e) = self.stream.synchronize() {
            self.fail("synchronize", e);
        }
    }

    fn sync_handle(&self) -> Option<Box<dyn Fn()>> {
        let s = self.stream.clone();
        Some(Box::new(move || {
            if let Err(e) = s.synchronize() {
                panic!("CUDA error in synchronize: {e}");
            }
        }))
    }

    fn encoder_forward(
        &mut self,
        out: Span,
        tokens: TokSpan,
        wte: Span,
        vocab_start: usize,
        wpe: Option<Span>,
        b: usize,
        t: usize,
        c: usize,
    ) {
        let n = b * t;
        assert!(
            out.len == n * c && tokens.len == n,
            "encoder_forward: shapes"
        );
        if let Some(w) = wpe {
            assert!(w.len >= t * c, "encoder_forward: wpe has fewer than T rows");
        }
        self.launch_elems(
            "encoder_forward",
            &self.k.encoder_forward,
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

    fn encoder_backward(
        &mut self,
        dwte: Span,
        dwpe: Option<Span>,
        dout: Span,
        tokens: TokSpan,
        vocab_start: usize,
        b: usize,
        t: usize,
        c: usize,
    ) {
        let n = b * t;
        assert!(
            dout.len == n * c && tokens.len == n,
            "encoder_backward: shapes"
        );
        // Bucket positions by local row on the host (a stable counting sort, as the CPU op):
        // [rows (U) | start (U + 1) | positions].
        let rows = dwte.len / c;
        let toks = &self.host_tokens[tokens.offset..tokens.offset + tokens.len];
        let local = |tok: u32| {
            (tok as usize)
                .checked_sub(vocab_start)
                .filter(|&r| r < rows)
        };
        let mut order: Vec<(usize, usize)> = toks
            .iter()
            .enumerate()
            .filter_map(|(i, &tok)| local(tok).map(|r| (r, i)))
            .collect();
        order.sort_unstable();
        let mut uniq: Vec<i32> = Vec::new();
        let mut start: Vec<i32> = Vec::new();
        for (k, &(r, _)) in order.iter().enumerate() {
            if uniq.last() != Some(&(r as i32)) {
                uniq.push(r as i32);
                start.push(k as i32);
            }
        }
        start.push(order.len() as i32);
        let u = uniq.len();
        let mut idx = uniq;
        idx.extend_from_slice(&start);
        idx.extend(order.iter().map(|&(_, i)| i as i32));
        if u > 0 {
            let base = self.upload_indices(&idx);
            self.launch(
                "encoder_backward",
                &self.k.encoder_backward_wte,
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
                "encoder_backward",
                &self.k.encoder_backward_wpe,
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

    fn layernorm_forward(
        &mut self,
        out: Span,
        mean: Span,
        rstd: Span,
        inp: Span,
        w: Span,
        bias: Span,
        n: usize,
        c: usize,
    ) {
        assert!(out.len == n * c && inp.len == n * c && mean.len == n && rstd.len == n);
        assert!(
            w.len == c && bias.len == c,
            "layernorm_forward: parameter length"
        );
        self.launch_rows(
            "layernorm_forward",
            &self.k.layernorm_forward,
            n,
            0,
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
        dinp: Span,
        dw: Span,
        dbias: Span,
        dout: Span,
        inp: Span,
        w: Span,
        mean: Span,
        rstd: Span,
        n: usize,
        c: usize,
    ) {
        assert!(dinp.len == n * c && dout.len == n * c && inp.len == n * c);
        assert!(w.len == c && dw.len == c && dbias.len == c && mean.len == n && rstd.len == n);
        self.launch_rows(
            "layernorm_backward",
            &self.k.layernorm_backward_dinp,
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

    fn linear_forward(
        &mut self,
        out: Span,
        inp: Span,
        w: Span,
        layout: WeightLayout,
        bias: Option<Span>,
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        assert!(
            out.len == n * oc && inp.len == n * ic && w.len == ic * oc,
            "linear_forward"
        );
        let beta = match bias {
            Some(bias) => {
                assert_eq!(bias.len, oc, "linear_forward: bias length");
                self.launch_elems(
                    "linear_forward",
                    &self.k.broadcast_rows,
                    n * oc,
                    &[
                        Arg::Ptr(self.ptr(out)),
                        Arg::Ptr(self.ptr(bias)),
                        Arg::I64(n as i64),
                        Arg::I64(oc as i64),
                    ],
                );
                1.0
            }
            None => 0.0,
        };
        // W as the (IC, OC) matrix of y = x·W: stored so (InOut) or transposed (OutIn).
        let (tw, ldw) = match layout {
            WeightLayout::InOut => (false, oc),
            WeightLayout::OutIn => (true, ic),
        };
        self.gemm(
            "linear_forward",
            (false, tw),
            (n, oc, ic),
            1.0,
            (self.ptr(inp), ic, 0),
            (self.ptr(w), ldw, 0),
            beta,
            (self.ptr(out), oc, 0),
            1,
        );
    }

    fn linear_backward(
        &mut self,
        dinp: Option<Span>,
        dw: Span,
        dbias: Option<Span>,
        dout: Span,
        inp: Span,
        w: Span,
        layout: WeightLayout,
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        assert!(
            dout.len == n * oc && inp.len == n * ic && w.len == ic * oc,
            "linear_backward"
        );
        assert_eq!(dw.len, ic * oc, "linear_backward: dw length");
        if let Some(dinp) = dinp {
            assert_eq!(dinp.len, n * ic, "linear_backward: dinp length");
            // dinp = dout·Wᵀ; Wᵀ (OC, IC) is W stored InOut read transposed, or OutIn as is.
            let (tw, ldw) = match layout {
                WeightLayout::InOut => (true, oc),
                WeightLayout::OutIn => (false, ic),
            };
            self.gemm(
                "linear_backward",
                (false, tw),
                (n, ic, oc),
                1.0,
                (self.ptr(dout), oc, 0),
                (self.ptr(w), ldw, 0),
                0.0,
                (self.ptr(dinp), ic, 0),
                1,
            );
        }
        let (i, d) = ((self.ptr(inp), ic, 0), (self.ptr(dout), oc, 0));
        match layout {
            // dW (IC, OC) += inpᵀ·dout
            WeightLayout::InOut => self.gemm(
                "linear_backward",
                (true, false),
                (ic, oc, n),
                1.0,
                i,
                d,
                1.0,
                (self.ptr(dw), oc, 0),
                1,
            ),
            // dW (OC, IC) += doutᵀ·inp
            WeightLayout::OutIn => self.gemm(
                "linear_backward",
                (true, false),
                (oc, ic, n),
                1.0,
                d,
                i,
                1.0,
                (self.ptr(dw), ic, 0),
                1,
            ),
        }
        if let Some(dbias) = dbias {
            assert_eq!(dbias.len, oc, "linear_backward: dbias length");
            self.column_sums(dbias, None, dout, n, oc);
        }
    }

    fn attention_scores(&mut self, att: Span, qkv: Span, d: AttnDims) {
        let a = Attn::new(self, att, qkv, d);
        for bi in 0..d.b {
            // att[b, h] (T, T) = scale · Q_h · K_hᵀ, one batch of nh heads per sequence.
            self.gemm(
                "attention_scores",
                (false, true),
                (d.t, d.t, d.hs),
                a.scale,
                a.qkv_part(bi, 0),
                a.qkv_part(bi, 1),
                0.0,
                a.att(bi),
                d.nh,
            );
        }
    }

    fn attention_softmax(&mut self, att: Span, d: AttnDims) {
        let rows = d.b * d.nh * d.t;
        assert_eq!(att.len, rows * d.t, "attention_softmax: att length");
        self.launch_rows(
            "attention_softmax",
            &self.k.attention_softmax,
            rows,
            0,
            &[
                Arg::Ptr(self.ptr(att)),
                Arg::I64(rows as i64),
                Arg::I64(d.t as i64),
            ],
        );
    }

    fn attention_values(&mut self, out: Span, att: Span, qkv: Span, d: AttnDims) {
        let a = Attn::new(self, att, qkv, d);
        let o = a.btc(self, out);
        for bi in 0..d.b {
            // out[b, :, h] = att[b, h] · V_h
            self.gemm(
                "attention_values",
                (false, false),
                (d.t, d.hs, d.t),
                1.0,
                a.att(bi),
                a.qkv_part(bi, 2),
                0.0,
                o(bi),
                d.nh,
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
        for bi in 0..d.b {
            // datt[b, h] = dout_h · V_hᵀ
            self.gemm(
                "attention_values_backward",
                (false, true),
                (d.t, d.t, d.hs),
                1.0,
                g(bi),
                a.qkv_part(bi, 2),
                0.0,
                da.att(bi),
                d.nh,
            );
            // dV_h = att[b, h]ᵀ · dout_h
            self.gemm(
                "attention_values_backward",
                (true, false),
                (d.t, d.hs, d.t),
                1.0,
                a.att(bi),
                g(bi),
                0.0,
                da.qkv_part(bi, 2),
                d.nh,
            );
        }
    }

    fn attention_softmax_backward(&mut self, datt: Span, att: Span, d: AttnDims) {
        let rows = d.b * d.nh * d.t;
        assert!(
            att.len == rows * d.t && datt.len == rows * d.t,
            "attention_softmax_backward"
        );
        self.launch_rows(
            "attention_softmax_backward",
            &self.k.attention_softmax_backward,
            rows,
            0,
            &[
                Arg::Ptr(self.ptr(datt)),
                Arg::Ptr(self.ptr(att)),
                Arg::I64(rows as i64),
                Arg::I64(d.t as i64),
            ],
        );
    }

    fn attention_scores_backward(&mut self, dqkv: Span, datt: Span, qkv: Span, d: AttnDims) {
        let a = Attn::new(self, datt, qkv, d);
        let da = Attn::new(self, datt, dqkv, d);
        for bi in 0..d.b {
            // dQ_h = scale · datt · K_h
            self.gemm(
                "attention_scores_backward",
                (false, false),
                (d.t, d.hs, d.t),
                a.scale,
                a.att(bi),
                a.qkv_part(bi, 1),
                0.0,
                da.qkv_part(bi, 0),
                d.nh,
            );
            // dK_h = scale · dattᵀ · Q_h
            self.gemm(
                "attention_scores_backward",
                (true, false),
                (d.t, d.hs, d.t),
                a.scale,
                a.att(bi),
                a.qkv_part(bi, 0),
                0.0,
                da.qkv_part(bi, 1),
                d.nh,
            );
        }
    }

    fn attention_decode(
        &mut self,
        out: Span,
        q: Span,
        k_cache: Span,
        v_cache: Span,
        len: usize,
        nh: usize,
        hs: usize,
    ) {
        let c = nh * hs;
        assert!(
            out.len == c && q.len == c && len >= 1,
            "attention_decode: shapes"
        );
        assert!(
            k_cache.len >= len * c && v_cache.len >= len * c,
            "attention_decode: cache"
        );
        self.launch(
            "attention_decode",
            &self.k.attention_decode,
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
                Arg::I64(hs as i64),
                Arg::F32(attention_scale(hs)),
            ],
        );
    }

    fn gelu_forward(&mut self, out: Span, inp: Span) {
        assert_eq!(out.len, inp.len, "gelu_forward: lengths differ");
        let args = [
            Arg::Ptr(self.ptr(out)),
            Arg::Ptr(self.ptr(inp)),
            Arg::I64(out.len as i64),
        ];
        self.launch_elems("gelu_forward", &self.k.gelu_forward, out.len, &args);
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
        self.launch_elems("gelu_backward", &self.k.gelu_backward, inp.len, &args);
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
        self.launch_elems("residual_forward", &self.k.residual_forward, out.len, &args);
    }

    fn add_inplace(&mut self, acc: Span, x: Span) {
        assert_eq!(acc.len, x.len, "add_inplace: lengths");
        let args = [
            Arg::Ptr(self.ptr(acc)),
            Arg::Ptr(self.ptr(x)),
            Arg::I64(acc.len as i64),
        ];
        self.launch_elems("add_inplace", &self.k.add_inplace, acc.len, &args);
    }

    fn ce_row_max(&mut self, maxes: Span, logits: Span, d: CeDims) {
        check_ce(logits, d);
        assert_eq!(maxes.len, d.n, "ce_row_max: maxes length");
        let args = [
            Arg::Ptr(self.ptr(maxes)),
            Arg::Ptr(self.ptr(logits)),
            Arg::I64(d.n as i64),
            Arg::I64(d.vp as i64),
            Arg::I64(d.v_valid as i64),
        ];
        self.launch_rows("ce_row_max", &self.k.ce_row_max, d.n, 0, &args);
    }

    fn ce_row_sumexp(&mut self, sums: Span, logits: Span, maxes: Span, d: CeDims) {
        check_ce(logits, d);
        assert!(
            sums.len == d.n && maxes.len == d.n,
            "ce_row_sumexp: lengths"
        );
        let args = [
            Arg::Ptr(self.ptr(sums)),
            Arg::Ptr(self.ptr(logits)),
            Arg::Ptr(self.ptr(maxes)),
            Arg::I64(d.n as i64),
            Arg::I64(d.vp as i64),
            Arg::I64(d.v_valid as i64),
        ];
        self.launch_rows("ce_row_sumexp", &self.k.ce_row_sumexp, d.n, 0, &args);
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
        self.launch_elems("ce_target_logit", &self.k.ce_target_logit, d.n, &args);
    }

    fn ce_finish(
        &mut self,
        losses: Span,
        logits: Span,
        maxes: Span,
        sums: Span,
        tl: Span,
        targets: TokSpan,
        dloss: Option<f32>,
        d: CeDims,
    ) {
        check_ce(logits, d);
        assert!(losses.len == d.n && maxes.len == d.n && sums.len == d.n && tl.len == d.n);
        assert_eq!(targets.len, d.n, "ce_finish: targets length");
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
        self.launch_rows("ce_finish", &self.k.ce_finish, d.n, 0, &args);
    }

    fn sum_of_squares(&mut self, x: Span) -> f64 {
        if x.len == 0 {
            return 0.0;
        }
        let sos = self.sos.device_ptr(&self.stream).0;
        let args = [Arg::Ptr(sos), Arg::Ptr(self.ptr(x)), Arg::I64(x.len as i64)];
        self.launch(
            "sum_of_squares",
            &self.k.sum_of_squares,
            SOS_BLOCKS as u64,
            ROW_THREADS,
            0,
            &args,
        );
        let mut parts = [0.0f64; SOS_BLOCKS];
        // SAFETY: `sos` holds SOS_BLOCKS doubles; the synchronous copy waits for the kernel.
        if let Err(e) = unsafe { drv::memcpy_dtoh_sync(&mut parts[..], sos) } {
            self.fail("sum_of_squares", e);
        }
        parts.iter().sum()
    }

    fn adamw(&mut self, params: Span, grads: Span, m: Span, v: Span, hp: &AdamWStep) {
        assert!(grads.len == params.len && m.len == params.len && v.len == params.len);
        let k = crate::ops::adamw::step_scalars(hp);
        let args = [
            Arg::Ptr(self.ptr(params)),
            Arg::Ptr(self.ptr(grads)),
            Arg::Ptr(self.ptr(m)),
            Arg::Ptr(self.ptr(v)),
            Arg::I64(params.len as i64),
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
        self.launch_elems("adamw", &self.k.adamw, params.len, &args);
    }
}

/// `1/√hs` rounded as the CPU op rounds it.
fn attention_scale(hs: usize) -> f32 {
    (1.0 / (hs as f64).sqrt()) as f32
}

fn check_ce(logits: Span, d: CeDims) {
    assert!(
        d.vp > 0 && d.v_valid <= d.vp,
        "cross-entropy: bad vocabulary sizes {d:?}"
    );
    assert_eq!(logits.len, d.n * d.vp, "cross-entropy: logits length");
}

/// Strided views of one attention call's tensors for the batched GEMMs: `(ptr, ld, stride)`
/// triples, one batch of `nh` heads per sequence (the layouts of `ops/attention.rs`).
struct Attn {
    att: u64,
    qkv: u64,
    d: AttnDims,
    scale: f32,
}

impl Attn {
    fn new(be: &CudaBackend, att: Span, qkv: Span, d: AttnDims) -> Attn {
        let c = d.nh * d.hs;
        assert_eq!(att.len, d.b * d.nh * d.t * d.t, "attention: att length");
        assert_eq!(qkv.len, d.b * d.t * 3 * c, "attention: qkv length");
        Attn {
            att: be.ptr(att),
            qkv: be.ptr(qkv),
            d,
            scale: attention_scale(d.hs),
        }
    }

    /// Part `part` (0 Q, 1 K, 2 V) of sequence `bi`: nh (T, hs) matrices, leading dimension
    /// 3C, head stride hs.
    fn qkv_part(&self, bi: usize, part: usize) -> (u64, usize, usize) {
        let c = self.d.nh * self.d.hs;
        let off = bi * self.d.t * 3 * c + part * c;
        (self.qkv + 4 * off as u64, 3 * c, self.d.hs)
    }

    /// `att[bi]`: nh (T, T) matrices.
    fn att(&self, bi: usize) -> (u64, usize, usize) {
        let tt = self.d.t * self.d.t;
        (self.att + 4 * (bi * self.d.nh * tt) as u64, self.d.t, tt)
    }

    /// A (B, T, C) tensor as per-sequence batches of nh (T, hs) head matrices.
    fn btc(&self, be: &CudaBackend, s: Span) -> impl Fn(usize) -> (u64, usize, usize) {
        let (t, c, hs) = (self.d.t, self.d.nh * self.d.hs, self.d.hs);
        assert_eq!(s.len, self.d.b * t * c, "attention: (B, T, C) length");
        let p = be.ptr(s);
        move |bi| (p + 4 * (bi * t * c) as u64, c, hs)
    }
}

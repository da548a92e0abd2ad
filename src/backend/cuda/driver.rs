//! The real device: cudarc over the CUDA driver, cuBLAS and NVRTC, all loaded at run time.

use super::engine::{Arg, DevAlloc, Engine, Epilogue, GemmCall, MarkSlots, NoEpilogue};
use super::lt::Lt;
use super::{kernel_cache, kernel_names};
use crate::backend::knobs::GemmSelect;
use crate::backend::CudaSettings;
use crate::dtype::Dtype;
use crate::metrics::timers::{DeviceClock, DeviceMark};
use anyhow::{bail, Context, Result};
use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    result as drv, sys as drv_sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream,
    DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use std::sync::Arc;

/// One GPU: its context, the legacy default stream (so synchronous copies are ordered with
/// every kernel), the compiled kernels and a cuBLAS handle on that stream.
pub struct DriverEngine {
    /// cuBLAS may use TF32 tensor cores for f32 GEMMs (`--tf32`).
    tf32: bool,
    /// Compute capability (major, minor).
    major: i32,
    minor: i32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// For the GEMMs with a bias epilogue.
    lt: Lt,
    kernels: Vec<CudaFunction>,
    /// The dynamic shared memory each kernel may use, as set on it so far (bytes; above the
    /// default 48 KB of a block, less its static memory, a kernel has to opt in).
    dynamic_shmem: std::sync::Mutex<Vec<u32>>,
    _module: Arc<CudaModule>,
    name: String,
    /// [`Engine::kernels_identity`]: the GPU, its compute capability and the kernels' build.
    kernels_identity: String,
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

/// Whether this machine has a CUDA driver that sees a GPU (a dlopen and a device count; no
/// context is made). The tests tell "no GPU here" (skipped) from "a GPU the backend failed to
/// start on" (a failure: a kernel source this GPU's NVRTC refuses, say) by it.
pub fn gpu_present() -> bool {
    // SAFETY: a dlopen only (no CUDA call is made).
    if !unsafe { drv_sys::is_culib_present() } {
        return false;
    }
    CudaContext::device_count().is_ok_and(|n| n > 0)
}

impl DriverEngine {
    /// Opens device `ordinal`: checks the libraries, compiles the kernels for its compute
    /// capability, creates the cuBLAS handle with the math mode `settings` ask for.
    pub fn new(ordinal: Option<usize>, settings: CudaSettings) -> Result<DriverEngine> {
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
        // SAFETY: as above, a dlopen only.
        require_lib(
            unsafe { cudarc::cublaslt::sys::is_culib_present() },
            "cuBLASLt (libcublasLt.so.13)",
        )?;
        require_lib(nvrtc, "NVRTC (libnvrtc.so.13)")?;
        let count = CudaContext::device_count().context("counting CUDA devices")? as usize;
        if count == 0 {
            bail!("no CUDA device found (the driver is installed but sees no GPU)");
        }
        let ordinal = ordinal.unwrap_or_else(|| crate::backend::device::local_gpu(count));
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
        let dir = kernel_cache::cache_dir();
        let (cubin, _) = kernel_cache::kernels(dir.as_deref(), major, minor)?;
        let module = match ctx.load_module(Ptx::from_binary(cubin)) {
            Ok(m) => m,
            Err(e) => {
                // Not expected (NVRTC assembled the cubin for this GPU's architecture); PTX
                // is what the backend loaded before, compiled by the driver.
                eprintln!(
                    "note: the GPU did not load the kernels' machine code for sm_{major}{minor} \
                     ({e}); loading their PTX instead"
                );
                let ptx = super::kernels_ptx(major, minor)?;
                ctx.load_module(Ptx::from_src(ptx))
                    .context("loading the compiled kernels")?
            }
        };
        let kernels = kernel_names()
            .iter()
            .map(|n| {
                module
                    .load_function(n)
                    .with_context(|| format!("kernels.cu has no kernel {n}"))
            })
            .collect::<Result<Vec<_>>>()?;
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
        let lt = Lt::new(stream.clone(), &name, (major, minor), settings.tf32)?;
        let kernels_identity = format!(
            "gpu={name:?} sm={major}{minor} kernels={}",
            &kernel_cache::build_key(major, minor)?[..16]
        );
        let tf32 = if settings.tf32 { ", TF32" } else { "" };
        Ok(DriverEngine {
            tf32: settings.tf32,
            major,
            minor,
            ctx,
            stream,
            blas,
            lt,
            dynamic_shmem: std::sync::Mutex::new(vec![0; kernels.len()]),
            kernels,
            _module: module,
            name: format!("{name} (sm_{major}{minor}{tf32})"),
            kernels_identity,
        })
    }

    fn cu_stream(&self) -> drv_sys::CUstream {
        self.stream.cu_stream()
    }
}

impl Engine for DriverEngine {
    fn describe(&self) -> String {
        self.name.clone()
    }

    fn kernels_identity(&self) -> String {
        self.kernels_identity.clone()
    }

    /// Memory clock × bus width × 2 (double data rate), as the driver reports them (3.35 TB/s
    /// on an H100 SXM, 4.8 on an H200).
    fn peak_gbs(&self) -> Option<(f64, String)> {
        use drv_sys::CUdevice_attribute::{
            CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
        };
        let khz = self
            .ctx
            .attribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)
            .ok()? as f64;
        let bits = self
            .ctx
            .attribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)
            .ok()? as f64;
        let gbs = 2.0 * khz * 1e3 * bits / 8.0 / 1e9;
        (gbs > 0.0).then(|| {
            let what = format!(
                "memory peak of {}: {:.0} MHz x {bits:.0} bits x 2",
                self.name,
                khz / 1e3
            );
            (gbs, what)
        })
    }

    /// The peak of the units the GEMMs run on, at the SM clock the device reports (its
    /// maximum; NVIDIA's datasheet figures use the lower boost clock, e.g. 1830 MHz for the
    /// H100 SXM's 989 TFLOP/s dense bf16, so this peak is the stricter one):
    /// * f32 without TF32: CUDA cores, SMs × FP32 lanes per SM × 2 (FMA) × clock;
    /// * bf16/f16: dense tensor cores, SMs × 16-bit tensor FLOP per SM per clock × clock
    ///   (2048 on sm_80, 4096 on sm_90, 8192 on sm_100: A100, H100, B200);
    /// * f32 with `--tf32`: half the 16-bit tensor rate.
    ///
    /// Where the tensor rate of an architecture is not in that table, the CUDA-core peak is
    /// returned and its description says MFU may exceed 100%.
    fn peak_gflops(&self, compute: Dtype) -> Option<(f64, String)> {
        use drv_sys::CUdevice_attribute::{
            CU_DEVICE_ATTRIBUTE_CLOCK_RATE, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        };
        let sms = self
            .ctx
            .attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .ok()? as f64;
        let khz = self.ctx.attribute(CU_DEVICE_ATTRIBUTE_CLOCK_RATE).ok()? as f64;
        let (major, minor) = self.ctx.compute_capability().ok()?;
        // FP32 lanes per SM: 64 on sm_75 and sm_80, 128 on sm_86/89/90 and later.
        let lanes = match (major, minor) {
            (8, 0) | (7, _) => 64.0,
            _ => 128.0,
        };
        let cuda_cores = sms * lanes * 2.0 * khz / 1e6;
        let tensor16 = match major {
            8 if minor == 0 => Some(2048.0),
            9 => Some(4096.0),
            10 => Some(8192.0),
            _ => None,
        };
        let uses_tensor_cores = compute != Dtype::F32 || self.tf32;
        match (uses_tensor_cores, tensor16) {
            (false, _) => Some((
                cuda_cores,
                format!(
                    "FP32 CUDA-core peak of {}: SMs x lanes x 2 x clock",
                    self.name
                ),
            )),
            (true, Some(per_sm)) => {
                let (rate, what) = if compute == Dtype::F32 {
                    (per_sm / 2.0, "TF32")
                } else {
                    (per_sm, "16-bit")
                };
                Some((
                    sms * rate * khz / 1e6,
                    format!(
                        "dense {what} tensor-core peak of {}: {sms} SMs x {rate} FLOP/clock x {:.0} MHz",
                        self.name,
                        khz / 1e3
                    ),
                ))
            }
            (true, None) => Some((
                cuda_cores,
                format!(
                    "FP32 CUDA-core peak of {} (its tensor-core rate is not known to fugu: MFU may exceed 100%)",
                    self.name
                ),
            )),
        }
    }

    fn max_blocks(&self) -> u32 {
        65_535
    }

    fn mma_16bit(&self) -> bool {
        self.major >= 8
    }

    fn wgmma(&self) -> bool {
        (self.major, self.minor) == (9, 0)
    }

    fn max_dynamic_shared(&self) -> u32 {
        use drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
        // An attribute every driver of an sm_70+ GPU reports; 0 (nothing large runs) if not.
        self.ctx
            .attribute(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_or(0, |b| b.max(0) as u32)
    }

    fn free_bytes(&self) -> Option<usize> {
        self.ctx.mem_get_info().ok().map(|(free, _)| free)
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevAlloc> {
        let m = self.stream.alloc_zeros::<u8>(bytes.max(1))?;
        let ptr = m.device_ptr(&self.stream).0;
        Ok(DevAlloc {
            ptr,
            bytes,
            _owner: Box::new(m),
        })
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: the caller passes a `dst` with room for `src.len()` bytes; the copy is
        // synchronous and, on the legacy stream, ordered after queued kernels.
        unsafe { drv::memcpy_htod_sync(dst, src) }?;
        Ok(())
    }

    fn download(&self, dst: &mut [u8], src: u64) -> Result<()> {
        // SAFETY: the caller passes a `src` holding `dst.len()` bytes; synchronous copy,
        // ordered after every queued kernel on the legacy stream.
        unsafe { drv::memcpy_dtoh_sync(dst, src) }?;
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller passes non-overlapping ranges of `bytes` inside live allocations.
        unsafe { drv::memcpy_dtod_async(dst, src, bytes, self.cu_stream()) }?;
        Ok(())
    }

    fn zero(&self, dst: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller passes a range of `bytes` inside a live allocation.
        unsafe { drv::memset_d8_async(dst, 0, bytes, self.cu_stream()) }?;
        Ok(())
    }

    fn launch(&self, kernel: usize, grid: u32, block: u32, shmem: u32, args: &[Arg]) -> Result<()> {
        let f = &self.kernels[kernel];
        {
            let mut set = self.dynamic_shmem.lock().unwrap_or_else(|e| e.into_inner());
            if shmem > set[kernel] {
                f.set_attribute(
                    drv_sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shmem as i32,
                )
                .with_context(|| {
                    format!("allowing kernel {kernel} {shmem} bytes of dynamic shared memory")
                })?;
                set[kernel] = shmem;
            }
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
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shmem,
        };
        // SAFETY: the backend builds `args` to match the kernel's parameter list in order and
        // type, and its pointers cover what the kernel touches (see `CudaBackend::ptr`).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn gemm(&self, g: &GemmCall) -> Result<()> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let i = |x: usize| x as i32;
        if g.epilogue != Epilogue::None {
            return self.lt.gemm(g);
        }
        // With algorithms timed per shape, cuBLASLt does every one-matrix call too (cuBLAS's
        // own calls take no algorithm choice); what it has no algorithm for goes to cuBLAS.
        if self.lt.select() == GemmSelect::Timed && g.batch == 1 {
            match self.lt.gemm(g) {
                Err(e) if e.is::<NoEpilogue>() => {}
                done => return done,
            }
        }
        if [g.a_type, g.b_type, g.c_type] != [Dtype::F32; 3] {
            return self.gemm_ex(g);
        }
        // SAFETY: the backend passes pointers whose buffers cover the m·n·k extents with these
        // leading dimensions and strides; alpha and beta are host scalars (the default
        // pointer mode).
        unsafe {
            blas_result::sgemm_strided_batched(
                *self.blas.handle(),
                op(g.trans_a),
                op(g.trans_b),
                i(g.m),
                i(g.n),
                i(g.k),
                &g.alpha,
                g.a as *const f32,
                i(g.lda),
                g.stride_a as i64,
                g.b as *const f32,
                i(g.ldb),
                g.stride_b as i64,
                &g.beta,
                g.c as *mut f32,
                i(g.ldc),
                g.stride_c as i64,
                i(g.batch),
            )
        }?;
        Ok(())
    }

    fn gemm_ptr_arrays(&self, g: &GemmCall, arrays: [u64; 3]) -> Result<()> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let ty = Self::blas_type;
        let i = |x: usize| x as i32;
        // SAFETY: `arrays` hold `g.batch` device pointers each, in device memory that lives
        // until the queued call has run (the backend keeps them cached); every pointed-to
        // matrix covers the m·n·k extents with these leading dimensions and types; alpha and
        // beta are f32 host scalars, as CUBLAS_COMPUTE_32F requires.
        unsafe {
            blas_sys::cublasGemmBatchedEx(
                *self.blas.handle(),
                op(g.trans_a),
                op(g.trans_b),
                i(g.m),
                i(g.n),
                i(g.k),
                (&g.alpha as *const f32).cast(),
                arrays[0] as *const *const std::ffi::c_void,
                ty(g.a_type),
                i(g.lda),
                arrays[1] as *const *const std::ffi::c_void,
                ty(g.b_type),
                i(g.ldb),
                (&g.beta as *const f32).cast(),
                arrays[2] as *const *mut std::ffi::c_void,
                ty(g.c_type),
                i(g.ldc),
                i(g.batch),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()?;
        Ok(())
    }

    fn set_gemm_select(&mut self, select: GemmSelect) {
        self.lt.set_select(select);
    }

    fn gemm_select(&self) -> GemmSelect {
        self.lt.select()
    }

    fn sync(&self) -> Result<()> {
        self.stream.synchronize()?;
        Ok(())
    }

    fn clock(&self) -> Box<dyn DeviceClock> {
        Box::new(EventClock {
            ctx: self.ctx.clone(),
            stream: self.stream.clone(),
            events: Default::default(),
        })
    }
}

/// CUDA events recorded on the stream (created with timing, reused once read).
struct EventClock {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    events: std::cell::RefCell<MarkSlots<CudaEvent>>,
}

impl DeviceClock for EventClock {
    fn mark(&self) -> DeviceMark {
        let mut events = self.events.borrow_mut();
        let timed = Some(drv_sys::CUevent_flags::CU_EVENT_DEFAULT);
        let marked = events
            .acquire(|| Ok(self.ctx.new_event(timed)?))
            .and_then(|(i, e)| Ok((i, e.record(&self.stream)?)));
        match marked {
            Ok((i, ())) => DeviceMark(i),
            Err(e) => panic!("CUDA error in recording a timer event: {e:#}"),
        }
    }

    fn take_interval(&self, start: DeviceMark, end: DeviceMark) -> f64 {
        let mut events = self.events.borrow_mut();
        let ms = events
            .get(start.0)
            .elapsed_ms(events.get(end.0))
            .unwrap_or_else(|e| panic!("CUDA error in reading timer events: {e}"));
        events.release(start.0);
        events.release(end.0);
        ms as f64
    }
}

impl DriverEngine {
    /// The cuBLAS type of a [`Dtype`].
    fn blas_type(d: Dtype) -> blas_sys::cudaDataType_t {
        use blas_sys::cudaDataType_t::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
        match d {
            Dtype::F32 => CUDA_R_32F,
            Dtype::Bf16 => CUDA_R_16BF,
            Dtype::F16 => CUDA_R_16F,
        }
    }

    /// A GEMM with a 16-bit operand or result: `cublasGemmStridedBatchedEx` with f32
    /// accumulation (`CUBLAS_COMPUTE_32F`), on the tensor cores for bf16/f16 operands.
    fn gemm_ex(&self, g: &GemmCall) -> Result<()> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        let ty = Self::blas_type;
        let i = |x: usize| x as i32;
        // SAFETY: as for the SGEMM: the backend passes pointers whose buffers, of the types
        // named, cover the m·n·k extents with these leading dimensions and strides; alpha and
        // beta are f32 host scalars, as CUBLAS_COMPUTE_32F requires.
        unsafe {
            blas_result::gemm_strided_batched_ex(
                *self.blas.handle(),
                op(g.trans_a),
                op(g.trans_b),
                i(g.m),
                i(g.n),
                i(g.k),
                (&g.alpha as *const f32).cast(),
                g.a as *const std::ffi::c_void,
                ty(g.a_type),
                i(g.lda),
                g.stride_a as i64,
                g.b as *const std::ffi::c_void,
                ty(g.b_type),
                i(g.ldb),
                g.stride_b as i64,
                (&g.beta as *const f32).cast(),
                g.c as *mut std::ffi::c_void,
                ty(g.c_type),
                i(g.ldc),
                g.stride_c as i64,
                i(g.batch),
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }?;
        Ok(())
    }
}

impl Drop for DriverEngine {
    fn drop(&mut self) {
        // Queued work may still use memory that is about to be freed.
        let _ = self.stream.synchronize();
    }
}

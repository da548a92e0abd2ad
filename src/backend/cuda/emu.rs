//! A host emulator of the CUDA device, so that [`super::CudaBackend`] (its host code and the
//! kernels of `kernels.cu`) can be tested on a machine without a GPU.
//!
//! `kernels.cu` is compiled as C++ by the system compiler (`$CXX`, else `c++`) with
//! `emu_shim.h` in front, which turns each block's threads into cooperative fibers (see the
//! header); the GEMMs are a plain column-major loop with cuBLAS's argument convention. Device
//! memory is host memory, device pointers are host addresses. Slow (thousands of context
//! switches per row kernel), so tests use small shapes. What it cannot show: warp scheduling,
//! real concurrency between threads of a block (a race that only shows under true parallelism
//! stays hidden), memory coalescing or speed, and cuBLAS itself.

use super::engine::{Arg, DevAlloc, Engine, Epilogue, GemmCall, MarkSlots, NoEpilogue};
use super::{kernel_names, KERNELS_SOURCE};
use crate::dtype::Dtype;
use crate::metrics::timers::{DeviceClock, DeviceMark};
use crate::ops::gelu::{gelu_backward_rows, gelu_rows};
use anyhow::{bail, Context, Result};
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// The emulated device's most dynamic shared memory per block: an H100's opt-in limit.
const H100_DYNAMIC_SHARED: u32 = 232_448;

const SHIM: &str = include_str!("emu_shim.h");

/// `int fugu_emu_launch(unsigned kernel, unsigned grid, unsigned block, unsigned shmem,
/// void** args)`.
type LaunchFn = unsafe extern "C" fn(u32, u32, u32, u32, *const *mut c_void) -> i32;

/// The compiled kernels, built and loaded once per process.
struct Compiled {
    _lib: libloading::Library,
    launch: LaunchFn,
}

static COMPILED: OnceLock<Result<Compiled, String>> = OnceLock::new();
/// The shim's scheduler state is global: one launch at a time in the process.
static LAUNCH_LOCK: Mutex<()> = Mutex::new(());

/// The C++ source: shim, kernels, and a launch table in [`kernel_names`] order.
fn source() -> String {
    let table: Vec<String> = kernel_names()
        .iter()
        .map(|k| format!("    &fugu_emu::run<{k}>,"))
        .collect();
    format!(
        "{SHIM}\n#line 1 \"kernels.cu\"\n{KERNELS_SOURCE}\n\
         static const fugu_emu::launcher fugu_emu_table[] = {{\n{}\n}};\n\
         extern \"C\" int fugu_emu_launch(unsigned k, unsigned grid, unsigned block, \
         unsigned shmem, void** args) {{\n\
         \x20   if (k >= sizeof fugu_emu_table / sizeof fugu_emu_table[0]) return 1;\n\
         \x20   return fugu_emu_table[k](grid, block, shmem, args);\n}}\n",
        table.join("\n")
    )
}

fn compile() -> Result<Compiled> {
    let dir = std::env::temp_dir().join(format!("fugu-cuda-emu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let src = dir.join("emu.cpp");
    let lib: PathBuf = dir.join("libfugu_cuda_emu.so");
    std::fs::write(&src, source())?;
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = std::process::Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O1",
            "-fPIC",
            "-shared",
            "-ffp-contract=off",
            // The fibers switch stacks with _longjmp, which glibc's fortified longjmp (on by
            // default in some distributions' compilers) rejects.
            "-U_FORTIFY_SOURCE",
            "-D_FORTIFY_SOURCE=0",
            "-w",
            "-o",
        ])
        .arg(&lib)
        .arg(&src)
        .output()
        .with_context(|| format!("running the C++ compiler {cxx} (set CXX to another)"))?;
    if !out.status.success() {
        bail!(
            "{cxx} could not compile the emulated kernels:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // SAFETY: the library was just built from our own source; loading it runs no
    // initialisers beyond the C++ statics of the shim.
    let library = unsafe { libloading::Library::new(&lib) }?;
    // SAFETY: `fugu_emu_launch` is defined in that source with exactly `LaunchFn`'s signature.
    let launch: LaunchFn = unsafe { *library.get::<LaunchFn>(b"fugu_emu_launch\0")? };
    let _ = std::fs::remove_dir_all(&dir);
    Ok(Compiled {
        _lib: library,
        launch,
    })
}

/// The emulated device.
pub struct Emulator {
    launch: LaunchFn,
    /// Answer every GEMM with an epilogue with [`NoEpilogue`], as cuBLASLt does for a shape
    /// it has no algorithm for (tests of the backend's fallbacks).
    refuse_epilogues: bool,
    /// The GEMMs run with each kind of epilogue (tests: which path a linear layer took).
    epilogues: Arc<EpilogueCounts>,
    memory: Arc<EmulatedMemory>,
}

/// The emulated device's memory: what its live allocations hold and, where a test gives it
/// one, a size, past which an allocation fails as on a full GPU and below which
/// [`Engine::free_bytes`] is answered (without one, it answers nothing, like a driver that
/// cannot tell, and allocations are the host's).
#[derive(Debug, Default)]
pub struct EmulatedMemory {
    used: AtomicUsize,
    /// Bytes; 0: no size.
    size: AtomicUsize,
}

impl EmulatedMemory {
    /// Gives the device `bytes` of memory (`None`: no size).
    pub fn set_size(&self, bytes: Option<usize>) {
        self.size.store(bytes.unwrap_or(0), Ordering::SeqCst);
    }

    /// The bytes its live allocations hold.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    fn free(&self) -> Option<usize> {
        match self.size.load(Ordering::SeqCst) {
            0 => None,
            size => Some(size.saturating_sub(self.used())),
        }
    }
}

/// One allocation's host words, counted in its device's [`EmulatedMemory`] while it lives.
struct Held {
    _words: Vec<u128>,
    bytes: usize,
    memory: Arc<EmulatedMemory>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.memory.used.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

/// How many GEMMs an [`Emulator`] has run with these epilogues.
#[derive(Debug, Default)]
pub struct EpilogueCounts {
    /// GELU, forward or gradient.
    pub gelu: AtomicU64,
    /// A residual read as C.
    pub residual: AtomicU64,
    /// A bias gradient.
    pub bias_grad: AtomicU64,
}

impl Emulator {
    /// Compiles the kernels for the host (once per process) and returns a device.
    pub fn new() -> Result<Emulator> {
        let c = COMPILED.get_or_init(|| compile().map_err(|e| format!("{e:#}")));
        match c {
            Ok(c) => Ok(Emulator {
                launch: c.launch,
                refuse_epilogues: false,
                epilogues: Default::default(),
                memory: Default::default(),
            }),
            Err(e) => bail!("CUDA emulator: {e}"),
        }
    }

    /// The counts of the GEMMs this emulator runs with epilogues, as they go up.
    pub fn epilogue_counts(&self) -> Arc<EpilogueCounts> {
        self.epilogues.clone()
    }

    /// Its memory: what is held, and a size a test may give it.
    pub fn memory(&self) -> Arc<EmulatedMemory> {
        self.memory.clone()
    }

    /// This emulator, answering every GEMM with an epilogue with [`NoEpilogue`].
    pub fn refusing_epilogues(self) -> Emulator {
        Emulator {
            refuse_epilogues: true,
            ..self
        }
    }
}

/// `len` bytes at host address `p`.
///
/// # Safety
/// `p..p + len` must lie inside one live [`DevAlloc`] of this emulator, not borrowed elsewhere.
unsafe fn bytes<'a>(p: u64, len: usize) -> &'a mut [u8] {
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut(p as *mut u8, len) }
}

impl Engine for Emulator {
    fn describe(&self) -> String {
        "CUDA emulator on the host (kernels.cu compiled as C++)".into()
    }

    fn peak_gflops(&self, _compute: Dtype) -> Option<(f64, String)> {
        None
    }

    fn max_blocks(&self) -> u32 {
        32
    }

    fn mma_16bit(&self) -> bool {
        true
    }

    fn wgmma(&self) -> bool {
        true
    }

    fn max_dynamic_shared(&self) -> u32 {
        H100_DYNAMIC_SHARED
    }

    fn free_bytes(&self) -> Option<usize> {
        self.memory.free()
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevAlloc> {
        // u128 words: 16-byte aligned (the fused attention kernels copy 16-byte rows where the
        // tensor allows it, as on a GPU, whose allocations are 256-byte aligned), zero-filled,
        // like device memory.
        if let Some(free) = self.memory.free().filter(|&f| bytes > f) {
            bail!("out of emulated device memory: {bytes} bytes asked, {free} free");
        }
        let mut v: Vec<u128> = Vec::new();
        v.try_reserve_exact(bytes.div_ceil(16).max(1))?;
        v.resize(bytes.div_ceil(16).max(1), 0);
        let ptr = v.as_mut_ptr() as u64;
        self.memory.used.fetch_add(bytes, Ordering::SeqCst);
        let held = Held {
            _words: v,
            bytes,
            memory: self.memory.clone(),
        };
        Ok(DevAlloc {
            ptr,
            bytes,
            _owner: Box::new(held),
        })
    }

    fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        // SAFETY: the backend passes a `dst` inside a live allocation with room for `src`.
        unsafe { bytes(dst, src.len()) }.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, dst: &mut [u8], src: u64) -> Result<()> {
        // SAFETY: the backend passes a `src` inside a live allocation holding `dst.len()`.
        dst.copy_from_slice(unsafe { bytes(src, dst.len()) });
        Ok(())
    }

    fn copy(&self, dst: u64, src: u64, n: usize) -> Result<()> {
        // SAFETY: the backend passes two non-overlapping ranges inside live allocations.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, n) };
        Ok(())
    }

    fn zero(&self, dst: u64, n: usize) -> Result<()> {
        // SAFETY: the backend passes a range inside a live allocation.
        unsafe { bytes(dst, n) }.fill(0);
        Ok(())
    }

    fn launch(&self, kernel: usize, grid: u32, block: u32, shmem: u32, args: &[Arg]) -> Result<()> {
        if shmem > H100_DYNAMIC_SHARED {
            bail!(
                "{shmem} bytes of dynamic shared memory, more than the {H100_DYNAMIC_SHARED} an \
                 H100 gives a block"
            );
        }
        // Each argument's value, and a pointer to it (what cuLaunchKernel takes).
        let mut vals: Vec<[u8; 8]> = args
            .iter()
            .map(|a| {
                let mut v = [0u8; 8];
                match *a {
                    Arg::Ptr(x) => v.copy_from_slice(&x.to_ne_bytes()),
                    Arg::I64(x) => v.copy_from_slice(&x.to_ne_bytes()),
                    Arg::I32(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
                    Arg::F32(x) => v[..4].copy_from_slice(&x.to_ne_bytes()),
                }
                v
            })
            .collect();
        let ptrs: Vec<*mut c_void> = vals.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
        let _one = LAUNCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: `ptrs` points at one value per kernel parameter, each stored in the first
        // bytes of an 8-byte cell (the host's little-endian layout of the parameter's type);
        // the pointer arguments are host addresses inside live allocations, as the backend
        // checks; the lock keeps the shim's global scheduler to one launch at a time.
        let rc = unsafe { (self.launch)(kernel as u32, grid, block, shmem, ptrs.as_ptr()) };
        match rc {
            0 => Ok(()),
            2 => bail!("wrote past its {shmem} bytes of dynamic shared memory"),
            _ => bail!("emulator has no kernel {kernel}"),
        }
    }

    fn gemm(&self, g: &GemmCall) -> Result<()> {
        if g.epilogue != Epilogue::None {
            g.check_epilogue()?;
            if self.refuse_epilogues {
                return Err(NoEpilogue("refused by the emulator".into()).into());
            }
            if g.epilogue.aux().is_some() {
                self.epilogues.gelu.fetch_add(1, Ordering::Relaxed);
            }
            if g.epilogue.residual().is_some() {
                self.epilogues.residual.fetch_add(1, Ordering::Relaxed);
            }
            if g.epilogue.bias_grad().is_some() {
                self.epilogues.bias_grad.fetch_add(1, Ordering::Relaxed);
            }
        }
        // Element `i` of an operand of type `dt` at `p`, widened to f32 (exact).
        let at = |p: u64, dt: Dtype, i: usize| -> f32 {
            let mut x = [0.0f32];
            // SAFETY: the backend passes matrices inside live allocations covering every
            // index this loop forms from the cuBLAS-style dimensions, strides and ld's.
            dt.decode(
                unsafe { bytes(p + (dt.bytes() * i) as u64, dt.bytes()) },
                &mut x,
            );
            x[0]
        };
        // op(A) as m rows of k and op(B)ᵀ as n rows of k, contiguous, so every C element is
        // one contiguous dot product (accumulated in f64). Element (r, l) of a column-major
        // matrix is at `l + r·ld` when its k index runs along memory, else at `r + l·ld`.
        let pack = |out: &mut [f32],
                    p: u64,
                    dt: Dtype,
                    rows: usize,
                    k: usize,
                    ld: usize,
                    k_inner: bool| {
            for r in 0..rows {
                for l in 0..k {
                    out[r * k + l] = at(p, dt, if k_inner { l + r * ld } else { r + l * ld });
                }
            }
        };
        let (mut ar, mut bc) = (vec![0.0f32; g.m * g.k], vec![0.0f32; g.n * g.k]);
        let (ab, bb, cb) = (g.a_type.bytes(), g.b_type.bytes(), g.c_type.bytes());
        let mut out = Vec::new();
        for p in 0..g.batch {
            let (a, b, c) = (
                g.a + (ab * p * g.stride_a) as u64,
                g.b + (bb * p * g.stride_b) as u64,
                g.c + (cb * p * g.stride_c) as u64,
            );
            pack(&mut ar, a, g.a_type, g.m, g.k, g.lda, g.trans_a);
            pack(&mut bc, b, g.b_type, g.n, g.k, g.ldb, !g.trans_b);
            if let Some((grad, of_a)) = g.epilogue.bias_grad() {
                // The sums over k of op(A)'s rows or op(B)'s columns (rows of `ar`, `bc`).
                let (rows, len) = if of_a { (&ar, g.m) } else { (&bc, g.n) };
                let sums: Vec<f32> = (0..len)
                    .map(|r| {
                        let row = &rows[r * g.k..(r + 1) * g.k];
                        row.iter().map(|&x| x as f64).sum::<f64>() as f32
                    })
                    .collect();
                g.c_type.encode(&sums, &mut out);
                // SAFETY: the backend passes a bias gradient of `len` values of C's type.
                unsafe { bytes(grad, out.len()) }.copy_from_slice(&out);
            }
            for j in 0..g.n {
                let bj = &bc[j * g.k..(j + 1) * g.k];
                for i in 0..g.m {
                    let ai = &ar[i * g.k..(i + 1) * g.k];
                    let acc: f64 = ai.iter().zip(bj).map(|(&x, &y)| x as f64 * y as f64).sum();
                    let idx = i + j * g.ldc;
                    let mut v = g.alpha as f64 * acc;
                    if g.beta != 0.0 {
                        v += g.beta as f64 * at(c, g.c_type, idx) as f64;
                    }
                    let bias = g.epilogue.bias();
                    if bias != 0 {
                        v += at(bias, g.c_type, i) as f64;
                    }
                    if let Some(resid) = g.epilogue.residual() {
                        v += at(resid, g.c_type, idx) as f64;
                    }
                    // The epilogue works on the f32 value, as cuBLASLt's does.
                    let (v, mut y) = (v as f32, [0.0f32]);
                    let aux = g
                        .epilogue
                        .aux()
                        .map(|(p, ld)| p + (cb * (i + j * ld)) as u64);
                    match (g.epilogue, aux) {
                        (Epilogue::GeluAux { .. }, Some(aux)) => {
                            g.c_type.encode(&[v], &mut out);
                            // SAFETY: as for `at` (the aux matrix is m×n with its ld).
                            unsafe { bytes(aux, cb) }.copy_from_slice(&out);
                            gelu_rows(&mut y, &[v]);
                        }
                        (Epilogue::GeluGrad { .. }, Some(aux)) => {
                            let x = at(aux, g.c_type, 0);
                            gelu_backward_rows(&mut y, &[x], &[v]);
                        }
                        _ => y[0] = v,
                    }
                    g.c_type.encode(&y, &mut out);
                    // SAFETY: as for `at`.
                    unsafe { bytes(c + (cb * idx) as u64, cb) }.copy_from_slice(&out);
                }
            }
        }
        Ok(())
    }

    fn gemm_ptr_arrays(&self, g: &GemmCall, arrays: [u64; 3]) -> Result<()> {
        // SAFETY: the backend passes three arrays of `g.batch` pointers in emulated device
        // memory (host memory here).
        let ptr = |arr: u64, i: usize| unsafe { *(arr as *const u64).add(i) };
        for i in 0..g.batch {
            let one = GemmCall {
                a: ptr(arrays[0], i),
                b: ptr(arrays[1], i),
                c: ptr(arrays[2], i),
                batch: 1,
                ..*g
            };
            self.gemm(&one)?;
        }
        Ok(())
    }

    fn sync(&self) -> Result<()> {
        Ok(())
    }

    fn clock(&self) -> Box<dyn DeviceClock> {
        Box::new(HostClock::default())
    }
}

/// The emulator's clock: work is done when it returns, so a mark is the host's time.
#[derive(Default)]
struct HostClock {
    marks: std::cell::RefCell<MarkSlots<std::time::Instant>>,
}

impl DeviceClock for HostClock {
    fn mark(&self) -> DeviceMark {
        let now = std::time::Instant::now();
        let mut marks = self.marks.borrow_mut();
        let (i, slot) = marks.acquire(|| Ok(now)).expect("a host mark");
        *slot = now;
        DeviceMark(i)
    }

    fn take_interval(&self, start: DeviceMark, end: DeviceMark) -> f64 {
        let mut marks = self.marks.borrow_mut();
        let ms = marks
            .get(end.0)
            .duration_since(*marks.get(start.0))
            .as_secs_f64()
            * 1e3;
        marks.release(start.0);
        marks.release(end.0);
        ms
    }
}

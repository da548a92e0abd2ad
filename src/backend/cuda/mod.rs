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

mod driver;
pub mod emu;
pub mod engine;
pub mod kernel_cache;
mod lt;
mod nvrtc;

use super::WeightLayout;
use super::{
    AdamWPart, AdamWStep, AttnDims, Backend, BufId, CeDims, CudaSettings, Dtype, FusedAttention,
    InGemm, Span, TokSpan,
};
use crate::ops::attention::Heads;
use anyhow::{Context, Result};
use engine::{Arg, DevAlloc, Engine, Epilogue, GemmCall, NoEpilogue};

/// The kernels' CUDA C source (compiled by NVRTC when a backend is created).
pub const KERNELS_SOURCE: &str = include_str!("kernels.cu");

/// NVRTC options: no FMA contraction (the CPU reference has none), IEEE division and square
/// root (NVRTC's defaults, spelled out).
pub const NVRTC_OPTIONS: &[&str] = &["--fmad=false", "--prec-div=true", "--prec-sqrt=true"];

/// Environment variable that turns `--device cuda` into the host emulator (tests only).
pub const EMULATE_ENV: &str = "FUGU_CUDA_EMULATE";

/// Environment variable: rows per warp of the fused attention kernels, `16` (the default,
/// measured) or `32` (the `_wide` kernels: each fragment a warp loads from shared memory feeds
/// two products; unmeasured, for A/B runs on a GPU), for all three kernels or as `F,Q,KV`
/// for the forward, dQ and dK/dV kernels ([`FlashWarpRows`]).
pub const FLASH_WARP_ROWS_ENV: &str = "FUGU_FLASH_WARP_ROWS";

/// Rows per warp (16 or 32) of each fused attention kernel: query rows for the forward and dQ
/// kernels, keys for the dK/dV kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashWarpRows {
    pub forward: usize,
    pub dq: usize,
    pub dkv: usize,
}

impl Default for FlashWarpRows {
    fn default() -> Self {
        FlashWarpRows {
            forward: 16,
            dq: 16,
            dkv: 16,
        }
    }
}

impl FlashWarpRows {
    /// [`FLASH_WARP_ROWS_ENV`]'s value: empty (the default), `R`, or `F,Q,KV`.
    pub fn parse(v: &str) -> Result<FlashWarpRows> {
        let bad = || {
            anyhow::anyhow!(
                "{FLASH_WARP_ROWS_ENV}={v}: expected 16 or 32, or three of them separated by \
                 commas (forward, dQ, dK/dV kernels)"
            )
        };
        if v.is_empty() {
            return Ok(Self::default());
        }
        let rows: Vec<usize> = v
            .split(',')
            .map(|x| match x.trim() {
                "16" => Ok(16),
                "32" => Ok(32),
                _ => Err(bad()),
            })
            .collect::<Result<_>>()?;
        match rows[..] {
            [r] => Ok(FlashWarpRows {
                forward: r,
                dq: r,
                dkv: r,
            }),
            [forward, dq, dkv] => Ok(FlashWarpRows { forward, dq, dkv }),
            _ => Err(bad()),
        }
    }

    /// A kernel's narrow (16 rows per warp, [`FLASH_THREADS`]) or wide (32 rows, half the
    /// threads) form.
    fn pick(rows: usize, narrow: K, wide: K) -> (K, u32) {
        if rows == 32 {
            (wide, FLASH_THREADS / 2)
        } else {
            (narrow, FLASH_THREADS)
        }
    }
}

/// Environment variable: how the layernorm backward pass runs, `split` (the default,
/// measured: the input gradient, then the weight gradients' column sums, which read dout and
/// the input a second time) or `fused` (both in one pass; unmeasured, for A/B runs on a GPU)
/// ([`LayernormBackward`]).
pub const LAYERNORM_BACKWARD_ENV: &str = "FUGU_LAYERNORM_BACKWARD";

/// A kernel setting's two forms: the work in more kernels or passes (the default, measured)
/// or fused into fewer (unmeasured, for A/B runs on a GPU). For each op: [`LayernormBackward`],
/// [`FlashBackward`]. Both forms compute the same values up to the order of f32 sums.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KernelForm {
    #[default]
    Split,
    Fused,
}

impl KernelForm {
    /// The setting's value for this form (what [`Self::parse`] reads and the run header shows).
    pub fn name(self) -> &'static str {
        match self {
            KernelForm::Split => "split",
            KernelForm::Fused => "fused",
        }
    }

    /// The value `v` of setting `env`: empty (the default), `split` or `fused`.
    pub fn parse(env: &str, v: &str) -> Result<KernelForm> {
        parse_form(env, v, &[KernelForm::Split, KernelForm::Fused], Self::name)
    }
}

/// The form of the layernorm backward kernels ([`LAYERNORM_BACKWARD_ENV`]): `Split`,
/// `layernorm_backward_dinp`, then `column_partials` and `column_finish`; `Fused`,
/// `layernorm_backward` (input gradient and the column sums' first stage), then
/// `column_finish` (the split form where C is too wide for its shared memory,
/// [`LN_FUSED_SHMEM`]).
pub type LayernormBackward = KernelForm;

/// Environment variable: how the fused attention's backward pass runs, `split` (the default,
/// measured: a kernel for dQ, then one for dK and dV, seven tensor-core products per tile) or
/// `fused` (one kernel, five products, dQ added across key blocks in a fixed order; unmeasured,
/// for A/B runs on a GPU) ([`FlashBackward`]).
pub const FLASH_BACKWARD_ENV: &str = "FUGU_FLASH_BACKWARD";

/// How the fused attention's backward pass runs ([`FLASH_BACKWARD_ENV`]): `Split`,
/// `flash_backward_dq` (which also computes Δ = rowsum(dO ∘ O)), then `flash_backward_dkv`;
/// `Fused`, `flash_backward_prep` (Δ), then `flash_backward_fused`: dK and dV as the dK/dV
/// kernel computes them, and each tile's share of dQ from the dS it computes anyway (dQ's f32
/// shares added in another order).
pub type FlashBackward = KernelForm;

/// Environment variable: how a linear layer's bias gradient is computed, `separate` (the
/// default, measured: column-sum kernels reading the output gradient again after the
/// weight-gradient GEMM) or `epilogue` (by that GEMM, from the output gradient it reads
/// anyway; unmeasured, for A/B runs on a GPU) ([`BiasGrad`]).
pub const BIAS_GRAD_ENV: &str = "FUGU_BIAS_GRAD";

/// How a linear layer's bias gradient is computed ([`BIAS_GRAD_ENV`]): `Separate`,
/// `column_partials` and `column_finish` over the output gradient; `Epilogue`, the
/// weight-gradient GEMM's epilogue (cuBLASLt's `BGRADA`/`BGRADB`, [`Epilogue::BiasGrad`]) into
/// a scratch vector, added to the gradient (the column sums where the engine has no such
/// epilogue for the shape). Both sum the same values in f32, in different orders.
pub type BiasGrad = InGemm;

/// The value `v` of setting `env` that says whether an op runs in a GEMM's epilogue: empty
/// (the default: separate), `separate` or `epilogue`.
pub fn parse_in_gemm(env: &str, v: &str) -> Result<InGemm> {
    parse_form(env, v, &[InGemm::Separate, InGemm::Epilogue], InGemm::name)
}

/// `v`, the value of kernel setting `env`, as the one of `forms` that `name` calls so (empty:
/// the default); an error naming the setting and the values it takes otherwise.
fn parse_form<F: Copy + Default>(
    env: &str,
    v: &str,
    forms: &[F],
    name: fn(F) -> &'static str,
) -> Result<F> {
    if v.is_empty() {
        return Ok(F::default());
    }
    forms
        .iter()
        .copied()
        .find(|&f| name(f) == v)
        .ok_or_else(|| {
            let names: Vec<&str> = forms.iter().map(|&f| name(f)).collect();
            anyhow::anyhow!("{env}={v}: expected {}", names.join(" or "))
        })
}

/// Dynamic shared memory per block of the fused layernorm backward: 2·C floats per warp, so
/// 8 warps up to C = 768, fewer above and the split form past C = 6144. 48 KiB is what every
/// GPU allows a block without opting in.
const LN_FUSED_SHMEM: usize = 48 << 10;

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
/// Causal blocks of the attention GEMMs: query rows in this many blocks, each multiplied only
/// with the keys up to its last row (5/8 of the full T×T work), for T of at least
/// [`CAUSAL_MIN_T`].
const CAUSAL_BLOCKS: usize = 4;
const CAUSAL_MIN_T: usize = 128;
/// Rows per chunk of the two-stage column sums (dbias, layernorm dw/dbias): at 32, a
/// (16384, 768) gradient has 512 chunks × 96 packs of columns, enough threads for the loads of
/// stage 1 to cover the memory latency, and stage 2 reads 1.5 MB of partial sums.
const COLUMN_CHUNK_ROWS: usize = 32;

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
    residual_forward,
    add_inplace,
    ce_row_stats,
    ce_rescale_sums,
    ce_target_logit,
    ce_finish,
    adamw,
    sum_of_squares;
    half:
    flash_forward,
    flash_forward_wide,
    flash_backward_dq,
    flash_backward_dq_wide,
    flash_backward_dkv,
    flash_backward_dkv_wide,
    flash_backward_prep,
    flash_backward_fused,
    flash_backward_fused_wide,
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
    /// Rows per warp of the fused attention kernels, and the form of their backward pass.
    flash_warp_rows: FlashWarpRows,
    flash_backward: FlashBackward,
    /// The one-kernel attention backward's dQ accumulators and counters
    /// ([`FlashBackward::Fused`]).
    attn_dq: Scratch,
    /// The form of the layernorm backward kernels.
    layernorm_backward: LayernormBackward,
    /// How linear layers' bias gradients are computed, and the vector cuBLASLt writes one to
    /// ([`BiasGrad::Epilogue`]).
    bias_grad: BiasGrad,
    bias_grad_sums: Scratch,
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
        let be = if std::env::var_os(EMULATE_ENV).is_some_and(|v| v == "1") {
            Self::emulated()?
        } else {
            Self::with_engine(Box::new(driver::DriverEngine::new(ordinal, settings)?))
        };
        be.with_env_settings()
    }

    /// This backend with the kernel settings the environment asks for
    /// ([`FLASH_WARP_ROWS_ENV`], [`FLASH_BACKWARD_ENV`], [`LAYERNORM_BACKWARD_ENV`],
    /// [`BIAS_GRAD_ENV`]; [`Self::new`] applies them, and the host-only benchmark); a value a
    /// setting does not take is an error naming it.
    pub fn with_env_settings(mut self) -> Result<CudaBackend> {
        let var = |name| std::env::var(name).unwrap_or_default();
        let form = |env| KernelForm::parse(env, &var(env));
        self.set_flash_warp_rows(FlashWarpRows::parse(&var(FLASH_WARP_ROWS_ENV))?);
        self.set_flash_backward(form(FLASH_BACKWARD_ENV)?);
        self.set_layernorm_backward(form(LAYERNORM_BACKWARD_ENV)?);
        self.set_bias_grad(parse_in_gemm(BIAS_GRAD_ENV, &var(BIAS_GRAD_ENV))?);
        Ok(self)
    }

    /// Rows per warp of the fused attention kernels ([`FLASH_WARP_ROWS_ENV`]).
    pub fn set_flash_warp_rows(&mut self, rows: FlashWarpRows) {
        for r in [rows.forward, rows.dq, rows.dkv] {
            assert!(r == 16 || r == 32, "flash warp rows: 16 or 32, not {r}");
        }
        self.flash_warp_rows = rows;
    }

    /// The form of the fused attention's backward pass ([`FLASH_BACKWARD_ENV`]).
    pub fn set_flash_backward(&mut self, form: FlashBackward) {
        self.flash_backward = form;
    }

    /// The form of the layernorm backward kernels ([`LAYERNORM_BACKWARD_ENV`]).
    pub fn set_layernorm_backward(&mut self, form: LayernormBackward) {
        self.layernorm_backward = form;
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
            flash_warp_rows: FlashWarpRows::default(),
            flash_backward: FlashBackward::default(),
            attn_dq: Scratch::default(),
            layernorm_backward: LayernormBackward::default(),
            bias_grad: BiasGrad::default(),
            bias_grad_sums: Scratch::default(),
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

    /// A span as a GEMM operand with leading dimension `ld` (not batched).
    fn mat(&self, s: Span, ld: usize) -> Mat {
        (self.ptr(s), ld, 0, self.dt(s))
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
        a: Mat,
        b: Mat,
        beta: f32,
        c: Mat,
        batch: usize,
    ) {
        let call = column_major((ta, tb), (m, n, k), alpha, a, b, beta, c, batch);
        self.queue_gemm(what, &call);
    }

    /// A linear layer's forward GEMM: `out (N, OC) = inp·W`, W the (IC, OC) matrix of
    /// y = x·W stored so (InOut) or transposed (OutIn).
    #[allow(clippy::too_many_arguments)]
    fn linear_call(
        &self,
        out: Span,
        inp: Span,
        w: Span,
        layout: WeightLayout,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> GemmCall {
        assert!(
            out.len == n * oc && inp.len == n * ic && w.len == ic * oc,
            "linear_forward"
        );
        let (tw, ldw) = match layout {
            WeightLayout::InOut => (false, oc),
            WeightLayout::OutIn => (true, ic),
        };
        let (a, b, c) = (self.mat(inp, ic), self.mat(w, ldw), self.mat(out, oc));
        column_major((false, tw), (n, oc, ic), 1.0, a, b, 0.0, c, 1)
    }

    /// Panics (a bug in the model) unless `bias`, where given, has `oc` values of `out`'s type
    /// (or a bias gradient, of the weight gradient's).
    fn check_bias(&self, what: &str, bias: Option<Span>, out: Span, oc: usize) {
        if let Some(b) = bias {
            assert!(
                b.len == oc && self.dt(b) == self.dt(out),
                "{what}: bias of {} {:?} values for {oc} outputs of {:?}",
                b.len,
                self.dt(b),
                self.dt(out)
            );
        }
    }

    /// A linear layer's input-gradient GEMM: `dinp (N, IC) = dout·Wᵀ`, the forward GEMM of
    /// a layer whose weight is W read transposed.
    #[allow(clippy::too_many_arguments)]
    fn input_grad_call(
        &self,
        dinp: Span,
        dout: Span,
        w: Span,
        layout: WeightLayout,
        n: usize,
        ic: usize,
        oc: usize,
    ) -> GemmCall {
        self.linear_call(dinp, dout, w, layout.transposed(), n, oc, ic)
    }

    /// A linear layer's parameter gradients: `dw += inpᵀ·dout` (in W's layout) and `dbias +=`
    /// the column sums of `dout`.
    #[allow(clippy::too_many_arguments)]
    fn linear_param_grads(
        &mut self,
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
        let (i, d) = (self.mat(inp, ic), self.mat(dout, oc));
        let call = match layout {
            // dW (IC, OC) += inpᵀ·dout
            WeightLayout::InOut => column_major(
                (true, false),
                (ic, oc, n),
                1.0,
                i,
                d,
                1.0,
                self.mat(dw, oc),
                1,
            ),
            // dW (OC, IC) += doutᵀ·inp
            WeightLayout::OutIn => column_major(
                (true, false),
                (oc, ic, n),
                1.0,
                d,
                i,
                1.0,
                self.mat(dw, ic),
                1,
            ),
        };
        let Some(dbias) = dbias else {
            return self.queue_gemm("linear_backward", &call);
        };
        self.check_bias("linear_backward", Some(dbias), dw, oc);
        if self.bias_grad == BiasGrad::Epilogue {
            // The bias gradient (the sums of dout over its rows) into a scratch vector by the
            // GEMM, which reads dout as cuBLAS's A (its rows the output features) for InOut and
            // as B for OutIn ([`column_major`] swaps the operands); then added, as gradients
            // accumulate.
            let sums = self.scratch(|s| &mut s.bias_grad_sums, self.dt(dbias).bytes() * oc);
            let of_a = layout == WeightLayout::InOut;
            if self.try_epilogue(&call, Epilogue::BiasGrad { grad: sums, of_a }) {
                let args = [
                    Arg::Ptr(self.ptr(dbias)),
                    Arg::Ptr(sums),
                    Arg::I64(oc as i64),
                ];
                return self.launch_packs(K::add_inplace, self.dt(dbias), oc, &args);
            }
        }
        self.queue_gemm("linear_backward", &call);
        self.column_sums(dbias, None, dout, n, oc);
    }

    /// Queues `call` with `epilogue` if the engine runs it: false (nothing queued) where the
    /// call does not meet the epilogue's alignment ([`GemmCall::check_epilogue`]), the
    /// product is empty, or the engine has no such epilogue for the shape (noted on stderr
    /// once, and remembered: the caller does the epilogue's work with kernels).
    fn try_epilogue(&mut self, call: &GemmCall, epilogue: Epilogue) -> bool {
        let call = GemmCall { epilogue, ..*call };
        let shape = (
            epilogue.name(),
            (call.m, call.n, call.k),
            (call.trans_a, call.trans_b),
            (call.a_type, call.c_type),
        );
        if call.is_empty() || call.check_epilogue().is_err() || self.no_epilogue.contains(&shape) {
            return false;
        }
        match self.eng.gemm(&call) {
            Ok(()) => true,
            Err(e) if e.is::<NoEpilogue>() => {
                eprintln!(
                    "note: a linear layer's GEMM (cuBLAS m {}, n {}, k {}, {} → {}): {e:#}; its \
                     {} epilogue is done by kernels instead",
                    call.m,
                    call.n,
                    call.k,
                    call.a_type.name(),
                    call.c_type.name(),
                    epilogue.name()
                );
                self.no_epilogue.insert(shape);
                false
            }
            Err(e) => self.fail("linear layer", e),
        }
    }

    /// Queues `call` (nothing for an empty product).
    fn queue_gemm(&self, what: &str, call: &GemmCall) {
        if call.is_empty() {
            return;
        }
        if let Err(e) = self.eng.gemm(call) {
            self.fail(what, e);
        }
    }

    /// [`Self::gemm`] over matrices given one pointer each (`Ptrs`: pointers, leading
    /// dimension, type), for batches whose strides are not uniform (the attention heads of
    /// every sequence at once). The pointer arrays are uploaded once and cached by content.
    #[allow(clippy::too_many_arguments)]
    fn gemm_ptrs(
        &mut self,
        what: &str,
        (ta, tb): (bool, bool),
        (m, n, k): (usize, usize, usize),
        alpha: f32,
        a: &Ptrs,
        b: &Ptrs,
        beta: f32,
        c: &Ptrs,
    ) {
        let batch = c.0.len();
        assert!(
            a.0.len() == batch && b.0.len() == batch,
            "{what}: pointer counts"
        );
        if m == 0 || n == 0 || batch == 0 {
            return;
        }
        // cuBLAS cannot see the alignment of pointers in an array and assumes 16 bytes (a
        // misaligned one faults). Odd shapes (head sizes or row offsets that are not a
        // multiple of 16 bytes) run one plain GEMM per matrix instead.
        let aligned =
            |(p, ld, dt): &Ptrs| p.iter().all(|x| x % 16 == 0) && (ld * dt.bytes()) % 16 == 0;
        if ![a, b, c].into_iter().all(aligned) {
            for i in 0..batch {
                self.gemm(
                    what,
                    (ta, tb),
                    (m, n, k),
                    alpha,
                    (a.0[i], a.1, 0, a.2),
                    (b.0[i], b.1, 0, b.2),
                    beta,
                    (c.0[i], c.1, 0, c.2),
                    1,
                );
            }
            return;
        }
        // Column-major: C_iᵀ = op(B_i)ᵀ·op(A_i)ᵀ, as in `gemm`.
        let key: Vec<u64> = b.0.iter().chain(&a.0).chain(&c.0).copied().collect();
        let base = self.table(key, "pointer arrays");
        // The matrices come from the arrays; addresses and strides in the call are unused.
        let call = column_major(
            (ta, tb),
            (m, n, k),
            alpha,
            (0, a.1, 0, a.2),
            (0, b.1, 0, b.2),
            beta,
            (0, c.1, 0, c.2),
            batch,
        );
        let arrays = [base, base + 8 * batch as u64, base + 16 * batch as u64];
        if let Err(e) = self.eng.gemm_ptr_arrays(&call, arrays) {
            self.fail(what, e);
        }
    }

    /// Adds the column sums of `rows`×`cols` `dout` into `dst` (and, for layernorm, the column
    /// sums of `dout·x̂` into the first span of `dst2`), in two fixed-shape stages
    /// (`column_partials`: a thread per chunk of rows and pack of columns; `column_finish`: a
    /// block per 32 columns).
    fn column_sums(
        &mut self,
        dst: Span,
        dst2: Option<(Span, Span, Span, Span)>,
        dout: Span,
        rows: usize,
        cols: usize,
    ) {
        let chunks = rows.div_ceil(COLUMN_CHUNK_ROWS).max(1);
        let (part, part2) = self.column_partial_sums(chunks, cols);
        let (inp, mean, rstd, with) = match dst2 {
            Some((_, inp, mean, rstd)) => (self.ptr(inp), self.ptr(mean), self.ptr(rstd), 1),
            None => (0, 0, 0, 0),
        };
        self.launch_packs(
            K::column_partials,
            self.dt(dout),
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
        self.column_finish(dst, part, cols, chunks);
        if let Some((dw, ..)) = dst2 {
            self.column_finish(dw, part2, cols, chunks);
        }
    }

    /// Scratch for the first stage of two column sums over `chunks` chunks of rows: two arrays
    /// of `chunks`×`cols` floats.
    fn column_partial_sums(&mut self, chunks: usize, cols: usize) -> (u64, u64) {
        let part = self.scratch(|b| &mut b.partials, 4 * 2 * chunks * cols);
        (part, part + 4 * (chunks * cols) as u64)
    }

    /// The second stage of a column sum: `dst[c] += Σ_k part[k, c]` over `chunks` chunks.
    fn column_finish(&self, dst: Span, part: u64, cols: usize, chunks: usize) {
        self.launch_rows(
            K::column_finish,
            self.dt(dst),
            cols.div_ceil(WARP as usize),
            0,
            &[
                Arg::Ptr(self.ptr(dst)),
                Arg::Ptr(part),
                Arg::I64(cols as i64),
                Arg::I64(chunks as i64),
            ],
        )
    }

    /// Uploads a row-major strided-batched GEMM problem `C_i (m×n) = A_i·B_i` for the GEMM
    /// benchmark (`fugu bench gemm --device cuda`): `ta`/`tb` store A as k×m and B as n×k,
    /// as the benchmark's shapes do; A and B are stored as `operands` (rounded to it), C as
    /// `out`. Run it with [`Self::run_gemm`], read C and free it with [`Self::finish_gemm`].
    pub fn upload_gemm(
        &mut self,
        a: &[f32],
        b: &[f32],
        (m, n, k, batch): (usize, usize, usize, usize),
        (ta, tb): (bool, bool),
        (operands, out): (Dtype, Dtype),
    ) -> Result<DeviceGemm> {
        anyhow::ensure!(
            a.len() == batch * m * k && b.len() == batch * k * n,
            "upload_gemm: operand lengths"
        );
        let (ab, bb, cb) = (
            self.alloc(a.len(), operands)?,
            self.alloc(b.len(), operands)?,
            self.alloc(batch * m * n, out)?,
        );
        let spans = [self.whole(ab), self.whole(bb), self.whole(cb)];
        self.upload(spans[0], a);
        self.upload(spans[1], b);
        Ok(DeviceGemm {
            spans,
            dims: (m, n, k, batch),
            trans: (ta, tb),
        })
    }

    /// Queues one run of an uploaded GEMM.
    pub fn run_gemm(&self, g: &DeviceGemm) {
        let (m, n, k, batch) = g.dims;
        let (ta, tb) = g.trans;
        let [a, b, c] = g.spans;
        let lda = if ta { m } else { k };
        let ldb = if tb { k } else { n };
        self.gemm(
            "bench gemm",
            g.trans,
            (m, n, k),
            1.0,
            (self.ptr(a), lda, m * k, self.dt(a)),
            (self.ptr(b), ldb, k * n, self.dt(b)),
            0.0,
            (self.ptr(c), n, m * n, self.dt(c)),
            batch,
        );
    }

    /// C of an uploaded GEMM (after all queued runs), and its buffers freed.
    pub fn finish_gemm(&mut self, g: DeviceGemm) -> Vec<f32> {
        let c = g.spans[2];
        let mut out = vec![0.0f32; c.len];
        self.download(c, &mut out);
        for s in g.spans {
            self.free(s.buf);
        }
        out
    }

    /// Uploads `data` into the index scratch; returns its device address.
    fn upload_indices(&mut self, data: &[i32]) -> u64 {
        let p = self.scratch(|b| &mut b.indices, 4 * data.len());
        self.upload_bytes(p, as_bytes(data));
        p
    }
}

/// A GEMM problem on the device for the GEMM benchmark ([`CudaBackend::upload_gemm`]).
pub struct DeviceGemm {
    /// A, B, C.
    spans: [Span; 3],
    dims: (usize, usize, usize, usize),
    trans: (bool, bool),
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
    let ptx = compile_kernels(&format!("compute_{major}{minor}"), nvrtc::Output::Ptx)?;
    Ok(String::from_utf8_lossy(&ptx).into_owned())
}

/// `kernels.cu` compiled to machine code (a cubin) for compute capability `major.minor`:
/// what [`CudaBackend::new`] loads, through the on-disk cache ([`kernel_cache`]). Call only
/// when [`nvrtc_available`].
pub fn kernels_cubin(major: i32, minor: i32) -> Result<Vec<u8>> {
    compile_kernels(&format!("sm_{major}{minor}"), nvrtc::Output::Cubin)
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

    fn kernel_settings(&self) -> Vec<(&'static str, String)> {
        let r = self.flash_warp_rows;
        vec![
            (
                FLASH_WARP_ROWS_ENV,
                format!("{},{},{}", r.forward, r.dq, r.dkv),
            ),
            (
                LAYERNORM_BACKWARD_ENV,
                self.layernorm_backward.name().to_string(),
            ),
            (FLASH_BACKWARD_ENV, self.flash_backward.name().to_string()),
            (BIAS_GRAD_ENV, self.bias_grad.name().to_string()),
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
        let r = match self.dt(src) {
            Dtype::F32 => self.eng.download(as_bytes_mut(dst), self.ptr(src)),
            dt => {
                let mut bytes = vec![0u8; dt.bytes() * dst.len()];
                let r = self.eng.download(&mut bytes, self.ptr(src));
                dt.decode(&bytes, dst);
                r
            }
        };
        if let Err(e) = r {
            self.fail("download", e);
        }
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

    fn device_clock(&self) -> Option<Box<dyn crate::metrics::timers::DeviceClock>> {
        Some(self.eng.clock())
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
        // The one-pass kernel's shared memory: each warp's column sums of dout and dout·x̂.
        let warp_bytes = 2 * std::mem::size_of::<f32>() * c.max(1);
        let fused_warps = (LN_FUSED_SHMEM / warp_bytes).min((ROW_THREADS / WARP) as usize);
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
            self.column_finish(dbias, part, c, chunks);
            self.column_finish(dw, part2, c, chunks);
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
        let call = self.linear_call(out, inp, w, layout, n, ic, oc);
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
        if let Some(dinp) = dinp {
            let call = self.input_grad_call(dinp, dout, w, layout, n, ic, oc);
            self.queue_gemm("linear_backward", &call);
        }
        self.linear_param_grads(dw, dbias, dout, inp, w, layout, n, ic, oc);
    }

    fn residual_epilogue(&self, _dt: Dtype) -> bool {
        true
    }

    fn linear_residual_forward(
        &mut self,
        out: Span,
        resid: Span,
        scratch: Span,
        inp: Span,
        w: Span,
        layout: WeightLayout,
        bias: Option<Span>,
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        assert!(
            resid.len == out.len && self.dt(resid) == self.dt(out) && !resid.overlaps(out),
            "linear_residual_forward: resid"
        );
        self.check_bias("linear_residual_forward", bias, out, oc);
        // The GEMM reads the stream as its C (beta = 1) and writes the new one, the bias in
        // its epilogue; where cuBLASLt has no algorithm for that (or the bias is not 16-byte
        // aligned), the two ops.
        let call = self.linear_call(out, inp, w, layout, n, ic, oc);
        let epilogue = Epilogue::Residual {
            bias: bias.map_or(0, |b| self.ptr(b)),
            resid: self.ptr(resid),
        };
        if self.try_epilogue(&call, epilogue) {
            return;
        }
        crate::backend::linear_then_residual(
            self, out, resid, scratch, inp, w, layout, bias, n, ic, oc,
        );
    }

    fn gelu_epilogue(&self, dt: Dtype) -> bool {
        // cuBLASLt's GELU is the tanh form within 2e-4 in f32 (lt.rs): far below a 16-bit
        // type's rounding, not below f32's, whose runs are the references.
        dt != Dtype::F32
    }

    fn linear_gelu_forward(
        &mut self,
        out: Span,
        pre: Span,
        inp: Span,
        w: Span,
        layout: WeightLayout,
        bias: Option<Span>,
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        assert!(
            pre.len == n * oc && self.dt(pre) == self.dt(out),
            "linear_gelu_forward: pre"
        );
        self.check_bias("linear_gelu_forward", bias, out, oc);
        if self.gelu_epilogue(self.dt(out)) {
            let call = self.linear_call(out, inp, w, layout, n, ic, oc);
            let epilogue = Epilogue::GeluAux {
                bias: bias.map_or(0, |b| self.ptr(b)),
                aux: self.ptr(pre),
                ld_aux: oc,
            };
            if self.try_epilogue(&call, epilogue) {
                return;
            }
        }
        crate::backend::linear_then_gelu(self, out, pre, inp, w, layout, bias, n, ic, oc);
    }

    fn gelu_linear_backward(
        &mut self,
        dpre: Span,
        scratch: Span,
        dw: Span,
        dbias: Option<Span>,
        dout: Span,
        inp: Span,
        pre: Span,
        w: Span,
        layout: WeightLayout,
        n: usize,
        ic: usize,
        oc: usize,
    ) {
        assert!(
            pre.len == n * ic && self.dt(pre) == self.dt(dpre),
            "gelu_linear_backward: pre"
        );
        if self.gelu_epilogue(self.dt(dpre)) {
            let call = self.input_grad_call(dpre, dout, w, layout, n, ic, oc);
            let epilogue = Epilogue::GeluGrad {
                aux: self.ptr(pre),
                ld_aux: ic,
            };
            if self.try_epilogue(&call, epilogue) {
                return self.linear_param_grads(dw, dbias, dout, inp, w, layout, n, ic, oc);
            }
        }
        crate::backend::linear_then_gelu_backward(
            self, dpre, scratch, dw, dbias, dout, inp, pre, w, layout, n, ic, oc,
        );
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
                (false, true),
                m,
                a.scale,
                &q,
                &k,
                0.0,
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
            self.gemm_ptrs("attention_values", (false, false), m, 1.0, &p, &v, 0.0, &y);
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
            self.gemm_ptrs(what, (false, true), m, 1.0, &dy, &v, 0.0, &c);
            // dV_h[r0..r1] = att[b, h][r0..T, r0..r1]ᵀ · dout_h[r0..T] (att is 0 above the
            // diagonal, so earlier rows add nothing).
            let (p, dy, dv) = (a.att_at(r0, r0), a.rows_of(&g, r0), da.qkv(2, r0));
            let m = (r1 - r0, d.hs, d.t - r0);
            self.gemm_ptrs(what, (true, false), m, 1.0, &p, &dy, 0.0, &dv);
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
            self.gemm_ptrs(what, (false, false), m, a.scale, &ds, &k, 0.0, &dq);
            // dK_h[r0..r1] = scale · datt[r0..T, r0..r1]ᵀ · Q_h[r0..T]
            let (ds, q, dk) = (a.att_at(r0, r0), a.qkv(0, r0), da.qkv(1, r0));
            let m = (r1 - r0, d.hs, d.t - r0);
            self.gemm_ptrs(what, (true, false), m, a.scale, &ds, &q, 0.0, &dk);
        }
    }

    fn fused_attention(&self, hs: usize, dt: Dtype) -> FusedAttention {
        // The kernels hold a head in 64 columns of 16-bit values and multiply on the tensor
        // cores (flash_* in kernels.cu).
        if dt != Dtype::F32 && hs <= FLASH_MAX_HEAD && self.eng.mma_16bit() {
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
        let mut args = vec![Arg::Ptr(self.ptr(out)), Arg::Ptr(self.ptr(lse))];
        args.extend(self.flash_args(qkv, d));
        // Four warps of 16 query rows, or two of 32, per block of FLASH_ROWS rows.
        let (kernel, threads) = FlashWarpRows::pick(
            self.flash_warp_rows.forward,
            K::flash_forward,
            K::flash_forward_wide,
        );
        self.launch(kernel, dt, Self::flash_grid(d), threads, 0, &args);
    }

    fn attention_backward(
        &mut self,
        dqkv: Span,
        dout: Span,
        out: Span,
        lse: Span,
        qkv: Span,
        d: AttnDims,
    ) {
        let dt = self.fused_dtype(d, &[dqkv, dout, out, qkv], "attention_backward");
        assert!(
            dqkv.len == qkv.len && dout.len == out.len && lse.len == d.b * d.nh * d.t,
            "attention_backward: lengths"
        );
        let delta = self.scratch(|s| &mut s.attn_delta, 4 * lse.len);
        if self.flash_backward == FlashBackward::Fused {
            return self.attention_backward_one_kernel(dt, delta, dqkv, dout, out, lse, qkv, d);
        }
        let (grid, tail) = (Self::flash_grid(d), self.flash_args(qkv, d));
        let (dq, dy, y, l) = (self.ptr(dqkv), self.ptr(dout), self.ptr(out), self.ptr(lse));
        let mut args = vec![
            Arg::Ptr(dq),
            Arg::Ptr(delta),
            Arg::Ptr(dy),
            Arg::Ptr(y),
            Arg::Ptr(l),
        ];
        args.extend(tail.iter().copied());
        // The wide kernels keep two 64-row tiles (Q and dO, or K and V) in dynamic shared
        // memory.
        let rows = self.flash_warp_rows;
        let shmem = |r: usize| if r == 32 { FLASH_KV_SHMEM } else { 0 };
        let (k, threads) =
            FlashWarpRows::pick(rows.dq, K::flash_backward_dq, K::flash_backward_dq_wide);
        self.launch(k, dt, grid, threads, shmem(rows.dq), &args);
        let mut args = vec![Arg::Ptr(dq), Arg::Ptr(delta), Arg::Ptr(dy), Arg::Ptr(l)];
        args.extend(tail);
        let (k, threads) =
            FlashWarpRows::pick(rows.dkv, K::flash_backward_dkv, K::flash_backward_dkv_wide);
        self.launch(k, dt, grid, threads, shmem(rows.dkv), &args);
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
        self.launch_rows(K::ce_finish, self.dt(logits), d.n, 0, &args);
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

/// `1/√hs`, the value the CPU op uses.
/// Threads per block of the fused attention kernels (`FA_THREADS`) and the largest head they
/// hold (`FA_D`); a block owns `FLASH_ROWS` query rows or keys (`FA_ROWS`).
const FLASH_THREADS: u32 = 128;
/// Row stride of the fused kernels' shared-memory tiles, in elements (`FA_LDS`).
const FLASH_LDS: u32 = 72;
/// Dynamic shared memory of the wide backward attention kernels (`FA_REREAD`): two tiles (Q
/// and dO, or K and V) of `FLASH_ROWS` rows of 16-bit elements.
const FLASH_KV_SHMEM: u32 = 2 * FLASH_ROWS as u32 * FLASH_LDS * 2;
/// Dynamic shared memory of the one-kernel attention backward: K, V and dS.
const FLASH_FUSED_SHMEM: u32 = 3 * FLASH_ROWS as u32 * FLASH_LDS * 2;
const FLASH_MAX_HEAD: usize = 64;
const FLASH_ROWS: usize = 64;

impl CudaBackend {
    /// The common storage type of the fused attention's tensors, checked.
    fn fused_dtype(&self, d: AttnDims, spans: &[Span], what: &str) -> Dtype {
        let dt = self.dt(spans[0]);
        assert!(
            spans.iter().all(|&s| self.dt(s) == dt)
                && self.fused_attention(d.hs, dt) != FusedAttention::Unsupported,
            "{what}: no fused attention for head size {} in {}",
            d.hs,
            dt.name()
        );
        dt
    }

    /// The fused attention's backward pass as one kernel ([`FlashBackward::Fused`]): Δ and
    /// the kernel's counters zeroed by `flash_backward_prep`, then `flash_backward_fused` with
    /// an f32 accumulator tile per query block (64 × 64: 16 KB, 50 MB for GPT-2 124M B=16).
    #[allow(clippy::too_many_arguments)]
    fn attention_backward_one_kernel(
        &mut self,
        dt: Dtype,
        delta: u64,
        dqkv: Span,
        dout: Span,
        out: Span,
        lse: Span,
        qkv: Span,
        d: AttnDims,
    ) {
        // One query block (and one work item) per tile of the grid.
        let tiles = Self::flash_grid(d) as usize;
        // The kernel's item counter and turns are ints.
        assert!(
            tiles < i32::MAX as usize,
            "attention_backward: {tiles} tiles"
        );
        let acc_bytes = tiles * FLASH_ROWS * FLASH_MAX_HEAD * 4;
        let acc = self.scratch(|s| &mut s.attn_dq, acc_bytes + 4 * (1 + tiles));
        let sync = acc + acc_bytes as u64;
        let (dy, y) = (self.ptr(dout), self.ptr(out));
        let args = [
            Arg::Ptr(delta),
            Arg::Ptr(sync),
            Arg::I64(1 + tiles as i64),
            Arg::Ptr(dy),
            Arg::Ptr(y),
            Arg::I64(d.b as i64),
            Arg::I64(d.t as i64),
            Arg::I64(d.nh as i64),
            Arg::I64(d.hs as i64),
        ];
        // 8 threads per row.
        let grid = (8 * lse.len).div_ceil(ELEM_THREADS as usize) as u64;
        self.launch(K::flash_backward_prep, dt, grid, ELEM_THREADS, 0, &args);
        let mut args = vec![
            Arg::Ptr(self.ptr(dqkv)),
            Arg::Ptr(delta),
            Arg::Ptr(dy),
            Arg::Ptr(self.ptr(lse)),
        ];
        args.extend(self.flash_args(qkv, d));
        args.extend([Arg::Ptr(acc), Arg::Ptr(sync)]);
        let (k, threads) = FlashWarpRows::pick(
            self.flash_warp_rows.dkv,
            K::flash_backward_fused,
            K::flash_backward_fused_wide,
        );
        self.launch(k, dt, tiles as u64, threads, FLASH_FUSED_SHMEM, &args);
    }

    /// One block per (64-row block, sequence, head); [`Self::launch`] caps the grid at the
    /// engine's limit and the kernels loop over the rest.
    fn flash_grid(d: AttnDims) -> u64 {
        (d.t.div_ceil(FLASH_ROWS) * d.b * d.nh) as u64
    }

    /// The fused kernels' trailing arguments: qkv, B, T, nh, hs, scale.
    fn flash_args(&self, qkv: Span, d: AttnDims) -> [Arg; 6] {
        assert_eq!(
            qkv.len,
            d.b * d.t * 3 * d.nh * d.hs,
            "fused attention: qkv length"
        );
        [
            Arg::Ptr(self.ptr(qkv)),
            Arg::I64(d.b as i64),
            Arg::I64(d.t as i64),
            Arg::I64(d.nh as i64),
            Arg::I64(d.hs as i64),
            Arg::F32(attention_scale(d.hs)),
        ]
    }
}

fn attention_scale(hs: usize) -> f32 {
    crate::ops::attention::scale::<f32>(hs)
}

fn check_ce(logits: Span, d: CeDims) {
    assert!(
        d.vp > 0 && d.v_valid <= d.vp,
        "cross-entropy: bad vocabulary sizes {d:?}"
    );
    assert_eq!(logits.len, d.n * d.vp, "cross-entropy: logits length");
}

/// A GEMM operand: device address, leading dimension, batch stride (elements) and type.
type Mat = (u64, usize, usize, Dtype);

/// The cuBLAS (column-major) call computing the row-major `C = alpha·op(A)·op(B) + beta·C`
/// (C m×n, `ta`/`tb`: A stored k×m, B stored n×k): `Cᵀ = op(B)ᵀ·op(A)ᵀ`, so A and B swap
/// places and m and n swap.
#[allow(clippy::too_many_arguments)]
fn column_major(
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, lda, sa, at): Mat,
    (b, ldb, sb, bt): Mat,
    beta: f32,
    (c, ldc, sc, ct): Mat,
    batch: usize,
) -> GemmCall {
    GemmCall {
        a_type: bt,
        b_type: at,
        c_type: ct,
        trans_a: tb,
        trans_b: ta,
        m: n,
        n: m,
        k,
        alpha,
        a: b,
        lda: ldb,
        stride_a: sb,
        b: a,
        ldb: lda,
        stride_b: sa,
        beta,
        c,
        ldc,
        stride_c: sc,
        batch,
        epilogue: Epilogue::None,
    }
}

/// GEMM operands given one pointer per matrix: device addresses, leading dimension, type.
type Ptrs = (Vec<u64>, usize, Dtype);

/// Rows per block of the causal attention GEMMs for sequence length `t` (a multiple of 8, which
/// keeps row offsets 16-byte aligned for 16-bit types; `t` itself when not blocked).
fn causal_block_rows(t: usize) -> usize {
    if t >= CAUSAL_MIN_T {
        t.div_ceil(CAUSAL_BLOCKS).next_multiple_of(8)
    } else {
        t.max(1)
    }
}

/// The row blocks `(r0, r1)` of the causal attention GEMMs for sequence length `t`: each query
/// block is multiplied with the keys up to its own last row only, so the probabilities and
/// their gradients above the diagonal are read (and must be zero) only inside the diagonal
/// block, which is all the softmax kernels zero.
fn causal_blocks(t: usize) -> Vec<(usize, usize)> {
    let rows = causal_block_rows(t);
    (0..t)
        .step_by(rows.max(1))
        .map(|r0| (r0, (r0 + rows).min(t)))
        .collect()
}

/// The matrices of one attention call for the batched GEMMs: every (sequence, head) pair at
/// once, placed by [`Heads`] (the layouts of `ops/attention.rs`), as [`Ptrs`] starting at a
/// given row and column.
struct Attn {
    att: u64,
    qkv: u64,
    /// Storage type of `att`, `qkv` and every (B, T, C) tensor of the call (one type).
    dt: Dtype,
    d: AttnDims,
    scale: f32,
}

/// A sequence's heads as a [`Heads`] layout: the base address, leading dimension and stride
/// between heads.
fn heads_at(base: u64, dt: Dtype, h: Heads) -> Mat {
    (base + (dt.bytes() * h.offset) as u64, h.ld, h.stride, dt)
}

impl Attn {
    fn new(be: &CudaBackend, att: Span, qkv: Span, d: AttnDims) -> Attn {
        let c = d.nh * d.hs;
        assert_eq!(att.len, d.b * d.nh * d.t * d.t, "attention: att length");
        assert_eq!(qkv.len, d.b * d.t * 3 * c, "attention: qkv length");
        let dt = be.dt(qkv);
        assert_eq!(be.dt(att), dt, "attention: att and qkv types differ");
        Attn {
            att: be.ptr(att),
            qkv: be.ptr(qkv),
            dt,
            d,
            scale: attention_scale(d.hs),
        }
    }

    /// Element (row0, col0) of every head of every sequence, for per-sequence layouts `m`.
    fn every_head(&self, m: impl Fn(usize) -> Mat, row0: usize, col0: usize) -> Ptrs {
        let mut ptrs = Vec::with_capacity(self.d.b * self.d.nh);
        let mut ld = 0;
        for bi in 0..self.d.b {
            let (base, l, stride, dt) = m(bi);
            ld = l;
            let at = |h: usize| base + (dt.bytes() * (h * stride + row0 * l + col0)) as u64;
            ptrs.extend((0..self.d.nh).map(at));
        }
        (ptrs, ld, self.dt)
    }

    /// Part `part` (0 Q, 1 K, 2 V) of every head, from row `row0`.
    fn qkv(&self, part: usize, row0: usize) -> Ptrs {
        let d = self.d;
        let f = |bi| heads_at(self.qkv, self.dt, Heads::qkv(bi, part, d.t, d.nh, d.hs));
        self.every_head(f, row0, 0)
    }

    /// `att` of every head from element (row0, col0).
    fn att_at(&self, row0: usize, col0: usize) -> Ptrs {
        let d = self.d;
        self.every_head(
            |bi| heads_at(self.att, self.dt, Heads::att(bi, d.t, d.nh)),
            row0,
            col0,
        )
    }

    /// A (B, T, C) tensor as per-sequence head layouts.
    fn btc(&self, be: &CudaBackend, s: Span) -> impl Fn(usize) -> Mat {
        let d = self.d;
        assert_eq!(
            s.len,
            d.b * d.t * d.nh * d.hs,
            "attention: (B, T, C) length"
        );
        let (p, dt) = (be.ptr(s), be.dt(s));
        assert_eq!(dt, self.dt, "attention: (B, T, C) tensor of another type");
        move |bi| heads_at(p, dt, Heads::btc(bi, d.t, d.nh, d.hs))
    }

    /// Every head of a (B, T, C) tensor ([`Self::btc`]) from row `row0`.
    fn rows_of(&self, m: &impl Fn(usize) -> Mat, row0: usize) -> Ptrs {
        self.every_head(m, row0, 0)
    }
}

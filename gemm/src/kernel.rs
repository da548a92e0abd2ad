//! Micro-kernel descriptors and run-time ISA selection.
//!
//! The contract every kernel implements is written down in `docs/KERNELS.md`.

use crate::arch;
use crate::error::GemmError;
use crate::precision::Precision;
use std::fmt;

/// Signature of a micro-kernel (see `docs/KERNELS.md`).
///
/// `k, alpha, a (k*mr packed words), b (k*nr packed words), beta, c (column-major mr×nr f32
/// tile), ldc`. A packed word is 32 bits: one `f32`, or a pair of `bf16` for an
/// [`Operand::Bf16Pairs`] kernel, whose `k` then counts pairs.
pub type KernelFn = unsafe fn(usize, f32, *const f32, *const f32, f32, *mut f32, usize);

/// What one 32-bit word of a kernel's packed panels holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Operand {
    /// One `f32` element (the layouts of `docs/KERNELS.md`).
    F32,
    /// Two `bf16` elements adjacent along k: word `(q, r)` of Ã holds `A(r, 2q)` in its low
    /// half and `A(r, 2q + 1)` in its high half (B̃ likewise), an odd k padded with a zero.
    Bf16Pairs,
    /// f16 elements. Ã is dense: element `(p, r)` is half-word `p·mr + r` (two rows per word,
    /// `mr` even). B̃ has one element per word, in both halves, so that a 32-bit broadcast
    /// (`ld1rw`) fills every f16 lane with it: word `(p, j)` at `p·nr + j`.
    F16,
}

/// Which of the two packed operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Ã, panels `mr` rows tall.
    A,
    /// B̃, panels `nr` columns wide.
    B,
}

impl Operand {
    /// The micro-kernel's `k` argument for `k` elements along k (bf16 pairs count pairs).
    pub fn k_steps(self, k: usize) -> usize {
        k.div_ceil(self.k_per_word())
    }

    /// Packed words of one `w`-wide panel over `k` elements.
    pub fn panel_words(self, side: Side, k: usize, w: usize) -> usize {
        match (self, side) {
            (Operand::F16, Side::A) => k * w.div_ceil(2),
            _ => self.k_steps(k) * w,
        }
    }

    /// Elements along k that take the L1 space one f32 element does in the panels (the block
    /// sizes are derived for f32 words): 2 for bf16 pairs; 1 for f16, whose Ã micro-panels
    /// are twice as tall (`mr` counts f16 lanes) and B̃ keeps a word per element.
    pub fn k_per_word(self) -> usize {
        match self {
            Operand::Bf16Pairs => 2,
            Operand::F32 | Operand::F16 => 1,
        }
    }
}

/// Instruction sets fugu-gemm has micro-kernels for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Isa {
    /// Plain Rust, auto-vectorised by the compiler. Always available.
    Portable,
    /// x86-64 AVX2 + FMA.
    Avx2,
    /// x86-64 AVX-512F.
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
    /// aarch64 SVE, vector-length agnostic.
    Sve,
}

impl Isa {
    /// Every ISA, in order of preference (best last).
    pub const ALL: [Isa; 5] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Neon, Isa::Sve];

    /// The lower-case name used by `FUGU_GEMM_ISA` and `--isa`.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
            Isa::Sve => "sve",
        }
    }

    /// Parses a name as accepted by `FUGU_GEMM_ISA`.
    pub fn parse(s: &str) -> Result<Isa, GemmError> {
        let t = s.trim().to_ascii_lowercase();
        Isa::ALL
            .iter()
            .copied()
            .find(|i| i.name() == t)
            .ok_or_else(|| GemmError::Config {
                what: "ISA".into(),
                value: s.to_string(),
                expected: "one of portable, avx2, avx512, neon, sve".into(),
            })
    }

    /// FP32 lanes of one FMA on this ISA's widest register (used for the peak-FLOP estimate).
    pub fn f32_lanes(self) -> usize {
        match self {
            Isa::Portable => 4,
            Isa::Avx2 => 8,
            Isa::Avx512 => 16,
            Isa::Neon => 4,
            Isa::Sve => arch::sve_f32_lanes().unwrap_or(4),
        }
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Products summed per f16 chunk by kernels that accumulate in f16 ([`Accumulation::F16Chunks`]):
/// A64FX has no widening f16 -> f32 FMA, so its 2x-f32 rate needs f16 accumulators; every
/// `F16_CHUNK` products they are added into f32 and restarted. A chunk of c products sums in f16
/// with an error of at most about c·u of the sum of their magnitudes (u = 2^-11; about
/// sqrt(c)·u for random signs). The fold costs a fixed ~120 cycles per chunk on A64FX
/// (`scripts/predict-a64fx.sh` with `FUGU_MCA_CHUNK`): 64 gives 84% FMA-pipe utilisation over a
/// chunk, 128 gives 91% (the k loop alone: 99.9%), at a worst-case chunk error of 6%, 0.5%
/// typical. The trade-off and the training curves it gives are in `docs/KERNELS.md`.
pub const F16_CHUNK: usize = 128;

/// How a kernel sums its products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Accumulation {
    /// In f32 registers.
    F32,
    /// In f16, folded into f32 every `n` products (see [`F16_CHUNK`]).
    F16Chunks(usize),
}

/// A micro-kernel together with its register-tile shape and packed operand format.
#[derive(Clone, Copy)]
pub struct Kernel {
    /// What the packed panels hold.
    pub operand: Operand,
    /// How the products are summed.
    pub accumulation: Accumulation,
    /// The instruction set the kernel uses.
    pub isa: Isa,
    /// Rows of the C tile (the vectorised dimension).
    pub mr: usize,
    /// Columns of the C tile.
    pub nr: usize,
    /// The kernel itself. Callable only under the contract in `docs/KERNELS.md`.
    pub func: KernelFn,
}

impl fmt::Debug for Kernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Kernel({} {}x{} {:?})",
            self.isa, self.mr, self.nr, self.operand
        )
    }
}

/// The kernel for `isa`, or `None` when this CPU cannot run it.
pub fn kernel_for(isa: Isa) -> Option<Kernel> {
    match isa {
        Isa::Portable => Some(arch::portable::kernel()),
        Isa::Avx2 => arch::avx2_kernel(),
        Isa::Avx512 => arch::avx512_kernel(),
        Isa::Neon => arch::neon_kernel(),
        Isa::Sve => arch::sve_kernel(),
    }
}

/// The kernel that runs `isa`'s GEMMs at `prec`: a native 16-bit kernel where this CPU has
/// one (`vdpbf16ps` for bf16 on AVX-512 BF16; f16 chunks on SVE), otherwise `isa`'s `f32`
/// kernel, fed operands that the packing rounds to `prec` (the same products, see
/// [`Precision`]). `None` when this CPU cannot run `isa`.
pub fn kernel_for_precision(isa: Isa, prec: Precision) -> Option<Kernel> {
    let native = match (isa, prec) {
        (Isa::Avx512, Precision::Bf16) => arch::avx512_bf16_kernel(),
        (Isa::Sve, Precision::F16) => arch::sve_f16_kernel(),
        _ => None,
    };
    native.or_else(|| kernel_for(isa))
}

/// The kernel of a runtime whose f32 kernel is `f32_kernel` for GEMMs at `prec`, with the f16
/// accumulation `f16_chunked` asks for ([`crate::RuntimeConfig::f16_chunked`]): the native
/// kernel of `prec` where there is one, the portable f16-chunk emulation when chunks are asked
/// for and there is no native f16 kernel, the f32 kernel when f32 accumulation is asked for.
pub fn kernel_at(f32_kernel: Kernel, prec: Precision, f16_chunked: Option<bool>) -> Kernel {
    let native = kernel_for_precision(f32_kernel.isa, prec).unwrap_or(f32_kernel);
    match (prec, f16_chunked) {
        (Precision::F16, Some(false)) => f32_kernel,
        (Precision::F16, Some(true)) if native.accumulation == Accumulation::F32 => {
            arch::portable::f16_chunked_kernel()
        }
        _ => native,
    }
}

/// The kernel of each precision, in the order of [`Precision::ALL`] ([`kernel_at`]).
pub fn kernels_at(f32_kernel: Kernel, f16_chunked: Option<bool>) -> [Kernel; 3] {
    Precision::ALL.map(|p| kernel_at(f32_kernel, p, f16_chunked))
}

/// One line naming the kernel of each precision (`kernels` in the order of
/// [`Precision::ALL`]): `f32: avx512 32x12 F32 words; bf16: ...`.
pub fn describe_kernels(kernels: &[Kernel; 3]) -> String {
    Precision::ALL
        .iter()
        .zip(kernels)
        .map(|(p, k)| {
            let acc = match k.accumulation {
                Accumulation::F32 => String::new(),
                Accumulation::F16Chunks(c) => format!(", f16 sums in chunks of {c}"),
            };
            format!(
                "{p}: {} {}x{} {:?} words{acc}",
                k.isa, k.mr, k.nr, k.operand
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every ISA this CPU can run, in order of preference (best last).
pub fn available_isas() -> Vec<Isa> {
    Isa::ALL
        .iter()
        .copied()
        .filter(|&i| kernel_for(i).is_some())
        .collect()
}

/// The best kernel this CPU can run.
pub fn best_kernel() -> Kernel {
    for isa in [Isa::Sve, Isa::Avx512, Isa::Avx2, Isa::Neon] {
        if let Some(k) = kernel_for(isa) {
            return k;
        }
    }
    arch::portable::kernel()
}

/// The kernel for a forced ISA, with an error naming the ISA when this CPU cannot run it.
pub fn forced_kernel(isa: Isa) -> Result<Kernel, GemmError> {
    kernel_for(isa).ok_or_else(|| GemmError::Config {
        what: "ISA".into(),
        value: isa.name().into(),
        expected: format!(
            "an ISA this CPU supports ({})",
            available_isas()
                .iter()
                .map(|i| i.name())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

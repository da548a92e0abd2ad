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
    /// The packed micro-panel the macro-kernel keeps in L1 from one call of this kernel to the
    /// next, while the other one streams through L1 from an L2-resident block
    /// ([`crate::Blocking::nb`], `docs/KERNELS.md`): [`Side::B`] walks the whole Ã block
    /// under one B̃ micro-panel; [`Side::A`] walks `nb` columns of B̃ under one Ã micro-panel
    /// (BLIS's order: the vector-loaded panel stays, the broadcast one, `nr` words per k step
    /// against `mr`, streams). Chosen per kernel, where it was measured (the kernel's module docs).
    pub l1_panel: Side,
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
    native_16bit_kernel(isa, prec).or_else(|| kernel_for(isa))
}

/// The native 16-bit kernel of `isa` at `prec` on this CPU (`vdpbf16ps` for bf16 on AVX-512
/// BF16; f16 chunks on SVE), if there is one.
fn native_16bit_kernel(isa: Isa, prec: Precision) -> Option<Kernel> {
    match (isa, prec) {
        (Isa::Avx512, Precision::Bf16) => arch::avx512_bf16_kernel(),
        (Isa::Sve, Precision::F16) => arch::sve_f16_kernel(),
        _ => None,
    }
}

/// The kernels a runtime uses: its f32 kernel, and the ISA whose native 16-bit kernels it may
/// use for bf16/f16 GEMMs (not always the f32 kernel's: on Zen 4 the f32 kernel is AVX2 while
/// bf16 still has AVX-512 BF16's `vdpbf16ps`, see [`best_kernel`]).
#[derive(Clone, Copy, Debug)]
pub struct KernelChoice {
    pub f32: Kernel,
    pub native_isa: Isa,
    /// Whether bf16 GEMMs run the native bf16 kernel unless told ([`native_bf16_pays`], or
    /// an ISA forced: that ISA's kernels).
    pub bf16_native_by_default: bool,
}

impl KernelChoice {
    /// `forced`: that ISA's kernels for every precision (an error naming it when this CPU
    /// cannot run it); otherwise [`best_kernel`] for f32 and the widest ISA's native 16-bit
    /// kernels.
    pub fn new(forced: Option<Isa>) -> Result<KernelChoice, GemmError> {
        Ok(match forced {
            Some(isa) => KernelChoice {
                f32: forced_kernel(isa)?,
                native_isa: isa,
                bf16_native_by_default: true,
            },
            None => KernelChoice {
                f32: best_kernel(),
                native_isa: widest_kernel().isa,
                bf16_native_by_default: native_bf16_pays(),
            },
        })
    }

    /// The kernel for GEMMs at `prec`, with the f16 accumulation `f16_chunked` asks for
    /// ([`crate::RuntimeConfig::f16_chunked`]) and the bf16 kernel `bf16_native` asks for
    /// ([`crate::RuntimeConfig::bf16_native`]; unset: [`Self::bf16_native_by_default`]): the
    /// native kernel of `prec` where there is one (and bf16's is not declined), the portable
    /// f16-chunk emulation when chunks are
    /// asked for and there is no native f16 kernel, the f32 kernel (fed operands that the
    /// packing rounds to `prec`) otherwise.
    pub fn at(
        &self,
        prec: Precision,
        f16_chunked: Option<bool>,
        bf16_native: Option<bool>,
    ) -> Kernel {
        let native = native_16bit_kernel(self.native_isa, prec).unwrap_or(self.f32);
        match (prec, f16_chunked, bf16_native) {
            (Precision::Bf16, _, Some(false)) => self.f32,
            (Precision::Bf16, _, None) if !self.bf16_native_by_default => self.f32,
            (Precision::F16, Some(false), _) => self.f32,
            (Precision::F16, Some(true), _) if native.accumulation == Accumulation::F32 => {
                arch::portable::f16_chunked_kernel()
            }
            _ => native,
        }
    }

    /// The kernel of each precision, in the order of [`Precision::ALL`] ([`Self::at`]).
    pub fn all(&self, f16_chunked: Option<bool>, bf16_native: Option<bool>) -> [Kernel; 3] {
        Precision::ALL.map(|p| self.at(p, f16_chunked, bf16_native))
    }
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

/// The f32 kernel of the widest vector ISA this CPU can run.
fn widest_kernel() -> Kernel {
    for isa in [Isa::Sve, Isa::Avx512, Isa::Avx2, Isa::Neon] {
        if let Some(k) = kernel_for(isa) {
            return k;
        }
    }
    arch::portable::kernel()
}

/// The best f32 kernel for this CPU: the widest ISA's, except on a CPU whose 512-bit FMAs do
/// no more FLOPs than its 256-bit ones ([`avx512_doubles_flops`]), where the AVX2 16 × 6
/// kernel is faster: on Zen 4 it measured 0–7% faster than the AVX-512 32 × 12 one on one
/// core and up to 30% on two (`examples/blocking`), and the GPT-2 124M training step 3–9%
/// faster (`docs/KERNELS.md`, "Measured (Zen 4: AVX2, AVX-512 and OpenBLAS)").
pub fn best_kernel() -> Kernel {
    let widest = widest_kernel();
    if widest.isa == Isa::Avx512 && !avx512_doubles_flops() {
        if let Some(k) = kernel_for(Isa::Avx2) {
            return k;
        }
    }
    widest
}

/// Whether this CPU's native bf16 kernel (AVX-512 BF16's `vdpbf16ps`) beats its f32 kernel on
/// bf16-rounded operands, so that bf16 GEMMs run it by default. Not on Intel's AVX512_BF16
/// parts (Cooper Lake, Sapphire, Emerald and Granite Rapids): `vdpbf16ps` issues on one port
/// where f32 FMAs issue on two, so the two peaks are equal and the bf16 pack costs more; on 2
/// Sapphire Rapids vCPUs the f32 kernel ran the MLP's 4096 × 3072 × 768 on bf16 operands at
/// 107–208 GFLOP/s (median 163) against the native kernel's 85–121 (112), runs alternated,
/// and a GPT-2 124M B=8 bf16 step in 56.1 s against 68.1. On AMD (Zen 4 and 5) `vdpbf16ps`
/// has twice the f32 FMA's rate: the native kernel measured 1.4–2× faster.
pub fn native_bf16_pays() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        &x86_vendor() != b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
}

/// The CPU vendor's 12-byte CPUID string (`GenuineIntel`, `AuthenticAMD`).
#[cfg(target_arch = "x86_64")]
fn x86_vendor() -> [u8; 12] {
    let v = std::arch::x86_64::__cpuid(0);
    let mut vendor = [0u8; 12];
    for (i, r) in [v.ebx, v.edx, v.ecx].iter().enumerate() {
        vendor[4 * i..4 * i + 4].copy_from_slice(&r.to_le_bytes());
    }
    vendor
}

/// The x86 family of a CPUID leaf-1 `eax` (base family, plus the extended family when the
/// base is 0xF).
pub fn x86_family(eax: u32) -> u32 {
    let base = (eax >> 8) & 0xF;
    if base == 0xF {
        base + ((eax >> 20) & 0xFF)
    } else {
        base
    }
}

/// Whether this CPU's AVX-512 FMAs do twice the FLOPs of its AVX2 ones. Not so on AMD family
/// 19h (Zen 4, the only family-19h parts with AVX-512): each 512-bit operation runs as two
/// 256-bit halves on the same two FMA pipes, so the FMA-loop peak is the same for both ISAs
/// (117.6 and 117.8 GFLOP/s per core measured on one). Intel's AVX-512 parts and Zen 5
/// (family 1Ah, a full 512-bit datapath) do double it.
pub fn avx512_doubles_flops() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let family = x86_family(std::arch::x86_64::__cpuid(1).eax);
        !(&x86_vendor() == b"AuthenticAMD" && family == 0x19)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        true
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x86_families_of_known_cpuid_signatures() {
        assert_eq!(x86_family(0x00A0_0F11), 0x19); // Zen 3 (EPYC 7003)
        assert_eq!(x86_family(0x00A1_0F11), 0x19); // Zen 4 (EPYC 9004)
        assert_eq!(x86_family(0x00B0_0F21), 0x1A); // Zen 5 (EPYC 9005)
        assert_eq!(x86_family(0x0005_0654), 6); // Skylake-SP
    }

    /// The f32 kernel is AVX2 exactly where AVX-512 would be chosen but buys no FLOPs, and
    /// the native 16-bit kernels still come from the widest ISA unless one is forced.
    #[test]
    fn the_choice_keeps_native_16bit_kernels() {
        let widest = widest_kernel();
        let choice = KernelChoice::new(None).unwrap();
        let want_f32 = if widest.isa == Isa::Avx512 && !avx512_doubles_flops() {
            Isa::Avx2
        } else {
            widest.isa
        };
        assert_eq!(choice.f32.isa, want_f32);
        assert_eq!(choice.native_isa, widest.isa);
        // The native bf16 kernel where there is one, asked for or where it pays by default
        // (not on Intel: `native_bf16_pays`).
        assert_eq!(choice.bf16_native_by_default, native_bf16_pays());
        for ask in [None, Some(true)] {
            let bf16 = choice.at(Precision::Bf16, None, ask);
            match native_16bit_kernel(widest.isa, Precision::Bf16) {
                Some(k) if ask.unwrap_or(native_bf16_pays()) => {
                    assert_eq!((bf16.isa, bf16.operand), (k.isa, k.operand))
                }
                _ => assert_eq!(
                    (bf16.isa, bf16.operand),
                    (choice.f32.isa, choice.f32.operand)
                ),
            }
        }
        // Declining the native bf16 kernel (FUGU_GEMM_BF16=f32) gives the f32 kernel, and
        // leaves the other precisions' kernels as they were.
        let declined = choice.at(Precision::Bf16, None, Some(false));
        assert_eq!(
            (declined.isa, declined.operand),
            (choice.f32.isa, choice.f32.operand)
        );
        for p in [Precision::F32, Precision::F16] {
            let (a, b) = (choice.at(p, None, Some(false)), choice.at(p, None, None));
            assert_eq!((a.isa, a.operand, a.mr), (b.isa, b.operand, b.mr));
        }
        for isa in available_isas() {
            let forced = KernelChoice::new(Some(isa)).unwrap();
            assert!(forced
                .all(None, None)
                .iter()
                .all(|k| k.isa == isa
                    || (k.isa == Isa::Portable && k.accumulation != Accumulation::F32)));
        }
    }
}

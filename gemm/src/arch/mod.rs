//! Micro-kernels, one file per ISA. Each file exposes a constructor that returns `None` when the
//! running CPU lacks the instructions. All `unsafe` SIMD code of the crate lives here.

use crate::kernel::Kernel;

pub mod fma_peak;
pub mod portable;
pub mod prefetch;
pub mod transpose;

#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;

#[cfg(target_arch = "aarch64")]
mod aarch64_neon;
#[cfg(target_arch = "aarch64")]
mod aarch64_sve;

/// AVX2+FMA kernel, if the CPU has it.
pub fn avx2_kernel() -> Option<Kernel> {
    #[cfg(target_arch = "x86_64")]
    {
        x86_avx2::kernel()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// AVX-512F kernel, if the CPU has it.
pub fn avx512_kernel() -> Option<Kernel> {
    #[cfg(target_arch = "x86_64")]
    {
        x86_avx512::kernel()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// AVX-512 BF16 kernel (`vdpbf16ps`, bf16 pairs), if the CPU has AVX-512F and AVX512_BF16.
pub fn avx512_bf16_kernel() -> Option<Kernel> {
    #[cfg(target_arch = "x86_64")]
    {
        x86_avx512::bf16_kernel()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// NEON kernel, if the CPU has it.
pub fn neon_kernel() -> Option<Kernel> {
    #[cfg(target_arch = "aarch64")]
    {
        aarch64_neon::kernel()
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        None
    }
}

/// SVE kernel, if the CPU has it.
pub fn sve_kernel() -> Option<Kernel> {
    #[cfg(target_arch = "aarch64")]
    {
        aarch64_sve::kernel()
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        None
    }
}

/// SVE f16 kernel (f16 chunks folded into f32), if the CPU has SVE.
pub fn sve_f16_kernel() -> Option<Kernel> {
    #[cfg(target_arch = "aarch64")]
    {
        aarch64_sve::f16_kernel()
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        None
    }
}

/// Number of f32 lanes in one SVE vector, if the CPU has SVE.
pub fn sve_f32_lanes() -> Option<usize> {
    #[cfg(target_arch = "aarch64")]
    {
        aarch64_sve::f32_lanes()
    }
    #[cfg(not(target_arch = "aarch64"))]
    {
        None
    }
}

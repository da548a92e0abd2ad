//! Tight loops of independent FMAs, used to measure a core's FP32 FMA throughput (the "peak"
//! that benchmarks and the trainer report against). Each loop keeps enough independent
//! accumulators to cover FMA latency on every supported core and returns the number of FLOPs
//! it executed.

use crate::kernel::Isa;
use crate::precision::Precision;

/// Runs `iters` iterations of the loop of `isa`'s native kernel at `prec` and returns the
/// FLOPs executed (a multiply and an add per product): the bf16 dot-product loop where this
/// CPU has AVX512_BF16, the f16 FMLA loop on SVE, otherwise `None` (the precision runs on the f32 FMAs: [`fma_loop`]).
pub fn native_loop(isa: Isa, prec: Precision, iters: u64) -> Option<f64> {
    match (isa, prec) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Precision::Bf16)
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16") =>
        {
            // SAFETY: both features checked just above.
            Some(unsafe { x86::avx512_bf16(iters) })
        }
        #[cfg(target_arch = "aarch64")]
        (Isa::Sve, Precision::F16) if std::arch::is_aarch64_feature_detected!("sve") => {
            // SAFETY: sve checked just above.
            Some(unsafe { aarch64::sve_f16(iters) })
        }
        _ => {
            let _ = iters;
            None
        }
    }
}

/// Runs `iters` iterations of the FMA loop for `isa` and returns the FLOPs executed, or `None`
/// when this CPU cannot run `isa`.
pub fn fma_loop(isa: Isa, iters: u64) -> Option<f64> {
    match isa {
        Isa::Portable => Some(portable(iters)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if is_x86_feature_detected!("avx512f") => {
            // SAFETY: avx512f checked just above.
            Some(unsafe { x86::avx512(iters) })
        }
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") => {
            // SAFETY: avx2 and fma checked just above.
            Some(unsafe { x86::avx2(iters) })
        }
        #[cfg(target_arch = "aarch64")]
        Isa::Neon if std::arch::is_aarch64_feature_detected!("neon") => Some(aarch64::neon(iters)),
        #[cfg(target_arch = "aarch64")]
        Isa::Sve if std::arch::is_aarch64_feature_detected!("sve") => {
            // SAFETY: sve checked just above.
            Some(unsafe { aarch64::sve(iters) })
        }
        _ => None,
    }
}

fn portable(iters: u64) -> f64 {
    let mut acc = [[1.0f32; 8]; 8];
    let x = std::hint::black_box(0.999_999f32);
    for _ in 0..iters {
        for row in acc.iter_mut() {
            for v in row.iter_mut() {
                *v = *v * x + 1e-7;
            }
        }
    }
    std::hint::black_box(acc);
    iters as f64 * 64.0 * 2.0
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn avx512(iters: u64) -> f64 {
        let mut acc = [_mm512_set1_ps(1.0); 16];
        let x = _mm512_set1_ps(std::hint::black_box(0.999_999));
        let y = _mm512_set1_ps(1e-7);
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, x, y);
            }
        }
        std::hint::black_box(acc);
        iters as f64 * 16.0 * 16.0 * 2.0
    }

    /// 16 independent `vdpbf16ps` chains: each adds 16 lanes × 2 products per instruction.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn avx512_bf16(iters: u64) -> f64 {
        let mut acc = [_mm512_set1_ps(1.0); 16];
        let x = _mm512_cvtne2ps_pbh(
            _mm512_set1_ps(std::hint::black_box(0.5)),
            _mm512_set1_ps(std::hint::black_box(-0.5)),
        );
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_dpbf16_ps(*a, x, x);
            }
        }
        std::hint::black_box(acc);
        iters as f64 * 16.0 * 16.0 * 4.0
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn avx2(iters: u64) -> f64 {
        let mut acc = [_mm256_set1_ps(1.0); 12];
        let x = _mm256_set1_ps(std::hint::black_box(0.999_999));
        let y = _mm256_set1_ps(1e-7);
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, x, y);
            }
        }
        std::hint::black_box(acc);
        iters as f64 * 12.0 * 8.0 * 2.0
    }
}

#[cfg(target_arch = "aarch64")]
mod aarch64 {
    use std::arch::aarch64::*;

    pub fn neon(iters: u64) -> f64 {
        // SAFETY: NEON is part of the aarch64 baseline.
        unsafe {
            let mut acc = [vdupq_n_f32(1.0); 16];
            let x = vdupq_n_f32(std::hint::black_box(0.999_999));
            let y = vdupq_n_f32(1e-7);
            for _ in 0..iters {
                for a in acc.iter_mut() {
                    *a = vfmaq_f32(y, *a, x);
                }
            }
            std::hint::black_box(acc);
        }
        iters as f64 * 16.0 * 4.0 * 2.0
    }

    /// 20 independent `fmla` chains on elements `$t` (`"s"` or `"h"`), `$n` (>= 1) iterations.
    macro_rules! sve_fmla_loop {
        ($t:literal, $n:expr) => {
            std::arch::asm!(
                "ptrue p0.b",
                concat!("fmov z30.", $t, ", #1.0"),
                concat!("fmov z31.", $t, ", #0.5"),
                "mov z0.d, z30.d", "mov z1.d, z30.d", "mov z2.d, z30.d", "mov z3.d, z30.d",
                "mov z4.d, z30.d", "mov z5.d, z30.d", "mov z6.d, z30.d", "mov z7.d, z30.d",
                "mov z8.d, z30.d", "mov z9.d, z30.d", "mov z10.d, z30.d", "mov z11.d, z30.d",
                "mov z12.d, z30.d", "mov z13.d, z30.d", "mov z14.d, z30.d", "mov z15.d, z30.d",
                "mov z16.d, z30.d", "mov z17.d, z30.d", "mov z18.d, z30.d", "mov z19.d, z30.d",
                "2:",
                concat!("fmla z0.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z1.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z2.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z3.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z4.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z5.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z6.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z7.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z8.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z9.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z10.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z11.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z12.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z13.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z14.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z15.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z16.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z17.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z18.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                concat!("fmla z19.", $t, ", p0/m, z30.", $t, ", z31.", $t),
                "subs {n}, {n}, #1",
                "b.ne 2b",
                n = inout(reg) $n => _,
                out("v0") _, out("v1") _, out("v2") _, out("v3") _, out("v4") _,
                out("v5") _, out("v6") _, out("v7") _, out("v8") _, out("v9") _,
                out("v10") _, out("v11") _, out("v12") _, out("v13") _, out("v14") _,
                out("v15") _, out("v16") _, out("v17") _, out("v18") _, out("v19") _,
                out("v30") _, out("v31") _, out("p0") _,
                options(nomem, nostack),
            )
        };
    }

    /// f32 lanes of one vector.
    #[target_feature(enable = "sve")]
    unsafe fn cntw() -> u64 {
        let lanes: u64;
        // SAFETY: cntw only reads the vector length.
        unsafe { std::arch::asm!("cntw {l}", l = out(reg) lanes, options(nomem, nostack, pure)) };
        lanes
    }

    #[target_feature(enable = "sve")]
    pub unsafe fn sve(iters: u64) -> f64 {
        // SAFETY: the loop touches only the listed z/p registers and the counter.
        unsafe { sve_fmla_loop!("s", iters.max(1)) };
        // SAFETY: SVE is enabled for this function.
        iters.max(1) as f64 * 20.0 * unsafe { cntw() } as f64 * 2.0
    }

    /// The f16 FMLA loop: twice the lanes of [`sve`] per instruction.
    #[target_feature(enable = "sve")]
    pub unsafe fn sve_f16(iters: u64) -> f64 {
        // SAFETY: the loop touches only the listed z/p registers and the counter.
        unsafe { sve_fmla_loop!("h", iters.max(1)) };
        // SAFETY: SVE is enabled for this function.
        iters.max(1) as f64 * 20.0 * 2.0 * unsafe { cntw() } as f64 * 2.0
    }
}

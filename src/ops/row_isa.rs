//! The one place that chooses the vector instruction set of the row kernels in `ops/`
//! (`fastmath.rs`, `adamw.rs`, `gelu.rs`), detected once per process, as fugu-gemm chooses its
//! micro-kernel: the kernels match on [`row_isa`] instead of each asking the CPU on every
//! call. Every variant runs the same arithmetic (the portable bodies compiled with wider
//! vectors), so results do not depend on it.
//!
//! On aarch64 the compiler cannot produce the SVE variant (under LLVM's generic tuning a
//! function with `#[target_feature(enable = "sve")]` keeps 128-bit NEON vectors, and the A64FX
//! build leaves the exponential a single dependency chain), so a CPU with SVE runs the
//! hand-written kernels of the `fugu-rows` crate instead ([`RowIsa::Sve`]): the same
//! functions, computed with SVE's own instructions (`fexpa`, FMAs, reciprocal estimates), so
//! they agree with the portable bodies to a few ulp rather than bit for bit (each kernel's
//! bound is tested against f64 in `rows/tests/sve.rs`, under QEMU at 128–2048 bits).
//! `scripts/predict-a64fx-rows.sh` compares all three on A64FX: the compiler's SVE, its NEON
//! and the hand-written kernels.

use std::sync::OnceLock;

/// Instruction sets the row kernels are compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowIsa {
    /// Plain Rust, auto-vectorised for the build target.
    Portable,
    /// x86-64 AVX2 with FMA.
    Avx2Fma,
    /// x86-64 AVX-512F.
    Avx512,
    /// aarch64 SVE: `fugu-rows`' hand-written kernels (the token proves the CPU has SVE).
    #[cfg(target_arch = "aarch64")]
    Sve(fugu_rows::sve::Sve),
}

impl RowIsa {
    /// Whether the kernels compute exactly what the portable bodies compute (the compiled
    /// variants do; the hand-written SVE kernels agree to a few ulp).
    pub fn bit_identical_to_portable(self) -> bool {
        match self {
            #[cfg(target_arch = "aarch64")]
            RowIsa::Sve(_) => false,
            _ => true,
        }
    }
}

/// The widest instruction set of [`RowIsa`] this CPU has (detected on first use). A variant
/// other than `Portable` is returned only where the CPU supports it, which is what the
/// kernels' `unsafe` calls of `#[target_feature]` functions rely on.
pub fn row_isa() -> RowIsa {
    static ISA: OnceLock<RowIsa> = OnceLock::new();
    *ISA.get_or_init(detect)
}

fn detect() -> RowIsa {
    #[cfg(target_arch = "aarch64")]
    if let Some(sve) = fugu_rows::sve::Sve::detect() {
        return RowIsa::Sve(sve);
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return RowIsa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return RowIsa::Avx2Fma;
        }
    }
    RowIsa::Portable
}

/// Defines `fn $name(args) -> ret` running `$body(args)` compiled for the widest [`RowIsa`] of
/// this CPU: the same body (an `#[inline(always)]` function of plain loops) under
/// `#[target_feature]`, so the compiler vectorises it for AVX-512 or AVX2. Rust never
/// contracts `a·b + c` into an FMA, so every variant computes the same numbers; a body that
/// reduces keeps its own fixed lane structure (the order of its sums) on every ISA. On a CPU
/// with SVE it calls `$sve(sve, args)`, the hand-written kernel of the same function.
macro_rules! dispatch_rows {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;
     sve = $sve:path;) => {
        $(#[$meta])*
        // Never inlined: called once per row or chunk, and `scripts/predict-a64fx-rows.sh`
        // finds each kernel's loop under its own symbol.
        #[inline(never)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            fn avx512($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            match $crate::ops::row_isa::row_isa() {
                // SAFETY: row_isa() returns Avx512 only on a CPU with AVX-512F, the only
                // requirement of this safe-bodied function compiled with that feature.
                #[cfg(target_arch = "x86_64")]
                $crate::ops::row_isa::RowIsa::Avx512 => unsafe { avx512($($arg),*) },
                // SAFETY: row_isa() returns Avx2Fma only on a CPU with AVX2 and FMA.
                #[cfg(target_arch = "x86_64")]
                $crate::ops::row_isa::RowIsa::Avx2Fma => unsafe { avx2($($arg),*) },
                #[cfg(target_arch = "aarch64")]
                $crate::ops::row_isa::RowIsa::Sve(sve) => $sve(&sve, $($arg),*),
                _ => $body($($arg),*),
            }
        }
    };
    // A kernel fugu-rows has no SVE form of yet: the portable body there.
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
        $(#[$meta])*
        #[inline(never)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            fn avx512($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) $(-> $ret)? {
                $body($($arg),*)
            }
            match $crate::ops::row_isa::row_isa() {
                // SAFETY: as above: Avx512 only on a CPU with AVX-512F.
                #[cfg(target_arch = "x86_64")]
                $crate::ops::row_isa::RowIsa::Avx512 => unsafe { avx512($($arg),*) },
                // SAFETY: Avx2Fma only on a CPU with AVX2 and FMA.
                #[cfg(target_arch = "x86_64")]
                $crate::ops::row_isa::RowIsa::Avx2Fma => unsafe { avx2($($arg),*) },
                _ => $body($($arg),*),
            }
        }
    };
}
pub(crate) use dispatch_rows;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_is_stable_and_only_claims_what_the_cpu_has() {
        let isa = row_isa();
        assert_eq!(isa, row_isa());
        #[cfg(target_arch = "x86_64")]
        match isa {
            RowIsa::Avx512 => assert!(std::arch::is_x86_feature_detected!("avx512f")),
            RowIsa::Avx2Fma => assert!(std::arch::is_x86_feature_detected!("fma")),
            RowIsa::Portable => {}
        }
        #[cfg(target_arch = "aarch64")]
        assert_eq!(
            matches!(isa, RowIsa::Sve(_)),
            std::arch::is_aarch64_feature_detected!("sve")
        );
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        assert_eq!(isa, RowIsa::Portable);
    }
}

//! The one place that chooses the vector instruction set of the row kernels in `ops/`
//! (`fastmath.rs`, `adamw.rs`, `gelu.rs`), detected once per process, as fugu-gemm chooses its
//! micro-kernel: the kernels match on [`row_isa`] instead of each asking the CPU on every
//! call. Every variant runs the same arithmetic (the portable bodies compiled with wider
//! vectors), so results do not depend on it.
//!
//! On aarch64 there is no run-time variant: a generic build's bodies are NEON, and an SVE
//! variant under `#[target_feature(enable = "sve")]` stays NEON too (LLVM's generic tuning
//! keeps fixed 128-bit vectors for these loops; measured on the exp-based rows: no SVE
//! instruction). The A64FX build (`scripts/build-fugaku.sh`, `-C target-cpu=a64fx`) compiles
//! the same bodies to 512-bit SVE; `scripts/predict-a64fx.sh` reports both per element.

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
}

/// The widest instruction set of [`RowIsa`] this CPU has (detected on first use). A variant
/// other than `Portable` is returned only where the CPU supports it, which is what the
/// kernels' `unsafe` calls of `#[target_feature]` functions rely on.
pub fn row_isa() -> RowIsa {
    static ISA: OnceLock<RowIsa> = OnceLock::new();
    *ISA.get_or_init(detect)
}

fn detect() -> RowIsa {
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
/// reduces keeps its own fixed lane structure (the order of its sums) on every ISA.
macro_rules! dispatch_rows {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? = $body:path;) => {
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
        #[cfg(not(target_arch = "x86_64"))]
        assert_eq!(isa, RowIsa::Portable);
    }
}

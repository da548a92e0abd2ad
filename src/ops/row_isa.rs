//! The one place that chooses the vector instruction set of the row kernels in `ops/`
//! (`fastmath.rs`, `adamw.rs`), detected once per process, as fugu-gemm chooses its
//! micro-kernel: the kernels match on [`row_isa`] instead of each asking the CPU on every
//! call. Every variant runs the same arithmetic (the portable bodies compiled with wider
//! vectors), so results do not depend on it.

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

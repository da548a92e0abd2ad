//! Software prefetch for the packing loops (`pack.rs`).
//!
//! The hardware prefetchers follow a stream only inside one 4 KiB page, and only once it has
//! run for a few lines. A pack that reads one short piece per k step from a source whose k
//! stride is a page or more (the Ã pack of a matrix contiguous along m, e.g. the Bᵀ of a
//! row-major B with n ≥ 1024) starts a new page at every piece; a transposing pack starts
//! `w` new row streams of only kc floats at every panel. Either way most reads are demand
//! misses unless the pack asks for them ahead (`docs/KERNELS.md`, "Measured (Zen 4,
//! 2026-11-26)").

/// Hints that the cache line holding `p` will be read soon (into L1). Never faults, whatever
/// the address, so `p` may point past the end of the data.
#[inline(always)]
pub fn prefetch_read(p: *const f32) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint: it reads nothing architecturally and never faults.
    unsafe {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
    };
    #[cfg(target_arch = "aarch64")]
    // SAFETY: PRFM is a hint: it reads nothing architecturally and never faults.
    unsafe {
        core::arch::asm!("prfm pldl1keep, [{p}]", p = in(reg) p, options(nostack, readonly, preserves_flags))
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = p;
}

//! x86-64 AVX2+FMA micro-kernel: a 16 × 6 tile (BLIS Haswell's 6 × 16, transposed: fugu's
//! kernels vectorise along m, so the 16-tall operand is Ã and the broadcast operand is B̃).
//!
//! Register map (16 ymm):
//!
//! | registers | use |
//! |---|---|
//! | 12 ymm | C accumulators: column `j` is `acc[j][0]` (rows 0–7) and `acc[j][1]` (rows 8–15) |
//! | 2 ymm | the two Ã vectors of the current k step (`vmovups`, 64 bytes = one cache line) |
//! | 1 ymm | the B̃ broadcast (`vbroadcastss`), reused by the two FMAs of its column |
//! | 1 ymm | free (the compiled loop uses ymm1–ymm15; ymm0 holds alpha, live across the loop) |
//!
//! Throughput: one k step is 12 FMAs, i.e. 6 cycles on the two 256-bit FMA pipes of Haswell to
//! Zen 3, against 8 loads (2 Ã + 6 broadcasts; Zen 3 does 3 loads a cycle). The macro-kernel
//! keeps this kernel's Ã micro-panel in L1 (`l1_panel: Side::A`) and streams B̃ from L2, 24
//! bytes per k step, where the other order streams 64 bytes of Ã. 12 independent accumulators cover the FMA latency × pipes (Zen 3: 4 × 2 =
//! 8; Haswell: 5 × 2 = 10). The compiled loop (checked with `objdump -d`) has no spills; beta
//! is stored to the stack once at entry and reloaded for the C update.
//!
//! The k loop is unrolled by 4 with software prefetch of Ã `PF_A = 8` steps (512 bytes) ahead,
//! two lines per two steps, and the six C columns are prefetched at entry (hints only, so C is
//! still never read when `beta == 0`; a prefetch past the end of Ã cannot fault, contract item
//! 4 allows hints).
//!
//! Measured on the 2-core AMD EPYC Zen 3 VM (family 25 model 1, FMA-loop peak 102.5
//! GFLOP/s/core) with `cargo run --release -p fugu-gemm --example blocking -- 304,320,8190`
//! (1 thread, the derived Zen 3 blocking given explicitly), the previous kernel (plain k loop, no
//! prefetch) and this one built side by side and run alternately, 4 pairs at load average
//! 0.6–0.8, medians of 5 (GFLOP/s, previous → this):
//!
//! | shape | pair 1 | pair 2 | pair 3 | pair 4 |
//! |---|---|---|---|---|
//! | 2048³ | 86.8 → 89.1 | 86.6 → 88.9 | 86.5 → 88.1 | 86.6 → 87.2 |
//! | lm-head bwd-data 1024×768×50304 | 84.9 → 86.7 | 84.5 → 85.7 | 82.6 → 84.8 | 83.7 → 83.4 |
//! | qkv fwd 1024×2304×768 | 90.5 → 91.4 | 89.2 → 90.3 | 85.7 → 89.9 | 90.3 → 88.9 |
//! | QKᵀ 48 × 64³ | 64.1 → 67.3 | 64.1 → 67.4 | 64.5 → 67.1 | 63.1 → 67.0 |
//! | PV 48 × 64³ | 64.5 → 68.3 | 64.1 → 68.1 | 64.8 → 68.3 | 63.5 → 67.6 |
//!
//! About +2% on the large shapes (2048³: 87–89% of the peak) and +5% on the batched 64³ ones,
//! of which about half comes from the driver's uninitialised edge-tile scratch, committed with
//! it. Under heavier load (3.3–3.7) prefetch distances of 4, 8 and 16 steps measured the same.
//! On L1-resident panels (`--kernel-only KC`) the kernel runs at 97% of the peak at kc = 320
//! (99.3 GFLOP/s) and 89% at kc = 64. Tried and dropped (no gain beyond the noise): prefetching
//! B̃ ahead as well; 2 MiB huge pages for the packing buffers. Not tried: a BLIS-style 6 × 16
//! tile vectorised along n (it needs a transposing C update).
//!
//! Other tiles, measured on a Zen 4 (2-core AMD EPYC, family 25 model 17, AVX2 FMA-loop peak
//! 117.5 GFLOP/s/core) with one const-generic kernel body per tile and `examples/blocking`
//! (`--isa avx2`, 1 thread): on L1-resident panels (`--kernel-only 320`) 16 × 6 ran at 98.3% of
//! the peak, 24 × 4 (3 Ã vectors, 12 accumulators, all 16 registers) at 95.2%, 8 × 12 (13
//! loads per 12 FMAs) at 84.8% and 32 × 3 at 52% (17 live registers: spills); on the full
//! shapes 24 × 4 ran 3–20% below 16 × 6. Moving the C prefetch from the entry to 8–128 steps
//! before the end measured the same (±1%).
//!
//! Ã in L1 (BLIS's order for its 6 × 16 Haswell tile, whose vector-loaded operand is B̃),
//! measured on that Zen 4 with `examples/blocking --isa avx2 --reps 11 608,320,8190,6
//! 608,320,8190,102 608,320,8190,48` (the derived blocking with nb = nr, i.e. B̃ in L1, against
//! Ã in L1 under 17 and 8 B̃ micro-panels; round robin in one process, medians of 11, two runs,
//! GFLOP/s): 2048³ 93.2 / 95.2 / 96.1 and 94.1 / 101.0 / 98.7; lm-head bwd-data 95.4 / 94.8 /
//! 98.1 and 99.3 / 100.9 / 99.4; qkv fwd 97.2 / 101.8 / 102.0 and 98.9 / 100.3 / 102.7; QKᵀ 48
//! × 64³ 76.7 / 77.0 / 78.4 and 76.5 / 77.7 / 77.6; PV 75.8 / 78.2 / 77.1 and 76.5 / 77.4 /
//! 77.4. Ã in L1 won 11 of the 12 pairs at nb = 102, by 0.4–7% (about 2% typical). The
//! prefetch of Ã ahead (above) now mostly hits L1; it is kept, as it costs one load slot in
//! nine. The AVX-512 32 × 12 kernel, tried the same way on the same host (one run), ran 3–10%
//! slower on the four large shapes with Ã in L1 (nb = 96 or 192 against 12) and within 1% on
//! the 64³ ones, so it keeps B̃ in L1.
//!
//! On Zen 4 this is also the default f32 kernel of an AVX-512 CPU ([`crate::kernel::best_kernel`]):
//! Zen 4 runs 512-bit FMAs as two 256-bit halves, and this tile beat the AVX-512 32 × 12 one.

use crate::kernel::{Accumulation, Isa, Kernel, Operand, Side};
use std::arch::x86_64::*;

const MR: usize = 16;
const NR: usize = 6;

/// The AVX2 kernel, if this CPU has AVX2 and FMA.
pub fn kernel() -> Option<Kernel> {
    (is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")).then_some(Kernel {
        operand: Operand::F32,
        accumulation: Accumulation::F32,
        isa: Isa::Avx2,
        mr: MR,
        nr: NR,
        l1_panel: Side::A,
        func: kernel_16x6,
    })
}

/// # Safety
/// The caller upholds the contract in `docs/KERNELS.md` for `mr = 16`, `nr = 6`, and the CPU
/// supports AVX2 and FMA (checked by [`kernel`]).
unsafe fn kernel_16x6(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: forwarded contract; `kernel` only hands this out when avx2+fma are present.
    unsafe { inner(k, alpha, a, b, beta, c, ldc) }
}

/// Prefetch distance for Ã, in k steps (one step of Ã is 64 bytes, one cache line).
const PF_A: usize = 8;

#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn inner(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // Prefetch the C tile (hints only: C is not read when beta == 0).
    for j in 0..NR {
        let p = c.wrapping_add(j * ldc) as *const i8;
        _mm_prefetch::<_MM_HINT_T0>(p);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(63));
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; NR];
    let (mut ap, mut bp) = (a, b);
    macro_rules! step {
        ($off:expr) => {{
            // SAFETY: the caller checked that step `$off` is below k.
            unsafe {
                let a0 = _mm256_loadu_ps(ap.add($off * MR));
                let a1 = _mm256_loadu_ps(ap.add($off * MR + 8));
                for (j, accj) in acc.iter_mut().enumerate() {
                    let bj = _mm256_broadcast_ss(&*bp.add($off * NR + j));
                    accj[0] = _mm256_fmadd_ps(a0, bj, accj[0]);
                    accj[1] = _mm256_fmadd_ps(a1, bj, accj[1]);
                }
            }
        }};
    }
    let mut left = k;
    while left >= 4 {
        _mm_prefetch::<_MM_HINT_T0>(ap.wrapping_add(PF_A * MR) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(ap.wrapping_add((PF_A + 1) * MR) as *const i8);
        step!(0);
        step!(1);
        _mm_prefetch::<_MM_HINT_T0>(ap.wrapping_add((PF_A + 2) * MR) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(ap.wrapping_add((PF_A + 3) * MR) as *const i8);
        step!(2);
        step!(3);
        ap = ap.wrapping_add(4 * MR);
        bp = bp.wrapping_add(4 * NR);
        left -= 4;
    }
    while left > 0 {
        step!(0);
        ap = ap.wrapping_add(MR);
        bp = bp.wrapping_add(NR);
        left -= 1;
    }
    let va = _mm256_set1_ps(alpha);
    let vb = _mm256_set1_ps(beta);
    for (j, accj) in acc.iter().enumerate() {
        for (h, &v) in accj.iter().enumerate() {
            // SAFETY: column j of the tile is c[j*ldc .. j*ldc + MR], inside the C view.
            unsafe {
                let p = c.add(j * ldc + 8 * h);
                let r = if beta == 0.0 {
                    _mm256_mul_ps(va, v)
                } else {
                    _mm256_fmadd_ps(vb, _mm256_loadu_ps(p), _mm256_mul_ps(va, v))
                };
                _mm256_storeu_ps(p, r);
            }
        }
    }
}

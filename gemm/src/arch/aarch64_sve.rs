//! aarch64 SVE f32 micro-kernel, vector-length agnostic, written as `asm!` (SVE intrinsics are
//! not stable in Rust).
//!
//! Tile: `mr = 2·VL` rows (VL = f32 lanes of one SVE vector, read at run time with `cntw`) by
//! `nr = 10` columns: the BLIS A64FX SGEMM shape (see `docs/A64FX.md`).
//!
//! Register allocation (all 32 z registers, one predicate):
//!
//! | registers | use |
//! |---|---|
//! | `z0`–`z19` | C accumulators; column `j` is `z(2j)` (rows `0..VL`) and `z(2j+1)` (rows `VL..2VL`) |
//! | `z20`,`z21` / `z22`,`z23` | A, double-buffered: step `p` uses pair `p % 2`, loads step `p+1` into the other |
//! | `z24`–`z31` | B broadcasts (`ld1rw`), rotating: broadcast `g = 10p + j` lives in `z(24 + g % 8)` |
//! | `p0` | all-true `.s` predicate |
//!
//! The k loop is unrolled by 4 (lcm(10, 8) = 40 broadcasts, so the B register rotation repeats
//! every 4 steps). Each broadcast register is refilled with the broadcast 8 positions ahead right
//! after its two FMLAs, and the next step's A pair is loaded at the start of each step, so loads
//! run 8–10 cycles ahead of their use and the out-of-order core covers the rest of the 11-cycle
//! load latency. The 20 independent accumulators cover the 9-cycle FMLA latency on two pipes.
//! Only non-indexed `fmla` is used (indexed FMLA is 15 cycles and 2 µops on the A64FX).
//!
//! Loads never run past the packed panels: the main loop runs only while the next 4-step block
//! is followed by at least one more step, and the last step of the tail has no look-ahead loads.
//!
//! `scripts/predict-a64fx.sh` finds [`fugu_sve_sgemm_2vx10`] in the release build and checks its
//! inner loop with `llvm-mca -mcpu=a64fx`.

use crate::kernel::{Accumulation, Isa, Kernel, Operand, Side, F16_CHUNK};

/// Columns of the C tile.
const NR: usize = 10;

/// The SVE kernel descriptor, or `None` when the CPU has no SVE.
pub fn kernel() -> Option<Kernel> {
    let lanes = f32_lanes()?;
    Some(Kernel {
        operand: Operand::F32,
        accumulation: Accumulation::F32,
        isa: Isa::Sve,
        mr: 2 * lanes,
        nr: NR,
        l1_panel: Side::B,
        func: fugu_sve_sgemm_2vx10,
    })
}

/// The SVE f16 kernel descriptor (f16 products summed in f16 over chunks of [`F16_CHUNK`],
/// folded into f32), or `None` when the CPU has no SVE.
pub fn f16_kernel() -> Option<Kernel> {
    let lanes = f32_lanes()?;
    Some(Kernel {
        operand: Operand::F16,
        accumulation: Accumulation::F16Chunks(F16_CHUNK),
        isa: Isa::Sve,
        mr: 4 * lanes,
        nr: NR,
        l1_panel: Side::B,
        func: fugu_sve_hgemm_2vx10,
    })
}

/// f32 lanes of one SVE vector (`cntw`), or `None` when the CPU has no SVE.
pub fn f32_lanes() -> Option<usize> {
    if std::arch::is_aarch64_feature_detected!("sve") {
        // SAFETY: the CPU has SVE (checked just above), which is all `cntw_sve` needs.
        Some(unsafe { cntw_sve() })
    } else {
        None
    }
}

/// # Safety
/// The CPU must support SVE.
#[target_feature(enable = "sve")]
unsafe fn cntw_sve() -> usize {
    let n: usize;
    // SAFETY: `cntw` only reads the vector length; the caller guarantees SVE is present.
    unsafe {
        core::arch::asm!("cntw {n}", n = out(reg) n, options(pure, nomem, nostack, preserves_flags));
    }
    n
}

/// Two FMLAs for one C column (accumulators `z$c0`, `z$c1`) with the A pair `z$a0`, `z$a1` and
/// the broadcast `z$b`; with `$off`, then refill `z$b` from byte offset `$off` of the B block.
macro_rules! col {
    ($t:literal, $c0:literal, $c1:literal, $a0:literal, $a1:literal, $b:literal) => {
        concat!(
            "fmla z",
            $c0,
            ".",
            $t,
            ", p0/m, z",
            $a0,
            ".",
            $t,
            ", z",
            $b,
            ".",
            $t,
            "\n",
            "fmla z",
            $c1,
            ".",
            $t,
            ", p0/m, z",
            $a1,
            ".",
            $t,
            ", z",
            $b,
            ".",
            $t,
            "\n",
        )
    };
    ($t:literal, $c0:literal, $c1:literal, $a0:literal, $a1:literal, $b:literal, $off:literal) => {
        concat!(
            col!($t, $c0, $c1, $a0, $a1, $b),
            "ld1rw {{z",
            $b,
            ".s}}, p0/z, [{b}, #",
            $off,
            "]\n",
        )
    };
}

/// Loads the A pair `z$r0`, `z$r1` from vectors `$v0`, `$v1` (in units of VL) of the A block.
macro_rules! load_a {
    ($w:literal, $t:literal, $r0:literal, $r1:literal, $v0:literal, $v1:literal) => {
        concat!(
            "ld1",
            $w,
            " {{z",
            $r0,
            ".",
            $t,
            "}}, p0/z, [{a}, #",
            $v0,
            ", mul vl]\n",
            "ld1",
            $w,
            " {{z",
            $r1,
            ".",
            $t,
            "}}, p0/z, [{a}, #",
            $v1,
            ", mul vl]\n",
        )
    };
}

// One k step `p` of a 4-step block. Broadcast `g = 10p + j` of column `j` is in `z(24 + g % 8)`
// and, after its FMLAs, that register is refilled with broadcast `g + 8` (byte offset 4(g + 8)
// from the block start). The `*_la` steps load ahead (A of step p+1, broadcasts up to the
// 8th of step p+1); the `*_last` steps are the final step of the whole k loop and load only the
// two broadcasts of their own step that did not fit in the 8 registers.

macro_rules! step0_la {
    ($w:literal, $t:literal) => {
        concat!(
            load_a!($w, $t, 22, 23, 2, 3),
            col!($t, 0, 1, 20, 21, 24, 32),
            col!($t, 2, 3, 20, 21, 25, 36),
            col!($t, 4, 5, 20, 21, 26, 40),
            col!($t, 6, 7, 20, 21, 27, 44),
            col!($t, 8, 9, 20, 21, 28, 48),
            col!($t, 10, 11, 20, 21, 29, 52),
            col!($t, 12, 13, 20, 21, 30, 56),
            col!($t, 14, 15, 20, 21, 31, 60),
            col!($t, 16, 17, 20, 21, 24, 64),
            col!($t, 18, 19, 20, 21, 25, 68),
        )
    };
}

macro_rules! step1_la {
    ($w:literal, $t:literal) => {
        concat!(
            load_a!($w, $t, 20, 21, 4, 5),
            col!($t, 0, 1, 22, 23, 26, 72),
            col!($t, 2, 3, 22, 23, 27, 76),
            col!($t, 4, 5, 22, 23, 28, 80),
            col!($t, 6, 7, 22, 23, 29, 84),
            col!($t, 8, 9, 22, 23, 30, 88),
            col!($t, 10, 11, 22, 23, 31, 92),
            col!($t, 12, 13, 22, 23, 24, 96),
            col!($t, 14, 15, 22, 23, 25, 100),
            col!($t, 16, 17, 22, 23, 26, 104),
            col!($t, 18, 19, 22, 23, 27, 108),
        )
    };
}

macro_rules! step2_la {
    ($w:literal, $t:literal) => {
        concat!(
            load_a!($w, $t, 22, 23, 6, 7),
            col!($t, 0, 1, 20, 21, 28, 112),
            col!($t, 2, 3, 20, 21, 29, 116),
            col!($t, 4, 5, 20, 21, 30, 120),
            col!($t, 6, 7, 20, 21, 31, 124),
            col!($t, 8, 9, 20, 21, 24, 128),
            col!($t, 10, 11, 20, 21, 25, 132),
            col!($t, 12, 13, 20, 21, 26, 136),
            col!($t, 14, 15, 20, 21, 27, 140),
            col!($t, 16, 17, 20, 21, 28, 144),
            col!($t, 18, 19, 20, 21, 29, 148),
        )
    };
}

/// Step 3 with look-ahead, main loop only: also advances `{a}` and `{b}` to the next block.
macro_rules! step3_la {
    ($w:literal, $t:literal) => {
        concat!(
            "addvl {a}, {a}, #8\n",
            load_a!($w, $t, 20, 21, 0, 1),
            col!($t, 0, 1, 22, 23, 30, 152),
            col!($t, 2, 3, 22, 23, 31, 156),
            col!($t, 4, 5, 22, 23, 24, 160),
            col!($t, 6, 7, 22, 23, 25, 164),
            col!($t, 8, 9, 22, 23, 26, 168),
            col!($t, 10, 11, 22, 23, 27, 172),
            col!($t, 12, 13, 22, 23, 28, 176),
            col!($t, 14, 15, 22, 23, 29, 180),
            col!($t, 16, 17, 22, 23, 30, 184),
            col!($t, 18, 19, 22, 23, 31, 188),
            "add {b}, {b}, #160\n",
        )
    };
}

macro_rules! step0_last {
    ($w:literal, $t:literal) => {
        concat!(
            col!($t, 0, 1, 20, 21, 24, 32),
            col!($t, 2, 3, 20, 21, 25, 36),
            col!($t, 4, 5, 20, 21, 26),
            col!($t, 6, 7, 20, 21, 27),
            col!($t, 8, 9, 20, 21, 28),
            col!($t, 10, 11, 20, 21, 29),
            col!($t, 12, 13, 20, 21, 30),
            col!($t, 14, 15, 20, 21, 31),
            col!($t, 16, 17, 20, 21, 24),
            col!($t, 18, 19, 20, 21, 25),
        )
    };
}

macro_rules! step1_last {
    ($w:literal, $t:literal) => {
        concat!(
            col!($t, 0, 1, 22, 23, 26, 72),
            col!($t, 2, 3, 22, 23, 27, 76),
            col!($t, 4, 5, 22, 23, 28),
            col!($t, 6, 7, 22, 23, 29),
            col!($t, 8, 9, 22, 23, 30),
            col!($t, 10, 11, 22, 23, 31),
            col!($t, 12, 13, 22, 23, 24),
            col!($t, 14, 15, 22, 23, 25),
            col!($t, 16, 17, 22, 23, 26),
            col!($t, 18, 19, 22, 23, 27),
        )
    };
}

macro_rules! step2_last {
    ($w:literal, $t:literal) => {
        concat!(
            col!($t, 0, 1, 20, 21, 28, 112),
            col!($t, 2, 3, 20, 21, 29, 116),
            col!($t, 4, 5, 20, 21, 30),
            col!($t, 6, 7, 20, 21, 31),
            col!($t, 8, 9, 20, 21, 24),
            col!($t, 10, 11, 20, 21, 25),
            col!($t, 12, 13, 20, 21, 26),
            col!($t, 14, 15, 20, 21, 27),
            col!($t, 16, 17, 20, 21, 28),
            col!($t, 18, 19, 20, 21, 29),
        )
    };
}

macro_rules! step3_last {
    ($w:literal, $t:literal) => {
        concat!(
            col!($t, 0, 1, 22, 23, 30, 152),
            col!($t, 2, 3, 22, 23, 31, 156),
            col!($t, 4, 5, 22, 23, 24),
            col!($t, 6, 7, 22, 23, 25),
            col!($t, 8, 9, 22, 23, 26),
            col!($t, 10, 11, 22, 23, 27),
            col!($t, 12, 13, 22, 23, 28),
            col!($t, 14, 15, 22, 23, 29),
            col!($t, 16, 17, 22, 23, 30),
            col!($t, 18, 19, 22, 23, 31),
        )
    };
}

/// Zeroes the 20 accumulators `z0`–`z19` as elements `$t` (`"s"` or `"h"`).
macro_rules! zero_acc {
    ($t:literal) => {
        concat!(
            "dup z0.", $t, ", #0\n", "dup z1.", $t, ", #0\n", "dup z2.", $t, ", #0\n", "dup z3.",
            $t, ", #0\n", "dup z4.", $t, ", #0\n", "dup z5.", $t, ", #0\n", "dup z6.", $t,
            ", #0\n", "dup z7.", $t, ", #0\n", "dup z8.", $t, ", #0\n", "dup z9.", $t, ", #0\n",
            "dup z10.", $t, ", #0\n", "dup z11.", $t, ", #0\n", "dup z12.", $t, ", #0\n",
            "dup z13.", $t, ", #0\n", "dup z14.", $t, ", #0\n", "dup z15.", $t, ", #0\n",
            "dup z16.", $t, ", #0\n", "dup z17.", $t, ", #0\n", "dup z18.", $t, ", #0\n",
            "dup z19.", $t, ", #0\n",
        )
    };
}

/// The whole k loop over `{blocks}` 4-step blocks and `{rem}` (1..=4) tail steps, for A loads
/// `ld1$w` and FMLAs on elements `$t`, ending at label `8:` with the 20 accumulators summed.
/// Prologue: A of step 0 and the first 8 broadcasts; main loop: 4 steps with look-ahead; tail:
/// `rem` steps, the last one without look-ahead.
macro_rules! k_loop {
    ($w:literal, $t:literal) => {
        concat!(
            load_a!($w, $t, 20, 21, 0, 1),
            "ld1rw {{z24.s}}, p0/z, [{b}, #0]\n",
            "ld1rw {{z25.s}}, p0/z, [{b}, #4]\n",
            "ld1rw {{z26.s}}, p0/z, [{b}, #8]\n",
            "ld1rw {{z27.s}}, p0/z, [{b}, #12]\n",
            "ld1rw {{z28.s}}, p0/z, [{b}, #16]\n",
            "ld1rw {{z29.s}}, p0/z, [{b}, #20]\n",
            "ld1rw {{z30.s}}, p0/z, [{b}, #24]\n",
            "ld1rw {{z31.s}}, p0/z, [{b}, #28]\n",
            "cbz {blocks}, 3f\n",
            "2:\n",
            step0_la!($w, $t),
            step1_la!($w, $t),
            step2_la!($w, $t),
            step3_la!($w, $t),
            "subs {blocks}, {blocks}, #1\n",
            "b.ne 2b\n",
            "3:\n",
            "cmp {rem}, #1\n",
            "b.eq 4f\n",
            step0_la!($w, $t),
            "cmp {rem}, #2\n",
            "b.eq 5f\n",
            step1_la!($w, $t),
            "cmp {rem}, #3\n",
            "b.eq 6f\n",
            step2_la!($w, $t),
            step3_last!($w, $t),
            "b 8f\n",
            "4:\n",
            step0_last!($w, $t),
            "b 8f\n",
            "5:\n",
            step1_last!($w, $t),
            "b 8f\n",
            "6:\n",
            step2_last!($w, $t),
            "8:\n",
        )
    };
}

/// C column `j` (accumulators `z$c0`, `z$c1`) := alpha·acc (`z20` = alpha); C is not read.
macro_rules! store_beta0 {
    ($c0:literal, $c1:literal) => {
        concat!(
            "fmul z",
            $c0,
            ".s, z",
            $c0,
            ".s, z20.s\n",
            "fmul z",
            $c1,
            ".s, z",
            $c1,
            ".s, z20.s\n",
            "st1w {{z",
            $c0,
            ".s}}, p0, [{c}, #0, mul vl]\n",
            "st1w {{z",
            $c1,
            ".s}}, p0, [{c}, #1, mul vl]\n",
            "add {c}, {c}, {ldc}\n",
        )
    };
}

/// C column `j` := alpha·acc + beta·C (`z20` = alpha, `z21` = beta, `z22`/`z23` hold old C).
macro_rules! store_beta {
    ($c0:literal, $c1:literal) => {
        concat!(
            "ld1w {{z22.s}}, p0/z, [{c}, #0, mul vl]\n",
            "ld1w {{z23.s}}, p0/z, [{c}, #1, mul vl]\n",
            "fmul z",
            $c0,
            ".s, z",
            $c0,
            ".s, z20.s\n",
            "fmul z",
            $c1,
            ".s, z",
            $c1,
            ".s, z20.s\n",
            "fmla z",
            $c0,
            ".s, p0/m, z22.s, z21.s\n",
            "fmla z",
            $c1,
            ".s, p0/m, z23.s, z21.s\n",
            "st1w {{z",
            $c0,
            ".s}}, p0, [{c}, #0, mul vl]\n",
            "st1w {{z",
            $c1,
            ".s}}, p0, [{c}, #1, mul vl]\n",
            "add {c}, {c}, {ldc}\n",
        )
    };
}

/// The SVE micro-kernel: `C := alpha·Ã·B̃ + beta·C` on a `2·VL × 10` column-major tile.
///
/// # Safety
/// The CPU must support SVE and the caller must uphold the contract in `docs/KERNELS.md` with
/// `mr = 2·VL` (`2 * f32_lanes()`) and `nr = 10`: `a` holds `k*mr` floats, `b` holds `k*nr`
/// floats, and `c[r + j*ldc]` is writable for `r < mr`, `j < nr`, `ldc >= mr`.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn fugu_sve_sgemm_2vx10(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // Blocks of 4 steps that are followed by at least one more step (so their look-ahead loads
    // stay inside the panels), then 1..=4 tail steps; `rem == 0` only when `k == 0`.
    let blocks = k.saturating_sub(1) / 4;
    let rem = k - 4 * blocks;
    let ldc_bytes = ldc * core::mem::size_of::<f32>();
    let beta_nonzero = usize::from(beta != 0.0);
    // SAFETY: the caller guarantees SVE and the contract: the loads read Ã[0 .. k*mr] and
    // B̃[0 .. k*nr] only (see the look-ahead argument in the module docs), and the stores write
    // exactly the mr×nr tile at `c` with column stride `ldc`; C is loaded only when beta != 0.
    // Every z register (aliasing v0–v31), p0 and the flags are declared clobbered.
    unsafe {
        core::arch::asm!(
            "ptrue p0.s",
            // Zero the 20 accumulators.
            zero_acc!("s"),
            "cbz {rem}, 8f",
            k_loop!("w", "s"),
            // Write the tile.
            "dup z20.s, {alpha:w}",
            "dup z21.s, {beta:w}",
            "cbnz {beta_nonzero}, 9f",
            store_beta0!(0, 1),
            store_beta0!(2, 3),
            store_beta0!(4, 5),
            store_beta0!(6, 7),
            store_beta0!(8, 9),
            store_beta0!(10, 11),
            store_beta0!(12, 13),
            store_beta0!(14, 15),
            store_beta0!(16, 17),
            store_beta0!(18, 19),
            "b 7f",
            "9:",
            store_beta!(0, 1),
            store_beta!(2, 3),
            store_beta!(4, 5),
            store_beta!(6, 7),
            store_beta!(8, 9),
            store_beta!(10, 11),
            store_beta!(12, 13),
            store_beta!(14, 15),
            store_beta!(16, 17),
            store_beta!(18, 19),
            "7:",
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            c = inout(reg) c => _,
            blocks = inout(reg) blocks => _,
            rem = in(reg) rem,
            ldc = in(reg) ldc_bytes,
            alpha = in(reg) alpha.to_bits(),
            beta = in(reg) beta.to_bits(),
            beta_nonzero = in(reg) beta_nonzero,
            out("v0") _, out("v1") _, out("v2") _, out("v3") _,
            out("v4") _, out("v5") _, out("v6") _, out("v7") _,
            out("v8") _, out("v9") _, out("v10") _, out("v11") _,
            out("v12") _, out("v13") _, out("v14") _, out("v15") _,
            out("v16") _, out("v17") _, out("v18") _, out("v19") _,
            out("v20") _, out("v21") _, out("v22") _, out("v23") _,
            out("v24") _, out("v25") _, out("v26") _, out("v27") _,
            out("v28") _, out("v29") _, out("v30") _, out("v31") _,
            out("p0") _,
            options(nostack),
        );
    }
}

/// Adds the f16 accumulators of one C column (`z$c0`: rows `0..VLh`, `z$c1`: rows
/// `VLh..2·VLh`, VLh = f16 lanes) to the f32 column at `{s}` (four f32 vectors) and moves `{s}`
/// to the next column. `uunpklo/hi` widen each half of the f16 lanes into 32-bit containers and
/// `fcvt` converts the f16 in the low half of each container, so the rows stay in order.
macro_rules! fold_col {
    ($c0:literal, $c1:literal) => {
        concat!(
            "uunpklo z20.s, z",
            $c0,
            ".h\n",
            "uunpkhi z21.s, z",
            $c0,
            ".h\n",
            "uunpklo z22.s, z",
            $c1,
            ".h\n",
            "uunpkhi z23.s, z",
            $c1,
            ".h\n",
            "fcvt z20.s, p0/m, z20.h\n",
            "fcvt z21.s, p0/m, z21.h\n",
            "fcvt z22.s, p0/m, z22.h\n",
            "fcvt z23.s, p0/m, z23.h\n",
            "ld1w {{z24.s}}, p0/z, [{s}, #0, mul vl]\n",
            "ld1w {{z25.s}}, p0/z, [{s}, #1, mul vl]\n",
            "ld1w {{z26.s}}, p0/z, [{s}, #2, mul vl]\n",
            "ld1w {{z27.s}}, p0/z, [{s}, #3, mul vl]\n",
            "fadd z24.s, z24.s, z20.s\n",
            "fadd z25.s, z25.s, z21.s\n",
            "fadd z26.s, z26.s, z22.s\n",
            "fadd z27.s, z27.s, z23.s\n",
            "st1w {{z24.s}}, p0, [{s}, #0, mul vl]\n",
            "st1w {{z25.s}}, p0, [{s}, #1, mul vl]\n",
            "st1w {{z26.s}}, p0, [{s}, #2, mul vl]\n",
            "st1w {{z27.s}}, p0, [{s}, #3, mul vl]\n",
            "addvl {s}, {s}, #4\n",
        )
    };
}

/// Largest f16 tile height: 4 f32 vectors of SVE's longest (2048-bit) length.
const MAX_F16_ROWS: usize = 4 * 64;

/// The SVE f16 micro-kernel: `C := alpha·Ã·B̃ + beta·C` on a `2·VLh × 10` column-major f32 tile
/// (VLh = f16 lanes, so `mr = 4·VL` f32 lanes), with [`Operand::F16`] panels.
///
/// The register map and the k loop are the f32 kernel's (the same step macros with `fmla .h`
/// and `ld1h`; a B̃ word holds its f16 in both halves, so the same `ld1rw` broadcasts it to every
/// f16 lane). Every [`F16_CHUNK`] steps the 20 f16 accumulators are widened, converted and added
/// into an f32 tile on the stack (`fold_col!`), and zeroed; the epilogue applies alpha and beta
/// from that tile. A64FX has no f16 -> f32 widening FMA: this is how it gets its 2x f16 rate.
///
/// # Safety
/// The CPU must support SVE and the caller must uphold the contract in `docs/KERNELS.md` with
/// `mr = 4·VL` (`4 * f32_lanes()`), `nr = 10`, and [`Operand::F16`] panels: `a` holds `k*mr`
/// f16 (`k*mr/2` words), `b` holds `k*nr` words, and `c[r + j*ldc]` is writable for `r < mr`,
/// `j < nr`, `ldc >= mr`.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn fugu_sve_hgemm_2vx10(
    k: usize,
    alpha: f32,
    a: *const f32,
    b: *const f32,
    beta: f32,
    c: *mut f32,
    ldc: usize,
) {
    // SAFETY: the caller guarantees SVE.
    let mr = 4 * unsafe { cntw_sve() };
    debug_assert!(mr <= MAX_F16_ROWS);
    let mut tile = core::mem::MaybeUninit::<[f32; MAX_F16_ROWS * NR]>::uninit();
    // SAFETY: the first mr*NR floats of the array (mr <= MAX_F16_ROWS) are zeroed here before
    // any read; the rest is never touched.
    let tile = unsafe {
        let t = core::slice::from_raw_parts_mut(tile.as_mut_ptr() as *mut f32, mr * NR);
        t.fill(0.0);
        t
    };
    let (mut ap, mut bp) = (a as *const u8, b as *const u8);
    let mut left = k;
    while left > 0 {
        let kk = left.min(F16_CHUNK);
        // SAFETY: the chunk reads kk steps of the panels (kk*mr f16 of Ã, kk*NR words of B̃),
        // inside what the contract guarantees, and adds into the mr×NR f32 tile.
        unsafe { hgemm_chunk(kk, ap, bp, tile.as_mut_ptr()) };
        // SAFETY: advancing by the kk steps just read stays inside (or one past) the panels.
        unsafe {
            ap = ap.add(kk * mr * 2);
            bp = bp.add(kk * NR * 4);
        }
        left -= kk;
    }
    for (j, col) in tile.chunks_exact(mr).enumerate() {
        // SAFETY: the contract guarantees column j of the C tile, c[j*ldc .. j*ldc + mr].
        let cj = unsafe { core::slice::from_raw_parts_mut(c.add(j * ldc), mr) };
        if beta == 0.0 {
            for (cr, &v) in cj.iter_mut().zip(col) {
                *cr = alpha * v;
            }
        } else {
            for (cr, &v) in cj.iter_mut().zip(col) {
                *cr = alpha * v + beta * *cr;
            }
        }
    }
}

/// One chunk of `kk >= 1` f16 steps: the f32 kernel's k loop on f16 lanes, then the fold of the
/// 20 accumulators into the f32 tile at `s` (column-major, `mr = 2·VLh` rows).
///
/// # Safety
/// SVE; `a` holds `kk` steps of Ã (2 vectors each), `b` `kk` rows of B̃ words (10 each), `s` a
/// writable `mr × 10` f32 tile.
#[inline(always)]
unsafe fn hgemm_chunk(kk: usize, a: *const u8, b: *const u8, s: *mut f32) {
    debug_assert!(kk >= 1);
    let blocks = (kk - 1) / 4;
    let rem = kk - 4 * blocks;
    // SAFETY: as for the f32 kernel: the loads read Ã[0 .. kk steps] and B̃[0 .. kk rows] only
    // (look-ahead stops before the last step), the fold reads and writes the f32 tile only.
    // Every z register, p0 and the flags are declared clobbered.
    unsafe {
        core::arch::asm!(
            "ptrue p0.b",
            zero_acc!("h"),
            k_loop!("h", "h"),
            fold_col!(0, 1),
            fold_col!(2, 3),
            fold_col!(4, 5),
            fold_col!(6, 7),
            fold_col!(8, 9),
            fold_col!(10, 11),
            fold_col!(12, 13),
            fold_col!(14, 15),
            fold_col!(16, 17),
            fold_col!(18, 19),
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            s = inout(reg) s => _,
            blocks = inout(reg) blocks => _,
            rem = in(reg) rem,
            out("v0") _, out("v1") _, out("v2") _, out("v3") _,
            out("v4") _, out("v5") _, out("v6") _, out("v7") _,
            out("v8") _, out("v9") _, out("v10") _, out("v11") _,
            out("v12") _, out("v13") _, out("v14") _, out("v15") _,
            out("v16") _, out("v17") _, out("v18") _, out("v19") _,
            out("v20") _, out("v21") _, out("v22") _, out("v23") _,
            out("v24") _, out("v25") _, out("v26") _, out("v27") _,
            out("v28") _, out("v29") _, out("v30") _, out("v31") _,
            out("p0") _,
            options(nostack),
        );
    }
}

//! Packing: copies a block of a strided matrix into the micro-panel layout of `docs/KERNELS.md`.
//!
//! A and B use the same routine: Ã packs `mr`-tall panels of A, and B̃ packs `nr`-wide panels of
//! B, which are `nr`-tall panels of Bᵀ. So `pack_panels` takes the source with its stride
//! along the panel (`s_w`) and along k (`s_k`).

use crate::arch::prefetch::prefetch_read;
use crate::arch::transpose::{transposes, TransposeFn, Transposes};
use crate::kernel::{Operand, Side};
use crate::precision::{bf16_to_f32, f16_bits_of, f16_value_of, round_bf16, Precision, Storage};
use crate::raw::RawMat;
use std::cell::RefCell;

/// What a kernel's panels hold: its packed word format, and the precision the operands are
/// rounded to on the way in (a no-op for `f32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PanelFormat {
    pub operand: Operand,
    pub prec: Precision,
}

/// Packs the `len × k` block `src` (rows are the panel dimension) into panels of `w` rows:
/// `dst[panel*k*w + p*w + r] = src(panel*w + r, p)` for `f32` words (rounded to `fmt.prec`),
/// zero-padding the last panel; 16-bit operands pack their words as [`Operand`] says.
/// `dst` must hold `ceil(len / w) * fmt.operand.panel_words(side, k, w)` words.
///
/// Panels are packed one after the other. (Walking k outermost across many panels, to read a
/// source that is contiguous along the panel in longer pieces, measured slower on Zen 5: the
/// panel-by-panel walk writes sequentially and its reads of neighbouring panels hit in cache.)
pub(crate) fn pack_panels(fmt: PanelFormat, side: Side, dst: &mut [f32], src: RawMat, w: usize) {
    let (len, k) = (src.rows, src.cols);
    let panels = len.div_ceil(w);
    let words = fmt.operand.panel_words(side, k, w);
    debug_assert!(dst.len() >= panels * words);
    for (pi, panel) in dst.chunks_exact_mut(words).take(panels).enumerate() {
        pack_one_panel(fmt, side, panel, src, pi * w, w);
    }
}

/// Packs the single panel of rows `r0 .. r0 + w` (clipped to the block, rest zero) in `fmt`.
pub(crate) fn pack_one_panel(
    fmt: PanelFormat,
    side: Side,
    panel: &mut [f32],
    src: RawMat,
    r0: usize,
    w: usize,
) {
    if fmt.operand == Operand::F32 {
        pack_source_panel(panel, src, r0, w);
        if !src.storage.exact_in(fmt.prec) {
            fmt.prec.round_slice(panel);
        }
        return;
    }
    // 16-bit words: pack as f32 into a scratch panel, then convert it.
    thread_local! {
        static F32_PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    F32_PANEL.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        let need = src.cols * w;
        if scratch.len() < need {
            scratch.resize(need, 0.0);
        }
        let f32_panel = &mut scratch[..need];
        pack_source_panel(f32_panel, src, r0, w);
        match (fmt.operand, side) {
            (Operand::Bf16Pairs, _) => {
                debug_assert_eq!(fmt.prec, Precision::Bf16);
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2 (checked just above).
                    return unsafe { pair_words_avx2(panel, f32_panel, w) };
                }
                pair_words(panel, f32_panel, w)
            }
            (Operand::F16, Side::A) => {
                debug_assert_eq!(fmt.prec, Precision::F16);
                dense_f16_words(panel, f32_panel)
            }
            (Operand::F16, Side::B) => {
                debug_assert_eq!(fmt.prec, Precision::F16);
                broadcast_f16_words(panel, f32_panel)
            }
            (Operand::F32, _) => unreachable!("handled above"),
        }
    })
}

/// f16 elements two to a word, in order (element `2i` in the low half of word `i`): Ã's
/// layout for [`Operand::F16`] (`w` even, so a k step's run of `w` ends on a word).
fn dense_f16_words(dst: &mut [f32], f32_panel: &[f32]) {
    for (o, pair) in dst.iter_mut().zip(f32_panel.chunks_exact(2)) {
        let (lo, hi) = (f16_bits_of(pair[0]), f16_bits_of(pair[1]));
        *o = f32::from_bits(u32::from(lo) | (u32::from(hi) << 16));
    }
}

/// One f16 element per word, in both halves: B̃'s layout for [`Operand::F16`].
fn broadcast_f16_words(dst: &mut [f32], f32_panel: &[f32]) {
    for (o, &x) in dst.iter_mut().zip(f32_panel) {
        let h = u32::from(f16_bits_of(x));
        *o = f32::from_bits(h | (h << 16));
    }
}

/// [`pair_words`] compiled for AVX2: eight words per instruction instead of SSE2's four (the
/// bf16 GEMMs run on AVX-512 BF16 CPUs, which all have AVX2).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pair_words_avx2(dst: &mut [f32], f32_panel: &[f32], w: usize) {
    pair_words(dst, f32_panel, w)
}

/// Interleaves an `f32` panel (`k` runs of `w`) into bf16-pair words: word `(q, r)` holds
/// run `2q`'s element `r` (rounded to bf16) in its low half and run `2q + 1`'s in its high half,
/// zero past the last run. Plain loops over whole runs, which the compiler vectorises.
#[inline(always)]
fn pair_words(dst: &mut [f32], f32_panel: &[f32], w: usize) {
    let word = |lo: f32, hi: f32| {
        f32::from_bits((round_bf16(lo).to_bits() >> 16) | (round_bf16(hi).to_bits() & 0xffff_0000))
    };
    let mut runs = f32_panel.chunks_exact(w);
    for out in dst.chunks_exact_mut(w) {
        match (runs.next(), runs.next()) {
            (Some(lo), Some(hi)) => {
                for ((o, &l), &h) in out.iter_mut().zip(lo).zip(hi) {
                    *o = word(l, h);
                }
            }
            (Some(lo), None) => {
                for (o, &l) in out.iter_mut().zip(lo) {
                    *o = word(l, 0.0);
                }
            }
            _ => unreachable!("dst has ceil(k/2) runs"),
        }
    }
}

/// The strided copy of one panel (source contiguous along the panel): `rows` floats per k step
/// from `base + r0 + p·s_k` to `panel[p·w ..]`, with the source prefetched [`COPY_AHEAD`] steps
/// ahead. The kernels' panel widths (16 and 32: Ã of AVX2 and AVX-512; 4, 6, 8, 10, 12: B̃ of the
/// portable, AVX2/NEON, SVE and AVX-512 kernels) get a copy of a fixed size chosen once per
/// panel, so each k step is a few vector moves; other widths copy `rows` floats as a slice.
/// (A `memcpy` call per 24-byte piece cost more than the copy: giving AVX2's 6 its own move
/// measured +3% on PV 48 × 64³ and +1–2% on the LM head's weight gradient, Zen 4.)
///
/// # Safety
/// Rows `r0 .. r0 + rows` of columns `0 .. panel.len() / w` are inside the source view at
/// `base`, which is contiguous along rows; `rows <= w`.
#[inline(always)]
unsafe fn copy_strip(
    panel: &mut [f32],
    base: *const f32,
    r0: usize,
    s_k: usize,
    rows: usize,
    w: usize,
) {
    /// The loop every width shares: per k step, prefetch the piece COPY_AHEAD steps on, then
    /// `copy` the `n` floats at `from` into the step's run of the panel.
    #[inline(always)]
    fn each_step(
        panel: &mut [f32],
        base: *const f32,
        r0: usize,
        s_k: usize,
        n: usize,
        w: usize,
        copy: impl Fn(&mut [f32], *const f32),
    ) {
        for (p, out) in panel.chunks_exact_mut(w).enumerate() {
            let ahead = base.wrapping_add(r0 + (p + COPY_AHEAD) * s_k);
            prefetch_read(ahead);
            prefetch_read(ahead.wrapping_add(n - 1));
            copy(out, base.wrapping_add(r0 + p * s_k));
        }
    }
    #[inline(always)]
    unsafe fn strip<const N: usize>(
        panel: &mut [f32],
        base: *const f32,
        r0: usize,
        s_k: usize,
        w: usize,
    ) {
        // SAFETY (closure): rows r0..r0+N of each column are inside the source (caller's
        // contract), so `from` points at N readable floats.
        unsafe {
            each_step(panel, base, r0, s_k, N, w, |out, from| {
                let out: &mut [f32; N] = (&mut out[..N]).try_into().expect("w >= N");
                *out = *(from as *const [f32; N]);
            })
        }
    }
    // SAFETY (all arms): forwarded contract, with N = rows.
    unsafe {
        match rows {
            4 => strip::<4>(panel, base, r0, s_k, w),
            6 => strip::<6>(panel, base, r0, s_k, w),
            8 => strip::<8>(panel, base, r0, s_k, w),
            10 => strip::<10>(panel, base, r0, s_k, w),
            12 => strip::<12>(panel, base, r0, s_k, w),
            16 => strip::<16>(panel, base, r0, s_k, w),
            32 => strip::<32>(panel, base, r0, s_k, w),
            _ => each_step(panel, base, r0, s_k, rows, w, |out, from| {
                out[..rows].copy_from_slice(std::slice::from_raw_parts(from, rows))
            }),
        }
    }
}

/// Transposing pack, scalar part: row `r` of the panel (source row `r0 + r`, contiguous along
/// k) from column `p0` to the end goes to `panel[p*w + r]`.
fn scatter_row_tail(panel: &mut [f32], src: RawMat, r0: usize, r: usize, p0: usize, w: usize) {
    let k = src.cols;
    // SAFETY: row r0+r, columns p0..k are inside the source view, which is contiguous along k.
    let tail =
        unsafe { std::slice::from_raw_parts(src.f32_ptr().add((r0 + r) * src.rs + p0), k - p0) };
    for (q, &v) in tail.iter().enumerate() {
        panel[(p0 + q) * w + r] = v;
    }
}

/// Transposing pack, block part: from panel row `r` on, as many `size`-row strips as fit in
/// the panel's `rows` rows, each along k in `size × steps` blocks of `f` (then the strip's tail
/// past the last whole block, scalar); returns the first row not packed.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn transpose_rows(
    f: TransposeFn,
    size: usize,
    steps: usize,
    mut r: usize,
    panel: &mut [f32],
    src: RawMat,
    r0: usize,
    w: usize,
) -> usize {
    let (k, s_w) = (src.cols, src.rs);
    let rows = w.min(src.rows - r0);
    let base = src.f32_ptr();
    while r + size <= rows {
        let mut p = 0;
        while p + steps <= k {
            if p % 16 == 0 {
                for i in r..r + size {
                    prefetch_read(base.wrapping_add((r0 + w + i) * s_w + p));
                }
            }
            // SAFETY: rows r0+r .. r0+r+size and columns p .. p+steps are inside the source
            // view (contiguous along k); the panel holds k runs of w >= r+size floats, so runs
            // p .. p+steps at offset r are inside it.
            unsafe {
                f(
                    base.add((r0 + r) * s_w + p),
                    s_w,
                    panel.as_mut_ptr().add(p * w + r),
                    w,
                )
            };
            p += steps;
        }
        for i in r..r + size {
            scatter_row_tail(panel, src, r0, i, p, w);
        }
        r += size;
    }
    r
}

/// Packs rows `r0 .. r0 + w` of `src` (clipped, rest zero) into an `f32` panel, converting
/// 16-bit sources exactly.
fn pack_source_panel(panel: &mut [f32], src: RawMat, r0: usize, w: usize) {
    match src.storage {
        Storage::F32 => pack_f32_panel(panel, src, r0, w),
        Storage::F16 | Storage::Bf16 => pack_converted_panel(panel, src, r0, w),
    }
}

/// [`pack_source_panel`] for 16-bit sources. Contiguous along k (A row-major, B stored
/// transposed): the panel's rows are widened, each one sequential run, into an `f32` block,
/// which the `f32` pack then transposes. Contiguous along the panel: each k step's run is
/// widened straight into place. Otherwise element by element.
fn pack_converted_panel(panel: &mut [f32], src: RawMat, r0: usize, w: usize) {
    let (k, s_w, s_k) = (src.cols, src.rs, src.cs);
    let rows = w.min(src.rows - r0);
    let base = src.u16_ptr();
    if s_k == 1 && s_w != 1 {
        thread_local! {
            static ROWS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
        }
        return ROWS.with(|block| {
            let mut block = block.borrow_mut();
            if block.len() < rows * k {
                block.resize(rows * k, 0.0);
            }
            for (r, out) in block.chunks_exact_mut(k.max(1)).take(rows).enumerate() {
                // SAFETY: row r0+r, columns 0..k are inside the source view, contiguous along
                // k, whose elements are 16 bits.
                let run = unsafe { std::slice::from_raw_parts(base.add((r0 + r) * s_w), k) };
                crate::convert::widen(src.storage, run, out);
            }
            let widened = RawMat {
                ptr: block.as_ptr().cast(),
                storage: Storage::F32,
                rows,
                cols: k,
                rs: k,
                cs: 1,
            };
            pack_f32_panel(panel, widened, 0, w)
        });
    }
    if rows < w {
        panel.fill(0.0);
    }
    for (p, out) in panel.chunks_exact_mut(w).enumerate() {
        if s_w == 1 {
            // SAFETY: rows r0..r0+rows of column p are inside the source view, contiguous
            // along rows, whose elements are 16 bits.
            let run = unsafe { std::slice::from_raw_parts(base.add(r0 + p * s_k), rows) };
            crate::convert::widen(src.storage, run, &mut out[..rows]);
        } else {
            for (r, o) in out[..rows].iter_mut().enumerate() {
                // SAFETY: (r0+r, p) is inside the source view, whose elements are 16 bits.
                let h = unsafe { *base.add((r0 + r) * s_w + p * s_k) };
                *o = match src.storage {
                    Storage::Bf16 => bf16_to_f32(h),
                    _ => f16_value_of(h),
                };
            }
        }
    }
}

/// How many k steps ahead the strided copy in [`pack_f32_panel`] prefetches its source (16
/// lines, about 50 ns of copying: enough to cover an L3 hit on Zen 4; 64 and 160 steps measured
/// the same).
const COPY_AHEAD: usize = 16;

/// Packs rows `r0 .. r0 + w` of an `f32` source (clipped, rest zero) into `panel`. On x86-64
/// with AVX the whole pack is compiled for AVX, with the block transposes called directly (and
/// inlined): in the baseline build every 16-float piece was four SSE moves behind a jump on its
/// length, and every 4 × 4 block an indirect call (`docs/KERNELS.md`, "... packing compiled for
/// AVX"). On aarch64 (NEON is baseline) the transposes are called directly too.
fn pack_f32_panel(panel: &mut [f32], src: RawMat, r0: usize, w: usize) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: the CPU has AVX (checked just above).
        return unsafe { pack_f32_panel_avx(panel, src, r0, w) };
    }
    #[cfg(target_arch = "aarch64")]
    return pack_f32_panel_with(crate::arch::transpose::AARCH64_NEON, panel, src, r0, w);
    #[allow(unreachable_code)]
    pack_f32_panel_with(transposes(), panel, src, r0, w)
}

/// [`pack_f32_panel`] compiled for AVX.
///
/// # Safety
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn pack_f32_panel_avx(panel: &mut [f32], src: RawMat, r0: usize, w: usize) {
    pack_f32_panel_with(crate::arch::transpose::X86_AVX, panel, src, r0, w)
}

#[inline(always)]
fn pack_f32_panel_with(t: Transposes, panel: &mut [f32], src: RawMat, r0: usize, w: usize) {
    let k = src.cols;
    let rows = w.min(src.rows - r0);
    let (s_w, s_k) = (src.rs, src.cs);
    let base = src.f32_ptr();
    if rows < w {
        panel.fill(0.0);
    }
    if s_w == 1 {
        // Contiguous along the panel: copy `rows` floats per k step. Each step reads another
        // row of the source; with a row stride of a page or more no hardware prefetcher
        // follows, so the piece COPY_AHEAD steps on is asked for now.
        // SAFETY: rows r0..r0+rows of every column are inside the source view, which is
        // contiguous along rows here; rows <= w.
        unsafe { copy_strip(&mut panel[..k * w], base, r0, s_k, rows, w) };
    } else if s_k == 1 {
        // Contiguous along k: a transpose, in 8 × 8, 4 × 4 and 2 × 4 SIMD blocks of rows ×
        // k steps (`arch::transpose`), each walking its rows along k so every row is one
        // sequential stream. Those streams are short (kc floats) and every panel starts `w`
        // new ones, too few lines each for the hardware prefetchers to pick up; so each
        // block also asks for the same columns of the next panel's rows, one cache line
        // (16 floats) per row at a time: they arrive while this panel is packed.
        // One call per block size (not a loop over the three), so that where `t` is a
        // constant the block transposes are called directly and inlined.
        let mut r = 0;
        r = transpose_rows(t.t8, 8, 8, r, panel, src, r0, w);
        r = transpose_rows(t.t4, 4, 4, r, panel, src, r0, w);
        r = transpose_rows(t.t2x4, 2, 4, r, panel, src, r0, w);
        for r in r..rows {
            scatter_row_tail(panel, src, r0, r, 0, w);
        }
    } else {
        for (p, out) in panel.chunks_exact_mut(w).enumerate() {
            for (r, o) in out[..rows].iter_mut().enumerate() {
                // SAFETY: (r0+r, p) is inside the source view.
                *o = unsafe { *base.add((r0 + r) * s_w + p * s_k) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::bf16_to_f32;

    const F32_WORDS: PanelFormat = PanelFormat {
        operand: Operand::F32,
        prec: Precision::F32,
    };

    /// Packs the `len × k` source with strides (rs, cs) into `w`-row panels and compares every
    /// packed element with the definition (zeros past the last row).
    fn check_pack(w: usize, k: usize, len: usize, rs: usize, cs: usize) {
        let size = len * rs + k * cs + 1;
        let data: Vec<f32> = (0..size).map(|i| i as f32 + 0.25).collect();
        let src = RawMat::f32(data.as_ptr(), len, k, rs, cs);
        let panels = len.div_ceil(w);
        let mut got = vec![f32::NAN; panels * w * k];
        pack_panels(F32_WORDS, Side::A, &mut got, src, w);
        for pi in 0..panels {
            for p in 0..k {
                for r in 0..w {
                    let row = pi * w + r;
                    let want = if row < len {
                        data[row * rs + p * cs]
                    } else {
                        0.0
                    };
                    assert_eq!(
                        got[pi * w * k + p * w + r],
                        want,
                        "w={w} k={k} len={len} rs={rs} cs={cs} row={row} p={p}"
                    );
                }
            }
        }
    }

    /// Whole blocks of several panels (partial last panel), every stride kind.
    #[test]
    fn blocks_match_the_definition() {
        for &(w, k, len) in &[
            (12, 37, 100),
            (32, 5, 64),
            (8, 1, 17),
            (12, 16, 12),
            (4, 9, 3),
        ] {
            for (rs, cs) in [(1, len + 3), (k + 1, 1), (3, 3 * len + 2)] {
                check_pack(w, k, len, rs, cs);
            }
        }
    }

    /// Single panels of every height up to `w` on awkward widths: each pack path (contiguous
    /// along the panel, along k, neither), including the SIMD transposes' leftovers.
    #[test]
    fn packs_match_the_definition() {
        for &(w, k) in &[
            (12, 37),
            (32, 9),
            (8, 8),
            (16, 1),
            (4, 5),
            (13, 20),
            (48, 17),
            (6, 10),
            (10, 7),
        ] {
            for rows in [1, 2, 3, 4, 6, 7, 8, w - 1, w] {
                let rows = rows.min(w);
                for (rs, cs) in [(1, rows + 2), (k + 3, 1), (2, 2 * rows + 1)] {
                    check_pack(w, k, rows, rs, cs);
                }
            }
        }
    }

    /// Rounding packs give the f32 pack rounded element by element, and bf16 pairs hold the
    /// rounded elements 2q (low half) and 2q + 1 (high half), zero past an odd k.
    #[test]
    fn rounding_and_pair_packs_match_the_f32_pack() {
        let (w, len) = (8, 11);
        for k in [1, 2, 5, 16] {
            for (rs, cs) in [(1, len + 1), (k + 2, 1)] {
                let data: Vec<f32> = (0..len * rs + k * cs + 1)
                    .map(|i| 1.0 + i as f32 * 1.001e-3)
                    .collect();
                let src = RawMat::f32(data.as_ptr(), len, k, rs, cs);
                let panels = len.div_ceil(w);
                let mut plain = vec![0.0; panels * w * k];
                pack_panels(F32_WORDS, Side::A, &mut plain, src, w);
                for prec in [Precision::Bf16, Precision::F16] {
                    let fmt = PanelFormat {
                        operand: Operand::F32,
                        prec,
                    };
                    let mut got = vec![f32::NAN; panels * w * k];
                    pack_panels(fmt, Side::A, &mut got, src, w);
                    for (g, p) in got.iter().zip(&plain) {
                        assert_eq!(g.to_bits(), prec.round(*p).to_bits());
                    }
                }
                let fmt = PanelFormat {
                    operand: Operand::F16,
                    prec: Precision::F16,
                };
                let mut dense = vec![f32::NAN; panels * k * w / 2];
                pack_panels(fmt, Side::A, &mut dense, src, w);
                let mut bcast = vec![f32::NAN; panels * k * w];
                pack_panels(fmt, Side::B, &mut bcast, src, w);
                for (i, p) in plain.iter().enumerate() {
                    let h = f16_bits_of(*p);
                    let word = dense[i / 2].to_bits();
                    assert_eq!((word >> (16 * (i % 2))) as u16, h, "k={k} element {i}");
                    assert_eq!(bcast[i].to_bits(), u32::from(h) * 0x1_0001);
                    assert_eq!(crate::precision::f16_to_f32(h), Precision::F16.round(*p));
                }
                let fmt = PanelFormat {
                    operand: Operand::Bf16Pairs,
                    prec: Precision::Bf16,
                };
                let kw = k.div_ceil(2);
                let mut got = vec![f32::NAN; panels * kw * w];
                pack_panels(fmt, Side::A, &mut got, src, w);
                for pi in 0..panels {
                    for q in 0..kw {
                        for r in 0..w {
                            let bits = got[pi * kw * w + q * w + r].to_bits();
                            let at = |p: usize| {
                                if p < k {
                                    Precision::Bf16.round(plain[pi * k * w + p * w + r])
                                } else {
                                    0.0
                                }
                            };
                            assert_eq!(bf16_to_f32(bits as u16), at(2 * q), "k={k} q={q} r={r}");
                            assert_eq!(bf16_to_f32((bits >> 16) as u16), at(2 * q + 1));
                        }
                    }
                }
            }
        }
    }
}

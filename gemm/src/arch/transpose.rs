//! Small SIMD transposes for the transposing pack (`pack.rs`): a source block that is contiguous
//! along k (a row-major A, or the Bᵀ of a row-major B) must be written k-major into a micro-panel.
//!
//! A block transpose reads `R` rows of `Q` consecutive floats (row `r` starts at `src + r·s_w`)
//! and writes them as `Q` runs of `R` floats (run `q` starts at `dst + q·w`), so that
//! `dst[q·w + r] = src[r·s_w + q]`, for R × Q = 8 × 8, 4 × 4 and 2 × 4 (the last two rows of a
//! 6- or 10-wide micro-panel: the AVX2 and NEON kernels' nr = 6, SVE's 10). x86-64 uses AVX for
//! 8 × 8 and SSE for the others; aarch64 uses NEON (8 × 8 is four 4 × 4 blocks). Other targets
//! fall back to plain loops.

/// A block transpose: `(src, s_w, dst, w)`.
///
/// # Safety
/// `src + r·s_w + q` must be readable and `dst + q·w + r` writable for all `r < R`, `q < Q`,
/// where R × Q is the block of the function.
pub type TransposeFn = unsafe fn(*const f32, usize, *mut f32, usize);

/// The 8 × 8, 4 × 4 and 2 × 4 block transposes this CPU runs best, chosen once.
#[derive(Clone, Copy)]
pub struct Transposes {
    pub t8: TransposeFn,
    pub t4: TransposeFn,
    /// 2 rows of 4 floats into 4 runs of 2.
    pub t2x4: TransposeFn,
}

/// The x86-64 transposes with AVX, for code compiled for AVX (which calls them directly).
#[cfg(target_arch = "x86_64")]
pub const X86_AVX: Transposes = Transposes {
    t8: x86::t8_avx,
    t4: x86::t4_sse,
    t2x4: x86::t2x4_sse,
};

/// The aarch64 transposes (NEON is part of the baseline), for direct calls.
#[cfg(target_arch = "aarch64")]
pub const AARCH64_NEON: Transposes = Transposes {
    t8: neon::t8,
    t4: neon::t4,
    t2x4: neon::t2x4,
};

/// The transposes for this CPU (detected on first use).
pub fn transposes() -> Transposes {
    static T: std::sync::OnceLock<Transposes> = std::sync::OnceLock::new();
    *T.get_or_init(detect)
}

fn detect() -> Transposes {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx") {
        return X86_AVX;
    }
    #[cfg(target_arch = "x86_64")]
    return Transposes {
        t8: scalar::<8, 8>,
        t4: x86::t4_sse,
        t2x4: x86::t2x4_sse,
    };
    #[cfg(target_arch = "aarch64")]
    return AARCH64_NEON;
    #[allow(unreachable_code)]
    Transposes {
        t8: scalar::<8, 8>,
        t4: scalar::<4, 4>,
        t2x4: scalar::<2, 4>,
    }
}

/// The plain-loop transpose of R rows × Q floats, also the reference the SIMD versions are
/// tested against.
///
/// # Safety
/// As for [`TransposeFn`] with block R × Q.
pub unsafe fn scalar<const R: usize, const Q: usize>(
    src: *const f32,
    s_w: usize,
    dst: *mut f32,
    w: usize,
) {
    for r in 0..R {
        for q in 0..Q {
            // SAFETY: r < R, q < Q; the caller guarantees both addresses are valid.
            unsafe { *dst.add(q * w + r) = *src.add(r * s_w + q) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// 8 × 8 with AVX: unpack pairs of rows, shuffle quads, then swap 128-bit lanes.
    ///
    /// # Safety
    /// [`super::TransposeFn`] with `S = 8`, and the CPU has AVX (checked by `detect`).
    #[inline]
    pub unsafe fn t8_avx(src: *const f32, s_w: usize, dst: *mut f32, w: usize) {
        // SAFETY: forwarded contract.
        unsafe { t8_avx_inner(src, s_w, dst, w) }
    }

    #[target_feature(enable = "avx")]
    #[inline]
    unsafe fn t8_avx_inner(src: *const f32, s_w: usize, dst: *mut f32, w: usize) {
        // SAFETY: rows r < 8 hold 8 readable floats at src + r·s_w (caller's contract).
        let r: [__m256; 8] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(src.add(i * s_w)) });
        // t[2i] = [a0 b0 a1 b1 | a4 b4 a5 b5], t[2i+1] = [a2 b2 a3 b3 | a6 b6 a7 b7] for rows a, b.
        let t: [__m256; 8] = std::array::from_fn(|i| {
            let (a, b) = (r[(i / 2) * 2], r[(i / 2) * 2 + 1]);
            if i % 2 == 0 {
                _mm256_unpacklo_ps(a, b)
            } else {
                _mm256_unpackhi_ps(a, b)
            }
        });
        // s[j] for rows 0-3 (j < 4) and rows 4-7 (j >= 4): columns (j%4) | (j%4 + 4).
        let s: [__m256; 8] = std::array::from_fn(|j| {
            let base = (j / 4) * 4;
            let (x, y) = match j % 4 {
                0 | 1 => (t[base], t[base + 2]),
                _ => (t[base + 1], t[base + 3]),
            };
            if j % 2 == 0 {
                _mm256_shuffle_ps::<0x44>(x, y)
            } else {
                _mm256_shuffle_ps::<0xEE>(x, y)
            }
        });
        for q in 0..4 {
            let lo = _mm256_permute2f128_ps::<0x20>(s[q], s[q + 4]);
            let hi = _mm256_permute2f128_ps::<0x31>(s[q], s[q + 4]);
            // SAFETY: runs q and q + 4 hold 8 writable floats at dst + q·w (caller's contract).
            unsafe {
                _mm256_storeu_ps(dst.add(q * w), lo);
                _mm256_storeu_ps(dst.add((q + 4) * w), hi);
            }
        }
    }

    /// 4 × 4 with SSE (part of the x86-64 baseline).
    ///
    /// # Safety
    /// [`super::TransposeFn`] with `S = 4`.
    #[inline]
    pub unsafe fn t4_sse(src: *const f32, s_w: usize, dst: *mut f32, w: usize) {
        // SAFETY: rows r < 4 hold 4 readable floats at src + r·s_w (caller's contract).
        let [a, b, c, d]: [__m128; 4] =
            std::array::from_fn(|i| unsafe { _mm_loadu_ps(src.add(i * s_w)) });
        let (ab_lo, ab_hi) = (_mm_unpacklo_ps(a, b), _mm_unpackhi_ps(a, b));
        let (cd_lo, cd_hi) = (_mm_unpacklo_ps(c, d), _mm_unpackhi_ps(c, d));
        let out = [
            _mm_movelh_ps(ab_lo, cd_lo),
            _mm_movehl_ps(cd_lo, ab_lo),
            _mm_movelh_ps(ab_hi, cd_hi),
            _mm_movehl_ps(cd_hi, ab_hi),
        ];
        for (q, v) in out.into_iter().enumerate() {
            // SAFETY: run q < 4 holds 4 writable floats at dst + q·w (caller's contract).
            unsafe { _mm_storeu_ps(dst.add(q * w), v) };
        }
    }

    /// 2 × 4 with SSE: interleave the two rows, store 64-bit halves.
    ///
    /// # Safety
    /// [`super::TransposeFn`] with R × Q = 2 × 4.
    #[inline]
    pub unsafe fn t2x4_sse(src: *const f32, s_w: usize, dst: *mut f32, w: usize) {
        // SAFETY: rows r < 2 hold 4 readable floats at src + r·s_w (caller's contract).
        let (a, b) = unsafe { (_mm_loadu_ps(src), _mm_loadu_ps(src.add(s_w))) };
        let (lo, hi) = (_mm_unpacklo_ps(a, b), _mm_unpackhi_ps(a, b));
        let out = [lo, _mm_movehl_ps(lo, lo), hi, _mm_movehl_ps(hi, hi)];
        for (q, v) in out.into_iter().enumerate() {
            // SAFETY: run q < 4 holds 2 writable floats at dst + q·w (caller's contract);
            // `_mm_storeu_si64` writes the low 8 bytes, with no alignment requirement.
            unsafe { _mm_storeu_si64(dst.add(q * w) as *mut u8, _mm_castps_si128(v)) };
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    /// 4 × 4 with NEON: TRN1/TRN2 on 32-bit then on 64-bit lanes.
    ///
    /// # Safety
    /// [`super::TransposeFn`] with `S = 4`.
    #[inline]
    pub unsafe fn t4(src: *const f32, s_w: usize, dst: *mut f32, w: usize) {
        // SAFETY: rows r < 4 hold 4 readable floats at src + r·s_w (caller's contract).
        let [a, b, c, d]: [float32x4_t; 4] =
            std::array::from_fn(|i| unsafe { vld1q_f32(src.add(i * s_w)) });
        let (ab1, ab2) = (vtrn1q_f32(a, b), vtrn2q_f32(a, b));
        let (cd1, cd2) = (vtrn1q_f32(c, d), vtrn2q_f32(c, d));
        let f = vreinterpretq_f64_f32;
        let out = [
            vtrn1q_f64(f(ab1), f(cd1)),
            vtrn1q_f64(f(ab2), f(cd2)),
            vtrn2q_f64(f(ab1), f(cd1)),
            vtrn2q_f64(f(ab2), f(cd2)),
        ];
        for (q, v) in out.into_iter().enumerate() {
            // SAFETY: run q < 4 holds 4 writable floats at dst + q·w (caller's contract).
            unsafe { vst1q_f32(dst.add(q * w), vreinterpretq_f32_f64(v)) };
        }
    }

    /// 2 × 4 with NEON: ZIP1/ZIP2 of the two rows, stored as 64-bit halves.
    ///
    /// # Safety
    /// [`super::TransposeFn`] with R × Q = 2 × 4.
    #[inline]
    pub unsafe fn t2x4(src: *const f32, s_w: usize, dst: *mut f32, w: usize) {
        // SAFETY: rows r < 2 hold 4 readable floats at src + r·s_w (caller's contract).
        let (a, b) = unsafe { (vld1q_f32(src), vld1q_f32(src.add(s_w))) };
        let (lo, hi) = (vzip1q_f32(a, b), vzip2q_f32(a, b));
        let out = [
            vget_low_f32(lo),
            vget_high_f32(lo),
            vget_low_f32(hi),
            vget_high_f32(hi),
        ];
        for (q, v) in out.into_iter().enumerate() {
            // SAFETY: run q < 4 holds 2 writable floats at dst + q·w (caller's contract).
            unsafe { vst1_f32(dst.add(q * w), v) };
        }
    }

    /// 8 × 8 as four 4 × 4 blocks.
    ///
    /// # Safety
    /// [`super::TransposeFn`] with `S = 8`.
    #[inline]
    pub unsafe fn t8(src: *const f32, s_w: usize, dst: *mut f32, w: usize) {
        for (br, bq) in [(0, 0), (0, 4), (4, 0), (4, 4)] {
            // SAFETY: the 4 × 4 block at rows br.., columns bq.. lies inside the 8 × 8 block.
            unsafe { t4(src.add(br * s_w + bq), s_w, dst.add(bq * w + br), w) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `f` on an R × Q block with padded strides; every float outside the block untouched.
    fn check(f: TransposeFn, rows: usize, q_len: usize) {
        let (s_w, w) = (q_len + 3, rows + 5);
        let src: Vec<f32> = (0..rows * s_w).map(|i| i as f32).collect();
        let mut got = vec![-1.0f32; q_len * w];
        let mut want = got.clone();
        // SAFETY: src holds `rows` rows of s_w >= q_len floats; dst holds q_len runs of
        // w >= rows floats.
        unsafe { f(src.as_ptr(), s_w, got.as_mut_ptr(), w) };
        for r in 0..rows {
            for q in 0..q_len {
                want[q * w + r] = src[r * s_w + q];
            }
        }
        assert_eq!(got, want, "block {rows} x {q_len}");
    }

    #[test]
    fn simd_transposes_match_the_definition() {
        let t = transposes();
        check(t.t8, 8, 8);
        check(t.t4, 4, 4);
        check(t.t2x4, 2, 4);
        check(scalar::<8, 8>, 8, 8);
        check(scalar::<4, 4>, 4, 4);
        check(scalar::<2, 4>, 2, 4);
    }
}

//! Runs of 16-bit values (their bits) widened to `f32`, and `f32` runs rounded to 16 bits (to
//! nearest even): plain loops over the branch-free converters of [`crate::precision`],
//! compiled for the widest x86 vectors the CPU has. Every variant does the same integer and
//! float operations, so all give the same bits. The packs and the tiles written into 16-bit D
//! use them, and fugu's rows stored in 16 bits.

use crate::precision::{bf16_to_f32, f16_bits_of, f16_value_of, round_bf16, Storage};

/// `dst[i] = src[i]` widened exactly from 16-bit `storage` (bits) to `f32`.
pub fn widen(storage: Storage, src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "convert::widen: lengths differ");
    match storage {
        Storage::Bf16 => widen_bf16(src, dst),
        Storage::F16 => widen_f16(src, dst),
        Storage::F32 => panic!("convert::widen: f32 is not a 16-bit storage"),
    }
}

/// `dst[i] = src[i]` rounded to 16-bit `storage` (to nearest even), as bits.
pub fn round(storage: Storage, src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "convert::round: lengths differ");
    match storage {
        Storage::Bf16 => round_to_bf16(src, dst),
        Storage::F16 => round_to_f16(src, dst),
        Storage::F32 => panic!("convert::round: f32 is not a 16-bit storage"),
    }
}

/// A conversion loop `$name(src, dst)` over `$body`, run as an AVX-512 or AVX2 variant where
/// the CPU has one.
macro_rules! dispatch_x86 {
    ($name:ident($src:ty, $dst:ty) = $body:expr) => {
        fn $name(src: &[$src], dst: &mut [$dst]) {
            #[inline(always)]
            fn body(src: &[$src], dst: &mut [$dst]) {
                dst.iter_mut().zip(src).for_each(|(d, &s)| *d = $body(s));
            }
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw")]
                unsafe fn avx512(src: &[$src], dst: &mut [$dst]) {
                    body(src, dst)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2(src: &[$src], dst: &mut [$dst]) {
                    body(src, dst)
                }
                if std::arch::is_x86_feature_detected!("avx512bw") {
                    // SAFETY: the CPU has AVX-512 F and BW (checked just above).
                    return unsafe { avx512(src, dst) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has AVX2 and FMA (checked just above).
                    return unsafe { avx2(src, dst) };
                }
            }
            body(src, dst)
        }
    };
}

dispatch_x86!(widen_bf16(u16, f32) = bf16_to_f32);
dispatch_x86!(widen_f16(u16, f32) = f16_value_of);
// The branch-free rounding (bit for bit `f32_to_bf16`, NaN payloads included), so that the
// loop vectorises.
dispatch_x86!(round_to_bf16(f32, u16) = |x: f32| (round_bf16(x).to_bits() >> 16) as u16);
dispatch_x86!(round_to_f16(f32, u16) = f16_bits_of);

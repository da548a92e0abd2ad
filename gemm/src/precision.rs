//! The arithmetic of a GEMM's products ([`Precision`]) and the exact conversions between `f32`
//! and the two 16-bit float formats (IEEE binary16 and bfloat16), bit by bit, shared with the
//! `fugu` crate (checkpoints, the CPU backend's low-precision storage, CUDA uploads).

use crate::error::GemmError;
use std::fmt;

/// The arithmetic of a GEMM's products: A and B are rounded to this type (to nearest even) as
/// they are packed, and the products are accumulated in `f32`. A product of two 16-bit values
/// is exact in `f32` (8 + 8 or 11 + 11 significant bits, at most 24), so a 16-bit GEMM equals the
/// `f32` GEMM of the rounded operands up to the order of the sums, whichever kernel runs it:
/// a native one (`vdpbf16ps` on AVX-512 BF16) or the `f32` kernel after a rounding pack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Precision {
    /// `f32` operands.
    #[default]
    F32,
    /// bfloat16 operands (8 significant bits, the range of `f32`).
    Bf16,
    /// IEEE binary16 operands (11 significant bits; beyond ±65504 an operand becomes ±inf).
    F16,
}

impl Precision {
    /// Every precision.
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::Bf16, Precision::F16];

    /// The lower-case name (`f32`, `bf16`, `f16`) used by `--dtype`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }

    /// Parses a name as printed by [`Precision::name`].
    pub fn parse(s: &str) -> Result<Precision, GemmError> {
        let t = s.trim().to_ascii_lowercase();
        Precision::ALL
            .iter()
            .copied()
            .find(|p| p.name() == t)
            .ok_or_else(|| GemmError::Config {
                what: "precision".into(),
                value: s.to_string(),
                expected: "one of f32, bf16, f16".into(),
            })
    }

    /// Unit roundoff (half the distance from 1 to the next representable value): the relative
    /// error of one rounding to nearest, for normal numbers.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Precision::F32 => f64::powi(2.0, -24),
            Precision::Bf16 => f64::powi(2.0, -8),
            Precision::F16 => f64::powi(2.0, -11),
        }
    }

    /// `x` rounded to this type (nearest even; overflow to ±inf in `f16`).
    #[inline(always)]
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::F32 => x,
            Precision::Bf16 => round_bf16(x),
            Precision::F16 => round_f16(x),
        }
    }

    /// Rounds every element of `xs` to this type in place (nothing to do for `f32`).
    pub fn round_slice(self, xs: &mut [f32]) {
        match self {
            Precision::F32 => {}
            Precision::Bf16 => xs.iter_mut().for_each(|x| *x = round_bf16(*x)),
            Precision::F16 => xs.iter_mut().for_each(|x| *x = round_f16(*x)),
        }
    }
}

/// How the elements of an input matrix are stored: `f32`, or the bits of a 16-bit float
/// ([`half::f16`], [`half::bf16`]), converted exactly to `f32` as the matrix is packed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Storage {
    F32,
    F16,
    Bf16,
}

impl Storage {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Storage::F32 => 4,
            Storage::F16 | Storage::Bf16 => 2,
        }
    }

    /// Whether every value stored this way is a value of `prec`, so that packing at `prec`
    /// needs no rounding (a bf16 matrix at `Precision::Bf16`, anything at `Precision::F32`).
    pub(crate) fn exact_in(self, prec: Precision) -> bool {
        matches!(
            (self, prec),
            (_, Precision::F32) | (Storage::Bf16, Precision::Bf16) | (Storage::F16, Precision::F16)
        )
    }
}

/// An element type A and B may be given in: `f32`, [`half::f16`] or [`half::bf16`]. The GEMM's
/// [`Precision`] is separate: an `f16` matrix multiplied at `Precision::F16` is packed without
/// rounding; at `Precision::F32` its exact `f32` values are used; at `Precision::Bf16` they
/// are rounded to bfloat16.
pub trait Element: Copy + Send + Sync + sealed::Sealed + 'static {
    /// How this type is stored.
    const STORAGE: Storage;
}

impl Element for f32 {
    const STORAGE: Storage = Storage::F32;
}

impl Element for half::f16 {
    const STORAGE: Storage = Storage::F16;
}

impl Element for half::bf16 {
    const STORAGE: Storage = Storage::Bf16;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// `x` rounded to the nearest `bf16` value (ties to even; NaNs as [`f32_to_bf16`] keeps them),
/// without branches, so that loops over it vectorise: `bf16_to_f32(f32_to_bf16(x))` for every
/// `f32` (tested). The rounding pack of bf16 GEMMs on `f32` operands runs it on every element.
#[inline(always)]
pub fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    // A NaN keeps its top half, made quiet where the fraction bits kept would all be zero.
    let top = b & 0xffff_0000;
    let kept_nan = if b & 0x007f_0000 == 0 {
        top | 0x0040_0000
    } else {
        top
    };
    let is_nan = b & 0x7fff_ffff > 0x7f80_0000;
    f32::from_bits(if is_nan { kept_nan } else { rounded })
}

/// `x` rounded to the nearest `f16` value (ties to even; ±inf past 65504, the NaNs kept), in
/// `f32` arithmetic without branches, so that loops over it vectorise: the same result as
/// `f16_to_f32(f32_to_f16(x))` for every `f32` (tested), several times faster.
///
/// Adding `m = 2^(e+13)` to `|x|` in `[2^e, 2^(e+1))` leaves a sum whose last bit is worth
/// `2^(e-10)`: the f32 addition rounds `|x|` to 11 significant bits, to nearest even, and
/// subtracting `m` is exact. Below f16's normal range (`e < -14`) `m` stays at `2^-1`, which
/// rounds to multiples of `2^-24`, f16's subnormal step. A result above 65504 (the ties at
/// 65520 round up to 65536) is f16's overflow, ±inf.
#[inline(always)]
pub fn round_f16(x: f32) -> f32 {
    // Clamped so that m stays finite; anything this large becomes inf below anyway.
    let ax = x.abs().min(131_072.0);
    let m = f32::from_bits((ax.to_bits() & 0x7f80_0000) + (13 << 23)).max(0.5);
    let r = (ax + m) - m;
    let r = if r > 65_504.0 { f32::INFINITY } else { r };
    if x.is_nan() {
        x
    } else {
        r.copysign(x)
    }
}

/// The f16 bits of `x` rounded to nearest even: [`f32_to_f16`] without branches that block
/// vectorisation (the packs of f16 kernels use it; a NaN becomes the quiet NaN 0x7e00).
#[inline(always)]
pub fn f16_bits_of(x: f32) -> u16 {
    let r = round_f16(x);
    let b = r.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let a = r.abs();
    // Subnormal (and zero): an integer number of 2^-24 steps, exact. Normal: re-bias the
    // exponent (f32 bias 127, f16 bias 15) and keep the top 10 fraction bits, exact because r
    // is an f16 value. inf and NaN by their patterns.
    let sub = (a * 16_777_216.0) as u32 as u16;
    let normal = ((b & 0x7fff_ffff).wrapping_sub(112 << 23) >> 13) as u16;
    let mag = if a < 6.103_515_6e-5 {
        sub
    } else if a == f32::INFINITY {
        0x7c00
    } else if a.is_nan() {
        0x7e00
    } else {
        normal
    };
    sign | mag
}

/// `f16` bits to `f32` (exact): [`f16_to_f32`] without branches that block vectorisation.
/// The bits shifted into an f32's exponent and fraction fields read 2^112 times too small
/// (f32's exponent bias 127 against f16's 15, subnormals included), so one exact product
/// scales them; infinities and NaNs (exponent 0x1f) take f32's all-ones exponent instead.
#[inline(always)]
pub fn f16_value_of(h: u16) -> f32 {
    let mag = ((h & 0x7fff) as u32) << 13;
    let scaled = f32::from_bits(mag) * f32::from_bits(0x7780_0000); // 2^112
    let special = f32::from_bits(mag | 0x7f80_0000);
    let v = if h & 0x7c00 == 0x7c00 {
        special
    } else {
        scaled
    };
    f32::from_bits(v.to_bits() | (((h & 0x8000) as u32) << 16))
}

/// `f16` bits to `f32` (exact).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        0 if man == 0 => sign,
        // Subnormal: man * 2^-24, exact in f32.
        0 => sign | (man as f32 * (1.0 / 16_777_216.0)).to_bits(),
        0x1f => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// `f32` to `f16` bits, rounding to nearest even; overflow gives ±inf, NaN payloads are kept
/// (so `f16 → f32 → f16` is the identity for every bit pattern).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        let m = (man >> 13) as u16;
        return sign | 0x7c00 | if man != 0 && m == 0 { 0x200 } else { m };
    }
    let e = exp - 112; // f16 biased exponent
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    let round = |v: u32, shift: u32, rem: u32| {
        let half = 1u32 << (shift - 1);
        if rem > half || (rem == half && v & 1 == 1) {
            v + 1
        } else {
            v
        }
    };
    if e <= 0 {
        if e < -10 {
            return sign; // below half the smallest subnormal
        }
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let v = round(m >> shift, shift, m & ((1 << shift) - 1));
        return sign | v as u16; // a carry into 0x400 is the smallest normal, as it should be
    }
    let v = round(((e as u32) << 10) | (man >> 13), 13, man & 0x1fff);
    sign | v as u16 // a carry into exponent 0x1f is inf, as it should be
}

/// `bf16` bits to `f32` (exact). Inlined into callers' loops (other crates' too: without
/// it each element is a call, and a loop of them is not vectorised).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `f32` to `bf16` bits, rounding to nearest even; NaN payloads are kept where they fit.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        let h = (b >> 16) as u16;
        return if h & 0x7f != 0 { h } else { h | 0x40 };
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The branch-free decoding equals the exact converter on every f16 bit pattern (NaNs
    /// keep their payload too).
    #[test]
    fn fast_f16_decoding_matches_the_converter_on_every_pattern() {
        for h in 0..=u16::MAX {
            assert_eq!(
                f16_value_of(h).to_bits(),
                f16_to_f32(h).to_bits(),
                "{h:#06x}"
            );
        }
    }

    /// The branch-free rounding equals the bit converter's on a stride through every f32 bit
    /// pattern (both signs, zeros, subnormals, every exponent, inf, NaN) and on every f16
    /// value, midpoint and neighbour of a midpoint.
    #[test]
    fn fast_f16_rounding_matches_the_bit_converter() {
        let check = |x: f32| {
            let want = f16_to_f32(f32_to_f16(x));
            let got = round_f16(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x:e} ({:#010x}): {got:e} vs {want:e}",
                x.to_bits()
            );
        };
        let mut bits: u32 = 0;
        while let Some(next) = bits.checked_add(9_973) {
            check(f32::from_bits(bits));
            bits = next;
        }
        for h in 0..0x7c00u16 {
            let a = f16_to_f32(h);
            let b = if h == 0x7bff {
                65_536.0
            } else {
                f16_to_f32(h + 1)
            };
            let mid = ((a as f64 + b as f64) / 2.0) as f32;
            for x in [
                a,
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                check(x);
                check(-x);
            }
        }
        for x in [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MAX,
            65_519.99,
            65_520.0,
        ] {
            check(x);
        }
    }

    /// The branch-free bf16 rounding gives the converters' bits exactly (NaN payloads too) on a
    /// stride through every f32 bit pattern and, for every bf16 value of both signs, on the
    /// patterns around its rounding tie (where the half below it is 0x8000) and its NaN cases.
    #[test]
    fn fast_bf16_rounding_matches_the_bit_converters() {
        let check = |bits: u32| {
            let x = f32::from_bits(bits);
            let want = bf16_to_f32(f32_to_bf16(x)).to_bits();
            assert_eq!(round_bf16(x).to_bits(), want, "{x:e} ({bits:#010x})");
        };
        let mut bits: u32 = 0;
        while let Some(next) = bits.checked_add(7_919) {
            check(bits);
            bits = next;
        }
        for top in 0..=u32::from(u16::MAX) {
            for low in [0, 1, 0x7fff, 0x8000, 0x8001, 0xffff] {
                check((top << 16) | low);
            }
        }
    }

    /// The branch-free bits equal the converter's for every non-NaN f32 on a stride, and every
    /// f16 value round-trips.
    #[test]
    fn fast_f16_bits_match_the_converter() {
        let mut bits: u32 = 0;
        while let Some(next) = bits.checked_add(7_919) {
            let x = f32::from_bits(bits);
            if !x.is_nan() {
                assert_eq!(f16_bits_of(x), f32_to_f16(x), "{x:e} ({bits:#010x})");
            } else {
                assert!(f16_to_f32(f16_bits_of(x)).is_nan());
            }
            bits = next;
        }
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            if !x.is_nan() {
                assert_eq!(f16_bits_of(x), h, "{h:#06x}");
            }
        }
    }

    #[test]
    fn names_parse_back_and_round_matches_the_bit_converters() {
        for p in Precision::ALL {
            assert_eq!(Precision::parse(&p.name().to_uppercase()).unwrap(), p);
        }
        assert!(Precision::parse("fp8").is_err());
        let xs = [1.0f32 + f32::EPSILON, -3.3e-3, 7.0e4, 1e-9, f32::NAN];
        let mut r = xs;
        Precision::Bf16.round_slice(&mut r);
        for (x, r) in xs.iter().zip(r) {
            assert_eq!(r.to_bits(), bf16_to_f32(f32_to_bf16(*x)).to_bits());
        }
        let mut r = xs;
        Precision::F16.round_slice(&mut r);
        assert_eq!(r[2], f32::INFINITY, "f16 overflows past 65504");
        assert_eq!(r[1], f16_to_f32(f32_to_f16(-3.3e-3)));
        let mut r = xs;
        Precision::F32.round_slice(&mut r);
        assert_eq!(r[0], xs[0]);
    }

    #[test]
    fn f16_round_trips_every_bit_pattern_and_rounds_to_even() {
        for h in 0..=u16::MAX {
            assert_eq!(f32_to_f16(f16_to_f32(h)), h, "{h:#06x}");
        }
        // Midpoints between neighbours (positive finite, and the overflow midpoint 65520)
        // round to the even one; anything off the midpoint goes to the nearer one.
        for h in 0..0x7c00u16 {
            let a = f16_to_f32(h) as f64;
            // Past the largest finite value (0x7bff), the next step would be 65536.
            let b = if h == 0x7bff {
                65536.0
            } else {
                f16_to_f32(h + 1) as f64
            };
            let mid = ((a + b) / 2.0) as f32; // exact: needs 12 significant bits
            let even = if h & 1 == 0 { h } else { h + 1 };
            assert_eq!(f32_to_f16(mid), even, "midpoint after {h:#06x}");
            assert_eq!(f32_to_f16(-mid), even | 0x8000);
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(f32_to_f16(below), h, "below the midpoint after {h:#06x}");
            assert_eq!(
                f32_to_f16(above),
                h + 1,
                "above the midpoint after {h:#06x}"
            );
        }
        assert_eq!(f32_to_f16(1.0), 0x3c00);
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(1e6), 0x7c00);
        assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xfc00);
        assert_eq!(f32_to_f16(1e-9), 0);
        assert!(f16_to_f32(f32_to_f16(f32::NAN)).is_nan());
    }

    #[test]
    fn bf16_round_trips_and_rounds_to_even() {
        for h in 0..=u16::MAX {
            let x = bf16_to_f32(h);
            assert_eq!(f32_to_bf16(x), h, "{h:#06x}");
        }
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie, even below
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie, even above
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80); // rounds up to inf
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
    }
}

//! Element types of backend buffers ([`Dtype`]) and the exact conversions between `f32` and
//! the two 16-bit float formats (IEEE binary16 and bfloat16), shared by the checkpoint reader
//! and writer (safetensors `F16`/`BF16`), the CPU backend's low-precision storage and the CUDA
//! backend's uploads and downloads.

use serde::{Deserialize, Serialize};

/// Element type of a backend buffer. Ops compute in `f32` whatever their operands' storage
/// type; a low-precision buffer holds only values its type can represent, rounded to nearest
/// even when written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    /// Short name (`f32`, `bf16`, `f16`), as in logs and the CUDA kernels' name suffixes.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }

    /// Unit roundoff (half the distance from 1 to the next representable value): the relative
    /// error bound of one rounding to nearest, for normal numbers.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Dtype::F32 => f64::powi(2.0, -24),
            Dtype::Bf16 => f64::powi(2.0, -8),
            Dtype::F16 => f64::powi(2.0, -11),
        }
    }

    /// `x` rounded to this type (nearest even; overflow to ±inf in `f16`).
    pub fn round(self, x: f32) -> f32 {
        match self {
            Dtype::F32 => x,
            Dtype::Bf16 => bf16_to_f32(f32_to_bf16(x)),
            Dtype::F16 => f16_to_f32(f32_to_f16(x)),
        }
    }

    /// Rounds every element of `xs` to this type in place (no-op for `f32`).
    pub fn round_slice(self, xs: &mut [f32]) {
        if self != Dtype::F32 {
            xs.iter_mut().for_each(|x| *x = self.round(*x));
        }
    }

    /// `xs` encoded as this type's little-endian bytes (`out` is cleared first).
    pub fn encode(self, xs: &[f32], out: &mut Vec<u8>) {
        out.clear();
        out.reserve(xs.len() * self.bytes());
        match self {
            Dtype::F32 => xs
                .iter()
                .for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            Dtype::Bf16 => xs
                .iter()
                .for_each(|&x| out.extend_from_slice(&f32_to_bf16(x).to_le_bytes())),
            Dtype::F16 => xs
                .iter()
                .for_each(|&x| out.extend_from_slice(&f32_to_f16(x).to_le_bytes())),
        }
    }

    /// Decodes this type's little-endian bytes into `out` (`bytes.len() == out.len() *
    /// self.bytes()`).
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        assert_eq!(
            bytes.len(),
            out.len() * self.bytes(),
            "decode: length mismatch"
        );
        match self {
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::Bf16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
            Dtype::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
                }
            }
        }
    }
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

/// `bf16` bits to `f32` (exact).
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `f32` to `bf16` bits, rounding to nearest even; NaN payloads are kept where they fit.
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
    fn round_and_byte_codecs_agree() {
        let xs = [1.0f32, -2.5e-3, 3.1, 7.0e4, -1e-9, 0.0];
        for d in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let mut bytes = Vec::new();
            d.encode(&xs, &mut bytes);
            assert_eq!(bytes.len(), xs.len() * d.bytes());
            let mut back = [0.0f32; 6];
            d.decode(&bytes, &mut back);
            let mut rounded = xs;
            d.round_slice(&mut rounded);
            assert_eq!(back.map(f32::to_bits), rounded.map(f32::to_bits), "{d:?}");
            for (&x, &r) in xs.iter().zip(&rounded) {
                if r.is_finite() && x.abs() > 1e-4 {
                    assert!(
                        ((r - x) / x).abs() as f64 <= d.unit_roundoff(),
                        "{d:?} {x} {r}"
                    );
                }
            }
        }
        assert_eq!(Dtype::F16.round(7.0e4), f32::INFINITY);
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

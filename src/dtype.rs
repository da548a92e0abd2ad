//! Element types of backend buffers ([`Dtype`]) and the exact conversions between `f32` and
//! the two 16-bit float formats (IEEE binary16 and bfloat16), shared by the checkpoint reader
//! and writer (safetensors `F16`/`BF16`), the CPU backend's low-precision storage and the CUDA
//! backend's uploads and downloads.

pub use fugu_gemm::precision::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
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

    /// The GEMM arithmetic of operands of this type.
    pub fn precision(self) -> fugu_gemm::Precision {
        match self {
            Dtype::F32 => fugu_gemm::Precision::F32,
            Dtype::Bf16 => fugu_gemm::Precision::Bf16,
            Dtype::F16 => fugu_gemm::Precision::F16,
        }
    }

    /// The storage type of GEMM operands of precision `p`.
    pub fn of_precision(p: fugu_gemm::Precision) -> Dtype {
        match p {
            fugu_gemm::Precision::F32 => Dtype::F32,
            fugu_gemm::Precision::Bf16 => Dtype::Bf16,
            fugu_gemm::Precision::F16 => Dtype::F16,
        }
    }

    /// Unit roundoff (half the distance from 1 to the next representable value): the relative
    /// error bound of one rounding to nearest, for normal numbers.
    pub fn unit_roundoff(self) -> f64 {
        self.precision().unit_roundoff()
    }

    /// `x` rounded to this type (nearest even; overflow to ±inf in `f16`).
    pub fn round(self, x: f32) -> f32 {
        self.precision().round(x)
    }

    /// Rounds every element of `xs` to this type in place (no-op for `f32`).
    pub fn round_slice(self, xs: &mut [f32]) {
        self.precision().round_slice(xs)
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

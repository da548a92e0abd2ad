//! SVE row kernels (`asm!`), vector-length agnostic.
//!
//! Every kernel is one predicated loop: `whilelo` builds the predicate of each vector from the
//! element index and the row length, so the last partial vector needs no scalar tail, and a
//! load or store never touches an element outside its slice (inactive lanes are not accessed).
//! The f32 kernels handle two vectors per iteration and the f64 sums four, as independent
//! chains: A64FX's floating-point latency is 9 cycles on two pipes, so one chain per iteration
//! leaves the pipes mostly idle (what the compiler's loop for `exp` does).
//!
//! Register map (all kernels):
//!
//! | registers | use |
//! |---|---|
//! | `z0`–`z7`, `z8`–`z15` | the two chains' values and temporaries (`z8`–`z15` = `z0`–`z7` + 8) |
//! | `z16`–`z23` | the exponential's constants ([`EXP_CONSTS`]); AdamW's own constants |
//! | `z24`–`z29` | the kernel's own constants (broadcast from its constant array) |
//! | `z28`–`z31` | accumulators of the reductions (kernels without constants there) |
//! | `p0` | all true (`ptrue p0.s`, which is also all true for 64-bit elements) |
//! | `p1`–`p4` | the chains' predicates (`whilelo`) |
//!
//! ## The exponential
//! `e^x = 2^n · e^r` with `n = x/ln2` rounded to a multiple of 1/64 and `|r| ≤ ln2/128`. The
//! rounding is the "shift" trick: `z = x·(1/ln2) + (1.5·2^17 + 127)` leaves `n`'s 1/64ths in the
//! low 6 bits of `z` and `⌊n⌋ + 127` in the next 8, exactly the input `fexpa` takes, so one
//! `fexpa` gives `2^n` from its 64-entry table of `2^(i/64)`. `e^r − 1 ≈ p = r + r²/2`
//! (truncation `r³/6` ≤ 2.7·10⁻⁸ relative at `|r| ≤ ln2/128`, under half an ulp), and
//! `e^x = s + s·p` (one `fmad`): 12 instructions per vector, `movprfx` counted (A64FX issues it
//! as an instruction of its own). Inputs are
//! clamped to [−87.3, 88.7] as in fugu's portable `exp_f32` (the exponent field then stays in
//! 1..=254, the result is a normal number; NaN propagates through `fmax`/`fmin`). Accuracy:
//! within 2 ulp of the correctly rounded result over the whole range (tested).
//!
//! ## Reciprocals and square roots
//! A64FX's `fdiv`/`fsqrt` are long and not pipelined, so `1/d` is `frecpe` (8 bits) refined by
//! two Newton steps (`frecps`), and `1/√v` is `frsqrte` with two `frsqrts` steps: about 1 ulp.

use core::arch::asm;

/// Elements per block of [`Sve::sum_exp`]: each block is summed in f32 lanes, the blocks'
/// sums are added in f64 (as fugu's portable `sum_exp` does).
pub const SUM_EXP_BLOCK: usize = 512;

/// The exponential's constants, broadcast into `z16`–`z23`: clamp low and high, the shift,
/// 1/ln2, ln2 split in a high part with trailing zeros and the rest, the polynomial's 1/2, and
/// one unused slot.
pub const EXP_CONSTS: [f32; 8] = [
    -87.3,
    88.7,
    196_735.0, // 1.5·2^17 + 127 (0x1.803f8p17)
    core::f32::consts::LOG2_E,
    LN2_HI,
    LN2_LO,
    0.5,
    0.0,
];
const LN2_HI: f32 = 0.693_145_751_953_125; // 0x1.62e4p-1
const LN2_LO: f32 = (core::f64::consts::LN_2 - LN2_HI as f64) as f32;

/// The 16-bit formats the `*_half` kernels read and write, as bits (`u16`): each value is
/// widened to f32 exactly, the kernel computes as its f32 form does, and each result is
/// rounded to nearest even once (overflow to infinity, subnormals kept, NaN quiet), so a
/// `*_half` kernel gives the bits of its f32 form run on the widened row and rounded after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    /// IEEE binary16.
    F16,
    /// bfloat16.
    Bf16,
}

/// Proof that the CPU has SVE: the kernels are methods of this token, so they are safe to call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sve {
    lanes: usize,
}

impl Sve {
    /// The token, or `None` when the CPU has no SVE.
    pub fn detect() -> Option<Sve> {
        if std::arch::is_aarch64_feature_detected!("sve") {
            // SAFETY: the CPU has SVE (checked just above).
            Some(Sve {
                lanes: unsafe { cntw() },
            })
        } else {
            None
        }
    }

    /// f32 lanes of one vector (16 on A64FX).
    pub fn f32_lanes(&self) -> usize {
        self.lanes
    }

    /// `row[j] = scale · exp(row[j] − max)` in place.
    pub fn exp_scale(&self, row: &mut [f32], max: f32, scale: f32) {
        let k = with_exp_consts(&[max, scale]);
        // SAFETY: `self` proves SVE; the kernel reads and writes `row[..len]` only.
        unsafe { exp_scale(row.as_mut_ptr(), row.len(), k.as_ptr()) }
    }

    /// `Σ exp(x − max)` over a row: each [`SUM_EXP_BLOCK`] elements summed in f32 lanes, the
    /// blocks added in order in f64.
    pub fn sum_exp(&self, row: &[f32], max: f32) -> f64 {
        let k = with_exp_consts(&[max]);
        row.chunks(SUM_EXP_BLOCK)
            // SAFETY: `self` proves SVE; the kernel reads `block[..len]` only.
            .map(|block| unsafe { sum_exp(block.as_ptr(), block.len(), k.as_ptr()) } as f64)
            .sum()
    }

    /// `row[j] = exp(row[j] − max)` in place, returning their sum: the same exponentials as
    /// [`Sve::exp_scale`] with scale 1 and the same sum as [`Sve::sum_exp`], in one pass (a
    /// softmax then needs one exponential per element and [`Sve::scale`]).
    pub fn exp_sum(&self, row: &mut [f32], max: f32) -> f64 {
        let k = with_exp_consts(&[max]);
        row.chunks_mut(SUM_EXP_BLOCK)
            // SAFETY: `self` proves SVE; the kernel reads and writes `block[..len]` only.
            .map(|block| unsafe { exp_sum(block.as_mut_ptr(), block.len(), k.as_ptr()) } as f64)
            .sum()
    }

    /// `row[j] *= scale` in place.
    pub fn scale(&self, row: &mut [f32], scale: f32) {
        // SAFETY: `self` proves SVE; the kernel reads and writes `row[..len]` only.
        unsafe { scale_row(row.as_mut_ptr(), row.len(), &scale) }
    }

    /// Softmax backward of one row, in place: `d = a·(d − Σ d·a)` with `a` the softmax output
    /// and `d` its gradient (the sum in f32, two vectors of lanes, then `faddv`).
    pub fn softmax_backward(&self, d: &mut [f32], a: &[f32]) {
        assert_eq!(d.len(), a.len(), "softmax_backward: lengths differ");
        let n = d.len();
        // SAFETY: `self` proves SVE; reads `d`, `a[..n]`.
        let s = unsafe { dot(d.as_ptr(), a.as_ptr(), n) };
        // SAFETY: `self` proves SVE; reads `a[..n]`, reads and writes `d[..n]`.
        unsafe { softmax_backward_update(d.as_mut_ptr(), a.as_ptr(), n, &s) }
    }

    /// GELU, tanh form, written as `x·σ(2u)` with `u = √(2/π)·(x + 0.044715·x³)` (the same
    /// function: `(1 + tanh u)/2 = σ(2u)`); `out` is overwritten.
    pub fn gelu(&self, out: &mut [f32], inp: &[f32]) {
        assert_eq!(out.len(), inp.len(), "gelu: lengths differ");
        let k = with_exp_consts(&gelu_consts());
        // SAFETY: `self` proves SVE; the kernel reads `inp[..len]`, writes `out[..len]`.
        unsafe { gelu(out.as_mut_ptr(), inp.as_ptr(), inp.len(), k.as_ptr()) }
    }

    /// `dinp = dout · gelu'(inp)` with `gelu' = s + x·s(1−s)·(2k + 6k·0.044715·x²)`,
    /// `s = σ(2u) = 1/(1 + e)`, `e = e^{−2u}`, and `1 − s = e·s` (not `1 − s`, which cancels
    /// for large x); `dinp` is overwritten.
    pub fn gelu_backward(&self, dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
        assert_eq!(dinp.len(), inp.len(), "gelu_backward: dinp length");
        assert_eq!(dout.len(), inp.len(), "gelu_backward: dout length");
        let k = with_exp_consts(&gelu_consts());
        // SAFETY: `self` proves SVE; the kernel reads `inp`/`dout[..len]`, writes `dinp[..len]`.
        unsafe {
            gelu_backward(
                dinp.as_mut_ptr(),
                inp.as_ptr(),
                dout.as_ptr(),
                inp.len(),
                k.as_ptr(),
            )
        }
    }

    /// `out[j] = x[j]` rounded to the 16-bit format (to nearest even; [`Half`]).
    pub fn round_half(&self, fmt: Half, out: &mut [u16], x: &[f32]) {
        assert_eq!(out.len(), x.len(), "round_half: lengths differ");
        let (y, xp, n) = (out.as_mut_ptr(), x.as_ptr(), x.len());
        // SAFETY: `self` proves SVE; the kernel reads `x[..len]`, writes `out[..len]`.
        unsafe {
            match fmt {
                Half::F16 => round_f16(y, xp, n),
                Half::Bf16 => round_bf16(y, xp, n),
            }
        }
    }

    /// `out[j] = x[j]` widened from the 16-bit format to f32 (exact; [`Half`]).
    pub fn widen_half(&self, fmt: Half, out: &mut [f32], x: &[u16]) {
        assert_eq!(out.len(), x.len(), "widen_half: lengths differ");
        let (y, xp, n) = (out.as_mut_ptr(), x.as_ptr(), x.len());
        // SAFETY: `self` proves SVE; the kernel reads `x[..len]`, writes `out[..len]`.
        unsafe {
            match fmt {
                Half::F16 => widen_f16(y, xp, n),
                Half::Bf16 => widen_bf16(y, xp, n),
            }
        }
    }

    /// [`Sve::gelu`] on 16-bit rows ([`Half`]).
    pub fn gelu_half(&self, fmt: Half, out: &mut [u16], inp: &[u16]) {
        assert_eq!(out.len(), inp.len(), "gelu_half: lengths differ");
        let k = with_exp_consts(&gelu_consts());
        let (y, x, n) = (out.as_mut_ptr(), inp.as_ptr(), inp.len());
        // SAFETY: `self` proves SVE; the kernel reads `inp[..len]`, writes `out[..len]`.
        unsafe {
            match fmt {
                Half::F16 => gelu_f16(y, x, n, k.as_ptr()),
                Half::Bf16 => gelu_bf16(y, x, n, k.as_ptr()),
            }
        }
    }

    /// [`Sve::gelu_backward`] on 16-bit rows ([`Half`]).
    pub fn gelu_backward_half(&self, fmt: Half, dinp: &mut [u16], inp: &[u16], dout: &[u16]) {
        assert_eq!(dinp.len(), inp.len(), "gelu_backward_half: dinp length");
        assert_eq!(dout.len(), inp.len(), "gelu_backward_half: dout length");
        let k = with_exp_consts(&gelu_consts());
        let (d, x, g, n) = (dinp.as_mut_ptr(), inp.as_ptr(), dout.as_ptr(), inp.len());
        // SAFETY: `self` proves SVE; the kernel reads `inp`/`dout[..len]`, writes `dinp[..len]`.
        unsafe {
            match fmt {
                Half::F16 => gelu_backward_f16(d, x, g, n, k.as_ptr()),
                Half::Bf16 => gelu_backward_bf16(d, x, g, n, k.as_ptr()),
            }
        }
    }

    /// `Σ x` in f64 (each element converted exactly, summed in `4·VL/2` f64 lanes).
    pub fn sum_f64(&self, x: &[f32]) -> f64 {
        // SAFETY: `self` proves SVE; the kernel reads `x[..len]` only.
        unsafe { sum_f64(x.as_ptr(), x.len()) }
    }

    /// `Σ (x − c)²` in f64 (the sum of squares with `c = 0`; layernorm's variance with
    /// `c` = the mean).
    pub fn sum_sq_dev_f64(&self, x: &[f32], c: f64) -> f64 {
        // SAFETY: `self` proves SVE; the kernel reads `x[..len]` only.
        unsafe { sum_sq_dev_f64(x.as_ptr(), x.len(), &c) }
    }

    /// One layernorm row: `out = (x − mean)·rstd·w + bias` with the mean and the biased
    /// variance summed in f64 (two passes), `rstd = 1/√(var + eps)`; returns `(mean, rstd)`
    /// rounded to f32, the values the normalisation used.
    pub fn layernorm_row(
        &self,
        out: &mut [f32],
        x: &[f32],
        w: &[f32],
        bias: &[f32],
        eps: f64,
    ) -> (f32, f32) {
        let c = layernorm_lengths("layernorm_row", out.len(), x.len(), w, bias);
        let (mu, rs) = row_stats(c, eps, || self.sum_f64(x), |mu| self.sum_sq_dev_f64(x, mu));
        // SAFETY: `self` proves SVE; reads `x`, `w`, `bias[..c]`, writes `out[..c]`.
        unsafe {
            normalise(
                out.as_mut_ptr(),
                x.as_ptr(),
                w.as_ptr(),
                bias.as_ptr(),
                c,
                [mu, rs].as_ptr(),
            )
        }
        (mu, rs)
    }

    /// [`Sve::sum_f64`] of a 16-bit row ([`Half`]).
    pub fn sum_f64_half(&self, fmt: Half, x: &[u16]) -> f64 {
        let (xp, n) = (x.as_ptr(), x.len());
        // SAFETY: `self` proves SVE; the kernels read `x[..len]` only.
        unsafe {
            match fmt {
                Half::F16 => sum_f64_f16(xp, n),
                Half::Bf16 => sum_f64_bf16(xp, n),
            }
        }
    }

    /// [`Sve::sum_sq_dev_f64`] of a 16-bit row ([`Half`]).
    pub fn sum_sq_dev_f64_half(&self, fmt: Half, x: &[u16], c: f64) -> f64 {
        let (xp, n) = (x.as_ptr(), x.len());
        // SAFETY: `self` proves SVE; the kernels read `x[..len]` only.
        unsafe {
            match fmt {
                Half::F16 => sum_sq_dev_f64_f16(xp, n, &c),
                Half::Bf16 => sum_sq_dev_f64_bf16(xp, n, &c),
            }
        }
    }

    /// [`Sve::layernorm_row`] on a 16-bit row ([`Half`]: `x` and `out`; `w`, `bias` f32).
    pub fn layernorm_row_half(
        &self,
        fmt: Half,
        out: &mut [u16],
        x: &[u16],
        w: &[f32],
        bias: &[f32],
        eps: f64,
    ) -> (f32, f32) {
        let c = layernorm_lengths("layernorm_row_half", out.len(), x.len(), w, bias);
        let (mu, rs) = row_stats(
            c,
            eps,
            || self.sum_f64_half(fmt, x),
            |mu| self.sum_sq_dev_f64_half(fmt, x, mu),
        );
        let (y, xp, k) = (out.as_mut_ptr(), x.as_ptr(), [mu, rs]);
        let (wp, bp) = (w.as_ptr(), bias.as_ptr());
        // SAFETY: `self` proves SVE; reads `x`, `w`, `bias[..c]`, writes `out[..c]`.
        unsafe {
            match fmt {
                Half::F16 => normalise_f16(y, xp, wp, bp, c, k.as_ptr()),
                Half::Bf16 => normalise_bf16(y, xp, wp, bp, c, k.as_ptr()),
            }
        }
        (mu, rs)
    }

    /// One row of layernorm's input gradient: `dinp += rstd·(g − mean(g) − x̂·mean(g·x̂))` with
    /// `g = dout·w`, `x̂ = (x − mean)·rstd`, the two means summed in f64.
    pub fn layernorm_backward_row(
        &self,
        dinp: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        mean: f32,
        rstd: f32,
    ) {
        let c = x.len();
        assert!(c > 0, "layernorm_backward_row: empty row");
        assert!(
            dinp.len() == c && dout.len() == c && w.len() == c,
            "layernorm_backward_row: dinp, dout and w must have the row's length {c}"
        );
        let mut sums = [0.0f64; 2];
        // SAFETY: `self` proves SVE; reads `dout`, `x`, `w[..c]`, writes `sums`.
        unsafe {
            ln_backward_sums(
                dout.as_ptr(),
                x.as_ptr(),
                w.as_ptr(),
                c,
                [mean, rstd].as_ptr(),
                sums.as_mut_ptr(),
            )
        }
        let inv_c = 1.0 / c as f64;
        let k = [
            mean,
            rstd,
            (sums[0] * inv_c) as f32,
            (sums[1] * inv_c) as f32,
        ];
        // SAFETY: `self` proves SVE; reads `dout`, `x`, `w[..c]`, reads and writes `dinp[..c]`.
        unsafe {
            ln_backward_update(
                dinp.as_mut_ptr(),
                dout.as_ptr(),
                x.as_ptr(),
                w.as_ptr(),
                c,
                k.as_ptr(),
            )
        }
    }

    /// The AdamW update of one chunk (fugu's `ops::adamw`, the same per-step scalars):
    /// `g' = g·scale`, `p ·= decay`, `m = β1·m + (1−β1)·g'`, `v = β2·v + (1−β2)·g'²`,
    /// `p += neg_step · m / (√v / bc2_sqrt + eps)`.
    pub fn adamw(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], k: &AdamWScalars) {
        let n = p.len();
        assert!(
            g.len() == n && m.len() == n && v.len() == n,
            "adamw: p, g, m and v must have the same length"
        );
        let consts = [
            k.scale,
            k.decay,
            k.beta1,
            k.one_m_b1,
            k.beta2,
            k.one_m_b2,
            k.neg_step_size,
            1.0 / k.bc2_sqrt,
            k.eps,
        ];
        // SAFETY: `self` proves SVE; reads `g[..n]`, reads and writes `p`, `m`, `v[..n]`.
        unsafe {
            adamw(
                p.as_mut_ptr(),
                g.as_ptr(),
                m.as_mut_ptr(),
                v.as_mut_ptr(),
                n,
                consts.as_ptr(),
            )
        }
    }
}

/// A layernorm row's length `c`, checked: not empty, and `out`, `w`, `bias` of length `c`.
fn layernorm_lengths(what: &str, out: usize, c: usize, w: &[f32], bias: &[f32]) -> usize {
    assert!(c > 0, "{what}: empty row");
    assert!(
        out == c && w.len() == c && bias.len() == c,
        "{what}: out, w and bias must have the row's length {c}"
    );
    c
}

/// A row's mean and `1/√(var + eps)` (the biased variance), summed in f64 by `sum` and
/// `sum_sq_dev` (about a centre), rounded to f32.
fn row_stats(
    c: usize,
    eps: f64,
    sum: impl FnOnce() -> f64,
    sum_sq_dev: impl FnOnce(f64) -> f64,
) -> (f32, f32) {
    let mu = sum() / c as f64;
    let var = sum_sq_dev(mu) / c as f64;
    (mu as f32, (1.0 / (var + eps).sqrt()) as f32)
}

/// The scalars of one AdamW step (see [`Sve::adamw`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    pub scale: f32,
    pub decay: f32,
    pub beta1: f32,
    pub one_m_b1: f32,
    pub beta2: f32,
    pub one_m_b2: f32,
    pub neg_step_size: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
}

/// GELU's constants after the exponential's: 1, 0.044715, −2k, 2k, 6k·0.044715 (k = √(2/π)),
/// and [`GELU_ZERO_BELOW`].
fn gelu_consts() -> [f32; 6] {
    let k = (2.0 / core::f64::consts::PI).sqrt();
    let a = 0.044715f64;
    [
        1.0,
        a as f32,
        (-2.0 * k) as f32,
        (2.0 * k) as f32,
        (6.0 * k * a) as f32,
        GELU_ZERO_BELOW,
    ]
}

/// GELU and its derivative are 0 below this input: |gelu(−10)| ≈ 1.2·10⁻³⁷, and below it the
/// exponential's clamp (e^88.7 at most) would leave `x·σ(2u)` at `x·3·10⁻³⁹` instead of 0
/// for huge |x|.
const GELU_ZERO_BELOW: f32 = -10.0;

/// [`EXP_CONSTS`] followed by a kernel's own constants (at most 8; the rest zero).
fn with_exp_consts(own: &[f32]) -> [f32; 16] {
    let mut k = [0.0f32; 16];
    k[..8].copy_from_slice(&EXP_CONSTS);
    k[8..8 + own.len()].copy_from_slice(own);
    k
}

/// # Safety
/// The CPU must support SVE.
#[target_feature(enable = "sve")]
unsafe fn cntw() -> usize {
    let n: usize;
    // SAFETY: `cntw` only reads the vector length; the caller guarantees SVE.
    unsafe { asm!("cntw {n}", n = out(reg) n, options(pure, nomem, nostack, preserves_flags)) };
    n
}

/// Broadcasts `{k}[0..8]` into z16–z23 and `{k}[8..8+n]` into z24.. (the first `n` of them).
macro_rules! load_consts {
    (exp) => {
        concat!(
            "ld1rw {{z16.s}}, p0/z, [{k}]\n",
            "ld1rw {{z17.s}}, p0/z, [{k}, #4]\n",
            "ld1rw {{z18.s}}, p0/z, [{k}, #8]\n",
            "ld1rw {{z19.s}}, p0/z, [{k}, #12]\n",
            "ld1rw {{z20.s}}, p0/z, [{k}, #16]\n",
            "ld1rw {{z21.s}}, p0/z, [{k}, #20]\n",
            "ld1rw {{z22.s}}, p0/z, [{k}, #24]\n",
            "ld1rw {{z23.s}}, p0/z, [{k}, #28]\n",
        )
    };
    ($($z:literal @ $off:literal),+) => {
        concat!($("ld1rw {{z", $z, ".s}}, p0/z, [{k}, #", $off, "]\n",)+)
    };
}

/// `z$r = exp(z$x)` for each chain `(x, z, n, r)` (`x` is clamped in place, `z` and `n` are
/// temporaries), the chains' instructions interleaved step by step. Needs [`EXP_CONSTS`] in
/// z16–z23 and `p0` all true.
macro_rules! exp_vecs {
    ($(($x:literal, $z:literal, $n:literal, $r:literal)),+) => {
        concat!(
            // Clamp (NaN propagates).
            $("fmax z", $x, ".s, p0/m, z", $x, ".s, z16.s\n",)+
            $("fmin z", $x, ".s, p0/m, z", $x, ".s, z17.s\n",)+
            // z = x/ln2 + shift: n's 1/64ths and biased integer part in z's low bits.
            $("movprfx z", $z, ", z18\n", "fmla z", $z, ".s, p0/m, z", $x, ".s, z19.s\n",)+
            $("fsub z", $n, ".s, z", $z, ".s, z18.s\n",)+
            // r = x − n·ln2 (two parts).
            $("movprfx z", $r, ", z", $x, "\n", "fmls z", $r, ".s, p0/m, z", $n, ".s, z20.s\n",)+
            $("fmls z", $r, ".s, p0/m, z", $n, ".s, z21.s\n",)+
            // s = 2^n.
            $("fexpa z", $n, ".s, z", $z, ".s\n",)+
            // p = r + r²/2.
            $("fmul z", $z, ".s, z", $r, ".s, z", $r, ".s\n",)+
            $("fmla z", $r, ".s, p0/m, z", $z, ".s, z22.s\n",)+
            // e^x = s + s·p (fmad: p·s + s, into p's register).
            $("fmad z", $r, ".s, p0/m, z", $n, ".s, z", $n, ".s\n",)+
        )
    };
}

/// `z$y = 1/z$d` for each chain `(d, y, t)`: `frecpe` and two Newton steps.
macro_rules! recip_vecs {
    ($(($d:literal, $y:literal, $t:literal)),+) => {
        concat!(
            $("frecpe z", $y, ".s, z", $d, ".s\n",)+
            $("frecps z", $t, ".s, z", $d, ".s, z", $y, ".s\n",)+
            $("fmul z", $y, ".s, z", $y, ".s, z", $t, ".s\n",)+
            $("frecps z", $t, ".s, z", $d, ".s, z", $y, ".s\n",)+
            $("fmul z", $y, ".s, z", $y, ".s, z", $t, ".s\n",)+
        )
    };
}

/// Head of a two-chain loop over `{n}` elements of size `$t` (`s` or `d`): predicates `p1`
/// (elements `{i}..`) and `p2` (`{j} = {i} + {vl}..`), exits to `4:` when `p1` is empty.
/// `{vl}` holds the lanes per vector.
macro_rules! loop2_head {
    ($t:literal) => {
        concat!(
            "mov {i}, #0\n",
            "3:\n",
            "whilelo p1.",
            $t,
            ", {i}, {n}\n",
            "b.none 4f\n",
            "add {j}, {i}, {vl}\n",
            "whilelo p2.",
            $t,
            ", {j}, {n}\n",
        )
    };
}

/// Tail of a two-chain loop: next pair of vectors.
macro_rules! loop2_tail {
    () => {
        concat!("add {i}, {j}, {vl}\n", "b 3b\n", "4:\n")
    };
}

/// Loads of both chains at `{$ptr}[{i}..]` (predicate `p1`) and `[{j}..]` (`p2`) into `z$r1`
/// and `z$r2` as f32, from a row of `$fmt` elements (`f32` when not given): 16-bit elements
/// are loaded into 32-bit lanes (`ld1h`) and widened exactly (`f16`: `fcvt`; `bf16`: the bits
/// shifted into the high half).
macro_rules! ld2 {
    ($r1:literal, $r2:literal, $ptr:literal) => {
        ld2!(f32, $r1, $r2, $ptr)
    };
    (f32, $r1:literal, $r2:literal, $ptr:literal) => {
        concat!(
            "ld1w {{z",
            $r1,
            ".s}}, p1/z, [{",
            $ptr,
            "}, {i}, lsl #2]\n",
            "ld1w {{z",
            $r2,
            ".s}}, p2/z, [{",
            $ptr,
            "}, {j}, lsl #2]\n",
        )
    };
    (f16, $r1:literal, $r2:literal, $ptr:literal) => {
        concat!(
            ld2!(half, $r1, $r2, $ptr),
            "fcvt z",
            $r1,
            ".s, p0/m, z",
            $r1,
            ".h\n",
            "fcvt z",
            $r2,
            ".s, p0/m, z",
            $r2,
            ".h\n",
        )
    };
    (bf16, $r1:literal, $r2:literal, $ptr:literal) => {
        concat!(
            ld2!(half, $r1, $r2, $ptr),
            "lsl z",
            $r1,
            ".s, z",
            $r1,
            ".s, #16\n",
            "lsl z",
            $r2,
            ".s, z",
            $r2,
            ".s, #16\n",
        )
    };
    (half, $r1:literal, $r2:literal, $ptr:literal) => {
        concat!(
            "ld1h {{z",
            $r1,
            ".s}}, p1/z, [{",
            $ptr,
            "}, {i}, lsl #1]\n",
            "ld1h {{z",
            $r2,
            ".s}}, p2/z, [{",
            $ptr,
            "}, {j}, lsl #1]\n",
        )
    };
}

/// Stores of both chains' f32 vectors `z$r1` (`p1`, `[{i}..]`) and `z$r2` (`p2`, `[{j}..]`)
/// into a row of `$fmt` elements (`f32` when not given), rounded to nearest even: `f16` by
/// `fcvt` (in place; overflow to infinity, subnormals kept); `bf16` by integer rounding into
/// the temporaries `z$t1`/`z$t2` (`z$u1`/`z$u2` and `p3`/`p4` for NaN lanes, which keep their
/// payload's top bits and are made quiet), as `fugu_gemm::precision` rounds.
macro_rules! st2 {
    ($r1:literal, $r2:literal, $ptr:literal) => {
        st2!(f32, $r1, $r2, $ptr, (0, 0), (0, 0))
    };
    (f32, $r1:literal, $r2:literal, $ptr:literal, $tmp1:tt, $tmp2:tt) => {
        concat!(
            "st1w {{z",
            $r1,
            ".s}}, p1, [{",
            $ptr,
            "}, {i}, lsl #2]\n",
            "st1w {{z",
            $r2,
            ".s}}, p2, [{",
            $ptr,
            "}, {j}, lsl #2]\n",
        )
    };
    (f16, $r1:literal, $r2:literal, $ptr:literal, $tmp1:tt, $tmp2:tt) => {
        concat!(
            "fcvt z",
            $r1,
            ".h, p0/m, z",
            $r1,
            ".s\n",
            "fcvt z",
            $r2,
            ".h, p0/m, z",
            $r2,
            ".s\n",
            "st1h {{z",
            $r1,
            ".s}}, p1, [{",
            $ptr,
            "}, {i}, lsl #1]\n",
            "st1h {{z",
            $r2,
            ".s}}, p2, [{",
            $ptr,
            "}, {j}, lsl #1]\n",
        )
    };
    (bf16, $r1:literal, $r2:literal, $ptr:literal, ($t1:literal, $u1:literal), ($t2:literal, $u2:literal)) => {
        concat!(
            bf16_round!($r1, $t1, $u1, 3),
            bf16_round!($r2, $t2, $u2, 4),
            "st1h {{z",
            $t1,
            ".s}}, p1, [{",
            $ptr,
            "}, {i}, lsl #1]\n",
            "st1h {{z",
            $t2,
            ".s}}, p2, [{",
            $ptr,
            "}, {j}, lsl #1]\n",
        )
    };
}

/// `z$t` = the bfloat16 bits of `z$r`'s f32 values, rounded to nearest even
/// (`(b + 0x7fff + ((b >> 16) & 1)) >> 16`), NaN lanes (`p$p`) `(b >> 16) | 0x40` (quiet);
/// `z$u` is a temporary. Needs `p0` all true.
macro_rules! bf16_round {
    ($r:literal, $t:literal, $u:literal, $p:literal) => {
        concat!(
            "lsr z",
            $t,
            ".s, z",
            $r,
            ".s, #16\n",
            "and z",
            $t,
            ".s, z",
            $t,
            ".s, #1\n",
            "add z",
            $t,
            ".s, z",
            $t,
            ".s, z",
            $r,
            ".s\n",
            "add z",
            $t,
            ".s, z",
            $t,
            ".s, #128, lsl #8\n",
            "sub z",
            $t,
            ".s, z",
            $t,
            ".s, #1\n",
            "lsr z",
            $t,
            ".s, z",
            $t,
            ".s, #16\n",
            "fcmuo p",
            $p,
            ".s, p0/z, z",
            $r,
            ".s, z",
            $r,
            ".s\n",
            "lsr z",
            $u,
            ".s, z",
            $r,
            ".s, #16\n",
            "orr z",
            $u,
            ".s, z",
            $u,
            ".s, #0x40\n",
            "sel z",
            $t,
            ".s, p",
            $p,
            ", z",
            $u,
            ".s, z",
            $t,
            ".s\n",
        )
    };
}

/// `asm!` with what every kernel has: the loop registers `{i}`, `{j}` (element indices) and
/// `{vl}` (lanes per vector), and all z registers (as v0–v31) and p0–p4 clobbered.
macro_rules! sve_asm {
    ($($t:tt)*) => {
        asm!(
            $($t)*
            i = out(reg) _,
            j = out(reg) _,
            vl = out(reg) _,
            out("v0") _, out("v1") _, out("v2") _, out("v3") _,
            out("v4") _, out("v5") _, out("v6") _, out("v7") _,
            out("v8") _, out("v9") _, out("v10") _, out("v11") _,
            out("v12") _, out("v13") _, out("v14") _, out("v15") _,
            out("v16") _, out("v17") _, out("v18") _, out("v19") _,
            out("v20") _, out("v21") _, out("v22") _, out("v23") _,
            out("v24") _, out("v25") _, out("v26") _, out("v27") _,
            out("v28") _, out("v29") _, out("v30") _, out("v31") _,
            out("p0") _, out("p1") _, out("p2") _, out("p3") _, out("p4") _,
            options(nostack),
        )
    };
}

/// # Safety
/// SVE; `row[..n]` readable and writable; `k[..10]`: [`EXP_CONSTS`], max, scale.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn exp_scale(row: *mut f32, n: usize, k: *const f32) {
    // SAFETY: loads and stores are predicated on index < n (whilelo), so they touch
    // row[..n] only; the constants are read from k[..10]. All registers used are clobbered.
    unsafe {
        sve_asm!(
            "ptrue p0.s",
            "cntw {vl}",
            load_consts!(exp),
            load_consts!(24 @ 32, 25 @ 36),
            loop2_head!("s"),
            ld2!(0, 8, "x"),
            "fsub z0.s, z0.s, z24.s",
            "fsub z8.s, z8.s, z24.s",
            exp_vecs!((0, 1, 2, 3), (8, 9, 10, 11)),
            "fmul z0.s, z3.s, z25.s",
            "fmul z8.s, z11.s, z25.s",
            st2!(0, 8, "x"),
            loop2_tail!(),
            x = in(reg) row,
            n = in(reg) n,
            k = in(reg) k,
        );
    }
}

/// `Σ exp(x − max)` in f32 over `x[..n]` (VL lanes in two chains, then `faddv`).
///
/// # Safety
/// SVE; `x[..n]` readable; `k[..9]`: [`EXP_CONSTS`], max.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn sum_exp(x: *const f32, n: usize, k: *const f32) -> f32 {
    let bits: u32;
    // SAFETY: loads are predicated on index < n; constants from k[..9]. Registers clobbered.
    unsafe {
        sve_asm!(
            "ptrue p0.s",
            "cntw {vl}",
            load_consts!(exp),
            load_consts!(24 @ 32),
            "dup z30.s, #0",
            "dup z31.s, #0",
            loop2_head!("s"),
            ld2!(0, 8, "x"),
            "fsub z0.s, z0.s, z24.s",
            "fsub z8.s, z8.s, z24.s",
            exp_vecs!((0, 1, 2, 3), (8, 9, 10, 11)),
            "fadd z30.s, p1/m, z30.s, z3.s",
            "fadd z31.s, p2/m, z31.s, z11.s",
            loop2_tail!(),
            "fadd z30.s, z30.s, z31.s",
            "faddv s0, p0, z30.s",
            "fmov {r:w}, s0",
            x = in(reg) x,
            n = in(reg) n,
            k = in(reg) k,
            r = out(reg) bits,
        );
    }
    f32::from_bits(bits)
}

/// `x[j] = exp(x[j] − max)` over `x[..n]`, returning `Σ x[j]` in f32: [`sum_exp`]'s loop
/// with the exponentials stored (the lanes and order of the sum are the same).
///
/// # Safety
/// SVE; `x[..n]` readable and writable; `k[..9]`: [`EXP_CONSTS`], max.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn exp_sum(x: *mut f32, n: usize, k: *const f32) -> f32 {
    let bits: u32;
    // SAFETY: loads and stores are predicated on index < n; constants from k[..9]. Registers
    // clobbered.
    unsafe {
        sve_asm!(
            "ptrue p0.s",
            "cntw {vl}",
            load_consts!(exp),
            load_consts!(24 @ 32),
            "dup z30.s, #0",
            "dup z31.s, #0",
            loop2_head!("s"),
            ld2!(0, 8, "x"),
            "fsub z0.s, z0.s, z24.s",
            "fsub z8.s, z8.s, z24.s",
            exp_vecs!((0, 1, 2, 3), (8, 9, 10, 11)),
            st2!(3, 11, "x"),
            "fadd z30.s, p1/m, z30.s, z3.s",
            "fadd z31.s, p2/m, z31.s, z11.s",
            loop2_tail!(),
            "fadd z30.s, z30.s, z31.s",
            "faddv s0, p0, z30.s",
            "fmov {r:w}, s0",
            x = in(reg) x,
            n = in(reg) n,
            k = in(reg) k,
            r = out(reg) bits,
        );
    }
    f32::from_bits(bits)
}

/// `x[j] *= s` over `x[..n]`.
///
/// # Safety
/// SVE; `x[..n]` readable and writable; `k` points to `s`.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn scale_row(x: *mut f32, n: usize, k: *const f32) {
    // SAFETY: loads and stores are predicated on index < n; the scale is read from k[0].
    // Registers clobbered.
    unsafe {
        sve_asm!(
            "ptrue p0.s",
            "cntw {vl}",
            load_consts!(24 @ 0),
            loop2_head!("s"),
            ld2!(0, 8, "x"),
            "fmul z0.s, z0.s, z24.s",
            "fmul z8.s, z8.s, z24.s",
            st2!(0, 8, "x"),
            loop2_tail!(),
            x = in(reg) x,
            n = in(reg) n,
            k = in(reg) k,
        );
    }
}

/// `Σ x·y` in f32 (two chains of lanes, then `faddv`).
///
/// # Safety
/// SVE; `x`, `y[..n]` readable.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn dot(x: *const f32, y: *const f32, n: usize) -> f32 {
    let bits: u32;
    // SAFETY: loads predicated on index < n. Registers clobbered.
    unsafe {
        sve_asm!(
            "ptrue p0.s",
            "cntw {vl}",
            "dup z30.s, #0",
            "dup z31.s, #0",
            loop2_head!("s"),
            ld2!(0, 8, "x"),
            ld2!(1, 9, "y"),
            "fmla z30.s, p1/m, z0.s, z1.s",
            "fmla z31.s, p2/m, z8.s, z9.s",
            loop2_tail!(),
            "fadd z30.s, z30.s, z31.s",
            "faddv s0, p0, z30.s",
            "fmov {r:w}, s0",
            x = in(reg) x,
            y = in(reg) y,
            n = in(reg) n,
            r = out(reg) bits,
        );
    }
    f32::from_bits(bits)
}

/// `d = a·(d − s)`.
///
/// # Safety
/// SVE; `a[..n]` readable, `d[..n]` readable and writable; `k` points to `s`.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn softmax_backward_update(d: *mut f32, a: *const f32, n: usize, k: *const f32) {
    // SAFETY: loads and stores predicated on index < n; the constant from k[0].
    unsafe {
        sve_asm!(
            "ptrue p0.s",
            "cntw {vl}",
            load_consts!(24 @ 0),
            loop2_head!("s"),
            ld2!(0, 8, "d"),
            ld2!(1, 9, "a"),
            "fsub z0.s, z0.s, z24.s",
            "fsub z8.s, z8.s, z24.s",
            "fmul z0.s, z0.s, z1.s",
            "fmul z8.s, z8.s, z9.s",
            st2!(0, 8, "d"),
            loop2_tail!(),
            d = in(reg) d,
            a = in(reg) a,
            n = in(reg) n,
            k = in(reg) k,
        );
    }
}

/// Per chain: x in z0, x² in z1, `e = e^{−2u}` in z5, `1 + e` in z2, `s = σ(2u)` in z3.
macro_rules! gelu_sigmoid {
    () => {
        concat!(
            "fmul z1.s, z0.s, z0.s\n",
            "fmul z9.s, z8.s, z8.s\n",
            "movprfx z2, z24\n",
            "fmla z2.s, p0/m, z1.s, z25.s\n",
            "movprfx z10, z24\n",
            "fmla z10.s, p0/m, z9.s, z25.s\n",
            "fmul z2.s, z2.s, z0.s\n",
            "fmul z10.s, z10.s, z8.s\n",
            "fmul z2.s, z2.s, z26.s\n",
            "fmul z10.s, z10.s, z26.s\n",
            exp_vecs!((2, 3, 4, 5), (10, 11, 12, 13)),
            "fadd z2.s, z5.s, z24.s\n",
            "fadd z10.s, z13.s, z24.s\n",
            recip_vecs!((2, 3, 4), (10, 11, 12)),
        )
    };
}

/// `p3`/`p4`: the lanes of chain 1/2 whose input (`z0`/`z8`) is below [`GELU_ZERO_BELOW`].
macro_rules! zero_below {
    () => {
        concat!(
            "fcmgt p3.s, p0/z, z29.s, z0.s\n",
            "fcmgt p4.s, p0/z, z29.s, z8.s\n",
        )
    };
}

/// A row of f32 rounded into `$fmt` (`$round`) and one of `$fmt` widened to f32 (`$widen`):
/// the loads and stores of the 16-bit kernels alone.
macro_rules! convert_kernels {
    ($($fmt:tt: $round:ident, $widen:ident;)+) => {$(
        /// # Safety
        /// SVE; `x[..n]` readable, `out[..n]` writable.
        #[inline(never)]
        #[target_feature(enable = "sve")]
        unsafe fn $round(out: *mut u16, x: *const f32, n: usize) {
            // SAFETY: loads and stores predicated on index < n. Registers clobbered.
            unsafe {
                sve_asm!(
                    "ptrue p0.s",
                    "cntw {vl}",
                    loop2_head!("s"),
                    ld2!(f32, 0, 8, "x"),
                    st2!($fmt, 0, 8, "y", (1, 2), (9, 10)),
                    loop2_tail!(),
                    x = in(reg) x,
                    y = in(reg) out,
                    n = in(reg) n,
                );
            }
        }

        /// # Safety
        /// SVE; `x[..n]` readable, `out[..n]` writable.
        #[inline(never)]
        #[target_feature(enable = "sve")]
        unsafe fn $widen(out: *mut f32, x: *const u16, n: usize) {
            // SAFETY: loads and stores predicated on index < n. Registers clobbered.
            unsafe {
                sve_asm!(
                    "ptrue p0.s",
                    "cntw {vl}",
                    loop2_head!("s"),
                    ld2!($fmt, 0, 8, "x"),
                    st2!(0, 8, "y"),
                    loop2_tail!(),
                    x = in(reg) x,
                    y = in(reg) out,
                    n = in(reg) n,
                );
            }
        }
    )+};
}

convert_kernels! {
    f16: round_f16, widen_f16;
    bf16: round_bf16, widen_bf16;
}

/// GELU forward and backward over rows of `$fmt` elements (`$t`): `$gelu`, `$backward`.
macro_rules! gelu_kernels {
    ($($fmt:tt, $t:ty: $gelu:ident, $backward:ident;)+) => {$(
        /// # Safety
        /// SVE; `inp[..n]` readable, `out[..n]` writable; `k[..14]`: [`EXP_CONSTS`],
        /// [`gelu_consts`].
        #[inline(never)]
        #[target_feature(enable = "sve")]
        unsafe fn $gelu(out: *mut $t, inp: *const $t, n: usize, k: *const f32) {
            // SAFETY: loads and stores predicated on index < n; constants from k[..14].
            unsafe {
                sve_asm!(
                    "ptrue p0.s",
                    "cntw {vl}",
                    load_consts!(exp),
                    load_consts!(24 @ 32, 25 @ 36, 26 @ 40, 29 @ 52),
                    loop2_head!("s"),
                    ld2!($fmt, 0, 8, "x"),
                    gelu_sigmoid!(),
                    zero_below!(),
                    "fmul z0.s, z0.s, z3.s",
                    "fmul z8.s, z8.s, z11.s",
                    "mov z0.s, p3/m, #0",
                    "mov z8.s, p4/m, #0",
                    st2!($fmt, 0, 8, "y", (1, 2), (9, 10)),
                    loop2_tail!(),
                    x = in(reg) inp,
                    y = in(reg) out,
                    n = in(reg) n,
                    k = in(reg) k,
                );
            }
        }

        /// # Safety
        /// SVE; `inp`, `dout[..n]` readable, `dinp[..n]` writable; `k[..14]` as for the
        /// forward kernel.
        #[inline(never)]
        #[target_feature(enable = "sve")]
        unsafe fn $backward(
            dinp: *mut $t,
            inp: *const $t,
            dout: *const $t,
            n: usize,
            k: *const f32,
        ) {
            // SAFETY: loads and stores predicated on index < n; constants from k[..14].
            unsafe {
                sve_asm!(
                    "ptrue p0.s",
                    "cntw {vl}",
                    load_consts!(exp),
                    load_consts!(24 @ 32, 25 @ 36, 26 @ 40, 27 @ 44, 28 @ 48, 29 @ 52),
                    loop2_head!("s"),
                    ld2!($fmt, 0, 8, "x"),
                    ld2!($fmt, 7, 15, "g"),
                    gelu_sigmoid!(),
                    // s(1 − s)·x, with 1 − s = e·s (no cancellation where s is near 1)
                    "fmul z4.s, z5.s, z3.s",
                    "fmul z12.s, z13.s, z11.s",
                    "fmul z4.s, z4.s, z3.s",
                    "fmul z12.s, z12.s, z11.s",
                    "fmul z4.s, z4.s, z0.s",
                    "fmul z12.s, z12.s, z8.s",
                    // 2k + 6ka·x²
                    "movprfx z5, z27",
                    "fmla z5.s, p0/m, z1.s, z28.s",
                    "movprfx z13, z27",
                    "fmla z13.s, p0/m, z9.s, z28.s",
                    // (s + x·s(1−s)·(2k + 6ka·x²))·dout
                    "fmla z3.s, p0/m, z4.s, z5.s",
                    "fmla z11.s, p0/m, z12.s, z13.s",
                    zero_below!(),
                    "fmul z0.s, z3.s, z7.s",
                    "fmul z8.s, z11.s, z15.s",
                    "mov z0.s, p3/m, #0",
                    "mov z8.s, p4/m, #0",
                    st2!($fmt, 0, 8, "y", (1, 2), (9, 10)),
                    loop2_tail!(),
                    x = in(reg) inp,
                    g = in(reg) dout,
                    y = in(reg) dinp,
                    n = in(reg) n,
                    k = in(reg) k,
                );
            }
        }
    )+};
}

gelu_kernels! {
    f32, f32: gelu, gelu_backward;
    f16, u16: gelu_f16, gelu_backward_f16;
    bf16, u16: gelu_bf16, gelu_backward_bf16;
}

/// Head of the four-chain f64 loop: `p1`–`p4` for elements `{i}`, `{j}`, `{j2}`, `{j3}`..
/// (`{vl}` = f64 lanes apart), each element of `{x}` (`$fmt`, f32 when not given) loaded into
/// a 64-bit lane and converted to f64 in `z0`–`z3`; exits to `4:` when `p1` is empty.
macro_rules! loop4_f64_head {
    () => {
        concat!(
            loop4_f64_predicates!(),
            "ld1w {{z0.d}}, p1/z, [{x}, {i}, lsl #2]\n",
            "ld1w {{z1.d}}, p2/z, [{x}, {j}, lsl #2]\n",
            "ld1w {{z2.d}}, p3/z, [{x}, {j2}, lsl #2]\n",
            "ld1w {{z3.d}}, p4/z, [{x}, {j3}, lsl #2]\n",
            "fcvt z0.d, p0/m, z0.s\n",
            "fcvt z1.d, p0/m, z1.s\n",
            "fcvt z2.d, p0/m, z2.s\n",
            "fcvt z3.d, p0/m, z3.s\n",
        )
    };
    (f32) => {
        loop4_f64_head!()
    };
    (f16) => {
        concat!(
            loop4_f64_half_loads!(),
            "fcvt z0.d, p0/m, z0.h\n",
            "fcvt z1.d, p0/m, z1.h\n",
            "fcvt z2.d, p0/m, z2.h\n",
            "fcvt z3.d, p0/m, z3.h\n",
        )
    };
    (bf16) => {
        concat!(
            loop4_f64_half_loads!(),
            "lsl z0.d, z0.d, #16\n",
            "lsl z1.d, z1.d, #16\n",
            "lsl z2.d, z2.d, #16\n",
            "lsl z3.d, z3.d, #16\n",
            "fcvt z0.d, p0/m, z0.s\n",
            "fcvt z1.d, p0/m, z1.s\n",
            "fcvt z2.d, p0/m, z2.s\n",
            "fcvt z3.d, p0/m, z3.s\n",
        )
    };
}

/// [`loop4_f64_head`]'s 16-bit loads, one element into each 64-bit lane.
macro_rules! loop4_f64_half_loads {
    () => {
        concat!(
            loop4_f64_predicates!(),
            "ld1h {{z0.d}}, p1/z, [{x}, {i}, lsl #1]\n",
            "ld1h {{z1.d}}, p2/z, [{x}, {j}, lsl #1]\n",
            "ld1h {{z2.d}}, p3/z, [{x}, {j2}, lsl #1]\n",
            "ld1h {{z3.d}}, p4/z, [{x}, {j3}, lsl #1]\n",
        )
    };
}

/// [`loop4_f64_head`]'s loop label, exit and predicates.
macro_rules! loop4_f64_predicates {
    () => {
        concat!(
            "mov {i}, #0\n",
            "3:\n",
            "whilelo p1.d, {i}, {n}\n",
            "b.none 4f\n",
            "add {j}, {i}, {vl}\n",
            "add {j2}, {j}, {vl}\n",
            "add {j3}, {j2}, {vl}\n",
            "whilelo p2.d, {j}, {n}\n",
            "whilelo p3.d, {j2}, {n}\n",
            "whilelo p4.d, {j3}, {n}\n",
        )
    };
}

/// Tail of the four-chain f64 loop, then the four accumulators z28–z31 summed into `{r}`.
macro_rules! loop4_f64_tail {
    () => {
        concat!(
            "add {i}, {j3}, {vl}\n",
            "b 3b\n",
            "4:\n",
            "fadd z28.d, z28.d, z29.d\n",
            "fadd z30.d, z30.d, z31.d\n",
            "fadd z28.d, z28.d, z30.d\n",
            "faddv d0, p0, z28.d\n",
            "fmov {r}, d0\n",
        )
    };
}

/// The f64 reductions' prologue: `p0` all true (f64), `{vl}` f64 lanes, zero accumulators.
macro_rules! f64_prologue {
    () => {
        concat!(
            "ptrue p0.d\n",
            "cntd {vl}\n",
            "dup z28.d, #0\n",
            "dup z29.d, #0\n",
            "dup z30.d, #0\n",
            "dup z31.d, #0\n",
        )
    };
}

/// A layernorm row's kernels over `x` (and `out`) of `$fmt` elements (`$t`): the sum and the
/// sum of squared deviations in f64, and the normalisation.
macro_rules! layernorm_kernels {
    ($($fmt:tt, $t:ty: $sum:ident, $sum_sq_dev:ident, $normalise:ident;)+) => {$(
        /// # Safety
        /// SVE; `x[..n]` readable.
        #[inline(never)]
        #[target_feature(enable = "sve")]
        unsafe fn $sum(x: *const $t, n: usize) -> f64 {
            let bits: u64;
            // SAFETY: loads predicated on index < n. Registers clobbered.
            unsafe {
                sve_asm!(
                    f64_prologue!(),
                    loop4_f64_head!($fmt),
                    "fadd z28.d, p1/m, z28.d, z0.d",
                    "fadd z29.d, p2/m, z29.d, z1.d",
                    "fadd z30.d, p3/m, z30.d, z2.d",
                    "fadd z31.d, p4/m, z31.d, z3.d",
                    loop4_f64_tail!(),
                    x = in(reg) x,
                    n = in(reg) n,
                    r = out(reg) bits,
                    j2 = out(reg) _,
                    j3 = out(reg) _,
                );
            }
            f64::from_bits(bits)
        }

        /// # Safety
        /// SVE; `x[..n]` readable; `c` points to the f64 centre.
        #[inline(never)]
        #[target_feature(enable = "sve")]
        unsafe fn $sum_sq_dev(x: *const $t, n: usize, c: *const f64) -> f64 {
            let bits: u64;
            // SAFETY: loads predicated on index < n; the centre read from *c. Registers
            // clobbered.
            unsafe {
                sve_asm!(
                    f64_prologue!(),
                    "ld1rd {{z24.d}}, p0/z, [{k}]",
                    loop4_f64_head!($fmt),
                    "fsub z0.d, z0.d, z24.d",
                    "fsub z1.d, z1.d, z24.d",
                    "fsub z2.d, z2.d, z24.d",
                    "fsub z3.d, z3.d, z24.d",
                    "fmla z28.d, p1/m, z0.d, z0.d",
                    "fmla z29.d, p2/m, z1.d, z1.d",
                    "fmla z30.d, p3/m, z2.d, z2.d",
                    "fmla z31.d, p4/m, z3.d, z3.d",
                    loop4_f64_tail!(),
                    x = in(reg) x,
                    n = in(reg) n,
                    k = in(reg) c,
                    r = out(reg) bits,
                    j2 = out(reg) _,
                    j3 = out(reg) _,
                );
            }
            f64::from_bits(bits)
        }

        /// `out = (x − mean)·rstd·w + bias` (`w`, `bias` f32).
        ///
        /// # Safety
        /// SVE; `x`, `w`, `bias[..n]` readable, `out[..n]` writable; `k[..2]`: mean, rstd.
        #[inline(never)]
        #[target_feature(enable = "sve")]
        unsafe fn $normalise(
            out: *mut $t,
            x: *const $t,
            w: *const f32,
            b: *const f32,
            n: usize,
            k: *const f32,
        ) {
            // SAFETY: loads and stores predicated on index < n; constants from k[..2].
            unsafe {
                sve_asm!(
                    "ptrue p0.s",
                    "cntw {vl}",
                    load_consts!(24 @ 0, 25 @ 4),
                    loop2_head!("s"),
                    ld2!($fmt, 0, 8, "x"),
                    ld2!(1, 9, "w"),
                    ld2!(2, 10, "b"),
                    "fsub z0.s, z0.s, z24.s",
                    "fsub z8.s, z8.s, z24.s",
                    "fmul z0.s, z0.s, z25.s",
                    "fmul z8.s, z8.s, z25.s",
                    "fmad z0.s, p0/m, z1.s, z2.s",
                    "fmad z8.s, p0/m, z9.s, z10.s",
                    st2!($fmt, 0, 8, "y", (1, 2), (9, 10)),
                    loop2_tail!(),
                    x = in(reg) x,
                    w = in(reg) w,
                    b = in(reg) b,
                    y = in(reg) out,
                    n = in(reg) n,
                    k = in(reg) k,
                );
            }
        }
    )+};
}

layernorm_kernels! {
    f32, f32: sum_f64, sum_sq_dev_f64, normalise;
    f16, u16: sum_f64_f16, sum_sq_dev_f64_f16, normalise_f16;
    bf16, u16: sum_f64_bf16, sum_sq_dev_f64_bf16, normalise_bf16;
}

/// `sums = [Σ dout·w, Σ dout·w·x̂]` in f64, `x̂ = (x − mean)·rstd` (products in f32, each
/// term converted exactly): two chains of 64-bit lanes, four accumulators.
///
/// # Safety
/// SVE; `dout`, `x`, `w[..n]` readable; `k[..2]`: mean, rstd; `sums[..2]` writable.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn ln_backward_sums(
    dout: *const f32,
    x: *const f32,
    w: *const f32,
    n: usize,
    k: *const f32,
    sums: *mut f64,
) {
    // SAFETY: loads predicated on index < n; constants from k[..2]; stores sums[0..2].
    unsafe {
        sve_asm!(
            // All true for .s and for .d elements.
            "ptrue p0.s",
            "cntd {vl}",
            load_consts!(24 @ 0, 25 @ 4),
            "dup z28.d, #0",
            "dup z29.d, #0",
            "dup z30.d, #0",
            "dup z31.d, #0",
            "mov {i}, #0",
            "3:",
            "whilelo p1.d, {i}, {n}",
            "b.none 4f",
            "add {j}, {i}, {vl}",
            "whilelo p2.d, {j}, {n}",
            // f32 values in the low half of 64-bit lanes: g, w, x.
            "ld1w {{z0.d}}, p1/z, [{g}, {i}, lsl #2]",
            "ld1w {{z8.d}}, p2/z, [{g}, {j}, lsl #2]",
            "ld1w {{z1.d}}, p1/z, [{w}, {i}, lsl #2]",
            "ld1w {{z9.d}}, p2/z, [{w}, {j}, lsl #2]",
            "ld1w {{z2.d}}, p1/z, [{x}, {i}, lsl #2]",
            "ld1w {{z10.d}}, p2/z, [{x}, {j}, lsl #2]",
            // dn = g·w, x̂ = (x − mean)·rstd, dn·x̂ (f32 arithmetic on the low halves).
            "fmul z0.s, z0.s, z1.s",
            "fmul z8.s, z8.s, z9.s",
            "fsub z2.s, z2.s, z24.s",
            "fsub z10.s, z10.s, z24.s",
            "fmul z2.s, z2.s, z25.s",
            "fmul z10.s, z10.s, z25.s",
            "fmul z2.s, z2.s, z0.s",
            "fmul z10.s, z10.s, z8.s",
            "fcvt z0.d, p0/m, z0.s",
            "fcvt z8.d, p0/m, z8.s",
            "fcvt z2.d, p0/m, z2.s",
            "fcvt z10.d, p0/m, z10.s",
            "fadd z28.d, p1/m, z28.d, z0.d",
            "fadd z29.d, p2/m, z29.d, z8.d",
            "fadd z30.d, p1/m, z30.d, z2.d",
            "fadd z31.d, p2/m, z31.d, z10.d",
            "add {i}, {j}, {vl}",
            "b 3b",
            "4:",
            "fadd z28.d, z28.d, z29.d",
            "fadd z30.d, z30.d, z31.d",
            "faddv d0, p0, z28.d",
            "faddv d1, p0, z30.d",
            "stp d0, d1, [{s}]",
            g = in(reg) dout,
            x = in(reg) x,
            w = in(reg) w,
            n = in(reg) n,
            k = in(reg) k,
            s = in(reg) sums,
        );
    }
}

/// `dinp += (dout·w − m1 − x̂·m2)·rstd`, `x̂ = (x − mean)·rstd`.
///
/// # Safety
/// SVE; `dout`, `x`, `w[..n]` readable, `dinp[..n]` readable and writable;
/// `k[..4]`: mean, rstd, m1, m2.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn ln_backward_update(
    dinp: *mut f32,
    dout: *const f32,
    x: *const f32,
    w: *const f32,
    n: usize,
    k: *const f32,
) {
    // SAFETY: loads and stores predicated on index < n; constants from k[..4].
    unsafe {
        sve_asm!(
            "ptrue p0.s",
            "cntw {vl}",
            load_consts!(24 @ 0, 25 @ 4, 26 @ 8, 27 @ 12),
            loop2_head!("s"),
            ld2!(0, 8, "g"),
            ld2!(1, 9, "w"),
            ld2!(2, 10, "x"),
            ld2!(3, 11, "y"),
            "fmul z0.s, z0.s, z1.s",
            "fmul z8.s, z8.s, z9.s",
            "fsub z2.s, z2.s, z24.s",
            "fsub z10.s, z10.s, z24.s",
            "fmul z2.s, z2.s, z25.s",
            "fmul z10.s, z10.s, z25.s",
            "fsub z0.s, z0.s, z26.s",
            "fsub z8.s, z8.s, z26.s",
            "fmls z0.s, p0/m, z2.s, z27.s",
            "fmls z8.s, p0/m, z10.s, z27.s",
            "fmla z3.s, p0/m, z0.s, z25.s",
            "fmla z11.s, p0/m, z8.s, z25.s",
            st2!(3, 11, "y"),
            loop2_tail!(),
            g = in(reg) dout,
            w = in(reg) w,
            x = in(reg) x,
            y = in(reg) dinp,
            n = in(reg) n,
            k = in(reg) k,
        );
    }
}

/// # Safety
/// SVE; `g[..n]` readable, `p`, `m`, `v[..n]` readable and writable; `k[..9]`: scale, decay,
/// β1, 1−β1, β2, 1−β2, neg_step, 1/bc2_sqrt, eps.
#[inline(never)]
#[target_feature(enable = "sve")]
unsafe fn adamw(p: *mut f32, g: *const f32, m: *mut f32, v: *mut f32, n: usize, k: *const f32) {
    // SAFETY: loads and stores predicated on index < n; constants from k[..9].
    unsafe {
        sve_asm!(
            "ptrue p0.s",
            "cntw {vl}",
            load_consts!(16 @ 0, 17 @ 4, 18 @ 8, 19 @ 12, 20 @ 16, 21 @ 20, 22 @ 24, 23 @ 28, 24 @ 32),
            // The smallest normal f32: √v is computed as v·(1/√max(v, tiny)), 0 for v = 0.
            "mov {t:w}, #0x00800000",
            "dup z25.s, {t:w}",
            loop2_head!("s"),
            ld2!(0, 8, "g"),
            ld2!(1, 9, "m"),
            ld2!(2, 10, "v"),
            ld2!(3, 11, "p"),
            // g' = g·scale; p ·= decay
            "fmul z0.s, z0.s, z16.s",
            "fmul z8.s, z8.s, z16.s",
            "fmul z3.s, z3.s, z17.s",
            "fmul z11.s, z11.s, z17.s",
            // m = β1·m + (1−β1)·g'
            "fmul z1.s, z1.s, z18.s",
            "fmul z9.s, z9.s, z18.s",
            "fmla z1.s, p0/m, z0.s, z19.s",
            "fmla z9.s, p0/m, z8.s, z19.s",
            // v = β2·v + (1−β2)·g'²
            "fmul z0.s, z0.s, z0.s",
            "fmul z8.s, z8.s, z8.s",
            "fmul z2.s, z2.s, z20.s",
            "fmul z10.s, z10.s, z20.s",
            "fmla z2.s, p0/m, z0.s, z21.s",
            "fmla z10.s, p0/m, z8.s, z21.s",
            st2!(1, 9, "m"),
            st2!(2, 10, "v"),
            // y = 1/√max(v, tiny): frsqrte and two Newton steps.
            "movprfx z4, z2",
            "fmax z4.s, p0/m, z4.s, z25.s",
            "movprfx z12, z10",
            "fmax z12.s, p0/m, z12.s, z25.s",
            "frsqrte z5.s, z4.s",
            "frsqrte z13.s, z12.s",
            "fmul z6.s, z5.s, z4.s",
            "fmul z14.s, z13.s, z12.s",
            "frsqrts z6.s, z6.s, z5.s",
            "frsqrts z14.s, z14.s, z13.s",
            "fmul z5.s, z5.s, z6.s",
            "fmul z13.s, z13.s, z14.s",
            "fmul z6.s, z5.s, z4.s",
            "fmul z14.s, z13.s, z12.s",
            "frsqrts z6.s, z6.s, z5.s",
            "frsqrts z14.s, z14.s, z13.s",
            "fmul z5.s, z5.s, z6.s",
            "fmul z13.s, z13.s, z14.s",
            // denom = v·y/bc2_sqrt + eps
            "fmul z5.s, z5.s, z2.s",
            "fmul z13.s, z13.s, z10.s",
            "movprfx z4, z24",
            "fmla z4.s, p0/m, z5.s, z23.s",
            "movprfx z12, z24",
            "fmla z12.s, p0/m, z13.s, z23.s",
            recip_vecs!((4, 5, 6), (12, 13, 14)),
            // p += neg_step·m/denom
            "fmul z1.s, z1.s, z22.s",
            "fmul z9.s, z9.s, z22.s",
            "fmla z3.s, p0/m, z1.s, z5.s",
            "fmla z11.s, p0/m, z9.s, z13.s",
            st2!(3, 11, "p"),
            loop2_tail!(),
            p = in(reg) p,
            g = in(reg) g,
            m = in(reg) m,
            v = in(reg) v,
            n = in(reg) n,
            k = in(reg) k,
            t = out(reg) _,
        );
    }
}

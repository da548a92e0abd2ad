//! The SVE row kernels against f64 references, on lengths around the vector length, with the
//! output inside a NaN-filled buffer (nothing outside the slice may change). Runs where the CPU
//! has SVE: under QEMU at 128–2048 bits (`scripts/test-aarch64.sh`); elsewhere each test prints
//! `skipped: <reason>`.

#[cfg(not(target_arch = "aarch64"))]
#[test]
fn sve_row_kernels() {
    println!("skipped: the SVE row kernels exist on aarch64 only (scripts/test-aarch64.sh runs them under QEMU)");
}

#[cfg(target_arch = "aarch64")]
mod sve {
    use fugu_gemm::precision::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
    use fugu_rows::sve::{AdamWScalars, Half, Sve};

    /// f32 unit roundoff.
    const U: f64 = 1.0 / (1u64 << 24) as f64;

    fn sve() -> Option<Sve> {
        let s = Sve::detect();
        if s.is_none() {
            println!("skipped: this CPU has no SVE");
        }
        s
    }

    /// Row lengths around the vector length (and 0, and a long row).
    fn lengths(s: &Sve) -> Vec<usize> {
        let vl = s.f32_lanes();
        let mut v = vec![
            0,
            1,
            2,
            vl - 1,
            vl,
            vl + 1,
            2 * vl - 1,
            2 * vl,
            2 * vl + 1,
            4 * vl + 3,
            1237,
        ];
        v.sort();
        v.dedup();
        v
    }

    /// Deterministic values in `[lo, hi)`.
    fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                lo + (hi - lo) * ((x >> 40) as f32 / (1u64 << 24) as f32)
            })
            .collect()
    }

    /// A buffer with `data` at offset 3 and NaN guards around it; `check` asserts the guards.
    struct Guarded {
        buf: Vec<f32>,
        n: usize,
    }
    const GUARD: usize = 3;
    const TAIL: usize = 67;
    impl Guarded {
        fn new(data: &[f32]) -> Guarded {
            let mut buf = vec![f32::from_bits(0x7FC0_1234); GUARD + data.len() + TAIL];
            buf[GUARD..GUARD + data.len()].copy_from_slice(data);
            Guarded { buf, n: data.len() }
        }
        fn slice(&mut self) -> &mut [f32] {
            &mut self.buf[GUARD..GUARD + self.n]
        }
        fn data(&self) -> &[f32] {
            &self.buf[GUARD..GUARD + self.n]
        }
        fn check(&self, what: &str) {
            let outside = self.buf[..GUARD].iter().chain(&self.buf[GUARD + self.n..]);
            assert!(
                outside.into_iter().all(|v| v.to_bits() == 0x7FC0_1234),
                "{what}: wrote outside its slice (n = {})",
                self.n
            );
        }
    }

    fn ulps(a: f32, b: f64) -> f64 {
        let bf = b as f32;
        let ulp = (f32::from_bits(bf.abs().to_bits() + 1) - bf.abs()) as f64;
        (a as f64 - b).abs() / ulp
    }

    #[test]
    fn exp_is_within_2_ulp_over_its_range() {
        let Some(s) = sve() else { return };
        let xs: Vec<f32> = (0..)
            .map(|i| -87.0 + 0.000_731 * i as f32)
            .take_while(|&x| x < 88.5)
            .collect();
        let mut row = xs.clone();
        s.exp_scale(&mut row, 0.0, 1.0);
        let worst = xs
            .iter()
            .zip(&row)
            .map(|(&x, &e)| ulps(e, (x as f64).exp()))
            .fold(0.0, f64::max);
        println!("exp: worst {worst:.2} ulp over {} points", xs.len());
        assert!(worst <= 2.0, "exp worst {worst} ulp");
        let mut special = [0.0, f32::NAN, -1e30, 1e30, f32::INFINITY, f32::NEG_INFINITY];
        s.exp_scale(&mut special, 0.0, 1.0);
        assert_eq!(special[0], 1.0);
        assert!(special[1].is_nan());
        assert!(special[2] >= 0.0 && special[2] < 1e-37);
        assert!(special[3].is_finite() && special[3] > 1e38);
        assert!(special[4].is_finite() && special[5] >= 0.0);
    }

    #[test]
    fn exp_scale_and_sum_exp_on_awkward_lengths() {
        let Some(s) = sve() else { return };
        for n in lengths(&s).into_iter().chain([511, 512, 513, 1500]) {
            let x = values(n, n as u64, -12.0, 3.0);
            let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut g = Guarded::new(&x);
            s.exp_scale(g.slice(), max, 0.25);
            g.check("exp_scale");
            for (&xi, &yi) in x.iter().zip(g.data()) {
                let want = 0.25 * ((xi - max) as f64).exp();
                assert!(ulps(yi, want) <= 2.0, "exp_scale n={n}: {yi} vs {want}");
            }
            // Each term within 2 ulp, blocks summed in f32 (512 terms: ≤ 512·u relative).
            let want: f64 = x.iter().map(|&xi| ((xi - max) as f64).exp()).sum();
            let got = s.sum_exp(&x, max);
            let tol = (2.0 + 512.0) * U * want + f64::MIN_POSITIVE;
            assert!((got - want).abs() <= tol, "sum_exp n={n}: {got} vs {want}");
        }
    }

    /// `exp_sum` stores exactly `exp_scale`'s exponentials at scale 1 and returns exactly
    /// `sum_exp`'s sum (same lanes, same order); `scale` multiplies in place, and neither
    /// writes outside its slice.
    #[test]
    fn exp_sum_and_scale_are_the_two_pass_kernels_in_one() {
        let Some(s) = sve() else { return };
        for n in lengths(&s).into_iter().chain([511, 512, 513, 1500]) {
            let x = values(n, 3 + n as u64, -12.0, 3.0);
            let max = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mut e = Guarded::new(&x);
            let sum = s.exp_sum(e.slice(), max);
            e.check("exp_sum");
            let mut want = x.clone();
            s.exp_scale(&mut want, max, 1.0);
            assert_eq!(e.data(), &want[..], "exp_sum n={n}: exponentials");
            assert_eq!(
                sum.to_bits(),
                s.sum_exp(&x, max).to_bits(),
                "exp_sum n={n}: sum"
            );
            let mut g = Guarded::new(&x);
            s.scale(g.slice(), 0.375);
            g.check("scale");
            for (&xi, &yi) in x.iter().zip(g.data()) {
                assert_eq!(yi, xi * 0.375, "scale n={n}");
            }
        }
    }

    /// f64 GELU (tanh form) and its derivative, through `(1 + tanh u)/2 = σ(2u)`: the tanh
    /// form itself cancels in f64 for x < −6 (tanh u rounds to −1).
    fn gelu64(x: f64) -> (f64, f64) {
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let a = 0.044715;
        let s = 1.0 / (1.0 + (-2.0 * k * (x + a * x * x * x)).exp());
        let du = 2.0 * k * (1.0 + 3.0 * a * x * x);
        (x * s, s + x * s * (1.0 - s) * du)
    }

    #[test]
    fn gelu_forward_and_backward_match_f64() {
        let Some(s) = sve() else { return };
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let (mut worst_f, mut worst_b) = (0.0f64, 0.0f64);
        for n in lengths(&s).into_iter().chain([3001]) {
            let x = values(n, 7 + n as u64, -8.0, 8.0);
            let g = values(n, 11 + n as u64, -1.0, 1.0);
            let mut out = Guarded::new(&vec![0.0; n]);
            s.gelu(out.slice(), &x);
            out.check("gelu");
            let mut din = Guarded::new(&vec![0.0; n]);
            s.gelu_backward(din.slice(), &x, &g);
            din.check("gelu_backward");
            for i in 0..n {
                let xi = x[i] as f64;
                let (y, dy) = gelu64(xi);
                // σ(2u) = 1/(1 + e^v), v = −2u computed in f32 with 3 roundings (relative
                // error 3u, amplified by exp's condition number |v|), exp within 2 ulp, 1 + e,
                // the reciprocal (≈1 ulp), one product: (6 + 3|v|)·u relative to |y|.
                let v = 2.0 * k * (xi + 0.044715 * xi.powi(3));
                let rel = (6.0 + 3.0 * v.abs()) * U;
                let ef = (out.data()[i] as f64 - y).abs() / (rel * y.abs() + 1e-37);
                worst_f = worst_f.max(ef);
                assert!(ef <= 1.0, "gelu({xi}) = {} vs {y}", out.data()[i]);
                // dy = s + x·s(1−s)·du cancels near x ≈ −0.75: bound by the terms' sizes,
                // each within 2·rel (s, and 1 − s = e·s, within rel; a few more roundings).
                let sig = 1.0 / (1.0 + (-2.0 * k * (xi + 0.044715 * xi.powi(3))).exp());
                let du = 2.0 * k * (1.0 + 3.0 * 0.044715 * xi * xi);
                let terms = sig + xi.abs() * sig * (1.0 - sig) * du;
                let want = g[i] as f64 * dy;
                let eb = (din.data()[i] as f64 - want).abs()
                    / (2.0 * rel * terms * (g[i] as f64).abs() + 1e-37);
                worst_b = worst_b.max(eb);
                assert!(
                    eb <= 1.0,
                    "gelu'({xi})·{} = {} vs {want}",
                    g[i],
                    din.data()[i]
                );
            }
        }
        println!("gelu: worst error / bound: forward {worst_f:.3}, backward {worst_b:.3}");
        let special = [f32::NAN, 1e30, -1e30, 0.0];
        let mut y = [0.0f32; 4];
        s.gelu(&mut y, &special);
        assert!(y[0].is_nan());
        assert_eq!((y[1], y[2], y[3]), (1e30, 0.0, 0.0));
        let mut dy = [0.0f32; 4];
        s.gelu_backward(&mut dy, &special, &[1.0; 4]);
        assert!(dy[0].is_nan());
        assert_eq!(dy[3], 0.5);
    }

    #[test]
    fn softmax_backward_matches_f64() {
        let Some(s) = sve() else { return };
        for n in lengths(&s).into_iter().chain([1024]) {
            let mut a = values(n, 31 + n as u64, 0.0, 1.0);
            let total: f32 = a.iter().sum();
            a.iter_mut().for_each(|v| *v /= total.max(1e-30));
            let d = values(n, 32 + n as u64, -1.0, 1.0);
            let mut got = Guarded::new(&d);
            s.softmax_backward(got.slice(), &a);
            got.check("softmax_backward");
            let dot: f64 = d.iter().zip(&a).map(|(&x, &y)| x as f64 * y as f64).sum();
            let dot_abs: f64 = d
                .iter()
                .zip(&a)
                .map(|(&x, &y)| (x as f64 * y as f64).abs())
                .sum();
            for i in 0..n {
                let want = a[i] as f64 * (d[i] as f64 - dot);
                // The f32 sum: (n/(2·VL) + log2(2·VL) + 2)·u of Σ|d·a| (each lane's chain,
                // then the tree); the difference and product: 2 more roundings.
                let lanes = 2 * s.f32_lanes();
                let sum_err = ((n / lanes) as f64 + (lanes as f64).log2() + 2.0) * U * dot_abs;
                let tol = (a[i] as f64) * (sum_err + 2.0 * U * (d[i] as f64 - dot).abs());
                let g = got.data()[i] as f64;
                assert!(
                    (g - want).abs() <= tol + 1e-37,
                    "softmax_backward n={n} i={i}: {g} vs {want}"
                );
            }
        }
    }

    #[test]
    fn f64_sums_match_exact_sums() {
        let Some(s) = sve() else { return };
        for n in lengths(&s).into_iter().chain([16384 + 5]) {
            let x = values(n, 3 + n as u64, -2.0, 5.0);
            let exact: f64 = x.iter().map(|&v| v as f64).sum();
            let c = exact / n.max(1) as f64;
            let sq: f64 = x.iter().map(|&v| (v as f64 - c).powi(2)).sum();
            let sum_abs: f64 = x.iter().map(|&v| (v as f64).abs()).sum();
            // f64 sums of n terms: n·2^-53 relative to Σ|terms| (the orders differ).
            let tol = |t: f64| (n as f64 + 4.0) * f64::EPSILON * t + f64::MIN_POSITIVE;
            assert!((s.sum_f64(&x) - exact).abs() <= tol(sum_abs), "sum n={n}");
            assert!(
                (s.sum_sq_dev_f64(&x, c) - sq).abs() <= tol(sq),
                "sum_sq_dev n={n}"
            );
        }
    }

    #[test]
    fn layernorm_rows_match_f64() {
        let Some(s) = sve() else { return };
        let eps = 1e-5;
        for c in lengths(&s).into_iter().filter(|&c| c > 0).chain([768]) {
            let x = values(c, 5 + c as u64, -3.0, 4.0);
            let w = values(c, 6 + c as u64, 0.5, 1.5);
            let b = values(c, 7 + c as u64, -0.2, 0.2);
            let dout = values(c, 8 + c as u64, -1.0, 1.0);
            let mu = x.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var = x.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / c as f64;
            let rs = 1.0 / (var + eps).sqrt();
            let mut out = Guarded::new(&vec![0.0; c]);
            let (m32, r32) = s.layernorm_row(out.slice(), &x, &w, &b, eps);
            out.check("layernorm_row");
            // The f64 statistics round to the same f32 (or a neighbour, if the sums' order
            // moves a value across a rounding boundary).
            assert!(ulps(m32, mu) <= 1.0 && ulps(r32, rs) <= 1.0, "stats c={c}");
            for j in 0..c {
                let xhat = (x[j] as f64 - m32 as f64) * r32 as f64;
                let want = xhat * w[j] as f64 + b[j] as f64;
                // (x − mean) exact-ish, two products and a fused add: 4 ulp of the terms.
                let tol = 4.0 * U * (xhat.abs() * w[j] as f64 + (b[j] as f64).abs());
                assert!(
                    (out.data()[j] as f64 - want).abs() <= tol,
                    "layernorm c={c} j={j}"
                );
            }
            // Backward: dinp += rstd·(g − mean(g) − x̂·mean(g·x̂)), g = dout·w.
            let init = values(c, 9 + c as u64, -0.1, 0.1);
            let mut dinp = Guarded::new(&init);
            s.layernorm_backward_row(dinp.slice(), &dout, &x, &w, m32, r32);
            dinp.check("layernorm_backward_row");
            let (m, r) = (m32 as f64, r32 as f64);
            let gw: Vec<f64> = (0..c).map(|j| dout[j] as f64 * w[j] as f64).collect();
            let xh: Vec<f64> = (0..c).map(|j| (x[j] as f64 - m) * r).collect();
            let m1 = gw.iter().sum::<f64>() / c as f64;
            let m2 = gw.iter().zip(&xh).map(|(g, x)| g * x).sum::<f64>() / c as f64;
            for j in 0..c {
                let terms = gw[j].abs() + m1.abs() + (xh[j] * m2).abs();
                let want = init[j] as f64 + r * (gw[j] - m1 - xh[j] * m2);
                let tol = 8.0 * U * (r * terms + (init[j] as f64).abs());
                let got = dinp.data()[j] as f64;
                assert!(
                    (got - want).abs() <= tol,
                    "layernorm backward c={c} j={j}: {got} vs {want}"
                );
            }
        }
    }

    /// fugu's exact converters for a 16-bit format.
    fn encode(fmt: Half, x: f32) -> u16 {
        match fmt {
            Half::F16 => f32_to_f16(x),
            Half::Bf16 => f32_to_bf16(x),
        }
    }
    fn decode(fmt: Half, h: u16) -> f32 {
        match fmt {
            Half::F16 => f16_to_f32(h),
            Half::Bf16 => bf16_to_f32(h),
        }
    }

    /// A signalling NaN of the format (the hardware's conversions make it quiet, fugu's
    /// converters keep it as it is: neither arithmetic nor rounding makes one).
    fn signalling(fmt: Half, h: u16) -> bool {
        match fmt {
            Half::F16 => h & 0x7c00 == 0x7c00 && h & 0x3ff != 0 && h & 0x200 == 0,
            Half::Bf16 => h & 0x7f80 == 0x7f80 && h & 0x7f != 0 && h & 0x40 == 0,
        }
    }

    /// A 16-bit buffer with `data` at offset 3 and guards around it (as [`Guarded`]).
    struct Guarded16 {
        buf: Vec<u16>,
        n: usize,
    }
    const GUARD16: u16 = 0xA5A5;
    impl Guarded16 {
        fn new(n: usize) -> Guarded16 {
            Guarded16 {
                buf: vec![GUARD16; GUARD + n + TAIL],
                n,
            }
        }
        fn slice(&mut self) -> &mut [u16] {
            &mut self.buf[GUARD..GUARD + self.n]
        }
        fn data(&self) -> &[u16] {
            &self.buf[GUARD..GUARD + self.n]
        }
        fn check(&self, what: &str) {
            let outside = self.buf[..GUARD].iter().chain(&self.buf[GUARD + self.n..]);
            assert!(
                outside.into_iter().all(|&v| v == GUARD16),
                "{what}: wrote outside its slice (n = {})",
                self.n
            );
        }
    }

    /// The same bits, or both NaN.
    fn same16(a: u16, b: u16, fmt: Half) -> bool {
        a == b || (decode(fmt, a).is_nan() && decode(fmt, b).is_nan())
    }

    /// Rounding into f16/bf16 gives fugu's converters' bits on f32 patterns across the whole
    /// range (a stride through all 2^32, and every pattern around the rounding ties, the
    /// overflow threshold, the subnormals and the NaNs); widening gives theirs on all 65,536
    /// 16-bit patterns (signalling NaNs: both NaN). Guards around every output.
    #[test]
    fn half_rounding_and_widening_are_fugus_converters() {
        let Some(s) = sve() else { return };
        for fmt in [Half::F16, Half::Bf16] {
            let mut xs: Vec<f32> = (0..(1u64 << 32))
                .step_by(997)
                .map(|b| f32::from_bits(b as u32))
                .collect();
            for centre in [
                0x3f80_0000u32, // 1.0
                0x3f80_8000,    // a bf16 tie
                0x3f80_1000,    // an f16 tie
                0x477f_f000,    // near f16's largest (65504)
                0x4780_0000,    // 65536
                0x3380_0000,    // 2^-24: f16's smallest subnormal
                0x3880_0000,    // 2^-14: f16's smallest normal
                0x7f7f_ffff,    // f32's largest
                0x7f80_0000,    // infinity
                0x7fc0_0000,    // NaN
                0x0000_0001,    // f32's smallest subnormal
            ] {
                for d in 0..4096u32 {
                    for sign in [0, 0x8000_0000u32] {
                        xs.push(f32::from_bits(
                            centre.wrapping_add(d).wrapping_sub(2048) | sign,
                        ));
                    }
                }
            }
            let mut out = Guarded16::new(xs.len());
            s.round_half(fmt, out.slice(), &xs);
            out.check("round_half");
            for (x, &h) in xs.iter().zip(out.data()) {
                let want = encode(fmt, *x);
                assert!(
                    h == want || (x.is_nan() && decode(fmt, h).is_nan()),
                    "{fmt:?}: {x:e} ({:#010x}) rounds to {h:#06x}, fugu's converter {want:#06x}",
                    x.to_bits()
                );
            }
            let all: Vec<u16> = (0..=u16::MAX).collect();
            for n in lengths(&s).into_iter().chain([all.len()]) {
                let mut wide = Guarded::new(&vec![0.0; n]);
                s.widen_half(fmt, wide.slice(), &all[..n]);
                wide.check("widen_half");
                for (&h, &v) in all[..n].iter().zip(wide.data()) {
                    let want = decode(fmt, h);
                    if signalling(fmt, h) {
                        assert!(v.is_nan(), "{fmt:?} {h:#06x}");
                    } else {
                        assert_eq!(v.to_bits(), want.to_bits(), "{fmt:?} {h:#06x}");
                    }
                }
            }
        }
    }

    /// Rows of `n` values in `[lo, hi)` rounded to the format, with the format's specials
    /// (zeros, infinities, a NaN, the largest finite value, subnormals) in the first places.
    fn half_row(fmt: Half, n: usize, seed: u64, lo: f32, hi: f32) -> Vec<u16> {
        let mut v: Vec<u16> = values(n, seed, lo, hi)
            .iter()
            .map(|&x| encode(fmt, x))
            .collect();
        let largest = match fmt {
            Half::F16 => 0x7bff,
            Half::Bf16 => 0x7f7f,
        };
        let specials = [
            0x0000,
            0x8000,
            0x7c00 | 0x8000,
            0x7e00,
            largest,
            0x0001,
            0x83ff,
        ];
        for (d, &sp) in v.iter_mut().zip(&specials) {
            *d = match (fmt, sp) {
                (Half::Bf16, 0xfc00) => 0xff80,
                (Half::Bf16, 0x7e00) => 0x7fc0,
                _ => sp,
            };
        }
        v
    }

    /// The 16-bit GELU and layernorm kernels give the bits of their f32 forms run on the
    /// widened rows and rounded once by fugu's converters (so a 16-bit run of the trainer
    /// computes what the staged f32 path computes), on lengths around the vector length, with
    /// the formats' specials in the rows; and against f64: within the f32 kernel's bound plus
    /// one rounding to the format (half an ulp of it: 2^-11 for f16, 2^-8 for bf16, relative).
    #[test]
    fn half_gelu_and_layernorm_are_their_f32_forms_rounded() {
        let Some(s) = sve() else { return };
        let wide =
            |fmt: Half, h: &[u16]| -> Vec<f32> { h.iter().map(|&b| decode(fmt, b)).collect() };
        let round =
            |fmt: Half, x: &[f32]| -> Vec<u16> { x.iter().map(|&v| encode(fmt, v)).collect() };
        for fmt in [Half::F16, Half::Bf16] {
            let half_u = match fmt {
                Half::F16 => 1.0 / 2048.0,
                Half::Bf16 => 1.0 / 256.0,
            };
            for n in lengths(&s).into_iter().chain([3001]) {
                let x = half_row(fmt, n, 70 + n as u64, -8.0, 8.0);
                let g = half_row(fmt, n, 80 + n as u64, -1.0, 1.0);
                let (xf, gf) = (wide(fmt, &x), wide(fmt, &g));
                let mut want = vec![0.0f32; n];
                s.gelu(&mut want, &xf);
                let mut out = Guarded16::new(n);
                s.gelu_half(fmt, out.slice(), &x);
                out.check("gelu_half");
                for (j, (&h, w)) in out.data().iter().zip(round(fmt, &want)).enumerate() {
                    assert!(
                        same16(h, w, fmt),
                        "{fmt:?} gelu n={n} j={j}: {h:#06x} vs {w:#06x}"
                    );
                    let xj = xf[j] as f64;
                    if xj.is_finite() && xj.abs() < 60.0 {
                        let y = gelu64(xj).0;
                        let got = decode(fmt, h) as f64;
                        let tol = half_u * y.abs() + 64.0 * U * (1.0 + xj.abs()) * y.abs() + 1e-7;
                        assert!((got - y).abs() <= tol, "{fmt:?} gelu({xj}) = {got} vs {y}");
                    }
                }
                s.gelu_backward(&mut want, &xf, &gf);
                let mut din = Guarded16::new(n);
                s.gelu_backward_half(fmt, din.slice(), &x, &g);
                din.check("gelu_backward_half");
                for (j, (&h, w)) in din.data().iter().zip(round(fmt, &want)).enumerate() {
                    assert!(
                        same16(h, w, fmt),
                        "{fmt:?} gelu' n={n} j={j}: {h:#06x} vs {w:#06x}"
                    );
                }
            }
            let eps = 1e-5;
            for c in lengths(&s).into_iter().filter(|&c| c > 0).chain([768]) {
                let x: Vec<u16> = round(fmt, &values(c, 5 + c as u64, -3.0, 4.0));
                let w = values(c, 6 + c as u64, 0.5, 1.5);
                let b = values(c, 7 + c as u64, -0.2, 0.2);
                let xf = wide(fmt, &x);
                let mut want = vec![0.0f32; c];
                let stats = s.layernorm_row(&mut want, &xf, &w, &b, eps);
                let mut out = Guarded16::new(c);
                let got = s.layernorm_row_half(fmt, out.slice(), &x, &w, &b, eps);
                out.check("layernorm_row_half");
                assert_eq!(got, stats, "{fmt:?} layernorm stats c={c}");
                let mu = xf.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
                let var = xf.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / c as f64;
                for (j, (&h, wv)) in out.data().iter().zip(round(fmt, &want)).enumerate() {
                    assert_eq!(h, wv, "{fmt:?} layernorm c={c} j={j}");
                    let y = (xf[j] as f64 - mu) / (var + eps).sqrt() * w[j] as f64 + b[j] as f64;
                    let terms = ((xf[j] as f64 - mu) / (var + eps).sqrt() * w[j] as f64).abs()
                        + (b[j] as f64).abs();
                    // The f32 kernel's roundings (as in the f32 test, and the mean's rounding
                    // to f32 carried through rstd·w), then one rounding to the format.
                    let rs = 1.0 / (var + eps).sqrt();
                    let tol = half_u * y.abs()
                        + 8.0 * U * (terms + mu.abs() * rs * (w[j] as f64).abs())
                        + 1e-30;
                    let v = decode(fmt, h) as f64;
                    assert!(
                        (v - y).abs() <= tol,
                        "{fmt:?} layernorm c={c} j={j}: {v} vs {y}"
                    );
                }
            }
        }
    }

    #[test]
    fn adamw_matches_f64() {
        let Some(s) = sve() else { return };
        let k = AdamWScalars {
            scale: 0.5,
            decay: 0.999,
            beta1: 0.9,
            one_m_b1: 0.1,
            beta2: 0.95,
            one_m_b2: 0.05,
            neg_step_size: -3e-4,
            bc2_sqrt: 0.3,
            eps: 1e-8,
        };
        for n in lengths(&s) {
            let p0 = values(n, 21 + n as u64, -1.0, 1.0);
            let mut g = values(n, 22 + n as u64, -2.0, 2.0);
            let m0 = values(n, 23 + n as u64, -0.1, 0.1);
            let mut v0 = values(n, 24 + n as u64, 0.0, 0.01);
            if n > 2 {
                // v = 0 with g = 0 (a parameter that never had a gradient).
                g[1] = 0.0;
                v0[1] = 0.0;
            }
            let (mut p, mut m, mut v) = (Guarded::new(&p0), Guarded::new(&m0), Guarded::new(&v0));
            s.adamw(p.slice(), &g, m.slice(), v.slice(), &k);
            p.check("adamw p");
            m.check("adamw m");
            v.check("adamw v");
            for i in 0..n {
                let gi = g[i] as f64 * k.scale as f64;
                let mi = k.beta1 as f64 * m0[i] as f64 + k.one_m_b1 as f64 * gi;
                let vi = k.beta2 as f64 * v0[i] as f64 + k.one_m_b2 as f64 * gi * gi;
                let step =
                    k.neg_step_size as f64 * mi / (vi.sqrt() / k.bc2_sqrt as f64 + k.eps as f64);
                let pi = p0[i] as f64 * k.decay as f64 + step;
                // m, v: two products and a fused add (3 ulp of the terms); the step: m, √v
                // (estimate + 2 Newton steps), the reciprocal, three products: 10 ulp.
                let mt = (k.beta1 as f64 * m0[i] as f64).abs() + (k.one_m_b1 as f64 * gi).abs();
                assert!(
                    (m.data()[i] as f64 - mi).abs() <= 3.0 * U * mt,
                    "adamw m[{i}]"
                );
                assert!(
                    (v.data()[i] as f64 - vi).abs() <= 3.0 * U * vi,
                    "adamw v[{i}]"
                );
                let tol = 2.0 * U * pi.abs() + 10.0 * U * step.abs();
                assert!(
                    (p.data()[i] as f64 - pi).abs() <= tol,
                    "adamw p[{i}]: {} vs {pi}",
                    p.data()[i]
                );
            }
        }
    }

    #[test]
    fn report_vector_length() {
        let Some(s) = sve() else { return };
        println!(
            "sve row kernels: {} f32 lanes ({} bits)",
            s.f32_lanes(),
            32 * s.f32_lanes()
        );
    }
}

//! Side-by-side timing of block sizes (and ISAs) on the shapes of issue 14.
//!
//! ```text
//! cargo run --release -p fugu-gemm --example blocking -- [VARIANT ...] [--reps N] [--isa avx2]
//!     [--only SUBSTR] [--threads N] [--mm]
//! cargo run --release -p fugu-gemm --example blocking -- [--isa avx2] --kernel-only KC [MC]
//! ```
//!
//! Each VARIANT is `derived` (the cache-derived blocking, `FUGU_GEMM_MC/KC/NC/NB` still apply) or
//! `MC,KC,NC[,NB]` (used as given; NB defaults to the kernel's nr: one B̃ micro-panel under the
//! whole Ã block). Default: `derived 96,672,6240` (the pre-issue-14 Zen 3 blocking).
//! The variants run round-robin, one repetition each in turn, so that load from other processes
//! hits all of them alike; the report gives the median and the best of `--reps` repetitions, in
//! GFLOP/s and in % of the FMA peak measured by `fugu_gemm::peak::measure_core_gflops` before and
//! after the timings (the larger of the two).
//!
//! * `--only SUBSTR` keeps the shapes whose name contains SUBSTR;
//! * `--threads N` runs fugu-gemm on N threads (the % is still of one core's peak);
//! * `--mm` adds matrixmultiply (on `MATMUL_NUM_THREADS` threads, default 1) to the round-robin;
//! * `--kernel-only KC [MC]` instead times the bare micro-kernel: one B̃ micro-panel of depth KC
//!   against the Ã micro-panels of an MC-row Ã block (default: one micro-panel, all in L1).
use fugu_gemm::peak::measure_core_gflops;
use fugu_gemm::{
    BatchMut, BatchRef, Blocking, Isa, MatMut, MatRef, Runtime, RuntimeConfig, TopologyRequest,
};
use std::time::Instant;

struct Shape {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
    /// A is given as its transpose (k × m row-major), as in a weight gradient Xᵀ·dY.
    ta: bool,
    /// B is given as its transpose (n × k row-major), as in Q·Kᵀ.
    tb: bool,
}

const SHAPES: [Shape; 13] = [
    Shape {
        name: "256x252x256",
        m: 256,
        n: 252,
        k: 256,
        batch: 1,
        ta: false,
        tb: false,
    },
    Shape {
        name: "256x264x256",
        m: 256,
        n: 264,
        k: 256,
        batch: 1,
        ta: false,
        tb: false,
    },
    Shape {
        name: "512x510x512",
        m: 512,
        n: 510,
        k: 512,
        batch: 1,
        ta: false,
        tb: false,
    },
    Shape {
        name: "256^3",
        m: 256,
        n: 256,
        k: 256,
        batch: 1,
        ta: false,
        tb: false,
    },
    Shape {
        name: "512^3",
        m: 512,
        n: 512,
        k: 512,
        batch: 1,
        ta: false,
        tb: false,
    },
    Shape {
        name: "2048^3",
        m: 2048,
        n: 2048,
        k: 2048,
        batch: 1,
        ta: false,
        tb: false,
    },
    Shape {
        name: "lm-head bwd-data",
        m: 1024,
        n: 768,
        k: 50304,
        batch: 1,
        ta: false,
        tb: false,
    },
    Shape {
        name: "qkv fwd",
        m: 1024,
        n: 2304,
        k: 768,
        batch: 1,
        ta: false,
        tb: false,
    },
    Shape {
        name: "lm-head bwd-weight",
        m: 50304,
        n: 768,
        k: 1024,
        batch: 1,
        ta: true,
        tb: false,
    },
    Shape {
        name: "QK^T T=64 x48",
        m: 64,
        n: 64,
        k: 64,
        batch: 48,
        ta: false,
        tb: true,
    },
    Shape {
        name: "PV T=64 x48",
        m: 64,
        n: 64,
        k: 64,
        batch: 48,
        ta: false,
        tb: false,
    },
    Shape {
        name: "1024^3",
        m: 1024,
        n: 1024,
        k: 1024,
        batch: 1,
        ta: false,
        tb: false,
    },
    Shape {
        name: "fc bwd-weight",
        m: 768,
        n: 3072,
        k: 1024,
        batch: 1,
        ta: true,
        tb: false,
    },
];

fn run(rt: &Runtime, s: &Shape, a: &[f32], b: &[f32], c: &mut [f32]) {
    if s.batch == 1 {
        let av = if s.ta {
            MatRef::row_major(a, s.k, s.m).unwrap().t()
        } else {
            MatRef::row_major(a, s.m, s.k).unwrap()
        };
        rt.gemm(
            1.0,
            av,
            MatRef::row_major(b, s.k, s.n).unwrap(),
            0.0,
            MatMut::row_major(c, s.m, s.n).unwrap(),
        )
        .unwrap();
    } else {
        let bv = if s.tb {
            BatchRef::row_major(b, s.batch, s.n, s.k).unwrap().t()
        } else {
            BatchRef::row_major(b, s.batch, s.k, s.n).unwrap()
        };
        rt.gemm_strided_batched(
            1.0,
            BatchRef::row_major(a, s.batch, s.m, s.k).unwrap(),
            bv,
            0.0,
            BatchMut::row_major(c, s.batch, s.m, s.n).unwrap(),
        )
        .unwrap();
    }
}

/// The same problem with matrixmultiply (on `MATMUL_NUM_THREADS` threads, 1 by default).
fn run_mm(s: &Shape, a: &[f32], b: &[f32], c: &mut [f32]) {
    let (m, n, k) = (s.m, s.n, s.k);
    let (rsa, csa) = if s.ta {
        (1, m as isize)
    } else {
        (k as isize, 1)
    };
    let (rsb, csb) = if s.tb {
        (1, k as isize)
    } else {
        (n as isize, 1)
    };
    for i in 0..s.batch {
        // SAFETY: each matrix i lies inside a, b and c with these strides.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr().add(i * m * k),
                rsa,
                csa,
                b.as_ptr().add(i * k * n),
                rsb,
                csb,
                0.0,
                c.as_mut_ptr().add(i * m * n),
                n as isize,
                1,
            )
        }
    }
}

/// The micro-kernel alone, as the macro-kernel calls it: one B̃ micro-panel of depth `kc` against
/// the `mc / mr` Ã micro-panels of an Ã block (`mc = mr`: everything stays in L1), into a C block
/// that stays in cache. The ceiling the driver can reach with these block sizes.
fn kernel_only(isa: Option<Isa>, kc: usize, mc: Option<usize>) {
    let k = isa.map_or_else(fugu_gemm::kernel::best_kernel, |i| {
        fugu_gemm::kernel::kernel_for(i).expect("ISA not available")
    });
    let panels = mc.map_or(1, |mc| mc.div_ceil(k.mr));
    let a = vec![0.5f32; panels * kc * k.mr];
    let b = vec![0.25f32; kc * k.nr];
    let mut c = vec![0.0f32; panels * k.mr * k.nr];
    let calls = (2e8 as usize / (kc * k.mr * k.nr * panels)).max(1);
    let mut rates = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        for _ in 0..calls {
            for i in 0..panels {
                // SAFETY: panel i of a holds kc*mr floats, b kc*nr, and tile i of c is an
                // mr × nr column-major tile (ldc = mr).
                unsafe {
                    (k.func)(
                        kc,
                        1.0,
                        a.as_ptr().add(i * kc * k.mr),
                        b.as_ptr(),
                        1.0,
                        c.as_mut_ptr().add(i * k.mr * k.nr),
                        k.mr,
                    )
                };
            }
        }
        let flops = 2.0 * (calls * panels * kc * k.mr * k.nr) as f64;
        rates.push(flops / t.elapsed().as_secs_f64() / 1e9);
    }
    rates.sort_by(f64::total_cmp);
    let peak = measure_core_gflops(k.isa).unwrap_or(f64::NAN);
    println!(
        "{k:?} kc={kc} mc={}: median {:.1} GFLOP/s ({:.1}%), best {:.1} ({:.1}%) of {peak:.1}",
        panels * k.mr,
        rates[3],
        100.0 * rates[3] / peak,
        rates[6],
        100.0 * rates[6] / peak
    );
}

fn main() {
    // The workspace enables matrixmultiply's `threading` feature; keep it on one thread unless
    // asked otherwise (it reads this variable on first use).
    if std::env::var_os("MATMUL_NUM_THREADS").is_none() {
        std::env::set_var("MATMUL_NUM_THREADS", "1");
    }
    let mut variants: Vec<Option<Blocking>> = Vec::new();
    let mut reps = 7;
    let mut isa = None;
    let mut only: Option<String> = None;
    let mut threads = 1;
    let mut with_mm = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--reps" => reps = args.next().and_then(|s| s.parse().ok()).expect("--reps N"),
            "--isa" => isa = Some(Isa::parse(&args.next().expect("--isa NAME")).unwrap()),
            "--only" => only = args.next(),
            "--threads" => {
                threads = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--threads N")
            }
            "--mm" => with_mm = true,
            "--kernel-only" => {
                let kc = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--kernel-only KC [MC]");
                let mc = args.next().and_then(|s| s.parse().ok());
                return kernel_only(isa, kc, mc);
            }
            "derived" => variants.push(None),
            v => {
                let n: Vec<usize> = v
                    .split(',')
                    .map(|x| x.parse().expect("MC,KC,NC[,NB]"))
                    .collect();
                assert!(matches!(n.len(), 3 | 4), "MC,KC,NC[,NB]");
                variants.push(Some(Blocking {
                    mc: n[0],
                    kc: n[1],
                    nc: n[2],
                    // 0: the kernel's nr, filled in below.
                    nb: n.get(3).copied().unwrap_or(0),
                }));
            }
        }
    }
    if variants.is_empty() {
        variants = vec![
            None,
            Some(Blocking {
                mc: 96,
                kc: 672,
                nc: 6240,
                nb: 0,
            }),
        ];
    }
    let nr = isa
        .map_or_else(fugu_gemm::kernel::best_kernel, |i| {
            fugu_gemm::kernel::kernel_for(i).expect("ISA not available")
        })
        .nr;
    for b in variants.iter_mut().flatten() {
        if b.nb == 0 {
            b.nb = nr;
        }
    }
    let rts: Vec<Runtime> = variants
        .iter()
        .map(|&blocking| {
            Runtime::new(RuntimeConfig {
                isa,
                topology: TopologyRequest {
                    max_threads: Some(threads),
                    ..Default::default()
                },
                blocking,
                f16_chunked: None,
                bf16_native: None,
                split: None,
            })
            .unwrap()
        })
        .collect();
    let kisa = rts[0].kernel().isa;
    let peak0 = measure_core_gflops(kisa).unwrap_or(f64::NAN);
    for rt in &rts {
        println!("variant: {}", rt.describe());
    }
    println!("caches: {:?}", rts[0].caches());
    let mut results = Vec::new();
    for s in SHAPES
        .iter()
        .filter(|s| only.as_deref().is_none_or(|o| s.name.contains(o)))
    {
        let a: Vec<f32> = (0..s.batch * s.m * s.k)
            .map(|i| (i % 17) as f32 * 0.1)
            .collect();
        let b: Vec<f32> = (0..s.batch * s.k * s.n)
            .map(|i| (i % 13) as f32 * 0.1)
            .collect();
        let mut c = vec![0.0f32; s.batch * s.m * s.n];
        let flops = 2.0 * (s.batch * s.m * s.n * s.k) as f64;
        // Repeat small problems so one timing is at least ~20 ms.
        let inner = ((2e-2 * 50e9 / flops).ceil() as usize).max(1);
        let mut times = vec![Vec::new(); rts.len() + usize::from(with_mm)];
        for rep in 0..=reps {
            for (v, rt) in rts.iter().enumerate() {
                let t = Instant::now();
                for _ in 0..inner {
                    run(rt, s, &a, &b, &mut c);
                }
                if rep > 0 {
                    times[v].push(t.elapsed().as_secs_f64() / inner as f64);
                }
            }
            if with_mm {
                let t = Instant::now();
                for _ in 0..inner {
                    run_mm(s, &a, &b, &mut c);
                }
                if rep > 0 {
                    times[rts.len()].push(t.elapsed().as_secs_f64() / inner as f64);
                }
            }
        }
        results.push((s, flops, times));
    }
    let peak1 = measure_core_gflops(kisa).unwrap_or(f64::NAN);
    let peak = peak0.max(peak1);
    println!(
        "{kisa} FMA peak, 1 core: {peak0:.1} GFLOP/s before, {peak1:.1} after; % below are of {peak:.1}"
    );
    println!(
        "{:<18} {:>8} {:>20} {:>20} {:>14}",
        "shape", "variant", "median GFLOP/s (%)", "best GFLOP/s (%)", "min-max"
    );
    for (s, flops, times) in results {
        for (v, mut ts) in times.into_iter().enumerate() {
            ts.sort_by(f64::total_cmp);
            let g = |t: f64| flops / t / 1e9;
            let (med, best, worst) = (g(ts[ts.len() / 2]), g(ts[0]), g(ts[ts.len() - 1]));
            let name = match variants.get(v) {
                None => "mm".to_string(),
                Some(None) => "derived".to_string(),
                Some(Some(b)) => format!("{},{},{},{}", b.mc, b.kc, b.nc, b.nb),
            };
            println!(
                "{:<18} {:>8} {:>11.1} ({:>4.1}%) {:>11.1} ({:>4.1}%) {:>6.1}-{:<6.1}",
                s.name,
                name,
                med,
                100.0 * med / peak,
                best,
                100.0 * best / peak,
                worst,
                best
            );
        }
    }
}

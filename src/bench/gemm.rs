//! The GEMM benchmark behind `fugu bench gemm` and `cargo bench --bench gemm`.
//!
//! Every row times fugu-gemm and a baseline (matrixmultiply, and the system OpenBLAS with the
//! `openblas` feature) on the same operands in the same process, checks that they agree, and
//! reports median GFLOP/s, % of the machine's FP32 peak and the ratio to the baseline.

use super::stats::{median, time_interleaved, Contender};
use anyhow::{bail, Context, Result};
use fugu_gemm::peak::Peak;
use fugu_gemm::{BatchMut, BatchRef, MatMut, MatRef, Precision, Runtime};
use serde::Serialize;

pub use crate::model::cost::GemmShape;

/// One benchmark problem: a named [`GemmShape`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchShape {
    pub set: String,
    pub name: String,
    #[serde(flatten)]
    pub shape: GemmShape,
}

impl std::ops::Deref for BenchShape {
    type Target = GemmShape;
    fn deref(&self) -> &GemmShape {
        &self.shape
    }
}

#[allow(clippy::too_many_arguments)]
fn shape(
    set: &str,
    name: &str,
    m: usize,
    n: usize,
    k: usize,
    batch: usize,
    ta: bool,
    tb: bool,
) -> BenchShape {
    BenchShape {
        set: set.into(),
        name: name.into(),
        shape: GemmShape {
            m,
            n,
            k,
            batch,
            ta,
            tb,
        },
    }
}

/// The named shape sets: `square`, `gpt2`, `attention`, `fugaku`, and `all`.
pub fn shape_set(name: &str) -> Result<Vec<BenchShape>> {
    let mut v = Vec::new();
    match name {
        "square" => {
            for s in [256, 512, 1024, 2048, 4096] {
                v.push(shape("square", &format!("{s}^3"), s, s, s, 1, false, false));
            }
        }
        "gpt2" => {
            // GPT-2 124M at B·T = 1024 tokens: every linear layer forward (X·W), backward data
            // (dY·Wᵀ) and backward weight (Xᵀ·dY), and the LM head (X·Eᵀ).
            let bt = 1024;
            for (layer, din, dout) in [
                ("qkv", 768, 2304),
                ("attn-proj", 768, 768),
                ("fc", 768, 3072),
                ("mlp-proj", 3072, 768),
            ] {
                v.push(shape(
                    "gpt2",
                    &format!("{layer} fwd"),
                    bt,
                    dout,
                    din,
                    1,
                    false,
                    false,
                ));
                v.push(shape(
                    "gpt2",
                    &format!("{layer} bwd-data"),
                    bt,
                    din,
                    dout,
                    1,
                    false,
                    true,
                ));
                v.push(shape(
                    "gpt2",
                    &format!("{layer} bwd-weight"),
                    din,
                    dout,
                    bt,
                    1,
                    true,
                    false,
                ));
            }
            v.push(shape("gpt2", "lm-head fwd", bt, 50304, 768, 1, false, true));
            v.push(shape(
                "gpt2",
                "lm-head bwd-data",
                bt,
                768,
                50304,
                1,
                false,
                false,
            ));
            v.push(shape(
                "gpt2",
                "lm-head bwd-weight",
                50304,
                768,
                bt,
                1,
                true,
                false,
            ));
        }
        "attention" => {
            // 4 sequences x 12 heads = batch 48, head size 64: scores Q·Kᵀ and context P·V.
            for t in [64, 256, 1024] {
                v.push(shape(
                    "attention",
                    &format!("QK^T T={t}"),
                    t,
                    t,
                    64,
                    48,
                    false,
                    true,
                ));
                v.push(shape(
                    "attention",
                    &format!("PV T={t}"),
                    t,
                    64,
                    t,
                    48,
                    false,
                    false,
                ));
            }
        }
        "fugaku" => {
            // DL4Fugaku GPT shapes (hidden 7168, 56 heads of 128, sequence 2048) at tensor
            // parallel degree 8, which fits a 24 GiB machine with the baseline's copies.
            let (s, h, heads, tp) = (2048, 7168, 56, 8);
            v.push(shape(
                "fugaku",
                "qkv tp=8",
                s,
                3 * h / tp,
                h,
                1,
                false,
                false,
            ));
            v.push(shape(
                "fugaku",
                "scores tp=8",
                s,
                s,
                128,
                heads / tp,
                false,
                true,
            ));
            v.push(shape(
                "fugaku",
                "context tp=8",
                s,
                128,
                s,
                heads / tp,
                false,
                false,
            ));
            v.push(shape(
                "fugaku",
                "out-proj tp=8",
                s,
                h,
                h / tp,
                1,
                false,
                false,
            ));
            v.push(shape(
                "fugaku",
                "fc1 tp=8",
                s,
                4 * h / tp,
                h,
                1,
                false,
                false,
            ));
            v.push(shape(
                "fugaku",
                "fc2 tp=8",
                s,
                h,
                4 * h / tp,
                1,
                false,
                false,
            ));
        }
        "all" => {
            for s in ["square", "gpt2", "attention", "fugaku"] {
                v.extend(shape_set(s)?);
            }
        }
        other => {
            bail!("unknown shape set {other:?}: expected square, gpt2, attention, fugaku or all")
        }
    }
    Ok(v)
}

/// Parses `MxNxK` or `MxNxKxBATCH`.
pub fn parse_shape(s: &str) -> Result<BenchShape> {
    let mut parts = s.split(':');
    let dims = parts.next().unwrap_or_default();
    let (mut ta, mut tb) = (false, false);
    for flag in parts {
        match flag.trim() {
            "ta" if !ta => ta = true,
            "tb" if !tb => tb = true,
            other => bail!(
                "bad --shape {s:?}: unknown or repeated suffix {other:?} (expected :ta, A stored transposed, and/or :tb, B stored transposed)"
            ),
        }
    }
    let nums: Vec<usize> = dims
        .split(['x', 'X'])
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(|| {
            format!("bad --shape {s:?}: expected MxNxK or MxNxKxBATCH with integers, then optional :ta/:tb")
        })?;
    let (m, n, k, batch) = match nums[..] {
        [m, n, k] => (m, n, k, 1),
        [m, n, k, b] => (m, n, k, b),
        _ => bail!("bad --shape {s:?}: expected MxNxK or MxNxKxBATCH, then optional :ta/:tb"),
    };
    if m == 0 || n == 0 || k == 0 || batch == 0 {
        bail!("bad --shape {s:?}: every dimension must be at least 1");
    }
    // Checked: a dimension near usize::MAX must be refused, not overflow.
    let elems = [m.checked_mul(k), k.checked_mul(n), m.checked_mul(n)]
        .into_iter()
        .try_fold(0usize, |a, x| a.checked_add(x?))
        .and_then(|e| e.checked_mul(batch));
    const MAX_ELEMS: usize = 2_000_000_000;
    match elems {
        Some(e) if e <= MAX_ELEMS => {}
        _ => bail!(
            "--shape {s:?}: A, B and C hold more than {MAX_ELEMS} floats together (8 GB); \
             give a smaller shape"
        ),
    }
    Ok(shape("custom", s, m, n, k, batch, ta, tb))
}

/// What to compare against, and how long to time each row.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Approximate seconds spent timing each implementation per row.
    pub budget_s: f64,
    pub min_reps: usize,
    pub max_reps: usize,
    /// Time matrixmultiply too (the default baseline).
    pub baseline: bool,
    /// Time the system OpenBLAS too (only with the `openblas` feature).
    pub openblas: bool,
    /// The precision of fugu-gemm's GEMMs; below f32, the operands are rounded to it (so
    /// that every contender multiplies the same numbers) and fugu-gemm's f32 GEMM is timed
    /// side by side.
    pub prec: Precision,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            budget_s: 0.5,
            min_reps: 3,
            // High enough that small shapes spend the budget too: with 50, a 256³ row was
            // timed for 15 ms of its 1.5 s, ten calls per block, and its ratio to OpenBLAS
            // moved by ±2% between runs (0.947–0.967 in four runs, 87–93 GFLOP/s); with the
            // budget spent, 0.958–0.959 (105 GFLOP/s, the steady state; docs/KERNELS.md).
            max_reps: 10_000,
            baseline: true,
            openblas: cfg!(feature = "openblas"),
            prec: Precision::F32,
        }
    }
}

/// One result line (`--format json` writes these).
#[derive(Clone, Debug, Serialize)]
pub struct BenchRow {
    pub set: String,
    pub name: String,
    #[serde(flatten)]
    pub shape: GemmShape,
    pub threads: usize,
    pub domains: usize,
    pub isa: String,
    /// The precision of fugu-gemm's GEMM (`f32`, `bf16`, `f16`).
    pub dtype: String,
    pub gflops: f64,
    pub median_s: f64,
    pub repeats: usize,
    pub peak_gflops: f64,
    pub peak_pct: f64,
    pub peak_source: String,
    pub baseline: String,
    pub baseline_gflops: Option<f64>,
    pub ratio: Option<f64>,
    pub openblas_gflops: Option<f64>,
    pub openblas_ratio: Option<f64>,
    /// Batched shapes: OpenBLAS with the batch split over threads, 1-thread calls each.
    pub openblas_split_gflops: Option<f64>,
    /// Largest |fugu − baseline| relative to the largest |C|.
    pub max_rel_diff: Option<f64>,
    /// Below f32: fugu-gemm's f32 GEMM on the same (rounded) operands, and fugu / that.
    pub f32_gflops: Option<f64>,
    pub f32_ratio: Option<f64>,
    /// On a device: the type of C (`--out-dtype`; by default the operands' `dtype`).
    pub out_dtype: Option<String>,
}

impl BenchRow {
    /// The row of one timed implementation of `s`: its sorted run `times` (seconds), the
    /// `isa` label, `(threads, domains)`, the `(GFLOP/s, source)` peak it is measured against
    /// and the baseline's name; baseline and OpenBLAS columns empty.
    fn timed(
        s: &BenchShape,
        isa: String,
        (threads, domains): (usize, usize),
        times: &[f64],
        (peak_gflops, peak_source): (f64, String),
        baseline: &str,
    ) -> BenchRow {
        let t = median(times);
        let g = gflops(s, t);
        BenchRow {
            set: s.set.clone(),
            name: s.name.clone(),
            shape: s.shape,
            threads,
            domains,
            isa,
            dtype: Precision::F32.name().into(),
            gflops: g,
            median_s: t,
            repeats: times.len(),
            peak_gflops,
            peak_pct: 100.0 * g / peak_gflops,
            peak_source,
            baseline: baseline.into(),
            baseline_gflops: None,
            ratio: None,
            openblas_gflops: None,
            openblas_ratio: None,
            openblas_split_gflops: None,
            max_rel_diff: None,
            f32_gflops: None,
            f32_ratio: None,
            out_dtype: None,
        }
    }
}

struct Operands {
    a: Vec<f32>,
    b: Vec<f32>,
}

/// Strides (row, col) of the stored A (m×k logical) and B (k×n logical).
fn strides(s: &BenchShape) -> ((usize, usize), (usize, usize)) {
    let a = if s.ta { (1, s.m) } else { (s.k, 1) };
    let b = if s.tb { (1, s.k) } else { (s.n, 1) };
    (a, b)
}

fn run_fugu(
    rt: &Runtime,
    prec: Precision,
    s: &BenchShape,
    ops: &Operands,
    c: &mut [f32],
) -> Result<()> {
    let ((ars, acs), (brs, bcs)) = strides(s);
    let rt = rt.at(prec);
    if s.batch == 1 {
        rt.gemm(
            1.0,
            MatRef::new(&ops.a, s.m, s.k, ars, acs)?,
            MatRef::new(&ops.b, s.k, s.n, brs, bcs)?,
            0.0,
            MatMut::row_major(c, s.m, s.n)?,
        )?;
    } else {
        rt.gemm_strided_batched(
            1.0,
            BatchRef::new(&ops.a, s.batch, s.m, s.k, ars, acs, s.m * s.k)?,
            BatchRef::new(&ops.b, s.batch, s.k, s.n, brs, bcs, s.k * s.n)?,
            0.0,
            BatchMut::row_major(c, s.batch, s.m, s.n)?,
        )?;
    }
    Ok(())
}

fn run_matrixmultiply(s: &BenchShape, ops: &Operands, c: &mut [f32]) {
    let ((ars, acs), (brs, bcs)) = strides(s);
    for i in 0..s.batch {
        let (a, b) = (&ops.a[i * s.m * s.k..], &ops.b[i * s.k * s.n..]);
        let c = &mut c[i * s.m * s.n..(i + 1) * s.m * s.n];
        // SAFETY: a, b and c hold the dense m×k, k×n and m×n matrices of problem i with the
        // strides given, as laid out by `strides` and the batch offsets above.
        unsafe {
            matrixmultiply::sgemm(
                s.m,
                s.k,
                s.n,
                1.0,
                a.as_ptr(),
                ars as isize,
                acs as isize,
                b.as_ptr(),
                brs as isize,
                bcs as isize,
                0.0,
                c.as_mut_ptr(),
                s.n as isize,
                1,
            )
        }
    }
}

#[cfg(feature = "openblas")]
fn run_openblas_loop(s: &BenchShape, ops: &Operands, c: &mut [f32]) {
    for i in 0..s.batch {
        super::openblas::sgemm(
            s.m,
            s.n,
            s.k,
            s.ta,
            s.tb,
            &ops.a[i * s.m * s.k..(i + 1) * s.m * s.k],
            &ops.b[i * s.k * s.n..(i + 1) * s.k * s.n],
            &mut c[i * s.m * s.n..(i + 1) * s.m * s.n],
        );
    }
}

#[cfg(feature = "openblas")]
fn run_openblas_split(s: &BenchShape, ops: &Operands, c: &mut [f32], threads: usize) {
    let per = s.batch.div_ceil(threads);
    std::thread::scope(|sc| {
        for (t, cc) in c.chunks_mut(per * s.m * s.n).enumerate() {
            sc.spawn(move || {
                for (j, ci) in cc.chunks_mut(s.m * s.n).enumerate() {
                    let i = t * per + j;
                    super::openblas::sgemm(
                        s.m,
                        s.n,
                        s.k,
                        s.ta,
                        s.tb,
                        &ops.a[i * s.m * s.k..(i + 1) * s.m * s.k],
                        &ops.b[i * s.k * s.n..(i + 1) * s.k * s.n],
                        ci,
                    );
                }
            });
        }
    });
}

fn gflops(s: &BenchShape, secs: f64) -> f64 {
    2.0 * (s.m * s.n * s.k * s.batch) as f64 / secs / 1e9
}

/// Largest |got − want| relative to the largest |want| (NaN when they disagree on NaNs).
fn max_rel_diff(got: &[f32], want: &[f32]) -> f64 {
    let scale = want
        .iter()
        .fold(0.0f32, |m, v| m.max(v.abs()))
        .max(f32::MIN_POSITIVE);
    let diff = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    (diff / scale) as f64
}

/// Times one shape on `rt` (and the baselines) and checks that the results agree.
pub fn run_shape(
    rt: &Runtime,
    peak: &Peak,
    s: &BenchShape,
    opts: &BenchOptions,
) -> Result<BenchRow> {
    let prec = opts.prec;
    let mut ops = Operands {
        a: super::fill(s.batch * s.m * s.k, 1),
        b: super::fill(s.batch * s.k * s.n, 2),
    };
    prec.round_slice(&mut ops.a);
    prec.round_slice(&mut ops.b);
    let c_len = s.batch * s.m * s.n;
    let mut c = vec![0.0f32; c_len];
    let mut cb = vec![0.0f32; c_len];
    let mut c32 = vec![0.0f32; c_len];
    let (mut err, mut err32) = (None, None);
    // Contenders, timed in interleaved rounds: fugu-gemm first (then its f32 GEMM when the
    // precision is lower), then the baselines asked for.
    let mut fs: Vec<Contender> = vec![Box::new(|| {
        if let Err(e) = run_fugu(rt, prec, s, &ops, &mut c) {
            err.get_or_insert(e);
        }
    })];
    let f32_at = (prec != Precision::F32).then(|| {
        fs.push(Box::new(|| {
            if let Err(e) = run_fugu(rt, Precision::F32, s, &ops, &mut c32) {
                err32.get_or_insert(e);
            }
        }));
        fs.len() - 1
    });
    let baseline_at = fs.len();
    if opts.baseline {
        fs.push(Box::new(|| run_matrixmultiply(s, &ops, &mut cb)));
    }
    #[cfg(feature = "openblas")]
    let (openblas_at, split_at) = {
        let threads = rt.threads();
        let mut co = vec![0.0f32; c_len];
        let mut cs = vec![0.0f32; c_len];
        let (ops, at) = (&ops, fs.len());
        let mut split_at = None;
        if opts.openblas {
            fs.push(Box::new(move || {
                super::openblas::set_threads(threads);
                run_openblas_loop(s, ops, &mut co)
            }));
            if s.batch > 1 && threads > 1 {
                split_at = Some(fs.len());
                fs.push(Box::new(move || {
                    super::openblas::set_threads(1);
                    run_openblas_split(s, ops, &mut cs, threads)
                }));
            }
        }
        (opts.openblas.then_some(at), split_at)
    };
    // Only parallel runs need the pause: single-threaded libraries leave no spinning workers.
    let settle = if rt.threads() > 1 {
        std::time::Duration::from_millis(100)
    } else {
        std::time::Duration::ZERO
    };
    let times = time_interleaved(&mut fs, opts.budget_s, opts.min_reps, opts.max_reps, settle);
    drop(fs);
    if let Some(e) = err.or(err32) {
        return Err(e).with_context(|| format!("fugu-gemm failed on {}", s.name));
    }
    let mut row = BenchRow::timed(
        s,
        rt.kernel_at(prec).isa.to_string(),
        (rt.threads(), rt.topology().domains.len()),
        &times[0],
        (peak.total_gflops(), peak.source.to_string()),
        "matrixmultiply",
    );
    row.dtype = prec.name().into();
    let g = row.gflops;
    if let Some(at) = f32_at {
        let fg = gflops(s, median(&times[at]));
        row.f32_gflops = Some(fg);
        row.f32_ratio = Some(g / fg);
        let rel = max_rel_diff(&c, &c32);
        if rel.is_nan() || rel >= agreement_tolerance(rt, prec) {
            bail!(
                "{}: fugu-gemm at {prec} and at f32 disagree on the same operands (max relative difference {rel:e})",
                s.name
            );
        }
    }
    if opts.baseline {
        let bg = gflops(s, median(&times[baseline_at]));
        row.baseline_gflops = Some(bg);
        row.ratio = Some(g / bg);
        let rel = max_rel_diff(&c, &cb);
        row.max_rel_diff = Some(rel);
        if rel.is_nan() || rel >= agreement_tolerance(rt, prec) {
            bail!(
                "{}: fugu-gemm and matrixmultiply disagree (max relative difference {rel:e})",
                s.name
            );
        }
    }
    #[cfg(feature = "openblas")]
    if let Some(at) = openblas_at {
        let og = gflops(s, median(&times[at]));
        row.openblas_gflops = Some(og);
        row.openblas_ratio = Some(g / og);
        row.openblas_split_gflops = split_at.map(|i| gflops(s, median(&times[i])));
        super::openblas::set_threads(rt.threads());
    }
    Ok(row)
}

/// How far fugu-gemm at `prec` may be from another GEMM of the same (rounded) operands: f32
/// accumulation differs only in the order of the sums; f16 chunks round every addition to 11
/// bits (their bound is tested in fugu-gemm; here a loose check that catches a wrong result,
/// not rounding).
fn agreement_tolerance(rt: &Runtime, prec: Precision) -> f64 {
    match rt.kernel_at(prec).accumulation {
        fugu_gemm::kernel::Accumulation::F32 => 1e-3,
        fugu_gemm::kernel::Accumulation::F16Chunks(_) => 5e-2,
    }
}

/// The table header matching [`format_row`] for GEMMs at `prec`.
pub fn table_header(prec: Precision) -> String {
    let mut h = format!(
        "{:<10} {:<20} {:>17} {:>5} {:>3} {:<8} {:<5} {:>8} {:>6} {:>9} {:>6}",
        "set",
        "name",
        "MxNxK",
        "batch",
        "thr",
        "isa",
        "dtype",
        "GFLOP/s",
        "%peak",
        "mm GF/s",
        "ratio"
    );
    if cfg!(feature = "openblas") {
        h.push_str(&format!(
            " {:>9} {:>6} {:>9}",
            "oblas GF", "ratio", "oblas-spl"
        ));
    }
    if prec != Precision::F32 {
        h.push_str(&format!(" {:>9} {:>6}", "f32 GF/s", "x f32"));
    }
    h
}

fn opt(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.prec$}"))
}

/// One human-readable table line.
pub fn format_row(r: &BenchRow) -> String {
    let mut line = format!(
        "{:<10} {:<20} {:>17} {:>5} {:>3} {:<8} {:<5} {:>8.1} {:>6} {:>9} {:>6}",
        r.set,
        r.name,
        format!("{}x{}x{}", r.shape.m, r.shape.n, r.shape.k),
        r.shape.batch,
        r.threads,
        r.isa,
        match &r.out_dtype {
            Some(out) if *out != r.dtype => format!("{}>{out}", r.dtype),
            _ => r.dtype.clone(),
        },
        r.gflops,
        // A device without a known peak (the emulator) has none to compare with.
        if r.peak_pct.is_finite() {
            format!("{:.1}%", r.peak_pct)
        } else {
            "-".into()
        },
        opt(r.baseline_gflops, 1),
        opt(r.ratio, 2),
    );
    if cfg!(feature = "openblas") {
        line.push_str(&format!(
            " {:>9} {:>6} {:>9}",
            opt(r.openblas_gflops, 1),
            opt(r.openblas_ratio, 2),
            opt(r.openblas_split_gflops, 1)
        ));
    }
    if r.f32_gflops.is_some() {
        line.push_str(&format!(
            " {:>9} {:>6}",
            opt(r.f32_gflops, 1),
            opt(r.f32_ratio, 2)
        ));
    }
    line
}

/// One shape on a CUDA device: cuBLAS on operands of `opts.prec` (rounded to it on the host),
/// accumulating in f32, writing C as `out`; checked against fugu-gemm's f32 GEMM of the same
/// rounded operands on the host. The tolerance (largest difference relative to the largest
/// |C|) is 1e-3 for the summation order (1e-2 with TF32, whose inputs keep 10 mantissa bits),
/// or two roundings of C to `out` where that is larger. `isa` labels the row (`cublas`,
/// `cublas-tf32`); the peak is the device's for the operands' type (FP32 CUDA cores, or the
/// 16-bit tensor cores).
#[cfg(feature = "cuda")]
pub fn run_shape_cuda(
    be: &mut crate::backend::cuda::CudaBackend,
    rt: &Runtime,
    s: &BenchShape,
    opts: &BenchOptions,
    isa: &str,
    out: crate::backend::Dtype,
) -> Result<BenchRow> {
    use crate::backend::{Backend, Dtype};
    let prec = opts.prec;
    let mut ops = Operands {
        a: super::fill(s.batch * s.m * s.k, 1),
        b: super::fill(s.batch * s.k * s.n, 2),
    };
    prec.round_slice(&mut ops.a);
    prec.round_slice(&mut ops.b);
    let types = (Dtype::of_precision(prec), out);
    // Timed by the same interleaved-rounds helper as the CPU contenders; each run ends with a
    // device synchronisation so that it measures the kernel, not its launch.
    let g = be.upload_gemm(
        &ops.a,
        &ops.b,
        (s.m, s.n, s.k, s.batch),
        (s.ta, s.tb),
        types,
    )?;
    let mut fs: Vec<Contender> = vec![Box::new(|| {
        be.run_gemm(&g);
        be.sync();
    })];
    let times = time_interleaved(
        &mut fs,
        opts.budget_s,
        opts.min_reps,
        opts.max_reps,
        std::time::Duration::ZERO,
    );
    drop(fs);
    let c = be.finish_gemm(g);
    let mut want = vec![0.0f32; c.len()];
    run_fugu(rt, Precision::F32, s, &ops, &mut want)?;
    let rel = max_rel_diff(&c, &want);
    let order: f64 = if isa.contains("tf32") { 1e-2 } else { 1e-3 };
    let tol = order.max(2.0 * out.unit_roundoff());
    if rel.is_nan() || rel >= tol {
        bail!(
            "{}: cuBLAS and fugu-gemm disagree (max relative difference {rel:e}, tolerance {tol:e})",
            s.name
        );
    }
    let peak = be
        .peak_gflops(types.0)
        .unwrap_or((f64::NAN, "unknown (no device peak)".into()));
    let mut row = BenchRow::timed(
        s,
        isa.into(),
        (1, 1),
        &times[0],
        peak,
        "fugu-gemm on the host (correctness only)",
    );
    row.dtype = prec.name().into();
    row.out_dtype = Some(out.name().into());
    row.max_rel_diff = Some(rel);
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_sets_have_the_issue_shapes() {
        let g = shape_set("gpt2").unwrap();
        for (m, n, k) in [
            (1024, 2304, 768),
            (1024, 768, 768),
            (1024, 3072, 768),
            (1024, 768, 3072),
            (1024, 50304, 768),
        ] {
            assert!(
                g.iter().any(|s| (s.m, s.n, s.k) == (m, n, k)),
                "{m}x{n}x{k}"
            );
        }
        assert!(g.iter().any(|s| s.ta) && g.iter().any(|s| s.tb));
        let a = shape_set("attention").unwrap();
        assert_eq!(a.len(), 6);
        assert!(a.iter().all(|s| s.batch == 48));
        assert_eq!(shape_set("square").unwrap().last().unwrap().m, 4096);
        assert!(shape_set("nope").is_err());
    }

    #[test]
    fn custom_shapes() {
        let s = parse_shape("7x5x3x2").unwrap();
        assert_eq!((s.m, s.n, s.k, s.batch), (7, 5, 3, 2));
        assert!(parse_shape("7x5").is_err());
        assert!(parse_shape("7x0x3").is_err());
        assert!(parse_shape("axbxc").is_err());
        let t = parse_shape("7x5x3:tb").unwrap();
        assert_eq!((t.ta, t.tb, t.batch), (false, true, 1));
        let t = parse_shape("7x5x3x4:ta:tb").unwrap();
        assert_eq!((t.ta, t.tb, t.batch), (true, true, 4));
        assert!(parse_shape("7x5x3:tc").is_err());
        assert!(parse_shape("7x5x3:ta:ta").is_err());
        // Sizes that overflow, or would not fit, are refused by name (no panic).
        for huge in [
            "18446744073709551615x2x2",
            "4294967296x4294967296x1",
            "65536x65536x65536",
            "1024x1024x1024x100000",
        ] {
            let e = parse_shape(huge).unwrap_err().to_string();
            assert!(e.contains(huge) && e.contains("smaller shape"), "{e}");
        }
    }

    #[test]
    fn a_small_row_runs_and_agrees_with_the_baseline() {
        let rt = Runtime::new(fugu_gemm::RuntimeConfig {
            topology: fugu_gemm::TopologyRequest {
                layout: Some((1, 1)),
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        let peak = Peak {
            per_core_gflops: 10.0,
            threads: 1,
            source: fugu_gemm::peak::PeakSource::Given,
        };
        for prec in Precision::ALL {
            let opts = BenchOptions {
                budget_s: 0.0,
                min_reps: 1,
                max_reps: 1,
                prec,
                ..Default::default()
            };
            for s in [
                parse_shape("33x17x9x3").unwrap(),
                shape("t", "t", 20, 30, 40, 1, true, true),
            ] {
                let r = run_shape(&rt, &peak, &s, &opts).unwrap();
                assert!(r.gflops > 0.0 && r.baseline_gflops.unwrap() > 0.0);
                // Every contender multiplies the same (rounded) operands: with f32
                // accumulation only the order of the sums differs; an SVE machine's f16
                // kernel rounds its sums to f16 within each chunk (k ≤ 40 here: 40 additions,
                // each within 2^-11 relative of the partial sums, which do not cancel much on
                // these operands).
                let tol = match rt.kernel_at(prec).accumulation {
                    fugu_gemm::kernel::Accumulation::F32 => 1e-5,
                    fugu_gemm::kernel::Accumulation::F16Chunks(_) => 40.0 * 2f64.powi(-11),
                };
                assert!(
                    r.max_rel_diff.unwrap() < tol,
                    "{prec}: {:?}",
                    r.max_rel_diff
                );
                assert_eq!(r.dtype, prec.name());
                assert_eq!(r.f32_ratio.is_some(), prec != Precision::F32);
            }
        }
    }
}

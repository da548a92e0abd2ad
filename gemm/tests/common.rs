//! Shared helpers for the fugu-gemm integration tests: a deterministic RNG, runtime layouts
//! and a checker against the f64 reference.
#![allow(dead_code)]

use fugu_gemm::kernel::Accumulation;
use fugu_gemm::reference::gemm_ref;
use fugu_gemm::{
    Blocking, Isa, MatMut, MatRef, Precision, Runtime, RuntimeConfig, SplitMode, TopologyRequest,
};

/// A small xorshift RNG so the tests need no dependencies and are reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

/// The thread layouts every driver test runs under: 1 thread, 2 threads in one domain, and
/// simulated multi-domain layouts (2 domains × 1 thread, 2 domains × 2 threads).
pub fn layouts() -> Vec<(&'static str, TopologyRequest)> {
    let req = |layout: Option<(usize, usize)>, max: Option<usize>| TopologyRequest {
        layout,
        max_threads: max,
        pin: Some(false),
    };
    vec![
        ("1 thread", req(Some((1, 1)), None)),
        ("1 domain x 2 threads", req(Some((1, 2)), None)),
        ("2 domains x 1 thread", req(Some((2, 1)), None)),
        ("2 domains x 2 threads", req(Some((2, 2)), None)),
    ]
}

/// A runtime for `isa` and `layout`, with tiny blocks so that small matrices still run
/// several iterations of every loop (jc, pc, ic) and exercise every edge.
pub fn small_block_runtime(isa: Isa, topology: TopologyRequest) -> Runtime {
    small_block_runtime_split(isa, topology, None)
}

/// [`small_block_runtime`] with the threads' split forced (`None`: the one the caches pick).
pub fn small_block_runtime_split(
    isa: Isa,
    topology: TopologyRequest,
    split: Option<SplitMode>,
) -> Runtime {
    let k = fugu_gemm::kernel::kernel_for(isa).expect("caller checked the ISA");
    Runtime::new(RuntimeConfig {
        isa: Some(isa),
        topology,
        blocking: Some(Blocking {
            mc: 2 * k.mr,
            kc: 16,
            nc: 3 * k.nr,
            // Groups of two B̃ micro-panels under each Ã micro-panel, the last one short.
            nb: 2 * k.nr,
        }),
        f16_chunked: None,
        bf16_native: None,
        split,
    })
    .expect("runtime")
}

/// ISAs this CPU can run, narrowed to those `FUGU_TEST_ISAS` names (comma-separated, e.g.
/// `sve`) when it is set: `scripts/test-aarch64.sh` re-runs the tests under QEMU at several
/// SVE vector lengths and there re-tests only the kernels that depend on it. Prints the
/// skipped ones.
pub fn runnable_isas() -> Vec<Isa> {
    let only = std::env::var("FUGU_TEST_ISAS")
        .ok()
        .filter(|v| !v.is_empty());
    for name in only.iter().flat_map(|v| v.split(',')) {
        // A misspelt name would skip every kernel and leave the tests vacuous.
        if let Err(e) = Isa::parse(name) {
            panic!("FUGU_TEST_ISAS: {e}");
        }
    }
    Isa::ALL
        .iter()
        .copied()
        .filter(|&isa| {
            if let Some(only) = &only {
                if !only.split(',').any(|name| name.trim() == isa.name()) {
                    eprintln!("skipped: {isa} (FUGU_TEST_ISAS={only})");
                    return false;
                }
            }
            let ok = fugu_gemm::kernel::kernel_for(isa).is_some();
            if !ok {
                eprintln!("skipped: {isa} not supported on this CPU");
            }
            ok
        })
        .collect()
}

/// Storage of one operand: row-major or column-major inside a larger buffer with padding
/// (leading dimension larger than needed) and an offset, so every view is a strided sub-view.
#[derive(Clone, Copy, Debug)]
pub enum Layout {
    RowMajor,
    ColMajor,
    /// Both strides larger than 1 (e.g. every other element of every other row).
    Strided,
}

pub const LAYOUTS: [Layout; 3] = [Layout::RowMajor, Layout::ColMajor, Layout::Strided];

/// (buffer length, offset, row stride, col stride) for a `rows × cols` view in `layout`.
pub fn geometry(layout: Layout, rows: usize, cols: usize) -> (usize, usize, usize, usize) {
    let off = 3;
    let (rs, cs) = match layout {
        Layout::RowMajor => (cols + 2, 1),
        Layout::ColMajor => (1, rows + 1),
        Layout::Strided => (2, 2 * rows + 3),
    };
    let len = off + rows.saturating_sub(1) * rs + cols.saturating_sub(1) * cs + 1 + 5;
    (len, off, rs, cs)
}

/// Relative error bound for an f32 GEMM of depth k against the f64 reference.
pub fn tolerance(k: usize) -> f32 {
    1e-6 * (k as f32 + 8.0) * 4.0
}

/// One GEMM problem with its reference result, built once and checked against any number of
/// runtimes (the reference costs as much as the GEMM, and under QEMU it dominates). The
/// reference multiplies A and B rounded to the case's precision: a product of two 16-bit
/// values is exact in f32, so the f32 tolerance holds for every precision; an unrounded operand
/// would miss it by about the type's unit roundoff (2^-8 or 2^-11).
pub struct GemmCase {
    prec: Precision,
    dims: Dims,
    alpha: f32,
    beta: f32,
    a: Vec<f32>,
    b: Vec<f32>,
    /// C before the call.
    c: Vec<f32>,
    /// C after the call, computed from A and B rounded to `prec`.
    want: Vec<f32>,
    /// |alpha|·|A|·|B| per element of C (0 outside the view), for the f16-chunk error bound;
    /// computed the first time a kernel that sums in f16 chunks is checked.
    magnitude: std::cell::OnceCell<Vec<f32>>,
}

/// A case's shape and operand layouts: the views of its A, B and C buffers ([`geometry`]).
#[derive(Clone, Copy)]
struct Dims {
    m: usize,
    n: usize,
    k: usize,
    la: Layout,
    lb: Layout,
    lc: Layout,
}

impl Dims {
    fn a<'d>(&self, d: &'d [f32]) -> MatRef<'d, f32> {
        let (_, off, rs, cs) = geometry(self.la, self.m, self.k);
        MatRef::with_offset(d, off, self.m, self.k, rs, cs).unwrap()
    }

    fn b<'d>(&self, d: &'d [f32]) -> MatRef<'d, f32> {
        let (_, off, rs, cs) = geometry(self.lb, self.k, self.n);
        MatRef::with_offset(d, off, self.k, self.n, rs, cs).unwrap()
    }

    fn c<'d>(&self, d: &'d mut [f32]) -> MatMut<'d, f32> {
        let (_, off, rs, cs) = geometry(self.lc, self.m, self.n);
        MatMut::with_offset(d, off, self.m, self.n, rs, cs).unwrap()
    }
}

impl GemmCase {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        prec: Precision,
        rng: &mut Rng,
        m: usize,
        n: usize,
        k: usize,
        la: Layout,
        lb: Layout,
        lc: Layout,
        alpha: f32,
        beta: f32,
    ) -> GemmCase {
        let dims = Dims {
            m,
            n,
            k,
            la,
            lb,
            lc,
        };
        let a = rng.vec(geometry(la, m, k).0);
        let b = rng.vec(geometry(lb, k, n).0);
        let (clen, coff, crs, ccs) = geometry(lc, m, n);
        let mut c = rng.vec(clen);
        if beta == 0.0 {
            // NaN must not leak from C when beta is 0. Mark the elements of the view only, so
            // the padding check still sees the original values.
            for i in 0..m {
                for j in 0..n {
                    c[coff + i * crs + j * ccs] = f32::NAN;
                }
            }
        }
        let mut want = c.clone();
        let (ar, br) = (rounded(prec, &a), rounded(prec, &b));
        gemm_ref(alpha, dims.a(&ar), dims.b(&br), beta, dims.c(&mut want));
        GemmCase {
            prec,
            dims,
            alpha,
            beta,
            a,
            b,
            c,
            want,
            magnitude: std::cell::OnceCell::new(),
        }
    }

    fn magnitude(&self) -> &[f32] {
        self.magnitude.get_or_init(|| {
            let abs = |v: &[f32]| {
                rounded(self.prec, v)
                    .iter()
                    .map(|x| x.abs())
                    .collect::<Vec<_>>()
            };
            let (aa, ba) = (abs(&self.a), abs(&self.b));
            let mut mag = vec![0.0f32; self.c.len()];
            let d = self.dims;
            gemm_ref(self.alpha.abs(), d.a(&aa), d.b(&ba), 0.0, d.c(&mut mag));
            mag
        })
    }

    /// Runs `rt`'s GEMM at the case's precision and compares every element (and the untouched
    /// padding) against the reference. Returns a description of the first mismatch.
    pub fn check(&self, rt: &Runtime) -> Result<(), String> {
        let GemmCase {
            prec, alpha, beta, ..
        } = *self;
        let d = self.dims;
        let Dims {
            m,
            n,
            k,
            la,
            lb,
            lc,
        } = d;
        let mut c = self.c.clone();
        rt.at(prec)
            .gemm(alpha, d.a(&self.a), d.b(&self.b), beta, d.c(&mut c))
            .map_err(|e| e.to_string())?;
        // Kernels that sum in f16 chunks of c (the SVE f16 kernel, the emulation) add up to
        // c·2^-11 of Σ|alpha·a·b| (each f16 addition, the first included, rounds), plus f16's
        // subnormal step per addition: bounded per element from |alpha|·|A|·|B|.
        let chunk_error = |idx: usize| match rt.kernel_at(prec).accumulation {
            Accumulation::F16Chunks(chunk) => {
                let u = (2.0f32).powi(-11);
                chunk.min(k) as f32 * u * self.magnitude()[idx]
                    + k as f32 * alpha.abs() * (2.0f32).powi(-25)
            }
            _ => 0.0,
        };
        let tol = tolerance(k);
        for (idx, (&got, &exp)) in c.iter().zip(&self.want).enumerate() {
            let scale = 1.0 + exp.abs();
            let ok = (got - exp).abs() <= tol * scale + chunk_error(idx) || got == exp;
            if !(got.is_finite() == exp.is_finite() && ok) {
                return Err(format!(
                    "{prec}: m={m} n={n} k={k} A={la:?} B={lb:?} C={lc:?} alpha={alpha} beta={beta}: element {idx} is {got}, want {exp} (tol {tol})"
                ));
            }
        }
        Ok(())
    }
}

/// `v` rounded to `prec` (as the kernels see it).
fn rounded(prec: Precision, v: &[f32]) -> Vec<f32> {
    let mut r = v.to_vec();
    prec.round_slice(&mut r);
    r
}

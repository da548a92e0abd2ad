//! The runtime: the chosen kernel, block sizes and one worker team per NUMA domain; and the GEMM
//! entry points that validate views and dispatch to the driver.

use crate::blocking::{Blocking, CacheInfo};
use crate::buffer::AlignedBuf;
use crate::driver::{run_parallel, run_sequential, Ctx, Dest, Problem, SplitMode, MAX_TILE};
use crate::error::GemmError;
use crate::into::Target;
use crate::kernel::{Isa, Kernel, KernelChoice};
use crate::precision::{Element, Precision};
use crate::raw::{RawMat, RawMatMut, RawOut};
use crate::team::Team;
use crate::topology::{pin_current_thread, Topology, TopologyRequest};
use crate::view::{BatchMut, BatchRef, MatMut, MatRef};
use std::sync::{Mutex, OnceLock};

/// Everything that can be chosen when building a [`Runtime`]. `Default` means "detect";
/// [`RuntimeConfig::from_env`] reads the `FUGU_*` environment variables.
#[derive(Clone, Debug, Default)]
pub struct RuntimeConfig {
    /// Force one micro-kernel (`FUGU_GEMM_ISA`).
    pub isa: Option<Isa>,
    /// Domains, thread cap and pinning (`FUGU_CMGS`, `FUGU_NUM_THREADS`, `FUGU_PIN`).
    pub topology: TopologyRequest,
    /// Block sizes instead of the cache-derived ones (`FUGU_GEMM_MC/KC/NC/NB` override fields).
    pub blocking: Option<Blocking>,
    /// How f16 GEMMs sum their products (`FUGU_GEMM_F16=chunked|f32`): `Some(true)` in f16
    /// chunks folded into f32 ([`crate::kernel::F16_CHUNK`]; the native SVE kernel, or its
    /// portable emulation on other CPUs, to reproduce A64FX numbers anywhere), `Some(false)`
    /// in f32 (the f32 kernel after an f16 rounding pack). `None`: chunks where a native f16
    /// kernel exists, f32 elsewhere.
    pub f16_chunked: Option<bool>,
    /// Which kernel bf16 GEMMs run (`FUGU_GEMM_BF16=native|f32`): `Some(false)` the f32
    /// kernel after a bf16 rounding pack (the same products, summed by f32 FMAs), where a
    /// native bf16 kernel (AVX-512 BF16's `vdpbf16ps`) is slower than the f32 one, as on
    /// Sapphire Rapids, whose `vdpbf16ps` issues on one port where f32 FMAs issue on two.
    /// `None` or `Some(true)`: the native kernel where there is one.
    pub bf16_native: Option<bool>,
    /// How a domain's threads share one GEMM (`FUGU_GEMM_SPLIT=ic|jr`).
    pub split: Option<SplitMode>,
}

impl RuntimeConfig {
    /// Reads `FUGU_GEMM_ISA`, `FUGU_CMGS`, `FUGU_NUM_THREADS`, `FUGU_PIN` and
    /// `FUGU_GEMM_SPLIT`. (`FUGU_GEMM_MC/KC/NC/NB` are applied in [`Runtime::new`].)
    pub fn from_env() -> Result<RuntimeConfig, GemmError> {
        let isa = match std::env::var("FUGU_GEMM_ISA") {
            Ok(v) if !v.trim().is_empty() => Some(Isa::parse(&v)?),
            _ => None,
        };
        let split = match std::env::var("FUGU_GEMM_SPLIT") {
            Ok(v) => Some(match v.trim() {
                "ic" => SplitMode::Ic,
                "jr" => SplitMode::Jr,
                _ => {
                    return Err(GemmError::Config {
                        what: "FUGU_GEMM_SPLIT".into(),
                        value: v,
                        expected: "ic or jr".into(),
                    })
                }
            }),
            Err(_) => None,
        };
        let f16_chunked = env_switch(
            "FUGU_GEMM_F16",
            ("chunked", "f32"),
            "chunked (f16 accumulation in chunks, as on A64FX) or f32",
        )?;
        let bf16_native = env_switch(
            "FUGU_GEMM_BF16",
            ("native", "f32"),
            "native (the CPU's bf16 kernel) or f32 (the f32 kernel on bf16-rounded operands)",
        )?;
        Ok(RuntimeConfig {
            isa,
            topology: TopologyRequest::from_env()?,
            blocking: None,
            f16_chunked,
            bf16_native,
            split,
        })
    }
}

/// A two-way setting from environment variable `name`: `Some(true)` for `on`, `Some(false)`
/// for `off`, `None` when unset; any other value an error naming the variable and `expected`.
fn env_switch(
    name: &str,
    (on, off): (&str, &str),
    expected: &str,
) -> Result<Option<bool>, GemmError> {
    match std::env::var(name) {
        Ok(v) if v.trim() == on => Ok(Some(true)),
        Ok(v) if v.trim() == off => Ok(Some(false)),
        Ok(v) => Err(GemmError::Config {
            what: name.into(),
            value: v,
            expected: expected.into(),
        }),
        Err(_) => Ok(None),
    }
}

struct Domain {
    /// The domain's pinned workers; `None` for a single-threaded runtime, which runs on the
    /// calling thread.
    team: Option<Team>,
    threads: usize,
    /// Packing buffers owned by this domain (B̃ panel, shared Ã block), reused across calls.
    bufs: Mutex<Vec<(AlignedBuf, AlignedBuf)>>,
}

/// A configured GEMM engine: kernel, block sizes and per-domain worker teams.
///
/// Most code uses the process-wide runtime behind [`crate::gemm`] (configured from the
/// environment). Build your own with [`Runtime::new`] to choose threads or layout in code.
pub struct Runtime {
    /// One context per [`Precision`], in the order of [`Precision::ALL`].
    ctxs: [Ctx; 3],
    split: SplitMode,
    topology: Topology,
    caches: CacheInfo,
    domains: Vec<Domain>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

static GLOBAL: OnceLock<Result<Runtime, GemmError>> = OnceLock::new();

impl Runtime {
    /// Builds a runtime: picks the kernel, derives block sizes and starts the domain teams.
    pub fn new(cfg: RuntimeConfig) -> Result<Runtime, GemmError> {
        let choice = KernelChoice::new(cfg.isa)?;
        let kernel = choice.f32;
        assert!(
            kernel.mr * kernel.nr <= MAX_TILE,
            "kernel tile exceeds MAX_TILE"
        );
        let topology = Topology::build(&cfg.topology);
        let first_cpu = topology
            .domains
            .iter()
            .flat_map(|d| d.cpus.first())
            .next()
            .copied()
            .unwrap_or(0);
        let caches = CacheInfo::detect(first_cpu);
        let split = cfg.split.unwrap_or(if caches.l2_shared_by > 1 {
            SplitMode::Jr
        } else {
            SplitMode::Ic
        });
        let kc_fixed = crate::blocking::kc_overridden() || cfg.blocking.is_some();
        let ctx_for = |prec: Precision| -> Result<Ctx, GemmError> {
            let kernel = choice.at(prec, cfg.f16_chunked, cfg.bf16_native);
            let blk = match cfg.blocking {
                Some(b) => b,
                None => Blocking::derive_for(
                    &caches,
                    kernel.mr,
                    kernel.nr,
                    kernel.l1_panel,
                    split == SplitMode::Jr,
                ),
            }
            .with_env_overrides(kernel.mr, kernel.nr)?;
            Ok(Ctx {
                kernel,
                prec,
                blk,
                l1d: caches.l1d,
                llc: caches.l3_share(),
                kc_fixed,
            })
        };
        let ctxs = [
            ctx_for(Precision::F32)?,
            ctx_for(Precision::Bf16)?,
            ctx_for(Precision::F16)?,
        ];
        debug_assert!(Precision::ALL.iter().zip(&ctxs).all(|(&p, c)| c.prec == p));
        let single = topology.domains.len() == 1 && topology.domains[0].threads == 1;
        let mut domains = Vec::new();
        for (di, d) in topology.domains.iter().enumerate() {
            let team = if single {
                None
            } else {
                let cpus = d.cpus.clone();
                let pin = topology.pin;
                let threads = d.threads;
                let team = Team::new(
                    d.threads,
                    |i| format!("fugu-gemm-d{di}-t{i}"),
                    move |i| {
                        if pin && !cpus.is_empty() {
                            if threads <= cpus.len() {
                                pin_current_thread(&cpus[i % cpus.len()..=i % cpus.len()]);
                            } else {
                                pin_current_thread(&cpus);
                            }
                        }
                    },
                )
                .map_err(|e| GemmError::Config {
                    what: "worker threads".into(),
                    value: format!("{} threads", d.threads),
                    expected: format!("threads the OS can start ({e})"),
                })?;
                Some(team)
            };
            domains.push(Domain {
                team,
                threads: d.threads,
                bufs: Mutex::new(Vec::new()),
            });
        }
        Ok(Runtime {
            ctxs,
            split,
            topology,
            caches,
            domains,
        })
    }

    /// A runtime configured from the environment (see [`RuntimeConfig::from_env`]).
    pub fn from_env() -> Result<Runtime, GemmError> {
        Runtime::new(RuntimeConfig::from_env()?)
    }

    /// The process-wide runtime used by [`crate::gemm`] and friends, built from the
    /// environment on first use. A bad environment setting is returned on every call.
    pub fn global() -> Result<&'static Runtime, GemmError> {
        GLOBAL
            .get_or_init(Runtime::from_env)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn ctx(&self, prec: Precision) -> &Ctx {
        &self.ctxs[prec as usize]
    }

    /// The `f32` micro-kernel in use.
    pub fn kernel(&self) -> Kernel {
        self.ctx(Precision::F32).kernel
    }
    /// The micro-kernel that runs GEMMs at `prec` (the `f32` one when this CPU has no native
    /// kernel for `prec`; see [`kernel_for_precision`](crate::kernel::kernel_for_precision)).
    pub fn kernel_at(&self, prec: Precision) -> Kernel {
        self.ctx(prec).kernel
    }
    /// The block sizes of the `f32` kernel.
    pub fn blocking(&self) -> Blocking {
        self.ctx(Precision::F32).blk
    }

    /// This runtime's GEMMs at `prec`: operands rounded to `prec`, products accumulated in
    /// `f32` (see [`Precision`]).
    pub fn at(&self, prec: Precision) -> PrecisionGemm<'_> {
        PrecisionGemm {
            rt: self,
            ctx: self.ctx(prec),
        }
    }
    /// The domains and threads.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }
    /// The detected cache sizes.
    pub fn caches(&self) -> CacheInfo {
        self.caches
    }
    /// How a domain's threads share one GEMM.
    pub fn split_mode(&self) -> SplitMode {
        self.split
    }
    /// Total number of threads.
    pub fn threads(&self) -> usize {
        self.domains.iter().map(|d| d.threads).sum()
    }

    /// One line for logs: kernel, tile, blocks, domains.
    pub fn describe(&self) -> String {
        let k = self.kernel();
        let b = self.blocking();
        format!(
            "isa={} tile={}x{} mc={} kc={} nc={} nb={} split={:?} {}",
            k.isa,
            k.mr,
            k.nr,
            b.mc,
            b.kc,
            b.nc,
            b.nb,
            self.split,
            self.topology.describe()
        )
    }

    /// The kernel of each precision, one line ([`describe_kernels`](crate::kernel::describe_kernels)).
    pub fn describe_kernels(&self) -> String {
        crate::kernel::describe_kernels(&self.ctxs.map(|c| c.kernel))
    }

    /// `C := alpha·A·B + beta·C` in `f32` (see [`PrecisionGemm::gemm`]).
    pub fn gemm(
        &self,
        alpha: f32,
        a: MatRef<'_, f32>,
        b: MatRef<'_, f32>,
        beta: f32,
        c: MatMut<'_, f32>,
    ) -> Result<(), GemmError> {
        self.at(Precision::F32).gemm(alpha, a, b, beta, c)
    }

    /// Strided batched GEMM in `f32` (see [`PrecisionGemm::gemm_strided_batched`]).
    pub fn gemm_strided_batched(
        &self,
        alpha: f32,
        a: BatchRef<'_, f32>,
        b: BatchRef<'_, f32>,
        beta: f32,
        c: BatchMut<'_, f32>,
    ) -> Result<(), GemmError> {
        self.at(Precision::F32)
            .gemm_strided_batched(alpha, a, b, beta, c)
    }

    /// Pointer-array batched GEMM in `f32` (see [`PrecisionGemm::gemm_batched`]).
    pub fn gemm_batched(
        &self,
        alpha: f32,
        a: &[MatRef<'_, f32>],
        b: &[MatRef<'_, f32>],
        beta: f32,
        c: &mut [MatMut<'_, f32>],
    ) -> Result<(), GemmError> {
        self.at(Precision::F32).gemm_batched(alpha, a, b, beta, c)
    }

    /// Runs one problem on all domains: rows of C are split over domains in proportion to
    /// their threads, each domain packing its own panels.
    fn run_one(&self, ctx: &Ctx, p: Problem) {
        let Some(p) = p.needs_kernel() else {
            return;
        };
        if self.threads() == 1 {
            return run_sequential(ctx, p);
        }
        let mr = ctx.kernel.mr;
        let nd = self.domains.len();
        if nd == 1 || p.m() < nd * mr * 4 {
            return self.run_on_domain(ctx, 0, p);
        }
        let total = self.threads();
        let mut parts = Vec::with_capacity(nd);
        let (mut start, mut cum) = (0, 0);
        for d in &self.domains {
            cum += d.threads;
            let end = if cum == total {
                p.m()
            } else {
                (p.m() * cum / total).next_multiple_of(mr).min(p.m())
            };
            parts.push((start, end.max(start) - start));
            start = end.max(start);
        }
        std::thread::scope(|s| {
            for (di, &(r0, rows)) in parts.iter().enumerate().skip(1) {
                if rows > 0 {
                    let sub = p.rows(r0, rows);
                    s.spawn(move || self.run_on_domain(ctx, di, sub));
                }
            }
            let (r0, rows) = parts[0];
            if rows > 0 {
                self.run_on_domain(ctx, 0, p.rows(r0, rows));
            }
        });
    }

    fn run_on_domain(&self, ctx: &Ctx, di: usize, p: Problem) {
        let d = &self.domains[di];
        let Some(team) = d.team.as_ref().filter(|_| d.threads > 1) else {
            return match d.team.as_ref() {
                Some(team) => team.run(|_| run_sequential(ctx, p)),
                None => run_sequential(ctx, p),
            };
        };
        let (mut bbuf, mut abuf) = d
            .bufs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
            .unwrap_or((AlignedBuf::empty(), AlignedBuf::empty()));
        run_parallel(ctx, p, team, self.split, &mut bbuf, &mut abuf);
        d.bufs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((bbuf, abuf));
    }

    /// Schedules a batch: whole problems go to domains and threads by cost when that balances
    /// well (many small GEMMs: attention); otherwise each problem uses every thread in turn.
    fn run_batch(&self, ctx: &Ctx, problems: Vec<Problem>) {
        // Empty and scale-only problems are finished here; the rest need the kernel.
        let mut work: Vec<Problem> = problems
            .into_iter()
            .filter_map(Problem::needs_kernel)
            .collect();
        let threads = self.threads();
        if threads == 1 {
            return work.into_iter().for_each(|p| run_sequential(ctx, p));
        }
        if work.is_empty() {
            return;
        }
        // Longest-processing-time-first over all threads predicts the balance.
        work.sort_by_key(|p| std::cmp::Reverse(p.cost()));
        let mut loads = vec![0u128; threads];
        for p in &work {
            let min = loads.iter_mut().min().expect("threads >= 1");
            *min += p.cost();
        }
        let total: u128 = loads.iter().sum();
        let makespan = *loads.iter().max().expect("threads >= 1");
        let efficiency = total as f64 / (threads as f64 * makespan as f64);
        if efficiency < 0.8 {
            return work.into_iter().for_each(|p| self.run_one(ctx, p));
        }
        // Whole problems to domains, by cost relative to each domain's thread count.
        let nd = self.domains.len();
        let mut per_domain: Vec<Vec<Problem>> = vec![Vec::new(); nd];
        let mut dload = vec![0f64; nd];
        for p in work {
            let di = (0..nd)
                .min_by(|&x, &y| {
                    let lx = (dload[x] + p.cost() as f64) / self.domains[x].threads as f64;
                    let ly = (dload[y] + p.cost() as f64) / self.domains[y].threads as f64;
                    lx.total_cmp(&ly)
                })
                .expect("at least one domain");
            dload[di] += p.cost() as f64;
            per_domain[di].push(p);
        }
        let run_domain = |di: usize, ps: Vec<Problem>| match self.domains[di].team.as_ref() {
            Some(team) => team.for_each(ps, |p| run_sequential(ctx, p)),
            None => ps.into_iter().for_each(|p| run_sequential(ctx, p)),
        };
        let mut per_domain = per_domain.into_iter().enumerate();
        let first = per_domain.next();
        std::thread::scope(|s| {
            for (di, ps) in per_domain {
                if !ps.is_empty() {
                    s.spawn(move || run_domain(di, ps));
                }
            }
            if let Some((di, ps)) = first {
                run_domain(di, ps);
            }
        });
    }
}

/// A [`Runtime`]'s GEMMs at one [`Precision`] ([`Runtime::at`]): A and B are rounded to the
/// precision as they are packed, C is `f32` and the products accumulate in `f32`.
#[derive(Clone, Copy)]
pub struct PrecisionGemm<'a> {
    rt: &'a Runtime,
    ctx: &'a Ctx,
}

impl PrecisionGemm<'_> {
    /// `C := alpha·A·B + beta·C`.
    ///
    /// A is m×k, B is k×n and C is m×n; any strides. A and B may be `f32`, [`half::f16`] or
    /// [`half::bf16`] views ([`Element`]), converted exactly as they are packed and then
    /// rounded to this precision; C is `f32`. When `beta == 0`, C is not read (NaN in C does
    /// not propagate). Mismatched shapes return [`GemmError::ShapeMismatch`].
    pub fn gemm<TA: Element, TB: Element>(
        &self,
        alpha: f32,
        a: MatRef<'_, TA>,
        b: MatRef<'_, TB>,
        beta: f32,
        mut c: MatMut<'_, f32>,
    ) -> Result<(), GemmError> {
        check_shapes(&a, &b, c.rows(), c.cols(), "")?;
        let p = problem(alpha, &a, &b, beta, &mut c);
        self.rt.run_one(self.ctx, p);
        Ok(())
    }

    /// `D := alpha·A·B + start` with D of any [`Element`] type, written once: each element is
    /// summed in `f32` (the start, then the product's k blocks, as [`Self::gemm`] adds them onto
    /// an `f32` C) in a tile of the thread's own, then rounded to D's type (to nearest even).
    /// So a 16-bit D costs its 16-bit bytes and no `f32` copy of D exists, and its values are
    /// those of [`Self::gemm`] with `beta = 1` on a unit-stride `f32` C set to the start,
    /// rounded once: bit for bit. The start is `beta·C + bias` ([`Start`]); C is read and not
    /// written. Mismatched shapes return [`GemmError::ShapeMismatch`].
    pub fn gemm_into<TA: Element, TB: Element, TD: Element>(
        &self,
        alpha: f32,
        a: MatRef<'_, TA>,
        b: MatRef<'_, TB>,
        start: Start<'_, TD>,
        mut d: MatMut<'_, TD>,
    ) -> Result<(), GemmError> {
        let (m, n) = (d.rows(), d.cols());
        check_shapes(&a, &b, m, n, "")?;
        if let Some(c) = &start.c {
            if (c.rows(), c.cols()) != (m, n) {
                return Err(GemmError::ShapeMismatch {
                    detail: format!(
                        "C is {}x{}, D is {m}x{n}: the start's C has D's shape",
                        c.rows(),
                        c.cols()
                    ),
                });
            }
        }
        if let Some(bias) = start.bias {
            if bias.len() != n {
                return Err(GemmError::ShapeMismatch {
                    detail: format!(
                        "the bias has {} values, D has {n} columns: one per column",
                        bias.len()
                    ),
                });
            }
        }
        let bias = start.bias.map(|b| RawMat {
            ptr: b.as_ptr().cast(),
            storage: TD::STORAGE,
            rows: m,
            cols: n,
            rs: 0,
            cs: 1,
        });
        let target = Target {
            d: raw_out(&mut d),
            c: start.c.as_ref().map(raw),
            bias,
        };
        let p = Problem {
            alpha,
            a: raw(&a),
            b: raw(&b),
            beta: start.beta,
            c: Dest::Into(target),
        };
        self.rt.run_one(self.ctx, p);
        Ok(())
    }

    /// Strided batched [`Self::gemm_into`] with no start: `D[i] := alpha·A[i]·B[i]` for every
    /// `i` of the batch, each element's `f32` sum rounded once to D's type (`bmm` into a
    /// 16-bit tensor, with no `f32` copy of it).
    pub fn gemm_into_strided_batched<TA: Element, TB: Element, TD: Element>(
        &self,
        alpha: f32,
        a: BatchRef<'_, TA>,
        b: BatchRef<'_, TB>,
        mut d: BatchMut<'_, TD>,
    ) -> Result<(), GemmError> {
        let problems = batch_problems(alpha, a, b, 0.0, &mut d, |d| {
            Dest::Into(Target {
                d: raw_out(d),
                c: None,
                bias: None,
            })
        })?;
        self.rt.run_batch(self.ctx, problems);
        Ok(())
    }

    /// Strided batched GEMM: `C[i] := alpha·A[i]·B[i] + beta·C[i]` for every `i` of the batch
    /// (PyTorch's `baddbmm`; `bmm` is `beta = 0`).
    pub fn gemm_strided_batched<TA: Element, TB: Element>(
        &self,
        alpha: f32,
        a: BatchRef<'_, TA>,
        b: BatchRef<'_, TB>,
        beta: f32,
        mut c: BatchMut<'_, f32>,
    ) -> Result<(), GemmError> {
        let problems = batch_problems(alpha, a, b, beta, &mut c, |c| Dest::F32(raw_f32(c)))?;
        self.rt.run_batch(self.ctx, problems);
        Ok(())
    }

    /// Pointer-array batched GEMM: `C[i] := alpha·A[i]·B[i] + beta·C[i]`. Problems may have
    /// different shapes; they are scheduled by cost (m·n·k).
    pub fn gemm_batched<TA: Element, TB: Element>(
        &self,
        alpha: f32,
        a: &[MatRef<'_, TA>],
        b: &[MatRef<'_, TB>],
        beta: f32,
        c: &mut [MatMut<'_, f32>],
    ) -> Result<(), GemmError> {
        if a.len() != c.len() || b.len() != c.len() {
            return Err(GemmError::BatchMismatch {
                detail: format!(
                    "{} A matrices, {} B matrices, {} C matrices",
                    a.len(),
                    b.len(),
                    c.len()
                ),
            });
        }
        let mut problems = Vec::with_capacity(c.len());
        for (i, ci) in c.iter_mut().enumerate() {
            check_shapes(
                &a[i],
                &b[i],
                ci.rows(),
                ci.cols(),
                &format!(" (problem {i})"),
            )?;
            problems.push(problem(alpha, &a[i], &b[i], beta, ci));
        }
        self.rt.run_batch(self.ctx, problems);
        Ok(())
    }
}

fn check_shapes<TA, TB>(
    a: &MatRef<'_, TA>,
    b: &MatRef<'_, TB>,
    m: usize,
    n: usize,
    ctx: &str,
) -> Result<(), GemmError> {
    if a.rows() != m || b.cols() != n || a.cols() != b.rows() {
        return Err(GemmError::ShapeMismatch {
            detail: format!(
                "A is {}x{}, B is {}x{}, C is {}x{}{}: need A m×k, B k×n, C m×n",
                a.rows(),
                a.cols(),
                b.rows(),
                b.cols(),
                m,
                n,
                ctx
            ),
        });
    }
    Ok(())
}

fn raw<T: Element>(v: &MatRef<'_, T>) -> RawMat {
    let empty = v.rows() == 0 || v.cols() == 0;
    RawMat {
        ptr: if empty {
            std::ptr::null()
        } else {
            v.ptr().cast()
        },
        storage: T::STORAGE,
        rows: v.rows(),
        cols: v.cols(),
        rs: v.row_stride(),
        cs: v.col_stride(),
    }
}

/// The problems of a strided batch, each C (or D) made a [`Dest`] by `dest`.
fn batch_problems<TA: Element, TB: Element, TC>(
    alpha: f32,
    a: BatchRef<'_, TA>,
    b: BatchRef<'_, TB>,
    beta: f32,
    c: &mut BatchMut<'_, TC>,
    dest: impl Fn(&mut MatMut<'_, TC>) -> Dest,
) -> Result<Vec<Problem>, GemmError> {
    if a.batch() != c.batch() || b.batch() != c.batch() {
        return Err(GemmError::BatchMismatch {
            detail: format!(
                "A has {} matrices, B has {}, C has {}",
                a.batch(),
                b.batch(),
                c.batch()
            ),
        });
    }
    let mut cs = c.matrices();
    let mut problems = Vec::with_capacity(cs.len());
    for (i, ci) in cs.iter_mut().enumerate() {
        let (ai, bi) = (
            a.matrix(i).expect("i < batch"),
            b.matrix(i).expect("i < batch"),
        );
        check_shapes(&ai, &bi, ci.rows(), ci.cols(), "")?;
        problems.push(Problem {
            alpha,
            a: raw(&ai),
            b: raw(&bi),
            beta,
            c: dest(ci),
        });
    }
    Ok(problems)
}

/// An `f32` C.
fn raw_f32(c: &mut MatMut<'_, f32>) -> RawMatMut {
    RawMatMut {
        ptr: c.ptr_mut(),
        rows: c.rows(),
        cols: c.cols(),
        rs: c.row_stride(),
        cs: c.col_stride(),
    }
}

/// A D of any element type.
fn raw_out<T: Element>(d: &mut MatMut<'_, T>) -> RawOut {
    RawOut(RawMat {
        ptr: d.ptr_mut().cast_const().cast(),
        storage: T::STORAGE,
        rows: d.rows(),
        cols: d.cols(),
        rs: d.row_stride(),
        cs: d.col_stride(),
    })
}

fn problem<TA: Element, TB: Element>(
    alpha: f32,
    a: &MatRef<'_, TA>,
    b: &MatRef<'_, TB>,
    beta: f32,
    c: &mut MatMut<'_, f32>,
) -> Problem {
    Problem {
        alpha,
        a: raw(a),
        b: raw(b),
        beta,
        c: Dest::F32(raw_f32(c)),
    }
}

/// What each element of a [`PrecisionGemm::gemm_into`] starts from before the product is
/// added: `beta·c + bias[j]` (`j` its column), each term optional, in `f32` (`beta·c`, then
/// `+ bias[j]`, each rounded to `f32`: what adding onto an `f32` C set to `c`, scaled, then
/// `+= bias` does; C is not read when `beta` is 0). [`Start::zero`]: nothing.
#[derive(Clone, Copy, Debug)]
pub struct Start<'a, T> {
    pub beta: f32,
    pub c: Option<MatRef<'a, T>>,
    /// One value per column of D.
    pub bias: Option<&'a [T]>,
}

impl<'a, T> Start<'a, T> {
    /// No start: D is the product alone.
    pub fn zero() -> Self {
        Start {
            beta: 0.0,
            c: None,
            bias: None,
        }
    }
}

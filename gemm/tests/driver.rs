//! The full GEMM (driver + every runnable kernel) against the f64 reference, over awkward
//! shapes, every transpose/stride combination, several beta values, and 1-thread, 2-thread and
//! simulated multi-domain layouts.

mod common;
use common::*;
use fugu_gemm::{GemmError, MatMut, MatRef, Precision, SplitMode, TopologyRequest};

const DIMS: [usize; 7] = [0, 1, 2, 7, 13, 33, 67];

#[test]
fn gemm_matches_reference_all_isas_layouts_and_shapes() {
    let mut rng = Rng::new(1);
    let mut checked = 0;
    for isa in runnable_isas() {
        for (lname, layout) in layouts() {
            let rt = small_block_runtime(isa, layout);
            for &m in &DIMS {
                for &n in &DIMS {
                    for &k in &[0usize, 1, 5, 17, 40] {
                        // Cover every operand layout on a subset, and one layout for the rest.
                        let all = (m + n + k) % 5 == 0;
                        for la in LAYOUTS {
                            for lb in LAYOUTS {
                                for lc in LAYOUTS {
                                    let default = matches!(la, Layout::RowMajor)
                                        && matches!(lb, Layout::ColMajor)
                                        && matches!(lc, Layout::RowMajor);
                                    if !all && !default {
                                        continue;
                                    }
                                    for (alpha, beta) in [(1.0, 0.0), (1.0, 1.0), (-0.75, 0.5)] {
                                        let case = GemmCase::new(
                                            Precision::F32,
                                            &mut rng,
                                            m,
                                            n,
                                            k,
                                            la,
                                            lb,
                                            lc,
                                            alpha,
                                            beta,
                                        );
                                        if let Err(e) = case.check(&rt) {
                                            panic!("isa {isa}, {lname}: {e}");
                                        }
                                        checked += 1;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("checked {checked} GEMMs");
    assert!(checked > 1000);
}

/// Both ways of sharing a domain's GEMM between its threads, forced whatever this host's
/// caches would pick (the jr split, A64FX's, is chosen only where the L2 is shared): awkward
/// shapes on every multi-threaded layout, so shared Ã and B̃ blocks are packed by several
/// members, the ic split's column blocks (m ≤ mc) and its shared-B̃ path both run.
#[test]
fn both_thread_splits_match_reference() {
    let mut rng = Rng::new(11);
    let mut checked = 0;
    for isa in runnable_isas() {
        for (lname, layout) in layouts() {
            for split in [SplitMode::Ic, SplitMode::Jr] {
                let rt = small_block_runtime_split(isa, layout.clone(), Some(split));
                if rt.threads() == 1 {
                    continue;
                }
                for &(m, n, k) in &[
                    (7, 13, 5),
                    (33, 29, 17),
                    (67, 7, 40),
                    (67, 67, 40),
                    (130, 45, 50),
                ] {
                    for (alpha, beta) in [(1.0, 0.0), (-0.75, 0.5)] {
                        GemmCase::new(
                            Precision::F32,
                            &mut rng,
                            m,
                            n,
                            k,
                            Layout::RowMajor,
                            Layout::ColMajor,
                            Layout::RowMajor,
                            alpha,
                            beta,
                        )
                        .check(&rt)
                        .unwrap_or_else(|e| panic!("isa {isa}, {lname}, {split:?}: {e}"));
                        checked += 1;
                    }
                }
            }
        }
    }
    eprintln!("checked {checked} GEMMs");
    assert!(checked >= 60);
}

/// bf16 and f16 GEMMs (a native kernel where this CPU has one, else the f32 kernel after a
/// rounding pack) against the reference on rounded operands: small blocks, so odd k blocks
/// (a bf16 pair padded with zero) and edge tiles occur, every layout on a subset.
#[test]
fn low_precision_gemm_matches_reference_on_rounded_operands() {
    let mut rng = Rng::new(3);
    let mut checked = 0;
    for isa in runnable_isas() {
        for (lname, layout) in layouts() {
            let rt = small_block_runtime(isa, layout);
            for prec in [Precision::Bf16, Precision::F16] {
                for (m, n, k) in [
                    (1, 1, 1),
                    (7, 13, 5),
                    (33, 29, 17),
                    (67, 7, 40),
                    (40, 70, 33),
                ] {
                    for la in LAYOUTS {
                        for lc in [Layout::RowMajor, Layout::ColMajor] {
                            for (alpha, beta) in [(1.0, 0.0), (-0.75, 0.5)] {
                                GemmCase::new(
                                    prec,
                                    &mut rng,
                                    m,
                                    n,
                                    k,
                                    la,
                                    Layout::ColMajor,
                                    lc,
                                    alpha,
                                    beta,
                                )
                                .check(&rt)
                                .unwrap_or_else(|e| {
                                    panic!("isa {isa} ({:?}), {lname}: {e}", rt.kernel_at(prec))
                                });
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
    }
    eprintln!("checked {checked} low-precision GEMMs");
    assert!(checked >= 240);
}

#[test]
fn large_gemm_with_default_blocks_spans_domains() {
    // Default (cache-derived) block sizes, a simulated 2-domain layout, and shapes large
    // enough that the rows are split over domains and threads. Each problem and its reference
    // are built once for every runtime (the operand layouts' packing is covered edge by edge,
    // with tiny blocks, above; here one layout per shape).
    let mut rng = Rng::new(7);
    let cases: Vec<GemmCase> = [
        ((301, 257, 129), Layout::RowMajor),
        ((520, 64, 300), Layout::ColMajor),
    ]
    .into_iter()
    .flat_map(|((m, n, k), layout)| Precision::ALL.map(|prec| (prec, m, n, k, layout)))
    .map(|(prec, m, n, k, layout)| {
        GemmCase::new(
            prec,
            &mut rng,
            m,
            n,
            k,
            layout,
            Layout::RowMajor,
            layout,
            1.0,
            0.5,
        )
    })
    .collect();
    for isa in runnable_isas() {
        for (lname, layout) in layouts() {
            let rt = fugu_gemm::Runtime::new(fugu_gemm::RuntimeConfig {
                isa: Some(isa),
                topology: layout,
                ..Default::default()
            })
            .unwrap();
            for case in &cases {
                case.check(&rt)
                    .unwrap_or_else(|e| panic!("isa {isa}, {lname}: {e}"));
            }
        }
    }
}

#[test]
fn mismatched_shapes_are_errors_not_panics() {
    let a = vec![0.0f32; 6];
    let b = vec![0.0f32; 12];
    let mut c = vec![0.0f32; 8];
    let err = fugu_gemm::gemm(
        1.0,
        MatRef::row_major(&a, 2, 3).unwrap(),
        MatRef::row_major(&b, 4, 3).unwrap(),
        0.0,
        MatMut::row_major(&mut c, 2, 4).unwrap(),
    )
    .unwrap_err();
    assert!(matches!(err, GemmError::ShapeMismatch { .. }), "{err}");
    assert!(err.to_string().contains("A is 2x3, B is 4x3"), "{err}");
    // A view that does not fit its buffer is refused when built.
    let err = MatRef::row_major(&a, 3, 3).unwrap_err();
    assert!(matches!(err, GemmError::OutOfBounds { .. }), "{err}");
    // An output view with aliasing elements is refused.
    let err = MatMut::new(&mut c, 2, 4, 1, 1).unwrap_err();
    assert!(matches!(err, GemmError::OverlappingOutput { .. }), "{err}");
}

/// A runtime whose f16 GEMMs sum in f16 chunks (`FUGU_GEMM_F16=chunked`: the SVE kernel on
/// SVE CPUs, its portable emulation elsewhere), with `kc` large enough for one k block.
fn f16_chunked_runtime(kc: usize) -> fugu_gemm::Runtime {
    fugu_gemm::Runtime::new(fugu_gemm::RuntimeConfig {
        topology: fugu_gemm::TopologyRequest {
            layout: Some((1, 1)),
            ..Default::default()
        },
        blocking: Some(fugu_gemm::Blocking {
            mc: 64,
            kc,
            nc: 64,
            nb: 64,
        }),
        f16_chunked: Some(true),
        ..Default::default()
    })
    .unwrap()
}

/// The chunked f16 arithmetic, exactly: a row of 1 followed by 2^-12's. In f16, 1 + 2^-12 rounds
/// back to 1 (half an ulp of 1 is 2^-11), so the first chunk of `F16_CHUNK` products sums to 1
/// whatever follows; the second chunk, all 2^-12, sums exactly to F16_CHUNK·2^-12 and is added
/// in f32. An f32 accumulation would give 1 + (2·F16_CHUNK - 1)·2^-12.
#[test]
fn f16_chunks_sum_in_f16_and_fold_into_f32() {
    use fugu_gemm::kernel::{Accumulation, F16_CHUNK};
    let k = 2 * F16_CHUNK;
    let rt = f16_chunked_runtime(k);
    assert_eq!(
        rt.kernel_at(Precision::F16).accumulation,
        Accumulation::F16Chunks(F16_CHUNK),
        "{:?}",
        rt.kernel_at(Precision::F16)
    );
    let tiny = (2.0f32).powi(-12);
    let (m, n) = (37, 11); // edge tiles on every kernel
    let a: Vec<f32> = (0..m * k)
        .map(|i| if i % k == 0 { 1.0 } else { tiny })
        .collect();
    let b = vec![1.0f32; k * n];
    let mut c = vec![f32::NAN; m * n];
    rt.at(Precision::F16)
        .gemm(
            1.0,
            MatRef::row_major(&a, m, k).unwrap(),
            MatRef::row_major(&b, k, n).unwrap(),
            0.0,
            MatMut::row_major(&mut c, m, n).unwrap(),
        )
        .unwrap();
    let want = 1.0 + F16_CHUNK as f32 * tiny;
    for (i, &got) in c.iter().enumerate() {
        assert_eq!(got, want, "element {i}");
    }
}

/// Random GEMMs with f16 chunks against the f64 reference on f16-rounded operands, within the
/// bound the chunk length gives: each f16 addition of a chunk rounds with relative error
/// u = 2^-11 of a partial sum no larger than the chunk's sum of |products|, so the error is at
/// most about F16_CHUNK·u·Σ|a·b| (plus f16's subnormal step, 2^-25 per addition, and the f32
/// folds). Also checks that the f16 rounding shows: a worst relative error above 1e-5, where
/// an f32 accumulation stays near 1e-7.
#[test]
fn f16_chunked_gemm_stays_within_the_chunk_error_bound() {
    use fugu_gemm::kernel::F16_CHUNK;
    let u = (2.0f64).powi(-11);
    let mut rng = Rng::new(11);
    for (m, n, k) in [(33, 10, 200), (64, 21, 64), (5, 3, 1000), (70, 13, 7)] {
        for kc in [16, 1024] {
            let rt = f16_chunked_runtime(kc);
            let mut a = rng.vec(m * k);
            let mut b = rng.vec(k * n);
            Precision::F16.round_slice(&mut a);
            Precision::F16.round_slice(&mut b);
            let mut c = vec![0.0f32; m * n];
            rt.at(Precision::F16)
                .gemm(
                    1.0,
                    MatRef::row_major(&a, m, k).unwrap(),
                    MatRef::row_major(&b, k, n).unwrap(),
                    0.0,
                    MatMut::row_major(&mut c, m, n).unwrap(),
                )
                .unwrap();
            let mut worst: f64 = 0.0;
            for i in 0..m {
                for j in 0..n {
                    let (mut dot, mut mag) = (0.0f64, 0.0f64);
                    for p in 0..k {
                        let x = a[i * k + p] as f64 * b[p * n + j] as f64;
                        dot += x;
                        mag += x.abs();
                    }
                    let chunk = F16_CHUNK.min(kc).min(k) as f64;
                    let tol = chunk * u * mag
                        + k as f64 * (2.0f64).powi(-25)
                        + (k as f64 + 4.0) * f32::EPSILON as f64 * mag;
                    let err = (c[i * n + j] as f64 - dot).abs();
                    assert!(
                        err <= tol,
                        "{m}x{n}x{k} kc {kc}: C({i},{j}) = {} vs {dot} (error {err:e} > {tol:e})",
                        c[i * n + j]
                    );
                    worst = worst.max(err / mag.max(1e-30));
                }
            }
            // f32 accumulation would be ~1e-7 relative: the chunks must show f16's rounding.
            if k >= 64 {
                assert!(
                    worst > 1e-5,
                    "{m}x{n}x{k}: no f16 rounding visible ({worst:e})"
                );
            }
        }
    }
}

/// A and B given as `half::f16` / `half::bf16` views give the same C, bit for bit, as `f32`
/// views of the same values (the pack converts 16-bit elements exactly, so the kernels see the
/// same panels), at every precision, on every ISA and layout, for every operand layout, through
/// `gemm`, `gemm_strided_batched` and `gemm_batched`.
#[test]
fn half_views_give_the_f32_views_results() {
    use fugu_gemm::half::{bf16, f16};
    use fugu_gemm::{BatchMut, BatchRef};
    let mut rng = Rng::new(11);
    let mut checked = 0;
    for isa in runnable_isas() {
        for (lname, layout) in layouts() {
            let rt = small_block_runtime(isa, layout);
            for prec in Precision::ALL {
                for (m, n, k) in [(1, 1, 1), (7, 13, 5), (33, 29, 17), (40, 70, 33)] {
                    for la in LAYOUTS {
                        for lb in LAYOUTS {
                            let (alen, aoff, ars, acs) = geometry(la, m, k);
                            let (blen, boff, brs, bcs) = geometry(lb, k, n);
                            // A in f16, B in bf16, and their exact f32 values.
                            let ah: Vec<f16> =
                                rng.vec(alen).into_iter().map(f16::from_f32).collect();
                            let bh: Vec<bf16> =
                                rng.vec(blen).into_iter().map(bf16::from_f32).collect();
                            let af: Vec<f32> = ah.iter().map(|v| v.to_f32()).collect();
                            let bf: Vec<f32> = bh.iter().map(|v| v.to_f32()).collect();
                            let c0 = rng.vec(m * n);
                            let (mut want, mut got) = (c0.clone(), c0.clone());
                            let g = rt.at(prec);
                            g.gemm(
                                -0.75,
                                MatRef::with_offset(&af, aoff, m, k, ars, acs).unwrap(),
                                MatRef::with_offset(&bf, boff, k, n, brs, bcs).unwrap(),
                                0.5,
                                MatMut::row_major(&mut want, m, n).unwrap(),
                            )
                            .unwrap();
                            g.gemm(
                                -0.75,
                                MatRef::with_offset(&ah, aoff, m, k, ars, acs).unwrap(),
                                MatRef::with_offset(&bh, boff, k, n, brs, bcs).unwrap(),
                                0.5,
                                MatMut::row_major(&mut got, m, n).unwrap(),
                            )
                            .unwrap();
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "isa {isa}, {lname}, {prec}, {m}x{n}x{k}, {la:?}/{lb:?}"
                            );
                            checked += 1;
                        }
                    }
                }
                // Batches: three 9×11×6 problems, strided and pointer-array.
                let (m, n, k, batch) = (9, 11, 6, 3);
                let ah: Vec<f16> = rng
                    .vec(batch * m * k)
                    .into_iter()
                    .map(f16::from_f32)
                    .collect();
                let bh: Vec<f16> = rng
                    .vec(batch * k * n)
                    .into_iter()
                    .map(f16::from_f32)
                    .collect();
                let af: Vec<f32> = ah.iter().map(|v| v.to_f32()).collect();
                let bf: Vec<f32> = bh.iter().map(|v| v.to_f32()).collect();
                let (mut want, mut got) =
                    (vec![0.0f32; batch * m * n], vec![0.0f32; batch * m * n]);
                let g = rt.at(prec);
                g.gemm_strided_batched(
                    1.0,
                    BatchRef::row_major(&af, batch, m, k).unwrap(),
                    BatchRef::row_major(&bf, batch, k, n).unwrap(),
                    0.0,
                    BatchMut::row_major(&mut want, batch, m, n).unwrap(),
                )
                .unwrap();
                g.gemm_strided_batched(
                    1.0,
                    BatchRef::row_major(&ah, batch, m, k).unwrap(),
                    BatchRef::row_major(&bh, batch, k, n).unwrap(),
                    0.0,
                    BatchMut::row_major(&mut got, batch, m, n).unwrap(),
                )
                .unwrap();
                assert_eq!(got, want, "isa {isa}, {lname}, {prec}: strided batch");
                let views_h: Vec<_> = (0..batch)
                    .map(|i| {
                        (
                            MatRef::with_offset(&ah, i * m * k, m, k, k, 1).unwrap(),
                            MatRef::with_offset(&bh, i * k * n, k, n, n, 1).unwrap(),
                        )
                    })
                    .collect();
                let mut got2 = vec![0.0f32; batch * m * n];
                let mut cs: Vec<MatMut<'_, f32>> = got2
                    .chunks_mut(m * n)
                    .map(|c| MatMut::row_major(c, m, n).unwrap())
                    .collect();
                let (a_views, b_views): (Vec<_>, Vec<_>) = views_h.into_iter().unzip();
                g.gemm_batched(1.0, &a_views, &b_views, 0.0, &mut cs)
                    .unwrap();
                drop(cs);
                assert_eq!(
                    got2, want,
                    "isa {isa}, {lname}, {prec}: pointer-array batch"
                );
                checked += 2;
            }
        }
    }
    eprintln!("checked {checked} GEMMs on 16-bit views");
    assert!(checked >= 300);
}

/// The ic split hands tiles of C to whichever member asks next (a busy machine changes who runs
/// what), yet every tile is summed over the whole problem's k blocks by the same kernel: the
/// result equals the one-thread run bit for bit, call after call. Shapes with several row
/// blocks and column chunks, edge tiles, and both beta paths; `C` starts from the same values.
#[test]
fn the_ic_split_gives_the_sequential_result_bit_for_bit_whatever_the_schedule() {
    let mut rng = Rng::new(29);
    let layout = |threads| TopologyRequest {
        layout: Some((1, threads)),
        max_threads: None,
        pin: Some(false),
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut checked = 0;
    for isa in runnable_isas() {
        let one = small_block_runtime_split(isa, layout(1), Some(SplitMode::Ic));
        let team = small_block_runtime_split(isa, layout(2), Some(SplitMode::Ic));
        for &(m, n, k) in &[(67, 130, 40), (200, 37, 33), (9, 301, 70)] {
            let (a, b, c0) = (rng.vec(m * k), rng.vec(k * n), rng.vec(m * n));
            for beta in [0.0, 0.5] {
                let run = |rt: &fugu_gemm::Runtime| {
                    let mut c = c0.clone();
                    rt.gemm(
                        1.25,
                        MatRef::row_major(&a, m, k).unwrap(),
                        MatRef::row_major(&b, k, n).unwrap(),
                        beta,
                        MatMut::row_major(&mut c, m, n).unwrap(),
                    )
                    .unwrap();
                    bits(&c)
                };
                let want = run(&one);
                for call in 0..20 {
                    assert!(
                        run(&team) == want,
                        "{isa} {m}x{n}x{k} beta {beta}: call {call} differs from one thread"
                    );
                    checked += 1;
                }
            }
        }
    }
    eprintln!("checked {checked} two-thread GEMMs bit for bit");
    assert!(checked >= 120);
}

/// One element type D may be stored in, for [`gemm_into_is_the_f32_gemm_rounded_once`]: the
/// value of an `f32` in it (rounded to nearest even by fugu-gemm's bit converters) and its
/// bits.
trait IntoType: fugu_gemm::Element + std::fmt::Debug {
    const NAME: &'static str;
    fn of(x: f32) -> Self;
    fn value(self) -> f32;
    fn bits(self) -> u32;
}

impl IntoType for f32 {
    const NAME: &'static str = "f32";
    fn of(x: f32) -> f32 {
        x
    }
    fn value(self) -> f32 {
        self
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}

impl IntoType for fugu_gemm::half::bf16 {
    const NAME: &'static str = "bf16";
    fn of(x: f32) -> Self {
        Self::from_bits(fugu_gemm::precision::f32_to_bf16(x))
    }
    fn value(self) -> f32 {
        self.to_f32()
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

impl IntoType for fugu_gemm::half::f16 {
    const NAME: &'static str = "f16";
    fn of(x: f32) -> Self {
        Self::from_bits(fugu_gemm::precision::f32_to_f16(x))
    }
    fn value(self) -> f32 {
        self.to_f32()
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

/// What a D starts from in one case: (beta and C, the bias).
type StartCase = (Option<f32>, bool);

/// The starts every case cycles through: none; C; C scaled; the bias; C and the bias; and C
/// with beta 0 (not read: it holds NaNs).
const STARTS: [StartCase; 6] = [
    (None, false),
    (Some(1.0), false),
    (Some(-0.5), false),
    (None, true),
    (Some(1.0), true),
    (Some(0.0), true),
];

/// Runs `gemm_into` on one case with D of type `T` in `layout` (padded: the padding must stay
/// as it was) and compares every element, bit for bit, with `gemm` on an `f32` C of the same
/// layout set to the start (`beta·C`, then `+ bias`), rounded once to `T`.
#[allow(clippy::too_many_arguments)]
fn check_into<T: IntoType>(
    g: fugu_gemm::PrecisionGemm<'_>,
    rng: &mut Rng,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (beta, with_bias): StartCase,
    layout: Layout,
    what: &str,
) {
    use fugu_gemm::Start;
    let (a, b) = (rng.vec(m * k), rng.vec(k * n));
    // C of large values too, so that an f16 D overflows to infinity somewhere.
    let c: Vec<T> = (0..m * n)
        .map(|i| match beta {
            Some(0.0) => T::of(f32::NAN),
            _ if i % 17 == 3 => T::of(7.0e4),
            _ => T::of(rng.f32() * 4.0),
        })
        .collect();
    let bias: Vec<T> = (0..n).map(|_| T::of(rng.f32())).collect();
    let (len, off, rs, cs) = geometry(layout, m, n);
    let pad = T::of(-3.25);
    // The f32 C: the start, computed as adding onto an f32 C does.
    let mut want = vec![0.0f32; len];
    for i in 0..m {
        for j in 0..n {
            let mut s = match beta {
                Some(beta) if beta != 0.0 => beta * c[i * n + j].value(),
                _ => 0.0,
            };
            if with_bias {
                s = match beta {
                    Some(beta) if beta != 0.0 => s + bias[j].value(),
                    _ => bias[j].value(),
                };
            }
            want[off + i * rs + j * cs] = s;
        }
    }
    let has_start = matches!(beta, Some(b) if b != 0.0) || with_bias;
    let (av, bv) = (
        MatRef::row_major(&a, m, k).unwrap(),
        MatRef::row_major(&b, k, n).unwrap(),
    );
    let cview = MatMut::with_offset(&mut want, off, m, n, rs, cs).unwrap();
    g.gemm(alpha, av, bv, if has_start { 1.0 } else { 0.0 }, cview)
        .unwrap();
    let mut got = vec![pad; len];
    let start = Start {
        beta: beta.unwrap_or(0.0),
        c: beta.map(|_| MatRef::row_major(&c, m, n).unwrap()),
        bias: with_bias.then_some(&bias[..]),
    };
    let dview = MatMut::with_offset(&mut got, off, m, n, rs, cs).unwrap();
    g.gemm_into(alpha, av, bv, start, dview).unwrap();
    let inside = |e: usize| (0..m).any(|i| (0..n).any(|j| off + i * rs + j * cs == e));
    for e in 0..len {
        let expected = if inside(e) { T::of(want[e]) } else { pad };
        assert!(
            got[e].bits() == expected.bits(),
            "{what}, D {} {layout:?}, {m}x{n}x{k}, alpha {alpha}, start {:?}: element {e} is \
             {:?}, want {:?}",
            T::NAME,
            (beta, with_bias),
            got[e],
            expected
        );
    }
}

/// `gemm_into` writes D once from the thread's own `f32` tiles, yet every element is the `f32`
/// GEMM's (on a C set to the start) rounded once to D's type, bit for bit: on every ISA and
/// thread layout, both splits, every precision, D in f32, bf16 and f16, row- and column-major
/// with padding left untouched, every kind of start, and shapes with edge tiles, several row
/// blocks and column chunks, one element, and `k = 0` (D is the start alone).
#[test]
fn gemm_into_is_the_f32_gemm_rounded_once() {
    use fugu_gemm::half::{bf16, f16};
    let mut rng = Rng::new(31);
    let mut checked = 0;
    let mut case = 0usize;
    for isa in runnable_isas() {
        for (lname, layout) in layouts() {
            for split in [SplitMode::Ic, SplitMode::Jr] {
                let rt = small_block_runtime_split(isa, layout.clone(), Some(split));
                for prec in Precision::ALL {
                    let g = rt.at(prec);
                    for shape in [
                        (67, 130, 40),
                        (200, 37, 33),
                        (9, 301, 70),
                        (1, 1, 1),
                        (5, 6, 0),
                    ] {
                        case += 1;
                        let alpha = if case.is_multiple_of(2) { 1.0 } else { -1.25 };
                        let start = STARTS[case % STARTS.len()];
                        // Each start with both layouts of D (a row-major D repeats the bias along the
                        // kernel's columns, a column-major one along its rows).
                        let d_layout = LAYOUTS[(case / STARTS.len()) % 2];
                        let what = format!("{isa}, {lname}, {split:?}, {prec}");
                        check_into::<f32>(g, &mut rng, shape, alpha, start, d_layout, &what);
                        check_into::<bf16>(g, &mut rng, shape, alpha, start, d_layout, &what);
                        check_into::<f16>(g, &mut rng, shape, alpha, start, d_layout, &what);
                        checked += 3;
                    }
                }
            }
        }
    }
    eprintln!("checked {checked} gemm_into calls bit for bit");
    assert!(checked >= 360);
}

#[test]
fn gemm_into_names_a_mismatched_start() {
    use fugu_gemm::Start;
    let rt = small_block_runtime(runnable_isas()[0], layouts()[0].1.clone());
    let g = rt.at(Precision::F32);
    let (a, b, c) = (vec![1.0f32; 6], vec![1.0f32; 12], vec![0.0f32; 6]);
    let mut d = vec![0.0f32; 8];
    let (av, bv) = (
        MatRef::row_major(&a, 2, 3).unwrap(),
        MatRef::row_major(&b, 3, 4).unwrap(),
    );
    let start = Start {
        beta: 1.0,
        c: Some(MatRef::row_major(&c, 2, 3).unwrap()),
        bias: None,
    };
    let e = g
        .gemm_into(1.0, av, bv, start, MatMut::row_major(&mut d, 2, 4).unwrap())
        .unwrap_err();
    assert!(e.to_string().contains("C is 2x3, D is 2x4"), "{e}");
    let bias = [0.0f32; 3];
    let start = Start {
        bias: Some(&bias[..]),
        ..Start::zero()
    };
    let e = g
        .gemm_into(1.0, av, bv, start, MatMut::row_major(&mut d, 2, 4).unwrap())
        .unwrap_err();
    assert!(
        e.to_string().contains("bias has 3 values, D has 4 columns"),
        "{e}"
    );
    assert!(d.iter().all(|&x| x == 0.0), "D untouched on an error");
}

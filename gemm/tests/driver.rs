//! The full GEMM (driver + every runnable kernel) against the f64 reference, over awkward
//! shapes, every transpose/stride combination, several beta values, and 1-thread, 2-thread and
//! simulated multi-domain layouts.

mod common;
use common::*;
use fugu_gemm::{GemmError, MatMut, MatRef, Precision};

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
                                        if let Err(e) = check_gemm(
                                            &rt, &mut rng, m, n, k, la, lb, lc, alpha, beta,
                                        ) {
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
                                check_gemm_at(
                                    &rt,
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
    // enough that the rows are split over domains and threads.
    let mut rng = Rng::new(7);
    for isa in runnable_isas() {
        for (lname, layout) in layouts() {
            let rt = fugu_gemm::Runtime::new(fugu_gemm::RuntimeConfig {
                isa: Some(isa),
                topology: layout,
                ..Default::default()
            })
            .unwrap();
            for (m, n, k) in [(301, 257, 129), (520, 64, 300)] {
                for (la, lc) in [
                    (Layout::RowMajor, Layout::RowMajor),
                    (Layout::ColMajor, Layout::ColMajor),
                ] {
                    for prec in Precision::ALL {
                        check_gemm_at(
                            &rt,
                            prec,
                            &mut rng,
                            m,
                            n,
                            k,
                            la,
                            Layout::RowMajor,
                            lc,
                            1.0,
                            0.5,
                        )
                        .unwrap_or_else(|e| panic!("isa {isa}, {lname}: {e}"));
                    }
                }
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

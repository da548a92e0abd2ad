//! Strided-batched and pointer-array batched GEMM against the f64 reference, on every runnable
//! kernel and thread layout, with batch 1 and many, transposed operands, broadcast (stride 0)
//! inputs, mixed problem sizes, and NaN-filled outputs when beta = 0.

mod common;
use common::*;
use fugu_gemm::reference::gemm_ref;
use fugu_gemm::{BatchMut, BatchRef, GemmError, MatMut, MatRef, Runtime, RuntimeConfig};

fn runtimes() -> Vec<(String, Runtime)> {
    let mut v = Vec::new();
    for isa in runnable_isas() {
        for (name, layout) in layouts() {
            v.push((format!("{isa}, {name}"), small_block_runtime(isa, layout)));
        }
        // Default block sizes too, so the batch scheduler sees realistic blocking.
        v.push((
            format!("{isa}, default blocks, 2 domains x 1"),
            Runtime::new(RuntimeConfig {
                isa: Some(isa),
                topology: fugu_gemm::TopologyRequest {
                    layout: Some((2, 1)),
                    ..Default::default()
                },
                ..Default::default()
            })
            .unwrap(),
        ));
    }
    v
}

fn assert_close(got: &[f32], want: &[f32], k: usize, what: &str) {
    let tol = tolerance(k);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite() && (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}: element {i} is {g}, want {w}"
        );
    }
}

#[test]
fn strided_batched_matches_reference() {
    let mut rng = Rng::new(11);
    for (name, rt) in runtimes() {
        for &(batch, m, n, k) in &[
            (1, 13, 7, 5),
            (5, 33, 17, 9),
            (48, 16, 16, 8),
            (3, 1, 40, 2),
            (4, 0, 3, 2),
            (2, 5, 4, 0),
        ] {
            for (ta, tb) in [(false, false), (false, true), (true, false)] {
                for beta in [0.0f32, 0.5] {
                    // A: batch of m×k (stored k×m when ta), padded batch stride.
                    let (ars, acs) = if ta { (1, m) } else { (k, 1) };
                    let (brs, bcs) = if tb { (1, k) } else { (n, 1) };
                    let (sa, sb, sc) = (m * k + 3, k * n + 1, m * n + 2);
                    let a = rng.vec(batch * sa + 1);
                    let b = rng.vec(batch * sb + 1);
                    let mut c = rng.vec(batch * sc + 1);
                    if beta == 0.0 {
                        c.iter_mut().for_each(|x| *x = f32::NAN);
                    }
                    let mut want = c.clone();
                    for i in 0..batch {
                        gemm_ref(
                            1.25,
                            MatRef::with_offset(&a, i * sa, m, k, ars, acs).unwrap(),
                            MatRef::with_offset(&b, i * sb, k, n, brs, bcs).unwrap(),
                            beta,
                            MatMut::with_offset(&mut want, i * sc, m, n, n, 1).unwrap(),
                        );
                    }
                    rt.gemm_strided_batched(
                        1.25,
                        BatchRef::new(&a, batch, m, k, ars, acs, sa).unwrap(),
                        BatchRef::new(&b, batch, k, n, brs, bcs, sb).unwrap(),
                        beta,
                        BatchMut::new(&mut c, batch, m, n, n, 1, sc).unwrap(),
                    )
                    .unwrap();
                    // Compare the matrices only; the padding between them must be untouched.
                    for i in 0..batch {
                        let r = i * sc..i * sc + m * n;
                        assert_close(&c[r.clone()], &want[r], k, &format!("{name}: batch {batch} {m}x{n}x{k} ta={ta} tb={tb} beta={beta} matrix {i}"));
                        if beta != 0.0 {
                            assert_eq!(
                                c[i * sc + m * n..(i + 1) * sc],
                                want[i * sc + m * n..(i + 1) * sc],
                                "{name}: padding changed"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn broadcast_operand_with_zero_batch_stride() {
    // One B shared by every problem (batch stride 0), as in a batched X·W.
    let mut rng = Rng::new(5);
    let (batch, m, n, k) = (6, 20, 11, 7);
    let a = rng.vec(batch * m * k);
    let b = rng.vec(k * n);
    for (name, rt) in runtimes() {
        let mut c = vec![f32::NAN; batch * m * n];
        let mut want = vec![0.0; batch * m * n];
        for i in 0..batch {
            gemm_ref(
                1.0,
                MatRef::with_offset(&a, i * m * k, m, k, k, 1).unwrap(),
                MatRef::row_major(&b, k, n).unwrap(),
                0.0,
                MatMut::with_offset(&mut want, i * m * n, m, n, n, 1).unwrap(),
            );
        }
        rt.gemm_strided_batched(
            1.0,
            BatchRef::row_major(&a, batch, m, k).unwrap(),
            BatchRef::new(&b, batch, k, n, n, 1, 0).unwrap(),
            0.0,
            BatchMut::row_major(&mut c, batch, m, n).unwrap(),
        )
        .unwrap();
        assert_close(&c, &want, k, &name);
    }
}

#[test]
fn pointer_array_batch_with_mixed_shapes() {
    let mut rng = Rng::new(9);
    let shapes = [
        (1usize, 1usize, 1usize),
        (70, 3, 9),
        (5, 64, 33),
        (0, 4, 4),
        (31, 29, 0),
        (40, 40, 40),
        (2, 97, 13),
    ];
    for (name, rt) in runtimes() {
        let a: Vec<Vec<f32>> = shapes.iter().map(|&(m, _, k)| rng.vec(m * k)).collect();
        let b: Vec<Vec<f32>> = shapes.iter().map(|&(_, n, k)| rng.vec(k * n)).collect();
        let mut c: Vec<Vec<f32>> = shapes
            .iter()
            .map(|&(m, n, _)| vec![f32::NAN; m * n])
            .collect();
        let mut want: Vec<Vec<f32>> = shapes.iter().map(|&(m, n, _)| vec![0.0; m * n]).collect();
        for (i, &(m, n, k)) in shapes.iter().enumerate() {
            gemm_ref(
                -1.0,
                MatRef::row_major(&a[i], m, k).unwrap(),
                MatRef::col_major(&b[i], k, n).unwrap(),
                0.0,
                MatMut::row_major(&mut want[i], m, n).unwrap(),
            );
        }
        let av: Vec<MatRef<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(m, _, k))| MatRef::row_major(&a[i], m, k).unwrap())
            .collect();
        let bv: Vec<MatRef<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(_, n, k))| MatRef::col_major(&b[i], k, n).unwrap())
            .collect();
        let mut cv: Vec<MatMut<f32>> = c
            .iter_mut()
            .zip(&shapes)
            .map(|(ci, &(m, n, _))| MatMut::row_major(ci, m, n).unwrap())
            .collect();
        rt.gemm_batched(-1.0, &av, &bv, 0.0, &mut cv).unwrap();
        drop(cv);
        for (i, &(_, _, k)) in shapes.iter().enumerate() {
            assert_close(&c[i], &want[i], k, &format!("{name}: problem {i}"));
        }
    }
}

#[test]
fn batch_errors_name_the_problem() {
    let a = vec![0.0f32; 8];
    let b = vec![0.0f32; 8];
    let mut c = vec![0.0f32; 8];
    let rt = Runtime::new(RuntimeConfig::default()).unwrap();
    let err = rt
        .gemm_strided_batched(
            1.0,
            BatchRef::row_major(&a, 2, 2, 2).unwrap(),
            BatchRef::row_major(&b, 1, 2, 2).unwrap(),
            0.0,
            BatchMut::row_major(&mut c, 2, 2, 2).unwrap(),
        )
        .unwrap_err();
    assert!(matches!(err, GemmError::BatchMismatch { .. }), "{err}");
    // Overlapping output batches are refused when the view is built.
    let err = BatchMut::new(&mut c, 2, 2, 2, 2, 1, 2).unwrap_err();
    assert!(matches!(err, GemmError::OverlappingOutput { .. }), "{err}");
    // Pointer-array: the error names the problem index.
    let mut c2 = vec![0.0f32; 4];
    let mut cs = vec![MatMut::row_major(&mut c2, 2, 2).unwrap()];
    let err = rt
        .gemm_batched(
            1.0,
            &[MatRef::row_major(&a, 2, 3).unwrap()],
            &[MatRef::row_major(&b, 2, 2).unwrap()],
            0.0,
            &mut cs,
        )
        .unwrap_err();
    assert!(err.to_string().contains("problem 0"), "{err}");
}

/// `gemm_into_strided_batched` writes each D once, rounded from the `f32` sums: bit for bit the
/// strided batched `gemm` (beta 0) rounded to D's type, matrix by matrix, with the padding
/// between the matrices untouched; on every runnable kernel and thread layout (the batch
/// scheduler's whole problems per thread and its all-threads-per-problem path), at every
/// precision, with transposed operands.
#[test]
fn strided_batched_into_16_bits_is_the_f32_batch_rounded() {
    use fugu_gemm::half::{bf16, f16};
    use fugu_gemm::precision::{f32_to_bf16, f32_to_f16};
    use fugu_gemm::Precision;
    let mut rng = Rng::new(19);
    let mut checked = 0;
    for (name, rt) in runtimes() {
        for prec in Precision::ALL {
            let g = rt.at(prec);
            for &(batch, m, n, k) in &[(5, 33, 17, 9), (48, 16, 16, 8), (2, 70, 130, 40)] {
                for (ta, tb) in [(false, false), (true, false), (false, true)] {
                    let (ars, acs) = if ta { (1, m) } else { (k, 1) };
                    let (brs, bcs) = if tb { (1, k) } else { (n, 1) };
                    let (sa, sb, sc) = (m * k + 3, k * n + 1, m * n + 2);
                    let (a, b) = (rng.vec(batch * sa + 1), rng.vec(batch * sb + 1));
                    let av = BatchRef::new(&a, batch, m, k, ars, acs, sa).unwrap();
                    let bv = BatchRef::new(&b, batch, k, n, brs, bcs, sb).unwrap();
                    let mut want = vec![0.0f32; batch * sc + 1];
                    g.gemm_strided_batched(
                        -0.75,
                        av,
                        bv,
                        0.0,
                        BatchMut::new(&mut want, batch, m, n, n, 1, sc).unwrap(),
                    )
                    .unwrap();
                    let pad = 0x7e01u16;
                    let inside = |e: usize| e % sc < m * n && e < batch * sc;
                    let mut hb = vec![bf16::from_bits(pad); want.len()];
                    g.gemm_into_strided_batched(
                        -0.75,
                        av,
                        bv,
                        BatchMut::new(&mut hb, batch, m, n, n, 1, sc).unwrap(),
                    )
                    .unwrap();
                    let mut hf = vec![f16::from_bits(pad); want.len()];
                    g.gemm_into_strided_batched(
                        -0.75,
                        av,
                        bv,
                        BatchMut::new(&mut hf, batch, m, n, n, 1, sc).unwrap(),
                    )
                    .unwrap();
                    for e in 0..want.len() {
                        let (wb, wf) = match inside(e) {
                            true => (f32_to_bf16(want[e]), f32_to_f16(want[e])),
                            false => (pad, pad),
                        };
                        let what = format!("{name}, {prec}, batch {batch} {m}x{n}x{k} ta={ta} tb={tb}: element {e}");
                        assert_eq!(hb[e].to_bits(), wb, "{what} (bf16)");
                        assert_eq!(hf[e].to_bits(), wf, "{what} (f16)");
                    }
                    checked += 2;
                }
            }
        }
    }
    eprintln!("checked {checked} batched GEMMs into 16 bits");
    assert!(checked >= 100);
}

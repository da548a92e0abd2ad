//! A naive reference GEMM with f64 accumulation, used by the tests and benchmarks to check
//! results. It is deliberately simple and slow.

use crate::view::{MatMut, MatRef};

/// `C := alpha·A·B + beta·C` with every dot product accumulated in f64. When `beta == 0`,
/// C is not read. Shapes must already agree (panics otherwise: test helper only).
pub fn gemm_ref(
    alpha: f32,
    a: MatRef<'_, f32>,
    b: MatRef<'_, f32>,
    beta: f32,
    mut c: MatMut<'_, f32>,
) {
    assert!(a.rows() == c.rows() && b.cols() == c.cols() && a.cols() == b.rows());
    for i in 0..c.rows() {
        for j in 0..c.cols() {
            let mut acc = 0.0f64;
            for p in 0..a.cols() {
                acc += *a.get(i, p).unwrap() as f64 * *b.get(p, j).unwrap() as f64;
            }
            let old = if beta == 0.0 {
                0.0
            } else {
                beta as f64 * c.get(i, j).unwrap() as f64
            };
            *c.get_mut(i, j).unwrap() = (alpha as f64 * acc + old) as f32;
        }
    }
}

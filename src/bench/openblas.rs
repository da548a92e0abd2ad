//! Optional side-by-side column: the system OpenBLAS (`--features openblas`, needs
//! Debian's libopenblas-dev). Only `cblas_sgemm` and the thread-count setter are used.

use std::os::raw::c_int;

#[link(name = "openblas")]
extern "C" {
    fn cblas_sgemm(
        layout: c_int,
        transa: c_int,
        transb: c_int,
        m: c_int,
        n: c_int,
        k: c_int,
        alpha: f32,
        a: *const f32,
        lda: c_int,
        b: *const f32,
        ldb: c_int,
        beta: f32,
        c: *mut f32,
        ldc: c_int,
    );
    fn openblas_set_num_threads(n: c_int);
}

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

/// Sets OpenBLAS's thread count.
pub fn set_threads(n: usize) {
    // SAFETY: plain FFI call with a positive count.
    unsafe { openblas_set_num_threads(n.max(1) as c_int) }
}

/// Row-major `C = A·B` (A m×k, or k×m when `ta`; B k×n, or n×k when `tb`), dense operands.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    ta: bool,
    tb: bool,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let lda = if ta { m } else { k };
    let ldb = if tb { k } else { n };
    // SAFETY: the asserts above guarantee the dense operands hold the elements cblas reads
    // and writes for these dimensions and leading dimensions.
    unsafe {
        cblas_sgemm(
            ROW_MAJOR,
            if ta { TRANS } else { NO_TRANS },
            if tb { TRANS } else { NO_TRANS },
            m as c_int,
            n as c_int,
            k as c_int,
            1.0,
            a.as_ptr(),
            lda.max(1) as c_int,
            b.as_ptr(),
            ldb.max(1) as c_int,
            0.0,
            c.as_mut_ptr(),
            n.max(1) as c_int,
        )
    }
}

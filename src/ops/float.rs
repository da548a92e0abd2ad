//! The float type the ops are generic over, and the GEMM hooks behind it.
//!
//! Every op is written once over `T: Float`. Production runs in `f32`, whose GEMMs go to
//! fugu-gemm; the finite-difference tests run in `f64`, whose GEMMs are a plain triple loop
//! (slow, exact enough, only ever used on tiny shapes).
//!
//! GEMM operands are described by small plain views ([`Mat`], [`MatMutT`], [`BatchMat`],
//! [`BatchMatMut`]): a slice plus `(offset, rows, cols, row stride, col stride)`, element
//! `(i, j)` at `offset + i*rs + j*cs`, and for batches matrix `p` starting `p*bs` further on.
//! `.t()` transposes a view for free. They are deliberately dumb: fugu-gemm checks bounds and
//! output aliasing when the `f32` path builds its own views, and the `f64` loop bounds-checks
//! every access. A failed check is a bug in an op (the ops assert their slice lengths first), so
//! it panics with fugu-gemm's error message.

pub use fugu_gemm::Precision;
use std::fmt::Debug;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

/// A read-only strided matrix view: element `(i, j)` is `data[offset + i*rs + j*cs]`.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a, T> {
    pub data: &'a [T],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    /// Row stride (elements between `(i, j)` and `(i+1, j)`).
    pub rs: usize,
    /// Column stride (elements between `(i, j)` and `(i, j+1)`).
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A `rows × cols` view starting at `offset` with strides `(rs, cs)`.
    pub fn new(
        data: &'a [T],
        offset: usize,
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Self {
        Mat {
            data,
            offset,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// A dense row-major `rows × cols` view of `data` from element 0.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Self {
        Mat::new(data, 0, rows, cols, cols, 1)
    }

    /// The transpose (swaps dimensions and strides).
    pub fn t(self) -> Self {
        Mat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// A writable strided matrix view (same indexing as [`Mat`]). Its elements must not alias one
/// another (fugu-gemm checks this on the `f32` path).
#[derive(Debug)]
pub struct MatMutT<'a, T> {
    pub data: &'a mut [T],
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> MatMutT<'a, T> {
    /// A writable `rows × cols` view starting at `offset` with strides `(rs, cs)`.
    pub fn new(
        data: &'a mut [T],
        offset: usize,
        rows: usize,
        cols: usize,
        rs: usize,
        cs: usize,
    ) -> Self {
        MatMutT {
            data,
            offset,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// A dense row-major `rows × cols` view of `data` from element 0.
    pub fn row_major(data: &'a mut [T], rows: usize, cols: usize) -> Self {
        MatMutT::new(data, 0, rows, cols, cols, 1)
    }

    /// The transpose.
    pub fn t(self) -> Self {
        MatMutT {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// A read-only strided batch: matrix `p` (for `p < batch`) is the [`Mat`] starting at
/// `offset + p*bs`.
#[derive(Clone, Copy, Debug)]
pub struct BatchMat<'a, T> {
    pub data: &'a [T],
    pub offset: usize,
    pub batch: usize,
    /// Batch stride: elements between matrix `p` and matrix `p+1`.
    pub bs: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> BatchMat<'a, T> {
    /// Transposes every matrix of the batch.
    pub fn t(self) -> Self {
        BatchMat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Matrix `p` of the batch.
    pub fn matrix(&self, p: usize) -> Mat<'a, T> {
        Mat::new(
            self.data,
            self.offset + p * self.bs,
            self.rows,
            self.cols,
            self.rs,
            self.cs,
        )
    }
}

/// A writable strided batch (indexing as [`BatchMat`]); no two elements of any two matrices may
/// alias.
#[derive(Debug)]
pub struct BatchMatMut<'a, T> {
    pub data: &'a mut [T],
    pub offset: usize,
    pub batch: usize,
    pub bs: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> BatchMatMut<'a, T> {
    /// Transposes every matrix of the batch.
    pub fn t(self) -> Self {
        BatchMatMut {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }
}

/// The scalar type of the ops: `f32` (production, GEMMs on fugu-gemm) or `f64` (tests).
pub trait Float:
    Copy
    + Send
    + Sync
    + Default
    + PartialOrd
    + Debug
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;

    /// Rounds an `f64` to this type.
    fn from_f64(x: f64) -> Self;
    /// Widens (exactly) to `f64`.
    fn to_f64(self) -> f64;
    /// Converts a count (rounding above 2^24 for `f32`).
    fn from_usize(x: usize) -> Self;
    fn exp(self) -> Self;
    /// `Σ exp(x − max)` over a row, accumulated in f64 (deterministic for a given row).
    fn sum_exp_row(row: &[Self], max: Self) -> f64 {
        const LANES: usize = 8;
        let mut total = 0.0f64;
        for block in row.chunks(512) {
            let mut acc = [Self::ZERO; LANES];
            let mut it = block.chunks_exact(LANES);
            for c in &mut it {
                for l in 0..LANES {
                    acc[l] += (c[l] - max).exp();
                }
            }
            for (l, &x) in it.remainder().iter().enumerate() {
                acc[l] += (x - max).exp();
            }
            total += acc.iter().map(|a| a.to_f64()).sum::<f64>();
        }
        total
    }
    /// `row[j] = scale · exp(row[j] − max)` in place.
    fn exp_scale_row(row: &mut [Self], max: Self, scale: Self) {
        for x in row.iter_mut() {
            *x = scale * (*x - max).exp();
        }
    }
    /// `row[j] = exp(row[j] − max)` in place, returning [`Float::sum_exp_row`]'s sum of them:
    /// a softmax's one exponential per element (then [`Float::scale_row`]). By default the two
    /// row kernels (two exponentials; f64, the tests' type); f32 has a one-pass kernel.
    fn exp_sum_row(row: &mut [Self], max: Self) -> f64 {
        let sum = Self::sum_exp_row(row, max);
        Self::exp_scale_row(row, max, Self::ONE);
        sum
    }
    /// `row[j] *= scale` in place.
    fn scale_row(row: &mut [Self], scale: Self) {
        for x in row.iter_mut() {
            *x *= scale;
        }
    }
    /// The row's largest element (−inf for an empty row; NaNs ignored, as [`Float::max`]).
    fn row_max(row: &[Self]) -> Self {
        super::crossentropy::row_max(row)
    }
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
    fn sqrt(self) -> Self;
    fn abs(self) -> Self;
    /// The larger of the two; a NaN operand is ignored (IEEE `maxNum`, like `f32::max`).
    fn max(self, other: Self) -> Self;
    fn is_finite(self) -> bool;

    /// One row of layer normalisation ([`super::layernorm::layernorm_forward`]'s loop): writes
    /// `out`, returns `(mean, rstd)`.
    fn layernorm_row(out: &mut [Self], x: &[Self], w: &[Self], bias: &[Self]) -> (Self, Self) {
        super::layernorm::layernorm_row(out, x, w, bias)
    }

    /// One row of the layer-norm input gradient ([`super::layernorm::layernorm_backward`]).
    fn layernorm_backward_row(
        dinp: &mut [Self],
        dout: &[Self],
        x: &[Self],
        w: &[Self],
        mu: Self,
        rs: Self,
    ) {
        super::layernorm::layernorm_backward_row(dinp, dout, x, w, mu, rs)
    }

    /// One row of the attention softmax backward, in place: `d = a·(d − Σ d·a)`
    /// ([`super::attention::attention_softmax_backward`]'s loop).
    fn softmax_backward_row(d: &mut [Self], a: &[Self]) {
        super::attention::softmax_backward_row(d, a)
    }

    /// `out = gelu(inp)` over one chunk ([`super::gelu::gelu_forward`]'s loop).
    fn gelu_rows(out: &mut [Self], inp: &[Self]) {
        super::gelu::gelu_rows(out, inp)
    }

    /// `dinp = dout · gelu'(inp)` over one chunk ([`super::gelu::gelu_backward`]'s loop).
    fn gelu_backward_rows(dinp: &mut [Self], inp: &[Self], dout: &[Self]) {
        super::gelu::gelu_backward_rows(dinp, inp, dout)
    }

    /// `out = silu(gate) · up` over one row ([`super::swiglu::swiglu_forward`]'s loop).
    fn swiglu_row(out: &mut [Self], gate: &[Self], up: &[Self]) {
        super::swiglu::swiglu_row(out, gate, up)
    }

    /// One row of [`super::swiglu::swiglu_backward`].
    fn swiglu_backward_row(
        d: (&mut [Self], &mut [Self]),
        dout: &[Self],
        gate: &[Self],
        up: &[Self],
    ) {
        super::swiglu::swiglu_backward_row(d, dout, gate, up)
    }

    /// `C := alpha·A·B + beta·C` with A m×k, B k×n, C m×n. When `beta == 0`, C is not read
    /// (NaN or garbage in C does not propagate). `prec` is the arithmetic of the products
    /// (fugu-gemm's [`Precision`]: operands rounded to it, f32 accumulation); the f64 reference
    /// multiplies the operands as given, which is the same when they already hold values of
    /// that type (as a low-precision backend buffer does).
    ///
    /// # Panics
    /// On mismatched shapes or views that do not fit their slices (a bug in the caller).
    fn gemm(
        prec: Precision,
        alpha: Self,
        a: Mat<'_, Self>,
        b: Mat<'_, Self>,
        beta: Self,
        c: MatMutT<'_, Self>,
    );
}

fn check_shapes(am: usize, ak: usize, bk: usize, bn: usize, cm: usize, cn: usize) {
    assert!(
        am == cm && bn == cn && ak == bk,
        "ops gemm: shape mismatch: A is {am}x{ak}, B is {bk}x{bn}, C is {cm}x{cn}"
    );
}

/// The `f64` reference GEMM: one dot product per element of C, summed in `k` order.
#[allow(clippy::too_many_arguments)]
fn gemm_naive<T: Float>(
    alpha: T,
    a: &Mat<'_, T>,
    b: &Mat<'_, T>,
    beta: T,
    c: &mut [T],
    c_off: usize,
    c_rs: usize,
    c_cs: usize,
) {
    for i in 0..a.rows {
        for j in 0..b.cols {
            let mut s = T::ZERO;
            for p in 0..a.cols {
                s +=
                    a.data[a.offset + i * a.rs + p * a.cs] * b.data[b.offset + p * b.rs + j * b.cs];
            }
            let ci = &mut c[c_off + i * c_rs + j * c_cs];
            *ci = if beta == T::ZERO {
                alpha * s
            } else {
                alpha * s + beta * *ci
            };
        }
    }
}

/// The part of `data` from `offset` on (empty when `offset` is past the end, which only an
/// empty view may have).
fn tail<T>(data: &[T], offset: usize) -> &[T] {
    data.get(offset..).unwrap_or(&[])
}

fn tail_mut<T>(data: &mut [T], offset: usize) -> &mut [T] {
    let len = data.len();
    &mut data[offset.min(len)..]
}

/// `c = alpha·a·b + beta·c` in f32 on operands as they are stored (`f32`, or 16-bit values as
/// `half::bf16`/`half::f16`, which fugu-gemm packs without converting them first): the f32
/// GEMM of [`Float::gemm`], and the CPU backend's on 16-bit buffers.
pub fn gemm_stored<A: fugu_gemm::Element, B: fugu_gemm::Element>(
    prec: Precision,
    alpha: f32,
    a: Mat<'_, A>,
    b: Mat<'_, B>,
    beta: f32,
    c: MatMutT<'_, f32>,
) {
    let (av, bv, cv) = (mat_ref(a), mat_ref(b), mat_mut(c));
    fugu_gemm::Runtime::global()
        .and_then(|rt| rt.at(prec).gemm(alpha, av, bv, beta, cv))
        .unwrap_or_else(|e| gemm_failed(e));
}

/// `d = alpha·a·b + beta·c + bias` through fugu-gemm's `gemm_into`: D of any stored type,
/// written once from f32 sums (each tile's start, then the product), rounded once; the values
/// of [`gemm_stored`] on an f32 `d` set to the start (`beta·c`, then `+ bias`), rounded.
#[allow(clippy::too_many_arguments)]
pub fn gemm_into_stored<'c, A: fugu_gemm::Element, B: fugu_gemm::Element, D: fugu_gemm::Element>(
    prec: Precision,
    alpha: f32,
    a: Mat<'_, A>,
    b: Mat<'_, B>,
    beta: f32,
    c: Option<Mat<'c, D>>,
    bias: Option<&'c [D]>,
    d: MatMutT<'_, D>,
) {
    let (av, bv, dv) = (mat_ref(a), mat_ref(b), mat_mut(d));
    let start = fugu_gemm::Start {
        beta,
        c: c.map(mat_ref),
        bias,
    };
    fugu_gemm::Runtime::global()
        .and_then(|rt| rt.at(prec).gemm_into(alpha, av, bv, start, dv))
        .unwrap_or_else(|e| gemm_failed(e));
}

/// fugu-gemm's view of a read-only matrix.
fn mat_ref<T>(m: Mat<'_, T>) -> fugu_gemm::MatRef<'_, T> {
    fugu_gemm::MatRef::with_offset(m.data, m.offset, m.rows, m.cols, m.rs, m.cs)
        .unwrap_or_else(|e| gemm_failed(e))
}

/// fugu-gemm's view of a writable matrix.
fn mat_mut<T>(m: MatMutT<'_, T>) -> fugu_gemm::MatMut<'_, T> {
    fugu_gemm::MatMut::with_offset(m.data, m.offset, m.rows, m.cols, m.rs, m.cs)
        .unwrap_or_else(|e| gemm_failed(e))
}

fn gemm_failed(e: fugu_gemm::GemmError) -> ! {
    panic!("ops gemm (internal misuse): {e}")
}

/// The `Float` methods that only forward to the primitive type's own.
macro_rules! primitive_float_methods {
    ($t:ident) => {
        const ZERO: Self = 0.0;
        const ONE: Self = 1.0;
        const NEG_INFINITY: Self = $t::NEG_INFINITY;

        #[inline(always)]
        fn from_f64(x: f64) -> Self {
            x as $t
        }
        #[inline(always)]
        fn to_f64(self) -> f64 {
            self as f64
        }
        #[inline(always)]
        fn from_usize(x: usize) -> Self {
            x as $t
        }
        #[inline(always)]
        fn ln(self) -> Self {
            $t::ln(self)
        }
        #[inline(always)]
        fn sqrt(self) -> Self {
            $t::sqrt(self)
        }
        #[inline(always)]
        fn abs(self) -> Self {
            $t::abs(self)
        }
        #[inline(always)]
        fn max(self, other: Self) -> Self {
            $t::max(self, other)
        }
        #[inline(always)]
        fn is_finite(self) -> bool {
            $t::is_finite(self)
        }
    };
}

impl Float for f32 {
    primitive_float_methods!(f32);

    fn sum_exp_row(row: &[f32], max: f32) -> f64 {
        super::fastmath::sum_exp_f32(row, max)
    }
    fn exp_scale_row(row: &mut [f32], max: f32, scale: f32) {
        super::fastmath::exp_scale_f32(row, max, scale)
    }
    fn exp_sum_row(row: &mut [f32], max: f32) -> f64 {
        super::fastmath::exp_sum_f32(row, max)
    }
    fn scale_row(row: &mut [f32], scale: f32) {
        super::fastmath::scale_f32(row, scale)
    }
    fn row_max(row: &[f32]) -> f32 {
        super::crossentropy::row_max_f32(row)
    }
    fn layernorm_row(out: &mut [f32], x: &[f32], w: &[f32], bias: &[f32]) -> (f32, f32) {
        super::layernorm::layernorm_row_f32(out, x, w, bias)
    }
    fn layernorm_backward_row(
        dinp: &mut [f32],
        dout: &[f32],
        x: &[f32],
        w: &[f32],
        mu: f32,
        rs: f32,
    ) {
        super::layernorm::layernorm_backward_row_f32(dinp, dout, x, w, mu, rs)
    }
    fn gelu_rows(out: &mut [f32], inp: &[f32]) {
        super::gelu::gelu_rows_f32(out, inp)
    }
    fn softmax_backward_row(d: &mut [f32], a: &[f32]) {
        super::attention::softmax_backward_row_f32(d, a)
    }
    fn gelu_backward_rows(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
        super::gelu::gelu_backward_rows_f32(dinp, inp, dout)
    }
    fn swiglu_row(out: &mut [f32], gate: &[f32], up: &[f32]) {
        super::swiglu::swiglu_row_f32(out, gate, up)
    }
    fn swiglu_backward_row(d: (&mut [f32], &mut [f32]), dout: &[f32], gate: &[f32], up: &[f32]) {
        super::swiglu::swiglu_backward_row_f32(d, dout, gate, up)
    }
    #[inline(always)]
    fn exp(self) -> Self {
        super::fastmath::exp_f32(self)
    }
    #[inline(always)]
    fn tanh(self) -> Self {
        super::fastmath::tanh_f32(self)
    }

    fn gemm(
        prec: Precision,
        alpha: f32,
        a: Mat<'_, f32>,
        b: Mat<'_, f32>,
        beta: f32,
        c: MatMutT<'_, f32>,
    ) {
        gemm_stored(prec, alpha, a, b, beta, c);
    }
}

/// The operand type of a strided batched GEMM computed in `T`, its results stored in `O`
/// (`T` itself by default): `T`, and for `f32` the 16-bit types a backend stores
/// ([`half::bf16`], [`half::f16`]), which fugu-gemm packs as stored (exact conversions): ops
/// generic over it read 16-bit tensors without staging them in `f32`; with a 16-bit `O` they
/// write 16-bit results too, each rounded once from its `f32` sum (fugu-gemm's `gemm_into`).
pub trait GemmOperand<T: Float, O = T>: Copy + Send + Sync + 'static {
    /// Strided batched GEMM, `C[p] := alpha·A[p]·B[p] + beta·C[p]` for every `p < batch`
    /// (PyTorch `baddbmm`; `bmm` with `beta = 0`). C is not read when `beta == 0`. `prec` as
    /// for [`Float::gemm`].
    ///
    /// # Panics
    /// As [`Float::gemm`], when the batch sizes differ, and when a 16-bit C would be added
    /// onto (`beta != 0`: it is written once, from `f32` sums).
    fn gemm_strided_batched(
        prec: Precision,
        alpha: T,
        a: BatchMat<'_, Self>,
        b: BatchMat<'_, Self>,
        beta: T,
        c: BatchMatMut<'_, O>,
    );
}

/// 16-bit results, written once ([`GemmOperand`]).
macro_rules! gemm_operand_into {
    ($out:ty) => {
        impl<E: fugu_gemm::Element> GemmOperand<f32, $out> for E {
            fn gemm_strided_batched(
                prec: Precision,
                alpha: f32,
                a: BatchMat<'_, E>,
                b: BatchMat<'_, E>,
                beta: f32,
                c: BatchMatMut<'_, $out>,
            ) {
                assert_eq!(
                    beta, 0.0,
                    "ops gemm: a 16-bit C is written once, not added onto"
                );
                let (av, bv, cv) = (batch_ref(a), batch_ref(b), batch_mut(c));
                fugu_gemm::Runtime::global()
                    .and_then(|rt| rt.at(prec).gemm_into_strided_batched(alpha, av, bv, cv))
                    .unwrap_or_else(|e| gemm_failed(e));
            }
        }
    };
}
gemm_operand_into!(fugu_gemm::half::bf16);
gemm_operand_into!(fugu_gemm::half::f16);

impl<E: fugu_gemm::Element> GemmOperand<f32> for E {
    fn gemm_strided_batched(
        prec: Precision,
        alpha: f32,
        a: BatchMat<'_, E>,
        b: BatchMat<'_, E>,
        beta: f32,
        c: BatchMatMut<'_, f32>,
    ) {
        fugu_gemm_strided_batched(prec, alpha, a, b, beta, c)
    }
}

impl GemmOperand<f64> for f64 {
    fn gemm_strided_batched(
        _prec: Precision,
        alpha: f64,
        a: BatchMat<'_, f64>,
        b: BatchMat<'_, f64>,
        beta: f64,
        c: BatchMatMut<'_, f64>,
    ) {
        assert!(
            a.batch == c.batch && b.batch == c.batch,
            "ops gemm: batch mismatch: A has {}, B has {}, C has {}",
            a.batch,
            b.batch,
            c.batch
        );
        check_shapes(a.rows, a.cols, b.rows, b.cols, c.rows, c.cols);
        for p in 0..c.batch {
            let off = c.offset + p * c.bs;
            gemm_naive(
                alpha,
                &a.matrix(p),
                &b.matrix(p),
                beta,
                c.data,
                off,
                c.rs,
                c.cs,
            );
        }
    }
}

/// The element type of a table an op reads rows of into `T` values (an embedding): `T`
/// itself, and for `f32` the 16-bit types a backend stores, widened exactly as the rows are
/// read, so the table is never staged in `f32`.
pub trait TableRow<T: Float>: Copy + Send + Sync + 'static {
    /// `dst = src`, exactly.
    fn widen_row(src: &[Self], dst: &mut [T]);
    /// `acc[j] += src[j]`, the row widened into `wide` (of its length) first where it is
    /// not already of type `T`.
    fn add_row(acc: &mut [T], src: &[Self], wide: &mut [T]) {
        Self::widen_row(src, wide);
        for (x, &y) in acc.iter_mut().zip(&*wide) {
            *x += y;
        }
    }
}

impl<T: Float> TableRow<T> for T {
    fn widen_row(src: &[T], dst: &mut [T]) {
        dst.copy_from_slice(src)
    }
    fn add_row(acc: &mut [T], src: &[T], _wide: &mut [T]) {
        for (x, &y) in acc.iter_mut().zip(src) {
            *x += y;
        }
    }
}

impl TableRow<f32> for fugu_gemm::half::bf16 {
    fn widen_row(src: &[fugu_gemm::half::bf16], dst: &mut [f32]) {
        use fugu_gemm::half::slice::HalfFloatSliceExt;
        super::half_rows::widen(crate::dtype::Dtype::Bf16, src.reinterpret_cast(), dst)
    }
}

impl TableRow<f32> for fugu_gemm::half::f16 {
    fn widen_row(src: &[fugu_gemm::half::f16], dst: &mut [f32]) {
        use fugu_gemm::half::slice::HalfFloatSliceExt;
        super::half_rows::widen(crate::dtype::Dtype::F16, src.reinterpret_cast(), dst)
    }
}

/// fugu-gemm's strided batched GEMM at `prec` on operands of any type it takes.
fn fugu_gemm_strided_batched<E: fugu_gemm::Element>(
    prec: Precision,
    alpha: f32,
    a: BatchMat<'_, E>,
    b: BatchMat<'_, E>,
    beta: f32,
    c: BatchMatMut<'_, f32>,
) {
    let (av, bv, cv) = (batch_ref(a), batch_ref(b), batch_mut(c));
    fugu_gemm::Runtime::global()
        .and_then(|rt| rt.at(prec).gemm_strided_batched(alpha, av, bv, beta, cv))
        .unwrap_or_else(|e| gemm_failed(e));
}

/// fugu-gemm's view of a writable batch.
fn batch_mut<T>(c: BatchMatMut<'_, T>) -> fugu_gemm::BatchMut<'_, T> {
    let data = tail_mut(c.data, c.offset);
    fugu_gemm::BatchMut::new(data, c.batch, c.rows, c.cols, c.rs, c.cs, c.bs)
        .unwrap_or_else(|e| gemm_failed(e))
}

/// fugu-gemm's view of a read-only batch.
fn batch_ref<E: fugu_gemm::Element>(m: BatchMat<'_, E>) -> fugu_gemm::BatchRef<'_, E> {
    let data = tail(m.data, m.offset);
    fugu_gemm::BatchRef::new(data, m.batch, m.rows, m.cols, m.rs, m.cs, m.bs)
        .unwrap_or_else(|e| gemm_failed(e))
}

impl Float for f64 {
    primitive_float_methods!(f64);

    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn tanh(self) -> Self {
        f64::tanh(self)
    }

    fn gemm(
        _prec: Precision,
        alpha: f64,
        a: Mat<'_, f64>,
        b: Mat<'_, f64>,
        beta: f64,
        c: MatMutT<'_, f64>,
    ) {
        check_shapes(a.rows, a.cols, b.rows, b.cols, c.rows, c.cols);
        gemm_naive(alpha, &a, &b, beta, c.data, c.offset, c.rs, c.cs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::Rng;

    /// Transposed, offset and strided views agree between the fugu-gemm path and the loop.
    #[test]
    fn f32_hooks_match_f64_loop() {
        let mut rng = Rng::new(1);
        let (m, k, n) = (13, 9, 11);
        // A stored transposed with padding: (k, m) with row stride m + 3, at offset 5.
        let a64: Vec<f64> = rng.vec(5 + k * (m + 3));
        let b64: Vec<f64> = rng.vec(n * k); // B stored as (n, k): B = this^T
        let c0: Vec<f64> = rng.vec(2 + m * n * 2);
        let a32: Vec<f32> = a64.iter().map(|&x| x as f32).collect();
        let b32: Vec<f32> = b64.iter().map(|&x| x as f32).collect();
        let mut c64 = c0.clone();
        let mut c32: Vec<f32> = c0.iter().map(|&x| x as f32).collect();
        // C: (m, n) with column stride 2 at offset 2.
        f64::gemm(
            Precision::F32,
            0.5,
            Mat::new(&a64, 5, k, m, m + 3, 1).t(),
            Mat::row_major(&b64, n, k).t(),
            1.5,
            MatMutT::new(&mut c64, 2, m, n, 2 * n, 2),
        );
        f32::gemm(
            Precision::F32,
            0.5,
            Mat::new(&a32, 5, k, m, m + 3, 1).t(),
            Mat::row_major(&b32, n, k).t(),
            1.5,
            MatMutT::new(&mut c32, 2, m, n, 2 * n, 2),
        );
        for (x, y) in c32.iter().zip(&c64) {
            assert!((*x as f64 - y).abs() < 1e-5, "{x} vs {y}");
        }
        // Untouched elements (odd positions after the offset) keep their values.
        assert_eq!(c64[3], c0[3]);
        assert_eq!(c32[3], c0[3] as f32);

        // Batched: 3 matrices interleaved along the columns (batch stride 4, row stride 12).
        let x: Vec<f64> = rng.vec(7 * 12);
        let y: Vec<f64> = rng.vec(3 * 4 * 5);
        let (x32, y32): (Vec<f32>, Vec<f32>) = (
            x.iter().map(|&v| v as f32).collect(),
            y.iter().map(|&v| v as f32).collect(),
        );
        let mut o64 = vec![f64::NAN; 3 * 7 * 5];
        let mut o32 = vec![f32::NAN; 3 * 7 * 5];
        let xa = |d| BatchMat {
            data: d,
            offset: 0,
            batch: 3,
            bs: 4,
            rows: 7,
            cols: 4,
            rs: 12,
            cs: 1,
        };
        <f64 as GemmOperand<f64>>::gemm_strided_batched(
            Precision::F32,
            1.0,
            xa(&x),
            BatchMat {
                data: &y,
                offset: 0,
                batch: 3,
                bs: 20,
                rows: 5,
                cols: 4,
                rs: 4,
                cs: 1,
            }
            .t(),
            0.0,
            BatchMatMut {
                data: &mut o64,
                offset: 0,
                batch: 3,
                bs: 5,
                rows: 7,
                cols: 5,
                rs: 15,
                cs: 1,
            },
        );
        <f32 as GemmOperand<f32>>::gemm_strided_batched(
            Precision::F32,
            1.0,
            BatchMat {
                data: &x32,
                offset: 0,
                batch: 3,
                bs: 4,
                rows: 7,
                cols: 4,
                rs: 12,
                cs: 1,
            },
            BatchMat {
                data: &y32,
                offset: 0,
                batch: 3,
                bs: 20,
                rows: 5,
                cols: 4,
                rs: 4,
                cs: 1,
            }
            .t(),
            0.0,
            BatchMatMut {
                data: &mut o32,
                offset: 0,
                batch: 3,
                bs: 5,
                rows: 7,
                cols: 5,
                rs: 15,
                cs: 1,
            },
        );
        for (p, (u, v)) in o32.iter().zip(&o64).enumerate() {
            assert!(v.is_finite(), "element {p} not written");
            assert!((*u as f64 - v).abs() < 1e-5, "{u} vs {v}");
        }
        // Spot-check one element against a direct dot product.
        let (p, i, j) = (2, 6, 3);
        let want: f64 = (0..4)
            .map(|q| x[i * 12 + p * 4 + q] * y[p * 20 + j * 4 + q])
            .sum();
        assert!((o64[i * 15 + p * 5 + j] - want).abs() < 1e-12);
    }

    #[test]
    #[should_panic(expected = "shape mismatch")]
    fn f64_shape_mismatch_panics() {
        let a = vec![0.0f64; 6];
        let mut c = vec![0.0f64; 4];
        f64::gemm(
            Precision::F32,
            1.0,
            Mat::row_major(&a, 2, 3),
            Mat::row_major(&a, 2, 3),
            0.0,
            MatMutT::row_major(&mut c, 2, 2),
        );
    }

    #[test]
    #[should_panic(expected = "internal misuse")]
    fn f32_out_of_bounds_panics() {
        let a = vec![0.0f32; 6];
        let mut c = vec![0.0f32; 3];
        f32::gemm(
            Precision::F32,
            1.0,
            Mat::row_major(&a, 2, 3),
            Mat::row_major(&a, 3, 2),
            0.0,
            MatMutT::row_major(&mut c, 2, 2),
        );
    }
}

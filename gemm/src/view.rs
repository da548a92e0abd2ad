//! Strided matrix views: the only way data enters fugu-gemm.
//!
//! A view is a buffer plus `(offset, rows, cols, row_stride, col_stride)`: element `(i, j)` lives
//! at `offset + i*row_stride + j*col_stride`. Transposes and sub-matrices are free (they only
//! change the numbers). Every constructor checks that the view fits its buffer, and output views
//! are also checked to have no two elements at the same address, so a GEMM can write them from
//! many threads without a race.

use crate::error::GemmError;
use std::marker::PhantomData;

/// Number of elements a view with these extents needs, `None` on overflow.
/// Each `(dim, stride)` pair contributes `(dim - 1) * stride`; an empty view needs nothing.
fn span(offset: usize, dims: &[(usize, usize)]) -> Option<usize> {
    if dims.iter().any(|&(d, _)| d == 0) {
        return Some(0);
    }
    let mut last = offset;
    for &(d, s) in dims {
        last = last.checked_add((d - 1).checked_mul(s)?)?;
    }
    last.checked_add(1)
}

#[allow(clippy::too_many_arguments)]
fn check_fits(
    operand: &str,
    len: usize,
    offset: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
    extra: &[(usize, usize)],
) -> Result<(), GemmError> {
    let mut dims = vec![(rows, rs), (cols, cs)];
    dims.extend_from_slice(extra);
    let needed = span(offset, &dims).ok_or_else(|| GemmError::Overflow {
        operand: operand.to_string(),
        detail: format!("{rows}x{cols}, strides ({rs}, {cs}), offset {offset}, extra {extra:?}"),
    })?;
    if needed > len || (needed == 0 && offset > len) {
        return Err(GemmError::OutOfBounds {
            operand: operand.to_string(),
            rows,
            cols,
            row_stride: rs,
            col_stride: cs,
            offset,
            needed,
            len,
        });
    }
    Ok(())
}

/// True when no two index tuples map to the same element: sorting the dimensions that have
/// more than one element by stride, each stride must exceed the span of all smaller ones.
fn injective(dims: &[(usize, usize)]) -> bool {
    if dims.iter().any(|&(d, _)| d == 0) {
        return true; // no elements at all
    }
    let mut ds: Vec<(usize, usize)> = dims.iter().copied().filter(|&(d, _)| d > 1).collect();
    ds.sort_by_key(|&(_, s)| s);
    let mut reach: usize = 0;
    for (d, s) in ds {
        if s <= reach {
            return false;
        }
        reach = match (d - 1).checked_mul(s).and_then(|x| x.checked_add(reach)) {
            Some(r) => r,
            None => return false,
        };
    }
    true
}

/// A read-only strided matrix view.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a, T> {
    data: &'a [T],
    offset: usize,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// A writable strided matrix view whose elements never alias one another.
///
/// It holds a raw pointer to element (0, 0) rather than a slice, so that a batch can be split
/// into disjoint per-matrix views without creating aliasing `&mut` slices.
#[derive(Debug)]
pub struct MatMut<'a, T> {
    ptr: *mut T,
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
    _borrow: PhantomData<&'a mut T>,
}

// SAFETY: a MatMut is a unique borrow of its elements, like `&mut [T]`, which is Send/Sync
// exactly when T is.
unsafe impl<T: Send> Send for MatMut<'_, T> {}
// SAFETY: as above; shared access only reads through `as_ref`.
unsafe impl<T: Sync> Sync for MatMut<'_, T> {}

impl<'a, T> MatRef<'a, T> {
    /// A `rows × cols` view of `data` with the given strides, starting at element 0.
    pub fn new(
        data: &'a [T],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, GemmError> {
        Self::with_offset(data, 0, rows, cols, row_stride, col_stride)
    }

    /// Like [`MatRef::new`], starting at element `offset`.
    pub fn with_offset(
        data: &'a [T],
        offset: usize,
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, GemmError> {
        check_fits(
            "A/B",
            data.len(),
            offset,
            rows,
            cols,
            row_stride,
            col_stride,
            &[],
        )?;
        Ok(MatRef {
            data,
            offset,
            rows,
            cols,
            rs: row_stride,
            cs: col_stride,
        })
    }

    /// A dense row-major `rows × cols` view (`data.len()` must be at least `rows*cols`).
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Result<Self, GemmError> {
        Self::new(data, rows, cols, cols, 1)
    }

    /// A dense column-major `rows × cols` view.
    pub fn col_major(data: &'a [T], rows: usize, cols: usize) -> Result<Self, GemmError> {
        Self::new(data, rows, cols, 1, rows)
    }

    /// The transpose (free: swaps dimensions and strides).
    pub fn t(self) -> Self {
        MatRef {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// The `rows × cols` sub-matrix starting at `(r0, c0)`.
    pub fn submatrix(
        self,
        r0: usize,
        c0: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Self, GemmError> {
        sub_bounds(self.rows, self.cols, r0, c0, rows, cols)?;
        let offset = self.offset + r0 * self.rs + c0 * self.cs;
        Ok(MatRef {
            offset,
            rows,
            cols,
            ..self
        })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Distance in elements between consecutive rows.
    pub fn row_stride(&self) -> usize {
        self.rs
    }
    /// Distance in elements between consecutive columns.
    pub fn col_stride(&self) -> usize {
        self.cs
    }

    /// Element `(i, j)`, or `None` outside the view.
    pub fn get(&self, i: usize, j: usize) -> Option<&'a T> {
        if i < self.rows && j < self.cols {
            self.data.get(self.offset + i * self.rs + j * self.cs)
        } else {
            None
        }
    }

    /// Pointer to element (0, 0). Only meaningful for non-empty views.
    pub(crate) fn ptr(&self) -> *const T {
        self.data[self.offset..].as_ptr()
    }
}

fn sub_bounds(
    prows: usize,
    pcols: usize,
    r0: usize,
    c0: usize,
    rows: usize,
    cols: usize,
) -> Result<(), GemmError> {
    let r_end = r0.checked_add(rows);
    let c_end = c0.checked_add(cols);
    match (r_end, c_end) {
        (Some(re), Some(ce)) if re <= prows && ce <= pcols => Ok(()),
        _ => Err(GemmError::ShapeMismatch {
            detail: format!(
                "submatrix rows {r0}..{r0}+{rows}, cols {c0}..{c0}+{cols} is outside a {prows}x{pcols} view"
            ),
        }),
    }
}

impl<'a, T> MatMut<'a, T> {
    /// A writable `rows × cols` view with the given strides, starting at element 0.
    pub fn new(
        data: &'a mut [T],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, GemmError> {
        Self::with_offset(data, 0, rows, cols, row_stride, col_stride)
    }

    /// Like [`MatMut::new`], starting at element `offset`.
    pub fn with_offset(
        data: &'a mut [T],
        offset: usize,
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self, GemmError> {
        check_fits(
            "C",
            data.len(),
            offset,
            rows,
            cols,
            row_stride,
            col_stride,
            &[],
        )?;
        if !injective(&[(rows, row_stride), (cols, col_stride)]) {
            return Err(GemmError::OverlappingOutput {
                operand: "C".into(),
                rows,
                cols,
                row_stride,
                col_stride,
            });
        }
        // An empty view never dereferences its pointer, so any in-bounds base is fine.
        let ptr = data.as_mut_ptr().wrapping_add(offset.min(data.len()));
        Ok(MatMut {
            ptr,
            rows,
            cols,
            rs: row_stride,
            cs: col_stride,
            _borrow: PhantomData,
        })
    }

    /// A dense row-major `rows × cols` view.
    pub fn row_major(data: &'a mut [T], rows: usize, cols: usize) -> Result<Self, GemmError> {
        Self::new(data, rows, cols, cols, 1)
    }

    /// A dense column-major `rows × cols` view.
    pub fn col_major(data: &'a mut [T], rows: usize, cols: usize) -> Result<Self, GemmError> {
        Self::new(data, rows, cols, 1, rows)
    }

    /// The transpose (free).
    pub fn t(self) -> Self {
        MatMut {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// A shorter-lived writable view of the same elements.
    pub fn rb_mut(&mut self) -> MatMut<'_, T> {
        MatMut {
            ptr: self.ptr,
            rows: self.rows,
            cols: self.cols,
            rs: self.rs,
            cs: self.cs,
            _borrow: PhantomData,
        }
    }

    /// Reads element `(i, j)`, or `None` outside the view.
    pub fn get(&self, i: usize, j: usize) -> Option<T>
    where
        T: Copy,
    {
        // SAFETY: (i, j) is inside the view, which the constructor checked lies in the buffer.
        (i < self.rows && j < self.cols)
            .then(|| unsafe { *self.ptr.add(i * self.rs + j * self.cs) })
    }

    /// The writable `rows × cols` sub-matrix starting at `(r0, c0)`.
    pub fn submatrix(
        self,
        r0: usize,
        c0: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Self, GemmError> {
        sub_bounds(self.rows, self.cols, r0, c0, rows, cols)?;
        let ptr = if rows == 0 || cols == 0 {
            self.ptr
        } else {
            // SAFETY: (r0, c0) is an element of the view, hence inside the buffer.
            unsafe { self.ptr.add(r0 * self.rs + c0 * self.cs) }
        };
        Ok(MatMut {
            ptr,
            rows,
            cols,
            ..self
        })
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Distance in elements between consecutive rows.
    pub fn row_stride(&self) -> usize {
        self.rs
    }
    /// Distance in elements between consecutive columns.
    pub fn col_stride(&self) -> usize {
        self.cs
    }

    /// Element `(i, j)`, or `None` outside the view.
    pub fn get_mut(&mut self, i: usize, j: usize) -> Option<&mut T> {
        // SAFETY: (i, j) is inside the view, hence inside the buffer, and the view borrows its
        // elements uniquely; the returned reference borrows `self`.
        (i < self.rows && j < self.cols)
            .then(|| unsafe { &mut *self.ptr.add(i * self.rs + j * self.cs) })
    }

    /// Pointer to element (0, 0). Only meaningful for non-empty views.
    pub(crate) fn ptr_mut(&mut self) -> *mut T {
        self.ptr
    }
}

/// A read-only strided batch of equally shaped matrices: matrix `b` starts `b*batch_stride`
/// elements after matrix 0 (the `bmm`/`baddbmm` layout). A batch stride of 0 repeats one matrix.
#[derive(Clone, Copy, Debug)]
pub struct BatchRef<'a, T> {
    mat: MatRef<'a, T>,
    batch: usize,
    bs: usize,
}

/// A writable strided batch; no two elements of any two matrices alias.
#[derive(Debug)]
pub struct BatchMut<'a, T> {
    mat: MatMut<'a, T>,
    batch: usize,
    bs: usize,
}

impl<'a, T> BatchRef<'a, T> {
    /// `batch` matrices of `rows × cols` with the given strides.
    pub fn new(
        data: &'a [T],
        batch: usize,
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
        batch_stride: usize,
    ) -> Result<Self, GemmError> {
        check_fits(
            "A/B batch",
            data.len(),
            0,
            rows,
            cols,
            row_stride,
            col_stride,
            &[(batch, batch_stride)],
        )?;
        Ok(BatchRef {
            mat: MatRef {
                data,
                offset: 0,
                rows,
                cols,
                rs: row_stride,
                cs: col_stride,
            },
            batch,
            bs: batch_stride,
        })
    }

    /// Dense row-major matrices stored one after another.
    pub fn row_major(
        data: &'a [T],
        batch: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Self, GemmError> {
        Self::new(data, batch, rows, cols, cols, 1, rows * cols)
    }

    /// Transposes every matrix of the batch.
    pub fn t(self) -> Self {
        BatchRef {
            mat: self.mat.t(),
            ..self
        }
    }

    /// Number of matrices.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Rows of each matrix.
    pub fn rows(&self) -> usize {
        self.mat.rows
    }
    /// Columns of each matrix.
    pub fn cols(&self) -> usize {
        self.mat.cols
    }

    /// Matrix `i` of the batch.
    pub fn matrix(&self, i: usize) -> Option<MatRef<'a, T>> {
        (i < self.batch).then(|| MatRef {
            offset: self.mat.offset + i * self.bs,
            ..self.mat
        })
    }
}

impl<'a, T> BatchMut<'a, T> {
    /// `batch` writable matrices of `rows × cols`; the batch must not overlap itself.
    pub fn new(
        data: &'a mut [T],
        batch: usize,
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
        batch_stride: usize,
    ) -> Result<Self, GemmError> {
        check_fits(
            "C batch",
            data.len(),
            0,
            rows,
            cols,
            row_stride,
            col_stride,
            &[(batch, batch_stride)],
        )?;
        if !injective(&[
            (rows, row_stride),
            (cols, col_stride),
            (batch, batch_stride),
        ]) {
            return Err(GemmError::OverlappingOutput {
                operand: format!("C batch (batch {batch}, batch stride {batch_stride})"),
                rows,
                cols,
                row_stride,
                col_stride,
            });
        }
        Ok(BatchMut {
            mat: MatMut {
                ptr: data.as_mut_ptr(),
                rows,
                cols,
                rs: row_stride,
                cs: col_stride,
                _borrow: PhantomData,
            },
            batch,
            bs: batch_stride,
        })
    }

    /// Dense row-major matrices stored one after another.
    pub fn row_major(
        data: &'a mut [T],
        batch: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Self, GemmError> {
        Self::new(data, batch, rows, cols, cols, 1, rows * cols)
    }

    /// Number of matrices.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Rows of each matrix.
    pub fn rows(&self) -> usize {
        self.mat.rows
    }
    /// Columns of each matrix.
    pub fn cols(&self) -> usize {
        self.mat.cols
    }

    /// Splits the batch into one writable view per matrix.
    pub fn matrices(&mut self) -> Vec<MatMut<'_, T>> {
        let empty = self.mat.rows == 0 || self.mat.cols == 0;
        (0..self.batch)
            .map(|i| MatMut {
                // The constructor checked that the whole batch lies in the buffer and that no
                // two of its elements share an address, so these views are disjoint; they
                // borrow `self` mutably, so nothing else touches the buffer while they live.
                // wrapping_add: empty matrices are never dereferenced.
                ptr: if empty {
                    self.mat.ptr
                } else {
                    self.mat.ptr.wrapping_add(i * self.bs)
                },
                rows: self.mat.rows,
                cols: self.mat.cols,
                rs: self.mat.rs,
                cs: self.mat.cs,
                _borrow: PhantomData,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn injectivity() {
        assert!(injective(&[(3, 4), (4, 1)]));
        assert!(!injective(&[(3, 3), (4, 1)]));
        assert!(!injective(&[(3, 0), (4, 1)]));
        assert!(injective(&[(1, 0), (4, 1)]));
        assert!(injective(&[(2, 12), (3, 4), (4, 1)]));
        assert!(!injective(&[(2, 11), (3, 4), (4, 1)]));
        assert!(injective(&[(0, 0), (4, 0)]));
    }

    #[test]
    fn bounds() {
        let v = vec![0.0f32; 12];
        assert!(MatRef::new(&v, 3, 4, 4, 1).is_ok());
        assert!(MatRef::new(&v, 3, 5, 4, 1).is_err());
        assert!(MatRef::new(&v, 0, 5, 400, 1).is_ok());
        assert!(MatRef::new(&v, 2, 2, usize::MAX, 1).is_err());
        assert!(MatRef::row_major(&v, 3, 4)
            .unwrap()
            .submatrix(1, 1, 2, 3)
            .is_ok());
        assert!(MatRef::row_major(&v, 3, 4)
            .unwrap()
            .submatrix(1, 1, 3, 3)
            .is_err());
    }
}

//! Raw strided matrices used inside the driver, after the safe views have been validated.

use crate::precision::Storage;

/// A validated read-only strided block: `ptr` points at element (0, 0), whose elements are
/// stored as `storage` says; strides count elements.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawMat {
    pub ptr: *const u8,
    pub storage: Storage,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

/// A validated writable strided block whose elements do not alias.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawMatMut {
    pub ptr: *mut f32,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

// SAFETY: RawMat/RawMatMut are only built from validated views whose borrows outlive the GEMM
// call; the driver gives each thread disjoint C tiles, and A/B are only read.
unsafe impl Send for RawMat {}
// SAFETY: as above.
unsafe impl Sync for RawMat {}
// SAFETY: as above; writes go to disjoint tiles.
unsafe impl Send for RawMatMut {}
// SAFETY: as above.
unsafe impl Sync for RawMatMut {}

impl RawMat {
    /// An `f32` block (the tests build their sources with it).
    #[cfg(test)]
    pub fn f32(ptr: *const f32, rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        RawMat {
            ptr: ptr.cast(),
            storage: Storage::F32,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// The pointer to element (0, 0) of an `f32` block.
    pub fn f32_ptr(self) -> *const f32 {
        debug_assert_eq!(self.storage, Storage::F32);
        self.ptr.cast()
    }

    /// The pointer to element (0, 0) of a 16-bit block (`f16` or `bf16` bits).
    pub fn u16_ptr(self) -> *const u16 {
        debug_assert_ne!(self.storage, Storage::F32);
        self.ptr.cast()
    }

    /// The transpose.
    pub fn t(self) -> Self {
        RawMat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// The `rows × cols` block at `(r0, c0)`; the caller keeps it inside the view.
    pub fn block(self, r0: usize, c0: usize, rows: usize, cols: usize) -> Self {
        debug_assert!(r0 + rows <= self.rows && c0 + cols <= self.cols);
        RawMat {
            ptr: self
                .ptr
                .wrapping_add((r0 * self.rs + c0 * self.cs) * self.storage.bytes()),
            rows,
            cols,
            ..self
        }
    }
}

impl RawMatMut {
    /// The transpose.
    pub fn t(self) -> Self {
        RawMatMut {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// The `rows × cols` block at `(r0, c0)`; the caller keeps it inside the view.
    pub fn block(self, r0: usize, c0: usize, rows: usize, cols: usize) -> Self {
        debug_assert!(r0 + rows <= self.rows && c0 + cols <= self.cols);
        RawMatMut {
            ptr: self.ptr.wrapping_add(r0 * self.rs + c0 * self.cs),
            rows,
            cols,
            ..self
        }
    }
}

/// A validated writable strided block of any [`Storage`] (the D of
/// [`crate::PrecisionGemm::gemm_into`]): a [`RawMat`] whose pointer was taken from a writable
/// view ([`RawOut::ptr`]); its elements do not alias.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawOut(pub RawMat);

impl RawOut {
    /// The pointer to element (0, 0), to write through.
    pub fn ptr(self) -> *mut u8 {
        self.0.ptr as *mut u8
    }

    /// The transpose.
    pub fn t(self) -> Self {
        RawOut(self.0.t())
    }

    /// The `rows × cols` block at `(r0, c0)`; the caller keeps it inside the view.
    pub fn block(self, r0: usize, c0: usize, rows: usize, cols: usize) -> Self {
        RawOut(self.0.block(r0, c0, rows, cols))
    }
}

impl std::ops::Deref for RawOut {
    type Target = RawMat;
    fn deref(&self) -> &RawMat {
        &self.0
    }
}

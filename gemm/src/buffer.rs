//! 64-byte-aligned f32 buffers for packed panels and `gemm_into`'s tiles, reused across calls.
//!
//! Buffers are allocated zeroed, which on Linux maps fresh pages lazily, so the pages land on the
//! NUMA node of the thread that first writes them (first-touch placement): each domain's packing
//! threads touch their own packed blocks first.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::RefCell;
use std::ptr::NonNull;

const ALIGN: usize = 64;

/// An owned, zero-initialised, 64-byte-aligned `[f32]`.
pub(crate) struct AlignedBuf {
    ptr: NonNull<f32>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Vec<f32>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only allow reads through `&[f32]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub(crate) const fn empty() -> Self {
        AlignedBuf {
            ptr: NonNull::dangling(),
            len: 0,
        }
    }

    fn with_len(len: usize) -> Self {
        if len == 0 {
            return Self::empty();
        }
        let layout = Layout::from_size_align(len * 4, ALIGN).expect("packed buffer size overflows");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) } as *mut f32;
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    /// Makes the buffer at least `len` floats long (contents are not preserved when it grows)
    /// and returns the first `len` floats.
    pub(crate) fn get(&mut self, len: usize) -> &mut [f32] {
        if self.len < len {
            *self = Self::with_len(len);
        }
        // SAFETY: the allocation holds self.len >= len initialised floats and is owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            let layout = Layout::from_size_align(self.len * 4, ALIGN).expect("layout was valid");
            // SAFETY: allocated in with_len with this very layout.
            unsafe { dealloc(self.ptr.as_ptr() as *mut u8, layout) };
        }
    }
}

thread_local! {
    static PACK_A: RefCell<AlignedBuf> = const { RefCell::new(AlignedBuf::empty()) };
    static PACK_B: RefCell<AlignedBuf> = const { RefCell::new(AlignedBuf::empty()) };
    static TILE_C: RefCell<AlignedBuf> = const { RefCell::new(AlignedBuf::empty()) };
}

/// Runs `f` with this thread's A packing buffer of at least `len` floats.
pub(crate) fn with_thread_a<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    PACK_A.with(|b| f(b.borrow_mut().get(len)))
}

/// Runs `f` with this thread's B packing buffer of at least `len` floats.
pub(crate) fn with_thread_b<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    PACK_B.with(|b| f(b.borrow_mut().get(len)))
}

/// Runs `f` with this thread's `f32` tile of C (a `gemm_into` tile's sums) of at least `len`
/// floats.
pub(crate) fn with_thread_c<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    TILE_C.with(|b| f(b.borrow_mut().get(len)))
}

/// A packed buffer that the members of one team job fill in disjoint panels and then all
/// read, the two separated by a barrier ([`crate::team::Member::barrier`]): the raw view that
/// lets several threads write one buffer without a lock.
pub(crate) struct SharedPanels<'a> {
    ptr: *mut f32,
    len: usize,
    _buf: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: SharedPanels is a borrowed `&mut [f32]`; the access rules of its unsafe methods are
// what make concurrent use sound.
unsafe impl Send for SharedPanels<'_> {}
// SAFETY: as above.
unsafe impl Sync for SharedPanels<'_> {}

impl<'a> SharedPanels<'a> {
    pub(crate) fn new(buf: &'a mut [f32]) -> Self {
        SharedPanels {
            ptr: buf.as_mut_ptr(),
            len: buf.len(),
            _buf: std::marker::PhantomData,
        }
    }

    fn check(&self, r: &std::ops::Range<usize>) {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "panel outside the buffer"
        );
    }

    /// Words `r` to write.
    ///
    /// # Safety
    /// No other reference to any word of `r` may be live while the slice is (each member
    /// writes its own panels, and nobody reads them before the next barrier).
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice_mut(&self, r: std::ops::Range<usize>) -> &mut [f32] {
        self.check(&r);
        // SAFETY: in bounds (checked); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.len()) }
    }

    /// Words `r` to read.
    ///
    /// # Safety
    /// No member may write any word of `r` while the slice is live (the writes happened before
    /// a barrier this member has passed, and the next ones come after a later barrier).
    pub(crate) unsafe fn slice(&self, r: std::ops::Range<usize>) -> &[f32] {
        self.check(&r);
        // SAFETY: in bounds (checked); no concurrent writer is the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }
}

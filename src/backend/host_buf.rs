//! Host buffers that start on a cache-line boundary.
//!
//! A `Vec<f32>` of a few hundred KiB or more comes from `mmap` through glibc's `malloc`, 16
//! bytes past a page boundary: every 64-byte row piece a GEMM reads or writes then straddles
//! two cache lines. fugu-gemm's AVX-512 kernels store whole 64-byte vectors of C, so each
//! store split in two: a 64-byte-aligned C made the bf16 GEMMs of GPT-2 124M 1–4% faster on
//! Zen 4 (`docs/KERNELS.md`, "aligned buffers"). A64FX's lines are 256 bytes, so buffers start
//! on a [`HOST_ALIGN`] = 256-byte boundary, which is also a 64-byte one.

use anyhow::{bail, Result};

/// Where every [`HostBuf`] starts, in bytes: A64FX's cache line (x86's is 64).
pub const HOST_ALIGN: usize = 256;

/// `len` zero-initialised elements (`f32`, or the bits of a 16-bit float) whose first element
/// is [`HOST_ALIGN`]-byte aligned: a `Vec` with up to `HOST_ALIGN` bytes of slack in front of
/// the data (safe code; nothing is reallocated after construction, so the offset stays
/// valid).
#[derive(Default)]
pub struct HostBuf<T = f32> {
    store: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Default> HostBuf<T> {
    /// Allocates `len` zeros, or says how much memory was asked for.
    pub fn zeroed(len: usize) -> Result<HostBuf<T>> {
        let size = std::mem::size_of::<T>();
        let slack = HOST_ALIGN / size;
        let mut store = Vec::new();
        if store.try_reserve_exact(len + slack).is_err() {
            bail!(
                "out of memory allocating {:.1} MiB",
                len as f64 * size as f64 / (1 << 20) as f64
            );
        }
        store.resize(len + slack, T::default());
        // A T pointer is size-aligned, so the distance to the next boundary is a whole
        // number of elements, at most `slack - 1`.
        let misalign = store.as_ptr() as usize % HOST_ALIGN;
        let start = (HOST_ALIGN - misalign) % HOST_ALIGN / size;
        Ok(HostBuf { store, start, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_slice(&self) -> &[T] {
        &self.store[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.store[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_the_boundary_and_hold_zeros() {
        for len in [0, 1, 7, 64, 1000, 300_000] {
            let mut b = HostBuf::<f32>::zeroed(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_slice().len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0.0));
            if len > 0 {
                assert_eq!(b.as_slice().as_ptr() as usize % HOST_ALIGN, 0, "len {len}");
            }
            b.as_mut_slice().iter_mut().for_each(|x| *x = 1.0);
            assert!(b.as_slice().iter().all(|&x| x == 1.0));
            let h = HostBuf::<u16>::zeroed(len).unwrap();
            assert!(h.as_slice().len() == len && h.as_slice().iter().all(|&x| x == 0));
            if len > 0 {
                assert_eq!(h.as_slice().as_ptr() as usize % HOST_ALIGN, 0, "len {len}");
            }
        }
    }

    #[test]
    fn an_impossible_size_is_an_error() {
        let e = HostBuf::<f32>::zeroed(usize::MAX / 8)
            .err()
            .expect("too large");
        assert!(e.to_string().contains("out of memory"), "{e}");
    }
}

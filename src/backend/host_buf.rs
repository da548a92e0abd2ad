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

/// `len` zero-initialised `f32`s whose first element is [`HOST_ALIGN`]-byte aligned: a `Vec`
/// with up to `HOST_ALIGN` bytes of slack in front of the data (safe code; nothing is
/// reallocated after construction, so the offset stays valid).
#[derive(Default)]
pub struct HostBuf {
    store: Vec<f32>,
    start: usize,
    len: usize,
}

impl HostBuf {
    /// Allocates `len` zeros, or says how much memory was asked for.
    pub fn zeroed(len: usize) -> Result<HostBuf> {
        let slack = HOST_ALIGN / std::mem::size_of::<f32>();
        let mut store = Vec::new();
        if store.try_reserve_exact(len + slack).is_err() {
            bail!(
                "out of memory allocating {:.1} MiB",
                len as f64 * 4.0 / (1 << 20) as f64
            );
        }
        store.resize(len + slack, 0.0);
        // An f32 pointer is 4-byte aligned, so the distance to the next boundary is a whole
        // number of floats, at most `slack - 1`.
        let misalign = store.as_ptr() as usize % HOST_ALIGN;
        let start = (HOST_ALIGN - misalign) % HOST_ALIGN / std::mem::size_of::<f32>();
        Ok(HostBuf { store, start, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_slice(&self) -> &[f32] {
        &self.store[self.start..self.start + self.len]
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        &mut self.store[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_the_boundary_and_hold_zeros() {
        for len in [0, 1, 7, 64, 1000, 300_000] {
            let mut b = HostBuf::zeroed(len).unwrap();
            assert_eq!(b.len(), len);
            assert_eq!(b.as_slice().len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0.0));
            if len > 0 {
                assert_eq!(b.as_slice().as_ptr() as usize % HOST_ALIGN, 0, "len {len}");
            }
            b.as_mut_slice().iter_mut().for_each(|x| *x = 1.0);
            assert!(b.as_slice().iter().all(|&x| x == 1.0));
        }
    }

    #[test]
    fn an_impossible_size_is_an_error() {
        let e = HostBuf::zeroed(usize::MAX / 8).err().expect("too large");
        assert!(e.to_string().contains("out of memory"), "{e}");
    }
}

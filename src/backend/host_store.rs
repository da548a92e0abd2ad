//! The CPU backend's memory: every buffer in its own type, `f32` or the bits of a bf16/f16
//! value (half the bytes: with `--precision bf16|fp16` the activations, their gradients and
//! the compute copy of the weights), and the `f32` views the ops run on.
//!
//! An op asks for its spans with [`HostStore::run`]: an `f32` span is a view of its buffer;
//! a 16-bit span is decoded (exactly) into the *stage*, one `f32` arena reused from op to op,
//! and a written one is encoded back (rounded to nearest even) when the op returns. The ops
//! thus compute in `f32` on exactly the values a device stores and round what they write
//! once, as before storage was typed: the results are bit for bit the same. The stage holds
//! one op's 16-bit spans at a time (the largest: the LM head's logits), so it is what a 16-bit
//! run pays in memory on top of its buffers.

use super::host_buf::HostBuf;
use super::{BufId, Span};
use crate::dtype::{bf16_to_f32, f32_to_bf16, Dtype};
use anyhow::Result;
use fugu_gemm::precision::{f16_bits_of, f16_value_of};
use rayon::prelude::*;

/// A buffer's elements.
enum Store {
    F32(HostBuf<f32>),
    /// bf16 or f16 bits, as the buffer's [`Dtype`] says.
    Bits16(HostBuf<u16>),
}

impl Default for Store {
    fn default() -> Self {
        Store::F32(HostBuf::default())
    }
}

impl Store {
    fn len(&self) -> usize {
        match self {
            Store::F32(b) => b.len(),
            Store::Bits16(b) => b.len(),
        }
    }
}

/// Typed host buffers and the stage their 16-bit spans are viewed through (module docs).
#[derive(Default)]
pub struct HostStore {
    bufs: Vec<Store>,
    dtypes: Vec<Dtype>,
    stage: HostBuf<f32>,
}

/// Elements per piece of a parallel conversion.
const CONVERT_PIECE: usize = 1 << 15;

/// Floats between the stage's slots: a slot starts at the same offset modulo this as its span
/// in its buffer, so a staged span keeps its alignment to the 256-byte boundary (`HostBuf`).
const SLOT_ALIGN: usize = 64;

impl HostStore {
    pub fn alloc(&mut self, len: usize, dtype: Dtype) -> Result<BufId> {
        self.bufs.push(match dtype {
            Dtype::F32 => Store::F32(HostBuf::zeroed(len)?),
            Dtype::Bf16 | Dtype::F16 => Store::Bits16(HostBuf::zeroed(len)?),
        });
        self.dtypes.push(dtype);
        Ok(BufId(self.bufs.len() as u32 - 1))
    }

    pub fn free(&mut self, buf: BufId) {
        self.bufs[buf.0 as usize] = Store::default();
    }

    /// Elements of `buf`.
    pub fn len(&self, buf: BufId) -> usize {
        self.bufs[buf.0 as usize].len()
    }

    pub fn dtype(&self, buf: BufId) -> Dtype {
        self.dtypes[buf.0 as usize]
    }

    /// Bytes of the stage (grown to the largest op's 16-bit spans so far).
    pub fn stage_bytes(&self) -> usize {
        4 * self.stage.len()
    }

    /// Writes `src` into `dst`, rounded to its type.
    pub fn upload(&mut self, dst: Span, src: &[f32]) {
        assert_eq!(dst.len, src.len(), "upload: span and data lengths differ");
        self.check(&[dst]);
        let dt = self.dtype(dst.buf);
        match &mut self.bufs[dst.buf.0 as usize] {
            Store::F32(b) => b.as_mut_slice()[dst.range()].copy_from_slice(src),
            Store::Bits16(b) => encode(dt, src, &mut b.as_mut_slice()[dst.range()]),
        }
    }

    /// Reads `src` as `f32`s into `dst`.
    pub fn download(&self, src: Span, dst: &mut [f32]) {
        assert_eq!(src.len, dst.len(), "download: span and data lengths differ");
        self.check(&[src]);
        match &self.bufs[src.buf.0 as usize] {
            Store::F32(b) => dst.copy_from_slice(&b.as_slice()[src.range()]),
            Store::Bits16(b) => decode(self.dtype(src.buf), &b.as_slice()[src.range()], dst),
        }
    }

    /// Sets `s` to zeros (all-zero bits in every type).
    pub fn zero(&mut self, s: Span) {
        self.check(&[s]);
        match &mut self.bufs[s.buf.0 as usize] {
            Store::F32(b) => b.as_mut_slice()[s.range()].fill(0.0),
            Store::Bits16(b) => b.as_mut_slice()[s.range()].fill(0),
        }
    }

    /// `dst = src`, rounded to `dst`'s type (bits copied as they are between spans of one
    /// 16-bit type).
    pub fn copy(&mut self, dst: Span, src: Span) {
        assert_eq!(dst.len, src.len, "copy: span lengths differ");
        let (dd, ds) = (self.dtype(dst.buf), self.dtype(src.buf));
        if dd == ds && dd != Dtype::F32 {
            self.check(&[dst, src]);
            assert!(!dst.overlaps(src), "copy: {dst:?} overlaps {src:?}");
            let mut bits = vec![0u16; 0];
            if let Store::Bits16(b) = &self.bufs[src.buf.0 as usize] {
                bits.extend_from_slice(&b.as_slice()[src.range()]);
            }
            if let Store::Bits16(b) = &mut self.bufs[dst.buf.0 as usize] {
                b.as_mut_slice()[dst.range()].copy_from_slice(&bits);
            }
            return;
        }
        self.run([dst], [src], |[d], [s]| d.copy_from_slice(s));
    }

    /// Runs `op` on `f32` views of the spans it writes (`w`, read first: some ops update in
    /// place) and reads (`r`), through the stage for 16-bit spans, whose written values are
    /// rounded into their buffers when `op` returns.
    ///
    /// Panics (an internal bug, never user input) if a span is out of bounds or a written span
    /// overlaps any other span of the call; or if the stage cannot grow (out of memory).
    pub fn run<const W: usize, const R: usize, T>(
        &mut self,
        w: [Span; W],
        r: [Span; R],
        op: impl for<'a> FnOnce([&'a mut [f32]; W], [&'a [f32]; R]) -> T,
    ) -> T {
        self.check(&w);
        self.check(&r);
        for (i, a) in w.iter().enumerate() {
            for b in w.iter().skip(i + 1).chain(r.iter()) {
                assert!(!a.overlaps(*b), "written span {a:?} overlaps {b:?}");
            }
        }
        // Each 16-bit span's slot in the stage.
        let mut end = 0usize;
        let mut slot = |s: &Span| -> Option<usize> {
            let staged = matches!(self.bufs[s.buf.0 as usize], Store::Bits16(_));
            staged.then(|| {
                let at = end.next_multiple_of(SLOT_ALIGN) + s.offset % SLOT_ALIGN;
                end = at + s.len;
                at
            })
        };
        let w_at: [Option<usize>; W] = std::array::from_fn(|i| slot(&w[i]));
        let r_at: [Option<usize>; R] = std::array::from_fn(|i| slot(&r[i]));
        if self.stage.len() < end {
            self.stage = HostBuf::default();
            self.stage = HostBuf::zeroed(end).unwrap_or_else(|e| {
                panic!("staging {end} floats of 16-bit spans for an op: {e:#}")
            });
        }
        for (s, at) in w.iter().zip(&w_at).chain(r.iter().zip(&r_at)) {
            if let (Some(at), Store::Bits16(b)) = (at, &self.bufs[s.buf.0 as usize]) {
                let dt = self.dtypes[s.buf.0 as usize];
                decode(
                    dt,
                    &b.as_slice()[s.range()],
                    &mut self.stage.as_mut_slice()[*at..*at + s.len],
                );
            }
        }
        let stage = self.stage.as_mut_slice().as_mut_ptr();
        let ptrs: Vec<*mut f32> = self
            .bufs
            .iter_mut()
            .map(|b| match b {
                Store::F32(b) => b.as_mut_slice().as_mut_ptr(),
                Store::Bits16(_) => std::ptr::null_mut(),
            })
            .collect();
        let at = |s: &Span, slot: Option<usize>| match slot {
            // SAFETY: the slot lies inside the stage (grown to `end` above).
            Some(at) => unsafe { stage.add(at) },
            // SAFETY: checked above to lie inside its f32 buffer.
            None => unsafe { ptrs[s.buf.0 as usize].add(s.offset) },
        };
        // SAFETY: every span was checked to lie inside its buffer, and every slot inside the
        // stage; no written span overlaps another span of this call, and slots are disjoint,
        // so the mutable slices are disjoint from each other and from the shared ones (shared
        // spans may overlap each other: both are reads). The slices borrow `self` mutably
        // and cannot outlive `op` (its signature), so nothing is reallocated while they live.
        let wm: [&mut [f32]; W] = std::array::from_fn(|i| unsafe {
            std::slice::from_raw_parts_mut(at(&w[i], w_at[i]), w[i].len)
        });
        // SAFETY: as above.
        let rm: [&[f32]; R] = std::array::from_fn(|i| unsafe {
            std::slice::from_raw_parts(at(&r[i], r_at[i]) as *const f32, r[i].len)
        });
        let out = op(wm, rm);
        for (s, at) in w.iter().zip(&w_at) {
            let dt = self.dtypes[s.buf.0 as usize];
            if let (Some(at), Store::Bits16(b)) = (at, &mut self.bufs[s.buf.0 as usize]) {
                encode(
                    dt,
                    &self.stage.as_slice()[*at..*at + s.len],
                    &mut b.as_mut_slice()[s.range()],
                );
            }
        }
        out
    }

    /// Panics unless every span lies inside its buffer.
    fn check(&self, spans: &[Span]) {
        for s in spans {
            let len = self.bufs.get(s.buf.0 as usize).map_or(0, Store::len);
            assert!(
                s.offset.checked_add(s.len).is_some_and(|end| end <= len),
                "span {s:?} outside its buffer of {len} elements"
            );
        }
    }
}

/// `dst` = the `f32` values of the `dt` bits in `src` (exact).
fn decode(dt: Dtype, src: &[u16], dst: &mut [f32]) {
    let run = |(s, d): (&[u16], &mut [f32])| match dt {
        Dtype::Bf16 => d.iter_mut().zip(s).for_each(|(d, &s)| *d = bf16_to_f32(s)),
        Dtype::F16 => d.iter_mut().zip(s).for_each(|(d, &s)| *d = f16_value_of(s)),
        Dtype::F32 => unreachable!("f32 spans are not staged"),
    };
    src.par_chunks(CONVERT_PIECE)
        .zip(dst.par_chunks_mut(CONVERT_PIECE))
        .for_each(run);
}

/// `dst` = `src` rounded to `dt` (nearest even), as bits.
fn encode(dt: Dtype, src: &[f32], dst: &mut [u16]) {
    let run = |(s, d): (&[f32], &mut [u16])| match dt {
        Dtype::Bf16 => d.iter_mut().zip(s).for_each(|(d, &s)| *d = f32_to_bf16(s)),
        Dtype::F16 => d.iter_mut().zip(s).for_each(|(d, &s)| *d = f16_bits_of(s)),
        Dtype::F32 => unreachable!("f32 spans are not staged"),
    };
    src.par_chunks(CONVERT_PIECE)
        .zip(dst.par_chunks_mut(CONVERT_PIECE))
        .for_each(run);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(buf: BufId, offset: usize, len: usize) -> Span {
        Span { buf, offset, len }
    }

    /// A 16-bit buffer holds half the bytes, rounds what is written to its type exactly as
    /// `Dtype::round` does, and an op sees and writes it as `f32`s.
    #[test]
    fn sixteen_bit_spans_round_like_the_type_and_run_as_f32() {
        for dt in [Dtype::Bf16, Dtype::F16] {
            let mut st = HostStore::default();
            let a = st.alloc(300, dt).unwrap();
            let b = st.alloc(300, Dtype::F32).unwrap();
            let xs: Vec<f32> = (0..300).map(|i| (i as f32 * 0.731).sin() * 3.3e3).collect();
            st.upload(span(a, 0, 300), &xs);
            let mut got = vec![0.0; 300];
            st.download(span(a, 0, 300), &mut got);
            for (x, g) in xs.iter().zip(&got) {
                assert_eq!(g.to_bits(), dt.round(*x).to_bits(), "{dt:?} {x}");
            }
            // An op reading the 16-bit span and writing another part of it in place.
            st.run(
                [span(a, 200, 100)],
                [span(a, 3, 100), span(b, 0, 100)],
                |[w], [r, z]| {
                    for i in 0..100 {
                        w[i] += r[i] / 7.0 + z[i];
                    }
                },
            );
            let mut after = vec![0.0; 300];
            st.download(span(a, 0, 300), &mut after);
            for i in 0..100 {
                let want = dt.round(got[200 + i] + got[3 + i] / 7.0);
                assert_eq!(after[200 + i].to_bits(), want.to_bits(), "{dt:?} {i}");
            }
            assert_eq!(after[..200], got[..200]);
            assert!(st.stage_bytes() >= 4 * 200);
        }
    }

    #[test]
    fn copies_between_types_round_and_within_one_keep_the_bits() {
        let mut st = HostStore::default();
        let f = st.alloc(10, Dtype::F32).unwrap();
        let h = st.alloc(20, Dtype::F16).unwrap();
        let xs: Vec<f32> = (0..10).map(|i| 1.0 + i as f32 / 3.0).collect();
        st.upload(span(f, 0, 10), &xs);
        st.copy(span(h, 0, 10), span(f, 0, 10));
        st.copy(span(h, 10, 10), span(h, 0, 10));
        let mut got = vec![0.0; 20];
        st.download(span(h, 0, 20), &mut got);
        for i in 0..10 {
            assert_eq!(got[i], Dtype::F16.round(xs[i]));
            assert_eq!(got[10 + i], got[i]);
        }
    }

    #[test]
    fn spans_are_checked() {
        let mut st = HostStore::default();
        let a = st.alloc(10, Dtype::Bf16).unwrap();
        let s = |o, l| span(a, o, l);
        st.run([s(0, 5)], [s(5, 5)], |[w], [r]| {
            w[0] = 1.0;
            assert_eq!(r.len(), 5);
        });
        let mut v = [0.0];
        st.download(s(0, 1), &mut v);
        assert_eq!(v, [1.0]);
        let overlap = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            st.run([s(0, 5)], [s(4, 2)], |_, _| ());
        }));
        assert!(overlap.is_err());
        let outside = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            st.run([s(8, 5)], [], |_, _| ());
        }));
        assert!(outside.is_err());
    }
}

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
//! run pays in memory on top of its buffers. Row ops stage in cache-sized chunks of rows
//! ([`HostStore::run_rows`]), GEMMs read 16-bit operands as stored
//! ([`HostStore::run_rows_stored`]), and ops with 16-bit kernels of their own get the bits
//! ([`HostStore::run_rows_bits`]). The conversions are `ops::half_rows`' (fugu-rows'
//! SVE kernels on a CPU with SVE).

use super::host_buf::HostBuf;
use super::{BufId, Span};
use crate::dtype::Dtype;
use crate::ops::half_rows;
use anyhow::Result;
use fugu_gemm::half::slice::HalfBitsSliceExt;
use fugu_gemm::half::{bf16, f16};
use rayon::prelude::*;
use std::ops::Range;
use std::sync::Mutex;

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
    /// Row chunks' stages ([`HostStore::run_rows`]), one per chunk in flight, reused: small
    /// ones for [`Chunks::Cache`], and the one of the [`Chunks::Serial`] chunk in flight (kept
    /// apart, so that the large GEMM chunks grow one buffer, not every small one in turn).
    chunk_stages: Mutex<Vec<Vec<f32>>>,
    serial_stage: Mutex<Vec<Vec<f32>>>,
}

/// A span an op reads or writes in rows of `width` elements (`n · width` in all), or reads
/// whole for every row (`width` 0: a weight, a bias, a table).
#[derive(Clone, Copy, Debug)]
pub struct Rows {
    pub span: Span,
    pub width: usize,
    /// A written span whose elements the op sets before it reads them, or leaves to be set
    /// before anything reads them: its 16-bit rows are not decoded into the stage first.
    pub overwritten: bool,
}

impl Rows {
    pub fn of(span: Span, width: usize) -> Rows {
        Rows {
            span,
            width,
            overwritten: false,
        }
    }

    /// Read whole by every row.
    pub fn whole(span: Span) -> Rows {
        Rows::of(span, 0)
    }

    /// Written rows of `width` that the op overwrites without reading them first (where it
    /// writes nothing, the stage's stale values are stored: only for spans whose unwritten
    /// elements nothing reads before another op sets them).
    pub fn overwritten(span: Span, width: usize) -> Rows {
        Rows {
            overwritten: true,
            ..Rows::of(span, width)
        }
    }

    /// Rows `rows` of this span (all of it when whole).
    fn part(self, rows: &Range<usize>) -> Span {
        match self.width {
            0 => self.span,
            w => self.span.sub(rows.start * w, (rows.end - rows.start) * w),
        }
    }
}

/// About how many elements of its widest span a row chunk holds ([`HostStore::run_rows`]):
/// with the chunk's other spans, a few hundred KiB, in the core's L2 while the op runs. A
/// multiple of 64, so that chunks of an elementwise op (rows of one element) start on whole
/// SIMD vectors and the op meets its tail where it would whole.
pub const ROW_CHUNK: usize = 1 << 14;

/// A GEMM operand as it is stored: fugu-gemm packs 16-bit values as they are, so a GEMM
/// reads them without the stage ([`HostStore::run_rows_stored`]).
#[derive(Clone, Copy, Debug)]
pub enum Stored<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    F16(&'a [f16]),
}

/// A span to write as it is stored ([`HostStore::run_stored`]).
#[derive(Debug)]
pub enum StoredMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
    F16(&'a mut [f16]),
}

/// The elements of span `s` of the buffer at `base` (its 16-bit type, or `None`: f32), as
/// stored.
///
/// # Safety
/// `s` lies inside that buffer, and nothing writes its elements while the slice lives.
unsafe fn stored<'a>((Addr(base), dt): (Addr, Option<Dtype>), s: Span) -> Stored<'a> {
    // SAFETY: the caller's promise.
    unsafe {
        match dt {
            None => Stored::F32(std::slice::from_raw_parts(
                (base as *const f32).add(s.offset),
                s.len,
            )),
            Some(dt) => {
                let bits = std::slice::from_raw_parts((base as *const u16).add(s.offset), s.len);
                match dt {
                    Dtype::Bf16 => Stored::Bf16(bits.reinterpret_cast()),
                    _ => Stored::F16(bits.reinterpret_cast()),
                }
            }
        }
    }
}

/// [`stored`] to write.
///
/// # Safety
/// `s` lies inside that buffer, and nothing else reads or writes its elements while the slice
/// lives.
unsafe fn stored_mut<'a>((Addr(base), dt): (Addr, Option<Dtype>), s: Span) -> StoredMut<'a> {
    // SAFETY: the caller's promise.
    unsafe {
        match dt {
            None => StoredMut::F32(std::slice::from_raw_parts_mut(
                (base as *mut f32).add(s.offset),
                s.len,
            )),
            Some(dt) => {
                let bits = std::slice::from_raw_parts_mut((base as *mut u16).add(s.offset), s.len);
                match dt {
                    Dtype::Bf16 => StoredMut::Bf16(bits.reinterpret_cast_mut()),
                    _ => StoredMut::F16(bits.reinterpret_cast_mut()),
                }
            }
        }
    }
}

/// How [`HostStore::run_rows`] cuts an op's rows into chunks where it stages them.
#[derive(Clone, Copy, Debug)]
pub enum Chunks {
    /// About [`ROW_CHUNK`] elements of the widest span per chunk (at least one row), the
    /// chunks in parallel: row-wise ops, their chunks in cache.
    Cache,
    /// This many rows per chunk (the last one fewer), the chunks in parallel: row-wise ops
    /// whose rows go in fixed blocks (a reduction's partial sums, `ops::ROW_BLOCK`).
    Rows(usize),
    /// At least this many rows per chunk (the rows split evenly), one chunk after another:
    /// GEMMs (fugu-gemm's threads work on one at a time; enough rows to amortise packing the
    /// operand every chunk shares, and to keep the GEMM's sums those of the whole).
    Serial(usize),
}

impl Chunks {
    /// How `n` rows are cut, `widest` elements in the op's widest row: the number of chunks,
    /// and where chunk `c` starts (chunk `c` holds rows `start(c)..start(c + 1)`).
    fn cut(self, n: usize, widest: usize) -> (usize, impl Fn(usize) -> usize) {
        let per = match self {
            Chunks::Cache => (ROW_CHUNK / widest.max(1)).max(1),
            Chunks::Rows(rows) => rows.max(1),
            Chunks::Serial(_) => 0,
        };
        let count = match self {
            Chunks::Cache | Chunks::Rows(_) => n.div_ceil(per),
            Chunks::Serial(rows) => (n / rows.max(1)).max(1),
        };
        let start = move |c: usize| match self {
            Chunks::Cache | Chunks::Rows(_) => (c * per).min(n),
            Chunks::Serial(_) => c * n / count,
        };
        (count, start)
    }
}

/// An address shared with the threads of a parallel loop.
#[derive(Clone, Copy)]
struct Addr(usize);

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

    /// Bytes of the stages (grown to the largest op's whole 16-bit spans so far, and the
    /// row chunks').
    pub fn stage_bytes(&self) -> usize {
        let held = |m: &Mutex<Vec<Vec<f32>>>| -> usize {
            let bufs = m.lock().unwrap_or_else(|e| e.into_inner());
            bufs.iter().map(Vec::capacity).sum()
        };
        4 * (self.stage.len() + held(&self.chunk_stages) + held(&self.serial_stage))
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

    /// `dst = src`, rounded to `dst`'s type: bits copied as they are between spans of one
    /// type, f32 rounded straight into a 16-bit span and 16-bit values widened straight into
    /// an f32 one (no stage: the compute copy of the weights is refreshed this way); only
    /// between the two 16-bit types through the stage.
    pub fn copy(&mut self, dst: Span, src: Span) {
        assert_eq!(dst.len, src.len, "copy: span lengths differ");
        self.check_call(&[dst], &[src]);
        let (dd, ds) = (self.dtype(dst.buf), self.dtype(src.buf));
        if dst.buf == src.buf {
            match &mut self.bufs[dst.buf.0 as usize] {
                Store::F32(b) => b.as_mut_slice().copy_within(src.range(), dst.offset),
                Store::Bits16(b) => b.as_mut_slice().copy_within(src.range(), dst.offset),
            }
            return;
        }
        match self.two(dst.buf, src.buf) {
            (Store::F32(d), Store::F32(s)) => {
                d.as_mut_slice()[dst.range()].copy_from_slice(&s.as_slice()[src.range()])
            }
            (Store::Bits16(d), Store::Bits16(s)) if dd == ds => {
                d.as_mut_slice()[dst.range()].copy_from_slice(&s.as_slice()[src.range()])
            }
            (Store::Bits16(d), Store::F32(s)) => encode(
                dd,
                &s.as_slice()[src.range()],
                &mut d.as_mut_slice()[dst.range()],
            ),
            (Store::F32(d), Store::Bits16(s)) => decode(
                ds,
                &s.as_slice()[src.range()],
                &mut d.as_mut_slice()[dst.range()],
            ),
            (Store::Bits16(_), Store::Bits16(_)) => {
                self.run([dst], [src], |[d], [s]| d.copy_from_slice(s))
            }
        }
    }

    /// Buffer `dst` to write and buffer `src` to read (two different buffers).
    fn two(&mut self, dst: BufId, src: BufId) -> (&mut Store, &Store) {
        let (d, s) = (dst.0 as usize, src.0 as usize);
        assert_ne!(d, s, "two: the same buffer");
        if d < s {
            let (lo, hi) = self.bufs.split_at_mut(s);
            (&mut lo[d], &hi[0])
        } else {
            let (lo, hi) = self.bufs.split_at_mut(d);
            (&mut hi[0], &lo[s])
        }
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
        self.check_call(&w, &r);
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
        self.grow_stage(end);
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

    /// Runs `op` once on the spans it writes (`w`) and reads (`r`) as they are stored, 16-bit
    /// ones as bits (no stage): for ops that read and write each type themselves (fugu-gemm's
    /// `gemm_into`). Panics as [`Self::run`] does.
    pub fn run_stored<const W: usize, const R: usize>(
        &mut self,
        w: [Span; W],
        r: [Span; R],
        op: impl for<'a> FnOnce([StoredMut<'a>; W], [Stored<'a>; R]),
    ) {
        self.check_call(&w, &r);
        let bases = self.bases();
        // SAFETY: every span lies inside its buffer (checked above); no written span overlaps
        // another span of the call, so each written slice is the only view of its elements
        // and the read ones are only read. The slices borrow `self` mutably and cannot
        // outlive `op` (its signature).
        let wm: [StoredMut; W] =
            std::array::from_fn(|i| unsafe { stored_mut(bases[w[i].buf.0 as usize], w[i]) });
        // SAFETY: as above.
        let rm: [Stored; R] =
            std::array::from_fn(|i| unsafe { stored(bases[r[i].buf.0 as usize], r[i]) });
        op(wm, rm)
    }

    /// Runs `op` over `n` rows of the spans it writes (`w`, read first) and reads (`r`), as
    /// [`Self::run`] does, but in chunks of rows ([`Chunks`]) where a row span is 16-bit:
    /// each chunk's rows are decoded into a small stage of its own, the op runs on them, and
    /// the written rows are rounded back while they are in cache, so a 16-bit row costs its
    /// 16-bit bytes in memory traffic and the stage stays small. `op` gets the chunk's rows
    /// and its views (whole spans whole); it must compute each row from that row alone, as
    /// the row-wise ops do, so that chunks give the same values as one call. With no 16-bit
    /// row span it runs once on every row ([`Self::run`]).
    pub fn run_rows<const W: usize, const R: usize>(
        &mut self,
        chunks: Chunks,
        n: usize,
        w: [Rows; W],
        r: [Rows; R],
        op: impl for<'a> Fn(Range<usize>, [&'a mut [f32]; W], [&'a [f32]; R]) + Sync,
    ) {
        self.run_rows_stored(chunks, n, w, r, [], |rows, wv, rv, []| op(rows, wv, rv));
    }

    /// [`Self::run_rows`] with GEMM operands `g` too, read as they are stored ([`Stored`]:
    /// never staged), by rows or whole like the others; always in chunks.
    pub fn run_rows_stored<const W: usize, const R: usize, const G: usize>(
        &mut self,
        chunks: Chunks,
        n: usize,
        w: [Rows; W],
        r: [Rows; R],
        g: [Rows; G],
        op: impl for<'a> Fn(Range<usize>, [&'a mut [f32]; W], [&'a [f32]; R], [Stored<'a>; G]) + Sync,
    ) {
        for x in w.iter().chain(&r).chain(&g) {
            assert!(
                x.width == 0 || x.span.len == n * x.width,
                "rows: {:?} is not {n} rows of {}",
                x.span,
                x.width
            );
        }
        assert!(
            w.iter().all(|x| x.width > 0),
            "rows: a written span is whole"
        );
        let chunked = G > 0
            || w.iter()
                .chain(&r)
                .any(|x| x.width > 0 && self.is_16bit(x.span));
        if !chunked || n == 0 {
            return self.run(w.map(|x| x.span), r.map(|x| x.span), |wv, rv| {
                op(0..n, wv, rv, [(); G].map(|_| Stored::F32(&[])))
            });
        }
        let read: Vec<Span> = r.iter().chain(&g).map(|x| x.span).collect();
        self.check_call(&w.map(|x| x.span), &read);
        // Whole 16-bit spans: decoded once into the stage, shared by every chunk.
        let mut end = 0usize;
        let whole_at: [Option<usize>; R] = std::array::from_fn(|i| {
            (r[i].width == 0 && self.is_16bit(r[i].span)).then(|| {
                let at = end.next_multiple_of(SLOT_ALIGN) + r[i].span.offset % SLOT_ALIGN;
                end = at + r[i].span.len;
                at
            })
        });
        self.grow_stage(end);
        for (x, at) in r.iter().zip(&whole_at) {
            if let (Some(at), Store::Bits16(b)) = (at, &self.bufs[x.span.buf.0 as usize]) {
                let dt = self.dtypes[x.span.buf.0 as usize];
                let dst = &mut self.stage.as_mut_slice()[*at..*at + x.span.len];
                decode(dt, &b.as_slice()[x.span.range()], dst);
            }
        }
        let stage = Addr(self.stage.as_mut_slice().as_mut_ptr() as usize);
        let bases = self.bases();
        let widest = w
            .iter()
            .chain(&r)
            .chain(&g)
            .map(|x| x.width)
            .max()
            .unwrap_or(1);
        let (count, bound) = chunks.cut(n, widest);
        // Chunks run in parallel, each converting its rows alone; or one after another, each
        // converting its rows in parallel pieces.
        let (pool, convert) = match chunks {
            Chunks::Cache | Chunks::Rows(_) => (&self.chunk_stages, Convert::Serial),
            Chunks::Serial(_) => (&self.serial_stage, Convert::Parallel),
        };
        let one_chunk = |c: usize| {
            let rows = bound(c)..bound(c + 1);
            let mut own = pool
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop()
                .unwrap_or_default();
            // This chunk's 16-bit row spans: their slots in `own`.
            let mut used = 0usize;
            let mut slot = |x: &Rows| -> Option<usize> {
                (x.width > 0 && bases[x.span.buf.0 as usize].1.is_some()).then(|| {
                    let s = x.part(&rows);
                    let at = used.next_multiple_of(SLOT_ALIGN) + s.offset % SLOT_ALIGN;
                    used = at + s.len;
                    at
                })
            };
            let w_at: [Option<usize>; W] = std::array::from_fn(|i| slot(&w[i]));
            let r_at: [Option<usize>; R] = std::array::from_fn(|i| slot(&r[i]));
            if own.len() < used {
                own.reserve_exact(used - own.len());
                own.resize(used, 0.0);
            }
            let bits = |s: Span| {
                let (Addr(base), _) = bases[s.buf.0 as usize];
                // SAFETY: `s` lies inside its 16-bit buffer (checked above); the chunks'
                // rows are disjoint, and no written span overlaps another span of the call,
                // so no other thread writes these elements while this one reads them.
                unsafe { std::slice::from_raw_parts((base as *const u16).add(s.offset), s.len) }
            };
            for (x, at) in w.iter().zip(&w_at).chain(r.iter().zip(&r_at)) {
                if let (Some(at), false) = (*at, x.overwritten) {
                    let s = x.part(&rows);
                    let dt = bases[s.buf.0 as usize].1.expect("16-bit");
                    convert.decode(dt, bits(s), &mut own[at..at + s.len]);
                }
            }
            let own_ptr = own.as_mut_ptr();
            let at = |x: &Rows, slot: Option<usize>, whole: Option<usize>| -> *mut f32 {
                let s = x.part(&rows);
                match (slot, whole) {
                    // SAFETY: slots lie inside `own` (resized to `used` above).
                    (Some(at), _) => unsafe { own_ptr.add(at) },
                    // SAFETY: whole slots lie inside the stage (grown to `end` above).
                    (None, Some(at)) => unsafe { (stage.0 as *mut f32).add(at) },
                    // SAFETY: an f32 span, checked to lie inside its buffer.
                    (None, None) => unsafe {
                        (bases[s.buf.0 as usize].0 .0 as *mut f32).add(s.offset)
                    },
                }
            };
            // SAFETY: each written part is this chunk's rows of a written span (or their
            // slots in this chunk's own stage): disjoint from every other chunk's, from the
            // other spans of the call (checked above) and from each other; read parts are
            // only read while the op runs. The slices cannot outlive `op` (its signature).
            let wm: [&mut [f32]; W] = std::array::from_fn(|i| unsafe {
                std::slice::from_raw_parts_mut(at(&w[i], w_at[i], None), w[i].part(&rows).len)
            });
            // SAFETY: as above.
            let rm: [&[f32]; R] = std::array::from_fn(|i| unsafe {
                std::slice::from_raw_parts(at(&r[i], r_at[i], whole_at[i]), r[i].part(&rows).len)
            });
            // SAFETY: each part lies inside its buffer (checked above) and is only read while
            // the op runs: no written span overlaps it.
            let gm: [Stored; G] = std::array::from_fn(|i| {
                let s = g[i].part(&rows);
                unsafe { stored(bases[s.buf.0 as usize], s) }
            });
            op(rows.clone(), wm, rm, gm);
            for (x, at) in w.iter().zip(&w_at) {
                if let Some(at) = *at {
                    let s = x.part(&rows);
                    let (Addr(base), dt) = bases[s.buf.0 as usize];
                    // SAFETY: this chunk's rows of a written 16-bit span: inside the buffer,
                    // and written by this thread alone (as above).
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut((base as *mut u16).add(s.offset), s.len)
                    };
                    convert.encode(dt.expect("16-bit"), &own[at..at + s.len], dst);
                }
            }
            pool.lock().unwrap_or_else(|e| e.into_inner()).push(own);
        };
        match chunks {
            Chunks::Cache | Chunks::Rows(_) => (0..count).into_par_iter().for_each(one_chunk),
            Chunks::Serial(_) => (0..count).for_each(one_chunk),
        }
    }

    /// Runs a row-wise op on rows of one 16-bit type as they are stored (bits, no stage): `op`
    /// gets the type, the chunk's rows and their parts of every span, in chunks of about
    /// [`ROW_CHUNK`] elements of the widest (at least one row), the chunks in parallel; for
    /// kernels that read and write 16-bit values themselves (`ops::half_rows`), so that a
    /// row costs its 16-bit bytes and no more (an elementwise op: rows of one element).
    /// Returns `false`, running nothing, unless every span is of one 16-bit type (the caller
    /// then runs its f32 op through [`Self::run_rows`]).
    ///
    /// Panics as [`Self::run_rows`] does, and if a span is whole (`width` 0).
    pub fn run_rows_bits<const W: usize, const R: usize>(
        &mut self,
        n: usize,
        w: [Rows; W],
        r: [Rows; R],
        op: impl for<'a> Fn(Range<usize>, Dtype, [&'a mut [u16]; W], [&'a [u16]; R]) + Sync,
    ) -> bool {
        let Some(first) = w.first() else {
            return false;
        };
        let dt = self.dtype(first.span.buf);
        if dt == Dtype::F32 || w.iter().chain(&r).any(|x| self.dtype(x.span.buf) != dt) {
            return false;
        }
        if n == 0 {
            return true;
        }
        self.check_call(&w.map(|x| x.span), &r.map(|x| x.span));
        for x in w.iter().chain(&r) {
            assert!(
                x.width > 0 && x.span.len == n * x.width,
                "rows: {:?} is not {n} rows of {}",
                x.span,
                x.width
            );
        }
        let bases: Vec<Addr> = self
            .bufs
            .iter_mut()
            .map(|b| match b {
                Store::Bits16(b) => Addr(b.as_mut_slice().as_mut_ptr() as usize),
                Store::F32(_) => Addr(0),
            })
            .collect();
        let widest = w.iter().chain(&r).map(|x| x.width).max().unwrap_or(1);
        let (count, start) = Chunks::Cache.cut(n, widest);
        (0..count).into_par_iter().for_each(|c| {
            let rows = start(c)..start(c + 1);
            // SAFETY: every span lies inside its 16-bit buffer (checked above), these rows
            // of each inside it; no written span overlaps another span of the call, and the
            // chunks' rows are disjoint, so each written part is this task's alone and no
            // task writes what another reads. The slices cannot outlive `op`.
            let wm: [&mut [u16]; W] = std::array::from_fn(|i| unsafe {
                let s = w[i].part(&rows);
                std::slice::from_raw_parts_mut(
                    (bases[s.buf.0 as usize].0 as *mut u16).add(s.offset),
                    s.len,
                )
            });
            // SAFETY: as above (read only).
            let rm: [&[u16]; R] = std::array::from_fn(|i| unsafe {
                let s = r[i].part(&rows);
                std::slice::from_raw_parts(
                    (bases[s.buf.0 as usize].0 as *const u16).add(s.offset),
                    s.len,
                )
            });
            op(rows, dt, wm, rm);
        });
        true
    }

    /// Panics unless every span lies inside its buffer and no written span overlaps another
    /// span of the call (reads may overlap each other).
    /// Each buffer's first element, and its 16-bit type (`None`: f32).
    fn bases(&mut self) -> Vec<(Addr, Option<Dtype>)> {
        self.bufs
            .iter_mut()
            .zip(&self.dtypes)
            .map(|(b, &dt)| match b {
                Store::F32(b) => (Addr(b.as_mut_slice().as_mut_ptr() as usize), None),
                Store::Bits16(b) => (Addr(b.as_mut_slice().as_mut_ptr() as usize), Some(dt)),
            })
            .collect()
    }

    fn check_call(&self, written: &[Span], read: &[Span]) {
        self.check(written);
        self.check(read);
        for (i, a) in written.iter().enumerate() {
            for b in written.iter().skip(i + 1).chain(read) {
                assert!(!a.overlaps(*b), "written span {a:?} overlaps {b:?}");
            }
        }
    }

    /// Grows the stage to at least `len` floats (its old contents are not kept).
    fn grow_stage(&mut self, len: usize) {
        if self.stage.len() < len {
            self.stage = HostBuf::default();
            self.stage = HostBuf::zeroed(len).unwrap_or_else(|e| {
                panic!("staging {len} floats of 16-bit spans for an op: {e:#}")
            });
        }
    }

    fn is_16bit(&self, s: Span) -> bool {
        matches!(self.bufs[s.buf.0 as usize], Store::Bits16(_))
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

/// `dst` = the `f32` values of the `dt` bits in `src` (exact), in parallel pieces.
fn decode(dt: Dtype, src: &[u16], dst: &mut [f32]) {
    src.par_chunks(CONVERT_PIECE)
        .zip(dst.par_chunks_mut(CONVERT_PIECE))
        .for_each(|(s, d)| decode_serial(dt, s, d));
}

/// `dst` = `src` rounded to `dt` (nearest even), as bits, in parallel pieces.
fn encode(dt: Dtype, src: &[f32], dst: &mut [u16]) {
    src.par_chunks(CONVERT_PIECE)
        .zip(dst.par_chunks_mut(CONVERT_PIECE))
        .for_each(|(s, d)| encode_serial(dt, s, d));
}

/// How a chunk converts its rows: on its own thread, or in parallel pieces.
#[derive(Clone, Copy)]
enum Convert {
    Serial,
    Parallel,
}

impl Convert {
    fn decode(self, dt: Dtype, src: &[u16], dst: &mut [f32]) {
        match self {
            Convert::Serial => decode_serial(dt, src, dst),
            Convert::Parallel => decode(dt, src, dst),
        }
    }

    fn encode(self, dt: Dtype, src: &[f32], dst: &mut [u16]) {
        match self {
            Convert::Serial => encode_serial(dt, src, dst),
            Convert::Parallel => encode(dt, src, dst),
        }
    }
}

fn decode_serial(dt: Dtype, src: &[u16], dst: &mut [f32]) {
    half_rows::widen(dt, src, dst);
}

fn encode_serial(dt: Dtype, src: &[f32], dst: &mut [u16]) {
    half_rows::round(dt, src, dst);
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

    /// 16-bit rows as stored: every row reaches the op once, with its index, in chunks of
    /// rows of several widths (rows of one element: an elementwise op); any f32 span or
    /// other 16-bit type among the spans runs nothing.
    #[test]
    fn rows_as_bits_cover_the_spans_and_refuse_mixed_types() {
        // More than two chunks, spans at odd offsets: each output element is its input's bits
        // plus the other input's plus its row's index mod 64 (finite values of either type),
        // so a row out of place or missed shows.
        for (n, c) in [(2 * ROW_CHUNK + 77, 1), (3 * ROW_CHUNK / 100 + 5, 100)] {
            let len = n * c;
            for dt in [Dtype::Bf16, Dtype::F16] {
                let mut st = HostStore::default();
                let a = st.alloc(len + 5, dt).unwrap();
                let b = st.alloc(len + 3, dt).unwrap();
                let out = st.alloc(len + 1, dt).unwrap();
                let (sa, sb, so) = (span(a, 5, len), span(b, 3, len), span(out, 1, len));
                let pattern =
                    |k: usize| -> Vec<f32> { (0..len).map(|i| ((i * k) % 251) as f32).collect() };
                st.upload(sa, &pattern(3));
                st.upload(sb, &pattern(5));
                let rows = |s| Rows::of(s, c);
                let ran =
                    st.run_rows_bits(n, [rows(so)], [rows(sa), rows(sb)], |rs, t, [o], [x, y]| {
                        assert_eq!(t, dt);
                        assert_eq!(o.len(), rs.len() * c);
                        for (j, ((o, &x), &y)) in o.iter_mut().zip(x).zip(y).enumerate() {
                            let row = ((rs.start + j / c) % 64) as u16;
                            *o = x.wrapping_add(y).wrapping_add(row);
                        }
                    });
                assert!(ran, "{dt:?}");
                let bits = |s: Span| -> Vec<u16> {
                    let mut v = vec![0.0f32; len];
                    st.download(s, &mut v);
                    let mut h = vec![0u16; len];
                    half_rows::round(dt, &v, &mut h);
                    h
                };
                let want: Vec<u16> = bits(sa)
                    .iter()
                    .zip(bits(sb))
                    .enumerate()
                    .map(|(j, (&x, y))| x.wrapping_add(y).wrapping_add((j / c % 64) as u16))
                    .collect();
                assert_eq!(bits(so), want, "{dt:?} rows of {c}");
                // An f32 span, or another 16-bit type, among them: nothing runs.
                let f = st.alloc(len, Dtype::F32).unwrap();
                let other_dt = if dt == Dtype::F16 {
                    Dtype::Bf16
                } else {
                    Dtype::F16
                };
                let other = st.alloc(len, other_dt).unwrap();
                for s in [span(f, 0, len), span(other, 0, len)] {
                    let never = |_, _, _: [&mut [u16]; 1], _: [&[u16]; 1]| panic!("ran");
                    assert!(!st.run_rows_bits(n, [rows(so)], [rows(s)], never));
                    assert!(!st.run_rows_bits(n, [rows(s)], [rows(sa)], never));
                }
            }
        }
    }

    #[test]
    fn row_chunks_equal_one_call() {
        let (n, c) = (1000, 37);
        // Each output row: input row scaled by the whole vector, plus the row's own sum.
        let op = |o: &mut [f32], x: &[f32], g: &[f32]| {
            for (o, x) in o.chunks_exact_mut(c).zip(x.chunks_exact(c)) {
                let sum: f32 = x.iter().sum();
                for ((o, &x), &g) in o.iter_mut().zip(x).zip(g) {
                    *o = x * g + sum;
                }
            }
        };
        for dt in [Dtype::Bf16, Dtype::F16] {
            let mut st = HostStore::default();
            let x = st.alloc(n * c, dt).unwrap();
            let g = st.alloc(c, dt).unwrap();
            let outs: Vec<BufId> = (0..6).map(|_| st.alloc(n * c, dt).unwrap()).collect();
            let xs: Vec<f32> = (0..n * c)
                .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 97.0)
                .collect();
            let gs: Vec<f32> = (0..c).map(|i| 0.5 + i as f32 / 19.0).collect();
            st.upload(span(x, 0, n * c), &xs);
            st.upload(span(g, 0, c), &gs);
            let (xr, gr) = (span(x, 0, n * c), span(g, 0, c));
            st.run([span(outs[0], 0, n * c)], [xr, gr], |[o], [x, g]| {
                op(o, x, g)
            });
            // Written rows decoded first, then (the op sets every element) not decoded.
            let kinds = [
                Rows::of,
                Rows::of,
                Rows::overwritten,
                Rows::overwritten,
                Rows::of,
            ];
            let mut chunkings = [Chunks::Cache, Chunks::Serial(7)].repeat(2);
            chunkings.push(Chunks::Rows(64));
            for (k, (chunks, rows)) in chunkings.into_iter().zip(kinds).enumerate() {
                let w = [rows(span(outs[k + 1], 0, n * c), c)];
                st.run_rows(
                    chunks,
                    n,
                    w,
                    [Rows::of(xr, c), Rows::whole(gr)],
                    |rs, [o], [x, g]| {
                        if let Chunks::Rows(k) = chunks {
                            assert!(rs.start % k == 0 && rs.len() <= k, "{rs:?}: blocks of {k}");
                        }
                        op(o, x, g)
                    },
                );
            }
            let get = |st: &HostStore, b| {
                let mut v = vec![0.0f32; n * c];
                st.download(span(b, 0, n * c), &mut v);
                v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            assert_eq!(get(&st, outs[0]), get(&st, outs[1]), "{dt:?} cache chunks");
            assert_eq!(get(&st, outs[0]), get(&st, outs[2]), "{dt:?} serial chunks");
            assert_eq!(
                get(&st, outs[0]),
                get(&st, outs[3]),
                "{dt:?} cache, overwritten"
            );
            assert_eq!(
                get(&st, outs[0]),
                get(&st, outs[4]),
                "{dt:?} serial, overwritten"
            );
            assert_eq!(get(&st, outs[0]), get(&st, outs[5]), "{dt:?} rows of 64");
            // Elementwise, in place: rows of one element.
            let e = span(outs[1], 0, n * c);
            st.run_rows(
                Chunks::Cache,
                n * c,
                [Rows::of(e, 1)],
                [Rows::of(xr, 1)],
                |_, [o], [x]| o.iter_mut().zip(x).for_each(|(o, &x)| *o -= x),
            );
            st.run([span(outs[0], 0, n * c)], [xr], |[o], [x]| {
                o.iter_mut().zip(x).for_each(|(o, &x)| *o -= x)
            });
            assert_eq!(get(&st, outs[0]), get(&st, outs[1]), "{dt:?} elementwise");
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

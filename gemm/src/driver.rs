//! The BLIS five-loop driver (jc, pc, ic, jr, ir) for one GEMM, sequential or on one domain's
//! worker team (`team.rs`). See `docs/KERNELS.md` for the loop structure and packed layouts.

use crate::blocking::Blocking;
use crate::buffer::{with_thread_a, with_thread_b, with_thread_c, AlignedBuf, SharedPanels};
use crate::into::Target;
use crate::kernel::{Kernel, Side};
use crate::pack::{pack_one_panel, pack_panels, PanelFormat};
use crate::precision::Precision;
use crate::raw::{RawMat, RawMatMut};
use crate::team::{split_range, Member, Team};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

/// Largest `mr × nr` tile any kernel may use (the SVE f16 kernel at 2048 bits: 256 × 10).
pub(crate) const MAX_TILE: usize = 256 * 16;

/// One validated GEMM: `C := alpha·A·B + beta·C` with A m×k, B k×n, C m×n, or into a D
/// (`Dest::Into`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Problem {
    pub alpha: f32,
    pub a: RawMat,
    pub b: RawMat,
    pub beta: f32,
    pub c: Dest,
}

/// Where a problem's sums go.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Dest {
    /// An `f32` C, updated in place: each k block of the product is added onto it.
    F32(RawMatMut),
    /// A D of any storage, written once from `f32` tiles ([`Target`]); `beta` scales its `c`.
    Into(Target),
}

impl Dest {
    fn shape(&self) -> (usize, usize, usize, usize) {
        match self {
            Dest::F32(c) => (c.rows, c.cols, c.rs, c.cs),
            Dest::Into(t) => (t.d.rows, t.d.cols, t.d.rs, t.d.cs),
        }
    }

    fn t(self) -> Dest {
        match self {
            Dest::F32(c) => Dest::F32(c.t()),
            Dest::Into(t) => Dest::Into(t.t()),
        }
    }

    fn block(self, r0: usize, c0: usize, rows: usize, cols: usize) -> Dest {
        match self {
            Dest::F32(c) => Dest::F32(c.block(r0, c0, rows, cols)),
            Dest::Into(t) => Dest::Into(t.block(r0, c0, rows, cols)),
        }
    }

    /// The `f32` C of a problem that is not `Into` (the loops below add onto it in place).
    fn f32(self) -> RawMatMut {
        match self {
            Dest::F32(c) => c,
            Dest::Into(_) => unreachable!("an Into problem runs by tiles (with_f32_c)"),
        }
    }
}

/// How the threads of one domain share a GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitMode {
    /// Each thread packs its own Ã block and owns a range of `ic` (private L2 per core: x86).
    Ic,
    /// The domain packs one shared Ã block and its threads split the `jr` loop (one L2 shared
    /// by the domain's cores: A64FX CMGs).
    Jr,
}

/// Kernel, precision and block sizes the driver runs with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx {
    pub kernel: Kernel,
    /// What the operands are rounded to when packed (see [`Precision`]).
    pub prec: Precision,
    /// Block sizes in packed words (a word is one `f32` or one bf16 pair along k).
    pub blk: Blocking,
    /// L1 data cache and last-level cache of one domain, in bytes (0: unknown / none), for
    /// [`Ctx::blocking_for`].
    pub l1d: usize,
    pub llc: usize,
    /// `FUGU_GEMM_KC` was given: use `blk.kc` as is, in elements.
    pub kc_fixed: bool,
}

impl Ctx {
    /// How this context's panels are packed.
    pub fn format(&self) -> PanelFormat {
        PanelFormat {
            operand: self.kernel.operand,
            prec: self.prec,
        }
    }

    /// Block sizes for one m×n×k problem, kc in elements of k: the cache-derived ones (kc
    /// counts words, so a bf16-pair kernel's kc covers twice the elements), except that when C
    /// is larger than the last-level cache and a B̃ micro-panel of the whole k (k × nr) still
    /// fits in L1, k is done in one block. Each pc pass reads and writes all of C from memory, so this
    /// divides C's traffic by the number of passes; on Zen 5 it gained about 5% on the LM
    /// head's weight-gradient GEMM (C is 50304 × 768). With the analytical kc (320 on Zen 3)
    /// the old bound "k ≤ 2·kc" left the GPT-2 LM head (k = 768, C of 256 × 50304) at three
    /// passes: `cargo bench --bench train -- --threads 2` at B=4 T=64 went from 1380 ms/step
    /// (old kc 672, one pass) to 1528–1557 ms, and back to 1407 ms with this bound (Zen 3 VM,
    /// single noisy runs). That one block relies on B̃ staying in L1 (an Ã micro-panel of the
    /// whole k does not fit), so it also runs with `nb = nr`, one B̃ micro-panel under the whole
    /// Ã block, whatever the kernel's [`Kernel::l1_panel`]: on Zen 4 (AVX2, k = 1024) that
    /// measured 2.5–3.5% faster than kc = 320 with Ã in L1 (`examples/blocking`, two runs).
    /// Last, each of kc, mc and nc is [`balanced`] over its dimension.
    pub fn blocking_for(&self, m: usize, n: usize, k: usize) -> Blocking {
        let mut b = self.blk;
        if self.kc_fixed {
            return b;
        }
        b.kc *= self.kernel.operand.k_per_word();
        let c_bytes = m.saturating_mul(n).saturating_mul(4);
        if self.llc > 0
            && c_bytes > self.llc
            && k > b.kc
            && self.kernel.operand.panel_words(Side::B, k, self.kernel.nr) * 4 <= self.l1d
        {
            b.kc = k;
            b.nb = self.kernel.nr;
        }
        b.kc = balanced(k, b.kc, 8);
        b.mc = balanced(m, b.mc, self.kernel.mr);
        b.nc = balanced(n, b.nc, self.kernel.nr);
        b
    }
}

/// The block size that cuts `len` into as many blocks as `block` does, but of nearly equal
/// sizes (rounded up to `unit`, never above `block`): with the cache-derived kc = 320 a k of
/// 1024 (every GPT-2 weight gradient at B·T = 1024) ran as 320 + 320 + 320 + 64, the last pass
/// over C at kc = 64; balanced it is 4 × 256. OpenBLAS and BLIS split their remainders
/// likewise. Measured neutral within 1% on Zen 4 (`docs/KERNELS.md`, "Balanced blocks").
fn balanced(len: usize, block: usize, unit: usize) -> usize {
    if len <= block || block == 0 {
        return block;
    }
    even_block(len, len.div_ceil(block), unit, block)
}

/// The size of `blocks` nearly equal blocks covering `len`, rounded up to `unit`, at most `cap`.
fn even_block(len: usize, blocks: usize, unit: usize, cap: usize) -> usize {
    len.div_ceil(blocks).next_multiple_of(unit).min(cap)
}

impl Problem {
    pub fn m(&self) -> usize {
        self.c.shape().0
    }
    pub fn n(&self) -> usize {
        self.c.shape().1
    }
    pub fn k(&self) -> usize {
        self.a.cols
    }

    /// m·n·k, the cost used to balance batched problems.
    pub fn cost(&self) -> u128 {
        self.m() as u128 * self.n() as u128 * self.k().max(1) as u128
    }

    /// Transposes the problem when that makes C unit-stride along m (the kernel's vector
    /// dimension): `Cᵀ = Bᵀ·Aᵀ`.
    pub fn oriented(self) -> Problem {
        let (_, cols, rs, cs) = self.c.shape();
        if rs != 1 && (cs == 1 || cols == 1) {
            Problem {
                alpha: self.alpha,
                a: self.b.t(),
                b: self.a.t(),
                beta: self.beta,
                c: self.c.t(),
            }
        } else {
            self
        }
    }

    /// The sub-problem of C rows `r0 .. r0 + rows`.
    pub fn rows(self, r0: usize, rows: usize) -> Problem {
        Problem {
            a: self.a.block(r0, 0, rows, self.k()),
            c: self.c.block(r0, 0, rows, self.n()),
            ..self
        }
    }

    /// The sub-problem of C columns `c0 .. c0 + cols`.
    pub fn cols(self, c0: usize, cols: usize) -> Problem {
        Problem {
            b: self.b.block(0, c0, self.k(), cols),
            c: self.c.block(0, c0, self.m(), cols),
            ..self
        }
    }

    /// Orients the problem and finishes the cases that need no kernel (empty C; `k == 0` or
    /// `alpha == 0`, which only scale C). Returns the problem when the kernel has work.
    pub fn needs_kernel(self) -> Option<Problem> {
        let p = self.oriented();
        if p.m() == 0 || p.n() == 0 {
            return None;
        }
        if p.is_scale_only() {
            match p.c {
                Dest::F32(c) => scale_c(c, p.beta),
                Dest::Into(t) => t.store_start_only(p.beta),
            }
            return None;
        }
        Some(p)
    }

    /// True when only `C := beta·C` is left to do.
    pub fn is_scale_only(&self) -> bool {
        self.k() == 0 || self.alpha == 0.0
    }
}

/// `C := beta·C` (zeros when beta is 0, without reading C).
pub(crate) fn scale_c(c: RawMatMut, beta: f32) {
    if beta == 1.0 {
        return;
    }
    for j in 0..c.cols {
        for i in 0..c.rows {
            // SAFETY: (i, j) is inside the validated C view.
            unsafe {
                let p = c.ptr.add(i * c.rs + j * c.cs);
                *p = if beta == 0.0 { 0.0 } else { beta * *p };
            }
        }
    }
}

/// Runs the micro-kernel over the `mc × nc` block of C at `c`, for `B̃` panels `j0..j1`, the
/// packed panels holding `kcur` elements along k. The B̃ panels are taken `nb / nr` at a time,
/// each group swept by every Ã micro-panel in turn ([`Blocking::nb`]; `nb = nr`: jr outside
/// ir).
#[allow(clippy::too_many_arguments)]
fn macro_kernel(
    ctx: &Ctx,
    nb: usize,
    ap: &[f32],
    bp: &[f32],
    mcur: usize,
    ncur: usize,
    kcur: usize,
    panels: std::ops::Range<usize>,
    alpha: f32,
    beta: f32,
    c: RawMatMut,
) {
    let Kernel {
        mr,
        nr,
        func,
        operand,
        ..
    } = ctx.kernel;
    let (aw, bw) = (
        operand.panel_words(Side::A, kcur, mr),
        operand.panel_words(Side::B, kcur, nr),
    );
    let kw = operand.k_steps(kcur);
    let direct_ok = c.rs == 1 && c.cs >= mr;
    // Scratch for edge tiles, left uninitialised: zeroing 8 KiB per call measured about 2% of
    // a 64³ problem. The kernel writes all mr × nr floats before any is read (beta = 0).
    let mut tile = std::mem::MaybeUninit::<[f32; MAX_TILE]>::uninit();
    let tile = tile.as_mut_ptr() as *mut f32;
    let group = (nb / nr).max(1);
    let mut g0 = panels.start;
    while g0 < panels.end {
        let g1 = (g0 + group).min(panels.end);
        for ip in 0..mcur.div_ceil(mr) {
            let mi = mr.min(mcur - ip * mr);
            let apanel = &ap[ip * aw..(ip + 1) * aw];
            for jp in g0..g1 {
                let nj = nr.min(ncur - jp * nr);
                let bpanel = &bp[jp * bw..(jp + 1) * bw];
                let cblk = c.block(ip * mr, jp * nr, mi, nj);
                if direct_ok && mi == mr && nj == nr {
                    // SAFETY: the panels hold what a kernel call of kw steps reads (aw, bw
                    // words); the full mr×nr tile of C is inside the view, unit-stride along m
                    // with ldc = c.cs >= mr, and this thread is the only writer of this tile.
                    unsafe {
                        func(
                            kw,
                            alpha,
                            apanel.as_ptr(),
                            bpanel.as_ptr(),
                            beta,
                            cblk.ptr,
                            c.cs,
                        )
                    };
                } else {
                    // SAFETY: the scratch tile holds mr*nr <= MAX_TILE floats with ldc = mr.
                    unsafe { func(kw, 1.0, apanel.as_ptr(), bpanel.as_ptr(), 0.0, tile, mr) };
                    for j in 0..nj {
                        for r in 0..mi {
                            // SAFETY: r + j*mr < mr*nr, written by the kernel just above
                            // (contract: with beta = 0 it writes every float of the tile).
                            let v = alpha * unsafe { *tile.add(r + j * mr) };
                            // SAFETY: (r, j) is inside the mi×nj block of the validated C view.
                            unsafe {
                                let p = cblk.ptr.add(r * c.rs + j * c.cs);
                                *p = if beta == 0.0 { v } else { v + beta * *p };
                            }
                        }
                    }
                }
            }
        }
        g0 = g1;
    }
}

/// Runs one problem on the calling thread, with its thread-local packing buffers.
pub(crate) fn run_sequential(ctx: &Ctx, p: Problem) {
    let Some(p) = p.needs_kernel() else {
        return;
    };
    if let Dest::Into(_) = p.c {
        return run_tiles(ctx, p, 1, |count, tile| (0..count).for_each(tile));
    }
    let (m, n, k) = (p.m(), p.n(), p.k());
    let Kernel { mr, nr, .. } = ctx.kernel;
    let Blocking { mc, kc, nc, nb } = ctx.blocking_for(m, n, k);
    let fmt = ctx.format();
    for jc in (0..n).step_by(nc) {
        let ncur = nc.min(n - jc);
        for pc in (0..k).step_by(kc) {
            let kcur = kc.min(k - pc);
            let (aw, bw) = (
                fmt.operand.panel_words(Side::A, kcur, mr),
                fmt.operand.panel_words(Side::B, kcur, nr),
            );
            let beta = if pc == 0 { p.beta } else { 1.0 };
            with_thread_b(bw * ncur.div_ceil(nr), |bp| {
                pack_panels(fmt, Side::B, bp, p.b.block(pc, jc, kcur, ncur).t(), nr);
                for ic in (0..m).step_by(mc) {
                    let mcur = mc.min(m - ic);
                    with_thread_a(aw * mcur.div_ceil(mr), |ap| {
                        pack_panels(fmt, Side::A, ap, p.a.block(ic, pc, mcur, kcur), mr);
                        let c = p.c.f32().block(ic, jc, mcur, ncur);
                        macro_kernel(
                            ctx,
                            nb,
                            ap,
                            bp,
                            mcur,
                            ncur,
                            kcur,
                            0..ncur.div_ceil(nr),
                            p.alpha,
                            beta,
                            c,
                        );
                    })
                }
            })
        }
    }
}

/// How many tiles of C [`run_tiles`] aims to cut per member: with several, the members that
/// are running take the tiles of a member whose core is busy elsewhere.
const TILES_PER_MEMBER: usize = 4;

/// The narrowest column chunk of a tile, in B̃ micro-panels, when the members keep their
/// packed Ã: below it a tile's B̃ packing and kernel start-up stop being small beside its
/// arithmetic.
const MIN_CHUNK_PANELS: usize = 8;

/// Largest packed Ã row block (all of k) a member keeps between its tiles of that row block,
/// in bytes. Above it a member packs Ã again for each tile, and the tiles are made as wide as
/// the static split's (one column chunk per member and row block), so Ã is packed no more
/// often than before.
const KEEP_A_BYTES: usize = 8 << 20;

/// Numbers [`run_tiles`] calls, so that a member's kept Ã is never taken for another call's.
static TILE_CALLS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// A member's packed Ã row block for all of k: the call and row block it holds, and the
    /// panels, one k block after another.
    static KEPT_A: RefCell<(u64, usize, AlignedBuf)> = const {
        RefCell::new((u64::MAX, 0, AlignedBuf::empty()))
    };
}

/// The largest `f32` tile an [`Dest::Into`] problem's tile is summed in, in bytes, where its
/// members keep their packed Ã ([`KEEP_A_BYTES`]): its column chunks are cut narrow enough
/// that a thread's tile (the row block × the chunk) stays in L2 or close to it, beside the
/// packed Ã block. Otherwise the tiles, and so the `f32` tile, are those an `f32` C is cut
/// into, so that Ã (packed once per tile) is packed no more often.
const INTO_TILE_BYTES: usize = 1 << 20;

/// Runs one problem as tiles of C, a row block by a column chunk, on `threads` threads:
/// `run_items(count, tile)` calls `tile(t)` once for each `t < count`, in any order and on any
/// of them (a team's members one at a time: [`Team::run_items`]; the caller alone: in turn).
/// [`SplitMode::Ic`], and every [`Dest::Into`] problem (each tile summed in the thread's own
/// `f32` tile: [`with_f32_c`]). A member packs its own B̃ for each tile and its own Ã (private
/// L2 per core), keeping the packed Ã row block for its next tile of the same row block when
/// it fits [`KEEP_A_BYTES`]. The members never wait for each
/// other: when one is held off its core (a busy machine), the others run its tiles.
///
/// The blocking is the whole problem's, and each tile of C is summed over the same k blocks by
/// the same kernel whichever member runs it, so the result does not depend on the schedule.
fn run_tiles(
    ctx: &Ctx,
    p: Problem,
    threads: usize,
    run_items: impl FnOnce(usize, &(dyn Fn(usize) + Sync)),
) {
    let (m, n, k) = (p.m(), p.n(), p.k());
    let Kernel { mr, nr, .. } = ctx.kernel;
    let blk = ctx.blocking_for(m, n, k);
    let fmt = ctx.format();
    // Row blocks: a multiple of `threads` when there are enough rows for that.
    let n_ic_min = m.div_ceil(blk.mc);
    let n_ic = if n_ic_min >= threads {
        n_ic_min.next_multiple_of(threads)
    } else {
        n_ic_min
    };
    let mc = even_block(m, n_ic, mr, blk.mc.max(mr));
    let n_ic = m.div_ceil(mc);
    let kc = blk.kc;
    let k_blocks = k.div_ceil(kc);
    // Words of a packed Ã block of `rows` rows and `kcur` elements of k, and of all k blocks.
    let a_block_words =
        |rows: usize, kcur: usize| fmt.operand.panel_words(Side::A, kcur, mr) * rows.div_ceil(mr);
    let a_words = |rows: usize| {
        (0..k_blocks)
            .map(|b| a_block_words(rows, kc.min(k - b * kc)))
            .sum::<usize>()
    };
    let keep_a = a_words(mc) * 4 <= KEEP_A_BYTES;
    // Column chunks: within nc, at least one tile per member (as the static split had), and
    // several per member when Ã is kept.
    let npanels = n.div_ceil(nr);
    let fewest = npanels.div_ceil((blk.nc / nr).max(1));
    let one_each = threads.div_ceil(n_ic);
    let wanted = if keep_a {
        let several = (TILES_PER_MEMBER * threads).div_ceil(n_ic);
        one_each.max(several.min(npanels.div_ceil(MIN_CHUNK_PANELS)))
    } else {
        one_each
    };
    let jchunks = wanted.max(fewest).clamp(1, npanels);
    // An Into problem's tiles narrow enough for its f32 tile to stay in cache, where the
    // packed Ã is kept across them (otherwise every tile would pack its Ã again: the LM head's
    // input gradient, k = V, went from 5.4-5.6 to 5.7-7.4 s per step at B=8).
    let jchunks = match p.c {
        Dest::Into(_) if keep_a => {
            let panels_per_tile = (INTO_TILE_BYTES / (4 * mc * nr)).max(1);
            jchunks.max(npanels.div_ceil(panels_per_tile))
        }
        _ => jchunks,
    };
    let call = TILE_CALLS.fetch_add(1, SeqCst);
    run_items(n_ic * jchunks, &|t| {
        let (ib, jb) = (t / jchunks, t % jchunks);
        let (ic, panels) = (ib * mc, split_range(npanels, jchunks, jb));
        let mcur = mc.min(m - ic);
        let (jc, ncur) = (
            panels.start * nr,
            (panels.end * nr).min(n) - panels.start * nr,
        );
        with_f32_c(p.rows(ic, mcur).cols(jc, ncur), |tile| {
            if !keep_a {
                return run_block(ctx, &blk, tile, |pc, kcur, f| {
                    with_thread_a(a_block_words(mcur, kcur), |ap| {
                        pack_panels(fmt, Side::A, ap, tile.a.block(0, pc, mcur, kcur), mr);
                        f(ap)
                    })
                });
            }
            KEPT_A.with(|kept| {
                let kept = &mut *kept.borrow_mut();
                let ap = kept.2.get(a_words(mcur));
                if (kept.0, kept.1) != (call, ib) {
                    let mut at = 0;
                    for pc in (0..k).step_by(kc) {
                        let kcur = kc.min(k - pc);
                        let len = a_block_words(mcur, kcur);
                        let src = tile.a.block(0, pc, mcur, kcur);
                        pack_panels(fmt, Side::A, &mut ap[at..at + len], src, mr);
                        at += len;
                    }
                    (kept.0, kept.1) = (call, ib);
                }
                let mut at = 0;
                run_block(ctx, &blk, tile, |_, kcur, f| {
                    let len = a_block_words(mcur, kcur);
                    at += len;
                    f(&ap[at - len..at])
                });
            });
        });
    });
}

/// Runs `f` on `tile` with an `f32` C: the tile's own, or for a [`Dest::Into`] tile this
/// thread's `f32` tile holding each element's start, converted into D once `f` has added
/// every k block of the product onto it.
fn with_f32_c(tile: Problem, f: impl FnOnce(Problem)) {
    let Dest::Into(target) = tile.c else {
        return f(tile);
    };
    let (m, n) = (tile.m(), tile.n());
    with_thread_c(m * n, |buf| {
        let c = RawMatMut {
            ptr: buf.as_mut_ptr(),
            rows: m,
            cols: n,
            rs: 1,
            cs: m,
        };
        let beta = target.start(tile.beta, c);
        f(Problem {
            beta,
            c: Dest::F32(c),
            ..tile
        });
        target.store(c);
    })
}

/// Runs one tile of C (at most mc × nc) on the calling thread with the blocking `blk`: for each
/// k block, packs B̃ into the thread's buffer and takes the packed Ã block from
/// `a_block(pc, kcur, kernel)`, which calls `kernel` with it.
fn run_block(
    ctx: &Ctx,
    blk: &Blocking,
    p: Problem,
    mut a_block: impl FnMut(usize, usize, &mut dyn FnMut(&[f32])),
) {
    let (m, n, k) = (p.m(), p.n(), p.k());
    let Kernel { nr, .. } = ctx.kernel;
    let fmt = ctx.format();
    for pc in (0..k).step_by(blk.kc) {
        let kcur = blk.kc.min(k - pc);
        let bw = fmt.operand.panel_words(Side::B, kcur, nr);
        let beta = if pc == 0 { p.beta } else { 1.0 };
        with_thread_b(bw * n.div_ceil(nr), |bp| {
            pack_panels(fmt, Side::B, bp, p.b.block(pc, 0, kcur, n).t(), nr);
            a_block(pc, kcur, &mut |ap| {
                let panels = 0..n.div_ceil(nr);
                let c = p.c.f32();
                macro_kernel(ctx, blk.nb, ap, bp, m, n, kcur, panels, p.alpha, beta, c);
            });
        });
    }
}

/// Packs, on member `me`, its share of the `w`-row panels of `src` (`words` per panel) into the
/// team's `shared` block, waits at a barrier for the other members' shares, and returns the
/// whole packed block.
///
/// # Safety
/// Every member of the job calls this together with the same arguments, and passes a barrier
/// after its last read of the returned block before any member packs into `shared` again.
unsafe fn pack_together<'s>(
    me: &Member<'_>,
    shared: &'s SharedPanels<'_>,
    fmt: PanelFormat,
    side: Side,
    src: RawMat,
    w: usize,
    words: usize,
) -> &'s [f32] {
    let panels = src.rows.div_ceil(w);
    for j in me.share(panels) {
        // SAFETY: panel j is this member's alone (`share` ranges are disjoint), and nobody
        // reads the block before the barrier below nor packs into it again before the
        // caller's closing barrier.
        let panel = unsafe { shared.slice_mut(j * words..(j + 1) * words) };
        pack_one_panel(fmt, side, panel, src, j * w, w);
    }
    me.barrier();
    // SAFETY: every panel was written before the barrier above, and none is written again
    // before the caller's closing barrier (this function's contract).
    unsafe { shared.slice(0..panels * words) }
}

/// Runs one problem on `team` while the caller waits: as tiles ([`run_tiles`]) for
/// [`SplitMode::Ic`]; for [`SplitMode::Jr`] SPMD, every member walking the jc, pc and ic loops,
/// the domain's B̃ packed into `bbuf` and Ã into `abuf` (first touched by the members that
/// pack them) by [`pack_together`], with a barrier between reading a block and packing the
/// next.
pub(crate) fn run_parallel(
    ctx: &Ctx,
    p: Problem,
    team: &Team,
    split: SplitMode,
    bbuf: &mut AlignedBuf,
    abuf: &mut AlignedBuf,
) {
    let Some(p) = p.needs_kernel() else {
        return;
    };
    if split == SplitMode::Ic || matches!(p.c, Dest::Into(_)) {
        return run_tiles(ctx, p, team.size(), |count, tile| {
            team.run_items(count, |_, t| tile(t))
        });
    }
    let threads = team.size();
    let (m, n, k) = (p.m(), p.n(), p.k());
    let Kernel { mr, nr, .. } = ctx.kernel;
    let Blocking { mc, kc, nc, nb } = ctx.blocking_for(m, n, k);
    let fmt = ctx.format();
    // The shared buffers, sized for the largest block.
    let (kmax, nmax, mmax) = (kc.min(k), nc.min(n), mc.min(m));
    let bshared =
        SharedPanels::new(bbuf.get(fmt.operand.panel_words(Side::B, kmax, nr) * nmax.div_ceil(nr)));
    let ashared =
        SharedPanels::new(abuf.get(fmt.operand.panel_words(Side::A, kmax, mr) * mmax.div_ceil(mr)));
    team.run(|me| {
        for jc in (0..n).step_by(nc) {
            let ncur = nc.min(n - jc);
            let npanels = ncur.div_ceil(nr);
            for pc in (0..k).step_by(kc) {
                let kcur = kc.min(k - pc);
                let (aw, bw) = (
                    fmt.operand.panel_words(Side::A, kcur, mr),
                    fmt.operand.panel_words(Side::B, kcur, nr),
                );
                let beta = if pc == 0 { p.beta } else { 1.0 };
                let bsrc = p.b.block(pc, jc, kcur, ncur).t();
                // SAFETY: every member packs here with the same arguments, and all pass the
                // barrier that ends this pc step before B̃ is packed again.
                let bp = unsafe { pack_together(&me, &bshared, fmt, Side::B, bsrc, nr, bw) };
                for ic in (0..m).step_by(mc) {
                    let mcur = mc.min(m - ic);
                    let asrc = p.a.block(ic, pc, mcur, kcur);
                    // SAFETY: every member packs here with the same arguments, and all pass the
                    // barrier after the macro-kernels before Ã is packed again.
                    let ap = unsafe { pack_together(&me, &ashared, fmt, Side::A, asrc, mr, aw) };
                    let jchunks = threads.min(npanels);
                    if me.id < jchunks {
                        let c = p.c.f32().block(ic, jc, mcur, ncur);
                        let panels = split_range(npanels, jchunks, me.id);
                        macro_kernel(ctx, nb, ap, bp, mcur, ncur, kcur, panels, p.alpha, beta, c);
                    }
                    me.barrier();
                }
                me.barrier();
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(llc: usize, kc_fixed: bool) -> Ctx {
        Ctx {
            kernel: crate::arch::portable::kernel(),
            prec: Precision::F32,
            blk: Blocking {
                mc: 32,
                kc: 8,
                nc: 8,
                nb: 8,
            },
            l1d: 1 << 20,
            llc,
            kc_fixed,
        }
    }

    #[test]
    fn one_k_block_only_when_c_outgrows_the_last_level_cache() {
        let kc = |c: &Ctx, m, n, k| c.blocking_for(m, n, k).kc;
        // C of 20 × 13 floats is 1040 bytes.
        assert_eq!(kc(&ctx(512, false), 20, 13, 15), 15);
        assert_eq!(kc(&ctx(4096, false), 20, 13, 15), 8, "C fits in the cache");
        assert_eq!(
            kc(&ctx(512, false), 20, 13, 17),
            17,
            "three blocks become one"
        );
        let small_l1 = Ctx {
            l1d: 16 * crate::arch::portable::kernel().nr * 4,
            ..ctx(512, false)
        };
        assert_eq!(
            kc(&small_l1, 20, 13, 17),
            8,
            "a B micro-panel of k = 17 does not fit in L1"
        );
        assert_eq!(kc(&small_l1, 20, 13, 15), 15);
        assert_eq!(kc(&ctx(512, true), 20, 13, 15), 8, "FUGU_GEMM_KC given");
        assert_eq!(
            kc(&ctx(0, false), 20, 13, 15),
            8,
            "no last-level cache known"
        );
    }

    /// Runs `ctx` sequentially on an m×n×k problem and compares C with the reference.
    fn check_against_reference(ctx: &Ctx, m: usize, n: usize, k: usize) {
        let a: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 - 5.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.5).collect();
        let mut c = vec![f32::NAN; m * n];
        let p = Problem {
            alpha: 1.5,
            a: RawMat::f32(a.as_ptr(), m, k, k, 1),
            b: RawMat::f32(b.as_ptr(), k, n, n, 1),
            beta: 0.0,
            c: Dest::F32(RawMatMut {
                ptr: c.as_mut_ptr(),
                rows: m,
                cols: n,
                rs: n,
                cs: 1,
            }),
        };
        run_sequential(ctx, p);
        let mut want = vec![0.0f32; m * n];
        crate::reference::gemm_ref(
            1.5,
            crate::MatRef::row_major(&a, m, k).unwrap(),
            crate::MatRef::row_major(&b, k, n).unwrap(),
            0.0,
            crate::MatMut::row_major(&mut want, m, n).unwrap(),
        );
        for (g, w) in c.iter().zip(&want) {
            assert!(
                (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                "{:?} {m}x{n}x{k}: {g} vs {w}",
                ctx.blk
            );
        }
    }

    #[test]
    fn one_k_block_gives_the_reference_result() {
        for llc in [512, 0] {
            check_against_reference(&ctx(llc, false), 20, 13, 15);
        }
    }

    #[test]
    fn balanced_blocks_give_the_reference_result() {
        // Transposed (C is row-major), the kernel's m is 45 and n is 130. kc 40 over k = 50
        // becomes 32 + 18; mc 32 over 45 and nc 20 over 130 come back unchanged from the
        // rounding to mr = 16 and nr = 4 (32 + 13, 7 × 20 with a 10 tail); nb 8: two B̃
        // micro-panels per group.
        let c = Ctx {
            blk: Blocking {
                mc: 32,
                kc: 40,
                nc: 20,
                nb: 8,
            },
            ..ctx(0, false)
        };
        assert_eq!(c.blocking_for(45, 130, 50).kc, 32);
        check_against_reference(&c, 130, 45, 50);
    }

    #[test]
    fn balanced_blocks_keep_the_count_and_even_out_the_tail() {
        assert_eq!(balanced(1024, 320, 8), 256);
        assert_eq!(balanced(768, 320, 8), 256);
        assert_eq!(balanced(2048, 320, 8), 296, "7 blocks: 6 × 296 + 272");
        assert_eq!(balanced(768, 608, 16), 384);
        assert_eq!(balanced(300, 320, 8), 320, "one block: unchanged");
        assert_eq!(balanced(321, 320, 8), 168);
        assert_eq!(balanced(1000, 333, 1000), 333, "never above the block");
        for len in 1..700 {
            for (block, unit) in [(64, 8), (320, 8), (100, 16), (7, 1)] {
                let b = balanced(len, block, unit);
                assert!(b <= block.max(1));
                assert_eq!(
                    len.div_ceil(b),
                    len.div_ceil(block),
                    "len {len} block {block}"
                );
            }
        }
    }
}

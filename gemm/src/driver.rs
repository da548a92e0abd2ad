//! The BLIS five-loop driver (jc, pc, ic, jr, ir) for one GEMM, sequential or on one domain's
//! thread pool. See `docs/KERNELS.md` for the loop structure and packed layouts.

use crate::blocking::Blocking;
use crate::buffer::{with_thread_a, with_thread_b, AlignedBuf};
use crate::kernel::KernelF32;
use crate::pack::{pack_one_panel, pack_panels};
use crate::raw::{RawMat, RawMatMut};
use rayon::prelude::*;

/// Largest `mr × nr` tile any kernel may use (SVE at 2048 bits: 128 × 10).
pub(crate) const MAX_TILE: usize = 128 * 16;

/// One validated GEMM: `C := alpha·A·B + beta·C` with A m×k, B k×n, C m×n.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Problem {
    pub alpha: f32,
    pub a: RawMat,
    pub b: RawMat,
    pub beta: f32,
    pub c: RawMatMut,
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

/// Kernel and block sizes the driver runs with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx {
    pub kernel: KernelF32,
    pub blk: Blocking,
}

impl Problem {
    pub fn m(&self) -> usize {
        self.c.rows
    }
    pub fn n(&self) -> usize {
        self.c.cols
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
        if self.c.rs != 1 && (self.c.cs == 1 || self.c.cols == 1) {
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

    /// Orients the problem and finishes the cases that need no kernel (empty C; `k == 0` or
    /// `alpha == 0`, which only scale C). Returns the problem when the kernel has work.
    pub fn needs_kernel(self) -> Option<Problem> {
        let p = self.oriented();
        if p.m() == 0 || p.n() == 0 {
            return None;
        }
        if p.is_scale_only() {
            scale_c(p.c, p.beta);
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

/// Runs the micro-kernel over the `mc × nc` block of C at `c`, for `B̃` panels `j0..j1`.
#[allow(clippy::too_many_arguments)]
fn macro_kernel(
    ctx: &Ctx,
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
    let KernelF32 { mr, nr, func, .. } = ctx.kernel;
    let direct_ok = c.rs == 1 && c.cs >= mr;
    let mut tile = [0.0f32; MAX_TILE];
    for jp in panels {
        let nj = nr.min(ncur - jp * nr);
        let bpanel = &bp[jp * kcur * nr..(jp + 1) * kcur * nr];
        for ip in 0..mcur.div_ceil(mr) {
            let mi = mr.min(mcur - ip * mr);
            let apanel = &ap[ip * kcur * mr..(ip + 1) * kcur * mr];
            let cblk = c.block(ip * mr, jp * nr, mi, nj);
            if direct_ok && mi == mr && nj == nr {
                // SAFETY: the panels hold kcur*mr and kcur*nr floats; the full mr×nr tile of
                // C is inside the view, unit-stride along m with ldc = c.cs >= mr, and this
                // thread is the only writer of this tile.
                unsafe {
                    func(
                        kcur,
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
                unsafe {
                    func(
                        kcur,
                        1.0,
                        apanel.as_ptr(),
                        bpanel.as_ptr(),
                        0.0,
                        tile.as_mut_ptr(),
                        mr,
                    )
                };
                for j in 0..nj {
                    for r in 0..mi {
                        let v = alpha * tile[r + j * mr];
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
}

/// Runs one problem on the calling thread, with its thread-local packing buffers.
pub(crate) fn run_sequential(ctx: &Ctx, p: Problem) {
    let Some(p) = p.needs_kernel() else {
        return;
    };
    let (m, n, k) = (p.m(), p.n(), p.k());
    let KernelF32 { mr, nr, .. } = ctx.kernel;
    let Blocking { mc, kc, nc } = ctx.blk;
    for jc in (0..n).step_by(nc) {
        let ncur = nc.min(n - jc);
        for pc in (0..k).step_by(kc) {
            let kcur = kc.min(k - pc);
            let beta = if pc == 0 { p.beta } else { 1.0 };
            with_thread_b(kcur * ncur.next_multiple_of(nr), |bp| {
                pack_panels(bp, p.b.block(pc, jc, kcur, ncur).t(), nr);
                for ic in (0..m).step_by(mc) {
                    let mcur = mc.min(m - ic);
                    with_thread_a(kcur * mcur.next_multiple_of(mr), |ap| {
                        pack_panels(ap, p.a.block(ic, pc, mcur, kcur), mr);
                        let c = p.c.block(ic, jc, mcur, ncur);
                        macro_kernel(
                            ctx,
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

/// Splits `0..len` into `parts` nearly equal ranges.
fn split_range(len: usize, parts: usize, i: usize) -> std::ops::Range<usize> {
    let (q, r) = (len / parts, len % parts);
    let start = i * q + i.min(r);
    start..start + q + usize::from(i < r)
}

/// Runs one problem on `pool` with `threads` threads, packing B̃ into `bbuf` (the domain's
/// buffer, first touched by the domain's threads) and Ã per thread or per domain.
pub(crate) fn run_parallel(
    ctx: &Ctx,
    p: Problem,
    pool: &rayon::ThreadPool,
    threads: usize,
    split: SplitMode,
    bbuf: &mut AlignedBuf,
    abuf: &mut AlignedBuf,
) {
    let Some(p) = p.needs_kernel() else {
        return;
    };
    let (m, n, k) = (p.m(), p.n(), p.k());
    let KernelF32 { mr, nr, .. } = ctx.kernel;
    let Blocking { mc, kc, nc } = ctx.blk;
    // Balance ic blocks over threads: a multiple of `threads` blocks when there are enough.
    let n_ic_min = m.div_ceil(mc);
    let n_ic = if n_ic_min >= threads {
        n_ic_min.next_multiple_of(threads)
    } else {
        n_ic_min
    };
    let mc_eff = m.div_ceil(n_ic).next_multiple_of(mr).min(mc.max(mr));
    let n_ic = m.div_ceil(mc_eff);
    pool.install(|| {
        for jc in (0..n).step_by(nc) {
            let ncur = nc.min(n - jc);
            let npanels = ncur.div_ceil(nr);
            for pc in (0..k).step_by(kc) {
                let kcur = kc.min(k - pc);
                let beta = if pc == 0 { p.beta } else { 1.0 };
                let bp = bbuf.get(kcur * npanels * nr);
                let bsrc = p.b.block(pc, jc, kcur, ncur).t();
                bp.par_chunks_mut(kcur * nr)
                    .enumerate()
                    .for_each(|(j, panel)| pack_one_panel(panel, bsrc, j * nr, nr));
                let bp: &[f32] = bp;
                match split {
                    SplitMode::Ic => {
                        let jchunks = threads.div_ceil(n_ic).min(npanels).max(1);
                        (0..n_ic * jchunks).into_par_iter().for_each(|t| {
                            let (ib, jb) = (t / jchunks, t % jchunks);
                            let ic = ib * mc_eff;
                            let mcur = mc_eff.min(m - ic);
                            with_thread_a(kcur * mcur.next_multiple_of(mr), |ap| {
                                pack_panels(ap, p.a.block(ic, pc, mcur, kcur), mr);
                                let c = p.c.block(ic, jc, mcur, ncur);
                                let panels = split_range(npanels, jchunks, jb);
                                macro_kernel(
                                    ctx, ap, bp, mcur, ncur, kcur, panels, p.alpha, beta, c,
                                );
                            })
                        });
                    }
                    SplitMode::Jr => {
                        for ic in (0..m).step_by(mc) {
                            let mcur = mc.min(m - ic);
                            let ap = abuf.get(kcur * mcur.next_multiple_of(mr));
                            let asrc = p.a.block(ic, pc, mcur, kcur);
                            ap.par_chunks_mut(kcur * mr)
                                .enumerate()
                                .for_each(|(i, panel)| pack_one_panel(panel, asrc, i * mr, mr));
                            let ap: &[f32] = ap;
                            let c = p.c.block(ic, jc, mcur, ncur);
                            let jchunks = threads.min(npanels);
                            (0..jchunks).into_par_iter().for_each(|jb| {
                                let panels = split_range(npanels, jchunks, jb);
                                macro_kernel(
                                    ctx, ap, bp, mcur, ncur, kcur, panels, p.alpha, beta, c,
                                );
                            });
                        }
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::split_range;

    #[test]
    fn ranges_cover() {
        for len in 0..20 {
            for parts in 1..6 {
                let mut next = 0;
                for i in 0..parts {
                    let r = split_range(len, parts, i);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }
}

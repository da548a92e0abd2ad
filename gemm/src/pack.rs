//! Packing: copies a block of a strided matrix into the micro-panel layout of `docs/KERNELS.md`.
//!
//! A and B use the same routine: Ã packs `mr`-tall panels of A, and B̃ packs `nr`-wide panels of
//! B, which are `nr`-tall panels of Bᵀ. So `pack_panels` takes the source with its stride
//! along the panel (`s_w`) and along k (`s_k`).

use crate::raw::RawMat;

/// Packs the `len × k` block `src` (rows are the panel dimension) into panels of `w` rows:
/// `dst[panel*k*w + p*w + r] = src(panel*w + r, p)`, zero-padding the last panel.
/// `dst` must hold `ceil(len / w) * w * k` floats.
pub(crate) fn pack_panels(dst: &mut [f32], src: RawMat, w: usize) {
    let (len, k) = (src.rows, src.cols);
    let panels = len.div_ceil(w);
    debug_assert!(dst.len() >= panels * w * k);
    for (pi, panel) in dst.chunks_exact_mut(w * k).take(panels).enumerate() {
        pack_one_panel(panel, src, pi * w, w);
    }
}

/// Packs the single panel of rows `r0 .. r0 + w` (clipped to the block, rest zero).
pub(crate) fn pack_one_panel(panel: &mut [f32], src: RawMat, r0: usize, w: usize) {
    let k = src.cols;
    let rows = w.min(src.rows - r0);
    let (s_w, s_k) = (src.rs, src.cs);
    let base = src.ptr;
    if rows < w {
        panel.fill(0.0);
    }
    if s_w == 1 {
        // Contiguous along the panel: copy `rows` floats per k step.
        for (p, out) in panel.chunks_exact_mut(w).enumerate() {
            // SAFETY: rows r0..r0+rows and column p are inside the source view, which is
            // contiguous along rows here.
            let col = unsafe { std::slice::from_raw_parts(base.add(r0 + p * s_k), rows) };
            out[..rows].copy_from_slice(col);
        }
    } else if s_k == 1 {
        // Contiguous along k: a transpose. Take the rows eight at a time so each k step
        // writes eight consecutive floats (one vector store) from eight sequential streams.
        let mut r = 0;
        while r + 8 <= rows {
            let src: [*const f32; 8] =
                std::array::from_fn(|i| base.wrapping_add((r0 + r + i) * s_w));
            for (p, out) in panel.chunks_exact_mut(w).enumerate() {
                let out: &mut [f32; 8] = (&mut out[r..r + 8]).try_into().expect("8 floats");
                for i in 0..8 {
                    // SAFETY: rows r0+r .. r0+r+8 and column p < k are inside the source view.
                    out[i] = unsafe { *src[i].add(p) };
                }
            }
            r += 8;
        }
        for r in r..rows {
            // SAFETY: row r0+r, columns 0..k are inside the source view, contiguous along k.
            let row = unsafe { std::slice::from_raw_parts(base.add((r0 + r) * s_w), k) };
            for (p, &v) in row.iter().enumerate() {
                panel[p * w + r] = v;
            }
        }
    } else {
        for (p, out) in panel.chunks_exact_mut(w).enumerate() {
            for (r, o) in out[..rows].iter_mut().enumerate() {
                // SAFETY: (r0+r, p) is inside the source view.
                *o = unsafe { *base.add((r0 + r) * s_w + p * s_k) };
            }
        }
    }
}

//! Rows stored in 16 bits (the CPU backend's bf16/f16 buffers, as bits): their conversion to
//! and from f32, and the ops that read and write them as stored. On a CPU with SVE these are
//! fugu-rows' `*_half` kernels, which widen each value as they load it and round each result
//! as they store it; elsewhere each piece of a row is widened into a small f32 buffer (in L1,
//! by fugu-gemm's `convert`, the packs' conversions), the f32 kernel runs on it and the
//! result is rounded back. Both give the bits of the f32 op
//! run on the widened rows and rounded once (`rows/tests/sve.rs` checks the kernels against
//! fugu-gemm's converters), so which runs does not change a value.

#[cfg(target_arch = "aarch64")]
use super::row_isa::{row_isa, RowIsa};
use crate::dtype::Dtype;
use fugu_gemm::convert;
use fugu_gemm::precision::Storage;

/// Elements per piece where a row is widened into an f32 buffer (16 KiB).
const PIECE: usize = 4096;

/// `dst[j] = src[j]` widened from `dt` (bits) to f32, exactly.
pub fn widen(dt: Dtype, src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "half_rows::widen: lengths differ");
    #[cfg(target_arch = "aarch64")]
    if let RowIsa::Sve(sve) = row_isa() {
        return sve.widen_half(half(dt), dst, src);
    }
    convert::widen(storage(dt), src, dst)
}

/// `dst[j] = src[j]` rounded to `dt` (nearest even), as bits.
pub fn round(dt: Dtype, src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len(), "half_rows::round: lengths differ");
    #[cfg(target_arch = "aarch64")]
    if let RowIsa::Sve(sve) = row_isa() {
        return sve.round_half(half(dt), dst, src);
    }
    convert::round(storage(dt), src, dst)
}

/// fugu-gemm's name for 16-bit type `dt` (its conversions, compiled for the widest x86
/// vectors; on SVE, `widen` and `round` call fugu-rows instead).
fn storage(dt: Dtype) -> Storage {
    match dt {
        Dtype::Bf16 => Storage::Bf16,
        Dtype::F16 => Storage::F16,
        Dtype::F32 => panic!("half_rows: f32 is not a 16-bit type"),
    }
}

/// [`super::gelu::gelu_forward`] on rows stored in `dt`: `out` is overwritten.
pub fn gelu_forward(dt: Dtype, out: &mut [u16], inp: &[u16]) {
    assert_eq!(
        out.len(),
        inp.len(),
        "half_rows::gelu_forward: lengths differ"
    );
    #[cfg(target_arch = "aarch64")]
    if let RowIsa::Sve(sve) = row_isa() {
        return sve.gelu_half(half(dt), out, inp);
    }
    let mut x = [0.0f32; PIECE];
    let mut y = [0.0f32; PIECE];
    for (o, i) in out.chunks_mut(PIECE).zip(inp.chunks(PIECE)) {
        let n = i.len();
        widen(dt, i, &mut x[..n]);
        super::gelu::gelu_rows_f32(&mut y[..n], &x[..n]);
        round(dt, &y[..n], o);
    }
}

/// [`super::gelu::gelu_backward`] on rows stored in `dt`: `dinp` is overwritten.
pub fn gelu_backward(dt: Dtype, dinp: &mut [u16], inp: &[u16], dout: &[u16]) {
    assert_eq!(
        dinp.len(),
        inp.len(),
        "half_rows::gelu_backward: dinp length"
    );
    assert_eq!(
        dout.len(),
        inp.len(),
        "half_rows::gelu_backward: dout length"
    );
    #[cfg(target_arch = "aarch64")]
    if let RowIsa::Sve(sve) = row_isa() {
        return sve.gelu_backward_half(half(dt), dinp, inp, dout);
    }
    let mut x = [0.0f32; PIECE];
    let mut g = [0.0f32; PIECE];
    let mut d = [0.0f32; PIECE];
    for ((o, i), go) in dinp
        .chunks_mut(PIECE)
        .zip(inp.chunks(PIECE))
        .zip(dout.chunks(PIECE))
    {
        let n = i.len();
        widen(dt, i, &mut x[..n]);
        widen(dt, go, &mut g[..n]);
        super::gelu::gelu_backward_rows_f32(&mut d[..n], &x[..n], &g[..n]);
        round(dt, &d[..n], o);
    }
}

/// [`super::attention::attention_softmax`] on rows of causal (T, T) blocks stored in `dt`:
/// `att` holds whole rows of `t`, the first of them row `first` of the blocks' rows (a row's
/// causal length is its index within its block, plus one). Each row is widened up to that
/// length only, its f32 softmax rounded back, and the rest set to zero, so the masked half
/// of a block is written but never read.
pub fn attention_softmax(dt: Dtype, att: &mut [u16], first: usize, t: usize) {
    assert_eq!(
        att.len() % t.max(1),
        0,
        "half_rows::attention_softmax: whole rows"
    );
    let mut x = vec![0.0f32; t];
    for (r, row) in att.chunks_mut(t.max(1)).enumerate() {
        let live = (first + r) % t + 1;
        let (l, masked) = row.split_at_mut(live);
        widen(dt, l, &mut x[..live]);
        super::attention::softmax_row::<f32>(&mut x[..live]);
        round(dt, &x[..live], l);
        masked.fill(0);
    }
}

/// [`super::attention::attention_softmax_backward`] on rows stored in `dt`, laid out as in
/// [`attention_softmax`]: each row of `datt` and `att` widened up to its causal length,
/// `datt`'s f32 result rounded back and the rest of its row set to zero.
pub fn attention_softmax_backward(
    dt: Dtype,
    datt: &mut [u16],
    att: &[u16],
    first: usize,
    t: usize,
) {
    assert_eq!(
        datt.len(),
        att.len(),
        "half_rows::attention_softmax_backward: lengths differ"
    );
    assert_eq!(
        datt.len() % t.max(1),
        0,
        "half_rows::attention_softmax_backward: whole rows"
    );
    let (mut d, mut a) = (vec![0.0f32; t], vec![0.0f32; t]);
    let rows = datt.chunks_mut(t.max(1)).zip(att.chunks(t.max(1)));
    for (r, (drow, arow)) in rows.enumerate() {
        let live = (first + r) % t + 1;
        let (dl, masked) = drow.split_at_mut(live);
        widen(dt, dl, &mut d[..live]);
        widen(dt, &arow[..live], &mut a[..live]);
        super::attention::softmax_backward_row_f32(&mut d[..live], &a[..live]);
        round(dt, &d[..live], dl);
        masked.fill(0);
    }
}

/// fugu-rows' name of a 16-bit type.
#[cfg(target_arch = "aarch64")]
fn half(dt: Dtype) -> fugu_rows::sve::Half {
    match dt {
        Dtype::F16 => fugu_rows::sve::Half::F16,
        Dtype::Bf16 => fugu_rows::sve::Half::Bf16,
        Dtype::F32 => panic!("half_rows: f32 is not a 16-bit type"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 16-bit GELU is the f32 GELU of the widened rows, rounded once by fugu's converters
    /// (whichever kernel runs: fugu-rows' on SVE, the staged pieces elsewhere), over more than
    /// one piece and with an uneven tail; and widening then rounding is the identity.
    #[test]
    fn gelu_on_16_bit_rows_is_the_f32_gelu_rounded() {
        let n = 2 * PIECE + 37;
        let xs: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 2000) as f32 / 125.0 - 8.0)
            .collect();
        let gs: Vec<f32> = (0..n)
            .map(|i| ((i * 104_729) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        for dt in [Dtype::Bf16, Dtype::F16] {
            let enc = |v: &[f32]| {
                let mut h = vec![0u16; v.len()];
                round(dt, v, &mut h);
                h
            };
            let (x, g) = (enc(&xs), enc(&gs));
            let mut xw = vec![0.0f32; n];
            let mut gw = vec![0.0f32; n];
            widen(dt, &x, &mut xw);
            widen(dt, &g, &mut gw);
            assert_eq!(enc(&xw), x, "{dt:?}: widen then round");
            let mut want = vec![0.0f32; n];
            super::super::gelu::gelu_forward(&mut want, &xw);
            let mut out = vec![0u16; n];
            gelu_forward(dt, &mut out, &x);
            assert_eq!(out, enc(&want), "{dt:?} forward");
            super::super::gelu::gelu_backward(&mut want, &xw, &gw);
            gelu_backward(dt, &mut out, &x, &g);
            assert_eq!(out, enc(&want), "{dt:?} backward");
        }
    }

    /// The 16-bit attention softmax and its backward are the f32 ops on the widened blocks,
    /// rounded once, whatever rows a call starts at (chunks of 5 rows cut across blocks);
    /// the masked half of every row is zero and its old contents never matter.
    #[test]
    fn attention_softmax_on_16_bit_rows_is_the_f32_softmax_rounded() {
        let (t, blocks) = (37, 3);
        let n = blocks * t * t;
        let xs: Vec<f32> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f32 / 125.0 - 4.0)
            .collect();
        let gs: Vec<f32> = (0..n)
            .map(|i| ((i * 104_729) % 999) as f32 / 400.0 - 1.2)
            .collect();
        for dt in [Dtype::Bf16, Dtype::F16] {
            let enc = |v: &[f32]| {
                let mut h = vec![0u16; v.len()];
                round(dt, v, &mut h);
                h
            };
            let dec = |h: &[u16]| {
                let mut v = vec![0.0f32; h.len()];
                widen(dt, h, &mut v);
                v
            };
            let (x, g) = (enc(&xs), enc(&gs));
            let mut want = dec(&x);
            super::super::attention::attention_softmax(&mut want, 1, t, blocks);
            let mut att = x.clone();
            for (c, rows) in att.chunks_mut(5 * t).enumerate() {
                attention_softmax(dt, rows, 5 * c, t);
            }
            assert_eq!(att, enc(&want), "{dt:?} forward");
            let mut dwant = dec(&g);
            super::super::attention::attention_softmax_backward(
                &mut dwant,
                &dec(&att),
                1,
                t,
                blocks,
            );
            let mut datt = g.clone();
            for (c, (d, a)) in datt.chunks_mut(5 * t).zip(att.chunks(5 * t)).enumerate() {
                attention_softmax_backward(dt, d, a, 5 * c, t);
            }
            assert_eq!(datt, enc(&dwant), "{dt:?} backward");
        }
    }
}

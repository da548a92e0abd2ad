//! Causal multi-head self-attention on a fused qkv tensor, as three timed steps (Megatron's
//! baddbmm / softmax / bmm) and their backward counterparts, with grouped-query attention.
//!
//! Layout ([`AttnShape`]): `qkv` is (B, T, (nh + 2·kv)·hs) with each row
//! `[q (nh·hs) | k (kv·hs) | v (kv·hs)]`, head `h` at columns `h*hs .. (h+1)*hs` of its part;
//! query head `h` attends with key/value head `h / (nh/kv)` (grouped-query attention, as
//! `transformers`' `repeat_kv`; `kv = nh` is multi-head attention, each row `[q | k | v]` of
//! `C = nh·hs` each). The widths are the *local* ones (with tensor parallelism each rank sees
//! only its heads). `att` is (B, nh, T, T). The attention output and its gradient are
//! (B, T, C) with the query heads' layout.
//!
//! Every matrix product is a strided batched GEMM over the heads of one batch element (batch
//! stride `hs` inside a qkv or output row, `T·T` in `att`), reading and writing the fused
//! layouts in place through strides: no head split or merge copies. Under grouped-query
//! attention one batch covers the `i`-th query head of every group ([`Heads::every`]), one
//! call per group member; the key/value gradients add the members' shares in member order.
//!
//! Causal blocks ([`causal_blocks`], the rule every backend follows): from T = 128 the query
//! rows go in four blocks, and each block's products use the keys up to its own last row only
//! (the scores, the values and their gradients), 5/8 of the T×T work. Entries of `att` and
//! `datt` right of a row's block are then never written or read; the softmax and its
//! backward zero the rest of each row, so the products see exact zeros above the diagonal.

use super::{BatchMat, BatchMatMut, Float, GemmOperand, Precision};
use rayon::prelude::*;

/// Causal blocks of the attention GEMMs: query rows in this many blocks, each multiplied only
/// with the keys up to its last row (5/8 of the full T×T work), for T of at least
/// [`CAUSAL_MIN_T`].
pub const CAUSAL_BLOCKS: usize = 4;
/// The shortest sequence whose attention GEMMs run in causal blocks.
pub const CAUSAL_MIN_T: usize = 128;

/// Rows per block of the causal attention GEMMs for sequence length `t` (a multiple of 8, which
/// keeps row offsets 16-byte aligned for 16-bit types; `t` itself when not blocked).
pub fn causal_block_rows(t: usize) -> usize {
    if t >= CAUSAL_MIN_T {
        t.div_ceil(CAUSAL_BLOCKS).next_multiple_of(8)
    } else {
        t.max(1)
    }
}

/// The row blocks `(r0, r1)` of the causal attention GEMMs for sequence length `t`: each query
/// block is multiplied with the keys up to its own last row only, so the probabilities and
/// their gradients above the diagonal are read (and must be zero) only inside the diagonal
/// block.
pub fn causal_blocks(t: usize) -> Vec<(usize, usize)> {
    let rows = causal_block_rows(t);
    (0..t)
        .step_by(rows.max(1))
        .map(|r0| (r0, (r0 + rows).min(t)))
        .collect()
}

/// The shape of one attention call: `b` sequences of `t` tokens, `nh` query heads sharing `kv`
/// key/value heads (`kv` divides `nh`; `kv = nh` is multi-head attention), heads of `hs`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    pub nh: usize,
    pub kv: usize,
    pub hs: usize,
}

impl AttnShape {
    /// Multi-head attention: as many key/value heads as query heads.
    pub fn mha(b: usize, t: usize, nh: usize, hs: usize) -> AttnShape {
        AttnShape {
            b,
            t,
            nh,
            kv: nh,
            hs,
        }
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.nh / self.kv
    }

    /// Elements of one qkv row: `(nh + 2·kv)·hs`.
    pub fn qkv_width(&self) -> usize {
        (self.nh + 2 * self.kv) * self.hs
    }

    /// Elements of one output row: `nh·hs`.
    pub fn out_width(&self) -> usize {
        self.nh * self.hs
    }

    /// Asserts the qkv length and that `kv` divides `nh`.
    fn check(&self, qkv: usize, op: &str) {
        assert!(
            self.kv > 0 && self.nh.is_multiple_of(self.kv),
            "{op}: {} key/value heads do not divide {} query heads",
            self.kv,
            self.nh
        );
        assert_eq!(qkv, self.b * self.t * self.qkv_width(), "{op}: qkv length");
    }
}

/// Where batch element `bi`'s `heads` matrices (each `rows`×`cols`, unit column stride) lie in
/// one of attention's tensors: the first element, the row stride `ld`, the stride between
/// heads, and the batch element's whole range `base .. base + span`. The one statement of these
/// layouts: the CPU views below and the CUDA backend's strided-batched GEMMs are built from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heads {
    pub offset: usize,
    pub ld: usize,
    pub stride: usize,
    pub heads: usize,
    pub rows: usize,
    pub cols: usize,
    pub base: usize,
    pub span: usize,
}

impl Heads {
    /// Part `part` (0 = Q, 1 = K, 2 = V) of a (B, T, 3C) qkv tensor: `nh` (T, hs) matrices.
    pub fn qkv(bi: usize, part: usize, t: usize, nh: usize, hs: usize) -> Heads {
        Heads::qkv_grouped(bi, part, &AttnShape::mha(bi + 1, t, nh, hs))
    }

    /// Part `part` (0 = Q: `nh` matrices; 1 = K, 2 = V: `kv` each) of a qkv tensor of shape `d`.
    pub fn qkv_grouped(bi: usize, part: usize, d: &AttnShape) -> Heads {
        let (w, hs) = (d.qkv_width(), d.hs);
        let base = bi * d.t * w;
        let (start, heads) = match part {
            0 => (0, d.nh),
            1 => (d.nh * hs, d.kv),
            _ => ((d.nh + d.kv) * hs, d.kv),
        };
        Heads {
            offset: base + start,
            ld: w,
            stride: hs,
            heads,
            rows: d.t,
            cols: hs,
            base,
            span: d.t * w,
        }
    }

    /// Heads `i, i + g, i + 2g, …`: member `i` of every group of `g` consecutive heads.
    pub fn every(self, g: usize, i: usize) -> Heads {
        assert!(
            i < g && self.heads.is_multiple_of(g),
            "Heads::every: member {i} of groups of {g} among {} heads",
            self.heads
        );
        Heads {
            offset: self.offset + i * self.stride,
            stride: self.stride * g,
            heads: self.heads / g,
            ..self
        }
    }

    /// A (B, T, C) tensor: `nh` (T, hs) matrices.
    pub fn btc(bi: usize, t: usize, nh: usize, hs: usize) -> Heads {
        let c = nh * hs;
        Heads {
            offset: bi * t * c,
            ld: c,
            stride: hs,
            heads: nh,
            rows: t,
            cols: hs,
            base: bi * t * c,
            span: t * c,
        }
    }

    /// A (B, nh, T, T) tensor: `nh` (T, T) matrices.
    pub fn att(bi: usize, t: usize, nh: usize) -> Heads {
        Heads {
            offset: bi * nh * t * t,
            ld: t,
            stride: t * t,
            heads: nh,
            rows: t,
            cols: t,
            base: bi * nh * t * t,
            span: nh * t * t,
        }
    }

    /// Rows `r0..r1` and columns `c0..c1` of every head's matrix.
    pub fn block(self, (r0, r1): (usize, usize), (c0, c1): (usize, usize)) -> Heads {
        assert!(
            r0 <= r1 && r1 <= self.rows && c0 <= c1 && c1 <= self.cols,
            "Heads::block: rows {r0}..{r1} of {}, columns {c0}..{c1} of {}",
            self.rows,
            self.cols
        );
        Heads {
            offset: self.offset + r0 * self.ld + c0,
            rows: r1 - r0,
            cols: c1 - c0,
            ..self
        }
    }

    /// The range of row `row` of head `head`'s matrix.
    pub fn row(&self, head: usize, row: usize) -> std::ops::Range<usize> {
        let start = self.offset + row * self.ld + head * self.stride;
        start..start + self.cols
    }

    fn view<T>(self, data: &[T]) -> BatchMat<'_, T> {
        BatchMat {
            data,
            offset: self.offset,
            batch: self.heads,
            bs: self.stride,
            rows: self.rows,
            cols: self.cols,
            rs: self.ld,
            cs: 1,
        }
    }

    /// Writable, over the batch element's range only.
    fn view_mut<T>(self, data: &mut [T]) -> BatchMatMut<'_, T> {
        BatchMatMut {
            data: &mut data[self.base..self.base + self.span],
            offset: self.offset - self.base,
            batch: self.heads,
            bs: self.stride,
            rows: self.rows,
            cols: self.cols,
            rs: self.ld,
            cs: 1,
        }
    }
}

/// `1/sqrt(hs)`, computed in `f64` and rounded once (every backend uses this value).
pub fn scale<T: Float>(hs: usize) -> T {
    T::from_f64(1.0 / (hs as f64).sqrt())
}

/// Attention scores: `att[b, h] = Q[b, h]·K[b, h]ᵀ / sqrt(hs)` (the pre-softmax logits).
///
/// * `att`: (B, nh, T, T), **overwritten** up to the end of each row's causal block (entries
///   above the diagonal inside it are meaningless until [`attention_softmax`]; those right of
///   it are not written).
/// * `qkv`: (B, T, (nh + 2·kv)·hs).
///
/// One strided batched GEMM (batch = kv) per batch element, causal block and group member.
pub fn attention_scores<T: Float, O, E: GemmOperand<T, O>>(
    prec: Precision,
    att: &mut [O],
    qkv: &[E],
    d: AttnShape,
) {
    let AttnShape { b, t, nh, hs, .. } = d;
    d.check(qkv.len(), "attention_scores");
    assert_eq!(att.len(), b * nh * t * t, "attention_scores: att length");
    let (alpha, g) = (scale::<T>(hs), d.group());
    for bi in 0..b {
        let (q, k, a) = (
            Heads::qkv_grouped(bi, 0, &d),
            Heads::qkv_grouped(bi, 1, &d),
            Heads::att(bi, t, nh),
        );
        for (r0, r1) in causal_blocks(t) {
            for i in 0..g {
                // att[r0..r1, 0..r1] = α·Q[r0..r1]·K[0..r1]ᵀ
                E::gemm_strided_batched(
                    prec,
                    alpha,
                    q.every(g, i).block((r0, r1), (0, hs)).view(qkv),
                    k.block((0, r1), (0, hs)).view(qkv).t(),
                    T::ZERO,
                    a.every(g, i).block((r0, r1), (0, r1)).view_mut(att),
                );
            }
        }
    }
}

/// Causal softmax in place: row `i` of each (T, T) matrix becomes the softmax of its columns
/// `0..=i` (max-subtracted, sum in `T`); columns `> i` are set to exactly 0.
///
/// * `att`: (B, nh, T, T), read and **overwritten**. Parallel over the B·nh·T rows.
pub fn attention_softmax<T: Float>(att: &mut [T], b: usize, t: usize, nh: usize) {
    assert_eq!(att.len(), b * nh * t * t, "attention_softmax: att length");
    if t == 0 {
        return;
    }
    att.par_chunks_mut(t)
        .with_min_len(16)
        .enumerate()
        .for_each(|(r, row)| {
            let i = r % t;
            let (live, masked) = row.split_at_mut(i + 1);
            softmax_row(live);
            masked.fill(T::ZERO);
        });
}

/// One row's softmax in place: the maximum subtracted, each exponential taken once and stored
/// with their sum (in f64), then the row scaled by its reciprocal (vectorised row kernels).
/// Returns the maximum and the sum (the fused path's log-sum-exp).
pub(crate) fn softmax_row<T: Float>(row: &mut [T]) -> (T, f64) {
    let mx = T::row_max(row);
    let sum = T::exp_sum_row(row, mx);
    T::scale_row(row, T::from_f64(1.0 / sum));
    (mx, sum)
}

/// Attention output: `out[b, :, h] = att[b, h]·V[b, h]`.
///
/// * `out`: (B, T, nh·hs), **overwritten**, written in place through strides.
/// * `att`: (B, nh, T, T) after [`attention_softmax`] (zero above the diagonal); `qkv` as above.
pub fn attention_values<T: Float, O, E: GemmOperand<T, O>>(
    prec: Precision,
    out: &mut [O],
    att: &[E],
    qkv: &[E],
    d: AttnShape,
) {
    let AttnShape { b, t, nh, hs, .. } = d;
    d.check(qkv.len(), "attention_values");
    assert_eq!(att.len(), b * nh * t * t, "attention_values: att length");
    assert_eq!(out.len(), b * t * nh * hs, "attention_values: out length");
    let g = d.group();
    for bi in 0..b {
        let (a, v, o) = (
            Heads::att(bi, t, nh),
            Heads::qkv_grouped(bi, 2, &d),
            Heads::btc(bi, t, nh, hs),
        );
        for (r0, r1) in causal_blocks(t) {
            for i in 0..g {
                // out[r0..r1] = att[r0..r1, 0..r1]·V[0..r1]
                E::gemm_strided_batched(
                    prec,
                    T::ONE,
                    a.every(g, i).block((r0, r1), (0, r1)).view(att),
                    v.block((0, r1), (0, hs)).view(qkv),
                    T::ZERO,
                    o.every(g, i).block((r0, r1), (0, hs)).view_mut(out),
                );
            }
        }
    }
}

/// Backward of [`attention_values`].
///
/// * `datt`: (B, nh, T, T), **overwritten** with `dout·Vᵀ` per head up to the end of each
///   row's causal block (entries above the diagonal inside it are zeroed later by
///   [`attention_softmax_backward`]; those right of it are not written).
/// * `dqkv`: like `qkv`; its V columns are **overwritten** with `attᵀ·dout` (each key/value
///   head the sum over its group's query heads); Q and K columns are untouched.
/// * `dout`: (B, T, nh·hs); `att`, `qkv` from the forward pass.
pub fn attention_values_backward<T: Float, O, E: GemmOperand<T, O>>(
    prec: Precision,
    datt: &mut [O],
    dqkv: &mut [O],
    dout: &[E],
    att: &[E],
    qkv: &[E],
    d: AttnShape,
) {
    let AttnShape { b, t, nh, hs, .. } = d;
    d.check(qkv.len(), "attention_values_backward");
    d.check(dqkv.len(), "attention_values_backward (dqkv)");
    assert_eq!(
        att.len(),
        b * nh * t * t,
        "attention_values_backward: att length"
    );
    assert_eq!(
        datt.len(),
        b * nh * t * t,
        "attention_values_backward: datt length"
    );
    assert_eq!(
        dout.len(),
        b * t * nh * hs,
        "attention_values_backward: dout length"
    );
    let g = d.group();
    for bi in 0..b {
        let (a, v, y) = (
            Heads::att(bi, t, nh),
            Heads::qkv_grouped(bi, 2, &d),
            Heads::btc(bi, t, nh, hs),
        );
        for (r0, r1) in causal_blocks(t) {
            for i in 0..g {
                let (a, y) = (a.every(g, i), y.every(g, i));
                // datt[r0..r1, 0..r1] = dout[r0..r1]·V[0..r1]ᵀ
                E::gemm_strided_batched(
                    prec,
                    T::ONE,
                    y.block((r0, r1), (0, hs)).view(dout),
                    v.block((0, r1), (0, hs)).view(qkv).t(),
                    T::ZERO,
                    a.block((r0, r1), (0, r1)).view_mut(datt),
                );
                // dV[r0..r1] (+)= att[r0..T, r0..r1]ᵀ·dout[r0..T] (att is 0 above the diagonal,
                // so earlier query rows add nothing).
                E::gemm_strided_batched(
                    prec,
                    T::ONE,
                    a.block((r0, t), (r0, r1)).view(att).t(),
                    y.block((r0, t), (0, hs)).view(dout),
                    if i == 0 { T::ZERO } else { T::ONE },
                    v.block((r0, r1), (0, hs)).view_mut(dqkv),
                );
            }
        }
    }
}

/// Backward of [`attention_softmax`], in place: `datt` (the gradient of the softmax output)
/// becomes the gradient of the scores, `datt[i, j] = att[i, j]·(datt[i, j] - Σ_{k≤i}
/// datt[i, k]·att[i, k])` for `j ≤ i`, and exactly 0 for `j > i`. The `1/sqrt(hs)` scale is
/// not folded in (it is [`attention_scores_backward`]'s GEMM alpha).
///
/// * `datt`: (B, nh, T, T), read and **overwritten**; `att`: the softmax output.
///   Parallel over rows.
pub fn attention_softmax_backward<T: Float>(
    datt: &mut [T],
    att: &[T],
    b: usize,
    t: usize,
    nh: usize,
) {
    assert_eq!(
        att.len(),
        b * nh * t * t,
        "attention_softmax_backward: att length"
    );
    assert_eq!(
        datt.len(),
        b * nh * t * t,
        "attention_softmax_backward: datt length"
    );
    if t == 0 {
        return;
    }
    datt.par_chunks_mut(t)
        .zip(att.par_chunks(t))
        .enumerate()
        .for_each(|(r, (d, a))| {
            let i = r % t;
            let (live, masked) = d.split_at_mut(i + 1);
            T::softmax_backward_row(live, &a[..i + 1]);
            masked.fill(T::ZERO);
        });
}

/// Lanes of [`softmax_backward_row`]'s sum: element `j` goes to lane `j % 16`, the lanes are
/// added in order, then the tail (a fixed order that vectorises).
const SOFTMAX_BWD_LANES: usize = 16;

/// One row of [`attention_softmax_backward`] (`Float::softmax_backward_row` runs it,
/// vectorised for the CPU): `d = a·(d − Σ d·a)`, in place.
#[inline(always)]
pub(crate) fn softmax_backward_row<T: Float>(d: &mut [T], a: &[T]) {
    let mut acc = [T::ZERO; SOFTMAX_BWD_LANES];
    let (mut di, mut ai) = (
        d.chunks_exact(SOFTMAX_BWD_LANES),
        a.chunks_exact(SOFTMAX_BWD_LANES),
    );
    for (dc, ac) in (&mut di).zip(&mut ai) {
        for l in 0..SOFTMAX_BWD_LANES {
            acc[l] += dc[l] * ac[l];
        }
    }
    let mut s = acc.iter().fold(T::ZERO, |x, &y| x + y);
    for (&dj, &aj) in di.remainder().iter().zip(ai.remainder()) {
        s += dj * aj;
    }
    for (dj, &aj) in d.iter_mut().zip(a) {
        *dj = aj * (*dj - s);
    }
}

super::row_isa::dispatch_rows! {
    /// [`softmax_backward_row`] in f32 with the widest vectors the CPU has.
    pub(crate) fn softmax_backward_row_f32(d: &mut [f32], a: &[f32]) = softmax_backward_row::<f32>;
    sve = fugu_rows::sve::Sve::softmax_backward;
}

/// Backward of [`attention_scores`].
///
/// * `dqkv`: like `qkv`; its Q columns are **overwritten** with `scale·dpre·K` and its K
///   columns with `scale·dpreᵀ·Q` (each key head the sum over its group's query heads); V
///   columns are untouched.
/// * `datt`: (B, nh, T, T), the score gradient from [`attention_softmax_backward`] (zero above
///   the diagonal); `qkv` from the forward pass.
pub fn attention_scores_backward<T: Float, O, E: GemmOperand<T, O>>(
    prec: Precision,
    dqkv: &mut [O],
    datt: &[E],
    qkv: &[E],
    d: AttnShape,
) {
    let AttnShape { b, t, nh, hs, .. } = d;
    d.check(qkv.len(), "attention_scores_backward");
    d.check(dqkv.len(), "attention_scores_backward (dqkv)");
    assert_eq!(
        datt.len(),
        b * nh * t * t,
        "attention_scores_backward: datt length"
    );
    let (alpha, g) = (scale::<T>(hs), d.group());
    for bi in 0..b {
        let (a, q, k) = (
            Heads::att(bi, t, nh),
            Heads::qkv_grouped(bi, 0, &d),
            Heads::qkv_grouped(bi, 1, &d),
        );
        for (r0, r1) in causal_blocks(t) {
            for i in 0..g {
                let (a, q) = (a.every(g, i), q.every(g, i));
                // dQ[r0..r1] = α·datt[r0..r1, 0..r1]·K[0..r1]
                E::gemm_strided_batched(
                    prec,
                    alpha,
                    a.block((r0, r1), (0, r1)).view(datt),
                    k.block((0, r1), (0, hs)).view(qkv),
                    T::ZERO,
                    q.block((r0, r1), (0, hs)).view_mut(dqkv),
                );
                // dK[r0..r1] (+)= α·datt[r0..T, r0..r1]ᵀ·Q[r0..T]
                E::gemm_strided_batched(
                    prec,
                    alpha,
                    a.block((r0, t), (r0, r1)).view(datt).t(),
                    q.block((r0, t), (0, hs)).view(qkv),
                    if i == 0 { T::ZERO } else { T::ONE },
                    k.block((r0, r1), (0, hs)).view_mut(dqkv),
                );
            }
        }
    }
}

/// Attention of one new token over a key/value cache (incremental decoding).
///
/// * `out`: (nh·hs), **overwritten** with `softmax(q·K[0..len]ᵀ/√hs)·V[0..len]` per head.
/// * `q`: (nh·hs), the new token's queries (the Q part of its qkv row).
/// * `k_cache`, `v_cache`: (P, kv·hs) with P ≥ `len`; rows `0..len` are the keys and values of
///   positions `0..len`, the new token's own at row `len - 1` (the caller appends it first).
///   Query head `h` reads key/value head `h / (nh/kv)`.
///
/// Same result as the last row of [`attention_scores`] → [`attention_softmax`] →
/// [`attention_values`] over the `len`-token prefix, up to summation order. Parallel over
/// heads.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode<T: Float>(
    out: &mut [T],
    q: &[T],
    k_cache: &[T],
    v_cache: &[T],
    len: usize,
    (nh, kv): (usize, usize),
    hs: usize,
) {
    let c = nh * hs;
    let ckv = kv * hs;
    assert!(
        kv > 0 && nh.is_multiple_of(kv),
        "attention_decode: {kv} key/value heads do not divide {nh} query heads"
    );
    assert_eq!(out.len(), c, "attention_decode: out length");
    assert_eq!(q.len(), c, "attention_decode: q length");
    assert!(len >= 1, "attention_decode: empty cache");
    assert!(
        k_cache.len() >= len * ckv && v_cache.len() >= len * ckv,
        "attention_decode: cache shorter than {len} positions"
    );
    let (alpha, g) = (scale::<T>(hs), nh / kv);
    out.par_chunks_mut(hs)
        .enumerate()
        .for_each_init(Vec::new, |w, (h, o)| {
            let qh = &q[h * hs..(h + 1) * hs];
            let j = h / g;
            w.clear();
            w.extend((0..len).map(|s| {
                let k = &k_cache[s * ckv + j * hs..s * ckv + (j + 1) * hs];
                qh.iter().zip(k).fold(T::ZERO, |acc, (&a, &b)| acc + a * b) * alpha
            }));
            softmax_row(w);
            o.fill(T::ZERO);
            for (s, &p) in w.iter().enumerate() {
                let v = &v_cache[s * ckv + j * hs..s * ckv + (j + 1) * hs];
                for (x, &vv) in o.iter_mut().zip(v) {
                    *x += p * vv;
                }
            }
        });
}

/// Fused causal attention (the reference for FlashAttention kernels): what
/// [`attention_scores`], [`attention_softmax`] and [`attention_values`] compute, without a
/// (T, T) tensor, plus each row's log-sum-exp for [`attention_backward_fused`].
///
/// * `out`: (B, T, C), **overwritten**; `lse`: (B, nh, T), **overwritten** with
///   `ln Σ_{j≤i} exp(s_ij)` of the scaled scores `s_ij = q_i·k_j/√hs`.
/// * Per query row: the scores, their maximum, `Σ exp` in f64 and the probabilities as
///   [`attention_softmax`] forms them, then `out_i = Σ_j p_ij v_j`.
pub fn attention_forward_fused<T: Float>(out: &mut [T], lse: &mut [T], qkv: &[T], d: AttnShape) {
    let AttnShape { b, t, nh, hs, .. } = d;
    d.check(qkv.len(), "attention_forward_fused");
    let c = d.out_width();
    assert_eq!(out.len(), b * t * c, "attention_forward_fused: out length");
    assert_eq!(lse.len(), b * nh * t, "attention_forward_fused: lse length");
    let (alpha, g) = (scale::<T>(hs), d.group());
    out.par_chunks_mut(t * c)
        .zip(lse.par_chunks_mut(nh * t))
        .zip(qkv.par_chunks(t * d.qkv_width()))
        .for_each(|((out, lse), qkv)| {
            // One sequence's chunks: its heads as batch element 0.
            let [q, k, v] = [0, 1, 2].map(|part| Heads::qkv_grouped(0, part, &d));
            let y = Heads::btc(0, t, nh, hs);
            let mut w = Vec::with_capacity(t);
            for h in 0..nh {
                let kh = h / g;
                for i in 0..t {
                    let qi = &qkv[q.row(h, i)];
                    w.clear();
                    w.extend((0..=i).map(|j| head_dot(qi, &qkv[k.row(kh, j)]) * alpha));
                    let (mx, sum) = softmax_row(&mut w);
                    lse[h * t + i] = T::from_f64(mx.to_f64() + sum.ln());
                    let o = &mut out[y.row(h, i)];
                    o.fill(T::ZERO);
                    for (j, &p) in w.iter().enumerate() {
                        for (x, &v) in o.iter_mut().zip(&qkv[v.row(kh, j)]) {
                            *x += p * v;
                        }
                    }
                }
            }
        });
}

/// Backward of [`attention_forward_fused`] from its `out` and `lse`: with
/// `p_ij = exp(s_ij − lse_i)`, `dp_ij = dout_i·v_j`, `Δ_i = dout_i·out_i` and
/// `ds_ij = p_ij (dp_ij − Δ_i)`: `dq_i = Σ_j ds_ij k_j/√hs`, `dk_j = Σ_i ds_ij q_i/√hs`,
/// `dv_j = Σ_i p_ij dout_i` (j ≤ i).
///
/// * `dqkv`: like `qkv`, **overwritten** (all three parts; each key/value head the sum over
///   its group's query heads).
pub fn attention_backward_fused<T: Float>(
    dqkv: &mut [T],
    dout: &[T],
    out: &[T],
    lse: &[T],
    qkv: &[T],
    d: AttnShape,
) {
    let AttnShape { b, t, nh, hs, .. } = d;
    d.check(qkv.len(), "attention_backward_fused");
    d.check(dqkv.len(), "attention_backward_fused (dqkv)");
    let c = d.out_width();
    assert!(
        dout.len() == b * t * c && out.len() == b * t * c,
        "attention_backward_fused: dout/out length"
    );
    assert_eq!(
        lse.len(),
        b * nh * t,
        "attention_backward_fused: lse length"
    );
    let (alpha, g, w) = (scale::<T>(hs), d.group(), d.qkv_width());
    dqkv.par_chunks_mut(t * w)
        .zip(dout.par_chunks(t * c))
        .zip(out.par_chunks(t * c))
        .zip(lse.par_chunks(nh * t))
        .zip(qkv.par_chunks(t * w))
        .for_each(|((((dqkv, dout), out), lse), qkv)| {
            // One sequence's chunks: its heads as batch element 0.
            let [q, k, v] = [0, 1, 2].map(|part| Heads::qkv_grouped(0, part, &d));
            let y = Heads::btc(0, t, nh, hs);
            dqkv.fill(T::ZERO);
            for h in 0..nh {
                let kh = h / g;
                for i in 0..t {
                    let (dy, qi) = (&dout[y.row(h, i)], &qkv[q.row(h, i)]);
                    let delta = head_dot(dy, &out[y.row(h, i)]);
                    for j in 0..=i {
                        let kj = &qkv[k.row(kh, j)];
                        let p = (head_dot(qi, kj) * alpha - lse[h * t + i]).exp();
                        let ds = p * (head_dot(dy, &qkv[v.row(kh, j)]) - delta) * alpha;
                        for e in 0..hs {
                            dqkv[q.row(h, i).start + e] += ds * kj[e];
                            dqkv[k.row(kh, j).start + e] += ds * qi[e];
                            dqkv[v.row(kh, j).start + e] += p * dy[e];
                        }
                    }
                }
            }
        });
}

fn head_dot<T: Float>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::ZERO, |acc, (&x, &y)| acc + x * y)
}

/// max |a − b| / max(1, max |b|) over two results of attention (an output, or the q, k, v
/// gradients); NaN anywhere gives NaN.
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let mut scale = 1.0f64;
    let mut diff = 0.0f64;
    for (&x, &y) in a.iter().zip(b) {
        if x.is_nan() || y.is_nan() {
            return f64::NAN;
        }
        scale = scale.max(y.abs() as f64);
        diff = diff.max((x as f64 - y as f64).abs());
    }
    diff / scale
}

/// How far ([`max_rel_diff`]) two ways of computing attention in `dt` may be apart (`fugu bench
/// attention`'s fused forms against the three-step path, a timed form against the default
/// one): both round the probabilities (and in the backward pass dS) to the type for their
/// products, from maxima and sums found in another order, so each term of an output moves by
/// a few units of the type's rounding; 16 of them relative to the largest value catches a
/// wrong result, not rounding (the CUDA tests hold each kernel to 4-8 against the CPU). In
/// f32, where that is 1e-6, the sums' order over thousands of terms is what differs: 1e-4.
pub fn form_tolerance(dt: crate::dtype::Dtype) -> f64 {
    (16.0 * dt.unit_roundoff()).max(1e-4)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched softmax-backward row gives the portable row's result (C = 1001: lanes
    /// and a tail).
    #[test]
    fn dispatched_softmax_backward_row_matches_the_portable_row() {
        let n = 1001;
        let a: Vec<f32> = (0..n)
            .map(|i| ((i * 31) % 97) as f32 / (97.0 * 500.0))
            .collect();
        let d: Vec<f32> = (0..n)
            .map(|i| ((i * 17) % 89) as f32 * 0.02 - 0.9)
            .collect();
        let (mut d1, mut d2) = (d.clone(), d);
        softmax_backward_row_f32(&mut d1, &a);
        softmax_backward_row::<f32>(&mut d2, &a);
        crate::ops::testutil::assert_rows_match(&d1, &d2);
    }
    use crate::ops::testutil::*;

    /// The three forward steps; returns (att, out).
    fn forward_grouped<T: Float + GemmOperand<T>>(qkv: &[T], d: AttnShape) -> (Vec<T>, Vec<T>) {
        let AttnShape { b, t, nh, hs, .. } = d;
        let mut att = vec![T::from_f64(f64::NAN); b * nh * t * t];
        let mut out = vec![T::from_f64(f64::NAN); b * t * nh * hs];
        attention_scores(Precision::F32, &mut att, qkv, d);
        attention_softmax(&mut att, b, t, nh);
        attention_values(Precision::F32, &mut out, &att, qkv, d);
        (att, out)
    }

    fn forward<T: Float + GemmOperand<T>>(
        qkv: &[T],
        b: usize,
        t: usize,
        nh: usize,
        hs: usize,
    ) -> (Vec<T>, Vec<T>) {
        forward_grouped(qkv, AttnShape::mha(b, t, nh, hs))
    }

    /// The three backward steps; returns dqkv (every column overwritten).
    fn backward_grouped<T: Float + GemmOperand<T>>(
        dout: &[T],
        att: &[T],
        qkv: &[T],
        d: AttnShape,
    ) -> Vec<T> {
        let AttnShape { b, t, nh, .. } = d;
        let mut datt = vec![T::from_f64(f64::NAN); b * nh * t * t];
        let mut dqkv = vec![T::from_f64(f64::NAN); qkv.len()];
        attention_values_backward(Precision::F32, &mut datt, &mut dqkv, dout, att, qkv, d);
        attention_softmax_backward(&mut datt, att, b, t, nh);
        attention_scores_backward(Precision::F32, &mut dqkv, &datt, qkv, d);
        dqkv
    }

    #[allow(clippy::too_many_arguments)]
    fn backward<T: Float + GemmOperand<T>>(
        dout: &[T],
        att: &[T],
        qkv: &[T],
        b: usize,
        t: usize,
        nh: usize,
        hs: usize,
    ) -> Vec<T> {
        backward_grouped(dout, att, qkv, AttnShape::mha(b, t, nh, hs))
    }

    /// Straightforward per-head reference (like dev/gpt2_ref.py).
    fn reference(qkv: &[f64], b: usize, t: usize, nh: usize, hs: usize) -> Vec<f64> {
        let c = nh * hs;
        let mut out = vec![0.0; b * t * c];
        let at = |bi: usize, ti: usize, part: usize, h: usize, d: usize| {
            qkv[(bi * t + ti) * 3 * c + part * c + h * hs + d]
        };
        for bi in 0..b {
            for h in 0..nh {
                for i in 0..t {
                    let s: Vec<f64> = (0..=i)
                        .map(|j| {
                            (0..hs)
                                .map(|d| at(bi, i, 0, h, d) * at(bi, j, 1, h, d))
                                .sum::<f64>()
                                / (hs as f64).sqrt()
                        })
                        .collect();
                    let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for d in 0..hs {
                        out[(bi * t + i) * c + h * hs + d] =
                            (0..=i).map(|j| e[j] / z * at(bi, j, 2, h, d)).sum();
                    }
                }
            }
        }
        out
    }

    /// Random qkv (scaled by `scale`) and dout for the f64 tests.
    fn inputs(
        seed: u64,
        scale: f64,
        b: usize,
        t: usize,
        nh: usize,
        hs: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut rng = Rng::new(seed);
        let qkv = rng
            .vec(b * t * 3 * nh * hs)
            .iter()
            .map(|x| scale * x)
            .collect();
        (qkv, rng.vec(b * t * nh * hs))
    }

    /// Against the per-head loop and finite differences, at T = 5 (one block) and T = 131
    /// (four causal blocks of 40 rows, the last ragged: [`causal_blocks`]).
    #[test]
    fn gradients_match_finite_differences() {
        assert_eq!(
            causal_blocks(131),
            [(0, 40), (40, 80), (80, 120), (120, 131)]
        );
        for (b, t, nh, hs) in [(2, 5, 2, 3), (1, 131, 2, 2)] {
            let (qkv, dout) = inputs(40, 1.5, b, t, nh, hs);
            let (att, out) = forward(&qkv, b, t, nh, hs);
            assert_close(
                "out vs reference",
                &out,
                &reference(&qkv, b, t, nh, hs),
                1e-13,
            );
            // Causal structure: zeros above the diagonal, rows sum to 1.
            for (r, row) in att.chunks(t).enumerate() {
                let i = r % t;
                assert!(row[i + 1..].iter().all(|&x| x == 0.0));
                assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-14);
            }
            let dqkv = backward(&dout, &att, &qkv, b, t, nh, hs);
            check_grad("dqkv", &qkv, &dqkv, |x| {
                dot(&dout, &forward(x, b, t, nh, hs).1)
            });
        }
    }

    /// The fused reference is the three-step path without the (T, T) tensor: in f64 both
    /// agree to rounding (T = 1, 9 and 33 rows; hs = 5), and the log-sum-exp is that of the
    /// three-step scores. Its gradients also match finite differences through
    /// [`attention_forward_fused`] itself.
    #[test]
    fn fused_matches_the_three_steps() {
        for (b, t, nh, hs) in [(1, 1, 2, 5), (2, 9, 3, 5), (1, 33, 2, 5)] {
            let (qkv, dout) = inputs(42, 2.0, b, t, nh, hs);
            let (att, out) = forward(&qkv, b, t, nh, hs);
            let mut fout = vec![f64::NAN; out.len()];
            let mut lse = vec![f64::NAN; b * nh * t];
            let d = AttnShape::mha(b, t, nh, hs);
            attention_forward_fused(&mut fout, &mut lse, &qkv, d);
            assert_close("fused out", &fout, &out, 1e-13);
            let mut scores = vec![0.0; att.len()];
            attention_scores(Precision::F32, &mut scores, &qkv, d);
            for (r, &l) in lse.iter().enumerate() {
                let row = &scores[r * t..][..=r % t];
                let want = row.iter().map(|s| s.exp()).sum::<f64>().ln();
                assert!((l - want).abs() < 1e-12, "lse[{r}] {l} vs {want}");
            }
            let mut fdqkv = vec![f64::NAN; qkv.len()];
            attention_backward_fused(&mut fdqkv, &dout, &fout, &lse, &qkv, d);
            assert_close(
                "fused dqkv",
                &fdqkv,
                &backward(&dout, &att, &qkv, b, t, nh, hs),
                1e-12,
            );
            check_grad("fused dqkv", &qkv, &fdqkv, |x| {
                let mut o = vec![0.0; out.len()];
                let mut l = vec![0.0; lse.len()];
                attention_forward_fused(&mut o, &mut l, x, d);
                dot(&dout, &o)
            });
        }
    }

    /// The f32 path (fugu-gemm strided batches over the fused layouts) against the f64 loop.
    #[test]
    fn f32_matches_f64() {
        // T = 67: one block; T = 150: four causal blocks of 40 rows, the last 30.
        for (b, t, nh, hs) in [(2, 67, 2, 20), (1, 150, 3, 16)] {
            let mut rng = Rng::new(41);
            let qkv = round_f32(&rng.vec(b * t * 3 * nh * hs));
            let dout = round_f32(&rng.vec(b * t * nh * hs));
            let (att64, out64) = forward(&qkv, b, t, nh, hs);
            let (att32, out32) = forward(&to_f32(&qkv), b, t, nh, hs);
            assert_close_f32("att", &att32, &att64, 1e-5);
            assert_close_f32("out", &out32, &out64, 1e-5);
            let d64 = backward(&dout, &att64, &qkv, b, t, nh, hs);
            let d32 = backward(&to_f32(&dout), &att32, &to_f32(&qkv), b, t, nh, hs);
            assert_close_f32("dqkv", &d32, &d64, 1e-5);
        }
    }

    /// Each backward step overwrites only its own columns of dqkv.
    #[test]
    fn backward_steps_write_their_own_columns() {
        let (b, t, nh, hs) = (2, 3, 2, 2);
        let c = nh * hs;
        let mut rng = Rng::new(42);
        let qkv = rng.vec(b * t * 3 * c);
        let dout = rng.vec(b * t * c);
        let (att, _) = forward(&qkv, b, t, nh, hs);
        let mut datt = vec![0.0; b * nh * t * t];
        let mut dqkv = vec![7.0; qkv.len()];
        let d = AttnShape::mha(b, t, nh, hs);
        attention_values_backward(Precision::F32, &mut datt, &mut dqkv, &dout, &att, &qkv, d);
        for (i, &x) in dqkv.iter().enumerate() {
            assert_eq!(x == 7.0, (i % (3 * c)) < 2 * c, "element {i}");
        }
        let mut dqkv2 = vec![7.0; qkv.len()];
        attention_softmax_backward(&mut datt, &att, b, t, nh);
        attention_scores_backward(Precision::F32, &mut dqkv2, &datt, &qkv, d);
        for (i, &x) in dqkv2.iter().enumerate() {
            assert_eq!(x == 7.0, (i % (3 * c)) >= 2 * c, "element {i}");
        }
    }
    /// Decoding token by token over a cache gives every row of the full causal attention.
    #[test]
    fn decode_matches_the_full_forward_rows() {
        let (t, nh, hs) = (7, 3, 5);
        let c = nh * hs;
        let qkv: Vec<f64> = (0..t * 3 * c)
            .map(|i| ((i * 7919) % 97) as f64 / 48.0 - 1.0)
            .collect();
        let (_, full) = forward(&qkv, 1, t, nh, hs);
        let mut kc = vec![f64::NAN; (t + 2) * c];
        let mut vc = kc.clone();
        for pos in 0..t {
            let row = &qkv[pos * 3 * c..(pos + 1) * 3 * c];
            kc[pos * c..(pos + 1) * c].copy_from_slice(&row[c..2 * c]);
            vc[pos * c..(pos + 1) * c].copy_from_slice(&row[2 * c..]);
            let mut out = vec![f64::NAN; c];
            attention_decode(&mut out, &row[..c], &kc, &vc, pos + 1, (nh, nh), hs);
            assert_close(
                &format!("decode row {pos}"),
                &out,
                &full[pos * c..(pos + 1) * c],
                1e-12,
            );
        }
    }

    /// Grouped-query attention is multi-head attention over the key/value heads repeated
    /// (`transformers`' `repeat_kv`): the same output, and each key/value head's gradient the
    /// sum of its copies'. Three-step and fused, at 4 query heads over 2 and over 1 key/value
    /// heads, T = 5 (one block) and 131 (four causal blocks); and against finite differences.
    #[test]
    fn grouped_heads_are_repeated_key_value_heads() {
        for (b, t, nh, kv, hs) in [(2, 5, 4, 2, 3), (1, 131, 4, 1, 2), (1, 9, 6, 3, 2)] {
            let d = AttnShape { b, t, nh, kv, hs };
            let (g, w, c) = (nh / kv, d.qkv_width(), nh * hs);
            let mut rng = Rng::new(70 + kv as u64);
            let qkv: Vec<f64> = rng.vec(b * t * w).iter().map(|x| 1.5 * x).collect();
            let dout = rng.vec(b * t * c);
            // The same tensor with every key/value head repeated for its group's query heads.
            let rep = |x: &[f64]| -> Vec<f64> {
                let mut m = Vec::with_capacity(b * t * 3 * c);
                for row in x.chunks(w) {
                    m.extend_from_slice(&row[..c]);
                    for part in [c, c + kv * hs] {
                        for h in 0..nh {
                            let j = h / g;
                            m.extend_from_slice(&row[part + j * hs..part + (j + 1) * hs]);
                        }
                    }
                }
                m
            };
            let (att, out) = forward_grouped(&qkv, d);
            let (matt, mout) = forward(&rep(&qkv), b, t, nh, hs);
            assert_close("out", &out, &mout, 1e-14);
            assert_close("att", &att, &matt, 1e-14);
            let dqkv = backward_grouped(&dout, &att, &qkv, d);
            let mdqkv = backward(&dout, &matt, &rep(&qkv), b, t, nh, hs);
            // Sum the repeated heads' gradients back onto their key/value heads.
            let mut want = vec![0.0; qkv.len()];
            for (row, mrow) in want.chunks_mut(w).zip(mdqkv.chunks(3 * c)) {
                row[..c].copy_from_slice(&mrow[..c]);
                for (part, mpart) in [(c, c), (c + kv * hs, 2 * c)] {
                    for h in 0..nh {
                        let j = h / g;
                        for e in 0..hs {
                            row[part + j * hs + e] += mrow[mpart + h * hs + e];
                        }
                    }
                }
            }
            assert_close("dqkv", &dqkv, &want, 1e-13);
            let mut fout = vec![f64::NAN; out.len()];
            let mut lse = vec![f64::NAN; b * nh * t];
            attention_forward_fused(&mut fout, &mut lse, &qkv, d);
            assert_close("fused out", &fout, &out, 1e-13);
            let mut fdqkv = vec![f64::NAN; qkv.len()];
            attention_backward_fused(&mut fdqkv, &dout, &fout, &lse, &qkv, d);
            assert_close("fused dqkv", &fdqkv, &want, 1e-12);
            if t < 100 {
                check_grad("dqkv", &qkv, &dqkv, |x| {
                    dot(&dout, &forward_grouped(x, d).1)
                });
            }
        }
    }

    /// The f32 path with grouped heads (strided batches over every group member) against f64,
    /// over four causal blocks.
    #[test]
    fn grouped_f32_matches_f64() {
        let d = AttnShape {
            b: 2,
            t: 150,
            nh: 4,
            kv: 2,
            hs: 16,
        };
        let mut rng = Rng::new(72);
        let qkv = round_f32(&rng.vec(d.b * d.t * d.qkv_width()));
        let dout = round_f32(&rng.vec(d.b * d.t * d.out_width()));
        let (att64, out64) = forward_grouped(&qkv, d);
        let (att32, out32) = forward_grouped(&to_f32(&qkv), d);
        assert_close_f32("att", &att32, &att64, 1e-5);
        assert_close_f32("out", &out32, &out64, 1e-5);
        let d64 = backward_grouped(&dout, &att64, &qkv, d);
        let d32 = backward_grouped(&to_f32(&dout), &att32, &to_f32(&qkv), d);
        assert_close_f32("dqkv", &d32, &d64, 1e-5);
    }

    /// Decoding with grouped heads over a cache of key/value heads gives the full forward's
    /// rows.
    #[test]
    fn grouped_decode_matches_the_full_forward_rows() {
        let d = AttnShape {
            b: 1,
            t: 6,
            nh: 6,
            kv: 2,
            hs: 3,
        };
        let (w, c, ckv) = (d.qkv_width(), d.out_width(), d.kv * d.hs);
        let qkv: Vec<f64> = (0..d.t * w)
            .map(|i| ((i * 7919) % 97) as f64 / 48.0 - 1.0)
            .collect();
        let (_, full) = forward_grouped(&qkv, d);
        let mut kc = vec![f64::NAN; (d.t + 1) * ckv];
        let mut vc = kc.clone();
        for pos in 0..d.t {
            let row = &qkv[pos * w..(pos + 1) * w];
            kc[pos * ckv..(pos + 1) * ckv].copy_from_slice(&row[c..c + ckv]);
            vc[pos * ckv..(pos + 1) * ckv].copy_from_slice(&row[c + ckv..]);
            let mut out = vec![f64::NAN; c];
            attention_decode(&mut out, &row[..c], &kc, &vc, pos + 1, (d.nh, d.kv), d.hs);
            assert_close(
                &format!("decode row {pos}"),
                &out,
                &full[pos * c..(pos + 1) * c],
                1e-12,
            );
        }
    }
}

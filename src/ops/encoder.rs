//! GPT-2 input embedding: `out[b, t] = wte[token] + wpe[t]`, with `wte` possibly one shard of a
//! vocabulary-parallel (tensor-parallel) embedding table.

use super::{Float, TableRow};
use rayon::prelude::*;

/// Local row of token `tok` in a shard holding rows `vocab_start .. vocab_start + rows`.
fn local_row(tok: u32, vocab_start: usize, rows: usize) -> Option<usize> {
    (tok as usize)
        .checked_sub(vocab_start)
        .filter(|&r| r < rows)
}

/// Token + position embedding.
///
/// * `out`: (B, T, C), **overwritten**.
/// * `tokens`: (B, T).
/// * `wte`: rows `vocab_start .. vocab_start + wte.len()/C` of the (padded) token embedding,
///   row-major with C columns. A token outside that range contributes zeros, so the outputs of
///   all vocabulary shards sum to the full embedding. Serial code passes `vocab_start = 0` and
///   the whole table.
/// * `wpe`: (n_positions ≥ T, C); row `t` is added at position `t` when `Some` (in tensor
///   parallelism exactly one shard should pass it, or the caller adds it once after the sum).
///
/// Parallel over the B·T rows.
#[allow(clippy::too_many_arguments)]
pub fn encoder_forward<T: Float, E: TableRow<T>>(
    out: &mut [T],
    tokens: &[u32],
    wte: &[E],
    vocab_start: usize,
    wpe: Option<&[T]>,
    b: usize,
    t: usize,
    c: usize,
) {
    assert!(c > 0, "encoder_forward: C must be positive");
    assert_eq!(out.len(), b * t * c, "encoder_forward: out length");
    assert_eq!(tokens.len(), b * t, "encoder_forward: tokens length");
    assert_eq!(
        wte.len() % c,
        0,
        "encoder_forward: wte length is not a multiple of C"
    );
    if let Some(wpe) = wpe {
        assert!(
            wpe.len() >= t * c,
            "encoder_forward: wpe has fewer than T rows"
        );
    }
    let rows = wte.len() / c;
    out.par_chunks_mut(c).enumerate().for_each(|(i, o)| {
        match local_row(tokens[i], vocab_start, rows) {
            Some(r) => E::widen_row(&wte[r * c..(r + 1) * c], o),
            None => o.fill(T::ZERO),
        }
        if let Some(wpe) = wpe {
            let p = i % t;
            for (x, &w) in o.iter_mut().zip(&wpe[p * c..(p + 1) * c]) {
                *x += w;
            }
        }
    });
}

/// The positions of `tokens` grouped by their local row in a vocabulary shard of `rows` rows
/// starting at `vocab_start` (a stable counting sort): `pos[start[r] .. start[r + 1]]` are the
/// positions of row `r`, increasing. Tokens outside the shard are left out. The order in which
/// [`encoder_backward`] sums, shared with device backends so that they sum in the same order.
pub fn positions_by_row(
    tokens: &[u32],
    vocab_start: usize,
    rows: usize,
) -> (Vec<usize>, Vec<usize>) {
    let mut start = vec![0usize; rows + 1];
    for &tok in tokens {
        if let Some(r) = local_row(tok, vocab_start, rows) {
            start[r + 1] += 1;
        }
    }
    for r in 0..rows {
        start[r + 1] += start[r];
    }
    let mut fill = start.clone();
    let mut pos = vec![0usize; start[rows]];
    for (i, &tok) in tokens.iter().enumerate() {
        if let Some(r) = local_row(tok, vocab_start, rows) {
            pos[fill[r]] = i;
            fill[r] += 1;
        }
    }
    (start, pos)
}

/// Backward of [`encoder_forward`].
///
/// * `dwte`: this shard's rows of the token-embedding gradient (same shape as `wte`),
///   **accumulated** (`+=`): row `token - vocab_start` gets `dout[b, t]` for every position
///   whose token is in the shard; other tokens are skipped.
/// * `dwpe`: (n_positions ≥ T, C), **accumulated**: row `t` gets `Σ_b dout[b, t]`.
/// * `dout`: (B, T, C).
///
/// Deterministic: positions are bucketed by token (a stable counting sort), then each `dwte`
/// row is summed by one task in increasing position order; each `dwpe` row sums over `b` in
/// order.
#[allow(clippy::too_many_arguments)]
pub fn encoder_backward<T: Float>(
    dwte: &mut [T],
    dwpe: Option<&mut [T]>,
    dout: &[T],
    tokens: &[u32],
    vocab_start: usize,
    b: usize,
    t: usize,
    c: usize,
) {
    assert!(c > 0, "encoder_backward: C must be positive");
    assert_eq!(dout.len(), b * t * c, "encoder_backward: dout length");
    assert_eq!(tokens.len(), b * t, "encoder_backward: tokens length");
    assert_eq!(
        dwte.len() % c,
        0,
        "encoder_backward: dwte length is not a multiple of C"
    );
    let rows = dwte.len() / c;
    let (start, pos) = positions_by_row(tokens, vocab_start, rows);
    dwte.par_chunks_mut(c).enumerate().for_each(|(r, row)| {
        for &i in &pos[start[r]..start[r + 1]] {
            for (d, &g) in row.iter_mut().zip(&dout[i * c..(i + 1) * c]) {
                *d += g;
            }
        }
    });

    if let Some(dwpe) = dwpe {
        assert!(
            dwpe.len() >= t * c,
            "encoder_backward: dwpe has fewer than T rows"
        );
        dwpe[..t * c]
            .par_chunks_mut(c)
            .enumerate()
            .for_each(|(p, row)| {
                for bi in 0..b {
                    let i = bi * t + p;
                    for (d, &g) in row.iter_mut().zip(&dout[i * c..(i + 1) * c]) {
                        *d += g;
                    }
                }
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    const B: usize = 2;
    const T: usize = 3;
    const C: usize = 5;
    const V: usize = 11;
    const VP: usize = 16;
    const NPOS: usize = 4;

    #[test]
    fn gradients_match_finite_differences() {
        let mut rng = Rng::new(10);
        // Repeated tokens, so dwte rows sum several positions.
        let tokens: Vec<u32> = vec![3, 7, 3, 10, 0, 3];
        let wte = rng.vec(VP * C);
        let wpe = rng.vec(NPOS * C);
        let dout = rng.vec(B * T * C);
        let fwd = |wte: &[f64], wpe: &[f64]| {
            let mut out = vec![f64::NAN; B * T * C];
            encoder_forward(&mut out, &tokens, wte, 0, Some(wpe), B, T, C);
            dot(&dout, &out)
        };
        let mut dwte = vec![0.0; VP * C];
        let mut dwpe = vec![0.0; NPOS * C];
        encoder_backward(&mut dwte, Some(&mut dwpe), &dout, &tokens, 0, B, T, C);
        check_grad("dwte", &wte, &dwte, |x| fwd(x, &wpe));
        check_grad("dwpe", &wpe, &dwpe, |x| fwd(&wte, x));
        // Unused rows get nothing: padded rows, and wpe rows >= T.
        assert!(dwte[V * C..].iter().all(|&x| x == 0.0));
        assert!(dwpe[T * C..].iter().all(|&x| x == 0.0));

        // Accumulation: a second call doubles everything.
        let (g1, p1) = (dwte.clone(), dwpe.clone());
        encoder_backward(&mut dwte, Some(&mut dwpe), &dout, &tokens, 0, B, T, C);
        assert!(dwte.iter().zip(&g1).all(|(a, b)| *a == 2.0 * b));
        assert!(dwpe.iter().zip(&p1).all(|(a, b)| *a == 2.0 * b));
    }

    #[test]
    fn vocab_shards_sum_to_full() {
        let mut rng = Rng::new(11);
        let tokens = rng.tokens(B * T, V);
        let wte = rng.vec(VP * C);
        let wpe = rng.vec(NPOS * C);
        let mut full = vec![f64::NAN; B * T * C];
        encoder_forward(&mut full, &tokens, &wte, 0, Some(&wpe), B, T, C);
        // Shard 0: rows 0..6 (with wpe); shard 1: rows 6..16 (without).
        let split = 6;
        let mut s0 = vec![f64::NAN; B * T * C];
        let mut s1 = vec![f64::NAN; B * T * C];
        encoder_forward(&mut s0, &tokens, &wte[..split * C], 0, Some(&wpe), B, T, C);
        encoder_forward(&mut s1, &tokens, &wte[split * C..], split, None, B, T, C);
        for i in 0..full.len() {
            assert_eq!(s0[i] + s1[i], full[i], "element {i}");
        }
        // Backward: the shards' dwte are the matching rows of the full dwte.
        let dout = rng.vec(B * T * C);
        let mut dfull = vec![0.0; VP * C];
        encoder_backward(&mut dfull, None, &dout, &tokens, 0, B, T, C);
        let mut d0 = vec![0.0; split * C];
        let mut d1 = vec![0.0; (VP - split) * C];
        encoder_backward(&mut d0, None, &dout, &tokens, 0, B, T, C);
        encoder_backward(&mut d1, None, &dout, &tokens, split, B, T, C);
        assert_eq!(&dfull[..split * C], &d0[..]);
        assert_eq!(&dfull[split * C..], &d1[..]);
    }

    #[test]
    fn f32_matches_f64_and_is_thread_count_independent() {
        let (b, t, c, v) = (3, 67, 40, 50);
        let mut rng = Rng::new(12);
        let tokens = rng.tokens(b * t, 7); // few distinct tokens: long per-row sums
        let wte = round_f32(&rng.vec(v * c));
        let wpe = round_f32(&rng.vec(t * c));
        let dout = round_f32(&rng.vec(b * t * c));
        let mut o64 = vec![0.0; b * t * c];
        let mut o32 = vec![0.0f32; b * t * c];
        encoder_forward(&mut o64, &tokens, &wte, 0, Some(&wpe), b, t, c);
        encoder_forward(
            &mut o32,
            &tokens,
            &to_f32(&wte),
            0,
            Some(&to_f32(&wpe)),
            b,
            t,
            c,
        );
        assert_close_f32("out", &o32, &o64, 1e-6);

        let run = |threads| {
            with_threads(threads, || {
                let mut dwte = vec![0.0f32; v * c];
                let mut dwpe = vec![0.0f32; t * c];
                encoder_backward(
                    &mut dwte,
                    Some(&mut dwpe),
                    &to_f32(&dout),
                    &tokens,
                    0,
                    b,
                    t,
                    c,
                );
                (dwte, dwpe)
            })
        };
        let (a1, p1) = run(1);
        let (a3, p3) = run(3);
        assert_eq!(a1, a3);
        assert_eq!(p1, p3);
    }
}

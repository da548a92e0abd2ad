//! Fused softmax + cross-entropy over the logits, with the gradient written over the logits in
//! place (no second vocabulary-sized tensor).
//!
//! Logits are (N, VP) in memory, of which the first `v_valid` columns are real vocabulary and
//! the rest padding: padding is ignored by every phase and gets gradient exactly 0.
//!
//! The work is split into phases so that a vocabulary-parallel (tensor-parallel) LM head can
//! all-reduce between them; each rank holds columns `vocab_start ..` of the vocabulary:
//!
//! 1. [`ce_row_stats`]: this rank's row maxima and sums of exponentials relative to them, in one
//!    pass over the logits (a GPU reads the vocabulary-sized tensor once here, not twice) →
//!    all-reduce the maxima (**max**, kept apart from the local ones);
//! 2. [`ce_rescale_sums`] to the global maxima → all-reduce **sum**;
//! 3. [`ce_target_logit`] (0 on ranks without the target) → all-reduce **sum**;
//! 4. [`ce_finish`]: per-row losses (identical on every rank) and this rank's dlogits.
//!
//! Serial code uses [`crossentropy_forward_backward`] (training) or [`crossentropy_forward`]
//! (evaluation). Sums of exponentials are accumulated in `f64` and rounded to `T`; the loss
//! `ln(sum) + max - target_logit` is evaluated in `f64`.

use super::Float;
use rayon::prelude::*;

fn check_logits(len: usize, n: usize, vp: usize, v_valid: usize, op: &str) {
    assert!(vp > 0, "{op}: VP must be positive");
    assert!(v_valid <= vp, "{op}: v_valid {v_valid} exceeds VP {vp}");
    assert_eq!(len, n * vp, "{op}: logits length");
}

/// Phase 1: `maxes[i] = max_{j < v_valid} logits[i, j]` (−∞ when `v_valid == 0`) and
/// `sums[i] = Σ_{j < v_valid} exp(logits[i, j] - maxes[i])` (accumulated in `f64`; 0 when
/// `v_valid == 0`). `maxes`, `sums`: (N), **overwritten**. (Here two passes over each row,
/// which stays in cache; the CUDA kernel keeps a running maximum and rescales its sum.)
pub fn ce_row_stats<T: Float>(
    maxes: &mut [T],
    sums: &mut [T],
    logits: &[T],
    n: usize,
    vp: usize,
    v_valid: usize,
) {
    check_logits(logits.len(), n, vp, v_valid, "ce_row_stats");
    assert_eq!(maxes.len(), n, "ce_row_stats: maxes length");
    assert_eq!(sums.len(), n, "ce_row_stats: sums length");
    maxes
        .par_iter_mut()
        .zip(sums.par_iter_mut())
        .zip(logits.par_chunks(vp))
        .for_each(|((m, s), row)| (*m, *s) = row_stats(&row[..v_valid]));
}

/// A row's maximum and its sum of exponentials relative to it.
fn row_stats<T: Float>(row: &[T]) -> (T, T) {
    let m = T::row_max(row);
    (m, T::from_f64(sum_exp(row, m)))
}

/// Phase 2: `sums[i]`, relative to this rank's `local_maxes[i]`, made relative to the
/// all-reduced `maxes[i]`: times `exp(local - global)`, unchanged where the two agree (every
/// row of a run without vocabulary shards), 0 for a shard without real columns (local −∞).
/// `sums`: (N), **updated**.
pub fn ce_rescale_sums<T: Float>(sums: &mut [T], local_maxes: &[T], maxes: &[T]) {
    assert!(
        local_maxes.len() == sums.len() && maxes.len() == sums.len(),
        "ce_rescale_sums: lengths"
    );
    for ((s, &l), &m) in sums.iter_mut().zip(local_maxes).zip(maxes) {
        *s = rescaled(*s, l, m);
    }
}

/// A sum of `exp(x - local)` as a sum of `exp(x - global)` (`global ≥ local`).
fn rescaled<T: Float>(sum: T, local: T, global: T) -> T {
    if local == global {
        sum
    } else if local == T::NEG_INFINITY {
        T::ZERO
    } else {
        sum * (local - global).exp()
    }
}

#[inline(always)]
pub(crate) fn row_max<T: Float>(row: &[T]) -> T {
    // Eight independent lanes so the loop vectorises; max is exact, so the order is free.
    const LANES: usize = 8;
    let mut acc = [T::NEG_INFINITY; LANES];
    let mut it = row.chunks_exact(LANES);
    for c in &mut it {
        for l in 0..LANES {
            acc[l] = acc[l].max(c[l]);
        }
    }
    let mut m = T::NEG_INFINITY;
    for &x in acc.iter().chain(it.remainder()) {
        m = m.max(x);
    }
    m
}

super::row_isa::dispatch_rows! {
    /// [`row_max`] in f32 with the widest vectors the CPU has (max is exact: the same value).
    pub(crate) fn row_max_f32(row: &[f32]) -> f32 = row_max::<f32>;
}

/// `Σ exp(x - max)` accumulated in `f64`.
fn sum_exp<T: Float>(row: &[T], max: T) -> f64 {
    T::sum_exp_row(row, max)
}

/// Local column of target `tgt` in a shard holding vocabulary `vocab_start .. + v_valid`.
fn local_target(tgt: u32, vocab_start: usize, v_valid: usize) -> Option<usize> {
    (tgt as usize)
        .checked_sub(vocab_start)
        .filter(|&j| j < v_valid)
}

/// Phase 3: `tl[i] = logits[i, targets[i] - vocab_start]` when the target lies in this shard
/// (`vocab_start ..= vocab_start + v_valid - 1`), else 0, so a sum over shards gives the
/// target logit. `tl`: (N), **overwritten**; `targets`: (N) global token ids.
pub fn ce_target_logit<T: Float>(
    tl: &mut [T],
    logits: &[T],
    targets: &[u32],
    vocab_start: usize,
    n: usize,
    vp: usize,
    v_valid: usize,
) {
    check_logits(logits.len(), n, vp, v_valid, "ce_target_logit");
    assert_eq!(tl.len(), n, "ce_target_logit: tl length");
    assert_eq!(targets.len(), n, "ce_target_logit: targets length");
    tl.par_iter_mut()
        .zip(logits.par_chunks(vp))
        .zip(targets.par_iter())
        .for_each(|((t, row), &tgt)| {
            *t = match local_target(tgt, vocab_start, v_valid) {
                Some(j) => row[j],
                None => T::ZERO,
            };
        });
}

/// Phase 4: losses and gradient, from the (all-reduced) `maxes`, `sums` and `tl`.
///
/// * `losses`: (N), **overwritten** with `ln(sums[i]) + maxes[i] - tl[i]` (evaluated in `f64`).
/// * `logits_to_dlogits`: (N, VP) logits in, **overwritten** with
///   `dloss · (softmax - onehot(target))` on the `v_valid` real columns and 0 on padding.
///   `dloss` is the gradient of the objective per row loss (e.g. `1/(B·T)` for a mean).
/// * `targets`: (N) global ids; `vocab_start` as in [`ce_target_logit`].
#[allow(clippy::too_many_arguments)]
pub fn ce_finish<T: Float>(
    losses: &mut [T],
    logits_to_dlogits: &mut [T],
    maxes: &[T],
    sums: &[T],
    tl: &[T],
    targets: &[u32],
    vocab_start: usize,
    dloss: T,
    n: usize,
    vp: usize,
    v_valid: usize,
) {
    check_logits(logits_to_dlogits.len(), n, vp, v_valid, "ce_finish");
    assert_eq!(losses.len(), n, "ce_finish: losses length");
    assert_eq!(maxes.len(), n, "ce_finish: maxes length");
    assert_eq!(sums.len(), n, "ce_finish: sums length");
    assert_eq!(tl.len(), n, "ce_finish: tl length");
    assert_eq!(targets.len(), n, "ce_finish: targets length");
    logits_to_dlogits
        .par_chunks_mut(vp)
        .zip(losses.par_iter_mut())
        .enumerate()
        .for_each(|(i, (row, loss))| {
            let target = local_target(targets[i], vocab_start, v_valid);
            let stats = (maxes[i], sums[i], tl[i]);
            *loss = finish_row(row, stats, target, dloss, v_valid);
        });
}

/// One row's loss from its statistics `(max, sum, target logit)`, and the row overwritten by
/// its gradient (`target`: the target's local column, if in this shard).
#[inline]
fn finish_row<T: Float>(
    row: &mut [T],
    (m, s, tl): (T, T, T),
    target: Option<usize>,
    dloss: T,
    v_valid: usize,
) -> T {
    let loss = T::from_f64(s.to_f64().ln() + m.to_f64() - tl.to_f64());
    let inv = T::ONE / s;
    let (real, pad) = row.split_at_mut(v_valid);
    // The target's logit, read before the row is overwritten.
    let target = target.map(|j| (j, real[j]));
    T::exp_scale_row(real, m, dloss * inv);
    if let Some((j, x)) = target {
        real[j] = dloss * ((x - m).exp() * inv - T::ONE);
    }
    pad.fill(T::ZERO);
    loss
}

/// The statistics the phases leave per row ([`ce_fused`] writes them too): maxima, sums of
/// exponentials relative to them, target logits; (N) each, **overwritten**.
pub struct CeStats<'a, T> {
    pub maxes: &'a mut [T],
    pub sums: &'a mut [T],
    pub tl: &'a mut [T],
}

/// Phases 1, 3 and 4 row by row, for logits not split across ranks (`vocab_start = 0`, so
/// phase 2 has nothing to do): each row's statistics (into `stats`), target logit, loss and
/// gradient while the row is in cache, so the logits come from memory once instead of twice.
/// The same per-row code as the phases, so the same values and bits as [`ce_row_stats`],
/// [`ce_target_logit`] and [`ce_finish`] in turn.
#[allow(clippy::too_many_arguments)]
pub fn ce_fused<T: Float>(
    losses: &mut [T],
    logits_to_dlogits: &mut [T],
    stats: CeStats<'_, T>,
    targets: &[u32],
    dloss: T,
    n: usize,
    vp: usize,
    v_valid: usize,
) {
    check_fused(
        logits_to_dlogits.len(),
        losses,
        &stats,
        targets,
        (n, vp, v_valid),
    );
    let rows = logits_to_dlogits.par_chunks_mut(vp);
    each_row(rows, losses, stats, targets, v_valid, |row, st, target| {
        finish_row(row, st, target, dloss, v_valid)
    });
}

/// [`ce_fused`] without the gradient (evaluation): the statistics, and the losses as
/// `ln(sum) + max - tl` in `T` (the backends' evaluation form); the logits are only read.
pub fn ce_fused_losses<T: Float>(
    losses: &mut [T],
    logits: &[T],
    stats: CeStats<'_, T>,
    targets: &[u32],
    (n, vp, v_valid): (usize, usize, usize),
) {
    check_fused(logits.len(), losses, &stats, targets, (n, vp, v_valid));
    let rows = logits.par_chunks(vp);
    each_row(rows, losses, stats, targets, v_valid, |_, (m, s, t), _| {
        s.ln() + m - t
    });
}

/// The one-shard rows in parallel: each row's statistics ([`fused_row_stats`]) into `stats`,
/// then `loss(row, (max, sum, target logit), target column)` into `losses`.
fn each_row<T: Float, R: AsRef<[T]> + Send>(
    rows: impl IndexedParallelIterator<Item = R>,
    losses: &mut [T],
    stats: CeStats<'_, T>,
    targets: &[u32],
    v_valid: usize,
    loss: impl Fn(R, (T, T, T), Option<usize>) -> T + Sync + Send,
) {
    let CeStats { maxes, sums, tl } = stats;
    let stats = maxes
        .par_iter_mut()
        .zip(sums.par_iter_mut())
        .zip(tl.par_iter_mut());
    rows.zip(losses.par_iter_mut())
        .zip(stats)
        .zip(targets.par_iter())
        .for_each(|(((row, l), ((m, s), t)), &tgt)| {
            let target = fused_row_stats(row.as_ref(), tgt, v_valid, (m, s, t));
            *l = loss(row, (*m, *s, *t), target);
        });
}

fn check_fused<T>(
    logits_len: usize,
    losses: &[T],
    stats: &CeStats<'_, T>,
    targets: &[u32],
    (n, vp, v_valid): (usize, usize, usize),
) {
    check_logits(logits_len, n, vp, v_valid, "ce_fused");
    for (what, len) in [
        ("losses", losses.len()),
        ("maxes", stats.maxes.len()),
        ("sums", stats.sums.len()),
        ("tl", stats.tl.len()),
        ("targets", targets.len()),
    ] {
        assert_eq!(len, n, "ce_fused: {what} length");
    }
}

/// One row's maximum, sum of exponentials and target logit (phases 1 and 3, one shard) into
/// `(m, s, t)`; returns the target's column.
#[inline]
fn fused_row_stats<T: Float>(
    row: &[T],
    tgt: u32,
    v_valid: usize,
    (m, s, t): (&mut T, &mut T, &mut T),
) -> Option<usize> {
    (*m, *s) = row_stats(&row[..v_valid]);
    let target = local_target(tgt, 0, v_valid);
    *t = target.map_or(T::ZERO, |j| row[j]);
    target
}

fn check_targets(targets: &[u32], v_valid: usize, op: &str) {
    if let Some(i) = targets.iter().position(|&t| t as usize >= v_valid) {
        panic!(
            "{op}: target {} at row {i} is not below v_valid {v_valid}",
            targets[i]
        );
    }
}

/// Serial fused forward + backward ([`ce_fused`]: the phases row by row with `vocab_start =
/// 0`; no rescaling, the maxima being global already).
///
/// * `losses`: (N), **overwritten** with the per-row losses.
/// * `logits`: (N, VP), **overwritten** with `dloss · (softmax - onehot)` (padding 0).
/// * Returns the **sum** of the N losses (accumulated in `f64`, rounded to `T`); divide by N
///   for the mean. Targets must be below `v_valid` (checked).
pub fn crossentropy_forward_backward<T: Float>(
    losses: &mut [T],
    logits: &mut [T],
    targets: &[u32],
    dloss: T,
    n: usize,
    vp: usize,
    v_valid: usize,
) -> T {
    check_logits(
        logits.len(),
        n,
        vp,
        v_valid,
        "crossentropy_forward_backward",
    );
    check_targets(targets, v_valid, "crossentropy_forward_backward");
    let stats = CeStats {
        maxes: &mut vec![T::ZERO; n],
        sums: &mut vec![T::ZERO; n],
        tl: &mut vec![T::ZERO; n],
    };
    ce_fused(losses, logits, stats, targets, dloss, n, vp, v_valid);
    T::from_f64(losses.iter().map(|l| l.to_f64()).sum())
}

/// Forward only (evaluation): `losses` (N) **overwritten** with the per-row losses; `logits`
/// are only read. Returns the sum of the losses (accumulated in `f64`). Targets must be below
/// `v_valid` (checked). Gives the same losses as [`crossentropy_forward_backward`].
pub fn crossentropy_forward<T: Float>(
    losses: &mut [T],
    logits: &[T],
    targets: &[u32],
    n: usize,
    vp: usize,
    v_valid: usize,
) -> T {
    check_logits(logits.len(), n, vp, v_valid, "crossentropy_forward");
    assert_eq!(losses.len(), n, "crossentropy_forward: losses length");
    assert_eq!(targets.len(), n, "crossentropy_forward: targets length");
    check_targets(targets, v_valid, "crossentropy_forward");
    losses
        .par_iter_mut()
        .zip(logits.par_chunks(vp))
        .zip(targets.par_iter())
        .for_each(|((loss, row), &tgt)| {
            let row = &row[..v_valid];
            let (m, s) = row_stats(row);
            *loss = T::from_f64(s.to_f64().ln() + m.to_f64() - row[tgt as usize].to_f64());
        });
    T::from_f64(losses.iter().map(|l| l.to_f64()).sum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::*;

    const N: usize = 7;
    const VP: usize = 16;
    const V: usize = 11;

    fn logits(rng: &mut Rng, n: usize, vp: usize, v: usize, pad: f64) -> Vec<f64> {
        let mut x: Vec<f64> = rng.vec(n * vp).iter().map(|x| 3.0 * x).collect();
        for row in x.chunks_mut(vp) {
            row[v..].fill(pad);
        }
        x
    }

    #[test]
    fn gradient_matches_finite_differences() {
        let mut rng = Rng::new(70);
        let x = logits(&mut rng, N, VP, V, 50.0); // large padding must be ignored
        let mut targets = rng.tokens(N, V);
        targets[0] = (V - 1) as u32; // the last real column
        let dloss = 0.37;
        let mut losses = vec![f64::NAN; N];
        let mut d = x.clone();
        let total = crossentropy_forward_backward(&mut losses, &mut d, &targets, dloss, N, VP, V);
        for i in 0..N {
            let row = &x[i * VP..i * VP + V];
            let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
            assert!((losses[i] - (lse - row[targets[i] as usize])).abs() < 1e-13);
        }
        assert!((total - losses.iter().sum::<f64>()).abs() < 1e-13);
        // Padding gets exactly zero gradient.
        for row in d.chunks(VP) {
            assert!(row[V..].iter().all(|&g| g == 0.0));
        }
        let loss = |x: &[f64]| {
            let mut l = vec![0.0; N];
            dloss * crossentropy_forward(&mut l, x, &targets, N, VP, V)
        };
        check_grad("dlogits", &x, &d, loss);
        // Forward-only agrees exactly and leaves the logits alone.
        let mut l2 = vec![f64::NAN; N];
        let x2 = x.clone();
        assert_eq!(
            crossentropy_forward(&mut l2, &x2, &targets, N, VP, V),
            total
        );
        assert_eq!(l2, losses);
        assert_eq!(x2, x);
        // NaN in the padding changes nothing.
        let mut xn = logits(&mut Rng::new(70), N, VP, V, f64::NAN);
        let mut ln = vec![0.0; N];
        crossentropy_forward_backward(&mut ln, &mut xn, &targets, dloss, N, VP, V);
        assert_eq!(ln, losses);
        assert_eq!(xn, d);
    }

    /// Two vocabulary shards (columns 0..8 and 8..16, the second with 3 real columns), combined
    /// with max / sum / sum between the phases as an all-reduce would, match the serial op.
    #[test]
    fn vocab_shards_match_serial() {
        let mut rng = Rng::new(71);
        let x = logits(&mut rng, N, VP, V, -7.0);
        let targets = rng.tokens(N, V);
        let dloss = 1.0 / N as f64;
        let mut losses = vec![0.0; N];
        let mut d = x.clone();
        crossentropy_forward_backward(&mut losses, &mut d, &targets, dloss, N, VP, V);

        let w = 8;
        let shards: Vec<(usize, usize, Vec<f64>)> = (0..2)
            .map(|s| {
                let start = s * w;
                let cols: Vec<f64> = x
                    .chunks(VP)
                    .flat_map(|r| r[start..start + w].to_vec())
                    .collect();
                (start, (V - start).min(w), cols)
            })
            .collect();
        let mut maxes = vec![f64::NEG_INFINITY; N];
        let mut sums = vec![0.0; N];
        let mut tl = vec![0.0; N];
        let mut part = vec![0.0; N];
        let stats: Vec<(Vec<f64>, Vec<f64>)> = shards
            .iter()
            .map(|(_, vv, cols)| {
                let (mut m, mut s) = (vec![f64::NAN; N], vec![f64::NAN; N]);
                ce_row_stats(&mut m, &mut s, cols, N, w, *vv);
                (m, s)
            })
            .collect();
        for (m, _) in &stats {
            maxes.iter_mut().zip(m).for_each(|(g, l)| *g = g.max(*l));
        }
        for ((start, vv, cols), (m, s)) in shards.iter().zip(&stats) {
            let mut s = s.clone();
            ce_rescale_sums(&mut s, m, &maxes);
            sums.iter_mut().zip(&s).for_each(|(g, p)| *g += p);
            ce_target_logit(&mut part, cols, &targets, *start, N, w, *vv);
            tl.iter_mut().zip(&part).for_each(|(s, p)| *s += p);
        }
        for (start, vv, cols) in &shards {
            let mut l = vec![0.0; N];
            let mut dl = cols.clone();
            ce_finish(
                &mut l, &mut dl, &maxes, &sums, &tl, &targets, *start, dloss, N, w, *vv,
            );
            assert_close("shard losses", &l, &losses, 1e-13);
            let want: Vec<f64> = d
                .chunks(VP)
                .flat_map(|r| r[*start..*start + w].to_vec())
                .collect();
            assert_close("shard dlogits", &dl, &want, 1e-13);
        }
    }

    /// Sums move to the global maximum; a shard without real columns (maximum −∞, sum 0)
    /// contributes 0, not NaN.
    #[test]
    fn rescaled_sums_and_empty_shards() {
        let (mut m, mut s) = (vec![f64::NAN; 2], vec![f64::NAN; 2]);
        ce_row_stats(&mut m, &mut s, &[1.0, 2.0, 3.0, 4.0], 2, 2, 0);
        assert_eq!((m[0], s[0]), (f64::NEG_INFINITY, 0.0));
        let mut sums = vec![2.0, 3.0, s[1]];
        ce_rescale_sums(&mut sums, &[1.0, 0.5, m[1]], &[1.0, 1.5, 2.0]);
        assert_eq!(sums[0], 2.0);
        assert!((sums[1] - 3.0 * (-1.0f64).exp()).abs() < 1e-15);
        assert_eq!(sums[2], 0.0);
    }

    /// The row-by-row forms give the phases' statistics, losses and gradient bit for bit, with
    /// a gradient and without.
    #[test]
    fn fused_rows_match_the_phases() {
        let (n, vp, v) = (37, 80, 67);
        let mut rng = Rng::new(73);
        let x = to_f32(&logits(&mut rng, n, vp, v, 9.0));
        let mut targets = rng.tokens(n, v);
        targets[3] = (v - 1) as u32;
        let dloss = 0.25f32;
        let (mut m, mut s, mut tl) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        ce_row_stats(&mut m, &mut s, &x, n, vp, v);
        ce_target_logit(&mut tl, &x, &targets, 0, n, vp, v);
        let (mut losses, mut d) = (vec![0f32; n], x.clone());
        ce_finish(
            &mut losses,
            &mut d,
            &m,
            &s,
            &tl,
            &targets,
            0,
            dloss,
            n,
            vp,
            v,
        );
        let eval: Vec<f32> = (0..n).map(|i| s[i].ln() + m[i] - tl[i]).collect();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let want_stats = (bits(&m), bits(&s), bits(&tl));
        for with_gradient in [true, false] {
            let (mut fm, mut fs, mut ft) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            let stats = CeStats {
                maxes: &mut fm,
                sums: &mut fs,
                tl: &mut ft,
            };
            let (mut fl, mut fd) = (vec![f32::NAN; n], x.clone());
            let want_losses = if with_gradient {
                ce_fused(&mut fl, &mut fd, stats, &targets, dloss, n, vp, v);
                assert_eq!(bits(&fd), bits(&d), "gradient");
                &losses
            } else {
                ce_fused_losses(&mut fl, &x, stats, &targets, (n, vp, v));
                &eval
            };
            let what = if with_gradient {
                "training"
            } else {
                "evaluation"
            };
            assert_eq!(
                (bits(&fm), bits(&fs), bits(&ft)),
                want_stats,
                "{what}: statistics"
            );
            assert_eq!(bits(&fl), bits(want_losses), "{what}: losses");
        }
    }

    #[test]
    fn f32_matches_f64() {
        let (n, vp, v) = (67, 64, 50);
        let mut rng = Rng::new(72);
        let x = round_f32(&logits(&mut rng, n, vp, v, 0.0));
        let targets = rng.tokens(n, v);
        let (mut l64, mut d64) = (vec![0.0; n], x.clone());
        let t64 = crossentropy_forward_backward(&mut l64, &mut d64, &targets, 0.5, n, vp, v);
        let (mut l32, mut d32) = (vec![0.0f32; n], to_f32(&x));
        let t32 = crossentropy_forward_backward(&mut l32, &mut d32, &targets, 0.5f32, n, vp, v);
        assert_close_f32("losses", &l32, &l64, 1e-6);
        assert_close_f32("dlogits", &d32, &d64, 1e-6);
        assert!((t32 as f64 - t64).abs() < 1e-6 * t64);
    }

    #[test]
    #[should_panic(expected = "not below v_valid")]
    fn target_in_padding_panics() {
        let mut l = vec![0.0; 1];
        crossentropy_forward(&mut l, &[0.0; 4], &[3], 1, 4, 3);
    }
}

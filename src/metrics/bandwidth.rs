//! The host's memory bandwidth, measured with an in-place triad (`a[i] += s·b[i]`, STREAM's
//! triad with the sum written over one of its inputs) on the threads the CPU ops run on
//! (rayon's pool), so that the per-op breakdown can set a memory-bound op's GB/s beside what
//! this machine's memory moves (its roofline, with the FP32 peak of [`super::machine`]).
//!
//! The bytes are counted as STREAM counts them and as the breakdown counts an op's
//! ([`super::Work`]): each array read or written once, 12 bytes per element. In place, that
//! is all the traffic there is: STREAM's `a[i] = b[i] + s·c[i]` also reads `a` into the cache
//! before writing it (write-allocate, without streaming stores), a third more than it counts,
//! so its figure sits below what the memory moves (about 20 against 27 GB/s, best figures, on a 2-core Zen 3 VM),
//! and an op that updates in place (AdamW) would show above 100% of it. An op that writes a
//! fresh output pays the write-allocate itself, and shows it as a lower percentage.
//!
//! The arrays are sized from the caches the threads share, so that the passes run from
//! memory, not from the last-level cache; the figure is the best of [`TIMED_PASSES`] passes
//! after one untimed (each thread first writes the chunks it later reads, so on a NUMA machine
//! the pages sit near the threads the pool runs the chunks on, as far as rayon's work stealing
//! keeps them there).

use rayon::prelude::*;
use std::time::Instant;

/// Timed triad passes, the best kept (interference only ever slows a pass down).
pub const TIMED_PASSES: usize = 5;

/// Elements per rayon task: 256 KiB per array, large enough for a stream per task.
const CHUNK: usize = 1 << 16;

/// Bytes of each of the two arrays for `threads` threads given the caches `caches`:
/// twice the last-level cache they use together, at least 128 MiB and at most 1 GiB.
pub fn array_bytes(caches: &fugu_gemm::CacheInfo, threads: usize) -> usize {
    let per_group = |size: usize, shared_by: usize| size * threads.div_ceil(shared_by.max(1));
    let llc =
        per_group(caches.l2, caches.l2_shared_by).max(per_group(caches.l3, caches.l3_shared_by));
    (2 * llc).clamp(128 << 20, 1 << 30)
}

/// The bandwidth in GB/s of `a[i] += s·b[i]` over arrays of `len` f32 each, on rayon's
/// current pool: the best of [`TIMED_PASSES`] passes. `None` when the arrays cannot be
/// allocated.
pub fn triad_gbs(len: usize) -> Option<f64> {
    let alloc = |v: f32| -> Option<Vec<f32>> {
        let mut x = Vec::new();
        x.try_reserve_exact(len).ok()?;
        x.resize(len, 0.0);
        // The pages are first written by the pool's threads, chunk by chunk, as the passes
        // later read them.
        x.par_chunks_mut(CHUNK).for_each(|c| c.fill(v));
        Some(x)
    };
    let (mut a, b) = (alloc(1.0)?, alloc(2.0)?);
    let scalar = 0.5f32;
    let mut best = f64::INFINITY;
    for pass in 0..=TIMED_PASSES {
        let t0 = Instant::now();
        a.par_chunks_mut(CHUNK)
            .zip(b.par_chunks(CHUNK))
            .for_each(|(a, b)| {
                for (a, &b) in a.iter_mut().zip(b) {
                    *a += scalar * b;
                }
            });
        let s = t0.elapsed().as_secs_f64();
        if pass > 0 {
            best = best.min(s);
        }
    }
    // The result is read (and exact: small integers), so no pass can be optimised away.
    let want = 1.0 + (TIMED_PASSES + 1) as f32;
    (a[len / 2] == want && best > 0.0).then(|| 12.0 * len as f64 / best / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrays_outgrow_the_caches_the_threads_share() {
        let c = fugu_gemm::CacheInfo {
            l2: 8 << 20,
            l2_shared_by: 12,
            l3: 0,
            l3_shared_by: 1,
            ..Default::default()
        };
        // A64FX: 8 MiB of L2 per 12-core CMG; 48 threads use 32 MiB of it: the 128 MiB floor.
        assert_eq!(array_bytes(&c, 48), 128 << 20);
        let zen = fugu_gemm::CacheInfo {
            l2: 1 << 20,
            l2_shared_by: 1,
            l3: 32 << 20,
            l3_shared_by: 8,
            ..Default::default()
        };
        // 32 threads over four 32 MiB L3s: twice their 128 MiB.
        assert_eq!(array_bytes(&zen, 32), 256 << 20);
        assert_eq!(array_bytes(&zen, 4096), 1 << 30);
    }

    #[test]
    fn the_triad_computes_and_times_something() {
        let gbs = triad_gbs(1 << 18).expect("4 MiB arrays");
        assert!(gbs.is_finite() && gbs > 0.0, "{gbs}");
    }
}

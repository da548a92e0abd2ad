//! Timing helpers: time several implementations in interleaved rounds, report medians.

use std::time::Instant;

/// A timed implementation: the closure that runs it once.
pub type Contender<'a> = Box<dyn FnMut() + 'a>;

/// Times several implementations of the same operation in interleaved rounds, so that drift in
/// the machine's speed (other tenants, clock changes) hits all of them alike. Each closure is
/// run once to warm up and to size its repeats so that all rounds together take about
/// `budget_s` seconds (at least `min_reps`, at most `max_reps` runs). Before each block of runs
/// the thread sleeps `settle`, so that worker threads another library left spinning (OpenBLAS
/// spins for tens of milliseconds after a call) go idle and do not steal cores from the next
/// contender; operations shorter than 10 ms are then run untimed for 10 ms to reach the steady
/// state again. Returns each closure's sorted run times in seconds.
pub fn time_interleaved(
    fs: &mut [Contender<'_>],
    budget_s: f64,
    min_reps: usize,
    max_reps: usize,
    settle: std::time::Duration,
) -> Vec<Vec<f64>> {
    const ROUNDS: usize = 5;
    // After a pause, threads sleep and cores idle; short operations are run untimed for this
    // long first so that the timed runs see the steady state.
    const WARM_S: f64 = 0.01;
    let firsts: Vec<f64> = fs
        .iter_mut()
        .map(|f| {
            std::thread::sleep(settle);
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64().max(1e-9)
        })
        .collect();
    let mut times = vec![Vec::new(); fs.len()];
    for round in 0..ROUNDS {
        for ((f, &first), out) in fs.iter_mut().zip(&firsts).zip(times.iter_mut()) {
            let n = ((budget_s / first).ceil() as usize).clamp(min_reps, max_reps);
            // Spread n runs over the rounds (the first rounds take the remainder).
            let here = n / ROUNDS + usize::from(round < n % ROUNDS);
            if here == 0 {
                continue;
            }
            std::thread::sleep(settle);
            if !settle.is_zero() && first < WARM_S {
                let t = Instant::now();
                while t.elapsed().as_secs_f64() < WARM_S {
                    f();
                }
            }
            for _ in 0..here {
                let t = Instant::now();
                f();
                out.push(t.elapsed().as_secs_f64());
            }
        }
    }
    for t in &mut times {
        t.sort_by(f64::total_cmp);
    }
    times
}

/// Median of sorted values (mean of the middle two for even lengths).
pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => 0.5 * (sorted[n / 2 - 1] + sorted[n / 2]),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn interleaved_runs_every_contender_its_share() {
        let (mut a, mut b) = (0, 0);
        let times = {
            let mut fs: Vec<super::Contender> = vec![Box::new(|| a += 1), Box::new(|| b += 1)];
            super::time_interleaved(&mut fs, 0.0, 7, 7, std::time::Duration::ZERO)
        };
        // One warm-up run each, then exactly min_reps timed runs.
        assert_eq!((a, b), (8, 8));
        assert_eq!(times.iter().map(Vec::len).collect::<Vec<_>>(), vec![7, 7]);
        assert!(times[0].windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn medians() {
        assert_eq!(super::median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(super::median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
        assert!(super::median(&[]).is_nan());
    }
}

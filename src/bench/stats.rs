//! Timing helpers: repeat a closure, report the median.

use std::time::Instant;

/// Runs `f` once to warm up, then enough times to fill about `budget_s` seconds (between
/// `min_reps` and `max_reps` runs), and returns the sorted run times in seconds.
pub fn time_runs(mut f: impl FnMut(), budget_s: f64, min_reps: usize, max_reps: usize) -> Vec<f64> {
    let t = Instant::now();
    f();
    let first = t.elapsed().as_secs_f64().max(1e-9);
    let reps = ((budget_s / first).ceil() as usize).clamp(min_reps, max_reps);
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
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
    fn medians() {
        assert_eq!(super::median(&[1.0, 2.0, 9.0]), 2.0);
        assert_eq!(super::median(&[1.0, 2.0, 4.0, 9.0]), 3.0);
        assert!(super::median(&[]).is_nan());
    }
}

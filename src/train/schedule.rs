//! Learning-rate schedules (the formulas of `dev/README.md`, which the golden files follow).

use crate::config::{LrSchedule, TrainConfig};

/// Learning rate of 0-based step `s`: linear warmup over `warmup_steps`, then cosine decay to
/// `min_lr` at the last step, or constant.
pub fn lr_at(t: &TrainConfig, s: usize) -> f64 {
    if s < t.warmup_steps {
        return t.lr * (s + 1) as f64 / t.warmup_steps as f64;
    }
    match t.lr_schedule {
        LrSchedule::Constant => t.lr,
        LrSchedule::Cosine => {
            let progress = if t.steps <= t.warmup_steps {
                1.0
            } else {
                ((s - t.warmup_steps) as f64 / (t.steps - t.warmup_steps) as f64).clamp(0.0, 1.0)
            };
            t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;

    #[test]
    fn warmup_cosine_and_constant() {
        let mut t = RunConfig::load("gpt2-tiny").unwrap().train;
        t.lr = 1e-3;
        t.min_lr = 1e-4;
        t.warmup_steps = 2;
        t.steps = 4;
        t.lr_schedule = LrSchedule::Cosine;
        // The golden file's schedule (tests/golden/README.md).
        let lrs: Vec<f64> = (0..4).map(|s| lr_at(&t, s)).collect();
        let want = [5e-4, 1e-3, 1e-3, 5.5e-4];
        for (a, b) in lrs.iter().zip(want) {
            assert!((a - b).abs() < 1e-15, "{lrs:?}");
        }
        t.lr = 1e-2;
        t.min_lr = 1e-3;
        assert_eq!(lr_at(&t, 2), 0.010000000000000002);
        t.lr_schedule = LrSchedule::Constant;
        assert_eq!(lr_at(&t, 3), 1e-2);
        assert_eq!(lr_at(&t, 0), 5e-3);
    }
}

//! Dynamic loss scaling for fp16 training (the Megatron / PyTorch `GradScaler` convention).
//!
//! fp16 has 5 exponent bits: gradients of a small loss underflow to zero. The loss gradient is
//! multiplied by the scale before the backward pass (so every activation gradient is scaled),
//! and the model divides the scale out of the f32 weight gradients before clipping and the
//! optimizer. A step whose gradient norm is not finite overflowed somewhere: it is skipped
//! (no optimizer step) and the scale halves; after [`GROWTH_INTERVAL`] clean steps in a row
//! the scale doubles. The decision uses the global gradient norm, which every rank computes
//! from the same all-reduced sum, so all ranks agree on it without another collective.

use serde::{Deserialize, Serialize};

/// Scale of the first step (2^16).
pub const INITIAL_SCALE: f32 = 65536.0;
/// Environment variable overriding [`INITIAL_SCALE`] for a new run (a power of two; tests and
/// experiments: a scale far too large makes the first steps overflow on purpose).
pub const INITIAL_SCALE_ENV: &str = "FUGU_INITIAL_LOSS_SCALE";
/// Clean steps in a row before the scale doubles.
pub const GROWTH_INTERVAL: u32 = 2000;
/// Below this the gradients overflow fp16 even without scaling: the run is diverging, and the
/// step is treated as non-finite (`--skip-nonfinite` decides) instead of scaled further down.
pub const MIN_SCALE: f32 = 1.0;

/// The scaler's state (saved in `state.json` so that a resumed fp16 run continues exactly).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    /// The loss scale of the next step.
    pub scale: f32,
    /// Clean steps since the last change of scale.
    pub clean_steps: u32,
    /// Steps skipped because their gradients overflowed, over the whole run.
    pub overflow_steps: u64,
}

/// What to do with a step after its gradient norm is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Finite gradients: take the optimizer step.
    Apply,
    /// Overflow: skip the step (the scale has been halved).
    SkipOverflow,
    /// Overflow at the smallest scale: the gradients are not finite even unscaled.
    NonFinite,
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler {
            scale: INITIAL_SCALE,
            clean_steps: 0,
            overflow_steps: 0,
        }
    }
}

impl LossScaler {
    /// The scaler of a new run: [`INITIAL_SCALE`], or the value of [`INITIAL_SCALE_ENV`].
    pub fn for_new_run() -> anyhow::Result<LossScaler> {
        let scale = match std::env::var(INITIAL_SCALE_ENV) {
            Err(_) => INITIAL_SCALE,
            Ok(v) => match v.parse::<f32>() {
                Ok(x) if x >= MIN_SCALE && x.is_finite() && x.log2().fract() == 0.0 => x,
                _ => anyhow::bail!(
                    "{INITIAL_SCALE_ENV}={v}: expected a power of two of at least {MIN_SCALE}"
                ),
            },
        };
        Ok(LossScaler {
            scale,
            ..Default::default()
        })
    }

    /// Updates the scale after a step whose (unscaled) gradient norm is `norm`.
    pub fn update(&mut self, norm: f64) -> Verdict {
        if norm.is_finite() {
            self.clean_steps += 1;
            if self.clean_steps >= GROWTH_INTERVAL {
                self.clean_steps = 0;
                // Doubling is exact; stop where f32 would overflow.
                if self.scale < f32::MAX / 2.0 {
                    self.scale *= 2.0;
                }
            }
            return Verdict::Apply;
        }
        self.clean_steps = 0;
        if self.scale <= MIN_SCALE {
            return Verdict::NonFinite;
        }
        self.scale = (self.scale * 0.5).max(MIN_SCALE);
        self.overflow_steps += 1;
        Verdict::SkipOverflow
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_halves_and_skips_clean_steps_grow() {
        let mut s = LossScaler::default();
        assert_eq!(s.scale, 65536.0);
        assert_eq!(s.update(f64::INFINITY), Verdict::SkipOverflow);
        assert_eq!(s.update(f64::NAN), Verdict::SkipOverflow);
        assert_eq!((s.scale, s.overflow_steps), (16384.0, 2));
        for i in 1..GROWTH_INTERVAL {
            assert_eq!(s.update(1.0), Verdict::Apply);
            assert_eq!(s.clean_steps, i);
        }
        assert_eq!(s.scale, 16384.0, "no growth before the interval");
        assert_eq!(s.update(1.0), Verdict::Apply);
        assert_eq!((s.scale, s.clean_steps), (32768.0, 0));
        // An overflow restarts the count.
        for _ in 0..10 {
            s.update(1.0);
        }
        s.update(f64::INFINITY);
        assert_eq!((s.scale, s.clean_steps), (16384.0, 0));
    }

    #[test]
    fn overflow_at_the_smallest_scale_is_non_finite() {
        let mut s = LossScaler {
            scale: 2.0,
            ..Default::default()
        };
        assert_eq!(s.update(f64::INFINITY), Verdict::SkipOverflow);
        assert_eq!(s.scale, 1.0);
        assert_eq!(s.update(f64::INFINITY), Verdict::NonFinite);
        assert_eq!(s.scale, 1.0);
        assert_eq!(s.overflow_steps, 1);
    }
}

//! Step progress on stderr: an indicatif bar on a terminal, plain lines otherwise (batch jobs,
//! redirected logs):
//!
//! ```text
//! step   10/300 | loss 5.1234 | lr 1.00e-03 | 12.3k tok/s | 85.2 ms | 0.12 TFLOP/s | ETA 1m23s
//! ```
//!
//! The ETA is the median of the last [`ETA_WINDOW`] step times times the steps left, so one
//! slow step (a checkpoint, an eval) does not swing it.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::collections::VecDeque;
use std::io::IsTerminal;

/// Step times the ETA's moving median looks at.
pub const ETA_WINDOW: usize = 21;

/// Whether stderr is a terminal (so [`Progress`] should draw a bar).
pub fn stderr_is_tty() -> bool {
    std::io::stderr().is_terminal()
}

/// What one progress update shows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepLine {
    /// 1-based number of the step just completed (the last step is `total_steps`).
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub tokens_per_s: f64,
    pub step_ms: f64,
    /// TFLOP/s of this process.
    pub tflops: f64,
    /// Seconds left; `None` lets [`Progress`] estimate it from recent step times.
    pub eta_secs: Option<f64>,
}

/// The training loop's progress display (see the module docs).
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
    total_steps: u64,
    log_every: u64,
    recent: VecDeque<f64>,
    printed_any: bool,
    silent: bool,
}

impl Progress {
    /// A display for steps `start_step + 1 ..= total_steps` (a resumed run passes the step it
    /// resumed from). With `is_tty` (use [`stderr_is_tty`]) a bar is drawn on stderr;
    /// otherwise [`Progress::update`] prints a line every [`Progress::log_every`] steps
    /// (default 10) and on the first and last step.
    pub fn new(total_steps: u64, start_step: u64, is_tty: bool) -> Progress {
        let bar = is_tty.then(|| {
            let bar = ProgressBar::with_draw_target(
                Some(total_steps),
                ProgressDrawTarget::stderr_with_hz(4),
            );
            bar.set_style(
                ProgressStyle::with_template("{bar:30.cyan/blue} {pos:>5}/{len} | {msg}")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            bar.set_position(start_step);
            bar
        });
        Progress {
            bar,
            total_steps,
            log_every: 10,
            recent: VecDeque::with_capacity(ETA_WINDOW),
            printed_any: false,
            silent: false,
        }
    }

    /// Prints nothing at all (the ranks other than rank 0 of a parallel job).
    pub fn silenced(mut self) -> Progress {
        self.silent = true;
        self.bar = None;
        self
    }

    /// Prints a plain line every `n` steps (0: only the first and the last).
    pub fn with_log_every(mut self, n: u64) -> Progress {
        self.log_every = n;
        self
    }

    pub fn set_log_every(&mut self, n: u64) {
        self.log_every = n;
    }

    pub fn log_every(&self) -> u64 {
        self.log_every
    }

    /// Whether a bar is drawn (else plain lines).
    pub fn is_bar(&self) -> bool {
        self.bar.is_some()
    }

    /// Seconds left after `step`: median recent step time × steps left (`None` before the
    /// first step time is known).
    pub fn eta_secs(&self, step: u64) -> Option<f64> {
        if self.recent.is_empty() {
            return None;
        }
        let mut v: Vec<f64> = self.recent.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        let mid = v.len() / 2;
        let median = if v.len() % 2 == 1 {
            v[mid]
        } else {
            0.5 * (v[mid - 1] + v[mid])
        };
        Some(median / 1e3 * self.total_steps.saturating_sub(step) as f64)
    }

    /// Records a finished step: moves the bar, or prints a plain line when due.
    pub fn update(&mut self, line: &StepLine) {
        if self.silent {
            return;
        }
        if let Some(s) = self.plain_line(line) {
            eprintln!("{s}");
        }
    }

    /// The plain line `update` would print for `line` (also updates the step-time window and
    /// the bar). Separate so it can be tested without a terminal.
    fn plain_line(&mut self, line: &StepLine) -> Option<String> {
        if line.step_ms.is_finite() && line.step_ms > 0.0 {
            if self.recent.len() == ETA_WINDOW {
                self.recent.pop_front();
            }
            self.recent.push_back(line.step_ms);
        }
        let eta = line.eta_secs.or_else(|| self.eta_secs(line.step));
        if let Some(bar) = &self.bar {
            bar.set_position(line.step.min(self.total_steps));
            bar.set_message(format_fields(line, eta));
            return None;
        }
        let due = !self.printed_any
            || line.step >= self.total_steps
            || (self.log_every > 0 && line.step.is_multiple_of(self.log_every));
        if !due {
            return None;
        }
        self.printed_any = true;
        Some(format_step_line(line, self.total_steps, eta))
    }

    /// Prints a message line (an eval result, a checkpoint) without breaking the bar.
    pub fn message(&self, msg: &str) {
        if self.silent {
            return;
        }
        match &self.bar {
            Some(bar) => bar.println(msg),
            None => eprintln!("{msg}"),
        }
    }

    /// Leaves the bar drawn at its last state.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

/// `step   10/300 | loss 5.1234 | lr 1.00e-03 | 12.3k tok/s | 85.2 ms | 0.12 TFLOP/s | ETA 1m23s`
pub fn format_step_line(line: &StepLine, total_steps: u64, eta_secs: Option<f64>) -> String {
    let width = total_steps.to_string().len().max(4);
    format!(
        "step {:>width$}/{} | {}",
        line.step,
        total_steps,
        format_fields(line, eta_secs)
    )
}

/// The fields after the step counter (also the bar's message).
pub fn format_fields(line: &StepLine, eta_secs: Option<f64>) -> String {
    format!(
        "loss {:.4} | lr {} | {} tok/s | {:.1} ms | {:.2} TFLOP/s | ETA {}",
        line.loss,
        format_sci(line.lr),
        format_si(line.tokens_per_s),
        line.step_ms,
        line.tflops,
        format_duration(eta_secs)
    )
}

/// `1.00e-03`: two decimals, exponent with a sign and at least two digits.
pub fn format_sci(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let s = format!("{x:.2e}");
    let Some((mant, exp)) = s.split_once('e') else {
        return s;
    };
    let (sign, digits) = match exp.strip_prefix('-') {
        Some(d) => ('-', d),
        None => ('+', exp),
    };
    format!("{mant}e{sign}{digits:0>2}")
}

/// `950`, `12.3k`, `4.56M`, `1.20G`.
pub fn format_si(x: f64) -> String {
    let a = x.abs();
    if !x.is_finite() {
        format!("{x}")
    } else if a < 1e3 {
        format!("{x:.0}")
    } else if a < 1e6 {
        format!("{:.1}k", x / 1e3)
    } else if a < 1e9 {
        format!("{:.2}M", x / 1e6)
    } else {
        format!("{:.2}G", x / 1e9)
    }
}

/// `45s`, `1m23s`, `2h05m`, `3d04h`; `?` when unknown.
pub fn format_duration(secs: Option<f64>) -> String {
    let Some(s) = secs.filter(|s| s.is_finite() && *s >= 0.0) else {
        return "?".into();
    };
    let s = s.round() as u64;
    let (d, h, m, sec) = (s / 86400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d{h:02}h")
    } else if h > 0 {
        format!("{h}h{m:02}m")
    } else if m > 0 {
        format!("{m}m{sec:02}s")
    } else {
        format!("{sec}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: u64, step_ms: f64) -> StepLine {
        StepLine {
            step,
            loss: 5.12341,
            lr: 1e-3,
            tokens_per_s: 12_345.0,
            step_ms,
            tflops: 0.1234,
            eta_secs: None,
        }
    }

    #[test]
    fn plain_line_format() {
        let mut l = line(10, 85.24);
        l.eta_secs = Some(83.0);
        assert_eq!(
            format_step_line(&l, 300, l.eta_secs),
            "step   10/300 | loss 5.1234 | lr 1.00e-03 | 12.3k tok/s | 85.2 ms | 0.12 TFLOP/s | ETA 1m23s"
        );
        assert_eq!(
            format_step_line(&l, 100_000, None),
            "step     10/100000 | loss 5.1234 | lr 1.00e-03 | 12.3k tok/s | 85.2 ms | 0.12 TFLOP/s | ETA ?"
        );
        l.loss = f64::NAN;
        assert!(format_step_line(&l, 300, None).contains("loss NaN"));
    }

    #[test]
    fn number_formats() {
        assert_eq!(format_sci(1e-3), "1.00e-03");
        assert_eq!(format_sci(6e-4), "6.00e-04");
        assert_eq!(format_sci(2.5), "2.50e+00");
        assert_eq!(format_sci(1.5e12), "1.50e+12");
        assert_eq!(format_sci(0.0), "0.00e+00");
        assert_eq!(format_si(950.0), "950");
        assert_eq!(format_si(12_345.0), "12.3k");
        assert_eq!(format_si(4_560_000.0), "4.56M");
        assert_eq!(format_duration(Some(45.0)), "45s");
        assert_eq!(format_duration(Some(83.0)), "1m23s");
        assert_eq!(format_duration(Some(7500.0)), "2h05m");
        assert_eq!(format_duration(Some(3.0 * 86400.0 + 4.0 * 3600.0)), "3d04h");
        assert_eq!(format_duration(Some(f64::INFINITY)), "?");
        assert_eq!(format_duration(None), "?");
    }

    #[test]
    fn prints_first_every_n_and_last() {
        let mut p = Progress::new(25, 0, false).with_log_every(10);
        assert!(!p.is_bar());
        let printed: Vec<u64> = (1..=25)
            .filter(|&s| p.plain_line(&line(s, 100.0)).is_some())
            .collect();
        assert_eq!(printed, [1, 10, 20, 25]);
        // A resumed run prints its first step too.
        let mut p = Progress::new(25, 13, false).with_log_every(10);
        let printed: Vec<u64> = (14..=25)
            .filter(|&s| p.plain_line(&line(s, 100.0)).is_some())
            .collect();
        assert_eq!(printed, [14, 20, 25]);
        // log_every 0: first and last only.
        let mut p = Progress::new(5, 0, false).with_log_every(0);
        let printed: Vec<u64> = (1..=5)
            .filter(|&s| p.plain_line(&line(s, 100.0)).is_some())
            .collect();
        assert_eq!(printed, [1, 5]);
    }

    #[test]
    fn eta_is_a_moving_median() {
        let mut p = Progress::new(100, 0, false);
        assert_eq!(p.eta_secs(0), None);
        for s in 1..=10 {
            p.plain_line(&line(s, 100.0));
        }
        // One slow step (a checkpoint) does not move the median.
        p.plain_line(&line(11, 5000.0));
        assert_eq!(p.eta_secs(11), Some(0.1 * 89.0));
        let out = p.plain_line(&line(20, 100.0)).unwrap();
        assert!(out.ends_with("ETA 8s"), "{out}");
        // The window forgets old steps.
        for s in 21..=21 + ETA_WINDOW as u64 {
            p.plain_line(&line(s, 200.0));
        }
        let left = 100 - (21 + ETA_WINDOW as u64);
        assert_eq!(p.eta_secs(21 + ETA_WINDOW as u64), Some(0.2 * left as f64));
        // A given ETA wins.
        let mut l = line(30, 100.0);
        l.eta_secs = Some(61.0);
        assert!(p.plain_line(&l).unwrap().ends_with("ETA 1m01s"));
    }

    #[test]
    fn bar_mode_prints_no_lines() {
        let mut p = Progress::new(10, 0, true);
        assert!(p.is_bar());
        for s in 1..=10 {
            assert!(p.plain_line(&line(s, 10.0)).is_none());
        }
        p.message("eval: val_loss 4.2");
        p.finish();
    }
}

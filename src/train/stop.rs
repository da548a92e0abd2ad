//! Stopping before a batch system's time limit: SIGUSR1 / SIGTERM (Slurm's `--signal`,
//! `scancel --signal`, a forwarded signal), SIGINT (Ctrl-C; a second one exits at once, with
//! no checkpoint) and a wall-clock deadline (`--deadline`,
//! `SLURM_JOB_END_TIME`, `PJM_ELAPSE_LIMIT`). The trainer checks [`StopWatch::should_stop`]
//! after every step; all ranks agree through a max-all-reduce, write one complete checkpoint
//! and exit with [`super::EXIT_CHECKPOINTED`].

use anyhow::{bail, Result};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The last stop signal received (0 = none).
static SIGNALLED: AtomicI32 = AtomicI32::new(0);

/// Whether this process says, the moment the first stop signal arrives, what happens next
/// (rank 0 only: every rank of an MPI job gets the signal).
static ANNOUNCE: AtomicBool = AtomicBool::new(false);

/// What the first stop signal starts, said at once: a step can take minutes, and a Ctrl-C
/// that seems ignored gets pressed again.
fn first_signal_message(sig: libc::c_int) -> &'static [u8] {
    match sig {
        libc::SIGINT => b"\nfugu: SIGINT: finishing this step, then writing a checkpoint and exiting (code 4); press Ctrl-C again to quit at once without one\n",
        libc::SIGTERM => b"\nfugu: SIGTERM: finishing this step, then writing a checkpoint and exiting (code 4)\n",
        _ => b"\nfugu: SIGUSR1: finishing this step, then writing a checkpoint and exiting (code 4)\n",
    }
}

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic swap, `write` and `_exit`: all async-signal-safe.
    let before = SIGNALLED.swap(sig, Ordering::SeqCst);
    if before == libc::SIGINT && sig == libc::SIGINT {
        // SAFETY: `_exit` is async-signal-safe; a second Ctrl-C means "quit now".
        unsafe { libc::_exit(130) };
    }
    if before == 0 && ANNOUNCE.load(Ordering::SeqCst) {
        let msg = first_signal_message(sig);
        // SAFETY: `write` is async-signal-safe; the buffer is a static byte string of that
        // length. A failed write is ignored (nothing else could be done here).
        unsafe { libc::write(2, msg.as_ptr() as *const libc::c_void, msg.len()) };
    }
}

/// Installs the SIGUSR1, SIGTERM and SIGINT handlers; `announce`: this process prints, on the
/// first of them, what happens next.
pub fn install_handlers(announce: bool) {
    ANNOUNCE.store(announce, Ordering::SeqCst);
    for sig in [libc::SIGUSR1, libc::SIGTERM, libc::SIGINT] {
        // SAFETY: `on_signal` is an `extern "C"` function that only stores to an atomic, which
        // is async-signal-safe; `signal` is called before any other thread could race on the
        // disposition of these signals.
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }
}

/// The signal received so far, if any (`SIGUSR1`, `SIGTERM`, `SIGINT`).
pub fn signalled() -> Option<&'static str> {
    match SIGNALLED.load(Ordering::SeqCst) {
        0 => None,
        s if s == libc::SIGUSR1 => Some("SIGUSR1"),
        s if s == libc::SIGTERM => Some("SIGTERM"),
        s if s == libc::SIGINT => Some("SIGINT"),
        _ => Some("a signal"),
    }
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Parses a duration: plain seconds, `MM:SS`, `HH:MM:SS` or `D-HH:MM:SS`.
pub fn parse_duration(s: &str) -> Result<f64> {
    let s = s.trim();
    let (days, rest) = match s.split_once('-') {
        Some((d, r)) => (d.parse::<f64>().ok(), r),
        None => (Some(0.0), s),
    };
    let parts: Vec<Option<f64>> = rest.split(':').map(|p| p.parse::<f64>().ok()).collect();
    let secs = match (days, parts.as_slice()) {
        (Some(d), [Some(x)]) => d * 86400.0 + x,
        (Some(d), [Some(m), Some(x)]) => d * 86400.0 + m * 60.0 + x,
        (Some(d), [Some(h), Some(m), Some(x)]) => d * 86400.0 + h * 3600.0 + m * 60.0 + x,
        _ => bail!("{s:?} is not a duration (seconds, MM:SS, HH:MM:SS or D-HH:MM:SS)"),
    };
    if !(secs.is_finite() && secs >= 0.0) {
        bail!("{s:?} is not a non-negative duration");
    }
    Ok(secs)
}

/// Where the deadline came from and when it is (Unix seconds).
#[derive(Clone, Debug, PartialEq)]
pub struct Deadline {
    pub at_unix: f64,
    pub source: String,
}

/// Parses an RFC 3339 time (`2026-11-21T09:30:00Z`, `2026-11-21T18:30:00+09:00`, fractional
/// seconds allowed) to Unix seconds.
pub fn parse_rfc3339(s: &str) -> Option<f64> {
    let s = s.trim();
    let (date, rest) = s.split_once(['T', 't', ' '])?;
    let mut d = date.split('-');
    let (y, mo, da): (i64, i64, i64) = (
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
        d.next()?.parse().ok()?,
    );
    if d.next().is_some() || !(1..=12).contains(&mo) || !(1..=31).contains(&da) {
        return None;
    }
    let (clock, offset) = if let Some(c) = rest.strip_suffix(['Z', 'z']) {
        (c, 0.0)
    } else {
        let i = rest.rfind(['+', '-'])?;
        let (c, off) = rest.split_at(i);
        let sign = if off.starts_with('-') { -1.0 } else { 1.0 };
        let (oh, om) = off[1..].split_once(':')?;
        (
            c,
            sign * (oh.parse::<f64>().ok()? * 3600.0 + om.parse::<f64>().ok()? * 60.0),
        )
    };
    let mut c = clock.split(':');
    let (h, mi, sec): (f64, f64, f64) = (
        c.next()?.parse().ok()?,
        c.next()?.parse().ok()?,
        c.next()?.parse().ok()?,
    );
    if c.next().is_some() || h >= 24.0 || mi >= 60.0 || sec >= 61.0 {
        return None;
    }
    // Days from 1970-01-01 in the proleptic Gregorian calendar (Howard Hinnant's algorithm).
    let (y2, m2) = if mo <= 2 {
        (y - 1, mo + 9)
    } else {
        (y, mo - 3)
    };
    let era = y2.div_euclid(400);
    let yoe = y2 - era * 400;
    let doy = (153 * m2 + 2) / 5 + da - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86400.0 + h * 3600.0 + mi * 60.0 + sec - offset)
}

/// The run's deadline: `--deadline` (an RFC 3339 time, `+DURATION` from now, a Unix time, or a
/// duration from now), else `SLURM_JOB_END_TIME` (Unix seconds), else `PJM_ELAPSE_LIMIT` (a duration counted
/// from `FUGU_JOB_START`, Unix seconds, which the job scripts export at the top of the job,
/// or from now).
pub fn find_deadline(arg: Option<&str>) -> Result<Option<Deadline>> {
    let now = now_unix();
    if let Some(a) = arg {
        let at = if let Some(t) = parse_rfc3339(a) {
            t
        } else if let Some(d) = a.strip_prefix('+') {
            now + parse_duration(d)?
        } else {
            let v = parse_duration(a).map_err(|e| anyhow::anyhow!("--deadline {a}: {e}"))?;
            // A Unix time is large; anything else is a duration from now.
            if v > 1e9 {
                v
            } else {
                now + v
            }
        };
        return Ok(Some(Deadline {
            at_unix: at,
            source: format!("--deadline {a}"),
        }));
    }
    if let Ok(end) = std::env::var("SLURM_JOB_END_TIME") {
        if let Ok(at) = end.trim().parse::<f64>() {
            return Ok(Some(Deadline {
                at_unix: at,
                source: "SLURM_JOB_END_TIME".into(),
            }));
        }
    }
    if let Ok(lim) = std::env::var("PJM_ELAPSE_LIMIT") {
        let secs =
            parse_duration(&lim).map_err(|e| anyhow::anyhow!("PJM_ELAPSE_LIMIT={lim}: {e}"))?;
        let start = std::env::var("FUGU_JOB_START")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .unwrap_or(now);
        return Ok(Some(Deadline {
            at_unix: start + secs,
            source: format!("PJM_ELAPSE_LIMIT={lim}"),
        }));
    }
    Ok(None)
}

/// Decides, after each step, whether to checkpoint and stop now.
pub struct StopWatch {
    deadline: Option<Deadline>,
    margin: Duration,
    longest_step: Duration,
    longest_ckpt: Duration,
}

impl StopWatch {
    pub fn new(deadline: Option<Deadline>, margin: Duration) -> StopWatch {
        StopWatch {
            deadline,
            margin,
            longest_step: Duration::ZERO,
            longest_ckpt: Duration::ZERO,
        }
    }

    pub fn deadline(&self) -> Option<&Deadline> {
        self.deadline.as_ref()
    }

    pub fn record_step(&mut self, d: Duration) {
        self.longest_step = self.longest_step.max(d);
    }

    pub fn record_checkpoint(&mut self, d: Duration) {
        self.longest_ckpt = self.longest_ckpt.max(d);
    }

    /// This rank's reason to stop now: a stop signal, or too little time left for one more
    /// step and a checkpoint (longest seen of each, doubled, plus the margin).
    pub fn should_stop(&self) -> Option<String> {
        if let Some(s) = signalled() {
            return Some(format!("received {s}"));
        }
        let d = self.deadline.as_ref()?;
        let need =
            2.0 * (self.longest_step + self.longest_ckpt).as_secs_f64() + self.margin.as_secs_f64();
        let left = d.at_unix - now_unix();
        (left < need).then(|| {
            format!(
                "{:.0} s left before the deadline ({}), {need:.0} s needed for another step and a checkpoint",
                left.max(0.0),
                d.source
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90").unwrap(), 90.0);
        assert_eq!(parse_duration("01:30").unwrap(), 90.0);
        assert_eq!(parse_duration("1:00:00").unwrap(), 3600.0);
        assert_eq!(parse_duration("1-00:00:10").unwrap(), 86410.0);
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("-5").is_err());
    }

    #[test]
    fn rfc3339() {
        assert_eq!(parse_rfc3339("1970-01-01T00:00:00Z"), Some(0.0));
        assert_eq!(parse_rfc3339("2026-11-21T09:30:00Z"), Some(1_795_253_400.0));
        assert_eq!(
            parse_rfc3339("2026-11-21T18:30:00+09:00"),
            parse_rfc3339("2026-11-21T09:30:00Z")
        );
        assert_eq!(
            parse_rfc3339("2000-02-29T12:00:00.5-01:30"),
            Some(951_831_000.5)
        );
        assert_eq!(parse_rfc3339("2026-13-01T00:00:00Z"), None);
        assert_eq!(parse_rfc3339("90"), None);
    }

    #[test]
    fn deadline_arithmetic() {
        let d = find_deadline(Some("+100")).unwrap().unwrap();
        assert!((d.at_unix - now_unix() - 100.0).abs() < 5.0);
        let w = StopWatch::new(Some(d), Duration::from_secs(10));
        assert!(w.should_stop().is_none());
        let past = Deadline {
            at_unix: now_unix() + 5.0,
            source: "test".into(),
        };
        let w = StopWatch::new(Some(past), Duration::from_secs(10));
        assert!(w.should_stop().unwrap().contains("test"));
    }
}

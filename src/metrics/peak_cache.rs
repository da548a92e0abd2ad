//! The per-machine cache of the measured FP32 peak.
//!
//! Measuring the peak at every start (an FMA loop, ~0.2 s) alone gives a different figure each
//! time, and a low one on a busy machine, so "% of peak" could exceed 100%. Instead the highest
//! measurement on a machine is stored, keyed by CPU model and ISA, and every run and benchmark
//! divides by it ([`cached_peak`]): the figure only moves up, towards the hardware ceiling. A
//! measurement above the peak (GEMM rows, training steps) is reported with a warning that names
//! the cache.
//!
//! The file is JSON, `{"format": "fugu-peak-cache-v1", "entries": {"CPU|isa": {...}}}`, at
//! `FUGU_PEAK_CACHE` (a path; `off` disables the cache), else
//! `$XDG_CACHE_HOME/fugu/peak.json`, else `$HOME/.cache/fugu/peak.json`. It is replaced
//! atomically (temporary file, rename), so concurrent ranks writing it race harmlessly.
//! `FUGU_PEAK_REMEASURE=1` replaces the entry with the new measurement even when lower (a
//! machine whose clock or power settings were lowered).
//!
//! The memory bandwidth ([`super::bandwidth`], an in-place triad) is kept the same way, keyed by
//! CPU model and thread count (`"bandwidth"` in the file; absent from files written before it).

use fugu_gemm::peak::{measured_peak, Peak, PeakSource};
use fugu_gemm::Isa;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const FORMAT: &str = "fugu-peak-cache-v1";

#[derive(Debug, Default, Serialize, Deserialize)]
struct CacheFile {
    format: String,
    entries: BTreeMap<String, Entry>,
    #[serde(default)]
    bandwidth: BTreeMap<String, BandwidthEntry>,
}

/// One cached measurement.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Entry {
    pub per_core_gflops: f64,
    /// Unix time of the measurement.
    pub measured_at: u64,
    pub fugu_version: String,
}

/// One cached memory bandwidth.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BandwidthEntry {
    /// GB/s of the in-place triad over all the threads of the key.
    pub gbs: f64,
    /// Unix time of the measurement.
    pub measured_at: u64,
    pub fugu_version: String,
}

/// Where the cache lives, or `None` when disabled or no home is known.
pub fn cache_path() -> Option<PathBuf> {
    crate::user_cache::cache_path("FUGU_PEAK_CACHE", "peak.json")
}

fn key(cpu: &str, isa: Isa) -> String {
    format!("{cpu}|{isa}")
}

fn read(path: &Path) -> CacheFile {
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<CacheFile>(&b).ok())
        .filter(|c| c.format == FORMAT)
        .unwrap_or_default()
}

fn write(path: &Path, cache: &CacheFile) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec_pretty(cache).unwrap_or_default())?;
    std::fs::rename(&tmp, path)
}

/// The cached peak of `cpu` running `isa`, if any.
pub fn lookup(path: &Path, cpu: &str, isa: Isa) -> Option<Entry> {
    read(path).entries.get(&key(cpu, isa)).cloned()
}

/// The peak for `threads` threads of `cpu` running `isa`: measured now (an FMA loop, ~0.2 s)
/// and compared with the cache at `path`. Interference only ever slows the loop down, so the
/// higher of the two is the better estimate of the hardware: a higher measurement replaces
/// the entry, a lower one (a busy machine) is ignored and the cached figure used. So the
/// peak every run divides by only moves up, towards the ceiling, and is the same for every
/// run once the machine has been measured idle. `FUGU_PEAK_REMEASURE=1` replaces the entry
/// with the new measurement whatever it is. Without a cache path: the measurement.
pub fn cached_peak(path: Option<&Path>, cpu: &str, isa: Isa, threads: usize) -> Peak {
    let measured_peak = measured_peak(isa, threads);
    let k = key(cpu, isa);
    let kept = path.and_then(|p| {
        keep_highest(
            "peak",
            p,
            measured_peak.per_core_gflops,
            |c| c.entries.get(&k).map(|e| e.per_core_gflops),
            |c, per_core_gflops, measured_at, fugu_version| {
                c.entries.insert(
                    k.clone(),
                    Entry {
                        per_core_gflops,
                        measured_at,
                        fugu_version,
                    },
                );
            },
        )
    });
    match kept {
        Some(per_core_gflops) => Peak {
            per_core_gflops,
            threads,
            source: PeakSource::Cached { isa },
        },
        None => measured_peak,
    }
}

/// The memory bandwidth of `threads` threads of `cpu` in GB/s and whether it came from the
/// cache: `measured` (a [`super::bandwidth::triad_gbs`] run) kept or replaced by the rule of
/// [`cached_peak`]. Without a cache path: the measurement.
pub fn cached_bandwidth(
    path: Option<&Path>,
    cpu: &str,
    threads: usize,
    measured: f64,
) -> (f64, bool) {
    let k = format!("{cpu}|{threads} threads|in-place triad");
    let kept = path.and_then(|p| {
        keep_highest(
            "memory bandwidth",
            p,
            measured,
            |c| c.bandwidth.get(&k).map(|e| e.gbs),
            |c, gbs, measured_at, fugu_version| {
                c.bandwidth.insert(
                    k.clone(),
                    BandwidthEntry {
                        gbs,
                        measured_at,
                        fugu_version,
                    },
                );
            },
        )
    });
    match kept {
        Some(gbs) => (gbs, true),
        None => (measured, false),
    }
}

/// The cached figure `stored` reads from the cache at `path` when it is at least `measured`
/// (and `FUGU_PEAK_REMEASURE` is not `1`); otherwise `None`, after `store(cache, measured,
/// unix time, version)` wrote the measurement into the file. A file that cannot be written
/// costs a warning naming `what` was measured, not the run.
fn keep_highest(
    what: &str,
    path: &Path,
    measured: f64,
    stored: impl FnOnce(&CacheFile) -> Option<f64>,
    store: impl FnOnce(&mut CacheFile, f64, u64, String),
) -> Option<f64> {
    let remeasure = std::env::var("FUGU_PEAK_REMEASURE").is_ok_and(|v| v == "1");
    let mut cache = read(path);
    if let Some(cached) = stored(&cache) {
        if !remeasure && cached >= measured {
            return Some(cached);
        }
    }
    cache.format = FORMAT.into();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    store(&mut cache, measured, now, env!("CARGO_PKG_VERSION").into());
    if let Err(e) = write(path, &cache) {
        eprintln!(
            "warning: could not store the measured {what} in {}: {e} (runs may divide by \
             different figures)",
            path.display()
        );
    }
    None
}

/// A warning for a measured rate above the peak it is divided by, or `None`. `what` names the
/// measurement (`GEMM 1024x1024x1024`, `training step 12`).
pub fn above_peak_warning(what: &str, pct: f64, peak: &str) -> Option<String> {
    (pct > 100.0).then(|| {
        let hint = match cache_path() {
            Some(p) => format!(
                "the peak was probably measured on a busy machine: measure it again with \
                 FUGU_PEAK_REMEASURE=1 (cache: {})",
                p.display()
            ),
            None => "the peak was probably measured on a busy machine".into(),
        };
        format!("warning: {what} ran at {pct:.1}% of the {peak}: above the peak; {hint}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_measurement_is_kept() {
        let dir = std::env::temp_dir().join(format!("fugu-peak-{}", std::process::id()));
        let path = dir.join("peak.json");
        let first = cached_peak(Some(&path), "Test CPU", Isa::Portable, 2);
        assert!(matches!(first.source, PeakSource::Measured { .. }));
        assert!(first.per_core_gflops > 0.0);
        let stored = lookup(&path, "Test CPU", Isa::Portable).unwrap();
        // serde_json parses floats to within an ulp (no `float_roundtrip` feature).
        let rel = (stored.per_core_gflops - first.per_core_gflops).abs() / first.per_core_gflops;
        assert!(
            rel < 1e-12,
            "{} vs {}",
            stored.per_core_gflops,
            first.per_core_gflops
        );
        // A cached figure above anything this machine measures is kept and used.
        let mut cache = read(&path);
        cache
            .entries
            .get_mut(&key("Test CPU", Isa::Portable))
            .unwrap()
            .per_core_gflops = 1e9;
        write(&path, &cache).unwrap();
        let again = cached_peak(Some(&path), "Test CPU", Isa::Portable, 4);
        assert_eq!(again.source, PeakSource::Cached { isa: Isa::Portable });
        assert_eq!((again.per_core_gflops, again.threads), (1e9, 4));
        // A cached figure below the measurement is replaced by it.
        cache
            .entries
            .get_mut(&key("Test CPU", Isa::Portable))
            .unwrap()
            .per_core_gflops = 1e-9;
        write(&path, &cache).unwrap();
        let up = cached_peak(Some(&path), "Test CPU", Isa::Portable, 1);
        assert!(matches!(up.source, PeakSource::Measured { .. }));
        assert!(
            lookup(&path, "Test CPU", Isa::Portable)
                .unwrap()
                .per_core_gflops
                > 1e-9
        );
        // Another CPU model is another entry; a damaged file is measured over, not an error.
        assert!(lookup(&path, "Other CPU", Isa::Portable).is_none());
        std::fs::write(&path, b"{not json").unwrap();
        let fresh = cached_peak(Some(&path), "Test CPU", Isa::Portable, 1);
        assert!(matches!(fresh.source, PeakSource::Measured { .. }));
        assert!(lookup(&path, "Test CPU", Isa::Portable).is_some());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_highest_bandwidth_is_kept_beside_the_peak() {
        let dir = std::env::temp_dir().join(format!("fugu-bw-{}", std::process::id()));
        let path = dir.join("peak.json");
        let peak = cached_peak(Some(&path), "Test CPU", Isa::Portable, 1);
        assert_eq!(
            cached_bandwidth(Some(&path), "Test CPU", 2, 10.0),
            (10.0, false)
        );
        // A busy machine's lower figure: the cached one is used, and stays.
        assert_eq!(
            cached_bandwidth(Some(&path), "Test CPU", 2, 5.0),
            (10.0, true)
        );
        assert_eq!(
            cached_bandwidth(Some(&path), "Test CPU", 2, 20.0),
            (20.0, false)
        );
        assert_eq!(
            cached_bandwidth(Some(&path), "Test CPU", 2, 15.0),
            (20.0, true)
        );
        // Another thread count is another entry; the FMA peak is untouched by all of it.
        assert_eq!(
            cached_bandwidth(Some(&path), "Test CPU", 4, 1.0),
            (1.0, false)
        );
        let entry = lookup(&path, "Test CPU", Isa::Portable).unwrap();
        assert!(
            (entry.per_core_gflops - peak.per_core_gflops).abs() <= 1e-9 * entry.per_core_gflops
        );
        // A cache written before the bandwidth existed reads as having none.
        std::fs::write(&path, br#"{"format": "fugu-peak-cache-v1", "entries": {}}"#).unwrap();
        assert_eq!(
            cached_bandwidth(Some(&path), "Test CPU", 2, 3.0),
            (3.0, false)
        );
        assert_eq!(cached_bandwidth(None, "Test CPU", 2, 2.0), (2.0, false));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn above_peak_is_named() {
        assert!(above_peak_warning("x", 99.0, "peak").is_none());
        let w = above_peak_warning("GEMM 8x8x8", 120.0, "peak of 10 GFLOP/s").unwrap();
        assert!(w.contains("GEMM 8x8x8") && w.contains("120.0%"), "{w}");
    }
}

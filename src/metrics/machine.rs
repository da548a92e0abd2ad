//! What the run ran on: host, CPU, the fugu-gemm kernel and thread layout, and the FP32 peak
//! that `peak_pct` divides by. The peak comes from [`machine_peak`], which `fugu bench gemm`
//! uses too, so the trainer's "% of peak" and the benchmark's are the same figure.

use anyhow::{bail, Context, Result};
use fugu_gemm::kernel::KernelChoice;
use fugu_gemm::peak::{Peak, PeakSource};
use fugu_gemm::{Isa, Runtime, RuntimeConfig, Topology};
use serde::{Deserialize, Serialize};

/// The machine and layout a run used (written into the `metrics.jsonl` header).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MachineInfo {
    pub hostname: String,
    /// `model name` from /proc/cpuinfo, or the aarch64 implementer/part (`Fujitsu A64FX`).
    pub cpu_model: String,
    /// `std::env::consts::ARCH`.
    pub arch: String,
    /// Online logical CPUs of the machine.
    pub logical_cpus: usize,
    /// CPUs this process may run on (its affinity mask), if the OS says.
    pub allowed_cpus: Option<usize>,
    /// The fugu-gemm micro-kernel ISA (`sve`, `avx2`, ...).
    pub isa: String,
    /// fugu-gemm threads over all domains.
    pub threads: usize,
    /// Number of NUMA domains (CMGs) fugu-gemm uses.
    pub domains: usize,
    /// Domains x threads per domain, e.g. `4x12`; `2x[12,11]` when uneven.
    pub layout: String,
    /// fugu-gemm's topology line, e.g. `2 domains x [12, 12] threads (sysfs, pinned)`.
    pub topology: String,
    pub pinned: bool,
    /// FP32 peak of one core, GFLOP/s.
    pub peak_gflops_per_core: f64,
    /// FP32 peak of `threads` cores, GFLOP/s (what `peak_pct` divides by).
    pub peak_gflops: f64,
    /// How the peak was obtained, as in `fugu bench gemm`'s `peak_source` column
    /// (`measured (avx2 FMA loop)` or `given`).
    pub peak_source: String,
    /// The sentence `fugu bench gemm` prints (`peak 96.0 GFLOP/s = 2 cores x ...`).
    pub peak_description: String,
    /// The GEMM kernel of each precision (`FUGU_GEMM_F16` changes f16's), as
    /// [`fugu_gemm::kernel::describe_kernels`] writes it; empty in headers from before.
    #[serde(default)]
    pub gemm_kernels: String,
}

/// The FP32 peak for `threads` threads running `isa`: `per_core_gflops` (a command-line
/// override such as `--peak-per-core`) if given, else `FUGU_PEAK_GFLOPS_PER_CORE`, else the
/// per-machine cached measurement (an FMA loop on one core, measured the first time; see
/// [`super::peak_cache`]). Shared by `fugu bench gemm` and the trainer.
pub fn machine_peak(isa: Isa, threads: usize, per_core_gflops: Option<f64>) -> Result<Peak> {
    if let Some(p) = per_core_gflops {
        if !(p > 0.0 && p.is_finite()) {
            bail!("the per-core peak must be a positive number of GFLOP/s, got {p}");
        }
        return Ok(Peak {
            per_core_gflops: p,
            threads,
            source: PeakSource::Given,
        });
    }
    if std::env::var_os("FUGU_PEAK_GFLOPS_PER_CORE").is_some() {
        return Ok(fugu_gemm::peak::machine_peak(isa, threads)?);
    }
    let cache = super::peak_cache::cache_path();
    Ok(super::peak_cache::cached_peak(
        cache.as_deref(),
        &cpu_model(),
        isa,
        threads,
    ))
}

/// The memory bandwidth of rayon's pool (the threads the CPU ops run on) in GB/s, and where
/// it comes from: `FUGU_PEAK_GBS` when set (all the threads' GB/s, e.g. a STREAM figure for the
/// node), else an in-place triad ([`super::bandwidth`], about 0.5 s) kept or replaced by the
/// per-machine cache ([`super::peak_cache::cached_bandwidth`]) like the FMA peak. `None` when
/// the arrays cannot be allocated. (A malformed `FUGU_PEAK_GBS` is an error at
/// [`MachineInfo::detect`]; here it costs a warning and a measurement.)
pub fn memory_bandwidth() -> Option<(f64, String)> {
    match bandwidth_override() {
        Ok(Some(gbs)) => return Some((gbs, "given by FUGU_PEAK_GBS".into())),
        Ok(None) => {}
        Err(e) => eprintln!("warning: {e:#}; measuring the bandwidth instead"),
    }
    let threads = rayon::current_num_threads();
    let caches = fugu_gemm::Runtime::global()
        .map(|r| r.caches())
        .unwrap_or_default();
    let bytes = super::bandwidth::array_bytes(&caches, threads);
    let measured = super::bandwidth::triad_gbs(bytes / 4)?;
    let cache = super::peak_cache::cache_path();
    let (gbs, cached) =
        super::peak_cache::cached_bandwidth(cache.as_deref(), &cpu_model(), threads, measured);
    let how = if cached {
        "cached: best measured on this machine"
    } else {
        "measured now"
    };
    Some((
        gbs,
        format!(
            "a += s*b over 2 x {} MiB, {threads} threads, best of {} ({how})",
            bytes >> 20,
            super::bandwidth::TIMED_PASSES
        ),
    ))
}

/// Checks the peak settings of the environment (`FUGU_PEAK_GFLOPS_PER_CORE`, `FUGU_PEAK_GBS`)
/// without measuring anything: a malformed one is an error naming it, before a run creates
/// anything.
pub fn check_peak_settings() -> Result<()> {
    if std::env::var_os("FUGU_PEAK_GFLOPS_PER_CORE").is_some() {
        fugu_gemm::peak::machine_peak(Isa::Portable, 1)?;
    }
    bandwidth_override()?;
    Ok(())
}

/// `FUGU_PEAK_GBS`, the memory bandwidth a run's breakdown sets its ops' GB/s against, if set:
/// a positive number of GB/s, or an error naming the variable and the value.
pub fn bandwidth_override() -> Result<Option<f64>> {
    let Some(v) = std::env::var_os("FUGU_PEAK_GBS") else {
        return Ok(None);
    };
    let v = v.to_string_lossy();
    match v.trim().parse::<f64>() {
        Ok(x) if x > 0.0 && x.is_finite() => Ok(Some(x)),
        _ => bail!("FUGU_PEAK_GBS={v}: expected a positive number of GB/s (the memory bandwidth of a process's threads)"),
    }
}

/// `DxT`, or `Dx[t0,t1,..]` when the domains have different thread counts.
pub fn layout_string(topology: &Topology) -> String {
    let t: Vec<usize> = topology.domains.iter().map(|d| d.threads).collect();
    match t.first() {
        Some(&first) if t.iter().all(|&x| x == first) => format!("{}x{}", t.len(), first),
        _ => format!(
            "{}x[{}]",
            t.len(),
            t.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
    }
}

impl MachineInfo {
    /// Describes a run of `isa` over `topology` with `peak` (no measuring, no system calls
    /// other than host and CPU names).
    pub fn from_parts(
        isa: Isa,
        topology: &Topology,
        peak: &Peak,
        gemm_kernels: String,
    ) -> MachineInfo {
        MachineInfo {
            hostname: hostname(),
            cpu_model: cpu_model(),
            arch: std::env::consts::ARCH.to_string(),
            logical_cpus: logical_cpus(),
            allowed_cpus: fugu_gemm::topology::allowed_cpus().map(|c| c.len()),
            isa: isa.to_string(),
            threads: topology.threads(),
            domains: topology.domains.len(),
            layout: layout_string(topology),
            topology: topology.describe(),
            pinned: topology.pin,
            peak_gflops_per_core: peak.per_core_gflops,
            peak_gflops: peak.total_gflops(),
            peak_source: peak.source.to_string(),
            peak_description: peak.describe(),
            gemm_kernels,
        }
    }

    /// The machine as `rt` uses it, with the peak for `rt`'s kernel and thread count, exactly
    /// as `fugu bench gemm` derives it. `per_core_gflops` overrides the peak like
    /// `--peak-per-core`. Measuring takes about 0.2 s.
    pub fn for_runtime(rt: &Runtime, per_core_gflops: Option<f64>) -> Result<MachineInfo> {
        let isa = rt.kernel().isa;
        let peak = machine_peak(isa, rt.threads(), per_core_gflops)?;
        Ok(MachineInfo::from_parts(
            isa,
            rt.topology(),
            &peak,
            rt.describe_kernels(),
        ))
    }

    /// The machine as a fugu-gemm runtime configured from the environment (`FUGU_GEMM_ISA`,
    /// `FUGU_CMGS`, `FUGU_PIN`) and capped at `threads` threads (0: no cap) would use it, with
    /// its peak (`FUGU_PEAK_GFLOPS_PER_CORE` or measured). Starts no thread pool. Prefer
    /// [`MachineInfo::for_runtime`] when the runtime exists. Fails on a malformed `FUGU_*`
    /// setting, as `fugu bench gemm` does.
    pub fn detect(threads: usize) -> Result<MachineInfo> {
        let mut cfg = RuntimeConfig::from_env().context("reading FUGU_* settings")?;
        if threads > 0 {
            cfg.topology.max_threads = Some(threads);
        }
        let choice = KernelChoice::new(cfg.isa)?;
        let kernel = choice.f32;
        let topology = Topology::build(&cfg.topology);
        let peak = machine_peak(kernel.isa, topology.threads(), None)?;
        bandwidth_override()?;
        let kernels =
            fugu_gemm::kernel::describe_kernels(&choice.all(cfg.f16_chunked, cfg.bf16_native));
        Ok(MachineInfo::from_parts(
            kernel.isa, &topology, &peak, kernels,
        ))
    }
}

/// [`MachineInfo::detect`].
pub fn detect(threads: usize) -> Result<MachineInfo> {
    MachineInfo::detect(threads)
}

/// The host name (`gethostname`), or `$HOSTNAME`, or `unknown`.
pub fn hostname() -> String {
    #[cfg(unix)]
    {
        let mut buf = [0u8; 256];
        // SAFETY: buf is writable for buf.len() bytes; gethostname writes at most that many.
        let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
        if rc == 0 {
            let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
            let s = String::from_utf8_lossy(&buf[..end]).trim().to_string();
            if !s.is_empty() {
                return s;
            }
        }
    }
    std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown".into())
}

/// The CPU model from /proc/cpuinfo (`model name`, or implementer and part on aarch64).
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| cpu_model_from_cpuinfo(&s))
        .unwrap_or_else(|| format!("unknown {}", std::env::consts::ARCH))
}

fn cpu_model_from_cpuinfo(text: &str) -> Option<String> {
    let field = |key: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    if let Some(m) = field("model name").filter(|m| !m.is_empty()) {
        return Some(m);
    }
    let imp = field("CPU implementer")?;
    let part = field("CPU part").unwrap_or_default();
    let known = match (
        imp.to_ascii_lowercase().as_str(),
        part.to_ascii_lowercase().as_str(),
    ) {
        ("0x46", "0x001") => Some("Fujitsu A64FX"),
        ("0x41", "0xd0c") => Some("Arm Neoverse N1"),
        ("0x41", "0xd40") => Some("Arm Neoverse V1"),
        ("0x41", "0xd4f") => Some("Arm Neoverse V2"),
        ("0x41", "0xd49") => Some("Arm Neoverse N2"),
        _ => None,
    };
    Some(match known {
        Some(k) => k.to_string(),
        None => format!("CPU implementer {imp} part {part}"),
    })
}

/// Online logical CPUs (`/sys/devices/system/cpu/online`), else `available_parallelism`.
pub fn logical_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| count_cpulist(&s))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Counts the CPUs of a sysfs cpulist such as `0-3,8,10-11`.
fn count_cpulist(s: &str) -> Option<usize> {
    let mut n = 0;
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.trim().parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

/// A `Key:   N kB` line of a Linux `/proc` file, in bytes.
fn proc_kib(path: &str, key: &str) -> Option<u64> {
    let s = std::fs::read_to_string(path).ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Peak resident set size of this process in bytes (`VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<u64> {
    proc_kib("/proc/self/status", "VmHWM:")
}

/// Host memory available to new allocations (`MemAvailable`), if known.
pub fn host_memory_available() -> Option<u64> {
    proc_kib("/proc/meminfo", "MemAvailable:")
}

#[cfg(test)]
mod tests {
    use super::*;
    use fugu_gemm::TopologyRequest;

    #[test]
    fn given_peak_and_layout() {
        let topo = Topology::build(&TopologyRequest {
            layout: Some((2, 3)),
            ..Default::default()
        });
        let peak = machine_peak(Isa::Portable, topo.threads(), Some(12.5)).unwrap();
        assert_eq!(peak.source, PeakSource::Given);
        let m = MachineInfo::from_parts(Isa::Portable, &topo, &peak, "k".into());
        assert_eq!(m.threads, 6);
        assert_eq!(m.domains, 2);
        assert_eq!(m.layout, "2x3");
        assert_eq!(m.peak_gflops, 75.0);
        assert_eq!(m.peak_gflops_per_core, 12.5);
        assert_eq!(m.peak_source, "given");
        assert_eq!(m.peak_description, peak.describe());
        assert_eq!(m.isa, "portable");
        assert!(m.logical_cpus >= 1);
        assert!(!m.hostname.is_empty() && !m.cpu_model.is_empty());
        // Round-trips through JSON.
        let back: MachineInfo = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);

        assert!(machine_peak(Isa::Portable, 1, Some(0.0)).is_err());
        assert!(machine_peak(Isa::Portable, 1, Some(f64::NAN)).is_err());
    }

    #[test]
    fn uneven_layout() {
        let topo = Topology::build(&TopologyRequest {
            layout: Some((2, 3)),
            max_threads: Some(5),
            ..Default::default()
        });
        assert_eq!(layout_string(&topo), "2x[3,2]");
    }

    #[test]
    fn cpuinfo_parsing() {
        assert_eq!(
            cpu_model_from_cpuinfo("processor\t: 0\nmodel name\t: AMD EPYC 7763\n").unwrap(),
            "AMD EPYC 7763"
        );
        let a64fx =
            "processor\t: 12\nCPU implementer\t: 0x46\nCPU architecture: 8\nCPU part\t: 0x001\n";
        assert_eq!(cpu_model_from_cpuinfo(a64fx).unwrap(), "Fujitsu A64FX");
        assert!(cpu_model_from_cpuinfo("processor: 0\n").is_none());
        assert_eq!(count_cpulist("0-3,8,10-11\n"), Some(7));
        assert_eq!(count_cpulist("0"), Some(1));
        assert_eq!(count_cpulist(""), None);
    }

    #[test]
    fn detect_measures_a_peak() {
        let m = detect(1).unwrap();
        assert_eq!(m.threads, 1);
        assert!(m.peak_gflops > 0.0 && m.peak_gflops.is_finite());
        assert_eq!(m.peak_gflops, m.peak_gflops_per_core);
    }

    #[test]
    fn for_runtime_matches_the_runtime() {
        let rt = Runtime::new(RuntimeConfig {
            topology: TopologyRequest {
                layout: Some((1, 1)),
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        let m = MachineInfo::for_runtime(&rt, Some(10.0)).unwrap();
        assert_eq!(m.threads, 1);
        assert_eq!(m.layout, "1x1");
        assert_eq!(m.isa, rt.kernel().isa.to_string());
        assert_eq!(m.peak_gflops, 10.0);
    }
}

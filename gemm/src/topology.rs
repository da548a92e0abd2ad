//! NUMA domains (CMGs) and the threads fugu-gemm runs in each.
//!
//! Detection reads `/sys/devices/system/node/node*/cpulist` and keeps only the CPUs this
//! process may run on (`sched_getaffinity`), so a rank bound to one CMG by its launcher sees one
//! domain, and a whole-node process on a Fugaku node sees NUMA nodes 4–7 (CPUs 12–59).
//!
//! Environment:
//! * `FUGU_CMGS=DxT` simulates D domains of T threads on any machine (no pinning);
//! * `FUGU_NUM_THREADS=N` caps the total number of threads (spread over the domains);
//! * `FUGU_PIN=0|1` turns pinning off or on (default: on when the launcher restricted our CPU
//!   set, or when we use every allowed CPU across several domains).

use crate::blocking::parse_cpulist;
use crate::error::GemmError;
use std::fs;

/// One NUMA domain: the threads fugu-gemm runs there and the CPUs they may be pinned to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DomainSpec {
    /// NUMA node id (`None` when simulated or unknown).
    pub node: Option<usize>,
    /// CPUs of this domain that the process may use (empty when simulated).
    pub cpus: Vec<usize>,
    /// Number of threads (team workers) of this domain.
    pub threads: usize,
}

/// Where a topology came from (printed by benchmarks and the trainer header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopologySource {
    /// Read from sysfs.
    Sysfs,
    /// Simulated by `FUGU_CMGS` (or an explicit layout).
    Simulated,
    /// No NUMA information: one domain with every allowed CPU.
    Flat,
}

/// The domains fugu-gemm spreads its threads over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub domains: Vec<DomainSpec>,
    pub source: TopologySource,
    /// Whether team workers are pinned to their domain's CPUs.
    pub pin: bool,
}

/// Parses `FUGU_CMGS`-style layouts: `4x12` means 4 domains of 12 threads.
pub fn parse_layout(s: &str) -> Result<(usize, usize), GemmError> {
    let bad = || GemmError::Config {
        what: "CMG layout (FUGU_CMGS)".into(),
        value: s.into(),
        expected: "DOMAINSxTHREADS with both at least 1, e.g. 4x12".into(),
    };
    let (d, t) = s.trim().split_once(['x', 'X']).ok_or_else(bad)?;
    let d: usize = d.trim().parse().map_err(|_| bad())?;
    let t: usize = t.trim().parse().map_err(|_| bad())?;
    if d == 0 || t == 0 || d * t > 4096 {
        return Err(bad());
    }
    Ok((d, t))
}

/// The CPUs this process may run on, or `None` if the OS does not say.
pub fn allowed_cpus() -> Option<Vec<usize>> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most size_of::<cpu_set_t>()
        // bytes into it, and CPU_ISSET only reads it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return None;
            }
            let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect();
            (!cpus.is_empty()).then_some(cpus)
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// Pins the calling thread to `cpus`. Failures are ignored: pinning is an optimisation.
pub(crate) fn pin_current_thread(cpus: &[usize]) {
    #[cfg(target_os = "linux")]
    {
        if cpus.is_empty() {
            return;
        }
        // SAFETY: as in allowed_cpus; CPU_SET writes inside the zeroed set for ids below
        // CPU_SETSIZE, which the filter guarantees.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
                libc::CPU_SET(c, &mut set);
            }
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = cpus;
    }
}

fn online_cpus() -> usize {
    fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| parse_cpulist(&s))
        .map(|v| v.len())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn sysfs_nodes() -> Vec<(usize, Vec<usize>)> {
    let mut nodes = Vec::new();
    let Ok(entries) = fs::read_dir("/sys/devices/system/node") else {
        return nodes;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(id) = name
            .strip_prefix("node")
            .and_then(|s| s.parse::<usize>().ok())
        else {
            continue;
        };
        if let Some(cpus) = fs::read_to_string(e.path().join("cpulist"))
            .ok()
            .and_then(|s| parse_cpulist(&s))
        {
            if !cpus.is_empty() {
                nodes.push((id, cpus));
            }
        }
    }
    nodes.sort();
    nodes
}

/// Caps the total thread count at `max`, handing threads out round-robin over the domains so
/// they stay balanced; domains left with no thread are dropped.
fn cap_threads(domains: &mut Vec<DomainSpec>, max: usize) {
    let total: usize = domains.iter().map(|d| d.threads).sum();
    if max >= total {
        return;
    }
    let mut give = vec![0usize; domains.len()];
    let mut left = max.max(1);
    while left > 0 {
        for (g, d) in give.iter_mut().zip(domains.iter()) {
            if left > 0 && *g < d.threads {
                *g += 1;
                left -= 1;
            }
        }
    }
    for (d, g) in domains.iter_mut().zip(give) {
        d.threads = g;
    }
    domains.retain(|d| d.threads > 0);
}

/// How the caller wants the topology built.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TopologyRequest {
    /// Simulated layout (domains, threads per domain), like `FUGU_CMGS`.
    pub layout: Option<(usize, usize)>,
    /// Cap on the total number of threads, like `FUGU_NUM_THREADS`.
    pub max_threads: Option<usize>,
    /// Force pinning on or off.
    pub pin: Option<bool>,
}

impl TopologyRequest {
    /// Reads `FUGU_CMGS`, `FUGU_NUM_THREADS` and `FUGU_PIN`.
    pub fn from_env() -> Result<TopologyRequest, GemmError> {
        let mut r = TopologyRequest::default();
        if let Ok(v) = std::env::var("FUGU_CMGS") {
            r.layout = Some(parse_layout(&v)?);
        }
        if let Ok(v) = std::env::var("FUGU_NUM_THREADS") {
            r.max_threads = Some(v.trim().parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                GemmError::Config {
                    what: "FUGU_NUM_THREADS".into(),
                    value: v.clone(),
                    expected: "a positive integer".into(),
                }
            })?);
        }
        if let Ok(v) = std::env::var("FUGU_PIN") {
            r.pin = Some(match v.trim() {
                "1" | "true" | "on" => true,
                "0" | "false" | "off" => false,
                _ => {
                    return Err(GemmError::Config {
                        what: "FUGU_PIN".into(),
                        value: v,
                        expected: "0 or 1".into(),
                    })
                }
            });
        }
        Ok(r)
    }
}

impl Topology {
    /// Builds the topology for a request (see the module docs for the rules).
    pub fn build(req: &TopologyRequest) -> Topology {
        let allowed = allowed_cpus();
        let (mut domains, source) = if let Some((d, t)) = req.layout {
            let ds = (0..d)
                .map(|_| DomainSpec {
                    node: None,
                    cpus: Vec::new(),
                    threads: t,
                })
                .collect();
            (ds, TopologySource::Simulated)
        } else {
            let allowed_v = allowed
                .clone()
                .unwrap_or_else(|| (0..online_cpus()).collect());
            let mut ds: Vec<DomainSpec> = sysfs_nodes()
                .into_iter()
                .map(|(id, cpus)| {
                    let cpus: Vec<usize> =
                        cpus.into_iter().filter(|c| allowed_v.contains(c)).collect();
                    DomainSpec {
                        node: Some(id),
                        threads: cpus.len(),
                        cpus,
                    }
                })
                .filter(|d| d.threads > 0)
                .collect();
            if ds.is_empty() {
                ds.push(DomainSpec {
                    node: None,
                    threads: allowed_v.len().max(1),
                    cpus: allowed_v,
                });
                (ds, TopologySource::Flat)
            } else {
                (ds, TopologySource::Sysfs)
            }
        };
        if let Some(max) = req.max_threads {
            cap_threads(&mut domains, max);
        }
        let pin = req.pin.unwrap_or_else(|| {
            if source == TopologySource::Simulated {
                return false;
            }
            let n_allowed = allowed.as_ref().map_or(0, |a| a.len());
            let bound_by_launcher = n_allowed > 0 && n_allowed < online_cpus();
            let owns_all =
                domains.len() > 1 && domains.iter().map(|d| d.threads).sum::<usize>() == n_allowed;
            bound_by_launcher || owns_all
        });
        Topology {
            domains,
            source,
            pin,
        }
    }

    /// Total threads over all domains.
    pub fn threads(&self) -> usize {
        self.domains.iter().map(|d| d.threads).sum()
    }

    /// A one-line description such as `2 domains x [12, 12] threads (sysfs, pinned)`.
    pub fn describe(&self) -> String {
        let src = match self.source {
            TopologySource::Sysfs => "sysfs",
            TopologySource::Simulated => "simulated",
            TopologySource::Flat => "flat",
        };
        format!(
            "{} domain{} x {:?} threads ({}, {})",
            self.domains.len(),
            if self.domains.len() == 1 { "" } else { "s" },
            self.domains.iter().map(|d| d.threads).collect::<Vec<_>>(),
            src,
            if self.pin { "pinned" } else { "not pinned" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        assert_eq!(parse_layout("4x12").unwrap(), (4, 12));
        assert_eq!(parse_layout(" 2X1 ").unwrap(), (2, 1));
        assert!(parse_layout("4").is_err());
        assert!(parse_layout("0x3").is_err());
        assert!(parse_layout("ax3").is_err());
    }

    #[test]
    fn simulated_with_cap() {
        let t = Topology::build(&TopologyRequest {
            layout: Some((4, 12)),
            max_threads: Some(6),
            pin: None,
        });
        assert_eq!(t.domains.len(), 4);
        assert_eq!(t.threads(), 6);
        assert!(!t.pin);
        let t = Topology::build(&TopologyRequest {
            layout: Some((4, 12)),
            max_threads: Some(2),
            pin: None,
        });
        assert_eq!(t.domains.len(), 2);
        assert_eq!(t.threads(), 2);
    }

    #[test]
    fn detected_has_threads() {
        let t = Topology::build(&TopologyRequest::default());
        assert!(t.threads() >= 1);
        assert!(t.domains.iter().all(|d| d.threads >= 1));
    }
}

//! Cache-derived block sizes (mc, kc, nc) for the five-loop driver.
//!
//! Sizes follow the BLIS analytical model: a B̃ micro-panel (kc × nr) stays in half of L1, an Ã
//! block (mc × kc) in half of the L2 a thread can use, and the B̃ panel (kc × nc) in half of the
//! L3 share of one domain (or a fixed large nc on machines without an L3, such as A64FX, where
//! it streams from HBM). `FUGU_GEMM_MC`, `FUGU_GEMM_KC` and `FUGU_GEMM_NC` override each.

use crate::error::GemmError;
use std::fs;

/// Cache sizes in bytes and how many CPUs share each level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheInfo {
    pub l1d: usize,
    pub l2: usize,
    pub l2_shared_by: usize,
    pub l3: usize,
    pub l3_shared_by: usize,
}

impl Default for CacheInfo {
    /// Conservative sizes for machines whose sysfs says nothing.
    fn default() -> Self {
        CacheInfo {
            l1d: 32 << 10,
            l2: 512 << 10,
            l2_shared_by: 1,
            l3: 0,
            l3_shared_by: 1,
        }
    }
}

fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.chars().last()? {
        'K' => (&s[..s.len() - 1], 1usize << 10),
        'M' => (&s[..s.len() - 1], 1 << 20),
        'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok().map(|n| n * mult)
}

/// Counts the CPUs in a sysfs cpulist such as `0-11,24-35`.
pub(crate) fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?);
                if b < a || b - a > 1 << 20 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    Some(out)
}

impl CacheInfo {
    /// Bytes of L3 one domain's threads can count on: its share of the L3, scaled back up to at
    /// most 16 sharers (0 when there is no L3).
    pub fn l3_share(&self) -> usize {
        self.l3 / self.l3_shared_by.max(1) * self.l3_shared_by.min(16)
    }

    /// Reads `/sys/devices/system/cpu/cpuN/cache/index*/`; missing levels keep their defaults.
    pub fn detect(cpu: usize) -> CacheInfo {
        let mut info = CacheInfo::default();
        let dir = format!("/sys/devices/system/cpu/cpu{cpu}/cache");
        let Ok(entries) = fs::read_dir(&dir) else {
            return info;
        };
        let mut found_l3 = false;
        for e in entries.flatten() {
            let p = e.path();
            let read = |f: &str| fs::read_to_string(p.join(f)).ok();
            let (Some(level), Some(kind), Some(size)) = (read("level"), read("type"), read("size"))
            else {
                continue;
            };
            let Some(size) = parse_size(&size) else {
                continue;
            };
            let shared = read("shared_cpu_list")
                .and_then(|s| parse_cpulist(&s))
                .map(|v| v.len().max(1))
                .unwrap_or(1);
            match (level.trim(), kind.trim()) {
                ("1", "Data") => info.l1d = size,
                ("2", "Unified") | ("2", "Data") => {
                    info.l2 = size;
                    info.l2_shared_by = shared;
                }
                ("3", "Unified") => {
                    info.l3 = size;
                    info.l3_shared_by = shared;
                    found_l3 = true;
                }
                _ => {}
            }
        }
        if !found_l3 {
            info.l3 = 0;
        }
        info
    }
}

/// Block sizes of the five loops, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocking {
    pub mc: usize,
    pub kc: usize,
    pub nc: usize,
}

/// The variable that overrides kc.
const KC_VAR: &str = "FUGU_GEMM_KC";

/// True when `FUGU_GEMM_KC` is set, so kc must be used as given.
pub(crate) fn kc_overridden() -> bool {
    std::env::var_os(KC_VAR).is_some()
}

fn round_down(x: usize, to: usize) -> usize {
    (x / to).max(1) * to
}

impl Blocking {
    /// Derives block sizes for an `mr × nr` kernel from the cache sizes.
    pub fn derive(c: &CacheInfo, mr: usize, nr: usize) -> Blocking {
        let kc = round_down((c.l1d / 2) / (nr * 4), 16).clamp(64, 1024);
        let mc = round_down((c.l2 / 2) / (kc * 4), mr).min(round_down(4096, mr));
        let nc = if c.l3 > 0 {
            round_down((c.l3_share() / 2) / (kc * 4), nr).clamp(nr * 16, 8192 / nr * nr)
        } else {
            round_down(4096, nr)
        };
        Blocking { mc, kc, nc }
    }

    /// Applies `FUGU_GEMM_MC/KC/NC` overrides, rounding mc to mr and nc to nr.
    pub fn with_env_overrides(mut self, mr: usize, nr: usize) -> Result<Blocking, GemmError> {
        for (var, slot, unit) in [
            ("FUGU_GEMM_MC", &mut self.mc, mr),
            (KC_VAR, &mut self.kc, 1),
            ("FUGU_GEMM_NC", &mut self.nc, nr),
        ] {
            if let Ok(v) = std::env::var(var) {
                let n: usize =
                    v.trim()
                        .parse()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| GemmError::Config {
                            what: var.into(),
                            value: v.clone(),
                            expected: "a positive integer".into(),
                        })?;
                *slot = n.div_ceil(unit) * unit;
            }
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist(""), Some(vec![]));
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("x"), None);
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("32K"), Some(32768));
        assert_eq!(parse_size("8M\n"), Some(8 << 20));
        assert_eq!(parse_size("12"), Some(12));
    }

    #[test]
    fn a64fx_blocking_is_sane() {
        let c = CacheInfo {
            l1d: 64 << 10,
            l2: 8 << 20,
            l2_shared_by: 12,
            l3: 0,
            l3_shared_by: 1,
        };
        let b = Blocking::derive(&c, 32, 10);
        assert!(b.kc * 10 * 4 <= 32 << 10);
        assert!(b.mc * b.kc * 4 <= 4 << 20);
        assert_eq!(b.mc % 32, 0);
        assert_eq!(b.nc % 10, 0);
    }
}

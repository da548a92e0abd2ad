//! Cache-derived block sizes (mc, kc, nc, nb) for the BLIS-loop driver.
//!
//! The sizes follow the analytical model of Low, Igual, Smith and Quintana-Ortí, "Analytical
//! modeling is enough for high-performance BLIS" (ACM TOMS 43(2), 2016), for the two loop orders
//! of `docs/KERNELS.md`, chosen by the kernel's [`Kernel::l1_panel`](crate::Kernel):
//! [`Side::B`], jr outside ir, so one B̃ micro-panel (kc × nr) is reused from L1 by every Ã
//! micro-panel (mr × kc) of the Ã block, and the Ã micro-panels stream through L1 from L2; or
//! [`Side::A`], BLIS's order, where one Ã micro-panel stays in L1 while a B̃ block of nb columns
//! streams through L1 from L2 under it.
//! A cache of `W` ways of `S/W` bytes each is modelled as set-associative LRU; data packed
//! contiguously spreads evenly over the sets, so a buffer of `x` bytes takes `ceil(x / (S/W))`
//! ways of every set.
//!
//! * **kc (L1).** Between two uses of the same B̃ line, the kernel touches one whole Ã
//!   micro-panel and the rest of B̃, so B̃ stays in L1 only if both fit, plus one free way: while
//!   the next Ã micro-panel comes in, LRU must evict lines of the previous Ã micro-panel, not of
//!   B̃. With `C_A` ways for Ã and `C_B` for B̃:
//!
//!   `ceil(mr·kc·4 / (S1/W1)) + ceil(nr·kc·4 / (S1/W1)) <= W1 − 1`
//!
//!   kc is the largest value that satisfies it with the ways split in the ratio mr : nr:
//!   `C_A = floor((W1 − 1)·mr / (mr + nr))`, `kc = C_A·(S1/W1) / (mr·4)` (then `C_B =
//!   ceil(C_A·nr/mr) <= W1 − 1 − C_A`). The old rule, "B̃ micro-panel in half of L1", ignored the
//!   Ã micro-panel: on Zen 3 (AVX2 16 × 6) it gave kc = 672, a 43 KiB Ã micro-panel streaming
//!   through a 32 KiB L1, which evicts B̃ on every micro-kernel call. The same inequality holds
//!   with the roles swapped (Ã kept, B̃ streaming), so both orders get the same kc.
//! * **mc and nb (L2).** The Ã block (mc × kc) stays in L2 while the current B̃ block(s) of nb
//!   columns and C tiles pass through it, again with one free way:
//!
//!   `ceil(mc·kc·4 / (S2/W2)) + ceil(t·nb·kc·4 / (S2/W2)) <= W2 − 1`
//!
//!   With B̃ in L1 the B̃ block is one micro-panel, `nb = nr`. With Ã in L1 it must hold at
//!   least `NB_PANELS` = 16 micro-panels, so that 16 kernel calls share each fill of L1 with
//!   an Ã micro-panel: `C_N = ceil(t·16·nr·kc·4 / (S2/W2))` ways, nb the most columns (a
//!   multiple of nr) those ways hold, and mc the most rows the other `W2 − 1 − C_N` hold.
//!   `t` is the number of threads whose B̃ blocks share that L2. With a private L2
//!   (x86, Neoverse) `t = 1` and each thread has its own Ã block. With an L2 shared by a domain
//!   (A64FX CMG: 12 cores, 8 MiB) the default split is `jr` (one Ã block for the domain, see
//!   [`crate::SplitMode`]), so the Ã block gets the whole L2 and `t` = the sharers; if `ic` split
//!   is forced there, every thread packs its own Ã block into its share of the L2 (`S2/t` bytes,
//!   still `W2` ways) with `t = 1`.
//! * **nc (L3).** The B̃ panel (kc × nc), shared by the threads of a domain, takes at most half of
//!   the domain's L3 share (the other half is left to the threads' Ã blocks, which L2 victims
//!   bring into a victim L3 such as AMD's, and to C): `nc·kc·4 <= L3_share / 2`, nc in
//!   `[16·nr, 8192]`. Without an L3 (A64FX: B̃ streams from HBM) nc is 4096.
//!
//! mc is capped at 4096. Associativity comes from sysfs (`ways_of_associativity`); when it is
//! missing, 8 ways are assumed. `FUGU_GEMM_MC`, `FUGU_GEMM_KC`, `FUGU_GEMM_NC` and
//! `FUGU_GEMM_NB` override each size.
//!
//! Derived sizes (asserted, with the inequalities, by the unit tests below):
//!
//! | machine | L1d / L2 / L3 share | tile (L1 panel) | mc | kc | nc | nb | old mc, kc |
//! |---|---|---|---|---|---|---|---|
//! | Zen 3 | 32K 8-way / 512K 8-way / 32M | avx2 16 × 6 (Ã) | 256 | 320 | 8190 | 102 | 96, 672 |
//! | Zen 4 | 32K 8-way / 1M 8-way / 32M | avx2 16 × 6 (Ã) | 608 | 320 | 8190 | 102 | 96, 672 |
//! | Zen 4 | 32K 8-way / 1M 8-way / 32M | avx512 32 × 12 (B̃) | 1216 | 160 | 8184 | 12 | 384, 336 |
//! | Zen 5 | 48K 12-way / 1M 16-way / 32M | avx512 32 × 12 (B̃) | 896 | 256 | 8184 | 12 | 256, 512 |
//! | Skylake-X (18 cores) | 32K 8-way / 1M 16-way / 11M | avx512 32 × 12 (B̃) | 1408 | 160 | 8184 | 12 | 384, 336 |
//! | Neoverse V1 (Graviton 3) | 64K 4-way / 1M 8-way / 8M | sve-256 16 × 10 (B̃) | 768 | 256 | 4090 | 10 | 160, 816 |
//! | A64FX CMG | 64K 4-way / 8M 16-way shared by 12 / none | sve 32 × 10 (B̃) | 4096 | 256 | 4090 | 10 | 1280, 816 |
//!
//! (On Zen 4 the AVX2 kernel is the default f32 kernel, see [`crate::kernel::best_kernel`].) With
//! B̃ in L1 the AVX2 kernel's Ã block took 304 rows on Zen 3 (6 of the 8 L2 ways); keeping Ã in
//! L1 gives 2 ways to the B̃ block and leaves 5 to the Ã block.
//!
//! The Ã micro-panel of the Zen 4 / Skylake-X AVX-512 tile (32 × 12) is 128 bytes per k step, so
//! only kc = 160 fits beside B̃ in a 32 KiB 8-way L1.
//!
//! Measured, only on the 2-core Zen 3 VM (AMD EPYC family 25 model 1, FMA-loop peak 102.5
//! GFLOP/s/core), with `cargo run --release -p fugu-gemm --example blocking`, which runs block
//! sizes round-robin in one process (load average 0.9–3.6 from other work; medians of 7):
//! at 1 thread every block size tried in kc 208–672 × mc 96–464 is within the ±3% run-to-run
//! noise on 2048³ (derived 304/320: 84–92 GFLOP/s, old 96/672: 81–91) and qkv fwd
//! 1024×2304×768; on lm-head bwd-data 1024×768×50304 (k = 50304, so 157 passes over C with
//! kc = 320 against 75 with kc = 672) the derived sizes are 1–3% slower (e.g. 89.7 against 90.3
//! and 84.6 against 87.2), and kc = 208 (one B̃ plus two whole Ã micro-panels in L1) is slower
//! still (83.3). At 2 threads, 2048³ went from 175 / 172 to 182 / 182 GFLOP/s and lm-head
//! bwd-data from 177 / 177 to 175 / 174 (two paired runs, blocking and the AVX2 kernel changes
//! together). On this core streaming B̃ from L2 again each call (the old kc) is cheap: the L2
//! delivers 32 B/cycle and a k step needs 64 + 24 bytes per 6 cycles. The micro-kernel alone over
//! one Ã block against one B̃ micro-panel (`--kernel-only KC MC`, load 0.7) runs at 98.0 GFLOP/s
//! (96% of the peak) with the derived kc = 320, mc = 304, against 99.4 with everything in L1, and
//! drops to 85.6 with kc = 672, mc = 304 (a 798 KiB Ã block, larger than the L2): the derived
//! sizes leave the kernel's ceiling intact; the 87–90% the driver reaches on the large shapes is
//! lost outside it (packing, about 3.5% of the 2048³ time in `perf record`, and C tiles fetched
//! from L3 or memory on every pc pass). AVX-512 and aarch64 hosts:
//! not measured (no such machine was available); the old sizes are in the table above for a
//! comparison there.

use crate::error::GemmError;
use crate::kernel::Side;
use std::fs;

/// Cache sizes in bytes and how many CPUs share each level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheInfo {
    pub l1d: usize,
    /// Ways of associativity of the L1d (0: unknown, 8 assumed).
    pub l1d_ways: usize,
    pub l2: usize,
    /// Ways of associativity of the L2 (0: unknown, 8 assumed).
    pub l2_ways: usize,
    pub l2_shared_by: usize,
    pub l3: usize,
    pub l3_shared_by: usize,
}

impl Default for CacheInfo {
    /// Conservative sizes for machines whose sysfs says nothing.
    fn default() -> Self {
        CacheInfo {
            l1d: 32 << 10,
            l1d_ways: 8,
            l2: 512 << 10,
            l2_ways: 8,
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
            let ways = read("ways_of_associativity")
                .and_then(|w| w.trim().parse::<usize>().ok())
                .unwrap_or(0);
            let shared = read("shared_cpu_list")
                .and_then(|s| parse_cpulist(&s))
                .map(|v| v.len().max(1))
                .unwrap_or(1);
            match (level.trim(), kind.trim()) {
                ("1", "Data") => {
                    info.l1d = size;
                    info.l1d_ways = ways;
                }
                ("2", "Unified") | ("2", "Data") => {
                    info.l2 = size;
                    info.l2_ways = ways;
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

/// Block sizes of the loops, in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocking {
    pub mc: usize,
    pub kc: usize,
    pub nc: usize,
    /// Columns of B̃ the ir loop sweeps under one Ã micro-panel (a multiple of nr): the
    /// macro-kernel runs `for each nb columns { for each Ã micro-panel { for each B̃
    /// micro-panel of them } }`. `nb = nr` is the order with jr outside ir, one B̃ micro-panel
    /// in L1 for the whole Ã block (a kernel whose [`Kernel::l1_panel`](crate::Kernel) is
    /// [`Side::B`]); a kernel that keeps Ã in L1 ([`Side::A`]) gets nb from L2.
    pub nb: usize,
}

/// B̃ micro-panels an `nb` block holds at least, for a kernel that keeps Ã in L1: each Ã
/// micro-panel is brought into L1 once per nb block, so 16 kernel calls share that fill.
const NB_PANELS: usize = 16;

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
    /// Derives block sizes for an `mr × nr` kernel that keeps `l1_panel` in L1, from the cache
    /// sizes, for the split mode the runtime picks by default (`jr`, one Ã block per domain,
    /// when the L2 is shared; `ic`, one Ã block per thread, otherwise). See the module docs.
    pub fn derive(c: &CacheInfo, mr: usize, nr: usize, l1_panel: Side) -> Blocking {
        Blocking::derive_for(c, mr, nr, l1_panel, c.l2_shared_by > 1)
    }

    /// [`Blocking::derive`] for a given split: `a_block_shared` is true when the threads that
    /// share the L2 share one Ã block (`jr` split), false when each packs its own (`ic`).
    pub fn derive_for(
        c: &CacheInfo,
        mr: usize,
        nr: usize,
        l1_panel: Side,
        a_block_shared: bool,
    ) -> Blocking {
        const F32: usize = 4;
        let ways = |w: usize| if w == 0 { 8 } else { w.max(2) };
        // kc: C_A ways of L1 for one Ã micro-panel, C_B for the B̃ micro-panel, one way free.
        let w1 = ways(c.l1d_ways);
        let way1 = c.l1d / w1;
        let c_a = ((w1 - 1) * mr / (mr + nr)).max(1);
        let kc = round_down(c_a * way1 / (mr * F32), 16).clamp(64, 1024);
        // mc and nb: the Ã block and `t` B̃ blocks of nb columns in L2, one way free.
        let w2 = ways(c.l2_ways);
        let sharers = c.l2_shared_by.max(1);
        // Ã shared by the domain: the whole L2, with every sharer's B̃ block in it. Ã per
        // thread: each thread's share of the L2 (every way of every set split `sharers` ways).
        let (way2, t) = if a_block_shared {
            (c.l2 / w2, sharers)
        } else {
            (c.l2 / sharers / w2, 1)
        };
        // C_B2 ways for the B̃ block(s): one micro-panel each with B̃ in L1; with Ã in L1,
        // NB_PANELS micro-panels each, nb then the most columns those ways hold.
        let panels_bytes = t * nr * kc * F32;
        let (c_b2, nb) = match l1_panel {
            Side::B => (panels_bytes.div_ceil(way2), nr),
            Side::A => {
                let c_b2 = (NB_PANELS * panels_bytes).div_ceil(way2);
                (c_b2, round_down(c_b2 * way2 / (t * kc * F32), nr))
            }
        };
        let c_ac = w2.saturating_sub(1 + c_b2).max(1);
        let mc = round_down(c_ac * way2 / (kc * F32), mr).min(round_down(4096, mr));
        // nc: the B̃ panel in half of the domain's L3 share.
        let nc = if c.l3 > 0 {
            round_down((c.l3_share() / 2) / (kc * F32), nr).clamp(nr * 16, 8192 / nr * nr)
        } else {
            round_down(4096, nr)
        };
        Blocking { mc, kc, nc, nb }
    }

    /// Applies `FUGU_GEMM_MC/KC/NC/NB` overrides, rounding mc to mr and nc, nb to nr.
    pub fn with_env_overrides(mut self, mr: usize, nr: usize) -> Result<Blocking, GemmError> {
        for (var, slot, unit) in [
            ("FUGU_GEMM_MC", &mut self.mc, mr),
            (KC_VAR, &mut self.kc, 1),
            ("FUGU_GEMM_NC", &mut self.nc, nr),
            ("FUGU_GEMM_NB", &mut self.nb, nr),
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

    const K: usize = 1 << 10;
    const M: usize = 1 << 20;

    fn caches(
        l1d: usize,
        l1w: usize,
        l2: usize,
        l2w: usize,
        l2_by: usize,
        l3: usize,
        l3_by: usize,
    ) -> CacheInfo {
        CacheInfo {
            l1d,
            l1d_ways: l1w,
            l2,
            l2_ways: l2w,
            l2_shared_by: l2_by,
            l3,
            l3_shared_by: l3_by,
        }
    }

    /// Checks the inequalities of the module docs (and that each size is the largest that
    /// satisfies them), for the split `derive` picks and for the other one.
    fn check(name: &str, c: &CacheInfo, mr: usize, nr: usize, l1_panel: Side) -> Blocking {
        for a_shared in [c.l2_shared_by > 1, c.l2_shared_by <= 1] {
            let b = Blocking::derive_for(c, mr, nr, l1_panel, a_shared);
            let what = format!("{name} {mr}x{nr} {l1_panel:?} a_shared={a_shared}: {b:?}");
            assert_eq!(b.kc % 16, 0, "{what}");
            assert_eq!(b.mc % mr, 0, "{what}");
            assert_eq!(b.nc % nr, 0, "{what}");
            assert_eq!(b.nb % nr, 0, "{what}");
            // L1: one Ã micro-panel + one B̃ micro-panel in W1 - 1 ways.
            let (w1, way1) = (c.l1d_ways, c.l1d / c.l1d_ways);
            let ways1 = |kc: usize| (mr * kc * 4).div_ceil(way1) + (nr * kc * 4).div_ceil(way1);
            assert!(ways1(b.kc) < w1, "{what}: L1 ways {}", ways1(b.kc));
            assert!((mr + nr) * b.kc * 4 <= c.l1d - way1, "{what}");
            // ...and kc is the largest multiple of 16 that keeps Ã within its C_A ways.
            let c_a = (w1 - 1) * mr / (mr + nr);
            assert!((mr * b.kc * 4).div_ceil(way1) <= c_a, "{what}");
            assert!(
                b.kc == 1024 || (mr * (b.kc + 16) * 4).div_ceil(way1) > c_a,
                "{what}"
            );
            // L2: the Ã block + t B̃ blocks of nb columns in W2 - 1 ways of the L2 (or of this
            // thread's share of it).
            let w2 = c.l2_ways;
            let sharers = c.l2_shared_by;
            let (way2, t) = if a_shared {
                (c.l2 / w2, sharers)
            } else {
                (c.l2 / sharers / w2, 1)
            };
            let ways2 = |mc: usize, nb: usize| {
                (mc * b.kc * 4).div_ceil(way2) + (t * nb * b.kc * 4).div_ceil(way2)
            };
            assert!(
                ways2(b.mc, b.nb) < w2,
                "{what}: L2 ways {}",
                ways2(b.mc, b.nb)
            );
            assert!(
                b.mc * b.kc * 4 <= c.l2 / if a_shared { 1 } else { sharers },
                "{what}"
            );
            assert!(
                b.mc >= 4096 / mr * mr || ways2(b.mc + mr, b.nb) >= w2,
                "{what}: mc not maximal"
            );
            match l1_panel {
                // One B̃ micro-panel under the whole Ã block.
                Side::B => assert_eq!(b.nb, nr, "{what}"),
                // At least NB_PANELS micro-panels, and as many as their ways hold.
                Side::A => {
                    assert!(b.nb >= NB_PANELS * nr, "{what}");
                    assert_eq!(ways2(0, b.nb), ways2(0, NB_PANELS * nr), "{what}");
                    assert!(
                        ways2(0, b.nb + nr) > ways2(0, b.nb),
                        "{what}: nb not maximal"
                    );
                }
            }
            // L3: the B̃ panel in half of the domain's L3 share; no L3: nc = 4096 (to nr).
            if c.l3 > 0 {
                assert!(b.nc * b.kc * 4 <= c.l3_share() / 2, "{what}");
                assert!(
                    b.nc == 8192 / nr * nr || (b.nc + nr) * b.kc * 4 > c.l3_share() / 2,
                    "{what}: nc not maximal"
                );
            } else {
                assert_eq!(b.nc, 4096 / nr * nr, "{what}");
            }
        }
        Blocking::derive(c, mr, nr, l1_panel)
    }

    // Tile sizes: AVX2 16 x 6, AVX-512 32 x 12, NEON 16 x 6, SVE 2·VL x 10 (gemm/src/arch).

    #[test]
    fn zen3_avx2() {
        // 32 KiB 8-way L1d, 512 KiB 8-way private L2, 32 MiB L3 per 8-core CCX (16 CPUs).
        let c = caches(32 * K, 8, 512 * K, 8, 1, 32 * M, 16);
        let b = check("Zen 3", &c, 16, 6, Side::A);
        // C_A = floor(7·16/22) = 5 ways (20 KiB Ã micro-panel), B̃ 7.5 KiB in 2 ways: kc = 320,
        // where the old half-of-L1 rule gave 672 (a 43 KiB Ã micro-panel). In L2, 16 B̃
        // micro-panels (120 KiB) take 2 of the 8 64-KiB ways, which hold nb = 102 columns
        // (17 micro-panels); the Ã block gets 5 ways.
        assert_eq!(b.kc, 320);
        assert_eq!(
            b,
            Blocking {
                mc: 256,
                kc: 320,
                nc: 8190,
                nb: 102
            }
        );
        // With B̃ in L1 (the order before), the Ã block took 6 ways.
        assert_eq!(check("Zen 3 B̃ in L1", &c, 16, 6, Side::B).mc, 304);
    }

    #[test]
    fn zen4_avx2_and_avx512() {
        // 32 KiB 8-way L1d, 1 MiB 8-way private L2, 32 MiB L3 per CCX. AVX2 is Zen 4's default
        // f32 kernel (see `best_kernel`): 16 B̃ micro-panels fit one 128-KiB way of the L2,
        // which holds 17; its Ã block keeps 6 ways, as with B̃ in L1. AVX-512 keeps B̃ in L1.
        let c = caches(32 * K, 8, M, 8, 1, 32 * M, 16);
        let avx2 = check("Zen 4 AVX2", &c, 16, 6, Side::A);
        let avx512 = check("Zen 4 AVX-512", &c, 32, 12, Side::B);
        assert_eq!(
            [avx2, avx512],
            [
                Blocking {
                    mc: 608,
                    kc: 320,
                    nc: 8190,
                    nb: 102
                },
                Blocking {
                    mc: 1216,
                    kc: 160,
                    nc: 8184,
                    nb: 12
                }
            ]
        );
    }

    #[test]
    fn zen5_avx512() {
        // 48 KiB 12-way L1d, 1 MiB 16-way private L2, 32 MiB L3 per CCX.
        let c = caches(48 * K, 12, M, 16, 1, 32 * M, 16);
        let b = check("Zen 5", &c, 32, 12, Side::B);
        assert_eq!(
            b,
            Blocking {
                mc: 896,
                kc: 256,
                nc: 8184,
                nb: 12
            }
        );
    }

    #[test]
    fn skylake_x_avx512() {
        // 32 KiB 8-way L1d, 1 MiB 16-way private L2, 1.375 MiB of L3 per core (18 cores,
        // 36 CPUs share 24.75 MiB).
        let c = caches(32 * K, 8, M, 16, 1, 18 * 1408 * K, 36);
        let b = check("Skylake-X", &c, 32, 12, Side::B);
        assert_eq!(
            b,
            Blocking {
                mc: 1408,
                kc: 160,
                nc: 8184,
                nb: 12
            }
        );
    }

    #[test]
    fn neoverse_v1() {
        // 64 KiB 4-way L1d, 1 MiB 8-way private L2, 32 MiB L3 shared by 64 cores (Graviton 3).
        let c = caches(64 * K, 4, M, 8, 1, 32 * M, 64);
        let b = check("Neoverse V1 SVE-256", &c, 16, 10, Side::B);
        assert_eq!(
            b,
            Blocking {
                mc: 768,
                kc: 256,
                nc: 4090,
                nb: 10
            }
        );
        check("Neoverse V1 NEON", &c, 16, 6, Side::B);
    }

    #[test]
    fn a64fx_sve512() {
        // 64 KiB 4-way L1d, 8 MiB 16-way L2 shared by the 12 cores of a CMG, no L3.
        let c = caches(64 * K, 4, 8 * M, 16, 12, 0, 1);
        let b = check("A64FX", &c, 32, 10, Side::B);
        // C_A = floor(3·32/42) = 2 of 4 ways: kc = 256; the CMG's Ã block (jr split) then
        // takes 14 of the 16 L2 ways, capped at mc = 4096.
        assert_eq!(b.kc, 256);
        assert_eq!(b.mc, 4096);
        assert_eq!(b.nc, 4090);
        // With ic split forced, each of the 12 threads packs its own Ã block in 1/12 of the L2.
        let ic = Blocking::derive_for(&c, 32, 10, Side::B, false);
        assert!(ic.mc * ic.kc * 4 <= 8 * M / 12);
        // A kernel that kept Ã in L1 here (none does yet): each of the 12 threads of the jr
        // split sweeps its own nb block, 12 × 16 micro-panels in 4 of the 16 ways.
        let a = check("A64FX Ã in L1", &c, 32, 10, Side::A);
        assert_eq!((a.mc, a.nb), (4096, 170));
    }

    #[test]
    fn unknown_ways_assume_eight() {
        let mut c = caches(32 * K, 0, 512 * K, 0, 1, 0, 1);
        let b = Blocking::derive(&c, 16, 6, Side::A);
        c.l1d_ways = 8;
        c.l2_ways = 8;
        assert_eq!(b, check("unknown ways", &c, 16, 6, Side::A));
    }
}

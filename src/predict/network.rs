//! The network model: an α–β cost per link level (between the ranks of one node, between
//! nodes) and the collective algorithms MPI libraries choose between by message size, each
//! collective costed as the cheapest of them (what a well-tuned library's size thresholds
//! approximate).
//!
//! For `n` ranks, `m` bytes, latency `α` and bandwidth `β` (Thakur, Rabenseifner and Gropp,
//! "Optimization of collective communication operations in MPICH", IJHPCA 2005):
//!
//! | collective | algorithm | time |
//! |---|---|---|
//! | all-reduce | ring | 2(n−1)·α + 2(n−1)/n · m/β |
//! | all-reduce | recursive doubling | ⌈log₂n⌉·(α + m/β) |
//! | all-reduce | Rabenseifner (halving + doubling) | 2⌈log₂n⌉·α + 2(n−1)/n · m/β |
//! | reduce-scatter, all-gather | ring | (n−1)·α + (n−1)/n · m/β |
//! | reduce-scatter, all-gather | recursive halving / doubling | ⌈log₂n⌉·α + (n−1)/n · m/β |
//! | send/recv | | α + m/β |
//!
//! Reductions also cost `γ` per byte reduced (Thakur et al.'s third term: the sum itself,
//! memory-bound for large messages): `(n−1)/n · m/γ` for ring, Rabenseifner and
//! reduce-scatter, `⌈log₂n⌉ · m/γ` for recursive doubling. `γ` (`reduce_gbs`) is fitted to a
//! benchmark's all-reduce rows once `α` and `β` are fitted to its send/recv rows.
//!
//! A group spread over several nodes with several ranks on each also gets the hierarchical
//! all-reduce (reduce-scatter inside the node, all-reduce of a 1/r share between nodes,
//! all-gather inside the node); otherwise a group that spans nodes runs on the inter-node link.
//! `m` is the reduce-scatter's input and the all-gather's output (as in `fugu bench comm`).

use crate::bench::comm::CommRow;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// One link level: latency in microseconds and bandwidth in GB/s (10⁹ bytes per second).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Link {
    pub alpha_us: f64,
    pub beta_gbs: f64,
}

impl Link {
    /// `α + m/β` in seconds.
    pub fn time(&self, bytes: f64) -> f64 {
        self.alpha() + bytes / self.beta()
    }

    fn alpha(&self) -> f64 {
        self.alpha_us * 1e-6
    }

    fn beta(&self) -> f64 {
        self.beta_gbs * 1e9
    }

    /// Checks that both numbers are positive and finite, naming `what`.
    pub fn validate(&self, what: &str) -> Result<()> {
        if !(self.alpha_us >= 0.0 && self.alpha_us.is_finite()) {
            bail!(
                "{what}: alpha_us = {} must be a finite number ≥ 0",
                self.alpha_us
            );
        }
        if !(self.beta_gbs > 0.0 && self.beta_gbs.is_finite()) {
            bail!(
                "{what}: beta_gbs = {} must be a finite number > 0",
                self.beta_gbs
            );
        }
        Ok(())
    }
}

/// The two link levels and the reduction rate, and the traffic classes' own values where a
/// profile gives them.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// Between the ranks of one node (shared memory).
    pub intra: Link,
    /// Between nodes: one rank's path to another node.
    pub inter: Link,
    /// Bytes per second (GB/s) a rank reduces (adds) received data into its own; absent:
    /// free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce_gbs: Option<f64>,
    /// Tensor-parallel collectives' own links (`[network.tp]`), each value defaulting to the
    /// ones above.
    #[serde(default, skip_serializing_if = "ClassLinks::is_empty")]
    pub tp: ClassLinks,
    /// Pipeline transfers' own links (`[network.pp]`).
    #[serde(default, skip_serializing_if = "ClassLinks::is_empty")]
    pub pp: ClassLinks,
    /// Data-parallel gradient synchronisation's own links (`[network.dp]`).
    #[serde(default, skip_serializing_if = "ClassLinks::is_empty")]
    pub dp: ClassLinks,
}

/// The kinds of traffic a training step makes. Published runs show them at very different
/// effective rates on one network (a framework's data-parallel all-reduce 5–60× slower than
/// its tensor-parallel traffic), so each may have links of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Traffic {
    /// Tensor-parallel all-reduces (activations, per block and micro-batch).
    Tp,
    /// Pipeline sends and receives between stages, and the tied embedding's all-reduce.
    Pp,
    /// Data-parallel gradient all-reduce (or ZeRO-1's reduce-scatter and all-gather).
    Dp,
}

impl Traffic {
    pub const ALL: [Traffic; 3] = [Traffic::Tp, Traffic::Pp, Traffic::Dp];

    /// The profile's section name (`[network.dp]`) and `fugu bench comm --groups` key.
    pub fn name(self) -> &'static str {
        match self {
            Traffic::Tp => "tp",
            Traffic::Pp => "pp",
            Traffic::Dp => "dp",
        }
    }
}

/// One traffic class's links and reduction rate; a value left out is the network's.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClassLinks {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intra: Option<Link>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inter: Option<Link>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reduce_gbs: Option<f64>,
}

impl ClassLinks {
    /// Nothing set.
    pub const NONE: ClassLinks = ClassLinks {
        intra: None,
        inter: None,
        reduce_gbs: None,
    };

    /// Nothing set: the class runs on the network's links.
    pub fn is_empty(&self) -> bool {
        *self == ClassLinks::default()
    }
}

/// The ranks of a communicator: `ranks` spread evenly over `nodes` nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    pub ranks: usize,
    pub nodes: usize,
}

impl Group {
    /// Ranks on each node.
    pub fn per_node(&self) -> usize {
        self.ranks.div_ceil(self.nodes.max(1))
    }
}

fn log2_ceil(n: usize) -> f64 {
    (n.max(1) as f64).log2().ceil()
}

/// All-reduce of `m` bytes over `n` ranks on one link, reducing at `g` bytes/s: the cheapest
/// algorithm.
fn allreduce_flat(l: &Link, g: f64, n: usize, m: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let nf = n as f64;
    let (a, b) = (l.alpha(), l.beta());
    let share = (nf - 1.0) / nf * m;
    let ring = 2.0 * (nf - 1.0) * a + 2.0 * share / b + share / g;
    let doubling = log2_ceil(n) * (a + m / b + m / g);
    let rabenseifner = 2.0 * log2_ceil(n) * a + 2.0 * share / b + share / g;
    ring.min(doubling).min(rabenseifner)
}

/// Reduce-scatter (input `m`, reducing at `g` bytes/s) or all-gather (output `m`, `g` = ∞)
/// over `n` ranks on one link.
fn scatter_gather_flat(l: &Link, g: f64, n: usize, m: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let nf = n as f64;
    let (a, b) = (l.alpha(), l.beta());
    let bw = (nf - 1.0) / nf * m * (1.0 / b + 1.0 / g);
    ((nf - 1.0) * a + bw).min(log2_ceil(n) * a + bw)
}

impl Network {
    /// The links traffic of class `c` runs on: the class's own values where given, the
    /// network's elsewhere (the result has no classes of its own).
    pub fn class(&self, c: Traffic) -> Network {
        let own = *self.links(c);
        Network {
            intra: own.intra.unwrap_or(self.intra),
            inter: own.inter.unwrap_or(self.inter),
            reduce_gbs: own.reduce_gbs.or(self.reduce_gbs),
            tp: ClassLinks::NONE,
            pp: ClassLinks::NONE,
            dp: ClassLinks::NONE,
        }
    }

    /// Class `c`'s own values.
    pub fn links(&self, c: Traffic) -> &ClassLinks {
        match c {
            Traffic::Tp => &self.tp,
            Traffic::Pp => &self.pp,
            Traffic::Dp => &self.dp,
        }
    }

    /// Class `c`'s own values, to set.
    pub fn links_mut(&mut self, c: Traffic) -> &mut ClassLinks {
        match c {
            Traffic::Tp => &mut self.tp,
            Traffic::Pp => &mut self.pp,
            Traffic::Dp => &mut self.dp,
        }
    }

    /// Checks every link and rate, naming the field (`network.dp.inter`).
    pub fn validate(&self) -> Result<()> {
        self.intra.validate("network.intra")?;
        self.inter.validate("network.inter")?;
        check_reduce("network.reduce_gbs", self.reduce_gbs)?;
        for c in Traffic::ALL {
            let own = self.links(c);
            let n = c.name();
            if let Some(l) = own.intra {
                l.validate(&format!("network.{n}.intra"))?;
            }
            if let Some(l) = own.inter {
                l.validate(&format!("network.{n}.inter"))?;
            }
            check_reduce(&format!("network.{n}.reduce_gbs"), own.reduce_gbs)?;
        }
        Ok(())
    }

    /// The reduction rate in bytes/s (∞ when not given).
    fn gamma(&self) -> f64 {
        self.reduce_gbs.map_or(f64::INFINITY, |g| g * 1e9)
    }

    /// This network with every rank getting `1/factor` of a core (more ranks and threads than
    /// cores on a node): shared-memory copies and reductions are done by the cores, so the
    /// intra-node bandwidth and the reduction rate drop by `factor` and the latency grows by it.
    pub fn oversubscribed(&self, factor: f64) -> Network {
        if factor <= 1.0 {
            return *self;
        }
        Network {
            intra: Link {
                alpha_us: self.intra.alpha_us * factor,
                beta_gbs: self.intra.beta_gbs / factor,
            },
            reduce_gbs: self.reduce_gbs.map(|g| g / factor),
            ..*self
        }
    }

    /// The link a group's flat algorithms run on (the slower one when it spans nodes).
    fn link(&self, g: Group) -> &Link {
        if g.nodes > 1 {
            &self.inter
        } else {
            &self.intra
        }
    }

    /// All-reduce of `m` bytes.
    pub fn allreduce(&self, g: Group, m: f64) -> f64 {
        let gamma = self.gamma();
        let flat = allreduce_flat(self.link(g), gamma, g.ranks, m);
        let r = g.per_node();
        if g.nodes > 1 && r > 1 {
            let hier = scatter_gather_flat(&self.intra, gamma, r, m)
                + allreduce_flat(&self.inter, gamma, g.nodes, m / r as f64)
                + scatter_gather_flat(&self.intra, f64::INFINITY, r, m);
            flat.min(hier)
        } else {
            flat
        }
    }

    /// Reduce-scatter of `m` input bytes.
    pub fn reduce_scatter(&self, g: Group, m: f64) -> f64 {
        scatter_gather_flat(self.link(g), self.gamma(), g.ranks, m)
    }

    /// All-gather of `m` output bytes.
    pub fn allgather(&self, g: Group, m: f64) -> f64 {
        scatter_gather_flat(self.link(g), f64::INFINITY, g.ranks, m)
    }

    /// One message of `m` bytes between two ranks on the same node or on two nodes.
    pub fn sendrecv(&self, across_nodes: bool, m: f64) -> f64 {
        if across_nodes {
            self.inter.time(m)
        } else {
            self.intra.time(m)
        }
    }
}

fn check_reduce(what: &str, g: Option<f64>) -> Result<()> {
    match g {
        Some(g) if !(g > 0.0 && g.is_finite()) => bail!(
            "{what} = {g}: expected a positive number (GB/s a rank reduces at), or leave it out \
             for a free reduction"
        ),
        _ => Ok(()),
    }
}

/// A link fitted to a benchmark's send/recv rows, and how well it fits.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkFit {
    pub link: Link,
    /// Rows used.
    pub rows: usize,
    /// Largest |model − measured| / measured over those rows.
    pub max_rel_err: f64,
}

/// Fits `α + m/β` to the send/recv rows of a benchmark: `α` is the median time of the
/// messages of at most 256 bytes, `β` the least-squares slope of `t − α` against `m` over the
/// messages of at least 64 KiB (both kinds must be present).
pub fn fit_link(rows: &[CommRow]) -> Result<LinkFit> {
    let p2p: Vec<&CommRow> = rows.iter().filter(|r| r.op == "sendrecv").collect();
    let mut small: Vec<f64> = p2p
        .iter()
        .filter(|r| r.bytes <= 256)
        .map(|r| r.time_us)
        .collect();
    let large: Vec<(f64, f64)> = p2p
        .iter()
        .filter(|r| r.bytes >= 65_536)
        .map(|r| (r.bytes as f64, r.time_us * 1e-6))
        .collect();
    if small.is_empty() || large.len() < 2 {
        bail!(
            "fitting a link needs sendrecv rows of at most 256 B and at least two of 64 KiB or \
             more (run `fugu bench comm` with --min-size 4 --max-size 1MiB or larger); found {} \
             and {}",
            small.len(),
            large.len()
        );
    }
    small.sort_by(f64::total_cmp);
    let alpha_us = small[small.len() / 2];
    // Slope through the large messages with the latency removed: Σ x·y / Σ x² (a line through
    // the origin of (m, t − α)).
    let (sxy, sxx) = large.iter().fold((0.0, 0.0), |(sxy, sxx), &(x, t)| {
        let y = t - alpha_us * 1e-6;
        (sxy + x * y, sxx + x * x)
    });
    if sxy <= 0.0 {
        bail!(
            "the large sendrecv messages took no longer than the small ones: no bandwidth to fit"
        );
    }
    let link = Link {
        alpha_us,
        beta_gbs: sxx / sxy / 1e9,
    };
    let max_rel_err = p2p
        .iter()
        .map(|r| (link.time(r.bytes as f64) * 1e6 - r.time_us).abs() / r.time_us)
        .fold(0.0, f64::max);
    Ok(LinkFit {
        link,
        rows: p2p.len(),
        max_rel_err,
    })
}

/// Fits the reduction rate (GB/s) to the all-reduce rows of at least 64 KiB of a benchmark
/// on `g`, given its links: the least-squares rate of what the α–β part leaves. `None` when
/// there are no such rows or nothing is left (reductions look free).
pub fn fit_reduce(net: &Network, g: Group, rows: &[CommRow]) -> Option<f64> {
    let n = g.ranks as f64;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for r in rows
        .iter()
        .filter(|r| r.op == "allreduce" && r.bytes >= 65_536)
    {
        let free = Network {
            reduce_gbs: None,
            ..*net
        };
        let rest = r.time_us * 1e-6 - free.allreduce(g, r.bytes as f64);
        // Bytes reduced per rank by the bandwidth-optimal algorithms.
        let x = (n - 1.0) / n * r.bytes as f64;
        sxy += x * rest;
        sxx += x * x;
    }
    (sxy > 0.0).then(|| sxx / sxy / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NET: Network = Network {
        intra: Link {
            alpha_us: 0.5,
            beta_gbs: 10.0,
        },
        inter: Link {
            alpha_us: 2.0,
            beta_gbs: 5.0,
        },
        reduce_gbs: None,
        tp: ClassLinks::NONE,
        pp: ClassLinks::NONE,
        dp: ClassLinks::NONE,
    };

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1e-30)
    }

    #[test]
    fn collectives_follow_the_formulas() {
        let one_node = Group { ranks: 4, nodes: 1 };
        let m = 1e8;
        // Large message: ring and Rabenseifner share the bandwidth term, Rabenseifner has the
        // smaller latency term for n = 4 (2·2 vs 2·3 α).
        let want = 2.0 * 2.0 * 0.5e-6 + 1.5 * m / 10e9;
        assert!(close(NET.allreduce(one_node, m), want));
        // Small message: recursive doubling, 2 steps.
        assert!(close(
            NET.allreduce(one_node, 8.0),
            2.0 * (0.5e-6 + 8.0 / 10e9)
        ));
        // Reduce-scatter of 4 blocks: 2 α + 3/4 m/β.
        assert!(close(
            NET.reduce_scatter(one_node, m),
            2.0 * 0.5e-6 + 0.75 * m / 10e9
        ));
        assert!(close(NET.sendrecv(true, 1e6), 2e-6 + 1e6 / 5e9));
        assert_eq!(NET.allreduce(Group { ranks: 1, nodes: 1 }, m), 0.0);
    }

    #[test]
    fn groups_across_nodes_use_the_inter_link_or_the_hierarchy() {
        // One rank per node: the flat algorithms on the inter-node link.
        let g = Group { ranks: 8, nodes: 8 };
        let m = 1e9;
        let flat = 2.0 * 3.0 * 2e-6 + 2.0 * 7.0 / 8.0 * m / 5e9;
        assert!(close(NET.allreduce(g, m), flat));
        // 4 ranks on each of 8 nodes: the hierarchy moves only a quarter between nodes.
        let g = Group {
            ranks: 32,
            nodes: 8,
        };
        let hier =
            2.0 * (2.0 * 0.5e-6 + 0.75 * m / 10e9) + (2.0 * 3.0 * 2e-6 + 1.75 * (m / 4.0) / 5e9);
        assert!(
            close(NET.allreduce(g, m), hier),
            "{} vs {hier}",
            NET.allreduce(g, m)
        );
        assert!(NET.allreduce(g, m) < allreduce_flat(&NET.inter, f64::INFINITY, 32, m));
    }

    #[test]
    fn reductions_and_oversubscription_cost_what_they_say() {
        let net = Network {
            reduce_gbs: Some(2.0),
            ..NET
        };
        let g = Group { ranks: 2, nodes: 1 };
        let m = 1e8;
        // Two ranks, large message: ring (= Rabenseifner here), reducing half the message at
        // 2 GB/s (recursive doubling would reduce all of it).
        let want = 2.0 * 0.5e-6 + m / 10e9 + 0.5 * m / 2e9;
        assert!(close(net.allreduce(g, m), want));
        // All-gather reduces nothing.
        assert!(close(net.allgather(g, m), NET.allgather(g, m)));
        // A rank with half a core: intra-node transfers and reductions at half speed.
        let slow = net.oversubscribed(2.0);
        assert_eq!(slow.intra.beta_gbs, 5.0);
        assert_eq!(slow.reduce_gbs, Some(1.0));
        assert_eq!(slow.inter, NET.inter);
        assert_eq!(net.oversubscribed(0.5), net);
        // The fit recovers γ from all-reduce rows made with it.
        let rows: Vec<CommRow> = (16..26)
            .map(|p| 1usize << p)
            .map(|b| row("allreduce", b, net.allreduce(g, b as f64) * 1e6))
            .collect();
        let fitted = fit_reduce(&NET, g, &rows).unwrap();
        // (Not exact: near 64 KiB the cheapest algorithm reduces more than (n−1)/n of m.)
        assert!((fitted - 2.0).abs() < 2e-3, "{fitted}");
        // Rows the α–β part explains fully leave (next to) nothing to fit.
        let free: Vec<CommRow> = (16..26)
            .map(|p| 1usize << p)
            .map(|b| row("allreduce", b, NET.allreduce(g, b as f64) * 1e6))
            .collect();
        assert!(fit_reduce(&NET, g, &free).is_none_or(|r| r > 1e3));
    }

    fn row(op: &str, bytes: usize, time_us: f64) -> CommRow {
        CommRow {
            op: op.into(),
            bytes,
            ranks: 2,
            iters: 1,
            samples: 1,
            time_us,
            min_time_us: time_us,
            algbw_gbs: 0.0,
            busbw_gbs: 0.0,
        }
    }

    #[test]
    fn a_link_is_fitted_from_sendrecv_rows() {
        let truth = Link {
            alpha_us: 1.5,
            beta_gbs: 4.0,
        };
        let rows: Vec<CommRow> = (2..24)
            .map(|p| 1usize << p)
            .map(|b| row("sendrecv", b, truth.time(b as f64) * 1e6))
            .chain([row("allreduce", 1 << 20, 1.0)])
            .collect();
        let fit = fit_link(&rows).unwrap();
        assert!((fit.link.alpha_us - 1.5).abs() < 0.01, "{fit:?}");
        assert!((fit.link.beta_gbs - 4.0).abs() < 1e-3, "{fit:?}");
        assert!(fit.max_rel_err < 0.01 && fit.rows == 22);
        let e = fit_link(&rows[..5]).unwrap_err().to_string();
        assert!(e.contains("at least two of 64 KiB"), "{e}");
    }
}

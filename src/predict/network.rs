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
//! | broadcast | binomial tree | ⌈log₂n⌉·(α + m/β) |
//! | broadcast | scatter + all-gather | (⌈log₂n⌉ + n − 1)·α + 2(n−1)/n · m/β |
//! | send/recv | | α + m/β |
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
            bail!("{what}: alpha_us = {} must be a finite number ≥ 0", self.alpha_us);
        }
        if !(self.beta_gbs > 0.0 && self.beta_gbs.is_finite()) {
            bail!("{what}: beta_gbs = {} must be a finite number > 0", self.beta_gbs);
        }
        Ok(())
    }
}

/// The two link levels.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// Between the ranks of one node (shared memory).
    pub intra: Link,
    /// Between nodes: one rank's path to another node.
    pub inter: Link,
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

/// All-reduce of `m` bytes over `n` ranks on one link: the cheapest algorithm.
fn allreduce_flat(l: &Link, n: usize, m: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let nf = n as f64;
    let (a, b) = (l.alpha(), l.beta());
    let ring = 2.0 * (nf - 1.0) * a + 2.0 * (nf - 1.0) / nf * m / b;
    let doubling = log2_ceil(n) * (a + m / b);
    let rabenseifner = 2.0 * log2_ceil(n) * a + 2.0 * (nf - 1.0) / nf * m / b;
    ring.min(doubling).min(rabenseifner)
}

/// Reduce-scatter (input `m`) or all-gather (output `m`) over `n` ranks on one link.
fn scatter_gather_flat(l: &Link, n: usize, m: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let nf = n as f64;
    let (a, b) = (l.alpha(), l.beta());
    let bw = (nf - 1.0) / nf * m / b;
    ((nf - 1.0) * a + bw).min(log2_ceil(n) * a + bw)
}

impl Network {
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
        let flat = allreduce_flat(self.link(g), g.ranks, m);
        let r = g.per_node();
        if g.nodes > 1 && r > 1 {
            let hier = scatter_gather_flat(&self.intra, r, m)
                + allreduce_flat(&self.inter, g.nodes, m / r as f64)
                + scatter_gather_flat(&self.intra, r, m);
            flat.min(hier)
        } else {
            flat
        }
    }

    /// Reduce-scatter of `m` input bytes (or all-gather of `m` output bytes).
    pub fn reduce_scatter(&self, g: Group, m: f64) -> f64 {
        scatter_gather_flat(self.link(g), g.ranks, m)
    }

    /// Broadcast of `m` bytes.
    pub fn broadcast(&self, g: Group, m: f64) -> f64 {
        let n = g.ranks;
        if n <= 1 {
            return 0.0;
        }
        let l = self.link(g);
        let (a, b, nf) = (l.alpha(), l.beta(), n as f64);
        let tree = log2_ceil(n) * (a + m / b);
        let scatter_allgather = (log2_ceil(n) + nf - 1.0) * a + 2.0 * (nf - 1.0) / nf * m / b;
        tree.min(scatter_allgather)
    }

    /// One message of `m` bytes between two ranks on the same node or on two nodes.
    pub fn sendrecv(&self, across_nodes: bool, m: f64) -> f64 {
        if across_nodes {
            self.inter.time(m)
        } else {
            self.intra.time(m)
        }
    }

    /// The model's time for a `fugu bench comm` row measured on `g`.
    pub fn time_of(&self, op: &str, g: Group, bytes: f64) -> Option<f64> {
        Some(match op {
            "allreduce" => self.allreduce(g, bytes),
            "reduce-scatter" | "allgather" => self.reduce_scatter(g, bytes),
            "broadcast" => self.broadcast(g, bytes),
            "sendrecv" => self.sendrecv(g.nodes > 1, bytes),
            _ => return None,
        })
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
        bail!("the large sendrecv messages took no longer than the small ones: no bandwidth to fit");
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
        assert!(close(NET.allreduce(one_node, 8.0), 2.0 * (0.5e-6 + 8.0 / 10e9)));
        // Reduce-scatter of 4 blocks: 2 α + 3/4 m/β.
        assert!(close(NET.reduce_scatter(one_node, m), 2.0 * 0.5e-6 + 0.75 * m / 10e9));
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
        let g = Group { ranks: 32, nodes: 8 };
        let hier = 2.0 * (2.0 * 0.5e-6 + 0.75 * m / 10e9) + (2.0 * 3.0 * 2e-6 + 1.75 * (m / 4.0) / 5e9);
        assert!(close(NET.allreduce(g, m), hier), "{} vs {hier}", NET.allreduce(g, m));
        assert!(NET.allreduce(g, m) < allreduce_flat(&NET.inter, 32, m));
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
        assert!((fit.link.beta_gbs - 4.0).abs() < 1e-6, "{fit:?}");
        assert!(fit.max_rel_err < 0.01 && fit.rows == 22);
        let e = fit_link(&rows[..5]).unwrap_err().to_string();
        assert!(e.contains("at least two of 64 KiB"), "{e}");
    }
}

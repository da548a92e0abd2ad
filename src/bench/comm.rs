//! `fugu bench comm`: the collectives and point-to-point transfers of fugu's trainer, timed
//! through its own [`Comm`] (MPI underneath: the calls, buffers and copies a training step
//! makes) over message sizes, in the style of the OSU micro-benchmarks and nccl-tests.
//!
//! Per operation and size: one warm-up sample that also **checks the result** (every rank's
//! data is distinct, so a wrong or missing transfer is an error, not a fast number), then
//! `repeats` samples of `iters` back-to-back operations between barriers. A sample's time per
//! operation is the slowest rank's; the row reports the median and the minimum over samples,
//! the algorithm bandwidth `bytes / time` and the bus bandwidth `algbw × factor` (nccl-tests'
//! convention: the bytes each rank's link carries, comparable across rank counts and with
//! the network's bandwidth):
//!
//! | op | `bytes` is | busbw factor | fugu's call |
//! |---|---|---|---|
//! | `allreduce` | the buffer | 2(n−1)/n | `allreduce_f32` (in place, as TP and the gradient norm use it) |
//! | `reduce-scatter` | the input (n blocks) | (n−1)/n | `start_reduce_scatter` + `wait` (ZeRO-1's gradients) |
//! | `allgather` | the output (n blocks) | (n−1)/n | `allgather_f32` (ZeRO-1's parameters, vocabulary-parallel logits) |
//! | `broadcast` | the buffer (from rank 0) | 1 | `broadcast_f32` |
//! | `sendrecv` | one message | 1 | `start_send`/`start_recv` + `wait`, ping-pong between rank 0 and the last rank; the time is half a round trip (pipeline stages) |

use crate::bench::stats::median;
use crate::comm::{Comm, ReduceOp};
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// The operations of [`CommOp::ALL`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommOp {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    SendRecv,
}

impl CommOp {
    /// Every operation, in report order.
    pub const ALL: [CommOp; 5] = [
        CommOp::AllReduce,
        CommOp::ReduceScatter,
        CommOp::AllGather,
        CommOp::Broadcast,
        CommOp::SendRecv,
    ];

    /// The name used by `--op` and in the output.
    pub fn name(self) -> &'static str {
        match self {
            CommOp::AllReduce => "allreduce",
            CommOp::ReduceScatter => "reduce-scatter",
            CommOp::AllGather => "allgather",
            CommOp::Broadcast => "broadcast",
            CommOp::SendRecv => "sendrecv",
        }
    }

    /// Parses a name of [`CommOp::name`].
    pub fn parse(s: &str) -> Result<CommOp> {
        match CommOp::ALL.iter().find(|op| op.name() == s) {
            Some(&op) => Ok(op),
            None => bail!(
                "unknown operation '{s}': expected one of {}",
                CommOp::ALL.map(|op| op.name()).join(", ")
            ),
        }
    }

    /// Bus bandwidth over algorithm bandwidth for `n` ranks.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            CommOp::AllReduce => 2.0 * (n - 1.0) / n,
            CommOp::ReduceScatter | CommOp::AllGather => (n - 1.0) / n,
            CommOp::Broadcast | CommOp::SendRecv => 1.0,
        }
    }

    /// f32 elements of the buffer `bytes` names for `n` ranks (see the module table): whole
    /// blocks of at least one element for the block collectives.
    pub fn elements(self, bytes: usize, n: usize) -> usize {
        let floats = (bytes / 4).max(1);
        match self {
            CommOp::ReduceScatter | CommOp::AllGather => (floats / n).max(1) * n,
            _ => floats,
        }
    }
}

/// What to measure.
#[derive(Clone, Debug)]
pub struct CommOptions {
    pub ops: Vec<CommOp>,
    /// Smallest and largest message in bytes (powers of two in between).
    pub min_bytes: usize,
    pub max_bytes: usize,
    /// Timed samples per size (after one checked warm-up sample).
    pub repeats: usize,
    /// Bytes one sample moves at least: `iters = clamp(target / bytes, 1, max_iters)`.
    pub target_bytes: usize,
    pub max_iters: usize,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            ops: CommOp::ALL.to_vec(),
            min_bytes: 4,
            max_bytes: 256 << 20,
            repeats: 5,
            target_bytes: 64 << 20,
            max_iters: 1000,
        }
    }
}

/// One operation at one size (a row of `--format json`, read back by `fugu report`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CommRow {
    pub op: String,
    /// Bytes as the module table defines them (after rounding to whole f32 blocks).
    pub bytes: usize,
    pub ranks: usize,
    /// Operations per sample.
    pub iters: usize,
    pub samples: usize,
    /// Median over samples of the slowest rank's time per operation, in microseconds.
    pub time_us: f64,
    /// The fastest sample.
    pub min_time_us: f64,
    /// `bytes / time` in GB/s (10⁹ bytes per second).
    pub algbw_gbs: f64,
    /// `algbw × bus factor` in GB/s.
    pub busbw_gbs: f64,
}

/// The message sizes: powers of two from `min` (rounded up to one, at least 4) to `max`.
pub fn sizes(min: usize, max: usize) -> Vec<usize> {
    let mut s = min.max(4).next_power_of_two();
    let mut out = Vec::new();
    while s <= max {
        out.push(s);
        s *= 2;
    }
    out
}

/// Parses a size: bytes, or with a suffix B, KiB, MiB, GiB (also K, M, G: binary).
pub fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| {
        anyhow::anyhow!("size '{s}': expected a number of bytes like 4, 64KiB or 256MiB")
    })?;
    let mult = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        u => bail!("size '{s}': unknown unit '{u}' (use B, KiB, MiB or GiB)"),
    };
    n.checked_mul(mult)
        .ok_or_else(|| anyhow::anyhow!("size '{s}' is too large"))
}

/// Runs every operation of `opts` at every size on `comm` (all ranks call it; every rank
/// gets the same rows).
pub fn run(comm: &dyn Comm, opts: &CommOptions) -> Result<Vec<CommRow>> {
    if comm.size() < 2 {
        bail!(
            "fugu bench comm measures transfers between ranks, and this is one process: start \
             it with at least 2 ranks under an MPI launcher (mpirun -np 2 fugu bench comm, srun, \
             or mpiexec in a pjsub job) from a build with `--features mpi`"
        );
    }
    if opts.min_bytes > opts.max_bytes {
        bail!(
            "--min-size ({} B) is larger than --max-size ({} B)",
            opts.min_bytes,
            opts.max_bytes
        );
    }
    if opts.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    let mut rows = Vec::new();
    for &op in &opts.ops {
        let mut last_bytes = 0;
        for bytes in sizes(opts.min_bytes, opts.max_bytes) {
            let elems = op.elements(bytes, comm.size());
            // Tiny sizes round up to the same block for many ranks: measure each once.
            if 4 * elems == last_bytes {
                continue;
            }
            last_bytes = 4 * elems;
            rows.push(run_one(comm, op, elems, opts)?);
        }
    }
    Ok(rows)
}

/// A tag no other transfer of the process uses while the benchmark runs.
const TAG: u32 = 0xBE0C;

/// The buffers of one operation, reused across iterations.
struct Buffers {
    a: Vec<f32>,
    b: Vec<f32>,
}

fn run_one(comm: &dyn Comm, op: CommOp, elems: usize, opts: &CommOptions) -> Result<CommRow> {
    let (n, rank) = (comm.size(), comm.rank());
    let bytes = 4 * elems;
    let iters = (opts.target_bytes / bytes).clamp(1, opts.max_iters.max(1));
    let mut bufs = setup(op, elems, n, rank);
    // Warm-up: one operation, checked, then the timed samples on zeros (so repeated sums stay
    // finite).
    once(comm, op, &mut bufs);
    check(op, &bufs, n, rank)?;
    bufs.a.fill(0.0);
    bufs.b.fill(0.0);
    let mut times = Vec::with_capacity(opts.repeats);
    for _ in 0..opts.repeats {
        comm.barrier();
        let t0 = Instant::now();
        for _ in 0..iters {
            once(comm, op, &mut bufs);
        }
        let mut dt = [t0.elapsed().as_secs_f64() / iters as f64];
        comm.allreduce_f64(&mut dt, ReduceOp::Max);
        times.push(dt[0]);
    }
    times.sort_by(f64::total_cmp);
    let t = median(&times);
    let algbw = bytes as f64 / t / 1e9;
    Ok(CommRow {
        op: op.name().to_string(),
        bytes,
        ranks: n,
        iters,
        samples: times.len(),
        time_us: t * 1e6,
        min_time_us: times[0] * 1e6,
        algbw_gbs: algbw,
        busbw_gbs: algbw * op.bus_factor(n),
    })
}

/// The value rank `r` contributes at element `i` (distinct per rank and element, exact in
/// f32 and in sums of a few ranks).
fn value(r: usize, i: usize) -> f32 {
    ((r + 1) * 1000 + i % 997) as f32
}

fn setup(op: CommOp, elems: usize, n: usize, rank: usize) -> Buffers {
    let mine = |len: usize| (0..len).map(|i| value(rank, i)).collect::<Vec<f32>>();
    match op {
        CommOp::AllReduce | CommOp::Broadcast => Buffers {
            a: mine(elems),
            b: Vec::new(),
        },
        CommOp::ReduceScatter => Buffers {
            a: mine(elems),
            b: vec![0.0; elems / n],
        },
        CommOp::AllGather => Buffers {
            a: mine(elems / n),
            b: vec![0.0; elems],
        },
        CommOp::SendRecv => Buffers {
            a: mine(elems),
            b: vec![0.0; elems],
        },
    }
}

/// One operation on the buffers (results in `a` for the in-place ones, in `b` otherwise).
fn once(comm: &dyn Comm, op: CommOp, bufs: &mut Buffers) {
    let (n, rank) = (comm.size(), comm.rank());
    match op {
        CommOp::AllReduce => comm.allreduce_f32(&mut bufs.a, ReduceOp::Sum),
        CommOp::ReduceScatter => {
            let send = std::mem::take(&mut bufs.a);
            let recv = std::mem::take(&mut bufs.b);
            let (recv, send) = comm.start_reduce_scatter(send, recv).wait();
            (bufs.a, bufs.b) = (send, recv);
        }
        CommOp::AllGather => comm.allgather_f32(&bufs.a, &mut bufs.b),
        CommOp::Broadcast => comm.broadcast_f32(&mut bufs.a),
        CommOp::SendRecv => {
            let last = n - 1;
            let (send, recv) = (std::mem::take(&mut bufs.a), std::mem::take(&mut bufs.b));
            let (send, recv) = if rank == 0 {
                let (_, send) = comm.start_send(last, TAG, send).wait();
                let (recv, _) = comm.start_recv(last, TAG, recv).wait();
                (send, recv)
            } else if rank == last {
                let (recv, _) = comm.start_recv(0, TAG, recv).wait();
                let (_, send) = comm.start_send(0, TAG, send).wait();
                (send, recv)
            } else {
                (send, recv)
            };
            (bufs.a, bufs.b) = (send, recv);
        }
    }
}

/// Checks the warm-up operation's result on this rank.
fn check(op: CommOp, bufs: &Buffers, n: usize, rank: usize) -> Result<()> {
    let sum = |i: usize| (0..n).map(|r| value(r, i)).sum::<f32>();
    let (got, want): (&[f32], Box<dyn Fn(usize) -> f32>) = match op {
        CommOp::AllReduce => (&bufs.a, Box::new(sum)),
        CommOp::ReduceScatter => {
            let block = bufs.b.len();
            (&bufs.b, Box::new(move |i| sum(rank * block + i)))
        }
        CommOp::AllGather => {
            let block = bufs.b.len() / n;
            (&bufs.b, Box::new(move |i| value(i / block, i % block)))
        }
        CommOp::Broadcast => (&bufs.a, Box::new(|i| value(0, i))),
        CommOp::SendRecv => {
            let peer = match rank {
                0 => n - 1,
                r if r == n - 1 => 0,
                _ => return Ok(()),
            };
            (&bufs.b, Box::new(move |i| value(peer, i)))
        }
    };
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want(i)) {
        bail!(
            "{} of {} B on {n} ranks returned {} at element {i} on rank {rank}, expected {}: the \
             transfer is wrong, not just slow",
            op.name(),
            // The message of the module table: the larger buffer (n blocks or the whole).
            4 * bufs.a.len().max(bufs.b.len()),
            got[i],
            want(i)
        );
    }
    Ok(())
}

/// The table `fugu bench comm` prints: one line per operation and size.
pub fn format_table(rows: &[CommRow]) -> String {
    let mut s = format!(
        "{:<15} {:>12} {:>7} {:>12} {:>12} {:>10} {:>10}\n",
        "op", "bytes", "iters", "time us", "min us", "algbw GB/s", "busbw GB/s"
    );
    for r in rows {
        s += &format!(
            "{:<15} {:>12} {:>7} {:>12.2} {:>12.2} {:>10.3} {:>10.3}\n",
            r.op, r.bytes, r.iters, r.time_us, r.min_time_us, r.algbw_gbs, r.busbw_gbs
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::SerialComm;

    #[test]
    fn sizes_are_powers_of_two_between_the_bounds() {
        assert_eq!(sizes(4, 64), vec![4, 8, 16, 32, 64]);
        assert_eq!(sizes(1, 8), vec![4, 8]);
        assert_eq!(sizes(5, 40), vec![8, 16, 32]);
        assert_eq!(sizes(4, 268_435_456).len(), 27);
        assert!(sizes(64, 32).is_empty());
    }

    #[test]
    fn sizes_parse_with_binary_units_and_reject_garbage() {
        assert_eq!(parse_size("4").unwrap(), 4);
        assert_eq!(parse_size("64KiB").unwrap(), 65_536);
        assert_eq!(parse_size("256MiB").unwrap(), 268_435_456);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        for bad in ["", "MiB", "12XB", "-4", "99999999999999999999G"] {
            let e = parse_size(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("'{bad}'")), "{e}");
        }
    }

    #[test]
    fn block_collectives_round_to_whole_blocks_and_bus_factors_follow_nccl_tests() {
        assert_eq!(CommOp::ReduceScatter.elements(4, 3), 3);
        assert_eq!(CommOp::AllGather.elements(64, 3), 15);
        assert_eq!(CommOp::AllReduce.elements(2, 4), 1);
        assert_eq!(CommOp::AllReduce.bus_factor(4), 1.5);
        assert_eq!(CommOp::ReduceScatter.bus_factor(2), 0.5);
        assert_eq!(CommOp::SendRecv.bus_factor(8), 1.0);
        for op in CommOp::ALL {
            assert_eq!(CommOp::parse(op.name()).unwrap(), op);
        }
        assert!(CommOp::parse("alltoall")
            .unwrap_err()
            .to_string()
            .contains("allreduce, reduce-scatter"));
    }

    #[test]
    fn one_process_is_a_clear_error() {
        let e = run(&SerialComm::new(), &CommOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("at least 2 ranks") && e.contains("--features mpi"),
            "{e}"
        );
    }

    /// The result check catches a transfer that did not happen (here: a one-process
    /// "allreduce" that sums nothing, checked as if there were 2 ranks).
    #[test]
    fn a_wrong_result_is_an_error() {
        let comm = SerialComm::new();
        let mut bufs = setup(CommOp::AllReduce, 8, 2, 0);
        once(&comm, CommOp::AllReduce, &mut bufs);
        let e = check(CommOp::AllReduce, &bufs, 2, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("allreduce of 32 B on 2 ranks") && e.contains("expected"),
            "{e}"
        );
        // With the true rank count it passes.
        let mut bufs = setup(CommOp::AllGather, 4, 1, 0);
        once(&comm, CommOp::AllGather, &mut bufs);
        check(CommOp::AllGather, &bufs, 1, 0).unwrap();
    }
}

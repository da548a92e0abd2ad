//! `fugu predict --search`: every layout of a model on a node count that the trainer accepts
//! and memory allows, predicted and ranked by model TFLOP/s per node.
//!
//! The space: ranks per node (and the threads that fill the node), tensor-parallel degree,
//! pipeline stages (balanced by predicted time, [`super::step`]), data-parallel degree (what is
//! left), micro-batch size (a divisor of each replica's sequences), recomputation and ZeRO-1.
//! Each layout is one [`predict`] call (milliseconds), so the search is exhaustive, not
//! heuristic; layouts the trainer would refuse (TP not dividing the heads, more stages than
//! blocks, a batch that does not split) are counted and skipped, and those over memory are
//! counted and dropped.

use super::step::{predict, Layout, Machine, Prediction, Workload};
use crate::config::Precision;
use crate::model::acts::Recompute;
use crate::model::ModelConfig;
use anyhow::{bail, Result};

/// What to search over.
#[derive(Clone, Debug)]
pub struct Space {
    pub model: ModelConfig,
    pub seq_len: usize,
    pub global_batch: usize,
    pub nodes: usize,
    /// Ranks per node to try; each with `threads` per rank, or the node's cores over its ranks.
    pub ranks_per_node: Vec<usize>,
    pub threads: Option<usize>,
    /// Micro-batch sizes to try; `None`: every divisor of a replica's sequences.
    pub micro_batch_sizes: Option<Vec<usize>>,
    pub recompute: Vec<Recompute>,
    /// Rows of logits per LM head chunk (`--loss-chunk`), in every layout.
    pub loss_chunk: Option<usize>,
    /// The step's precision (`--precision`).
    pub precision: Precision,
    /// ZeRO-1 off and on (on only where dp > 1).
    pub zero: Vec<bool>,
}

/// One layout found.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub prediction: Prediction,
    pub recompute: Recompute,
    pub loss_chunk: Option<usize>,
    pub precision: Precision,
    pub micro_batch_size: usize,
}

/// The ranked layouts and what was left out.
#[derive(Clone, Debug)]
pub struct Found {
    /// Layouts within memory, best first.
    pub ranked: Vec<Candidate>,
    /// Layouts predicted, layouts the trainer's rules refuse, layouts over memory.
    pub predicted: usize,
    pub refused: usize,
    pub over_memory: usize,
    /// Why the first refused layout was refused (for a search that finds none).
    pub first_refusal: Option<String>,
}

fn divisors(n: usize) -> Vec<usize> {
    let mut small = Vec::new();
    let mut large = Vec::new();
    let mut d = 1;
    while d * d <= n {
        if n.is_multiple_of(d) {
            small.push(d);
            if d * d != n {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// Every layout of `space` on `machine`, predicted and ranked (module docs).
pub fn search(space: &Space, machine: &Machine, cores_per_node: usize) -> Result<Found> {
    let m = &space.model;
    let mut found = Found {
        ranked: Vec::new(),
        predicted: 0,
        refused: 0,
        over_memory: 0,
        first_refusal: None,
    };
    // One workload per recomputation choice, shared by every layout.
    let workloads: Vec<Workload> = space
        .recompute
        .iter()
        .map(|&recompute| Workload {
            model: m.clone(),
            seq_len: space.seq_len,
            global_batch: space.global_batch,
            recompute,
            loss_chunk: space.loss_chunk,
            precision: space.precision,
            pp_layers: None,
        })
        .collect();
    for &rpn in &space.ranks_per_node {
        let Some(world) = space.nodes.checked_mul(rpn) else {
            bail!(
                "{} node(s) x {rpn} ranks per node: too many ranks to count",
                space.nodes
            );
        };
        let threads = space
            .threads
            .unwrap_or((cores_per_node / rpn.max(1)).max(1));
        // TP divides the heads (the grid checks the rest); PP at most the blocks.
        for tp in divisors(m.n_head)
            .into_iter()
            .filter(|t| world.is_multiple_of(*t))
        {
            for pp in (1..=m.n_layer).filter(|p| world.is_multiple_of(tp * p)) {
                let dp = world / (tp * pp);
                if !space.global_batch.is_multiple_of(dp) {
                    found.refused += 1;
                    continue;
                }
                let per_replica = space.global_batch / dp;
                let sizes = match &space.micro_batch_sizes {
                    Some(s) => s
                        .iter()
                        .copied()
                        .filter(|s| per_replica.is_multiple_of(*s))
                        .collect(),
                    None => divisors(per_replica),
                };
                for mbs in sizes {
                    for w in &workloads {
                        for &zero in space.zero.iter().filter(|z| !**z || dp > 1) {
                            let l = Layout {
                                nodes: space.nodes,
                                ranks_per_node: rpn,
                                threads_per_rank: threads,
                                tp,
                                pp,
                                dp,
                                zero,
                                micro_batches: per_replica / mbs,
                            };
                            let p = match predict(w, &l, machine) {
                                Ok(p) => p,
                                Err(e) => {
                                    found.refused += 1;
                                    found.first_refusal.get_or_insert_with(|| {
                                        format!("tp {tp} x pp {pp} x dp {dp}: {e:#}")
                                    });
                                    continue;
                                }
                            };
                            found.predicted += 1;
                            if !p.fits {
                                found.over_memory += 1;
                                continue;
                            }
                            found.ranked.push(Candidate {
                                prediction: p,
                                recompute: w.recompute,
                                loss_chunk: w.loss_chunk,
                                precision: w.precision,
                                micro_batch_size: mbs,
                            });
                        }
                    }
                }
            }
        }
    }
    // Fastest first; between equals, the one using less memory.
    found.ranked.sort_by(|a, b| {
        let (pa, pb) = (&a.prediction, &b.prediction);
        pb.tflops_per_node
            .total_cmp(&pa.tflops_per_node)
            .then(pa.memory_gib_per_rank.total_cmp(&pb.memory_gib_per_rank))
    });
    Ok(found)
}

impl Candidate {
    /// The `fugu train` flags that run this layout (with the config and data added by the
    /// caller), under `mpirun -np` its world size.
    pub fn train_flags(&self, seq_len: usize) -> String {
        let p = &self.prediction;
        let l = &p.layout;
        let mut f = format!(
            "--seq-len {seq_len} --threads {} --batch-size {} --micro-batches {}",
            l.threads_per_rank,
            l.micro_batches * self.micro_batch_size,
            l.micro_batches
        );
        if l.tp > 1 {
            f += &format!(" --tp {}", l.tp);
        }
        if l.pp > 1 {
            f += &format!(" --pp {} --pp-layers {}", l.pp, join(&p.pp_layers));
        }
        if l.zero {
            f += " --zero 1";
        }
        if self.recompute != Recompute::None {
            f += &format!(" --recompute {}", self.recompute.name());
        }
        if let Some(rows) = self.loss_chunk {
            f += &format!(" --loss-chunk {rows}");
        }
        if self.precision != Precision::Fp32 {
            f += &format!(" --precision {}", self.precision.name());
        }
        f
    }

    /// The job scripts' settings for this layout (`FUGU_*`, as `jobscripts/*/train.sh` read
    /// them).
    pub fn job_settings(&self, seq_len: usize) -> String {
        let p = &self.prediction;
        let l = &p.layout;
        let mut s = format!(
            "FUGU_RANKS_PER_NODE={} FUGU_THREADS={} FUGU_TP={} FUGU_PP={} FUGU_ZERO={} \
             FUGU_SEQ_LEN={seq_len} FUGU_BATCH_SIZE={} FUGU_MICRO_BATCHES={} FUGU_RECOMPUTE={}",
            l.ranks_per_node,
            l.threads_per_rank,
            l.tp,
            l.pp,
            l.zero as u8,
            l.micro_batches * self.micro_batch_size,
            l.micro_batches,
            self.recompute.name()
        );
        if l.pp > 1 {
            s += &format!(" FUGU_PP_LAYERS={}", join(&p.pp_layers));
        }
        if self.precision != Precision::Fp32 {
            s += &format!(" FUGU_PRECISION={}", self.precision.name());
        }
        if let Some(rows) = self.loss_chunk {
            s += &format!(" FUGU_LOSS_CHUNK={rows}");
        }
        s
    }
}

/// `1,2,3`: blocks per stage as `--pp-layers` takes them.
pub fn join(v: &[usize]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::divisors;

    #[test]
    fn divisors_in_order() {
        assert_eq!(divisors(1), [1]);
        assert_eq!(divisors(12), [1, 2, 3, 4, 6, 12]);
        assert_eq!(divisors(36), [1, 2, 3, 4, 6, 9, 12, 18, 36]);
        assert_eq!(divisors(13), [1, 13]);
    }
}

//! Pipeline stages: which contiguous blocks of the model one stage runs.
//!
//! The first stage also owns the embeddings (`wte`, `wpe`), the last the final layernorm, the
//! LM head (the tied `wte`) and the loss. With one stage, that is the whole model. A stage is
//! declared here and the parameter table ([`super::table::gpt2_stage_params`]) and the
//! activation table are built from it, so a stage holds only its own tensors.
//!
//! The split balances compute, not block counts: the LM head of a GPT-2 costs as much as
//! several blocks (2·C·V FLOPs per token against 24·C² + 4·T·C for a block, the second term
//! the attention scores and context at sequence length T: 5.2 blocks for GPT-2 124M at
//! T = 256, 4.5 at T = 1024), so an even split of blocks would leave the last stage the
//! slowest and every other stage waiting for it. The costs are the forward GEMM FLOPs the
//! architecture declares ([`super::registry::cost`]). [`Stage::split`] gives each stage a contiguous run of at least one
//! block, choosing the run lengths that minimise the largest stage cost (blocks, plus the LM
//! head on the last stage); ties go to the split that gives earlier stages more blocks.
//! FLOPs are only an estimate of time (the LM head's large GEMMs run closer to peak than a
//! block's, whose non-GEMM ops the count leaves out): `--pp-layers` sets the blocks per stage
//! explicitly ([`Stage::layout`]).

use crate::model::cost::{Pass, Slice};
use crate::model::registry;
use crate::model::table::padded_vocab;
use crate::model::ModelConfig;
use anyhow::{bail, Result};
use std::ops::Range;

/// One pipeline stage of a model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    /// 0-based stage index.
    pub index: usize,
    /// Number of stages.
    pub count: usize,
    /// The transformer blocks this stage runs (global block indices).
    pub layers: Range<usize>,
}

impl Stage {
    /// The whole model as one stage.
    pub fn whole(n_layer: usize) -> Stage {
        Stage {
            index: 0,
            count: 1,
            layers: 0..n_layer,
        }
    }

    /// This stage holds the embeddings and reads the tokens.
    pub fn is_first(&self) -> bool {
        self.index == 0
    }

    /// This stage holds the final layernorm and LM head and computes the loss.
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }

    /// What one rank of this stage works on per micro-batch of `mb` sequences of `seq_len`
    /// tokens under `tp`-way tensor parallelism (the LM head over the padded vocabulary).
    pub fn slice<'a>(&self, m: &'a ModelConfig, seq_len: usize, mb: usize, tp: usize) -> Slice<'a> {
        Slice {
            model: m,
            seq_len,
            mb,
            tp,
            layers: self.layers.len(),
            first: self.is_first(),
            last: self.is_last(),
            vocab: padded_vocab(m.vocab_size),
        }
    }

    /// The stages of a run with sequences of `seq_len` tokens: `counts[s]` blocks on stage `s`
    /// when given (`--pp-layers`: one count of at least 1 per stage, summing to `n_layer`),
    /// else [`Self::split`].
    pub fn layout(
        m: &ModelConfig,
        pp: usize,
        seq_len: usize,
        counts: Option<&[usize]>,
    ) -> Result<Vec<Stage>> {
        let Some(counts) = counts else {
            return Self::split(m, pp, seq_len);
        };
        if counts.len() != pp {
            bail!(
                "--pp-layers gives {} stage(s), --pp is {pp}: give one block count per stage",
                counts.len()
            );
        }
        if counts.contains(&0) {
            bail!("--pp-layers {counts:?}: every stage needs at least one block");
        }
        let total: usize = counts.iter().sum();
        if total != m.n_layer {
            bail!(
                "--pp-layers {counts:?} sums to {total} blocks, the model has n_layer = {}",
                m.n_layer
            );
        }
        let mut start = 0;
        Ok(counts
            .iter()
            .enumerate()
            .map(|(index, &n)| {
                start += n;
                Stage {
                    index,
                    count: pp,
                    layers: start - n..start,
                }
            })
            .collect())
    }

    /// `m`'s blocks split into `pp` contiguous stages of at least one block each, balancing
    /// the compute per stage at sequence length `seq_len` (module docs): [`Self::balanced`] with
    /// forward GEMM FLOPs as the costs.
    pub fn split(m: &ModelConfig, pp: usize, seq_len: usize) -> Result<Vec<Stage>> {
        // Costs in forward FLOPs of one sequence (the backward's 2x is the same for every
        // part): one block, and the LM head.
        let model_cost = registry::cost(m.arch);
        let one = |layers: usize, last: bool| {
            let s = Slice {
                first: false,
                last,
                ..Stage::whole(layers).slice(m, seq_len, 1, 1)
            };
            model_cost.gemm_flops(Pass::Forward, &s)
        };
        let costs = PartCosts {
            block: one(1, false),
            first: 0.0,
            last: one(0, true),
        };
        Self::balanced(m.n_layer, pp, costs)
    }

    /// `n` blocks split into `pp` contiguous stages of at least one block each, choosing the
    /// run lengths that minimise the largest stage cost (its blocks, plus what the first and
    /// last stage add); ties go to the split that gives earlier stages more blocks. `fugu
    /// predict` calls it with predicted times and prints the counts as `--pp-layers`.
    pub fn balanced(n: usize, pp: usize, c: PartCosts) -> Result<Vec<Stage>> {
        if pp == 0 || pp > n {
            bail!("cannot split model.n_layer = {n} blocks into {pp} pipeline stages (1..={n})");
        }
        let extra = |s: usize| {
            let mut e = 0.0;
            if s == 0 {
                e += c.first;
            }
            if s == pp - 1 {
                e += c.last;
            }
            e
        };
        // best[s][k]: the smallest possible largest cost when stages s.. run blocks k..n,
        // and the length of stage s's run that achieves it.
        let mut best = vec![vec![(f64::INFINITY, 0usize); n + 1]; pp + 1];
        for (k, cell) in best[pp - 1].iter_mut().enumerate().take(n) {
            *cell = ((n - k) as f64 * c.block + extra(pp - 1), n - k);
        }
        for s in (0..pp - 1).rev() {
            let later = pp - 1 - s; // stages after s, at least one block each
            for k in 0..n {
                let mut cell = (f64::INFINITY, 0);
                // Longest run first, so that ties give earlier stages more blocks.
                for len in (1..=n.saturating_sub(k + later)).rev() {
                    let cost = (len as f64 * c.block + extra(s)).max(best[s + 1][k + len].0);
                    if cost < cell.0 {
                        cell = (cost, len);
                    }
                }
                best[s][k] = cell;
            }
        }
        let mut stages = Vec::with_capacity(pp);
        let mut k = 0;
        for (s, row) in best.iter().take(pp).enumerate() {
            let len = row[k].1;
            stages.push(Stage {
                index: s,
                count: pp,
                layers: k..k + len,
            });
            k += len;
        }
        debug_assert_eq!(k, n);
        Ok(stages)
    }

    /// Blocks per stage, as `--pp-layers` takes them.
    pub fn counts(stages: &[Stage]) -> Vec<usize> {
        stages.iter().map(|s| s.layers.len()).collect()
    }
}

/// What the parts of a model cost for [`Stage::balanced`], in any one unit: one block, and
/// what the first stage (embeddings) and the last (final norm, LM head, loss) add.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PartCosts {
    pub block: f64,
    pub first: f64,
    pub last: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;

    fn layers(name: &str, pp: usize, t: usize) -> Vec<Range<usize>> {
        let m = RunConfig::load(name).unwrap().model;
        Stage::split(&m, pp, t)
            .unwrap()
            .into_iter()
            .map(|s| s.layers)
            .collect()
    }

    #[test]
    fn one_stage_is_the_whole_model() {
        let m = RunConfig::load("gpt2-124m").unwrap().model;
        assert_eq!(Stage::split(&m, 1, 1024).unwrap(), vec![Stage::whole(12)]);
        let w = Stage::whole(12);
        assert!(w.is_first() && w.is_last());
    }

    #[test]
    fn the_split_leaves_room_for_the_lm_head() {
        // GPT-2 124M at T = 256: the head is 50304·768 / (12·768² + 2·256·768) = 5.17 blocks;
        // 9 + 3 blocks gives stage costs 9 and 8.17 (an even 6 + 6: 6 and 11.17).
        assert_eq!(layers("gpt2-124m", 2, 256), vec![0..9, 9..12]);
        // At T = 1024 attention makes a block dearer (head = 4.47 blocks): 8 + 4 (8 and 8.47)
        // beats 9 + 3 (9 and 7.47).
        assert_eq!(layers("gpt2-124m", 2, 1024), vec![0..8, 8..12]);
        // gpt2-tiny: the head (about 30 blocks) outweighs all four blocks, so the last stage
        // gets the one block it must have.
        assert_eq!(layers("gpt2-tiny", 2, 64), vec![0..3, 3..4]);
        assert_eq!(layers("gpt2-tiny", 4, 64), vec![0..1, 1..2, 2..3, 3..4]);
    }

    #[test]
    fn stages_partition_the_blocks_and_know_their_ends() {
        let m = RunConfig::load("gpt2-124m").unwrap().model;
        for pp in 1..=12 {
            let st = Stage::split(&m, pp, 1024).unwrap();
            assert_eq!(st.len(), pp);
            let mut next = 0;
            for (i, s) in st.iter().enumerate() {
                assert_eq!(s.layers.start, next);
                assert!(!s.layers.is_empty(), "pp {pp}: stage {i} has no block");
                assert_eq!(s.is_first(), i == 0);
                assert_eq!(s.is_last(), i + 1 == pp);
                next = s.layers.end;
            }
            assert_eq!(next, 12);
        }
        let e = Stage::split(&m, 13, 1024).unwrap_err().to_string();
        assert!(e.contains("n_layer = 12"), "{e}");
    }

    #[test]
    fn balanced_stages_make_room_for_both_ends() {
        // 10 blocks of cost 1, the first stage adding 2 and the last 4: the largest stage
        // cost can be 6 (not 5: 3 + 5 + 1 blocks is too few), and ties give earlier stages
        // more blocks.
        let c = PartCosts {
            block: 1.0,
            first: 2.0,
            last: 4.0,
        };
        let st = Stage::balanced(10, 3, c).unwrap();
        assert_eq!(
            st.iter().map(|s| s.layers.clone()).collect::<Vec<_>>(),
            vec![0..4, 4..9, 9..10]
        );
        assert_eq!(Stage::counts(&st), vec![4, 5, 1]);
        // One block per stage whatever the costs; more stages than blocks is an error.
        assert_eq!(Stage::counts(&Stage::balanced(3, 3, c).unwrap()), [1, 1, 1]);
        assert!(Stage::balanced(3, 4, c).is_err());
    }

    #[test]
    fn explicit_block_counts() {
        let m = RunConfig::load("gpt2-124m").unwrap().model;
        let st = Stage::layout(&m, 2, 256, Some(&[8, 4])).unwrap();
        assert_eq!((st[0].layers.clone(), st[1].layers.clone()), (0..8, 8..12));
        assert_eq!(
            Stage::layout(&m, 2, 256, None).unwrap(),
            Stage::split(&m, 2, 256).unwrap()
        );
        for (pp, counts, want) in [
            (3, &[8, 4, 0][..], "at least one block"),
            (2, &[8, 3], "sums to 11"),
            (2, &[12], "one block count per stage"),
        ] {
            let e = Stage::layout(&m, pp, 256, Some(counts))
                .unwrap_err()
                .to_string();
            assert!(e.contains(want), "{counts:?}: {e}");
        }
    }
}

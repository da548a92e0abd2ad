//! The process grid: `world = pp × dp × tp`, tensor parallelism innermost, pipeline stages
//! outermost (Megatron's order).
//!
//! World rank `r` is tensor-parallel rank `r % tp` of data-parallel replica `(r / tp) % dp` of
//! pipeline stage `r / (tp·dp)`. The order follows the traffic of each kind of parallelism:
//! - TP innermost: its blocking all-reduces come twice per layer in both passes, so the ranks
//!   of one TP group are consecutive: with one rank per CMG and 4 ranks per node they share a
//!   node and never leave it;
//! - DP next: one gradient all-reduce (or reduce-scatter) per step, overlapped with the
//!   backward pass, among the replicas of one stage: nearby nodes;
//! - PP outermost: only a micro-batch's activations (B·T·C floats) cross a stage boundary, the
//!   least traffic of the three, so stages may sit on the most distant nodes.

use crate::model::table::padded_vocab;
use crate::model::ModelConfig;
use anyhow::{bail, Result};

/// Where this process sits in the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub world_rank: usize,
    pub world_size: usize,
    pub pp: usize,
    pub tp: usize,
    pub dp: usize,
    pub pp_rank: usize,
    pub tp_rank: usize,
    pub dp_rank: usize,
}

impl Grid {
    /// One process.
    pub const SERIAL: Grid = Grid {
        world_rank: 0,
        world_size: 1,
        pp: 1,
        tp: 1,
        dp: 1,
        pp_rank: 0,
        tp_rank: 0,
        dp_rank: 0,
    };

    /// The grid of `world_size` ranks with tensor-parallel degree `tp` and `pp` pipeline
    /// stages, checked against the model: `tp × pp` must divide the world size; `tp` the head
    /// count, the MLP width and the padded vocabulary; `pp` must not exceed the layer count.
    /// The error names which.
    pub fn new(
        world_rank: usize,
        world_size: usize,
        tp: usize,
        pp: usize,
        m: &ModelConfig,
    ) -> Result<Grid> {
        if tp == 0 {
            bail!("--tp 0: expected at least 1");
        }
        if pp == 0 {
            bail!("--pp 0: expected at least 1");
        }
        if !world_size.is_multiple_of(tp * pp) {
            if pp == 1 {
                bail!("--tp {tp} does not divide the number of MPI ranks ({world_size})");
            }
            bail!(
                "--tp {tp} x --pp {pp} = {} does not divide the number of MPI ranks ({world_size})",
                tp * pp
            );
        }
        if pp > m.n_layer {
            bail!(
                "--pp {pp} exceeds model.n_layer = {} (every stage runs at least one block)",
                m.n_layer
            );
        }
        if !m.n_head.is_multiple_of(tp) {
            bail!(
                "--tp {tp} does not divide model.n_head = {} (each rank holds n_head/tp heads)",
                m.n_head
            );
        }
        if m.kv_heads() != m.n_head && !m.kv_heads().is_multiple_of(tp) {
            bail!(
                "--tp {tp} does not divide model.n_kv_head = {} (each rank keeps whole key/value heads with the query heads that read them; replicating key/value heads is not supported)",
                m.kv_heads()
            );
        }
        if !m.mlp_width().is_multiple_of(tp) {
            let name = match m.intermediate_size {
                Some(_) => "model.intermediate_size",
                None => "4*n_embd",
            };
            bail!(
                "--tp {tp} does not divide the MLP width {name} = {}",
                m.mlp_width()
            );
        }
        let vp = padded_vocab(m.vocab_size);
        if !vp.is_multiple_of(tp) {
            bail!("--tp {tp} does not divide the padded vocabulary {vp}");
        }
        let dp = world_size / (tp * pp);
        Ok(Grid {
            world_rank,
            world_size,
            pp,
            tp,
            dp,
            pp_rank: world_rank / (tp * dp),
            tp_rank: world_rank % tp,
            dp_rank: (world_rank / tp) % dp,
        })
    }

    /// The world rank at (`pp_rank`, `dp_rank`, `tp_rank`).
    pub fn world_rank_of(&self, pp_rank: usize, dp_rank: usize, tp_rank: usize) -> usize {
        (pp_rank * self.dp + dp_rank) * self.tp + tp_rank
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;

    #[test]
    fn tp_is_innermost() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model;
        let g: Vec<_> = (0..8).map(|r| Grid::new(r, 8, 2, 1, &m).unwrap()).collect();
        assert_eq!(g[5].tp_rank, 1);
        assert_eq!(g[5].dp_rank, 2);
        assert_eq!(g[5].dp, 4);
        assert!(g.iter().all(|x| x.dp_rank * 2 + x.tp_rank == x.world_rank));
    }

    #[test]
    fn pipeline_stages_are_outermost() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model; // 4 layers
        let g: Vec<_> = (0..8).map(|r| Grid::new(r, 8, 2, 2, &m).unwrap()).collect();
        assert_eq!((g[5].pp_rank, g[5].dp_rank, g[5].tp_rank), (1, 0, 1));
        assert_eq!((g[2].pp_rank, g[2].dp_rank, g[2].tp_rank), (0, 1, 0));
        assert!(g.iter().all(|x| x.dp == 2 && x.pp == 2));
        assert!(g
            .iter()
            .all(|x| x.world_rank_of(x.pp_rank, x.dp_rank, x.tp_rank) == x.world_rank));
    }

    #[test]
    fn errors_name_the_constraint() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model; // n_head 4, n_embd 128
        let e = Grid::new(0, 6, 4, 1, &m).unwrap_err().to_string();
        assert!(e.contains("number of MPI ranks (6)"), "{e}");
        let e = Grid::new(0, 3, 3, 1, &m).unwrap_err().to_string();
        assert!(e.contains("n_head = 4"), "{e}");
        let e = Grid::new(0, 1, 0, 1, &m).unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
        let e = Grid::new(0, 4, 2, 4, &m).unwrap_err().to_string();
        assert!(e.contains("--tp 2 x --pp 4 = 8"), "{e}");
        let e = Grid::new(0, 8, 1, 8, &m).unwrap_err().to_string();
        assert!(e.contains("model.n_layer = 4"), "{e}");
    }
}

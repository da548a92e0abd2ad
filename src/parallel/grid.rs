//! The process grid: `world = dp × tp`, tensor parallelism innermost.
//!
//! World rank `r` is tensor-parallel rank `r % tp` of data-parallel replica `r / tp`, so the
//! ranks of one TP group are consecutive: with one rank per CMG and 4 ranks per node they share
//! a node, and the per-layer TP all-reduces never leave it.

use crate::config::ModelConfig;
use crate::model::table::padded_vocab;
use anyhow::{bail, Result};

/// Where this process sits in the grid.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    pub world_rank: usize,
    pub world_size: usize,
    pub tp: usize,
    pub dp: usize,
    pub tp_rank: usize,
    pub dp_rank: usize,
}

impl Grid {
    /// One process.
    pub const SERIAL: Grid = Grid {
        world_rank: 0,
        world_size: 1,
        tp: 1,
        dp: 1,
        tp_rank: 0,
        dp_rank: 0,
    };

    /// The grid of `world_size` ranks with tensor-parallel degree `tp`, checked against the
    /// model: `tp` must divide the world size, the head count, the MLP width and the padded
    /// vocabulary. The error names which.
    pub fn new(world_rank: usize, world_size: usize, tp: usize, m: &ModelConfig) -> Result<Grid> {
        if tp == 0 {
            bail!("--tp 0: expected at least 1");
        }
        if !world_size.is_multiple_of(tp) {
            bail!("--tp {tp} does not divide the number of MPI ranks ({world_size})");
        }
        if !m.n_head.is_multiple_of(tp) {
            bail!(
                "--tp {tp} does not divide model.n_head = {} (each rank holds n_head/tp heads)",
                m.n_head
            );
        }
        if !(4 * m.n_embd).is_multiple_of(tp) {
            bail!(
                "--tp {tp} does not divide the MLP width 4*n_embd = {}",
                4 * m.n_embd
            );
        }
        let vp = padded_vocab(m.vocab_size);
        if !vp.is_multiple_of(tp) {
            bail!("--tp {tp} does not divide the padded vocabulary {vp}");
        }
        Ok(Grid {
            world_rank,
            world_size,
            tp,
            dp: world_size / tp,
            tp_rank: world_rank % tp,
            dp_rank: world_rank / tp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;

    #[test]
    fn tp_is_innermost() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model;
        let g: Vec<_> = (0..8).map(|r| Grid::new(r, 8, 2, &m).unwrap()).collect();
        assert_eq!(g[5].tp_rank, 1);
        assert_eq!(g[5].dp_rank, 2);
        assert_eq!(g[5].dp, 4);
        assert!(g.iter().all(|x| x.dp_rank * 2 + x.tp_rank == x.world_rank));
    }

    #[test]
    fn errors_name_the_constraint() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model; // n_head 4, n_embd 128
        let e = Grid::new(0, 6, 4, &m).unwrap_err().to_string();
        assert!(e.contains("number of MPI ranks (6)"), "{e}");
        let e = Grid::new(0, 3, 3, &m).unwrap_err().to_string();
        assert!(e.contains("n_head = 4"), "{e}");
        let e = Grid::new(0, 1, 0, &m).unwrap_err().to_string();
        assert!(e.contains("at least 1"), "{e}");
    }
}

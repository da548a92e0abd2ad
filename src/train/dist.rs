//! The processes of a training job: MPI (cargo feature `mpi`, when started by an MPI
//! launcher) or one process, and the dp × tp grid and communicators over them.

use crate::config::ModelConfig;
use crate::parallel::{Comm, Grid, SerialComm};
use anyhow::Result;
use std::rc::Rc;

/// Environment variables that MPI launchers set in every rank (Open MPI and Fujitsu MPI,
/// PMI/PMIx as used by MPICH, Intel MPI and `srun`).
const LAUNCHER_VARS: &[&str] = &["OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE", "PMI_RANK"];

/// True when this process was started by an MPI launcher (mpirun, mpiexec, srun).
pub fn launched_by_mpi() -> bool {
    LAUNCHER_VARS.iter().any(|v| std::env::var_os(v).is_some())
}

#[cfg(not(feature = "mpi"))]
fn launcher_world_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// The job's processes and communicators.
pub struct Dist {
    pub grid: Grid,
    pub world: Rc<dyn Comm>,
    pub tp: Rc<dyn Comm>,
    pub dp: Rc<dyn Comm>,
    /// Distinct host names over the job.
    pub nodes: usize,
    #[cfg(feature = "mpi")]
    runtime: Option<crate::parallel::mpi::MpiRuntime>,
}

impl Dist {
    /// One process.
    pub fn serial() -> Dist {
        Dist {
            grid: Grid::SERIAL,
            world: Rc::new(SerialComm::new()),
            tp: Rc::new(SerialComm::new()),
            dp: Rc::new(SerialComm::new()),
            nodes: 1,
            #[cfg(feature = "mpi")]
            runtime: None,
        }
    }

    /// MPI when an MPI launcher started this process, otherwise one process. The grid is
    /// serial-shaped (tp = 1) until [`Dist::make_grid`].
    pub fn init() -> Result<Dist> {
        if !launched_by_mpi() {
            return Ok(Dist::serial());
        }
        #[cfg(feature = "mpi")]
        {
            let rt = crate::parallel::mpi::MpiRuntime::init()?;
            let world = rt.world();
            let (r, n) = (world.rank(), world.size());
            let host = hostname();
            let nodes = match world.gather_bytes(host.as_bytes()) {
                Some(all) => {
                    let set: std::collections::BTreeSet<Vec<u8>> = all.into_iter().collect();
                    set.len()
                }
                None => 0,
            };
            let mut nb = (nodes as u64).to_le_bytes().to_vec();
            world.broadcast_bytes(&mut nb);
            let nodes = u64::from_le_bytes(nb[..8].try_into().expect("8 bytes")) as usize;
            let world: Rc<dyn Comm> = Rc::new(world);
            Ok(Dist {
                grid: Grid {
                    world_rank: r,
                    world_size: n,
                    tp: 1,
                    dp: n,
                    tp_rank: 0,
                    dp_rank: r,
                },
                tp: Rc::new(SerialComm::new()),
                dp: world.clone(),
                world,
                nodes,
                runtime: Some(rt),
            })
        }
        #[cfg(not(feature = "mpi"))]
        {
            match launcher_world_size() {
                Some(n) if n > 1 => anyhow::bail!(
                    "started by an MPI launcher with {n} ranks, but this fugu was built without \
                     MPI support; rebuild with `cargo build --release --features mpi`"
                ),
                _ => Ok(Dist::serial()),
            }
        }
    }

    /// Builds the dp × tp grid for `tp` (checked against the world size and the model) and
    /// the tensor- and data-parallel communicators.
    pub fn make_grid(&mut self, tp: usize, m: &ModelConfig) -> Result<()> {
        let grid = Grid::new(self.grid.world_rank, self.grid.world_size, tp, m)?;
        if grid.world_size == 1 {
            self.grid = grid;
            return Ok(());
        }
        #[cfg(feature = "mpi")]
        {
            let rt = self
                .runtime
                .as_ref()
                .expect("a multi-rank Dist has an MPI runtime");
            // TP groups: same dp index, ordered by tp rank; DP groups: same tp index.
            self.tp = Rc::new(rt.split(grid.dp_rank, grid.tp_rank)?);
            self.dp = Rc::new(rt.split(grid.tp_rank, grid.dp_rank)?);
            self.grid = grid;
            Ok(())
        }
        #[cfg(not(feature = "mpi"))]
        anyhow::bail!("internal: a multi-rank grid without MPI support")
    }

    /// World rank 0: the rank that writes metrics, checkpoints and progress.
    pub fn is_root(&self) -> bool {
        self.grid.world_rank == 0
    }

    /// More than one process.
    pub fn is_parallel(&self) -> bool {
        self.grid.world_size > 1
    }

    /// Payload bytes handed to collectives by this rank so far, over all communicators.
    pub fn payload_bytes(&self) -> u64 {
        self.world.payload_bytes() + self.tp.payload_bytes() + self.dp.payload_bytes()
    }

    /// Ends the whole job after an error on this rank (`MPI_Abort`), so that no rank waits
    /// forever in a collective. Returns (and does nothing) for one process.
    pub fn abort_job(&self, code: i32) {
        #[cfg(feature = "mpi")]
        if let Some(rt) = &self.runtime {
            if self.grid.world_size > 1 {
                rt.abort(code);
            }
        }
        let _ = code;
    }

    /// Mean of `x` over the data-parallel group.
    pub fn dp_mean(&self, x: f64) -> f64 {
        let mut v = [x];
        self.dp
            .allreduce_f64(&mut v, crate::parallel::ReduceOp::Sum);
        v[0] / self.dp.size() as f64
    }
}

/// This machine's host name.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .or_else(|_| std::env::var("HOSTNAME"))
        .unwrap_or_else(|_| "localhost".into())
}

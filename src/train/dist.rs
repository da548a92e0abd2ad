//! The processes of a training job: MPI (cargo feature `mpi`, when started by an MPI
//! launcher) or one process, and the pp × dp × tp grid and communicators over them.

use crate::model::ModelConfig;
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

/// Distinct host names over the ranks of `comm` (every rank gets the count; collective).
pub fn count_hosts(comm: &dyn Comm) -> usize {
    let n = comm
        .gather_bytes(hostname().as_bytes())
        .map(|all| {
            all.into_iter()
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        })
        .unwrap_or(0);
    let mut nb = (n as u64).to_le_bytes().to_vec();
    comm.broadcast_bytes(&mut nb);
    u64::from_le_bytes(nb[..8].try_into().expect("8 bytes")) as usize
}

/// The job's processes and communicators.
pub struct Dist {
    pub grid: Grid,
    pub world: Rc<dyn Comm>,
    pub tp: Rc<dyn Comm>,
    pub dp: Rc<dyn Comm>,
    /// The pipeline: the stages with this rank's data- and tensor-parallel index, in stage
    /// order.
    pub pp: Rc<dyn Comm>,
    /// The first and the last stage of this rank's pipeline, which both hold the tied `wte`
    /// (the pipeline itself with 2 stages; one process with 1, and on middle stages).
    pub tied: Rc<dyn Comm>,
    /// Model parallelism: every stage and tensor-parallel rank of this rank's data-parallel
    /// replica (the tensor-parallel group with one stage).
    pub mp: Rc<dyn Comm>,
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
            pp: Rc::new(SerialComm::new()),
            tied: Rc::new(SerialComm::new()),
            mp: Rc::new(SerialComm::new()),
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
            let nodes = count_hosts(&world);
            let world: Rc<dyn Comm> = Rc::new(world);
            Ok(Dist {
                grid: Grid {
                    world_rank: r,
                    world_size: n,
                    pp: 1,
                    tp: 1,
                    dp: n,
                    pp_rank: 0,
                    tp_rank: 0,
                    dp_rank: r,
                },
                tp: Rc::new(SerialComm::new()),
                dp: world.clone(),
                pp: Rc::new(SerialComm::new()),
                tied: Rc::new(SerialComm::new()),
                mp: Rc::new(SerialComm::new()),
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

    /// Builds the pp × dp × tp grid for `tp` and `pp` (checked against the world size and
    /// the model) and the tensor-parallel, data-parallel, pipeline, tied-embedding and
    /// model-parallel communicators.
    pub fn make_grid(&mut self, tp: usize, pp: usize, m: &ModelConfig) -> Result<()> {
        let grid = Grid::new(self.grid.world_rank, self.grid.world_size, tp, pp, m)?;
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
            // Every split is collective over the world: all ranks make them in this order.
            // TP groups: same stage and dp index, ordered by tp rank; DP groups: same stage
            // and tp index, ordered by dp rank; pipelines: same dp and tp index, by stage.
            let g = grid;
            let replica = g.dp_rank * g.tp + g.tp_rank;
            self.tp = Rc::new(rt.split(g.pp_rank * g.dp + g.dp_rank, g.tp_rank)?);
            self.dp = Rc::new(rt.split(g.pp_rank * g.tp + g.tp_rank, g.dp_rank)?);
            if g.pp > 1 {
                let pipeline: Rc<dyn Comm> = Rc::new(rt.split(replica, g.pp_rank)?);
                self.mp = Rc::new(rt.split(g.dp_rank, g.pp_rank * g.tp + g.tp_rank)?);
                let end = g.pp_rank == 0 || g.pp_rank + 1 == g.pp;
                self.tied = if g.pp == 2 {
                    pipeline.clone()
                } else {
                    // Middle stages get a group of their own (unused).
                    let color = if end {
                        replica
                    } else {
                        g.dp * g.tp + g.world_rank
                    };
                    let c = rt.split(color, g.pp_rank)?;
                    if end {
                        Rc::new(c)
                    } else {
                        Rc::new(SerialComm::new())
                    }
                };
                self.pp = pipeline;
            } else {
                self.mp = self.tp.clone();
            }
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
        let mut bytes = self.world.payload_bytes() + self.tp.payload_bytes();
        bytes += self.dp.payload_bytes();
        if self.grid.pp > 1 {
            // `mp` is `tp` with one stage, and `tied` is `pp` with two: count each group once.
            bytes += self.pp.payload_bytes() + self.mp.payload_bytes();
            if self.grid.pp > 2 {
                bytes += self.tied.payload_bytes();
            }
        }
        bytes
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

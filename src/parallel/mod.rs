//! Parallelism (over the communicator interface, [`crate::comm`]): the dp × tp process grid, tensor-parallel
//! sharding, the data-parallel gradient synchronisation and cross-rank timer statistics.
//!
//! Everything here works with [`SerialComm`] (one process), so the default build has
//! no MPI dependency; the `mpi` cargo feature adds [`mpi::MpiRuntime`].

pub mod grad_sync;
pub mod grid;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod shard;
pub mod timer_stats;

pub use crate::comm::{Comm, Pending, ReduceOp, SerialComm};
pub use grid::Grid;

//! The communicator interface the model and trainer use, independent of MPI.
//!
//! [`Comm`] is a group of processes (the whole job, one tensor-parallel group or one
//! data-parallel group). [`SerialComm`] is the group of one process: every collective is the
//! identity, so serial runs go through exactly the same code as parallel ones. The MPI
//! implementation lives in [`super::mpi`] (cargo feature `mpi`).
//!
//! Only the main thread calls a `Comm` (MPI is initialised with `MPI_THREAD_FUNNELED`).
//!
//! Byte accounting: every collective adds its *payload* (the bytes this rank hands to the
//! collective: the buffer length × element size) to [`Comm::payload_bytes`]. The bytes that
//! actually cross the wire depend on the algorithm MPI picks (a ring all-reduce moves about
//! 2·(p−1)/p × payload per rank), so the payload is the stable quantity to report.

use std::cell::Cell;

/// The reduction of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

/// A non-blocking collective in flight. It owns its buffers, so nothing can touch them until it
/// completes; dropping it waits.
pub trait Pending {
    /// Makes progress and reports whether the collective has completed.
    fn test(&mut self) -> bool;
    /// Waits for completion and returns the result buffer, plus the send buffer back for reuse.
    fn wait(self: Box<Self>) -> (Vec<f32>, Vec<f32>);
}

/// A group of processes.
pub trait Comm {
    /// This process's rank in the group.
    fn rank(&self) -> usize;
    /// Number of processes in the group.
    fn size(&self) -> usize;
    /// Element-wise reduction over the group, result on every rank (in place).
    fn allreduce_f32(&self, buf: &mut [f32], op: ReduceOp);
    /// [`Comm::allreduce_f32`] for `f64`.
    fn allreduce_f64(&self, buf: &mut [f64], op: ReduceOp);
    /// Concatenation of every rank's `send` (all the same length) in rank order, on every rank.
    fn allgather_f32(&self, send: &[f32], recv: &mut [f32]);
    /// Concatenation of every rank's `send` (all the same length) in rank order, on rank 0
    /// (`recv` must be `Some` with `size × send.len()` elements there; ignored elsewhere).
    fn gather_f32(&self, send: &[f32], recv: Option<&mut [f32]>);
    /// Every rank's bytes (any lengths) on rank 0, in rank order; `None` elsewhere.
    fn gather_bytes(&self, send: &[u8]) -> Option<Vec<Vec<u8>>>;
    /// Rank 0's bytes on every rank (`buf` is replaced elsewhere).
    fn broadcast_bytes(&self, buf: &mut Vec<u8>);
    /// Waits until every rank has arrived.
    fn barrier(&self);
    /// Starts a sum all-reduce of `send` into a result of the same length.
    fn start_allreduce(&self, send: Vec<f32>, recv: Vec<f32>) -> Box<dyn Pending>;
    /// Starts a sum reduce-scatter: `send` (a multiple of `size` long) is summed over the
    /// group and rank `r` receives block `r` (`send.len() / size` elements) in `recv`.
    fn start_reduce_scatter(&self, send: Vec<f32>, recv: Vec<f32>) -> Box<dyn Pending>;
    /// Payload bytes handed to collectives so far (see the module docs).
    fn payload_bytes(&self) -> u64;
}

/// A collective that completed immediately.
struct Done {
    send: Vec<f32>,
    recv: Vec<f32>,
}

impl Pending for Done {
    fn test(&mut self) -> bool {
        true
    }
    fn wait(self: Box<Self>) -> (Vec<f32>, Vec<f32>) {
        (self.recv, self.send)
    }
}

/// The group of one process.
#[derive(Debug, Default)]
pub struct SerialComm {
    bytes: Cell<u64>,
}

impl SerialComm {
    pub fn new() -> SerialComm {
        SerialComm::default()
    }
}

impl Comm for SerialComm {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn allreduce_f32(&self, _buf: &mut [f32], _op: ReduceOp) {}
    fn allreduce_f64(&self, _buf: &mut [f64], _op: ReduceOp) {}
    fn allgather_f32(&self, send: &[f32], recv: &mut [f32]) {
        recv.copy_from_slice(send);
    }
    fn gather_f32(&self, send: &[f32], recv: Option<&mut [f32]>) {
        if let Some(r) = recv {
            r.copy_from_slice(send);
        }
    }
    fn gather_bytes(&self, send: &[u8]) -> Option<Vec<Vec<u8>>> {
        Some(vec![send.to_vec()])
    }
    fn broadcast_bytes(&self, _buf: &mut Vec<u8>) {}
    fn barrier(&self) {}
    fn start_allreduce(&self, send: Vec<f32>, mut recv: Vec<f32>) -> Box<dyn Pending> {
        recv.copy_from_slice(&send);
        Box::new(Done { send, recv })
    }
    fn start_reduce_scatter(&self, send: Vec<f32>, mut recv: Vec<f32>) -> Box<dyn Pending> {
        recv.copy_from_slice(&send);
        Box::new(Done { send, recv })
    }
    fn payload_bytes(&self) -> u64 {
        self.bytes.get()
    }
}

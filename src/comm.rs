//! The communicator interface the model and trainer use, independent of MPI.
//!
//! [`Comm`] is a group of processes (the whole job, one tensor-parallel group or one
//! data-parallel group). [`SerialComm`] is the group of one process: every collective is the
//! identity, so serial runs go through exactly the same code as parallel ones. The MPI
//! implementation lives in `parallel::mpi` (cargo feature `mpi`).
//!
//! Only the main thread calls a `Comm` (MPI is initialised with `MPI_THREAD_FUNNELED`).
//!
//! Byte accounting: every collective adds its *payload* (the bytes this rank hands to the
//! collective: the buffer length × element size) to [`Comm::payload_bytes`]. The bytes that
//! actually cross the wire depend on the algorithm MPI picks (a ring all-reduce moves about
//! 2·(p−1)/p × payload per rank), so the payload is the stable quantity to report.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

/// The reduction of a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
    Min,
}

/// A non-blocking collective or point-to-point transfer in flight. It owns its buffers, so
/// nothing can touch them until it completes; dropping it waits.
pub trait Pending {
    /// Makes progress and reports whether the operation has completed.
    fn test(&mut self) -> bool;
    /// Waits for completion and returns the result buffer, plus the send buffer back for reuse
    /// (a send's result buffer and a receive's send buffer are empty).
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
    /// Rank 0's `buf` on every rank; every rank passes the same length (one broadcast, no
    /// length message).
    fn broadcast_f32(&self, buf: &mut [f32]);
    /// Waits until every rank has arrived.
    fn barrier(&self);
    /// Starts a sum all-reduce of `send` into a result of the same length.
    fn start_allreduce(&self, send: Vec<f32>, recv: Vec<f32>) -> Box<dyn Pending>;
    /// Whether the communication library says it reads and writes GPU memory itself (a
    /// CUDA-aware MPI), so that [`Comm::start_allreduce_device`] may be handed device
    /// addresses; `false` where it does not say (the default).
    fn takes_device_memory(&self) -> bool {
        false
    }
    /// Starts a sum all-reduce of the `len` f32 at address `send` into the `len` f32 at `recv`
    /// (a GPU's memory, for a library that takes it), for a group of more than one; waiting
    /// gives back two empty buffers. A group that cannot (the group of one, never asked:
    /// nothing to reduce) panics.
    ///
    /// # Safety
    /// `send` and `recv` must each address `len` f32 that do not overlap, that the library can
    /// read and write (device memory for a CUDA-aware MPI), that stay allocated until the
    /// returned operation has completed (waited for or dropped), and that nothing else writes
    /// meanwhile (nor reads `recv`); work queued on a GPU that writes `send` must have finished.
    unsafe fn start_allreduce_device(&self, send: u64, recv: u64, len: usize) -> Box<dyn Pending> {
        let _ = (send, recv, len);
        panic!("this communicator does not reduce device memory");
    }
    /// Starts a sum reduce-scatter: `send` (a multiple of `size` long) is summed over the
    /// group and rank `r` receives block `r` (`send.len() / size` elements) in `recv`.
    fn start_reduce_scatter(&self, send: Vec<f32>, recv: Vec<f32>) -> Box<dyn Pending>;
    /// Starts sending `data` to rank `to` of the group with message tag `tag`. Messages from
    /// one rank to another with the same tag arrive in the order they were sent. Waiting gives
    /// `data` back (second element) once it may be reused.
    fn start_send(&self, to: usize, tag: u32, data: Vec<f32>) -> Box<dyn Pending>;
    /// Starts receiving exactly `buf.len()` floats sent by rank `from` with tag `tag` into
    /// `buf`; waiting returns the filled buffer (first element).
    fn start_recv(&self, from: usize, tag: u32, buf: Vec<f32>) -> Box<dyn Pending>;
    /// Payload bytes handed to collectives and sends so far (see the module docs).
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

/// Messages a process sent to itself and has not received yet, per tag, oldest first.
type Mailbox = Rc<RefCell<HashMap<u32, VecDeque<Vec<f32>>>>>;

/// A receive on the group of one process: completes once a send to self with its tag exists.
struct SelfRecv {
    mailbox: Mailbox,
    tag: u32,
    buf: Vec<f32>,
}

impl Pending for SelfRecv {
    fn test(&mut self) -> bool {
        self.mailbox
            .borrow()
            .get(&self.tag)
            .is_some_and(|q| !q.is_empty())
    }
    fn wait(mut self: Box<Self>) -> (Vec<f32>, Vec<f32>) {
        let msg = self
            .mailbox
            .borrow_mut()
            .get_mut(&self.tag)
            .and_then(VecDeque::pop_front);
        // Waiting for a message nobody will send would hang a real group: a bug in the caller.
        let msg = msg.unwrap_or_else(|| {
            panic!(
                "receive with tag {} on a one-process group has no matching send",
                self.tag
            )
        });
        assert_eq!(
            msg.len(),
            self.buf.len(),
            "message with tag {} has {} floats, the receive expects {}",
            self.tag,
            msg.len(),
            self.buf.len()
        );
        self.buf.copy_from_slice(&msg);
        (std::mem::take(&mut self.buf), Vec::new())
    }
}

/// The group of one process. Point-to-point messages go to itself: a send is queued and a
/// receive with the same tag takes the oldest.
#[derive(Default)]
pub struct SerialComm {
    bytes: Cell<u64>,
    mailbox: Mailbox,
}

impl std::fmt::Debug for SerialComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialComm").finish_non_exhaustive()
    }
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
    fn broadcast_f32(&self, _buf: &mut [f32]) {}
    fn barrier(&self) {}
    fn start_allreduce(&self, send: Vec<f32>, mut recv: Vec<f32>) -> Box<dyn Pending> {
        recv.copy_from_slice(&send);
        Box::new(Done { send, recv })
    }
    fn start_reduce_scatter(&self, send: Vec<f32>, mut recv: Vec<f32>) -> Box<dyn Pending> {
        recv.copy_from_slice(&send);
        Box::new(Done { send, recv })
    }
    fn start_send(&self, to: usize, tag: u32, data: Vec<f32>) -> Box<dyn Pending> {
        assert_eq!(to, 0, "send to rank {to} of a one-process group");
        self.bytes.set(self.bytes.get() + 4 * data.len() as u64);
        self.mailbox
            .borrow_mut()
            .entry(tag)
            .or_default()
            .push_back(data.clone());
        Box::new(Done {
            send: data,
            recv: Vec::new(),
        })
    }
    fn start_recv(&self, from: usize, tag: u32, buf: Vec<f32>) -> Box<dyn Pending> {
        assert_eq!(from, 0, "receive from rank {from} of a one-process group");
        Box::new(SelfRecv {
            mailbox: self.mailbox.clone(),
            tag,
            buf,
        })
    }
    fn payload_bytes(&self) -> u64 {
        self.bytes.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_to_self_arrive_in_order_per_tag() {
        let c = SerialComm::new();
        let mut r1 = c.start_recv(0, 1, vec![0.0; 2]);
        assert!(!r1.test(), "nothing sent yet");
        let s = c.start_send(0, 1, vec![1.0, 2.0]);
        c.start_send(0, 2, vec![9.0]).wait();
        c.start_send(0, 1, vec![3.0, 4.0]).wait();
        assert_eq!(s.wait().1, vec![1.0, 2.0], "the send buffer comes back");
        assert!(r1.test());
        assert_eq!(r1.wait().0, vec![1.0, 2.0]);
        assert_eq!(c.start_recv(0, 2, vec![0.0]).wait().0, vec![9.0]);
        assert_eq!(c.start_recv(0, 1, vec![0.0; 2]).wait().0, vec![3.0, 4.0]);
        assert_eq!(c.payload_bytes(), 4 * 5);
    }

    #[test]
    #[should_panic(expected = "no matching send")]
    fn a_receive_without_a_send_is_a_bug() {
        SerialComm::new().start_recv(0, 7, vec![0.0]).wait();
    }
}

//! [`Comm`] over MPI (rsmpi; cargo feature `mpi`).
//!
//! Blocking collectives use rsmpi's safe API. The non-blocking all-reduce and reduce-scatter
//! of the gradient buckets call `MPI_Iallreduce` / `MPI_Ireduce_scatter_block` directly: the
//! [`MpiPending`] that owns the request also owns both buffers, so they cannot be touched or
//! freed while MPI may still read or write them, and dropping it waits for completion.

use crate::comm::{Comm, Pending, ReduceOp};
use anyhow::{bail, Result};
use mpi::collective::SystemOperation;
use mpi::datatype::Equivalence;
use mpi::datatype::PartitionMut;
use mpi::ffi;
use mpi::raw::AsRaw;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use std::cell::{Cell, RefCell};
use std::os::raw::{c_int, c_void};

/// The MPI environment; finalises MPI when dropped.
pub struct MpiRuntime {
    _universe: mpi::environment::Universe,
    world: SimpleCommunicator,
}

impl MpiRuntime {
    /// Initialises MPI with `MPI_THREAD_FUNNELED` (compute threads never call MPI).
    pub fn init() -> Result<MpiRuntime> {
        let Some((universe, level)) = mpi::initialize_with_threading(mpi::Threading::Funneled)
        else {
            bail!("MPI was already initialised in this process");
        };
        if level < mpi::Threading::Funneled {
            bail!("the MPI library offers thread level {level:?}; fugu needs at least Funneled");
        }
        let world = universe.world();
        Ok(MpiRuntime {
            _universe: universe,
            world,
        })
    }

    /// The whole job.
    pub fn world(&self) -> MpiComm {
        MpiComm::new(self.world.duplicate())
    }

    /// Splits the world: ranks with the same `color` form one group, ordered by `key`.
    pub fn split(&self, color: usize, key: usize) -> Result<MpiComm> {
        match self
            .world
            .split_by_color_with_key(Color::with_value(color as c_int), key as c_int)
        {
            Some(c) => Ok(MpiComm::new(c)),
            None => bail!("MPI_Comm_split returned no communicator for color {color}"),
        }
    }

    /// Ends every process of the job with `code` (`MPI_Abort`). Used after an error on one
    /// rank so the others do not wait forever in a collective.
    pub fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    /// The MPI library's version string (Open MPI's ends in a NUL and a space: trimmed).
    pub fn library_version() -> String {
        mpi::environment::library_version()
            .map(|v| {
                v.trim_matches(|c: char| c == '\0' || c.is_whitespace())
                    .to_string()
            })
            .unwrap_or_else(|_| "unknown MPI".into())
    }
}

/// Whether the MPI library says it takes CUDA device memory in its calls: Open MPI's
/// `MPIX_Query_cuda_support()` (its `mpi-ext.h` extension), looked up in the loaded library,
/// so that an MPI without the extension (MPICH, ...) answers `false` rather than failing to
/// link. Asked once per process.
fn cuda_aware() -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ANSWER.get_or_init(|| {
        type Query = unsafe extern "C" fn() -> c_int;
        let this = libloading::os::unix::Library::this();
        // SAFETY: `MPIX_Query_cuda_support` is declared `int MPIX_Query_cuda_support(void)` in
        // Open MPI's mpi-ext.h, which `Query` matches; it is called after MPI_Init (the
        // communicator exists), as its documentation requires.
        unsafe {
            this.get::<Query>(b"MPIX_Query_cuda_support\0")
                .is_ok_and(|query| query() == 1)
        }
    })
}

/// One MPI communicator.
pub struct MpiComm {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    bytes: Cell<u64>,
    scratch_f32: RefCell<Vec<f32>>,
    scratch_f64: RefCell<Vec<f64>>,
}

fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum => SystemOperation::sum(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Min => SystemOperation::min(),
    }
}

fn count(len: usize) -> c_int {
    c_int::try_from(len).expect("collective larger than 2^31 elements (buckets are smaller)")
}

impl MpiComm {
    fn new(comm: SimpleCommunicator) -> MpiComm {
        MpiComm {
            rank: comm.rank() as usize,
            size: comm.size() as usize,
            comm,
            bytes: Cell::new(0),
            scratch_f32: RefCell::default(),
            scratch_f64: RefCell::default(),
        }
    }

    fn count_bytes(&self, n: usize) {
        self.bytes.set(self.bytes.get() + n as u64);
    }
}

/// The non-blocking operations: the sum collectives of the gradient buckets and the
/// point-to-point transfers of pipeline parallelism.
#[derive(Clone, Copy)]
enum NonBlocking {
    AllReduce,
    ReduceScatter,
    Send { to: usize, tag: u32 },
    Recv { from: usize, tag: u32 },
}

fn tag(t: u32) -> c_int {
    c_int::try_from(t).expect("message tags are small (micro-batch indices)")
}

fn peer(r: usize) -> c_int {
    r as c_int
}

impl MpiComm {
    /// Starts `kind` on owned buffers (lengths already checked by the caller).
    fn start(&self, kind: NonBlocking, send: Vec<f32>, mut recv: Vec<f32>) -> Box<dyn Pending> {
        let (sp, rp) = (
            send.as_ptr() as *const c_void,
            recv.as_mut_ptr() as *mut c_void,
        );
        // SAFETY: both buffers are moved into the returned MpiPending, which is the only owner
        // until MPI_Wait/MPI_Test reports completion (its Drop waits), so MPI reads `send` and
        // writes `recv` while nothing else can; the heap storage of a Vec does not move when
        // the Vec is moved. The counts fit the lengths (checked by the callers), peers are
        // ranks of this communicator (checked by the callers), and the communicator outlives
        // the request (the trainer waits every bucket and transfer).
        let req = unsafe { self.request(kind, (sp, send.len()), (rp, recv.len())) };
        Box::new(MpiPending {
            req,
            send,
            recv,
            done: false,
        })
    }

    /// Issues `kind` on `send` and `recv` (address and f32 count each), counting the sent
    /// payload, and returns its request.
    ///
    /// # Safety
    /// The buffers must hold their counts, stay allocated and untouched by others (`send` not
    /// written, `recv` not read or written) until the request completes, and be memory this MPI
    /// library can access; peers must be ranks of this communicator.
    unsafe fn request(
        &self,
        kind: NonBlocking,
        (sp, send_len): (*const c_void, usize),
        (rp, recv_len): (*mut c_void, usize),
    ) -> ffi::MPI_Request {
        self.count_bytes(4 * send_len);
        // SAFETY: RSMPI_REQUEST_NULL is a constant of the MPI shim, read-only; the buffers
        // are as the caller guarantees.
        unsafe {
            let mut req = ffi::RSMPI_REQUEST_NULL;
            match kind {
                NonBlocking::AllReduce => ffi::MPI_Iallreduce(
                    sp,
                    rp,
                    count(send_len),
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_SUM,
                    self.comm.as_raw(),
                    &mut req,
                ),
                NonBlocking::ReduceScatter => ffi::MPI_Ireduce_scatter_block(
                    sp,
                    rp,
                    count(recv_len),
                    ffi::RSMPI_FLOAT,
                    ffi::RSMPI_SUM,
                    self.comm.as_raw(),
                    &mut req,
                ),
                NonBlocking::Send { to, tag: t } => ffi::MPI_Isend(
                    sp,
                    count(send_len),
                    ffi::RSMPI_FLOAT,
                    peer(to),
                    tag(t),
                    self.comm.as_raw(),
                    &mut req,
                ),
                NonBlocking::Recv { from, tag: t } => ffi::MPI_Irecv(
                    rp,
                    count(recv_len),
                    ffi::RSMPI_FLOAT,
                    peer(from),
                    tag(t),
                    self.comm.as_raw(),
                    &mut req,
                ),
            };
            req
        }
    }

    /// In-place blocking all-reduce through a kept scratch copy (MPI_IN_PLACE has no
    /// portable value in rsmpi), so the TP all-reduces of every block allocate nothing.
    fn allreduce_in_place<T>(&self, buf: &mut [T], scratch: &RefCell<Vec<T>>, op: ReduceOp)
    where
        T: Copy + Default + Equivalence,
    {
        if self.size == 1 || buf.is_empty() {
            return;
        }
        self.count_bytes(std::mem::size_of_val(buf));
        let mut send = scratch.borrow_mut();
        send.clear();
        send.extend_from_slice(buf);
        self.comm.all_reduce_into(&send[..], buf, system_op(op));
    }
}

impl Comm for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn allreduce_f32(&self, buf: &mut [f32], op: ReduceOp) {
        self.allreduce_in_place(buf, &self.scratch_f32, op);
    }

    fn allreduce_f64(&self, buf: &mut [f64], op: ReduceOp) {
        self.allreduce_in_place(buf, &self.scratch_f64, op);
    }

    fn allgather_f32(&self, send: &[f32], recv: &mut [f32]) {
        assert_eq!(
            recv.len(),
            send.len() * self.size,
            "allgather_f32: recv length"
        );
        self.count_bytes(4 * send.len());
        self.comm.all_gather_into(send, recv);
    }

    fn gather_f32(&self, send: &[f32], recv: Option<&mut [f32]>) {
        self.count_bytes(4 * send.len());
        let root = self.comm.process_at_rank(0);
        if self.rank == 0 {
            let recv = recv.expect("gather_f32: rank 0 needs a receive buffer");
            assert_eq!(
                recv.len(),
                send.len() * self.size,
                "gather_f32: recv length"
            );
            root.gather_into_root(send, recv);
        } else {
            root.gather_into(send);
        }
    }

    fn gather_bytes(&self, send: &[u8]) -> Option<Vec<Vec<u8>>> {
        self.count_bytes(send.len());
        let root = self.comm.process_at_rank(0);
        let len = count(send.len());
        if self.rank != 0 {
            root.gather_into(&len);
            root.gather_varcount_into(send);
            return None;
        }
        let mut lens = vec![0 as c_int; self.size];
        root.gather_into_root(&len, &mut lens[..]);
        let displs: Vec<c_int> = lens
            .iter()
            .scan(0, |acc, &l| {
                let d = *acc;
                *acc += l;
                Some(d)
            })
            .collect();
        let total: usize = lens.iter().map(|&l| l as usize).sum();
        let mut all = vec![0u8; total];
        {
            let mut part = PartitionMut::new(&mut all[..], &lens[..], &displs[..]);
            root.gather_varcount_into_root(send, &mut part);
        }
        Some(
            lens.iter()
                .zip(&displs)
                .map(|(&l, &d)| all[d as usize..(d + l) as usize].to_vec())
                .collect(),
        )
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>) {
        if self.size == 1 {
            return;
        }
        self.count_bytes(buf.len());
        let root = self.comm.process_at_rank(0);
        let mut len = buf.len() as u64;
        root.broadcast_into(&mut len);
        buf.resize(len as usize, 0);
        root.broadcast_into(&mut buf[..]);
    }

    fn broadcast_f32(&self, buf: &mut [f32]) {
        if self.size == 1 {
            return;
        }
        self.count_bytes(std::mem::size_of_val(buf));
        self.comm.process_at_rank(0).broadcast_into(buf);
    }

    fn barrier(&self) {
        self.comm.barrier();
    }

    fn start_allreduce(&self, send: Vec<f32>, recv: Vec<f32>) -> Box<dyn Pending> {
        assert_eq!(send.len(), recv.len(), "start_allreduce: buffer lengths");
        self.start(NonBlocking::AllReduce, send, recv)
    }

    fn takes_device_memory(&self) -> bool {
        cuda_aware()
    }

    unsafe fn start_allreduce_device(&self, send: u64, recv: u64, len: usize) -> Box<dyn Pending> {
        let (sp, rp) = (send as *const c_void, recv as *mut c_void);
        // SAFETY: the caller guarantees that `send` and `recv` hold `len` f32 each, apart, that
        // the library may access, that stay allocated and untouched by others until the
        // returned MpiPending completes (its Drop waits); the communicator outlives the
        // request (the trainer waits every bucket).
        let req = unsafe { self.request(NonBlocking::AllReduce, (sp, len), (rp, len)) };
        Box::new(MpiPending {
            req,
            send: Vec::new(),
            recv: Vec::new(),
            done: false,
        })
    }

    fn start_reduce_scatter(&self, send: Vec<f32>, recv: Vec<f32>) -> Box<dyn Pending> {
        assert_eq!(
            send.len(),
            recv.len() * self.size,
            "start_reduce_scatter: buffer lengths"
        );
        self.start(NonBlocking::ReduceScatter, send, recv)
    }

    fn start_send(&self, to: usize, tag: u32, data: Vec<f32>) -> Box<dyn Pending> {
        assert!(
            to < self.size,
            "send to rank {to} of a group of {}",
            self.size
        );
        self.start(NonBlocking::Send { to, tag }, data, Vec::new())
    }

    fn start_recv(&self, from: usize, tag: u32, buf: Vec<f32>) -> Box<dyn Pending> {
        assert!(
            from < self.size,
            "receive from rank {from} of a group of {}",
            self.size
        );
        // Received bytes are counted by the sender.
        self.start(NonBlocking::Recv { from, tag }, Vec::new(), buf)
    }

    fn payload_bytes(&self) -> u64 {
        self.bytes.get()
    }
}

/// A non-blocking collective that owns its buffers.
struct MpiPending {
    req: ffi::MPI_Request,
    send: Vec<f32>,
    recv: Vec<f32>,
    done: bool,
}

impl MpiPending {
    fn wait_now(&mut self) {
        if !self.done {
            // SAFETY: `req` is the live request of this collective (or MPI_REQUEST_NULL after a
            // completed MPI_Test, which MPI_Wait accepts).
            unsafe {
                ffi::MPI_Wait(&mut self.req, ffi::RSMPI_STATUS_IGNORE);
            }
            self.done = true;
        }
    }
}

impl Pending for MpiPending {
    fn test(&mut self) -> bool {
        if !self.done {
            let mut flag: c_int = 0;
            // SAFETY: `req` is the live request of this collective; MPI_Test sets it to
            // MPI_REQUEST_NULL once complete.
            unsafe {
                ffi::MPI_Test(&mut self.req, &mut flag, ffi::RSMPI_STATUS_IGNORE);
            }
            self.done = flag != 0;
        }
        self.done
    }

    fn wait(mut self: Box<Self>) -> (Vec<f32>, Vec<f32>) {
        self.wait_now();
        (
            std::mem::take(&mut self.recv),
            std::mem::take(&mut self.send),
        )
    }
}

impl Drop for MpiPending {
    fn drop(&mut self) {
        self.wait_now();
    }
}

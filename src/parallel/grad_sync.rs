//! Data-parallel gradient synchronisation in buckets, overlapped with the backward pass.
//!
//! The parameter table is cut into buckets of about `bucket_floats` each, at tensor boundaries,
//! from the end of the table (the order backward produces gradients). When
//! [`crate::model::Model::backward_micro`] reports that the gradients from some offset on are
//! final, every bucket above that offset is copied out and its collective started
//! non-blocking; later reports also poll the outstanding ones (Open MPI progresses
//! non-blocking collectives inside MPI calls). [`GradSync::finish`] starts whatever is left,
//! waits, and writes the averaged gradients back. Only the wait is visible time
//! (`allreduce-params`).
//!
//! * Plain data parallelism: each bucket is all-reduced; every rank ends with the averaged
//!   gradient of the whole model.
//! * ZeRO-1: each bucket is reduce-scattered: rank `r` of `dp` ends with the averaged gradient
//!   of block `r` of every bucket ([`GradSync::owned`]), updates just that with its shard of
//!   the AdamW moments, and [`GradSync::gather_params`] all-gathers the updated parameters.
//!
//! With one data-parallel rank everything here is a no-op.
//!
//! Where the buckets go to the collective ([`BucketMemory`], `FUGU_CUDA_AWARE_MPI`): through
//! host memory (a download before, an upload after; any backend and MPI), or, for plain data
//! parallelism on a GPU backend with an MPI that reads and writes GPU memory (CUDA-aware), as
//! device addresses: each bucket is all-reduced from the gradient buffer into a second f32
//! buffer on the device (MPI's in-place all-reduce has no portable spelling in rsmpi), then
//! averaged and copied back there by the backend's kernels. The same sums and the same f32
//! multiply as the host path, so the same bits.

use crate::backend::{Backend, BufId, Span};
use crate::comm::{Comm, Pending};
use crate::dtype::Dtype;
use crate::model::table::Table;
use crate::model::OwnedRange;
use anyhow::{bail, Result};
use std::ops::Range;
use std::rc::Rc;

/// Environment variable: where the gradient buckets go to MPI ([`BucketMemory`]).
pub const CUDA_AWARE_MPI_ENV: &str = "FUGU_CUDA_AWARE_MPI";

/// Where the data-parallel buckets are handed to the collective, as asked
/// (`FUGU_CUDA_AWARE_MPI`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BucketMemory {
    /// Host memory (`off`, the default until the device path has run on a GPU).
    #[default]
    Host,
    /// Device memory where the backend's buffers are a GPU's, the MPI library says it takes
    /// them (Open MPI's `MPIX_Query_cuda_support`) and ZeRO-1 is off; else host (`auto`).
    Auto,
    /// Device memory, told rather than asked (`on`: an MPI that takes GPU memory without
    /// saying so); refused with ZeRO-1 or host buffers.
    Device,
}

impl BucketMemory {
    /// The choice in [`CUDA_AWARE_MPI_ENV`] (`off`, `auto`, `on`; unset: `off`).
    pub fn from_env() -> Result<BucketMemory> {
        match std::env::var(CUDA_AWARE_MPI_ENV).as_deref() {
            Err(_) | Ok("off") => Ok(BucketMemory::Host),
            Ok("auto") => Ok(BucketMemory::Auto),
            Ok("on") => Ok(BucketMemory::Device),
            Ok(v) => bail!("{CUDA_AWARE_MPI_ENV}={v}: expected off, auto or on"),
        }
    }
}

/// Where this rank's buckets go to the collective.
enum Staging {
    /// Downloaded into host vectors and uploaded back.
    Host,
    /// Device addresses, summed into `sums` (f32, the gradient buffer's length).
    Device { sums: BufId, bytes: usize },
}

/// Default bucket size (floats): 4 Mi floats = 16 MiB, about 13 buckets for GPT-2 124M.
pub const DEFAULT_BUCKET_FLOATS: usize = 4 << 20;

/// One bucket: a contiguous range of the flat gradient buffer.
#[derive(Clone, Debug)]
struct Bucket {
    range: Range<usize>,
    /// ZeRO-1 block length (`⌈len / dp⌉`); rank `r` owns `[start + r·chunk, start + (r+1)·chunk)`.
    chunk: usize,
}

impl Bucket {
    fn owned(&self, r: usize) -> Range<usize> {
        let lo = (self.range.start + r * self.chunk).min(self.range.end);
        let hi = (lo + self.chunk).min(self.range.end);
        lo..hi
    }
}

/// The bucketed gradient synchronisation of one data-parallel group.
pub struct GradSync {
    comm: Rc<dyn Comm>,
    zero: bool,
    staging: Staging,
    /// In table order; launched from the last.
    buckets: Vec<Bucket>,
    pending: Vec<Option<Box<dyn Pending>>>,
    /// Buffers kept between steps (send, recv) per bucket.
    spare: Vec<Option<(Vec<f32>, Vec<f32>)>>,
    /// Buckets `next..` have been started this step.
    next: usize,
    /// ZeRO-1 parameter all-gather buffers (send block, gathered bucket), kept between steps.
    gather_scratch: (Vec<f32>, Vec<f32>),
}

/// The buckets' ranges of the flat gradient buffer, in offset order: cut at tensor boundaries,
/// from the end (the gradients that become final first), each at least `bucket_floats` except
/// the first. `fugu predict` models the overlap with the same cuts.
pub fn bucket_ranges(table: &Table, bucket_floats: usize) -> Vec<std::ops::Range<usize>> {
    let total = table.total();
    let mut cuts = vec![total];
    let mut hi = total;
    for spec in table.specs().iter().rev() {
        if hi - spec.offset >= bucket_floats.max(1) {
            cuts.push(spec.offset);
            hi = spec.offset;
        }
    }
    if *cuts.last().unwrap() != 0 {
        cuts.push(0);
    }
    cuts.reverse();
    cuts.windows(2)
        .filter(|w| w[1] > w[0])
        .map(|w| w[0]..w[1])
        .collect()
}

impl GradSync {
    /// Buckets of about `bucket_floats` over `table` for the data-parallel group `comm`.
    pub fn new(table: &Table, comm: Rc<dyn Comm>, bucket_floats: usize, zero: bool) -> GradSync {
        let dp = comm.size();
        let buckets: Vec<Bucket> = bucket_ranges(table, bucket_floats)
            .into_iter()
            .map(|range| Bucket {
                chunk: range.len().div_ceil(dp),
                range,
            })
            .collect();
        let n = buckets.len();
        GradSync {
            comm,
            zero,
            staging: Staging::Host,
            next: n,
            pending: (0..n).map(|_| None).collect(),
            spare: (0..n).map(|_| None).collect(),
            gather_scratch: Default::default(),
            buckets,
        }
    }

    /// Hands the buckets to the collective in the device's memory where `ask` says so and the
    /// backend and MPI library allow it (see [`BucketMemory`]); a device buffer of the
    /// gradients' length receives the sums. Call once, before the first step. Refuses `on`
    /// (naming the setting) where it cannot be done; nothing changes with one rank.
    pub fn place_buckets<B: Backend>(
        &mut self,
        ask: BucketMemory,
        be: &mut B,
        grads: BufId,
    ) -> Result<()> {
        if !self.active() || ask == BucketMemory::Host {
            return Ok(());
        }
        let on_device = be.device_address(be.whole(grads)).is_some();
        if ask == BucketMemory::Device {
            if !on_device {
                bail!(
                    "{CUDA_AWARE_MPI_ENV}=on: the gradients are in host memory (--device {}); \
                     it takes a GPU backend (--device cuda)",
                    be.name()
                );
            }
            if self.zero {
                bail!(
                    "{CUDA_AWARE_MPI_ENV}=on: ZeRO-1's reduce-scatter goes through host memory \
                     only; use --zero 0, or {CUDA_AWARE_MPI_ENV}=auto or off"
                );
            }
        } else if !(on_device && self.comm.takes_device_memory() && !self.zero) {
            return Ok(());
        }
        let len = be.buf_len(grads);
        let sums = be.alloc(len, Dtype::F32)?;
        self.staging = Staging::Device {
            sums,
            bytes: 4 * len,
        };
        Ok(())
    }

    /// Where the buckets go to the collective: `"host"` or `"device"` (the run header).
    pub fn staging(&self) -> &'static str {
        match self.staging {
            Staging::Host => "host",
            Staging::Device { .. } => "device",
        }
    }

    /// Device memory held for the buckets' sums (0 through host memory).
    pub fn device_sums_bytes(&self) -> usize {
        match self.staging {
            Staging::Host => 0,
            Staging::Device { bytes, .. } => bytes,
        }
    }

    /// Number of buckets.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// True when there is more than one data-parallel rank.
    pub fn active(&self) -> bool {
        self.comm.size() > 1
    }

    /// The parameter ranges this rank updates: everything, or with ZeRO-1 its block of every
    /// bucket (moments packed in that order).
    pub fn owned(&self, total: usize) -> Vec<OwnedRange> {
        if !self.zero || !self.active() {
            return vec![OwnedRange {
                flat: 0..total,
                moment_offset: 0,
            }];
        }
        let r = self.comm.rank();
        let mut off = 0;
        self.buckets
            .iter()
            .map(|b| b.owned(r))
            .filter(|o| !o.is_empty())
            .map(|flat| {
                let o = OwnedRange {
                    flat: flat.clone(),
                    moment_offset: off,
                };
                off += flat.len();
                o
            })
            .collect()
    }

    /// Call before a step's backward pass.
    pub fn begin_step(&mut self) {
        self.next = self.buckets.len();
    }

    /// Gradients at offsets `from..` are final: start every bucket that lies there, and poll
    /// the ones in flight.
    pub fn ready<B: Backend>(&mut self, be: &B, grads: BufId, from: usize) {
        if !self.active() {
            return;
        }
        while self.next > 0 && self.buckets[self.next - 1].range.start >= from {
            self.next -= 1;
            self.start(be, grads, self.next);
        }
        for p in self.pending.iter_mut().flatten() {
            p.test();
        }
    }

    fn start<B: Backend>(&mut self, be: &B, grads: BufId, i: usize) {
        let b = &self.buckets[i];
        let dp = self.comm.size();
        let len = b.range.len();
        if let Staging::Device { sums, .. } = self.staging {
            let at = |buf| Span {
                buf,
                offset: b.range.start,
                len,
            };
            let addresses = be
                .device_address(at(grads))
                .zip(be.device_address(at(sums)));
            let (send, recv) = addresses.expect("place_buckets checked the device buffers");
            be.sync();
            // SAFETY: both are `len` f32 of the device's own buffers (the gradients and the
            // sums, apart), which stay allocated while the operation is in flight (the trainer
            // drops this before the model, and dropping a pending operation waits); the
            // backward pass has finished writing this range (`ready`: final from here on, and
            // the device's queued work just waited for), nothing touches it until `finish` has
            // waited, and the sums are read only there. The library takes device memory
            // (`place_buckets`: it says so, or the user said so).
            self.pending[i] = Some(unsafe { self.comm.start_allreduce_device(send, recv, len) });
            return;
        }
        let (send_len, recv_len) = if self.zero {
            (b.chunk * dp, b.chunk)
        } else {
            (len, len)
        };
        let (mut send, recv) = self.spare[i]
            .take()
            .unwrap_or_else(|| (vec![0.0; send_len], vec![0.0; recv_len]));
        be.download(
            Span {
                buf: grads,
                offset: b.range.start,
                len,
            },
            &mut send[..len],
        );
        self.pending[i] = Some(if self.zero {
            self.comm.start_reduce_scatter(send, recv)
        } else {
            self.comm.start_allreduce(send, recv)
        });
    }

    /// Starts the buckets not started yet, waits for all, and writes the averaged gradients
    /// back (all of them, or with ZeRO-1 this rank's blocks).
    pub fn finish<B: Backend>(&mut self, be: &mut B, grads: BufId) {
        if !self.active() {
            return;
        }
        self.ready(be, grads, 0);
        let scale = 1.0 / self.comm.size() as f32;
        let r = self.comm.rank();
        for i in (0..self.buckets.len()).rev() {
            let Some(p) = self.pending[i].take() else {
                continue;
            };
            let (mut result, send) = p.wait();
            let b = &self.buckets[i];
            if let Staging::Device { sums, .. } = self.staging {
                let at = |buf| Span {
                    buf,
                    offset: b.range.start,
                    len: b.range.len(),
                };
                be.scale_inplace(at(sums), scale);
                be.copy(at(grads), at(sums));
                continue;
            }
            let dst = if self.zero {
                b.owned(r)
            } else {
                b.range.clone()
            };
            let n = dst.len();
            for x in &mut result[..n] {
                *x *= scale;
            }
            be.upload(
                Span {
                    buf: grads,
                    offset: dst.start,
                    len: n,
                },
                &result[..n],
            );
            self.spare[i] = Some((send, result));
        }
    }

    /// ZeRO-1: all-gathers every rank's updated parameter blocks so that all ranks hold the
    /// whole updated model. A no-op without ZeRO.
    pub fn gather_params<B: Backend>(&mut self, be: &mut B, params: BufId) {
        if !self.zero || !self.active() {
            return;
        }
        let dp = self.comm.size();
        let r = self.comm.rank();
        let (send, all) = &mut self.gather_scratch;
        for b in &self.buckets {
            let own = b.owned(r);
            // The padding after a short last block is never read back.
            send.resize(b.chunk, 0.0);
            all.resize(b.chunk * dp, 0.0);
            be.download(
                Span {
                    buf: params,
                    offset: own.start,
                    len: own.len(),
                },
                &mut send[..own.len()],
            );
            self.comm.allgather_f32(send, all);
            let len = b.range.len();
            be.upload(
                Span {
                    buf: params,
                    offset: b.range.start,
                    len,
                },
                &all[..len],
            );
        }
    }
}

/// Packs the parts of a whole-table buffer that `owned` selects (the inverse of placing a
/// packed moment buffer).
pub fn pack_owned(full: &[f32], owned: &[OwnedRange]) -> Vec<f32> {
    let mut out = Vec::with_capacity(owned.iter().map(|o| o.flat.len()).sum());
    for o in owned {
        out.extend_from_slice(&full[o.flat.clone()]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RunConfig;
    use crate::model::table::gpt2_params;
    use crate::parallel::SerialComm;

    #[test]
    fn buckets_cover_the_table_at_tensor_boundaries() {
        let m = RunConfig::load("gpt2-tiny").unwrap().model;
        let t = gpt2_params(&m, 1).unwrap();
        let gs = GradSync::new(&t, Rc::new(SerialComm::new()), 100_000, false);
        assert!(gs.buckets() > 3);
        let starts: std::collections::HashSet<usize> = t.specs().iter().map(|s| s.offset).collect();
        let mut at = 0;
        for b in &gs.buckets {
            assert_eq!(b.range.start, at);
            assert!(starts.contains(&b.range.start));
            at = b.range.end;
        }
        assert_eq!(at, t.total());
    }

    #[test]
    fn zero_blocks_partition_each_bucket() {
        let b = Bucket {
            range: 10..21,
            chunk: 11usize.div_ceil(4),
        };
        let parts: Vec<_> = (0..4).map(|r| b.owned(r)).collect();
        assert_eq!(parts, vec![10..13, 13..16, 16..19, 19..21]);
    }
}

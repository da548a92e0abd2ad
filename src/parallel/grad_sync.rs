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

use crate::backend::{Backend, BufId, Span};
use crate::comm::{Comm, Pending};
use crate::model::table::Table;
use crate::model::OwnedRange;
use std::ops::Range;
use std::rc::Rc;

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
            next: n,
            pending: (0..n).map(|_| None).collect(),
            spare: (0..n).map(|_| None).collect(),
            gather_scratch: Default::default(),
            buckets,
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

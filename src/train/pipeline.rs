//! Pipeline parallelism: the 1F1B schedule and the executor that runs one stage of it.
//!
//! A step's batch is `m` micro-batches. [`one_f_one_b`] is the non-interleaved 1F1B schedule
//! (PipeDream-Flush, Megatron-LM's default): stage `s` of `p` runs `min(p − s − 1, m)` warm-up
//! forward passes, then alternates one forward and one backward pass, then drains the
//! remaining backward passes. A stage never holds more than `min(p − s, m)` micro-batches'
//! activations (against `m` for GPipe's all-forward-then-all-backward), and the idle time per
//! stage, the bubble, is `(p − 1)` micro-batch forward+backward times out of `m + p − 1`.
//! Interleaving (Megatron's virtual stages: each rank runs `v` non-contiguous chunks of
//! blocks) would divide the bubble by `v` at the price of `v` times more point-to-point
//! messages; it is not implemented.
//!
//! With one stage the schedule is forward, backward, forward, backward, ...: plain gradient
//! accumulation over `--micro-batches`, the same code path.
//!
//! Between stages, a micro-batch's output residual stream (B·T·C floats, f32 on the wire) goes
//! forward with message tag `2j` and the gradient of a stage's input goes back with tag
//! `2j + 1`, over the pipeline communicator (same data- and tensor-parallel index; with TP
//! every tensor-parallel rank sends its own, identical, copy). Sends are non-blocking, so a
//! stage that sends its forward output and then waits for a gradient never deadlocks with a
//! neighbour doing the opposite; receives block where the data is needed.
//!
//! Timers: `pipeline:bubble` is time blocked waiting for a neighbour's message (the idle
//! time of the schedule, plus the transfer itself, which on one node is small);
//! `pipeline:recv` copies a received message onto the backend; `pipeline:send` copies a
//! message off the backend, posts it, and at the end of the step waits for the posted sends.

use crate::backend::{Backend, Span};
use crate::metrics::ops::trainer;
use crate::metrics::timers::{TimerLevel, Timers};
use crate::model::{Model, Stage};
use crate::parallel::{Comm, Pending, ReduceOp};
use std::rc::Rc;

/// One entry of a stage's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// The forward pass of micro-batch `j`.
    Forward(usize),
    /// The backward pass of micro-batch `j`.
    Backward(usize),
}

/// Stage `stage` of `stages`' non-interleaved 1F1B schedule over `micro` micro-batches
/// (module docs). Backward passes come in the order of the forward passes.
pub fn one_f_one_b(stage: usize, stages: usize, micro: usize) -> Vec<Op> {
    let warmup = (stages - stage - 1).min(micro);
    let mut ops: Vec<Op> = (0..warmup).map(Op::Forward).collect();
    for j in warmup..micro {
        ops.push(Op::Forward(j));
        ops.push(Op::Backward(j - warmup));
    }
    ops.extend((micro - warmup..micro).map(Op::Backward));
    ops
}

/// The most micro-batches stage `stage` of `stages` holds activations for under
/// [`one_f_one_b`].
pub fn in_flight(stage: usize, stages: usize, micro: usize) -> usize {
    (stages - stage).min(micro)
}

fn forward_tag(j: usize) -> u32 {
    2 * j as u32
}

fn backward_tag(j: usize) -> u32 {
    2 * j as u32 + 1
}

/// One stage's end of the pipeline: its communicators and the sends still in flight.
pub struct Pipeline {
    /// The stages of this rank's pipeline, in stage order.
    comm: Rc<dyn Comm>,
    /// The first and the last stage (the two holders of the tied `wte`).
    tied: Rc<dyn Comm>,
    stage: Stage,
    sends: Vec<Box<dyn Pending>>,
    /// Message buffers returned by completed sends, for reuse.
    spare: Vec<Vec<f32>>,
}

impl Pipeline {
    /// The pipeline of `stage` over `comm` (rank = stage index), with `tied` the group of the
    /// first and the last stage.
    pub fn new(comm: Rc<dyn Comm>, tied: Rc<dyn Comm>, stage: Stage) -> Pipeline {
        assert_eq!(comm.size(), stage.count, "pipeline group size");
        assert_eq!(comm.rank(), stage.index, "pipeline group rank");
        Pipeline {
            comm,
            tied,
            stage,
            sends: Vec::new(),
            spare: Vec::new(),
        }
    }

    /// The forward and backward passes of one training step over the `micro` micro-batches
    /// loaded in `model` ([`Model::set_batches`]), in 1F1B order. `ready` is called as the
    /// step's gradients become final (during the last micro-batch's backward pass, and with
    /// `from = 0` once the tied `wte` gradient is summed), as in [`Model::backward_micro`].
    /// Returns the sum of the micro-batch mean losses on the last stage, 0 elsewhere.
    pub fn train_step<B: Backend>(
        &mut self,
        model: &mut dyn Model<B>,
        micro: usize,
        timers: &Timers,
        ready: &mut dyn FnMut(&B, usize),
    ) -> f64 {
        let mut loss = 0.0f64;
        for op in one_f_one_b(self.stage.index, self.stage.count, micro) {
            match op {
                Op::Forward(j) => {
                    if let Some(l) = self.forward(model, j, timers, true) {
                        loss += l as f64;
                    }
                }
                Op::Backward(j) => self.backward(model, j, micro, timers, ready),
            }
        }
        self.flush(timers);
        loss
    }

    /// Forward passes only (evaluation) over the `micro` micro-batches loaded in `model`.
    /// Returns the sum of their mean losses on the last stage, 0 elsewhere.
    pub fn forward_only<B: Backend>(
        &mut self,
        model: &mut dyn Model<B>,
        micro: usize,
        timers: &Timers,
    ) -> f64 {
        let mut loss = 0.0f64;
        for j in 0..micro {
            if let Some(l) = self.forward(model, j, timers, false) {
                loss += l as f64;
            }
        }
        self.flush(timers);
        loss
    }

    fn forward<B: Backend>(
        &mut self,
        model: &mut dyn Model<B>,
        j: usize,
        timers: &Timers,
        for_backward: bool,
    ) -> Option<f32> {
        if !self.stage.is_first() {
            let into = model.stage_input(j);
            self.recv(model, into, self.stage.index - 1, forward_tag(j), timers);
        }
        let loss = model.forward_micro(j, timers, for_backward);
        if !self.stage.is_last() {
            let out = model.stage_output(j);
            self.send(model, out, self.stage.index + 1, forward_tag(j), timers);
        }
        loss
    }

    fn backward<B: Backend>(
        &mut self,
        model: &mut dyn Model<B>,
        j: usize,
        micro: usize,
        timers: &Timers,
        ready: &mut dyn FnMut(&B, usize),
    ) {
        if !self.stage.is_last() {
            let into = model.output_grad();
            self.recv(model, into, self.stage.index + 1, backward_tag(j), timers);
        }
        let step_done = j + 1 == micro;
        if step_done {
            // `from = 0` waits for the tied gradient below.
            model.backward_micro(j, timers, &mut |be, from| {
                if from > 0 {
                    ready(be, from)
                }
            });
        } else {
            model.backward_micro(j, timers, &mut |_, _| {});
        }
        if !self.stage.is_first() {
            let out = model.input_grad();
            self.send(model, out, self.stage.index - 1, backward_tag(j), timers);
        }
        if step_done {
            if let Some(g) = model.tied_grad() {
                // After the send above: the first stage needs it to finish its own last
                // backward pass before it can join this all-reduce.
                let _t = timers.scope(trainer::pipeline::TIED_ALLREDUCE, TimerLevel::Coarse);
                let tied = &*self.tied;
                model
                    .backend_mut()
                    .with_host(g, &mut |x| tied.allreduce_f32(x, ReduceOp::Sum));
            }
            ready(model.backend(), 0);
        }
    }

    /// Receives message `tag` from stage `from` into `into` on the backend.
    fn recv<B: Backend>(
        &mut self,
        model: &mut dyn Model<B>,
        into: Span,
        from: usize,
        tag: u32,
        timers: &Timers,
    ) {
        let buf = self.buffer(into.len);
        let pending = self.comm.start_recv(from, tag, buf);
        let (msg, _) = {
            let _t = timers.scope(trainer::pipeline::BUBBLE, TimerLevel::Coarse);
            pending.wait()
        };
        let _t = timers.scope(trainer::pipeline::RECV, TimerLevel::Coarse);
        model.backend_mut().upload(into, &msg);
        self.spare.push(msg);
    }

    /// Starts sending `span` of the backend to stage `to` as message `tag`.
    fn send<B: Backend>(
        &mut self,
        model: &mut dyn Model<B>,
        span: Span,
        to: usize,
        tag: u32,
        timers: &Timers,
    ) {
        let _t = timers.scope(trainer::pipeline::SEND, TimerLevel::Coarse);
        self.reclaim();
        let mut buf = self.buffer(span.len);
        model.backend().download(span, &mut buf);
        self.sends.push(self.comm.start_send(to, tag, buf));
    }

    /// A message buffer of `len` floats (a spare one when there is one).
    fn buffer(&mut self, len: usize) -> Vec<f32> {
        let mut b = self.spare.pop().unwrap_or_default();
        b.resize(len, 0.0);
        b
    }

    /// Takes back the buffers of sends that have completed.
    fn reclaim(&mut self) {
        let mut i = 0;
        while i < self.sends.len() {
            if self.sends[i].test() {
                let (_, buf) = self.sends.swap_remove(i).wait();
                self.spare.push(buf);
            } else {
                i += 1;
            }
        }
    }

    /// Waits for every posted send (their buffers may then be reused).
    fn flush(&mut self, timers: &Timers) {
        if self.sends.is_empty() {
            return;
        }
        let _t = timers.scope(trainer::pipeline::SEND, TimerLevel::Coarse);
        for s in self.sends.drain(..) {
            let (_, buf) = s.wait();
            self.spare.push(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_stage_is_gradient_accumulation() {
        use Op::*;
        assert_eq!(
            one_f_one_b(0, 1, 3),
            vec![
                Forward(0),
                Backward(0),
                Forward(1),
                Backward(1),
                Forward(2),
                Backward(2)
            ]
        );
    }

    #[test]
    fn warmup_steady_state_and_cooldown() {
        use Op::*;
        // Stage 0 of 4 with 6 micro-batches: 3 warm-up forwards.
        assert_eq!(
            one_f_one_b(0, 4, 6),
            vec![
                Forward(0),
                Forward(1),
                Forward(2),
                Forward(3),
                Backward(0),
                Forward(4),
                Backward(1),
                Forward(5),
                Backward(2),
                Backward(3),
                Backward(4),
                Backward(5)
            ]
        );
        // The last stage alternates from the start.
        assert_eq!(
            one_f_one_b(3, 4, 2),
            vec![Forward(0), Backward(0), Forward(1), Backward(1)]
        );
        // Fewer micro-batches than stages: all forwards, then all backwards.
        assert_eq!(
            one_f_one_b(0, 4, 2),
            vec![Forward(0), Forward(1), Backward(0), Backward(1)]
        );
    }

    /// Every micro-batch runs forward then backward once, backward passes in forward order,
    /// and the activations held never exceed [`in_flight`]. A simulation of all stages
    /// (each op waits for its message from the neighbour) finishes, so the schedule has no
    /// deadlock.
    #[test]
    fn every_schedule_is_complete_bounded_and_deadlock_free() {
        for p in 1..=5 {
            for m in 1..=9 {
                let scheds: Vec<Vec<Op>> = (0..p).map(|s| one_f_one_b(s, p, m)).collect();
                for (s, ops) in scheds.iter().enumerate() {
                    let (mut held, mut peak, mut next_f, mut next_b) = (0usize, 0, 0, 0);
                    for op in ops {
                        match *op {
                            Op::Forward(j) => {
                                assert_eq!(j, next_f);
                                next_f += 1;
                                held += 1;
                            }
                            Op::Backward(j) => {
                                assert_eq!(j, next_b);
                                assert!(j < next_f, "backward before forward");
                                next_b += 1;
                                held -= 1;
                            }
                        }
                        peak = peak.max(held);
                    }
                    assert_eq!((next_f, next_b), (m, m));
                    assert_eq!(peak, in_flight(s, p, m), "p {p} m {m} stage {s}");
                }
                // Simulate: forward j on stage s needs forward j done on s-1; backward j on
                // s needs backward j done on s+1 (sends never block).
                let mut pos = vec![0usize; p];
                let mut fdone = vec![vec![false; m]; p];
                let mut bdone = vec![vec![false; m]; p];
                loop {
                    let mut moved = false;
                    for s in 0..p {
                        while pos[s] < scheds[s].len() {
                            let ok = match scheds[s][pos[s]] {
                                Op::Forward(j) => s == 0 || fdone[s - 1][j],
                                Op::Backward(j) => s + 1 == p || bdone[s + 1][j],
                            };
                            if !ok {
                                break;
                            }
                            match scheds[s][pos[s]] {
                                Op::Forward(j) => fdone[s][j] = true,
                                Op::Backward(j) => bdone[s][j] = true,
                            }
                            pos[s] += 1;
                            moved = true;
                        }
                    }
                    if !moved {
                        break;
                    }
                }
                assert!(
                    (0..p).all(|s| pos[s] == scheds[s].len()),
                    "p {p} m {m}: deadlock at {pos:?}"
                );
            }
        }
    }
}

//! The skeleton every decoder architecture's passes share, written once: a stage's forward
//! pass (the embedding on the first stage, its blocks in order, the final norm on the last and,
//! when decoding, the LM head) and its backward pass in reverse (the head and final norm, each
//! block, run forward again first under [`Recompute::Full`], with the `ready` calls that let
//! data-parallel all-reduces start, then the embedding). An architecture supplies the pieces
//! through [`Blocks`], a view of one micro-batch's activations and its parameters; its block
//! forward and backward are lists of [`Layers`] calls.

use super::acts::Recompute;
use super::contract::GradsReady;
use super::decoder_ops::backward as bwd;
use super::layers::Layers;
use crate::backend::{Backend, Span, TokSpan};
use crate::metrics::timers::TimerLevel::Fine;

/// An architecture's pieces of a pass over one micro-batch on one stage (what a first stage
/// or a last stage lacks is a no-op: no embedding parameters, no head).
pub trait Blocks<B: Backend> {
    /// Blocks on this stage.
    fn layers(&self) -> usize;
    /// The residual stream entering the first block: the embedding's output on the first
    /// stage, the previous stage's output on the others.
    fn encoded(&self) -> Span;
    /// Block `l`'s output (the residual stream after it).
    fn block_output(&self, l: usize) -> Span;
    /// Where block `l`'s parameter gradients start in the gradient buffer: everything from
    /// there on is final once its backward pass is done.
    fn block_grads_start(&self, l: usize) -> usize;
    /// The embedding of `inputs` into [`Self::encoded`], on the first stage.
    fn embed_forward(&self, x: &mut Layers<B>, inputs: TokSpan);
    /// Block `l`'s forward pass from `resid` (its input) into its activations.
    fn block_forward(&self, x: &mut Layers<B>, l: usize, resid: Span);
    /// On the last stage, the final norm of `resid` and, when decoding, the LM head (a
    /// batch's head runs with its loss, [`super::core::Core::head_loss`]).
    fn head_forward(&self, x: &mut Layers<B>, resid: Span);
    /// On the last stage, the LM head's and the final norm's backward pass from the loss
    /// gradient to the gradient of `last`, the last block's output.
    fn head_backward(&self, x: &mut Layers<B>, last: Span);
    /// Block `l`'s backward pass: the gradient of its output in, of `resid` out; with
    /// `recompute_attention` its attention probabilities computed again first.
    fn block_backward(&self, x: &mut Layers<B>, l: usize, resid: Span, recompute_attention: bool);
    /// The embedding's backward pass, on the first stage.
    fn embed_backward(&self, x: &mut Layers<B>, inputs: TokSpan);
}

/// The residual stream entering block `l`.
fn block_input<B: Backend>(s: &impl Blocks<B>, l: usize) -> Span {
    match l {
        0 => s.encoded(),
        _ => s.block_output(l - 1),
    }
}

/// The stage's forward pass from `inputs` (first stage) or its input to its output.
pub fn forward_stage<B: Backend>(x: &mut Layers<B>, s: &impl Blocks<B>, inputs: TokSpan) {
    s.embed_forward(x, inputs);
    for l in 0..s.layers() {
        s.block_forward(x, l, block_input(s, l));
    }
    s.head_forward(x, block_input(s, s.layers()));
}

/// The stage's backward pass after its forward pass (and, on a stage before the last, once
/// the gradient of its output is in place): `ready` is called after each block, in reverse
/// order, and with `from = 0` at the end.
pub fn backward_stage<B: Backend>(
    x: &mut Layers<B>,
    s: &impl Blocks<B>,
    recompute: Recompute,
    inputs: TokSpan,
    ready: &mut GradsReady<B>,
) {
    let layers = s.layers();
    s.head_backward(x, block_input(s, layers));
    for l in (0..layers).rev() {
        let resid = block_input(s, l);
        if recompute == Recompute::Full && l + 1 < layers {
            // This block's activations, as the forward pass computed them, into the set all
            // blocks share (the last block's are still there). Its inner op timers (and TP
            // all-reduces) count as this one.
            let timers = x.timers;
            let _t = timers.scope(bwd::RECOMPUTE, Fine);
            let _quiet = timers.pause();
            s.block_forward(x, l, resid);
        }
        s.block_backward(x, l, resid, recompute == Recompute::Attention);
        ready(x.be, s.block_grads_start(l));
    }
    s.embed_backward(x, inputs);
    ready(x.be, 0);
}

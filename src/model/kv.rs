//! The key/value cache of incremental decoding, in backend memory: one buffer holding, per
//! layer, the keys and then the values of every position, (P, C) each, row `p` for position
//! `p` (C = this rank's attention width).

use crate::backend::{Backend, BufId, Dtype, Span};
use anyhow::Result;

/// Keys and values of `positions` positions for every layer (see the module docs).
#[derive(Debug)]
pub struct KvCache {
    buf: BufId,
    layers: usize,
    positions: usize,
    width: usize,
}

impl KvCache {
    /// Allocates a zeroed cache on `be`, in the model's compute type `dtype`.
    pub fn new<B: Backend>(
        be: &mut B,
        layers: usize,
        positions: usize,
        width: usize,
        dtype: Dtype,
    ) -> Result<KvCache> {
        let buf = be.alloc(2 * layers * positions * width, dtype)?;
        Ok(KvCache {
            buf,
            layers,
            positions,
            width,
        })
    }

    /// The buffer (to free it).
    pub fn buf(&self) -> BufId {
        self.buf
    }

    /// Positions the cache can hold.
    pub fn positions(&self) -> usize {
        self.positions
    }

    fn part(&self, layer: usize, which: usize) -> Span {
        assert!(layer < self.layers, "layer {layer} of {}", self.layers);
        let len = self.positions * self.width;
        Span {
            buf: self.buf,
            offset: (2 * layer + which) * len,
            len,
        }
    }

    /// Keys of `layer`: (positions, width).
    pub fn k(&self, layer: usize) -> Span {
        self.part(layer, 0)
    }

    /// Values of `layer`: (positions, width).
    pub fn v(&self, layer: usize) -> Span {
        self.part(layer, 1)
    }
}

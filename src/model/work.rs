//! What each op of the model computes and moves ([`Work`]), for the breakdown's rates
//! (GFLOP/s, GB/s per op): the arithmetic from the shapes where the model calls the op, the
//! bytes from the spans it passes, at their buffers' storage types.
//!
//! FLOPs are the model's (MFU's convention, [`crate::metrics::megatron_flops_per_step`]): the
//! GEMMs of the linear layers and of attention, a multiply-add counting two; a backward pass
//! twice its forward; recomputation not counted. Attention counts the causal pairs only (a
//! key at or before its query): `b·nh·t(t+1)/2` per product. (FlashAttention's papers count
//! the fused backward as five products, the scores recomputed: multiply its rate by 1.25 to
//! compare.) Ops whose cost is their memory traffic (layernorm, GELU, residual, loss,
//! embedding, optimizer) count bytes only.

use crate::backend::{AttnDims, Backend, Span};
use crate::metrics::Work;

/// Bytes of `spans` at their buffers' storage types.
pub fn bytes<B: Backend>(be: &B, spans: &[Span]) -> f64 {
    spans
        .iter()
        .map(|s| (s.len * be.buf_dtype(s.buf).bytes()) as f64)
        .sum()
}

/// An op that reads `read`, writes `written` and adds into `added` (read and written), whose
/// arithmetic is not counted.
pub fn traffic<B: Backend>(be: &B, read: &[Span], written: &[Span], added: &[Span]) -> Work {
    Work {
        flops: 0.0,
        bytes: bytes(be, read) + bytes(be, written) + 2.0 * bytes(be, added),
    }
}

/// A linear layer's forward pass, `(n, ic) × (ic, oc)`: 2·n·ic·oc FLOPs, reading `read`
/// (input, weight, bias, and the residual stream when the GEMM adds it) and writing `written`.
pub fn linear_forward<B: Backend>(
    be: &B,
    (n, ic, oc): (usize, usize, usize),
    read: &[Span],
    written: &[Span],
) -> Work {
    Work {
        flops: 2.0 * (n * ic * oc) as f64,
        ..traffic(be, read, written, &[])
    }
}

/// A linear layer's backward pass, `(n, ic) × (ic, oc)`: the input gradient `dinp`
/// (overwritten) and the weight gradient `dw` (added into), 2·n·ic·oc FLOPs each; the bias
/// gradient `db` added into; reading `read` (the output gradient, the input, the weight, and
/// for a GELU carried back its input).
pub fn linear_backward<B: Backend>(
    be: &B,
    (n, ic, oc): (usize, usize, usize),
    dinp: Option<Span>,
    dw: Span,
    db: Option<Span>,
    read: &[Span],
) -> Work {
    let products = 1 + dinp.is_some() as usize;
    let added: Vec<Span> = [Some(dw), db].into_iter().flatten().collect();
    let written: Vec<Span> = dinp.into_iter().collect();
    Work {
        flops: (2 * products * n * ic * oc) as f64,
        ..traffic(be, read, &written, &added)
    }
}

/// `products` attention GEMMs (scores, values, or their gradients) over the causal pairs of
/// `d`, reading `read` and writing `written`.
pub fn attention<B: Backend>(
    be: &B,
    d: AttnDims,
    products: usize,
    read: &[Span],
    written: &[Span],
) -> Work {
    Work {
        flops: (2 * products * d.hs) as f64 * causal_pairs(d),
        ..traffic(be, read, written, &[])
    }
}

/// Q, K and V of a (N, (nh + 2·kv)·hs) qkv activation of attention `d`, as spans of their
/// sizes for [`bytes`] (they interleave by row; only their lengths and type are meant).
pub fn qkv_parts(qkv: Span, d: AttnDims) -> (Span, Span, Span) {
    let part = |heads: usize| Span {
        len: qkv.len / (d.nh + 2 * d.kv) * heads,
        ..qkv
    };
    (part(d.nh), part(d.kv), part(d.kv))
}

/// (query, key) pairs with the key at or before the query, over every sequence and head.
pub fn causal_pairs(d: AttnDims) -> f64 {
    (d.b * d.nh) as f64 * (d.t * (d.t + 1) / 2) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::dtype::Dtype;

    #[test]
    fn bytes_follow_each_buffers_type_and_accumulated_spans_count_twice() {
        let mut be = CpuBackend::new();
        let act = be.alloc(100, Dtype::Bf16).unwrap();
        let grad = be.alloc(10, Dtype::F32).unwrap();
        let a = Span {
            buf: act,
            offset: 0,
            len: 100,
        };
        let g = Span {
            buf: grad,
            offset: 0,
            len: 10,
        };
        assert_eq!(bytes(&be, &[a, g]), 240.0);
        // (4, 5) × (5, 2): dinp 4·5 bf16 written; dw 5·2 f32 and db 2 f32 read and written.
        let dw = g.sub(0, 10);
        let db = g.sub(0, 2);
        let w = linear_backward(&be, (4, 5, 2), Some(a.sub(0, 20)), dw, Some(db), &[a]);
        assert_eq!(w.flops, 2.0 * 2.0 * 40.0);
        assert_eq!(w.bytes, 200.0 + 40.0 + 2.0 * (40.0 + 8.0));
        let w = linear_backward(&be, (4, 5, 2), None, dw, None, &[]);
        assert_eq!((w.flops, w.bytes), (80.0, 80.0));
        let d = AttnDims::mha(2, 3, 4, 5);
        assert_eq!(causal_pairs(d), 2.0 * 4.0 * 6.0);
        assert_eq!(attention(&be, d, 2, &[], &[]).flops, 4.0 * 5.0 * 48.0);
    }
}

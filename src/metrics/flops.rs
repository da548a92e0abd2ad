//! Megatron's model FLOPs formula for GPT models, and throughput as TFLOP/s and % of peak.
//! Runs, benchmarks and predictions count model FLOPs from the architecture's cost model
//! (`model/cost.rs`, `CostModel::model_flops`); the formula here is the independent check
//! that GPT-2's cost model (`model/gpt2_cost.rs`) and the ops' declared work agree with it.

/// FLOPs of one training step (forward + backward) of a GPT with `l` layers, hidden size `h`,
/// vocabulary `v`, on `b` sequences of `s` tokens, without activation recomputation:
///
/// ```text
/// F = 72 · B · s · l · h² · (1 + s/(6h) + V/(12·l·h))
///   = 72·B·s·l·h²  +  12·B·s²·l·h  +  6·B·s·h·V
/// ```
///
/// Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
/// Megatron-LM" (SC'21), §5.1 / appendix: a transformer layer's forward pass is
/// 24·B·s·h² (QKV, projection and the 4h MLP GEMMs) + 4·B·s²·h (the attention score and
/// context batched GEMMs), the LM head 2·B·s·h·V; backward is twice the forward. The paper's
/// headline formula, 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)), adds one more forward pass of the
/// layers for full activation recomputation. These are *model* FLOPs (MFU, as PaLM defines
/// it): recomputation (`--recompute`) is extra work the hardware does and is not counted, so
/// the factor is 3 × 24 = 72 and the LM-head term is V/(12·l·h) whatever the recomputation. Only GEMM FLOPs are counted (softmax,
/// layer norm, GELU and the optimizer are ignored), the same convention as Megatron's reported
/// TFLOP/s, so comparisons against it are like for like.
///
/// `b` is the number of sequences the step processes: the global batch for the job's FLOPs,
/// or a process's share (`global / dp`) for its own; divide by the tensor-parallel degree as
/// well for the FLOPs one TP rank executes. Use the padded vocabulary if the model pads it
/// (the padded columns are computed).
pub fn megatron_flops_per_step(b: usize, s: usize, l: usize, h: usize, v: usize) -> f64 {
    let (b, s, l, h, v) = (b as f64, s as f64, l as f64, h as f64, v as f64);
    72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h))
}

/// Achieved TFLOP/s for `flops` done in `secs` seconds (0 when `secs` is not positive).
pub fn tflops(flops: f64, secs: f64) -> f64 {
    if secs > 0.0 {
        flops / secs / 1e12
    } else {
        0.0
    }
}

/// `tflops` as a percentage of a peak given in GFLOP/s (`MachineInfo::peak_gflops`, the same
/// figure `fugu bench gemm` divides by). 0 when the peak is not positive.
pub fn peak_pct(tflops: f64, peak_gflops: f64) -> f64 {
    if peak_gflops > 0.0 {
        100.0 * tflops * 1e3 / peak_gflops
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_124m_by_hand() {
        // B = 8, s = 1024, l = 12, h = 768, V = 50257:
        //   72·8·1024·12·768²  = 4 174 708 211 712
        //   12·8·1024²·12·768  =   927 712 935 936
        //   6·8·1024·768·50257 = 1 897 138 225 152
        //   sum                = 6 999 559 372 800
        let f = megatron_flops_per_step(8, 1024, 12, 768, 50257);
        assert!((f - 6_999_559_372_800.0).abs() < 1.0, "{f}");
        // About 854 MFLOP per token: 6·N (N ≈ 124M) plus attention.
        let per_token = f / (8.0 * 1024.0);
        assert!((per_token / 1e6 - 854.4).abs() < 0.1, "{per_token}");
        // Linear in the batch.
        let f1 = megatron_flops_per_step(1, 1024, 12, 768, 50257);
        assert!((8.0 * f1 - f).abs() < 1.0);
    }

    #[test]
    fn throughput_helpers() {
        assert_eq!(tflops(3e12, 2.0), 1.5);
        assert_eq!(tflops(3e12, 0.0), 0.0);
        // 1.5 TFLOP/s on a 3000 GFLOP/s machine is 50%.
        assert_eq!(peak_pct(1.5, 3000.0), 50.0);
        assert_eq!(peak_pct(1.5, 0.0), 0.0);
    }
}

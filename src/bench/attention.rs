//! `fugu bench attention`: a backend's ways of running causal attention, the forward and the
//! backward pass each timed alone on a model's shape: the three-step path (the scores' batched
//! GEMM, the softmax, the values' GEMM, and their gradients) and every fused form the backend
//! has for the head size and type (on a GPU, each `FUGU_FLASH_*` setting that launches other
//! kernels). Each fused form's output and gradients are first checked against the three-step
//! path's on the same inputs, so a form that computes something else fails instead of
//! reporting a speed.
//!
//! FLOPs are the training breakdown's ([`crate::model::work::attention`]): two products in the
//! forward pass, four in the backward, over the causal (query, key) pairs; FlashAttention's
//! papers count the fused backward as five products (multiply its rate by 1.25 to compare).
//! `dev/bench_attention.py` times PyTorch's scaled-dot-product attention on the same shapes
//! and counts the same way.

use crate::backend::{AttnDims, Backend, Dtype, FusedAttention, FusedOut, Span};
use crate::model::work;
use crate::ops::attention::{form_tolerance as tolerance, max_rel_diff};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::time::Instant;

/// One attention shape to time: where it comes from and its dimensions.
#[derive(Clone, Debug)]
pub struct AttnCase {
    pub name: String,
    pub d: AttnDims,
}

/// The named shape sets: `gpt2` (GPT-2 124M's training shape, heads of 64), `llama` (heads of
/// 128 with grouped-query attention: the `llama-d128` config's shape and a Llama 3 8B layer's),
/// `all`.
pub fn case_set(name: &str) -> Result<Vec<AttnCase>> {
    let case = |name: &str, (b, t, nh, kv, hs)| AttnCase {
        name: name.into(),
        d: AttnDims { b, t, nh, kv, hs },
    };
    Ok(match name {
        "gpt2" => vec![case("gpt2-124m", (16, 1024, 12, 12, 64))],
        "llama" => vec![
            case("llama-d128", (8, 2048, 8, 2, 128)),
            case("llama3-8b", (8, 2048, 32, 8, 128)),
        ],
        "all" => [case_set("gpt2")?, case_set("llama")?].concat(),
        other => bail!("unknown attention shape set {other:?}: expected gpt2, llama or all"),
    })
}

/// A custom shape `BxTxHxHS` (sequences, tokens per sequence, query heads, head size) or
/// `BxTxHxHSxKV` (with KV key/value heads, dividing H: grouped-query attention).
pub fn parse_case(s: &str) -> Result<AttnCase> {
    let what = || format!("attention shape {s:?}: expected BxTxHxHS or BxTxHxHSxKV");
    let n: Vec<usize> = s
        .split('x')
        .map(|p| p.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .with_context(what)?;
    let (b, t, nh, hs, kv) = match n[..] {
        [b, t, nh, hs] => (b, t, nh, hs, nh),
        [b, t, nh, hs, kv] => (b, t, nh, hs, kv),
        _ => bail!("{}", what()),
    };
    if n.contains(&0) {
        bail!("{}: every size must be at least 1", what());
    }
    if !nh.is_multiple_of(kv) {
        bail!("attention shape {s:?}: {kv} key/value heads do not divide {nh} query heads");
    }
    Ok(AttnCase {
        name: "custom".into(),
        d: AttnDims { b, t, nh, kv, hs },
    })
}

/// The pass a row times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AttnPass {
    Forward,
    Backward,
}

impl AttnPass {
    /// Its attention products per causal pair (the training breakdown's count).
    fn products(self) -> usize {
        match self {
            AttnPass::Forward => 2,
            AttnPass::Backward => 4,
        }
    }
}

/// What the benchmark asks of a backend besides [`Backend`]: its fused attention forms, and
/// which kernels a call launched (to label rows, and to time each distinct set once).
pub trait AttentionForms: Backend {
    type Form;
    /// The fused forms to time for heads of `d.hs` in `dt`, each with the settings that
    /// select it, the default first; none where the backend has no fused attention for them.
    fn fused_forms(&self, d: AttnDims, dt: Dtype) -> Vec<(String, Self::Form)>;
    /// Makes `form` the one the attention calls run.
    fn set_form(&mut self, form: &Self::Form) -> Result<()>;
    /// Starts noting the kernels launched.
    fn note_kernels(&self);
    /// The kernels launched since [`Self::note_kernels`], each once (none where the backend
    /// has no kernels to name).
    fn noted_kernels(&self) -> Vec<String>;
}

impl AttentionForms for crate::backend::cpu::CpuBackend {
    type Form = ();

    fn fused_forms(&self, d: AttnDims, dt: Dtype) -> Vec<(String, ())> {
        match self.fused_attention(d.hs, dt) {
            FusedAttention::Unsupported => Vec::new(),
            _ => vec![("fused (reference loops)".into(), ())],
        }
    }

    fn set_form(&mut self, _: &()) -> Result<()> {
        Ok(())
    }

    fn note_kernels(&self) {}

    fn noted_kernels(&self) -> Vec<String> {
        Vec::new()
    }
}

#[cfg(feature = "cuda")]
mod cuda_forms {
    use super::*;
    use crate::backend::cuda::{CudaBackend, FlashForm, FlashSelect};

    impl AttentionForms for CudaBackend {
        type Form = FlashForm;

        /// Every form the device runs ([`FlashForm::every`]), labelled by its settings.
        fn fused_forms(&self, d: AttnDims, dt: Dtype) -> Vec<(String, FlashForm)> {
            if self.fused_attention(d.hs, dt) == FusedAttention::Unsupported {
                return Vec::new();
            }
            FlashForm::every(self.has_wgmma())
                .into_iter()
                .map(|f| (f.label(), f))
                .collect()
        }

        /// The form `f` for every shape (not timed per shape: `FUGU_FLASH_SELECT` set aside).
        fn set_form(&mut self, f: &FlashForm) -> Result<()> {
            self.set_flash_select(FlashSelect::Settings);
            self.set_flash_form(*f)
        }

        fn note_kernels(&self) {
            self.log_launches();
        }

        fn noted_kernels(&self) -> Vec<String> {
            self.launched()
        }
    }
}

/// How long to time each contender, and which.
#[derive(Clone, Debug, Default)]
pub struct AttnBenchOptions {
    /// Seconds of timed calls per contender and pass, over all rounds.
    pub budget_s: f64,
    /// Rounds: every contender is timed once per round, in turn (drift hits all alike).
    pub rounds: usize,
    /// Only the fused forms whose settings contain this text.
    pub only: Option<String>,
    /// Not the fused forms whose settings contain this text.
    pub skip: Option<String>,
}

impl AttnBenchOptions {
    /// Whether the fused form with these settings is to be timed.
    fn wants(&self, label: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|o| label.contains(o.as_str()))
            && self
                .skip
                .as_ref()
                .is_none_or(|s| !label.contains(s.as_str()))
    }
}

/// One timed contender of one pass on one shape.
#[derive(Clone, Debug, Serialize)]
pub struct AttnRow {
    pub case: String,
    pub b: usize,
    pub t: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_size: usize,
    pub dtype: String,
    pub pass: AttnPass,
    /// `three-step`, or the settings selecting a fused form (`default` for none).
    pub form: String,
    /// The kernels it launched (where the backend names them), without the type suffix.
    pub kernels: Vec<String>,
    /// Median over the rounds of the mean time per call, and the fastest round's.
    pub ms: f64,
    pub ms_min: f64,
    pub tflops: f64,
    /// Percent of the backend's peak for the type (none where it has none).
    pub peak_pct: Option<f64>,
    /// The three-step path's time over this one's.
    pub speedup: f64,
    /// Largest difference from the three-step path's result (the output, or the q, k, v
    /// gradients) over the largest |value| of that result, at least 1 (none for the path
    /// itself).
    pub max_rel_diff: Option<f64>,
}

/// The buffers of one shape: inputs, the fused path's outputs and the three-step path's.
struct Bufs {
    qkv: Span,
    dout: Span,
    out: Span,
    lse: Span,
    dqkv: Span,
    att: Span,
    datt: Span,
}

fn alloc_span<B: Backend + ?Sized>(be: &mut B, len: usize, dt: Dtype, what: &str) -> Result<Span> {
    let buf = be
        .alloc(len, dt)
        .with_context(|| format!("allocating attention's {what} ({len} {})", dt.name()))?;
    Ok(be.whole(buf))
}

impl Bufs {
    fn new<B: Backend + ?Sized>(be: &mut B, d: AttnDims, dt: Dtype) -> Result<Bufs> {
        let rows = d.b * d.t;
        let qkv_len = rows * d.shape().qkv_width();
        let scores = d.b * d.nh * d.t * d.t;
        Ok(Bufs {
            qkv: alloc_span(be, qkv_len, dt, "q, k, v")?,
            dout: alloc_span(be, rows * d.nh * d.hs, dt, "output gradient")?,
            out: alloc_span(be, rows * d.nh * d.hs, dt, "output")?,
            lse: alloc_span(be, d.b * d.nh * d.t, Dtype::F32, "log-sum-exp")?,
            dqkv: alloc_span(be, qkv_len, dt, "q, k, v gradients")?,
            att: alloc_span(be, scores, dt, "three-step probabilities")?,
            datt: alloc_span(be, scores, dt, "three-step probability gradients")?,
        })
    }

    fn free<B: Backend + ?Sized>(self, be: &mut B) {
        for s in [
            self.qkv, self.dout, self.out, self.lse, self.dqkv, self.att, self.datt,
        ] {
            be.free(s.buf);
        }
    }
}

/// The three-step path's forward pass (scores, softmax, values).
fn three_step_forward<B: Backend + ?Sized>(be: &mut B, x: &Bufs, d: AttnDims) {
    be.attention_scores(x.att, x.qkv, d);
    be.attention_softmax(x.att, d);
    be.attention_values(x.out, x.att, x.qkv, d);
}

/// The three-step path's backward pass over the probabilities its forward left in `x.att`.
fn three_step_backward<B: Backend + ?Sized>(be: &mut B, x: &Bufs, d: AttnDims) {
    be.attention_values_backward(x.datt, x.dqkv, x.dout, x.att, x.qkv, d);
    be.attention_softmax_backward(x.datt, x.att, d);
    be.attention_scores_backward(x.dqkv, x.datt, x.qkv, d);
}

fn fused_forward<B: Backend + ?Sized>(be: &mut B, x: &Bufs, d: AttnDims) {
    be.attention_forward(x.out, x.lse, x.qkv, d);
}

fn fused_backward<B: Backend + ?Sized>(be: &mut B, x: &Bufs, d: AttnDims) {
    let fwd = FusedOut {
        out: x.out,
        lse: x.lse,
    };
    be.attention_backward(x.dqkv, x.dout, fwd, x.qkv, d, None);
}

fn download<B: Backend + ?Sized>(be: &B, s: Span) -> Vec<f32> {
    let mut v = vec![0.0; s.len];
    be.download(s, &mut v);
    v
}

/// A contender: its label, the kernels it launches, and how to run one call of its pass.
struct Contender<'f, F> {
    form: String,
    kernels: Vec<String>,
    setting: Option<&'f F>,
    max_rel_diff: Option<f64>,
}

impl<'f, F> Contender<'f, F> {
    fn three_step() -> Self {
        Contender {
            form: "three-step".into(),
            kernels: Vec::new(),
            setting: None,
            max_rel_diff: None,
        }
    }

    /// Adds the fused form `setting` to `cs` unless an earlier one launched the same kernels
    /// (the settings that do not apply to this shape or pass).
    fn add_new(cs: &mut Vec<Self>, form: &str, kernels: Vec<String>, setting: &'f F, diff: f64) {
        let seen = |c: &Self| c.setting.is_some() && c.kernels == kernels;
        if kernels.is_empty() || !cs.iter().any(seen) {
            cs.push(Contender {
                form: form.into(),
                kernels,
                setting: Some(setting),
                max_rel_diff: Some(diff),
            });
        }
    }
}

/// Every row of shape `case` in type `dt`: the three-step path and each fused form that
/// launches kernels no earlier form did, forward and backward; rates against `peak`
/// (GFLOP/s) where known.
pub fn run_case<B: AttentionForms>(
    be: &mut B,
    case: &AttnCase,
    dt: Dtype,
    opts: &AttnBenchOptions,
    peak: Option<f64>,
) -> Result<Vec<AttnRow>> {
    let d = case.d;
    let x = Bufs::new(be, d, dt)?;
    let rows = run_case_on(be, (case, dt), opts, &x, peak);
    x.free(be);
    rows
}

fn run_case_on<B: AttentionForms>(
    be: &mut B,
    (case, dt): (&AttnCase, Dtype),
    opts: &AttnBenchOptions,
    x: &Bufs,
    peak: Option<f64>,
) -> Result<Vec<AttnRow>> {
    let d = case.d;
    be.upload(x.qkv, &fill(x.qkv.len, 1));
    be.upload(x.dout, &fill(x.dout.len, 2));
    // The reference: the three-step path's output and gradients.
    three_step_forward(be, x, d);
    let want_out = download(be, x.out);
    three_step_backward(be, x, d);
    let want_dqkv = download(be, x.dqkv);

    let mut forms = be.fused_forms(d, dt);
    forms.retain(|(label, _)| opts.wants(label));
    let mut fwd = vec![Contender::three_step()];
    let mut bwd = vec![Contender::three_step()];
    for (label, form) in &forms {
        be.set_form(form)
            .with_context(|| format!("attention form {label}"))?;
        // Cleared first, so that a form that leaves any of its output unwritten fails the
        // check rather than passing on what the three steps left there.
        be.zero(x.out);
        be.zero(x.dqkv);
        be.note_kernels();
        fused_forward(be, x, d);
        let kernels = strip_type(be.noted_kernels(), dt);
        let diff = max_rel_diff(&download(be, x.out), &want_out);
        check(case, label, "output", diff, dt)?;
        Contender::add_new(&mut fwd, label, kernels, form, diff);
        be.note_kernels();
        fused_backward(be, x, d);
        let kernels = strip_type(be.noted_kernels(), dt);
        let diff = max_rel_diff(&download(be, x.dqkv), &want_dqkv);
        check(case, label, "q, k, v gradients", diff, dt)?;
        Contender::add_new(&mut bwd, label, kernels, form, diff);
    }
    let mut rows = Vec::new();
    for (pass, contenders) in [(AttnPass::Forward, &fwd), (AttnPass::Backward, &bwd)] {
        let times = time_pass(be, x, d, pass, contenders, opts)?;
        let work = work::attention(&*be, d, pass.products(), &[], &[]).flops;
        let three_ms = median(&times[0]);
        for (c, t) in contenders.iter().zip(&times) {
            let ms = median(t);
            let tflops = work / (ms * 1e-3) / 1e12;
            rows.push(AttnRow {
                case: case.name.clone(),
                b: d.b,
                t: d.t,
                heads: d.nh,
                kv_heads: d.kv,
                head_size: d.hs,
                dtype: dt.name().into(),
                pass,
                form: c.form.clone(),
                kernels: c.kernels.clone(),
                ms,
                ms_min: t.iter().copied().fold(f64::INFINITY, f64::min),
                tflops,
                peak_pct: peak.map(|p| 100.0 * tflops * 1e3 / p),
                speedup: three_ms / ms,
                max_rel_diff: c.max_rel_diff,
            });
        }
    }
    Ok(rows)
}

/// Kernel names without the storage type's suffix (the row names the type).
fn strip_type(names: Vec<String>, dt: Dtype) -> Vec<String> {
    let suffix = format!("_{}", dt.name());
    names
        .into_iter()
        .map(|n| n.strip_suffix(&suffix).map(str::to_string).unwrap_or(n))
        .collect()
}

fn check(case: &AttnCase, form: &str, what: &str, diff: f64, dt: Dtype) -> Result<()> {
    let tol = tolerance(dt);
    if diff.is_nan() || diff > tol {
        bail!(
            "{} ({:?}): the fused attention form {form:?} and the three-step path disagree on \
             the {what} (largest difference {diff:e} of the largest value, tolerance {tol:e})",
            case.name,
            case.d
        );
    }
    Ok(())
}

fn median(t: &[f64]) -> f64 {
    let mut s = t.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Milliseconds per call of each contender's `pass`, one entry per round: in each round every
/// contender in turn runs its calls between two marks of the device's clock (the host's, after
/// a synchronisation, where the backend has none), so launches overlap as in a training step
/// and the time is the device's.
fn time_pass<B: AttentionForms>(
    be: &mut B,
    x: &Bufs,
    d: AttnDims,
    pass: AttnPass,
    contenders: &[Contender<'_, B::Form>],
    opts: &AttnBenchOptions,
) -> Result<Vec<Vec<f64>>> {
    let clock = be.device_clock();
    let run = |be: &mut B, c: &Contender<'_, B::Form>, calls: usize| -> Result<f64> {
        if let Some(f) = c.setting {
            be.set_form(f)?;
        }
        let body = |be: &mut B| {
            for _ in 0..calls {
                match (pass, c.setting.is_some()) {
                    (AttnPass::Forward, false) => three_step_forward(be, x, d),
                    (AttnPass::Backward, false) => three_step_backward(be, x, d),
                    (AttnPass::Forward, true) => fused_forward(be, x, d),
                    (AttnPass::Backward, true) => fused_backward(be, x, d),
                }
            }
        };
        let ms = match &clock {
            Some(k) => {
                let start = k.mark();
                body(be);
                let end = k.mark();
                k.take_interval(start, end)
            }
            None => {
                be.sync();
                let host = Instant::now();
                body(be);
                be.sync();
                host.elapsed().as_secs_f64() * 1e3
            }
        };
        Ok(ms / calls as f64)
    };
    // One warm call each sizes its calls per round.
    let per_round = opts.budget_s * 1e3 / opts.rounds.max(1) as f64;
    let mut calls = Vec::new();
    for c in contenders {
        let first = run(be, c, 1)?.max(1e-6);
        calls.push(((per_round / first).ceil() as usize).clamp(1, 10_000));
    }
    let mut times = vec![Vec::new(); contenders.len()];
    for _ in 0..opts.rounds.max(1) {
        for ((c, &n), t) in contenders.iter().zip(&calls).zip(times.iter_mut()) {
            t.push(run(be, c, n)?);
        }
    }
    Ok(times)
}

/// Deterministic values in [-1, 1): q, k, v that give softmax rows neither flat nor one-hot
/// at heads of 64-128 (scores of about ±1 after the 1/√hs scale), and an output gradient.
fn fill(n: usize, seed: u64) -> Vec<f32> {
    super::fill(n, seed).into_iter().map(|v| 2.0 * v).collect()
}

/// The table's header line of a shape, naming what the rates are against.
pub fn case_header(case: &AttnCase, dt: Dtype, peak: Option<&(f64, String)>) -> String {
    let d = case.d;
    let peak = match peak {
        Some((gflops, source)) => format!("% of {:.1} TFLOP/s ({source})", gflops / 1e3),
        None => "no peak known for this type on this device".into(),
    };
    format!(
        "{}: {} sequences of {} tokens, {} heads of {} ({} key/value heads), {}; TFLOP/s count \
         the causal pairs, 2 products forward and 4 backward (FlashAttention counts the \
         backward's as 5: ×1.25); {peak}",
        case.name,
        d.b,
        d.t,
        d.nh,
        d.hs,
        d.kv,
        dt.name()
    )
}

/// The column names of [`format_row`].
pub fn table_header() -> String {
    format!(
        "{:<8} {:>8} {:>8} {:>8} {:>6} {:>7} {:>9}  {:<58} {}",
        "pass", "ms", "min ms", "TFLOP/s", "%peak", "×3step", "max diff", "form", "kernels"
    )
}

/// One human-readable table line.
pub fn format_row(r: &AttnRow) -> String {
    let pass = match r.pass {
        AttnPass::Forward => "forward",
        AttnPass::Backward => "backward",
    };
    format!(
        "{:<8} {:>8.3} {:>8.3} {:>8} {:>6} {:>7.2} {:>9}  {:<58} {}",
        pass,
        r.ms,
        r.ms_min,
        // Small shapes (tests, CPUs) run at well under a TFLOP/s.
        if r.tflops >= 10.0 {
            format!("{:.1}", r.tflops)
        } else {
            format!("{:.4}", r.tflops)
        },
        r.peak_pct.map_or("-".into(), |p| format!("{p:.1}%")),
        r.speedup,
        r.max_rel_diff.map_or("-".into(), |v| format!("{v:.1e}")),
        r.form,
        r.kernels.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    #[test]
    fn shapes_parse_and_sets_hold_the_models() {
        let c = parse_case("2x70x4x24x2").unwrap();
        assert_eq!(
            c.d,
            AttnDims {
                b: 2,
                t: 70,
                nh: 4,
                kv: 2,
                hs: 24
            }
        );
        assert_eq!(parse_case("1x8x3x16").unwrap().d.kv, 3);
        for bad in ["1x8x3", "1x8x3x16x2", "0x8x2x16", "1x8xfourx16", ""] {
            assert!(parse_case(bad).is_err(), "{bad}");
        }
        let e = parse_case("1x8x3x16x2").unwrap_err().to_string();
        assert!(e.contains("do not divide"), "{e}");
        assert_eq!(case_set("gpt2").unwrap()[0].d.hs, 64);
        assert!(case_set("llama").unwrap().iter().all(|c| c.d.hs == 128));
        assert_eq!(case_set("all").unwrap().len(), 3);
        assert!(case_set("bert").is_err());
    }

    /// On the CPU: the three-step path and the reference loops, checked against each other
    /// (f32: both sum in f32, in other orders), rates from the model's FLOP count.
    #[test]
    fn cpu_rows_check_the_fused_loops_against_the_three_steps() {
        let mut be = CpuBackend::new();
        let case = parse_case("2x37x4x16x2").unwrap();
        let opts = AttnBenchOptions {
            budget_s: 0.0,
            rounds: 1,
            ..Default::default()
        };
        let rows = run_case(&mut be, &case, Dtype::F32, &opts, Some(1e3)).unwrap();
        let forms: Vec<_> = rows.iter().map(|r| (r.pass, r.form.as_str())).collect();
        assert_eq!(
            forms,
            [
                (AttnPass::Forward, "three-step"),
                (AttnPass::Forward, "fused (reference loops)"),
                (AttnPass::Backward, "three-step"),
                (AttnPass::Backward, "fused (reference loops)"),
            ]
        );
        for r in &rows {
            assert!(r.ms > 0.0 && r.tflops > 0.0, "{r:?}");
            let pairs = 2.0 * 4.0 * (37.0 * 38.0 / 2.0);
            let flops = 2.0 * r.pass.products() as f64 * 16.0 * pairs;
            let want = flops / (r.ms * 1e-3) / 1e12;
            assert!((r.tflops - want).abs() <= 1e-9 * want, "{r:?}");
            let pct = r.peak_pct.unwrap();
            assert!((pct - 100.0 * r.tflops).abs() <= 1e-9 * pct, "{r:?}");
            if r.form != "three-step" {
                assert!(r.max_rel_diff.unwrap() < 1e-5, "{r:?}");
            }
        }
    }

    #[test]
    fn forms_are_picked_by_their_settings() {
        let o = |only: Option<&str>, skip: Option<&str>| AttnBenchOptions {
            only: only.map(str::to_string),
            skip: skip.map(str::to_string),
            ..Default::default()
        };
        let wg = "FUGU_FLASH_MMA=wgmma FUGU_FLASH_BACKWARD=stored";
        assert!(o(None, None).wants(wg) && o(None, None).wants("default"));
        assert!(o(Some("wgmma"), None).wants(wg) && !o(Some("wgmma"), None).wants("default"));
        assert!(!o(None, Some("wgmma")).wants(wg) && o(None, Some("wgmma")).wants("default"));
        // On the CPU, skipping its one form leaves the three-step path alone.
        let mut be = CpuBackend::new();
        let case = parse_case("1x9x2x8").unwrap();
        let opts = AttnBenchOptions {
            rounds: 1,
            ..o(None, Some("reference"))
        };
        let rows = run_case(&mut be, &case, Dtype::F32, &opts, None).unwrap();
        assert!(rows
            .iter()
            .all(|r| r.form == "three-step" && r.peak_pct.is_none()));
        assert_eq!(rows.len(), 2);
    }

    #[test]
    fn a_wrong_result_is_refused() {
        let case = parse_case("1x4x1x8").unwrap();
        let e = check(&case, "default", "output", 0.5, Dtype::Bf16)
            .unwrap_err()
            .to_string();
        assert!(e.contains("disagree on the output"), "{e}");
        assert!(check(&case, "default", "output", f64::NAN, Dtype::F32).is_err());
        assert!(check(&case, "default", "output", 1e-5, Dtype::F32).is_ok());
        assert!(check(&case, "default", "output", 1e-3, Dtype::F32).is_err());
    }
}

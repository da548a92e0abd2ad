//! Reading one `fugu train` run directory into a [`Run`]: its last header (model, batch,
//! parallel layout, machine), its step records (deduplicated, warm-up marked) and the medians
//! and timer means the report is built from.
//!
//! The reader is lenient about what a run may lack (old single-process headers without
//! `ranks_per_node` or `zero`, step records without `timers_min`/`timers_max`/`comm_bytes`, a
//! last line cut short) and strict about what makes a run unusable (no `metrics.jsonl`, a
//! malformed line in the middle, no step records), which it reports as an error naming the
//! file.

use crate::metrics::jsonl::{parse_metrics, Record, StepRecord};
use crate::metrics::Roofs;
use crate::model::Arch;
use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The parallel layout from the header's `layout` (missing fields default to a single
/// process: 1, and 0 for `zero`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub world: u64,
    pub tp: u64,
    pub dp: u64,
    pub nodes: u64,
    /// Compute threads per rank.
    pub threads: u64,
    pub ranks_per_node: u64,
    /// ZeRO stage (0 = off).
    pub zero: u64,
}

impl Default for Layout {
    fn default() -> Self {
        Layout {
            world: 1,
            tp: 1,
            dp: 1,
            nodes: 1,
            threads: 1,
            ranks_per_node: 1,
            zero: 0,
        }
    }
}

/// The model section of the run's config (what decides whether two runs are "the same
/// model" for scaling).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelDims {
    /// The architecture (`arch` in the header's model config; GPT-2 where absent).
    pub arch: Arch,
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_head: u64,
    pub vocab_size: u64,
}

/// What the header says about the machine (rank 0's).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Machine {
    pub cpu_model: String,
    pub isa: String,
    /// FP32 peak of one process, GFLOP/s.
    pub peak_gflops: Option<f64>,
    pub peak_source: String,
}

/// One step as the report uses it.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub rec: StepRecord,
    /// Per-timer minimum across ranks (ms), when the run wrote `timers_min`.
    pub timers_min: BTreeMap<String, f64>,
    /// Per-timer maximum across ranks (ms), when the run wrote `timers_max`.
    pub timers_max: BTreeMap<String, f64>,
    /// Bytes this rank communicated in the step, when written.
    pub comm_bytes: Option<f64>,
    /// The first step after a resume (a header that is not the file's first).
    pub after_resume: bool,
    /// Left out of the medians as warm-up.
    pub warmup: bool,
}

/// Timer means over the steps used for the breakdown.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TimerMeans {
    /// Steps the means are over.
    pub steps: u64,
    /// Mean step time over those steps, ms.
    pub step_ms: f64,
    /// Mean ms per step of each timer (mean across ranks where the run has several).
    pub mean: BTreeMap<String, f64>,
    /// Mean over steps of the per-step minimum across ranks.
    pub min: BTreeMap<String, f64>,
    /// Mean over steps of the per-step maximum across ranks.
    pub max: BTreeMap<String, f64>,
    /// Where the means come from, for the report (`metrics.jsonl` or `breakdown.json`).
    pub source: String,
}

/// One op's rates from a `breakdown.json` written with fine timers
/// ([`crate::metrics::Breakdown::to_json`]).
#[derive(Clone, Debug, PartialEq)]
pub struct OpRate {
    /// Full timer name (`backward:layernorm`).
    pub name: String,
    pub ms_per_step: f64,
    /// Share of the mean step, percent.
    pub pct_of_step: f64,
    pub gflops: Option<f64>,
    pub gbs: Option<f64>,
    /// Percent of the op's roofline (`None` where the run recorded no roofs).
    pub roof_pct: Option<f64>,
}

impl OpRate {
    /// Milliseconds per step the op would save at its roofline: its time × (1 − roof% / 100),
    /// never below zero (an op above its roof ran from the caches).
    pub fn headroom_ms(&self) -> Option<f64> {
        self.roof_pct
            .map(|p| (self.ms_per_step * (1.0 - p / 100.0)).max(0.0))
    }
}

/// The ops of a run that declared their work, and the roofs their rates were set against
/// (empty for runs without fine timers or from before the rates).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpRates {
    pub ops: Vec<OpRate>,
    /// The peak GFLOP/s of the run's compute type and the memory bandwidth, per process.
    pub roofs: Roofs,
}

/// A usable run.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// Short name (the directory's), unique within a report.
    pub name: String,
    /// The metrics file read.
    pub path: PathBuf,
    pub config_name: String,
    pub model: Option<ModelDims>,
    /// Sequences per step per data-parallel replica (`config.train.batch_size`).
    pub batch_size: Option<u64>,
    pub seq_len: Option<u64>,
    pub parameters: Option<u64>,
    pub backend: String,
    /// Numeric precision (`fp32` for headers from before `--precision`).
    pub precision: String,
    /// Micro-batches per step (1 for headers from before `--micro-batches`).
    pub micro_batches: u64,
    pub layout: Layout,
    pub machine: Machine,
    /// Headers in the file (more than one: the run was resumed).
    pub headers: usize,
    /// Steps by step number (the last record of each step wins), warm-up marked.
    pub steps: Vec<Step>,
    /// Validation losses `(step, loss)` by step (the last record of each step wins).
    pub evals: Vec<(u64, f64)>,
    /// The same in bits per byte of text, for the evaluations that recorded it.
    pub evals_bpb: Vec<(u64, f64)>,
    /// Medians over the measured (non-warm-up) steps.
    pub step_ms: f64,
    pub tokens_per_s: f64,
    pub tflops_per_process: f64,
    pub peak_pct: f64,
    pub comm_bytes: Option<f64>,
    pub timers: TimerMeans,
    /// Each op's rates and roofline share, from `breakdown.json`.
    pub rates: OpRates,
    /// Lines of the file that were not used (cut off, or not JSON before a resume header),
    /// as (1-based line number, why).
    pub bad_lines: Vec<(usize, String)>,
    /// Anything else worth saying about the run.
    pub notes: Vec<String>,
}

impl Run {
    /// Sequences per optimizer step over the whole job: `batch_size × dp`.
    pub fn global_batch(&self) -> Option<u64> {
        self.batch_size.map(|b| b.saturating_mul(self.layout.dp))
    }

    /// Steps used for the medians.
    pub fn measured_steps(&self) -> usize {
        self.steps.iter().filter(|s| !s.warmup).count()
    }

    /// Steps left out as warm-up.
    pub fn warmup_steps(&self) -> usize {
        self.steps.iter().filter(|s| s.warmup).count()
    }

    /// Model, sequence length and machine: runs with the same key can be compared for
    /// scaling. `None` when the header does not say.
    pub fn model_key(&self) -> Option<String> {
        let m = self.model.as_ref()?;
        Some(format!(
            "{} (L={} d={} h={} V={}, T={})",
            self.config_name, m.n_layer, m.n_embd, m.n_head, m.vocab_size, self.seq_len?
        ))
    }
}

/// Fields of a step line that [`StepRecord`] does not carry (written by multi-rank runs).
#[derive(Deserialize)]
struct StepExtras {
    step: u64,
    #[serde(default)]
    timers_min: Option<BTreeMap<String, Option<f64>>>,
    #[serde(default)]
    timers_max: Option<BTreeMap<String, Option<f64>>>,
    #[serde(default)]
    comm_bytes: Option<f64>,
}

fn nan_free(m: Option<BTreeMap<String, Option<f64>>>) -> BTreeMap<String, f64> {
    m.unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, v.unwrap_or(f64::NAN)))
        .collect()
}

/// Timer names that are not part of a training step: the trainer records them after the
/// step's clock stopped, so they land in the next step's timers (as does the forward pass of an
/// evaluation). Steps that carry them are left out of the breakdown.
pub fn is_outside_step(name: &str) -> bool {
    let top = name.split(':').next().unwrap_or(name);
    top == "eval" || top == "checkpoint"
}

/// Reads a run from its directory (or its `metrics.jsonl`), naming the file in every error.
pub fn read_run(metrics: &Path, name: &str) -> Result<Run> {
    let bytes = std::fs::read(metrics).with_context(|| format!("reading {}", metrics.display()))?;
    let text = String::from_utf8_lossy(&bytes);
    if text.trim().is_empty() {
        bail!("{} is empty", metrics.display());
    }
    let mut run = parse_run(&text, name).with_context(|| format!("in {}", metrics.display()))?;
    run.path = metrics.to_owned();
    // The end-of-run breakdown: each op's rates, and the timers where the steps carried none
    // (or nowhere, with --timers off).
    let bd = metrics.parent().map(|d| d.join("breakdown.json"));
    if let Some(bd) = bd.filter(|p| p.exists()) {
        match read_json(&bd) {
            Ok(v) => {
                if run.timers.mean.is_empty() {
                    match breakdown_timers(&v, &bd) {
                        Ok(t) => run.timers = t,
                        Err(e) => run.notes.push(format!("{e:#}")),
                    }
                }
                run.rates = breakdown_rates(&v);
            }
            Err(e) => run.notes.push(format!("{e:#}")),
        }
    }
    Ok(run)
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

/// The rates of the ops of a `breakdown.json` that said their work (`gflops` or `gbs`), in
/// the file's order, and its `roofs`; files without them give none.
pub fn breakdown_rates(v: &Value) -> OpRates {
    let positive = |x: &Value| x.as_f64().filter(|x| x.is_finite() && *x > 0.0);
    let ops = v["ops"].as_array().map_or(&[][..], |a| a.as_slice());
    OpRates {
        ops: ops
            .iter()
            .filter_map(|op| {
                let (gflops, gbs) = (positive(&op["gflops"]), positive(&op["gbs"]));
                if gflops.is_none() && gbs.is_none() {
                    return None;
                }
                Some(OpRate {
                    name: op["name"].as_str()?.to_owned(),
                    ms_per_step: op["ms_per_step"].as_f64()?,
                    pct_of_step: op["pct"].as_f64().unwrap_or(f64::NAN),
                    gflops,
                    gbs,
                    roof_pct: positive(&op["roof_pct"]),
                })
            })
            .collect(),
        roofs: Roofs {
            gflops: positive(&v["roofs"]["gflops"]),
            gbs: positive(&v["roofs"]["gbs"]),
        },
    }
}

/// Parses the text of a `metrics.jsonl` (see [`read_run`]).
pub fn parse_run(text: &str, name: &str) -> Result<Run> {
    let records = parse_metrics(text)?;

    // Lines parse_metrics tolerated (a cut-off last line, or one before a resume header), and
    // the step fields it does not keep.
    let mut bad_lines = Vec::new();
    let mut extras: BTreeMap<u64, StepExtras> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(v @ Value::Object(_)) => {
                if v.get("type").and_then(Value::as_str) == Some("step") {
                    if let Ok(x) = serde_json::from_value::<StepExtras>(v) {
                        extras.insert(x.step, x);
                    }
                }
            }
            Ok(_) => bad_lines.push((i + 1, "not a JSON object".to_owned())),
            Err(e) => bad_lines.push((i + 1, format!("cut off or not JSON ({e})"))),
        }
    }

    let mut header = Value::Null;
    let mut headers = 0;
    let mut steps: BTreeMap<u64, Step> = BTreeMap::new();
    let mut evals: BTreeMap<u64, f64> = BTreeMap::new();
    let mut evals_bpb: BTreeMap<u64, f64> = BTreeMap::new();
    let mut after_resume = false;
    for r in records {
        match r {
            Record::Header(h) => {
                headers += 1;
                after_resume = headers > 1;
                header = h;
            }
            Record::Step(rec) => {
                let x = extras.remove(&rec.step);
                let (timers_min, timers_max, comm_bytes) = match x {
                    Some(x) => (nan_free(x.timers_min), nan_free(x.timers_max), x.comm_bytes),
                    None => Default::default(),
                };
                steps.insert(
                    rec.step,
                    Step {
                        rec,
                        timers_min,
                        timers_max,
                        comm_bytes,
                        after_resume,
                        warmup: false,
                    },
                );
                after_resume = false;
            }
            // A run started over in the same folder: what came before is another history.
            Record::Event { kind, .. } if kind == "restarted" => {
                steps.clear();
                evals.clear();
                evals_bpb.clear();
            }
            Record::Eval(e) => {
                evals.insert(e.step, e.val_loss);
                match e.val_bpb {
                    Some(b) => evals_bpb.insert(e.step, b),
                    None => evals_bpb.remove(&e.step),
                };
            }
            _ => {}
        }
    }
    if steps.is_empty() {
        let why = match bad_lines.first() {
            Some((n, e)) => format!("no step records (line {n}: {e})"),
            None => "no step records".to_owned(),
        };
        return Err(anyhow!(why));
    }

    let mut notes = Vec::new();
    if headers == 0 {
        notes.push("no header line: model, batch and layout unknown".to_owned());
    } else if headers > 1 {
        notes.push(format!(
            "resumed {} time{} (the last header is used; the first step after each resume counts as warm-up)",
            headers - 1,
            if headers == 2 { "" } else { "s" }
        ));
    }
    let mut steps: Vec<Step> = steps.into_values().collect();
    mark_warmup(&mut steps);
    if steps.len() == 1 {
        notes.push("only one step: warm-up not excluded".to_owned());
    }

    let measured: Vec<&Step> = steps.iter().filter(|s| !s.warmup).collect();
    let med = |f: &dyn Fn(&Step) -> f64| median(measured.iter().map(|s| f(s)));
    let comm: Vec<f64> = measured.iter().filter_map(|s| s.comm_bytes).collect();
    let timers = timer_means(&measured);

    let h = &header;
    let cfg = &h["config"];
    // An architecture this fugu does not know leaves the model unknown.
    let arch = match &cfg["model"]["arch"] {
        Value::Null => Some(Arch::default()),
        a => a.as_str().and_then(Arch::from_name),
    };
    let model = match (
        arch,
        u(&cfg["model"]["n_layer"]),
        u(&cfg["model"]["n_embd"]),
        u(&cfg["model"]["n_head"]),
        u(&cfg["model"]["vocab_size"]),
    ) {
        (Some(arch), Some(n_layer), Some(n_embd), Some(n_head), Some(vocab_size)) => {
            Some(ModelDims {
                arch,
                n_layer,
                n_embd,
                n_head,
                vocab_size,
            })
        }
        _ => None,
    };
    let lay = &h["layout"];
    let world = u(&lay["world"]).unwrap_or(1).max(1);
    let nodes = u(&lay["nodes"]).unwrap_or(1).max(1);
    let layout = Layout {
        world,
        tp: u(&lay["tp"]).unwrap_or(1).max(1),
        dp: u(&lay["dp"]).unwrap_or(1).max(1),
        nodes,
        threads: u(&lay["threads"])
            .or_else(|| u(&h["machine"]["threads"]))
            .unwrap_or(1),
        ranks_per_node: u(&lay["ranks_per_node"]).unwrap_or(world.div_ceil(nodes)),
        zero: u(&lay["zero"]).unwrap_or(0),
    };
    if layout.tp.saturating_mul(layout.dp) != layout.world {
        notes.push(format!(
            "layout says world {} but tp {} x dp {}",
            layout.world, layout.tp, layout.dp
        ));
    }
    let m = &h["machine"];
    let machine = Machine {
        cpu_model: s(&m["cpu_model"]),
        isa: s(&m["isa"]),
        peak_gflops: m["peak_gflops"].as_f64().filter(|p| *p > 0.0),
        peak_source: human_peak_source(&s(&m["peak_source"])),
    };
    let config_name = h["config_name"]
        .as_str()
        .filter(|s| !s.is_empty())
        .map_or_else(|| "?".to_owned(), str::to_owned);

    Ok(Run {
        name: name.to_owned(),
        path: PathBuf::new(),
        config_name,
        model,
        batch_size: u(&cfg["train"]["batch_size"]),
        seq_len: u(&cfg["train"]["seq_len"]),
        parameters: u(&h["parameters"]),
        backend: s(&h["backend"]),
        precision: h["precision"].as_str().unwrap_or("fp32").to_owned(),
        micro_batches: u(&h["layout"]["micro_batches"]).unwrap_or(1).max(1),
        layout,
        machine,
        headers,
        step_ms: med(&|s| s.rec.step_ms),
        tokens_per_s: med(&|s| s.rec.tokens_per_s),
        tflops_per_process: med(&|s| s.rec.tflops_per_process),
        peak_pct: med(&|s| s.rec.peak_pct),
        comm_bytes: (!comm.is_empty()).then(|| median(comm.into_iter())),
        timers,
        rates: OpRates::default(),
        steps,
        evals: evals.into_iter().collect(),
        evals_bpb: evals_bpb.into_iter().collect(),
        bad_lines,
        notes,
    })
}

/// The peak's source in words: runs before fugu wrote words recorded Rust's debug text
/// (`Measured { isa: Avx2 }`, `MeasuredNative { isa: Avx512, prec: Bf16 }`, `Given`).
fn human_peak_source(s: &str) -> String {
    let field = |name: &str| {
        s.split(&format!("{name}: "))
            .nth(1)
            .and_then(|r| r.split([',', ' ', '}']).next())
            .map(str::to_lowercase)
            .unwrap_or_default()
    };
    if s == "Given" {
        "given".into()
    } else if s.starts_with("Measured {") {
        format!("measured ({} FMA loop)", field("isa"))
    } else if s.starts_with("Cached {") {
        format!("cached ({} FMA loop, an earlier run)", field("isa"))
    } else if s.starts_with("MeasuredNative {") {
        format!("measured ({} {} loop)", field("prec"), field("isa"))
    } else {
        s.to_string()
    }
}

fn u(v: &Value) -> Option<u64> {
    v.as_u64()
        .or_else(|| v.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64))
}

fn s(v: &Value) -> String {
    v.as_str().unwrap_or("").to_owned()
}

/// Marks warm-up steps: the first 10% of the steps (at least one, none when there is only
/// one step) and the first step after each resume.
pub fn mark_warmup(steps: &mut [Step]) {
    let n = steps.len();
    if n < 2 {
        return;
    }
    let k = (n / 10).max(1);
    for (i, s) in steps.iter_mut().enumerate() {
        s.warmup = i < k || s.after_resume;
    }
    if steps.iter().all(|s| s.warmup) {
        // Every step follows a resume: keep the last ones.
        for s in steps.iter_mut().skip(k) {
            s.warmup = false;
        }
    }
}

/// Median of the finite values (NaN when there are none).
pub fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Timer means over the measured steps that have timers, leaving out steps that carry
/// evaluation or checkpoint time (see [`is_outside_step`]) unless no step is free of it.
fn timer_means(measured: &[&Step]) -> TimerMeans {
    let with_timers: Vec<&Step> = measured
        .iter()
        .copied()
        .filter(|s| !s.rec.timers.is_empty())
        .collect();
    let clean: Vec<&Step> = with_timers
        .iter()
        .copied()
        .filter(|s| !s.rec.timers.keys().any(|k| is_outside_step(k)))
        .collect();
    let used = if clean.is_empty() { with_timers } else { clean };
    if used.is_empty() {
        return TimerMeans::default();
    }
    let n = used.len() as f64;
    let mean_of = |get: &dyn Fn(&Step) -> &BTreeMap<String, f64>| {
        let mut sum: BTreeMap<String, (f64, usize)> = BTreeMap::new();
        for s in &used {
            for (k, v) in get(s) {
                if v.is_finite() && !is_outside_step(k) {
                    let e = sum.entry(k.clone()).or_default();
                    e.0 += v;
                    e.1 += 1;
                }
            }
        }
        sum
    };
    // A timer missing from a step took 0 ms in it; min/max are averaged over the steps that
    // report them.
    let mean = mean_of(&|s| &s.rec.timers)
        .into_iter()
        .map(|(k, (v, _))| (k, v / n))
        .collect();
    let avg = |m: BTreeMap<String, (f64, usize)>| {
        m.into_iter()
            .map(|(k, (v, c))| (k, v / c as f64))
            .collect::<BTreeMap<_, _>>()
    };
    TimerMeans {
        steps: used.len() as u64,
        step_ms: used
            .iter()
            .map(|s| s.rec.step_ms)
            .filter(|x| x.is_finite())
            .sum::<f64>()
            / n,
        mean,
        min: avg(mean_of(&|s| &s.timers_min)),
        max: avg(mean_of(&|s| &s.timers_max)),
        source: "metrics.jsonl".to_owned(),
    }
}

/// Timer means from a parsed `breakdown.json` ([`crate::metrics::Breakdown::write_json`]) at
/// `path`: the timed rows, over all of the run's steps.
fn breakdown_timers(v: &Value, path: &Path) -> Result<TimerMeans> {
    let ops = v["ops"]
        .as_array()
        .ok_or_else(|| anyhow!("{} has no \"ops\" list", path.display()))?;
    let mut mean = BTreeMap::new();
    for op in ops {
        if op["timed"].as_bool() == Some(true) {
            if let (Some(n), Some(ms)) = (op["name"].as_str(), op["ms_per_step"].as_f64()) {
                if !is_outside_step(n) {
                    mean.insert(n.to_owned(), ms);
                }
            }
        }
    }
    let step_ms = v["step_ms"].as_f64().unwrap_or(f64::NAN);
    if mean.is_empty() || !step_ms.is_finite() {
        bail!("{} has no timed ops", path.display());
    }
    Ok(TimerMeans {
        steps: u(&v["steps"]).unwrap_or(1),
        step_ms,
        mean,
        min: BTreeMap::new(),
        max: BTreeMap::new(),
        source: "breakdown.json (all steps, warm-up included)".to_owned(),
    })
}

/// Gives every run a unique short name: the directory's name, or more of its path when two
/// directories share a name, or a `#n` suffix as the last resort.
pub fn unique_names(paths: &[PathBuf]) -> Vec<String> {
    let comps: Vec<Vec<String>> = paths
        .iter()
        .map(|p| {
            let p = if p.file_name().is_some_and(|f| f == "metrics.jsonl") {
                p.parent().unwrap_or(p)
            } else {
                p
            };
            let mut c: Vec<String> = p
                .components()
                .filter_map(|c| match c {
                    std::path::Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
                    _ => None,
                })
                .collect();
            if c.is_empty() {
                c.push(p.display().to_string());
            }
            c
        })
        .collect();
    let tail = |c: &[String], k: usize| c[c.len().saturating_sub(k)..].join("/");
    let mut names: Vec<String> = comps.iter().map(|c| tail(c, 1)).collect();
    for k in 2..=4 {
        let dup: BTreeSet<String> = dups(&names);
        if dup.is_empty() {
            break;
        }
        for (i, c) in comps.iter().enumerate() {
            if dup.contains(&names[i]) {
                names[i] = tail(c, k);
            }
        }
    }
    let dup = dups(&names);
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for n in names.iter_mut() {
        if dup.contains(n) {
            let c = seen.entry(n.clone()).or_insert(0);
            *c += 1;
            *n = format!("{n}#{c}");
        }
    }
    names
}

fn dups(names: &[String]) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    names
        .iter()
        .filter(|n| !seen.insert(n.as_str()))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rates_are_the_ops_that_declared_work() {
        let v = json!({
            "roofs": {"gflops": 200.0, "gbs": null},
            "ops": [
                {"name": "forward", "ms_per_step": 10.0, "pct": 50.0, "timed": true},
                {"name": "forward:mlp:mm", "ms_per_step": 4.0, "pct": 20.0,
                 "gflops": 150.0, "gbs": 1.5, "roof_pct": 75.0},
                {"name": "forward:loss", "ms_per_step": 2.0, "pct": 10.0,
                 "gflops": null, "gbs": 5.0, "roof_pct": null},
                {"name": "forward:softmax", "ms_per_step": 1.0, "pct": 5.0,
                 "gbs": 30.0, "roof_pct": 120.0},
            ]
        });
        let r = breakdown_rates(&v);
        assert_eq!(
            r.roofs,
            Roofs {
                gflops: Some(200.0),
                gbs: None
            }
        );
        let names: Vec<&str> = r.ops.iter().map(|o| o.name.as_str()).collect();
        assert_eq!(names, ["forward:mlp:mm", "forward:loss", "forward:softmax"]);
        assert_eq!(r.ops[0].headroom_ms(), Some(1.0));
        assert_eq!((r.ops[1].gflops, r.ops[1].headroom_ms()), (None, None));
        // Above its roof (from the caches): no time to win, not a negative one.
        assert_eq!(r.ops[2].headroom_ms(), Some(0.0));
        // A breakdown from before the rates has none.
        let old = json!({"ops": [{"name": "forward", "ms_per_step": 1.0, "timed": true}]});
        assert_eq!(breakdown_rates(&old), OpRates::default());
    }

    fn header(layout: Value) -> String {
        json!({"type": "header", "config_name": "gpt2-tiny",
            "config": {"model": {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 50257},
                       "train": {"batch_size": 8, "seq_len": 128}},
            "machine": {"cpu_model": "Test CPU", "isa": "avx2", "threads": 2, "peak_gflops": 96.0,
                        "peak_source": "Given"},
            "layout": layout, "parameters": 1000, "backend": "cpu"})
        .to_string()
    }

    fn step(n: u64, ms: f64, extra: Value) -> String {
        let mut v = json!({"type": "step", "step": n, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0,
            "tokens": n * 1024, "tokens_per_s": 1024.0 / ms * 1e3, "step_ms": ms,
            "tflops_per_process": 0.01, "peak_pct": 10.0,
            "timers": {"forward": ms * 0.4, "backward": ms * 0.5}});
        if let (Value::Object(a), Value::Object(b)) = (&mut v, extra) {
            a.extend(b);
        }
        v.to_string()
    }

    fn lines(v: &[String]) -> String {
        v.join("\n") + "\n"
    }

    #[test]
    fn old_single_process_header() {
        let text = lines(&[
            header(json!({"world": 1, "tp": 1, "dp": 1, "nodes": 1, "threads": 2})),
            step(1, 500.0, json!({})),
            step(2, 100.0, json!({})),
            step(3, 110.0, json!({})),
        ]);
        let r = parse_run(&text, "a").unwrap();
        assert_eq!(
            r.layout,
            Layout {
                world: 1,
                tp: 1,
                dp: 1,
                nodes: 1,
                threads: 2,
                ranks_per_node: 1,
                zero: 0
            }
        );
        // Headers from before --precision and --micro-batches read as fp32, one micro-batch.
        assert_eq!((r.precision.as_str(), r.micro_batches), ("fp32", 1));
        let mut h: Value = serde_json::from_str(&header(
            json!({"world": 1, "tp": 1, "dp": 1, "nodes": 1, "threads": 2, "micro_batches": 4}),
        ))
        .unwrap();
        h["precision"] = json!("bf16");
        let mixed = parse_run(&lines(&[h.to_string(), step(1, 100.0, json!({}))]), "b").unwrap();
        assert_eq!((mixed.precision.as_str(), mixed.micro_batches), ("bf16", 4));
        assert_eq!(r.config_name, "gpt2-tiny");
        assert_eq!(r.batch_size, Some(8));
        assert_eq!(r.global_batch(), Some(8));
        assert_eq!(r.machine.peak_gflops, Some(96.0));
        // The first step is warm-up.
        assert_eq!(r.warmup_steps(), 1);
        assert_eq!(r.measured_steps(), 2);
        assert_eq!(r.step_ms, 105.0);
        assert!(r.comm_bytes.is_none());
        assert_eq!(r.timers.steps, 2);
        assert!((r.timers.mean["forward"] - 42.0).abs() < 1e-9);
        assert!(r.timers.min.is_empty());
        assert!(r.bad_lines.is_empty());
        assert!(r.model_key().unwrap().contains("gpt2-tiny"));
    }

    #[test]
    fn new_multi_rank_header_and_extras() {
        let text = lines(&[
            header(
                json!({"world": 4, "tp": 2, "dp": 2, "nodes": 2, "threads": 12,
                          "ranks_per_node": 2, "zero": 1}),
            ),
            step(1, 300.0, json!({})),
            step(
                2,
                100.0,
                json!({"timers_min": {"forward": 30.0, "backward:mlp:allreduce": null},
                       "timers_max": {"forward": 50.0}, "comm_bytes": 4000000}),
            ),
        ]);
        let r = parse_run(&text, "b").unwrap();
        assert_eq!(r.layout.world, 4);
        assert_eq!(r.layout.ranks_per_node, 2);
        assert_eq!(r.layout.zero, 1);
        assert_eq!(r.global_batch(), Some(16));
        assert_eq!(r.comm_bytes, Some(4.0e6));
        assert_eq!(r.timers.min["forward"], 30.0);
        assert_eq!(r.timers.max["forward"], 50.0);
        assert!(!r.timers.min.contains_key("backward:mlp:allreduce"));
    }

    #[test]
    fn missing_layout_fields_default_and_ranks_per_node_is_derived() {
        let text = lines(&[
            header(json!({"world": 8, "tp": 1, "dp": 8, "nodes": 2})),
            step(1, 1.0, json!({})),
        ]);
        let r = parse_run(&text, "c").unwrap();
        assert_eq!(r.layout.ranks_per_node, 4);
        assert_eq!(r.layout.threads, 2, "from machine.threads");
        assert_eq!(r.layout.zero, 0);
        assert!(r.notes.iter().any(|n| n.contains("only one step")));
    }

    #[test]
    fn cut_off_last_line_is_reported_not_fatal() {
        let mut text = lines(&[
            header(json!({"world": 1})),
            step(1, 100.0, json!({})),
            step(2, 100.0, json!({})),
        ]);
        text.push_str("{\"type\":\"step\",\"step\":3,\"lo");
        let r = parse_run(&text, "d").unwrap();
        assert_eq!(r.steps.len(), 2);
        assert_eq!(r.bad_lines.len(), 1);
        assert_eq!(r.bad_lines[0].0, 4);
    }

    #[test]
    fn malformed_middle_line_and_no_steps_are_errors() {
        let text = lines(&[header(json!({})), "garbage".into(), step(1, 1.0, json!({}))]);
        let e = parse_run(&text, "e").unwrap_err();
        assert!(format!("{e:#}").contains("line 2"), "{e:#}");
        let e = parse_run(&lines(&[header(json!({}))]), "f").unwrap_err();
        assert!(format!("{e:#}").contains("no step records"), "{e:#}");
        let e = parse_run("this is not json\n", "g").unwrap_err();
        assert!(format!("{e:#}").contains("line 1"), "{e:#}");
    }

    #[test]
    fn resume_dedupes_steps_last_wins_and_marks_warmup() {
        let mut v = vec![header(json!({"world": 1}))];
        for i in 1..=6 {
            v.push(step(i, 100.0, json!({})));
        }
        v.push("{\"type\":\"step\",\"step\":7,".into()); // killed mid-line
        v.push(header(json!({"world": 1})));
        for i in 5..=20 {
            v.push(step(i, 200.0, json!({})));
        }
        let r = parse_run(&lines(&v), "h").unwrap();
        assert_eq!(r.headers, 2);
        assert_eq!(r.steps.len(), 20);
        assert_eq!(r.steps[4].rec.step, 5);
        assert_eq!(r.steps[4].rec.step_ms, 200.0, "the resumed record wins");
        assert!(r.steps[4].after_resume && r.steps[4].warmup);
        // 10% of 20 = 2 leading warm-up steps, plus the first step after the resume.
        assert_eq!(r.warmup_steps(), 3);
        assert_eq!(r.bad_lines.len(), 1);
        assert!(r.notes.iter().any(|n| n.contains("resumed 1 time")));
    }

    #[test]
    fn eval_and_checkpoint_steps_are_left_out_of_timer_means() {
        let text = lines(&[
            header(json!({})),
            step(1, 100.0, json!({})),
            step(2, 100.0, json!({})),
            step(
                3,
                100.0,
                json!({"timers": {"forward": 90.0, "eval": 500.0, "eval:x": 1.0}}),
            ),
        ]);
        let r = parse_run(&text, "i").unwrap();
        assert_eq!(r.timers.steps, 1);
        assert_eq!(r.timers.mean["forward"], 40.0);
        assert!(!r.timers.mean.contains_key("eval"));
    }

    #[test]
    fn timers_fall_back_to_breakdown_json() {
        let d = std::env::temp_dir().join(format!("fugu-report-bd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let no_timers = |n: u64| {
            let mut v: Value = serde_json::from_str(&step(n, 100.0, json!({}))).unwrap();
            v.as_object_mut().unwrap().remove("timers");
            v.to_string()
        };
        let text = lines(&[header(json!({})), no_timers(1), no_timers(2)]);
        std::fs::write(d.join("metrics.jsonl"), text).unwrap();
        let mut tot = BTreeMap::new();
        tot.insert("forward".to_string(), 80.0);
        tot.insert("eval".to_string(), 500.0);
        crate::metrics::Breakdown::from_totals(&tot, 200.0, 2, &crate::model::registry::all_ops())
            .write_json(d.join("breakdown.json"))
            .unwrap();
        let r = read_run(&d.join("metrics.jsonl"), "bd").unwrap();
        assert_eq!(r.timers.mean["forward"], 40.0);
        assert!(!r.timers.mean.contains_key("eval"));
        assert_eq!(r.timers.step_ms, 100.0);
        assert!(r.timers.source.starts_with("breakdown.json"));
        // A broken breakdown.json is a note, not an error.
        std::fs::write(d.join("breakdown.json"), "{").unwrap();
        let r = read_run(&d.join("metrics.jsonl"), "bd").unwrap();
        assert!(r.timers.mean.is_empty());
        assert!(
            r.notes.iter().any(|n| n.contains("breakdown.json")),
            "{:?}",
            r.notes
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn peak_sources_read_as_words_also_from_older_runs() {
        for (old, words) in [
            ("Measured { isa: Avx2 }", "measured (avx2 FMA loop)"),
            (
                "Cached { isa: Avx512 }",
                "cached (avx512 FMA loop, an earlier run)",
            ),
            (
                "MeasuredNative { isa: Avx512, prec: Bf16 }",
                "measured (bf16 avx512 loop)",
            ),
            ("Given", "given"),
            ("measured (sve FMA loop)", "measured (sve FMA loop)"),
        ] {
            assert_eq!(human_peak_source(old), words);
        }
    }

    #[test]
    fn names_are_unique() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(
            unique_names(&[
                p("runs/a/n1"),
                p("runs/b/n1"),
                p("x/n2/metrics.jsonl"),
                p("n1")
            ]),
            vec!["a/n1", "b/n1", "n2", "n1"]
        );
        assert_eq!(unique_names(&[p("r"), p("r")]), vec!["r#1", "r#2"]);
    }
}

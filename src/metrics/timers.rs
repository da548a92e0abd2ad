//! Per-op wall-clock timers with Megatron-DeepSpeed-style names and a per-step breakdown.
//!
//! [`Timers`] lives on the training loop's thread. Scopes nest freely (`forward` around
//! `forward:attention:qkv` around nothing): each guard records its own interval when dropped,
//! so a parent's time includes its children's. A name used several times in one step (once per
//! layer) sums. [`Timers::take_step`] hands out the step's times and adds them to run totals,
//! from which [`Timers::breakdown`] builds the end-of-run table and `breakdown.json`.
//!
//! Levels: a scope opened at [`TimerLevel::Coarse`] records when the timers run at `Coarse` or
//! `Fine`; one opened at [`TimerLevel::Fine`] only at `Fine`. With the timers [`TimerLevel::Off`]
//! nothing records and a scope costs one `Cell` read (no clock read).
//!
//! Devices: a backend whose ops return before their work is done (a GPU) gives the timers a
//! [`DeviceClock`] ([`Timers::set_device_clock`]). At `Fine`, every scope then reads that clock
//! instead of the host's: a mark queued between the device's work at its start and at its end
//! (CUDA events), with no synchronisation, so the work keeps overlapping the host as it does
//! untimed; [`Timers::take_step`] waits for the marks and records each scope's time on the
//! device's timeline. At `Coarse`, scopes read the host clock (what the host waited for).
//!
//! Work: a scope may say what its op computes and moves ([`TimerGuard::with_work`], a
//! [`Work`]), declared where the op is called; the breakdown divides it by the scope's time
//! and prints the op's rates (GFLOP/s, GB/s) beside its time.

use super::ops::{class_of, OpCatalogue, OpClass, Share};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// How much to time (`--timers off|coarse|fine`). Ordered: `Off < Coarse < Fine`.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum TimerLevel {
    /// Time nothing.
    Off,
    /// Whole phases: forward, backward, optimizer, batch generation, communication waits.
    /// (Evaluation and checkpoints run between steps and are timed apart: see
    /// [`Timers::pause`].)
    #[default]
    Coarse,
    /// Every op inside the phases (per layer, summed over layers).
    Fine,
}

impl std::fmt::Display for TimerLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TimerLevel::Off => "off",
            TimerLevel::Coarse => "coarse",
            TimerLevel::Fine => "fine",
        })
    }
}

impl std::str::FromStr for TimerLevel {
    type Err = String;

    /// `off`, `coarse` or `fine` (what `--timers` takes; the CLI parses it through this).
    fn from_str(s: &str) -> Result<TimerLevel, String> {
        match s {
            "off" => Ok(TimerLevel::Off),
            "coarse" => Ok(TimerLevel::Coarse),
            "fine" => Ok(TimerLevel::Fine),
            _ => Err(format!("{s:?}: expected off, coarse or fine")),
        }
    }
}

/// What an op computes and moves, for the breakdown's rates: `flops`, its floating-point
/// operations (a multiply-add is two; 0 for ops whose cost is their memory traffic), and
/// `bytes`, its compulsory traffic: every tensor it takes read once and every tensor it makes
/// written once, at their storage types, one it adds into both read and written. What its
/// kernels actually move may be more (a second pass over an input) or less (a tensor still in
/// cache), so the GB/s of an op is against what it could not avoid moving.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Work {
    pub flops: f64,
    pub bytes: f64,
}

impl std::ops::AddAssign for Work {
    fn add_assign(&mut self, o: Work) {
        self.flops += o.flops;
        self.bytes += o.bytes;
    }
}

impl std::ops::Div<f64> for Work {
    type Output = Work;
    fn div(self, n: f64) -> Work {
        Work {
            flops: self.flops / n,
            bytes: self.bytes / n,
        }
    }
}

/// What the machine can do at most, the roofs an op's rates are set against
/// ([`Breakdown::set_roofs`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Roofs {
    /// GFLOP/s of the GEMMs' compute type: the peak MFU divides by.
    pub gflops: Option<f64>,
    /// GB/s of memory: measured (an in-place triad) on a CPU, the driver's figure on a GPU.
    pub gbs: Option<f64>,
}

impl Roofs {
    /// `peak X GFLOP/s, memory Y GB/s`, `unknown` for a roof not known.
    pub fn describe(&self) -> String {
        let roof =
            |x: Option<f64>, unit: &str| x.map_or("unknown".into(), |x| format!("{x:.1} {unit}"));
        format!(
            "peak {}, memory {}",
            roof(self.gflops, "GFLOP/s"),
            roof(self.gbs, "GB/s")
        )
    }
}

/// A mark queued on a device's timeline ([`DeviceClock::mark`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMark(pub usize);

/// A device's clock: marks queued between its work, read once the device has passed them.
pub trait DeviceClock {
    /// Queues a mark after the work queued so far.
    fn mark(&self) -> DeviceMark;
    /// Milliseconds on the device from `start` to `end` (waiting until it has passed `end`);
    /// both marks are free for reuse afterwards.
    fn take_interval(&self, start: DeviceMark, end: DeviceMark) -> f64;
}

/// Where a recording scope started.
#[derive(Clone, Copy, Debug)]
enum Start {
    Host(Instant),
    Device(DeviceMark),
}

/// Wall-clock timers for one training loop (main thread only; see the module docs).
pub struct Timers {
    level: Cell<TimerLevel>,
    clock: RefCell<Option<Box<dyn DeviceClock>>>,
    /// Scopes timed on the device clock that have ended, not yet read.
    pending: RefCell<Vec<(&'static str, DeviceMark, DeviceMark)>>,
    /// Milliseconds per name since the last `take_step`.
    step: RefCell<BTreeMap<String, f64>>,
    /// Milliseconds per name summed over every `take_step` (since the last `reset_totals`).
    totals: RefCell<BTreeMap<String, f64>>,
    /// The work of the scopes that said theirs ([`TimerGuard::with_work`]), per name, since
    /// the last `take_step`, and summed as `totals` is.
    step_work: RefCell<BTreeMap<&'static str, Work>>,
    work_totals: RefCell<BTreeMap<String, Work>>,
    steps: Cell<u64>,
}

impl std::fmt::Debug for Timers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timers")
            .field("level", &self.level.get())
            .field("steps", &self.steps.get())
            .finish_non_exhaustive()
    }
}

impl Default for Timers {
    fn default() -> Self {
        Timers::new(TimerLevel::default())
    }
}

/// Records the time from its creation to its drop (see [`Timers::scope`]).
#[must_use = "the timer stops when the guard is dropped; bind it with `let _t = ...`"]
pub struct TimerGuard<'a> {
    timers: &'a Timers,
    name: &'static str,
    /// `None` when this scope does not record.
    start: Option<Start>,
    /// What the op timed computes and moves, when it said ([`TimerGuard::with_work`]).
    work: Option<Work>,
}

impl TimerGuard<'_> {
    /// Stops the timer now (same as dropping the guard).
    pub fn stop(self) {}

    /// Says what the op this scope times computes and moves ([`Work`]), for the breakdown's
    /// rates: `work` runs only when the scope records, and its result is added to the name's
    /// work for the step when the scope ends.
    pub fn with_work(mut self, work: impl FnOnce() -> Work) -> Self {
        if self.start.is_some() {
            self.work = Some(work());
        }
        self
    }
}

impl Drop for TimerGuard<'_> {
    fn drop(&mut self) {
        if let Some(w) = self.work {
            *self
                .timers
                .step_work
                .borrow_mut()
                .entry(self.name)
                .or_default() += w;
        }
        match self.start {
            None => {}
            Some(Start::Host(start)) => {
                let ms = start.elapsed().as_secs_f64() * 1e3;
                self.timers.record(self.name, ms);
            }
            Some(Start::Device(start)) => {
                let clock = self.timers.clock.borrow();
                let end = clock.as_ref().expect("a device scope has a clock").mark();
                self.timers
                    .pending
                    .borrow_mut()
                    .push((self.name, start, end));
            }
        }
    }
}

/// Restores the timers' level when dropped (see [`Timers::pause`]).
#[must_use = "the timers resume when the guard is dropped"]
pub struct PauseGuard<'a> {
    timers: &'a Timers,
    level: TimerLevel,
}

impl Drop for PauseGuard<'_> {
    fn drop(&mut self) {
        self.timers.level.set(self.level);
    }
}

impl Timers {
    pub fn new(level: TimerLevel) -> Timers {
        Timers {
            level: Cell::new(level),
            clock: RefCell::new(None),
            pending: RefCell::new(Vec::new()),
            step: RefCell::new(BTreeMap::new()),
            totals: RefCell::new(BTreeMap::new()),
            step_work: RefCell::new(BTreeMap::new()),
            work_totals: RefCell::new(BTreeMap::new()),
            steps: Cell::new(0),
        }
    }

    pub fn level(&self) -> TimerLevel {
        self.level.get()
    }

    /// Changes the level (e.g. to time only some steps finely).
    pub fn set_level(&self, level: TimerLevel) {
        self.level.set(level);
    }

    /// Whether a scope opened at `level` records: `level` is not `Off` and at most the timers'
    /// level.
    #[inline]
    pub fn enabled(&self, level: TimerLevel) -> bool {
        level != TimerLevel::Off && level <= self.level.get()
    }

    /// Times [`TimerLevel::Fine`] runs on a device's clock (see the module docs; the CPU
    /// backend has none). Set it before the first scope.
    pub fn set_device_clock(&self, clock: Box<dyn DeviceClock>) {
        *self.clock.borrow_mut() = Some(clock);
    }

    /// Starts timing `name` until the guard drops, if `level` is enabled (see
    /// [`Timers::enabled`]); otherwise returns an inert guard without reading the clock.
    /// Bind the guard to a named variable (`let _t = timers.scope(..)`): `let _ = ..` drops it
    /// at once and records nothing useful.
    #[inline]
    pub fn scope(&self, name: &'static str, level: TimerLevel) -> TimerGuard<'_> {
        let start = if !self.enabled(level) {
            None
        } else {
            match self.clock.borrow().as_ref() {
                Some(clock) if self.level.get() == TimerLevel::Fine => {
                    Some(Start::Device(clock.mark()))
                }
                _ => Some(Start::Host(Instant::now())),
            }
        };
        TimerGuard {
            timers: self,
            name,
            start,
            work: None,
        }
    }

    /// Runs `f` inside [`Timers::scope`]`(name, level)`.
    pub fn time<R>(&self, name: &'static str, level: TimerLevel, f: impl FnOnce() -> R) -> R {
        let _g = self.scope(name, level);
        f()
    }

    /// Adds an externally measured time (milliseconds) to `name` for this step. Ignored when
    /// the timers are `Off`.
    pub fn add(&self, name: &str, ms: f64) {
        if self.level.get() != TimerLevel::Off {
            self.record(name, ms);
        }
    }

    fn record(&self, name: &str, ms: f64) {
        let mut step = self.step.borrow_mut();
        match step.get_mut(name) {
            Some(v) => *v += ms,
            None => {
                step.insert(name.to_owned(), ms);
            }
        }
    }

    /// Milliseconds per name recorded since the last call (scopes timed on the device clock
    /// read first, which waits for the device); resets the step's map, adds it to the run
    /// totals and counts one step (also when nothing was recorded).
    pub fn take_step(&self) -> BTreeMap<String, f64> {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        if !pending.is_empty() {
            let clock = self.clock.borrow();
            let clock = clock.as_ref().expect("device scopes have a clock");
            for (name, start, end) in pending {
                self.record(name, clock.take_interval(start, end));
            }
        }
        let step = std::mem::take(&mut *self.step.borrow_mut());
        let mut totals = self.totals.borrow_mut();
        for (k, v) in &step {
            *totals.entry(k.clone()).or_insert(0.0) += v;
        }
        let mut work = self.work_totals.borrow_mut();
        for (k, w) in std::mem::take(&mut *self.step_work.borrow_mut()) {
            *work.entry(k.to_owned()).or_default() += w;
        }
        self.steps.set(self.steps.get() + 1);
        step
    }

    /// Stops every scope from recording until the returned guard drops: for work between
    /// steps (evaluation, checkpoints), which runs the same ops but is not part of any step
    /// and is reported apart ([`Breakdown::outside`]).
    pub fn pause(&self) -> PauseGuard<'_> {
        let level = self.level.replace(TimerLevel::Off);
        PauseGuard {
            timers: self,
            level,
        }
    }

    /// Steps counted by [`Timers::take_step`] since the start or the last
    /// [`Timers::reset_totals`].
    pub fn steps(&self) -> u64 {
        self.steps.get()
    }

    /// Run totals (milliseconds per name) over [`Timers::steps`] steps.
    pub fn totals(&self) -> BTreeMap<String, f64> {
        self.totals.borrow().clone()
    }

    /// Run totals of the work the scopes said ([`TimerGuard::with_work`]) per name, over the
    /// same steps as [`Timers::totals`].
    pub fn work_totals(&self) -> BTreeMap<String, Work> {
        self.work_totals.borrow().clone()
    }

    /// Forgets the run totals and the step count (e.g. after warm-up steps); the current step's
    /// times are kept.
    pub fn reset_totals(&self) {
        self.totals.borrow_mut().clear();
        self.work_totals.borrow_mut().clear();
        self.steps.set(0);
    }

    /// The breakdown of the run totals over `steps` steps whose wall times sum to
    /// `total_step_ms` (so the mean step is `total_step_ms / steps`). Normally `steps` is
    /// [`Timers::steps`] and `total_step_ms` the summed step times of the same steps. Times of
    /// the step in progress (not yet taken) are not included. `ops` declare the timers.
    pub fn breakdown(&self, total_step_ms: f64, steps: u64, ops: &[&OpCatalogue]) -> Breakdown {
        let mut b = Breakdown::from_totals(&self.totals.borrow(), total_step_ms, steps, ops);
        b.set_work(&self.work_totals.borrow());
        b
    }
}

/// One line of a [`Breakdown`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BreakdownRow {
    /// Full timer name (`forward:attention:qkv`); the untimed remainder of a parent `P` is
    /// `P:(other)`, that of the whole step `(other)`.
    pub name: String,
    pub ms_per_step: f64,
    /// Share of the mean step time, in percent.
    pub pct_of_step: f64,
    /// 0 for top-level names, 1 for their children, ...
    pub depth: usize,
    /// False for parents that were not timed themselves (their time is the sum of their
    /// children) and for `(other)` rows.
    pub timed: bool,
    /// With several ranks: the smallest and largest per-rank ms/step of this timer
    /// ([`Breakdown::set_rank_spread`]); `ms_per_step` is then the mean over ranks.
    pub min_max: Option<(f64, f64)>,
    /// The op's work per step, when its scope said it ([`Breakdown::set_work`]).
    pub work: Option<Work>,
}

impl BreakdownRow {
    /// The last component of the name (what the table prints, indented by depth).
    pub fn label(&self) -> &str {
        self.name.rsplit(':').next().unwrap_or(&self.name)
    }

    /// GFLOP/s: the op's floating-point operations over its time (`None` without work,
    /// FLOPs or time).
    pub fn gflops(&self) -> Option<f64> {
        self.rate(|w| w.flops)
    }

    /// GB/s: the op's compulsory traffic over its time (`None` without work or time).
    pub fn gbs(&self) -> Option<f64> {
        self.rate(|w| w.bytes)
    }

    fn rate(&self, of: impl Fn(&Work) -> f64) -> Option<f64> {
        let x = self.work.as_ref().map(of)?;
        (x > 0.0 && self.ms_per_step > 0.0).then(|| x / (self.ms_per_step * 1e6))
    }

    /// Percent of its roofline the op runs at: its rate over the best rate a machine with
    /// `roofs` allows at its arithmetic intensity I = FLOPs / bytes, min(peak, I × bandwidth).
    /// That is the larger of GFLOP/s over the peak and GB/s over the bandwidth, so a
    /// memory-bound op is measured against the memory and a GEMM against the peak; a roof
    /// that is not known drops its term. `None` without work, time or roofs.
    pub fn roof_pct(&self, roofs: &Roofs) -> Option<f64> {
        let of =
            |rate: Option<f64>, roof: Option<f64>| Some(100.0 * rate? / roof.filter(|r| *r > 0.0)?);
        match (of(self.gflops(), roofs.gflops), of(self.gbs(), roofs.gbs)) {
            (Some(f), Some(b)) => Some(f.max(b)),
            (f, b) => f.or(b),
        }
    }
}

/// Where the time of a step went, as a tree (parents before children, children by decreasing
/// time, each parent's `(other)` last).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Breakdown {
    pub steps: u64,
    /// Mean step time, ms.
    pub step_ms: f64,
    pub rows: Vec<BreakdownRow>,
    /// Share of the step in GEMM-bound ops (`attention:qkv|baddbmm|bmm|fused|proj`, `mlp:mm`,
    /// `lm-head`, forward and backward), percent. Meaningful at `--timers fine`.
    pub gemm_pct: f64,
    /// Share of the step in the other compute ops (`attention:softmax`, `layernorm`,
    /// `mlp:gelu`, `residual`, `embedding`, `loss`, forward and backward, and `optimizer`),
    /// percent. Meaningful at `--timers fine`.
    pub non_gemm_pct: f64,
    /// Work between steps (evaluation, checkpoints), by name: not part of any step, so not in
    /// `rows` or `step_ms`.
    pub outside: BTreeMap<String, OutsideStep>,
    /// The machine's peak and memory bandwidth, for each op's `roof %`
    /// ([`BreakdownRow::roof_pct`]); none until [`Breakdown::set_roofs`].
    pub roofs: Roofs,
}

/// Time spent between steps on one kind of work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct OutsideStep {
    /// How many times it ran.
    pub count: u64,
    /// Wall time of all of them, ms.
    pub total_ms: f64,
}

const OTHER: &str = "(other)";
/// The timer a name is the child of (the part before its last `:`), if any.
pub fn parent_of(name: &str) -> Option<&str> {
    name.rfind(':').map(|i| &name[..i])
}

/// The name tree behind [`Breakdown::from_totals`].
struct Tree<'a, 'b> {
    children: &'b BTreeMap<Option<&'a str>, Vec<&'a str>>,
    /// ms/step of every node (untimed parents: the sum of their children).
    value: &'b BTreeMap<&'a str, f64>,
    /// ms/step of the nodes that were timed themselves.
    timed: &'b BTreeMap<&'a str, f64>,
    pct: &'b dyn Fn(f64) -> f64,
}

impl<'a> Tree<'a, '_> {
    /// Depth-first: `parent`'s children by decreasing time, each followed by its subtree, then
    /// `parent`'s `(other)` row if `parent_ms` (its own time) is known. `None` is the root.
    fn visit(
        &self,
        parent: Option<&'a str>,
        parent_ms: Option<f64>,
        depth: usize,
        rows: &mut Vec<BreakdownRow>,
    ) {
        let Some(kids) = self.children.get(&parent) else {
            return;
        };
        let value = self.value;
        let mut kids = kids.clone();
        kids.sort_by(|a, b| value[b].total_cmp(&value[a]).then(a.cmp(b)));
        for &k in &kids {
            rows.push(BreakdownRow {
                name: k.to_owned(),
                ms_per_step: value[k],
                pct_of_step: (self.pct)(value[k]),
                depth,
                timed: self.timed.contains_key(k),
                min_max: None,
                work: None,
            });
            self.visit(Some(k), self.timed.get(k).copied(), depth + 1, rows);
        }
        if let Some(p) = parent_ms {
            let rest = (p - kids.iter().map(|k| value[k]).sum::<f64>()).max(0.0);
            rows.push(BreakdownRow {
                name: match parent {
                    Some(p) => format!("{p}:{OTHER}"),
                    None => OTHER.to_owned(),
                },
                ms_per_step: rest,
                pct_of_step: (self.pct)(rest),
                depth,
                timed: false,
                min_max: None,
                work: None,
            });
        }
    }
}

impl Breakdown {
    /// Builds the tree from run totals (ms per name summed over `steps` steps); `ops` declare
    /// the timers' classes, for the GEMM and non-GEMM shares.
    pub fn from_totals(
        totals: &BTreeMap<String, f64>,
        total_step_ms: f64,
        steps: u64,
        ops: &[&OpCatalogue],
    ) -> Self {
        let n = steps.max(1) as f64;
        let step_ms = total_step_ms / n;
        let pct = |ms: f64| {
            if step_ms > 0.0 {
                100.0 * ms / step_ms
            } else {
                0.0
            }
        };
        // Every name and every ancestor of a name; untimed ancestors get their children's sum.
        let mut timed: BTreeMap<&str, f64> = BTreeMap::new();
        let mut nodes: BTreeMap<&str, ()> = BTreeMap::new();
        for (name, &ms) in totals {
            timed.insert(name.as_str(), ms / n);
            let mut cur = name.as_str();
            nodes.insert(cur, ());
            while let Some(p) = parent_of(cur) {
                nodes.insert(p, ());
                cur = p;
            }
        }
        let mut children: BTreeMap<Option<&str>, Vec<&str>> = BTreeMap::new();
        for &name in nodes.keys() {
            children.entry(parent_of(name)).or_default().push(name);
        }
        // Values bottom-up: deepest names first.
        let mut value: BTreeMap<&str, f64> = BTreeMap::new();
        let mut by_depth: Vec<&str> = nodes.keys().copied().collect();
        by_depth.sort_by_key(|s| std::cmp::Reverse(s.matches(':').count()));
        for name in by_depth {
            let v = match timed.get(name) {
                Some(&v) => v,
                None => children
                    .get(&Some(name))
                    .map_or(0.0, |c| c.iter().map(|k| value[k]).sum()),
            };
            value.insert(name, v);
        }

        let tree = Tree {
            children: &children,
            value: &value,
            timed: &timed,
            pct: &pct,
        };
        let mut rows = Vec::new();
        let root_ms = (!totals.is_empty()).then_some(step_ms);
        tree.visit(None, root_ms, 0, &mut rows);

        // Each share sums its outermost timers (`optimizer`, not also `optimizer:clip`).
        let share = |name: &str| class_of(ops, name).and_then(OpClass::share);
        let mut gemm_ms = 0.0;
        let mut non_gemm_ms = 0.0;
        for (&name, &ms) in &timed {
            let mut ancestors = std::iter::successors(parent_of(name), |p| parent_of(p));
            if ancestors.any(|p| share(p).is_some()) {
                continue;
            }
            match share(name) {
                Some(Share::Gemm) => gemm_ms += ms,
                Some(Share::NonGemm) => non_gemm_ms += ms,
                None => {}
            }
        }
        Breakdown {
            steps,
            step_ms,
            rows,
            gemm_pct: pct(gemm_ms),
            non_gemm_pct: pct(non_gemm_ms),
            outside: BTreeMap::new(),
            roofs: Roofs::default(),
        }
    }

    /// Sets the roofs the table's `roof%` column and the JSON's `"roof_pct"` divide by.
    pub fn set_roofs(&mut self, roofs: Roofs) {
        self.roofs = roofs;
    }

    /// Adds the per-rank spread of every timed row from run totals over `steps` steps of the
    /// per-step minimum and maximum over ranks (the totals this breakdown was built from being
    /// the means).
    pub fn set_rank_spread(
        &mut self,
        min_totals: &BTreeMap<String, f64>,
        max_totals: &BTreeMap<String, f64>,
    ) {
        let n = self.steps.max(1) as f64;
        for r in &mut self.rows {
            if let (Some(lo), Some(hi)) = (min_totals.get(&r.name), max_totals.get(&r.name)) {
                r.min_max = Some((lo / n, hi / n));
            }
        }
    }

    /// Adds each timed row's work per step from run totals over `steps` steps of the work
    /// its scope said ([`Timers::work_totals`]); rows whose scope said none keep `None`.
    pub fn set_work(&mut self, work_totals: &BTreeMap<String, Work>) {
        let n = self.steps.max(1) as f64;
        for r in &mut self.rows {
            if let Some(&w) = work_totals.get(&r.name) {
                r.work = Some(w / n);
            }
        }
    }

    /// An aligned text table: name indented by depth, ms/step and % of the step (and the
    /// min/max over ranks when known; GFLOP/s and GB/s where an op said its work), then the
    /// step total and the GEMM / non-GEMM summary.
    pub fn to_table(&self) -> String {
        let label = |r: &BreakdownRow| format!("{}{}", "  ".repeat(r.depth), r.label());
        let width = self
            .rows
            .iter()
            .map(|r| label(r).len())
            .max()
            .unwrap_or(0)
            .max(12);
        let mut s = format!(
            "timer breakdown over {} step{} (mean step {:.1} ms)\n",
            self.steps,
            if self.steps == 1 { "" } else { "s" },
            self.step_ms
        );
        let spread = self.rows.iter().any(|r| r.min_max.is_some());
        let rates = self.rows.iter().any(|r| r.work.is_some());
        let roofs = rates && (self.roofs.gflops.is_some() || self.roofs.gbs.is_some());
        if roofs {
            s.push_str(&format!(
                "roofs: {} (roof% = the larger of GFLOP/s / peak and GB/s / memory)\n",
                self.roofs.describe()
            ));
        }
        let mut head = format!("{:<width$} {:>10} {:>7}", "op", "ms/step", "%");
        if spread {
            head.push_str(&format!(" {:>10} {:>10}", "min rank", "max rank"));
        }
        if rates {
            head.push_str(&format!(" {:>10} {:>8}", "GFLOP/s", "GB/s"));
        }
        if roofs {
            head.push_str(&format!(" {:>6}", "roof%"));
        }
        s.push_str(head.trim_end());
        s.push('\n');
        let cell = |x: Option<f64>, w: usize, prec: usize| match x {
            Some(x) => format!(" {x:>w$.prec$}"),
            None => format!(" {:>w$}", ""),
        };
        for r in &self.rows {
            let mut line = format!(
                "{:<width$} {:>10.2} {:>6.1}%",
                label(r),
                r.ms_per_step,
                r.pct_of_step
            );
            if spread {
                line.push_str(&cell(r.min_max.map(|m| m.0), 10, 2));
                line.push_str(&cell(r.min_max.map(|m| m.1), 10, 2));
            }
            if rates {
                line.push_str(&cell(r.gflops(), 10, 1));
                line.push_str(&cell(r.gbs(), 8, 1));
            }
            if roofs {
                line.push_str(&cell(r.roof_pct(&self.roofs), 6, 1));
            }
            s.push_str(line.trim_end());
            s.push('\n');
        }
        s.push_str(&format!(
            "{:<width$} {:>10.2} {:>6.1}%\n",
            "step", self.step_ms, 100.0
        ));
        if self.gemm_pct > 0.0 {
            s.push_str(&format!(
                "GEMM {:.1}% | non-GEMM compute {:.1}% | rest {:.1}%\n",
                self.gemm_pct,
                self.non_gemm_pct,
                (100.0 - self.gemm_pct - self.non_gemm_pct).max(0.0)
            ));
        }
        for (name, o) in &self.outside {
            if o.count > 0 {
                s.push_str(&format!(
                    "outside the steps: {name} {} × {:.1} ms = {:.2} s\n",
                    o.count,
                    o.total_ms / o.count as f64,
                    o.total_ms / 1e3
                ));
            }
        }
        s
    }

    /// The JSON written by [`Breakdown::write_json`]:
    /// `{"steps", "step_ms", "gemm_pct", "non_gemm_pct", "outside_step": {name: {"count",
    /// "total_ms"}}, "ops": [{"name", "ms_per_step", "pct",
    /// "depth", "timed"}]}`, each op with `"min_ms_per_step"` and `"max_ms_per_step"` (over
    /// ranks) when known, and `"gflop_per_step"`, `"gbyte_per_step"` (its [`Work`]) with the
    /// rates `"gflops"`, `"gbs"` and `"roof_pct"` (null without roofs) where its scope said
    /// its work; `"roofs": {"gflops", "gbs"}` (null where unknown). Non-finite numbers become
    /// `null`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "steps": self.steps,
            "step_ms": self.step_ms,
            "gemm_pct": self.gemm_pct,
            "non_gemm_pct": self.non_gemm_pct,
            "outside_step": self.outside,
            "roofs": self.roofs,
            "ops": self.rows.iter().map(|r| {
                let mut o = serde_json::json!({
                    "name": r.name,
                    "ms_per_step": r.ms_per_step,
                    "pct": r.pct_of_step,
                    "depth": r.depth,
                    "timed": r.timed,
                });
                if let Some((lo, hi)) = r.min_max {
                    o["min_ms_per_step"] = lo.into();
                    o["max_ms_per_step"] = hi.into();
                }
                if let Some(w) = r.work {
                    o["gflop_per_step"] = (w.flops / 1e9).into();
                    o["gbyte_per_step"] = (w.bytes / 1e9).into();
                    o["gflops"] = r.gflops().into();
                    o["gbs"] = r.gbs().into();
                    o["roof_pct"] = r.roof_pct(&self.roofs).into();
                }
                o
            }).collect::<Vec<_>>(),
        })
    }

    /// Writes [`Breakdown::to_json`] to `path` (normally `OUT/breakdown.json`), replacing it
    /// atomically (temporary file, then rename).
    pub fn write_json(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text = serde_json::to_string_pretty(&self.to_json())? + "\n";
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_ops::n::*;

    mod test_ops {
        crate::metrics::ops::op_catalogue! {
            n {
                FORWARD = "forward" => Scope;
                BACKWARD = "backward" => Scope;
                OPTIMIZER = "optimizer" => Optimizer;
                FORWARD_ATTENTION_QKV = "forward:attention:qkv" => Gemm;
                FORWARD_ATTENTION_SOFTMAX = "forward:attention:softmax" => AttentionSoftmax;
                FORWARD_LAYERNORM = "forward:layernorm" => Norm;
                FORWARD_MLP_MM = "forward:mlp:mm" => Gemm;
                FORWARD_MLP_GELU = "forward:mlp:gelu" => Activation;
                BACKWARD_MLP_MM = "backward:mlp:mm" => Gemm;
            }
        }
    }
    const OPS: &[&OpCatalogue] = &[&test_ops::OPS];
    use std::rc::Rc;
    use std::time::Duration;

    fn sleep_ms(ms: u64) {
        std::thread::sleep(Duration::from_millis(ms));
    }

    #[test]
    fn levels_order_and_parse() {
        assert!(TimerLevel::Off < TimerLevel::Coarse && TimerLevel::Coarse < TimerLevel::Fine);
        assert_eq!("fine".parse::<TimerLevel>(), Ok(TimerLevel::Fine));
        for l in [TimerLevel::Off, TimerLevel::Coarse, TimerLevel::Fine] {
            assert_eq!(l.to_string().parse::<TimerLevel>(), Ok(l));
        }
        let e = "bogus".parse::<TimerLevel>().unwrap_err();
        assert!(e.contains("expected off, coarse or fine"), "{e}");
        assert_eq!(serde_json::to_string(&TimerLevel::Off).unwrap(), "\"off\"");
        let t: TimerLevel = serde_json::from_str("\"coarse\"").unwrap();
        assert_eq!(t, TimerLevel::Coarse);
    }

    #[test]
    fn nesting_records_both_and_parent_includes_child() {
        let t = Timers::new(TimerLevel::Fine);
        {
            let _outer = t.scope(FORWARD, TimerLevel::Coarse);
            sleep_ms(2);
            {
                let _inner = t.scope(FORWARD_ATTENTION_QKV, TimerLevel::Fine);
                sleep_ms(3);
            }
        }
        let s = t.take_step();
        assert_eq!(s.len(), 2);
        assert!(s[FORWARD_ATTENTION_QKV] >= 3.0);
        assert!(s[FORWARD] >= s[FORWARD_ATTENTION_QKV] + 2.0, "{s:?}");
    }

    #[test]
    fn levels_filter_scopes() {
        let t = Timers::new(TimerLevel::Coarse);
        {
            let _a = t.scope(FORWARD, TimerLevel::Coarse);
            let _b = t.scope(FORWARD_LAYERNORM, TimerLevel::Fine);
            let _c = t.scope(OPTIMIZER, TimerLevel::Off);
        }
        let s = t.take_step();
        assert_eq!(s.keys().collect::<Vec<_>>(), vec![FORWARD]);
    }

    /// A device clock whose time advances by 1 ms per mark, counting its marks and the
    /// intervals read.
    #[derive(Clone, Default)]
    struct TickClock {
        marks: Rc<Cell<usize>>,
        taken: Rc<Cell<usize>>,
    }

    impl DeviceClock for TickClock {
        fn mark(&self) -> DeviceMark {
            self.marks.set(self.marks.get() + 1);
            DeviceMark(self.marks.get())
        }
        fn take_interval(&self, start: DeviceMark, end: DeviceMark) -> f64 {
            self.taken.set(self.taken.get() + 1);
            (end.0 - start.0) as f64
        }
    }

    #[test]
    fn off_records_nothing_and_reads_no_clock() {
        let clock = TickClock::default();
        let t = Timers::new(TimerLevel::Off);
        t.set_device_clock(Box::new(clock.clone()));
        {
            let _a = t.scope(FORWARD, TimerLevel::Coarse);
            let _b = t.scope(FORWARD_LAYERNORM, TimerLevel::Fine);
            assert!(_a.start.is_none() && _b.start.is_none());
        }
        t.add(OPTIMIZER, 5.0);
        assert!(t.take_step().is_empty());
        assert!(t.totals().is_empty());
        assert_eq!(t.steps(), 1);
        assert_eq!(clock.marks.get(), 0);
    }

    #[test]
    fn pause_records_nothing_and_restores_the_level() {
        let t = Timers::new(TimerLevel::Fine);
        {
            let _p = t.pause();
            let _a = t.scope(FORWARD, TimerLevel::Coarse);
            assert_eq!(t.level(), TimerLevel::Off);
        }
        assert_eq!(t.level(), TimerLevel::Fine);
        assert!(t.take_step().is_empty());
    }

    #[test]
    fn the_device_clock_times_fine_runs_only() {
        let clock = TickClock::default();
        let t = Timers::new(TimerLevel::Coarse);
        t.set_device_clock(Box::new(clock.clone()));
        // Coarse: the host clock.
        t.time(FORWARD, TimerLevel::Coarse, || {});
        assert_eq!(clock.marks.get(), 0);
        assert!(t.take_step()[FORWARD] < 1.0);
        // Fine: a mark at the start and one at the end of every scope, nested ones inside
        // their parent's; nothing read until the step is taken.
        t.set_level(TimerLevel::Fine);
        {
            let _f = t.scope(FORWARD, TimerLevel::Coarse);
            for _ in 0..2 {
                let _l = t.scope(FORWARD_LAYERNORM, TimerLevel::Fine);
            }
        }
        assert_eq!((clock.marks.get(), clock.taken.get()), (6, 0));
        let s = t.take_step();
        assert_eq!(clock.taken.get(), 3);
        // Marks 1..6: forward 1→6, the layernorms 2→3 and 4→5.
        assert_eq!(s[FORWARD], 5.0);
        assert_eq!(s[FORWARD_LAYERNORM], 2.0);
        // A scope that does not record reads no clock.
        t.time(FORWARD_MLP_GELU, TimerLevel::Off, || {});
        assert_eq!(clock.marks.get(), 6);
        assert!(t.take_step().is_empty());
    }

    #[test]
    fn take_step_sums_repeats_resets_and_accumulates() {
        let t = Timers::new(TimerLevel::Fine);
        for _ in 0..12 {
            t.add(FORWARD_LAYERNORM, 0.5);
        }
        t.add(FORWARD, 10.0);
        let s = t.take_step();
        assert_eq!(s[FORWARD_LAYERNORM], 6.0);
        assert_eq!(s[FORWARD], 10.0);
        t.add(FORWARD, 20.0);
        let s = t.take_step();
        assert_eq!(s.len(), 1);
        assert_eq!(s[FORWARD], 20.0);
        assert!(t.take_step().is_empty());
        assert_eq!(t.steps(), 3);
        let tot = t.totals();
        assert_eq!(tot[FORWARD], 30.0);
        assert_eq!(tot[FORWARD_LAYERNORM], 6.0);
        t.reset_totals();
        assert_eq!(t.steps(), 0);
        assert!(t.totals().is_empty());
    }

    fn sample() -> Breakdown {
        // Two steps of 100 ms each.
        let t = Timers::new(TimerLevel::Fine);
        for _ in 0..2 {
            t.add(FORWARD, 40.0);
            t.add(FORWARD_ATTENTION_QKV, 10.0);
            t.add(FORWARD_ATTENTION_SOFTMAX, 4.0);
            t.add(FORWARD_MLP_MM, 12.0);
            t.add(FORWARD_LAYERNORM, 2.0);
            t.add(BACKWARD, 50.0);
            t.add(BACKWARD_MLP_MM, 30.0);
            t.add(OPTIMIZER, 5.0);
            t.take_step();
        }
        t.breakdown(200.0, t.steps(), OPS)
    }

    #[test]
    fn breakdown_is_a_sorted_tree_with_other_rows() {
        let b = sample();
        let got: Vec<(&str, f64, usize)> = b
            .rows
            .iter()
            .map(|r| (r.name.as_str(), r.ms_per_step, r.depth))
            .collect();
        let want = vec![
            ("backward", 50.0, 0),
            ("backward:mlp", 30.0, 1),
            ("backward:mlp:mm", 30.0, 2),
            ("backward:(other)", 20.0, 1),
            ("forward", 40.0, 0),
            ("forward:attention", 14.0, 1),
            ("forward:attention:qkv", 10.0, 2),
            ("forward:attention:softmax", 4.0, 2),
            ("forward:mlp", 12.0, 1),
            ("forward:mlp:mm", 12.0, 2),
            ("forward:layernorm", 2.0, 1),
            ("forward:(other)", 12.0, 1),
            ("optimizer", 5.0, 0),
            ("(other)", 5.0, 0),
        ];
        assert_eq!(got, want);
        assert_eq!(b.step_ms, 100.0);
        assert_eq!(b.steps, 2);
        // Percent of the mean step.
        let fwd = b.rows.iter().find(|r| r.name == "forward").unwrap();
        assert_eq!(fwd.pct_of_step, 40.0);
        assert!(fwd.timed);
        assert!(!b.rows[5].timed, "forward:attention was synthesised");
        // Top-level rows add up to the step.
        let top: f64 = b
            .rows
            .iter()
            .filter(|r| r.depth == 0)
            .map(|r| r.pct_of_step)
            .sum();
        assert!((top - 100.0).abs() < 1e-9);
        assert_eq!(b.gemm_pct, 52.0); // qkv 10 + mlp:mm 12 + backward mlp:mm 30
        assert_eq!(b.non_gemm_pct, 11.0); // softmax 4 + layernorm 2 + optimizer 5
    }

    #[test]
    fn other_is_clamped_and_empty_breakdown_is_empty() {
        let mut tot = BTreeMap::new();
        tot.insert("forward".to_string(), 10.0);
        tot.insert("forward:loss".to_string(), 11.0); // clock noise: child > parent
        let b = Breakdown::from_totals(&tot, 10.0, 1, OPS);
        let other = b.rows.iter().find(|r| r.name == "forward:(other)").unwrap();
        assert_eq!(other.ms_per_step, 0.0);
        let e = Breakdown::from_totals(&BTreeMap::new(), 0.0, 0, OPS);
        assert!(e.rows.is_empty());
        assert_eq!(e.step_ms, 0.0);
        assert!(e.to_table().contains("step"));
    }

    #[test]
    fn scopes_work_becomes_rates_in_the_table_and_json() {
        let clock = TickClock::default();
        let t = Timers::new(TimerLevel::Fine);
        t.set_device_clock(Box::new(clock.clone()));
        let work = Work {
            flops: 2e9,
            bytes: 1e9,
        };
        // A warm-up step, forgotten with its work.
        drop(
            t.scope(FORWARD_ATTENTION_QKV, TimerLevel::Fine)
                .with_work(|| work),
        );
        t.take_step();
        t.reset_totals();
        assert!(t.work_totals().is_empty());
        for _ in 0..2 {
            // Each scope 1 ms on the tick clock; the work of both adds up.
            drop(
                t.scope(FORWARD_ATTENTION_QKV, TimerLevel::Fine)
                    .with_work(|| work),
            );
            drop(t.scope(FORWARD_LAYERNORM, TimerLevel::Fine));
            // Not recording: the work is not even computed.
            let _p = t.pause();
            drop(
                t.scope(FORWARD_MLP_MM, TimerLevel::Fine)
                    .with_work(|| unreachable!()),
            );
        }
        t.take_step();
        assert_eq!(t.work_totals()[FORWARD_ATTENTION_QKV], work / 0.5);
        let b = t.breakdown(10.0, 1, OPS);
        let qkv = b
            .rows
            .iter()
            .find(|r| r.name == FORWARD_ATTENTION_QKV)
            .unwrap();
        assert_eq!(qkv.ms_per_step, 2.0);
        assert_eq!((qkv.gflops(), qkv.gbs()), (Some(2000.0), Some(1000.0)));
        let ln = b.rows.iter().find(|r| r.name == FORWARD_LAYERNORM).unwrap();
        assert_eq!((ln.work, ln.gflops()), (None, None));
        let table = b.to_table();
        assert!(table.contains("GFLOP/s     GB/s"), "{table}");
        let row = table.lines().find(|l| l.contains("qkv")).unwrap();
        assert!(row.ends_with("2000.0   1000.0"), "{table}");
        let v = b.to_json();
        let op = |name: &str| {
            v["ops"]
                .as_array()
                .unwrap()
                .iter()
                .find(|o| o["name"] == name)
                .cloned()
        };
        let qkv = op(FORWARD_ATTENTION_QKV).unwrap();
        assert_eq!(
            (qkv["gflops"].as_f64(), qkv["gbyte_per_step"].as_f64()),
            (Some(2000.0), Some(2.0))
        );
        assert!(op(FORWARD_LAYERNORM).unwrap().get("gflops").is_none());
        assert!(qkv["roof_pct"].is_null(), "no roofs set: {qkv}");
        assert!(!table.contains("roof"), "{table}");
    }

    #[test]
    fn roof_percent_is_against_the_nearer_roof() {
        let row = |flops: f64, bytes: f64| BreakdownRow {
            name: "x".into(),
            ms_per_step: 1.0,
            pct_of_step: 0.0,
            depth: 0,
            timed: true,
            min_max: None,
            work: Some(Work { flops, bytes }),
        };
        let roofs = Roofs {
            gflops: Some(1000.0),
            gbs: Some(100.0),
        };
        // Ridge point at 10 FLOP/byte. A GEMM at 20 FLOP/byte running 500 GFLOP/s (25 GB/s):
        // the roofline allows min(1000, 20 x 100) = 1000, so 50%.
        assert_eq!(row(0.5e9, 0.025e9).roof_pct(&roofs), Some(50.0));
        // A row op at 0.25 FLOP/byte moving 80 GB/s: min(1000, 25) = 25 GFLOP/s allowed, it
        // does 20, 80%; with no FLOPs it is the bandwidth alone.
        assert_eq!(row(0.02e9, 0.08e9).roof_pct(&roofs), Some(80.0));
        assert_eq!(row(0.0, 0.08e9).roof_pct(&roofs), Some(80.0));
        // An unknown roof drops its term; no roofs or no work, no percent.
        let bw_only = Roofs {
            gflops: None,
            gbs: Some(100.0),
        };
        assert_eq!(row(0.5e9, 0.025e9).roof_pct(&bw_only), Some(25.0));
        assert_eq!(row(0.5e9, 0.025e9).roof_pct(&Roofs::default()), None);
        let mut untimed = row(1.0, 1.0);
        untimed.work = None;
        assert_eq!(untimed.roof_pct(&roofs), None);

        // The table says the roofs and adds the column; the JSON carries both.
        let clock = TickClock::default();
        let t = Timers::new(TimerLevel::Fine);
        t.set_device_clock(Box::new(clock));
        drop(
            t.scope(FORWARD_LAYERNORM, TimerLevel::Fine)
                .with_work(|| Work {
                    flops: 0.0,
                    bytes: 0.05e9,
                }),
        );
        drop(t.scope(FORWARD_MLP_MM, TimerLevel::Fine));
        t.take_step();
        let mut b = t.breakdown(10.0, 1, OPS);
        b.set_roofs(roofs);
        let table = b.to_table();
        assert!(
            table.contains("roofs: peak 1000.0 GFLOP/s, memory 100.0 GB/s"),
            "{table}"
        );
        assert!(table.contains("GB/s  roof%"), "{table}");
        let ln = table.lines().find(|l| l.contains("layernorm")).unwrap();
        assert!(ln.ends_with("50.0   50.0"), "{table}");
        let mm = table
            .lines()
            .find(|l| l.trim_start().starts_with("mm"))
            .unwrap();
        assert!(mm.trim_end().ends_with('%'), "no rates, no roof: {table}");
        let v = b.to_json();
        assert_eq!(v["roofs"]["gbs"].as_f64(), Some(100.0));
        let op = v["ops"]
            .as_array()
            .unwrap()
            .iter()
            .find(|o| o["name"] == FORWARD_LAYERNORM)
            .unwrap();
        assert_eq!(op["roof_pct"].as_f64(), Some(50.0));
    }

    #[test]
    fn table_and_json() {
        let b = sample();
        let table = b.to_table();
        assert!(
            table.contains("over 2 steps (mean step 100.0 ms)"),
            "{table}"
        );
        assert!(table.contains("\n    qkv "), "{table}");
        assert!(table.contains("GEMM 52.0%"), "{table}");
        let lines: Vec<&str> = table.lines().skip(1).collect();
        // Aligned: every row has the same length.
        let widths: std::collections::BTreeSet<usize> = lines
            .iter()
            .filter(|l| !l.starts_with("GEMM"))
            .map(|l| l.len())
            .collect();
        assert_eq!(widths.len(), 1, "{table}");

        let dir = std::env::temp_dir().join(format!("fugu-bd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("breakdown.json");
        b.write_json(&p).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(v["steps"], 2);
        assert_eq!(v["step_ms"], 100.0);
        assert_eq!(v["ops"][0]["name"], "backward");
        assert_eq!(v["ops"][0]["pct"], 50.0);
        assert_eq!(v["ops"].as_array().unwrap().len(), b.rows.len());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

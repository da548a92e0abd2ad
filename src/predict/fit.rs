//! Fitting a profile's traffic-class links to measured multi-node runs (`fugu predict profile
//! --fit RUNS.toml --fit-params dp.inter.beta_gbs,...`).
//!
//! A one-node profile cannot know how a framework's collectives behave at scale; a few
//! measured multi-node runs can say it. Each run in the file is a layout and its measured
//! TFLOP/s per node (or ms per step); the runs marked `fit = true` choose the values of the
//! named parameters, the others are predicted with them as out-of-sample checks. The fit
//! minimises the sum of squared log ratios (predicted over measured), by coordinate search in
//! log space (each parameter over ×/÷ 1000 of its start, then narrower rounds around the best):
//! a handful of parameters and runs, each prediction milliseconds.
//!
//! ```toml
//! [[run]]                           # a fugu run: layout and step time from its directory
//! run = "runs/gpt2-124m-n8-tp1"
//! fit = true
//!
//! [[run]]                           # or given by numbers (published runs)
//! name = "124M DP, 512 nodes"
//! config = "gpt2-124m"
//! nodes = 512
//! ranks_per_node = 1
//! threads = 48
//! batch = 1024
//! micro_batch_size = 1
//! compute_tflops_per_node = 1.09   # optional: this model's one-node rate (rate profiles)
//! tflops_per_node = 0.16           # measured (or step_ms)
//! fit = true
//! source = "..."
//! ```

use super::network::{ClassLinks, Link, Network, Traffic};
use super::profile::read_run_shape;
use super::step::{predict, Compute, Layout, Machine, Prediction, Workload};
use crate::config::RunConfig;
use crate::model::acts::Recompute;
use crate::model::stage::Stage;
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// A runs file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Runs {
    pub run: Vec<MeasuredRun>,
}

/// One measured run: its layout and what it achieved, given as numbers or read from a `fugu
/// train` run directory (`run = "DIR"`: its header's model, layout, batch and micro-batches,
/// and its median step time; stages split as the trainer splits them).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredRun {
    #[serde(default)]
    pub name: String,
    /// A `fugu train` run directory (or its metrics.jsonl), relative to the runs file.
    #[serde(default)]
    pub run: Option<PathBuf>,
    #[serde(default)]
    pub config: String,
    #[serde(default)]
    pub nodes: usize,
    #[serde(default)]
    pub ranks_per_node: usize,
    #[serde(default)]
    pub threads: usize,
    #[serde(default = "one")]
    pub tp: usize,
    #[serde(default = "one")]
    pub pp: usize,
    #[serde(default)]
    pub zero: bool,
    /// Global batch (sequences per step).
    #[serde(default)]
    pub batch: usize,
    #[serde(default)]
    pub seq_len: Option<usize>,
    #[serde(default)]
    pub micro_batch_size: usize,
    #[serde(default)]
    pub recompute: Option<String>,
    /// Blocks per pipeline stage, as the run had them (`--pp-layers`); default: balanced.
    #[serde(default)]
    pub pp_layers: Option<Vec<usize>>,
    /// This model's compute rate (model TFLOP/s per node), replacing the profile's compute.
    #[serde(default)]
    pub compute_tflops_per_node: Option<f64>,
    /// Measured: model TFLOP/s per node, or ms per step.
    #[serde(default)]
    pub tflops_per_node: Option<f64>,
    #[serde(default)]
    pub step_ms: Option<f64>,
    /// Used to fit (true) or only predicted (false: out of sample).
    #[serde(default)]
    pub fit: bool,
    #[serde(default)]
    pub source: String,
    /// The model: `config` loaded, or the run directory's (set by [`Runs::parse`]).
    #[serde(skip)]
    pub model: Option<ModelConfig>,
}

fn one() -> usize {
    1
}

impl Runs {
    /// Reads and checks a runs file, naming the file and the run in errors.
    pub fn load(path: &Path) -> Result<Runs> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the runs file {}", path.display()))?;
        Runs::parse(&text, path)
    }

    /// Parses and checks the text of the runs file `path` (run directories are relative to
    /// its folder), naming the file and the run in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Runs> {
        let mut runs: Runs =
            toml::from_str(text).with_context(|| format!("in the runs file {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        for (i, r) in runs.run.iter_mut().enumerate() {
            let what = || format!("in the runs file {}, run[{i}]", path.display());
            match r.run.clone() {
                Some(dir) => r.read_from(&base.join(dir)).with_context(what)?,
                // The model once here, not at every prediction of the fit.
                None if !r.config.is_empty() => {
                    let cfg = RunConfig::load(&r.config).with_context(what)?;
                    r.seq_len.get_or_insert(cfg.train.seq_len);
                    r.model = Some(cfg.model);
                }
                None => {}
            }
        }
        for (i, r) in runs.run.iter().enumerate() {
            r.check().with_context(|| {
                format!("in the runs file {}, run[{i}] `{}`", path.display(), r.name)
            })?;
        }
        if runs.run.is_empty() {
            bail!("the runs file {} lists no [[run]]", path.display());
        }
        Ok(runs)
    }
}

impl MeasuredRun {
    /// Fills the layout and the measured step time in from a run directory: the fields a
    /// runs file gave besides `run`, `fit`, `name`, `source` and `compute_tflops_per_node` are
    /// an error (the run says them).
    fn read_from(&mut self, dir: &Path) -> Result<()> {
        let given = MeasuredRun {
            run: self.run.clone(),
            name: self.name.clone(),
            fit: self.fit,
            source: self.source.clone(),
            compute_tflops_per_node: self.compute_tflops_per_node,
            ..Default::default()
        };
        let layout_given = !self.config.is_empty()
            || self.nodes != 0
            || self.ranks_per_node != 0
            || self.threads != 0
            || self.tp != 1
            || self.pp != 1
            || self.zero
            || self.batch != 0
            || self.micro_batch_size != 0
            || self.seq_len.is_some()
            || self.pp_layers.is_some()
            || self.tflops_per_node.is_some()
            || self.step_ms.is_some();
        if layout_given {
            bail!(
                "`run = \"{}\"` reads the layout and the step time from the run: leave out config, \
                 nodes, ranks_per_node, threads, tp, pp, zero, batch, seq_len, micro_batch_size, \
                 pp_layers, tflops_per_node and step_ms",
                dir.display()
            );
        }
        let name = if self.name.is_empty() {
            dir.file_name()
                .map_or_else(|| dir.display().to_string(), |f| f.to_string_lossy().into())
        } else {
            self.name.clone()
        };
        let (metrics, r, model, batch, seq) = read_run_shape(dir, &name)?;
        if r.step_ms.is_nan() || r.step_ms <= 0.0 {
            bail!(
                "{}: no measured steps (after the warm-up)",
                metrics.display()
            );
        }
        let l = &r.layout;
        let pp = (l.world / (l.tp * l.dp).max(1)).max(1) as usize;
        let micro = r.micro_batches.max(1);
        let stages = Stage::split(&model, pp, seq as usize)?;
        *self = MeasuredRun {
            name,
            config: r.config_name.clone(),
            nodes: l.nodes as usize,
            ranks_per_node: l.ranks_per_node as usize,
            threads: l.threads as usize,
            tp: l.tp as usize,
            pp,
            zero: l.zero > 0,
            batch: (batch * l.dp) as usize,
            seq_len: Some(seq as usize),
            micro_batch_size: (batch / micro) as usize,
            recompute: None,
            pp_layers: (pp > 1).then(|| Stage::counts(&stages)),
            step_ms: Some(r.step_ms),
            model: Some(model),
            ..given
        };
        Ok(())
    }

    fn check(&self) -> Result<()> {
        if self.model.is_none() {
            bail!("config: missing (a model config name or file), or give run = \"DIR\"");
        }
        for (what, v) in [
            ("nodes", self.nodes),
            ("ranks_per_node", self.ranks_per_node),
            ("threads", self.threads),
            ("tp", self.tp),
            ("pp", self.pp),
            ("batch", self.batch),
            ("micro_batch_size", self.micro_batch_size),
        ] {
            if v == 0 {
                bail!("{what} = 0: expected at least 1");
            }
        }
        let positive = |what: &str, v: Option<f64>| match v {
            Some(v) if !(v > 0.0 && v.is_finite()) => {
                bail!("{what} = {v}: expected a positive number")
            }
            _ => Ok(()),
        };
        positive("compute_tflops_per_node", self.compute_tflops_per_node)?;
        positive("tflops_per_node", self.tflops_per_node)?;
        positive("step_ms", self.step_ms)?;
        if self.tflops_per_node.is_some() == self.step_ms.is_some() {
            bail!("give the measured tflops_per_node or step_ms (one of them)");
        }
        self.recompute()?;
        Ok(())
    }

    fn recompute(&self) -> Result<Recompute> {
        let Some(name) = self.recompute.as_deref() else {
            return Ok(Recompute::None);
        };
        Recompute::ALL
            .into_iter()
            .find(|r| r.name() == name)
            .with_context(|| format!("recompute = \"{name}\": expected none, attention or full"))
    }

    /// The run's prediction on `machine` with `network`.
    pub fn predict(&self, machine: &Machine, network: &Network) -> Result<Prediction> {
        let model = self
            .model
            .clone()
            .context("checked: every run has its model")?;
        let w = Workload {
            seq_len: self.seq_len.unwrap_or(model.n_positions),
            model,
            global_batch: self.batch,
            recompute: self.recompute()?,
            loss_chunk: None,
            // The published runs, and the ones `fugu train` records, are fitted in f32.
            precision: Default::default(),
            pp_layers: self.pp_layers.clone(),
        };
        let (Some(world), Some(mp)) = (
            self.nodes.checked_mul(self.ranks_per_node),
            self.tp.checked_mul(self.pp),
        ) else {
            bail!(
                "too many ranks to count: {} nodes x {} ranks, tp {} x pp {}",
                self.nodes,
                self.ranks_per_node,
                self.tp,
                self.pp
            );
        };
        if !world.is_multiple_of(mp) {
            bail!(
                "{world} ranks are not a multiple of tp {} x pp {}",
                self.tp,
                self.pp
            );
        }
        let dp = world / mp;
        let split = dp.checked_mul(self.micro_batch_size).unwrap_or(0);
        if split == 0 || !self.batch.is_multiple_of(split) {
            bail!(
                "the batch {} does not split into dp {dp} x micro-batch size {}",
                self.batch,
                self.micro_batch_size
            );
        }
        let l = Layout {
            nodes: self.nodes,
            ranks_per_node: self.ranks_per_node,
            threads_per_rank: self.threads,
            tp: self.tp,
            pp: self.pp,
            dp,
            zero: self.zero,
            micro_batches: self.batch / (dp * self.micro_batch_size),
        };
        let mut m = machine.clone();
        m.network = *network;
        if let Some(r) = self.compute_tflops_per_node {
            m.compute = Compute::Rate {
                model_tflops_per_node: r,
            };
        }
        predict(&w, &l, &m)
    }

    /// Predicted over measured (TFLOP/s per node, or the inverse ratio of step times).
    fn ratio(&self, p: &Prediction) -> f64 {
        match (self.tflops_per_node, self.step_ms) {
            (Some(tf), _) => p.tflops_per_node / tf,
            (None, Some(ms)) => ms / p.step_ms,
            (None, None) => unreachable!("checked"),
        }
    }
}

/// A fitted parameter: a traffic class's link value (`dp.inter.beta_gbs`) or reduction rate
/// (`dp.reduce_gbs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Param {
    pub class: Traffic,
    pub field: Field,
}

/// What a [`Param`] sets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Field {
    Alpha { inter: bool },
    Beta { inter: bool },
    Reduce,
}

impl Param {
    /// Parses `CLASS.LEVEL.alpha_us|beta_gbs` or `CLASS.reduce_gbs`.
    pub fn parse(s: &str) -> Result<Param> {
        let parts: Vec<&str> = s.split('.').collect();
        let expected = "expected CLASS.intra|inter.alpha_us|beta_gbs or CLASS.reduce_gbs, CLASS \
                        one of tp, pp, dp (e.g. dp.inter.beta_gbs)";
        let class = Traffic::ALL
            .into_iter()
            .find(|c| Some(&c.name()) == parts.first())
            .with_context(|| format!("--fit-params {s}: {expected}"))?;
        let field = match parts[1..] {
            ["reduce_gbs"] => Field::Reduce,
            [level @ ("intra" | "inter"), "alpha_us"] => Field::Alpha {
                inter: level == "inter",
            },
            [level @ ("intra" | "inter"), "beta_gbs"] => Field::Beta {
                inter: level == "inter",
            },
            _ => bail!("--fit-params {s}: {expected}"),
        };
        Ok(Param { class, field })
    }

    /// Its name, as parsed.
    pub fn name(&self) -> String {
        let level = |inter: bool| if inter { "inter" } else { "intra" };
        match self.field {
            Field::Alpha { inter } => format!("{}.{}.alpha_us", self.class.name(), level(inter)),
            Field::Beta { inter } => format!("{}.{}.beta_gbs", self.class.name(), level(inter)),
            Field::Reduce => format!("{}.reduce_gbs", self.class.name()),
        }
    }

    /// Its value in `net` (the class's own, else the network's; a free reduction starts the
    /// search at 100 GB/s).
    pub fn get(&self, net: &Network) -> f64 {
        let eff = net.class(self.class);
        match self.field {
            Field::Alpha { inter } => level(&eff, inter).alpha_us,
            Field::Beta { inter } => level(&eff, inter).beta_gbs,
            Field::Reduce => eff.reduce_gbs.unwrap_or(100.0),
        }
    }

    /// Sets it in the class's own links (a link not yet the class's own starts as the
    /// network's).
    pub fn set(&self, net: &mut Network, v: f64) {
        let eff = net.class(self.class);
        let own: &mut ClassLinks = net.links_mut(self.class);
        match self.field {
            Field::Alpha { inter } | Field::Beta { inter } => {
                let slot = if inter {
                    &mut own.inter
                } else {
                    &mut own.intra
                };
                let link = slot.get_or_insert(*level(&eff, inter));
                if matches!(self.field, Field::Alpha { .. }) {
                    link.alpha_us = v;
                } else {
                    link.beta_gbs = v;
                }
            }
            Field::Reduce => own.reduce_gbs = Some(v),
        }
    }
}

fn level(n: &Network, inter: bool) -> &Link {
    if inter {
        &n.inter
    } else {
        &n.intra
    }
}

/// One run's predictions before and after the fit.
#[derive(Clone, Debug)]
pub struct Residual {
    pub name: String,
    pub fit: bool,
    /// The measured figure, and the predicted one before and after (TF/node or ms per step,
    /// whichever the run gives).
    pub measured: f64,
    pub before: f64,
    pub after: f64,
    pub unit: &'static str,
}

impl Residual {
    /// (after − measured) / measured, as a signed fraction of the measured figure.
    pub fn error(&self) -> f64 {
        (self.after - self.measured) / self.measured
    }
}

/// The fit: the network with the parameters set, and every run's residual.
#[derive(Clone, Debug)]
pub struct Fitted {
    pub network: Network,
    pub values: Vec<(Param, f64)>,
    pub residuals: Vec<Residual>,
}

/// Fits `params` of `machine`'s network to the runs marked `fit` (module docs); with no
/// parameters, only predicts every run.
pub fn fit(machine: &Machine, runs: &Runs, params: &[Param]) -> Result<Fitted> {
    let fitting: Vec<&MeasuredRun> = runs.run.iter().filter(|r| r.fit).collect();
    if !params.is_empty() && fitting.is_empty() {
        bail!("no run is marked `fit = true`: nothing to fit the parameters to");
    }
    let loss = |net: &Network| -> Result<f64> {
        let mut sum = 0.0;
        for r in &fitting {
            let p = r
                .predict(machine, net)
                .with_context(|| format!("run `{}`", r.name))?;
            sum += r.ratio(&p).ln().powi(2);
        }
        Ok(sum)
    };
    let mut net = machine.network;
    for p in params {
        let v = p.get(&net);
        p.set(&mut net, v);
    }
    let mut best = loss(&net)?;
    // Each parameter over ×/÷ `span` of its value in 40 log steps, the span narrowing.
    for span in [1000.0f64, 30.0, 3.0, 1.3, 1.05] {
        for p in params {
            let centre = p.get(&net);
            for i in 0..=40 {
                let v = centre * span.powf(i as f64 / 20.0 - 1.0);
                let mut trial = net;
                p.set(&mut trial, v);
                let l = loss(&trial)?;
                if l < best {
                    (best, net) = (l, trial);
                }
            }
        }
    }
    let mut residuals = Vec::new();
    for r in &runs.run {
        let figure = |net: &Network| -> Result<f64> {
            let p = r
                .predict(machine, net)
                .with_context(|| format!("run `{}`", r.name))?;
            Ok(match r.tflops_per_node {
                Some(_) => p.tflops_per_node,
                None => p.step_ms,
            })
        };
        residuals.push(Residual {
            name: r.name.clone(),
            fit: r.fit,
            measured: r.tflops_per_node.or(r.step_ms).expect("checked"),
            before: figure(&machine.network)?,
            after: figure(&net)?,
            unit: if r.tflops_per_node.is_some() {
                "TF/node"
            } else {
                "ms/step"
            },
        });
    }
    Ok(Fitted {
        network: net,
        values: params.iter().map(|p| (*p, p.get(&net))).collect(),
        residuals,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_parse_and_name_themselves() {
        for s in ["dp.inter.beta_gbs", "tp.intra.alpha_us", "pp.reduce_gbs"] {
            assert_eq!(Param::parse(s).unwrap().name(), s);
        }
        for bad in ["dp", "xx.inter.beta_gbs", "dp.inter", "dp.inter.gamma"] {
            let e = Param::parse(bad).unwrap_err().to_string();
            assert!(e.contains("expected CLASS"), "{e}");
        }
    }

    #[test]
    fn setting_a_class_value_leaves_the_others_on_the_network() {
        let mut net: Network = toml::from_str(
            "intra = { alpha_us = 0.5, beta_gbs = 20.0 }\ninter = { alpha_us = 1.0, beta_gbs = 6.8 }",
        )
        .unwrap();
        Param::parse("dp.inter.beta_gbs")
            .unwrap()
            .set(&mut net, 0.5);
        let dp = net.class(Traffic::Dp);
        assert_eq!(
            dp.inter,
            Link {
                alpha_us: 1.0,
                beta_gbs: 0.5
            }
        );
        assert_eq!(dp.intra, net.intra);
        assert_eq!(net.class(Traffic::Tp).inter.beta_gbs, 6.8);
        assert_eq!(net.dp.intra, None);
    }
}

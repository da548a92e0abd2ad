//! Predictions in the report: `fugu predict --format json` documents drawn in the report's
//! style (model TFLOP/s per node and step time against node count, the predicted per-op
//! breakdown with the same categories as runs), with the measured runs of the report overlaid.

use super::breakdown::{Category, OpBreakdown};
use super::charts::{self, Axis, BarChart, Line, LineChart, LineStyle, Stack};
use super::runs::Run;
use super::sections::{chart, pal, table, Section};
use super::table::{Cell, Table};
use crate::metrics::prediction::Prediction;
use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// One `fugu predict --format json` document.
#[derive(Clone, Debug, Deserialize)]
pub struct PredictionFile {
    pub profile: String,
    pub estimate: bool,
    pub config: String,
    pub seq_len: usize,
    pub global_batch: usize,
    pub predictions: Vec<Prediction>,
    #[serde(skip)]
    pub source: String,
}

impl PredictionFile {
    fn label(&self) -> String {
        let l = self.predictions.first().map(|p| &p.layout);
        format!(
            "{} tp {} pp {} on {}{}",
            self.config,
            l.map_or(1, |l| l.tp),
            l.map_or(1, |l| l.pp),
            self.profile,
            if self.estimate { " (estimate)" } else { "" }
        )
    }
}

/// Whether the text is a `fugu predict --format json` document.
pub fn looks_like_prediction(text: &str) -> bool {
    serde_json::from_str::<Value>(text.trim())
        .ok()
        .is_some_and(|v| {
            v.get("predictions").is_some_and(Value::is_array) && v.get("profile").is_some()
        })
}

/// Reads a document, naming the file and what is wrong in errors.
pub fn read_prediction(path: &Path) -> Result<PredictionFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut f: PredictionFile = serde_json::from_str(text.trim())
        .map_err(|e| anyhow!("not a `fugu predict --format json` document: {e}"))
        .with_context(|| format!("in {}", path.display()))?;
    if f.predictions.is_empty() {
        bail!("{}: no predictions", path.display());
    }
    f.source = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok(f)
}

/// Model TFLOP/s per node of a measured run (per process × ranks per node).
fn run_tflops_per_node(r: &Run) -> f64 {
    r.tflops_per_process * r.layout.world as f64 / r.layout.nodes.max(1) as f64
}

/// The section: TF/node and step time against nodes (measured runs as grey points), the
/// predicted breakdown per node count, and a table.
pub fn prediction_section(files: &[PredictionFile], runs: &[Run]) -> Result<Section> {
    let mut items = Vec::new();
    for (y_desc, file, alt, get, measured) in [
        (
            "model TFLOP/s per node",
            "predict-tflops.svg",
            "Predicted TFLOP/s per node",
            (|p: &Prediction| p.tflops_per_node) as fn(&Prediction) -> f64,
            run_tflops_per_node as fn(&Run) -> f64,
        ),
        (
            "ms per step",
            "predict-step.svg",
            "Predicted step time",
            |p: &Prediction| p.step_ms,
            |r: &Run| r.step_ms,
        ),
    ] {
        let mut lines: Vec<Line> = files
            .iter()
            .enumerate()
            .map(|(i, f)| Line {
                label: f.label(),
                color: pal(i),
                style: LineStyle::Markers,
                points: f
                    .predictions
                    .iter()
                    .map(|p| (p.layout.nodes as f64, get(p)))
                    .collect(),
            })
            .collect();
        let pts: Vec<(f64, f64)> = runs
            .iter()
            .map(|r| (r.layout.nodes as f64, measured(r)))
            .filter(|p| p.1 > 0.0)
            .collect();
        if !pts.is_empty() {
            lines.push(Line {
                label: "measured runs".into(),
                color: (0x77, 0x77, 0x77),
                style: LineStyle::Points,
                points: pts,
            });
        }
        let svg = charts::line_chart(&LineChart {
            title: alt.to_string(),
            x: Axis::log("nodes", 2.0),
            y: if file == "predict-step.svg" {
                Axis::log(y_desc, 10.0)
            } else {
                Axis::linear(y_desc, true)
            },
            lines,
            legend_notes: vec!["grey: measured runs in this report".into()],
        })?;
        items.push(chart(
            file,
            svg,
            alt,
            "One line per `fugu predict` file against node count (log scale); grey points are \
             the measured runs given to the report, at their node counts. A flat TFLOP/s line is \
             perfect weak or strong scaling of the model's work per node.",
        ));
    }
    // The predicted breakdowns, one bar per file and node count.
    let mut bars = Vec::new();
    let mut sublabels = Vec::new();
    let mut cats = Vec::new();
    let mut annotations = Vec::new();
    for f in files {
        for p in &f.predictions {
            let b = OpBreakdown::new(&p.timers_ms, &BTreeMap::new(), &BTreeMap::new(), p.step_ms);
            bars.push(format!(
                "{} node{}",
                p.layout.nodes,
                if p.layout.nodes == 1 { "" } else { "s" }
            ));
            sublabels.push(format!(
                "{} tp{} pp{} dp{}",
                f.config, p.layout.tp, p.layout.pp, p.layout.dp
            ));
            // Percent: node counts differ by orders of magnitude in step time.
            let total: f64 = b.by_category.iter().sum::<f64>().max(1e-12);
            cats.push(b.by_category.map(|v| 100.0 * v / total));
            annotations.push(format!("{:.3} s", p.step_ms / 1e3));
        }
    }
    let used: Vec<usize> = (0..Category::ALL.len())
        .filter(|&i| cats.iter().any(|c| c[i] > 0.0))
        .collect();
    let svg = charts::bar_chart(&BarChart {
        title: "Predicted per-op breakdown: share of the step".into(),
        x_desc: "prediction (file order, then nodes)".into(),
        y_desc: "% of step time".into(),
        bars,
        sublabels,
        stacks: used
            .iter()
            .map(|&i| Stack {
                label: Category::ALL[i].label().to_owned(),
                color: Category::ALL[i].color(),
                values: cats.iter().map(|c| c[i]).collect(),
            })
            .collect(),
        annotations,
        legend: true,
    })?;
    items.push(chart(
        "predict-breakdown.svg",
        svg,
        "Predicted per-op breakdown",
        "Each bar is one predicted step, split into the same categories as the measured runs' \
         breakdown (the predicted timers carry the runs' names); the number above is the step \
         time. A growing communication or bubble band is where scaling is lost.",
    ));
    let mut t = Table::new(
        "predict",
        &[
            "file", "config", "profile", "nodes", "ranks", "tp", "pp", "dp", "step ms", "tokens/s",
            "TF/node", "% peak", "GiB/rank", "fits",
        ],
    );
    for f in files {
        for p in &f.predictions {
            let l = &p.layout;
            t.push(vec![
                Cell::text(&f.source),
                Cell::text(&f.config),
                Cell::text(&f.profile),
                Cell::int(l.nodes),
                Cell::int(l.nodes * l.ranks_per_node),
                Cell::int(l.tp),
                Cell::int(l.pp),
                Cell::int(l.dp),
                Cell::num(p.step_ms, 1),
                Cell::num(p.tokens_per_s, 0),
                Cell::num(p.tflops_per_node, 3),
                Cell::num(p.peak_pct, 1),
                Cell::num(p.memory_gib_per_rank, 2),
                Cell::text(if p.fits { "yes" } else { "no" }),
            ]);
        }
    }
    items.push(table(
        t,
        "Every predicted node count (`fugu predict`; estimates where the profile says so).",
    ));
    Ok(Section {
        title: "Predictions".into(),
        items,
    })
}

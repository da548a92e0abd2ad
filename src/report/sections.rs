//! The report's sections: for each topic, the tables and charts built from the runs and the
//! GEMM rows, with a line on how to read each. [`super::markdown`] writes them out.

use super::breakdown::{Category, OpBreakdown};
use super::charts::{self, Axis, BarChart, Line, LineChart, LineStyle, Rgb, Stack};
use super::gemm::GemmRow;
use super::inputs::Skipped;
use super::runs::{median, Run, Step};
use super::scaling::{find_series, Kind, ScalingInput, Series};
use super::table::{Cell, Table};
use anyhow::Result;
use std::collections::{BTreeMap, BTreeSet};

/// One element of a section.
#[derive(Clone, Debug)]
pub enum Item {
    /// A paragraph of Markdown.
    Text(String),
    /// An SVG chart written to `file`.
    Chart {
        file: String,
        svg: String,
        alt: String,
        how_to_read: String,
    },
    /// A table, written as CSV and shown in Markdown (as `markdown` when given, e.g. a
    /// pivoted view of a long CSV).
    Table {
        table: Table,
        caption: String,
        markdown: Option<String>,
    },
}

/// A `##` section of REPORT.md.
#[derive(Clone, Debug)]
pub struct Section {
    pub title: String,
    pub items: Vec<Item>,
}

/// Series colours (Tableau 10 without grey).
pub const PALETTE: [Rgb; 9] = [
    (0x4e, 0x79, 0xa7),
    (0xf2, 0x8e, 0x2b),
    (0xe1, 0x57, 0x59),
    (0x59, 0xa1, 0x4f),
    (0xb0, 0x7a, 0xa1),
    (0x76, 0xb7, 0xb2),
    (0xed, 0xc9, 0x48),
    (0xff, 0x9d, 0xa7),
    (0x9c, 0x75, 0x5f),
];
const GREY: Rgb = (0x77, 0x77, 0x77);

pub(crate) fn pal(i: usize) -> Rgb {
    PALETTE[i % PALETTE.len()]
}

pub(crate) fn chart(file: &str, svg: String, alt: &str, how: &str) -> Item {
    Item::Chart {
        file: file.to_owned(),
        svg,
        alt: alt.to_owned(),
        how_to_read: how.to_owned(),
    }
}

pub(crate) fn table(t: Table, caption: &str) -> Item {
    Item::Table {
        table: t,
        caption: caption.to_owned(),
        markdown: None,
    }
}

/// `4 ranks, 2 nodes` (and `tp 2` when tensor-parallel): the second line of a bar label.
fn layout_label(r: &Run) -> String {
    let l = &r.layout;
    let mut s = format!(
        "{} rank{}, {} node{}",
        l.world,
        if l.world == 1 { "" } else { "s" },
        l.nodes,
        if l.nodes == 1 { "" } else { "s" }
    );
    if l.tp > 1 {
        s.push_str(&format!(", tp {}", l.tp));
    }
    s
}

fn opt_u(v: Option<u64>) -> Cell {
    v.map_or(Cell::Empty, Cell::int)
}

/// The runs and their layout, batch and median throughput.
pub fn runs_section(runs: &[Run]) -> Section {
    let mut t = Table::new(
        "runs",
        &[
            "run",
            "config",
            "parameters (M)",
            "ranks",
            "nodes",
            "ranks/node",
            "threads/rank",
            "tp",
            "dp",
            "ZeRO",
            "precision",
            "micro-batches",
            "batch/rank",
            "global batch",
            "seq len",
            "steps used",
            "warm-up steps",
            "step ms",
            "tokens/s",
            "comm MB/step",
            "CPU",
        ],
    );
    for r in runs {
        let l = &r.layout;
        t.push(vec![
            Cell::text(&r.name),
            Cell::text(&r.config_name),
            Cell::opt(r.parameters.map(|p| p as f64 / 1e6), 2),
            Cell::int(l.world),
            Cell::int(l.nodes),
            Cell::int(l.ranks_per_node),
            Cell::int(l.threads),
            Cell::int(l.tp),
            Cell::int(l.dp),
            Cell::int(l.zero),
            Cell::text(&r.precision),
            Cell::int(r.micro_batches),
            opt_u(r.batch_size),
            opt_u(r.global_batch()),
            opt_u(r.seq_len),
            Cell::int(r.measured_steps()),
            Cell::int(r.warmup_steps()),
            Cell::num(r.step_ms, 1),
            Cell::num(r.tokens_per_s, 0),
            Cell::opt(r.comm_bytes.map(|b| b / 1e6), 2),
            Cell::text(&r.machine.cpu_model),
        ]);
    }
    Section {
        title: "Runs".into(),
        items: vec![table(
            t,
            "One row per run, ordered by nodes, then ranks. Batches are in sequences; \
             global batch = batch/rank × dp. Step ms, tokens/s (whole job) and comm MB/step \
             (bytes one rank communicated per step) are medians over the steps used.",
        )],
    }
}

/// Validation loss against step for every run that evaluated, and each run's largest relative
/// deviation from a reference run with the same evaluation steps (the first fp32 run, else the
/// first run): how precision, parallel layout or kernel changes move the curve. In bits per
/// byte of text when every run recorded it (comparable across tokenizers), else in nats per
/// token, compared only between runs of one vocabulary. `None` when no run has evaluations.
pub fn loss_section(runs: &[Run]) -> Result<Option<Section>> {
    let with: Vec<&Run> = runs.iter().filter(|r| !r.evals.is_empty()).collect();
    if with.is_empty() {
        return Ok(None);
    }
    let bpb = with.iter().all(|r| r.evals_bpb.len() == r.evals.len());
    let series = |r: &Run| -> Vec<(u64, f64)> {
        if bpb {
            r.evals_bpb.clone()
        } else {
            r.evals.clone()
        }
    };
    let unit = if bpb {
        "bits per byte"
    } else {
        "nats per token"
    };
    let vocab = |r: &Run| r.model.as_ref().map(|m| m.vocab_size);
    let steps_of = |r: &Run| series(r).iter().map(|e| e.0).collect::<Vec<_>>();
    let reference = with
        .iter()
        .find(|r| r.precision == "fp32")
        .unwrap_or(&with[0]);
    let svg = per_run_chart(
        &with,
        format!("Validation loss ({unit})"),
        &format!("validation loss ({unit})"),
        LineStyle::Markers,
        &|r| series(r).iter().map(|&(s, l)| (s as f64, l)).collect(),
    )?;
    let mut t = Table::new(
        "loss",
        &[
            "run",
            "precision",
            "evaluations",
            &format!("first val loss ({unit})"),
            &format!("last val loss ({unit})"),
            "max |Δ| vs reference (%)",
        ],
    );
    for r in &with {
        let comparable =
            steps_of(r) == steps_of(reference) && (bpb || vocab(r) == vocab(reference));
        let (mine, theirs) = (series(r), series(reference));
        let dev = comparable.then(|| {
            mine.iter()
                .zip(&theirs)
                .map(|(a, b)| 100.0 * ((a.1 - b.1) / b.1).abs())
                .fold(0.0f64, f64::max)
        });
        t.push(vec![
            Cell::text(&r.name),
            Cell::text(&r.precision),
            Cell::int(mine.len()),
            Cell::num(mine[0].1, 4),
            Cell::num(mine[mine.len() - 1].1, 4),
            Cell::opt(dev, 3),
        ]);
    }
    let basis = if bpb {
        "Losses are in bits per byte of validation text (loss / ln 2 × tokens / text bytes), \
         comparable between tokenizers."
    } else {
        "Losses are in nats per token (not every run recorded bits per byte), compared only \
         between runs of one vocabulary size."
    };
    Ok(Some(Section {
        title: "Loss curves".into(),
        items: vec![
            chart(
                "loss.svg",
                svg,
                &format!("validation loss ({unit}) against step, one line per run"),
                "One line per run that evaluated (`eval_every`); lower is better. Runs of the \
                 same model and data should overlay; a gap is what a change of precision or \
                 layout costs.",
            ),
            table(
                t,
                &format!(
                    "Reference: {} ({}). The deviation is the largest relative difference of \
                     validation loss at the same step; empty when a run evaluated at other \
                     steps or cannot be compared. {basis}",
                    reference.name, reference.precision
                ),
            ),
        ],
    }))
}

/// A chart of one line per run (labelled with its name and precision) against step.
fn per_run_chart(
    runs: &[&Run],
    title: String,
    y: &str,
    style: LineStyle,
    points: &dyn Fn(&Run) -> Vec<(f64, f64)>,
) -> Result<String> {
    let lines = runs
        .iter()
        .enumerate()
        .map(|(i, r)| Line {
            label: format!("{} ({})", r.name, r.precision),
            color: pal(i),
            style,
            points: points(r),
        })
        .collect();
    charts::line_chart(&LineChart {
        title,
        x: Axis::linear("step", true),
        y: Axis::linear(y, false),
        lines,
        legend_notes: vec![],
    })
}

/// Training loss and learning rate against step, one line per run (every logged step).
pub fn training_section(runs: &[Run]) -> Result<Option<Section>> {
    let with: Vec<&Run> = runs.iter().filter(|r| !r.steps.is_empty()).collect();
    if with.is_empty() {
        return Ok(None);
    }
    let bpb = with
        .iter()
        .all(|r| r.steps.iter().all(|s| s.rec.bpb.is_some()));
    let unit = if bpb {
        "bits per byte"
    } else {
        "nats per token"
    };
    let chart_of = |title: String, y: &str, value: &dyn Fn(&Step) -> f64| {
        per_run_chart(&with, title, y, LineStyle::Solid, &|r| {
            r.steps
                .iter()
                .map(|s| (s.rec.step as f64, value(s)))
                .filter(|p| p.1.is_finite())
                .collect()
        })
    };
    let loss = chart_of(
        format!("Training loss ({unit})"),
        &format!("training loss ({unit})"),
        &|s| {
            if bpb {
                s.rec.bpb.unwrap_or(f64::NAN)
            } else {
                s.rec.loss
            }
        },
    )?;
    let lr = chart_of("Learning rate".into(), "learning rate", &|s| s.rec.lr)?;
    Ok(Some(Section {
        title: "Training curves".into(),
        items: vec![
            chart(
                "train-loss.svg",
                loss,
                &format!("training loss ({unit}) against step, one line per run"),
                "Each logged step's loss on its own batch (noisier than the validation loss).",
            ),
            chart(
                "lr.svg",
                lr,
                "learning rate against step, one line per run",
                "The schedule each step used (warmup, then cosine or constant).",
            ),
        ],
    }))
}

/// Per-op breakdown: stacked bars of ms per step by category, the same as % of the step, a
/// category table and a per-timer table with min/max across ranks.
pub fn breakdown_section(runs: &[Run]) -> Result<Section> {
    let mut items = Vec::new();
    let with: Vec<(&Run, OpBreakdown)> = runs
        .iter()
        .filter(|r| !r.timers.mean.is_empty())
        .map(|r| {
            (
                r,
                OpBreakdown::new(
                    &r.timers.mean,
                    &r.timers.min,
                    &r.timers.max,
                    r.timers.step_ms,
                ),
            )
        })
        .collect();
    if with.is_empty() {
        items.push(Item::Text(
            "No run recorded per-op timers (train with `--timers coarse` or `--timers fine`)."
                .into(),
        ));
        return Ok(Section {
            title: "Per-op breakdown".into(),
            items,
        });
    }
    let without: Vec<&str> = runs
        .iter()
        .filter(|r| r.timers.mean.is_empty())
        .map(|r| r.name.as_str())
        .collect();
    if !without.is_empty() {
        items.push(Item::Text(format!(
            "Without per-op timers (not in the breakdown): {}.",
            without
                .iter()
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    // Categories that occur at all, bottom of the bar first.
    let used: Vec<usize> = (0..Category::ALL.len())
        .filter(|&i| with.iter().any(|(_, b)| b.by_category[i] > 0.0))
        .collect();
    let bars: Vec<String> = with.iter().map(|(r, _)| r.name.clone()).collect();
    let sublabels: Vec<String> = with.iter().map(|(r, _)| layout_label(r)).collect();
    let stacks = |pct: bool| -> Vec<Stack> {
        used.iter()
            .map(|&i| Stack {
                label: Category::ALL[i].label().to_owned(),
                color: Category::ALL[i].color(),
                values: with
                    .iter()
                    .map(|(_, b)| {
                        let v = b.by_category[i];
                        if pct {
                            100.0 * v / b.by_category.iter().sum::<f64>().max(1e-12)
                        } else {
                            v
                        }
                    })
                    .collect(),
            })
            .collect()
    };
    let svg = charts::bar_chart(&BarChart {
        title: "Per-op breakdown: time per training step".into(),
        x_desc: "run (ordered by nodes, then ranks)".into(),
        y_desc: "ms per step (mean)".into(),
        bars: bars.clone(),
        sublabels: sublabels.clone(),
        stacks: stacks(false),
        annotations: with
            .iter()
            .map(|(_, b)| format!("{:.1} ms", b.step_ms))
            .collect(),
        legend: true,
    })?;
    items.push(chart(
        "breakdown.svg",
        svg,
        "Per-op breakdown, ms per step",
        "Each bar is one run's mean step, split into what its timers measured (leaf timers \
         only: a parent's own time is counted once, as \"other forward/backward\"). \
         Lower is faster; a growing red band is communication.",
    ));
    let svg = charts::bar_chart(&BarChart {
        title: "Per-op breakdown: share of the step".into(),
        x_desc: "run (ordered by nodes, then ranks)".into(),
        y_desc: "% of step time".into(),
        bars,
        sublabels,
        stacks: stacks(true),
        annotations: Vec::new(),
        legend: true,
    })?;
    items.push(chart(
        "breakdown-pct.svg",
        svg,
        "Per-op breakdown, % of step",
        "The same bars normalised to 100%: where each run spends its step, whatever its speed.",
    ));

    let mut cols = vec!["run", "ranks", "nodes", "steps averaged", "step ms"];
    cols.extend(Category::ALL.iter().map(|c| c.key()));
    let mut t = Table::new("breakdown", &cols);
    for (r, b) in &with {
        let mut row = vec![
            Cell::text(&r.name),
            Cell::int(r.layout.world),
            Cell::int(r.layout.nodes),
            Cell::int(r.timers.steps),
            Cell::num(b.step_ms, 2),
        ];
        row.extend(b.by_category.iter().map(|v| Cell::num(*v, 2)));
        t.push(row);
    }
    items.push(table(
        t,
        "Mean ms per step by category (the bars above). Steps right after an evaluation or a \
         checkpoint are not averaged (older runs recorded that time into the next step's \
         timers).",
    ));

    // Per timer: long CSV, pivoted Markdown.
    let mut t = Table::new(
        "breakdown-timers",
        &[
            "run",
            "timer",
            "category",
            "ms_per_step",
            "min_ms",
            "max_ms",
            "pct_of_step",
        ],
    );
    let mut leaf_max: BTreeMap<String, (Category, f64)> = BTreeMap::new();
    for (r, b) in &with {
        for l in &b.leaves {
            t.push(vec![
                Cell::text(&r.name),
                Cell::text(&l.name),
                Cell::text(l.category.label()),
                Cell::num(l.ms, 3),
                Cell::opt(l.min_ms, 3),
                Cell::opt(l.max_ms, 3),
                Cell::num(l.pct_of_step, 2),
            ]);
            let e = leaf_max.entry(l.name.clone()).or_insert((l.category, 0.0));
            e.1 = e.1.max(l.ms);
        }
    }
    let mut names: Vec<(&String, &(Category, f64))> = leaf_max.iter().collect();
    names.sort_by(|a, b| a.1 .0.cmp(&b.1 .0).then(b.1 .1.total_cmp(&a.1 .1)));
    let mut cols: Vec<&str> = vec!["timer", "category"];
    cols.extend(with.iter().map(|(r, _)| r.name.as_str()));
    let mut pivot = Table::new("breakdown-timers", &cols);
    for (name, (cat, _)) in names {
        let mut row = vec![Cell::text(name), Cell::text(cat.label())];
        for (_, b) in &with {
            row.push(match b.leaves.iter().find(|l| &l.name == name) {
                None => Cell::Empty,
                Some(l) => Cell::text(match (l.min_ms, l.max_ms) {
                    (Some(lo), Some(hi)) => format!("{:.2} ({lo:.2}–{hi:.2})", l.ms),
                    _ => format!("{:.2}", l.ms),
                }),
            });
        }
        pivot.push(row);
    }
    let any_minmax = with
        .iter()
        .any(|(_, b)| b.leaves.iter().any(|l| l.max_ms.is_some()));
    items.push(Item::Table {
        table: t,
        caption: format!(
            "Mean ms per step of every leaf timer, per run{}. `P:(other)` is the part of timer P \
             not covered by its children; `(other)` is the part of the step no timer covers. \
             The CSV has one row per run and timer.",
            if any_minmax {
                ", with the min–max across ranks in parentheses where the run recorded them"
            } else {
                ""
            }
        ),
        markdown: Some(pivot.to_markdown()),
    });
    Ok(Section {
        title: "Per-op breakdown".into(),
        items,
    })
}

/// Strong and weak scaling: throughput and speedup charts, and the efficiency table.
pub fn scaling_section(runs: &[Run]) -> Result<Section> {
    let inputs: Vec<Option<ScalingInput>> = runs
        .iter()
        .map(|r| {
            Some(ScalingInput {
                model_key: r.model_key()?,
                global_batch: r.global_batch()?,
                world: r.layout.world,
                threads: r.layout.threads,
                nodes: r.layout.nodes,
                tp: r.layout.tp,
                tokens_per_s: r.tokens_per_s,
            })
        })
        .collect();
    // find_series wants a dense slice; keep the run index beside it.
    let (idx, dense): (Vec<usize>, Vec<ScalingInput>) = inputs
        .into_iter()
        .enumerate()
        .filter_map(|(i, x)| Some((i, x?)))
        .unzip();
    let series: Vec<Series> = find_series(&dense)
        .into_iter()
        .map(|mut s| {
            for p in &mut s.points {
                p.run = idx[p.run];
            }
            s
        })
        .collect();
    let mut items = Vec::new();
    if series.is_empty() {
        items.push(Item::Text(
            "No scaling series: that needs runs of the same model and sequence length at two or \
             more rank counts, with the same global batch (strong scaling) or the same work per \
             rank (weak scaling)."
                .into(),
        ));
        return Ok(Section {
            title: "Scaling".into(),
            items,
        });
    }
    let multi_model = series
        .iter()
        .map(|s| &s.model_key)
        .collect::<BTreeSet<_>>()
        .len()
        > 1;
    let label = |s: &Series| {
        if multi_model {
            format!("{} — {}", s.label(), s.model_key)
        } else {
            s.label()
        }
    };
    let worlds: BTreeSet<u64> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.cores))
        .collect();
    let xticks: Vec<f64> = if worlds.len() <= 10 {
        worlds.iter().map(|&w| w as f64).collect()
    } else {
        charts::log_ticks(
            *worlds.first().unwrap_or(&1) as f64,
            *worlds.last().unwrap_or(&1) as f64,
            2.0,
        )
    };
    let xaxis =
        || Axis::log("cores (MPI ranks × threads per rank)", 2.0).with_ticks(xticks.clone());

    let mut lines = Vec::new();
    for (i, s) in series.iter().enumerate() {
        lines.push(Line {
            label: label(s),
            color: pal(i),
            style: LineStyle::Markers,
            points: s
                .points
                .iter()
                .map(|p| (p.cores as f64, p.tokens_per_s))
                .collect(),
        });
        let base = s.points[0].tokens_per_s / s.points[0].speedup;
        lines.push(Line {
            label: String::new(),
            color: pal(i),
            style: LineStyle::Dashed,
            points: s
                .points
                .iter()
                .map(|p| (p.cores as f64, base * p.ideal))
                .collect(),
        });
    }
    let svg = charts::line_chart(&LineChart {
        title: "Scaling: training throughput".into(),
        x: xaxis(),
        y: Axis::log("tokens/s (whole job, median)", 10.0),
        lines,
        legend_notes: vec!["dashed: ideal (baseline × core ratio)".into()],
    })?;
    items.push(chart(
        "scaling-throughput.svg",
        svg,
        "Throughput against cores",
        "Tokens per second of the whole job against cores (ranks × threads per rank), both axes \
         logarithmic. Each \
         series' dashed line is perfect scaling from its smallest run; the gap is lost efficiency.",
    ));

    let mut lines = Vec::new();
    for (i, s) in series.iter().enumerate() {
        lines.push(Line {
            label: label(s),
            color: pal(i),
            style: LineStyle::Markers,
            points: s
                .points
                .iter()
                .map(|p| (p.cores as f64, p.speedup))
                .collect(),
        });
    }
    let bases: BTreeSet<u64> = series.iter().map(|s| s.base_cores()).collect();
    for b in &bases {
        let pts: Vec<(f64, f64)> = worlds
            .iter()
            .filter(|&&w| w >= *b)
            .map(|&w| (w as f64, w as f64 / *b as f64))
            .collect();
        lines.push(Line {
            label: if bases.len() == 1 {
                "ideal".into()
            } else {
                format!("ideal from {b} cores")
            },
            color: GREY,
            style: LineStyle::Dashed,
            points: pts,
        });
    }
    let svg = charts::line_chart(&LineChart {
        title: "Scaling: speedup against ideal".into(),
        x: xaxis(),
        y: Axis::log("speedup (× baseline throughput)", 2.0),
        lines,
        legend_notes: Vec::new(),
    })?;
    items.push(chart(
        "scaling-speedup.svg",
        svg,
        "Speedup against ideal",
        "Throughput relative to each series' best run at its smallest core count, against cores \
         (ranks × threads per rank: two ranks of one thread use the machine of one rank with two). \
         On the dashed line, doubling the cores doubles the throughput; parallel efficiency is \
         the ratio of the two (table below).",
    ));

    let mut t = Table::new(
        "scaling",
        &[
            "series",
            "kind",
            "model",
            "run",
            "ranks",
            "cores",
            "nodes",
            "global batch",
            "tokens/s",
            "speedup",
            "ideal",
            "efficiency %",
        ],
    );
    for s in &series {
        for p in &s.points {
            let r = &runs[p.run];
            t.push(vec![
                Cell::text(s.label()),
                Cell::text(s.kind.name()),
                Cell::text(&s.model_key),
                Cell::text(&r.name),
                Cell::int(p.world),
                Cell::int(p.cores),
                Cell::int(p.nodes),
                opt_u(r.global_batch()),
                Cell::num(p.tokens_per_s, 0),
                Cell::num(p.speedup, 2),
                Cell::num(p.ideal, 2),
                Cell::num(100.0 * p.efficiency, 1),
            ]);
        }
    }
    let kinds: BTreeSet<Kind> = series.iter().map(|s| s.kind).collect();
    items.push(table(
        t,
        &format!(
            "Parallel efficiency = speedup / ideal. {}",
            [
                kinds.contains(&Kind::Strong).then_some(
                    "Strong scaling: the same global batch spread over more cores (ideal: step time falls with the core ratio)."
                ),
                kinds.contains(&Kind::Weak).then_some(
                    "Weak scaling: the same work per rank and threads per rank, so the global batch grows with the ranks (ideal: constant step time)."
                ),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(" ")
        ),
    ));
    Ok(Section {
        title: "Scaling".into(),
        items,
    })
}

/// Model TFLOP/s per process and % of the FP32 peak.
pub fn efficiency_section(runs: &[Run]) -> Result<Section> {
    let mut items = Vec::new();
    let svg = charts::bar_chart(&BarChart {
        title: "Model TFLOP/s per process".into(),
        x_desc: "run (ordered by nodes, then ranks)".into(),
        y_desc: "TFLOP/s per process (median)".into(),
        bars: runs.iter().map(|r| r.name.clone()).collect(),
        sublabels: runs.iter().map(layout_label).collect(),
        stacks: vec![Stack {
            label: "TFLOP/s per process".into(),
            color: PALETTE[0],
            values: runs.iter().map(|r| r.tflops_per_process).collect(),
        }],
        annotations: runs
            .iter()
            .map(|r| {
                if r.peak_pct.is_finite() {
                    format!("{:.1}% of peak", r.peak_pct)
                } else {
                    String::new()
                }
            })
            .collect(),
        legend: false,
    })?;
    items.push(chart(
        "tflops.svg",
        svg,
        "TFLOP/s per process",
        "Model FLOPs (Megatron formula) per second per MPI process; the label is the share of \
         the process's FP32 peak. Flat bars across a strong-scaling sweep mean perfect scaling.",
    ));
    let mut t = Table::new(
        "efficiency",
        &[
            "run",
            "ranks",
            "nodes",
            "threads/rank",
            "TFLOP/s per process",
            "TFLOP/s job",
            "peak GFLOP/s per process",
            "% of peak",
            "peak source",
            "ISA",
        ],
    );
    for r in runs {
        t.push(vec![
            Cell::text(&r.name),
            Cell::int(r.layout.world),
            Cell::int(r.layout.nodes),
            Cell::int(r.layout.threads),
            Cell::num(r.tflops_per_process, 4),
            Cell::num(r.tflops_per_process * r.layout.world as f64, 4),
            Cell::opt(r.machine.peak_gflops, 1),
            Cell::num(r.peak_pct, 2),
            Cell::text(&r.machine.peak_source),
            Cell::text(&r.machine.isa),
        ]);
    }
    items.push(table(
        t,
        "Medians over the steps used. TFLOP/s job = per process × ranks. The peak is the one \
         `fugu bench gemm` reports (measured FMA loop per core × threads, or given).",
    ));
    Ok(Section {
        title: "Compute efficiency".into(),
        items,
    })
}

/// Ops per run in the Markdown view of the roofline table (the CSV has them all).
const ROOFLINE_TOP: usize = 10;

/// Each op's rates against its roofline, per run with fine timers: where a step's time could
/// still go, the largest headroom (time above the roof) first.
pub fn roofline_section(runs: &[Run]) -> Section {
    let title = "Per-op rates and rooflines".to_string();
    let with: Vec<&Run> = runs.iter().filter(|r| !r.rates.ops.is_empty()).collect();
    if with.is_empty() {
        return Section {
            title,
            items: vec![Item::Text(
                "No run recorded per-op rates (`breakdown.json` of a run with `--timers fine`, \
                 the default; runs from before the rates have none)."
                    .into(),
            )],
        };
    }
    let columns = [
        "run",
        "op",
        "ms/step",
        "% of step",
        "GFLOP/s",
        "GB/s",
        "roof %",
        "headroom ms/step",
    ];
    let mut all = Table::new("roofline", &columns);
    let mut top = Table::new("roofline", &columns);
    let mut roofs = Vec::new();
    for r in &with {
        let mut ops: Vec<_> = r.rates.ops.iter().collect();
        // Largest headroom first; ops without a roof after, by time.
        ops.sort_by(|a, b| {
            let key = |o: &super::runs::OpRate| (o.headroom_ms().unwrap_or(-1.0), o.ms_per_step);
            key(b)
                .partial_cmp(&key(a))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        for (i, o) in ops.iter().enumerate() {
            let row = vec![
                Cell::text(&r.name),
                Cell::text(&o.name),
                Cell::num(o.ms_per_step, 3),
                Cell::num(o.pct_of_step, 1),
                Cell::opt(o.gflops, 1),
                Cell::opt(o.gbs, 1),
                Cell::opt(o.roof_pct, 1),
                Cell::opt(o.headroom_ms(), 3),
            ];
            if i < ROOFLINE_TOP {
                top.push(row.clone());
            }
            all.push(row);
        }
        roofs.push(format!("`{}`: {}", r.name, r.rates.roofs.describe()));
    }
    let caption = format!(
        "Each op that declared its work (FLOPs and compulsory bytes, `src/model/work.rs`): its \
         rates over the run's steps and its roof %, the larger of GFLOP/s over the peak and GB/s \
         over the memory bandwidth (its rate over the most its FLOPs per byte allow). Headroom \
         is the time per step it would save at its roof, ms/step × (1 − roof %/100): the ops \
         worth working on first. Above 100%, an op ran from the caches. The {ROOFLINE_TOP} \
         largest per run are shown; the CSV has every op. Roofs per process: {}.",
        roofs.join("; ")
    );
    Section {
        title,
        items: vec![Item::Table {
            markdown: Some(top.to_markdown()),
            table: all,
            caption,
        }],
    }
}

/// A GEMM series: one ISA (and domain count, and file when needed) at one thread count.
struct GemmSeries<'a> {
    label: String,
    threads: u64,
    rows: Vec<&'a GemmRow>,
}

fn gemm_series(rows: &[GemmRow]) -> Vec<GemmSeries<'_>> {
    // Does an (isa, threads, domains) key appear in several files?
    let mut files: BTreeMap<(String, u64, Option<u64>), BTreeSet<&str>> = BTreeMap::new();
    let mut domains: BTreeMap<(String, u64), BTreeSet<Option<u64>>> = BTreeMap::new();
    for r in rows {
        files
            .entry((r.isa.clone(), r.threads, r.domains))
            .or_default()
            .insert(&r.source);
        domains
            .entry((r.isa.clone(), r.threads))
            .or_default()
            .insert(r.domains);
    }
    let mut by: BTreeMap<(u64, String, Option<u64>, String), Vec<&GemmRow>> = BTreeMap::new();
    for r in rows {
        let split_file = files[&(r.isa.clone(), r.threads, r.domains)].len() > 1;
        by.entry((
            r.threads,
            r.isa.clone(),
            r.domains,
            if split_file {
                r.source.clone()
            } else {
                String::new()
            },
        ))
        .or_default()
        .push(r);
    }
    by.into_iter()
        .map(|((threads, isa, dom, file), rows)| {
            let mut label = format!(
                "{isa}, {threads} thread{}",
                if threads == 1 { "" } else { "s" }
            );
            if domains[&(isa.clone(), threads)].len() > 1 {
                if let Some(d) = dom {
                    label.push_str(&format!(", {d} domain{}", if d == 1 { "" } else { "s" }));
                }
            }
            if !file.is_empty() {
                label.push_str(&format!(" ({file})"));
            }
            GemmSeries {
                label,
                threads,
                rows,
            }
        })
        .collect()
}

fn sorted_points(rows: &[&GemmRow], f: impl Fn(&GemmRow) -> Option<f64>) -> Vec<(f64, f64)> {
    let mut p: Vec<(f64, f64)> = rows
        .iter()
        .filter_map(|r| Some((r.size(), f(r)?)))
        .collect();
    p.sort_by(|a, b| a.0.total_cmp(&b.0));
    p
}

/// A series' measurements: square shapes (m = n = k, batch 1) as a line with markers, the
/// others as points of the same colour (labelled only when there is no line). The flag says
/// whether both kinds were drawn.
fn measured_lines(
    label: &str,
    color: Rgb,
    rows: &[&GemmRow],
    f: impl Fn(&GemmRow) -> Option<f64>,
) -> (Vec<Line>, bool) {
    let (sq, other): (Vec<&GemmRow>, Vec<&GemmRow>) = rows
        .iter()
        .partition(|r| r.m == r.n && r.n == r.k && r.batch == 1);
    let mut v = Vec::new();
    if !sq.is_empty() {
        v.push(Line {
            label: label.to_owned(),
            color,
            style: LineStyle::Markers,
            points: sorted_points(&sq, &f),
        });
    }
    if !other.is_empty() {
        v.push(Line {
            label: if sq.is_empty() {
                label.to_owned()
            } else {
                String::new()
            },
            color,
            style: LineStyle::Points,
            points: sorted_points(&other, &f),
        });
    }
    (v, !sq.is_empty() && !other.is_empty())
}

/// The x range of a horizontal reference line over data from `lo` to `hi` on a log axis: the
/// data's range, widened when it is a single point (a zero-length line draws nothing).
fn line_span(lo: f64, hi: f64) -> (f64, f64) {
    if hi > lo {
        (lo, hi)
    } else {
        (lo / 1.5, hi * 1.5)
    }
}

/// GEMM benchmark charts (GFLOP/s against size per thread count, % of peak for all) and
/// tables.
pub fn gemm_section(rows: &[GemmRow]) -> Result<Section> {
    let mut items = Vec::new();
    let series = gemm_series(rows);
    let x_desc = "GEMM size (m·n·k)^(1/3)";
    let threads: BTreeSet<u64> = series.iter().map(|s| s.threads).collect();
    let mixed_note = "unconnected points: non-square or batched shapes".to_owned();
    for &t in &threads {
        let mut lines = Vec::new();
        let mut mixed = false;
        for (i, s) in series.iter().enumerate().filter(|(_, s)| s.threads == t) {
            let pts = sorted_points(&s.rows, |r| Some(r.gflops));
            let peak = median(s.rows.iter().filter_map(|r| r.peak()));
            let (xlo, xhi) = line_span(
                pts.first().map_or(1.0, |p| p.0),
                pts.last().map_or(1.0, |p| p.0),
            );
            let (l, m) = measured_lines(&s.label, pal(i), &s.rows, |r| Some(r.gflops));
            lines.extend(l);
            mixed |= m;
            let base = sorted_points(&s.rows, |r| r.baseline_gflops);
            if !base.is_empty() {
                let name = s
                    .rows
                    .iter()
                    .find_map(|r| r.baseline.clone())
                    .unwrap_or_else(|| "baseline".into());
                lines.push(Line {
                    label: format!(
                        "{name}, {} thread{} (baseline)",
                        s.threads,
                        if s.threads == 1 { "" } else { "s" }
                    ),
                    color: GREY,
                    style: LineStyle::Points,
                    points: base,
                });
            }
            if peak.is_finite() {
                lines.push(Line {
                    label: format!("peak, {}: {} GFLOP/s", s.label, charts::fmt_tick(peak)),
                    color: pal(i),
                    style: LineStyle::Dashed,
                    points: vec![(xlo, peak), (xhi, peak)],
                });
            }
        }
        let svg = charts::line_chart(&LineChart {
            title: format!(
                "GEMM throughput, {t} thread{}",
                if t == 1 { "" } else { "s" }
            ),
            x: Axis::log(x_desc, 2.0),
            y: Axis::linear("GFLOP/s (FP32, median)", true),
            lines,
            legend_notes: if mixed {
                vec![mixed_note.clone()]
            } else {
                Vec::new()
            },
        })?;
        items.push(chart(
            &format!("gemm-{t}t.svg"),
            svg,
            &format!("GEMM GFLOP/s, {t} thread{}", if t == 1 { "" } else { "s" }),
            "fugu-gemm GFLOP/s against problem size (cube root of m·n·k, log scale) per ISA; \
             the dashed line is the FP32 peak of those threads, grey points the baseline library \
             on the same shapes. Points close to the dashed line are near peak.",
        ));
    }
    if threads.len() > 1 || series.len() > 1 {
        let mut lines = Vec::new();
        let mut mixed = false;
        for (i, s) in series.iter().enumerate() {
            let (l, m) = measured_lines(&s.label, pal(i), &s.rows, |r| r.pct_of_peak());
            lines.extend(l);
            mixed |= m;
        }
        let all = sorted_points(&rows.iter().collect::<Vec<_>>(), |r| r.pct_of_peak());
        if let (Some(a), Some(b)) = (all.first(), all.last()) {
            let (xlo, xhi) = line_span(a.0, b.0);
            lines.push(Line {
                label: "peak (100%)".into(),
                color: GREY,
                style: LineStyle::Dashed,
                points: vec![(xlo, 100.0), (xhi, 100.0)],
            });
        }
        let svg = charts::line_chart(&LineChart {
            title: "GEMM efficiency: % of FP32 peak".into(),
            x: Axis::log(x_desc, 2.0),
            y: Axis::linear("% of peak", true),
            lines,
            legend_notes: if mixed { vec![mixed_note] } else { Vec::new() },
        })?;
        items.push(chart(
            "gemm-peak-pct.svg",
            svg,
            "GEMM % of peak",
            "Every series on one scale: the share of its own threads' FP32 peak.",
        ));
    }

    let mut t = Table::new(
        "gemm-summary",
        &[
            "series",
            "threads",
            "rows",
            "peak GFLOP/s",
            "best GFLOP/s",
            "best shape",
            "best % of peak",
            "median % of peak",
            "median ratio to baseline",
        ],
    );
    for s in &series {
        let best = s
            .rows
            .iter()
            .max_by(|a, b| a.gflops.total_cmp(&b.gflops))
            .copied();
        let ratio = median(
            s.rows
                .iter()
                .filter_map(|r| r.baseline_gflops.map(|b| r.gflops / b)),
        );
        t.push(vec![
            Cell::text(&s.label),
            Cell::int(s.threads),
            Cell::int(s.rows.len()),
            Cell::num(median(s.rows.iter().filter_map(|r| r.peak())), 1),
            Cell::opt(best.map(|b| b.gflops), 1),
            Cell::text(best.map_or(String::new(), |b| {
                if b.name.is_empty() || b.name == b.shape() {
                    b.shape()
                } else {
                    format!("{} ({})", b.name, b.shape())
                }
            })),
            Cell::opt(best.and_then(|b| b.pct_of_peak()), 1),
            Cell::num(median(s.rows.iter().filter_map(|r| r.pct_of_peak())), 1),
            Cell::num(ratio, 2),
        ]);
    }
    items.push(table(
        t,
        "One row per ISA and thread count. The ratio is fugu-gemm over the baseline on the same shape.",
    ));
    let mut t = Table::new(
        "gemm",
        &[
            "file",
            "set",
            "name",
            "shape",
            "size",
            "isa",
            "threads",
            "GFLOP/s",
            "% of peak",
            "baseline GFLOP/s",
            "ratio",
        ],
    );
    for r in rows {
        t.push(vec![
            Cell::text(&r.source),
            Cell::text(&r.set),
            Cell::text(&r.name),
            Cell::text(r.shape()),
            Cell::num(r.size(), 0),
            Cell::text(&r.isa),
            Cell::int(r.threads),
            Cell::num(r.gflops, 1),
            Cell::opt(r.pct_of_peak(), 1),
            Cell::opt(r.baseline_gflops, 1),
            Cell::opt(r.baseline_gflops.map(|b| r.gflops / b), 2),
        ]);
    }
    items.push(table(t, "Every benchmark row."));
    Ok(Section {
        title: "GEMM benchmarks".into(),
        items,
    })
}

/// Notes on individual runs, if any.
pub fn notes_section(runs: &[Run]) -> Option<Section> {
    let mut lines = Vec::new();
    for r in runs {
        let mut notes = r.notes.clone();
        if r.timers.source != "metrics.jsonl" && !r.timers.source.is_empty() {
            notes.push(format!("timers from {}", r.timers.source));
        }
        for n in notes {
            lines.push(format!("- `{}`: {n}", r.name));
        }
    }
    (!lines.is_empty()).then(|| Section {
        title: "Notes".into(),
        items: vec![Item::Text(lines.join("\n"))],
    })
}

/// What was not used, and why.
pub fn skipped_section(skipped: &[Skipped]) -> Section {
    if skipped.is_empty() {
        return Section {
            title: "Skipped inputs".into(),
            items: vec![Item::Text("None: every input was used.".into())],
        };
    }
    let mut t = Table::new("skipped", &["input", "reason"]);
    for s in skipped {
        t.push(vec![Cell::text(&s.input), Cell::text(&s.reason)]);
    }
    Section {
        title: "Skipped inputs".into(),
        items: vec![table(
            t,
            "Inputs (or lines of inputs) the report could not use. A run with a cut-off last \
             line is still reported from its other lines.",
        )],
    }
}

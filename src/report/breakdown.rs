//! The per-op breakdown of a run: its timer means turned into non-overlapping leaves with
//! [`Breakdown::from_totals`] (a parent's own time is its `P:(other)` row, so parents and
//! children are never counted twice, and the step's untimed rest is `(other)`), and the leaves
//! grouped into a few [`Category`]s for the stacked bars.

use crate::metrics::ops::{class_of, OpClass};
use crate::metrics::timers::Breakdown;
use crate::model::registry;
use std::collections::BTreeMap;

/// What a leaf timer's time was spent on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Category {
    /// Linear layers: `qkv`, `proj`, `mlp:mm`, `lm-head` (forward and backward).
    Gemm,
    /// Attention scores, softmax and context (`baddbmm`, `softmax`, `bmm`, or `fused`).
    Attention,
    /// LayerNorm, GELU, residual adds, embedding, loss.
    Elementwise,
    /// Forward/backward time not covered by a finer timer (`forward:(other)`, ...).
    OtherCompute,
    /// All-reduces and other collectives, pipeline sends and receives.
    Communication,
    /// Pipeline stages waiting for a neighbour (`pipeline:bubble`).
    Bubble,
    Optimizer,
    /// Batch generation.
    Data,
    /// The rest of the step (untimed, or timers the report does not know).
    Other,
}

impl Category {
    /// Every category, bottom of the stacked bar first.
    pub const ALL: [Category; 9] = [
        Category::Gemm,
        Category::Attention,
        Category::Elementwise,
        Category::OtherCompute,
        Category::Communication,
        Category::Bubble,
        Category::Optimizer,
        Category::Data,
        Category::Other,
    ];

    /// Legend label.
    pub fn label(self) -> &'static str {
        match self {
            Category::Gemm => "GEMM (linear layers)",
            Category::Attention => "attention (scores, softmax, context)",
            Category::Elementwise => "norms, GELU, residual, embedding, loss",
            Category::OtherCompute => "other forward/backward",
            Category::Communication => "communication (all-reduce, send/recv)",
            Category::Bubble => "pipeline bubble (waiting)",
            Category::Optimizer => "optimizer",
            Category::Data => "data (batch generation)",
            Category::Other => "other (untimed)",
        }
    }

    /// CSV column name.
    pub fn key(self) -> &'static str {
        match self {
            Category::Gemm => "gemm_ms",
            Category::Attention => "attention_ms",
            Category::Elementwise => "elementwise_ms",
            Category::OtherCompute => "other_compute_ms",
            Category::Communication => "communication_ms",
            Category::Bubble => "bubble_ms",
            Category::Optimizer => "optimizer_ms",
            Category::Data => "data_ms",
            Category::Other => "other_ms",
        }
    }

    /// Fill colour (Tableau 10), `#rrggbb`.
    pub fn color(self) -> (u8, u8, u8) {
        match self {
            Category::Gemm => (0x4e, 0x79, 0xa7),
            Category::Attention => (0xf2, 0x8e, 0x2b),
            Category::Elementwise => (0x59, 0xa1, 0x4f),
            Category::OtherCompute => (0x76, 0xb7, 0xb2),
            Category::Communication => (0xe1, 0x57, 0x59),
            Category::Bubble => (0xff, 0x9d, 0xa7),
            Category::Optimizer => (0xb0, 0x7a, 0xa1),
            Category::Data => (0xed, 0xc9, 0x48),
            Category::Other => (0xba, 0xb0, 0xac),
        }
    }
}

impl Category {
    /// The category of an op of class `class`.
    pub fn of(class: OpClass) -> Category {
        use OpClass::*;
        match class {
            Gemm => Category::Gemm,
            AttentionMatmul | AttentionSoftmax | AttentionRecompute => Category::Attention,
            Norm | Activation | Embedding | Loss => Category::Elementwise,
            Communication => Category::Communication,
            Bubble => Category::Bubble,
            Recompute | Scope => Category::OtherCompute,
            Optimizer => Category::Optimizer,
            Data => Category::Data,
        }
    }
}

/// Words that name a collective, for timers no catalogue declares (runs of other versions).
const COMM_WORDS: &[&str] = &[
    "allreduce",
    "all-reduce",
    "all_reduce",
    "allgather",
    "all-gather",
    "reduce-scatter",
    "reduce_scatter",
    "reducescatter",
    "broadcast",
    "alltoall",
];

/// The category of a leaf of the timer tree (a timer name, or `P:(other)` / `(other)`): its
/// class in the op catalogues ([`registry::all_ops`]); a name none declares is communication
/// if it names a collective, other compute under `forward`/`backward`, and other otherwise.
pub fn categorize(name: &str) -> Category {
    if let Some(class) = class_of(&registry::all_ops(), name) {
        return Category::of(class);
    }
    let lower = name.to_ascii_lowercase();
    if COMM_WORDS.iter().any(|w| lower.contains(w)) {
        return Category::Communication;
    }
    match lower.split(':').next() {
        Some("forward" | "backward") => Category::OtherCompute,
        _ => Category::Other,
    }
}

fn hoist(name: &str) -> &str {
    if name.ends_with(":batch-generator") {
        "batch-generator"
    } else {
        name
    }
}

/// One leaf of a run's timer tree.
#[derive(Clone, Debug, PartialEq)]
pub struct Leaf {
    /// Timer name, or `P:(other)` for the part of timer `P` not covered by its children.
    pub name: String,
    pub category: Category,
    /// Mean ms per step.
    pub ms: f64,
    /// Mean over steps of the fastest rank's time (timed leaves of multi-rank runs).
    pub min_ms: Option<f64>,
    /// Mean over steps of the slowest rank's time.
    pub max_ms: Option<f64>,
    pub pct_of_step: f64,
}

/// A run's step split into leaves and categories.
#[derive(Clone, Debug, PartialEq)]
pub struct OpBreakdown {
    /// Mean step time, ms (the height of the stacked bar).
    pub step_ms: f64,
    pub leaves: Vec<Leaf>,
    /// ms per step of each category, in [`Category::ALL`] order.
    pub by_category: [f64; Category::ALL.len()],
}

impl OpBreakdown {
    /// Builds the leaves from timer means (`mean`, `min`, `max`: ms per step per name) and
    /// the mean step time.
    pub fn new(
        mean: &BTreeMap<String, f64>,
        min: &BTreeMap<String, f64>,
        max: &BTreeMap<String, f64>,
        step_ms: f64,
    ) -> OpBreakdown {
        // The trainer times `forward:batch-generator` before and outside `forward`: make it
        // top-level so that it is not subtracted from forward's own time.
        let mut hoisted: BTreeMap<String, f64> = BTreeMap::new();
        let mut original: BTreeMap<String, String> = BTreeMap::new();
        for (k, v) in mean {
            let h = hoist(k);
            *hoisted.entry(h.to_owned()).or_default() += v;
            if h != k {
                original.insert(h.to_owned(), k.clone());
            }
        }
        // from_totals divides by the step count; means are totals over one step.
        let b = Breakdown::from_totals(&hoisted, step_ms, 1, &registry::all_ops());
        let mut leaves = Vec::new();
        for (i, r) in b.rows.iter().enumerate() {
            let has_children = b.rows.get(i + 1).is_some_and(|n| n.depth > r.depth);
            if has_children {
                continue;
            }
            let name = original.get(&r.name).unwrap_or(&r.name);
            leaves.push(Leaf {
                name: name.clone(),
                category: categorize(name),
                ms: r.ms_per_step,
                min_ms: r.timed.then(|| min.get(name).copied()).flatten(),
                max_ms: r.timed.then(|| max.get(name).copied()).flatten(),
                pct_of_step: r.pct_of_step,
            });
        }
        let mut by_category = [0.0; Category::ALL.len()];
        for l in &leaves {
            let i = Category::ALL
                .iter()
                .position(|c| *c == l.category)
                .unwrap_or(Category::ALL.len() - 1);
            by_category[i] += l.ms;
        }
        OpBreakdown {
            step_ms: b.step_ms,
            leaves,
            by_category,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_part_of_an_op_keeps_the_op_category() {
        assert_eq!(categorize("forward:lm-head:(other)"), Category::Gemm);
        assert_eq!(
            categorize("backward:lm-head:allreduce"),
            Category::Communication
        );
        assert_eq!(categorize("forward:(other)"), Category::OtherCompute);
    }

    #[test]
    fn categories() {
        use Category::*;
        for (n, c) in [
            ("forward:attention:qkv", Gemm),
            ("backward:mlp:mm", Gemm),
            ("forward:lm-head", Gemm),
            ("forward:attention:softmax", Attention),
            ("backward:attention:baddbmm", Attention),
            ("backward:attention:fused", Attention),
            // A scope's own time: not attention's (the scope also holds its GEMMs).
            ("forward:attention:(other)", OtherCompute),
            ("backward:recompute", OtherCompute),
            ("backward:attention:recompute", Attention),
            ("forward:layernorm", Elementwise),
            ("backward:loss", Elementwise),
            ("forward:(other)", OtherCompute),
            ("backward:allreduce", Communication),
            ("forward:attention:allreduce", Communication),
            ("backward:mlp:allreduce", Communication),
            ("allreduce-params", Communication),
            ("pipeline:send", Communication),
            ("pipeline:recv", Communication),
            ("pipeline:tied-wte:allreduce", Communication),
            ("pipeline:bubble", Bubble),
            ("optimizer", Optimizer),
            ("optimizer:clip", Optimizer),
            ("optimizer:(other)", Optimizer),
            ("forward:batch-generator", Data),
            ("(other)", Other),
            ("something-new", Other),
        ] {
            assert_eq!(categorize(n), c, "{n}");
        }
    }

    #[test]
    fn leaves_partition_the_step_without_double_counting() {
        let m = |v: &[(&str, f64)]| -> BTreeMap<String, f64> {
            v.iter().map(|(k, x)| (k.to_string(), *x)).collect()
        };
        let mean = m(&[
            ("forward", 40.0),
            ("forward:attention:qkv", 10.0),
            ("forward:attention:allreduce", 5.0),
            ("forward:batch-generator", 2.0),
            ("backward", 45.0),
            ("backward:mlp:mm", 30.0),
            ("allreduce-params", 8.0),
            ("optimizer", 5.0),
        ]);
        let min = m(&[("allreduce-params", 6.0)]);
        let max = m(&[("allreduce-params", 11.0), ("forward", 44.0)]);
        let b = OpBreakdown::new(&mean, &min, &max, 100.0);
        let total: f64 = b.leaves.iter().map(|l| l.ms).sum();
        assert!((total - 100.0).abs() < 1e-9, "{b:?}");
        assert!((b.by_category.iter().sum::<f64>() - 100.0).abs() < 1e-9);
        assert!(
            !b.leaves.iter().any(|l| l.name == "forward"),
            "parents are not leaves"
        );
        let get = |n: &str| b.leaves.iter().find(|l| l.name == n).unwrap();
        // batch-generator is timed outside forward: not subtracted from forward's own time.
        assert_eq!(get("forward:(other)").ms, 25.0);
        assert_eq!(get("forward:batch-generator").ms, 2.0);
        assert_eq!(get("(other)").ms, 0.0);
        assert_eq!(get("allreduce-params").min_ms, Some(6.0));
        assert_eq!(get("allreduce-params").max_ms, Some(11.0));
        assert_eq!(get("forward:(other)").max_ms, None);
        let cat = |c: Category| b.by_category[Category::ALL.iter().position(|x| *x == c).unwrap()];
        assert_eq!(cat(Category::Gemm), 40.0);
        assert_eq!(cat(Category::Communication), 13.0);
        assert_eq!(cat(Category::Data), 2.0);
        assert_eq!(cat(Category::OtherCompute), 25.0 + 15.0);
        assert_eq!(cat(Category::Other), 0.0);
    }

    /// The rules `categorize` followed before the op catalogues (the last word of the name),
    /// kept to show that every declared name keeps its category.
    fn categorize_by_words(name: &str) -> Category {
        const GEMM_OPS: &[&str] = &["qkv", "proj", "mm", "lm-head", "fc", "linear"];
        const ATTENTION_OPS: &[&str] = &["baddbmm", "bmm", "softmax", "fused"];
        // The Llama family's row ops (`rmsnorm`, `rope` inside attention, `swiglu`) came after
        // the names went by their class: elementwise, as their classes say.
        const ELEMENTWISE_OPS: &[&str] = &[
            "layernorm",
            "gelu",
            "residual",
            "embedding",
            "loss",
            "rmsnorm",
            "rope",
            "swiglu",
        ];
        let lower = name.to_ascii_lowercase();
        let mut parts: Vec<&str> = lower.split(':').collect();
        if parts.len() > 2 && parts.last() == Some(&"(other)") {
            parts.pop();
        }
        let last = *parts.last().unwrap_or(&"");
        let top = parts[0];
        if top == "pipeline" {
            return if last == "bubble" {
                Category::Bubble
            } else {
                Category::Communication
            };
        }
        if parts
            .iter()
            .any(|p| COMM_WORDS.iter().any(|w| p.contains(w)))
        {
            return Category::Communication;
        }
        if parts.contains(&"batch-generator") {
            return Category::Data;
        }
        if top == "optimizer" {
            return Category::Optimizer;
        }
        if top == "forward" || top == "backward" {
            if GEMM_OPS.contains(&last) {
                return Category::Gemm;
            }
            if ELEMENTWISE_OPS.contains(&last) {
                return Category::Elementwise;
            }
            if ATTENTION_OPS.contains(&last) || parts.contains(&"attention") {
                return Category::Attention;
            }
            return Category::OtherCompute;
        }
        Category::Other
    }

    #[test]
    fn every_declared_op_keeps_the_category_its_name_gave_it() {
        // Scopes are not ops: their `(other)` time is other compute (the attention scope's was
        // called attention by its name); a decode step's attention was not named as one.
        let changed = [
            "forward:attention",
            "backward:attention",
            "forward:attention:decode",
        ];
        let mut checked = 0;
        for cat in registry::all_ops() {
            for op in cat.ops {
                for name in [op.name.to_string(), format!("{}:(other)", op.name)] {
                    if changed.contains(&op.name) {
                        continue;
                    }
                    assert_eq!(categorize(&name), categorize_by_words(&name), "{name}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 50, "{checked}");
        assert_eq!(categorize("forward:attention:decode"), Category::Attention);
    }
}

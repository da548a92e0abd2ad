//! Strong and weak scaling series from a set of runs.
//!
//! Runs of the same model (same model dimensions and sequence length) are grouped. Within a
//! group, runs with the same **global batch** (`batch_size × dp` sequences per step) at two or
//! more rank counts form a *strong* scaling series; runs with the same **work per rank**
//! (global batch / ranks, which is the per-rank batch for pure data parallelism and
//! `batch_size / tp` in general) at two or more rank counts form a *weak* series. A run can
//! belong to one series of each kind (a one-rank baseline usually does).
//!
//! The scaling axis is **cores** (ranks × compute threads per rank), not ranks: one rank with
//! 2 threads and two ranks with 1 thread each use the same machine, so the ideal speedup
//! between them is 1, not 2. Speedup is throughput (tokens/s) relative to the series' best run
//! at its smallest core count; the ideal is the core ratio; parallel efficiency is speedup /
//! ideal. For weak scaling (same threads per rank throughout a series) this equals the ratio of
//! step times, the usual definition.

use std::collections::BTreeMap;

/// Strong or weak scaling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    Strong,
    Weak,
}

impl Kind {
    /// `strong` or `weak`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Strong => "strong",
            Kind::Weak => "weak",
        }
    }
}

/// What scaling needs to know about one run.
#[derive(Clone, Debug, PartialEq)]
pub struct ScalingInput {
    /// Runs with equal keys are the same model ([`super::runs::Run::model_key`]).
    pub model_key: String,
    /// Sequences per step over the job.
    pub global_batch: u64,
    pub world: u64,
    /// Compute threads per rank.
    pub threads: u64,
    pub nodes: u64,
    pub tp: u64,
    pub tokens_per_s: f64,
}

impl ScalingInput {
    /// Ranks × threads per rank.
    pub fn cores(&self) -> u64 {
        self.world * self.threads.max(1)
    }
}

/// One run in a series.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// Index of the run in the input slice.
    pub run: usize,
    pub world: u64,
    /// Ranks × threads per rank: the scaling axis.
    pub cores: u64,
    pub nodes: u64,
    pub tokens_per_s: f64,
    /// Throughput relative to the series' baseline.
    pub speedup: f64,
    /// Core ratio to the baseline.
    pub ideal: f64,
    /// `speedup / ideal`.
    pub efficiency: f64,
}

/// A scaling series.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub kind: Kind,
    pub model_key: String,
    /// What is held constant, e.g. `global batch 8` or `4 sequences per rank`.
    pub constant: String,
    /// Ascending core count (ties: ascending ranks, nodes, then tp).
    pub points: Vec<Point>,
}

impl Series {
    /// A label for legends and tables: `strong, global batch 8`.
    pub fn label(&self) -> String {
        format!("{}, {}", self.kind.name(), self.constant)
    }

    /// Core count of the baseline.
    pub fn base_cores(&self) -> u64 {
        self.points.first().map_or(1, |p| p.cores)
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn fmt_ratio(num: u64, den: u64) -> String {
    if den == 1 {
        num.to_string()
    } else {
        let v = num as f64 / den as f64;
        format!("{v:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_owned()
    }
}

/// Finds every strong and weak series among `runs` (see the module docs). Runs with
/// non-finite throughput are left out.
pub fn find_series(runs: &[ScalingInput]) -> Vec<Series> {
    let mut by_model: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, r) in runs.iter().enumerate() {
        if r.tokens_per_s.is_finite() && r.tokens_per_s > 0.0 && r.world > 0 {
            by_model.entry(&r.model_key).or_default().push(i);
        }
    }
    let mut out = Vec::new();
    for (model, idx) in by_model {
        let mut strong: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        // Weak series also keep the threads per rank, so that the work per core is constant.
        let mut weak: BTreeMap<(u64, u64, u64), Vec<usize>> = BTreeMap::new();
        for &i in &idx {
            let r = &runs[i];
            strong.entry(r.global_batch).or_default().push(i);
            let g = gcd(r.global_batch, r.world).max(1);
            weak.entry((r.global_batch / g, r.world / g, r.threads))
                .or_default()
                .push(i);
        }
        for (gb, members) in strong {
            if let Some(s) = series(
                runs,
                Kind::Strong,
                model,
                format!("global batch {gb}"),
                members,
            ) {
                out.push(s);
            }
        }
        for ((num, den, _), members) in weak {
            let per = fmt_ratio(num, den);
            let unit = if num == den { "sequence" } else { "sequences" };
            if let Some(s) = series(
                runs,
                Kind::Weak,
                model,
                format!("{per} {unit} per rank"),
                members,
            ) {
                out.push(s);
            }
        }
    }
    out
}

fn series(
    runs: &[ScalingInput],
    kind: Kind,
    model: &str,
    constant: String,
    mut members: Vec<usize>,
) -> Option<Series> {
    members.sort_by_key(|&i| (runs[i].cores(), runs[i].world, runs[i].nodes, runs[i].tp, i));
    let first = runs[members[0]].cores();
    if members.iter().all(|&i| runs[i].cores() == first) {
        return None;
    }
    // Baseline: the best throughput at the smallest core count.
    let base = members
        .iter()
        .map(|&i| &runs[i])
        .filter(|r| r.cores() == first)
        .map(|r| r.tokens_per_s)
        .fold(f64::NEG_INFINITY, f64::max);
    let points = members
        .iter()
        .map(|&i| {
            let r = &runs[i];
            let speedup = r.tokens_per_s / base;
            let ideal = r.cores() as f64 / first as f64;
            Point {
                run: i,
                world: r.world,
                cores: r.cores(),
                nodes: r.nodes,
                tokens_per_s: r.tokens_per_s,
                speedup,
                ideal,
                efficiency: speedup / ideal,
            }
        })
        .collect();
    Some(Series {
        kind,
        model_key: model.to_owned(),
        constant,
        points,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(model: &str, batch: u64, tp: u64, dp: u64, nodes: u64, tps: f64) -> ScalingInput {
        ScalingInput {
            model_key: model.into(),
            global_batch: batch * dp,
            world: tp * dp,
            threads: 1,
            nodes,
            tp,
            tokens_per_s: tps,
        }
    }

    #[test]
    fn strong_series_from_constant_global_batch() {
        let runs = vec![
            run("m", 8, 1, 1, 1, 1000.0),
            run("m", 4, 1, 2, 1, 1800.0),
            run("m", 4, 2, 2, 2, 3000.0), // tp 2 x dp 2: global batch 8
        ];
        let s = find_series(&runs);
        assert_eq!(s.len(), 1, "{s:#?}");
        let s = &s[0];
        assert_eq!(s.kind, Kind::Strong);
        assert_eq!(s.label(), "strong, global batch 8");
        assert_eq!(
            s.points.iter().map(|p| p.world).collect::<Vec<_>>(),
            [1, 2, 4]
        );
        assert_eq!(s.points[1].speedup, 1.8);
        assert_eq!(s.points[1].ideal, 2.0);
        assert!((s.points[2].efficiency - 0.75).abs() < 1e-12);
    }

    #[test]
    fn the_axis_is_cores_so_equal_machines_scale_ideally_at_one() {
        // One rank × 2 threads, two ranks × 1 thread, four ranks × 1 thread: same global batch.
        let mut runs = vec![
            run("m", 8, 1, 1, 1, 1000.0),
            run("m", 4, 1, 2, 1, 1000.0),
            run("m", 2, 1, 4, 1, 1800.0),
        ];
        runs[0].threads = 2;
        let s = find_series(&runs);
        assert_eq!(s.len(), 1, "{s:#?}");
        let p = &s[0].points;
        assert_eq!(p.iter().map(|p| p.cores).collect::<Vec<_>>(), [2, 2, 4]);
        assert_eq!((p[1].ideal, p[1].efficiency), (1.0, 1.0));
        assert_eq!(p[2].ideal, 2.0);
        assert!((p[2].efficiency - 0.9).abs() < 1e-12);
    }

    #[test]
    fn weak_series_from_constant_batch_per_rank() {
        let runs = vec![
            run("m", 4, 1, 1, 1, 1000.0),
            run("m", 4, 1, 2, 1, 1900.0),
            run("m", 4, 1, 4, 1, 3600.0),
            run("other-model", 4, 1, 2, 1, 5.0),
        ];
        let s = find_series(&runs);
        assert_eq!(s.len(), 1, "{s:#?}");
        assert_eq!(s[0].kind, Kind::Weak);
        assert_eq!(s[0].label(), "weak, 4 sequences per rank");
        assert_eq!(s[0].points.len(), 3);
        assert!((s[0].points[2].efficiency - 0.9).abs() < 1e-12);
    }

    #[test]
    fn mixed_group_gives_both_and_a_shared_baseline() {
        let runs = vec![
            run("m", 8, 1, 1, 1, 1000.0), // baseline of both
            run("m", 4, 1, 2, 1, 1800.0), // strong (global 8)
            run("m", 8, 1, 2, 1, 1950.0), // weak (8 per rank)
            run("m", 2, 2, 2, 1, 500.0),  // tp 2: 4 sequences over 4 ranks = 1 per rank
        ];
        let s = find_series(&runs);
        let kinds: Vec<(Kind, usize)> = s.iter().map(|x| (x.kind, x.points.len())).collect();
        assert_eq!(kinds, [(Kind::Strong, 2), (Kind::Weak, 2)], "{s:#?}");
        assert_eq!(s[1].constant, "8 sequences per rank");
    }

    #[test]
    fn single_rank_count_is_no_series_and_fractions_print() {
        let runs = vec![run("m", 8, 1, 1, 1, 1.0), run("m", 8, 1, 1, 1, 2.0)];
        assert!(find_series(&runs).is_empty());
        let runs = vec![run("m", 1, 2, 1, 1, 1.0), run("m", 1, 2, 2, 2, 2.0)];
        let s = find_series(&runs);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].label(), "weak, 0.5 sequences per rank");
    }
}

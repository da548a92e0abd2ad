//! The communication benchmark in the report: `fugu bench comm --format json` documents
//! (one per launch: a rank count and node count), drawn as latency and bus bandwidth against
//! message size per operation, with a summary table.

use super::charts::{self, Axis, Line, LineChart, LineStyle};
use super::sections::{chart, pal, table, Item, Section};
use super::table::{Cell, Table};
use crate::bench::comm::CommRow;
use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// One `fugu bench comm --format json` document.
#[derive(Clone, Debug, Deserialize)]
pub struct CommFile {
    pub ranks: usize,
    pub nodes: usize,
    #[serde(default)]
    pub host: String,
    #[serde(default)]
    pub mpi_library: String,
    /// A traffic class's groups (`fugu bench comm --group tp|pp|dp`): then `ranks` and `nodes`
    /// are one group's, and `job_ranks`, `job_nodes` the whole job's.
    #[serde(default)]
    pub group: Option<String>,
    #[serde(default)]
    pub job_ranks: Option<usize>,
    #[serde(default)]
    pub job_nodes: Option<usize>,
    pub rows: Vec<CommRow>,
    /// The file name (set when read).
    #[serde(skip)]
    pub source: String,
}

impl CommFile {
    /// "8 ranks on 2 nodes".
    pub fn label(&self) -> String {
        let s = |n: usize| if n == 1 { "" } else { "s" };
        let mut l = format!(
            "{} rank{} on {} node{}",
            self.ranks,
            s(self.ranks),
            self.nodes,
            s(self.nodes)
        );
        if let Some(g) = &self.group {
            l += &format!(" ({g} groups");
            if let (Some(r), Some(n)) = (self.job_ranks, self.job_nodes) {
                l += &format!(" of {r} ranks on {n} node{}", s(n));
            }
            l += ")";
        }
        l
    }
}

/// Whether the text is a `fugu bench comm` document (a JSON object with `"benchmark":
/// "comm"`).
pub fn looks_like_comm(text: &str) -> bool {
    serde_json::from_str::<Value>(text.trim())
        .ok()
        .and_then(|v| {
            v.get("benchmark")
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
        .is_some_and(|b| b == "comm")
}

/// Parses a document, naming what is wrong.
pub fn parse_comm(text: &str, source: &str) -> Result<CommFile> {
    let v: Value = serde_json::from_str(text.trim()).map_err(|e| anyhow!("not JSON: {e}"))?;
    if v.get("benchmark").and_then(Value::as_str) != Some("comm") {
        bail!("not a `fugu bench comm --format json` document (no \"benchmark\": \"comm\")");
    }
    let mut f: CommFile = serde_json::from_value(v)
        .map_err(|e| anyhow!("a `fugu bench comm` document with a bad field: {e}"))?;
    if f.rows.is_empty() {
        bail!("no rows: the benchmark measured nothing");
    }
    if let Some(r) = f
        .rows
        .iter()
        .find(|r| !(r.time_us > 0.0 && r.time_us.is_finite()) || r.bytes == 0)
    {
        bail!(
            "row {} at {} B has time {} us: expected a positive time and size",
            r.op,
            r.bytes,
            r.time_us
        );
    }
    f.source = source.to_owned();
    Ok(f)
}

/// Reads a document, naming the file in errors.
pub fn read_comm(path: &Path) -> Result<CommFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let source = path.file_name().map_or_else(
        || path.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    );
    parse_comm(&text, &source).with_context(|| format!("in {}", path.display()))
}

/// Operations in report order, as they appear in the files.
fn ops(files: &[CommFile]) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    for r in files.iter().flat_map(|f| &f.rows) {
        if !v.contains(&r.op) {
            v.push(r.op.clone());
        }
    }
    v
}

/// The section: per operation, latency and bus bandwidth against size (one line per file),
/// and a table of each file's small-message latency and largest bus bandwidth per operation.
pub fn comm_section(files: &[CommFile]) -> Result<Section> {
    let mut items = Vec::new();
    for op in ops(files) {
        let mut lat = Vec::new();
        let mut bw = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let mut pts: Vec<&CommRow> = f.rows.iter().filter(|r| r.op == op).collect();
            if pts.is_empty() {
                continue;
            }
            pts.sort_by_key(|r| r.bytes);
            let label = format!("{} ({})", f.label(), f.source);
            lat.push(Line {
                label: label.clone(),
                color: pal(i),
                style: LineStyle::Markers,
                points: pts.iter().map(|r| (r.bytes as f64, r.time_us)).collect(),
            });
            bw.push(Line {
                label,
                color: pal(i),
                style: LineStyle::Markers,
                points: pts.iter().map(|r| (r.bytes as f64, r.busbw_gbs)).collect(),
            });
        }
        let x = || Axis::log("message size (bytes)", 2.0);
        let svg = charts::line_chart(&LineChart {
            title: format!("{op}: time per operation"),
            x: x(),
            y: Axis::log("microseconds (median of the slowest rank)", 10.0),
            lines: lat,
            legend_notes: Vec::new(),
        })?;
        items.push(chart(
            &format!("comm-{op}-time.svg"),
            svg,
            &format!("{op} time against message size"),
            "Time per operation (log scale) against message size (log scale): the flat left \
             part is the latency, the slope on the right the bandwidth. Lower is better.",
        ));
        let svg = charts::line_chart(&LineChart {
            title: format!("{op}: bus bandwidth"),
            x: x(),
            y: Axis::linear("bus bandwidth, GB/s", true),
            lines: bw,
            legend_notes: Vec::new(),
        })?;
        items.push(chart(
            &format!("comm-{op}-busbw.svg"),
            svg,
            &format!("{op} bus bandwidth against message size"),
            "Bus bandwidth (nccl-tests' convention: algorithm bandwidth times 2(n−1)/n for \
             all-reduce, (n−1)/n for reduce-scatter and all-gather, 1 otherwise) against message \
             size; it approaches the slowest link's bandwidth for large messages.",
        ));
    }
    let mut t = Table::new(
        "comm",
        &[
            "file",
            "ranks",
            "nodes",
            "op",
            "smallest bytes",
            "latency us",
            "largest bytes",
            "time us",
            "busbw GB/s",
        ],
    );
    for f in files {
        for op in ops(std::slice::from_ref(f)) {
            let rows: Vec<&CommRow> = f.rows.iter().filter(|r| r.op == op).collect();
            let small = rows.iter().min_by_key(|r| r.bytes).expect("a row per op");
            let large = rows.iter().max_by_key(|r| r.bytes).expect("a row per op");
            t.push(vec![
                Cell::text(&f.source),
                Cell::int(f.ranks),
                Cell::int(f.nodes),
                Cell::text(&op),
                Cell::int(small.bytes),
                Cell::num(small.time_us, 2),
                Cell::int(large.bytes),
                Cell::num(large.time_us, 1),
                Cell::num(large.busbw_gbs, 2),
            ]);
        }
    }
    items.push(table(
        t,
        "Per file and operation: the time of the smallest message (the latency) and the time \
         and bus bandwidth of the largest.",
    ));
    let libs: Vec<String> = files
        .iter()
        .map(|f| format!("{}: {} on {}", f.source, f.mpi_library, f.host))
        .collect();
    items.push(Item::Text(format!("MPI libraries: {}.", libs.join("; "))));
    Ok(Section {
        title: "Communication benchmarks".into(),
        items,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(ranks: usize) -> String {
        let row = |op: &str, bytes: usize, t: f64| {
            format!(
                r#"{{"op":"{op}","bytes":{bytes},"ranks":{ranks},"iters":10,"samples":5,"time_us":{t},"min_time_us":{t},"algbw_gbs":{a},"busbw_gbs":{a}}}"#,
                a = bytes as f64 / t / 1e3
            )
        };
        format!(
            r#"{{"benchmark":"comm","ranks":{ranks},"nodes":1,"host":"h","mpi_library":"m","rows":[{},{},{}]}}"#,
            row("allreduce", 4, 2.0),
            row("allreduce", 1024, 3.0),
            row("sendrecv", 4, 1.0)
        )
    }

    #[test]
    fn documents_are_recognised_parsed_and_drawn() {
        let text = doc(2);
        assert!(looks_like_comm(&text));
        assert!(!looks_like_comm(r#"{"type":"header"}"#));
        let f = parse_comm(&text, "comm-1n2r.json").unwrap();
        assert_eq!(
            (f.ranks, f.rows.len(), f.label().as_str()),
            (2, 3, "2 ranks on 1 node")
        );
        let s = comm_section(&[f]).unwrap();
        let charts: Vec<&str> = s
            .items
            .iter()
            .filter_map(|i| match i {
                Item::Chart { file, .. } => Some(file.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(
            charts,
            [
                "comm-allreduce-time.svg",
                "comm-allreduce-busbw.svg",
                "comm-sendrecv-time.svg",
                "comm-sendrecv-busbw.svg"
            ]
        );
    }

    #[test]
    fn bad_documents_say_what_is_wrong() {
        let e = |t: &str| parse_comm(t, "x").unwrap_err().to_string();
        assert!(e("{").contains("not JSON"));
        assert!(e(r#"{"benchmark":"gemm"}"#).contains("no \"benchmark\": \"comm\""));
        assert!(e(r#"{"benchmark":"comm","ranks":2,"nodes":1,"rows":[]}"#).contains("no rows"));
        assert!(
            e(r#"{"benchmark":"comm","ranks":"two","nodes":1,"rows":[]}"#).contains("bad field")
        );
        let zero = doc(2).replace(r#""time_us":2"#, r#""time_us":0"#);
        assert!(e(&zero).contains("expected a positive time"));
    }
}

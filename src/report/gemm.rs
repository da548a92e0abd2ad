//! Reading `fugu bench gemm --format json` output: one JSON object per line (or a JSON
//! array of them) with at least `m, n, k, threads, isa, gflops`; `batch`, `peak_pct`,
//! `peak_gflops`, `domains`, `set`, `name`, `baseline` and `baseline_gflops` are used when
//! present (see [`crate::bench::gemm::BenchRow`]).

use anyhow::{anyhow, Context, Result};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// One benchmark row.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct GemmRow {
    #[serde(default)]
    pub set: String,
    #[serde(default)]
    pub name: String,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    #[serde(default = "one")]
    pub batch: u64,
    pub threads: u64,
    #[serde(default)]
    pub domains: Option<u64>,
    pub isa: String,
    pub gflops: f64,
    #[serde(default)]
    pub peak_pct: Option<f64>,
    #[serde(default)]
    pub peak_gflops: Option<f64>,
    #[serde(default)]
    pub baseline: Option<String>,
    #[serde(default)]
    pub baseline_gflops: Option<f64>,
    /// The file the row came from (its name), filled in by the reader.
    #[serde(skip)]
    pub source: String,
}

fn one() -> u64 {
    1
}

impl GemmRow {
    /// Cube root of `m·n·k`: the edge of the square problem with the same work per GEMM.
    pub fn size(&self) -> f64 {
        (self.m as f64 * self.n as f64 * self.k as f64).cbrt()
    }

    /// The FP32 peak the row was measured against, GFLOP/s: `peak_gflops`, or
    /// `gflops × 100 / peak_pct`.
    pub fn peak(&self) -> Option<f64> {
        self.peak_gflops
            .filter(|p| p.is_finite() && *p > 0.0)
            .or_else(|| {
                self.peak_pct
                    .filter(|p| p.is_finite() && *p > 0.0)
                    .map(|p| self.gflops * 100.0 / p)
            })
    }

    /// % of peak: `peak_pct`, or computed from [`GemmRow::peak`].
    pub fn pct_of_peak(&self) -> Option<f64> {
        self.peak_pct
            .filter(|p| p.is_finite())
            .or_else(|| self.peak().map(|p| 100.0 * self.gflops / p))
    }

    /// `m×n×k` and `×batch` when batched.
    pub fn shape(&self) -> String {
        if self.batch > 1 {
            format!("{}x{}x{}x{}", self.m, self.n, self.k, self.batch)
        } else {
            format!("{}x{}x{}", self.m, self.n, self.k)
        }
    }
}

/// What reading one file gave: its rows and the lines it could not use.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GemmFile {
    pub rows: Vec<GemmRow>,
    /// (1-based line, why) of every line that was not a benchmark row.
    pub bad_lines: Vec<(usize, String)>,
}

/// Whether the text looks like a `metrics.jsonl` (its first JSON line has a `type` that a
/// metrics file uses) rather than benchmark rows.
pub fn looks_like_metrics(text: &str) -> bool {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
        .and_then(|v| v.get("type").and_then(Value::as_str).map(str::to_owned))
        .is_some_and(|t| matches!(t.as_str(), "header" | "step" | "eval" | "event"))
}

/// Parses benchmark rows (see the module docs). A file with no usable row is an error that
/// says what the first bad line was.
pub fn parse_gemm(text: &str, source: &str) -> Result<GemmFile> {
    let mut f = GemmFile::default();
    let trimmed = text.trim_start();
    let items: Vec<(usize, std::result::Result<Value, String>)> = if trimmed.starts_with('[') {
        match serde_json::from_str::<Vec<Value>>(trimmed) {
            Ok(v) => v
                .into_iter()
                .enumerate()
                .map(|(i, x)| (i + 1, Ok(x)))
                .collect(),
            Err(e) => vec![(1, Err(format!("not a JSON array of rows: {e}")))],
        }
    } else {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                (
                    i + 1,
                    serde_json::from_str::<Value>(l.trim()).map_err(|e| format!("not JSON: {e}")),
                )
            })
            .collect()
    };
    for (line, v) in items {
        let row = v.and_then(|v| {
            if !v.is_object() {
                return Err("not a JSON object".to_owned());
            }
            serde_json::from_value::<GemmRow>(v).map_err(|e| format!("not a GEMM row: {e}"))
        });
        match row {
            Ok(mut r) if r.gflops.is_finite() && r.m > 0 && r.n > 0 && r.k > 0 => {
                r.source = source.to_owned();
                f.rows.push(r);
            }
            Ok(_) => f
                .bad_lines
                .push((line, "zero size or non-finite GFLOP/s".to_owned())),
            Err(e) => f.bad_lines.push((line, e)),
        }
    }
    if f.rows.is_empty() {
        return Err(match f.bad_lines.first() {
            Some((n, e)) => anyhow!(
                "no GEMM benchmark rows (line {n}: {e}); expected the output of `fugu bench gemm --format json`"
            ),
            None => anyhow!("no GEMM benchmark rows (the file is empty)"),
        });
    }
    Ok(f)
}

/// Reads a benchmark file, naming it in errors.
pub fn read_gemm(path: &Path) -> Result<GemmFile> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let source = path.file_name().map_or_else(
        || path.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    );
    parse_gemm(&String::from_utf8_lossy(&bytes), &source)
        .with_context(|| format!("in {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROW: &str = r#"{"set":"square","name":"256^3","m":256,"n":256,"k":256,"batch":1,"ta":false,"tb":false,"threads":2,"domains":1,"isa":"avx2","gflops":50.0,"median_s":0.001,"repeats":10,"peak_gflops":100.0,"peak_pct":50.0,"peak_source":"Given","baseline":"matrixmultiply","baseline_gflops":40.0,"ratio":1.25,"openblas_gflops":null,"openblas_ratio":null,"openblas_split_gflops":null,"max_rel_diff":1e-7}"#;

    #[test]
    fn reads_bench_rows_and_reports_bad_lines() {
        let text = format!(
            "{ROW}\n{{\"m\":8,\"n\":8,\"k\":8,\"threads\":1,\"isa\":\"sve\",\"gflops\":1.0,\"peak_pct\":25.0}}\n[1,2]\n{{\"m\":1"
        );
        let f = parse_gemm(&text, "x.jsonl").unwrap();
        assert_eq!(f.rows.len(), 2);
        assert_eq!(f.rows[0].size(), 256.0);
        assert_eq!(f.rows[0].peak(), Some(100.0));
        assert_eq!(f.rows[0].source, "x.jsonl");
        assert_eq!(f.rows[1].batch, 1);
        assert_eq!(f.rows[1].peak(), Some(4.0), "from peak_pct");
        assert_eq!(f.rows[1].pct_of_peak(), Some(25.0));
        assert_eq!(f.bad_lines.iter().map(|b| b.0).collect::<Vec<_>>(), [3, 4]);
    }

    #[test]
    fn array_form_and_errors() {
        let f = parse_gemm(&format!("[{ROW}]"), "a.json").unwrap();
        assert_eq!(f.rows.len(), 1);
        let e = parse_gemm("m      n      k    GFLOP/s\n", "t.txt").unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        let e = parse_gemm("{\"m\":1}\n", "t.json").unwrap_err();
        assert!(e.to_string().contains("missing field"), "{e}");
        assert!(parse_gemm("", "e").is_err());
    }

    #[test]
    fn sniffs_metrics_files() {
        assert!(looks_like_metrics("\n{\"type\":\"header\",\"x\":1}\n"));
        assert!(!looks_like_metrics(ROW));
        assert!(!looks_like_metrics("nonsense"));
    }
}

//! Sorting the command line's paths into run metrics files, GEMM benchmark files and
//! communication benchmark files, and the list of inputs (or parts of inputs) that could not be
//! used.

use super::comm::looks_like_comm;
use super::gemm::looks_like_metrics;
use super::prediction::looks_like_prediction;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// A usable-looking input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// A run: its metrics file and the path the user gave (which names the run).
    Run { metrics: PathBuf, given: PathBuf },
    /// A `fugu bench gemm --format json` output file.
    Gemm(PathBuf),
    /// A `fugu bench comm --format json` document.
    Comm(PathBuf),
    /// A `fugu predict --format json` document.
    Prediction(PathBuf),
}

/// An input, or a part of one, that the report does not use, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    pub input: String,
    pub reason: String,
}

impl Skipped {
    /// A skipped input.
    pub fn new(input: impl Into<String>, reason: impl Into<String>) -> Skipped {
        Skipped {
            input: input.into(),
            reason: reason.into(),
        }
    }
}

/// Files directly in `dir` whose names pass `keep`, sorted by name.
fn files_named(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.file_name().and_then(|f| f.to_str()).is_some_and(&keep))
        .collect();
    v.sort();
    v
}

/// `bench-gemm*.jsonl` files directly in `dir`.
fn bench_files(dir: &Path) -> Vec<PathBuf> {
    files_named(dir, |f| {
        f.starts_with("bench-gemm") && f.ends_with(".jsonl")
    })
}

/// `comm-*.json` (the job scripts' names) and `bench-comm*.json` files directly in `dir`.
fn comm_files(dir: &Path) -> Vec<PathBuf> {
    files_named(dir, |f| {
        (f.starts_with("comm-") || f.starts_with("bench-comm")) && f.ends_with(".json")
    })
}

fn has_json_ext(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("json") || e.eq_ignore_ascii_case("jsonl"))
}

/// Classifies the positional inputs, the `--gemm`, `--comm` and `--predict` files (see `fugu
/// report --help`). The same file given twice is used once.
pub fn classify(
    positional: &[PathBuf],
    gemm: &[PathBuf],
    comm: &[PathBuf],
    predict: &[PathBuf],
) -> (Vec<Input>, Vec<Skipped>) {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    let mut seen = BTreeSet::new();
    let mut push = |i: Input, out: &mut Vec<Input>| {
        let key = match &i {
            Input::Run { metrics, .. } => metrics.clone(),
            Input::Gemm(p) | Input::Comm(p) | Input::Prediction(p) => p.clone(),
        };
        let key = std::fs::canonicalize(&key).unwrap_or(key);
        if seen.insert(key) {
            out.push(i);
        }
    };
    for p in positional {
        let shown = p.display().to_string();
        if !p.exists() {
            skipped.push(Skipped::new(shown, "does not exist"));
        } else if p.is_dir() {
            let metrics = p.join("metrics.jsonl");
            let bench = bench_files(p);
            let comms = comm_files(p);
            if metrics.is_file() {
                push(
                    Input::Run {
                        metrics,
                        given: p.clone(),
                    },
                    &mut out,
                );
            }
            let none = !p.join("metrics.jsonl").is_file() && bench.is_empty() && comms.is_empty();
            for b in bench {
                push(Input::Gemm(b), &mut out);
            }
            for c in comms {
                push(Input::Comm(c), &mut out);
            }
            if none {
                skipped.push(Skipped::new(
                    shown,
                    "no metrics.jsonl (not a finished or running `fugu train` directory), no bench-gemm*.jsonl and no comm-*.json",
                ));
            }
        } else if p.file_name().is_some_and(|f| f == "metrics.jsonl") {
            push(
                Input::Run {
                    metrics: p.clone(),
                    given: p.clone(),
                },
                &mut out,
            );
        } else if has_json_ext(p) {
            match std::fs::read(p) {
                Ok(b) if looks_like_comm(&String::from_utf8_lossy(&b)) => {
                    push(Input::Comm(p.clone()), &mut out)
                }
                Ok(b) if looks_like_prediction(&String::from_utf8_lossy(&b)) => {
                    push(Input::Prediction(p.clone()), &mut out)
                }
                Ok(b) if looks_like_metrics(&String::from_utf8_lossy(&b)) => push(
                    Input::Run {
                        metrics: p.clone(),
                        given: p.with_extension(""),
                    },
                    &mut out,
                ),
                Ok(_) => push(Input::Gemm(p.clone()), &mut out),
                Err(e) => skipped.push(Skipped::new(shown, format!("cannot read: {e}"))),
            }
        } else {
            skipped.push(Skipped::new(
                shown,
                "not a run directory, a metrics.jsonl, or a .json/.jsonl GEMM benchmark file (use --gemm FILE for one with another name)",
            ));
        }
    }
    for p in gemm {
        let shown = p.display().to_string();
        if p.is_dir() {
            let bench = bench_files(p);
            if bench.is_empty() {
                skipped.push(Skipped::new(shown, "no bench-gemm*.jsonl files in it"));
            }
            for b in bench {
                push(Input::Gemm(b), &mut out);
            }
        } else if p.is_file() {
            push(Input::Gemm(p.clone()), &mut out);
        } else {
            skipped.push(Skipped::new(shown, "does not exist"));
        }
    }
    for p in predict {
        if p.is_file() {
            push(Input::Prediction(p.clone()), &mut out);
        } else {
            skipped.push(Skipped::new(
                p.display().to_string(),
                "does not exist (or is not a file)",
            ));
        }
    }
    for p in comm {
        let shown = p.display().to_string();
        if p.is_dir() {
            let files = comm_files(p);
            if files.is_empty() {
                skipped.push(Skipped::new(
                    shown,
                    "no comm-*.json or bench-comm*.json files in it",
                ));
            }
            for c in files {
                push(Input::Comm(c), &mut out);
            }
        } else if p.is_file() {
            push(Input::Comm(p.clone()), &mut out);
        } else {
            skipped.push(Skipped::new(shown, "does not exist"));
        }
    }
    (out, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_inputs() {
        let d = std::env::temp_dir().join(format!("fugu-report-inputs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let run = d.join("run");
        let bench = d.join("bench");
        let empty = d.join("empty");
        for x in [&run, &bench, &empty] {
            std::fs::create_dir_all(x).unwrap();
        }
        std::fs::write(run.join("metrics.jsonl"), "{\"type\":\"header\"}\n").unwrap();
        std::fs::write(bench.join("bench-gemm-1.jsonl"), "{}\n").unwrap();
        std::fs::write(bench.join("other.txt"), "x").unwrap();
        let loose = d.join("g.jsonl");
        std::fs::write(&loose, "{\"m\":1}\n").unwrap();
        let renamed = d.join("r.jsonl");
        std::fs::write(&renamed, "{\"type\":\"step\"}\n").unwrap();
        let odd = d.join("x.txt");
        std::fs::write(&odd, "").unwrap();
        let comm = d.join("net.json");
        std::fs::write(&comm, "{\"benchmark\": \"comm\", \"rows\": []}").unwrap();
        std::fs::write(bench.join("comm-2n8r.json"), "{}").unwrap();

        let (ins, skipped) = classify(
            &[
                run.clone(),
                bench.clone(),
                empty.clone(),
                loose.clone(),
                renamed.clone(),
                odd.clone(),
                d.join("missing"),
                run.join("metrics.jsonl"), // duplicate of `run`
                comm.clone(),
            ],
            std::slice::from_ref(&odd),
            std::slice::from_ref(&bench),
            &[],
        );
        assert_eq!(
            ins,
            vec![
                Input::Run {
                    metrics: run.join("metrics.jsonl"),
                    given: run.clone()
                },
                Input::Gemm(bench.join("bench-gemm-1.jsonl")),
                Input::Comm(bench.join("comm-2n8r.json")),
                Input::Gemm(loose.clone()),
                Input::Run {
                    metrics: renamed.clone(),
                    given: d.join("r")
                },
                Input::Comm(comm.clone()),
                Input::Gemm(odd.clone()),
            ]
        );
        let why: Vec<&str> = skipped.iter().map(|s| s.reason.as_str()).collect();
        assert_eq!(skipped.len(), 3, "{why:?}");
        assert!(why[0].starts_with("no metrics.jsonl"));
        assert!(why[1].starts_with("not a run directory"));
        assert_eq!(why[2], "does not exist");
        std::fs::remove_dir_all(&d).unwrap();
    }
}

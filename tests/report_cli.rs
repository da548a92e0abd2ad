//! `fugu report` end to end, through the real binary, on the recorded and synthetic runs and
//! the GEMM benchmark under `tests/fixtures/report/` (see its README): every chart and table is
//! written with the right rows, malformed inputs are listed under "Skipped inputs", and no
//! usable input is an error. Nothing here depends on the numbers in the fixtures.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/report")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fugu-report-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn fugu(args: &[&Path]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fugu"))
        .arg("report")
        .args(args)
        .output()
        .expect("running fugu")
}

/// Run directories under `runs/`, sorted.
fn run_dirs() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures().join("runs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("metrics.jsonl").is_file())
        .collect();
    v.sort();
    v
}

/// Non-empty lines of a file.
fn lines(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

/// The fields of one CSV line (RFC 4180 quoting; no field spans lines in these files).
fn csv_fields(line: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                chars.next();
                out.last_mut().unwrap().push('"');
            }
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(String::new()),
            c => out.last_mut().unwrap().push(c),
        }
    }
    out
}

/// CSV rows, header dropped; every row has the header's number of fields.
fn csv(p: &Path) -> Vec<Vec<String>> {
    let l = lines(p);
    let width = csv_fields(&l[0]).len();
    l.iter()
        .skip(1)
        .map(|l| {
            let f = csv_fields(l);
            assert_eq!(f.len(), width, "{}: {l}", p.display());
            f
        })
        .collect()
}

fn svg(p: &Path) -> String {
    let s = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    assert!(s.starts_with("<svg"), "{} is not an SVG", p.display());
    assert!(
        s.trim_end().ends_with("</svg>"),
        "{} is cut short",
        p.display()
    );
    assert_eq!(
        s.matches("<text").count(),
        s.matches("</text>").count(),
        "{}",
        p.display()
    );
    s
}

fn name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

#[test]
fn full_report_from_runs_bench_and_bad_inputs() {
    let f = fixtures();
    let out = tmp("full");
    let runs = run_dirs();
    assert!(runs.len() >= 3, "fixtures: 1, 2 and 4 ranks");
    let bad = [
        f.join("bad/no-metrics"),
        f.join("bad/no-steps"),
        f.join("bad/not-json"),
    ];
    let bench = f.join("bench");
    let out_flag = PathBuf::from("--out");
    let mut args: Vec<&Path> = runs.iter().map(PathBuf::as_path).collect();
    args.push(&bench);
    args.extend(bad.iter().map(PathBuf::as_path));
    args.push(&out_flag);
    args.push(&out);
    let o = fugu(&args);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "fugu report failed:\n{stderr}");

    // Every chart, with its series names.
    let run_names: Vec<String> = runs.iter().map(|p| name(p)).collect();
    let b = svg(&out.join("breakdown.svg"));
    for n in &run_names {
        assert!(b.contains(n.as_str()), "breakdown.svg lacks run {n}");
    }
    for c in [
        "GEMM (linear layers)",
        "communication (all-reduce, send/recv)",
        "optimizer",
    ] {
        assert!(b.contains(c), "breakdown.svg lacks category {c}");
    }
    assert!(b.contains(" ms<") || b.contains(" ms\n"), "bar totals");
    let bp = svg(&out.join("breakdown-pct.svg"));
    assert!(bp.contains("% of step time"));
    let st = svg(&out.join("scaling-throughput.svg"));
    assert!(
        st.contains("strong, global batch"),
        "strong series in the legend"
    );
    assert!(st.contains("MPI ranks") && st.contains("tokens/s"));
    let sp = svg(&out.join("scaling-speedup.svg"));
    assert!(sp.contains("ideal") && sp.contains("strong, global batch"));
    let tf = svg(&out.join("tflops.svg"));
    assert!(tf.contains("% of peak") && tf.contains("TFLOP/s per process"));
    for n in &run_names {
        assert!(tf.contains(n.as_str()), "tflops.svg lacks run {n}");
    }

    // GEMM: one chart per thread count in the benchmark file, plus the % of peak chart.
    let rows: Vec<serde_json::Value> = lines(&f.join("bench/bench-gemm.jsonl"))
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut threads: Vec<u64> = rows
        .iter()
        .map(|r| r["threads"].as_u64().unwrap())
        .collect();
    threads.sort();
    threads.dedup();
    let isa = rows[0]["isa"].as_str().unwrap();
    for t in &threads {
        let g = svg(&out.join(format!("gemm-{t}t.svg")));
        assert!(
            g.contains(&format!("{isa}, {t} thread")),
            "gemm-{t}t.svg series"
        );
        assert!(g.contains("peak, "), "gemm-{t}t.svg peak line");
        assert!(g.contains("GFLOP/s"));
    }
    if threads.len() > 1 {
        assert!(svg(&out.join("gemm-peak-pct.svg")).contains("peak (100%)"));
    }

    // Every table as CSV, with the right rows.
    let n = runs.len();
    assert_eq!(csv(&out.join("runs.csv")).len(), n);
    assert_eq!(csv(&out.join("efficiency.csv")).len(), n);
    let bd = csv(&out.join("breakdown.csv"));
    assert_eq!(bd.len(), n);
    // Runs are ordered by nodes, then ranks.
    let order: Vec<(u64, u64)> = bd
        .iter()
        .map(|r| (r[2].parse().unwrap(), r[1].parse().unwrap()))
        .collect();
    assert!(order.windows(2).all(|w| w[0] <= w[1]), "{order:?}");
    // The category columns add up to the step.
    for r in &bd {
        let step: f64 = r[4].parse().unwrap();
        let sum: f64 = r[5..].iter().map(|x| x.parse::<f64>().unwrap()).sum();
        assert!((sum - step).abs() <= 0.01 * step + 1e-6, "{r:?}");
    }
    let timers = csv(&out.join("breakdown-timers.csv"));
    for n in &run_names {
        assert!(timers.iter().any(|r| &r[0] == n), "no timers for {n}");
    }
    assert!(
        timers
            .iter()
            .any(|r| r[1].contains("allreduce") && !r[4].is_empty()),
        "min/max across ranks for the all-reduce timers"
    );
    let sc = csv(&out.join("scaling.csv"));
    let strong: Vec<u64> = sc
        .iter()
        .filter(|r| r[1] == "strong")
        .map(|r| r[4].parse().unwrap())
        .collect();
    for w in [1, 2, 4] {
        assert!(strong.contains(&w), "strong series at {w} ranks: {sc:?}");
    }
    // n2-dp2-weak has 8 sequences per rank like n1-gpt2-tiny, but 1 thread per rank against 2:
    // twice the work per core, so the two do not form a weak-scaling series.
    assert!(!sc.iter().any(|r| r[1] == "weak"), "{sc:?}");
    // One rank of 2 threads and two ranks of 1 thread are the same 2 cores: ideal speedup 1.
    let dp2 = sc
        .iter()
        .find(|r| r[3] == "n2-dp2")
        .expect("n2-dp2 in the strong series");
    assert_eq!((dp2[5].as_str(), dp2[10].as_str()), ("2", "1"), "{dp2:?}");
    // Per-op rates: n1-gpt2-tiny's breakdown.json, every op that declared work, largest
    // headroom (ms/step x (1 - roof%/100)) first.
    let roof = csv(&out.join("roofline.csv"));
    let n1: Vec<&Vec<String>> = roof.iter().filter(|r| r[0] == "n1-gpt2-tiny").collect();
    assert!(n1.len() >= 20, "{roof:?}");
    assert!(
        roof.iter().all(|r| r[0] == "n1-gpt2-tiny"),
        "only n1 has rates"
    );
    let num = |x: &str| x.parse::<f64>().unwrap();
    let headroom: Vec<f64> = n1.iter().map(|r| num(&r[7])).collect();
    assert!(headroom.windows(2).all(|w| w[0] >= w[1]), "{headroom:?}");
    for r in &n1 {
        let (ms, pct) = (num(&r[2]), num(&r[6]));
        let want = (ms * (1.0 - pct / 100.0)).max(0.0);
        assert!((num(&r[7]) - want).abs() <= 1e-3 + 1e-3 * ms, "{r:?}");
    }
    assert!(n1
        .iter()
        .any(|r| r[1] == "backward:layernorm" && r[4].is_empty() && !r[5].is_empty()));
    assert_eq!(csv(&out.join("gemm.csv")).len(), rows.len());
    assert!(!csv(&out.join("gemm-summary.csv")).is_empty());

    // Skipped: the three bad inputs with their reasons.
    let md = std::fs::read_to_string(out.join("REPORT.md")).unwrap();
    let skipped = md
        .split("## Skipped inputs")
        .nth(1)
        .expect("a Skipped section");
    assert!(skipped.contains("no-metrics") && skipped.contains("no metrics.jsonl"));
    assert!(skipped.contains("no-steps") && skipped.contains("no step records"));
    assert!(skipped.contains("not-json") && skipped.contains("not valid JSON"));
    let sk = csv(&out.join("skipped.csv"));
    assert!(sk.len() >= 3, "{sk:?}");
    // REPORT.md links every chart and CSV it was written with.
    for e in std::fs::read_dir(&out).unwrap() {
        let file = name(&e.unwrap().path());
        if file != "REPORT.md" {
            assert!(
                md.contains(&format!("]({file})")),
                "REPORT.md does not link {file}"
            );
        }
    }
    assert!(md.contains("warm-up"));
    assert!(stderr.contains("skipped"), "{stderr}");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn gemm_only_and_runs_only_reports() {
    let f = fixtures();
    let out = tmp("gemm-only");
    let gemm = f.join("bench/bench-gemm.jsonl");
    let o = fugu(&[
        &PathBuf::from("--gemm"),
        &gemm,
        &PathBuf::from("--out"),
        &out,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.join("gemm-summary.csv").exists());
    assert!(!out.join("runs.csv").exists());
    std::fs::remove_dir_all(&out).unwrap();

    // One GEMM row: the peak line still has length (dash segments drawn at two x positions).
    let out = tmp("gemm-one-row");
    std::fs::create_dir_all(&out).unwrap();
    let one = out.join("one.jsonl");
    let first = std::fs::read_to_string(&gemm).unwrap();
    std::fs::write(&one, first.lines().next().unwrap()).unwrap();
    let o = fugu(&[
        &PathBuf::from("--gemm"),
        &one,
        &PathBuf::from("--out"),
        &out.join("r"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let svgs: Vec<_> = std::fs::read_dir(out.join("r"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.to_string_lossy().contains("gemm-") && p.extension().is_some_and(|x| x == "svg")
        })
        .collect();
    assert!(!svgs.is_empty());
    for p in svgs {
        let g = svg(&p);
        // The dashed line is drawn as many short 2-px polylines at one height.
        let dashes = g.matches("stroke-width=\"2\" points=").count();
        assert!(dashes >= 5, "{}: peak line not drawn", p.display());
    }
    std::fs::remove_dir_all(&out).unwrap();

    let out = tmp("one-run");
    let run = &run_dirs()[0];
    let o = fugu(&[run, &PathBuf::from("-o"), &out]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let md = std::fs::read_to_string(out.join("REPORT.md")).unwrap();
    assert!(md.contains("No scaling series"), "{md}");
    assert!(md.contains("No GEMM benchmark given"));
    assert!(out.join("breakdown.svg").exists() && !out.join("scaling.csv").exists());
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn no_usable_input_is_an_error_naming_each() {
    let f = fixtures();
    let out = tmp("none");
    let (a, b) = (f.join("bad/no-steps"), f.join("bad/not-json"));
    let o = fugu(&[&a, &b, &PathBuf::from("--out"), &out]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("no usable input"), "{e}");
    assert!(e.contains("no-steps") && e.contains("not-json"), "{e}");
    assert!(!out.join("REPORT.md").exists());

    let o = Command::new(env!("CARGO_BIN_EXE_fugu"))
        .args(["report", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(!o.status.success());

    let o = Command::new(env!("CARGO_BIN_EXE_fugu"))
        .args(["report", "--help"])
        .output()
        .unwrap();
    assert!(o.status.success());
    let h = String::from_utf8_lossy(&o.stdout);
    assert!(
        h.contains("bench-gemm") && h.contains("Skipped inputs"),
        "{h}"
    );
}

/// Runs with evaluations get a loss chart and table: the fp32 run is the reference, the other
/// run's largest relative deviation at the same steps is reported; runs without evaluations
/// (the fixtures above) get no loss section.
#[test]
fn loss_curves_of_runs_that_evaluated() {
    let src = fixtures().join("runs/n1-gpt2-tiny/metrics.jsonl");
    let text = std::fs::read_to_string(&src).unwrap();
    let dir = tmp("loss");
    let mut runs = Vec::new();
    for (name, precision, losses) in [
        ("low", "bf16", [6.0, 5.05, 4.2]),
        ("ref", "fp32", [6.0, 5.0, 4.0]),
    ] {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        let header_end = text.find('\n').unwrap();
        let header = text[..header_end].replacen(
            "\"type\":\"header\",",
            &format!("\"type\":\"header\",\"precision\":\"{precision}\","),
            1,
        );
        let mut m = format!("{header}{}", &text[header_end..]);
        for (i, l) in losses.iter().enumerate() {
            m.push_str(&format!(
                "{{\"type\":\"eval\",\"step\":{},\"val_loss\":{l}}}\n",
                2 * (i + 1)
            ));
        }
        std::fs::write(d.join("metrics.jsonl"), m).unwrap();
        runs.push(d);
    }
    let out = dir.join("report");
    let out_flag = PathBuf::from("--out");
    let o = fugu(&[&runs[0], &runs[1], &out_flag, &out]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let chart = svg(&out.join("loss.svg"));
    assert!(chart.contains("low (bf16)") && chart.contains("ref (fp32)"));
    let rows = csv(&out.join("loss.csv"));
    let low = rows.iter().find(|r| r[0] == "low").expect("a row for low");
    assert_eq!(low[2], "3", "{low:?}");
    // |4.2 - 4.0| / 4.0 = 5%, the largest of 0%, 1%, 5%.
    assert!(
        (low[5].parse::<f64>().unwrap() - 5.0).abs() < 1e-9,
        "{low:?}"
    );
    let md = std::fs::read_to_string(out.join("REPORT.md")).unwrap();
    assert!(md.contains("Reference: ref (fp32)"), "{md}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `fugu bench comm` output (a real 2-rank run, 4 B .. 1 KiB): charts per operation, the
/// summary table, and a malformed `--comm` file listed as skipped with the reason.
#[test]
fn comm_benchmark_files_are_charted_and_tabled() {
    let out = tmp("comm");
    let bad = tmp("comm-bad");
    std::fs::create_dir_all(&bad).unwrap();
    let bad_file = bad.join("net.json");
    std::fs::write(
        &bad_file,
        r#"{"benchmark":"comm","ranks":2,"nodes":1,"rows":[]}"#,
    )
    .unwrap();
    let o = fugu(&[
        &fixtures().join("comm"),
        Path::new("--comm"),
        &bad_file,
        Path::new("--out"),
        &out,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let md = std::fs::read_to_string(out.join("REPORT.md")).unwrap();
    assert!(md.contains("## Communication benchmarks"), "{md}");
    assert!(md.contains("net.json") && md.contains("no rows"), "{md}");
    let rows = csv(&out.join("comm.csv"));
    let ops: Vec<&str> = rows.iter().map(|r| r[3].as_str()).collect();
    assert_eq!(
        ops,
        [
            "allreduce",
            "reduce-scatter",
            "allgather",
            "broadcast",
            "sendrecv"
        ]
    );
    for r in &rows {
        // The smallest message: one f32, one per rank for the block collectives.
        let smallest = if r[3].contains("scatter") || r[3].contains("gather") {
            "8"
        } else {
            "4"
        };
        assert_eq!(
            (r[0].as_str(), r[1].as_str(), r[4].as_str()),
            ("comm-1n2r.json", "2", smallest)
        );
        assert!(r[5].parse::<f64>().unwrap() > 0.0 && r[8].parse::<f64>().unwrap() > 0.0);
    }
    for op in ops {
        for kind in ["time", "busbw"] {
            let s = svg(&out.join(format!("comm-{op}-{kind}.svg")));
            assert!(s.contains("2 ranks on 1 node"), "comm-{op}-{kind}.svg");
        }
    }
}

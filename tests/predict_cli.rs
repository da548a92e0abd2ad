//! `fugu predict` against measurements.
//!
//! * This machine: a profile built from a one-process reference run and a `fugu bench comm`
//!   run, then the step time of six 2- and 4-rank layouts (dp, tp, ZeRO-1, tp x dp) predicted
//!   and compared with the measured runs (`tests/fixtures/predict/vm-zen4`, recorded by
//!   `scripts/validate-predict.sh` on a 2-core AMD EPYC Zen 4). Target: within 15%.
//! * Fugaku: the shipped estimate profile, calibrated on the published one-node figures only,
//!   against the published multi-node points (`docs/PREDICT.md` discusses the misses).

use fugu::report::runs::read_run;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fugu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fugu"))
        .args(args)
        .output()
        .expect("running fugu")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "fugu failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/predict/vm-zen4")
}

fn repo(p: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(p)
        .display()
        .to_string()
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fugu-predict-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The predictions of `fugu predict ... --format json`.
fn predictions(args: &[&str]) -> Vec<Value> {
    let mut a = vec!["predict"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["--format", "json"]);
    let v: Value = serde_json::from_str(&ok(&fugu(&a))).expect("JSON output");
    v["predictions"].as_array().unwrap().clone()
}

/// Builds the vm-zen4 profile from the fixtures, with the measured GEMM rates or without
/// (GEMM time then scales with FLOPs), and returns its path.
fn vm_profile(name: &str, with_gemm: bool) -> String {
    let d = fixtures();
    let out = tmp(name);
    let profile = out.join("vm.toml");
    let (run, comm, gemm, path) = (
        d.join("ref").display().to_string(),
        d.join("comm-1n2r.json").display().to_string(),
        d.join("gemm-1t.json").display().to_string(),
        profile.display().to_string(),
    );
    let mut args = vec![
        "predict",
        "profile",
        "--run",
        &run,
        "--comm",
        &comm,
        "--name",
        "vm-zen4",
        "--cores-per-node",
        "2",
        "--memory-gib",
        "24",
        "--out",
        &path,
    ];
    if with_gemm {
        args.extend(["--gemm", &gemm]);
    }
    ok(&fugu(&args));
    path
}

#[test]
fn layouts_measured_here_are_predicted_within_15_percent() {
    let d = fixtures();
    let profiles = [
        ("FLOPs", vm_profile("vm-flops", false)),
        ("rates", vm_profile("vm-rates", true)),
    ];
    assert!(std::fs::read_to_string(&profiles[1].1)
        .unwrap()
        .contains("[[compute.gemm]]"));
    let mut worst = [0.0f64; 2];
    println!("layout   ranks  measured ms  predicted ms (GEMMs by FLOPs)  (by measured rates)");
    // The last one is reported, not held to the target: an oversubscribed pipeline, whose
    // waiting ranks poll MPI with sched_yield (Open MPI under --oversubscribe) and take part of
    // the cores that the model gives to the busy stage (docs/PREDICT.md).
    for (run, rpn, extra) in [
        ("dp2", "2", vec![]),
        ("tp2", "2", vec!["--tp", "2"]),
        ("dp2z", "2", vec!["--zero", "1"]),
        ("pp2", "2", vec!["--pp", "2", "--micro-batches", "4"]),
        ("dp4", "4", vec![]),
        ("tp2dp2", "4", vec!["--tp", "2"]),
        ("tp4", "4", vec!["--tp", "4"]),
        ("pp2dp2", "4", vec!["--pp", "2", "--micro-batches", "2"]),
    ] {
        let measured = read_run(&d.join(run).join("metrics.jsonl"), run)
            .unwrap()
            .step_ms;
        let mut line = format!("{run:<8} {rpn:>5} {measured:>12.1}");
        for (i, (_, p)) in profiles.iter().enumerate() {
            let mut args = vec![
                "--profile",
                p,
                "--config",
                "gpt2-tiny",
                "--seq-len",
                "128",
                "--batch",
                "8",
                "--nodes",
                "1",
                "--ranks-per-node",
                rpn,
                "--threads",
                "1",
            ];
            args.extend(extra.iter().copied());
            let pred = predictions(&args)[0]["step_ms"].as_f64().unwrap();
            let err = (pred - measured) / measured;
            line += &format!(" {pred:>13.1} {:>+6.1}%", 100.0 * err);
            if run != "pp2dp2" {
                worst[i] = worst[i].max(err.abs());
            }
        }
        println!("{line}");
    }
    for (i, (what, _)) in profiles.iter().enumerate() {
        println!("worst |error|, GEMMs by {what}: {:.1}%", 100.0 * worst[i]);
        assert!(
            worst[i] <= 0.15,
            "GEMMs by {what}: a prediction is off by {:.1}%",
            100.0 * worst[i]
        );
    }
}

/// `fugu predict gemm-shapes` lists the shapes the rates are looked up by, and a profile whose
/// rates miss some of them says which.
#[test]
fn gemm_shapes_are_listed_and_missing_rates_named() {
    let shapes = ok(&fugu(&[
        "predict",
        "gemm-shapes",
        "--config",
        "gpt2-tiny",
        "--seq-len",
        "128",
        "--micro-batch-size",
        "8",
        "--tp",
        "2",
    ]));
    // gpt2-tiny (C = 128, 4 heads, V padded to 50304) at tp 2, 1024 tokens: the QKV forward,
    // the vocabulary-parallel LM head forward and the attention scores (2 heads of 128 x 128
    // x 32, B given transposed).
    for s in ["1024x192x128", "1024x25152x128:tb", "128x128x32x2:tb"] {
        assert!(
            shapes.split_whitespace().any(|w| w == s),
            "{s} missing from {shapes}"
        );
    }
    let p = vm_profile("vm-missing", true);
    let o = fugu(&[
        "predict",
        "--profile",
        &p,
        "--config",
        "gpt2-tiny",
        "--seq-len",
        "64",
        "--batch",
        "8",
        "--threads",
        "1",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("no rate measured") && err.contains("--shape 64x64x32x4:tb"),
        "{err}"
    );
    // A misspelt field in a rate row is named, not ignored.
    let typo = tmp("vm-typo").join("typo.toml");
    std::fs::write(
        &typo,
        std::fs::read_to_string(&p)
            .unwrap()
            .replacen("gflops = ", "gfloops = 1.0\ngflops = ", 1),
    )
    .unwrap();
    let o = fugu(&[
        "predict",
        "--profile",
        &typo.display().to_string(),
        "--config",
        "gpt2-tiny",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("compute.gemm[0]: unknown field `gfloops`"),
        "{err}"
    );
}

#[test]
fn fugaku_points_calibrated_on_one_node() {
    let fugaku = repo("profiles/fugaku.toml");
    // (model, tp, calibration TF/node at 1 node, published points (nodes, TF/node)); the
    // published runs had one process per node (48 threads), global batch 1024, micro-batch
    // 1 (shared docs/A64FX.md).
    let curves = [
        (
            "gpt2-124m",
            "1",
            "1.09",
            vec![(1usize, 1.09f64), (512, 0.16)],
        ),
        ("gpt-1.3b", "4", "0.99", vec![(4, 0.86), (4096, 0.41)]),
    ];
    println!("model      tp  nodes  published  predicted  error");
    let mut errors = Vec::new();
    for (cfg, tp, calib, points) in curves {
        let nodes: Vec<String> = points.iter().map(|p| p.0.to_string()).collect();
        let nodes = nodes.join(",");
        let preds = predictions(&[
            "--profile",
            &fugaku,
            "--config",
            cfg,
            "--tp",
            tp,
            "--batch",
            "1024",
            "--micro-batch-size",
            "1",
            "--ranks-per-node",
            "1",
            "--threads",
            "48",
            "--tflops-per-node",
            calib,
            "--nodes",
            &nodes,
        ]);
        for ((n, published), p) in points.iter().zip(&preds) {
            let got = p["tflops_per_node"].as_f64().unwrap();
            let err = (got - published) / published;
            println!(
                "{cfg:<10} {tp:>2} {n:>6} {published:>10.2} {got:>10.3} {:>+7.0}%",
                100.0 * err
            );
            assert!(
                p["fits"].as_bool().unwrap(),
                "{cfg} at {n} nodes does not fit"
            );
            errors.push((cfg, *n, err));
        }
    }
    // The calibration point reproduces itself, and the 1.3B TP 4 run over 4 nodes (inter-node
    // tensor parallelism, no data parallelism) is within the 20% target.
    let err = |c: &str, n: usize| errors.iter().find(|e| e.0 == c && e.1 == n).unwrap().2;
    assert!(err("gpt2-124m", 1).abs() < 0.01);
    assert!(
        err("gpt-1.3b", 4).abs() <= 0.20,
        "1.3B at 4 nodes: {:.0}%",
        100.0 * err("gpt-1.3b", 4)
    );
    // At 512 and 4096 nodes the model is far more optimistic than the published runs (see
    // docs/PREDICT.md: their data-parallel all-reduce ran at a small fraction of Tofu-D's
    // bandwidth): the 20% target is not met there, and this records by how much.
    for (c, n) in [("gpt2-124m", 512), ("gpt-1.3b", 4096)] {
        println!(
            "{c} at {n} nodes: the model is {:.1}x the published TF/node",
            1.0 + err(c, n)
        );
        assert!(err(c, n) > 0.0);
    }
}

#[test]
fn ten_node_counts_and_bad_inputs() {
    let fugaku = repo("profiles/fugaku.toml");
    let preds = predictions(&[
        "--profile",
        &fugaku,
        "--config",
        "gpt2-124m",
        "--batch",
        "4096",
        "--nodes",
        "1,2,4,8,16,32,64,128,256,512",
        "--micro-batch-size",
        "1",
    ]);
    assert_eq!(preds.len(), 10);
    // More nodes: never slower per step in this strong-scaling series, never more TF/node.
    for w in preds.windows(2) {
        let (a, b) = (&w[0], &w[1]);
        assert!(b["step_ms"].as_f64() <= a["step_ms"].as_f64());
        assert!(b["tflops_per_node"].as_f64() <= a["tflops_per_node"].as_f64());
    }
    // Same timer names as real runs.
    let t = preds[5]["timers_ms"].as_object().unwrap();
    assert!(
        t.contains_key("forward") && t.contains_key("allreduce-params"),
        "{t:?}"
    );

    let bad = tmp("bad");
    let missing = bad.join("nope.toml").display().to_string();
    let broken = bad.join("broken.toml");
    std::fs::write(
        &broken,
        std::fs::read_to_string(&fugaku)
            .unwrap()
            .replace("beta_gbs = 6.8", "beta_gbs = -1"),
    )
    .unwrap();
    let broken = broken.display().to_string();
    for (args, want) in [
        (vec!["predict"], "--profile FILE is needed"),
        (
            vec!["predict", "--profile", &missing],
            "reading the machine profile",
        ),
        (
            vec!["predict", "--profile", &broken],
            "network.inter: beta_gbs = -1",
        ),
        (
            vec![
                "predict",
                "--profile",
                &fugaku,
                "--tp",
                "5",
                "--nodes",
                "5",
                "--ranks-per-node",
                "1",
            ],
            "--tp 5 does not divide model.n_head",
        ),
        (
            vec![
                "predict",
                "--profile",
                &fugaku,
                "--nodes",
                "3",
                "--batch",
                "8",
            ],
            "does not split into dp 12",
        ),
        (
            vec!["predict", "--profile", &fugaku, "--dp", "7"],
            "leave dp = 4",
        ),
        (
            vec!["predict", "--profile", &fugaku, "--search"],
            "--search needs --batch",
        ),
        (
            vec!["predict", "--profile", &fugaku, "--search", "--tp", "2"],
            "cannot be used with",
        ),
        (
            vec!["predict", "--profile", &fugaku, "--zero", "2"],
            "--zero 2: fugu has ZeRO stages 0 and 1",
        ),
        (
            vec![
                "predict",
                "--profile",
                &fugaku,
                "--batch",
                "100000000000000000",
                "--micro-batch-size",
                "1",
            ],
            "too large to count",
        ),
    ] {
        let o = fugu(&args);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(want), "{args:?}: {e}");
    }
}

/// `fugu report --predict`: the prediction charts and table, with measured runs overlaid, and
/// a positional prediction file recognised by its content.
#[test]
fn predictions_are_charted_by_fugu_report() {
    let out = tmp("report");
    let pred = out.join("p.json");
    let o = fugu(&[
        "predict",
        "--profile",
        &repo("profiles/fugaku.toml"),
        "--config",
        "gpt2-124m",
        "--batch",
        "1024",
        "--micro-batch-size",
        "1",
        "--nodes",
        "1,16,256",
        "--format",
        "json",
    ]);
    std::fs::write(&pred, ok(&o)).unwrap();
    let rep = out.join("rep");
    let run = fixtures().join("dp2").display().to_string();
    for how in [
        vec!["--predict", pred.to_str().unwrap()],
        vec![pred.to_str().unwrap()],
    ] {
        let _ = std::fs::remove_dir_all(&rep);
        let mut args = vec!["report", &run];
        args.extend(how);
        args.extend(["--out", rep.to_str().unwrap()]);
        ok(&fugu(&args));
        let md = std::fs::read_to_string(rep.join("REPORT.md")).unwrap();
        assert!(md.contains("## Predictions"), "{md}");
        for svg in [
            "predict-tflops.svg",
            "predict-step.svg",
            "predict-breakdown.svg",
        ] {
            let s = std::fs::read_to_string(rep.join(svg)).unwrap();
            assert!(
                s.starts_with("<svg") && s.contains("measured runs")
                    || svg == "predict-breakdown.svg"
            );
        }
        let csv = std::fs::read_to_string(rep.join("predict.csv")).unwrap();
        assert_eq!(csv.lines().count(), 4, "{csv}");
        assert!(
            csv.lines().nth(3).unwrap().contains(",256,1024,1,1,1024,"),
            "{csv}"
        );
    }
}

/// Memory is the fullest pipeline stage's (1F1B keeps `p − s` micro-batches in flight on stage
/// `s`), against the layout's own ranks per node; `--recompute` trades time for memory; a
/// layout that does not fit is named on stderr and fails unless allowed.
#[test]
fn memory_is_the_fullest_stage_and_a_layout_that_does_not_fit_fails() {
    let fugaku = repo("profiles/fugaku.toml");
    // The published 30B layout: TP 4 x PP 48, one rank per node, 1024 micro-batches of 1.
    let thirty = [
        "--profile",
        fugaku.as_str(),
        "--config",
        "gpt-30b",
        "--tp",
        "4",
        "--pp",
        "48",
        "--ranks-per-node",
        "1",
        "--threads",
        "48",
        "--nodes",
        "192",
        "--batch",
        "1024",
        "--micro-batch-size",
        "1",
    ];
    let mut a = vec!["predict"];
    a.extend_from_slice(&thirty);
    let o = fugu(&a);
    let e = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("pipeline stage 0 needs") && e.contains("32.00 GiB available"),
        "{e}"
    );
    assert!(e.contains("--allow-oversubscribed-memory"), "{e}");
    let mut allowed = thirty.to_vec();
    allowed.push("--allow-oversubscribed-memory");
    let p = &predictions(&allowed)[0];
    // Stage 0 holds 48 micro-batches' activations of one block; the last stage one
    // micro-batch's plus the LM head: the first is the fullest, and over 32 GiB.
    assert_eq!(p["memory_stage"], 0);
    let mem = p["memory_gib_per_rank"].as_f64().unwrap();
    assert!(mem > 32.0 && !p["fits"].as_bool().unwrap(), "{p}");

    // 1.3B on one node as one rank: the whole node's 32 GiB is that rank's (the profile's
    // default of 4 ranks per node would give it 8).
    let one = |extra: &[&str]| {
        let mut a = vec![
            "--profile",
            fugaku.as_str(),
            "--config",
            "gpt-1.3b",
            "--ranks-per-node",
            "1",
            "--threads",
            "48",
            "--batch",
            "8",
            "--micro-batch-size",
            "2",
        ];
        a.extend_from_slice(extra);
        predictions(&a)[0].clone()
    };
    let plain = one(&[]);
    assert!(plain["fits"].as_bool().unwrap(), "{plain}");
    assert_eq!(plain["memory_gib_available"].as_f64(), Some(32.0));
    // Recomputation: less memory, more time (attention: the scores and softmax again; full:
    // every block's forward pass but the last again, about a third more compute).
    let att = one(&["--recompute", "attention"]);
    let full = one(&["--recompute", "full"]);
    let mem = |p: &Value| p["memory_gib_per_rank"].as_f64().unwrap();
    let step = |p: &Value| p["step_ms"].as_f64().unwrap();
    assert!(mem(&full) < mem(&att) && mem(&att) < mem(&plain));
    assert!(step(&plain) < step(&att) && step(&att) < step(&full));
    let extra = step(&full) / step(&plain) - 1.0;
    assert!((0.25..0.34).contains(&extra), "full recompute adds {extra}");
    assert!(full["timers_ms"]["backward:recompute"].as_f64().unwrap() > 0.0);
    assert!(
        att["timers_ms"]["backward:attention:recompute"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    // The loss in chunks of 512 rows: the logits of 512 rows instead of the micro-batch's
    // 2 × 1024 (f32, the padded vocabulary of 50,304), plus the head's input gradient (2048 ×
    // 2048), and the same time.
    let chunk = one(&["--loss-chunk", "512"]);
    let saved = (mem(&plain) - mem(&chunk)) * (1u64 << 30) as f64;
    let want = ((2048 - 512) * 50_304 - 2048 * 2048) as f64 * 4.0;
    assert!(
        (saved - want).abs() < 1e-3 * want,
        "saved {saved} bytes, want {want}"
    );
    assert_eq!(step(&chunk), step(&plain));
}

/// `fugu predict profile --base --fit`: the data-parallel class's inter-node bandwidth fitted
/// to the published 124M run on 512 nodes reproduces it, leaves the tensor-parallel point (its
/// own class) where it was, and the rest are printed as out-of-sample errors
/// (docs/PREDICT.md records them).
#[test]
fn published_fugaku_runs_fit_the_data_parallel_class() {
    let out = tmp("fit");
    let fitted = out.join("fitted.toml");
    let o = fugu(&[
        "predict",
        "profile",
        "--base",
        &repo("profiles/fugaku.toml"),
        "--fit",
        &repo("profiles/fugaku-published-runs.toml"),
        "--fit-params",
        "dp.inter.beta_gbs",
        "--out",
        fitted.to_str().unwrap(),
    ]);
    let table = ok(&o);
    println!("{table}");
    let row = |name: &str| -> Vec<String> {
        let line = table.lines().find(|l| l.starts_with(name)).unwrap();
        line[44..].split_whitespace().map(str::to_owned).collect()
    };
    // fit, measured, before, error, after, error, unit
    let err = |name: &str| row(name)[5].trim_end_matches('%').parse::<f64>().unwrap();
    assert_eq!(row("124M DP, 512 nodes")[0], "yes");
    assert!(err("124M DP, 512 nodes").abs() <= 1.0, "{table}");
    assert!(err("124M DP, 1 node").abs() <= 1.0, "{table}");
    // Tensor-parallel traffic keeps its own (the network's) links: 1.3B TP 4 on 4 nodes is
    // unchanged by the fit.
    let tp = row("1.3B TP 4 across 4 nodes");
    assert_eq!(tp[2], tp[4], "{table}");
    assert!(table.contains("fitted dp.inter.beta_gbs = "), "{table}");
    // The written profile holds the class and predicts what the fit printed.
    let text = std::fs::read_to_string(&fitted).unwrap();
    assert!(text.contains("[network.dp.inter]"), "{text}");
    let p = &predictions(&[
        "--profile",
        fitted.to_str().unwrap(),
        "--config",
        "gpt2-124m",
        "--batch",
        "1024",
        "--micro-batch-size",
        "1",
        "--ranks-per-node",
        "1",
        "--threads",
        "48",
        "--tflops-per-node",
        "1.09",
        "--nodes",
        "512",
    ])[0];
    let tf = p["tflops_per_node"].as_f64().unwrap();
    assert!((tf - 0.16).abs() < 0.0025, "{tf}");

    for (args, want) in [
        (vec!["--fit-params", "dp.inter.gamma"], "expected CLASS"),
        (vec!["--fit-params", "dp.inter.beta_gbs"], "nothing to fit"),
    ] {
        let runs = out.join("nofit.toml");
        std::fs::write(
            &runs,
            std::fs::read_to_string(repo("profiles/fugaku-published-runs.toml"))
                .unwrap()
                .replace("fit = true", "fit = false"),
        )
        .unwrap();
        let mut a = vec![
            "predict",
            "profile",
            "--base",
            fugaku_path(),
            "--fit",
            runs.to_str().unwrap(),
            "--out",
            "/dev/null",
        ];
        a.extend(args);
        let o = fugu(&a);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(want), "{e}");
    }
}

fn fugaku_path() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/profiles/fugaku.toml")
}

/// `fugu predict --search`: ranked best first, every layout within memory, and the best
/// layout's printed settings, given back to `fugu predict`, predict the same step (what the
/// search assumed is what those flags run).
#[test]
fn search_ranks_layouts_and_its_settings_reproduce_the_best() {
    let fugaku = repo("profiles/fugaku.toml");
    let o = fugu(&[
        "predict",
        "--profile",
        &fugaku,
        "--config",
        "gpt-1.3b",
        "--batch",
        "256",
        "--nodes",
        "16,64",
        "--search",
        "--top",
        "4",
        "--format",
        "json",
    ]);
    let v: Value = serde_json::from_str(&ok(&o)).unwrap();
    let per_nodes = v.as_array().unwrap();
    assert_eq!(per_nodes.len(), 2);
    for found in per_nodes {
        let layouts = found["layouts"].as_array().unwrap();
        assert_eq!(layouts.len(), 4, "{found}");
        assert!(found["predicted"].as_u64().unwrap() >= 4);
        let tf: Vec<f64> = layouts
            .iter()
            .map(|c| c["prediction"]["tflops_per_node"].as_f64().unwrap())
            .collect();
        assert!(tf.windows(2).all(|w| w[0] >= w[1]), "{tf:?}");
        assert!(layouts
            .iter()
            .all(|c| c["prediction"]["fits"].as_bool().unwrap()));
        // The best against plain data parallelism at the profile's 4 ranks per node (ZeRO-1
        // off, no recomputation, micro-batch 1): never worse.
        let nodes = found["nodes"].as_u64().unwrap().to_string();
        let plain = &predictions(&[
            "--profile",
            &fugaku,
            "--config",
            "gpt-1.3b",
            "--batch",
            "256",
            "--micro-batch-size",
            "1",
            "--nodes",
            &nodes,
            "--allow-oversubscribed-memory",
        ])[0];
        if plain["fits"].as_bool().unwrap() {
            assert!(tf[0] >= plain["tflops_per_node"].as_f64().unwrap());
        }
        // The best layout's settings, given back to `fugu predict`, predict the same step.
        let best = &layouts[0];
        let l = &best["prediction"]["layout"];
        let s = |k: &str| l[k].as_u64().unwrap().to_string();
        let pp_layers: Vec<String> = best["prediction"]["pp_layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.to_string())
            .collect();
        let mbs = best["micro_batch_size"].as_u64().unwrap().to_string();
        let zero = if l["zero"].as_bool().unwrap() {
            "1"
        } else {
            "0"
        };
        let flags = best["train_flags"].as_str().unwrap();
        assert!(
            flags.contains(&format!("--threads {}", s("threads_per_rank"))),
            "{flags}"
        );
        let again = &predictions(&[
            "--profile",
            &fugaku,
            "--config",
            "gpt-1.3b",
            "--batch",
            "256",
            "--nodes",
            &nodes,
            "--ranks-per-node",
            &s("ranks_per_node"),
            "--threads",
            &s("threads_per_rank"),
            "--tp",
            &s("tp"),
            "--pp",
            &s("pp"),
            "--pp-layers",
            &pp_layers.join(","),
            "--zero",
            zero,
            "--recompute",
            best["recompute"].as_str().unwrap(),
            "--micro-batch-size",
            &mbs,
        ])[0];
        assert_eq!(
            again["step_ms"], best["prediction"]["step_ms"],
            "{again}\n{best}"
        );
    }
}

/// Runs files may name `fugu train` run directories: the layout and the median step time come
/// from the run. The data-parallel class's intra-node bandwidth fitted to the 2-rank
/// data-parallel run reproduces it; the other seven runs are out-of-sample checks, printed.
#[test]
fn runs_are_fitted_from_their_directories() {
    let out = tmp("fit-dirs");
    let profile = vm_profile("fit-dirs-profile", false);
    let d = fixtures();
    let mut runs = String::new();
    for (name, fit) in [
        ("dp2", true),
        ("tp2", false),
        ("dp2z", false),
        ("pp2", false),
        ("dp4", false),
        ("tp2dp2", false),
        ("tp4", false),
    ] {
        runs += &format!(
            "[[run]]\nrun = \"{}\"\nfit = {fit}\n",
            d.join(name).display()
        );
    }
    let file = out.join("runs.toml");
    std::fs::write(&file, &runs).unwrap();
    let o = fugu(&[
        "predict",
        "profile",
        "--base",
        &profile,
        "--fit",
        file.to_str().unwrap(),
        "--fit-params",
        "dp.intra.beta_gbs",
        "--out",
        out.join("fitted.toml").to_str().unwrap(),
    ]);
    let table = ok(&o);
    println!("{table}");
    let cols = |name: &str| -> Vec<String> {
        let line = table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("{name} missing:\n{table}"));
        line.split_whitespace().map(str::to_owned).collect()
    };
    // name, fit, measured, before, error, after, error, unit
    let after_err = |name: &str| cols(name)[6].trim_end_matches('%').parse::<f64>().unwrap();
    assert_eq!(cols("dp2")[1], "yes");
    assert!(after_err("dp2").abs() <= 1.0, "{table}");
    assert_eq!(cols("dp2")[7], "ms/step");
    // Tensor parallelism and the pipeline keep their links: unchanged by the fit.
    for name in ["tp2", "tp4", "pp2"] {
        assert_eq!(cols(name)[3], cols(name)[5], "{name}: {table}");
    }
    // Every out-of-sample run within the 15% the validation holds them to.
    for name in ["tp2", "dp2z", "pp2", "dp4", "tp2dp2", "tp4"] {
        assert!(after_err(name).abs() <= 15.0, "{name}: {table}");
    }
    // A run directory says the layout: giving it as well is an error.
    std::fs::write(
        &file,
        format!(
            "[[run]]\nrun = \"{}\"\nnodes = 2\n",
            d.join("dp2").display()
        ),
    )
    .unwrap();
    let o = fugu(&[
        "predict",
        "profile",
        "--base",
        &profile,
        "--fit",
        file.to_str().unwrap(),
        "--out",
        out.join("x.toml").to_str().unwrap(),
    ]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("reads the layout"), "{e}");
}

/// A64FX by its kernels' rates (`profiles/fugaku-kernels.toml`): a GEMM op takes its FLOPs at
/// the precision's rate (fp16's time is fp32's times the rates' ratio), a row op its bytes at
/// the rank's share of the memory bandwidth (worked by hand for GELU; fp16 moves half the
/// bytes), and 16-bit activations fit twice the micro-batch. The largest micro-batch fits and
/// one more sequence does not; bf16, which A64FX lacks, is refused by the field's name.
#[test]
fn kernel_rates_time_fp16_against_fp32_and_find_the_largest_micro_batch() {
    let profile = repo("profiles/fugaku-kernels.toml");
    let at = |precision: &str, extra: &[&str]| {
        let mut a = vec![
            "--profile",
            profile.as_str(),
            "--config",
            "gpt2-124m",
            "--precision",
            precision,
        ];
        a.extend_from_slice(extra);
        predictions(&a)[0].clone()
    };
    let (f32_, f16) = (
        at("fp32", &["--batch", "16"]),
        at("fp16", &["--batch", "16"]),
    );
    let ms = |p: &Value, k: &str| p["timers_ms"][k].as_f64().unwrap();
    // GEMMs: the profile's rates, 123.8 and 233.2 GFLOP/s per core.
    for op in [
        "forward:mlp:mm",
        "backward:attention:qkv",
        "forward:lm-head",
    ] {
        let ratio = ms(&f16, op) / ms(&f32_, op);
        assert!((ratio - 123.8 / 233.2).abs() < 1e-9, "{op}: {ratio}");
    }
    // GELU forward, fp32: 4 sequences x 1024 tokens x 3072 x 12 blocks, read and written (8
    // bytes), at 804/4 GB/s.
    let gelu = 4.0 * 1024.0 * 3072.0 * 12.0 * 8.0 / (804e9 / 4.0) * 1e3;
    assert!((ms(&f32_, "forward:mlp:gelu") - gelu).abs() < 1e-9 * gelu);
    assert!((ms(&f16, "forward:mlp:gelu") - gelu / 2.0).abs() < 1e-9 * gelu);
    let step = |p: &Value| p["step_ms"].as_f64().unwrap();
    let speedup = step(&f32_) / step(&f16);
    assert!((1.7..1.95).contains(&speedup), "fp16 {speedup}x fp32");
    let mem = |p: &Value| p["memory_gib_per_rank"].as_f64().unwrap();
    assert!(mem(&f16) < 0.7 * mem(&f32_));

    let mbs = |p: &Value| p["micro_batch_size"].as_u64().unwrap() as usize;
    let (big32, big16) = (
        at("fp32", &["--largest-micro-batch"]),
        at("fp16", &["--largest-micro-batch"]),
    );
    assert!(mbs(&big16) >= 2 * mbs(&big32), "{big32} {big16}");
    for (precision, p) in [("fp32", &big32), ("fp16", &big16)] {
        assert!(p["fits"].as_bool().unwrap(), "{p}");
        // One more sequence per rank (4 data-parallel ranks on the node) does not fit.
        let more = (4 * (mbs(p) + 1)).to_string();
        let over = at(
            precision,
            &["--batch", &more, "--allow-oversubscribed-memory"],
        );
        assert!(!over["fits"].as_bool().unwrap(), "{over}");
    }

    let o = fugu(&["predict", "--profile", &profile, "--precision", "bf16"]);
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("compute.kernels.gemm_gflops_per_core.bf16"),
        "{e}"
    );
}

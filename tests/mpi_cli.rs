//! MPI data, tensor and pipeline parallelism end to end (`cargo test --features mpi --test mpi_cli`):
//! `mpirun -np 2 | 4 --oversubscribe fugu train` against one process on the same global batch.
//!
//! Every comparison is between a parallel run and a serial run that reads the same global
//! batch (`--data-ranks 2`, B doubled), over 4 AdamW steps of a small GPT-2.
//!
//! Tolerances, and why: the parallel runs change the order of floating-point sums (partial
//! GEMM products summed by the TP all-reduce, the gradient average over DP ranks, the gradient
//! norm summed per shard), nothing else. In fp32 that perturbs a gradient by a few ulp
//! (relative ~1e-7 to 1e-6 for elements that are sums of cancelling terms). AdamW divides each
//! gradient by √v, so after the first step the update of an element with a tiny gradient can
//! differ by a fraction of the learning rate: parameter differences are bounded by
//! steps × lr × (a small factor). We require |Δp| ≤ 2e-5 absolute after 4 steps at lr 1e-3
//! (observed: 0.7e-6 to 2.6e-6), first moments to 2e-7 (observed ≤ 1.1e-8), and per-step
//! losses to agree to 1e-5 relative (observed: equal to all printed digits).

#![cfg(feature = "mpi")]

mod common;

use common::ok;
use fugu::checkpoint;
use fugu::config::RunConfig;
use fugu::metrics::jsonl::{read_metrics, Record};
use fugu::model::registry;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const MODEL: &str = r#"
[model]
vocab_size = 1024
n_positions = 64
n_embd = 64
n_head = 4
n_layer = 2

[train]
batch_size = 4
seq_len = 32
steps = 4
lr = 1e-3
min_lr = 1e-4
warmup_steps = 2
lr_schedule = "cosine"
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
eps = 1e-8
grad_clip = 1.0
seed = 7
eval_every = 0
ckpt_every = 0
"#;

/// True (after saying so) when there is no `mpirun` to test with.
fn mpirun_missing() -> bool {
    let missing = Command::new("mpirun").arg("--version").output().is_err();
    if missing {
        eprintln!("skipped: mpirun not found");
    }
    missing
}

/// The same run with a Llama-family model of the same size: 4 query heads sharing 2
/// key/value heads, SwiGLU, an untied head (or a tied one).
fn llama_model(tied: bool) -> String {
    let model = format!(
        r#"[model]
arch = "llama"
vocab_size = 1024
n_positions = 64
n_embd = 64
n_head = 4
n_kv_head = 2
n_layer = 2
intermediate_size = 96
rope_theta = 10000.0
norm_eps = 1e-5
tie_embeddings = {tied}
"#
    );
    let train = &MODEL[MODEL.find("[train]").unwrap()..];
    format!("{model}\n{train}")
}

/// A scratch folder with the test model (`m.toml`) and a token stream (`tok.bin`).
fn tmp(name: &str) -> PathBuf {
    tmp_with(name, MODEL)
}

/// [`tmp`] with the model config `model`.
fn tmp_with(name: &str, model: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fugu-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("m.toml"), model).unwrap();
    // A deterministic token stream below the vocabulary (LCG), 20k tokens.
    let mut x = 12345u32;
    let ids: Vec<u8> = (0..20_000)
        .flat_map(|_| {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (((x >> 16) % 1000) as u16).to_le_bytes()
        })
        .collect();
    std::fs::write(d.join("tok.bin"), ids).unwrap();
    d
}

/// Runs `fugu train` in `dir` with `np` ranks (0 = no mpirun) and the common flags (the
/// test model and data unless `extra` names a `--config`).
fn train(dir: &Path, np: usize, extra: &[&str]) -> Output {
    train_env(dir, np, extra, &[])
}

/// [`train`] with environment variables `env` set for every rank.
fn train_env(dir: &Path, np: usize, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let mut args: Vec<String> = vec!["train".into()];
    if !extra.contains(&"--config") {
        args.extend(["--config", "m.toml", "--data", "tok.bin"].map(String::from));
    }
    args.extend(["--no-shuffle", "--threads", "1", "--timers", "coarse"].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    fugu_ranks(dir, np, &args, env)
}

/// Runs `fugu ARGS` in `dir` as `np` MPI ranks (0 = no mpirun) with `env` set for every rank.
fn fugu_ranks(dir: &Path, np: usize, args: &[String], env: &[(&str, &str)]) -> Output {
    let exe = env!("CARGO_BIN_EXE_fugu");
    let mut cmd = if np == 0 {
        Command::new(exe)
    } else {
        let mut c = Command::new("mpirun");
        c.args([
            "-np",
            &np.to_string(),
            "--oversubscribe",
            "--bind-to",
            "none",
            exe,
        ]);
        c
    };
    cmd.args(args)
        .current_dir(dir)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .env("FUGU_PEAK_GFLOPS_PER_CORE", "100")
        .envs(env.iter().copied())
        .output()
        .expect("running fugu")
}

/// Asserts that a run failed and said `says` on stderr.
fn refused(out: &Output, says: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {err}");
    assert!(err.contains(says), "{err}");
}

/// The loss of every step, the last record of each step where a resume from an older
/// checkpoint ran it again.
fn losses(run: &Path) -> Vec<f64> {
    let mut by_step = std::collections::BTreeMap::new();
    for r in read_metrics(run.join("metrics.jsonl")).unwrap() {
        if let Record::Step(s) = r {
            by_step.insert(s.step, s.loss);
        }
    }
    by_step.into_values().collect()
}

fn params_of(ckpt: &Path) -> (Vec<f32>, Vec<f32>) {
    let m = RunConfig::load(ckpt.join("../../m.toml").to_str().unwrap())
        .unwrap()
        .model;
    let t = registry::full_params(&m).unwrap();
    let mut p = vec![0.0; t.total()];
    checkpoint::load_hf(ckpt)
        .unwrap()
        .copy_into(&t, &mut p)
        .unwrap();
    let (mut mm, mut vv) = (vec![0.0; t.total()], vec![0.0; t.total()]);
    checkpoint::load_optimizer(ckpt, &registry::hf_layout(&m), &t, &mut mm, &mut vv).unwrap();
    (p, mm)
}

/// Asserts that two runs agree (see the module docs for the tolerances).
fn assert_same(a: &Path, b: &Path, step: u64, what: &str) {
    let (la, lb) = (losses(a), losses(b));
    assert_eq!(la.len(), lb.len(), "{what}: step counts");
    for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert!(
            ((x - y) / x).abs() <= 1e-5,
            "{what}: loss at step {} differs: {x} vs {y}",
            i + 1
        );
    }
    let ck = format!("ckpt-{step:08}");
    let (pa, ma) = params_of(&a.join(&ck));
    let (pb, mb) = params_of(&b.join(&ck));
    let dp = pa
        .iter()
        .zip(&pb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    let dm = ma
        .iter()
        .zip(&mb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("{what}: max |dparam| {dp:.3e}, max |dm| {dm:.3e}");
    assert!(dp <= 2e-5, "{what}: parameters differ by {dp}");
    assert!(dm <= 2e-7, "{what}: first moments differ by {dm}");
}

/// The serial reference: B = 4 read as 2 data streams (the global batch of dp = 2 × B = 2).
fn serial(dir: &Path) -> PathBuf {
    let out = dir.join("serial");
    ok(&train(dir, 0, &["--data-ranks", "2", "--out", "serial"]));
    out
}

/// Continues run `out` (in `dir`) to step 4 from its newest checkpoint with `np` ranks in
/// the layout `layout`, and checks it against the serial run `s`.
fn resume_to_4(dir: &Path, s: &Path, np: usize, out: &str, layout: &[&str], what: &str) -> Output {
    let mut args = layout.to_vec();
    args.extend(["--steps", "4", "--resume", "auto", "--out", out]);
    let o = train(dir, np, &args);
    ok(&o);
    assert_same(s, &dir.join(out), 4, what);
    o
}

#[test]
fn parallel_layouts_match_the_serial_run() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("layouts");
    let s = serial(&dir);
    // dp = 2 (B = 2 per rank), tp = 2 (one replica of B = 4), tp = 2 x dp = 2, ZeRO-1 dp = 2
    // with small buckets so that blocks cross tensor boundaries; tp = 2 with the projections
    // adding onto the residual stream in their GEMMs (the first rank adds the stream, the
    // all-reduce sums it with the other rank's partial product: a different order of f32
    // sums, inside the same tolerances); tp = 2 x dp = 2 with the LM head and loss in chunks
    // of 24 rows (of 64: the vocabulary-parallel loss all-reduced per chunk, the head's
    // weight gradient summed per chunk, inside the same tolerances).
    let tp2 = vec!["--tp", "2", "--data-ranks", "2"];
    let epilogue = [("FUGU_RESIDUAL", "epilogue")];
    for (name, np, extra, env) in [
        ("dp2", 2, vec!["--batch-size", "2"], &[][..]),
        ("tp2", 2, tp2.clone(), &[]),
        ("tp2-residual", 2, tp2, &epilogue),
        (
            "tp2dp2-loss-chunk",
            4,
            vec!["--tp", "2", "--batch-size", "2", "--loss-chunk", "24"],
            &[],
        ),
        (
            "zero1",
            2,
            vec!["--batch-size", "2", "--zero", "1", "--bucket-mb", "0.05"],
            &[],
        ),
    ] {
        let mut args = extra.clone();
        args.extend(["--out", name]);
        let out = train_env(&dir, np, &args, env);
        ok(&out);
        assert_same(&s, &dir.join(name), 4, name);
        // The header records the layout and the per-step records the cross-rank timers.
        let recs = read_metrics(dir.join(name).join("metrics.jsonl")).unwrap();
        let Some(Record::Header(h)) = recs.first() else {
            panic!("no header")
        };
        assert_eq!(h["layout"]["world"], np, "{name}");
        let residual = if env.is_empty() {
            "separate"
        } else {
            "epilogue"
        };
        assert_eq!(h["residual"], residual, "{name}");
        let step = recs
            .iter()
            .find_map(|r| match r {
                Record::Step(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap();
        assert!(step.comm_bytes.unwrap() > 0, "{name}");
        for key in step.timers.keys() {
            assert!(
                step.timers_min[key] <= step.timers[key] + 1e-9,
                "{name} {key}"
            );
            assert!(
                step.timers[key] <= step.timers_max[key] + 1e-9,
                "{name} {key}"
            );
        }
        let must: &[&str] = match name {
            "tp2" | "tp2-residual" | "tp2dp2" => &[
                "forward:attention:allreduce",
                "forward:mlp:allreduce",
                "backward:attention:allreduce",
                "backward:mlp:allreduce",
            ],
            _ => &["allreduce-params"],
        };
        for m in must {
            assert!(step.timers.contains_key(*m), "{name}: no {m} timer");
        }
    }
    // ZeRO-1 halves the AdamW moments per rank.
    let recs = read_metrics(dir.join("zero1").join("metrics.jsonl")).unwrap();
    let Some(Record::Header(h)) = recs.first() else {
        panic!()
    };
    let (pg, mom) = (
        h["memory"]["params_grads_bytes"].as_f64().unwrap(),
        h["memory"]["adam_moment_bytes"].as_f64().unwrap(),
    );
    assert!(
        (mom / pg - 0.5).abs() < 0.01,
        "moments {mom} vs params+grads {pg}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The Llama family through every layout (grouped-query attention split by key/value heads
/// under tp 2, the untied head on the last stage, ZeRO-1), against its serial run with the same
/// tolerances as GPT-2's; and pp 2 with tied embeddings (the two stages' copies of the
/// embedding all-reduced).
#[test]
fn llama_layouts_match_the_serial_run() {
    if mpirun_missing() {
        return;
    }
    for tied in [false, true] {
        let dir = tmp_with(&format!("llama-{tied}"), &llama_model(tied));
        let s = serial(&dir);
        let pp2 = vec!["--pp", "2", "--micro-batches", "2", "--data-ranks", "2"];
        let layouts = if tied {
            vec![("pp2", 2, pp2)]
        } else {
            vec![
                ("tp2", 2, vec!["--tp", "2", "--data-ranks", "2"]),
                ("pp2", 2, pp2),
                (
                    // With the LM head and loss in chunks of 24 rows (of 64).
                    "pp2tp2-loss-chunk",
                    4,
                    vec![
                        "--pp",
                        "2",
                        "--tp",
                        "2",
                        "--micro-batches",
                        "2",
                        "--data-ranks",
                        "2",
                        "--loss-chunk",
                        "24",
                    ],
                ),
                (
                    "zero1",
                    2,
                    vec!["--batch-size", "2", "--zero", "1", "--bucket-mb", "0.05"],
                ),
            ]
        };
        for (name, np, extra) in layouts {
            let mut args = extra.clone();
            args.extend(["--out", name]);
            ok(&train(&dir, np, &args));
            let what = format!("llama (tied {tied}) {name}");
            assert_same(&s, &dir.join(name), 4, &what);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Pipeline parallelism: pp 2 (one block per stage of the 2-block model, the first with the
/// embeddings, the last with the head), alone, with tp 2 (and full recomputation) or with
/// dp 2 and ZeRO-1, on the serial run's global batch; evaluation through the pipeline. The micro-batches of a pipeline accumulate gradients, which
/// changes only the order of sums (as gradient accumulation does serially), so the same
/// tolerances hold. Checkpoints from the pipelined runs hold the whole model (checked by
/// `assert_same`) and a pp 2 checkpoint resumes on one process.
#[test]
fn pipeline_layouts_match_the_serial_run() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("pipeline");
    let s = serial(&dir);
    for (name, np, extra) in [
        (
            "pp2",
            2,
            vec!["--pp", "2", "--micro-batches", "4", "--data-ranks", "2"],
        ),
        (
            "pp2tp2",
            4,
            vec![
                "--pp",
                "2",
                "--tp",
                "2",
                "--micro-batches",
                "2",
                "--data-ranks",
                "2",
                "--recompute",
                "full",
            ],
        ),
        (
            "pp2dp2zero1",
            4,
            vec![
                "--pp",
                "2",
                "--batch-size",
                "2",
                "--micro-batches",
                "2",
                "--zero",
                "1",
                "--bucket-mb",
                "0.05",
            ],
        ),
    ] {
        let mut args = extra.clone();
        args.extend(["--out", name]);
        ok(&train(&dir, np, &args));
        assert_same(&s, &dir.join(name), 4, name);
        let recs = read_metrics(dir.join(name).join("metrics.jsonl")).unwrap();
        let Some(Record::Header(h)) = recs.first() else {
            panic!("no header")
        };
        assert_eq!(h["layout"]["pp"], 2, "{name}");
        let step = recs
            .iter()
            .find_map(|r| match r {
                Record::Step(s) => Some(s.clone()),
                _ => None,
            })
            .unwrap();
        for m in [
            "pipeline:send",
            "pipeline:recv",
            "pipeline:bubble",
            "pipeline:tied-wte:allreduce",
        ] {
            assert!(step.timers.contains_key(m), "{name}: no {m} timer");
        }
    }
    // Evaluation runs through the pipeline too (forward passes only): the validation loss
    // equals the serial run's.
    let val = |name: &str, np: usize, extra: &[&str]| -> Vec<f64> {
        let mut args = extra.to_vec();
        // gpt2-tiny (4 blocks) on the bundled corpus, which has a validation split.
        args.extend([
            "--config",
            "gpt2-tiny",
            "--batch-size",
            "4",
            "--seq-len",
            "32",
        ]);
        args.extend(["--steps", "4", "--eval-every", "2", "--eval-batches", "2"]);
        args.extend(["--out", name]);
        ok(&train(&dir, np, &args));
        read_metrics(dir.join(name).join("metrics.jsonl"))
            .unwrap()
            .into_iter()
            .filter_map(|r| match r {
                Record::Eval(e) => Some(e.val_loss),
                _ => None,
            })
            .collect()
    };
    let (a, b) = (
        val("serial-eval", 0, &[]),
        val("pp2-eval", 2, &["--pp", "2", "--micro-batches", "4"]),
    );
    assert_eq!(a.len(), 2, "evaluations at steps 2 and 4");
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!(((x - y) / x).abs() <= 1e-5, "val loss {x} vs {y}");
    }
    // A pp 2 run stopped after 2 steps, finished by one process.
    ok(&train(
        &dir,
        2,
        &[
            "--pp",
            "2",
            "--data-ranks",
            "2",
            "--steps",
            "2",
            "--out",
            "resumed",
        ],
    ));
    resume_to_4(
        &dir,
        &s,
        0,
        "resumed",
        &["--data-ranks", "2"],
        "pp2 -> serial",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Sharded checkpoints: a pp 2 x tp 2 run writes its checkpoint from 4 ranks as 4 model and 4
/// optimizer shards with Hugging Face style indexes (no single file), and that checkpoint
/// resumes on one process and on tp 2 x dp 2 to match the uninterrupted serial run. A
/// checkpoint with a shard missing is passed over by `--resume auto`, as is a temporary folder
/// left by a writer that was killed.
#[test]
fn sharded_checkpoints_resume_under_any_layout() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("sharded");
    let s = serial(&dir);
    let pp2tp2 = [
        "--pp",
        "2",
        "--tp",
        "2",
        "--micro-batches",
        "2",
        "--data-ranks",
        "2",
    ];
    let mut first = pp2tp2.to_vec();
    first.extend(["--steps", "2", "--out", "a"]);
    ok(&train(&dir, 4, &first));
    let ck = dir.join("a").join("ckpt-00000002");
    for kind in ["model", "optimizer"] {
        for i in 1..=4 {
            let f = ck.join(format!("{kind}-{i:05}-of-00004.safetensors"));
            assert!(f.is_file(), "{} missing", f.display());
        }
        let index: serde_json::Value = serde_json::from_slice(
            &std::fs::read(ck.join(format!("{kind}.safetensors.index.json"))).unwrap(),
        )
        .unwrap();
        let map = index["weight_map"].as_object().unwrap();
        let per_tensor = if kind == "model" { 1 } else { 2 };
        assert_eq!(map.len(), per_tensor * (2 + 2 * 12 + 2), "{kind} index");
        assert!(index["metadata"]["total_size"].as_u64().unwrap() > 0);
    }
    assert!(!ck.join("model.safetensors").exists());
    // Its weights (a sharded Hugging Face directory) also start a new run.
    let ck_arg = ck.to_string_lossy().into_owned();
    ok(&train(
        &dir,
        0,
        &["--init-from", &ck_arg, "--steps", "1", "--out", "init"],
    ));
    let copy = |to: &str| {
        let st = Command::new("cp")
            .args(["-r", "a", to])
            .current_dir(&dir)
            .status()
            .unwrap();
        assert!(st.success());
    };
    copy("b");
    copy("c");
    resume_to_4(&dir, &s, 0, "a", &["--data-ranks", "2"], "pp2tp2 -> serial");
    resume_to_4(
        &dir,
        &s,
        4,
        "b",
        &["--tp", "2", "--batch-size", "2"],
        "pp2tp2 -> tp2dp2",
    );
    // c: on to step 4 in the same layout, then damage that checkpoint and leave a killed
    // writer's temporary folder: --resume auto must go back to step 2.
    resume_to_4(&dir, &s, 4, "c", &pp2tp2, "pp2tp2 resumed");
    let c = dir.join("c");
    let ck4 = c.join("ckpt-00000004");
    std::fs::remove_file(ck4.join("model-00003-of-00004.safetensors")).unwrap();
    let killed = c.join(".tmp-ckpt-00000006-12345");
    std::fs::create_dir_all(&killed).unwrap();
    let shard1 = "model-00001-of-00004.safetensors";
    std::fs::copy(ck4.join(shard1), killed.join(shard1)).unwrap();
    let out = resume_to_4(
        &dir,
        &s,
        0,
        "c",
        &["--data-ranks", "2"],
        "damaged passed over",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("passing over damaged checkpoint ckpt-00000004")
            && err.contains("model-00003-of-00004.safetensors"),
        "{err}"
    );
    // Every checkpoint event records the peak RSS before and after writing.
    let recs = read_metrics(dir.join("b").join("metrics.jsonl")).unwrap();
    let ev = recs
        .iter()
        .find_map(|r| match r {
            Record::Event { kind, data } if kind == "checkpoint" => Some(data.clone()),
            _ => None,
        })
        .unwrap();
    assert!(
        ev["peak_rss_after_bytes"].as_f64().unwrap()
            >= ev["peak_rss_before_bytes"].as_f64().unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn checkpoints_reshard_between_layouts() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("reshard");
    let s = serial(&dir);
    // tp 2 x dp 2 for 2 steps, then one process finishes the run ...
    ok(&train(
        &dir,
        4,
        &[
            "--tp",
            "2",
            "--batch-size",
            "2",
            "--steps",
            "2",
            "--out",
            "a",
        ],
    ));
    resume_to_4(&dir, &s, 0, "a", &["--batch-size", "4"], "tp2dp2 -> serial");
    // ... and the reverse, with ZeRO-1 on the way back.
    ok(&train(
        &dir,
        0,
        &["--data-ranks", "2", "--steps", "2", "--out", "b"],
    ));
    resume_to_4(
        &dir,
        &s,
        4,
        "b",
        &["--tp", "2", "--batch-size", "2", "--zero", "1"],
        "serial -> tp2dp2 zero1",
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_error_on_one_rank_ends_the_job() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("fail");
    // Rank 1 of 2 reads the second half of the file; put a token id beyond the vocabulary
    // there. Rank 0's data is fine, so it would wait in the gradient all-reduce forever
    // without MPI_Abort.
    let mut ids = std::fs::read(dir.join("tok.bin")).unwrap();
    let at = 2 * (ids.len() / 2 / 2 + 10);
    ids[at..at + 2].copy_from_slice(&5000u16.to_le_bytes());
    std::fs::write(dir.join("tok.bin"), ids).unwrap();
    let t0 = Instant::now();
    let out = train(&dir, 2, &["--batch-size", "2", "--out", "f"]);
    let took = t0.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("error on rank 1 of 2"), "{err}");
    assert!(err.contains("5000"), "{err}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    // No checkpoint, complete or partial, was left behind.
    let left: Vec<_> = std::fs::read_dir(dir.join("f"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        left.iter()
            .all(|n| !n.to_string_lossy().starts_with("ckpt")),
        "{left:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_layouts_are_refused_with_the_reason() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("badtp");
    let out = train(&dir, 2, &["--tp", "3", "--out", "x"]);
    refused(&out, "--tp 3 does not divide the number of MPI ranks (2)");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Mixed precision composes with the layouts: bf16 under tensor parallelism (its all-reduces
/// of 16-bit activations go through f32 on the host and are rounded back) and fp16 with loss
/// scaling under ZeRO-1 data parallelism track the serial run of the same precision.
///
/// Tolerances: data parallelism changes only f32 sums (the gradient average), so fp16 ZeRO-1
/// losses agree as in fp32 (1e-5). Tensor parallelism also changes which partial sums are
/// rounded to bf16 (each shard's GEMM output is rounded before the all-reduce, the serial
/// run rounds the whole sum once), so activations differ by a bf16 rounding step here and
/// there, by a rounding step (2u) where they do; the per-step loss is a mean over B·T = 128
/// rows whose rounding differences are independent, so it is required within u/16 (2.4e-4;
/// observed 2.3e-5).
#[test]
fn mixed_precision_layouts_track_the_serial_run() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("mixed");
    for (p, name, np, extra, tol) in [
        (
            "bf16",
            "tp2",
            2,
            vec!["--tp", "2", "--data-ranks", "2"],
            1.0 / 4096.0,
        ),
        (
            "fp16",
            "zero1",
            2,
            vec!["--batch-size", "2", "--zero", "1"],
            1e-5,
        ),
    ] {
        let serial = format!("serial-{p}");
        ok(&train(
            &dir,
            0,
            &["--data-ranks", "2", "--precision", p, "--out", &serial],
        ));
        let par = format!("{name}-{p}");
        let mut args = extra.clone();
        args.extend(["--precision", p, "--out", &par]);
        ok(&train(&dir, np, &args));
        let (ls, lp) = (losses(&dir.join(&serial)), losses(&dir.join(&par)));
        assert_eq!(ls.len(), lp.len(), "{par}: step counts");
        let mut worst: f64 = 0.0;
        for (i, (x, y)) in ls.iter().zip(&lp).enumerate() {
            let rel = ((x - y) / x).abs();
            assert!(
                rel <= tol,
                "{par}: loss at step {} differs: {x} vs {y}",
                i + 1
            );
            worst = worst.max(rel);
        }
        eprintln!("{par}: losses within {worst:.2e} of the serial {p} run");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `fugu bench comm` on 2 and 3 ranks (3: blocks that do not divide the size): every operation
/// at every size, each result checked by the benchmark itself (a wrong transfer is an error,
/// not a number), positive times, bandwidths derived from them with nccl-tests' bus factors,
/// one JSON document from rank 0 only.
#[test]
fn bench_comm_reports_every_operation_and_size() {
    if mpirun_missing() {
        return;
    }
    for np in [2usize, 3] {
        let args = ["bench", "comm", "--max-size", "64KiB", "--repeats", "2"]
            .into_iter()
            .chain(["--format", "json"])
            .map(String::from)
            .collect::<Vec<_>>();
        let out = fugu_ranks(Path::new("."), np, &args, &[]);
        ok(&out);
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("np {np}: stdout is not one JSON document: {e}"));
        assert_eq!(doc["benchmark"], "comm");
        assert_eq!(doc["ranks"], np);
        let rows = doc["rows"].as_array().unwrap();
        let n = np as f64;
        for (op, factor) in [
            ("allreduce", 2.0 * (n - 1.0) / n),
            ("reduce-scatter", (n - 1.0) / n),
            ("allgather", (n - 1.0) / n),
            ("broadcast", 1.0),
            ("sendrecv", 1.0),
        ] {
            let mine: Vec<_> = rows.iter().filter(|r| r["op"] == op).collect();
            // 4 B .. 64 KiB is 15 sizes; the block collectives merge the sizes below one
            // block per rank (np = 3: 4 and 8 B both become 12 B).
            assert!(mine.len() >= 13, "np {np} {op}: {} rows", mine.len());
            let mut last = 0;
            for r in mine {
                let bytes = r["bytes"].as_u64().unwrap();
                let t = r["time_us"].as_f64().unwrap();
                let (alg, bus) = (
                    r["algbw_gbs"].as_f64().unwrap(),
                    r["busbw_gbs"].as_f64().unwrap(),
                );
                assert!(
                    bytes > last && bytes <= 65_536,
                    "np {np} {op}: sizes {last} then {bytes}"
                );
                assert!(
                    t > 0.0 && r["min_time_us"].as_f64().unwrap() <= t,
                    "np {np} {op}: {r}"
                );
                assert!(
                    (alg - bytes as f64 / t / 1e3).abs() <= 1e-9 * alg,
                    "np {np} {op}: {r}"
                );
                assert!(
                    (bus - alg * factor).abs() <= 1e-9 * alg,
                    "np {np} {op}: {r}"
                );
                last = bytes;
            }
        }
    }
}

/// `fugu bench comm --group dp|tp`: the data- and tensor-parallel groups of a tp 2 grid on 4
/// ranks measured as a training step has them (2 ranks each, all groups at once), and `fugu
/// predict profile` turning the files into the classes' own links; a class whose groups have
/// one rank is a clear error.
#[test]
fn bench_comm_measures_a_traffic_class_and_predict_fits_its_links() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("comm-groups");
    let run = |extra: &[&str]| -> Output {
        let args: Vec<String> = ["bench", "comm", "--op", "sendrecv,allreduce"]
            .into_iter()
            .chain(["--max-size", "1MiB", "--repeats", "2", "--format", "json"])
            .chain(extra.iter().copied())
            .map(String::from)
            .collect();
        fugu_ranks(&dir, 4, &args, &[])
    };
    let mut files = Vec::new();
    for (class, extra) in [
        ("world", vec![]),
        ("dp", vec!["--tp", "2", "--group", "dp"]),
        ("tp", vec!["--tp", "2", "--group", "tp"]),
    ] {
        let out = run(&extra);
        ok(&out);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        if class == "world" {
            assert_eq!(doc["ranks"], 4);
            assert!(doc.get("group").is_none(), "{doc}");
        } else {
            assert_eq!(
                (
                    &doc["group"],
                    &doc["ranks"],
                    &doc["job_ranks"],
                    &doc["nodes"]
                ),
                (
                    &serde_json::json!(class),
                    &serde_json::json!(2),
                    &serde_json::json!(4),
                    &serde_json::json!(1)
                ),
                "{doc}"
            );
            // The benchmark checked every result on the 2-rank groups (all-reduce sums of 2).
            assert!(doc["rows"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["ranks"] == 2));
        }
        let f = dir.join(format!("{class}.json"));
        std::fs::write(&f, text).unwrap();
        files.push(f);
    }
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/predict/vm-zen4/ref");
    let profile = dir.join("p.toml");
    let mut args: Vec<String> = vec!["predict".into(), "profile".into(), "--run".into()];
    args.push(fixtures.display().to_string());
    for f in &files {
        args.extend(["--comm".into(), f.display().to_string()]);
    }
    args.extend(["--cores-per-node", "2", "--memory-gib", "24", "--out"].map(String::from));
    args.push(profile.display().to_string());
    let out = fugu_ranks(&dir, 0, &args, &[]);
    ok(&out);
    let text = std::fs::read_to_string(&profile).unwrap();
    for section in ["[network.tp.intra]", "[network.dp.intra]"] {
        assert!(text.contains(section), "{section} missing:\n{text}");
    }
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("dp traffic's intra-node link"), "{e}");

    let out = run(&["--group", "tp"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("have one rank each"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `fugu eval` on every layout: the serial run's checkpoint evaluated by 2 ranks as --tp 2 and
/// as --pp 2 gives the serial evaluation's loss (the same forward pass with its sums in
/// another order: 1e-5 relative, as the training losses above).
#[test]
fn eval_on_parallel_layouts_matches_the_serial_evaluation() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("eval");
    serial(&dir);
    let eval = |np: usize, layout: &[&str]| -> f64 {
        let args: Vec<String> = ["eval", "serial", "--data", "tok.bin", "--batches", "3"]
            .into_iter()
            .chain(["--threads", "1", "--format", "json"])
            .chain(layout.iter().copied())
            .map(String::from)
            .collect();
        let o = fugu_ranks(&dir, np, &args, &[]);
        ok(&o);
        let r: serde_json::Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)));
        r["loss"].as_f64().unwrap()
    };
    let one = eval(0, &[]);
    for layout in [&["--tp", "2"][..], &["--pp", "2"][..]] {
        let l = eval(2, layout);
        eprintln!("eval {layout:?}: {l} vs serial {one}");
        assert!(((l - one) / one).abs() <= 1e-5, "{layout:?}: {l} vs {one}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Data parallelism on GPU ranks with the gradient buckets handed to MPI as device addresses
/// (`FUGU_CUDA_AWARE_MPI=on`) trains to the same bits as through host memory: the same sums
/// by the same MPI, the same f32 multiply for the average. Runs on the CUDA emulator, whose
/// device memory is host memory that this MPI (not CUDA-aware) can read: it covers fugu's side
/// (the addresses, the waits, the sums buffer, the average and copy back on the device), not a
/// CUDA-aware MPI's. `auto` stays on host memory with an MPI that does not say it takes GPU
/// memory; `on` is refused, by name, with host buffers and with ZeRO-1.
#[test]
#[cfg(feature = "cuda")]
fn device_buckets_train_as_host_staged() {
    if mpirun_missing() {
        return;
    }
    let dir = tmp("device-buckets");
    let emulate = (fugu::backend::cuda::EMULATE_ENV, "1");
    let run = |memory: &str| {
        let out = format!("dp2-{memory}");
        let env = [emulate, ("FUGU_CUDA_AWARE_MPI", memory)];
        let args = ["--device", "cuda", "--bucket-mb", "0.02", "--out", &out];
        ok(&train_env(&dir, 2, &args, &env));
        let recs = read_metrics(dir.join(&out).join("metrics.jsonl")).unwrap();
        let Some(Record::Header(h)) = recs.first() else {
            panic!("no header in {out}")
        };
        assert!(h["layout"]["buckets"].as_u64().unwrap() > 3, "{h}");
        let staging = h["layout"]["bucket_memory"].as_str().unwrap().to_string();
        let sums = h["memory"]["bucket_sums_bytes"].as_u64().unwrap();
        let ck = dir.join(&out).join("ckpt-00000004");
        (staging, sums, losses(&dir.join(&out)), params_of(&ck))
    };
    let host = run("off");
    let device = run("on");
    let auto = run("auto");
    assert_eq!((host.0.as_str(), host.1), ("host", 0));
    let params = registry::full_params(
        &RunConfig::load(dir.join("m.toml").to_str().unwrap())
            .unwrap()
            .model,
    )
    .unwrap()
    .total() as u64;
    assert_eq!((device.0.as_str(), device.1), ("device", 4 * params));
    assert_eq!(
        (auto.0.as_str(), auto.1),
        ("host", 0),
        "this MPI is not CUDA-aware"
    );
    assert_eq!(host.2.len(), 4);
    let bits = |l: &[f64]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&host.2),
        bits(&device.2),
        "{:?} {:?}",
        host.2,
        device.2
    );
    assert!(host.3 == device.3, "parameters or moments differ");

    for (args, says) in [
        (
            vec!["--device", "cpu"],
            "FUGU_CUDA_AWARE_MPI=on: the gradients are in host memory (--device cpu)",
        ),
        (
            vec!["--device", "cuda", "--zero", "1"],
            "FUGU_CUDA_AWARE_MPI=on: ZeRO-1's reduce-scatter goes through host memory only",
        ),
    ] {
        let mut args = args.clone();
        args.extend(["--out", "refused"]);
        let out = train_env(&dir, 2, &args, &[emulate, ("FUGU_CUDA_AWARE_MPI", "on")]);
        refused(&out, says);
    }
    let out = train_env(
        &dir,
        2,
        &["--out", "bad"],
        &[("FUGU_CUDA_AWARE_MPI", "yes")],
    );
    refused(&out, "FUGU_CUDA_AWARE_MPI=yes: expected off, auto or on");
    let _ = std::fs::remove_dir_all(&dir);
}

//! `fugu prepare` and `fugu bench io` end to end through the binary.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fugu() -> Command {
    Command::new(env!("CARGO_BIN_EXE_fugu"))
}

fn tmpdir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("prepare-cli-{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn prepare_bundled_corpus_with_no_input_then_bench() {
    let d = tmpdir("bundled");
    let out = d.join("shk");
    let stdout = run(fugu().args(["prepare", "--quiet", "--out"]).arg(&out));
    assert!(stdout.contains("prepared 42 documents"), "{stdout}");
    let m = manifest(&out);
    assert_eq!(m["tokenizer"], "gpt2");
    assert_eq!(m["dtype"], "u16");
    assert_eq!(m["totals"]["documents"], 42);
    assert_eq!(m["val"]["documents"], 2);
    let tokens = m["totals"]["tokens"].as_u64().unwrap();
    assert!((1_400_000..1_700_000).contains(&tokens), "{tokens}");
    for s in m["train"]["shards"].as_array().unwrap() {
        assert!(out.join(s["file"].as_str().unwrap()).exists());
    }
    let stdout = run(fugu()
        .args([
            "bench",
            "io",
            "--tokens",
            "200000",
            "--repeats",
            "2",
            "--data",
        ])
        .arg(out.join("manifest.json")));
    assert!(
        stdout.contains("median:") && stdout.contains("M tokens/s"),
        "{stdout}"
    );
}

#[test]
fn prepare_is_byte_identical_on_rerun() {
    let d = tmpdir("rerun");
    let input = d.join("in.txt");
    let text: String = (0..200)
        .map(|i| format!("Line {i} of a small test corpus.\n"))
        .collect();
    std::fs::write(&input, text).unwrap();
    let jsonl = d.join("in.jsonl");
    std::fs::write(
        &jsonl,
        "{\"text\":\"a\"}\n{\"text\":\"b\"}\n{\"text\":\"c\"}\n",
    )
    .unwrap();
    for o in ["o1", "o2"] {
        run(fugu()
            .args([
                "prepare",
                "--quiet",
                "--shard-size",
                "1K",
                "--val-fraction",
                "0.3",
                "--out",
            ])
            .arg(d.join(o))
            .arg(&input)
            .arg(&jsonl));
    }
    let list = |o: &str| {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(d.join(o))
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read(&p).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let (a, b) = (list("o1"), list("o2"));
    assert_eq!(a, b);
    assert!(a.iter().any(|(n, _)| n == "val-000000.tar"));
    assert_eq!(manifest(&d.join("o1"))["totals"]["documents"], 4);
}

#[test]
fn prepare_errors_name_the_input() {
    let d = tmpdir("errors");
    let bad = d.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": 1}\n").unwrap();
    let out = fugu()
        .args(["prepare", "--quiet", "--out"])
        .arg(d.join("o"))
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.jsonl:1"), "{err}");
}

/// Every file under `dir` with its bytes, by relative path.
fn snapshot(dir: &Path) -> std::collections::BTreeMap<PathBuf, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            (
                p.strip_prefix(dir).unwrap().to_path_buf(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect()
}

/// `prepare` killed (SIGKILL) while it writes a new version of a dataset leaves the old one
/// byte-identical; the next run cleans up what the killed one left and replaces it whole.
#[test]
fn prepare_killed_midway_leaves_the_old_dataset_intact() {
    let d = tmpdir("killed");
    let out = d.join("shk");
    run(fugu()
        .args(["prepare", "--quiet", "--val-fraction", "0.1", "--out"])
        .arg(&out));
    let before = snapshot(&out);
    let mut child = fugu()
        .args([
            "prepare",
            "--quiet",
            "--shard-size",
            "64K",
            "--threads",
            "1",
            "--out",
        ])
        .arg(&out)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the new version is being written (a shard in its temporary folder).
    let started = std::time::Instant::now();
    let writing = || {
        std::fs::read_dir(&d).unwrap().any(|e| {
            let e = e.unwrap();
            e.file_name().to_string_lossy().starts_with(".shk.tmp-")
                && std::fs::read_dir(e.path()).is_ok_and(|mut r| r.next().is_some())
        })
    };
    while !writing() && started.elapsed().as_secs() < 60 {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    if status.success() {
        eprintln!("skipped: prepare finished before it could be killed");
    } else {
        assert_eq!(snapshot(&out), before, "the old dataset changed");
    }
    // The next run replaces it and leaves nothing else next to it.
    run(fugu()
        .args(["prepare", "--quiet", "--shard-size", "256K", "--out"])
        .arg(&out));
    let names: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["shk"], "stray entries next to the dataset");
    assert_ne!(snapshot(&out), before);
    let m = manifest(&out);
    assert!(m["train"]["shards"].as_array().unwrap().len() > 1, "{m}");
    let _ = std::fs::remove_dir_all(&d);
}

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

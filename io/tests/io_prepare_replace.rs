//! `prepare` replaces a dataset atomically: a failed run leaves the old one
//! byte-identical, leftovers of a killed run are cleaned up (an old copy
//! put aside is restored), inputs without documents and folders that are
//! not datasets are refused without touching anything.

mod common;
use common::*;
use fugu_io::{prepare, Error, PrepareOptions};
use std::path::{Path, PathBuf};

fn write(p: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, bytes).unwrap();
}

fn opts(inputs: Vec<PathBuf>, out: &Path) -> PrepareOptions {
    PrepareOptions {
        inputs,
        out_dir: out.to_path_buf(),
        shard_bytes: 4096,
        val_fraction: 0.2,
        ..Default::default()
    }
}

/// Every file under `dir` (recursively) as (relative path, bytes), sorted.
fn tree(dir: &Path) -> Vec<(String, Vec<u8>)> {
    fn walk(base: &Path, dir: &Path, out: &mut Vec<(String, Vec<u8>)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                let rel = p.strip_prefix(base).unwrap().display().to_string();
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    let mut v = Vec::new();
    walk(dir, dir, &mut v);
    v.sort();
    v
}

/// Names in `dir`, sorted.
fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Text inputs large enough for several 4 KiB shards.
fn texts(dir: &Path, n: usize, tag: &str) -> PathBuf {
    let c = dir.join(format!("texts-{tag}"));
    for i in 0..n {
        let body: String = (0..40)
            .map(|l| format!("{tag} document {i} line {l} with some words.\n"))
            .collect();
        write(&c.join(format!("{i:03}.txt")), body.as_bytes());
    }
    c
}

/// A parent folder holding a prepared dataset `out`; returns (parent, out).
fn old_dataset(name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let d = tmpdir(name);
    let parent = d.join("parent");
    let out = parent.join("out");
    let s = prepare(&opts(vec![texts(&d, 12, "old")], &out)).unwrap();
    assert!(s.manifest.train.shards.len() >= 2);
    (d, parent, out)
}

#[test]
fn failed_run_leaves_the_old_dataset_byte_identical() {
    let (d, parent, out) = old_dataset("replace_fail");
    let before = tree(&out);
    // Many good documents (several shards already written), then a bad
    // JSONL line: the run fails after writing part of the new dataset.
    let good = texts(&d, 30, "new");
    write(&good.join("zzz.jsonl"), b"{\"text\":\"ok\"}\nnot json\n");
    let e = prepare(&opts(vec![good.clone()], &out))
        .unwrap_err()
        .to_string();
    assert!(e.contains("zzz.jsonl:2"), "{e}");
    assert_eq!(tree(&out), before, "old dataset changed");
    assert_eq!(names(&parent), vec!["out"], "leftovers in the parent");
    // A missing input later in the list fails the same way.
    let e = prepare(&opts(
        vec![texts(&d, 30, "new2"), d.join("missing.txt")],
        &out,
    ))
    .unwrap_err();
    assert!(e.to_string().contains("missing.txt"), "{e}");
    assert_eq!(tree(&out), before);
    assert_eq!(names(&parent), vec!["out"]);
    // A successful run replaces it as a whole, leaving nothing behind.
    std::fs::remove_file(good.join("zzz.jsonl")).unwrap();
    let s = prepare(&opts(vec![good], &out)).unwrap();
    assert_ne!(tree(&out), before);
    assert_eq!(names(&parent), vec!["out"]);
    assert_eq!(s.manifest_path, out.join("manifest.json"));
    let listed: Vec<String> = s
        .manifest
        .train
        .shards
        .iter()
        .chain(&s.manifest.val.shards)
        .map(|s| s.file.clone())
        .chain(["manifest.json".to_string()])
        .collect();
    let mut listed = listed;
    listed.sort();
    assert_eq!(names(&out), listed, "only the new dataset's files");
}

#[test]
fn leftovers_of_a_killed_run_are_restored_or_removed() {
    let (d, parent, out) = old_dataset("replace_killed");
    let before = tree(&out);
    // Killed between the two renames of the swap: the old dataset is only
    // at `.out.old-PID`, and a complete or partial new one at `.out.tmp-PID`.
    let old = parent.join(".out.old-12345");
    std::fs::rename(&out, &old).unwrap();
    write(&parent.join(".out.tmp-12345/train-000000.tar"), b"partial");
    write(&parent.join(".out.tmp-777"), b"a stray file");
    write(&parent.join(".other.tmp-1/x"), b"not ours");
    // This run fails (bad input): the old dataset is back, byte-identical,
    // and the leftovers are gone.
    let bad = d.join("bad.jsonl");
    write(&bad, b"oops\n");
    assert!(prepare(&opts(vec![bad], &out)).is_err());
    assert_eq!(tree(&out), before, "old dataset not restored");
    assert_eq!(names(&parent), vec![".other.tmp-1", "out"]);

    // Killed after the swap: the new dataset is in place and the old one
    // (maybe partly deleted) is still aside. It is removed; `out` is kept.
    write(&parent.join(".out.old-54321/train-000001.tar"), b"old");
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    assert!(prepare(&opts(vec![empty], &out)).is_err());
    assert_eq!(tree(&out), before);
    assert_eq!(names(&parent), vec![".other.tmp-1", "out"]);

    // And a run that succeeds after a kill leaves only the new dataset.
    std::fs::rename(&out, &old).unwrap();
    let s = prepare(&opts(vec![texts(&d, 3, "new")], &out)).unwrap();
    assert_eq!(names(&parent), vec![".other.tmp-1", "out"]);
    assert_eq!(s.manifest.totals.documents, 3);
}

#[test]
fn inputs_without_documents_are_refused_and_nothing_is_written() {
    let (d, parent, out) = old_dataset("replace_nodocs");
    let before = tree(&out);
    let check = |inputs: Vec<PathBuf>, expect: &[&str]| {
        let e = prepare(&opts(inputs, &out)).unwrap_err();
        let s = e.to_string();
        eprintln!("{s}");
        assert!(matches!(e, Error::NoDocuments { .. }), "{s}");
        for x in expect {
            assert!(s.contains(x), "`{x}` not in: {s}");
        }
        assert_eq!(tree(&out), before);
        assert_eq!(names(&parent), vec!["out"]);
    };
    // A copy of a prepared dataset (its folder, and one shard given alone).
    let copy = d.join("copy");
    std::fs::create_dir_all(&copy).unwrap();
    for (name, bytes) in tree(&out) {
        write(&copy.join(name), &bytes);
    }
    check(
        vec![copy.clone()],
        &[
            "no documents found in",
            "copy",
            "already prepared",
            "fugu train --data",
        ],
    );
    check(
        vec![copy.join("train-000000.tar")],
        &["train-000000.tar", "already prepared"],
    );
    write(&copy.join("loose.tokens"), &[1, 0, 2, 0]);
    check(
        vec![copy.join("loose.tokens")],
        &["loose.tokens", "already prepared"],
    );
    // Only unsupported file types.
    let other = d.join("other");
    write(&other.join("a.bin"), b"\x00\x01");
    write(&other.join("b.png"), b"\x89PNG");
    check(vec![other], &["unsupported", "a.bin", ".jsonl"]);
    // Only empty documents; an empty folder.
    let empty = d.join("empty");
    write(&empty.join("e.txt"), b"");
    check(vec![empty.clone()], &["empty"]);
    std::fs::remove_file(empty.join("e.txt")).unwrap();
    check(vec![empty], &["no input files"]);
    // A fresh output folder is not created either.
    let fresh = parent.join("fresh");
    assert!(prepare(&opts(vec![copy], &fresh)).is_err());
    assert!(!fresh.exists());
    assert_eq!(names(&parent), vec!["out"]);
}

#[test]
fn a_folder_that_is_not_a_dataset_is_refused_and_untouched() {
    let d = tmpdir("replace_foreign");
    let input = texts(&d, 2, "in");
    // A non-empty folder without a manifest.
    let foreign = d.join("mine");
    write(&foreign.join("notes.txt"), b"precious");
    write(&foreign.join("sub/data.tar"), b"precious too");
    let before = tree(&foreign);
    let e = prepare(&opts(vec![input.clone()], &foreign))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("mine") && e.contains("not a fugu dataset") && e.contains("refusing"),
        "{e}"
    );
    assert_eq!(tree(&foreign), before);
    assert_eq!(names(&d), vec!["mine", "texts-in"]);
    // A manifest.json of something else does not make it a dataset.
    write(&foreign.join("manifest.json"), b"{\"name\": \"web app\"}");
    let before = tree(&foreign);
    assert!(prepare(&opts(vec![input.clone()], &foreign)).is_err());
    assert_eq!(tree(&foreign), before);
    // A dataset with a file prepare did not write is refused too.
    let ds = d.join("ds");
    prepare(&opts(vec![input.clone()], &ds)).unwrap();
    write(&ds.join("README"), b"my notes");
    let before = tree(&ds);
    let e = prepare(&opts(vec![input.clone()], &ds))
        .unwrap_err()
        .to_string();
    assert!(e.contains("README"), "{e}");
    assert_eq!(tree(&ds), before);
    // A file is refused.
    let file = d.join("file");
    write(&file, b"x");
    let e = prepare(&opts(vec![input.clone()], &file))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a folder"), "{e}");
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    // An empty folder and a missing nested one are fine.
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    prepare(&opts(vec![input.clone()], &empty)).unwrap();
    assert!(empty.join("manifest.json").is_file());
    let nested = d.join("a/b/c");
    prepare(&opts(vec![input], &nested)).unwrap();
    assert!(nested.join("manifest.json").is_file());
}

#[cfg(unix)]
#[test]
fn a_link_to_a_dataset_is_followed_and_kept() {
    let (d, parent, out) = old_dataset("replace_link");
    let link = d.join("link");
    std::os::unix::fs::symlink(&out, &link).unwrap();
    let s = prepare(&opts(vec![texts(&d, 3, "new")], &link)).unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(s.manifest.totals.documents, 3);
    let (m, _) = fugu_io::Manifest::load(&out).unwrap();
    assert_eq!(m, s.manifest, "the link's target holds the new dataset");
    assert_eq!(names(&parent), vec!["out"]);
}

#[test]
fn a_second_prepare_into_the_same_folder_is_refused_while_the_first_runs() {
    let d = tmpdir("replace_locked");
    let out = d.join("out");
    let inputs = texts(&d, 3, "a");
    // Another process's prepare holds the folder's lock (taken here as it would be).
    let held = std::fs::File::create(d.join(".out.lock")).unwrap();
    held.try_lock().unwrap();
    let e = prepare(&opts(vec![inputs.clone()], &out))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("another `fugu prepare` is writing") && e.contains("out") && !e.contains("tmp-"),
        "{e}"
    );
    assert!(!out.exists());
    // Once it is released, the next run goes ahead and leaves no lock file behind.
    drop(held);
    prepare(&opts(vec![inputs], &out)).unwrap();
    assert_eq!(names(&d), vec!["out", "texts-a"]);
}

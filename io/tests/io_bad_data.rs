//! Bad data: every case is an error naming the shard, member and offset (or
//! is skipped and counted under `skip_bad_samples`); never a panic.

mod common;
use common::*;
use fugu_io::{Error, Loader, LoaderConfig, Verify};
use std::path::Path;

fn cfg(skip: bool) -> LoaderConfig {
    let mut c = LoaderConfig::train(2, 15, 0, 1, 3);
    c.shuffle = false;
    c.skip_bad_samples = skip;
    c
}

/// Drains up to `n` batches; returns the first error.
fn first_error(m: &str, c: &LoaderConfig, n: usize) -> Error {
    let mut l = match Loader::new(m, c) {
        Ok(l) => l,
        Err(e) => return e,
    };
    for _ in 0..n {
        if let Err(e) = l.next_batch() {
            return e;
        }
    }
    panic!("no error after {n} batches");
}

fn msg(e: &Error) -> String {
    let s = e.to_string();
    eprintln!("{s}");
    s
}

fn dataset(name: &str) -> (std::path::PathBuf, String) {
    let d = tmpdir(name);
    let m = make_dataset(&d, &distinct_docs(30, 11), 10, &[]);
    (d, m.to_str().unwrap().to_string())
}

#[test]
fn truncated_shard() {
    let (d, m) = dataset("trunc");
    let shard = d.join("train-000001.tar");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2 + 100]).unwrap();
    // Through the manifest: the size check names the file.
    let s = msg(&first_error(&m, &cfg(false), 100));
    assert!(
        s.contains("train-000001.tar") && s.contains("size mismatch"),
        "{s}"
    );
    // Through a pattern: the tar reader names file, member and offset.
    let pat = format!("{}/train-{{000000..000002}}.tar", d.display());
    let e = first_error(&pat, &cfg(false), 100);
    let s = msg(&e);
    assert!(matches!(e, Error::Tar { .. }), "{s}");
    assert!(
        s.contains("train-000001.tar") && s.contains("truncated"),
        "{s}"
    );
    assert!(s.contains("byte offset") && s.contains(".tokens"), "{s}");
}

#[test]
fn tar_cut_at_a_member_boundary_is_truncated() {
    let (d, _) = dataset("trunc_boundary");
    let shard = d.join("train-000000.tar");
    let bytes = std::fs::read(&shard).unwrap();
    // Drop the end-of-archive marker and the last sample (2 members).
    let mut r = fugu_io::tar::TarReader::open(&shard, 4096).unwrap();
    let mut last_header = 0;
    let mut count = 0;
    while let Some(e) = r.next_entry().unwrap() {
        count += 1;
        if count % 2 == 1 {
            last_header = e.header_offset;
        }
    }
    std::fs::write(&shard, &bytes[..last_header as usize]).unwrap();
    let pat = shard.to_str().unwrap();
    let s = msg(&first_error(pat, &cfg(false), 100));
    assert!(
        s.contains("train-000000.tar") && s.contains("end-of-archive"),
        "{s}"
    );
}

#[test]
fn corrupt_header() {
    let (d, m) = dataset("corrupt");
    let shard = d.join("train-000001.tar");
    let mut bytes = std::fs::read(&shard).unwrap();
    // The third member's header: after two members of the first sample.
    let mut r = fugu_io::tar::TarReader::open(&shard, 4096).unwrap();
    r.next_entry().unwrap();
    r.next_entry().unwrap();
    let off = r.next_entry().unwrap().unwrap().header_offset as usize;
    bytes[off + 3] ^= 0x55; // inside the name: checksum no longer matches
    std::fs::write(&shard, &bytes).unwrap();
    let m2 = d.join("manifest.json");
    let mut man: serde_json::Value = serde_json::from_slice(&std::fs::read(&m2).unwrap()).unwrap();
    // Keep the manifest's sha256 consistent so the tar reader is what fails.
    man["train"]["shards"][1]["sha256"] =
        serde_json::Value::String(fugu_io::manifest::sha256_file(&shard).unwrap());
    std::fs::write(&m2, serde_json::to_vec(&man).unwrap()).unwrap();
    let e = first_error(&m, &cfg(false), 100);
    let s = msg(&e);
    assert!(s.contains("train-000001.tar"), "{s}");
    assert!(
        s.contains(&format!("byte offset {off}")) && s.contains("checksum"),
        "{s}"
    );
    // skip-bad-samples skips the rest of that shard and goes on.
    let mut l = Loader::new(&m, &cfg(true)).unwrap();
    for _ in 0..(l.info().batches_per_epoch * 2.0) as usize {
        l.next_batch().unwrap();
    }
    assert!(l.skipped_bad_samples() >= 1);
}

fn bad_sample_dataset(name: &str) -> (std::path::PathBuf, String, Vec<u32>) {
    let d = tmpdir(name);
    let docs = distinct_docs(20, 12);
    let good: Vec<u32> = docs.concat();
    make_dataset(&d, &docs, 10, &[]);
    // Rewrite shard 1 with two bad samples in the middle.
    let path = d.join("train-000001.tar");
    let mut w = fugu_io::tar::TarWriter::new(Vec::new());
    for (i, s) in docs[10..].iter().enumerate() {
        let data: Vec<u8> = s.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect();
        w.append(&format!("{:010}.tokens", 10 + i), &data).unwrap();
        if i == 3 {
            w.append("odd.tokens", &[1, 2, 3, 4, 5, 6, 7]).unwrap();
            let mut v: Vec<u8> = (0..10u16).flat_map(|t| t.to_le_bytes()).collect();
            v.extend(60000u16.to_le_bytes());
            w.append("vocab.tokens", &v).unwrap();
        }
    }
    let bytes = w.finish().unwrap();
    std::fs::write(&path, &bytes).unwrap();
    (d, path.to_str().unwrap().to_string(), good)
}

#[test]
fn odd_byte_count_and_out_of_vocab_ids() {
    let (d, _, _) = bad_sample_dataset("badsamples");
    let pat = format!("{}/train-{{000000..000001}}.tar", d.display());
    let e = first_error(&pat, &cfg(false), 100);
    let s = msg(&e);
    assert!(matches!(e, Error::BadSample { .. }), "{s}");
    assert!(
        s.contains("train-000001.tar") && s.contains("`odd.tokens`"),
        "{s}"
    );
    assert!(s.contains("not a multiple"), "{s}");

    // With the odd member gone, the out-of-vocabulary id is reported with
    // the offset of that very token.
    let path = d.join("train-000001.tar");
    let mut w = fugu_io::tar::TarWriter::new(Vec::new());
    let mut v: Vec<u8> = (0..10u16).flat_map(|t| t.to_le_bytes()).collect();
    v.extend(60000u16.to_le_bytes());
    w.append("0000000099.tokens", &v).unwrap();
    w.append("0000000100.tokens", &v).unwrap();
    std::fs::write(&path, w.finish().unwrap()).unwrap();
    let e = first_error(path.to_str().unwrap(), &cfg(false), 100);
    let s = msg(&e);
    assert!(
        s.contains("`0000000099.tokens`") && s.contains("token id 60000"),
        "{s}"
    );
    assert!(s.contains(&format!("byte offset {}", 512 + 20)), "{s}");
}

#[test]
fn skip_bad_samples_counts_and_never_yields_bad_tokens() {
    let (d, _, good) = bad_sample_dataset("skipbad");
    let pat = format!("{}/train-{{000000..000001}}.tar", d.display());
    let mut c = cfg(true);
    c.batch_size = 1;
    let mut l = Loader::new(&pat, &c).unwrap();
    let windows = l.info().windows_per_epoch;
    let mut got = Vec::new();
    for _ in 0..windows {
        got.extend(l.next_batch().unwrap().tokens);
    }
    assert_eq!(l.skipped_bad_samples(), 2);
    assert!(got.iter().all(|&t| t < 50257));
    // Good tokens come out in order. The bad members still occupy their
    // declared 3 + 11 token positions of the range, and the short fall is
    // filled by wrapping to the start of the rank's range.
    let k = got.len() - 14;
    assert!(got[..k] == good[..k], "good tokens in order");
    assert!(got[k..] == good[..14], "wrapped to the range start");
}

#[test]
fn missing_shard() {
    let (d, m) = dataset("missing");
    std::fs::remove_file(d.join("train-000002.tar")).unwrap();
    let e = first_error(&m, &cfg(false), 1);
    let s = msg(&e);
    assert!(matches!(e, Error::MissingShard { .. }), "{s}");
    assert!(
        s.contains("train-000002.tar") && s.contains("manifest.json"),
        "{s}"
    );
    let pat = format!("{}/train-{{000000..000002}}.tar", d.display());
    let s = msg(&first_error(&pat, &cfg(false), 1));
    assert!(
        s.contains("train-000002.tar") && s.contains("missing"),
        "{s}"
    );
}

#[test]
fn checksum_mismatch() {
    let (d, m) = dataset("checksum");
    let shard = d.join("train-000000.tar");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[600] ^= 1; // a token byte: sizes and headers stay valid
    std::fs::write(&shard, &bytes).unwrap();
    let mut c = cfg(false);
    c.verify = Verify::Full;
    let e = first_error(&m, &c, 1);
    let s = msg(&e);
    assert!(matches!(e, Error::ChecksumMismatch { .. }), "{s}");
    assert!(
        s.contains("train-000000.tar") && s.contains("sha256"),
        "{s}"
    );
}

#[test]
fn bad_manifests() {
    let (d, m) = dataset("badmanifest");
    let text = std::fs::read_to_string(&m).unwrap();
    for (from, to, expect) in [
        ("\"u16\"", "\"u8\"", "dtype"),
        ("\"fugu-webdataset\"", "\"other\"", "format"),
        ("\"samples\": 10,", "\"samples\": 11,", "differ"),
    ] {
        std::fs::write(&m, text.replacen(from, to, 1)).unwrap();
        let s = msg(&first_error(&m, &cfg(false), 1));
        assert!(s.contains("manifest.json") && s.contains(expect), "{s}");
    }
    std::fs::write(&m, &text[..text.len() / 2]).unwrap();
    let s = msg(&first_error(&m, &cfg(false), 1));
    assert!(s.contains("manifest.json") && s.contains("JSON"), "{s}");
    let _ = d;
}

#[test]
fn bad_bin_files() {
    let d = tmpdir("badbin");
    let p = d.join("odd.bin");
    std::fs::write(&p, [0u8; 301]).unwrap();
    let s = msg(&first_error(p.to_str().unwrap(), &cfg(false), 1));
    assert!(
        s.contains("odd.bin") && s.contains("byte offset 300"),
        "{s}"
    );
    let p = d.join("vocab.bin");
    let mut v = vec![0u8; 200];
    v[70..72].copy_from_slice(&65000u16.to_le_bytes());
    std::fs::write(&p, &v).unwrap();
    let s = msg(&first_error(p.to_str().unwrap(), &cfg(false), 10));
    assert!(
        s.contains("vocab.bin") && s.contains("byte offset 70") && s.contains("65000"),
        "{s}"
    );
    // Every window bad under skip_bad_samples: an error, not an endless loop.
    let p = d.join("allbad.bin");
    std::fs::write(&p, [0xffu8; 256]).unwrap();
    let s = msg(&first_error(p.to_str().unwrap(), &cfg(true), 10));
    assert!(s.contains("allbad.bin") && s.contains("65535"), "{s}");
    let _ = Path::new("");
}

//! Shard checksums: `Verify::Size` checks sizes at open, `Verify::FirstRead`
//! (the default) also each shard's sha256 before any of its samples is
//! returned, `Verify::Full` every sha256 at open.

mod common;
use common::*;
use fugu_io::{Batch, Error, Loader, LoaderConfig, Verify};
use std::path::{Path, PathBuf};

const B: usize = 2;
const T: usize = 15;

fn cfg(verify: Verify, shuffle: bool, prefetch: usize) -> LoaderConfig {
    let mut c = LoaderConfig::train(B, T, 0, 1, 5);
    c.verify = verify;
    c.shuffle = shuffle;
    c.prefetch = prefetch;
    c
}

/// 30 documents in 3 train shards of 10; returns (folder, manifest).
fn dataset(name: &str) -> (PathBuf, String) {
    let d = tmpdir(name);
    let m = make_dataset(&d, &distinct_docs(30, 4), 10, &[]);
    (d, m.to_str().unwrap().to_string())
}

/// Flips one token byte of the first sample of `shard`: same size, valid
/// headers and token ids, different sha256.
fn flip_payload_byte(shard: &Path) {
    let mut bytes = std::fs::read(shard).unwrap();
    bytes[512 + 10] ^= 1; // the 6th token of the first `.tokens` member
    std::fs::write(shard, &bytes).unwrap();
}

/// `n` batches, or the index of the failing batch and its error.
fn batches(m: &str, c: &LoaderConfig, n: usize) -> Result<Vec<Batch>, (usize, Error)> {
    let mut l = Loader::new(m, c).map_err(|e| (0, e))?;
    let mut v = Vec::new();
    for i in 0..n {
        v.push(l.next_batch().map_err(|e| (i, e))?);
    }
    Ok(v)
}

/// Tokens of the train shards in manifest order.
fn shard_tokens(m: &str) -> Vec<u64> {
    let (man, _) = fugu_io::Manifest::load(Path::new(m)).unwrap();
    man.train.shards.iter().map(|s| s.tokens).collect()
}

#[test]
fn intact_data_reads_identically_under_every_mode() {
    let (_d, m) = dataset("verify_intact");
    let n = 40; // several epochs
    for shuffle in [false, true] {
        let size = batches(&m, &cfg(Verify::Size, shuffle, 4), n).unwrap();
        for verify in [Verify::FirstRead, Verify::Full] {
            for prefetch in [0, 3] {
                let got = batches(&m, &cfg(verify, shuffle, prefetch), n).unwrap();
                assert!(
                    got == size,
                    "{verify:?} shuffle {shuffle} prefetch {prefetch}"
                );
            }
        }
    }
    assert_eq!(LoaderConfig::train(1, 1, 0, 1, 0).verify, Verify::FirstRead);
    assert_eq!(LoaderConfig::val(1, 1, 0, 1).verify, Verify::FirstRead);
}

#[test]
fn a_flipped_payload_byte_fails_at_the_first_batch_touching_the_shard() {
    let (d, m) = dataset("verify_flip");
    let shard = d.join("train-000001.tar");
    flip_payload_byte(&shard);
    // The size check does not see it: a whole epoch reads "fine".
    let c = Loader::new(&m, &cfg(Verify::Size, false, 0))
        .unwrap()
        .info()
        .windows_per_epoch as usize;
    batches(&m, &cfg(Verify::Size, false, 0), c / B).unwrap();
    // Without shuffling, the first window needing shard 1's tokens is window
    // ⌊tokens of shard 0 / (T+1)⌋; every batch before it comes out.
    let first_bad = shard_tokens(&m)[0] as usize / (T + 1) / B;
    for prefetch in [0, 4] {
        for skip in [false, true] {
            let mut c = cfg(Verify::FirstRead, false, prefetch);
            c.skip_bad_samples = skip;
            let (i, e) = batches(&m, &c, 1000).unwrap_err();
            let s = e.to_string();
            assert!(matches!(e, Error::ChecksumMismatch { .. }), "{s}");
            assert!(
                s.contains("train-000001.tar") && s.contains("sha256"),
                "{s}"
            );
            assert_eq!(i, first_bad, "prefetch {prefetch} skip {skip}: {s}");
        }
    }
    // Shuffled: it still never yields the shard's samples.
    let (_, e) = batches(&m, &cfg(Verify::FirstRead, true, 2), 1000).unwrap_err();
    assert!(e.to_string().contains("train-000001.tar"), "{e}");
    // Full fails at open.
    let e = Loader::new(&m, &cfg(Verify::Full, false, 0))
        .err()
        .expect("Full must fail at open");
    assert!(
        e.to_string().contains("train-000001.tar") && e.to_string().contains("sha256"),
        "{e}"
    );
}

#[test]
fn resuming_into_a_corrupted_shard_fails_before_its_samples() {
    let (d, m) = dataset("verify_resume");
    flip_payload_byte(&d.join("train-000002.tar"));
    // A cursor taken (under Size) after reading into shard 2.
    let tok = shard_tokens(&m);
    let window = (tok[0] + tok[1]) as usize / (T + 1) + 3;
    let c = cfg(Verify::Size, false, 0);
    let mut l = Loader::new(&m, &c).unwrap();
    for _ in 0..window.div_ceil(B) {
        l.next_batch().unwrap();
    }
    let cursor = l.cursor();
    let c = cfg(Verify::FirstRead, false, 0);
    let e = match Loader::resume(&m, &c, &cursor) {
        Err(e) => e,
        Ok(mut l) => l.next_batch().unwrap_err(),
    };
    assert!(
        e.to_string().contains("train-000002.tar") && e.to_string().contains("sha256"),
        "{e}"
    );
}

/// Hash throughput of a 64 MiB shard from the page cache, for `docs/DATA.md`:
/// `cargo test --release -p fugu-io --test io_verify -- --ignored --nocapture`.
#[test]
#[ignore]
fn sha256_throughput() {
    let d = tmpdir("verify_speed");
    let p = d.join("big.tar");
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let bytes: Vec<u8> = (0..64 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(&p, &bytes).unwrap();
    let expected = fugu_io::manifest::sha256_file(&p).unwrap(); // warms the cache
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        fugu_io::manifest::check_sha256(&p, &expected).unwrap();
        best = best.min(t.elapsed().as_secs_f64());
    }
    eprintln!(
        "sha256 of a 64 MiB file: {:.1} ms, {:.0} MB/s",
        best * 1e3,
        (64 << 20) as f64 / best / 1e6
    );
}

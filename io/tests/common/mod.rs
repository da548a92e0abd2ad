//! Helpers shared by the fugu-io integration tests.
#![allow(dead_code)]

use fugu_io::manifest::{hex, Manifest, ShardInfo, SplitInfo, SplitRule, Totals};
use fugu_io::tar::TarWriter;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// A fresh temporary folder under the target dir.
pub fn tmpdir(name: &str) -> PathBuf {
    let base = std::env::var_os("CARGO_TARGET_TMPDIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let d = base.join(format!("fugu-io-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes one shard holding `samples` as `KEY.tokens` (u16) + `KEY.json`.
pub fn write_shard(path: &Path, first_key: usize, samples: &[Vec<u32>]) -> ShardInfo {
    let mut w = TarWriter::new(Vec::new());
    let mut tokens = 0;
    for (i, s) in samples.iter().enumerate() {
        let key = format!("{:010}", first_key + i);
        let data: Vec<u8> = s.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect();
        w.append(&format!("{key}.tokens"), &data).unwrap();
        w.append(&format!("{key}.json"), b"{}").unwrap();
        tokens += s.len() as u64;
    }
    let bytes = w.finish().unwrap();
    std::fs::write(path, &bytes).unwrap();
    ShardInfo {
        file: path.file_name().unwrap().to_string_lossy().into_owned(),
        samples: samples.len() as u64,
        tokens,
        bytes: bytes.len() as u64,
        sha256: hex(&Sha256::digest(&bytes)),
    }
}

/// Writes a dataset: `docs` split into shards of `per_shard` samples (train),
/// and `val` docs into one val shard. Returns the manifest path.
pub fn make_dataset(dir: &Path, docs: &[Vec<u32>], per_shard: usize, val: &[Vec<u32>]) -> PathBuf {
    let mut train = SplitInfo::default();
    for (i, chunk) in docs.chunks(per_shard).enumerate() {
        let info = write_shard(&dir.join(format!("train-{i:06}.tar")), i * per_shard, chunk);
        train.samples += info.samples;
        train.tokens += info.tokens;
        train.shards.push(info);
    }
    train.documents = train.samples;
    let mut v = SplitInfo::default();
    if !val.is_empty() {
        let info = write_shard(&dir.join("val-000000.tar"), 0, val);
        v.samples = info.samples;
        v.tokens = info.tokens;
        v.documents = info.samples;
        v.shards.push(info);
    }
    let m = Manifest {
        format: fugu_io::manifest::MANIFEST_FORMAT.into(),
        version: fugu_io::manifest::MANIFEST_VERSION,
        tokenizer: "gpt2".into(),
        vocab_size: 50257,
        eot: 50256,
        dtype: "u16".into(),
        created_by: "test".into(),
        inputs: vec![],
        split: SplitRule {
            val_fraction: 0.0,
            val_every: 0,
        },
        totals: Totals {
            documents: train.documents + v.documents,
            samples: train.samples + v.samples,
            tokens: train.tokens + v.tokens,
            ..Default::default()
        },
        train,
        val: v,
    };
    let p = dir.join("manifest.json");
    std::fs::write(&p, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    p
}

/// `n` documents of varying length whose tokens are all distinct
/// (values 0..total), so token multisets identify positions.
pub fn distinct_docs(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut next = 0u32;
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 20 + ((s >> 33) % 300) as usize;
            (0..len)
                .map(|_| {
                    next += 1;
                    next - 1
                })
                .collect()
        })
        .collect()
}

/// Whether python3 is available.
pub fn python3() -> bool {
    std::process::Command::new("python3")
        .arg("-c")
        .arg("import tarfile")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// Prints a skip notice on the real stderr (the test harness captures `eprintln!`).
pub fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "skipped: {why}");
}

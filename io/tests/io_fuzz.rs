//! Fuzzing of the tar reader, the manifest parser and the loader over
//! mutated bytes: every outcome must be `Ok` or an `Err`, never a panic or a
//! hang. Bounded for CI; run longer with
//! `FUGU_FUZZ_ITERS=200000 cargo test --release -p fugu-io --test io_fuzz`.

mod common;
use common::*;
use fugu_io::tar::{StreamSource, TarReader};
use fugu_io::{Loader, LoaderConfig, Manifest};
use std::path::Path;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn iters(default: usize) -> usize {
    std::env::var("FUGU_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// Applies 1..=4 random mutations that are likely to hit tar structure.
fn mutate(rng: &mut Rng, base: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..1 + rng.below(4) {
        if v.is_empty() {
            v.push(0);
        }
        let block = rng.below(v.len().div_ceil(512)) * 512;
        match rng.below(9) {
            0 => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 => v.truncate(rng.below(v.len() + 1)),
            3 => {
                // A header field: size, checksum, typeflag, name or magic.
                let (off, len) = [(124, 12), (148, 8), (156, 1), (0, 100), (257, 8)][rng.below(5)];
                for k in 0..len {
                    if block + off + k < v.len() && rng.below(3) == 0 {
                        v[block + off + k] = b"0123456789 \0\x80\xffxLgK7"[rng.below(16)];
                    }
                }
                // Sometimes fix the checksum so the field change gets through.
                if rng.below(2) == 0 && block + 512 <= v.len() {
                    let h = &mut v[block..block + 512];
                    h[148..156].copy_from_slice(b"        ");
                    let sum: u64 = h.iter().map(|&b| b as u64).sum();
                    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
                }
            }
            4 => {
                let i = rng.below(v.len());
                let n = rng.below(600);
                v.splice(i..i, (0..n).map(|_| rng.next() as u8));
            }
            5 => {
                let i = rng.below(v.len());
                let n = rng.below(600).min(v.len() - i);
                v.drain(i..i + n);
            }
            6 => {
                // Duplicate a block elsewhere.
                let src = rng.below(v.len().div_ceil(512)) * 512;
                let chunk: Vec<u8> = v[src..(src + 512).min(v.len())].to_vec();
                let at = block.min(v.len());
                v.splice(at..at, chunk);
            }
            7 => {
                // A large size in octal or base-256.
                if block + 136 <= v.len() {
                    if rng.below(2) == 0 {
                        v[block + 124..block + 136].copy_from_slice(b"77777777777\0");
                    } else {
                        v[block + 124] = 0x80;
                        for k in 1..12 {
                            v[block + 124 + k] = rng.next() as u8;
                        }
                    }
                }
            }
            _ => {
                let i = rng.below(v.len());
                v[i..].iter_mut().take(8).for_each(|b| *b = 0);
            }
        }
    }
    v
}

fn read_all_in_memory(bytes: &[u8]) {
    let mut r = TarReader::new(StreamSource(bytes), Path::new("fuzz.tar"));
    let mut buf = Vec::new();
    for _ in 0..10_000 {
        match r.next_entry() {
            Ok(Some(e)) => {
                if e.size < 1 << 20 {
                    let _ = r.read_data(&mut buf, 1 << 20);
                }
            }
            Ok(None) | Err(_) => return,
        }
    }
}

fn run_loader(data: &str, skip: bool, shuffle: bool) {
    let mut c = LoaderConfig::train(2, 7, 0, 1, 1);
    c.prefetch = 0; // panics would surface here, on this thread
    c.skip_bad_samples = skip;
    c.shuffle = shuffle;
    c.shuffle_buffer = 4;
    if let Ok(mut l) = Loader::new(data, &c) {
        for _ in 0..40 {
            if l.next_batch().is_err() {
                break;
            }
        }
    }
}

#[test]
fn fuzz_tar_reader_and_loader() {
    let d = tmpdir("fuzz_tar");
    let docs = distinct_docs(12, 21);
    make_dataset(&d, &docs, 12, &[]);
    let base = std::fs::read(d.join("train-000000.tar")).unwrap();
    let shard = d.join("fuzzed.tar");
    let shard_s = shard.to_str().unwrap().to_string();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let n = iters(3000);
    for i in 0..n {
        let v = mutate(&mut rng, &base);
        read_all_in_memory(&v);
        if i % 10 == 0 {
            std::fs::write(&shard, &v).unwrap();
            run_loader(&shard_s, i % 20 == 0, i % 30 == 0);
        }
    }
    eprintln!("fuzzed {n} tar mutations");
}

#[test]
fn fuzz_manifest_parser_and_loader() {
    let d = tmpdir("fuzz_manifest");
    let docs = distinct_docs(20, 22);
    let m = make_dataset(&d, &docs, 7, &[docs[0].clone()]);
    let base = std::fs::read(&m).unwrap();
    let text = String::from_utf8(base.clone()).unwrap();
    let fuzzed = d.join("fuzzed.json");
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    let n = iters(3000);
    let numbers = [
        "0",
        "1",
        "2",
        "-1",
        "65535",
        "65536",
        "4294967295",
        "18446744073709551615",
        "1e300",
        "0.5",
        "null",
        "\"\"",
        "[]",
    ];
    for i in 0..n {
        // Byte-level mutations and value-level ones (numbers and strings).
        let v = if i % 2 == 0 {
            mutate(&mut rng, &base)
        } else {
            let mut t = text.clone();
            for _ in 0..1 + rng.below(3) {
                let digits: Vec<usize> = t
                    .char_indices()
                    .filter(|(_, c)| c.is_ascii_digit())
                    .map(|(i, _)| i)
                    .collect();
                let at = digits[rng.below(digits.len())];
                let end = t[at..]
                    .find(|c: char| !c.is_ascii_digit())
                    .map_or(t.len(), |e| at + e);
                t.replace_range(at..end, numbers[rng.below(numbers.len())]);
            }
            t.into_bytes()
        };
        if let Ok(man) = Manifest::parse(&v, &fuzzed) {
            let _ = man.split_fingerprint(&man.train);
            if i % 5 == 1 {
                std::fs::write(&fuzzed, &v).unwrap();
                run_loader(fuzzed.to_str().unwrap(), i % 2 == 1, true);
                let mut c = LoaderConfig::val(1, 3, 0, 1);
                c.prefetch = 0;
                if let Ok(mut l) = Loader::new(fuzzed.to_str().unwrap(), &c) {
                    let _ = l.next_batch();
                }
            }
        }
    }
    eprintln!("fuzzed {n} manifest mutations");
}

#[test]
fn fuzz_brace_patterns_and_bin_files() {
    let mut rng = Rng(77);
    let alphabet = b"{},.0123456789ab-/";
    for _ in 0..iters(3000) {
        let s: String = (0..rng.below(14))
            .map(|_| alphabet[rng.below(alphabet.len())] as char)
            .collect();
        if let Ok(v) = fugu_io::expand_braces(&s) {
            assert!(!v.is_empty());
        }
    }
    let d = tmpdir("fuzz_bin");
    let p = d.join("x.bin");
    for i in 0..iters(3000) / 30 {
        let n = rng.below(400);
        let bytes: Vec<u8> = (0..n)
            .map(|_| {
                if rng.below(50) == 0 {
                    0xff
                } else {
                    (rng.next() % 0xc0) as u8
                }
            })
            .collect();
        std::fs::write(&p, &bytes).unwrap();
        run_loader(p.to_str().unwrap(), i % 2 == 0, i % 3 == 0);
    }
}

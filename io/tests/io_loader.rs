//! Loader: rank partition, shuffling, cursor save/restore, .bin, val split.

mod common;
use common::*;
use fugu_io::{Cursor, Loader, LoaderConfig};
use std::collections::HashSet;

fn cfg(b: usize, t: usize, rank: usize, world: usize, shuffle: bool) -> LoaderConfig {
    let mut c = LoaderConfig::train(b, t, rank, world, 7);
    c.shuffle = shuffle;
    c.shuffle_buffer = 8;
    c
}

fn take(l: &mut Loader, n: usize) -> Vec<Vec<u32>> {
    (0..n).map(|_| l.next_batch().unwrap().tokens).collect()
}

#[test]
fn ranks_are_disjoint_and_cover_the_epoch_in_order() {
    let d = tmpdir("cover");
    let docs = distinct_docs(60, 1);
    let stream: Vec<u32> = docs.concat();
    let m = make_dataset(&d, &docs, 7, &[]);
    let m = m.to_str().unwrap();
    let (b, t) = (2, 15);
    let w = t + 1;
    for world in [1usize, 2, 3, 5] {
        let c = (stream.len() / w / world) as u64;
        let mut all = Vec::new();
        for rank in 0..world {
            let mut l = Loader::new(m, &cfg(1, t, rank, world, false)).unwrap();
            assert_eq!(l.info().windows_per_epoch, c);
            for _ in 0..c {
                all.extend(l.next_batch().unwrap().tokens);
            }
            // The next window starts epoch 1 (same order without shuffle).
            let cur = l.cursor();
            assert_eq!((cur.epoch, cur.window), (1, 0));
        }
        // Unshuffled: ranks' windows concatenated in rank order are exactly
        // the stream prefix of world*c windows.
        assert_eq!(all, stream[..all.len()].to_vec(), "world {world}");
        assert_eq!(all.len() as u64, world as u64 * c * w as u64);
        assert!(stream.len() - all.len() < world * w);
    }
    // Batches of B rows just group consecutive windows.
    let mut l = Loader::new(m, &cfg(b, t, 0, 1, false)).unwrap();
    let x = l.next_batch().unwrap();
    assert_eq!(x.tokens, stream[..b * w].to_vec());
    assert_eq!(x.row(1), &stream[w..2 * w]);
}

#[test]
fn shuffled_ranks_are_disjoint_cover_and_differ_per_epoch() {
    let d = tmpdir("shufcover");
    let docs = distinct_docs(80, 2);
    let stream: Vec<u32> = docs.concat();
    let m = make_dataset(&d, &docs, 9, &[]);
    let m = m.to_str().unwrap();
    let t = 31;
    let w = t + 1;
    let world = 3;
    let mut seen = HashSet::new();
    let mut epoch1 = Vec::new();
    let mut epoch0 = Vec::new();
    for rank in 0..world {
        let mut l = Loader::new(m, &cfg(1, t, rank, world, true)).unwrap();
        let c = l.info().windows_per_epoch as usize;
        for _ in 0..c {
            let x = l.next_batch().unwrap().tokens;
            for &v in &x {
                assert!(seen.insert(v), "token {v} read twice");
            }
            if rank == 0 {
                epoch0.extend(x);
            }
        }
        if rank == 0 {
            for _ in 0..c {
                epoch1.extend(l.next_batch().unwrap().tokens);
            }
        }
    }
    let total = seen.len();
    assert!(
        stream.len() - total < world * w,
        "cover: {total} of {}",
        stream.len()
    );
    assert_ne!(epoch0, epoch1, "epochs should be shuffled differently");
    assert_ne!(
        epoch0,
        stream[..epoch0.len()].to_vec(),
        "should be shuffled"
    );
    // Deterministic given the seed.
    let mut a = Loader::new(m, &cfg(2, t, 1, world, true)).unwrap();
    let mut b = Loader::new(m, &cfg(2, t, 1, world, true)).unwrap();
    assert_eq!(take(&mut a, 10), take(&mut b, 10));
}

fn check_resume(m: &str, c: LoaderConfig, before: usize, after: usize) {
    let mut orig = Loader::new(m, &c).unwrap();
    take(&mut orig, before);
    let cur = orig.cursor();
    // Round-trip through JSON like a checkpoint's state.json.
    let json = serde_json::to_string(&cur).unwrap();
    let cur2: Cursor = serde_json::from_str(&json).unwrap();
    assert_eq!(cur, cur2);
    let expect = take(&mut orig, after);
    let mut restored = Loader::resume(m, &c, &cur2).unwrap();
    assert_eq!(restored.cursor(), cur);
    assert_eq!(
        take(&mut restored, after),
        expect,
        "resume after {before} batches"
    );
}

#[test]
fn cursor_restore_is_exact_mid_epoch_and_across_epochs() {
    let d = tmpdir("resume");
    let docs = distinct_docs(70, 3);
    let m = make_dataset(&d, &docs, 6, &[]);
    let m = m.to_str().unwrap();
    for shuffle in [false, true] {
        for world_rank in [(1, 0), (3, 2)] {
            let mut c = cfg(3, 20, world_rank.1, world_rank.0, shuffle);
            let per_epoch = Loader::new(m, &c).unwrap().info().batches_per_epoch;
            assert!(per_epoch > 2.0);
            // Start, mid-epoch, just before / after / across epoch boundaries.
            let e = per_epoch.floor() as usize;
            for before in [0, 1, e / 2, e, e + 1, 2 * e + 1] {
                check_resume(m, c.clone(), before, e + 2);
            }
            c.prefetch = 0;
            check_resume(m, c.clone(), e / 2 + 1, 5);
        }
    }
}

#[test]
fn one_cursor_restores_every_rank() {
    let d = tmpdir("resume_ranks");
    let docs = distinct_docs(70, 4);
    let m = make_dataset(&d, &docs, 6, &[]);
    let m = m.to_str().unwrap();
    let world = 3;
    let mut loaders: Vec<Loader> = (0..world)
        .map(|r| Loader::new(m, &cfg(2, 16, r, world, true)).unwrap())
        .collect();
    for l in &mut loaders {
        take(l, 13);
    }
    let cursors: Vec<Cursor> = loaders.iter().map(|l| l.cursor()).collect();
    assert!(cursors.windows(2).all(|p| p[0] == p[1]));
    for (r, l) in loaders.iter_mut().enumerate() {
        let expect = take(l, 4);
        let mut re = Loader::resume(m, &cfg(2, 16, r, world, true), &cursors[0]).unwrap();
        assert_eq!(take(&mut re, 4), expect);
    }
}

#[test]
fn world_size_change_is_deterministic() {
    let d = tmpdir("worldchange");
    let docs = distinct_docs(70, 5);
    let m = make_dataset(&d, &docs, 6, &[]);
    let m = m.to_str().unwrap();
    let mut l = Loader::new(m, &cfg(2, 16, 0, 4, true)).unwrap();
    take(&mut l, 5);
    let cur = l.cursor();
    let new_cfg = cfg(2, 16, 1, 2, true);
    let mut a = Loader::resume(m, &new_cfg, &cur).unwrap();
    let mut b = Loader::resume(m, &new_cfg, &cur).unwrap();
    let ca = a.cursor();
    assert_eq!(ca.world, 2);
    assert_eq!(ca.epoch, cur.epoch);
    // Same fraction of the epoch.
    assert_eq!(
        ca.window,
        cur.window * ca.windows_per_epoch / cur.windows_per_epoch
    );
    assert_eq!(take(&mut a, 6), take(&mut b, 6));
}

#[test]
fn cursor_for_other_data_is_refused() {
    let d = tmpdir("otherdata");
    let m1 = make_dataset(&d, &distinct_docs(40, 6), 6, &[]);
    let mut l = Loader::new(m1.to_str().unwrap(), &cfg(1, 8, 0, 1, true)).unwrap();
    take(&mut l, 2);
    let cur = l.cursor();
    let d2 = tmpdir("otherdata2");
    let m2 = make_dataset(&d2, &distinct_docs(41, 6), 6, &[]);
    let e = Loader::resume(m2.to_str().unwrap(), &cfg(1, 8, 0, 1, true), &cur)
        .err()
        .unwrap();
    assert!(e.to_string().contains("other data"), "{e}");
}

#[test]
fn long_samples_are_streamed_in_pieces() {
    let d = tmpdir("long");
    // One sample longer than MAX_PIECE_TOKENS, plus small ones.
    let long: Vec<u32> = (0..(fugu_io::loader::MAX_PIECE_TOKENS as u32 * 2 + 123))
        .map(|i| i % 50000)
        .collect();
    let docs = vec![vec![1, 2, 3], long, vec![4, 5]];
    let stream = docs.concat();
    let m = make_dataset(&d, &docs, 2, &[]);
    let mut l = Loader::new(m.to_str().unwrap(), &cfg(4, 1023, 0, 1, false)).unwrap();
    let x = l.next_batch().unwrap();
    assert_eq!(x.tokens, stream[..4 * 1024].to_vec());
    let mut all = x.tokens;
    let c = l.info().windows_per_epoch as usize;
    while all.len() < c * 1024 {
        all.extend(l.next_batch().unwrap().tokens);
    }
    assert_eq!(all[..c * 1024], stream[..c * 1024]);
    // Shuffled, restored from a cursor while a long piece is in the buffer.
    let mut c2 = cfg(4, 1023, 0, 1, true);
    c2.shuffle_buffer = 3;
    check_resume(m.to_str().unwrap(), c2, 3, 20);
}

#[test]
fn brace_patterns_and_single_shards() {
    let d = tmpdir("pattern");
    let docs = distinct_docs(30, 8);
    let stream = docs.concat();
    make_dataset(&d, &docs, 10, &[]);
    let pat = format!("{}/train-{{000000..000002}}.tar", d.display());
    let mut l = Loader::new(&pat, &cfg(1, 9, 0, 1, false)).unwrap();
    assert_eq!(l.info().files, 3);
    assert_eq!(l.info().tokens, stream.len() as u64);
    assert_eq!(l.next_batch().unwrap().tokens, stream[..10].to_vec());
    let files = fugu_io::expand_braces("a-{00..02}-{x,y}.tar").unwrap();
    assert_eq!(files.len(), 6);
    assert_eq!(files[0], "a-00-x.tar");
    assert_eq!(files[5], "a-02-y.tar");
    let one = format!("{}/train-000001.tar", d.display());
    assert_eq!(
        Loader::new(&one, &cfg(1, 9, 0, 1, false))
            .unwrap()
            .info()
            .files,
        1
    );
}

#[test]
fn validation_loader_reads_the_held_out_split_in_order() {
    let d = tmpdir("val");
    let docs = distinct_docs(30, 9);
    let val: Vec<Vec<u32>> = vec![(40000..40100).collect(), (41000..41050).collect()];
    let vstream = val.concat();
    let m = make_dataset(&d, &docs, 10, &val);
    let m = m.to_str().unwrap();
    let vc = LoaderConfig::val(2, 9, 0, 1);
    let mut a = Loader::new(m, &vc).unwrap();
    let mut b = Loader::new(m, &vc).unwrap();
    let xa = take(&mut a, 3);
    assert_eq!(xa, take(&mut b, 3));
    assert_eq!(xa[0], vstream[..20].to_vec());
    // Two ranks split the validation data too.
    let r1 = Loader::new(m, &LoaderConfig::val(1, 9, 1, 2))
        .unwrap()
        .next_batch()
        .unwrap();
    let c = (vstream.len() / 10 / 2) * 10;
    assert_eq!(r1.tokens, vstream[c..c + 10].to_vec());
}

#[test]
fn raw_bin_windows_in_file_order_and_wrapping() {
    let d = tmpdir("bin");
    let n = 1000u32;
    let bytes: Vec<u8> = (0..n).flat_map(|t| (t as u16).to_le_bytes()).collect();
    let p = d.join("tokens.bin");
    std::fs::write(&p, &bytes).unwrap();
    let p = p.to_str().unwrap();
    let (b, t) = (4, 63);
    let w = 64;
    let mut l = Loader::new(p, &cfg(b, t, 0, 1, false)).unwrap();
    let windows = n as usize / w; // 15
    let mut got = Vec::new();
    for _ in 0..8 {
        got.extend(l.next_batch().unwrap().tokens);
    }
    for (i, win) in got.chunks(w).enumerate() {
        let k = i % windows;
        let expect: Vec<u32> = (k as u32 * 64..k as u32 * 64 + 64).collect();
        assert_eq!(win, &expect[..], "window {i}");
    }
    // Shuffled: every window once per epoch, and resumable.
    let mut s = Loader::new(p, &cfg(1, t, 0, 1, true)).unwrap();
    let mut starts: Vec<u32> = (0..windows)
        .map(|_| s.next_batch().unwrap().tokens[0])
        .collect();
    starts.sort();
    assert_eq!(
        starts,
        (0..windows as u32).map(|k| k * 64).collect::<Vec<_>>()
    );
    check_resume(p, cfg(2, t, 0, 1, true), 5, 9);
    check_resume(p, cfg(2, t, 1, 2, false), 3, 9);
    // Two ranks: disjoint contiguous halves.
    let r1 = Loader::new(p, &cfg(1, t, 1, 2, false))
        .unwrap()
        .next_batch()
        .unwrap();
    assert_eq!(r1.tokens[0], 7 * 64);
}

/// llm.c's token files (a 1024-byte header: magic 20240520, version 1, the token count) are
/// read after their header, window for window as the raw file of the same tokens, shuffled and
/// resumable alike; another version or a count the file does not hold is refused at open,
/// naming the file and the field.
#[test]
fn llmc_bin_files_are_read_after_their_header() {
    let d = tmpdir("llmc-bin");
    let n = 1000u32;
    let tokens: Vec<u8> = (0..n)
        .flat_map(|t| ((t * 7) as u16).to_le_bytes())
        .collect();
    let header = |magic: u32, version: u32, count: u32| {
        let mut h = vec![0u8; 1024];
        for (i, v) in [magic, version, count].into_iter().enumerate() {
            h[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        h
    };
    let raw = d.join("raw.bin");
    std::fs::write(&raw, &tokens).unwrap();
    let llmc = d.join("llmc.bin");
    std::fs::write(&llmc, [header(20240520, 1, n), tokens.clone()].concat()).unwrap();
    let (raw, llmc) = (raw.to_str().unwrap(), llmc.to_str().unwrap());
    for shuffle in [false, true] {
        let mut a = Loader::new(raw, &cfg(2, 31, 0, 1, shuffle)).unwrap();
        let mut b = Loader::new(llmc, &cfg(2, 31, 0, 1, shuffle)).unwrap();
        assert_eq!(a.info().windows_per_epoch, b.info().windows_per_epoch);
        assert_eq!(take(&mut a, 20), take(&mut b, 20), "shuffle {shuffle}");
    }
    check_resume(llmc, cfg(2, 31, 0, 1, true), 4, 9);
    let refused = |bytes: Vec<u8>, what: &str| {
        let p = d.join("bad.bin");
        std::fs::write(&p, bytes).unwrap();
        let Err(e) = Loader::new(p.to_str().unwrap(), &cfg(1, 31, 0, 1, false)) else {
            panic!("{what}: opened");
        };
        let e = e.to_string();
        assert!(e.contains("bad.bin") && e.contains(what), "{e}");
    };
    refused(
        [header(20240520, 2, n), tokens.clone()].concat(),
        "version 2",
    );
    refused(
        [header(20240520, 1, n + 5), tokens.clone()].concat(),
        "truncated",
    );
}

/// Megatron-LM's `.idx` for sequences of `sizes` tokens of `width` bytes (dtype `code`).
fn megatron_index(sizes: &[u32], width: u64, code: u8) -> Vec<u8> {
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend_from_slice(&1u64.to_le_bytes());
    idx.push(code);
    idx.extend_from_slice(&(sizes.len() as u64).to_le_bytes());
    idx.extend_from_slice(&(sizes.len() as u64 + 1).to_le_bytes());
    for s in sizes {
        idx.extend_from_slice(&(*s as i32).to_le_bytes());
    }
    let mut pointer = 0u64;
    for s in sizes {
        idx.extend_from_slice(&(pointer as i64).to_le_bytes());
        pointer += *s as u64 * width;
    }
    for d in 0..=sizes.len() as i64 {
        idx.extend_from_slice(&d.to_le_bytes());
    }
    idx
}

#[test]
fn megatron_bin_idx_pairs_are_read_as_one_stream() {
    let d = tmpdir("megatron");
    let sizes = [300u32, 500, 200];
    let ids: Vec<u32> = (0..1000u32).map(|t| (t * 13) % 4000).collect();
    let u16s: Vec<u8> = ids.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect();
    let i32s: Vec<u8> = ids.iter().flat_map(|&t| (t as i32).to_le_bytes()).collect();
    std::fs::write(d.join("raw.bin"), &u16s).unwrap();
    std::fs::write(d.join("c4_text_document.bin"), &u16s).unwrap();
    std::fs::write(d.join("c4_text_document.idx"), megatron_index(&sizes, 2, 8)).unwrap();
    std::fs::write(d.join("wide_text_document.bin"), &i32s).unwrap();
    std::fs::write(
        d.join("wide_text_document.idx"),
        megatron_index(&sizes, 4, 4),
    )
    .unwrap();
    let path = |n: &str| d.join(n).to_str().unwrap().to_string();
    // The dataset by its .bin, its .idx or its prefix (Megatron's --data-path), u16 or i32:
    // the same windows as the raw u16 file.
    for shuffle in [false, true] {
        let mut raw = Loader::new(&path("raw.bin"), &cfg(2, 31, 0, 1, shuffle)).unwrap();
        let expect = take(&mut raw, 20);
        for name in [
            "c4_text_document.bin",
            "c4_text_document.idx",
            "c4_text_document",
            "wide_text_document",
        ] {
            let mut l = Loader::new(&path(name), &cfg(2, 31, 0, 1, shuffle)).unwrap();
            assert_eq!(take(&mut l, 20), expect, "{name}, shuffle {shuffle}");
        }
        // The same documents written by megatron-core's own IndexedDatasetBuilder
        // (dev/make_megatron_fixture.py).
        let fixtures =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/megatron");
        for name in ["tiny_text_document", "wide_text_document"] {
            let prefix = fixtures.join(name);
            let mut l = Loader::new(prefix.to_str().unwrap(), &cfg(2, 31, 0, 1, shuffle)).unwrap();
            assert_eq!(
                take(&mut l, 20),
                expect,
                "megatron-core's {name}, shuffle {shuffle}"
            );
        }
    }
    check_resume(&path("wide_text_document"), cfg(2, 31, 0, 1, true), 4, 9);
    let refused = |bin: &[u8], idx: Vec<u8>, want: &[&str]| {
        std::fs::write(d.join("bad.bin"), bin).unwrap();
        std::fs::write(d.join("bad.idx"), idx).unwrap();
        let Err(e) = Loader::new(&path("bad"), &cfg(1, 31, 0, 1, false)) else {
            panic!("{want:?}: opened");
        };
        let e = e.to_string();
        assert!(want.iter().all(|w| e.contains(w)), "{want:?}: {e}");
    };
    refused(
        &u16s[..1200],
        megatron_index(&sizes, 2, 8),
        &["bad.bin", "truncated"],
    );
    refused(
        &u16s,
        megatron_index(&sizes, 2, 6),
        &["bad.idx", "dtype code 6"],
    );
    refused(
        &u16s,
        megatron_index(&sizes, 2, 8)[..60].to_vec(),
        &["bad.idx", "truncated"],
    );
    refused(
        &u16s,
        b"not an index at all, but long enough".to_vec(),
        &["bad.idx", "MMIDIDX"],
    );
    // A negative i32 token reads as an id beyond the vocabulary: refused by its offset.
    let mut neg = i32s.clone();
    neg[40..44].copy_from_slice(&(-1i32).to_le_bytes());
    std::fs::write(d.join("bad.bin"), &neg).unwrap();
    std::fs::write(d.join("bad.idx"), megatron_index(&sizes, 4, 4)).unwrap();
    let mut l = Loader::new(&path("bad"), &cfg(1, 31, 0, 1, false)).unwrap();
    let e = l.next_batch().unwrap_err().to_string();
    assert!(
        e.contains("bad.bin") && e.contains("offset 40") && e.contains("4294967295"),
        "{e}"
    );
}

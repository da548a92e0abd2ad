//! Tokenizer and `prepare`: known ids, round trips, input kinds, determinism,
//! atomic writes, splits, and shards that Python's `tarfile` reads.

mod common;
use common::*;
use fugu_io::tar::{EntryKind, TarReader};
use fugu_io::{prepare, Gpt2Tokenizer, Manifest, PrepareOptions, Tokenizer};
use std::io::Write;
use std::path::{Path, PathBuf};

#[test]
fn gpt2_known_ids_and_round_trip() {
    let t = Gpt2Tokenizer::new();
    assert_eq!(t.encode("Hello world"), vec![15496, 995]);
    assert_eq!(t.eot(), 50256);
    assert_eq!(t.vocab_size(), 50257);
    // Special-token text in documents is plain text, never id 50256.
    assert!(!t.encode("a <|endoftext|> b").contains(&50256));
    assert_eq!(t.decode(&[50256]).unwrap(), "<|endoftext|>");
    for s in [
        "",
        "Hello world",
        "  leading spaces\n\n\ttabs",
        "ünïcödé 日本語 🐟",
        "To be, or not to be",
    ] {
        assert_eq!(t.decode(&t.encode(s)).unwrap(), s);
    }
    assert!(t.decode(&[50257]).is_err());
    assert!(fugu_io::tokenizer_by_name("nope").is_err());
    assert_eq!(fugu_io::tokenizer_by_name("gpt2").unwrap().name(), "gpt2");
}

fn write(p: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, bytes).unwrap();
}

fn gz(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

const DOC_A: &str = "First document.\nIt has two lines.\n";
const DOC_B: &str = "# Markdown\n\nSecond   document,  with  spaces.\n \n";
const DOC_X: &str = "Inside a tar.\r\nWindows line ends.\r\n";

/// A folder with every input kind. Returns (folder, expected documents in order).
fn corpus(dir: &Path) -> (PathBuf, Vec<String>) {
    let c = dir.join("corpus");
    write(&c.join("a.txt"), DOC_A.as_bytes());
    write(&c.join("b/b.md"), DOC_B.as_bytes());
    write(
        &c.join("c.jsonl"),
        b"{\"text\": \"json one\"}\n\n{\"text\": \"json \\u00e9 two\", \"id\": 3}\n",
    );
    write(&c.join("d.txt.gz"), &gz(b"gzipped text"));
    let mut tw = fugu_io::tar::TarWriter::new(Vec::new());
    tw.append("x.txt", DOC_X.as_bytes()).unwrap();
    tw.append("y.jsonl", b"{\"text\":\"tar json\"}\n").unwrap();
    tw.append("z.png", b"\x89PNG").unwrap();
    write(&c.join("e.tar"), &tw.finish().unwrap());
    write(&c.join(".hidden.txt"), b"ignored");
    write(&c.join("f.bin"), b"ignored");
    write(&c.join("g.txt"), b""); // empty: left out
    let docs = vec![
        DOC_A.to_string(),
        DOC_B.to_string(),
        "json one".into(),
        "json é two".into(),
        "gzipped text".into(),
        DOC_X.into(),
        "tar json".into(),
    ];
    (c, docs)
}

fn opts(inputs: Vec<PathBuf>, out: PathBuf) -> PrepareOptions {
    PrepareOptions {
        inputs,
        out_dir: out,
        shard_bytes: 4096,
        val_fraction: 0.0,
        ..Default::default()
    }
}

/// All `.tokens` members of a split, in order, as (key, tokens).
fn read_split(dir: &Path, m: &Manifest, val: bool) -> Vec<(String, Vec<u32>)> {
    let split = if val { &m.val } else { &m.train };
    let mut out = Vec::new();
    for s in &split.shards {
        let mut r = TarReader::open(&dir.join(&s.file), 4096).unwrap();
        while let Some(e) = r.next_entry().unwrap() {
            assert_eq!(e.kind, EntryKind::File);
            if e.name.ends_with(".tokens") {
                let mut d = Vec::new();
                r.read_data(&mut d, u64::MAX).unwrap();
                let toks = d
                    .chunks(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                    .collect();
                out.push((e.name.clone(), toks));
            }
        }
    }
    out
}

fn all_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
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
}

#[test]
fn every_input_kind_in_order_and_deterministic() {
    let d = tmpdir("prep_kinds");
    let (c, docs) = corpus(&d);
    let s1 = prepare(&opts(vec![c.clone()], d.join("out1"))).unwrap();
    let m = &s1.manifest;
    assert_eq!(m.totals.documents, docs.len() as u64);
    assert_eq!(m.totals.empty_documents, 1);
    let t = Gpt2Tokenizer::new();
    let samples = read_split(&d.join("out1"), m, false);
    assert_eq!(samples.len(), docs.len());
    for (i, ((key, toks), doc)) in samples.iter().zip(&docs).enumerate() {
        assert_eq!(key, &format!("{i:010}.tokens"));
        let mut expect = t.encode(doc);
        expect.push(50256);
        assert_eq!(toks, &expect, "document {i}");
    }
    assert!(
        m.train.shards.len() >= 2,
        "small shard size should give several shards"
    );
    // Byte-identical re-runs, also with another thread count.
    let mut o2 = opts(vec![c.clone()], d.join("out2"));
    o2.threads = Some(1);
    prepare(&o2).unwrap();
    assert_eq!(all_files(&d.join("out1")), all_files(&d.join("out2")));
    // No temporary files are left behind.
    assert!(all_files(&d.join("out1"))
        .iter()
        .all(|(n, _)| !n.ends_with(".tmp")));
}

#[test]
fn chunked_tokenisation_equals_whole_documents_and_long_docs_split() {
    let d = tmpdir("prep_chunks");
    // Lines with every whitespace situation around newlines.
    let mut text = String::new();
    for i in 0..300 {
        text.push_str(match i % 6 {
            0 => "word\n",
            1 => "  indented line\n",
            2 => "\n",
            3 => "trailing spaces   \n",
            4 => "ünïcödé\u{a0}nbsp\n",
            _ => "x\r\n",
        });
    }
    let f = d.join("long.txt");
    write(&f, text.as_bytes());
    let mut o = opts(vec![f], d.join("out"));
    o.chunk_bytes = 64;
    o.max_sample_tokens = 100;
    let s = prepare(&o).unwrap();
    let samples = read_split(&d.join("out"), &s.manifest, false);
    let t = Gpt2Tokenizer::new();
    let mut expect = t.encode(&text);
    expect.push(50256);
    assert!(samples.len() > 3);
    let got: Vec<u32> = samples.iter().flat_map(|(_, t)| t.clone()).collect();
    assert_eq!(got, expect);
    // EOT only at the very end; parts are at most max_sample_tokens.
    assert!(samples.iter().all(|(_, t)| t.len() <= 100));
    assert_eq!(got.iter().filter(|&&x| x == 50256).count(), 1);
}

#[test]
fn validation_split_is_every_kth_document() {
    let d = tmpdir("prep_val");
    let c = d.join("docs");
    for i in 0..10 {
        write(
            &c.join(format!("{i:02}.txt")),
            format!("document number {i}").as_bytes(),
        );
    }
    let mut o = opts(vec![c], d.join("out"));
    o.val_fraction = 0.25;
    let m = prepare(&o).unwrap().manifest;
    assert_eq!(m.split.val_every, 4);
    assert_eq!((m.train.documents, m.val.documents), (8, 2));
    let t = Gpt2Tokenizer::new();
    let val = read_split(&d.join("out"), &m, true);
    assert_eq!(
        t.decode(&val[0].1).unwrap(),
        "document number 3<|endoftext|>"
    );
    assert_eq!(
        t.decode(&val[1].1).unwrap(),
        "document number 7<|endoftext|>"
    );
    // The loader's validation split reads them.
    let mut l = fugu_io::Loader::new(
        d.join("out").to_str().unwrap(),
        &fugu_io::LoaderConfig::val(1, 3, 0, 1),
    )
    .unwrap();
    assert_eq!(l.next_batch().unwrap().tokens, val[0].1[..4].to_vec());
}

#[test]
fn bad_jsonl_is_an_error_or_skipped_and_counted() {
    let d = tmpdir("prep_badjson");
    let f = d.join("bad.jsonl");
    write(
        &f,
        b"{\"text\":\"ok\"}\n{\"txt\":\"no text\"}\nnot json\n{\"text\":\"ok2\"}\n",
    );
    let e = prepare(&opts(vec![f.clone()], d.join("out")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.jsonl:2") && e.contains("text"), "{e}");
    let mut o = opts(vec![f, d.join("missing.txt")], d.join("out"));
    o.skip_bad = true;
    let m = prepare(&o).unwrap().manifest;
    assert_eq!(m.totals.skipped_bad_inputs, 3);
    assert_eq!(m.totals.documents, 2);
}

#[test]
fn text_members_and_python_tarfile() {
    let d = tmpdir("prep_python");
    let (c, docs) = corpus(&d);
    let mut o = opts(vec![c], d.join("out"));
    o.write_text = true;
    let m = prepare(&o).unwrap().manifest;
    if !python3() {
        eprintln!("SKIPPED: python3 not found; shards not checked with tarfile");
        return;
    }
    let files: Vec<String> = m
        .train
        .shards
        .iter()
        .map(|s| d.join("out").join(&s.file).display().to_string())
        .collect();
    let script = r#"
import sys, tarfile, json, struct
texts, tokens = [], 0
for path in sys.argv[1:]:
    with tarfile.open(path) as t:
        for mem in t.getmembers():
            assert mem.isfile() and mem.mtime == 0 and mem.uid == 0, mem
            data = t.extractfile(mem).read()
            key, ext = mem.name.split('.', 1)
            if ext == 'tokens':
                assert len(data) % 2 == 0
                ids = struct.unpack('<%dH' % (len(data) // 2), data)
                assert ids[-1] == 50256 and all(i < 50257 for i in ids)
                tokens += len(ids)
            elif ext == 'json':
                meta = json.loads(data)
                assert meta['tokens'] > 0
            elif ext == 'txt':
                texts.append(data.decode('utf-8'))
print(tokens)
print(json.dumps(texts))
"#;
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(&files)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let mut lines = stdout.lines();
    assert_eq!(
        lines.next().unwrap().parse::<u64>().unwrap(),
        m.train.tokens
    );
    let texts: Vec<String> = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(texts, docs);
    // webdataset, when installed, reads them too.
    let wds = std::process::Command::new("python3")
        .arg("-c")
        .arg("import webdataset")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if wds {
        let script = "import sys, webdataset as wds\nn = sum(1 for s in wds.WebDataset(sys.argv[1:], shardshuffle=False))\nprint(n)";
        let out = std::process::Command::new("python3")
            .arg("-c")
            .arg(script)
            .args(&files)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let n: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        assert_eq!(n, m.train.samples);
    } else {
        eprintln!("note: python webdataset not installed; checked with tarfile only");
    }
}

#[test]
fn bundled_corpus_is_embedded_and_readable() {
    use fugu_io::tar::StreamSource;
    let gz = flate2::read::GzDecoder::new(fugu_io::bundled::SHAKESPEARE_TAR_GZ);
    let mut r = TarReader::new(StreamSource(gz), Path::new("bundled"));
    let mut n = 0;
    let mut bytes = 0;
    while let Some(e) = r.next_entry().unwrap() {
        if e.kind == EntryKind::File {
            n += 1;
            bytes += e.size;
            assert!(e.name.starts_with("shakespeare/") && e.name.ends_with(".txt"));
        }
    }
    assert_eq!(n, 42);
    assert!(bytes > 5_000_000);
}

/// Content that is not text is refused by name, never tokenised: a Parquet, zstd or Arrow
/// stream file named explicitly (whatever its extension), a UTF-16 file, NUL bytes, and the
/// same inside a folder or a tar archive; with `skip_bad` each is skipped and counted. A FIFO
/// inside an input folder is passed over with a notice instead of blocking the walk.
#[test]
fn content_that_is_not_text_is_refused_by_name() {
    let d = tmpdir("prep_not_text");
    let cases: [(&str, &[u8], &str); 5] = [
        ("parquet.txt", b"PAR1\x15\x04\x15\x10\x15\x14", "Parquet"),
        ("zstd.txt", &[0x28, 0xb5, 0x2f, 0xfd, 0x04, 0x58], "zstd"),
        (
            "stream.txt",
            &[0xff, 0xff, 0xff, 0xff, 0x78, 0, 0, 0],
            "Arrow IPC stream",
        ),
        ("utf16.txt", &[0xff, 0xfe, b'h', 0, b'i', 0], "UTF-16"),
        ("ids.txt", b"12\x0034\x00", "NUL byte"),
    ];
    for (name, bytes, what) in cases {
        let f = d.join(name);
        write(&f, bytes);
        let e = prepare(&opts(vec![f.clone()], d.join("out")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(name) && e.contains(what) && e.contains("not text"),
            "{e}"
        );
    }
    // In a folder (the .txt ones are read, so refused) and in a tar archive.
    let folder = d.join("folder");
    std::fs::create_dir_all(&folder).unwrap();
    write(&folder.join("a.txt"), b"plain text\n");
    write(&folder.join("b.txt"), &[0xff, 0xfe, b'h', 0]);
    let e = prepare(&opts(vec![folder.clone()], d.join("out")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("b.txt") && e.contains("UTF-16"), "{e}");
    let mut tar = fugu_io::tar::TarWriter::new(Vec::new());
    tar.append("x/ok.txt", b"fine\n").unwrap();
    tar.append("x/bad.txt", b"PAR1\x15\x04").unwrap();
    write(&d.join("t.tar"), &tar.finish().unwrap());
    let e = prepare(&opts(vec![d.join("t.tar")], d.join("out")))
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad.txt") && e.contains("Parquet"), "{e}");
    // skip_bad: the folder's text is kept, the UTF-16 file skipped and counted.
    let mut o = opts(vec![folder.clone()], d.join("out"));
    o.skip_bad = true;
    let m = prepare(&o).unwrap().manifest;
    assert_eq!((m.totals.documents, m.totals.skipped_bad_inputs), (1, 1));
    // A FIFO in the folder: passed over (reading it would wait for a writer forever).
    std::fs::remove_file(folder.join("b.txt")).unwrap();
    let fifo = folder.join("pipe.txt");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status();
    if !made.is_ok_and(|s| s.success()) {
        skipped("mkfifo is not available");
        return;
    }
    let m = prepare(&opts(vec![folder], d.join("out")))
        .unwrap()
        .manifest;
    assert_eq!(m.totals.documents, 1);
}

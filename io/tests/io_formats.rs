#![cfg(feature = "formats")]
//! Every input format `prepare` reads gives the ids of the same text read as `.txt` files, and
//! every one it cannot read is refused naming the file and the reason. Files come from three
//! writers: arrow-rs/parquet/zstd/flate2 here (always), the Python libraries' own output
//! committed in `tests/fixtures/formats` by `dev/make_format_fixtures.py` (always), and that
//! script run afresh when pyarrow, datasets, zstandard and webdataset are importable.

mod common;
use arrow_array::{ArrayRef, Int64Array, LargeStringArray, RecordBatch, StringArray};
use common::*;
use fugu_io::tar::{EntryKind, TarReader};
use fugu_io::{prepare, PrepareOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The documents of `dev/make_format_fixtures.py` (`DOCS`), in order.
const DOCS: [&str; 4] = [
    "First document.\nIt has two lines.\n",
    "Second: ünïcödé, 日本語 and a fish 🐟.",
    "  leading spaces, a tab\tand a blank line\n\nthen more",
    "To be, or not to be, that is the question:\n",
];

fn docs() -> Vec<String> {
    let mut d: Vec<String> = DOCS.iter().map(|s| s.to_string()).collect();
    d[3] = d[3].repeat(3);
    d
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/formats")
}

fn opts(inputs: Vec<PathBuf>, out: PathBuf) -> PrepareOptions {
    PrepareOptions {
        inputs,
        out_dir: out,
        val_fraction: 0.0,
        ..Default::default()
    }
}

/// Every sample's tokens of a prepared dataset's training split, in order.
fn samples(out: &Path) -> Vec<Vec<u32>> {
    let (m, _) = fugu_io::Manifest::load(&out.join("manifest.json")).unwrap();
    let mut all = Vec::new();
    for s in &m.train.shards {
        let mut r = TarReader::open(&out.join(&s.file), 4096).unwrap();
        while let Some(e) = r.next_entry().unwrap() {
            if e.kind == EntryKind::File && e.name.ends_with(".tokens") {
                let mut d = Vec::new();
                r.read_data(&mut d, u64::MAX).unwrap();
                all.push(
                    d.chunks(2)
                        .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                        .collect(),
                );
            }
        }
    }
    all
}

/// Prepares `input` (with `--text-field field`) and returns its samples, or the error text.
fn ids_of(input: PathBuf, field: &str, out: PathBuf) -> Result<Vec<Vec<u32>>, String> {
    let mut o = opts(vec![input], out.clone());
    o.text_field = field.into();
    prepare(&o).map_err(|e| e.to_string())?;
    Ok(samples(&out))
}

/// The reference: each document as its own `.txt` file in a folder.
fn reference_ids(d: &Path) -> Vec<Vec<u32>> {
    let texts = d.join("reference-texts");
    std::fs::create_dir_all(&texts).unwrap();
    for (i, doc) in docs().iter().enumerate() {
        std::fs::write(texts.join(format!("{i}.txt")), doc).unwrap();
    }
    let ids = ids_of(texts, "text", d.join("reference-out")).unwrap();
    assert_eq!(ids.len(), DOCS.len());
    ids
}

fn record_batch(columns: Vec<(&str, ArrayRef)>) -> RecordBatch {
    RecordBatch::try_from_iter(columns).unwrap()
}

fn jsonl(field: &str) -> Vec<u8> {
    docs()
        .iter()
        .enumerate()
        .map(|(i, d)| serde_json::json!({ "id": i, field: d }).to_string() + "\n")
        .collect::<String>()
        .into_bytes()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn zstd(bytes: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(bytes, 3).unwrap()
}

fn write_parquet(path: &Path, batch: &RecordBatch, codec: parquet::basic::Compression) {
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(codec)
        .set_max_row_group_size(3) // two row groups: batches cross them
        .build();
    let f = std::fs::File::create(path).unwrap();
    let mut w = parquet::arrow::ArrowWriter::try_new(f, batch.schema(), Some(props)).unwrap();
    w.write(batch).unwrap();
    w.close().unwrap();
}

fn write_arrow_stream(path: &Path, batches: &[RecordBatch]) {
    let f = std::fs::File::create(path).unwrap();
    let mut w = arrow_ipc::writer::StreamWriter::try_new(f, &batches[0].schema()).unwrap();
    for b in batches {
        w.write(b).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn rust_written_files_read_as_their_text() {
    let d = tmpdir("formats_rust");
    let reference = reference_ids(&d);
    let texts: ArrayRef = Arc::new(StringArray::from(docs()));
    let ids: ArrayRef = Arc::new(Int64Array::from_iter_values(0..DOCS.len() as i64));
    let batch = record_batch(vec![("id", ids.clone()), ("text", texts.clone())]);
    let files = d.join("files");
    std::fs::create_dir_all(&files).unwrap();
    let f = |n: &str| files.join(n);

    write_parquet(
        &f("snappy.parquet"),
        &batch,
        parquet::basic::Compression::SNAPPY,
    );
    let zstd_level = parquet::basic::ZstdLevel::try_new(3).unwrap();
    write_parquet(
        &f("zstd.parquet"),
        &record_batch(vec![("body", texts.clone())]),
        parquet::basic::Compression::ZSTD(zstd_level),
    );
    let large: ArrayRef = Arc::new(LargeStringArray::from(docs()));
    let ipc_file = std::fs::File::create(f("file.arrow")).unwrap();
    let large_batch = record_batch(vec![("text", large)]);
    let mut w = arrow_ipc::writer::FileWriter::try_new(ipc_file, &large_batch.schema()).unwrap();
    w.write(&large_batch).unwrap();
    w.finish().unwrap();
    // A save_to_disk folder of two stream files (two batches in the first), read in the order
    // state.json lists them, not by name.
    let hf = d.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    write_arrow_stream(
        &hf.join("data-00001-of-00002.arrow"),
        &[batch.slice(0, 1), batch.slice(1, 1)],
    );
    write_arrow_stream(&hf.join("data-00000-of-00002.arrow"), &[batch.slice(2, 2)]);
    std::fs::write(hf.join("dataset_info.json"), "{}").unwrap();
    std::fs::write(
        hf.join("state.json"),
        r#"{"_data_files": [{"filename": "data-00001-of-00002.arrow"},
                            {"filename": "data-00000-of-00002.arrow"}]}"#,
    )
    .unwrap();
    std::fs::write(f("docs.jsonl.zst"), zstd(&jsonl("text"))).unwrap();
    std::fs::write(f("docs.jsonl.gz"), gzip(&jsonl("text"))).unwrap();
    std::fs::write(f("docs.ndjson"), jsonl("content")).unwrap();
    let array = serde_json::Value::Array(
        docs()
            .iter()
            .map(|t| serde_json::json!({ "text": t }))
            .collect(),
    );
    std::fs::write(f("array.json"), array.to_string()).unwrap();
    let mut tar = fugu_io::tar::TarWriter::new(Vec::new());
    tar.append("part/docs.jsonl.zst", &zstd(&jsonl("text")))
        .unwrap();
    std::fs::write(f("jsonl-in.tar.zst"), zstd(&tar.finish().unwrap())).unwrap();
    for (i, doc) in docs().iter().enumerate() {
        std::fs::write(f(&format!("part-{i}.txt.zst")), zstd(doc.as_bytes())).unwrap();
    }

    let cases: [(PathBuf, &str); 11] = [
        (f("snappy.parquet"), "text"),
        (f("zstd.parquet"), "body"),
        (f("file.arrow"), "text"),
        (hf.clone(), "text"),
        (f("docs.jsonl.zst"), "text"),
        (f("docs.jsonl.gz"), "text"),
        (f("docs.ndjson"), "content"),
        (f("array.json"), "text"),
        (f("jsonl-in.tar.zst"), "text"),
        (f("part-{0..3}.txt.zst"), "text"),
        (f("{snappy,zstd}.parquet"), "text"),
    ];
    for (i, (input, field)) in cases.into_iter().enumerate() {
        let name = input.display().to_string();
        let got = ids_of(input, field, d.join(format!("out{i}")));
        if name.contains("{snappy,zstd}") {
            // The second file has no `text` column: refused, naming it and its string columns.
            let e = got.unwrap_err();
            assert!(
                e.contains("zstd.parquet") && e.contains("no column `text`") && e.contains("body"),
                "{e}"
            );
            continue;
        }
        assert_eq!(got.unwrap(), reference, "{name}");
    }
}

/// Compares every format in `dir` (the script's output) with its `texts/` folder.
fn check_python_written(dir: &Path, scratch: &Path) {
    let reference = ids_of(dir.join("texts"), "text", scratch.join("texts")).unwrap();
    assert_eq!(reference.len(), DOCS.len());
    for (input, field) in [
        ("pandas.parquet", "text"),
        ("polars.parquet", "content"),
        ("hf", "text"),
        ("hf/data-00000-of-00001.arrow", "text"),
        ("hf_dict/train", "text"),
        ("file.arrow", "text"),
        ("docs.jsonl.zst", "text"),
        ("docs.jsonl.gz", "text"),
        ("records.json", "text"),
        ("array.json", "text"),
        ("webdataset.tar", "text"),
    ] {
        let out = scratch.join(input.replace('/', "_"));
        let got = ids_of(dir.join(input), field, out);
        assert_eq!(
            got.as_ref(),
            Ok(&reference),
            "{}",
            dir.join(input).display()
        );
    }
    let e = ids_of(dir.join("hf_dict"), "text", scratch.join("dict")).unwrap_err();
    assert!(
        e.contains("DatasetDict") && e.contains("train, test") && e.contains("hf_dict/train"),
        "{e}"
    );
}

#[test]
fn python_written_files_read_as_their_text() {
    let d = tmpdir("formats_python");
    check_python_written(&fixtures(), &d.join("committed"));
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dev/make_format_fixtures.py");
    let python = std::env::var("FUGU_PYTHON").unwrap_or_else(|_| "python3".into());
    let fresh = d.join("fresh");
    let ran = std::process::Command::new(&python)
        .arg(&script)
        .arg(&fresh)
        .output();
    match ran {
        Ok(o) if o.status.success() => check_python_written(&fresh, &d.join("fresh-out")),
        Ok(o) => skipped(&format!(
            "writing the formats afresh needs pyarrow, datasets, zstandard and webdataset in {python} \
             (FUGU_PYTHON): {}",
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .last()
                .unwrap_or("")
        )),
        Err(e) => skipped(&format!("{python} (FUGU_PYTHON) does not run: {e}")),
    }
}

#[test]
fn unreadable_and_unsupported_files_are_refused_by_name() {
    let d = tmpdir("formats_refused");
    let fx = fixtures();
    let w = |name: &str, bytes: &[u8]| {
        let p = d.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let pandas = std::fs::read(fx.join("pandas.parquet")).unwrap();
    let arrow = std::fs::read(fx.join("file.arrow")).unwrap();
    let jsonl_zst = std::fs::read(fx.join("docs.jsonl.zst")).unwrap();
    let texts: ArrayRef = Arc::new(StringArray::from(vec![Some("a"), None, Some("c")]));
    write_parquet(
        &d.join("nulls.parquet"),
        &record_batch(vec![("text", texts)]),
        parquet::basic::Compression::UNCOMPRESSED,
    );
    let cases: Vec<(PathBuf, &str, Vec<&str>)> = vec![
        (
            w("cut.parquet", &pandas[..pandas.len() / 2]),
            "text",
            vec!["cut.parquet", "not a readable Parquet file"],
        ),
        (
            w("cut.arrow", &arrow[..arrow.len() / 2]),
            "text",
            vec!["cut.arrow", "not a readable Arrow IPC file"],
        ),
        (
            w("junk.arrow", b"not arrow at all"),
            "text",
            vec!["junk.arrow", "Arrow IPC stream"],
        ),
        (
            w("cut.jsonl.zst", &jsonl_zst[..jsonl_zst.len() / 2]),
            "text",
            vec!["cut.jsonl.zst"],
        ),
        (
            w("table.csv", b"text,id\nhello,1\n"),
            "text",
            vec!["table.csv", "CSV"],
        ),
        (
            fx.join("polars.parquet"),
            "text",
            vec!["polars.parquet", "no column `text`", "content"],
        ),
        (
            fx.join("polars.parquet"),
            "id",
            vec!["polars.parquet", "column `id` holds Int64, not strings"],
        ),
        (
            d.join("nulls.parquet"),
            "text",
            vec!["nulls.parquet:row 2", "null"],
        ),
        (
            fx.join("records.json"),
            "body",
            vec!["records.json:1", "no field `body`", "string fields: [text]"],
        ),
        (
            w("numbers.jsonl", b"{\"text\": 5}\n"),
            "text",
            vec!["numbers.jsonl:1", "not a string but a number"],
        ),
        (
            w("gz.jsonl", &gzip(b"{\"text\": \"x\"}\n")),
            "text",
            vec!["gz.jsonl", "gzip", "not JSON Lines"],
        ),
        (
            w("parquet-named.txt", &pandas),
            "text",
            vec!["parquet-named.txt", "Parquet", "name it .parquet"],
        ),
        (
            w("bad-array.json", b"[{\"text\": \"a\"}, 3"),
            "text",
            vec!["bad-array.json", "not a JSON array of records"],
        ),
    ];
    for (i, (input, field, want)) in cases.into_iter().enumerate() {
        let name = input.display().to_string();
        let e = ids_of(input, field, d.join(format!("out{i}"))).unwrap_err();
        for w in want {
            assert!(e.contains(w), "{name}: `{w}` not in: {e}");
        }
    }
    // --skip-bad-samples: the null row is left out and counted, the others kept.
    let mut o = opts(vec![d.join("nulls.parquet")], d.join("skip"));
    o.skip_bad = true;
    let m = prepare(&o).unwrap().manifest;
    assert_eq!((m.totals.documents, m.totals.skipped_bad_inputs), (2, 1));
}

#!/usr/bin/env python3
"""Writes the same documents in every input format `fugu prepare` reads, each with the format's
own Python library, into OUT (default tests/fixtures/formats):

  texts/0.txt ...        one plain UTF-8 file per document (the reference: what the ids must be)
  pandas.parquet         pyarrow, snappy (what pandas' and datasets' to_parquet write)
  polars.parquet         pyarrow, zstd, a `content` column beside an int column
  hf/                    datasets' Dataset.save_to_disk (Arrow IPC stream + state.json)
  hf_dict/               datasets' DatasetDict.save_to_disk (refused: a split must be named)
  file.arrow             pyarrow's Arrow IPC file format (large_string column)
  docs.jsonl.zst         zstandard
  docs.jsonl.gz          gzip
  records.json           datasets' to_json (JSON Lines under a .json name)
  array.json             one JSON array of records
  webdataset.tar         webdataset's TarWriter: one sample per document, its text as KEY.txt

io/tests/io_formats.rs (`python_written_files_read_as_their_text`) reads the committed copy,
and runs this script into a temporary folder when pyarrow, datasets, zstandard and webdataset
are importable.
"""
import gzip
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

DOCS = [
    "First document.\nIt has two lines.\n",
    "Second: ünïcödé, 日本語 and a fish 🐟.",
    "  leading spaces, a tab\tand a blank line\n\nthen more",
    "To be, or not to be, that is the question:\n" * 3,
]


def main(out):
    os.makedirs(os.path.join(out, "texts"), exist_ok=True)
    for i, d in enumerate(DOCS):
        with open(os.path.join(out, "texts", f"{i}.txt"), "w", encoding="utf-8") as f:
            f.write(d)
    pq.write_table(pa.table({"text": DOCS}), os.path.join(out, "pandas.parquet"),
                   compression="snappy")
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "content": DOCS}),
                   os.path.join(out, "polars.parquet"), compression="zstd")
    table = pa.table({"text": pa.array(DOCS, type=pa.large_string())})
    with pa.OSFile(os.path.join(out, "file.arrow"), "wb") as sink:
        with pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
    lines = "".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS))
    with open(os.path.join(out, "docs.jsonl.zst"), "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(lines.encode()))
    with open(os.path.join(out, "docs.jsonl.gz"), "wb") as f:
        f.write(gzip.compress(lines.encode(), mtime=0))
    with open(os.path.join(out, "array.json"), "w", encoding="utf-8") as f:
        json.dump([{"text": d} for d in DOCS], f, ensure_ascii=False, indent=1)
    import webdataset

    with webdataset.TarWriter(os.path.join(out, "webdataset.tar")) as w:
        for i, d in enumerate(DOCS):
            w.write({"__key__": f"doc{i:04d}", "txt": d})

    import datasets

    datasets.disable_progress_bars()

    ds = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    ds.save_to_disk(os.path.join(out, "hf"))
    ds.to_json(os.path.join(out, "records.json"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(
        os.path.join(out, "hf_dict"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/formats")

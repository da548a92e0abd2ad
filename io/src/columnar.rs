//! The text column of columnar files: Parquet, and Arrow IPC (the stream format Hugging Face
//! `datasets` writes with `save_to_disk` and keeps in its cache, or the random-access file
//! format). Files are read batch by batch and only the named column is decoded; each row's
//! string goes to a callback in file order.

use crate::error::{Error, Result};
use std::path::Path;

/// One row's text (`None`: null) and its 1-based row number in the file.
pub type RowSink<'a> = dyn FnMut(u64, Option<&str>) -> Result<()> + 'a;

/// The error for an input this build cannot read (built without the `formats` feature).
pub fn not_built(source: &str, what: &str) -> Error {
    Error::Input {
        path: source.into(),
        what: format!(
            "is {what}, which this fugu was built without (cargo feature `formats`, on by \
             default)"
        ),
    }
}

#[cfg(not(feature = "formats"))]
pub fn parquet_texts(path: &Path, _field: &str, _each: &mut RowSink) -> Result<()> {
    Err(not_built(&path.display().to_string(), "Parquet"))
}

#[cfg(not(feature = "formats"))]
pub fn arrow_texts(path: &Path, _field: &str, _each: &mut RowSink) -> Result<()> {
    Err(not_built(&path.display().to_string(), "Arrow IPC"))
}

#[cfg(feature = "formats")]
pub use readers::{arrow_texts, parquet_texts};

#[cfg(feature = "formats")]
mod readers {
    use super::RowSink;
    use crate::error::{Error, Result};
    use arrow_array::cast::AsArray;
    use arrow_array::{Array, ArrayRef, RecordBatch};
    use arrow_schema::{DataType, Schema};
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::arrow::ProjectionMask;
    use std::fs::File;
    use std::io::{BufReader, Read};
    use std::path::Path;

    /// Rows decoded at a time.
    const BATCH_ROWS: usize = 1024;

    /// Calls `each` with every row of column `field` of the Parquet file at `path`.
    pub fn parquet_texts(path: &Path, field: &str, each: &mut RowSink) -> Result<()> {
        let bad = |what: String| Error::Input {
            path: path.into(),
            what,
        };
        let file = File::open(path).map_err(|e| Error::io(path, "open input", e))?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file)
            .map_err(|e| bad(format!("is not a readable Parquet file: {e}")))?;
        let column = text_column(builder.schema(), field).map_err(&bad)?;
        let mask = ProjectionMask::roots(builder.parquet_schema(), [column]);
        let reader = builder
            .with_projection(mask)
            .with_batch_size(BATCH_ROWS)
            .build()
            .map_err(|e| bad(format!("cannot read column `{field}`: {e}")))?;
        let mut row = 0u64;
        for batch in reader {
            let batch = batch.map_err(|e| bad(format!("reading rows after row {row}: {e}")))?;
            each_text(batch.column(0), &mut row, each)?;
        }
        Ok(())
    }

    /// Calls `each` with every row of column `field` of the Arrow IPC file or stream at `path`.
    pub fn arrow_texts(path: &Path, field: &str, each: &mut RowSink) -> Result<()> {
        let bad = |what: String| Error::Input {
            path: path.into(),
            what,
        };
        let open = || -> Result<BufReader<File>> {
            File::open(path)
                .map(|f| BufReader::with_capacity(1 << 20, f))
                .map_err(|e| Error::io(path, "open input", e))
        };
        let mut magic = [0u8; 6];
        let n = open()?
            .read(&mut magic)
            .map_err(|e| Error::io(path, "read", e))?;
        let is_file_format = n == magic.len() && &magic == b"ARROW1";
        let mut row = 0u64;
        let mut take = |batch: std::result::Result<RecordBatch, arrow_schema::ArrowError>,
                        row: &mut u64|
         -> Result<()> {
            let batch = batch.map_err(|e| bad(format!("reading rows after row {row}: {e}")))?;
            each_text(batch.column(0), row, each)
        };
        if is_file_format {
            let schema = arrow_ipc::reader::FileReader::try_new(open()?, None)
                .map_err(|e| bad(format!("is not a readable Arrow IPC file: {e}")))?
                .schema();
            let column = text_column(&schema, field).map_err(&bad)?;
            let reader = arrow_ipc::reader::FileReader::try_new(open()?, Some(vec![column]))
                .map_err(|e| bad(format!("is not a readable Arrow IPC file: {e}")))?;
            for batch in reader {
                take(batch, &mut row)?;
            }
        } else {
            let schema = arrow_ipc::reader::StreamReader::try_new(open()?, None)
                .map_err(|e| bad(format!("is not a readable Arrow IPC stream: {e}")))?
                .schema();
            let column = text_column(&schema, field).map_err(&bad)?;
            let reader = arrow_ipc::reader::StreamReader::try_new(open()?, Some(vec![column]))
                .map_err(|e| bad(format!("is not a readable Arrow IPC stream: {e}")))?;
            for batch in reader {
                take(batch, &mut row)?;
            }
        }
        Ok(())
    }

    /// The index of top-level column `field`, which must hold strings; else what is wrong, naming
    /// the columns that do.
    fn text_column(schema: &Schema, field: &str) -> std::result::Result<usize, String> {
        let is_text =
            |t: &DataType| matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View);
        let texts: Vec<&str> = schema
            .fields()
            .iter()
            .filter(|f| is_text(f.data_type()))
            .map(|f| f.name().as_str())
            .collect();
        let hint = if texts.is_empty() {
            "it has no string column".to_string()
        } else {
            format!(
                "its string columns: {} (choose one with --text-field)",
                texts.join(", ")
            )
        };
        match schema.index_of(field) {
            Ok(i) if is_text(schema.field(i).data_type()) => Ok(i),
            Ok(i) => Err(format!(
                "column `{field}` holds {}, not strings; {hint}",
                schema.field(i).data_type()
            )),
            Err(_) => Err(format!("has no column `{field}`; {hint}")),
        }
    }

    /// Passes each row of a string array to `each`, counting rows in `row`.
    fn each_text(column: &ArrayRef, row: &mut u64, each: &mut RowSink) -> Result<()> {
        let mut emit = |value: Option<&str>| {
            *row += 1;
            each(*row, value)
        };
        if let Some(a) = column.as_string_opt::<i32>() {
            for i in 0..a.len() {
                emit(a.is_valid(i).then(|| a.value(i)))?;
            }
        } else if let Some(a) = column.as_string_opt::<i64>() {
            for i in 0..a.len() {
                emit(a.is_valid(i).then(|| a.value(i)))?;
            }
        } else {
            let a = column.as_string_view();
            for i in 0..a.len() {
                emit(a.is_valid(i).then(|| a.value(i)))?;
            }
        }
        Ok(())
    }
}

/// The data files of a Hugging Face `save_to_disk` folder, in order (`state.json`'s
/// `_data_files`); `None` when `dir` is not one. A `DatasetDict` folder (`dataset_dict.json`)
/// is refused: which split to read is the user's choice.
pub fn hf_dataset_files(dir: &Path) -> Result<Option<Vec<std::path::PathBuf>>> {
    let dict = dir.join("dataset_dict.json");
    if dict.is_file() {
        let splits = std::fs::read(&dict)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|v| {
                v.get("splits")?.as_array().map(|a| {
                    a.iter()
                        .filter_map(|s| s.as_str().map(str::to_owned))
                        .collect::<Vec<_>>()
                })
            })
            .unwrap_or_default();
        return Err(Error::Input {
            path: dir.into(),
            what: format!(
                "is a Hugging Face DatasetDict with splits [{}]: name the split's folder, e.g. {}",
                splits.join(", "),
                dir.join(splits.first().map_or("train", |s| s.as_str()))
                    .display()
            ),
        });
    }
    let state = dir.join("state.json");
    if !state.is_file() || !dir.join("dataset_info.json").is_file() {
        return Ok(None);
    }
    let bad = |what: String| Error::Input {
        path: state.clone(),
        what,
    };
    let bytes = std::fs::read(&state).map_err(|e| Error::io(&state, "read", e))?;
    let v: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let files = v
        .get("_data_files")
        .and_then(|f| f.as_array())
        .ok_or_else(|| bad("has no `_data_files` list".into()))?;
    files
        .iter()
        .map(|f| {
            let name = f
                .get("filename")
                .and_then(|n| n.as_str())
                .filter(|n| !n.contains('/') && !n.contains('\\') && !n.starts_with('.'))
                .ok_or_else(|| {
                    bad(format!(
                        "`_data_files` entry {f} has no plain `filename` in this folder"
                    ))
                })?;
            Ok(dir.join(name))
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

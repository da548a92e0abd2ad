//! `OUT/metrics.jsonl`: one JSON object per line, each with a `"type"`:
//!
//! * `{"type":"header", ...}`: whatever the trainer passes (config, machine, thread layout,
//!   world/tp/dp); a resumed run appends a new header;
//! * `{"type":"step","step":..,"loss":..,"lr":..,"grad_norm":..,"tokens":..,"tokens_per_s":..,
//!   "step_ms":..,"tflops_per_process":..,"peak_pct":..,"timers":{name: ms}}`, and with several
//!   ranks also `"timers_min"`, `"timers_max"` (over ranks; `timers` is then the mean) and
//!   `"comm_bytes"`;
//!   and `"bpb"` (the loss in bits per byte of text, when the data's manifest counts its bytes);
//! * `{"type":"eval","step":..,"val_loss":..,"val_bpb":..}` (`val_bpb` as `bpb`);
//! * `{"type":"event","kind":"checkpoint", ...}`: anything else (checkpoint written, skipped
//!   non-finite step, ...), the payload's fields inline.
//!
//! Every line also carries `"time"`: when it was written, in seconds since the Unix epoch (UTC,
//! millisecond resolution).
//!
//! Every line is written with one `write` call and flushed, so a reader (or `tail -f`) never
//! sees a line that the writer has not finished, except after a crash, when the last line may be
//! cut short; [`read_metrics`] tolerates that.
//!
//! **Non-finite numbers** (a NaN loss, an infinite gradient norm) are written as `null`, which
//! keeps every line valid JSON; [`read_metrics`] reads `null` back as NaN for the float fields
//! of [`StepRecord`] and [`EvalRecord`] (including the `timers` values). Whether it was NaN or ±∞ is not kept.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// One training step as written to `metrics.jsonl`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    /// 1-based number of the step just completed.
    pub step: u64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub loss: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub lr: f64,
    /// Gradient norm before clipping.
    #[serde(deserialize_with = "f64_or_nan")]
    pub grad_norm: f64,
    /// Tokens processed by the whole job so far.
    pub tokens: u64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub tokens_per_s: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub step_ms: f64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub tflops_per_process: f64,
    /// `tflops_per_process` as % of the process's FP32 peak (`MachineInfo::peak_gflops`).
    #[serde(deserialize_with = "f64_or_nan")]
    pub peak_pct: f64,
    /// Milliseconds per timer name in this step ([`super::Timers::take_step`]).
    /// With several ranks: the mean over ranks.
    #[serde(default, deserialize_with = "map_f64_or_nan")]
    pub timers: BTreeMap<String, f64>,
    /// With several ranks: the minimum over ranks of each timer.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "map_f64_or_nan"
    )]
    pub timers_min: BTreeMap<String, f64>,
    /// With several ranks: the maximum over ranks of each timer.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "map_f64_or_nan"
    )]
    pub timers_max: BTreeMap<String, f64>,
    /// Payload bytes this rank handed to collectives in this step (see
    /// [`crate::comm`]); absent for one process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_bytes: Option<u64>,
    /// The loss in bits per byte of training text (`loss / ln 2 × tokens / text bytes` of the
    /// training split): comparable across tokenizers. Absent when the data does not record
    /// its text bytes (token files, older manifests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bpb: Option<f64>,
}

/// A validation-loss measurement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    pub step: u64,
    #[serde(deserialize_with = "f64_or_nan")]
    pub val_loss: f64,
    /// The loss in bits per byte of the validation text (see [`StepRecord::bpb`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_bpb: Option<f64>,
}

/// One line of `metrics.jsonl` as read back.
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// The header's fields (without `type`).
    Header(Value),
    Step(StepRecord),
    Eval(EvalRecord),
    /// An event's kind and its other fields (without `type` and `kind`).
    Event {
        kind: String,
        data: Value,
    },
    /// A line with a `type` this reader does not know (kept for newer writers).
    Unknown(Value),
}

fn f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

fn map_f64_or_nan<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, f64>, D::Error> {
    let m = BTreeMap::<String, Option<f64>>::deserialize(d)?;
    Ok(m.into_iter()
        .map(|(k, v)| (k, v.unwrap_or(f64::NAN)))
        .collect())
}

/// Appends `"type": ty` to a serialisable value that must be a JSON object (the writer keeps
/// `type` first on the line).
#[derive(Serialize)]
struct Tagged<'a, T: ?Sized> {
    #[serde(rename = "type")]
    ty: &'a str,
    time: f64,
    #[serde(flatten)]
    body: &'a T,
}

/// Writes `metrics.jsonl` (see the module docs).
#[derive(Debug)]
pub struct MetricsWriter {
    file: File,
    path: PathBuf,
}

impl MetricsWriter {
    /// Creates (or truncates) `path`, creating its directory if needed.
    pub fn create(path: impl AsRef<Path>) -> Result<MetricsWriter> {
        let path = path.as_ref();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating directory {}", dir.display()))?;
        }
        let file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        Ok(MetricsWriter {
            file,
            path: path.to_owned(),
        })
    }

    /// Opens `path` for appending (a resumed run), creating it if missing. If the file ends
    /// in a line cut short by a crash, a newline is written first so that the cut line stays
    /// on its own (the reader skips it).
    pub fn append(path: impl AsRef<Path>) -> Result<MetricsWriter> {
        let path = path.as_ref();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("creating directory {}", dir.display()))?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("opening {} for appending", path.display()))?;
        let len = file.metadata()?.len();
        if len > 0 {
            let mut last = [0u8; 1];
            file.seek(SeekFrom::Start(len - 1))?;
            file.read_exact(&mut last)?;
            if last[0] != b'\n' {
                file.write_all(b"\n")?;
            }
        }
        Ok(MetricsWriter {
            file,
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_line(&mut self, mut line: String) -> Result<()> {
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|_| self.file.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }

    fn write_tagged<T: Serialize + ?Sized>(&mut self, ty: &str, body: &T) -> Result<()> {
        let time = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| (d.as_millis() as f64) / 1e3);
        let line = serde_json::to_string(&Tagged { ty, time, body })
            .with_context(|| format!("a {ty} record must serialise to a JSON object"))?;
        self.write_line(line)
    }

    /// `{"type":"header", ...header's fields}`. `header` must serialise to an object (a struct
    /// or a map); a `type` field of its own is not allowed.
    pub fn header<T: Serialize + ?Sized>(&mut self, header: &T) -> Result<()> {
        self.write_tagged("header", header)
    }

    /// `{"type":"step", ...}`.
    pub fn step(&mut self, rec: &StepRecord) -> Result<()> {
        self.write_tagged("step", rec)
    }

    /// `{"type":"eval","step":..,"val_loss":..,"val_bpb":..}`.
    pub fn eval(&mut self, rec: &EvalRecord) -> Result<()> {
        self.write_tagged("eval", rec)
    }

    /// `{"type":"event","kind":kind, ...}`: an object's fields go inline (a `type` or `kind`
    /// field in it is dropped); any other value goes under `"data"`.
    pub fn event(&mut self, kind: &str, data: &Value) -> Result<()> {
        let mut m = Map::new();
        m.insert("kind".into(), Value::String(kind.into()));
        match data {
            Value::Object(o) => {
                for (k, v) in o {
                    if k != "type" && k != "kind" {
                        m.insert(k.clone(), v.clone());
                    }
                }
            }
            Value::Null => {}
            other => {
                m.insert("data".into(), other.clone());
            }
        }
        self.write_tagged("event", &m)
    }
}

/// Reads a `metrics.jsonl` file (see [`parse_metrics`]).
pub fn read_metrics(path: impl AsRef<Path>) -> Result<Vec<Record>> {
    let path = path.as_ref();
    let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    parse_metrics(&String::from_utf8_lossy(&text)).with_context(|| format!("in {}", path.display()))
}

/// Parses the lines of a `metrics.jsonl`. Blank lines are skipped. A line that is not a JSON
/// object is skipped when it is the last line (a run still writing, or killed mid-line) or
/// when the next record is a header (a run killed mid-line, then resumed); anywhere else it is
/// an error naming the line.
pub fn parse_metrics(text: &str) -> Result<Vec<Record>> {
    let mut out = Vec::new();
    // A bad line waiting to see whether a header follows: (line number, error).
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let v = match serde_json::from_str::<Value>(line) {
            Ok(v @ Value::Object(_)) => v,
            Ok(_) => {
                bail_or_pend(&mut pending, i + 1, "not a JSON object".into())?;
                continue;
            }
            Err(e) => {
                bail_or_pend(&mut pending, i + 1, e.to_string())?;
                continue;
            }
        };
        let rec = to_record(v).with_context(|| format!("line {}", i + 1))?;
        if let Some((n, e)) = pending.take() {
            if !matches!(rec, Record::Header(_)) {
                bail!("line {n} is not valid JSON ({e})");
            }
        }
        out.push(rec);
    }
    Ok(out)
}

fn bail_or_pend(pending: &mut Option<(usize, String)>, n: usize, e: String) -> Result<()> {
    if let Some((m, e)) = pending.take() {
        bail!("line {m} is not valid JSON ({e})");
    }
    *pending = Some((n, e));
    Ok(())
}

fn to_record(v: Value) -> Result<Record> {
    let Value::Object(mut m) = v else {
        unreachable!("checked by the caller")
    };
    let ty = m.remove("type");
    // Every line's write time; the typed records leave it out, headers and events too.
    m.remove("time");
    Ok(match ty.as_ref().and_then(Value::as_str) {
        Some("header") => Record::Header(Value::Object(m)),
        Some("step") => Record::Step(serde_json::from_value(Value::Object(m))?),
        Some("eval") => Record::Eval(serde_json::from_value(Value::Object(m))?),
        Some("event") => {
            let kind = match m.remove("kind") {
                Some(Value::String(s)) => s,
                _ => String::new(),
            };
            Record::Event {
                kind,
                data: Value::Object(m),
            }
        }
        _ => {
            if let Some(t) = ty {
                m.insert("type".into(), t);
            }
            Record::Unknown(Value::Object(m))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fugu-metrics-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d.join("out").join("metrics.jsonl")
    }

    fn step(n: u64, loss: f64) -> StepRecord {
        let mut timers = BTreeMap::new();
        timers.insert("forward".to_string(), 12.5);
        StepRecord {
            step: n,
            loss,
            lr: 1e-3,
            grad_norm: 0.7,
            tokens: n * 1024,
            tokens_per_s: 5000.0,
            step_ms: 204.8,
            tflops_per_process: 0.12,
            peak_pct: 8.5,
            timers,
            ..Default::default()
        }
    }

    #[derive(Serialize)]
    struct Header {
        world: usize,
        tp: usize,
        dp: usize,
        machine: Value,
    }

    fn eval(step: u64, val_loss: f64) -> EvalRecord {
        EvalRecord {
            step,
            val_loss,
            val_bpb: None,
        }
    }

    #[test]
    fn write_then_read_all_kinds() {
        let p = tmp("kinds");
        let mut w = MetricsWriter::create(&p).unwrap();
        w.header(&Header {
            world: 2,
            tp: 1,
            dp: 2,
            machine: json!({"threads": 4}),
        })
        .unwrap();
        w.step(&step(1, 5.5)).unwrap();
        w.eval(&eval(1, 5.25)).unwrap();
        w.event("checkpoint", &json!({"step": 1, "path": "ckpt/1"}))
            .unwrap();
        w.event("note", &json!("hello")).unwrap();
        drop(w);

        let text = std::fs::read_to_string(&p).unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        for line in text.lines() {
            assert!(line.starts_with("{\"type\":\""), "{line}");
            let v: Value = serde_json::from_str(line).unwrap();
            let t = v["time"].as_f64().unwrap();
            assert!((now - 60.0..=now + 1.0).contains(&t), "{line}");
        }
        let recs = read_metrics(&p).unwrap();
        assert_eq!(recs.len(), 5);
        match &recs[0] {
            Record::Header(h) => {
                assert_eq!(h["dp"], 2);
                assert_eq!(h["machine"]["threads"], 4);
                assert!(h.get("type").is_none());
            }
            r => panic!("{r:?}"),
        }
        assert_eq!(recs[1], Record::Step(step(1, 5.5)));
        assert_eq!(recs[2], Record::Eval(eval(1, 5.25)));
        assert_eq!(
            recs[3],
            Record::Event {
                kind: "checkpoint".into(),
                data: json!({"step": 1, "path": "ckpt/1"})
            }
        );
        assert_eq!(
            recs[4],
            Record::Event {
                kind: "note".into(),
                data: json!({"data": "hello"})
            }
        );
        std::fs::remove_dir_all(p.parent().unwrap().parent().unwrap()).unwrap();
    }

    #[test]
    fn non_finite_values_are_null_and_read_back_as_nan() {
        let p = tmp("nan");
        let mut w = MetricsWriter::create(&p).unwrap();
        let mut s = step(3, f64::NAN);
        s.grad_norm = f64::INFINITY;
        s.timers.insert("backward".into(), f64::NEG_INFINITY);
        w.step(&s).unwrap();
        w.eval(&eval(3, f64::NAN)).unwrap();
        w.event("skipped", &json!({"step": 3, "loss": f64::NAN}))
            .unwrap();
        drop(w);
        let text = std::fs::read_to_string(&p).unwrap();
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).expect("valid JSON");
            assert!(v.is_object());
        }
        assert!(text.contains("\"loss\":null"), "{text}");
        assert!(text.contains("\"grad_norm\":null"), "{text}");
        let recs = read_metrics(&p).unwrap();
        let Record::Step(r) = &recs[0] else {
            panic!("{:?}", recs[0])
        };
        assert!(r.loss.is_nan() && r.grad_norm.is_nan());
        assert_eq!(r.lr, 1e-3);
        assert!(r.timers["backward"].is_nan());
        assert_eq!(r.timers["forward"], 12.5);
        let Record::Eval(e) = &recs[1] else {
            panic!("{:?}", recs[1])
        };
        assert!(e.val_loss.is_nan());
        std::fs::remove_dir_all(p.parent().unwrap().parent().unwrap()).unwrap();
    }

    #[test]
    fn missing_timers_default_to_empty() {
        let line = r#"{"type":"step","step":1,"loss":1,"lr":1,"grad_norm":1,"tokens":1,"tokens_per_s":1,"step_ms":1,"tflops_per_process":1,"peak_pct":1}"#;
        let recs = parse_metrics(line).unwrap();
        let Record::Step(r) = &recs[0] else {
            panic!("{recs:?}")
        };
        assert!(r.timers.is_empty());
    }

    #[test]
    fn truncated_last_line_is_skipped() {
        let p = tmp("trunc");
        let mut w = MetricsWriter::create(&p).unwrap();
        w.step(&step(1, 5.0)).unwrap();
        w.step(&step(2, 4.0)).unwrap();
        drop(w);
        let full = std::fs::read_to_string(&p).unwrap();
        // Cut the last line at every position: the first record always survives.
        let first_len = full.find('\n').unwrap() + 1;
        for cut in first_len..full.len() {
            let recs = parse_metrics(&full[..cut]).unwrap();
            let want = if cut >= full.len() - 1 { 2 } else { 1 };
            assert_eq!(recs.len(), want, "cut at {cut}");
        }
        std::fs::remove_dir_all(p.parent().unwrap().parent().unwrap()).unwrap();
    }

    #[test]
    fn a_bad_line_in_the_middle_is_an_error() {
        let text = "{\"type\":\"eval\",\"step\":1,\"val_loss\":2}\n{\"type\":\"st\n{\"type\":\"eval\",\"step\":2,\"val_loss\":2}\n";
        let e = parse_metrics(text).unwrap_err();
        assert!(format!("{e:#}").contains("line 2"), "{e:#}");
        // A well-formed line of the wrong shape names its line too.
        let text = "{\"type\":\"eval\",\"step\":\"x\",\"val_loss\":2}\n";
        assert!(format!("{:#}", parse_metrics(text).unwrap_err()).contains("line 1"));
    }

    #[test]
    fn append_after_a_crash_isolates_the_cut_line() {
        let p = tmp("append");
        let mut w = MetricsWriter::create(&p).unwrap();
        w.header(&json!({"run": 1})).unwrap();
        w.step(&step(1, 5.0)).unwrap();
        drop(w);
        // Simulate a crash in the middle of writing step 2.
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(b"{\"type\":\"step\",\"step\":2,\"lo").unwrap();
        drop(f);
        let mut w = MetricsWriter::append(&p).unwrap();
        w.header(&json!({"run": 2, "resumed_from": 1})).unwrap();
        w.step(&step(2, 4.5)).unwrap();
        drop(w);
        let recs = read_metrics(&p).unwrap();
        let kinds: Vec<&str> = recs
            .iter()
            .map(|r| match r {
                Record::Header(_) => "header",
                Record::Step(_) => "step",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, ["header", "step", "header", "step"]);
        assert_eq!(recs[3], Record::Step(step(2, 4.5)));
        // Appending to a clean file adds no blank line; to a missing file creates it.
        let before = std::fs::read_to_string(&p).unwrap();
        MetricsWriter::append(&p).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), before);
        let q = p.with_file_name("new.jsonl");
        let mut w = MetricsWriter::append(&q).unwrap();
        w.eval(&eval(1, 1.0)).unwrap();
        assert_eq!(read_metrics(&q).unwrap().len(), 1);
        std::fs::remove_dir_all(p.parent().unwrap().parent().unwrap()).unwrap();
    }

    #[test]
    fn unknown_types_are_kept_and_headers_must_be_objects() {
        let recs = parse_metrics("{\"type\":\"future\",\"x\":1}\n{\"x\":2}\n").unwrap();
        assert_eq!(recs[0], Record::Unknown(json!({"type": "future", "x": 1})));
        assert_eq!(recs[1], Record::Unknown(json!({"x": 2})));
        let p = tmp("hdr");
        let mut w = MetricsWriter::create(&p).unwrap();
        assert!(w.header(&5u32).is_err());
        std::fs::remove_dir_all(p.parent().unwrap().parent().unwrap()).unwrap();
    }
}

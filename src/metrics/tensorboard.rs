//! TensorBoard event files: `OUT/events.out.tfevents.TIME.HOST.PID`, beside `metrics.jsonl`,
//! holding the same scalars (TensorBoard reads every such file in a run folder, so a resumed
//! run adds one).
//!
//! The format, written without TensorFlow: a sequence of TFRecords (`u64` length, masked
//! CRC-32C of the length, the bytes, masked CRC-32C of the bytes; little-endian), each a
//! serialised `tensorflow.Event` protocol buffer. The first carries `file_version =
//! "brain.Event:2"`; each later one a `wall_time`, a `step` and a `Summary` of
//! `(tag, simple_value)` pairs. The few protobuf fields needed are encoded by hand below.

use super::jsonl::{EvalRecord, StepRecord};
use anyhow::{Context, Result};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes scalars to one event file; each call is flushed, so TensorBoard sees it at once.
#[derive(Debug)]
pub struct TensorBoardWriter {
    file: File,
    path: PathBuf,
}

impl TensorBoardWriter {
    /// Creates a new event file in `dir` and writes its version record.
    pub fn create(dir: &Path) -> Result<TensorBoardWriter> {
        let now = wall_time();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .ok()
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .unwrap_or_else(|| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now as u64,
            std::process::id()
        ));
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = TensorBoardWriter { file, path };
        let mut event = Vec::new();
        put_double(&mut event, 1, now);
        put_bytes(&mut event, 3, b"brain.Event:2");
        w.write_record(&event)?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A training step's scalars: `train/loss`, `train/bpb` (when known), `train/lr`,
    /// `train/grad_norm`, `train/tokens_per_s`, `train/tflops_per_process`, `train/peak_pct`
    /// (MFU against the FP32 peak), `train/step_ms`, and each timer as `time_ms/NAME`.
    pub fn step(&mut self, r: &StepRecord) -> Result<()> {
        let mut values: Vec<(String, f64)> = vec![("train/loss".into(), r.loss)];
        if let Some(b) = r.bpb {
            values.push(("train/bpb".into(), b));
        }
        values.extend([
            ("train/lr".into(), r.lr),
            ("train/grad_norm".into(), r.grad_norm),
            ("train/tokens_per_s".into(), r.tokens_per_s),
            ("train/tflops_per_process".into(), r.tflops_per_process),
            ("train/peak_pct".into(), r.peak_pct),
            ("train/step_ms".into(), r.step_ms),
        ]);
        values.extend(r.timers.iter().map(|(k, v)| (format!("time_ms/{k}"), *v)));
        let refs: Vec<(&str, f64)> = values.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        self.scalars(r.step, &refs)
    }

    /// An evaluation's scalars: `val/loss` and `val/bpb` (when known).
    pub fn eval(&mut self, r: &EvalRecord) -> Result<()> {
        let mut values = vec![("val/loss", r.val_loss)];
        if let Some(b) = r.val_bpb {
            values.push(("val/bpb", b));
        }
        self.scalars(r.step, &values)
    }

    /// One event at `step` holding every `(tag, value)` as a scalar.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> Result<()> {
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            put_bytes(&mut value, 1, tag.as_bytes());
            put_float(&mut value, 2, *v as f32);
            put_bytes(&mut summary, 1, &value);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    fn write_record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
        rec.extend_from_slice(data);
        rec.extend_from_slice(&masked_crc32c(data).to_le_bytes());
        self.file
            .write_all(&rec)
            .and_then(|_| self.file.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_varint_field(out: &mut Vec<u8>, field: u64, v: u64) {
    put_varint(out, field << 3);
    put_varint(out, v);
}

fn put_double(out: &mut Vec<u8>, field: u64, v: f64) {
    put_varint(out, (field << 3) | 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_float(out: &mut Vec<u8>, field: u64, v: f32) {
    put_varint(out, (field << 3) | 5);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_varint(out, (field << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bitwise: records are small.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82F6_3B78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// TFRecord's masking of a CRC (so that a CRC of CRCs is not trivially related).
fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// One event read back: its step and its `(tag, value)` scalars.
pub type ScalarEvent = (u64, Vec<(String, f32)>);

/// A protobuf field: number, wire type, varint value, bytes (for the other wire types).
type Field<'a> = (u64, u8, u64, &'a [u8]);

/// Reads an event file back: each event's step and scalars (the version record has none).
/// For tests and tools; every record's CRCs are checked.
pub fn read_scalars(path: &Path) -> Result<Vec<ScalarEvent>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let bad = |what: &str| anyhow::anyhow!("{}: byte {at}: {what}", path.display());
        let head = bytes
            .get(at..at + 12)
            .ok_or_else(|| bad("cut-off record header"))?;
        let len = u64::from_le_bytes(head[..8].try_into()?) as usize;
        if masked_crc32c(&head[..8]).to_le_bytes() != head[8..12] {
            return Err(bad("length CRC mismatch"));
        }
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or_else(|| bad("cut-off record"))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or_else(|| bad("cut-off record CRC"))?;
        if masked_crc32c(data).to_le_bytes() != crc {
            return Err(bad("data CRC mismatch"));
        }
        if let Some(e) = parse_event(data) {
            out.push(e);
        }
        at += 16 + len;
    }
    Ok(out)
}

/// A protobuf message's fields: (field number, wire type, varint value or bytes).
fn fields(mut b: &[u8]) -> Option<Vec<Field<'_>>> {
    fn varint(b: &mut &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&x, rest) = b.split_first()?;
            *b = rest;
            v |= ((x & 0x7f) as u64) << shift;
            if x < 0x80 {
                return Some(v);
            }
        }
        None
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b)?;
        let (field, wire) = (key >> 3, (key & 7) as u8);
        let (num, data): (u64, &[u8]) = match wire {
            0 => (varint(&mut b)?, &[]),
            1 | 5 => {
                let n = if wire == 1 { 8 } else { 4 };
                let (d, rest) = (b.get(..n)?, b.get(n..)?);
                b = rest;
                (0, d)
            }
            2 => {
                let n = varint(&mut b)? as usize;
                let (d, rest) = (b.get(..n)?, b.get(n..)?);
                b = rest;
                (0, d)
            }
            _ => return None,
        };
        out.push((field, wire, num, data));
    }
    Some(out)
}

fn parse_event(data: &[u8]) -> Option<ScalarEvent> {
    let f = fields(data)?;
    let step = f.iter().find(|x| x.0 == 2).map_or(0, |x| x.2);
    let summary = f.iter().find(|x| x.0 == 5)?.3;
    let mut scalars = Vec::new();
    for v in fields(summary)?.iter().filter(|x| x.0 == 1) {
        let vf = fields(v.3)?;
        let tag = String::from_utf8(vf.iter().find(|x| x.0 == 1)?.3.to_vec()).ok()?;
        let val = f32::from_le_bytes(vf.iter().find(|x| x.0 == 2)?.3.try_into().ok()?);
        scalars.push((tag, val));
    }
    Some((step, scalars))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn scalars_are_written_and_read_back_with_their_crcs() {
        let dir = std::env::temp_dir().join(format!("fugu-tb-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut w = TensorBoardWriter::create(&dir).unwrap();
        w.scalars(1, &[("train/loss", 5.5), ("train/lr", 3e-4)])
            .unwrap();
        w.scalars(300, &[("val/loss", 4.25)]).unwrap();
        let path = w.path().to_path_buf();
        drop(w);
        assert!(path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("events.out.tfevents."));
        let ev = read_scalars(&path).unwrap();
        assert_eq!(
            ev,
            vec![
                (
                    1,
                    vec![("train/loss".into(), 5.5), ("train/lr".into(), 3e-4)]
                ),
                (300, vec![("val/loss".into(), 4.25)]),
            ]
        );
        // A flipped byte is caught by the CRC.
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        assert!(read_scalars(&path).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

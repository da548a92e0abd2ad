//! A small safetensors reader and writer.
//!
//! The `safetensors` crate wants the whole file in memory and writes `__metadata__` from a
//! `HashMap` (so two keys come out in a random order). Checkpoints need neither: this reader
//! parses and checks the header, then reads one tensor at a time; the writer streams tensors
//! from the `f32` buffer, converting to F16/BF16 on the way, and writes the header the way the
//! reference implementation does (compact JSON, `__metadata__` first with sorted keys, tensors
//! in data order, padded with spaces to a multiple of 8 bytes), so its files are byte-identical
//! to what Python's `safetensors` writes for the same tensors.

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Largest header accepted (the reference implementation's limit).
const MAX_HEADER: u64 = 100_000_000;

/// Elements converted per read or write call.
const CHUNK: usize = 1 << 16;

/// Element types of the safetensors format, in the reference implementation's order
/// (the writer sorts tensors by this order, descending, then by name).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    I16,
    U16,
    F16,
    Bf16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

const DTYPES: [(Dtype, &str, usize); 15] = [
    (Dtype::Bool, "BOOL", 1),
    (Dtype::U8, "U8", 1),
    (Dtype::I8, "I8", 1),
    (Dtype::F8E5M2, "F8_E5M2", 1),
    (Dtype::F8E4M3, "F8_E4M3", 1),
    (Dtype::I16, "I16", 2),
    (Dtype::U16, "U16", 2),
    (Dtype::F16, "F16", 2),
    (Dtype::Bf16, "BF16", 2),
    (Dtype::I32, "I32", 4),
    (Dtype::U32, "U32", 4),
    (Dtype::F32, "F32", 4),
    (Dtype::F64, "F64", 8),
    (Dtype::I64, "I64", 8),
    (Dtype::U64, "U64", 8),
];

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        DTYPES.iter().find(|d| d.0 == self).map_or(0, |d| d.2)
    }
    /// The name used in headers (`F32`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        DTYPES.iter().find(|d| d.0 == self).map_or("?", |d| d.1)
    }
    /// Parses a header name.
    pub fn parse(s: &str) -> Option<Dtype> {
        DTYPES.iter().find(|d| d.1 == s).map(|d| d.0)
    }
    /// F32, F16 and BF16: the types that convert to and from `f32` parameters.
    pub fn is_float(self) -> bool {
        self.float().is_some()
    }
    /// The float element type (as backends store it) of F32, F16 and BF16.
    pub fn float(self) -> Option<crate::dtype::Dtype> {
        match self {
            Dtype::F32 => Some(crate::dtype::Dtype::F32),
            Dtype::F16 => Some(crate::dtype::Dtype::F16),
            Dtype::Bf16 => Some(crate::dtype::Dtype::Bf16),
            _ => None,
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor listed in a header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The name in the file.
    pub key: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range relative to the start of the data section.
    pub start: usize,
    pub end: usize,
}

impl Entry {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A parsed, checked safetensors header.
#[derive(Clone, Debug)]
pub struct Header {
    /// The file it came from (for error messages and reads).
    pub path: PathBuf,
    /// The first `8 + n` bytes of the file, exactly as stored.
    pub raw: Vec<u8>,
    /// `__metadata__`, if present.
    pub metadata: Option<BTreeMap<String, String>>,
    /// The tensors, ordered by their position in the data section.
    pub entries: Vec<Entry>,
}

impl Header {
    /// File offset of the data section.
    pub fn data_start(&self) -> u64 {
        self.raw.len() as u64
    }
    /// The entry called `key`.
    pub fn find(&self, key: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.key == key)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInfo {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// Reads and checks the header of `path`: sizes, offsets (contiguous, in range, matching
/// dtype × shape) and that the file is exactly as long as the header says.
pub fn read_header(path: &Path) -> Result<Header> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = f
        .metadata()
        .with_context(|| format!("reading the size of {}", path.display()))?
        .len();
    parse_header(&mut f, len, path)
}

fn parse_header(f: &mut File, len: u64, path: &Path) -> Result<Header> {
    let p = path.display();
    if len < 8 {
        bail!("{p}: not a safetensors file: {len} bytes, shorter than the 8-byte header length");
    }
    let mut n8 = [0u8; 8];
    f.read_exact(&mut n8)
        .with_context(|| format!("reading {p}"))?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER || n > len - 8 {
        bail!(
            "{p}: corrupt or truncated safetensors file: header length {n} bytes, file is {len} bytes"
        );
    }
    let mut raw = vec![0u8; 8 + n as usize];
    raw[..8].copy_from_slice(&n8);
    f.read_exact(&mut raw[8..])
        .with_context(|| format!("reading the header of {p}"))?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&raw[8..])
        .map_err(|e| anyhow!("{p}: corrupt safetensors header (not a JSON object): {e}"))?;
    let mut metadata = None;
    let mut entries = Vec::with_capacity(json.len());
    for (key, value) in json {
        if key == "__metadata__" {
            let m: BTreeMap<String, String> = serde_json::from_value(value)
                .map_err(|e| anyhow!("{p}: corrupt safetensors __metadata__: {e}"))?;
            metadata = Some(m);
            continue;
        }
        let info: RawInfo = serde_json::from_value(value)
            .map_err(|e| anyhow!("{p}: corrupt safetensors header entry {key:?}: {e}"))?;
        let dtype = Dtype::parse(&info.dtype)
            .ok_or_else(|| anyhow!("{p}: tensor {key:?} has unknown dtype {:?}", info.dtype))?;
        let (start, end) = info.data_offsets;
        let bytes = info
            .shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| anyhow!("{p}: tensor {key:?}: shape {:?} overflows", info.shape))?;
        if end < start || end - start != bytes {
            bail!(
                "{p}: corrupt safetensors header: tensor {key:?} ({dtype} {:?}, {bytes} bytes) has data_offsets [{start}, {end}]",
                info.shape
            );
        }
        entries.push(Entry {
            key,
            dtype,
            shape: info.shape,
            start,
            end,
        });
    }
    entries.sort_by_key(|e| (e.start, e.end));
    let mut pos = 0usize;
    for e in &entries {
        if e.start != pos {
            bail!(
                "{p}: corrupt safetensors header: tensor {:?} starts at byte {} of the data, expected {pos} (overlap or hole)",
                e.key,
                e.start
            );
        }
        pos = e.end;
    }
    let data = len - 8 - n;
    if pos as u64 != data {
        bail!(
            "{p}: {} safetensors file: the header describes {pos} bytes of tensor data, the file holds {data}",
            if (pos as u64) > data { "truncated" } else { "corrupt" }
        );
    }
    Ok(Header {
        path: path.to_path_buf(),
        raw,
        metadata,
        entries,
    })
}

/// Reads the tensor `e` of the file `f` (described by `h`) into `out`, converting to `f32`.
pub fn read_f32(f: &mut File, h: &Header, e: &Entry, out: &mut [f32]) -> Result<()> {
    let p = h.path.display();
    if !e.dtype.is_float() {
        bail!(
            "{p}: tensor {:?} has dtype {}; expected F32, F16 or BF16",
            e.key,
            e.dtype
        );
    }
    if out.len() != e.numel() {
        bail!(
            "{p}: tensor {:?}: {} elements in the file, {} expected",
            e.key,
            e.numel(),
            out.len()
        );
    }
    let size = e.dtype.size();
    f.seek(SeekFrom::Start(h.data_start() + e.start as u64))
        .with_context(|| format!("{p}: seeking to tensor {:?}", e.key))?;
    let mut buf = vec![0u8; CHUNK.min(out.len()) * size];
    for chunk in out.chunks_mut(CHUNK) {
        let b = &mut buf[..chunk.len() * size];
        f.read_exact(b)
            .with_context(|| format!("{p}: reading tensor {:?} (file truncated?)", e.key))?;
        decode(e.dtype, b, chunk);
    }
    Ok(())
}

/// Reads the raw bytes of tensor `e`.
pub fn read_raw(f: &mut File, h: &Header, e: &Entry) -> Result<Vec<u8>> {
    let p = h.path.display();
    f.seek(SeekFrom::Start(h.data_start() + e.start as u64))
        .with_context(|| format!("{p}: seeking to tensor {:?}", e.key))?;
    let mut b = vec![0u8; e.end - e.start];
    f.read_exact(&mut b)
        .with_context(|| format!("{p}: reading tensor {:?} (file truncated?)", e.key))?;
    Ok(b)
}

fn decode(dtype: Dtype, b: &[u8], out: &mut [f32]) {
    let float = dtype.float();
    let float = float.unwrap_or_else(|| unreachable!("decode of {dtype} (checked by the caller)"));
    float.decode(b, out);
}

fn encode(dtype: Dtype, x: &[f32], out: &mut Vec<u8>) {
    let float = dtype.float();
    let float = float.unwrap_or_else(|| unreachable!("encode to {dtype} (checked by the caller)"));
    float.encode(x, out);
}

/// Where a tensor's bytes come from when writing.
#[derive(Clone, Copy, Debug)]
pub enum Data<'a> {
    /// `f32` values, converted to the tensor's dtype (F32, F16 or BF16).
    F32(&'a [f32]),
    /// Bytes written as they are (already in the tensor's dtype).
    Raw(&'a [u8]),
}

/// A tensor to write.
#[derive(Clone, Debug)]
pub struct OutTensor<'a> {
    pub key: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Data<'a>,
}

impl OutTensor<'_> {
    fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
    fn check(&self) -> Result<()> {
        let n: usize = self.shape.iter().product();
        match self.data {
            Data::F32(_) if !self.dtype.is_float() => {
                bail!(
                    "tensor {:?}: cannot write f32 data as {}",
                    self.key,
                    self.dtype
                )
            }
            Data::F32(x) if x.len() != n => bail!(
                "tensor {:?}: {} values for shape {:?}",
                self.key,
                x.len(),
                self.shape
            ),
            Data::Raw(b) if b.len() != self.nbytes() => bail!(
                "tensor {:?}: {} bytes for {} {:?}",
                self.key,
                b.len(),
                self.dtype,
                self.shape
            ),
            _ => Ok(()),
        }
    }
}

/// Sorts tensors the way the reference writer lays them out: by dtype (descending), then name.
pub fn sort_tensors(t: &mut [OutTensor<'_>]) {
    t.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.key.cmp(&b.key)));
}

/// The header (8-byte length + JSON + space padding) for `tensors` in the given data order.
pub fn build_header(
    metadata: Option<&BTreeMap<String, String>>,
    tensors: &[OutTensor<'_>],
) -> Vec<u8> {
    // Hand-written so that the key order is fixed: __metadata__ first, then data order.
    let q = |s: &str| serde_json::to_string(s).expect("strings serialize");
    let mut s = String::from("{");
    let mut first = true;
    if let Some(m) = metadata {
        s.push_str("\"__metadata__\":{");
        let kv: Vec<String> = m
            .iter()
            .map(|(k, v)| format!("{}:{}", q(k), q(v)))
            .collect();
        s.push_str(&kv.join(","));
        s.push('}');
        first = false;
    }
    let mut off = 0usize;
    for t in tensors {
        if !first {
            s.push(',');
        }
        first = false;
        let shape: Vec<String> = t.shape.iter().map(usize::to_string).collect();
        let end = off + t.nbytes();
        s.push_str(&format!(
            "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{off},{end}]}}",
            q(&t.key),
            t.dtype.name(),
            shape.join(",")
        ));
        off = end;
    }
    s.push('}');
    let mut h = s.into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out
}

/// Writes `header` (as built by [`build_header`] or taken from a file read earlier) followed by
/// the data of `tensors`, which must be in the header's data order with the header's sizes.
pub fn write_body(
    w: &mut (impl Write + ?Sized),
    header: &[u8],
    tensors: &[OutTensor<'_>],
) -> Result<()> {
    for t in tensors {
        t.check()?;
    }
    w.write_all(header)?;
    let mut buf = Vec::new();
    for t in tensors {
        match t.data {
            Data::Raw(b) => w.write_all(b)?,
            Data::F32(x) => {
                for c in x.chunks(CHUNK) {
                    encode(t.dtype, c, &mut buf);
                    w.write_all(&buf)?;
                }
            }
        }
    }
    Ok(())
}

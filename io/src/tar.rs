//! A small streaming tar reader and a deterministic ustar writer.
//!
//! The reader is hand-written (rather than the `tar` crate) so that every
//! error can name the archive, the member and the byte offset, so that it
//! never allocates per member beyond the name, and so that payloads can be
//! skipped with a seek on files. It understands ustar, GNU long names (`L`)
//! and pax `path`/`size` records; it requires the end-of-archive marker, so a
//! tar cut at a member boundary is reported as truncated.

use crate::error::{Error, Result};
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

pub(crate) const BLOCK: u64 = 512;

/// A byte source that can skip forward cheaply.
pub trait TarSource: Read {
    /// Skips `n` bytes forward.
    fn skip_bytes(&mut self, n: u64) -> io::Result<()>;
    /// Total length if known (files); used to detect truncation early.
    fn total_len(&self) -> Option<u64>;
}

/// A buffered file: skips by seeking.
pub struct FileSource {
    reader: BufReader<File>,
    len: u64,
}

impl FileSource {
    /// Opens `path` with a buffer of `buf_size` bytes.
    pub fn open(path: &Path, buf_size: usize) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, "open", e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(path, "stat", e))?
            .len();
        Ok(FileSource {
            reader: BufReader::with_capacity(buf_size, file),
            len,
        })
    }

    /// Seeks to an absolute offset.
    pub fn seek_to(&mut self, pos: u64) -> io::Result<()> {
        self.reader.seek(SeekFrom::Start(pos)).map(|_| ())
    }
}

impl Read for FileSource {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.reader.read(buf)
    }
}

impl TarSource for FileSource {
    fn skip_bytes(&mut self, n: u64) -> io::Result<()> {
        if n == 0 {
            return Ok(());
        }
        let n = i64::try_from(n).map_err(|_| io::Error::other("skip too large"))?;
        self.reader.seek_relative(n)
    }
    fn total_len(&self) -> Option<u64> {
        Some(self.len)
    }
}

/// Any reader (e.g. a gzip stream): skips by reading.
pub struct StreamSource<R>(pub R);

impl<R: Read> Read for StreamSource<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl<R: Read> TarSource for StreamSource<R> {
    fn skip_bytes(&mut self, n: u64) -> io::Result<()> {
        let copied = io::copy(&mut (&mut self.0).take(n), &mut io::sink())?;
        if copied < n {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "end of stream while skipping",
            ));
        }
        Ok(())
    }
    fn total_len(&self) -> Option<u64> {
        None
    }
}

/// Kind of a tar member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// Links, devices and other kinds (skipped by fugu).
    Other,
}

/// One member's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TarEntry {
    /// Member path.
    pub name: String,
    /// Payload size in bytes.
    pub size: u64,
    /// Kind of member.
    pub kind: EntryKind,
    /// Byte offset of the member's (last) header block in the archive.
    pub header_offset: u64,
    /// Byte offset of the member's payload in the archive.
    pub data_offset: u64,
}

/// Streaming tar reader over a [`TarSource`].
pub struct TarReader<S> {
    src: S,
    path: PathBuf,
    pos: u64,
    /// Unread payload + padding bytes of the current entry.
    pending: u64,
    /// Unread payload bytes (without padding) of the current entry.
    pending_data: u64,
    current: Option<String>,
    /// Name of the last member returned (for messages about the next header).
    prev: Option<String>,
    finished: bool,
}

impl TarReader<FileSource> {
    /// Opens a tar file with a read buffer of `buf_size` bytes.
    pub fn open(path: &Path, buf_size: usize) -> Result<Self> {
        Ok(TarReader::new(FileSource::open(path, buf_size)?, path))
    }

    /// Opens a tar file positioned at `offset` (which must be a header boundary).
    pub fn open_at(path: &Path, buf_size: usize, offset: u64) -> Result<Self> {
        let mut src = FileSource::open(path, buf_size)?;
        if offset > src.len {
            return Err(Error::Tar {
                path: path.into(),
                offset,
                what: format!("offset is past the end of the file ({} bytes)", src.len),
            });
        }
        src.seek_to(offset)
            .map_err(|e| Error::io(path, "seek", e))?;
        let mut r = TarReader::new(src, path);
        r.pos = offset;
        Ok(r)
    }
}

fn padded(size: u64) -> u64 {
    size.div_ceil(BLOCK) * BLOCK
}

impl<S: TarSource> TarReader<S> {
    /// Wraps a source; `path` is used in error messages.
    pub fn new(src: S, path: &Path) -> Self {
        TarReader {
            src,
            path: path.to_path_buf(),
            pos: 0,
            pending: 0,
            pending_data: 0,
            current: None,
            prev: None,
            finished: false,
        }
    }

    /// The archive path used in messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Current byte offset in the archive.
    pub fn position(&self) -> u64 {
        self.pos
    }

    fn tar_err(&self, offset: u64, what: impl Into<String>) -> Error {
        let mut what = what.into();
        if self.current.is_none() {
            match &self.prev {
                Some(p) => what.push_str(&format!(" (in the header after member `{p}`)")),
                None => what.push_str(" (in the first header)"),
            }
        }
        Error::Tar {
            path: self.path.clone(),
            offset,
            what,
        }
    }

    fn read_block(&mut self, buf: &mut [u8; 512]) -> Result<bool> {
        let mut got = 0;
        while got < 512 {
            match self.src.read(&mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(&self.path, "read", e)),
            }
        }
        if got == 0 {
            return Ok(false);
        }
        if got < 512 {
            return Err(self.tar_err(
                self.pos,
                format!("truncated: a 512-byte header block was expected, found only {got} bytes"),
            ));
        }
        self.pos += 512;
        Ok(true)
    }

    fn skip(&mut self, n: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if let Some(len) = self.src.total_len() {
            if self.pos + n > len {
                return Err(self.tar_err(
                    self.pos,
                    format!(
                        "truncated: {} more bytes of member `{}` expected, file ends at {len}",
                        n,
                        self.current.as_deref().unwrap_or("?")
                    ),
                ));
            }
        }
        self.src.skip_bytes(n).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                self.tar_err(self.pos, "truncated: end of file inside a member")
            } else {
                Error::io(&self.path, "read", e)
            }
        })?;
        self.pos += n;
        Ok(())
    }

    fn read_exact_at(&mut self, buf: &mut [u8]) -> Result<()> {
        let start = self.pos;
        let member = self.current.clone().unwrap_or_default();
        self.src.read_exact(buf).map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                Error::Tar {
                    path: self.path.clone(),
                    offset: start,
                    what: format!(
                        "truncated: end of file inside member `{member}` ({} bytes expected)",
                        buf.len()
                    ),
                }
            } else {
                Error::io(&self.path, "read", e)
            }
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    /// Advances to the next member (skipping the rest of the current one).
    /// Returns `None` at the end-of-archive marker.
    pub fn next_entry(&mut self) -> Result<Option<TarEntry>> {
        if self.finished {
            return Ok(None);
        }
        let rest = self.pending;
        self.skip(rest)?;
        self.pending = 0;
        self.pending_data = 0;
        self.current = None;
        let mut long_name: Option<String> = None;
        let mut pax_size: Option<u64> = None;
        let mut block = [0u8; 512];
        loop {
            let header_offset = self.pos;
            if !self.read_block(&mut block)? {
                return Err(self.tar_err(
                    header_offset,
                    "truncated: end of file where a header or the end-of-archive marker was expected",
                ));
            }
            if block.iter().all(|&b| b == 0) {
                // End-of-archive marker; a second zero block normally follows.
                self.finished = true;
                return Ok(None);
            }
            self.verify_checksum(&block, header_offset)?;
            let size = match pax_size.take() {
                Some(s) => s,
                None => self.parse_number(&block[124..136], header_offset, "size")?,
            };
            if let Some(len) = self.src.total_len() {
                if self.pos.checked_add(size).is_none_or(|end| end > len) {
                    return Err(self.tar_err(
                        header_offset,
                        format!(
                            "truncated: member `{}` declares {size} bytes but the file ends at {len}",
                            header_name(&block)
                        ),
                    ));
                }
            }
            let typeflag = block[156];
            match typeflag {
                b'L' | b'x' | b'K' | b'g' => {
                    if size > 1 << 20 {
                        return Err(self.tar_err(
                            header_offset,
                            format!("extended header of {size} bytes is too large"),
                        ));
                    }
                    let mut data = vec![0u8; size as usize];
                    self.current = Some("(extended header)".into());
                    self.read_exact_at(&mut data)?;
                    self.skip(padded(size) - size)?;
                    match typeflag {
                        b'L' => {
                            let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
                            long_name = Some(String::from_utf8_lossy(&data[..end]).into_owned());
                        }
                        b'x' => {
                            let (p, s) = self.parse_pax(&data, header_offset)?;
                            if p.is_some() {
                                long_name = p;
                            }
                            pax_size = s;
                        }
                        _ => {}
                    }
                    continue;
                }
                _ => {}
            }
            let name = long_name.take().unwrap_or_else(|| header_name(&block));
            let kind = match typeflag {
                b'0' | 0 | b'7' => EntryKind::File,
                b'5' => EntryKind::Dir,
                _ => EntryKind::Other,
            };
            // Only regular files have a payload in ustar; others may declare one (skip it).
            self.pending = padded(size);
            self.pending_data = size;
            self.current = Some(name.clone());
            self.prev = Some(name.clone());
            return Ok(Some(TarEntry {
                name,
                size,
                kind,
                header_offset,
                data_offset: self.pos,
            }));
        }
    }

    fn verify_checksum(&self, block: &[u8; 512], offset: u64) -> Result<()> {
        let stored = self.parse_number(&block[148..156], offset, "checksum")?;
        let mut unsigned: u64 = 0;
        let mut signed: i64 = 0;
        for (i, &b) in block.iter().enumerate() {
            let b = if (148..156).contains(&i) { b' ' } else { b };
            unsigned += b as u64;
            signed += (b as i8) as i64;
        }
        if stored != unsigned && stored as i64 != signed {
            return Err(self.tar_err(
                offset,
                format!(
                    "header checksum mismatch (stored {stored}, computed {unsigned}): not a tar header or corrupt"
                ),
            ));
        }
        Ok(())
    }

    fn parse_number(&self, field: &[u8], offset: u64, what: &str) -> Result<u64> {
        if field[0] & 0x80 != 0 {
            // GNU base-256.
            if field[0] & 0x40 != 0 {
                return Err(self.tar_err(offset, format!("negative {what} field")));
            }
            let mut v: u64 = (field[0] & 0x3f) as u64;
            for &b in &field[1..] {
                v = v
                    .checked_mul(256)
                    .and_then(|v| v.checked_add(b as u64))
                    .ok_or_else(|| self.tar_err(offset, format!("{what} field overflows")))?;
            }
            return Ok(v);
        }
        let mut v: u64 = 0;
        let mut seen = false;
        for &b in field {
            match b {
                b'0'..=b'7' => {
                    seen = true;
                    v = v
                        .checked_mul(8)
                        .and_then(|v| v.checked_add((b - b'0') as u64))
                        .ok_or_else(|| self.tar_err(offset, format!("{what} field overflows")))?;
                }
                b' ' if !seen => {}
                b' ' | 0 => break,
                _ => {
                    return Err(self.tar_err(
                        offset,
                        format!("invalid octal digit {b:#04x} in the {what} field"),
                    ))
                }
            }
        }
        Ok(v)
    }

    fn parse_pax(&self, data: &[u8], offset: u64) -> Result<(Option<String>, Option<u64>)> {
        let mut path = None;
        let mut size = None;
        let mut rest = data;
        while !rest.is_empty() {
            if rest.iter().all(|&b| b == 0) {
                break;
            }
            let sp = rest
                .iter()
                .position(|&b| b == b' ')
                .ok_or_else(|| self.tar_err(offset, "malformed pax record"))?;
            let len: usize = std::str::from_utf8(&rest[..sp])
                .ok()
                .and_then(|s| s.parse().ok())
                .filter(|&l| l > sp && l <= rest.len())
                .ok_or_else(|| self.tar_err(offset, "malformed pax record length"))?;
            let rec = &rest[sp + 1..len];
            let rec = rec.strip_suffix(b"\n").unwrap_or(rec);
            if let Some(eq) = rec.iter().position(|&b| b == b'=') {
                let (k, v) = (&rec[..eq], &rec[eq + 1..]);
                match k {
                    b"path" => path = Some(String::from_utf8_lossy(v).into_owned()),
                    b"size" => {
                        size = Some(
                            std::str::from_utf8(v)
                                .ok()
                                .and_then(|s| s.parse().ok())
                                .ok_or_else(|| self.tar_err(offset, "malformed pax size"))?,
                        )
                    }
                    _ => {}
                }
            }
            rest = &rest[len..];
        }
        Ok((path, size))
    }

    /// Reads the whole payload of the current member into `buf` (replacing
    /// its content). `max` bounds the size accepted.
    pub fn read_data(&mut self, buf: &mut Vec<u8>, max: u64) -> Result<()> {
        let n = self.pending_data;
        if n > max {
            return Err(Error::BadSample {
                path: self.path.clone(),
                member: self.current.clone().unwrap_or_default(),
                offset: self.pos,
                what: format!("member of {n} bytes exceeds the limit of {max} bytes"),
            });
        }
        buf.clear();
        buf.resize(n as usize, 0);
        self.read_exact_at(buf)?;
        self.pending -= n;
        self.pending_data = 0;
        Ok(())
    }

    /// Reads up to `buf.len()` payload bytes of the current member; returns
    /// the count (0 at the member's end).
    pub fn read_some(&mut self, buf: &mut [u8]) -> Result<usize> {
        let want = (buf.len() as u64).min(self.pending_data) as usize;
        if want == 0 {
            return Ok(0);
        }
        self.read_exact_at(&mut buf[..want])?;
        self.pending -= want as u64;
        self.pending_data -= want as u64;
        Ok(want)
    }

    /// Skips `n` payload bytes of the current member.
    pub fn skip_data(&mut self, n: u64) -> Result<()> {
        let n = n.min(self.pending_data);
        self.skip(n)?;
        self.pending -= n;
        self.pending_data -= n;
        Ok(())
    }

    /// A `Read` over the rest of the current member's payload.
    pub fn entry_reader(&mut self) -> EntryReader<'_, S> {
        EntryReader { tar: self }
    }
}

/// `Read` adapter over the current member's payload.
pub struct EntryReader<'a, S> {
    tar: &'a mut TarReader<S>,
}

impl<S: TarSource> Read for EntryReader<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.tar
            .read_some(buf)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
    }
}

fn header_name(block: &[u8; 512]) -> String {
    let cstr = |b: &[u8]| {
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).into_owned()
    };
    let name = cstr(&block[0..100]);
    if &block[257..262] == b"ustar" {
        let prefix = cstr(&block[345..500]);
        if !prefix.is_empty() {
            return format!("{prefix}/{name}");
        }
    }
    name
}

/// Writes deterministic ustar archives: mode 0644, uid/gid 0, mtime 0, no
/// user or group names, so equal inputs give byte-identical archives.
pub struct TarWriter<W: Write> {
    out: W,
    written: u64,
}

impl<W: Write> TarWriter<W> {
    /// Starts an archive on `out`.
    pub fn new(out: W) -> Self {
        TarWriter { out, written: 0 }
    }

    /// Bytes written so far.
    pub fn bytes_written(&self) -> u64 {
        self.written
    }

    /// Size in the archive of a member with `len` payload bytes.
    pub fn member_size(len: u64) -> u64 {
        BLOCK + padded(len)
    }

    /// Appends a regular file. `name` must be at most 100 bytes.
    pub fn append(&mut self, name: &str, data: &[u8]) -> io::Result<()> {
        let header = ustar_header(name, data.len() as u64)?;
        self.out.write_all(&header)?;
        self.out.write_all(data)?;
        let pad = (padded(data.len() as u64) - data.len() as u64) as usize;
        self.out.write_all(&[0u8; 512][..pad])?;
        self.written += Self::member_size(data.len() as u64);
        Ok(())
    }

    /// Writes the end-of-archive marker and returns the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.write_all(&[0u8; 1024])?;
        self.written += 1024;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// Builds a deterministic ustar header block.
pub fn ustar_header(name: &str, size: u64) -> io::Result<[u8; 512]> {
    let nb = name.as_bytes();
    if nb.is_empty() || nb.len() > 100 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("tar member name `{name}` must be 1..=100 bytes"),
        ));
    }
    if size >= 8u64.pow(11) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("tar member `{name}` is too large ({size} bytes)"),
        ));
    }
    let mut h = [0u8; 512];
    h[..nb.len()].copy_from_slice(nb);
    h[100..108].copy_from_slice(b"0000644\0");
    h[108..116].copy_from_slice(b"0000000\0");
    h[116..124].copy_from_slice(b"0000000\0");
    h[124..136].copy_from_slice(format!("{size:011o}\0").as_bytes());
    h[136..148].copy_from_slice(b"00000000000\0");
    h[156] = b'0';
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[329..337].copy_from_slice(b"0000000\0");
    h[337..345].copy_from_slice(b"0000000\0");
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|&b| b as u64).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
    Ok(h)
}

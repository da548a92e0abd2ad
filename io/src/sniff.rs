//! What a file is when it is not text: known binary and structured formats by their magic
//! bytes, and NUL bytes near the start, so that `fugu prepare` refuses them by name instead of
//! tokenising their bytes as text.

/// Bytes of a file's start that [`not_text`] looks at.
pub const SNIFF_BYTES: usize = 4096;

/// Magic bytes at offset 0 and the format they mean, with what to do about it.
const MAGIC: &[(&[u8], &str)] = &[
    (b"PAR1", "a Parquet file (name it .parquet to read its text column)"),
    (b"ARROW1", "an Arrow IPC file (name it .arrow to read its text column)"),
    (
        &[0xff, 0xff, 0xff, 0xff],
        "an Arrow IPC stream, as Hugging Face `save_to_disk` writes (name it .arrow, or pass its folder)",
    ),
    (&[0x28, 0xb5, 0x2f, 0xfd], "zstd-compressed data (name it .zst, .jsonl.zst or .tar.zst)"),
    (&[0x1f, 0x8b], "gzip-compressed data (name it .gz, .jsonl.gz or .tar.gz)"),
    (b"BZh", "bzip2-compressed data (decompress it first)"),
    (&[0xfd, b'7', b'z', b'X', b'Z', 0], "xz-compressed data (decompress it first)"),
    (b"PK\x03\x04", "a zip archive (unpack it first)"),
    (b"%PDF-", "a PDF document (extract its text first)"),
    (b"\x7fELF", "an executable (ELF)"),
    (b"\x93NUMPY", "a NumPy array"),
    (b"SQLite format 3\0", "an SQLite database"),
    (&[0x89, b'P', b'N', b'G'], "a PNG image"),
    (&[0xff, 0xd8, 0xff], "a JPEG image"),
    (&[0xff, 0xfe], "UTF-16 text (convert it to UTF-8 first)"),
    (&[0xfe, 0xff], "UTF-16 text (convert it to UTF-8 first)"),
];

/// `None` when `head` (a file's first bytes, up to [`SNIFF_BYTES`]) may be text; else what the
/// file is. UTF-8 text, with or without a byte-order mark, and text with some invalid bytes
/// pass; a known magic number or a NUL byte does not.
pub fn not_text(head: &[u8]) -> Option<String> {
    let head = &head[..head.len().min(SNIFF_BYTES)];
    if let Some((_, what)) = MAGIC.iter().find(|(m, _)| head.starts_with(m)) {
        return Some((*what).to_string());
    }
    if let Some(at) = head.iter().position(|&b| b == 0) {
        return Some(format!("binary data (a NUL byte at offset {at})"));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_passes_and_formats_are_named() {
        for text in [
            &b"Hello, world\n"[..],
            "\u{feff}UTF-8 with a BOM".as_bytes(),
            "日本語のテキスト".as_bytes(),
            b"invalid \xc3\x28 utf-8 still text",
            b"",
        ] {
            assert_eq!(not_text(text), None, "{text:?}");
        }
        let named = |b: &[u8]| not_text(b).unwrap();
        assert!(named(b"PAR1\x15\x04\x15").contains("Parquet"));
        assert!(named(b"ARROW1\0\0").contains("Arrow IPC file"));
        assert!(named(&[0xff, 0xff, 0xff, 0xff, 0x78, 0, 0, 0]).contains("save_to_disk"));
        assert!(named(&[0x28, 0xb5, 0x2f, 0xfd, 0x04]).contains("zstd"));
        assert!(named(&[0x1f, 0x8b, 0x08]).contains("gzip"));
        assert!(named(b"PK\x03\x04rest").contains("zip"));
        assert!(named(&[0xff, 0xfe, b'h', 0]).contains("UTF-16"));
        assert!(named(b"tokens\0\0\x01").contains("NUL byte at offset 6"));
        // Only the first SNIFF_BYTES count.
        let mut late = vec![b'a'; SNIFF_BYTES + 10];
        late[SNIFF_BYTES + 5] = 0;
        assert_eq!(not_text(&late), None);
    }
}

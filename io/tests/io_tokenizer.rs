//! Tokenizers: the Hugging Face `tokenizers`-crate GPT-2 built from the
//! derived `vocab.json`/`merges.txt` agrees with tiktoken's GPT-2, trained
//! byte-level BPEs round-trip and are deterministic, and the tokenizer files
//! load back.

mod common;

use std::path::Path;
use std::time::Instant;

use fugu_io::tar::{EntryKind, StreamSource, TarReader};
use fugu_io::tokenizer::{
    bytes_to_unicode, gpt2_vocab_and_merges, hf_tokenizer_files, tokenizer_by_name, train_bpe,
    train_bpe_with, write_hf_tokenizer_files, BpeTrainOptions, ByteEncoding, Gpt2Tokenizer,
    HfTokenizer, Tokenizer, HF_TOKENIZER_FILES,
};
use sha2::{Digest, Sha256};

/// The bundled Shakespeare corpus: (file name, text), 42 documents.
fn shakespeare() -> Vec<(String, String)> {
    let gz = flate2::read::GzDecoder::new(fugu_io::bundled::SHAKESPEARE_TAR_GZ);
    let mut r = TarReader::new(StreamSource(gz), Path::new("bundled"));
    let mut out = Vec::new();
    while let Some(e) = r.next_entry().unwrap() {
        if e.kind == EntryKind::File {
            let mut buf = Vec::new();
            r.read_data(&mut buf, e.size).unwrap();
            out.push((e.name.clone(), String::from_utf8(buf).unwrap()));
        }
    }
    out.sort();
    assert_eq!(out.len(), 42);
    out
}

/// Texts that exercise GPT-2's pre-tokenizer: contractions, digits,
/// whitespace runs, unicode, emoji, control bytes and special-token strings.
fn tricky_texts() -> Vec<String> {
    let mut v: Vec<String> = [
        "Hello world",
        "",
        " ",
        "\n",
        "   leading and trailing   ",
        "It's, we'll, they're, I've, I'm, he'd, don't, DON'T, 'S 'LL",
        "''s ''ll 'x 's's",
        "numbers 1 12 123 1234 12345 3.14159 -42 1e10 0x1F 2024-01-01",
        "tabs\tand\t\tnewlines\n\n\nand\r\nCRLF \u{a0}nbsp \u{2003}emspace",
        "trailing spaces before newline   \n   indented\n\t\n",
        "caf\u{e9} na\u{ef}ve r\u{e9}sum\u{e9} \u{d8}resund \u{df}tra\u{df}e",
        "\u{65e5}\u{672c}\u{8a9e}\u{306e}\u{6587}\u{7ae0} \u{4e2d}\u{6587} \u{d55c}\u{ad6d}\u{c5b4} \u{627}\u{644}\u{639}\u{631}\u{628}\u{64a}\u{629} \u{5e2}\u{5d1}\u{5e8}\u{5d9}\u{5ea} \u{420}\u{443}\u{441}\u{441}\u{43a}\u{438}\u{439}",
        "emoji \u{1f600}\u{1f389} \u{1f468}\u{200d}\u{1f469}\u{200d}\u{1f467} flags \u{1f1ef}\u{1f1f5} skin \u{1f44d}\u{1f3fd}",
        "combining e\u{301} a\u{308} zero\u{200b}width \u{feff}bom",
        "control \u{0}\u{1}\u{7}\u{1b}[0m \u{7f}",
        "<|endoftext|> inside text <|endoftext|><|endoftext|>",
        "code: fn main() { println!(\"{}\", x?); } // comment\n    return a->b[i] != c;",
        "URL https://example.com/a?b=c&d=e#f email a.b@c.de",
        "!!!??? ... --- ___ *** ### $$$ %%% ^^^ &&& (((",
        "MiXeD CaSe WORDS and words",
        "a  b   c    d     e",
        "\u{10ffff}\u{fffd}\u{e000}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push("x".repeat(3000));
    v.push(" ".repeat(100) + "word" + &"\n".repeat(50));
    v
}

fn assert_same_ids(a: &dyn Tokenizer, b: &dyn Tokenizer, text: &str, what: &str) {
    let ia = a.encode(text);
    let ib = b.encode(text);
    if ia != ib {
        let first = ia
            .iter()
            .zip(&ib)
            .position(|(x, y)| x != y)
            .unwrap_or(ia.len().min(ib.len()));
        panic!(
            "{what}: {} and {} differ at token {first}: {:?} vs {:?} (text {:?}...)",
            a.name(),
            b.name(),
            &ia[first..(first + 8).min(ia.len())],
            &ib[first..(first + 8).min(ib.len())],
            &text.chars().take(80).collect::<String>()
        );
    }
    assert_eq!(
        a.decode(&ia).unwrap(),
        text,
        "{what}: {} round trip",
        a.name()
    );
    assert_eq!(
        b.decode(&ib).unwrap(),
        text,
        "{what}: {} round trip",
        b.name()
    );
}

#[test]
fn bytes_to_unicode_is_gpt2s_table() {
    let t = bytes_to_unicode();
    assert_eq!(t[b' ' as usize], '\u{120}'); // Ġ
    assert_eq!(t[b'\n' as usize], '\u{10a}'); // Ċ
    assert_eq!(t[0], '\u{100}'); // Ā
    assert_eq!(t[b'A' as usize], 'A');
    assert_eq!(t[0xad], '\u{143}');
    let mut sorted = t.to_vec();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 256);
}

#[test]
fn gpt2_vocab_and_merges_match_the_published_files() {
    let (vocab, merges) = gpt2_vocab_and_merges().unwrap();
    assert_eq!(vocab.len(), 50257);
    assert_eq!(vocab[50256], "<|endoftext|>");
    assert_eq!(merges.len(), 50000);
    // Anchors from GPT-2's vocab.json / merges.txt.
    assert_eq!(vocab[0], "!");
    assert_eq!(vocab[198], "\u{10a}"); // "\n"
    assert_eq!(vocab[220], "\u{120}"); // " "
    assert_eq!(vocab[256], "\u{120}t");
    assert_eq!(vocab[262], "\u{120}the");
    assert_eq!(vocab[15496], "Hello");
    assert_eq!(vocab[995], "\u{120}world");
    assert_eq!(merges[0], ("\u{120}".into(), "t".into()));
    assert_eq!(merges[1], ("\u{120}".into(), "a".into()));
    assert_eq!(merges[2], ("h".into(), "e".into()));
    assert_eq!(merges[6], ("\u{120}t".into(), "he".into()));
    // Each merge's result is the token of the next id.
    for (i, (a, b)) in merges.iter().enumerate() {
        assert_eq!(format!("{a}{b}"), vocab[256 + i], "merge {i}");
    }
}

#[test]
fn hf_gpt2_encodes_like_tiktoken_gpt2() {
    let gpt2 = Gpt2Tokenizer::new();
    let hf = HfTokenizer::gpt2().unwrap();
    assert_eq!(hf.vocab_size(), 50257);
    assert_eq!(hf.eot(), 50256);
    assert_eq!(hf.name(), "gpt2");
    assert_eq!(hf.encode("Hello world"), vec![15496, 995]);
    assert_eq!(gpt2.encode("Hello world"), vec![15496, 995]);
    for t in tricky_texts() {
        assert_same_ids(&gpt2, &hf, &t, "tricky text");
    }
    // A slice of every play and poem (the whole corpus: the ignored
    // `gpt2_equivalence_full_corpus`, best run with --release).
    for (name, text) in shakespeare() {
        let cut = text
            .char_indices()
            .nth(20_000)
            .map_or(text.len(), |(i, _)| i);
        assert_same_ids(&gpt2, &hf, &text[..cut], &name);
    }
}

#[test]
#[ignore = "slow in debug builds; run with --release"]
fn gpt2_equivalence_full_corpus() {
    let gpt2 = Gpt2Tokenizer::new();
    let hf = HfTokenizer::gpt2().unwrap();
    let (mut bytes, mut tokens) = (0usize, 0usize);
    let (mut t_tik, mut t_hf, mut t_crate) = (0.0, 0.0, 0.0);
    for (name, text) in shakespeare() {
        let t0 = Instant::now();
        let a = gpt2.encode(&text);
        t_tik += t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let b = hf.encode(&text);
        t_hf += t0.elapsed().as_secs_f64();
        assert!(a == b, "{name}: tiktoken and tokenizers-crate gpt2 differ");
        let t0 = Instant::now();
        let c = hf.try_encode(&text).unwrap();
        t_crate += t0.elapsed().as_secs_f64();
        assert!(
            a == c,
            "{name}: tiktoken and the crate's full pipeline differ"
        );
        assert_eq!(hf.decode(&b).unwrap(), text);
        bytes += text.len();
        tokens += a.len();
    }
    eprintln!(
        "gpt2 on Shakespeare: {bytes} bytes, {tokens} tokens ({:.4} tokens/byte); encode \
         tiktoken {:.2} MB/s, HfTokenizer {:.2} MB/s (the crate's encode_fast {:.2} MB/s)",
        tokens as f64 / bytes as f64,
        bytes as f64 / 1e6 / t_tik,
        bytes as f64 / 1e6 / t_hf,
        bytes as f64 / 1e6 / t_crate
    );
}

/// Builds a `tokenizers`-crate BPE tokenizer from written `vocab.json` +
/// `merges.txt` only (as the slow `GPT2Tokenizer` reads them).
fn from_vocab_and_merges(dir: &Path) -> HfTokenizer {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::AddedToken;
    let bpe = BPE::from_file(
        dir.join("vocab.json").to_str().unwrap(),
        dir.join("merges.txt").to_str().unwrap(),
    )
    .build()
    .unwrap();
    let mut t = tokenizers::Tokenizer::new(bpe);
    t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    t.with_decoder(Some(ByteLevel::default()));
    t.add_special_tokens(&[AddedToken::from("<|endoftext|>", true)]);
    HfTokenizer::from_bytes(t.to_string(false).unwrap().as_bytes()).unwrap()
}

fn check_files(tok: &dyn Tokenizer, dir: &Path, max_len: usize) {
    let written = write_hf_tokenizer_files(tok, dir, Some(max_len)).unwrap();
    assert_eq!(written.len(), HF_TOKENIZER_FILES.len());
    let files = hf_tokenizer_files(tok, Some(max_len)).unwrap();
    for ((name, bytes), (path, expected)) in
        files.iter().zip(written.iter().zip(HF_TOKENIZER_FILES))
    {
        assert_eq!(name, expected);
        assert_eq!(&std::fs::read(path).unwrap(), bytes, "{name}");
    }
    let n = tok.vocab_size() as usize;
    let vocab: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&std::fs::read(dir.join("vocab.json")).unwrap()).unwrap();
    assert_eq!(vocab.len(), n);
    assert_eq!(vocab["<|endoftext|>"], tok.eot());
    let merges = std::fs::read_to_string(dir.join("merges.txt")).unwrap();
    assert!(merges.starts_with("#version: 0.2\n") && merges.ends_with('\n'));
    let merge_lines = merges.lines().count() - 1;
    // 256 bytes + merges + <|endoftext|> (merges can repeat a token only
    // when two pairs make the same string; neither GPT-2 nor training does).
    assert_eq!(merge_lines, n - 257);
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    assert_eq!(config["tokenizer_class"], "GPT2Tokenizer");
    assert_eq!(config["eos_token"], "<|endoftext|>");
    assert_eq!(config["bos_token"], "<|endoftext|>");
    assert_eq!(config["unk_token"], "<|endoftext|>");
    assert_eq!(config["add_prefix_space"], false);
    assert_eq!(config["model_max_length"], max_len);
    assert_eq!(
        config["added_tokens_decoder"][tok.eot().to_string()]["special"],
        true
    );
    let special: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("special_tokens_map.json")).unwrap())
            .unwrap();
    assert_eq!(special["eos_token"], "<|endoftext|>");

    // tokenizer.json and vocab.json + merges.txt both load and agree with tok.
    let from_json = HfTokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let from_vm = from_vocab_and_merges(dir);
    let by_name = tokenizer_by_name(dir.to_str().unwrap()).unwrap();
    assert_eq!(from_json.vocab_size(), tok.vocab_size());
    assert_eq!(from_vm.vocab_size(), tok.vocab_size());
    assert_eq!(from_json.eot(), tok.eot());
    assert_eq!(from_vm.eot(), tok.eot());
    assert_eq!(by_name.eot(), tok.eot());
    let mut texts = tricky_texts();
    let (_, hamlet) = shakespeare()
        .into_iter()
        .find(|(n, _)| n.contains("hamlet"))
        .unwrap();
    texts.push(hamlet.chars().take(30_000).collect());
    for t in &texts {
        assert_same_ids(tok, &from_json, t, "tokenizer.json");
        assert_same_ids(tok, &from_vm, t, "vocab.json+merges.txt");
        assert_same_ids(tok, by_name.as_ref(), t, "tokenizer_by_name(dir)");
    }
}

#[test]
fn gpt2_hf_files_load_back_and_agree() {
    let dir = common::tmpdir("tok-gpt2-files");
    check_files(&Gpt2Tokenizer::new(), &dir, 1024);
    // The tokenizer.json is the one HfTokenizer::gpt2 serialises.
    assert_eq!(
        std::fs::read_to_string(dir.join("tokenizer.json")).unwrap(),
        HfTokenizer::gpt2().unwrap().to_json()
    );
}

fn corpus_sample() -> Vec<String> {
    // Small enough for debug builds: ~60 kB from each of 6 works.
    shakespeare()
        .into_iter()
        .step_by(7)
        .map(|(_, t)| t.chars().take(60_000).collect())
        .collect()
}

#[test]
fn trained_bpe_round_trips_and_has_the_gpt2_layout() {
    let docs = corpus_sample();
    let tok = train_bpe(&docs, 1000).unwrap();
    assert_eq!(tok.vocab_size(), 1000);
    assert_eq!(tok.eot(), 999);
    assert_eq!(tok.name(), "bpe-1000");
    // The byte tokens are ids 0..256 in GPT-2's order.
    let (gpt2_vocab, _) = gpt2_vocab_and_merges().unwrap();
    let ids = tok.id_to_token();
    assert_eq!(&ids[..256], &gpt2_vocab[..256]);
    assert_eq!(ids[999], "<|endoftext|>");
    for t in tricky_texts().iter().chain(&docs) {
        let enc = tok.encode(t);
        assert!(enc.iter().all(|&i| i < 999), "no special id from text");
        assert_eq!(tok.decode(&enc).unwrap(), *t);
    }
    // Compression: fewer tokens than bytes on the training text.
    let bytes: usize = docs.iter().map(|d| d.len()).sum();
    let tokens: usize = docs.iter().map(|d| tok.encode(d).len()).sum();
    assert!(
        (tokens as f64) < 0.5 * bytes as f64,
        "{tokens} tokens for {bytes} bytes"
    );
    // <|endoftext|> in text is plain text; the id decodes to the string.
    let e = tok.encode("a<|endoftext|>b");
    assert!(!e.contains(&tok.eot()));
    assert_eq!(tok.decode(&[tok.eot()]).unwrap(), "<|endoftext|>");
    let err = tok.decode(&[1000]).unwrap_err().to_string();
    assert!(err.contains("1000") && err.contains("bpe-1000"), "{err}");
}

#[test]
fn trained_bpe_is_deterministic() {
    let docs = corpus_sample();
    let a = train_bpe(&docs, 800).unwrap().to_json();
    let b = train_bpe(docs.clone(), 800).unwrap().to_json();
    assert!(a == b, "two trainings on the same documents differ");
    let mut rev = docs.clone();
    rev.reverse();
    let c = train_bpe(&rev, 800).unwrap().to_json();
    assert!(a == c, "document order changed the tokenizer");
    // Save / load keeps it byte-identical.
    let dir = common::tmpdir("tok-determinism");
    let tok = HfTokenizer::from_bytes(a.as_bytes()).unwrap();
    tok.save(dir.join("tokenizer.json")).unwrap();
    let back = HfTokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    assert_eq!(back.to_json(), a);
}

#[test]
fn trained_bpe_hf_files_load_back_and_agree() {
    let tok = train_bpe(corpus_sample(), 600).unwrap();
    let dir = common::tmpdir("tok-bpe-files");
    check_files(&tok, &dir, 256);
}

#[test]
fn train_bpe_validates_and_handles_tiny_input() {
    for bad in [0, 1, 256] {
        let e = train_bpe(["abc"], bad).unwrap_err().to_string();
        assert!(
            e.contains("at least 257") && e.contains(&bad.to_string()),
            "{e}"
        );
    }
    let e = train_bpe(["abc"], (1 << 20) + 1).unwrap_err().to_string();
    assert!(e.contains("at most"), "{e}");
    let mut o = BpeTrainOptions::new(300);
    o.max_token_length = Some(0);
    assert!(train_bpe_with(["abc"], &o).is_err());
    // 257: bytes and <|endoftext|> only.
    let t = train_bpe(["hello hello"], 257).unwrap();
    assert_eq!((t.vocab_size(), t.eot()), (257, 256));
    assert_eq!(t.encode("hi"), vec![b'h' as u32 - 33, b'i' as u32 - 33]);
    // No documents, or too little text for the requested size: fewer ids.
    let t = train_bpe(Vec::<String>::new(), 5000).unwrap();
    assert_eq!(t.vocab_size(), 257);
    let t = train_bpe(["ab ab ab ab"], 5000).unwrap();
    assert!(t.vocab_size() > 257 && t.vocab_size() < 300);
    assert_eq!(t.eot(), t.vocab_size() - 1);
    assert_eq!(t.decode(&t.encode("ab \u{1f600}")).unwrap(), "ab \u{1f600}");
    // max_token_length bounds token length.
    let mut o = BpeTrainOptions::new(400);
    o.max_token_length = Some(3);
    let t = train_bpe_with(&corpus_sample()[..1], &o).unwrap();
    assert!(t
        .id_to_token()
        .iter()
        .take(399)
        .all(|s| s.chars().count() <= 3));
}

#[test]
fn bad_tokenizer_files_are_clear_errors() {
    let dir = common::tmpdir("tok-bad");
    let p = dir.join("tokenizer.json");
    let path = p.to_str().unwrap();
    let err = |name: &str| match tokenizer_by_name(name) {
        Ok(_) => panic!("{name}: loaded"),
        Err(e) => e.to_string(),
    };
    // Missing file.
    let e = err(path);
    assert!(e.contains(path), "{e}");
    // Not JSON / not a tokenizer.
    std::fs::write(&p, b"{ not json").unwrap();
    let e = err(path);
    assert!(
        e.contains(path) && e.contains("not a valid Hugging Face tokenizer.json"),
        "{e}"
    );
    // No <|endoftext|>.
    let tok = train_bpe(["hello world"], 300).unwrap();
    let json = tok.to_json().replace("<|endoftext|>", "<|eos|>");
    std::fs::write(&p, &json).unwrap();
    let e = err(path);
    assert!(e.contains(path) && e.contains("<|endoftext|>"), "{e}");
    // A directory without tokenizer.json.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = err(empty.to_str().unwrap());
    assert!(e.contains("no tokenizer.json"), "{e}");
    // Not byte-level: a WordLevel model.
    let wl = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
        "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
        "model":{"type":"WordLevel","vocab":{"<|endoftext|>":0,"a":1},"unk_token":"a"}}"#;
    std::fs::write(&p, wl).unwrap();
    let e = err(path);
    assert!(e.contains("BPE") && e.contains("WordLevel"), "{e}");
    // A byte-level BPE missing byte tokens.
    let mut v: serde_json::Value = serde_json::from_str(&tok.to_json()).unwrap();
    let vocab = v["model"]["vocab"].as_object_mut().unwrap();
    vocab.remove("\u{100}");
    let e = HfTokenizer::from_bytes(v.to_string().as_bytes())
        .unwrap_err()
        .to_string();
    assert!(e.contains("0x00") || e.contains("ids must be"), "{e}");
    // Unknown names.
    let e = err("gpt3");
    assert!(e.contains("unknown tokenizer `gpt3`"), "{e}");
    // gpt2 by name still works and is not an HfTokenizer path.
    assert_eq!(tokenizer_by_name("gpt2").unwrap().name(), "gpt2");
}

#[test]
fn tokenizer_by_name_loads_files_and_dirs() {
    let dir = common::tmpdir("tok-by-name");
    let tok = train_bpe(&corpus_sample()[..2], 500).unwrap();
    tok.save(dir.join("tokenizer.json")).unwrap();
    for name in [dir.join("tokenizer.json"), dir.clone()] {
        let t: Box<dyn Tokenizer> = tokenizer_by_name(name.to_str().unwrap()).unwrap();
        assert_eq!(t.name(), "bpe-500");
        assert_eq!((t.vocab_size(), t.eot()), (500, 499));
        assert_eq!(
            t.encode("To be, or not to be"),
            tok.encode("To be, or not to be")
        );
        assert!(t.hf_tokenizer_json().unwrap() == tok.to_json());
    }
}

/// Training time and tokens/byte on the whole corpus (release build).
#[test]
#[ignore = "measurement; run with --release --nocapture"]
fn bpe_training_numbers() {
    let docs: Vec<String> = shakespeare().into_iter().map(|(_, t)| t).collect();
    let bytes: usize = docs.iter().map(|d| d.len()).sum();
    let gpt2 = Gpt2Tokenizer::new();
    let g: usize = docs.iter().map(|d| gpt2.encode(d).len()).sum();
    eprintln!(
        "corpus: {} documents, {bytes} bytes; gpt2: {g} tokens, {:.4} tokens/byte",
        docs.len(),
        g as f64 / bytes as f64
    );
    for v in [2048, 4096, 8192] {
        let t0 = Instant::now();
        let tok = train_bpe(&docs, v).unwrap();
        let train_s = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        let n: usize = docs.iter().map(|d| tok.encode(d).len()).sum();
        let enc_s = t0.elapsed().as_secs_f64();
        let sha = Sha256::digest(tok.to_json().as_bytes());
        eprintln!(
            "vocab {v}: trained in {train_s:.2} s, {n} tokens, {:.4} tokens/byte ({:.2}x gpt2's \
             count), encode {:.2} MB/s, tokenizer.json sha256 {}",
            n as f64 / bytes as f64,
            n as f64 / g as f64,
            bytes as f64 / 1e6 / enc_s,
            sha.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
    }
}

/// Writes fixtures for `dev/check_tokenizer.py`: `$FUGU_TOKENIZER_FIXTURE`
/// (default `<tmp>/fugu-tokenizer-fixture`)/{gpt2,bpe-4096}/ with the
/// tokenizer files and `expected_ids.json` (`[{"text": .., "ids": [..]}]`).
#[test]
#[ignore = "writes the Python check fixture; run with --release"]
fn write_python_check_fixture() {
    let root = std::env::var_os("FUGU_TOKENIZER_FIXTURE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("fugu-tokenizer-fixture"));
    let docs: Vec<String> = shakespeare().into_iter().map(|(_, t)| t).collect();
    let bpe = train_bpe(&docs, 4096).unwrap();
    let gpt2 = Gpt2Tokenizer::new();
    let mut texts = tricky_texts();
    texts.push(docs[0].chars().take(20_000).collect());
    let toks: [(&str, &dyn Tokenizer); 2] = [("gpt2", &gpt2), ("bpe-4096", &bpe)];
    for (name, tok) in toks {
        let dir = root.join(name);
        write_hf_tokenizer_files(tok, &dir, Some(1024)).unwrap();
        let expected: Vec<serde_json::Value> = texts
            .iter()
            .map(|t| serde_json::json!({"text": t, "ids": tok.encode(t)}))
            .collect();
        std::fs::write(
            dir.join("expected_ids.json"),
            serde_json::to_string_pretty(&expected).unwrap(),
        )
        .unwrap();
        eprintln!("wrote {}", dir.display());
    }
}

#[test]
fn newline_cuts_are_safe_for_gpt2_style_tokenizers() {
    let docs = corpus_sample();
    let bpe = train_bpe(&docs, 700).unwrap();
    assert!(bpe.safe_newline_cuts());
    assert!(Gpt2Tokenizer::new().safe_newline_cuts());
    assert!(HfTokenizer::gpt2().unwrap().safe_newline_cuts());
    // Encoding the parts between safe cuts gives the ids of the whole.
    let text = &docs[0];
    let b = text.as_bytes();
    let mut parts = Vec::new();
    let mut start = 0;
    for i in 0..b.len() {
        if fugu_io::tokenizer::is_safe_cut(b, i) {
            parts.extend(bpe.encode(&text[start..=i]));
            start = i + 1;
        }
    }
    parts.extend(bpe.encode(&text[start..]));
    assert!(start > 0);
    assert_eq!(parts, bpe.encode(text));
    // With a prefix space, cuts are not safe.
    let json = bpe.to_json().replacen(
        "\"add_prefix_space\": false",
        "\"add_prefix_space\": true",
        1,
    );
    assert!(!HfTokenizer::from_bytes(json.as_bytes())
        .unwrap()
        .safe_newline_cuts());
}

#[test]
fn fast_encode_matches_the_crates_pipeline() {
    let docs = corpus_sample();
    let bpe = train_bpe(&docs, 900).unwrap();
    let gpt2 = HfTokenizer::gpt2().unwrap();
    for tok in [&bpe, &gpt2] {
        for t in tricky_texts().iter().chain(&docs) {
            assert_eq!(
                tok.encode(t),
                tok.try_encode(t).unwrap(),
                "{}: {:?}",
                tok.name(),
                &t[..t.len().min(40)]
            );
        }
    }
}

#[test]
fn huge_whitespace_runs_do_not_panic() {
    // tiktoken-rs panics on this (regex backtracking limit); Gpt2Tokenizer
    // falls back to the tokenizers-crate GPT-2.
    let text = " ".repeat(1_000_000) + "x y";
    let g = Gpt2Tokenizer::new();
    let ids = g.encode(&text);
    assert_eq!(g.decode(&ids).unwrap(), text);
    let hf = HfTokenizer::gpt2().unwrap();
    assert_eq!(hf.decode(&hf.encode(&text)).unwrap(), text);
}

/// The Llama-style tokenizer of `tests/fixtures/llama-tokenizer` (SentencePiece BPE with byte
/// fallback, converted by transformers; `dev/make_llama_tokenizer.py`).
fn llama_fixture() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/llama-tokenizer")
}

#[test]
fn llama_style_tokenizer_gives_transformers_ids() {
    let dir = llama_fixture();
    let tok = HfTokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    assert_eq!(tok.byte_encoding(), ByteEncoding::ByteFallback);
    assert_eq!(
        (tok.vocab_size(), tok.eot(), tok.eot_token().as_str()),
        (1000, 2, "</s>")
    );
    let cases: Vec<serde_json::Value> =
        serde_json::from_slice(&std::fs::read(dir.join("expected_ids.json")).unwrap()).unwrap();
    assert!(cases.len() >= 10);
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(tok.encode(text), want, "{text:?}");
        // A leading space is dropped by the round trip, as in transformers.
        let back = text.strip_prefix(' ').unwrap_or(text);
        assert_eq!(tok.decode(&want).unwrap(), back, "{text:?}");
    }
    // Characters the merges never saw go through <0xXX> byte tokens.
    let ids = tok.encode("Ωμέγα 🐡");
    let byte_tokens = tok.id_to_token();
    assert!(
        ids.iter()
            .any(|&i| byte_tokens[i as usize].starts_with("<0x")),
        "{ids:?}"
    );
    assert_eq!(tok.decode(&ids).unwrap(), "Ωμέγα 🐡");
    // The directory form (as `--tokenizer DIR` and checkpoints use) loads the same tokenizer.
    let by_dir = tokenizer_by_name(dir.to_str().unwrap()).unwrap();
    assert_eq!(by_dir.encode("To be, or not"), tok.encode("To be, or not"));
}

/// The fixture as transformers writes it now (a `Metaspace` pre-tokenizer), and in the older
/// form of Llama 2's own `tokenizer.json` (a `Prepend`+`Replace` normalizer, no pre-tokenizer).
fn llama_fixture_forms() -> [HfTokenizer; 2] {
    let json = std::fs::read_to_string(llama_fixture().join("tokenizer.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["pre_tokenizer"]["type"], "Metaspace");
    v["pre_tokenizer"] = serde_json::Value::Null;
    v["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]});
    [
        HfTokenizer::from_bytes(json.as_bytes()).unwrap(),
        HfTokenizer::from_bytes(v.to_string().as_bytes()).unwrap(),
    ]
}

#[test]
fn llama_style_tokenizer_round_trips_the_corpus() {
    for tok in llama_fixture_forms() {
        round_trips_and_cuts_exactly(&tok);
    }
}

fn round_trips_and_cuts_exactly(tok: &HfTokenizer) {
    assert!(tok.safe_newline_cuts());
    for (i, text) in corpus_sample().iter().enumerate() {
        let ids = tok.encode(text);
        assert!(ids.iter().all(|&i| i < tok.vocab_size()));
        let back = text.strip_prefix(' ').unwrap_or(text);
        assert!(tok.decode(&ids).unwrap() == back, "document {i}");
        // Cut at every safe newline: the first part encoded as a text, the others as
        // continuations (no `▁` in front), the ids are those of the whole.
        let b = text.as_bytes();
        let (mut parts, mut start, mut cuts) = (Vec::new(), 0, 0);
        for j in 0..b.len() {
            if fugu_io::tokenizer::is_safe_cut(b, j) {
                let part = &text[start..=j];
                parts.extend(match start {
                    0 => tok.encode(part),
                    _ => tok.encode_continuation(part),
                });
                start = j + 1;
                cuts += 1;
            }
        }
        parts.extend(tok.encode_continuation(&text[start..]));
        assert!(cuts > 10, "document {i}: {cuts} cuts");
        assert!(parts == ids, "document {i}: cut encoding differs");
        // Without the continuation form, each part would gain a `▁`.
        if let Some(j) = (1..b.len()).find(|&j| fugu_io::tokenizer::is_safe_cut(b, j)) {
            let rest = &text[j + 1..];
            assert_ne!(
                tok.encode(rest),
                tok.encode_continuation(rest),
                "document {i}"
            );
        }
    }
}

#[test]
fn llama_style_tokenizer_files_load_back() {
    let tok = HfTokenizer::from_file(llama_fixture().join("tokenizer.json")).unwrap();
    let files = hf_tokenizer_files(&tok, Some(256)).unwrap();
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    // No GPT-2 slow-tokenizer files: GPT2Tokenizer would byte-level encode with them.
    assert_eq!(
        names,
        [
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json"
        ]
    );
    let config: serde_json::Value = serde_json::from_slice(&files[1].1).unwrap();
    assert_eq!(config["tokenizer_class"], "PreTrainedTokenizerFast");
    assert_eq!(
        (
            &config["bos_token"],
            &config["eos_token"],
            &config["unk_token"]
        ),
        (&"<s>".into(), &"</s>".into(), &"<unk>".into())
    );
    assert_eq!(
        (&config["add_bos_token"], &config["model_max_length"]),
        (&false.into(), &256.into())
    );
    let back = HfTokenizer::from_bytes(&files[0].1).unwrap();
    let text = "KING HENRY V.\nO for a Muse of fire";
    assert_eq!(back.encode(text), tok.encode(text));
}

#[test]
fn unusable_llama_style_tokenizers_are_refused_by_what_is_wrong() {
    let json = std::fs::read_to_string(llama_fixture().join("tokenizer.json")).unwrap();
    let refuse = |edit: &dyn Fn(&mut serde_json::Value)| -> String {
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        edit(&mut v);
        match HfTokenizer::from_bytes(v.to_string().as_bytes()) {
            Ok(_) => panic!("accepted"),
            Err(e) => e.to_string(),
        }
    };
    // Byte fallback without a ByteFallback decoder step: <0xXX> would decode as names.
    let e = refuse(&|v| {
        v["decoder"]["decoders"]
            .as_array_mut()
            .unwrap()
            .retain(|d| d["type"] != "ByteFallback")
    });
    assert!(e.contains("ByteFallback"), "{e}");
    // Neither byte fallback nor byte-level: some text has no encoding.
    let e = refuse(&|v| v["model"]["byte_fallback"] = false.into());
    assert!(
        e.contains("byte fallback") && e.contains("byte-level"),
        "{e}"
    );
    // A byte token missing.
    let e = refuse(&|v| {
        let vocab = v["model"]["vocab"].as_object_mut().unwrap();
        let id = vocab.remove("<0x41>").unwrap();
        vocab.insert("<0x41-renamed>".into(), id);
    });
    assert!(e.contains("0x41"), "{e}");
    // A token holding a newline: cuts at newlines would not be exact, documents are whole.
    let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let vocab = v["model"]["vocab"].as_object_mut().unwrap();
    vocab.insert("\n\n".into(), 1000.into());
    let whole_docs = HfTokenizer::from_bytes(v.to_string().as_bytes()).unwrap();
    assert!(!whole_docs.safe_newline_cuts());
    // A lowercasing normalizer: the data would not be the text.
    let e = refuse(&|v| v["normalizer"] = serde_json::json!({"type": "Lowercase"}));
    assert!(e.contains("does not give back the text"), "{e}");
    // No end-of-text token of any known name.
    let e = refuse(&|v| {
        for t in v["added_tokens"].as_array_mut().unwrap() {
            if t["content"] == "</s>" {
                t["content"] = "<end>".into();
            }
        }
        let vocab = v["model"]["vocab"].as_object_mut().unwrap();
        let id = vocab.remove("</s>").unwrap();
        vocab.insert("<end>".into(), id);
    });
    assert!(e.contains("end-of-text") && e.contains("</s>"), "{e}");
}

/// Tokenizers compared by what they do: GPT-2 through tiktoken and through the `tokenizers`
/// crate are the same; the Llama-style fixture and a BPE of as many ids trained here differ,
/// and the difference is named.
#[test]
fn tokenizers_are_compared_by_what_they_do() {
    use fugu_io::tokenizer::difference;
    let gpt2 = Gpt2Tokenizer::new();
    assert_eq!(difference(&gpt2, &HfTokenizer::gpt2().unwrap()), None);
    let llama = HfTokenizer::from_file(llama_fixture().join("tokenizer.json")).unwrap();
    assert_eq!(difference(&llama, &llama.clone()), None);
    let d = difference(&llama, &gpt2).unwrap();
    assert!(d.contains("1000 ids against 50257"), "{d}");
    let bpe = train_bpe(&corpus_sample()[..2], 1000).unwrap();
    assert!(difference(&llama, &bpe).is_some());
}

//! Property tests of what users type and the files they hand over: every numeric flag of
//! `fugu train`, `--set` values, config TOML, machine profiles (TOML) and dataset manifests
//! (JSON), each fed a fixed budget of hostile values and mutated texts from a seeded generator.
//! The property: an input is accepted or refused with an error, never a panic (the test
//! binary is built with overflow checks, so an unchecked multiplication of two user numbers
//! fails here too). The budget is a fixed case count per section (not a time), so the suite's
//! time is stable; each section prints its count and time. `FUGU_FUZZ_SEED` picks another seed.

use clap::{Args, FromArgMatches};
use fugu::cli::TrainArgs;
use fugu::config::RunConfig;
use fugu::predict::fit::{fit, Runs};
use fugu::predict::profile::Profile;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::time::Instant;

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n.max(1)
    }

    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

/// Values a careless or hostile user might give a number.
const SPECIAL: &[&str] = &[
    "nan",
    "NaN",
    "-nan",
    "inf",
    "-inf",
    "infinity",
    "1e309",
    "-1e309",
    "1e-320",
    "0",
    "-0",
    "0.0",
    "-1",
    "-5",
    "1",
    "2",
    "3",
    "7",
    "1000000000",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "9007199254740993",
    "1e12",
    "0.5",
    "-0.5",
    "1e-9",
    "",
    " ",
    "1_000",
    "0x10",
    "1e",
    ".",
    "+",
    "--",
    "1,5",
    "١",
    "∞",
    "1e5000",
    "3.4e38",
    "-3.4e38",
    "65536",
    "65535",
    "2147483648",
];

/// A random number-like string: a special value, or a sign, digits, a fraction and an
/// exponent put together.
fn number(rng: &mut Rng) -> String {
    if rng.below(2) == 0 {
        return rng.pick(SPECIAL).to_string();
    }
    let mut s = String::new();
    if rng.below(4) == 0 {
        s.push('-');
    }
    for _ in 0..1 + rng.below(22) {
        s.push((b'0' + rng.below(10) as u8) as char);
    }
    if rng.below(3) == 0 {
        s.push('.');
        for _ in 0..rng.below(6) {
            s.push((b'0' + rng.below(10) as u8) as char);
        }
    }
    if rng.below(3) == 0 {
        s += &format!("e{}{}", rng.pick(&["", "-", "+"]), rng.below(400));
    }
    s
}

thread_local! {
    /// Set while a case runs: its panic is caught and reported with its input, so the hook
    /// stays quiet; a panic anywhere else is printed as usual.
    static IN_CASE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f`, turning a panic into the input that caused it.
fn no_panic(section: &str, input: &str, f: impl FnOnce()) -> Option<String> {
    IN_CASE.set(true);
    let r = catch_unwind(AssertUnwindSafe(f));
    IN_CASE.set(false);
    r.err().map(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        format!("{section}: {input:?} panicked: {msg}")
    })
}

/// Applies one random edit to a text: a number replaced, a line dropped or repeated, a byte
/// inserted, or the text cut short.
fn mutate(rng: &mut Rng, text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    if lines.is_empty() {
        return format!("{text}{}", number(rng));
    }
    match rng.below(6) {
        0 | 1 => {
            // Replace the value of a `key = number` / `"key": number` with a random number.
            let i = rng.below(lines.len());
            let mut out: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
            let l = &lines[i];
            if let Some(at) = l.find([':', '=']) {
                let (head, tail) = l.split_at(at + 1);
                let comma = if tail.trim_end().ends_with(',') {
                    ","
                } else {
                    ""
                };
                out[i] = format!("{head} {}{comma}", number(rng));
            }
            out.join("\n")
        }
        2 => {
            let i = rng.below(lines.len());
            let mut out = lines.clone();
            out.remove(i);
            out.join("\n")
        }
        3 => {
            let i = rng.below(lines.len());
            let mut out = lines.clone();
            out.insert(i, lines[i]);
            out.join("\n")
        }
        4 => {
            let mut b = text.as_bytes().to_vec();
            let at = rng.below(b.len() + 1);
            b.insert(
                at,
                rng.pick(&["{", "}", "[", "\"", "=", ":", "\u{0}", "9", "-", "\n"])
                    .as_bytes()[0],
            );
            String::from_utf8_lossy(&b).into_owned()
        }
        _ => {
            let at = rng.below(text.len() + 1);
            String::from_utf8_lossy(&text.as_bytes()[..at]).into_owned()
        }
    }
}

/// Every `fugu train` flag that takes a value, given random numbers (the numeric ones are the
/// point; the others are given them too): parse, then the checks `fugu train` makes before it
/// creates anything.
fn train_flags(rng: &mut Rng, cases: usize, failures: &mut Vec<String>) {
    let cmd = TrainArgs::augment_args(clap::Command::new("train"));
    let flags: Vec<String> = cmd
        .get_arguments()
        .filter(|a| a.get_action().takes_values() && a.get_long().is_some())
        .map(|a| format!("--{}", a.get_long().unwrap()))
        .collect();
    assert!(flags.len() >= 20, "found only {flags:?}");
    for i in 0..cases {
        let flag = &flags[i % flags.len()];
        let value = number(rng);
        let input = format!("{flag} {value}");
        let cmd = cmd.clone();
        failures.extend(no_panic("train flag", &input, || {
            let Ok(m) = cmd.try_get_matches_from(["train", flag.as_str(), value.as_str()]) else {
                return;
            };
            let Ok(args) = TrainArgs::from_arg_matches(&m) else {
                return;
            };
            if let Ok(opts) = args.options() {
                let _ = opts.config.validate();
            }
        }));
    }
}

/// `--set section.field=value` for every field of the default config, random values.
fn set_values(rng: &mut Rng, cases: usize, failures: &mut Vec<String>) {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/configs/gpt2-tiny.toml"
    ))
    .unwrap();
    let keys: Vec<String> = {
        let mut section = String::new();
        let mut keys = Vec::new();
        for l in text.lines().map(str::trim) {
            if let Some(s) = l.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
                section = s.to_string();
            } else if let Some((k, _)) = l.split_once('=') {
                if !section.is_empty() && !l.starts_with('#') {
                    keys.push(format!("{section}.{}", k.trim()));
                }
            }
        }
        keys
    };
    assert!(keys.len() >= 10, "{keys:?}");
    for i in 0..cases {
        let set = format!("{}={}", keys[i % keys.len()], number(rng));
        failures.extend(no_panic("--set", &set, || {
            if let Ok(cfg) = RunConfig::load_with("gpt2-tiny", std::slice::from_ref(&set)) {
                if cfg.validate().is_ok() {
                    let _ = fugu::model::registry::full_params(&cfg.model);
                }
            }
        }));
    }
}

/// `cases` mutated copies (one to three edits each) of the files in the repository folder
/// `folder`, each given to `check` under `section`.
fn mutated_files(
    rng: &mut Rng,
    cases: usize,
    failures: &mut Vec<String>,
    (section, folder): (&str, &str),
    check: impl Fn(&str),
) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(folder);
    let mut texts: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    texts.sort();
    for i in 0..cases {
        let mut text = texts[i % texts.len()].clone();
        for _ in 0..1 + rng.below(3) {
            text = mutate(rng, &text);
        }
        failures.extend(no_panic(section, &text, || check(&text)));
    }
}

/// Mutated copies of every shipped config.
fn config_texts(rng: &mut Rng, cases: usize, failures: &mut Vec<String>) {
    mutated_files(rng, cases, failures, ("config", "configs"), |text| {
        if let Ok(cfg) = RunConfig::parse(text, "fuzz.toml") {
            if cfg.validate().is_ok() {
                let _ = fugu::model::registry::full_params(&cfg.model);
            }
        }
    });
}

/// Mutated copies of the shipped machine profiles, through the checks `fugu predict` makes.
fn profiles(rng: &mut Rng, cases: usize, failures: &mut Vec<String>) {
    mutated_files(rng, cases, failures, ("profile", "profiles"), |text| {
        if let Ok(p) = toml::from_str::<Profile>(text) {
            if p.validate().is_ok() {
                let _ = p.machine();
            }
        }
    });
}

/// Mutated copies of the shipped runs file (published Fugaku runs), parsed and every run
/// predicted on the Fugaku profile, as `fugu predict profile --fit` does.
fn runs_files(rng: &mut Rng, cases: usize, failures: &mut Vec<String>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let file = root.join("profiles/fugaku-published-runs.toml");
    let original = std::fs::read_to_string(&file).unwrap();
    let machine = Profile::load(&root.join("profiles/fugaku.toml"))
        .unwrap()
        .machine();
    for _ in 0..cases {
        let mut text = original.clone();
        for _ in 0..1 + rng.below(3) {
            text = mutate(rng, &text);
        }
        failures.extend(no_panic("runs file", &text, || {
            if let Ok(runs) = Runs::parse(&text, &file) {
                let _ = fit(&machine, &runs, &[]);
            }
        }));
    }
}

/// A manifest as `fugu prepare` writes one, mutated.
fn manifests(rng: &mut Rng, cases: usize, failures: &mut Vec<String>) {
    let sha = "0".repeat(64);
    let text = format!(
        r#"{{
  "format": "fugu-webdataset",
  "version": 1,
  "tokenizer": "gpt2",
  "vocab_size": 50257,
  "eot": 50256,
  "dtype": "u16",
  "created_by": "fugu 0.1.0",
  "inputs": ["corpus.txt"],
  "split": {{
    "val_fraction": 0.1,
    "val_every": 10
  }},
  "train": {{
    "documents": 9,
    "samples": 9,
    "tokens": 4096,
    "text_bytes": 16000,
    "shards": [
      {{
        "file": "train-000000.tar",
        "samples": 9,
        "tokens": 4096,
        "bytes": 20480,
        "sha256": "{sha}"
      }}
    ]
  }},
  "val": {{
    "documents": 1,
    "samples": 1,
    "tokens": 512,
    "text_bytes": 2000,
    "shards": [
      {{
        "file": "val-000000.tar",
        "samples": 1,
        "tokens": 512,
        "bytes": 10240,
        "sha256": "{sha}"
      }}
    ]
  }},
  "totals": {{
    "documents": 10,
    "samples": 10,
    "tokens": 4608,
    "text_bytes": 18000,
    "shard_bytes": 30720,
    "empty_documents": 0,
    "invalid_utf8_documents": 0,
    "skipped_bad_inputs": 0
  }}
}}"#
    );
    let path = Path::new("fuzz/manifest.json");
    fugu_io::Manifest::parse(text.as_bytes(), path).expect("the unmutated manifest is valid");
    for _ in 0..cases {
        let mut t = text.clone();
        for _ in 0..1 + rng.below(3) {
            t = mutate(rng, &t);
        }
        failures.extend(no_panic("manifest", &t, || {
            if let Ok(m) = fugu_io::Manifest::parse(t.as_bytes(), path) {
                let _ = (m.train.tokens_per_byte(), m.token_bytes());
            }
        }));
    }
}

#[test]
fn hostile_numbers_and_mutated_files_are_refused_without_a_panic() {
    let seed = std::env::var("FUGU_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_f0f0_u64);
    let mut rng = Rng(seed | 1);
    // The panics of cases are caught and listed below; the hook prints only the others.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !IN_CASE.get() {
            hook(info)
        }
    }));
    let mut failures = Vec::new();
    type Section = fn(&mut Rng, usize, &mut Vec<String>);
    let sections: [(&str, Section, usize); 6] = [
        ("train flags", train_flags, 3000),
        ("--set values", set_values, 1500),
        ("config texts", config_texts, 1500),
        ("machine profiles", profiles, 1500),
        ("runs files", runs_files, 300),
        ("manifests", manifests, 1500),
    ];
    let mut report = Vec::new();
    for (name, section, cases) in sections {
        eprintln!("{name}: {cases} cases...");
        let t = Instant::now();
        let before = failures.len();
        section(&mut rng, cases, &mut failures);
        report.push(format!(
            "{name}: {cases} cases in {:.2} s, {} panics",
            t.elapsed().as_secs_f64(),
            failures.len() - before
        ));
    }
    for line in &report {
        eprintln!("{line} (seed {seed:#x})");
    }
    assert!(
        failures.is_empty(),
        "{} input(s) panicked; the first:\n{}",
        failures.len(),
        failures
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

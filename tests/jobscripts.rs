//! The batch job scripts in `jobscripts/` (docs/JOBS.md), tested for real:
//!
//! * always: shellcheck on every script, the `#PJM` / `#SBATCH` directives linted against the
//!   documented pjsub syntax and against each other (node, proc, max-proc-per-node, threads),
//!   the shell helpers of `lib/common.sh`, the `local-pjsub.sh` stand-in itself, and the pjsub
//!   GEMM benchmark job under it (and its communication benchmark with 2 ranks, where mpirun
//!   and an MPI build of fugu are at hand);
//! * with `FUGU_SLURM_TESTS=1` as root (scripts/test.sh sets it; root because the local Slurm
//!   runs its daemons as root and Open MPI must be told that root is fine): the Slurm scripts
//!   submitted to a single-node Slurm started here by `jobscripts/local-slurm.sh` (a 1-rank
//!   job; a 2-rank training, a GEMM benchmark and a report job that depends on both, through
//!   `scaling-sweep.sh`; the pre-timeout signal: USR1 -> checkpoint -> exit 4 -> resubmitted
//!   job resumes at the right step; the communication benchmark with 2 ranks through srun and
//!   mpirun), and the pjsub training under `local-pjsub.sh` with 2 ranks, including its own
//!   deadline.
//!
//! The MPI jobs need a binary built with `--features mpi`: this test's own build of `fugu` when
//! it is built with that feature (scripts/test.sh does), or the binary `FUGU_JOBS_BIN` names
//! (a release build, say).

use fugu::metrics::jsonl::{read_metrics, Record};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

// ------------------------------------------------------------------------------------ helpers

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn jobscripts() -> PathBuf {
    repo().join("jobscripts")
}

/// A scratch folder, removed when the test passes (kept for a look when it fails, or with
/// `FUGU_KEEP_TEST_DIRS=1`).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() && std::env::var_os("FUGU_KEEP_TEST_DIRS").is_none() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

fn tmp(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("fugu-jobs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

fn text(out: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The fugu binary the jobs run.
fn jobs_bin() -> PathBuf {
    match std::env::var_os("FUGU_JOBS_BIN") {
        Some(p) => {
            let p = PathBuf::from(p);
            let p = if p.is_absolute() { p } else { repo().join(p) };
            assert!(p.is_file(), "FUGU_JOBS_BIN={} does not exist", p.display());
            p
        }
        None => PathBuf::from(env!("CARGO_BIN_EXE_fugu")),
    }
}

/// Root and `FUGU_SLURM_TESTS=1`, or prints why the test is skipped.
fn gated(test: &str) -> bool {
    let opted_in = std::env::var("FUGU_SLURM_TESTS").as_deref() == Ok("1");
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !opted_in || !root {
        skipped(&format!(
            "{test} (needs root and FUGU_SLURM_TESTS=1: it runs a local Slurm and MPI jobs; \
             scripts/test.sh sets it)"
        ));
        return false;
    }
    true
}

/// Says so on the real stderr (the test harness captures `eprintln!`).
fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "skipped: {why}");
}

/// The bundled corpus, tokenised once into the temp folder and reused by later test runs
/// (the jobs then skip their own staging).
fn corpus() -> PathBuf {
    static DATA: OnceLock<PathBuf> = OnceLock::new();
    DATA.get_or_init(|| {
        let dir = std::env::temp_dir().join("fugu-jobs-corpus");
        if !dir.join("manifest.json").exists() {
            let part =
                std::env::temp_dir().join(format!("fugu-jobs-corpus.{}", std::process::id()));
            let out = Command::new(jobs_bin())
                .args(["prepare", "--quiet", "--out"])
                .arg(&part)
                .output()
                .unwrap();
            assert!(out.status.success(), "fugu prepare: {}", text(&out));
            // Another test process may have won the race: keep its copy.
            if std::fs::rename(&part, &dir).is_err() {
                let _ = std::fs::remove_dir_all(&part);
            }
        }
        dir.join("manifest.json")
    })
    .clone()
}

/// Environment of every MPI job: Open MPI as root, loopback only.
const OMPI_ENV: [(&str, &str); 4] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ("OMPI_MCA_btl_tcp_if_include", "lo"),
    ("OMPI_MCA_oob_tcp_if_include", "lo"),
];

/// A tiny, quick training: gpt2-tiny with short sequences (what the 2-core CI can afford).
fn tiny_train_env(steps: u32) -> Vec<(String, String)> {
    [
        ("FUGU_CONFIG", "gpt2-tiny".to_string()),
        ("FUGU_STEPS", steps.to_string()),
        ("FUGU_BATCH_SIZE", "2".into()),
        ("FUGU_SEQ_LEN", "32".into()),
        ("FUGU_THREADS", "1".into()),
        ("FUGU_EVAL_EVERY", "0".into()),
        ("FUGU_LOG_EVERY", "1".into()),
        ("FUGU_PEAK_GFLOPS_PER_CORE", "100".into()),
        ("FUGU_PEAK_GBS", "50".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn metrics(run: &Path) -> Vec<Record> {
    read_metrics(run.join("metrics.jsonl"))
        .unwrap_or_else(|e| panic!("{}/metrics.jsonl: {e:#}", run.display()))
}

fn headers(m: &[Record]) -> Vec<&Value> {
    m.iter()
        .filter_map(|r| match r {
            Record::Header(h) => Some(h),
            _ => None,
        })
        .collect()
}

fn steps(m: &[Record]) -> Vec<u64> {
    m.iter()
        .filter_map(|r| match r {
            Record::Step(s) => Some(s.step),
            _ => None,
        })
        .collect()
}

/// The first header says the run used `world` ranks.
fn assert_world(m: &[Record], world: u64) {
    let h = headers(m);
    assert!(!h.is_empty(), "no header in metrics.jsonl");
    assert_eq!(
        h[0]["layout"]["world"].as_u64(),
        Some(world),
        "layout in the header: {}",
        h[0]["layout"]
    );
}

fn jsonl_rows(p: &Path) -> Vec<Value> {
    read(p)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}: {l}", p.display())))
        .collect()
}

// ------------------------------------------------------------------------------ shellcheck

fn job_script_files() -> Vec<PathBuf> {
    let mut v = vec![jobscripts().join("lib/common.sh")];
    for dir in ["pjsub", "slurm"] {
        let mut files: Vec<PathBuf> = std::fs::read_dir(jobscripts().join(dir))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "sh"))
            .collect();
        files.sort();
        v.extend(files);
    }
    v
}

#[test]
fn shellcheck_every_job_script() {
    if !have("shellcheck") {
        // CI installs it (scripts/install-deps.sh); a developer without it is told so.
        assert!(
            std::env::var_os("FUGU_SLURM_TESTS").is_none() && std::env::var_os("CI").is_none(),
            "shellcheck is not installed (scripts/install-deps.sh installs it)"
        );
        skipped("shellcheck_every_job_script (shellcheck not installed)");
        return;
    }
    let files = job_script_files();
    assert!(files.len() >= 8, "job scripts: {files:?}");
    // The job scripts: every check, down to style. -x follows `. common.sh`.
    let out = Command::new("shellcheck")
        .args(["-x", "--severity=style", "--shell=bash"])
        .args(&files)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(out.status.success(), "shellcheck:\n{}", text(&out));
    // local-slurm.sh is a copied test tool: warnings and errors only.
    let out = Command::new("shellcheck")
        .args(["--severity=warning"])
        .arg(jobscripts().join("local-slurm.sh"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "shellcheck local-slurm.sh:\n{}",
        text(&out)
    );
    for f in &files {
        let out = Command::new("bash").arg("-n").arg(f).output().unwrap();
        assert!(
            out.status.success(),
            "bash -n {}: {}",
            f.display(),
            text(&out)
        );
    }
}

/// scripts/build-fugaku.sh cannot build here (no Fujitsu MPI); it is only parsed and checked
/// for its clear failures: the wrong machine for a native build, a missing MPI wrapper.
#[test]
fn build_fugaku_script_fails_clearly_without_its_tools() {
    let sh = repo().join("scripts/build-fugaku.sh");
    let out = Command::new("bash").arg("-n").arg(&sh).output().unwrap();
    assert!(out.status.success(), "bash -n: {}", text(&out));
    if have("shellcheck") {
        let out = Command::new("shellcheck").arg(&sh).output().unwrap();
        assert!(out.status.success(), "shellcheck: {}", text(&out));
    }
    let run = |args: &[&str], envs: &[(&str, &str)]| {
        Command::new("bash")
            .arg(&sh)
            .args(args)
            .envs(envs.iter().copied())
            .output()
            .unwrap()
    };
    if std::env::consts::ARCH != "aarch64" {
        let out = run(&[], &[]);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out));
        assert!(text(&out).contains("compute node"), "{}", text(&out));
    }
    let out = run(
        &["--cross", "--check"],
        &[("MPICC", "/nonexistent/mpifccpx")],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("/nonexistent/mpifccpx not found"),
        "{}",
        text(&out)
    );
    let out = run(&["--bogus"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
}

// ------------------------------------------------------------------------- directive lint

/// One `#PJM` option with its argument, as written.
#[derive(Debug, Clone, PartialEq)]
struct PjmOpt {
    opt: String,
    arg: Option<String>,
}

/// Splits a directive line like the shell does (double and single quotes, no expansion).
fn shell_words(s: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    for c in s.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            (None, c) => {
                cur.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        return Err(format!("unbalanced quote in `{s}`"));
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// The `#PJM` directives of a script: only those in the leading comment block count (a
/// directive after the first command is an error, since a scheduler may ignore it).
fn pjm_directives(script: &str) -> Result<Vec<PjmOpt>, String> {
    let mut v = Vec::new();
    let mut body = false;
    for (i, line) in script.lines().enumerate() {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix("#PJM") {
            if body {
                return Err(format!("line {}: #PJM after the first command", i + 1));
            }
            if !rest.starts_with(char::is_whitespace) {
                return Err(format!("line {}: `{line}` is not `#PJM <option>`", i + 1));
            }
            let words = shell_words(rest)?;
            let mut w = words.into_iter().peekable();
            while let Some(opt) = w.next() {
                let takes_arg = !matches!(opt.as_str(), "-j" | "-s" | "-S" | "-X" | "--step");
                let arg = if takes_arg {
                    Some(
                        w.next()
                            .ok_or(format!("line {}: {opt} needs a value", i + 1))?,
                    )
                } else {
                    None
                };
                v.push(PjmOpt { opt, arg });
            }
        } else if !(t.is_empty() || t.starts_with('#')) {
            body = true;
        }
    }
    Ok(v)
}

/// pjsub's elapse syntax: `[[H:]M:]S`.
fn pjm_elapse_seconds(s: &str) -> Option<u64> {
    let parts: Vec<&str> = s.split(':').collect();
    if parts.is_empty()
        || parts.len() > 3
        || parts
            .iter()
            .any(|p| p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return None;
    }
    Some(
        parts
            .iter()
            .fold(0u64, |acc, p| acc * 60 + p.parse::<u64>().unwrap()),
    )
}

/// What the directives of one pjsub script ask for.
#[derive(Debug, Default)]
struct PjmJob {
    nodes: u64,
    proc: Option<u64>,
    max_proc_per_node: Option<u64>,
    elapse_s: Option<u64>,
    rscgrp: Option<String>,
    freq: Option<u64>,
    eco_state: Option<u64>,
    /// `--llio sharedtmp-size=`, in MiB.
    sharedtmp_mib: Option<u64>,
    group: Option<String>,
    exports: BTreeMap<String, String>,
    merge: bool,
    stats: bool,
    name: Option<String>,
}

/// Checks every directive against the syntax confirmed from the R-CCS Fugaku user guide
/// (shared/slurm/PJSUB-NOTES.md, summarised in docs/JOBS.md) and the resources against each
/// other.
fn lint_pjm(script: &str) -> Result<PjmJob, String> {
    let mut job = PjmJob {
        nodes: 0,
        ..Default::default()
    };
    let positive = |what: &str, v: &str| -> Result<u64, String> {
        v.parse::<u64>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or(format!("{what}={v}: expected a positive integer"))
    };
    for d in pjm_directives(script)? {
        let arg = d.arg.clone().unwrap_or_default();
        match d.opt.as_str() {
            "-L" | "--rsc-list" => {
                for item in arg.split(',') {
                    let (k, v) = item
                        .trim()
                        .split_once('=')
                        .ok_or(format!("-L {arg}: `{item}` is not resource=value"))?;
                    match k {
                        "node" => {
                            let (shape, mode) = v.split_once(':').unwrap_or((v, ""));
                            if !["", "torus", "mesh", "noncont"].contains(&mode) {
                                return Err(format!("-L node={v}: unknown allocation mode {mode}"));
                            }
                            let mut n = 1;
                            for dim in shape.split('x') {
                                n *= positive("node", dim)?;
                            }
                            if n > 82_944 {
                                return Err(format!("-L node={v}: Fugaku has 82,944 nodes"));
                            }
                            job.nodes = n;
                        }
                        "elapse" => {
                            job.elapse_s = Some(
                                pjm_elapse_seconds(v)
                                    .ok_or(format!("-L elapse={v}: expected [[H:]M:]S"))?,
                            )
                        }
                        "rscgrp" if !v.is_empty() => job.rscgrp = Some(v.into()),
                        "freq" => {
                            let f = positive("freq", v)?;
                            if f != 2000 && f != 2200 {
                                return Err(format!("-L freq={v}: A64FX runs at 2000 or 2200"));
                            }
                            job.freq = Some(f);
                        }
                        "eco_state" => {
                            // R-CCS power control: 0 = eco mode off (both FP pipelines),
                            // 2 = Fugaku's default (FLA only).
                            let e = v
                                .parse::<u64>()
                                .ok()
                                .filter(|e| *e <= 2)
                                .ok_or(format!("-L eco_state={v}: expected 0, 1 or 2"))?;
                            job.eco_state = Some(e);
                        }
                        "rscunit" | "proc-core" | "jobenv" if !v.is_empty() => {}
                        _ => return Err(format!("-L {k}={v}: unknown or empty resource")),
                    }
                }
            }
            "--mpi" => {
                for item in arg.split(',') {
                    let (k, v) = item.trim().split_once('=').unwrap_or((item.trim(), ""));
                    match k {
                        "proc" => job.proc = Some(positive("proc", v)?),
                        "max-proc-per-node" => {
                            let n = positive("max-proc-per-node", v)?;
                            if n > 48 {
                                return Err(format!(
                                    "--mpi max-proc-per-node={n}: an A64FX node has 48 cores"
                                ));
                            }
                            job.max_proc_per_node = Some(n);
                        }
                        "shape" | "rank-map-bynode" | "rank-map-bychip" => {}
                        _ => return Err(format!("--mpi {item}: unknown MPI option")),
                    }
                }
            }
            "-g" => {
                if arg.is_empty() || arg.contains(char::is_whitespace) {
                    return Err(format!("-g `{arg}`: expected a group name"));
                }
                job.group = Some(arg);
            }
            "-x" => {
                let (k, v) = arg
                    .split_once('=')
                    .ok_or(format!("-x {arg}: expected VAR=value"))?;
                let ok_name = k.chars().enumerate().all(|(i, c)| {
                    c == '_' || c.is_ascii_alphabetic() || (i > 0 && c.is_ascii_digit())
                });
                if k.is_empty() || !ok_name {
                    return Err(format!("-x {arg}: `{k}` is not a variable name"));
                }
                job.exports.insert(k.into(), v.into());
            }
            "-j" => job.merge = true,
            "-s" | "-S" => job.stats = true,
            "--name" | "-N" => {
                if arg.is_empty() || arg.len() > 63 {
                    return Err(format!("--name `{arg}`: 1 to 63 bytes"));
                }
                job.name = Some(arg);
            }
            "--llio" => {
                for item in arg.split(',') {
                    let (k, v) = item
                        .trim()
                        .split_once('=')
                        .ok_or(format!("--llio {arg}: `{item}` is not key=value"))?;
                    if k == "sharedtmp-size" || k == "localtmp-size" {
                        let mib = if let Some(g) = v.strip_suffix("Gi") {
                            g.parse::<u64>().ok().map(|g| g * 1024)
                        } else if let Some(m) = v.strip_suffix("Mi") {
                            m.parse::<u64>().ok()
                        } else {
                            None
                        }
                        .ok_or(format!("--llio {k}={v}: expected a size like 512Mi or 1Gi"))?;
                        if mib > 87 * 1024 {
                            return Err(format!("--llio {k}={v}: a node has 87 GiB of LLIO"));
                        }
                        if k == "sharedtmp-size" {
                            job.sharedtmp_mib = Some(mib);
                        }
                    }
                }
            }
            "-o" | "-e" | "--spath" | "-m" | "--mail-list" if !arg.is_empty() => {}
            o => return Err(format!("unknown or unsupported pjsub option {o}")),
        }
    }
    if job.nodes == 0 {
        return Err("no -L node=".into());
    }
    if job.elapse_s.is_none() {
        return Err("no -L elapse=".into());
    }
    if let (Some(p), Some(m)) = (job.proc, job.max_proc_per_node) {
        if p > job.nodes * m {
            return Err(format!(
                "--mpi proc={p} does not fit node={} x max-proc-per-node={m}",
                job.nodes
            ));
        }
    }
    Ok(job)
}

/// The `: "${FUGU_X:=default}"  # comment` settings at the top of a job script (before its
/// "common code" section).
fn settings(script: &str) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for line in script.lines().take_while(|l| !l.contains("common code")) {
        let Some(rest) = line.strip_prefix(": \"${") else {
            continue;
        };
        let Some((name, tail)) = rest.split_once([':', '=']) else {
            continue;
        };
        let tail = tail.trim_start_matches('=');
        let default = tail.split("}\"").next().unwrap_or("").to_string();
        assert!(
            line.contains("}\"") && line.contains(" # "),
            "setting {name} has no comment: {line}"
        );
        m.insert(name.to_string(), default);
    }
    m
}

fn script(path: &str) -> String {
    read(&jobscripts().join(path))
}

#[test]
fn pjsub_directives_follow_the_documented_syntax() {
    for name in [
        "train.sh",
        "bench-gemm.sh",
        "bench-comm.sh",
        "scaling-sweep.sh",
    ] {
        let s = script(&format!("pjsub/{name}"));
        let job = lint_pjm(&s).unwrap_or_else(|e| panic!("pjsub/{name}: {e}"));
        assert!(
            job.group.is_some(),
            "pjsub/{name}: no -g (required on Fugaku)"
        );
        assert!(job.rscgrp.is_some(), "pjsub/{name}: no rscgrp");
        assert!(
            job.merge && job.stats && job.name.is_some(),
            "pjsub/{name}: -j, -S, --name"
        );
        assert!(
            job.exports.contains_key("PJM_LLIO_GFSCACHE"),
            "pjsub/{name}: -x PJM_LLIO_GFSCACHE"
        );
        let m = settings(&s);
        assert!(m.contains_key("FUGU_BIN"), "pjsub/{name}: FUGU_BIN setting");
    }

    // train.sh: one rank per CMG, 12 threads each, on every node; boost clock.
    let s = script("pjsub/train.sh");
    let job = lint_pjm(&s).unwrap();
    let m = settings(&s);
    assert_eq!(job.max_proc_per_node, Some(4));
    assert_eq!(
        job.proc,
        Some(job.nodes * 4),
        "proc = node x max-proc-per-node"
    );
    assert_eq!(job.freq, Some(2200));
    assert_eq!(job.eco_state, Some(0), "both FP pipelines (eco_state=0)");
    assert_eq!(m["FUGU_ECO_STATE"], "0");
    assert!(
        job.sharedtmp_mib.unwrap_or(0) >= 256,
        "--llio sharedtmp-size for llio_transfer"
    );
    assert_eq!(m["FUGU_LLIO_SHAREDTMP"], "1Gi");
    assert_eq!(
        m["FUGU_RANKS_PER_NODE"], "4",
        "FUGU_RANKS_PER_NODE = max-proc-per-node"
    );
    let threads: u64 = m["FUGU_THREADS"].parse().unwrap();
    assert_eq!(
        threads * job.max_proc_per_node.unwrap(),
        48,
        "ranks x threads = 48 cores"
    );
    assert!(
        m.contains_key("FUGU_DEADLINE_MARGIN"),
        "pjsub/train.sh: FUGU_DEADLINE_MARGIN"
    );
    for v in [
        "FUGU_CONFIG",
        "FUGU_DATA",
        "FUGU_STEPS",
        "FUGU_TP",
        "FUGU_OUT",
        "FUGU_ZERO",
        "FUGU_PRECISION",
        "FUGU_MICRO_BATCHES",
        "FUGU_RECOMPUTE",
        "FUGU_LOSS_CHUNK",
        "FUGU_PP",
    ] {
        assert!(m.contains_key(v), "pjsub/train.sh: setting {v}");
    }
    for needed in [
        "llio_transfer",
        "XOS_MMM_L_PAGING_POLICY=${XOS_MMM_L_PAGING_POLICY:-demand:demand:demand}",
        "PLE_MPI_STD_EMPTYFILE=${PLE_MPI_STD_EMPTYFILE:-off}",
        "mpiexec -n",
    ] {
        assert!(s.contains(needed), "pjsub/train.sh lacks {needed}");
    }
    assert!(read(&jobscripts().join("lib/common.sh")).contains("--resume auto"));

    // bench-gemm.sh: one process on one node, both FP pipelines.
    let job = lint_pjm(&script("pjsub/bench-gemm.sh")).unwrap();
    assert_eq!(
        (job.nodes, job.proc, job.max_proc_per_node),
        (1, Some(1), Some(1))
    );
    assert_eq!((job.freq, job.eco_state), (Some(2200), Some(0)));
    assert!(
        job.sharedtmp_mib.is_some(),
        "bench-gemm.sh: --llio sharedtmp-size"
    );

    // bench-comm.sh: like train.sh, one rank per CMG on every node (two nodes, so that the
    // numbers include the network); rank 0's stdout collected by mpiexec -ofout.
    let s = script("pjsub/bench-comm.sh");
    let job = lint_pjm(&s).unwrap();
    let m = settings(&s);
    assert_eq!(
        (job.nodes, job.proc, job.max_proc_per_node),
        (2, Some(8), Some(4)),
        "bench-comm.sh: 2 nodes x 4 ranks"
    );
    assert_eq!((job.freq, job.eco_state), (Some(2200), Some(0)));
    assert!(
        job.sharedtmp_mib.unwrap_or(0) >= 256,
        "bench-comm.sh: --llio sharedtmp-size for llio_transfer"
    );
    assert_eq!(
        m["FUGU_RANKS_PER_NODE"], "4",
        "FUGU_RANKS_PER_NODE = max-proc-per-node"
    );
    for v in [
        "FUGU_COMM_ARGS",
        "FUGU_MPIEXEC_ARGS",
        "FUGU_OUT",
        "FUGU_WORKDIR",
    ] {
        assert!(m.contains_key(v), "pjsub/bench-comm.sh: setting {v}");
    }
    for needed in [
        "XOS_MMM_L_PAGING_POLICY=${XOS_MMM_L_PAGING_POLICY:-demand:demand:demand}",
        "PLE_MPI_STD_EMPTYFILE=${PLE_MPI_STD_EMPTYFILE:-off}",
        "mpiexec -n \"$ranks\" -ofout \"$tmp\"",
        "fugu_llio_purge \"$FUGU_BIN\"",
        "fugu_comm_publish",
    ] {
        assert!(s.contains(needed), "pjsub/bench-comm.sh lacks {needed}");
    }

    // Nothing opens or stats the binary before llio_transfer: in the job scripts the transfer
    // comes before the first check of FUGU_BIN and the first run of it.
    for name in ["train.sh", "bench-gemm.sh", "bench-comm.sh"] {
        let s = script(&format!("pjsub/{name}"));
        let body = &s[s.find("- the job").unwrap()..];
        let transfer = body.find("fugu_llio_transfer").unwrap();
        for later in [
            "fugu_require_bin",
            "fugu_setup_train",
            "\"$FUGU_BIN\" ",
            "fugu_bench_gemm_runs",
        ] {
            if let Some(at) = body.find(later) {
                assert!(
                    transfer < at,
                    "pjsub/{name}: {later} before fugu_llio_transfer"
                );
            }
        }
    }
}

#[test]
fn the_pjsub_lint_catches_mistakes() {
    let base = "#!/bin/bash\n#PJM -L \"node=2\"\n#PJM -L \"elapse=1:00:00\"\n";
    assert!(lint_pjm(base).is_ok());
    let bad = [
        ("#PJM -L \"node=0\"\n", "node"),
        ("#PJM -L \"elapse=1h\"\n", "elapse"),
        ("#PJM -L \"freq=2500\"\n", "freq"),
        ("#PJM -L \"freq=2200,eco_state=3\"\n", "eco_state"),
        ("#PJM --llio sharedtmp-size=1G\n", "sharedtmp-size"),
        ("#PJM --llio sharedtmp-size=100Gi\n", "87 GiB"),
        ("#PJM -L \"nodes=2\"\n", "unknown"),
        (
            "#PJM --mpi \"proc=9,max-proc-per-node=4\"\n",
            "does not fit",
        ),
        ("#PJM --mpi \"max-proc-per-node=64\"\n", "48 cores"),
        ("#PJM -x 1VAR=x\n", "variable name"),
        ("#PJM -x NOVALUE\n", "VAR=value"),
        ("#PJM --walltime 1:00\n", "unknown"),
        ("#PJM -L \"node=2\n", "quote"),
        ("#PJM -g\n", "needs a value"),
        ("echo hi\n#PJM -j\n", "after the first command"),
        ("#PJM--mpi proc=2\n", "not `#PJM <option>`"),
    ];
    for (extra, why) in bad {
        let e = lint_pjm(&format!("{base}{extra}")).expect_err(extra);
        assert!(e.contains(why), "`{extra}` gave `{e}`, expected `{why}`");
    }
    assert!(lint_pjm("#!/bin/bash\n#PJM -L \"elapse=10\"\n")
        .unwrap_err()
        .contains("node"));
    let shaped =
        lint_pjm("#PJM -L \"node=2x3x2:torus,elapse=60:00\"\n#PJM --mpi proc=48\n").unwrap();
    assert_eq!((shaped.nodes, shaped.elapse_s), (12, Some(3600)));
}

/// `#SBATCH --opt=value` / `#SBATCH --opt value` lines.
fn sbatch_directives(script: &str) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for line in script.lines() {
        if let Some(rest) = line.strip_prefix("#SBATCH") {
            let rest = rest.trim();
            let (k, v) = rest
                .split_once(['=', ' '])
                .unwrap_or_else(|| panic!("#SBATCH without a value: {line}"));
            assert!(k.starts_with("--"), "use long options: {line}");
            m.insert(k.to_string(), v.trim().to_string());
        }
    }
    m
}

#[test]
fn slurm_directives_match_the_a64fx_layout() {
    let s = script("slurm/train.sh");
    let d = sbatch_directives(&s);
    assert_eq!(d["--ntasks-per-node"], "4");
    assert_eq!(d["--cpus-per-task"], "12");
    let signal = &d["--signal"];
    assert!(
        signal.starts_with("B:USR1@"),
        "the batch shell must get the signal to forward it: {signal}"
    );
    assert!(s.contains("trap") || read(&jobscripts().join("lib/common.sh")).contains("trap"));
    let m = settings(&s);
    for v in [
        "FUGU_BIN",
        "FUGU_CONFIG",
        "FUGU_DATA",
        "FUGU_STEPS",
        "FUGU_TP",
        "FUGU_OUT",
        "FUGU_ZERO",
        "FUGU_PRECISION",
        "FUGU_MICRO_BATCHES",
        "FUGU_RECOMPUTE",
        "FUGU_LOSS_CHUNK",
        "FUGU_PP",
    ] {
        assert!(m.contains_key(v), "slurm/train.sh: setting {v}");
    }
    let d = sbatch_directives(&script("slurm/bench-gemm.sh"));
    assert_eq!(
        (d["--nodes"].as_str(), d["--cpus-per-task"].as_str()),
        ("1", "48")
    );
    // bench-comm.sh: 2 nodes x 4 ranks x 12 CPUs, given per node (no --ntasks), so that
    // `sbatch --nodes=N` scales the ranks with the nodes.
    let s = script("slurm/bench-comm.sh");
    let d = sbatch_directives(&s);
    assert_eq!(
        (
            d["--nodes"].as_str(),
            d["--ntasks-per-node"].as_str(),
            d["--cpus-per-task"].as_str()
        ),
        ("2", "4", "12"),
        "slurm/bench-comm.sh: 2 nodes x one rank per CMG"
    );
    assert!(!d.contains_key("--ntasks"), "slurm/bench-comm.sh: --ntasks");
    let m = settings(&s);
    for v in [
        "FUGU_BIN",
        "FUGU_COMM_ARGS",
        "FUGU_LAUNCHER",
        "FUGU_SRUN_ARGS",
        "FUGU_MPIRUN_ARGS",
        "FUGU_WORKDIR",
        "FUGU_OUT",
    ] {
        assert!(m.contains_key(v), "slurm/bench-comm.sh: setting {v}");
    }
    assert!(s.contains("fugu_comm_publish"), "slurm/bench-comm.sh");
    for name in [
        "train.sh",
        "bench-gemm.sh",
        "bench-comm.sh",
        "scaling-sweep.sh",
    ] {
        let s = script(&format!("slurm/{name}"));
        assert!(
            sbatch_directives(&s).contains_key("--time"),
            "slurm/{name}: --time"
        );
        assert!(
            s.contains("set -euo pipefail"),
            "slurm/{name}: set -euo pipefail"
        );
    }
}

// ------------------------------------------------------------------------ shell helpers

/// Runs `bash -c` with lib/common.sh sourced.
fn common_sh(code: &str, envs: &[(&str, &str)]) -> Output {
    Command::new("bash")
        .arg("-c")
        .arg(format!(
            "set -euo pipefail; . {}; {code}",
            jobscripts().join("lib/common.sh").display()
        ))
        .env_remove("FUGU_ELAPSE")
        .env_remove("PJM_ELAPSE_LIMIT")
        .env_remove("PJM_JOBID")
        .envs(envs.iter().copied())
        .output()
        .unwrap()
}

fn common_sh_ok(code: &str, envs: &[(&str, &str)]) -> String {
    let out = common_sh(code, envs);
    assert!(out.status.success(), "{code}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The summary table `pjstat` prints above its job list.
const PJSTAT_SUMMARY: &str =
    "  ACCEPT QUEUED  STGIN  READY RUNING RUNOUT STGOUT   HOLD  ERROR   TOTAL\n\
       0      0      0      0      1      0      0      0      0       1\n\
s      0      0      0      0      1      0      0      0      0       1\n\n";

fn chmod_x(p: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `pjstat`'s job list, English layout, as recorded in public tools that parse it (the header
/// names START_DATE once, the rows print it as two fields, or as "-" before the start, or in
/// parentheses with "<" for an estimated start). The ELAPSE_LIM column is found by name.
/// The Japanese layout is not covered: no public recording of it was found.
#[test]
fn pjstat_elapse_limit_is_read_by_column_name() {
    let header = "JOB_ID     JOB_NAME   MD ST  USER     START_DATE      ELAPSE_LIM NODE_REQUIRE    VNODE  CORE V_MEM";
    let rows = [
        ("43067", "43067      pjsub_test NM RUN goldsack 02/23 20:53:49  0024:00:00 -               1      1    4096 MiB", "0024:00:00"),
        ("112111", "112111     test.sh    NM RUN test     10/29 18:42:44  0001:00:00 1", "0001:00:00"),
        ("123", "123    J52df5c2a8 NM RUN a03116   -               0000:05:00 1", "0000:05:00"),
        ("123431", "123431 a.sh NM RNP q0903102 (03/12 11:05)< 0000:00:15 1 - - -", "0000:00:15"),
        ("24302383", "24302383   ito.sh     NM RUN p70486a  12/25 18:17:58< 0096:00:00 -               1      36   unlimited", "0096:00:00"),
        ("64856_1", "64856_1    sub_job1.s NM RUN user01   11/17 09:01:41  0000:30:00 2", "0000:30:00"),
    ];
    let mut listing = format!("{PJSTAT_SUMMARY}{header}\n");
    for (_, row, _) in rows {
        listing.push_str(row);
        listing.push('\n');
    }
    let dir = tmp("pjstat-layout");
    let f = dir.join("pjstat.txt");
    std::fs::write(&f, &listing).unwrap();
    for (id, _, lim) in rows {
        let got = common_sh_ok(
            &format!("fugu_pjstat_column ELAPSE_LIM {id} < {}", f.display()),
            &[],
        );
        assert_eq!(got, lim, "job {id}");
        // Not the start time of day that a header-position read gives.
        assert_ne!(got, "20:53:49");
    }
    let node = common_sh_ok(
        &format!("fugu_pjstat_column NODE_REQUIRE 112111 < {}", f.display()),
        &[],
    );
    assert_eq!(node, "1");
    let none = common_sh_ok(
        &format!("fugu_pjstat_column ELAPSE_LIM 999 < {}", f.display()),
        &[],
    );
    assert_eq!(none, "", "an unknown job");
}

#[test]
fn common_sh_helpers() {
    for (limit, unit, secs) in [
        ("1:00:00", "seconds", 3600),
        ("01:00:00", "seconds", 3600),
        ("60:00", "seconds", 3600),
        ("600", "seconds", 600),
        ("600", "minutes", 36000),
        ("0001:30:00", "seconds", 5400),
        ("1-00:00:00", "minutes", 86400),
        ("2-12", "minutes", 216000),
    ] {
        let got = common_sh_ok(&format!("fugu_parse_elapse {limit} {unit}"), &[]);
        assert_eq!(got, secs.to_string(), "{limit} ({unit})");
    }
    for bad in ["1h", "", "1:xx:00"] {
        assert!(!common_sh(&format!("fugu_parse_elapse '{bad}'"), &[])
            .status
            .success());
    }
    assert_eq!(common_sh_ok("fugu_rfc3339 0", &[]), "1970-01-01T00:00:00Z");

    // Where the pjsub job's elapse limit comes from, in order.
    let train = jobscripts().join("pjsub/train.sh");
    let t = train.display();
    let code = format!("fugu_pjm_elapse {t}; echo \"$FUGU_ELAPSE_S|$FUGU_ELAPSE_SRC\"");
    let from_script = common_sh_ok(&code, &[]);
    assert!(
        from_script.starts_with("3600|#PJM -L elapse=01:00:00"),
        "{from_script}"
    );
    let from_pjm = common_sh_ok(&code, &[("PJM_ELAPSE_LIMIT", "120")]);
    assert_eq!(
        from_pjm, "120|PJM_ELAPSE_LIMIT=120",
        "the optional override"
    );
    let from_user = common_sh_ok(
        &code,
        &[("FUGU_ELAPSE", "2:00:00"), ("PJM_ELAPSE_LIMIT", "120")],
    );
    assert_eq!(from_user, "7200|FUGU_ELAPSE=2:00:00");

    // pjstat in a job: a shorter limit than the #PJM line (given on the pjsub command line)
    // wins; a longer one does not (only FUGU_ELAPSE may lengthen the deadline).
    let fake = tmp("fake-pjstat");
    for (lim, want) in [
        (
            "0000:10:00",
            "600|pjstat ELAPSE_LIM=0000:10:00, shorter than",
        ),
        ("0006:00:00", "3600|#PJM -L elapse=01:00:00"),
    ] {
        let bin = fake.join(lim.replace(':', "-"));
        std::fs::create_dir_all(&bin).unwrap();
        let f = bin.join("pjstat");
        std::fs::write(
            &f,
            format!(
                "#!/bin/sh\n[ \"$1\" = 4242 ] || exit 1\ncat <<'X'\n{PJSTAT_SUMMARY}\
                 JOB_ID     JOB_NAME   MD ST  USER     START_DATE      ELAPSE_LIM NODE_REQUIRE    VNODE  CORE V_MEM\n\
                 4242       fugu-train NM RUN user01   11/17 09:01:41  {lim} 1               -      -    -\nX\n"
            ),
        )
        .unwrap();
        chmod_x(&f);
        let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap());
        let got = common_sh_ok(&code, &[("PJM_JOBID", "4242"), ("PATH", &path)]);
        assert!(got.starts_with(want), "pjstat {lim}: {got}");
        let off = common_sh_ok(
            &code,
            &[("PJM_JOBID", "4242"), ("PATH", &path), ("FUGU_PJSTAT", "0")],
        );
        assert!(off.starts_with("3600|#PJM"), "FUGU_PJSTAT=0: {off}");
    }

    // pjsub's answers: the id from the INFO line, a step sub-job, and `pjsub -z jid`.
    for (answer, id) in [
        ("[INFO] PJM 0000 pjsub Job 64856 submitted.", "64856"),
        (" [INFO.] PJM 0000 pjsub Job 64856_1 submitted.", "64856_1"),
        ("71080_0", "71080_0"),
        ("12345\n", "12345"),
        ("[ERR.] PJM 0049 pjsub Option argument is invalid.", ""),
    ] {
        let got = common_sh_ok(&format!("fugu_pjsub_jid {}", shell_quote(answer)), &[]);
        assert_eq!(got, id, "{answer}");
    }

    // The exit status a job reports: 4 when mpiexec lost the ranks' 4 but rank 0 recorded a
    // checkpointed stop in this job's part of metrics.jsonl.
    let run = tmp("reconcile");
    let m = run.join("metrics.jsonl");
    std::fs::write(&m, "{\"type\":\"event\",\"kind\":\"stopped\",\"step\":2}\n").unwrap();
    let mark = std::fs::metadata(&m).unwrap().len().to_string();
    let r = run.display().to_string();
    let rec = |rc: &str, mark: &str| {
        common_sh_ok(
            &format!("fugu_reconcile_exit {rc} {r} {mark} 2>/dev/null"),
            &[],
        )
    };
    assert_eq!(rec("1", "0"), "4", "a stop written in this job");
    assert_eq!(rec("1", &mark), "1", "the stop was an earlier job's");
    assert_eq!(rec("0", "0"), "0");
    assert_eq!(rec("137", "0"), "4");
    std::fs::write(
        &m,
        "{\"type\":\"event\",\"kind\":\"stopped\"}\n{\"type\":\"event\",\"kind\":\"end\"}\n",
    )
    .unwrap();
    assert_eq!(rec("1", "0"), "1", "an end event after the stop");

    // The power and LLIO options of the login-node scripts.
    assert_eq!(
        common_sh_ok(
            "fugu_pjm_power_args; echo \"${FUGU_PJM_POWER_ARGS[*]}\"",
            &[]
        ),
        "-L freq=2200,eco_state=0"
    );
    assert_eq!(
        common_sh_ok(
            "FUGU_ECO_STATE=2 fugu_pjm_power_args; echo \"${FUGU_PJM_POWER_ARGS[*]}\"",
            &[]
        ),
        "-L freq=2200,eco_state=2"
    );
    assert!(!common_sh("FUGU_ECO_STATE=on fugu_pjm_power_args", &[])
        .status
        .success());
    assert_eq!(
        common_sh_ok("fugu_pjm_llio_args; echo \"${FUGU_PJM_LLIO_ARGS[*]}\"", &[]),
        "--llio sharedtmp-size=1Gi"
    );
    let big = run.join("big.bin");
    std::fs::write(&big, vec![0u8; 3 << 20]).unwrap();
    let out = common_sh(
        &format!(
            "FUGU_LLIO_SHAREDTMP=4Mi fugu_check_llio_fits {}",
            big.display()
        ),
        &[],
    );
    assert!(
        !out.status.success() && text(&out).contains("at least 6Mi"),
        "{}",
        text(&out)
    );
    common_sh_ok(
        &format!(
            "FUGU_LLIO_SHAREDTMP=8Mi fugu_check_llio_fits {}",
            big.display()
        ),
        &[],
    );

    // Errors name the variable.
    let out = common_sh("FUGU_BIN=/nonexistent/fugu; fugu_require_bin", &[]);
    assert!(!out.status.success() && text(&out).contains("FUGU_BIN=/nonexistent/fugu"));
    let out = common_sh("FUGU_TP=two; fugu_require_uint FUGU_TP", &[]);
    assert!(!out.status.success() && text(&out).contains("FUGU_TP must be"));
    // FUGU_PP: passed on as --pp, named in the default run directory, checked against the ranks.
    let args = common_sh_ok(
        "FUGU_CONFIG=c FUGU_DATA=d FUGU_OUT=o FUGU_THREADS=1 FUGU_TP=2 FUGU_ZERO=0 FUGU_PP=2; \
         fugu_train_args; echo \"${FUGU_TRAIN_ARGS[*]}|$(fugu_pp_suffix)\"",
        &[],
    );
    assert!(
        args.contains("--tp 2 --pp 2") && args.trim_end().ends_with("|-pp2"),
        "{args}"
    );
    let args = common_sh_ok(
        "FUGU_CONFIG=c FUGU_DATA=d FUGU_OUT=o FUGU_THREADS=1 FUGU_TP=1 FUGU_ZERO=0 FUGU_PP=1; \
         fugu_train_args; echo \"${FUGU_TRAIN_ARGS[*]}|$(fugu_pp_suffix)\"",
        &[],
    );
    assert!(
        !args.contains("--pp") && args.trim_end().ends_with('|'),
        "{args}"
    );
    // FUGU_LOSS_CHUNK: passed on as --loss-chunk; 0 rows refused by name.
    let args = common_sh_ok(
        "FUGU_CONFIG=c FUGU_DATA=d FUGU_OUT=o FUGU_THREADS=1 FUGU_TP=1 FUGU_ZERO=0 FUGU_PP=1 \
         FUGU_LOSS_CHUNK=512; fugu_train_args; echo \"${FUGU_TRAIN_ARGS[*]}\"",
        &[],
    );
    assert!(args.contains("--loss-chunk 512"), "{args}");
    let out = common_sh(
        "FUGU_CONFIG=c FUGU_DATA=d FUGU_THREADS=1 FUGU_TP=1 FUGU_PP=1 FUGU_ZERO=0 FUGU_RANKS=1 \
         FUGU_AUTO_RESUBMIT=0 FUGU_RESUBMIT_MAX=0 FUGU_RESUBMIT_COUNT=0 FUGU_LOSS_CHUNK=0 \
         FUGU_BIN=/bin/true; fugu_setup_train",
        &[],
    );
    assert!(
        !out.status.success() && text(&out).contains("FUGU_LOSS_CHUNK must be at least 1"),
        "{}",
        text(&out)
    );

    // The comm benchmark's result is renamed into place only when it is one complete document;
    // anything else leaves neither the temporary file nor a result.
    let comm = tmp("comm-publish");
    let doc = "{\n  \"benchmark\": \"comm\",\n  \"ranks\": 2,\n  \"rows\": []\n}\n";
    for (name, body, ok) in [
        ("whole", doc, true),
        ("empty", "", false),
        ("cut", &doc[..doc.len() - 2], false),
        ("gemm", "{\n  \"benchmark\": \"gemm\"\n}\n", false),
        ("table", "# fugu bench comm: 2 ranks\nop bytes\n", false),
    ] {
        let t = comm.join(format!("{name}.tmp"));
        let f = comm.join(format!("{name}.json"));
        std::fs::write(&t, body).unwrap();
        let out = common_sh(
            &format!(
                "fugu_comm_publish {} {}",
                shell_quote(&t.display().to_string()),
                shell_quote(&f.display().to_string())
            ),
            &[],
        );
        assert_eq!(out.status.success(), ok, "{name}: {}", text(&out));
        assert!(!t.exists(), "{name}: the temporary file is left");
        assert_eq!(f.exists(), ok, "{name}");
        if ok {
            assert_eq!(read(&f), doc);
        } else {
            assert!(text(&out).contains("rank 0"), "{name}: {}", text(&out));
        }
    }

    // The settings file of a continuation keeps values with spaces, commas and quotes.
    let dir = tmp("envfile");
    let f = dir.join("env.sh");
    common_sh_ok(
        &format!(
            "FUGU_EXTRA_ARGS=\"--lr 1e-3 --set a,b 'q'\" FUGU_BENCH_SETS= fugu_write_env {} FUGU_EXTRA_ARGS FUGU_BENCH_SETS FUGU_UNSET_X",
            f.display()
        ),
        &[],
    );
    let back = Command::new("bash")
        .arg("-c")
        .arg(format!(
            ". {}; echo \"$FUGU_EXTRA_ARGS|${{FUGU_BENCH_SETS-unset}}|${{FUGU_UNSET_X-unset}}\"",
            f.display()
        ))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&back.stdout).trim(),
        "--lr 1e-3 --set a,b 'q'||unset"
    );
}

#[test]
fn job_scripts_fail_clearly_without_a_binary() {
    let dir = tmp("nobin");
    for (script, envs) in [
        ("pjsub/train.sh", vec![("PJM_MPI_PROC", "2")]),
        ("pjsub/bench-gemm.sh", vec![]),
        (
            "slurm/train.sh",
            vec![("SLURM_JOB_ID", "1"), ("SLURM_NTASKS", "2")],
        ),
        ("slurm/bench-gemm.sh", vec![("SLURM_JOB_ID", "1")]),
        ("pjsub/bench-comm.sh", vec![("PJM_MPI_PROC", "2")]),
        (
            "slurm/bench-comm.sh",
            vec![("SLURM_JOB_ID", "1"), ("SLURM_NTASKS", "2")],
        ),
    ] {
        let out = Command::new("bash")
            .arg(jobscripts().join(script))
            .current_dir(&dir)
            .env("FUGU_BIN", dir.join("no-such-fugu"))
            .envs(envs)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{script}: {}", text(&out));
        assert!(text(&out).contains("FUGU_BIN="), "{script}: {}", text(&out));
    }
    // The communication benchmark needs 2 ranks: a 1-rank job stops before launching anything.
    for (script, envs) in [
        ("pjsub/bench-comm.sh", vec![("PJM_MPI_PROC", "1")]),
        (
            "slurm/bench-comm.sh",
            vec![("SLURM_JOB_ID", "1"), ("SLURM_NTASKS", "1")],
        ),
    ] {
        let out = Command::new("bash")
            .arg(jobscripts().join(script))
            .current_dir(&dir)
            .env("FUGU_BIN", "/bin/true")
            .env("FUGU_LLIO_TRANSFER", "0")
            .envs(envs)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{script}: {}", text(&out));
        assert!(
            text(&out).contains("this job has 1"),
            "{script}: {}",
            text(&out)
        );
        assert!(!dir.join("bench").exists(), "{script}: made an output dir");
    }
}

// ------------------------------------------------------------------------ local pjsub

fn local_pjsub(dir: &Path, args: &[&str]) -> Output {
    Command::new(jobscripts().join("pjsub/local-pjsub.sh"))
        .args(args)
        .current_dir(dir)
        .env("LOCAL_PJSUB_DIR", dir.join("pjm-state"))
        .envs(OMPI_ENV)
        .output()
        .unwrap()
}

/// The job id from "[INFO] PJM 0000 pjsub Job 1001 submitted."
fn pjm_job_id(out: &Output) -> String {
    let s = String::from_utf8_lossy(&out.stdout);
    s.lines()
        .find_map(|l| l.split("pjsub Job ").nth(1)?.split(' ').next())
        .unwrap_or_else(|| panic!("no job id: {}", text(out)))
        .to_string()
}

#[test]
fn local_pjsub_stand_in() {
    let dir = tmp("pjm");
    let job = dir.join("job.sh");
    std::fs::write(
        &job,
        "#!/bin/bash\n#PJM -L \"node=2\"\n#PJM -L \"rscgrp=small,elapse=0:30\"\n\
         #PJM --mpi \"max-proc-per-node=4\"\n#PJM -g grp\n#PJM -x A=1\n#PJM -j\n#PJM -S\n\
         #PJM -L \"freq=2200,eco_state=0\"\n\
         echo \"proc=$PJM_MPI_PROC node=$PJM_NODE limit=${PJM_ELAPSE_LIMIT:-unset} a=$A b=${B:-} \
         home=${FUGU_NOT_PASSED:-none} wd=$PJM_O_WORKDIR\"\necho to-stderr >&2\n\
         command -v mpiexec llio_transfer pjsub pjstat pjwait | sed 's|.*/||'\npjstat \"$PJM_JOBID\"\nexit 7\n",
    )
    .unwrap();
    let out = local_pjsub(&dir, &["-x", "B=2", "--mpi", "proc=6", "job.sh"]);
    assert_eq!(out.status.code(), Some(7), "{}", text(&out));
    let id = pjm_job_id(&out);
    let log = read(&dir.join(format!("job.sh.{id}.out")));
    assert!(
        log.contains(&format!(
            "proc=6 node=2 limit=unset a=1 b=2 home=none wd={}",
            dir.display()
        )),
        "{log}"
    );
    assert!(
        log.contains("to-stderr") && log.contains("mpiexec\nllio_transfer\npjsub\npjstat\npjwait"),
        "{log}"
    );
    // The stand-in's pjstat: START_DATE as two fields under one header name.
    let lim = common_sh_ok(
        &format!(
            "fugu_pjstat_column ELAPSE_LIM {id} < {}",
            dir.join(format!("job.sh.{id}.out")).display()
        ),
        &[],
    );
    assert_eq!(lim, "0000:00:30", "{log}");
    let stats = read(&dir.join(format!("job.sh.{id}.stats")));
    assert!(stats.contains("PJM CODE          : 0") && stats.contains("EXIT CODE         : 7"));
    assert!(
        stats.contains("FREQ              : 2200") && stats.contains("ECO STATE         : 0"),
        "{stats}"
    );

    // Inconsistent resources are refused before anything runs, like pjsub does.
    let out = local_pjsub(&dir, &["--mpi", "proc=9", "job.sh"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out).contains("does not fit"), "{}", text(&out));
    let out = local_pjsub(&dir, &["--walltime", "5", "job.sh"]);
    assert!(
        text(&out).contains("unsupported pjsub option"),
        "{}",
        text(&out)
    );
    for (bad, why) in [
        (["-L", "eco_state=3"], "eco_state"),
        (["--llio", "sharedtmp-size=lots"], "sharedtmp-size"),
        (["-z", "all"], "-z jid"),
        (["--sparam", "jid=1"], "needs --step"),
    ] {
        let out = local_pjsub(&dir, &[bad[0], bad[1], "job.sh"]);
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {}", text(&out));
        assert!(text(&out).contains(why), "{bad:?}: {}", text(&out));
    }

    // The elapse limit is enforced: PJM code 11.
    std::fs::write(
        &job,
        "#!/bin/bash\n#PJM -L \"node=1,elapse=1\"\n#PJM -s\nsleep 30\n",
    )
    .unwrap();
    let t = Instant::now();
    let out = local_pjsub(&dir, &["job.sh"]);
    assert_eq!(out.status.code(), Some(124), "{}", text(&out));
    assert!(t.elapsed() < Duration::from_secs(20));
    let stats = read(&dir.join(format!("job.sh.{}.stats", pjm_job_id(&out))));
    assert!(stats.contains("PJM CODE          : 11"), "{stats}");
}

/// Step jobs in the stand-in: `pjsub -z jid` prints only the id; a sub-job whose `sd=`
/// condition holds on the previous sub-job's exit code is deleted, with every later one for
/// the deletion type `all`; llio_transfer needs the job's `--llio sharedtmp-size`.
#[test]
fn local_pjsub_step_jobs_sd_and_llio() {
    let dir = tmp("pjm-step");
    let job = dir.join("j.sh");
    std::fs::write(
        &job,
        "#!/bin/bash\n#PJM -L \"node=1,elapse=0:30\"\n#PJM -S\n\
         echo \"ran $PJM_JOBID\" >>ran.txt\nexit \"${RC:-0}\"\n",
    )
    .unwrap();
    let first = local_pjsub(&dir, &["-z", "jid", "--step", "-x", "RC=4", "j.sh"]);
    assert_eq!(first.status.code(), Some(4), "{}", text(&first));
    let id = String::from_utf8_lossy(&first.stdout).trim().to_string();
    let base = id
        .strip_suffix("_0")
        .unwrap_or_else(|| panic!("-z jid printed `{id}`"));
    let sub = |sn: u32, rc: &str| {
        let sparam = format!("jid={base},sn={sn},sd=ec!=4:all:{}", sn - 1);
        let rcv = format!("RC={rc}");
        local_pjsub(
            &dir,
            &[
                "-z", "jid", "--step", "--sparam", &sparam, "-x", &rcv, "j.sh",
            ],
        )
    };
    // 4 -> the next one runs; it exits 0 -> the ones after it are deleted.
    for (sn, rc) in [(1, "0"), (2, "4"), (3, "4")] {
        let out = sub(sn, rc);
        assert!(out.status.success(), "{}", text(&out));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("{base}_{sn}")
        );
    }
    assert_eq!(
        read(&dir.join("ran.txt")),
        format!("ran {base}_0\nran {base}_1\n")
    );
    let stats = read(&dir.join(format!("j.sh.{base}_2.stats")));
    assert!(
        stats.contains("DELETED") && stats.contains("ec of"),
        "{stats}"
    );
    assert!(read(&dir.join(format!("j.sh.{base}_3.stats"))).contains("DELETED"));
    // A malformed dependency is refused.
    let out = local_pjsub(
        &dir,
        &[
            "--step",
            "--sparam",
            &format!("jid={base},sd=ec=4:all"),
            "j.sh",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));

    // llio_transfer: fits in sharedtmp-size x nodes, or LLIO 2450.
    std::fs::write(dir.join("blob"), vec![0u8; 2 << 20]).unwrap();
    std::fs::write(
        &job,
        "#!/bin/bash\n#PJM -L \"node=1,elapse=0:30\"\nllio_transfer blob\n",
    )
    .unwrap();
    let out = local_pjsub(&dir, &["j.sh"]);
    assert_eq!(out.status.code(), Some(1), "no sharedtmp: {}", text(&out));
    let id = pjm_job_id(&out);
    assert!(read(&dir.join(format!("j.sh.{id}.err"))).contains("LLIO 2450"));
    let out = local_pjsub(&dir, &["--llio", "sharedtmp-size=4Mi", "j.sh"]);
    assert!(out.status.success(), "{}", text(&out));
}

/// The pjsub GEMM job: one file per THREADS:CMGS run, each row a benchmark result.
#[test]
fn pjsub_bench_gemm_under_local_pjsub() {
    let dir = tmp("pjm-gemm");
    let bin = jobs_bin();
    let home = format!("FUGU_HOME={}", repo().display());
    let fbin = format!("FUGU_BIN={}", bin.display());
    let out = local_pjsub(
        &dir,
        &[
            "-x",
            &home,
            "-x",
            &fbin,
            "-x",
            "FUGU_OUT=gemm",
            "-x",
            "FUGU_BENCH_RUNS=1:1 2:2",
            "-x",
            "FUGU_BENCH_SETS=",
            "-x",
            "FUGU_BENCH_ARGS=--shape 64x64x64 --shape 32x48x16 --budget 0.02 --no-baseline",
            "-x",
            "FUGU_NUMA_NODES=0",
            &jobscripts()
                .join("pjsub/bench-gemm.sh")
                .display()
                .to_string(),
        ],
    );
    let id = pjm_job_id(&out);
    let log = read(&dir.join(format!("fugu-bench-gemm.{id}.out")));
    assert!(out.status.success(), "{}\n{log}", text(&out));
    assert!(log.contains("llio_transfer"), "{log}");
    for (threads, cmgs) in [(1, 1), (2, 2)] {
        let rows = jsonl_rows(&dir.join(format!("gemm/gemm-t{threads}-c{cmgs}.jsonl")));
        assert_eq!(rows.len(), 2, "two shapes");
        for r in rows {
            assert_eq!(r["threads"].as_u64(), Some(threads), "{r}");
            assert_eq!(r["domains"].as_u64(), Some(cmgs), "{r}");
            assert!(r["gflops"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
}

/// The five operations of `fugu bench comm`.
const COMM_OPS: [&str; 5] = [
    "allreduce",
    "reduce-scatter",
    "allgather",
    "broadcast",
    "sendrecv",
];

/// The `fugu bench comm` arguments of the test jobs: a few small sizes, one sample each.
const COMM_TEST_ARGS: &str = "--max-size 4KiB --repeats 1";

/// A comm benchmark result: one JSON document of `ranks` ranks on one node, with rows for every
/// operation.
fn assert_comm_result(p: &Path, ranks: u64) {
    let doc: Value = serde_json::from_str(&read(p))
        .unwrap_or_else(|e| panic!("{}: not one JSON document: {e}", p.display()));
    assert_eq!(doc["benchmark"], "comm", "{doc}");
    assert_eq!(doc["ranks"].as_u64(), Some(ranks), "{}", p.display());
    assert_eq!(doc["nodes"].as_u64(), Some(1), "{}", p.display());
    let rows = doc["rows"].as_array().expect("rows");
    for op in COMM_OPS {
        let mine: Vec<&Value> = rows.iter().filter(|r| r["op"] == op).collect();
        assert!(!mine.is_empty(), "no {op} rows in {}", p.display());
        for r in mine {
            assert_eq!(r["ranks"].as_u64(), Some(ranks), "{r}");
            assert!(r["bytes"].as_u64().unwrap() <= 4096, "{r}");
            assert!(r["time_us"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
    // Only the result in the folder: no temporary file left behind.
    let dir = p.parent().unwrap();
    let names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 1, "{}: {names:?}", dir.display());
}

/// Whether 2-rank MPI jobs can run here: mpirun, and a fugu built with MPI (this test build
/// with `--features mpi`, as scripts/test.sh builds it, or FUGU_JOBS_BIN).
fn mpi_jobs(test: &str) -> bool {
    if !have("mpirun") {
        skipped(&format!("{test} (mpirun not installed)"));
        return false;
    }
    if !cfg!(feature = "mpi") && std::env::var_os("FUGU_JOBS_BIN").is_none() {
        skipped(&format!(
            "{test} (this fugu is built without MPI: run with --features mpi or set FUGU_JOBS_BIN)"
        ));
        return false;
    }
    true
}

/// The pjsub communication benchmark with 2 ranks: mpiexec -ofout collects rank 0's JSON, which
/// lands in bench/comm-JOBID/comm-1n2r.json.
#[test]
fn pjsub_bench_comm_under_local_pjsub() {
    if !mpi_jobs("pjsub_bench_comm_under_local_pjsub") {
        return;
    }
    let dir = tmp("pjm-comm");
    let home = format!("FUGU_HOME={}", repo().display());
    let fbin = format!("FUGU_BIN={}", jobs_bin().display());
    // FUGU_COMM_ARGS through a settings file, as docs/JOBS.md says (-x cannot carry spaces).
    let envfile = dir.join("comm.env");
    std::fs::write(
        &envfile,
        format!("export FUGU_COMM_ARGS={}\n", shell_quote(COMM_TEST_ARGS)),
    )
    .unwrap();
    let cargs = format!("FUGU_ENV_FILE={}", envfile.display());
    let out = local_pjsub(
        &dir,
        &[
            "-L",
            "node=1",
            "--mpi",
            "proc=2",
            "-x",
            &home,
            "-x",
            &fbin,
            "-x",
            &cargs,
            &jobscripts()
                .join("pjsub/bench-comm.sh")
                .display()
                .to_string(),
        ],
    );
    let id = pjm_job_id(&out);
    let log = read(&dir.join(format!("fugu-bench-comm.{id}.out")));
    assert!(out.status.success(), "{}\n{log}", text(&out));
    assert!(
        log.contains("llio_transfer")
            && log.contains("mpiexec -n 2 -ofout")
            && log.contains(COMM_TEST_ARGS),
        "{log}"
    );
    let file = dir.join(format!("bench/comm-{id}/comm-1n2r.json"));
    assert!(log.contains(&format!("wrote {}", file.display())), "{log}");
    assert_comm_result(&file, 2);
}

/// A 2-rank tiny training as a pjsub job: mpiexec -> mpirun, PJM_* variables, deadline.
#[test]
fn pjsub_train_two_ranks_under_local_pjsub() {
    if !gated("pjsub_train_two_ranks_under_local_pjsub") {
        return;
    }
    let dir = tmp("pjm-train");
    let mut args: Vec<String> = vec![
        "-L".into(),
        "node=1".into(),
        "--mpi".into(),
        "proc=2".into(),
    ];
    let mut env = tiny_train_env(6);
    env.push(("FUGU_HOME".into(), repo().display().to_string()));
    env.push(("FUGU_BIN".into(), jobs_bin().display().to_string()));
    env.push(("FUGU_DATA".into(), corpus().display().to_string()));
    env.push(("FUGU_CKPT_EVERY".into(), "3".into()));
    for (k, v) in env {
        args.extend(["-x".into(), format!("{k}={v}")]);
    }
    args.push(jobscripts().join("pjsub/train.sh").display().to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = local_pjsub(&dir, &args);
    let id = pjm_job_id(&out);
    let log = read(&dir.join(format!("fugu-train.{id}.out")));
    assert!(out.status.success(), "{}\n{log}", text(&out));
    assert!(
        log.contains("--deadline") && log.contains("--resume auto"),
        "{log}"
    );
    let run = dir.join("runs/gpt2-tiny-n2-tp1");
    let m = metrics(&run);
    assert_world(&m, 2);
    assert_eq!(steps(&m), (1..=6).collect::<Vec<_>>());
    assert!(run.join("ckpt-00000006/state.json").exists());
    assert!(read(&run.join("jobs.log")).contains(&format!("pjsub job {id} exit 0")));
}

/// pjsub has no pre-timeout signal: the job's deadline (start + elapse - margin) makes the
/// trainer checkpoint and exit 4, and the continuation it submits resumes from there.
#[test]
fn pjsub_deadline_checkpoints_and_the_continuation_resumes() {
    if !gated("pjsub_deadline_checkpoints_and_the_continuation_resumes") {
        return;
    }
    let dir = tmp("pjm-deadline");
    let mut args: Vec<String> = ["-L", "node=1,elapse=40", "--mpi", "proc=2"]
        .map(String::from)
        .to_vec();
    let mut env = tiny_train_env(100_000);
    env.extend(
        [
            ("FUGU_HOME", repo().display().to_string()),
            ("FUGU_BIN", jobs_bin().display().to_string()),
            ("FUGU_DATA", corpus().display().to_string()),
            ("FUGU_CKPT_EVERY", "0".into()),
            ("FUGU_DEADLINE_MARGIN", "32".into()),
            ("FUGU_AUTO_RESUBMIT", "1".into()),
            ("FUGU_RESUBMIT_MAX", "1".into()),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    for (k, v) in env {
        args.extend(["-x".into(), format!("{k}={v}")]);
    }
    args.push(jobscripts().join("pjsub/train.sh").display().to_string());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = local_pjsub(&dir, &args);
    let id = pjm_job_id(&out);
    let log = read(&dir.join(format!("fugu-train.{id}.out")));
    assert_eq!(out.status.code(), Some(4), "{}\n{log}", text(&out));
    // The elapse was given on the command line only: pjstat's ELAPSE_LIM (shorter than the
    // script's #PJM line) set the deadline.
    assert!(log.contains("pjstat ELAPSE_LIM=0000:00:40"), "{log}");
    assert!(log.contains("resubmitted as job"), "{log}");
    assert_continued(&dir.join("runs/gpt2-tiny-n2-tp1"), 2);
}

/// The pjsub scaling sweep, submitted from the "login node" through the stand-in's `pjsub`:
/// one step job of a 2-rank training, the GEMM benchmark and the report, in that order.
#[test]
fn pjsub_sweep_under_local_pjsub() {
    if !gated("pjsub_sweep_under_local_pjsub") {
        return;
    }
    let dir = tmp("pjm-sweep");
    let state = dir.join("pjm-state");
    let out = Command::new(jobscripts().join("pjsub/local-pjsub.sh"))
        .arg("--install-shims")
        .env("LOCAL_PJSUB_DIR", &state)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let shims = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let path = format!("{shims}:{}", std::env::var("PATH").unwrap_or_default());
    let mut env = tiny_train_env(4);
    env.extend(
        [
            ("FUGU_HOME", repo().display().to_string()),
            ("FUGU_BIN", jobs_bin().display().to_string()),
            ("FUGU_DATA", corpus().display().to_string()),
            ("FUGU_GROUP", "testgrp".into()),
            ("FUGU_SWEEP", "1x2".into()),
            ("FUGU_ELAPSE", "10:00".into()),
            ("FUGU_SWEEP_DIR", "sweep".into()),
            ("FUGU_BENCH_RUNS", "1:1".into()),
            ("FUGU_BENCH_SETS", String::new()),
            (
                "FUGU_BENCH_ARGS",
                "--shape 64x64x64 --budget 0.02 --no-baseline".into(),
            ),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    let out = Command::new(jobscripts().join("pjsub/scaling-sweep.sh"))
        .current_dir(&dir)
        .env("PATH", path)
        .env("LOCAL_PJSUB_DIR", &state)
        .envs(OMPI_ENV)
        .envs(env)
        .output()
        .unwrap();
    let logs: String = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "out"))
        .map(|p| read(&p))
        .collect::<Vec<_>>()
        .join("\n-----\n");
    assert!(
        out.status.success(),
        "scaling-sweep.sh: {}\n{logs}",
        text(&out)
    );
    let sweep = dir.join("sweep");
    let jobs = read(&sweep.join("jobs.txt"));
    let ids: Vec<&str> = jobs
        .lines()
        .map(|l| l.split_whitespace().nth(2).unwrap())
        .collect();
    assert_eq!(ids.len(), 3, "{jobs}");
    // One step job: the same job id, sub-jobs 0, 1, 2.
    let base = ids[0].split('_').next().unwrap();
    assert_eq!(
        ids,
        [
            format!("{base}_0"),
            format!("{base}_1"),
            format!("{base}_2")
        ]
    );
    assert!(sweep.join("runs/N1-n2/metrics.jsonl").exists(), "{logs}");
    let m = metrics(&sweep.join("runs/N1-n2"));
    assert_world(&m, 2);
    assert_eq!(steps(&m), vec![1, 2, 3, 4]);
    assert!(
        !jsonl_rows(&sweep.join("gemm/gemm-t1-c1.jsonl")).is_empty(),
        "{logs}"
    );
    assert!(sweep.join("report/REPORT.md").exists(), "{logs}");
}

/// The stand-in's shim folder (pjsub, pjstat, pjwait, ...) first in PATH, for login-node scripts.
fn shim_path(state: &Path) -> String {
    let out = Command::new(jobscripts().join("pjsub/local-pjsub.sh"))
        .arg("--install-shims")
        .env("LOCAL_PJSUB_DIR", state)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let shims = String::from_utf8_lossy(&out.stdout).trim().to_string();
    format!("{shims}:{}", std::env::var("PATH").unwrap_or_default())
}

/// A stand-in for `fugu` that exits with the codes listed in LOCAL_PJSUB_FAKE_DIR/codes, one
/// per run; `stopN` writes a "stopped" event to metrics.jsonl and exits N (a launcher that
/// loses the ranks' exit code 4).
fn fake_fugu(dir: &Path, codes: &[&str]) -> PathBuf {
    std::fs::write(dir.join("codes"), codes.join("\n") + "\n").unwrap();
    let f = dir.join("fake-fugu");
    std::fs::write(
        &f,
        r#"#!/bin/bash
d=$LOCAL_PJSUB_FAKE_DIR
out=; prev=
for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
n=$(cat "$d/n" 2>/dev/null || echo 0); echo $((n + 1)) >"$d/n"
code=$(sed -n "$((n + 1))p" "$d/codes")
echo "run $n job $PJM_JOBID code $code: $*" >>"$d/runs"
case "$code" in
  stop*) echo '{"type":"event","kind":"stopped","step":3}' >>"$out/metrics.jsonl"; exit "${code#stop}" ;;
esac
exit "${code:-0}"
"#,
    )
    .unwrap();
    chmod_x(&f);
    f
}

fn run_chain(dir: &Path, mode: &str, jobs: u32, env: &[(String, String)]) -> Output {
    let state = dir.join("pjm-state");
    Command::new(jobscripts().join("pjsub/chain.sh"))
        .current_dir(dir)
        .env("PATH", shim_path(&state))
        .env("LOCAL_PJSUB_DIR", &state)
        .env("LOCAL_PJSUB_FAKE_DIR", dir)
        .envs(OMPI_ENV)
        .env("FUGU_HOME", repo())
        .env("FUGU_GROUP", "testgrp")
        .env("FUGU_CHAIN_MODE", mode)
        .env("FUGU_CHAIN_JOBS", jobs.to_string())
        .envs(env.iter().cloned())
        .output()
        .unwrap()
}

/// `jobs.log` lines "pjsub job ID exit RC" -> (ID, RC).
fn job_exits(run: &Path) -> Vec<(String, String)> {
    read(&run.join("jobs.log"))
        .lines()
        .filter_map(|l| {
            let rest = l.split("pjsub job ").nth(1)?;
            let (id, rc) = rest.split_once(" exit ")?;
            Some((id.to_string(), rc.trim().to_string()))
        })
        .collect()
}

fn fake_chain_env(dir: &Path, codes: &[&str]) -> Vec<(String, String)> {
    [
        ("FUGU_BIN", fake_fugu(dir, codes).display().to_string()),
        ("FUGU_DATA", "data.bin".into()),
        ("FUGU_CONFIG", "gpt2-tiny".into()),
        ("FUGU_NODES", "1".into()),
        ("FUGU_RANKS_PER_NODE", "1".into()),
        ("FUGU_THREADS", "1".into()),
        ("FUGU_ELAPSE", "5:00".into()),
        ("FUGU_OUT", "run".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// chain.sh in step mode: one step job; exit 4 lets the next sub-job run, exit 0 deletes the
/// rest (PJM's `sd=ec!=4:all:K-1`, as the stand-in models it).
#[test]
fn pjsub_chain_step_job_continues_on_4_and_stops_on_0() {
    if !gated("pjsub_chain_step_job_continues_on_4_and_stops_on_0") {
        return;
    }
    let dir = tmp("pjm-chain-step");
    let env = fake_chain_env(&dir, &["4", "0", "4", "4"]);
    let out = run_chain(&dir, "step", 4, &env);
    assert!(out.status.success(), "chain.sh: {}", text(&out));
    let run = dir.join("run");
    let chain = read(&run.join("chain.txt"));
    let ids: Vec<&str> = chain
        .lines()
        .map(|l| l.split_whitespace().nth(2).unwrap())
        .collect();
    assert_eq!(ids.len(), 4, "{chain}");
    let base = ids[0].strip_suffix("_0").unwrap();
    let exits = job_exits(&run);
    assert_eq!(
        exits,
        [
            (format!("{base}_0"), "4".to_string()),
            (format!("{base}_1"), "0".to_string())
        ],
        "{}",
        read(&dir.join("runs"))
    );
    for k in [2, 3] {
        let stats = read(&dir.join(format!("fugu-train.{base}_{k}.stats")));
        assert!(stats.contains("DELETED"), "{stats}");
    }
    let log0 = read(&dir.join(format!("fugu-train.{base}_0.out")));
    assert!(log0.contains("FUGU_ELAPSE=5:00"), "{log0}");
    let stats0 = read(&dir.join(format!("fugu-train.{base}_0.stats")));
    assert!(stats0.contains("ECO STATE         : 0"), "{stats0}");
}

/// chain.sh in wait mode: pjsub -z jid, pjwait, the exit code from jobs.log; a launcher that
/// returns 1 after rank 0 recorded a checkpointed stop still continues the chain.
#[test]
fn pjsub_chain_wait_mode_reads_exit_codes() {
    if !gated("pjsub_chain_wait_mode_reads_exit_codes") {
        return;
    }
    let dir = tmp("pjm-chain-wait");
    let env = fake_chain_env(&dir, &["stop1", "4", "0"]);
    let out = run_chain(&dir, "wait", 5, &env);
    assert!(out.status.success(), "chain.sh: {}", text(&out));
    let exits = job_exits(&dir.join("run"));
    let codes: Vec<&str> = exits.iter().map(|e| e.1.as_str()).collect();
    assert_eq!(codes, ["4", "4", "0"], "{exits:?}");
    assert!(text(&out).contains("chain done"), "{}", text(&out));

    // An error stops the chain with its code.
    let dir = tmp("pjm-chain-wait-err");
    let env = fake_chain_env(&dir, &["4", "7", "0"]);
    let out = run_chain(&dir, "wait", 5, &env);
    assert_eq!(out.status.code(), Some(7), "chain.sh: {}", text(&out));
    assert_eq!(job_exits(&dir.join("run")).len(), 2);
}

/// A real 2-rank training as a step-job chain: the first sub-job stops at its deadline with a
/// checkpoint (exit 4), the second resumes from it.
#[test]
fn pjsub_chain_resumes_a_real_training() {
    if !gated("pjsub_chain_resumes_a_real_training") {
        return;
    }
    let dir = tmp("pjm-chain-train");
    let mut env = tiny_train_env(100_000);
    env.extend(
        [
            ("FUGU_BIN", jobs_bin().display().to_string()),
            ("FUGU_DATA", corpus().display().to_string()),
            ("FUGU_CKPT_EVERY", "0".into()),
            ("FUGU_DEADLINE_MARGIN", "32".into()),
            ("FUGU_ELAPSE", "40".into()),
            ("FUGU_NODES", "1".into()),
            ("FUGU_RANKS_PER_NODE", "2".into()),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    let out = run_chain(&dir, "step", 2, &env);
    let run = dir.join("runs/gpt2-tiny-n2-tp1");
    let logs: String = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "out"))
        .map(|p| read(&p))
        .collect::<Vec<_>>()
        .join("\n-----\n");
    assert!(out.status.success(), "chain.sh: {}\n{logs}", text(&out));
    let codes: Vec<String> = job_exits(&run).into_iter().map(|e| e.1).collect();
    assert_eq!(codes, ["4", "4"], "{logs}");
    assert_continued(&run, 2);
}

/// A run stopped by its deadline or signal and continued by the next job: the second
/// header starts at the last checkpoint of the first job, and the steps go on from there.
fn assert_continued(run: &Path, world: u64) {
    let m = metrics(run);
    assert_world(&m, world);
    let mut part = 0;
    let mut last_ckpt_of_first = None;
    let mut first_steps = Vec::new();
    let mut second_steps = Vec::new();
    let mut second_start = None;
    for r in &m {
        match r {
            Record::Header(h) => {
                part += 1;
                if part == 2 {
                    second_start = h["start_step"].as_u64();
                }
            }
            Record::Event { kind, data } if kind == "checkpoint" && part == 1 => {
                last_ckpt_of_first = data["step"].as_u64();
            }
            Record::Step(s) if part == 1 => first_steps.push(s.step),
            Record::Step(s) if part == 2 => second_steps.push(s.step),
            _ => {}
        }
    }
    assert!(part >= 2, "the continuation wrote no header");
    let k = last_ckpt_of_first.expect("the first job wrote no checkpoint before stopping");
    assert!(k >= 1, "checkpoint at step {k}");
    assert_eq!(second_start, Some(k), "the continuation resumed elsewhere");
    assert_eq!(
        second_steps.first(),
        Some(&(k + 1)),
        "steps after resuming: {second_steps:?}"
    );
    assert!(
        first_steps.iter().all(|&s| s <= k),
        "{first_steps:?} vs checkpoint {k}"
    );
}

// ------------------------------------------------------------------------------ Slurm

/// Starts (or finds) the local Slurm and returns the environment its clients need.
fn slurm_env() -> Vec<(String, String)> {
    static ENV: OnceLock<Vec<(String, String)>> = OnceLock::new();
    ENV.get_or_init(|| {
        let state = std::env::var("LOCAL_SLURM_DIR").unwrap_or("/tmp/fugu-test-slurm".into());
        // 2 cores here: 4 CPUs let a 2-rank job and the GEMM job run side by side.
        let cpus = std::env::var("LOCAL_SLURM_CPUS").unwrap_or("4".into());
        let out = Command::new(jobscripts().join("local-slurm.sh"))
            .arg("start")
            .env("LOCAL_SLURM_DIR", &state)
            .env("LOCAL_SLURM_CPUS", &cpus)
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        assert!(out.status.success(), "local-slurm.sh start failed");
        let mut env: Vec<(String, String)> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix("export ")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        env.push(("LOCAL_SLURM_DIR".into(), state));
        env.push(("LOCAL_SLURM_CPUS".into(), cpus));
        env
    })
    .clone()
}

fn sbatch(dir: &Path, args: &[&str], env: &[(String, String)]) -> String {
    let out = Command::new("sbatch")
        .arg("--parsable")
        .args(args)
        .current_dir(dir)
        .envs(slurm_env())
        .envs(env.iter().cloned())
        .output()
        .unwrap();
    assert!(out.status.success(), "sbatch {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .split(';')
        .next()
        .unwrap()
        .to_string()
}

/// Waits for a job to end; returns (state, exit code).
fn wait_job(jid: &str, secs: u64) -> (String, i32) {
    let out = Command::new(jobscripts().join("local-slurm.sh"))
        .args(["wait", jid, &secs.to_string()])
        .envs(slurm_env())
        .output()
        .unwrap();
    let s = String::from_utf8_lossy(&out.stdout);
    let f: Vec<&str> = s.split_whitespace().collect();
    assert!(
        f.len() == 3 && f[0] == jid,
        "local-slurm.sh wait {jid}: {}",
        text(&out)
    );
    assert_ne!(f[2], "timeout", "job {jid} still {} after {secs} s", f[1]);
    let code = f[2].split(':').next().unwrap().parse().unwrap_or(-1);
    (f[1].to_string(), code)
}

/// A single-rank training job through sbatch: finds lib/common.sh from Slurm's copy of the
/// script, stages the bundled corpus itself, trains, and records the job in jobs.log.
#[test]
fn slurm_single_rank_train_job() {
    if !gated("slurm_single_rank_train_job") {
        return;
    }
    let dir = tmp("slurm-one");
    let mut env = tiny_train_env(4);
    env.push(("FUGU_BIN".into(), jobs_bin().display().to_string()));
    let jid = sbatch(
        &dir,
        &[
            "--ntasks=1",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            "--output=%x-%j.out",
            &jobscripts().join("slurm/train.sh").display().to_string(),
        ],
        &env,
    );
    let (state, code) = wait_job(&jid, 180);
    let log = read(&dir.join(format!("fugu-train-{jid}.out")));
    assert_eq!((state.as_str(), code), ("COMPLETED", 0), "{log}");
    assert!(dir.join("data/shakespeare/manifest.json").exists(), "{log}");
    let run = dir.join("runs/gpt2-tiny-n1-tp1");
    assert_eq!(steps(&metrics(&run)), vec![1, 2, 3, 4]);
    assert!(run.join("ckpt-00000004/state.json").exists());
    let jobs = read(&run.join("jobs.log"));
    assert!(jobs.contains(&format!("slurm job {jid} exit 0")), "{jobs}");
}

/// bench-comm.sh with 2 ranks on the one node, through srun (the default) and mpirun: each job
/// writes FUGU_OUT/comm-1n2r.json, one JSON document with rows for every operation.
#[test]
fn slurm_bench_comm_job() {
    if !gated("slurm_bench_comm_job") {
        return;
    }
    let dir = tmp("slurm-comm");
    for launcher in ["srun", "mpirun"] {
        let env: Vec<(String, String)> = [
            ("FUGU_BIN", jobs_bin().display().to_string()),
            ("FUGU_COMM_ARGS", COMM_TEST_ARGS.to_string()),
            ("FUGU_LAUNCHER", launcher.to_string()),
            ("FUGU_OUT", format!("comm-{launcher}")),
        ]
        .map(|(k, v)| (k.to_string(), v))
        .into();
        let jid = sbatch(
            &dir,
            &[
                "--nodes=1",
                "--ntasks-per-node=2",
                "--cpus-per-task=1",
                "--time=5",
                "--output=%x-%j.out",
                &jobscripts()
                    .join("slurm/bench-comm.sh")
                    .display()
                    .to_string(),
            ],
            &env,
        );
        let (state, code) = wait_job(&jid, 180);
        let log = read(&dir.join(format!("fugu-bench-comm-{jid}.out")));
        assert_eq!(
            (state.as_str(), code),
            ("COMPLETED", 0),
            "{launcher}: {log}"
        );
        assert!(log.contains(&format!("{launcher} -")), "{launcher}: {log}");
        assert_comm_result(&dir.join(format!("comm-{launcher}/comm-1n2r.json")), 2);
    }
}

/// scaling-sweep.sh: a 2-rank training (srun), a GEMM benchmark and a report job that runs
/// after both (afterok), all completed with their files.
#[test]
fn slurm_sweep_trains_benchmarks_and_reports() {
    if !gated("slurm_sweep_trains_benchmarks_and_reports") {
        return;
    }
    let dir = tmp("slurm-sweep");
    let mut env = tiny_train_env(6);
    env.extend(
        [
            ("FUGU_BIN", jobs_bin().display().to_string()),
            ("FUGU_DATA", corpus().display().to_string()),
            ("FUGU_SWEEP", "1x2".into()),
            ("FUGU_TIME", "10".into()),
            ("FUGU_SWEEP_DIR", "sweep".into()),
            ("FUGU_BENCH_RUNS", "1:1 2:2".into()),
            ("FUGU_BENCH_CPUS", "2".into()),
            ("FUGU_BENCH_SETS", String::new()),
            (
                "FUGU_BENCH_ARGS",
                "--shape 64x64x64 --budget 0.02 --no-baseline".into(),
            ),
            ("FUGU_SBATCH_ARGS", "--cpus-per-task=1".into()),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    let out = Command::new(jobscripts().join("slurm/scaling-sweep.sh"))
        .current_dir(&dir)
        .envs(slurm_env())
        .envs(env)
        .output()
        .unwrap();
    assert!(out.status.success(), "scaling-sweep.sh: {}", text(&out));
    let sweep = dir.join("sweep");
    let jobs: Vec<(String, String, String)> = read(&sweep.join("jobs.txt"))
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].to_string(), f[1].to_string(), f[2].to_string())
        })
        .collect();
    let kinds: Vec<&str> = jobs.iter().map(|j| j.0.as_str()).collect();
    assert_eq!(kinds, ["train", "gemm", "report"]);
    for (kind, name, jid) in &jobs {
        let (state, code) = wait_job(jid, 240);
        let logs: Vec<String> = std::fs::read_dir(sweep.join("logs"))
            .unwrap()
            .map(|e| read(&e.unwrap().path()))
            .collect();
        assert_eq!(
            (state.as_str(), code),
            ("COMPLETED", 0),
            "{kind} {name} (job {jid}):\n{}",
            logs.join("\n-----\n")
        );
    }
    let m = metrics(&sweep.join("runs/N1-n2"));
    assert_world(&m, 2);
    assert_eq!(steps(&m), (1..=6).collect::<Vec<_>>());
    for f in ["gemm-t1-c1.jsonl", "gemm-t2-c2.jsonl"] {
        assert!(!jsonl_rows(&sweep.join("gemm").join(f)).is_empty(), "{f}");
    }
    let report = sweep.join("report");
    assert!(read(&report.join("REPORT.md")).contains('#'));
    let svgs = std::fs::read_dir(&report)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "svg")
        })
        .count();
    assert!(svgs >= 1, "no SVG chart in {}", report.display());
}

/// The stop path through mpirun: SIGTERM to the batch shell (what Slurm sends at the limit, or
/// `scancel`) reaches both ranks as SIGUSR1 (the script converts it: on SIGTERM Open MPI's
/// mpirun ends the job itself with exit 1), and they checkpoint and exit 4; the job resubmits
/// itself and the continuation resumes at the checkpointed step and finishes. SIGUSR1 (what
/// `--signal=B:USR1@120` sends) takes the same path from the forward on.
#[test]
fn slurm_sigterm_reaches_the_ranks_as_usr1_exits_4_and_the_resubmitted_job_resumes() {
    if !gated("slurm_sigterm_reaches_the_ranks_as_usr1_exits_4_and_the_resubmitted_job_resumes") {
        return;
    }
    let dir = tmp("slurm-usr1");
    let total = 120;
    let mut env = tiny_train_env(total);
    env.extend(
        [
            ("FUGU_BIN", jobs_bin().display().to_string()),
            ("FUGU_DATA", corpus().display().to_string()),
            ("FUGU_LAUNCHER", "mpirun".into()),
            ("FUGU_CKPT_EVERY", "0".into()),
            ("FUGU_AUTO_RESUBMIT", "1".into()),
            ("FUGU_RESUBMIT_MAX", "1".into()),
            ("FUGU_OUT", "run".into()),
        ]
        .map(|(k, v)| (k.to_string(), v)),
    );
    let jid = sbatch(
        &dir,
        &[
            "--ntasks=2",
            "--ntasks-per-node=2",
            "--cpus-per-task=1",
            "--time=10",
            "--output=%x-%j.out",
            &jobscripts().join("slurm/train.sh").display().to_string(),
        ],
        &env,
    );
    // Signal as soon as training runs.
    let run = dir.join("run");
    let t = Instant::now();
    while read_metrics(run.join("metrics.jsonl"))
        .map(|m| steps(&m).is_empty())
        .unwrap_or(true)
    {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "training did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = Command::new("scancel")
        .args(["--batch", "--signal=TERM", &jid])
        .envs(slurm_env())
        .output()
        .unwrap();
    assert!(out.status.success(), "scancel: {}", text(&out));
    let (state, code) = wait_job(&jid, 120);
    let log = read(&dir.join(format!("fugu-train-{jid}.out")));
    assert!(
        log.contains("got SIGTERM: sending SIGUSR1 to mpirun"),
        "{log}"
    );
    assert!(log.contains("received SIGUSR1"), "{log}");
    assert_eq!((state.as_str(), code), ("FAILED", 4), "{log}");
    let jobs = read(&run.join("jobs.log"));
    let next = jobs
        .lines()
        .find_map(|l| l.split("resubmitted as job ").nth(1))
        .unwrap_or_else(|| panic!("no resubmission in jobs.log:\n{jobs}\n{log}"))
        .trim()
        .to_string();
    let (state, code) = wait_job(&next, 240);
    let log2 = read(&dir.join(format!("fugu-train-{next}.out")));
    assert_eq!((state.as_str(), code), ("COMPLETED", 0), "{log2}");
    assert!(log2.contains("continuation 1"), "{log2}");
    assert_continued(&run, 2);
    assert_eq!(steps(&metrics(&run)).last(), Some(&(total as u64)));
}

//! `fugu report`: scaling-breakdown reports from training runs and GEMM benchmarks.
//!
//! Reads `fugu train` run directories ([`runs`]) and `fugu bench gemm --format json` output
//! ([`gemm`]), and writes `REPORT.md`, standalone SVG charts ([`charts`]) and one CSV per table
//! ([`table`]) into an output directory ([`markdown`]): the per-op breakdown per run
//! ([`breakdown`]), strong and weak scaling ([`scaling`]), TFLOP/s and % of peak per process,
//! and the GEMM benchmark. Inputs that cannot be used are listed in the report with the reason
//! ([`inputs`]); only when none can be used is it an error.

pub mod breakdown;
pub mod charts;
pub mod comm;
pub mod gemm;
pub mod inputs;
pub mod markdown;
pub mod prediction;
pub mod runs;
pub mod scaling;
pub mod sections;
pub mod table;

use anyhow::{bail, Result};
use inputs::{Input, Skipped};
use std::path::PathBuf;

/// What to report on and where.
#[derive(Clone, Debug, Default)]
pub struct ReportOptions {
    /// Run directories, metrics files, GEMM benchmark files or directories of them.
    pub inputs: Vec<PathBuf>,
    /// Files (or directories of `bench-gemm*.jsonl`) to read as GEMM benchmark output whatever
    /// their names.
    pub gemm: Vec<PathBuf>,
    /// Files (or directories of `comm-*.json`) to read as `fugu bench comm` output.
    pub comm: Vec<PathBuf>,
    /// `fugu predict --format json` files.
    pub predict: Vec<PathBuf>,
    /// Output directory.
    pub out: PathBuf,
}

/// What [`generate`] did.
#[derive(Clone, Debug)]
pub struct ReportOutcome {
    /// Runs reported.
    pub runs: usize,
    /// GEMM benchmark rows reported.
    pub gemm_rows: usize,
    /// Communication benchmark files reported.
    pub comm_files: usize,
    /// Inputs or parts of inputs not used.
    pub skipped: Vec<Skipped>,
    /// Files written, `REPORT.md` first.
    pub files: Vec<PathBuf>,
}

/// Reads the inputs and writes the report. Fails only when no input is usable (naming each
/// input and why) or when the output cannot be written.
pub fn generate(opts: &ReportOptions) -> Result<ReportOutcome> {
    let (found, mut skipped) =
        inputs::classify(&opts.inputs, &opts.gemm, &opts.comm, &opts.predict);

    let run_inputs: Vec<(&PathBuf, &PathBuf)> = found
        .iter()
        .filter_map(|i| match i {
            Input::Run { metrics, given } => Some((metrics, given)),
            Input::Gemm(_) | Input::Comm(_) | Input::Prediction(_) => None,
        })
        .collect();
    let names = runs::unique_names(
        &run_inputs
            .iter()
            .map(|(_, g)| (*g).clone())
            .collect::<Vec<_>>(),
    );
    let mut all_runs = Vec::new();
    for ((metrics, given), name) in run_inputs.iter().zip(names) {
        match runs::read_run(metrics, &name) {
            Ok(r) => {
                for (line, why) in &r.bad_lines {
                    skipped.push(Skipped::new(
                        format!("{} line {line}", metrics.display()),
                        format!("{why}: ignored, the run's other lines were used"),
                    ));
                }
                all_runs.push(r);
            }
            Err(e) => skipped.push(Skipped::new(given.display().to_string(), format!("{e:#}"))),
        }
    }
    all_runs.sort_by(|a, b| {
        (a.layout.nodes, a.layout.world, a.layout.tp, &a.name).cmp(&(
            b.layout.nodes,
            b.layout.world,
            b.layout.tp,
            &b.name,
        ))
    });

    let mut gemm_rows = Vec::new();
    let mut gemm_files = 0;
    for i in &found {
        let Input::Gemm(p) = i else { continue };
        match gemm::read_gemm(p) {
            Ok(f) => {
                gemm_files += 1;
                let n = f.bad_lines.len();
                for (line, why) in f.bad_lines.iter().take(5) {
                    skipped.push(Skipped::new(
                        format!("{} line {line}", p.display()),
                        why.clone(),
                    ));
                }
                if n > 5 {
                    skipped.push(Skipped::new(
                        p.display().to_string(),
                        format!("{} more lines that are not GEMM rows", n - 5),
                    ));
                }
                gemm_rows.extend(f.rows);
            }
            Err(e) => skipped.push(Skipped::new(p.display().to_string(), format!("{e:#}"))),
        }
    }

    let mut comm_files = Vec::new();
    for i in &found {
        let Input::Comm(p) = i else { continue };
        match comm::read_comm(p) {
            Ok(f) => comm_files.push(f),
            Err(e) => skipped.push(Skipped::new(p.display().to_string(), format!("{e:#}"))),
        }
    }

    let mut predictions = Vec::new();
    for i in &found {
        let Input::Prediction(p) = i else { continue };
        match prediction::read_prediction(p) {
            Ok(f) => predictions.push(f),
            Err(e) => skipped.push(Skipped::new(p.display().to_string(), format!("{e:#}"))),
        }
    }

    if all_runs.is_empty()
        && gemm_rows.is_empty()
        && comm_files.is_empty()
        && predictions.is_empty()
    {
        let why: Vec<String> = skipped
            .iter()
            .map(|s| format!("  {}: {}", s.input, s.reason))
            .collect();
        if why.is_empty() {
            bail!("no inputs given: pass run directories and/or benchmark files");
        }
        bail!("no usable input:\n{}", why.join("\n"));
    }

    let mut sections = Vec::new();
    if !all_runs.is_empty() {
        sections.push(sections::runs_section(&all_runs));
        sections.extend(sections::loss_section(&all_runs)?);
        sections.extend(sections::training_section(&all_runs)?);
        sections.push(sections::breakdown_section(&all_runs)?);
        sections.push(sections::roofline_section(&all_runs));
        sections.push(sections::scaling_section(&all_runs)?);
        sections.push(sections::efficiency_section(&all_runs)?);
    }
    if !gemm_rows.is_empty() {
        sections.push(sections::gemm_section(&gemm_rows)?);
    } else {
        sections.push(sections::Section {
            title: "GEMM benchmarks".into(),
            items: vec![sections::Item::Text(
                "No GEMM benchmark given (`fugu bench gemm --format json > bench-gemm.jsonl`, then \
                 pass the file or its directory)."
                    .into(),
            )],
        });
    }
    if !comm_files.is_empty() {
        sections.push(comm::comm_section(&comm_files)?);
    }
    if !predictions.is_empty() {
        sections.push(prediction::prediction_section(&predictions, &all_runs)?);
    }
    sections.extend(sections::notes_section(&all_runs));
    sections.push(sections::skipped_section(&skipped));

    let preamble = format!(
        "Generated by `fugu report` (fugu {}) from {} run{} and {} GEMM row{} in {} file{}. \
         Medians and means leave out warm-up: the first 10% of each run's steps (at least one \
         step) and the first step after every resume.",
        env!("CARGO_PKG_VERSION"),
        all_runs.len(),
        if all_runs.len() == 1 { "" } else { "s" },
        gemm_rows.len(),
        if gemm_rows.len() == 1 { "" } else { "s" },
        gemm_files,
        if gemm_files == 1 { "" } else { "s" },
    );
    let preamble = if comm_files.is_empty() {
        preamble
    } else {
        format!(
            "{preamble} Communication: {} `fugu bench comm` file{}.",
            comm_files.len(),
            if comm_files.len() == 1 { "" } else { "s" }
        )
    };
    let preamble = format!("{preamble} {}", measured_on(&all_runs, &gemm_rows));
    let files = markdown::write(&opts.out, "fugu report", &preamble, &sections)?;
    Ok(ReportOutcome {
        runs: all_runs.len(),
        gemm_rows: gemm_rows.len(),
        comm_files: comm_files.len(),
        skipped,
        files,
    })
}

/// Where the inputs were measured (CPU model and ISA of the runs, ISA of the GEMM rows): a
/// report describes those machines, not the one that generated it.
fn measured_on(runs: &[runs::Run], gemm: &[gemm::GemmRow]) -> String {
    let mut m: std::collections::BTreeSet<String> = runs
        .iter()
        .map(
            |r| match (r.machine.cpu_model.as_str(), r.machine.isa.as_str()) {
                ("", "") => "an unrecorded CPU".to_string(),
                (c, "") => c.to_string(),
                ("", i) => format!("a CPU with {i}"),
                (c, i) => format!("{c} ({i})"),
            },
        )
        .collect();
    let isas: std::collections::BTreeSet<&str> = gemm.iter().map(|g| g.isa.as_str()).collect();
    if !isas.is_empty() {
        m.insert(format!(
            "GEMM rows on {}",
            isas.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    if m.is_empty() {
        return String::new();
    }
    format!(
        "Measured on: {} (the machines that recorded the inputs, not necessarily the one that \
         generated this report).",
        m.into_iter().collect::<Vec<_>>().join("; ")
    )
}

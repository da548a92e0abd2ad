//! `cargo bench --features mpi --bench parallel -- [--config gpt2-124m] [--shape 8x256]
//! [--steps 6] [--cores 2] [--micro 8] [--pp-layers N,N]`
//!
//! The MPI targets of the parallelism issue, as ratios measured in one run on this machine:
//! `fugu train` (the real binary, the real data path) as
//!   1. one rank × `cores` threads (the baseline),
//!   2. `cores` ranks × 1 thread, data parallel (B per rank, so `cores`× the tokens per step),
//!   3. `cores` ranks × 1 thread, tensor parallel (one replica of B),
//!   4. as 2 with ZeRO-1,
//!   5. `cores` ranks × 1 thread, pipeline parallel (one replica of B as `micro` micro-batches
//!      through `cores` stages, 1F1B),
//!
//! each for `steps` steps. Reads every run's metrics.jsonl and prints the median tokens/s
//! (first step excluded as warm-up), the ratio to the baseline, the visible
//! `allreduce-params` time and the TP all-reduce time as a share of the step, and the payload
//! bytes communicated per step, the pipeline bubble (`pipeline:bubble`, mean over ranks) as a
//! share of the step next to the ideal 1F1B bubble (p−1)/(m+p−1), and rank 0's peak RSS (which includes gathering the final
//! checkpoint on rank 0, so it understates what ZeRO-1 saves during training).

use clap::Parser;
use fugu::metrics::jsonl::{read_metrics, Record, StepRecord};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "gpt2-124m")]
    config: String,
    /// Per-rank batch BxT.
    #[arg(long, default_value = "8x256")]
    shape: String,
    /// Steps per run (the first is excluded).
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Cores to use: threads of the baseline, ranks of the parallel runs.
    #[arg(long, default_value_t = 2)]
    cores: usize,
    /// Micro-batches of the pipeline-parallel run.
    #[arg(long, default_value_t = 8)]
    micro: usize,
    /// Blocks per stage of the pipeline-parallel run (`fugu train --pp-layers`); default: the
    /// trainer's balanced split.
    #[arg(long)]
    pp_layers: Option<String>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn steps_of(out: &Path) -> anyhow::Result<Vec<StepRecord>> {
    Ok(read_metrics(out.join("metrics.jsonl"))?
        .into_iter()
        .filter_map(|r| match r {
            Record::Step(s) => Some(s),
            _ => None,
        })
        .skip(1)
        .collect())
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let (b, t) = a
        .shape
        .split_once('x')
        .ok_or_else(|| anyhow::anyhow!("--shape {}: expected BxT", a.shape))?;
    let exe = env!("CARGO_BIN_EXE_fugu");
    let tmp = std::env::temp_dir().join(format!("fugu-bench-parallel-{}", std::process::id()));
    let cores = a.cores.to_string();
    let steps = a.steps.to_string();
    let micro = a.micro.to_string();
    let runs: Vec<(&str, usize, Vec<&str>)> = vec![
        ("1 rank x threads", 0, vec!["--threads", &cores]),
        ("dp ranks x 1 thread", a.cores, vec!["--threads", "1"]),
        (
            "tp ranks x 1 thread",
            a.cores,
            vec!["--threads", "1", "--tp", &cores],
        ),
        (
            "dp + ZeRO-1",
            a.cores,
            vec!["--threads", "1", "--zero", "1"],
        ),
        (
            "pp ranks x 1 thread",
            a.cores,
            [
                vec!["--threads", "1", "--pp", &cores, "--micro-batches", &micro],
                a.pp_layers
                    .as_deref()
                    .map_or(vec![], |l| vec!["--pp-layers", l]),
            ]
            .concat(),
        ),
    ];
    let ideal_bubble = 100.0 * (a.cores - 1) as f64 / (a.micro + a.cores - 1) as f64;
    println!(
        "{} B={b} T={t} per replica, {} steps (first excluded), {} cores",
        a.config, a.steps, a.cores
    );
    println!(
        "{:<22} {:>10} {:>9} {:>8} {:>16} {:>14} {:>20} {:>12} {:>10}",
        "run",
        "tokens/s",
        "ms/step",
        "ratio",
        "allreduce-params",
        "TP allreduce",
        "bubble (ideal)",
        "MB/step",
        "RSS MiB"
    );
    let mut base = f64::NAN;
    for (name, np, extra) in runs {
        let out: PathBuf = tmp.join(name.replace(' ', "_"));
        let _ = std::fs::remove_dir_all(&out);
        let mut cmd = if np == 0 {
            Command::new(exe)
        } else {
            let mut c = Command::new("mpirun");
            c.args([
                "-np",
                &np.to_string(),
                "--oversubscribe",
                "--bind-to",
                "core",
                exe,
            ]);
            c
        };
        cmd.args([
            "train",
            "--config",
            &a.config,
            "--batch-size",
            b,
            "--seq-len",
            t,
            "--steps",
            &steps,
            "--eval-every",
            "0",
            "--ckpt-every",
            "0",
            "--keep-last",
            "1",
            "--timers",
            "coarse",
            "--log-every",
            "1",
            "--out",
        ])
        .arg(&out)
        .args(&extra)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        let st = cmd.output()?;
        if !st.status.success() {
            anyhow::bail!("{name} failed:\n{}", String::from_utf8_lossy(&st.stderr));
        }
        let recs = steps_of(&out)?;
        let tps = median(recs.iter().map(|r| r.tokens_per_s).collect());
        let ms = median(recs.iter().map(|r| r.step_ms).collect());
        let share = |pred: &dyn Fn(&str) -> bool| {
            median(
                recs.iter()
                    .map(|r| {
                        r.timers
                            .iter()
                            .filter(|(k, _)| pred(k))
                            .map(|(_, v)| v)
                            .sum::<f64>()
                            / r.step_ms
                    })
                    .collect(),
            ) * 100.0
        };
        let ar = share(&|k| k == "allreduce-params") + 0.0;
        let tpar = share(&|k| k.ends_with(":allreduce") && !k.starts_with("pipeline:")) + 0.0;
        let bubble = share(&|k| k == "pipeline:bubble") + 0.0;
        let bubble = if extra.contains(&"--pp") {
            format!("{bubble:.1}% ({ideal_bubble:.1}%)")
        } else {
            "-".to_string()
        };
        let mb = median(
            recs.iter()
                .map(|r| r.comm_bytes.unwrap_or(0) as f64 / 1e6)
                .collect(),
        );
        if np == 0 {
            base = tps;
        }
        let rss = read_metrics(out.join("metrics.jsonl"))?
            .into_iter()
            .find_map(|r| match r {
                Record::Event { kind, data } if kind == "end" => data["peak_rss_bytes"].as_f64(),
                _ => None,
            })
            .unwrap_or(f64::NAN)
            / (1u64 << 20) as f64;
        println!(
            "{:<22} {:>10.1} {:>9.0} {:>7.2}x {:>15.1}% {:>13.1}% {:>20} {:>12.0} {:>10.0}",
            name,
            tps,
            ms,
            tps / base,
            ar,
            tpar,
            bubble,
            mb,
            rss
        );
        let _ = std::fs::remove_dir_all(&out);
    }
    Ok(())
}

//! `--resume`: which checkpoint a run continues from, and the settings it continues with.
//!
//! A resumed run is the run that wrote the checkpoint: its model, batch size, sequence length,
//! learning-rate schedule, optimiser settings, seed, data and data order come from
//! `state.json`. A command-line value (or an explicit `--config` file) that differs from the
//! saved one is refused with a message naming the field, except the fields in [`MAY_CHANGE`]
//! (`--steps` to extend a run, `--eval-every`, `--ckpt-every`). Options that are not part of the
//! run's state may change freely: `--keep-last`, `--eval-batches`, `--val-data`, `--log-every`,
//! `--timers`, the deadline, the parallel layout (`--tp`, `--pp`, `--pp-layers`, `--zero`, `--bucket-mb`; the
//! checkpoint is layout-free) and `--threads` (warned: a bit-exact resume needs the same count).
//!
//! Which checkpoint: `--resume auto` (or a run folder) takes the newest one that is whole
//! ([`open_checkpoint`]); passing over a damaged newer one is reported, and a folder whose
//! checkpoints are all damaged is an error, never a silent fresh start.

use super::state::{TrainState, STATE_FORMAT};
use crate::checkpoint::hf::read_tensor_files;
use crate::checkpoint::{self, sharded, CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE};
use crate::config::{
    train_fields, train_flag, with_train_fields, LrSchedule, RunConfig, TrainOverrides,
};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// [`crate::config::TrainConfig`] fields a resumed run may change from the command line.
pub const MAY_CHANGE: [&str; 3] = ["steps", "eval_every", "ckpt_every"];

/// The checkpoint a run continues from.
#[derive(Clone, Debug)]
pub struct ResumePoint {
    pub dir: PathBuf,
    pub state: TrainState,
}

/// True for a path that names a checkpoint itself (`ckpt-STEP`, or any folder with a
/// `state.json`) rather than a run folder holding `ckpt-*`.
pub fn is_checkpoint_dir(p: &Path) -> bool {
    checkpoint::checkpoint_step(p).is_some() || p.join(STATE_FILE).exists()
}

/// Resolves `--resume`: a checkpoint directory (which must be whole), a run directory (its
/// newest whole checkpoint), or `auto` (the same in `out`, or `None` when `out` holds no
/// `ckpt-*` at all). With `report`, passing over damaged newer checkpoints is printed.
pub fn find(resume: Option<&str>, out: &Path, report: bool) -> Result<Option<ResumePoint>> {
    let Some(r) = resume else { return Ok(None) };
    let run_dir = if r == "auto" {
        out.to_path_buf()
    } else {
        let p = PathBuf::from(r);
        if !p.exists() {
            bail!("--resume {r}: {} does not exist", p.display());
        }
        if is_checkpoint_dir(&p) {
            let state = open_checkpoint(&p).with_context(|| format!("--resume {r}"))?;
            return Ok(Some(ResumePoint { dir: p, state }));
        }
        p
    };
    let entries = checkpoint::checkpoint_entries(&run_dir)?;
    if entries.is_empty() {
        if r == "auto" {
            return Ok(None);
        }
        bail!("--resume {r}: not a checkpoint directory and holds no ckpt-* checkpoints");
    }
    let mut damaged: Vec<(PathBuf, anyhow::Error)> = Vec::new();
    for (_, dir) in entries.iter().rev() {
        match open_checkpoint(dir) {
            Ok(state) => {
                if report {
                    for (d, e) in &damaged {
                        eprintln!(
                            "warning: --resume {r}: passing over damaged checkpoint {}: {e:#}",
                            path_name(d)
                        );
                    }
                    if !damaged.is_empty() {
                        eprintln!("warning: --resume {r}: resuming from {}", dir.display());
                    }
                }
                return Ok(Some(ResumePoint {
                    dir: dir.clone(),
                    state,
                }));
            }
            Err(e) => damaged.push((dir.clone(), e)),
        }
    }
    let list: Vec<String> = damaged
        .iter()
        .map(|(d, e)| format!("  {}: {e:#}", path_name(d)))
        .collect();
    bail!(
        "--resume {r}: {} holds {} checkpoint(s) and none can be resumed from:\n{}\nmove them \
         away to start over in this folder, or start a new run with another --out",
        run_dir.display(),
        damaged.len(),
        list.join("\n")
    )
}

fn path_name(p: &Path) -> String {
    p.file_name()
        .map_or_else(|| p.display().to_string(), |n| n.to_string_lossy().into())
}

/// Checks that `dir` is a whole checkpoint (every file present; `state.json` and `config.json`
/// parse and agree; the safetensors headers of the model and the optimizer state, single files
/// or every shard an index names, parse, match the files' lengths and agree with the indexes)
/// and returns its state. Tensor contents are read later, by the load itself.
pub fn open_checkpoint(dir: &Path) -> Result<TrainState> {
    for f in [CONFIG_FILE, STATE_FILE] {
        if !dir.join(f).is_file() {
            bail!("{}: missing {f}", dir.display());
        }
    }
    let state: TrainState = checkpoint::read_state(dir)?;
    if state.format != STATE_FORMAT {
        bail!(
            "{}: state.json format {:?}, expected {STATE_FORMAT:?}",
            dir.display(),
            state.format
        );
    }
    if let Some(named) = checkpoint::checkpoint_step(dir) {
        if named != state.step {
            bail!(
                "{}: state.json says step {}, but the folder is named for step {named} \
                 (edited or copied over?)",
                dir.display(),
                state.step
            );
        }
    }
    state
        .config
        .validate()
        .with_context(|| format!("{}: state.json holds settings fugu refuses", dir.display()))?;
    let model = checkpoint::read_hf_config(dir)?;
    if model != state.config.model {
        bail!(
            "{}: config.json ({model:?}) disagrees with state.json ({:?})",
            dir.display(),
            state.config.model
        );
    }
    for (single, index, what) in [
        (
            MODEL_FILE,
            sharded::MODEL_INDEX_FILE,
            "a checkpoint with model weights",
        ),
        (
            OPTIMIZER_FILE,
            sharded::OPTIMIZER_INDEX_FILE,
            "a checkpoint with optimizer state",
        ),
    ] {
        read_tensor_files(dir, single, index, what)?;
    }
    Ok(state)
}

/// The configuration a resumed run continues with: `saved`, with the [`MAY_CHANGE`] fields
/// given on the command line (`cli`) applied. What the command line asks for (an explicitly
/// given `--config` file, `file`, with `cli` applied to it; without `--config`, just `cli`)
/// must otherwise equal the saved settings: a difference is an error naming the flag or the
/// file's field. A file's [`MAY_CHANGE`] fields are not applied (only a flag changes those).
/// With `report`, every change is printed.
///
/// The batch is the run's global batch (`batch_size` per rank × data-parallel ranks): with
/// `dp = (saved, now)` different, the per-rank batch becomes `global / now` (a `--batch-size`
/// must give that value), so a layout change keeps what the run trains on.
pub fn settings(
    saved: &RunConfig,
    step: u64,
    dp: (usize, usize),
    file: Option<(&str, &RunConfig)>,
    cli: &TrainOverrides,
    report: bool,
) -> Result<RunConfig> {
    const KEEPS: &str = "a resumed run keeps the settings it was started with (state.json): \
                         pass the same values, or start a new run with another --out";
    if let Some((name, f)) = file {
        if f.model != saved.model {
            let (field, given, was) = first_difference(&f.model, &saved.model);
            bail!(
                "--config {name}: model.{field} = {given}, but the checkpoint's model has \
                 {was}; {KEEPS}"
            );
        }
    }
    let batch = per_rank_batch(saved.train.batch_size, dp, cli.batch_size)?;
    let given = cli.given();
    let asked = cli.apply(file.map_or(&saved.train, |(_, f)| &f.train));
    let theirs = train_fields(&saved.train);
    let mut changes = serde_json::Map::new();
    changes.insert("batch_size".into(), batch.into());
    for (field, want) in train_fields(&asked) {
        let was = &theirs[&field];
        // The batch was settled above when given or when the layout changed.
        let batch_settled = field == "batch_size" && (given.contains_key(&field) || dp.0 != dp.1);
        if *was == want || batch_settled {
            continue;
        }
        match (
            MAY_CHANGE.contains(&field.as_str()),
            given.contains_key(&field),
            file,
        ) {
            (true, true, _) => {
                changes.insert(field, want);
            }
            (true, false, _) => {}
            (false, true, _) => bail!(
                "{} {want}: the run was started with {was}; {KEEPS}",
                train_flag(&field)
            ),
            (false, false, Some((name, _))) => bail!(
                "--config {name}: train.{field} = {want}, but the run was started with {was} \
                 (set by a flag then?); {KEEPS}"
            ),
            (false, false, None) => unreachable!("without --config, only flags differ"),
        }
    }
    let mut cfg = saved.clone();
    cfg.train = with_train_fields(&saved.train, changes);
    let t = &cfg.train;
    if (t.steps as u64) < step {
        bail!(
            "--steps {}: the checkpoint is already at step {step}; pass at least that many",
            t.steps
        );
    }
    if report {
        if t.batch_size != saved.train.batch_size {
            eprintln!(
                "resume: --batch-size {} per rank × {} data-parallel ranks (the run had {} × {}: \
                 the same global batch)",
                t.batch_size, dp.1, saved.train.batch_size, dp.0
            );
        }
        for (field, now) in train_fields(t) {
            if theirs[&field] != now && field != "batch_size" {
                eprintln!(
                    "resume: {} {now} (the run had {})",
                    train_flag(&field),
                    theirs[&field]
                );
            }
        }
        if t.steps != saved.train.steps && t.lr_schedule == LrSchedule::Cosine {
            eprintln!(
                "resume: the cosine decay now ends at step {} instead of {}, so the learning \
                 rate from step {step} on differs from the original schedule",
                t.steps, saved.train.steps
            );
        }
    }
    Ok(cfg)
}

/// The per-rank batch that keeps the global batch `saved × dp.0` over `dp.1` ranks; a given
/// `--batch-size` must be that value.
fn per_rank_batch(saved: usize, dp: (usize, usize), given: Option<usize>) -> Result<usize> {
    let global = saved * dp.0;
    let now = dp.1.max(1);
    match given {
        Some(b) if b * now == global => Ok(b),
        Some(b) if dp.0 == now => bail!(
            "--batch-size {b}: the run was started with {saved}; a resumed run keeps the \
             settings it was started with (state.json): pass the same values, or start a new \
             run with another --out"
        ),
        Some(b) => bail!(
            "--batch-size {b}: the run's global batch is {global} ({saved} per rank × {} \
             data-parallel ranks); over {now} ranks that is --batch-size {}",
            dp.0,
            if global.is_multiple_of(now) {
                (global / now).to_string()
            } else {
                "not a whole number".into()
            }
        ),
        None if global.is_multiple_of(now) => Ok(global / now),
        None => bail!(
            "the run's global batch of {global} sequences ({saved} per rank × {} data-parallel \
             ranks) does not split evenly over {now} data-parallel ranks; resume with a \
             data-parallel size that divides it",
            dp.0
        ),
    }
}

/// The first field (serde name) in which `a` and `b` differ, with both values.
fn first_difference<T: serde::Serialize>(a: &T, b: &T) -> (String, String, String) {
    let (a, b) = (serde_json::to_value(a), serde_json::to_value(b));
    if let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) = (a, b) {
        for (k, v) in &a {
            if b.get(k) != Some(v) {
                let was = b.get(k).map_or_else(|| "nothing".into(), |w| w.to_string());
                return (k.clone(), v.to_string(), was);
            }
        }
    }
    ("?".into(), "?".into(), "?".into())
}

/// The data a resumed run reads: the saved `--data`, which an explicit `--data` must name too
/// (the same string, or a path to the same file).
pub fn data(saved: &str, given: Option<&str>, report: bool) -> Result<String> {
    if let Some(g) = given {
        let same_file = match (Path::new(g).canonicalize(), Path::new(saved).canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if g != saved && !same_file && report {
            eprintln!(
                "notice: --data {g}: reading the run's data from here (the checkpoint names \
                 {saved}); the data loader checks that it is the same dataset"
            );
        }
        return Ok(super::data::absolute_data(g));
    }
    let first = fugu_io::expand_braces(saved)
        .ok()
        .and_then(|v| v.into_iter().next())
        .unwrap_or_else(|| saved.to_string());
    if !Path::new(&first).exists() {
        bail!(
            "the run's data {saved} is not there (moved or deleted?): pass --data with its \
             new place; it must be the same dataset (the checkpoint's data cursor names its \
             shards' checksums)"
        );
    }
    Ok(saved.to_string())
}

/// Whether a resumed run shuffles: as saved (checkpoints older than this field: as asked).
/// `--no-shuffle` on a run started with shuffling is refused.
pub fn shuffle(saved: Option<bool>, asked: bool) -> Result<bool> {
    match saved {
        Some(true) if !asked => bail!(
            "--no-shuffle: the run was started with shuffled data; a resumed run keeps its data \
             order (drop --no-shuffle, or start a new run with another --out)"
        ),
        Some(s) => Ok(s),
        None => Ok(asked),
    }
}

/// Warns when the thread count differs from the one the checkpoint was written with.
pub fn check_threads(saved: usize, now: usize, report: bool) {
    if report && saved != now {
        eprintln!(
            "warning: resuming with {now} compute threads; the checkpoint was written with \
             {saved}. Training continues correctly, but a bit-exact continuation needs the same \
             count (--threads {saved})"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> RunConfig {
        RunConfig::load("gpt2-tiny").unwrap()
    }

    #[test]
    fn changed_fixed_settings_are_refused_by_name() {
        let saved = tiny();
        let cli = TrainOverrides {
            batch_size: Some(saved.train.batch_size + 1),
            ..Default::default()
        };
        let e = settings(&saved, 10, (1, 1), None, &cli, false).unwrap_err();
        assert!(e.to_string().contains("--batch-size 9"), "{e}");
        assert!(e.to_string().contains("started with 8"), "{e}");
        // The same value is accepted (a job script passes the same flags every time).
        let cli = TrainOverrides {
            batch_size: Some(saved.train.batch_size),
            lr: Some(saved.train.lr),
            ..Default::default()
        };
        assert_eq!(
            settings(&saved, 10, (1, 1), None, &cli, false).unwrap(),
            saved
        );
    }

    #[test]
    fn steps_may_grow_but_not_below_the_checkpoint() {
        let saved = tiny();
        let cli = TrainOverrides {
            steps: Some(600),
            ckpt_every: Some(7),
            ..Default::default()
        };
        let c = settings(&saved, 100, (1, 1), None, &cli, false).unwrap();
        assert_eq!((c.train.steps, c.train.ckpt_every), (600, 7));
        let cli = TrainOverrides {
            steps: Some(50),
            ..Default::default()
        };
        let e = settings(&saved, 100, (1, 1), None, &cli, false).unwrap_err();
        assert!(e.to_string().contains("already at step 100"), "{e}");
    }

    #[test]
    fn an_explicit_config_must_agree_with_the_checkpoint() {
        let saved = tiny();
        let big = RunConfig::load("gpt2-124m").unwrap();
        let e = settings(
            &saved,
            1,
            (1, 1),
            Some(("gpt2-124m", &big)),
            &Default::default(),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("model.n_embd = 768"), "{e}");
        // Same model, another schedule.
        let mut other = saved.clone();
        other.train.warmup_steps += 1;
        let e = settings(
            &saved,
            1,
            (1, 1),
            Some(("x.toml", &other)),
            &Default::default(),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("train.warmup_steps = 21"), "{e}");
        // A file value the run overrode by a flag must be given by that flag again.
        let cli = TrainOverrides {
            warmup_steps: Some(21),
            ..Default::default()
        };
        let mut overridden = saved.clone();
        overridden.train.warmup_steps = 21;
        let c = settings(
            &overridden,
            1,
            (1, 1),
            Some(("x.toml", &saved)),
            &cli,
            false,
        )
        .unwrap();
        assert_eq!(c, overridden);
        let e = settings(
            &overridden,
            1,
            (1, 1),
            Some(("x.toml", &saved)),
            &Default::default(),
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("set by a flag then?"), "{e}");
        // A file whose steps differ keeps the saved steps (only --steps changes them).
        let mut longer = saved.clone();
        longer.train.steps = 5000;
        let c = settings(
            &saved,
            1,
            (1, 1),
            Some(("x.toml", &longer)),
            &Default::default(),
            false,
        )
        .unwrap();
        assert_eq!(c, saved);
    }

    #[test]
    fn a_layout_change_keeps_the_global_batch() {
        let saved = tiny(); // batch 8 per rank
        let c = settings(&saved, 1, (2, 4), None, &Default::default(), false).unwrap();
        assert_eq!(c.train.batch_size, 4);
        let cli = TrainOverrides {
            batch_size: Some(16),
            ..Default::default()
        };
        assert_eq!(
            settings(&saved, 1, (2, 1), None, &cli, false)
                .unwrap()
                .train
                .batch_size,
            16
        );
        let e = settings(&saved, 1, (2, 4), None, &cli, false).unwrap_err();
        assert!(e.to_string().contains("that is --batch-size 4"), "{e}");
        let e = settings(&saved, 1, (1, 3), None, &Default::default(), false).unwrap_err();
        assert!(e.to_string().contains("does not split evenly"), "{e}");
    }

    #[test]
    fn data_follows_its_path_and_order_is_kept() {
        // The saved path when it is there; when it is gone, an error that says how to go on.
        let dir = std::env::temp_dir().join(format!("fugu-resume-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let there = dir.join("manifest.json");
        std::fs::write(&there, "{}").unwrap();
        let there = there.display().to_string();
        assert_eq!(data(&there, None, false).unwrap(), there);
        let gone = dir.join("moved/manifest.json").display().to_string();
        let e = data(&gone, None, false).unwrap_err().to_string();
        assert!(e.contains("not there") && e.contains("--data"), "{e}");
        // --data elsewhere is taken, as an absolute path (the loader checks the dataset).
        let moved = data(&gone, Some("new/manifest.json"), false).unwrap();
        assert!(Path::new(&moved).is_absolute() && moved.ends_with("new/manifest.json"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(shuffle(Some(true), false).is_err());
        assert!(!shuffle(Some(false), true).unwrap());
        assert!(shuffle(None, true).unwrap());
    }
}

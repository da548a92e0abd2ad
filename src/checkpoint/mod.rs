//! Checkpoints: Hugging Face model directories plus optimizer and trainer state.
//!
//! A training run writes `OUT/ckpt-STEP/` (STEP zero-padded to 8 digits, `ckpt-00000100`;
//! longer numbers are written and read as they are), containing:
//!
//! | file | content |
//! |---|---|
//! | `config.json` | a Hugging Face `GPT2Config` ([`hf_config_json`]) |
//! | `model.safetensors` | the weights, laid out as `transformers` `save_pretrained` writes a `GPT2LMHeadModel` (see [`hf`]) |
//! | `optimizer.safetensors` | AdamW moments `exp_avg.<key>` / `exp_avg_sq.<key>`, F32, metadata `step` (see [`optim`]) |
//! | `state.json` | the trainer's state (step, data cursor, RNG, run config): any `Serialize` type |
//!
//! so `GPT2LMHeadModel.from_pretrained("OUT/ckpt-00000100")` loads a checkpoint as it is.
//!
//! [`write_checkpoint`] builds the directory as `OUT/.tmp-ckpt-STEP-PID`, fsyncs every file and
//! the directory, and renames it into place (swapping atomically with an existing
//! `ckpt-STEP`), so a `ckpt-*` directory is always complete. Leftover `.tmp-*` entries from a
//! crash are removed by [`clean_stale_tmp`], which the (single) writer calls at start-up.

pub mod hf;
pub mod optim;
pub mod sharded;
pub mod st;
#[cfg(test)]
mod testutil;

pub use hf::{
    dropout_settings, hf_config_json, load_hf, load_model, read_hf_config, save_model,
    write_model_config, HfModel, CONFIG_FILE, MODEL_FILE,
};
pub use optim::{load_optimizer, save_optimizer, save_table_tensors, OPTIMIZER_FILE};
pub use st::Dtype;

use crate::atomic_write::{self as atomic, TMP_PREFIX};
use crate::model::table::Table;
use crate::model::ModelConfig;
use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::fs;
use std::path::{Path, PathBuf};

/// The trainer-state file of a checkpoint.
pub const STATE_FILE: &str = "state.json";

/// Files a `ckpt-*` directory must hold to count as a checkpoint (and the weights: one
/// `model.safetensors` or a sharded model's index, see [`has_weights`]).
const REQUIRED: [&str; 2] = [CONFIG_FILE, STATE_FILE];

/// Names reserved for the checkpoint's own files (not allowed as extra files).
const RESERVED: [&str; 5] = [
    CONFIG_FILE,
    STATE_FILE,
    MODEL_FILE,
    sharded::MODEL_INDEX_FILE,
    sharded::OPTIMIZER_INDEX_FILE,
];

/// `dir` holds model weights: `model.safetensors` or a sharded model's index.
pub fn has_weights(dir: &Path) -> bool {
    dir.join(MODEL_FILE).is_file() || dir.join(sharded::MODEL_INDEX_FILE).is_file()
}

/// `ckpt-00000100` for step 100.
pub fn checkpoint_dir_name(step: u64) -> String {
    format!("ckpt-{step:08}")
}

/// The step of a checkpoint directory (`.../ckpt-00000100` → 100); `None` for other names.
pub fn checkpoint_step(path: &Path) -> Option<u64> {
    let digits = path.file_name()?.to_str()?.strip_prefix("ckpt-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Every `ckpt-STEP` directory in `out_dir`, whole or not, by increasing step. A missing
/// `out_dir` has none; temporary directories and other names are not listed.
pub fn checkpoint_entries(out_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let rd = match fs::read_dir(out_dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", out_dir.display())),
    };
    let mut found = Vec::new();
    for entry in rd {
        let path = entry
            .with_context(|| format!("listing {}", out_dir.display()))?
            .path();
        if let Some(step) = checkpoint_step(&path) {
            if path.is_dir() {
                found.push((step, path));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// The complete checkpoints in `out_dir` (config, model and state present), by increasing
/// step.
pub fn list_checkpoints(out_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut found = checkpoint_entries(out_dir)?;
    found.retain(|(_, p)| REQUIRED.iter().all(|f| p.join(f).is_file()) && has_weights(p));
    Ok(found)
}

/// The complete checkpoint with the highest step in `out_dir`, if any.
pub fn latest_checkpoint(out_dir: &Path) -> Result<Option<PathBuf>> {
    Ok(list_checkpoints(out_dir)?.pop().map(|(_, p)| p))
}

/// Reads `ckpt/state.json`.
pub fn read_state<S: DeserializeOwned>(ckpt: &Path) -> Result<S> {
    let path = ckpt.join(STATE_FILE);
    let text = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_slice(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Removes what an interrupted [`write_checkpoint`] left in `out_dir` (`.tmp-*` entries) and
/// returns how many entries it removed. A checkpoint that was moved aside to be replaced
/// (`.tmp-old-ckpt-STEP-PID`) is put back if `ckpt-STEP` is missing. Call it from the one
/// process that writes checkpoints, before it writes any.
pub fn clean_stale_tmp(out_dir: &Path) -> Result<usize> {
    let rd = match fs::read_dir(out_dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e).with_context(|| format!("listing {}", out_dir.display())),
    };
    let mut removed = 0;
    for entry in rd {
        let entry = entry.with_context(|| format!("listing {}", out_dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(TMP_PREFIX) else {
            continue;
        };
        let path = entry.path();
        if let Some(old) = rest.strip_prefix("old-") {
            // old = "ckpt-STEP-PID"
            if let Some((ckpt, _pid)) = old.rsplit_once('-') {
                let dst = out_dir.join(ckpt);
                if checkpoint_step(&dst).is_some() && fs::symlink_metadata(&dst).is_err() {
                    fs::rename(&path, &dst).with_context(|| {
                        format!("restoring {} to {}", path.display(), dst.display())
                    })?;
                    continue;
                }
            }
        }
        let r = if entry.file_type()?.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        r.with_context(|| format!("removing {}", path.display()))?;
        removed += 1;
    }
    if removed > 0 {
        atomic::sync_dir(out_dir)?;
    }
    Ok(removed)
}

/// Writes the checkpoint `out_dir/ckpt-STEP/`: model (`config.json`, `model.safetensors`,
/// `generation_config.json`), the AdamW moments if `moments` is `Some((m, v))` (with
/// `opt_step` in the metadata), `state`, and `files` (name, contents: the tokenizer files).
/// Returns the checkpoint's path. One process writes everything ([`begin_checkpoint`], the
/// weights, [`finish_checkpoint`]); a parallel run writes its shards from many ranks between
/// the same two calls.
#[allow(clippy::too_many_arguments)]
pub fn write_checkpoint(
    out_dir: &Path,
    step: u64,
    cfg: &ModelConfig,
    table: &Table,
    params: &[f32],
    moments: Option<(&[f32], &[f32])>,
    opt_step: u64,
    state: &impl Serialize,
    files: &[(String, Vec<u8>)],
    keep_last: usize,
) -> Result<PathBuf> {
    let tmp = begin_checkpoint(out_dir, step)?;
    let weights = (|| -> Result<()> {
        save_model(&tmp, cfg, table, params)?;
        if let Some((m, v)) = moments {
            save_optimizer(&tmp, cfg, table, m, v, opt_step)?;
        }
        Ok(())
    })();
    if let Err(e) = weights {
        let _ = fs::remove_dir_all(&tmp);
        let dst = out_dir.join(checkpoint_dir_name(step));
        return Err(e).with_context(|| format!("writing checkpoint {}", dst.display()));
    }
    finish_checkpoint(out_dir, &tmp, step, state, files, keep_last)
}

/// Creates the empty temporary directory `out_dir/.tmp-ckpt-STEP-PID` that checkpoint `step`
/// is written into (removing a leftover of the same name) and returns it. Until
/// [`finish_checkpoint`] renames it, no reader takes it for a checkpoint.
pub fn begin_checkpoint(out_dir: &Path, step: u64) -> Result<PathBuf> {
    fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let name = checkpoint_dir_name(step);
    let tmp = out_dir.join(format!("{TMP_PREFIX}{name}-{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    }
    fs::create_dir(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    Ok(tmp)
}

/// Completes checkpoint `step` whose weights are in `tmp` (from [`begin_checkpoint`]): writes
/// `state` and `files` (name, contents: the tokenizer files), fsyncs, and renames `tmp` to
/// `ckpt-STEP` (an existing `ckpt-STEP` is replaced atomically and survives any failure before
/// that rename). Then `out_dir` is fsynced, and if `keep_last > 0` the oldest complete
/// checkpoints are deleted until `keep_last` remain (the new one always stays). On error the
/// temporary directory is removed if possible, else [`clean_stale_tmp`] removes it later.
pub fn finish_checkpoint(
    out_dir: &Path,
    tmp: &Path,
    step: u64,
    state: &impl Serialize,
    files: &[(String, Vec<u8>)],
    keep_last: usize,
) -> Result<PathBuf> {
    let name = checkpoint_dir_name(step);
    let dst = out_dir.join(&name);
    let written = (|| {
        let mut json = serde_json::to_vec_pretty(state).context("serializing the trainer state")?;
        json.push(b'\n');
        atomic::write_bytes(&tmp.join(STATE_FILE), &json)?;
        for (name, bytes) in files {
            if name.contains(['/', '\\']) || RESERVED.contains(&name.as_str()) {
                bail!("checkpoint file name {name:?}: expected a plain name of an extra file");
            }
            atomic::write_bytes(&tmp.join(name), bytes)?;
        }
        atomic::sync_dir(tmp)?;
        let old = out_dir.join(format!("{TMP_PREFIX}old-{name}-{}", std::process::id()));
        atomic::replace_dir(tmp, &dst, &old)
    })();
    if let Err(e) = written {
        let _ = fs::remove_dir_all(tmp);
        return Err(e).with_context(|| format!("writing checkpoint {}", dst.display()));
    }
    if keep_last > 0 {
        prune(out_dir, &dst, keep_last).with_context(|| {
            format!(
                "checkpoint {} was written, but deleting older ones failed",
                dst.display()
            )
        })?;
    }
    Ok(dst)
}

/// Deletes the oldest complete checkpoints until `keep` remain, never `keep_this`. Each is
/// first renamed to a `.tmp-del-` name, so a half-deleted checkpoint is never seen as one.
fn prune(out_dir: &Path, keep_this: &Path, keep: usize) -> Result<()> {
    let all = list_checkpoints(out_dir)?;
    let others: Vec<&PathBuf> = all
        .iter()
        .map(|(_, p)| p)
        .filter(|p| p.as_path() != keep_this)
        .collect();
    let excess = (others.len() + 1).saturating_sub(keep);
    for p in others.into_iter().take(excess) {
        let name = p.file_name().unwrap_or_default().to_string_lossy();
        let doomed = out_dir.join(format!("{TMP_PREFIX}del-{name}-{}", std::process::id()));
        fs::rename(p, &doomed).with_context(|| format!("renaming {} for deletion", p.display()))?;
        atomic::sync_dir(out_dir)?;
        fs::remove_dir_all(&doomed)
            .with_context(|| format!("deleting old checkpoint {}", doomed.display()))?;
    }
    if !keep_this.is_dir() {
        bail!("{} vanished while pruning", keep_this.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::testutil::{tiny, TestDir};
    use super::*;
    use crate::model::gpt2_hf;
    use serde::{Deserialize, Serializer};

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct State {
        step: u64,
        cursor: Vec<u64>,
        rng: [u64; 2],
        note: String,
    }

    fn state(step: u64) -> State {
        State {
            step,
            cursor: vec![step, 7],
            rng: [u64::MAX, 3],
            note: "héllo".into(),
        }
    }

    struct Unserializable;
    impl Serialize for Unserializable {
        fn serialize<S: Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
            Err(serde::ser::Error::custom("injected state failure"))
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn step_names() {
        assert_eq!(checkpoint_dir_name(100), "ckpt-00000100");
        assert_eq!(checkpoint_dir_name(1_234_567_890), "ckpt-1234567890");
        assert_eq!(checkpoint_step(Path::new("out/ckpt-00000100")), Some(100));
        assert_eq!(
            checkpoint_step(Path::new("ckpt-1234567890")),
            Some(1_234_567_890)
        );
        for bad in [
            "ckpt-",
            "ckpt-12a",
            "ckpt--1",
            ".tmp-ckpt-00000001-5",
            "x-00000001",
        ] {
            assert_eq!(checkpoint_step(Path::new(bad)), None, "{bad}");
        }
    }

    #[test]
    fn write_resume_prune_and_replace() {
        let d = TestDir::new("ckpt");
        let out = d.0.join("run");
        let (cfg, table, params) = tiny();
        let m: Vec<f32> = params.iter().map(|x| x * 0.1).collect();
        let v: Vec<f32> = params.iter().map(|x| x * x).collect();
        assert_eq!(latest_checkpoint(&out).unwrap(), None);
        let p = write_checkpoint(
            &out,
            100,
            &cfg,
            &table,
            &params,
            Some((&m, &v)),
            100,
            &state(100),
            &[("tokenizer.json".to_string(), b"{}".to_vec())],
            2,
        )
        .unwrap();
        assert_eq!(p, out.join("ckpt-00000100"));
        assert_eq!(
            names(&p),
            [
                CONFIG_FILE,
                hf::GENERATION_CONFIG_FILE,
                MODEL_FILE,
                OPTIMIZER_FILE,
                STATE_FILE,
                "tokenizer.json"
            ]
        );
        assert_eq!(names(&out), ["ckpt-00000100"]);
        // Resume: model, moments, state.
        let mut p2 = vec![0f32; table.total()];
        assert_eq!(load_model(&p, &table, &mut p2).unwrap(), cfg);
        let (mut m2, mut v2) = (vec![0f32; table.total()], vec![0f32; table.total()]);
        assert_eq!(
            load_optimizer(&p, &gpt2_hf::LAYOUT, &table, &mut m2, &mut v2).unwrap(),
            100
        );
        assert_eq!((&p2, &m2, &v2), (&params, &m, &v));
        assert_eq!(read_state::<State>(&p).unwrap(), state(100));
        // Junk and a crashed write do not count; keep_last = 2 keeps the newest two.
        fs::create_dir_all(out.join("ckpt-99999999")).unwrap(); // incomplete
        fs::write(out.join("ckpt-0000007"), "a file").unwrap();
        fs::create_dir_all(out.join(".tmp-ckpt-00000900-1")).unwrap();
        fs::write(out.join(".tmp-ckpt-00000900-1/state.json"), "{}").unwrap();
        for s in [200, 300] {
            write_checkpoint(&out, s, &cfg, &table, &params, None, 0, &state(s), &[], 2).unwrap();
        }
        assert_eq!(
            latest_checkpoint(&out).unwrap(),
            Some(out.join("ckpt-00000300"))
        );
        let steps: Vec<u64> = list_checkpoints(&out)
            .unwrap()
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(steps, [200, 300]);
        assert!(!out.join("ckpt-00000300").join(OPTIMIZER_FILE).exists());
        // An older step written later (a restart) is never pruned itself.
        write_checkpoint(
            &out,
            150,
            &cfg,
            &table,
            &params,
            None,
            0,
            &state(150),
            &[],
            2,
        )
        .unwrap();
        let steps: Vec<u64> = list_checkpoints(&out)
            .unwrap()
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(steps, [150, 300]);
        // Replacing an existing checkpoint.
        write_checkpoint(
            &out,
            300,
            &cfg,
            &table,
            &params,
            None,
            0,
            &state(301),
            &[],
            0,
        )
        .unwrap();
        assert_eq!(
            read_state::<State>(&out.join("ckpt-00000300")).unwrap(),
            state(301)
        );
        // A failure before the rename leaves the old checkpoint and no temporary directory.
        let e = write_checkpoint(
            &out,
            300,
            &cfg,
            &table,
            &params,
            None,
            0,
            &Unserializable,
            &[],
            0,
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("injected state failure"), "{e:#}");
        let e = write_checkpoint(
            &out,
            300,
            &cfg,
            &table,
            &params[..5],
            None,
            0,
            &state(9),
            &[],
            0,
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("ckpt-00000300"), "{e:#}");
        assert_eq!(
            read_state::<State>(&out.join("ckpt-00000300")).unwrap(),
            state(301)
        );
        assert_eq!(
            names(&out),
            [
                ".tmp-ckpt-00000900-1",
                "ckpt-0000007",
                "ckpt-00000150",
                "ckpt-00000300",
                "ckpt-99999999"
            ]
        );
        // The next start cleans up.
        assert_eq!(clean_stale_tmp(&out).unwrap(), 1);
        assert!(!out.join(".tmp-ckpt-00000900-1").exists());
        let e = read_state::<State>(&out.join("ckpt-99999999")).unwrap_err();
        assert!(format!("{e:#}").contains("state.json"), "{e:#}");
    }

    #[test]
    fn clean_stale_tmp_restores_a_checkpoint_moved_aside() {
        let d = TestDir::new("ckpt-restore");
        let out = &d.0;
        let (cfg, table, params) = tiny();
        write_checkpoint(out, 5, &cfg, &table, &params, None, 0, &state(5), &[], 0).unwrap();
        // A crash between the two renames of the fallback replacement.
        fs::rename(
            out.join("ckpt-00000005"),
            out.join(".tmp-old-ckpt-00000005-42"),
        )
        .unwrap();
        fs::create_dir(out.join(".tmp-ckpt-00000005-42")).unwrap();
        // Another one whose replacement did land.
        write_checkpoint(out, 6, &cfg, &table, &params, None, 0, &state(6), &[], 0).unwrap();
        fs::create_dir(out.join(".tmp-old-ckpt-00000006-42")).unwrap();
        fs::write(out.join(".tmp-model.safetensors-42"), "x").unwrap();
        assert_eq!(
            latest_checkpoint(out).unwrap(),
            Some(out.join("ckpt-00000006"))
        );
        assert_eq!(clean_stale_tmp(out).unwrap(), 3);
        assert_eq!(names(out), ["ckpt-00000005", "ckpt-00000006"]);
        assert_eq!(
            read_state::<State>(&out.join("ckpt-00000005")).unwrap(),
            state(5)
        );
        assert_eq!(clean_stale_tmp(&out.join("missing")).unwrap(), 0);
    }
}

//! Training and validation data for `fugu train`: the `--data` argument, or the bundled
//! Shakespeare corpus prepared on first use.

use anyhow::{Context, Result};
use fugu_io::{Loader, LoaderConfig};
use std::path::Path;

/// Where `fugu train` prepares the bundled corpus when no `--data` is given.
pub const BUNDLED_DIR: &str = "data/shakespeare";

/// Returns the `--data` string to use: the given one, or the bundled corpus's manifest
/// (tokenised into `BUNDLED_DIR` once and reused afterwards).
pub fn resolve_data(data: Option<&str>, quiet: bool) -> Result<String> {
    if let Some(d) = data {
        return Ok(d.to_string());
    }
    let dir = Path::new(BUNDLED_DIR);
    let manifest = dir.join("manifest.json");
    if !manifest.exists() {
        if !quiet {
            eprintln!(
                "no --data given: tokenising the bundled Shakespeare corpus into {}",
                dir.display()
            );
        }
        let opts = fugu_io::PrepareOptions {
            out_dir: dir.to_path_buf(),
            ..Default::default()
        };
        fugu_io::prepare(&opts).context("preparing the bundled corpus")?;
    }
    Ok(manifest.display().to_string())
}

/// Opens the training loader at the start, or at a saved cursor.
pub fn train_loader(
    data: &str,
    cfg: &LoaderConfig,
    cursor: Option<&fugu_io::Cursor>,
) -> Result<Loader> {
    let loader = match cursor {
        Some(c) => Loader::resume(data, cfg, c),
        None => Loader::new(data, cfg),
    };
    loader.with_context(|| format!("opening training data {data}"))
}

/// Mean loss over the first `batches` batches of the validation split, through `loss_of`
/// (which runs a forward pass on one batch window). `None` when `data` has no validation
/// split (a `.bin` file or bare shards without `--val-data`).
pub fn eval_loss(
    data: &str,
    cfg: &LoaderConfig,
    batches: usize,
    mut loss_of: impl FnMut(&[u32]) -> Result<f32>,
) -> Result<Option<f64>> {
    let mut loader = match Loader::new(data, cfg) {
        Ok(l) => l,
        Err(_) => return Ok(None),
    };
    if loader.info().windows_per_epoch == 0 {
        return Ok(None);
    }
    let mut sum = 0.0f64;
    for _ in 0..batches {
        let batch = loader
            .next_batch()
            .with_context(|| format!("reading validation data {data}"))?;
        sum += loss_of(&batch.tokens)? as f64;
        loader.recycle(batch);
    }
    Ok(Some(sum / batches as f64))
}

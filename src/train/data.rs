//! Training and validation data for `fugu train`: the `--data` argument, or the bundled
//! Shakespeare corpus prepared on first use.

use crate::make_once::{found_or_made, LockTiming};
use crate::model::{ModelConfig, SpecialIds};
use anyhow::{bail, Context, Result};
use fugu_io::{
    tokenizer_by_name, DataSpec, Gpt2Tokenizer, Loader, LoaderConfig, Manifest, Split, Tokenizer,
    GPT2_VOCAB,
};
use std::path::{Path, PathBuf};

/// Where `fugu train` prepares the bundled corpus when no `--data` is given: tokenised with
/// GPT-2's BPE for a model with GPT-2's 50257 ids, else with a byte-level BPE of the model's
/// vocabulary size trained on the corpus (`data/shakespeare-bpeN`).
pub fn bundled_dir(vocab_size: usize) -> PathBuf {
    if vocab_size == GPT2_VOCAB as usize {
        PathBuf::from("data/shakespeare")
    } else {
        PathBuf::from(format!("data/shakespeare-bpe{vocab_size}"))
    }
}

/// Returns the `--data` string to use: the given one, or the bundled corpus's manifest for a
/// model of `vocab_size` ids (tokenised into [`bundled_dir`] once and reused afterwards; a run
/// that finds another preparing it waits for that one, [`crate::make_once`]).
pub fn resolve_data(data: Option<&str>, vocab_size: usize, quiet: bool) -> Result<String> {
    if let Some(d) = data {
        return Ok(d.to_string());
    }
    let dir = bundled_dir(vocab_size);
    let manifest = dir.join("manifest.json");
    // Runs started together (the ranks of a job, a batch of jobs) prepare it once: the others
    // wait for the first (a lock file beside the folder).
    let what = "preparing the bundled corpus";
    let prepared = || manifest.exists().then_some(());
    found_or_made(&dir, what, LockTiming::default(), prepared, || {
        let train_tokenizer = (vocab_size != GPT2_VOCAB as usize).then_some(vocab_size as u32);
        if !quiet {
            eprintln!(
                "no --data given: tokenising the bundled Shakespeare corpus into {}{}",
                dir.display(),
                match train_tokenizer {
                    Some(n) => format!(" with a byte-level BPE of {n} ids trained on it"),
                    None => " with GPT-2's BPE".into(),
                }
            );
        }
        let opts = fugu_io::PrepareOptions {
            out_dir: dir.clone(),
            train_tokenizer,
            ..Default::default()
        };
        fugu_io::prepare(&opts).context("preparing the bundled corpus")?;
        Ok(())
    })?;
    Ok(manifest.display().to_string())
}

/// A `--data` argument as an absolute path (a brace pattern too), so that the run's
/// checkpoints find it from any working directory.
pub fn absolute_data(spec: &str) -> String {
    let p = Path::new(spec);
    if p.is_absolute() {
        return spec.to_string();
    }
    std::env::current_dir()
        .map(|cwd| cwd.join(p).display().to_string())
        .unwrap_or_else(|_| spec.to_string())
}

/// The tokenizer `data` was made with: its manifest's (`gpt2`, or the `tokenizer.json` that
/// `fugu prepare` stored in the dataset folder). Token files (`.bin`, Megatron's) and bare
/// shards record none: then the tokenizer of the model the run starts from (`model_dir`, a
/// checkpoint or an `--init-from` folder holding `tokenizer.json`), else GPT-2's for a model
/// with GPT-2's 50257 ids, else `None`.
pub fn data_tokenizer(
    data: &str,
    vocab_size: usize,
    model_dir: Option<&Path>,
) -> Result<Option<Box<dyn Tokenizer>>> {
    let spec = DataSpec::parse(data).with_context(|| format!("--data {data}"))?;
    match spec {
        DataSpec::Manifest(p) => {
            let (m, dir) = Manifest::load(&p).with_context(|| format!("--data {data}"))?;
            let name = if m.tokenizer == "gpt2" {
                m.tokenizer.clone()
            } else {
                dir.join(&m.tokenizer).display().to_string()
            };
            let tok = tokenizer_by_name(&name)
                .with_context(|| format!("the tokenizer of the dataset {}", dir.display()))?;
            Ok(Some(tok))
        }
        _ => {
            if let Some(file) = model_dir
                .map(|d| d.join("tokenizer.json"))
                .filter(|f| f.is_file())
            {
                let tok = tokenizer_by_name(&file.display().to_string())
                    .with_context(|| format!("reading {}", file.display()))?;
                return Ok(Some(tok));
            }
            if vocab_size == GPT2_VOCAB as usize {
                return Ok(Some(Box::new(Gpt2Tokenizer::new())));
            }
            Ok(None)
        }
    }
}

/// Refuses a run whose starting model (`dir`: a checkpoint being resumed, or an `--init-from`
/// folder, named by `flag`) carries a `tokenizer.json` other than the one `data` was tokenised
/// with: the ids would mean other text. Tokenizers are compared by what they do (vocabulary
/// size, end-of-text id, the text of every id, the ids of a probe text), not by file bytes.
/// Nothing to compare when either side records no tokenizer.
pub fn check_model_tokenizer(dir: &Path, flag: &str, data: &str, vocab_size: usize) -> Result<()> {
    let file = dir.join("tokenizer.json");
    if !file.is_file() {
        return Ok(());
    }
    let Some(data_tok) = data_tokenizer(data, vocab_size, None)? else {
        return Ok(());
    };
    let model_tok = tokenizer_by_name(&file.display().to_string())
        .with_context(|| format!("{flag} {}: reading its tokenizer", dir.display()))?;
    let Some(difference) = fugu_io::tokenizer::difference(model_tok.as_ref(), data_tok.as_ref())
    else {
        return Ok(());
    };
    bail!(
        "{flag} {}: the model's tokenizer ({}, {} ids) is not the one --data {data} was \
         tokenised with ({}, {} ids): {difference}. The ids would stand for other text; prepare \
         the data with `fugu prepare --tokenizer {}`",
        dir.display(),
        file.display(),
        model_tok.vocab_size(),
        data_tok.name(),
        data_tok.vocab_size(),
        dir.display()
    )
}

/// What every checkpoint of a run says about its tokenizer.
pub struct CheckpointTokenizer {
    /// The Hugging Face tokenizer files (empty when the data records no tokenizer).
    pub files: Vec<(String, Vec<u8>)>,
    /// The ids `config.json` and `generation_config.json` name.
    pub ids: SpecialIds,
}

/// The tokenizer files and special ids every checkpoint of a run on `data`, starting from the
/// model in `model_dir` (if any), carries ([`data_tokenizer`]; no files, with a warning, and
/// the model's default ids when neither records a tokenizer), after checking that the
/// tokenizer's ids fit the model's `vocab_size`.
pub fn checkpoint_tokenizer(
    data: &str,
    m: &ModelConfig,
    model_dir: Option<&Path>,
) -> Result<CheckpointTokenizer> {
    let vocab_size = m.vocab_size;
    let Some(tok) = data_tokenizer(data, vocab_size, model_dir)? else {
        eprintln!(
            "warning: --data {data} records no tokenizer, nor does a model the run starts \
             from, and the model does not have GPT-2's {GPT2_VOCAB} ids: checkpoints will carry \
             no tokenizer files (`fugu sample` will need one)"
        );
        return Ok(CheckpointTokenizer {
            files: Vec::new(),
            ids: m.special_ids(),
        });
    };
    if tok.vocab_size() as usize > vocab_size {
        anyhow::bail!(
            "--data {data} was tokenised with `{}` ({} ids), but the model's vocab_size is \
             {vocab_size}: use a config whose model.vocab_size is at least {}",
            tok.name(),
            tok.vocab_size(),
            tok.vocab_size()
        );
    }
    Ok(CheckpointTokenizer {
        files: fugu_io::hf_tokenizer_files(tok.as_ref(), Some(m.n_positions))?,
        ids: SpecialIds {
            bos: tok.bos() as usize,
            eos: tok.eot() as usize,
        },
    })
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

/// Fails unless `data` (given as `flag`) opens as a validation split with at least one window
/// (with `--verify-data`, every validation shard's sha256 checked), naming the flag and the
/// loader's reason.
pub fn check_val_data(flag: &str, data: &str, cfg: &LoaderConfig) -> Result<()> {
    let loader = Loader::new(data, cfg).with_context(|| {
        format!(
            "{flag} {data}: cannot be read as validation data (a manifest with a val split, \
             or with --val-data a .bin file or shard pattern read whole)"
        )
    })?;
    if loader.info().windows_per_epoch == 0 {
        bail!(
            "{flag} {data}: its validation split holds no window of seq_len + 1 = {} tokens",
            cfg.seq_len + 1
        );
    }
    Ok(())
}

/// Mean loss over the first `batches` batches of the validation split of `data` (checked at
/// start by [`check_val_data`]: any failure now is an error), through `loss_of` (which runs a
/// forward pass on one batch window).
pub fn eval_loss(
    data: &str,
    cfg: &LoaderConfig,
    batches: usize,
    mut loss_of: impl FnMut(&[u32]) -> Result<f32>,
) -> Result<f64> {
    let mut loader =
        Loader::new(data, cfg).with_context(|| format!("opening validation data {data}"))?;
    let mut sum = 0.0f64;
    for _ in 0..batches {
        let batch = loader
            .next_batch()
            .with_context(|| format!("reading validation data {data}"))?;
        sum += loss_of(&batch.tokens)? as f64;
        loader.recycle(batch);
    }
    Ok(sum / batches as f64)
}

/// Tokens per byte of text of `data`'s `split` (see `SplitInfo::tokens_per_byte`): `None` for
/// token files, shard patterns and manifests that do not count text bytes.
pub fn tokens_per_byte(data: &str, split: Split) -> Option<f64> {
    let DataSpec::Manifest(path) = DataSpec::parse(data).ok()? else {
        return None;
    };
    let (m, _) = Manifest::load(&path).ok()?;
    match split {
        Split::Train => &m.train,
        Split::Val => &m.val,
    }
    .tokens_per_byte()
}

/// A loss in nats per token as bits per byte of text, given the data's tokens per byte.
pub fn bits_per_byte(loss: f64, tokens_per_byte: Option<f64>) -> Option<f64> {
    tokens_per_byte.map(|r| loss / std::f64::consts::LN_2 * r)
}

/// The training batches of one data-parallel rank.
///
/// The global batch (`B × dp` rows) is read as `data_ranks` equal streams of the fugu-io
/// loader (rank `k` of `data_ranks`), concatenated in stream order; data-parallel rank `d`
/// reads streams `d·data_ranks/dp ..`. The default `data_ranks = dp` is one stream per rank.
/// Fixing `data_ranks` makes the sequence of global batches independent of `dp`: a serial
/// run with `--data-ranks 2` and twice the batch sees exactly the batches of a dp = 2 run,
/// and a checkpoint resumes exactly under another `dp` (see docs/TRAINING.md).
pub struct BatchSource {
    loaders: Vec<Loader>,
}

impl BatchSource {
    /// Opens the streams of DP rank `dp_rank` of `dp`; `cfg.batch_size` is this rank's `B`.
    pub fn open(
        data: &str,
        cfg: &LoaderConfig,
        dp_rank: usize,
        dp: usize,
        data_ranks: usize,
        cursor: Option<&fugu_io::Cursor>,
    ) -> Result<BatchSource> {
        if data_ranks == 0 || !data_ranks.is_multiple_of(dp) {
            anyhow::bail!(
                "--data-ranks {data_ranks} must be a positive multiple of the data-parallel size {dp}"
            );
        }
        let per_rank = data_ranks / dp;
        if !cfg.batch_size.is_multiple_of(per_rank) {
            anyhow::bail!(
                "--data-ranks {data_ranks}: each of the {dp} data-parallel ranks reads {per_rank} \
                 streams, which must divide the per-rank batch size {}",
                cfg.batch_size
            );
        }
        let loaders = (0..per_rank)
            .map(|j| {
                let mut c = cfg.clone();
                c.batch_size = cfg.batch_size / per_rank;
                c.rank = dp_rank * per_rank + j;
                c.world = data_ranks;
                train_loader(data, &c, cursor)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(BatchSource { loaders })
    }

    /// The next batch window of this rank (`B` rows of `T + 1` tokens) into `out`.
    pub fn next_into(&mut self, out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        for l in &mut self.loaders {
            let b = l.next_batch()?;
            out.extend_from_slice(&b.tokens);
            l.recycle(b);
        }
        Ok(())
    }

    /// The loader position (the same for every stream and rank).
    pub fn cursor(&self) -> fugu_io::Cursor {
        self.loaders[0].cursor()
    }

    /// Bad samples this rank's streams skipped so far (`--skip-bad-samples`).
    pub fn skipped_bad_samples(&self) -> u64 {
        self.loaders.iter().map(|l| l.skipped_bad_samples()).sum()
    }

    /// Size of one stream (for the run header).
    pub fn info(&self) -> &fugu_io::LoaderInfo {
        self.loaders[0].info()
    }
}

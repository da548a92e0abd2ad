//! `fugu sample`: generate text from a checkpoint.

use crate::backend::{Backend, CudaSettings, Device};
use crate::checkpoint;
use crate::model::registry;
use crate::sample::{generate, Generator, SampleOptions, Stop};
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Generate text with a KV cache from a checkpoint (`ckpt-*` or any Hugging Face GPT-2 dir).
#[derive(Args, Debug, Clone)]
pub struct SampleArgs {
    /// Checkpoint directory, or a run directory (its newest checkpoint). Default: the newest
    /// checkpoint under ./runs.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// Most tokens generated per sample (fewer when the end-of-text token comes or the
    /// context, n_positions, is full; both are said on stderr).
    #[arg(long, default_value_t = 200)]
    pub max_tokens: usize,
    /// Samples to generate from the prompt, one after another (seeds seed, seed + 1, ...).
    #[arg(short = 'n', long, default_value_t = 1)]
    pub num_samples: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample from the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Then from the smallest set of most likely tokens whose probability adds up to p
    /// (nucleus sampling; 1 = all).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Go on past the end-of-text token (the tokenizer's, also the checkpoint's
    /// eos_token_id) instead of stopping there.
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    #[command(flatten)]
    pub run: RunOn,
}

/// Where an inference command runs: compute threads and device (shared by `sample` and
/// `eval`).
#[derive(Args, Debug, Clone)]
pub struct RunOn {
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where to run: cpu, cuda (device 0) or cuda:N (needs a build with --features cuda).
    #[arg(long, default_value = "cpu", value_name = "cpu|cuda|cuda:N")]
    pub device: Device,
    /// With --device cuda: TF32 tensor cores for the GEMMs (default: strict fp32).
    #[arg(long)]
    pub tf32: bool,
}

/// The newest checkpoint (by modification time) of any run under `runs`.
fn newest_under(runs: &Path) -> Result<Option<PathBuf>> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    let Ok(rd) = std::fs::read_dir(runs) else {
        return Ok(None);
    };
    for e in rd.flatten() {
        if let Some(ck) = checkpoint::latest_checkpoint(&e.path())? {
            let t = std::fs::metadata(&ck).and_then(|m| m.modified()).ok();
            if let Some(t) = t {
                if best.as_ref().is_none_or(|(bt, _)| t > *bt) {
                    best = Some((t, ck));
                }
            }
        }
    }
    Ok(best.map(|(_, p)| p))
}

/// True for a Hugging Face model directory (single-file or sharded safetensors weights).
fn is_model_dir(p: &Path) -> bool {
    p.join(checkpoint::MODEL_FILE).exists() || p.join(checkpoint::hf::INDEX_FILE).exists()
}

pub(super) fn resolve(ck: Option<&Path>) -> Result<PathBuf> {
    match ck {
        Some(p) if is_model_dir(p) => Ok(p.to_path_buf()),
        // A run folder: its newest whole checkpoint, passing over damaged ones (named on
        // stderr) as `fugu train --resume` does.
        Some(p) if !checkpoint::checkpoint_entries(p)?.is_empty() => {
            let run = p.display().to_string();
            match crate::train::resume::find(Some(&run), p, true)? {
                Some(r) => Ok(r.dir),
                None => bail!("{run}: holds no whole checkpoint"),
            }
        }
        Some(p) => checkpoint::latest_checkpoint(p)?.with_context(|| {
            let bin = if p.join("pytorch_model.bin").exists() {
                " (it has pytorch_model.bin: fugu reads safetensors only; save it with \
                 `save_pretrained(dir, safe_serialization=True)`)"
            } else {
                ""
            };
            format!(
                "{}: no model.safetensors, no {} and no ckpt-* checkpoints{bin}",
                p.display(),
                checkpoint::hf::INDEX_FILE
            )
        }),
        None => match newest_under(Path::new("runs"))? {
            Some(p) => Ok(p),
            None => bail!(
                "no --checkpoint given and no checkpoints under ./runs; run `fugu train` first"
            ),
        },
    }
}

/// Runs `fugu sample`.
pub fn run(args: SampleArgs) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        bail!(
            "--temperature {}: expected a finite number >= 0 (0 = greedy)",
            args.temperature
        );
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!(
            "--top-p {}: expected a number in (0, 1] (1 = all tokens)",
            args.top_p
        );
    }
    if args.num_samples == 0 {
        bail!("--num-samples 0: expected at least one sample");
    }
    crate::train::set_threads(args.run.threads)?;
    let dir = resolve(args.checkpoint.as_deref())?;
    let hf = checkpoint::load_hf(&dir)?;
    let table = registry::full_params(&hf.config)?;
    let mut params = vec![0.0f32; table.total()];
    hf.copy_into(&table, &mut params)?;
    check_finite_weights(&dir, &table, &params)?;
    let cuda = CudaSettings {
        tf32: args.run.tf32,
    };
    crate::with_backend!(args.run.device, cuda, |be| {
        sample_on(be, &args, &dir, &hf.config, &params)
    })
}

/// Refuses weights holding NaN or infinity (a diverged run's), naming the first tensor: they
/// would decode to one repeated token.
pub(super) fn check_finite_weights(
    dir: &Path,
    table: &crate::model::table::Table,
    params: &[f32],
) -> Result<()> {
    if let Some(i) = params.iter().position(|x| !x.is_finite()) {
        let name = table
            .specs()
            .iter()
            .find(|s| (s.offset..s.offset + s.len()).contains(&i))
            .map_or("?", |s| s.name.as_str());
        bail!(
            "{}: the weights hold non-finite values ({} in `{name}`): the run diverged before \
             this checkpoint; use an earlier one",
            dir.display(),
            params[i]
        );
    }
    Ok(())
}

/// The tokenizer of a checkpoint: its `tokenizer.json` (every fugu checkpoint has one; so do
/// most Hugging Face model directories), else GPT-2's (with a warning unless the model has
/// GPT-2's 50257 ids).
pub(super) fn checkpoint_tokenizer(
    dir: &Path,
    cfg: &crate::model::ModelConfig,
) -> Result<Box<dyn fugu_io::Tokenizer>> {
    let file = dir.join("tokenizer.json");
    if file.is_file() {
        let tok = fugu_io::tokenizer_by_name(&file.display().to_string())
            .with_context(|| format!("loading {}", file.display()))?;
        if tok.vocab_size() as usize > cfg.vocab_size {
            bail!(
                "{}: {} ids, more than the model's vocab_size {}",
                file.display(),
                tok.vocab_size(),
                cfg.vocab_size
            );
        }
        return Ok(tok);
    }
    if cfg.vocab_size != fugu_io::GPT2_VOCAB as usize {
        eprintln!(
            "warning: {}: no tokenizer.json, and the model's vocab_size {} is not GPT-2's {}; \
             using GPT-2's BPE, which may not be the tokenizer it was trained with",
            dir.display(),
            cfg.vocab_size,
            fugu_io::GPT2_VOCAB
        );
    }
    Ok(Box::new(fugu_io::Gpt2Tokenizer::new()))
}

/// Generates on backend `be` and prints the text as it comes.
fn sample_on<B: Backend>(
    be: B,
    args: &SampleArgs,
    dir: &Path,
    cfg: &crate::model::ModelConfig,
    params: &[f32],
) -> Result<()> {
    let device = be.describe();
    let mut g = Generator::new(cfg, params, be)?;
    let tok = checkpoint_tokenizer(dir, cfg)?;
    let prompt = tok.encode(&args.prompt);
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= cfg.vocab_size) {
        bail!(
            "--prompt {:?}: token id {bad} is outside the model's vocabulary of {} ids",
            args.prompt,
            cfg.vocab_size
        );
    }
    eprintln!(
        "sampling from {} ({} prompt tokens) on {device}",
        dir.display(),
        prompt.len()
    );
    let mut stdout = std::io::stdout().lock();
    for i in 0..args.num_samples {
        if i > 0 {
            writeln!(stdout, "\n---")?;
        }
        let opts = SampleOptions {
            max_tokens: args.max_tokens,
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed.wrapping_add(i as u64),
            stop: (!args.ignore_eos).then(|| tok.eot()),
        };
        write!(stdout, "{}", args.prompt)?;
        let mut text = IncrementalText::new(tok.as_ref(), &prompt)?;
        let (ids, why) = generate(&mut g, &prompt, &opts, |id| {
            if let Some(s) = text.push(id) {
                let _ = write!(stdout, "{s}");
                let _ = stdout.flush();
            }
        })?;
        write!(stdout, "{}", text.finish())?;
        stdout.flush()?;
        match why {
            Stop::MaxTokens => {}
            Stop::EndOfText => eprintln!(
                "\n(stopped at the end-of-text token after {} tokens; --ignore-eos goes on)",
                ids.len() - 1
            ),
            Stop::Context => eprintln!(
                "\n(stopped after {} of --max-tokens {}: the context of n_positions = {} is full)",
                ids.len(),
                args.max_tokens,
                cfg.n_positions
            ),
        }
    }
    writeln!(stdout)?;
    Ok(())
}

/// The text of generated ids as they come, printed only in complete UTF-8 and decoded in context:
/// the whole sequence (prompt included) is decoded each time and the new suffix returned, since
/// a token decoded alone may differ from the same token after others (a SentencePiece-style
/// decoder strips the leading space of a sequence; a byte-level token may be half a character).
struct IncrementalText<'a> {
    tok: &'a dyn fugu_io::Tokenizer,
    ids: Vec<u32>,
    /// Bytes of the decoded sequence already returned (the prompt's decoding at first).
    done: usize,
}

impl<'a> IncrementalText<'a> {
    fn new(tok: &'a dyn fugu_io::Tokenizer, prompt: &[u32]) -> Result<Self> {
        let done = tok.decode(prompt)?.len();
        Ok(IncrementalText {
            tok,
            ids: prompt.to_vec(),
            done,
        })
    }

    /// Adds a token; returns the new text once it is complete UTF-8.
    fn push(&mut self, id: u32) -> Option<String> {
        self.ids.push(id);
        let all = self.tok.decode(&self.ids).ok()?;
        if all.ends_with('\u{FFFD}') {
            return None;
        }
        self.take(all)
    }

    /// What is left (possibly an incomplete character, as U+FFFD).
    fn finish(&mut self) -> String {
        let all = self.tok.decode(&self.ids).unwrap_or_default();
        self.take(all).unwrap_or_default()
    }

    fn take(&mut self, all: String) -> Option<String> {
        let new = all.get(self.done..)?.to_string();
        self.done = all.len();
        (!new.is_empty()).then_some(new)
    }
}

#[cfg(test)]
mod tests {
    use super::IncrementalText;
    use fugu_io::Tokenizer;

    /// Printed piece by piece, generated text is what decoding the whole sequence gives after
    /// the prompt's text: with a SentencePiece-style tokenizer (a token decoded alone loses its
    /// leading space) and with GPT-2's (a character split over several byte tokens is held back
    /// until complete).
    #[test]
    fn incremental_text_is_the_whole_decoding() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/llama-tokenizer"
        );
        let llama = fugu_io::tokenizer_by_name(dir).unwrap();
        let gpt2 = fugu_io::Gpt2Tokenizer::new();
        for tok in [llama.as_ref(), &gpt2 as &dyn Tokenizer] {
            let prompt = tok.encode("Shall I compare");
            let more = tok.encode_continuation(" thee to a summer's day? 日本語 🐟 naïve");
            let mut text = IncrementalText::new(tok, &prompt).unwrap();
            let mut printed = String::new();
            let mut held = 0;
            for &id in &more {
                match text.push(id) {
                    Some(s) => printed.push_str(&s),
                    None => held += 1,
                }
            }
            printed.push_str(&text.finish());
            let all: Vec<u32> = prompt.iter().chain(&more).copied().collect();
            let whole = tok.decode(&all).unwrap();
            assert_eq!(format!("Shall I compare{printed}"), whole, "{}", tok.name());
            assert!(printed.starts_with(" thee"), "{printed:?}");
            assert!(held > 0, "{}: no token was held back", tok.name());
        }
    }
}

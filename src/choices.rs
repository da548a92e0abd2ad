//! Multiple-choice evaluation in HellaSwag's layout: a JSONL file of questions, each a context
//! (`ctx`), candidate endings (`endings`) and the index of the right one (`label`). Each
//! ending is scored by the mean next-token loss of its tokens after the context (as llm.c's
//! HellaSwag evaluation does; the sum is reported too), and the question counts as right
//! when the right ending has the lowest score.
//!
//! The context is encoded after the model's beginning-of-text id (GPT-2's end-of-text, which
//! precedes every document in training; Llama's `<s>`), each ending as a continuation of it
//! with a leading space (`" " + ending`). Scoring runs through the KV-cache decoder of
//! `fugu sample` ([`crate::sample::Generator`]): the context once, then each ending from the
//! context's end.

use crate::backend::Backend;
use crate::sample::Generator;
use anyhow::{bail, Context, Result};
use fugu_io::Tokenizer;
use std::path::Path;

/// One question.
#[derive(Clone, Debug, PartialEq)]
pub struct Question {
    /// 1-based line in its file.
    pub line: usize,
    pub context: String,
    pub endings: Vec<String>,
    /// Index of the right ending.
    pub label: usize,
}

/// Reads a HellaSwag-layout JSONL file; a line without a string `ctx`, a list of at least two
/// string `endings`, or an integer `label` indexing them is an error naming `file:line`.
pub fn read_questions(path: &Path) -> Result<Vec<Question>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: invalid JSON", at()))?;
        let context = v
            .get("ctx")
            .and_then(|c| c.as_str())
            .with_context(|| format!("{}: no string field `ctx` (the context)", at()))?;
        let endings: Vec<String> = v
            .get("endings")
            .and_then(|e| e.as_array())
            .and_then(|a| a.iter().map(|x| x.as_str().map(str::to_owned)).collect())
            .filter(|e: &Vec<String>| e.len() >= 2)
            .with_context(|| {
                format!("{}: `endings` must be a list of at least two strings", at())
            })?;
        let label = match v.get("label") {
            Some(serde_json::Value::Number(n)) => n.as_u64(),
            // HellaSwag's own files write the label as a string ("2").
            Some(serde_json::Value::String(s)) => s.parse().ok(),
            _ => None,
        }
        .filter(|&l| (l as usize) < endings.len())
        .with_context(|| {
            format!(
                "{}: `label` must be the index of the right ending (0..{})",
                at(),
                endings.len() - 1
            )
        })? as usize;
        out.push(Question {
            line: i + 1,
            context: context.to_owned(),
            endings,
            label,
        });
    }
    if out.is_empty() {
        bail!("{}: holds no question", path.display());
    }
    Ok(out)
}

/// A decoder that can be rewound: what scoring needs from a model.
pub trait NextToken {
    /// Feeds one token at the current position; the next-token logits.
    fn feed(&mut self, token: u32) -> Result<Vec<f32>>;
    /// Continues from position `pos` (≤ the current one): later positions are overwritten.
    fn rewind(&mut self, pos: usize);
    /// The longest sequence it takes.
    fn context_len(&self) -> usize;
}

impl<B: Backend> NextToken for Generator<B> {
    fn feed(&mut self, token: u32) -> Result<Vec<f32>> {
        self.step(token)
    }
    fn rewind(&mut self, pos: usize) {
        self.rewind_to(pos);
    }
    fn context_len(&self) -> usize {
        self.config().n_positions
    }
}

/// `-log softmax(logits)[token]`, in f64.
fn nll(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    max + sum.ln() - logits[token as usize] as f64
}

/// Each ending's summed and mean loss after `context` (token ids, non-empty).
pub fn ending_losses(
    model: &mut dyn NextToken,
    context: &[u32],
    endings: &[Vec<u32>],
) -> Result<Vec<(f64, f64)>> {
    model.rewind(0);
    let mut after_context = Vec::new();
    for &t in context {
        after_context = model.feed(t)?;
    }
    endings
        .iter()
        .map(|ending| {
            model.rewind(context.len());
            let mut logits = after_context.clone();
            let mut sum = 0.0;
            for (i, &t) in ending.iter().enumerate() {
                sum += nll(&logits, t);
                if i + 1 < ending.len() {
                    logits = model.feed(t)?;
                }
            }
            Ok((sum, sum / ending.len() as f64))
        })
        .collect()
}

/// The result over a file.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ChoiceScore {
    pub questions: usize,
    /// Right by the lowest mean loss per ending token (the reported accuracy).
    pub correct: usize,
    pub accuracy: f64,
    /// Right by the lowest summed loss.
    pub correct_by_sum: usize,
    pub accuracy_by_sum: f64,
    /// Each question's mean loss per ending token, ending by ending.
    pub mean_losses: Vec<Vec<f64>>,
}

/// Scores every question with `model` and `tok`; `progress` is told each question's index.
pub fn score(
    model: &mut dyn NextToken,
    tok: &dyn Tokenizer,
    questions: &[Question],
    mut progress: impl FnMut(usize),
) -> Result<ChoiceScore> {
    let argmin = |xs: &[f64]| {
        xs.iter()
            .enumerate()
            .fold(
                (0, f64::INFINITY),
                |b, (i, &x)| if x < b.1 { (i, x) } else { b },
            )
            .0
    };
    let (mut correct, mut correct_by_sum) = (0, 0);
    let mut mean_losses = Vec::with_capacity(questions.len());
    for (i, q) in questions.iter().enumerate() {
        progress(i);
        let mut context = vec![tok.bos()];
        context.extend(tok.encode(&q.context));
        let endings: Vec<Vec<u32>> = q
            .endings
            .iter()
            .map(|e| tok.encode_continuation(&format!(" {e}")))
            .collect();
        let longest = endings.iter().map(Vec::len).max().unwrap_or(0);
        if endings.iter().any(Vec::is_empty) || context.len() + longest > model.context_len() {
            bail!(
                "question on line {}: the context and an ending take {} tokens, beyond the \
                 model's {} positions (or an ending is empty)",
                q.line,
                context.len() + longest,
                model.context_len()
            );
        }
        let losses = ending_losses(model, &context, &endings)?;
        let means: Vec<f64> = losses.iter().map(|l| l.1).collect();
        let sums: Vec<f64> = losses.iter().map(|l| l.0).collect();
        correct += usize::from(argmin(&means) == q.label);
        correct_by_sum += usize::from(argmin(&sums) == q.label);
        mean_losses.push(means);
    }
    let n = questions.len();
    Ok(ChoiceScore {
        questions: n,
        correct,
        accuracy: correct as f64 / n as f64,
        correct_by_sum,
        accuracy_by_sum: correct_by_sum as f64 / n as f64,
        mean_losses,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bigram "model": the logits after token `t` are `table[t]`; records rewinds.
    struct Bigram {
        table: Vec<Vec<f32>>,
        pos: usize,
        fed: Vec<(usize, u32)>,
    }

    impl NextToken for Bigram {
        fn feed(&mut self, token: u32) -> Result<Vec<f32>> {
            self.fed.push((self.pos, token));
            self.pos += 1;
            Ok(self.table[token as usize].clone())
        }
        fn rewind(&mut self, pos: usize) {
            assert!(pos <= self.pos);
            self.pos = pos;
        }
        fn context_len(&self) -> usize {
            16
        }
    }

    fn log_softmax(row: &[f32], i: usize) -> f64 {
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        row[i] as f64 - z.ln()
    }

    #[test]
    fn endings_are_scored_by_their_tokens_after_the_context() {
        let table: Vec<Vec<f32>> = (0..4)
            .map(|t| (0..4).map(|j| ((t * 3 + j * 5) % 7) as f32 * 0.5).collect())
            .collect();
        let mut m = Bigram {
            table: table.clone(),
            pos: 0,
            fed: Vec::new(),
        };
        let losses = ending_losses(&mut m, &[2, 1], &[vec![3, 0], vec![1]]).unwrap();
        // Ending [3, 0]: -log p(3 | 1) - log p(0 | 3); ending [1]: -log p(1 | 1).
        let a = -log_softmax(&table[1], 3) - log_softmax(&table[3], 0);
        let b = -log_softmax(&table[1], 1);
        assert!((losses[0].0 - a).abs() < 1e-12 && (losses[0].1 - a / 2.0).abs() < 1e-12);
        assert!((losses[1].0 - b).abs() < 1e-12 && (losses[1].1 - b).abs() < 1e-12);
        // The context is fed once; each ending from the context's end, its last token never.
        assert_eq!(m.fed, vec![(0, 2), (1, 1), (2, 3)]);
    }

    #[test]
    fn questions_are_read_strictly() {
        let dir = std::env::temp_dir().join(format!("fugu-choices-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("q.jsonl");
        std::fs::write(
            &f,
            "{\"ctx\": \"A man\", \"endings\": [\"runs\", \"sits\"], \"label\": 1}\n\n\
             {\"ctx\": \"B\", \"endings\": [\"x\", \"y\", \"z\"], \"label\": \"2\"}\n",
        )
        .unwrap();
        let q = read_questions(&f).unwrap();
        assert_eq!((q.len(), q[0].label, q[1].label, q[1].line), (2, 1, 2, 3));
        for (bad, want) in [
            ("{\"endings\": [\"a\", \"b\"], \"label\": 0}", "`ctx`"),
            (
                "{\"ctx\": \"c\", \"endings\": [\"a\"], \"label\": 0}",
                "at least two",
            ),
            (
                "{\"ctx\": \"c\", \"endings\": [\"a\", \"b\"], \"label\": 2}",
                "0..1",
            ),
            (
                "{\"ctx\": \"c\", \"endings\": [\"a\", 3], \"label\": 0}",
                "strings",
            ),
            ("not json", "invalid JSON"),
        ] {
            std::fs::write(&f, format!("{bad}\n")).unwrap();
            let e = format!("{:#}", read_questions(&f).unwrap_err());
            assert!(e.contains("q.jsonl:1") && e.contains(want), "{e}");
        }
        std::fs::write(&f, "\n").unwrap();
        assert!(format!("{:#}", read_questions(&f).unwrap_err()).contains("no question"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! `FUGU_FLASH_SELECT=timed`: the fused attention's form chosen per shape by timing, as
//! `FUGU_GEMM_SELECT=timed` chooses cuBLASLt's algorithms.
//!
//! The fused attention has 36 forms on an H100 or H200 (`FUGU_FLASH_MMA`,
//! `FUGU_FLASH_OVERLAP`, `FUGU_FLASH_BACKWARD`, `FUGU_FLASH_QUERY_ROWS`,
//! `FUGU_FLASH_WARP_ROWS`: [`FlashForm::every`]; for heads of 64, 8 distinct forward kernels
//! and 15 backward passes), and which is fastest depends on the GPU, the head size, the
//! sequence length and the batch; the defaults are the forms measured fastest on one H200 for
//! GPT-2 124M. With `timed`, the first forward (and backward) call of each shape runs every
//! form once, untimed, to learn which kernels it launches and to hold its results to the
//! default form's (one that computes something else, a kernel broken on a new GPU, is named in
//! a warning and left out); each distinct kernel set left is then timed, [`TIMED_ROUNDS`]
//! rounds of [`TIMED_CALLS`] calls, alternating so that drift hits all alike, and the one with
//! the fastest round runs: the forward and the backward pass each take their fastest form.
//! Timed calls write scratch outputs, never the caller's; the caller's call then runs the
//! chosen form. A note on stderr names each choice and the default form's time beside it.
//!
//! Choices are kept on disk per GPU model, compute capability and build of the kernels (their
//! source, compiler options and NVRTC: any change is another file, never a stale hit), one line
//! per (pass, shape, type, rope), shared by a job's ranks: the first rank to find a shape
//! missing times it under a lock file beside the cache's and stores its choice before letting
//! the lock go, the others wait for that choice (`choice_cache.rs`). A resumed run, and every
//! rank, runs the same forms, so a run stays bit-identical to an uninterrupted one though
//! forms may sum in other orders.
//!
//! Where: `FUGU_ATTENTION_CACHE` (a directory; `off` keeps choices for the process only), else
//! `$XDG_CACHE_HOME/fugu/attention`, else `$HOME/.cache/fugu/attention`.

use super::attention::FlashBackwardCall;
use super::choice_cache::{file_part, short_sha, ChoiceCache, Entry};
use super::engine::Arg;
use super::{AttnDims, CudaBackend, DevAlloc, Dtype, FlashForm, Span};
use crate::backend::knobs::{FlashSelect, Knobs, FLASH_FORM_ENVS};
use crate::ops::attention::{form_tolerance, max_rel_diff};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Environment variable: the timed attention forms' directory, or `off`.
pub const ATTENTION_CACHE_ENV: &str = "FUGU_ATTENTION_CACHE";

/// The first line of a cache file.
const HEADER: &str = "fugu attention forms, format 1";

/// Rounds of timing per (pass, shape): every candidate once per round, in turn.
pub const TIMED_ROUNDS: usize = 3;
/// Calls per candidate and round (its time is their mean; a candidate's fastest round counts).
pub const TIMED_CALLS: usize = 2;

/// The pass a form is chosen for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashPass {
    Forward,
    Backward,
}

/// One stored choice: the form, and how it was chosen (for the reader).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FormChoice {
    pub form: FlashForm,
    /// How many forms were timed (those launching distinct kernels whose results agreed with
    /// the default form's).
    pub timed: usize,
    /// The default form's time and the chosen one's, in ms per call.
    pub default_ms: f32,
    pub chosen_ms: f32,
}

impl Entry for FormChoice {
    const HEADER: &'static str = HEADER;
    const CACHE: &'static str = "the attention form cache";
    const CHOICES: &'static str = "timed attention forms";
    const ENV: &'static str = ATTENTION_CACHE_ENV;

    /// Every form setting, written out (a default that changes later does not change what a
    /// stored choice means), then the forms timed and the times: `FUGU_FLASH_WARP_ROWS=16,16,16
    /// … timed=N default_ms=F chosen_ms=F`.
    fn fields(&self) -> String {
        let f = &self.form;
        let r = f.warp_rows;
        let settings = [
            format!("{},{},{}", r.forward, r.dq, r.dkv),
            f.query_rows.0.to_string(),
            f.mma.name().to_string(),
            f.overlap.name().to_string(),
            f.backward.name().to_string(),
        ];
        let mut out: Vec<String> = FLASH_FORM_ENVS
            .iter()
            .zip(settings)
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        out.push(format!("timed={}", self.timed));
        out.push(format!("default_ms={}", self.default_ms));
        out.push(format!("chosen_ms={}", self.chosen_ms));
        out.join(" ")
    }

    /// The settings are read as the environment's are ([`Knobs::read`]), each required.
    fn parse(text: &str) -> Result<FormChoice> {
        let mut fields = HashMap::new();
        for f in text.split(' ') {
            let (k, v) = f
                .split_once('=')
                .with_context(|| format!("expected NAME=VALUE, not {f:?}"))?;
            if fields.insert(k, v).is_some() {
                bail!("{k} given twice");
            }
        }
        let mut take = |k: &str| fields.remove(k).with_context(|| format!("no {k}"));
        let mut settings = HashMap::new();
        for k in FLASH_FORM_ENVS {
            settings.insert(k, take(k)?.to_string());
        }
        let timed = take("timed")?.parse().context("timed")?;
        let default_ms = take("default_ms")?.parse().context("default_ms")?;
        let chosen_ms = take("chosen_ms")?.parse().context("chosen_ms")?;
        if let Some(k) = fields.keys().next() {
            bail!("unexpected field {k}");
        }
        let k = Knobs::read(|k| settings.get(k).cloned())?;
        let backward = k
            .flash_backward
            .ok_or_else(|| anyhow!("the backward form is empty"))?;
        Ok(FormChoice {
            form: FlashForm {
                warp_rows: k.flash_warp_rows,
                query_rows: k.flash_query_rows,
                mma: k.flash_mma,
                overlap: k.flash_overlap,
                backward,
            },
            timed,
            default_ms,
            chosen_ms,
        })
    }
}

/// `bytes` for a note: in KiB below a MiB (the emulator's small shapes), else in MiB.
fn size_text(bytes: usize) -> String {
    match bytes {
        b if b < 1 << 20 => format!("{} KiB", b.div_ceil(1 << 10)),
        b => format!("{:.0} MiB", b as f64 / (1 << 20) as f64),
    }
}

/// What one choice is for: the pass, the shape, the type, and whether the backward kernels
/// undo RoPE in their stores (they do more work).
pub fn shape_key(pass: FlashPass, d: AttnDims, dt: Dtype, rope: bool) -> String {
    let pass = match pass {
        FlashPass::Forward => "forward",
        FlashPass::Backward => "backward",
    };
    let rope = if rope { " rope" } else { "" };
    format!(
        "{pass} b={} t={} heads={} kv={} hs={} {}{rope}",
        d.b,
        d.t,
        d.nh,
        d.kv,
        d.hs,
        dt.name()
    )
}

/// One pass to time: its outputs' lengths and types (written to scratch), the scratch a form
/// takes of its own, and one call of a form on scratch outputs at the given addresses.
struct TimedPass<'a> {
    outs: &'a [(usize, Dtype)],
    scratch: &'a dyn Fn(&CudaBackend, FlashForm) -> usize,
    run: &'a mut dyn FnMut(&mut CudaBackend, FlashForm, &[u64]),
}

/// One scratch output of a timed call: its address, length and storage type.
struct Out {
    ptr: u64,
    len: usize,
    dt: Dtype,
}

/// Whether a form's outputs `got` agree with the default form's `want` (each output within
/// [`form_tolerance`] of its type, [`max_rel_diff`]); where they do not, which output is how
/// far off.
fn agreement(outs: &[Out], got: &[Vec<f32>], want: &[Vec<f32>]) -> Result<(), String> {
    for (i, ((o, g), w)) in outs.iter().zip(got).zip(want).enumerate() {
        let (diff, tol) = (max_rel_diff(g, w), form_tolerance(o.dt));
        // NaN (a NaN in either) is no agreement.
        if diff.is_nan() || diff > tol {
            return Err(format!(
                "output {i} ({}) off by {diff:.1e} of its largest value, more than {tol:.0e}",
                o.dt.name()
            ));
        }
    }
    Ok(())
}

/// The timed choices of a backend ([`FlashSelect::Timed`]).
pub(super) struct TimedForms {
    /// The form this process runs per [`shape_key`]: timed here, or taken from the disk.
    chosen: HashMap<String, FlashForm>,
    /// The choices on disk: opened at the first timed call.
    cache: Option<ChoiceCache<FormChoice>>,
    /// Rounds, and calls per round ([`TIMED_ROUNDS`], [`TIMED_CALLS`]; tests use fewer).
    rounds: usize,
    calls: usize,
    /// The cache's directory where set by [`CudaBackend::set_attention_cache`] (`Some(None)`:
    /// in memory only); `None`, the environment's.
    dir: Option<Option<PathBuf>>,
}

impl Default for TimedForms {
    fn default() -> Self {
        TimedForms {
            chosen: HashMap::new(),
            cache: None,
            rounds: TIMED_ROUNDS,
            calls: TIMED_CALLS,
            dir: None,
        }
    }
}

impl CudaBackend {
    /// How the fused attention's form is chosen ([`FlashSelect`]).
    pub fn set_flash_select(&mut self, select: FlashSelect) {
        self.flash_select = select;
    }

    /// Rounds of timing, and calls per round, of [`FlashSelect::Timed`] (tests: 1 and 1).
    pub fn set_flash_timing(&mut self, rounds: usize, calls: usize) {
        assert!(
            rounds >= 1 && calls >= 1,
            "flash timing: {rounds} × {calls}"
        );
        self.timed_forms.rounds = rounds;
        self.timed_forms.calls = calls;
    }

    /// Keeps the timed choices in `dir` (`None`: for the process only) instead of the
    /// environment's directory, and forgets those made so far: the next call of each shape
    /// takes the form stored there, or times them again.
    pub fn set_attention_cache(&mut self, dir: Option<&Path>) {
        let t = &mut self.timed_forms;
        t.chosen.clear();
        t.cache = None;
        t.dir = Some(dir.map(Path::to_path_buf));
    }

    /// The form the forward pass runs on this shape: the settings', or the timed choice
    /// (timed now on scratch outputs where there is none).
    pub(super) fn forward_form(&mut self, qkv: Span, d: AttnDims, dt: Dtype) -> FlashForm {
        if self.flash_select == FlashSelect::Settings {
            return self.flash;
        }
        let key = shape_key(FlashPass::Forward, d, dt, false);
        let outs = [
            (d.b * d.t * d.nh * d.hs, dt),
            (d.b * d.nh * d.t, Dtype::F32),
        ];
        let pass = TimedPass {
            outs: &outs,
            scratch: &|_, _| 0,
            run: &mut |be, f, s| be.flash_forward(f, (s[0], s[1]), qkv, d, dt),
        };
        self.timed_form(key, pass)
    }

    /// The form the backward pass runs for `call`: the settings', or the timed choice (timed
    /// now, writing scratch gradients, where there is none).
    pub(super) fn backward_form_for(&mut self, call: &FlashBackwardCall) -> FlashForm {
        if self.flash_select == FlashSelect::Settings {
            return self.flash;
        }
        let rope = !matches!(call.rope[0], Arg::Ptr(0));
        let key = shape_key(FlashPass::Backward, call.d, call.dt, rope);
        let outs = [(call.d.b * call.d.t * call.d.shape().qkv_width(), call.dt)];
        let pass = TimedPass {
            outs: &outs,
            scratch: &|be, f| be.backward_scratch_bytes(f, call.d, call.dt),
            run: &mut |be, form, s| {
                be.flash_backward(&FlashBackwardCall {
                    form,
                    dqkv: s[0],
                    ..*call
                })
            },
        };
        self.timed_form(key, pass)
    }

    /// The choice for `key`: made before in this process, or stored on disk (where the device
    /// runs it), or timed now ([`Self::time_forms`]) and stored. Where the scratch outputs
    /// cannot be allocated, the settings' form, with a note.
    fn timed_form(&mut self, key: String, pass: TimedPass) -> FlashForm {
        if let Some(&f) = self.timed_forms.chosen.get(&key) {
            return f;
        }
        let mut cache = match self.timed_forms.cache.take() {
            Some(c) => c,
            None => self.open_form_cache(),
        };
        let wgmma = self.has_wgmma();
        let runnable = |c: &FormChoice| c.form.refusal(wgmma).is_none();
        let what = "timing the attention's forms";
        let form = match cache.choose(&key, what, runnable, || self.time_on_scratch(&key, pass)) {
            Ok(c) => c.form,
            Err(e) => {
                eprintln!("note: attention {key}: {e:#}; running the default form");
                self.flash
            }
        };
        self.timed_forms.cache = Some(cache);
        self.timed_forms.chosen.insert(key, form);
        form
    }

    /// [`Self::time_forms`] for `pass` on scratch outputs, given back afterwards with the forms'
    /// own scratch (the one-kernel backward's accumulators, stored dS: the chosen form takes
    /// what it needs); an error where the outputs cannot be allocated.
    fn time_on_scratch(&mut self, key: &str, pass: TimedPass) -> Result<FormChoice> {
        let scratch = self
            .scratch_outputs(pass.outs)
            .context("no memory to time its forms")?;
        let outs: Vec<Out> = scratch
            .iter()
            .zip(pass.outs)
            .map(|(a, &(len, dt))| Out {
                ptr: a.ptr,
                len,
                dt,
            })
            .collect();
        let timed = self.time_forms(key, &outs, pass.scratch, pass.run);
        // Queued calls may still write the scratch.
        crate::backend::Backend::sync(self);
        drop(scratch);
        self.attn_dq = Default::default();
        Ok(timed)
    }

    /// The cache of this device's and kernel build's choices ([`super::engine::Engine::kernels_identity`]),
    /// in the directory [`Self::set_attention_cache`] or the environment names; a note says
    /// how many shapes it already holds.
    fn open_form_cache(&self) -> ChoiceCache<FormChoice> {
        let identity = self.eng.kernels_identity();
        let device = file_part(&self.eng.describe());
        let device: Vec<&str> = device.split('-').filter(|w| !w.is_empty()).collect();
        let name = format!(
            "attention-{}-{}.txt",
            device.join("-").chars().take(40).collect::<String>(),
            short_sha(&identity, 12)
        );
        let cache = match &self.timed_forms.dir {
            Some(dir) => ChoiceCache::open(dir.as_deref(), &name, identity),
            None => ChoiceCache::from_env("attention", &name, identity),
        };
        if let (false, Some(file)) = (cache.is_empty(), cache.file()) {
            eprintln!(
                "note: attention forms timed before for {} shapes, from {}",
                cache.len(),
                file.display()
            );
        }
        cache
    }

    /// Scratch outputs of `outs`' lengths and types for timed calls.
    fn scratch_outputs(&mut self, outs: &[(usize, Dtype)]) -> Result<Vec<DevAlloc>> {
        outs.iter()
            .map(|&(len, dt)| self.eng.alloc((len * dt.bytes()).max(1)))
            .collect()
    }

    /// Every form of [`FlashForm::every`] that launches other kernels for this pass than the
    /// ones before it (each run once untimed to find out) and whose results agree with the
    /// default form's ([`agreement`]; one that does not is named in a warning and left out),
    /// timed in alternating rounds; the fastest, with the default form's time beside it, named
    /// in a note.
    fn time_forms(
        &mut self,
        key: &str,
        outs: &[Out],
        scratch: &dyn Fn(&CudaBackend, FlashForm) -> usize,
        run: &mut dyn FnMut(&mut CudaBackend, FlashForm, &[u64]),
    ) -> FormChoice {
        let ptrs: Vec<u64> = outs.iter().map(|o| o.ptr).collect();
        let mut candidates: Vec<FlashForm> = Vec::new();
        // The kernel sets run so far, those left out too.
        let mut seen: Vec<Vec<usize>> = Vec::new();
        let mut reference: Option<Vec<Vec<f32>>> = None;
        let mut too_big: Vec<String> = Vec::new();
        for form in FlashForm::every(self.has_wgmma()) {
            let bytes = scratch(self, form);
            if !self.scratch_fits(bytes) {
                too_big.push(format!("{} ({})", form.label(), size_text(bytes)));
                continue;
            }
            let kernels = self.launches_of(|be| run(be, form, &ptrs));
            if seen.contains(&kernels) {
                continue;
            }
            seen.push(kernels);
            let got: Vec<Vec<f32>> = outs.iter().map(|o| self.read_out(o)).collect();
            // The default form comes first: the others are held to its results.
            if let Some(want) = &reference {
                if let Err(why) = agreement(outs, &got, want) {
                    eprintln!(
                        "warning: attention {key}: {} left out of the timing, its results are \
                         not the default form's: {why}",
                        form.label()
                    );
                    continue;
                }
            } else {
                reference = Some(got);
            }
            candidates.push(form);
        }
        if let (false, Some(free)) = (too_big.is_empty(), self.scratch_room()) {
            eprintln!(
                "note: attention {key}: {} forms not timed, their own scratch exceeding the {} \
                 free: {}",
                too_big.len(),
                size_text(free),
                too_big.join(", ")
            );
        }
        let clock = self.eng.clock();
        let (rounds, calls) = (self.timed_forms.rounds, self.timed_forms.calls);
        let mut ms = vec![f64::INFINITY; candidates.len()];
        for _ in 0..rounds {
            for (i, form) in candidates.iter().enumerate() {
                let start = clock.mark();
                for _ in 0..calls {
                    run(self, *form, &ptrs);
                }
                let end = clock.mark();
                ms[i] = ms[i].min(clock.take_interval(start, end) / calls as f64);
            }
        }
        let best = (0..ms.len())
            .min_by(|&i, &j| ms[i].total_cmp(&ms[j]))
            .expect("the default form is a candidate");
        let default = FlashForm::default();
        let default_ms = candidates
            .iter()
            .position(|f| *f == default)
            .map_or(f64::NAN, |i| ms[i]);
        let chosen = candidates[best];
        eprintln!(
            "note: attention {key}: {} forms timed, the default {default_ms:.4} ms, {} {:.4} ms \
             ({:+.1}%)",
            candidates.len(),
            chosen.label(),
            ms[best],
            (ms[best] / default_ms - 1.0) * 100.0
        );
        FormChoice {
            form: chosen,
            timed: candidates.len(),
            default_ms: default_ms as f32,
            chosen_ms: ms[best] as f32,
        }
    }

    /// Whether a form's own scratch of `bytes` fits in the device's free memory with what its
    /// scratch already holds ([`Self::scratch_room`]; a device that cannot tell: yes). Timing
    /// a form must not end the run.
    fn scratch_fits(&self, bytes: usize) -> bool {
        self.scratch_room().is_none_or(|room| bytes <= room)
    }

    /// The free memory and what the forms' scratch holds already, if the device tells.
    fn scratch_room(&self) -> Option<usize> {
        let held = self.attn_dq.0.as_ref().map_or(0, |a| a.bytes);
        Some(self.eng.free_bytes()? + held)
    }

    /// A scratch output's values (after the work queued so far).
    fn read_out(&self, o: &Out) -> Vec<f32> {
        let mut v = vec![0.0; o.len];
        self.download_raw(o.ptr, o.dt, &mut v);
        v
    }

    /// The kernels `f` launches (indices, each once), whatever an outer
    /// [`Self::log_launches`] is noting (which goes on without them).
    fn launches_of(&mut self, f: impl FnOnce(&mut CudaBackend)) -> Vec<usize> {
        let outer = self.launch_log.borrow_mut().replace(Vec::new());
        f(self);
        std::mem::replace(&mut *self.launch_log.borrow_mut(), outer).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::knobs::{FlashBackward, FlashMma, FlashOverlap, FlashQueryRows};

    #[test]
    fn every_form_is_stored_and_read_back_exactly() {
        let forms = FlashForm::every(true);
        assert_eq!(forms.len(), 36);
        assert_eq!(FlashForm::every(false).len(), 24);
        for (i, &form) in forms.iter().enumerate() {
            let c = FormChoice {
                form,
                timed: i + 1,
                default_ms: 0.25,
                chosen_ms: 0.125 + i as f32 / 1024.0,
            };
            let text = c.fields();
            assert!(!text.contains(" | ") && !text.contains('\n'), "{text}");
            assert_eq!(FormChoice::parse(&text).unwrap(), c, "{text}");
        }
        let wide = FlashForm {
            warp_rows: crate::backend::knobs::FlashWarpRows {
                forward: 32,
                dq: 16,
                dkv: 32,
            },
            query_rows: FlashQueryRows(128),
            mma: FlashMma::Sync,
            overlap: FlashOverlap::Off,
            backward: FlashBackward::Fused,
        };
        let c = FormChoice {
            form: wide,
            timed: 9,
            default_ms: 1.0,
            chosen_ms: 0.5,
        };
        assert_eq!(
            c.fields(),
            "FUGU_FLASH_WARP_ROWS=32,16,32 FUGU_FLASH_QUERY_ROWS=128 FUGU_FLASH_MMA=sync \
             FUGU_FLASH_OVERLAP=off FUGU_FLASH_BACKWARD=fused timed=9 default_ms=1 chosen_ms=0.5"
        );
    }

    #[test]
    fn a_damaged_entry_names_what_is_wrong() {
        let good = FormChoice {
            form: FlashForm::default(),
            timed: 1,
            default_ms: 1.0,
            chosen_ms: 0.5,
        }
        .fields();
        for (damaged, want) in [
            (
                good.replace("FUGU_FLASH_MMA=sync ", ""),
                "no FUGU_FLASH_MMA",
            ),
            (
                good.replace("=sync", "=tma"),
                "FUGU_FLASH_MMA=tma: expected sync or wgmma",
            ),
            (good.replace("=split", "="), "the backward form is empty"),
            (good.replace("chosen_ms=0.5", "chosen_ms=fast"), "chosen_ms"),
            (format!("{good} extra=1"), "unexpected field extra"),
            (format!("{good} chosen_ms=1"), "chosen_ms given twice"),
            (
                good.replace(" default_ms=1", " default_ms"),
                "expected NAME=VALUE",
            ),
        ] {
            let e = format!("{:#}", FormChoice::parse(&damaged).unwrap_err());
            assert!(e.contains(want), "{damaged}: {e}");
        }
    }

    /// A form is held to the default's results output by output, at its type's tolerance; a
    /// NaN is never agreement.
    #[test]
    fn a_form_that_computes_something_else_is_left_out() {
        let outs = [
            Out {
                ptr: 0,
                len: 3,
                dt: Dtype::Bf16,
            },
            Out {
                ptr: 0,
                len: 2,
                dt: Dtype::F32,
            },
        ];
        let want = vec![vec![1.0, -2.0, 4.0], vec![5.0, 6.0]];
        let near = vec![vec![1.0, -2.0, 4.0 + 0.1], vec![5.0, 6.0 + 5e-4]];
        assert_eq!(agreement(&outs, &near, &want), Ok(()));
        let off = vec![vec![1.0, -2.0, 4.5], vec![5.0, 6.0]];
        let e = agreement(&outs, &off, &want).unwrap_err();
        assert!(e.starts_with("output 0 (bf16) off by 1.2e-1"), "{e}");
        let lse_off = vec![want[0].clone(), vec![5.0, 6.01]];
        let e = agreement(&outs, &lse_off, &want).unwrap_err();
        assert!(e.starts_with("output 1 (f32)"), "{e}");
        let nan = vec![vec![1.0, f32::NAN, 4.0], want[1].clone()];
        assert!(agreement(&outs, &nan, &want).is_err());
    }

    #[test]
    fn each_pass_shape_type_and_rope_has_its_key() {
        let d = AttnDims {
            b: 16,
            t: 1024,
            nh: 12,
            kv: 4,
            hs: 64,
        };
        assert_eq!(
            shape_key(FlashPass::Backward, d, Dtype::Bf16, true),
            "backward b=16 t=1024 heads=12 kv=4 hs=64 bf16 rope"
        );
        assert_eq!(
            shape_key(FlashPass::Forward, d, Dtype::F16, false),
            "forward b=16 t=1024 heads=12 kv=4 hs=64 f16"
        );
    }
}

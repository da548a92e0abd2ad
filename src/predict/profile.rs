//! Machine profiles: what `fugu predict` knows about a machine, in a small TOML file
//! (`docs/PREDICT.md` documents every field; `profiles/` ships examples).
//!
//! ```toml
//! [machine]
//! name = "fugaku"
//! estimate = true                # from published figures, not measured by fugu
//! cores_per_node = 48
//! peak_gflops_per_core = 140.8   # FP32
//! memory_gib_per_node = 32
//! ranks_per_node = 4             # the defaults of `fugu predict`
//! threads_per_rank = 12
//! sources = ["..."]
//!
//! [compute]                      # one of:
//! model_tflops_per_node = 1.09   #   a rate for the model FLOPs, or
//! [compute.reference]            #   a reference run's per-op times (`fugu predict profile`),
//! [[compute.gemm]]               #   with optional measured GEMM rates (`fugu bench gemm`), or
//! [compute.kernels]              #   GEMM rates per precision and the memory bandwidth
//!
//! [network]
//! intra = { alpha_us = 0.5, beta_gbs = 10.0 }
//! inter = { alpha_us = 1.0, beta_gbs = 6.8 }
//! ```

use super::gemm::{read_bench_gemm, GemmRate, GemmRates, GEMM_RATE_FIELDS};
use super::network::{fit_link, fit_reduce, ClassLinks, Group, Link, Network, Traffic};
use super::step::{Compute, KernelRates, Machine, Reference};
use crate::model::ModelConfig;
use crate::report::comm::read_comm;
use crate::report::runs::{read_run, ModelDims, Run};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A machine profile file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub machine: MachineSection,
    pub compute: ComputeSection,
    pub network: Network,
}

/// `[machine]`.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineSection {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// True when the numbers are estimates from published figures rather than measurements.
    #[serde(default)]
    pub estimate: bool,
    pub cores_per_node: usize,
    pub peak_gflops_per_core: f64,
    pub memory_gib_per_node: f64,
    pub ranks_per_node: usize,
    pub threads_per_rank: usize,
    #[serde(default)]
    pub sources: Vec<String>,
}

/// `[compute]`: exactly one of the three.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComputeSection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_tflops_per_node: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<Reference>,
    /// Measured GEMM rates (with a reference only): the GEMM ops then scale by their
    /// predicted time at each shape instead of their FLOPs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gemm: Vec<GemmRate>,
    /// The machine's kernels: GEMM rates per precision and the memory bandwidth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernels: Option<KernelRates>,
}

impl Profile {
    /// Reads and checks a profile, naming the file and the field in errors.
    pub fn load(path: &Path) -> Result<Profile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the machine profile {}", path.display()))?;
        let p: Profile = toml::from_str(&text)
            .with_context(|| format!("in the machine profile {}", path.display()))?;
        check_gemm_fields(&text)
            .with_context(|| format!("in the machine profile {}", path.display()))?;
        p.validate()
            .with_context(|| format!("in the machine profile {}", path.display()))?;
        Ok(p)
    }

    /// Checks the numbers.
    pub fn validate(&self) -> Result<()> {
        let m = &self.machine;
        for (what, v) in [
            ("machine.cores_per_node", m.cores_per_node),
            ("machine.ranks_per_node", m.ranks_per_node),
            ("machine.threads_per_rank", m.threads_per_rank),
        ] {
            if v == 0 {
                bail!("{what} = 0: expected at least 1");
            }
        }
        for (what, v) in [
            ("machine.peak_gflops_per_core", m.peak_gflops_per_core),
            ("machine.memory_gib_per_node", m.memory_gib_per_node),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                bail!("{what} = {v}: expected a positive number");
            }
        }
        self.network.validate()?;
        GemmRates(self.compute.gemm.clone()).validate()?;
        if !self.compute.gemm.is_empty() && self.compute.reference.is_none() {
            bail!("[[compute.gemm]] rates scale a reference run's GEMM times: they need [compute.reference]");
        }
        let c = &self.compute;
        let given = [
            c.model_tflops_per_node.is_some(),
            c.reference.is_some(),
            c.kernels.is_some(),
        ];
        if given.iter().filter(|g| **g).count() != 1 {
            bail!("[compute]: give exactly one of model_tflops_per_node, [compute.reference] and [compute.kernels]");
        }
        if let Some(k) = &c.kernels {
            return k.validate("compute.kernels");
        }
        match (&c.model_tflops_per_node, &c.reference) {
            (Some(r), None) if *r > 0.0 && r.is_finite() => Ok(()),
            (Some(r), None) => {
                bail!("compute.model_tflops_per_node = {r}: expected a positive number")
            }
            (None, Some(r)) => {
                if r.ops_ms.is_empty() || r.batch_per_rank == 0 || r.threads_per_rank == 0 {
                    bail!("compute.reference: needs ops_ms, batch_per_rank ≥ 1 and threads_per_rank ≥ 1");
                }
                if r.seq_len == 0 || r.micro_batches == 0 {
                    bail!("compute.reference: seq_len and micro_batches must be at least 1");
                }
                for (op, ms) in &r.ops_ms {
                    if !(*ms >= 0.0 && ms.is_finite()) {
                        bail!("compute.reference.ops_ms.{op} = {ms}: expected a finite time ≥ 0 (ms per step)");
                    }
                }
                if !(r.step_ms >= 0.0 && r.step_ms.is_finite()) {
                    bail!(
                        "compute.reference.step_ms = {}: expected a finite time ≥ 0",
                        r.step_ms
                    );
                }
                Ok(())
            }
            _ => unreachable!("exactly one section, checked above"),
        }
    }

    /// The model's view of the machine.
    pub fn machine(&self) -> Machine {
        let m = &self.machine;
        Machine {
            compute: match &self.compute {
                ComputeSection {
                    reference: Some(r), ..
                } => Compute::Reference {
                    run: Box::new(r.clone()),
                    gemm: GemmRates(self.compute.gemm.clone()),
                },
                ComputeSection {
                    kernels: Some(k), ..
                } => Compute::Kernels(k.clone()),
                ComputeSection {
                    model_tflops_per_node: Some(r),
                    ..
                } => Compute::Rate {
                    model_tflops_per_node: *r,
                },
                _ => unreachable!("validated"),
            },
            network: self.network,
            cores_per_node: m.cores_per_node,
            peak_gflops_per_core: m.peak_gflops_per_core,
            memory_gib_per_node: m.memory_gib_per_node,
        }
    }
}

/// Every `[[compute.gemm]]` row has only [`GEMM_RATE_FIELDS`] (a misspelt field is an
/// error, not a silent default).
fn check_gemm_fields(text: &str) -> Result<()> {
    let raw: toml::Value = toml::from_str(text)?;
    let rows = raw
        .get("compute")
        .and_then(|c| c.get("gemm"))
        .and_then(|g| g.as_array());
    for (i, row) in rows.into_iter().flatten().enumerate() {
        for key in row.as_table().into_iter().flat_map(|t| t.keys()) {
            if !GEMM_RATE_FIELDS.contains(&key.as_str()) {
                bail!(
                    "compute.gemm[{i}]: unknown field `{key}` (expected {})",
                    GEMM_RATE_FIELDS.join(", ")
                );
            }
        }
    }
    Ok(())
}

/// A `fugu train` run (its directory or metrics.jsonl): the metrics file, the run, its model
/// (from the header's dimensions) and its batch size per replica and sequence length.
pub fn read_run_shape(
    path: &Path,
    name: &str,
) -> Result<(std::path::PathBuf, Run, ModelConfig, u64, u64)> {
    let metrics = if path.is_dir() {
        path.join("metrics.jsonl")
    } else {
        path.to_path_buf()
    };
    let run = read_run(&metrics, name)?;
    let dims = run
        .model
        .as_ref()
        .with_context(|| format!("{}: the header has no model", metrics.display()))?;
    let (Some(batch), Some(seq)) = (run.batch_size, run.seq_len) else {
        bail!(
            "{}: the header has no batch size or sequence length",
            metrics.display()
        );
    };
    let model = run_model(dims, seq as usize);
    Ok((metrics, run, model, batch, seq))
}

/// The model of a run, from its header's dimensions (sequences of `seq` tokens).
fn run_model(dims: &ModelDims, seq: usize) -> ModelConfig {
    ModelConfig {
        arch: dims.arch,
        vocab_size: dims.vocab_size as usize,
        n_positions: seq,
        n_embd: dims.n_embd as usize,
        n_head: dims.n_head as usize,
        n_layer: dims.n_layer as usize,
        ..Default::default()
    }
}

/// What [`measure`] fitted, for the user to see.
#[derive(Clone, Debug)]
pub struct Measured {
    pub profile: Profile,
    pub notes: Vec<String>,
}

/// Builds a profile from a one-node reference run (a `fugu train` directory: its header and
/// per-op timers), `fugu bench comm` files (one node: the intra-node link; several nodes: the
/// inter-node link), optional `fugu bench gemm --format json` files and the node's size.
pub fn measure(
    name: &str,
    run_dir: &Path,
    comm: &[std::path::PathBuf],
    gemm: &[std::path::PathBuf],
    cores_per_node: usize,
    memory_gib_per_node: f64,
) -> Result<Measured> {
    let (metrics, run, model, batch, seq) = read_run_shape(run_dir, name)?;
    let mut notes = Vec::new();
    if run.layout.world != 1 {
        bail!(
            "{}: the reference must be a one-process run (it has {} ranks): its per-op times \
             are scaled to other layouts",
            metrics.display(),
            run.layout.world
        );
    }
    if run.timers.mean.is_empty() {
        bail!(
            "{}: the run recorded no per-op timers (run it with --timers fine or coarse)",
            metrics.display()
        );
    }
    let peak_core = run
        .machine
        .peak_gflops
        .map(|p| p / run.layout.threads.max(1) as f64)
        .unwrap_or(0.0);
    let reference = Reference {
        model,
        seq_len: seq as usize,
        batch_per_rank: batch as usize,
        micro_batches: run.micro_batches.max(1) as usize,
        threads_per_rank: run.layout.threads.max(1) as usize,
        ops_ms: run.timers.mean.clone(),
        step_ms: run.timers.step_ms,
        source: format!(
            "{} ({} measured steps, {} on {})",
            metrics.display(),
            run.timers.steps,
            run.config_name,
            run.machine.cpu_model
        ),
    };
    let mut intra = None;
    let mut inter = None;
    let mut files = Vec::new();
    // Per traffic class, from `--group` files: (class, link level inter?, link, the file).
    let mut classes = Vec::new();
    for p in comm {
        let f = read_comm(p)?;
        let fit = fit_link(&f.rows).with_context(|| format!("fitting {}", p.display()))?;
        let class = match f.group.as_deref() {
            None => None,
            Some(g) => Some(
                Traffic::ALL
                    .into_iter()
                    .find(|c| c.name() == g)
                    .with_context(|| {
                        format!("{}: group `{g}`: expected tp, pp or dp", p.display())
                    })?,
            ),
        };
        notes.push(format!(
            "{}: {}{} link α = {:.2} µs, β = {:.2} GB/s ({} sendrecv rows, worst fit error {:.0}%)",
            p.display(),
            class.map_or(String::new(), |c| format!("{} traffic's ", c.name())),
            if f.nodes > 1 {
                "inter-node"
            } else {
                "intra-node"
            },
            fit.link.alpha_us,
            fit.link.beta_gbs,
            fit.rows,
            100.0 * fit.max_rel_err
        ));
        match (class, f.nodes > 1) {
            (Some(c), across) => classes.push((c, across, fit.link, p.clone(), f)),
            (None, true) => {
                inter = Some(fit.link);
                files.push((p.clone(), f));
            }
            (None, false) => {
                intra = Some(fit.link);
                files.push((p.clone(), f));
            }
        }
    }
    let intra: Link = intra.context(
        "no one-node `fugu bench comm` file given (--comm): the intra-node link is needed",
    )?;
    let inter = inter.unwrap_or_else(|| {
        notes.push(
            "no multi-node benchmark: the inter-node link is taken to be the intra-node one".into(),
        );
        intra
    });
    let mut profile = Profile {
        machine: MachineSection {
            name: name.to_string(),
            description: format!("measured by fugu on {}", run.machine.cpu_model),
            estimate: false,
            cores_per_node,
            peak_gflops_per_core: peak_core,
            memory_gib_per_node,
            ranks_per_node: 1,
            threads_per_rank: run.layout.threads.max(1) as usize,
            sources: vec![reference.source.clone()],
        },
        compute: ComputeSection {
            model_tflops_per_node: None,
            reference: Some(reference),
            gemm: Vec::new(),
            kernels: None,
        },
        network: Network {
            intra,
            inter,
            reduce_gbs: None,
            tp: ClassLinks::NONE,
            pp: ClassLinks::NONE,
            dp: ClassLinks::NONE,
        },
    };
    // The reduction rate, from the one-node all-reduce rows (the α–β part known).
    if let Some((p, f)) = files.iter().find(|(_, f)| f.nodes == 1) {
        let g = Group {
            ranks: f.ranks,
            nodes: 1,
        };
        profile.network.reduce_gbs = fit_reduce(&profile.network, g, &f.rows);
        match profile.network.reduce_gbs {
            Some(r) => notes.push(format!(
                "{}: reduction rate γ = {r:.2} GB/s (all-reduce rows ≥ 64 KiB)",
                p.display()
            )),
            None => notes.push(format!(
                "{}: all-reduce rows leave no reduction cost to fit",
                p.display()
            )),
        }
    }
    // The classes' own links, and (from a one-node group) their reduction rate.
    for (c, across, link, p, f) in classes {
        if across {
            profile.network.links_mut(c).inter = Some(link);
        } else {
            profile.network.links_mut(c).intra = Some(link);
            let g = Group {
                ranks: f.ranks,
                nodes: 1,
            };
            let reduce = fit_reduce(&profile.network.class(c), g, &f.rows);
            profile.network.links_mut(c).reduce_gbs = reduce;
            if let Some(r) = reduce {
                notes.push(format!(
                    "{}: {} traffic's reduction rate γ = {r:.2} GB/s",
                    p.display(),
                    c.name()
                ));
            }
        }
    }
    for p in gemm {
        let rows = read_bench_gemm(p)?;
        notes.push(format!("{}: {} GEMM rates", p.display(), rows.len()));
        profile.compute.gemm.extend(rows);
    }
    profile.validate()?;
    Ok(Measured { profile, notes })
}

#[cfg(test)]
mod tests {
    use super::Profile;

    const MACHINE: &str = "[machine]\nname = \"m\"\ncores_per_node = 4\npeak_gflops_per_core = 10\n\
        memory_gib_per_node = 8\nranks_per_node = 1\nthreads_per_rank = 4\n\
        [network]\nintra = { alpha_us = 1, beta_gbs = 1 }\ninter = { alpha_us = 1, beta_gbs = 1 }\n";

    fn check(compute: &str) -> Result<(), String> {
        let text = format!("{MACHINE}{compute}");
        let p: Profile = toml::from_str(&text).map_err(|e| e.to_string())?;
        p.validate().map_err(|e| format!("{e:#}"))
    }

    /// `[compute.kernels]`: one compute section only, a positive rate for at least one
    /// precision and a positive bandwidth, each error naming its field.
    #[test]
    fn kernel_rates_are_checked_by_field() {
        let kernels = "[compute.kernels]\nmemory_gbs_per_node = 100\n";
        check(&format!(
            "{kernels}gemm_gflops_per_core = {{ fp16 = 20 }}\n"
        ))
        .unwrap();
        for (compute, want) in [
            (
                format!("{kernels}gemm_gflops_per_core = {{}}\n"),
                "give a rate for at least one of fp32, bf16, fp16",
            ),
            (
                format!("{kernels}gemm_gflops_per_core = {{ fp32 = 10, bf16 = -1 }}\n"),
                "gemm_gflops_per_core.bf16 = -1",
            ),
            (
                "[compute.kernels]\nmemory_gbs_per_node = 0\ngemm_gflops_per_core = { fp32 = 1 }\n"
                    .to_string(),
                "compute.kernels.memory_gbs_per_node = 0",
            ),
            (
                format!("[compute]\nmodel_tflops_per_node = 1\n{kernels}gemm_gflops_per_core = {{ fp32 = 1 }}\n"),
                "exactly one of",
            ),
            (
                format!("{kernels}gemm_gflops_per_core = {{ fp8 = 1 }}\n"),
                "unknown field `fp8`",
            ),
        ] {
            let e = check(&compute).unwrap_err();
            assert!(e.contains(want), "{compute}: {e}");
        }
    }
}

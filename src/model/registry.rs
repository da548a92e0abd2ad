//! The one place that maps a model family ([`Arch`], `arch` in `[model]`) to its code: the
//! model on a backend, its full parameter table and its initialisation. Adding an
//! architecture adds one arm to each `match` here.

use super::acts::{self, AttnKeep, Recompute, StepDims};
use super::contract::{Model, TpRank};
use super::gpt2::Gpt2;
use super::gpt2_hf;
use super::hf_fields::HfFields;
use super::hf_layout::HfLayout;
use super::llama::Llama;
use super::stage::Stage;
use super::table::Table;
use super::{llama_hf, llama_params};
use crate::backend::{Backend, Dtype};
use crate::metrics::ops::{trainer, OpCatalogue};
use crate::model::cost::CostModel;
use crate::model::{Arch, ModelConfig};
use anyhow::Result;
use serde_json::{Map, Value};

/// This rank's share (`tp`, `stage`) of the model `cfg` names, on `be`, with parameters
/// zeroed, gradients, AdamW moments and activations in `compute`.
pub fn build<B: Backend>(
    cfg: &ModelConfig,
    tp: TpRank,
    stage: &Stage,
    compute: Dtype,
    be: B,
) -> Result<Box<dyn Model<B>>> {
    Ok(match cfg.arch {
        Arch::Gpt2 => Box::new(Gpt2::new_stage(cfg, tp, stage, compute, be)?),
        Arch::Llama => Box::new(Llama::new_stage(cfg, tp, stage, compute, be)?),
    })
}

/// The tables one micro-batch's activations of `stage` are carved by at step shape `d`
/// (compute type), its f32 statistics, and the gradient scratch the blocks share.
pub fn activation_tables(
    cfg: &ModelConfig,
    d: &StepDims,
    stage: &Stage,
    (recompute, keep): (Recompute, AttnKeep),
) -> [Table; 3] {
    match cfg.arch {
        Arch::Gpt2 => [
            acts::acts_table(d, stage, recompute, keep),
            acts::stats_table(d, stage, keep),
            acts::grad_acts_table(d, keep),
        ],
        Arch::Llama => {
            let (a, s) = super::llama::act_tables(d, stage.clone(), (recompute, keep));
            [a, s, super::llama::grad_table(d, keep)]
        }
    }
}

/// The whole model with parameters only (no gradients or moments), for decoding.
pub fn build_for_inference<B: Backend>(cfg: &ModelConfig, be: B) -> Result<Box<dyn Model<B>>> {
    Ok(match cfg.arch {
        Arch::Gpt2 => Box::new(Gpt2::for_inference(cfg, be)?),
        Arch::Llama => Box::new(Llama::for_inference(cfg, be)?),
    })
}

/// The whole model's parameter table (one stage, no tensor parallelism): the logical form
/// checkpoints hold.
pub fn full_params(cfg: &ModelConfig) -> Result<Table> {
    match cfg.arch {
        Arch::Gpt2 => super::table::gpt2_params(cfg, 1),
        Arch::Llama => llama_params::llama_stage_params(cfg, 1, &Stage::whole(cfg.n_layer)),
    }
}

/// The parameter table of one tensor-parallel shard (of `tp_size`) of one pipeline stage.
pub fn stage_params(cfg: &ModelConfig, tp_size: usize, stage: &Stage) -> Result<Table> {
    match cfg.arch {
        Arch::Gpt2 => super::table::gpt2_stage_params(cfg, tp_size, stage),
        Arch::Llama => llama_params::llama_stage_params(cfg, tp_size, stage),
    }
}

/// Fills `dst` with the seeded initial value of the full tensor `name`.
pub fn init_tensor(cfg: &ModelConfig, name: &str, seed: u64, dst: &mut [f32]) {
    match cfg.arch {
        Arch::Gpt2 => super::init::init_tensor(cfg, name, seed, dst),
        Arch::Llama => llama_params::init_tensor(cfg, name, seed, dst),
    }
}

/// The Hugging Face `config.json` of `cfg` (keys sorted, as `save_pretrained` writes them).
pub fn hf_config_json(cfg: &ModelConfig) -> Value {
    match cfg.arch {
        Arch::Gpt2 => gpt2_hf::config_json(cfg),
        Arch::Llama => llama_hf::config_json(cfg),
    }
}

/// How the model `cfg` names and shapes its tensors in Hugging Face files.
pub fn hf_layout(cfg: &ModelConfig) -> HfLayout {
    match cfg.arch {
        Arch::Gpt2 => gpt2_hf::LAYOUT,
        Arch::Llama => llama_hf::layout(cfg),
    }
}

/// Writes `cfg`'s sizes into a `config.json` object of its architecture read from a file,
/// keeping the file's other fields.
pub fn update_hf_config(obj: &mut Map<String, Value>, cfg: &ModelConfig) {
    match cfg.arch {
        Arch::Gpt2 => gpt2_hf::update_config(obj, cfg),
        Arch::Llama => llama_hf::update_config(obj, cfg),
    }
}

/// The op catalogue of architecture `arch`: its timer names and their classes.
pub fn ops(arch: Arch) -> &'static OpCatalogue {
    match arch {
        Arch::Gpt2 | Arch::Llama => &super::decoder_ops::OPS,
    }
}

/// What the compute ops of architecture `arch` cost (for predictions, stage balancing and
/// model FLOPs).
pub fn cost(arch: Arch) -> &'static CostModel {
    match arch {
        Arch::Gpt2 => &super::gpt2_cost::COST,
        Arch::Llama => &super::llama_cost::COST,
    }
}

/// Every timer name a run can write, whatever its architecture: the trainer's, then each
/// architecture's (`fugu report` reads runs of any).
pub fn all_ops() -> Vec<&'static OpCatalogue> {
    let mut cats: Vec<&'static OpCatalogue> = vec![&trainer::OPS];
    for a in Arch::ALL {
        // Architectures may share a catalogue: each once.
        if !cats.iter().any(|&c| std::ptr::eq(c, ops(a))) {
            cats.push(ops(a));
        }
    }
    cats
}

/// The config of architecture `arch` (from the file's `model_type`) in the `config.json`
/// object `obj` read from `path`, or an error naming the field fugu does not run.
pub fn parse_hf_config(arch: Arch, obj: &Map<String, Value>, path: &str) -> Result<ModelConfig> {
    let f = HfFields { obj, path };
    match arch {
        Arch::Gpt2 => gpt2_hf::parse_config(&f),
        Arch::Llama => llama_hf::parse_config(&f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::timers::parent_of;

    /// Each architecture's timer names with the trainer's: none declared twice, and every
    /// parent of the architecture's declared (a run's breakdown classifies its names from these
    /// two catalogues; the trainer's `pipeline:*` hang under a `pipeline` nobody times).
    #[test]
    fn op_names_are_unique_and_every_parent_is_declared() {
        for arch in Arch::ALL {
            let cats = [&trainer::OPS, ops(arch)];
            let mut names: Vec<_> = cats.iter().flat_map(|c| c.ops).map(|o| o.name).collect();
            names.sort();
            let n = names.len();
            names.dedup();
            assert_eq!(names.len(), n, "{}: a name declared twice", arch.name());
            for op in ops(arch).ops {
                if let Some(p) = parent_of(op.name) {
                    let declared = cats.iter().any(|c| c.class_of(p).is_some());
                    assert!(
                        declared,
                        "{}: parent {p} of {} is not declared",
                        arch.name(),
                        op.name
                    );
                }
            }
        }
    }
}

//! `fugu predict`: a training step's time at any node count and layout, from measurements on
//! one node (or published figures), op by op under the timer names real runs record.
//!
//! * [`network`]: α–β links (intra-node, inter-node, and per traffic class: tensor-parallel,
//!   pipeline, data-parallel) and the collective algorithms, fitted to `fugu bench comm` output;
//! * [`gemm`]: the GEMM shapes each op makes and measured GEMM rates (`fugu bench gemm`);
//! * [`step`]: the step model: compute scaled from a reference run per op (or one rate),
//!   tensor-, pipeline- and data-parallel communication with fugu's placement and overlap,
//!   memory per rank with the trainer's own activation and parameter tables;
//! * [`profile`]: the machine profile file (TOML) and building one from a run and benchmarks;
//! * [`fit`]: a profile's traffic-class links fitted to measured multi-node runs;
//! * [`search`]: every layout of a model on a node count, ranked (`fugu predict --search`).
//!
//! It is a model, not a simulation: a prediction for 10 node counts takes milliseconds.
//! `docs/PREDICT.md` states the assumptions and the validation against measured runs.

pub mod fit;
pub mod gemm;
pub mod network;
pub mod profile;
pub mod search;
pub mod step;

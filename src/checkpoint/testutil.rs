//! Helpers for the checkpoint tests.

use crate::model::gpt2_hf::LAYOUT;
use crate::model::table::{gpt2_params, Table};
use crate::model::ModelConfig;
use std::fs;
use std::path::PathBuf;

/// A directory for tests, removed when dropped.
pub(crate) struct TestDir(pub PathBuf);

impl TestDir {
    pub fn new(name: &str) -> TestDir {
        let d = std::env::temp_dir().join(format!("fugu-ckpt-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        TestDir(d)
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A tiny config (vocabulary 101 → 128 rows) and deterministic non-zero parameters.
pub(crate) fn tiny() -> (ModelConfig, Table, Vec<f32>) {
    let cfg = ModelConfig {
        vocab_size: 101,
        n_positions: 16,
        n_embd: 32,
        n_head: 4,
        n_layer: 2,
        ..Default::default()
    };
    let table = gpt2_params(&cfg, 1).unwrap();
    let mut params = vec![0f32; table.total()];
    for s in table.specs() {
        let n = LAYOUT
            .file_shape(s, cfg.vocab_size)
            .iter()
            .product::<usize>();
        for (i, x) in params[s.offset..s.offset + n].iter_mut().enumerate() {
            *x = ((s.offset + i) as f32 * 0.618).sin() * 0.1;
        }
    }
    (cfg, table, params)
}

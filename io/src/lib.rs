//! fugu-io: the tokenizer, WebDataset-style tar shards (`prepare`), and the
//! streaming, resumable, data-parallel training-data [`Loader`].
//!
//! See `docs/DATA.md` for the shard format, the manifest schema, the cursor
//! semantics and what happens when the data-parallel world size changes.
//!
//! ```no_run
//! use fugu_io::{Loader, LoaderConfig};
//! let cfg = LoaderConfig::train(8, 1024, /*rank*/ 0, /*world*/ 1, /*seed*/ 1);
//! let mut train = Loader::new("data/shakespeare/manifest.json", &cfg)?;
//! let batch = train.next_batch()?; // 8 x 1025 u32 token ids
//! let state = train.cursor();      // serde-serialisable, restore with Loader::resume
//! # Ok::<(), fugu_io::Error>(())
//! ```

pub mod bundled;
pub mod columnar;
pub mod error;
pub mod loader;
pub mod manifest;
pub mod prepare;
mod replace;
pub mod rng;
pub mod sniff;
pub mod tar;
pub mod tokenizer;

pub use error::{Error, Result};
pub use loader::{
    expand_braces, Batch, Cursor, DataSpec, Loader, LoaderConfig, LoaderInfo, Split, Verify,
};
pub use manifest::Manifest;
pub use prepare::{prepare, PrepareOptions, PrepareSummary};
pub use tokenizer::{
    hf_tokenizer_files, tokenizer_by_name, train_bpe, train_bpe_with, write_hf_tokenizer_files,
    BpeTrainOptions, Gpt2Tokenizer, HfTokenizer, Tokenizer, GPT2_EOT, GPT2_VOCAB,
};

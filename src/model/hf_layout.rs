//! How an architecture's parameter table is stored in Hugging Face safetensors files: the key
//! each table tensor has, the tensors whose rows are the vocabulary (padded in the model, not in
//! files), a tied output head, and the buffers old files carry that are not parameters. The
//! checkpoint code reads and writes every architecture through this; each architecture declares
//! its own beside its config reader ([`super::registry::hf_layout`]).

use super::table::{Table, TensorSpec};

/// A file tensor that mirrors a table tensor: the output head tied to the token embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TiedHead {
    /// The file key (as [`HfLayout::strip`] leaves it), e.g. `lm_head.weight`.
    pub file_name: &'static str,
    /// The table tensor it must equal, e.g. `wte.weight`.
    pub table_name: &'static str,
}

/// An architecture's file layout (module docs).
#[derive(Clone, Copy, Debug)]
pub struct HfLayout {
    /// The model's name in messages (`GPT-2`).
    pub title: &'static str,
    /// What files put before a table name (`transformer.` for GPT-2's body); files without it
    /// are read too.
    pub key_prefix: &'static str,
    /// Table tensors whose first dimension is the vocabulary: padded in the table, `vocab_size`
    /// rows in files. The first is the token embedding.
    pub vocab_rows: &'static [&'static str],
    /// The tied output head, when the model ties it.
    pub tied_head: Option<TiedHead>,
    /// True for a file key (stripped) that is a buffer, not a parameter: read, kept, not loaded.
    pub is_buffer: fn(&str) -> bool,
}

impl HfLayout {
    /// The file key of table tensor `name`.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.key_prefix)
    }

    /// A file key without the prefix (unchanged when it has none).
    pub fn strip<'a>(&self, key: &'a str) -> &'a str {
        key.strip_prefix(self.key_prefix).unwrap_or(key)
    }

    /// The token embedding's table name.
    pub fn embedding(&self) -> &'static str {
        self.vocab_rows[0]
    }

    /// True when table tensor `name` has the vocabulary as rows.
    pub fn has_vocab_rows(&self, name: &str) -> bool {
        self.vocab_rows.contains(&name)
    }

    /// The shape table tensor `spec` has in files: the table's, with `vocab` rows for the
    /// vocabulary tensors (the padding rows are not stored).
    pub fn file_shape(&self, spec: &TensorSpec, vocab: usize) -> Vec<usize> {
        let mut s = spec.shape.clone();
        if self.has_vocab_rows(&spec.name) {
            s[0] = vocab;
        }
        s
    }

    /// The table tensor a tied head mirrors, when the model ties one and `table` holds it.
    pub fn tied_source<'t>(&self, table: &'t Table) -> Option<&'t TensorSpec> {
        self.tied_head.and_then(|h| table.get(h.table_name))
    }
}

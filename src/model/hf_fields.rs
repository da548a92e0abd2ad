//! Reading a Hugging Face `config.json` object field by field, with errors that name the file,
//! the field and what fugu expected: what every architecture's config reader uses.

use anyhow::{anyhow, bail, Result};
use serde_json::{Map, Value};

/// A parsed `config.json` object and the path its errors name.
pub struct HfFields<'a> {
    pub obj: &'a Map<String, Value>,
    pub path: &'a str,
}

impl HfFields<'_> {
    /// The raw value of field `k`, if present.
    pub fn get(&self, k: &str) -> Option<&Value> {
        self.obj.get(k)
    }

    /// A positive integer (below 2³²) field, `default` when absent.
    pub fn int(&self, k: &str, default: usize) -> Result<usize> {
        let p = self.path;
        match self.get(k) {
            None => Ok(default),
            Some(x) => match x.as_u64() {
                Some(n) if n > 0 && n <= u32::MAX as u64 => Ok(n as usize),
                _ => bail!("{p}: field `{k}` = {x}: expected a positive integer"),
            },
        }
    }

    /// A boolean field (`default` when absent) that fugu supports only as `supported`.
    pub fn flag(&self, k: &str, default: bool, supported: bool) -> Result<()> {
        let p = self.path;
        let b = match self.get(k) {
            None => default,
            Some(x) => x
                .as_bool()
                .ok_or_else(|| anyhow!("{p}: field `{k}` = {x}: expected true or false"))?,
        };
        if b != supported {
            bail!("{p}: field `{k}` = {b} is not supported by fugu (only {supported})");
        }
        Ok(())
    }
}

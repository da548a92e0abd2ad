//! Where fugu keeps per-user caches between runs (the measured CPU peak, compiled CUDA
//! kernels): `$XDG_CACHE_HOME/fugu`, else `$HOME/.cache/fugu`.

use std::path::PathBuf;

/// `$XDG_CACHE_HOME/fugu`, else `$HOME/.cache/fugu`; `None` when neither variable is set.
pub fn fugu_cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("fugu"))
}

/// A cache location from environment variable `env` (a path; `off` or empty disables),
/// else `name` inside [`fugu_cache_dir`].
pub fn cache_path(env: &str, name: &str) -> Option<PathBuf> {
    if let Ok(p) = std::env::var(env) {
        return (p != "off" && !p.is_empty()).then(|| PathBuf::from(p));
    }
    fugu_cache_dir().map(|d| d.join(name))
}

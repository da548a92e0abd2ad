//! Helpers shared by the workspace-level integration tests (each test crate uses some).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs the `fugu` binary with `args` in `cwd` (a fixed peak and memory bandwidth, so runs
/// never measure them).
pub fn fugu(args: &[&str], cwd: &Path) -> Output {
    fugu_with_env(args, cwd, &[])
}

/// [`fugu`] with extra environment variables.
pub fn fugu_with_env(args: &[&str], cwd: &Path, env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fugu"))
        .args(args)
        .current_dir(cwd)
        .env("FUGU_PEAK_GFLOPS_PER_CORE", "100")
        .env("FUGU_PEAK_GBS", "50")
        .envs(env.iter().copied())
        .output()
        .expect("running fugu")
}

/// Asserts that a run succeeded, showing its status and output otherwise.
pub fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "fugu failed ({:?}): {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An empty folder `fugu-GROUP-NAME-PID` in the temporary directory.
pub fn tmp(group: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("fugu-{group}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The bundled corpus, tokenised once per test process (folder `fugu-GROUP-data-PID`); the
/// manifest's path.
pub fn corpus(group: &str) -> String {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _held = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("fugu-{group}-data-{}", std::process::id()));
    let manifest = dir.join("manifest.json");
    if !manifest.exists() {
        ok(&fugu(
            &["prepare", "--out", dir.to_str().unwrap()],
            Path::new("."),
        ));
    }
    manifest.display().to_string()
}

/// Prints a skip notice on the real stderr (not captured by the test harness).
pub fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "skipped: {why}");
}

/// The CUDA backend on GPU 0; `None` where this machine has no GPU. A GPU the backend fails
/// to start on (kernels its NVRTC refuses, a missing library) fails the test instead of
/// letting it fall back or skip: that is what a GPU run is for.
#[cfg(feature = "cuda")]
pub fn cuda_gpu() -> Result<fugu::backend::cuda::CudaBackend, anyhow::Error> {
    use fugu::backend::cuda::{emulation_asked, gpu_present, CudaBackend, EMULATE_ENV};
    use fugu::backend::CudaSettings;
    if emulation_asked() {
        // The backend would start the emulator: tests that need a GPU skip.
        anyhow::bail!("{EMULATE_ENV}=1: the emulator, not a GPU");
    }
    let started = CudaBackend::new(Some(0), CudaSettings::default());
    if let Err(e) = &started {
        assert!(
            !gpu_present(),
            "this machine has a GPU, but the CUDA backend did not start on it: {e:#}"
        );
    }
    started
}

/// The CUDA backend under test: on GPU 0, or where there is none, on the host emulator
/// (`kernels.cu` compiled as C++; the same host code and kernels, cuBLAS replaced by a loop).
/// `None`, after printing why, when neither can be had.
#[cfg(feature = "cuda")]
pub fn cuda_device() -> Option<fugu::backend::cuda::CudaBackend> {
    use fugu::backend::cuda::CudaBackend;
    match cuda_gpu() {
        Ok(b) => Some(b),
        Err(gpu) => match CudaBackend::emulated() {
            Ok(b) => {
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr().lock(),
                    "note: no GPU ({gpu:#}); testing the CUDA backend on the host emulator"
                );
                Some(b)
            }
            Err(e) => {
                // With a C++ compiler at hand, an emulator that does not build is a broken
                // kernel source, which must fail the tests rather than skip them all.
                let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
                let has_cxx = std::process::Command::new(&cxx)
                    .arg("--version")
                    .output()
                    .is_ok_and(|o| o.status.success());
                assert!(
                    !has_cxx,
                    "the CUDA emulator does not build with {cxx}: {e:#}"
                );
                skipped(&format!("no CUDA device ({gpu:#}) and no emulator ({e:#})"));
                None
            }
        },
    }
}

/// The model FLOPs of a training step as the ops declare them (`src/model/work.rs`):
/// Megatron's formula ([`fugu::metrics::megatron_flops_per_step`]), whose attention term counts
/// all s² (query, key) pairs, with the causal s(s+1)/2 the ops compute instead.
pub fn causal_model_flops(b: usize, s: usize, l: usize, h: usize, vp: usize) -> f64 {
    let attention = |pairs: usize| 12.0 * (b * l * h * pairs) as f64;
    fugu::metrics::megatron_flops_per_step(b, s, l, h, vp) - attention(s * s)
        + attention(s * (s + 1) / 2)
}

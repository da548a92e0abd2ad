//! Helpers shared by the workspace-level integration tests.

/// Prints a skip notice on the real stderr (not captured by the test harness).
pub fn skipped(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "skipped: {why}");
}

/// The CUDA backend under test: on GPU 0, or where there is none, on the host emulator
/// (`kernels.cu` compiled as C++; the same host code and kernels, cuBLAS replaced by a loop).
/// `None`, after printing why, when neither can be had.
#[cfg(feature = "cuda")]
pub fn cuda_device() -> Option<fugu::backend::cuda::CudaBackend> {
    use fugu::backend::cuda::CudaBackend;
    use fugu::backend::CudaSettings;
    match CudaBackend::new(Some(0), CudaSettings::default()) {
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
                skipped(&format!("no CUDA device ({gpu:#}) and no emulator ({e:#})"));
                None
            }
        },
    }
}

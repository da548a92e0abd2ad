//! `--device cpu|cuda|cuda:N`: which backend a command runs on, and building it.
//!
//! The commands are generic over [`crate::backend::Backend`]; [`with_backend!`] builds the
//! chosen one and runs the same generic code on it, so there is one code path per command
//! whatever the device. A build without the `cuda` feature still parses `--device cuda` and
//! answers it with an error that says how to get CUDA support.

use anyhow::{bail, Result};
use std::fmt;
use std::str::FromStr;

/// Where a command's buffers live and its ops run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// Host memory, fugu-gemm and the rayon kernels of `ops/`.
    #[default]
    Cpu,
    /// A CUDA device (cuBLAS and NVRTC-compiled kernels): this ordinal, or with `None`
    /// (`--device cuda`) the node-local MPI rank's GPU ([`local_gpu`]).
    Cuda(Option<usize>),
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        let bad = || format!("--device {s:?}: expected cpu, cuda or cuda:N (N = device ordinal)");
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(None)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(|n| Device::Cuda(Some(n))).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(None) => f.write_str("cuda"),
            Device::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

/// Environment variables that MPI launchers set to a process's rank among the ranks of its
/// node (Open MPI, MPICH and Intel MPI, Slurm's srun).
const LOCAL_RANK_VARS: &[&str] = &[
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
];

/// The GPU ordinal for `--device cuda` without one: the node-local rank modulo the node's
/// `gpus`, so that 4 ranks on a 4-GPU node use one GPU each; 0 outside an MPI launch.
pub fn local_gpu(gpus: usize) -> usize {
    let local = LOCAL_RANK_VARS
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok())
        .unwrap_or(0);
    local % gpus.max(1)
}

/// Settings of the CUDA backend that a command line can change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaSettings {
    /// Let cuBLAS use TF32 tensor cores for fp32 GEMMs (`--tf32`); off = strict fp32.
    pub tf32: bool,
}

/// The error of `--device cuda` in a build without the `cuda` feature.
pub fn no_cuda_build(device: Device) -> anyhow::Error {
    anyhow::anyhow!(
        "--device {device}: this fugu was built without CUDA support; rebuild with \
         `cargo build --release --features cuda` (no CUDA toolkit is needed to build: the \
         driver, cuBLAS and NVRTC libraries are loaded at run time)"
    )
}

/// Rejects settings that only mean something on another device.
pub fn check_settings(device: Device, cuda: CudaSettings) -> Result<()> {
    if device == Device::Cpu && cuda.tf32 {
        bail!("--tf32 applies to --device cuda only (the CPU backend computes in strict fp32)");
    }
    Ok(())
}

/// Runs `$body` with `$be` bound to a new backend for `$device` (a [`Device`]) built with
/// `$cuda` ([`CudaSettings`]); evaluates to `$body`'s value, which must be an
/// `anyhow::Result`.
#[macro_export]
macro_rules! with_backend {
    ($device:expr, $cuda:expr, |$be:ident| $body:expr) => {{
        let device: $crate::backend::Device = $device;
        let cuda: $crate::backend::CudaSettings = $cuda;
        match $crate::backend::device::check_settings(device, cuda) {
            Err(e) => Err(e),
            Ok(()) => match device {
                $crate::backend::Device::Cpu => {
                    let $be = $crate::backend::CpuBackend::new();
                    $body
                }
                #[cfg(feature = "cuda")]
                $crate::backend::Device::Cuda(ordinal) => {
                    match $crate::backend::cuda::CudaBackend::new(ordinal, cuda) {
                        Ok($be) => $body,
                        Err(e) => Err(e),
                    }
                }
                #[cfg(not(feature = "cuda"))]
                $crate::backend::Device::Cuda(_) => {
                    let _ = cuda;
                    Err($crate::backend::device::no_cuda_build(device))
                }
            },
        }
    }};
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(None)));
        assert_eq!("CUDA:3".parse(), Ok(Device::Cuda(Some(3))));
        for bad in ["", "cuda:", "cuda:x", "tpu", "cuda:-1"] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.contains("expected cpu, cuda or cuda:N"), "{bad}: {e}");
        }
        assert_eq!(Device::Cuda(Some(2)).to_string(), "cuda:2");
        assert_eq!(Device::Cuda(None).to_string(), "cuda");
    }

    #[test]
    fn tf32_needs_cuda() {
        let e = check_settings(Device::Cpu, CudaSettings { tf32: true }).unwrap_err();
        assert!(e.to_string().contains("--tf32"), "{e}");
        check_settings(Device::Cuda(None), CudaSettings { tf32: true }).unwrap();
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_get_it() {
        let r: Result<()> =
            crate::with_backend!(Device::Cuda(None), CudaSettings::default(), |be| {
                let _ = crate::backend::Backend::name(&be);
                Ok(())
            });
        let e = r.unwrap_err().to_string();
        assert!(e.contains("--features cuda"), "{e}");
    }
}

//! `--host-only`: the CUDA backend's host side on an engine that executes nothing, to count
//! what a training step queues and time the host work of queueing it. A GPU step can be no
//! faster than this (plus the driver's and cuBLAS's host time per call, which an engine that
//! runs nothing cannot see): it is the floor that launch overhead sets.

use super::{Args, Run};
use fugu::model::ModelConfig;

#[cfg(not(feature = "cuda"))]
pub fn report(
    _: &Args,
    _: &ModelConfig,
    _: &[f32],
    _: (usize, usize),
    _: Run,
) -> anyhow::Result<()> {
    anyhow::bail!("--host-only runs the CUDA backend's host code: build with --features cuda")
}

#[cfg(feature = "cuda")]
pub use imp::report;

#[cfg(feature = "cuda")]
mod imp {
    use super::super::time_steps;
    use super::{Args, ModelConfig, Run};
    use fugu::backend::cuda::engine::{Arg, DevAlloc, Engine, Epilogue, GemmCall};
    use fugu::backend::cuda::{kernel_names, CudaBackend};
    use fugu::dtype::Dtype;
    use fugu::metrics::timers::{DeviceClock, DeviceMark};
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    /// What the engine was asked to do.
    #[derive(Default, Clone)]
    struct Counts {
        launches: BTreeMap<usize, u64>,
        gemms: u64,
        epilogue_gemms: u64,
        ptr_array_gemms: u64,
        copies: u64,
        zeros: u64,
        uploads: u64,
        downloads: u64,
    }

    impl Counts {
        fn launch_total(&self) -> u64 {
            self.launches.values().sum()
        }
    }

    /// Device memory is a range of addresses nothing reads; downloads return zeros.
    struct NullEngine {
        counts: Arc<Mutex<Counts>>,
        /// The next allocation's address.
        next: u64,
    }

    impl NullEngine {
        fn count(&self, f: impl FnOnce(&mut Counts)) {
            f(&mut self.counts.lock().expect("counts lock"));
        }
    }

    impl Engine for NullEngine {
        fn describe(&self) -> String {
            "no device: host work only (--host-only)".into()
        }
        fn peak_gflops(&self, _: Dtype) -> Option<(f64, String)> {
            None
        }
        fn max_blocks(&self) -> u32 {
            65_535 // as the driver engine
        }
        fn mma_16bit(&self) -> bool {
            true // an sm_80+ GPU: fused attention in bf16/fp16, as on an H100
        }
        fn wgmma(&self) -> bool {
            true // as an H100
        }
        fn max_dynamic_shared(&self) -> u32 {
            232_448 // as an H100
        }
        fn free_bytes(&self) -> Option<usize> {
            None
        }
        fn alloc(&mut self, bytes: usize) -> anyhow::Result<DevAlloc> {
            let ptr = self.next;
            self.next += (bytes as u64).div_ceil(256).max(1) * 256;
            Ok(DevAlloc {
                ptr,
                bytes,
                _owner: Box::new(()),
            })
        }
        fn upload(&self, _: u64, _: &[u8]) -> anyhow::Result<()> {
            self.count(|c| c.uploads += 1);
            Ok(())
        }
        fn download(&self, dst: &mut [u8], _: u64) -> anyhow::Result<()> {
            dst.fill(0);
            self.count(|c| c.downloads += 1);
            Ok(())
        }
        fn copy(&self, _: u64, _: u64, _: usize) -> anyhow::Result<()> {
            self.count(|c| c.copies += 1);
            Ok(())
        }
        fn zero(&self, _: u64, _: usize) -> anyhow::Result<()> {
            self.count(|c| c.zeros += 1);
            Ok(())
        }
        fn launch(&self, kernel: usize, _: u32, _: u32, _: u32, _: &[Arg]) -> anyhow::Result<()> {
            self.count(|c| *c.launches.entry(kernel).or_default() += 1);
            Ok(())
        }
        fn gemm(&self, g: &GemmCall) -> anyhow::Result<()> {
            let epilogue = g.epilogue != Epilogue::None;
            if epilogue {
                g.check_epilogue()?;
            }
            self.count(|c| {
                c.gemms += 1;
                c.epilogue_gemms += u64::from(epilogue);
            });
            Ok(())
        }
        fn gemm_ptr_arrays(&self, _: &GemmCall, _: [u64; 3]) -> anyhow::Result<()> {
            self.count(|c| c.ptr_array_gemms += 1);
            Ok(())
        }
        fn sync(&self) -> anyhow::Result<()> {
            Ok(())
        }
        fn clock(&self) -> Box<dyn DeviceClock> {
            Box::new(NoTime)
        }
    }

    /// `run` on a fresh backend over a [`NullEngine`]: the step times and what it queued.
    fn counted(
        cfg: &ModelConfig,
        params: &[f32],
        shape: (usize, usize),
        run: Run,
    ) -> anyhow::Result<(Vec<f64>, Counts)> {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let engine = NullEngine {
            counts: counts.clone(),
            next: 1 << 40,
        };
        let be = CudaBackend::with_engine(Box::new(engine)).with_env_settings()?;
        let (times, ..) = time_steps(be, cfg, params, shape, run)?;
        let counts = counts.lock().expect("counts lock").clone();
        Ok((times, counts))
    }

    /// A device that takes no time.
    struct NoTime;

    impl DeviceClock for NoTime {
        fn mark(&self) -> DeviceMark {
            DeviceMark(0)
        }
        fn take_interval(&self, _: DeviceMark, _: DeviceMark) -> f64 {
            0.0
        }
    }

    /// Times `run`'s steps of B×T with the backend on a [`NullEngine`] and prints the host
    /// time per step and what each step queued (the warm-up step's counts excluded).
    pub fn report(
        args: &Args,
        cfg: &ModelConfig,
        params: &[f32],
        (b, t): (usize, usize),
        run: Run,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            matches!(args.device, fugu::backend::Device::Cuda(_)),
            "--host-only measures the CUDA backend: add --device cuda"
        );
        let steps = run.0;
        anyhow::ensure!(steps >= 1, "--host-only needs --steps of at least 1");
        // What the setup, the warm-up step and one step queued, against the setup, the
        // warm-up and 1 + `steps` steps: the difference is `steps` steady steps.
        let (_, warm) = counted(cfg, params, (b, t), (1, run.1, run.2, run.3))?;
        let (mut times, all) = counted(cfg, params, (b, t), (1 + steps, run.1, run.2, run.3))?;
        let steps = steps as f64;
        let per = |a: u64, w: u64| (a - w) as f64 / steps;
        times.sort_by(f64::total_cmp);
        let med = times[times.len() / 2];
        let launches = per(all.launch_total(), warm.launch_total());
        let gemms = per(
            all.gemms + all.ptr_array_gemms,
            warm.gemms + warm.ptr_array_gemms,
        );
        println!(
            "host only {b}x{t}: {med:.2} ms/step of host work queueing {launches:.0} kernel \
             launches, {gemms:.0} GEMM calls ({:.0} with an epilogue, {:.0} pointer-array \
             batched), {:.0} copies, {:.0} memsets, {:.0} uploads, {:.0} downloads per step",
            per(all.epilogue_gemms, warm.epilogue_gemms),
            per(all.ptr_array_gemms, warm.ptr_array_gemms),
            per(all.copies, warm.copies),
            per(all.zeros, warm.zeros),
            per(all.uploads, warm.uploads),
            per(all.downloads, warm.downloads),
        );
        let names = kernel_names();
        let mut by_kernel: Vec<(f64, &str)> = all
            .launches
            .iter()
            .map(|(k, n)| {
                (
                    per(*n, warm.launches.get(k).copied().unwrap_or(0)),
                    names[*k].as_str(),
                )
            })
            .collect();
        by_kernel.sort_by(|x, y| y.0.total_cmp(&x.0));
        for (n, name) in by_kernel {
            println!("  {n:>6.0}  {name}");
        }
        Ok(())
    }
}

//! The CUDA backend against the CPU backend: every op on awkward shapes, the whole model (loss
//! and every gradient), 20 training steps, checkpoints across devices, exact resume on one GPU
//! and greedy sampling. Each test prints `skipped: ...` and passes where it cannot run: in a
//! build without `--features cuda`, or with no CUDA driver or device.
//!
//! Tolerances: both backends compute in fp32 with no FMA contraction in the kernels; they differ
//! only in summation order (cuBLAS's and the kernels' reduction trees against fugu-gemm's and
//! the CPU loops) and in `expf`/`tanhf` (CUDA's are within 2 ulp). Elementwise ops are held to a
//! few ulp (1e-6 relative); sums of k products of O(1) values differ by about √k·ε per element
//! (worst case k·ε), so GEMM-based ops, with k ≤ 300 here, are held to 2e-5 relative to the
//! output's largest magnitude; reductions done in f64 on both sides (sum of squares) to 1e-12.

mod common;
use common::skipped;

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_tests() {
    skipped("built without --features cuda (cargo test --features cuda runs these)");
}

#[cfg(feature = "cuda")]
mod gpu {
    use fugu::backend::cuda::attention_select::ATTENTION_CACHE_ENV;
    use fugu::backend::cuda::emu::EpilogueCounts;
    use fugu::backend::cuda::{
        self, BiasGrad, CrossEntropyForm, CudaBackend, FlashBackward, FlashMma, FlashOverlap,
        FlashQueryRows, FlashWarpRows, LayernormBackward, CROSS_ENTROPY_DEFAULT,
    };
    use fugu::backend::knobs::FLASH_SELECT_ENV;
    use fugu::backend::{
        AdamWPart, AdamWStep, AttnDims, Backend, CeDims, CeRows, CpuBackend, Dtype, Embedding,
        FusedAttention, FusedOut, KvRows, LayerNorm, LayerNormGrads, Linear, LinearGrads,
        NormStats, RmsNorm, RmsNormGrads, Rope, Span, TokSpan, WeightLayout,
    };
    use fugu::checkpoint::checkpoint_dir_name;
    use fugu::config::RunConfig;
    use fugu::metrics::jsonl::{read_metrics, Record};
    use fugu::metrics::timers::{TimerLevel, Timers};
    use fugu::model::init::init_params;
    use fugu::model::paths::{MlpGelu, Residual};
    use fugu::model::table::{gpt2_params, padded_vocab};
    use fugu::model::ModelConfig;
    use fugu::model::{registry, Gpt2, Model, OptimStep, Stage, TpRank};
    use fugu::ops::RopeTable;
    use fugu::sample::{generate, Generator, SampleOptions};
    use fugu_io::rng::SplitMix64;
    use std::path::{Path, PathBuf};
    use std::process::{Command, Output};
    use std::sync::atomic::Ordering;
    use std::sync::Arc;

    use super::skipped;

    use super::common::cuda_device as device;

    /// How the binary's `--device cuda` runs here: `Some(false)` on a real GPU, `Some(true)` on
    /// the host emulator (`FUGU_CUDA_EMULATE=1`), `None` (after printing why) on neither.
    fn binary_mode() -> Option<bool> {
        if super::common::cuda_gpu().is_ok() {
            Some(false)
        } else {
            device().map(|_| true)
        }
    }

    /// The kernels compile under NVRTC for every architecture CUDA 13 supports (Turing to
    /// Blackwell), and the PTX defines every kernel the backend loads. Needs NVRTC only, no GPU
    /// (CI installs it).
    #[test]
    fn kernels_compile_with_nvrtc() {
        if !cuda::nvrtc_available() {
            skipped("NVRTC (libnvrtc.so.13) not found; scripts/install-deps.sh installs it");
            return;
        }
        let archs = [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)];
        // One compile per core at a time (NVRTC compiles programs concurrently; each takes
        // about half a minute of one core).
        let next = std::sync::atomic::AtomicUsize::new(0);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::thread::scope(|s| {
            for _ in 0..cores.min(archs.len()) {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let Some(&(major, minor)) = archs.get(i) else {
                        return;
                    };
                    let ptx = cuda::kernels_ptx(major, minor)
                        .unwrap_or_else(|e| panic!("sm_{major}{minor}: {e:#}"));
                    for name in cuda::kernel_names() {
                        assert!(
                            ptx.contains(&format!(".entry {name}(")),
                            "sm_{major}{minor}: no kernel {name} in the PTX"
                        );
                    }
                });
            }
        });
    }

    /// The kernel cache (`kernel_cache.rs`): a miss compiles a cubin (an ELF file) and stores
    /// it, a hit returns the same bytes without compiling, a damaged file (cut short) is
    /// compiled again and replaced, and each architecture has its own file. Needs NVRTC only
    /// (two compiles to machine code, about 30 s).
    #[test]
    fn compiled_kernels_are_cached() {
        use cuda::kernel_cache::{cache_file, kernels, Compiled};
        if !cuda::nvrtc_available() {
            skipped("NVRTC (libnvrtc.so.13) not found; scripts/install-deps.sh installs it");
            return;
        }
        let dir = tmp("kernel-cache").join("kernels");
        // sm_80: the cache is the same for every architecture, and its compile is the
        // quickest of those with the tensor-core kernels (sm_90a adds the wgmma ones).
        let (major, minor) = (8, 0);
        let file = cache_file(&dir, major, minor).unwrap();
        assert_ne!(file, cache_file(&dir, 9, 0).unwrap());
        let (cubin, from) = kernels(Some(&dir), major, minor).unwrap();
        assert_eq!(from, Compiled::Now);
        assert!(cubin.starts_with(b"\x7fELF"), "not an ELF file");
        assert!(file.exists(), "{}", file.display());
        let hit = (cubin.clone(), Compiled::Cached);
        assert_eq!(kernels(Some(&dir), major, minor).unwrap(), hit);
        let whole = std::fs::read(&file).unwrap();
        std::fs::write(&file, &whole[..whole.len() - 100]).unwrap();
        assert_eq!(
            kernels(Some(&dir), major, minor).unwrap(),
            (cubin.clone(), Compiled::Now)
        );
        assert_eq!(std::fs::read(&file).unwrap(), whole);
        assert_eq!(kernels(Some(&dir), major, minor).unwrap(), hit);
        let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = SplitMix64(seed);
        (0..n)
            .map(|_| (r.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            .collect()
    }

    /// Every storage type the ops run with: f32, and the 16-bit activation types of mixed
    /// precision (against the CPU backend's rounded storage of the same type).
    const ACTS: [Dtype; 3] = [Dtype::F32, Dtype::Bf16, Dtype::F16];

    /// The same buffers on both backends (allocated in the same order, so a span means the
    /// same thing on each). `rand`/`nan` buffers have the activation type `act`; `rand32`/
    /// `nan32` are f32 whatever `act` is (statistics, parameter gradients, optimizer state).
    struct Both {
        cpu: CpuBackend,
        gpu: CudaBackend,
        act: Dtype,
    }

    impl Both {
        fn new(act: Dtype) -> Option<Both> {
            Some(Both {
                cpu: CpuBackend::new(),
                gpu: device()?,
                act,
            })
        }

        /// The CPU and the emulator (counting the epilogues it runs, or refusing all of
        /// them), whatever the device; `None` (after a skip line) where it does not compile.
        fn emulated(act: Dtype, refusing: bool) -> Option<(Both, Arc<EpilogueCounts>)> {
            let emulator = match cuda::emu::Emulator::new() {
                Ok(e) if refusing => e.refusing_epilogues(),
                Ok(e) => e,
                Err(e) => {
                    skipped(&format!("no CUDA emulator ({e:#})"));
                    return None;
                }
            };
            let count = emulator.epilogue_counts();
            let gpu = CudaBackend::with_engine(Box::new(emulator));
            let cpu = CpuBackend::new();
            Some((Both { cpu, gpu, act }, count))
        }

        fn buf(&mut self, data: &[f32], dt: Dtype) -> Span {
            let a = self.cpu.alloc(data.len(), dt).unwrap();
            let b = self.gpu.alloc(data.len(), dt).unwrap();
            assert_eq!(a, b);
            let s = self.cpu.whole(a);
            self.cpu.upload(s, data);
            self.gpu.upload(s, data);
            s
        }

        fn rand(&mut self, n: usize, seed: u64) -> Span {
            self.buf(&random(n, seed), self.act)
        }

        /// A buffer filled with NaN, so an op that forgets to write an element is caught.
        fn nan(&mut self, n: usize) -> Span {
            self.buf(&vec![f32::NAN; n], self.act)
        }

        fn rand32(&mut self, n: usize, seed: u64) -> Span {
            self.buf(&random(n, seed), Dtype::F32)
        }

        fn nan32(&mut self, n: usize) -> Span {
            self.buf(&vec![f32::NAN; n], Dtype::F32)
        }

        /// The tolerance of a result: `base` (f32 rounding from different summation orders)
        /// plus, with 16-bit activations, 4 unit roundoffs of the type: both backends compute
        /// in f32 and round to the type, so an element whose f32 values straddle a rounding
        /// boundary differs by one step of the type (2u relative), and an op fed such an
        /// element by an earlier op can differ by about as much again.
        fn tol(&self, base: f64) -> f64 {
            match self.act {
                Dtype::F32 => base,
                low => base + 4.0 * low.unit_roundoff(),
            }
        }

        fn tokens(&mut self, t: &[u32]) {
            self.cpu.set_tokens(t);
            self.gpu.set_tokens(t);
        }

        fn run(&mut self, f: impl Fn(&mut dyn Backend)) {
            f(&mut self.cpu);
            f(&mut self.gpu);
        }

        /// [`Both::check`] on the causal part of attention matrices `s` (rows of `t`, row `r`
        /// is query `r % t`): entries above the diagonal are the backend's own business (it
        /// need not write, or zero, what its own GEMMs do not read); the final results
        /// (`out`, `dqkv`) are compared whole.
        fn check_causal(&self, what: &str, s: Span, t: usize, tol: f64) {
            self.check_kept(what, s, tol, |v| {
                v.chunks(t)
                    .enumerate()
                    .flat_map(|(r, row)| row[..=r % t].to_vec())
                    .collect()
            });
        }

        /// Compares `s` on both backends: |gpu − cpu| ≤ tol · max(1, max |cpu|), with `tol`
        /// widened for the activation type by [`Both::tol`].
        fn check(&self, what: &str, s: Span, tol: f64) {
            self.check_kept(what, s, tol, |v| v);
        }

        /// [`Both::check`] on the elements `keep` selects.
        fn check_kept(&self, what: &str, s: Span, tol: f64, keep: impl Fn(Vec<f32>) -> Vec<f32>) {
            let (mut a, mut b) = (vec![0.0; s.len], vec![0.0; s.len]);
            self.cpu.download(s, &mut a);
            self.gpu.download(s, &mut b);
            let what = format!("{what} ({:?})", self.act);
            compare(&what, &keep(a), &keep(b), self.tol(tol));
        }
    }

    /// A span's values as bits (for results that must agree exactly).
    fn bits<B: Backend>(be: &B, s: Span) -> Vec<u32> {
        let mut v = vec![0.0; s.len];
        be.download(s, &mut v);
        v.iter().map(|x| x.to_bits()).collect()
    }

    fn compare(what: &str, cpu: &[f32], gpu: &[f32], tol: f64) {
        assert_eq!(cpu.len(), gpu.len(), "{what}: length");
        let scale = cpu.iter().fold(1.0f64, |m, &x| m.max((x as f64).abs()));
        for (i, (&x, &y)) in cpu.iter().zip(gpu).enumerate() {
            assert!(
                x.is_finite() == y.is_finite() && x.is_nan() == y.is_nan(),
                "{what}[{i}]: cpu {x} gpu {y}"
            );
            if x.is_finite() {
                let d = (x as f64 - y as f64).abs();
                assert!(
                    d <= tol * scale,
                    "{what}[{i}]: cpu {x:e} gpu {y:e} (scale {scale:e})"
                );
            }
        }
    }

    const ELEM: f64 = 1e-6;
    const GEMM: f64 = 2e-5;

    #[test]
    fn embedding_and_layernorm() {
        for act in ACTS {
            embedding_and_layernorm_in(act);
        }
    }

    fn embedding_and_layernorm_in(act: Dtype) {
        let Some(mut be) = Both::new(act) else { return };
        let (b, t, c) = (3, 5, 7);
        // A vocabulary shard of 11 rows starting at id 4: some tokens fall outside it.
        let toks: Vec<u32> = (0..b * t).map(|i| ((i * 7) % 19) as u32).collect();
        be.tokens(&toks);
        let tk = TokSpan {
            offset: 0,
            len: b * t,
        };
        let wte = be.rand(11 * c, 1);
        let wpe = be.rand(9 * c, 2);
        for with_wpe in [true, false] {
            let out = be.nan(b * t * c);
            let p = with_wpe.then_some(wpe);
            let e = |wte, wpe| Embedding {
                wte,
                wpe,
                vocab_start: 4,
                b,
                t,
                c,
            };
            be.run(|x| x.encoder_forward(&e(wte, p), out, tk));
            be.check("encoder_forward", out, ELEM);
            let dwte = be.rand32(11 * c, 3);
            let dwpe = be.rand32(9 * c, 4);
            let dout = be.rand(b * t * c, 5);
            let dp = with_wpe.then_some(dwpe);
            be.run(|x| x.encoder_backward(&e(dwte, dp), dout, tk));
            be.check("encoder_backward dwte", dwte, ELEM);
            be.check("encoder_backward dwpe", dwpe, ELEM);
        }
        // C above one block of threads, and a single row. Rows of 40 and 2064 go in 16-byte
        // packs for every type (2064: more packs than a block has threads), 300 for f32 only,
        // 37 and 5 element by element. 300 rows of 40: more chunks of rows (32 each, the
        // last partial) than the column sums' second stage has warps. The fused backward
        // runs 8 warps per chunk (the chunk of 12 rows: some warps with an empty second row;
        // 3 rows: warps with none), 2 for C = 2064, and 6150 is too wide for it (the split
        // form runs). The warp-row kernels hold rows of up to 4 packs per lane in registers
        // (LN_LANE_PACKS): 300 in f32 (3 per lane), 768 (GPT-2's, 3 per lane) and 1024 (4,
        // the widest) in the 16-bit types; 768 and 1024 in f32 and 2064 go by the loops.
        for (n, c) in [
            (13, 37),
            (3, 300),
            (1, 5),
            (7, 40),
            (2, 2064),
            (300, 40),
            (2, 6150),
            (5, 768),
            (3, 1024),
        ] {
            let (out, mean, rstd) = (be.nan(n * c), be.nan32(n), be.nan32(n));
            let inp = be.rand(n * c, 6);
            let (w, bias) = (be.rand(c, 7), be.rand(c, 8));
            let (ln, stats) = (LayerNorm { w, bias, n, c }, NormStats { mean, rstd });
            be.run(|x| x.layernorm_forward(&ln, out, stats, inp));
            be.check("layernorm_forward out", out, ELEM * 10.0);
            be.check("layernorm_forward mean", mean, ELEM);
            be.check("layernorm_forward rstd", rstd, ELEM);
            let dout = be.rand(n * c, 12);
            for form in [LayernormBackward::Split, LayernormBackward::Fused] {
                be.gpu.set_layernorm_backward(form);
                let (dinp, dw, db) = (be.rand(n * c, 9), be.rand32(c, 10), be.rand32(c, 11));
                let g = LayerNormGrads {
                    dinp,
                    dw,
                    dbias: db,
                };
                be.run(|x| x.layernorm_backward(&ln, &g, dout, inp, stats));
                be.check("layernorm_backward dinp", dinp, ELEM * 10.0);
                // Column sums over n rows in different orders.
                be.check("layernorm_backward dw", dw, GEMM);
                be.check("layernorm_backward dbias", db, GEMM);
            }
            be.gpu
                .set_layernorm_backward(cuda::LAYERNORM_BACKWARD_DEFAULT);
        }
    }

    /// The Llama family's row ops (RMS norm, rotary embeddings, SwiGLU) on the device against
    /// the CPU backend, in every storage type; rows of odd widths, one row, and more rows than
    /// a chunk of the weight gradient's column sums.
    #[test]
    fn llama_row_ops() {
        for act in ACTS {
            llama_row_ops_in(act);
        }
    }

    fn llama_row_ops_in(act: Dtype) {
        let Some(mut be) = Both::new(act) else { return };
        for (n, c) in [(13, 37), (1, 5), (70, 64), (3, 768), (2, 2064)] {
            let (out, rstd) = (be.nan(n * c), be.nan32(n));
            let (inp, w) = (be.rand(n * c, 21), be.rand(c, 22));
            let r = RmsNorm { w, n, c, eps: 1e-5 };
            be.run(|x| x.rmsnorm_forward(&r, out, rstd, inp));
            be.check("rmsnorm_forward out", out, ELEM * 10.0);
            be.check("rmsnorm_forward rstd", rstd, ELEM);
            let dout = be.rand(n * c, 23);
            // Both forms (FUGU_LAYERNORM_BACKWARD picks the RMS norm's too): the one-pass
            // kernel (8 warps' column sums per block; rows of 2064 fit 5 in its 48 KB) and the
            // input gradient, then the column sums.
            for form in [LayernormBackward::Split, LayernormBackward::Fused] {
                be.gpu.set_layernorm_backward(form);
                let g = RmsNormGrads {
                    dinp: be.rand(n * c, 24),
                    dw: be.rand32(c, 25),
                };
                be.run(|x| x.rmsnorm_backward(&r, &g, dout, inp, rstd));
                be.check(
                    &format!("rmsnorm_backward dinp ({form:?})"),
                    g.dinp,
                    ELEM * 10.0,
                );
                // Column sums over n rows in different orders.
                be.check(&format!("rmsnorm_backward dw ({form:?})"), g.dw, GEMM);
            }
            be.gpu
                .set_layernorm_backward(cuda::LAYERNORM_BACKWARD_DEFAULT);
        }
        // Two sequences of 6 positions, rows of 3 rotated heads and 2 left alone (the V part
        // of a GQA qkv row), a table of 9 positions; heads of 8 (halves of 4: pair by pair in
        // the 16-bit types, whose packs are 8 wide) and 32 (16-byte packs in every type).
        for hs in [8, 32] {
            let (t, heads, width) = (6, 3, 5 * hs);
            let n = 2 * t;
            let tab = RopeTable::<f32>::new(hs, 9, 10_000.0);
            let table = be.buf(&[tab.cos.clone(), tab.sin.clone()].concat(), Dtype::F32);
            let r = Rope {
                table,
                n,
                width,
                heads,
                half: hs / 2,
                t,
            };
            let x = be.rand(n * width, 26);
            be.run(|b| b.rope_forward(&r, x));
            be.check("rope_forward", x, ELEM);
            be.run(|b| b.rope_backward(&r, x));
            be.check("rope_backward", x, ELEM);
        }
        for (n, f) in [(7, 13), (1, 1), (4, 256)] {
            let out = be.nan(n * f);
            let inp = be.buf(
                &random(n * 2 * f, 27)
                    .iter()
                    .map(|v| 8.0 * v)
                    .collect::<Vec<_>>(),
                act,
            );
            be.run(|x| x.swiglu_forward(out, inp, f));
            be.check("swiglu_forward", out, ELEM * 10.0);
            let (dout, dinp) = (be.rand(n * f, 28), be.nan(n * 2 * f));
            be.run(|x| x.swiglu_backward(dinp, dout, inp, f));
            be.check("swiglu_backward", dinp, ELEM * 10.0);
        }
    }

    #[test]
    fn linear_layers() {
        for act in ACTS {
            linear_layers_in(act);
        }
    }

    fn linear_layers_in(act: Dtype) {
        let Some(mut be) = Both::new(act) else { return };
        // A bias at the start of its buffer goes in the GEMM's epilogue; one element in, it is
        // not 16-byte aligned and a kernel writes it into the output first.
        linear_cases(&mut be, &[Some(0), Some(1), None]);
    }

    /// Where the engine has no epilogue for a shape (cuBLASLt's heuristic finds no
    /// algorithm), the backend adds an aligned bias with the kernel, and runs the MLP's GELU
    /// with its own kernels, instead; and keeps doing so for that shape. Runs on the emulator
    /// told to refuse every epilogue.
    #[test]
    fn linear_layers_without_epilogues() {
        for act in ACTS {
            let Some((mut be, _)) = Both::emulated(act, true) else {
                return;
            };
            // Twice: the second pass finds the shapes already marked.
            linear_cases(&mut be, &[Some(0), Some(0)]);
            for _ in 0..2 {
                linear_gelu_cases(&mut be, false, None);
            }
        }
    }

    /// A linear layer's bias gradient computed by its weight-gradient GEMM
    /// (`FUGU_BIAS_GRAD=epilogue`), against the CPU's column sums (the gradient starts
    /// non-zero: the sums are added to it): on the device (a GPU, or the emulator), on an
    /// emulator counting the epilogues (one per case with a bias, aligned or not: the GEMM
    /// writes a scratch vector of the backend's), and on one refusing them (the column-sum
    /// kernels instead). Tolerance: the same f32 sums in another order, as for the column sums
    /// of layernorm's weights.
    #[test]
    fn linear_bias_gradients_in_the_gemm() {
        for act in ACTS {
            let Some(mut be) = Both::new(act) else { return };
            be.gpu.set_bias_grad(BiasGrad::Epilogue);
            linear_cases(&mut be, &[Some(0), Some(1), None]);
            for refusing in [false, true] {
                let Some((mut be, count)) = Both::emulated(act, refusing) else {
                    return;
                };
                be.gpu.set_bias_grad(BiasGrad::Epilogue);
                linear_cases(&mut be, &[Some(0), Some(1), None]);
                // 4 shapes × 2 layouts × 2 cases with a bias.
                let ran = count.bias_grad.load(Ordering::Relaxed);
                assert_eq!(ran, if refusing { 0 } else { 16 }, "{act:?}");
            }
        }
    }

    #[test]
    fn bias_grad_parse() {
        let parse = |v| cuda::parse_in_gemm(cuda::BIAS_GRAD_ENV, v);
        assert_eq!(parse("").unwrap(), BiasGrad::Separate);
        assert_eq!(parse("separate").unwrap(), BiasGrad::Separate);
        assert_eq!(parse("epilogue").unwrap(), BiasGrad::Epilogue);
        let e = parse("gemm").unwrap_err().to_string();
        assert!(
            e.contains("FUGU_BIAS_GRAD=gemm: expected separate or epilogue"),
            "{e}"
        );
    }

    /// A linear layer with the GELU after it, and its backward pass through the GELU
    /// (`linear_gelu_forward`, `gelu_linear_backward`): on a GPU with 16-bit activations in
    /// cuBLASLt's GELU epilogues where the matrices allow them, elsewhere as two ops.
    /// Tolerance: the epilogue applies GELU (derivative) to the f32 sum where the CPU applies
    /// it to the sum rounded to the type, |gelu'| ≤ 1.13, so the two differ by at most about
    /// 1.2 unit roundoffs of the result before it is rounded once more (up to 2u if the two
    /// values straddle a rounding boundary): inside the 4u of [`Both::tol`].
    #[test]
    fn linear_gelu_layers() {
        for act in ACTS {
            // On the device (a GPU where there is one).
            let Some(mut be) = Both::new(act) else { return };
            let epilogues = be.gpu.gelu_epilogue(act);
            assert_eq!(epilogues, act != Dtype::F32, "GELU epilogues for {act:?}");
            linear_gelu_cases(&mut be, epilogues, None);
            // On the emulator, which counts the GELU epilogues it runs.
            let Some((mut be, count)) = Both::emulated(act, false) else {
                return;
            };
            linear_gelu_cases(&mut be, epilogues, Some(count));
        }
    }

    /// `epilogues`: whether the GPU side runs the GELU epilogues where a case's matrices meet
    /// their alignment (checked: the backward pass then leaves `scratch` unwritten, and
    /// `count`, where given, goes up by one in each pass).
    fn linear_gelu_cases(be: &mut Both, epilogues: bool, count: Option<Arc<EpilogueCounts>>) {
        let ran = || count.as_ref().map(|c| c.gelu.load(Ordering::Relaxed));
        // (n, ic, oc, pre's offset): 16-byte aligned rows of 16-bit values (ic and oc
        // multiples of 8) take the epilogues; 33 and 65 features, or a `pre` one element
        // into its buffer, do not.
        for (n, ic, oc, at) in [
            (17, 32, 64, 0),
            (9, 16, 24, 0),
            (1, 8, 8, 0),
            (5, 33, 65, 0),
            (7, 16, 24, 1),
            (6, 64, 16, 0),
        ] {
            let aligned = ic % 8 == 0 && oc % 8 == 0 && at == 0;
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                let (out, pre) = (be.nan(n * oc), be.nan(n * oc + 1).sub(at, n * oc));
                let inp = be.rand(n * ic, 1);
                let w = be.rand(ic * oc, 2);
                let bias = be.rand(oc, 3);
                let before = ran();
                let l = Linear {
                    w,
                    layout,
                    bias: Some(bias),
                    n,
                    ic,
                    oc,
                };
                be.run(|x| x.linear_gelu_forward(&l, out, pre, inp));
                be.check("linear_gelu_forward pre", pre, GEMM);
                be.check("linear_gelu_forward out", out, GEMM);
                let fused = epilogues && aligned;
                let what = format!("{n}x{ic}->{oc} at {at} ({:?})", be.act);
                if let (Some(a), Some(b)) = (before, ran()) {
                    assert_eq!(b - a, u64::from(fused), "forward GELU epilogues, {what}");
                }
                // Backward of a layer whose input is gelu(pre): here the roles turn, its
                // input has `oc` features (gelu(pre) = out) and its output `ic`.
                let (dpre, scratch) = (be.nan(n * oc + 1).sub(at, n * oc), be.nan(n * oc));
                let dw = be.rand32(ic * oc, 4);
                let db = be.rand32(ic, 5);
                let dout = be.rand(n * ic, 6);
                let before = ran();
                let back = Linear {
                    w,
                    layout,
                    bias: None,
                    n,
                    ic: oc,
                    oc: ic,
                };
                let g = LinearGrads {
                    dinp: Some(dpre),
                    dw,
                    dbias: Some(db),
                };
                be.run(|x| x.gelu_linear_backward(&back, &g, scratch, dout, out, pre));
                be.check("gelu_linear_backward dpre", dpre, GEMM);
                be.check("gelu_linear_backward dw", dw, GEMM);
                be.check("gelu_linear_backward dbias", db, GEMM);
                if let (Some(a), Some(b)) = (before, ran()) {
                    assert_eq!(b - a, u64::from(fused), "backward GELU epilogues, {what}");
                }
                let mut s = vec![0.0; n * oc];
                be.gpu.download(scratch, &mut s);
                let untouched = s.iter().all(|x| x.is_nan());
                assert_eq!(untouched, fused, "backward {what}: scratch left unwritten");
            }
        }
    }

    /// A projection whose output joins the residual stream (`linear_residual_forward`): on a
    /// GPU in the GEMM (the stream read as cuBLASLt's C) where the bias is 16-byte aligned or
    /// absent, elsewhere as two ops through the scratch; on the emulator, counted, and on an
    /// emulator refusing every epilogue, the two ops. Tolerance: the epilogue rounds the sum
    /// once where the CPU rounds the product (plus bias) first, a difference of at most one
    /// step of the type at the product's magnitude (≤ the compared scale): inside [`Both::tol`].
    #[test]
    fn linear_residual_layers() {
        for act in ACTS {
            let Some(mut be) = Both::new(act) else { return };
            assert!(be.gpu.residual_epilogue(act), "{act:?}");
            linear_residual_cases(&mut be, true, None);
            for refusing in [false, true] {
                let Some((mut be, count)) = Both::emulated(act, refusing) else {
                    return;
                };
                linear_residual_cases(&mut be, !refusing, Some(count));
            }
        }
    }

    /// `epilogues`: whether the GPU side runs the residual epilogue where a case's bias is
    /// aligned (checked: `scratch` is then left unwritten, and `count`, where given, goes up
    /// by one).
    fn linear_residual_cases(be: &mut Both, epilogues: bool, count: Option<Arc<EpilogueCounts>>) {
        let ran = || count.as_ref().map(|c| c.residual.load(Ordering::Relaxed));
        for (n, ic, oc) in [(17, 33, 65), (9, 16, 24), (1, 8, 8), (130, 64, 300)] {
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                // No bias, an aligned one, one a element into its buffer (not 16-byte aligned).
                for bias_at in [None, Some(0), Some(1)] {
                    let (out, scratch) = (be.nan(n * oc), be.nan(n * oc));
                    let resid = be.rand(n * oc, 7);
                    let inp = be.rand(n * ic, 1);
                    let w = be.rand(ic * oc, 2);
                    let bias = bias_at.map(|at| be.rand(oc + 1, 3).sub(at, oc));
                    let before = ran();
                    let l = Linear {
                        w,
                        layout,
                        bias,
                        n,
                        ic,
                        oc,
                    };
                    be.run(|x| x.linear_residual_forward(&l, out, resid, scratch, inp));
                    be.check("linear_residual_forward", out, GEMM);
                    let fused = epilogues && bias_at != Some(1);
                    let what = format!("{n}x{ic}->{oc}, bias at {bias_at:?} ({:?})", be.act);
                    if let (Some(a), Some(b)) = (before, ran()) {
                        assert_eq!(b - a, u64::from(fused), "residual epilogues, {what}");
                    }
                    let mut s = vec![0.0; n * oc];
                    be.gpu.download(scratch, &mut s);
                    let untouched = s.iter().all(|x| x.is_nan());
                    assert_eq!(untouched, fused, "{what}: scratch left unwritten");
                }
            }
        }
    }

    fn linear_cases(be: &mut Both, biases: &[Option<usize>]) {
        for (n, ic, oc) in [(17, 33, 65), (1, 8, 3), (130, 64, 300), (9, 16, 24)] {
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                for &bias_at in biases {
                    let out = be.nan(n * oc);
                    let inp = be.rand(n * ic, 1);
                    let w = be.rand(ic * oc, 2);
                    let bias = be.rand(oc + 1, 3).sub(bias_at.unwrap_or(0), oc);
                    let bo = bias_at.map(|_| bias);
                    let l = Linear {
                        w,
                        layout,
                        bias: bo,
                        n,
                        ic,
                        oc,
                    };
                    be.run(|x| x.linear_forward(&l, out, inp));
                    be.check("linear_forward", out, GEMM);
                    let dinp = be.nan(n * ic);
                    let dw = be.rand32(ic * oc, 4);
                    let db = be.rand32(oc, 5);
                    let dout = be.rand(n * oc, 6);
                    let dbo = bias_at.map(|_| db);
                    let g = LinearGrads {
                        dinp: Some(dinp),
                        dw,
                        dbias: dbo,
                    };
                    be.run(|x| x.linear_backward(&l, &g, dout, inp));
                    be.check("linear_backward dinp", dinp, GEMM);
                    be.check("linear_backward dw", dw, GEMM);
                    be.check("linear_backward dbias", db, GEMM);
                }
            }
        }
    }

    #[test]
    fn attention() {
        for act in ACTS {
            attention_in(act);
        }
    }

    fn attention_in(act: Dtype) {
        let Some(mut be) = Both::new(act) else { return };
        // T = 1, T = 37 (not a multiple of any block size), T = 150 and 260 (rows longer than
        // a block of threads; the CUDA GEMMs in causal row blocks of uneven sizes).
        for (b, t, nh, hs) in [(2, 1, 3, 8), (2, 37, 3, 8), (2, 150, 2, 4), (1, 260, 1, 4)] {
            let d = AttnDims::mha(b, t, nh, hs);
            let c = nh * hs;
            let qkv = be.rand(b * t * 3 * c, 1);
            let att = be.nan(b * nh * t * t);
            let out = be.nan(b * t * c);
            be.run(|x| x.attention_scores(att, qkv, d));
            be.check_causal("attention_scores", att, t, GEMM);
            be.run(|x| x.attention_softmax(att, d));
            be.check_causal("attention_softmax", att, t, ELEM * 10.0);
            be.run(|x| x.attention_values(out, att, qkv, d));
            be.check("attention_values", out, GEMM);
            let dout = be.rand(b * t * c, 2);
            let datt = be.nan(b * nh * t * t);
            let dqkv = be.nan(b * t * 3 * c);
            be.run(|x| x.attention_values_backward(datt, dqkv, dout, att, qkv, d));
            be.check_causal("attention_values_backward datt", datt, t, GEMM);
            be.run(|x| x.attention_softmax_backward(datt, att, d));
            be.check_causal("attention_softmax_backward", datt, t, GEMM);
            be.run(|x| x.attention_scores_backward(dqkv, datt, qkv, d));
            be.check("attention dqkv", dqkv, GEMM);
        }
        // Decoding over a cache of 1..=9 positions, with a key/value head per query head and
        // with grouped-query attention (two query heads per key/value head).
        for (nh, kvh) in [(3, 3), (4, 2)] {
            let (hs, p) = (5, 12);
            let (c, ckv) = (nh * hs, kvh * hs);
            let (kc, vc) = (be.rand(p * ckv, 3), be.rand(p * ckv, 4));
            let q = be.rand(c, 5);
            let d = AttnDims {
                b: 1,
                t: 1,
                nh,
                kv: kvh,
                hs,
            };
            for len in 1..=9 {
                let out = be.nan(c);
                let kv = KvRows { k: kc, v: vc, len };
                be.run(|x| x.attention_decode(out, q, kv, d));
                be.check("attention_decode", out, GEMM);
            }
        }
    }

    /// Fused (flash) attention in the 16-bit types against the CPU's reference loops, on head
    /// sizes that take every path of the kernels: 8 (one 16-wide k chunk, half used), 24
    /// (16-byte rows, a partial chunk), 64 (the whole tile), 5 (element-wise tile loads), and
    /// T = 1, 37, 150 (partial 64-row blocks, several key blocks).
    ///
    /// Tolerances: `out` is a convex combination of v rows; the device rounds the
    /// probabilities to the type for its tensor-core product (the reference keeps f32), which
    /// moves it by at most u·max|v| ≤ u, inside [`Both::tol`]'s 4u. The gradients' products
    /// also take dS = P∘(dP − Δ) rounded to the type: each term moves by u relative, so sums
    /// of them by up to u·Σ|term|, a few times u of the largest result; 4u more is allowed.
    /// `lse` is f32 on both sides (sums of exponentials in different orders).
    #[test]
    fn fused_attention() {
        for act in [Dtype::Bf16, Dtype::F16] {
            fused_attention_in(act, &FUSED_SHAPES);
        }
    }

    /// The same for heads of 65 to 128 (the `_d128` kernels: tiles 128 columns wide, in
    /// dynamic shared memory; the backward's reread their own tiles' fragments): 128 (the
    /// whole tile, three key blocks, the last partial), 100 with grouped-query attention (not
    /// a multiple of 8: element-wise loads), 72 (16-byte rows, most of the tile padding). The
    /// other forms' settings leave these heads on the one form: the same bits. Tolerances as
    /// above: the rounding of P and dS moves each term by u relative, whatever the head size.
    const HEAD_128_SHAPES: [(usize, usize, usize, usize, usize); 3] =
        [(1, 150, 2, 2, 128), (2, 70, 4, 2, 100), (1, 37, 3, 3, 72)];

    #[test]
    fn fused_attention_head_128() {
        for act in [Dtype::Bf16, Dtype::F16] {
            fused_attention_in(act, &HEAD_128_SHAPES);
        }
    }

    /// Every fused attention kernel with 32 rows per warp.
    const WIDE: FlashWarpRows = FlashWarpRows {
        forward: 32,
        dq: 32,
        dkv: 32,
    };

    /// The fused attention's forms other than the default: 32 rows per warp; 128 query rows
    /// per block (the forward and dQ kernels), with 16 and with 32 rows per warp.
    const OTHER_FORMS: [(FlashWarpRows, FlashQueryRows); 3] = [
        (WIDE, FlashQueryRows(64)),
        (
            FlashWarpRows {
                forward: 16,
                dq: 16,
                dkv: 16,
            },
            FlashQueryRows(128),
        ),
        (WIDE, FlashQueryRows(128)),
    ];

    /// `x` and `y` hold the same bits on `be`.
    fn same_bits(be: &CudaBackend, what: &str, x: Span, y: Span, d: AttnDims) {
        let (mut u, mut v) = (vec![0.0; x.len], vec![0.0; y.len]);
        be.download(x, &mut u);
        be.download(y, &mut v);
        let bits = |w: &[f32]| w.iter().map(|z| z.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&u), bits(&v), "{what}, {d:?}");
    }

    #[test]
    fn layernorm_backward_parse() {
        let parse = |v| {
            LayernormBackward::parse(
                cuda::LAYERNORM_BACKWARD_ENV,
                v,
                cuda::LAYERNORM_BACKWARD_DEFAULT,
            )
        };
        assert_eq!(parse("").unwrap(), LayernormBackward::Fused);
        assert_eq!(parse("split").unwrap(), LayernormBackward::Split);
        assert_eq!(parse("fused").unwrap(), LayernormBackward::Fused);
        let e = parse("Fused").unwrap_err().to_string();
        assert!(
            e.contains("FUGU_LAYERNORM_BACKWARD=Fused: expected split or fused"),
            "{e}"
        );
    }

    #[test]
    fn flash_backward_parse() {
        let parse =
            |v| FlashBackward::parse(cuda::FLASH_BACKWARD_ENV, v, cuda::FLASH_BACKWARD_DEFAULT);
        assert_eq!(parse("").unwrap(), FlashBackward::Split);
        assert_eq!(parse("fused").unwrap(), FlashBackward::Fused);
        assert_eq!(parse("stored").unwrap(), FlashBackward::Stored);
        let e = parse("one").unwrap_err().to_string();
        assert!(
            e.contains("FUGU_FLASH_BACKWARD=one: expected split, fused or stored"),
            "{e}"
        );
    }

    /// `FUGU_FLASH_WARP_ROWS`: one value for every kernel, or one each.
    #[test]
    fn flash_warp_rows_parse() {
        let rows = |f, q, kv| FlashWarpRows {
            forward: f,
            dq: q,
            dkv: kv,
        };
        assert_eq!(FlashWarpRows::parse("").unwrap(), rows(16, 16, 16));
        assert_eq!(FlashWarpRows::parse("32").unwrap(), rows(32, 32, 32));
        assert_eq!(FlashWarpRows::parse("32,16, 32").unwrap(), rows(32, 16, 32));
        for bad in ["8", "16,32", "32,16,16,16", "x"] {
            let e = FlashWarpRows::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains(&format!("FUGU_FLASH_WARP_ROWS={bad}: expected 16 or 32")),
                "{e}"
            );
        }
    }

    fn fused_attention_in(act: Dtype, shapes: &[(usize, usize, usize, usize, usize)]) {
        let Some(mut be) = Both::new(act) else { return };
        for &(b, t, nh, kv, hs) in shapes {
            if be.gpu.fused_attention(hs, act) == FusedAttention::Unsupported {
                skipped(&format!(
                    "no fused attention on this device for hs = {hs} in {act:?}"
                ));
                return;
            }
            let d = AttnDims { b, t, nh, kv, hs };
            let (c, w) = (nh * hs, d.shape().qkv_width());
            let qkv = be.rand(b * t * w, 1);
            let out = be.nan(b * t * c);
            let lse = be.nan32(b * nh * t);
            be.run(|x| x.attention_forward(out, lse, qkv, d));
            be.check("fused attention out", out, GEMM);
            be.check("fused attention lse", lse, GEMM);
            // The kernels with 32 rows per warp, and those with 128 query rows per block, do
            // each row's arithmetic in the same order as the default: the same bits.
            for (warp, query) in OTHER_FORMS {
                let (o, l) = (be.nan(b * t * c), be.nan32(b * nh * t));
                be.gpu.set_flash_warp_rows(warp);
                be.gpu.set_flash_query_rows(query);
                be.gpu.attention_forward(o, l, qkv, d);
                let what = format!("{} rows per warp, {} per block", warp.forward, query.0);
                same_bits(&be.gpu, &format!("out, {what}"), out, o, d);
                same_bits(&be.gpu, &format!("lse, {what}"), lse, l, d);
            }
            be.gpu.set_flash_warp_rows(FlashWarpRows::default());
            be.gpu.set_flash_query_rows(FlashQueryRows::default());
            let dout = be.rand(b * t * c, 2);
            let dqkv = be.nan(b * t * w);
            be.run(|x| x.attention_backward(dqkv, dout, FusedOut { out, lse }, qkv, d, None));
            for (warp, query) in OTHER_FORMS {
                let other = be.nan(b * t * w);
                be.gpu.set_flash_warp_rows(warp);
                be.gpu.set_flash_query_rows(query);
                be.gpu
                    .attention_backward(other, dout, FusedOut { out, lse }, qkv, d, None);
                let what = format!("{} rows per warp, {} per block", warp.forward, query.0);
                same_bits(&be.gpu, &format!("dqkv, {what}"), dqkv, other, d);
            }
            be.gpu.set_flash_warp_rows(FlashWarpRows::default());
            be.gpu.set_flash_query_rows(FlashQueryRows::default());
            be.check(
                "fused attention dqkv",
                dqkv,
                GEMM + FUSED_DQKV_TOL * act.unit_roundoff(),
            );
        }
    }

    /// The fused attention kernels' shapes (B, T, query heads, key/value heads, head size):
    /// T = 1; T = 37, 70 and 150 (one to three key blocks of 64, the last partial); head sizes
    /// 8, 64, 24 and 5 (padded to 64 columns; 5 is not a multiple of 8: element-wise loads);
    /// grouped-query attention with groups of 2 and 4 query heads (the dK/dV kernels sum a
    /// group's heads), one of them with several key/value heads.
    const FUSED_SHAPES: [(usize, usize, usize, usize, usize); 8] = [
        (2, 1, 3, 3, 8),
        (2, 37, 3, 3, 8),
        (1, 150, 2, 2, 64),
        (1, 70, 2, 2, 24),
        (1, 40, 2, 2, 5),
        (2, 37, 4, 2, 8),
        (1, 150, 4, 1, 64),
        (2, 70, 8, 2, 24),
    ];

    /// The fused backward's dqkv against the CPU: the GEMM tolerance, plus four roundings of
    /// the type (P and dS are rounded to it for their products, as the three steps store
    /// them), in units of its unit roundoff over GEMM.
    const FUSED_DQKV_TOL: f64 = 4.0;

    /// The fused attention's one-kernel backward (`FUGU_FLASH_BACKWARD=fused`): the products
    /// of the two kernels, with dQ's shares added across key blocks in turn (another order
    /// of f32 sums), against the CPU as the two kernels are; its 16- and 32-row forms give
    /// the same bits. Its own test, so that on a GPU (scripts/gpu-check.sh runs it in its own
    /// process) a kernel that traps waiting for its turn does not take the other tests'
    /// context with it.
    #[test]
    fn fused_attention_one_kernel_backward() {
        // Plus 36 work items (4 sequences × 3 heads × 3 key blocks): more than the emulator's
        // 32 blocks, so a block takes several items from the counter; and 24 over groups of 3
        // query heads (4 sequences × 2 key/value heads × 3 key blocks).
        let shapes = FUSED_SHAPES
            .into_iter()
            .chain([(4, 150, 3, 3, 8), (4, 150, 6, 2, 8)]);
        each_attention_case(shapes, false, |be, x, _| {
            let (d, n) = (x.d, x.width());
            let (dqkv, wide) = (be.nan(n), be.nan(n));
            be.gpu.set_flash_backward(FlashBackward::Fused);
            be.run(|b| x.backward(b, dqkv));
            let tol = GEMM + FUSED_DQKV_TOL * be.act.unit_roundoff();
            be.check("fused attention dqkv, one kernel", dqkv, tol);
            be.gpu.set_flash_warp_rows(WIDE);
            x.backward(&mut be.gpu, wide);
            be.gpu.set_flash_warp_rows(FlashWarpRows::default());
            be.gpu.set_flash_backward(FlashBackward::Split);
            same_bits(&be.gpu, "dqkv, one kernel, 32 rows per warp", dqkv, wide, d);
        });
    }

    /// The inputs of a fused-attention test case: qkv, the forward pass's out and lse (on
    /// both backends, default kernels) and a random dout.
    #[derive(Clone, Copy)]
    struct AttnCase {
        d: AttnDims,
        qkv: Span,
        out: Span,
        lse: Span,
        dout: Span,
    }

    impl AttnCase {
        /// The forward pass's out and lse.
        fn fwd(&self) -> FusedOut {
            FusedOut {
                out: self.out,
                lse: self.lse,
            }
        }

        /// dqkv's length.
        fn width(&self) -> usize {
            self.d.b * self.d.t * self.d.shape().qkv_width()
        }

        /// The backward pass into `dqkv` on backend `x`.
        fn backward(&self, x: &mut dyn Backend, dqkv: Span) {
            x.attention_backward(dqkv, self.dout, self.fwd(), self.qkv, self.d, None);
        }
    }

    /// Runs `case` on each of `shapes` (B, T, query heads, key/value heads, head size), in
    /// bf16 and f16, with whether the device is the emulator; with `wgmma`, only on a device
    /// with warpgroup MMA (skipped elsewhere: compute capability other than 9.0).
    fn each_attention_case(
        shapes: impl IntoIterator<Item = (usize, usize, usize, usize, usize)> + Clone,
        wgmma: bool,
        mut case: impl FnMut(&mut Both, AttnCase, bool),
    ) {
        for act in [Dtype::Bf16, Dtype::F16] {
            let Some(mut be) = Both::new(act) else { return };
            if wgmma && !be.gpu.has_wgmma() {
                return skipped("no warpgroup MMA on this GPU (compute capability 9.0 only)");
            }
            let emulated = be.gpu.describe().contains("emulator");
            for (b, t, nh, kv, hs) in shapes.clone() {
                if be.gpu.fused_attention(hs, act) == FusedAttention::Unsupported {
                    return skipped(&format!(
                        "no fused attention on this device for hs = {hs} in {act:?}"
                    ));
                }
                let d = AttnDims { b, t, nh, kv, hs };
                let c = nh * hs;
                let qkv = be.rand(b * t * d.shape().qkv_width(), 1);
                let (out, lse) = (be.nan(b * t * c), be.nan32(b * nh * t));
                be.run(|x| x.attention_forward(out, lse, qkv, d));
                let dout = be.rand(b * t * c, 2);
                let x = AttnCase {
                    d,
                    qkv,
                    out,
                    lse,
                    dout,
                };
                case(&mut be, x, emulated);
            }
        }
    }

    /// The attention backward with stored dS (`FUGU_FLASH_BACKWARD=stored`): the dK/dV kernel
    /// stores each tile's dS and a dQ kernel multiplies it by K, the same products on the same
    /// values, summed in the same order, as the dQ kernel of the default form: the same bits
    /// as the default (on a GPU this holds where the tensor cores sum a product's terms in
    /// the order they sum its transpose's, which the test checks), in its 16- and 32-row
    /// forms, with every sequence in one chunk of dS tiles and one sequence per chunk; heads of
    /// 65 to 128 too (the head-128 kernels, Δ by the prep kernel's 16 lanes per row).
    #[test]
    fn fused_attention_stored_ds_backward() {
        let shapes = FUSED_SHAPES.into_iter().chain(HEAD_128_SHAPES);
        each_attention_case(shapes, false, |be, x, _| {
            let (d, n) = (x.d, x.width());
            let split = be.nan(n);
            x.backward(&mut be.gpu, split);
            be.gpu.set_flash_backward(FlashBackward::Stored);
            for (warp, budget) in [(16, usize::MAX), (32, usize::MAX), (16, 1), (32, 1)] {
                if warp == 32 && d.hs > 64 {
                    continue; // the head-128 kernels have 16 rows per warp only
                }
                let stored = be.nan(n);
                be.gpu.set_flash_warp_rows(FlashWarpRows {
                    forward: 16,
                    dq: warp,
                    dkv: warp,
                });
                be.gpu.set_flash_ds_budget(budget);
                x.backward(&mut be.gpu, stored);
                let what = format!("dqkv, stored dS, {warp} rows per warp, budget {budget}");
                same_bits(&be.gpu, &what, split, stored, d);
            }
            be.gpu.set_flash_warp_rows(FlashWarpRows::default());
            be.gpu.set_flash_backward(FlashBackward::Split);
            be.gpu.set_flash_ds_budget(usize::MAX);
        });
    }

    /// The forward kernel on Hopper's warpgroup MMA (`FUGU_FLASH_MMA=wgmma`, the tensor
    /// cores reading K and V from swizzled shared memory), with 64 and 128 query rows per
    /// block (one warpgroup or two): against the CPU as the default kernel is, on every
    /// fused-attention test shape, heads of 65 to 128 too (`flash_forward_wgmma_d128`: two
    /// 64-column swizzled tiles per K and V tile, 64 rows per block whatever the setting); on
    /// the emulator, which sums each 16-deep slice in k order as it does for mma.sync, also
    /// the same bits as the default kernel (a GPU's order inside either instruction is
    /// unspecified).
    #[test]
    fn fused_attention_wgmma_forward() {
        let shapes = FUSED_SHAPES.into_iter().chain(HEAD_128_SHAPES);
        each_attention_case(shapes, true, |be, x, emulated| {
            let AttnCase {
                d, qkv, out, lse, ..
            } = x;
            for (rows, overlap) in [64, 128]
                .into_iter()
                .flat_map(|r| [(r, FlashOverlap::Off), (r, FlashOverlap::On)])
            {
                let (o, l) = (be.nan(out.len), be.nan32(lse.len));
                be.gpu.set_flash_query_rows(FlashQueryRows(rows));
                be.gpu.set_flash_mma(FlashMma::Wgmma).unwrap();
                be.gpu.set_flash_overlap(overlap).unwrap();
                be.run(|x| x.attention_forward(o, l, qkv, d));
                be.gpu.set_flash_overlap(FlashOverlap::Off).unwrap();
                be.gpu.set_flash_mma(FlashMma::Sync).unwrap();
                be.gpu.set_flash_query_rows(FlashQueryRows::default());
                let form = format!("{rows} rows, overlap {}", overlap.name());
                be.check(&format!("wgmma attention out, {form}"), o, GEMM);
                be.check(&format!("wgmma attention lse, {form}"), l, GEMM);
                if emulated {
                    same_bits(&be.gpu, &format!("out, wgmma, {form}"), out, o, d);
                    same_bits(&be.gpu, &format!("lse, wgmma, {form}"), lse, l, d);
                }
            }
            // The overlap needs the warpgroup-MMA kernels.
            let e = be.gpu.set_flash_overlap(FlashOverlap::On).unwrap_err();
            assert!(e.to_string().contains("FUGU_FLASH_MMA=wgmma"), "{e}");
        });
    }

    /// The backward pass with stored dS on Hopper's warpgroup MMA (`FUGU_FLASH_MMA=wgmma`,
    /// `FUGU_FLASH_BACKWARD=stored`: the dK/dV kernel's four products and the dQ kernel's one
    /// with the tensor cores reading Q, dO and K from swizzled shared memory): against the
    /// CPU as the default kernels are, on every fused-attention test shape, heads of 65 to
    /// 128 too (the `_wgmma_d128` kernels); on the emulator also the same bits as the default
    /// (the same sums in the same order there).
    #[test]
    fn fused_attention_wgmma_backward() {
        let shapes = FUSED_SHAPES.into_iter().chain(HEAD_128_SHAPES);
        each_attention_case(shapes, true, |be, x, emulated| {
            let (d, n) = (x.d, x.width());
            let (split, wg) = (be.nan(n), be.nan(n));
            x.backward(&mut be.gpu, split);
            be.gpu.set_flash_backward(FlashBackward::Stored);
            be.gpu.set_flash_mma(FlashMma::Wgmma).unwrap();
            be.run(|b| x.backward(b, wg));
            be.gpu.set_flash_mma(FlashMma::Sync).unwrap();
            be.gpu.set_flash_backward(FlashBackward::Split);
            let tol = GEMM + FUSED_DQKV_TOL * be.act.unit_roundoff();
            be.check("wgmma attention dqkv", wg, tol);
            if emulated {
                same_bits(&be.gpu, "dqkv, wgmma (emulated)", split, wg, d);
            }
        });
    }

    /// The attention backward with the rotary embedding undone in its dQ and dK stores
    /// (`Backend::attention_backward`'s `rope`; heads of 64 and 128, `rope_in_stores`), in
    /// every backward form it has for the head size: the same bits as the backward followed
    /// by the rope kernel, which it replaces (each pair of columns rounded to the type,
    /// rotated by the same f32 arithmetic, `rope_pair`, rounded again). Heads of 24 and 100
    /// run the rope kernel after the backward, as the model did before. Against the CPU (the
    /// backward, then its rope op) too: the fused backward's tolerance doubled (a rotated
    /// value mixes two gradients, each within it, by a cosine and a sine whose absolute values
    /// add to at most √2) plus one more rounding of the type (2u).
    #[test]
    fn fused_attention_backward_rotates_back() {
        let shapes = [
            (1, 150, 4, 2, 64),
            (2, 70, 2, 1, 128),
            (1, 70, 2, 2, 24),
            (1, 37, 4, 2, 100),
        ];
        each_attention_case(shapes, false, |be, x, _| {
            let (d, n) = (x.d, x.width());
            let in_stores = be.gpu.rope_in_attention_backward(d.hs);
            assert_eq!(in_stores, d.hs == 64 || d.hs == 128, "{d:?}");
            assert!(!be.cpu.rope_in_attention_backward(d.hs));
            let tab = RopeTable::<f32>::new(d.hs, d.t + 3, 10_000.0);
            let table = be.buf(&[tab.cos.clone(), tab.sin.clone()].concat(), Dtype::F32);
            let r = Rope {
                table,
                n: d.b * d.t,
                width: d.shape().qkv_width(),
                heads: d.nh + d.kv,
                half: d.hs / 2,
                t: d.t,
            };
            let rotated = be.nan(n);
            be.run(|b| {
                b.attention_backward(rotated, x.dout, x.fwd(), x.qkv, d, Some(&r));
            });
            let u = be.act.unit_roundoff();
            let tol = 2.0 * (GEMM + FUSED_DQKV_TOL * u) + 2.0 * u;
            be.check("fused attention dqkv, rotated back", rotated, tol);
            let mut forms = vec![
                (FlashBackward::Split, FlashMma::Sync, 16),
                (FlashBackward::Stored, FlashMma::Sync, 16),
            ];
            if d.hs <= 64 {
                forms.extend([
                    (FlashBackward::Split, FlashMma::Sync, 32),
                    (FlashBackward::Stored, FlashMma::Sync, 32),
                    (FlashBackward::Fused, FlashMma::Sync, 16),
                    (FlashBackward::Fused, FlashMma::Sync, 32),
                ]);
            }
            if be.gpu.has_wgmma() {
                forms.push((FlashBackward::Stored, FlashMma::Wgmma, 16));
            }
            for (form, mma, rows) in forms {
                be.gpu.set_flash_backward(form);
                be.gpu.set_flash_warp_rows(FlashWarpRows {
                    forward: 16,
                    dq: rows,
                    dkv: rows,
                });
                be.gpu.set_flash_mma(mma).unwrap();
                let (then, inside) = (be.nan(n), be.nan(n));
                x.backward(&mut be.gpu, then);
                be.gpu.rope_backward(&r, then);
                be.gpu
                    .attention_backward(inside, x.dout, x.fwd(), x.qkv, d, Some(&r));
                let what = format!("dqkv rotated back, {form:?} {mma:?} {rows} rows per warp");
                same_bits(&be.gpu, &what, then, inside, d);
            }
            be.gpu.set_flash_backward(FlashBackward::Split);
            be.gpu.set_flash_mma(FlashMma::Sync).unwrap();
            be.gpu.set_flash_warp_rows(FlashWarpRows::default());
        });
    }

    /// The files of timed choices in cache folder `dir` (not the lock files beside them that
    /// their writers take, `<file>.flock`).
    fn choice_files(dir: &Path) -> Vec<PathBuf> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_none_or(|e| e != "flock"))
            .collect()
    }

    /// The timed-forms tests' shape: GQA, and a last query block of 32 rows.
    const TIMED_SHAPE: AttnDims = AttnDims {
        b: 1,
        t: 96,
        nh: 2,
        kv: 1,
        hs: 64,
    };

    /// `FUGU_FLASH_SELECT=timed` (`attention_select.rs`): the first forward and backward call
    /// of a shape time every form and run the fastest, writing the caller's outputs as that
    /// form run from its settings does (the same bits: the timed calls wrote scratch), within
    /// the fused attention's tolerance of the CPU; the choices are kept on disk (one entry per
    /// pass), so that a backend opening the cache again runs the stored forms without timing
    /// (only their kernels launch); and a stored choice is what runs (an entry written by hand
    /// for 128 query rows launches that form's kernel).
    #[test]
    fn timed_attention_forms_run_the_fastest_and_are_kept() {
        use fugu::backend::cuda::attention_select::{shape_key, FlashPass, FormChoice};
        use fugu::backend::cuda::choice_cache::lock_path;
        use fugu::backend::cuda::choice_cache::Entry;
        use fugu::backend::cuda::{FlashForm, FlashSelect};
        let Some(mut be) = Both::new(Dtype::Bf16) else {
            return;
        };
        let d = TIMED_SHAPE;
        let (n, c) = (d.b * d.t * d.shape().qkv_width(), d.b * d.t * d.nh * d.hs);
        let (qkv, dout) = (be.rand(n, 1), be.rand(c, 2));
        let dir = tmp("attention-forms");
        be.gpu.set_flash_timing(1, 1);
        be.gpu.set_attention_cache(Some(&dir));
        be.gpu.set_flash_select(FlashSelect::Timed);
        let (out, lse, dqkv) = (be.nan(c), be.nan32(d.b * d.nh * d.t), be.nan(n));
        let fwd = FusedOut { out, lse };
        be.run(|x| x.attention_forward(out, lse, qkv, d));
        be.run(|x| x.attention_backward(dqkv, dout, fwd, qkv, d, None));
        be.check("timed attention out", out, GEMM);
        be.check("timed attention lse", lse, GEMM);
        let tol = GEMM + FUSED_DQKV_TOL * be.act.unit_roundoff();
        be.check("timed attention dqkv", dqkv, tol);

        // One file, holding the two passes' choices.
        let files = choice_files(&dir);
        assert_eq!(files.len(), 1, "{files:?}");
        let text = std::fs::read_to_string(&files[0]).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        let stored = |pass| {
            let key = shape_key(pass, d, Dtype::Bf16, false);
            let line = lines[2..]
                .iter()
                .find_map(|l| l.strip_prefix(&format!("{key} | ")))
                .unwrap_or_else(|| panic!("no {key} in {text}"));
            FormChoice::parse(line).unwrap()
        };
        let (f_fwd, f_bwd) = (stored(FlashPass::Forward), stored(FlashPass::Backward));
        assert!(f_fwd.chosen_ms <= f_fwd.default_ms, "{f_fwd:?}");
        assert!(f_bwd.chosen_ms <= f_bwd.default_ms, "{f_bwd:?}");
        // Every distinct kernel set was timed (none left out for disagreeing with the
        // default): forward, 16 or 32 rows per warp by 64 or 128 per block with mma.sync,
        // and with wgmma 64 or 128, overlapped or not; backward, the split pass's eight (dQ
        // kernel 16 or 32 rows per warp by 64 or 128 per block, dK/dV kernel 16 or 32), the
        // one kernel's two, the stored-dS pass's four (each kernel 16 or 32), and its wgmma
        // form.
        let wgmma = be.gpu.has_wgmma() as usize;
        assert_eq!((f_fwd.timed, f_bwd.timed), (4 + 4 * wgmma, 14 + wgmma));

        // Each chosen form run from its settings: the same bits, and the kernels it launches.
        type Outs = (Span, Span, Span);
        let both_passes = |g: &mut CudaBackend, (o, l, dq): Outs| {
            g.log_launches();
            g.attention_forward(o, l, qkv, d);
            let forward = g.launched();
            g.log_launches();
            g.attention_backward(dq, dout, fwd, qkv, d, None);
            (forward, g.launched())
        };
        let settings_run = |g: &mut CudaBackend, form: FlashForm, outs: Outs| {
            g.set_flash_select(FlashSelect::Settings);
            g.set_flash_form(form).unwrap();
            let kernels = both_passes(g, outs);
            g.set_flash_form(FlashForm::default()).unwrap();
            kernels
        };
        let timed_run = |g: &mut CudaBackend, outs: Outs| {
            g.set_attention_cache(Some(&dir));
            g.set_flash_select(FlashSelect::Timed);
            let kernels = both_passes(g, outs);
            g.set_flash_select(FlashSelect::Settings);
            kernels
        };
        let mut outs = || (be.nan(c), be.nan32(d.b * d.nh * d.t), be.nan(n));
        let (as_fwd, as_bwd, again, by_hand) = (outs(), outs(), outs(), outs());
        let (fwd_kernels, _) = settings_run(&mut be.gpu, f_fwd.form, as_fwd);
        same_bits(&be.gpu, "timed forward, as its settings", out, as_fwd.0, d);
        let (_, bwd_kernels) = settings_run(&mut be.gpu, f_bwd.form, as_bwd);
        same_bits(
            &be.gpu,
            "timed backward, as its settings",
            dqkv,
            as_bwd.2,
            d,
        );

        // Opened again: the stored forms, and nothing else, run.
        let (forward, backward) = timed_run(&mut be.gpu, again);
        assert_eq!(forward, fwd_kernels);
        assert_eq!(backward, bwd_kernels);
        same_bits(&be.gpu, "stored forward form", out, again.0, d);
        same_bits(&be.gpu, "stored backward form", dqkv, again.2, d);

        // A choice written by hand is the one that runs.
        let q128 = FlashForm {
            query_rows: FlashQueryRows(128),
            ..FlashForm::default()
        };
        let entry = |pass| {
            let choice = FormChoice {
                form: q128,
                timed: 1,
                default_ms: 1.0,
                chosen_ms: 0.5,
            };
            let key = shape_key(pass, d, Dtype::Bf16, false);
            format!("{key} | {}", choice.fields())
        };
        let edited = [
            lines[0].to_string(),
            lines[1].to_string(),
            entry(FlashPass::Forward),
            entry(FlashPass::Backward),
        ];
        std::fs::write(&files[0], edited.join("\n") + "\n").unwrap();
        let (want_fwd, want_bwd) = settings_run(&mut be.gpu, q128, by_hand);
        assert!(
            want_fwd[0].starts_with("flash_forward_q128"),
            "{want_fwd:?}"
        );
        assert!(want_bwd
            .iter()
            .any(|k| k.starts_with("flash_backward_dq_q128")));
        let (forward, backward) = timed_run(&mut be.gpu, by_hand);
        assert_eq!(forward, want_fwd);
        assert_eq!(backward, want_bwd);
        let (o, l, dq) = by_hand;
        be.cpu.attention_forward(o, l, qkv, d);
        be.cpu.attention_backward(dq, dout, fwd, qkv, d, None);
        be.check("stored 128-row forward", o, GEMM);
        be.check("stored 128-row backward", dq, tol);

        // Ranks sharing a cache: where another process holds a shape's lock (timing it), this
        // one waits for its choice and runs it (here a choice written a moment later).
        let shared = tmp("attention-forms-shared");
        std::fs::create_dir_all(&shared).unwrap();
        let file = shared.join(files[0].file_name().unwrap());
        let key = shape_key(FlashPass::Forward, d, Dtype::Bf16, false);
        let mut lock = lock_path(&file, &key).into_os_string();
        lock.push(".lock");
        std::fs::write(&lock, "another rank").unwrap();
        let writer = {
            let (file, lock) = (file.clone(), lock.clone());
            let text = [edited[0].clone(), edited[1].clone(), edited[2].clone()].join("\n");
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(1500));
                std::fs::write(&file, text + "\n").unwrap();
                std::fs::remove_file(&lock).unwrap();
            })
        };
        let g = &mut be.gpu;
        g.set_attention_cache(Some(&shared));
        g.set_flash_select(FlashSelect::Timed);
        g.log_launches();
        g.attention_forward(by_hand.0, by_hand.1, qkv, d);
        assert_eq!(g.launched(), want_fwd);
        g.set_flash_select(FlashSelect::Settings);
        writer.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&shared);
    }

    /// Timing the backward's forms on a device whose free memory cannot hold a form's own
    /// scratch (the stored-dS tiles, the one-kernel backward's dQ accumulators): those forms
    /// are never run (an allocation past the emulated device's size fails, as on a full GPU),
    /// a form without scratch is chosen, and its gradients match the CPU's. Emulator only:
    /// it is given a memory size just above what the run holds plus the timed calls' outputs.
    #[test]
    fn timed_attention_forms_skip_those_whose_scratch_does_not_fit() {
        use fugu::backend::cuda::FlashSelect;
        let emulator = match cuda::emu::Emulator::new() {
            Ok(e) => e,
            Err(e) => return skipped(&format!("no CUDA emulator ({e:#})")),
        };
        let memory = emulator.memory();
        let mut be = Both {
            cpu: CpuBackend::new(),
            gpu: CudaBackend::with_engine(Box::new(emulator)),
            act: Dtype::Bf16,
        };
        let d = TIMED_SHAPE;
        let (n, c) = (d.b * d.t * d.shape().qkv_width(), d.b * d.t * d.nh * d.hs);
        let (qkv, dout) = (be.rand(n, 1), be.rand(c, 2));
        let (out, lse, dqkv) = (be.nan(c), be.nan32(d.b * d.nh * d.t), be.nan(n));
        let fwd = FusedOut { out, lse };
        be.run(|x| x.attention_forward(out, lse, qkv, d));
        // The default (split) backward once, for what it holds between calls.
        be.gpu.attention_backward(dqkv, dout, fwd, qkv, d, None);
        // Room for the timed calls' scratch gradients and 16 KiB: less than either form's own
        // scratch (the dS tiles, 2 heads × 3 tile pairs × 64² × 2 bytes = 48 KiB; the one-kernel
        // backward's f32 dQ accumulators, 96 × 2 × 64 × 4 bytes, and its tiles' counters).
        memory.set_size(Some(memory.used() + n * 2 + (16 << 10)));
        let g = &mut be.gpu;
        g.set_flash_timing(1, 1);
        g.set_attention_cache(None);
        g.set_flash_select(FlashSelect::Timed);
        let scratch_kernel = |k: &String| k.contains("store") || k.contains("fused");
        g.log_launches();
        g.attention_backward(dqkv, dout, fwd, qkv, d, None);
        let timing = g.launched();
        assert!(
            timing.iter().any(|k| k.starts_with("flash_backward_dq")),
            "{timing:?}"
        );
        assert!(!timing.iter().any(scratch_kernel), "{timing:?}");
        g.log_launches();
        g.attention_backward(dqkv, dout, fwd, qkv, d, None);
        let chosen = g.launched();
        assert!(
            !chosen.is_empty() && !chosen.iter().any(scratch_kernel),
            "{chosen:?}"
        );
        g.set_flash_select(FlashSelect::Settings);
        memory.set_size(None);
        be.cpu.attention_backward(dqkv, dout, fwd, qkv, d, None);
        let tol = GEMM + FUSED_DQKV_TOL * be.act.unit_roundoff();
        be.check("backward timed in little memory", dqkv, tol);
    }

    /// The operand layouts of the wgmma kernels on their own (`CudaBackend::wgmma_probe`):
    /// one warpgroup multiplies a 64 × 64 A from registers by a 64 × 64 tile that the tensor
    /// cores read from swizzled shared memory, as a K tile (A·Bᵀ) and as a V tile (A·B), against
    /// the products in f64 of the same 16-bit values. Where the wgmma attention kernels fail
    /// on a GPU, this names the layout that is wrong.
    #[test]
    fn wgmma_layouts() {
        for act in [Dtype::Bf16, Dtype::F16] {
            let Some(mut be) = Both::new(act) else { return };
            if !be.gpu.has_wgmma() {
                return skipped("no warpgroup MMA on this GPU (compute capability 9.0 only)");
            }
            let n = 64;
            let (a, b) = (be.rand(n * n, 5), be.rand(n * n, 6));
            let (mut av, mut bv) = (vec![0.0; n * n], vec![0.0; n * n]);
            be.gpu.download(a, &mut av);
            be.gpu.download(b, &mut bv);
            for transposed in [false, true] {
                let d = be.nan32(n * n);
                be.gpu.wgmma_probe(d, a, b, transposed);
                let mut got = vec![0.0; n * n];
                be.gpu.download(d, &mut got);
                let what = if transposed {
                    "A·B (V tiles)"
                } else {
                    "A·Bᵀ (K tiles)"
                };
                for i in 0..n {
                    for j in 0..n {
                        let (mut want, mut size) = (0.0f64, 0.0f64);
                        for k in 0..n {
                            let bk = if transposed {
                                bv[k * n + j]
                            } else {
                                bv[j * n + k]
                            };
                            let p = av[i * n + k] as f64 * bk as f64;
                            want += p;
                            size += p.abs();
                        }
                        // f32 sums of 64 exact products (16-bit operands).
                        let err = (got[i * n + j] as f64 - want).abs();
                        assert!(
                            err <= 64.0 * f32::EPSILON as f64 * size,
                            "wgmma {what}, {act:?}: d[{i}][{j}] = {}, want {want}",
                            got[i * n + j]
                        );
                    }
                }
            }
            // The emulator's products take effect at the wait, as a GPU's asynchronous ones
            // do: accumulators read before it still hold what they held (so a kernel that
            // reads them early fails here as it would on a GPU, where that is undefined).
            if be.gpu.describe().contains("emulator") {
                let d = be.nan32(n * n);
                be.gpu.wgmma_probe_read_before_wait(d, a, b);
                let mut got = vec![0.0; n * n];
                be.gpu.download(d, &mut got);
                assert!(got.iter().all(|&v| v == -1.0), "{act:?}: {:?}", &got[..8]);
            }
        }
    }

    #[test]
    fn pointwise_loss_and_optimizer() {
        for act in ACTS {
            pointwise_loss_and_optimizer_in(act);
        }
    }

    fn pointwise_loss_and_optimizer_in(act: Dtype) {
        let Some(mut be) = Both::new(act) else { return };
        // The elementwise kernels work in 16-byte packs where every span of the call starts
        // 16-byte aligned, element by element otherwise and past the last whole pack: spans
        // that start 0, 3, 4 (aligned for f32 only) and 8 elements into their buffers, beside
        // others that start at 0, with lengths that leave tails of every size.
        for (off, n) in [(0, 1003), (3, 61), (4, 37), (8, 17), (8, 1)] {
            let (a, bb) = (be.rand(off + n, 1).sub(off, n), be.rand(n, 2));
            let out = be.nan(off + n).sub(off, n);
            be.run(|x| x.gelu_forward(out, a));
            be.check("gelu_forward", out, ELEM);
            be.run(|x| x.gelu_backward(out, a, bb));
            be.check("gelu_backward", out, ELEM);
            be.run(|x| x.residual_forward(out, a, bb));
            be.check("residual_forward", out, 0.0);
            be.run(|x| x.add_inplace(out, a));
            be.check("add_inplace", out, 0.0);
            be.run(|x| x.add_inplace(bb, out));
            be.check("add_inplace", bb, 0.0);
            // One multiply rounded once on both: the same bits (1/3 is not a power of two).
            be.run(|x| x.scale_inplace(out, 1.0 / 3.0));
            be.check("scale_inplace", out, 0.0);
            let dst = be.nan(n);
            be.run(|x| x.copy(dst, a));
            be.check("copy", dst, 0.0);
            // f32 → the activation type (the master → compute-copy refresh): both round to
            // nearest even, so the results are identical.
            let src32 = be.buf(
                &random(off + n, 12)
                    .iter()
                    .map(|x| x * 3e4)
                    .collect::<Vec<_>>(),
                Dtype::F32,
            );
            let conv = be.nan(n);
            be.run(|x| x.copy(conv, src32.sub(off, n)));
            let (mut c1, mut c2) = (vec![0.0; n], vec![0.0; n]);
            be.cpu.download(conv, &mut c1);
            be.gpu.download(conv, &mut c2);
            compare(&format!("converting copy ({act:?})"), &c1, &c2, 0.0);
        }
        let dst = be.rand(1003, 13);
        be.run(|x| x.zero(dst.sub(3, 100)));
        be.check("zero", dst, 0.0);

        // Cross-entropy phases: padded rows, and a vocabulary shard that misses some targets;
        // rows of 40 are 16-byte aligned for every type (packs), rows of 42 for none.
        let rows = 5;
        for (vp, vocab_start, v_valid) in [(40, 0, 37), (40, 30, 10), (42, 0, 41)] {
            let d = CeDims {
                n: rows,
                vp,
                v_valid,
                vocab_start,
            };
            let targets: Vec<u32> = (0..rows as u32).map(|i| i * 9 % 37).collect();
            be.tokens(&targets);
            let tg = TokSpan {
                offset: 0,
                len: rows,
            };
            for dloss in [Some(0.2f32), None] {
                let logits = be.rand(rows * vp, 3);
                let [mx, sm, tl, lo] = [(); 4].map(|_| be.nan32(rows));
                be.run(|x| {
                    x.ce_row_stats(mx, sm, logits, d);
                    x.ce_target_logit(tl, logits, tg, d);
                    let rows = CeRows {
                        maxes: mx,
                        sums: sm,
                        tl,
                    };
                    x.ce_finish(lo, logits, rows, tg, dloss, d);
                });
                be.check("ce max", mx, 0.0);
                be.check("ce sumexp", sm, ELEM);
                be.check("ce target logit", tl, 0.0);
                be.check("ce losses", lo, ELEM * 10.0);
                be.check("ce dlogits", logits, ELEM * 10.0);
                if vocab_start != 0 {
                    continue;
                }
                // One shard as one op, in each CUDA form: the phases' bits, on each backend.
                for form in [CrossEntropyForm::Split, CrossEntropyForm::Fused] {
                    be.gpu.set_cross_entropy(form);
                    let one = be.rand(rows * vp, 3);
                    let [mx1, sm1, tl1, lo1] = [(); 4].map(|_| be.nan32(rows));
                    be.run(|x| {
                        let rows = CeRows {
                            maxes: mx1,
                            sums: sm1,
                            tl: tl1,
                        };
                        x.ce_whole_vocab(lo1, one, rows, tg, dloss, d);
                    });
                    let pairs = [(mx, mx1), (sm, sm1), (tl, tl1), (lo, lo1), (logits, one)];
                    for (what, (phases, whole)) in
                        ["max", "sum", "tl", "losses", "logits"].iter().zip(pairs)
                    {
                        let at = format!("ce_whole_vocab {what} ({form:?}, {dloss:?}, vp {vp})");
                        assert_eq!(
                            bits(&be.cpu, phases),
                            bits(&be.cpu, whole),
                            "{at} on the CPU"
                        );
                        assert_eq!(
                            bits(&be.gpu, phases),
                            bits(&be.gpu, whole),
                            "{at} on the GPU"
                        );
                    }
                }
                be.gpu.set_cross_entropy(CROSS_ENTROPY_DEFAULT);
            }
        }
        // A shard without real columns (maximum −∞, sum 0), and sums moved to larger maxima as
        // after the all-reduce of a vocabulary-parallel head (unchanged where equal).
        let logits = be.rand(rows * 40, 4);
        let (mx, sm) = (be.nan32(rows), be.nan32(rows));
        let empty = CeDims {
            n: rows,
            vp: 40,
            v_valid: 0,
            vocab_start: 0,
        };
        be.run(|x| x.ce_row_stats(mx, sm, logits, empty));
        be.check("ce max of no columns", mx, 0.0);
        be.check("ce sumexp of no columns", sm, 0.0);
        let inf = f32::NEG_INFINITY;
        let sums = be.buf(&[2.0, 3.0, 0.0, 5.0, 7.0], Dtype::F32);
        let local = be.buf(&[1.0, 0.5, inf, 2.0, -3.0], Dtype::F32);
        let global = be.buf(&[1.0, 1.5, 2.0, 2.0, 4.0], Dtype::F32);
        be.run(|x| x.ce_rescale_sums(sums, local, global));
        be.check("ce rescaled sums", sums, ELEM);

        // Several spans in one call: long (more than 512 blocks of 256, so each block
        // strides), short, empty.
        let big = be.rand32(140_003, 7);
        let spans = [big, big.sub(5, 300), big.sub(0, 0), big.sub(1000, 1)];
        let (s_cpu, s_gpu) = (be.cpu.sum_of_squares(&spans), be.gpu.sum_of_squares(&spans));
        for (a, b) in s_cpu.iter().zip(&s_gpu) {
            assert!(
                (a - b).abs() <= 1e-12 * a.abs(),
                "sum_of_squares {a} vs {b}"
            );
        }
        // Parts of one flat buffer, as the model passes them: decayed and not, more than
        // one ADAMW_CHUNK (4096) of elements, one element, none. More virtual blocks than
        // the emulator's grid (32 blocks), so blocks loop.
        let n = 3 * 4096 + 1003 + 700 + 1;
        let (p, g, m, v) = (
            be.rand32(n, 8),
            be.rand32(n, 9),
            be.rand32(n, 10),
            be.rand32(n, 11),
        );
        be.run(|x| x.zero(v));
        // With 16-bit activations, the parameters' compute copy of that type (NaN until the
        // update writes it).
        let copy = (act != Dtype::F32).then(|| be.nan(n));
        let ranges = [(0, 3 * 4096 + 1003, true), (3 * 4096 + 1003, 700, false)];
        let ranges = ranges
            .into_iter()
            .chain([(n - 1, 1, true), (n - 1, 0, false)]);
        let parts: Vec<AdamWPart> = ranges
            .map(|(at, len, decay)| AdamWPart {
                params: p.sub(at, len),
                grads: g.sub(at, len),
                m: m.sub(at, len),
                v: v.sub(at, len),
                compute: copy.map(|c| c.sub(at, len)),
                decay,
            })
            .collect();
        for step in 1..=3 {
            let hp = AdamWStep {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                step,
                grad_scale: 0.7,
            };
            be.run(|x| x.adamw(&parts, &hp));
        }
        be.check("adamw params", p, ELEM);
        be.check("adamw m", m, ELEM);
        be.check("adamw v", v, ELEM);
        if let Some(c) = copy {
            be.check("adamw compute copy", c, ELEM);
            // The copy is the updated parameters rounded, as `copy` rounds them.
            let fresh = be.nan(n);
            be.run(|x| x.copy(fresh, p));
            let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
            be.gpu.download(c, &mut a);
            be.gpu.download(fresh, &mut b);
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }

    fn small_cfg() -> ModelConfig {
        ModelConfig {
            arch: fugu::model::Arch::Gpt2,
            vocab_size: 300,
            n_positions: 24,
            n_embd: 32,
            n_head: 4,
            n_layer: 2,
            ..Default::default()
        }
    }

    fn batch(cfg: &ModelConfig, b: usize, t: usize, seed: u64) -> Vec<u32> {
        let mut r = SplitMix64(seed);
        (0..b * (t + 1))
            .map(|_| r.below(cfg.vocab_size as u64) as u32)
            .collect()
    }

    fn model<B: Backend>(cfg: &ModelConfig, be: B) -> Gpt2<B> {
        model_in(cfg, Dtype::F32, be)
    }

    fn model_in<B: Backend>(cfg: &ModelConfig, compute: Dtype, be: B) -> Gpt2<B> {
        let table = gpt2_params(cfg, 1).unwrap();
        let mut m = Gpt2::new(cfg, TpRank::SERIAL, compute, be).unwrap();
        m.load_params(&init_params(cfg, &table, 11)).unwrap();
        m
    }

    /// The whole model's loss and every gradient on the device against the CPU backend, the
    /// device running the LM head and loss in chunks of 20 rows (of 51 and 128: the head's
    /// weight gradient summed chunk by chunk, a different order of f32 sums, within the
    /// gradients' bound).
    #[test]
    fn whole_model_loss_and_every_gradient() {
        let Some(g) = device() else { return };
        let tiny = RunConfig::load("gpt2-tiny").unwrap().model;
        let timers = Timers::new(TimerLevel::Off);
        let mut g = Some(g);
        for (cfg, b, t) in [(small_cfg(), 3, 17), (tiny, 2, 64)] {
            let mut cpu = model(&cfg, CpuBackend::new());
            let mut gpu = model(&cfg, g.take().or_else(device).unwrap());
            gpu.set_loss_chunk(Some(20));
            let w = batch(&cfg, b, t, 5);
            let mut losses = [0.0f32; 2];
            cpu.set_batch(&w, b, t).unwrap();
            gpu.set_batch(&w, b, t).unwrap();
            cpu.zero_grad();
            gpu.zero_grad();
            losses[0] = cpu.forward(&timers, true);
            losses[1] = gpu.forward(&timers, true);
            cpu.backward(&timers);
            gpu.backward(&timers);
            assert!(
                ((losses[0] - losses[1]) / losses[0]).abs() < 1e-5,
                "loss {losses:?}"
            );
            let (gc, gg) = (cpu.download(cpu.core.grads), gpu.download(gpu.core.grads));
            for spec in cpu.core.table.specs() {
                // Gradients are sums over B·T positions of GEMM outputs.
                compare(&spec.name, &gc[spec.range()], &gg[spec.range()], 1e-4);
            }
        }
    }

    /// A Llama-family model (RMSNorm, RoPE, SwiGLU, untied head) on the device against the CPU
    /// backend, with a key/value head per query head and with grouped-query attention (two
    /// query heads per key/value head), in f32 with the GPT-2 model's bounds and in bf16 with
    /// the mixed-precision test's; and with heads of 128 (two query heads sharing one
    /// key/value head, as Llama's 7-8B models have them). f32 runs the three-step attention
    /// (its products map each query head to its key/value head and add a group's key/value
    /// gradients in turn), bf16 the flash kernels (the dK/dV kernel sums a group's query
    /// heads; heads of 128 the `_d128` kernels).
    #[test]
    fn llama_model_loss_and_every_gradient() {
        let Some(g) = device() else { return };
        let timers = Timers::new(TimerLevel::Off);
        let mha = ModelConfig {
            arch: fugu::model::Arch::Llama,
            n_kv_head: Some(4),
            intermediate_size: Some(48),
            rope_theta: Some(100.0),
            tie_embeddings: Some(false),
            ..small_cfg()
        }
        .normalized();
        let gqa = ModelConfig {
            n_kv_head: Some(2),
            ..mha.clone()
        };
        let head_128 = ModelConfig {
            n_embd: 256,
            n_head: 2,
            n_kv_head: Some(1),
            ..mha.clone()
        };
        fn build<B: Backend + 'static>(cfg: &ModelConfig, dt: Dtype, be: B) -> Box<dyn Model<B>> {
            let whole = Stage::whole(cfg.n_layer);
            let mut m = registry::build(cfg, TpRank::SERIAL, &whole, dt, be).unwrap();
            let table = registry::full_params(cfg).unwrap();
            let mut p = vec![0.0f32; table.total()];
            for spec in table.specs() {
                registry::init_tensor(cfg, &spec.name, 11, &mut p[spec.range()]);
            }
            m.load_params(&p).unwrap();
            m
        }
        let (b, t) = (3, 17);
        let w = batch(&mha, b, t, 5);
        let u = Dtype::Bf16.unit_roundoff();
        let mut g = Some(g);
        for cfg in [&mha, &gqa, &head_128] {
            for (dt, loss_tol, grad_tol) in
                [(Dtype::F32, 1e-5, 1e-4), (Dtype::Bf16, 8.0 * u, 64.0 * u)]
            {
                let kv = cfg.kv_heads();
                let mut cpu = build(cfg, dt, CpuBackend::new());
                let mut gpu = build(cfg, dt, g.take().or_else(device).unwrap());
                let forms = gpu.forms();
                let form = forms.iter().find(|f| f.key == "attention").unwrap();
                let want = if dt == Dtype::F32 {
                    "three-step"
                } else {
                    "fused"
                };
                assert_eq!(form.form, want, "kv {kv} {dt:?}");
                // The rope's backward in the fused backward's stores for heads of 128 (the
                // `_d128` kernels; these configs' others are 8 wide: the rope op after it).
                let rope = forms.iter().find(|f| f.key == "rope_backward").unwrap();
                let inside = dt == Dtype::Bf16 && cfg.head_size() == 128;
                let want = if inside { "attention" } else { "separate" };
                assert_eq!(rope.form, want, "kv {kv} {dt:?}");
                let losses = [
                    loss_grads(cpu.as_mut(), &w, (b, t), &timers),
                    loss_grads(gpu.as_mut(), &w, (b, t), &timers),
                ];
                let rel = ((losses[0] - losses[1]) / losses[0]).abs() as f64;
                assert!(rel <= loss_tol, "kv {kv} {dt:?}: loss {losses:?}");
                let gc = cpu.download(cpu.buffers().grads);
                let gg = gpu.download(gpu.buffers().grads);
                for spec in cpu.table().specs() {
                    let name = format!("{} (kv {kv}, {dt:?})", spec.name);
                    compare(&name, &gc[spec.range()], &gg[spec.range()], grad_tol);
                }
            }
        }
    }

    /// One step's loss and gradients of any model, on any backend.
    fn loss_grads<B: Backend>(
        m: &mut dyn Model<B>,
        w: &[u32],
        (b, t): (usize, usize),
        timers: &Timers,
    ) -> f32 {
        m.set_batch(w, b, t).unwrap();
        m.zero_grad();
        let loss = m.forward_micro(0, timers, true).unwrap();
        m.backward_micro(0, timers, &mut |_, _| {});
        loss
    }

    /// Mixed precision: the whole model in bf16 and f16 (with a loss scale) on the device
    /// against the CPU backend's rounded storage of the same type. Tolerances: both compute
    /// in f32 and round every stored activation, so they differ where an f32 value straddles
    /// a rounding boundary (one step of the type, 2u) and where such a difference propagates
    /// through later layers; the loss, a mean over B·T rows, within 8u, every gradient within
    /// 64u of its tensor's largest element (measured: well inside both, see the closing
    /// note of the mixed-precision issue).
    #[test]
    fn mixed_precision_model_matches_the_cpu_reference() {
        let Some(g) = device() else { return };
        let timers = Timers::new(TimerLevel::Off);
        let mut g = Some(g);
        let cfg = small_cfg();
        let (b, t) = (3, 17);
        for (dt, scale) in [(Dtype::Bf16, 1.0), (Dtype::F16, 1024.0)] {
            let u = dt.unit_roundoff();
            let mut cpu = model_in(&cfg, dt, CpuBackend::new());
            let mut dev = g.take().or_else(device).unwrap();
            // The fp16 model runs the one-pass layernorm backward (bf16: the split form), the
            // bf16 model its bias gradients in the weight-gradient GEMMs.
            if dt == Dtype::F16 {
                dev.set_layernorm_backward(LayernormBackward::Fused);
            } else {
                dev.set_bias_grad(BiasGrad::Epilogue);
            }
            let mut gpu = model_in(&cfg, dt, dev);
            // 16-bit activations take the GELU epilogues (128 MLP features: aligned rows).
            assert_eq!(gpu.mlp_gelu(), MlpGelu::Epilogue, "{dt:?}");
            // The bf16 model adds its projections to the residual stream in their GEMMs (the
            // CPU reference: its own ops).
            if dt == Dtype::Bf16 {
                gpu.set_residual(Residual::Epilogue).unwrap();
            }
            let w = batch(&cfg, b, t, 5);
            let mut losses = [0.0f32; 2];
            for (i, m) in [&mut cpu as &mut dyn Train, &mut gpu]
                .into_iter()
                .enumerate()
            {
                losses[i] = m.loss_and_grads(&w, b, t, scale, &timers);
            }
            let rel = ((losses[0] - losses[1]) / losses[0]).abs() as f64;
            assert!(rel <= 8.0 * u, "{dt:?}: loss {losses:?}");
            let (gc, gg) = (cpu.download(cpu.core.grads), gpu.download(gpu.core.grads));
            for spec in cpu.core.table.specs() {
                compare(
                    &format!("{} ({dt:?})", spec.name),
                    &gc[spec.range()],
                    &gg[spec.range()],
                    64.0 * u,
                );
            }
        }
    }

    /// One forward and backward pass, for models on either backend.
    trait Train {
        fn loss_and_grads(&mut self, w: &[u32], b: usize, t: usize, scale: f32, tm: &Timers)
            -> f32;
    }

    impl<B: Backend> Train for Gpt2<B> {
        fn loss_and_grads(
            &mut self,
            w: &[u32],
            b: usize,
            t: usize,
            scale: f32,
            tm: &Timers,
        ) -> f32 {
            self.set_batch(w, b, t).unwrap();
            self.zero_grad();
            self.set_loss_scale(scale);
            let loss = self.forward(tm, true);
            self.backward(tm);
            loss
        }
    }

    #[test]
    fn twenty_training_steps_match_the_cpu() {
        let Some(g) = device() else { return };
        let cfg = small_cfg();
        let timers = Timers::new(TimerLevel::Off);
        let mut cpu = model(&cfg, CpuBackend::new());
        let mut gpu = model(&cfg, g);
        let (b, t) = (4, 16);
        for step in 1..=20u64 {
            let w = batch(&cfg, b, t, step);
            let l = [
                train_step(&mut cpu, &w, b, t, step, &timers),
                train_step(&mut gpu, &w, b, t, step, &timers),
            ];
            assert!(
                ((l[0] - l[1]) / l[0]).abs() <= 1e-4,
                "step {step}: cpu loss {} gpu loss {}",
                l[0],
                l[1]
            );
        }
    }

    /// Fine timers on the device's clock (events on a GPU, host instants on the emulator):
    /// every op of a step is timed, nothing is read until the step is taken, and a scope's
    /// time contains its children's (their marks lie inside its own on the device's timeline).
    #[test]
    fn fine_timers_read_the_device_clock() {
        let Some(g) = device() else { return };
        let cfg = small_cfg();
        let timers = Timers::new(TimerLevel::Fine);
        let mut gpu = model(&cfg, g);
        timers.set_device_clock(
            gpu.core
                .be
                .device_clock()
                .expect("a CUDA backend has a clock"),
        );
        let (b, t) = (2, 16);
        for step in 1..=2u64 {
            let w = batch(&cfg, b, t, step);
            let _step = timers.scope("step", TimerLevel::Coarse);
            train_step(&mut gpu, &w, b, t, step, &timers);
        }
        let s = timers.take_step();
        for name in [
            "step",
            "forward",
            "forward:layernorm",
            "forward:attention:qkv",
            "backward",
        ] {
            assert!(s.get(name).is_some_and(|&ms| ms > 0.0), "{name}: {s:?}");
        }
        for (name, &ms) in &s {
            let children: f64 = s
                .iter()
                .filter(|(c, _)| c.rsplit_once(':').is_some_and(|(p, _)| p == name))
                .map(|(_, v)| v)
                .sum();
            assert!(
                ms >= children * (1.0 - 1e-6),
                "{name} {ms} ms < its children's {children}"
            );
        }
    }

    /// The work the ops declare (the breakdown's rates) on the paths only a device takes in
    /// bf16, fused attention and the GELU in the GEMMs' epilogues: their FLOPs add up to the
    /// model FLOPs with causal attention (as `tests/op_work.rs` checks on the CPU's paths), and
    /// the fc GEMM's bytes include both outputs it writes.
    #[test]
    fn declared_work_adds_up_in_mixed_precision() {
        let Some(g) = device() else { return };
        let cfg = small_cfg();
        let timers = Timers::new(TimerLevel::Fine);
        let mut gpu = model_in(&cfg, Dtype::Bf16, g);
        timers.set_device_clock(
            gpu.core
                .be
                .device_clock()
                .expect("a CUDA backend has a clock"),
        );
        let (b, t) = (2, 16);
        train_step(&mut gpu, &batch(&cfg, b, t, 1), b, t, 1, &timers);
        timers.take_step();
        let work = timers.work_totals();
        // The forms a bf16 run takes on a device by default (FUGU_* may choose others).
        let gelu_in_gemm = gpu.mlp_gelu() == MlpGelu::Epilogue;
        let stream_in_gemm = gpu.residual() == Residual::Epilogue;
        assert_eq!(work.contains_key("forward:mlp:gelu"), !gelu_in_gemm);
        let (h, l, vp) = (cfg.n_embd, cfg.n_layer, padded_vocab(cfg.vocab_size));
        let want = super::common::causal_model_flops(b, t, l, h, vp);
        let flops: f64 = work.values().map(|w| w.flops).sum();
        assert_eq!(flops, want, "{work:?}");
        // fc (n, h) -> (n, 4h) and fcproj (n, 4h) -> (n, h), bf16 with bf16 biases: the fc
        // GEMM writing GELU of its output too in the epilogue, fcproj reading the residual
        // stream in its.
        let n = b * t;
        let fc = n * h + 4 * h * h + 4 * h + (1 + gelu_in_gemm as usize) * n * 4 * h;
        let fcproj = n * 4 * h + 4 * h * h + h + (1 + stream_in_gemm as usize) * n * h;
        let (fc, fcproj) = (2 * l * fc, 2 * l * fcproj);
        assert_eq!(work["forward:mlp:mm"].bytes, (fc + fcproj) as f64);
    }

    fn train_step<B: Backend>(
        m: &mut Gpt2<B>,
        w: &[u32],
        b: usize,
        t: usize,
        step: u64,
        timers: &Timers,
    ) -> f32 {
        m.set_batch(w, b, t).unwrap();
        m.zero_grad();
        let loss = m.forward(timers, true);
        m.backward(timers);
        let norm = m.grad_norm(timers);
        m.apply_optimizer(
            &OptimStep {
                lr: 3e-3,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                grad_clip: 1.0,
                step,
            },
            norm,
            timers,
        );
        loss
    }

    #[test]
    fn greedy_decoding_matches_the_cpu() {
        let Some(g) = device() else { return };
        let cfg = small_cfg();
        let params = init_params(&cfg, &gpt2_params(&cfg, 1).unwrap(), 3);
        let o = SampleOptions {
            max_tokens: 15,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 1,
            stop: None,
        };
        let mut cpu = Generator::new(&cfg, &params, CpuBackend::new()).unwrap();
        let mut gpu = Generator::new(&cfg, &params, g).unwrap();
        let a = generate(&mut cpu, &[1, 2, 3], &o, |_| {}).unwrap();
        let b = generate(&mut gpu, &[1, 2, 3], &o, |_| {}).unwrap();
        assert_eq!(a, b);
    }

    // ---- through the binary --------------------------------------------------------------

    /// Runs the binary; `emulate` turns its `--device cuda` into the host emulator.
    fn fugu(args: &[&str], emulate: bool) -> Output {
        let mut c = Command::new(env!("CARGO_BIN_EXE_fugu"));
        c.args(args);
        if emulate {
            c.env(cuda::EMULATE_ENV, "1");
        }
        c.output().expect("running fugu")
    }

    fn ok(out: &Output) -> String {
        assert!(
            out.status.success(),
            "fugu failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fugu-cuda-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn losses(run: &Path) -> Vec<f64> {
        read_metrics(run.join("metrics.jsonl"))
            .unwrap()
            .into_iter()
            .filter_map(|r| match r {
                Record::Step(s) => Some(s.loss),
                _ => None,
            })
            .collect()
    }

    const RUN: &[&str] = &[
        "train",
        "--steps",
        "6",
        "--ckpt-every",
        "3",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--eval-every",
        "0",
        "--timers",
        "coarse",
    ];

    fn train(device: &str, out: &Path, resume: Option<&Path>, emulate: bool) -> Vec<f64> {
        let mut a: Vec<&str> = RUN.to_vec();
        a.extend(["--device", device, "--out", out.to_str().unwrap()]);
        if let Some(ck) = resume {
            std::fs::create_dir_all(out).unwrap();
            a.extend(["--resume", ck.to_str().unwrap()]);
        }
        ok(&fugu(&a, emulate));
        losses(out)
    }

    /// `fugu train --precision bf16 --steps 2` on sequences of 130 tokens (three key blocks
    /// of 64) with the kernel settings `env`, as a child process on the GPU, or with `emulate`
    /// on the emulator: its losses, after checking that the run header records the fused
    /// attention and each setting; or the child's stderr where it failed.
    fn train_with(emulate: bool, name: &str, env: &[(&str, &str)]) -> Result<Vec<f64>, String> {
        let out = tmp(&format!("train-with-{name}"));
        let mut c = Command::new(env!("CARGO_BIN_EXE_fugu"));
        c.args([
            "train",
            "--device",
            "cuda",
            "--precision",
            "bf16",
            "--steps",
            "2",
        ]);
        c.args(["--batch-size", "2", "--seq-len", "130", "--eval-every", "0"]);
        c.args(["--out", out.to_str().unwrap()]);
        // Timed attention forms kept for the process only: tests write nothing to the home
        // directory's cache.
        c.env(ATTENTION_CACHE_ENV, "off");
        c.envs(env.iter().copied());
        if emulate {
            c.env(cuda::EMULATE_ENV, "1");
        }
        let o = c.output().expect("running fugu");
        if !o.status.success() {
            return Err(String::from_utf8_lossy(&o.stderr).into_owned());
        }
        let recs = read_metrics(out.join("metrics.jsonl")).unwrap();
        let Some(Record::Header(h)) = recs.first() else {
            panic!("no header in {}", out.display())
        };
        assert_eq!(h["attention"], "fused", "{h}");
        for (k, v) in env {
            assert_eq!(h["kernels"][*k], *v, "{h}");
        }
        Ok(losses(&out))
    }

    /// `fugu train --precision bf16` with the one-kernel attention backward
    /// (`FUGU_FLASH_BACKWARD=fused`) trains as with the two kernels: the first loss the same
    /// bits (the same forward pass), the second, after a step on the gradients of each, within
    /// 1e-4 relative. The two add dQ's f32 shares in different orders; only where a sum then
    /// rounds to the other neighbouring bf16 value does a gradient differ, by one step of the
    /// type in one element, which moves the next loss by far less than this (on the emulator
    /// the losses came out identical). Runs `fugu` as a child process, on the GPU where there
    /// is one (a kernel that traps waiting for its turn fails the run, not the tests' process).
    #[test]
    fn one_kernel_attention_backward_trains_as_the_two_kernels() {
        let Some(emulate) = binary_mode() else {
            return;
        };
        let form = |f| train_with(emulate, f, &[(cuda::FLASH_BACKWARD_ENV, f)]).unwrap();
        let (split, fused) = (form("split"), form("fused"));
        assert_eq!(split.len(), 2);
        assert_eq!(
            split[0].to_bits(),
            fused[0].to_bits(),
            "{split:?} {fused:?}"
        );
        for (a, b) in split.iter().zip(&fused) {
            assert!(
                ((a - b) / a).abs() <= 1e-4,
                "split {split:?} fused {fused:?}"
            );
        }
    }

    /// `fugu train --precision bf16` with the attention's forms timed per shape
    /// (`FUGU_FLASH_SELECT=timed`, the header saying so) trains as the defaults: the first loss
    /// the same bits on the emulator (every forward form sums in the same order there), the
    /// second within 1e-4 relative (the fastest backward may be the one kernel, whose dQ sums
    /// in another order); on a GPU both within 1e-4. And with the backward pass on stored dS
    /// and every attention kernel that has a warpgroup-MMA form on it
    /// (`FUGU_FLASH_BACKWARD=stored FUGU_FLASH_MMA=wgmma`): on the emulator the same bits in
    /// both losses (the same sums in the same order); on a GPU within 1e-4 relative (a GPU's
    /// order inside either instruction is unspecified, as for the one-kernel backward above),
    /// skipped on a GPU without warpgroup MMA (the run is refused there, by name).
    #[test]
    fn timed_and_wgmma_attention_forms_train_as_the_defaults() {
        let Some(emulate) = binary_mode() else {
            return;
        };
        let split = train_with(emulate, "defaults", &[]).unwrap();
        let timed = train_with(emulate, "timed", &[(FLASH_SELECT_ENV, "timed")]).unwrap();
        assert_eq!(timed.len(), 2);
        for (i, (a, b)) in split.iter().zip(&timed).enumerate() {
            let close = if emulate && i == 0 {
                a.to_bits() == b.to_bits()
            } else {
                ((a - b) / a).abs() <= 1e-4
            };
            assert!(close, "defaults {split:?}, timed forms {timed:?}");
        }
        let env = [
            (cuda::FLASH_BACKWARD_ENV, "stored"),
            (cuda::FLASH_MMA_ENV, "wgmma"),
        ];
        let wg = match train_with(emulate, "stored-wgmma", &env) {
            Err(e) if e.contains("needs a GPU of compute capability 9.0") => {
                return skipped("no warpgroup MMA on this GPU (compute capability 9.0 only)")
            }
            r => r.unwrap(),
        };
        assert_eq!(wg.len(), 2);
        for (a, b) in split.iter().zip(&wg) {
            let close = if emulate {
                a.to_bits() == b.to_bits()
            } else {
                ((a - b) / a).abs() <= 1e-4
            };
            assert!(close, "defaults {split:?}, stored dS on wgmma {wg:?}");
        }
    }

    /// `FUGU_GEMM_SELECT=timed` keeps its choices on disk (`FUGU_GEMM_CACHE`): a second run
    /// times nothing, says where its algorithms came from, and, running the same algorithms,
    /// trains to the same bits. Needs a GPU: the emulator has one algorithm per GEMM.
    #[test]
    fn timed_gemm_choices_are_kept_on_disk_and_reused() {
        if super::common::cuda_gpu().is_err() {
            return skipped("no GPU (the emulator has one algorithm per GEMM, nothing to time)");
        }
        let cache = tmp("gemm-cache");
        let run = |name: &str| {
            let out = tmp(name);
            let mut c = Command::new(env!("CARGO_BIN_EXE_fugu"));
            c.args(RUN)
                .args(["--device", "cuda", "--precision", "bf16"]);
            c.args(["--out", out.to_str().unwrap()]);
            c.env("FUGU_GEMM_SELECT", "timed")
                .env("FUGU_GEMM_CACHE", &cache);
            let o = c.output().expect("running fugu");
            ok(&o);
            let recs = read_metrics(out.join("metrics.jsonl")).unwrap();
            let Some(Record::Header(h)) = recs.first() else {
                panic!("no header in {}", out.display())
            };
            assert_eq!(h["kernels"]["FUGU_GEMM_SELECT"], "timed", "{h}");
            (
                String::from_utf8_lossy(&o.stderr).into_owned(),
                losses(&out),
            )
        };
        let (err1, first) = run("gemm-timed-1");
        assert!(err1.contains("candidates timed"), "{err1}");
        let files = choice_files(&cache);
        assert_eq!(files.len(), 1, "{files:?}");
        let (err2, second) = run("gemm-timed-2");
        assert!(!err2.contains("candidates timed"), "{err2}");
        assert!(err2.contains("timed before for"), "{err2}");
        let bits = |l: &[f64]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&first), bits(&second), "{first:?} {second:?}");
        let _ = std::fs::remove_dir_all(&cache);
    }

    /// A kernel setting with a value it does not take (`FUGU_FLASH_WARP_ROWS` neither 16 nor
    /// 32, `FUGU_LAYERNORM_BACKWARD` neither split nor fused) is refused by name when the CUDA
    /// backend starts.
    #[test]
    fn kernel_settings_are_checked() {
        let Some(emulate) = binary_mode() else {
            return;
        };
        for (var, value, says) in [
            (
                cuda::FLASH_WARP_ROWS_ENV,
                "8",
                "FUGU_FLASH_WARP_ROWS=8: expected 16 or 32",
            ),
            (
                cuda::LAYERNORM_BACKWARD_ENV,
                "one-pass",
                "FUGU_LAYERNORM_BACKWARD=one-pass: expected split or fused",
            ),
            (
                cuda::BIAS_GRAD_ENV,
                "gemm",
                "FUGU_BIAS_GRAD=gemm: expected separate or epilogue",
            ),
            (
                cuda::FLASH_BACKWARD_ENV,
                "one",
                "FUGU_FLASH_BACKWARD=one: expected split, fused or stored",
            ),
            (
                cuda::FLASH_MMA_ENV,
                "tma",
                "FUGU_FLASH_MMA=tma: expected sync or wgmma",
            ),
            // The wgmma kernels have 16 rows per warp (a device without wgmma is refused
            // first: "needs a GPU of compute capability 9.0").
            (cuda::FLASH_WARP_ROWS_ENV, "32", "FUGU_FLASH_MMA=wgmma"),
            (
                cuda::FLASH_OVERLAP_ENV,
                "yes",
                "FUGU_FLASH_OVERLAP=yes: expected off or on",
            ),
            // The overlap is the wgmma kernels'.
            (
                cuda::FLASH_OVERLAP_ENV,
                "on",
                "FUGU_FLASH_OVERLAP=on overlaps warpgroup MMA products: it needs \
                 FUGU_FLASH_MMA=wgmma",
            ),
        ] {
            let mut c = Command::new(env!("CARGO_BIN_EXE_fugu"));
            c.args(["bench", "gemm", "--device", "cuda", "--shape", "8x16x24"]);
            c.env(var, value);
            if var == cuda::FLASH_WARP_ROWS_ENV && value == "32" {
                c.env(cuda::FLASH_MMA_ENV, "wgmma");
            }
            if emulate {
                c.env(cuda::EMULATE_ENV, "1");
            }
            let out = c.output().expect("running fugu");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{err}");
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn checkpoints_cross_devices_and_resume_exactly() {
        // The real GPU, else the binary's --device cuda on the host emulator.
        let Some(emulate) = binary_mode() else {
            return;
        };
        // Straight runs on each device.
        let (cpu_run, gpu_run) = (tmp("cpu"), tmp("gpu"));
        let lc = train("cpu", &cpu_run, None, emulate);
        let lg = train("cuda", &gpu_run, None, emulate);
        assert_eq!(lc.len(), 6);
        // The header records the kernel settings the CUDA run used (the defaults here).
        let recs = read_metrics(gpu_run.join("metrics.jsonl")).unwrap();
        let Some(Record::Header(h)) = recs.into_iter().next() else {
            panic!("no header in the CUDA run's metrics")
        };
        assert_eq!(h["kernels"][cuda::FLASH_WARP_ROWS_ENV], "16,16,16", "{h}");
        assert_eq!(h["kernels"][cuda::FLASH_QUERY_ROWS_ENV], "64", "{h}");
        assert_eq!(h["kernels"][cuda::LAYERNORM_BACKWARD_ENV], "fused", "{h}");
        assert_eq!(h["kernels"][cuda::BIAS_GRAD_ENV], "separate", "{h}");
        assert_eq!(h["kernels"][cuda::FLASH_BACKWARD_ENV], "split", "{h}");
        for (a, b) in lc.iter().zip(&lg) {
            assert!(((a - b) / a).abs() <= 1e-4, "cpu {lc:?} gpu {lg:?}");
        }
        // Exact resume on the same device: steps 4..6 from ckpt-3 equal the straight run.
        let resumed = tmp("gpu-resumed");
        let lr = train(
            "cuda",
            &resumed,
            Some(&gpu_run.join(checkpoint_dir_name(3))),
            emulate,
        );
        assert_eq!(&lr[..], &lg[3..], "CUDA resume is not exact");
        // A CUDA checkpoint resumes on the CPU and the other way round.
        for (from, device, reference) in [(&gpu_run, "cpu", &lc), (&cpu_run, "cuda", &lg)] {
            let out = tmp(&format!("cross-{device}"));
            let l = train(
                device,
                &out,
                Some(&from.join(checkpoint_dir_name(3))),
                emulate,
            );
            assert_eq!(l.len(), 3);
            for (x, y) in l.iter().zip(&reference[3..]) {
                assert!(((x - y) / y).abs() <= 1e-4, "{device}: {x} vs {y}");
            }
            let _ = std::fs::remove_dir_all(out);
        }
        // Greedy sampling from the CUDA checkpoint prints the same text on both devices.
        let ck = gpu_run.join(checkpoint_dir_name(6));
        let sample = |device: &str| {
            let a = [
                "sample",
                "--checkpoint",
                ck.to_str().unwrap(),
                "--prompt",
                "ROMEO:",
                "--max-tokens",
                "20",
                "--temperature",
                "0",
                "--device",
                device,
            ];
            ok(&fugu(&a, emulate))
        };
        assert_eq!(sample("cpu"), sample("cuda"));
        for d in [cpu_run, gpu_run, resumed] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn bench_gemm_on_the_device_checks_cublas_against_fugu_gemm() {
        let Some(emulate) = binary_mode() else {
            return;
        };
        let a = [
            "bench",
            "gemm",
            "--device",
            "cuda",
            "--shape",
            "33x17x9x3",
            "--shape",
            "64x48x40",
            "--budget",
            "0.01",
            "--format",
            "json",
        ];
        // Operands and C in f32; 16-bit operands with C of their type (the forward and
        // input-gradient GEMMs of mixed precision) and with C in f32 (the weight gradients'):
        // the bench checks each against fugu-gemm's f32 product of the same rounded operands
        // (to within two roundings of C); here the f32 case must agree to summation order.
        for (extra, dtype, out_dtype, tol) in [
            (&[][..], "f32", "f32", 1e-5),
            (
                &["--dtype", "bf16"][..],
                "bf16",
                "bf16",
                2.0 * 2f64.powi(-8),
            ),
            (
                &["--dtype", "bf16", "--out-dtype", "f32"][..],
                "bf16",
                "f32",
                1e-5,
            ),
            (&["--dtype", "f16"][..], "f16", "f16", 2.0 * 2f64.powi(-11)),
        ] {
            let args: Vec<&str> = a.iter().chain(extra).copied().collect();
            let out = ok(&fugu(&args, emulate));
            let rows: Vec<serde_json::Value> = out
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            assert_eq!(rows.len(), 2, "{out}");
            for r in &rows {
                assert_eq!(r["isa"], "cublas");
                assert_eq!(
                    (&r["dtype"], &r["out_dtype"]),
                    (&dtype.into(), &out_dtype.into())
                );
                assert!(r["gflops"].as_f64().unwrap() > 0.0, "{r}");
                assert!(r["max_rel_diff"].as_f64().unwrap() < tol, "{r}");
            }
        }
    }

    /// `fugu bench attention` times the three-step path and every fused form the device runs,
    /// each checked against the three steps first (the bench refuses a form more than 16
    /// roundings of bf16 away, `bench/attention.rs`), one row per distinct set of kernels:
    /// heads of 64 (the four mma.sync forward forms, the split, stored and one-kernel
    /// backward's at 16 and 32 rows per warp, the split and stored ones' two kernels also at
    /// 16 and 32 apart, and 128 query rows for the split dQ; with wgmma,
    /// its forward at 64 and 128 rows and its stored-dS backward), and heads of 128 (one form
    /// per instruction; their other settings launch the same kernels, so no row of their own).
    #[test]
    fn bench_attention_times_each_form_checked_against_the_three_steps() {
        let Some(emulate) = binary_mode() else {
            return;
        };
        let wgmma = emulate || super::common::cuda_gpu().is_ok_and(|b| b.has_wgmma());
        let args = [
            "bench",
            "attention",
            "--device",
            "cuda",
            "--shape",
            "1x40x2x64x1",
            "--shape",
            "1x40x2x128",
            "--budget",
            "0",
            "--rounds",
            "1",
            "--format",
            "json",
        ];
        let out = ok(&fugu(&args, emulate));
        let rows: Vec<serde_json::Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let forms = |hs: u64, pass: &str| -> Vec<(String, String)> {
            rows.iter()
                .filter(|r| r["head_size"] == hs && r["pass"] == pass)
                .map(|r| {
                    let k: Vec<&str> = r["kernels"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|k| k.as_str().unwrap())
                        .collect();
                    (r["form"].as_str().unwrap().to_string(), k.join(","))
                })
                .collect()
        };
        let f64s = forms(64, "forward");
        let b64s = forms(64, "backward");
        assert_eq!(f64s.len(), 5 + 4 * wgmma as usize, "{f64s:?}");
        assert_eq!(b64s.len(), 15 + wgmma as usize, "{b64s:?}");
        assert_eq!(f64s[0], ("three-step".into(), String::new()));
        assert_eq!(f64s[1], ("default".into(), "flash_forward".into()));
        assert_eq!(
            b64s[1],
            (
                "default".into(),
                "flash_backward_dq,flash_backward_dkv".into()
            )
        );
        let f128s = forms(128, "forward");
        let b128s = forms(128, "backward");
        assert_eq!(f128s.len(), 2 + 4 * wgmma as usize, "{f128s:?}");
        assert_eq!(b128s.len(), 3 + wgmma as usize, "{b128s:?}");
        assert_eq!(f128s[1].1, "flash_forward_d128");
        if wgmma {
            assert!(
                f64s.iter().any(|f| f.1 == "flash_forward_wgmma_q128"),
                "{f64s:?}"
            );
            assert!(
                b128s.iter().any(|f| f.1.contains("dq_stored_wgmma_d128")),
                "{b128s:?}"
            );
        }
        for set in [&f64s, &b64s, &f128s, &b128s] {
            let kernels: std::collections::BTreeSet<_> = set.iter().map(|f| &f.1).collect();
            assert_eq!(
                kernels.len(),
                set.len(),
                "a set of kernels timed twice: {set:?}"
            );
        }
        for r in &rows {
            assert_eq!(r["dtype"], "bf16");
            assert!(r["ms"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["tflops"].as_f64().unwrap() > 0.0, "{r}");
            if r["form"] == "three-step" {
                assert_eq!(r["speedup"], 1.0, "{r}");
            } else {
                assert!(
                    r["max_rel_diff"].as_f64().unwrap() < 16.0 * 2f64.powi(-8),
                    "{r}"
                );
            }
        }
        // --only keeps the forms whose settings name it (the three-step path stays).
        let mut only: Vec<&str> = args.to_vec();
        only.splice(4..6, ["--only", "QUERY_ROWS=128"]);
        let out = ok(&fugu(&only, emulate));
        let forms: Vec<String> = out
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["form"].to_string())
            .collect();
        assert!(
            forms.iter().any(|f| f.contains("QUERY_ROWS=128")),
            "{forms:?}"
        );
        assert!(
            forms
                .iter()
                .all(|f| f.contains("QUERY_ROWS=128") || f == "\"three-step\""),
            "{forms:?}"
        );
        // A shape whose key/value heads do not divide the query heads is refused by name.
        let bad = fugu(
            &[
                "bench",
                "attention",
                "--device",
                "cuda",
                "--shape",
                "1x8x3x16x2",
            ],
            emulate,
        );
        assert!(!bad.status.success());
        assert!(String::from_utf8_lossy(&bad.stderr).contains("do not divide"));
    }
}

//! The micro-kernel contract of `docs/KERNELS.md`, checked directly on every kernel this CPU can
//! run (portable, AVX2, AVX-512 on x86-64; NEON and SVE at whatever vector length on aarch64,
//! including under QEMU with `scripts/test-aarch64.sh`).
//!
//! Each kernel is called on random packed panels and compared with an f64 reference:
//! * `k` in {0, 1, 2, 3, 4, 5, 7, 8, 13, 64, 257}, `alpha` in {1, 0.5, -2}, `beta` in {0, 1, 0.5};
//! * `beta == 0` with C pre-filled with NaN: no NaN may leak (C must not be read);
//! * `ldc == mr` and `ldc == mr + 3`; every float around and between the tile's columns holds a
//!   sentinel that must survive bit-for-bit (nothing written outside the tile);
//! * native 16-bit kernels (bf16 pairs: `k` counts pairs) get bf16 operands, and the same bound:
//!   a product of two bf16 values is exact in f32;
//! * Ã and B̃ placed so that they end exactly at a `PROT_NONE` guard page (any read past
//!   `k*mr` / `k*nr` floats faults), and placed at addresses that are only 4-byte aligned.

use fugu_gemm::kernel::Accumulation;
use fugu_gemm::kernel::{kernel_for, kernel_for_precision};
use fugu_gemm::precision::{bf16_to_f32, f32_to_bf16, f32_to_f16};
use fugu_gemm::{Isa, Kernel, Operand, Precision};

const KS: [usize; 11] = [0, 1, 2, 3, 4, 5, 7, 8, 13, 64, 257];
const ALPHAS: [f32; 3] = [1.0, 0.5, -2.0];
const BETAS: [f32; 3] = [0.0, 1.0, 0.5];
/// Floats of C before the tile and after its last column, all holding the sentinel.
const C_PRE: usize = 5;
const C_POST: usize = 7;
/// Marks every float of the C buffer outside the tile; compared bit-for-bit.
const SENTINEL_BITS: u32 = 0xC4F2_1A5B; // about -1936.8, not a value any kernel would compute

/// A tiny 64-bit LCG (Knuth's MMIX constants); the tests need no other randomness.
struct Lcg(u64);

impl Lcg {
    fn new(seed: u64) -> Self {
        Lcg(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next_u32(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 32) as u32
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next_u32() >> 8) as f32 / (1u32 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform()).collect()
    }
}

/// How the packed panels are placed in memory.
#[derive(Clone, Copy, Debug)]
enum Placement {
    /// Each panel ends exactly where a `PROT_NONE` page begins.
    GuardPage,
    /// Each panel starts 4 bytes past a 64-byte boundary.
    Misaligned,
}

/// Anonymous memory whose last page is `PROT_NONE`; holds one panel that ends at that page.
#[cfg(unix)]
struct Guarded {
    base: *mut libc::c_void,
    total: usize,
    data: *mut f32,
}

#[cfg(unix)]
impl Guarded {
    fn new(values: &[f32]) -> Guarded {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let bytes = std::mem::size_of_val(values);
        let data_pages = bytes.div_ceil(page).max(1);
        let total = (data_pages + 1) * page;
        // SAFETY: a fresh private anonymous mapping; the result is checked below.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED, "mmap of {total} bytes failed");
        // SAFETY: `base + data_pages*page` is the last page of the mapping just created.
        let rc = unsafe {
            libc::mprotect(
                base.cast::<u8>().add(data_pages * page).cast(),
                page,
                libc::PROT_NONE,
            )
        };
        assert_eq!(rc, 0, "mprotect of the guard page failed");
        // SAFETY: `data .. data + values.len()` lies in the readable, writable pages, ending at
        // the guard page; page sizes are multiples of 4 so `data` is f32-aligned.
        let data = unsafe {
            let data = base
                .cast::<u8>()
                .add(data_pages * page - bytes)
                .cast::<f32>();
            std::ptr::copy_nonoverlapping(values.as_ptr(), data, values.len());
            data
        };
        Guarded { base, total, data }
    }
}

#[cfg(unix)]
impl Drop for Guarded {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`; no pointer into it outlives `self`.
        unsafe {
            libc::munmap(self.base, self.total);
        }
    }
}

/// A panel in memory, placed as asked.
enum Panel {
    #[cfg(unix)]
    Guarded(Guarded),
    Vec {
        buf: Vec<f32>,
        start: usize,
    },
}

impl Panel {
    fn new(values: &[f32], placement: Placement) -> Panel {
        match placement {
            #[cfg(unix)]
            Placement::GuardPage => Panel::Guarded(Guarded::new(values)),
            #[cfg(not(unix))]
            Placement::GuardPage => Panel::new(values, Placement::Misaligned),
            Placement::Misaligned => {
                let mut buf = vec![0.0f32; values.len() + 32];
                let skip = buf.as_ptr().align_offset(64);
                let start = if skip < 16 { skip + 1 } else { 1 };
                buf[start..start + values.len()].copy_from_slice(values);
                Panel::Vec { buf, start }
            }
        }
    }

    fn ptr(&self) -> *const f32 {
        match self {
            #[cfg(unix)]
            Panel::Guarded(g) => g.data,
            Panel::Vec { buf, start } => buf[*start..].as_ptr(),
        }
    }
}

struct Case {
    k: usize,
    alpha: f32,
    beta: f32,
    ldc: usize,
    placement: Placement,
}

/// Runs one kernel call and checks every float of C, returning a description of the first
/// violation.
fn check_case(kern: &Kernel, case: &Case, rng: &mut Lcg) -> Result<(), String> {
    let (mr, nr) = (kern.mr, kern.nr);
    let Case {
        k,
        alpha,
        beta,
        ldc,
        placement,
    } = *case;
    // `a`/`b`: the elements, `k·per` deep, in the f32 layout (p*mr + r); `pa`/`pb`: the packed
    // words the kernel reads.
    let per = kern.operand.k_per_word();
    let (a, b) = (rng.vec(k * per * mr), rng.vec(k * per * nr));
    let (a, b, wa, wb) = match kern.operand {
        // The f16 emulation reads f32 words holding f16 values.
        Operand::F32 if kern.accumulation != Accumulation::F32 => {
            let round = |v: Vec<f32>| v.into_iter().map(|x| Precision::F16.round(x)).collect();
            let (a, b): (Vec<f32>, Vec<f32>) = (round(a), round(b));
            (a.clone(), b.clone(), a, b)
        }
        Operand::F32 => (a.clone(), b.clone(), a, b),
        Operand::Bf16Pairs => {
            let (a, b) = (
                a.iter()
                    .map(|&x| Precision::Bf16.round(x))
                    .collect::<Vec<_>>(),
                b.iter()
                    .map(|&x| Precision::Bf16.round(x))
                    .collect::<Vec<_>>(),
            );
            let (wa, wb) = (bf16_pairs(&a, mr), bf16_pairs(&b, nr));
            (a, b, wa, wb)
        }
        Operand::F16 => {
            let (a, b) = (
                a.iter()
                    .map(|&x| Precision::F16.round(x))
                    .collect::<Vec<_>>(),
                b.iter()
                    .map(|&x| Precision::F16.round(x))
                    .collect::<Vec<_>>(),
            );
            // Ã dense (two elements per word, in order), B̃ one element per word in both halves.
            let wa = a
                .chunks_exact(2)
                .map(|p| {
                    f32::from_bits(u32::from(f32_to_f16(p[0])) | u32::from(f32_to_f16(p[1])) << 16)
                })
                .collect();
            let wb = b
                .iter()
                .map(|&x| f32::from_bits(u32::from(f32_to_f16(x)) * 0x1_0001))
                .collect();
            (a, b, wa, wb)
        }
    };
    let pa = Panel::new(&wa, placement);
    let pb = Panel::new(&wb, placement);

    let sentinel = f32::from_bits(SENTINEL_BITS);
    let clen = C_PRE + ldc * nr + C_POST;
    let mut c = vec![sentinel; clen];
    let in_tile = |idx: usize| -> Option<(usize, usize)> {
        let t = idx.checked_sub(C_PRE)?;
        let (r, j) = (t % ldc, t / ldc);
        (r < mr && j < nr).then_some((r, j))
    };
    let mut c0 = vec![0.0f32; mr * nr];
    for j in 0..nr {
        for r in 0..mr {
            let v = if beta == 0.0 { f32::NAN } else { rng.uniform() };
            c0[r + j * mr] = v;
            c[C_PRE + r + j * ldc] = v;
        }
    }

    // SAFETY: the contract of docs/KERNELS.md holds: `pa` holds k*mr floats, `pb` k*nr floats,
    // and `c[C_PRE..]` holds the mr×nr tile with column stride ldc >= mr.
    unsafe {
        (kern.func)(
            k,
            alpha,
            pa.ptr(),
            pb.ptr(),
            beta,
            c.as_mut_ptr().add(C_PRE),
            ldc,
        );
    }

    for (idx, &got) in c.iter().enumerate() {
        match in_tile(idx) {
            None => {
                if got.to_bits() != SENTINEL_BITS {
                    return Err(format!(
                        "wrote outside the tile: float {idx} of C (tile starts at {C_PRE}) is {got}, \
                         expected the sentinel"
                    ));
                }
            }
            Some((r, j)) => {
                let mut dot = 0.0f64;
                let mut mag = 0.0f64;
                for p in 0..k * per {
                    let prod = f64::from(a[p * mr + r]) * f64::from(b[p * nr + j]);
                    dot += prod;
                    mag += prod.abs();
                }
                let old = f64::from(c0[r + j * mr]);
                let (want, scale) = if beta == 0.0 {
                    (f64::from(alpha) * dot, f64::from(alpha).abs() * mag)
                } else {
                    let bc = f64::from(beta) * old;
                    (
                        f64::from(alpha) * dot + bc,
                        f64::from(alpha).abs() * mag + bc.abs(),
                    )
                };
                // Any summation order in f32: |error| <= (k + 2)·u·scale, u = eps/2; allow 2x.
                // Sums in f16 chunks of c add at most c·2^-11 of a chunk's magnitude (and f16's
                // subnormal step, 2^-25 per addition).
                let mut tol = (k as f64 + 4.0) * f64::from(f32::EPSILON) * scale;
                if let Accumulation::F16Chunks(c) = kern.accumulation {
                    tol += (c.min(k) as f64 * scale + k as f64 * f64::from(alpha).abs())
                        * f64::powi(2.0, -11);
                }
                let err = (f64::from(got) - want).abs();
                if !got.is_finite() || err > tol {
                    return Err(format!(
                        "C({r}, {j}) = {got}, expected {want} (error {err:e} > tolerance {tol:e})"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Packs `k × w` elements (p*w + r) as bf16-pair words: word (q, r) holds element (2q, r) in its
/// low half and (2q + 1, r) in its high half.
fn bf16_pairs(x: &[f32], w: usize) -> Vec<f32> {
    let k = x.len() / w;
    (0..k / 2 * w)
        .map(|i| {
            let (q, r) = (i / w, i % w);
            let lo = f32_to_bf16(x[2 * q * w + r]);
            let hi = f32_to_bf16(x[(2 * q + 1) * w + r]);
            assert_eq!(
                bf16_to_f32(lo),
                x[2 * q * w + r],
                "operands are bf16 values"
            );
            f32::from_bits(u32::from(lo) | u32::from(hi) << 16)
        })
        .collect()
}

/// Every case of the grid for one kernel; panics naming the kernel and the case that failed.
fn check_kernel(kern: &Kernel, seed: u64) -> usize {
    let mut rng = Lcg::new(seed);
    let mut cases = 0;
    for &k in &KS {
        for &alpha in &ALPHAS {
            for &beta in &BETAS {
                for ldc in [kern.mr, kern.mr + 3] {
                    for placement in [Placement::GuardPage, Placement::Misaligned] {
                        let case = Case {
                            k,
                            alpha,
                            beta,
                            ldc,
                            placement,
                        };
                        if let Err(e) = check_case(kern, &case, &mut rng) {
                            panic!(
                                "{kern:?}: k={k} alpha={alpha} beta={beta} ldc={ldc} \
                                 placement={placement:?}: {e}"
                            );
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    cases
}

/// The kernels this CPU can run, the f32 one of each ISA and its native 16-bit ones, and the
/// portable emulation of f16 chunks; prints the skipped ones.
fn runnable_kernels() -> Vec<(Isa, Kernel)> {
    let mut out = vec![(
        Isa::Portable,
        fugu_gemm::arch::portable::f16_chunked_kernel(),
    )];
    for isa in Isa::ALL {
        match kernel_for(isa) {
            Some(kern) => out.push((isa, kern)),
            None => eprintln!("skipped: {isa} not supported on this CPU"),
        }
        for prec in [Precision::Bf16, Precision::F16] {
            match kernel_for_precision(isa, prec) {
                Some(kern) if kern.operand != Operand::F32 => out.push((isa, kern)),
                _ => eprintln!("skipped: no native {prec} kernel for {isa} on this CPU"),
            }
        }
    }
    out
}

#[test]
fn every_kernel_meets_the_contract() {
    let kernels = runnable_kernels();
    assert!(
        kernels.iter().any(|(isa, _)| *isa == Isa::Portable),
        "the portable kernel must always be available"
    );
    for (isa, kern) in &kernels {
        let cases = check_kernel(kern, 0x5EED ^ *isa as u64);
        eprintln!("{kern:?} passed {cases} cases");
        assert_eq!(cases, KS.len() * ALPHAS.len() * BETAS.len() * 2 * 2);
    }
}

#[test]
fn kernel_shapes_are_consistent() {
    for (isa, kern) in runnable_kernels() {
        assert_eq!(kern.isa, isa, "kernel_for({isa}) returned {kern:?}");
        assert!(kern.mr > 0 && kern.nr > 0, "{kern:?}: empty tile");
        let lanes = isa.f32_lanes();
        assert_eq!(
            kern.mr % lanes,
            0,
            "{kern:?}: mr is not a whole number of {lanes}-lane vectors"
        );
        if isa == Isa::Sve {
            // Vector-length agnostic: two vectors of whatever length the CPU has.
            // Two vectors of its element: f32 lanes, or twice as many f16 lanes.
            let per_vector = if kern.operand == Operand::F16 {
                2 * lanes
            } else {
                lanes
            };
            assert_eq!(kern.mr, 2 * per_vector, "{kern:?}: SVE mr must be 2·VL");
            assert!(lanes.is_power_of_two() && (4..=64).contains(&lanes));
        }
    }
}

/// Prints the kernels and, for SVE, the vector length in use (`scripts/test-aarch64.sh` shows it).
#[test]
fn report_kernels() {
    for (isa, kern) in runnable_kernels() {
        if isa == Isa::Sve {
            eprintln!(
                "kernel {isa}: {}x{} (SVE vector length {} bits)",
                kern.mr,
                kern.nr,
                isa.f32_lanes() * 32
            );
        } else {
            eprintln!("kernel {isa}: {}x{}", kern.mr, kern.nr);
        }
    }
}

/// Kernels keep no state: two threads calling the same kernel at once get correct results.
#[test]
fn kernels_are_callable_from_several_threads() {
    for (isa, kern) in runnable_kernels() {
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..2u64)
                .map(|t| {
                    s.spawn(move || {
                        let mut rng = Lcg::new(t + 100);
                        for k in [64, 257] {
                            let case = Case {
                                k,
                                alpha: 0.5,
                                beta: 1.0,
                                ldc: kern.mr + 3,
                                placement: Placement::Misaligned,
                            };
                            check_case(&kern, &case, &mut rng)
                                .unwrap_or_else(|e| panic!("{isa} in thread {t}: {e}"));
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().expect("kernel thread panicked");
            }
        });
    }
}

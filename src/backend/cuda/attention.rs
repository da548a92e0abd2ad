//! Attention on the CUDA backend: the three-step path's batched GEMMs over every (sequence,
//! head) pair ([`Attn`]; the causal row blocks are `ops/attention.rs`'s), and the fused (flash) kernels' launch geometry and
//! arguments.

use super::engine::Arg;
use super::forms::QueryKernels;
use super::gemm::{Mat, Ptrs};
use super::{
    AttnDims, Backend, CudaBackend, Dtype, FlashBackward, FlashForm, FlashMma, FlashOverlap,
    FlashQueryRows, FlashSelect, FlashWarpRows, FusedAttention, Rope, Span, ELEM_THREADS, K, WARP,
};
use crate::ops::attention::Heads;
pub(super) use crate::ops::attention::{causal_block_rows, causal_blocks};

/// Threads per block of the fused attention kernels (`FA_THREADS`); a block owns
/// `FLASH_ROWS` query rows or keys (`FA_ROWS`).
pub(super) const FLASH_THREADS: u32 = 128;
/// Row stride of the head-64 kernels' shared-memory tiles, in elements (`FA_LDS(64)`).
pub(super) const FLASH_LDS: u32 = 72;
/// Dynamic shared memory of the wide backward attention kernels (`FA_REREAD`): two tiles (Q
/// and dO, or K and V) of `FLASH_ROWS` rows of 16-bit elements.
pub(super) const FLASH_KV_SHMEM: u32 = 2 * FLASH_ROWS as u32 * FLASH_LDS * 2;
/// Dynamic shared memory of the one-kernel attention backward: K, V and dS.
pub(super) const FLASH_FUSED_SHMEM: u32 = 3 * FLASH_ROWS as u32 * FLASH_LDS * 2;
/// The most memory the tiles of dS take at once in the backward pass with stored dS
/// ([`super::FlashBackward::Stored`]): the sequences go through in chunks that fit (at least one
/// sequence per chunk, whatever its size: heads × T² bytes in 16 bits, 12 MiB for GPT-2 124M
/// at T = 1024, 2 GiB for 32 heads at T = 8192).
pub(super) const FLASH_DS_BUDGET: usize = 512 << 20;
/// The widest head of the fused kernels in each of their forms (`D = 64` in `kernels.cu`): wider
/// heads, up to [`FLASH_MAX_HEAD`], run the `_d128` kernels ([`D128_FORM`]).
pub(super) const FLASH_HEAD_64: usize = 64;
/// The widest head of the fused attention on a GPU (the `_d128` kernels, `D = 128`).
pub(super) const FLASH_MAX_HEAD: usize = 128;
pub(super) const FLASH_ROWS: usize = 64;
/// The forms of the kernels for heads of 65 to 128 (`flash_forward_d128`, the split backward's
/// `flash_backward_dq_d128` and `flash_backward_dkv_d128`, the stored-dS backward's
/// `flash_backward_dkv_store_d128` and `flash_backward_dq_stored_d128`, and on warpgroup MMA
/// the forward's and the stored-dS backward's `_wgmma_d128`): 64 query rows or keys per block
/// (the wgmma forward 128 too, `flash_forward_wgmma_d128_q128`), 16 per warp; the other
/// `FUGU_FLASH_*` forms are the head-64 kernels'.
pub(super) const D128_FORM: &str = "64 query rows per block (128 in the wgmma forward), 16 per \
     warp, the split or stored backward";

/// The most tiles a `_d128` kernel keeps in dynamic shared memory (the backward's six: 102 KB,
/// more than sm_86 and sm_89 GPUs give a block, where heads over 64 take the three-step path).
pub(super) const D128_MOST_TILES: u32 = 6;

/// Whether the backward kernels rotate dQ and dK back in their stores for heads of `hs`
/// (`FaRope` in `kernels.cu`: heads exactly as wide as their tiles, where each lane holds both
/// columns of a rotated pair): 64, and 128 for the `_d128` kernels. Other heads take the rope
/// kernel after the backward, as before.
pub(super) fn rope_in_stores(hs: usize) -> bool {
    hs == FLASH_HEAD_64 || hs == FLASH_MAX_HEAD
}

/// One fused attention backward call as [`Backend::attention_backward`] gets it, with the
/// form to run, its storage type, Δ's scratch and the kernels' trailing rope arguments
/// ([`CudaBackend::rope_args`]); the gradient's device address (a timed call's is scratch).
#[derive(Clone, Copy)]
pub(super) struct FlashBackwardCall {
    pub form: FlashForm,
    pub dt: Dtype,
    pub delta: u64,
    pub dqkv: u64,
    pub dout: Span,
    pub out: Span,
    pub lse: Span,
    pub qkv: Span,
    pub d: AttnDims,
    pub rope: [Arg; 2],
}

/// Dynamic shared memory of `tiles` tiles of the `_d128` kernels (`fa_tiles`: 64 rows of 128 +
/// 8 elements of 16 bits, 17 KB each): the forward's four (K and V, double-buffered), the
/// backward's six (its own Q and dO, or K and V, too); and [`FLASH_TILE_ALIGN`] bytes to start
/// them on a 1024-byte boundary (`fa_dynamic`).
pub(super) fn d128_shmem(tiles: u32) -> u32 {
    tiles * FLASH_ROWS as u32 * (FLASH_MAX_HEAD as u32 + 8) * 2 + FLASH_TILE_ALIGN
}

/// The alignment of the tiles the tensor cores read themselves (the 128-byte swizzle's
/// pattern repeats every 1024 bytes of shared memory): the `_d128` kernels' dynamic shared
/// memory, which starts after their static, leaves up to this much unused before its first.
pub(super) const FLASH_TILE_ALIGN: u32 = 1024;

impl CudaBackend {
    /// The common storage type of the fused attention's tensors, checked.
    pub(super) fn fused_dtype(&self, d: AttnDims, spans: &[Span], what: &str) -> Dtype {
        let dt = self.dt(spans[0]);
        assert!(
            d.kv > 0 && d.nh.is_multiple_of(d.kv),
            "{what}: {} query heads in groups over {} key/value heads",
            d.nh,
            d.kv
        );
        assert!(
            spans.iter().all(|&s| self.dt(s) == dt)
                && self.fused_attention(d.hs, dt) != FusedAttention::Unsupported,
            "{what}: no fused attention for head size {} in {}",
            d.hs,
            dt.name()
        );
        dt
    }

    /// The forward kernel of form `f` for heads of `d.hs`: warps of 16 or 32 query rows, in
    /// blocks of 64 or 128 rows (wgmma: 16 and 64); heads over 64, the `_d128` kernel
    /// ([`D128_FORM`]).
    pub(super) fn forward_kernel(&mut self, f: FlashForm, d: AttnDims) -> FlashLaunch {
        let overlap = f.overlap == FlashOverlap::On;
        if self.head_128(f, d) {
            return match (f.mma, f.query_rows.0) {
                (FlashMma::Sync, _) => FlashLaunch::d128(K::flash_forward_d128, 4),
                (FlashMma::Wgmma, 128) => FlashLaunch {
                    // Two warpgroups of 64 rows on the same K and V tiles.
                    threads: 2 * FLASH_THREADS,
                    rows: 2 * FLASH_ROWS,
                    ..FlashLaunch::d128(
                        [
                            K::flash_forward_wgmma_d128_q128,
                            K::flash_forward_wgmma_overlap_d128_q128,
                        ][overlap as usize],
                        4,
                    )
                },
                (FlashMma::Wgmma, _) => FlashLaunch::d128(
                    [
                        K::flash_forward_wgmma_d128,
                        K::flash_forward_wgmma_overlap_d128,
                    ][overlap as usize],
                    4,
                ),
            };
        }
        let q = f.query_rows;
        let (kernel, threads) = if f.mma == FlashMma::Wgmma {
            // One warpgroup per 64 rows (16 per warp: FlashMma::refusal).
            let wide = q.0 > FLASH_ROWS;
            let k = [
                [K::flash_forward_wgmma, K::flash_forward_wgmma_q128],
                [
                    K::flash_forward_wgmma_overlap,
                    K::flash_forward_wgmma_overlap_q128,
                ],
            ][overlap as usize][wide as usize];
            (k, q.0 as u32 / 16 * WARP)
        } else {
            q.pick(
                f.warp_rows.forward,
                QueryKernels {
                    narrow: K::flash_forward,
                    wide: K::flash_forward_wide,
                    narrow_q128: K::flash_forward_q128,
                    wide_q128: K::flash_forward_wide_q128,
                },
            )
        };
        FlashLaunch {
            kernel,
            threads,
            rows: q.0,
            shmem: 0,
        }
    }

    /// The backward pass of form `f` ([`FlashBackward`]) for heads of `d.hs`: as the form
    /// says, but for heads over 64 split where it says one kernel ([`D128_FORM`]).
    pub(super) fn backward_form(&mut self, f: FlashForm, d: AttnDims) -> FlashBackward {
        self.head_128(f, d);
        backward_of(f, d)
    }

    /// The scratch (beyond Δ) the backward pass of form `f` takes for `d` in `dt`, in bytes:
    /// the one-kernel form's dQ accumulators and counters, the stored-dS form's tiles of dS
    /// for one chunk of sequences, none for the split form.
    pub(super) fn backward_scratch_bytes(&self, f: FlashForm, d: AttnDims, dt: Dtype) -> usize {
        match backward_of(f, d) {
            FlashBackward::Split => 0,
            FlashBackward::Fused => {
                let (tiles, acc_bytes) = one_kernel_scratch(d);
                acc_bytes + 4 * (1 + tiles)
            }
            FlashBackward::Stored => {
                let (chunk, per_seq) = self.stored_ds_chunk(d, dt);
                chunk * per_seq
            }
        }
    }

    /// The stored-dS backward's sequences per chunk, and the bytes of one sequence's dS tiles
    /// (every causal tile pair of every head), for `d` in `dt`.
    fn stored_ds_chunk(&self, d: AttnDims, dt: Dtype) -> (usize, usize) {
        let nkb = d.t.div_ceil(FLASH_ROWS);
        let per_seq = d.nh * nkb * (nkb + 1) / 2 * FLASH_ROWS * FLASH_ROWS * dt.bytes();
        ((self.flash_ds_budget / per_seq).clamp(1, d.b), per_seq)
    }

    /// The split backward's dQ and dK/dV kernels of form `f` for heads of `d.hs`; heads over
    /// 64, the `_d128` kernels (both reread their own tiles' fragments from dynamic shared
    /// memory: six tiles).
    pub(super) fn split_kernels(
        &mut self,
        f: FlashForm,
        d: AttnDims,
    ) -> (FlashLaunch, FlashLaunch) {
        if self.head_128(f, d) {
            return (
                FlashLaunch::d128(K::flash_backward_dq_d128, D128_MOST_TILES),
                FlashLaunch::d128(K::flash_backward_dkv_d128, D128_MOST_TILES),
            );
        }
        let (q, rows) = (f.query_rows, f.warp_rows);
        let (kernel, threads) = q.pick(
            rows.dq,
            QueryKernels {
                narrow: K::flash_backward_dq,
                wide: K::flash_backward_dq_wide,
                narrow_q128: K::flash_backward_dq_q128,
                wide_q128: K::flash_backward_dq_wide_q128,
            },
        );
        let dq = FlashLaunch {
            kernel,
            threads,
            rows: q.0,
            shmem: q.dq_shmem(rows.dq),
        };
        let (kernel, threads) =
            FlashWarpRows::pick(rows.dkv, K::flash_backward_dkv, K::flash_backward_dkv_wide);
        let dkv = FlashLaunch {
            kernel,
            threads,
            rows: FLASH_ROWS,
            shmem: dkv_shmem(rows.dkv),
        };
        (dq, dkv)
    }

    /// Whether heads of `d.hs` take the `_d128` kernels (over 64 columns); the first time they
    /// do where form `f`, set by the settings (not timed), is one they do not have, a note on
    /// stderr says that the form settings choose among the head-64 kernels only.
    fn head_128(&mut self, f: FlashForm, d: AttnDims) -> bool {
        let wide = d.hs > FLASH_HEAD_64;
        // 128 query rows: the wgmma forward has them, and the stored-dS backward's dQ kernel
        // has 64 at every head size; the split backward's head-128 dQ kernel has 64 only.
        let rows_128 = f.mma == FlashMma::Wgmma && f.backward == FlashBackward::Stored;
        let d128_has = f.warp_rows == FlashWarpRows::default()
            && (f.query_rows == FlashQueryRows::default() || rows_128)
            && f.backward != FlashBackward::Fused;
        let set = self.flash_select == FlashSelect::Settings;
        if wide && !d128_has && set && !self.head_128_noted {
            eprintln!(
                "note: attention heads of {} run the head-128 kernels ({D128_FORM}); the other \
                 FUGU_FLASH_* forms are those of the kernels for heads of at most 64",
                d.hs
            );
            self.head_128_noted = true;
        }
        wide
    }

    /// The backward kernels' trailing arguments for `rope` (the rotary embedding to undo in
    /// the dQ and dK stores, [`rope_in_stores`]): its table's address and positions, or none;
    /// and the rope left for [`Self::rope`] to undo after the kernels (heads of other widths).
    pub(super) fn rope_args<'r>(
        &self,
        rope: Option<&'r Rope>,
        dqkv: Span,
        d: AttnDims,
    ) -> ([Arg; 2], Option<&'r Rope>) {
        let none = [Arg::Ptr(0), Arg::I64(0)];
        let Some(r) = rope else {
            return (none, None);
        };
        r.check(dqkv, "attention_backward's rope");
        assert!(
            2 * r.half == d.hs
                && r.heads == d.nh + d.kv
                && r.width == d.shape().qkv_width()
                && (r.n, r.t) == (d.b * d.t, d.t),
            "attention_backward: {r:?} is not the rope of q and k in {d:?}"
        );
        assert_eq!(self.dt(r.table), Dtype::F32, "rope: the table is f32");
        if rope_in_stores(d.hs) {
            let table = [Arg::Ptr(self.ptr(r.table)), Arg::I64(r.positions() as i64)];
            (table, None)
        } else {
            (none, Some(r))
        }
    }

    /// The forward kernel of form `f` writing the output and the log-sum-exp rows at `outs`
    /// (device addresses; a timed call's are scratch).
    pub(super) fn flash_forward(
        &mut self,
        f: FlashForm,
        (out, lse): (u64, u64),
        qkv: Span,
        d: AttnDims,
        dt: Dtype,
    ) {
        let mut args = vec![Arg::Ptr(out), Arg::Ptr(lse)];
        args.extend(self.flash_args(qkv, d));
        let k = self.forward_kernel(f, d);
        let grid = Self::flash_grid(d, k.rows);
        self.launch(k.kernel, dt, grid, k.threads, k.shmem, &args);
    }

    /// The kernels of the backward pass of `c`'s form (not the rope kernel after them, where
    /// the stores do not undo it).
    pub(super) fn flash_backward(&mut self, c: &FlashBackwardCall) {
        match self.backward_form(c.form, c.d) {
            FlashBackward::Split => self.attention_backward_split(c),
            FlashBackward::Fused => self.attention_backward_one_kernel(c),
            FlashBackward::Stored => self.attention_backward_stored_ds(c),
        }
    }

    /// The fused attention's backward pass as two kernels ([`FlashBackward::Split`], the
    /// default): dQ (and Δ) per query block, then dK and dV per key block.
    pub(super) fn attention_backward_split(&mut self, c: &FlashBackwardCall) {
        let d = c.d;
        let (kq, kkv) = self.split_kernels(c.form, d);
        let (grid, tail) = (Self::flash_grid(d, kq.rows), self.flash_args(c.qkv, d));
        let (dq, dy, l) = (c.dqkv, self.ptr(c.dout), self.ptr(c.lse));
        let mut args = vec![
            Arg::Ptr(dq),
            Arg::Ptr(c.delta),
            Arg::Ptr(dy),
            Arg::Ptr(self.ptr(c.out)),
            Arg::Ptr(l),
        ];
        args.extend(tail.iter().chain(&c.rope).copied());
        self.launch(kq.kernel, c.dt, grid, kq.threads, kq.shmem, &args);
        let mut args = vec![Arg::Ptr(dq), Arg::Ptr(c.delta), Arg::Ptr(dy), Arg::Ptr(l)];
        args.extend(tail);
        args.push(Arg::Ptr(0)); // no dS stored
        args.extend(c.rope);
        let grid_kv = Self::flash_grid_kv(d);
        self.launch(kkv.kernel, c.dt, grid_kv, kkv.threads, kkv.shmem, &args);
    }

    /// The fused attention's backward pass as one kernel ([`FlashBackward::Fused`]): Δ and
    /// the kernel's counters zeroed by `flash_backward_prep`, then `flash_backward_fused` with
    /// an f32 accumulator tile per query block (64 × 64: 16 KB, 50 MB for GPT-2 124M B=16).
    pub(super) fn attention_backward_one_kernel(&mut self, c: &FlashBackwardCall) {
        let d = c.d;
        let (tiles, acc_bytes) = one_kernel_scratch(d);
        // The kernel's item counter and turns are ints.
        assert!(
            tiles < i32::MAX as usize,
            "attention_backward: {tiles} tiles"
        );
        let acc = self.scratch(|s| &mut s.attn_dq, acc_bytes + 4 * (1 + tiles));
        let sync = acc + acc_bytes as u64;
        self.flash_delta(c, (sync, 1 + tiles));
        let mut args = vec![
            Arg::Ptr(c.dqkv),
            Arg::Ptr(c.delta),
            Arg::Ptr(self.ptr(c.dout)),
            Arg::Ptr(self.ptr(c.lse)),
        ];
        args.extend(self.flash_args(c.qkv, d));
        args.extend([Arg::Ptr(acc), Arg::Ptr(sync)]);
        args.extend(c.rope);
        let (k, threads) = FlashWarpRows::pick(
            c.form.warp_rows.dkv,
            K::flash_backward_fused,
            K::flash_backward_fused_wide,
        );
        let blocks = Self::flash_grid_kv(d);
        self.launch(k, c.dt, blocks, threads, FLASH_FUSED_SHMEM, &args);
    }

    /// Δ = rowsum(dout ∘ out) of call `c` into its `delta` (`flash_backward_prep`), which
    /// also zeroes `n` counters at `sync` (the one-kernel backward's; none for the others).
    fn flash_delta(&mut self, c: &FlashBackwardCall, (sync, n): (u64, usize)) {
        let d = c.d;
        let args = [
            Arg::Ptr(c.delta),
            Arg::Ptr(sync),
            Arg::I64(n as i64),
            Arg::Ptr(self.ptr(c.dout)),
            Arg::Ptr(self.ptr(c.out)),
            Arg::I64(d.b as i64),
            Arg::I64(d.t as i64),
            Arg::I64(d.nh as i64),
            Arg::I64(d.hs as i64),
        ];
        // A lane per 8 columns of a row's tile: 8 lanes, or 16 for heads over 64.
        let (k, lanes) = if d.hs > FLASH_HEAD_64 {
            (K::flash_backward_prep_d128, FLASH_MAX_HEAD / 8)
        } else {
            (K::flash_backward_prep, FLASH_HEAD_64 / 8)
        };
        let grid = (lanes * d.b * d.nh * d.t).div_ceil(ELEM_THREADS as usize) as u64;
        self.launch(k, c.dt, grid, ELEM_THREADS, 0, &args);
    }

    /// The fused attention's backward pass with stored dS ([`super::FlashBackward::Stored`]): Δ, then
    /// for each chunk of sequences whose dS tiles fit in the budget ([`FLASH_DS_BUDGET`]),
    /// `flash_backward_dkv_store` (dK, dV, and dS for every causal tile pair) and
    /// `flash_backward_dq_stored` (dQ from dS and K).
    pub(super) fn attention_backward_stored_ds(&mut self, call: &FlashBackwardCall) {
        let (dt, delta, d) = (call.dt, call.delta, call.d);
        self.flash_delta(call, (delta, 0));
        let (chunk, per_seq) = self.stored_ds_chunk(d, dt);
        let ds = self.scratch(|s| &mut s.attn_dq, chunk * per_seq);
        let (w, c) = (d.shape().qkv_width(), d.nh * d.hs);
        let (dq, dy, l, x) = (
            call.dqkv,
            self.ptr(call.dout),
            self.ptr(call.lse),
            self.qkv_ptr(call.qkv, d),
        );
        let (kkv, kq) = self.stored_kernels(call.form, d);
        for b0 in (0..d.b).step_by(chunk) {
            let part = AttnDims {
                b: chunk.min(d.b - b0),
                ..d
            };
            // The chunk's first sequence in each tensor.
            let at = |p: u64, per_seq_elems: usize, bytes: usize| {
                p + (b0 * per_seq_elems * bytes) as u64
            };
            let (dq, x) = (at(dq, d.t * w, dt.bytes()), at(x, d.t * w, dt.bytes()));
            let tail = flash_dims(x, part);
            let mut args = vec![
                Arg::Ptr(dq),
                Arg::Ptr(at(delta, d.nh * d.t, 4)),
                Arg::Ptr(at(dy, d.t * c, dt.bytes())),
                Arg::Ptr(at(l, d.nh * d.t, 4)),
            ];
            args.extend(tail);
            args.push(Arg::Ptr(ds));
            args.extend(call.rope);
            let kv_grid = Self::flash_grid_kv(part);
            self.launch(kkv.kernel, dt, kv_grid, kkv.threads, kkv.shmem, &args);
            let mut args = vec![Arg::Ptr(dq), Arg::Ptr(ds)];
            args.extend(tail.iter().chain(&call.rope).copied());
            let q_grid = Self::flash_grid(part, kq.rows);
            self.launch(kq.kernel, dt, q_grid, kq.threads, kq.shmem, &args);
        }
    }

    /// The stored-dS backward's dK/dV kernel (storing dS) and dQ kernel of form `f` for heads
    /// of `d.hs` (with wgmma, 16 rows per warp: FlashMma::refusal); heads over 64, the `_d128`
    /// kernels (the dQ kernel's four tiles, the dK/dV kernel's six).
    fn stored_kernels(&mut self, f: FlashForm, d: AttnDims) -> (FlashLaunch, FlashLaunch) {
        if self.head_128(f, d) {
            let (dkv, dq) = match f.mma {
                FlashMma::Sync => (
                    K::flash_backward_dkv_store_d128,
                    K::flash_backward_dq_stored_d128,
                ),
                FlashMma::Wgmma => (
                    K::flash_backward_dkv_store_wgmma_d128,
                    K::flash_backward_dq_stored_wgmma_d128,
                ),
            };
            return (
                FlashLaunch::d128(dkv, D128_MOST_TILES),
                FlashLaunch::d128(dq, 4),
            );
        }
        let rows = f.warp_rows;
        let (dkv, dq) = match f.mma {
            FlashMma::Wgmma => (
                (K::flash_backward_dkv_store_wgmma, FLASH_THREADS),
                (K::flash_backward_dq_stored_wgmma, FLASH_THREADS),
            ),
            FlashMma::Sync => (
                FlashWarpRows::pick(
                    rows.dkv,
                    K::flash_backward_dkv_store,
                    K::flash_backward_dkv_store_wide,
                ),
                FlashWarpRows::pick(
                    rows.dq,
                    K::flash_backward_dq_stored,
                    K::flash_backward_dq_stored_wide,
                ),
            ),
        };
        let launch = |(kernel, threads), shmem| FlashLaunch {
            kernel,
            threads,
            rows: FLASH_ROWS,
            shmem,
        };
        (launch(dkv, dkv_shmem(rows.dkv)), launch(dq, 0))
    }

    /// One block per (query block of `rows` rows, sequence, query head); [`Self::launch`]
    /// caps the grid at the engine's limit and the kernels loop over the rest.
    pub(super) fn flash_grid(d: AttnDims, rows: usize) -> u64 {
        (d.t.div_ceil(rows) * d.b * d.nh) as u64
    }

    /// The dK/dV kernels' blocks: one per (64-row key block, sequence, key/value head), each
    /// over the query heads of its group.
    pub(super) fn flash_grid_kv(d: AttnDims) -> u64 {
        (d.t.div_ceil(FLASH_ROWS) * d.b * d.kv) as u64
    }

    /// The fused kernels' trailing arguments: qkv (rows `[q | k | v]`, `kv` key/value heads),
    /// B, T, nh, kv, hs, scale.
    pub(super) fn flash_args(&self, qkv: Span, d: AttnDims) -> [Arg; 7] {
        flash_dims(self.qkv_ptr(qkv, d), d)
    }

    /// The device address of the fused kernels' qkv, after checking its length.
    fn qkv_ptr(&self, qkv: Span, d: AttnDims) -> u64 {
        assert_eq!(
            qkv.len,
            d.b * d.t * d.shape().qkv_width(),
            "fused attention: qkv length"
        );
        self.ptr(qkv)
    }
}

/// The backward pass form `f` runs for heads of `d.hs`: its own, but split where it is the
/// one kernel and the heads are over 64 ([`D128_FORM`]).
fn backward_of(f: FlashForm, d: AttnDims) -> FlashBackward {
    if d.hs > FLASH_HEAD_64 && f.backward == FlashBackward::Fused {
        FlashBackward::Split
    } else {
        f.backward
    }
}

/// The one-kernel backward's query blocks for `d` (one work item and one f32 accumulator tile
/// each, 64 × 64: 16 KB, 50 MB for GPT-2 124M B=16) and its accumulators' bytes.
fn one_kernel_scratch(d: AttnDims) -> (usize, usize) {
    let tiles = CudaBackend::flash_grid(d, FLASH_ROWS) as usize;
    (tiles, tiles * FLASH_ROWS * FLASH_HEAD_64 * 4)
}

/// The fused kernels' trailing arguments for qkv at device address `qkv` (see
/// [`CudaBackend::flash_args`]).
fn flash_dims(qkv: u64, d: AttnDims) -> [Arg; 7] {
    [
        Arg::Ptr(qkv),
        Arg::I64(d.b as i64),
        Arg::I64(d.t as i64),
        Arg::I64(d.nh as i64),
        Arg::I64(d.kv as i64),
        Arg::I64(d.hs as i64),
        Arg::F32(attention_scale(d.hs)),
    ]
}

/// One fused attention kernel's launch: the kernel, its threads per block, the query rows or
/// keys a block owns, its dynamic shared memory.
pub(super) struct FlashLaunch {
    pub kernel: K,
    pub threads: u32,
    pub rows: usize,
    pub shmem: u32,
}

impl FlashLaunch {
    /// A `_d128` kernel ([`D128_FORM`]) with `tiles` tiles in dynamic shared memory.
    fn d128(kernel: K, tiles: u32) -> FlashLaunch {
        FlashLaunch {
            kernel,
            threads: FLASH_THREADS,
            rows: FLASH_ROWS,
            shmem: d128_shmem(tiles),
        }
    }
}

/// Dynamic shared memory of a dK/dV kernel with `rows` keys per warp: the wide ones keep
/// their K and V tiles there ([`FLASH_KV_SHMEM`]).
pub(super) fn dkv_shmem(rows: usize) -> u32 {
    if rows == 32 {
        FLASH_KV_SHMEM
    } else {
        0
    }
}

/// `1/√hs`, the value the CPU op uses.
pub(super) fn attention_scale(hs: usize) -> f32 {
    crate::ops::attention::scale::<f32>(hs)
}

/// The matrices of one attention call for the batched GEMMs: every (sequence, head) pair at
/// once, placed by [`Heads`] (the layouts of `ops/attention.rs`), as [`Ptrs`] starting at a
/// given row and column.
pub(super) struct Attn {
    att: u64,
    qkv: u64,
    /// Storage type of `att`, `qkv` and every (B, T, C) tensor of the call (one type).
    dt: Dtype,
    d: AttnDims,
    /// `1/√hs`, the scores' scale.
    pub(super) scale: f32,
}

/// A sequence's heads as a [`Heads`] layout: the base address, leading dimension and stride
/// between heads.
fn heads_at(base: u64, dt: Dtype, h: Heads) -> Mat {
    (base + (dt.bytes() * h.offset) as u64, h.ld, h.stride, dt)
}

impl Attn {
    pub(super) fn new(be: &CudaBackend, att: Span, qkv: Span, d: AttnDims) -> Attn {
        assert!(d.kv > 0 && d.nh.is_multiple_of(d.kv), "attention: {d:?}");
        assert_eq!(att.len, d.b * d.nh * d.t * d.t, "attention: att length");
        let width = d.shape().qkv_width();
        assert_eq!(qkv.len, d.b * d.t * width, "attention: qkv length");
        let dt = be.dt(qkv);
        assert_eq!(be.dt(att), dt, "attention: att and qkv types differ");
        Attn {
            att: be.ptr(att),
            qkv: be.ptr(qkv),
            dt,
            d,
            scale: attention_scale(d.hs),
        }
    }

    /// Element (row0, col0) of every head of every sequence, for per-sequence layouts `m`.
    pub(super) fn every_head(&self, m: impl Fn(usize) -> Mat, row0: usize, col0: usize) -> Ptrs {
        self.every_head_of(m, (row0, col0), |h| h)
    }

    /// [`Self::every_head`] where query head `h` reads matrix `of(h)` of `m`.
    fn every_head_of(
        &self,
        m: impl Fn(usize) -> Mat,
        (row0, col0): (usize, usize),
        of: impl Fn(usize) -> usize,
    ) -> Ptrs {
        let mut ptrs = Vec::with_capacity(self.d.b * self.d.nh);
        let mut ld = 0;
        for bi in 0..self.d.b {
            let (base, l, stride, dt) = m(bi);
            ld = l;
            let at = |h: usize| base + (dt.bytes() * (of(h) * stride + row0 * l + col0)) as u64;
            ptrs.extend((0..self.d.nh).map(at));
        }
        (ptrs, ld, self.dt)
    }

    /// Part `part` (0 Q, 1 K, 2 V) of every query head, from row `row0`: for K and V, the
    /// key/value head query head `h` reads (`h / (nh / kv)`; the same one for a group).
    pub(super) fn qkv(&self, part: usize, row0: usize) -> Ptrs {
        let shape = self.d.shape();
        let f = |bi| heads_at(self.qkv, self.dt, Heads::qkv_grouped(bi, part, &shape));
        let g = shape.group();
        match part {
            0 => self.every_head(f, row0, 0),
            _ => self.every_head_of(f, (row0, 0), |h| h / g),
        }
    }

    /// The query heads of `p` (one pointer per sequence and query head) that are member `i`
    /// of their key/value group: one per key/value head, so that products writing a
    /// key/value head's gradient run as `group()` batches, each adding its members' share.
    pub(super) fn members(&self, p: &Ptrs, i: usize) -> Ptrs {
        let (nh, g) = (self.d.nh, self.d.shape().group());
        let ptrs =
            p.0.iter()
                .enumerate()
                .filter(|(j, _)| (j % nh) % g == i)
                .map(|(_, &x)| x)
                .collect();
        (ptrs, p.1, p.2)
    }

    /// Query heads per key/value head.
    pub(super) fn group(&self) -> usize {
        self.d.shape().group()
    }

    /// `att` of every head from element (row0, col0).
    pub(super) fn att_at(&self, row0: usize, col0: usize) -> Ptrs {
        let d = self.d;
        self.every_head(
            |bi| heads_at(self.att, self.dt, Heads::att(bi, d.t, d.nh)),
            row0,
            col0,
        )
    }

    /// A (B, T, C) tensor as per-sequence head layouts.
    pub(super) fn btc(&self, be: &CudaBackend, s: Span) -> impl Fn(usize) -> Mat {
        let d = self.d;
        assert_eq!(
            s.len,
            d.b * d.t * d.nh * d.hs,
            "attention: (B, T, C) length"
        );
        let (p, dt) = (be.ptr(s), be.dt(s));
        assert_eq!(dt, self.dt, "attention: (B, T, C) tensor of another type");
        move |bi| heads_at(p, dt, Heads::btc(bi, d.t, d.nh, d.hs))
    }

    /// Every head of a (B, T, C) tensor ([`Self::btc`]) from row `row0`.
    pub(super) fn rows_of(&self, m: &impl Fn(usize) -> Mat, row0: usize) -> Ptrs {
        self.every_head(m, row0, 0)
    }
}

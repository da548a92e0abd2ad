//! Column sums on the CUDA backend (bias gradients, the layernorm weight gradients): two
//! fixed-shape stages, so the sums are added in the same order on every run.

use super::engine::Arg;
use super::{CudaBackend, Span, K, WARP};

/// Rows per chunk of the two-stage column sums (dbias, layernorm dw/dbias): at 32, a
/// (16384, 768) gradient has 512 chunks × 96 packs of columns, enough threads for the loads of
/// stage 1 to cover the memory latency, and stage 2 reads 1.5 MB of partial sums.
pub(super) const COLUMN_CHUNK_ROWS: usize = 32;

impl CudaBackend {
    /// Adds the column sums of `rows`×`cols` `dout` into `dst` (and, for layernorm, the column
    /// sums of `dout·x̂` into the first span of `dst2`), in two fixed-shape stages
    /// (`column_partials`: a thread per chunk of rows and pack of columns; `column_finish`: a
    /// block per 32 columns).
    pub(super) fn column_sums(
        &mut self,
        dst: Span,
        dst2: Option<(Span, Span, Span, Span)>,
        dout: Span,
        rows: usize,
        cols: usize,
    ) {
        let chunks = rows.div_ceil(COLUMN_CHUNK_ROWS).max(1);
        let (part, part2) = self.column_partial_sums(chunks, cols);
        let (inp, mean, rstd, with) = match dst2 {
            Some((_, inp, mean, rstd)) => (self.ptr(inp), self.ptr(mean), self.ptr(rstd), 1),
            None => (0, 0, 0, 0),
        };
        self.launch_packs(
            K::column_partials,
            self.dt(dout),
            chunks * cols,
            &[
                Arg::Ptr(part),
                Arg::Ptr(part2),
                Arg::Ptr(self.ptr(dout)),
                Arg::Ptr(inp),
                Arg::Ptr(mean),
                Arg::Ptr(rstd),
                Arg::I32(with),
                Arg::I64(rows as i64),
                Arg::I64(cols as i64),
                Arg::I64(COLUMN_CHUNK_ROWS as i64),
                Arg::I64(chunks as i64),
            ],
        );
        let second = dst2.map(|(dw, ..)| (dw, part2));
        self.column_finish(dst, part, second, cols, chunks);
    }

    /// Scratch for the first stage of two column sums over `chunks` chunks of rows: two arrays
    /// of `chunks`×`cols` floats.
    pub(super) fn column_partial_sums(&mut self, chunks: usize, cols: usize) -> (u64, u64) {
        let part = self.scratch(|b| &mut b.partials, 4 * 2 * chunks * cols);
        (part, part + 4 * (chunks * cols) as u64)
    }

    /// The second stage of a column sum: `dst[c] += Σ_k part[k, c]` over `chunks` chunks, and
    /// for `second = Some((dst2, part2))` the same of `part2` into `dst2`, in the same launch
    /// (the layernorm's dbias and dw: one launch instead of two, each a few µs of latency).
    pub(super) fn column_finish(
        &self,
        dst: Span,
        part: u64,
        second: Option<(Span, u64)>,
        cols: usize,
        chunks: usize,
    ) {
        let groups = cols.div_ceil(WARP as usize);
        let (dst2, part2) = match second {
            Some((d2, p2)) => {
                assert_eq!(
                    self.dt(d2),
                    self.dt(dst),
                    "column_finish: the two sums' types"
                );
                (self.ptr(d2), p2)
            }
            None => (0, 0),
        };
        self.launch_rows(
            K::column_finish,
            self.dt(dst),
            groups * if second.is_some() { 2 } else { 1 },
            0,
            &[
                Arg::Ptr(self.ptr(dst)),
                Arg::Ptr(dst2),
                Arg::Ptr(part),
                Arg::Ptr(part2),
                Arg::I64(cols as i64),
                Arg::I64(chunks as i64),
            ],
        )
    }
}

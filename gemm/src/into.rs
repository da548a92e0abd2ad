//! GEMMs written once into D ([`crate::PrecisionGemm::gemm_into`]): each tile of D is summed in
//! an `f32` tile of the thread's own (the tile's start, then every k block of the product) and
//! then converted into D, so D may be stored in 16 bits without an `f32` copy of it anywhere,
//! and its values are those of the `f32` GEMM on a C holding the start, rounded once.

use crate::precision::{bf16_to_f32, f16_bits_of, f16_value_of, round_bf16, Storage};
use crate::raw::{RawMat, RawMatMut, RawOut};

/// Where a GEMM's sums go and what they start from other than `C`: `D := alpha·A·B + start`,
/// `start = beta·c + bias` (each term optional; `beta` is the problem's; C is not read when it
/// is 0), in the kernel's orientation like the rest of the problem (`bias` is a view with a
/// zero stride along what it repeats over).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Target {
    pub d: RawOut,
    pub c: Option<RawMat>,
    pub bias: Option<RawMat>,
}

impl Target {
    pub fn t(self) -> Self {
        Target {
            d: self.d.t(),
            c: self.c.map(RawMat::t),
            bias: self.bias.map(RawMat::t),
        }
    }

    pub fn block(self, r0: usize, c0: usize, rows: usize, cols: usize) -> Self {
        Target {
            d: self.d.block(r0, c0, rows, cols),
            c: self.c.map(|c| c.block(r0, c0, rows, cols)),
            bias: self.bias.map(|b| b.block(r0, c0, rows, cols)),
        }
    }

    /// Writes each element's start into `tile` (column-major, unit row stride, the shape of
    /// this block of D) and returns the `beta` the product is then added with: 1 onto the
    /// start, or 0 when there is none (the tile left as it is, never read).
    pub fn start(&self, beta: f32, tile: RawMatMut) -> f32 {
        debug_assert!(tile.rs == 1 && (tile.rows, tile.cols) == (self.d.rows, self.d.cols));
        // beta = 0: C is not read (as `gemm` does not read C then).
        let c = self.c.filter(|_| beta != 0.0);
        if c.is_none() && self.bias.is_none() {
            return 0.0;
        }
        // The bias as one column per column of the tile; one for all of them where it repeats
        // along the columns (a row-major D: the kernel's rows are its columns), widened once.
        let mut add = Vec::new();
        let mut widened = None;
        for j in 0..tile.cols {
            // SAFETY: column j of the tile, `rows` floats from its start (unit row stride),
            // is inside the caller's tile and written by this thread alone.
            let col =
                unsafe { std::slice::from_raw_parts_mut(tile.ptr.add(j * tile.cs), tile.rows) };
            // The same operations as adding onto an f32 C set to `c` then `+= bias`: beta·c,
            // then the bias added, each rounded to f32.
            match (c, self.bias) {
                (Some(c), bias) => {
                    column_to_f32(c, j, col);
                    if beta != 1.0 {
                        col.iter_mut().for_each(|x| *x *= beta);
                    }
                    if let Some(b) = bias {
                        let column = if b.cs == 0 { 0 } else { j };
                        if widened != Some(column) {
                            add.resize(tile.rows, 0.0);
                            column_to_f32(b, column, &mut add);
                            widened = Some(column);
                        }
                        col.iter_mut().zip(&add).for_each(|(x, b)| *x += b);
                    }
                }
                (None, Some(b)) => column_to_f32(b, j, col),
                (None, None) => unreachable!("returned above"),
            }
        }
        1.0
    }

    /// Converts `tile` (as [`Self::start`] takes it) into this block of D.
    pub fn store(&self, tile: RawMatMut) {
        debug_assert!(tile.rs == 1 && (tile.rows, tile.cols) == (self.d.rows, self.d.cols));
        for j in 0..tile.cols {
            // SAFETY: as in `start` (read only).
            let col = unsafe { std::slice::from_raw_parts(tile.ptr.add(j * tile.cs), tile.rows) };
            column_from_f32(col, self.d, j);
        }
    }

    /// D := start, for a problem with no product to add (`k == 0` or `alpha == 0`).
    pub fn store_start_only(&self, beta: f32) {
        let rows = self.d.rows;
        let mut col = vec![0.0f32; rows];
        for j in 0..self.d.cols {
            let one = self.block(0, j, rows, 1);
            let tile = RawMatMut {
                ptr: col.as_mut_ptr(),
                rows,
                cols: 1,
                rs: 1,
                cs: rows,
            };
            if one.start(beta, tile) == 0.0 {
                col.fill(0.0);
            }
            one.store(tile);
        }
    }
}

/// Column `j` of `src` as `f32`s (exact: every stored type widens exactly).
fn column_to_f32(src: RawMat, j: usize, dst: &mut [f32]) {
    let n = dst.len();
    debug_assert!(n <= src.rows && j < src.cols);
    let base = src.ptr.wrapping_add(j * src.cs * src.storage.bytes());
    match src.storage {
        Storage::F32 => {
            let p = base as *const f32;
            if src.rs == 1 {
                // SAFETY: n elements of column j, inside the validated view.
                dst.copy_from_slice(unsafe { std::slice::from_raw_parts(p, n) });
            } else {
                // SAFETY: element (i, j) is inside the validated view.
                (0..n).for_each(|i| dst[i] = unsafe { *p.add(i * src.rs) });
            }
        }
        Storage::Bf16 | Storage::F16 => {
            let widen: fn(u16) -> f32 = if src.storage == Storage::Bf16 {
                bf16_to_f32
            } else {
                f16_value_of
            };
            let p = base as *const u16;
            if src.rs == 1 {
                // SAFETY: as above.
                let bits = unsafe { std::slice::from_raw_parts(p, n) };
                crate::convert::widen(src.storage, bits, dst);
            } else {
                // SAFETY: as above.
                (0..n).for_each(|i| dst[i] = widen(unsafe { *p.add(i * src.rs) }));
            }
        }
    }
}

/// Rounds `src` into column `j` of `d` (round to nearest even; an `f32` D takes it as is).
fn column_from_f32(src: &[f32], d: RawOut, j: usize) {
    let n = src.len();
    debug_assert!(n <= d.rows && j < d.cols);
    let base = d.ptr().wrapping_add(j * d.cs * d.storage.bytes());
    let bf16_bits = |x: f32| (round_bf16(x).to_bits() >> 16) as u16;
    match d.storage {
        Storage::F32 => {
            let p = base as *mut f32;
            if d.rs == 1 {
                // SAFETY: n elements of column j of the validated D, written by this thread
                // alone (its tile).
                unsafe { std::slice::from_raw_parts_mut(p, n) }.copy_from_slice(src);
            } else {
                // SAFETY: element (i, j) is inside the validated D, in this thread's tile.
                (0..n).for_each(|i| unsafe { *p.add(i * d.rs) = src[i] });
            }
        }
        Storage::Bf16 | Storage::F16 => {
            let p = base as *mut u16;
            if d.rs == 1 {
                // SAFETY: as above.
                let bits = unsafe { std::slice::from_raw_parts_mut(p, n) };
                crate::convert::round(d.storage, src, bits);
            } else {
                let round: fn(f32) -> u16 = if d.storage == Storage::Bf16 {
                    bf16_bits
                } else {
                    f16_bits_of
                };
                // SAFETY: as above.
                (0..n).for_each(|i| unsafe { *p.add(i * d.rs) = round(src[i]) });
            }
        }
    }
}

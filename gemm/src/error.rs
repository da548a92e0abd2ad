//! Errors returned by fugu-gemm. Every error names the operand, dimension or setting at fault.

use thiserror::Error;

/// What went wrong in a GEMM call or in configuring the library.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GemmError {
    /// A matrix view does not fit inside its buffer.
    #[error("{operand}: a {rows}x{cols} view with row stride {row_stride}, column stride {col_stride} and offset {offset} needs {needed} elements, but the buffer has {len}")]
    OutOfBounds {
        operand: String,
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
        offset: usize,
        needed: usize,
        len: usize,
    },
    /// An output view whose elements overlap (e.g. a zero stride), which would race.
    #[error("{operand}: output view {rows}x{cols} with row stride {row_stride} and column stride {col_stride} has overlapping elements")]
    OverlappingOutput {
        operand: String,
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    },
    /// Operand shapes that cannot be multiplied.
    #[error("shape mismatch: {detail}")]
    ShapeMismatch { detail: String },
    /// A batched call whose operand lists have different lengths.
    #[error("batch mismatch: {detail}")]
    BatchMismatch { detail: String },
    /// An index or size computation that overflows `usize`.
    #[error("{operand}: size overflows the address space ({detail})")]
    Overflow { operand: String, detail: String },
    /// A bad setting (environment variable or explicit configuration).
    #[error("bad {what} {value:?}: expected {expected}")]
    Config {
        what: String,
        value: String,
        expected: String,
    },
}

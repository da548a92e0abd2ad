//! aarch64 SVE micro-kernel (placeholder until the SVE kernel lands).

use crate::kernel::KernelF32;

pub fn kernel() -> Option<KernelF32> {
    None
}

pub fn f32_lanes() -> Option<usize> {
    None
}

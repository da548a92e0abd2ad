//! aarch64 NEON micro-kernel (placeholder until the NEON kernel lands).

use crate::kernel::KernelF32;

pub fn kernel() -> Option<KernelF32> {
    None
}

//! NVRTC, for `kernels.cu`: to PTX text (what the compile test and `scripts/ptxas-report.sh`
//! read) or to the GPU's own machine code, a cubin (what the backend loads). A driver runs a
//! cubin as it is; PTX it must compile itself, at every load not in its cache (seconds for
//! these kernels), and it refuses PTX from an NVRTC newer than itself (CUDA's minor-version
//! compatibility covers cubins, not PTX: NVRTC 13.5 writes PTX ISA 9.5, which a CUDA 13.0
//! driver does not read).

use anyhow::{bail, Context, Result};
use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, CString};

/// What NVRTC produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// PTX text for a virtual architecture (`compute_XY`).
    Ptx,
    /// Machine code for a real one (`sm_XY`).
    Cubin,
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by `create_program` in `compile`, destroyed once, here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// A C string of NVRTC's (a log or PTX), up to its terminating NUL.
fn c_text(bytes: &[c_char]) -> Vec<u8> {
    bytes
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect()
}

/// Compiles CUDA C++ `source` (named `name` in messages) with NVRTC `options` (which name
/// the architecture) into `out`. NVRTC must be loadable (`super::nvrtc_available`).
pub fn compile(source: &str, name: &str, options: &[String], out: Output) -> Result<Vec<u8>> {
    let src = CString::new(source).context("the CUDA source holds a NUL byte")?;
    let c_name = CString::new(name).context("the CUDA source's name holds a NUL byte")?;
    // Declared after `src` and `c_name`, so dropped (destroyed) before them: NVRTC keeps
    // pointers to both while the program lives.
    let prog = Program(result::create_program(&src, Some(&c_name))?);
    // SAFETY: `prog.0` is a live program (created above, destroyed when `prog` drops).
    if let Err(e) = unsafe { result::compile_program(prog.0, options) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|l| String::from_utf8_lossy(&c_text(&l)).into_owned())
            .unwrap_or_default();
        bail!("NVRTC could not compile {name} ({e:?}, options {options:?}):\n{log}");
    }
    Ok(match out {
        // SAFETY: as above; the program compiled.
        Output::Ptx => c_text(&unsafe { result::get_ptx(prog.0) }?),
        Output::Cubin => {
            let mut size = 0usize;
            // SAFETY: as above; `size` is a valid out-pointer, and the buffer NVRTC fills
            // has the size it reported.
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }.result()?;
            let mut cubin = vec![0u8; size];
            // SAFETY: as above.
            unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }.result()?;
            if size == 0 {
                bail!("NVRTC made no cubin from {name} (options {options:?}: a real `sm_` architecture is needed)");
            }
            cubin
        }
    })
}

/// NVRTC's version (major, minor).
pub fn version() -> Result<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers for the duration of the call.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result()?;
    Ok((major, minor))
}

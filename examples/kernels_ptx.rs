//! Prints the PTX of `kernels.cu` as NVRTC compiles it (no GPU needed) for compute capability
//! `MAJOR MINOR`: `cargo run --release --features cuda --example kernels_ptx -- 9 0 >
//! kernels.ptx`. `scripts/ptxas-report.sh` assembles it with ptxas for the registers, spills
//! and shared memory of each kernel. With `--cubin`, writes the machine code the CUDA backend
//! loads instead (for `cuobjdump -sass`, or to check that every architecture assembles).

use std::io::Write;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (major, minor, cubin) = match args.as_slice() {
        [major, minor] => (major, minor, false),
        [major, minor, flag] if flag == "--cubin" => (major, minor, true),
        _ => anyhow::bail!(
            "usage: kernels_ptx MAJOR MINOR [--cubin] (a compute capability, e.g. 9 0)"
        ),
    };
    let (major, minor) = (major.parse()?, minor.parse()?);
    let out = if cubin {
        fugu::backend::cuda::kernels_cubin(major, minor)?
    } else {
        fugu::backend::cuda::kernels_ptx(major, minor)?.into_bytes()
    };
    std::io::stdout().write_all(&out)?;
    Ok(())
}

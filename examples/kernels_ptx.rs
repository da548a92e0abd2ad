//! Prints the PTX of `kernels.cu` as the CUDA backend compiles it at start-up (NVRTC, no GPU
//! needed) for compute capability `MAJOR MINOR`: `cargo run --release --features cuda --example
//! kernels_ptx -- 9 0 > kernels.ptx`. `scripts/ptxas-report.sh` assembles it with ptxas for the
//! registers, spills and shared memory of each kernel.

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [major, minor] = args.as_slice() else {
        anyhow::bail!("usage: kernels_ptx MAJOR MINOR (a compute capability, e.g. 9 0)");
    };
    let (major, minor) = (major.parse()?, minor.parse()?);
    print!("{}", fugu::backend::cuda::kernels_ptx(major, minor)?);
    Ok(())
}

fn main() {
    for isa in fugu_gemm::kernel::available_isas() {
        println!(
            "{isa}: {:?} GFLOP/s per core",
            fugu_gemm::peak::measure_core_gflops(isa)
        );
    }
}

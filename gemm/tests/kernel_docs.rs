//! Keeps the kernel table in docs/KERNELS.md true: every kernel this CPU can run must appear
//! with its real tile shape.

use fugu_gemm::kernel::{available_isas, kernel_for};
use fugu_gemm::Isa;

#[test]
fn kernel_table_matches_docs() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/KERNELS.md"))
        .expect("docs/KERNELS.md is readable");
    for isa in available_isas() {
        let k = kernel_for(isa).unwrap();
        let row = doc
            .lines()
            .find(|l| l.starts_with(&format!("| {} ", isa.name())))
            .unwrap_or_else(|| panic!("docs/KERNELS.md has no table row for {isa}"));
        let tile = if isa == Isa::Sve {
            assert_eq!(k.mr, 2 * isa.f32_lanes(), "SVE mr must be 2·VL");
            format!("2·VL × {}", k.nr)
        } else {
            format!("{} × {}", k.mr, k.nr)
        };
        assert!(
            row.contains(&tile),
            "docs/KERNELS.md row for {isa} should say {tile}: {row}"
        );
    }
}

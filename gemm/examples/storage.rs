// Times one GEMM shape in every precision, with its operands stored in f32 and in the
// precision's own 16-bit type (how the CPU backend hands fugu-gemm its bf16/f16 activations),
// A and B plain or stored transposed: the cost of the packs' conversions and rounding.
//
//   cargo run --release -p fugu-gemm --example storage -- M N K [reps]
use fugu_gemm::{Element, MatMut, MatRef, Precision, Runtime};
use half::{bf16, f16};
use std::time::Instant;

fn median_gflops(flops: f64, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut ts: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    ts.sort_by(|a, b| a.total_cmp(b));
    flops / ts[ts.len() / 2] / 1e9
}

/// `a` (m×k) and `b` (k×n), each row-major or (when `ta`/`tb`) stored transposed.
fn view<T: Element>(data: &[T], rows: usize, cols: usize, transposed: bool) -> MatRef<'_, T> {
    if transposed {
        MatRef::row_major(data, cols, rows).unwrap().t()
    } else {
        MatRef::row_major(data, rows, cols).unwrap()
    }
}

#[allow(clippy::too_many_arguments)]
fn time<T: Element>(
    rt: &Runtime,
    prec: Precision,
    a: &[T],
    b: &[T],
    (m, n, k): (usize, usize, usize),
    (ta, tb): (bool, bool),
    reps: usize,
) -> f64 {
    let mut c = vec![0.0f32; m * n];
    median_gflops(2.0 * (m * n * k) as f64, reps, || {
        rt.at(prec)
            .gemm(
                1.0,
                view(a, m, k, ta),
                view(b, k, n, tb),
                0.0,
                MatMut::row_major(&mut c, m, n).unwrap(),
            )
            .unwrap()
    })
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().expect("M N K [reps]: numbers"))
        .collect();
    let (m, n, k) = (args[0], args[1], args[2]);
    let reps = args.get(3).copied().unwrap_or(5);
    let a: Vec<f32> = (0..m * k)
        .map(|i| ((i % 97) as f32 - 48.0) / 50.0)
        .collect();
    let b: Vec<f32> = (0..k * n)
        .map(|i| ((i % 89) as f32 - 44.0) / 45.0)
        .collect();
    let (a16, b16): (Vec<f16>, Vec<f16>) = (
        a.iter().map(|&x| f16::from_f32(x)).collect(),
        b.iter().map(|&x| f16::from_f32(x)).collect(),
    );
    let (abf, bbf): (Vec<bf16>, Vec<bf16>) = (
        a.iter().map(|&x| bf16::from_f32(x)).collect(),
        b.iter().map(|&x| bf16::from_f32(x)).collect(),
    );
    let rt = Runtime::from_env().unwrap();
    eprintln!("{}", rt.describe());
    println!("{m}x{n}x{k}: GFLOP/s (median of {reps})");
    println!("ta tb   f32/f32   bf16/f32  bf16/bf16   f16/f32   f16/f16");
    for (ta, tb) in [(false, false), (false, true), (true, false)] {
        let shape = (m, n, k);
        let t = (ta, tb);
        println!(
            "{:>2} {:>2} {:>9.1} {:>10.1} {:>10.1} {:>9.1} {:>9.1}",
            ta as u8,
            tb as u8,
            time(&rt, Precision::F32, &a, &b, shape, t, reps),
            time(&rt, Precision::Bf16, &a, &b, shape, t, reps),
            time(&rt, Precision::Bf16, &abf, &bbf, shape, t, reps),
            time(&rt, Precision::F16, &a, &b, shape, t, reps),
            time(&rt, Precision::F16, &a16, &b16, shape, t, reps),
        );
    }
}

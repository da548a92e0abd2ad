// Quick timing for tuning: cargo run --release -p fugu-gemm --example quick -- M N K [reps]
use fugu_gemm::{MatMut, MatRef, Runtime};
use std::time::Instant;
fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|s| s.parse().unwrap())
        .collect();
    let (m, n, k) = (args[0], args[1], args[2]);
    let reps = args.get(3).copied().unwrap_or(5);
    let a = vec![1.0f32; m * k];
    let b = vec![1.0f32; k * n];
    let mut c = vec![0.0f32; m * n];
    let rt = Runtime::from_env().unwrap();
    eprintln!("{}", rt.describe());
    let mut ts = vec![];
    for _ in 0..reps {
        let t = Instant::now();
        rt.gemm(
            1.0,
            MatRef::row_major(&a, m, k).unwrap(),
            MatRef::row_major(&b, k, n).unwrap(),
            0.0,
            MatMut::row_major(&mut c, m, n).unwrap(),
        )
        .unwrap();
        ts.push(t.elapsed().as_secs_f64());
    }
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let fl = 2.0 * (m * n * k) as f64;
    println!("fugu {:.1} GFLOP/s", fl / ts[ts.len() / 2] / 1e9);
    let mut ts = vec![];
    for _ in 0..reps {
        let t = Instant::now();
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                1.0,
                a.as_ptr(),
                k as isize,
                1,
                b.as_ptr(),
                n as isize,
                1,
                0.0,
                c.as_mut_ptr(),
                n as isize,
                1,
            )
        };
        ts.push(t.elapsed().as_secs_f64());
    }
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("mm   {:.1} GFLOP/s", fl / ts[ts.len() / 2] / 1e9);
}

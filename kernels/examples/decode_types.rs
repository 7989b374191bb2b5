//! One activation row against every panel format (a decode step of one sequence): for each
//! GGML type, `MATS` distinct 2048×2048 matrices of random blocks (64 MiB of f32 values' worth,
//! streamed from memory as a model's are), the median time of a pass over them, the bytes read
//! per second and the weights per nanosecond. `TANDEM_ISA` picks the level; `ROWS` the
//! activation rows (1 by default): `cargo run --release -p tandem-kernels --example decode_types`.

mod common;

use common::{env_count, median_secs};
use rand::{Rng, SeedableRng};
use tandem_kernels::{matmul, Weight};
use tandem_model::GgmlType;

/// Random blocks of `ty` for `n` values, with finite f16 scales of either sign.
fn blocks(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let bb = ty.block_bytes();
    let mut out = Vec::with_capacity(n / ty.block_elems() * bb);
    for _ in 0..n / ty.block_elems() {
        let mut b: Vec<u8> = (0..bb).map(|_| r.gen()).collect();
        let mut f16 = |at: usize| {
            let v = half::f16::from_f32(r.gen_range(-0.01f32..0.01));
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        };
        match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => {
                f16(0);
                f16(2);
            }
            GgmlType::Q6K => f16(208),
            _ => f16(0),
        }
        out.extend(b);
    }
    out
}

fn main() {
    rayon::ThreadPoolBuilder::new()
        .build()
        .unwrap()
        .install(run);
}

fn run() {
    let (m, mats, steps) = (
        env_count("ROWS", 1),
        env_count("MATS", 8),
        env_count("STEPS", 15),
    );
    let (n, k) = (2048, 2048);
    println!(
        "{} threads, kernels {}, {mats} matrices of {n}x{k}, {m} row(s)",
        rayon::current_num_threads(),
        tandem_kernels::simd_level()
    );
    println!("type     ms/pass   GB/s   weights/ns");
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ] {
        let ws: Vec<Weight> = (0..mats)
            .map(|i| Weight::quant(ty, &blocks(ty, n * k, i as u64), n, k).unwrap())
            .collect();
        let bytes: usize = ws.iter().map(Weight::bytes).sum();
        let mut out = vec![0f32; m * n];
        let s = median_secs(steps, || {
            for w in &ws {
                matmul(&x, m, w, &mut out).unwrap();
            }
        });
        println!(
            "{:<7} {:>8.3} {:>6.1} {:>12.2}",
            ty.to_string(),
            s * 1e3,
            bytes as f64 / s / 1e9,
            (mats * n * k) as f64 / s / 1e9
        );
    }
}

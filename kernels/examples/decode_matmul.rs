//! The products of one batched decode step of a SmolLM2-135M-shaped model (30 layers of Q4_1
//! q|k|v, o, gate|up and down, a Q8_0 head; 32 activation rows by default, `ROWS` to change):
//! each layer's weights distinct, as in the model, so they stream from memory as they do in the
//! engine (`LAYERS=1`: one layer's weights for all 30 and no head, so they stay in cache and the
//! kernels' arithmetic alone is timed). Prints the step's product time, its GFLOP/s and the share of this level's FMA peak
//! (measured here). `TANDEM_ISA` picks the level:
//! `cargo run --release -p tandem-kernels --example decode_matmul`.

mod common;

use common::{env_count, fma_peak, median_secs};
use tandem_kernels::{matmul, Weight};
use tandem_model::{quantize_q4_1, quantize_q8_0, GgmlType};

fn main() {
    // Inside the pool, as the engine's forward runs: no injection from outside per product.
    rayon::ThreadPoolBuilder::new()
        .build()
        .unwrap()
        .install(run);
}

fn weight(ty: GgmlType, n: usize, k: usize, seed: usize) -> Weight {
    let wf: Vec<f32> = (0..n * k)
        .map(|i| (((i + seed) * 7919 % 1000) as f32 - 500.0) / 700.0)
        .collect();
    let bytes = match ty {
        GgmlType::Q4_1 => quantize_q4_1(&wf),
        _ => quantize_q8_0(&wf),
    };
    Weight::quant(ty, &bytes, n, k).unwrap()
}

fn run() {
    let (m, steps) = (env_count("ROWS", 32), env_count("STEPS", 20));
    let all_shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
    // `ONLY=i`: only the i-th of q|k|v, o, gate|up and down (0-3), 30 times.
    let layer_shapes: Vec<(usize, usize)> = match std::env::var("ONLY")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(i) => vec![all_shapes[i.min(3)]],
        None => all_shapes.to_vec(),
    };
    // `LAYERS` distinct layers' weights, taken in turn by the 30 (fewer: they stay in cache,
    // which sets what the kernels' arithmetic alone costs against what streaming adds).
    let distinct = env_count("LAYERS", 30).clamp(1, 30);
    let layers: Vec<Weight> = (0..distinct)
        .flat_map(|l| {
            layer_shapes
                .iter()
                .map(move |&(n, k)| weight(GgmlType::Q4_1, n, k, l * 131 + n))
        })
        .collect();
    let head = weight(GgmlType::Q8_0, 49152, 576, 7);
    let mut products: Vec<&Weight> = (0..30 * layer_shapes.len())
        .map(|i| &layers[i % layers.len()])
        .collect();
    if distinct == 30 {
        products.push(&head);
    }
    let flops: f64 = products
        .iter()
        .map(|w| 2.0 * (m * w.rows() * w.cols()) as f64)
        .sum();
    let xs: Vec<Vec<f32>> = [576, 1536]
        .map(|k| {
            (0..m * k)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 50.0)
                .collect()
        })
        .into();
    let mut out = vec![0f32; m * 49152];
    let med = median_secs(steps, || {
        for w in &products {
            let x = if w.cols() == 576 { &xs[0] } else { &xs[1] };
            matmul(x, m, w, &mut out[..m * w.rows()]).unwrap();
        }
    });
    let threads = rayon::current_num_threads();
    let peak = fma_peak();
    println!(
        "{m} rows, {threads} threads: products of a step {:.2} ms (median of {steps}), {:.1} GFLOP/s, {:.0}% of the FMA peak ({peak:.1} GFLOP/s)",
        med * 1e3,
        flops / med / 1e9,
        100.0 * flops / med / 1e9 / peak
    );
}

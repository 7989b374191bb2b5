//! What the kernel examples share: their knobs from the environment and their timing.

use std::time::{Duration, Instant};

/// `name` from the environment as a count, or `default`.
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median time of `steps` calls of `step` in seconds, after one call to warm up.
#[allow(dead_code)] // (each example includes this module; not every one uses both timings)
pub fn median_secs(steps: usize, mut step: impl FnMut()) -> f64 {
    median_timed(steps, || {
        let t = Instant::now();
        step();
        t.elapsed()
    })
}

/// The median of `steps` calls of `step` in seconds, after one call to warm up: each call's own
/// measure of its time (what it leaves out is not counted).
#[allow(dead_code)]
pub fn median_timed(steps: usize, mut step: impl FnMut() -> Duration) -> f64 {
    step();
    let mut times: Vec<f64> = (0..steps).map(|_| step().as_secs_f64()).collect();
    times.sort_by(f64::total_cmp);
    times[steps / 2]
}

/// The FMA peak of every thread of the pool at once, in GFLOP/s: the best of five bursts, as
/// `tandem bench engine` measures it.
#[allow(dead_code)]
pub fn fma_peak() -> f64 {
    (0..5)
        .map(|_| {
            let t = Instant::now();
            let flops: u64 = rayon::broadcast(|_| tandem_kernels::fma_burst(1 << 23))
                .into_iter()
                .sum();
            flops as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .fold(0f64, f64::max)
}

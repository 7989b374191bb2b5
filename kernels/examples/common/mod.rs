//! What the kernel examples share: their knobs from the environment and their timing.

use std::time::Instant;

/// `name` from the environment as a count, or `default`.
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The median time of `steps` calls of `step` in seconds, after one call to warm up.
pub fn median_secs(steps: usize, mut step: impl FnMut()) -> f64 {
    step();
    let mut times: Vec<f64> = (0..steps)
        .map(|_| {
            let t = Instant::now();
            step();
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[steps / 2]
}

//! This machine's roofline, measured: sustained memory bandwidth and f32 GEMM throughput.

use std::time::Instant;

use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct Roofline {
    /// Bytes read plus bytes written per second by a large parallel copy, in GB/s.
    pub mem_bw_gb_s: f64,
    /// A 1024³ f32 GEMM on all threads, in GFLOP/s.
    pub f32_gflops: f64,
}

/// Best of a few runs of each; about a second in all.
pub fn measure() -> Roofline {
    Roofline {
        mem_bw_gb_s: copy_bandwidth(256 << 20, 5),
        f32_gflops: gemm_gflops(1024, 3),
    }
}

fn copy_bandwidth(bytes: usize, reps: usize) -> f64 {
    let n = bytes / 4;
    let src: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut dst = vec![0f32; n];
    let chunk = n.div_ceil(rayon::current_num_threads() * 4);
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    2.0 * bytes as f64 / best / 1e9
}

fn gemm_gflops(n: usize, reps: usize) -> f64 {
    let a: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.1).collect();
    let b: Vec<f32> = (0..n * n).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut c = vec![0f32; n * n];
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        // SAFETY: three n×n row-major buffers.
        unsafe {
            gemm::gemm(
                n,
                n,
                n,
                c.as_mut_ptr(),
                1,
                n as isize,
                false,
                a.as_ptr(),
                1,
                n as isize,
                b.as_ptr(),
                1,
                n as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                par,
            );
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&c);
    2.0 * (n * n * n) as f64 / best / 1e9
}

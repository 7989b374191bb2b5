//! This machine's roofline, measured: sustained memory bandwidth, peak f32 FMA rate, and what a
//! GEMM library reaches.

use std::time::Instant;

use rayon::prelude::*;
use tandem_kernels::{matmul, Weight};

/// What this machine's CPUs and memory can do at best; all zero when not measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct Roofline {
    /// Bytes read plus bytes written per second by a large parallel copy, in GB/s.
    pub mem_bw_gb_s: f64,
    /// A 1024³ f32 GEMM on all threads, in GFLOP/s.
    pub f32_gflops: f64,
    /// Register-only vector FMAs on every thread at once, in GFLOP/s: the compute ceiling, with
    /// the instructions of the process's kernel level (`TANDEM_ISA`).
    pub f32_peak_gflops: f64,
}

/// The CPU's model name and the vector extensions the kernels care about, for every report
/// (a figure means little without the machine it was measured on).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct CpuInfo {
    /// The CPU's model name (the architecture's name where none is reported).
    pub model: String,
    /// The flags of this list the CPU has, in this order.
    pub flags: Vec<&'static str>,
}

/// Flags worth naming next to a figure: what separates the kernel levels.
const FLAGS: [&str; 10] = [
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
];

/// Reads `/proc/cpuinfo` (Linux); elsewhere the architecture's name.
pub fn cpu_info() -> CpuInfo {
    let text = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    };
    let model = field("model name")
        .or_else(|| field("Model"))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let have = field("flags")
        .or_else(|| field("Features"))
        .unwrap_or_default();
    let have: Vec<&str> = have.split_whitespace().collect();
    CpuInfo {
        model,
        flags: FLAGS.into_iter().filter(|f| have.contains(f)).collect(),
    }
}

impl std::fmt::Display for CpuInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} [{}]", self.model, self.flags.join(" "))
    }
}

/// Best of a few runs of each; about a second in all.
pub fn measure() -> Roofline {
    Roofline {
        mem_bw_gb_s: copy_bandwidth(256 << 20, 5),
        f32_gflops: gemm_gflops(1024, 5),
        f32_peak_gflops: fma_peak_gflops(7),
    }
}

fn fma_peak_gflops(reps: usize) -> f64 {
    // About 40 ms a run on a current AVX-512 core.
    const ROUNDS: usize = 20_000_000;
    let mut best = 0f64;
    for _ in 0..reps {
        let t = Instant::now();
        let flops: u64 = rayon::broadcast(|_| tandem_kernels::fma_burst(ROUNDS))
            .into_iter()
            .sum();
        best = best.max(flops as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
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
    // Through the kernels' matmul, so the roofline is the GEMM path prefill itself takes.
    let x: Vec<f32> = (0..n * n).map(|i| (i % 7) as f32 * 0.1).collect();
    let w = Weight::F32 {
        data: (0..n * n).map(|i| (i % 5) as f32 * 0.1).collect(),
        rows: n,
        cols: n,
    };
    let mut out = vec![0f32; n * n];
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        matmul(&x, n, &w, &mut out).expect("square shapes agree");
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&out);
    2.0 * (n * n * n) as f64 / best / 1e9
}

//! `y = x · Wᵀ` for a batch of `m` activation rows.
//!
//! Two regimes. Few rows (decode): read every weight row once, decode it on the fly and dot it with
//! each activation row; parallel over output rows, so the weights stream through memory once per
//! step (this is the memory-bound path). Many rows (prefill): decode the weight matrix to f32 once
//! and hand it to `gemm`, which is compute-bound and blocks for the caches.

use rayon::prelude::*;

use crate::simd::{block_sums, dequant_row, dot_f32, dot_quant_row};
use crate::{KernelError, Weight};

/// At or above this many activation rows, decode the weights once and use a GEMM.
/// Measured with `tandem bench engine` on a 2-core Sapphire Rapids VM (Q4_1 SmolLM2): at 8 rows
/// the row-wise path gives 138 tok/s against 54 for decode-then-GEMM (decoding every matrix to f32
/// costs ~100 ms a step); the GEMM's compute advantage overtakes that cost between 16 and 32 rows.
pub const GEMM_MIN_ROWS: usize = 24;

/// Output rows per rayon task in the row-parallel path: large enough to amortize scheduling,
/// small enough to balance two to a few dozen cores.
const ROWS_PER_TASK: usize = 64;

/// `out[m×n] = x[m×k] · Wᵀ` where `W` is `n×k`.
pub fn matmul(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) -> Result<(), KernelError> {
    let (n, k) = (w.rows(), w.cols());
    if x.len() != m * k || out.len() != m * n {
        return Err(KernelError::Shape(format!(
            "matmul: x has {} values for {m}×{k}, out has {} for {m}×{n}",
            x.len(),
            out.len()
        )));
    }
    if m == 0 {
        return Ok(());
    }
    if m >= GEMM_MIN_ROWS {
        match w {
            Weight::F32 { data, .. } => gemm_xwt(x, m, data, n, k, out),
            Weight::Quant { .. } => {
                let dense = dequantize_all(w);
                gemm_xwt(x, m, &dense, n, k, out)
            }
        }
        return Ok(());
    }
    rowwise(x, m, w, out);
    Ok(())
}

/// Decodes the whole weight matrix to f32 in parallel.
fn dequantize_all(w: &Weight) -> Vec<f32> {
    let (n, k) = (w.rows(), w.cols());
    let mut dense = vec![0f32; n * k];
    dense
        .par_chunks_mut(k * ROWS_PER_TASK)
        .enumerate()
        .for_each(|(c, chunk)| {
            for (i, row) in chunk.chunks_mut(k).enumerate() {
                w.row_f32(c * ROWS_PER_TASK + i, row);
            }
        });
    dense
}

fn gemm_xwt(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    let threads = rayon::current_num_threads();
    let par = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the pointers cover m×n (dst), m×k (lhs) and, read as a k×n column-major matrix, n×k
    // (rhs), as the length checks in `matmul` guarantee.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// Row-parallel path: each task owns a run of output rows and writes them transposed, then the
/// result is scattered into `out`'s row-major layout (a copy of m×n floats, tiny next to W).
fn rowwise(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    // Σx per block is used only by the one-row fused Q4_1 dot.
    let xsum = if m == 1 { block_sums(x) } else { Vec::new() };
    let mut out_t = vec![0f32; n * m];
    out_t
        .par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut scratch = vec![0f32; k];
            let r0 = c * ROWS_PER_TASK;
            for (i, o) in chunk.chunks_mut(m).enumerate() {
                let r = r0 + i;
                match w {
                    Weight::F32 { data, .. } => {
                        let wr = &data[r * k..(r + 1) * k];
                        for (j, oj) in o.iter_mut().enumerate() {
                            *oj = dot_f32(wr, &x[j * k..(j + 1) * k]);
                        }
                    }
                    Weight::Quant { ty, data, .. } => {
                        let rb = data.len() / n;
                        let wr = &data[r * rb..(r + 1) * rb];
                        if m == 1 {
                            o[0] = dot_quant_row(*ty, wr, x, &xsum, &mut scratch);
                        } else {
                            dequant_row(*ty, wr, &mut scratch);
                            for (j, oj) in o.iter_mut().enumerate() {
                                *oj = dot_f32(&scratch, &x[j * k..(j + 1) * k]);
                            }
                        }
                    }
                }
            }
        });
    if m == 1 {
        out.copy_from_slice(&out_t);
    } else {
        for r in 0..n {
            for j in 0..m {
                out[j * n + r] = out_t[r * m + j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use tandem_model::quant::{quantize_q4_1, quantize_q8_0};
    use tandem_model::GgmlType;

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
    }

    fn naive(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut o = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                o[i * n + j] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum::<f64>() as f32;
            }
        }
        o
    }

    #[test]
    fn all_paths_match_naive() {
        let (n, k) = (96, 128);
        let wf = rnd(n * k, 7);
        let weights = [
            Weight::F32 {
                data: wf.clone(),
                rows: n,
                cols: k,
            },
            Weight::Quant {
                ty: GgmlType::Q4_1,
                data: quantize_q4_1(&wf),
                rows: n,
                cols: k,
            },
            Weight::Quant {
                ty: GgmlType::Q8_0,
                data: quantize_q8_0(&wf),
                rows: n,
                cols: k,
            },
        ];
        for w in &weights {
            let mut dense = vec![0f32; n * k];
            for r in 0..n {
                w.row_f32(r, &mut dense[r * k..(r + 1) * k]);
            }
            for m in [1, 2, 3, GEMM_MIN_ROWS - 1, GEMM_MIN_ROWS, 33] {
                let x = rnd(m * k, m as u64);
                let mut out = vec![0f32; m * n];
                matmul(&x, m, w, &mut out).unwrap();
                let want = naive(&x, m, &dense, n, k);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() < 1e-4 * (1.0 + b.abs()),
                        "{:?} m={m}: {a} vs {b}",
                        w.dtype()
                    );
                }
            }
        }
    }

    #[test]
    fn shape_errors() {
        let w = Weight::F32 {
            data: vec![0.0; 6],
            rows: 2,
            cols: 3,
        };
        let mut out = vec![0f32; 2];
        assert!(matmul(&[0.0; 4], 1, &w, &mut out).is_err());
    }
}

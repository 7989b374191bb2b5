//! `y = x · Wᵀ` for a batch of `m` activation rows.
//!
//! Two regimes. Few rows (decode): read every weight row once, decode it on the fly and dot it with
//! each activation row; parallel over output rows, so the weights stream through memory once per
//! step (this is the memory-bound path). Many rows (prefill): decode the weight matrix to f32 once
//! and hand it to `gemm`, which is compute-bound and blocks for the caches.

use rayon::prelude::*;

use crate::simd::{
    block_sums, dot_4x2, dot_f32, dot_quant_row, dot_quant_rows, has_fused_rows, MAX_FUSED_ROWS,
};
use crate::{KernelError, Weight};

/// Quantized weights and at least this many activation rows: decode tiles of weight rows and
/// multiply them with a GEMM ([`tiled_gemm`]). Below it, decode blocks in registers and dot them
/// with each activation row. Measured with `tandem bench engine` on a 2-core Sapphire Rapids VM
/// (Q4_1 SmolLM2, decode steps): at 8 rows 34.8 ms a step against 59.6 tiled; at 16, 85 against
/// 89; at 32, 186 against 145.
pub const TILED_MIN_ROWS: usize = 16;

/// At or above this many activation rows, decode the whole weight matrix once and run one
/// parallel GEMM over it (prefill): the decode is amortized and the GEMM blocks for the caches
/// best. Measured as above: 128-token prefill 350-400 tok/s whole against 293-301 tiled; 32-row
/// decode steps 248 ms whole against 145 tiled.
pub const GEMM_MIN_ROWS: usize = 64;

/// Dense f32 weights need no decoding: a GEMM from this many rows.
const F32_GEMM_MIN_ROWS: usize = 24;

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
    match w {
        Weight::F32 { data, .. } if m >= F32_GEMM_MIN_ROWS => gemm_xwt(x, m, data, n, k, out),
        Weight::Quant { .. } if m >= GEMM_MIN_ROWS => {
            let dense = dequantize_all(w);
            gemm_xwt(x, m, &dense, n, k, out)
        }
        Weight::Quant { .. } if m >= TILED_MIN_ROWS => tiled_gemm(x, m, w, out),
        _ => rowwise(x, m, w, out),
    }
    Ok(())
}

/// Quantized weights, many activation rows: each task decodes a tile of weight rows into an f32
/// scratch that stays in cache and multiplies all activation rows with it (a GEMM with the tile as
/// right-hand side), so the weights are decoded once per step and never written out whole.
fn tiled_gemm(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    let mut out_t = vec![0f32; n * m];
    out_t
        .par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(c, chunk)| {
            let r0 = c * ROWS_PER_TASK;
            let rows = chunk.len() / m;
            let mut tile = vec![0f32; rows * k];
            for (i, row) in tile.chunks_exact_mut(k).enumerate() {
                w.row_f32(r0 + i, row);
            }
            // dst(j, r) = chunk[r·m + j] = Σ_t x[j·k + t] · tile[r·k + t]
            // SAFETY: dst covers m×rows at (row stride 1, column stride m) = chunk; lhs m×k at
            // (k, 1) = x; rhs k×rows at (1, k) = tile.
            unsafe {
                gemm::gemm(
                    m,
                    rows,
                    k,
                    chunk.as_mut_ptr(),
                    m as isize,
                    1,
                    false,
                    x.as_ptr(),
                    1,
                    k as isize,
                    tile.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
        });
    for r in 0..n {
        for j in 0..m {
            out[j * n + r] = out_t[r * m + j];
        }
    }
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
/// One activation row: fused decode·dot straight from the quantized weights. Several: where a
/// fused multi-row kernel exists, each weight block is decoded once in registers and used for up
/// to eight activation rows; otherwise four weight rows are decoded into a scratch tile that stays
/// in L1 and dotted with the activation rows two at a time (a 4×2 register tile).
fn rowwise(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    // Σx per block is used only by the one-row fused Q4_1 dot.
    let xsum = if m == 1 { block_sums(x) } else { Vec::new() };
    let xr = |j: usize| &x[j * k..(j + 1) * k];
    let mut out_t = vec![0f32; n * m];
    out_t
        .par_chunks_mut(ROWS_PER_TASK * m)
        .enumerate()
        .for_each(|(c, chunk)| {
            let r0 = c * ROWS_PER_TASK;
            let rows = chunk.len() / m;
            if m == 1 {
                let mut scratch = vec![0f32; k];
                for (i, o) in chunk.iter_mut().enumerate() {
                    *o = match w {
                        Weight::F32 { data, .. } => {
                            dot_f32(&data[(r0 + i) * k..(r0 + i + 1) * k], x)
                        }
                        Weight::Quant { ty, data, .. } => {
                            let rb = data.len() / n;
                            let wr = &data[(r0 + i) * rb..(r0 + i + 1) * rb];
                            dot_quant_row(*ty, wr, x, &xsum, &mut scratch)
                        }
                    };
                }
                return;
            }
            match w {
                Weight::Quant { ty, data, .. } if has_fused_rows(*ty) => {
                    let rb = data.len() / n;
                    for i in 0..rows {
                        let wr = &data[(r0 + i) * rb..(r0 + i + 1) * rb];
                        let o = &mut chunk[i * m..(i + 1) * m];
                        for (j0, oj) in (0..m)
                            .step_by(MAX_FUSED_ROWS)
                            .zip(o.chunks_mut(MAX_FUSED_ROWS))
                        {
                            dot_quant_rows(*ty, wr, &x[j0 * k..(j0 + oj.len()) * k], oj);
                        }
                    }
                    return;
                }
                _ => {}
            }
            let mut tile = vec![0f32; 4 * k];
            for i0 in (0..rows).step_by(4) {
                let nr = (rows - i0).min(4);
                // The tile's rows, decoded if the weights are quantized; a short last tile repeats
                // its first row (computed, not stored).
                for t in 0..4 {
                    let r = r0 + i0 + if t < nr { t } else { 0 };
                    match w {
                        Weight::F32 { data, .. } => {
                            tile[t * k..(t + 1) * k].copy_from_slice(&data[r * k..(r + 1) * k])
                        }
                        Weight::Quant { .. } => w.row_f32(r, &mut tile[t * k..(t + 1) * k]),
                    }
                }
                let wt = [0, 1, 2, 3].map(|t| &tile[t * k..(t + 1) * k]);
                for j in (0..m).step_by(2) {
                    let j1 = (j + 1).min(m - 1);
                    let d = dot_4x2(wt, [xr(j), xr(j1)]);
                    for t in 0..nr {
                        let o = &mut chunk[(i0 + t) * m..(i0 + t + 1) * m];
                        o[j] = d[t][0];
                        o[j1] = d[t][1];
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

    fn dequantized(ty: GgmlType, ggml: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; ggml.len() / ty.bytes_for(32).unwrap() * 32];
        tandem_model::quant::dequantize(ty, ggml, &mut out).unwrap();
        out
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
        // 98 rows: the last task has 34, so its last 4-row tile is short.
        let (n, k) = (98, 128);
        let wf = rnd(n * k, 7);
        let weights = [
            Weight::F32 {
                data: wf.clone(),
                rows: n,
                cols: k,
            },
            Weight::quant(GgmlType::Q4_1, &quantize_q4_1(&wf), n, k).unwrap(),
            Weight::quant(GgmlType::Q8_0, &quantize_q8_0(&wf), n, k).unwrap(),
        ];
        for w in &weights {
            // The reference decodes GGML's own layout, so the kernels' layout is checked too.
            let dense = match w.dtype() {
                GgmlType::F32 => wf.clone(),
                GgmlType::Q4_1 => dequantized(GgmlType::Q4_1, &quantize_q4_1(&wf)),
                ty => dequantized(ty, &quantize_q8_0(&wf)),
            };
            for r in 0..n {
                let mut row = vec![0f32; k];
                w.row_f32(r, &mut row);
                assert_eq!(row, dense[r * k..(r + 1) * k], "{:?} row {r}", w.dtype());
            }
            for m in [
                1,
                2,
                3,
                9,
                TILED_MIN_ROWS - 1,
                TILED_MIN_ROWS,
                33,
                GEMM_MIN_ROWS,
            ] {
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

//! `y = x · Wᵀ` for a batch of `m` activation rows.
//!
//! Every regime is parallel over runs of weight rows (output columns), so each weight is read and
//! decoded once per call and no task waits on another:
//! - one activation row (batch-1 decode): fused decode·dot straight from the quantized bytes;
//! - a few rows (batched decode): each weight block decoded once in registers, used for every row;
//! - many rows (big batches, prefill): a tile of weight rows decoded to f32 in cache and multiplied
//!   through a 4×4 register tile, activation rows blocked so tile and block share L2.
//!
//! Dense f32 weights with many rows go to the `gemm` crate.

use rayon::prelude::*;

use crate::simd::{
    block_sums, dot_f32, dot_quant_row, dot_quant_rows, has_fused_rows, pack_panels,
    pack_panels_into, panel_matmul, panel_rows, HALF_PANEL, MAX_FUSED_ROWS, PANEL,
};
use crate::{KernelError, Weight};

/// Quantized weights and at least this many activation rows: decode tiles of weight rows and
/// multiply them with activation panels ([`tiled`]); from 2 rows up to it, decode blocks in
/// registers and dot them with each activation row ([`fused_rows`]). A tiled product costs a
/// whole panel (16 rows, or 32 above 16) whatever the rows, so fused wins while rows are few.
/// Measured on a 2-core Zen 5 VM, all 30 layers of the Q4_1 SmolLM2 projections, two threads:
/// fused 8 rows 11–13 ms, 12 rows 19–20, 16 rows 24–25, 20 rows 34–35; tiled 19–22 ms up to 16
/// rows and 26–28 ms from 17 to 24. Tiled also serves prefill, without the whole-matrix f32 copy
/// a GEMM library would need.
pub const TILED_MIN_ROWS: usize = 13;

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
        _ if m == 1 => one_row(x, w, out),
        Weight::Quant { ty, .. } if m < TILED_MIN_ROWS && has_fused_rows(*ty) => {
            fused_rows(x, m, w, out)
        }
        _ => tiled(x, m, w, out),
    }
    Ok(())
}

thread_local! {
    /// Decoded weight tile of [`tiled`], reused by every task this thread runs.
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out` shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: tasks write disjoint elements (each owns a run of output columns) and the pointer does
// not outlive the `&mut` it came from (the parallel loop ends before `tiled` returns).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i` is inside the output and no other task writes it.
    pub(crate) unsafe fn at(&self, i: usize) -> *mut f32 {
        self.0.add(i)
    }
}

/// Several activation rows: each task owns a run of weight rows ([`task_rows`]), decodes them
/// (if quantized) into an f32 tile that stays in cache, and multiplies every activation row with
/// it through a 4×4 register tile. The weights are read and decoded once per call, never written
/// out whole.
fn tiled(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let k = w.cols();
    // Activations packed once, k-major in panels; every task streams them. A product of few rows
    // takes the narrow panel, so no more than it has are computed.
    let width = if m <= HALF_PANEL { HALF_PANEL } else { PANEL };
    let panels = m.div_ceil(width);
    let len = panels * k * width;
    PACKED.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < len {
                buf.resize(len, 0.0);
            }
            pack_panels_into(x, m, k, width, &mut buf[..len]);
            tiled_packed(&buf[..len], m, width, w, out);
        }
        // This thread is already inside a product (it stole another engine's step while
        // waiting): a buffer of its own.
        Err(_) => tiled_packed(&pack_panels(x, m, k, width), m, width, w, out),
    });
}

thread_local! {
    /// Packed activations of [`tiled`], kept by the calling thread between products: a prefill's
    /// panels are megabytes, and a fresh allocation per product is fresh pages to fault in and zero.
    static PACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`tiled`] over activations already packed in panels of `width` rows.
fn tiled_packed(packed: &[f32], m: usize, width: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    let panels = m.div_ceil(width);
    let tile_rows = panel_rows();
    let dst = OutPtr(out.as_mut_ptr());
    let per_task = task_rows(n, tile_rows);
    (0..n.div_ceil(per_task)).into_par_iter().for_each(|c| {
        let r0 = c * per_task;
        let rows = per_task.min(n - r0);
        let multiply = |tile: &[f32]| {
            // One panel's results for this task's rows, written out a row at a time. The
            // kernels store a column per weight row; into `out` directly those stores would
            // be n floats apart, which for n a multiple of 1024 puts all 32 of a column in one
            // L1 set (the 3072-row gate/up product ran at half speed).
            let mut block = [0f32; PANEL * ROWS_PER_TASK];
            for p in 0..panels {
                let panel = &packed[p * k * width..(p + 1) * k * width];
                let cols = (m - p * width).min(width);
                for i0 in (0..rows).step_by(tile_rows) {
                    let nr = (rows - i0).min(tile_rows);
                    // SAFETY: tile rows i0..i0+nr exist; the written elements (columns
                    // i0.. +nr of rows ..cols) are inside `block`.
                    unsafe {
                        panel_matmul(
                            tile.as_ptr().add(i0 * k),
                            nr,
                            k,
                            panel,
                            width,
                            block.as_mut_ptr().add(i0),
                            ROWS_PER_TASK,
                            cols,
                        )
                    };
                }
                for (j, res) in block.chunks_exact(ROWS_PER_TASK).take(cols).enumerate() {
                    // SAFETY: activation row p·width+j < m and weight rows r0.. +rows < n:
                    // inside m×n, and this task's own columns.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            res.as_ptr(),
                            dst.at((p * width + j) * n + r0),
                            rows,
                        )
                    };
                }
            }
        };
        match w {
            Weight::F32 { data, .. } => multiply(&data[r0 * k..(r0 + rows) * k]),
            // The decoded tile lives in a per-thread buffer: allocating it per task would
            // map and unmap pages (and shoot down TLBs on every core) thousands of times a step.
            Weight::Quant { .. } => TILE.with(|t| {
                let mut t = t.borrow_mut();
                if t.len() < rows * k {
                    t.resize(rows * k, 0.0);
                }
                for (i, row) in t[..rows * k].chunks_exact_mut(k).enumerate() {
                    w.row_f32(r0 + i, row);
                }
                multiply(&t[..rows * k]);
            }),
        }
    });
}

/// Output rows per task for a product of `n` rows taken `unit` at a time (a register tile, or one
/// row): whole units, at most [`ROWS_PER_TASK`] rows, and of the sizes that allows, the one whose
/// tasks, dealt out evenly over the pool's threads, leave the busiest thread the least work
/// (the largest on a tie). With 64 rows a task, the 576-row projections made 9 tasks, 5 on one of
/// two threads and 4 on the other; 48 rows make 12, 6 each (the 30 layers' o and down products
/// 5.2 → 4.6 ms and 14.0 → 12.4 ms on a 2-core Zen 3, 32 activation rows).
fn task_rows(n: usize, unit: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let units = n.div_ceil(unit);
    let busiest = |per: usize| units.div_ceil(per).div_ceil(threads) * per;
    (1..=(ROWS_PER_TASK / unit).max(1))
        .rev()
        .min_by_key(|&per| busiest(per))
        .expect("at least one size")
        * unit
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

/// One activation row: each task owns a run of output rows and dots them straight from the
/// (quantized) weights with the fused decode·dot kernels.
fn one_row(x: &[f32], w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    // Σx per block, for the fused Q4_1 dot.
    let xsum = block_sums(x);
    let per_task = task_rows(n, 1);
    out.par_chunks_mut(per_task)
        .enumerate()
        .for_each(|(c, chunk)| {
            let r0 = c * per_task;
            let mut scratch = vec![0f32; k];
            for (i, o) in chunk.iter_mut().enumerate() {
                *o = match w {
                    Weight::F32 { data, .. } => dot_f32(&data[(r0 + i) * k..(r0 + i + 1) * k], x),
                    Weight::Quant { ty, data, .. } => {
                        let rb = data.len() / n;
                        let wr = &data[(r0 + i) * rb..(r0 + i + 1) * rb];
                        dot_quant_row(*ty, wr, x, &xsum, &mut scratch)
                    }
                };
            }
        });
}

/// A few activation rows: each weight block is decoded once, in registers, and used for up to
/// [`MAX_FUSED_ROWS`] activation rows; nothing is written but the outputs.
fn fused_rows(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.rows(), w.cols());
    let Weight::Quant { ty, data, .. } = w else {
        unreachable!("fused rows are for quantized weights")
    };
    let rb = data.len() / n;
    let dst = OutPtr(out.as_mut_ptr());
    let per_task = task_rows(n, 1);
    (0..n.div_ceil(per_task)).into_par_iter().for_each(|c| {
        let r0 = c * per_task;
        let mut o = [0f32; MAX_FUSED_ROWS];
        for r in r0..(r0 + per_task).min(n) {
            let wr = &data[r * rb..(r + 1) * rb];
            for j0 in (0..m).step_by(MAX_FUSED_ROWS) {
                let nc = (m - j0).min(MAX_FUSED_ROWS);
                dot_quant_rows(*ty, wr, &x[j0 * k..(j0 + nc) * k], &mut o[..nc]);
                for (u, v) in o[..nc].iter().enumerate() {
                    // SAFETY: (j0+u, r) is inside m×n and row r belongs to this task.
                    unsafe { *dst.at((j0 + u) * n + r) = *v };
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use tandem_model::{quantize_q4_1, quantize_q8_0, GgmlType};

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
    }

    fn dequantized(ty: GgmlType, ggml: &[u8]) -> Vec<f32> {
        let mut out = vec![0f32; ggml.len() / ty.bytes_for(32).unwrap() * 32];
        tandem_model::dequantize(ty, ggml, &mut out).unwrap();
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
            for m in [1, 2, 3, 9, TILED_MIN_ROWS - 1, TILED_MIN_ROWS, 33, 70] {
                let x = rnd(m * k, m as u64);
                // Poisoned, so an element no path writes fails.
                let mut out = vec![f32::NAN; m * n];
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
    fn tasks_share_out_evenly() {
        let pool = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
        };
        // (rows, unit, threads, rows a task)
        for (n, unit, threads, want) in [
            (576, 6, 2, 48),  // 12 tasks, 6 a thread (64 rows: 9 tasks, 5 and 4)
            (3072, 6, 2, 48), // 64 tasks of 8 tiles, 256 a thread (10 tiles: 52 tasks, 260)
            (576, 1, 2, 48),  // one row at a time: 12 tasks of 48
            (576, 6, 16, 36), // 16 tasks, one a thread
            (5, 6, 2, 6),     // a single short tile
            (1024, 1, 1, 64), // one thread: the largest tasks that cover it exactly
        ] {
            let got = pool(threads).install(|| task_rows(n, unit));
            assert_eq!(got, want, "n={n} unit={unit} threads={threads}");
            assert!(got % unit == 0 && got <= ROWS_PER_TASK.max(unit));
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

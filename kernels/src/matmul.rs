//! `y = x · Wᵀ` for a batch of `m` activation rows.
//!
//! **Batch-invariant.** Every output element is one dot product taken in one fixed order (see
//! [`crate::simd::dot_tile`]: eight lanes at AVX2, sixteen at AVX-512, each an FMA chain over the
//! columns in order, reduced by one fixed tree), whatever `m` is, whichever rows share its register
//! tile and however the work is split among threads. A row's outputs are therefore the same bits
//! alone or in a batch of 64, in a prefill chunk or a decode step: what makes a seeded request give
//! the same samples whatever else is running. (The earlier kernels took each regime its own way: a
//! fused `d·Σq·x + m·Σx` dot for one row, two chains per row for a few, a chain per output for
//! many, the `gemm` crate for dense weights and AMX tiles above 16 rows; each gave other bits.)
//!
//! The work is parallel over runs of weight rows (output columns), so each weight is read and
//! decoded once per call and no task waits on another. A task decodes its quantized rows to f32
//! in a per-thread tile (a few rows at a time for few activation rows, so they stay in L1; the
//! whole run for many, so the activations stream past a tile in L2) and multiplies through
//! [`dot_tile`]. Dense f32 weights are multiplied in place.

use rayon::prelude::*;

use crate::simd::{dot_quant_x1, dot_tile, dot_tile_span, has_quant_x1, has_spans, tile, TILE_R1};
use crate::{KernelError, Weight};

/// Output rows per rayon task: large enough to amortize scheduling, small enough to balance two
/// to a few dozen cores.
const ROWS_PER_TASK: usize = 64;

/// Activation rows up to which a task decodes its weight rows [`SMALL_DECODE`] at a time (the
/// decoded rows are used at once, from L1); above, the task's whole run is decoded first and the
/// activations, in blocks of the level's [`tile`] rows, pass over it.
const SMALL_M: usize = 8;

/// Weight rows decoded at a time for few activation rows: 12 rows of 1536 floats are 72 KiB,
/// of 576 are 27 KiB.
const SMALL_DECODE: usize = 12;

/// Most columns a tile takes at a time where the level has [`dot_tile_span`]s (AVX2 and up).
/// A block of 6 activation rows (AVX-512's tile) of the down product's 1536 columns is 36 KiB
/// and each weight tile (24 KiB) evicted it from L1; in two spans of 768 it is 18 KiB and stays.
/// The down product of 512 rows on a 2-core Zen 5: 84 -> 70 ms (spans of 384: 75 ms). AVX2's
/// 4-row blocks (24 KiB whole) gain about 2% there, where L1 is 48 KiB (Zen 3's is 32). k up to
/// 768 (q, k, v, o, gate, up) takes one span, as before.
const SPAN: usize = 768;

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
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let dst = OutPtr(out.as_mut_ptr());
    // Tasks own whole register tiles of weight rows: a multiple of both tile widths.
    let per_task = task_rows(n, task_unit());
    (0..n.div_ceil(per_task)).into_par_iter().for_each(|c| {
        let r0 = c * per_task;
        let rows = per_task.min(n - r0);
        match w {
            Weight::F32 { data, .. } => {
                // SAFETY: rows r0.. +rows of `data` hold k values each; this task's outputs
                // are columns r0.. +rows of every row of `out`.
                unsafe { multiply(x, m, data[r0 * k..].as_ptr(), rows, k, dst, n, r0) }
            }
            // One activation row (a decode step of one sequence): each weight block decoded in
            // registers and used at once, the bits of the decoded rows' dot_tile.
            Weight::Quant { ty, data, .. } if m == 1 && has_quant_x1(*ty) => {
                let rb = data.len() / n;
                // SAFETY: outputs r0.. +rows of the one row are this task's.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.at(r0), rows) };
                dot_quant_x1(*ty, &data[r0 * rb..(r0 + rows) * rb], rb, x, o);
            }
            // The decoded tile lives in a per-thread buffer: allocating it per task would map
            // and unmap pages (and shoot down TLBs on every core) thousands of times a step.
            Weight::Quant { .. } => TILE.with(|t| {
                let mut t = t.borrow_mut();
                let chunk = if m <= SMALL_M { SMALL_DECODE } else { rows };
                if t.len() < chunk * k {
                    t.resize(chunk * k, 0.0);
                }
                for i0 in (0..rows).step_by(chunk) {
                    let nr = chunk.min(rows - i0);
                    for (i, row) in t[..nr * k].chunks_exact_mut(k).enumerate() {
                        w.row_f32(r0 + i0 + i, row);
                    }
                    // SAFETY: the tile holds nr decoded rows of k; the outputs are this task's.
                    unsafe { multiply(x, m, t.as_ptr(), nr, k, dst, n, r0 + i0) }
                }
            }),
        }
    });
    Ok(())
}

/// Columns `c0.. +rows` of `out` (m × n): the `m` activation rows of `x` against `rows` weight
/// rows of `k` at `w`, activation rows outermost in blocks of the [`tile`]'s, so a block stays in
/// L1 while the weight rows pass (in spans of columns where rows are long, see [`SPAN`]).
///
/// # Safety
/// `w` holds `rows` rows of `k`; columns `c0.. +rows` of `out` belong to the caller's task.
#[allow(clippy::too_many_arguments)]
unsafe fn multiply(
    x: &[f32],
    m: usize,
    w: *const f32,
    rows: usize,
    k: usize,
    dst: OutPtr,
    n: usize,
    c0: usize,
) {
    let (tile_m, tile_r) = tile();
    let step = if m == 1 { TILE_R1 } else { tile_r };
    // The activation rows in blocks as even as the tile allows (32 rows at 6: 6, 6, 5, 5, 5, 5,
    // not five of 6 and one of 2, whose short tile loads a weight vector for two multiply-adds).
    let blocks = m.div_ceil(tile_m);
    let spans = if m > 1 && has_spans() {
        (k / 16).div_ceil(SPAN / 16)
    } else {
        1
    };
    let mut a0 = 0;
    for b in 0..blocks {
        let ma = m / blocks + usize::from(b < m % blocks);
        if spans > 1 {
            // Columns in spans of at most SPAN (multiples of 16; the last takes k's tail), each
            // across all the run's weight rows, the lanes carried between spans per tile.
            let span = (k / 16).div_ceil(spans) * 16;
            STATE.with(|s| {
                let mut s = s.borrow_mut();
                let per_tile = ma * step * 16;
                let need = rows.div_ceil(step) * per_tile;
                if s.len() < need {
                    s.resize(need, 0.0);
                }
                for t0 in (0..k).step_by(span) {
                    let t1 = if t0 + span >= k / 16 * 16 {
                        k
                    } else {
                        t0 + span
                    };
                    for (j, i0) in (0..rows).step_by(step).enumerate() {
                        dot_tile_span(
                            x.as_ptr().add(a0 * k),
                            k,
                            ma,
                            w.add(i0 * k),
                            k,
                            step.min(rows - i0),
                            t0,
                            t1,
                            k,
                            s.as_mut_ptr().add(j * per_tile),
                            dst.at(a0 * n + c0 + i0),
                            n,
                        );
                    }
                    if t1 == k {
                        break;
                    }
                }
            });
            a0 += ma;
            continue;
        }
        for i0 in (0..rows).step_by(step) {
            let nr = step.min(rows - i0);
            dot_tile(
                x.as_ptr().add(a0 * k),
                k,
                ma,
                w.add(i0 * k),
                k,
                nr,
                k,
                dst.at(a0 * n + c0 + i0),
                n,
            );
        }
        a0 += ma;
    }
}

thread_local! {
    /// Decoded weight rows of a task, reused by every task this thread runs.
    static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The lanes of a block of activation rows against a task's weight rows, between spans.
    static STATE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `out` shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: tasks write disjoint elements (each owns a run of output columns) and the pointer does
// not outlive the `&mut` it came from (the parallel loop ends before `matmul` returns).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// # Safety
    /// `i` is inside the output and no other task writes it.
    pub(crate) unsafe fn at(&self, i: usize) -> *mut f32 {
        self.0.add(i)
    }
}

/// The weight rows a task's share is a multiple of: the least that both the one-row tile
/// ([`TILE_R1`]) and this level's [`tile`] divide (6 at AVX2, 12 at AVX-512).
fn task_unit() -> usize {
    let r = tile().1;
    let gcd = |mut a: usize, mut b: usize| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    TILE_R1 / gcd(TILE_R1, r) * r
}

/// Output rows per task for a product of `n` rows taken `unit` at a time (a register tile, or one
/// row): whole units, at most [`ROWS_PER_TASK`] rows, and of the sizes that allows, the one whose
/// tasks, dealt out evenly over the pool's threads, leave the busiest thread the least work
/// (the largest on a tie). With 64 rows a task, the 576-row projections made 9 tasks, 5 on one of
/// two threads and 4 on the other; 48 rows make 12, 6 each (the 30 layers' o and down products
/// 5.2 → 4.6 ms and 14.0 → 12.4 ms on a 2-core Zen 3, 32 activation rows). The split changes
/// which thread computes an output, never how.
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
            for m in [1, 2, 3, 5, 9, 12, 13, 33, 70] {
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

    /// The batch-invariance promise: a row's outputs are the same bits alone, among any number
    /// of other rows in any position, and whatever the thread count, for every weight format.
    #[test]
    fn a_rows_outputs_do_not_depend_on_the_batch_or_the_threads() {
        let pool = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(41);
        // 100 rows (tasks end mid-tile), k a multiple of 32 for the quantized formats (75
        // blocks: past the one-row kernel's run of 64 blocks' scales, not a multiple of 8, and
        // taken in spans at AVX-512); the f32 weight also with k = 37 (a tail past the last 8
        // lanes) and k = 1601 (spans and a tail).
        for (fmt, k) in [
            (0, 96),
            (0, 37),
            (0, 1601),
            (1, 96),
            (2, 128),
            (1, 2400),
            (2, 2400),
        ] {
            let n = 100;
            let wf = rnd(n * k, 3 + k as u64);
            let w = match fmt {
                0 => Weight::F32 {
                    data: wf,
                    rows: n,
                    cols: k,
                },
                1 => Weight::quant(GgmlType::Q4_1, &quantize_q4_1(&wf), n, k).unwrap(),
                _ => Weight::quant(GgmlType::Q8_0, &quantize_q8_0(&wf), n, k).unwrap(),
            };
            let probe = rnd(k, 99);
            let mut alone = vec![0f32; n];
            matmul(&probe, 1, &w, &mut alone).unwrap();
            for trial in 0..12 {
                let m = rng.gen_range(1..=70);
                let at = rng.gen_range(0..m);
                let mut x = rnd(m * k, 1000 + trial);
                x[at * k..(at + 1) * k].copy_from_slice(&probe);
                let threads = [1, 2, 3][trial as usize % 3];
                let mut out = vec![f32::NAN; m * n];
                pool(threads).install(|| matmul(&x, m, &w, &mut out).unwrap());
                let got = &out[at * n..(at + 1) * n];
                for (j, (a, b)) in got.iter().zip(&alone).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{:?} k={k}: output {j} of row {at} among {m} on {threads} threads: {a} vs {b} alone",
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

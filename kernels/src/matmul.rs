//! `y = x · Wᵀ` for a batch of `m` activation rows.
//!
//! **Batch-invariant.** Every output is one chain of multiply-adds over the columns in order
//! ([`crate::simd::panel_product`]), whatever `m` is, whichever rows and outputs share its
//! register tile and however the work is split among threads. A row's outputs are therefore the
//! same bits alone or in a batch of 64, in a prefill chunk or a decode step: what makes a seeded
//! request give the same samples whatever else is running. And since no sum crosses vector
//! lanes, the AVX2 and AVX-512 levels give the same bits too.
//!
//! The work is parallel over runs of weight rows (output columns), whole panels of sixteen, so
//! each weight is read and decoded once per call and no task waits on another. A task decodes
//! its panels to f32 in a per-thread tile, column after column (a few columns at a time for few
//! activation rows, so they stay in L1; all of them for many, so the activations stream past a
//! tile in L2), and multiplies through [`panel_product`]. A few activation rows against
//! quantized panels decode in registers instead ([`crate::simd::dot_quant_rows`], the same
//! bits).

use rayon::prelude::*;

use crate::aligned::AlignedF32;
use crate::simd::{
    dot_quant_rows, fused_rows, has_avx2_fma, has_avx512, has_quant_x1, panel_product, x1_unit,
    MAX_PANELS, PANEL,
};
use crate::{KernelError, Weight};

/// Output rows per rayon task, at most: whole panels, as many as a register tile takes (four
/// at AVX-512), enough to amortize scheduling, few enough to balance two to a few dozen cores.
const ROWS_PER_TASK: usize = MAX_PANELS * PANEL;

/// At AVX-512, groups of [`fused_rows`] (8) activation rows up to which a quantized product
/// decodes in registers, group after group, rather than into a tile (AVX2: see
/// [`AVX2_FUSED_MOST`]). The model's decode steps on 2 cores of Zen 5 (AVX-512), tile
/// against groups: 12 rows 19.5 and 14.7 ms, 16 rows 23.7 and 17.8, 24 rows 32.0 and 27.6, 32
/// rows 39.4 and 39.0. On 2 cores of an Intel Xeon (AVX-512, `decode_matmul`, 2026-12-05,
/// after the tile's aligned panels and four-column turns): 12 rows 19.4-20.8 and 17.4-17.8,
/// 16 rows 23.3-26.4 and 21.0-21.3, 18-22 rows within 5% either way, 24 rows 29.6-31.3 and
/// 31.8-32.9, 26-28 rows 31.5-36.9 and 35.1-39.9, 32 rows 36.0-38.3 and 42.7-42.9. Three
/// groups: Intel favours the tile from 24 rows on (by 5% at 24, 8-16% above), Zen 5 groups at
/// 24 (by 14%, before the tile's changes) and neither at 32; 25-31 rows were not measured on
/// Zen 5 with the faster tile.
const FUSED_GROUPS: usize = 3;

/// Activation rows up to which AVX2 (whose fused kernel takes four, see [`fused_rows`]) decodes
/// in registers: in `⌈m/4⌉` groups as even as can be (5 rows 3 + 2, 6 3 + 3, 7 4 + 3, 8 4 + 4).
/// The model's decode-step products on a 2-core Zen 3 (`decode_matmul`, 2026-12-07, after the
/// four-row kernel stopped copying its scales through the stack, two rounds alternated, the
/// weights in cache): 5 rows in threes 10.2-10.3 ms, through the tile 9.7, 4 + 1 11.0; 6 rows in
/// threes 11.3, tile 10.7-11.0, 4 + 2 11.8-12.0; 7 rows tile 14.1-14.2, 4 + 3 12.7; 8 rows tile
/// 14.1-14.3, fours 14.0; from memory (with the head) 7 rows tile 18.8-19.1 against 16.1-16.8 in
/// 4 + 3, 8 rows 19.1-19.2 against 17.7-18.0 in fours. On Zen 4 at AVX2 (three rounds, before
/// that change, when four rows cost 1.3-1.4x three): 5 rows through the tile 17.0-23.6 ms, in
/// threes 14.9-16.4, 4 + 1 19.3-20.5; 6 rows 15.9-19.9, in threes 14.8-16.5, in twos 17.7-30.6;
/// 8 rows 22.6-24.1, in fours 25.2-26.7. From memory on the Zen 3 (with the head) five rows took
/// 12.9-13.0 ms in threes against 13.5 through the tile, six 14.2-14.5 against 14.8-15.3. So five
/// and six rows stay in threes, and seven and eight go in fours. Decode in the
/// engine on that Zen 3 (`tandem bench engine --batch B --prompt-len 64 --gen-len 64`, two
/// rounds alternated with the build before, tok/s): batch 4 286-300 against 331, 7 300-312
/// against 363-367 (then through the tile), 8 330-350 against 366-374.
const AVX2_FUSED_MOST: usize = 8;

/// The rows of each group in which a quantized product of `m` activation rows decodes in
/// registers, or `None` where it goes through a decoded tile.
fn fused_group(m: usize) -> Option<usize> {
    let r = fused_rows();
    if has_avx512() {
        (m <= FUSED_GROUPS * r).then_some(r)
    } else if has_avx2_fma() {
        avx2_group(m, r)
    } else {
        None
    }
}

/// AVX2's [`fused_group`] for `m` rows where its kernel takes `r`.
fn avx2_group(m: usize, r: usize) -> Option<usize> {
    (m <= AVX2_FUSED_MOST).then(|| m.div_ceil(m.div_ceil(r).max(1)))
}

/// Activation rows up to which a task decodes its panels [`SPAN`] columns at a time (used at
/// once, from L1); above, all the columns first, and the activations pass over them.
const SMALL_M: usize = 8;

/// Columns decoded at a time for few activation rows (a multiple of the 32-value blocks): four
/// panels of 128 columns are 32 KiB. 4 rows through the model's products on Zen 5: 64 columns
/// 3.5 ms (AVX-512) and 6.0 ms (AVX2), 128 3.3 and 5.7, 256 3.7 and 5.8.
const SPAN: usize = 128;

/// `out[m×n] = x[m×k] · Wᵀ` where `W` is `n×k`.
pub fn matmul(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) -> Result<(), KernelError> {
    matmul_many(&mut [Product { x, m, w, out }])
}

/// One product of [`matmul_many`]: `out[m×n] = x[m×k] · Wᵀ`.
pub struct Product<'a> {
    /// `m` activation rows of `w.cols()` values.
    pub x: &'a [f32],
    /// Activation rows.
    pub m: usize,
    /// The weight.
    pub w: &'a Weight,
    /// `m` rows of `w.rows()` outputs.
    pub out: &'a mut [f32],
}

/// A task of one product: its activations, a weight (a part of a stacked one), its rows of that
/// part (from `r0`, whole panels), where its first row's first output goes and the output's
/// row length.
struct Task<'a> {
    x: &'a [f32],
    m: usize,
    w: &'a Weight,
    r0: usize,
    rows: usize,
    dst: OutPtr,
    n: usize,
}

/// Several products in one parallel pass: their tasks dealt out together, so that many small
/// products (a mixture of experts' experts) cost one fork and join instead of one each. Each
/// output has the bits [`matmul`] gives it alone.
pub fn matmul_many(products: &mut [Product<'_>]) -> Result<(), KernelError> {
    let mut tasks: Vec<Task<'_>> = Vec::new();
    for p in products.iter_mut() {
        let (m, w) = (p.m, p.w);
        let (n, k) = (w.rows(), w.cols());
        if p.x.len() != m * k || p.out.len() != m * n {
            return Err(KernelError::Shape(format!(
                "matmul: x has {} values for {m}×{k}, out has {} for {m}×{n}",
                p.x.len(),
                p.out.len()
            )));
        }
        if m == 0 || n == 0 {
            continue;
        }
        if k == 0 {
            p.out.fill(0.0);
            continue;
        }
        let dst = OutPtr(p.out.as_mut_ptr());
        // Whole panels a task; for one row against panels decoded in registers, shares of
        // the size that schedules best (see `x1_unit`). Parts of a stacked weight of several
        // types share the pass.
        let unit = |w: &Weight| match w {
            Weight::Quant { ty, .. } if m == 1 && has_quant_x1(*ty) => x1_unit() * PANEL,
            _ => PANEL,
        };
        for (base, part) in w.parts() {
            let per_task = task_rows(part.rows(), unit(part));
            for c in 0..part.rows().div_ceil(per_task) {
                let r0 = c * per_task;
                tasks.push(Task {
                    x: p.x,
                    m,
                    w: part,
                    r0,
                    rows: per_task.min(part.rows() - r0),
                    // SAFETY: column base + r0 of row 0 is inside the output.
                    dst: OutPtr(unsafe { dst.at(base + r0) }),
                    n,
                });
            }
        }
    }
    tasks.into_par_iter().for_each(run);
    Ok(())
}

/// `out[m×ff] = silu(x·Gᵀ) · (x·Uᵀ)`, where `w` stacks the gate rows `G` (`0..ff`) over the up
/// rows `U` (`ff..2ff`): [`matmul`] and then [`crate::ops::silu_mul_to`] of each row's halves,
/// the same bits, in one pass. Each task takes a run of gate rows and the matching up rows,
/// multiplies both into a buffer of its thread (in L2) and writes only the activations, so the
/// `m × 2ff` product never goes out to memory and back (at 512 rows of the default model it is
/// 6.3 MB a layer, which the separate pass read back from L3). Where a run of gate or up rows
/// would not start a panel (`ff` not a multiple of 16 in one weight) it runs as two passes.
pub fn matmul_silu(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) -> Result<(), KernelError> {
    let (n, k) = (w.rows(), w.cols());
    let ff = n / 2;
    if !n.is_multiple_of(2) || x.len() != m * k || out.len() != m * ff {
        return Err(KernelError::Shape(format!(
            "matmul_silu: x has {} values for {m}×{k}, out has {} for {m}×{ff}, the weight {n} rows",
            x.len(),
            out.len()
        )));
    }
    if m == 0 || ff == 0 {
        return Ok(());
    }
    // The part that holds rows `r..r + rows` of `w`, and their first row in it, where it starts
    // a panel.
    let parts = w.parts();
    let part_at = |r: usize, rows: usize| {
        let &(base, part) = parts.iter().rev().find(|(base, _)| *base <= r)?;
        let local = r - base;
        (local.is_multiple_of(PANEL) && local + rows <= part.rows()).then_some((part, local))
    };
    let unit = match w {
        Weight::Quant { ty, .. } if m == 1 && has_quant_x1(*ty) => x1_unit() * PANEL,
        _ => PANEL,
    };
    let per_task = task_rows(ff, unit);
    let runs: Option<Vec<_>> = (0..ff.div_ceil(per_task))
        .map(|c| {
            let (r0, rows) = (c * per_task, per_task.min(ff - c * per_task));
            Some((r0, rows, part_at(r0, rows)?, part_at(ff + r0, rows)?))
        })
        .collect();
    let Some(runs) = runs else {
        let mut gate_up = vec![0f32; m * n];
        matmul(x, m, w, &mut gate_up)?;
        silu_rows(&gate_up, ff, out);
        return Ok(());
    };
    let dst = OutPtr(out.as_mut_ptr());
    runs.into_par_iter()
        .for_each(|(r0, rows, (gw, g0), (uw, u0))| {
            GATE_UP.with(|buf| {
                let mut buf = buf.borrow_mut();
                if buf.len() < 2 * m * rows {
                    buf.resize(2 * m * rows, 0.0);
                }
                let (g, u) = buf[..2 * m * rows].split_at_mut(m * rows);
                for (w, r0, o) in [(gw, g0, &mut *g), (uw, u0, &mut *u)] {
                    let dst = OutPtr(o.as_mut_ptr());
                    run(Task {
                        x,
                        m,
                        w,
                        r0,
                        rows,
                        dst,
                        n: rows,
                    });
                }
                for i in 0..m {
                    let at = i * rows..(i + 1) * rows;
                    // SAFETY: columns r0.. +rows of each row are this run's alone.
                    let o = unsafe { std::slice::from_raw_parts_mut(dst.at(i * ff + r0), rows) };
                    crate::simd::silu_mul_to(&g[at.clone()], &u[at], o);
                }
            })
        });
    Ok(())
}

/// Activation rows from which [`crate::Linear::matmul_silu`] takes [`matmul_silu`]'s one pass
/// over the product and a separate silu·mul: below, gate|up (at most 8 rows of 2·1536 values
/// for the default model, 98 KiB) stays in L2 between the passes, and the decode kernels' task
/// sizes were tuned for the product alone. The model's 512-token prefill on a 2-core Zen 4
/// (`tandem bench engine --profile`, six rounds alternated): gate|up and silu·mul
/// 251.9-283.6 ms in two passes, 241.3-259.7 in one; the prefill 799-882 tok/s and 842-906.
pub(crate) const MATMUL_SILU_MIN_ROWS: usize = SMALL_M + 1;

/// `out = silu(gate) · up` of rows of [gate | up], `ff` wide each half, [`SILU_ROWS`] rows a
/// task: the separate pass of a product and silu·mul (each value [`crate::ops::silu_mul_to`]'s,
/// so the bits of [`matmul_silu`]'s one pass). Panics where `gate_up` is not twice `out`, or
/// `out` not whole rows of `ff`.
pub fn silu_rows(gate_up: &[f32], ff: usize, out: &mut [f32]) {
    assert!(
        gate_up.len() == 2 * out.len() && (ff > 0 || out.is_empty()),
        "silu_rows: {} gate|up values for {} outputs",
        gate_up.len(),
        out.len()
    );
    if out.is_empty() {
        return;
    }
    assert!(
        out.len().is_multiple_of(ff),
        "silu_rows: {} outputs are not rows of {ff}",
        out.len()
    );
    gate_up
        .par_chunks(SILU_ROWS * 2 * ff)
        .zip(out.par_chunks_mut(SILU_ROWS * ff))
        .for_each(|(g, o)| {
            for (g, o) in g.chunks_exact(2 * ff).zip(o.chunks_exact_mut(ff)) {
                crate::simd::silu_mul_to(&g[..ff], &g[ff..], o);
            }
        });
}

/// Rows a task of [`silu_rows`] takes.
const SILU_ROWS: usize = 16;

thread_local! {
    /// A task's gate and up outputs in [`matmul_silu`], reused by every task this thread runs.
    static GATE_UP: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One task: `rows` outputs of every activation row, from weight row `r0` of its part.
fn run(t: Task<'_>) {
    let Task {
        x,
        m,
        w,
        r0,
        rows,
        dst,
        n,
    } = t;
    let k = w.cols();
    let (p0, np) = (r0 / PANEL, rows.div_ceil(PANEL));
    let group = match w {
        Weight::Quant { ty, .. } if has_quant_x1(*ty) => fused_group(m),
        _ => None,
    };
    match (w, group) {
        // A few activation rows (decode steps of few sequences, an expert's rows): each panel
        // block decoded in registers once for all of them and used at once; a few times as
        // many in groups, each group decoding the task's panels again (from L1 and L2: a
        // task's panels are tens of KiB).
        (Weight::Quant { ty, data, .. }, Some(group)) => {
            let k = w.cols();
            for g0 in (0..m).step_by(group) {
                let mg = group.min(m - g0);
                // SAFETY: outputs 0.. rows of every row (n apart) from dst are this task's.
                unsafe {
                    dot_quant_rows(
                        *ty,
                        data,
                        w.rows(),
                        p0,
                        &x[g0 * k..(g0 + mg) * k],
                        mg,
                        dst.at(g0 * n),
                        n,
                        rows,
                    )
                };
            }
        }
        // The decoded tile lives in a per-thread buffer: allocating it per task would map and
        // unmap pages (and shoot down TLBs on every core) thousands of times a step.
        (_, _) => TILE.with(|tile| {
            let mut tile = tile.borrow_mut();
            let span = if m <= SMALL_M { SPAN } else { k };
            if tile.len() < np * span * PANEL {
                tile.resize(np * span * PANEL, 0.0);
            }
            for t0 in (0..k).step_by(span) {
                let t1 = (t0 + span).min(k);
                for p in 0..np {
                    w.panel_f32(p0 + p, t0, t1, &mut tile[p * span * PANEL..]);
                }
                // SAFETY: the tile holds np panels of (t1 - t0) columns, span·16 apart; x
                // holds m rows of k; the outputs are `rows` columns from dst of every row,
                // this task's (continued from the span before where t0 > 0).
                unsafe {
                    panel_product(
                        x.as_ptr().add(t0),
                        k,
                        m,
                        tile.as_ptr(),
                        span * PANEL,
                        rows,
                        t1 - t0,
                        t0 > 0,
                        dst.at(0),
                        n,
                    )
                }
            }
        }),
    }
}

thread_local! {
    /// Decoded panels of a task, reused by every task this thread runs; on a cache line, so
    /// that no load of a panel vector straddles two ([`crate::aligned`]).
    static TILE: std::cell::RefCell<AlignedF32> = const { std::cell::RefCell::new(AlignedF32::new()) };
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

/// Output rows per task for a product of `n` rows taken `unit` at a time (a panel of sixteen):
/// whole units, at most [`ROWS_PER_TASK`] rows, and of the sizes that allows, the one whose
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

    /// AVX2's fused groups: one call up to four rows, then `⌈m/4⌉` groups as even as can be,
    /// never a group of one; above eight rows the tile.
    #[test]
    fn avx2_groups_of_rows_are_even_and_never_one_row_beside_others() {
        let groups: Vec<_> = (1..=9).map(|m| avx2_group(m, 4)).collect();
        let want = [1, 2, 3, 4, 3, 3, 4, 4].map(Some);
        assert_eq!(groups[..8], want);
        assert_eq!(groups[8], None);
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
            for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 33, 70] {
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
            // Two to eight rows each once (every group the levels' fused kernels take), then
            // twelve row counts at random.
            for trial in 0..19 {
                let m = match trial {
                    0..7 => trial as usize + 2,
                    _ => rng.gen_range(1..=70),
                };
                // The small counts' probe is the last row: in the last group of registers.
                let at = match trial {
                    0..7 => m - 1,
                    _ => rng.gen_range(0..m),
                };
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

    /// The gated product gives the bits of the product and then silu·mul of each row's halves:
    /// for f32 and quantized weights, one weight or parts of two types (Q4_K_M's mixes), `ff` a
    /// multiple of the panel or not (two passes then), any row count (the decode kernels' groups
    /// and the tile's), on 1 to 3 threads.
    #[test]
    fn the_gated_product_gives_the_products_bits_through_silu() {
        let pool = |threads| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap()
        };
        let k = 96;
        let quant = |ty: GgmlType, wf: &[f32], rows: usize| {
            let ggml = match ty {
                GgmlType::Q4_1 => quantize_q4_1(wf),
                _ => quantize_q8_0(wf),
            };
            Weight::quant(ty, &ggml, rows, k).unwrap()
        };
        let f32w = |data: Vec<f32>, rows: usize| Weight::F32 {
            data,
            rows,
            cols: k,
        };
        for (case, ff) in [(0, 48), (0, 40), (1, 80), (2, 64), (3, 48), (3, 40)] {
            let (g, u) = (rnd(ff * k, 5 + ff as u64), rnd(ff * k, 6 + ff as u64));
            let both: Vec<f32> = g.iter().chain(&u).copied().collect();
            let w = match case {
                0 => f32w(both, 2 * ff),
                1 => quant(GgmlType::Q4_1, &both, 2 * ff),
                2 => quant(GgmlType::Q8_0, &both, 2 * ff),
                // Gate and up in two types: parts, the up part starting a panel or not.
                _ => Weight::stack(vec![quant(GgmlType::Q4_1, &g, ff), f32w(u, ff)]).unwrap(),
            };
            let name = format!("case {case}, ff {ff}");
            let lin = crate::Linear::new(w.clone());
            // (A gate of 40 rows is not whole panels: the two are stacked decoded, one weight.)
            assert_eq!(matches!(w, Weight::Parts { .. }), case == 3 && ff == 48);
            for (i, m) in [1, 3, 8, 9, 33, 70].into_iter().enumerate() {
                let x = rnd(m * k, 50 + m as u64);
                let mut gate_up = vec![0f32; m * 2 * ff];
                matmul(&x, m, &w, &mut gate_up).unwrap();
                let mut want = vec![0f32; m * ff];
                for (gu, o) in gate_up.chunks_exact(2 * ff).zip(want.chunks_exact_mut(ff)) {
                    crate::ops::silu_mul_to(&gu[..ff], &gu[ff..], o);
                }
                let threads = [1, 2, 3][i % 3];
                let mut got = vec![f32::NAN; m * ff];
                pool(threads).install(|| matmul_silu(&x, m, &w, &mut got).unwrap());
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "{name}, {m} rows, {threads} threads"
                );
                assert!(want.iter().all(|v| v.is_finite() && *v != 0.0), "{name}");
                // `Linear`'s, in one pass or (below 9 rows, or on the AMX tiles where
                // `TANDEM_AMX=1` turns them on) two through the buffer given.
                let tiles = lin.tiles() && m >= crate::weight::AMX_MIN_ROWS && crate::amx::active();
                if tiles {
                    lin.matmul(&x, m, &mut gate_up).unwrap();
                    for (gu, o) in gate_up.chunks_exact(2 * ff).zip(want.chunks_exact_mut(ff)) {
                        crate::ops::silu_mul_to(&gu[..ff], &gu[ff..], o);
                    }
                }
                let mut buf = vec![f32::NAN; m * 2 * ff + 5];
                let mut got = vec![f32::NAN; m * ff];
                lin.matmul_silu(&x, m, &mut buf, &mut got).unwrap();
                assert_eq!(bits(&got), bits(&want), "{name}, {m} rows, Linear");
                let two_passes = !buf[0].is_nan();
                assert_eq!(
                    two_passes,
                    m < MATMUL_SILU_MIN_ROWS || tiles,
                    "{name}, {m} rows"
                );
                let short = lin.matmul_silu(&x, m, &mut buf[..m * 2 * ff - 1], &mut got);
                assert_eq!(
                    short.is_err(),
                    two_passes,
                    "{name}, {m} rows: a short buffer"
                );
            }
        }
        let w = f32w(vec![0.0; 3 * k], 3);
        let err = matmul_silu(&[0.0; 96], 1, &w, &mut [0.0; 1]).unwrap_err();
        assert!(err.to_string().contains("the weight 3 rows"), "{err}");
        let w = f32w(vec![0.0; 4 * k], 4);
        assert!(matmul_silu(&[0.0; 96], 1, &w, &mut [0.0; 3]).is_err());
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
            (576, 16, 2, 48),  // 12 tasks, 6 a thread (64 rows: 9 tasks, 5 and 4)
            (960, 16, 2, 48),  // 20 tasks, 10 a thread (64 rows: 15, 8 and 7)
            (3072, 16, 2, 64), // 48 tasks, 24 a thread
            (576, 16, 16, 48), // 12 tasks of 3 panels (9 of 4: 4 panels the busiest's work)
            (5, 16, 2, 16),    // a single short panel
            (1024, 16, 1, 64), // one thread: the largest tasks that cover it exactly
        ] {
            let got = pool(threads).install(|| task_rows(n, unit));
            assert_eq!(got, want, "n={n} unit={unit} threads={threads}");
            assert!(got % unit == 0 && got <= ROWS_PER_TASK.max(unit));
        }
    }

    /// The separate silu·mul: each row's values are `silu_mul_to`'s of its halves, whatever the
    /// rows a task takes; a buffer that is not twice the output, or an output that is not whole
    /// rows, is refused.
    #[test]
    fn silu_rows_gives_each_rows_silu_mul() {
        let ff = 24;
        for rows in [0, 1, SILU_ROWS - 1, SILU_ROWS, 2 * SILU_ROWS + 3] {
            let gate_up = rnd(rows * 2 * ff, rows as u64);
            let mut out = vec![f32::NAN; rows * ff];
            silu_rows(&gate_up, ff, &mut out);
            for (g, o) in gate_up.chunks_exact(2 * ff).zip(out.chunks_exact(ff)) {
                let mut want = vec![0f32; ff];
                crate::ops::silu_mul_to(&g[..ff], &g[ff..], &mut want);
                assert_eq!(
                    o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{rows} rows"
                );
            }
        }
        let short = std::panic::catch_unwind(|| silu_rows(&[1.0; 47], ff, &mut [0.0; 24]));
        assert!(short.is_err());
        let ragged = std::panic::catch_unwind(|| silu_rows(&[1.0; 60], ff, &mut [0.0; 30]));
        assert!(ragged.is_err());
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

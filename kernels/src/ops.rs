//! Element-wise and row-wise ops: RMS norm, rotary embedding, SiLU·mul, embedding gather, and the
//! logits helpers (softmax, log-softmax, argmax).

use rayon::prelude::*;

use crate::Weight;

/// `out = x / sqrt(mean(x²) + eps) · w`, row by row (`x` is rows × w.len()), as HF's LlamaRMSNorm.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = crate::simd::dot_f32(xr, xr) / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        crate::simd::scale_row(xr, w, inv, or);
    }
}

/// Cosines and sines of every (position, frequency) pair up to a maximum position.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// `inv_freq` has head_dim/2 entries; angles are `(pos · pos_scale) · inv_freq` in f32, the way
    /// HF computes them, so long positions round the same way.
    pub fn new(inv_freq: &[f32], pos_scale: f32, max_pos: usize) -> Self {
        let half = inv_freq.len();
        let mut cos = vec![0f32; max_pos * half];
        let mut sin = vec![0f32; max_pos * half];
        cos.par_chunks_mut(half)
            .zip(sin.par_chunks_mut(half))
            .enumerate()
            .for_each(|(p, (c, s))| {
                let pos = p as f32 * pos_scale;
                for i in 0..half {
                    let a = (pos * inv_freq[i]) as f64;
                    c[i] = a.cos() as f32;
                    s[i] = a.sin() as f32;
                }
            });
        Self { half, cos, sin }
    }

    /// Positions the table covers: 0 up to (not including) this.
    pub fn max_pos(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// The cosine and sine tables, max_pos × head_dim/2 each (the GPU copies them).
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }
}

/// Applies HF's `rotate_half` rotary embedding in place. `x` is tokens × (n_heads·head_dim);
/// `positions[t]` is token t's position.
pub fn rope(x: &mut [f32], positions: &[usize], n_heads: usize, table: &RopeTable) {
    let half = table.half;
    let hd = 2 * half;
    for (t, row) in x.chunks_exact_mut(n_heads * hd).enumerate() {
        let p = positions[t];
        let c = &table.cos[p * half..(p + 1) * half];
        let s = &table.sin[p * half..(p + 1) * half];
        for h in row.chunks_exact_mut(hd) {
            let (a, b) = h.split_at_mut(half);
            crate::simd::rotate(a, b, c, s);
        }
    }
}

/// `gate[i] = silu(gate[i]) · up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    crate::simd::silu_mul(gate, up);
}

/// `out[i] = silu(gate[i]) · up[i]`: [`silu_mul`]'s bits, without overwriting `gate`.
pub fn silu_mul_to(gate: &[f32], up: &[f32], out: &mut [f32]) {
    crate::simd::silu_mul_to(gate, up, out);
}

/// Gathers embedding rows for `ids` into `out` (ids.len() × dim). Ids must be < table rows.
pub fn embedding(ids: &[u32], table: &Weight, out: &mut [f32]) {
    let d = table.cols();
    for (id, o) in ids.iter().zip(out.chunks_exact_mut(d)) {
        table.row_f32(*id as usize, o);
    }
}

/// Index of the largest value; the first one on ties (as `torch.argmax`).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `log(softmax(x))` written into `out`, computed stably.
pub fn log_softmax(x: &[f32], out: &mut [f32]) {
    // `out` holds the exponentials first, then the log-probabilities.
    let lse = log_sum_exp(x, out);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = v - lse;
    }
}

/// `ln Σ exp(x)`, shifted by the maximum so nothing overflows; `scratch` (as long as `x`) takes
/// the exponentials. `x[i] - log_sum_exp(x)` is element `i` of [`log_softmax`], bit for bit.
pub fn log_sum_exp(x: &[f32], scratch: &mut [f32]) -> f32 {
    let max = crate::simd::max_f32(x);
    scratch.copy_from_slice(x);
    max + crate::simd::exp_shifted_sum(scratch, max).ln()
}

/// One LoRA pair's part of a projection's output (see [`lora_add`]): `rows` of the output get
/// `scale · B·(A·x)` in columns `off..off + out`.
pub struct LoraJob<'a> {
    /// `rank × in`, row-major (PEFT's `lora_A`).
    pub a: &'a [f32],
    /// `rank × out`, row-major (PEFT's `lora_B` transposed).
    pub bt: &'a [f32],
    /// The pair's rank.
    pub rank: usize,
    /// What `B·(A·x)` is multiplied by.
    pub scale: f32,
    /// The first output column the pair's outputs land in (q, k and v share one fused output).
    pub off: usize,
    /// The rows it applies to.
    pub rows: &'a [usize],
}

/// Adds every job's low-rank product to its rows of `out` (rows of `n` values) from the same
/// rows of `x` (rows of `k` values): `out[row, off + o] += scale · Σⱼ B[o, j] · (A[j] · x[row])`,
/// the sum over `j` in order, then scaled, then added, as PEFT computes it.
///
/// Every row's values are one sequence of the same operations whatever else the call holds
/// (which jobs, how many rows, how the rows are split over threads): batch-invariant. The rows
/// of all jobs run as one parallel region; the rows of one job on a thread reuse its A and B
/// from cache (BGMV-style: the pair is read from memory once per step, not once per row).
pub fn lora_add(jobs: &[LoraJob<'_>], x: &[f32], k: usize, out: &mut [f32], n: usize) {
    use crate::simd::{axpy, dot_f32};
    let total: usize = jobs
        .iter()
        .map(|j| j.rows.len() * j.bt.len() / j.rank.max(1))
        .sum();
    let mut delta = vec![0f32; total];
    let mut tasks: Vec<(&LoraJob<'_>, usize, &mut [f32])> = Vec::new();
    let mut rest = delta.as_mut_slice();
    for j in jobs {
        let width = j.bt.len() / j.rank.max(1);
        for &row in j.rows {
            let (mine, tail) = rest.split_at_mut(width);
            tasks.push((j, row, mine));
            rest = tail;
        }
    }
    tasks
        .par_iter_mut()
        .for_each_init(Vec::new, |t: &mut Vec<f32>, (j, row, d)| {
            let xr = &x[*row * k..][..k];
            t.clear();
            t.extend(j.a.chunks_exact(k).map(|aj| dot_f32(xr, aj)));
            let width = d.len();
            for (tj, bj) in t.iter().zip(j.bt.chunks_exact(width)) {
                axpy(*tj, bj, d);
            }
        });
    for (j, row, d) in tasks {
        let o = &mut out[row * n + j.off..][..d.len()];
        for (o, &dv) in o.iter_mut().zip(d.iter()) {
            *o += dv * j.scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_values() {
        let x = [1.0f32, 2.0, 3.0, 4.0];
        let w = [1.0f32, 1.0, 2.0, 0.5];
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 0.0, &mut out);
        let r = (30.0f32 / 4.0).sqrt();
        assert!((out[0] - 1.0 / r).abs() < 1e-6);
        assert!((out[2] - 6.0 / r).abs() < 1e-6);
        assert!((out[3] - 2.0 / r).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_half_apart() {
        let inv = [1.0f32, 0.5];
        let t = RopeTable::new(&inv, 1.0, 4);
        let mut x = vec![1.0f32, 0.0, 0.0, 1.0];
        rope(&mut x, &[2], 1, &t);
        // pair (x0, x2) rotated by 2 rad, pair (x1, x3) by 1 rad
        assert!((x[0] - 2f32.cos()).abs() < 1e-6 && (x[2] - 2f32.sin()).abs() < 1e-6);
        assert!((x[1] + 1f32.sin()).abs() < 1e-6 && (x[3] - 1f32.cos()).abs() < 1e-6);
        let mut y = vec![0.3f32, -0.2, 0.9, 0.1];
        let before = y.clone();
        rope(&mut y, &[0], 1, &t);
        assert_eq!(y, before, "position 0 is the identity");
    }

    /// Every head of every row, at head sizes whose halves fill whole vectors, leave a tail or
    /// are shorter than one (the vector loop and its scalar tail): bits equal to the formula
    /// computed a pair at a time, each row at its own position.
    #[test]
    fn rope_gives_each_pair_its_rotation() {
        for half in [1, 3, 8, 16, 20, 32, 40, 64] {
            let inv: Vec<f32> = (0..half).map(|i| 1.0 / (1.0 + i as f32)).collect();
            let t = RopeTable::new(&inv, 1.0, 64);
            let (heads, rows) = (5, 3);
            let x: Vec<f32> = (0..rows * heads * 2 * half)
                .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let pos = [7, 0, 63];
            let mut got = x.clone();
            rope(&mut got, &pos, heads, &t);
            let (cos, sin) = t.tables();
            for (r, p) in pos.iter().enumerate() {
                for h in 0..heads {
                    let at = (r * heads + h) * 2 * half;
                    for i in 0..half {
                        let (c, s) = (cos[p * half + i], sin[p * half + i]);
                        let (a, b) = (x[at + i], x[at + half + i]);
                        let want = [a * c - b * s, b * c + a * s];
                        let have = [got[at + i], got[at + half + i]];
                        assert_eq!(
                            have.map(f32::to_bits),
                            want.map(f32::to_bits),
                            "half {half}, row {r}, head {h}, pair {i}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn logits_helpers() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        let mut p = [1.0f32, 2.0, 3.0];
        softmax(&mut p);
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let mut l = [0f32; 3];
        log_softmax(&[1.0, 2.0, 3.0], &mut l);
        for i in 0..3 {
            assert!((l[i] - p[i].ln()).abs() < 1e-6);
        }
        let mut g = [0.0f32, 2.0];
        silu_mul(&mut g, &[3.0, 1.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-2f32).exp())).abs() < 1e-6);
    }
}

//! Paged KV cache writes and attention over it.
//!
//! One layer's cache is a slice of blocks. A block holds `block_size` token slots for K then V,
//! each laid out `[kv_head][slot][head_dim]`, so one layer's block is one contiguous range (what a
//! KV transfer sends) and one head's keys within a block are contiguous (what attention reads).
//! A sequence's block table maps its logical block i (tokens i·bs .. (i+1)·bs) to a physical block.
//!
//! Attention takes a packed batch: query rows of several sequences one after another, each with
//! its own block table and context length. A sequence's new tokens are the last `q_len` of its
//! `context_len`, so the same kernel serves prefill (many new tokens, maybe after a cached prefix)
//! and decode (one new token); masking is causal by position.

use rayon::prelude::*;

use crate::simd::{axpy, dot_f32};
use crate::KernelError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// f32 values in one layer's block (K and V).
    pub fn block_floats(&self) -> usize {
        2 * self.num_kv_heads * self.block_size * self.head_dim
    }

    #[inline]
    fn k_at(&self, block: usize, head: usize, slot: usize) -> usize {
        block * self.block_floats() + (head * self.block_size + slot) * self.head_dim
    }

    #[inline]
    fn v_at(&self, block: usize, head: usize, slot: usize) -> usize {
        self.k_at(block, head, slot) + self.block_floats() / 2
    }
}

/// One sequence's share of a packed attention batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqAttn<'a> {
    /// First query row of this sequence in the packed batch.
    pub q_start: usize,
    /// Number of new tokens (query rows).
    pub q_len: usize,
    /// Tokens in the cache for this sequence after this step's writes (cached prefix + new).
    pub context_len: usize,
    /// Physical block of each logical block.
    pub block_table: &'a [u32],
}

/// Writes K and V rows (tokens × kv_heads·head_dim) into their cache slots
/// (`slot = physical_block · block_size + offset`).
pub fn write_kv(
    cache: &mut [f32],
    layout: KvLayout,
    k: &[f32],
    v: &[f32],
    slots: &[usize],
) -> Result<(), KernelError> {
    let row = layout.num_kv_heads * layout.head_dim;
    if k.len() != slots.len() * row || v.len() != k.len() {
        return Err(KernelError::Shape(format!(
            "write_kv: {} slots for {} K values",
            slots.len(),
            k.len()
        )));
    }
    let hd = layout.head_dim;
    for (t, &slot) in slots.iter().enumerate() {
        let (b, s) = (slot / layout.block_size, slot % layout.block_size);
        if (b + 1) * layout.block_floats() > cache.len() {
            return Err(KernelError::Shape(format!(
                "write_kv: slot {slot} is outside the cache"
            )));
        }
        for h in 0..layout.num_kv_heads {
            let src = t * row + h * hd;
            let ko = layout.k_at(b, h, s);
            cache[ko..ko + hd].copy_from_slice(&k[src..src + hd]);
            let vo = layout.v_at(b, h, s);
            cache[vo..vo + hd].copy_from_slice(&v[src..src + hd]);
        }
    }
    Ok(())
}

/// Causal attention of packed queries (rows × n_heads·head_dim) over the paged cache, into `out`
/// (same shape as `q`). Grouped-query: query head h reads KV head h / (n_heads / kv_heads).
pub fn paged_attention(
    q: &[f32],
    n_heads: usize,
    cache: &[f32],
    layout: KvLayout,
    seqs: &[SeqAttn<'_>],
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let hd = layout.head_dim;
    let width = n_heads * hd;
    if n_heads % layout.num_kv_heads != 0 {
        return Err(KernelError::Shape(format!(
            "{n_heads} heads over {} KV heads",
            layout.num_kv_heads
        )));
    }
    let group = n_heads / layout.num_kv_heads;
    let rows = q.len() / width;
    if q.len() != out.len() || q.len() % width != 0 {
        return Err(KernelError::Shape(
            "paged_attention: q and out differ".into(),
        ));
    }
    // Which sequence (and which of its new tokens) each query row is.
    let mut owner = vec![(usize::MAX, 0usize); rows];
    for (si, s) in seqs.iter().enumerate() {
        if s.q_len > s.context_len
            || s.context_len > s.block_table.len() * layout.block_size
            || s.q_start + s.q_len > rows
        {
            return Err(KernelError::Shape(format!(
                "sequence {si}: {} new of {} tokens with {} blocks of {}",
                s.q_len,
                s.context_len,
                s.block_table.len(),
                layout.block_size
            )));
        }
        if s.block_table
            .iter()
            .any(|&b| (b as usize + 1) * layout.block_floats() > cache.len())
        {
            return Err(KernelError::Shape(format!(
                "sequence {si}: block table points outside the cache"
            )));
        }
        for i in 0..s.q_len {
            owner[s.q_start + i] = (si, i);
        }
    }
    out.par_chunks_mut(width)
        .zip(q.par_chunks(width))
        .enumerate()
        .for_each(|(r, (o, qr))| {
            let (si, i) = owner[r];
            if si == usize::MAX {
                o.fill(0.0);
                return;
            }
            let s = &seqs[si];
            let n_ctx = s.context_len - s.q_len + i + 1;
            let mut scores = vec![0f32; n_ctx];
            for h in 0..n_heads {
                let kvh = h / group;
                let qh = &qr[h * hd..(h + 1) * hd];
                let mut max = f32::NEG_INFINITY;
                for (j, sc) in scores.iter_mut().enumerate() {
                    let b = s.block_table[j / layout.block_size] as usize;
                    let ko = layout.k_at(b, kvh, j % layout.block_size);
                    *sc = dot_f32(qh, &cache[ko..ko + hd]) * scale;
                    max = max.max(*sc);
                }
                let mut sum = 0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                let inv = 1.0 / sum;
                let oh = &mut o[h * hd..(h + 1) * hd];
                oh.fill(0.0);
                for (j, &p) in scores.iter().enumerate() {
                    let b = s.block_table[j / layout.block_size] as usize;
                    let vo = layout.v_at(b, kvh, j % layout.block_size);
                    axpy(p * inv, &cache[vo..vo + hd], oh);
                }
            }
        });
    Ok(())
}

/// Plain attention over contiguous K/V (context × kv_heads·head_dim) for `q_len` queries that are
/// the last of the context. The reference the paged kernel is tested against.
pub fn reference_attention(
    q: &[f32],
    n_heads: usize,
    k: &[f32],
    v: &[f32],
    num_kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    let width = n_heads * head_dim;
    let kw = num_kv_heads * head_dim;
    let q_len = q.len() / width;
    let ctx = k.len() / kw;
    let group = n_heads / num_kv_heads;
    let mut out = vec![0f32; q.len()];
    for i in 0..q_len {
        let n = ctx - q_len + i + 1;
        for h in 0..n_heads {
            let kvh = h / group;
            let qh = &q[i * width + h * head_dim..i * width + (h + 1) * head_dim];
            let s: Vec<f64> = (0..n)
                .map(|j| {
                    let kj = &k[j * kw + kvh * head_dim..j * kw + (kvh + 1) * head_dim];
                    qh.iter()
                        .zip(kj)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..head_dim {
                let acc: f64 = (0..n)
                    .map(|j| e[j] / z * v[j * kw + kvh * head_dim + d] as f64)
                    .sum();
                out[i * width + h * head_dim + d] = acc as f32;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{seq::SliceRandom, Rng, SeedableRng};

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Attention over a scattered block table equals attention over the same K/V laid out
        /// contiguously: random shapes, GQA ratios, block sizes, prefix lengths, several sequences.
        #[test]
        fn paged_equals_contiguous(
            seed in any::<u64>(),
            kv_heads in 1usize..4,
            group in 1usize..4,
            hd_pow in 2u32..6,
            block_size in prop::sample::select(vec![1usize, 2, 4, 16]),
            lens in prop::collection::vec((1usize..40, 0usize..40), 1..4),
        ) {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let hd = 1usize << hd_pow;
            let n_heads = kv_heads * group;
            let layout = KvLayout { block_size, num_kv_heads: kv_heads, head_dim: hd };
            let total_blocks: usize = lens.iter().map(|(n, p)| (n + p).div_ceil(block_size)).sum::<usize>() + 3;
            let mut cache = vec![f32::NAN; total_blocks * layout.block_floats()];
            let mut free: Vec<u32> = (0..total_blocks as u32).collect();
            free.shuffle(&mut rng);
            let kw = kv_heads * hd;
            let mut tables = Vec::new();
            let mut contiguous = Vec::new();
            let mut q_all = Vec::new();
            for &(new, prefix) in &lens {
                let ctx = new + prefix;
                let table: Vec<u32> = (0..ctx.div_ceil(block_size)).map(|_| free.pop().unwrap()).collect();
                let k: Vec<f32> = (0..ctx * kw).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let v: Vec<f32> = (0..ctx * kw).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let slots: Vec<usize> = (0..ctx).map(|p| table[p / block_size] as usize * block_size + p % block_size).collect();
                write_kv(&mut cache, layout, &k, &v, &slots).unwrap();
                let q: Vec<f32> = (0..new * n_heads * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
                q_all.extend_from_slice(&q);
                tables.push(table);
                contiguous.push((q, k, v));
            }
            let mut seqs = Vec::new();
            let mut start = 0;
            for (i, &(new, prefix)) in lens.iter().enumerate() {
                seqs.push(SeqAttn { q_start: start, q_len: new, context_len: new + prefix, block_table: &tables[i] });
                start += new;
            }
            let scale = 1.0 / (hd as f32).sqrt();
            let mut out = vec![0f32; q_all.len()];
            paged_attention(&q_all, n_heads, &cache, layout, &seqs, scale, &mut out).unwrap();
            let mut off = 0;
            for (q, k, v) in &contiguous {
                let want = reference_attention(q, n_heads, k, v, kv_heads, hd, scale);
                for (a, b) in out[off..off + q.len()].iter().zip(&want) {
                    prop_assert!((a - b).abs() < 1e-4, "{} vs {}", a, b);
                }
                off += q.len();
            }
        }
    }

    #[test]
    fn bad_tables_are_errors() {
        let layout = KvLayout {
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 4,
        };
        let cache = vec![0f32; 2 * layout.block_floats()];
        let q = vec![0f32; 4];
        let mut out = vec![0f32; 4];
        let table = [5u32];
        let s = [SeqAttn {
            q_start: 0,
            q_len: 1,
            context_len: 1,
            block_table: &table,
        }];
        assert!(paged_attention(&q, 1, &cache, layout, &s, 1.0, &mut out).is_err());
        let table = [0u32];
        let s = [SeqAttn {
            q_start: 0,
            q_len: 1,
            context_len: 3,
            block_table: &table,
        }];
        assert!(paged_attention(&q, 1, &cache, layout, &s, 1.0, &mut out).is_err());
    }
}

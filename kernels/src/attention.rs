//! Paged KV cache writes and attention over it.
//!
//! One layer's cache is a slice of blocks. A block holds `block_size` token slots for K then V:
//! K laid out `[kv_head][head_dim][slot]` (transposed: one dimension of all the block's keys is
//! one contiguous row) and V `[kv_head][slot][head_dim]`. One layer's block is one contiguous range
//! (what a KV transfer sends), and one head's keys or values within a block are contiguous (what
//! attention reads). A sequence's block table maps its logical block i (tokens i·bs .. (i+1)·bs)
//! to a physical block.
//!
//! Attention takes a packed batch: query rows of several sequences one after another, each with
//! its own block table and context length. A sequence's new tokens are the last `q_len` of its
//! `context_len`, so the same kernel serves prefill (many new tokens, maybe after a cached prefix)
//! and decode (one new token); masking is causal by position.
//!
//! The work is tiled like a small matmul. A tile is up to [`KEYS_T_TILE`] query vectors sharing
//! one KV head: the grouped heads of a few consecutive rows of one sequence (a decode row alone
//! when there is one new token). Scores come from the transposed keys, 16 keys per vector
//! register and each broadcast query element multiplied with a block's keys (two blocks' at
//! AVX-512), so there are no horizontal sums; the values are then accumulated for all the tile's
//! vectors with each value row loaded once, a few blocks a call.

use rayon::prelude::*;

use crate::matmul::OutPtr;
use crate::simd::{
    axpy, axpy_group, axpy_rows_group, axpy_rows_group_to, dot_keys_t, exp_shifted_sum, max_f32,
    Finish, KEYS_T_TILE,
};
use crate::KernelError;

/// How one layer's KV blocks are laid out (see the module docs): the sizes every cache access
/// and every block's byte count follow from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Token slots per block.
    pub block_size: usize,
    /// KV heads per token.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// f32 values in one layer's block (K and V).
    pub fn block_floats(&self) -> usize {
        2 * self.num_kv_heads * self.block_size * self.head_dim
    }

    /// Offset of a head's transposed keys in a block: `head_dim` rows of `block_size` slots.
    #[inline]
    fn kt_at(&self, block: usize, head: usize) -> usize {
        block * self.block_floats() + head * self.block_size * self.head_dim
    }

    /// Offset of a value row.
    #[inline]
    fn v_at(&self, block: usize, head: usize, slot: usize) -> usize {
        block * self.block_floats()
            + self.block_floats() / 2
            + (head * self.block_size + slot) * self.head_dim
    }

    /// Scales per block in an int8 cache: one per token slot of each head's K and of its V.
    pub fn block_scales(&self) -> usize {
        2 * self.num_kv_heads * self.block_size
    }

    /// Index of the scale of slot 0 of (block, K or V, head) in an int8 cache's scale array;
    /// the block's other slots follow it.
    #[inline]
    fn scale_at(&self, block: usize, kv: usize, head: usize) -> usize {
        ((block * 2 + kv) * self.num_kv_heads + head) * self.block_size
    }
}

/// One layer's cache, read-only: f32 or f16 values, or int8 values with an f32 scale per token
/// slot of each head's K and V (`scales[((block·2 + kv)·heads + head)·block_size + slot]`, kv 0
/// for K and 1 for V). A slot's scale is its own row's (absmax / 127): writing a later token
/// never touches an earlier one, so what a row reads does not depend on how far its block was
/// filled when it ran.
#[derive(Clone, Copy, Debug)]
pub enum KvSlab<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values.
    F16(&'a [half::f16]),
    /// int8 values with their scales.
    Int8 {
        /// The values, laid out as an f32 cache's.
        data: &'a [i8],
        /// One scale per slot of each head's K and V.
        scales: &'a [f32],
    },
}

/// One layer's cache, writable.
#[derive(Debug)]
pub enum KvSlabMut<'a> {
    /// f32 values.
    F32(&'a mut [f32]),
    /// f16 values.
    F16(&'a mut [half::f16]),
    /// int8 values with their scales.
    Int8 {
        /// The values, laid out as an f32 cache's.
        data: &'a mut [i8],
        /// One scale per slot of each head's K and V.
        scales: &'a mut [f32],
    },
}

impl KvSlabMut<'_> {
    /// The same cache, read-only.
    pub fn as_ref(&self) -> KvSlab<'_> {
        match self {
            Self::F32(d) => KvSlab::F32(d),
            Self::F16(d) => KvSlab::F16(d),
            Self::Int8 { data, scales } => KvSlab::Int8 { data, scales },
        }
    }
}

impl KvSlab<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(d) => d.len(),
            Self::F16(d) => d.len(),
            Self::Int8 { data, .. } => data.len(),
        }
    }

    /// Adds runs of value rows of one head, each `(at, run, scale_at)`: `run` rows from offset
    /// `at` (up to [`RUNS_A_CALL`] runs, row `t` counting on from run to run), weighted by the
    /// probabilities of the query vectors, to their accumulators: `acc[v] += Σ_t p[v·stride +
    /// t] · row t`. f32 and f16 rows are read in place; int8 rows are decoded (each row's scale,
    /// from `scale_at`, applied) into `scratch` first.
    ///
    /// With `fin`, the sums start from zero and go normalized to the output rows instead (see
    /// [`accumulate_group`]).
    ///
    /// # Safety
    /// As [`accumulate_group`]'s where `fin` is given.
    unsafe fn accumulate_rows(
        &self,
        layout: KvLayout,
        runs: &[(usize, usize, usize)],
        (p, stride): (&[f32], usize),
        acc: &mut [f32],
        scratch: &mut Vec<f32>,
        fin: Option<Finish<'_>>,
    ) {
        unsafe fn go<T: crate::simd::KvValue>(
            data: &[T],
            runs: &[(usize, usize, usize)],
            hd: usize,
            (p, stride): (&[f32], usize),
            acc: &mut [f32],
            fin: Option<Finish<'_>>,
        ) {
            let mut rows: [&[T]; RUNS_A_CALL] = [&[]; RUNS_A_CALL];
            for (r, &(at, run, _)) in rows.iter_mut().zip(runs) {
                *r = &data[at..at + run * hd];
            }
            // SAFETY: the caller's promise on `fin`.
            unsafe { accumulate_group(p, stride, &rows[..runs.len()], acc, hd, fin) }
        }
        assert!(runs.len() <= RUNS_A_CALL, "accumulate_rows: too many runs");
        let hd = layout.head_dim;
        // SAFETY (the calls of `go`): the caller's promise on `fin`.
        match self {
            Self::F32(d) => unsafe { go(d, runs, hd, (p, stride), acc, fin) },
            Self::F16(d) => unsafe { go(d, runs, hd, (p, stride), acc, fin) },
            Self::Int8 { data, scales } => {
                scratch.clear();
                for &(at, run, scale_at) in runs {
                    for (row, &sc) in data[at..at + run * hd]
                        .chunks_exact(hd)
                        .zip(&scales[scale_at..scale_at + run])
                    {
                        scratch.extend(row.iter().map(|&q| q as f32 * sc));
                    }
                }
                let rows = scratch.len() / hd;
                unsafe { go(scratch, &[(0, rows, 0)], hd, (p, stride), acc, fin) }
            }
        }
    }

    /// Asks the CPU to start loading `len` values from offset `at` into its L2 cache (x86-64;
    /// elsewhere the hardware prefetcher is left to it). Into L2, not L1: with the L1 hint, the
    /// prefetches of a few KiB at a time held up the loads in use (`examples/decode_attention`
    /// on a 2-core Zen 4: 4.9 ms a step with the L1 hint, 3.9 with the L2 one).
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn prefetch(&self, at: usize, len: usize) {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
            let (base, bytes) = match self {
                Self::F32(d) => (d[at..at + len].as_ptr().cast::<i8>(), len * 4),
                Self::F16(d) => (d[at..at + len].as_ptr().cast::<i8>(), len * 2),
                Self::Int8 { data, .. } => (data[at..at + len].as_ptr(), len),
            };
            for line in (0..bytes).step_by(64) {
                // SAFETY: a prefetch is a hint; the address is inside the slice (sliced above).
                unsafe { _mm_prefetch::<_MM_HINT_T1>(base.add(line)) };
            }
        }
    }

    /// Scores of the tile's `nq` query vectors (`qt`, nq×head_dim) against up to
    /// [`RUNS_A_CALL`] runs of keys, each of one block-head: `(at, off, run, scale_at)`, the
    /// head's transposed keys from `at` (their slot 0 scale at `scale_at`), the run's `run` keys
    /// from slot `off`; each run's scores follow the one's before in each row of `out`. f32 and
    /// f16 keys are read in place; int8 keys are decoded (each slot's scale applied) into
    /// `scratch` first.
    #[allow(clippy::too_many_arguments)]
    fn dot_keys(
        &self,
        layout: KvLayout,
        qt: &[f32],
        nq: usize,
        keys: &[(usize, usize, usize, usize)],
        scale: f32,
        out: &mut [f32],
        ldo: usize,
        scratch: &mut Vec<f32>,
    ) {
        let (n, bs) = (layout.head_dim * layout.block_size, layout.block_size);
        fn go<T: crate::simd::KvValue>(
            data: &[T],
            keys: &[(usize, usize, usize, usize)],
            n: usize,
            args: (&[f32], usize, usize, f32, &mut [f32], usize),
        ) {
            let (qt, nq, bs, scale, out, ldo) = args;
            let mut runs: [(&[T], usize); RUNS_A_CALL] = [(&[], 0); RUNS_A_CALL];
            for (r, &(at, off, run, _)) in runs.iter_mut().zip(keys) {
                *r = (&data[at + off..at + n], run);
            }
            dot_keys_t(qt, nq, &runs[..keys.len()], bs, scale, out, ldo)
        }
        assert!(keys.len() <= RUNS_A_CALL, "dot_keys: too many runs");
        let args = (qt, nq, bs, scale, out, ldo);
        match self {
            Self::F32(d) => go(d, keys, n, args),
            Self::F16(d) => go(d, keys, n, args),
            Self::Int8 { data, scales } => {
                // Each run's block-head decoded whole, one after another.
                scratch.clear();
                let mut local = [(0, 0, 0, 0); RUNS_A_CALL];
                for (l, &(at, off, run, scale_at)) in local.iter_mut().zip(keys) {
                    *l = (scratch.len(), off, run, 0);
                    let sc = &scales[scale_at..scale_at + bs];
                    for dim in data[at..at + n].chunks_exact(bs) {
                        scratch.extend(dim.iter().zip(sc).map(|(&q, &s)| q as f32 * s));
                    }
                }
                go(scratch, &local[..keys.len()], n, args)
            }
        }
    }
}

/// [`axpy_rows_group`] for all of `acc`'s vectors (`acc.len() / hd`), a register group at a time.
/// With `fin` (a factor and an output row for each vector), [`axpy_rows_group_to`]: the sums
/// from zero, normalized into the output rows, `acc` left alone.
///
/// # Safety
/// Where `fin` is given: as [`axpy_rows_group_to`]'s, for each vector.
unsafe fn accumulate_group<T: crate::simd::KvValue>(
    p: &[f32],
    stride: usize,
    rows: &[&[T]],
    acc: &mut [f32],
    hd: usize,
    fin: Option<Finish<'_>>,
) {
    let (nq, group) = (acc.len() / hd, axpy_group());
    for v0 in (0..nq).step_by(group) {
        let take = (nq - v0).min(group);
        let (p, acc) = (&p[v0 * stride..], &mut acc[v0 * hd..(v0 + take) * hd]);
        match fin {
            None => axpy_rows_group(p, stride, rows, acc, take),
            Some(f) => {
                let (inv, out) = (&f.inv[v0..v0 + take], &f.out[v0..v0 + take]);
                // SAFETY: the caller's promise.
                unsafe { axpy_rows_group_to(p, stride, rows, acc, take, Finish { inv, out }) }
            }
        }
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
///
/// An int8 cache keeps one scale per slot of each head's K and V: a row is quantized with its own
/// (`absmax / 127`), and no write touches another slot.
pub fn write_kv(
    cache: &mut KvSlabMut<'_>,
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
    write_kv_with(
        cache,
        layout,
        slots,
        |_| (),
        |t| (&k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row]),
    )
}

/// [`write_kv`] of rows `stride` apart in `kv` (token t's at `t·stride`), each a K row and then
/// its V row (kv_heads·head_dim values each): the keys and values inside fused q|k|v rows, read
/// where they are.
pub fn write_kv_strided(
    cache: &mut KvSlabMut<'_>,
    layout: KvLayout,
    kv: &[f32],
    stride: usize,
    slots: &[usize],
) -> Result<(), KernelError> {
    let row = layout.num_kv_heads * layout.head_dim;
    let n = slots.len();
    if stride < 2 * row || (n > 0 && kv.len() < (n - 1) * stride + 2 * row) {
        return Err(KernelError::Shape(format!(
            "write_kv: {n} slots' K and V rows {stride} apart need more than {} values",
            kv.len()
        )));
    }
    write_kv_with(
        cache,
        layout,
        slots,
        |_| (),
        |t| {
            let at = t * stride;
            (&kv[at..at + row], &kv[at + row..at + 2 * row])
        },
    )
}

/// [`write_kv_strided`] of fused q|k|v rows that `prepare` finishes in place first: token t's
/// row is `qkv[t·stride..]`, its queries the first `k_at` values, then its K row and its V row
/// (kv_heads·head_dim values each); `prepare(t, row)` gets those `k_at + 2·kv_heads·head_dim`
/// values (to rotate its queries and keys) once, from the task that writes the row's block,
/// just before the row's keys and values are read. One pass over the rows where a pass of
/// its own before the writes read each row from memory twice, and one parallel loop fewer.
pub fn prepare_and_write_kv(
    cache: &mut KvSlabMut<'_>,
    layout: KvLayout,
    qkv: &mut [f32],
    stride: usize,
    k_at: usize,
    slots: &[usize],
    prepare: impl Fn(usize, &mut [f32]) + Sync,
) -> Result<(), KernelError> {
    let row = layout.num_kv_heads * layout.head_dim;
    let (n, width) = (slots.len(), k_at + 2 * row);
    if stride < width || (n > 0 && qkv.len() < (n - 1) * stride + width) {
        return Err(KernelError::Shape(format!(
            "prepare_and_write_kv: {n} rows of {width} values {stride} apart need more than {}",
            qkv.len()
        )));
    }
    let rows = OutPtr(qkv.as_mut_ptr());
    write_kv_with(
        cache,
        layout,
        slots,
        // SAFETY: row t is inside `qkv` (checked above), which this call borrows mutably
        // throughout; each token is one block's and so one task's (`write_kv_with`), which
        // prepares it once and then reads it: no other reference to the row exists meanwhile.
        |t| {
            prepare(t, unsafe {
                std::slice::from_raw_parts_mut(rows.at(t * stride), width)
            })
        },
        |t| {
            // SAFETY: as above; the row was prepared, and is only read from here on.
            let at = unsafe { std::slice::from_raw_parts(rows.at(t * stride + k_at), 2 * row) };
            at.split_at(row)
        },
    )
}

/// The writes of [`write_kv`], token t's K and V rows from `kv(t)` (their lengths checked),
/// each token's `prepare(t)` called first by the task that writes its block (each token is in
/// exactly one block's task).
fn write_kv_with<'k>(
    cache: &mut KvSlabMut<'_>,
    layout: KvLayout,
    slots: &[usize],
    prepare: impl Fn(usize) + Sync,
    kv: impl Fn(usize) -> (&'k [f32], &'k [f32]) + Sync,
) -> Result<(), KernelError> {
    let (bs, bf) = (layout.block_size, layout.block_floats());
    let len = cache.as_ref().len();
    if let Some(&slot) = slots.iter().find(|&&s| (s / bs + 1) * bf > len) {
        return Err(KernelError::Shape(format!(
            "write_kv: slot {slot} is outside the cache"
        )));
    }
    // The rows grouped by block, blocks ascending and rows in order within each (a slot written
    // twice in one call keeps the later row): each block is a range of its own, written by one
    // task.
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&t| slots[t] / bs);
    let groups: Vec<&[usize]> = order
        .chunk_by(|&a, &b| slots[a] / bs == slots[b] / bs)
        .collect();
    let blocks: Vec<usize> = groups.iter().map(|g| slots[g[0]] / bs).collect();
    // f32 and f16 blocks take their rows together (see `write_rows`).
    let token = |t: usize| {
        let (k, v) = kv(t);
        (slots[t] % bs, k, v)
    };
    // The lines a block's writes will touch are asked for before its rows are prepared: the
    // writes then find them in cache, where they had waited on a block the pool handed out
    // cold (the writes of a 200-token prefill 1.55-2.72 ms, median 1.83, against 1.29-1.86,
    // median 1.53; 512 tokens 3.98-6.08 ms, median 4.97, against 3.84-5.10, median 4.4: 29
    // layers, `tandem bench engine`, three rounds of each build alternated on a 2-core Zen 4,
    // asking for the whole block, which a prefill's full block's writes touch). Only those
    // lines: a decode row writes one slot's values (its block's whole lines would add a tenth
    // to a decode step's memory traffic at 32 sequences); decode steps of 32 sequences 565-585
    // tok/s before, 557-601 after.
    let prepare_rows = |rows: &[usize]| rows.iter().for_each(|&t| prepare(t));
    match cache {
        KvSlabMut::F32(d) => {
            carve(d, bf, &blocks)
                .into_par_iter()
                .zip(groups)
                .for_each(|(b, rows)| {
                    prefetch_writes(b, layout, rows.iter().map(|&t| slots[t] % bs));
                    prepare_rows(rows);
                    write_group(b, layout, rows, &token, |x| x)
                })
        }
        KvSlabMut::F16(d) => {
            carve(d, bf, &blocks)
                .into_par_iter()
                .zip(groups)
                .for_each(|(b, rows)| {
                    prefetch_writes(b, layout, rows.iter().map(|&t| slots[t] % bs));
                    prepare_rows(rows);
                    write_group(b, layout, rows, &token, half::f16::from_f32)
                })
        }
        KvSlabMut::Int8 { data, scales } => carve(data, bf, &blocks)
            .into_par_iter()
            .zip(carve(scales, layout.block_scales(), &blocks))
            .zip(groups)
            .for_each(|((data, scales), rows)| {
                prefetch_writes(data, layout, rows.iter().map(|&t| slots[t] % bs));
                prepare_rows(rows);
                for &t in rows {
                    let (k, v) = kv(t);
                    write_int8_row(data, scales, layout, slots[t] % bs, k, v);
                }
            }),
    }
    Ok(())
}

/// Asks for the lines of one layer's `block` that writing `slots` touches: each head's keys
/// whole (stored transposed, a slot has a value in each of their lines) and the slots' values.
fn prefetch_writes<T>(block: &[T], layout: KvLayout, slots: impl Iterator<Item = usize> + Clone) {
    let (hd, bs, p) = (layout.head_dim, layout.block_size, block.as_ptr());
    for h in 0..layout.num_kv_heads {
        let kt = layout.kt_at(0, h);
        if kt + hd * bs <= block.len() {
            prefetch_t0(p.wrapping_add(kt), hd * bs);
        }
        for s in slots.clone() {
            let v = layout.v_at(0, h, s);
            if v + hd <= block.len() {
                prefetch_t0(p.wrapping_add(v), hd);
            }
        }
    }
}

/// Disjoint slices `b·len .. (b+1)·len` of `data` for each of `blocks` (ascending, distinct).
fn carve<'a, T>(mut data: &'a mut [T], len: usize, blocks: &[usize]) -> Vec<&'a mut [T]> {
    let mut out = Vec::with_capacity(blocks.len());
    let mut base = 0;
    for &b in blocks {
        let (_, rest) = std::mem::take(&mut data).split_at_mut(b * len - base);
        let (mine, rest) = rest.split_at_mut(len);
        out.push(mine);
        data = rest;
        base = (b + 1) * len;
    }
    out
}

/// [`write_rows`] of the tokens `rows`, each `(slot, k, v)` from `token` (a decode row's block,
/// which holds one, without gathering them into a vector).
fn write_group<'k, T: Copy>(
    block: &mut [T],
    layout: KvLayout,
    rows: &[usize],
    token: &impl Fn(usize) -> (usize, &'k [f32], &'k [f32]),
    cvt: impl Fn(f32) -> T,
) {
    match rows {
        [t] => write_rows(block, layout, &[token(*t)], cvt),
        _ => {
            let rows: Vec<_> = rows.iter().map(|&t| token(t)).collect();
            write_rows(block, layout, &rows, cvt)
        }
    }
}

/// Writes the K and V rows (kv_heads·head_dim each) of tokens `(slot, k, v)` into one layer's
/// f32 or f16 `block` (its values, from the block's start), in order: a slot given twice keeps
/// its later row. Each value row is written whole; the keys, stored transposed, a dimension at a
/// time for all the rows, so the slots of one dimension (a cache line of 16 at f32) are written
/// together. Written one value of one row at a time (each through a match on the cache type),
/// the rows took 6% of a 512-token prefill's attention, 0.40% of its samples; written so, 0.15%
/// (`perf`, `tandem bench engine --batch 8 --prompt-len 512`, a 2-core Zen 4).
fn write_rows<T: Copy>(
    block: &mut [T],
    layout: KvLayout,
    rows: &[(usize, &[f32], &[f32])],
    cvt: impl Fn(f32) -> T,
) {
    let (hd, bs) = (layout.head_dim, layout.block_size);
    for h in 0..layout.num_kv_heads {
        let src = h * hd..(h + 1) * hd;
        let kt = layout.kt_at(0, h);
        for (i, dim) in block[kt..kt + hd * bs].chunks_exact_mut(bs).enumerate() {
            for &(s, k, _) in rows {
                dim[s] = cvt(k[src.start + i]);
            }
        }
        for &(s, _, v) in rows {
            let at = layout.v_at(0, h, s);
            for (o, &x) in block[at..at + hd].iter_mut().zip(&v[src.clone()]) {
                *o = cvt(x);
            }
        }
    }
}

/// Writes one token's K and V rows (kv_heads·head_dim each) into slot `s` of an int8 block
/// (its values and scales, offsets from the block's start), each head's row with its own scale.
fn write_int8_row(
    data: &mut [i8],
    scales: &mut [f32],
    layout: KvLayout,
    s: usize,
    k: &[f32],
    v: &[f32],
) {
    let (hd, bs) = (layout.head_dim, layout.block_size);
    for h in 0..layout.num_kv_heads {
        let src = h * hd..(h + 1) * hd;
        // K: element i of slot s at kt + i·bs + s. V: a row per slot.
        let k_run = Run {
            first: layout.kt_at(0, h),
            slot_stride: 1,
            dim_stride: bs,
        };
        let v_run = Run {
            first: layout.v_at(0, h, 0),
            slot_stride: hd,
            dim_stride: 1,
        };
        for (kv, x, run) in [(0, &k[src.clone()], k_run), (1, &v[src.clone()], v_run)] {
            let si = layout.scale_at(0, kv, h) + s;
            quantize_into(data, &mut scales[si], run, s, x);
        }
    }
}

/// Where one head's K or V values of one block live: value `i` of slot `s` at
/// `first + s·slot_stride + i·dim_stride`.
#[derive(Clone, Copy)]
struct Run {
    first: usize,
    slot_stride: usize,
    dim_stride: usize,
}

impl Run {
    #[inline]
    fn at(&self, slot: usize, i: usize) -> usize {
        self.first + slot * self.slot_stride + i * self.dim_stride
    }
}

/// Quantizes slot `s` of a block-head run with its own scale (absmax / 127).
fn quantize_into(data: &mut [i8], scale: &mut f32, run: Run, s: usize, x: &[f32]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    *scale = amax / 127.0;
    let inv = if *scale > 0.0 { 1.0 / *scale } else { 0.0 };
    for (i, &v) in x.iter().enumerate() {
        data[run.at(s, i)] = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
}

/// What a layer's attention is, beyond the cache's layout.
#[derive(Clone, Copy, Debug)]
pub struct AttnSpec {
    /// Number of query heads.
    pub n_heads: usize,
    /// Factor on every score (`1/sqrt(head_dim)` for these models).
    pub scale: f32,
    /// Sliding window: a query at position `p` sees the keys at `p + 1 - window ..= p` only.
    /// `None`: every earlier key.
    pub window: Option<usize>,
}

impl AttnSpec {
    /// The first key a query at position `pos` sees.
    fn first_key(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Causal attention of packed queries (rows × n_heads·head_dim) over the paged cache, into `out`
/// (same shape as `q`), limited to the sliding window when `spec` has one. Grouped-query: query
/// head h reads KV head h / (n_heads / kv_heads).
pub fn paged_attention(
    q: &[f32],
    spec: AttnSpec,
    cache: KvSlab<'_>,
    layout: KvLayout,
    seqs: &[SeqAttn<'_>],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let width = spec.n_heads * layout.head_dim;
    if q.len() != out.len() {
        return Err(KernelError::Shape(
            "paged_attention: q and out differ".into(),
        ));
    }
    paged_attention_strided(q, width, spec, cache, layout, seqs, out)
}

/// [`paged_attention`] of queries that are the first n_heads·head_dim values of rows `q_stride`
/// apart (row r's at `r·q_stride`): the queries inside fused q|k|v rows, read where they are.
/// `out` is packed (rows × n_heads·head_dim), its rows those of `q`; the bits are those of the
/// same queries packed.
pub fn paged_attention_strided(
    q: &[f32],
    q_stride: usize,
    spec: AttnSpec,
    cache: KvSlab<'_>,
    layout: KvLayout,
    seqs: &[SeqAttn<'_>],
    out: &mut [f32],
) -> Result<(), KernelError> {
    let n_heads = spec.n_heads;
    if spec.window == Some(0) {
        return Err(KernelError::Shape("a sliding window of 0 keys".into()));
    }
    let hd = layout.head_dim;
    let width = n_heads * hd;
    if !n_heads.is_multiple_of(layout.num_kv_heads) {
        return Err(KernelError::Shape(format!(
            "{n_heads} heads over {} KV heads",
            layout.num_kv_heads
        )));
    }
    let group = n_heads / layout.num_kv_heads;
    if width == 0 || !out.len().is_multiple_of(width) {
        return Err(KernelError::Shape(
            "paged_attention: the output is not whole rows".into(),
        ));
    }
    let rows = out.len() / width;
    if q_stride < width || (rows > 0 && q.len() < (rows - 1) * q_stride + width) {
        return Err(KernelError::Shape(format!(
            "paged_attention: {rows} query rows {q_stride} apart need more than {} values",
            q.len()
        )));
    }
    for (si, s) in seqs.iter().enumerate() {
        if s.q_len > s.context_len
            || s.context_len > s.block_table.len() * layout.block_size
            || s.q_len > rows
            || s.q_start > rows - s.q_len
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
    }
    // Each output row is one sequence's (the merge below writes rows from several threads).
    let mut spans: Vec<(usize, usize)> = seqs
        .iter()
        .filter(|s| s.q_len > 0)
        .map(|s| (s.q_start, s.q_start + s.q_len))
        .collect();
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[1].0 < w[0].1) {
        return Err(KernelError::Shape(
            "paged_attention: two sequences share query rows".into(),
        ));
    }
    // Work items: one per (tile of query rows, KV head, run of segments). A tile is up to `tile`
    // consecutive rows of one sequence, and the query heads that share a KV head are done
    // together, so each key and value row is read once for the whole tile.
    //
    // Batch-invariant: every row's keys are cut at the same absolute positions, multiples of
    // [`SEGMENT`], whatever the tile, the batch or the threads; each segment's partial softmax
    // is computed alone (lanes aligned to its first key, keys a row may not see masked to
    // exact zeros) and the partials are merged in segment order by one formula. So a row gives
    // the same bits in a prefill tile of 8 rows, a chunk of one, or a decode step among 64
    // others. Only how segments are grouped into items follows the batch: where the tiles and
    // KV heads are fewer than the cores' share of work (a decode row alone, a few rows of
    // proposed tokens to verify), a tile's segments are spread over items so every core has
    // work (flash-decoding); otherwise a tile is one item.
    let kvh_n = layout.num_kv_heads;
    let tile = (KEYS_T_TILE / group).max(1);
    let target = 4 * rayon::current_num_threads();
    let tiles: usize = seqs.iter().map(|s| s.q_len.div_ceil(tile)).sum();
    let pairs = tiles * kvh_n;
    //
    // A sequence's items run KV head by KV head, so the tiles a task takes in turn read the same
    // head's keys and values (a 2048-token context's are 1 MiB a head, 3 MiB for the model's
    // three); a decode row's heads follow each other, reading the same blocks.
    //
    // Where there are fewer tiles and KV heads than the cores' share of work, every tile's
    // segments are spread over items (a decode row alone, a verification of a few proposed
    // tokens): its items then go segment by segment, each segment's for every tile of the
    // sequence in turn, so that a task's tiles read a segment's keys and values from memory
    // once between them.
    let mut items = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for kvh in 0..kvh_n {
            let first = items.len();
            for i0 in (0..s.q_len).step_by(tile) {
                let rows = tile.min(s.q_len - i0);
                let first_pos = s.context_len - s.q_len + i0;
                let (lo, hi) = (spec.first_key(first_pos), first_pos + rows);
                // Segments with a key some row of the tile sees.
                let (s0, s1) = (lo / SEGMENT, hi.div_ceil(SEGMENT));
                let per_item = if pairs >= target {
                    s1 - s0
                } else {
                    (s1 - s0).div_ceil(target.div_ceil(pairs)).max(1)
                };
                for g0 in (s0..s1).step_by(per_item) {
                    items.push(Item {
                        row: s.q_start + i0,
                        rows,
                        first_pos,
                        seq: si,
                        kvh,
                        s0: g0,
                        s1: (g0 + per_item).min(s1),
                        hi,
                        whole: per_item >= s1 - s0,
                    });
                }
            }
            if pairs < target {
                // (Stable: a tile's items stay in segment order.)
                items[first..].sort_by_key(|it| it.s0);
            }
        }
    }
    // Each item's partial softmaxes, one per segment (maxes, sums, outputs). A whole item (a
    // tile whose segments are not spread over several items) keeps them in its task's scratch
    // and merges them into its rows there, while they are in cache. Those of split items (a
    // few-tile batch's, so that a long decode row has every core) go to one buffer carved into
    // disjoint slices, merged after every task is done. The tasks take runs of consecutive
    // items.
    let gw = group * hd;
    let seg_len = |it: &Item| it.rows * group * (2 + hd);
    let segs_len = |it: &Item| seg_len(it) * (it.s1 - it.s0);
    let part_len = |it: &Item| if it.whole { 0 } else { segs_len(it) };
    //
    // The buffer is kept from call to call, one for the process, up to [`KEPT_PARTS`] values (a
    // fresh zeroed buffer every layer cost a few percent of attention). (Taken out while in
    // use, so a call beside this one, a tensor-parallel rank's, or nested in its parallel loop
    // makes its own.) Every value a merge reads is written by `attend_tile` first.
    let mut parts = std::mem::take(&mut *PARTS.lock().unwrap_or_else(|e| e.into_inner()));
    let total: usize = items.iter().map(part_len).sum();
    if parts.len() < total {
        parts.resize(total, 0.0);
    }
    let mut jobs: Vec<(&Item, &mut [f32])> = Vec::with_capacity(items.len());
    let mut rest = &mut parts[..];
    for it in &items {
        let (mine, after) = rest.split_at_mut(part_len(it));
        jobs.push((it, mine));
        rest = after;
    }
    // Rows without a sequence are zeroed; the others are written by the merges (zeroing the
    // whole output first cost a 2048-token prefill 5 MB of stores a layer).
    let mut from = 0;
    for &(a, b) in spans.iter().chain(std::iter::once(&(rows, rows))) {
        out[from * width..a * width].fill(0.0);
        from = b;
    }
    let (dst, len) = (OutPtr(out.as_mut_ptr()), out.len());
    // Writes the merged rows of the tile and KV head of `first` from its partials `segs`.
    let merge = |first: &Item, segs: &[&[f32]]| {
        let nq = first.rows * group;
        for r in 0..first.rows {
            let at = (first.row + r) * width + first.kvh * gw;
            assert!(at + gw <= len, "merge outside the output");
            // SAFETY: `at..at + gw` is inside `out` (asserted) and is this tile's row r for
            // this KV head: no other merge writes it (a row is one sequence's, checked above,
            // and a tile and KV head are one whole item's or one group of split items').
            let o = unsafe { std::slice::from_raw_parts_mut(dst.at(at), gw) };
            merge_parts(segs, nq, r * group, group, hd, o);
        }
    };
    let per_task = items.len().div_ceil(target).clamp(1, MAX_ITEMS_PER_TASK);
    // The tasks are handed out in turn to whichever thread is free: a prefill's tasks differ
    // in cost (a tile late in the prompt has more keys than an early one), and splitting them
    // in halves, as a parallel loop over the slice does, left a thread idle for 6-14% of the
    // call (median 12%) where this leaves it 2-8% (median 4.5%): `examples/decode_attention`,
    // 200 tokens, 2 threads of a Zen 4, 30 layers 10.5-13.1 ms against 9.7-11.8 (five rounds).
    jobs.chunks_mut(per_task).par_bridge().for_each(|run| {
        // The run's key and value ranges in the order they are read, fetched a few ahead of
        // use across item boundaries: a decode item reads a few KiB from each of a few blocks
        // scattered in the pool, too little for the hardware prefetcher to find the stream.
        //
        // So does a split item's task (a few rows alone, their tiles taking a segment in turn:
        // the rows of proposed tokens to verify). A prefill tile reads each range once for many
        // rows' work, long enough for the prefetcher and the caches: its task asks for nothing
        // (the requests cost a tenth of a prefill's attention: `examples/decode_attention` with
        // `QLEN`).
        let mut ahead = Ahead {
            on: run.iter().any(|(it, _)| it.rows == 1 || !it.whole),
            ..Ahead::default()
        };
        let (bs, k_len) = (layout.block_size, hd * layout.block_size);
        for (it, _) in run.iter().filter(|_| ahead.on) {
            for (j0, j1) in it.segments() {
                let runs = || block_runs(seqs[it.seq].block_table, bs, j0, j1);
                let keys = runs().map(|(blk, ..)| (layout.kt_at(blk, it.kvh), k_len));
                ahead.ranges.extend(keys);
                let values =
                    runs().map(|(blk, off, len, _)| (layout.v_at(blk, it.kvh, off), len * hd));
                ahead.ranges.extend(values);
            }
        }
        // The tiles' query vectors, tile after tile and row after row, each row's grouped heads
        // contiguous.
        let mut qt = Vec::new();
        let mut qts = Vec::with_capacity(run.len());
        for (it, _) in run.iter() {
            let at0 = qt.len();
            for r in it.row..it.row + it.rows {
                let at = r * q_stride + it.kvh * gw;
                qt.extend_from_slice(&q[at..at + gw]);
            }
            qts.push(at0..qt.len());
        }
        // (item, segment) in the order they run. Prefill tiles go segment by segment, each
        // segment for every tile of the run that sees it: a segment's keys and values (128 KiB
        // a head of the model) are read from memory once for the run, and from L2 after, where
        // tile after tile over the whole context read each block-head from L3 (a 2048-token
        // context is 3 MiB a layer). Decode items, whose ranges are asked for ahead in item
        // order, go item by item. Each (item, segment) is computed alone: the order changes no
        // bit.
        let order: Vec<(usize, usize)> = if ahead.on {
            run.iter()
                .enumerate()
                .flat_map(|(i, (it, _))| (it.s0..it.s1).map(move |g| (i, g)))
                .collect()
        } else {
            let g0 = run.iter().map(|(it, _)| it.s0).min().unwrap_or(0);
            let g1 = run.iter().map(|(it, _)| it.s1).max().unwrap_or(0);
            (g0..g1)
                .flat_map(|g| {
                    run.iter()
                        .enumerate()
                        .filter(move |(_, (it, _))| (it.s0..it.s1).contains(&g))
                        .map(move |(i, _)| (i, g))
                })
                .collect()
        };
        // The whole items' partials, item after item, in this thread's kept scratch.
        let mut local = LOCAL_PARTS.with(|c| std::mem::take(&mut *c.borrow_mut()));
        let mut at = Vec::with_capacity(run.len());
        let mut need = 0;
        for (it, _) in run.iter() {
            at.push(need);
            if it.whole {
                need += segs_len(it);
            }
        }
        if local.len() < need {
            local.resize(need, 0.0);
        }
        let mut bufs = TileBufs::default();
        // The items whose value kernel wrote their outputs (no merge left to do).
        let mut written = vec![false; run.len()];
        for (i, g) in order {
            let (it, part) = &mut run[i];
            if it.whole && g + 1 == it.s1 {
                // The rows this item's merge (or value kernel) will write, asked for as its last
                // segment starts: the output has left the caches since the layer before read
                // it, and the merges' stores waited on it (11% of a 200-token prefill's
                // attention samples; asked for, 7% less attention against the products'
                // samples: `perf`, `tandem bench engine --prompt-len 200 --rounds 25`, a 2-core
                // Zen 4).
                for r in it.row..it.row + it.rows {
                    let at = r * width + it.kvh * gw;
                    if at + gw <= len {
                        // SAFETY: `at..at + gw` is inside `out` (checked); nothing is accessed.
                        prefetch_t0(unsafe { dst.at(at) }, gw);
                    }
                }
            }
            let seg = seg_len(it);
            let part = if it.whole {
                &mut local[at[i]..at[i] + segs_len(it)]
            } else {
                &mut part[..]
            };
            // A whole item of one segment: its value kernel may write the outputs itself.
            let to = (it.whole && it.s1 - it.s0 == 1).then_some(TileOut {
                dst: &dst,
                width,
                len,
            });
            written[i] = attend_tile(
                &cache,
                layout,
                &seqs[it.seq],
                it,
                it.segment(g),
                spec,
                &qt[qts[i].clone()],
                &mut bufs,
                &mut ahead,
                &mut part[(g - it.s0) * seg..][..seg],
                to,
            );
        }
        let merged = run
            .iter()
            .enumerate()
            .filter(|&(i, (it, _))| it.whole && !written[i]);
        for (i, (it, _)) in merged {
            let segs: Vec<&[f32]> = local[at[i]..at[i] + segs_len(it)]
                .chunks_exact(seg_len(it))
                .collect();
            merge(it, &segs);
        }
        if local.len() <= KEPT_LOCAL_PARTS {
            LOCAL_PARTS.with(|c| {
                let mut kept = c.borrow_mut();
                if kept.len() < local.len() {
                    *kept = local;
                }
            });
        }
    });
    // The split items' merge, a tile and KV head at a time (its items gathered in segment
    // order), in parallel: each writes its own rows' heads of that KV head. Which thread merges
    // changes no bit, nor does where a partial was kept.
    let mut split: Vec<(&Item, &[f32])> = jobs
        .iter()
        .filter(|(it, _)| !it.whole)
        .map(|(it, part)| (*it, &part[..]))
        .collect();
    split.sort_by_key(|(it, _)| (it.row, it.kvh, it.s0));
    let groups: Vec<_> = split
        .chunk_by(|(a, _), (b, _)| a.row == b.row && a.kvh == b.kvh)
        .collect();
    groups.par_iter().for_each(|group_items| {
        let segs: Vec<&[f32]> = group_items
            .iter()
            .flat_map(|(it, part)| part.chunks_exact(seg_len(it)))
            .collect();
        merge(group_items[0].0, &segs);
    });
    drop(groups);
    drop(split);
    drop(jobs);
    if parts.len() <= KEPT_PARTS {
        let mut kept = PARTS.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < parts.len() {
            *kept = parts;
        }
    }
    Ok(())
}

/// Most partial-softmax values the process keeps between calls (16 MiB) in its buffer of split
/// items: `group × (2 + head_dim)` values a decode row and segment (198 for the model's heads),
/// up to a few hundred KB a step.
const KEPT_PARTS: usize = 4 << 20;

/// Most values each thread keeps between tasks (2 MiB) in its scratch of whole items: a task's
/// need about 50 KB a segment at 64-value heads (8 tiles of 24 query vectors), 400 KB over a
/// 2048-token context, 1.6 MB over 8192. A task over a longer context makes a scratch of its own
/// and drops it (zeroed for each layer: slower, not wrong), so that no thread of any pool holds
/// more than this for good.
const KEPT_LOCAL_PARTS: usize = 1 << 19;

/// [`paged_attention`]'s partial softmaxes of split items, kept for the next call.
static PARTS: std::sync::Mutex<Vec<f32>> = std::sync::Mutex::new(Vec::new());

thread_local! {
    /// A task's partial softmaxes of whole items, kept for the next task on this thread.
    static LOCAL_PARTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Keys per segment of a row's context: the fixed cut points of its partial softmaxes (see
/// [`paged_attention`]). Long enough that a prefill row's merge is a small part of its work
/// (2048 keys: 8 partials of 64 values), short enough that one long decode row splits over
/// the cores.
pub const SEGMENT: usize = 256;

struct Item {
    /// First query row of the tile in the packed batch, and how many rows it has.
    row: usize,
    rows: usize,
    /// Position of the tile's first row in its sequence.
    first_pos: usize,
    seq: usize,
    kvh: usize,
    /// The segments this item computes, `s0..s1`.
    s0: usize,
    s1: usize,
    /// One past the tile's last row's position: no key from here is seen.
    hi: usize,
    /// Whether the item computes every segment of its tile and KV head (its task merges them).
    whole: bool,
}

impl Item {
    /// The key ranges of the item's segments, in order: each starts at its segment's first key
    /// (so vector lanes line up with absolute positions) and ends at the segment's end or `hi`.
    fn segments(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (self.s0..self.s1).map(|g| self.segment(g))
    }

    /// The key range of segment `g`, one of the item's.
    fn segment(&self, g: usize) -> (usize, usize) {
        (g * SEGMENT, ((g + 1) * SEGMENT).min(self.hi))
    }
}

/// Lanes of the widest vector [`exp_shifted_sum`] sums in (AVX-512's; the others' divide it): a
/// row's exponentials started this many keys later put every key in the same lane.
const EXP_LANES: usize = 16;

/// Most blocks' values one call of the value kernel takes where a task asks for its ranges
/// ahead (see [`attend_tile`]).
const VALUE_RUNS: usize = 4;

/// Most runs of keys or values (a block-head's each) one call of [`KvSlab::dot_keys`] or
/// [`KvSlab::accumulate_rows`] takes: a whole segment's at the default block size, which a
/// prefill tile hands over in one call of each.
const RUNS_A_CALL: usize = 16;

/// Most consecutive work items one task takes: 64 rows of a sequence for a KV head at 3
/// query heads a KV head, as before tiles grew from 12 query vectors to 24 (16 items then).
const MAX_ITEMS_PER_TASK: usize = 8;

/// How many cache ranges (a block-head's keys or a run of its values, a few KiB each) are
/// requested ahead of the one in use. Measured with `examples/decode_attention` on a 2-core
/// Zen 4 (32 sequences of 64 tokens, AVX2): none 4.4 ms a step, 1 to 3 ranges 3.9–4.0, 8 4.5.
const PREFETCH_RANGES: usize = 2;

/// The cache ranges a task reads, in order, and how far it has asked for them.
#[derive(Default)]
struct Ahead {
    /// Whether the task asks for its ranges at all.
    on: bool,
    /// (offset, values) of each range.
    ranges: Vec<(usize, usize)>,
    /// Ranges used so far, and ranges requested so far.
    used: usize,
    asked: usize,
}

impl Ahead {
    /// The next range is about to be read: request those up to [`PREFETCH_RANGES`] past it.
    fn next(&mut self, cache: &KvSlab<'_>) {
        if !self.on {
            return;
        }
        let until = (self.used + 1 + PREFETCH_RANGES).min(self.ranges.len());
        while self.asked < until {
            let (at, len) = self.ranges[self.asked];
            cache.prefetch(at, len);
            self.asked += 1;
        }
        self.used += 1;
    }
}

/// A task's working buffers, reused by its items.
#[derive(Default)]
struct TileBufs {
    /// Scores, then probabilities, of each query vector against the item's keys.
    scores: Vec<f32>,
    /// Int8 values converted to f32.
    conv: Vec<f32>,
    /// Each query vector's `1 / sum` and output row, where the value kernel writes the tile's
    /// outputs itself.
    inv: Vec<f32>,
    outs: Vec<*mut f32>,
}

/// The output a tile of one segment is written to by its value kernel (see [`attend_tile`]):
/// `len` values, rows `width` apart.
#[derive(Clone, Copy)]
struct TileOut<'o> {
    dst: &'o OutPtr,
    width: usize,
    len: usize,
}

/// Softmax attention of a tile's `nq` query vectors (`qt`, nq×hd; vector `r·g + h` is head
/// `h` of the tile's row `r`) over keys `j0..j1` of one KV head, one segment, each row masked
/// causally at its own position (and below its window's first key). Writes, per vector, the
/// segment's max, the sum of exponentials and the unnormalized output into `part` (`nq × (2 +
/// hd)` values: maxes, then sums, then outputs); a vector that sees no key of the segment gets
/// max −∞, sum 0 and output 0, which the merge weighs by exactly 0. `ahead` holds the ranges
/// this reads, in order (keys, then values).
///
/// Given `to` (the item is its tile's only segment), the outputs, normalized as the merge of
/// one partial would, go to the tile's rows of the output instead where one call of the value
/// kernel takes the segment; returns whether they did (then `part` holds no outputs).
#[allow(clippy::too_many_arguments)]
fn attend_tile(
    cache: &KvSlab<'_>,
    layout: KvLayout,
    s: &SeqAttn<'_>,
    it: &Item,
    (j0, j1): (usize, usize),
    spec: AttnSpec,
    qt: &[f32],
    bufs: &mut TileBufs,
    ahead: &mut Ahead,
    part: &mut [f32],
    to: Option<TileOut<'_>>,
) -> bool {
    let (hd, bs, scale) = (layout.head_dim, layout.block_size, spec.scale);
    let TileBufs {
        scores,
        conv,
        inv,
        outs,
    } = bufs;
    let nq = qt.len() / hd;
    let g = nq / it.rows;
    let n = j1 - j0;
    // Every score is written below (the runs cover j0..j1), so the buffer is only grown.
    if scores.len() < nq * n {
        scores.resize(nq * n, 0.0);
    }
    // Keys a call: where the task asks for its ranges ahead (a decode row's), two blocks (the
    // AVX-512 kernel's pieces go in pairs), each asked for as it comes; otherwise (a prefill
    // tile's, from L2) a segment's blocks at once, the calls' overhead spread over them (in a
    // profile of a 2048-token prefill on Zen 4 the calls between attention's kernels took 4.2%
    // of its time at two blocks a call, 2.5% at a segment).
    let (key_runs, value_runs) = if ahead.on {
        (2, VALUE_RUNS)
    } else {
        (RUNS_A_CALL, RUNS_A_CALL)
    };
    let mut runs = block_runs(s.block_table, bs, j0, j1).peekable();
    while let Some(&(.., at)) = runs.peek() {
        let mut keys = [(0, 0, 0, 0); RUNS_A_CALL];
        let mut count = 0;
        while let Some((blk, off, run, _)) = runs.next_if(|_| count < key_runs) {
            ahead.next(cache);
            let kt = layout.kt_at(blk, it.kvh);
            keys[count] = (kt, off, run, layout.scale_at(blk, 0, it.kvh));
            count += 1;
        }
        let keys = &keys[..count];
        cache.dot_keys(layout, qt, nq, keys, scale, &mut scores[at..], n, conv);
    }
    // Row r sees keys from its window's first key up to its own position. The softmax runs
    // over the row up to its last key seen (lanes line up with the keys as over the whole row,
    // and masked keys would add exp(-inf) = +0 to their lanes: the same bits); the keys after
    // it get weight 0 without being read back, and the window's first unseen keys -inf.
    for r in 0..it.rows {
        let pos = it.first_pos + r;
        let end = (pos + 1).clamp(j0, j1) - j0;
        let first_seen = spec.first_key(pos).clamp(j0, j1) - j0;
        for v in r * g..(r + 1) * g {
            let row = &mut scores[v * n..(v + 1) * n];
            let (seen, after) = row.split_at_mut(end);
            let masked = first_seen.min(end);
            let max = max_f32(&seen[masked..]);
            // The window's unseen keys: whole vectors of them (of any level's lanes) would add
            // +0 to each lane of the sum, so they get their zeros without exponentials (which
            // take a slower path for −∞); the rest of a vector is −∞.
            let skip = masked / EXP_LANES * EXP_LANES;
            seen[..skip].fill(0.0);
            seen[skip..masked].fill(f32::NEG_INFINITY);
            part[v] = max;
            part[nq + v] = if max == f32::NEG_INFINITY {
                // No key of this segment is seen: weights of exactly zero.
                seen.fill(0.0);
                0.0
            } else {
                exp_shifted_sum(&mut seen[skip..], max)
            };
            after.fill(0.0);
        }
    }
    // Where the item is the tile's only segment and its values take one call, that call writes
    // the tile's outputs (`to`), normalized as the merge of one partial would: the
    // accumulators start at zero in registers and go straight to the output rows, not to the
    // partials and back through the merge.
    let value_calls = block_runs(s.block_table, bs, j0, j1)
        .count()
        .div_ceil(value_runs);
    let to = to.filter(|_| value_calls == 1);
    let (stats, acc) = part.split_at_mut(2 * nq);
    if let Some(to) = to {
        inv.clear();
        outs.clear();
        for v in 0..nq {
            // The merge's factor, 1 / sum (every row of a one-segment tile sees a key).
            inv.push(1.0 / stats[nq + v]);
            let at = (it.row + v / g) * to.width + it.kvh * g * hd + (v % g) * hd;
            assert!(at + hd <= to.len, "attention output outside the output");
            // SAFETY: inside the output (asserted); the row's head is this tile's alone.
            outs.push(unsafe { to.dst.at(at) });
        }
    } else {
        acc.fill(0.0);
    }
    // A few blocks' values a call where ranges are asked for ahead: the accumulators stay in
    // registers across them, and the blocks (4 KiB a head of the model each) stay in L1 for the
    // tile's second register group. A prefill tile's segment at once.
    let mut runs = block_runs(s.block_table, bs, j0, j1).peekable();
    while let Some(&(.., at)) = runs.peek() {
        let mut values = [(0, 0, 0); RUNS_A_CALL];
        let mut count = 0;
        while let Some((blk, off, run, _)) = runs.next_if(|_| count < value_runs) {
            ahead.next(cache);
            let v_at = layout.v_at(blk, it.kvh, off);
            values[count] = (v_at, run, layout.scale_at(blk, 1, it.kvh) + off);
            count += 1;
        }
        let fin = to.map(|_| Finish {
            inv: &inv[..],
            out: &outs[..],
        });
        // SAFETY: each output row's head of `outs` has `hd` values inside the output (asserted
        // above), written by this tile alone (its rows are one sequence's, and the tile and KV
        // head one item's), and read by no one until the call returns.
        unsafe {
            let p = (&scores[at..], n);
            cache.accumulate_rows(layout, &values[..count], p, acc, conv, fin);
        }
    }
    to.is_some()
}

/// Asks for the cache lines of `len` values at `p` (a hint: nothing is read or written).
#[inline]
fn prefetch_t0<T>(p: *const T, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for byte in (0..len * std::mem::size_of::<T>()).step_by(64) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint and faults on no address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().wrapping_add(byte)) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, len);
}

/// Positions `j0..j1` of a sequence as runs within one block each:
/// `(physical block, offset in it, length, offset from j0)`.
fn block_runs(
    table: &[u32],
    bs: usize,
    j0: usize,
    j1: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize)> + '_ {
    let mut j = j0;
    std::iter::from_fn(move || {
        if j >= j1 {
            return None;
        }
        let (blk, off) = (table[j / bs] as usize, j % bs);
        let run = (bs - off).min(j1 - j);
        let item = (blk, off, run, j - j0);
        j += run;
        Some(item)
    })
}

/// Combines vectors `v0..v0+g` of the partial softmaxes of one tile and KV head (each part holds
/// `nq` vectors) into normalized outputs `o` (g×hd).
fn merge_parts(parts: &[&[f32]], nq: usize, v0: usize, g: usize, hd: usize, o: &mut [f32]) {
    for h in 0..g {
        let v = v0 + h;
        let oh = &mut o[h * hd..(h + 1) * hd];
        let acc = 2 * nq + v * hd..2 * nq + (v + 1) * hd;
        if let [p] = parts {
            let inv = 1.0 / p[nq + v];
            // `+ 0.0`: a zero output is +0 on both paths (the merge below adds into +0).
            for (y, x) in oh.iter_mut().zip(&p[acc.clone()]) {
                *y = x * inv + 0.0;
            }
            continue;
        }
        let max = parts.iter().map(|p| p[v]).fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        oh.fill(0.0);
        for p in parts {
            let w = (p[v] - max).exp();
            sum += w * p[nq + v];
            axpy(w, &p[acc.clone()], oh);
        }
        let inv = 1.0 / sum;
        oh.iter_mut().for_each(|y| *y = *y * inv + 0.0);
    }
}

/// Plain attention over contiguous K/V (context × kv_heads·head_dim) for `q_len` queries that are
/// the last of the context, within `spec`'s window. The reference the paged kernel is tested
/// against.
pub fn reference_attention(
    q: &[f32],
    spec: AttnSpec,
    k: &[f32],
    v: &[f32],
    num_kv_heads: usize,
    head_dim: usize,
) -> Vec<f32> {
    let (n_heads, scale) = (spec.n_heads, spec.scale);
    let width = n_heads * head_dim;
    let kw = num_kv_heads * head_dim;
    let q_len = q.len() / width;
    let ctx = k.len() / kw;
    let group = n_heads / num_kv_heads;
    let mut out = vec![0f32; q.len()];
    for i in 0..q_len {
        let n = ctx - q_len + i + 1;
        let first = spec.first_key(n - 1);
        for h in 0..n_heads {
            let kvh = h / group;
            let qh = &q[i * width + h * head_dim..i * width + (h + 1) * head_dim];
            let s: Vec<f64> = (first..n)
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
                let acc: f64 = (first..n)
                    .map(|j| e[j - first] / z * v[j * kw + kvh * head_dim + d] as f64)
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

    /// A random cache of one dtype (0 f32, 1 f16, 2 int8) for sequences of `ctxs` tokens, the
    /// block tables scattered; sequence 0's K/V rows are kept so they can be written later.
    struct TestCache {
        dtype: usize,
        f32s: Vec<f32>,
        f16s: Vec<half::f16>,
        i8s: Vec<i8>,
        scales: Vec<f32>,
        tables: Vec<Vec<u32>>,
        /// Sequence 0's K and V rows and slots.
        probe: (Vec<f32>, Vec<f32>, Vec<usize>),
    }

    impl TestCache {
        /// Every sequence's rows written but sequence 0's from position `probe_upto` on.
        fn new(
            rng: &mut rand_chacha::ChaCha8Rng,
            layout: KvLayout,
            ctxs: &[usize],
            dtype: usize,
            probe_upto: usize,
        ) -> Self {
            let bs = layout.block_size;
            let blocks: usize = ctxs.iter().map(|c| c.div_ceil(bs)).sum();
            let n = blocks * layout.block_floats();
            let mut free: Vec<u32> = (0..blocks as u32).collect();
            free.shuffle(rng);
            let kw = layout.num_kv_heads * layout.head_dim;
            let mut c = Self {
                dtype,
                f32s: vec![0f32; n],
                f16s: vec![half::f16::ZERO; n],
                i8s: vec![0i8; n],
                scales: vec![0f32; blocks * layout.block_scales()],
                tables: Vec::new(),
                probe: Default::default(),
            };
            for (i, &ctx) in ctxs.iter().enumerate() {
                let table: Vec<u32> = (0..ctx.div_ceil(bs)).map(|_| free.pop().unwrap()).collect();
                let k: Vec<f32> = (0..ctx * kw).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let v: Vec<f32> = (0..ctx * kw).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let slots: Vec<usize> = (0..ctx)
                    .map(|p| table[p / bs] as usize * bs + p % bs)
                    .collect();
                c.tables.push(table);
                if i == 0 {
                    c.probe = (k, v, slots);
                    c.write_probe(layout, 0, probe_upto);
                } else {
                    write_kv(&mut c.slab_mut(), layout, &k, &v, &slots).unwrap();
                }
            }
            c
        }

        /// Writes sequence 0's positions `a..b`.
        fn write_probe(&mut self, layout: KvLayout, a: usize, b: usize) {
            let kw = layout.num_kv_heads * layout.head_dim;
            let (k, v, slots) = std::mem::take(&mut self.probe);
            let (ks, vs) = (&k[a * kw..b * kw], &v[a * kw..b * kw]);
            write_kv(&mut self.slab_mut(), layout, ks, vs, &slots[a..b]).unwrap();
            self.probe = (k, v, slots);
        }

        fn slab_mut(&mut self) -> KvSlabMut<'_> {
            match self.dtype {
                0 => KvSlabMut::F32(&mut self.f32s),
                1 => KvSlabMut::F16(&mut self.f16s),
                _ => KvSlabMut::Int8 {
                    data: &mut self.i8s,
                    scales: &mut self.scales,
                },
            }
        }

        /// Every value and scale of every cache type, as bits.
        fn bits(&self) -> Vec<u32> {
            let f = self.f32s.iter().chain(&self.scales).map(|x| x.to_bits());
            let h = self.f16s.iter().map(|x| x.to_bits() as u32);
            f.chain(h)
                .chain(self.i8s.iter().map(|&x| x as u8 as u32))
                .collect()
        }

        fn slab(&self) -> KvSlab<'_> {
            match self.dtype {
                0 => KvSlab::F32(&self.f32s),
                1 => KvSlab::F16(&self.f16s),
                _ => KvSlab::Int8 {
                    data: &self.i8s,
                    scales: &self.scales,
                },
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// Batch invariance: a sequence's attention rows are the same bits computed all at
        /// once, in random chunks (chunked prefill, a prefix hit: each chunk's rows written to
        /// the cache just before it runs, as a step does), the last few rows (a verification),
        /// one row at a time (decode), alone or among random other sequences, on 1 to 3
        /// threads, for f32, f16 and int8 caches, with and without a window, across the segment
        /// cuts.
        #[test]
        fn a_sequences_rows_do_not_depend_on_the_batch(
            seed in any::<u64>(),
            kv_heads in 1usize..4,
            group in 1usize..4,
            hd in prop::sample::select(vec![16usize, 64]),
            ctx in 1usize..700,
            new_frac in 0.0f64..1.0,
            dtype in 0usize..3,
            window in prop::option::of(1usize..400),
        ) {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let n_heads = kv_heads * group;
            let layout = KvLayout { block_size: 16, num_kv_heads: kv_heads, head_dim: hd };
            let q_len = ((ctx as f64 * new_frac) as usize).clamp(1, ctx);
            let others: Vec<usize> = (0..rng.gen_range(0..6)).map(|_| rng.gen_range(1..400)).collect();
            let mut ctxs = vec![ctx];
            ctxs.extend(&others);
            let cache_seed = rng.gen::<u64>();
            let new_cache = |upto| {
                let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(cache_seed);
                TestCache::new(&mut r, layout, &ctxs, dtype, upto)
            };
            // Every row written before attention runs, and only the prefix before the chunks.
            let full = new_cache(ctx);
            let mut growing = new_cache(ctx - q_len);
            let spec = AttnSpec { n_heads, scale: 1.0 / (hd as f32).sqrt(), window };
            let width = n_heads * hd;
            let q: Vec<f32> = (0..q_len * width).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let pool = |t| rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap();
            // The probe's rows `a..b` (the last of a context of `ctx - q_len + b`), after `lead`
            // rows of other sequences' queries, on `threads` threads.
            let run = |cache: &TestCache, a: usize, b: usize, with_others: bool, threads: usize, rng: &mut rand_chacha::ChaCha8Rng| {
                let mut seqs = Vec::new();
                let mut qs = Vec::new();
                if with_others {
                    for (i, &c) in others.iter().enumerate() {
                        let n = rng.gen_range(1..=c.min(20));
                        seqs.push(SeqAttn { q_start: qs.len() / width, q_len: n, context_len: c, block_table: &cache.tables[i + 1] });
                        qs.extend((0..n * width).map(|_| rng.gen_range(-1.0f32..1.0)));
                    }
                }
                let at = qs.len() / width;
                seqs.push(SeqAttn { q_start: at, q_len: b - a, context_len: ctx - q_len + b, block_table: &cache.tables[0] });
                qs.extend_from_slice(&q[a * width..b * width]);
                let mut out = vec![0f32; qs.len()];
                pool(threads).install(|| paged_attention(&qs, spec, cache.slab(), layout, &seqs, &mut out)).unwrap();
                out[at * width..].to_vec()
            };
            let whole = run(&full, 0, q_len, false, 1, &mut rng);
            // Random chunks, each written and then run among the others on 2 or 3 threads.
            let mut a = 0;
            let mut chunked = Vec::new();
            while a < q_len {
                let b = (a + rng.gen_range(1..=q_len)).min(q_len);
                let threads = rng.gen_range(2..=3);
                growing.write_probe(layout, ctx - q_len + a, ctx - q_len + b);
                chunked.extend(run(&growing, a, b, true, threads, &mut rng));
                a = b;
            }
            // The last rows one at a time, alone on two threads (a decode row split over the
            // cores) and among others.
            let last = q_len - 1;
            let alone = run(&full, last, q_len, false, 2, &mut rng);
            let among = run(&growing, last, q_len, true, 3, &mut rng);
            // The last few rows alone on two threads (a verification of proposed tokens, its
            // tiles spread over the cores segment by segment).
            let few_from = q_len.saturating_sub(rng.gen_range(2..=6));
            let few = run(&full, few_from, q_len, false, 2, &mut rng);
            for (i, (x, y)) in whole.iter().zip(&chunked).enumerate() {
                prop_assert_eq!(x.to_bits(), y.to_bits(), "row {} value {}: whole {} chunked {}", i / width, i % width, x, y);
            }
            for (i, (x, y)) in whole[few_from * width..].iter().zip(&few).enumerate() {
                prop_assert_eq!(x.to_bits(), y.to_bits(), "row {} value {}: whole {} few alone {}", few_from + i / width, i % width, x, y);
            }
            let tail = &whole[last * width..];
            for (i, ((x, y), z)) in tail.iter().zip(&alone).zip(&among).enumerate() {
                prop_assert_eq!(x.to_bits(), y.to_bits(), "last row value {}: whole {} alone {}", i, x, y);
                prop_assert_eq!(x.to_bits(), z.to_bits(), "last row value {}: whole {} among others {}", i, x, z);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Attention over a scattered block table equals attention over the same K/V laid out
        /// contiguously: random shapes, GQA ratios, block sizes, prefix lengths, several
        /// sequences, with and without a sliding window (shorter and longer than the contexts).
        #[test]
        fn paged_equals_contiguous(
            seed in any::<u64>(),
            kv_heads in 1usize..4,
            group in 1usize..4,
            hd_pow in 2u32..8,
            block_size in prop::sample::select(vec![1usize, 2, 4, 16]),
            lens in prop::collection::vec((1usize..40, prop_oneof![0usize..40, 200usize..600]), 1..4),
            dtype in 0usize..3,
            window in prop::option::of(prop_oneof![1usize..90, 200usize..500]),
        ) {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let hd = 1usize << hd_pow;
            let n_heads = kv_heads * group;
            let layout = KvLayout { block_size, num_kv_heads: kv_heads, head_dim: hd };
            let total_blocks: usize = lens.iter().map(|(n, p)| (n + p).div_ceil(block_size)).sum::<usize>() + 3;
            let mut cache = vec![f32::NAN; total_blocks * layout.block_floats()];
            let mut hcache = vec![half::f16::NAN; total_blocks * layout.block_floats()];
            let mut qcache = vec![0i8; total_blocks * layout.block_floats()];
            let mut scales = vec![f32::NAN; total_blocks * layout.block_scales()];
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
                // Written in two chunks, as chunked prefill would.
                let cut = ctx / 2;
                for (a, b) in [(0, cut), (cut, ctx)] {
                    let mut slab = match dtype {
                        0 => KvSlabMut::F32(&mut cache),
                        1 => KvSlabMut::F16(&mut hcache),
                        _ => KvSlabMut::Int8 { data: &mut qcache, scales: &mut scales },
                    };
                    write_kv(&mut slab, layout, &k[a * kw..b * kw], &v[a * kw..b * kw], &slots[a..b]).unwrap();
                }
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
            let spec = AttnSpec { n_heads, scale: 1.0 / (hd as f32).sqrt(), window };
            let mut out = vec![0f32; q_all.len()];
            let slab = match dtype {
                0 => KvSlab::F32(&cache),
                1 => KvSlab::F16(&hcache),
                _ => KvSlab::Int8 { data: &qcache, scales: &scales },
            };
            paged_attention(&q_all, spec, slab, layout, &seqs, &mut out).unwrap();
            // f16: each value within 2^-11 of the original, relatively; int8: within half a step
            // (absmax/254).
            let tol = [1e-4, 3e-3, 2e-2][dtype];
            let mut off = 0;
            for (q, k, v) in &contiguous {
                let want = reference_attention(q, spec, k, v, kv_heads, hd);
                for (a, b) in out[off..off + q.len()].iter().zip(&want) {
                    prop_assert!((a - b).abs() < tol, "{} vs {}", a, b);
                }
                off += q.len();
            }
        }
    }

    /// The rows of one call are written per block, blocks in parallel: the cache ends up
    /// bit-identical to writing the rows one call each, in order, for every cache type. A call
    /// with one slot outside the cache writes nothing.
    #[test]
    fn a_batch_of_rows_writes_what_the_rows_one_by_one_write() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let layout = KvLayout {
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
        };
        let (blocks, kw) = (24, 16);
        let mut free: Vec<usize> = (0..blocks).collect();
        free.shuffle(&mut rng);
        // Rows of three blocks, interleaved as a step's rows of several sequences are; growing
        // magnitudes, so int8 blocks rescale.
        let slots: Vec<usize> = (0..11).map(|i| free[i % 3] * 4 + i / 3).collect();
        let k: Vec<f32> = (0..11 * kw)
            .map(|i| rng.gen_range(-1.0..1.0) * (1 + i / kw) as f32)
            .collect();
        let v: Vec<f32> = (0..11 * kw).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let n = blocks * layout.block_floats();
        let fill = |dtype: usize, calls: &[(usize, usize)]| {
            let mut f = vec![0f32; n];
            let mut h = vec![half::f16::ZERO; n];
            let (mut q, mut sc) = (vec![0i8; n], vec![0f32; blocks * layout.block_scales()]);
            for &(a, b) in calls {
                let mut slab = match dtype {
                    0 => KvSlabMut::F32(&mut f),
                    1 => KvSlabMut::F16(&mut h),
                    _ => KvSlabMut::Int8 {
                        data: &mut q,
                        scales: &mut sc,
                    },
                };
                write_kv(
                    &mut slab,
                    layout,
                    &k[a * kw..b * kw],
                    &v[a * kw..b * kw],
                    &slots[a..b],
                )
                .unwrap();
            }
            let bits: Vec<u32> = f
                .iter()
                .map(|x| x.to_bits())
                .chain(sc.iter().map(|x| x.to_bits()))
                .collect();
            (bits, h.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), q)
        };
        for dtype in 0..3 {
            let one_by_one: Vec<_> = (0..11).map(|i| (i, i + 1)).collect();
            assert_eq!(
                fill(dtype, &[(0, 11)]),
                fill(dtype, &one_by_one),
                "cache type {dtype}"
            );
        }
        // Where each value lands: dimension i of a token's keys of head h at `kt_at + i·bs +
        // slot`, its values a row at `v_at`; a slot given twice in one call keeps the later row.
        let mut cache = vec![0f32; n];
        let mut twice = slots.clone();
        twice[7] = slots[2];
        write_kv(&mut KvSlabMut::F32(&mut cache), layout, &k, &v, &twice).unwrap();
        let (hd, bs) = (layout.head_dim, layout.block_size);
        for (t, &slot) in twice.iter().enumerate().filter(|&(t, _)| t != 2) {
            let (b, s) = (slot / bs, slot % bs);
            for h in 0..layout.num_kv_heads {
                for i in 0..hd {
                    let at = t * kw + h * hd + i;
                    assert_eq!(
                        cache[layout.kt_at(b, h) + i * bs + s],
                        k[at],
                        "k {t} {h} {i}"
                    );
                    assert_eq!(cache[layout.v_at(b, h, s) + i], v[at], "v {t} {h} {i}");
                }
            }
        }
        let mut cache = vec![0f32; n];
        let mut bad = slots.clone();
        bad[5] = blocks * 4;
        let err = write_kv(&mut KvSlabMut::F32(&mut cache), layout, &k, &v, &bad).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("slot {} is outside the cache", blocks * 4)),
            "{err}"
        );
        assert!(cache.iter().all(|&x| x == 0.0), "nothing is written");
    }

    #[test]
    fn int8_rows_keep_their_own_scales() {
        let layout = KvLayout {
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let mut data = vec![0i8; layout.block_floats()];
        let mut scales = vec![0f32; layout.block_scales()];
        assert_eq!(scales.len(), 8, "K then V, a scale per slot");
        let rows = [[0.5f32, -0.25], [1.0, 0.1], [-4.0, 2.0]];
        let mut before: Option<(Vec<i8>, Vec<f32>)> = None;
        for (s, r) in rows.iter().enumerate() {
            let mut slab = KvSlabMut::Int8 {
                data: &mut data,
                scales: &mut scales,
            };
            write_kv(&mut slab, layout, r, r, &[s]).unwrap();
            // The earlier slots' values and scales are untouched, bit for bit.
            if let Some((d, sc)) = &before {
                for slot in 0..s {
                    for dim in 0..2 {
                        assert_eq!(data[dim * 4 + slot], d[dim * 4 + slot], "K slot {slot}");
                        assert_eq!(
                            data[8 + slot * 2 + dim],
                            d[8 + slot * 2 + dim],
                            "V slot {slot}"
                        );
                    }
                    assert_eq!(scales[slot].to_bits(), sc[slot].to_bits());
                    assert_eq!(scales[4 + slot].to_bits(), sc[4 + slot].to_bits());
                }
            }
            before = Some((data.clone(), scales.clone()));
        }
        for (s, r) in rows.iter().enumerate() {
            let amax = r[0].abs().max(r[1].abs());
            assert_eq!(scales[s], amax / 127.0, "K slot {s}: its own row's scale");
            assert_eq!(scales[4 + s], amax / 127.0, "V slot {s}");
            for d in 0..2 {
                // K is transposed (`[dim][slot]`), V is not (`[slot][dim]`, after K).
                let k = data[d * 4 + s] as f32 * scales[s];
                let v = data[8 + s * 2 + d] as f32 * scales[4 + s];
                // One rounding: within half a step.
                for got in [k, v] {
                    assert!(
                        (got - r[d]).abs() <= scales[s] * 0.5 + 1e-7,
                        "slot {s}: {got} vs {}",
                        r[d]
                    );
                }
            }
        }
        // A row of zeros has scale 0 and decodes to zeros.
        let mut slab = KvSlabMut::Int8 {
            data: &mut data,
            scales: &mut scales,
        };
        write_kv(&mut slab, layout, &[0.01, 0.0], &[0.0, 0.0], &[3]).unwrap();
        assert_eq!(scales[3], 0.01 / 127.0);
        assert_eq!(scales[7], 0.0);
        assert_eq!(data[3], 127);
        assert_eq!(&data[8 + 6..8 + 8], &[0, 0]);
    }

    /// The pass that prepares fused q|k|v rows and writes them: every row prepared exactly once,
    /// and the rows and the cache (each cache type) as a preparation of every row and then
    /// `write_kv_strided` leave them, over rows of three blocks with a slot given twice, at 1
    /// and 3 threads. A buffer too short for its rows is refused, nothing prepared or written.
    #[test]
    fn prepare_and_write_kv_prepares_each_row_once_before_its_write() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let layout = KvLayout {
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
        };
        let (qd, kw) = (24, 16);
        let (w, n) = (qd + 2 * kw + 3, 11);
        let fused: Vec<f32> = (0..n * w).map(|_| rng.gen_range(-2.0..2.0)).collect();
        // Blocks 5, 2 and 7; slot 21 twice (the later row wins).
        let slots = [20, 21, 22, 23, 8, 9, 10, 28, 29, 30, 21];
        // Touches queries, keys and values, differently for each row.
        let prep = |t: usize, row: &mut [f32]| {
            assert_eq!(row.len(), qd + 2 * kw);
            for (i, x) in row.iter_mut().enumerate() {
                *x = *x * 1.5 + (t * 7 + i) as f32 / 64.0;
            }
        };
        let mut want_rows = fused.clone();
        for t in 0..n {
            prep(t, &mut want_rows[t * w..t * w + qd + 2 * kw]);
        }
        let blocks = 8;
        let empty = |dtype| TestCache {
            f32s: vec![0.0; blocks * layout.block_floats()],
            f16s: vec![half::f16::ZERO; blocks * layout.block_floats()],
            i8s: vec![0; blocks * layout.block_floats()],
            scales: vec![0.0; blocks * layout.block_scales()],
            tables: Vec::new(),
            probe: Default::default(),
            dtype,
        };
        for dtype in 0..3 {
            let mut want = empty(dtype);
            write_kv_strided(&mut want.slab_mut(), layout, &want_rows[qd..], w, &slots).unwrap();
            assert!(want.bits().iter().any(|&b| b != 0));
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (mut got, mut rows) = (empty(dtype), fused.clone());
                let calls: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.install(|| {
                    prepare_and_write_kv(
                        &mut got.slab_mut(),
                        layout,
                        &mut rows,
                        w,
                        qd,
                        &slots,
                        |t, row| {
                            calls[t].fetch_add(1, Ordering::Relaxed);
                            prep(t, row)
                        },
                    )
                })
                .unwrap();
                assert!(
                    calls.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                    "each row once"
                );
                let b = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    b(&rows),
                    b(&want_rows),
                    "cache type {dtype}, {threads} threads"
                );
                assert_eq!(
                    got.bits(),
                    want.bits(),
                    "cache type {dtype}, {threads} threads"
                );
            }
        }
        // One value short of the last row: refused before anything is prepared or written.
        let mut cache = empty(0);
        let mut rows = fused.clone();
        let short = (n - 1) * w + qd + 2 * kw - 1;
        let touched = AtomicUsize::new(0);
        let r = prepare_and_write_kv(
            &mut cache.slab_mut(),
            layout,
            &mut rows[..short],
            w,
            qd,
            &slots,
            |_, _| {
                touched.fetch_add(1, Ordering::Relaxed);
            },
        );
        assert!(r.is_err());
        assert_eq!(touched.load(Ordering::Relaxed), 0);
        assert!(cache.f32s.iter().all(|&x| x == 0.0), "nothing is written");
    }

    /// Queries, keys and values read in place from fused q|k|v rows (the strided forms) give the
    /// bits of the same rows packed: the cache each write leaves, for every cache type, and the
    /// attention rows over it (two sequences, a prefill chunk and a decode row, 1 and 3 threads).
    /// Buffers too short for their rows are errors that write nothing.
    #[test]
    fn fused_rows_read_in_place_give_the_packed_rows_bits() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let layout = KvLayout {
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
        };
        let spec = AttnSpec {
            n_heads: 4,
            scale: 0.35,
            window: None,
        };
        let (qd, kw) = (
            spec.n_heads * layout.head_dim,
            layout.num_kv_heads * layout.head_dim,
        );
        // A stride wider than the row, as a padded buffer's.
        let w = qd + 2 * kw + 3;
        // Sequence 0: 9 new tokens over 3 cached; sequence 1: one new token over 13.
        let (ctxs, news) = ([12usize, 14], [9usize, 1]);
        for dtype in 0..3 {
            let mut packed = TestCache::new(&mut rng, layout, &ctxs, dtype, ctxs[0]);
            let tables = packed.tables.clone();
            let fused: Vec<f32> = (0..10 * w).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let mut slots: Vec<usize> = Vec::new();
            for (s, (&ctx, &new)) in ctxs.iter().zip(&news).enumerate() {
                slots.extend((ctx - new..ctx).map(|p| tables[s][p / 4] as usize * 4 + p % 4));
            }
            let mut strided = TestCache {
                f32s: packed.f32s.clone(),
                f16s: packed.f16s.clone(),
                i8s: packed.i8s.clone(),
                scales: packed.scales.clone(),
                tables: tables.clone(),
                probe: Default::default(),
                dtype,
            };
            let rows = |a: usize, b: usize| -> Vec<f32> {
                (0..10)
                    .flat_map(|t| fused[t * w + a..t * w + b].to_vec())
                    .collect()
            };
            let (q, k, v) = (rows(0, qd), rows(qd, qd + kw), rows(qd + kw, qd + 2 * kw));
            write_kv(&mut packed.slab_mut(), layout, &k, &v, &slots).unwrap();
            write_kv_strided(&mut strided.slab_mut(), layout, &fused[qd..], w, &slots).unwrap();
            assert_eq!(packed.bits(), strided.bits(), "cache type {dtype}");
            assert!(packed.bits().iter().any(|&b| b != 0));
            let seqs = [
                SeqAttn {
                    q_start: 0,
                    q_len: 9,
                    context_len: 12,
                    block_table: &tables[0],
                },
                SeqAttn {
                    q_start: 9,
                    q_len: 1,
                    context_len: 14,
                    block_table: &tables[1],
                },
            ];
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (mut a, mut b) = (vec![0f32; 10 * qd], vec![0f32; 10 * qd]);
                pool.install(|| {
                    paged_attention(&q, spec, packed.slab(), layout, &seqs, &mut a).unwrap();
                    let c = strided.slab();
                    paged_attention_strided(&fused, w, spec, c, layout, &seqs, &mut b).unwrap();
                });
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "cache type {dtype}, {threads} threads");
                assert!(a.iter().any(|&x| x != 0.0));
            }
        }
        // Too short for the rows, or a stride narrower than a row: errors, nothing written.
        let mut cache = vec![0f32; 8 * layout.block_floats()];
        let fused = vec![1f32; 3 * w];
        let short = &fused[qd..3 * w - 1 - 3];
        let mut slab = KvSlabMut::F32(&mut cache);
        assert!(write_kv_strided(&mut slab, layout, short, w, &[0, 1, 2]).is_err());
        assert!(write_kv_strided(&mut slab, layout, &fused[qd..], 2 * kw - 1, &[0]).is_err());
        assert!(cache.iter().all(|&x| x == 0.0), "nothing is written");
        // No rows: nothing to read.
        let mut slab = KvSlabMut::F32(&mut cache);
        assert!(write_kv_strided(&mut slab, layout, &[], w, &[]).is_ok());
        let table = [0u32];
        let one = one_row(&table, 1);
        let slab = KvSlab::F32(&cache);
        let mut out = vec![0f32; 3 * qd];
        let seq = |q_start| SeqAttn { q_start, ..one[0] };
        let run = |q: &[f32], stride, out: &mut [f32]| {
            paged_attention_strided(q, stride, spec, slab, layout, &[seq(2)], out)
        };
        assert!(run(&fused, w, &mut out).is_ok());
        let err = run(&fused[..2 * w + qd - 1], w, &mut out).unwrap_err();
        assert!(err.to_string().contains("3 query rows"), "{err}");
        assert!(run(&fused, qd - 1, &mut out).is_err());
        assert!(
            run(&fused, w, &mut out[..qd + 1]).is_err(),
            "not whole rows"
        );
    }

    /// One sequence of one new token over `context_len` tokens in `table`'s blocks.
    fn one_row(table: &[u32], context_len: usize) -> [SeqAttn<'_>; 1] {
        [SeqAttn {
            q_start: 0,
            q_len: 1,
            context_len,
            block_table: table,
        }]
    }

    /// Bad tables, an empty window, and query rows shared between sequences or outside the batch.
    #[test]
    fn bad_tables_and_rows_are_errors() {
        let layout = KvLayout {
            block_size: 2,
            num_kv_heads: 1,
            head_dim: 4,
        };
        let cache = vec![0f32; 2 * layout.block_floats()];
        let q = vec![0f32; 4];
        let mut out = vec![0f32; 4];
        let spec = AttnSpec {
            n_heads: 1,
            scale: 1.0,
            window: None,
        };
        let slab = KvSlab::F32(&cache);
        // A block outside the cache, and more tokens than the table's blocks hold.
        for (table, ctx) in [([5u32], 1), ([0u32], 3)] {
            let s = one_row(&table, ctx);
            assert!(paged_attention(&q, spec, slab, layout, &s, &mut out).is_err());
        }
        let empty = AttnSpec {
            window: Some(0),
            ..spec
        };
        let err = paged_attention(&q, empty, slab, layout, &one_row(&[0], 1), &mut out);
        assert!(err.unwrap_err().to_string().contains("window of 0"));
        // Sequences whose query rows overlap, or reach past the batch (however large the
        // start): every output row is one sequence's.
        let table = [0u32, 1];
        let seq = |q_start, q_len| SeqAttn {
            q_start,
            q_len,
            context_len: 4,
            block_table: &table,
        };
        let (q, mut out) = (vec![1f32; 4 * 4], vec![0f32; 4 * 4]);
        let mut run =
            |seqs: &[SeqAttn<'_>]| paged_attention(&q, spec, slab, layout, seqs, &mut out);
        assert!(run(&[seq(0, 2), seq(2, 2)]).is_ok());
        assert!(run(&[seq(2, 2), seq(0, 0), seq(0, 2)]).is_ok());
        for bad in [
            vec![seq(0, 3), seq(1, 2)],
            vec![seq(2, 2), seq(1, 2)],
            vec![seq(usize::MAX, 1)],
            vec![seq(3, 2)],
        ] {
            let err = run(&bad).unwrap_err().to_string();
            assert!(
                err.contains("share query rows") || err.contains("new of"),
                "{err}"
            );
        }
    }

    /// A window of one key: each row's output is its own value row, however long the context and
    /// whichever way the work is split.
    #[test]
    fn a_window_of_one_key_returns_each_rows_own_value() {
        let layout = KvLayout {
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let ctx = 300usize;
        let mut cache = vec![0f32; ctx.div_ceil(4) * layout.block_floats()];
        let k: Vec<f32> = (0..ctx * 2).map(|i| (i % 7) as f32 - 3.0).collect();
        let v: Vec<f32> = (0..ctx * 2).map(|i| i as f32).collect();
        let slots: Vec<usize> = (0..ctx).collect();
        write_kv(&mut KvSlabMut::F32(&mut cache), layout, &k, &v, &slots).unwrap();
        let table: Vec<u32> = (0..ctx.div_ceil(4) as u32).collect();
        let spec = AttnSpec {
            n_heads: 1,
            scale: 1.0,
            window: Some(1),
        };
        for q_len in [1, 5] {
            let q = vec![1f32; q_len * 2];
            let mut out = vec![0f32; q_len * 2];
            let s = [SeqAttn {
                q_start: 0,
                q_len,
                context_len: ctx,
                block_table: &table,
            }];
            paged_attention(&q, spec, KvSlab::F32(&cache), layout, &s, &mut out).unwrap();
            let want = &v[(ctx - q_len) * 2..];
            assert_eq!(out, want, "{q_len} rows");
        }
    }
}

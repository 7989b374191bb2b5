//! Vector primitives at every kernel level ([`crate::isa`]): AVX-512 (`avx512`), AVX2+FMA
//! (`avx2`) and portable SIMD (`portable`, the `wide` crate: NEON on aarch64). Each public function
//! here dispatches on the process's level; a level's kernels are only called where it is active.
//!
//! Products keep activations in f32: weights are decoded to f32 a panel at a time
//! ([`dequant_panel`]) and every output is one chain of multiply-adds over the columns in order
//! ([`panel_product`]), whatever the batch. (llama.cpp instead rounds activations to 8 bits, which
//! is faster but no longer matches an f32 reference token for token.)
//!
//! Quantized weights, every GGML type, are kept in *panels* of sixteen rows (see [`fmt`]): a
//! column's sixteen weights side by side, so they widen into one vector whose lanes are sixteen
//! outputs. The bytes of GGML's blocks, rearranged.

use tandem_model::GgmlType;

use crate::isa::Isa;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether the AVX2+FMA+F16C kernels run in this process (the level, [`crate::isa::active`], is
/// AVX2 or above).
#[inline]
pub fn has_avx2_fma() -> bool {
    crate::isa::active() >= Isa::Avx2
}

/// Whether the AVX-512 kernels run in this process (F, BW and VL: every AVX-512 server CPU has
/// all three).
#[inline]
pub fn has_avx512() -> bool {
    crate::isa::active() >= Isa::Avx512
}

/// `Σ a[i]·b[i]`; `a` and `b` have the same length.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { avx512::dot(a, b) };
    } else if has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { avx2::dot(a, b) };
    }
    portable::dot(a, b)
}

/// `y[i] += alpha · x[i]`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { avx2::axpy(alpha, x, y) };
    }
    portable::axpy(alpha, x, y)
}

/// `acc += Σ_t p[t] · rows[t]` for the `p.len()` rows of `rows` (each `acc.len()` long): a run of
/// value rows weighted by attention probabilities. The tests' reference for [`axpy_rows_group`].
#[cfg(test)]
pub fn axpy_rows(p: &[f32], rows: &[f32], acc: &mut [f32]) {
    debug_assert_eq!(rows.len(), p.len() * acc.len());
    axpy_rows_group(p, p.len(), &[rows], acc, 1)
}

/// A KV cache value the attention kernels read in place: f32, or f16 widened as it is loaded
/// (exactly: every f16 is an f32), so a half-precision cache moves half the bytes and is never
/// copied out first.
pub trait KvValue: Copy + Send + Sync + 'static {
    /// Whether the value is an IEEE half (else an f32).
    const HALF: bool;
    fn to_f32(self) -> f32;
}

impl KvValue for f32 {
    const HALF: bool = false;
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
}

impl KvValue for half::f16 {
    const HALF: bool = true;
    #[inline]
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

/// Query vectors an attention tile holds ([`dot_keys_t`] takes them a register tile at a time,
/// so each pair of key blocks is read from L2 once for two register tiles). 24 against 12 on 2
/// cores of Zen 4 (`decode_attention`, alternated, bits unchanged): a 2048-token prefill 883-912
/// ms against 880-971, 512 tokens 68-74 against 68-89, 8 verifications of 5 tokens at 512
/// 15.4-15.9 against 16.3-17.5, 64-token chunks of 4 sequences at 1024 103-107 against
/// 103-137.
pub const KEYS_T_TILE: usize = 24;

/// Scores of `nq` query vectors (rows of `d = q.len() / nq`) against runs of keys stored
/// transposed. Run `r` is `runs[r] = (kt, n)`: `n` keys, dimension `i` of key `j` at
/// `kt[i·ld + j]`, and its scores go to `out[v·ldo + o + j]`, where `o` is the keys of the runs
/// before it (a segment's blocks, one after another in one row of scores). Computed `scale ·
/// Σ_i q[v·d + i] · kt[i·ld + j]`, each score one multiply-add chain over the dimensions in
/// order at every level, sixteen keys a vector: no horizontal sums, and neither the runs'
/// cuts nor the register tiles change a bit. A key vector is loaded once for a register tile
/// of queries, and each query element is broadcast once for the keys of two 16-key pieces at
/// AVX-512 (of one at the other levels).
#[allow(clippy::too_many_arguments)]
pub fn dot_keys_t<T: KvValue>(
    q: &[f32],
    nq: usize,
    runs: &[(&[T], usize)],
    ld: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
) {
    let n: usize = runs.iter().map(|r| r.1).sum();
    if nq == 0 || n == 0 {
        return;
    }
    let d = q.len() / nq;
    assert!(
        q.len() == nq * d && out.len() >= (nq - 1) * ldo + n,
        "dot_keys_t: {nq} queries of {d} against {n} keys do not fit"
    );
    if d == 0 {
        (0..nq).for_each(|v| out[v * ldo..v * ldo + n].fill(0.0));
        return;
    }
    for &(kt, len) in runs {
        assert!(
            len == 0 || (len <= ld && kt.len() >= (d - 1) * ld + len),
            "dot_keys_t: a run of {len} keys (stride {ld}) does not fit"
        );
    }
    // The runs cut into pieces of at most 16 keys: (keys, count, first score column), handed
    // to the level's kernel one at a time, or two at a time at AVX-512.
    let level = crate::isa::active();
    let pairs = cfg!(target_arch = "x86_64") && matches!(level, Isa::Avx512 | Isa::Amx);
    let mut held: Option<(*const T, usize, usize)> = None;
    // A piece alone: a second copy of it of no keys, which the kernels leave out.
    let alone = |p: (*const T, usize, usize)| [p, (p.0, 0, p.2)];
    let mut o = 0;
    for &(kt, len) in runs {
        for j0 in (0..len).step_by(16) {
            let piece = (kt[j0..].as_ptr(), (len - j0).min(16), o + j0);
            let two = match held.take() {
                Some(first) => [first, piece],
                None if pairs => {
                    held = Some(piece);
                    continue;
                }
                None => alone(piece),
            };
            key_pieces(level, q, nq, d, two, ld, scale, out, ldo);
        }
        o += len;
    }
    if let Some(p) = held {
        key_pieces(level, q, nq, d, alone(p), ld, scale, out, ldo);
    }
}

/// [`dot_keys_t`]'s scores against two pieces of up to 16 keys, `(keys, count, first score
/// column)` (only the first at levels below AVX-512, where the second is empty), for register
/// tiles of the queries in turn.
#[allow(clippy::too_many_arguments)]
#[inline]
fn key_pieces<T: KvValue>(
    level: Isa,
    q: &[f32],
    nq: usize,
    d: usize,
    pieces: [(*const T, usize, usize); 2],
    ld: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
) {
    let [a, b] = pieces;
    let mut v0 = 0;
    while v0 < nq {
        // SAFETY: the level's features are on this CPU (`isa::active`); rows `i < d` of each
        // piece hold its count of keys (checked by `dot_keys_t`; lanes past them are not read);
        // `q` holds `nq` rows of `d`; `out` rows `v0..v0+take` hold each piece's count of slots
        // from its column (`n` in all, checked by `dot_keys_t`).
        unsafe {
            let (qp, op) = (q.as_ptr().add(v0 * d), out.as_mut_ptr().add(v0 * ldo));
            #[cfg(target_arch = "x86_64")]
            if matches!(level, Isa::Avx512 | Isa::Amx) {
                // Up to 12 queries over two pieces: 24 accumulators.
                let take = (nq - v0).min(12);
                let (kt, cols, at) = ([a.0, b.0], [a.1, b.1], [op.add(a.2), op.add(b.2)]);
                macro_rules! go {
                    ($full:literal, $pieces:literal: $($t:literal)*) => {
                        match take {
                            $($t => avx512::dot_keys_t::<T, $t, $full, $pieces>(qp, d, kt, ld, cols, scale, at, ldo),)*
                            _ => unreachable!("at most 12 queries a register tile"),
                        }
                    };
                }
                // A piece alone (a run's odd last one) takes half the multiply-adds, not a
                // second piece's of masked-off lanes: half a prefill's tiles end so at 8 rows.
                match (a.1, b.1) {
                    (16, 16) => go!(true, 2: 1 2 3 4 5 6 7 8 9 10 11 12),
                    (16, 0) => go!(true, 1: 1 2 3 4 5 6 7 8 9 10 11 12),
                    (_, 0) => go!(false, 1: 1 2 3 4 5 6 7 8 9 10 11 12),
                    _ => go!(false, 2: 1 2 3 4 5 6 7 8 9 10 11 12),
                }
                v0 += take;
                continue;
            }
            debug_assert_eq!(b.1, 0, "one piece a call below AVX-512");
            let most = if sse2_only() { SSE2_QUERIES } else { 6 };
            let take = *[6, 4, 3, 2, 1]
                .iter()
                .find(|&&t| t <= (nq - v0).min(most))
                .expect("1 fits");
            let (kp, cols, op) = (a.0, a.1, op.add(a.2));
            macro_rules! go {
                ($m:ident :: $f:ident $(, $full:expr)?) => {
                    match take {
                        6 => $m::$f::<T, 6 $(, $full)?>(qp, d, kp, ld, cols, scale, op, ldo),
                        4 => $m::$f::<T, 4 $(, $full)?>(qp, d, kp, ld, cols, scale, op, ldo),
                        3 => $m::$f::<T, 3 $(, $full)?>(qp, d, kp, ld, cols, scale, op, ldo),
                        2 => $m::$f::<T, 2 $(, $full)?>(qp, d, kp, ld, cols, scale, op, ldo),
                        _ => $m::$f::<T, 1 $(, $full)?>(qp, d, kp, ld, cols, scale, op, ldo),
                    }
                };
            }
            match level {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 if cols == 16 => go!(avx2::dot_keys_t, true),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => go!(avx2::dot_keys_t, false),
                _ => go!(portable::dot_keys_t),
            }
            v0 += take;
        }
    }
}

/// Most heads [`axpy_rows_group`] keeps in registers at once (more fall back to one at a time).
pub const AXPY_GROUP_MAX: usize = 6;

/// Heads a call of [`axpy_rows_group`] takes at this level: [`AXPY_GROUP_MAX`], or at the
/// portable level on x86-64 [`SSE2_QUERIES`].
pub fn axpy_group() -> usize {
    if sse2_only() {
        SSE2_QUERIES
    } else {
        AXPY_GROUP_MAX
    }
}

/// The query vectors (or heads) the attention kernels keep in registers at once at the portable
/// level on x86-64: each takes four SSE2 registers of accumulators for 16 keys (or values), and
/// two (8 accumulators, beside four key vectors, a broadcast and a product) fit SSE2's 16. The
/// AVX2 kernels' six (12 registers there, 24 here) spilled to the stack. A 512-token prefill's
/// attention on a 2-core Zen 4 (`decode_attention`, `TANDEM_ISA=scalar`, two rounds alternated,
/// 2026-12-07): 212-222 ms with six, 195-206 with two, 239-241 with three, 247-252 with one; in
/// the engine (`tandem bench engine --prompt-len 512 --profile`) 215-227 ms, 36-37% of the FMA
/// peak, against 196-207, 39-41%. The same bits: the tile does not change a chain.
pub const SSE2_QUERIES: usize = 2;

/// Whether this process runs the portable kernels on x86-64 (SSE2's 16 registers of 4 lanes).
#[inline]
fn sse2_only() -> bool {
    cfg!(target_arch = "x86_64") && !has_avx2_fma()
}

/// Whole rows of `d` (> 0) values in `len`: a shift where `d` is a power of two, as every
/// model's head size is. The value kernels count each run's rows at every call (AVX2 once for
/// each 16 values of the head), and with divisions there the AVX-512 kernel alone, 12 query
/// vectors over a segment's 16 blocks in cache, ran about 5% slower on one core of Zen 4.
#[inline]
pub(crate) fn rows_of(len: usize, d: usize) -> usize {
    if d.is_power_of_two() {
        len >> d.trailing_zeros()
    } else {
        len / d
    }
}

/// [`axpy_rows`] for `g` heads sharing the rows: `acc[h] += Σ_t p[h·stride + t] · rows[t]` with
/// `acc` g×d, the rows given as runs (each whole rows of `d`: a segment's blocks), row `t`
/// counting on from run to run. Each output is one chain over the rows in order; the
/// accumulators stay in registers across the runs.
pub fn axpy_rows_group<T: KvValue>(
    p: &[f32],
    stride: usize,
    runs: &[&[T]],
    acc: &mut [f32],
    g: usize,
) {
    // SAFETY: no output is written outside `acc`.
    unsafe { rows_group(p, stride, runs, acc, g, None) }
}

/// Where [`axpy_rows_group_to`] writes head `h`'s sums: `out[h][i] = sum_i · inv[h] + 0` (a
/// normalized attention output; `+ 0` makes a zero +0).
#[derive(Clone, Copy)]
pub struct Finish<'a> {
    pub inv: &'a [f32],
    pub out: &'a [*mut f32],
}

/// [`axpy_rows_group`] from zeros, its sums written to `fin` (each head's `d` values times its
/// factor) instead of `acc`, which is neither read nor written (it gives `d`): the bits of
/// [`axpy_rows_group`] over a zeroed `acc` and then `acc[h][i] · inv[h] + 0`, without the
/// accumulators' trips through memory.
///
/// # Safety
/// `fin.inv` and `fin.out` have `g` entries, and each `fin.out[h]` is valid for writes of `d`
/// values that nothing else reads or writes meanwhile.
pub unsafe fn axpy_rows_group_to<T: KvValue>(
    p: &[f32],
    stride: usize,
    runs: &[&[T]],
    acc: &mut [f32],
    g: usize,
    fin: Finish<'_>,
) {
    assert!(
        fin.inv.len() == g && fin.out.len() == g,
        "axpy_rows_group_to: {g} heads"
    );
    // SAFETY: the caller's promise on `fin`.
    unsafe { rows_group(p, stride, runs, acc, g, Some(fin)) }
}

/// # Safety
/// As [`axpy_rows_group_to`] where `fin` is given.
unsafe fn rows_group<T: KvValue>(
    p: &[f32],
    stride: usize,
    runs: &[&[T]],
    acc: &mut [f32],
    g: usize,
    fin: Option<Finish<'_>>,
) {
    let d = acc.len() / g.max(1);
    let n: usize = runs.iter().map(|r| rows_of(r.len(), d.max(1))).sum();
    assert!(
        g > 0
            && d > 0
            && runs.iter().all(|r| rows_of(r.len(), d) * d == r.len())
            && p.len() >= (g - 1) * stride + n,
        "axpy_rows_group: {g} heads of {d} over {n} rows do not fit"
    );
    macro_rules! go {
        ($m:ident :: $f:ident) => {
            // SAFETY: the level's features are on this CPU (`isa::active`); each run holds
            // whole rows of `d` (a multiple of the kernel's width), `acc` g rows of `d`, and `p`
            // the probabilities of every head for each of the `n` rows (asserted above); the
            // caller's promise on `fin`.
            unsafe {
                match g {
                    1 => return $m::$f::<T, 1>(p, stride, runs, acc, fin),
                    2 => return $m::$f::<T, 2>(p, stride, runs, acc, fin),
                    3 => return $m::$f::<T, 3>(p, stride, runs, acc, fin),
                    4 => return $m::$f::<T, 4>(p, stride, runs, acc, fin),
                    5 => return $m::$f::<T, 5>(p, stride, runs, acc, fin),
                    6 => return $m::$f::<T, 6>(p, stride, runs, acc, fin),
                    _ => {}
                }
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if d.is_multiple_of(64) && has_avx512() {
        go!(avx512::axpy_rows_g);
    } else if d.is_multiple_of(16) && has_avx2_fma() {
        go!(avx2::axpy_rows_g);
    }
    if d.is_multiple_of(16) && !has_avx2_fma() {
        go!(portable::axpy_rows_g);
    }
    // Head sizes that are not a multiple of 16 (no model of ours has one) and more than 6 heads.
    if fin.is_some() {
        acc.fill(0.0);
    }
    for h in 0..g {
        let acc = &mut acc[h * d..(h + 1) * d];
        let rows = runs.iter().flat_map(|r| r.chunks_exact(d));
        for (t, row) in rows.enumerate() {
            let w = p[h * stride + t];
            for (a, x) in acc.iter_mut().zip(row) {
                *a += w * x.to_f32();
            }
        }
        if let Some(f) = fin {
            // SAFETY: the caller's promise: `d` values at `f.out[h]` are this call's.
            let out = unsafe { std::slice::from_raw_parts_mut(f.out[h], d) };
            for (o, a) in out.iter_mut().zip(acc.iter()) {
                *o = a * f.inv[h] + 0.0;
            }
        }
    }
}

/// Weight rows (output features) a panel holds: products take sixteen outputs at a time, one a
/// vector lane, and quantized weights are stored in panels of sixteen rows ([`to_panels`]).
pub const PANEL: usize = 16;

/// AVX-512's register tile: up to 6 activation rows × 4 panels, 24 accumulators, four weight
/// vectors and a broadcast activation in its 32 registers. 512 rows of the model's gate|up
/// product on one Zen 5 core: 97% of the FMA peak, where the lane-tree order's 6 × 4 tile of
/// dot products (each summed across sixteen lanes at its end) reached 78%. On a 2-core Intel
/// Xeon with AMX (two 512-bit FMA ports a core) the same product reaches 63-68% of its peak with
/// this tile, 8 × 3 or 12 × 2 alike (fewer panel loads a multiply-add: not the panels' traffic
/// from L2), and blocking the decoded panels in k to keep them in L1 was slower (`decode_matmul`,
/// `ROWS=512`, 2026-12-04); asking for the panels' lines ahead ([`PANEL_AHEAD`]) took it to
/// 69-73% (`ROWS=256 LAYERS=1`). Starting the decoded panels on a cache line (the matmul's
/// scratch, [`crate::aligned`]) and four columns a turn ([`PANEL_UNROLL`]) took those products
/// from 190-191 ms to 170-172 (2026-12-05): one thread alone then reaches 82% of its core's
/// FMA peak, two 75-78% of theirs.
const TILE_512: (usize, usize) = (6, 4);

/// AVX2's: up to 6 activation rows × one panel (two 8-lane vectors): 12 accumulators, two
/// weight vectors and a broadcast activation in its 16 registers. With fewer rows, more panels
/// (at most 12 accumulators). Tiles of 3 rows × 2 panels instead (the same 12 accumulators, half
/// the broadcasts and twice the weight loads a column) took the model's decode-step products of
/// 8 to 24 rows from memory 1.2-1.9x as long on a 2-core Zen 3 (`decode_matmul`, two rounds
/// alternated, 2026-12-07).
const TILE_AVX2: (usize, usize) = (6, 1);

/// The portable level's: SSE2's 16 registers of 4 lanes hold 2 × 1 panels' accumulators (four
/// 8-lane vectors) beside the weights. Against the unspilled peak ([`BURST_CHAINS_PORTABLE`])
/// the model's 512-row products reach 68-74% of it on a 2-core Zen 4 (`decode_matmul`,
/// `TANDEM_ISA=scalar ROWS=512 LAYERS=1`, 2026-12-06); 3 × 1 reached 50-54% (its accumulators
/// leave no room for the weights), and four columns a turn changed nothing. SSE2's operations
/// overwrite an operand, so each multiply-add needs a copy or a load beside it: a column's 16
/// multiplies and adds come with 15 other operations (loads, the broadcasts, copies and the
/// loop's), and 31 operations at the front end's 6 a cycle, against the pipes' 4 cycles, bound
/// the tile to about 77% of the peak. A 2-core Zen 3 reaches 37-48% (47-51% on one thread;
/// 512 rows, 2026-12-07), and decoding the panels 128 or 256 columns at a time for all the rows (so that
/// they stay in L1) did not move it.
const TILE_PORTABLE: (usize, usize) = (2, 1);

/// Columns ahead of the one a register tile multiplies whose panel lines it asks L1 for (a
/// column of a panel is one 64-byte line): the decoded panels of a task stream from L2 once for
/// every block of activation rows, and the hardware's prefetchers alone left the products of a
/// 256-row prefill of the model (`decode_matmul`, `ROWS=256 LAYERS=1`, 2 cores of an Intel Xeon
/// with AMX, binaries alternated) 9% slower at AVX-512 and 7% at AVX2. Any distance from 4 to 32
/// gave the same there.
pub(crate) const PANEL_AHEAD: usize = 8;

/// Columns the AVX-512 and AVX2 register tiles multiply in one turn of their loops (each
/// column's multiply-adds still in column order, so the bits are those of one at a time): the
/// loads of four columns' panel vectors in flight together. (The portable level's SSE2 tile, in
/// 16 registers, was 2-3% slower so and keeps one column a turn.) The model's products of a 256-row prefill on 2 cores of
/// an Intel Xeon (AVX-512, `decode_matmul ROWS=256 LAYERS=1`, binaries alternated, 3 runs):
/// one column a turn 178-184 ms, two 175-176, four 170-172, eight 174-176; 512 rows 366 ->
/// 343-349 ms; one thread 82% of a core's FMA peak instead of 78%.
pub(crate) const PANEL_UNROLL: usize = 4;

/// Runs `$body` for `$t = 0, 1, …, $k − 1` in order, [`PANEL_UNROLL`] columns a turn of the
/// loop (the AVX-512 and AVX2 tiles' column loop). A macro, so the loop is written in place: a
/// function taking the column as a closure, though inlined, measured 1-3% slower.
macro_rules! in_turns {
    ($k:expr, $t:ident => $body:expr) => {{
        let k = $k;
        let mut start = 0;
        while start + $crate::simd::PANEL_UNROLL <= k {
            for u in 0..$crate::simd::PANEL_UNROLL {
                let $t = start + u;
                $body;
            }
            start += $crate::simd::PANEL_UNROLL;
        }
        while start < k {
            let $t = start;
            $body;
            start += 1;
        }
    }};
}

/// Most panels of one kernel call (AVX-512's tile; a task's weight rows).
pub const MAX_PANELS: usize = 4;

/// Activation rows and panels of this level's register tile for `m` activation rows: the most
/// panels whose accumulators fit beside `min(m, rows)` rows'. A tile's shape never changes an
/// output's bits, only how many are computed at once.
fn tile_for(m: usize) -> (usize, usize) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            let rows = m.min(TILE_512.0);
            return (rows, (TILE_512.0 * TILE_512.1 / rows).min(MAX_PANELS));
        }
        if has_avx2_fma() {
            // 12 accumulators of 8 lanes: 6 × 1 panel, 3 × 2, 2 × 3, 1 × 4 (with the weights
            // from memory).
            let rows = m.min(TILE_AVX2.0);
            return (rows, (TILE_AVX2.0 * TILE_AVX2.1 / rows).min(MAX_PANELS));
        }
    }
    let rows = m.min(TILE_PORTABLE.0);
    (rows, TILE_PORTABLE.0 * TILE_PORTABLE.1 / rows)
}

/// `out[a·ldo + c] = Σ_t x[a·ldx + t] · W[c][t]` for activation rows `a < m` and outputs
/// `c < cols`, where weight row `c` is lane `c mod 16` of panel `c / 16`: the panel's values for
/// column `t` are the sixteen floats at `w + (c/16)·ldp + 16·t`. The one product behind every
/// [`crate::matmul`] path.
///
/// **The order**, the same whatever `m`, the tile, the panels or the threads: each output is one
/// chain `s ← x_t · w_t + s` over `t = 0, 1, …, k−1` in order, from `s = 0` (or from the value
/// in `out` where `cont`: a product taken in spans of columns has the bits of one taken whole).
/// Fused multiply-adds at AVX2 and above, so those levels give the same bits; the portable
/// level's own multiply-add (a multiply and an add on x86's SSE2, fused on aarch64). No sum
/// across lanes: each lane is an output. (The order before this one, lanes over the columns
/// summed by a fixed tree at the end, spent 15-25% of a tile on the sums and gave each level
/// its own bits.)
///
/// # Safety
/// `x` holds `m` rows of `k` values `ldx` apart; `w` holds `cols.div_ceil(16)` panels `ldp`
/// apart of `16·k` floats; `out` is valid for reads (where `cont`) and writes at `a·ldo + c`,
/// with nothing else writing there meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn panel_product(
    x: *const f32,
    ldx: usize,
    m: usize,
    w: *const f32,
    ldp: usize,
    cols: usize,
    k: usize,
    cont: bool,
    out: *mut f32,
    ldo: usize,
) {
    let (tm, tp) = tile_for(m);
    let panels = cols.div_ceil(PANEL);
    let mut a0 = 0;
    let avx2 = cfg!(target_arch = "x86_64") && has_avx2_fma() && !has_avx512();
    for ma in row_blocks(m, tm, avx2) {
        // Panels in groups as even as the tile allows, too.
        let groups = panels.div_ceil(tp);
        let mut p0 = 0;
        for g in 0..groups {
            let np = panels / groups + usize::from(g < panels % groups);
            let c = (cols - p0 * PANEL).min(np * PANEL);
            panel_tile(
                x.add(a0 * ldx),
                ldx,
                ma,
                w.add(p0 * ldp),
                ldp,
                np,
                c,
                k,
                cont,
                out.add(a0 * ldo + p0 * PANEL),
                ldo,
            );
            p0 += np;
        }
        a0 += ma;
    }
}

/// The rows of each register tile [`panel_product`] cuts `m` activation rows into, at most `tm`
/// each: blocks as even as the tile allows (32 rows at 6: 6, 6, 5, 5, 5, 5, not five of 6 and
/// one of 2), and at AVX2 (`avx2`: the level's tile is AVX2's) maybe a last block of 2 or 3 rows
/// (below).
///
/// AVX2's tile of 4 rows takes one panel, 8 accumulators: as many chains as two FMA pipes of 4
/// cycles' latency need, with nothing to spare (5 rows hold 10, 6 rows 12, and 2 or 3 rows take
/// three or two panels, 12). So at AVX2 no block has 4 rows where others can do: 8 rows go
/// 5 + 3, not 4 + 4; 7 go 5 + 2; 13 go 5 + 5 + 3 (every count from 5 on gets blocks of 5 or 6
/// and at most one of 2 or 3). The model's decode-step products (`decode_matmul`, `LAYERS=1`)
/// on a 2-core Zen 3, three builds alternated: 7 rows 14.62-14.64 ms as 4 + 3, 13.96-14.13 as
/// 5 + 2; 8 rows 16.13-16.20 as 4 + 4, 15.16-15.30 as 6 + 2, 14.36-15.10 as 5 + 3; 13 rows
/// 20.89-21.22 as 5 + 4 + 4, 19.31-19.43 as 5 + 5 + 3; 14 rows 20.92-20.93 as 5 + 5 + 4,
/// 20.45-20.46 as 6 + 5 + 3; 19 rows 26.23-26.42 as 5 + 5 + 5 + 4, 25.72-26.24 as 6 + 5 + 5 +
/// 3. As built (three rounds alternated with the build before): 7 rows 14.93-15.17 ms against
/// 14.20-14.38, 8 rows 16.68-16.94 against 14.45-14.46, 13 rows 21.18-21.37 against
/// 19.09-19.16, 24 and 64 rows unchanged; from memory (`LAYERS=30`, with the head) 8 rows
/// 21.78-21.81 against 19.17-19.28, 13 rows 27.23-27.41 against 24.39-25.03. Decode in the
/// engine (`tandem bench engine --batch B --prompt-len 64 --gen-len 64`, two rounds alternated,
/// tok/s): batch 7 297-300 against 317-318, 8 288 against 346, 9 359-366 against 383, 13 374
/// against 434-436, 19 441-442 against 451-455; 16 (6 + 5 + 5 either way) 462-474 and 465-472.
/// (Since then 7 and 8 rows of quantized weights decode in registers at AVX2, see `matmul`'s
/// `AVX2_FUSED_MOST`; f32 weights and longer products still come here.) Which rows share a
/// tile changes no bit.
fn row_blocks(m: usize, tm: usize, avx2: bool) -> impl Iterator<Item = usize> {
    // The last block's rows (0: none), where the others would otherwise hold 4.
    let tail = if !avx2 || tm != TILE_AVX2.0 || m <= tm || m >= 5 * m.div_ceil(tm) {
        0
    } else {
        // 3 rows (two panels a tile) where the rest splits into blocks of 5 or 6, else 2.
        [3, 2]
            .into_iter()
            .find(|&t| m - t >= 5 * (m - t).div_ceil(tm))
            .unwrap_or(0)
    };
    let even = m - tail;
    let blocks = even.div_ceil(tm);
    (0..blocks)
        .map(move |b| even / blocks + usize::from(b < even % blocks))
        .chain((tail > 0).then_some(tail))
}

/// One register tile of [`panel_product`]: `m` rows and `np` panels within this level's tile,
/// `cols` outputs of the `np · 16`.
#[allow(clippy::too_many_arguments)]
unsafe fn panel_tile(
    x: *const f32,
    ldx: usize,
    m: usize,
    w: *const f32,
    ldp: usize,
    np: usize,
    cols: usize,
    k: usize,
    cont: bool,
    out: *mut f32,
    ldo: usize,
) {
    macro_rules! go {
        ($l:ident; $(($a:literal, $p:literal)),*) => {
            match (m, np) {
                $(($a, $p) => $l::panel_tile::<$a, $p>(x, ldx, w, ldp, cols, k, cont, out, ldo),)*
                _ => panic!("panel_tile: no kernel for {m} activation rows × {np} panels"),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512() {
            return go!(avx512;
                (1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (2, 4),
                (3, 1), (3, 2), (3, 3), (3, 4), (4, 1), (4, 2), (4, 3), (4, 4),
                (5, 1), (5, 2), (5, 3), (5, 4), (6, 1), (6, 2), (6, 3), (6, 4));
        }
        if has_avx2_fma() {
            return go!(avx2;
                (1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (2, 3), (3, 1), (3, 2),
                (4, 1), (5, 1), (6, 1));
        }
    }
    go!(portable; (1, 1), (1, 2), (2, 1))
}

/// Independent FMA chains of 8-lane vectors in AVX2's [`fma_burst`]: enough to cover the
/// latency of two FMA pipes, few enough to stay in 16 registers with the constants.
const BURST_CHAINS_8: usize = 12;

/// The portable level's chains of 8-lane vectors. On x86-64 each is two SSE2 registers and each
/// step a multiply and an add, 6 cycles deep on Zen 4: seven chains (14 registers and the two
/// constants) keep both multiply and both add pipes busy. Twelve, as AVX2's, spilled to the
/// stack, and the peak read 64-89 GFLOP/s on a 2-core Zen 4 where seven read 103-108
/// (`decode_matmul`, `TANDEM_ISA=scalar`, 2026-12-06): products measured against it looked
/// closer to the peak than they were. NEON's 32 registers hold twelve (fused, 4 cycles deep).
#[cfg(target_arch = "x86_64")]
const BURST_CHAINS_PORTABLE: usize = 7;
#[cfg(not(target_arch = "x86_64"))]
const BURST_CHAINS_PORTABLE: usize = 12;

/// Runs `rounds` rounds of independent vector FMAs held in registers on this thread and returns
/// the floating-point operations done: timed on every thread at once, the machine's peak f32 rate,
/// the ceiling a product's FLOP rate is measured against.
pub fn fma_burst(rounds: usize) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports the features.
        std::hint::black_box(unsafe { avx512::fma_burst(rounds) });
        return rounds as u64 * 16 * 32;
    } else if has_avx2_fma() {
        // SAFETY: as above.
        std::hint::black_box(unsafe { avx2::fma_burst(rounds) });
        return rounds as u64 * BURST_CHAINS_8 as u64 * 16;
    }
    std::hint::black_box(portable::fma_burst(rounds));
    rounds as u64 * BURST_CHAINS_PORTABLE as u64 * 16
}

/// The largest value of `x` (`-∞` when empty; NaNs are skipped, as `f32::max` does).
pub fn max_f32(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports the features.
        return unsafe { avx512::max_f32(x) };
    } else if has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { avx2::max_f32(x) };
    }
    portable::max_f32(x)
}

/// `gate[i] = silu(gate[i]) · up[i]`, silu(v) = v / (1 + e^-v) (the vector `exp` is within 2 ulp).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul operands");
    let p = gate.as_mut_ptr();
    // SAFETY: both slices have gate.len() values; the kernels read each vector of `gate`
    // before they write it.
    unsafe { silu_mul_raw(p, up.as_ptr(), p, gate.len()) }
}

/// `out[i] = silu(gate[i]) · up[i]`, the same bits as [`silu_mul`] in place.
pub fn silu_mul_to(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == up.len() && gate.len() == out.len(),
        "silu_mul_to operands"
    );
    // SAFETY: the three slices have out.len() values.
    unsafe { silu_mul_raw(gate.as_ptr(), up.as_ptr(), out.as_mut_ptr(), out.len()) }
}

/// # Safety
/// `gate` and `up` readable and `out` writable for `n` values; `out` is `gate` or apart from it.
unsafe fn silu_mul_raw(gate: *const f32, up: *const f32, out: *mut f32, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports the features; the caller's promise on the pointers.
        return unsafe { avx512::silu_mul(gate, up, out, n) };
    } else if has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { avx2::silu_mul(gate, up, out, n) };
    }
    // SAFETY: the caller's promise.
    unsafe { portable::silu_mul(gate, up, out, n) }
}

/// `x[i] = exp(x[i] - max)`, returning `Σ x[i]` (the softmax numerators and denominator).
pub fn exp_shifted_sum(x: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports the features.
        return unsafe { avx512::exp_shifted_sum(x, max) };
    } else if has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { avx2::exp_shifted_sum(x, max) };
    }
    portable::exp_shifted_sum(x, max)
}

/// `out[i] = w[i] · (x[i] · inv)`: an RMS-normalized row (the products rounded in that order at
/// every level, so each gives the same bits).
pub fn scale_row(x: &[f32], w: &[f32], inv: f32, out: &mut [f32]) {
    assert!(
        x.len() == w.len() && out.len() == w.len(),
        "scale_row operands"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports the features; the three slices have one length.
        return unsafe { avx2::scale_row(x, w, inv, out) };
    }
    // The compiler vectorizes this loop for the target's baseline (SSE2, NEON).
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * inv);
    }
}

/// Rows `0..rows` (at most [`PANEL`]) of `src`, row `j` at `src[j·ld..]`, `span` values each,
/// column after column into `out`: `out[16·i + j] = src[j·ld + i]`, rows `rows..16` zeros, the
/// layout [`panel_product`] multiplies. A copy (every level gives the same values): a full
/// panel is transposed 16 × 16 (AVX-512), 8 × 8 (AVX2) or 4 × 4 (portable) in registers, where
/// one value at a time made a product of one row against an f32 weight run at a third of the
/// memory's rate (and at the portable level took 16% of a k-quant golden check's time, whose
/// reference runs on f32 weights).
pub fn transpose_panel(src: &[f32], ld: usize, rows: usize, span: usize, out: &mut [f32]) {
    assert!(
        rows <= PANEL
            && out.len() >= span * PANEL
            && (rows == 0 || src.len() >= (rows - 1) * ld + span),
        "transpose_panel: {rows} rows of {span} (stride {ld}) do not fit"
    );
    let mut i0 = 0;
    #[cfg(target_arch = "x86_64")]
    if rows == PANEL {
        // SAFETY: the level's features are on this CPU; rows 0..16 hold `span` values from
        // each start (asserted), and `out` 16 per column.
        unsafe {
            if has_avx512() {
                while i0 + 16 <= span {
                    avx512::transpose16(src.as_ptr().add(i0), ld, out.as_mut_ptr().add(16 * i0));
                    i0 += 16;
                }
            } else if has_avx2_fma() {
                while i0 + 8 <= span {
                    for half in 0..2 {
                        avx2::transpose8(
                            src.as_ptr().add(8 * half * ld + i0),
                            ld,
                            out.as_mut_ptr().add(16 * i0 + 8 * half),
                        );
                    }
                    i0 += 8;
                }
            }
        }
    }
    if rows == PANEL && i0 == 0 {
        // The portable level (and x86 below AVX2): 4 × 4 blocks in registers.
        while i0 + 4 <= span {
            // SAFETY: rows 0..16 hold `span` values from each start (asserted) and `out` 16 a
            // column, so columns i0..i0 + 4 ≤ span are in both.
            unsafe {
                portable::transpose4(src.as_ptr().add(i0), ld, out.as_mut_ptr().add(16 * i0))
            };
            i0 += 4;
        }
    }
    for j in 0..PANEL {
        if j < rows {
            for i in i0..span {
                out[i * PANEL + j] = src[j * ld + i];
            }
        } else {
            for i in i0..span {
                out[i * PANEL + j] = 0.0;
            }
        }
    }
}

/// Rotates pairs `(a[i], b[i])` by the angles whose cosines and sines are `c[i]`, `s[i]`:
/// `a' = a·c − b·s`, `b' = b·c + a·s`, each product rounded before the sum at every level.
pub fn rotate(a: &mut [f32], b: &mut [f32], c: &[f32], s: &[f32]) {
    assert!(
        a.len() == b.len() && c.len() >= a.len() && s.len() >= a.len(),
        "rotate operands"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the CPU supports the features; the lengths are checked above.
        return unsafe { avx2::rotate(a, b, c, s) };
    }
    // The compiler vectorizes this loop for the target's baseline (SSE2, NEON).
    for i in 0..a.len() {
        let (x0, x1) = (a[i], b[i]);
        a[i] = x0 * c[i] - x1 * s[i];
        b[i] = x1 * c[i] + x0 * s[i];
    }
}

/// Whether weights of `ty` are stored in panels ([`fmt::to_panels`]): every quantized type.
pub fn is_paneled(ty: GgmlType) -> bool {
    fmt::layout(ty).is_some()
}

pub use fmt::{dequant_panel_row, panel_row_ggml, to_panels};

/// Blocks `b0..b1` (32 columns each) of panel `p` of `ty` (panels of `rows` rows of `cols`
/// values in `data`) decoded column by column: column `t`'s sixteen rows at
/// `out[16·(t − 32·b0)..]`, the layout [`panel_product`] multiplies.
#[allow(clippy::too_many_arguments)]
pub fn dequant_panel(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    cols: usize,
    p: usize,
    b0: usize,
    b1: usize,
    out: &mut [f32],
) {
    let pl = fmt::layout(ty).expect("a quantized type").panel(cols);
    assert!(
        b0 <= b1
            && b1 <= cols / 32
            && p < rows.div_ceil(PANEL)
            && data.len() >= (p + 1) * pl
            && out.len() >= (b1 - b0) * 32 * PANEL,
        "dequant_panel: blocks {b0}..{b1} of {cols} columns, panel {p} of {rows} rows"
    );
    // SAFETY: the panel's bytes and the outputs are in bounds (asserted above).
    unsafe { dequant_panel_at(crate::isa::active(), ty, &data[p * pl..], b0, b1, out) }
}

/// [`dequant_panel`] of one panel (`panel` its bytes) at kernel level `level`.
///
/// # Safety
/// The CPU has `level`'s features; `panel` holds blocks `..b1`, `out` `(b1 − b0)·32·16` values.
unsafe fn dequant_panel_at(
    level: Isa,
    ty: GgmlType,
    panel: &[u8],
    b0: usize,
    b1: usize,
    out: &mut [f32],
) {
    let (src, o) = (panel.as_ptr(), out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    {
        if level >= Isa::Avx512 {
            return fmt::with_fmt!(ty, F => avx512::dequant_panel::<F>(src, b0, b1, o));
        }
        if level >= Isa::Avx2 {
            return fmt::with_fmt!(ty, F => avx2::dequant_panel::<F>(src, b0, b1, o));
        }
    }
    let _ = level;
    fmt::with_fmt!(ty, F => portable::dequant_panel::<F>(src, b0, b1, o))
}

/// Whether [`dot_quant_rows`] serves weights of `ty` in this process (panels, AVX2 and up).
pub fn has_quant_x1(ty: GgmlType) -> bool {
    is_paneled(ty) && has_avx2_fma()
}

/// The byte `dist` ahead of `at` (offset `o` in its panel of `pl` bytes) in the stream of panels
/// that a kernel reading `streams` panels side by side takes: in the same panel, and past its
/// end in the panel `streams` further on, which the same reader takes next (not the neighbour,
/// which another of its streams is reading at the same offset). A prefetch address: a hint,
/// never dereferenced, so it may point past the weights.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn ahead(at: *const u8, o: usize, pl: usize, streams: usize, dist: usize) -> *const i8 {
    let skip = if o + dist < pl { 0 } else { (streams - 1) * pl };
    at.wrapping_add(dist + skip) as *const i8
}

/// Panels that a one-row [`dot_quant_rows`] call's share is best a multiple of: two at AVX2
/// (whose kernel takes them one at a time; a unit of one, shares of one to four panels, was no
/// faster on Zen 3), one at AVX-512.
pub fn x1_unit() -> usize {
    if has_avx512() {
        1
    } else {
        2
    }
}

/// Activation rows that [`dot_quant_rows`] takes in one call at this process's level (eight at
/// AVX-512, four at AVX2, none below): up to this many rows decode each weight in registers once
/// for all of them instead of through a decoded tile in memory. (A mixture of experts' batch of
/// 32 on Zen 5, about two rows an expert: 71 tok/s through the tile, 97 with four rows fused.
/// AVX2 on Zen 4, the model's products of a decode step (`decode_matmul`, its Q4_1 and Q8_0
/// weights, rounds alternated), tile against registers: 2 rows 12.6-16.0 ms against 8.4-12.0,
/// 3 rows 17.3-22.0 against 8.7-9.9, 4 rows 13.9-18.1 against 12.1-13.6 (the one row's
/// 8.0-11.1). More rows go in groups, see `matmul`'s `AVX2_FUSED_MOST`.)
pub fn fused_rows() -> usize {
    if has_avx512() {
        8
    } else if has_avx2_fma() {
        4
    } else {
        0
    }
}

/// One activation row `x` against panels `p0.. p0 + np` (`np ≤` [`MAX_PANELS`]) of `ty`
/// (panels of `rows` rows of `k = x.len()` values in `data`): `out` gets the first `out.len()`
/// of their outputs, decoded in registers with [`panel_product`]'s bits (each output one chain
/// over the columns in order), without the decoded panels' round trip through memory. Only
/// where [`has_quant_x1`].
#[cfg(test)]
pub fn dot_quant_x1(ty: GgmlType, data: &[u8], rows: usize, p0: usize, x: &[f32], out: &mut [f32]) {
    let cols = out.len();
    // SAFETY: the one row's `cols` outputs are `out`'s.
    unsafe { dot_quant_rows(ty, data, rows, p0, x, 1, out.as_mut_ptr(), cols, cols) }
}

/// [`dot_quant_x1`] for `m ≤` [`fused_rows`] activation rows (`x`: `m` rows of `k`): row `a`'s
/// `cols` outputs at `out + a·ldo`.
///
/// # Safety
/// `out` is valid for writes at `a·ldo + c` for `a < m`, `c < cols`, and nothing else writes
/// there meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_quant_rows(
    ty: GgmlType,
    data: &[u8],
    rows: usize,
    p0: usize,
    x: &[f32],
    m: usize,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let k = x.len() / m.max(1);
    let np = cols.div_ceil(PANEL);
    let l = fmt::layout(ty);
    let all = rows.div_ceil(PANEL);
    assert!(
        has_quant_x1(ty)
            && (1..=fused_rows()).contains(&m)
            && x.len() == m * k
            && l.is_some_and(|l| k.is_multiple_of(l.cols()))
            && (1..=MAX_PANELS).contains(&np)
            && p0 + np <= all
            && data.len() >= all * l.map_or(0, |l| l.panel(k))
            && (m == 1 || ldo >= cols),
        "dot_quant_rows: {m} rows, {cols} outputs of {ty} panels from {p0}, k = {k}"
    );
    // SAFETY: the level is this process's (has_quant_x1, fused_rows); the panels and the
    // outputs are in bounds (asserted, and the caller's contract).
    unsafe {
        dot_quant_rows_at(
            crate::isa::active(),
            ty,
            data,
            all,
            p0,
            x,
            m,
            out,
            ldo,
            cols,
        )
    }
}

/// [`dot_quant_rows`] at kernel level `level` (AVX2: up to four rows; AVX-512: up to eight).
///
/// # Safety
/// The CPU has `level`'s features; `data` holds `all` panels of `k` columns of `ty`; the `cols`
/// outputs from panel `p0` are among them, at most [`MAX_PANELS`] panels' worth; `out` as for
/// [`dot_quant_rows`].
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
unsafe fn dot_quant_rows_at(
    level: Isa,
    ty: GgmlType,
    data: &[u8],
    all: usize,
    p0: usize,
    x: &[f32],
    m: usize,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    #[cfg(target_arch = "x86_64")]
    {
        let k = x.len() / m;
        let np = cols.div_ceil(PANEL);
        let pl = fmt::layout(ty).expect("a quantized type").panel(k);
        let at: [*const u8; MAX_PANELS] =
            std::array::from_fn(|i| data.as_ptr().wrapping_add((p0 + i).min(all - 1) * pl));
        let (xp, o) = (x.as_ptr(), out);
        macro_rules! xm {
            ($n:literal, $m:literal, $i:expr, $o:expr, $c:expr) => {
                fmt::with_fmt!(ty, F => avx512::dot_quant_xm::<F, $n, $m>(
                    at[$i..$i + $n].try_into().expect("n"),
                    pl,
                    xp,
                    k,
                    k,
                    $o,
                    ldo,
                    $c,
                ))
            };
        }
        if level >= Isa::Avx512 {
            if m == 1 {
                match np {
                    1 => xm!(1, 1, 0, o, cols),
                    2 => xm!(2, 1, 0, o, cols),
                    3 => xm!(3, 1, 0, o, cols),
                    _ => xm!(4, 1, 0, o, cols),
                }
                return;
            }
            // Two rows: two panels at a time. Three to eight: one panel at a time (the model's
            // decode-step products on 2 cores of Zen 4, `decode_matmul`, four runs alternated:
            // 3 rows 6.8-7.6 ms two panels at a time against 6.0-6.1 one, 4 rows 8.0-8.2
            // against 6.9-7.2 (one run 8.1), 2 rows 5.7-6.8 against 5.7-6.8; five rows two
            // panels at a time 9.9-10.1 against 9.1-9.2, eight 16.1-16.2 against 12.0-13.1;
            // not measured on Intel's cores or Zen 5's). The same bits either way: each output
            // is one chain over the columns in order.
            let step = if m == 2 { 2 } else { 1 };
            let mut i = 0;
            while i < np {
                let c = (cols - i * PANEL).min(step * PANEL);
                let oi = o.add(i * PANEL);
                match (m, c > PANEL) {
                    (2, true) => xm!(2, 2, i, oi, c),
                    (2, false) => xm!(1, 2, i, oi, c),
                    (3, _) => xm!(1, 3, i, oi, c),
                    (4, _) => xm!(1, 4, i, oi, c),
                    (5, _) => xm!(1, 5, i, oi, c),
                    (6, _) => xm!(1, 6, i, oi, c),
                    (7, _) => xm!(1, 7, i, oi, c),
                    _ => xm!(1, 8, i, oi, c),
                }
                i += step;
            }
        } else {
            // One row of 4-bit codes: two panels at a time (four accumulators, so a column's
            // multiply-adds do not wait on the last column's), the same bits as panel by panel
            // (each output one chain over the columns in order). One row against 2048 × 2048
            // matrices from memory on a 2-core Zen 3 (`decode_types`, two rounds alternated,
            // 2026-12-07), panel by panel against two at a time: Q4_0 1.38-1.39 ms against
            // 1.27-1.29, Q4_1 1.39 against 1.27-1.30, Q4_K 1.43-1.45 against 1.34-1.39; but
            // Q5_0, Q5_1 and Q5_K 2.04-2.21 against 2.20-2.32 (their fifth bits' operations
            // outgrow the registers), Q6_K and Q8_0 within 3% either way, so those stay panel
            // by panel. The model's Q4_1 products of a decode step at batch 1 in the engine
            // (`tandem bench engine --batch 1 --prompt-len 32 --gen-len 128 --profile`, three
            // rounds alternated): 4.61-5.16 ms against 4.30-4.34, the head (Q8_0) 1.19-1.23
            // both; decode 155 tok/s against 158-162. (A first two-panel one-row kernel, for
            // every format, kept an accumulator on the stack and was slower than panel by
            // panel: 13.1-13.7 ms against 11.3-11.8 on one thread. This one, with none there,
            // was measured once before in the engine at batch 1 in four rounds that the VM's
            // speed moved by a fifth, 95-119 tok/s against 102-116, and not taken then.)
            //
            // Two to four rows (or one of other formats, or a last odd panel) go panel by
            // panel: two panels' accumulators for more than one row would not fit the 16
            // registers. Two rows already cost about what one does (the model's products in
            // cache).
            let mut p = 0;
            if m == 1 && fmt::with_fmt!(ty, F => <F as fmt::Fmt>::BITS == 4) {
                while p + 1 < np {
                    let c = (cols - p * PANEL).min(2 * PANEL);
                    fmt::with_fmt!(ty, F => avx2::dot_quant_x1p::<F, 2>(
                        [at[p], at[p + 1]], pl, xp, k, o.add(p * PANEL), c,
                    ));
                    p += 2;
                }
            }
            for (i, &panel) in at.iter().enumerate().take(np).skip(p) {
                let c = (cols - i * PANEL).min(PANEL);
                let oi = o.add(i * PANEL);
                macro_rules! xm2 {
                    ($m:literal) => {
                        fmt::with_fmt!(ty, F => avx2::dot_quant_xm::<F, $m>(
                            panel, pl, xp, k, k, oi, ldo, c,
                        ))
                    };
                }
                match m {
                    1 => xm2!(1),
                    2 => xm2!(2),
                    3 => xm2!(3),
                    4 => xm2!(4),
                    _ => unreachable!("dot_quant_rows: {m} rows at AVX2 (four at most)"),
                }
            }
        }
    }
}

pub mod fmt;

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
mod avx2;

mod portable;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The transposing copy gives what one value at a time gives, for full
    /// panels and edges (short rows, spans not a multiple of the register tile).
    #[test]
    fn transpose_panel_matches_the_plain_copy() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        for (rows, span, ld) in [
            (16, 128, 2048),
            (16, 37, 40),
            (16, 8, 8),
            (7, 64, 64),
            (0, 5, 5),
        ] {
            let src: Vec<f32> = (0..rows.max(1) * ld)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            let mut want = vec![f32::NAN; span * PANEL];
            for i in 0..span {
                for j in 0..PANEL {
                    want[i * PANEL + j] = if j < rows { src[j * ld + i] } else { 0.0 };
                }
            }
            // At the process's level (scripts/test runs this at each level the CPU has).
            let mut got = vec![f32::NAN; span * PANEL];
            transpose_panel(&src, ld, rows, span, &mut got);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{rows} rows of {span}");
        }
    }

    /// Reference dot product: eight running sums, the order a plain loop vectorizes in.
    fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        let n8 = a.len() / 8 * 8;
        for (ca, cb) in a[..n8].chunks_exact(8).zip(b[..n8].chunks_exact(8)) {
            for j in 0..8 {
                acc[j] += ca[j] * cb[j];
            }
        }
        let mut s = acc.iter().sum::<f32>();
        for i in n8..a.len() {
            s += a[i] * b[i];
        }
        s
    }

    /// Reference [`dot_keys_t`]: one sum per query and key.
    #[allow(clippy::too_many_arguments)]
    fn dot_keys_t_scalar<T: KvValue>(
        q: &[f32],
        nq: usize,
        kt: &[T],
        ld: usize,
        n: usize,
        scale: f32,
        out: &mut [f32],
        ldo: usize,
    ) {
        let d = q.len() / nq;
        for v in 0..nq {
            let qv = &q[v * d..(v + 1) * d];
            for j in 0..n {
                let mut acc = 0f32;
                for (i, x) in qv.iter().enumerate() {
                    acc += x * kt[i * ld + j].to_f32();
                }
                out[v * ldo + j] = acc * scale;
            }
        }
    }

    /// Every finite half goes through the f16 key load as its exact f32 value (one query of one
    /// dimension equal to 1: each score is the key itself), masked tails included.
    #[test]
    fn f16_keys_load_exactly() {
        let all: Vec<half::f16> = (0..=0xffffu16)
            .map(half::f16::from_bits)
            .filter(|h| h.is_finite())
            .collect();
        for n in [all.len(), 1, 15, 17, 33] {
            let keys = &all[all.len() - n..];
            let mut out = vec![f32::NAN; n];
            dot_keys_t(&[1.0], 1, &[(keys, n)], n, 1.0, &mut out, n);
            for (h, &f) in keys.iter().zip(&out) {
                // A sum with +0 makes -0 into +0; every other value is bit-exact.
                assert_eq!(f, h.to_f32(), "{h}");
            }
        }
    }

    /// The f16 kernels compute exactly what the f32 kernels compute on the widened values: the
    /// conversion is the only difference, and it is exact.
    #[test]
    fn f16_kernels_equal_f32_on_widened_values() {
        let half_of = |v: Vec<f32>| -> (Vec<half::f16>, Vec<f32>) {
            let h: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            let w = h.iter().map(|x| x.to_f32()).collect();
            (h, w)
        };
        for nq in [1, 3, 6, 12] {
            for (n, ld) in [(1, 16), (7, 16), (16, 16), (40, 48)] {
                let d = 64;
                let q = rnd(nq * d, 3);
                let (kh, kw) = half_of(rnd((d - 1) * ld + n, 4));
                let (mut a, mut b) = (vec![0f32; nq * n], vec![0f32; nq * n]);
                dot_keys_t(&q, nq, &[(&kh[..], n)], ld, 0.125, &mut a, n);
                dot_keys_t(&q, nq, &[(&kw[..], n)], ld, 0.125, &mut b, n);
                assert_eq!(a, b, "scores nq={nq} n={n}");
                let (vh, vw) = half_of(rnd(n * d, 5));
                let p = rnd(nq * n, 6);
                let g = nq.min(AXPY_GROUP_MAX);
                let mut acc_h = rnd(g * d, 7);
                let mut acc_w = acc_h.clone();
                axpy_rows_group(&p, n, &[&vh[..]], &mut acc_h, g);
                axpy_rows_group(&p, n, &[&vw[..]], &mut acc_w, g);
                assert_eq!(acc_h, acc_w, "values g={g} n={n}");
            }
        }
    }

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
    }

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-4 * (1.0 + a.abs().max(b.abs()))
    }

    #[test]
    fn vector_max_equals_scalar() {
        for n in [0usize, 1, 15, 16, 17, 100] {
            let mut x = rnd(n, 70 + n as u64);
            assert_eq!(
                max_f32(&x),
                x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            );
            if n > 3 {
                x[2] = f32::NAN;
                x[n - 1] = 7.0;
                assert_eq!(max_f32(&x), 7.0, "n={n}");
            }
        }
        assert_eq!(max_f32(&[f32::NEG_INFINITY; 20]), f32::NEG_INFINITY);
    }

    #[test]
    fn vector_silu_mul_matches_the_scalar_formula() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        for n in [0usize, 1, 15, 16, 17, 100] {
            let mut g: Vec<f32> = (0..n).map(|_| r.gen_range(-30.0..30.0)).collect();
            g.extend([-200.0, 200.0, 0.0, -0.0]);
            let u: Vec<f32> = (0..g.len()).map(|_| r.gen_range(-2.0..2.0)).collect();
            let want: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(&v, &u)| v as f64 / (1.0 + (-v as f64).exp()) * u as f64)
                .collect();
            let mut got = g.clone();
            silu_mul(&mut got, &u);
            for ((v, w), x) in got.iter().zip(&want).zip(&g) {
                // exp within 2 ulp, then a division and a product: a few ulp of the result.
                let tol = 8.0 * f32::EPSILON as f64 * w.abs() + 1e-37;
                assert!((*v as f64 - w).abs() <= tol, "silu({x}) = {v}, want {w}");
            }
            // Into another buffer: the same bits as in place, and `gate` untouched.
            let mut to = vec![f32::NAN; g.len()];
            silu_mul_to(&g, &u, &mut to);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&to), bits(&got), "n={n}");
        }
    }

    #[test]
    fn vector_exp_is_within_two_ulp() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for n in [0usize, 1, 15, 16, 17, 100] {
            let x: Vec<f32> = (0..n).map(|_| r.gen_range(-90.0..0.0)).collect();
            let mut y = x.clone();
            let sum = exp_shifted_sum(&mut y, 0.0);
            let mut want_sum = 0f64;
            for (a, b) in x.iter().zip(&y) {
                let want = (*a as f64).exp();
                want_sum += want;
                let ulp = (want as f32).abs() * f32::EPSILON;
                assert!(
                    (*b as f64 - want).abs() <= 2.0 * ulp as f64 + 1e-45,
                    "exp({a}) = {b}, want {want}"
                );
            }
            assert!((sum as f64 - want_sum).abs() <= 1e-6 * want_sum + 1e-30);
        }
        let mut y = vec![-200.0, 0.0, -1e-8];
        assert_eq!(exp_shifted_sum(&mut y, 0.0), 1.0 + y[2]);
        assert_eq!(y[0], 0.0);
        assert_eq!(y[1], 1.0);
    }

    /// Each lane's exponential is its own: the same bits beside lanes that take the far path
    /// (a result below the normal range, a large argument, −∞, NaN) as beside lanes that do not,
    /// so a score's weight does not depend on the scores it is computed with.
    #[test]
    fn exp_lanes_do_not_depend_on_their_neighbours() {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        // Around 2^-126 (x = -87.34) and the clamp (-104) from both sides, and the far values.
        let mut near: Vec<f32> = vec![0.0, -0.0, -1e-30, -87.0, -87.3, -87.33, -87.335];
        near.extend((0..40).map(|_| r.gen_range(-87.3f32..0.0)));
        // (-88.0 to -89.0 also put silu's e^88 to e^89 on both sides of 2^128.)
        let mut far: Vec<f32> = vec![-87.35, -87.4, -87.7, -88.0, -88.3, -88.38, -88.4, -88.5];
        far.extend([-89.0, -100.0, -103.9, -104.0, -104.5, -150.0]);
        far.extend([f32::NEG_INFINITY, f32::NAN]);
        far.extend((0..20).map(|_| r.gen_range(-110.0f32..-87.34)));
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for &v in near.iter().chain(&far) {
            let mut alone = [v; 8];
            exp_shifted_sum(&mut alone, 0.0);
            for lane in 0..8 {
                for others in [&near, &far] {
                    let mut x: Vec<f32> = (0..8)
                        .map(|i| others[(i * 7 + lane) % others.len()])
                        .collect();
                    x[lane] = v;
                    exp_shifted_sum(&mut x, 0.0);
                    assert_eq!(
                        x[lane].to_bits(),
                        alone[0].to_bits(),
                        "exp({v}) in lane {lane}"
                    );
                }
            }
            // silu's exponential, of -v: large arguments (2^128 and up) take the far path too.
            for w in [v, -v] {
                let g = [w, 0.5, -89.0, 1.0, 95.0, -3.0, 100.0, 7.0];
                let mut mixed = [0f32; 8];
                silu_mul_to(&g, &[1.0; 8], &mut mixed);
                let mut one = [0f32; 8];
                silu_mul_to(&[w; 8], &[1.0; 8], &mut one);
                assert_eq!(bits(&mixed[..1]), bits(&one[..1]), "silu({w})");
            }
        }
    }

    #[test]
    fn value_runs_match_scalar() {
        for d in [4, 16, 48, 64, 128] {
            for n in [0, 1, 5, 16] {
                let rows = rnd(n * d, 4);
                let p = rnd(n, 5);
                let mut acc = rnd(d, 6);
                let mut want_acc = acc.clone();
                axpy_rows(&p, &rows, &mut acc);
                for t in 0..n {
                    for i in 0..d {
                        want_acc[i] += p[t] * rows[t * d + i];
                    }
                }
                for i in 0..d {
                    assert!(close(acc[i], want_acc[i]), "d={d} n={n} i={i}");
                }
            }
        }
    }

    /// Every tile size and key count (masked tails, several 16-key chunks), odd and even
    /// dimensions; slots outside the scores stay untouched.
    #[test]
    fn transposed_key_scores_match_dots() {
        for d in [1, 7, 16, 64, 128] {
            for nq in [1, 2, 3, 5, 9, 12, 13, 25] {
                for (n, ld) in [(1, 1), (4, 4), (15, 16), (16, 16), (17, 20), (40, 48)] {
                    let q = rnd(nq * d, 11 + nq as u64);
                    let kt = rnd((d - 1) * ld + n, 12 + n as u64);
                    let ldo = n + 3;
                    let mut out = vec![f32::NAN; nq * ldo];
                    dot_keys_t(&q, nq, &[(&kt[..], n)], ld, 0.25, &mut out, ldo);
                    let mut portable = vec![f32::NAN; nq * ldo];
                    dot_keys_t_scalar(&q, nq, &kt, ld, n, 0.25, &mut portable, ldo);
                    for (o, p) in out.iter().zip(&portable) {
                        assert!(
                            close(*o, *p) || (o.is_nan() && p.is_nan()),
                            "portable differs"
                        );
                    }
                    for v in 0..nq {
                        for j in 0..ldo {
                            let got = out[v * ldo + j];
                            if j >= n {
                                assert!(got.is_nan(), "wrote past the keys");
                                continue;
                            }
                            let want: f32 =
                                (0..d).map(|i| q[v * d + i] * kt[i * ld + j]).sum::<f32>() * 0.25;
                            assert!(close(got, want), "d={d} nq={nq} n={n} v={v} j={j}");
                        }
                    }
                }
            }
        }
    }

    /// Runs of keys from separate buffers (a segment's blocks) give each run's scores, after
    /// the runs before it in each row, the same bits as the runs one at a time: a run's
    /// pairing with its neighbours, and its cut into pieces of 16 keys, change no score. (An
    /// empty run may come with an empty buffer.)
    #[test]
    fn key_runs_score_as_alone() {
        let (d, ld) = (64, 32);
        for nq in [1, 3, 6, 7, 12, 13] {
            for lens in [
                &[16, 16][..],
                &[16, 16, 5],
                &[3],
                &[16, 9, 16, 16, 1],
                &[0, 16, 0],
                &[9, 32, 20],
                &[32, 17],
            ] {
                let q = rnd(nq * d, 21);
                let keys: Vec<Vec<f32>> = lens
                    .iter()
                    .enumerate()
                    .map(|(r, &l)| match l {
                        0 => Vec::new(),
                        l => rnd((d - 1) * ld + l, 22 + r as u64),
                    })
                    .collect();
                let runs: Vec<(&[f32], usize)> =
                    keys.iter().zip(lens).map(|(k, &l)| (&k[..], l)).collect();
                let n: usize = lens.iter().sum();
                let ldo = n + 1;
                let mut out = vec![f32::NAN; nq * ldo];
                dot_keys_t(&q, nq, &runs, ld, 0.125, &mut out, ldo);
                let mut o = 0;
                for &(k, l) in &runs {
                    let mut alone = vec![f32::NAN; nq * l.max(1)];
                    dot_keys_t(&q, nq, &[(k, l)], ld, 0.125, &mut alone, l.max(1));
                    let mut want = vec![f32::NAN; nq * l.max(1)];
                    dot_keys_t_scalar(&q, nq, k, ld, l, 0.125, &mut want, l.max(1));
                    for v in 0..nq {
                        for j in 0..l {
                            let got = out[v * ldo + o + j];
                            assert_eq!(got.to_bits(), alone[v * l + j].to_bits(), "{lens:?}");
                            assert!(close(got, want[v * l + j]), "nq={nq} {lens:?} v={v}");
                        }
                    }
                    o += l;
                }
                for v in 0..nq {
                    assert!(out[v * ldo + n].is_nan(), "wrote past the keys");
                }
            }
        }
    }

    /// How many query vectors (or heads) a register tile takes (the level's: six at AVX2, two
    /// at SSE2, twelve over two pieces at AVX-512) changes no score and no weighted value: a
    /// tile's outputs have the bits of each query or head alone.
    #[test]
    fn query_tiles_change_no_bit() {
        let (d, ld, n) = (64, 32, 29);
        let kt = rnd((d - 1) * ld + n, 31);
        let rows = rnd(n * d, 32);
        for nq in 1..=13 {
            let q = rnd(nq * d, 33);
            let mut all = vec![0f32; nq * n];
            dot_keys_t(&q, nq, &[(&kt[..], n)], ld, 0.125, &mut all, n);
            let p = rnd(nq * n, 34);
            let mut acc = rnd(nq * d, 35);
            let before = acc.clone();
            for v0 in (0..nq).step_by(AXPY_GROUP_MAX) {
                let g = (nq - v0).min(AXPY_GROUP_MAX);
                axpy_rows_group(
                    &p[v0 * n..],
                    n,
                    &[&rows[..]],
                    &mut acc[v0 * d..][..g * d],
                    g,
                );
            }
            for v in 0..nq {
                let mut one = vec![0f32; n];
                dot_keys_t(
                    &q[v * d..(v + 1) * d],
                    1,
                    &[(&kt[..], n)],
                    ld,
                    0.125,
                    &mut one,
                    n,
                );
                let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&all[v * n..(v + 1) * n]),
                    bits(&one),
                    "scores nq={nq} v={v}"
                );
                let mut alone = before[v * d..(v + 1) * d].to_vec();
                axpy_rows_group(&p[v * n..(v + 1) * n], n, &[&rows[..]], &mut alone, 1);
                assert_eq!(
                    bits(&acc[v * d..(v + 1) * d]),
                    bits(&alone),
                    "values nq={nq} v={v}"
                );
            }
        }
    }

    /// The sums written straight to the output rows, normalized, have the bits of the sums
    /// taken into zeroed accumulators and normalized after (the merge of one partial), at every
    /// head count and head size (the fallback's too), and nothing else is written.
    #[test]
    fn value_sums_written_out_equal_the_merged_ones() {
        for d in [8, 16, 64, 128] {
            for g in 1..=7 {
                let (n, stride) = (21, 23);
                let rows = rnd(n * d, 41);
                let p = rnd(g * stride, 42);
                let inv: Vec<f32> = rnd(g, 43).iter().map(|x| 1.0 / (x + 2.0)).collect();
                let mut want = vec![0f32; g * d];
                axpy_rows_group(&p, stride, &[&rows[..7 * d], &rows[7 * d..]], &mut want, g);
                for (h, w) in want.chunks_exact_mut(d).enumerate() {
                    w.iter_mut().for_each(|x| *x = *x * inv[h] + 0.0);
                }
                // Output rows 3 values apart, with NaN between and around them.
                let ld = d + 3;
                let mut out = vec![f32::NAN; g * ld + 3];
                let outs: Vec<*mut f32> = (0..g).map(|h| out[3 + h * ld..].as_mut_ptr()).collect();
                let mut acc = vec![f32::NAN; g * d];
                let fin = Finish {
                    inv: &inv,
                    out: &outs,
                };
                let runs = [&rows[..7 * d], &rows[7 * d..]];
                // SAFETY: each output row has `d` values of its own in `out`.
                unsafe { axpy_rows_group_to(&p, stride, &runs, &mut acc, g, fin) };
                for h in 0..g {
                    let got: Vec<u32> =
                        out[3 + h * ld..][..d].iter().map(|x| x.to_bits()).collect();
                    let w: Vec<u32> = want[h * d..][..d].iter().map(|x| x.to_bits()).collect();
                    assert_eq!(got, w, "d={d} g={g} h={h}");
                }
                let untouched = (0..out.len()).filter(|i| *i < 3 || (i - 3) % ld >= d);
                assert!(
                    untouched.into_iter().all(|i| out[i].is_nan()),
                    "d={d} g={g}"
                );
                if d.is_multiple_of(16) && g <= AXPY_GROUP_MAX {
                    assert!(
                        acc.iter().all(|x| x.is_nan()),
                        "the kernels leave acc alone"
                    );
                }
            }
        }
    }

    #[test]
    fn grouped_value_runs_match_per_head() {
        for d in [16, 64, 128] {
            for g in 1..=7 {
                for n in [0, 1, 3, 16] {
                    let stride = n + 2;
                    let rows = rnd(n * d, 8);
                    let p = rnd(g * stride, 9);
                    let mut acc = rnd(g * d, 10);
                    let before = acc.clone();
                    axpy_rows_group(&p, stride, &[&rows[..]], &mut acc, g);
                    // The rows cut into runs anywhere: the same bits.
                    for cut in [0, n / 2, n.saturating_sub(1), n] {
                        let mut split = before.clone();
                        let (a, b) = rows.split_at(cut * d);
                        axpy_rows_group(&p, stride, &[a, &[], b], &mut split, g);
                        assert_eq!(split, acc, "d={d} g={g} n={n} cut={cut}");
                    }
                    for h in 0..g {
                        let mut want_acc = before[h * d..(h + 1) * d].to_vec();
                        axpy_rows(&p[h * stride..h * stride + n], &rows, &mut want_acc);
                        for i in 0..d {
                            assert!(close(acc[h * d + i], want_acc[i]), "d={d} g={g} n={n}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn dot_and_axpy_match_scalar() {
        for n in [0, 1, 7, 8, 15, 16, 17, 64, 100] {
            let a = rnd(n, 1);
            let b = rnd(n, 2);
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!(close(dot_f32(&a, &b), want), "n={n}");
            assert!(close(dot_scalar(&a, &b), want), "n={n}");
            let mut y = b.clone();
            axpy(0.5, &a, &mut y);
            for i in 0..n {
                assert!(close(y[i], b[i] + 0.5 * a[i]));
            }
        }
    }

    /// [`panel_product`]'s order written out: one chain over the columns in order, fused at
    /// AVX2 and up (and on aarch64), a multiply and an add at x86's portable level.
    fn chain(x: &[f32], w: impl Fn(usize) -> f32) -> f32 {
        let fused = cfg!(not(target_arch = "x86_64")) || has_avx2_fma();
        let mut s = 0f32;
        for (t, &v) in x.iter().enumerate() {
            s = if fused {
                v.mul_add(w(t), s)
            } else {
                v * w(t) + s
            };
        }
        s
    }

    /// Row-major weights (`n` rows of `k`) as panels of `k` columns, zero rows to a whole panel.
    fn panels_of(w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let np = n.div_ceil(PANEL);
        let mut p = vec![0f32; np * k * PANEL];
        for r in 0..n {
            for t in 0..k {
                p[(r / PANEL) * k * PANEL + t * PANEL + r % PANEL] = w[r * k + t];
            }
        }
        p
    }

    /// [`row_blocks`] covers every row once, no block past the tile, and at AVX2 (tile of 6
    /// rows) no block of 4 or 1 from 5 rows on: blocks of 5 or 6 and at most one of 2 or 3, last.
    #[test]
    fn row_blocks_cover_the_rows_in_tiles_of_five_or_six_at_avx2() {
        let tiles = (1..=6).flat_map(|tm| [(false, tm), (true, tm)]);
        for ((avx2, tm), m) in tiles.flat_map(|t| (1..=400).map(move |m| (t, m))) {
            let sizes: Vec<usize> = row_blocks(m, tm, avx2).collect();
            assert_eq!(sizes.iter().sum::<usize>(), m, "m={m} tm={tm}: {sizes:?}");
            assert!(
                sizes.iter().all(|&b| (1..=tm).contains(&b)),
                "m={m} tm={tm}: {sizes:?}"
            );
            let even = |s: &[usize]| s.iter().max().unwrap() - s.iter().min().unwrap() <= 1;
            if avx2 && tm == 6 && m >= 5 {
                let (last, head) = sizes.split_last().unwrap();
                let fives = |s: &[usize]| s.iter().all(|&b| b == 5 || b == 6);
                assert!(
                    (fives(&sizes) && even(&sizes))
                        || ([2, 3].contains(last) && fives(head) && even(head)),
                    "m={m}: {sizes:?}"
                );
                assert!(sizes.len() <= m.div_ceil(6) + 1, "m={m}: {sizes:?}");
            } else {
                assert!(
                    even(&sizes) && sizes.len() == m.div_ceil(tm),
                    "m={m} tm={tm} avx2={avx2}: {sizes:?}"
                );
            }
        }
        let cut = |m| row_blocks(m, 6, true).collect::<Vec<_>>();
        assert_eq!(cut(8), [5, 3]);
        assert_eq!(cut(7), [5, 2]);
        assert_eq!(cut(13), [5, 5, 3]);
        assert_eq!(cut(32), [6, 6, 5, 5, 5, 5]);
        assert_eq!(row_blocks(8, 6, false).collect::<Vec<_>>(), [4, 4]);
    }

    /// Every tile shape the dispatch serves (every row count up to two tiles' and more, each way
    /// [`row_blocks`] cuts them, and panel count up to [`MAX_PANELS`], partial panels), whole and
    /// in spans of columns, gives each output the bits of the one chain: the tiles cannot drift
    /// apart, and a span boundary changes nothing.
    #[test]
    fn every_tile_shape_gives_one_chain_per_output() {
        for k in [1, 16, 37, 320, 577] {
            let n = MAX_PANELS * PANEL;
            let (x, w) = (rnd(19 * k, k as u64), rnd(n * k, 7 * k as u64));
            let wp = panels_of(&w, n, k);
            for m in (1..=14).chain([19]) {
                for cols in [1, 5, 16, 17, 31, 33, 48, 63, 64] {
                    let ldo = cols + 3;
                    let mut whole = vec![f32::NAN; m * ldo];
                    let mut spans = vec![f32::NAN; m * ldo];
                    let cut = k / 3;
                    // SAFETY: m rows of x (k apart), the panels of `cols` rows (k·16 apart),
                    // out of m rows of ldo ≥ cols.
                    unsafe {
                        let go = |t0: usize, t1: usize, cont: bool, out: &mut Vec<f32>| {
                            panel_product(
                                x.as_ptr().add(t0),
                                k,
                                m,
                                wp.as_ptr().add(t0 * PANEL),
                                k * PANEL,
                                cols,
                                t1 - t0,
                                cont,
                                out.as_mut_ptr(),
                                ldo,
                            )
                        };
                        go(0, k, false, &mut whole);
                        go(0, cut, false, &mut spans);
                        go(cut, k, true, &mut spans);
                    }
                    for a in 0..m {
                        for c in 0..ldo {
                            let (got, span) = (whole[a * ldo + c], spans[a * ldo + c]);
                            if c >= cols {
                                assert!(got.is_nan() && span.is_nan(), "wrote past the outputs");
                                continue;
                            }
                            let want = chain(&x[a * k..(a + 1) * k], |t| w[c * k + t]);
                            assert_eq!(
                                (got.to_bits(), span.to_bits()),
                                (want.to_bits(), want.to_bits()),
                                "m={m} cols={cols} k={k}, output ({a}, {c}): {got}, {span} in spans, vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Panels keep GGML's bytes (row by row back to them exactly), decode to GGML's values at
    /// every level this CPU has, and one row or a few against them in registers give the
    /// decoded panels' product bit for bit. The AVX2 and AVX-512 products give the same bits.
    #[test]
    fn panels_decode_and_multiply_alike_at_every_level() {
        // 37 rows: three panels, the last with 5 rows and 11 of padding; 44: its last with 12
        // (eight of them a vector: a whole one and a part); 69: five.
        for n in [37, 44, 69] {
            panels_at_every_level(n, 512);
        }
        panels_at_every_level(37, 320);
    }

    /// Two activation rows up to `most` against every panel of `n` rows of `k` columns, as a
    /// task takes them (up to [`MAX_PANELS`] from each panel): `product(xs, m, p0, out, cols)`
    /// writes `cols` outputs from panel `p0` of each of `m` rows of `n` outputs at `out`, the
    /// first row's at `out`. Each output is its row's one fused chain over the columns (the
    /// multi-row kernels exist only at levels that fuse), bit for bit.
    fn check_row_products(
        (n, k): (usize, usize),
        dense: &[f32],
        most: usize,
        what: &str,
        product: impl Fn(&[f32], usize, usize, *mut f32, usize),
    ) {
        for m in 2..=most {
            let xs: Vec<f32> = (0..m).flat_map(|a| rnd(k, 60 + a as u64)).collect();
            let mut got = vec![f32::NAN; m * n];
            for p0 in 0..n.div_ceil(PANEL) {
                let (c0, c1) = (p0 * PANEL, ((p0 + MAX_PANELS) * PANEL).min(n));
                product(&xs, m, p0, got.as_mut_ptr().wrapping_add(c0), c1 - c0);
            }
            for (i, g) in got.iter().enumerate() {
                let (a, c) = (i / n, i % n);
                let want = (0..k).fold(0f32, |s, t| xs[a * k + t].mul_add(dense[c * k + t], s));
                assert_eq!(g.to_bits(), want.to_bits(), "{what}: {m} rows, output {i}");
            }
        }
    }

    /// Every panel format at every level this CPU has: the decoded panels are GGML's values bit
    /// for bit, and the product of one row decoded in registers and the panel product both give
    /// each output's one fused chain over the columns.
    fn panels_at_every_level(n: usize, k: usize) {
        let x = rnd(k, 6);
        for ty in fmt::tests::TYPES {
            let Some(l) = fmt::layout(ty).filter(|l| k.is_multiple_of(l.cols())) else {
                continue;
            };
            let ggml = fmt::tests::random_ggml(ty, n * k, 5 + ty as u64);
            let panels = to_panels(ty, &ggml, n, k);
            let (nb, pl, np) = (k / 32, l.panel(k), n.div_ceil(PANEL));
            let mut dense = vec![0f32; n * k];
            tandem_model::dequantize(ty, &ggml, &mut dense).unwrap();
            let want = panels_of(&dense, n, k);
            let wants: Vec<f32> = (0..n).map(|c| chain(&x, |t| dense[c * k + t])).collect();
            let fused: Vec<f32> = (0..n)
                .map(|c| (0..k).fold(0f32, |s, t| x[t].mul_add(dense[c * k + t], s)))
                .collect();
            let mut levels = vec![Isa::Portable];
            #[cfg(target_arch = "x86_64")]
            levels.extend([Isa::Avx2, Isa::Avx512]);
            for level in levels {
                if crate::isa::detected() < level {
                    eprintln!("no {level:?} on this CPU: its kernels are not tested here");
                    continue;
                }
                let mut dec = vec![f32::NAN; np * k * PANEL];
                for p in 0..np {
                    // In two spans, the second from block 3.
                    let (a, b) = dec[p * k * PANEL..].split_at_mut(3 * 32 * PANEL);
                    // SAFETY: the level is on this CPU; panel p's bytes and its outputs.
                    unsafe {
                        dequant_panel_at(level, ty, &panels[p * pl..], 0, 3, a);
                        dequant_panel_at(level, ty, &panels[p * pl..], 3, nb, b);
                    }
                }
                assert_eq!(dec, want, "{ty} decoded at {level:?}");
                if level == Isa::Portable {
                    continue;
                }
                let mut x1 = vec![f32::NAN; n];
                // Every run of panels a task may take: from each panel, one to four.
                for p0 in 0..np {
                    for len in 1..=MAX_PANELS.min(np - p0) {
                        let (c0, c1) = (p0 * PANEL, ((p0 + len) * PANEL).min(n));
                        x1[c0..c1].fill(f32::NAN);
                        // SAFETY: as above; outputs c0..c1 are panels p0.. +len.
                        unsafe {
                            let o = &mut x1[c0..c1];
                            dot_quant_rows_at(
                                level,
                                ty,
                                &panels,
                                np,
                                p0,
                                &x,
                                1,
                                o.as_mut_ptr(),
                                o.len(),
                                o.len(),
                            )
                        };
                        for c in c0..c1 {
                            assert_eq!(
                                x1[c].to_bits(),
                                fused[c].to_bits(),
                                "{ty} {level:?} panels {p0}+{len}, output {c}"
                            );
                        }
                    }
                }
                // Two rows up to as many as the level's kernel takes in one call.
                let most = if level >= Isa::Avx512 { 8 } else { 4 };
                let what = format!("{ty} {level:?}");
                check_row_products((n, k), &dense, most, &what, |xs, m, p0, out, cols| {
                    // SAFETY: the level is on this CPU; the panels; `out` as the helper says.
                    unsafe { dot_quant_rows_at(level, ty, &panels, np, p0, xs, m, out, n, cols) }
                });
            }
            // Through the dispatch, at the process's level: the decoded panels and their
            // product, and where the level has it, the one-row product in registers.
            let mut dec = vec![f32::NAN; np * k * PANEL];
            for p in 0..np {
                dequant_panel(ty, &panels, n, k, p, 0, nb, &mut dec[p * k * PANEL..]);
            }
            assert_eq!(dec, want, "{ty} dispatched decode");
            let mut tile = vec![f32::NAN; n];
            // SAFETY: the decoded panels hold np panels of k columns; n outputs of one row.
            unsafe {
                panel_product(
                    x.as_ptr(),
                    k,
                    1,
                    dec.as_ptr(),
                    k * PANEL,
                    n,
                    k,
                    false,
                    tile.as_mut_ptr(),
                    n,
                )
            };
            let mut x1 = vec![f32::NAN; n];
            for c in 0..n {
                assert_eq!(tile[c].to_bits(), wants[c].to_bits(), "{ty} tile {c}");
            }
            // A few rows at once, each row's outputs its own chain's bits.
            if has_quant_x1(ty) && fused_rows() > 1 {
                let (most, what) = (fused_rows(), format!("{ty} dispatched"));
                check_row_products((n, k), &dense, most, &what, |xs, m, p0, out, cols| {
                    // SAFETY: `out` as the helper says.
                    unsafe { dot_quant_rows(ty, &panels, n, p0, xs, m, out, n, cols) }
                });
            }
            if has_quant_x1(ty) {
                for p0 in 0..np {
                    let (c0, c1) = (p0 * PANEL, ((p0 + MAX_PANELS) * PANEL).min(n));
                    dot_quant_x1(ty, &panels, n, p0, &x, &mut x1[c0..c1]);
                    for c in c0..c1 {
                        assert_eq!(x1[c].to_bits(), wants[c].to_bits(), "{ty} one row {c}");
                    }
                }
            }
        }
        let w = rnd(k, 5);
        let wantf = dot_scalar(&w, &x);
        #[cfg(target_arch = "x86_64")]
        {
            let cpu = crate::isa::detected();
            // SAFETY: guarded by the feature checks.
            unsafe {
                if cpu >= Isa::Avx2 {
                    assert!(close(avx2::dot(&w, &x), wantf));
                }
                if cpu >= Isa::Avx512 {
                    assert!(close(avx512::dot(&w, &x), wantf));
                }
            }
        }
        assert!(close(portable::dot(&w, &x), wantf));
    }
}

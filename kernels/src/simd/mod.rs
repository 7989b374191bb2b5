//! Vector primitives at every kernel level ([`crate::isa`]): AVX-512 (`avx512`), AVX2+FMA
//! (`avx2`) and portable SIMD (`portable`, the `wide` crate: NEON on aarch64). Each public function
//! here dispatches on the process's level; a level's kernels are only called where it is active.
//!
//! Products keep activations in f32: weight rows are decoded to f32 ([`dequant_row`]) and every
//! output is one [`dot_tile`] dot product in one fixed order, whatever the batch. (llama.cpp
//! instead rounds activations to 8 bits, which is faster but no longer matches an f32 reference
//! token for token; a fused `d·Σq·x + m·Σx` for Q4_1 is faster at one row but other bits than the
//! decoded rows give at many.)
//!
//! Q4_1 and Q8_0 rows are kept in a *split* layout (see [`split_row`]): a row's block scales (and
//! Q4_1 mins) first, then its quants. Same bytes as GGML's interleaved blocks, but sixteen scales
//! convert with one instruction and the quants stream without gaps.

use tandem_model::{dequantize, GgmlType};

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
    axpy_rows_group(p, p.len(), rows, acc, 1)
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

/// Most query vectors [`dot_keys_t`] keeps in registers at once.
pub const KEYS_T_TILE: usize = 12;

/// Scores of `nq` query vectors against `n` keys stored transposed:
/// `out[v·ldo + j] = scale · Σ_i q[v·d + i] · kt[i·ld + j]` for `v < nq`, `j < n`, where `d =
/// q.len() / nq` and column `j` of `kt` (stride `ld` between dimensions) is key `j`. Each
/// 16-key row of `kt` is loaded once for up to [`KEYS_T_TILE`] queries and multiplied with one
/// broadcast element of each: no horizontal sums, one FMA per query and key per dimension.
#[allow(clippy::too_many_arguments)]
pub fn dot_keys_t<T: KvValue>(
    q: &[f32],
    nq: usize,
    kt: &[T],
    ld: usize,
    n: usize,
    scale: f32,
    out: &mut [f32],
    ldo: usize,
) {
    if nq == 0 || n == 0 {
        return;
    }
    let d = q.len() / nq;
    if d == 0 {
        (0..nq).for_each(|v| out[v * ldo..v * ldo + n].fill(0.0));
        return;
    }
    assert!(
        n <= ld && kt.len() >= (d - 1) * ld + n && out.len() >= (nq - 1) * ldo + n,
        "dot_keys_t: {nq} queries of {d} against {n} keys (stride {ld}) do not fit"
    );
    // Query tiles the level's registers hold: AVX-512 has 32 of 16 lanes (two accumulator sets
    // per query), the others 16 (or NEON's 32) of 8 lanes in pairs.
    let tiles: &[usize] = if has_avx512() {
        &[12, 8, 6, 4, 3, 2, 1]
    } else {
        &[6, 4, 3, 2, 1]
    };
    let level = crate::isa::active();
    let mut v0 = 0;
    while v0 < nq {
        let take = *tiles.iter().find(|&&t| t <= nq - v0).expect("1 fits");
        for j0 in (0..n).step_by(16) {
            let cols = (n - j0).min(16);
            // SAFETY: the level's features are on this CPU (`isa::active`). Rows `i < d` of `kt`
            // hold `cols` keys from `j0` (checked above; lanes past them are not read); `out`
            // rows `v0..v0+take` hold `cols` slots from `j0`.
            unsafe {
                let (qp, kp, op) = (
                    q.as_ptr().add(v0 * d),
                    kt.as_ptr().add(j0),
                    out.as_mut_ptr().add(v0 * ldo + j0),
                );
                macro_rules! go {
                    ($m:ident :: $f:ident $(, $full:expr)?) => {
                        match take {
                            12 => $m::$f::<T, 12 $(, $full)?>(qp, d, kp, ld, cols, scale, op, ldo),
                            8 => $m::$f::<T, 8 $(, $full)?>(qp, d, kp, ld, cols, scale, op, ldo),
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
                    Isa::Avx512 | Isa::Amx => go!(avx512::dot_keys_t),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 if cols == 16 => go!(avx2::dot_keys_t, true),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => go!(avx2::dot_keys_t, false),
                    _ => go!(portable::dot_keys_t),
                }
            }
        }
        v0 += take;
    }
}

/// Most heads [`axpy_rows_group`] keeps in registers at once (more fall back to one at a time).
pub const AXPY_GROUP_MAX: usize = 6;

/// [`axpy_rows`] for `g` heads sharing the rows: `acc[h] += Σ_t p[h·stride + t] · rows[t]` with
/// `acc` g×d.
pub fn axpy_rows_group<T: KvValue>(
    p: &[f32],
    stride: usize,
    rows: &[T],
    acc: &mut [f32],
    g: usize,
) {
    let d = acc.len() / g;
    let n = rows.len() / d;
    assert!(
        g > 0 && rows.len() == n * d && p.len() >= (g - 1) * stride + n,
        "axpy_rows_group: {g} heads of {d} over {n} rows do not fit"
    );
    macro_rules! go {
        ($m:ident :: $f:ident) => {
            // SAFETY: the level's features are on this CPU (`isa::active`); `rows` holds `n` rows
            // of `d` (a multiple of the kernel's width), `acc` g rows of `d`, and `p` the
            // probabilities of every head for every row (asserted above).
            unsafe {
                match g {
                    1 => return $m::$f::<T, 1>(p, stride, rows, acc),
                    2 => return $m::$f::<T, 2>(p, stride, rows, acc),
                    3 => return $m::$f::<T, 3>(p, stride, rows, acc),
                    4 => return $m::$f::<T, 4>(p, stride, rows, acc),
                    5 => return $m::$f::<T, 5>(p, stride, rows, acc),
                    6 => return $m::$f::<T, 6>(p, stride, rows, acc),
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
    for h in 0..g {
        let acc = &mut acc[h * d..(h + 1) * d];
        for (t, row) in rows.chunks_exact(d).enumerate() {
            let w = p[h * stride + t];
            for (a, x) in acc.iter_mut().zip(row) {
                *a += w * x.to_f32();
            }
        }
    }
}

/// Most activation rows of one [`dot_tile`] call at AVX2 and below.
pub const TILE_M: usize = 4;

/// Most weight rows of one [`dot_tile`] call with several activation rows at AVX2 and below
/// (4 × 3 accumulators, three weight vectors and an activation vector fill AVX2's 16 registers).
pub const TILE_R: usize = 3;

/// Most weight rows of one [`dot_tile`] call with one activation row: six independent chains
/// cover the FMA latency when there is no other row to interleave.
pub const TILE_R1: usize = 6;

/// AVX-512's tile: 6 × 4 accumulators, four weight vectors and an activation vector in its 32
/// registers. Against 4 × 3 it loads a vector for every 2.4 multiply-adds instead of 1.7. 512
/// rows through the model's products on a 2-core Zen 5, with the sums reduced eight at a time:
/// 322 → 276 ms. In a first trial, one reduction an output: 333 → 299 ms (4 × 6: 320, 5 × 5:
/// 302, 8 × 3: 334, 4 × 4: 331).
const TILE_M_512: usize = 6;
const TILE_R_512: usize = 4;

/// This level's most activation rows and weight rows of one [`dot_tile`] call with several
/// activation rows. A tile's shape never changes an output's bits, only how many are computed
/// at once.
pub fn tile() -> (usize, usize) {
    if has_avx512() {
        (TILE_M_512, TILE_R_512)
    } else {
        (TILE_M, TILE_R)
    }
}

/// `out[a·ldo + r] = Σ_t x[a·ldx + t] · w[r·ldw + t]` for activation rows `a < m` and weight
/// rows `r < rows`, `t < k`: the one dot product behind every [`crate::matmul`] path, whatever
/// the row counts, so an output's bits never depend on which rows share its call (the
/// batch-invariant order, see `matmul`'s module doc). `m` and `rows` within this level's
/// [`tile`], or `m = 1` and `rows ≤` [`TILE_R1`].
///
/// Every output is computed one way at a level: at AVX2 (and the portable level, with its own
/// multiply-add, unfused on x86's SSE2) eight lanes, lane `l` one FMA chain over `t ≡ l (mod 8)`
/// in increasing `t` from zero, reduced as `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`, then the
/// `k mod 8` last terms added one at a time; at AVX-512 and AMX the same with sixteen lanes
/// (`l_i + l_{i+8}` first, then that tree, then the `k mod 16` last terms). Running AVX2's
/// eight lanes there cost 22-41% of every bench figure on Zen 5 against the build before the
/// batch-invariant products; the levels' bits differ, as attention's and the norms' already did.
///
/// # Safety
/// `x` holds `m` rows of `k` values `ldx` apart, `w` holds `rows` rows of `k` values `ldw` apart,
/// and `out` is valid for writes at `a·ldo + r` with nothing else writing there meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_tile(
    x: *const f32,
    ldx: usize,
    m: usize,
    w: *const f32,
    ldw: usize,
    rows: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
) {
    macro_rules! go {
        ($m:ident :: $f:ident) => {
            match (m, rows) {
                (1, 1) => $m::$f::<1, 1>(x, ldx, w, ldw, k, out, ldo),
                (1, 2) => $m::$f::<1, 2>(x, ldx, w, ldw, k, out, ldo),
                (1, 3) => $m::$f::<1, 3>(x, ldx, w, ldw, k, out, ldo),
                (1, 4) => $m::$f::<1, 4>(x, ldx, w, ldw, k, out, ldo),
                (1, 5) => $m::$f::<1, 5>(x, ldx, w, ldw, k, out, ldo),
                (1, 6) => $m::$f::<1, 6>(x, ldx, w, ldw, k, out, ldo),
                (2, 1) => $m::$f::<2, 1>(x, ldx, w, ldw, k, out, ldo),
                (2, 2) => $m::$f::<2, 2>(x, ldx, w, ldw, k, out, ldo),
                (2, 3) => $m::$f::<2, 3>(x, ldx, w, ldw, k, out, ldo),
                (3, 1) => $m::$f::<3, 1>(x, ldx, w, ldw, k, out, ldo),
                (3, 2) => $m::$f::<3, 2>(x, ldx, w, ldw, k, out, ldo),
                (3, 3) => $m::$f::<3, 3>(x, ldx, w, ldw, k, out, ldo),
                (4, 1) => $m::$f::<4, 1>(x, ldx, w, ldw, k, out, ldo),
                (4, 2) => $m::$f::<4, 2>(x, ldx, w, ldw, k, out, ldo),
                (4, 3) => $m::$f::<4, 3>(x, ldx, w, ldw, k, out, ldo),
                _ => panic!("dot_tile: no kernel for {m} activation rows × {rows} weight rows"),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        return match (m, rows) {
            (1, 1) => avx512::dot_tile::<1, 1>(x, ldx, w, ldw, k, out, ldo),
            (1, 2) => avx512::dot_tile::<1, 2>(x, ldx, w, ldw, k, out, ldo),
            (1, 3) => avx512::dot_tile::<1, 3>(x, ldx, w, ldw, k, out, ldo),
            (1, 4) => avx512::dot_tile::<1, 4>(x, ldx, w, ldw, k, out, ldo),
            (1, 5) => avx512::dot_tile::<1, 5>(x, ldx, w, ldw, k, out, ldo),
            (1, 6) => avx512::dot_tile::<1, 6>(x, ldx, w, ldw, k, out, ldo),
            (2, 1) => avx512::dot_tile::<2, 1>(x, ldx, w, ldw, k, out, ldo),
            (2, 2) => avx512::dot_tile::<2, 2>(x, ldx, w, ldw, k, out, ldo),
            (2, 3) => avx512::dot_tile::<2, 3>(x, ldx, w, ldw, k, out, ldo),
            (2, 4) => avx512::dot_tile::<2, 4>(x, ldx, w, ldw, k, out, ldo),
            (3, 1) => avx512::dot_tile::<3, 1>(x, ldx, w, ldw, k, out, ldo),
            (3, 2) => avx512::dot_tile::<3, 2>(x, ldx, w, ldw, k, out, ldo),
            (3, 3) => avx512::dot_tile::<3, 3>(x, ldx, w, ldw, k, out, ldo),
            (3, 4) => avx512::dot_tile::<3, 4>(x, ldx, w, ldw, k, out, ldo),
            (4, 1) => avx512::dot_tile::<4, 1>(x, ldx, w, ldw, k, out, ldo),
            (4, 2) => avx512::dot_tile::<4, 2>(x, ldx, w, ldw, k, out, ldo),
            (4, 3) => avx512::dot_tile::<4, 3>(x, ldx, w, ldw, k, out, ldo),
            (4, 4) => avx512::dot_tile::<4, 4>(x, ldx, w, ldw, k, out, ldo),
            (5, 1) => avx512::dot_tile::<5, 1>(x, ldx, w, ldw, k, out, ldo),
            (5, 2) => avx512::dot_tile::<5, 2>(x, ldx, w, ldw, k, out, ldo),
            (5, 3) => avx512::dot_tile::<5, 3>(x, ldx, w, ldw, k, out, ldo),
            (5, 4) => avx512::dot_tile::<5, 4>(x, ldx, w, ldw, k, out, ldo),
            (6, 1) => avx512::dot_tile::<6, 1>(x, ldx, w, ldw, k, out, ldo),
            (6, 2) => avx512::dot_tile::<6, 2>(x, ldx, w, ldw, k, out, ldo),
            (6, 3) => avx512::dot_tile::<6, 3>(x, ldx, w, ldw, k, out, ldo),
            (6, 4) => avx512::dot_tile::<6, 4>(x, ldx, w, ldw, k, out, ldo),
            _ => panic!("dot_tile: no kernel for {m} activation rows × {rows} weight rows"),
        };
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        return go!(avx2::dot_tile);
    }
    // SSE2 has 16 registers of 4 lanes: an 8-lane accumulator takes two, and a tile of 4 × 3
    // outputs spilled most of them (the scalar level's prefill and batch-32 decode ran 11-13%
    // slower than before the batch-invariant products). Its tiles are cut to what fits, 2 × 2
    // outputs or 1 × 3 for one activation row; each output is still the same one dot product,
    // so the bits do not change with the cut.
    #[cfg(target_arch = "x86_64")]
    {
        let (tm, tr) = if m == 1 { (1, 3) } else { (2, 2) };
        if m > tm || rows > tr {
            for a0 in (0..m).step_by(tm) {
                for r0 in (0..rows).step_by(tr) {
                    dot_tile(
                        x.add(a0 * ldx),
                        ldx,
                        tm.min(m - a0),
                        w.add(r0 * ldw),
                        ldw,
                        tr.min(rows - r0),
                        k,
                        out.add(a0 * ldo + r0),
                        ldo,
                    );
                }
            }
            return;
        }
    }
    go!(portable::dot_tile)
}

/// Whether [`dot_tile_span`] runs here (AVX2 and up).
pub fn has_spans() -> bool {
    has_avx2_fma()
}

/// [`dot_tile`] over the columns `t0..t1` of `k` only, `m` and `rows` within this level's
/// [`tile`]: the lanes of the `m × rows` outputs carried in `state` (16 floats a lane vector)
/// from one span to the next, and the sums finished and written at the span that reaches `k`.
/// The lanes take their columns in order, so the outputs have [`dot_tile`]'s bits; the spans
/// let the activation rows of a tile stay in L1 while many weight rows pass, when a whole row
/// of `k` does not fit beside them. `t0` is a multiple of 16. Only where [`has_spans`].
///
/// # Safety
/// As [`dot_tile`]; `state` holds `m × rows × 16` floats, written by the span before this one
/// of the same outputs unless `t0 = 0`.
#[allow(clippy::too_many_arguments)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub unsafe fn dot_tile_span(
    x: *const f32,
    ldx: usize,
    m: usize,
    w: *const f32,
    ldw: usize,
    rows: usize,
    t0: usize,
    t1: usize,
    k: usize,
    state: *mut f32,
    out: *mut f32,
    ldo: usize,
) {
    assert!(
        has_spans() && t0.is_multiple_of(16),
        "dot_tile_span: not at this level, or a span from {t0}"
    );
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        return match (m, rows) {
            (1, 1) => avx512::dot_tile_span::<1, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (1, 2) => avx512::dot_tile_span::<1, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (1, 3) => avx512::dot_tile_span::<1, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (1, 4) => avx512::dot_tile_span::<1, 4>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (2, 1) => avx512::dot_tile_span::<2, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (2, 2) => avx512::dot_tile_span::<2, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (2, 3) => avx512::dot_tile_span::<2, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (2, 4) => avx512::dot_tile_span::<2, 4>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (3, 1) => avx512::dot_tile_span::<3, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (3, 2) => avx512::dot_tile_span::<3, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (3, 3) => avx512::dot_tile_span::<3, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (3, 4) => avx512::dot_tile_span::<3, 4>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (4, 1) => avx512::dot_tile_span::<4, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (4, 2) => avx512::dot_tile_span::<4, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (4, 3) => avx512::dot_tile_span::<4, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (4, 4) => avx512::dot_tile_span::<4, 4>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (5, 1) => avx512::dot_tile_span::<5, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (5, 2) => avx512::dot_tile_span::<5, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (5, 3) => avx512::dot_tile_span::<5, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (5, 4) => avx512::dot_tile_span::<5, 4>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (6, 1) => avx512::dot_tile_span::<6, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (6, 2) => avx512::dot_tile_span::<6, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (6, 3) => avx512::dot_tile_span::<6, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            (6, 4) => avx512::dot_tile_span::<6, 4>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
            _ => panic!("dot_tile_span: no kernel for {m} activation rows × {rows} weight rows"),
        };
    }
    #[cfg(target_arch = "x86_64")]
    match (m, rows) {
        (1, 1) => avx2::dot_tile_span::<1, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (1, 2) => avx2::dot_tile_span::<1, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (1, 3) => avx2::dot_tile_span::<1, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (2, 1) => avx2::dot_tile_span::<2, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (2, 2) => avx2::dot_tile_span::<2, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (2, 3) => avx2::dot_tile_span::<2, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (3, 1) => avx2::dot_tile_span::<3, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (3, 2) => avx2::dot_tile_span::<3, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (3, 3) => avx2::dot_tile_span::<3, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (4, 1) => avx2::dot_tile_span::<4, 1>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (4, 2) => avx2::dot_tile_span::<4, 2>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        (4, 3) => avx2::dot_tile_span::<4, 3>(x, ldx, w, ldw, t0, t1, k, state, out, ldo),
        _ => panic!("dot_tile_span: no kernel for {m} activation rows × {rows} weight rows"),
    }
}

/// Independent FMA chains of 8-lane vectors in [`fma_burst`] (AVX2 and portable): enough to
/// cover the latency of two FMA pipes, few enough to stay in 16 registers with the constants.
const BURST_CHAINS_8: usize = 12;

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
    rounds as u64 * BURST_CHAINS_8 as u64 * 16
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
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports the features; both slices have gate.len() elements.
        return unsafe { avx512::silu_mul(gate, up) };
    } else if has_avx2_fma() {
        // SAFETY: as above.
        return unsafe { avx2::silu_mul(gate, up) };
    }
    portable::silu_mul(gate, up)
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

/// Whether rows of `ty` are stored in the split layout.
pub fn is_split(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// Rewrites one GGML row of `ty` (interleaved blocks) into the kernels' layout: for Q4_1
/// `[d; nb] [m; nb] [qs; nb]` (f16, f16, 16 bytes each), for Q8_0 `[d; nb] [qs; nb]` (f16, 32
/// bytes each). Other types are copied unchanged. `out` has the length of `ggml`.
pub fn split_row(ty: GgmlType, ggml: &[u8], out: &mut [u8]) {
    debug_assert_eq!(ggml.len(), out.len());
    match ty {
        GgmlType::Q4_1 => {
            let nb = ggml.len() / 20;
            let (dm, qs) = out.split_at_mut(4 * nb);
            let (d, m) = dm.split_at_mut(2 * nb);
            for (b, blk) in ggml.chunks_exact(20).enumerate() {
                d[2 * b..2 * b + 2].copy_from_slice(&blk[..2]);
                m[2 * b..2 * b + 2].copy_from_slice(&blk[2..4]);
                qs[16 * b..16 * b + 16].copy_from_slice(&blk[4..]);
            }
        }
        GgmlType::Q8_0 => {
            let nb = ggml.len() / 34;
            let (d, qs) = out.split_at_mut(2 * nb);
            for (b, blk) in ggml.chunks_exact(34).enumerate() {
                d[2 * b..2 * b + 2].copy_from_slice(&blk[..2]);
                qs[32 * b..32 * b + 32].copy_from_slice(&blk[2..]);
            }
        }
        _ => out.copy_from_slice(ggml),
    }
}

fn f16_at(p: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([p[2 * i], p[2 * i + 1]]).to_f32()
}

/// Portable decode of a split Q4_1 or Q8_0 row (the same values GGML's dequantization gives).
fn dequant_split_portable(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::Q4_1 => {
            let nb = row.len() / 20;
            let qs = &row[4 * nb..];
            for b in 0..nb {
                let (d, m) = (f16_at(row, b), f16_at(row, nb + b));
                let o = &mut out[32 * b..32 * b + 32];
                for (j, &q) in qs[16 * b..16 * b + 16].iter().enumerate() {
                    o[j] = (q & 0x0f) as f32 * d + m;
                    o[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q8_0 => {
            let nb = row.len() / 34;
            let qs = &row[2 * nb..];
            for b in 0..nb {
                let d = f16_at(row, b);
                for (o, &q) in out[32 * b..32 * b + 32]
                    .iter_mut()
                    .zip(&qs[32 * b..32 * b + 32])
                {
                    *o = q as i8 as f32 * d;
                }
            }
        }
        _ => unreachable!("{ty} rows are not split"),
    }
}

/// Whether [`dot_quant_x1`] serves rows of `ty` in this process (split Q4_1/Q8_0 rows, AVX2 and
/// up).
pub fn has_quant_x1(ty: GgmlType) -> bool {
    is_split(ty) && has_avx2_fma()
}

/// `out[r] = x · row r` for the `out.len()` split rows of `ty`, `rb` bytes each, at `rows`:
/// decoded in registers, the same bits as decoding the rows ([`dequant_row`]) and taking
/// [`dot_tile`] of them with the one row `x`. Only where [`has_quant_x1`].
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
pub fn dot_quant_x1(ty: GgmlType, rows: &[u8], rb: usize, x: &[f32], out: &mut [f32]) {
    let n = out.len();
    assert!(
        has_quant_x1(ty) && rows.len() >= n * rb && x.len().is_multiple_of(32),
        "dot_quant_x1: {n} {ty} rows"
    );
    assert_eq!(ty.bytes_for(x.len()), Some(rb), "dot_quant_x1: row length");
    #[cfg(target_arch = "x86_64")]
    {
        let (p, xp, k, o) = (rows.as_ptr(), x.as_ptr(), x.len(), out.as_mut_ptr());
        // SAFETY: the CPU has AVX2, FMA and F16C (has_quant_x1); `rows` holds n rows of rb bytes
        // of k values, `out` n slots (asserted above).
        unsafe {
            match (has_avx512(), ty == GgmlType::Q8_0) {
                (true, true) => avx512::dot_quant_x1::<true>(p, rb, n, xp, k, o),
                (true, false) => avx512::dot_quant_x1::<false>(p, rb, n, xp, k, o),
                (false, true) => avx2::dot_quant_x1::<true>(p, rb, n, xp, k, o),
                (false, false) => avx2::dot_quant_x1::<false>(p, rb, n, xp, k, o),
            }
        }
    }
}

/// Decodes one quantized row (in the kernels' layout, see [`split_row`]) into `out`.
pub fn dequant_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        match ty {
            // SAFETY: the CPU supports the features; row lengths are validated at construction.
            GgmlType::Q4_1 => return unsafe { avx512::dequant_q4_1(row, out) },
            GgmlType::Q8_0 => return unsafe { avx512::dequant_q8_0(row, out) },
            _ => {}
        }
    } else if has_avx2_fma() {
        match ty {
            // SAFETY: as above.
            GgmlType::Q4_1 => return unsafe { avx2::dequant_q4_1(row, out) },
            GgmlType::Q8_0 => return unsafe { avx2::dequant_q8_0(row, out) },
            _ => {}
        }
    }
    if is_split(ty) {
        return dequant_split_portable(ty, row, out);
    }
    dequantize(ty, row, out).expect("row length validated when the weight was built");
}

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
mod avx2;

mod portable;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use tandem_model::{quantize_q4_1, quantize_q8_0};

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
            dot_keys_t(&[1.0], 1, keys, n, n, 1.0, &mut out, n);
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
                dot_keys_t(&q, nq, &kh, ld, n, 0.125, &mut a, n);
                dot_keys_t(&q, nq, &kw, ld, n, 0.125, &mut b, n);
                assert_eq!(a, b, "scores nq={nq} n={n}");
                let (vh, vw) = half_of(rnd(n * d, 5));
                let p = rnd(nq * n, 6);
                let g = nq.min(AXPY_GROUP_MAX);
                let mut acc_h = rnd(g * d, 7);
                let mut acc_w = acc_h.clone();
                axpy_rows_group(&p, n, &vh, &mut acc_h, g);
                axpy_rows_group(&p, n, &vw, &mut acc_w, g);
                assert_eq!(acc_h, acc_w, "values g={g} n={n}");
            }
        }
    }

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
    }

    fn split(ty: GgmlType, ggml: &[u8]) -> Vec<u8> {
        let mut out = vec![0u8; ggml.len()];
        split_row(ty, ggml, &mut out);
        out
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
                    dot_keys_t(&q, nq, &kt, ld, n, 0.25, &mut out, ldo);
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
                    axpy_rows_group(&p, stride, &rows, &mut acc, g);
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

    /// [`dot_tile`]'s order written out one term at a time: `lanes` fused multiply-add chains,
    /// lane `l` over `t ≡ l (mod lanes)` in order, sixteen lanes folded `l_i + l_{i+8}`, the
    /// tree `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`, then the last `k mod lanes` terms.
    fn ordered_dot(x: &[f32], w: &[f32], lanes: usize) -> f32 {
        let kv = x.len() / lanes * lanes;
        let mut l = vec![0f32; lanes];
        for t in 0..kv {
            l[t % lanes] = x[t].mul_add(w[t], l[t % lanes]);
        }
        if lanes == 16 {
            l = (0..8).map(|i| l[i] + l[i + 8]).collect();
        }
        let mut s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        for t in kv..x.len() {
            s = x[t].mul_add(w[t], s);
        }
        s
    }

    /// Every tile shape the dispatch serves gives each output the bits of the one order of this
    /// level (eight lanes at AVX2, sixteen at AVX-512): the tiles, their batched reductions and
    /// the one-row tiles cannot drift apart.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_tile_shape_gives_the_levels_one_order() {
        if !has_avx2_fma() {
            eprintln!("no AVX2 here: the portable level's order is its own multiply-add");
            return;
        }
        let lanes = if has_avx512() { 16 } else { 8 };
        let (tm, tr) = tile();
        let mut shapes: Vec<(usize, usize)> = (1..=tm)
            .flat_map(|m| (1..=tr).map(move |r| (m, r)))
            .collect();
        shapes.extend((1..=TILE_R1).map(|r| (1, r)));
        for k in [16, 37, 320, 577] {
            // Rows `ld` apart, longer than k, as in a tile of a wider matrix.
            let ld = k + 3;
            let x = rnd(tm * ld, k as u64);
            let w = rnd(TILE_R1 * ld, 7 * k as u64);
            for &(m, r) in &shapes {
                let ldo = r + 1;
                let mut out = vec![f32::NAN; m * ldo];
                // SAFETY: m rows of x and r rows of w, ld apart, k each; out holds m rows of ldo.
                unsafe {
                    dot_tile(
                        x.as_ptr(),
                        ld,
                        m,
                        w.as_ptr(),
                        ld,
                        r,
                        k,
                        out.as_mut_ptr(),
                        ldo,
                    )
                };
                for a in 0..m {
                    for j in 0..r {
                        let want =
                            ordered_dot(&x[a * ld..a * ld + k], &w[j * ld..j * ld + k], lanes);
                        let got = out[a * ldo + j];
                        assert_eq!(
                            got.to_bits(),
                            want.to_bits(),
                            "{lanes} lanes, tile {m}×{r}, k={k}, output ({a}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// Each SIMD level this CPU has, called directly (dispatch picks only the widest one).
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn every_simd_level_matches_the_portable_code() {
        let k = 320;
        let w = rnd(k, 5);
        let x = rnd(k, 6);
        let (g41, g80) = (quantize_q4_1(&w), quantize_q8_0(&w));
        let mut d41 = vec![0f32; k];
        dequantize(GgmlType::Q4_1, &g41, &mut d41).unwrap();
        let mut d80 = vec![0f32; k];
        dequantize(GgmlType::Q8_0, &g80, &mut d80).unwrap();
        let (q41, q80) = (split(GgmlType::Q4_1, &g41), split(GgmlType::Q8_0, &g80));
        let mut o = vec![0f32; k];
        dequant_split_portable(GgmlType::Q4_1, &q41, &mut o);
        assert_eq!(o, d41);
        dequant_split_portable(GgmlType::Q8_0, &q80, &mut o);
        assert_eq!(o, d80);
        let wantf = dot_scalar(&w, &x);
        // The portable product (a multiply and an add on x86) against the FMA kernel: close.
        let mut pt = [0f32; 1];
        // SAFETY: one row of k each.
        unsafe { portable::dot_tile::<1, 1>(x.as_ptr(), k, w.as_ptr(), k, k, pt.as_mut_ptr(), 1) };
        assert!(close(pt[0], wantf));
        let cpu = crate::isa::detected();
        if cpu < Isa::Avx2 {
            eprintln!("no AVX2 on this CPU: its kernels are not tested here");
        }
        if cpu < Isa::Avx512 {
            eprintln!("no AVX-512 on this CPU: its kernels are not tested here");
        }
        if cpu >= Isa::Avx2 {
            // SAFETY: guarded by the feature check.
            unsafe {
                assert!(close(avx2::dot(&w, &x), wantf));
                let mut t = [0f32; 1];
                avx2::dot_tile::<1, 1>(x.as_ptr(), k, w.as_ptr(), k, k, t.as_mut_ptr(), 1);
                assert!(close(t[0], wantf));
                let mut o = vec![0f32; k];
                // Decoding is exact at every level: the products' bits depend on it.
                avx2::dequant_q4_1(&q41, &mut o);
                assert_eq!(o, d41);
                avx2::dequant_q8_0(&q80, &mut o);
                assert_eq!(o, d80);
            }
        }
        if cpu >= Isa::Avx512 {
            // SAFETY: guarded by the feature check.
            unsafe {
                assert!(close(avx512::dot(&w, &x), wantf));
                let mut t = [0f32; 1];
                avx512::dot_tile::<1, 1>(x.as_ptr(), k, w.as_ptr(), k, k, t.as_mut_ptr(), 1);
                assert!(close(t[0], wantf));
                let mut o = vec![0f32; k];
                // Decoding is exact at every level: the products' bits depend on it.
                avx512::dequant_q4_1(&q41, &mut o);
                assert_eq!(o, d41);
                avx512::dequant_q8_0(&q80, &mut o);
                assert_eq!(o, d80);
            }
        }
    }
}

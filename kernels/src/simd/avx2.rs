//! AVX2 + FMA + F16C kernels: 8 f32 lanes, 16 vector registers.

use super::*;

/// See [`super::fma_burst`].
#[target_feature(enable = "avx2,fma")]
pub unsafe fn fma_burst(rounds: usize) -> f32 {
    // 12 chains cover the FMA latency of both pipes (4 cycles × 2); with the two constants they
    // fit the 16 registers (16 chains spilled, and the measured peak read about half).
    let mut acc = [_mm256_set1_ps(1.0); super::BURST_CHAINS_8];
    let (b, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
    for _ in 0..rounds {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, b, c);
        }
    }
    let sum = acc
        .iter()
        .fold(_mm256_setzero_ps(), |s, a| _mm256_add_ps(s, *a));
    hsum(sum)
}

/// How far ahead of the current block the weight stream is prefetched. Prefetching past the
/// end of a row is harmless (a hint, never a fault) and warms the next row of the same task.
const PREFETCH_AHEAD: usize = 4096;

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_load(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i + 8)),
            _mm256_loadu_ps(pb.add(i + 8)),
            acc1,
        );
        i += 16;
    }
    if i + 8 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        i += 8;
    }
    let mut s = hsum(_mm256_add_ps(acc0, acc1));
    while i < n {
        s += *pa.add(i) * *pb.add(i);
        i += 1;
    }
    s
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let av = _mm256_set1_ps(alpha);
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(
            py.add(i),
            _mm256_fmadd_ps(av, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i))),
        );
        i += 8;
    }
    while i < n {
        *py.add(i) += alpha * *px.add(i);
        i += 1;
    }
}

/// The 32 nibbles of a Q4_1/Q4_0 block as four vectors of 8 f32 (elements 0-7, 8-15, 16-23, 24-31).
/// Each 8-byte half is widened straight from memory and split into its low and high nibbles in
/// 32-bit lanes: two widening shuffles a block instead of six (the 16-byte load, split in bytes
/// and widened in quarters, was 30% slower on Zen 3: 3.7-4.7 against 2.6-3.3 ns a block).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn nibbles(qs: *const u8) -> [__m256; 4] {
    let low = _mm256_set1_epi32(0x0f);
    let v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs as *const __m128i));
    let v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8) as *const __m128i));
    [
        _mm256_cvtepi32_ps(_mm256_and_si256(v0, low)),
        _mm256_cvtepi32_ps(_mm256_and_si256(v1, low)),
        _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v0)),
        _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(v1)),
    ]
}

/// The 32 signed bytes of a Q8_0 block as four vectors of 8 f32, each widened from memory.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn bytes_i8(qs: *const u8) -> [__m256; 4] {
    let w = |at: usize| {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
            qs.add(at) as *const __m128i
        )))
    };
    [w(0), w(8), w(16), w(24)]
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_q4_1(row: &[u8], out: &mut [f32]) {
    let nb = row.len() / 20;
    debug_assert!(out.len() >= nb * 32);
    let (pd, pq, po) = (row.as_ptr(), row.as_ptr().add(4 * nb), out.as_mut_ptr());
    for b in 0..nb {
        let d = _mm256_set1_ps(f16_load(pd.add(2 * b)));
        let m = _mm256_set1_ps(f16_load(pd.add(2 * (nb + b))));
        // The decoded tile is the first touch of these weights: fetch ahead, as the dots do.
        _mm_prefetch::<_MM_HINT_T0>(pq.wrapping_add(b * 16 + PREFETCH_AHEAD) as *const i8);
        let q = nibbles(pq.add(b * 16));
        let o = po.add(b * 32);
        for (j, qj) in q.iter().enumerate() {
            _mm256_storeu_ps(o.add(8 * j), _mm256_fmadd_ps(*qj, d, m));
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_q8_0(row: &[u8], out: &mut [f32]) {
    let nb = row.len() / 34;
    debug_assert!(out.len() >= nb * 32);
    let (pd, pq, po) = (row.as_ptr(), row.as_ptr().add(2 * nb), out.as_mut_ptr());
    for b in 0..nb {
        let d = _mm256_set1_ps(f16_load(pd.add(2 * b)));
        _mm_prefetch::<_MM_HINT_T0>(pq.wrapping_add(b * 32 + PREFETCH_AHEAD) as *const i8);
        let q = bytes_i8(pq.add(b * 32));
        let o = po.add(b * 32);
        for (j, qj) in q.iter().enumerate() {
            _mm256_storeu_ps(o.add(8 * j), _mm256_mul_ps(*qj, d));
        }
    }
}

/// `exp` of 8 lanes, computed as the AVX-512 `exp16` does (`x = n·ln2 + r`, Cephes' degree-7
/// polynomial for `e^r`, within 2 ulp), with `2^n` applied as two powers of two that are both
/// normal numbers: a result in the subnormal range is rounded once, as `vscalefps` rounds it, and
/// a large `x` gives +∞.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8(x: __m256) -> __m256 {
    // n stays within [-150, 145], so both halves of it are normal exponents.
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-104.0)),
        _mm256_set1_ps(100.0),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        5e-1,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let e = _mm256_fmadd_ps(
        _mm256_mul_ps(p, r),
        r,
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    );
    let ni = _mm256_cvtps_epi32(n);
    let h = _mm256_srai_epi32::<1>(ni);
    let pow2 = |k: __m256i| {
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            k,
            _mm256_set1_epi32(127),
        )))
    };
    _mm256_mul_ps(_mm256_mul_ps(e, pow2(h)), pow2(_mm256_sub_epi32(ni, h)))
}

/// Lanes `0..count` set (as `maskload` reads a mask: the sign bit of each 32-bit lane).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn lanes(count: usize) -> __m256i {
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(count.min(8) as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

#[target_feature(enable = "avx2")]
pub unsafe fn max_f32(x: &[f32]) -> f32 {
    let n8 = x.len() / 8 * 8;
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in (0..n8).step_by(8) {
        // vmaxps returns its second operand when the first is NaN, so NaNs are skipped.
        m = _mm256_max_ps(_mm256_loadu_ps(x.as_ptr().add(i)), m);
    }
    let mut buf = [0f32; 8];
    _mm256_storeu_ps(buf.as_mut_ptr(), m);
    buf.iter()
        .chain(&x[n8..])
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let one = _mm256_set1_ps(1.0);
    let silu = |v: __m256, u: __m256| {
        let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), u)
    };
    let n8 = gate.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        let g = gate.as_mut_ptr().add(i);
        let r = silu(_mm256_loadu_ps(g), _mm256_loadu_ps(up.as_ptr().add(i)));
        _mm256_storeu_ps(g, r);
    }
    let rest = gate.len() - n8;
    if rest > 0 {
        let k = lanes(rest);
        let g = gate.as_mut_ptr().add(n8);
        let r = silu(
            _mm256_maskload_ps(g, k),
            _mm256_maskload_ps(up.as_ptr().add(n8), k),
        );
        _mm256_maskstore_ps(g, k, r);
    }
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_shifted_sum(x: &mut [f32], max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
        acc = _mm256_add_ps(acc, e);
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let k = lanes(rest.len());
        let v = _mm256_maskload_ps(rest.as_ptr(), k);
        let e = _mm256_and_ps(exp8(_mm256_sub_ps(v, m)), _mm256_castsi256_ps(k));
        _mm256_maskstore_ps(rest.as_mut_ptr(), k, e);
        acc = _mm256_add_ps(acc, e);
    }
    hsum(acc)
}

/// The eight lanes of `v` summed as `((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7))`: the reduction
/// of [`dot_tile`]'s order (the portable level writes the same tree).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn hsum_pairs(v: __m256) -> f32 {
    let h = _mm256_hadd_ps(v, v); // l0+l1, l2+l3, .., l4+l5, l6+l7, ..
    let h = _mm256_hadd_ps(h, h); // (l0+l1)+(l2+l3) | (l4+l5)+(l6+l7)
    _mm_cvtss_f32(_mm_add_ss(
        _mm256_castps256_ps128(h),
        _mm256_extractf128_ps(h, 1),
    ))
}

/// One activation row `x` against `n` split Q4_1 (`Q8 = false`) or Q8_0 rows of `rb` bytes at
/// `rows`, `rb` apart, [`X1_GROUP`] rows at a time ([`x1_group`]); `out` gets the `n` dots.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_quant_x1<const Q8: bool>(
    rows: *const u8,
    rb: usize,
    n: usize,
    x: *const f32,
    k: usize,
    out: *mut f32,
) {
    let mut r = 0;
    while r + X1_GROUP <= n {
        x1_group::<Q8, X1_GROUP>(rows.add(r * rb), rb, x, k, out.add(r));
        r += X1_GROUP;
    }
    match n - r {
        1 => x1_group::<Q8, 1>(rows.add(r * rb), rb, x, k, out.add(r)),
        2 => x1_group::<Q8, 2>(rows.add(r * rb), rb, x, k, out.add(r)),
        3 => x1_group::<Q8, 3>(rows.add(r * rb), rb, x, k, out.add(r)),
        _ => {}
    }
}

/// Weight rows [`dot_quant_x1`] takes at a time: four independent chains, with the decode's
/// multiply-adds between them, cover the FMA latency.
const X1_GROUP: usize = 4;

/// One activation row `x` against `R` split rows of `rb` bytes at `rows`, `rb` apart: each block
/// decoded in registers to exactly what [`dequant_q4_1`] / [`dequant_q8_0`] write, and dotted in
/// [`dot_tile`]'s order (one 8-lane chain per row, `t` in order, [`hsum_pairs`]): the bits of
/// decoding the rows and calling `dot_tile::<1, R>`, without the decoded rows' round trip through
/// memory. Each block's f16 scale (and min) is broadcast and widened where it is used: converting
/// a run of them into a buffer first cost 10-15% more on Zen 3 (the buffer's reads wait on its
/// fresh writes, and the run's scales arrive from memory before any of its quants).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x1_group<const Q8: bool, const R: usize>(
    rows: *const u8,
    rb: usize,
    x: *const f32,
    k: usize,
    out: *mut f32,
) {
    let nb = k / 32;
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..nb {
        let xb = x.add(b * 32);
        for (r, a) in acc.iter_mut().enumerate() {
            let row = rows.add(r * rb);
            let d = f16_splat(row.add(2 * b));
            let wv = if Q8 {
                let qs = row.add(2 * nb + b * 32);
                // One request a 64-byte line: two blocks.
                if b % 2 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(qs.wrapping_add(PREFETCH_AHEAD) as *const i8);
                }
                let q = bytes_i8(qs);
                [
                    _mm256_mul_ps(q[0], d),
                    _mm256_mul_ps(q[1], d),
                    _mm256_mul_ps(q[2], d),
                    _mm256_mul_ps(q[3], d),
                ]
            } else {
                let qs = row.add(4 * nb + b * 16);
                // One request a 64-byte line: four blocks.
                if b % 4 == 0 {
                    _mm_prefetch::<_MM_HINT_T0>(qs.wrapping_add(PREFETCH_AHEAD) as *const i8);
                }
                let m = f16_splat(row.add(2 * (nb + b)));
                let q = nibbles(qs);
                [
                    _mm256_fmadd_ps(q[0], d, m),
                    _mm256_fmadd_ps(q[1], d, m),
                    _mm256_fmadd_ps(q[2], d, m),
                    _mm256_fmadd_ps(q[3], d, m),
                ]
            };
            // The activations are read again for each row (from L1, as the multiply-adds'
            // memory operands): held in registers, they left too few for four rows' decoding.
            for (j, wj) in wv.iter().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(xb.add(8 * j)), *wj, *a);
            }
        }
    }
    for (r, a) in acc.iter().enumerate() {
        *out.add(r) = hsum_pairs(*a);
    }
}

/// The f16 at `p` widened into all eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_splat(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16((p as *const i16).read_unaligned()))
}

/// See [`super::dot_tile`]: `M` activation rows against `R` weight rows, one 8-lane accumulator
/// each; the weight vectors are loaded once a step for every activation row.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_tile<const M: usize, const R: usize>(
    x: *const f32,
    ldx: usize,
    w: *const f32,
    ldw: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
) {
    dot_tile_span::<M, R>(x, ldx, w, ldw, 0, k, k, std::ptr::null_mut(), out, ldo)
}

/// Most accumulators of a [`dot_tile`] (4 × 3, or 1 × 6).
const MAX_TILE: usize = 12;

/// Eight vectors' [`hsum_pairs`] at once, in lane order, with the same additions: horizontal
/// adds of neighbouring pairs (`l0+l1`, `l2+l3`, then `(l0+l1)+(l2+l3)` in each half), then
/// the halves' sums added.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum8x8(v: &[__m256; 8]) -> __m256 {
    let q0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    let q1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(q0, q1),
        _mm256_permute2f128_ps::<0x31>(q0, q1),
    )
}

/// [`dot_tile`] over the columns `t0..t1` only (see the AVX-512 level's `dot_tile_span`): the
/// lanes start from zero at `t0 = 0` and from the `M × R` vectors at `state` (16 floats apart,
/// row-major) otherwise, and are stored back there unreduced unless `t1` reaches `k`. `t0` is a
/// multiple of 8.
///
/// # Safety
/// As [`dot_tile`]; `state` holds `M × R` vectors 16 floats apart unless the span is `0..k`.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_tile_span<const M: usize, const R: usize>(
    x: *const f32,
    ldx: usize,
    w: *const f32,
    ldw: usize,
    t0: usize,
    t1: usize,
    k: usize,
    state: *mut f32,
    out: *mut f32,
    ldo: usize,
) {
    const { assert!(M * R <= MAX_TILE) };
    let mut acc = [[_mm256_setzero_ps(); R]; M];
    if t0 > 0 {
        for (a, acc) in acc.iter_mut().enumerate() {
            for (r, c) in acc.iter_mut().enumerate() {
                *c = _mm256_loadu_ps(state.add((a * R + r) * 16));
            }
        }
    }
    let k8 = k / 8 * 8;
    let mut t = t0;
    while t < t1.min(k8) {
        let mut wv = [_mm256_setzero_ps(); R];
        for (r, v) in wv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(w.add(r * ldw + t));
        }
        for (a, acc) in acc.iter_mut().enumerate() {
            let xv = _mm256_loadu_ps(x.add(a * ldx + t));
            for (c, v) in acc.iter_mut().zip(&wv) {
                *c = _mm256_fmadd_ps(xv, *v, *c);
            }
        }
        t += 8;
    }
    if t1 < k {
        for (a, acc) in acc.iter().enumerate() {
            for (r, c) in acc.iter().enumerate() {
                _mm256_storeu_ps(state.add((a * R + r) * 16), *c);
            }
        }
        return;
    }
    // The tile's sums, eight at a time where it has eight (the same tree as one at a time),
    // from the accumulators stored in order.
    let mut flat = std::mem::MaybeUninit::<[__m256; MAX_TILE]>::uninit();
    let fp = flat.as_mut_ptr() as *mut __m256;
    for (a, acc) in acc.iter().enumerate() {
        for (r, c) in acc.iter().enumerate() {
            fp.add(a * R + r).write(*c);
        }
    }
    let mut sums = [[0f32; R]; M];
    let sp = sums.as_mut_ptr() as *mut f32;
    let mut i = 0;
    while i + 8 <= M * R {
        _mm256_storeu_ps(sp.add(i), hsum8x8(&*(fp.add(i) as *const [__m256; 8])));
        i += 8;
    }
    while i < M * R {
        *sp.add(i) = hsum_pairs(*fp.add(i));
        i += 1;
    }
    write_sums(&sums, x, ldx, w, ldw, k8, k, out, ldo);
}

/// A tile's reduced lane sums finished and written: the columns `from..k` past the last whole
/// vector added one at a time (fused), then output `(a, r)` stored at `out[a·ldo + r]`. The
/// last step of this level's and the AVX-512 level's `dot_tile`.
///
/// # Safety
/// As [`dot_tile`], with `from ≤ k`.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn write_sums<const M: usize, const R: usize>(
    sums: &[[f32; R]; M],
    x: *const f32,
    ldx: usize,
    w: *const f32,
    ldw: usize,
    from: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
) {
    for (a, sums) in sums.iter().enumerate() {
        for (r, &s) in sums.iter().enumerate() {
            let mut s = s;
            for t in from..k {
                s = (*x.add(a * ldx + t)).mul_add(*w.add(r * ldw + t), s);
            }
            *out.add(a * ldo + r) = s;
        }
    }
}

/// 8 cache values at `p` as f32: a plain load, or 8 halves and one conversion.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_kv<T: KvValue>(p: *const T) -> __m256 {
    if T::HALF {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    } else {
        _mm256_loadu_ps(p as *const f32)
    }
}

/// The first `count` (< 8) cache values at `p` as f32; other lanes zero and not read.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_kv_part<T: KvValue>(p: *const T, count: usize) -> __m256 {
    if T::HALF {
        // No masked 16-bit load below AVX-512: the few halves go through a buffer.
        let mut buf = [0u16; 8];
        std::ptr::copy_nonoverlapping(p as *const u16, buf.as_mut_ptr(), count);
        _mm256_cvtph_ps(_mm_loadu_si128(buf.as_ptr() as *const __m128i))
    } else {
        _mm256_maskload_ps(p as *const f32, lanes(count))
    }
}

/// `N` query vectors (rows of `d` at `q`) against `cols ≤ 16` keys stored transposed (row `i`
/// of `kt` at `kt + i·ld`), two vectors of 8 keys per dimension; `FULL` when `cols` is 16.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_keys_t<T: KvValue, const N: usize, const FULL: bool>(
    q: *const f32,
    d: usize,
    kt: *const T,
    ld: usize,
    cols: usize,
    scale: f32,
    out: *mut f32,
    ldo: usize,
) {
    let (c0, c1) = (cols.min(8), cols.saturating_sub(8));
    let mut a0 = [_mm256_setzero_ps(); N];
    let mut a1 = [_mm256_setzero_ps(); N];
    for i in 0..d {
        let row = kt.add(i * ld);
        let (k0, k1) = if FULL {
            (load_kv(row), load_kv(row.add(8)))
        } else {
            (load_kv_part(row, c0), load_kv_part(row.add(8), c1))
        };
        for v in 0..N {
            let qb = _mm256_set1_ps(*q.add(v * d + i));
            a0[v] = _mm256_fmadd_ps(qb, k0, a0[v]);
            a1[v] = _mm256_fmadd_ps(qb, k1, a1[v]);
        }
    }
    let s = _mm256_set1_ps(scale);
    let mut buf = [0f32; 16];
    for v in 0..N {
        let (r0, r1) = (_mm256_mul_ps(a0[v], s), _mm256_mul_ps(a1[v], s));
        let o = out.add(v * ldo);
        if FULL {
            _mm256_storeu_ps(o, r0);
            _mm256_storeu_ps(o.add(8), r1);
        } else {
            _mm256_storeu_ps(buf.as_mut_ptr(), r0);
            _mm256_storeu_ps(buf.as_mut_ptr().add(8), r1);
            std::ptr::copy_nonoverlapping(buf.as_ptr(), o, cols);
        }
    }
}

/// `G` heads (at most 6); `d` is a multiple of 16. Each 16-wide slice of a value row is loaded
/// once for all heads; the `2·G` accumulators stay in registers across the rows. Every output is
/// one FMA chain in row order, as in the AVX-512 kernel.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn axpy_rows_g<T: KvValue, const G: usize>(
    p: &[f32],
    stride: usize,
    rows: &[T],
    acc: &mut [f32],
) {
    let d = acc.len() / G;
    let n = rows.len() / d;
    let (pp, pr, pa) = (p.as_ptr(), rows.as_ptr(), acc.as_mut_ptr());
    for c in (0..d).step_by(16) {
        let mut a = [[_mm256_setzero_ps(); 2]; G];
        for (h, ah) in a.iter_mut().enumerate() {
            ah[0] = _mm256_loadu_ps(pa.add(h * d + c));
            ah[1] = _mm256_loadu_ps(pa.add(h * d + c + 8));
        }
        for t in 0..n {
            let r = pr.add(t * d + c);
            let (v0, v1) = (load_kv(r), load_kv(r.add(8)));
            for (h, ah) in a.iter_mut().enumerate() {
                let w = _mm256_set1_ps(*pp.add(h * stride + t));
                ah[0] = _mm256_fmadd_ps(w, v0, ah[0]);
                ah[1] = _mm256_fmadd_ps(w, v1, ah[1]);
            }
        }
        for (h, ah) in a.iter().enumerate() {
            _mm256_storeu_ps(pa.add(h * d + c), ah[0]);
            _mm256_storeu_ps(pa.add(h * d + c + 8), ah[1]);
        }
    }
}

/// `out = x / sqrt(mean(x²) + eps) · w` for one row, the product order of the portable code
/// (`w · (x · inv)`, no FMA) so every level gives the same bits.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn scale_row(x: &[f32], w: &[f32], inv: f32, out: &mut [f32]) {
    let n = x.len();
    let iv = _mm256_set1_ps(inv);
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), iv);
        _mm256_storeu_ps(
            out.as_mut_ptr().add(i),
            _mm256_mul_ps(_mm256_loadu_ps(w.as_ptr().add(i)), v),
        );
        i += 8;
    }
    while i < n {
        out[i] = w[i] * (x[i] * inv);
        i += 1;
    }
}

/// One head's rotation: `a' = a·c − b·s`, `b' = b·c + a·s` (products rounded before the sum,
/// as the portable code does, so every level gives the same bits).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn rotate(a: &mut [f32], b: &mut [f32], c: &[f32], s: &[f32]) {
    let n = a.len();
    let mut i = 0;
    while i + 8 <= n {
        let (pa, pb) = (a.as_mut_ptr().add(i), b.as_mut_ptr().add(i));
        let (x0, x1) = (_mm256_loadu_ps(pa), _mm256_loadu_ps(pb));
        let (cv, sv) = (
            _mm256_loadu_ps(c.as_ptr().add(i)),
            _mm256_loadu_ps(s.as_ptr().add(i)),
        );
        _mm256_storeu_ps(
            pa,
            _mm256_sub_ps(_mm256_mul_ps(x0, cv), _mm256_mul_ps(x1, sv)),
        );
        _mm256_storeu_ps(
            pb,
            _mm256_add_ps(_mm256_mul_ps(x1, cv), _mm256_mul_ps(x0, sv)),
        );
        i += 8;
    }
    while i < n {
        let (x0, x1) = (a[i], b[i]);
        a[i] = x0 * c[i] - x1 * s[i];
        b[i] = x1 * c[i] + x0 * s[i];
        i += 1;
    }
}

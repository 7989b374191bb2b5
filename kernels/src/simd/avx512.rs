//! AVX-512 kernels (F, BW, VL; F16C and FMA): 16 f32 lanes.

use super::*;

/// See [`super::fma_burst`].
#[target_feature(enable = "avx512f")]
pub unsafe fn fma_burst(rounds: usize) -> f32 {
    let mut acc = [_mm512_set1_ps(1.0); 16];
    let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
    for _ in 0..rounds {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, b, c);
        }
    }
    let sum = acc
        .iter()
        .fold(_mm512_setzero_ps(), |s, a| _mm512_add_ps(s, *a));
    _mm512_reduce_add_ps(sum)
}

/// Prefetch distance for the weight stream. Measured on the 2-core VM (batch-1 decode, same
/// background load): 1 KiB 35 tok/s, 4 KiB 44 tok/s, 8 KiB 30-35 tok/s; no prefetch 16 tok/s.
const PREFETCH_AHEAD: usize = 4096;

#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm512_fmadd_ps(
            _mm512_loadu_ps(pa.add(i + 16)),
            _mm512_loadu_ps(pb.add(i + 16)),
            acc1,
        );
        i += 32;
    }
    if i + 16 <= n {
        acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
        i += 16;
    }
    let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    while i < n {
        s += *pa.add(i) * *pb.add(i);
        i += 1;
    }
    s
}

/// `exp` of 16 lanes: `x = n·ln2 + r` with |r| ≤ ln2/2, a degree-7 polynomial for `e^r`
/// (Cephes' `expf` coefficients, within 2 ulp of the correctly rounded result), and `2^n`
/// applied with `vscalefps`, which also takes care of underflow to zero.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn exp16(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(-104.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        5e-1,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let e = _mm512_fmadd_ps(
        _mm512_mul_ps(p, r),
        r,
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    _mm512_scalef_ps(e, n)
}

#[target_feature(enable = "avx512f")]
pub unsafe fn max_f32(x: &[f32]) -> f32 {
    let n16 = x.len() / 16 * 16;
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    for i in (0..n16).step_by(16) {
        // vmaxps returns its second operand when the first is NaN, so NaNs are skipped.
        m = _mm512_max_ps(_mm512_loadu_ps(x.as_ptr().add(i)), m);
    }
    let tail = x[n16..].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    _mm512_reduce_max_ps(m).max(tail)
}

#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let one = _mm512_set1_ps(1.0);
    let silu = |v: __m512, u: __m512| {
        let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), u)
    };
    let n16 = gate.len() / 16 * 16;
    for i in (0..n16).step_by(16) {
        let g = gate.as_mut_ptr().add(i);
        let r = silu(_mm512_loadu_ps(g), _mm512_loadu_ps(up.as_ptr().add(i)));
        _mm512_storeu_ps(g, r);
    }
    let rest = gate.len() - n16;
    if rest > 0 {
        let k: __mmask16 = ((1u32 << rest) - 1) as u16;
        let g = gate.as_mut_ptr().add(n16);
        let r = silu(
            _mm512_maskz_loadu_ps(k, g),
            _mm512_maskz_loadu_ps(k, up.as_ptr().add(n16)),
        );
        _mm512_mask_storeu_ps(g, k, r);
    }
}

#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn exp_shifted_sum(x: &mut [f32], max: f32) -> f32 {
    let m = _mm512_set1_ps(max);
    let mut acc = _mm512_setzero_ps();
    let mut chunks = x.chunks_exact_mut(16);
    for c in &mut chunks {
        let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), m));
        _mm512_storeu_ps(c.as_mut_ptr(), e);
        acc = _mm512_add_ps(acc, e);
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let k: __mmask16 = (1u32 << rest.len()) as u16 - 1;
        let v = _mm512_maskz_loadu_ps(k, rest.as_ptr());
        let e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(v, m)));
        _mm512_mask_storeu_ps(rest.as_mut_ptr(), k, e);
        acc = _mm512_add_ps(acc, e);
    }
    _mm512_reduce_add_ps(acc)
}

/// `N` query vectors (rows of `d` at `q`) against `cols ≤ 16` keys stored transposed (row `i`
/// of `kt` at `kt + i·ld`): two sets of `N` accumulators (even and odd dimensions) so that
/// even a few queries keep both FMA units busy.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_keys_t<T: KvValue, const N: usize>(
    q: *const f32,
    d: usize,
    kt: *const T,
    ld: usize,
    cols: usize,
    scale: f32,
    out: *mut f32,
    ldo: usize,
) {
    let mask: __mmask16 = if cols >= 16 {
        0xFFFF
    } else {
        (1u16 << cols) - 1
    };
    let mut even = [_mm512_setzero_ps(); N];
    let mut odd = [_mm512_setzero_ps(); N];
    let mut i = 0;
    while i + 2 <= d {
        let k0 = load_kv(mask, kt.add(i * ld));
        let k1 = load_kv(mask, kt.add((i + 1) * ld));
        for v in 0..N {
            let qv = q.add(v * d + i);
            even[v] = _mm512_fmadd_ps(_mm512_set1_ps(*qv), k0, even[v]);
            odd[v] = _mm512_fmadd_ps(_mm512_set1_ps(*qv.add(1)), k1, odd[v]);
        }
        i += 2;
    }
    if i < d {
        let k0 = load_kv(mask, kt.add(i * ld));
        for (v, e) in even.iter_mut().enumerate() {
            *e = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(v * d + i)), k0, *e);
        }
    }
    let s = _mm512_set1_ps(scale);
    for v in 0..N {
        let sum = _mm512_mul_ps(_mm512_add_ps(even[v], odd[v]), s);
        _mm512_mask_storeu_ps(out.add(v * ldo), mask, sum);
    }
}

/// `G` heads; `d` is a multiple of 64. Each 64-wide slice of a row is loaded once for all heads
/// and the `4·G` accumulators stay in registers across the rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn axpy_rows_g<T: KvValue, const G: usize>(
    p: &[f32],
    stride: usize,
    rows: &[T],
    acc: &mut [f32],
) {
    let d = acc.len() / G;
    let n = rows.len() / d;
    let (pp, pr, pa) = (p.as_ptr(), rows.as_ptr(), acc.as_mut_ptr());
    for c in (0..d).step_by(64) {
        let mut a = [[_mm512_setzero_ps(); 4]; G];
        for (h, ah) in a.iter_mut().enumerate() {
            for (j, v) in ah.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(pa.add(h * d + c + 16 * j));
            }
        }
        for t in 0..n {
            let r = pr.add(t * d + c);
            let v = [
                load_kv(!0, r),
                load_kv(!0, r.add(16)),
                load_kv(!0, r.add(32)),
                load_kv(!0, r.add(48)),
            ];
            for (h, ah) in a.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*pp.add(h * stride + t));
                for j in 0..4 {
                    ah[j] = _mm512_fmadd_ps(w, v[j], ah[j]);
                }
            }
        }
        for (h, ah) in a.iter().enumerate() {
            for (j, v) in ah.iter().enumerate() {
                _mm512_storeu_ps(pa.add(h * d + c + 16 * j), *v);
            }
        }
    }
}

/// The 16 cache values at `p` whose lanes `mask` selects, as f32 (other lanes zero and not
/// read): a plain load for f32, a load of halves and one conversion for f16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load_kv<T: KvValue>(mask: __mmask16, p: *const T) -> __m512 {
    if T::HALF {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16))
    } else {
        _mm512_maskz_loadu_ps(mask, p as *const f32)
    }
}

/// Up to 16 f16 values at `p` as f32 lanes (missing lanes zero).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn f16x16(p: *const u8, count: usize) -> __m512 {
    // A masked load: lanes past `count` are neither read nor kept (a copy through a stack
    // buffer would stall the conversion on a failed store forward).
    let mask = ((1u32 << count) - 1) as __mmask16;
    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn dequant_q4_1(row: &[u8], out: &mut [f32]) {
    let nb = row.len() / 20;
    debug_assert!(out.len() >= nb * 32);
    let (pd, pq, po) = (row.as_ptr(), row.as_ptr().add(4 * nb), out.as_mut_ptr());
    let low = _mm512_set1_epi32(0x0f);
    let (mut dbuf, mut mbuf) = ([0f32; 16], [0f32; 16]);
    let mut b0 = 0;
    while b0 < nb {
        let cnt = (nb - b0).min(16);
        _mm512_storeu_ps(dbuf.as_mut_ptr(), f16x16(pd.add(2 * b0), cnt));
        _mm512_storeu_ps(mbuf.as_mut_ptr(), f16x16(pd.add(2 * (nb + b0)), cnt));
        for i in 0..cnt {
            let b = b0 + i;
            // The decoded tile is the first touch of these weights: fetch ahead, as the dots do.
            _mm_prefetch::<_MM_HINT_T0>(pq.add(b * 16 + PREFETCH_AHEAD) as *const i8);
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(pq.add(b * 16) as *const __m128i));
            let (d, m) = (_mm512_set1_ps(dbuf[i]), _mm512_set1_ps(mbuf[i]));
            let o = po.add(b * 32);
            let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
            let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
            _mm512_storeu_ps(o, _mm512_fmadd_ps(lo, d, m));
            _mm512_storeu_ps(o.add(16), _mm512_fmadd_ps(hi, d, m));
        }
        b0 += cnt;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn dequant_q8_0(row: &[u8], out: &mut [f32]) {
    let nb = row.len() / 34;
    debug_assert!(out.len() >= nb * 32);
    let (pd, pq, po) = (row.as_ptr(), row.as_ptr().add(2 * nb), out.as_mut_ptr());
    let mut dbuf = [0f32; 16];
    let mut b0 = 0;
    while b0 < nb {
        let cnt = (nb - b0).min(16);
        _mm512_storeu_ps(dbuf.as_mut_ptr(), f16x16(pd.add(2 * b0), cnt));
        for (i, &d) in dbuf[..cnt].iter().enumerate() {
            let b = b0 + i;
            let qs = pq.add(b * 32);
            _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
            let d = _mm512_set1_ps(d);
            let o = po.add(b * 32);
            for h in 0..2 {
                let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(qs.add(16 * h) as *const __m128i));
                _mm512_storeu_ps(o.add(16 * h), _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
            }
        }
        b0 += cnt;
    }
}

/// The sixteen lanes of `v` summed as `l_i + l_{i+8}` for each `i < 8`, then those eight as
/// [`dot_tile`]'s AVX2 tree `((s0+s1)+(s2+s3)) + ((s4+s5)+(s6+s7))`: the reduction of this
/// level's product order.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma")]
unsafe fn hsum16(v: __m512) -> f32 {
    super::avx2::hsum_pairs(_mm256_add_ps(
        _mm512_castps512_ps256(v),
        _mm512_extractf32x8_ps::<1>(v),
    ))
}

/// Most accumulators of a [`dot_tile`] (6 × 4, or 1 × 6).
const MAX_TILE: usize = 24;

/// Eight vectors' [`hsum16`]s at once, in lane order, with the same additions: each vector's
/// halves `l_i + l_{i+8}` (two vectors' to a register), then neighbouring pairs `l0+l1`,
/// `l2+l3` and `(l0+l1)+(l2+l3)` within each 128-bit quarter, then the two quarters' sums added.
/// 24 instructions instead of about a hundred. Only 512-bit forms (`vhaddps` has none): those
/// can use all 32 registers, where a 6 × 4 tile's accumulators live.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
unsafe fn hsum16x8(v: &[__m512; 8]) -> __m256 {
    // Vector i's halves' sums in quarters of [i | i + 4].
    let half = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x44>(a, b),
            _mm512_shuffle_f32x4::<0xee>(a, b),
        )
    };
    // Per quarter: [a0+a1, a2+a3, b0+b1, b2+b3].
    let pairs = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(a, b),
            _mm512_shuffle_ps::<0xdd>(a, b),
        )
    };
    let h = [
        half(v[0], v[4]),
        half(v[1], v[5]),
        half(v[2], v[6]),
        half(v[3], v[7]),
    ];
    // Quarters: [0..3 lanes 0-3 sums], [0..3 lanes 4-7], [4..7 lanes 0-3], [4..7 lanes 4-7].
    let z = pairs(pairs(h[0], h[1]), pairs(h[2], h[3]));
    let z = _mm512_shuffle_f32x4::<0xd8>(z, z); // quarters 0, 2, 1, 3
    _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps::<1>(z))
}

/// See [`super::dot_tile`]: this level's order is sixteen lanes, lane `l` one FMA chain over
/// `t ≡ l (mod 16)` in increasing `t`, reduced by [`hsum16`], then the `k mod 16` last terms one
/// at a time. `M` activation rows against `R` weight rows, one 16-lane accumulator each.
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
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

/// [`dot_tile`] over the columns `t0..t1` only: the lanes start from zero at `t0 = 0` and from
/// the `M × R` vectors at `state` (row-major) otherwise, and are stored back there unreduced
/// unless `t1` reaches `k`, when the sums are finished and written as [`dot_tile`] writes them.
/// Every lane's chain still takes its columns in order, so a product taken in spans has the
/// bits of one taken whole. `t0` is a multiple of 16.
///
/// # Safety
/// As [`dot_tile`]; `state` holds `M × R` vectors unless the span is the whole of `0..k`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
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
    let mut acc = [[_mm512_setzero_ps(); R]; M];
    if t0 > 0 {
        for (a, acc) in acc.iter_mut().enumerate() {
            for (r, c) in acc.iter_mut().enumerate() {
                *c = _mm512_loadu_ps(state.add((a * R + r) * 16));
            }
        }
    }
    let k16 = k / 16 * 16;
    let mut t = t0;
    while t < t1.min(k16) {
        let mut wv = [_mm512_setzero_ps(); R];
        for (r, v) in wv.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(w.add(r * ldw + t));
        }
        for (a, acc) in acc.iter_mut().enumerate() {
            let xv = _mm512_loadu_ps(x.add(a * ldx + t));
            for (c, v) in acc.iter_mut().zip(&wv) {
                *c = _mm512_fmadd_ps(xv, *v, *c);
            }
        }
        t += 16;
    }
    if t1 < k {
        for (a, acc) in acc.iter().enumerate() {
            for (r, c) in acc.iter().enumerate() {
                _mm512_storeu_ps(state.add((a * R + r) * 16), *c);
            }
        }
        return;
    }
    // The tile's sums, eight at a time where it has eight (the same tree as one at a time),
    // from the accumulators stored in order (indexing them at run time would keep them in
    // memory through the loop above).
    let mut flat = std::mem::MaybeUninit::<[__m512; MAX_TILE]>::uninit();
    let fp = flat.as_mut_ptr() as *mut __m512;
    for (a, acc) in acc.iter().enumerate() {
        for (r, c) in acc.iter().enumerate() {
            fp.add(a * R + r).write(*c);
        }
    }
    let mut sums = [[0f32; R]; M];
    let sp = sums.as_mut_ptr() as *mut f32;
    let mut i = 0;
    while i + 8 <= M * R {
        _mm256_storeu_ps(sp.add(i), hsum16x8(&*(fp.add(i) as *const [__m512; 8])));
        i += 8;
    }
    while i < M * R {
        *sp.add(i) = hsum16(*fp.add(i));
        i += 1;
    }
    super::avx2::write_sums(&sums, x, ldx, w, ldw, k16, k, out, ldo);
}

/// Weight rows [`dot_quant_x1`] takes at a time (as at AVX2: four chains cover the FMA latency).
const X1_GROUP: usize = 4;

/// One activation row `x` against `n` split Q4_1 (`Q8 = false`) or Q8_0 rows of `rb` bytes at
/// `rows`, `rb` apart; `out` gets the `n` dots, the bits of decoding the rows and taking this
/// level's [`dot_tile`] of them (see the AVX2 level's `dot_quant_x1`).
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
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

/// `R` rows of [`dot_quant_x1`]: each 32-value block decoded in registers into two 16-lane
/// vectors (elements 0-15 and 16-31), exactly what this level's dequantization writes, and
/// multiplied into one accumulator a row, elements 0-15 first: lane `l` takes `t ≡ l (mod 16)`
/// in increasing `t`, [`dot_tile`]'s order.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
unsafe fn x1_group<const Q8: bool, const R: usize>(
    rows: *const u8,
    rb: usize,
    x: *const f32,
    k: usize,
    out: *mut f32,
) {
    let nb = k / 32;
    let mut acc = [_mm512_setzero_ps(); R];
    let low = _mm512_set1_epi32(0x0f);
    // Each row's scales (and Q4_1's minimums), sixteen blocks' at a time, widened to f32 in one
    // conversion and broadcast from memory per block: the same values as widening each alone,
    // in fewer instructions (one row through the model's products on Zen 5: 3.3 -> 2.9 ms).
    let (mut dbuf, mut mbuf) = ([[0f32; 16]; R], [[0f32; 16]; R]);
    let mut b0 = 0;
    while b0 < nb {
        let cnt = (nb - b0).min(16);
        for r in 0..R {
            let row = rows.add(r * rb);
            _mm512_storeu_ps(dbuf[r].as_mut_ptr(), f16x16(row.add(2 * b0), cnt));
            if !Q8 {
                _mm512_storeu_ps(mbuf[r].as_mut_ptr(), f16x16(row.add(2 * (nb + b0)), cnt));
            }
        }
        for i in 0..cnt {
            let b = b0 + i;
            let xb = x.add(b * 32);
            let (x0, x1) = (_mm512_loadu_ps(xb), _mm512_loadu_ps(xb.add(16)));
            for (r, a) in acc.iter_mut().enumerate() {
                let row = rows.add(r * rb);
                let d = _mm512_set1_ps(dbuf[r][i]);
                let (w0, w1) = if Q8 {
                    let qs = row.add(2 * nb + b * 32);
                    if b % 2 == 0 {
                        _mm_prefetch::<_MM_HINT_T0>(qs.wrapping_add(PREFETCH_AHEAD) as *const i8);
                    }
                    let q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(qs as *const __m128i));
                    let q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(qs.add(16) as *const __m128i));
                    (
                        _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d),
                        _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d),
                    )
                } else {
                    let qs = row.add(4 * nb + b * 16);
                    if b % 4 == 0 {
                        _mm_prefetch::<_MM_HINT_T0>(qs.wrapping_add(PREFETCH_AHEAD) as *const i8);
                    }
                    let m = _mm512_set1_ps(mbuf[r][i]);
                    // Byte i holds element i (low nibble) and element 16 + i (high nibble).
                    let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs as *const __m128i));
                    (
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), d, m),
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v)), d, m),
                    )
                };
                *a = _mm512_fmadd_ps(x0, w0, *a);
                *a = _mm512_fmadd_ps(x1, w1, *a);
            }
        }
        b0 += cnt;
    }
    for (r, a) in acc.iter().enumerate() {
        *out.add(r) = hsum16(*a);
    }
}

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

/// 8 f16 values at `p` as f32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// `q·x` of one block: its 32 decoded values against the 32 activations at `xb`, as two short
/// chains.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_dot(q: [__m256; 4], xb: *const f32) -> __m256 {
    let s0 = _mm256_fmadd_ps(
        q[2],
        _mm256_loadu_ps(xb.add(16)),
        _mm256_mul_ps(q[0], _mm256_loadu_ps(xb)),
    );
    let s1 = _mm256_fmadd_ps(
        q[3],
        _mm256_loadu_ps(xb.add(24)),
        _mm256_mul_ps(q[1], _mm256_loadu_ps(xb.add(8))),
    );
    _mm256_add_ps(s0, s1)
}

/// `Σ_b d_b · block(b)` over a row's `nb` blocks, the f16 scales `d` at `scales`: converted 8 at
/// a time, blocks in pairs into two accumulators so the chains overlap; the row's last blocks
/// past a multiple of 8 (576 columns: 2) one at a time, with no partial copies.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled_blocks(nb: usize, scales: *const u8, block: impl Fn(usize) -> __m256) -> f32 {
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut dbuf = [0f32; 8];
    let groups = nb / 8 * 8;
    for b0 in (0..groups).step_by(8) {
        _mm256_storeu_ps(dbuf.as_mut_ptr(), f16x8(scales.add(2 * b0)));
        for i in (0..8).step_by(2) {
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(dbuf[i]), block(b0 + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(dbuf[i + 1]), block(b0 + i + 1), a1);
        }
    }
    for b in groups..nb {
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(f16_load(scales.add(2 * b))), block(b), a0);
    }
    hsum(_mm256_add_ps(a0, a1))
}

/// Split Q4_1 row: `Σ d·(q·x)` over the blocks ([`scaled_blocks`]; the 32 nibbles of a block
/// widened to four vectors) plus `Σ m·Σx`, the mins against the block sums of `x`, 8 at a time.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1(row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
    let nb = row.len() / 20;
    debug_assert!(x.len() >= nb * 32 && xsum.len() >= nb);
    let (pd, pm, pq, px) = (
        row.as_ptr(),
        row.as_ptr().add(2 * nb),
        row.as_ptr().add(4 * nb),
        x.as_ptr(),
    );
    let qx = scaled_blocks(nb, pd, |b| {
        let qs = pq.add(b * 16);
        _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
        block_dot(nibbles(qs), px.add(b * 32))
    });
    let mut macc = _mm256_setzero_ps();
    let groups = nb / 8 * 8;
    for b0 in (0..groups).step_by(8) {
        let m = f16x8(pm.add(2 * b0));
        macc = _mm256_fmadd_ps(m, _mm256_loadu_ps(xsum.as_ptr().add(b0)), macc);
    }
    let mut mtail = 0f32;
    for b in groups..nb {
        mtail += f16_load(pm.add(2 * b)) * *xsum.get_unchecked(b);
    }
    qx + hsum(macc) + mtail
}

/// Split Q8_0 row: `Σ d·(q·x)` over the blocks ([`scaled_blocks`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
    let nb = row.len() / 34;
    debug_assert!(x.len() >= nb * 32);
    let (pd, pq, px) = (row.as_ptr(), row.as_ptr().add(2 * nb), x.as_ptr());
    scaled_blocks(nb, pd, |b| {
        let qs = pq.add(b * 32);
        _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
        block_dot(bytes_i8(qs), px.add(b * 32))
    })
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
        _mm_prefetch::<_MM_HINT_T0>(pq.add(b * 16 + PREFETCH_AHEAD) as *const i8);
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
        _mm_prefetch::<_MM_HINT_T0>(pq.add(b * 32 + PREFETCH_AHEAD) as *const i8);
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

/// See [`super::panel_matmul`]: `R` weight rows (at most 6: 12 accumulators, two panel vectors
/// and a broadcast fill the 16 registers) against 16 activation columns of a panel whose k-steps
/// are `stride` floats apart. Every output is one FMA chain in `t` order, as in the AVX-512
/// kernel, so both give the same bits.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn panel_kernel<const R: usize>(
    w: *const f32,
    k: usize,
    panel: *const f32,
    stride: usize,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for t in 0..k {
        let x0 = _mm256_loadu_ps(panel.add(t * stride));
        let x1 = _mm256_loadu_ps(panel.add(t * stride + 8));
        for (r, a) in acc.iter_mut().enumerate() {
            let wb = _mm256_set1_ps(*w.add(r * k + t));
            a[0] = _mm256_fmadd_ps(wb, x0, a[0]);
            a[1] = _mm256_fmadd_ps(wb, x1, a[1]);
        }
    }
    let mut buf = [0f32; 16];
    for (r, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(buf.as_mut_ptr(), a[0]);
        _mm256_storeu_ps(buf.as_mut_ptr().add(8), a[1]);
        for (j, v) in buf.iter().enumerate().take(cols) {
            *out.add(j * ldo + r) = *v;
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

/// [`dot_q4_1`] against `M` (at most 8) activation rows: each block is decoded once to
/// `q·d + m` (the values [`dequant_q4_1`] gives) and dotted with every row; two accumulators per
/// row while there are few rows, so the FMA chains stay short.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_1_rows<const M: usize>(row: &[u8], x: &[f32], out: &mut [f32]) {
    let nb = row.len() / 20;
    let k = nb * 32;
    debug_assert!(x.len() >= M * k && out.len() >= M);
    let (pd, pq, px) = (row.as_ptr(), row.as_ptr().add(4 * nb), x.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    for b in 0..nb {
        let qs = pq.add(b * 16);
        _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
        let d = _mm256_set1_ps(f16_load(pd.add(2 * b)));
        let m = _mm256_set1_ps(f16_load(pd.add(2 * (nb + b))));
        let q = nibbles(qs);
        let wv = [
            _mm256_fmadd_ps(q[0], d, m),
            _mm256_fmadd_ps(q[1], d, m),
            _mm256_fmadd_ps(q[2], d, m),
            _mm256_fmadd_ps(q[3], d, m),
        ];
        fused_block::<M>(&wv, px.add(b * 32), k, &mut acc);
    }
    finish_rows(&acc, out);
}

/// [`dot_q8_0`] against `M` (at most 8) activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0_rows<const M: usize>(row: &[u8], x: &[f32], out: &mut [f32]) {
    let nb = row.len() / 34;
    let k = nb * 32;
    debug_assert!(x.len() >= M * k && out.len() >= M);
    let (pd, pq, px) = (row.as_ptr(), row.as_ptr().add(2 * nb), x.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    for b in 0..nb {
        let qs = pq.add(b * 32);
        _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
        let d = _mm256_set1_ps(f16_load(pd.add(2 * b)));
        let q = bytes_i8(qs);
        let wv = [
            _mm256_mul_ps(q[0], d),
            _mm256_mul_ps(q[1], d),
            _mm256_mul_ps(q[2], d),
            _mm256_mul_ps(q[3], d),
        ];
        fused_block::<M>(&wv, px.add(b * 32), k, &mut acc);
    }
    finish_rows(&acc, out);
}

/// One decoded 32-value block (`w`) dotted into the accumulators of `M` activation rows (`k`
/// floats apart, from `xb`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fused_block<const M: usize>(
    w: &[__m256; 4],
    xb: *const f32,
    k: usize,
    acc: &mut [[__m256; 2]; M],
) {
    for (j, a) in acc.iter_mut().enumerate() {
        let x = xb.add(j * k);
        if M <= 4 {
            a[0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), a[0]);
            a[1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x.add(8)), a[1]);
            a[0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x.add(16)), a[0]);
            a[1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x.add(24)), a[1]);
        } else {
            // Eight accumulators already cover the FMA latency; a second set would spill.
            a[0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), a[0]);
            a[0] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x.add(8)), a[0]);
            a[0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x.add(16)), a[0]);
            a[0] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x.add(24)), a[0]);
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn finish_rows<const M: usize>(acc: &[[__m256; 2]; M], out: &mut [f32]) {
    for (j, a) in acc.iter().enumerate() {
        out[j] = if M <= 4 {
            hsum(_mm256_add_ps(a[0], a[1]))
        } else {
            hsum(a[0])
        };
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

/// Transposes the 8×8 block in `r` (row `i` becomes column `i`).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose8(r: &mut [__m256; 8]) {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xee>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xee>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xee>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xee>(t5, t7);
    r[0] = _mm256_permute2f128_ps::<0x20>(s0, s4);
    r[1] = _mm256_permute2f128_ps::<0x20>(s1, s5);
    r[2] = _mm256_permute2f128_ps::<0x20>(s2, s6);
    r[3] = _mm256_permute2f128_ps::<0x20>(s3, s7);
    r[4] = _mm256_permute2f128_ps::<0x31>(s0, s4);
    r[5] = _mm256_permute2f128_ps::<0x31>(s1, s5);
    r[6] = _mm256_permute2f128_ps::<0x31>(s2, s6);
    r[7] = _mm256_permute2f128_ps::<0x31>(s3, s7);
}

/// See [`super::pack_panels_into`]: k-steps `t0..t0 + steps` of the `rows` activation rows at
/// `src` (`k` floats apart) into `dst`, `width` floats a step, rows past `rows` zero. 8 rows ×
/// 8 steps at a time through registers (one transposition) instead of a store per value.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn pack_run(
    src: *const f32,
    k: usize,
    rows: usize,
    t0: usize,
    steps: usize,
    dst: *mut f32,
    width: usize,
) {
    let whole = steps / 8 * 8;
    for j0 in (0..width).step_by(8) {
        let live = rows.saturating_sub(j0).min(8);
        for t in (0..whole).step_by(8) {
            let mut r = [_mm256_setzero_ps(); 8];
            for (i, v) in r.iter_mut().enumerate().take(live) {
                *v = _mm256_loadu_ps(src.add((j0 + i) * k + t0 + t));
            }
            transpose8(&mut r);
            for (i, v) in r.iter().enumerate() {
                _mm256_storeu_ps(dst.add((t + i) * width + j0), *v);
            }
        }
        for t in whole..steps {
            for i in 0..8 {
                *dst.add(t * width + j0 + i) = if i < live {
                    *src.add((j0 + i) * k + t0 + t)
                } else {
                    0.0
                };
            }
        }
    }
}

//! AVX2 + FMA + F16C kernels: 8 f32 lanes, 16 vector registers.

use super::fmt::Fmt;
use super::*;

/// Half of [`super::transpose_panel`]'s full panel: 8 rows (`ld` apart) of 8 values at `src`
/// into 8 columns of 8 at `out`, 16 apart (the panel's other half of rows beside them).
#[target_feature(enable = "avx2")]
pub unsafe fn transpose8(src: *const f32, ld: usize, out: *mut f32) {
    let r: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(src.add(j * ld)));
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4g + k]: rows 4g..4g+4 of column k of each 128-bit lane (lane L: column 4L + k).
    let u: [__m256; 8] = std::array::from_fn(|i| {
        let (g, k) = (i / 4, i % 4);
        let (a, b) = (
            _mm256_castps_pd(t[4 * g + k / 2]),
            _mm256_castps_pd(t[4 * g + 2 + k / 2]),
        );
        _mm256_castpd_ps(if k % 2 == 0 {
            _mm256_unpacklo_pd(a, b)
        } else {
            _mm256_unpackhi_pd(a, b)
        })
    });
    for k in 0..4 {
        _mm256_storeu_ps(
            out.add(16 * k),
            _mm256_permute2f128_ps::<0x20>(u[k], u[4 + k]),
        );
        _mm256_storeu_ps(
            out.add(16 * (4 + k)),
            _mm256_permute2f128_ps::<0x31>(u[k], u[4 + k]),
        );
    }
}

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

/// How far ahead the weight stream of a panel being decoded is prefetched (a hint: past the
/// end of the weights it never faults, and it warms the task's next panels). See the AVX-512
/// level's.
const PREFETCH_AHEAD: usize = 16384;

/// The same for the panels rows are multiplied against in registers ([`dot_quant_xm`],
/// [`dot_quant_x1p`]). Tuned on a former one-row kernel, which took two panels at a time: the
/// model's products of one row from memory at AVX2 on Zen 5, 2-8 KiB ahead 3.8-4.1 ms (the
/// lane-tree kernel on rows, 4 KiB ahead: 4.2).
const X1_AHEAD: usize = 8192;

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

/// `exp` of 8 lanes, computed as the AVX-512 `exp16` does (`x = n·ln2 + r`, Cephes' degree-7
/// polynomial for `e^r`, within 2 ulp), with `2^n` applied in one multiply where it is a normal
/// number for every lane (`-126 ≤ n ≤ 127`: the product is rounded once, as `vscalefps` rounds
/// it) and otherwise as two powers of two that are both normal ([`exp8_far`]), so a result in
/// the subnormal range is still rounded once and a large `x` gives +∞.
///
/// The test and its branch cost less than the clamps and the second power of two they skip (8 of
/// the 30 operations of a vector, several of them on the chain from `x` to the result): on a
/// 2-core Zen 3, [`crate::ops::log_sum_exp`] of 256 values (in a loop) took 0.69-0.70 ns a
/// value before and 0.58 after, and a 512-token prefill's attention on one thread
/// (`examples/decode_attention`) 4.72-5.16 ms before, 4.62-4.95 after (six runs each,
/// alternated).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8<const NONPOSITIVE: bool>(x: __m256) -> __m256 {
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // (NaN compares as out of range: the far path clamps it as before.)
    let low = _mm256_cmp_ps::<_CMP_NGE_UQ>(n, _mm256_set1_ps(-126.0));
    let far = if NONPOSITIVE {
        low
    } else {
        _mm256_or_ps(low, _mm256_cmp_ps::<_CMP_GT_OQ>(n, _mm256_set1_ps(127.0)))
    };
    if _mm256_movemask_ps(far) != 0 {
        return exp8_far(x);
    }
    let pow2 = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(exp_reduced(x, n), _mm256_castsi256_ps(pow2))
}

/// [`exp8`] of any lanes: `x` clamped to [-104, 100] (so `n` stays within [-150, 145]) and
/// `2^n` applied as two powers of two that are both normal numbers.
#[inline]
#[cold]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp8_far(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-104.0)),
        _mm256_set1_ps(100.0),
    );
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let e = exp_reduced(x, n);
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

/// `e^r` for `r = x − n·ln2` (ln2 in two parts), by the polynomial.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_reduced(x: __m256, n: __m256) -> __m256 {
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
    _mm256_fmadd_ps(
        _mm256_mul_ps(p, r),
        r,
        _mm256_add_ps(r, _mm256_set1_ps(1.0)),
    )
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

/// `out[i] = silu(gate[i]) · up[i]` over `n` values; `out` may be `gate` (each vector is read
/// before it is written).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul(gate: *const f32, up: *const f32, out: *mut f32, n: usize) {
    let one = _mm256_set1_ps(1.0);
    let silu = |v: __m256, u: __m256| {
        let e = exp8::<false>(_mm256_sub_ps(_mm256_setzero_ps(), v));
        _mm256_mul_ps(_mm256_div_ps(v, _mm256_add_ps(one, e)), u)
    };
    let n8 = n / 8 * 8;
    for i in (0..n8).step_by(8) {
        let r = silu(_mm256_loadu_ps(gate.add(i)), _mm256_loadu_ps(up.add(i)));
        _mm256_storeu_ps(out.add(i), r);
    }
    let rest = n - n8;
    if rest > 0 {
        let k = lanes(rest);
        let r = silu(
            _mm256_maskload_ps(gate.add(n8), k),
            _mm256_maskload_ps(up.add(n8), k),
        );
        _mm256_maskstore_ps(out.add(n8), k, r);
    }
}

#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_shifted_sum(x: &mut [f32], max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        let e = exp8::<true>(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
        _mm256_storeu_ps(c.as_mut_ptr(), e);
        acc = _mm256_add_ps(acc, e);
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let k = lanes(rest.len());
        let v = _mm256_maskload_ps(rest.as_ptr(), k);
        let e = _mm256_and_ps(exp8::<true>(_mm256_sub_ps(v, m)), _mm256_castsi256_ps(k));
        _mm256_maskstore_ps(rest.as_mut_ptr(), k, e);
        acc = _mm256_add_ps(acc, e);
    }
    hsum(acc)
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
    runs: &[&[T]],
    acc: &mut [f32],
    fin: Option<super::Finish<'_>>,
) {
    let d = acc.len() / G;
    let (pp, pa) = (p.as_ptr(), acc.as_mut_ptr());
    for c in (0..d).step_by(16) {
        let mut a = [[_mm256_setzero_ps(); 2]; G];
        for (h, ah) in a.iter_mut().enumerate().filter(|_| fin.is_none()) {
            ah[0] = _mm256_loadu_ps(pa.add(h * d + c));
            ah[1] = _mm256_loadu_ps(pa.add(h * d + c + 8));
        }
        let mut t0 = 0;
        for rows in runs {
            let (pr, n) = (rows.as_ptr(), super::rows_of(rows.len(), d));
            for t in 0..n {
                let r = pr.add(t * d + c);
                let (v0, v1) = (load_kv(r), load_kv(r.add(8)));
                for (h, ah) in a.iter_mut().enumerate() {
                    let w = _mm256_set1_ps(*pp.add(h * stride + t0 + t));
                    ah[0] = _mm256_fmadd_ps(w, v0, ah[0]);
                    ah[1] = _mm256_fmadd_ps(w, v1, ah[1]);
                }
            }
            t0 += n;
        }
        for (h, ah) in a.iter().enumerate() {
            let Some(f) = fin else {
                _mm256_storeu_ps(pa.add(h * d + c), ah[0]);
                _mm256_storeu_ps(pa.add(h * d + c + 8), ah[1]);
                continue;
            };
            let inv = _mm256_set1_ps(f.inv[h]);
            for (j, v) in ah.iter().enumerate() {
                let y = _mm256_add_ps(_mm256_mul_ps(*v, inv), _mm256_setzero_ps());
                _mm256_storeu_ps(f.out[h].add(c + 8 * j), y);
            }
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

/// Stores the lanes of `v` that hold outputs (`count` of the 8) at `p`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_part(p: *mut f32, count: usize, v: __m256) {
    if count >= 8 {
        _mm256_storeu_ps(p, v);
    } else if count > 0 {
        _mm256_maskstore_ps(p, lanes(count), v);
    }
}

/// See [`super::panel_product`]: `M` activation rows against `P` panels, two 8-lane
/// accumulators each (rows 0-7 and 8-15 of the panel).
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn panel_tile<const M: usize, const P: usize>(
    x: *const f32,
    ldx: usize,
    w: *const f32,
    ldp: usize,
    cols: usize,
    k: usize,
    cont: bool,
    out: *mut f32,
    ldo: usize,
) {
    // Outputs of vector h (8 lanes) of panel p.
    let count = |p: usize, h: usize| cols.saturating_sub(16 * p + 8 * h).min(8);
    let mut acc = [[[_mm256_setzero_ps(); 2]; P]; M];
    if cont {
        for (a, acc) in acc.iter_mut().enumerate() {
            for (p, c) in acc.iter_mut().enumerate() {
                for (h, c) in c.iter_mut().enumerate() {
                    *c = _mm256_maskload_ps(out.add(a * ldo + 16 * p + 8 * h), lanes(count(p, h)));
                }
            }
        }
    }
    // One column of the panels: 2·P vector loads, M broadcasts, 2·M·P multiply-adds.
    let column = |acc: &mut [[[__m256; 2]; P]; M], t: usize| {
        let mut wv = [[_mm256_setzero_ps(); 2]; P];
        for (p, v) in wv.iter_mut().enumerate() {
            let at = w.add(p * ldp + 16 * t);
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(16 * super::PANEL_AHEAD) as *const i8);
            *v = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
        }
        for (a, acc) in acc.iter_mut().enumerate() {
            let xv = _mm256_set1_ps(*x.add(a * ldx + t));
            for (c, v) in acc.iter_mut().zip(&wv) {
                c[0] = _mm256_fmadd_ps(xv, v[0], c[0]);
                c[1] = _mm256_fmadd_ps(xv, v[1], c[1]);
            }
        }
    };
    in_turns!(k, t => column(&mut acc, t));
    for (a, acc) in acc.iter().enumerate() {
        for (p, c) in acc.iter().enumerate() {
            for (h, c) in c.iter().enumerate() {
                store_part(out.add(a * ldo + 16 * p + 8 * h), count(p, h), *c);
            }
        }
    }
}

/// Two vectors of a panel block's sixteen f16 values at `p` (rows 0-7, 8-15) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves16(p: *const u8) -> [__m256; 2] {
    [
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)),
    ]
}

/// The scales and minimums of a sub-block at `sub` (super-block head at `head`) of format `F`,
/// rows 0-7 and 8-15; for Q6_K, those of columns `16·half ..`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales<F: Fmt>(head: *const u8, sub: *const u8, half: usize) -> [[__m256; 2]; 2] {
    let u8s = |p: *const u8| {
        let v = |at: usize| {
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                p.add(at) as *const __m128i
            )))
        };
        [v(0), v(8)]
    };
    let off = |s: [__m256; 2]| {
        let o = _mm256_set1_ps(-(F::OFFSET as f32));
        [_mm256_mul_ps(s[0], o), _mm256_mul_ps(s[1], o)]
    };
    if !F::KQ {
        let s = halves16(sub);
        let m = if F::MIN {
            halves16(sub.add(32))
        } else {
            off(s)
        };
        return [s, m];
    }
    let d = halves16(head);
    let mul =
        |a: [__m256; 2], b: [__m256; 2]| [_mm256_mul_ps(a[0], b[0]), _mm256_mul_ps(a[1], b[1])];
    if F::HALVES {
        let i8s = |at: usize| {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                sub.add(16 * half + at) as *const __m128i,
            )))
        };
        let s = mul(d, [i8s(0), i8s(8)]);
        return [s, off(s)];
    }
    [
        mul(d, u8s(sub)),
        mul(halves16(head.add(32)), u8s(sub.add(16))),
    ]
}

/// `v` shifted left by `n` bits (right where `n` is negative).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn shl(v: __m256i, n: i32) -> __m256i {
    if n >= 0 {
        _mm256_sllv_epi32(v, _mm256_set1_epi32(n))
    } else {
        _mm256_srlv_epi32(v, _mm256_set1_epi32(-n))
    }
}

/// The codes of columns `2c` and `2c+1` of a sub-block's codes at `codes` (the format's offset
/// is [`value`]'s): [column 2c rows 0-7, rows 8-15, column 2c+1 rows 0-7, rows 8-15], each
/// 8-byte half widened straight from memory.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn pair<F: Fmt>(codes: *const u8, c: usize) -> [__m256i; 4] {
    let ld = |at: usize| _mm_loadl_epi64(codes.add(at) as *const __m128i);
    let mut q = if F::BITS == 8 {
        let w = |at: usize| _mm256_cvtepi8_epi32(ld(at));
        [w(32 * c), w(32 * c + 8), w(32 * c + 16), w(32 * c + 24)]
    } else {
        let low = _mm256_set1_epi32(0x0f);
        let v0 = _mm256_cvtepu8_epi32(ld(16 * c));
        let v1 = _mm256_cvtepu8_epi32(ld(16 * c + 8));
        [
            _mm256_and_si256(v0, low),
            _mm256_and_si256(v1, low),
            _mm256_srli_epi32::<4>(v0),
            _mm256_srli_epi32::<4>(v1),
        ]
    };
    if F::BITS == 5 {
        // Column 2c + i/2's mask, shifted up four: lane j of half h takes bit 8h + j + 4.
        let lane = |h: i32| {
            _mm256_setr_epi32(
                8 * h,
                8 * h + 1,
                8 * h + 2,
                8 * h + 3,
                8 * h + 4,
                8 * h + 5,
                8 * h + 6,
                8 * h + 7,
            )
        };
        let bits = |col: usize| {
            let m = u16::from_le_bytes([*codes.add(256 + 2 * col), *codes.add(257 + 2 * col)]);
            _mm256_set1_epi32((m as i32) << 4)
        };
        let hv = [bits(2 * c), bits(2 * c + 1)];
        for (i, q) in q.iter_mut().enumerate() {
            let hi = _mm256_srlv_epi32(hv[i / 2], lane((i % 2) as i32));
            *q = _mm256_or_si256(*q, _mm256_and_si256(hi, _mm256_set1_epi32(0x10)));
        }
    }
    if F::BITS == 6 {
        let g = 256 + 16 * (c / 2);
        let hv = [_mm256_cvtepu8_epi32(ld(g)), _mm256_cvtepu8_epi32(ld(g + 8))];
        for (i, q) in q.iter_mut().enumerate() {
            let at = 2 * ((2 * c + i / 2) % 4) as i32;
            let hi = _mm256_and_si256(shl(hv[i % 2], 4 - at), _mm256_set1_epi32(0x30));
            *q = _mm256_or_si256(*q, hi);
        }
    }
    q
}

/// Codes `q` as weights with scales `s` and minimums `m` (see [`super::fmt`]); for a format
/// with an offset, `m` is `−offset·s`, as at AVX-512 (the same values).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn value<F: Fmt>(q: __m256i, s: __m256, m: __m256) -> __m256 {
    let f = _mm256_cvtepi32_ps(q);
    match (F::MIN, F::KQ) {
        (true, true) => _mm256_fmsub_ps(f, s, m),
        (true, false) => _mm256_fmadd_ps(f, s, m),
        _ if F::OFFSET != 0 => _mm256_fmadd_ps(f, s, m),
        _ => _mm256_mul_ps(f, s),
    }
}

/// See the AVX-512 `dequant_panel`: the same values, eight lanes at a time.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dequant_panel<F: Fmt>(panel: *const u8, b0: usize, b1: usize, out: *mut f32) {
    let l = F::L;
    for b in b0..b1 {
        let (ho, so) = l.block(b);
        let (head, sub) = (panel.add(ho), panel.add(so));
        for line in (0..l.sub()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(sub.wrapping_add(line + PREFETCH_AHEAD) as *const i8);
        }
        let [mut s, mut m] = scales::<F>(head, sub, 0);
        let codes = sub.add(l.scales);
        let o = out.add((b - b0) * 32 * 16);
        for c in 0..16 {
            if F::HALVES && c == 8 {
                [s, m] = scales::<F>(head, sub, 1);
            }
            let q = pair::<F>(codes, c);
            for (i, q) in q.iter().enumerate() {
                let h = i % 2;
                _mm256_storeu_ps(o.add(32 * c + 8 * i), value::<F>(*q, s[h], m[h]));
            }
        }
    }
}

/// Asks L1 for the lines [`X1_AHEAD`] bytes past those of block `b` of the panel at `panel` (of
/// `pl` bytes; with its super-block's head where `b` starts one), in a stream of panels that a
/// kernel reads `streams` at a time (see `ahead`). Returns the block's head and sub-block
/// offsets.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ask_ahead<F: Fmt>(
    panel: *const u8,
    pl: usize,
    b: usize,
    streams: usize,
) -> (usize, usize) {
    let l = F::L;
    let (ho, so) = l.block(b);
    let from = if b.is_multiple_of(l.subs) { ho } else { so };
    for line in (from..so + l.sub()).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(super::ahead(
            panel.wrapping_add(line),
            line,
            pl,
            streams,
            X1_AHEAD,
        ));
    }
    (ho, so)
}

/// Columns `t` and `t + 1` of `M` activation rows (`ldx` apart at `x`) into their accumulators:
/// the columns' codes `q` (see [`pair`]) decoded with the scales and minimums `sm(0, h)` and
/// `sm(1, h)` of rows `8h..8h + 8`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn two_columns<F: Fmt, const M: usize>(
    q: [__m256i; 4],
    sm: impl Fn(usize, usize) -> __m256,
    x: *const f32,
    ldx: usize,
    t: usize,
    acc: &mut [[__m256; 2]; M],
) {
    for i in 0..2 {
        let w = [
            value::<F>(q[2 * i], sm(0, 0), sm(1, 0)),
            value::<F>(q[2 * i + 1], sm(0, 1), sm(1, 1)),
        ];
        for (a, acc) in acc.iter_mut().enumerate() {
            let xv = _mm256_set1_ps(*x.add(a * ldx + t + i));
            acc[0] = _mm256_fmadd_ps(xv, w[0], acc[0]);
            acc[1] = _mm256_fmadd_ps(xv, w[1], acc[1]);
        }
    }
}

/// `M` (≤ 4) activation rows `x` (`k` values each, `ldx` apart) against one panel of format `F`
/// at `panel` decoded in registers: each column's sixteen weights decoded to exactly what
/// [`dequant_panel`] writes, once for all the rows, and multiplied into each row's two
/// accumulators, column after column: [`panel_tile`]'s bits. The first `cols` outputs of each row
/// go to `out` (rows `ldo` apart). From three rows on, the accumulators, the scales and minimums,
/// the codes and the weights outgrow the 16 registers a little; the model's decode-step products
/// on Zen 4 (`decode_matmul`, four rounds) still took 8.4-12.0 ms for 2 rows, 8.7-9.9 for 3 and
/// 12.1-13.6 for 4, where half a panel at a time (eight accumulators' room, each column's codes
/// decoded and the rows' values broadcast twice) took 12.6-13.8, 12.0-13.7 and 12.0-15.4.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_quant_xm<F: Fmt, const M: usize>(
    panel: *const u8,
    pl: usize,
    x: *const f32,
    ldx: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let l = F::L;
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    // From four rows on, the current sub-block's scales and minimums are read from this buffer
    // at each use, so that the registers they would hold keep every accumulator. (Left in
    // registers, one of the accumulators went to the stack and back every column: 10.1 ms for
    // 4 rows of the model's decode products on a 2-core Zen 3. Read into a fresh local array
    // every column, as until 2026-12-07, the scales were copied from stack slot to stack slot
    // every column and two code vectors spilled: 9.03-9.07 ms with the weights in cache,
    // against 6.96-7.06 read from this buffer, and 5.8 for 3 rows. 2 and 3 rows read from here
    // took 5.2-6.0 and 6.3-6.5 ms against 4.8 and 5.9 in registers.)
    let mut kept: [[__m256; 2]; 2];
    for b in 0..k / 32 {
        let (ho, so) = ask_ahead::<F>(panel, pl, b, 1);
        let mut sm = scales::<F>(panel.add(ho), panel.add(so), 0);
        kept = sm;
        let codes = panel.add(so + l.scales);
        for c in 0..16 {
            if F::HALVES && c == 8 {
                sm = scales::<F>(panel.add(ho), panel.add(so), 1);
                kept = sm;
            }
            // Columns 2c and 2c+1: codes 2i (rows 0-7) and 2i+1 (rows 8-15) of column 2c+i.
            let q = pair::<F>(codes, c);
            let t = 32 * b + 2 * c;
            if M >= 4 {
                let at = |j: usize, h: usize| std::ptr::read_volatile(&kept[j][h]);
                two_columns::<F, M>(q, at, x, ldx, t, &mut acc);
            } else {
                two_columns::<F, M>(q, |j, h| sm[j][h], x, ldx, t, &mut acc);
            }
        }
    }
    for (a, acc) in acc.iter().enumerate() {
        for (h, v) in acc.iter().enumerate() {
            store_part(
                out.add(a * ldo + 8 * h),
                cols.saturating_sub(8 * h).min(8),
                *v,
            );
        }
    }
}

/// One activation row `x` (`k` values) against the `P` panels at `panels` of format `F`, decoded
/// in registers: [`dot_quant_xm`]'s one row, the same bits, with `P` panels' chains side by side
/// (2·P accumulators) so that each column's multiply-adds do not wait on the last column's.
/// The scales and minimums of the panels' current sub-block wait in a buffer on the stack and
/// are read from it at each use (they would not fit the registers beside the accumulators).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_quant_x1p<F: Fmt, const P: usize>(
    panels: [*const u8; P],
    pl: usize,
    x: *const f32,
    k: usize,
    out: *mut f32,
    cols: usize,
) {
    let l = F::L;
    let mut acc = [[_mm256_setzero_ps(); 2]; P];
    let mut sm = [[[_mm256_setzero_ps(); 2]; 2]; P];
    for b in 0..k / 32 {
        let (ho, so) = l.block(b);
        for (p, &panel) in panels.iter().enumerate() {
            ask_ahead::<F>(panel, pl, b, P);
            sm[p] = scales::<F>(panel.add(ho), panel.add(so), 0);
        }
        let xb = x.add(32 * b);
        for c in 0..16 {
            if F::HALVES && c == 8 {
                for (p, &panel) in panels.iter().enumerate() {
                    sm[p] = scales::<F>(panel.add(ho), panel.add(so), 1);
                }
            }
            let mut q = [[_mm256_setzero_si256(); 4]; P];
            for (p, &panel) in panels.iter().enumerate() {
                q[p] = pair::<F>(panel.add(so + l.scales), c);
            }
            for i in 0..2 {
                let xv = _mm256_set1_ps(*xb.add(2 * c + i));
                for p in 0..P {
                    let at = |j: usize, h: usize| std::ptr::read_volatile(&sm[p][j][h]);
                    let w0 = value::<F>(q[p][2 * i], at(0, 0), at(1, 0));
                    let w1 = value::<F>(q[p][2 * i + 1], at(0, 1), at(1, 1));
                    acc[p][0] = _mm256_fmadd_ps(xv, w0, acc[p][0]);
                    acc[p][1] = _mm256_fmadd_ps(xv, w1, acc[p][1]);
                }
            }
        }
    }
    for (p, acc) in acc.iter().enumerate() {
        for (h, v) in acc.iter().enumerate() {
            store_part(
                out.add(16 * p + 8 * h),
                cols.saturating_sub(16 * p + 8 * h).min(8),
                *v,
            );
        }
    }
}

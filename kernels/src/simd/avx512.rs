//! AVX-512 kernels (F, BW, VL; F16C and FMA): 16 f32 lanes.

use super::fmt::Fmt;
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

/// How far ahead the weight stream of a panel being decoded is prefetched (a hint: past the
/// end of the weights it never faults, and it warms the task's next panels). 4 rows through the
/// model's products from memory on a 2-core Zen 5: 4 KiB 6.7 ms, 16 KiB 5.8 (32 rows alike).
const PREFETCH_AHEAD: usize = 16384;

/// The same for each of the panels one row is multiplied against in registers
/// ([`dot_quant_xm`]), side by side: the model's products of one row from memory, 4 KiB ahead
/// 3.2-3.5 ms when the streams ran into each other's panels, 2.5 ms with each stream's reach
/// passing its panel's end into the one the task takes next (2-8 KiB alike).
const X1_AHEAD: usize = 8192;

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

/// `out[i] = silu(gate[i]) · up[i]` over `n` values; `out` may be `gate` (each vector is read
/// before it is written).
#[target_feature(enable = "avx512f,avx2,fma")]
pub unsafe fn silu_mul(gate: *const f32, up: *const f32, out: *mut f32, n: usize) {
    let one = _mm512_set1_ps(1.0);
    let silu = |v: __m512, u: __m512| {
        let e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), v));
        _mm512_mul_ps(_mm512_div_ps(v, _mm512_add_ps(one, e)), u)
    };
    let n16 = n / 16 * 16;
    for i in (0..n16).step_by(16) {
        let r = silu(_mm512_loadu_ps(gate.add(i)), _mm512_loadu_ps(up.add(i)));
        _mm512_storeu_ps(out.add(i), r);
    }
    let rest = n - n16;
    if rest > 0 {
        let k: __mmask16 = ((1u32 << rest) - 1) as u16;
        let r = silu(
            _mm512_maskz_loadu_ps(k, gate.add(n16)),
            _mm512_maskz_loadu_ps(k, up.add(n16)),
        );
        _mm512_mask_storeu_ps(out.add(n16), k, r);
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

/// `N` (up to 12) query vectors against `PIECES` (two, or the first alone) pieces of up to 16
/// keys each, stored transposed (dimension `i` of piece `p`'s keys at `kt[p] + i·ld`, its lanes
/// past `cols[p]` neither read nor written; all 16 when `FULL`, so the loads are unmasked):
/// `PIECES·N` accumulators, one chain over the dimensions in order per query and piece (the
/// other levels' order), each query element (rows of `d` at `q`) broadcast once for both
/// pieces. Piece `p`'s scores of query `v` go to `out[p] + v·ldo`. Two pieces a call, where one
/// piece a call loaded a broadcast for each multiply-add: 12 queries over 2 × 16 keys in L1 on
/// one core of the Intel Xeon (`decode_attention`'s tiles) 148-150 -> 175-181 GFLOP/s. A run's
/// odd last piece goes alone: with a masked-off second piece beside it, half of its call's
/// multiply-adds were of zero lanes (the scores against the values' samples, a 200-token
/// prefill on a 2-core Zen 4, `perf` of `decode_attention`: 1.10-1.12 -> 1.00-1.07).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_keys_t<T: KvValue, const N: usize, const FULL: bool, const PIECES: usize>(
    q: *const f32,
    d: usize,
    kt: [*const T; 2],
    ld: usize,
    cols: [usize; 2],
    scale: f32,
    out: [*mut f32; 2],
    ldo: usize,
) {
    let mask = match FULL {
        true => [!0; 2],
        false => cols.map(|c| if c >= 16 { 0xFFFF } else { (1u16 << c) - 1 }),
    };
    let mut acc = [[_mm512_setzero_ps(); PIECES]; N];
    for i in 0..d {
        let k: [__m512; PIECES] = std::array::from_fn(|p| load_kv(mask[p], kt[p].add(i * ld)));
        for (v, a) in acc.iter_mut().enumerate() {
            let qv = _mm512_set1_ps(*q.add(v * d + i));
            for p in 0..PIECES {
                a[p] = _mm512_fmadd_ps(qv, k[p], a[p]);
            }
        }
    }
    let s = _mm512_set1_ps(scale);
    for p in 0..PIECES {
        for (v, a) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out[p].add(v * ldo), mask[p], _mm512_mul_ps(a[p], s));
        }
    }
}

/// See [`super::transpose_panel`]: 16 rows (`ld` apart) of 16 values at `src` into 16 columns
/// of 16 at `out`. Pairs of rows interleave, then pairs of pairs, within each 128-bit lane;
/// then lanes are gathered across the four groups of four rows.
#[target_feature(enable = "avx512f")]
pub unsafe fn transpose16(src: *const f32, ld: usize, out: *mut f32) {
    let r: [__m512; 16] = std::array::from_fn(|j| _mm512_loadu_ps(src.add(j * ld)));
    // t[2a], t[2a+1]: rows 2a and 2a+1 interleaved (lane values 0,1 then 2,3).
    let t: [__m512; 16] = std::array::from_fn(|i| {
        let (a, b) = (r[i & !1], r[i | 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(a, b)
        } else {
            _mm512_unpackhi_ps(a, b)
        }
    });
    // u[4g + k]: rows 4g..4g+4 of column k of each 128-bit lane (lane L: column 4L + k).
    let u: [__m512; 16] = std::array::from_fn(|i| {
        let (g, k) = (i / 4, i % 4);
        let (a, b) = (
            _mm512_castps_pd(t[4 * g + k / 2]),
            _mm512_castps_pd(t[4 * g + 2 + k / 2]),
        );
        _mm512_castpd_ps(if k % 2 == 0 {
            _mm512_unpacklo_pd(a, b)
        } else {
            _mm512_unpackhi_pd(a, b)
        })
    });
    for k in 0..4 {
        let (u0, u1, u2, u3) = (u[k], u[4 + k], u[8 + k], u[12 + k]);
        // Lanes 0 and 2 (v) and 1 and 3 (w) of each group, two groups a vector.
        let v01 = _mm512_shuffle_f32x4::<0x88>(u0, u1);
        let w01 = _mm512_shuffle_f32x4::<0xDD>(u0, u1);
        let v23 = _mm512_shuffle_f32x4::<0x88>(u2, u3);
        let w23 = _mm512_shuffle_f32x4::<0xDD>(u2, u3);
        let col = |lane: usize| out.add(16 * (4 * lane + k));
        _mm512_storeu_ps(col(0), _mm512_shuffle_f32x4::<0x88>(v01, v23));
        _mm512_storeu_ps(col(2), _mm512_shuffle_f32x4::<0xDD>(v01, v23));
        _mm512_storeu_ps(col(1), _mm512_shuffle_f32x4::<0x88>(w01, w23));
        _mm512_storeu_ps(col(3), _mm512_shuffle_f32x4::<0xDD>(w01, w23));
    }
}

/// `G` heads; `d` is a multiple of 64. Each 64-wide slice of a row is loaded once for all heads
/// and the `4·G` accumulators stay in registers across the rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn axpy_rows_g<T: KvValue, const G: usize>(
    p: &[f32],
    stride: usize,
    runs: &[&[T]],
    acc: &mut [f32],
    fin: Option<super::Finish<'_>>,
) {
    let d = acc.len() / G;
    let (pp, pa) = (p.as_ptr(), acc.as_mut_ptr());
    for c in (0..d).step_by(64) {
        let mut a = [[_mm512_setzero_ps(); 4]; G];
        for (h, ah) in a.iter_mut().enumerate().filter(|_| fin.is_none()) {
            for (j, v) in ah.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(pa.add(h * d + c + 16 * j));
            }
        }
        let mut t0 = 0;
        for rows in runs {
            let (pr, n) = (rows.as_ptr(), super::rows_of(rows.len(), d));
            for t in 0..n {
                let r = pr.add(t * d + c);
                let v = [
                    load_kv(!0, r),
                    load_kv(!0, r.add(16)),
                    load_kv(!0, r.add(32)),
                    load_kv(!0, r.add(48)),
                ];
                for (h, ah) in a.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*pp.add(h * stride + t0 + t));
                    for j in 0..4 {
                        ah[j] = _mm512_fmadd_ps(w, v[j], ah[j]);
                    }
                }
            }
            t0 += n;
        }
        for (h, ah) in a.iter().enumerate() {
            let Some(f) = fin else {
                for (j, v) in ah.iter().enumerate() {
                    _mm512_storeu_ps(pa.add(h * d + c + 16 * j), *v);
                }
                continue;
            };
            let inv = _mm512_set1_ps(f.inv[h]);
            for (j, v) in ah.iter().enumerate() {
                let y = _mm512_add_ps(_mm512_mul_ps(*v, inv), _mm512_setzero_ps());
                _mm512_storeu_ps(f.out[h].add(c + 16 * j), y);
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

/// The lanes of panel `p` of a tile that hold outputs (the first `cols` of its panels').
#[inline]
fn lanes(cols: usize, p: usize) -> __mmask16 {
    let c = cols.saturating_sub(16 * p).min(16);
    ((1u32 << c) - 1) as __mmask16
}

/// See [`super::panel_product`]: `M` activation rows against `P` panels, one 16-lane
/// accumulator each; a column's panel vectors are loaded once for every row, and each row's
/// activation broadcast once for every panel.
#[target_feature(enable = "avx512f,avx512dq,avx512vl,avx2,fma")]
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
    let mut acc = [[_mm512_setzero_ps(); P]; M];
    if cont {
        for (a, acc) in acc.iter_mut().enumerate() {
            for (p, c) in acc.iter_mut().enumerate() {
                *c = _mm512_maskz_loadu_ps(lanes(cols, p), out.add(a * ldo + 16 * p));
            }
        }
    }
    // One column of the panels: P vector loads, M broadcasts, M·P multiply-adds.
    let column = |acc: &mut [[__m512; P]; M], t: usize| {
        let mut wv = [_mm512_setzero_ps(); P];
        for (p, v) in wv.iter_mut().enumerate() {
            let at = w.add(p * ldp + 16 * t);
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(16 * super::PANEL_AHEAD) as *const i8);
            *v = _mm512_loadu_ps(at);
        }
        for (a, acc) in acc.iter_mut().enumerate() {
            let xv = _mm512_set1_ps(*x.add(a * ldx + t));
            for (c, v) in acc.iter_mut().zip(&wv) {
                *c = _mm512_fmadd_ps(xv, *v, *c);
            }
        }
    };
    in_turns!(k, t => column(&mut acc, t));
    for (a, acc) in acc.iter().enumerate() {
        for (p, c) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(a * ldo + 16 * p), lanes(cols, p), *c);
        }
    }
}

/// The scales and minimums of a sub-block at `sub` (super-block head at `head`) of format `F`,
/// sixteen rows a vector; for Q6_K, those of columns `16·half ..`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scales<F: Fmt>(head: *const u8, sub: *const u8, half: usize) -> (__m512, __m512) {
    let h16 = |p: *const u8| _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
    let u8s = |p: *const u8| {
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)))
    };
    if !F::KQ {
        let s = h16(sub);
        let m = if F::MIN {
            h16(sub.add(32))
        } else {
            offset::<F>(s)
        };
        return (s, m);
    }
    let d = h16(head);
    if F::HALVES {
        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(sub.add(16 * half) as *const __m128i));
        let s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        return (s, offset::<F>(s));
    }
    (
        _mm512_mul_ps(d, u8s(sub)),
        _mm512_mul_ps(h16(head.add(32)), u8s(sub.add(16))),
    )
}

/// The codes of columns `2c` and `2c+1` of a sub-block's codes at `codes`, sixteen rows a
/// vector, but for 6-bit codes' top bits ([`quad`]'s) and the format's offset ([`value`]'s). A
/// 4-bit format's column `2c` keeps column `2c+1`'s code above its low four bits: [`value`]
/// reads only those.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn pair<F: Fmt>(codes: *const u8, c: usize) -> [__m512i; 2] {
    let ld = |at: usize| _mm_loadu_si128(codes.add(at) as *const __m128i);
    let mut q = if F::BITS == 8 {
        [
            _mm512_cvtepi8_epi32(ld(32 * c)),
            _mm512_cvtepi8_epi32(ld(32 * c + 16)),
        ]
    } else {
        let v = _mm512_cvtepu8_epi32(ld(16 * c));
        [
            if F::BITS == 4 {
                v
            } else {
                _mm512_and_si512(v, _mm512_set1_epi32(0x0f))
            },
            _mm512_srli_epi32::<4>(v),
        ]
    };
    if F::BITS == 5 {
        for (i, q) in q.iter_mut().enumerate() {
            let k = (codes.add(256 + 4 * c + 2 * i) as *const u16).read_unaligned();
            *q = _mm512_mask_or_epi32(*q, k, *q, _mm512_set1_epi32(0x10));
        }
    }
    q
}

/// The codes of columns `4g .. 4g+4` of a sub-block's codes at `codes` (see [`pair`]).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn quad<F: Fmt>(codes: *const u8, g: usize) -> [__m512i; 4] {
    let [a, b] = pair::<F>(codes, 2 * g);
    let [c, d] = pair::<F>(codes, 2 * g + 1);
    let mut q = [a, b, c, d];
    if F::BITS == 6 {
        // The top two bits of column 4g+i are bits 2i, 2i+1 of the group's byte: moved to bits
        // 4-5 by immediate shifts and ORed in under the mask, one instruction each (0xEA:
        // A & B | C).
        let hv = _mm512_cvtepu8_epi32(_mm_loadu_si128(codes.add(256 + 16 * g) as *const __m128i));
        let m = _mm512_set1_epi32(0x30);
        let hi = [
            _mm512_slli_epi32::<4>(hv),
            _mm512_slli_epi32::<2>(hv),
            hv,
            _mm512_srli_epi32::<2>(hv),
        ];
        for (q, h) in q.iter_mut().zip(hi) {
            *q = _mm512_ternarylogic_epi32::<0xEA>(h, m, *q);
        }
    }
    q
}

/// Codes `q` as weights with scales `s` and minimums `m` (see [`super::fmt`]); for a format
/// with an offset, `m` is `−offset·s` ([`scales`]): `q·s − offset·s` is `(q − offset)·s` exactly
/// (every term is exact and so is the difference), in one instruction instead of two. Only a
/// zero may take the other sign, which no product chain can see: it starts from +0, and an
/// exact zero added to +0 is +0 whatever its sign.
///
/// A 4-bit code becomes its float by a lookup in one register (`vpermps` reads the low four
/// bits of each lane, so [`pair`] need not mask them): the value `vcvtdq2ps` gives, without the
/// mask, and on the other vector port (Intel runs both instructions on one port each, the
/// conversion on the multiply-adds' first).
#[inline]
#[target_feature(enable = "avx512f,fma")]
unsafe fn value<F: Fmt>(q: __m512i, s: __m512, m: __m512) -> __m512 {
    let f = if F::BITS == 4 {
        let codes = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        _mm512_permutexvar_ps(q, codes)
    } else {
        _mm512_cvtepi32_ps(q)
    };
    match (F::MIN, F::KQ) {
        (true, true) => _mm512_fmsub_ps(f, s, m),
        (true, false) => _mm512_fmadd_ps(f, s, m),
        _ if F::OFFSET != 0 => _mm512_fmadd_ps(f, s, m),
        _ => _mm512_mul_ps(f, s),
    }
}

/// `−offset·s`, the minimum [`value`] takes for a format with an offset.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn offset<F: Fmt>(s: __m512) -> __m512 {
    _mm512_mul_ps(s, _mm512_set1_ps(-(F::OFFSET as f32)))
}

/// Blocks `b0..b1` (32 columns each) of the panel of format `F` at `panel` decoded column by
/// column into `out` ([`super::dequant_panel`]).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn dequant_panel<F: Fmt>(panel: *const u8, b0: usize, b1: usize, out: *mut f32) {
    let l = F::L;
    for b in b0..b1 {
        let (ho, so) = l.block(b);
        let (head, sub) = (panel.add(ho), panel.add(so));
        // The decoded tile is the first touch of these weights: fetch ahead, as the dots do.
        for line in (0..l.sub()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(sub.wrapping_add(line + PREFETCH_AHEAD) as *const i8);
        }
        let (mut s, mut m) = scales::<F>(head, sub, 0);
        let codes = sub.add(l.scales);
        let o = out.add((b - b0) * 32 * 16);
        for g in 0..8 {
            if F::HALVES && g == 4 {
                (s, m) = scales::<F>(head, sub, 1);
            }
            let q = quad::<F>(codes, g);
            for (i, q) in q.iter().enumerate() {
                _mm512_storeu_ps(o.add(64 * g + 16 * i), value::<F>(*q, s, m));
            }
        }
    }
}

/// `M` activation rows `x` (`k` values each, `ldx` apart) against `P` panels of format `F` at
/// `panels` (each `pl` bytes, the panels of one matrix): each column's sixteen weights a panel
/// decoded in registers to exactly what [`dequant_panel`] writes, once for all the rows, and
/// multiplied into each row's accumulator for the panel, column after column: [`panel_tile`]'s
/// bits. The first `cols` outputs of each row go to `out` (rows `ldo` apart).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_quant_xm<F: Fmt, const P: usize, const M: usize>(
    panels: [*const u8; P],
    pl: usize,
    x: *const f32,
    ldx: usize,
    k: usize,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    let l = F::L;
    let mut acc = [[_mm512_setzero_ps(); P]; M];
    for b in 0..k / 32 {
        let (ho, so) = l.block(b);
        let from = if b % l.subs == 0 { ho } else { so };
        let mut s = [_mm512_setzero_ps(); P];
        let mut m = [_mm512_setzero_ps(); P];
        for p in 0..P {
            for line in (from..so + l.sub()).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(super::ahead(
                    panels[p].wrapping_add(line),
                    line,
                    pl,
                    P,
                    X1_AHEAD,
                ));
            }
            (s[p], m[p]) = scales::<F>(panels[p].add(ho), panels[p].add(so), 0);
        }
        for g in 0..8 {
            if F::HALVES && g == 4 {
                for p in 0..P {
                    (s[p], m[p]) = scales::<F>(panels[p].add(ho), panels[p].add(so), 1);
                }
            }
            let t = 32 * b + 4 * g;
            for p in 0..P {
                let q = quad::<F>(panels[p].add(so + l.scales), g);
                for (i, q) in q.into_iter().enumerate() {
                    let w = value::<F>(q, s[p], m[p]);
                    for (a, acc) in acc.iter_mut().enumerate() {
                        let xv = _mm512_set1_ps(*x.add(a * ldx + t + i));
                        acc[p] = _mm512_fmadd_ps(xv, w, acc[p]);
                    }
                }
            }
        }
    }
    for (a, acc) in acc.iter().enumerate() {
        for (p, c) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.add(a * ldo + 16 * p), lanes(cols, p), *c);
        }
    }
}

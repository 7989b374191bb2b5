//! Vector primitives with a runtime-selected AVX2/FMA path and a portable fallback.
//!
//! The quantized dot products keep activations in f32: a weight block is decoded to f32 lanes and
//! multiplied with the f32 activations. (llama.cpp instead rounds activations to 8 bits, which is
//! faster but no longer matches an f32 reference token for token.) Q4_1 uses
//! `Σ (d·q + m)·x = d·Σ q·x + m·Σ x` with the per-block `Σ x` computed once per activation row.

use tandem_model::quant::{dequantize, GgmlType};

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Whether the AVX2+FMA+F16C kernels can run here (checked once; the standard library caches it).
#[inline]
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the AVX-512F kernels can run here.
#[inline]
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f") && has_avx2_fma()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Portable dot product with 8 independent lanes so the compiler can vectorize it.
fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
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
    dot_portable(a, b)
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
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// Sums of each 32-element block of `x` (the `Σ x` term of the Q4_1 dot).
pub fn block_sums(x: &[f32]) -> Vec<f32> {
    x.chunks(32).map(|c| c.iter().sum()).collect()
}

/// Dot of one quantized row with f32 activations `x`. `xsum` holds `block_sums(x)` (used by Q4_1).
#[inline]
pub fn dot_quant_row(
    ty: GgmlType,
    row: &[u8],
    x: &[f32],
    xsum: &[f32],
    scratch: &mut [f32],
) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        match ty {
            // SAFETY: as above; row lengths are validated when the weight is built.
            GgmlType::Q4_1 => return unsafe { avx512::dot_q4_1(row, x, xsum) },
            GgmlType::Q8_0 => return unsafe { avx512::dot_q8_0(row, x) },
            _ => {}
        }
    } else if has_avx2_fma() {
        match ty {
            // SAFETY: as above; row lengths are validated when the weight is built.
            GgmlType::Q4_1 => return unsafe { avx2::dot_q4_1(row, x, xsum) },
            GgmlType::Q8_0 => return unsafe { avx2::dot_q8_0(row, x) },
            _ => {}
        }
    }
    dequant_row(ty, row, scratch);
    dot_f32(scratch, x)
}

/// Decodes one quantized row into `out`.
pub fn dequant_row(ty: GgmlType, row: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        match ty {
            // SAFETY: as above.
            GgmlType::Q4_1 => return unsafe { avx2::dequant_q4_1(row, out) },
            GgmlType::Q8_0 => return unsafe { avx2::dequant_q8_0(row, out) },
            _ => {}
        }
    }
    dequantize(ty, row, out).expect("row length validated when the weight was built");
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;

    /// Prefetch distance for the weight stream. Measured on the 2-core VM (batch-1 decode, same
    /// background load): 1 KiB 35 tok/s, 4 KiB 44 tok/s, 8 KiB 30-35 tok/s; no prefetch 16 tok/s.
    const PREFETCH_AHEAD: usize = 4096;

    /// d and m (two f16 at `p`) as f32.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

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

    /// Two blocks per iteration with separate accumulators, so the FMA latency chains overlap.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn dot_q4_1(row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
        let nb = row.len() / 20;
        debug_assert!(x.len() >= nb * 32 && xsum.len() >= nb);
        let mask = _mm_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut macc = [0f32; 2];
        let (pr, px) = (row.as_ptr(), x.as_ptr());
        for b in 0..nb {
            let blk = pr.add(b * 20);
            _mm_prefetch::<_MM_HINT_T0>(blk.add(PREFETCH_AHEAD) as *const i8);
            let (d, m) = f16_pair(blk);
            let q = _mm_loadu_si128(blk.add(4) as *const __m128i);
            let lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask)));
            let hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(
                _mm_srli_epi16(q, 4),
                mask,
            )));
            let xb = px.add(b * 32);
            let s = _mm512_fmadd_ps(
                hi,
                _mm512_loadu_ps(xb.add(16)),
                _mm512_mul_ps(lo, _mm512_loadu_ps(xb)),
            );
            let j = b & 1;
            acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(d), s, acc[j]);
            macc[j] += m * *xsum.get_unchecked(b);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + macc[0] + macc[1]
    }

    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    pub unsafe fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
        let nb = row.len() / 34;
        debug_assert!(x.len() >= nb * 32);
        let mut acc = [_mm512_setzero_ps(); 2];
        let (pr, px) = (row.as_ptr(), x.as_ptr());
        for b in 0..nb {
            let blk = pr.add(b * 34);
            _mm_prefetch::<_MM_HINT_T0>(blk.add(PREFETCH_AHEAD) as *const i8);
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                (blk as *const u16).read_unaligned() as i32,
            )));
            let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                blk.add(2) as *const __m128i
            )));
            let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                blk.add(18) as *const __m128i
            )));
            let xb = px.add(b * 32);
            let s = _mm512_fmadd_ps(
                q1,
                _mm512_loadu_ps(xb.add(16)),
                _mm512_mul_ps(q0, _mm512_loadu_ps(xb)),
            );
            let j = b & 1;
            acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(d), s, acc[j]);
        }
        _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;

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
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn nibbles(qs: *const u8) -> [__m256; 4] {
        let mask = _mm_set1_epi8(0x0f);
        let q = _mm_loadu_si128(qs as *const __m128i);
        let lo = _mm_and_si128(q, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))),
        ]
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn bytes_i8(qs: *const u8) -> [__m256; 4] {
        let a = _mm_loadu_si128(qs as *const __m128i);
        let b = _mm_loadu_si128(qs.add(16) as *const __m128i);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))),
        ]
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1(row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
        let nb = row.len() / 20;
        debug_assert!(x.len() >= nb * 32 && xsum.len() >= nb);
        let mut acc = _mm256_setzero_ps();
        let mut macc = 0f32;
        let (pr, px) = (row.as_ptr(), x.as_ptr());
        for b in 0..nb {
            let blk = pr.add(b * 20);
            _mm_prefetch::<_MM_HINT_T0>(blk.add(PREFETCH_AHEAD) as *const i8);
            let d = f16_load(blk);
            let m = f16_load(blk.add(2));
            let q = nibbles(blk.add(4));
            let xb = px.add(b * 32);
            let mut s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb.add(8)), s);
            s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb.add(16)), s);
            s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb.add(24)), s);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
            macc += m * *xsum.get_unchecked(b);
        }
        hsum(acc) + macc
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
        let nb = row.len() / 34;
        debug_assert!(x.len() >= nb * 32);
        let mut acc = _mm256_setzero_ps();
        let (pr, px) = (row.as_ptr(), x.as_ptr());
        for b in 0..nb {
            let blk = pr.add(b * 34);
            _mm_prefetch::<_MM_HINT_T0>(blk.add(PREFETCH_AHEAD) as *const i8);
            let d = f16_load(blk);
            let q = bytes_i8(blk.add(2));
            let xb = px.add(b * 32);
            let mut s = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
            s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb.add(8)), s);
            s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xb.add(16)), s);
            s = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb.add(24)), s);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dequant_q4_1(row: &[u8], out: &mut [f32]) {
        let nb = row.len() / 20;
        debug_assert!(out.len() >= nb * 32);
        let (pr, po) = (row.as_ptr(), out.as_mut_ptr());
        for b in 0..nb {
            let blk = pr.add(b * 20);
            let d = _mm256_set1_ps(f16_load(blk));
            let m = _mm256_set1_ps(f16_load(blk.add(2)));
            let q = nibbles(blk.add(4));
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
        let (pr, po) = (row.as_ptr(), out.as_mut_ptr());
        for b in 0..nb {
            let blk = pr.add(b * 34);
            let d = _mm256_set1_ps(f16_load(blk));
            let q = bytes_i8(blk.add(2));
            let o = po.add(b * 32);
            for (j, qj) in q.iter().enumerate() {
                _mm256_storeu_ps(o.add(8 * j), _mm256_mul_ps(*qj, d));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use tandem_model::quant::{quantize_q4_1, quantize_q8_0};

    fn rnd(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| r.gen_range(-1.0..1.0)).collect()
    }

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-4 * (1.0 + a.abs().max(b.abs()))
    }

    #[test]
    fn dot_and_axpy_match_scalar() {
        for n in [0, 1, 7, 8, 15, 16, 17, 64, 100] {
            let a = rnd(n, 1);
            let b = rnd(n, 2);
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!(close(dot_f32(&a, &b), want), "n={n}");
            assert!(close(dot_portable(&a, &b), want), "n={n}");
            let mut y = b.clone();
            axpy(0.5, &a, &mut y);
            for i in 0..n {
                assert!(close(y[i], b[i] + 0.5 * a[i]));
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
        let xs = block_sums(&x);
        let q41 = quantize_q4_1(&w);
        let q80 = quantize_q8_0(&w);
        let mut d41 = vec![0f32; k];
        dequantize(GgmlType::Q4_1, &q41, &mut d41).unwrap();
        let mut d80 = vec![0f32; k];
        dequantize(GgmlType::Q8_0, &q80, &mut d80).unwrap();
        let want41 = dot_portable(&d41, &x);
        let want80 = dot_portable(&d80, &x);
        let wantf = dot_portable(&w, &x);
        if has_avx2_fma() {
            // SAFETY: guarded by the feature check.
            unsafe {
                assert!(close(avx2::dot_q4_1(&q41, &x, &xs), want41));
                assert!(close(avx2::dot_q8_0(&q80, &x), want80));
                assert!(close(avx2::dot(&w, &x), wantf));
                let mut o = vec![0f32; k];
                avx2::dequant_q4_1(&q41, &mut o);
                assert!(o.iter().zip(&d41).all(|(a, b)| close(*a, *b)));
                avx2::dequant_q8_0(&q80, &mut o);
                assert!(o.iter().zip(&d80).all(|(a, b)| close(*a, *b)));
            }
        }
        if has_avx512() {
            // SAFETY: guarded by the feature check.
            unsafe {
                assert!(close(avx512::dot_q4_1(&q41, &x, &xs), want41));
                assert!(close(avx512::dot_q8_0(&q80, &x), want80));
                assert!(close(avx512::dot(&w, &x), wantf));
            }
        }
    }

    #[test]
    fn quantized_dots_match_dequantized_reference() {
        let k = 256;
        let w = rnd(k, 3);
        let x = rnd(k, 4);
        let xs = block_sums(&x);
        let mut scratch = vec![0f32; k];
        for (ty, q) in [
            (GgmlType::Q4_1, quantize_q4_1(&w)),
            (GgmlType::Q8_0, quantize_q8_0(&w)),
        ] {
            let mut deq = vec![0f32; k];
            dequantize(ty, &q, &mut deq).unwrap();
            let want: f32 = deq.iter().zip(&x).map(|(a, b)| a * b).sum();
            let got = dot_quant_row(ty, &q, &x, &xs, &mut scratch);
            assert!(close(got, want), "{ty}: {got} vs {want}");
            let mut fast = vec![0f32; k];
            dequant_row(ty, &q, &mut fast);
            for (a, b) in fast.iter().zip(&deq) {
                assert!(close(*a, *b), "{ty} dequant");
            }
        }
    }
}

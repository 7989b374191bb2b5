//! Portable kernels on the `wide` crate's 8-lane vectors: two NEON registers on aarch64 (with
//! fused multiply-adds), two SSE2 registers on x86-64 (a multiply and an add). The level every
//! CPU runs, and the one `TANDEM_ISA=scalar` picks on x86 to test it there.
//!
//! The same loop shapes as the AVX2 kernels (a register tile for the panel product, keys loaded
//! once for a tile of queries, value rows loaded once for a group of heads), so the compiler has
//! the same independent chains to schedule.

use half::slice::HalfFloatSliceExt;
use wide::{f32x8, i32x8};

use super::fmt::Fmt;
use super::KvValue;

#[inline(always)]
unsafe fn ld(p: *const f32) -> f32x8 {
    f32x8::new(std::ptr::read_unaligned(p as *const [f32; 8]))
}

#[inline(always)]
unsafe fn st(p: *mut f32, v: f32x8) {
    std::ptr::write_unaligned(p as *mut [f32; 8], v.to_array());
}

/// 8 cache values at `p` widened to f32 (exactly, for halves).
#[inline(always)]
unsafe fn ld_kv<T: KvValue>(p: *const T) -> f32x8 {
    if T::HALF {
        let v: [T; 8] = std::ptr::read_unaligned(p as *const [T; 8]);
        f32x8::new(v.map(T::to_f32))
    } else {
        ld(p as *const f32)
    }
}

/// The first `count` (≤ 8) cache values at `p`; other lanes zero and not read.
#[inline(always)]
unsafe fn ld_kv_part<T: KvValue>(p: *const T, count: usize) -> f32x8 {
    let mut buf = [0f32; 8];
    for (i, b) in buf.iter_mut().enumerate().take(count) {
        *b = (*p.add(i)).to_f32();
    }
    f32x8::new(buf)
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let (mut acc0, mut acc1) = (f32x8::ZERO, f32x8::ZERO);
    let mut i = 0;
    // SAFETY: every load is of 8 values at i + 8 ≤ n or i + 16 ≤ n.
    unsafe {
        while i + 16 <= n {
            acc0 = ld(pa.add(i)).mul_add(ld(pb.add(i)), acc0);
            acc1 = ld(pa.add(i + 8)).mul_add(ld(pb.add(i + 8)), acc1);
            i += 16;
        }
        if i + 8 <= n {
            acc0 = ld(pa.add(i)).mul_add(ld(pb.add(i)), acc0);
            i += 8;
        }
    }
    let mut s = (acc0 + acc1).reduce_add();
    for j in i..n {
        s += a[j] * b[j];
    }
    s
}

pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let av = f32x8::splat(alpha);
    let (px, py) = (x.as_ptr(), y.as_mut_ptr());
    let mut i = 0;
    // SAFETY: 8 values at i + 8 ≤ n of both.
    unsafe {
        while i + 8 <= n {
            st(py.add(i), av.mul_add(ld(px.add(i)), ld(py.add(i))));
            i += 8;
        }
    }
    for j in i..n {
        y[j] += alpha * x[j];
    }
}

/// See [`super::panel_product`] and the AVX2 `panel_tile`: `M` activation rows against `P`
/// panels, two 8-lane accumulators each.
///
/// # Safety
/// As [`super::panel_product`].
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
    let mut acc = [[[f32x8::ZERO; 2]; P]; M];
    // Outputs of vector h of panel p.
    let count = |p: usize, h: usize| cols.saturating_sub(16 * p + 8 * h).min(8);
    if cont {
        for (a, acc) in acc.iter_mut().enumerate() {
            for (p, c) in acc.iter_mut().enumerate() {
                for (h, c) in c.iter_mut().enumerate() {
                    let mut buf = [0f32; 8];
                    let at = out.add(a * ldo + 16 * p + 8 * h);
                    std::ptr::copy_nonoverlapping(at, buf.as_mut_ptr(), count(p, h));
                    *c = f32x8::new(buf);
                }
            }
        }
    }
    for t in 0..k {
        let mut wv = [[f32x8::ZERO; 2]; P];
        for (p, v) in wv.iter_mut().enumerate() {
            let at = w.add(p * ldp + 16 * t);
            prefetch(at.wrapping_add(16 * super::PANEL_AHEAD) as *const u8, 64);
            *v = [ld(at), ld(at.add(8))];
        }
        for (a, acc) in acc.iter_mut().enumerate() {
            let xv = f32x8::splat(*x.add(a * ldx + t));
            for (c, v) in acc.iter_mut().zip(&wv) {
                c[0] = xv.mul_add(v[0], c[0]);
                c[1] = xv.mul_add(v[1], c[1]);
            }
        }
    }
    for (a, acc) in acc.iter().enumerate() {
        for (p, c) in acc.iter().enumerate() {
            for (h, c) in c.iter().enumerate() {
                let at = out.add(a * ldo + 16 * p + 8 * h);
                std::ptr::copy_nonoverlapping(c.to_array().as_ptr(), at, count(p, h));
            }
        }
    }
}

/// See [`super::transpose_panel`]: columns `0..4` of 16 rows (`ld` apart) at `src` into 4
/// columns of 16 at `out`, 4 × 4 blocks at a time.
///
/// # Safety
/// Rows `j < 16` hold 4 values at `src + j·ld`; `out` has 64 writable values.
pub unsafe fn transpose4(src: *const f32, ld: usize, out: *mut f32) {
    use wide::f32x4;
    for g in 0..4 {
        let rows: [f32x4; 4] = std::array::from_fn(|r| {
            f32x4::new(std::ptr::read_unaligned(
                src.add((4 * g + r) * ld) as *const [f32; 4]
            ))
        });
        for (c, col) in f32x4::transpose(rows).iter().enumerate() {
            std::ptr::write_unaligned(out.add(16 * c + 4 * g) as *mut [f32; 4], col.to_array());
        }
    }
}

/// See the AVX2 `dot_keys_t`: `N` queries against `cols ≤ 16` transposed keys.
///
/// # Safety
/// `q` holds `N` rows of `d`; rows `i < d` of `kt` (at `kt + i·ld`) hold `cols` keys; `out` rows
/// `v < N` (at `out + v·ldo`) have `cols` writable slots.
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
    let full = cols == 16;
    let (c0, c1) = (cols.min(8), cols.saturating_sub(8));
    let mut a0 = [f32x8::ZERO; N];
    let mut a1 = [f32x8::ZERO; N];
    for i in 0..d {
        let row = kt.add(i * ld);
        let (k0, k1) = if full {
            (ld_kv(row), ld_kv(row.add(8)))
        } else {
            (ld_kv_part(row, c0), ld_kv_part(row.add(8), c1))
        };
        for v in 0..N {
            let qb = f32x8::splat(*q.add(v * d + i));
            a0[v] = qb.mul_add(k0, a0[v]);
            a1[v] = qb.mul_add(k1, a1[v]);
        }
    }
    let s = f32x8::splat(scale);
    for v in 0..N {
        let (lo, hi) = ((a0[v] * s).to_array(), (a1[v] * s).to_array());
        for (j, x) in lo.iter().chain(&hi).enumerate().take(cols) {
            *out.add(v * ldo + j) = *x;
        }
    }
}

/// See the AVX2 `axpy_rows_g`: `G` heads, `d` a multiple of 16.
///
/// # Safety
/// Each run holds whole rows of `d`; `p` holds `(G-1)·stride + n` probabilities for the `n`
/// rows of all the runs together.
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
        let mut a = [[f32x8::ZERO; 2]; G];
        for (h, ah) in a.iter_mut().enumerate().filter(|_| fin.is_none()) {
            ah[0] = ld(pa.add(h * d + c));
            ah[1] = ld(pa.add(h * d + c + 8));
        }
        let mut t0 = 0;
        for rows in runs {
            let (pr, n) = (rows.as_ptr(), super::rows_of(rows.len(), d));
            for t in 0..n {
                let r = pr.add(t * d + c);
                let (v0, v1) = (ld_kv(r), ld_kv(r.add(8)));
                for (h, ah) in a.iter_mut().enumerate() {
                    let w = f32x8::splat(*pp.add(h * stride + t0 + t));
                    ah[0] = w.mul_add(v0, ah[0]);
                    ah[1] = w.mul_add(v1, ah[1]);
                }
            }
            t0 += n;
        }
        for (h, ah) in a.iter().enumerate() {
            let Some(f) = fin else {
                st(pa.add(h * d + c), ah[0]);
                st(pa.add(h * d + c + 8), ah[1]);
                continue;
            };
            let inv = f32x8::splat(f.inv[h]);
            for (j, v) in ah.iter().enumerate() {
                st(f.out[h].add(c + 8 * j), *v * inv + f32x8::ZERO);
            }
        }
    }
}

pub fn max_f32(x: &[f32]) -> f32 {
    let mut chunks = x.chunks_exact(8);
    let mut m = f32x8::splat(f32::NEG_INFINITY);
    for c in &mut chunks {
        // `max` keeps the other operand where one is NaN, so NaNs are skipped.
        m = m.max(f32x8::new(c.try_into().expect("8 values")));
    }
    m.to_array()
        .iter()
        .chain(chunks.remainder())
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// `exp` of 8 lanes: the reduction and polynomial of the AVX kernels, `2^n` applied as two normal
/// powers of two (one rounding into the subnormal range, +∞ for a large `x`).
#[inline(always)]
fn exp8(x: f32x8) -> f32x8 {
    let x = x.max(f32x8::splat(-104.0)).min(f32x8::splat(100.0));
    let n = (x * f32x8::splat(std::f32::consts::LOG2_E)).round();
    let r = x - n * f32x8::splat(0.693_359_4);
    let r = r - n * f32x8::splat(-2.121_944_4e-4);
    let mut p = f32x8::splat(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        5e-1,
    ] {
        p = p.mul_add(r, f32x8::splat(c));
    }
    let e = (p * r).mul_add(r, r + f32x8::ONE);
    // (n is a whole number within [-150, 145]: its conversion is exact.)
    let ni = n.fast_round_int();
    let h = ni >> 1;
    let pow2 = |k: i32x8| -> f32x8 { bytemuck::cast((k + i32x8::splat(127)) << 23) };
    e * pow2(h) * pow2(ni - h)
}

/// `out[i] = silu(gate[i]) · up[i]` over `n` values; `out` may be `gate` (each vector is read
/// before it is written).
///
/// # Safety
/// `gate` and `up` are readable and `out` writable for `n` values.
pub unsafe fn silu_mul(gate: *const f32, up: *const f32, out: *mut f32, n: usize) {
    let silu = |v: f32x8, u: f32x8| v / (f32x8::ONE + exp8(-v)) * u;
    let n8 = n / 8 * 8;
    // SAFETY: 8 values at i < n8 of each (the caller's promise).
    unsafe {
        for i in (0..n8).step_by(8) {
            st(out.add(i), silu(ld(gate.add(i)), ld(up.add(i))));
        }
    }
    let rest = n - n8;
    if rest > 0 {
        let (mut g, mut u) = ([0f32; 8], [0f32; 8]);
        // SAFETY: `rest` values from n8 of each (the caller's promise); `g` and `u` are copies,
        // so `out` may be `gate`.
        unsafe {
            std::ptr::copy_nonoverlapping(gate.add(n8), g.as_mut_ptr(), rest);
            std::ptr::copy_nonoverlapping(up.add(n8), u.as_mut_ptr(), rest);
            let r = silu(f32x8::new(g), f32x8::new(u)).to_array();
            std::ptr::copy_nonoverlapping(r.as_ptr(), out.add(n8), rest);
        }
    }
}

pub fn exp_shifted_sum(x: &mut [f32], max: f32) -> f32 {
    let m = f32x8::splat(max);
    let mut acc = f32x8::ZERO;
    let mut chunks = x.chunks_exact_mut(8);
    for c in &mut chunks {
        let e = exp8(f32x8::new((&*c).try_into().expect("8 values")) - m);
        c.copy_from_slice(&e.to_array());
        acc += e;
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let mut buf = [f32::NEG_INFINITY; 8];
        buf[..rest.len()].copy_from_slice(rest);
        // exp(-∞ - max) is 0: the filler lanes add nothing. Into the same lanes as the whole
        // vectors, so a row's sum is the same bits with masked keys (zeros) after it or not.
        let e = exp8(f32x8::new(buf) - m);
        rest.copy_from_slice(&e.to_array()[..rest.len()]);
        acc += e;
    }
    acc.reduce_add()
}

/// See [`super::fma_burst`]: independent vector multiply-adds, as many as fit the registers.
pub fn fma_burst(rounds: usize) -> f32 {
    let mut acc = [f32x8::ONE; super::BURST_CHAINS_PORTABLE];
    let (b, c) = (f32x8::splat(0.999_999), f32x8::splat(1e-7));
    for _ in 0..rounds {
        for a in acc.iter_mut() {
            *a = a.mul_add(b, c);
        }
    }
    acc.iter().fold(f32x8::ZERO, |s, a| s + *a).reduce_add()
}

/// Sixteen f16 values at `p` as f32, converted in one call (F16C where the CPU has it,
/// whatever the level: one at a time, the conversion took a third of a one-row product here).
#[inline(always)]
fn halves16(p: &[u8]) -> [f32; 16] {
    let b: [u8; 32] = p[..32].try_into().expect("sixteen halves");
    let h: [half::f16; 16] =
        std::array::from_fn(|j| half::f16::from_le_bytes([b[2 * j], b[2 * j + 1]]));
    let mut f = [0f32; 16];
    h.convert_to_f32_slice(&mut f);
    f
}

/// See the AVX-512 `dequant_panel`: the same values (each exact but for one rounding, the same
/// fused or not), sixteen lanes of plain arithmetic that the compiler vectorizes.
///
/// # Safety
/// `panel` holds blocks `b0..b1` of a panel of format `F`, `out` their `(b1 − b0)·32·16` values.
pub unsafe fn dequant_panel<F: Fmt>(panel: *const u8, b0: usize, b1: usize, out: *mut f32) {
    let l = F::L;
    for b in b0..b1 {
        let (ho, so) = l.block(b);
        let head = std::slice::from_raw_parts(panel.add(ho), l.head);
        let sub = std::slice::from_raw_parts(panel.add(so), l.sub());
        prefetch(sub.as_ptr().wrapping_add(PREFETCH_AHEAD), l.sub());
        let o = std::slice::from_raw_parts_mut(out.add((b - b0) * 32 * 16), 32 * 16);
        let scales = |half: usize| -> ([f32; 16], [f32; 16]) {
            if !F::KQ {
                let m = if F::MIN {
                    halves16(&sub[32..])
                } else {
                    [0.0; 16]
                };
                return (halves16(sub), m);
            }
            let d = halves16(head);
            if F::HALVES {
                let s = std::array::from_fn(|j| d[j] * sub[16 * half + j] as i8 as f32);
                return (s, [0.0; 16]);
            }
            let dmin = halves16(&head[32..]);
            (
                std::array::from_fn(|j| d[j] * sub[j] as f32),
                std::array::from_fn(|j| dmin[j] * sub[16 + j] as f32),
            )
        };
        let (mut s, m) = scales(0);
        let codes = &sub[l.scales..];
        // Four columns at a time, each through its own instance of `column`, so every shift
        // and index is a constant and the compiler vectorizes the sixteen rows (with the
        // column a loop variable, it shifted byte by byte).
        for t4 in 0..8 {
            if F::HALVES && t4 == 4 {
                s = scales(1).0;
            }
            let o = &mut o[t4 * 64..(t4 + 1) * 64];
            column::<F, 0>(codes, t4, &s, &m, &mut o[..16]);
            column::<F, 1>(codes, t4, &s, &m, &mut o[16..32]);
            column::<F, 2>(codes, t4, &s, &m, &mut o[32..48]);
            column::<F, 3>(codes, t4, &s, &m, &mut o[48..]);
        }
    }
}

/// Column `t = 4·t4 + R` of a panel block's sixteen rows: its codes decoded and scaled, as the
/// AVX levels do (the scale's product exact, then one rounding for the minimum).
#[inline(always)]
fn column<F: Fmt, const R: usize>(
    codes: &[u8],
    t4: usize,
    s: &[f32; 16],
    m: &[f32; 16],
    o: &mut [f32],
) {
    let t = 4 * t4 + R;
    let q: [i32; 16] = std::array::from_fn(|j| {
        let q = match F::BITS {
            8 => codes[16 * t + j] as i8 as i32,
            bits => {
                let lo = (codes[16 * (t / 2) + j] >> (4 * (R % 2))) & 0x0f;
                let hi = match bits {
                    5 => (codes[256 + 2 * t + j / 8] >> (j % 8)) & 1,
                    6 => (codes[256 + 16 * t4 + j] >> (2 * R)) & 3,
                    _ => 0,
                };
                (lo | (hi << 4)) as i32
            }
        };
        q - F::OFFSET
    });
    for j in 0..16 {
        let f = q[j] as f32;
        o[j] = match (F::MIN, F::KQ) {
            (true, true) => f * s[j] - m[j],
            (true, false) => f * s[j] + m[j],
            _ => f * s[j],
        };
    }
}

/// How far ahead of the block being decoded its panel's stream is fetched (as the AVX levels).
const PREFETCH_AHEAD: usize = 16384;

/// A hint to fetch the `len` bytes at `p` into L1 (x86's SSE prefetch, part of every x86-64;
/// elsewhere the hardware's own prefetchers are left to it). Never dereferenced.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
fn prefetch(p: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for line in (0..len).step_by(64) {
        // SAFETY: a prefetch is a hint that never faults, whatever the address.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                p.wrapping_add(line) as *const i8,
            )
        }
    }
}

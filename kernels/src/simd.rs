//! Vector primitives with a runtime-selected AVX2/FMA path and a portable fallback.
//!
//! The quantized dot products keep activations in f32: a weight block is decoded to f32 lanes and
//! multiplied with the f32 activations. (llama.cpp instead rounds activations to 8 bits, which is
//! faster but no longer matches an f32 reference token for token.) Q4_1 uses
//! `Σ (d·q + m)·x = d·Σ q·x + m·Σ x` with the per-block `Σ x` computed once per activation row.
//!
//! Q4_1 and Q8_0 rows are kept in a *split* layout (see [`split_row`]): a row's block scales (and
//! Q4_1 mins) first, then its quants. Same bytes as GGML's interleaved blocks, but sixteen scales
//! convert with one instruction and the quants stream without gaps.

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

/// Whether the AVX-512 kernels can run here (F, BW and VL: every AVX-512 server CPU has all three).
#[inline]
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // Asked once per weight row by the batch-1 products: one load after the first call.
        static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *HAS.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && has_avx2_fma()
        })
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

/// `acc += Σ_t p[t] · rows[t]` for the `p.len()` rows of `rows` (each `acc.len()` long): a run of
/// value rows weighted by attention probabilities.
pub fn axpy_rows(p: &[f32], rows: &[f32], acc: &mut [f32]) {
    let d = acc.len();
    debug_assert_eq!(rows.len(), p.len() * d);
    #[cfg(target_arch = "x86_64")]
    if d.is_multiple_of(64) && has_avx512() {
        // SAFETY: as above.
        return unsafe { avx512::axpy_rows(p, rows, acc) };
    }
    for (&pt, r) in p.iter().zip(rows.chunks_exact(d)) {
        axpy(pt, r, acc);
    }
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
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        let mut v0 = 0;
        while v0 < nq {
            let take = [12, 8, 6, 4, 3, 2, 1]
                .into_iter()
                .find(|&t| t <= nq - v0)
                .expect("1 fits");
            for j0 in (0..n).step_by(16) {
                let cols = (n - j0).min(16);
                // SAFETY: the CPU supports the features. Rows `i < d` of `kt` hold `cols` keys
                // from `j0` (checked above; masked lanes are not read); `out` rows `v0..v0+take`
                // hold `cols` slots from `j0`.
                unsafe {
                    let (qp, kp, op) = (
                        q.as_ptr().add(v0 * d),
                        kt.as_ptr().add(j0),
                        out.as_mut_ptr().add(v0 * ldo + j0),
                    );
                    match take {
                        12 => avx512::dot_keys_t::<T, 12>(qp, d, kp, ld, cols, scale, op, ldo),
                        8 => avx512::dot_keys_t::<T, 8>(qp, d, kp, ld, cols, scale, op, ldo),
                        6 => avx512::dot_keys_t::<T, 6>(qp, d, kp, ld, cols, scale, op, ldo),
                        4 => avx512::dot_keys_t::<T, 4>(qp, d, kp, ld, cols, scale, op, ldo),
                        3 => avx512::dot_keys_t::<T, 3>(qp, d, kp, ld, cols, scale, op, ldo),
                        2 => avx512::dot_keys_t::<T, 2>(qp, d, kp, ld, cols, scale, op, ldo),
                        _ => avx512::dot_keys_t::<T, 1>(qp, d, kp, ld, cols, scale, op, ldo),
                    }
                }
            }
            v0 += take;
        }
        return;
    }
    dot_keys_t_portable(q, nq, kt, ld, n, scale, out, ldo);
}

/// [`dot_keys_t`] without SIMD.
#[allow(clippy::too_many_arguments)]
fn dot_keys_t_portable<T: KvValue>(
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
    debug_assert!(g == 0 || p.len() >= (g - 1) * stride + n);
    #[cfg(target_arch = "x86_64")]
    if d.is_multiple_of(64) && has_avx512() {
        // SAFETY: as above.
        unsafe {
            match g {
                1 => return avx512::axpy_rows_g::<T, 1>(p, stride, rows, acc),
                2 => return avx512::axpy_rows_g::<T, 2>(p, stride, rows, acc),
                3 => return avx512::axpy_rows_g::<T, 3>(p, stride, rows, acc),
                4 => return avx512::axpy_rows_g::<T, 4>(p, stride, rows, acc),
                5 => return avx512::axpy_rows_g::<T, 5>(p, stride, rows, acc),
                6 => return avx512::axpy_rows_g::<T, 6>(p, stride, rows, acc),
                _ => {}
            }
        }
    }
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

/// Activation rows per panel of [`panel_matmul`]: 32, or [`HALF_PANEL`] for products of at most
/// that many rows (a full panel would compute as many zero rows as real ones).
pub const PANEL: usize = 32;

/// The narrow panel width.
pub const HALF_PANEL: usize = 16;

/// Weight rows per call of [`panel_matmul`]'s register tile.
pub const PANEL_ROWS: usize = 8;

/// `out[j·ldo + r] = Σ_t w[r·k + t] · panel[t·width + j]` for weight rows `r < rows` (at most
/// [`PANEL_ROWS`]) and activation rows `j < cols` (at most `width`, [`PANEL`] or [`HALF_PANEL`]):
/// a few weight rows (row-major, as decoded) against a panel of activation rows stored k-major.
/// Each step loads one vector of the panel per 16 rows and broadcasts one weight per weight row:
/// 16 FMAs for 10 loads in a full panel, nothing reduced at the end. The activations are packed
/// once per matmul; the weights need no packing.
///
/// # Safety
/// `w` holds `rows` rows of `k`; `panel` holds `k × width`; `out` is valid for writes at
/// `j·ldo + r` for every `r < rows`, `j < cols`, and nothing else writes there meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn panel_matmul(
    w: *const f32,
    rows: usize,
    k: usize,
    panel: &[f32],
    width: usize,
    out: *mut f32,
    ldo: usize,
    cols: usize,
) {
    debug_assert!(width == PANEL || width == HALF_PANEL);
    debug_assert!(rows <= PANEL_ROWS && cols <= width && panel.len() >= k * width);
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        macro_rules! go {
            ($c:literal; $($r:literal)*) => {
                match rows {
                    $($r => return avx512::panel_kernel::<$r, $c>(w, k, panel.as_ptr(), out, ldo, cols),)*
                    _ => return,
                }
            };
        }
        if width == PANEL {
            go!(2; 1 2 3 4 5 6 7 8);
        } else {
            go!(1; 1 2 3 4 5 6 7 8);
        }
    }
    for r in 0..rows {
        for j in 0..cols {
            let mut acc = 0f32;
            for t in 0..k {
                acc += *w.add(r * k + t) * panel[t * width + j];
            }
            *out.add(j * ldo + r) = acc;
        }
    }
}

/// Packs activation rows `x` (m×k) into k-major panels of `width` rows (missing rows zero).
pub fn pack_panels(x: &[f32], m: usize, k: usize, width: usize) -> Vec<f32> {
    let mut packed = vec![0f32; m.div_ceil(width) * k * width];
    pack_panels_into(x, m, k, width, &mut packed);
    packed
}

/// [`pack_panels`] into `packed` (m.div_ceil(width)·k·width values), every element written.
/// Panels are packed in parallel; within one, 16 columns of every row at a time, so the 16 rows
/// of the panel being written stay in L1.
pub fn pack_panels_into(x: &[f32], m: usize, k: usize, width: usize, packed: &mut [f32]) {
    use rayon::prelude::*;
    let panels = m.div_ceil(width);
    assert_eq!(packed.len(), panels * k * width, "packed panel size");
    assert!(x.len() >= m * k, "activations hold m rows");
    packed
        .par_chunks_mut(k * width)
        .enumerate()
        .for_each(|(p, dst)| {
            let r0 = p * width;
            let rows = (m - r0).min(width);
            let src = &x[r0 * k..(r0 + rows) * k];
            for t0 in (0..k).step_by(16) {
                let tn = (k - t0).min(16);
                let block = &mut dst[t0 * width..(t0 + tn) * width];
                for (j, row) in src.chunks_exact(k).enumerate() {
                    for (i, &v) in row[t0..t0 + tn].iter().enumerate() {
                        block[i * width + j] = v;
                    }
                }
                if rows < width {
                    for line in block.chunks_exact_mut(width) {
                        line[rows..].fill(0.0);
                    }
                }
            }
        });
}

/// Most activation rows [`dot_quant_rows`] takes at once.
pub const MAX_FUSED_ROWS: usize = 8;

/// Whether [`dot_quant_rows`] has a kernel for `ty` on this machine.
pub fn has_fused_rows(ty: GgmlType) -> bool {
    is_split(ty) && has_avx512()
}

/// Dots of one quantized row with up to [`MAX_FUSED_ROWS`] activation rows (`x` is
/// `out.len()` rows of the row's length): each weight block is decoded once, in registers, and
/// used for every activation row. Only where [`has_fused_rows`]; otherwise (or with more rows)
/// it panics.
pub fn dot_quant_rows(ty: GgmlType, row: &[u8], x: &[f32], out: &mut [f32]) {
    assert!(
        has_fused_rows(ty) && out.len() <= MAX_FUSED_ROWS,
        "no fused {ty} kernel for {} rows",
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! rows {
            ($f:ident) => {
                // SAFETY: the CPU supports the features; `x` holds out.len() rows of the row's
                // length (checked by the debug assertion in the kernel).
                unsafe {
                    match out.len() {
                        1 => avx512::$f::<1>(row, x, out),
                        2 => avx512::$f::<2>(row, x, out),
                        3 => avx512::$f::<3>(row, x, out),
                        4 => avx512::$f::<4>(row, x, out),
                        5 => avx512::$f::<5>(row, x, out),
                        6 => avx512::$f::<6>(row, x, out),
                        7 => avx512::$f::<7>(row, x, out),
                        8 => avx512::$f::<8>(row, x, out),
                        _ => {}
                    }
                }
            };
        }
        match ty {
            GgmlType::Q4_1 => rows!(dot_q4_1_rows),
            GgmlType::Q8_0 => rows!(dot_q8_0_rows),
            _ => unreachable!("checked above"),
        }
    }
}

/// Runs `rounds` rounds of 16 independent vector FMAs held in registers on this thread and returns
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
        return rounds as u64 * 16 * 16;
    }
    let mut acc = [1f32; 16];
    for _ in 0..rounds {
        for a in acc.iter_mut() {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    std::hint::black_box(acc);
    rounds as u64 * 16 * 2
}

/// The largest value of `x` (`-∞` when empty; NaNs are skipped, as `f32::max` does).
pub fn max_f32(x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports the features.
        return unsafe { avx512::max_f32(x) };
    }
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `gate[i] = silu(gate[i]) · up[i]`, silu(v) = v / (1 + e^-v) (the vector `exp` is within 2 ulp).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul operands");
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports the features; both slices have gate.len() elements.
        return unsafe { avx512::silu_mul(gate, up) };
    }
    for (g, u) in gate.iter_mut().zip(up) {
        let v = *g;
        *g = v / (1.0 + (-v).exp()) * u;
    }
}

/// `x[i] = exp(x[i] - max)`, returning `Σ x[i]` (the softmax numerators and denominator).
pub fn exp_shifted_sum(x: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx512() {
        // SAFETY: the CPU supports the features.
        return unsafe { avx512::exp_shifted_sum(x, max) };
    }
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
}

/// Sums of each 32-element block of `x` (the `Σ x` term of the Q4_1 dot).
pub fn block_sums(x: &[f32]) -> Vec<f32> {
    x.chunks(32).map(|c| c.iter().sum()).collect()
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
mod avx512 {
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

    /// See [`super::panel_matmul`]; `R` weight rows, a panel of `16·C` activation rows.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn panel_kernel<const R: usize, const C: usize>(
        w: *const f32,
        k: usize,
        panel: *const f32,
        out: *mut f32,
        ldo: usize,
        cols: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); C]; R];
        for t in 0..k {
            let mut x = [_mm512_setzero_ps(); C];
            for (c, xc) in x.iter_mut().enumerate() {
                *xc = _mm512_loadu_ps(panel.add(t * 16 * C + 16 * c));
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let wb = _mm512_set1_ps(*w.add(r * k + t));
                for (ac, xc) in a.iter_mut().zip(&x) {
                    *ac = _mm512_fmadd_ps(wb, *xc, *ac);
                }
            }
        }
        let mut buf = [0f32; 32];
        for (r, a) in acc.iter().enumerate() {
            for (c, ac) in a.iter().enumerate() {
                _mm512_storeu_ps(buf.as_mut_ptr().add(16 * c), *ac);
            }
            for (j, v) in buf.iter().enumerate().take(cols) {
                *out.add(j * ldo + r) = *v;
            }
        }
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

    /// `d` is a multiple of 64: four accumulators stay in registers across all rows.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub unsafe fn axpy_rows(p: &[f32], rows: &[f32], acc: &mut [f32]) {
        let d = acc.len();
        let (pr, pa) = (rows.as_ptr(), acc.as_mut_ptr());
        for c in (0..d).step_by(64) {
            let mut a = [
                _mm512_loadu_ps(pa.add(c)),
                _mm512_loadu_ps(pa.add(c + 16)),
                _mm512_loadu_ps(pa.add(c + 32)),
                _mm512_loadu_ps(pa.add(c + 48)),
            ];
            for (t, &pt) in p.iter().enumerate() {
                let r = pr.add(t * d + c);
                let w = _mm512_set1_ps(pt);
                for (j, aj) in a.iter_mut().enumerate() {
                    *aj = _mm512_fmadd_ps(w, _mm512_loadu_ps(r.add(16 * j)), *aj);
                }
            }
            for (j, aj) in a.iter().enumerate() {
                _mm512_storeu_ps(pa.add(c + 16 * j), *aj);
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

    /// Split Q4_1 row: per 16 blocks, one conversion of the scales and mins and one FMA of the
    /// mins with the block sums of `x`; per block, one 16-byte load widened to 16 lanes whose low
    /// and high nibbles are elements 0-15 and 16-31.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_q4_1(row: &[u8], x: &[f32], xsum: &[f32]) -> f32 {
        let nb = row.len() / 20;
        debug_assert!(x.len() >= nb * 32 && xsum.len() >= nb);
        let (pd, pq, px) = (row.as_ptr(), row.as_ptr().add(4 * nb), x.as_ptr());
        // Unscaled q·x of block `b`.
        let block = |b: usize| -> __m512 {
            let qs = pq.add(b * 16);
            _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs as *const __m128i));
            let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f)));
            let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
            let xb = px.add(b * 32);
            _mm512_fmadd_ps(
                hi,
                _mm512_loadu_ps(xb.add(16)),
                _mm512_mul_ps(lo, _mm512_loadu_ps(xb)),
            )
        };
        // Two accumulators in registers, blocks taken in pairs: an accumulator picked by index
        // would live on the stack and chain every FMA through a store and a reload.
        let (mut a0, mut a1, mut macc) = (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
        let mut dbuf = [0f32; 16];
        let mut b0 = 0;
        while b0 < nb {
            let cnt = (nb - b0).min(16);
            _mm512_storeu_ps(dbuf.as_mut_ptr(), f16x16(pd.add(2 * b0), cnt));
            let m = f16x16(pd.add(2 * (nb + b0)), cnt);
            let mask: __mmask16 = ((1u32 << cnt) - 1) as u16;
            macc = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, xsum.as_ptr().add(b0)), macc);
            let mut i = 0;
            while i + 2 <= cnt {
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(dbuf[i]), block(b0 + i), a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(dbuf[i + 1]), block(b0 + i + 1), a1);
                i += 2;
            }
            if i < cnt {
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(dbuf[i]), block(b0 + i), a0);
            }
            b0 += cnt;
        }
        _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + _mm512_reduce_add_ps(macc)
    }

    /// [`dot_q4_1`] against `M` activation rows; two accumulators per row (low and high
    /// nibbles) keep the FMA chains short.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_q4_1_rows<const M: usize>(row: &[u8], x: &[f32], out: &mut [f32]) {
        let nb = row.len() / 20;
        let k = nb * 32;
        debug_assert!(x.len() >= M * k && out.len() >= M);
        let (pd, pq, px) = (row.as_ptr(), row.as_ptr().add(4 * nb), x.as_ptr());
        let low = _mm512_set1_epi32(0x0f);
        let mut acc = [[_mm512_setzero_ps(); 2]; M];
        let (mut dbuf, mut mbuf) = ([0f32; 16], [0f32; 16]);
        let mut b0 = 0;
        while b0 < nb {
            let cnt = (nb - b0).min(16);
            _mm512_storeu_ps(dbuf.as_mut_ptr(), f16x16(pd.add(2 * b0), cnt));
            _mm512_storeu_ps(mbuf.as_mut_ptr(), f16x16(pd.add(2 * (nb + b0)), cnt));
            for i in 0..cnt {
                let b = b0 + i;
                let qs = pq.add(b * 16);
                _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs as *const __m128i));
                let (d, m) = (_mm512_set1_ps(dbuf[i]), _mm512_set1_ps(mbuf[i]));
                let lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), d, m);
                let hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v)), d, m);
                for (j, a) in acc.iter_mut().enumerate() {
                    let xb = px.add(j * k + b * 32);
                    a[0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), a[0]);
                    a[1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb.add(16)), a[1]);
                }
            }
            b0 += cnt;
        }
        for (j, a) in acc.iter().enumerate() {
            out[j] = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
        }
    }

    /// [`dot_q8_0`] against `M` activation rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_rows<const M: usize>(row: &[u8], x: &[f32], out: &mut [f32]) {
        let nb = row.len() / 34;
        let k = nb * 32;
        debug_assert!(x.len() >= M * k && out.len() >= M);
        let (pd, pq, px) = (row.as_ptr(), row.as_ptr().add(2 * nb), x.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 2]; M];
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
                let w0 = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs as *const __m128i))),
                    d,
                );
                let w1 = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                        qs.add(16) as *const __m128i
                    ))),
                    d,
                );
                for (j, a) in acc.iter_mut().enumerate() {
                    let xb = px.add(j * k + b * 32);
                    a[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), a[0]);
                    a[1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb.add(16)), a[1]);
                }
            }
            b0 += cnt;
        }
        for (j, a) in acc.iter().enumerate() {
            out[j] = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
        }
    }

    /// Split Q8_0 row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_q8_0(row: &[u8], x: &[f32]) -> f32 {
        let nb = row.len() / 34;
        debug_assert!(x.len() >= nb * 32);
        let (pd, pq, px) = (row.as_ptr(), row.as_ptr().add(2 * nb), x.as_ptr());
        // Unscaled q·x of block `b`.
        let block = |b: usize| -> __m512 {
            let qs = pq.add(b * 32);
            _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
            let q0 =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs as *const __m128i)));
            let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                qs.add(16) as *const __m128i
            )));
            let xb = px.add(b * 32);
            _mm512_fmadd_ps(
                q1,
                _mm512_loadu_ps(xb.add(16)),
                _mm512_mul_ps(q0, _mm512_loadu_ps(xb)),
            )
        };
        // Blocks in pairs, two accumulators in registers (see `dot_q4_1`).
        let (mut a0, mut a1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut dbuf = [0f32; 16];
        let mut b0 = 0;
        while b0 < nb {
            let cnt = (nb - b0).min(16);
            _mm512_storeu_ps(dbuf.as_mut_ptr(), f16x16(pd.add(2 * b0), cnt));
            let mut i = 0;
            while i + 2 <= cnt {
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(dbuf[i]), block(b0 + i), a0);
                a1 = _mm512_fmadd_ps(_mm512_set1_ps(dbuf[i + 1]), block(b0 + i + 1), a1);
                i += 2;
            }
            if i < cnt {
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(dbuf[i]), block(b0 + i), a0);
            }
            b0 += cnt;
        }
        _mm512_reduce_add_ps(_mm512_add_ps(a0, a1))
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
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;

    /// See [`super::fma_burst`].
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_burst(rounds: usize) -> f32 {
        let mut acc = [_mm256_set1_ps(1.0); 16];
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
        let (pd, pq, px) = (row.as_ptr(), row.as_ptr().add(4 * nb), x.as_ptr());
        for b in 0..nb {
            let qs = pq.add(b * 16);
            _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
            let d = f16_load(pd.add(2 * b));
            let m = f16_load(pd.add(2 * (nb + b)));
            let q = nibbles(qs);
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
        let (pd, pq, px) = (row.as_ptr(), row.as_ptr().add(2 * nb), x.as_ptr());
        for b in 0..nb {
            let qs = pq.add(b * 32);
            _mm_prefetch::<_MM_HINT_T0>(qs.add(PREFETCH_AHEAD) as *const i8);
            let d = f16_load(pd.add(2 * b));
            let q = bytes_i8(qs);
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
        let (pd, pq, po) = (row.as_ptr(), row.as_ptr().add(4 * nb), out.as_mut_ptr());
        for b in 0..nb {
            let d = _mm256_set1_ps(f16_load(pd.add(2 * b)));
            let m = _mm256_set1_ps(f16_load(pd.add(2 * (nb + b))));
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
            let q = bytes_i8(pq.add(b * 32));
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

    #[test]
    fn fused_multi_row_dots_match_dequantized() {
        let k = 576;
        let w = rnd(k, 40);
        for (ty, g) in [
            (GgmlType::Q4_1, quantize_q4_1(&w)),
            (GgmlType::Q8_0, quantize_q8_0(&w)),
        ] {
            let mut deq = vec![0f32; k];
            dequantize(ty, &g, &mut deq).unwrap();
            let q = split(ty, &g);
            for m in 1..=MAX_FUSED_ROWS {
                let x = rnd(m * k, 41 + m as u64);
                let mut out = vec![0f32; m];
                if !has_fused_rows(ty) {
                    continue;
                }
                dot_quant_rows(ty, &q, &x, &mut out);
                for j in 0..m {
                    let want = dot_portable(&deq, &x[j * k..(j + 1) * k]);
                    assert!(
                        close(out[j], want),
                        "{ty} m={m} j={j}: {} vs {want}",
                        out[j]
                    );
                }
            }
        }
    }

    #[test]
    fn panel_matmul_matches_dots() {
        for k in [1, 7, 64, 576] {
            for rows in 1..=PANEL_ROWS {
                for (cols, width) in [
                    (1, HALF_PANEL),
                    (15, HALF_PANEL),
                    (16, HALF_PANEL),
                    (1, PANEL),
                    (15, PANEL),
                    (16, PANEL),
                    (17, PANEL),
                    (32, PANEL),
                ] {
                    let w = rnd(rows * k, 50 + rows as u64);
                    let x = rnd(cols * k, 60 + cols as u64);
                    let panel = pack_panels(&x, cols, k, width);
                    let ldo = 10;
                    let mut out = vec![f32::NAN; PANEL * ldo];
                    // SAFETY: w is rows×k, panel k×width, out covers 32 rows of ldo ≥ rows.
                    unsafe {
                        panel_matmul(
                            w.as_ptr(),
                            rows,
                            k,
                            &panel,
                            width,
                            out.as_mut_ptr(),
                            ldo,
                            cols,
                        )
                    };
                    for j in 0..PANEL {
                        for r in 0..ldo {
                            let got = out[j * ldo + r];
                            if j < cols && r < rows {
                                let want =
                                    dot_portable(&w[r * k..(r + 1) * k], &x[j * k..(j + 1) * k]);
                                assert!(
                                    close(got, want),
                                    "k={k} rows={rows} cols={cols} width={width}"
                                );
                            } else {
                                assert!(got.is_nan(), "wrote outside the tile");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn packing_into_a_used_buffer_zeroes_the_missing_rows() {
        // k below, at and across the 16-column blocks the packing works in.
        let shapes = [(5, HALF_PANEL), (16, HALF_PANEL), (33, PANEL), (64, PANEL)];
        for ((m, width), k) in shapes
            .into_iter()
            .flat_map(|s| [7, 16, 37, 96].map(|k| (s, k)))
        {
            let x = rnd(m * k, m as u64);
            let mut buf = vec![f32::NAN; m.div_ceil(width) * k * width];
            pack_panels_into(&x, m, k, width, &mut buf);
            for (i, v) in buf.iter().enumerate() {
                let (p, t, j) = (i / (k * width), i % (k * width) / width, i % width);
                let row = p * width + j;
                let want = if row < m { x[row * k + t] } else { 0.0 };
                assert_eq!(*v, want, "m={m} k={k} width={width} panel {p} t {t} j {j}");
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
                    dot_keys_t_portable(&q, nq, &kt, ld, n, 0.25, &mut portable, ldo);
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
                let mut o = vec![0f32; k];
                avx512::dequant_q4_1(&q41, &mut o);
                assert!(o.iter().zip(&d41).all(|(a, b)| close(*a, *b)));
                avx512::dequant_q8_0(&q80, &mut o);
                assert!(o.iter().zip(&d80).all(|(a, b)| close(*a, *b)));
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
        for (ty, g) in [
            (GgmlType::Q4_1, quantize_q4_1(&w)),
            (GgmlType::Q8_0, quantize_q8_0(&w)),
        ] {
            let mut deq = vec![0f32; k];
            dequantize(ty, &g, &mut deq).unwrap();
            let q = split(ty, &g);
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

//! The kernels' panel formats: every quantized GGML type in panels of sixteen rows.
//!
//! A panel holds sixteen weight rows (the last panel of a matrix padded with zero rows). Its
//! columns run in *super-blocks*: 32 columns for the block types (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0), 256 for the k-quants (Q4_K, Q5_K, Q6_K), one after another. A super-block is a head
//! (the k-quants' f16 super-block scale `d`, and `dmin` where the type has minimums, sixteen of
//! each, one a row) and then sub-blocks of 32 columns, each:
//!
//! - its scales, sixteen of each, one a row: the f16 scale (and f16 minimum) of a block type;
//!   the 6-bit integer scale and minimum of a Q4_K/Q5_K sub-block; Q6_K's two signed 8-bit
//!   scales (one for columns 0-15, one for 16-31);
//! - its codes, unsigned integers (signed bytes for Q8_0): for each pair of columns
//!   `(2c, 2c+1)`, sixteen bytes, row `j`'s low four bits of column `2c` in the low nibble and
//!   of `2c+1` in the high one (512 bytes of whole bytes for Q8_0, sixteen a column); then, for
//!   5-bit codes, their fifth bits: for each column a little-endian 16-bit mask, bit `j` row
//!   `j`'s (AVX-512 ORs it in under that mask, loaded as it is); for 6-bit codes, their top two
//!   bits: for each four columns sixteen bytes, bits `2i, 2i+1` of row `j`'s byte those of
//!   column `4g+i`.
//!
//! So a column's sixteen weights widen into one 16-lane vector (two of 8 lanes), lane `j` row
//! `j`, and every type costs what its GGML blocks cost, to a byte per row per super-block.
//!
//! A weight's value is GGML's (its own decoder, `tandem_model::dequantize`): `(q − o)·d` (Q4_0,
//! Q5_0 with `o` = 8, 16; Q8_0), `q·d + m` (Q4_1, Q5_1), `(d·sc)·q − dmin·mn` (Q4_K, Q5_K),
//! `(d·sc)·(q − 32)` (Q6_K). Each product is exact in f32 (at most 24 significant bits), so at
//! most one rounding is left, and fused or not gives the same bits. The vector levels take an
//! offset as `q·s − o·s` in one fused multiply-add, the same value exactly, but for the sign of
//! a zero (`+0` where GGML may give `−0`), which no product sees: each output's chain starts
//! from `+0`, and an exact zero added to it leaves `+0`.

use tandem_model::GgmlType;

/// Where a format's bytes lie in a super-block of a panel (see the module's description).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// 32-column sub-blocks in a super-block: 1, or 8 for the k-quants.
    pub subs: usize,
    /// Bytes of the super-block's head (the k-quants' `d` and `dmin`).
    pub head: usize,
    /// Bytes of a sub-block's scales (before its codes).
    pub scales: usize,
    /// Bytes of a sub-block's codes.
    pub codes: usize,
}

impl Layout {
    const fn new(bits: u32, min: bool, kq: bool) -> Self {
        let two = if min { 64 } else { 32 };
        Self {
            subs: if kq { 8 } else { 1 },
            head: if kq { two } else { 0 },
            // Q4_K/Q5_K: 16 scales and 16 minimums of a byte; Q6_K: two 16-byte scale rows.
            scales: if kq { 32 } else { two },
            codes: match bits {
                4 => 256,
                5 => 320,
                6 => 384,
                _ => 512,
            },
        }
    }

    /// Bytes of one sub-block (scales and codes).
    pub const fn sub(&self) -> usize {
        self.scales + self.codes
    }

    /// Bytes of one super-block.
    pub const fn super_block(&self) -> usize {
        self.head + self.subs * self.sub()
    }

    /// Columns of one super-block.
    pub const fn cols(&self) -> usize {
        32 * self.subs
    }

    /// Bytes of one panel of `cols` columns.
    pub fn panel(&self, cols: usize) -> usize {
        cols / self.cols() * self.super_block()
    }

    /// Offsets in a panel of the head of the super-block that 32-column block `b` is in, and of
    /// that block's sub-block.
    #[inline(always)]
    pub fn block(&self, b: usize) -> (usize, usize) {
        let h = b / self.subs * self.super_block();
        (h, h + self.head + b % self.subs * self.sub())
    }
}

/// A panel format, for the kernels (one type per GGML type, all resolved at compile time).
pub trait Fmt {
    /// Bits of a code: 4, 5, 6 or 8 (Q8_0's signed bytes).
    const BITS: u32;
    /// What is taken from a code before it is scaled.
    const OFFSET: i32;
    /// A minimum: added (block types, `q·d + m`) or subtracted (k-quants, `q·s − dmin·mn`).
    const MIN: bool;
    /// A k-quant: super-blocks of 256, integer sub-block scales times an f16 `d`.
    const KQ: bool;
    /// Q6_K: a signed scale for each sixteen columns (and no minimum).
    const HALVES: bool = false;
    /// Where its bytes lie.
    const L: Layout = Layout::new(Self::BITS, Self::MIN, Self::KQ);
}

macro_rules! fmt {
    ($name:ident, $bits:literal, $off:literal, $min:literal, $kq:literal $(, $halves:literal)?) => {
        #[doc = concat!("GGML `", stringify!($name), "` in panels.")]
        pub struct $name;
        impl Fmt for $name {
            const BITS: u32 = $bits;
            const OFFSET: i32 = $off;
            const MIN: bool = $min;
            const KQ: bool = $kq;
            $(const HALVES: bool = $halves;)?
        }
    };
}

fmt!(Q4_0, 4, 8, false, false);
fmt!(Q4_1, 4, 0, true, false);
fmt!(Q5_0, 5, 16, false, false);
fmt!(Q5_1, 5, 0, true, false);
fmt!(Q8_0, 8, 0, false, false);
fmt!(Q4K, 4, 0, true, true);
fmt!(Q5K, 5, 0, true, true);
fmt!(Q6K, 6, 32, false, true, true);

/// Runs `$body` with `$f` the panel format of `$ty` (a quantized type).
macro_rules! with_fmt {
    ($ty:expr, $f:ident => $body:expr) => {{
        use $crate::simd::fmt as pf;
        match $ty {
            GgmlType::Q4_0 => {
                type $f = pf::Q4_0;
                $body
            }
            GgmlType::Q4_1 => {
                type $f = pf::Q4_1;
                $body
            }
            GgmlType::Q5_0 => {
                type $f = pf::Q5_0;
                $body
            }
            GgmlType::Q5_1 => {
                type $f = pf::Q5_1;
                $body
            }
            GgmlType::Q8_0 => {
                type $f = pf::Q8_0;
                $body
            }
            GgmlType::Q4K => {
                type $f = pf::Q4K;
                $body
            }
            GgmlType::Q5K => {
                type $f = pf::Q5K;
                $body
            }
            GgmlType::Q6K => {
                type $f = pf::Q6K;
                $body
            }
            other => unreachable!("{other} has no panel format"),
        }
    }};
}
pub(crate) use with_fmt;

/// The panel layout of `ty`, where it has one (every quantized type).
pub fn layout(ty: GgmlType) -> Option<Layout> {
    ty.is_quantized().then(|| with_fmt!(ty, F => F::L))
}

/// One row's super-block, unpacked: what GGML's block and a panel's bytes both encode.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Unit {
    /// `d` (f16 bits).
    d: u16,
    /// The block types' minimum or the k-quants' `dmin` (f16 bits).
    m: u16,
    /// Sub-block scales: 8 (Q4_K, Q5_K) or 16 (Q6_K, signed) of them.
    sc: [u8; 16],
    /// Sub-block minimums (Q4_K, Q5_K).
    mn: [u8; 8],
    /// The codes, in GGML's element order (Q8_0's as the bytes of signed values).
    q: [u8; 256],
}

impl Unit {
    fn zero() -> Self {
        Self {
            d: 0,
            m: 0,
            sc: [0; 16],
            mn: [0; 8],
            q: [0; 256],
        }
    }
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// GGML's block `b` of `ty` unpacked.
fn from_ggml(ty: GgmlType, b: &[u8]) -> Unit {
    let mut u = Unit::zero();
    u.d = u16_at(b, 0);
    let nibbles = |u: &mut Unit, qs: &[u8]| {
        for (j, &x) in qs[..16].iter().enumerate() {
            u.q[j] = x & 0x0f;
            u.q[j + 16] = x >> 4;
        }
    };
    let fifth = |u: &mut Unit, qh: u32| {
        for j in 0..32 {
            u.q[j] |= (((qh >> j) & 1) << 4) as u8;
        }
    };
    match ty {
        GgmlType::Q4_0 => nibbles(&mut u, &b[2..18]),
        GgmlType::Q4_1 => {
            u.m = u16_at(b, 2);
            nibbles(&mut u, &b[4..20]);
        }
        GgmlType::Q5_0 => {
            nibbles(&mut u, &b[6..22]);
            fifth(&mut u, u32::from_le_bytes([b[2], b[3], b[4], b[5]]));
        }
        GgmlType::Q5_1 => {
            u.m = u16_at(b, 2);
            nibbles(&mut u, &b[8..24]);
            fifth(&mut u, u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
        }
        GgmlType::Q8_0 => u.q[..32].copy_from_slice(&b[2..34]),
        GgmlType::Q4K | GgmlType::Q5K => {
            u.m = u16_at(b, 2);
            let s = &b[4..16];
            for j in 0..8 {
                (u.sc[j], u.mn[j]) = if j < 4 {
                    (s[j] & 63, s[j + 4] & 63)
                } else {
                    (
                        (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
                        (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                    )
                };
            }
            let (qh, qs) = if ty == GgmlType::Q4K {
                (None, &b[16..144])
            } else {
                (Some(&b[16..48]), &b[48..176])
            };
            for step in 0..4 {
                for l in 0..32 {
                    let x = qs[32 * step + l];
                    let (h0, h1) = qh.map_or((0, 0), |h| {
                        (
                            ((h[l] >> (2 * step)) & 1) << 4,
                            ((h[l] >> (2 * step + 1)) & 1) << 4,
                        )
                    });
                    u.q[64 * step + l] = (x & 0x0f) | h0;
                    u.q[64 * step + 32 + l] = (x >> 4) | h1;
                }
            }
        }
        GgmlType::Q6K => {
            u.d = u16_at(b, 208);
            u.sc.copy_from_slice(&b[192..208]);
            for n in 0..2 {
                let (ql, qh) = (&b[64 * n..64 * n + 64], &b[128 + 32 * n..160 + 32 * n]);
                let q = &mut u.q[128 * n..128 * n + 128];
                for l in 0..32 {
                    q[l] = (ql[l] & 0x0f) | ((qh[l] & 3) << 4);
                    q[l + 32] = (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4);
                    q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                    q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                }
            }
        }
        other => unreachable!("{other} is not a block type"),
    }
    u
}

/// `u` as GGML's block of `ty` in `b`.
fn to_ggml(ty: GgmlType, u: &Unit, b: &mut [u8]) {
    b[..2].copy_from_slice(&u.d.to_le_bytes());
    let nibbles = |qs: &mut [u8]| {
        for (j, x) in qs[..16].iter_mut().enumerate() {
            *x = (u.q[j] & 0x0f) | (u.q[j + 16] << 4);
        }
    };
    let fifth = || (0..32).fold(0u32, |h, j| h | ((((u.q[j] >> 4) & 1) as u32) << j));
    match ty {
        GgmlType::Q4_0 => nibbles(&mut b[2..18]),
        GgmlType::Q4_1 => {
            b[2..4].copy_from_slice(&u.m.to_le_bytes());
            nibbles(&mut b[4..20]);
        }
        GgmlType::Q5_0 => {
            b[2..6].copy_from_slice(&fifth().to_le_bytes());
            nibbles(&mut b[6..22]);
        }
        GgmlType::Q5_1 => {
            b[2..4].copy_from_slice(&u.m.to_le_bytes());
            b[4..8].copy_from_slice(&fifth().to_le_bytes());
            nibbles(&mut b[8..24]);
        }
        GgmlType::Q8_0 => b[2..34].copy_from_slice(&u.q[..32]),
        GgmlType::Q4K | GgmlType::Q5K => {
            b[2..4].copy_from_slice(&u.m.to_le_bytes());
            let s = &mut b[4..16];
            for j in 0..4 {
                s[j] = u.sc[j] | ((u.sc[j + 4] >> 4) << 6);
                s[j + 4] = u.mn[j] | ((u.mn[j + 4] >> 4) << 6);
                s[j + 8] = (u.sc[j + 4] & 0x0f) | ((u.mn[j + 4] & 0x0f) << 4);
            }
            let at = if ty == GgmlType::Q4K { 16 } else { 48 };
            for step in 0..4 {
                for l in 0..32 {
                    let (a, c) = (u.q[64 * step + l], u.q[64 * step + 32 + l]);
                    b[at + 32 * step + l] = (a & 0x0f) | (c << 4);
                    if ty == GgmlType::Q5K {
                        let h = (((a >> 4) & 1) << (2 * step)) | (((c >> 4) & 1) << (2 * step + 1));
                        if step == 0 {
                            b[16 + l] = 0;
                        }
                        b[16 + l] |= h;
                    }
                }
            }
        }
        GgmlType::Q6K => {
            b[208..210].copy_from_slice(&u.d.to_le_bytes());
            b[192..208].copy_from_slice(&u.sc);
            for n in 0..2 {
                let q = &u.q[128 * n..128 * n + 128];
                for l in 0..32 {
                    b[64 * n + l] = (q[l] & 0x0f) | (q[l + 64] << 4);
                    b[64 * n + l + 32] = (q[l + 32] & 0x0f) | (q[l + 96] << 4);
                    b[128 + 32 * n + l] = (q[l] >> 4)
                        | ((q[l + 32] >> 4) << 2)
                        | ((q[l + 64] >> 4) << 4)
                        | ((q[l + 96] >> 4) << 6);
                }
            }
        }
        other => unreachable!("{other} is not a block type"),
    }
}

/// Row `j`'s unit `u` written into super-block `sb` (its bytes) of a panel of `ty`.
fn put(ty: GgmlType, l: &Layout, u: &Unit, j: usize, sb: &mut [u8]) {
    let kq = l.subs > 1;
    let (min, bits) = with_fmt!(ty, F => (F::MIN, F::BITS));
    let h16 = |b: &mut [u8], at: usize, v: u16| {
        b[at + 2 * j..at + 2 * j + 2].copy_from_slice(&v.to_le_bytes())
    };
    if kq {
        h16(sb, 0, u.d);
        if min {
            h16(sb, 32, u.m);
        }
    }
    for s in 0..l.subs {
        let sub = &mut sb[l.head + s * l.sub()..l.head + (s + 1) * l.sub()];
        if !kq {
            h16(sub, 0, u.d);
            if min {
                h16(sub, 32, u.m);
            }
        } else if ty == GgmlType::Q6K {
            sub[j] = u.sc[2 * s];
            sub[16 + j] = u.sc[2 * s + 1];
        } else {
            sub[j] = u.sc[s];
            sub[16 + j] = u.mn[s];
        }
        let codes = &mut sub[l.scales..];
        let q = &u.q[32 * s..32 * s + 32];
        for t in 0..32 {
            if bits == 8 {
                codes[16 * t + j] = q[t];
                continue;
            }
            let nib = &mut codes[16 * (t / 2) + j];
            if t % 2 == 0 {
                *nib = (*nib & 0xf0) | (q[t] & 0x0f);
            } else {
                *nib = (*nib & 0x0f) | ((q[t] & 0x0f) << 4);
            }
            if bits == 5 {
                let b = &mut codes[256 + 2 * t + j / 8];
                *b = (*b & !(1 << (j % 8))) | (((q[t] >> 4) & 1) << (j % 8));
            } else if bits == 6 {
                let b = &mut codes[256 + 16 * (t / 4) + j];
                let at = 2 * (t % 4);
                *b = (*b & !(3 << at)) | (((q[t] >> 4) & 3) << at);
            }
        }
    }
}

/// Row `j`'s unit read from super-block `sb` of a panel of `ty`.
fn get(ty: GgmlType, l: &Layout, j: usize, sb: &[u8]) -> Unit {
    let kq = l.subs > 1;
    let (min, bits) = with_fmt!(ty, F => (F::MIN, F::BITS));
    let mut u = Unit::zero();
    if kq {
        u.d = u16_at(sb, 2 * j);
        if min {
            u.m = u16_at(sb, 32 + 2 * j);
        }
    }
    for s in 0..l.subs {
        let sub = &sb[l.head + s * l.sub()..l.head + (s + 1) * l.sub()];
        if !kq {
            u.d = u16_at(sub, 2 * j);
            if min {
                u.m = u16_at(sub, 32 + 2 * j);
            }
        } else if ty == GgmlType::Q6K {
            u.sc[2 * s] = sub[j];
            u.sc[2 * s + 1] = sub[16 + j];
        } else {
            u.sc[s] = sub[j];
            u.mn[s] = sub[16 + j];
        }
        let codes = &sub[l.scales..];
        for t in 0..32 {
            u.q[32 * s + t] = match bits {
                8 => codes[16 * t + j],
                _ => {
                    let lo = (codes[16 * (t / 2) + j] >> (4 * (t % 2))) & 0x0f;
                    let hi = match bits {
                        5 => (codes[256 + 2 * t + j / 8] >> (j % 8)) & 1,
                        6 => (codes[256 + 16 * (t / 4) + j] >> (2 * (t % 4))) & 3,
                        _ => 0,
                    };
                    lo | (hi << 4)
                }
            };
        }
    }
    u
}

/// GGML rows (`rows` of `cols` values of `ty`) in panels: rows in groups of sixteen (the last
/// padded with zero rows, which decode to zeros), each group's super-blocks one after another.
pub fn to_panels(ty: GgmlType, ggml: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let l = layout(ty).expect("a quantized type");
    let (gb, rb) = (ty.block_bytes(), ty.bytes_for(cols).expect("whole blocks"));
    let (nsb, pl) = (cols / l.cols(), l.panel(cols));
    let mut out = vec![0u8; rows.div_ceil(16) * pl];
    for r in 0..rows {
        let (p, j) = (r / 16, r % 16);
        for s in 0..nsb {
            let u = from_ggml(ty, &ggml[r * rb + s * gb..r * rb + (s + 1) * gb]);
            let at = p * pl + s * l.super_block();
            put(ty, &l, &u, j, &mut out[at..at + l.super_block()]);
        }
    }
    out
}

/// Row `r` of panels of `ty` (`rows` rows of `cols` values) back in GGML's bytes.
pub fn panel_row_ggml(ty: GgmlType, data: &[u8], cols: usize, r: usize, out: &mut [u8]) {
    let l = layout(ty).expect("a quantized type");
    let (gb, pl) = (ty.block_bytes(), l.panel(cols));
    for s in 0..cols / l.cols() {
        let at = r / 16 * pl + s * l.super_block();
        let u = get(ty, &l, r % 16, &data[at..at + l.super_block()]);
        to_ggml(ty, &u, &mut out[s * gb..(s + 1) * gb]);
    }
}

/// Row `r` of panels of `ty` decoded into `out` (`cols` values): GGML's decoder on its bytes.
pub fn dequant_panel_row(ty: GgmlType, data: &[u8], cols: usize, r: usize, out: &mut [f32]) {
    let l = layout(ty).expect("a quantized type");
    let gb = ty.block_bytes();
    let mut ggml = vec![0u8; gb];
    let pl = l.panel(cols);
    for (s, o) in out[..cols].chunks_exact_mut(l.cols()).enumerate() {
        let at = r / 16 * pl + s * l.super_block();
        let u = get(ty, &l, r % 16, &data[at..at + l.super_block()]);
        to_ggml(ty, &u, &mut ggml);
        tandem_model::dequantize(ty, &ggml, o).expect("one whole block");
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random GGML blocks of `ty` for `n` values: every bit pattern of the codes, scales and
    /// minimums, with finite f16 scales of either sign in [2^-10, 2).
    pub(crate) fn random_ggml(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let bb = ty.block_bytes();
        let mut out = Vec::with_capacity(n / ty.block_elems() * bb);
        for _ in 0..n / ty.block_elems() {
            let mut b: Vec<u8> = (0..bb).map(|_| r.gen()).collect();
            let mut f16 = |at: usize| {
                let mag = r.gen_range(1e-3f32..2.0);
                let v = if r.gen() { mag } else { -mag };
                b[at..at + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            };
            match ty {
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => {
                    f16(0);
                    f16(2);
                }
                GgmlType::Q6K => f16(208),
                _ => f16(0),
            }
            out.extend(b);
        }
        out
    }

    pub(crate) const TYPES: [GgmlType; 8] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// Every type's panels hold exactly GGML's bytes (back out unchanged) and its rows decode to
    /// exactly what GGML's decoder gives; each type costs its GGML bytes (the k-quants' eight
    /// 6-bit scales and minimums take a byte each: four more a row per 256 columns).
    #[test]
    fn panels_keep_every_bit_of_every_type() {
        let (n, k) = (37, 512);
        for ty in TYPES {
            let ggml = random_ggml(ty, n * k, ty as u64);
            let panels = to_panels(ty, &ggml, n, k);
            let l = layout(ty).unwrap();
            assert_eq!(panels.len(), n.div_ceil(16) * l.panel(k));
            let per_row = l.super_block() as f64 / 16.0 / ty.block_bytes() as f64;
            let slack = if l.subs > 1 { 4.0 } else { 0.0 } / ty.block_bytes() as f64;
            assert!(
                per_row <= 1.0 + slack + 1e-9,
                "{ty}: {per_row}× GGML's bytes"
            );
            let rb = ty.bytes_for(k).unwrap();
            let mut want = vec![0f32; n * k];
            tandem_model::dequantize(ty, &ggml, &mut want).unwrap();
            let (mut back, mut row) = (vec![0u8; rb], vec![f32::NAN; k]);
            for r in 0..n {
                panel_row_ggml(ty, &panels, k, r, &mut back);
                assert_eq!(back, ggml[r * rb..(r + 1) * rb], "{ty} row {r} bytes");
                dequant_panel_row(ty, &panels, k, r, &mut row);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&row), bits(&want[r * k..(r + 1) * k]), "{ty} row {r}");
            }
        }
    }
}

//! GGML tensor types and their block layouts, with dequantization to f32.
//!
//! Layouts follow ggml's `ggml-common.h`: a quantized row is a sequence of blocks, each holding its
//! own scale (and minimum) in f16 followed by packed integers. Rows are always whole blocks, so a
//! row can be moved (for example un-permuted) without decoding it.

use half::{bf16, f16};

use crate::ModelError;

/// Number of weights in a k-quant super-block.
pub const QK_K: usize = 256;

/// A GGML tensor element type, with the numeric ids used in GGUF files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float, 4 bytes an element.
    F32,
    /// IEEE half float, 2 bytes an element.
    F16,
    /// bfloat16, 2 bytes an element.
    BF16,
    /// 4-bit quants with one f16 scale per block of 32 (18 bytes).
    Q4_0,
    /// 4-bit quants with an f16 scale and minimum per block of 32 (20 bytes).
    Q4_1,
    /// 5-bit quants with one f16 scale per block of 32 (22 bytes).
    Q5_0,
    /// 5-bit quants with an f16 scale and minimum per block of 32 (24 bytes).
    Q5_1,
    /// 8-bit quants with one f16 scale per block of 32 (34 bytes).
    Q8_0,
    /// GGML `Q4_K`: 4-bit k-quants, super-blocks of 256 (144 bytes).
    Q4K,
    /// GGML `Q5_K`: 5-bit k-quants, super-blocks of 256 (176 bytes).
    Q5K,
    /// GGML `Q6_K`: 6-bit k-quants, super-blocks of 256 (210 bytes).
    Q6K,
}

impl GgmlType {
    /// Maps a GGUF type id. Types we do not decode give an error naming the type.
    pub fn from_id(id: u32) -> Result<Self, ModelError> {
        Ok(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::BF16,
            other => {
                let name = match other {
                    9 => "Q8_1",
                    10 => "Q2_K",
                    11 => "Q3_K",
                    15 => "Q8_K",
                    16..=23 | 29 => "an IQ type",
                    24..=28 => "an integer/f64 type",
                    _ => "unknown",
                };
                return Err(ModelError::Unsupported(format!(
                    "GGML tensor type {other} ({name}); supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K"
                )));
            }
        })
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q5_1 => 7,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::BF16 => 30,
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Whether elements are packed in blocks with scales (every type but F32, F16 and BF16).
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes taken by `n` elements, or None when `n` is not a whole number of blocks or overflows.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_elems()) {
            return None;
        }
        (n / self.block_elems()).checked_mul(self.block_bytes())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q8_0 => "Q8_0",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
        };
        f.write_str(s)
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `src` (a whole number of blocks of `ty`) into `dst`, whose length must be the element
/// count those blocks hold.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), ModelError> {
    let need = ty.bytes_for(dst.len()).ok_or_else(|| {
        ModelError::Format(format!(
            "{} elements is not a whole number of {ty} blocks",
            dst.len()
        ))
    })?;
    if src.len() != need {
        return Err(ModelError::Format(format!(
            "{ty}: {} bytes given for {} elements, expected {need}",
            src.len(),
            dst.len()
        )));
    }
    let be = ty.block_bytes();
    let ne = ty.block_elems();
    match ty {
        GgmlType::F32 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            for (b, y) in src.chunks_exact(be).zip(dst.chunks_exact_mut(ne)) {
                dequantize_block(ty, b, y);
            }
        }
    }
    Ok(())
}

/// Dequantizes one block. `b` is exactly one block, `y` its elements.
pub fn dequantize_block(ty: GgmlType, b: &[u8], y: &mut [f32]) {
    match ty {
        GgmlType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
                y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        GgmlType::Q4_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = (qs[j] & 0x0f) as f32 * d + m;
                y[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        GgmlType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                let xh0 = (((qh >> j) << 4) & 0x10) as u8;
                let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
                y[j] = (((qs[j] & 0x0f) | xh0) as i32 - 16) as f32 * d;
                y[j + 16] = (((qs[j] >> 4) | xh1) as i32 - 16) as f32 * d;
            }
        }
        GgmlType::Q5_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..24];
            for j in 0..16 {
                let xh0 = (((qh >> j) << 4) & 0x10) as u8;
                let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
                y[j] = ((qs[j] & 0x0f) | xh0) as f32 * d + m;
                y[j + 16] = ((qs[j] >> 4) | xh1) as f32 * d + m;
            }
        }
        GgmlType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        GgmlType::Q4K => {
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let scales = &b[4..16];
            let qs = &b[16..144];
            for (step, chunk) in y.chunks_exact_mut(64).enumerate() {
                let is = step * 2;
                let (sc1, m1) = scale_min_k4(is, scales);
                let (sc2, m2) = scale_min_k4(is + 1, scales);
                let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                let q = &qs[step * 32..step * 32 + 32];
                for l in 0..32 {
                    chunk[l] = d1 * (q[l] & 0x0f) as f32 - mm1;
                    chunk[l + 32] = d2 * (q[l] >> 4) as f32 - mm2;
                }
            }
        }
        GgmlType::Q5K => {
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let scales = &b[4..16];
            let qh = &b[16..48];
            let qs = &b[48..176];
            for (step, chunk) in y.chunks_exact_mut(64).enumerate() {
                let is = step * 2;
                let u1 = 1u8 << (2 * step);
                let u2 = 2u8 << (2 * step);
                let (sc1, m1) = scale_min_k4(is, scales);
                let (sc2, m2) = scale_min_k4(is + 1, scales);
                let (d1, mm1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, mm2) = (d * sc2 as f32, dmin * m2 as f32);
                let ql = &qs[step * 32..step * 32 + 32];
                for l in 0..32 {
                    let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                    let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                    chunk[l] = d1 * ((ql[l] & 0x0f) + h1) as f32 - mm1;
                    chunk[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - mm2;
                }
            }
        }
        GgmlType::Q6K => {
            let ql_all = &b[0..128];
            let qh_all = &b[128..192];
            let sc_all = &b[192..208];
            let d = f16_at(b, 208);
            for (n, chunk) in y.chunks_exact_mut(128).enumerate() {
                let ql = &ql_all[n * 64..n * 64 + 64];
                let qh = &qh_all[n * 32..n * 32 + 32];
                let sc = &sc_all[n * 8..n * 8 + 8];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    chunk[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    chunk[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    chunk[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    chunk[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            unreachable!("dense types are decoded element-wise by dequantize")
        }
    }
}

/// Unpacks the 6-bit scale and minimum `j` (0..8) of a Q4_K/Q5_K super-block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Quantizes f32 values to Q8_0 (round to nearest, scale = max|x|/127), as ggml's reference does.
/// Used to build test data and by writers; the engine never quantizes activations.
pub fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 34);
    for blk in x.chunks(32) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        for i in 0..32 {
            let v = blk.get(i).copied().unwrap_or(0.0);
            out.push(((v * id).round() as i8) as u8);
        }
    }
    out
}

/// Quantizes f32 values to Q4_1 (min/max per block of 32), as ggml's reference does. Like
/// [`quantize_q8_0`], for test data and writers.
pub fn quantize_q4_1(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() / 32 * 20);
    for blk in x.chunks(32) {
        let min = blk.iter().fold(f32::INFINITY, |a, &v| a.min(v));
        let max = blk.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
        out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
        for j in 0..16 {
            let q0 = (((blk[j] - min) * id + 0.5) as u8).min(15);
            let q1 = (((blk[j + 16] - min) * id + 0.5) as u8).min(15);
            out.push(q0 | (q1 << 4));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    fn deq(ty: GgmlType, b: &[u8]) -> Vec<f32> {
        let mut y = vec![0f32; ty.block_elems() * (b.len() / ty.block_bytes())];
        dequantize(ty, b, &mut y).unwrap();
        y
    }

    #[test]
    fn dense_types() {
        let v = [1.5f32, -2.25, 0.0, 65504.0];
        let mut b = Vec::new();
        v.iter().for_each(|x| b.extend_from_slice(&x.to_le_bytes()));
        assert_eq!(deq(GgmlType::F32, &b), v);
        let mut b = Vec::new();
        v.iter().for_each(|x| b.extend_from_slice(&h(*x)));
        assert_eq!(deq(GgmlType::F16, &b), v);
        let mut b = Vec::new();
        [1.5f32, -2.25, 0.0, 3.0e38]
            .iter()
            .for_each(|x| b.extend_from_slice(&bf16::from_f32(*x).to_le_bytes()));
        let y = deq(GgmlType::BF16, &b);
        assert_eq!(&y[..3], &[1.5, -2.25, 0.0]);
        assert_eq!(y[3], bf16::from_f32(3.0e38).to_f32());
    }

    #[test]
    fn q4_0_block() {
        let mut b = h(0.5).to_vec();
        // element j gets nibble j%16 (low), element j+16 gets 15-j (high)
        for j in 0..16u8 {
            b.push(j | ((15 - j) << 4));
        }
        let y = deq(GgmlType::Q4_0, &b);
        for j in 0..16 {
            assert_eq!(y[j], (j as f32 - 8.0) * 0.5);
            assert_eq!(y[j + 16], ((15 - j) as f32 - 8.0) * 0.5);
        }
    }

    #[test]
    fn q4_1_block() {
        let mut b = h(0.25).to_vec();
        b.extend_from_slice(&h(-1.0));
        for j in 0..16u8 {
            b.push(j | (3 << 4));
        }
        let y = deq(GgmlType::Q4_1, &b);
        for j in 0..16 {
            assert_eq!(y[j], j as f32 * 0.25 - 1.0);
            assert_eq!(y[j + 16], 3.0 * 0.25 - 1.0);
        }
    }

    #[test]
    fn q5_0_block() {
        let mut b = h(2.0).to_vec();
        // high bits: element 0 and element 17 have their 5th bit set
        let qh: u32 = 1 | (1 << 17);
        b.extend_from_slice(&qh.to_le_bytes());
        for j in 0..16u8 {
            b.push(j | (1 << 4));
        }
        let y = deq(GgmlType::Q5_0, &b);
        assert_eq!(y[0], (16.0 - 16.0) * 2.0);
        assert_eq!(y[1], (1.0 - 16.0) * 2.0);
        assert_eq!(y[15], (15.0 - 16.0) * 2.0);
        assert_eq!(y[16], (1.0 - 16.0) * 2.0);
        assert_eq!(y[17], (17.0 - 16.0) * 2.0);
    }

    #[test]
    fn q5_1_block() {
        let mut b = h(1.0).to_vec();
        b.extend_from_slice(&h(0.5));
        let qh: u32 = (1 << 3) | (1 << 31);
        b.extend_from_slice(&qh.to_le_bytes());
        for _ in 0..16u8 {
            b.push(2 | (4 << 4));
        }
        let y = deq(GgmlType::Q5_1, &b);
        assert_eq!(y[0], 2.5);
        assert_eq!(y[3], 18.5);
        assert_eq!(y[16], 4.5);
        assert_eq!(y[31], 20.5);
    }

    #[test]
    fn q8_0_block() {
        let mut b = h(0.125).to_vec();
        for j in 0..32i32 {
            b.push(((j - 16) as i8) as u8);
        }
        let y = deq(GgmlType::Q8_0, &b);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, (j as f32 - 16.0) * 0.125);
        }
    }

    /// Packs eight 6-bit (scale, min) pairs the way ggml's Q4_K/Q5_K quantizers do.
    fn pack_scales(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
        let mut q = [0u8; 12];
        for j in 0..8 {
            if j < 4 {
                q[j] = sc[j];
                q[j + 4] = mn[j];
            } else {
                q[j + 4] = (sc[j] & 0x0f) | ((mn[j] & 0x0f) << 4);
                q[j - 4] |= (sc[j] >> 4) << 6;
                q[j] |= (mn[j] >> 4) << 6;
            }
        }
        q
    }

    #[test]
    fn q4_k_block() {
        let sc = [1, 2, 3, 4, 40, 50, 60, 63];
        let mn = [0, 1, 2, 3, 33, 17, 48, 5];
        let mut b = h(0.5).to_vec();
        b.extend_from_slice(&h(0.25));
        b.extend_from_slice(&pack_scales(sc, mn));
        // qs: byte l of chunk s holds element (s*64 + l) in its low nibble and (s*64+32+l) high
        for s in 0..4 {
            for l in 0..32u8 {
                b.push((l % 16) | (((l + s as u8) % 16) << 4));
            }
        }
        let y = deq(GgmlType::Q4K, &b);
        for s in 0..4 {
            for l in 0..32 {
                let lo = (l % 16) as f32;
                let hi = ((l + s) % 16) as f32;
                let (i1, i2) = (2 * s, 2 * s + 1);
                assert_eq!(
                    y[s * 64 + l],
                    0.5 * sc[i1] as f32 * lo - 0.25 * mn[i1] as f32
                );
                assert_eq!(
                    y[s * 64 + 32 + l],
                    0.5 * sc[i2] as f32 * hi - 0.25 * mn[i2] as f32
                );
            }
        }
    }

    #[test]
    fn q5_k_block() {
        let sc = [9, 8, 7, 6, 5, 44, 3, 2];
        let mn = [1, 1, 1, 1, 62, 1, 1, 1];
        let mut b = h(1.0).to_vec();
        b.extend_from_slice(&h(0.5));
        b.extend_from_slice(&pack_scales(sc, mn));
        // qh byte l: bit 2s set for even l (low half of chunk s), bit 2s+1 set for l divisible by 3
        for l in 0..32 {
            let mut v = 0u8;
            for s in 0..4 {
                if l % 2 == 0 {
                    v |= 1 << (2 * s);
                }
                if l % 3 == 0 {
                    v |= 2 << (2 * s);
                }
            }
            b.push(v);
        }
        for _s in 0..4 {
            for l in 0..32u8 {
                b.push((l % 16) | ((15 - l % 16) << 4));
            }
        }
        let y = deq(GgmlType::Q5K, &b);
        for s in 0..4 {
            for l in 0..32 {
                let lo = (l % 16 + if l % 2 == 0 { 16 } else { 0 }) as f32;
                let hi = (15 - l % 16 + if l % 3 == 0 { 16 } else { 0 }) as f32;
                let (i1, i2) = (2 * s, 2 * s + 1);
                assert_eq!(y[s * 64 + l], sc[i1] as f32 * lo - 0.5 * mn[i1] as f32);
                assert_eq!(y[s * 64 + 32 + l], sc[i2] as f32 * hi - 0.5 * mn[i2] as f32);
            }
        }
    }

    #[test]
    fn q6_k_block() {
        // Every element gets the 6-bit value 40 (so q = 8), scales vary per 16 elements.
        let mut b = Vec::new();
        b.extend(std::iter::repeat_n(0x88u8, 128)); // low nibbles 8, high nibbles 8
        b.extend(std::iter::repeat_n(0b1010_1010u8, 64)); // 2 high bits = 2 -> +32
        let scales: [i8; 16] = [
            1, -2, 3, -4, 5, -6, 7, -8, 9, -10, 11, -12, 13, -14, 15, -16,
        ];
        b.extend(scales.iter().map(|&s| s as u8));
        b.extend_from_slice(&h(0.5));
        let y = deq(GgmlType::Q6K, &b);
        for (i, v) in y.iter().enumerate() {
            // element i of the super-block uses scale i/16
            let expect = 0.5 * scales[i / 16] as f32 * 8.0;
            assert_eq!(*v, expect, "element {i}");
        }
    }

    #[test]
    fn wrong_sizes_are_errors() {
        let mut y = vec![0f32; 32];
        assert!(dequantize(GgmlType::Q4_1, &[0u8; 19], &mut y).is_err());
        let mut y = vec![0f32; 31];
        assert!(dequantize(GgmlType::Q4_1, &[0u8; 20], &mut y).is_err());
    }

    #[test]
    fn quantizers_round_trip() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        for (ty, q, tol) in [
            (GgmlType::Q8_0, quantize_q8_0(&x), 0.01),
            (GgmlType::Q4_1, quantize_q4_1(&x), 0.08),
        ] {
            let y = deq(ty, &q);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < tol, "{ty}: {a} vs {b}");
            }
        }
    }
}

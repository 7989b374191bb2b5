//! What a worker's KV cache is, as the two ends of a connection tell each other in the
//! handshake: the model, the block's shape and element type, and which KV heads the receiver's
//! ranks hold (the head ranges its block frames must carry).
//!
//! A sender and a receiver whose caches cannot map onto each other (another model, head size,
//! layer count, KV heads or block size, or an element type a frame cannot convert from) refuse
//! each other at the handshake with the reason, before any frame flows. The floating-point types
//! (a CPU cache's f32 and f16, a GPU cache's bf16) convert value by value at the receiver
//! ([`KvShape::conversion_from`], [`convert_values`]); int8 maps onto int8 only. Tensor-parallel sizes may differ: a block frame carries a
//! range of KV heads, and the receiver names the ranges its ranks hold (see [`crate::wire`]).

use std::ops::Range;

use crate::TransferError;

/// A worker's KV cache, as the handshake describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// The model (its name; the two ends must serve the same one).
    pub model: String,
    /// Layers per block.
    pub layers: u32,
    /// The model's KV heads, all ranks together.
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Token slots per block.
    pub block_size: u32,
    /// The cache's element type: `f32`, `f16`, `bf16` (a GPU's cache) or `int8`.
    pub dtype: String,
    /// The distinct KV head ranges of the worker's tensor-parallel ranks, in head order (one
    /// range of every head without tensor parallelism). A receiver takes block frames of
    /// exactly these ranges.
    pub pieces: Vec<Range<u32>>,
}

/// Bytes of one stored value of a cache of `dtype` (int8's scales aside).
pub fn value_bytes(dtype: &str) -> usize {
    match dtype {
        "f32" => 4,
        "f16" | "bf16" => 2,
        _ => 1,
    }
}

/// The floating-point element types a frame's values convert between at a receiver: a CPU
/// cache's f32 or f16 and a GPU cache's bf16. A frame of these is its values only (no scales),
/// laid out alike whatever the type, so a conversion is value by value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Float {
    /// IEEE single precision.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16: f32's exponent, 8 significant bits.
    Bf16,
}

impl Float {
    /// The type a cache's dtype name stores, if it is one of these.
    pub fn of(dtype: &str) -> Option<Self> {
        match dtype {
            "f32" => Some(Self::F32),
            "f16" => Some(Self::F16),
            "bf16" => Some(Self::Bf16),
            _ => None,
        }
    }

    /// Bytes per value.
    pub fn bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::Bf16 => 2,
        }
    }

    /// The value at `b` (little-endian, [`Self::bytes`] long) as f32: exact for every type.
    fn read(self, b: &[u8]) -> f32 {
        match self {
            Self::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Self::F16 => half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            Self::Bf16 => half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        }
    }

    /// Writes `v` rounded to this type (to nearest, ties to even: what the devices' own cache
    /// writes do) at `b`.
    fn write(self, v: f32, b: &mut [u8]) {
        match self {
            Self::F32 => b.copy_from_slice(&v.to_le_bytes()),
            Self::F16 => b.copy_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes()),
            Self::Bf16 => b.copy_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
        }
    }
}

/// `src`'s values of type `from` as values of type `to`, in `dst` (cleared first). A value that
/// does not fit the narrower type becomes its infinity, as a cast does.
pub fn convert_values(from: Float, src: &[u8], to: Float, dst: &mut Vec<u8>) {
    let n = src.len() / from.bytes();
    dst.clear();
    dst.resize(n * to.bytes(), 0);
    for (s, d) in src
        .chunks_exact(from.bytes())
        .zip(dst.chunks_exact_mut(to.bytes()))
    {
        to.write(from.read(s), d);
    }
}

impl KvShape {
    /// Bytes of one layer of one block holding `heads` of the KV heads: K and V values, and for
    /// int8 their f32 scales, one per slot of each head (the frame layout of docs/kv-wire.md).
    pub fn frame_len(&self, heads: usize) -> usize {
        let per_value = value_bytes(&self.dtype);
        let values = 2 * heads * self.block_size as usize * self.head_dim as usize;
        values * per_value + self.scaled() as usize * 2 * heads * self.scale_bytes()
    }

    /// Whether frames carry scales after the values (an int8 cache).
    pub fn scaled(&self) -> bool {
        self.dtype == "int8"
    }

    /// Bytes of one head's K (or V) scales in an int8 frame: an f32 per slot.
    fn scale_bytes(&self) -> usize {
        4 * self.block_size as usize
    }

    /// Why a peer's cache cannot exchange blocks with this one, if it cannot.
    pub fn mismatch(&self, peer: &KvShape) -> Option<String> {
        let differ = |what: &str, mine: &dyn std::fmt::Display, theirs: &dyn std::fmt::Display| {
            Some(format!(
                "the peer's {what} is {theirs}, this worker's {mine}"
            ))
        };
        if self.model != peer.model {
            return differ("model", &self.model, &peer.model);
        }
        if self.layers != peer.layers {
            return differ("layer count", &self.layers, &peer.layers);
        }
        if self.kv_heads != peer.kv_heads {
            return differ("KV head count", &self.kv_heads, &peer.kv_heads);
        }
        if self.head_dim != peer.head_dim {
            return differ("head size", &self.head_dim, &peer.head_dim);
        }
        if self.block_size != peer.block_size {
            return differ("KV block size", &self.block_size, &peer.block_size);
        }
        if self.dtype != peer.dtype && Float::of(&self.dtype).zip(Float::of(&peer.dtype)).is_none()
        {
            return Some(format!(
                "the peer's KV cache dtype is {}, this worker's {} (frames convert between f32, f16 and bf16 only)",
                peer.dtype, self.dtype
            ));
        }
        None
    }

    /// The conversion a receiver of this shape applies to the values of a sender of `peer`'s
    /// frames: None when they store the same type (the bytes are written as they came).
    pub fn conversion_from(&self, peer: &KvShape) -> Option<(Float, Float)> {
        if self.dtype == peer.dtype {
            return None;
        }
        Float::of(&peer.dtype).zip(Float::of(&self.dtype))
    }

    /// The shape's bytes in a handshake message (a length, then the fields).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        let model = &self.model.as_bytes()[..self.model.len().min(u16::MAX as usize)];
        b.extend_from_slice(&(model.len() as u16).to_le_bytes());
        b.extend_from_slice(model);
        for v in [self.layers, self.kv_heads, self.head_dim, self.block_size] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let dtype = &self.dtype.as_bytes()[..self.dtype.len().min(u8::MAX as usize)];
        b.push(dtype.len() as u8);
        b.extend_from_slice(dtype);
        b.extend_from_slice(&(self.pieces.len().min(u16::MAX as usize) as u16).to_le_bytes());
        for p in self.pieces.iter().take(u16::MAX as usize) {
            b.extend_from_slice(&p.start.to_le_bytes());
            b.extend_from_slice(&p.end.to_le_bytes());
        }
        let mut out = (b.len() as u32).to_le_bytes().to_vec();
        out.extend_from_slice(&b);
        out
    }

    /// Reads the fields [`KvShape::encode`] wrote after its length prefix.
    pub fn decode(b: &[u8]) -> Result<Self, TransferError> {
        let bad = || TransferError::Handshake("the peer's KV cache description is garbled".into());
        let mut at = 0usize;
        let mut take = |n: usize| -> Result<&[u8], TransferError> {
            let s = b.get(at..at + n).ok_or_else(bad)?;
            at += n;
            Ok(s)
        };
        let u16_ = |s: &[u8]| u16::from_le_bytes([s[0], s[1]]) as usize;
        let u32_ = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes"));
        let n = u16_(take(2)?);
        let model = String::from_utf8(take(n)?.to_vec()).map_err(|_| bad())?;
        let mut v = [0u32; 4];
        for x in &mut v {
            *x = u32_(take(4)?);
        }
        // Frames name KV heads in 16 bits.
        if v[1] > u16::MAX as u32 {
            return Err(bad());
        }
        let n = take(1)?[0] as usize;
        let dtype = String::from_utf8(take(n)?.to_vec()).map_err(|_| bad())?;
        let n = u16_(take(2)?);
        let mut pieces = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let (s, e) = (u32_(take(4)?), u32_(take(4)?));
            if s >= e || e > v[1] {
                return Err(bad());
            }
            pieces.push(s..e);
        }
        Ok(Self {
            model,
            layers: v[0],
            kv_heads: v[1],
            head_dim: v[2],
            block_size: v[3],
            dtype,
            pieces,
        })
    }
}

/// Most bytes of a shape in a handshake.
pub(crate) const MAX_SHAPE: usize = 64 << 10;

/// Builds the frame of KV heads `want` of one layer of one block from frames `have` of other
/// head ranges of the same block: K values, V values, then for int8 the K and V scales (a slot's
/// each), each head's part copied from the frame that holds it. None when `have` does not cover `want`, or a
/// frame is not as long as its heads' share.
pub fn regroup(shape: &KvShape, have: &[(Range<u32>, &[u8])], want: Range<u32>) -> Option<Vec<u8>> {
    let sb = shape.scale_bytes();
    let per_value = shape.frame_len(1) - shape.scaled() as usize * 2 * sb;
    // Bytes of one head's K (or V) values.
    let head = per_value / 2;
    let n = want.len();
    let mut out = vec![0u8; shape.frame_len(n)];
    for h in want.clone() {
        let (r, src) = have.iter().find(|(r, _)| r.contains(&h))?;
        if src.len() != shape.frame_len(r.len()) {
            return None;
        }
        let (i, j, m) = ((h - want.start) as usize, (h - r.start) as usize, r.len());
        for kv in 0..2 {
            let (to, from) = ((kv * n + i) * head, (kv * m + j) * head);
            out[to..to + head].copy_from_slice(&src[from..from + head]);
        }
        if shape.scaled() {
            let (vo, vi) = (2 * n * head, 2 * m * head);
            for kv in 0..2 {
                let (to, from) = (vo + (kv * n + i) * sb, vi + (kv * m + j) * sb);
                out[to..to + sb].copy_from_slice(&src[from..from + sb]);
            }
        }
    }
    Some(out)
}

#[cfg(test)]
// Lists of KV head ranges with a single range (every head) are what these tests mean.
#[allow(clippy::single_range_in_vec_init)]
pub(crate) mod tests {
    use super::*;

    /// A small cache of 2 layers, 3 KV heads of 4 values and blocks of 2, held as `pieces`.
    pub(crate) fn shape(dtype: &str, pieces: Vec<Range<u32>>) -> KvShape {
        KvShape {
            model: "m".into(),
            layers: 2,
            kv_heads: 3,
            head_dim: 4,
            block_size: 2,
            dtype: dtype.into(),
            pieces,
        }
    }

    #[test]
    fn shapes_round_trip_and_garbage_is_refused() {
        let s = shape("int8", vec![0..1, 1..3]);
        let b = s.encode();
        assert_eq!(
            u32::from_le_bytes(b[..4].try_into().unwrap()) as usize,
            b.len() - 4
        );
        assert_eq!(KvShape::decode(&b[4..]).unwrap(), s);
        assert!(KvShape::decode(&b[4..b.len() - 1]).is_err());
        // A range that ends before it starts.
        let backwards = std::ops::Range { start: 2, end: 1 };
        let mut bad = shape("f32", vec![backwards]).encode();
        assert!(KvShape::decode(&bad[4..]).is_err());
        bad.truncate(3);
        assert!(KvShape::decode(&bad).is_err());
    }

    #[test]
    fn mismatches_name_what_differs() {
        let a = shape("f32", vec![0..3]);
        assert_eq!(a.mismatch(&shape("f32", vec![0..1, 1..2, 2..3])), None);
        let e = a.mismatch(&shape("int8", vec![0..3])).unwrap();
        assert_eq!(
            e,
            "the peer's KV cache dtype is int8, this worker's f32 (frames convert between f32, f16 and bf16 only)"
        );
        // The float types map onto each other: the receiver converts.
        for (mine, peer) in [("bf16", "f32"), ("f32", "bf16"), ("f16", "bf16")] {
            let m = shape(mine, vec![0..3]);
            let p = shape(peer, vec![0..3]);
            assert_eq!(m.mismatch(&p), None, "{mine} <- {peer}");
            assert_eq!(
                m.conversion_from(&p),
                Some((Float::of(peer).unwrap(), Float::of(mine).unwrap()))
            );
        }
        assert_eq!(a.conversion_from(&a), None);
        assert!(shape("int8", vec![0..3])
            .mismatch(&shape("bf16", vec![0..3]))
            .is_some());
        let e = a
            .mismatch(&KvShape {
                head_dim: 8,
                ..a.clone()
            })
            .unwrap();
        assert!(e.contains("head size is 8"), "{e}");
        let e = a
            .mismatch(&KvShape {
                block_size: 16,
                ..a.clone()
            })
            .unwrap();
        assert!(e.contains("block size"), "{e}");
        let e = a
            .mismatch(&KvShape {
                model: "other".into(),
                ..a.clone()
            })
            .unwrap();
        assert!(e.contains("model is other"), "{e}");
    }

    /// Conversions round to nearest, ties to even, as the devices' cache writes do: bf16 keeps
    /// f32's top 16 bits, rounded; widening is exact, so narrowing what was widened gives the
    /// same bits back; what overflows f16 becomes infinity.
    #[test]
    fn values_convert_rounding_to_nearest_even() {
        let vals: [f32; 6] = [
            1.0,
            -2.5,
            // 1 + 2^-8 sits halfway between two bf16 values: ties go to the even one (1.0).
            1.0 + 1.0 / 256.0,
            // 1 + 3·2^-8: halfway again, now up to the even 1 + 2^-6.
            1.0 + 3.0 / 256.0,
            1.0e30,
            f32::from_bits(0x3f80_8001),
        ];
        let src: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut bf = Vec::new();
        convert_values(Float::F32, &src, Float::Bf16, &mut bf);
        let bits: Vec<u16> = bf
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        assert_eq!(bits, [0x3f80, 0xc020, 0x3f80, 0x3f82, 0x714a, 0x3f81]);
        let mut wide = Vec::new();
        convert_values(Float::Bf16, &bf, Float::F32, &mut wide);
        let back: Vec<u32> = wide
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(
            back,
            bits.iter().map(|&b| (b as u32) << 16).collect::<Vec<_>>()
        );
        let mut again = Vec::new();
        convert_values(Float::F32, &wide, Float::Bf16, &mut again);
        assert_eq!(again, bf);
        let mut h = Vec::new();
        convert_values(Float::Bf16, &bf, Float::F16, &mut h);
        let h: Vec<f32> = h
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect();
        assert_eq!(h[..4], [1.0, -2.5, 1.0, 1.015625]);
        assert_eq!(h[4], f32::INFINITY);
    }

    /// A whole block split into per-head frames and joined again is the block; a two-head
    /// frame built from single heads is what cutting the whole block gives.
    #[test]
    fn regrouping_splits_and_joins_frames() {
        for dtype in ["f32", "f16", "int8"] {
            let s = shape(dtype, vec![0..3]);
            let whole: Vec<u8> = (0..s.frame_len(3)).map(|i| (i * 7 % 251) as u8).collect();
            let singles: Vec<Vec<u8>> = (0..3)
                .map(|h| regroup(&s, &[(0..3, &whole)], h..h + 1).unwrap())
                .collect();
            assert!(singles.iter().all(|f| f.len() == s.frame_len(1)));
            let have: Vec<(Range<u32>, &[u8])> = singles
                .iter()
                .enumerate()
                .map(|(h, f)| (h as u32..h as u32 + 1, &f[..]))
                .collect();
            assert_eq!(regroup(&s, &have, 0..3), Some(whole.clone()), "{dtype}");
            assert_eq!(
                regroup(&s, &have, 1..3),
                regroup(&s, &[(0..3, &whole)], 1..3),
                "{dtype}"
            );
            // Heads nobody holds, or a frame of the wrong length: no frame.
            assert_eq!(regroup(&s, &have[..2], 0..3), None, "{dtype}");
            assert_eq!(regroup(&s, &[(0..3, &whole[1..])], 0..1), None, "{dtype}");
            // Head 1's K values are the second head-sized run of the whole block.
            let sb = 4 * s.block_size as usize;
            let head = (s.frame_len(1) - s.scaled() as usize * 2 * sb) / 2;
            assert_eq!(&singles[1][..head], &whole[head..2 * head], "{dtype}");
            if s.scaled() {
                // Its K scales (one per slot) follow every head's values; its V scales follow
                // every head's K scales.
                assert_eq!(s.frame_len(1), 2 * head + 2 * sb);
                let (k0, v0) = (6 * head + sb, 6 * head + 3 * sb + sb);
                assert_eq!(&singles[1][2 * head..2 * head + sb], &whole[k0..k0 + sb]);
                assert_eq!(&singles[1][2 * head + sb..], &whole[v0..v0 + sb]);
            }
        }
    }
}

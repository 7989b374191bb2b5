//! GGUF v2/v3 reader over a memory map, and a writer (used by tests and tooling).
//!
//! The reader validates everything it reads against the file's length before touching it: string
//! and array lengths, tensor shapes, types and data ranges. A truncated or garbled file gives a
//! [`ModelError::Format`] that says what and where, never a panic.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use memmap2::Mmap;

use crate::quant::GgmlType;
use crate::ModelError;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Tensors above this rank do not exist in GGML.
const MAX_DIMS: u32 = 4;

/// One metadata value. Arrays hold values of one type.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// GGUF type 0.
    U8(u8),
    /// GGUF type 1.
    I8(i8),
    /// GGUF type 2.
    U16(u16),
    /// GGUF type 3.
    I16(i16),
    /// GGUF type 4.
    U32(u32),
    /// GGUF type 5.
    I32(i32),
    /// GGUF type 6.
    F32(f32),
    /// GGUF type 7 (one byte, 0 or 1).
    Bool(bool),
    /// GGUF type 8 (UTF-8, length-prefixed).
    String(String),
    /// GGUF type 9: values of one type (written with the first element's type).
    Array(Vec<MetaValue>),
    /// GGUF type 10.
    U64(u64),
    /// GGUF type 11.
    I64(i64),
    /// GGUF type 12.
    F64(f64),
}

impl MetaValue {
    fn type_id(&self) -> u32 {
        match self {
            Self::U8(_) => 0,
            Self::I8(_) => 1,
            Self::U16(_) => 2,
            Self::I16(_) => 3,
            Self::U32(_) => 4,
            Self::I32(_) => 5,
            Self::F32(_) => 6,
            Self::Bool(_) => 7,
            Self::String(_) => 8,
            Self::Array(_) => 9,
            Self::U64(_) => 10,
            Self::I64(_) => 11,
            Self::F64(_) => 12,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U8(v) => Some(v as u64),
            Self::U16(v) => Some(v as u64),
            Self::U32(v) => Some(v as u64),
            Self::U64(v) => Some(v),
            Self::I8(v) => u64::try_from(v).ok(),
            Self::I16(v) => u64::try_from(v).ok(),
            Self::I32(v) => u64::try_from(v).ok(),
            Self::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as an f64, if it is a float or a non-negative integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F32(v) => Some(v as f64),
            Self::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The text of a string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value of a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements of an array value.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor lives in the file and what it holds.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// The tensor's name in the file (canonical, GGUF-style).
    pub name: String,
    /// GGML order: `dims[0]` is the fastest-varying (the row length).
    pub dims: Vec<u64>,
    /// How the elements are encoded.
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub start: usize,
    /// Bytes of data from `start`.
    pub len: usize,
}

impl TensorInfo {
    /// Shape in row-major (PyTorch) order: `[rows, cols]` for a matrix.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF file; tensor data stays in the memory map.
pub struct GgufFile {
    /// The GGUF format version (2 or 3).
    pub version: u32,
    /// Every metadata key and its value.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Every tensor, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Alignment of tensor data in bytes (`general.alignment`, default 32).
    pub alignment: u64,
    map: Arc<Mmap>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, what: &str) -> ModelError {
        ModelError::Format(format!(
            "GGUF: {what} at byte {} (file is {} bytes)",
            self.pos,
            self.buf.len()
        ))
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ModelError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.err(&format!("truncated {what}")))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, ModelError> {
        Ok(self.take(1, "u8")?[0])
    }
    fn u16(&mut self) -> Result<u16, ModelError> {
        let b = self.take(2, "u16")?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, ModelError> {
        let b = self.take(4, "u32")?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    fn u64(&mut self) -> Result<u64, ModelError> {
        let b = self.take(8, "u64")?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn string(&mut self) -> Result<String, ModelError> {
        let n = self.u64()?;
        if n > self.remaining() as u64 {
            return Err(self.err(&format!("string length {n} past end of file")));
        }
        let b = self.take(n as usize, "string")?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err("string is not UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue, ModelError> {
        Ok(match ty {
            0 => MetaValue::U8(self.u8()?),
            1 => MetaValue::I8(self.u8()? as i8),
            2 => MetaValue::U16(self.u16()?),
            3 => MetaValue::I16(self.u16()? as i16),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(self.u32()? as i32),
            6 => MetaValue::F32(f32::from_bits(self.u32()?)),
            7 => match self.u8()? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.err(&format!("bool value {b}"))),
            },
            8 => MetaValue::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.err("arrays nested too deep"));
                }
                let ety = self.u32()?;
                let n = self.u64()?;
                // Every element takes at least one byte: a length beyond the file is corrupt.
                if n > self.remaining() as u64 {
                    return Err(self.err(&format!("array length {n} past end of file")));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(self.u64()? as i64),
            12 => MetaValue::F64(f64::from_bits(self.u64()?)),
            t => return Err(self.err(&format!("unknown metadata value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file. The data stays mapped; nothing is copied.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: the map is read-only; a model file changed underneath a running server is outside
        // what we can defend against, as for every mmap-based loader.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        Self::parse(Arc::new(map)).map_err(|e| match e {
            ModelError::Format(m) => ModelError::Format(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    fn parse(map: Arc<Mmap>) -> Result<Self, ModelError> {
        let (version, metadata, tensors, alignment) = parse_bytes(&map)?;
        Ok(Self {
            version,
            metadata,
            tensors,
            alignment,
            map,
        })
    }

    /// The bytes of a tensor, borrowed from the map.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        &self.map[t.start..t.start + t.len]
    }

    /// The tensor named `name`, if the file has it.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The metadata value under `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }
}

type Parsed = (u32, BTreeMap<String, MetaValue>, Vec<TensorInfo>, u64);

/// Parses a whole GGUF image held in memory: its version, metadata, tensors (with absolute byte
/// ranges into `buf`) and data alignment.
pub fn parse_bytes(buf: &[u8]) -> Result<Parsed, ModelError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.take(4, "magic")?;
    if magic != MAGIC {
        return Err(ModelError::Format(format!(
            "not a GGUF file (magic {magic:02x?})"
        )));
    }
    let version = c.u32()?;
    if !(2..=3).contains(&version) {
        return Err(ModelError::Format(format!(
            "GGUF version {version} is not supported (2 and 3 are; a big-endian file also shows up here)"
        )));
    }
    let n_tensors = c.u64()?;
    let n_kv = c.u64()?;
    // A KV pair takes at least 8+1+4+1 bytes, a tensor info at least 8+1+4+8+4+8.
    if n_kv > c.remaining() as u64 / 14 || n_tensors > c.remaining() as u64 / 33 {
        return Err(c.err(&format!(
            "{n_kv} metadata entries / {n_tensors} tensors cannot fit in the file"
        )));
    }
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = c.string()?;
        let ty = c.u32()?;
        let v = c.value(ty, 0)?;
        metadata.insert(key, v);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
            _ => {
                return Err(ModelError::Format(format!(
                    "GGUF: bad general.alignment {v:?}"
                )))
            }
        },
    };
    let mut raw = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = c.string()?;
        let nd = c.u32()?;
        if nd == 0 || nd > MAX_DIMS {
            return Err(c.err(&format!("tensor {name}: {nd} dimensions")));
        }
        let mut dims = Vec::with_capacity(nd as usize);
        for _ in 0..nd {
            dims.push(c.u64()?);
        }
        let ty_id = c.u32()?;
        let ty = GgmlType::from_id(ty_id)
            .map_err(|e| ModelError::Format(format!("tensor {name}: {e}")))?;
        let offset = c.u64()?;
        raw.push((name, dims, ty, offset));
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ty, offset) in raw {
        let n = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let len = n
            .and_then(|n| usize::try_from(n).ok())
            .and_then(|n| ty.bytes_for(n))
            .ok_or_else(|| {
                ModelError::Format(format!(
                    "GGUF: tensor {name}: shape {dims:?} invalid for {ty}"
                ))
            })?;
        if offset % alignment != 0 {
            return Err(ModelError::Format(format!(
                "GGUF: tensor {name}: offset {offset} not aligned to {alignment}"
            )));
        }
        let start = data_start
            .checked_add(offset)
            .and_then(|s| usize::try_from(s).ok())
            .filter(|&s| s.checked_add(len).is_some_and(|e| e <= buf.len()))
            .ok_or_else(|| {
                ModelError::Format(format!(
                    "GGUF: tensor {name}: data at offset {offset} (+{len} bytes) lies past the end of the file ({} bytes); the file is truncated",
                    buf.len()
                ))
            })?;
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            start,
            len,
        });
    }
    Ok((version, metadata, tensors, alignment))
}

/// A tensor to write: name, GGML dims (fastest first), type and its encoded bytes.
pub struct TensorToWrite<'a> {
    /// The tensor's name in the file.
    pub name: String,
    /// GGML order: `dims[0]` is the fastest-varying (the row length).
    pub dims: Vec<u64>,
    /// How `data` is encoded.
    pub ty: GgmlType,
    /// The encoded elements, whole blocks of `ty`.
    pub data: &'a [u8],
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.push(*x as u8),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(*x as u8),
        MetaValue::String(s) => write_str(out, s),
        MetaValue::Array(a) => {
            let ety = a.first().map_or(4, MetaValue::type_id);
            out.extend_from_slice(&ety.to_le_bytes());
            out.extend_from_slice(&(a.len() as u64).to_le_bytes());
            for e in a {
                write_value(out, e);
            }
        }
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Encodes a GGUF v3 image with the default alignment.
pub fn encode(metadata: &[(String, MetaValue)], tensors: &[TensorToWrite<'_>]) -> Vec<u8> {
    let align = DEFAULT_ALIGNMENT as usize;
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        write_str(&mut out, k);
        out.extend_from_slice(&v.type_id().to_le_bytes());
        write_value(&mut out, v);
    }
    let mut offset = 0usize;
    let mut offsets = Vec::new();
    for t in tensors {
        write_str(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&(offset as u64).to_le_bytes());
        offsets.push(offset);
        offset = (offset + t.data.len()).div_ceil(align) * align;
    }
    out.resize(out.len().div_ceil(align) * align, 0);
    let base = out.len();
    for (t, off) in tensors.iter().zip(offsets) {
        out.resize(base + off, 0);
        out.extend_from_slice(t.data);
    }
    out
}

/// Writes a GGUF v3 file.
pub fn write(
    path: &Path,
    metadata: &[(String, MetaValue)],
    tensors: &[TensorToWrite<'_>],
) -> Result<(), ModelError> {
    let bytes = encode(metadata, tensors);
    let mut f = File::create(path).map_err(|e| ModelError::io(path, e))?;
    f.write_all(&bytes).map_err(|e| ModelError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Vec<u8> {
        let md = vec![
            (
                "general.architecture".to_string(),
                MetaValue::String("llama".into()),
            ),
            ("a.u8".into(), MetaValue::U8(7)),
            ("a.i8".into(), MetaValue::I8(-7)),
            ("a.u16".into(), MetaValue::U16(700)),
            ("a.i16".into(), MetaValue::I16(-700)),
            ("a.u32".into(), MetaValue::U32(70000)),
            ("a.i32".into(), MetaValue::I32(-70000)),
            ("a.f32".into(), MetaValue::F32(1.5)),
            ("a.bool".into(), MetaValue::Bool(true)),
            ("a.u64".into(), MetaValue::U64(1 << 40)),
            ("a.i64".into(), MetaValue::I64(-(1 << 40))),
            ("a.f64".into(), MetaValue::F64(-2.5)),
            (
                "a.arr".into(),
                MetaValue::Array(vec![
                    MetaValue::String("x".into()),
                    MetaValue::String("yz".into()),
                ]),
            ),
        ];
        let f: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let q = crate::quant::quantize_q8_0(&(0..64).map(|i| i as f32).collect::<Vec<_>>());
        encode(
            &md,
            &[
                TensorToWrite {
                    name: "t.f32".into(),
                    dims: vec![3, 2],
                    ty: GgmlType::F32,
                    data: &f,
                },
                TensorToWrite {
                    name: "t.q8".into(),
                    dims: vec![32, 2],
                    ty: GgmlType::Q8_0,
                    data: &q,
                },
            ],
        )
    }

    #[test]
    fn round_trip_all_value_types() {
        let buf = sample();
        let (version, md, tensors, align) = parse_bytes(&buf).unwrap();
        assert_eq!(version, 3);
        assert_eq!(align, 32);
        assert_eq!(md["a.u8"], MetaValue::U8(7));
        assert_eq!(md["a.i8"], MetaValue::I8(-7));
        assert_eq!(md["a.u16"], MetaValue::U16(700));
        assert_eq!(md["a.i16"], MetaValue::I16(-700));
        assert_eq!(md["a.u32"], MetaValue::U32(70000));
        assert_eq!(md["a.i32"], MetaValue::I32(-70000));
        assert_eq!(md["a.f32"], MetaValue::F32(1.5));
        assert_eq!(md["a.bool"], MetaValue::Bool(true));
        assert_eq!(md["a.u64"], MetaValue::U64(1 << 40));
        assert_eq!(md["a.i64"], MetaValue::I64(-(1 << 40)));
        assert_eq!(md["a.f64"], MetaValue::F64(-2.5));
        assert_eq!(md["a.arr"].as_array().unwrap()[1].as_str(), Some("yz"));
        assert_eq!(tensors.len(), 2);
        assert_eq!(tensors[0].shape(), vec![2, 3]);
        assert_eq!(tensors[0].start % 32, 0);
        assert_eq!(
            &buf[tensors[0].start..tensors[0].start + 4],
            &1.0f32.to_le_bytes()
        );
        assert_eq!(tensors[1].ty, GgmlType::Q8_0);
        assert_eq!(tensors[1].len, 68);
        assert_eq!(tensors[1].start % 32, 0);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let buf = sample();
        for n in 0..buf.len() {
            assert!(
                parse_bytes(&buf[..n]).is_err(),
                "truncated to {n} bytes parsed"
            );
        }
    }

    #[test]
    fn bad_magic_version_and_type() {
        let mut b = sample();
        b[0] = b'X';
        assert!(matches!(parse_bytes(&b), Err(ModelError::Format(m)) if m.contains("not a GGUF")));
        let mut b = sample();
        b[4] = 1;
        assert!(matches!(parse_bytes(&b), Err(ModelError::Format(m)) if m.contains("version 1")));
    }

    proptest! {
        #[test]
        fn garbled_headers_never_panic(pos in 0usize..400, byte in any::<u8>(), cut in 0usize..1000) {
            let mut b = sample();
            let p = pos % b.len();
            b[p] = byte;
            let cut = cut.min(b.len());
            let _ = parse_bytes(&b[..cut]);
            let _ = parse_bytes(&b);
        }

        #[test]
        fn random_bytes_after_magic_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut b = b"GGUF\x03\0\0\0".to_vec();
            b.extend(tail);
            let _ = parse_bytes(&b);
        }
    }
}

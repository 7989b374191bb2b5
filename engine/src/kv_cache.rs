//! The KV pool: the physical cache of one worker.
//!
//! `num_blocks` blocks for every layer; layer L's blocks are one contiguous slab, each block laid
//! out as [`tandem_kernels::KvLayout`] describes. Which block belongs to whom is the
//! [`crate::block_manager`]'s business; this is only the storage.

use std::sync::Arc;

use tandem_kernels::{KvLayout, KvSlabMut};

/// Element type of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// The activations' own precision: exact.
    #[default]
    F32,
    /// IEEE half precision: two bytes per value, the rounding of each value to 11 significant
    /// bits the only loss.
    F16,
    /// One byte per value plus an f32 scale per token slot of each head's K and V.
    Int8,
}

impl KvDtype {
    /// The name flags and worker cards use.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Int8 => "int8",
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "auto" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "int8" => Ok(Self::Int8),
            o => Err(format!("unknown KV dtype {o:?} (f32|f16|int8)")),
        }
    }
}

/// The pool's memory. The buffers are allocated once and never move; the raw pointers into them
/// are what both the engine (through `&mut KvPool`) and [`KvPoolWriter`]s use, so a KV receiver
/// on a network thread can write the blocks granted to a transfer while the engine steps.
struct PoolMemory {
    /// f32, f16 or i8 values, as the dtype says.
    values: *mut u8,
    /// f32 scales (int8 only; dangling and empty otherwise).
    scales: *mut f32,
    /// Owns what the pointers point into; not touched after construction.
    _values: memmap2::MmapMut,
    _scales: Vec<f32>,
}

// SAFETY: the pointers are into heap buffers owned by the struct; who may touch which block when
// is the engine's invariant (see `KvPoolWriter::write`).
unsafe impl Send for PoolMemory {}
unsafe impl Sync for PoolMemory {}

/// `bytes` of zeroed memory (page-aligned, so every dtype's view is aligned), backed by huge
/// pages where the system has them. Attention reads the pool a block-head (4 KiB at the default
/// shape) at a time from blocks scattered over it: with 4 KiB pages every such read is also a TLB
/// miss, and the pool is far larger than the TLB reaches.
///
/// Every page is faulted in here, at startup: otherwise the kernel zeroes each one when a prefill
/// first writes it (6% of a cold batch prefill's time), and a system short of memory fails a
/// request mid-stream instead of the worker at startup.
fn huge_zeroed(bytes: usize) -> std::io::Result<memmap2::MmapMut> {
    use rayon::prelude::*;
    // An anonymous map starts zeroed; one byte at least, as a map cannot be empty.
    let mut map = memmap2::MmapMut::map_anon(bytes.max(1))?;
    #[cfg(target_os = "linux")]
    {
        // Advice only: where transparent huge pages are off, the pool keeps small pages.
        let _ = map.advise(memmap2::Advice::HugePage);
    }
    const PAGE: usize = 4096;
    map.par_chunks_mut(1 << 21)
        .for_each(|region| region.iter_mut().step_by(PAGE).for_each(|b| *b = 0));
    Ok(map)
}

/// Physical KV storage for all layers.
pub struct KvPool {
    /// The shape of one block of one layer (tokens, KV heads, head size).
    pub layout: KvLayout,
    /// Element type of the stored K/V.
    pub dtype: KvDtype,
    /// Model layers, each with its own slab of blocks.
    pub num_layers: usize,
    /// Blocks in the pool (the same ids in every layer).
    pub num_blocks: usize,
    mem: Arc<PoolMemory>,
}

impl KvPool {
    /// A zeroed pool; fails only when the system will not map its memory.
    pub fn new(
        layout: KvLayout,
        dtype: KvDtype,
        num_layers: usize,
        num_blocks: usize,
    ) -> std::io::Result<Self> {
        let values = num_layers * num_blocks * layout.block_floats();
        let bytes = values
            * match dtype {
                KvDtype::F32 => 4,
                KvDtype::F16 => 2,
                KvDtype::Int8 => 1,
            };
        let mut v = huge_zeroed(bytes)?;
        let mut sc = match dtype {
            KvDtype::F32 | KvDtype::F16 => Vec::new(),
            KvDtype::Int8 => vec![0f32; num_layers * num_blocks * layout.block_scales()],
        };
        let mem = PoolMemory {
            values: v.as_mut_ptr(),
            scales: sc.as_mut_ptr(),
            _values: v,
            _scales: sc,
        };
        Ok(Self {
            layout,
            dtype,
            num_layers,
            num_blocks,
            mem: Arc::new(mem),
        })
    }

    /// Bytes one block takes across all layers.
    pub fn bytes_per_block(layout: KvLayout, dtype: KvDtype, num_layers: usize) -> usize {
        Self::frame_bytes(layout, dtype) * num_layers
    }

    /// Bytes of one layer of one block: a KV transfer frame's payload.
    pub fn frame_bytes(layout: KvLayout, dtype: KvDtype) -> usize {
        match dtype {
            KvDtype::F32 => layout.block_floats() * 4,
            KvDtype::F16 => layout.block_floats() * 2,
            KvDtype::Int8 => layout.block_floats() + layout.block_scales() * 4,
        }
    }

    /// Bytes of cache one token takes across all layers (int8 scales included).
    pub fn bytes_per_token(layout: KvLayout, dtype: KvDtype, num_layers: usize) -> f64 {
        Self::bytes_per_block(layout, dtype, num_layers) as f64 / layout.block_size as f64
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Total bytes the pool holds (scales included).
    pub fn bytes(&self) -> usize {
        Self::bytes_per_block(self.layout, self.dtype, self.num_layers) * self.num_blocks
    }

    /// One layer's slab of blocks.
    pub fn layer_mut(&mut self, layer: usize) -> KvSlabMut<'_> {
        assert!(layer < self.num_layers, "layer {layer} out of range");
        let n = self.num_blocks * self.layout.block_floats();
        let m = &self.mem;
        // SAFETY: in bounds (the buffers hold num_layers slabs); `&mut self` makes this the only
        // engine-side view; writers only touch blocks granted to a pending transfer, which the
        // engine does not read or write until the transfer completes.
        unsafe {
            match self.dtype {
                KvDtype::F32 => KvSlabMut::F32(std::slice::from_raw_parts_mut(
                    (m.values as *mut f32).add(layer * n),
                    n,
                )),
                KvDtype::F16 => KvSlabMut::F16(std::slice::from_raw_parts_mut(
                    (m.values as *mut half::f16).add(layer * n),
                    n,
                )),
                KvDtype::Int8 => {
                    let ns = self.num_blocks * self.layout.block_scales();
                    KvSlabMut::Int8 {
                        data: std::slice::from_raw_parts_mut(
                            (m.values as *mut i8).add(layer * n),
                            n,
                        ),
                        scales: std::slice::from_raw_parts_mut(m.scales.add(layer * ns), ns),
                    }
                }
            }
        }
    }

    /// Byte ranges of (layer, block): values, then scales (int8 only).
    fn ranges(&self, layer: usize, block: usize) -> ((usize, usize), (usize, usize)) {
        block_ranges(self.layout, self.dtype, self.num_blocks, layer, block)
    }

    /// Copies one layer of one block out in the KV wire layout (values, then int8 scales).
    pub fn read_block(&self, layer: usize, block: usize, out: &mut Vec<u8>) {
        out.clear();
        self.append_block(layer, block, out);
    }

    /// Appends one layer of one block to `out` in the KV wire layout (values, then int8 scales),
    /// as [`Self::read_block`] gives it: what a KV chunk and a disk tier's block are made of.
    pub fn append_block(&self, layer: usize, block: usize, out: &mut Vec<u8>) {
        assert!(layer < self.num_layers && block < self.num_blocks);
        let ((vo, vn), (so, sn)) = self.ranges(layer, block);
        // SAFETY: in bounds; `&self` excludes engine-side writers, and no transfer writes a block
        // the engine is reading out.
        unsafe {
            out.extend_from_slice(std::slice::from_raw_parts(self.mem.values.add(vo), vn));
            out.extend_from_slice(std::slice::from_raw_parts(
                (self.mem.scales as *const u8).add(so),
                sn,
            ));
        }
    }

    /// One layer of one block as it lies in the pool, when that is one contiguous range (an f32
    /// or f16 cache): a KV frame's payload, sent without copying. `None` for int8 (values and
    /// scales are apart): use [`Self::read_block`].
    pub fn block_bytes(&self, layer: usize, block: usize) -> Option<&[u8]> {
        assert!(layer < self.num_layers && block < self.num_blocks);
        let ((vo, vn), (_, sn)) = self.ranges(layer, block);
        // SAFETY: in bounds; `&self` excludes engine-side writers for the borrow's life, and no
        // transfer writes a block the engine is sending.
        (sn == 0).then(|| unsafe { std::slice::from_raw_parts(self.mem.values.add(vo), vn) })
    }

    /// Copies every layer of block `src` into block `dst` (copy-on-write of a shared block).
    pub fn copy_block(&mut self, src: usize, dst: usize) {
        assert!(src < self.num_blocks && dst < self.num_blocks && src != dst);
        for layer in 0..self.num_layers {
            let ((vs, vn), (ss, sn)) = self.ranges(layer, src);
            let ((vd, _), (sd, _)) = self.ranges(layer, dst);
            // SAFETY: in bounds, two different blocks (so the ranges do not overlap); `&mut
            // self` excludes engine-side readers, and no transfer writes a block a sequence holds.
            unsafe {
                std::ptr::copy_nonoverlapping(self.mem.values.add(vs), self.mem.values.add(vd), vn);
                let scales = self.mem.scales as *mut u8;
                std::ptr::copy_nonoverlapping(scales.add(ss), scales.add(sd), sn);
            }
        }
    }

    /// Another handle on the same memory: a tensor-parallel rank's pool, which its thread steps
    /// through while the backend reads it between steps (exports) and hands writers out for it.
    /// Who touches which block when is the engine's invariant, as for [`Self::writer`].
    pub(crate) fn alias(&self) -> KvPool {
        KvPool {
            layout: self.layout,
            dtype: self.dtype,
            num_layers: self.num_layers,
            num_blocks: self.num_blocks,
            mem: self.mem.clone(),
        }
    }

    /// A handle that writes blocks into this pool from another thread.
    pub fn writer(&self) -> KvPoolWriter {
        KvPoolWriter {
            mem: self.mem.clone(),
            layout: self.layout,
            dtype: self.dtype,
            num_layers: self.num_layers,
            num_blocks: self.num_blocks,
        }
    }
}

fn block_ranges(
    layout: KvLayout,
    dtype: KvDtype,
    num_blocks: usize,
    layer: usize,
    block: usize,
) -> ((usize, usize), (usize, usize)) {
    let idx = layer * num_blocks + block;
    match dtype {
        KvDtype::F32 | KvDtype::F16 => {
            let n = KvPool::frame_bytes(layout, dtype);
            ((idx * n, n), (0, 0))
        }
        KvDtype::Int8 => {
            let n = layout.block_floats();
            let s = layout.block_scales() * 4;
            ((idx * n, n), (idx * s, s))
        }
    }
}

/// Writes whole (layer, block)s into a [`KvPool`] from any thread: the receiving end of a KV
/// transfer. Cheap to clone; keeps the pool's memory alive.
#[derive(Clone)]
pub struct KvPoolWriter {
    mem: Arc<PoolMemory>,
    layout: KvLayout,
    dtype: KvDtype,
    num_layers: usize,
    num_blocks: usize,
}

impl KvPoolWriter {
    /// Bytes of one layer of one block (every write's exact length).
    pub fn frame_bytes(&self) -> usize {
        KvPool::frame_bytes(self.layout, self.dtype)
    }

    /// Model layers in the pool: every block has one frame per layer.
    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// The shape of one layer's block in the pool (its KV heads only, for a rank's pool).
    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    /// The pool's element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Copies `payload` (the KV wire layout) into (layer, block).
    ///
    /// # Safety
    /// Nothing else may read or write this (layer, block) until the caller hands the block back
    /// to the engine: the block must be reserved for a transfer the engine is waiting on, and
    /// two writes to the same block must not race.
    pub unsafe fn write(&self, layer: usize, block: usize, payload: &[u8]) -> Result<(), String> {
        if layer >= self.num_layers || block >= self.num_blocks {
            return Err(format!(
                "layer {layer} / block {block} outside the pool ({} layers, {} blocks)",
                self.num_layers, self.num_blocks
            ));
        }
        if payload.len() != self.frame_bytes() {
            return Err(format!(
                "{} bytes for a block that holds {}",
                payload.len(),
                self.frame_bytes()
            ));
        }
        let ((vo, vn), (so, sn)) =
            block_ranges(self.layout, self.dtype, self.num_blocks, layer, block);
        std::ptr::copy_nonoverlapping(payload.as_ptr(), self.mem.values.add(vo), vn);
        std::ptr::copy_nonoverlapping(
            payload[vn..].as_ptr(),
            (self.mem.scales as *mut u8).add(so),
            sn,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_sizes() {
        let l = KvLayout {
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        };
        let p = KvPool::new(l, KvDtype::F32, 30, 4).unwrap();
        assert_eq!(p.bytes(), 30 * 4 * 2 * 3 * 16 * 64 * 4);
        assert_eq!(
            KvPool::bytes_per_token(l, KvDtype::F32, 30),
            (2 * 3 * 64 * 4 * 30) as f64
        );
        let q = KvPool::new(l, KvDtype::Int8, 30, 4).unwrap();
        // One byte per value plus a scale per slot of each of the 6 K and V heads, per block and
        // layer.
        assert_eq!(q.bytes(), 30 * 4 * (2 * 3 * 16 * 64 + 6 * 16 * 4));
        // The f16 cache is half of f32; int8 halves it again, the scales adding 4 bytes to a
        // head's 64 (6%).
        let h = KvPool::new(l, KvDtype::F16, 30, 4).unwrap();
        let f16_bytes = h.bytes();
        assert_eq!(f16_bytes * 2, p.bytes());
        assert_eq!(
            KvPool::bytes_per_token(l, KvDtype::F16, 30) * 2.0,
            KvPool::bytes_per_token(l, KvDtype::F32, 30)
        );
        assert!(q.bytes() as f64 <= 0.54 * f16_bytes as f64);
        assert!(q.bytes() * 2 > f16_bytes);
    }

    #[test]
    fn blocks_read_out_and_written_into_another_pool_are_identical() {
        let l = KvLayout {
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 8,
        };
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
            let mut a = KvPool::new(l, dtype, 3, 5).unwrap();
            let b = KvPool::new(l, dtype, 3, 7).unwrap();
            for layer in 0..3 {
                match a.layer_mut(layer) {
                    KvSlabMut::F32(d) => {
                        for (i, x) in d.iter_mut().enumerate() {
                            *x = (i + 1000 * layer) as f32 * 0.5;
                        }
                    }
                    KvSlabMut::F16(d) => {
                        for (i, x) in d.iter_mut().enumerate() {
                            *x = half::f16::from_f32((i + 100 * layer) as f32 * 0.5);
                        }
                    }
                    KvSlabMut::Int8 { data, scales } => {
                        for (i, x) in data.iter_mut().enumerate() {
                            *x = ((i * 7 + layer) % 251) as i8;
                        }
                        for (i, x) in scales.iter_mut().enumerate() {
                            *x = i as f32 + layer as f32 * 0.25;
                        }
                    }
                }
            }
            let w = b.writer();
            let mut buf = Vec::new();
            let mut back = Vec::new();
            for layer in 0..3 {
                a.read_block(layer, 2, &mut buf);
                assert_eq!(buf.len(), KvPool::frame_bytes(l, dtype));
                if let Some(direct) = a.block_bytes(layer, 2) {
                    assert_eq!(direct, &buf[..]);
                }
                assert_eq!(a.block_bytes(layer, 2).is_some(), dtype != KvDtype::Int8);
                // SAFETY: nothing else touches pool b.
                unsafe { w.write(layer, 6, &buf).unwrap() };
                b.read_block(layer, 6, &mut back);
                assert_eq!(back, buf, "{dtype:?} layer {layer}");
                // Neighbours untouched.
                b.read_block(layer, 5, &mut back);
                assert!(back.iter().all(|&x| x == 0));
            }
            // SAFETY: as above; these are refused before any write.
            unsafe {
                assert!(w.write(3, 0, &buf).is_err());
                assert!(w.write(0, 7, &buf).is_err());
                assert!(w.write(0, 0, &buf[1..]).is_err());
            }
            // A block copied within the pool (copy-on-write) reads back the same, scales and
            // all, in every layer; the blocks beside it keep what they had.
            let (mut src, mut dst, mut next) = (Vec::new(), Vec::new(), Vec::new());
            let mut before = Vec::new();
            a.read_block(1, 4, &mut before);
            a.copy_block(2, 3);
            for layer in 0..3 {
                a.read_block(layer, 2, &mut src);
                a.read_block(layer, 3, &mut dst);
                assert_eq!(src, dst, "{dtype:?} layer {layer}");
            }
            a.read_block(1, 4, &mut next);
            assert_eq!(next, before);
            assert_ne!(next, dst, "the pattern differs block to block");
        }
    }
}

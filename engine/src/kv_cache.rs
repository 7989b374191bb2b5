//! The KV pool: the physical cache of one worker.
//!
//! `num_blocks` blocks for every layer; layer L's blocks are one contiguous slab, each block laid
//! out as [`tandem_kernels::KvLayout`] describes. Which block belongs to whom is the
//! [`crate::block_manager`]'s business; this is only the storage.

use tandem_kernels::{KvLayout, KvSlabMut};

/// Element type of the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// The activations' own precision: exact.
    #[default]
    F32,
    /// One byte per value plus an f32 scale per block, K/V and head.
    Int8,
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" | "auto" => Ok(Self::F32),
            "int8" => Ok(Self::Int8),
            o => Err(format!("unknown KV dtype {o:?} (f32|int8)")),
        }
    }
}

enum Storage {
    F32(Vec<f32>),
    Int8 { data: Vec<i8>, scales: Vec<f32> },
}

/// Physical KV storage for all layers.
pub struct KvPool {
    pub layout: KvLayout,
    pub dtype: KvDtype,
    pub num_layers: usize,
    pub num_blocks: usize,
    storage: Storage,
}

impl KvPool {
    pub fn new(layout: KvLayout, dtype: KvDtype, num_layers: usize, num_blocks: usize) -> Self {
        let values = num_layers * num_blocks * layout.block_floats();
        let storage = match dtype {
            KvDtype::F32 => Storage::F32(vec![0f32; values]),
            KvDtype::Int8 => Storage::Int8 {
                data: vec![0i8; values],
                scales: vec![0f32; num_layers * num_blocks * layout.block_scales()],
            },
        };
        Self {
            layout,
            dtype,
            num_layers,
            num_blocks,
            storage,
        }
    }

    /// Bytes one block takes across all layers.
    pub fn bytes_per_block(layout: KvLayout, dtype: KvDtype, num_layers: usize) -> usize {
        let per_layer = match dtype {
            KvDtype::F32 => layout.block_floats() * 4,
            KvDtype::Int8 => layout.block_floats() + layout.block_scales() * 4,
        };
        per_layer * num_layers
    }

    /// Bytes of cache one token takes across all layers (scales shared by a block included).
    pub fn bytes_per_token(layout: KvLayout, dtype: KvDtype, num_layers: usize) -> f64 {
        Self::bytes_per_block(layout, dtype, num_layers) as f64 / layout.block_size as f64
    }

    /// Total bytes the pool holds.
    pub fn bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(d) => d.len() * 4,
            Storage::Int8 { data, scales } => data.len() + scales.len() * 4,
        }
    }

    /// One layer's slab of blocks.
    pub fn layer_mut(&mut self, layer: usize) -> KvSlabMut<'_> {
        let n = self.num_blocks * self.layout.block_floats();
        match &mut self.storage {
            Storage::F32(d) => KvSlabMut::F32(&mut d[layer * n..(layer + 1) * n]),
            Storage::Int8 { data, scales } => {
                let ns = self.num_blocks * self.layout.block_scales();
                KvSlabMut::Int8 {
                    data: &mut data[layer * n..(layer + 1) * n],
                    scales: &mut scales[layer * ns..(layer + 1) * ns],
                }
            }
        }
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
        let p = KvPool::new(l, KvDtype::F32, 30, 4);
        assert_eq!(p.bytes(), 30 * 4 * 2 * 3 * 16 * 64 * 4);
        assert_eq!(
            KvPool::bytes_per_token(l, KvDtype::F32, 30),
            (2 * 3 * 64 * 4 * 30) as f64
        );
        let q = KvPool::new(l, KvDtype::Int8, 30, 4);
        // One byte per value plus 6 scales per block and layer.
        assert_eq!(q.bytes(), 30 * 4 * (2 * 3 * 16 * 64 + 6 * 4));
        // Against a 16-bit cache (half of f32), int8 halves the bytes per token; the scales add
        // under 1% at 16 tokens a block.
        let f16_bytes = p.bytes() / 2;
        assert!(q.bytes() as f64 <= 0.51 * f16_bytes as f64);
        assert!(q.bytes() * 2 > f16_bytes);
    }
}

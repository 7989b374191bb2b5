//! The KV pool and its block allocator.
//!
//! One pool per worker holds `num_blocks` blocks for every layer; layer L's blocks are one
//! contiguous slab, each block laid out as [`tandem_kernels::KvLayout`] describes. Blocks are handed
//! out as [`BlockList`]s that give their blocks back when dropped, so a finished, failed or cancelled
//! sequence can never leak cache.

use std::cell::RefCell;
use std::rc::Rc;

use tandem_kernels::KvLayout;

/// Physical KV storage for all layers.
pub struct KvPool {
    pub layout: KvLayout,
    pub num_layers: usize,
    pub num_blocks: usize,
    data: Vec<f32>,
}

impl KvPool {
    pub fn new(layout: KvLayout, num_layers: usize, num_blocks: usize) -> Self {
        let data = vec![0f32; num_layers * num_blocks * layout.block_floats()];
        Self {
            layout,
            num_layers,
            num_blocks,
            data,
        }
    }

    /// Bytes of cache one token takes across all layers.
    pub fn bytes_per_token(layout: KvLayout, num_layers: usize) -> usize {
        2 * layout.num_kv_heads * layout.head_dim * 4 * num_layers
    }

    /// Total bytes the pool holds.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }

    /// One layer's slab of blocks.
    pub fn layer_mut(&mut self, layer: usize) -> &mut [f32] {
        let n = self.num_blocks * self.layout.block_floats();
        &mut self.data[layer * n..(layer + 1) * n]
    }
}

#[derive(Debug)]
struct FreeList {
    free: Vec<u32>,
    total: usize,
}

/// Hands out blocks from a fixed pool. Single-threaded: it lives on the engine thread.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    inner: Rc<RefCell<FreeList>>,
}

impl BlockAllocator {
    pub fn new(total: usize) -> Self {
        // Hand out low block ids first (pop from the back of a reversed list).
        let free = (0..total as u32).rev().collect();
        Self {
            inner: Rc::new(RefCell::new(FreeList { free, total })),
        }
    }

    pub fn free_blocks(&self) -> usize {
        self.inner.borrow().free.len()
    }

    pub fn total_blocks(&self) -> usize {
        self.inner.borrow().total
    }

    /// Takes `n` blocks, or none if fewer are free.
    pub fn allocate(&self, n: usize) -> Option<BlockList> {
        let mut fl = self.inner.borrow_mut();
        if fl.free.len() < n {
            return None;
        }
        let at = fl.free.len() - n;
        let blocks = fl.free.split_off(at);
        Some(BlockList {
            blocks,
            alloc: self.clone(),
        })
    }
}

/// Blocks owned by one sequence, in logical order. Dropping it returns them to the pool.
#[derive(Debug)]
pub struct BlockList {
    blocks: Vec<u32>,
    alloc: BlockAllocator,
}

impl BlockList {
    pub fn ids(&self) -> &[u32] {
        &self.blocks
    }

    /// Appends `n` more blocks; false (and nothing taken) when the pool is short.
    pub fn grow(&mut self, n: usize) -> bool {
        match self.alloc.allocate(n) {
            Some(mut more) => {
                self.blocks.append(&mut more.blocks);
                true
            }
            None => false,
        }
    }
}

impl Drop for BlockList {
    fn drop(&mut self) {
        self.alloc.inner.borrow_mut().free.append(&mut self.blocks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_return_on_drop() {
        let a = BlockAllocator::new(8);
        let mut x = a.allocate(3).unwrap();
        assert_eq!(x.ids(), &[2, 1, 0]);
        assert!(x.grow(2));
        assert_eq!(a.free_blocks(), 3);
        assert!(a.allocate(4).is_none());
        assert_eq!(a.free_blocks(), 3, "a failed allocation takes nothing");
        let y = a.allocate(3).unwrap();
        assert!(!x.grow(1));
        drop(x);
        assert_eq!(a.free_blocks(), 5);
        drop(y);
        assert_eq!(a.free_blocks(), 8);
    }

    #[test]
    fn pool_sizes() {
        let l = KvLayout {
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        };
        let p = KvPool::new(l, 30, 4);
        assert_eq!(p.bytes(), 30 * 4 * 2 * 3 * 16 * 64 * 4);
        assert_eq!(KvPool::bytes_per_token(l, 30), 2 * 3 * 64 * 4 * 30);
    }
}

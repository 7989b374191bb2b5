//! Prefix-cache block hashing, shared by the engine's block manager and the router's KV index.
//!
//! A block's hash chains its parent's: `xxh3_64(parent_hash as u64 LE ‖ token ids as u32 LE)`, with
//! parent 0 for the first block. Two sequences share a block hash only if they share every token
//! up to the end of that block, so a hash names a whole prefix.

use xxhash_rust::xxh3::Xxh3;

/// The chained hash of one full KV block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// The parent of the first block.
pub const ROOT: BlockHash = BlockHash(0);

/// Hashes one block given its parent's hash.
pub fn hash_block(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = Xxh3::new();
    h.update(&parent.0.to_le_bytes());
    for t in tokens {
        h.update(&t.to_le_bytes());
    }
    BlockHash(h.digest())
}

/// Chained hashes of every full block of `tokens`; a trailing partial block has none.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    assert!(block_size > 0, "block size must be positive");
    let mut parent = ROOT;
    tokens
        .chunks_exact(block_size)
        .map(|b| {
            parent = hash_block(parent, b);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_one_shot_xxh3_over_the_documented_bytes() {
        let toks = [1u32, 2, 3, 70000];
        let mut bytes = 0u64.to_le_bytes().to_vec();
        toks.iter()
            .for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
        assert_eq!(
            hash_block(ROOT, &toks).0,
            xxhash_rust::xxh3::xxh3_64(&bytes)
        );
    }

    #[test]
    fn chaining_names_the_whole_prefix() {
        let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7], 2);
        assert_eq!(a.len(), 3);
        let b = block_hashes(&[1, 2, 3, 4, 9, 9], 2);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same block content after a different prefix hashes differently.
        let c = block_hashes(&[0, 0, 5, 6], 2);
        assert_ne!(c[1], a[2]);
        assert_eq!(a[1], hash_block(a[0], &[3, 4]));
    }
}

//! Prefix-cache block hashing, shared by the engine's block manager and the router's KV index.
//!
//! A block's hash chains its parent's: `xxh3_64(parent_hash as u64 LE ‖ token ids as u32 LE)`, with
//! parent 0 for the first block (the chain of a sequence run with a LoRA adapter starts from the
//! adapter's content hash instead: [`chain_root`]). Two sequences share a block hash only if they share every token
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

/// The hash a sequence's chain starts from: [`ROOT`] for the base model, a LoRA adapter's
/// content hash for a sequence that runs with it. A block's K/V depends on the adapter, so the
/// same tokens under two adapters (or one and the base) share no block.
pub fn chain_root(adapter: Option<u64>) -> BlockHash {
    adapter.map_or(ROOT, BlockHash)
}

/// Chained hashes of every full block of `tokens`; a trailing partial block has none.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    block_hashes_from(ROOT, tokens, block_size)
}

/// [`block_hashes`] of a chain that starts from `root` ([`chain_root`]).
pub fn block_hashes_from(root: BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    assert!(block_size > 0, "block size must be positive");
    let mut parent = root;
    tokens
        .chunks_exact(block_size)
        .map(|b| {
            parent = hash_block(parent, b);
            parent
        })
        .collect()
}

/// A short text that names a model's files as they are: each file's name and size and the
/// xxh3 of its first and last MiB (every file of a directory, in name order). Cheap for files of
/// any size; two different weights files agree on it only by a collision of all of that.
pub fn file_identity(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut files = Vec::new();
    if path.is_dir() {
        for e in std::fs::read_dir(path)? {
            let p = e?.path();
            if p.is_file() {
                files.push(p);
            }
        }
        files.sort();
    } else {
        files.push(path.to_path_buf());
    }
    let mut out = String::new();
    for p in files {
        let mut f = std::fs::File::open(&p)?;
        let len = f.metadata()?.len();
        let mut head = vec![0u8; len.min(1 << 20) as usize];
        f.read_exact(&mut head)?;
        let mut tail = vec![0u8; len.min(1 << 20) as usize];
        f.seek(SeekFrom::Start(len - tail.len() as u64))?;
        f.read_exact(&mut tail)?;
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
        out += &format!(
            "{}:{len}:{:016x}:{:016x};",
            name.unwrap_or_default(),
            xxhash_rust::xxh3::xxh3_64(&head),
            xxhash_rust::xxh3::xxh3_64(&tail)
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_identity_changes_with_the_bytes() {
        let dir = std::env::temp_dir().join(format!("tandem-identity-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("w.bin");
        std::fs::write(&p, vec![7u8; 3 << 20]).unwrap();
        let a = file_identity(&p).unwrap();
        assert_eq!(a, file_identity(&p).unwrap());
        let mut bytes = vec![7u8; 3 << 20];
        bytes[(3 << 20) - 5] = 8;
        std::fs::write(&p, bytes).unwrap();
        let b = file_identity(&p).unwrap();
        assert_ne!(a, b);
        assert!(file_identity(&dir).unwrap().starts_with("w.bin:3145728:"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

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

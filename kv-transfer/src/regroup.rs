//! A sender's chunk of blocks as the receiver takes it: one frame per block, layer and receiver
//! KV head range, each either a piece of the sender's KV as it is (the two sides' ranks hold the
//! same heads) or rebuilt from the sender's pieces ([`regroup`]); or one whole-block frame per
//! layer for a receiver that described no ranges.

use std::ops::Range;

use crate::shape::{regroup, KvShape};
use crate::transport::BlockFrame;
use crate::TransferError;
use tandem_types::BlockId;

/// Some KV heads of a run of blocks on the sending side, in the wire layout of those heads: per
/// layer, the blocks' frames back to back.
#[derive(Clone, Copy, Debug)]
pub struct HeadsKv<'a> {
    /// The KV heads.
    pub heads: &'a Range<u32>,
    /// Per layer, the blocks' frames back to back (each `frame_len` bytes).
    pub layers: &'a [Vec<u8>],
    /// Bytes of one block's frame in one layer.
    pub frame_len: usize,
}

impl<'a> HeadsKv<'a> {
    /// One layer of the `j`-th block of the run: one frame's payload.
    pub fn frame(&self, layer: usize, j: usize) -> &'a [u8] {
        &self.layers[layer][j * self.frame_len..(j + 1) * self.frame_len]
    }
}

/// A run of a prompt's blocks to send: the `blocks` blocks from the prompt's `first`, held by the
/// sender as `pieces` (head ranges in order, covering its heads).
#[derive(Clone, Debug)]
pub struct OutgoingChunk<'a> {
    /// The prompt's first block in the run.
    pub first: usize,
    /// Blocks in the run.
    pub blocks: usize,
    /// The sender's pieces of it.
    pub pieces: Vec<HeadsKv<'a>>,
}

impl OutgoingChunk<'_> {
    /// Layers of every block.
    pub fn layers(&self) -> usize {
        self.pieces.first().map_or(0, |p| p.layers.len())
    }
}

/// How a chunk goes to one receiver: per frame of a block layer, the header's heads and the
/// sender piece it is (if one is), and the frames that had to be rebuilt.
#[derive(Clone, Debug)]
pub struct FramePlan {
    /// Per frame of a block layer: the header's heads, and the piece it is, if one is.
    targets: Vec<(Range<u16>, Option<usize>)>,
    /// The rebuilt frames, `[block][layer][target]` over the targets that are no piece.
    built: Vec<Vec<u8>>,
}

impl FramePlan {
    /// Plans (and rebuilds where needed) `chunk`'s frames for a receiver taking head ranges
    /// `want` (None or empty: whole blocks), with the sender's cache `mine` for the layout; or
    /// [`TransferError::Mismatch`] saying why the chunk cannot make them (heads the sender's
    /// pieces do not cover, no host cache to rebuild from, heads a header cannot carry).
    pub fn new(
        chunk: &OutgoingChunk<'_>,
        want: Option<&[Range<u32>]>,
        mine: Option<&KvShape>,
    ) -> Result<Self, TransferError> {
        let pieces = &chunk.pieces;
        let all =
            pieces.first().map_or(0, |p| p.heads.start)..pieces.last().map_or(0, |p| p.heads.end);
        let ranges: Vec<(Range<u16>, Range<u32>)> = match want {
            Some(w) if !w.is_empty() => w
                .iter()
                .map(|r| {
                    let h = u16::try_from(r.start).and_then(|s| Ok(s..u16::try_from(r.end)?));
                    h.map(|h| (h, r.clone())).map_err(|_| {
                        TransferError::Mismatch(format!("KV heads {r:?} do not fit a frame header"))
                    })
                })
                .collect::<Result<_, _>>()?,
            _ => vec![(0..0, all)],
        };
        let targets: Vec<(Range<u16>, Option<usize>, Range<u32>)> = ranges
            .into_iter()
            .map(|(h, r)| {
                let direct = pieces.iter().position(|p| *p.heads == r);
                (h, direct, r)
            })
            .collect();
        let mut built = Vec::new();
        if targets.iter().any(|(_, direct, _)| direct.is_none()) {
            let shape = mine.ok_or_else(|| {
                TransferError::Mismatch(
                    "the sender has no host cache to rebuild KV heads from".into(),
                )
            })?;
            for j in 0..chunk.blocks {
                for layer in 0..chunk.layers() {
                    let have: Vec<(Range<u32>, &[u8])> = pieces
                        .iter()
                        .map(|p| (p.heads.clone(), p.frame(layer, j)))
                        .collect();
                    for (_, direct, r) in &targets {
                        if direct.is_none() {
                            let frame = regroup(shape, &have, r.clone()).ok_or_else(|| {
                                TransferError::Mismatch(format!(
                                    "the sender's KV does not hold heads {r:?}"
                                ))
                            })?;
                            built.push(frame);
                        }
                    }
                }
            }
        }
        Ok(Self {
            targets: targets.into_iter().map(|(h, d, _)| (h, d)).collect(),
            built,
        })
    }

    /// `chunk`'s frames to destination blocks `dest` (the receiver's ids of the prompt's
    /// blocks), block after block, layer after layer, as planned.
    pub fn frames<'a>(&'a self, chunk: &OutgoingChunk<'a>, dest: &[u32]) -> Vec<BlockFrame<'a>> {
        let mut built = self.built.iter();
        let mut frames = Vec::with_capacity(chunk.blocks * chunk.layers() * self.targets.len());
        for j in 0..chunk.blocks {
            let block = BlockId(dest[chunk.first + j]);
            for layer in 0..chunk.layers() {
                for (heads, direct) in &self.targets {
                    let payload = match direct {
                        Some(p) => chunk.pieces[*p].frame(layer, j),
                        None => built.next().map_or(&[][..], |b| &b[..]),
                    };
                    frames.push(BlockFrame {
                        layer: layer as u32,
                        block,
                        heads: heads.clone(),
                        payload,
                    });
                }
            }
        }
        frames
    }
}

#[cfg(test)]
// Lists of KV head ranges with a single range (every head) are what these tests mean.
#[allow(clippy::single_range_in_vec_init)]
mod tests {
    use super::*;

    /// Three ranks of one head each.
    fn shape() -> KvShape {
        crate::shape::tests::shape("f32", vec![0..1, 1..2, 2..3])
    }

    /// Two blocks from a sender whose three ranks hold one head each: per head, per layer.
    fn layers(s: &KvShape) -> Vec<(Range<u32>, Vec<Vec<u8>>)> {
        let len = s.frame_len(1);
        (0..3u32)
            .map(|h| {
                let layers = (0..2)
                    .map(|l| {
                        (0..2 * len)
                            .map(|i| (i as u32 + 100 * h + 7 * l) as u8)
                            .collect()
                    })
                    .collect();
                (h..h + 1, layers)
            })
            .collect()
    }

    fn chunk<'a>(s: &KvShape, held: &'a [(Range<u32>, Vec<Vec<u8>>)]) -> OutgoingChunk<'a> {
        OutgoingChunk {
            first: 0,
            blocks: 2,
            pieces: held
                .iter()
                .map(|(heads, layers)| HeadsKv {
                    heads,
                    layers,
                    frame_len: s.frame_len(1),
                })
                .collect(),
        }
    }

    /// Frames for receivers of other sizes: a matching range goes as the piece itself, others
    /// are rebuilt (whole blocks for a receiver of one rank or of no ranges); heads the chunk
    /// does not hold are refused.
    #[test]
    fn frames_follow_the_receivers_head_ranges() {
        let s = shape();
        let held = layers(&s);
        let c = chunk(&s, &held);
        let dest = [10, 11];
        let g = FramePlan::new(&c, Some(&[0..1, 1..3]), Some(&s)).unwrap();
        let frames = g.frames(&c, &dest);
        // Two blocks × two layers × two ranges, block-major.
        assert_eq!(frames.len(), 8);
        assert_eq!(
            (frames[0].heads.clone(), frames[0].block),
            (0..1, BlockId(10))
        );
        assert_eq!(frames[0].payload, c.pieces[0].frame(0, 0));
        assert_eq!(frames[1].heads, 1..3);
        let have: Vec<(Range<u32>, &[u8])> = c
            .pieces
            .iter()
            .map(|p| (p.heads.clone(), p.frame(0, 0)))
            .collect();
        assert_eq!(Some(frames[1].payload.to_vec()), regroup(&s, &have, 1..3));
        assert_eq!((frames[7].layer, frames[7].block), (1, BlockId(11)));
        for want in [None, Some(&[0..3][..])] {
            let g = FramePlan::new(&c, want, Some(&s)).unwrap();
            let frames = g.frames(&c, &dest);
            assert_eq!(frames.len(), 4);
            assert!(frames.iter().all(|f| f.payload.len() == s.frame_len(3)));
            let heads = if want.is_none() { 0..0 } else { 0..3 };
            assert!(frames.iter().all(|f| f.heads == heads));
        }
        let e = FramePlan::new(&c, Some(&[0..4]), Some(&s)).err().unwrap();
        assert!(e.to_string().contains("does not hold heads 0..4"), "{e}");
        let e = FramePlan::new(&c, Some(&[0..3]), None).err().unwrap();
        assert!(e.to_string().contains("no host cache"), "{e}");
        let e = FramePlan::new(&c, Some(&[0..70_000]), Some(&s))
            .err()
            .unwrap();
        assert!(e.to_string().contains("do not fit a frame header"), "{e}");
    }

    /// A chunk later in the prompt goes to the destination blocks at its place.
    #[test]
    fn a_later_chunk_lands_at_its_place_in_the_prompt() {
        let s = shape();
        let held = layers(&s);
        let mut c = chunk(&s, &held);
        c.first = 3;
        let g = FramePlan::new(&c, Some(&[0..1, 1..2, 2..3]), Some(&s)).unwrap();
        let frames = g.frames(&c, &[20, 21, 22, 23, 24]);
        let blocks: Vec<u32> = frames.iter().map(|f| f.block.0).collect();
        assert_eq!(blocks, [23, 23, 23, 23, 23, 23, 24, 24, 24, 24, 24, 24]);
        // Every frame is a piece as it is: nothing was rebuilt.
        assert!(g.built.is_empty());
    }
}

//! Tensor parallelism: how a model's weights and KV heads are split over the ranks of a group
//! (Megatron's scheme), and which part of each tensor a rank loads.
//!
//! Each rank of a group of `size` holds:
//! - whole query heads `q_heads`, and the KV heads they read, `kv_heads`: the KV heads split
//!   evenly when there are at least as many as ranks, else each replicated on the ranks whose
//!   query heads share it;
//! - the q/k/v rows of those heads and the o columns (o is row-parallel: the ranks' products are
//!   partial sums, all-reduced);
//! - a slice `ff` of the MLP: gate and up rows, down columns (row-parallel again);
//! - a slice `vocab` of the embedding's rows (a lookup of a token outside it gives zeros, and the
//!   all-reduce puts the one rank's row everywhere) and of the head's rows (each rank's logits
//!   are gathered).
//!
//! Norms and the rotary table are replicated. A split that would cut a head, or give the ranks
//! unequal query heads, is refused with the reason: the attention kernels work on whole groups
//! of query heads per KV head.
//!
//! Expert parallelism ([`TpShard::expert_rank`]) splits a mixture of experts' experts instead:
//! each rank holds a contiguous block of them, and everything else whole. Attention is data
//! parallel: each rank takes its own sequences of a step (their KV in one pool the ranks share),
//! every row-wise op keeps its bits whichever rank computes the row, and the experts' rows go to
//! the ranks that hold them and back (two all-to-alls a layer), so a group of any size gives the
//! bits of one rank. Tensor-parallel attention would cut each row's sums by ranks and change
//! them, and all-reduce every layer's activations.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::ops::Range;

use tandem_model::{get_tensor, ModelConfig, TensorData, TensorName};

use crate::error::EngineError;

/// One rank's share of a model split over a tensor-parallel group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpShard {
    /// This rank, `0..size`.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
    /// The query heads this rank computes.
    pub q_heads: Range<usize>,
    /// The KV heads its queries read (its slice of the cache).
    pub kv_heads: Range<usize>,
    /// Its slice of the MLP's intermediate features.
    pub ff: Range<usize>,
    /// Its slice of the vocabulary (embedding and head rows).
    pub vocab: Range<usize>,
    /// The experts of a mixture of experts this rank holds (all of them but under expert
    /// parallelism; empty for a dense model).
    pub experts: Range<usize>,
    /// Expert parallelism: this rank's place `(rank, size)` in its group; None outside it.
    pub ep: Option<(usize, usize)>,
}

impl TpShard {
    /// The whole model: a group of one.
    pub fn whole(c: &ModelConfig) -> Self {
        Self {
            rank: 0,
            size: 1,
            q_heads: 0..c.num_heads,
            kv_heads: 0..c.num_kv_heads,
            ff: 0..c.intermediate_size,
            vocab: 0..c.vocab_size,
            experts: 0..c.moe.as_ref().map_or(0, |m| m.experts),
            ep: None,
        }
    }

    /// Rank `rank` of an expert-parallel group of `size`: a contiguous block of the experts,
    /// everything else whole (see the module's description).
    pub fn expert_rank(c: &ModelConfig, rank: usize, size: usize) -> Result<Self, EngineError> {
        let refuse = |why: String| {
            EngineError::Config(format!("--ep {size} does not fit this model: {why}"))
        };
        let Some(m) = &c.moe else {
            return Err(refuse("it has no experts (a dense MLP)".into()));
        };
        if size == 0 || rank >= size {
            return Err(refuse(format!("rank {rank} of a group of {size}")));
        }
        if !m.experts.is_multiple_of(size) {
            return Err(refuse(format!(
                "its {} experts do not split evenly over {size} ranks",
                m.experts
            )));
        }
        let per = m.experts / size;
        Ok(Self {
            experts: rank * per..(rank + 1) * per,
            ep: Some((rank, size)),
            ..Self::whole(c)
        })
    }

    /// This rank's place `(rank, size)` in the group its steps run in: the expert-parallel
    /// group's, else the tensor-parallel one's.
    pub fn group(&self) -> (usize, usize) {
        self.ep.unwrap_or((self.rank, self.size))
    }

    /// The rank of an expert-parallel group of `size` that holds expert `e` of `experts`.
    pub fn expert_owner(e: usize, experts: usize, size: usize) -> usize {
        e / (experts / size).max(1)
    }

    /// Rank `rank`'s share of `c` split over `size` ranks, or why `c` does not split so.
    pub fn plan(c: &ModelConfig, size: usize, rank: usize) -> Result<Self, EngineError> {
        let refuse = |why: String| {
            EngineError::Config(format!("--tp {size} does not fit this model: {why}"))
        };
        if size == 0 || rank >= size {
            return Err(refuse(format!("rank {rank} of a group of {size}")));
        }
        if size > 1 && c.moe.is_some() {
            return Err(refuse(
                "its MLP is a mixture of experts, whose tensor-parallel split is not built (run it with --tp 1)".into(),
            ));
        }
        let (nq, nkv) = (c.num_heads, c.num_kv_heads);
        if !nq.is_multiple_of(size) {
            return Err(refuse(format!(
                "its {nq} query heads do not split evenly over {size} ranks (every rank computes whole heads, the same number; try a --tp that divides {nq})"
            )));
        }
        let q = nq / size;
        let kv_heads = if nkv.is_multiple_of(size) {
            let k = nkv / size;
            rank * k..(rank + 1) * k
        } else if size.is_multiple_of(nkv) {
            // More ranks than KV heads: each rank's queries sit in one group, whose KV head it
            // keeps a copy of.
            let group = nq / nkv;
            let h = rank * q / group;
            h..h + 1
        } else {
            return Err(refuse(format!(
                "its {nkv} KV heads neither split evenly over {size} ranks nor replicate evenly on them"
            )));
        };
        if !c.intermediate_size.is_multiple_of(size) {
            return Err(refuse(format!(
                "its {} MLP features do not split evenly over {size} ranks",
                c.intermediate_size
            )));
        }
        let ff = c.intermediate_size / size;
        let (_, pieces) = vocab_pieces(c.vocab_size, size);
        if pieces.iter().any(|&(_, len)| len == 0) {
            return Err(refuse(format!(
                "its vocabulary of {} tokens leaves a rank no slice of it",
                c.vocab_size
            )));
        }
        let (from, len) = pieces[rank];
        let vocab = from..from + len;
        Ok(Self {
            rank,
            size,
            q_heads: rank * q..(rank + 1) * q,
            kv_heads,
            ff: rank * ff..(rank + 1) * ff,
            vocab,
            experts: 0..c.moe.as_ref().map_or(0, |m| m.experts),
            ep: None,
        })
    }

    /// Every rank's share of `c` over `size` ranks.
    pub fn plan_all(c: &ModelConfig, size: usize) -> Result<Vec<Self>, EngineError> {
        (0..size).map(|r| Self::plan(c, size, r)).collect()
    }

    /// The model as this rank sees it: its heads, features and vocabulary slice (every other
    /// field as in `c`).
    pub fn local_config(&self, c: &ModelConfig) -> ModelConfig {
        ModelConfig {
            num_heads: self.q_heads.len(),
            num_kv_heads: self.kv_heads.len(),
            intermediate_size: self.ff.len(),
            vocab_size: self.vocab.len(),
            ..c.clone()
        }
    }

    /// Whether this is the whole model.
    pub fn is_whole(&self) -> bool {
        self.size == 1
    }

    /// Whether this rank is one of an expert-parallel group of more than one (whose ranks
    /// run different rows).
    pub fn is_expert_parallel(&self) -> bool {
        self.ep.is_some_and(|(_, size)| size > 1)
    }
}

/// How a vocabulary of `vocab` tokens splits over `size` ranks: the slice each rank holds but
/// the last (`vocab / size` rounded up), and each rank's `(first token, tokens)`; the last slice
/// is shorter where the division is not even (or empty). Gathers pad every slice to the first's.
pub(crate) fn vocab_pieces(vocab: usize, size: usize) -> (usize, Vec<(usize, usize)>) {
    let chunk = vocab.div_ceil(size.max(1));
    let pieces = (0..size)
        .map(|r| {
            let from = (r * chunk).min(vocab);
            (from, ((r + 1) * chunk).min(vocab) - from)
        })
        .collect();
    (chunk, pieces)
}

/// Which part of a tensor a rank loads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Cut {
    /// All of it.
    Whole,
    /// These rows of a matrix (these elements of a vector).
    Rows(Range<usize>),
    /// These columns of every row.
    Cols(Range<usize>),
    /// One expert's matrix of a tensor of every expert.
    Expert(usize),
}

/// A named tensor and the part of it a rank holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Part {
    pub name: TensorName,
    pub cut: Cut,
}

impl Part {
    pub fn whole(name: TensorName) -> Self {
        Self {
            name,
            cut: Cut::Whole,
        }
    }

    /// The part's data out of a model's `tensors` (borrowed when whole).
    pub fn tensor<'t>(
        &self,
        tensors: &'t BTreeMap<String, TensorData>,
    ) -> Result<Cow<'t, TensorData>, EngineError> {
        let t = get_tensor(tensors, self.name)?;
        let cut = |e: tandem_model::ModelError| {
            EngineError::Config(format!(
                "splitting {} for tensor parallelism: {e}",
                self.name.canonical()
            ))
        };
        Ok(match &self.cut {
            Cut::Whole => Cow::Borrowed(t),
            Cut::Rows(r) => Cow::Owned(t.slice_rows(r.clone()).map_err(cut)?),
            Cut::Cols(r) => Cow::Owned(t.slice_cols(r.clone()).map_err(cut)?),
            Cut::Expert(e) => Cow::Owned(
                t.expert(*e)
                    .map_err(|e| EngineError::Config(format!("{}: {e}", self.name.canonical())))?,
            ),
        })
    }

    /// Elements of the part of a tensor of `c`'s shape.
    pub fn elems(&self, c: &ModelConfig) -> usize {
        let shape = self.name.shape(c).unwrap_or_default();
        let whole: usize = shape.iter().product();
        match &self.cut {
            Cut::Whole => whole,
            Cut::Rows(r) => whole / shape[0].max(1) * r.len(),
            Cut::Cols(r) => whole / shape.last().copied().unwrap_or(1).max(1) * r.len(),
            Cut::Expert(_) => whole / shape[0].max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Slices of a vocabulary over ranks: equal but the last, which is shorter where the
    /// division is not even, or empty; every token in exactly one.
    #[test]
    fn the_vocabulary_splits_into_equal_slices_but_the_last() {
        assert_eq!(
            vocab_pieces(100, 4),
            (25, vec![(0, 25), (25, 25), (50, 25), (75, 25)])
        );
        assert_eq!(vocab_pieces(49152, 1), (49152, vec![(0, 49152)]));
        assert_eq!(vocab_pieces(10, 3), (4, vec![(0, 4), (4, 4), (8, 2)]));
        assert_eq!(
            vocab_pieces(9, 4),
            (3, vec![(0, 3), (3, 3), (6, 3), (9, 0)])
        );
        // A split that would leave a rank no slice is refused.
        let c = ModelConfig {
            vocab_size: 9,
            ..config(4, 4)
        };
        let e = TpShard::plan_all(&c, 4).unwrap_err().to_string();
        assert!(
            e.contains("vocabulary of 9 tokens leaves a rank no slice"),
            "{e}"
        );
        let c = ModelConfig {
            vocab_size: 9,
            ..config(3, 3)
        };
        assert_eq!(TpShard::plan_all(&c, 3).unwrap()[2].vocab, 6..9);
    }

    fn config(nq: usize, nkv: usize) -> ModelConfig {
        ModelConfig {
            num_heads: nq,
            num_kv_heads: nkv,
            intermediate_size: 96,
            vocab_size: 100,
            ..crate::testing::tiny_config()
        }
    }

    /// SmolLM2's 9 query and 3 KV heads: TP 3 gives each rank one KV head and its three
    /// queries; TP 2 cannot give the ranks whole, equal query heads and is refused.
    #[test]
    fn smollm2_shapes_split_over_three_and_not_two() {
        let c = config(9, 3);
        let s = TpShard::plan_all(&c, 3).unwrap();
        assert_eq!(
            s.iter().map(|s| s.q_heads.clone()).collect::<Vec<_>>(),
            [0..3, 3..6, 6..9]
        );
        assert_eq!(
            s.iter().map(|s| s.kv_heads.clone()).collect::<Vec<_>>(),
            [0..1, 1..2, 2..3]
        );
        assert_eq!(
            s.iter().map(|s| s.ff.clone()).collect::<Vec<_>>(),
            [0..32, 32..64, 64..96]
        );
        assert_eq!(
            s.iter().map(|s| s.vocab.clone()).collect::<Vec<_>>(),
            [0..34, 34..68, 68..100]
        );
        let e = TpShard::plan(&c, 2, 0).unwrap_err().to_string();
        assert!(
            e.contains("9 query heads do not split evenly over 2"),
            "{e}"
        );
        assert_eq!(TpShard::plan(&c, 1, 0).unwrap(), TpShard::whole(&c));
    }

    /// More ranks than KV heads: each KV head is kept by the ranks whose queries read it.
    #[test]
    fn kv_heads_replicate_when_ranks_outnumber_them() {
        let c = config(8, 2);
        let s = TpShard::plan_all(&c, 4).unwrap();
        assert_eq!(
            s.iter().map(|s| s.kv_heads.clone()).collect::<Vec<_>>(),
            [0..1, 0..1, 1..2, 1..2]
        );
        assert_eq!(s[3].local_config(&c).num_heads, 2);
        assert_eq!(s[3].local_config(&c).num_kv_heads, 1);
        // 12 query heads over 4 KV heads on 3 ranks: rank 0's four queries span two groups
        // partly; refused.
        let e = TpShard::plan(&config(12, 4), 3, 0).unwrap_err().to_string();
        assert!(e.contains("neither split evenly"), "{e}");
        let e = TpShard::plan(&config(8, 2), 4, 4).unwrap_err().to_string();
        assert!(e.contains("rank 4 of a group of 4"), "{e}");
    }
}

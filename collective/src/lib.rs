//! tandem-collective: what the ranks of one tensor-parallel forward exchange.
//!
//! [`Collective`] is the interface a sharded forward calls: an in-place all-reduce (sum), an
//! all-gather, a broadcast, a barrier, send/recv between two ranks (for pipeline stages), and an
//! all-to-all of any lengths (expert parallelism's dispatch and combine).
//! Every rank calls the same collectives in the same order.
//!
//! Implementations:
//! - [`SingleRank`]: a group of one (TP 1), where every collective is a copy or nothing;
//! - [`NcclRank`]: a rank on a CUDA GPU, exchanging through NCCL (see [`nccl`]);
//! - [`ThreadGroup`]: ranks that are threads of one process, exchanging through one shared
//!   allocation (per-rank slots, double-buffered, each with a ready stamp), as vLLM's CPU
//!   shared-memory all-reduce does. Sums are taken in rank order on every rank, so all ranks
//!   hold bit-identical results, and the same as a serial sum in that order.
//!
//! A rank that waits on a peer longer than the group's watchdog fails the collective with
//! [`CollectiveError::Timeout`], naming the ranks that did not arrive, instead of hanging; the
//! group is then poisoned and every later collective on it fails at once.

#![deny(missing_docs)]

pub mod nccl;
mod thread_group;

pub use nccl::{GroupAbort, NcclId, NcclRank};
pub use thread_group::{RankStats, ThreadGroup, ThreadRank};

use std::time::Duration;

/// What a collective can fail with.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CollectiveError {
    /// Peers did not arrive within the watchdog.
    #[error("{op} on rank {rank}: ranks {missing:?} did not arrive within {waited:?} (a rank skipped a collective, or is stuck)")]
    Timeout {
        /// The collective.
        op: &'static str,
        /// The rank that waited.
        rank: usize,
        /// The ranks it waited for.
        missing: Vec<usize>,
        /// How long it waited.
        waited: Duration,
    },
    /// An earlier collective of the group failed: the ranks no longer agree where they are.
    #[error("the group is poisoned by an earlier failure: {0}")]
    Poisoned(String),
    /// The arguments do not fit the collective.
    #[error("{0}")]
    Shape(String),
    /// The device or its collective library failed (NCCL, CUDA), or is not there.
    #[error("{0}")]
    Device(String),
}

/// Refuses a broadcast root outside a group of `size`.
fn check_root(root: usize, size: usize) -> Result<(), CollectiveError> {
    if root >= size {
        return Err(CollectiveError::Shape(format!(
            "broadcast from rank {root} in a group of {size}"
        )));
    }
    Ok(())
}

/// Refuses a send from `rank` to `peer` (`send`) or a receive on `rank` from `peer` (not
/// `send`) when `peer` is outside a group of `size`, or `rank` itself.
fn check_peer(send: bool, rank: usize, peer: usize, size: usize) -> Result<(), CollectiveError> {
    if peer < size && peer != rank {
        return Ok(());
    }
    Err(CollectiveError::Shape(if send {
        format!("send from rank {rank} to rank {peer} in a group of {size}")
    } else {
        format!("recv on rank {rank} from rank {peer} in a group of {size}")
    }))
}

/// The collectives of one rank of a group. Not `Send`: an NCCL rank stays on the thread that
/// made its communicator.
pub trait Collective {
    /// This rank's number, `0..size`.
    fn rank(&self) -> usize;

    /// Ranks in the group.
    fn size(&self) -> usize;

    /// Every rank's `buf` summed element-wise, into every rank's `buf`.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError>;

    /// Every rank's `mine` (all the same length), concatenated in rank order into `out`
    /// (`size × mine.len()` values).
    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), CollectiveError>;

    /// Rank `root`'s `buf` into every rank's `buf`.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError>;

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<(), CollectiveError>;

    /// Sends `buf` to rank `to`, which receives it with [`Collective::recv`].
    fn send(&mut self, to: usize, buf: &[f32]) -> Result<(), CollectiveError>;

    /// Receives into `buf` what rank `from` sent (the same length).
    fn recv(&mut self, from: usize, buf: &mut [f32]) -> Result<(), CollectiveError>;

    /// Each rank's `send[j]` to rank `j` (any lengths, one a rank, its own included): what every
    /// rank sent this one, in rank order (`[i]` from rank `i`). The exchange of expert
    /// parallelism: token rows out to the ranks of their experts, the experts' outputs back.
    fn all_to_all(&mut self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, CollectiveError>;
}

/// Refuses an all-to-all whose sends are not one a rank of a group of `size`.
fn check_sends(send: &[Vec<f32>], size: usize) -> Result<(), CollectiveError> {
    if send.len() == size {
        return Ok(());
    }
    Err(CollectiveError::Shape(format!(
        "all_to_all: {} sends in a group of {size}",
        send.len()
    )))
}

/// A group of one: TP 1.
#[derive(Debug, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn all_gather(&mut self, mine: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        if out.len() != mine.len() {
            return Err(CollectiveError::Shape(format!(
                "all_gather: {} values into {}",
                mine.len(),
                out.len()
            )));
        }
        out.copy_from_slice(mine);
        Ok(())
    }

    fn broadcast(&mut self, _buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        check_root(root, 1)?;
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Ok(())
    }

    fn send(&mut self, to: usize, _buf: &[f32]) -> Result<(), CollectiveError> {
        check_peer(true, 0, to, 1)
    }

    fn recv(&mut self, from: usize, _buf: &mut [f32]) -> Result<(), CollectiveError> {
        check_peer(false, 0, from, 1)
    }

    fn all_to_all(&mut self, send: &[Vec<f32>]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        check_sends(send, 1)?;
        Ok(send.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roots_and_peers_outside_the_group_or_the_rank_itself_are_refused() {
        assert_eq!(check_root(2, 3), Ok(()));
        let refused = |r: Result<(), CollectiveError>| match r {
            Err(CollectiveError::Shape(m)) => m,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            refused(check_root(3, 3)),
            "broadcast from rank 3 in a group of 3"
        );
        assert_eq!(check_peer(true, 0, 2, 3), Ok(()));
        assert_eq!(
            refused(check_peer(true, 1, 1, 3)),
            "send from rank 1 to rank 1 in a group of 3"
        );
        assert_eq!(
            refused(check_peer(false, 1, 4, 3)),
            "recv on rank 1 from rank 4 in a group of 3"
        );
        let mut one = SingleRank;
        assert_eq!(
            refused(one.send(0, &[1.0])),
            "send from rank 0 to rank 0 in a group of 1"
        );
    }
}

//! The CPU ranks' all-reduce on its own: the rate a group of rank threads sums a buffer at, for
//! the engine bench's tensor-parallel figures (set beside the memory copy rate).

use std::time::{Duration, Instant};

use tandem_collective::{Collective, ThreadGroup};

/// One all-reduce size's figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AllReduceRate {
    /// Ranks in the group.
    pub ranks: usize,
    /// Bytes of the buffer each rank contributes.
    pub bytes: usize,
    /// Median microseconds one all-reduce took (the slowest rank's).
    pub us: f64,
    /// The buffer's bytes over that time: the rate the group reduces at ("algorithm
    /// bandwidth" in NCCL's tests).
    pub gb_s: f64,
}

/// Median time of `rounds` all-reduces of `values` f32s over `ranks` rank threads.
pub fn all_reduce_rate(ranks: usize, values: usize, rounds: usize) -> AllReduceRate {
    let group = ThreadGroup::ranks(ranks, values.clamp(1, 1 << 22), Duration::from_secs(600));
    let handles: Vec<_> = group
        .into_iter()
        .map(|mut r| {
            std::thread::spawn(move || {
                let mut buf = vec![1f32; values];
                let mut times = Vec::with_capacity(rounds);
                // One untimed round to fault the pages in and line the ranks up.
                r.all_reduce_sum(&mut buf).expect("a healthy group");
                for _ in 0..rounds {
                    r.barrier().expect("a healthy group");
                    let t = Instant::now();
                    r.all_reduce_sum(&mut buf).expect("a healthy group");
                    times.push(t.elapsed().as_secs_f64());
                }
                times
            })
        })
        .collect();
    let per_rank: Vec<Vec<f64>> = handles
        .into_iter()
        .map(|h| h.join().expect("a rank thread"))
        .collect();
    let mut slowest: Vec<f64> = (0..rounds)
        .map(|i| per_rank.iter().map(|t| t[i]).fold(0.0, f64::max))
        .collect();
    let s = crate::percentile(&mut slowest, 0.5);
    let bytes = values * 4;
    AllReduceRate {
        ranks,
        bytes,
        us: s * 1e6,
        gb_s: if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_the_buffer_and_a_rate() {
        let r = all_reduce_rate(3, 1000, 5);
        assert_eq!((r.ranks, r.bytes), (3, 4000));
        assert!(r.us > 0.0 && r.gb_s > 0.0, "{r:?}");
        assert!((r.gb_s - 4000.0 / (r.us * 1e-6) / 1e9).abs() < 1e-9 * r.gb_s.max(1.0));
    }
}

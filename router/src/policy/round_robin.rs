//! Round-robin: each request to the next ready worker, ignoring load and caches.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Candidate, RoutingPolicy};

/// Picks the ready workers in turn; its only state is the turn counter.
#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn pick(&self, candidates: &[Candidate]) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % candidates.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_through_workers() {
        let p = RoundRobin::default();
        let c = [Candidate::default(); 3];
        let picks: Vec<usize> = (0..6).map(|_| p.pick(&c)).collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }
}

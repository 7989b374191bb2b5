//! Least-load: the worker with the fewest requests in flight from this router; ties go to the
//! one sent the fewest requests overall, so an idle cluster still spreads.

use super::{argmin, Candidate, RoutingPolicy};

/// Picks the worker with the fewest requests in flight from this router.
pub struct LeastLoad;

impl RoutingPolicy for LeastLoad {
    fn name(&self) -> &'static str {
        "least-load"
    }

    fn pick(&self, candidates: &[Candidate]) -> usize {
        argmin(candidates, |c| (c.load, c.assigned))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewest_in_flight_then_fewest_assigned() {
        let c = |load, assigned| Candidate {
            load,
            assigned,
            ..Default::default()
        };
        assert_eq!(LeastLoad.pick(&[c(3, 0), c(1, 9), c(2, 0)]), 1);
        assert_eq!(LeastLoad.pick(&[c(1, 5), c(1, 4)]), 1);
    }
}

//! Conditional disaggregation: whether a request's prompt is prefilled on a prefill worker, and
//! which ones to try in what order (DESIGN.md §2, step 2).
//!
//! Remote only pays when the prompt is long: moving KV costs a round trip and bandwidth, and a
//! short prompt prefilled in the decode worker's next step barely delays the others. So a prompt
//! goes remote when the part the chosen decode worker does not already cache is at least
//! `min_tokens`, and some prefill worker has room (fewer than `capacity` prompts of ours in
//! flight). Candidates are ordered by the work they would do: the prompt tokens they do not hold
//! in their own prefix cache, plus `load_weight` blocks' worth per prompt already queued on them.

/// What the decision knows about one ready prefill worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillCandidate {
    /// Prompts this router has sent it that have not produced their first token yet.
    pub in_flight: usize,
    /// Leading prompt tokens it holds in its prefix cache.
    pub cached_tokens: usize,
}

/// When a prompt is prefilled on a prefill worker, and how the prefill workers are ranked
/// (`--disagg-min-tokens`, `--prefill-capacity`).
#[derive(Clone, Copy, Debug)]
pub struct DisaggConfig {
    /// A prompt goes remote only when at least this many of its tokens are not in the chosen
    /// decode worker's prefix cache.
    pub min_tokens: usize,
    /// Prompts of this router in flight on one prefill worker (not yet at their first token)
    /// beyond which it takes no more.
    pub capacity: usize,
    /// Prompt tokens one queued prompt on a prefill worker is worth.
    pub load_tokens: f64,
    /// Whether a decode worker that holds at least `min_tokens` more of a prompt than the chosen
    /// one is a candidate too (the KV is pulled from it instead of computed).
    pub pull_from_peers: bool,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            min_tokens: 256,
            capacity: 4,
            load_tokens: 512.0,
            pull_from_peers: true,
        }
    }
}

/// The candidates to try, best first (indices into `candidates`); empty means prefill locally.
pub fn plan(
    cfg: &DisaggConfig,
    prompt_tokens: usize,
    uncached_on_decode: usize,
    candidates: &[PrefillCandidate],
) -> Vec<usize> {
    if uncached_on_decode < cfg.min_tokens.max(1) {
        return Vec::new();
    }
    let mut open: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].in_flight < cfg.capacity)
        .collect();
    let cost = |c: &PrefillCandidate| {
        prompt_tokens.saturating_sub(c.cached_tokens) as f64 + cfg.load_tokens * c.in_flight as f64
    };
    open.sort_by(|&a, &b| {
        cost(&candidates[a])
            .partial_cmp(&cost(&candidates[b]))
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    open
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(in_flight: usize, cached_tokens: usize) -> PrefillCandidate {
        PrefillCandidate {
            in_flight,
            cached_tokens,
        }
    }

    #[test]
    fn short_or_cached_prompts_stay_local() {
        let cfg = DisaggConfig::default();
        assert!(plan(&cfg, 200, 200, &[c(0, 0)]).is_empty(), "short");
        assert!(
            plan(&cfg, 2000, 100, &[c(0, 0)]).is_empty(),
            "long, but the decode worker caches all but 100 tokens"
        );
        assert_eq!(
            plan(&cfg, 300, 256, &[c(0, 0)]),
            vec![0],
            "at the threshold"
        );
        assert!(plan(&cfg, 300, 300, &[]).is_empty(), "no prefill workers");
    }

    #[test]
    fn saturated_workers_are_skipped_and_the_rest_ordered_by_work() {
        let cfg = DisaggConfig::default();
        // 0: full; 1: idle, nothing cached (cost 1024); 2: idle, a quarter cached (768);
        // 3: one queued (512), all cached (0).
        let cands = [c(4, 0), c(0, 0), c(0, 256), c(1, 1024)];
        assert_eq!(plan(&cfg, 1024, 1024, &cands), vec![3, 2, 1]);
        assert!(plan(&cfg, 1024, 1024, &[c(4, 0), c(9, 0)]).is_empty());
    }
}

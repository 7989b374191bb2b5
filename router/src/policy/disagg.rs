//! Conditional disaggregation: whether a request's prompt is prefilled on a prefill worker, and
//! which ones to try in what order (DESIGN.md §2, step 2).
//!
//! Remote only pays when the prompt is long: moving KV costs a round trip and bandwidth, and a
//! short prompt prefilled in the decode worker's next step barely delays the others. So a prompt
//! goes remote when the part the chosen decode worker does not already cache is at least
//! `min_tokens`, and some prefill worker has room (fewer than `capacity` prompts of ours in
//! flight). Candidates are ordered by the work they would do: the prompt tokens they do not hold
//! in their own prefix cache, plus `load_weight` blocks' worth per prompt already queued on them.
//!
//! Where the rates are known, the crossover is measured rather than fixed: computing the prompt
//! on the decode worker takes its uncached tokens over its prefill rate; a candidate takes the
//! longer of computing what it lacks at its rate and moving the prompt's KV over the link the
//! decode worker measured from it (the push overlaps the compute). A candidate estimated no
//! faster than computing locally is dropped: the prompt is computed where it decodes.

use tandem_types::MIN_ITL_PREFILL_CHUNK;

/// What the decision knows about one ready prefill worker.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PrefillCandidate {
    /// Prompts this router has sent it that have not produced their first token yet.
    pub in_flight: usize,
    /// Leading prompt tokens it holds in its prefix cache.
    pub cached_tokens: usize,
    /// Seconds until the decode worker would hold the prompt's KV through this candidate, when
    /// its prefill rate and its link to the decode worker have been measured.
    pub estimate_s: Option<f64>,
}

/// Seconds a prompt's KV takes through a candidate: the longer of computing its `uncached`
/// tokens at `rate` tokens a second and moving `tokens` tokens' KV (`kv_bytes` a token) at
/// `link` bytes a second. None while any rate is unknown (0).
pub fn estimate(
    uncached: usize,
    rate: f64,
    tokens: usize,
    kv_bytes: f64,
    link: f64,
) -> Option<f64> {
    let compute = if uncached == 0 {
        0.0
    } else if rate > 0.0 {
        uncached as f64 / rate
    } else {
        return None;
    };
    if link <= 0.0 || kv_bytes <= 0.0 {
        return None;
    }
    Some(compute.max(tokens as f64 * kv_bytes / link))
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

/// The threshold of uncached tokens above which a prompt may go to a prefill worker, for a
/// decode worker with `decoding` streams decoding, an ITL target of `itl_target_ms` (0: none)
/// and a measured prefill rate of `tokens_per_s` (0: unmeasured): `min_tokens`, or, while
/// streams decode under a target, the tokens it computes within one target if fewer. A prompt
/// longer than that, computed there, would hold its streams' gaps past the target (or, as the
/// engine chunks it to keep them, wait several steps for its own first token).
///
/// Never below [`MIN_ITL_PREFILL_CHUNK`] on the target's account (only a configured
/// `min_tokens` may be lower): the decode worker's engine computes that many prompt tokens in
/// its next step whatever the target leaves, so a shorter prompt gains nothing remote. (The
/// rate is an average over recent steps' prompt tokens, and a step of a few tokens measures
/// mostly the step's fixed cost: on a loaded machine it said a 4-token prompt would not fit in
/// a 100 ms target, and the prompt went to a prefill worker.)
pub fn min_tokens(
    cfg: &DisaggConfig,
    decoding: u32,
    itl_target_ms: f64,
    tokens_per_s: f64,
) -> usize {
    let min = cfg.min_tokens.max(1);
    if decoding == 0
        || itl_target_ms.is_nan()
        || itl_target_ms <= 0.0
        || tokens_per_s.is_nan()
        || tokens_per_s <= 0.0
    {
        return min;
    }
    let within = (tokens_per_s * itl_target_ms / 1e3).ceil() as usize;
    within.max(MIN_ITL_PREFILL_CHUNK).min(min)
}

/// The candidates to try, best first (indices into `candidates`); empty means prefill locally.
/// `local_s`: the seconds computing the prompt on the decode worker would take, when its rate is
/// known.
/// `threshold`: [`min_tokens`]'s answer for the decode worker.
pub fn plan(
    cfg: &DisaggConfig,
    threshold: usize,
    prompt_tokens: usize,
    uncached_on_decode: usize,
    candidates: &[PrefillCandidate],
    local_s: Option<f64>,
) -> Vec<usize> {
    if uncached_on_decode < threshold.max(1) {
        return Vec::new();
    }
    let slower =
        |c: &PrefillCandidate| matches!((c.estimate_s, local_s), (Some(r), Some(l)) if r >= l);
    let mut open: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].in_flight < cfg.capacity && !slower(&candidates[i]))
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

    #[test]
    fn a_candidate_estimated_no_faster_than_computing_locally_is_dropped() {
        let cfg = DisaggConfig::default();
        // 4096 tokens: 2 s locally at 2048 tokens/s.
        let local = Some(4096.0 / 2048.0);
        // Holds it all; 4096 tokens × 48 KiB over a 1 Gbit/s link: 1.6 s. Pulled.
        let fast = estimate(1, 2048.0, 4096, 48.0 * 1024.0, 125e6);
        assert!((fast.unwrap() - 4096.0 * 48.0 * 1024.0 / 125e6).abs() < 1e-9);
        // The same over 100 Mbit/s: 16 s. Computed here instead.
        let slow = estimate(1, 2048.0, 4096, 48.0 * 1024.0, 12.5e6);
        let cand = |estimate_s| PrefillCandidate {
            in_flight: 0,
            cached_tokens: 4095,
            estimate_s,
        };
        assert_eq!(
            plan(&cfg, cfg.min_tokens, 4096, 4096, &[cand(fast)], local),
            [0]
        );
        assert!(plan(&cfg, cfg.min_tokens, 4096, 4096, &[cand(slow)], local).is_empty());
        // Unmeasured (a rate of 0): the threshold alone decides, as before.
        assert_eq!(estimate(10, 0.0, 4096, 1.0, 1.0), None);
        assert_eq!(
            plan(&cfg, cfg.min_tokens, 4096, 4096, &[cand(None)], local),
            [0]
        );
        assert_eq!(
            plan(&cfg, cfg.min_tokens, 4096, 4096, &[cand(slow)], None),
            [0]
        );
    }

    fn c(in_flight: usize, cached_tokens: usize) -> PrefillCandidate {
        PrefillCandidate {
            in_flight,
            cached_tokens,
            estimate_s: None,
        }
    }

    #[test]
    fn short_or_cached_prompts_stay_local() {
        let cfg = DisaggConfig::default();
        assert!(
            plan(&cfg, cfg.min_tokens, 200, 200, &[c(0, 0)], None).is_empty(),
            "short"
        );
        assert!(
            plan(&cfg, cfg.min_tokens, 2000, 100, &[c(0, 0)], None).is_empty(),
            "long, but the decode worker caches all but 100 tokens"
        );
        assert_eq!(
            plan(&cfg, cfg.min_tokens, 300, 256, &[c(0, 0)], None),
            vec![0],
            "at the threshold"
        );
        assert!(
            plan(&cfg, cfg.min_tokens, 300, 300, &[], None).is_empty(),
            "no prefill workers"
        );
    }

    #[test]
    fn saturated_workers_are_skipped_and_the_rest_ordered_by_work() {
        let cfg = DisaggConfig::default();
        // 0: full; 1: idle, nothing cached (cost 1024); 2: idle, a quarter cached (768);
        // 3: one queued (512), all cached (0).
        let cands = [c(4, 0), c(0, 0), c(0, 256), c(1, 1024)];
        assert_eq!(
            plan(&cfg, cfg.min_tokens, 1024, 1024, &cands, None),
            vec![3, 2, 1]
        );
        assert!(plan(&cfg, cfg.min_tokens, 1024, 1024, &[c(4, 0), c(9, 0)], None).is_empty());
    }

    #[test]
    fn under_an_itl_target_a_prompt_longer_than_one_target_goes_remote_while_streams_decode() {
        let cfg = DisaggConfig::default();
        // 1000 tokens/s, a 70 ms target: 70 tokens fit in one target.
        assert_eq!(min_tokens(&cfg, 3, 70.0, 1000.0), 70);
        // No stream decoding, no target or no measure: the configured threshold.
        assert_eq!(min_tokens(&cfg, 0, 70.0, 1000.0), 256);
        assert_eq!(min_tokens(&cfg, 3, 0.0, 1000.0), 256);
        assert_eq!(min_tokens(&cfg, 3, 70.0, 0.0), 256);
        assert_eq!(min_tokens(&cfg, 3, f64::NAN, 1000.0), 256);
        // A fast worker: more than the threshold fits in a target; the threshold stays.
        assert_eq!(min_tokens(&cfg, 3, 70.0, 10_000.0), 256);
        // Never below the engine's prompt floor under a target: a rate measured on steps of a
        // few prompt tokens (3 tokens in a 60 ms step: 50 tokens/s) would say 5 tokens.
        assert_eq!(MIN_ITL_PREFILL_CHUNK, 16);
        assert_eq!(min_tokens(&cfg, 3, 100.0, 50.0), 16);
        assert_eq!(min_tokens(&cfg, 3, 0.001, 1.0), 16);
        assert!(plan(&cfg, 16, 4, 4, &[c(0, 0)], Some(0.08)).is_empty());
        assert!(plan(&cfg, 16, 15, 15, &[c(0, 0)], Some(0.3)).is_empty());
        assert_eq!(plan(&cfg, 16, 16, 16, &[c(0, 0)], Some(0.3)), [0]);
        // Unless the configured threshold is lower: it is the operator's floor.
        let low = DisaggConfig {
            min_tokens: 4,
            ..cfg
        };
        assert_eq!(min_tokens(&low, 3, 0.001, 1.0), 4);
        assert_eq!(min_tokens(&low, 0, 70.0, 1000.0), 4);
        // A 200-token prompt: local while nothing decodes, remote while streams decode.
        let idle = min_tokens(&cfg, 0, 70.0, 1000.0);
        let busy = min_tokens(&cfg, 2, 70.0, 1000.0);
        assert!(plan(&cfg, idle, 200, 200, &[c(0, 0)], Some(0.2)).is_empty());
        assert_eq!(plan(&cfg, busy, 200, 200, &[c(0, 0)], Some(0.2)), [0]);
    }
}

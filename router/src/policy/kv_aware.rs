//! KV-aware: send a request where its prompt's prefix is already cached.
//!
//! Cost of a worker = blocks it would have to prefill + `disk_weight` × blocks it would read back
//! from its disk tier + `load_weight` × its requests in flight;
//! the cheapest wins (ties: fewest requests assigned, so distinct prefixes spread). When load is
//! imbalanced (the busiest worker has more than `balance_abs` requests over the idlest and more
//! than `balance_rel` times its load) the policy falls back to least-load, so one hot prefix
//! cannot pile every request onto one worker. The thresholds follow the shape of SGLang's
//! cache-aware router (absolute and relative imbalance, both required).

use super::{argmin, Candidate, RoutingPolicy};

/// The KV-aware policy's weights and its imbalance thresholds (`--kv-load-weight`,
/// `--balance-abs`, `--balance-rel`).
#[derive(Clone, Copy, Debug)]
pub struct KvAwareConfig {
    /// Blocks of prefill one in-flight request is worth.
    pub load_weight: f64,
    /// Blocks of prefill reading one block back from a worker's disk tier is worth (`bench
    /// kv-tiers` measured 0.05 for a 4k-token prompt on a VM's disk, 0.12 at 1k).
    pub disk_weight: f64,
    /// Load is imbalanced only when the busiest worker has more than this many requests in
    /// flight over the idlest ...
    pub balance_abs: usize,
    /// ... and more than this many times as many.
    pub balance_rel: f64,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self {
            load_weight: 1.0,
            disk_weight: 0.1,
            balance_abs: 8,
            balance_rel: 1.5,
        }
    }
}

/// Picks the worker with the least prefill-plus-load cost, falling back to least-load when load
/// is imbalanced.
pub struct KvAware {
    cfg: KvAwareConfig,
}

impl KvAware {
    /// A KV-aware policy with these weights and thresholds.
    pub fn new(cfg: KvAwareConfig) -> Self {
        Self { cfg }
    }

    fn imbalanced(&self, c: &[Candidate]) -> bool {
        let max = c.iter().map(|c| c.load).max().unwrap_or(0);
        let min = c.iter().map(|c| c.load).min().unwrap_or(0);
        max - min > self.cfg.balance_abs && max as f64 > self.cfg.balance_rel * min as f64
    }
}

impl RoutingPolicy for KvAware {
    fn name(&self) -> &'static str {
        "kv-aware"
    }

    fn needs_prefix_match(&self) -> bool {
        true
    }

    fn pick(&self, c: &[Candidate]) -> usize {
        if self.imbalanced(c) {
            return argmin(c, |c| (c.load, c.assigned));
        }
        argmin(c, |c| {
            let held = c.cached_blocks + c.disk_blocks;
            let prefill = c.prompt_blocks.saturating_sub(held) as f64;
            let read = self.cfg.disk_weight * c.disk_blocks as f64;
            (
                prefill + read + self.cfg.load_weight * c.load as f64,
                c.assigned,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(load: usize, assigned: u64, cached: usize) -> Candidate {
        Candidate {
            load,
            assigned,
            cached_blocks: cached,
            disk_blocks: 0,
            prompt_blocks: 40,
        }
    }

    #[test]
    fn a_prefix_on_disk_is_cheaper_than_none_and_dearer_than_the_pool() {
        let p = KvAware::new(KvAwareConfig::default());
        let disk = Candidate {
            disk_blocks: 32,
            ..c(0, 0, 0)
        };
        // Disk beats recompute ...
        assert_eq!(p.pick(&[c(0, 0, 0), disk]), 1);
        // ... the pool beats disk ...
        assert_eq!(p.pick(&[disk, c(0, 5, 32)]), 1);
        // ... and 32 blocks to read back (3.2 blocks of prefill) outweigh less load than that.
        assert_eq!(p.pick(&[Candidate { load: 3, ..disk }, c(0, 0, 0)]), 0);
        assert_eq!(p.pick(&[Candidate { load: 30, ..disk }, c(0, 0, 0)]), 1);
    }

    #[test]
    fn prefers_the_worker_holding_the_prefix() {
        let p = KvAware::new(KvAwareConfig::default());
        assert_eq!(p.pick(&[c(0, 0, 0), c(2, 5, 32)]), 1);
        // Same cost: the one assigned fewer requests.
        assert_eq!(p.pick(&[c(0, 3, 0), c(0, 2, 0)]), 1);
    }

    #[test]
    fn load_outweighs_a_small_cache_hit() {
        let p = KvAware::new(KvAwareConfig::default());
        assert_eq!(p.pick(&[c(0, 0, 0), c(5, 0, 3)]), 0);
    }

    #[test]
    fn a_hot_prefix_falls_back_to_least_load_when_imbalanced() {
        let p = KvAware::new(KvAwareConfig::default());
        // Worker 1 holds everything but has 9 more in flight: imbalance wins.
        assert_eq!(p.pick(&[c(0, 10, 0), c(9, 10, 40)]), 0);
        // 8 more is within the absolute threshold: the cache still decides.
        assert_eq!(p.pick(&[c(0, 10, 0), c(8, 10, 40)]), 1);
        // 9 more but not 1.5x: the relative threshold keeps the cache deciding.
        assert_eq!(p.pick(&[c(20, 0, 0), c(29, 0, 40)]), 1);
    }
}

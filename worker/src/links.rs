//! The KV links a worker has measured: for each source it received KV from (the address it
//! called for the prefill), the rate its transfers arrived at. The router weighs a pull against
//! computing the prompt with them.

use std::collections::HashMap;
use std::sync::Mutex;

/// Each source's measured rate, bytes a second: a moving average over its transfers, the newest
/// weighing [`WEIGHT`].
#[derive(Debug, Default)]
pub struct LinkRates(Mutex<HashMap<String, f64>>);

/// Weight of the newest transfer in a link's rate.
pub const WEIGHT: f64 = 0.5;

/// Transfers smaller than this say more about round trips than about the link: not counted.
pub const MIN_BYTES: u64 = 256 << 10;

impl LinkRates {
    /// Counts a transfer of `bytes` from `source` that took `seconds` from its first frame to its
    /// last.
    pub fn record(&self, source: &str, bytes: u64, seconds: f64) {
        if bytes < MIN_BYTES || seconds.is_nan() || seconds <= 0.0 {
            return;
        }
        let rate = bytes as f64 / seconds;
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(source.to_string())
            .and_modify(|r| *r = WEIGHT * rate + (1.0 - WEIGHT) * *r)
            .or_insert(rate);
    }

    /// Every source's rate now, by address.
    pub fn snapshot(&self) -> Vec<(String, f64)> {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<(String, f64)> = m.iter().map(|(k, r)| (k.clone(), *r)).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_s_rate_moves_toward_its_newest_transfers_and_small_ones_do_not_count() {
        let l = LinkRates::default();
        l.record("a:1", 1 << 20, 0.01);
        l.record("a:1", 1 << 20, 0.02);
        l.record("b:2", 1000, 0.5);
        l.record("b:2", 1 << 20, 0.0);
        let s = l.snapshot();
        assert_eq!(s.len(), 1);
        let want = 0.5 * (1 << 20) as f64 / 0.02 + 0.5 * (1 << 20) as f64 / 0.01;
        assert_eq!(s[0].0, "a:1");
        assert!((s[0].1 - want).abs() < 1e-6 * want);
    }
}

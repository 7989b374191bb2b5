//! The servers' own Prometheus metrics, read before and after a run so a report can say why
//! its numbers are what they are: prefix-cache hits, remote and local prefills, KV bytes moved,
//! migrations, preemptions.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `k="v"` pairs of a label set (without its braces), `model_name` and `role` left out (they
/// name the process, not the kind of event).
fn labels(set: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = set;
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim_start_matches([',', ' ']).to_string();
        let mut value = String::new();
        let mut chars = rest[eq + 2..].char_indices();
        let mut end = rest.len() - eq - 2;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(n);
                    }
                }
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        if key != "model_name" && key != "role" {
            out.push((key, value));
        }
        rest = &rest[eq + 2 + end..];
    }
    out.sort();
    out
}

/// Every sample of a text exposition summed by metric name (`_total` cut), and by name and
/// label set (`name{k="v"}`, without `model_name` and `role`); the histograms' `_bucket`
/// series left out.
pub fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (name_labels, set, rest) = match line.find('{') {
            Some(i) => {
                let close = line[i..].rfind('}').map_or(line.len(), |c| i + c);
                (
                    &line[..i],
                    &line[i + 1..close],
                    &line[(close + 1).min(line.len())..],
                )
            }
            None => match line.split_once(' ') {
                Some((n, r)) => (n, "", r),
                None => continue,
            },
        };
        if name_labels.ends_with("_bucket") {
            continue;
        }
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        let name = name_labels.strip_suffix("_total").unwrap_or(name_labels);
        *out.entry(name.to_string()).or_insert(0.0) += value;
        let l = labels(set);
        if !l.is_empty() {
            let set: Vec<String> = l.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
            *out.entry(format!("{name}{{{}}}", set.join(",")))
                .or_insert(0.0) += value;
        }
    }
    out
}

/// One URL's metrics, or `None` when it does not answer within `wait`.
async fn fetch(
    client: &reqwest::Client,
    url: &str,
    wait: Duration,
) -> Option<BTreeMap<String, f64>> {
    let got = async {
        client
            .get(url)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await
    };
    match tokio::time::timeout(wait, got).await {
        Ok(Ok(text)) => Some(parse(&text)),
        _ => None,
    }
}

/// Sums of every URL's metrics; URLs that do not answer are left out (and named in `missing`).
pub async fn scrape(
    client: &reqwest::Client,
    urls: &[String],
) -> (BTreeMap<String, f64>, Vec<String>) {
    let mut all = BTreeMap::new();
    let mut missing = Vec::new();
    for u in urls {
        match fetch(client, u, Duration::from_secs(5)).await {
            Some(m) => {
                for (k, v) in m {
                    *all.entry(k).or_insert(0.0) += v;
                }
            }
            None => missing.push(u.clone()),
        }
    }
    (all, missing)
}

/// The largest value of a gauge across the URLs (each URL's samples summed first).
pub async fn scrape_gauge(client: &reqwest::Client, urls: &[String], name: &str) -> Option<f64> {
    let mut best: Option<f64> = None;
    for u in urls {
        if let Some(v) = fetch(client, u, Duration::from_secs(2))
            .await
            .and_then(|m| m.get(name).copied())
        {
            best = Some(best.map_or(v, |b| b.max(v)));
        }
    }
    best
}

/// What the servers counted during a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ServerDelta {
    /// Prompt tokens found in the prefix cache over those looked up.
    pub prefix_cache_hit_rate: Option<f64>,
    /// Requests the router sent to a prefill worker.
    pub remote_prefills: f64,
    /// Requests whose prompt the decode worker computed itself.
    pub local_prefills: f64,
    /// Remote prefills that fell back to the decode worker.
    pub local_fallbacks: f64,
    /// KV-cache bytes moved between workers.
    pub kv_bytes_moved: f64,
    /// Requests moved to another worker mid-stream.
    pub migrations: f64,
    /// Sequences preempted for room in the KV cache.
    pub preemptions: f64,
    /// The servers' mean queue time over the run's requests, in milliseconds.
    pub mean_queue_ms: Option<f64>,
    /// Every counter that changed, by name.
    pub changed: BTreeMap<String, f64>,
    /// Metrics URLs that did not answer.
    pub unreachable: Vec<String>,
}

impl ServerDelta {
    /// The differences between two scrapes.
    pub fn between(
        before: &BTreeMap<String, f64>,
        after: &BTreeMap<String, f64>,
        unreachable: Vec<String>,
    ) -> Self {
        let d =
            |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
        let changed = after
            .keys()
            .filter(|k| !k.ends_with("_sum") || k.starts_with("tandem_"))
            .map(|k| (k.clone(), d(k)))
            .filter(|(_, v)| *v != 0.0)
            .collect();
        let lookups = d("tandem_prefix_cache_lookup_tokens");
        // A histogram's mean over the run: the change of its sum over the change of its count.
        let mean = |prefix: &str| {
            let sum = after
                .keys()
                .find(|k| k.starts_with(prefix) && k.ends_with("_sum"))?;
            let count = format!("{}_count", sum.strip_suffix("_sum")?);
            let n = d(&count);
            (n > 0.0).then(|| d(sum) / n)
        };
        Self {
            prefix_cache_hit_rate: (lookups > 0.0)
                .then(|| d("tandem_prefix_cache_hit_tokens") / lookups),
            remote_prefills: d("tandem_prefill_requests{mode=\"remote\"}"),
            local_prefills: d("tandem_prefill_requests{mode=\"local\"}"),
            local_fallbacks: d("tandem_remote_prefill_local_fallbacks"),
            kv_bytes_moved: d("tandem_kv_transfer_bytes"),
            migrations: d("tandem_request_migrations"),
            preemptions: d("tandem_preemptions"),
            mean_queue_ms: mean("tandem_request_queue_time").map(|s| s * 1e3),
            changed,
            unreachable,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expositions_sum_by_name() {
        let text = "# TYPE tandem_prefix_cache_hit_tokens counter\n\
            tandem_prefix_cache_hit_tokens_total{model_name=\"m\",role=\"decode\"} 30\n\
            tandem_prefix_cache_hit_tokens_total{model_name=\"m\",role=\"prefill\"} 10\n\
            tandem_prefix_cache_lookup_tokens_total 80\n\
            tandem_kv_cache_usage_perc{x=\"a b\"} 0.25\n\
            tandem_time_to_first_token_seconds_bucket{le=\"0.1\"} 4\n\
            tandem_time_to_first_token_seconds_count 9\n\
            # EOF\n";
        let m = parse(text);
        assert_eq!(m["tandem_prefix_cache_hit_tokens"], 40.0);
        assert_eq!(m["tandem_prefix_cache_lookup_tokens"], 80.0);
        assert_eq!(m["tandem_kv_cache_usage_perc"], 0.25);
        assert_eq!(m["tandem_time_to_first_token_seconds_count"], 9.0);
        assert!(!m.keys().any(|k| k.ends_with("_bucket")));
        let before = parse(
            "tandem_prefix_cache_hit_tokens_total 10\ntandem_prefix_cache_lookup_tokens_total 20\n",
        );
        let d = ServerDelta::between(&before, &m, vec![]);
        assert_eq!(d.prefix_cache_hit_rate, Some(0.5));
        assert_eq!(d.changed["tandem_prefix_cache_hit_tokens"], 30.0);
        let q = parse("tandem_request_queue_time_seconds_sum 3.0\ntandem_request_queue_time_seconds_count 4\n");
        let d = ServerDelta::between(&before, &q, vec![]);
        assert_eq!(d.mean_queue_ms, Some(750.0));
        let routed = parse(
            "tandem_prefill_requests_total{model_name=\"m\",role=\"router\",mode=\"remote\"} 3\n\
             tandem_prefill_requests_total{model_name=\"m,\\\"x\",role=\"router\",mode=\"local\"} 5\n",
        );
        assert_eq!(routed["tandem_prefill_requests"], 8.0);
        assert_eq!(routed["tandem_prefill_requests{mode=\"remote\"}"], 3.0);
        let d = ServerDelta::between(&BTreeMap::new(), &routed, vec![]);
        assert_eq!((d.remote_prefills, d.local_prefills), (3.0, 5.0));
    }
}

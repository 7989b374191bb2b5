//! End to end: several routers in front of the same decode workers route as one. Each builds
//! the same prefix-cache index from every worker's KV events, so a shared-prefix workload spread
//! over three routers finds its prefixes as often as through one; a router started again
//! mid-run rebuilds its index from the workers' snapshots and routes to the holders at once.

use crate::common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// What a router's index says each worker caches: address to blocks.
async fn view(c: &reqwest::Client, r: &Router) -> BTreeMap<String, u64> {
    let v: Value = c
        .get(format!("{}/ready", r.http))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["addr"].as_str().unwrap().to_string(),
                w["cached_blocks"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// Waits until every router's index says the same of every worker (each has taken every KV
/// event the workers sent), and returns that view.
async fn agree(c: &reqwest::Client, routers: &[&Router]) -> BTreeMap<String, u64> {
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let mut views = Vec::new();
        for r in routers {
            views.push(view(c, r).await);
        }
        if views.windows(2).all(|w| w[0] == w[1]) {
            return views.swap_remove(0);
        }
        assert!(
            Instant::now() < end,
            "the routers' indexes never agreed: {views:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A system prompt of about 150 tokens, one per `i`.
fn prefix(i: usize) -> String {
    let topics = [
        "rivers",
        "castles",
        "comets",
        "orchards",
        "lighthouses",
        "glaciers",
        "markets",
        "bridges",
    ];
    let t = topics[i % topics.len()];
    format!(
        "You are guide number {i}, an expert on {t}. Answer every question about {t} in one \
         careful sentence, naming the {t} you mean, the place they are found, the people who \
         study {t} there, and the season in which {t} are best seen. Never answer about anything \
         but {t}; if a question strays from {t}, bring it back to {t} politely. Keep a calm tone, \
         use plain words, avoid lists, and end with a short fact about {t} that few people know. \
         Question: "
    )
}

/// Sends `prefix + question` through `r` and returns (prompt tokens, cached prompt tokens).
async fn ask(c: &reqwest::Client, r: &Router, prefix: &str, question: &str) -> (u64, u64) {
    let v: Value = c
        .post(format!("{}/v1/completions", r.http))
        .json(
            &json!({"prompt": format!("{prefix}{question}"), "max_tokens": 2,
                      "temperature": 0}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let u = &v["usage"];
    (
        u["prompt_tokens"].as_u64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    )
}

const QUESTIONS: [&str; 4] = [
    "Which one is the oldest?",
    "Where should a visitor start?",
    "What changed in the last century?",
    "Who keeps the records?",
];

/// The share of prompt tokens found cached when prefixes `first..first + 4` are asked every
/// question, the requests spread over `routers` in turn (each waits for their indexes to
/// agree, so every router routes with the whole cluster's view).
async fn hit_rate(c: &reqwest::Client, routers: &[&Router], first: usize) -> f64 {
    let (mut prompt, mut cached, mut k) = (0, 0, 0);
    for q in QUESTIONS {
        for p in first..first + 4 {
            let (t, h) = ask(c, routers[k % routers.len()], &prefix(p), q).await;
            (prompt, cached, k) = (prompt + t, cached + h, k + 1);
            agree(c, routers).await;
        }
    }
    cached as f64 / prompt as f64
}

fn all(rs: &[Router]) -> Vec<&Router> {
    rs.iter().collect()
}

#[tokio::test]
async fn three_routers_find_prefixes_as_one_does_and_a_restarted_one_rebuilds_its_view() {
    let (_w0, a0) = start_worker(&[]);
    let (_w1, a1) = start_worker(&[]);
    let workers = [a0, a1];
    let mut routers: Vec<Router> = (0..3).map(|_| start_router(&workers, &[])).collect();
    for r in &routers {
        wait_ready(r, 2).await;
    }
    let c = reqwest::Client::new();

    // One router, then all three, each on prefixes of its own.
    let one = hit_rate(&c, &[&routers[0]], 0).await;
    let three = hit_rate(&c, &all(&routers), 4).await;
    println!("prefix hit rate: one router {one:.3}, three routers {three:.3}");
    // Each prefix's first question misses and the other three find it (about 3/4 of the
    // prompt tokens that the prefix's whole blocks hold).
    assert!(one > 0.5, "one router: {one}");
    assert!(
        (three - one).abs() <= 0.05 * one,
        "three routers {three} against one {one}"
    );

    // A router stopped and started again rebuilds its index from the workers' snapshots ...
    drop(routers.remove(1));
    routers.push(start_router(&workers, &[]));
    wait_ready(&routers[2], 2).await;
    let before = agree(&c, &all(&routers)).await;
    assert!(before.values().all(|&b| b > 0), "{before:?}");
    // ... and sends each prefix to the worker that holds it.
    for p in 4..8 {
        let (t, h) = ask(&c, &routers[2], &prefix(p), "Is it far?").await;
        assert!(h + 32 >= t, "prefix {p}: {h} of {t} tokens cached");
        agree(&c, &all(&routers)).await;
    }
}

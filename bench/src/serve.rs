//! `tandem bench serve`: a load generator for a running cluster, and the same workload through an
//! engine in this process as the baseline.
//!
//! Requests are streamed completions with random prompt token ids (fixed seed), greedy, EOS
//! ignored, so every request produces exactly `gen_len` tokens and two runs of the same spec do
//! the same work. Arrivals are either a fixed number of concurrent clients (closed loop) or an
//! open loop with Poisson arrivals at `rate` requests/s. Per request it records time to first
//! token, the gaps between streamed chunks (inter-token latency) and end-to-end latency; the
//! report has their percentiles and output tokens/s over the whole run.
//!
//! A mixed workload (`long_every` > 0) makes every k-th request a long prompt with a short answer
//! (`long_prompt_len`, `long_gen_len`): long prefills arriving while the short requests decode.
//! The report then also has the short requests' inter-token latency (what a long prefill on the
//! same worker stalls) and the long requests' TTFT.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};
use tandem_engine::{EngineHandle, Request, SamplingParams, StreamEvent};

use crate::percentile;

/// The workload and arrival process of a serve benchmark.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// Requests sent in all.
    pub requests: usize,
    /// Closed loop: this many requests in flight at all times (until the last is sent).
    pub concurrency: usize,
    /// Open loop instead: Poisson arrivals at this many requests per second.
    pub rate: Option<f64>,
    /// Prompt tokens of a (short) request.
    pub prompt_len: usize,
    /// Output tokens of a (short) request.
    pub gen_len: usize,
    /// Seed of the prompts and the arrival times.
    pub seed: u64,
    /// Every k-th request (k > 0) is a long one.
    pub long_every: usize,
    /// Prompt tokens of a long request.
    pub long_prompt_len: usize,
    /// Output tokens of a long request.
    pub long_gen_len: usize,
}

/// One request of a workload.
#[derive(Clone, Debug)]
pub struct Job {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output tokens to generate (EOS ignored).
    pub gen_len: usize,
    /// Whether it is one of a mixed workload's long requests.
    pub long: bool,
}

impl LoadSpec {
    /// The requests, identical for every target.
    pub fn jobs(&self, vocab: u32) -> Vec<Job> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed);
        (0..self.requests)
            .map(|i| {
                let long = self.long_every > 0 && i % self.long_every == self.long_every - 1;
                let (len, gen_len) = if long {
                    (self.long_prompt_len, self.long_gen_len)
                } else {
                    (self.prompt_len, self.gen_len)
                };
                Job {
                    prompt: (0..len).map(|_| rng.gen_range(100..vocab)).collect(),
                    gen_len,
                    long,
                }
            })
            .collect()
    }

    fn arrivals(&self) -> Vec<Duration> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed ^ 0x5eed);
        let mut t = 0.0;
        (0..self.requests)
            .map(|_| {
                if let Some(rate) = self.rate {
                    let u: f64 = rng.gen_range(f64::EPSILON..1.0);
                    t += -u.ln() / rate;
                }
                Duration::from_secs_f64(t)
            })
            .collect()
    }
}

/// One request's timings.
#[derive(Clone, Debug, Default)]
struct Sample {
    long: bool,
    ttft: f64,
    gaps: Vec<f64>,
    e2e: f64,
    tokens: usize,
    error: Option<String>,
}

/// A serve run's latencies and throughput; latency percentiles are over the requests that
/// succeeded.
#[derive(Clone, Debug, Serialize)]
pub struct ServeReport {
    /// What was measured: the router's base URL, or the in-process engine.
    pub target: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed.
    pub errors: usize,
    /// The spec's closed-loop concurrency.
    pub concurrency: usize,
    /// The spec's open-loop arrival rate, in requests per second.
    pub rate: Option<f64>,
    /// The spec's (short) prompt length, in tokens.
    pub prompt_len: usize,
    /// The spec's (short) output length, in tokens.
    pub gen_len: usize,
    /// Output tokens the successful requests received.
    pub output_tokens: usize,
    /// Seconds from the first request sent to the last one done.
    pub wall_s: f64,
    /// `output_tokens` / `wall_s`.
    pub output_tok_s: f64,
    /// Median time to first token, in milliseconds.
    pub ttft_ms_p50: f64,
    /// 99th-percentile time to first token, in milliseconds.
    pub ttft_ms_p99: f64,
    /// Median gap between streamed tokens, in milliseconds.
    pub itl_ms_p50: f64,
    /// 99th-percentile gap between streamed tokens, in milliseconds.
    pub itl_ms_p99: f64,
    /// Median request latency, submission to last token, in milliseconds.
    pub e2e_ms_p50: f64,
    /// 99th-percentile request latency, in milliseconds.
    pub e2e_ms_p99: f64,
    /// Mixed workloads: the short requests' median inter-token latency, in milliseconds.
    pub short_itl_ms_p50: Option<f64>,
    /// Mixed workloads: the short requests' 99th-percentile inter-token latency, in milliseconds.
    pub short_itl_ms_p99: Option<f64>,
    /// The longest stall a short request saw between two tokens, in milliseconds.
    pub short_itl_ms_max: Option<f64>,
    /// Mixed workloads: the long requests' median time to first token, in milliseconds.
    pub long_ttft_ms_p50: Option<f64>,
    /// Mixed workloads: the long requests' 99th-percentile time to first token, in milliseconds.
    pub long_ttft_ms_p99: Option<f64>,
    /// The first error seen, if any.
    pub first_error: Option<String>,
}

fn report(target: &str, spec: &LoadSpec, samples: Vec<Sample>, wall: f64) -> ServeReport {
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
    let tokens: usize = ok.iter().map(|s| s.tokens).sum();
    let mut ttft: Vec<f64> = ok.iter().map(|s| s.ttft * 1e3).collect();
    let mut e2e: Vec<f64> = ok.iter().map(|s| s.e2e * 1e3).collect();
    let mut itl: Vec<f64> = ok
        .iter()
        .flat_map(|s| s.gaps.iter().map(|g| g * 1e3))
        .collect();
    let mixed = spec.long_every > 0;
    let mut short_itl: Vec<f64> = ok
        .iter()
        .filter(|s| !s.long)
        .flat_map(|s| s.gaps.iter().map(|g| g * 1e3))
        .collect();
    let mut long_ttft: Vec<f64> = ok.iter().filter(|s| s.long).map(|s| s.ttft * 1e3).collect();
    ServeReport {
        target: target.to_string(),
        requests: samples.len(),
        errors: samples.len() - ok.len(),
        concurrency: spec.concurrency,
        rate: spec.rate,
        prompt_len: spec.prompt_len,
        gen_len: spec.gen_len,
        output_tokens: tokens,
        wall_s: wall,
        output_tok_s: tokens as f64 / wall.max(1e-9),
        ttft_ms_p50: percentile(&mut ttft, 0.5),
        ttft_ms_p99: percentile(&mut ttft, 0.99),
        itl_ms_p50: percentile(&mut itl, 0.5),
        itl_ms_p99: percentile(&mut itl, 0.99),
        e2e_ms_p50: percentile(&mut e2e, 0.5),
        e2e_ms_p99: percentile(&mut e2e, 0.99),
        short_itl_ms_p50: mixed.then(|| percentile(&mut short_itl, 0.5)),
        short_itl_ms_p99: mixed.then(|| percentile(&mut short_itl, 0.99)),
        short_itl_ms_max: mixed.then(|| short_itl.iter().copied().fold(0.0, f64::max)),
        long_ttft_ms_p50: mixed.then(|| percentile(&mut long_ttft, 0.5)),
        long_ttft_ms_p99: mixed.then(|| percentile(&mut long_ttft, 0.99)),
        first_error: samples.iter().find_map(|s| s.error.clone()),
    }
}

/// Runs `one` for every job under the spec's arrival process.
async fn drive<F, Fut>(spec: &LoadSpec, jobs: Vec<Job>, one: F) -> (Vec<Sample>, f64)
where
    F: Fn(Job) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Sample> + Send + 'static,
{
    let one = Arc::new(one);
    let limit = Arc::new(tokio::sync::Semaphore::new(if spec.rate.is_some() {
        usize::MAX >> 4
    } else {
        spec.concurrency.max(1)
    }));
    let start = Instant::now();
    let mut tasks = Vec::new();
    for (job, at) in jobs.into_iter().zip(spec.arrivals()) {
        let wait = at.saturating_sub(start.elapsed());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let permit = limit.clone().acquire_owned().await.expect("semaphore");
        let one = one.clone();
        let long = job.long;
        tasks.push(tokio::spawn(async move {
            let mut s = one(job).await;
            s.long = long;
            drop(permit);
            s
        }));
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.push(t.await.unwrap_or_else(|e| Sample {
            error: Some(format!("task failed: {e}")),
            ..Default::default()
        }));
    }
    (samples, start.elapsed().as_secs_f64())
}

/// Streams one completion from the router at `base` (`http://host:port`).
async fn http_one(client: reqwest::Client, url: String, body: Value) -> Sample {
    let t0 = Instant::now();
    let mut s = Sample::default();
    let resp = match client.post(&url).json(&body).send().await {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => {
            s.error = Some(format!(
                "HTTP {}: {}",
                r.status(),
                r.text().await.unwrap_or_default()
            ));
            return s;
        }
        Err(e) => {
            s.error = Some(e.to_string());
            return s;
        }
    };
    let mut body = resp.bytes_stream();
    let mut buf = Vec::new();
    let mut last: Option<Instant> = None;
    let mut done = false;
    while let Some(chunk) = body.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                s.error = Some(e.to_string());
                return s;
            }
        };
        buf.extend_from_slice(&chunk);
        // Complete events end with a blank line.
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let Some(data) = event.strip_prefix(b"data: ") else {
                continue;
            };
            let data = &data[..data.len() - 2];
            if data == b"[DONE]" {
                done = true;
                continue;
            }
            let v: Value = match serde_json::from_slice(data) {
                Ok(v) => v,
                Err(e) => {
                    s.error = Some(format!("bad event: {e}"));
                    return s;
                }
            };
            if let Some(u) = v.get("usage").and_then(|u| u.get("completion_tokens")) {
                s.tokens = u.as_u64().unwrap_or(0) as usize;
            }
            if let Some(e) = v.get("error") {
                s.error = Some(e.to_string());
                return s;
            }
            if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                let now = Instant::now();
                match last {
                    None => s.ttft = (now - t0).as_secs_f64(),
                    Some(prev) => s.gaps.push((now - prev).as_secs_f64()),
                }
                last = Some(now);
            }
        }
    }
    if !done {
        s.error = Some("stream ended without [DONE]".into());
    }
    s.e2e = t0.elapsed().as_secs_f64();
    s
}

/// The spec against a router's OpenAI API.
pub async fn run_http(base: &str, model: &str, spec: &LoadSpec, vocab: u32) -> ServeReport {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(spec.concurrency.max(64))
        .build()
        .expect("http client");
    let url = format!("{base}/v1/completions");
    let model = model.to_string();
    let (samples, wall) = drive(spec, spec.jobs(vocab), move |job| {
        let body = json!({
            "model": model, "prompt": job.prompt, "max_tokens": job.gen_len, "temperature": 0,
            "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true},
        });
        http_one(client.clone(), url.clone(), body)
    })
    .await;
    report(base, spec, samples, wall)
}

/// The spec straight into an engine in this process: the baseline the cluster is measured
/// against.
pub async fn run_engine(engine: Arc<EngineHandle>, spec: &LoadSpec) -> ServeReport {
    let vocab = engine.limits().vocab_size as u32;
    let (samples, wall) = drive(spec, spec.jobs(vocab), move |job| {
        let engine = engine.clone();
        async move {
            let t0 = Instant::now();
            let mut s = Sample::default();
            let prompt = job.prompt;
            let params = SamplingParams {
                max_tokens: job.gen_len as u32,
                ignore_eos: true,
                ..Default::default()
            };
            let submitted = params.validate().map_err(Into::into).and_then(|params| {
                engine.submit(Request {
                    prompt,
                    params,
                    resume: Vec::new(),
                    constraint: None,
                    samples: tandem_engine::Samples::ONE,
                })
            });
            let mut stream = match submitted {
                Ok(st) => st,
                Err(e) => {
                    s.error = Some(e.to_string());
                    return s;
                }
            };
            let mut last: Option<Instant> = None;
            while let Some(ev) = stream.next().await {
                match ev {
                    StreamEvent::Token(_) => {
                        let now = Instant::now();
                        match last {
                            None => s.ttft = (now - t0).as_secs_f64(),
                            Some(prev) => s.gaps.push((now - prev).as_secs_f64()),
                        }
                        last = Some(now);
                        s.tokens += 1;
                    }
                    StreamEvent::Finished(_) => break,
                    StreamEvent::Failed(e) => {
                        s.error = Some(e.to_string());
                        break;
                    }
                    StreamEvent::Kv(_) => {}
                }
            }
            s.e2e = t0.elapsed().as_secs_f64();
            s
        }
    })
    .await;
    report("engine (in process)", spec, samples, wall)
}

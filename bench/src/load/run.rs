//! Runs a plan against a target: dispatches sessions on schedule (open loop) or keeps a number in
//! flight (closed loop), streams every request, and records what each one saw. A request that
//! receives nothing for the stall timeout fails as `"stall"`: the deadline is tied to progress,
//! so a slow but moving server is measured, a stuck one does not hold the run.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tandem_engine::{EngineHandle, Request, SamplingParams, StreamEvent};
use tokio::sync::Semaphore;

use super::dataset::{Dataset, Message, Prompt, Session, Turn};
use super::measure::{Gaps, Measured, Record};
use super::metrics::scrape_gauge;
use super::schedule::{arrival_times, Shape, StopAfter};

/// Where requests go.
#[derive(Clone)]
pub enum Target {
    /// An OpenAI-compatible server.
    Http(HttpTarget),
    /// An engine in this process (the baseline a cluster's overhead is measured against).
    Engine(Arc<EngineHandle>),
}

impl Target {
    /// How the report names it.
    pub fn name(&self) -> String {
        match self {
            Self::Http(h) => match &h.label {
                Some(l) => format!("{l} ({})", h.base),
                None => h.base.clone(),
            },
            Self::Engine(_) => "engine (in process)".into(),
        }
    }
}

/// An OpenAI-compatible server and the model name to send.
#[derive(Clone)]
pub struct HttpTarget {
    /// `http://host:port`.
    pub base: String,
    /// The `model` field of every request.
    pub model: String,
    /// What reports call it, beside its address (e.g. the server's name).
    pub label: Option<String>,
    /// The API key sent as `Authorization: Bearer`, when the server wants one.
    pub key: Option<String>,
    client: reqwest::Client,
}

impl HttpTarget {
    /// A client for `base` with connections for `in_flight` requests at once.
    pub fn new(base: &str, model: &str, in_flight: usize) -> Self {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(in_flight.max(64))
            .build()
            .expect("http client");
        Self {
            base: base.trim_end_matches('/').to_string(),
            model: model.to_string(),
            label: None,
            key: None,
            client,
        }
    }

    /// The same target, called with API key `key` (a tenant's, say).
    pub fn with_key(mut self, key: Option<&str>) -> Self {
        self.key = key.map(str::to_string);
        self
    }

    /// The same target, named `label` in reports.
    pub fn labelled(mut self, label: Option<&str>) -> Self {
        self.label = label.map(str::to_string);
        self
    }
}

/// The schedule of a run and how it is measured: identical on every agent, each of which takes
/// its share (sessions `j` with `j % agents == agent`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Plan {
    /// Closed or open loop.
    pub shape: Shape,
    /// When sending stops.
    pub bound: StopAfter,
    /// The first sessions are sent but not measured.
    pub warmup: usize,
    /// Seed of the arrival times (the dataset has its own).
    pub seed: u64,
    /// A request that receives nothing for this long fails as a stall.
    pub stall: Duration,
    /// Replaces the arrival process with these offsets (a trace's timestamps).
    pub times: Option<Vec<Duration>>,
}

impl Plan {
    /// The open-loop send offsets of every session (all agents'), or `None` for a closed loop.
    pub fn arrivals(&self) -> Option<Vec<Duration>> {
        if let Some(t) = &self.times {
            return Some(
                t.iter()
                    .enumerate()
                    .take_while(|(i, at)| self.bound.admits(*i, **at))
                    .map(|(_, at)| *at)
                    .collect(),
            );
        }
        match self.shape {
            Shape::Closed { .. } => None,
            Shape::Open {
                rate,
                arrival,
                ramp,
                ..
            } => Some(arrival_times(rate, arrival, ramp, self.bound, self.seed)),
        }
    }
}

/// This process's part of a distributed run.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Share {
    /// This agent's number.
    pub agent: usize,
    /// Agents in the run.
    pub agents: usize,
}

impl Share {
    /// The whole run.
    pub const ALL: Share = Share {
        agent: 0,
        agents: 1,
    };

    fn owns(&self, session: usize) -> bool {
        session % self.agents == self.agent
    }

    /// This agent's part of a closed loop's concurrency.
    fn concurrency(&self, total: usize) -> usize {
        total / self.agents + usize::from(self.agent < total % self.agents)
    }
}

/// Live counters of a run, read by the progress line and the time series.
#[derive(Debug, Default)]
pub struct Progress {
    /// Requests sent.
    pub sent: AtomicUsize,
    /// Requests ended (either way).
    pub done: AtomicUsize,
    /// Requests failed.
    pub failed: AtomicUsize,
    /// Output tokens received.
    pub tokens: AtomicUsize,
    /// Requests in flight.
    pub in_flight: AtomicUsize,
}

/// One point of a run's time series.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Tick {
    /// Seconds from the start.
    pub t: f64,
    /// Requests in flight.
    pub in_flight: usize,
    /// Requests ended so far.
    pub done: usize,
    /// Output tokens so far.
    pub tokens: usize,
    /// The servers' KV cache usage (0-1, the fullest), when their metrics are scraped.
    pub kv_usage: Option<f64>,
}

/// How a run reports while it goes.
#[derive(Clone, Debug, Default)]
pub struct Watch {
    /// Print a progress line to stderr every second.
    pub progress: bool,
    /// `/metrics` URLs to read KV usage from for the time series.
    pub metrics: Vec<String>,
    /// A label for the progress line.
    pub label: String,
}

/// What one run gives back.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RunOutput {
    /// Records and gaps.
    pub measured: Measured,
    /// The time series, one point a second.
    pub ticks: Vec<Tick>,
}

/// Runs this share of `plan` on `dataset` against `target`.
pub async fn run(
    target: &Target,
    dataset: &Dataset,
    plan: &Plan,
    share: Share,
    watch: &Watch,
    progress: Arc<Progress>,
) -> RunOutput {
    let start = Instant::now();
    let gaps = Arc::new(Mutex::new((Gaps::default(), Gaps::default())));
    let records = Arc::new(Mutex::new(Vec::new()));
    let first_measured = Arc::new(Mutex::new(None::<f64>));
    let finished = Arc::new(AtomicBool::new(false));
    let ticker = tokio::spawn(tick(
        start,
        watch.clone(),
        progress.clone(),
        finished.clone(),
    ));
    let one = {
        let (target, dataset, gaps, records, progress, first_measured) = (
            target.clone(),
            dataset.clone(),
            gaps.clone(),
            records.clone(),
            progress.clone(),
            first_measured.clone(),
        );
        let (warmup, stall) = (plan.warmup, plan.stall);
        move |session: usize, due: Duration| {
            let (target, gaps, records, progress, first_measured) = (
                target.clone(),
                gaps.clone(),
                records.clone(),
                progress.clone(),
                first_measured.clone(),
            );
            let s = dataset.session(session);
            async move {
                let warm = session < warmup;
                let lag = start.elapsed().saturating_sub(due).as_secs_f64() * 1e3;
                if !warm {
                    let mut f = first_measured.lock().expect("lock");
                    let now = start.elapsed().as_secs_f64();
                    *f = Some(f.map_or(now, |x: f64| x.min(now)));
                }
                let out = run_session(&target, s, session, stall, &progress, start).await;
                let mut g = gaps.lock().expect("lock");
                let mut r = records.lock().expect("lock");
                for (mut rec, rec_gaps) in out {
                    rec.warmup = warm;
                    rec.lag_ms = lag;
                    if !warm && rec.ok() {
                        for x in rec_gaps {
                            g.0.record_ms(x);
                            if !rec.long {
                                g.1.record_ms(x);
                            }
                        }
                    }
                    r.push(rec);
                }
            }
        }
    };
    match plan.arrivals() {
        Some(times) => {
            let cap = match plan.shape {
                Shape::Open {
                    max_in_flight: Some(m),
                    ..
                } => share.concurrency(m).max(1),
                _ => Semaphore::MAX_PERMITS,
            };
            let limit = Arc::new(Semaphore::new(cap));
            let mut tasks = Vec::new();
            for (j, at) in times.into_iter().enumerate() {
                if !share.owns(j) {
                    continue;
                }
                // Absolute deadlines: a late wake-up delays this send only.
                tokio::time::sleep_until((start + at).into()).await;
                let permit = limit.clone().acquire_owned().await.expect("semaphore");
                let fut = one(j, at);
                tasks.push(tokio::spawn(async move {
                    fut.await;
                    drop(permit);
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
        }
        None => {
            let Shape::Closed { concurrency } = plan.shape else {
                unreachable!("a plan without arrivals is a closed loop")
            };
            let next = Arc::new(AtomicUsize::new(0));
            let workers = share.concurrency(concurrency);
            let mut tasks = Vec::new();
            for _ in 0..workers {
                let (next, one, bound) = (next.clone(), one.clone(), plan.bound);
                tasks.push(tokio::spawn(async move {
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let j = k * share.agents + share.agent;
                        if !bound.admits(j, start.elapsed()) {
                            return;
                        }
                        one(j, start.elapsed()).await;
                    }
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
        }
    }
    let wall = start.elapsed().as_secs_f64();
    finished.store(true, Ordering::Relaxed);
    let ticks = ticker.await.unwrap_or_default();
    let (gaps, short_gaps) = std::mem::take(&mut *gaps.lock().expect("lock"));
    let mut records = std::mem::take(&mut *records.lock().expect("lock"));
    records.sort_by_key(|r: &Record| (r.session, r.turn));
    let warmup_s = first_measured.lock().expect("lock").unwrap_or(0.0);
    RunOutput {
        measured: Measured {
            records,
            gaps,
            short_gaps,
            wall_s: wall,
            warmup_s,
        },
        ticks,
    }
}

async fn tick(
    start: Instant,
    watch: Watch,
    progress: Arc<Progress>,
    finished: Arc<AtomicBool>,
) -> Vec<Tick> {
    let mut ticks = Vec::new();
    let mut last_tokens = 0;
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    let client = reqwest::Client::new();
    loop {
        interval.tick().await;
        let kv_usage = if watch.metrics.is_empty() {
            None
        } else {
            scrape_gauge(&client, &watch.metrics, "tandem_kv_cache_usage_perc").await
        };
        let p = &progress;
        let t = Tick {
            t: start.elapsed().as_secs_f64(),
            in_flight: p.in_flight.load(Ordering::Relaxed),
            done: p.done.load(Ordering::Relaxed),
            tokens: p.tokens.load(Ordering::Relaxed),
            kv_usage,
        };
        if watch.progress {
            eprintln!(
                "{} {:>6.1} s  sent {:>6}  done {:>6}  in flight {:>5}  failed {:>4}  {:>8.1} out tok/s",
                watch.label,
                t.t,
                p.sent.load(Ordering::Relaxed),
                t.done,
                t.in_flight,
                p.failed.load(Ordering::Relaxed),
                (t.tokens - last_tokens) as f64,
            );
        }
        last_tokens = t.tokens;
        ticks.push(t);
        if finished.load(Ordering::Relaxed) {
            return ticks;
        }
    }
}

/// Runs a session's turns one after another; each turn resends the conversation so far.
async fn run_session(
    target: &Target,
    s: Session,
    session: usize,
    stall: Duration,
    progress: &Progress,
    start: Instant,
) -> Vec<(Record, Vec<f64>)> {
    let mut history: Vec<Message> = Vec::new();
    let mut out = Vec::new();
    for (turn, t) in s.turns.into_iter().enumerate() {
        progress.sent.fetch_add(1, Ordering::Relaxed);
        progress.in_flight.fetch_add(1, Ordering::Relaxed);
        let sent_s = start.elapsed().as_secs_f64();
        let mut attempt = match target {
            Target::Http(h) => http_turn(h, &t, &mut history, stall, progress).await,
            Target::Engine(e) => engine_turn(e, &t, stall, progress).await,
        };
        progress.in_flight.fetch_sub(1, Ordering::Relaxed);
        progress.done.fetch_add(1, Ordering::Relaxed);
        attempt.0.session = session;
        attempt.0.turn = turn;
        attempt.0.long = t.long;
        attempt.0.sent_s = sent_s;
        let failed = !attempt.0.ok();
        if failed {
            progress.failed.fetch_add(1, Ordering::Relaxed);
        }
        out.push(attempt);
        // A conversation cannot go on without its answer.
        if failed {
            break;
        }
    }
    out
}

/// Timing of a stream's chunks.
struct Clock {
    t0: Instant,
    last: Option<Instant>,
    gaps: Vec<f64>,
    ttft: Option<f64>,
}

impl Clock {
    fn new() -> Self {
        Self {
            t0: Instant::now(),
            last: None,
            gaps: Vec::new(),
            ttft: None,
        }
    }

    fn token(&mut self) {
        let now = Instant::now();
        match self.last {
            None => self.ttft = Some((now - self.t0).as_secs_f64() * 1e3),
            Some(prev) => self.gaps.push((now - prev).as_secs_f64() * 1e3),
        }
        self.last = Some(now);
    }

    fn finish(self, mut r: Record) -> (Record, Vec<f64>) {
        r.e2e_ms = self.t0.elapsed().as_secs_f64() * 1e3;
        r.chunks = usize::from(self.ttft.is_some()) + self.gaps.len();
        r.ttft_ms = self.ttft;
        r.itl_max_ms = self.gaps.iter().copied().reduce(f64::max);
        (r, self.gaps)
    }
}

fn failed(status: &str, error: String) -> Record {
    Record {
        status: status.into(),
        error: Some(error),
        ..Default::default()
    }
}

/// An error and its sources, `: `-separated (reqwest's own text leaves the cause out).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

async fn http_turn(
    h: &HttpTarget,
    t: &Turn,
    history: &mut Vec<Message>,
    stall: Duration,
    progress: &Progress,
) -> (Record, Vec<f64>) {
    let mut clock = Clock::new();
    let mut body = json!({
        "model": h.model, "max_tokens": t.max_tokens, "temperature": 0,
        "ignore_eos": t.ignore_eos,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let (path, chat) = match &t.prompt {
        Prompt::Tokens(ids) => {
            body["prompt"] = json!(ids);
            ("/v1/completions", false)
        }
        Prompt::Text(text) => {
            body["prompt"] = json!(text);
            ("/v1/completions", false)
        }
        Prompt::Chat(new) => {
            history.extend(new.iter().cloned());
            body["messages"] = json!(history);
            ("/v1/chat/completions", true)
        }
    };
    let url = format!("{}{path}", h.base);
    let send = || {
        let mut req = h.client.post(&url).json(&body);
        if let Some(k) = &h.key {
            req = req.bearer_auth(k);
        }
        tokio::time::timeout(stall, req.send())
    };
    let mut sent = send().await;
    if let Ok(Err(e)) = &sent {
        // A pooled connection the server had closed while idle (servers close keep-alive
        // connections after a while or a number of requests): the request never reached it,
        // so it goes again once, on a fresh connection.
        if chain(e).contains("closed before message completed") {
            sent = send().await;
        }
    }
    let resp = match sent {
        Err(_) => return clock.finish(failed("stall", format!("no response in {stall:?}"))),
        Ok(Err(e)) => return clock.finish(failed("connect", chain(&e))),
        Ok(Ok(r)) if !r.status().is_success() => {
            let code = r.status().as_u16().to_string();
            let text = r.text().await.unwrap_or_default();
            return clock.finish(failed(&code, format!("HTTP {code}: {text}")));
        }
        Ok(Ok(r)) => r,
    };
    let mut rec = Record {
        status: "ok".into(),
        ..Default::default()
    };
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    let (mut done, mut chunks, mut usage_tokens, mut reply) = (false, 0usize, None, String::new());
    while !done {
        let chunk = match tokio::time::timeout(stall, stream.next()).await {
            Err(_) => {
                let r = failed("stall", format!("nothing streamed for {stall:?}"));
                return clock.finish(r);
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => return clock.finish(failed("stream", e.to_string())),
            Ok(Some(Ok(c))) => c,
        };
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            // The field is `data:`, the space after it optional; lines may end in CRLF.
            let Some(data) = event.trim_ascii().strip_prefix(b"data:") else {
                continue;
            };
            let data = data.trim_ascii();
            if data == b"[DONE]" {
                done = true;
                break;
            }
            let v: Value = match serde_json::from_slice(data) {
                Ok(v) => v,
                Err(e) => return clock.finish(failed("bad_event", e.to_string())),
            };
            if let Some(e) = v.get("error") {
                return clock.finish(failed("error_event", e.to_string()));
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                usage_tokens = u["completion_tokens"].as_u64().map(|n| n as usize);
                if let Some(p) = u["prompt_tokens"].as_u64() {
                    rec.prompt_tokens = p as usize;
                }
            }
            let Some(choice) = v["choices"].as_array().and_then(|c| c.first()) else {
                continue;
            };
            let text = if chat {
                choice["delta"]["content"].as_str()
            } else {
                choice["text"].as_str()
            };
            if let Some(text) = text.filter(|t| !t.is_empty()) {
                clock.token();
                chunks += 1;
                progress.tokens.fetch_add(1, Ordering::Relaxed);
                if chat {
                    reply.push_str(text);
                }
            }
        }
    }
    if !done {
        return clock.finish(failed("truncated", "stream ended without [DONE]".into()));
    }
    // The server's own count where it gives one; a peer without usage counts chunks.
    rec.output_tokens = usage_tokens.unwrap_or(chunks);
    if rec.prompt_tokens == 0 {
        if let Prompt::Tokens(ids) = &t.prompt {
            rec.prompt_tokens = ids.len();
        }
    }
    if chat {
        history.push(Message {
            role: "assistant".into(),
            content: reply,
        });
    }
    clock.finish(rec)
}

async fn engine_turn(
    engine: &EngineHandle,
    t: &Turn,
    stall: Duration,
    progress: &Progress,
) -> (Record, Vec<f64>) {
    let mut clock = Clock::new();
    let Prompt::Tokens(prompt) = &t.prompt else {
        let r = failed(
            "unsupported",
            "the in-process engine takes token prompts".into(),
        );
        return clock.finish(r);
    };
    let params = SamplingParams {
        max_tokens: t.max_tokens as u32,
        ignore_eos: t.ignore_eos,
        ..Default::default()
    };
    let submitted = params
        .validate()
        .map(|p| Request::new(prompt.clone(), p))
        .map_err(Into::into)
        .and_then(|r| engine.submit(r));
    let mut stream = match submitted {
        Ok(s) => s,
        Err(e) => return clock.finish(failed("refused", e.to_string())),
    };
    let mut rec = Record {
        status: "ok".into(),
        prompt_tokens: prompt.len(),
        ..Default::default()
    };
    loop {
        match tokio::time::timeout(stall, stream.next()).await {
            Err(_) => return clock.finish(failed("stall", format!("no token for {stall:?}"))),
            Ok(None) => return clock.finish(failed("truncated", "stream ended".into())),
            Ok(Some(StreamEvent::Token(_))) => {
                clock.token();
                rec.output_tokens += 1;
                progress.tokens.fetch_add(1, Ordering::Relaxed);
            }
            Ok(Some(StreamEvent::Finished(_))) => return clock.finish(rec),
            Ok(Some(StreamEvent::Failed(e))) => {
                return clock.finish(failed("error", e.to_string()))
            }
            Ok(Some(StreamEvent::Kv(_))) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a turn sends: its `max_tokens` and whether the server is to ignore the end of
    /// sequence (an edit's answer ends where the model ends it; every other turn runs to its
    /// length), to a server that records each body and streams one token.
    #[tokio::test]
    async fn a_turn_asks_for_its_length_and_its_end_of_sequence() {
        use axum::routing::post;
        let bodies: Arc<Mutex<Vec<Value>>> = Arc::default();
        let seen = bodies.clone();
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            post(move |axum::Json(body): axum::Json<Value>| {
                let seen = seen.clone();
                async move {
                    seen.lock().unwrap().push(body);
                    "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n"
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let target = HttpTarget::new(&base, "m", 1);
        let progress = Progress::default();
        for ignore_eos in [false, true] {
            let turn = Turn {
                prompt: Prompt::Chat(vec![Message {
                    role: "user".into(),
                    content: "Fix this.".into(),
                }]),
                max_tokens: 7,
                ignore_eos,
                long: false,
            };
            let stall = Duration::from_secs(60);
            let (rec, _) = http_turn(&target, &turn, &mut Vec::new(), stall, &progress).await;
            assert_eq!(
                (rec.status.as_str(), rec.output_tokens),
                ("ok", 1),
                "{rec:?}"
            );
        }
        let bodies = bodies.lock().unwrap();
        let asked: Vec<(Value, Value)> = bodies
            .iter()
            .map(|b| (b["max_tokens"].clone(), b["ignore_eos"].clone()))
            .collect();
        assert_eq!(
            asked,
            [(json!(7), json!(false)), (json!(7), json!(true))],
            "{bodies:?}"
        );
    }
}

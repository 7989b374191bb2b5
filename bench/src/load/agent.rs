//! Load from several machines at once: `tandem bench agent` serves `POST /run`, and the
//! coordinator (`tandem bench serve --agents A,B`) sends each agent the same plan with its share,
//! a common start delay, and merges what comes back (records concatenated, gap histograms added:
//! exactly what one process would have measured on the same schedule).
//!
//! An agent answers with one JSON line a second while it runs (`{"progress": ...}`) and its
//! result last (`{"result": ...}`). An agent whose line stops coming for `silence`, or whose
//! connection breaks, is reported lost with its share; the run still ends.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Json;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tandem_model::Tokenizer;

use super::dataset::Dataset;
use super::run::{run, HttpTarget, Plan, Progress, RunOutput, Share, Target, Tick, Watch};

/// What the coordinator sends an agent.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Assignment {
    /// The server to load.
    pub base: String,
    /// The model name to send.
    pub model: String,
    /// The dataset, files already read (the agent needs none of them).
    pub dataset: Dataset,
    /// The schedule.
    pub plan: Plan,
    /// This agent's share.
    pub share: Share,
    /// Wait this long before starting (every agent is sent the same moment).
    pub start_in_ms: u64,
    /// `/metrics` URLs for the KV usage series (the first agent only).
    pub metrics: Vec<String>,
}

/// One line of an agent's answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AgentLine {
    /// Still running: requests ended so far.
    Progress {
        /// Requests ended.
        done: usize,
    },
    /// Finished.
    Result(Box<RunOutput>),
    /// Could not run.
    Error(String),
}

/// The agent's HTTP service (`POST /run`). `tokenizer` makes text for the datasets that need
/// it, as the coordinator's does.
pub fn router(tokenizer: Option<Tokenizer>) -> axum::Router {
    axum::Router::new()
        .route("/run", post(run_assignment))
        .with_state(Arc::new(tokenizer))
}

/// Serves coordinators on `listener` until `stop` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tokenizer: Option<Tokenizer>,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(tokenizer))
        .with_graceful_shutdown(stop)
        .await
}

async fn run_assignment(
    State(tok): State<Arc<Option<Tokenizer>>>,
    Json(a): Json<Assignment>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<AgentLine>(4);
    tokio::spawn(async move {
        let dataset = match a.dataset.clone().with_tokenizer((*tok).clone()) {
            Ok(d) => d,
            Err(e) => {
                let _ = tx.send(AgentLine::Error(e)).await;
                return;
            }
        };
        tokio::time::sleep(Duration::from_millis(a.start_in_ms)).await;
        let target = Target::Http(HttpTarget::new(&a.base, &a.model, 256));
        let progress = Arc::new(Progress::default());
        let watch = Watch {
            metrics: a.metrics.clone(),
            ..Watch::default()
        };
        let work = run(
            &target,
            &dataset,
            &a.plan,
            a.share,
            &watch,
            progress.clone(),
        );
        tokio::pin!(work);
        let mut beat = tokio::time::interval(Duration::from_secs(1));
        let out = loop {
            tokio::select! {
                out = &mut work => break out,
                _ = beat.tick() => {
                    let done = progress.done.load(Ordering::Relaxed);
                    if tx.send(AgentLine::Progress { done }).await.is_err() {
                        // The coordinator is gone: stop sending load for it.
                        return;
                    }
                }
            }
        };
        let _ = tx.send(AgentLine::Result(Box::new(out))).await;
    });
    let lines = tokio_stream_lines(rx);
    Response::builder()
        .header("content-type", "application/x-ndjson")
        .body(Body::from_stream(lines))
        .unwrap_or_else(|_| "agent: bad response".into_response())
}

fn tokio_stream_lines(
    rx: tokio::sync::mpsc::Receiver<AgentLine>,
) -> impl futures::Stream<Item = Result<Vec<u8>, std::io::Error>> {
    futures::stream::unfold(rx, |mut rx| async move {
        let line = rx.recv().await?;
        let mut bytes = serde_json::to_vec(&line).unwrap_or_default();
        bytes.push(b'\n');
        Some((Ok(bytes), rx))
    })
}

/// What came back from the agents of one run.
#[derive(Debug, Default)]
pub struct Gathered {
    /// The merged result of the agents that finished.
    pub output: RunOutput,
    /// Agents lost, with what happened and their share.
    pub lost: Vec<String>,
}

/// Sends `a` (with each agent's share) to every agent and merges the results.
pub async fn coordinate(agents: &[String], a: &Assignment, silence: Duration) -> Gathered {
    let client = reqwest::Client::new();
    let n = agents.len();
    let runs = agents.iter().enumerate().map(|(i, host)| {
        let mut mine = a.clone();
        mine.share = Share {
            agent: i,
            agents: n,
        };
        if i > 0 {
            mine.metrics.clear();
        }
        let (client, host) = (client.clone(), host.clone());
        async move {
            (
                host.clone(),
                one_agent(&client, &host, &mine, silence).await,
            )
        }
    });
    let results = futures::future::join_all(runs).await;
    let mut g = Gathered::default();
    for (host, r) in results {
        match r {
            Ok(out) => {
                g.output.measured.merge(out.measured);
                merge_ticks(&mut g.output.ticks, &out.ticks);
            }
            Err(e) => g.lost.push(format!(
                "agent {host}: {e} (its share is not in the results)"
            )),
        }
    }
    g
}

fn merge_ticks(into: &mut Vec<Tick>, from: &[Tick]) {
    for (i, t) in from.iter().enumerate() {
        match into.get_mut(i) {
            Some(m) => {
                m.in_flight += t.in_flight;
                m.done += t.done;
                m.tokens += t.tokens;
                m.kv_usage = m.kv_usage.or(t.kv_usage);
            }
            None => into.push(*t),
        }
    }
}

async fn one_agent(
    client: &reqwest::Client,
    host: &str,
    a: &Assignment,
    silence: Duration,
) -> Result<RunOutput, String> {
    let url = format!("http://{host}/run");
    let resp = tokio::time::timeout(silence, client.post(&url).json(a).send())
        .await
        .map_err(|_| format!("no answer in {silence:?}"))?
        .map_err(|e| format!("unreachable: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("HTTP {}", resp.status()));
    }
    let mut stream = resp.bytes_stream();
    let mut buf = Vec::new();
    loop {
        let chunk = match tokio::time::timeout(silence, stream.next()).await {
            Err(_) => return Err(format!("silent for {silence:?}")),
            Ok(None) => return Err("connection closed before its result".into()),
            Ok(Some(Err(e))) => return Err(format!("connection broke: {e}")),
            Ok(Some(Ok(c))) => c,
        };
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            match serde_json::from_slice::<AgentLine>(&line) {
                Ok(AgentLine::Progress { .. }) => {}
                Ok(AgentLine::Result(out)) => return Ok(*out),
                Ok(AgentLine::Error(e)) => return Err(e),
                Err(e) => return Err(format!("bad line: {e}")),
            }
        }
    }
}

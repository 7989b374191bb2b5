//! The dispatcher against in-memory workers: routing, heartbeats, migration with the tokens
//! already streamed, the stall deadline, and how each worker failure reaches the client. The
//! fakes sit behind the router's own `WorkerClient`/`Connect` seam, so these run the router's
//! real code without a worker process or a socket.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_proto::worker as pb;
use tandem_router::{
    ApiError, Connect, Discovery, DispatchConfig, Dispatcher, FinishKind, GenParams,
    MaxTokensDefault, PoolConfig, PoolShared, PromptInput, Role, WorkerAddr, WorkerClient,
    WorkerPool, WorkerStream,
};
use tonic::{Code, Status};

/// What a fake decode worker sends on a stream.
#[derive(Clone, Debug)]
enum Say {
    /// Tokens of the request's first sample (its only one, unless it asked for several).
    Tokens(Vec<u32>),
    /// Tokens of sample `.0`.
    SampleTokens(u32, Vec<u32>),
    /// Sample `.0` finished while others go on.
    SampleEnded(u32, pb::FinishReason),
    Heartbeat,
    Finish(pb::FinishReason),
    /// The stream fails with this code (the worker died, or its engine failed).
    Fail(Code),
    /// The stream ends as a draining worker ends it: handed over.
    HandOff,
    /// Nothing more, ever (a frozen worker); the stream stays open.
    Silence,
    /// Nothing for this long (a slow step).
    Wait(Duration),
}

/// How a fake answers a `Generate` call, given the request.
type Script = Box<dyn Fn(&pb::DecodeRequest) -> Result<Vec<Say>, Code> + Send + Sync>;

struct FakeWorker {
    script: Script,
    calls: Mutex<Vec<pb::DecodeRequest>>,
    /// The StopSamples calls it took.
    stops: Mutex<Vec<pb::StopSamplesRequest>>,
    /// What its Info says its KV block size is.
    block_size: u32,
    /// Whether its Load says it drains (once it has handed a stream over).
    draining: std::sync::atomic::AtomicBool,
    /// Whether it has stopped: its calls fail.
    gone: std::sync::atomic::AtomicBool,
    /// What its Load says it holds in flight (other routers' requests, say).
    reported: std::sync::atomic::AtomicU32,
}

impl FakeWorker {
    fn new(
        script: impl Fn(&pb::DecodeRequest) -> Result<Vec<Say>, Code> + Send + Sync + 'static,
    ) -> Arc<Self> {
        Arc::new(Self {
            script: Box::new(script),
            calls: Mutex::new(Vec::new()),
            stops: Mutex::new(Vec::new()),
            block_size: 16,
            draining: Default::default(),
            gone: Default::default(),
            reported: Default::default(),
        })
    }

    /// A fake that answers every request with `answer` and says its blocks hold `block_size`.
    fn answering(answer: Vec<u32>, block_size: u32) -> Arc<Self> {
        Arc::new(Self {
            script: Box::new(move |_| {
                Ok(vec![
                    Say::Tokens(answer.clone()),
                    Say::Finish(pb::FinishReason::Length),
                ])
            }),
            calls: Mutex::new(Vec::new()),
            stops: Mutex::new(Vec::new()),
            block_size,
            draining: Default::default(),
            gone: Default::default(),
            reported: Default::default(),
        })
    }

    fn calls(&self) -> Vec<pb::DecodeRequest> {
        self.calls.lock().unwrap().clone()
    }

    /// Waits for the StopSamples calls the router sends in the background, `n` of them.
    async fn stops(&self, n: usize) -> Vec<pb::StopSamplesRequest> {
        for _ in 0..30_000 {
            let stops = self.stops.lock().unwrap().clone();
            if stops.len() >= n {
                return stops;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        panic!("{n} StopSamples calls never came");
    }
}

#[tonic::async_trait]
impl WorkerClient for FakeWorker {
    async fn info(&self) -> Result<pb::WorkerInfo, Status> {
        Ok(pb::WorkerInfo {
            worker_id: "fake".into(),
            model: "fake".into(),
            block_size: self.block_size,
            max_context: 8192,
            vocab_size: 49152,
            kv_dtype: "f32".into(),
            total_blocks: 1024,
            tensor_parallel: 1,
        })
    }

    async fn load(&self) -> Result<pb::LoadReport, Status> {
        if self.gone.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Status::unavailable("stopped"));
        }
        Ok(pb::LoadReport {
            draining: self.draining.load(std::sync::atomic::Ordering::SeqCst),
            in_flight: self.reported.load(std::sync::atomic::Ordering::SeqCst),
            ..Default::default()
        })
    }

    async fn kv_events(&self) -> Result<WorkerStream<pb::KvEventBatch>, Status> {
        Ok(Box::pin(futures::stream::pending()))
    }

    async fn generate(
        &self,
        request: pb::DecodeRequest,
    ) -> Result<WorkerStream<pb::DecodeResponse>, Status> {
        // Each call's stream id on this worker: its number among the calls.
        let stream_id = {
            let mut calls = self.calls.lock().unwrap();
            calls.push(request.clone());
            calls.len() as u64
        };
        let sends = (self.script)(&request).map_err(|c| Status::new(c, "scripted refusal"))?;
        if sends.iter().any(|s| matches!(s, Say::HandOff)) {
            // (A draining worker says so in its Load from the moment it hands over.)
            self.draining
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        let prompt_tokens = request.prompt_ids.len() as u32;
        // `Finish` ends the stream with the first sample's finish: a script for several
        // samples ends the others first.
        let first = request.first_index;
        let tokens = move |index: u32, ids: Vec<u32>| pb::DecodeResponse {
            tokens: ids
                .into_iter()
                .map(|id| pb::Token {
                    id,
                    logprob: -0.5,
                    top: vec![],
                    index,
                })
                .collect(),
            stream_id,
            ..Default::default()
        };
        let finish = move |index: u32, reason: pb::FinishReason| pb::Finish {
            reason: reason as i32,
            prompt_tokens,
            index,
            ..Default::default()
        };
        let message = move |s: Say| match s {
            Say::Tokens(ids) => Ok(tokens(first, ids)),
            Say::SampleTokens(i, ids) => Ok(tokens(i, ids)),
            Say::SampleEnded(i, reason) => Ok(pb::DecodeResponse {
                finished: vec![finish(i, reason)],
                ..Default::default()
            }),
            Say::Heartbeat => Ok(pb::DecodeResponse::default()),
            Say::Finish(reason) => Ok(pb::DecodeResponse {
                finish: Some(finish(first, reason)),
                ..Default::default()
            }),
            Say::Fail(c) => Err(Status::new(c, "scripted failure")),
            Say::HandOff => Err(tandem_proto::wire::handed_off_status("draining")),
            Say::Silence | Say::Wait(_) => unreachable!("not a message"),
        };
        let s = futures::stream::unfold(sends.into_iter(), move |mut sends| async move {
            loop {
                match sends.next()? {
                    Say::Wait(d) => tokio::time::sleep(d).await,
                    Say::Silence => futures::future::pending::<()>().await,
                    s => return Some((message(s), sends)),
                }
            }
        });
        Ok(Box::pin(s))
    }

    async fn stop_samples(
        &self,
        request: pb::StopSamplesRequest,
    ) -> Result<pb::StopSamplesResponse, Status> {
        self.stops.lock().unwrap().push(request);
        Ok(pb::StopSamplesResponse { found: true })
    }
}

struct FakeConnect(HashMap<WorkerAddr, Arc<FakeWorker>>);

impl Connect for FakeConnect {
    fn connect(&self, addr: &WorkerAddr) -> Result<Arc<dyn WorkerClient>, String> {
        match self.0.get(addr) {
            Some(w) => Ok(w.clone()),
            None => Err(format!("no fake at {addr}")),
        }
    }
}

/// A dispatcher over the default model's tokenizer and `workers` (named w0, w1, ...), once
/// every worker is ready.
async fn dispatcher(workers: &[Arc<FakeWorker>], max_migrations: u32) -> Dispatcher {
    let named: HashMap<WorkerAddr, Arc<FakeWorker>> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| (WorkerAddr::from(format!("w{i}")), w.clone()))
        .collect();
    let (_tx, rx) = tokio::sync::watch::channel(named.keys().cloned().collect::<Vec<_>>());
    let cfg = PoolConfig {
        poll_interval: Duration::from_millis(10),
        connect_timeout: Duration::from_secs(1),
    };
    let pool = WorkerPool::spawn_with(Role::Decode, rx, cfg, Arc::new(FakeConnect(named)));
    while pool.ready().len() < workers.len() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let policy =
        tandem_router::policy::build(tandem_router::PolicyKind::LeastLoad, Default::default());
    Dispatcher::new(
        common::served_model(),
        pool,
        None,
        policy,
        DispatchConfig {
            max_queue: 8,
            disagg: Default::default(),
            max_migrations,
            stall: Duration::from_secs(10),
            flow: Default::default(),
        },
    )
}

fn params(max_tokens: u64) -> GenParams {
    GenParams {
        temperature: Some(0.5),
        top_p: Some(0.9),
        max_tokens: Some(max_tokens),
        skip_special_tokens: true,
        ..Default::default()
    }
}

/// Runs a request to its end: its text, its finish, or the error it ended with.
async fn run(d: &Dispatcher, max_tokens: u64) -> Result<(String, FinishKind, u32), ApiError> {
    let prep = d
        .prepare(
            "",
            PromptInput::Text("Tell me a story".into()),
            params(max_tokens),
            MaxTokensDefault::Fixed(16),
        )
        .await?;
    let mut g = d.generate(prep).await?;
    let mut text = String::new();
    while let Some(c) = g.next().await {
        let (_, c) = c?;
        text.push_str(&c.text);
        if let Some((kind, usage)) = c.finish {
            return Ok((text, kind, usage.completion_tokens));
        }
    }
    panic!("the generation ended without a finish");
}

const ANSWER: &str = " Once upon a time, a small robot learned to sing.";

#[tokio::test]
async fn tokens_arrive_as_text_across_heartbeats_with_the_request_as_prepared() {
    let answer = answer_ids().await;
    let (a, b) = answer.split_at(4);
    let (a, b) = (a.to_vec(), b.to_vec());
    let w = FakeWorker::new(move |_| {
        Ok(vec![
            Say::Heartbeat,
            Say::Tokens(a.clone()),
            Say::Heartbeat,
            Say::Tokens(b.clone()),
            Say::Finish(pb::FinishReason::Length),
        ])
    });
    let d = dispatcher(std::slice::from_ref(&w), 1).await;
    let (text, finish, n) = run(&d, answer.len() as u64).await.unwrap();
    assert_eq!(text, ANSWER);
    assert_eq!(finish, FinishKind::Length);
    assert_eq!(n as usize, answer.len());
    let calls = w.calls();
    assert_eq!(calls.len(), 1);
    let s = calls[0].sampling.clone().unwrap();
    assert_eq!((s.temperature, s.top_p), (0.5, 0.9));
    assert_eq!(
        calls[0].stopping.as_ref().unwrap().max_tokens,
        answer.len() as u32
    );
    assert!(calls[0].resume_ids.is_empty());
}

/// Both fakes: a fresh request gets `first` tokens and then the stream fails with `code`; a
/// resumed one gets the rest of the answer.
fn dies_mid_stream(answer: Vec<u32>, first: usize, then: Say) -> Arc<FakeWorker> {
    FakeWorker::new(move |r| {
        let done = r.resume_ids.len();
        if done == 0 {
            Ok(vec![Say::Tokens(answer[..first].to_vec()), then.clone()])
        } else {
            assert_eq!(
                r.resume_ids,
                answer[..done],
                "resumes from what was streamed"
            );
            Ok(vec![
                Say::Tokens(answer[done..].to_vec()),
                Say::Finish(pb::FinishReason::Stop),
            ])
        }
    })
}

async fn answer_ids() -> Vec<u32> {
    let model = common::served_model();
    model.text.tokenizer.encode(ANSWER, false).unwrap()
}

#[tokio::test]
async fn a_worker_lost_mid_stream_is_left_and_the_request_resumes_on_another() {
    let answer = answer_ids().await;
    for lost in [
        Code::Unavailable,
        Code::Internal,
        Code::Unknown,
        Code::Cancelled,
    ] {
        let ws = [
            dies_mid_stream(answer.clone(), 3, Say::Fail(lost)),
            dies_mid_stream(answer.clone(), 3, Say::Fail(lost)),
        ];
        let d = dispatcher(&ws, 1).await;
        let (text, finish, n) = run(&d, 64).await.unwrap();
        assert_eq!(text, ANSWER, "{lost:?}: one continuous answer");
        assert_eq!(finish, FinishKind::Stop);
        assert_eq!(n as usize, answer.len());
        let calls: Vec<_> = ws.iter().map(|w| w.calls()).collect();
        assert_eq!(calls[0].len() + calls[1].len(), 2, "{lost:?}");
        assert_eq!(calls[0].len(), 1, "one call on each worker");
        let resumed = calls.iter().flatten().find(|c| !c.resume_ids.is_empty());
        assert_eq!(resumed.unwrap().resume_ids, answer[..3]);
    }
}

/// A draining worker's hand-over is no failure: the request resumes on the other worker even
/// with no migration allowed, and the draining worker is taken for draining (no new requests),
/// not for dead (still up, for its KV to be pulled).
#[tokio::test]
async fn a_handed_off_stream_resumes_elsewhere_without_spending_a_migration() {
    let answer = answer_ids().await;
    let ws = [
        dies_mid_stream(answer.clone(), 3, Say::HandOff),
        dies_mid_stream(answer.clone(), 3, Say::HandOff),
    ];
    let d = dispatcher(&ws, 0).await;
    let (text, finish, n) = run(&d, 64).await.unwrap();
    assert_eq!(text, ANSWER);
    assert_eq!(finish, FinishKind::Stop);
    assert_eq!(n as usize, answer.len());
    let calls: Vec<_> = ws.iter().map(|w| w.calls()).collect();
    let (from, to) = if calls[0][0].resume_ids.is_empty() {
        (0, 1)
    } else {
        (1, 0)
    };
    assert_eq!(calls[from].len(), 1);
    assert_eq!(calls[to][0].resume_ids, answer[..3]);
    let name = WorkerAddr::from(format!("w{from}"));
    let ready: Vec<WorkerAddr> = d.pool.ready().iter().map(|w| w.addr.clone()).collect();
    let up: Vec<WorkerAddr> = d.pool.up().iter().map(|w| w.addr.clone()).collect();
    assert!(!ready.contains(&name), "draining: no new requests");
    assert!(up.contains(&name), "but up, for pulls");
    assert_eq!(sample(&d, "tandem_request_handoffs_total"), 1.0);
    assert_eq!(sample(&d, "tandem_request_migrations_total"), 1.0);
}

#[tokio::test(start_paused = true)]
async fn a_worker_silent_past_the_stall_deadline_is_left_like_a_dead_one() {
    let answer = answer_ids().await;
    let ws = [
        dies_mid_stream(answer.clone(), 2, Say::Silence),
        dies_mid_stream(answer.clone(), 2, Say::Silence),
    ];
    let d = dispatcher(&ws, 1).await;
    let t0 = tokio::time::Instant::now();
    let (text, _, _) = run(&d, 64).await.unwrap();
    assert_eq!(text, ANSWER);
    assert!(
        t0.elapsed() >= Duration::from_secs(10),
        "left only after the stall deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn heartbeats_keep_a_worker_that_is_slow_past_the_stall_deadline() {
    let answer = answer_ids().await;
    // 30 s of work before the first token (three stall deadlines), a heartbeat every second.
    let a = answer.clone();
    let w = FakeWorker::new(move |_| {
        let mut s = vec![];
        for _ in 0..30 {
            s.push(Say::Wait(Duration::from_secs(1)));
            s.push(Say::Heartbeat);
        }
        s.push(Say::Tokens(a.clone()));
        s.push(Say::Finish(pb::FinishReason::Stop));
        Ok(s)
    });
    // The only worker: leaving it would fail the request.
    let d = dispatcher(std::slice::from_ref(&w), 1).await;
    let t0 = tokio::time::Instant::now();
    let (text, _, _) = run(&d, 64).await.unwrap();
    assert_eq!(text, ANSWER);
    assert!(t0.elapsed() >= Duration::from_secs(30));
    assert_eq!(w.calls().len(), 1);
    // The same wait without heartbeats is a stall: the request fails once the deadline passes.
    let a = answer.clone();
    let silent = FakeWorker::new(move |_| {
        Ok(vec![
            Say::Wait(Duration::from_secs(30)),
            Say::Tokens(a.clone()),
            Say::Finish(pb::FinishReason::Stop),
        ])
    });
    let d = dispatcher(&[silent], 1).await;
    let e = run(&d, 64).await.unwrap_err();
    assert_eq!(e.status().as_u16(), 502, "{e}");
}

#[tokio::test]
async fn a_refusal_reaches_the_client_with_the_status_of_its_kind_and_is_not_retried() {
    for (code, http) in [
        (Code::InvalidArgument, 400),
        (Code::OutOfRange, 400),
        (Code::ResourceExhausted, 503),
        (Code::FailedPrecondition, 502),
        (Code::Internal, 502),
    ] {
        let ws = [
            FakeWorker::new(move |_| Err(code)),
            FakeWorker::new(move |_| Err(code)),
        ];
        let d = dispatcher(&ws, 1).await;
        let e = run(&d, 8).await.unwrap_err();
        assert_eq!(e.status().as_u16(), http, "{code:?}: {e}");
        let calls: usize = ws.iter().map(|w| w.calls().len()).sum();
        assert_eq!(
            calls, 1,
            "{code:?}: a refusal is not retried on another worker"
        );
    }
}

#[tokio::test]
async fn an_unreachable_worker_is_skipped_when_the_stream_opens() {
    let answer = answer_ids().await;
    let a = answer.clone();
    let ok = move |_: &pb::DecodeRequest| {
        Ok(vec![
            Say::Tokens(a.clone()),
            Say::Finish(pb::FinishReason::Stop),
        ])
    };
    let ws = [
        FakeWorker::new(|_| Err(Code::Unavailable)),
        FakeWorker::new(ok.clone()),
    ];
    // Whichever is picked first, the request ends on the one that answers.
    let d = dispatcher(&ws, 0).await;
    let (text, _, _) = run(&d, 64).await.unwrap();
    assert_eq!(text, ANSWER);
    assert_eq!(ws[1].calls().len(), 1);
    assert!(ws[0].calls().len() <= 1);
    // With every worker unreachable the client gets a 502 naming the last one tried.
    let ws = [
        FakeWorker::new(|_| Err(Code::Unavailable)),
        FakeWorker::new(|_| Err(Code::Unavailable)),
    ];
    let d = dispatcher(&ws, 0).await;
    let e = run(&d, 8).await.unwrap_err();
    assert_eq!(e.status().as_u16(), 502, "{e}");
    assert_eq!(ws[0].calls().len() + ws[1].calls().len(), 2);
}

#[tokio::test]
async fn a_failure_with_no_migration_left_fails_the_request_as_the_cluster_s_fault() {
    let answer = answer_ids().await;
    let ws = [dies_mid_stream(
        answer.clone(),
        3,
        Say::Fail(Code::Internal),
    )];
    let d = dispatcher(&ws, 0).await;
    let e = run(&d, 64).await.unwrap_err();
    assert_eq!(e.status().as_u16(), 502, "{e}");
    // A worker that refuses the request mid-stream as the client's fault is not migrated.
    let ws = [
        dies_mid_stream(answer.clone(), 3, Say::Fail(Code::InvalidArgument)),
        dies_mid_stream(answer.clone(), 3, Say::Fail(Code::InvalidArgument)),
    ];
    let d = dispatcher(&ws, 1).await;
    let e = run(&d, 64).await.unwrap_err();
    assert_eq!(e.status().as_u16(), 400, "{e}");
    assert_eq!(ws[0].calls().len() + ws[1].calls().len(), 1);
}

#[tokio::test]
async fn with_no_ready_worker_the_request_is_a_503() {
    let d = dispatcher(&[], 1).await;
    let e = run(&d, 8).await.unwrap_err();
    assert!(matches!(e, ApiError::NoWorker), "{e}");
    assert_eq!(e.status().as_u16(), 503);
}

/// An in-memory discovery backend: the test decides who is in the cluster.
struct FakeDiscovery {
    decode: tokio::sync::watch::Sender<Vec<WorkerAddr>>,
    prefill: tokio::sync::watch::Sender<Vec<WorkerAddr>>,
}

impl FakeDiscovery {
    fn new(decode: &[&str]) -> Self {
        Self {
            decode: tokio::sync::watch::Sender::new(decode.iter().map(|&a| a.into()).collect()),
            prefill: tokio::sync::watch::Sender::new(Vec::new()),
        }
    }

    fn join(&self, addr: &str) {
        self.decode.send_modify(|v| v.push(addr.into()));
    }

    fn leave(&self, addr: &str) {
        self.decode
            .send_modify(|v| v.retain(|a| a.as_str() != addr));
    }
}

impl Discovery for FakeDiscovery {
    fn decode_workers(&self) -> tokio::sync::watch::Receiver<Vec<WorkerAddr>> {
        self.decode.subscribe()
    }

    fn prefill_workers(&self) -> tokio::sync::watch::Receiver<Vec<WorkerAddr>> {
        self.prefill.subscribe()
    }
}

/// One sample of the router's metrics page, named without the labels every sample carries.
fn sample(d: &Dispatcher, key: &str) -> f64 {
    const ROLE: &str = "model_name=\"\",role=\"router\"";
    d.metrics
        .render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| {
            assert!(l.contains(ROLE), "{l}: every sample is labelled");
            l.replace(ROLE, "")
                .replace("{,", "{")
                .replace(",}", "}")
                .replace("{}", "")
        })
        .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
        .unwrap_or(0.0)
}

async fn until(what: &str, ok: impl Fn() -> bool) {
    for _ in 0..10_000 {
        if ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("{what}");
}

/// A decode pool following `found`, reaching the fakes `all` by name, polling every 5 ms.
fn discovered_pool(found: &FakeDiscovery, all: &[(&str, &Arc<FakeWorker>)]) -> Arc<WorkerPool> {
    let all: HashMap<WorkerAddr, Arc<FakeWorker>> = all
        .iter()
        .map(|&(a, w)| (WorkerAddr::from(a), w.clone()))
        .collect();
    let shared = PoolShared {
        metrics: Default::default(),
        expect: Arc::new(tandem_discovery::Expect::new(vec!["fake".into()], None)),
    };
    let cfg = PoolConfig {
        poll_interval: Duration::from_millis(5),
        connect_timeout: Duration::from_secs(1),
    };
    WorkerPool::start(
        Role::Decode,
        found.decode_workers(),
        cfg,
        Arc::new(FakeConnect(all)),
        shared,
    )
}

#[tokio::test]
async fn workers_that_join_take_requests_and_workers_that_leave_or_do_not_fit_get_none() {
    let answer = answer_ids().await;
    let w0 = FakeWorker::answering(answer.clone(), 16);
    let w1 = FakeWorker::answering(answer.clone(), 16);
    // Its blocks hold 32 tokens; the cluster's (pinned by the first worker) hold 16.
    let w2 = FakeWorker::answering(answer.clone(), 32);
    let found = FakeDiscovery::new(&["w0"]);
    let pool = discovered_pool(&found, &[("w0", &w0), ("w1", &w1), ("w2", &w2)]);
    let policy =
        tandem_router::policy::build(tandem_router::PolicyKind::RoundRobin, Default::default());
    let d = Dispatcher::new(
        common::served_model(),
        pool.clone(),
        None,
        policy,
        DispatchConfig {
            max_queue: 8,
            disagg: Default::default(),
            max_migrations: 1,
            stall: Duration::from_secs(10),
            flow: Default::default(),
        },
    );
    until("w0 ready", || pool.ready().len() == 1).await;
    for _ in 0..2 {
        run(&d, answer.len() as u64).await.unwrap();
    }
    assert_eq!(w0.calls().len(), 2);

    // w1 joins and takes its turn; w2 joins but its Info does not fit: refused, counted.
    found.join("w1");
    found.join("w2");
    until("w1 ready", || pool.ready().len() == 2).await;
    let refused =
        "tandem_discovery_refused_workers_total{worker_role=\"decode\",reason=\"block_size\"}";
    until("w2 refused", || sample(&d, refused) == 1.0).await;
    for _ in 0..4 {
        run(&d, answer.len() as u64).await.unwrap();
    }
    assert_eq!((w0.calls().len(), w1.calls().len()), (4, 2));
    assert!(w2.calls().is_empty());
    let ready: Vec<String> = pool.ready().iter().map(|w| w.addr.to_string()).collect();
    assert_eq!(ready, ["w0", "w1"]);

    // w0 leaves: every later request goes elsewhere.
    found.leave("w0");
    until("w0 gone", || pool.all().len() == 2).await;
    for _ in 0..3 {
        run(&d, answer.len() as u64).await.unwrap();
    }
    assert_eq!((w0.calls().len(), w1.calls().len()), (4, 5));
    assert!(w2.calls().is_empty());
    let joins = "tandem_discovery_membership_changes_total{worker_role=\"decode\",change=\"join\"}";
    let leaves =
        "tandem_discovery_membership_changes_total{worker_role=\"decode\",change=\"leave\"}";
    assert_eq!((sample(&d, joins), sample(&d, leaves)), (3.0, 1.0));
    assert_eq!(
        sample(
            &d,
            "tandem_router_worker_requests_total{worker_role=\"decode\",worker=\"w1\"}"
        ),
        5.0
    );
}

/// A draining worker that discovery drops (a terminating pod leaves DNS at once) stays a peer
/// KV can be pulled from while it answers, and never takes a request; once it stops answering
/// it is gone.
#[tokio::test]
async fn a_draining_worker_dropped_by_discovery_stays_a_pull_source_while_it_answers() {
    use std::sync::atomic::Ordering::SeqCst;
    let answer = answer_ids().await;
    let w0 = FakeWorker::answering(answer.clone(), 16);
    let w1 = FakeWorker::answering(answer.clone(), 16);
    let found = FakeDiscovery::new(&["w0", "w1"]);
    let pool = discovered_pool(&found, &[("w0", &w0), ("w1", &w1)]);
    let names = |ws: Vec<Arc<tandem_router::Worker>>| -> Vec<String> {
        let mut n: Vec<String> = ws.iter().map(|w| w.addr.to_string()).collect();
        n.sort();
        n
    };
    until("both ready", || pool.ready().len() == 2).await;
    w0.draining.store(true, SeqCst);
    until("w0 draining", || names(pool.ready()) == ["w1"]).await;
    found.leave("w0");
    until("w0 dropped", || pool.all().len() == 1).await;
    assert_eq!(names(pool.up()), ["w0", "w1"], "still a pull source");
    assert_eq!(names(pool.ready()), ["w1"]);
    w0.gone.store(true, SeqCst);
    until("w0 gone", || names(pool.up()) == ["w1"]).await;
    // A worker dropped while not draining is gone at once.
    found.leave("w1");
    until("w1 dropped", || pool.up().is_empty()).await;
}

/// Runs a request for `n` samples to its end: each sample's text and finish, in sample order.
async fn run_samples(
    d: &Dispatcher,
    n: u32,
    stop: &[&str],
) -> Result<Vec<(String, FinishKind, u32)>, ApiError> {
    let p = GenParams {
        n,
        stop: stop.iter().map(|s| s.to_string()).collect(),
        ..params(64)
    };
    let prep = d
        .prepare(
            "",
            PromptInput::Text("Tell me a story".into()),
            p,
            MaxTokensDefault::Fixed(16),
        )
        .await?;
    let mut g = d.generate(prep).await?;
    let mut out = vec![(String::new(), None, 0); n as usize];
    while let Some(c) = g.next().await {
        let (i, c) = c?;
        let o = &mut out[i as usize];
        assert!(o.1.is_none(), "sample {i} goes on after its finish");
        o.0.push_str(&c.text);
        if let Some((kind, usage)) = c.finish {
            o.1 = Some(kind);
            o.2 = usage.completion_tokens;
        }
    }
    Ok(out
        .into_iter()
        .map(|(t, f, n)| (t, f.expect("every sample finishes"), n))
        .collect())
}

#[tokio::test]
async fn parallel_samples_share_one_stream_and_each_ends_on_its_own() {
    let answer = answer_ids().await;
    let (a, b) = answer.split_at(5);
    let (a, b) = (a.to_vec(), b.to_vec());
    let model = common::served_model();
    let other = model.text.tokenizer.encode(" The end.", false).unwrap();
    let other_len = other.len() as u32;
    let w = FakeWorker::new(move |r| {
        assert_eq!((r.n, r.first_index), (3, 0));
        Ok(vec![
            Say::SampleTokens(0, a.clone()),
            Say::SampleTokens(2, other.clone()),
            Say::SampleTokens(1, a.clone()),
            Say::SampleEnded(2, pb::FinishReason::Stop),
            Say::Heartbeat,
            Say::SampleTokens(1, b.clone()),
            Say::SampleEnded(1, pb::FinishReason::Length),
            Say::SampleTokens(0, b.clone()),
            Say::Finish(pb::FinishReason::Stop),
        ])
    });
    let d = dispatcher(std::slice::from_ref(&w), 1).await;
    let got = run_samples(&d, 3, &[]).await.unwrap();
    let n = answer.len() as u32;
    assert_eq!(
        got,
        vec![
            (ANSWER.to_string(), FinishKind::Stop, n),
            (ANSWER.to_string(), FinishKind::Length, n),
            (" The end.".to_string(), FinishKind::Stop, other_len),
        ]
    );
    assert_eq!(w.calls().len(), 1, "one stream for every sample");
    // A stop string ends one sample where it appears; the others go on.
    let got = run_samples(&d, 3, &["robot"]).await.unwrap();
    assert_eq!(got[0].0, " Once upon a time, a small ");
    assert_eq!(got[0].1, FinishKind::Stop);
    assert_eq!(got[1].0, " Once upon a time, a small ");
    assert_eq!(got[1].1, FinishKind::Stop);
    assert_eq!(got[2].0, " The end.");
    // The worker cannot see stop strings: it is told to stop sample 1, cut while sample 0 still
    // ran there. Sample 0, cut last, needs no call: the stream is dropped, which cancels it.
    // It names the stream by its id on the worker (the second call's) and the request's id.
    let stops = w.stops(1).await;
    let id = &w.calls()[1].request_id;
    assert_eq!(stops.len(), 1, "{stops:?}");
    assert_eq!(
        (
            &stops[0].request_id,
            stops[0].stream_id,
            &stops[0].indices[..]
        ),
        (id, 2, &[1][..])
    );
}

#[tokio::test]
async fn a_lost_worker_s_samples_each_resume_on_their_own_stream() {
    let answer = answer_ids().await;
    let ans = answer.clone();
    // The first worker sends sample 0 three tokens and sample 1 five, finishes sample 2, and
    // dies. Each sample left resumes alone, with its index and its own tokens.
    let script = move |r: &pb::DecodeRequest| {
        if r.n == 2 {
            assert!(r.resume_ids.is_empty());
            return Ok(vec![
                Say::SampleTokens(0, ans[..3].to_vec()),
                Say::SampleTokens(1, ans[..5].to_vec()),
                Say::Fail(Code::Unavailable),
            ]);
        }
        assert_eq!(r.n, 1);
        let done = r.resume_ids.len();
        assert_eq!(done, [3, 5][r.first_index as usize], "{r:?}");
        assert_eq!(r.resume_ids, ans[..done]);
        Ok(vec![
            Say::Tokens(ans[done..].to_vec()),
            Say::Finish(pb::FinishReason::Stop),
        ])
    };
    let ws = [FakeWorker::new(script.clone()), FakeWorker::new(script)];
    let d = dispatcher(&ws, 1).await;
    let got = run_samples(&d, 2, &[]).await.unwrap();
    for (text, finish, n) in &got {
        assert_eq!(text, ANSWER);
        assert_eq!(*finish, FinishKind::Stop);
        assert_eq!(*n as usize, answer.len());
    }
    let calls: Vec<pb::DecodeRequest> = ws.iter().flat_map(|w| w.calls()).collect();
    assert_eq!(calls.len(), 3, "one stream, then one per sample");
    let mut resumed: Vec<u32> = calls
        .iter()
        .filter(|c| c.n == 1)
        .map(|c| c.first_index)
        .collect();
    resumed.sort();
    assert_eq!(resumed, vec![0, 1]);
}

/// The id `d` gives a request.
async fn request_id(d: &Dispatcher) -> String {
    let prep = d
        .prepare(
            "",
            PromptInput::Text("Tell me a story".into()),
            params(4),
            MaxTokensDefault::Fixed(16),
        )
        .await
        .unwrap();
    prep.request_id.to_string()
}

#[tokio::test]
async fn two_routers_give_their_requests_different_ids() {
    let w = FakeWorker::answering(answer_ids().await, 16);
    let (a, b) = (
        dispatcher(std::slice::from_ref(&w), 1).await,
        dispatcher(std::slice::from_ref(&w), 1).await,
    );
    let (a1, a2, b1) = (
        request_id(&a).await,
        request_id(&a).await,
        request_id(&b).await,
    );
    // One router's ids share its prefix and count up; another router's start elsewhere.
    let prefix = |s: &str| s.rsplit_once('-').unwrap().0.to_string();
    assert_eq!(prefix(&a1), prefix(&a2));
    assert_ne!(a1, a2);
    assert_ne!(prefix(&a1), prefix(&b1), "{a1} {b1}");
    assert_ne!(a1, b1);
}

/// Several routers in front of the same workers: each balances by what the workers report they
/// hold (every router's requests), not by its own share alone.
#[tokio::test]
async fn load_counts_what_other_routers_sent() {
    let answer = answer_ids().await;
    let (w0, w1) = (
        FakeWorker::answering(answer.clone(), 16),
        FakeWorker::answering(answer, 16),
    );
    let d = dispatcher(&[w0.clone(), w1.clone()], 0).await;
    let busy = |w: &FakeWorker, n: u32| {
        w.reported.store(n, std::sync::atomic::Ordering::SeqCst);
    };
    // Another router keeps 10 requests on w0: this one sends everything to w1.
    busy(&w0, 10);
    let polled = |w: &Arc<FakeWorker>, n: usize| {
        let addr = if Arc::ptr_eq(w, &w0) { "w0" } else { "w1" };
        d.pool
            .all()
            .into_iter()
            .find(|x| x.addr.as_str() == addr)
            .is_some_and(|x| x.load() == n)
    };
    until("w0's report", || polled(&w0, 10)).await;
    for _ in 0..4 {
        run(&d, 4).await.unwrap();
    }
    assert_eq!((w0.calls().len(), w1.calls().len()), (0, 4));
    // Now w1 is the busy one.
    busy(&w0, 0);
    busy(&w1, 10);
    until("w1's report", || polled(&w1, 10) && polled(&w0, 0)).await;
    for _ in 0..3 {
        run(&d, 4).await.unwrap();
    }
    assert_eq!((w0.calls().len(), w1.calls().len()), (3, 4));
}

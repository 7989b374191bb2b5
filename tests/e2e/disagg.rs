//! Disaggregation end to end: real `tandem prefill`, `tandem decode` and `tandem router`
//! processes on loopback (and, for the damaged-frame case, the two worker services in this
//! process with a transport that flips a byte). DESIGN.md §2 and its failure rules.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::netns::{block_in, start_in, Net};
use common::*;
use futures::future::BoxFuture;
use futures::StreamExt;
use serde_json::{json, Value};
use tandem_engine::device::fake::{FakeDevice, FakeDeviceBackend};
use tandem_kv_transfer::{
    BlockFrame, KvStream, KvTransport, Secret, TcpTransport, ThreadFabric, TransferError, WireFault,
};
use tandem_proto::worker as wpb;

/// Bytes one block of every layer takes on the wire (f32 KV, the workers' default).
fn bytes_per_block() -> u64 {
    let m = tandem_model::load_text(&model_path()).unwrap();
    let c = &m.config;
    (2 * 16 * c.num_kv_heads * c.head_dim * 4 * c.num_layers) as u64
}

/// The same request straight to a decode worker with a local plan: the reference output.
async fn local_reference(decode: &str, ids: &[u32], max_tokens: u32) -> Vec<u32> {
    let mut c = wpb::decode_client::DecodeClient::connect(format!("http://{decode}"))
        .await
        .unwrap();
    let req = wpb::DecodeRequest {
        request_id: "reference".into(),
        prompt_ids: ids.to_vec(),
        sampling: Some(wpb::Sampling::default()),
        stopping: Some(wpb::Stopping {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut s = c.generate(authed(req)).await.unwrap().into_inner();
    let mut out = Vec::new();
    while let Some(m) = s.message().await.unwrap() {
        out.extend(m.tokens.iter().map(|t| t.id));
    }
    out
}

fn golden_ids(g: &Value, key: &str) -> Vec<u32> {
    serde_json::from_value(g[key].clone()).unwrap()
}

/// A long prompt no earlier request shares a block with (`salt` changes its first token).
fn long_prompt(salt: u32, len: usize) -> Vec<u32> {
    let base = golden_ids(
        golden()
            .iter()
            .find(|g| g["id"] == "dev_long_history")
            .unwrap(),
        "prompt_ids",
    );
    let mut p: Vec<u32> = base.iter().cycle().take(len).copied().collect();
    p[0] = 1000 + salt;
    p
}

/// A prefill worker, a decode worker and a router that prefills every prompt remotely; the
/// processes, the router and the decode worker's address.
async fn remote_prefill_cluster() -> (Proc, Proc, Router, String) {
    let (p, paddr) = start_prefill(&[]);
    let (d, daddr, _kv) = start_decode(&[]);
    let r = start_router(
        std::slice::from_ref(&daddr),
        &[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=1",
        ],
    );
    wait_ready(&r, 1).await;
    (p, d, r, daddr)
}

/// Every one of the cluster's `remote` requests was prefilled on the prefill worker and its KV
/// crossed whole: none prefilled locally, no transfer failed, and the decode worker ends idle.
async fn all_prefilled_remotely(r: &Router, daddr: &str, remote: f64) {
    let rm = scrape(&r.http).await;
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="remote"}"#),
        remote
    );
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="local"}"#),
        0.0
    );
    let dm = scrape(daddr).await;
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="ok"}"#),
        remote
    );
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="failed"}"#),
        0.0
    );
    wait_idle(daddr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_output_is_exact_and_only_uncached_blocks_move() {
    let (_p, _d, r, daddr) = remote_prefill_cluster().await;
    let per_block = bytes_per_block();
    let block_tokens = 16usize;
    let recs = golden();
    let mut remote = 0.0;
    for g in &recs {
        let prompt = golden_ids(g, "prompt_ids");
        let want = golden_ids(g, "generated_ids");
        let before = metric(&scrape(&daddr).await, "tandem_kv_transfer_bytes_total");
        let (ids, usage) = generate_ids(&r.grpc, &prompt, want.len() as u32).await;
        assert_eq!(
            ids, want,
            "{}: disaggregated output differs from golden",
            g["id"]
        );
        let moved = metric(&scrape(&daddr).await, "tandem_kv_transfer_bytes_total") - before;
        let cached = usage.cached_prompt_tokens as usize;
        let blocks = prompt.len().div_ceil(block_tokens) - cached / block_tokens;
        assert_eq!(
            moved as u64,
            blocks as u64 * per_block,
            "{}: {} prompt tokens, {cached} cached on the decode worker",
            g["id"],
            prompt.len()
        );
        remote += 1.0;
    }
    // Multi-turn: the second turn repeats the first (prompt and answer) and adds a question;
    // only blocks past what the decode worker cached cross the wire.
    let g = recs.iter().find(|g| g["id"] == "dev_long_history").unwrap();
    let mut turn2 = golden_ids(g, "prompt_ids");
    turn2.extend(golden_ids(g, "generated_ids"));
    turn2.extend([
        198, 1, 4093, 198, 7329, 314, 260, 3575, 47, 2, 198, 1, 520, 9531, 198,
    ]);
    let before = metric(&scrape(&daddr).await, "tandem_kv_transfer_bytes_total");
    let (ids, usage) = generate_ids(&r.grpc, &turn2, 12).await;
    let moved = metric(&scrape(&daddr).await, "tandem_kv_transfer_bytes_total") - before;
    let cached = usage.cached_prompt_tokens as usize;
    let first_turn_blocks = golden_ids(g, "prompt_ids").len() / block_tokens;
    assert!(
        cached >= first_turn_blocks * block_tokens,
        "the first turn's {first_turn_blocks} full blocks are reused, {cached} tokens were"
    );
    let new_blocks = turn2.len().div_ceil(block_tokens) - cached / block_tokens;
    assert_eq!(moved as u64, new_blocks as u64 * per_block);
    assert!(
        new_blocks <= 6,
        "only the new tail moved: {new_blocks} blocks"
    );
    remote += 1.0;
    assert_eq!(ids, local_reference(&daddr, &turn2, 12).await);
    all_prefilled_remotely(&r, &daddr, remote).await;
}

/// Structured outputs across the split: the prefill worker samples the first token under the
/// grammar (free text there would break every JSON below) and the decode worker goes on from
/// it. Each schema once, greedy, every answer validated against its schema. (A test of its own,
/// on its own cluster, so that it runs beside the golden records above.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_hold_their_schemas_across_the_split() {
    let (_p, _d, r, daddr) = remote_prefill_cluster().await;
    let models = models(&r.http).await;
    let model = models["data"][0]["id"].as_str().unwrap();
    let remote = structured_python_client(&format!("{}/v1", r.http), model, true).await as f64;
    assert!(remote > 0.0);
    all_prefilled_remotely(&r, &daddr, remote).await;
}

/// Waits until the router sees exactly `n` prefill workers ready.
async fn ready_prefill_workers(http: &str, n: usize) {
    let end = Instant::now() + Duration::from_secs(30);
    loop {
        let v = router_state(http).await;
        let up = v["prefill_workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["ready"] == true)
            .count();
        if up == n {
            return;
        }
        assert!(Instant::now() < end, "prefill workers ready: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the router's view of its one decode worker passes `ok`.
async fn until_decode_worker(http: &str, what: &str, ok: impl Fn(&Value) -> bool) {
    let end = Instant::now() + Duration::from_secs(120);
    loop {
        let v = router_state(http).await;
        if ok(&v["workers"][0]) {
            return;
        }
        assert!(Instant::now() < end, "{what}: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_an_itl_target_a_prompt_goes_to_a_prefill_worker_while_streams_decode() {
    // A decode worker held to a 1 ms ITL target: any prompt of more than a few tokens takes
    // longer than that to compute there. The disaggregation threshold stays at its 256.
    let (_p, paddr) = start_prefill(&[]);
    let (_d, daddr, _kv) = start_decode(&["--itl-target-ms=1"]);
    let r = start_router(
        std::slice::from_ref(&daddr),
        &[&format!("--prefill-workers={paddr}")],
    );
    wait_ready(&r, 1).await;
    ready_prefill_workers(&r.http, 1).await;
    let counts = |m: &std::collections::HashMap<String, f64>| {
        (
            metric(m, r#"tandem_prefill_requests_total{mode="local"}"#),
            metric(m, r#"tandem_prefill_requests_total{mode="remote"}"#),
        )
    };
    // Nothing decoding: a 100-token prompt is computed where it decodes (and the worker
    // measures its prefill rate on it).
    let quiet = long_prompt(1, 100);
    let (alone, _) = generate_ids(&r.grpc, &quiet, 2).await;
    assert_eq!(counts(&scrape(&r.http).await), (1.0, 0.0));
    until_decode_worker(&r.http, "measured, idle", |w| {
        w["prefill_tokens_per_s"].as_f64().unwrap() > 0.0
            && w["decoding"] == 0
            && w["itl_target_ms"] == 1.0
    })
    .await;
    // A stream that keeps decoding (a short prompt: computed locally too).
    let stream = tokio::spawn({
        let grpc = r.grpc.clone();
        async move { generate_ids(&grpc, &long_prompt(2, 8), 4000).await }
    });
    until_decode_worker(&r.http, "a stream decoding", |w| w["decoding"] == 1).await;
    assert_eq!(counts(&scrape(&r.http).await), (2.0, 0.0));
    // Now the same length of prompt goes to the prefill worker, and gives the same tokens.
    let busy = long_prompt(3, 100);
    let (out, _) = generate_ids(&r.grpc, &busy, 2).await;
    assert_eq!(counts(&scrape(&r.http).await), (2.0, 1.0));
    stream.abort();
    let _ = stream.await;
    wait_idle(&daddr).await;
    assert_eq!(out, local_reference(&daddr, &busy, 2).await);
    assert_eq!(alone, local_reference(&daddr, &quiet, 2).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_prefill_worker_refuses_up_front_and_the_prompt_is_prefilled_locally_at_once() {
    // A prefill worker that queues at most 1 ms of work (at its measured rate) and computes in
    // 32-token chunks: a second prompt that comes while the first one is computing is refused
    // before any work, and its decode worker prefills it itself instead of waiting in line.
    let (_p, paddr) = start_prefill(&["--max-batched-tokens=32", "--max-queue-wait-ms=1"]);
    let (_d, daddr, _kv) = start_decode(&[]);
    let r = start_router(
        std::slice::from_ref(&daddr),
        &[&format!("--prefill-workers={paddr}")],
    );
    wait_ready(&r, 1).await;
    ready_prefill_workers(&r.http, 1).await;
    let (a, b) = (long_prompt(5, 1200), long_prompt(6, 1200));
    let base = metric(&scrape(&daddr).await, "tandem_kv_transfer_bytes_total");
    let first = tokio::spawn({
        let (grpc, a) = (r.grpc.clone(), a.clone());
        async move { generate_ids(&grpc, &a, 8).await }
    });
    // Two chunks in: the worker has finished a step, so it has measured its rate.
    wait_transfer_started(&daddr, base + 2.0 * bytes_per_block() as f64, &first).await;
    let (second, _) = generate_ids(&r.grpc, &b, 8).await;
    let (first, _) = first.await.unwrap();
    let pm = scrape(&paddr).await;
    assert_eq!(
        metric(&pm, r#"tandem_prefill_requests_total{result="refused"}"#),
        1.0
    );
    assert_eq!(
        metric(&pm, r#"tandem_prefill_requests_total{result="ok"}"#),
        1.0
    );
    let dm = scrape(&daddr).await;
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="refused"}"#),
        1.0
    );
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="failed"}"#),
        0.0
    );
    assert_eq!(
        metric(
            &dm,
            r#"tandem_remote_prefill_local_fallbacks_total{reason="all_candidates_failed"}"#
        ),
        1.0
    );
    wait_idle(&daddr).await;
    assert_eq!(
        first,
        local_reference(&daddr, &a, 8).await,
        "remote prefill"
    );
    assert_eq!(
        second,
        local_reference(&daddr, &b, 8).await,
        "refused, then local"
    );
    wait_idle(&daddr).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_engine_failing_under_a_request_ends_it_and_no_other_engine_runs_it() {
    // The prefill worker's engine panics in its first step, the one that holds the request. The
    // request ends with that failure: the decode worker neither tries another candidate nor
    // prefills it itself, and the router does not move it, since the request may be what made
    // the engine fail.
    let hook = [("TANDEM_TEST_PANIC_AT_STEP", "1")];
    let (mut p, paddr) = Launch::prefill().env(&hook).spawn_prefill();
    let (d, daddr, _kv) = start_decode(&[]);
    let r = start_router(
        std::slice::from_ref(&daddr),
        &[&format!("--prefill-workers={paddr}")],
    );
    wait_ready(&r, 1).await;
    ready_prefill_workers(&r.http, 1).await;
    let prompt = long_prompt(10, 1200);
    let mut c = tandem_proto::v1::generation_client::GenerationClient::connect(r.grpc.clone())
        .await
        .unwrap();
    let req = tandem_proto::v1::GenerateRequest {
        prompt: Some(tandem_proto::v1::generate_request::Prompt::TokenIds(
            tandem_proto::v1::TokenIds { ids: prompt },
        )),
        sampling: Some(tandem_proto::v1::SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        }),
        stopping: Some(tandem_proto::v1::StoppingCriteria {
            max_tokens: Some(4),
            ignore_eos: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let ended = match c.generate(req).await {
        Err(s) => Err(s),
        Ok(r) => {
            let mut s = r.into_inner();
            let mut tokens = Vec::new();
            loop {
                match s.message().await {
                    Ok(Some(m)) => tokens.extend(m.token_ids),
                    Ok(None) => break Ok(tokens),
                    Err(e) => break Err(e),
                }
            }
        }
    };
    let status = ended.expect_err("a request that failed an engine ends with an error");
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    let m = status.message();
    assert!(
        m.contains("the engine failed") && m.contains("engine step 1"),
        "{m}"
    );
    // The decode worker ran nothing of it: no local fallback, and every block it reserved is
    // back.
    let dm = scrape(&daddr).await;
    assert_eq!(
        metric(
            &dm,
            r#"tandem_remote_prefill_local_fallbacks_total{reason="all_candidates_failed"}"#
        ),
        0.0
    );
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="failed"}"#),
        1.0
    );
    wait_idle(&daddr).await;
    // The prefill worker stops by itself, with a failure; the decode worker lives on and
    // serves the next long prompt itself.
    let end = Instant::now() + Duration::from_secs(120);
    let exit = loop {
        if let Ok(Some(s)) = p.child.try_wait() {
            break s;
        }
        assert!(
            Instant::now() < end,
            "the failed prefill worker did not stop"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!exit.success(), "{exit:?}");
    ready_prefill_workers(&r.http, 0).await;
    let (out, _) = generate_ids(&r.grpc, &long_prompt(11, 1200), 4).await;
    assert_eq!(out.len(), 4);
    assert!(alive(d.pid()) && alive(r.proc.pid()));
    wait_idle(&daddr).await;
}

/// Waits until the decode worker has received more KV bytes than `base`, for the request
/// `req` sent for it: however long that takes on this machine (the 10x slow suite on 2 cores
/// ran past a minute before the first chunk arrived), but not past the request's end.
async fn wait_transfer_started<T>(daddr: &str, base: f64, req: &tokio::task::JoinHandle<T>) {
    while metric(&scrape(daddr).await, "tandem_kv_transfer_bytes_total") <= base {
        assert!(
            !req.is_finished(),
            "the request ended before any KV arrived"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_or_stalled_prefill_workers_and_strangers_lose_nothing() {
    // Small chunks make a prefill long enough to interrupt. No deadline depends on this machine's
    // speed: an attempt lives while its prefill worker keeps sending heartbeats and frames, within
    // 4x the time its measured rate gives, so only the frozen one (2 s silent) is given up on.
    let (p1, p1addr) = start_prefill(&["--max-batched-tokens=32"]);
    let (p2, p2addr) = start_prefill(&["--max-batched-tokens=128"]);
    let (_d, daddr, kvaddr) = start_decode(&["--kv-stall-timeout-ms=2000"]);
    let r = start_router(
        std::slice::from_ref(&daddr),
        &[&format!("--prefill-workers={p1addr},{p2addr}")],
    );
    wait_ready(&r, 1).await;
    let ready_prefill = |n: usize| ready_prefill_workers(&r.http, n);

    // 1. The first candidate dies mid-transfer: the second one serves the request.
    let prompt = long_prompt(1, 1200);
    let base = metric(&scrape(&daddr).await, "tandem_kv_transfer_bytes_total");
    let req = tokio::spawn({
        let (grpc, prompt) = (r.grpc.clone(), prompt.clone());
        async move { generate_ids(&grpc, &prompt, 16).await }
    });
    wait_transfer_started(&daddr, base, &req).await;
    p1.signal(libc::SIGKILL);
    let (ids, _) = req.await.unwrap();
    let dm = scrape(&daddr).await;
    assert!(metric(&dm, r#"tandem_kv_transfers_total{result="failed"}"#) >= 1.0);
    assert_eq!(
        metric(&dm, r#"tandem_kv_transfers_total{result="ok"}"#),
        1.0
    );
    wait_idle(&daddr).await;
    // Its reference is computed after part 2: a prompt prefilled on the decode worker gives the
    // router a measured local rate, and the crossover (local against remote estimates, both
    // measured on a busy machine) could then keep part 2's prompt local.
    let killed = (prompt, ids);

    // 2. The only live prefill worker freezes (SIGSTOP) mid-transfer: its heartbeats stop, the
    //    stall allowance passes and the decode worker prefills locally.
    ready_prefill(1).await;
    let prompt = long_prompt(2, 1200);
    let base = metric(&scrape(&daddr).await, "tandem_kv_transfer_bytes_total");
    let req = tokio::spawn({
        let (grpc, prompt) = (r.grpc.clone(), prompt.clone());
        async move { generate_ids(&grpc, &prompt, 16).await }
    });
    wait_transfer_started(&daddr, base, &req).await;
    p2.signal(libc::SIGSTOP);
    let (ids, _) = req.await.unwrap();
    p2.signal(libc::SIGCONT);
    let dm = scrape(&daddr).await;
    assert_eq!(
        metric(
            &dm,
            r#"tandem_remote_prefill_local_fallbacks_total{reason="all_candidates_failed"}"#
        ),
        1.0
    );
    assert_eq!(
        metric(
            &scrape(&r.http).await,
            r#"tandem_prefill_requests_total{mode="remote"}"#
        ),
        2.0,
        "both prompts were planned remote"
    );
    wait_idle(&daddr).await;
    assert_eq!(
        ids,
        local_reference(&daddr, &prompt, 16).await,
        "after a stall"
    );
    wait_idle(&daddr).await;
    assert_eq!(
        killed.1,
        local_reference(&daddr, &killed.0, 16).await,
        "after a kill -9"
    );

    // 3. Strangers: junk, and a peer with the wrong secret, write nothing.
    let bytes = metric(&dm, "tandem_kv_transfer_bytes_total");
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(&kvaddr).await.unwrap();
        let _ = s.write_all(&[0x54u8; 4096]).await;
        let mut buf = [0u8; 64];
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "the receiver hangs up on a stranger");
    }
    let wrong = TcpTransport::new(Secret::new(b"not-the-cluster-secret".to_vec()).unwrap());
    assert!(
        wrong.open(&kvaddr, 1).await.is_err(),
        "wrong secret refused"
    );
    let dm = scrape(&daddr).await;
    assert_eq!(
        metric(
            &dm,
            r#"tandem_kv_transfer_rejected_frames_total{reason="unauthenticated"}"#
        ),
        2.0
    );
    assert_eq!(metric(&dm, "tandem_kv_transfer_bytes_total"), bytes);
}

/// A KV transport whose sends wait until the test lets them through (their frames go
/// nowhere): a link that takes the KV as slowly as the test likes.
struct Held {
    gate: Arc<tokio::sync::Semaphore>,
    held: Arc<AtomicBool>,
}

struct HeldStream {
    gate: Arc<tokio::sync::Semaphore>,
    held: Arc<AtomicBool>,
}

impl KvTransport for Held {
    fn open<'a>(
        &'a self,
        _endpoint: &'a str,
        _transfer: u64,
    ) -> BoxFuture<'a, Result<Box<dyn KvStream>, TransferError>> {
        let (gate, held) = (self.gate.clone(), self.held.clone());
        Box::pin(async move { Ok(Box::new(HeldStream { gate, held }) as Box<dyn KvStream>) })
    }
}

impl KvStream for HeldStream {
    fn send_blocks<'a>(
        &'a mut self,
        _transfer: u64,
        _frames: &'a [BlockFrame<'a>],
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async move {
            self.held.store(true, Ordering::SeqCst);
            let permit = self
                .gate
                .acquire()
                .await
                .map_err(|_| TransferError::Aborted)?;
            permit.forget();
            Ok(())
        })
    }
    fn end(&mut self, _transfer: u64) -> BoxFuture<'_, Result<(), TransferError>> {
        Box::pin(async { Ok(()) })
    }
    fn abort(&mut self, _transfer: u64) -> BoxFuture<'_, Result<(), TransferError>> {
        Box::pin(async { Ok(()) })
    }
    fn context<'a>(
        &'a mut self,
        _transfer: u64,
        _context: &'a str,
    ) -> BoxFuture<'a, Result<(), TransferError>> {
        Box::pin(async { Ok(()) })
    }
}

/// A prefill worker service in this process over its own engine, sending KV through
/// `transport`; its address.
async fn serve_prefill(transport: Arc<dyn KvTransport>) -> String {
    serve_prefill_on(engine(), transport).await
}

/// [`serve_prefill`] over `engine`. Its admission takes up to an hour of queued work: these
/// workers' tests check transfers, not admission (`a_busy_prefill_worker_refuses_...` does),
/// and on a machine 10x slower a retry sent to the worker while its first attempt's prompt still
/// counts as queued was refused by the default 10 s (seen in the slowed disaggregation run).
async fn serve_prefill_on(
    engine: tandem_engine::EngineHandle,
    transport: Arc<dyn KvTransport>,
) -> String {
    capture_worker_logs();
    let prefill = tandem_prefill_worker::PrefillService::new(
        Arc::new(engine),
        transport,
        tandem_decode_worker::WorkerIdentity {
            worker_id: "p".into(),
            model: "m".into(),
            kv_dtype: "f32".into(),
            loras: no_loras(),
        },
        tandem_prefill_worker::PrefillLimits {
            max_queue_wait: Duration::from_secs(3600),
        },
    );
    let pl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let paddr = pl.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(wpb::prefill_server::PrefillServer::new(prefill))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(pl)),
    );
    paddr
}

/// While the link holds a prefill's KV, the worker goes on telling its caller that it is alive
/// (and its rate): heartbeats keep coming, four of them after the send was held (the worker
/// beats every 250 ms; a beat already on its way when the send was held is at most the first),
/// and the answer comes once the link takes the KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_worker_keeps_beating_while_its_link_holds_the_kv() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let held = Arc::new(AtomicBool::new(false));
    let paddr = serve_prefill(Arc::new(Held {
        gate: gate.clone(),
        held: held.clone(),
    }))
    .await;
    let mut c = wpb::prefill_client::PrefillClient::connect(format!("http://{paddr}"))
        .await
        .unwrap();
    let prompt = long_prompt(5, 64);
    let req = wpb::PrefillRequest {
        request_id: "held".into(),
        prompt_ids: prompt,
        cached_tokens: 0,
        destination: Some(wpb::KvDestination {
            endpoint: "held".into(),
            transfer_id: 7,
            block_ids: (0..4).collect(),
        }),
        sampling: Some(wpb::Sampling::default()),
        priority: 0,
        lora: None,
    };
    let mut updates = c.prefill(req).await.unwrap().into_inner();
    use wpb::prefill_update::Update;
    async fn next(u: &mut tonic::Streaming<wpb::PrefillUpdate>) -> Option<Update> {
        tokio::time::timeout(Duration::from_secs(120), u.message())
            .await
            .expect("the worker went silent while the link held its KV")
            .unwrap()
            .expect("the call ended early")
            .update
    }
    assert!(matches!(
        next(&mut updates).await,
        Some(Update::Accepted(_))
    ));
    let mut beats_held = 0;
    while beats_held < 4 {
        match next(&mut updates).await {
            Some(Update::Progress(_)) if held.load(Ordering::SeqCst) => beats_held += 1,
            Some(Update::Progress(_)) => {}
            other => panic!("{other:?} before the link took the KV"),
        }
    }
    gate.add_permits(1 << 20);
    loop {
        match next(&mut updates).await {
            Some(Update::Progress(_)) => {}
            Some(Update::Done(d)) => {
                assert_eq!(d.prefilled_tokens, 64);
                break;
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A worker's adapters: none.
fn no_loras() -> Arc<tandem_worker::Loras> {
    let c = tandem_model::load_text(&model_path()).unwrap().config;
    Arc::new(tandem_worker::Loras::none(c))
}

fn engine() -> tandem_engine::EngineHandle {
    engine_on(None)
}

/// The default model's engine; with `device_delay`, its pool reached only through the host
/// fake of a device (every batch of copies that late), as a GPU's is.
fn engine_on(device_delay: Option<Duration>) -> tandem_engine::EngineHandle {
    engine_and_device(device_delay).0
}

/// [`engine_on`], and the (first rank's) fake device where there is one.
fn engine_and_device(
    device_delay: Option<Duration>,
) -> (tandem_engine::EngineHandle, Option<Arc<FakeDevice>>) {
    engine_tp_and_device(1, device_delay)
}

/// [`engine_and_device`] over `tp` tensor-parallel ranks (with a device, a fake device per
/// rank's pool, as GPUs a rank each).
fn engine_tp_and_device(
    tp: usize,
    device_delay: Option<Duration>,
) -> (tandem_engine::EngineHandle, Option<Arc<FakeDevice>>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = tandem_engine::EngineHandle::spawn(move || {
        let loaded = tandem_model::load(&model_path())?;
        let cfg = tandem_engine::EngineConfig {
            kv_cache_mb: 64,
            ..Default::default()
        };
        let eos = loaded.tokenizer.eos_token_ids.clone();
        let cpu: Box<dyn tandem_engine::Backend> = match tp {
            1 => {
                let model = tandem_engine::CpuModel::new(&loaded, Default::default())?;
                Box::new(tandem_engine::CpuBackend::new(model, &cfg.pool())?)
            }
            _ => Box::new(tandem_engine::TpCpuBackend::new(
                &loaded,
                Default::default(),
                &cfg.pool(),
                tandem_engine::TpCpuConfig {
                    size: tp,
                    threads_per_rank: 1,
                    watchdog: Duration::from_secs(600),
                    max_step_tokens: cfg.max_batched_tokens,
                    max_step_seqs: cfg.max_seqs,
                    experts: false,
                },
            )?),
        };
        match device_delay {
            None => tandem_engine::Engine::with_backend(cpu, cfg, eos),
            Some(delay) => {
                let b = FakeDeviceBackend::new(cpu, delay)?;
                let _ = tx.send(b.fake().clone());
                tandem_engine::Engine::with_backend(Box::new(b), cfg, eos)
            }
        }
    })
    .unwrap();
    (handle, rx.try_recv().ok())
}

/// A decode worker service in this process over `engine`, taking remote prefills into its
/// cache (host pools or a device's) with `secret`: its KV ingress and its address.
async fn serve_decode_with_remote(
    engine: tandem_engine::EngineHandle,
    secret: Secret,
) -> (Arc<tandem_decode_worker::remote::RemotePrefill>, String) {
    capture_worker_logs();
    let engine = Arc::new(engine);
    // SAFETY: the target is this engine's own.
    let remote = Arc::new(
        unsafe {
            tandem_decode_worker::remote::RemotePrefill::bind(
                "127.0.0.1:0",
                "127.0.0.1",
                secret,
                "m",
                tandem_worker::KvTarget::of(&engine).unwrap(),
                // These tests move KV and count the transfers; none tests the deadlines (the
                // process tests with `--kv-stall-timeout-ms` do). With the default ones, a
                // prompt's attempt is bounded by 4x the prefill worker's measured rate, which
                // the load of the suite's parallel tests on 2 cores has moved more than that
                // between one prompt and the next (a 280-token prompt "not done within 29.4 s"
                // at 46 tokens/s, and a local prefill instead). So the bounds here are the
                // broken-build bound of `wait_until`, not a timing.
                tandem_decode_worker::remote::Deadlines {
                    stall: Duration::from_secs(600),
                    slack: 1e6,
                },
            )
        }
        .await
        .unwrap(),
    );
    let decode = tandem_decode_worker::DecodeService::new(
        engine,
        tandem_decode_worker::WorkerIdentity {
            worker_id: "d".into(),
            model: "m".into(),
            kv_dtype: "f32".into(),
            loras: no_loras(),
        },
    )
    .with_remote(remote.clone());
    let dl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let daddr = dl.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(wpb::worker_control_server::WorkerControlServer::new(
                decode.control(),
            ))
            .add_service(wpb::decode_server::DecodeServer::new(decode))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(dl)),
    );
    (remote, daddr)
}

/// Greedy `max_tokens` of `prompt` from the decode worker at `daddr`, prefilled on the prefill
/// workers `prefill_addrs` (in order) where they can.
async fn remote_greedy(
    daddr: &str,
    id: &str,
    prompt: &[u32],
    max_tokens: u32,
    prefill_addrs: Vec<String>,
) -> Vec<u32> {
    let mut c = wpb::decode_client::DecodeClient::connect(format!("http://{daddr}"))
        .await
        .unwrap();
    let req = wpb::DecodeRequest {
        request_id: id.into(),
        prompt_ids: prompt.to_vec(),
        sampling: Some(wpb::Sampling::default()),
        stopping: Some(wpb::Stopping {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        prefill: Some(wpb::PrefillPlan {
            plan: Some(wpb::prefill_plan::Plan::Remote(wpb::RemotePrefill {
                prefill_addrs,
            })),
        }),
        ..Default::default()
    };
    let mut s = c.generate(req).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while let Some(m) = s.next().await {
        ids.extend(m.unwrap().tokens.iter().map(|t| t.id));
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_is_rejected_counted_and_the_request_recovers() {
    let secret = Secret::new(KV_SECRET.as_bytes().to_vec()).unwrap();
    // The production transport, the first block frame it sends damaged after its checksum.
    let fault = WireFault::flip_block_frame(1);
    let paddr = serve_prefill(Arc::new(
        TcpTransport::new(secret.clone()).with_fault(fault.clone()),
    ))
    .await;
    let (remote, daddr) = serve_decode_with_remote(engine(), secret).await;
    let prompt = long_prompt(3, 300);
    // The same prefill worker twice: the first attempt is damaged, the second is clean.
    let ids = remote_greedy(&daddr, "flip", &prompt, 12, vec![paddr.clone(), paddr]).await;
    let seen = ingress(&remote);
    assert!(fault.fired(), "{seen}");
    let rx = remote.receiver();
    assert_eq!(
        rx.rejections().bad_checksum.load(Ordering::Relaxed),
        1,
        "{seen}"
    );
    assert_eq!(
        remote.counts.transfers_failed.load(Ordering::Relaxed),
        1,
        "{seen}"
    );
    assert_eq!(
        remote.counts.transfers_ok.load(Ordering::Relaxed),
        1,
        "{seen}"
    );
    assert_eq!(remote.counts.fallbacks.load(Ordering::Relaxed), 0, "{seen}");
    assert_eq!(ids, local_reference(&daddr, &prompt, 12).await, "{seen}");
    wait_idle(&daddr).await;
}

/// What a decode worker's KV ingress counted: each attempt's end, failures by reason and the
/// receiver's rejections (a failed assertion on one of them says what happened instead).
fn ingress(remote: &tandem_decode_worker::remote::RemotePrefill) -> String {
    use tandem_decode_worker::remote::Failure;
    let c = &remote.counts;
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let failures: Vec<_> = Failure::ALL
        .iter()
        .map(|f| format!("{}={}", f.as_str(), l(&c.failures[*f as usize])))
        .collect();
    let rejected: Vec<_> = remote
        .receiver()
        .rejections()
        .snapshot()
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .map(|(why, n)| format!("{why}={n}"))
        .collect();
    format!(
        "attempts: ok {}, failed {}, refused {}; fallbacks {}; failures: {}; frames rejected: [{}]",
        l(&c.transfers_ok),
        l(&c.transfers_failed),
        l(&c.transfers_refused),
        l(&c.fallbacks),
        failures.join(" "),
        rejected.join(" ")
    )
}

/// The KV staging paths a GPU worker takes, with the host fake of the device (copies complete
/// 3 ms late, on a thread of their own): a prefill worker whose cache is behind the device
/// exports through page-locked staging, a decode worker whose cache is behind it imports through
/// staging slots settled before the request joins; each pairing with a plain CPU worker and with
/// each other. The tokens are those of the decode worker prefilling locally, the transfer
/// succeeds first time, and every byte of the prompt's blocks reached the decode side's pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_moves_through_device_staging_on_either_side_exactly() {
    let delay = Some(Duration::from_millis(3));
    for (prefill_dev, decode_dev) in [(None, delay), (delay, None), (delay, delay)] {
        let secret = Secret::new(KV_SECRET.as_bytes().to_vec()).unwrap();
        let paddr = serve_prefill_on(
            engine_on(prefill_dev),
            Arc::new(TcpTransport::new(secret.clone())),
        )
        .await;
        let decode_engine = engine_on(decode_dev);
        assert_eq!(decode_engine.kv_writers().is_empty(), decode_dev.is_some());
        let (remote, daddr) = serve_decode_with_remote(decode_engine, secret).await;
        // 300 tokens: 19 blocks of 16, the last partial.
        let prompt = long_prompt(4, 300);
        let ids = remote_greedy(&daddr, "staged", &prompt, 12, vec![paddr]).await;
        let case = format!(
            "prefill on a device: {}, decode on a device: {}",
            prefill_dev.is_some(),
            decode_dev.is_some()
        );
        assert_eq!(
            remote.counts.transfers_ok.load(Ordering::Relaxed),
            1,
            "{case}"
        );
        assert_eq!(remote.counts.fallbacks.load(Ordering::Relaxed), 0, "{case}");
        assert_eq!(remote.receiver().rejections().total(), 0, "{case}");
        // SmolLM2-135M: 30 layers, 3 KV heads of 64, f32: 2 · 3 · 64 · 16 · 4 bytes a frame.
        let frame = 2 * 3 * 64 * 16 * 4;
        assert_eq!(remote.rank_bytes(), [19 * 30 * frame as u64], "{case}");
        assert_eq!(ids.len(), 12, "{case}");
        assert_eq!(ids, local_reference(&daddr, &prompt, 12).await, "{case}");
        wait_idle(&daddr).await;
    }
}

/// Tensor-parallel caches behind devices, a fake device per rank's pool as a GPU per rank (as
/// `--tp` on CUDA has them): a prefill worker of 3 ranks exports each rank's KV heads through
/// its own staging, a decode worker of 3 takes each piece into its rank's pool, and a worker of
/// one rank on either side splits or joins the heads. The transfer succeeds first time, every
/// decode rank received exactly its heads' bytes, and the tokens are the golden ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_moves_between_tensor_parallel_device_pools_exactly() {
    let delay = Some(Duration::from_millis(1));
    for (p_tp, d_tp) in [(3, 1), (1, 3), (3, 3)] {
        let secret = Secret::new(KV_SECRET.as_bytes().to_vec()).unwrap();
        let paddr = serve_prefill_on(
            engine_tp_and_device(p_tp, delay).0,
            Arc::new(TcpTransport::new(secret.clone())),
        )
        .await;
        let decode_engine = engine_tp_and_device(d_tp, delay).0;
        assert!(decode_engine.kv_writers().is_empty());
        assert_eq!(decode_engine.kv_devices().len(), d_tp);
        let (remote, daddr) = serve_decode_with_remote(decode_engine, secret).await;
        let g = golden()
            .into_iter()
            .find(|g| g["id"] == "dev_long_history")
            .unwrap();
        let (prompt, want) = (
            golden_ids(&g, "prompt_ids"),
            golden_ids(&g, "generated_ids"),
        );
        let blocks = prompt.len().div_ceil(16) as u64;
        let ids = remote_greedy(&daddr, "tp-staged", &prompt, want.len() as u32, vec![paddr]).await;
        let case = format!("prefill tp {p_tp} -> decode tp {d_tp}");
        assert_eq!(
            remote.counts.transfers_ok.load(Ordering::Relaxed),
            1,
            "{case}"
        );
        assert_eq!(remote.counts.fallbacks.load(Ordering::Relaxed), 0, "{case}");
        assert_eq!(remote.receiver().rejections().total(), 0, "{case}");
        // SmolLM2-135M: 30 layers, 3 KV heads of 64, f32: 2 · 64 · 16 · 4 bytes a head's frame.
        let head_frame = 2 * 64 * 16 * 4;
        let share = blocks * 30 * (3 / d_tp) as u64 * head_frame;
        assert_eq!(remote.rank_bytes(), vec![share; d_tp], "{case}");
        assert_eq!(ids, want, "{case}: the golden tokens");
        wait_idle(&daddr).await;
    }
}

/// KV payloads on a payload link between two workers whose caches sit behind the host fake of
/// a device, as two GPU workers' go on NCCL (two thread ranks of this process stand for the two
/// GPUs' NCCL ranks: one card cannot hold both). The first prefill worker has its first payload
/// damaged on the link: that attempt fails (`bad_checksum`) and the second prefill worker's
/// succeeds on a link of its own; every byte that reached the decode pool came on a link, and the
/// tokens are a local prefill's. The next prompt from the same prefill worker takes the same link
/// again (no new pair is made). A decode worker that has no fabric declines the offers and takes
/// its prompts over TCP, as exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_payloads_go_on_a_link_between_device_workers_exactly() {
    let delay = Some(Duration::from_millis(3));
    let fabric = ThreadFabric::new(Duration::from_secs(120));
    let secret = Secret::new(KV_SECRET.as_bytes().to_vec()).unwrap();
    let fault = WireFault::flip_block_frame(1);
    let damaging = serve_prefill_on(
        engine_on(delay),
        Arc::new(
            TcpTransport::new(secret.clone())
                .with_fault(fault.clone())
                .with_link(fabric.clone()),
        ),
    )
    .await;
    let clean = serve_prefill_on(
        engine_on(delay),
        Arc::new(TcpTransport::new(secret.clone()).with_link(fabric.clone())),
    )
    .await;
    for joins in [true, false] {
        let (remote, daddr) = serve_decode_with_remote(engine_on(delay), secret.clone()).await;
        if joins {
            remote.receiver().join_links(fabric.clone());
        }
        let prompt = long_prompt(8 + joins as u32, 300);
        let plan = vec![damaging.clone(), clean.clone()];
        let ids = remote_greedy(&daddr, "linked", &prompt, 12, plan).await;
        let seen = format!("joins: {joins}; {}", ingress(&remote));
        let c = &remote.counts;
        let rx = remote.receiver();
        // The fault fires once, on the first case's first attempt.
        let failed = joins as u64;
        assert!(fault.fired(), "{seen}");
        assert_eq!(
            rx.rejections().bad_checksum.load(Ordering::Relaxed),
            failed,
            "{seen}"
        );
        assert_eq!(c.transfers_failed.load(Ordering::Relaxed), failed, "{seen}");
        assert_eq!(c.transfers_ok.load(Ordering::Relaxed), 1, "{seen}");
        assert_eq!(c.fallbacks.load(Ordering::Relaxed), 0, "{seen}");
        assert_eq!(
            rx.rejections().link_failed.load(Ordering::Relaxed),
            0,
            "{seen}"
        );
        // SmolLM2-135M: 30 layers, 3 KV heads of 64, f32; 300 tokens: 19 blocks of 16.
        let prompt_bytes = 19 * 30 * (2 * 3 * 64 * 16 * 4) as u64;
        assert_eq!(remote.rank_bytes(), [prompt_bytes], "{seen}");
        let on_link = |prompts: u64| if joins { prompts * prompt_bytes } else { 0 };
        assert_eq!(rx.link_bytes_received(), on_link(1), "{seen}");
        assert_eq!(ids.len(), 12, "{seen}");
        assert_eq!(ids, local_reference(&daddr, &prompt, 12).await, "{seen}");

        // Another prompt from the clean worker, once its link is idle on both sides (the
        // damaging worker's, cut or drained, is dropped or idle too).
        wait_until(|| rx.busy_links() == 0 && rx.idle_links() >= joins as usize).await;
        let offered = fabric.offered();
        let other = long_prompt(20 + joins as u32, 300);
        let ids = remote_greedy(&daddr, "again", &other, 12, vec![clean.clone()]).await;
        assert_eq!(c.transfers_ok.load(Ordering::Relaxed), 2, "{seen}");
        assert_eq!(rx.link_bytes_received(), on_link(2), "{seen}");
        assert_eq!(fabric.offered() - offered, !joins as u64, "{seen}");
        assert_eq!(ids, local_reference(&daddr, &other, 12).await, "{seen}");
        wait_idle(&daddr).await;
    }
    assert_eq!(
        fabric.pending(),
        0,
        "every offered pair joined or withdrawn"
    );
}

/// Waits (at most ten minutes: a bound for a broken build, not a timing) until `ok`.
async fn wait_until(ok: impl Fn() -> bool) {
    let end = Instant::now() + Duration::from_secs(600);
    while !ok() {
        assert!(Instant::now() < end, "never came");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `--kv-link nccl` on a CPU worker, and a link mode that does not exist, are refused at start
/// with the reason, before a model is loaded or a port opened.
#[test]
fn a_kv_link_a_worker_cannot_make_is_refused_at_start() {
    for (role, args, want) in [
        (
            "prefill",
            &["--kv-link", "nccl"][..],
            "--kv-link nccl: NCCL links join GPUs, and this worker runs on the CPU (--device cpu)",
        ),
        (
            "decode",
            &["--kv-link", "nccl"][..],
            "--kv-link nccl: NCCL links join GPUs, and this worker runs on the CPU (--device cpu)",
        ),
        (
            "prefill",
            &["--kv-link", "infiniband"][..],
            "unknown KV link \"infiniband\" (auto, nccl or off)",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
            .arg(role)
            .args(args)
            .args(["--port", "0", "--kv-port", "0"][..if role == "decode" { 4 } else { 2 }].iter())
            .env("TANDEM_KV_SECRET", KV_SECRET)
            .env("TANDEM_MODEL", "/nonexistent/model.gguf")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{role} {args:?}: {err}");
        assert!(err.contains(want), "{role} {args:?}: {err}");
    }
}

/// A decode worker whose device copies fail (a GPU gone bad) fails the transfer when it settles
/// its staging, revokes the grant and prefills the prompt itself: the tokens are those of a
/// local prefill and no block is left held; once the copies work again, the next transfer
/// succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_device_copy_fails_the_transfer_and_the_prompt_is_prefilled_locally() {
    let secret = Secret::new(KV_SECRET.as_bytes().to_vec()).unwrap();
    let paddr = serve_prefill(Arc::new(TcpTransport::new(secret.clone()))).await;
    let (engine, fake) = engine_and_device(Some(Duration::from_millis(1)));
    let fake = fake.expect("a fake device");
    let (remote, daddr) = serve_decode_with_remote(engine, secret).await;
    fake.fail_copies(Some("device lost"));
    let prompt = long_prompt(6, 280);
    let ids = remote_greedy(&daddr, "lost", &prompt, 10, vec![paddr.clone()]).await;
    assert_eq!(remote.counts.transfers_failed.load(Ordering::Relaxed), 1);
    assert_eq!(remote.counts.fallbacks.load(Ordering::Relaxed), 1);
    assert_eq!(remote.counts.transfers_ok.load(Ordering::Relaxed), 0);
    wait_idle(&daddr).await;
    fake.fail_copies(None);
    let want = local_reference(&daddr, &prompt, 10).await;
    assert_eq!(ids, want);
    let other = long_prompt(7, 280);
    let again = remote_greedy(&daddr, "back", &other, 10, vec![paddr]).await;
    assert_eq!(remote.counts.transfers_ok.load(Ordering::Relaxed), 1);
    assert_eq!(again, local_reference(&daddr, &other, 10).await);
    wait_idle(&daddr).await;
}

/// Streams `body` through a router over two decode workers (`workers`, with their addresses),
/// `hit`s the one holding the stream once ten events are in, and checks that the stream still
/// ends as a non-streamed rerun of the same request does, after exactly one migration. Returns
/// the address of the worker that was hit.
async fn hit_the_busy_worker_mid_stream(
    r: &Router,
    workers: [(&mut Proc, &str); 2],
    body: Value,
    hit: impl FnOnce(&mut Proc),
) -> String {
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/completions", r.http))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let mut raw = String::new();
    let mut hit = Some(hit);
    let mut victim = None;
    while let Some(chunk) = stream.next().await {
        raw.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        if victim.is_none() && sse_events(&raw).len() >= 10 {
            let busy = worker_holding_the_stream(&r.http).await;
            let i = usize::from(busy != workers[0].1);
            (hit.take().unwrap())(&mut *workers[i].0);
            victim = Some(busy);
        }
    }
    let victim = victim.expect("the stream outlived the point it was to be hit at");
    let (text, finish, _) = read_stream(&raw);
    assert_eq!(finish.as_deref(), Some("length"));
    let mut again = body.clone();
    again["stream"] = json!(false);
    let (status, v) = post(&r.http, "/v1/completions", again).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(text, v["choices"][0]["text"].as_str().unwrap());
    assert_eq!(
        metric(&scrape(&r.http).await, "tandem_request_migrations_total"),
        1.0
    );
    victim
}

/// A greedy story streamed through `r`, its worker SIGKILLed mid-stream (see
/// [`hit_the_busy_worker_mid_stream`]).
async fn kill_the_busy_worker_mid_story(r: &Router, workers: [(&mut Proc, &str); 2]) {
    let body = json!({
        "prompt": "Write a long story about a lighthouse keeper.",
        "max_tokens": 120,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    });
    hit_the_busy_worker_mid_stream(r, workers, body, |p| {
        p.signal(libc::SIGKILL);
        p.wait_exit(Duration::from_secs(5));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_killed_mid_stream_is_migrated_seamlessly() {
    let (mut d1, d1addr) = start_worker(&[]);
    let (mut d2, d2addr) = start_worker(&[]);
    let r = start_router(&[d1addr.clone(), d2addr.clone()], &[]);
    wait_ready(&r, 2).await;
    kill_the_busy_worker_mid_story(&r, [(&mut d1, &d1addr), (&mut d2, &d2addr)]).await;
}

/// Speculative decoding through the cluster: decode workers that speculate (suffix decoding,
/// its worker-wide index learning from the records before) after a remote prefill give every
/// golden record's tokens, and a stream whose worker is killed mid-way resumes on the other,
/// speculating too, with the text of an uninterrupted run. The workers count what they
/// proposed and what was accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculating_decode_workers_stay_exact_across_the_split_and_a_migration() {
    let spec = ["--speculative=suffix", "--num-speculative-tokens=4"];
    let (accepted, proposed, prefill) = speculate_across_the_split_and_a_migration(&spec).await;
    assert!(
        accepted > 0.0 && accepted <= proposed,
        "{accepted} of {proposed}"
    );
    assert_eq!(prefill, 0.0, "no draft model, nothing to catch up");
}

/// The same with a draft model on the decode workers: the model's own file, every proposal
/// verified (so each proposes what the target draws, and only what follows a record's last
/// token goes unaccepted). Its K/V for each prompt is computed on the decode worker (the
/// prefill worker sends the target's only), and again on the worker a migration moves to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_model_on_the_decode_workers_stays_exact_across_the_split_and_a_migration() {
    let draft = format!(
        "--speculative=draft:{}",
        tandem_model::default_model_path().display()
    );
    let spec = [
        draft.as_str(),
        "--num-speculative-tokens=3",
        "--speculative-fixed",
    ];
    let (accepted, proposed, prefill) = speculate_across_the_split_and_a_migration(&spec).await;
    let tails = 2.0 * golden().len() as f64;
    assert!(
        accepted > 0.0 && proposed - accepted <= tails,
        "{accepted} of {proposed}"
    );
    // Every prompt's K/V for the draft was computed on the decode workers.
    let prompts: usize = golden()
        .iter()
        .map(|g| golden_ids(g, "prompt_ids").len())
        .sum();
    assert!(prefill >= prompts as f64, "{prefill} of {prompts}");
}

/// A prefill worker and two decode workers started with `spec`: every golden record's tokens
/// after a remote prefill, then a stream whose worker is killed mid-way resumed on the other
/// with the text of an uninterrupted run; the tokens the workers had accepted and proposed
/// over the records, and those their draft models computed to catch up.
async fn speculate_across_the_split_and_a_migration(spec: &[&str]) -> (f64, f64, f64) {
    let (_p, paddr) = start_prefill(&[]);
    let (mut d1, d1addr, _) = start_decode(spec);
    let (mut d2, d2addr, _) = start_decode(spec);
    let r = start_router(
        &[d1addr.clone(), d2addr.clone()],
        &[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=1",
        ],
    );
    wait_ready(&r, 2).await;
    for g in &golden() {
        let prompt = golden_ids(g, "prompt_ids");
        let want = golden_ids(g, "generated_ids");
        let (ids, _) = generate_ids(&r.grpc, &prompt, want.len() as u32).await;
        assert_eq!(ids, want, "{}: speculating after a remote prefill", g["id"]);
    }
    let rm = scrape(&r.http).await;
    assert_eq!(
        metric(&rm, r#"tandem_prefill_requests_total{mode="local"}"#),
        0.0
    );
    let counted = |m: &std::collections::HashMap<String, f64>, what: &str| {
        metric(m, &format!("tandem_spec_decode_num_{what}_total"))
    };
    let (m1, m2) = (scrape(&d1addr).await, scrape(&d2addr).await);
    let accepted = counted(&m1, "accepted_tokens") + counted(&m2, "accepted_tokens");
    let proposed = counted(&m1, "draft_tokens") + counted(&m2, "draft_tokens");
    let prefill = counted(&m1, "draft_prefill_tokens") + counted(&m2, "draft_prefill_tokens");
    kill_the_busy_worker_mid_story(&r, [(&mut d1, &d1addr), (&mut d2, &d2addr)]).await;
    (accepted, proposed, prefill)
}

/// Migration that moves KV: a long prompt prefilled on a prefill worker, its decode worker killed
/// mid-stream; the request resumes on the other decode worker, which takes the KV of the prompt
/// and of the tokens streamed so far from the prefill worker (it holds the prompt's blocks and
/// computes only the streamed tokens) instead of computing it all. Same text, one migration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_request_takes_its_prompt_s_kv_from_the_prefill_worker() {
    let (_p, paddr) = start_prefill(&[]);
    let (mut d1, d1addr, _) = start_decode(&[]);
    let (mut d2, d2addr, _) = start_decode(&[]);
    let r = start_router(
        &[d1addr.clone(), d2addr.clone()],
        &[
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=64",
        ],
    );
    wait_ready(&r, 2).await;
    let body = json!({
        "prompt": "Write a long story about a lighthouse keeper and the sea. ".repeat(12),
        "max_tokens": 96,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    });
    let hits =
        |m: &std::collections::HashMap<String, f64>| metric(m, "tandem_prefix_cache_hits_total");
    let hits_before = hits(&scrape(&paddr).await);
    let victim =
        hit_the_busy_worker_mid_stream(&r, [(&mut d1, &d1addr), (&mut d2, &d2addr)], body, |p| {
            p.signal(libc::SIGKILL);
            p.wait_exit(Duration::from_secs(5));
        })
        .await;
    let survivor = if victim == d1addr { &d2addr } else { &d1addr };
    // The survivor received KV for the resumed stream (and for the check's uninterrupted run),
    // and the prefill worker found the prompt in its cache for it.
    let sm = scrape(survivor).await;
    assert!(
        metric(&sm, "tandem_kv_transfer_bytes_total") > 0.0,
        "{sm:?}"
    );
    assert!(hits(&scrape(&paddr).await) - hits_before >= 128.0);
    // Of the resumed request's KV, the prompt's whole blocks were found (at the prefill
    // worker); only what no one held was computed again: the prompt's last, partly filled
    // block and the tokens streamed before the kill (fewer than 16 + 96).
    assert_eq!(metric(&sm, "tandem_resumed_requests_total"), 1.0);
    let found = metric(&sm, "tandem_resumed_kv_tokens_total{kv=\"found\"}");
    let again = metric(&sm, "tandem_resumed_kv_tokens_total{kv=\"recomputed\"}");
    assert!(found >= 128.0 && found % 16.0 == 0.0, "{found}");
    assert!((10.0..16.0 + 96.0).contains(&again), "{again}");
}

/// A drained decode worker hands its running request over: SIGTERM mid-stream of a long prompt
/// (seeded sampling); the request resumes on the other decode worker, which pulls the KV of the
/// prompt and of every streamed token from the draining one (whole blocks from its cache, the
/// partly filled last one parked for the pull): nothing is computed again. Same text, one
/// migration and it a hand-off; the drained worker exits cleanly once it has been pulled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_decode_worker_hands_its_requests_over_with_nothing_computed_again() {
    // The window only bounds a pull that never comes: the worker stops once it is pulled.
    let (mut d1, d1addr, _) = start_decode(&["--handoff-window-s=600"]);
    let (mut d2, d2addr, _) = start_decode(&["--handoff-window-s=600"]);
    let r = start_router(
        &[d1addr.clone(), d2addr.clone()],
        &["--disagg-min-tokens=64"],
    );
    wait_ready(&r, 2).await;
    let body = json!({
        "prompt": "Write a long story about a lighthouse keeper and the sea. ".repeat(12),
        "max_tokens": 96,
        "temperature": 0.8,
        "seed": 7,
        "ignore_eos": true,
        "stream": true,
    });
    let mut exit = None;
    let victim =
        hit_the_busy_worker_mid_stream(&r, [(&mut d1, &d1addr), (&mut d2, &d2addr)], body, |p| {
            p.signal(libc::SIGTERM);
            exit = p.wait_exit(Duration::from_secs(600));
        })
        .await;
    assert!(
        exit.is_some_and(|s| s.success()),
        "the drained worker stops by itself, cleanly: {exit:?}"
    );
    let survivor = if victim == d1addr { &d2addr } else { &d1addr };
    let sm = scrape(survivor).await;
    assert_eq!(metric(&sm, "tandem_resumed_requests_total"), 1.0, "{sm:?}");
    assert_eq!(
        metric(&sm, "tandem_resumed_kv_tokens_total{kv=\"recomputed\"}"),
        0.0,
        "{sm:?}"
    );
    // The prompt (about 150 tokens) and the streamed tokens but the last.
    assert!(metric(&sm, "tandem_resumed_kv_tokens_total{kv=\"found\"}") > 128.0);
    assert!(metric(&sm, "tandem_kv_transfer_bytes_total") > 0.0);
    assert_eq!(
        metric(&scrape(&r.http).await, "tandem_request_handoffs_total"),
        1.0
    );
}

/// A decode worker frozen mid-stream (SIGSTOP) stops its heartbeats: the router leaves it after
/// `--worker-stall-timeout-ms` and the stream goes on elsewhere, exact. A worker that is only
/// slow (a long prompt's prefill, and at TANDEM_TEST_SLOWDOWN every step) keeps sending
/// heartbeats and is never left: exactly one migration. Thawed, the frozen worker frees the
/// abandoned request's blocks. The stall timeout is five heartbeats (a second each): with 1.5 s
/// a worker only slow was once left, its heartbeat late by half a second while the 10x-slow
/// suite's workers shared two cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_decode_worker_is_left_once_its_heartbeats_stop() {
    let (mut d1, d1addr) = start_worker(&[]);
    let (mut d2, d2addr) = start_worker(&[]);
    let r = start_router(
        &[d1addr.clone(), d2addr.clone()],
        &["--worker-stall-timeout-ms=5000"],
    );
    wait_ready(&r, 2).await;
    let body = json!({
        "prompt": "Write a long story about a lighthouse keeper. ".repeat(60),
        "max_tokens": 96,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
    });
    let frozen =
        hit_the_busy_worker_mid_stream(&r, [(&mut d1, &d1addr), (&mut d2, &d2addr)], body, |p| {
            p.signal(libc::SIGSTOP)
        })
        .await;
    let victim = if frozen == d1addr { &d1 } else { &d2 };
    victim.signal(libc::SIGCONT);
    let load = wait_idle(&frozen).await;
    assert_eq!(load.running, 0);
}

/// The prefill worker on one host, the decode worker and the router on another, and the prefill
/// host's link shaped to 8 Mbit/s (tc's token bucket): a 128-token prompt's KV (6 MB) takes
/// about 6 s to cross it, several times what computing it takes, and the decode worker's stall
/// allowance is 2 s. The transfer moves the whole time, so the decode worker waits for it and
/// takes the KV: no failed attempt, no local prefill, and the tokens of a local prefill.
#[test]
fn a_transfer_slower_than_its_prefill_is_waited_for_while_it_moves() {
    let mut net = Net::new();
    let pf = net.host("pf", "10.78.0.2");
    let dc = net.host("dc", "10.78.0.3");
    let tc = std::process::Command::new("ip")
        .args([
            "netns", "exec", &pf, "tc", "qdisc", "add", "dev", "eth0", "root",
        ])
        .args(["tbf", "rate", "8mbit", "burst", "32kbit", "latency", "1s"])
        .output()
        .expect("tc (iproute2)");
    assert!(
        tc.status.success(),
        "{}",
        String::from_utf8_lossy(&tc.stderr)
    );
    let model = format!("--model={}", model_path().display());
    let args = |a: &[&str]| -> Vec<String> { a.iter().map(|s| s.to_string()).collect() };
    let (_p, paddr) = start_in(
        &pf,
        &args(&[
            "prefill",
            "--host=10.78.0.2",
            "--port=0",
            &model,
            "--kv-cache-mb=256",
        ]),
        Ready::PREFILL,
    );
    let paddr = ready_line(&paddr).grpc().to_string();
    let (_d, line) = start_in(
        &dc,
        &args(&[
            "decode",
            "--host=10.78.0.3",
            "--port=0",
            &model,
            "--kv-cache-mb=256",
            "--kv-port=0",
            "--kv-stall-timeout-ms=2000",
        ]),
        Ready::DECODE,
    );
    let daddr = ready_line(&line).grpc().to_string();
    let (router, line) = start_in(
        &dc,
        &args(&[
            "router",
            "--host=127.0.0.1",
            "--http-port=0",
            "--grpc-port=0",
            &model,
            "--poll-ms=100",
            &format!("--decode-workers={daddr}"),
            &format!("--prefill-workers={paddr}"),
            "--disagg-min-tokens=64",
        ]),
        Ready::ROUTER,
    );
    let r = router_at(router, &line);
    let per_block = bytes_per_block();
    block_in(&dc, move || async move {
        wait_ready(&r, 1).await;
        ready_prefill_workers(&r.http, 1).await;
        let prompt = long_prompt(11, 128);
        let started = Instant::now();
        let (ids, usage) = generate_ids(&r.grpc, &prompt, 8).await;
        let took = started.elapsed().as_secs_f64();
        assert_eq!(usage.cached_prompt_tokens, 0);
        let dm = scrape(&daddr).await;
        let moved = metric(&dm, "tandem_kv_transfer_bytes_total");
        assert_eq!(moved as u64, 8 * per_block, "the prompt's 8 blocks crossed");
        assert_eq!(
            metric(&dm, r#"tandem_kv_transfers_total{result="ok"}"#),
            1.0
        );
        assert_eq!(
            metric(&dm, r#"tandem_kv_transfers_total{result="failed"}"#),
            0.0,
            "no attempt was given up on"
        );
        let rm = scrape(&r.http).await;
        assert_eq!(
            metric(&rm, r#"tandem_prefill_requests_total{mode="remote"}"#),
            1.0
        );
        assert_eq!(ids, local_reference(&daddr, &prompt, 8).await);
        // The prefill worker's side: one send, every byte, and time spent waiting for the link.
        let pm = scrape(&paddr).await;
        assert_eq!(metric(&pm, "tandem_kv_transfer_sent_bytes_total"), moved);
        assert_eq!(metric(&pm, "tandem_kv_send_duration_seconds_count"), 1.0);
        let blocked = metric(&pm, "tandem_kv_send_blocked_seconds_total");
        assert!(blocked > 0.0, "{blocked}");
        eprintln!(
            "slow link: {:.1} MB of KV in {took:.1} s ({:.2} MB/s), the request's whole time; the prefill worker waited {blocked:.1} s for the link",
            moved / 1e6,
            moved / 1e6 / took
        );
        wait_idle(&daddr).await;
    });
}

/// A decode request's priority band reaches its prefill worker: of two prompts queued there
/// behind a long one, the higher band's is computed first (though it came second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_higher_band_is_prefilled_first_on_the_prefill_worker() {
    // 32-token steps: the long prompt holds every step's budget, so the others wait in its queue.
    let (_p, paddr) = start_prefill(&["--max-batched-tokens=32", "--max-queue-wait-ms=600000"]);
    let (_d, daddr, _kv) = start_decode(&[]);
    let send = |id: &str, prompt: Vec<u32>, priority: i32| {
        let (daddr, paddr, id) = (daddr.clone(), paddr.clone(), id.to_string());
        tokio::spawn(async move {
            let mut c = wpb::decode_client::DecodeClient::connect(format!("http://{daddr}"))
                .await
                .unwrap();
            let req = wpb::DecodeRequest {
                request_id: id,
                prompt_ids: prompt,
                sampling: Some(wpb::Sampling::default()),
                stopping: Some(wpb::Stopping {
                    max_tokens: 1,
                    ignore_eos: true,
                    ..Default::default()
                }),
                prefill: Some(wpb::PrefillPlan {
                    plan: Some(wpb::prefill_plan::Plan::Remote(wpb::RemotePrefill {
                        prefill_addrs: vec![paddr],
                    })),
                }),
                priority,
                ..Default::default()
            };
            let mut s = c.generate(authed(req)).await.unwrap().into_inner();
            while s.message().await.unwrap().is_some() {}
            Instant::now()
        })
    };
    let until = |what: &'static str, key: &'static str, want: f64| {
        let paddr = paddr.clone();
        async move {
            let end = Instant::now() + Duration::from_secs(120);
            loop {
                let got = metric(&scrape(&paddr).await, key);
                if got == want {
                    return;
                }
                assert!(Instant::now() < end, "{what}: {key} {got}");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    let a = send("a", long_prompt(1, 4000), 0);
    until("the long prompt runs", "tandem_num_requests_running", 1.0).await;
    let b = send("b", long_prompt(2, 200), 0);
    until("the low band waits", "tandem_num_requests_waiting", 1.0).await;
    let c = send("c", long_prompt(3, 200), 5);
    until("both wait", "tandem_num_requests_waiting", 2.0).await;
    let (_, tb, tc) = (a.await.unwrap(), b.await.unwrap(), c.await.unwrap());
    assert!(tc < tb, "the higher band came second and was served first");
    wait_idle(&daddr).await;
}

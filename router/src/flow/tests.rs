//! The queue's rules, on tokio's paused clock: quotas and their waits, priority bands,
//! fairness in tokens within a band, concurrency limits, the wait limit, callers that leave,
//! and a reload's new limits.

use super::*;

fn spec(name: &str, priority: i32) -> TenantSpec {
    TenantSpec {
        name: name.into(),
        keys: vec![format!("key-{name}")],
        priority,
        weight: 1.0,
        requests_per_minute: None,
        tokens_per_minute: None,
        max_concurrent: None,
        max_queue_wait_ms: None,
    }
}

fn flow(per_worker: Option<usize>, tenants: Vec<TenantSpec>) -> Arc<Flow> {
    let f = Flow::new(
        FlowConfig {
            per_worker,
            max_wait: None,
            replicas: 1,
        },
        || 1,
        Arc::new(RouterMetrics::default()),
    );
    f.configure(&TenantTable::new(tenants).unwrap());
    f
}

/// Starts a request of `tenant` that records its name in `order` when its turn comes and then
/// holds its permit until `hold` is told to let go.
fn start(
    f: &Arc<Flow>,
    tenant: &str,
    prompt: u64,
    order: &Arc<Mutex<Vec<String>>>,
) -> (
    tokio::task::JoinHandle<Result<(), ApiError>>,
    oneshot::Sender<u64>,
) {
    let (hold, held) = oneshot::channel::<u64>();
    let (f, order, name) = (f.clone(), order.clone(), tenant.to_string());
    let h = tokio::spawn(async move {
        let mut p = f.admit(&Caller::tenant(&name), 1, prompt).await?;
        order.lock().unwrap().push(name);
        p.finish(held.await.unwrap_or(0));
        Ok(())
    });
    (h, hold)
}

/// Lets the spawned tasks run until they wait on something.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_quota_refuses_with_the_wait_its_bucket_needs_and_then_admits() {
    let mut a = spec("a", 0);
    a.requests_per_minute = Some(2);
    let f = flow(None, vec![a]);
    let caller = Caller::tenant("a");
    let p1 = f.admit(&caller, 1, 10).await.unwrap();
    let p2 = f.admit(&caller, 1, 10).await.unwrap();
    let Err(ApiError::OverQuota {
        limit, retry_after, ..
    }) = f.admit(&caller, 1, 10).await
    else {
        panic!("a third request in the minute must be over quota");
    };
    assert_eq!(limit, "requests_per_minute");
    // One request of a 2-a-minute bucket takes 30 s to come back.
    assert_eq!(retry_after, Duration::from_secs(30));
    drop((p1, p2));
    tokio::time::advance(Duration::from_secs(29)).await;
    assert!(f.admit(&caller, 1, 10).await.is_err(), "not yet");
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(
        f.admit(&caller, 1, 10).await.is_ok(),
        "the wait it was told"
    );
}

/// One of three routers sharing a tenant's limits enforces a third of its rates and of its
/// concurrency rounded up.
#[tokio::test(start_paused = true)]
async fn a_router_of_several_enforces_its_share_of_a_tenant_s_limits() {
    let mut a = spec("a", 0);
    a.requests_per_minute = Some(6);
    a.tokens_per_minute = Some(3000);
    a.max_concurrent = Some(4);
    let f = Flow::new(
        FlowConfig {
            replicas: 3,
            ..Default::default()
        },
        || 1,
        Arc::new(RouterMetrics::default()),
    );
    f.configure(&TenantTable::new(vec![a]).unwrap());
    let caller = Caller::tenant("a");
    // A third of 6 a minute: 2 now, and the next one a bucket of 2 a minute's 30 s away.
    let p1 = f.admit(&caller, 1, 10).await.unwrap();
    let p2 = f.admit(&caller, 1, 10).await.unwrap();
    let Err(ApiError::OverQuota {
        limit, retry_after, ..
    }) = f.admit(&caller, 1, 10).await
    else {
        panic!("a third request in the minute must be over this router's share");
    };
    assert_eq!(limit, "requests_per_minute");
    assert_eq!(retry_after, Duration::from_secs(30));
    drop((p1, p2));
    // A third of 3000 tokens a minute: after 600, a 500-token prompt is over it (a router
    // holding the whole 3000 would take it).
    tokio::time::advance(Duration::from_secs(60)).await;
    let big = f.admit(&caller, 1, 600).await.unwrap();
    let Err(ApiError::OverQuota { limit, .. }) = f.admit(&caller, 1, 500).await else {
        panic!("1100 tokens are over a 1000-token share");
    };
    assert_eq!(limit, "tokens_per_minute");
    drop(big);
    // Concurrency: 4 over 3, rounded up: 2 run, a third waits.
    let mut b = spec("b", 0);
    b.max_concurrent = Some(4);
    let f = Flow::new(
        FlowConfig {
            replicas: 3,
            ..Default::default()
        },
        || 1,
        Arc::new(RouterMetrics::default()),
    );
    f.configure(&TenantTable::new(vec![b]).unwrap());
    let caller = Caller::tenant("b");
    let _p = f.admit(&caller, 1, 10).await.unwrap();
    let _q = f.admit(&caller, 1, 10).await.unwrap();
    let third = tokio::spawn({
        let f = f.clone();
        async move { f.admit(&Caller::tenant("b"), 1, 10).await.map(|_| ()) }
    });
    settle().await;
    assert!(!third.is_finished(), "a third concurrent request must wait");
    third.abort();
}

#[tokio::test(start_paused = true)]
async fn a_token_quota_counts_prompts_at_dispatch_and_outputs_at_the_finish() {
    let mut a = spec("a", 0);
    a.tokens_per_minute = Some(600);
    let f = flow(None, vec![a]);
    let caller = Caller::tenant("a");
    let mut p = f.admit(&caller, 1, 200).await.unwrap();
    p.finish(300);
    drop(p);
    // 600 - 200 - 300 = 100 left: a prompt of 150 waits for 50 tokens, 5 s at 10 a second.
    let Err(ApiError::OverQuota {
        limit, retry_after, ..
    }) = f.admit(&caller, 1, 150).await
    else {
        panic!("over the token quota");
    };
    assert_eq!(
        (limit, retry_after),
        ("tokens_per_minute", Duration::from_secs(5))
    );
    // A prompt larger than the whole bucket is let in when the bucket is full.
    tokio::time::advance(Duration::from_secs(60)).await;
    assert!(f.admit(&caller, 1, 5000).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_higher_band_overtakes_a_full_queue_of_a_lower_one() {
    let f = flow(Some(1), vec![spec("low", 0), spec("high", 5)]);
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut holds = Vec::new();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (h, hold) = start(&f, "low", 10, &order);
        tasks.push(h);
        holds.push(hold);
        settle().await;
    }
    assert_eq!((f.dispatched(), f.waiting()), (1, 3));
    let (h, hold) = start(&f, "high", 10, &order);
    tasks.push(h);
    settle().await;
    assert_eq!(f.waiting(), 4);
    // The running one finishes: the high band's request goes next, then the low ones in turn.
    for hold in holds.into_iter().chain([hold]) {
        hold.send(0).unwrap();
        settle().await;
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(*order.lock().unwrap(), ["low", "high", "low", "low", "low"]);
    assert_eq!((f.dispatched(), f.waiting()), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn within_a_band_the_tenant_served_fewer_tokens_goes_first() {
    let f = flow(Some(1), vec![spec("flood", 0), spec("quiet", 0)]);
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut holds = VecDeque::new();
    let mut tasks = Vec::new();
    // The flooder's first request runs and three more of its wait, each 1000 tokens.
    for _ in 0..4 {
        let (h, hold) = start(&f, "flood", 1000, &order);
        tasks.push(h);
        holds.push_back(hold);
        settle().await;
    }
    // The quiet tenant's two small requests arrive behind them.
    for _ in 0..2 {
        let (h, hold) = start(&f, "quiet", 10, &order);
        tasks.push(h);
        holds.push_back(hold);
        settle().await;
    }
    // Finish whatever runs, in the order it was dispatched.
    let mut done = 0;
    while done < 6 {
        let running = order.lock().unwrap().len();
        assert_eq!(running, done + 1, "one at a time");
        // The hold of the request that runs: the order of dispatch maps to the holds by tenant.
        let who = order.lock().unwrap()[done].clone();
        let i = if who == "flood" {
            order.lock().unwrap()[..done]
                .iter()
                .filter(|t| *t == "flood")
                .count()
        } else {
            4 + order.lock().unwrap()[..done]
                .iter()
                .filter(|t| *t == "quiet")
                .count()
        };
        let hold = std::mem::replace(&mut holds[i], oneshot::channel().0);
        hold.send(if who == "flood" { 500 } else { 10 }).unwrap();
        settle().await;
        done += 1;
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    // Though the flooder's requests came first, the quiet tenant's go as soon as the first
    // finishes. The quiet tenant starts at the flooder's counter as it was when it began to
    // wait (1000: no credit for time idle), then is charged 20 a request against the
    // flooder's 1500.
    assert_eq!(
        *order.lock().unwrap(),
        ["flood", "quiet", "quiet", "flood", "flood", "flood"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_tenant_at_its_concurrency_limit_waits_while_others_go() {
    let mut a = spec("a", 0);
    a.max_concurrent = Some(1);
    let f = flow(None, vec![a, spec("b", 0)]);
    let order = Arc::new(Mutex::new(Vec::new()));
    let (t1, h1) = start(&f, "a", 10, &order);
    settle().await;
    let (t2, h2) = start(&f, "a", 10, &order);
    settle().await;
    let (t3, h3) = start(&f, "b", 10, &order);
    settle().await;
    assert_eq!(*order.lock().unwrap(), ["a", "b"]);
    assert_eq!(f.waiting(), 1);
    h1.send(0).unwrap();
    settle().await;
    assert_eq!(*order.lock().unwrap(), ["a", "b", "a"]);
    h2.send(0).unwrap();
    h3.send(0).unwrap();
    for t in [t1, t2, t3] {
        t.await.unwrap().unwrap();
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_past_its_wait_limit_is_refused_before_any_work_and_its_quota_given_back() {
    let mut a = spec("a", 0);
    a.max_queue_wait_ms = Some(2000);
    a.requests_per_minute = Some(2);
    let f = flow(Some(1), vec![a]);
    let caller = Caller::tenant("a");
    let running = f.admit(&caller, 1, 10).await.unwrap();
    let started = Instant::now();
    let Err(ApiError::QueueTimeout { waited, .. }) = f.admit(&caller, 1, 10).await else {
        panic!("it must time out waiting");
    };
    assert_eq!(waited, Duration::from_secs(2));
    assert_eq!(started.elapsed(), Duration::from_secs(2));
    assert_eq!((f.dispatched(), f.waiting()), (1, 0));
    drop(running);
    // The refused request's quota came back: a second one fits the minute.
    assert!(f.admit(&caller, 1, 10).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_leaves_while_waiting_leaves_no_trace() {
    let f = flow(Some(1), vec![spec("a", 0)]);
    let caller = Caller::tenant("a");
    let running = f.admit(&caller, 1, 10).await.unwrap();
    let waiting = {
        let f = f.clone();
        let caller = caller.clone();
        tokio::spawn(async move { f.admit(&caller, 1, 10).await.map(|_| ()) })
    };
    settle().await;
    assert_eq!(f.waiting(), 1);
    waiting.abort();
    settle().await;
    assert_eq!((f.dispatched(), f.waiting()), (1, 0));
    drop(running);
    assert_eq!(f.dispatched(), 0);
    let p = f.admit(&caller, 1, 10).await.unwrap();
    assert_eq!(f.dispatched(), 1);
    drop(p);
}

#[tokio::test(start_paused = true)]
async fn a_reload_changes_a_quota_live_and_a_removed_tenant_is_refused() {
    let mut a = spec("a", 0);
    a.requests_per_minute = Some(1);
    let f = flow(None, vec![a.clone(), spec("b", 0)]);
    let caller = Caller::tenant("a");
    f.admit(&caller, 1, 1).await.unwrap();
    assert!(matches!(
        f.admit(&caller, 1, 1).await,
        Err(ApiError::OverQuota { .. })
    ));
    a.requests_per_minute = Some(100);
    f.configure(&TenantTable::new(vec![a]).unwrap());
    // The raised quota is there at once.
    for _ in 0..50 {
        f.admit(&caller, 1, 1).await.unwrap();
    }
    assert!(matches!(
        f.admit(&Caller::tenant("b"), 1, 1).await,
        Err(ApiError::Unauthorized(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn without_tenants_every_caller_shares_one_unlimited_queue() {
    let f = Flow::new(
        FlowConfig {
            per_worker: Some(2),
            max_wait: Some(Duration::from_secs(1)),
            replicas: 1,
        },
        || 1,
        Arc::new(RouterMetrics::default()),
    );
    let anyone = Caller::default();
    let a = f.admit(&anyone, 1, 10).await.unwrap();
    let b = f.admit(&anyone, 1, 10).await.unwrap();
    assert!(matches!(
        f.admit(&anyone, 1, 10).await,
        Err(ApiError::QueueTimeout { .. })
    ));
    drop(a);
    let c = f.admit(&anyone, 1, 10).await.unwrap();
    assert_eq!(f.dispatched(), 2);
    drop((b, c));
    // A request of more samples than the whole room still runs, alone.
    let big = f.admit(&anyone, 5, 10).await.unwrap();
    assert_eq!(f.dispatched(), 5);
    drop(big);
}

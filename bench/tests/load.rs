//! The load generator against a scripted OpenAI-compatible server on loopback: what it counts,
//! how it fails requests (errors, streams closed early, stalls), goodput, constant-rate
//! accuracy, distributed load through two agents against one process, a lost agent, and the
//! HTML report rendered by headless Chromium.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Json;
use serde_json::{json, Value};
use tandem_bench::load::dataset::{Dataset, DatasetSpec, LenDist, Prompt};
use tandem_bench::load::measure::Slo;
use tandem_bench::load::run::{run, HttpTarget, Plan, Progress, Share, Target, Watch};
use tandem_bench::load::schedule::{Arrival, Shape, StopAfter};
use tandem_bench::load::{agent, execute, report, Bench, RunResult};

/// The server's script, by prompt length: 1 → HTTP 503; 2 → the stream closes before its
/// end; 3 → one token, then silence; 4 → the first token after 1.5 s; longer → at once. Every
/// token is one SSE chunk, 2 ms apart, and the usage chunk counts them.
async fn completions(Json(body): Json<Value>) -> Response {
    let len = body["prompt"].as_array().map_or(0, |a| a.len());
    let n = body["max_tokens"].as_u64().unwrap_or(1) as usize;
    if len == 1 {
        return (axum::http::StatusCode::SERVICE_UNAVAILABLE, "busy").into_response();
    }
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(scripted(len, n)))
        .unwrap()
}

fn scripted(len: usize, n: usize) -> impl futures::Stream<Item = Result<Bytes, Infallible>> {
    futures::stream::unfold(0usize, move |i| async move {
        let chunk = |v: Value| Bytes::from(format!("data: {v}\n\n"));
        if i == 0 && len == 4 {
            tokio::time::sleep(Duration::from_millis(1500)).await;
        } else if i > 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        if len == 3 && i == 1 {
            std::future::pending::<()>().await;
        }
        if len == 2 && i == n / 2 {
            return None;
        }
        match i.cmp(&n) {
            std::cmp::Ordering::Less => Some((
                Ok(chunk(json!({"choices": [{"index": 0, "text": "x"}]}))),
                i + 1,
            )),
            std::cmp::Ordering::Equal => Some((
                Ok(chunk(
                    json!({"choices": [], "usage": {"prompt_tokens": len, "completion_tokens": n}}),
                )),
                i + 1,
            )),
            _ if i == n + 1 => Some((Ok(Bytes::from("data: [DONE]\n\n")), i + 1)),
            _ => None,
        }
    })
}

async fn serve(app: axum::Router) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    addr
}

async fn fake_server() -> String {
    let app = axum::Router::new().route("/v1/completions", post(completions));
    format!("http://{}", serve(app).await)
}

fn dataset(input: LenDist, output: usize) -> Dataset {
    let spec = DatasetSpec::Random {
        input,
        output: LenDist::Fixed(output),
        long_every: 0,
        long_input: 0,
        long_output: 0,
    };
    Dataset::new(spec, 5, 1000, None).unwrap()
}

fn prompt_len(d: &Dataset, i: usize) -> usize {
    match &d.session(i).turns[0].prompt {
        Prompt::Tokens(t) => t.len(),
        p => panic!("{p:?}"),
    }
}

fn plan(shape: Shape, requests: usize) -> Plan {
    Plan {
        shape,
        bound: StopAfter {
            requests: Some(requests),
            duration: None,
        },
        warmup: 0,
        seed: 1,
        stall: Duration::from_secs(1),
        times: None,
    }
}

async fn run_once(target: &Target, d: &Dataset, p: &Plan) -> tandem_bench::load::run::RunOutput {
    let progress = Arc::new(Progress::default());
    run(target, d, p, Share::ALL, &Watch::default(), progress).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_by_kind_and_goodput_follows_the_targets() {
    let base = fake_server().await;
    let d = dataset(LenDist::Uniform(1, 6), 6);
    let n = 40;
    // Stalls are cut after 3 s of silence: past the slow first tokens' 1.5 s.
    let p = Plan {
        stall: Duration::from_secs(3),
        ..plan(Shape::Closed { concurrency: 8 }, n)
    };
    let target = Target::Http(HttpTarget::new(&base, "m", 8));
    let out = run_once(&target, &d, &p).await;
    let lens: Vec<usize> = (0..n).map(|i| prompt_len(&d, i)).collect();
    let count = |f: &dyn Fn(usize) -> bool| lens.iter().filter(|&&l| f(l)).count();
    let slo: Slo = "ttft=1000".parse().unwrap();
    let s = out.measured.summary(&slo);
    assert_eq!(s.requests, n);
    let by = |k: &str| s.errors_by_status.get(k).copied().unwrap_or(0);
    assert_eq!(by("503"), count(&|l| l == 1));
    assert_eq!(by("truncated"), count(&|l| l == 2));
    assert_eq!(by("stall"), count(&|l| l == 3));
    assert_eq!(s.ok, count(&|l| l >= 4));
    assert!(
        count(&|l| l == 4) > 0 && count(&|l| l == 3) > 0,
        "every case drawn"
    );
    assert_eq!(s.output_tokens, 6 * s.ok);
    assert_eq!(
        s.input_tokens,
        lens.iter().filter(|&&l| l >= 4).sum::<usize>()
    );
    // The slow first tokens (1.5 s) miss the 1 s target, the others meet it.
    assert_eq!(s.slo_met, Some(count(&|l| l >= 5)));
    assert!(s.ttft.max >= 1500.0, "{:?}", s.ttft);
    for r in &out.measured.records {
        assert_eq!(r.prompt_tokens >= 4, r.ok(), "{r:?}");
        if r.ok() {
            // 5 gaps of at least 2 ms each.
            assert!(r.e2e_ms >= r.ttft_ms.unwrap() + 10.0, "{r:?}");
        }
    }
    assert_eq!(s.itl.count, 5 * s.ok);
    assert!(s.itl.p50 >= 2.0, "{:?}", s.itl);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constant_rate_is_kept() {
    let base = fake_server().await;
    let d = dataset(LenDist::Fixed(8), 1);
    // 500 requests a second from one process, kept to 2%.
    let rate = 500.0;
    let shape = Shape::Open {
        rate,
        arrival: Arrival::Constant,
        ramp: None,
        max_in_flight: None,
    };
    let target = Target::Http(HttpTarget::new(&base, "m", 64));
    let out = run_once(&target, &d, &plan(shape, 1000)).await;
    // The rate is the inverse of the least-squares slope of send time against request number,
    // over the sends' due times (each send's time less its lag behind its schedule): 2% where
    // it is the schedule's own pace, whatever the machine's stalls; the sends themselves,
    // which a stall holds up and which then catch up, within a tenfold looser bound.
    let pace = |mut times: Vec<f64>| {
        times.sort_by(f64::total_cmp);
        let n = times.len() as f64;
        let (mx, my) = ((n - 1.0) / 2.0, times.iter().sum::<f64>() / n);
        let (mut sxy, mut sxx) = (0.0, 0.0);
        for (i, t) in times.iter().enumerate() {
            sxy += (i as f64 - mx) * (t - my);
            sxx += (i as f64 - mx).powi(2);
        }
        sxx / sxy
    };
    let records = &out.measured.records;
    let due = pace(records.iter().map(|r| r.sent_s - r.lag_ms / 1e3).collect());
    assert!((due / rate - 1.0).abs() < 0.02, "due at {due}/s for {rate}");
    let sent = pace(records.iter().map(|r| r.sent_s).collect());
    assert!(
        (sent / rate - 1.0).abs() < 0.2,
        "sent at {sent}/s for {rate}"
    );
    eprintln!("{sent} requests/s sent, {due} due, for {rate}");
    let s = out.measured.summary(&Slo::default());
    assert_eq!(s.ok, 1000);
    eprintln!("schedule lag at {rate}/s: {:?}", s.schedule_lag);
}

fn bench(d: Dataset, p: Plan, agents: Vec<String>) -> Bench {
    Bench {
        dataset: d,
        plan: p,
        slo: "ttft=1000".parse().unwrap(),
        sweep: None,
        rounds: 1,
        agents,
        metrics: vec![],
        progress: false,
        agent_silence: Duration::from_secs(3),
    }
}

async fn start_agent() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(agent::serve(l, None, std::future::pending()));
    addr.to_string()
}

fn outcomes(r: &RunResult) -> Vec<(usize, String, usize, usize)> {
    r.output
        .measured
        .records
        .iter()
        .map(|x| {
            (
                x.session,
                x.status.clone(),
                x.prompt_tokens,
                x.output_tokens,
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_agents_add_up_to_one_process_and_a_lost_agent_is_reported() {
    let base = fake_server().await;
    let d = dataset(LenDist::Uniform(1, 6), 4);
    let shape = Shape::Open {
        rate: 40.0,
        arrival: Arrival::Poisson,
        ramp: None,
        max_in_flight: None,
    };
    let p = plan(shape, 30);
    let target = Target::Http(HttpTarget::new(&base, "m", 64));
    let alone = bench(d.clone(), p.clone(), vec![]);
    let one = execute(&alone, std::slice::from_ref(&target), "one".into()).await;
    let agents = vec![start_agent().await, start_agent().await];
    let spread = bench(d.clone(), p.clone(), agents.clone());
    let two = execute(&spread, std::slice::from_ref(&target), "two".into()).await;
    let (a, b) = (&one.runs[0], &two.runs[0]);
    assert!(b.lost_agents.is_empty(), "{:?}", b.lost_agents);
    assert_eq!(
        outcomes(a),
        outcomes(b),
        "the same requests, the same outcomes"
    );
    let (s, t) = (&a.summary, &b.summary);
    assert_eq!(
        (s.requests, s.ok, s.output_tokens, s.slo_met),
        (t.requests, t.ok, t.output_tokens, t.slo_met)
    );
    assert_eq!(s.errors_by_status, t.errors_by_status);
    assert_eq!(
        s.itl.count, t.itl.count,
        "every gap in the merged histogram"
    );

    // An agent that goes silent after its first line is lost, and said to be.
    let silent = axum::Router::new().route(
        "/run",
        post(|| async {
            let lines = futures::stream::unfold(0, |i| async move {
                if i > 0 {
                    std::future::pending::<()>().await;
                }
                let line = Bytes::from("{\"progress\":{\"done\":0}}\n");
                Some((Ok::<_, Infallible>(line), i + 1))
            });
            Body::from_stream(lines)
        }),
    );
    let dead = serve(silent).await.to_string();
    let mixed = bench(d, p, vec![agents[0].clone(), dead.clone()]);
    let r = execute(&mixed, &[target], "lost".into()).await;
    let lost = &r.runs[0].lost_agents;
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert!(
        lost[0].contains(&dead) && lost[0].contains("silent"),
        "{lost:?}"
    );
    // The live agent's half is there.
    assert_eq!(r.runs[0].summary.requests, 15);
    assert!(report::text(&r).contains("LOST"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_html_report_renders_in_a_browser() {
    let base = fake_server().await;
    let d = dataset(LenDist::Uniform(4, 40), 8);
    let p = plan(Shape::Closed { concurrency: 4 }, 24);
    let target = Target::Http(HttpTarget::new(&base, "m", 8));
    let r = execute(&bench(d, p, vec![]), &[target], "report".into()).await;
    let html = report::html(&r).unwrap();
    assert!(html.matches("<svg").count() >= 5, "one plot per measure");
    let csv = report::csv(&r);
    assert_eq!(csv.lines().count(), 2, "{csv}");
    assert_eq!(report::requests_jsonl(&r).lines().count(), 24);
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("report.html");
    std::fs::write(&page, &html).unwrap();
    let shot = dir.path().join("shot.png");
    let browser = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|b| {
            std::process::Command::new(b)
                .arg("--version")
                .output()
                .is_ok()
        })
        .expect("headless Chromium (scripts/test installs Debian's chromium)");
    let out = std::process::Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1000,1400",
            &format!("--screenshot={}", shot.display()),
            &format!("file://{}", page.display()),
        ])
        .output()
        .unwrap();
    assert!(
        shot.exists(),
        "no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = std::io::BufReader::new(std::fs::File::open(&shot).unwrap());
    let mut reader = png::Decoder::new(file).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let px = info.color_type.samples();
    let pixels: Vec<&[u8]> = buf[..info.buffer_size()].chunks(px).collect();
    let inked = pixels
        .iter()
        .filter(|p| p[..3].iter().any(|&c| c < 200))
        .count();
    // The first series' red (#E6194B) is drawn: the plots rendered, not only the page.
    let red = pixels
        .iter()
        .filter(|p| p[0] > 200 && p[1] < 60 && (50..110).contains(&p[2]))
        .count();
    assert!(
        inked * 50 > pixels.len(),
        "{inked} of {} pixels inked",
        pixels.len()
    );
    assert!(red > 200, "{red} pixels of the series colour");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_servers_side_by_side_give_the_first_over_each_other() {
    let d = dataset(LenDist::Uniform(5, 12), 4);
    let p = plan(Shape::Closed { concurrency: 4 }, 12);
    let mut targets = Vec::new();
    for name in ["tandem", "peer-a", "peer-b"] {
        let base = fake_server().await;
        targets.push(Target::Http(
            HttpTarget::new(&base, "m", 8).labelled(Some(name)),
        ));
    }
    let mut b = bench(d, p, vec![]);
    b.rounds = 2;
    let r = execute(&b, &targets, "three".into()).await;
    assert_eq!(r.targets.len(), 3);
    assert!(
        r.targets[1].starts_with("peer-a (http://"),
        "{:?}",
        r.targets
    );
    // Every target in every round, the same requests to each.
    assert_eq!(r.runs.len(), 6);
    for round in 0..2 {
        let of = |k: usize| {
            r.runs
                .iter()
                .find(|x| x.round == round && x.target_index == k)
                .unwrap_or_else(|| panic!("target {k} round {round}"))
        };
        let first = of(0);
        assert_eq!(first.summary.ok, 12);
        for k in 1..3 {
            let other = of(k);
            assert_eq!(outcomes(first), outcomes(other));
            let q = r
                .ratios
                .iter()
                .find(|q| q.round == round && q.against == k)
                .unwrap_or_else(|| panic!("ratio against {k} round {round}"));
            let (s, t) = (&first.summary, &other.summary);
            assert_eq!(q.output_tok_s, s.output_tok_s / t.output_tok_s);
            assert_eq!(q.ttft_p50, s.ttft.p50 / t.ttft.p50);
            assert_eq!(q.itl_p99, s.itl.p99 / t.itl.p99);
            let g = s.goodput_request_s.unwrap() / t.goodput_request_s.unwrap();
            assert_eq!(q.goodput.map(f64::to_bits), Some(g.to_bits()));
        }
    }
    assert_eq!(r.ratios.len(), 4, "two others, two rounds");
    let text = report::text(&r);
    assert!(text.contains("tandem (http://"), "{text}");
    assert_eq!(text.matches(" / peer-b (").count(), 2, "{text}");
    assert!(text.contains("goodput "), "{text}");
}

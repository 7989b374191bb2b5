//! A benchmark's outputs besides its JSON line: a text table, CSV (one row per run), every
//! request's record as JSON lines, and one self-contained HTML file with the plots (SVG drawn by
//! plotters, inline: it opens without a network).

use std::fmt::Write as _;

use plotters::prelude::*;

use super::measure::{Dist, Summary};
use super::{Ratio, Report, RunResult};

/// The text table a terminal shows.
pub fn text(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", r.description);
    let _ = writeln!(out, "load generator: {}", r.client_cpu);
    for run in &r.runs {
        let s = &run.summary;
        let point = run.point.map_or(String::new(), |p| format!(" @ {p}"));
        let _ = writeln!(
            out,
            "{}{point} round {}: {} req ({} failed)  {:.1} out tok/s  {:.1} decode tok/s a stream  {:.2} req/s{}  ttft p50/p99 {:.1}/{:.1} ms  itl p50/p99 {:.1}/{:.1} ms  tpot p50 {:.1} ms  e2e p50/p99 {:.0}/{:.0} ms",
            run.target,
            run.round + 1,
            s.requests,
            s.errors,
            s.output_tok_s,
            s.decode_tok_s,
            s.request_s,
            s.goodput_request_s.map_or(String::new(), |g| format!(" (goodput {g:.2})")),
            s.ttft.p50,
            s.ttft.p99,
            s.itl.p50,
            s.itl.p99,
            s.tpot.p50,
            s.e2e.p50,
            s.e2e.p99,
        );
        if let Some(m) = &s.mixed {
            let _ = writeln!(
                out,
                "  short requests' itl p50/p99/max {:.1}/{:.1}/{:.1} ms  long prompts' ttft p50/p99 {:.1}/{:.1} ms",
                m.short_itl.p50, m.short_itl.p99, m.short_itl.max, m.long_ttft.p50, m.long_ttft.p99
            );
        }
        if !s.errors_by_status.is_empty() {
            let _ = writeln!(out, "  errors by status: {:?}", s.errors_by_status);
        }
        if let Some(e) = &s.first_error {
            let _ = writeln!(out, "  first error: {e}");
        }
        if let Some(d) = &run.server {
            let _ = writeln!(
                out,
                "  server: prefix-cache hit rate {}  prefills remote {} local {} (fallbacks {})  KV bytes moved {}  migrations {}  preemptions {}  mean queue {}{}",
                d.prefix_cache_hit_rate.map_or("-".into(), |h| format!("{:.1}%", h * 100.0)),
                d.remote_prefills,
                d.local_prefills,
                d.local_fallbacks,
                d.kv_bytes_moved,
                d.migrations,
                d.preemptions,
                d.mean_queue_ms.map_or("-".into(), |q| format!("{q:.1} ms")),
                if d.unreachable.is_empty() { String::new() } else { format!("  (unreachable: {})", d.unreachable.join(", ")) }
            );
        }
        for l in &run.lost_agents {
            let _ = writeln!(out, "  LOST {l}");
        }
    }
    for q in &r.ratios {
        let _ = writeln!(
            out,
            "{}{} round {}: output tok/s {:.3}x  decode tok/s {:.3}x  ttft p50 {:.3}x p99 {:.3}x  itl p50 {:.3}x p99 {:.3}x{}",
            ratio_name(r, q),
            q.point.map_or(String::new(), |p| format!(" @ {p}")),
            q.round + 1,
            q.output_tok_s,
            q.decode_tok_s,
            q.ttft_p50,
            q.ttft_p99,
            q.itl_p50,
            q.itl_p99,
            q.goodput.map_or(String::new(), |g| format!("  goodput {g:.3}x"))
        );
    }
    if let Some(s) = &r.sweep_stopped {
        let _ = writeln!(out, "sweep stopped: {s}");
    }
    out
}

/// "first / NAME": whom a ratio divides by.
fn ratio_name(r: &Report, q: &Ratio) -> String {
    let name = |k: usize| r.targets.get(k).map_or("?", String::as_str);
    format!("{} / {}", name(0), name(q.against))
}

fn dist_cells(d: &Dist) -> String {
    format!(
        "{:.3},{:.3},{:.3},{:.3},{:.3},{:.3}",
        d.mean, d.p50, d.p90, d.p95, d.p99, d.max
    )
}

/// One CSV row per run.
pub fn csv(r: &Report) -> String {
    let mut out = String::from("target,point,round,requests,ok,errors,output_tokens,output_tok_s,decode_tok_s,total_tok_s,request_s,goodput_request_s,wall_s");
    for m in ["ttft", "itl", "tpot", "e2e"] {
        for q in ["mean", "p50", "p90", "p95", "p99", "max"] {
            let _ = write!(out, ",{m}_ms_{q}");
        }
    }
    out.push('\n');
    for run in &r.runs {
        let s: &Summary = &run.summary;
        let _ = writeln!(
            out,
            "{},{},{},{},{},{},{},{:.3},{:.3},{:.3},{:.4},{},{:.3},{},{},{},{}",
            run.target.replace(',', ";"),
            run.point.map_or(String::new(), |p| p.to_string()),
            run.round + 1,
            s.requests,
            s.ok,
            s.errors,
            s.output_tokens,
            s.output_tok_s,
            s.decode_tok_s,
            s.total_tok_s,
            s.request_s,
            s.goodput_request_s
                .map_or(String::new(), |g| format!("{g:.4}")),
            s.wall_s,
            dist_cells(&s.ttft),
            dist_cells(&s.itl),
            dist_cells(&s.tpot),
            dist_cells(&s.e2e),
        );
    }
    out
}

/// Every request of every run, one JSON object a line.
pub fn requests_jsonl(r: &Report) -> String {
    let mut out = String::new();
    for run in &r.runs {
        for rec in &run.output.measured.records {
            let mut v = serde_json::to_value(rec).unwrap_or_default();
            v["target"] = run.target.clone().into();
            v["point"] = run.point.into();
            v["round"] = (run.round + 1).into();
            let _ = writeln!(out, "{v}");
        }
    }
    out
}

fn run_name(r: &RunResult, many_rounds: bool) -> String {
    let mut n = r.target.clone();
    if let Some(p) = r.point {
        let _ = write!(n, " @ {p}");
    }
    if many_rounds {
        let _ = write!(n, " r{}", r.round + 1);
    }
    n
}

type Plot = Result<String, String>;

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("{e:?}")
}

/// Line plots of several (name, points) series.
fn lines(title: &str, x: &str, y: &str, series: &[(String, Vec<(f64, f64)>)]) -> Plot {
    plot(title, (x, y), series, false)
}

/// Scatter plot of several (name, points) series.
fn scatter(title: &str, x: &str, y: &str, series: &[(String, Vec<(f64, f64)>)]) -> Plot {
    plot(title, (x, y), series, true)
}

/// One SVG chart from zero to the largest values: each series a line, or dots when `dots`.
fn plot(
    title: &str,
    (x, y): (&str, &str),
    series: &[(String, Vec<(f64, f64)>)],
    dots: bool,
) -> Plot {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 420)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (mut x1, mut y1) = (0f64, 0f64);
        for &(a, b) in series.iter().flat_map(|(_, p)| p.iter()) {
            x1 = x1.max(a);
            y1 = y1.max(b);
        }
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..(x1 * 1.05).max(1e-6), 0f64..(y1 * 1.05).max(1e-6))
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(x)
            .y_desc(y)
            .draw()
            .map_err(err)?;
        for (i, (name, pts)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            if dots {
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))
                    .map_err(err)?
                    .label(name.clone())
                    .legend(move |(x, y)| Circle::new((x + 10, y), 3, color.filled()));
            } else {
                chart
                    .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
                    .map_err(err)?
                    .label(name.clone())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                    });
            }
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(if dots {
                SeriesLabelPosition::UpperLeft
            } else {
                SeriesLabelPosition::LowerRight
            })
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

fn cdf(mut xs: Vec<f64>) -> Vec<(f64, f64)> {
    xs.sort_by(f64::total_cmp);
    let n = xs.len() as f64;
    xs.iter()
        .enumerate()
        .map(|(i, &x)| (x, (i + 1) as f64 / n))
        .collect()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The HTML report: the summary table, then latency CDFs, throughput and goodput against the
/// sweep's points, TTFT against prompt length, and the time series of requests in flight and KV
/// usage.
pub fn html(r: &Report) -> Result<String, String> {
    let many_rounds = r.runs.iter().any(|x| x.round > 0);
    // Plot at most a dozen runs' curves, the first ones.
    let shown: Vec<&RunResult> = r.runs.iter().take(12).collect();
    let ok = |run: &RunResult| {
        run.output
            .measured
            .records
            .iter()
            .filter(|x| !x.warmup && x.ok())
            .cloned()
            .collect::<Vec<_>>()
    };
    let mut plots = Vec::new();
    let series = |f: &dyn Fn(&RunResult) -> Vec<(f64, f64)>| -> Vec<(String, Vec<(f64, f64)>)> {
        shown
            .iter()
            .map(|x| (run_name(x, many_rounds), f(x)))
            .collect()
    };
    plots.push(lines(
        "Time to first token (CDF)",
        "ms",
        "fraction of requests",
        &series(&|x| cdf(ok(x).iter().filter_map(|q| q.ttft_ms).collect())),
    )?);
    // The gaps' tail (a prefill's stall) can be 100 times their body: the plot stops at the
    // 99th percentile so the body stays readable; p99 and max are in the table.
    plots.push(lines(
        "Inter-token latency (CDF over tokens, to the 99th percentile)",
        "ms",
        "fraction of gaps",
        &series(&|x| {
            let h = &x.output.measured.gaps.0;
            let n = h.len().max(1) as f64;
            let mut acc = 0u64;
            let mut pts: Vec<(f64, f64)> = Vec::new();
            for v in h.iter_recorded() {
                acc += v.count_at_value();
                pts.push((v.value_iterated_to() as f64 / 1e3, acc as f64 / n));
                if acc as f64 / n >= 0.99 {
                    break;
                }
            }
            pts
        }),
    )?);
    plots.push(lines(
        "End-to-end latency (CDF)",
        "ms",
        "fraction of requests",
        &series(&|x| cdf(ok(x).iter().map(|q| q.e2e_ms).collect())),
    )?);
    if r.runs.iter().any(|x| x.point.is_some()) {
        let targets = r.targets.len();
        let by_target =
            |f: &dyn Fn(&Summary) -> f64, what: &str| -> Vec<(String, Vec<(f64, f64)>)> {
                (0..targets)
                    .map(|k| {
                        let pts = r
                            .runs
                            .iter()
                            .filter(|x| x.target_index == k)
                            .filter_map(|x| x.point.map(|p| (p, f(&x.summary))))
                            .collect();
                        (format!("{} {what}", r.targets[k]), pts)
                    })
                    .collect()
            };
        let mut s = by_target(&|s| s.output_tok_s, "output tok/s");
        plots.push(lines(
            "Throughput against the sweep's points",
            "rate (req/s) or concurrency",
            "output tok/s",
            &s,
        )?);
        s = by_target(
            &|s| s.goodput_request_s.unwrap_or(s.request_s),
            "goodput req/s",
        );
        plots.push(lines(
            "Goodput against the sweep's points",
            "rate (req/s) or concurrency",
            "requests/s meeting the SLO",
            &s,
        )?);
    }
    plots.push(scatter(
        "Time to first token against prompt length",
        "prompt tokens",
        "TTFT ms",
        &series(&|x| {
            ok(x)
                .iter()
                .filter_map(|q| q.ttft_ms.map(|t| (q.prompt_tokens as f64, t)))
                .collect()
        }),
    )?);
    plots.push(lines(
        "Requests in flight",
        "s",
        "requests",
        &series(&|x| {
            x.output
                .ticks
                .iter()
                .map(|t| (t.t, t.in_flight as f64))
                .collect()
        }),
    )?);
    if r.runs
        .iter()
        .any(|x| x.output.ticks.iter().any(|t| t.kv_usage.is_some()))
    {
        plots.push(lines(
            "KV cache usage (the fullest worker)",
            "s",
            "fraction used",
            &series(&|x| {
                x.output
                    .ticks
                    .iter()
                    .filter_map(|t| t.kv_usage.map(|u| (t.t, u)))
                    .collect()
            }),
        )?);
    }
    let mut html = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Tandem load report</title><style>\
         body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;font-size:13px}\
         td,th{border:1px solid #bbb;padding:3px 8px;text-align:right}th{background:#eee}\
         td:first-child{text-align:left}.plots svg{margin:8px;border:1px solid #ddd}</style></head><body>",
    );
    let _ = write!(
        html,
        "<h1>Tandem load report</h1><p>{}</p><p>Load generator: {}</p>",
        escape(&r.description),
        escape(&r.client_cpu)
    );
    html.push_str("<table><tr><th>run</th><th>requests</th><th>failed</th><th>out tok/s</th><th>decode tok/s a stream</th><th>req/s</th><th>goodput req/s</th><th>TTFT p50/p99 ms</th><th>ITL p50/p99 ms</th><th>TPOT p50 ms</th><th>E2E p50/p99 ms</th></tr>");
    for run in &r.runs {
        let s = &run.summary;
        let _ = write!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.2}</td><td>{}</td><td>{:.1} / {:.1}</td><td>{:.1} / {:.1}</td><td>{:.1}</td><td>{:.0} / {:.0}</td></tr>",
            escape(&run_name(run, many_rounds)),
            s.requests,
            s.errors,
            s.output_tok_s,
            s.decode_tok_s,
            s.request_s,
            s.goodput_request_s.map_or("-".into(), |g| format!("{g:.2}")),
            s.ttft.p50, s.ttft.p99, s.itl.p50, s.itl.p99, s.tpot.p50, s.e2e.p50, s.e2e.p99
        );
    }
    html.push_str("</table>");
    for q in &r.ratios {
        let _ = write!(
            html,
            "<p>{}{} round {}: output tok/s {:.3}x, decode tok/s {:.3}x, TTFT p50 {:.3}x, ITL p50 {:.3}x{}</p>",
            escape(&ratio_name(r, q)),
            q.point.map_or(String::new(), |p| format!(" @ {p}")),
            q.round + 1,
            q.output_tok_s,
            q.decode_tok_s,
            q.ttft_p50,
            q.itl_p50,
            q.goodput
                .map_or(String::new(), |g| format!(", goodput {g:.3}x"))
        );
    }
    if let Some(s) = &r.sweep_stopped {
        let _ = write!(html, "<p>Sweep stopped: {}</p>", escape(s));
    }
    html.push_str("<div class=\"plots\">");
    for p in plots {
        html.push_str(&p);
    }
    html.push_str("</div></body></html>\n");
    Ok(html)
}

//! The load generator for clusters (`tandem bench serve`): arrival processes
//! ([`schedule`]), datasets ([`dataset`]), per-request records and goodput ([`measure`]), the
//! servers' own counters ([`metrics`]), distributed load ([`agent`]), and reports ([`report`]).
//!
//! [`execute`] runs a [`Bench`] against one target or two (side by side, alternating rounds),
//! once or as a sweep over rates or concurrencies that stops when goodput falls.

pub mod agent;
pub mod dataset;
pub mod measure;
pub mod metrics;
pub mod report;
pub mod run;
pub mod schedule;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use agent::{coordinate, Assignment};
use dataset::Dataset;
use measure::{Slo, Summary};
use metrics::{scrape, ServerDelta};
use run::{run, Plan, Progress, RunOutput, Share, Target, Watch};
use schedule::Shape;

/// A sweep: the same run at each of these points.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Sweep {
    /// Open-loop rates, requests per second.
    Rate(Vec<f64>),
    /// Closed-loop concurrencies.
    Concurrency(Vec<usize>),
}

impl std::str::FromStr for Sweep {
    type Err = String;

    /// `rate:1,2,4` or `concurrency:1,8,32`.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?}: a sweep is rate:R1,R2,... or concurrency:C1,C2,...");
        let (kind, list) = s.split_once(':').ok_or_else(bad)?;
        match kind {
            "rate" => list
                .split(',')
                .map(|v| v.parse::<f64>().ok().filter(|r| *r > 0.0))
                .collect::<Option<Vec<_>>>()
                .filter(|v| !v.is_empty())
                .map(Self::Rate)
                .ok_or_else(bad),
            "concurrency" => list
                .split(',')
                .map(|v| v.parse::<usize>().ok().filter(|c| *c > 0))
                .collect::<Option<Vec<_>>>()
                .filter(|v| !v.is_empty())
                .map(Self::Concurrency)
                .ok_or_else(bad),
            _ => Err(bad()),
        }
    }
}

/// A benchmark: what to send, when, how it is judged and from where.
#[derive(Clone, Debug)]
pub struct Bench {
    /// The dataset, read (run `k` draws it from its seed + `k`).
    pub dataset: Dataset,
    /// The schedule (the sweep changes its shape per point).
    pub plan: Plan,
    /// Goodput targets.
    pub slo: Slo,
    /// Run at several points instead of once.
    pub sweep: Option<Sweep>,
    /// Runs per point (per target): with two targets they alternate, first one then the other.
    /// Run `k` (in point-then-round order) draws the dataset from its seed + `k`.
    pub rounds: usize,
    /// Load agents (`host:port`); none: this process sends everything.
    pub agents: Vec<String>,
    /// Extra `/metrics` URLs of the first target's cluster (its workers), read with its own.
    pub metrics: Vec<String>,
    /// A progress line on stderr.
    pub progress: bool,
    /// An agent silent this long is lost.
    pub agent_silence: Duration,
}

/// One run against one target.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunResult {
    /// The target's name.
    pub target: String,
    /// Which target of the comparison (0: the first).
    pub target_index: usize,
    /// The sweep point (rate or concurrency), if sweeping.
    pub point: Option<f64>,
    /// Round number.
    pub round: usize,
    /// The figures.
    pub summary: Summary,
    /// What the servers counted meanwhile.
    pub server: Option<ServerDelta>,
    /// Agents lost during the run.
    pub lost_agents: Vec<String>,
    /// Records, gaps and time series.
    #[serde(skip)]
    pub output: RunOutput,
}

/// The first target's figures over another's, for one point and round.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Ratio {
    /// Sweep point.
    pub point: Option<f64>,
    /// Round.
    pub round: usize,
    /// The target the first is divided by (its index in `targets`, 1 or more).
    pub against: usize,
    /// Output tokens per second, first over the other (above 1: the first is faster).
    pub output_tok_s: f64,
    /// A stream's decode rate ([`measure::Summary::decode_tok_s`]), first over the other.
    #[serde(default)]
    pub decode_tok_s: f64,
    /// Median TTFT, first over second (below 1: the first is faster).
    pub ttft_p50: f64,
    /// 99th-percentile TTFT.
    pub ttft_p99: f64,
    /// Median inter-token latency.
    pub itl_p50: f64,
    /// 99th-percentile inter-token latency.
    pub itl_p99: f64,
    /// Goodput under the SLO (requests/s), first over the other; absent without an SLO.
    pub goodput: Option<f64>,
}

/// Everything a benchmark measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// The load generator's machine.
    pub client_cpu: String,
    /// What was run, in words.
    pub description: String,
    /// The targets, in order.
    pub targets: Vec<String>,
    /// Every run.
    pub runs: Vec<RunResult>,
    /// The first target over each other one, per point and round.
    pub ratios: Vec<Ratio>,
    /// Why a sweep stopped early, if it did.
    pub sweep_stopped: Option<String>,
}

fn plan_at(plan: &Plan, sweep: &Option<Sweep>, i: usize) -> (Plan, Option<f64>) {
    let mut p = plan.clone();
    let point = match sweep {
        None => None,
        Some(Sweep::Rate(r)) => {
            let (arrival, ramp, max_in_flight) = match plan.shape {
                Shape::Open {
                    arrival,
                    ramp,
                    max_in_flight,
                    ..
                } => (arrival, ramp, max_in_flight),
                Shape::Closed { .. } => (schedule::Arrival::Poisson, None, None),
            };
            p.shape = Shape::Open {
                rate: r[i],
                arrival,
                ramp,
                max_in_flight,
            };
            Some(r[i])
        }
        Some(Sweep::Concurrency(c)) => {
            p.shape = Shape::Closed { concurrency: c[i] };
            Some(c[i] as f64)
        }
    };
    (p, point)
}

fn metrics_urls(bench: &Bench, target: &Target, index: usize) -> Vec<String> {
    let mut urls = Vec::new();
    if let Target::Http(h) = target {
        urls.push(format!("{}/metrics", h.base));
    }
    if index == 0 {
        urls.extend(bench.metrics.iter().cloned());
    }
    urls
}

/// One run of `plan` against `target`, locally or through the agents, with the dataset drawn
/// from `seed`.
async fn one_run(
    bench: &Bench,
    target: &Target,
    index: usize,
    (plan, seed): (&Plan, u64),
    label: String,
) -> RunResult {
    let urls = metrics_urls(bench, target, index);
    let client = reqwest::Client::new();
    let before = if urls.is_empty() {
        None
    } else {
        Some(scrape(&client, &urls).await)
    };
    let watch = Watch {
        progress: bench.progress,
        metrics: urls.clone(),
        label,
    };
    let (output, lost) = match (target, bench.agents.is_empty()) {
        (Target::Http(h), false) => {
            let a = Assignment {
                base: h.base.clone(),
                model: h.model.clone(),
                dataset: bench.dataset.with_seed(seed),
                plan: plan.clone(),
                share: Share::ALL,
                start_in_ms: 500,
                metrics: urls.clone(),
            };
            let g = coordinate(&bench.agents, &a, bench.agent_silence).await;
            (g.output, g.lost)
        }
        _ => {
            let progress = Arc::new(Progress::default());
            let dataset = bench.dataset.with_seed(seed);
            let out = run(target, &dataset, plan, Share::ALL, &watch, progress).await;
            (out, Vec::new())
        }
    };
    let server = match before {
        Some((before, _)) => {
            let (after, missing) = scrape(&client, &urls).await;
            Some(ServerDelta::between(&before, &after, missing))
        }
        None => None,
    };
    RunResult {
        target: target.name(),
        target_index: index,
        point: None,
        round: 0,
        summary: output.measured.summary(&bench.slo),
        server,
        lost_agents: lost,
        output,
    }
}

/// What a sweep judges a point by: goodput when targets are set, else successful requests/s.
fn goodput(s: &Summary) -> f64 {
    s.goodput_request_s.unwrap_or(s.request_s)
}

/// Runs the benchmark against `targets` (one, or several side by side: the same schedule to
/// each in turn, the order reversed every other round; ratios are the first over each other).
pub async fn execute(bench: &Bench, targets: &[Target], description: String) -> Report {
    let points = match &bench.sweep {
        None => 1,
        Some(Sweep::Rate(r)) => r.len(),
        Some(Sweep::Concurrency(c)) => c.len(),
    };
    let mut runs = Vec::new();
    let mut ratios = Vec::new();
    let mut best: Option<f64> = None;
    let mut stopped = None;
    for i in 0..points {
        let (plan, point) = plan_at(&bench.plan, &bench.sweep, i);
        let mut at_point = Vec::new();
        for round in 0..bench.rounds.max(1) {
            let mut this_round: Vec<RunResult> = Vec::new();
            // Alternate which target goes first, so drift over time hits both alike.
            let order: Vec<usize> = if round % 2 == 0 {
                (0..targets.len()).collect()
            } else {
                (0..targets.len()).rev().collect()
            };
            for k in order {
                let label = format!(
                    "[{}{} round {}]",
                    if targets.len() > 1 {
                        format!("target {} ", k + 1)
                    } else {
                        String::new()
                    },
                    point.map_or(String::new(), |p| format!("point {p}")),
                    round + 1
                );
                // Each point and round draws new prompts (the same for every target), so no
                // server replays an earlier run from its prefix cache.
                let seed = bench.dataset.seed() + (i * bench.rounds.max(1) + round) as u64;
                let mut r = one_run(bench, &targets[k], k, (&plan, seed), label).await;
                r.point = point;
                r.round = round;
                this_round.push(r);
            }
            this_round.sort_by_key(|r| r.target_index);
            if let [a, others @ ..] = &this_round[..] {
                let over = |x: f64, y: f64| if y > 0.0 { x / y } else { f64::NAN };
                for b in others {
                    let (s, t) = (&a.summary, &b.summary);
                    ratios.push(Ratio {
                        point,
                        round,
                        against: b.target_index,
                        output_tok_s: over(s.output_tok_s, t.output_tok_s),
                        decode_tok_s: over(s.decode_tok_s, t.decode_tok_s),
                        ttft_p50: over(s.ttft.p50, t.ttft.p50),
                        ttft_p99: over(s.ttft.p99, t.ttft.p99),
                        itl_p50: over(s.itl.p50, t.itl.p50),
                        itl_p99: over(s.itl.p99, t.itl.p99),
                        goodput: s
                            .goodput_request_s
                            .zip(t.goodput_request_s)
                            .map(|(x, y)| over(x, y)),
                    });
                }
            }
            at_point.extend(this_round);
        }
        let mut g: Vec<f64> = at_point
            .iter()
            .filter(|r| r.target_index == 0)
            .map(|r| goodput(&r.summary))
            .collect();
        g.sort_by(f64::total_cmp);
        let median = g[g.len() / 2];
        runs.extend(at_point);
        if bench.sweep.is_some() && i + 1 < points {
            if let Some(b) = best.filter(|b| median < *b) {
                stopped = Some(format!(
                    "goodput fell at point {} ({median:.2} req/s, after {b:.2}): the points past it were not run",
                    point.unwrap_or(0.0)
                ));
                break;
            }
        }
        best = Some(best.map_or(median, |b: f64| b.max(median)));
    }
    Report {
        client_cpu: crate::roofline::cpu_info().to_string(),
        description,
        targets: targets.iter().map(Target::name).collect(),
        runs,
        ratios,
        sweep_stopped: stopped,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use schedule::{Arrival, StopAfter};

    #[test]
    fn sweeps_parse_and_set_each_points_shape() {
        assert_eq!("rate:1,2.5".parse(), Ok(Sweep::Rate(vec![1.0, 2.5])));
        assert_eq!(
            "concurrency:1,8".parse(),
            Ok(Sweep::Concurrency(vec![1, 8]))
        );
        for bad in ["rate:", "rate:0", "concurrency:1,x", "speed:1"] {
            assert!(bad.parse::<Sweep>().is_err(), "{bad}");
        }
        let plan = Plan {
            shape: Shape::Open {
                rate: 9.0,
                arrival: Arrival::Gamma(2.0),
                ramp: None,
                max_in_flight: Some(4),
            },
            bound: StopAfter {
                requests: Some(10),
                duration: None,
            },
            warmup: 0,
            seed: 0,
            stall: Duration::from_secs(1),
            times: None,
        };
        let (p, point) = plan_at(&plan, &Some(Sweep::Rate(vec![1.0, 3.0])), 1);
        assert_eq!(point, Some(3.0));
        let Shape::Open {
            rate,
            arrival,
            max_in_flight,
            ..
        } = p.shape
        else {
            panic!("{:?}", p.shape)
        };
        assert_eq!(
            (rate, arrival, max_in_flight),
            (3.0, Arrival::Gamma(2.0), Some(4))
        );
        let (p, point) = plan_at(&plan, &Some(Sweep::Concurrency(vec![2, 16])), 0);
        assert_eq!(point, Some(2.0));
        assert!(matches!(p.shape, Shape::Closed { concurrency: 2 }));
        assert_eq!(plan_at(&plan, &None, 0).1, None);
    }
}

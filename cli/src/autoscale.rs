//! `tandem up --autoscale`: the planner ([`tandem_bench::plan`]) run continuously on the
//! cluster's own numbers, starting and draining local workers to the shape it asks for.
//!
//! Every interval `up` reads the router's counters (`tandem_router_admitted_requests`,
//! `tandem_router_tokens`, `tandem_router_requests`) and keeps them for a window: the arrival
//! rate and the mean prompt length of the requests admitted over it, and the mean output length
//! of those that finished over it (the last known when none did), are the load. The profiles
//! are the files given (`--autoscale-profile`, from `tandem bench profile`), or, without one,
//! each worker's own fitted step cost as it reports it in `Load` ([`Profile::from_step_cost`]).
//! The plan's
//! cheapest shape within the bounds that meets the TTFT and ITL targets is the wanted one
//! ([`plan::within`]): a role below it gets workers at once; a role above it for
//! `--scale-down-after-s` (with nothing waiting on its workers) has one drained: it leaves the
//! router's pool (its `Load` reports draining, so no new request goes to it), finishes what it
//! runs, and only then is stopped and taken out of the worker list. Nothing is lost and its KV
//! is freed with its requests.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use tandem_bench::plan::{self, Load, Profile, Shape, Targets};

/// The autoscaler's flags (`tandem up --autoscale ...`).
#[derive(Args, Clone, Debug)]
pub struct AutoscaleArgs {
    /// Start and drain workers to the planner's shape for the load the router sees (between
    /// --decode-workers and --max-decode-workers decode workers, --prefill-workers and
    /// --max-prefill-workers prefill workers).
    #[arg(long, env = "TANDEM_AUTOSCALE")]
    pub autoscale: bool,
    /// A decode worker's measured profile (`tandem bench profile --out F`). Default: one built
    /// from the workers' own fitted step cost, as they report it.
    #[arg(long = "autoscale-profile", env = "TANDEM_AUTOSCALE_PROFILE")]
    pub profile: Option<PathBuf>,
    /// A prefill worker's profile (default: the decode worker's).
    #[arg(long = "autoscale-prefill-profile")]
    pub prefill_profile: Option<PathBuf>,
    /// Most decode workers (default: as many as the cores hold at --worker-threads each).
    #[arg(long = "max-decode-workers", env = "TANDEM_MAX_DECODE_WORKERS")]
    pub max_decode: Option<usize>,
    /// Most prefill workers (default: --prefill-workers, so none is added unless this is set).
    #[arg(long = "max-prefill-workers", env = "TANDEM_MAX_PREFILL_WORKERS")]
    pub max_prefill: Option<usize>,
    /// The 90th percentile time-to-first-token target the plan sizes for, ms.
    #[arg(long = "autoscale-ttft-ms", default_value_t = 2000.0)]
    pub ttft_ms: f64,
    /// The mean inter-token gap target the plan sizes for, ms.
    #[arg(long = "autoscale-itl-ms", default_value_t = 100.0)]
    pub itl_ms: f64,
    /// Seconds of traffic the load is measured over (rate and mean lengths).
    #[arg(long = "autoscale-window-s", default_value_t = 60.0)]
    pub window_s: f64,
    /// Seconds between plans.
    #[arg(long = "autoscale-interval-s", default_value_t = 5.0)]
    pub interval_s: f64,
    /// Seconds the plan must keep asking for fewer workers of a role before one is drained.
    #[arg(long = "scale-down-after-s", default_value_t = 120.0)]
    pub down_after_s: f64,
    /// Seconds a drained worker gets to finish its requests before it is stopped anyway (its
    /// own --drain-timeout-s then applies).
    #[arg(long = "autoscale-drain-timeout-s", default_value_t = 600.0)]
    pub drain_timeout_s: f64,
}

impl AutoscaleArgs {
    /// Refuses settings the loop cannot run with.
    pub fn check(&self) -> Result<(), String> {
        let positive = [
            ("--autoscale-ttft-ms", self.ttft_ms),
            ("--autoscale-itl-ms", self.itl_ms),
            ("--autoscale-window-s", self.window_s),
            ("--autoscale-interval-s", self.interval_s),
            ("--autoscale-drain-timeout-s", self.drain_timeout_s),
        ];
        for (flag, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{flag} must be a positive number, not {v}"));
            }
        }
        if !(self.down_after_s.is_finite() && self.down_after_s >= 0.0) {
            return Err(format!(
                "--scale-down-after-s must be 0 or more, not {}",
                self.down_after_s
            ));
        }
        Ok(())
    }

    pub fn targets(&self) -> Targets {
        Targets {
            ttft_p90_ms: self.ttft_ms,
            itl_ms: self.itl_ms,
        }
    }
}

/// Reads a profile file (`tandem bench profile`'s JSON).
pub fn read_profile(path: &std::path::Path) -> anyhow::Result<Profile> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("reading the profile {}: {e}", path.display()))?;
    let p: Profile = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("the profile {}: {e}", path.display()))?;
    p.check()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(p)
}

/// The router's running totals, from its `/metrics` page.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Totals {
    /// Requests admitted past its queue.
    pub admitted: f64,
    /// Prompt tokens dispatched.
    pub prompt: f64,
    /// Completion tokens served.
    pub completion: f64,
    /// Requests admitted that finished (answered, failed or cancelled).
    pub finished: f64,
}

impl Totals {
    /// Sums the counters out of a Prometheus/OpenMetrics text page.
    pub fn parse(page: &str) -> Self {
        let mut t = Self::default();
        for line in page.lines() {
            if line.starts_with('#') {
                continue;
            }
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(v) = value.trim().parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => (n, l),
                None => (series, ""),
            };
            match name {
                "tandem_router_admitted_requests_total" => t.admitted += v,
                "tandem_router_tokens_total" if labels.contains("kind=\"prompt\"") => t.prompt += v,
                "tandem_router_tokens_total" if labels.contains("kind=\"completion\"") => {
                    t.completion += v
                }
                "tandem_router_requests_total"
                    if ["ok", "failed", "cancelled"]
                        .iter()
                        .any(|o| labels.contains(&format!("outcome=\"{o}\""))) =>
                {
                    t.finished += v
                }
                _ => {}
            }
        }
        t
    }
}

/// The load over the window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observed {
    /// Requests a second.
    pub rate: f64,
    /// Mean prompt tokens of a request.
    pub prompt_mean: f64,
    /// Mean completion tokens of a request.
    pub output_mean: f64,
}

/// The router's totals over the last `span`.
pub struct Window {
    span: Duration,
    samples: VecDeque<(Instant, Totals)>,
    /// The last mean prompt and output lengths seen, kept through a quiet window.
    prompt: Option<f64>,
    output: Option<f64>,
}

impl Window {
    pub fn new(span: Duration) -> Self {
        Self {
            span,
            samples: VecDeque::new(),
            prompt: None,
            output: None,
        }
    }

    /// Adds a reading; readings older than the span are dropped (one at least `span` old is
    /// kept as the window's start).
    pub fn push(&mut self, at: Instant, t: Totals) {
        // A router that restarted counts from zero: start over.
        if self
            .samples
            .back()
            .is_some_and(|(_, last)| t.admitted < last.admitted)
        {
            self.samples.clear();
        }
        self.samples.push_back((at, t));
        while self.samples.len() > 2 && at.duration_since(self.samples[1].0) >= self.span {
            self.samples.pop_front();
        }
    }

    /// The load between the window's first and last readings (None with fewer than two, or
    /// while no request has finished yet: its output length is not known).
    pub fn observed(&mut self) -> Option<Observed> {
        let (t0, a) = *self.samples.front()?;
        let (t1, b) = *self.samples.back()?;
        let dt = t1.duration_since(t0).as_secs_f64();
        if dt <= 0.0 {
            return None;
        }
        let n = b.admitted - a.admitted;
        if n > 0.0 {
            self.prompt = Some((b.prompt - a.prompt) / n);
        }
        let done = b.finished - a.finished;
        if done > 0.0 {
            self.output = Some((b.completion - a.completion) / done);
        }
        Some(Observed {
            rate: n / dt,
            prompt_mean: self.prompt.unwrap_or(1.0),
            output_mean: self.output?,
        })
    }
}

/// Worker bounds per role: (least, most).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub prefill: (usize, usize),
    pub decode: (usize, usize),
}

/// The shape the plan wants for `seen` within `b`, and its estimate (none for an idle load:
/// the least of each role).
pub fn wanted(
    prefill: &Profile,
    decode: &Profile,
    seen: &Observed,
    targets: &Targets,
    b: &Bounds,
) -> (Shape, Option<plan::Estimate>) {
    let least = Shape {
        prefill: b.prefill.0,
        decode: b.decode.0,
    };
    let round = |x: f64| (x.round().max(1.0)) as usize;
    let load = Load {
        rate: seen.rate,
        prompt: (round(seen.prompt_mean), round(seen.prompt_mean)),
        output: (round(seen.output_mean), round(seen.output_mean)),
    };
    if load.check().is_err() {
        return (least, None);
    }
    let most = b.prefill.1.max(b.decode.1);
    let p = plan::plan(prefill, decode, &load, targets, most);
    match plan::within(&p, targets, b.prefill, b.decode) {
        Some(e) => (e.shape, Some(e)),
        None => (least, None),
    }
}

/// A role: prefill (index 0) or decode (index 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub const BOTH: [Role; 2] = [Role::Prefill, Role::Decode];

    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    fn of(self, s: Shape) -> usize {
        match self {
            Role::Prefill => s.prefill,
            Role::Decode => s.decode,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What to do about a role now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Start this many workers.
    Start(Role, usize),
    /// Drain one worker.
    Drain(Role),
}

/// Turns wanted shapes into actions: up at once, down only after the plan has asked for fewer
/// for `down_after` without a break, one worker at a time, and never while requests wait.
pub struct Decider {
    down_after: Duration,
    fewer_since: [Option<Instant>; 2],
}

impl Decider {
    pub fn new(down_after: Duration) -> Self {
        Self {
            down_after,
            fewer_since: [None, None],
        }
    }

    /// `serving`: workers of each role taking requests (draining ones not counted);
    /// `waiting[role]`: whether requests wait on any of that role's workers.
    pub fn decide(
        &mut self,
        now: Instant,
        serving: Shape,
        want: Shape,
        waiting: [bool; 2],
    ) -> Vec<Action> {
        let mut out = Vec::new();
        for role in Role::BOTH {
            let (have, need) = (role.of(serving), role.of(want));
            let since = &mut self.fewer_since[role.index()];
            if need > have {
                *since = None;
                out.push(Action::Start(role, need - have));
            } else if need < have && !waiting[role.index()] {
                let t = *since.get_or_insert(now);
                if now.duration_since(t) >= self.down_after {
                    out.push(Action::Drain(role));
                    // The next one waits its own turn.
                    *since = Some(now);
                }
            } else {
                *since = None;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_bench::plan::DecodePoint;

    const PAGE: &str = r#"# HELP tandem_router_admitted_requests Generation requests admitted.
# TYPE tandem_router_admitted_requests counter
tandem_router_admitted_requests_total 12
# TYPE tandem_router_tokens counter
tandem_router_tokens_total{kind="prompt"} 2400
tandem_router_tokens_total{kind="completion"} 640
tandem_router_tenant_tokens_total{tenant="a",kind="prompt"} 99
tandem_router_requests_total{role="router",outcome="ok"} 9
tandem_router_requests_total{role="router",outcome="cancelled"} 1
tandem_router_requests_total{role="router",outcome="invalid"} 5
# EOF
"#;

    #[test]
    fn totals_are_read_from_the_router_s_page() {
        assert_eq!(
            Totals::parse(PAGE),
            Totals {
                admitted: 12.0,
                prompt: 2400.0,
                completion: 640.0,
                finished: 10.0,
            }
        );
        assert_eq!(Totals::parse("garbage\n{}\n"), Totals::default());
    }

    fn at(t0: Instant, s: f64) -> Instant {
        t0 + Duration::from_secs_f64(s)
    }

    fn totals(admitted: f64, prompt: f64, completion: f64, finished: f64) -> Totals {
        Totals {
            admitted,
            prompt,
            completion,
            finished,
        }
    }

    #[test]
    fn the_window_measures_the_rate_and_lengths_and_forgets_old_traffic() {
        let t0 = Instant::now();
        let mut w = Window::new(Duration::from_secs(10));
        w.push(t0, totals(0.0, 0.0, 0.0, 0.0));
        assert_eq!(w.observed(), None);
        // Admitted, none finished: the output length is not known yet.
        w.push(at(t0, 2.0), totals(4.0, 800.0, 0.0, 0.0));
        assert_eq!(w.observed(), None);
        w.push(at(t0, 5.0), totals(10.0, 2000.0, 500.0, 5.0));
        let o = w.observed().unwrap();
        assert_eq!((o.rate, o.prompt_mean, o.output_mean), (2.0, 200.0, 100.0));
        // Quiet for longer than the window: no rate, the last lengths kept.
        w.push(at(t0, 10.0), totals(10.0, 2000.0, 1000.0, 10.0));
        w.push(at(t0, 20.0), totals(10.0, 2000.0, 1000.0, 10.0));
        w.push(at(t0, 30.0), totals(10.0, 2000.0, 1000.0, 10.0));
        let o = w.observed().unwrap();
        assert_eq!((o.rate, o.prompt_mean, o.output_mean), (0.0, 200.0, 100.0));
        // A restarted router (its counters back to zero) starts the window over.
        w.push(at(t0, 31.0), totals(1.0, 10.0, 0.0, 0.0));
        assert_eq!(w.observed(), None);
        w.push(at(t0, 32.0), totals(3.0, 50.0, 8.0, 2.0));
        let o = w.observed().unwrap();
        assert_eq!((o.rate, o.prompt_mean, o.output_mean), (2.0, 20.0, 4.0));
    }

    /// A slow worker: 200 prompt tokens a second, 50 ms steps alone, 100 ms at 8 streams.
    pub(crate) fn slow() -> Profile {
        Profile {
            kind: "slow".into(),
            cores: 1,
            prefill_tokens_per_s: 200.0,
            decode: vec![
                DecodePoint {
                    batch: 1,
                    step_ms: 50.0,
                },
                DecodePoint {
                    batch: 8,
                    step_ms: 100.0,
                },
            ],
            max_batch: 8,
        }
    }

    #[test]
    fn the_wanted_shape_follows_the_load_within_the_bounds() {
        let p = slow();
        let t = Targets {
            ttft_p90_ms: 2000.0,
            itl_ms: 100.0,
        };
        let b = Bounds {
            prefill: (0, 0),
            decode: (1, 2),
        };
        let seen = |rate| Observed {
            rate,
            prompt_mean: 20.0,
            output_mean: 16.0,
        };
        let shape = |d| Shape {
            prefill: 0,
            decode: d,
        };
        // Idle and light: the least; a burst of 8 a second: both workers.
        assert_eq!(wanted(&p, &p, &seen(0.0), &t, &b).0, shape(1));
        assert_eq!(wanted(&p, &p, &seen(1.0), &t, &b).0, shape(1));
        assert_eq!(wanted(&p, &p, &seen(4.0), &t, &b).0, shape(2));
        assert_eq!(wanted(&p, &p, &seen(8.0), &t, &b).0, shape(2));
        // Past what two can do: still two (the bound).
        let (s, e) = wanted(&p, &p, &seen(100.0), &t, &b);
        assert_eq!(s, shape(2));
        assert!(!e.unwrap().meets(&t));
    }

    #[test]
    fn up_at_once_down_after_a_steady_while_and_not_while_requests_wait() {
        let t0 = Instant::now();
        let mut d = Decider::new(Duration::from_secs(10));
        let s = |p, d| Shape {
            prefill: p,
            decode: d,
        };
        assert_eq!(
            d.decide(t0, s(0, 1), s(1, 3), [false; 2]),
            [
                Action::Start(Role::Prefill, 1),
                Action::Start(Role::Decode, 2)
            ]
        );
        assert!(d.decide(t0, s(1, 3), s(1, 3), [false; 2]).is_empty());
        // Fewer wanted: nothing until it has been so for 10 s.
        assert!(d
            .decide(at(t0, 1.0), s(1, 3), s(1, 1), [false; 2])
            .is_empty());
        assert!(d
            .decide(at(t0, 10.0), s(1, 3), s(1, 1), [false; 2])
            .is_empty());
        // A break in between starts the wait over.
        assert!(d
            .decide(at(t0, 10.5), s(1, 3), s(1, 3), [false; 2])
            .is_empty());
        assert!(d
            .decide(at(t0, 11.0), s(1, 3), s(1, 1), [false; 2])
            .is_empty());
        assert_eq!(
            d.decide(at(t0, 21.0), s(1, 3), s(1, 1), [false; 2]),
            [Action::Drain(Role::Decode)]
        );
        // The next drain waits its own turn, and none while requests wait.
        assert!(d
            .decide(at(t0, 25.0), s(1, 2), s(1, 1), [false; 2])
            .is_empty());
        assert!(d
            .decide(at(t0, 31.0), s(1, 2), s(1, 1), [false, true])
            .is_empty());
        assert!(d
            .decide(at(t0, 40.0), s(1, 2), s(1, 1), [false; 2])
            .is_empty());
        assert_eq!(
            d.decide(at(t0, 50.0), s(1, 2), s(1, 1), [false; 2]),
            [Action::Drain(Role::Decode)]
        );
    }
}

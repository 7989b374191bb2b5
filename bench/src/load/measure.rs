//! What a run measured: one record per request, the inter-token gaps in a histogram, and the
//! summary a report prints. Records and histograms merge exactly, so the results of several
//! load agents add up to what one process would have measured on the same schedule.

use std::collections::BTreeMap;
use std::str::FromStr;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// One request's outcome and timings (milliseconds from its send; `sent_s` from the run start).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Session and turn it came from.
    pub session: usize,
    /// Turn within the session.
    pub turn: usize,
    /// Seconds from the run's start to the send.
    pub sent_s: f64,
    /// How late the send was against its schedule (open loop), in milliseconds.
    pub lag_ms: f64,
    /// Prompt tokens (the server's count when it reports usage).
    pub prompt_tokens: usize,
    /// Output tokens received.
    pub output_tokens: usize,
    /// Time to the first token.
    pub ttft_ms: Option<f64>,
    /// Send to last byte.
    pub e2e_ms: f64,
    /// The longest gap between two streamed chunks.
    pub itl_max_ms: Option<f64>,
    /// Streamed chunks that carried output (one token each, or several where the server's
    /// stream fell behind its engine and sent them together): the gaps are between these.
    #[serde(default)]
    pub chunks: usize,
    /// `"ok"`, an HTTP status (`"503"`), or what went wrong (`"connect"`, `"stream"`, ...).
    pub status: String,
    /// The error's text.
    pub error: Option<String>,
    /// Sent during warmup: not in the measures.
    pub warmup: bool,
    /// One of a mixed workload's long requests.
    #[serde(default)]
    pub long: bool,
}

impl Record {
    /// Whether the request succeeded.
    pub fn ok(&self) -> bool {
        self.status == "ok"
    }

    /// Time per output token after the first.
    pub fn tpot_ms(&self) -> Option<f64> {
        let ttft = self.ttft_ms?;
        (self.output_tokens > 1).then(|| (self.e2e_ms - ttft) / (self.output_tokens - 1) as f64)
    }
}

/// Output tokens after the first over the seconds from first token to last, over the requests
/// with two tokens or more (0 where there are none).
fn decode_rate(ok: &[&Record]) -> f64 {
    let (mut tokens, mut ms) = (0usize, 0.0f64);
    for r in ok {
        if let (Some(ttft), true) = (r.ttft_ms, r.output_tokens > 1) {
            tokens += r.output_tokens - 1;
            ms += r.e2e_ms - ttft;
        }
    }
    if ms > 0.0 {
        tokens as f64 / (ms / 1e3)
    } else {
        0.0
    }
}

/// Latency targets a request must all meet to count towards goodput.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Slo {
    /// Time to first token, at most.
    pub ttft_ms: Option<f64>,
    /// The request's mean inter-token latency (its TPOT), at most.
    pub itl_ms: Option<f64>,
    /// End-to-end latency, at most.
    pub e2e_ms: Option<f64>,
}

impl Slo {
    /// Whether `r` succeeded and met every target.
    pub fn met(&self, r: &Record) -> bool {
        let within = |v: Option<f64>, t: Option<f64>| t.is_none_or(|t| v.is_some_and(|v| v <= t));
        r.ok()
            && within(r.ttft_ms, self.ttft_ms)
            && within(r.tpot_ms().or(r.ttft_ms.map(|_| 0.0)), self.itl_ms)
            && within(Some(r.e2e_ms), self.e2e_ms)
    }

    /// Whether any target is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.itl_ms.is_some() || self.e2e_ms.is_some()
    }
}

impl FromStr for Slo {
    type Err = String;

    /// `ttft=MS,itl=MS,e2e=MS`, any subset (`tpot` is taken for `itl`).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut slo = Slo::default();
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: a target is NAME=MS"))?;
            let v: f64 = v
                .parse()
                .ok()
                .filter(|v: &f64| *v > 0.0)
                .ok_or_else(|| format!("{part:?}: a target is a positive number of ms"))?;
            match k {
                "ttft" => slo.ttft_ms = Some(v),
                "itl" | "tpot" => slo.itl_ms = Some(v),
                "e2e" => slo.e2e_ms = Some(v),
                _ => return Err(format!("{k:?}: targets are ttft, itl and e2e")),
            }
        }
        Ok(slo)
    }
}

/// Inter-token gaps, in microseconds (3 significant digits).
#[derive(Clone, Debug)]
pub struct Gaps(pub Histogram<u64>);

impl Default for Gaps {
    fn default() -> Self {
        Self(Histogram::new(3).expect("3 significant digits"))
    }
}

impl Gaps {
    /// Records one gap.
    pub fn record_ms(&mut self, ms: f64) {
        // Auto-resizing: any value fits.
        let _ = self.0.record((ms * 1e3).round().max(1.0) as u64);
    }

    /// Adds another histogram's counts.
    pub fn merge(&mut self, other: &Gaps) {
        let _ = self.0.add(&other.0);
    }

    /// The non-empty buckets as (value, count): what an agent sends.
    pub fn buckets(&self) -> Vec<(u64, u64)> {
        self.0
            .iter_recorded()
            .map(|v| (v.value_iterated_to(), v.count_at_value()))
            .collect()
    }

    /// The histogram of `buckets`.
    pub fn from_buckets(b: &[(u64, u64)]) -> Self {
        let mut g = Self::default();
        for &(v, n) in b {
            let _ = g.0.record_n(v, n);
        }
        g
    }

    fn dist(&self) -> Dist {
        let h = &self.0;
        if h.is_empty() {
            return Dist::default();
        }
        let q = |p: f64| h.value_at_quantile(p) as f64 / 1e3;
        Dist {
            count: h.len() as usize,
            mean: h.mean() / 1e3,
            p50: q(0.5),
            p90: q(0.9),
            p95: q(0.95),
            p99: q(0.99),
            max: h.max() as f64 / 1e3,
        }
    }
}

impl Serialize for Gaps {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.buckets().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Gaps {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self::from_buckets(&Vec::<(u64, u64)>::deserialize(d)?))
    }
}

/// Percentiles of one measure, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    /// Values measured.
    pub count: usize,
    /// Their mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Dist {
    /// Exact percentiles of `xs` (nearest rank).
    pub fn of(mut xs: Vec<f64>) -> Self {
        if xs.is_empty() {
            return Self::default();
        }
        xs.sort_by(f64::total_cmp);
        let n = xs.len();
        let q = |p: f64| xs[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
        Self {
            count: n,
            mean: xs.iter().sum::<f64>() / n as f64,
            p50: q(0.5),
            p90: q(0.9),
            p95: q(0.95),
            p99: q(0.99),
            max: xs[n - 1],
        }
    }
}

/// Everything measured against one target in one run (or merged from several agents).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Measured {
    /// Every request, warmup included (flagged).
    pub records: Vec<Record>,
    /// Inter-token gaps of the measured (non-warmup) requests that succeeded.
    pub gaps: Gaps,
    /// Those of the short requests, when the workload mixes in long ones.
    pub short_gaps: Gaps,
    /// Seconds from the first send to the last request's end.
    pub wall_s: f64,
    /// Seconds the warmup took (from the start to the first measured send).
    pub warmup_s: f64,
}

impl Measured {
    /// Adds another agent's part of the same run.
    pub fn merge(&mut self, other: Measured) {
        self.records.extend(other.records);
        self.records.sort_by_key(|r: &Record| (r.session, r.turn));
        self.gaps.merge(&other.gaps);
        self.short_gaps.merge(&other.short_gaps);
        self.wall_s = self.wall_s.max(other.wall_s);
        self.warmup_s = self.warmup_s.max(other.warmup_s);
    }

    /// The summary, goodput under `slo`.
    pub fn summary(&self, slo: &Slo) -> Summary {
        let measured: Vec<&Record> = self.records.iter().filter(|r| !r.warmup).collect();
        let ok: Vec<&Record> = measured.iter().copied().filter(|r| r.ok()).collect();
        let mut errors = BTreeMap::new();
        for r in measured.iter().filter(|r| !r.ok()) {
            *errors.entry(r.status.clone()).or_insert(0) += 1;
        }
        let span = (self.wall_s - self.warmup_s).max(1e-9);
        let output_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
        let input_tokens: usize = ok.iter().map(|r| r.prompt_tokens).sum();
        let output_chunks: usize = ok.iter().map(|r| r.chunks).sum();
        let met = slo
            .is_set()
            .then(|| measured.iter().filter(|r| slo.met(r)).count());
        Summary {
            requests: measured.len(),
            ok: ok.len(),
            errors: measured.len() - ok.len(),
            errors_by_status: errors,
            warmup_requests: self.records.len() - measured.len(),
            wall_s: span,
            input_tokens,
            output_tokens,
            output_chunks,
            output_tok_s: output_tokens as f64 / span,
            decode_tok_s: decode_rate(&ok),
            total_tok_s: (input_tokens + output_tokens) as f64 / span,
            request_s: ok.len() as f64 / span,
            slo_met: met,
            goodput_request_s: met.map(|m| m as f64 / span),
            ttft: Dist::of(ok.iter().filter_map(|r| r.ttft_ms).collect()),
            itl: self.gaps.dist(),
            tpot: Dist::of(ok.iter().filter_map(|r| r.tpot_ms()).collect()),
            e2e: Dist::of(ok.iter().map(|r| r.e2e_ms).collect()),
            schedule_lag: Dist::of(measured.iter().map(|r| r.lag_ms).collect()),
            mixed: measured.iter().any(|r| r.long).then(|| Mixed {
                short_itl: self.short_gaps.dist(),
                long_ttft: Dist::of(
                    ok.iter()
                        .filter(|r| r.long)
                        .filter_map(|r| r.ttft_ms)
                        .collect(),
                ),
            }),
            first_error: measured.iter().find_map(|r| r.error.clone()),
        }
    }
}

/// A run's figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests measured (warmup excluded).
    pub requests: usize,
    /// Of them, succeeded.
    pub ok: usize,
    /// Of them, failed.
    pub errors: usize,
    /// Failures by status (`"503"`, `"connect"`, `"stream"`, `"timeout"`, ...).
    pub errors_by_status: BTreeMap<String, usize>,
    /// Requests sent during warmup.
    pub warmup_requests: usize,
    /// Seconds measured (from the first measured send to the last end).
    pub wall_s: f64,
    /// Prompt tokens of the successful requests.
    pub input_tokens: usize,
    /// Output tokens of the successful requests.
    pub output_tokens: usize,
    /// The streamed chunks those came in ([`Record::chunks`]): [`Summary::itl`] holds a gap for
    /// each after a request's first. Fewer than the tokens where a server sent several at once.
    #[serde(default)]
    pub output_chunks: usize,
    /// Output tokens per second.
    pub output_tok_s: f64,
    /// A stream's decode rate: the successful requests' output tokens after their first over
    /// the time from first token to last, summed over requests (what speculative decoding
    /// speeds up; the first token's wait is the prefill's, the same with or without it).
    #[serde(default)]
    pub decode_tok_s: f64,
    /// Prompt and output tokens per second.
    pub total_tok_s: f64,
    /// Successful requests per second.
    pub request_s: f64,
    /// Requests that met every SLO target (when targets were given).
    pub slo_met: Option<usize>,
    /// Those per second.
    pub goodput_request_s: Option<f64>,
    /// Time to first token.
    pub ttft: Dist,
    /// Gaps between streamed tokens, over every token of every request.
    pub itl: Dist,
    /// Each request's mean time per output token after the first.
    pub tpot: Dist,
    /// Send to last token.
    pub e2e: Dist,
    /// Lateness of open-loop sends against their schedule.
    pub schedule_lag: Dist,
    /// A mixed workload's two classes.
    pub mixed: Option<Mixed>,
    /// The first error's text.
    pub first_error: Option<String>,
}

/// What a mixed workload is for: how long prefills stall the others' tokens, and how long they
/// wait themselves.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Mixed {
    /// Inter-token latency of the short requests.
    pub short_itl: Dist,
    /// Time to first token of the long requests.
    pub long_ttft: Dist,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ttft: f64, e2e: f64, out: usize, status: &str) -> Record {
        Record {
            ttft_ms: Some(ttft),
            e2e_ms: e2e,
            output_tokens: out,
            // Two tokens a chunk.
            chunks: out.div_ceil(2),
            prompt_tokens: 10,
            status: status.into(),
            ..Default::default()
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let d = Dist::of((1..=100).map(|x| x as f64).collect());
        assert_eq!(
            (d.p50, d.p90, d.p95, d.p99, d.max),
            (50.0, 90.0, 95.0, 99.0, 100.0)
        );
        assert_eq!(d.mean, 50.5);
        let d = Dist::of(vec![3.0]);
        assert_eq!((d.p50, d.p99, d.count), (3.0, 3.0, 1));
        assert_eq!(Dist::of(vec![]), Dist::default());
    }

    #[test]
    fn goodput_counts_requests_meeting_every_target() {
        let slo: Slo = "ttft=100,itl=10,e2e=1000".parse().unwrap();
        // tpot = (e2e - ttft) / (out - 1).
        let m = Measured {
            records: vec![
                rec(50.0, 500.0, 46, "ok"),   // tpot 10: meets all
                rec(150.0, 500.0, 36, "ok"),  // ttft over
                rec(50.0, 600.0, 11, "ok"),   // tpot 55: over
                rec(90.0, 1200.0, 112, "ok"), // e2e over
                rec(10.0, 20.0, 2, "503"),    // failed
                Record {
                    warmup: true,
                    ..rec(1.0, 2.0, 2, "ok")
                },
            ],
            wall_s: 2.5,
            warmup_s: 0.5,
            ..Default::default()
        };
        let s = m.summary(&slo);
        assert_eq!(
            (s.requests, s.ok, s.errors, s.warmup_requests),
            (5, 4, 1, 1)
        );
        assert_eq!(s.slo_met, Some(1));
        assert_eq!(s.goodput_request_s, Some(0.5));
        assert_eq!(s.request_s, 2.0);
        assert_eq!(s.output_tokens, 46 + 36 + 11 + 112);
        // The successful measured requests' chunks only.
        assert_eq!(s.output_chunks, 23 + 18 + 6 + 56);
        assert_eq!(s.errors_by_status.get("503"), Some(&1));
        assert_eq!(s.ttft.max, 150.0);
        // Tokens after the first over first-to-last seconds, over the successful requests:
        // (45 + 35 + 10 + 111) tokens in (450 + 350 + 550 + 1110) ms.
        assert_eq!(s.decode_tok_s, 201.0 / 2.46);
        assert_eq!(m.summary(&Slo::default()).slo_met, None);
        assert!("ttft=0".parse::<Slo>().is_err());
        assert!("latency=5".parse::<Slo>().unwrap_err().contains("ttft"));
    }

    #[test]
    fn gaps_merge_exactly() {
        let (mut a, mut b, mut all) = (Gaps::default(), Gaps::default(), Gaps::default());
        for i in 0..1000 {
            let v = 0.1 + (i as f64 * 7.3) % 97.0;
            if i % 3 == 0 { &mut a } else { &mut b }.record_ms(v);
            all.record_ms(v);
        }
        let wire: Vec<(u64, u64)> =
            serde_json::from_str(&serde_json::to_string(&b).unwrap()).unwrap();
        a.merge(&Gaps::from_buckets(&wire));
        assert_eq!(a.buckets(), all.buckets());
        assert_eq!(a.dist(), all.dist());
        // 3 significant digits.
        assert!(
            (all.dist().max - 97.0).abs() / 97.0 < 1e-3,
            "{}",
            all.dist().max
        );
    }
}

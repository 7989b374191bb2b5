//! When requests are sent: a closed loop (a fixed number in flight) or an open loop whose
//! arrivals follow a Poisson, gamma or constant process at a rate, optionally ramped up, bounded
//! by a number of requests or a duration.
//!
//! Open-loop times are computed before the run as offsets from its start, so the dispatcher
//! sleeps to absolute deadlines: a late wake-up delays one request, it does not shift (or bunch
//! up) the ones after it.

use std::str::FromStr;
use std::time::Duration;

use rand::SeedableRng;
use rand_distr::{Distribution, Exp1, Gamma};
use serde::{Deserialize, Serialize};

/// The process open-loop arrivals follow.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Arrival {
    /// Exponential gaps: a Poisson process.
    Poisson,
    /// Gamma gaps of this shape (below 1: burstier than Poisson; above: more regular).
    Gamma(f64),
    /// Equal gaps.
    Constant,
}

impl FromStr for Arrival {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "poisson" => Ok(Self::Poisson),
            "constant" => Ok(Self::Constant),
            _ => match s.strip_prefix("gamma:").map(str::parse::<f64>) {
                Some(Ok(k)) if k > 0.0 && k.is_finite() => Ok(Self::Gamma(k)),
                Some(_) => Err(format!("{s:?}: a gamma shape is a positive number")),
                None => Err(format!(
                    "{s:?}: arrivals are poisson, gamma:SHAPE or constant"
                )),
            },
        }
    }
}

/// How the load is applied.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Shape {
    /// This many requests in flight at all times.
    Closed {
        /// Requests in flight.
        concurrency: usize,
    },
    /// Requests arrive at `rate` per second (a linear ramp from 0 over `ramp`, if set), however
    /// many are in flight (at most `max_in_flight` when set: arrivals past it wait).
    Open {
        /// Requests per second once ramped up.
        rate: f64,
        /// The arrival process.
        arrival: Arrival,
        /// The rate grows linearly from 0 to `rate` over this long.
        ramp: Option<Duration>,
        /// A cap on requests in flight.
        max_in_flight: Option<usize>,
    },
}

/// When the run stops sending.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct StopAfter {
    /// After this many requests (warmup included).
    pub requests: Option<usize>,
    /// After this long.
    pub duration: Option<Duration>,
}

impl StopAfter {
    /// Whether request `i` (0-based), due `at` after the start, is still sent.
    pub fn admits(&self, i: usize, at: Duration) -> bool {
        self.requests.is_none_or(|n| i < n) && self.duration.is_none_or(|d| at < d)
    }
}

/// Offsets from the run's start of the open-loop arrivals, as many as `bound` admits. The gaps
/// are drawn with mean 1 in "expected arrivals" and mapped through the inverse of the cumulative
/// rate, so a ramp bends time without changing the process's shape.
pub fn arrival_times(
    rate: f64,
    arrival: Arrival,
    ramp: Option<Duration>,
    bound: StopAfter,
    seed: u64,
) -> Vec<Duration> {
    assert!(rate > 0.0, "an open loop needs a positive rate");
    assert!(
        bound.requests.is_some() || bound.duration.is_some(),
        "an open loop needs a bound"
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0xa7717a1);
    let gamma = match arrival {
        Arrival::Gamma(k) => Some(Gamma::new(k, 1.0 / k).expect("a positive shape")),
        _ => None,
    };
    let ramp_s = ramp.map_or(0.0, |r| r.as_secs_f64());
    // Expected arrivals by the end of the ramp.
    let ramp_mass = rate * ramp_s / 2.0;
    let time_of = |s: f64| -> f64 {
        if s < ramp_mass {
            (2.0 * ramp_s * s / rate).sqrt()
        } else {
            ramp_s + (s - ramp_mass) / rate
        }
    };
    let mut out = Vec::new();
    let mut s = 0.0;
    loop {
        let gap: f64 = match arrival {
            Arrival::Poisson => Exp1.sample(&mut rng),
            Arrival::Gamma(_) => gamma.as_ref().expect("gamma").sample(&mut rng),
            Arrival::Constant => 1.0,
        };
        // The first request goes at once; every later one a gap after the previous.
        let at = Duration::from_secs_f64(time_of(s));
        if !bound.admits(out.len(), at) {
            return out;
        }
        out.push(at);
        s += gap;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(n: usize) -> StopAfter {
        StopAfter {
            requests: Some(n),
            duration: None,
        }
    }

    fn gaps(times: &[Duration]) -> Vec<f64> {
        times
            .windows(2)
            .map(|w| (w[1] - w[0]).as_secs_f64())
            .collect()
    }

    /// Kolmogorov-Smirnov distance of a sample from a CDF.
    fn ks(mut xs: Vec<f64>, cdf: impl Fn(f64) -> f64) -> f64 {
        xs.sort_by(f64::total_cmp);
        let n = xs.len() as f64;
        xs.iter()
            .enumerate()
            .map(|(i, &x)| {
                let f = cdf(x);
                (f - i as f64 / n).abs().max((f - (i + 1) as f64 / n).abs())
            })
            .fold(0.0, f64::max)
    }

    /// The gamma CDF for an integer shape `k` and rate `l`: 1 - e^(-lx) Σ_{i<k} (lx)^i / i!.
    fn erlang_cdf(k: u32, l: f64) -> impl Fn(f64) -> f64 {
        move |x: f64| {
            let y = l * x;
            let mut term = 1.0;
            let mut sum = 0.0;
            for i in 0..k {
                if i > 0 {
                    term *= y / i as f64;
                }
                sum += term;
            }
            1.0 - (-y).exp() * sum
        }
    }

    #[test]
    fn poisson_and_gamma_gaps_fit_their_distributions() {
        let n = 20_000;
        // The 99.9% critical value of the KS statistic is 1.95/sqrt(n).
        let critical = 1.95 / (n as f64).sqrt();
        let rate = 40.0;
        let t = arrival_times(rate, Arrival::Poisson, None, bound(n), 7);
        assert_eq!(t.len(), n);
        assert_eq!(t[0], Duration::ZERO);
        let d = ks(gaps(&t), |x| 1.0 - (-rate * x).exp());
        assert!(d < critical, "poisson: KS {d} over {critical}");
        for k in [2u32, 4] {
            let t = arrival_times(rate, Arrival::Gamma(k as f64), None, bound(n), 9);
            let d = ks(gaps(&t), erlang_cdf(k, k as f64 * rate));
            assert!(d < critical, "gamma {k}: KS {d} over {critical}");
            // And the wrong shape is told apart: the test has power.
            let wrong = ks(gaps(&t), |x| 1.0 - (-rate * x).exp());
            assert!(
                wrong > 5.0 * critical,
                "gamma {k} against exponential: {wrong}"
            );
        }
        // A non-integer shape: mean 1/rate, coefficient of variation 1/sqrt(shape).
        let t = arrival_times(rate, Arrival::Gamma(0.5), None, bound(n), 11);
        let g = gaps(&t);
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        let var = g.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / g.len() as f64;
        assert!((mean * rate - 1.0).abs() < 0.05, "mean {mean}");
        let cv = var.sqrt() / mean;
        assert!((cv - 2f64.sqrt()).abs() < 0.1, "cv {cv}");
    }

    #[test]
    fn constant_arrivals_are_evenly_spaced_and_bounded_by_duration() {
        let b = StopAfter {
            requests: None,
            duration: Some(Duration::from_secs(2)),
        };
        let t = arrival_times(50.0, Arrival::Constant, None, b, 0);
        assert_eq!(t.len(), 100);
        for (i, at) in t.iter().enumerate() {
            assert!((at.as_secs_f64() - i as f64 / 50.0).abs() < 1e-9);
        }
    }

    #[test]
    fn a_ramp_reaches_the_rate_and_keeps_it() {
        let ramp = Duration::from_secs(10);
        let t = arrival_times(100.0, Arrival::Constant, Some(ramp), bound(3000), 0);
        // Half the ramp's area (rate·T/2 = 500 arrivals) lands in the ramp, a quarter of them in
        // its first half (the rate there averages a quarter of the full rate).
        let before = |s: f64| t.iter().filter(|a| a.as_secs_f64() < s).count();
        assert!((before(10.0) as i64 - 500).abs() <= 1, "{}", before(10.0));
        assert!((before(5.0) as i64 - 125).abs() <= 1, "{}", before(5.0));
        // After it, constant gaps of 1/rate.
        let g = gaps(&t[600..]);
        assert!(g.iter().all(|x| (x - 0.01).abs() < 1e-9));
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let a = arrival_times(10.0, Arrival::Poisson, None, bound(50), 3);
        let b = arrival_times(10.0, Arrival::Poisson, None, bound(50), 3);
        let c = arrival_times(10.0, Arrival::Poisson, None, bound(50), 4);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn arrivals_parse() {
        assert_eq!("poisson".parse(), Ok(Arrival::Poisson));
        assert_eq!("gamma:0.5".parse(), Ok(Arrival::Gamma(0.5)));
        assert!("gamma:-1".parse::<Arrival>().is_err());
        assert!("uniform"
            .parse::<Arrival>()
            .unwrap_err()
            .contains("poisson"));
    }
}

//! The queueing model behind `tandem plan`: what a shape gives a load, in closed form.

use super::{Estimate, Load, Profile, Shape};

/// Prompt tokens a decode step takes under the ITL target whatever the time left
/// (`tandem_engine::MIN_ITL_PREFILL_CHUNK`).
pub const MIN_CHUNK: f64 = 16.0;

/// The 90th percentile of an M/G/c queue's wait: `c` servers of mean service `s` seconds (its
/// squared coefficient of variation `cv2`) at `lambda` arrivals a second. The wait of those that
/// wait is about exponential at rate `c/s - lambda` (Erlang C for the share that waits, the
/// Allen-Cunneen factor `(1 + cv2) / 2` for service that is not exponential). Infinite when the
/// servers cannot keep up.
pub fn wait_p90(c: usize, s: f64, lambda: f64, cv2: f64) -> f64 {
    let a = lambda * s;
    if c == 0 || a >= c as f64 {
        return f64::INFINITY;
    }
    let p_wait = erlang_c(c, a);
    if p_wait <= 0.1 {
        return 0.0;
    }
    (p_wait / 0.1).ln() / (c as f64 / s - lambda) * (1.0 + cv2) / 2.0
}

/// Erlang C: the chance an arrival waits, `c` servers at offered load `a` (< c).
pub fn erlang_c(c: usize, a: f64) -> f64 {
    // Erlang B by its recurrence (stable), then C from B.
    let mut b = 1.0;
    for k in 1..=c {
        b = a * b / (k as f64 + a * b);
    }
    let rho = a / c as f64;
    b / (1.0 - rho + rho * b)
}

/// The smallest `b` with `b = demand × step_ms(b) / 1000 × stretch(b)`: the mean streams on a
/// decode worker serving `demand` tokens a second, by Little's law (iterated up from none, which
/// converges to the least fixed point as the step time grows with the batch). None when it
/// passes `max_batch`: the worker cannot keep up.
fn streams(p: &Profile, demand: f64, stretch: f64) -> Option<f64> {
    let mut b = 0.0f64;
    for _ in 0..10_000 {
        let next = demand * p.step_ms(b) / 1000.0 * stretch;
        if next > p.max_batch as f64 {
            return None;
        }
        if (next - b).abs() < 1e-9 {
            return Some(next);
        }
        b = next;
    }
    Some(b)
}

/// What `shape` gives `load`: the 90th percentile TTFT and the mean ITL (infinite where a pool
/// cannot keep up). Decode workers are assumed to run with `--itl-target-ms` at the ITL target
/// (`itl_target_ms`); KV transfer time is not counted (on one machine's loopback it is
/// milliseconds; across machines add the link's time per prompt).
pub fn estimate_at(
    prefill: &Profile,
    decode: &Profile,
    load: &Load,
    shape: Shape,
    itl_target_ms: f64,
) -> Estimate {
    let cores = shape.prefill * prefill.cores + shape.decode * decode.cores;
    let lost = Estimate {
        shape,
        cores,
        ttft_p90_ms: f64::INFINITY,
        itl_ms: f64::INFINITY,
        batch: f64::INFINITY,
    };
    if shape.decode == 0 {
        return lost;
    }
    let lambda_w = load.rate / shape.decode as f64;
    let demand = lambda_w * load.output_mean();
    let cv2 = load.prompt_cv2();
    if shape.prefill > 0 {
        // Prompts queue for the prefill pool; decode workers only decode.
        let s = load.prompt_mean() / prefill.prefill_tokens_per_s;
        let wait = wait_p90(shape.prefill, s, load.rate, cv2);
        let Some(b) = streams(decode, demand, 1.0) else {
            return lost;
        };
        let itl = decode.step_ms(b);
        let longest = load.prompt.1 as f64 / prefill.prefill_tokens_per_s;
        Estimate {
            shape,
            cores,
            ttft_p90_ms: (longest + wait) * 1e3 + itl,
            itl_ms: itl,
            batch: b,
        }
    } else {
        // Colocated: a share u of each worker's time computes prompts; decodes get the rest.
        let s = load.prompt_mean() / decode.prefill_tokens_per_s;
        let u = lambda_w * s;
        if u >= 1.0 {
            return lost;
        }
        let Some(b) = streams(decode, demand, 1.0 / (1.0 - u)) else {
            return lost;
        };
        let t = decode.step_ms(b);
        // While a prompt is computed beside decoding streams, a step is held to the target: the
        // prompt gets what the decodes leave of it (a floor of MIN_CHUNK tokens a step).
        let floor_ms = MIN_CHUNK / decode.prefill_tokens_per_s * 1e3;
        let prompt_ms = (itl_target_ms - t).max(floor_ms);
        let share = if b < 0.5 {
            1.0
        } else {
            prompt_ms / (prompt_ms + t)
        };
        let s_eff = s / share;
        let rho = lambda_w * s_eff;
        if rho >= 1.0 {
            return lost;
        }
        // A single server; its wait's tail (M/G/1, the same exponential tail as wait_p90).
        let wait = wait_p90(1, s_eff, lambda_w, cv2);
        let longest = load.prompt.1 as f64 / decode.prefill_tokens_per_s / share;
        // Streams see held steps while a prompt is in (a share rho of the time), plain ones else.
        let itl = (t / (1.0 - u)).max(t * (1.0 - rho) + (prompt_ms + t) * rho);
        Estimate {
            shape,
            cores,
            ttft_p90_ms: (longest + wait) * 1e3,
            itl_ms: itl,
            batch: b,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erlang_c_matches_known_values() {
        // One server: the chance to wait is the utilisation.
        assert!((erlang_c(1, 0.7) - 0.7).abs() < 1e-12);
        // Two servers at a = 1: C = 1/3.
        assert!((erlang_c(2, 1.0) - 1.0 / 3.0).abs() < 1e-12);
        // M/M/1 at rho 0.5, s = 1: P(W > t) = 0.5 e^{-0.5 t}; p90 at ln 5 / 0.5.
        assert!((wait_p90(1, 1.0, 0.5, 1.0) - 5f64.ln() / 0.5).abs() < 1e-9);
        assert_eq!(wait_p90(2, 1.0, 2.0, 0.0), f64::INFINITY);
        assert_eq!(wait_p90(4, 1.0, 0.1, 0.0), 0.0);
    }
}

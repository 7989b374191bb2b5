//! Speculation checked by its outcome, step against step: whatever the cost model of the
//! policy expects ([`super::Engine::propose`] keeps the proposals it says pay), a step that
//! speculates must be seen to make tokens faster than a step that does not, at the same batch.
//! A model drafting costs forwards and catch-ups the cost model can misjudge; a proposer's
//! tokens cost nearly nothing to ask, but the rows they add cost what the cost model's line
//! through steps of other sizes may not say (a row past eight takes the products to another
//! kernel, a row of a verification costs compute where a decode row costs reading its cache).
//!
//! For each batch size (the sequences decoding in the step, exact up to 8, then by powers of
//! two), the tokens per second of the steps that speculated and of those that decoded plainly,
//! each a moving average over steps that computed no prompt tokens (slow for the arm chosen,
//! whose steps swing with what is accepted; faster for the one probed), timed from before the
//! proposals (a draft model's forwards count) to the end of the step. A draft model's
//! catch-up (its K/V for a prompt, or for tokens decoded while it did not draft) is paid once
//! for the tokens a sequence makes after it: its time is taken out of the step and charged,
//! shared over the tokens the sequence may still make (no more than finished sequences made
//! on average), to the steps that speculate
//! ([`super::Engine::record_arm`]). The faster arm runs; the other is probed, [`PROBE_RUN`]
//! steps in a row, so that its measure follows the traffic (the texts, their acceptance, the
//! contexts' lengths): [`PROBE`] steps after the choice, then at intervals that double while
//! probes confirm the choice, up to [`MAX_PROBE`]. A probe of a draft model pays for catching
//! a sequence up, wasted if plain decoding stays chosen, so probes must be rare where
//! speculation loses: one waits besides until the plain steps since the last (at any batch
//! size: the budget is the worker's) ran fifty times what that one spent catching up
//! ([`PROBE_BUDGET`]). Where speculation is not chosen, a step that speculates catches up one
//! sequence at most ([`super::Engine::propose`]), so a probe of a draft model at a batch of
//! many measures one sequence drafting beside plain decodes (a self-draft catches nothing
//! up: every sequence may draft), and only where the policy expects that one to
//! pay for the draft forwards it then runs alone (else the probe's steps verify nothing and
//! count as plain): speculation is chosen there only where that pays already. A batch size
//! seen for the first time is meant to speculate for [`WARM`] steps (the policy may hold
//! every proposal back) and then decodes plainly for as many. Which arm a step takes
//! changes no output: speculation gives the bits plain decoding gives.

/// Steps each arm is tried at a batch size before the measures decide (a step that computed
/// prompt tokens is not measured, one meant to speculate that verified nothing is measured as
/// plain).
pub(super) const WARM: u32 = 3;
/// Steps at a batch size between a choice and the first probe of the other arm.
pub(super) const PROBE: u32 = 16;
/// The longest interval between probes.
pub(super) const MAX_PROBE: u32 = 256;
/// Weight of the newest step in the chosen arm's tokens per second: a slow average (about the
/// last 20 steps), since one step's tokens swing from one to all proposed as proposals are
/// accepted or not, and a run of misses must not turn the choice.
const CHOSEN_WEIGHT: f64 = 0.05;
/// Weight of the newest step in the tokens per second of an arm being tried or probed: a probe
/// is a few steps, so they count for more.
const PROBE_WEIGHT: f64 = 0.25;
/// Steps in a row a probe takes the other arm: its measure is of several steps, not one, and
/// with [`PROBE_WEIGHT`] four steps carry a probed arm's average 68% of the way to their rate.
pub(super) const PROBE_RUN: u32 = 4;
/// The most a probe of speculation may spend catching sequences up (a draft model's forwards
/// over what they decoded plainly, wasted if plain decoding stays chosen), as a share of the
/// time plain steps ran since the probe before it: a probe that spent `c` seconds is followed
/// by the next only after `c / PROBE_BUDGET` seconds of plain steps. 2%: within the 3% that
/// speculation may cost where it does not pay (it must keep 0.97 of plain decoding's rate).
const PROBE_BUDGET: f64 = 0.02;

/// Whether a step speculates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Arm {
    Speculate,
    Plain,
}

impl Arm {
    fn other(self) -> Self {
        match self {
            Arm::Speculate => Arm::Plain,
            Arm::Plain => Arm::Speculate,
        }
    }
}

/// One arm's measure at one batch size.
#[derive(Clone, Copy, Debug, Default)]
struct Measure {
    tokens_per_s: f64,
    steps: u32,
}

impl Measure {
    fn record(&mut self, rate: f64, weight: f64) {
        self.tokens_per_s = match self.steps {
            0 => rate,
            _ => weight * rate + (1.0 - weight) * self.tokens_per_s,
        };
        self.steps = self.steps.saturating_add(1);
    }
}

/// Both arms' measures at one batch size, the steps decided there by them, the arm they chose
/// and when the other is probed next.
#[derive(Clone, Copy, Debug, Default)]
struct Bucket {
    /// Steps decided while the arms are first tried.
    warm: u32,
    speculate: Measure,
    plain: Measure,
    decided: u32,
    best: Option<Arm>,
    interval: u32,
    next_probe: u32,
    /// Steps the probe under way still takes the other arm.
    probing: u32,
}

impl Bucket {
    fn arm(&mut self, arm: Arm) -> &mut Measure {
        match arm {
            Arm::Speculate => &mut self.speculate,
            Arm::Plain => &mut self.plain,
        }
    }
}

/// The two arms' measures by batch size.
#[derive(Debug, Default)]
pub(super) struct AbCheck {
    buckets: Vec<Bucket>,
    /// The bucket of the last step (a probe under way ends where the batch size changes).
    last: usize,
    /// Seconds of plain steps since the last probe of speculation, at any batch size.
    plain_seconds: f64,
    /// Seconds the last probe of speculation spent catching sequences up.
    probe_cost: f64,
}

/// The bucket of a step with `decoding` sequences decoding: exact up to 8, then one per power
/// of two (9-16, 17-32, ...).
fn bucket(decoding: usize) -> usize {
    if decoding <= 8 {
        decoding
    } else {
        8 + (usize::BITS - (decoding - 1).leading_zeros()) as usize - 3
    }
}

impl AbCheck {
    fn bucket(&mut self, decoding: usize) -> &mut Bucket {
        let b = bucket(decoding);
        if self.buckets.len() <= b {
            self.buckets.resize(b + 1, Bucket::default());
        }
        &mut self.buckets[b]
    }

    /// The arm a step with `decoding` sequences decoding takes.
    pub(super) fn arm(&mut self, decoding: usize) -> Arm {
        let last = std::mem::replace(&mut self.last, bucket(decoding));
        if last != self.last {
            if let Some(b) = self.buckets.get_mut(last) {
                b.probing = 0;
            }
        }
        // A probe of speculation waits (past its step) until the plain steps since the last
        // one, at any batch size, have paid for what that one spent catching up.
        let affordable = self.plain_seconds * PROBE_BUDGET >= self.probe_cost;
        let b = self.bucket(decoding);
        if b.warm < 2 * WARM {
            b.warm += 1;
            return match b.warm <= WARM {
                true => Arm::Speculate,
                false => Arm::Plain,
            };
        }
        b.decided = b.decided.saturating_add(1);
        let best = if b.speculate.tokens_per_s >= b.plain.tokens_per_s {
            Arm::Speculate
        } else {
            Arm::Plain
        };
        if b.best != Some(best) {
            b.best = Some(best);
            b.interval = PROBE;
            b.next_probe = b.decided.saturating_add(PROBE);
            b.probing = 0;
        }
        if b.probing > 0 {
            b.probing -= 1;
            return best.other();
        }
        if b.decided >= b.next_probe && (best == Arm::Speculate || affordable) {
            b.interval = (2 * b.interval).min(MAX_PROBE);
            b.next_probe = b.decided.saturating_add(b.interval);
            b.probing = PROBE_RUN - 1;
            if best == Arm::Plain {
                self.probe_cost = 0.0;
                self.plain_seconds = 0.0;
            }
            return best.other();
        }
        best
    }

    /// The tokens per second measured for `arm` at `decoding` sequences decoding (a test's
    /// view).
    #[cfg(test)]
    pub(super) fn rate(&self, decoding: usize, arm: Arm) -> f64 {
        self.buckets
            .get(bucket(decoding))
            .map_or(0.0, |b| match arm {
                Arm::Speculate => b.speculate.tokens_per_s,
                Arm::Plain => b.plain.tokens_per_s,
            })
    }

    /// Whether steps at `decoding` sequences decoding are expected to go on speculating: where
    /// speculation is chosen, not while the arms are first tried nor where plain decoding is
    /// chosen (there a step that speculates catches up one sequence at most, enough to measure
    /// drafting by, not every sequence whose drafting is not expected to go on).
    pub(super) fn speculating(&self, decoding: usize) -> bool {
        self.buckets
            .get(bucket(decoding))
            .is_some_and(|b| b.best == Some(Arm::Speculate))
    }

    /// A step with `decoding` sequences decoding that was to take `arm` ran `seconds`, of which
    /// `catch_up` a draft model spent catching sequences up (measured or not: a step that
    /// computed prompt tokens counts here too).
    pub(super) fn spent(&mut self, decoding: usize, arm: Arm, seconds: f64, catch_up: f64) {
        match (arm, self.bucket(decoding).best) {
            (Arm::Plain, _) => self.plain_seconds += seconds,
            (Arm::Speculate, Some(Arm::Plain)) => self.probe_cost += catch_up,
            (Arm::Speculate, _) => {}
        }
    }

    /// A step with `decoding` sequences decoding took `arm` and made `tokens` tokens in
    /// `seconds` (a step that verified no proposal is a plain one, whatever it was meant to
    /// be).
    pub(super) fn record(&mut self, decoding: usize, arm: Arm, tokens: usize, seconds: f64) {
        if tokens == 0 || seconds.is_nan() || seconds <= 0.0 {
            return;
        }
        let rate = tokens as f64 / seconds;
        let b = self.bucket(decoding);
        let weight = match b.best == Some(arm) {
            true => CHOSEN_WEIGHT,
            false => PROBE_WEIGHT,
        };
        b.arm(arm).record(rate, weight);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A probe of speculation that spent time catching sequences up is followed by the next
    /// only once the plain steps since ran fifty times as long; one that spent nothing waits
    /// its interval only.
    #[test]
    fn a_costly_probe_waits_for_plain_steps_to_pay_for_it() {
        let mut ab = AbCheck::default();
        // Plain steps of 1/16 s make a token at 100 tokens/s, speculating ones at 50.
        let step = |ab: &mut AbCheck, catch_up: f64| {
            let arm = ab.arm(4);
            let (rate, catch_up) = match arm {
                Arm::Speculate => (50.0, catch_up),
                Arm::Plain => (100.0, 0.0),
            };
            ab.spent(4, arm, 0.0625 + catch_up, catch_up);
            ab.record(4, arm, 1, 1.0 / rate);
            arm
        };
        // Plain steps until a probe, then its run (catching up in its first step).
        let plain_run = |ab: &mut AbCheck, catch_up: f64| {
            let mut n = 0;
            while step(ab, catch_up) == Arm::Plain {
                n += 1;
            }
            for _ in 1..PROBE_RUN {
                assert_eq!(step(ab, 0.0), Arm::Speculate);
            }
            n
        };
        // The arms' first steps (catching up there is no probe's), then plain decoding, the
        // first probe PROBE steps after the choice.
        for _ in 0..2 * WARM {
            step(&mut ab, 0.5);
        }
        assert_eq!(plain_run(&mut ab, 0.101), PROBE);
        // That probe spent 0.101 s catching up: the next comes after 5.05 s of plain steps
        // (81 of them), not after the 32 steps its interval says.
        assert_eq!(plain_run(&mut ab, 0.0), 81);
        // That one spent nothing: the next starts when its interval (64 steps from the start of
        // the one before) says.
        assert_eq!(plain_run(&mut ab, 0.0), 4 * PROBE - PROBE_RUN);
        assert_eq!(ab.buckets[4].best, Some(Arm::Plain));
    }

    #[test]
    fn batch_sizes_fall_into_exact_then_doubling_buckets() {
        let got: Vec<usize> = [1, 2, 8, 9, 16, 17, 32, 33, 64, 65]
            .iter()
            .map(|&n| bucket(n))
            .collect();
        assert_eq!(got, [1, 2, 8, 9, 9, 10, 10, 11, 11, 12]);
    }

    /// Each arm is measured first, then the faster one runs, the slower one probed at
    /// intervals that double from `PROBE` to `MAX_PROBE` while it stays slower, and a measure
    /// that turns around turns the choice around within a probe.
    #[test]
    fn the_faster_arm_runs_and_the_slower_is_probed() {
        let mut ab = AbCheck::default();
        let run = |ab: &mut AbCheck, steps: u32, spec_rate: f64, plain_rate: f64| {
            let mut took = [0u32; 2];
            for _ in 0..steps {
                let arm = ab.arm(8);
                took[(arm == Arm::Plain) as usize] += 1;
                let rate = match arm {
                    Arm::Speculate => spec_rate,
                    Arm::Plain => plain_rate,
                };
                ab.record(8, arm, 8, 8.0 / rate);
            }
            took
        };
        assert_eq!(run(&mut ab, 2 * WARM, 50.0, 100.0), [WARM, WARM]);
        // Probes of PROBE_RUN steps 16, 32, 64, 128, 256 and 256 decided steps apart (from the
        // 17th, the 49th, ...).
        let n = PROBE + 2 * PROBE + 4 * PROBE + 8 * PROBE + 2 * MAX_PROBE;
        let probed = 5 * PROBE_RUN;
        assert_eq!(run(&mut ab, n, 50.0, 100.0), [probed, n - probed]);
        assert_eq!(ab.buckets[8].interval, MAX_PROBE);
        assert!(!ab.speculating(8));
        // Speculation turns faster (the texts repeat themselves now): the next probe's steps
        // carry its moving average over.
        let [spec, plain] = run(&mut ab, MAX_PROBE + 2 * PROBE + 1, 200.0, 100.0);
        assert!(
            spec >= MAX_PROBE && ab.buckets[8].best == Some(Arm::Speculate),
            "{spec} {plain}"
        );
        let [spec, plain] = run(&mut ab, 4 * PROBE, 200.0, 100.0);
        assert!(spec >= 4 * PROBE - 2, "{spec} {plain}");
        assert!(ab.speculating(8));
        // Another batch size is measured on its own.
        assert_eq!(ab.arm(3), Arm::Speculate);
        assert_eq!(ab.buckets[3].speculate.steps, 0);
        // A batch size where the steps meant to speculate verified nothing (each measured as
        // plain): plain decoding is chosen once both arms were tried.
        for _ in 0..2 * WARM {
            let _ = ab.arm(5);
            ab.record(5, Arm::Plain, 5, 0.05);
        }
        assert_eq!(ab.arm(5), Arm::Plain);
        // Steps that made nothing or took no time say nothing.
        ab.record(3, Arm::Speculate, 0, 1.0);
        ab.record(3, Arm::Speculate, 3, 0.0);
        assert_eq!(ab.buckets[3].speculate.steps, 0);
    }
}

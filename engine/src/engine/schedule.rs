//! The scheduler seam: what runs in the next step.
//!
//! A [`Scheduler`] decides each step's work through a [`StepPlan`]: it reads the running set and
//! the queue ([`SeqInfo`]) and asks for work with [`StepPlan::run`] (the next chunk of a running
//! sequence) and [`StepPlan::admit`] (the head of the queue). The plan does the mechanics every
//! policy shares and none may get wrong: the token budget, block reservation, copy-on-write of
//! shared blocks, prefix reuse at admission, admission headroom, and preemption by recompute
//! (the lowest priority band first, newest first within it) when the pool runs short. A policy
//! only chooses order and admission.
//!
//! Policies here: [`Continuous`] (the default: iteration-level batching with chunked prefill,
//! decodes first) and [`StaticBatches`] (a batch is formed from the head of the queue and nothing
//! joins it until all of it is done: the static batcher the benchmarks compare against; size 1
//! serves one request at a time).

use std::time::Instant;

use super::{Engine, PrefillOrder, RequestId, Seq};
use crate::block_manager::PoolFull;

/// Decides what runs in each step. The engine calls [`Scheduler::schedule`] once per step, after
/// dropping cancelled and stopped sequences; whatever the plan holds when it returns is the
/// step's batch (an empty plan: nothing runs this step).
pub trait Scheduler: Send {
    /// The policy's name, for logs and reports.
    fn name(&self) -> &'static str;

    /// Puts the next step's work into `plan`.
    fn schedule(&mut self, plan: &mut StepPlan<'_>);
}

/// One sequence as a scheduler sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqInfo {
    /// Its request.
    pub id: RequestId,
    /// Which of the request's samples it is.
    pub index: u32,
    /// Tokens it holds (prompt and generated).
    pub len: usize,
    /// Of those, the prompt's.
    pub prompt_len: usize,
    /// Leading tokens whose K/V is in the cache.
    pub computed: usize,
    /// Sequences it stands for: itself and the samples it has still to fork.
    pub width: usize,
    /// Times it was preempted (a preempted sequence waits with its generated tokens).
    pub preemptions: u32,
    /// Waiting: times a prompt behind it in the queue was admitted first.
    pub passed: u32,
    /// Its request's priority band (higher first).
    pub priority: i32,
}

impl SeqInfo {
    fn of(s: &Seq) -> Self {
        Self {
            id: s.id,
            index: s.index,
            len: s.tokens.len(),
            prompt_len: s.prompt_len,
            computed: s.computed,
            width: s.width(),
            preemptions: s.preemptions,
            passed: s.passed,
            priority: s.priority,
        }
    }

    /// Tokens to compute before it samples again.
    pub fn pending(&self) -> usize {
        self.len - self.computed
    }

    /// Whether its next step is one token of decode.
    pub fn decoding(&self) -> bool {
        self.pending() == 1
    }
}

/// A step being planned: the running set, the queue and the pool, with the operations a
/// [`Scheduler`] builds a step from. Indices into the running set are by priority band (higher
/// first), then oldest admission first; preemption takes the last. An admission joins at its
/// band's end, so the indices of sequences of lower bands move up by one.
pub struct StepPlan<'e> {
    /// The engine whose step this is (its scheduler is out of it while the plan is made).
    e: &'e mut Engine,
    budget: usize,
    /// Under a step target: the time the step has left.
    time: Option<TimeLeft>,
    planned: Vec<(usize, usize)>,
    /// Per running sequence, whether it is in `planned`.
    in_plan: Vec<bool>,
    /// Blocks the running sequences need to grow a while (computed at the first admission after
    /// the running set or its reservations last changed).
    headroom: Option<usize>,
}

impl<'e> StepPlan<'e> {
    pub(super) fn new(e: &'e mut Engine) -> Self {
        let (budget, time) = e.step_budget();
        Self {
            budget,
            time,
            in_plan: vec![false; e.running.len()],
            e,
            planned: Vec::new(),
            headroom: None,
        }
    }

    /// The step's work: `(index into running, new tokens)`, in the order it was planned.
    pub(super) fn into_planned(self) -> Vec<(usize, usize)> {
        self.planned
    }

    /// Tokens the step may still take: the step's budget (`max_batched_tokens`, or less under a
    /// step target) less what was planned (the tokens of a planned sequence that was then
    /// preempted stay spent).
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Sequences running (admitted, holding blocks).
    pub fn running_len(&self) -> usize {
        self.e.running.len()
    }

    /// The running sequence at `i` (higher bands first, then oldest admission first).
    pub fn running(&self, i: usize) -> SeqInfo {
        SeqInfo::of(&self.e.running[i])
    }

    /// Whether `running(i)` is in the plan already.
    pub fn is_planned(&self, i: usize) -> bool {
        self.in_plan[i]
    }

    /// The queue, head first: higher bands first, and within a band the sequences that held
    /// blocks (preempted) first, then by arrival.
    pub fn waiting(&self) -> impl Iterator<Item = SeqInfo> + '_ {
        self.e.waiting.iter().map(SeqInfo::of)
    }

    /// The engine's prompt order (its configuration's).
    pub fn prefill_order(&self) -> PrefillOrder {
        self.e.config.prefill_order
    }

    /// Plans the next chunk of `running(i)`: its pending tokens, as many as the budget allows
    /// (and under a step target, as fit in the step's time left; see `EngineConfig::step_target`).
    /// Where the pool is short, the newest running sequences are preempted (out of the plan too,
    /// if they were in it) until it fits. False when `running(i)` itself had to go, and with it
    /// every sequence after it: the running set then ends before `i`. Nothing is planned when
    /// the budget is spent or `i` is planned already.
    ///
    /// A decoding sequence with a proposal (speculation) runs its last token and as much of the
    /// proposal as the budget allows (a step target does not cut it: the proposal was sized by
    /// the same measure of the steps).
    pub fn run(&mut self, i: usize) -> bool {
        let s = &self.e.running[i];
        let take = if s.pending() == 1 && !s.draft.is_empty() {
            (1 + s.draft.len()).min(self.budget)
        } else {
            Self::chunk_of(self.budget, self.time, s.computed, s.pending())
        };
        if take == 0 || self.is_planned(i) {
            return true;
        }
        if !self.make_room(i, take) {
            return false;
        }
        let s = &mut self.e.running[i];
        s.draft.truncate(take.saturating_sub(s.pending()));
        let computed = s.computed;
        self.charge(computed, take);
        self.planned.push((i, take));
        self.in_plan[i] = true;
        self.budget -= take;
        // Its reservation changed what the pool holds and what it still needs.
        self.headroom = None;
        true
    }

    /// Admits the head of the queue with its first chunk (after taking over its longest cached
    /// prefix), if the budget, `max_seqs` and the pool allow it: the pool must hold its growth
    /// and the running sequences' growth for a while (`admission_lookahead`), since admitting
    /// into that headroom only buys a preemption later. A request with parallel samples is
    /// admitted with room for all of them (alone, it is admitted anyway: otherwise it would never
    /// run), and so is anything when nothing runs. False when nothing was admitted: the head
    /// keeps its place.
    pub fn admit(&mut self) -> bool {
        self.admit_at(0)
    }

    /// Admits the queue's `j`-th sequence as [`StepPlan::admit`] admits the head; each sequence
    /// before it counts one more pass ([`SeqInfo::passed`]). False when nothing was admitted
    /// (or there is no `j`-th): every sequence keeps its place.
    pub fn admit_at(&mut self, j: usize) -> bool {
        if self.budget == 0 || self.e.running.len() >= self.e.config.max_seqs {
            return false;
        }
        let (block_size, lookahead, max_ctx) = (
            self.e.config.block_size,
            self.e.config.admission_lookahead,
            self.e.backend.config().max_position_embeddings,
        );
        let headroom = *self.headroom.get_or_insert_with(|| {
            self.e
                .running
                .iter()
                .map(|r| r.growth_blocks(block_size, lookahead, max_ctx))
                .sum()
        });
        let Some(s) = self.e.waiting.get_mut(j) else {
            return false;
        };
        if !self.e.running.is_empty() && self.e.running.len() + s.width() > self.e.config.max_seqs {
            return false;
        }
        let mut hit = 0;
        if self.e.config.prefix_caching && s.blocks.is_empty() {
            // (A handed-off sequence's parked tail too: a peer pulling it from here.)
            hit = s.blocks.reuse_prefix_and_tail(&s.tokens);
            s.computed = hit;
        }
        let take = Self::chunk_of(self.budget, self.time, s.computed, s.pending());
        let own = s.growth_blocks(block_size, lookahead, max_ctx);
        let fits = self.e.running.is_empty() || self.e.blocks.available() >= own + headroom;
        // A parked tail taken is shared: the step writes a copy of it.
        let copy = match fits && take > 0 && s.blocks.reserve(s.computed + take) {
            true => s.blocks.make_writable(s.computed),
            false => Err(PoolFull),
        };
        let copy = match copy {
            Ok(copy) => copy,
            Err(PoolFull) => {
                // Not now: give the reused blocks back (they stay cached) and keep its place.
                s.blocks.clear();
                s.computed = 0;
                return false;
            }
        };
        self.e.copies.extend(copy);
        self.e.stats.prefix_lookup_tokens += s.tokens.len() as u64;
        self.e.stats.prefix_hit_tokens += hit as u64;
        let mut s = self.e.waiting.remove(j).expect("j-th exists");
        if s.admitted.is_none() && s.tokens.len() > s.prompt_len {
            // Resumed after a move, its K/V computed here from what this worker holds.
            self.e.stats.resumed.add(s.tokens.len(), hit);
        }
        self.charge(s.computed, take);
        for passed in self.e.waiting.iter_mut().take(j) {
            passed.passed += 1;
        }
        s.cached_prompt_tokens.get_or_insert(hit.min(s.prompt_len));
        s.admitted.get_or_insert_with(Instant::now);
        self.headroom = Some(headroom + s.growth_blocks(block_size, lookahead, max_ctx));
        // At its band's end of the running set (the set stays ordered by band, so preemption,
        // which takes the last, takes a lower band first): what was planned after it moves up.
        let at = self.e.run_seq(s);
        for (p, _) in &mut self.planned {
            if *p >= at {
                *p += 1;
            }
        }
        self.planned.push((at, take));
        self.in_plan.insert(at, true);
        self.budget -= take;
        true
    }

    /// Tokens to plan of a sequence with `cached` tokens cached and `pending` to compute: all
    /// of them within the budget; under a step target, a decode's one token always, a prompt
    /// chunk what fits in the time left or the floor's prompt tokens, whichever is more.
    fn chunk_of(budget: usize, time: Option<TimeLeft>, cached: usize, pending: usize) -> usize {
        let most = pending.min(budget);
        match time {
            Some(t) if pending > 1 => t
                .cost
                .tokens_within(cached, most, t.left)
                .max(t.floor.min(most)),
            _ => most,
        }
    }

    /// Counts `take` planned tokens of a sequence with `cached` cached against the step's time.
    fn charge(&mut self, cached: usize, take: usize) {
        if let Some(t) = &mut self.time {
            t.left -= t.cost.seconds(cached, take);
            if take > 1 {
                t.floor = t.floor.saturating_sub(take);
            }
        }
    }

    /// Ensures `running[i]` has blocks for `take` more tokens (its own copy of a block it shares
    /// where it writes), preempting the newest running sequences. False if `running[i]` itself
    /// had to go.
    fn make_room(&mut self, i: usize, take: usize) -> bool {
        loop {
            let s = &mut self.e.running[i];
            if s.blocks.reserve(s.computed + take) {
                // The step writes from `computed` on: a block there that a parallel sample
                // shares is copied first (the rest of the range is in blocks just reserved).
                match s.blocks.make_writable(s.computed) {
                    Ok(Some(copy)) => {
                        self.e.copies.push(copy);
                        return true;
                    }
                    Ok(None) => return true,
                    Err(PoolFull) => {}
                }
            }
            // The newest sequence goes. It may be planned already: a sequence that joined
            // decoding after `i` was admitted (a remote prefill that arrived, a forked sample)
            // is planned in the decode pass before `i`'s prompt chunk. It is the last index, so
            // taking it out of the plan leaves every other index as it was.
            let victim = self.e.running.len() - 1;
            // (Its tokens stay spent from the budget: the step is planned as it was.)
            self.planned.retain(|&(p, _)| p != victim);
            self.in_plan.pop();
            self.preempt(victim);
            if victim == i {
                return false;
            }
        }
    }

    /// Releases a running sequence's blocks and puts it at the head of the queue.
    fn preempt(&mut self, i: usize) {
        let mut s = self.e.running.remove(i);
        s.blocks.clear();
        s.computed = 0;
        s.draft.clear();
        s.preemptions += 1;
        self.e.stats.preemptions += 1;
        self.headroom = None;
        tracing::debug!(request = s.id.0, tokens = s.tokens.len(), "preempted");
        self.e.queue_front(s);
    }
}

/// Iteration-level batching with chunked prefill (the default): every step, one token for each
/// decoding sequence, oldest first; then the rest of the budget to prompt chunks (partly
/// computed prompts and recomputes first, then new sequences from the queue), in the engine's
/// [`PrefillOrder`]: arrival (the head of the queue, never skipped) or shortest remaining first
/// (a prompt passed over [`MAX_PASSED`] times goes first).
#[derive(Clone, Copy, Debug, Default)]
pub struct Continuous;

impl Continuous {
    /// Plans every running sequence, decodes first (oldest first), then prompt chunks (oldest
    /// first, or fewest tokens left first under [`PrefillOrder::Shortest`]), within the budget.
    pub fn run_running(plan: &mut StepPlan<'_>) {
        let mut i = 0;
        while i < plan.running_len() && plan.budget() > 0 {
            if plan.running(i).decoding() && !plan.run(i) {
                // `i` itself was preempted: the sequences after it were preempted first,
                // so nothing after it is left.
                break;
            }
            i += 1;
        }
        let mut prompts: Vec<usize> = (0..plan.running_len())
            .filter(|&i| !plan.running(i).decoding())
            .collect();
        if plan.prefill_order() == PrefillOrder::Shortest {
            prompts.sort_by_key(|&i| (plan.running(i).pending(), i));
        }
        for i in prompts {
            if plan.budget() == 0 {
                break;
            }
            // A preemption takes the newest sequences (when `run` says `i` went, everything
            // admitted after it went first): what went is past the running set's end, and the
            // earlier prompts may still fit.
            if i < plan.running_len() {
                plan.run(i);
            }
        }
    }

    /// Admits from the queue while the plan allows: the head each time, or under
    /// [`PrefillOrder::Shortest`] the sequence [`Continuous::next_shortest`] picks. Stops at the
    /// first that cannot be admitted (it keeps its turn).
    pub fn admit_all(plan: &mut StepPlan<'_>) {
        loop {
            let j = match plan.prefill_order() {
                PrefillOrder::Arrival => 0,
                PrefillOrder::Shortest => match Self::next_shortest(plan.waiting()) {
                    Some(j) => j,
                    None => return,
                },
            };
            if !plan.admit_at(j) {
                return;
            }
        }
    }

    /// Which waiting sequence goes next in shortest-first order: a preempted one (it held
    /// blocks and has tokens out, so it resumes first, in queue order), then one passed over
    /// [`MAX_PASSED`] times (queue order), then the fewest tokens to compute (the earlier on a
    /// tie).
    pub fn next_shortest(waiting: impl Iterator<Item = SeqInfo>) -> Option<usize> {
        waiting
            .enumerate()
            .min_by_key(|(j, s)| (s.preemptions == 0, s.passed < MAX_PASSED, s.pending(), *j))
            .map(|(j, _)| j)
    }
}

/// Under [`PrefillOrder::Shortest`], how many later prompts may be admitted before a waiting
/// one: then it goes first. With 8 requests in flight a prompt waits behind at most this many
/// shorter ones (about four rounds of the running set).
pub const MAX_PASSED: u32 = 32;

impl Scheduler for Continuous {
    fn name(&self) -> &'static str {
        "continuous"
    }

    fn schedule(&mut self, plan: &mut StepPlan<'_>) {
        Self::run_running(plan);
        Self::admit_all(plan);
    }
}

/// Prompt tokens a step may always take beside its decodes, whatever a step target says: prompts
/// keep moving when decodes alone fill the target.
pub const MIN_PREFILL_CHUNK: usize = 64;

/// Prompt tokens a step with decoding sequences may always take under an ITL target
/// (`EngineConfig::itl_target`); the router's disaggregation threshold plans by it too.
pub use tandem_types::MIN_ITL_PREFILL_CHUNK;

/// A step's budget before any step was measured, under a step target.
const FIRST_STEP_TOKENS: usize = 256;

/// What a step costs on this engine, learned from the steps it ran: seconds ≈ `fixed` +
/// `per_token` × tokens + `per_key` × attended keys (a row at position p attends p + 1 keys),
/// fitted by least squares with each step's weight decaying by [`StepCost::DECAY`] per later
/// step (the recent steps count most, so the fit follows the machine's load). The fixed part
/// is what a step costs whatever its size (reading the weights, sampling), the per-token part
/// the rows' products, the per-key part attention over their context.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepCost {
    w: f64,
    /// Weighted sums of tokens (t), keys (k), seconds (y) and their products.
    t: f64,
    k: f64,
    y: f64,
    tt: f64,
    tk: f64,
    kk: f64,
    ty: f64,
    ky: f64,
    /// The last fit that told the fixed part from the rows' ([`StepCost::parts_within`]), and
    /// the steps recorded since.
    parts: Option<Cost>,
    since_parts: u32,
}

/// A fitted [`StepCost`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    /// Seconds a step costs whatever it holds.
    pub fixed: f64,
    /// Seconds per token computed.
    pub per_token: f64,
    /// Seconds per key attended.
    pub per_key: f64,
}

impl Cost {
    /// Seconds `n` new tokens of a sequence with `cached` tokens in the cache add to a step.
    pub fn seconds(&self, cached: usize, n: usize) -> f64 {
        let (p, n) = (cached as f64, n as f64);
        self.per_token * n + self.per_key * (n * p + n * (n + 1.0) / 2.0)
    }

    /// The most new tokens (at most `most`) of a sequence with `cached` cached that fit in
    /// `seconds`.
    pub fn tokens_within(&self, cached: usize, most: usize, seconds: f64) -> usize {
        if seconds <= 0.0 || most == 0 {
            return 0;
        }
        // per_key/2 n² + (per_token + per_key (p + 1/2)) n = seconds, for n.
        let (a, b) = (
            self.per_key / 2.0,
            self.per_token + self.per_key * (cached as f64 + 0.5),
        );
        let n = if a * most as f64 <= 1e-6 * b {
            seconds / b
        } else {
            (-b + (b * b + 4.0 * a * seconds).sqrt()) / (2.0 * a)
        };
        // (A millionth of a token over: a quotient that is whole but for rounding stays whole.)
        ((n + 1e-6).floor().max(0.0) as usize).min(most)
    }
}

impl StepCost {
    /// A step's weight a step later.
    pub const DECAY: f64 = 0.95;

    /// Records a step of `tokens` tokens attending `keys` keys that took `seconds`.
    pub fn record(&mut self, tokens: usize, keys: u64, seconds: f64) {
        if tokens == 0 || !(seconds.is_finite() && seconds >= 0.0) {
            return;
        }
        let (t, k, y, d) = (tokens as f64, keys as f64, seconds, Self::DECAY);
        self.w = self.w * d + 1.0;
        self.t = self.t * d + t;
        self.k = self.k * d + k;
        self.y = self.y * d + y;
        self.tt = self.tt * d + t * t;
        self.tk = self.tk * d + t * k;
        self.kk = self.kk * d + k * k;
        self.ty = self.ty * d + t * y;
        self.ky = self.ky * d + k * y;
        match self.fit().filter(|c| c.fixed > 0.0) {
            Some(c) => (self.parts, self.since_parts) = (Some(c), 0),
            None => self.since_parts = self.since_parts.saturating_add(1),
        }
    }

    /// The fitted cost with its fixed part told from the rows': the fit where the recent
    /// steps tell them apart, else the last fit that did, if that was at most `steps` steps
    /// ago (steps all of one size, as a worker decoding a steady batch runs them, do not tell
    /// the parts apart); None before any fit did. (A policy that sizes steps by the parts
    /// and takes what it is offered without them varies the steps' sizes, and the fit tells
    /// the parts again: so parts learned under another load, where a step's rows cost
    /// otherwise, do not hold it for good.)
    pub fn parts_within(&self, steps: u32) -> Option<Cost> {
        self.parts.filter(|_| self.since_parts <= steps)
    }

    /// The fitted cost, once a step was recorded. Where the recent steps do not tell the parts
    /// apart, fewer parts: keys that move with tokens (or not at all) leave the line in tokens;
    /// steps all about one size leave all of the cost per token (an overestimate for larger
    /// steps, so a budget from it errs short).
    pub fn fit(&self) -> Option<Cost> {
        if self.w == 0.0 {
            return None;
        }
        let w = self.w;
        let (mt, mk, my) = (self.t / w, self.k / w, self.y / w);
        let vt = self.tt / w - mt * mt;
        let vk = self.kk / w - mk * mk;
        let ctk = self.tk / w - mt * mk;
        let cty = self.ty / w - mt * my;
        let cky = self.ky / w - mk * my;
        // Both parts: tokens and keys must vary, and not (nearly) together.
        let spread = vt > (0.1 * mt).powi(2);
        let det = vt * vk - ctk * ctk;
        if spread && vk > 0.0 && det > 0.01 * vt * vk {
            let per_token = (cty * vk - cky * ctk) / det;
            let per_key = (cky * vt - cty * ctk) / det;
            let fixed = my - per_token * mt - per_key * mk;
            if per_token >= 0.0 && per_key >= 0.0 && fixed >= 0.0 {
                return Some(Cost {
                    fixed,
                    per_token,
                    per_key,
                });
            }
        }
        if spread && cty > 0.0 {
            let per_token = cty / vt;
            let fixed = my - per_token * mt;
            if fixed >= 0.0 {
                return Some(Cost {
                    fixed,
                    per_token,
                    per_key: 0.0,
                });
            }
        }
        Some(Cost {
            fixed: 0.0,
            per_token: my / mt,
            per_key: 0.0,
        })
    }
}

/// A step's time under a step target, as it is planned.
#[derive(Clone, Copy, Debug)]
struct TimeLeft {
    cost: Cost,
    /// Seconds of the target not yet planned (negative once over).
    left: f64,
    /// Prompt tokens the step may still take whatever the time says ([`MIN_PREFILL_CHUNK`]).
    floor: usize,
}

impl Engine {
    /// The next step's token budget and, under a step target with a measured cost, its time:
    /// `max_batched_tokens`, or before any step was measured `FIRST_STEP_TOKENS` with room for
    /// every decoding sequence and [`MIN_PREFILL_CHUNK`] prompt tokens.
    ///
    /// With an ITL target and a decoding sequence running, the step's time is the shorter of
    /// the two targets and its prompt floor [`MIN_ITL_PREFILL_CHUNK`].
    fn step_budget(&self) -> (usize, Option<TimeLeft>) {
        let max = self.config.max_batched_tokens;
        let decoding = self.running.iter().filter(|s| s.pending() == 1).count();
        let (target, floor, whole) = match (self.config.step_target, self.config.itl_target) {
            (step, Some(itl)) if decoding > 0 => (
                Some(step.map_or(itl, |s| s.min(itl))),
                MIN_ITL_PREFILL_CHUNK,
                0,
            ),
            (step, _) => (step, MIN_PREFILL_CHUNK, self.config.step_target_whole),
        };
        let Some(target) = target else {
            return (max, None);
        };
        match self.step_cost.fit() {
            Some(cost) => {
                // The time `whole` prompt tokens take beside the decodes, if that is longer.
                let step = match whole {
                    0 => 0.0,
                    n => {
                        let decodes: f64 = (self.running.iter())
                            .filter(|s| s.pending() == 1)
                            .map(|s| cost.seconds(s.computed, 1))
                            .sum();
                        cost.seconds(0, n) + decodes
                    }
                };
                let left = (target.as_secs_f64() - cost.fixed).max(step);
                (max, Some(TimeLeft { cost, left, floor }))
            }
            None => {
                let first = FIRST_STEP_TOKENS.max(decoding + floor);
                (first.min(max), None)
            }
        }
    }
}

/// Static batching: the first `size` requests of the queue form a batch, which runs (chunked
/// prefill, decodes first, as [`Continuous`] runs it) until every sequence of it is done; only
/// then is the next batch formed. A finished member's slot stays empty, and the batch waits for
/// its longest member. Size 1 serves one request at a time.
#[derive(Clone, Debug)]
pub struct StaticBatches {
    size: usize,
    members: Vec<RequestId>,
}

impl StaticBatches {
    /// Batches of `size` requests (at least one).
    pub fn new(size: usize) -> Self {
        Self {
            size: size.max(1),
            members: Vec::new(),
        }
    }
}

impl Scheduler for StaticBatches {
    fn name(&self) -> &'static str {
        "static"
    }

    fn schedule(&mut self, plan: &mut StepPlan<'_>) {
        let members = &self.members;
        let alive = (0..plan.running_len())
            .map(|i| plan.running(i).id)
            .chain(plan.waiting().map(|s| s.id))
            .any(|id| members.contains(&id));
        if !alive {
            // A new batch: what runs already (when this policy took over mid-flight), then the
            // head of the queue up to the batch's size.
            let mut next: Vec<RequestId> = Vec::with_capacity(self.size);
            for id in (0..plan.running_len()).map(|i| plan.running(i).id) {
                if !next.contains(&id) {
                    next.push(id);
                }
            }
            for s in plan.waiting() {
                if next.len() >= self.size {
                    break;
                }
                if !next.contains(&s.id) {
                    next.push(s.id);
                }
            }
            self.members = next;
        }
        Continuous::run_running(plan);
        // Members wait at the head of the queue: they were its first when the batch was formed,
        // later requests queue behind them, and preempted ones go back to the head. Should the
        // head be no member with nothing running (a sequence that joined from elsewhere, then
        // was preempted), it joins the batch: the engine never idles with work queued.
        loop {
            let Some(head) = plan.waiting().next() else {
                break;
            };
            let member = self.members.contains(&head.id);
            if !member && plan.running_len() > 0 {
                break;
            }
            if !plan.admit() {
                break;
            }
            if !member {
                self.members.push(head.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::tests::{config, engine, req};
    use crate::engine::{EngineConfig, Event, Finished, PrefillOrder, Request};

    /// A test policy: admits everything it can, then runs only the newest running sequence
    /// (last in, first out), and records the running set it saw at each step.
    #[derive(Default)]
    struct NewestOnly {
        seen: std::sync::Arc<std::sync::Mutex<Vec<Vec<SeqInfo>>>>,
    }

    impl Scheduler for NewestOnly {
        fn name(&self) -> &'static str {
            "newest-only"
        }

        fn schedule(&mut self, plan: &mut StepPlan<'_>) {
            let running = (0..plan.running_len()).map(|i| plan.running(i)).collect();
            self.seen.lock().unwrap().push(running);
            if plan.running_len() == 0 {
                while plan.admit() {}
                return;
            }
            let newest = plan.running_len() - 1;
            assert!(plan.run(newest), "the pool has room");
        }
    }

    /// Three greedy requests of different prompts, each generating `out` tokens.
    fn three(out: u32) -> Vec<Request> {
        vec![
            req(vec![3, 4, 5, 6, 7], out),
            req(vec![8, 9, 10], out),
            req(vec![11, 12, 13, 14], out),
        ]
    }

    /// Runs `requests` to the end under `scheduler`: the outputs, and every event as
    /// `(request, finished?)` in the order the steps gave them.
    fn serve(
        scheduler: Box<dyn Scheduler>,
        requests: Vec<Request>,
    ) -> (Vec<Finished>, Vec<(u64, bool)>) {
        serve_with(config(), scheduler, requests)
    }

    fn serve_with(
        cfg: EngineConfig,
        scheduler: Box<dyn Scheduler>,
        requests: Vec<Request>,
    ) -> (Vec<Finished>, Vec<(u64, bool)>) {
        let mut e = engine(cfg);
        e.set_scheduler(scheduler);
        let mut order = Vec::new();
        for (i, r) in requests.into_iter().enumerate() {
            e.add(RequestId(i as u64), r).unwrap();
        }
        let mut done = Vec::new();
        while e.has_work() {
            for ev in e.step().unwrap().0 {
                match ev {
                    Event::Token(t) => order.push((t.request.0, false)),
                    Event::Finished(f) => {
                        order.push((f.request.0, true));
                        done.push(f);
                    }
                    Event::Kv(_) => unreachable!("no prefill-mode requests"),
                }
            }
        }
        done.sort_by_key(|f| f.request);
        let st = e.stats();
        assert_eq!((st.blocks_used, st.running, st.waiting), (0, 0, 0));
        (done, order)
    }

    /// Output tokens and their logprobs' bits, per request.
    fn bits(done: &[Finished]) -> Vec<(Vec<u32>, Vec<u32>)> {
        done.iter()
            .map(|f| {
                let lp = f.logprobs.iter().map(|l| l.to_bits()).collect();
                (f.output_ids.clone(), lp)
            })
            .collect()
    }

    #[test]
    fn the_engine_runs_what_the_scheduler_plans_and_nothing_else() {
        let seen = std::sync::Arc::default();
        let fake = NewestOnly {
            seen: std::sync::Arc::clone(&seen),
        };
        let (done, order) = serve(Box::new(fake), three(3));
        // One step admits all three (each samples its first token); then only the newest runs
        // until it finishes, then the one before it.
        let want: Vec<(u64, bool)> = vec![
            (0, false),
            (1, false),
            (2, false),
            (2, false),
            (2, false),
            (2, true),
            (1, false),
            (1, false),
            (1, true),
            (0, false),
            (0, false),
            (0, true),
        ];
        assert_eq!(order, want);
        let seen = seen.lock().unwrap();
        let ids: Vec<Vec<u64>> = seen
            .iter()
            .map(|r| r.iter().map(|s| s.id.0).collect())
            .collect();
        assert_eq!(
            ids,
            [
                vec![],
                vec![0, 1, 2],
                vec![0, 1, 2],
                vec![0, 1],
                vec![0, 1],
                vec![0],
                vec![0]
            ]
        );
        // What the policy read of a sequence is what it is: after the admitting step, request
        // 2 (prompt 4 tokens) holds its prompt and first token, with the prompt computed.
        let s = seen[1][2];
        assert_eq!(
            (s.len, s.prompt_len, s.computed, s.pending(), s.width),
            (5, 4, 4, 1, 1)
        );
        assert!(s.decoding());
        // Whatever the order, each sequence's bits are its own.
        let (continuous, _) = serve(Box::new(Continuous), three(3));
        assert_eq!(bits(&done), bits(&continuous));
    }

    #[test]
    fn a_static_batch_takes_no_one_in_until_all_of_it_is_done() {
        let (done, order) = serve(Box::new(StaticBatches::new(2)), three(3));
        // Request 2 draws nothing until both of the first batch have finished.
        let first_of_2 = order.iter().position(|&(r, _)| r == 2).unwrap();
        let done_before: Vec<u64> = order[..first_of_2]
            .iter()
            .filter(|e| e.1)
            .map(|e| e.0)
            .collect();
        assert_eq!(done_before, [0, 1]);
        assert_eq!(order.len(), 12, "three tokens and an end each");
        // One at a time: each request is served whole before the next starts.
        let (one, order) = serve(Box::new(StaticBatches::new(1)), three(3));
        let runs: Vec<u64> = order.iter().map(|e| e.0).collect();
        assert_eq!(runs, [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]);
        // The schedule changes when a sequence runs, never its bits.
        let (continuous, order) = serve(Box::new(Continuous), three(3));
        assert_eq!(&order[..3], [(0, false), (1, false), (2, false)]);
        assert_eq!(bits(&done), bits(&continuous));
        assert_eq!(bits(&one), bits(&continuous));
    }

    /// Switched to mid-flight, over a pool so small that sequences are preempted: what ran
    /// under the old policy is part of the first batch (were the batch only the waiting one, a
    /// preempted sequence at the head would wait behind it forever), and everything finishes as
    /// it would have.
    #[test]
    fn static_batches_taking_over_mid_flight_finish_everything() {
        let cfg = EngineConfig {
            block_size: 4,
            num_blocks: Some(12),
            admission_lookahead: 0,
            max_seqs: 4,
            ..config()
        };
        // Four run when the policy changes, the fifth waits.
        let requests = || {
            (0..5u32)
                .map(|i| req(vec![3 + i, 4, 5, 6, 7, 8], 12))
                .collect::<Vec<_>>()
        };
        let mut e = engine(cfg.clone());
        for (i, r) in requests().into_iter().enumerate() {
            e.add(RequestId(i as u64), r).unwrap();
        }
        let mut done = Vec::new();
        for _ in 0..2 {
            done.extend(e.step().unwrap().0);
        }
        let st = e.stats();
        assert_eq!((st.running, st.waiting), (4, 1), "before the switch");
        e.set_scheduler(Box::new(StaticBatches::new(1)));
        assert_eq!(e.scheduler_name(), "static");
        let mut steps = 0;
        while e.has_work() {
            done.extend(e.step().unwrap().0);
            steps += 1;
            assert!(steps < 1000, "no progress");
        }
        let mut finished: Vec<Finished> = done
            .into_iter()
            .filter_map(|ev| match ev {
                Event::Finished(f) => Some(f),
                _ => None,
            })
            .collect();
        finished.sort_by_key(|f| f.request);
        assert!(e.stats().preemptions > 0, "the pool was short");
        let (alone, _) = serve(Box::new(Continuous), requests());
        assert_eq!(bits(&finished), bits(&alone));
        assert_eq!(e.stats().blocks_used, 0);
    }

    #[test]
    fn a_static_batch_counts_a_request_once_whatever_its_samples() {
        // Request 0 has three parallel samples: it and request 1 make one batch of two.
        let mut wide = three(2);
        wide[0].samples.count = 3;
        let (done, order) = serve(Box::new(StaticBatches::new(2)), wide);
        assert_eq!(done.len(), 5);
        let first_of_2 = order.iter().position(|&(r, _)| r == 2).unwrap();
        let ends_before = order[..first_of_2].iter().filter(|e| e.1).count();
        assert_eq!(ends_before, 4, "three samples of request 0 and request 1");
    }

    /// A waiting sequence as a policy sees it: `pending` tokens to compute.
    fn waiting(pending: usize, preemptions: u32, passed: u32) -> SeqInfo {
        SeqInfo {
            id: RequestId(0),
            index: 0,
            len: pending,
            prompt_len: pending,
            computed: 0,
            width: 1,
            preemptions,
            passed,
            priority: 0,
        }
    }

    #[test]
    fn shortest_first_picks_preempted_then_long_passed_then_fewest_tokens() {
        let pick = |w: &[SeqInfo]| Continuous::next_shortest(w.iter().copied());
        assert_eq!(pick(&[]), None);
        assert_eq!(
            pick(&[waiting(9, 0, 0), waiting(3, 0, 0), waiting(6, 0, 0)]),
            Some(1)
        );
        // A tie goes to the earlier.
        assert_eq!(
            pick(&[waiting(9, 0, 0), waiting(3, 0, 0), waiting(3, 0, 0)]),
            Some(1)
        );
        // Preempted first, whatever its length.
        assert_eq!(pick(&[waiting(3, 0, 0), waiting(90, 1, 0)]), Some(1));
        // Passed over MAX_PASSED times: next, before shorter ones; one pass fewer: not yet.
        assert_eq!(
            pick(&[waiting(900, 0, MAX_PASSED), waiting(3, 0, 0)]),
            Some(0)
        );
        assert_eq!(
            pick(&[waiting(900, 0, MAX_PASSED - 1), waiting(3, 0, 0)]),
            Some(1)
        );
    }

    #[test]
    fn shortest_first_serves_the_short_prompt_first_and_counts_the_passes() {
        // Budget 4: one prompt chunk a step. Prompts of 9, 3 and 6 tokens.
        let cfg = EngineConfig {
            max_batched_tokens: 4,
            prefill_order: PrefillOrder::Shortest,
            ..config()
        };
        let requests = || {
            vec![
                req((3..12).collect(), 2),
                req(vec![20, 21, 22], 2),
                req((30..36).collect(), 2),
            ]
        };
        let first_tokens = |order: &[(u64, bool)]| {
            let mut firsts = Vec::new();
            for &(r, _) in order {
                if !firsts.contains(&r) {
                    firsts.push(r);
                }
            }
            firsts
        };
        let (short, order) = serve_with(cfg.clone(), Box::new(Continuous), requests());
        assert_eq!(first_tokens(&order), [1, 2, 0]);
        let arrival = EngineConfig {
            prefill_order: PrefillOrder::Arrival,
            ..cfg.clone()
        };
        let (fcfs, order) = serve_with(arrival, Box::new(Continuous), requests());
        assert_eq!(first_tokens(&order), [0, 1, 2]);
        assert_eq!(bits(&short), bits(&fcfs), "the order changes no bits");

        // The passes: the first step admits request 1 (3 tokens) and, with the budget's last
        // token, request 2's first chunk; each passes request 0, ahead of them in the queue.
        let mut e = engine(cfg);
        for (i, r) in requests().into_iter().enumerate() {
            e.add(RequestId(i as u64), r).unwrap();
        }
        e.step().unwrap();
        let queue: Vec<(u64, u32)> = e.waiting.iter().map(|s| (s.id.0, s.passed)).collect();
        assert_eq!(queue, [(0, 2)]);
        let running: Vec<u64> = e.running.iter().map(|s| s.id.0).collect();
        assert_eq!(running, [1, 2]);
    }

    /// Attended keys of `n` new tokens after `p` cached.
    fn keys(p: usize, n: usize) -> u64 {
        (n * p + n * (n + 1) / 2) as u64
    }

    #[test]
    fn a_step_cost_fit_recovers_its_parts_and_follows_a_change() {
        let mut c = StepCost::default();
        assert_eq!(c.fit(), None);
        // 20 ms a step, 1 ms a token, 1 us a key: decode steps of 8 rows over long contexts and
        // prompt chunks at several depths.
        let truth = |t: usize, k: u64| 0.020 + 0.001 * t as f64 + 1e-6 * k as f64;
        let steps = [
            (8, 8 * 500),
            (200, keys(0, 200)),
            (64, keys(1000, 64)),
            (8, 8 * 2000),
            (300, keys(300, 300)),
            (1, 900),
            (128, keys(0, 128)),
        ];
        for &(t, k) in &steps {
            c.record(t, k, truth(t, k));
        }
        let f = c.fit().unwrap();
        assert!((f.fixed - 0.020).abs() < 1e-9, "{f:?}");
        assert!((f.per_token - 0.001).abs() < 1e-11, "{f:?}");
        assert!((f.per_key - 1e-6).abs() < 1e-13, "{f:?}");
        // Keys that move with tokens: the line in tokens.
        let mut line = StepCost::default();
        for t in [1usize, 8, 200, 64, 300] {
            line.record(t, 10 * t as u64, 0.020 + 0.001 * t as f64);
        }
        let f = line.fit().unwrap();
        assert_eq!(f.per_key, 0.0);
        assert!((f.fixed - 0.020).abs() < 1e-9 && (f.per_token - 0.001).abs() < 1e-12);
        // All one size: the cost counts as all per token.
        let mut one = StepCost::default();
        for _ in 0..5 {
            one.record(100, 5050, 0.2);
        }
        assert_eq!(
            one.fit(),
            Some(Cost {
                fixed: 0.0,
                per_token: 0.002,
                per_key: 0.0
            })
        );
        assert_eq!(
            one.parts_within(u32::MAX),
            None,
            "no fit told the parts apart"
        );
        // Steps of several sizes, then only one size: once the fit loses the parts, the last
        // fit that told them apart stands for as many steps as asked, and then no longer; a
        // step of another size and the fit tells them again.
        let mut steady = StepCost::default();
        for t in [1usize, 2, 4, 8, 3, 6] {
            steady.record(t, 0, 0.020 + 0.001 * t as f64);
        }
        let told = steady.parts_within(0).unwrap();
        assert!((told.fixed - 0.020).abs() < 1e-9, "{told:?}");
        let mut n = 0;
        while steady.fit().unwrap().fixed > 0.0 {
            steady.record(8, 0, 0.028);
            n += 1;
            assert!(n < 1000, "the fit never lost its parts");
        }
        for _ in 1..32 {
            steady.record(8, 0, 0.028);
        }
        let kept = steady.parts_within(32).unwrap();
        assert!((kept.fixed - 0.020).abs() < 1e-6, "{kept:?}");
        assert!((kept.per_token - 0.001).abs() < 1e-6, "{kept:?}");
        assert_eq!(steady.parts_within(31), None);
        assert_eq!(steady.parts_within(u32::MAX), Some(kept));
        steady.record(1, 0, 0.021);
        let again = steady.parts_within(0).unwrap();
        assert!((again.fixed - 0.020).abs() < 1e-6, "{again:?}");
        // The machine gets twice as slow: after a hundred steps the fit says so.
        for i in 0..100 {
            let (t, k) = steps[i % steps.len()];
            c.record(t, k, 2.0 * truth(t, k));
        }
        let f = c.fit().unwrap();
        assert!((f.fixed - 0.040).abs() < 1e-3, "{f:?}");
        assert!((f.per_token - 0.002).abs() < 1e-5, "{f:?}");
        assert!((f.per_key - 2e-6).abs() < 1e-7, "{f:?}");
        // Nothing recorded from an empty or unmeasured step.
        let before = c.fit();
        c.record(0, 0, 1.0);
        c.record(10, 55, f64::NAN);
        assert_eq!(c.fit(), before);
    }

    #[test]
    fn the_tokens_within_a_time_are_the_most_that_fit() {
        let flat = Cost {
            fixed: 0.02,
            per_token: 0.001,
            per_key: 0.0,
        };
        assert_eq!(flat.tokens_within(0, 10_000, 0.230), 230);
        assert_eq!(flat.tokens_within(5000, 10_000, 0.230), 230);
        assert_eq!(flat.tokens_within(0, 100, 0.230), 100, "no more than asked");
        assert_eq!(flat.tokens_within(0, 100, -0.1), 0);
        let deep = Cost {
            per_key: 1e-6,
            ..flat
        };
        for cached in [0usize, 100, 1500, 8000] {
            for seconds in [0.001, 0.05, 0.23, 1.0] {
                let n = deep.tokens_within(cached, 100_000, seconds);
                assert!(
                    deep.seconds(cached, n) <= seconds + 1e-12,
                    "{cached} {seconds} {n}"
                );
                assert!(
                    deep.seconds(cached, n + 1) > seconds,
                    "{cached} {seconds} {n}"
                );
            }
        }
        // Deeper in a context, fewer tokens fit.
        assert!(deep.tokens_within(1500, 100_000, 0.23) < deep.tokens_within(0, 100_000, 0.23));
    }

    #[test]
    fn a_step_target_sizes_prompt_chunks_by_time_and_keeps_the_decodes() {
        let target = std::time::Duration::from_millis(250);
        let cfg = EngineConfig {
            max_batched_tokens: 2048,
            step_target: Some(target),
            ..config()
        };
        let cost = |e: &mut Engine, fixed: f64, per_token: f64, per_key: f64| {
            e.step_cost = StepCost::default();
            for (t, k) in [
                (8, 4000),
                (200, keys(0, 200)),
                (64, keys(1000, 64)),
                (1, 900),
            ] {
                let y = fixed + per_token * t as f64 + per_key * k as f64;
                e.step_cost.record(t, k, y);
            }
        };
        // Before any step: FIRST_STEP_TOKENS.
        let mut e = engine(cfg.clone());
        e.add(RequestId(0), req((0..240).map(|t| 3 + t % 90).collect(), 4))
            .unwrap();
        let (_, st) = e.step().unwrap();
        assert_eq!(st.prefill_tokens, 240.min(FIRST_STEP_TOKENS));
        // A prompt chunk after 100 cached tokens: what fits in the 230 ms left.
        let mut e = engine(cfg.clone());
        e.add(RequestId(0), req((0..250).map(|t| 3 + t % 90).collect(), 4))
            .unwrap();
        cost(&mut e, 0.02, 0.001, 0.0);
        let (_, st) = e.step().unwrap();
        assert_eq!(st.prefill_tokens, 230);
        // Attention counted: 1 ms a token and 10 us a key leave 136 tokens in 230 ms
        // (0.001 n + 0.00001 n (n + 1) / 2 <= 0.23).
        let mut e = engine(cfg.clone());
        e.add(RequestId(0), req((0..250).map(|t| 3 + t % 90).collect(), 4))
            .unwrap();
        cost(&mut e, 0.02, 0.001, 1e-5);
        let (_, st) = e.step().unwrap();
        assert_eq!(st.prefill_tokens, 136);
        // Three decoding, a cost that leaves the prompts no time: the decodes and the floor.
        let mut e = engine(cfg.clone());
        for i in 0..3u32 {
            e.add(RequestId(u64::from(i)), req(vec![3 + i, 4], 8))
                .unwrap();
        }
        e.step().unwrap();
        e.add(RequestId(9), req((0..200).map(|t| 3 + t % 90).collect(), 4))
            .unwrap();
        cost(&mut e, 0.3, 0.01, 0.0);
        let (_, st) = e.step().unwrap();
        assert_eq!(
            (st.decode_tokens, st.prefill_tokens),
            (3, MIN_PREFILL_CHUNK)
        );
        // Without a target, max_batched_tokens.
        let mut plain = engine(EngineConfig {
            step_target: None,
            ..cfg
        });
        plain
            .add(RequestId(0), req((0..250).map(|t| 3 + t % 90).collect(), 4))
            .unwrap();
        cost(&mut plain, 0.3, 0.01, 0.0);
        let (_, st) = plain.step().unwrap();
        assert_eq!(st.prefill_tokens, 250);
    }

    /// A step target shorter than `step_target_whole` prompt tokens cost does not cut a prompt
    /// of that many: the step takes as long as they do; a longer prompt's chunk is that many.
    #[test]
    fn a_step_target_leaves_a_short_prompt_whole_on_a_slow_machine() {
        let cfg = |whole| EngineConfig {
            max_batched_tokens: 2048,
            step_target: Some(std::time::Duration::from_millis(250)),
            step_target_whole: whole,
            ..config()
        };
        // 20 ms a step and 3 ms a token: 76 prompt tokens fit in 250 ms, 128 take 384.
        let first_chunk = |whole: usize, prompt: u32, decoding: u32| {
            let mut e = engine(cfg(whole));
            for i in 0..decoding {
                e.add(RequestId(u64::from(i) + 100), req(vec![3 + i, 4], 8))
                    .unwrap();
            }
            if decoding > 0 {
                e.step().unwrap();
            }
            e.add(
                RequestId(0),
                req((0..prompt).map(|t| 3 + t % 90).collect(), 4),
            )
            .unwrap();
            e.step_cost = StepCost::default();
            for t in [8, 200, 64, 1] {
                e.step_cost.record(t, 0, 0.02 + 0.003 * t as f64);
            }
            let (_, st) = e.step().unwrap();
            (st.decode_tokens, st.prefill_tokens)
        };
        assert_eq!(first_chunk(0, 100, 0), (0, 76));
        assert_eq!(first_chunk(128, 100, 0), (0, 100));
        assert_eq!(first_chunk(128, 200, 0), (0, 128));
        // Beside three decodes, the time for 128 prompt tokens and the decodes.
        assert_eq!(first_chunk(128, 200, 3), (3, 128));
        // A target long enough for them: the target's own chunk.
        assert_eq!(first_chunk(50, 200, 0), (0, 76));
    }

    /// Under a step target the step sizes follow the machine, and the bits do not: a run whose
    /// steps were sized by a target (the fake cost makes each step 64 tokens at most) gives
    /// every request the same tokens and logprobs as one run under the plain budget.
    #[test]
    fn a_step_target_changes_the_steps_not_the_bits() {
        let long = |k: u32| req((0..150).map(|t| 3 + (t * 7 + k) % 90).collect(), 6);
        let requests = || (0..4).map(long).collect::<Vec<_>>();
        let (plain, _) = serve(Box::new(Continuous), requests());
        let cfg = EngineConfig {
            step_target: Some(std::time::Duration::from_millis(1)),
            prefill_order: PrefillOrder::Shortest,
            ..config()
        };
        let mut e = engine(cfg);
        for (i, r) in requests().into_iter().enumerate() {
            e.add(RequestId(i as u64), r).unwrap();
        }
        let mut done = Vec::new();
        let mut sizes = Vec::new();
        while e.has_work() {
            // A cost the target allows no prompt tokens under: steps are the decodes and
            // MIN_PREFILL_CHUNK.
            e.step_cost = StepCost::default();
            e.step_cost.record(10, 55, 1.0);
            let (events, st) = e.step().unwrap();
            sizes.push(st.prefill_tokens + st.decode_tokens);
            done.extend(events.into_iter().filter_map(|ev| match ev {
                Event::Finished(f) => Some(f),
                _ => None,
            }));
        }
        done.sort_by_key(|f| f.request);
        assert!(
            sizes.iter().all(|&n| n <= 4 + MIN_PREFILL_CHUNK),
            "{sizes:?}"
        );
        assert!(sizes.len() >= 4 * 150 / MIN_PREFILL_CHUNK, "{sizes:?}");
        assert_eq!(bits(&done), bits(&plain));
    }

    #[test]
    fn an_itl_target_bounds_prompt_work_only_while_streams_decode() {
        let cfg = EngineConfig {
            max_batched_tokens: 2048,
            step_target: Some(std::time::Duration::from_millis(150)),
            itl_target: Some(std::time::Duration::from_millis(50)),
            ..config()
        };
        // 10 ms a step, 1 ms a token.
        let cost = |e: &mut Engine| {
            e.step_cost = StepCost::default();
            for t in [8, 200, 64, 1] {
                e.step_cost.record(t, 0, 0.01 + 0.001 * t as f64);
            }
        };
        let prompt = || req((0..200).map(|t| 3 + t % 90).collect(), 4);
        let three_decoding = |e: &mut Engine| {
            for i in 0..3u32 {
                e.add(RequestId(u64::from(i)), req(vec![3 + i, 4], 8))
                    .unwrap();
            }
            e.step().unwrap();
        };
        // Nothing decoding: the step target's 140 ms.
        let mut e = engine(cfg.clone());
        e.add(RequestId(0), prompt()).unwrap();
        cost(&mut e);
        let (_, st) = e.step().unwrap();
        assert_eq!((st.decode_tokens, st.prefill_tokens), (0, 140));
        assert_eq!(e.stats().itl_target_ms, 50.0);
        // Three streams decoding: 50 ms less 10 fixed and 3 for the decodes leave 37 tokens.
        let mut e = engine(cfg.clone());
        three_decoding(&mut e);
        assert_eq!(e.stats().decoding, 3);
        e.add(RequestId(9), prompt()).unwrap();
        cost(&mut e);
        let (_, st) = e.step().unwrap();
        assert_eq!((st.decode_tokens, st.prefill_tokens), (3, 37));
        // Decodes that fill the target alone: the floor keeps the prompt moving.
        let mut e = engine(EngineConfig {
            itl_target: Some(std::time::Duration::from_millis(5)),
            ..cfg.clone()
        });
        three_decoding(&mut e);
        e.add(RequestId(9), prompt()).unwrap();
        cost(&mut e);
        let (_, st) = e.step().unwrap();
        assert_eq!(
            (st.decode_tokens, st.prefill_tokens),
            (3, MIN_ITL_PREFILL_CHUNK)
        );
        // An ITL target longer than the step target: the step target.
        let mut e = engine(EngineConfig {
            itl_target: Some(std::time::Duration::from_millis(500)),
            ..cfg
        });
        three_decoding(&mut e);
        e.add(RequestId(9), prompt()).unwrap();
        cost(&mut e);
        let (_, st) = e.step().unwrap();
        assert_eq!((st.decode_tokens, st.prefill_tokens), (3, 137));
    }
}

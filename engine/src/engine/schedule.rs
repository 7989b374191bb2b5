//! The scheduler seam: what runs in the next step.
//!
//! A [`Scheduler`] decides each step's work through a [`StepPlan`]: it reads the running set and
//! the queue ([`SeqInfo`]) and asks for work with [`StepPlan::run`] (the next chunk of a running
//! sequence) and [`StepPlan::admit`] (the head of the queue). The plan does the mechanics every
//! policy shares and none may get wrong: the token budget, block reservation, copy-on-write of
//! shared blocks, prefix reuse at admission, admission headroom, and preemption by recompute
//! (newest first) when the pool runs short. A policy only chooses order and admission.
//!
//! Policies here: [`Continuous`] (the default: iteration-level batching with chunked prefill,
//! decodes first) and [`StaticBatches`] (a batch is formed from the head of the queue and nothing
//! joins it until all of it is done: the static batcher the benchmarks compare against; size 1
//! serves one request at a time).

use std::time::Instant;

use super::{Engine, RequestId, Seq};
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
/// [`Scheduler`] builds a step from. Indices into the running set are oldest admission first;
/// preemption takes the last.
pub struct StepPlan<'e> {
    /// The engine whose step this is (its scheduler is out of it while the plan is made).
    e: &'e mut Engine,
    budget: usize,
    planned: Vec<(usize, usize)>,
    /// Per running sequence, whether it is in `planned`.
    in_plan: Vec<bool>,
    /// Blocks the running sequences need to grow a while (computed at the first admission after
    /// the running set or its reservations last changed).
    headroom: Option<usize>,
}

impl<'e> StepPlan<'e> {
    pub(super) fn new(e: &'e mut Engine) -> Self {
        Self {
            budget: e.config.max_batched_tokens,
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

    /// Tokens the step may still take: `max_batched_tokens` less what was planned (the tokens of
    /// a planned sequence that was then preempted stay spent).
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Sequences running (admitted, holding blocks).
    pub fn running_len(&self) -> usize {
        self.e.running.len()
    }

    /// The running sequence at `i` (oldest admission first).
    pub fn running(&self, i: usize) -> SeqInfo {
        SeqInfo::of(&self.e.running[i])
    }

    /// Whether `running(i)` is in the plan already.
    pub fn is_planned(&self, i: usize) -> bool {
        self.in_plan[i]
    }

    /// The queue, head first (preempted sequences are at the head).
    pub fn waiting(&self) -> impl Iterator<Item = SeqInfo> + '_ {
        self.e.waiting.iter().map(SeqInfo::of)
    }

    /// Plans the next chunk of `running(i)`: its pending tokens, as many as the budget allows.
    /// Where the pool is short, the newest running sequences are preempted (out of the plan too,
    /// if they were in it) until it fits. False when `running(i)` itself had to go, and with it
    /// every sequence after it: the running set then ends before `i`. Nothing is planned when
    /// the budget is spent or `i` is planned already.
    pub fn run(&mut self, i: usize) -> bool {
        let take = self.e.running[i].pending().min(self.budget);
        if take == 0 || self.is_planned(i) {
            return true;
        }
        if !self.make_room(i, take) {
            return false;
        }
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
        let Some(s) = self.e.waiting.front_mut() else {
            return false;
        };
        if !self.e.running.is_empty() && self.e.running.len() + s.width() > self.e.config.max_seqs {
            return false;
        }
        let mut hit = 0;
        if self.e.config.prefix_caching && s.blocks.is_empty() {
            hit = s.blocks.reuse_prefix(&s.tokens);
            s.computed = hit;
        }
        let take = s.pending().min(self.budget);
        let own = s.growth_blocks(block_size, lookahead, max_ctx);
        let fits = self.e.running.is_empty() || self.e.blocks.available() >= own + headroom;
        if !fits || !s.blocks.reserve(s.computed + take) {
            // Not now: give the reused blocks back (they stay cached) and keep its place.
            s.blocks.clear();
            s.computed = 0;
            return false;
        }
        self.e.stats.prefix_lookup_tokens += s.tokens.len() as u64;
        self.e.stats.prefix_hit_tokens += hit as u64;
        let mut s = self.e.waiting.pop_front().expect("front exists");
        s.cached_prompt_tokens.get_or_insert(hit.min(s.prompt_len));
        s.admitted.get_or_insert_with(Instant::now);
        self.headroom = Some(headroom + s.growth_blocks(block_size, lookahead, max_ctx));
        self.e.running.push(s);
        self.planned.push((self.e.running.len() - 1, take));
        self.in_plan.push(true);
        self.budget -= take;
        true
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
        s.preemptions += 1;
        self.e.stats.preemptions += 1;
        self.headroom = None;
        tracing::debug!(request = s.id.0, tokens = s.tokens.len(), "preempted");
        self.e.waiting.push_front(s);
    }
}

/// Iteration-level batching with chunked prefill (the default): every step, one token for each
/// decoding sequence, oldest first; then the rest of the budget to prompt chunks (partly
/// computed prompts and recomputes first, then new sequences from the head of the queue, which
/// is never skipped, so nothing starves).
#[derive(Clone, Copy, Debug, Default)]
pub struct Continuous;

impl Continuous {
    /// Plans every running sequence, decodes first (oldest first), then prompt chunks, within
    /// the budget.
    pub fn run_running(plan: &mut StepPlan<'_>) {
        for decoding in [true, false] {
            let mut i = 0;
            while i < plan.running_len() && plan.budget() > 0 {
                if plan.running(i).decoding() != decoding {
                    i += 1;
                    continue;
                }
                if !plan.run(i) {
                    // `i` itself was preempted: the sequences after it were preempted first,
                    // so nothing after it is left.
                    break;
                }
                i += 1;
            }
        }
    }
}

impl Scheduler for Continuous {
    fn name(&self) -> &'static str {
        "continuous"
    }

    fn schedule(&mut self, plan: &mut StepPlan<'_>) {
        Self::run_running(plan);
        while plan.admit() {}
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
    use crate::engine::{EngineConfig, Event, Finished, Request};

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
        let mut e = engine(config());
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
}

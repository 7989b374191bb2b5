//! One step: drop the cancelled, let the scheduler plan the step (see `schedule`), run one packed
//! forward, sample, retire the finished.

use std::time::Instant;

use rayon::prelude::*;

use super::schedule::{Continuous, StepPlan};
use super::types::RATE_WEIGHT;
use super::{finish_reason, Engine, Event, FinishReason, Finished, Seq, StepStats, TokenEvent};
use crate::error::EngineError;
use crate::forward::SeqBatch;
use crate::sampler::Sampled;

impl Engine {
    /// One scheduling iteration and one forward. Returns this step's events, in order.
    ///
    /// The stages, each its own method: `plan` (drop what was cancelled or
    /// stopped, schedule, copy shared blocks the step writes), `pack` the planned
    /// sequences into one batch and `forward` it, `sample` each
    /// completed sequence's row, `advance` the sequences past their new tokens
    /// (forking parallel samples off a finished prompt), and `retire` the
    /// finished while placing the forked.
    pub fn step(&mut self) -> Result<(Vec<Event>, StepStats), EngineError> {
        let mut events = Vec::new();
        let planned = Instant::now();
        let plan = self.plan(&mut events)?;
        if plan.is_empty() {
            return Ok((events, StepStats::default()));
        }
        self.stats.steps += 1;
        if self.config.panic_at_step == Some(self.stats.steps) {
            panic!(
                "test hook: a panic in engine step {} (TANDEM_TEST_PANIC_AT_STEP)",
                self.stats.steps
            );
        }
        let t0 = Instant::now();
        let out = self.forward(&plan)?;
        let mut stats = StepStats {
            collective_seconds: out.collective_seconds,
            collective_values: out.collective_values,
            ops: self.backend.take_op_times(),
            ..StepStats::default()
        };
        let rows = self.sample(&plan, &out);
        let advanced = self.advance(&plan, &out, rows, &mut stats, &mut events)?;
        let charge = self.draft_charge(&events);
        self.retire(advanced, &mut events);
        stats.seconds = t0.elapsed().as_secs_f64();
        self.step_cost.record(
            stats.prefill_tokens + stats.decode_tokens,
            stats.attended_keys,
            stats.seconds,
        );
        if stats.prefill_tokens == 0 {
            self.decode_cost
                .record(stats.decode_tokens, stats.attended_keys, stats.seconds);
        }
        self.record_timing(&stats);
        let made = events
            .iter()
            .filter(|e| matches!(e, Event::Token(_)))
            .count();
        self.record_arm(
            stats.prefill_tokens,
            made,
            planned.elapsed().as_secs_f64(),
            charge,
        );
        Ok((events, stats))
    }

    /// Drops what was cancelled or stopped, decides the step's work (`(index into running, new
    /// tokens)`) and copies the shared blocks it writes.
    fn plan(&mut self, events: &mut Vec<Event>) -> Result<Vec<(usize, usize)>, EngineError> {
        self.drop_cancelled(events);
        self.drop_stopped(events);
        self.disk_turn()?;
        self.propose()?;
        let plan = self.schedule();
        // Blocks the schedule evicted from the prefix cache go to the disk tier before the
        // step (its copies first) writes them.
        self.spill();
        // Copy-on-write: shared blocks the step writes were swapped for fresh ones while it was
        // scheduled; their contents go over before anything writes them.
        let copies = std::mem::take(&mut self.copies);
        if !copies.is_empty() {
            self.backend.copy_blocks(&copies)?;
        }
        Ok(plan)
    }

    /// The planned sequences as the device takes them: each one's new tokens (a verified
    /// proposal's after its last token), what it has cached, its blocks, and the rows it
    /// samples from (its last token's, and one per proposed token).
    fn pack<'a>(running: &'a mut [Seq], plan: &[(usize, usize)]) -> Vec<SeqBatch<'a>> {
        for &(i, take) in plan {
            let s = &mut running[i];
            if take > s.pending() {
                s.window.clear();
                s.window.extend(&s.tokens[s.computed..]);
                s.window.extend(&s.draft[..take - s.pending()]);
            }
        }
        plan.iter()
            .map(|&(i, take)| {
                let s = &running[i];
                let pending = s.pending();
                SeqBatch {
                    tokens: match take > pending {
                        true => &s.window,
                        false => &s.tokens[s.computed..s.computed + take],
                    },
                    cached: s.computed,
                    block_table: s.blocks.ids(),
                    logits: match take >= pending {
                        true => 1 + take - pending,
                        false => 0,
                    },
                    lora: s.adapter.as_deref(),
                }
            })
            .collect()
    }

    /// The packed step through the device: the rows' logits, or only their picks where the
    /// device picks tokens itself and every sampler in the step takes the argmax (the logits
    /// are rows × vocabulary floats); and what the step cost in collectives.
    fn forward(&mut self, plan: &[(usize, usize)]) -> Result<Forwarded, EngineError> {
        let argmax_only = self.backend.picks_on_device()
            && plan.iter().all(|&(i, take)| {
                let s = &self.running[i];
                s.computed + take < s.tokens.len() || s.sampler.argmax_only()
            });
        let collective0 = self.backend.tp_stats();
        let batch = Self::pack(&mut self.running, plan);
        let (logits, picks) = if argmax_only {
            (Vec::new(), self.backend.forward_argmax(&batch)?)
        } else {
            (self.backend.forward(&batch)?, Vec::new())
        };
        let (collective_seconds, collective_values) = match (collective0, self.backend.tp_stats()) {
            (Some(a), Some(b)) => (
                b.collective.saturating_sub(a.collective).as_secs_f64(),
                b.values.saturating_sub(a.values),
            ),
            _ => (0.0, 0),
        };
        Ok(Forwarded {
            logits,
            picks,
            vocab: self.backend.config().vocab_size,
            collective_seconds,
            collective_values,
        })
    }

    /// Every sequence that completes its tokens this step samples one from its row of logits
    /// (rows in plan order) or the device's pick, and, where it verifies a proposal, goes on
    /// drawing from the proposal's rows while it draws the proposed tokens
    /// ([`super::speculate::verify`]). The sequences are sampled in parallel: each sampler is
    /// its own sequence's, and a row is a whole vocabulary to scan.
    fn sample(&mut self, plan: &[(usize, usize)], out: &Forwarded) -> Rows {
        let mut row_of = vec![None; self.running.len()];
        let mut rows = 0;
        for &(i, take) in plan {
            let s = &self.running[i];
            if take >= s.pending() {
                let proposed = take - s.pending();
                row_of[i] = Some((rows, proposed));
                rows += 1 + proposed;
            }
        }
        let ends = (&self.eos[..], self.backend.config().max_position_embeddings);
        let sampled = self
            .running
            .iter_mut()
            .zip(&row_of)
            .map(|(s, row)| {
                row.map(|(r, proposed)| {
                    let len = (s.tokens.len(), s.prompt_len);
                    (&mut s.sampler, &s.draft[..proposed], r, len)
                })
            })
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|job| {
                job.map(|(sampler, draft, r, len)| {
                    super::speculate::verify(sampler, draft, out, r, len, ends)
                })
            })
            .collect();
        Rows { row_of, sampled }
    }

    /// Moves each planned sequence past the tokens it computed (committing its blocks,
    /// exporting those a prefill hands out) and, where it completed them, past the token it
    /// sampled; a finished prompt with parallel samples forks them off its row.
    fn advance(
        &mut self,
        plan: &[(usize, usize)],
        out: &Forwarded,
        mut rows: Rows,
        stats: &mut StepStats,
        events: &mut Vec<Event>,
    ) -> Result<Advanced, EngineError> {
        let max_ctx = self.backend.config().max_position_embeddings;
        let mut done = Advanced::default();
        for &(i, take) in plan {
            let s = &mut self.running[i];
            // Proposed tokens verified after its pending ones (speculation).
            let proposed = take.saturating_sub(s.pending());
            let (cached, new) = (s.computed as u64, take as u64);
            stats.attended_keys += new * cached + new * (new + 1) / 2;
            stats.context_tokens += cached + new;
            if s.computed + take >= s.tokens.len() {
                stats.logit_rows += 1 + proposed;
            }
            if s.pending() == 1 && s.computed >= s.prompt_len {
                stats.decode_tokens += take;
            } else {
                stats.prefill_tokens += take;
            }
            s.computed += take - proposed;
            s.blocks.commit(&s.tokens, s.computed);
            if s.export.is_some() {
                let bs = self.config.block_size;
                if let Some(chunk) = Self::export_ready(&*self.backend, &mut self.staging, bs, s)? {
                    events.push(Event::Kv(chunk));
                }
            }
            if s.computed < s.tokens.len() {
                continue;
            }
            let sampled = rows.sampled[i]
                .take()
                .expect("a sequence that completed its tokens has a row");
            if !s.forks.is_empty() {
                // The prompt's logits are ready: the request's other samples draw their first
                // tokens from the same row and go on as sequences of their own.
                let (r, _) = rows.row_of[i].expect("a sequence that samples has a row");
                for (child, first) in s.fork_samples(|sampler| out.draw(sampler, r)) {
                    let finish = finish_reason(&self.eos, max_ctx, &child, first.token);
                    events.push(Event::Token(TokenEvent {
                        request: child.id,
                        index: child.index,
                        sampled: first,
                        finish,
                    }));
                    match finish {
                        Some(r) => done.forked_done.push(child.finished(r)),
                        None => done.forked.push(child),
                    }
                }
            }
            s.first_token.get_or_insert_with(Instant::now);
            let accepted = sampled
                .iter()
                .zip(&s.draft[..proposed])
                .take_while(|((x, _), &d)| x.token == d)
                .count();
            let rejected = accepted < proposed && accepted < sampled.len();
            let emitted = sampled.len();
            let mut end = None;
            for (x, finish) in sampled {
                s.tokens.push(x.token);
                s.logprobs.push(x.logprob);
                events.push(Event::Token(TokenEvent {
                    request: s.id,
                    index: s.index,
                    sampled: x,
                    finish,
                }));
                end = end.or(finish);
            }
            if proposed > 0 {
                // Every token emitted but the last continued the proposal: the K/V the step
                // wrote for it stands. The blocks reserved for the rest go back (their slots
                // were never committed, so no prefix-cache hash names them).
                s.computed += emitted - 1;
                s.blocks.commit(&s.tokens, s.computed);
                s.blocks.truncate(s.tokens.len());
                self.count_verified(i, proposed, accepted, rejected);
            }
            if let Some(r) = end {
                done.finished.push((i, r));
            }
        }
        Ok(done)
    }

    /// Takes the finished out of the running set (their events in step order, then the forked
    /// samples that ended at their first token) and places the forked samples that go on.
    fn retire(&mut self, done: Advanced, events: &mut Vec<Event>) {
        // Highest index first so the lower indices stay valid, then back in step order. (The
        // step's order is the plan's, which need not ascend: a sequence admitted in a higher
        // band than one planned before it is inserted below it. Two of them finishing in one
        // step, taken in the plan's order reversed, removed the wrong one and then one past
        // the end.)
        let mut order: Vec<_> = done.finished.iter().enumerate().collect();
        order.sort_unstable_by_key(|&(_, &(index, _))| std::cmp::Reverse(index));
        let mut gone: Vec<_> = order
            .into_iter()
            .map(|(k, &(index, r))| (k, self.running.remove(index), r))
            .collect();
        gone.sort_unstable_by_key(|&(k, ..)| k);
        for (_, s, _) in &gone {
            self.learn(s);
        }
        events.extend(
            gone.into_iter()
                .map(|(_, s, r)| Event::Finished(s.finished(r))),
        );
        events.extend(done.forked_done.into_iter().map(Event::Finished));
        // Forked samples run right after their parent: admitted with it, they are older than
        // what came after it (preemption takes the newest first). A sample with no room under max_seqs
        // (its request was admitted alone, wider than the limit) waits as a preempted
        // sequence does, its prompt in the prefix cache.
        for mut s in done.forked.into_iter().rev() {
            if self.running.len() < self.config.max_seqs {
                let parent = self.running.iter().position(|p| p.id == s.id);
                let at = parent.map_or(self.running.len(), |p| p + 1);
                self.running.insert(at, s);
            } else {
                s.blocks.clear();
                s.computed = 0;
                self.queue_front(s);
            }
        }
    }

    /// Folds a step's prompt work into the measured prefill rate peers plan their deadlines by.
    fn record_timing(&mut self, step: &StepStats) {
        if step.prefill_tokens > 0 && step.seconds > 0.0 {
            let rate = step.prefill_tokens as f64 / step.seconds;
            let r = &mut self.stats.prefill_tokens_per_s;
            *r = if *r == 0.0 {
                rate
            } else {
                RATE_WEIGHT * rate + (1.0 - RATE_WEIGHT) * *r
            };
        }
    }

    fn drop_cancelled(&mut self, events: &mut Vec<Event>) {
        for id in std::mem::take(&mut self.cancelled) {
            // Every sequence of the request (its samples), wherever each is; none when it has
            // finished already.
            let mut gone = Vec::new();
            let take = |seqs: Vec<Seq>, gone: &mut Vec<Seq>| -> Vec<Seq> {
                let (out, keep) = seqs.into_iter().partition(|s| s.id == id);
                gone.extend::<Vec<Seq>>(out);
                keep
            };
            self.running = take(std::mem::take(&mut self.running), &mut gone);
            self.remote = take(std::mem::take(&mut self.remote), &mut gone);
            self.loading = take(std::mem::take(&mut self.loading), &mut gone);
            self.waiting = take(std::mem::take(&mut self.waiting).into(), &mut gone).into();
            gone.sort_by_key(|s| s.index);
            for s in gone {
                events.extend(s.cancelled().into_iter().map(Event::Finished));
            }
        }
    }

    fn drop_stopped(&mut self, events: &mut Vec<Event>) {
        for (id, index) in std::mem::take(&mut self.stopped) {
            let mine = |s: &Seq| s.id == id && s.index == index && s.forks.is_empty();
            // A sequence of its own: it leaves with its blocks (shared ones stay with the
            // samples that hold them too).
            let gone = if let Some(i) = self.running.iter().position(mine) {
                Some(self.running.remove(i))
            } else if let Some(i) = self.waiting.iter().position(mine) {
                self.waiting.remove(i)
            } else if let Some(i) = self.remote.iter().position(mine) {
                Some(self.remote.remove(i))
            } else if let Some(i) = self.loading.iter().position(mine) {
                Some(self.loading.remove(i))
            } else {
                None
            };
            if let Some(s) = gone {
                events.push(Event::Finished(s.finished(FinishReason::Stop)));
                continue;
            }
            // A sample not forked yet: the sequence computing the prompt stands for it.
            let parent = self
                .running
                .iter_mut()
                .chain(self.waiting.iter_mut())
                .chain(self.remote.iter_mut())
                .filter(|s| s.id == id)
                .find_map(|s| s.take_unforked(index, FinishReason::Stop));
            if let Some(f) = parent {
                events.push(Event::Finished(f));
            }
        }
    }

    /// Decides this step's work, `(index into running, new tokens)`, through the scheduler.
    fn schedule(&mut self) -> Vec<(usize, usize)> {
        // The policy plans through the engine itself, so it is out of the engine meanwhile (the
        // stand-in is a unit struct: no allocation).
        let mut scheduler = std::mem::replace(&mut self.scheduler, Box::new(Continuous));
        let mut plan = StepPlan::new(self);
        scheduler.schedule(&mut plan);
        let planned = plan.into_planned();
        self.scheduler = scheduler;
        planned
    }
}

/// What a step's forward gave: the rows' logits (vocabulary each) or the device's picks, and
/// what the step spent in collectives.
pub(super) struct Forwarded {
    logits: Vec<f32>,
    picks: Vec<(u32, f32)>,
    vocab: usize,
    collective_seconds: f64,
    collective_values: u64,
}

impl Forwarded {
    /// Rows of logits as a forward gives them (for tests of what is drawn from them).
    #[cfg(test)]
    pub(super) fn of_logits(logits: Vec<f32>, vocab: usize) -> Self {
        Self {
            logits,
            picks: Vec::new(),
            vocab,
            collective_seconds: 0.0,
            collective_values: 0,
        }
    }

    /// Row `r`'s token for `sampler`: the device's pick, accepted, or a draw from its logits.
    pub(super) fn draw(&self, sampler: &mut crate::Sampler, r: usize) -> Sampled {
        match self.picks.get(r) {
            Some(&(token, logprob)) => sampler.accept(token, logprob),
            None => sampler.sample(&self.logits[r * self.vocab..(r + 1) * self.vocab]),
        }
    }
}

/// Which row each running sequence samples from (None: it did not complete its tokens), and
/// what it drew.
struct Rows {
    /// The first row and the proposed tokens verified after it.
    row_of: Vec<Option<(usize, usize)>>,
    /// The tokens drawn, each with why it ends its sequence (if it does).
    sampled: Vec<Option<super::speculate::Drawn>>,
}

/// What advancing the step's sequences left to retire: the running ones that finished (index,
/// why), the forked samples that go on, and those their first token ended.
#[derive(Default)]
struct Advanced {
    finished: Vec<(usize, FinishReason)>,
    forked: Vec<Seq>,
    forked_done: Vec<Finished>,
}

//! Speculative decoding in the step: before the scheduler plans a step, every decoding
//! sequence asks the engine's proposer for up to `k` tokens ([`Engine::propose`]); the policy
//! keeps those expected to pay ([`Engine::size_drafts`]); the scheduler plans the sequence's
//! last token and its proposal as one chunk of `1 + k` rows of the packed step, each producing
//! logits; the sequence's sampler draws from those rows in order and stops at the first draw
//! that differs from the proposal ([`verify`]); the tokens drawn are emitted, the K/V of the
//! accepted ones stays, and the blocks reserved past them go back to the pool.
//!
//! Why that is exact: every proposer is deterministic (a point mass, see [`crate::spec`]), and
//! for a point mass the standard rejection rule accepts a proposed token `d` with probability
//! `p(d)` and otherwise draws from `p` without `d`: exactly what drawing from `p` and comparing
//! does. Each emitted token is drawn by the sequence's own sampler from the target's row for
//! its position, with every sampling option applied (penalties counting the tokens accepted
//! before it, grammar masks, top-k/p, min-p), taking the same draw of the random stream it takes
//! without speculation. With the batch-invariant numerics a row's logits do not depend on how
//! many rows the step holds, so greedy and seeded outputs are the bits they are without
//! speculation, whatever was proposed.

use serde::Serialize;

use super::draft::Drafter;
use super::spec_ab::{AbCheck, Arm};
use super::{finish_at, Engine, FinishReason, Forwarded};
use crate::backend::Backend;
use crate::error::EngineError;
use crate::forward::SeqBatch;
use crate::sampler::{Sampled, Sampler};
use crate::spec::{Proposer, SpecConfig, SpecMethod, MAX_SPECULATIVE_TOKENS};

/// What speculation did on an engine (zeros without it): the counters vLLM's `spec_decode`
/// metrics report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SpecCounts {
    /// Proposals verified (one per sequence and step that verified at least one token).
    pub drafts: u64,
    /// Proposed tokens verified.
    pub draft_tokens: u64,
    /// Of those, accepted: the target drew the proposed token.
    pub accepted_tokens: u64,
    /// Accepted tokens by their position in the proposal (0: the first proposed).
    pub accepted_per_position: [u64; MAX_SPECULATIVE_TOKENS],
    /// Proposed tokens the policy held back, expected not to pay in their step.
    pub withheld_tokens: u64,
    /// Tokens a draft model fed to catch sequences up rather than to propose: its K/V for
    /// their prompts (computed where they decode) and for what verification emitted past
    /// what it had proposed.
    pub draft_prefill_tokens: u64,
    /// Steps the adaptive policy decoded plainly because steps that speculated were measured
    /// to make tokens more slowly at their batch size (or to measure plain steps).
    pub plain_steps: u64,
}

/// An engine's speculation: its configuration, its proposer of tokens or its draft model
/// (neither for a self-draft: the engine drafts with its own model).
pub(super) struct Speculation {
    pub(super) config: SpecConfig,
    proposer: Option<Box<dyn Proposer>>,
    pub(super) drafter: Option<Drafter>,
    /// Speculating steps against plain ones, measured (with the adaptive policy).
    pub(super) ab: AbCheck,
    /// What the sequences' proposals were accepted at, by position: where a sequence starts.
    pub(super) recent: Acceptance,
    /// The arm the step being planned took, the sequences it decoded and the proposed tokens
    /// verified before it (recorded when the step ends).
    arm: Option<(usize, Arm, u64)>,
    /// Seconds the step's draft forwards spent catching sequences up (charged to the
    /// sequences' later tokens instead, `Seq::draft_overhead`).
    pub(super) catch_up: f64,
    /// Tokens the sequences that finished generated, a moving average (none before one
    /// finished): the most tokens a catch-up is shared over.
    pub(super) typical_output: Option<f64>,
}

impl Speculation {
    /// Speculation as `config` says for an engine on `target` with blocks of `block_size`
    /// tokens of `kv_dtype` (a draft model is loaded here, its pool as many blocks as the
    /// target's).
    pub(super) fn new(
        config: SpecConfig,
        target: &dyn Backend,
        block_size: usize,
        kv_dtype: crate::KvDtype,
    ) -> Result<Self, EngineError> {
        let drafter = match &config.method {
            SpecMethod::Draft(path) => Some(Drafter::load(
                path,
                (
                    target.config().vocab_size,
                    target.num_blocks(),
                    block_size,
                    kv_dtype,
                ),
            )?),
            _ => None,
        };
        Ok(Self::with(config.proposer(), drafter, config))
    }

    /// Speculation by `proposer` or `drafter` as `config` says, nothing measured yet.
    fn with(
        proposer: Option<Box<dyn Proposer>>,
        drafter: Option<Drafter>,
        config: SpecConfig,
    ) -> Self {
        Self {
            config,
            proposer,
            drafter,
            ab: AbCheck::default(),
            arm: None,
            catch_up: 0.0,
            typical_output: None,
            recent: Acceptance::recent(),
        }
    }
}

/// The worker's recent acceptance before anything was verified (where a sequence starts), and
/// where an estimate drifts back to while its proposals are held back (so a sequence whose text
/// turns repetitive again is tried again).
const PRIOR_ACCEPT: f32 = 0.5;
/// Weight of each verified position in a sequence's acceptance estimate.
const ACCEPT_WEIGHT: f32 = 0.25;
/// How far an estimate drifts back to [`PRIOR_ACCEPT`] per step its proposal is held back.
const RELAX: f32 = 0.05;
/// Weight of each finished sequence in the typical output length (about the last 20).
const OUTPUT_WEIGHT: f64 = 0.05;
/// Weight of each verified position in the worker's recent acceptance, the estimate a sequence
/// starts from: an exponential average over about the last 50 verified positions.
const RECENT_WEIGHT: f32 = 0.02;

/// The tokens a sequence's draft catch-up is shared over, for the policy's estimate as for the
/// charge: the `left` it may still make, and no more than finished sequences made on average
/// (`typical`; a request without `max_tokens` may make the whole context).
pub(super) fn ahead(left: usize, typical: Option<f64>) -> usize {
    typical
        .map_or(left, |t| left.min(t.round() as usize))
        .max(1)
}

/// A sequence's estimates of how likely its proposed tokens are to be accepted, for the
/// policy: `pooled`, each verified token's outcome alike, and `at[j]`, the chance that the
/// token at position `j` of a proposal is accepted once the ones before it were (negative
/// until that position is first verified: the pooled estimate stands in). Acceptance is not
/// the same at every position: the first token after a miss is a guess, the fourth of a run
/// that held is likelier. n-gram proposals on the `edit` workload with four tokens always
/// verified (2 cores of Zen 4): 73% of first tokens accepted, then 77%, 88% and 89% of those
/// reached; one pooled rate (80%) overrates the first position and underrates the later ones.
///
/// A sequence starts from the worker's recent acceptance (`fresh` until then): what the
/// sequences before it were accepted at each position, an exponential average over about the
/// last 50 positions verified (so sequences that verify many tokens weigh most), so a
/// worker serving edits verifies four tokens from a sequence's first step and one serving
/// free text few (from the prior, 0.5 at every position, each request relearned its rates
/// over its first steps).
#[derive(Clone, Copy, Debug)]
pub(super) struct Acceptance {
    pooled: f32,
    at: [f32; MAX_SPECULATIVE_TOKENS],
    fresh: bool,
}

impl Default for Acceptance {
    fn default() -> Self {
        Self {
            pooled: PRIOR_ACCEPT,
            at: [-1.0; MAX_SPECULATIVE_TOKENS],
            fresh: true,
        }
    }
}

impl Acceptance {
    /// The chance that the token at position `j` is accepted, those before it having been.
    pub(super) fn at(&self, j: usize) -> f32 {
        match self.at[j] {
            a if a >= 0.0 => a,
            _ => self.pooled,
        }
    }

    /// A proposal was verified: its first `accepted` tokens were accepted and, where
    /// `rejected`, the next was not; each outcome weighs `w`.
    fn verified(&mut self, accepted: usize, rejected: bool, w: f32) {
        (0..accepted).for_each(|j| self.observe(j, true, w));
        if rejected {
            self.observe(accepted, false, w);
        }
    }

    /// The token at position `j` was verified, and `accepted` or not; the outcome weighs `w`.
    fn observe(&mut self, j: usize, accepted: bool, w: f32) {
        let x = if accepted { 1.0 } else { 0.0 };
        let start = self.at(j);
        self.at[j] = start + w * (x - start);
        self.pooled += w * (x - self.pooled);
        self.fresh = false;
    }

    /// The worker's recent acceptance before anything was verified: the prior.
    fn recent() -> Self {
        Self {
            fresh: false,
            ..Self::default()
        }
    }

    /// The estimates after proposals of `proposed` tokens each, of which the first `accepted[i]`
    /// were accepted and the next (if any) was not.
    #[cfg(test)]
    pub(super) fn after(proposed: usize, accepted: &[usize]) -> Self {
        let mut a = Self::default();
        for &n in accepted {
            a.verified(n, n < proposed, ACCEPT_WEIGHT);
        }
        a
    }

    /// The same pooled estimate without the positions' own.
    #[cfg(test)]
    pub(super) fn pooled_only(&self) -> Self {
        Self {
            pooled: self.pooled,
            ..Self::recent()
        }
    }

    /// Positions `from..to` were offered but held back: their own estimates drift towards the
    /// pooled one (a position lowered by a miss would otherwise stay there, never verified
    /// again to show it recovered).
    fn relax_from(&mut self, from: usize, to: usize) {
        let pooled = self.pooled;
        for a in self.at[from..to].iter_mut().filter(|a| **a >= 0.0) {
            *a += RELAX * (pooled - *a);
        }
    }

    /// Held back a step: every estimate drifts towards the prior.
    fn relax(&mut self) {
        self.pooled += RELAX * (PRIOR_ACCEPT - self.pooled);
        for a in self.at.iter_mut().filter(|a| **a >= 0.0) {
            *a += RELAX * (PRIOR_ACCEPT - *a);
        }
    }
}

/// Steps a proposer's proposals are sized by the decode steps' last parts after the steps stop
/// telling them apart ([`StepCost::parts_within`](super::StepCost::parts_within)): none, the
/// current fit's parts only; without them everything offered is verified, so the steps' sizes
/// vary and the parts are learned again. (At 32 steps, an n-gram worker's first requests, sized
/// by parts from its first few steps, once verified 8 tokens and withheld 192.)
const PROPOSER_PARTS: u32 = 0;

/// How much more a proposed token must be expected to give than the step's tokens per second
/// before it is verified: the cost model is a line through steps of other sizes and its
/// acceptance estimates are estimates, so a token that only breaks even by them is not worth
/// the risk of making the step slower. On 2 cores of Zen 5 with 8 decoding sequences, verifying
/// what merely broke even measured 0.89-0.97x the tokens per second of plain decoding.
const MARGIN: f64 = 1.25;

/// The tokens a sequence drew in a step, each with why it ends the sequence (if it does).
pub(super) type Drawn = Vec<(Sampled, Option<FinishReason>)>;

/// Draws a sequence's tokens from its rows of logits, `first` on: one from each row while the
/// token drawn is the proposed one (`draft`, one token per row after the first) and does not
/// end the sequence; each with why it ends the sequence, if it does. `len` and `prompt_len` are
/// the sequence's tokens before the draws and its prompt's.
pub(super) fn verify(
    sampler: &mut Sampler,
    draft: &[u32],
    out: &Forwarded,
    first: usize,
    (len, prompt_len): (usize, usize),
    (eos, max_ctx): (&[u32], usize),
) -> Drawn {
    let mut got = Vec::with_capacity(draft.len() + 1);
    for j in 0..=draft.len() {
        let x = out.draw(sampler, first + j);
        let after = len + j + 1;
        let finish = finish_at(eos, max_ctx, sampler, after - prompt_len, after, x.token);
        let go_on = finish.is_none() && draft.get(j) == Some(&x.token);
        got.push((x, finish));
        if !go_on {
            break;
        }
    }
    got
}

impl Engine {
    /// Records what the step that ends made in `seconds` (from before its proposals) for the
    /// arm it took, if it decoded only: the time its draft model spent catching sequences up
    /// taken out, and where it speculated, `charge` put in (the shares of catch-ups the tokens
    /// it made bear, [`Self::draft_charge`]). So a catch-up weighs on the measure of
    /// speculation as it weighs on the tokens it serves, not all on one step: a probe of
    /// speculation where plain decoding was chosen would otherwise pay, in its first step, for
    /// catching a sequence up over every token decoded plainly, and never measure faster.
    pub(super) fn record_arm(
        &mut self,
        prefill_tokens: usize,
        tokens: usize,
        seconds: f64,
        charge: f64,
    ) {
        let verified = self.stats.spec.draft_tokens;
        if let Some(spec) = self.spec.as_mut() {
            if let Some((decoding, meant, before)) = spec.arm.take() {
                spec.ab.spent(decoding, meant, seconds, spec.catch_up);
                let arm = match verified > before {
                    true => meant,
                    false => Arm::Plain,
                };
                let measured = seconds - spec.catch_up
                    + match arm {
                        Arm::Speculate => charge,
                        Arm::Plain => 0.0,
                    };
                tracing::debug!(
                    decoding,
                    meant = ?meant,
                    arm = ?arm,
                    prefill_tokens,
                    tokens,
                    verified = verified - before,
                    seconds,
                    catch_up = spec.catch_up,
                    charge,
                    "speculation step"
                );
                if prefill_tokens == 0 {
                    spec.ab.record(decoding, arm, tokens, measured);
                }
            }
        }
    }

    /// The catch-up seconds the tokens of `events` bear (their sequences'
    /// `Seq::draft_overhead` each, for the sequences that drafted in the step) where the step
    /// speculates with a draft model; nothing otherwise. Call it before the sequences that
    /// finished retire.
    pub(super) fn draft_charge(&self, events: &[super::Event]) -> f64 {
        if !matches!(
            self.spec,
            Some(Speculation {
                arm: Some((_, Arm::Speculate, _)),
                drafter: Some(_),
                ..
            })
        ) {
            return 0.0;
        }
        let owing: Vec<_> = self
            .running
            .iter()
            .filter(|s| s.draft_overhead > 0.0 && !s.draft.is_empty())
            .map(|s| ((s.id, s.index), s.draft_overhead))
            .collect();
        events
            .iter()
            .filter_map(|e| match e {
                super::Event::Token(t) => owing
                    .iter()
                    .find(|(key, _)| *key == (t.request, t.index))
                    .map(|&(_, seconds)| seconds),
                _ => None,
            })
            .sum()
    }

    /// Proposes tokens for every running sequence that decodes (none for one that forks
    /// samples, exports its K/V or cannot grow), within what it may still generate, the
    /// model's context and the step's token budget, sized by the policy: a proposer of tokens
    /// proposes first and the policy keeps what pays; a self-draft is sized first (drafting
    /// costs forwards) and then drafts.
    pub(super) fn propose(&mut self) -> Result<(), EngineError> {
        let Some(spec) = self.spec.as_mut() else {
            return Ok(());
        };
        let max_ctx = self.backend.config().max_position_embeddings;
        // A sequence that decodes starts from the worker's recent acceptance.
        for s in self.running.iter_mut() {
            if s.accept.fresh && s.pending() == 1 {
                s.accept = spec.recent;
            }
        }
        // The adaptive policy speculates only at batch sizes where speculating steps are
        // measured to make tokens faster than plain ones: the policy's fits can misjudge a
        // model drafting (its forwards, its catch-up), and the rows a proposer's tokens add
        // where the step's cost does not grow in a line with its rows.
        spec.arm = None;
        spec.catch_up = 0.0;
        if spec.config.adaptive {
            let decoding = self.running.iter().filter(|s| s.pending() == 1).count();
            if decoding > 0 {
                let arm = spec.ab.arm(decoding);
                spec.arm = Some((decoding, arm, self.stats.spec.draft_tokens));
                if arm == Arm::Plain {
                    self.stats.spec.plain_steps += 1;
                    for s in &mut self.running {
                        s.draft.clear();
                    }
                    return Ok(());
                }
            }
        }
        // Every running sequence keeps its one token of the budget.
        let mut spare = self
            .config
            .max_batched_tokens
            .saturating_sub(self.running.len());
        let mut room = vec![0usize; self.running.len()];
        for (s, room) in self.running.iter_mut().zip(&mut room) {
            s.draft.clear();
            if s.pending() != 1
                || !s.forks.is_empty()
                || s.export.is_some()
                || s.sampler.grammar_failure().is_some()
            {
                continue;
            }
            let generated = s.tokens.len() - s.prompt_len;
            let left = (s.sampler.params().max_tokens as usize)
                .saturating_sub(generated + 1)
                .min(max_ctx.saturating_sub(s.tokens.len() + 1));
            *room = spec.config.tokens.min(left).min(spare);
            spare -= *room;
        }
        let adaptive = spec.config.adaptive;
        match (&spec.proposer, spec.config.method.clone()) {
            (Some(proposer), _) => {
                for (s, &k) in self.running.iter_mut().zip(&room) {
                    if k > 0 {
                        proposer.propose(&s.tokens, k, &mut s.draft);
                        s.draft.truncate(k);
                        // Structured outputs: what the grammar refuses is not verified.
                        let allowed = s.sampler.grammar_prefix(&s.draft);
                        s.draft.truncate(allowed);
                    }
                }
                if adaptive {
                    let offered: Vec<usize> = self.running.iter().map(|s| s.draft.len()).collect();
                    let keep = self.sizes(&offered, &[], &[]);
                    self.withhold(&offered, &keep);
                    for (s, &k) in self.running.iter_mut().zip(&keep) {
                        s.draft.truncate(k);
                    }
                }
                Ok(())
            }
            (None, SpecMethod::SelfDraft(layers)) => {
                let share = layers as f64 / self.backend.config().num_layers.max(1) as f64;
                let keep = self.size_drafts(room, share, &[]);
                self.draft_self(layers, keep)
            }
            (None, SpecMethod::Draft(_)) => {
                let share = match &spec.drafter {
                    Some(d) => d.weight_bytes() as f64 / self.backend.weight_bytes().max(1) as f64,
                    None => {
                        return Err(EngineError::Internal(
                            "speculation by a draft model without one".into(),
                        ))
                    }
                };
                let lag = self.draft_lag();
                let keep = self.size_drafts(room, share, &lag);
                self.draft_model(keep)
            }
            (None, m) => Err(EngineError::Internal(format!(
                "speculation by {m} without a proposer"
            ))),
        }
    }

    /// How many of `offered[i]` proposed tokens each running sequence verifies: those expected
    /// to raise the step's tokens per second, by the engine's measure of its decode steps (a
    /// [`super::StepCost`] of the steps that computed no prompt tokens: a prompt chunk's rows
    /// are cheaper per token than a decode step's where the decode step is bound by reading
    /// the weights and the chunk by computing, so the two do not share a line), each token
    /// also costing seconds to propose, `per_token[j - 1]` the `j`-th of a sequence (nothing
    /// past its end). The step's decoding sequences make a token
    /// each in the time the measure gives them; a proposed token adds the product of its
    /// sequence's estimates for the positions up to and including its own ([`Acceptance`]) in
    /// tokens, and its row's time.
    /// Taking the best first, a token is kept while it raises tokens per second by a margin
    /// (`MARGIN`). Where the step
    /// is compute-bound (many sequences, each row costing its full share) nothing pays and the
    /// step is plain decoding. Before any fit of the steps told their fixed part from their
    /// rows' (and, for a proposer, where the last that did is more than [`PROPOSER_PARTS`]
    /// steps old: no fit since told them apart, the steps being of about one size), everything
    /// offered is kept (but for the catch-up rule below).
    ///
    /// A draft model must first catch a sequence up over what it lacks (`lag[i]` tokens; none
    /// where `lag` is empty): a cost paid once for the steps the sequence drafts in after, so
    /// its first proposed token bears that cost shared over the steps it has left at the
    /// rate its proposals are expected to go. A sequence whose drafting would pay for itself
    /// but not for its catch-up does not draft; where the outcome check ([`super::spec_ab`])
    /// has not chosen speculation for the batch size (while it tries the arms or probes, a
    /// catch-up is wasted if plain decoding is chosen), only the sequence that lags least may
    /// catch up, and none where that one lags a token at most, so that the step measures
    /// drafting at the least cost (before the decode steps are measured too).
    fn sizes(&self, offered: &[usize], per_token: &[f64], lag: &[usize]) -> Vec<usize> {
        // The outcome check's batch size, as `propose` took it for this step.
        let catches_up = match self.spec.as_ref() {
            Some(Speculation {
                arm: Some((decoding, ..)),
                ab,
                ..
            }) => ab.speculating(*decoding),
            _ => true,
        };
        // Where speculation is not chosen (the arms being tried, or plain chosen), a step
        // catches up one sequence at most (the one that lags least): enough to measure
        // drafting by, not a batch's worth of catch-up. (None where the one that lags least is
        // caught up already: it drafts, nothing catches up.)
        let lone = match catches_up {
            true => None,
            false => (0..self.running.len())
                .filter(|&i| offered[i] > 0 && i < lag.len())
                .min_by_key(|&i| lag[i])
                .filter(|&i| lag[i] > 1),
        };
        // A sequence that may not catch up does not draft.
        let may = |i: usize| catches_up || lone == Some(i) || lag.get(i).is_none_or(|&l| l <= 1);
        // The decode steps' parts, the last that were told apart: for a model drafting,
        // whatever their age (its outcome check stops speculation they let through, and with
        // no parts a probe at a batch of many would draft one sequence alone at a loss; but
        // parts that hold every draft back keep its batch size plain until the batch changes
        // or a step of another size teaches them again); a proposer's proposals, sized by the
        // parts alone, by parts from at most `PROPOSER_PARTS` steps ago (the steps a proposer
        // leaves plain are all one size, and parts from another load would keep it plain for
        // good).
        let checked = matches!(
            self.spec,
            Some(Speculation {
                arm: Some(_),
                proposer: None,
                ..
            })
        );
        let Some(cost) = self.decode_cost.parts_within(match checked {
            true => u32::MAX,
            false => PROPOSER_PARTS,
        }) else {
            return (0..offered.len())
                .map(|i| if may(i) { offered[i] } else { 0 })
                .collect();
        };
        let mut tokens = 0.0;
        let mut time = cost.fixed;
        let mut cands = Vec::new();
        let max_ctx = self.backend.config().max_position_embeddings;
        let catch_up = self.draft_fit();
        let typical = self.spec.as_ref().and_then(|s| s.typical_output);
        let mut setup = vec![0.0f64; self.running.len()];
        for (i, s) in self.running.iter().enumerate() {
            if s.pending() != 1 {
                continue;
            }
            tokens += 1.0;
            time += cost.seconds(s.computed, 1);
            let mut gain = 1.0f64;
            let mut per_step = 1.0f64;
            for j in 1..=offered[i] {
                gain *= f64::from(s.accept.at(j - 1));
                per_step += gain;
                cands.push((gain, i, j));
            }
            if let Some(&lag) = lag.get(i).filter(|&&l| l > 0 && offered[i] > 0) {
                let len = s.tokens.len();
                let first = per_token.first().copied().unwrap_or(0.0);
                let seconds = catch_up.map_or(first * lag as f64, |c| c.seconds(len - lag, lag));
                let left = ahead(s.left(max_ctx), typical);
                setup[i] = match may(i) {
                    true => seconds * per_step / left as f64,
                    false => f64::INFINITY,
                };
            }
        }
        // Best first; a sequence's positions in order (gains fall with j, ties keep j order).
        cands.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.2.cmp(&b.2)));
        let mut keep = vec![0usize; self.running.len()];
        for (gain, i, j) in cands {
            if keep[i] + 1 != j {
                continue;
            }
            let c = self.running[i].computed;
            let mut extra = cost.seconds(c, 1 + j) - cost.seconds(c, j)
                + per_token.get(j - 1).copied().unwrap_or(0.0);
            if j == 1 {
                extra += setup[i];
            }
            if gain * time > MARGIN * tokens * extra {
                keep[i] = j;
                tokens += gain;
                time += extra;
            }
        }
        keep
    }

    /// Tokens each running sequence's draft-model state lacks before it can draft (none
    /// without a draft model).
    fn draft_lag(&self) -> Vec<usize> {
        let Some(d) = self.spec.as_ref().and_then(|s| s.drafter.as_ref()) else {
            return Vec::new();
        };
        self.running
            .iter()
            .map(|s| s.tokens.len() - d.kept(&(s.id, s.index), &s.tokens))
            .collect()
    }

    /// Counts what the policy held back of what was offered, and lets the estimate of a
    /// sequence that verifies nothing drift back towards the prior (so it is tried again).
    fn withhold(&mut self, offered: &[usize], keep: &[usize]) {
        for ((s, &o), &k) in self.running.iter_mut().zip(offered).zip(keep) {
            if o > k {
                self.stats.spec.withheld_tokens += (o - k) as u64;
                if k == 0 {
                    s.accept.relax();
                } else {
                    s.accept.relax_from(k, o);
                }
            }
        }
    }

    /// How many of the `room[i]` tokens each sequence may draft a model (a self-draft or a
    /// draft model, whose forwards cost `share` of the target's) drafts: all of them without
    /// the adaptive policy, else what the policy expects to pay, drafting included.
    ///
    /// The `j`-th drafted token of every sequence comes from one forward, whose fixed part
    /// (reading the draft's weights) the sequences drafting `j` tokens or more share: sized
    /// first as if every sequence offered room did, then again with each forward shared by
    /// those the sizing kept, until those counts no longer fall. (Priced as if all drafted, one
    /// sequence kept alone beside plain decodes would pay a forward over the whole draft for a
    /// share of it.)
    pub(super) fn size_drafts(
        &mut self,
        room: Vec<usize>,
        share: f64,
        lag: &[usize],
    ) -> Vec<usize> {
        if !self.spec.as_ref().is_some_and(|s| s.config.adaptive) {
            return room;
        }
        let at_least = |k: &[usize]| -> Vec<usize> {
            let depth = room.iter().copied().max().unwrap_or(0);
            (1..=depth)
                .map(|j| k.iter().filter(|&&n| n >= j).count().max(1))
                .collect()
        };
        let mut sharing = at_least(&room);
        let mut keep;
        loop {
            let per_token: Vec<f64> = sharing
                .iter()
                .map(|&n| self.draft_row_seconds(n, share))
                .collect();
            keep = self.sizes(&room, &per_token, lag);
            // Fewer sharing a forward only raises its tokens' price: the counts only
            // fall, so the loop ends.
            let kept: Vec<usize> = at_least(&keep)
                .iter()
                .zip(&sharing)
                .map(|(&k, &s)| k.min(s))
                .collect();
            if kept == sharing {
                break;
            }
            sharing = kept;
        }
        self.withhold(&room, &keep);
        keep
    }

    /// Seconds one more drafted token of one sequence costs, by the measure of the draft
    /// forwards so far, with their fixed part shared by the `drafting` sequences of its
    /// forward; before any was measured, the decode steps' parts scaled by the draft's `share`
    /// of the target's cost (no parts either: nothing, and the sizing then keeps what was
    /// offered, so the first drafts are made and measured).
    fn draft_row_seconds(&self, drafting: usize, share: f64) -> f64 {
        let drafting = drafting.max(1) as f64;
        if let Some(c) = self.draft_fit() {
            return c.per_token + c.fixed / drafting;
        }
        self.decode_cost
            .parts_within(u32::MAX)
            .map_or(0.0, |c| share * (c.per_token + c.fixed / drafting))
    }

    /// The draft forwards' parts, the last told apart whatever their age, else their current
    /// fit.
    fn draft_fit(&self) -> Option<super::Cost> {
        self.draft_cost
            .parts_within(u32::MAX)
            .or_else(|| self.draft_cost.fit())
    }

    /// Drafts `keep[i]` tokens for each running sequence with the model's first `layers`
    /// layers: forward after forward, each taking every sequence that drafts further one token
    /// (its last, then its drafts), greedily. Each sequence first gets the blocks for its
    /// proposal and the verification (a shared block it writes copied first); one the pool
    /// cannot grow does not draft. The draft's K/V stays where the verification will write the
    /// same bits for the tokens it accepts.
    fn draft_self(&mut self, layers: usize, mut keep: Vec<usize>) -> Result<(), EngineError> {
        let mut copies = Vec::new();
        for (s, k) in self.running.iter_mut().zip(&mut keep) {
            if *k == 0 {
                continue;
            }
            let ok = s.blocks.reserve(s.computed + *k + 1)
                && match s.blocks.make_writable(s.computed) {
                    Ok(copy) => {
                        copies.extend(copy);
                        true
                    }
                    Err(crate::PoolFull) => false,
                };
            if !ok {
                *k = 0;
            }
        }
        // Blocks taken from the prefix cache go to the disk tier before anything writes them.
        self.spill();
        if !copies.is_empty() {
            self.backend.copy_blocks(&copies)?;
        }
        let mut last: Vec<u32> = self
            .running
            .iter()
            .map(|s| s.tokens.last().copied().unwrap_or(0))
            .collect();

        let vocab = self.backend.config().vocab_size;
        let most = keep.iter().copied().max().unwrap_or(0);
        for p in 0..most {
            let drafting: Vec<usize> = (0..keep.len()).filter(|&i| keep[i] > p).collect();
            let t0 = std::time::Instant::now();
            let mut keys = 0;
            let batch: Vec<SeqBatch<'_>> = drafting
                .iter()
                .map(|&i| {
                    let s = &self.running[i];
                    keys += (s.computed + p + 1) as u64;
                    SeqBatch {
                        tokens: std::slice::from_ref(&last[i]),
                        cached: s.computed + p,
                        block_table: s.blocks.ids(),
                        logits: 1,
                        lora: s.adapter.as_deref(),
                    }
                })
                .collect();
            let logits = self.backend.forward_layers(&batch, layers)?;
            drop(batch);
            Self::take_drafted(
                &mut self.running,
                (&logits, vocab),
                &drafting,
                &mut last,
                &mut keep,
            );
            self.draft_cost
                .record(drafting.len(), keys, t0.elapsed().as_secs_f64());
        }
        Ok(())
    }

    /// A draft forward's rows of logits (`vocab` each), one for each of the `running`
    /// sequences `drafting` (indices, in order): each takes its row's greedy token as its next
    /// proposed one (the token it feeds next, in `last`), unless its grammar refuses it, which
    /// ends its draft (`keep` cut to what it has).
    pub(super) fn take_drafted(
        running: &mut [super::Seq],
        (logits, vocab): (&[f32], usize),
        drafting: &[usize],
        last: &mut [u32],
        keep: &mut [usize],
    ) {
        for (row, &i) in logits.chunks_exact(vocab).zip(drafting) {
            let t = tandem_kernels::ops::argmax(row) as u32;
            let s = &mut running[i];
            s.draft.push(t);
            last[i] = t;
            // Structured outputs: a token the grammar refuses ends the draft.
            if s.sampler.grammar_prefix(&s.draft) < s.draft.len() {
                s.draft.pop();
                keep[i] = s.draft.len();
            }
        }
    }

    /// Counts a sequence's verified proposal: `proposed` tokens, of which the first `accepted`
    /// were drawn as proposed, and whether a draw then differed (`rejected`; false when the
    /// sequence ended first). The sequence's estimates and the worker's recent ones follow.
    pub(super) fn count_verified(
        &mut self,
        i: usize,
        proposed: usize,
        accepted: usize,
        rejected: bool,
    ) {
        let c = &mut self.stats.spec;
        c.drafts += 1;
        c.draft_tokens += proposed as u64;
        c.accepted_tokens += accepted as u64;
        for n in &mut c.accepted_per_position[..accepted] {
            *n += 1;
        }
        let s = &mut self.running[i];
        s.spec_tokens.0 += proposed as u32;
        s.spec_tokens.1 += accepted as u32;
        s.accept.verified(accepted, rejected, ACCEPT_WEIGHT);
        if let Some(sp) = self.spec.as_mut() {
            sp.recent.verified(accepted, rejected, RECENT_WEIGHT);
        }
    }

    /// A sequence left the engine at its end: the proposer learns its tokens; its draft
    /// model's state gives its blocks back.
    pub(super) fn learn(&mut self, s: &super::Seq) {
        let Some(spec) = self.spec.as_mut() else {
            return;
        };
        if let Some(p) = spec.proposer.as_mut() {
            p.learn(&s.tokens, s.prompt_len);
        }
        if let Some(d) = spec.drafter.as_mut() {
            d.release(&(s.id, s.index));
        }
        let made = (s.tokens.len() - s.prompt_len) as f64;
        spec.typical_output = Some(
            spec.typical_output
                .map_or(made, |t| t + OUTPUT_WEIGHT * (made - t)),
        );
    }

    /// Speculates from the next step on with `proposer`, sized by `config` (its method names
    /// the proposer [`EngineConfig::speculative`](super::EngineConfig::speculative) would
    /// build; a proposer of one's own takes its place here).
    pub fn set_proposer(&mut self, config: SpecConfig, proposer: Box<dyn Proposer>) {
        assert!(
            (1..=MAX_SPECULATIVE_TOKENS).contains(&config.tokens),
            "{} proposed tokens: 1 to {MAX_SPECULATIVE_TOKENS}",
            config.tokens
        );
        self.config.speculative = Some(config.clone());
        self.spec = Some(Speculation::with(Some(proposer), None, config));
    }

    /// Speculates from the next step on with `draft` as the draft model (a backend over a pool
    /// of its own, of blocks the size of the engine's), sized by `tokens` and `adaptive` as
    /// [`SpecConfig`] says; `name` labels it (`draft:NAME`). Refused where the draft's
    /// vocabulary is not the target's.
    pub fn set_draft_model(
        &mut self,
        name: &str,
        draft: Box<dyn Backend>,
        tokens: usize,
        adaptive: bool,
    ) -> Result<(), EngineError> {
        let config = SpecConfig {
            method: SpecMethod::Draft(name.into()),
            tokens,
            adaptive,
        };
        config.check().map_err(EngineError::Config)?;
        let drafter = Drafter::new(
            draft,
            self.backend.config().vocab_size,
            self.config.block_size,
        )?;
        self.config.speculative = Some(config.clone());
        self.spec = Some(Speculation::with(None, Some(drafter), config));
        Ok(())
    }

    /// The draft model's pool: blocks free and in all (None without a draft model).
    #[cfg(test)]
    pub(crate) fn draft_pool(&self) -> Option<(usize, usize)> {
        self.spec.as_ref()?.drafter.as_ref().map(Drafter::blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_types::SamplingParams;

    /// Pearson's statistic of `counts` against probabilities `p` over `n` draws; a count where
    /// `p` is 0 is a failure of its own.
    fn chi_square(counts: &[u64], p: &[f64], n: u64) -> f64 {
        counts
            .iter()
            .zip(p)
            .map(|(&c, &p)| {
                assert!(p > 0.0 || c == 0, "a token outside the support was drawn");
                if p == 0.0 {
                    0.0
                } else {
                    let e = p * n as f64;
                    (c as f64 - e).powi(2) / e
                }
            })
            .sum()
    }

    /// The target's distribution of the test's logits at temperature 1, cut to its top-p.
    fn target(logits: &[f32], top_p: f64) -> Vec<f64> {
        let z: Vec<f64> = logits.iter().map(|&l| f64::from(l).exp()).collect();
        let sum: f64 = z.iter().sum();
        let mut order: Vec<usize> = (0..z.len()).collect();
        order.sort_by(|&a, &b| z[b].total_cmp(&z[a]));
        let (mut kept, mut acc) = (vec![false; z.len()], 0.0);
        for &i in &order {
            kept[i] = true;
            acc += z[i] / sum;
            if acc >= top_p {
                break;
            }
        }
        let mass: f64 = (0..z.len()).filter(|&i| kept[i]).map(|i| z[i]).sum();
        (0..z.len())
            .map(|i| if kept[i] { z[i] / mass } else { 0.0 })
            .collect()
    }

    /// A position's estimate moves only with its own outcomes; one held back drifts towards the
    /// pooled estimate, and one never verified is the pooled estimate.
    #[test]
    fn each_position_keeps_its_own_estimate() {
        // Four proposals of four: all accepted, then a miss at the fourth token, twice.
        let mut a = Acceptance::after(4, &[4, 3, 4, 3]);
        let (first, fourth) = (a.at(0), a.at(3));
        assert_eq!(
            first,
            0.5 + 0.25 * 0.5 + 0.25 * 0.375 + 0.25 * 0.28125 + 0.25 * 0.2109375
        );
        assert!(fourth < first, "{fourth} {first}");
        assert_eq!(a.at(5), a.pooled, "never verified");
        a.relax_from(3, 4);
        assert_eq!(a.at(0), first);
        assert_eq!(a.at(3), fourth + RELAX * (a.pooled - fourth));
        a.relax();
        assert_eq!(a.at(0), first + RELAX * (PRIOR_ACCEPT - first));
    }

    /// The rejection rule, measured: over a six-token vocabulary, 40 000 verifications of a
    /// two-token proposal draw their first token from the target's distribution (chi-square
    /// below the 0.1% point of its degrees of freedom, fixed seed), and so does the second
    /// where the first was accepted, with and without top-p; the first proposed token is
    /// accepted as often as the target draws it.
    #[test]
    fn verified_tokens_follow_the_target_distribution() {
        let logits = [1.0f32, 3.0, 2.5, -1.0, 0.0, 2.9];
        let rows: Vec<f32> = logits.iter().cycle().take(3 * 6).copied().collect();
        let out = Forwarded::of_logits(rows, 6);
        // 0.1% points of chi-square for 5 and 2 degrees of freedom.
        for (top_p, draft, critical) in [(1.0, [2u32, 1], 20.52), (0.8, [5, 2], 13.82)] {
            let p = target(&logits, top_p);
            let params = SamplingParams {
                temperature: 1.0,
                top_p: top_p as f32,
                seed: Some(7),
                max_tokens: 1000,
                ..Default::default()
            };
            let mut sampler = Sampler::new(params.validate().unwrap(), &[], None);
            let n = 40_000u64;
            let (mut first, mut second, mut accepted) = ([0u64; 6], [0u64; 6], 0u64);
            for _ in 0..n {
                let got = verify(&mut sampler, &draft, &out, 0, (10, 5), (&[], 100_000));
                assert!(!got.is_empty() && got.len() <= 3);
                first[got[0].0.token as usize] += 1;
                if got[0].0.token == draft[0] {
                    accepted += 1;
                    second[got[1].0.token as usize] += 1;
                } else {
                    assert_eq!(got.len(), 1, "nothing is drawn after a rejection");
                }
            }
            let x1 = chi_square(&first, &p, n);
            let x2 = chi_square(&second, &p, accepted);
            assert!(
                x1 < critical,
                "top-p {top_p}: first tokens {first:?}, chi-square {x1}"
            );
            assert!(
                x2 < critical,
                "top-p {top_p}: second tokens {second:?}, chi-square {x2}"
            );
            let rate = accepted as f64 / n as f64;
            let sd = (p[draft[0] as usize] * (1.0 - p[draft[0] as usize]) / n as f64).sqrt();
            assert!(
                (rate - p[draft[0] as usize]).abs() < 4.0 * sd,
                "top-p {top_p}: accepted {rate}, target {}",
                p[draft[0] as usize]
            );
        }
    }
}

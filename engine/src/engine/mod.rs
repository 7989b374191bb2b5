//! The engine: an iteration-level scheduler over one KV pool and one packed forward per step.
//!
//! Requests wait in arrival order. Each [`Engine::step`] (under the default [`Continuous`]
//! scheduler; a [`Scheduler`] decides step 2 and 3, see `schedule`):
//! 1. drops cancelled sequences (their blocks return to the pool at once);
//! 2. schedules one token for every running sequence that is decoding, oldest first;
//! 3. gives the rest of the token budget (`max_batched_tokens`; under a step target, the time
//!    the step has left by the measured `StepCost`) to prompt chunks: first running sequences
//!    whose prompt is partly done, then new ones from the queue in the configured `PrefillOrder`
//!    (arrival by default: the head is never skipped, so nothing starves), up to `max_seqs`
//!    running. A new sequence first takes over the longest cached prefix of its tokens from the
//!    block manager;
//! 4. runs one forward over everything scheduled, samples the sequences whose tokens are all in
//!    the cache, and retires the finished ones.
//!
//! When a running sequence needs a block and the pool is empty (cached prefixes are evicted
//! first), the newest running sequence is preempted: its blocks are released and it goes back to the
//! head of the queue with its generated tokens, to be recomputed (mostly from the prefix cache)
//! later. A step never fails for lack of blocks.
//!
//! Files: this one holds the engine, its sequences and its core bookkeeping; `types` the public
//! types (configuration, requests, events, stats, limits); `schedule` the scheduler seam and its
//! policies (the mechanics of reserving, admitting and preempting in `StepPlan`); `step` the step
//! loop in its stages; `remote` the remote-prefill lifecycle (both sides); `offline` running a batch to its
//! end (benchmarks, the golden checks).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::{Backend, RankPool};
use crate::block_manager::{BlockCounts, BlockManager, KvEvent, SeqBlocks};
use crate::device::cpu::CpuBackend;
use crate::device::cpu::CpuModel;
use crate::error::EngineError;
use crate::kv_cache::KvPool;
use crate::sampler::{Sampled, Sampler};
use tandem_grammar::GrammarCompiler;
use tandem_model::ModelConfig;
use tandem_types::BlockId;

mod disk;
mod draft;
mod offline;
mod remote;
mod schedule;
mod spec_ab;
mod speculate;
mod step;
mod types;

pub use schedule::{
    Continuous, Cost, Scheduler, SeqInfo, StaticBatches, StepCost, StepPlan, MAX_PASSED,
    MIN_ITL_PREFILL_CHUNK, MIN_PREFILL_CHUNK,
};

pub use disk::DiskCounts;
pub use speculate::SpecCounts;
use step::Forwarded;
pub use types::{
    EngineConfig, EngineStats, Event, FinishReason, Finished, KvChunk, KvDiskConfig, KvPiece,
    Limits, PrefillOrder, Request, RequestId, Reservation, ResumedCounts, Samples, StepStats,
    TokenEvent,
};

/// Why `s` stops after `token` (already appended), if it does.
fn finish_reason(eos: &[u32], max_ctx: usize, s: &Seq, token: u32) -> Option<FinishReason> {
    let len = s.tokens.len();
    finish_at(eos, max_ctx, &s.sampler, len - s.prompt_len, len, token)
}

/// Why a sequence stops after `token`, drawn by `sampler` (which recorded it), if it does:
/// `generated` output tokens and `len` tokens in all with it.
fn finish_at(
    eos: &[u32],
    max_ctx: usize,
    sampler: &Sampler,
    generated: usize,
    len: usize,
    token: u32,
) -> Option<FinishReason> {
    let p = sampler.params();
    if sampler.grammar_failure().is_some() {
        Some(FinishReason::Error)
    } else if p.stop_token_ids.contains(&token)
        || (!p.ignore_eos && eos.contains(&token))
        || sampler.grammar_finished()
    {
        Some(FinishReason::Stop)
    } else if generated >= p.max_tokens as usize || len >= max_ctx {
        Some(FinishReason::Length)
    } else {
        None
    }
}
struct Seq {
    id: RequestId,
    /// Which of its request's samples this sequence is.
    index: u32,
    /// The request's other samples, not yet forked off (until the prompt's logits are ready):
    /// their numbers and samplers.
    forks: Vec<(u32, Sampler)>,
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Leading tokens whose K/V is in the cache.
    computed: usize,
    blocks: SeqBlocks,
    sampler: Sampler,
    logprobs: Vec<f32>,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    cached_prompt_tokens: Option<usize>,
    preemptions: u32,
    /// While waiting: times a prompt behind it was admitted first (shortest-first order).
    passed: u32,
    /// Prefill mode: `(first prompt block to export, next block to export)`.
    export: Option<(usize, usize)>,
    /// Blocks of its prefix being read back from the disk tier (while it waits aside).
    awaits: Vec<u64>,
    /// Tokens proposed to follow its last one, verified in the next step (speculation).
    draft: Vec<u32>,
    /// The next step's tokens when it verifies a proposal: its last token, then the proposal.
    window: Vec<u32>,
    /// Estimated chances that its proposed tokens are accepted (speculation's policy).
    accept: speculate::Acceptance,
    /// Proposed tokens verified for it, and of those the accepted.
    spec_tokens: (u32, u32),
    /// Seconds of a draft model's catch-up charged to each token it makes in a step that
    /// speculates: each catch-up's time shared over the tokens it may still make then (the
    /// outcome check's measure, [`spec_ab`]).
    draft_overhead: f64,
    /// Its request's priority band: the queue and the running set are ordered by it (higher
    /// first, then by arrival), so admission takes a higher band first and preemption, which
    /// takes the running set's last, a lower band first.
    priority: i32,
    /// The LoRA adapter it runs with.
    adapter: Option<std::sync::Arc<tandem_model::LoraAdapter>>,
}

impl Seq {
    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Tokens it may still generate (at least one): what `max_tokens` and the model's context
    /// `max_ctx` leave.
    fn left(&self, max_ctx: usize) -> usize {
        let len = self.tokens.len();
        (self.sampler.params().max_tokens as usize)
            .saturating_sub(len - self.prompt_len)
            .min(max_ctx.saturating_sub(len))
            .max(1)
    }

    /// Blocks still needed to hold the whole prompt and `lookahead` more tokens (or to finish,
    /// if sooner).
    fn growth_blocks(&self, block_size: usize, lookahead: usize, max_ctx: usize) -> usize {
        let end = (self.prompt_len + self.sampler.params().max_tokens as usize).min(max_ctx);
        let target = end
            .min(self.tokens.len() + lookahead)
            .max(self.tokens.len());
        let own = target
            .div_ceil(block_size)
            .saturating_sub(self.blocks.len());
        // Each sample still to fork shares the prompt and grows a tail of its own (plus the
        // copy of the prompt's last block).
        own + self.forks.len() * (lookahead.div_ceil(block_size) + 1)
    }

    /// Sequences this one stands for in the running set: itself and its samples to fork.
    fn width(&self) -> usize {
        1 + self.forks.len()
    }

    /// Forks off every sample still to fork now that the prompt's logits are ready: each draws
    /// its first token with `draw` and holds the same blocks (shared copy-on-write). Call it
    /// before this sequence appends its own first token.
    fn fork_samples(
        &mut self,
        mut draw: impl FnMut(&mut Sampler) -> Sampled,
    ) -> Vec<(Seq, Sampled)> {
        std::mem::take(&mut self.forks)
            .into_iter()
            .map(|(index, mut sampler)| {
                let first = draw(&mut sampler);
                let mut tokens = self.tokens.clone();
                tokens.push(first.token);
                let seq = Seq {
                    id: self.id,
                    index,
                    forks: Vec::new(),
                    tokens,
                    prompt_len: self.prompt_len,
                    computed: self.computed,
                    blocks: self.blocks.fork(),
                    sampler,
                    logprobs: vec![first.logprob],
                    submitted: self.submitted,
                    admitted: self.admitted,
                    first_token: Some(Instant::now()),
                    cached_prompt_tokens: self.cached_prompt_tokens,
                    preemptions: self.preemptions,
                    passed: 0,
                    export: None,
                    awaits: Vec::new(),
                    draft: Vec::new(),
                    window: Vec::new(),
                    accept: self.accept,
                    spec_tokens: (0, 0),
                    draft_overhead: 0.0,
                    priority: self.priority,
                    adapter: self.adapter.clone(),
                };
                (seq, first)
            })
            .collect()
    }

    /// The `Cancelled` finish of this sequence and of every sample it has still to fork.
    fn cancelled(mut self) -> Vec<Finished> {
        let forks: Vec<u32> = self.forks.drain(..).map(|(i, _)| i).collect();
        let unforked: Vec<Finished> = forks
            .into_iter()
            .map(|index| self.unforked_finish(index, FinishReason::Cancelled))
            .collect();
        let mut out = vec![self.finished(FinishReason::Cancelled)];
        out.extend(unforked);
        out
    }

    /// The `reason` finish of sample `index`, one this sequence has still to fork: no output
    /// (it never drew a token), the prompt and times of this sequence.
    fn unforked_finish(&self, index: u32, reason: FinishReason) -> Finished {
        let since = |t: Option<Instant>| t.map_or(0.0, |t| (t - self.submitted).as_secs_f64());
        Finished {
            request: self.id,
            index,
            prompt_ids: self.tokens[..self.prompt_len].to_vec(),
            output_ids: Vec::new(),
            logprobs: Vec::new(),
            finish_reason: reason,
            error: None,
            cached_prompt_tokens: self.cached_prompt_tokens.unwrap_or(0),
            preemptions: self.preemptions,
            spec_tokens: self.spec_tokens,
            queue_s: since(self.admitted),
            ttft_s: 0.0,
            e2e_s: self.submitted.elapsed().as_secs_f64(),
        }
    }

    /// Takes sample `index` out of this sequence before the prompt's logits are ready, with
    /// its `reason` finish (no output: it never drew a token), or `None` when this sequence
    /// does not stand for it. When `index` is this sequence's own sample, the next sample to
    /// fork takes its place, so the prompt it computes still serves the others.
    fn take_unforked(&mut self, index: u32, reason: FinishReason) -> Option<Finished> {
        if self.forks.is_empty() {
            return None;
        }
        let at = if index == self.index {
            0
        } else {
            self.forks.iter().position(|(i, _)| *i == index)?
        };
        let (next, mut sampler) = self.forks.remove(at);
        if index == self.index {
            for &t in &self.tokens[self.prompt_len..] {
                sampler.record(t);
            }
            self.index = next;
            self.sampler = sampler;
        }
        Some(self.unforked_finish(index, reason))
    }

    fn finished(self, reason: FinishReason) -> Finished {
        let now = Instant::now();
        let since = |t: Option<Instant>| t.map_or(0.0, |t| (t - self.submitted).as_secs_f64());
        let error = match reason {
            FinishReason::Error => Some(
                self.sampler
                    .grammar_failure()
                    .unwrap_or("the request failed")
                    .to_string(),
            ),
            _ => None,
        };
        Finished {
            request: self.id,
            index: self.index,
            prompt_ids: self.tokens[..self.prompt_len].to_vec(),
            output_ids: self.tokens[self.prompt_len..].to_vec(),
            logprobs: self.logprobs,
            finish_reason: reason,
            error,
            cached_prompt_tokens: self.cached_prompt_tokens.unwrap_or(0),
            preemptions: self.preemptions,
            spec_tokens: self.spec_tokens,
            queue_s: since(self.admitted),
            ttft_s: since(self.first_token),
            e2e_s: (now - self.submitted).as_secs_f64(),
        }
    }
}

/// The scheduler over one model and one KV pool: queue requests with [`Engine::add`], then call
/// [`Engine::step`] until [`Engine::has_work`] is false (or [`Engine::generate`] for a batch).
pub struct Engine {
    /// The configuration it was built with.
    pub config: EngineConfig,
    backend: Box<dyn Backend>,
    blocks: BlockManager,
    eos: Vec<u32>,
    /// Compiles requests' grammars (none: requests with a grammar are refused).
    grammars: Option<Arc<GrammarCompiler>>,
    waiting: VecDeque<Seq>,
    /// Oldest admission first; the last one is the first to be preempted.
    running: Vec<Seq>,
    /// Prompts whose KV is being transferred in from a prefill worker: blocks allocated, never
    /// touched by a step until they join (or fall back to a local prefill).
    remote: Vec<Seq>,
    cancelled: Vec<RequestId>,
    /// Samples to finish at the start of the next step: `(request, sample index)`.
    stopped: Vec<(RequestId, u32)>,
    /// Blocks to copy before the next forward (copy-on-write of blocks that samples shared).
    copies: Vec<(BlockId, BlockId)>,
    /// New requests waiting aside for their prefix's blocks from the disk tier.
    loading: Vec<Seq>,
    /// The disk tier under the prefix cache, if configured.
    disk: Option<disk::Disk>,
    /// Decides what runs in each step.
    scheduler: Box<dyn Scheduler>,
    /// What its steps cost (sizes steps under a step target).
    step_cost: StepCost,
    /// What its steps without prompt tokens cost (sizes speculation's proposals: a decode row
    /// costs what a prompt token costs only where both are compute-bound).
    decode_cost: StepCost,
    /// What a draft model's or a self-draft's forwards cost (sizes its proposals before it
    /// drafts).
    draft_cost: StepCost,
    stats: EngineStats,
    /// First id `generate` gives its requests next time.
    next_batch_id: u64,
    /// Speculative decoding, when configured.
    spec: Option<speculate::Speculation>,
    /// The page-locked buffer a device's blocks are exported through (kept between exports).
    staging: Vec<Option<crate::device::staging::Pinned>>,
}
impl Engine {
    /// An engine on the CPU. `eos` lists the token ids that end generation unless a request
    /// ignores EOS.
    pub fn new(model: CpuModel, config: EngineConfig, eos: Vec<u32>) -> Result<Self, EngineError> {
        config.check()?;
        let backend = CpuBackend::new(model, &config.pool())?;
        Self::with_backend(Box::new(backend), config, eos)
    }

    /// An engine whose steps run on `backend` (made with the same `config`).
    pub fn with_backend(
        mut backend: Box<dyn Backend>,
        config: EngineConfig,
        eos: Vec<u32>,
    ) -> Result<Self, EngineError> {
        config.check()?;
        if let Some(crate::SpecMethod::SelfDraft(n)) =
            config.speculative.as_ref().map(|s| &s.method)
        {
            // A backend that cannot stop early says so on an empty step.
            backend
                .forward_layers(&[], *n)
                .map_err(|e| EngineError::Config(format!("--speculative self:{n}: {e}")))?;
            let layers = backend.config().num_layers;
            if *n >= layers {
                return Err(EngineError::Config(format!(
                    "--speculative self:{n}: a self-draft takes fewer than the model's {layers} layers"
                )));
            }
        }
        let spec = match config.speculative.clone() {
            Some(c) => Some(speculate::Speculation::new(
                c,
                backend.as_ref(),
                config.block_size,
                config.kv_dtype,
            )?),
            None => None,
        };
        let blocks = BlockManager::new(backend.num_blocks(), config.block_size);
        let disk = match &config.kv_disk {
            Some(c) => {
                blocks.set_spill(true);
                Some(disk::Disk::open(c, backend.as_ref(), config.block_size)?)
            }
            None => None,
        };
        Ok(Self {
            blocks,
            disk,
            loading: Vec::new(),
            backend,
            config,
            eos,
            grammars: None,
            waiting: VecDeque::new(),
            running: Vec::new(),
            remote: Vec::new(),
            cancelled: Vec::new(),
            stopped: Vec::new(),
            copies: Vec::new(),
            scheduler: Box::new(Continuous),
            step_cost: StepCost::default(),
            decode_cost: StepCost::default(),
            draft_cost: StepCost::default(),
            stats: EngineStats::default(),
            next_batch_id: 1 << 48,
            spec,
            staging: Vec::new(),
        })
    }

    /// Serves requests with grammars (structured outputs), compiling them with `grammars` (the
    /// model's vocabulary).
    pub fn with_grammars(mut self, grammars: Arc<GrammarCompiler>) -> Self {
        self.grammars = Some(grammars);
        self
    }

    /// Schedules the steps from now on with `scheduler` (the default is [`Continuous`]); returns
    /// the one it replaces. What runs or waits stays where it is: the new policy takes over from
    /// the next step.
    pub fn set_scheduler(&mut self, scheduler: Box<dyn Scheduler>) -> Box<dyn Scheduler> {
        std::mem::replace(&mut self.scheduler, scheduler)
    }

    /// The name of the policy that schedules the steps.
    pub fn scheduler_name(&self) -> &'static str {
        self.scheduler.name()
    }

    /// The grammar compiler, if this engine serves grammars.
    pub fn grammars(&self) -> Option<&Arc<GrammarCompiler>> {
        self.grammars.as_ref()
    }

    /// The host KV pool (None when the cache lives on a GPU, or is split over tensor-parallel
    /// ranks: see [`Engine::kv_pools`]).
    pub fn kv_pool(&self) -> Option<&KvPool> {
        self.backend.host_pool()
    }

    /// Every tensor-parallel rank's host KV pool with its KV heads (one pool without tensor
    /// parallelism; none on a GPU).
    pub fn kv_pools(&self) -> Vec<RankPool<'_>> {
        self.backend.host_pools()
    }

    /// The device the steps run on.
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// The model's shape.
    pub fn model_config(&self) -> &ModelConfig {
        self.backend.config()
    }

    /// The CPU model (None on a GPU).
    pub fn cpu_model(&self) -> Option<&CpuModel> {
        self.backend
            .as_any()
            .downcast_ref::<CpuBackend>()
            .map(CpuBackend::model)
    }

    /// The pool's block bookkeeping (counts, prefix cache, events).
    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    /// What a request is checked against: vocabulary, context, block size and pool size.
    pub fn limits(&self) -> Limits {
        Limits {
            vocab_size: self.backend.config().vocab_size,
            max_context: self.backend.config().max_position_embeddings,
            block_size: self.config.block_size,
            total_blocks: self.blocks.counts().total,
            tensor_parallel: self.backend.tp(),
            kv_bytes_per_token: self.backend.kv_bytes_per_token(),
        }
    }

    /// Checks a request against the model and the pool before it is queued.
    pub fn validate(&self, r: &Request) -> Result<(), EngineError> {
        self.limits().validate(r)?;
        if let Some(a) = &r.adapter {
            if !self.backend.supports_lora() {
                return Err(EngineError::Unsupported(format!(
                    "LoRA adapter {:?}: this backend ({}) runs the base model only",
                    a.name,
                    self.backend.device()
                )));
            }
            if !a.fits(self.backend.config()) {
                return Err(EngineError::Unsupported(format!(
                    "LoRA adapter {:?} was read for another base model",
                    a.name
                )));
            }
        }
        Ok(())
    }

    /// Queue, pool and throughput figures now.
    pub fn stats(&self) -> EngineStats {
        let BlockCounts {
            total,
            free,
            cached,
            used,
        } = self.blocks.counts();
        EngineStats {
            running: self.running.len(),
            decoding: self
                .running
                .iter()
                .filter(|s| s.computed >= s.prompt_len)
                .count(),
            itl_target_ms: self
                .config
                .itl_target
                .map_or(0.0, |t| t.as_secs_f64() * 1e3),
            waiting: self.waiting.len(),
            blocks_total: total,
            blocks_free: free,
            blocks_cached: cached,
            blocks_used: used,
            pending_prompt_tokens: self
                .running
                .iter()
                .chain(&self.waiting)
                .filter(|s| s.computed < s.prompt_len)
                .map(|s| (s.prompt_len - s.computed) as u64)
                .sum(),
            collective_seconds: self
                .backend
                .tp_stats()
                .map_or(0.0, |s| s.collective.as_secs_f64()),
            loading: self.loading.len(),
            disk: self.disk.as_ref().map(|d| d.stats).unwrap_or_default(),
            disk_tier: self.disk.as_ref().map(|d| d.tier().stats()),
            parked_tails: self.blocks.tails(),
            step_cost_ms: self.step_cost.fit().map_or([0.0; 3], |c| {
                [c.fixed * 1e3, c.per_token * 1e3, c.per_key * 1e3]
            }),
            ..self.stats
        }
    }

    /// A mixture of experts' rows per expert so far (None for a dense model).
    pub fn expert_load(&self) -> Option<std::sync::Arc<crate::forward::ExpertLoad>> {
        self.backend.expert_load()
    }

    /// Forgets every cached prefix that no running sequence holds (with a disk tier, the blocks
    /// go there first).
    pub fn clear_prefix_cache(&mut self) {
        self.blocks.clear_cache();
        self.spill();
    }

    /// Block-manager events since the last call (for the router's prefix index).
    pub fn drain_kv_events(&self) -> Vec<KvEvent> {
        self.blocks.drain_events()
    }

    /// Whether any request is queued or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty()
            || !self.running.is_empty()
            || !self.cancelled.is_empty()
            || !self.stopped.is_empty()
            || !self.loading.is_empty()
    }

    /// Queues a request.
    pub fn add(&mut self, id: RequestId, mut r: Request) -> Result<(), EngineError> {
        r.compile(self.grammars.as_deref())?;
        self.validate(&r)?;
        let s = self.new_seq(id, r);
        self.enqueue(s);
        Ok(())
    }

    /// Drops every queued and running request (their blocks return to the pool); returns their
    /// ids. For a step that failed: the requests in it cannot be trusted to continue.
    pub fn abort_all(&mut self) -> Vec<RequestId> {
        self.cancelled.clear();
        self.stopped.clear();
        self.copies.clear();
        let mut ids: Vec<RequestId> = self.running.drain(..).map(|s| s.id).collect();
        ids.extend(self.waiting.drain(..).map(|s| s.id));
        ids.extend(self.remote.drain(..).map(|s| s.id));
        ids.extend(self.loading.drain(..).map(|s| s.id));
        // A request's samples are several sequences under one id.
        ids.sort();
        ids.dedup();
        ids
    }

    /// Hands every request over to the workers that take them next (a drain for shutdown):
    /// each running sequence's K/V stays here for them to pull, its whole blocks in the prefix
    /// cache and its partly filled last block parked ([`crate::SeqBlocks::park_tail`]), and
    /// every request leaves (queued ones too); returns their ids, for their streams to end with
    /// [`EngineError::HandedOff`]. Requests added afterwards run as usual.
    pub fn hand_off(&mut self) -> Vec<RequestId> {
        self.cancelled.clear();
        self.stopped.clear();
        let mut ids = Vec::new();
        for mut s in self.running.drain(..) {
            // A sequence that has computed none of its tokens has nothing to park.
            if s.computed > 0 {
                s.blocks.park_tail(&s.tokens, s.computed);
            }
            ids.push(s.id);
        }
        ids.extend(self.waiting.drain(..).map(|s| s.id));
        ids.extend(self.remote.drain(..).map(|s| s.id));
        ids.extend(self.loading.drain(..).map(|s| s.id));
        // Blocks to copy belonged to sequences that are gone.
        self.copies.clear();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Times each op of every step's forward from now on (`on`), each step's split in its
    /// [`StepStats::ops`]; false when the backend cannot (only the CPU's single rank can).
    pub fn profile_ops(&mut self, on: bool) -> bool {
        self.backend.profile_ops(on)
    }

    /// Cancels a request; it leaves (and frees its blocks) at the start of the next step.
    pub fn cancel(&mut self, id: RequestId) {
        self.cancelled.push(id);
    }

    /// Finishes some of a request's samples (`Stop`) while the others go on: the caller found
    /// a stop the engine cannot see (a stop string in the sample's text). Each leaves, freeing
    /// its blocks, at the start of the next step; a sample that has already finished, or an
    /// index the request does not have, is ignored.
    pub fn stop_samples(&mut self, id: RequestId, indices: &[u32]) {
        self.stopped.extend(indices.iter().map(|&i| (id, i)));
    }

    fn new_seq(&self, id: RequestId, r: Request) -> Seq {
        let Samples { count, first } = r.samples;
        let priority = r.priority;
        let forks = (first + 1..first + count)
            .map(|i| {
                let c = r.constraint.as_ref().map(tandem_grammar::Constraint::fork);
                (i, Sampler::for_sample(r.params.clone(), &r.prompt, c, i))
            })
            .collect();
        let mut sampler = Sampler::for_sample(r.params, &r.prompt, r.constraint, first);
        for &t in &r.resume {
            sampler.record(t);
        }
        let prompt_len = r.prompt.len();
        let root = tandem_model::chain_root(r.adapter.as_ref().map(|a| a.content_hash));
        let adapter = r.adapter;
        let mut tokens = r.prompt;
        tokens.extend(&r.resume);
        Seq {
            id,
            index: first,
            forks,
            prompt_len,
            sampler,
            tokens,
            computed: 0,
            blocks: self.blocks.sequence_from(root),
            logprobs: Vec::new(),
            submitted: Instant::now(),
            admitted: None,
            first_token: None,
            cached_prompt_tokens: None,
            preemptions: 0,
            passed: 0,
            export: None,
            awaits: Vec::new(),
            draft: Vec::new(),
            window: Vec::new(),
            accept: speculate::Acceptance::default(),
            spec_tokens: (0, 0),
            draft_overhead: 0.0,
            priority,
            adapter,
        }
    }

    /// Queues `s` behind every waiting sequence of its band or a higher one (a new arrival).
    fn queue_back(&mut self, s: Seq) {
        let at = self
            .waiting
            .iter()
            .position(|w| w.priority < s.priority)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(at, s);
    }

    /// Queues `s` ahead of every waiting sequence of its band (one that held blocks: a
    /// preempted sequence, a fork without room, a failed remote prefill), behind the higher
    /// bands.
    fn queue_front(&mut self, s: Seq) {
        let at = self
            .waiting
            .iter()
            .position(|w| w.priority <= s.priority)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(at, s);
    }

    /// Where a sequence of band `priority` joins the running set: after every sequence of its
    /// band or a higher one.
    fn running_slot(&self, priority: i32) -> usize {
        self.running
            .iter()
            .position(|r| r.priority < priority)
            .unwrap_or(self.running.len())
    }

    /// Puts `s` into the running set at its band's end; returns its index.
    fn run_seq(&mut self, s: Seq) -> usize {
        let at = self.running_slot(s.priority);
        self.running.insert(at, s);
        at
    }
}

#[cfg(test)]
mod fake_backend;
#[cfg(test)]
pub(crate) mod tests;

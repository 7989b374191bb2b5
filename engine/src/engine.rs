//! The engine: an iteration-level scheduler over one KV pool and one packed forward per step.
//!
//! Requests wait in arrival order. Each [`Engine::step`]:
//! 1. drops cancelled sequences (their blocks return to the pool at once);
//! 2. schedules one token for every running sequence that is decoding, oldest first;
//! 3. gives the rest of the token budget (`max_batched_tokens`) to prompt chunks: first running
//!    sequences whose prompt is partly done, then new ones from the head of the queue (first come,
//!    first served: the head is never skipped, so nothing starves), up to `max_seqs` running. A new
//!    sequence first takes over the longest cached prefix of its tokens from the block manager;
//! 4. runs one forward over everything scheduled, samples the sequences whose tokens are all in
//!    the cache, and retires the finished ones.
//!
//! When a running sequence needs a block and the pool is empty (cached prefixes are evicted
//! first), the newest running sequence is preempted: its blocks are released and it goes back to the
//! head of the queue with its generated tokens, to be recomputed (mostly from the prefix cache)
//! later. A step never fails for lack of blocks.

use std::collections::VecDeque;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::backend::Backend;
use crate::block_manager::{BlockCounts, BlockManager, KvEvent, SeqBlocks};
use crate::kv_cache::{KvDtype, KvPool};
use crate::model::{LlamaModel, SeqBatch};
use crate::sampler::{Sampled, Sampler};
use crate::EngineError;
use tandem_model::LlamaConfig;
use tandem_types::ValidSampling;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV pool size in MiB.
    pub kv_cache_mb: usize,
    /// Element type of the KV cache.
    pub kv_dtype: KvDtype,
    /// Token budget of one forward (prompt chunks plus decode tokens).
    pub max_batched_tokens: usize,
    /// Most sequences running at once.
    pub max_seqs: usize,
    /// Reuse cached prefix blocks across requests.
    pub prefix_caching: bool,
    /// Exact pool size in blocks, overriding `kv_cache_mb`.
    pub num_blocks: Option<usize>,
    /// Tokens of growth per running sequence that admission keeps room for (0: admit whenever
    /// the first chunk fits). Preemption covers what this misses; on the mixed workload, admitting
    /// without it preempted 39 of 200 requests.
    pub admission_lookahead: usize,
    /// Test hook: every step takes this many times as long as it computed (the engine sleeps for
    /// the rest, counted in the step's time), so this machine behaves like one that much slower.
    /// `TANDEM_TEST_SLOWDOWN` sets it for the CLI's engines; 1 in production.
    pub slowdown: f64,
}

impl EngineConfig {
    /// Refuses sizes that make no engine (before any memory is sized from them).
    pub fn check(&self) -> Result<(), EngineError> {
        if !(self.slowdown.is_finite() && self.slowdown >= 1.0) {
            return Err(EngineError::Config(format!(
                "slowdown {} must be a number of at least 1",
                self.slowdown
            )));
        }
        if self.block_size == 0 || self.max_batched_tokens == 0 || self.max_seqs == 0 {
            return Err(EngineError::Config(
                "block size, batch budget and max seqs must be positive".into(),
            ));
        }
        Ok(())
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_mb: 1024,
            kv_dtype: KvDtype::F32,
            max_batched_tokens: 2048,
            max_seqs: 256,
            prefix_caching: true,
            num_blocks: None,
            admission_lookahead: 64,
            slowdown: 1.0,
        }
    }
}

/// Identifies a request within one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct RequestId(pub u64);

/// A generation request: prompt token ids and sampling.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: ValidSampling,
    /// Output tokens this request already produced elsewhere (a stream migrated from a worker
    /// that died): they are prefilled after the prompt, count toward `max_tokens` and the
    /// penalties, and generation continues after them. Usually empty.
    pub resume: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// Hit max_tokens or the context limit.
    Length,
    /// Produced EOS (not ignored) or a stop token.
    Stop,
    /// Cancelled by the client.
    Cancelled,
}

/// Emitted for every generated token.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    pub request: RequestId,
    pub sampled: Sampled,
    /// Set on the request's last token.
    pub finish: Option<FinishReason>,
}

/// A request that left the engine (after its last token, or on cancel).
#[derive(Clone, Debug, Serialize)]
pub struct Finished {
    pub request: RequestId,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
    /// Prompt tokens whose K/V came from the prefix cache at first admission.
    pub cached_prompt_tokens: usize,
    /// Times the request was preempted and recomputed.
    pub preemptions: u32,
    /// Seconds from submission to admission, to the first token, and to the end.
    pub queue_s: f64,
    pub ttft_s: f64,
    pub e2e_s: f64,
}

/// What one step produced.
#[derive(Clone, Debug)]
pub enum Event {
    /// KV blocks of a prefill-mode request ([`Engine::add_prefill`]), as soon as a chunk has
    /// filled them; always before that request's token.
    Kv(KvChunk),
    Token(TokenEvent),
    Finished(Finished),
}

/// Consecutive KV blocks of a prefill-mode request, copied out in the KV wire layout.
#[derive(Clone, Debug)]
pub struct KvChunk {
    pub request: RequestId,
    /// Index of the first block among the blocks the receiver asked for (block 0 holds the
    /// tokens right after its `skip_tokens`).
    pub first: usize,
    pub blocks: usize,
    /// Per layer, the blocks' frames back to back (each `frame_len` bytes).
    pub layers: Vec<Vec<u8>>,
    pub frame_len: usize,
}

impl KvChunk {
    /// One layer of the `j`-th block of this chunk: one frame's payload.
    pub fn frame(&self, layer: usize, j: usize) -> &[u8] {
        &self.layers[layer][j * self.frame_len..(j + 1) * self.frame_len]
    }
}

/// Timing of one engine step, for benchmarks.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepStats {
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    /// Rows that ran the output head (the last new token of each sequence that samples).
    pub logit_rows: usize,
    /// Keys attended to, summed over the step's rows (a row at position p sees p + 1 keys): the
    /// attention's work.
    pub attended_keys: u64,
    /// Cached plus new tokens of every sequence in the step: the KV the step must read.
    pub context_tokens: u64,
    pub seconds: f64,
}

/// The engine's state at a glance.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub blocks_total: usize,
    pub blocks_free: usize,
    pub blocks_cached: usize,
    pub blocks_used: usize,
    /// Prompt tokens looked up in the prefix cache at admission, and how many were found.
    pub prefix_lookup_tokens: u64,
    pub prefix_hit_tokens: u64,
    pub preemptions: u64,
    pub steps: u64,
    /// Prompt tokens admitted (running or waiting) and not computed yet: the prefill work queued.
    pub pending_prompt_tokens: u64,
    /// Prompt tokens computed a second, averaged over recent steps that computed any (0 before the
    /// first such step).
    pub prefill_tokens_per_s: f64,
}

/// Weight of the newest step in [`EngineStats::prefill_tokens_per_s`].
const RATE_WEIGHT: f64 = 0.25;

impl EngineStats {
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prefix_lookup_tokens == 0 {
            0.0
        } else {
            self.prefix_hit_tokens as f64 / self.prefix_lookup_tokens as f64
        }
    }
}

/// What the engine checks a request against, without touching the engine (the handle validates
/// on the caller's thread with a copy).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub vocab_size: usize,
    pub max_context: usize,
    pub block_size: usize,
    pub total_blocks: usize,
}

impl Limits {
    /// A request is accepted only if, alone, it fits the model's context and the whole pool, so
    /// preemption can always make room for the oldest sequence.
    pub fn validate(&self, r: &Request) -> Result<(), EngineError> {
        if r.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let known = r.prompt.iter().chain(&r.resume);
        if let Some(&bad) = known.clone().find(|&&t| t as usize >= self.vocab_size) {
            return Err(EngineError::BadToken {
                id: bad,
                vocab: self.vocab_size,
            });
        }
        if r.resume.len() >= r.params.max_tokens as usize {
            return Err(EngineError::NothingToResume {
                resume: r.resume.len(),
                max_tokens: r.params.max_tokens,
            });
        }
        if known.count() >= self.max_context {
            return Err(EngineError::ContextOverflow {
                tokens: r.prompt.len() + r.resume.len() + 1,
                max: self.max_context,
            });
        }
        let tokens = (r.prompt.len() + r.params.max_tokens as usize).min(self.max_context);
        let need = tokens.div_ceil(self.block_size);
        if need > self.total_blocks {
            return Err(EngineError::TooLargeForCache {
                need,
                total: self.total_blocks,
            });
        }
        Ok(())
    }
}

/// Why `s` stops after `token` (already appended), if it does.
fn finish_reason(eos: &[u32], max_ctx: usize, s: &Seq, token: u32) -> Option<FinishReason> {
    let p = s.sampler.params();
    let generated = s.tokens.len() - s.prompt_len;
    if p.stop_token_ids.contains(&token) || (!p.ignore_eos && eos.contains(&token)) {
        Some(FinishReason::Stop)
    } else if generated >= p.max_tokens as usize || s.tokens.len() >= max_ctx {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// Blocks set aside for a prompt whose KV comes from a prefill worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// Leading prompt tokens already in this engine's prefix cache (a multiple of the block
    /// size): the prefill worker sends only what follows.
    pub cached_tokens: usize,
    /// Destination blocks for tokens `cached_tokens..`, in order (the last may be partial).
    pub blocks: Vec<u32>,
}

struct Seq {
    id: RequestId,
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
    /// Prefill mode: `(first prompt block to export, next block to export)`.
    export: Option<(usize, usize)>,
}

impl Seq {
    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Blocks still needed to hold the whole prompt and `lookahead` more tokens (or to finish,
    /// if sooner).
    fn growth_blocks(&self, block_size: usize, lookahead: usize, max_ctx: usize) -> usize {
        let end = (self.prompt_len + self.sampler.params().max_tokens as usize).min(max_ctx);
        let target = end
            .min(self.tokens.len() + lookahead)
            .max(self.tokens.len());
        target
            .div_ceil(block_size)
            .saturating_sub(self.blocks.len())
    }

    fn finished(self, reason: FinishReason) -> Finished {
        let now = Instant::now();
        let since = |t: Option<Instant>| t.map_or(0.0, |t| (t - self.submitted).as_secs_f64());
        Finished {
            request: self.id,
            prompt_ids: self.tokens[..self.prompt_len].to_vec(),
            output_ids: self.tokens[self.prompt_len..].to_vec(),
            logprobs: self.logprobs,
            finish_reason: reason,
            cached_prompt_tokens: self.cached_prompt_tokens.unwrap_or(0),
            preemptions: self.preemptions,
            queue_s: since(self.admitted),
            ttft_s: since(self.first_token),
            e2e_s: (now - self.submitted).as_secs_f64(),
        }
    }
}

pub struct Engine {
    pub config: EngineConfig,
    backend: Backend,
    blocks: BlockManager,
    eos: Vec<u32>,
    waiting: VecDeque<Seq>,
    /// Oldest admission first; the last one is the first to be preempted.
    running: Vec<Seq>,
    /// Prompts whose KV is being transferred in from a prefill worker: blocks allocated, never
    /// touched by a step until they join (or fall back to a local prefill).
    remote: Vec<Seq>,
    cancelled: Vec<RequestId>,
    stats: EngineStats,
    /// First id `generate` gives its requests next time.
    next_batch_id: u64,
}

impl Engine {
    /// An engine on the CPU. `eos` lists the token ids that end generation unless a request
    /// ignores EOS.
    pub fn new(
        model: LlamaModel,
        config: EngineConfig,
        eos: Vec<u32>,
    ) -> Result<Self, EngineError> {
        config.check()?;
        let backend = Backend::cpu(model, &config)?;
        Self::with_backend(backend, config, eos)
    }

    /// An engine whose steps run on `backend` (made with the same `config`).
    pub fn with_backend(
        backend: Backend,
        config: EngineConfig,
        eos: Vec<u32>,
    ) -> Result<Self, EngineError> {
        config.check()?;
        Ok(Self {
            blocks: BlockManager::new(backend.num_blocks(), config.block_size),
            backend,
            config,
            eos,
            waiting: VecDeque::new(),
            running: Vec::new(),
            remote: Vec::new(),
            cancelled: Vec::new(),
            stats: EngineStats::default(),
            next_batch_id: 1 << 48,
        })
    }

    /// The host KV pool (None when the cache lives on a GPU).
    pub fn kv_pool(&self) -> Option<&KvPool> {
        self.backend.host_pool()
    }

    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The model's shape.
    pub fn model_config(&self) -> &LlamaConfig {
        self.backend.config()
    }

    /// The CPU model (None on a GPU).
    pub fn cpu_model(&self) -> Option<&LlamaModel> {
        match &self.backend {
            Backend::Cpu { model, .. } => Some(model),
            Backend::Cuda(_) => None,
        }
    }

    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    pub fn limits(&self) -> Limits {
        Limits {
            vocab_size: self.backend.config().vocab_size,
            max_context: self.backend.config().max_position_embeddings,
            block_size: self.config.block_size,
            total_blocks: self.blocks.counts().total,
        }
    }

    /// Checks a request against the model and the pool before it is queued.
    pub fn validate(&self, r: &Request) -> Result<(), EngineError> {
        self.limits().validate(r)
    }

    pub fn stats(&self) -> EngineStats {
        let BlockCounts {
            total,
            free,
            cached,
            used,
        } = self.blocks.counts();
        EngineStats {
            running: self.running.len(),
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
            ..self.stats
        }
    }

    /// Forgets every cached prefix that no running sequence holds.
    pub fn clear_prefix_cache(&self) {
        self.blocks.clear_cache();
    }

    /// Block-manager events since the last call (for the router's prefix index).
    pub fn drain_kv_events(&self) -> Vec<KvEvent> {
        self.blocks.drain_events()
    }

    /// Whether any request is queued or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.cancelled.is_empty()
    }

    /// Queues a request.
    pub fn add(&mut self, id: RequestId, r: Request) -> Result<(), EngineError> {
        self.validate(&r)?;
        let s = self.new_seq(id, r);
        self.waiting.push_back(s);
        Ok(())
    }

    /// Drops every queued and running request (their blocks return to the pool); returns their
    /// ids. For a step that failed: the requests in it cannot be trusted to continue.
    pub fn abort_all(&mut self) -> Vec<RequestId> {
        self.cancelled.clear();
        let mut ids: Vec<RequestId> = self.running.drain(..).map(|s| s.id).collect();
        ids.extend(self.waiting.drain(..).map(|s| s.id));
        ids.extend(self.remote.drain(..).map(|s| s.id));
        ids
    }

    /// Cancels a request; it leaves (and frees its blocks) at the start of the next step.
    pub fn cancel(&mut self, id: RequestId) {
        self.cancelled.push(id);
    }

    fn new_seq(&self, id: RequestId, r: Request) -> Seq {
        let mut sampler = Sampler::new(r.params, &r.prompt);
        for &t in &r.resume {
            sampler.record(t);
        }
        let prompt_len = r.prompt.len();
        let mut tokens = r.prompt;
        tokens.extend(&r.resume);
        Seq {
            id,
            prompt_len,
            sampler,
            tokens,
            computed: 0,
            blocks: self.blocks.sequence(),
            logprobs: Vec::new(),
            submitted: Instant::now(),
            admitted: None,
            first_token: None,
            cached_prompt_tokens: None,
            preemptions: 0,
            export: None,
        }
    }

    /// The decode side of a remote prefill, step one: allocates blocks for the whole prompt,
    /// reusing this engine's prefix cache, and parks the request until its KV arrives. `None`
    /// when the pool cannot hold it now (prefill it locally with [`Engine::add`] instead).
    /// The returned blocks are the transfer's destination; the engine does not touch them until
    /// [`Engine::join_remote`] or [`Engine::prefill_locally`].
    pub fn reserve_remote(
        &mut self,
        id: RequestId,
        r: Request,
    ) -> Result<Option<Reservation>, EngineError> {
        self.validate(&r)?;
        self.check_host_cache()?;
        if !r.resume.is_empty() {
            return Err(EngineError::BadPlan(
                "a resumed request is prefilled where it decodes".into(),
            ));
        }
        let mut s = self.new_seq(id, r);
        let hit = if self.config.prefix_caching {
            s.blocks.reuse_prefix(&s.tokens)
        } else {
            0
        };
        if !s.blocks.reserve(s.prompt_len) {
            return Ok(None);
        }
        self.stats.prefix_lookup_tokens += s.prompt_len as u64;
        self.stats.prefix_hit_tokens += hit as u64;
        s.computed = hit;
        s.cached_prompt_tokens = Some(hit);
        s.admitted = Some(Instant::now());
        let bs = self.config.block_size;
        let reservation = Reservation {
            cached_tokens: hit,
            blocks: s.blocks.ids()[hit / bs..].to_vec(),
        };
        self.remote.push(s);
        Ok(Some(reservation))
    }

    /// Step two: every reserved block holds its K/V and `first` is the token the prefill worker
    /// sampled. The request joins the running batch (decoding from the next step); its prompt
    /// blocks enter the prefix cache. Returns the first token's events.
    pub fn join_remote(
        &mut self,
        id: RequestId,
        first: Sampled,
    ) -> Result<Vec<Event>, EngineError> {
        let i = self
            .remote
            .iter()
            .position(|s| s.id == id)
            .ok_or(EngineError::NotParked(id.0))?;
        let mut s = self.remote.remove(i);
        s.computed = s.prompt_len;
        s.blocks.commit(&s.tokens, s.computed);
        s.sampler.record(first.token);
        s.first_token = Some(Instant::now());
        s.tokens.push(first.token);
        s.logprobs.push(first.logprob);
        let finish = finish_reason(
            &self.eos,
            self.backend.config().max_position_embeddings,
            &s,
            first.token,
        );
        let mut events = vec![Event::Token(TokenEvent {
            request: id,
            sampled: first,
            finish,
        })];
        match finish {
            Some(r) => events.push(Event::Finished(s.finished(r))),
            None => self.running.push(s),
        }
        Ok(events)
    }

    /// The transfer failed: the request is prefilled here, ahead of the queue, in the blocks it
    /// already holds (whatever a broken transfer left in them is recomputed).
    pub fn prefill_locally(&mut self, id: RequestId) -> bool {
        match self.remote.iter().position(|s| s.id == id) {
            Some(i) => {
                let s = self.remote.remove(i);
                self.waiting.push_front(s);
                true
            }
            None => false,
        }
    }

    /// Queues a request in prefill mode (a prefill worker's side of a remote prefill): it is
    /// scheduled, chunked and batched like any other, reuses this engine's prefix cache, and
    /// emits its prompt's blocks from `skip_tokens` on as [`Event::Kv`] chunks as soon as each
    /// step fills them, then its first token, and finishes (it never decodes).
    pub fn add_prefill(
        &mut self,
        id: RequestId,
        mut r: Request,
        skip_tokens: usize,
    ) -> Result<(), EngineError> {
        self.check_host_cache()?;
        let bs = self.config.block_size;
        if !skip_tokens.is_multiple_of(bs) || skip_tokens >= r.prompt.len() {
            return Err(EngineError::BadPlan(format!(
                "skip_tokens {skip_tokens} must be a multiple of the block size {bs} below the prompt length {}",
                r.prompt.len()
            )));
        }
        if !r.resume.is_empty() {
            return Err(EngineError::BadPlan(
                "a prefill-mode request has no output to resume".into(),
            ));
        }
        r.params = r.params.with_max_tokens(std::num::NonZeroU32::MIN);
        self.validate(&r)?;
        let mut s = self.new_seq(id, r);
        s.export = Some((skip_tokens / bs, skip_tokens / bs));
        self.waiting.push_back(s);
        Ok(())
    }

    /// KV transfers read and write the host pool; a GPU's cache has none yet.
    fn check_host_cache(&self) -> Result<(), EngineError> {
        match self.backend.host_pool() {
            Some(_) => Ok(()),
            None => Err(EngineError::Unsupported(format!(
                "KV transfer to or from a {} cache is not supported: run prefill and decode workers that exchange KV with --device cpu",
                self.backend.device()
            ))),
        }
    }

    /// The prompt blocks of a prefill-mode `s` that are complete now and not yet exported, copied
    /// out (the last, partial block once the whole prompt is computed).
    fn export_ready(kv: &KvPool, bs: usize, s: &mut Seq) -> Option<KvChunk> {
        let (skip, next) = s.export?;
        let upto = if s.computed >= s.prompt_len {
            s.prompt_len.div_ceil(bs)
        } else {
            s.computed / bs
        };
        if upto <= next {
            return None;
        }
        let ids = &s.blocks.ids()[next..upto];
        let frame_len = KvPool::frame_bytes(kv.layout, kv.dtype);
        let mut tmp = Vec::new();
        let layers = (0..kv.num_layers)
            .map(|layer| {
                let mut out = Vec::with_capacity(frame_len * ids.len());
                for &b in ids {
                    match kv.block_bytes(layer, b as usize) {
                        Some(bytes) => out.extend_from_slice(bytes),
                        None => {
                            kv.read_block(layer, b as usize, &mut tmp);
                            out.extend_from_slice(&tmp);
                        }
                    }
                }
                out
            })
            .collect();
        s.export = Some((skip, upto));
        Some(KvChunk {
            request: s.id,
            first: next - skip,
            blocks: upto - next,
            layers,
            frame_len,
        })
    }

    /// One scheduling iteration and one forward. Returns this step's events, in order.
    pub fn step(&mut self) -> Result<(Vec<Event>, StepStats), EngineError> {
        let mut events = Vec::new();
        self.drop_cancelled(&mut events);
        let plan = self.schedule();
        if plan.is_empty() {
            return Ok((events, StepStats::default()));
        }
        self.stats.steps += 1;
        let t0 = Instant::now();
        // Only the slowdown test hook reads it (a system call, kept off the normal step).
        let cpu0 = if self.config.slowdown > 1.0 {
            process_cpu_seconds()
        } else {
            None
        };
        let batch: Vec<SeqBatch<'_>> = plan
            .iter()
            .map(|&(i, take)| {
                let s = &self.running[i];
                SeqBatch {
                    tokens: &s.tokens[s.computed..s.computed + take],
                    cached: s.computed,
                    block_table: s.blocks.ids(),
                    want_logits: s.computed + take == s.tokens.len(),
                }
            })
            .collect();
        // Where the device picks tokens itself and every sampler in the step takes the argmax,
        // only the picks come back (the logits are rows × vocabulary floats).
        let argmax_only = self.backend.picks_on_device()
            && plan.iter().all(|&(i, take)| {
                let s = &self.running[i];
                s.computed + take < s.tokens.len() || s.sampler.argmax_only()
            });
        let (logits, picks) = if argmax_only {
            (Vec::new(), self.backend.forward_argmax(&batch)?)
        } else {
            (self.backend.forward(&batch)?, Vec::new())
        };
        let vocab = self.backend.config().vocab_size;
        let max_ctx = self.backend.config().max_position_embeddings;
        let mut stats = StepStats::default();
        let mut finished = Vec::new();
        // Every sequence that completes its tokens this step samples one, from its row of logits
        // (rows in plan order) or the device's pick. The rows are sampled in parallel: each
        // sampler is its own sequence's, and a row is a whole vocabulary to scan.
        let mut row_of = vec![None; self.running.len()];
        let mut rows = 0;
        for &(i, take) in &plan {
            let s = &self.running[i];
            if s.computed + take == s.tokens.len() {
                row_of[i] = Some(rows);
                rows += 1;
            }
        }
        let mut sampled: Vec<Option<Sampled>> = self
            .running
            .iter_mut()
            .zip(&row_of)
            .map(|(s, row)| row.map(|r| (&mut s.sampler, r)))
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|job| {
                job.map(|(sampler, r)| match picks.get(r) {
                    Some(&(token, logprob)) => sampler.accept(token, logprob),
                    None => sampler.sample(&logits[r * vocab..(r + 1) * vocab]),
                })
            })
            .collect();
        for &(i, take) in &plan {
            let s = &mut self.running[i];
            let (cached, new) = (s.computed as u64, take as u64);
            stats.attended_keys += new * cached + new * (new + 1) / 2;
            stats.context_tokens += cached + new;
            if s.computed + take == s.tokens.len() {
                stats.logit_rows += 1;
            }
            if s.pending() == 1 && s.computed >= s.prompt_len {
                stats.decode_tokens += take;
            } else {
                stats.prefill_tokens += take;
            }
            s.computed += take;
            s.blocks.commit(&s.tokens, s.computed);
            if let Some(kv) = self.backend.host_pool() {
                if let Some(chunk) = Self::export_ready(kv, self.config.block_size, s) {
                    events.push(Event::Kv(chunk));
                }
            }
            if s.computed < s.tokens.len() {
                continue;
            }
            let sampled = sampled[i]
                .take()
                .expect("a sequence that completed its tokens has a row");
            s.first_token.get_or_insert_with(Instant::now);
            s.tokens.push(sampled.token);
            s.logprobs.push(sampled.logprob);
            let finish = finish_reason(&self.eos, max_ctx, s, sampled.token);
            events.push(Event::Token(TokenEvent {
                request: s.id,
                sampled,
                finish,
            }));
            if let Some(r) = finish {
                finished.push((i, r));
            }
        }
        // Highest index first so the earlier indices stay valid, then back in step order.
        let mut gone: Vec<_> = finished
            .iter()
            .rev()
            .map(|&(i, r)| (self.running.remove(i), r))
            .collect();
        gone.reverse();
        events.extend(
            gone.into_iter()
                .map(|(s, r)| Event::Finished(s.finished(r))),
        );
        if self.config.slowdown > 1.0 {
            // The step's running time: its wall time, but no more than the CPU time the process
            // spent meanwhile, so that a step the process was stopped (SIGSTOP) in the middle of
            // is not stretched by the stop.
            let wall = t0.elapsed().as_secs_f64();
            let spent = match (cpu0, process_cpu_seconds()) {
                (Some(a), Some(b)) => wall.min(b - a),
                _ => wall,
            };
            std::thread::sleep(std::time::Duration::from_secs_f64(
                spent * (self.config.slowdown - 1.0),
            ));
        }
        stats.seconds = t0.elapsed().as_secs_f64();
        self.record_timing(&stats);
        Ok((events, stats))
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
            let s = if let Some(i) = self.running.iter().position(|s| s.id == id) {
                self.running.remove(i)
            } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
                self.waiting.remove(i).expect("index from position")
            } else if let Some(i) = self.remote.iter().position(|s| s.id == id) {
                self.remote.remove(i)
            } else {
                continue; // already finished
            };
            events.push(Event::Finished(s.finished(FinishReason::Cancelled)));
        }
    }

    /// Decides this step's work: `(index into running, new tokens)`, decodes first.
    fn schedule(&mut self) -> Vec<(usize, usize)> {
        let mut budget = self.config.max_batched_tokens;
        let mut plan: Vec<(usize, usize)> = Vec::new();
        // Decodes, oldest first, then chunks of partly computed prompts (or recomputes).
        for decoding in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let s = &self.running[i];
                if (s.pending() == 1) != decoding {
                    i += 1;
                    continue;
                }
                let take = s.pending().min(budget);
                if !self.make_room(i, take, &plan) {
                    // `i` itself was preempted: the sequences after it were preempted first, so
                    // nothing after it is left.
                    break;
                }
                plan.push((i, take));
                budget -= take;
                i += 1;
            }
        }
        // New sequences from the head of the queue, while the pool has room for them and for
        // the running ones to grow a while: admitting into that headroom only buys a preemption
        // (and a recompute) a few steps later.
        let mut headroom: usize = self.running.iter().map(|r| self.growth_blocks(r)).sum();
        while budget > 0 && self.running.len() < self.config.max_seqs {
            let Some(s) = self.waiting.front_mut() else {
                break;
            };
            let mut hit = 0;
            if self.config.prefix_caching && s.blocks.is_empty() {
                hit = s.blocks.reuse_prefix(&s.tokens);
                s.computed = hit;
            }
            let take = s.pending().min(budget);
            let own = s.growth_blocks(
                self.config.block_size,
                self.config.admission_lookahead,
                self.backend.config().max_position_embeddings,
            );
            let fits = self.running.is_empty() || self.blocks.available() >= own + headroom;
            if !fits || !s.blocks.reserve(s.computed + take) {
                // Not now: give the reused blocks back (they stay cached) and keep its place.
                s.blocks.clear();
                s.computed = 0;
                break;
            }
            self.stats.prefix_lookup_tokens += s.tokens.len() as u64;
            self.stats.prefix_hit_tokens += hit as u64;
            let mut s = self.waiting.pop_front().expect("front exists");
            s.cached_prompt_tokens.get_or_insert(hit.min(s.prompt_len));
            s.admitted.get_or_insert_with(Instant::now);
            headroom += self.growth_blocks(&s);
            self.running.push(s);
            plan.push((self.running.len() - 1, take));
            budget -= take;
        }
        plan
    }

    /// Blocks `s` still needs to hold its whole prompt and `admission_lookahead` more tokens (or
    /// to finish, if sooner).
    fn growth_blocks(&self, s: &Seq) -> usize {
        s.growth_blocks(
            self.config.block_size,
            self.config.admission_lookahead,
            self.backend.config().max_position_embeddings,
        )
    }

    /// Ensures `running[i]` has blocks for `take` more tokens, preempting the newest running
    /// sequences not yet planned this step. False if `running[i]` itself had to go.
    fn make_room(&mut self, i: usize, take: usize, plan: &[(usize, usize)]) -> bool {
        loop {
            let s = &mut self.running[i];
            if s.blocks.reserve(s.computed + take) {
                return true;
            }
            // Planned sequences are all older than i (indices below i), so the newest unplanned
            // one is the last in the list.
            let victim = self.running.len() - 1;
            debug_assert!(plan.iter().all(|&(p, _)| p < i));
            self.preempt(victim);
            if victim == i {
                return false;
            }
        }
    }

    /// Releases a running sequence's blocks and puts it at the head of the queue.
    fn preempt(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        s.blocks.clear();
        s.computed = 0;
        s.preemptions += 1;
        self.stats.preemptions += 1;
        tracing::debug!(request = s.id.0, tokens = s.tokens.len(), "preempted");
        self.waiting.push_front(s);
    }

    /// Runs requests to completion as one continuous batch; `on_token` sees every token as it is
    /// produced, `on_step` every step's timing. Outputs come back in request order.
    pub fn generate(
        &mut self,
        requests: Vec<Request>,
        mut on_token: impl FnMut(&TokenEvent),
        mut on_step: impl FnMut(&StepStats),
    ) -> Result<Vec<Finished>, EngineError> {
        for r in &requests {
            self.validate(r)?;
        }
        let n = requests.len();
        let base = self.next_batch_id;
        self.next_batch_id += n as u64;
        for (i, r) in requests.into_iter().enumerate() {
            self.add(RequestId(base + i as u64), r)?;
        }
        let mut done: Vec<Option<Finished>> = (0..n).map(|_| None).collect();
        while self.has_work() {
            let (events, st) = self.step()?;
            for e in events {
                match e {
                    Event::Token(t) => on_token(&TokenEvent {
                        request: RequestId(t.request.0 - base),
                        ..t
                    }),
                    Event::Finished(f) => {
                        let i = (f.request.0 - base) as usize;
                        done[i] = Some(Finished {
                            request: RequestId(i as u64),
                            ..f
                        });
                    }
                    Event::Kv(_) => {}
                }
            }
            on_step(&st);
        }
        done.into_iter()
            .map(|o| o.ok_or_else(|| EngineError::Internal("request lost".into())))
            .collect()
    }

    /// Last-position logits of a prompt (one prefill, nothing kept): for checks against a reference.
    pub fn prompt_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.validate(&Request {
            prompt: prompt.to_vec(),
            params: ValidSampling::greedy(std::num::NonZeroU32::MIN),
            resume: Vec::new(),
        })?;
        let mut blocks = self.blocks.sequence();
        if !blocks.reserve(prompt.len()) {
            return Err(EngineError::TooLargeForCache {
                need: prompt.len().div_ceil(self.config.block_size),
                total: self.blocks.available(),
            });
        }
        let batch = [SeqBatch {
            tokens: prompt,
            cached: 0,
            block_table: blocks.ids(),
            want_logits: true,
        }];
        self.backend.forward(&batch)
    }
}

/// CPU time used by this process so far, every thread together (Unix).
fn process_cpu_seconds() -> Option<f64> {
    #[cfg(unix)]
    {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec we own.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::tiny_model;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use tandem_types::SamplingParams;

    /// A greedy request that runs to `max_tokens`.
    pub(crate) fn req(prompt: Vec<u32>, max_tokens: u32) -> Request {
        Request {
            prompt,
            params: SamplingParams {
                max_tokens,
                ignore_eos: true,
                ..Default::default()
            }
            .validate()
            .unwrap(),
            resume: Vec::new(),
        }
    }

    fn engine(cfg: EngineConfig) -> Engine {
        Engine::new(tiny_model(1), cfg, vec![]).unwrap()
    }

    /// The defaults with a pool sized for the tiny model (still thousands of blocks): the
    /// default gigabyte would be faulted in by every engine a test makes.
    pub(crate) fn config() -> EngineConfig {
        EngineConfig {
            kv_cache_mb: 16,
            ..EngineConfig::default()
        }
    }

    #[test]
    fn step_stats_count_the_work_of_each_step() {
        // Two prompts of 5 and 3 tokens, a 4-token budget: step 1 prefills 4 of the first; step
        // 2 its last token (which samples) and 3 of the second, which samples too; then both
        // decode together.
        let mut e = engine(EngineConfig {
            max_batched_tokens: 4,
            ..config()
        });
        let mut steps = Vec::new();
        e.generate(
            vec![req(vec![3, 4, 5, 6, 7], 2), req(vec![8, 9, 10], 2)],
            |_| {},
            |s| steps.push(*s),
        )
        .unwrap();
        let got: Vec<_> = steps
            .iter()
            .map(|s| {
                (
                    s.prefill_tokens,
                    s.decode_tokens,
                    s.logit_rows,
                    s.attended_keys,
                    s.context_tokens,
                )
            })
            .collect();
        // Keys: a row at position p sees p + 1. Step 1: 1+2+3+4. Step 2: the first prompt's
        // last row sees 5, the second prompt's rows 1, 2 and 3. Step 3: positions 5 and 3 see 6
        // and 4.
        assert_eq!(
            got,
            vec![
                (4, 0, 0, 10, 4),
                (4, 0, 2, 5 + 6, 5 + 3),
                (0, 2, 2, 6 + 4, 6 + 4)
            ]
        );
    }

    #[test]
    fn stats_tell_the_queued_prompt_work_and_the_measured_speed() {
        let mut e = engine(EngineConfig {
            max_batched_tokens: 4,
            ..config()
        });
        assert_eq!(
            e.stats().prefill_tokens_per_s,
            0.0,
            "nothing measured before the first step"
        );
        e.add(RequestId(1), req(vec![3, 4, 5, 6, 7], 2)).unwrap();
        e.add(RequestId(2), req(vec![8, 9, 10], 2)).unwrap();
        assert_eq!(e.stats().pending_prompt_tokens, 8);
        let (_, step) = e.step().unwrap();
        assert_eq!(step.prefill_tokens, 4);
        let s = e.stats();
        assert_eq!(s.pending_prompt_tokens, 4, "4 of the first prompt computed");
        assert!(step.seconds > 0.0);
        assert_eq!(s.prefill_tokens_per_s, 4.0 / step.seconds);
        e.step().unwrap();
        assert_eq!(e.stats().pending_prompt_tokens, 0);
    }

    #[test]
    fn a_slowdown_below_one_or_not_a_number_is_refused() {
        for slowdown in [0.5, f64::NAN, f64::INFINITY] {
            let c = EngineConfig {
                slowdown,
                ..config()
            };
            assert!(c.check().is_err(), "{slowdown}");
        }
        let c = EngineConfig {
            slowdown: 10.0,
            ..config()
        };
        assert!(c.check().is_ok());
    }

    /// Runs `e` until `id` finishes; its output tokens after `first`.
    fn run_to_end(e: &mut Engine, id: RequestId) -> Vec<u32> {
        let mut out = Vec::new();
        loop {
            let (events, _) = e.step().unwrap();
            for ev in events {
                match ev {
                    Event::Token(t) if t.request == id => out.push(t.sampled.token),
                    Event::Finished(f) if f.request == id => return out,
                    _ => {}
                }
            }
        }
    }

    /// Runs `r` in prefill mode on `e`: its first token and the KV chunks it emitted, in order.
    fn prefill_export(e: &mut Engine, r: Request, skip: usize) -> (Sampled, Vec<KvChunk>) {
        let id = RequestId(1000);
        e.add_prefill(id, r, skip).unwrap();
        let (mut first, mut chunks) = (None, Vec::new());
        while e.has_work() {
            for ev in e.step().unwrap().0 {
                match ev {
                    Event::Kv(c) => {
                        assert!(first.is_none(), "blocks come before the token");
                        chunks.push(c);
                    }
                    Event::Token(t) => first = Some(t.sampled),
                    Event::Finished(f) => assert_eq!(f.output_ids.len(), 1),
                }
            }
        }
        (first.expect("a first token"), chunks)
    }

    /// Writes a prefill side's chunks into the reservation's blocks of `e`'s pool; checks they
    /// cover every reserved block once, in order.
    fn fill(e: &Engine, r: &Reservation, chunks: &[KvChunk]) {
        let w = e.kv_pool().expect("a CPU engine").writer();
        let mut next = 0;
        for c in chunks {
            assert_eq!(c.first, next);
            for j in 0..c.blocks {
                for layer in 0..c.layers.len() {
                    let b = r.blocks[c.first + j];
                    // SAFETY: reserved for a remote prefill: the engine does not touch these blocks.
                    unsafe { w.write(layer, b as usize, c.frame(layer, j)).unwrap() };
                }
            }
            next += c.blocks;
        }
        assert_eq!(next, r.blocks.len());
    }

    #[test]
    fn a_remotely_prefilled_request_decodes_like_a_local_one() {
        let prompt: Vec<u32> = (0..45).map(|t| (t * 11 + 5) % 97).collect();
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8] {
            let cfg = EngineConfig {
                kv_dtype: dtype,
                ..config()
            };
            let want = engine(cfg.clone())
                .generate(vec![req(prompt.clone(), 10)], |_| {}, |_| {})
                .unwrap()[0]
                .output_ids
                .clone();
            let mut prefill = engine(cfg.clone());
            let mut decode = engine(cfg.clone());
            let id = RequestId(7);
            let r = decode
                .reserve_remote(id, req(prompt.clone(), 10))
                .unwrap()
                .expect("room");
            assert_eq!(r.cached_tokens, 0);
            assert_eq!(r.blocks.len(), 3, "45 tokens in 16-token blocks");
            let (first, kv) = prefill_export(&mut prefill, req(prompt.clone(), 10), 0);
            fill(&decode, &r, &kv);
            let ev = decode.join_remote(id, first.clone()).unwrap();
            assert!(matches!(&ev[..], [Event::Token(t)] if t.sampled.token == want[0]));
            let mut got = vec![first.token];
            got.extend(run_to_end(&mut decode, id));
            assert_eq!(got, want, "{dtype:?}");
            check_counts(&decode);
            assert_eq!(decode.stats().blocks_used, 0);
        }
    }

    #[test]
    fn a_remote_prefill_sends_only_what_the_decode_cache_lacks() {
        let prompt: Vec<u32> = (0..50).map(|t| (t * 7 + 3) % 97).collect();
        let want = engine(config())
            .generate(vec![req(prompt.clone(), 8)], |_| {}, |_| {})
            .unwrap()[0]
            .output_ids
            .clone();
        let mut decode = engine(config());
        // An earlier conversation turn left the first 40 tokens (two full blocks) cached.
        decode
            .generate(vec![req(prompt[..40].to_vec(), 1)], |_| {}, |_| {})
            .unwrap();
        let id = RequestId(9);
        let r = decode
            .reserve_remote(id, req(prompt.clone(), 8))
            .unwrap()
            .unwrap();
        assert_eq!(r.cached_tokens, 32);
        assert_eq!(r.blocks.len(), 2, "tokens 32..50");
        // The prefill side chunks the prompt (8-token budget) and has a prefix of its own
        // cached (24 tokens: one full block), so blocks come out in several chunks.
        let mut prefill = engine(EngineConfig {
            max_batched_tokens: 8,
            ..config()
        });
        prefill
            .generate(vec![req(prompt[..24].to_vec(), 1)], |_| {}, |_| {})
            .unwrap();
        let (first, kv) = prefill_export(&mut prefill, req(prompt.clone(), 8), r.cached_tokens);
        assert!(kv.len() >= 2, "streamed per chunk: {}", kv.len());
        fill(&decode, &r, &kv);
        decode.join_remote(id, first.clone()).unwrap();
        let mut got = vec![first.token];
        got.extend(run_to_end(&mut decode, id));
        assert_eq!(got, want);
        for bad in [8, 50, 64] {
            assert!(
                prefill
                    .add_prefill(RequestId(1), req(prompt.clone(), 8), bad)
                    .is_err(),
                "skip {bad}: not a block multiple below the prompt length"
            );
        }
    }

    #[test]
    fn a_failed_transfer_falls_back_to_a_local_prefill_and_cancel_frees_reservations() {
        let prompt: Vec<u32> = (0..30).map(|t| (t * 5 + 1) % 97).collect();
        let want = engine(config())
            .generate(vec![req(prompt.clone(), 6)], |_| {}, |_| {})
            .unwrap()[0]
            .output_ids
            .clone();
        let mut decode = engine(config());
        let id = RequestId(3);
        let r = decode
            .reserve_remote(id, req(prompt.clone(), 6))
            .unwrap()
            .unwrap();
        // A broken transfer left garbage in the blocks.
        let kv = decode.kv_pool().expect("a CPU engine");
        let frame_len = KvPool::frame_bytes(kv.layout, kv.dtype);
        let layers = kv.num_layers;
        let junk = KvChunk {
            request: id,
            first: 0,
            blocks: r.blocks.len(),
            layers: vec![vec![0x7fu8; frame_len * r.blocks.len()]; layers],
            frame_len,
        };
        fill(&decode, &r, &[junk]);
        assert!(decode.prefill_locally(id));
        assert_eq!(run_to_end(&mut decode, id), want);
        check_counts(&decode);
        assert_eq!(decode.stats().blocks_used, 0);

        let id2 = RequestId(4);
        decode.reserve_remote(id2, req(prompt, 6)).unwrap().unwrap();
        assert!(decode.stats().blocks_used > 0);
        decode.cancel(id2);
        let (events, _) = decode.step().unwrap();
        assert!(
            matches!(&events[..], [Event::Finished(f)] if f.finish_reason == FinishReason::Cancelled)
        );
        assert_eq!(decode.stats().blocks_used, 0);
        check_counts(&decode);
    }

    #[test]
    fn a_resumed_request_continues_exactly_where_the_first_run_stopped() {
        let prompt: Vec<u32> = (0..21).map(|t| (t * 13 + 2) % 97).collect();
        let sampled = |resume: Vec<u32>| Request {
            prompt: prompt.clone(),
            params: SamplingParams {
                max_tokens: 14,
                temperature: 0.9,
                seed: Some(42),
                frequency_penalty: 0.5,
                ignore_eos: true,
                ..Default::default()
            }
            .validate()
            .unwrap(),
            resume,
        };
        let full = engine(config())
            .generate(vec![sampled(vec![])], |_| {}, |_| {})
            .unwrap()[0]
            .output_ids
            .clone();
        assert_eq!(full.len(), 14);
        for k in [1, 6, 13] {
            let got = engine(config())
                .generate(vec![sampled(full[..k].to_vec())], |_| {}, |_| {})
                .unwrap()[0]
                .output_ids
                .clone();
            assert_eq!(got, full, "resumed after {k} tokens");
        }
        let e = engine(config());
        assert!(e.validate(&sampled(full.clone())).is_err(), "nothing left");
        assert!(e.validate(&sampled(vec![500])).is_err(), "bad token");
    }

    fn check_counts(e: &Engine) {
        let st = e.stats();
        assert_eq!(
            st.blocks_free + st.blocks_cached + st.blocks_used,
            st.blocks_total,
            "{st:?}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Random arrivals, lengths and cancels over a pool small enough to force preemption:
        /// block states always add up, nothing leaks, every request finishes or is cancelled,
        /// and every request that ran to the end produced the tokens it produces alone.
        #[test]
        fn scheduler_serves_everything_without_leaks(
            seed in any::<u64>(),
            n in 1usize..10,
            block_size in prop::sample::select(vec![1usize, 4, 16]),
            pool_tokens in 48usize..160,
            budget in 3usize..48,
            max_seqs in 1usize..6,
            lookahead in prop::sample::select(vec![0usize, 8, 64]),
        ) {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let cfg = EngineConfig {
                block_size,
                num_blocks: Some(pool_tokens.div_ceil(block_size)),
                max_batched_tokens: budget,
                max_seqs,
                admission_lookahead: lookahead,
                ..config()
            };
            let mut e = engine(cfg.clone());
            // (arrival step, cancel at step, request); tokens from a tiny alphabet so prefixes
            // are shared often.
            let mut plan = Vec::new();
            for _ in 0..n {
                let len = rng.gen_range(1..40);
                let prompt: Vec<u32> = (0..len).map(|_| rng.gen_range(0..3)).collect();
                let r = req(prompt, rng.gen_range(1..24));
                if e.validate(&r).is_err() {
                    continue;
                }
                let arrive = rng.gen_range(0..15usize);
                let cancel = rng.gen_bool(0.2).then(|| arrive + rng.gen_range(0..20usize));
                plan.push((arrive, cancel, r));
            }
            let mut finished: Vec<Option<Finished>> = vec![None; plan.len()];
            let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); plan.len()];
            let mut step = 0;
            while step < 40 || e.has_work() {
                for (i, (arrive, cancel, r)) in plan.iter().enumerate() {
                    if *arrive == step {
                        e.add(RequestId(i as u64), r.clone()).unwrap();
                    }
                    if *cancel == Some(step) {
                        e.cancel(RequestId(i as u64));
                    }
                }
                let (events, _) = e.step().unwrap();
                check_counts(&e);
                for ev in events {
                    match ev {
                        Event::Token(t) => tokens[t.request.0 as usize].push(t.sampled.token),
                        Event::Kv(_) => prop_assert!(false, "no prefill-mode requests here"),
                        Event::Finished(f) => {
                            let i = f.request.0 as usize;
                            prop_assert!(finished[i].is_none(), "finished twice");
                            finished[i] = Some(f);
                        }
                    }
                }
                step += 1;
                prop_assert!(step < 10_000, "no progress");
            }
            let st = e.stats();
            prop_assert_eq!(st.blocks_used, 0);
            prop_assert_eq!(st.blocks_free + st.blocks_cached, st.blocks_total);
            let mut alone = engine(config());
            for (i, (_, _, r)) in plan.iter().enumerate() {
                let f = finished[i].as_ref().expect("every request finishes or is cancelled");
                prop_assert_eq!(&f.output_ids, &tokens[i], "stream and result agree");
                match f.finish_reason {
                    FinishReason::Cancelled => {
                        prop_assert!(f.output_ids.len() <= r.params.max_tokens as usize)
                    }
                    FinishReason::Length => {
                        prop_assert_eq!(f.output_ids.len(), r.params.max_tokens as usize);
                        alone.clear_prefix_cache();
                        let want = alone.generate(vec![r.clone()], |_| {}, |_| {}).unwrap();
                        prop_assert_eq!(&f.output_ids, &want[0].output_ids);
                    }
                    FinishReason::Stop => prop_assert!(false, "no stop tokens were set"),
                }
            }
        }
    }

    #[test]
    fn admission_leaves_room_to_grow() {
        // 24 blocks of 4: the first request needs 3 now and 16 more within the lookahead, so the
        // second (3 now, 19 within the lookahead) waits instead of being preempted later.
        let mut e = engine(EngineConfig {
            block_size: 4,
            num_blocks: Some(24),
            ..config()
        });
        e.add(RequestId(0), req((0..10).collect(), 80)).unwrap();
        e.add(RequestId(1), req((20..30).collect(), 80)).unwrap();
        e.step().unwrap();
        assert_eq!((e.stats().running, e.stats().waiting), (1, 1));
        while e.has_work() {
            e.step().unwrap();
        }
        assert_eq!(e.stats().preemptions, 0);
    }

    #[test]
    fn prefix_hits_skip_computation() {
        let mut e = engine(EngineConfig {
            block_size: 4,
            ..config()
        });
        let prompt: Vec<u32> = (0..18).collect();
        let mut prefill = [0usize; 3];
        let mut outs = Vec::new();
        for (k, p) in prefill.iter_mut().enumerate() {
            if k == 2 {
                e.clear_prefix_cache();
            }
            let o = e
                .generate(
                    vec![req(prompt.clone(), 5)],
                    |_| {},
                    |s| *p += s.prefill_tokens,
                )
                .unwrap();
            outs.push(o[0].output_ids.clone());
            if k == 1 {
                assert_eq!(o[0].cached_prompt_tokens, 16);
            }
        }
        // 18 tokens = 4 full blocks + 2: the second run reuses the 4 blocks.
        assert_eq!(prefill, [18, 2, 18]);
        assert_eq!(outs[0], outs[1]);
        assert_eq!(outs[0], outs[2]);
        let st = e.stats();
        assert_eq!((st.prefix_lookup_tokens, st.prefix_hit_tokens), (54, 16));
        // A prompt that is a prefix of the cached one, ending exactly on a block boundary, still
        // computes its last block (its logits are needed).
        let mut p = 0;
        e.generate(
            vec![req(prompt[..8].to_vec(), 1)],
            |_| {},
            |s| p += s.prefill_tokens,
        )
        .unwrap();
        assert_eq!(p, 4);
    }

    #[test]
    fn oldest_sequences_keep_running_when_the_pool_is_short() {
        // Two requests that each need most of the pool over their lifetime: admission's lookahead
        // lets both start, the newer one is preempted as they grow, the older one finishes first,
        // then the newer one completes with the same tokens as without any of this.
        let mut e = engine(EngineConfig {
            block_size: 4,
            num_blocks: Some(60),
            ..config()
        });
        let a = req((0..10).collect(), 200);
        let b = req((20..30).collect(), 200);
        let out = e
            .generate(vec![a.clone(), b.clone()], |_| {}, |_| {})
            .unwrap();
        assert!(e.stats().preemptions >= 1);
        assert_eq!(out[0].preemptions, 0, "the oldest is never the victim");
        assert!(out[1].preemptions >= 1);
        let mut fresh = engine(config());
        let want = fresh.generate(vec![a, b], |_| {}, |_| {}).unwrap();
        assert_eq!(out[0].output_ids, want[0].output_ids);
        assert_eq!(out[1].output_ids, want[1].output_ids);
    }
}

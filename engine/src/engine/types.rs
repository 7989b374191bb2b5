//! The engine's public types: configuration, requests and their events, stats, limits.

use serde::Serialize;

use crate::backend::PoolSize;
use crate::error::EngineError;
use crate::forward::OpTimes;
use crate::kv_cache::KvDtype;
use crate::sampler::Sampled;
use tandem_grammar::{Constraint, GrammarCompiler};
use tandem_types::{BlockId, SamplingError, SamplingParams, ValidSampling};

/// How an engine sizes its KV pool and schedules its steps.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV pool size in MiB.
    pub kv_cache_mb: usize,
    /// On a GPU: the share of its memory this engine may hold, the KV pool taking what the
    /// weights leave (overrides `kv_cache_mb`).
    pub gpu_memory_fraction: Option<f64>,
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
    /// Which waiting prompt is admitted first, and which running prompt's chunk goes first.
    pub prefill_order: PrefillOrder,
    /// The step time to keep within, when set: each prompt chunk is what fits in the time the
    /// step has left by the engine's measure of its own steps ([`StepCost`](super::StepCost):
    /// a fixed part, a part per token and one per attended key), at most `max_batched_tokens`
    /// in all, and a step always takes every decoding sequence's token and at least
    /// [`MIN_PREFILL_CHUNK`](super::MIN_PREFILL_CHUNK) prompt tokens. Decoding sequences get a
    /// token about this often while prompts are computed; and a burst's prompts finish one or
    /// two a step instead of together in one long step, so the first of them reach their first
    /// token sooner. `None`: `max_batched_tokens` only.
    pub step_target: Option<std::time::Duration>,
    /// Under a step target, the prompt tokens it never cuts: a step's time is at least what
    /// this many prompt tokens beside its decodes cost by the engine's measure, so a prompt of
    /// up to this many is computed in one step even where the target is shorter than that (a
    /// slow machine's). 0: the target alone. (An ITL target is not widened by it.)
    pub step_target_whole: usize,
    /// The inter-token gap to keep decoding sequences within, when set: a step that holds a
    /// decoding sequence is planned to this time (or the step target, if that is shorter), so
    /// prompt work mixed into decode steps is bounded by it; a step with no decoding sequence
    /// keeps the step target (or `max_batched_tokens`), so a prompt alone is computed at full
    /// speed. Prompts keep moving whatever it says: each step takes at least
    /// [`MIN_ITL_PREFILL_CHUNK`](super::MIN_ITL_PREFILL_CHUNK) prompt tokens. `None`: off.
    pub itl_target: Option<std::time::Duration>,
    /// Test hook: the engine thread panics in this step (counted from 1, steps with work only),
    /// as a bug would, so the tests can see what a worker does then. `TANDEM_TEST_PANIC_AT_STEP`
    /// sets it for the CLI's engines; `None` in production.
    pub panic_at_step: Option<u64>,
    /// A disk tier under the prefix cache (see the `disk` module), or none.
    pub kv_disk: Option<KvDiskConfig>,
    /// Speculative decoding (see the `speculate` module), or none.
    pub speculative: Option<crate::spec::SpecConfig>,
}

/// Where an engine keeps the KV blocks its pool evicts, and how long a request waits for them.
#[derive(Clone, Debug)]
pub struct KvDiskConfig {
    /// The directory (several engines may share one: each keeps its blocks under the
    /// fingerprint of what they are).
    pub dir: std::path::PathBuf,
    /// Most bytes of block files this engine keeps there.
    pub capacity_bytes: u64,
    /// What makes two engines' blocks interchangeable beyond the cache's shape (which the
    /// engine adds): the model's name and its weights' identity.
    pub identity: String,
    /// Longest a new request waits for its prefix's blocks to be read back before it is queued
    /// anyway (what has not arrived is computed).
    pub max_wait: std::time::Duration,
    /// Most bytes of evicted blocks queued for writing (more are dropped, not waited for).
    pub max_pending_bytes: u64,
    /// Other engines write the directory too (a volume a group of workers shares): how often
    /// to look for their blocks. `None`: only this engine writes there.
    pub rescan: Option<std::time::Duration>,
}

impl KvDiskConfig {
    /// A tier of `capacity_bytes` in `dir` for a model known as `identity`: requests wait up to
    /// two seconds for their blocks, and up to 256 MiB of evicted blocks queue for writing.
    pub fn new(dir: impl Into<std::path::PathBuf>, capacity_bytes: u64, identity: &str) -> Self {
        Self {
            dir: dir.into(),
            capacity_bytes,
            identity: identity.into(),
            max_wait: std::time::Duration::from_secs(2),
            max_pending_bytes: 256 << 20,
            rescan: None,
        }
    }
}

impl EngineConfig {
    /// The pool a backend for this engine is built with.
    pub fn pool(&self) -> PoolSize {
        PoolSize {
            block_size: self.block_size,
            kv_cache_mb: self.kv_cache_mb,
            num_blocks: self.num_blocks,
            kv_dtype: self.kv_dtype,
            gpu_memory_fraction: self.gpu_memory_fraction,
        }
    }

    /// Refuses sizes that make no engine (before any memory is sized from them).
    pub fn check(&self) -> Result<(), EngineError> {
        if self.block_size == 0 || self.max_batched_tokens == 0 || self.max_seqs == 0 {
            return Err(EngineError::Config(
                "block size, batch budget and max seqs must be positive".into(),
            ));
        }
        if let Some(s) = &self.speculative {
            s.check().map_err(EngineError::Config)?;
        }
        Ok(())
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_mb: 1024,
            gpu_memory_fraction: None,
            kv_dtype: KvDtype::F32,
            max_batched_tokens: 2048,
            max_seqs: 256,
            prefix_caching: true,
            num_blocks: None,
            admission_lookahead: 64,
            prefill_order: PrefillOrder::Arrival,
            step_target: None,
            step_target_whole: 0,
            itl_target: None,
            panic_at_step: None,
            kv_disk: None,
            speculative: None,
        }
    }
}

/// The order prompts are computed in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefillOrder {
    /// First come, first served (vLLM's): the head of the queue is admitted first, running
    /// prompts continue oldest admission first.
    #[default]
    Arrival,
    /// Shortest remaining prompt first: of the waiting prompts the one with the fewest tokens to
    /// compute is admitted first (preempted sequences still go before any new one), and running
    /// prompts continue fewest remaining first. A prompt passed over
    /// [`MAX_PASSED`](super::MAX_PASSED) times goes first at the next admission, so a long
    /// prompt waits behind a bounded number of shorter ones, not forever.
    Shortest,
}

impl std::str::FromStr for PrefillOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "arrival" | "fcfs" => Ok(Self::Arrival),
            "shortest" => Ok(Self::Shortest),
            o => Err(format!("unknown prefill order {o:?} (arrival|shortest)")),
        }
    }
}

impl std::fmt::Display for PrefillOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Arrival => "arrival",
            Self::Shortest => "shortest",
        })
    }
}

/// Identifies a request within one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct RequestId(pub u64);

/// A generation request: prompt token ids and sampling.
#[derive(Clone, Debug)]
pub struct Request {
    /// Prompt token ids; must not be empty.
    pub prompt: Vec<u32>,
    /// How to pick each next token and when to stop.
    pub params: ValidSampling,
    /// Output tokens this request already produced elsewhere (a stream migrated from a worker
    /// that died): they are prefilled after the prompt, count toward `max_tokens` and the
    /// penalties, and generation continues after them. Usually empty.
    pub resume: Vec<u32>,
    /// `params.grammar` compiled for this model's vocabulary (none: free text). The resumed
    /// tokens are fed through it before the first token sampled here.
    pub constraint: Option<Constraint>,
    /// How many samples of the prompt to generate (OpenAI's `n`), and their numbering.
    pub samples: Samples,
    /// Its priority band (its tenant's): a higher band is admitted first and preempted last;
    /// within a band, first come first served. 0 by default; negative is lower.
    pub priority: i32,
    /// The LoRA adapter it runs with (None: the base model). Its sequences' block hashes start
    /// from the adapter's content hash, so they share a cached prefix only with the same
    /// adapter's.
    pub adapter: Option<std::sync::Arc<tandem_model::LoraAdapter>>,
}

/// Parallel samples of one prompt (OpenAI's `n`). The prompt is computed once; when its last
/// token's logits are ready, each sample draws its own first token from them and the sequence
/// forks: every sample holds the prompt's blocks (shared, counted once in the pool) and gets
/// its own copy of a block only when it writes one (copy-on-write: the last, partial prompt
/// block). Samples are numbered `first..first + count`; every event carries its sample's
/// number, and sample `i` draws from stream `i` of the request's seed, so a seeded request's
/// samples differ from each other and sample 0 is what the same request with `n = 1` gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Samples {
    /// Samples to generate (at least 1, at most [`Samples::MAX`]).
    pub count: u32,
    /// The number of the first (a migrated sample keeps its own).
    pub first: u32,
}

impl Samples {
    /// One sample, number 0: a plain request.
    pub const ONE: Self = Self { count: 1, first: 0 };
    /// Most samples one request may ask for (OpenAI's limit on `n`).
    pub const MAX: u32 = 128;
}

impl Default for Samples {
    fn default() -> Self {
        Self::ONE
    }
}

impl Request {
    /// A request for `params` after `prompt`: nothing resumed, no grammar compiled yet, one
    /// sample.
    pub fn new(prompt: Vec<u32>, params: ValidSampling) -> Self {
        Self {
            prompt,
            params,
            resume: Vec::new(),
            constraint: None,
            samples: Samples::ONE,
            priority: 0,
            adapter: None,
        }
    }

    /// A greedy request that runs to `max_tokens` after `prompt`, EOS ignored, so that every
    /// run does the same work (benchmarks, tests).
    pub fn greedy(prompt: Vec<u32>, max_tokens: u32) -> Result<Self, SamplingError> {
        let params = SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()?;
        Ok(Self::new(prompt, params))
    }

    /// Compiles `params.grammar` into [`Request::constraint`] with `grammars` (this engine's
    /// compiler) unless it is compiled already. A grammar the compiler refuses is the request's
    /// fault; an engine without a compiler cannot serve grammars.
    pub fn compile(&mut self, grammars: Option<&GrammarCompiler>) -> Result<(), EngineError> {
        let Some(g) = &self.params.grammar else {
            return Ok(());
        };
        if self.constraint.is_none() {
            let grammars = grammars.ok_or_else(|| {
                EngineError::Unsupported("this engine was built without a grammar compiler".into())
            })?;
            self.constraint = Some(grammars.compile(g)?);
        }
        Ok(())
    }
}

/// Why a request stopped generating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// Hit max_tokens or the context limit.
    Length,
    /// Produced EOS (not ignored) or a stop token.
    Stop,
    /// Cancelled by the client.
    Cancelled,
    /// The request's grammar could not go on ([`Finished::error`] says why): the output ends
    /// here rather than leave it, and the request fails with that error.
    Error,
}

/// Emitted for every generated token.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    /// The request the token belongs to.
    pub request: RequestId,
    /// Which of the request's samples it continues ([`Samples`]).
    pub index: u32,
    /// The token, its log-probability and the top alternatives.
    pub sampled: Sampled,
    /// Set on the request's last token.
    pub finish: Option<FinishReason>,
}

/// A request that left the engine (after its last token, or on cancel).
#[derive(Clone, Debug, Serialize)]
pub struct Finished {
    /// The request that finished.
    pub request: RequestId,
    /// Which of the request's samples this is ([`Samples`]); each one finishes on its own.
    pub index: u32,
    /// Its prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Every output token id, the resumed ones first.
    pub output_ids: Vec<u32>,
    /// Log-probability of each token sampled by this engine (resumed tokens have none).
    pub logprobs: Vec<f32>,
    /// Why it stopped.
    pub finish_reason: FinishReason,
    /// With [`FinishReason::Error`], what went wrong.
    pub error: Option<String>,
    /// Prompt tokens whose K/V came from the prefix cache at first admission.
    pub cached_prompt_tokens: usize,
    /// Times the request was preempted and recomputed.
    pub preemptions: u32,
    /// Speculation: tokens proposed for this sample and verified, and of those the accepted.
    pub spec_tokens: (u32, u32),
    /// Seconds from submission to admission, to the first token, and to the end.
    pub queue_s: f64,
    /// Seconds from submission to the first token sampled here (0 if none was).
    pub ttft_s: f64,
    /// Seconds from submission to leaving the engine.
    pub e2e_s: f64,
}

/// What one step produced.
#[derive(Clone, Debug)]
pub enum Event {
    /// KV blocks of a prefill-mode request ([`Engine::add_prefill`](crate::Engine::add_prefill)),
    /// as soon as a chunk has filled them; always before that request's token.
    Kv(KvChunk),
    /// A request sampled a token.
    Token(TokenEvent),
    /// A request left the engine; always after its last token.
    Finished(Finished),
}

/// Consecutive KV blocks of a prefill-mode request, copied out in the KV wire layout.
#[derive(Clone, Debug)]
pub struct KvChunk {
    /// The prefill-mode request the blocks belong to.
    pub request: RequestId,
    /// Index of the first block among the blocks the receiver asked for (block 0 holds the
    /// tokens right after its `skip_tokens`).
    pub first: usize,
    /// Number of blocks in this chunk.
    pub blocks: usize,
    /// The blocks' KV, one piece per KV head range the engine's tensor-parallel ranks hold
    /// (replicated ranges once; one piece of every head without tensor parallelism), in head
    /// order.
    pub pieces: Vec<KvPiece>,
}

/// The KV of some heads of a chunk's blocks, in the KV wire layout of those heads.
#[derive(Clone, Debug)]
pub struct KvPiece {
    /// The KV heads.
    pub heads: std::ops::Range<u32>,
    /// Per layer, the blocks' frames back to back (each `frame_len` bytes).
    pub layers: Vec<Vec<u8>>,
    /// Bytes of one block's frame in one layer.
    pub frame_len: usize,
}

impl KvPiece {
    /// One layer of the `j`-th block: one frame's payload.
    pub fn frame(&self, layer: usize, j: usize) -> &[u8] {
        &self.layers[layer][j * self.frame_len..(j + 1) * self.frame_len]
    }
}

impl KvChunk {
    /// Layers of every block.
    pub fn layers(&self) -> usize {
        self.pieces.first().map_or(0, |p| p.layers.len())
    }
}

/// Timing of one engine step, for benchmarks.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepStats {
    /// Prompt (and recomputed) tokens the step computed.
    pub prefill_tokens: usize,
    /// Tokens the step computed for sequences that were decoding, one per sequence.
    pub decode_tokens: usize,
    /// Rows that ran the output head (the last new token of each sequence that samples).
    pub logit_rows: usize,
    /// Keys attended to, summed over the step's rows (a row at position p sees p + 1 keys): the
    /// attention's work.
    pub attended_keys: u64,
    /// Cached plus new tokens of every sequence in the step: the KV the step must read.
    pub context_tokens: u64,
    /// Wall-clock seconds the step took (including any test slowdown).
    pub seconds: f64,
    /// Of those, seconds the tensor-parallel ranks spent in collectives (the mean over ranks;
    /// 0 without tensor parallelism).
    pub collective_seconds: f64,
    /// Values (f32) each tensor-parallel rank all-reduced or gathered in the step.
    pub collective_values: u64,
    /// The step's forward split by op, when the engine profiles them
    /// ([`crate::Engine::profile_ops`]).
    pub ops: Option<OpTimes>,
}

/// The engine's state at a glance.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct EngineStats {
    /// Sequences admitted and stepping.
    pub running: usize,
    /// Of those, the ones past their prompt (a token a step).
    pub decoding: usize,
    /// The ITL target it schedules to (`EngineConfig::itl_target`), in milliseconds; 0: none.
    pub itl_target_ms: f64,
    /// Requests queued for admission (including preempted ones).
    pub waiting: usize,
    /// KV blocks in the pool.
    pub blocks_total: usize,
    /// KV blocks holding nothing.
    pub blocks_free: usize,
    /// KV blocks no sequence holds that keep a cached prefix (evictable).
    pub blocks_cached: usize,
    /// KV blocks held by at least one sequence.
    pub blocks_used: usize,
    /// Prompt tokens looked up in the prefix cache at admission.
    pub prefix_lookup_tokens: u64,
    /// Of those, tokens found there (their K/V reused, not computed).
    pub prefix_hit_tokens: u64,
    /// Preemptions (each one a sequence sent back to be recomputed) since the engine started.
    pub preemptions: u64,
    /// Steps run since the engine started.
    pub steps: u64,
    /// Prompt tokens admitted (running or waiting) and not computed yet: the prefill work queued.
    pub pending_prompt_tokens: u64,
    /// Prompt tokens computed a second, averaged over recent steps that computed any (0 before the
    /// first such step).
    pub prefill_tokens_per_s: f64,
    /// The fitted step cost ([`crate::Cost`]) in milliseconds: fixed a step, per token
    /// computed, per key attended (zeros before the first step was timed).
    pub step_cost_ms: [f64; 3],
    /// Seconds the tensor-parallel ranks spent in collectives since the engine started (the
    /// mean over ranks; 0 without tensor parallelism).
    pub collective_seconds: f64,
    /// Requests waiting aside for blocks from the disk tier.
    pub loading: usize,
    /// What the engine did with its disk tier (zeros without one).
    pub disk: super::disk::DiskCounts,
    /// The disk tier's own counters and contents (none without one).
    pub disk_tier: Option<tandem_kv_transfer::DiskTierStats>,
    /// Handed-off sequences' partly filled blocks kept for their pull ([`super::Engine::hand_off`]),
    /// and how many of them a pull has taken.
    pub parked_tails: (usize, usize),
    /// Requests resumed here after a move, and what their K/V cost.
    pub resumed: ResumedCounts,
    /// What speculative decoding proposed and what was accepted (zeros without it).
    pub spec: super::SpecCounts,
}

/// What requests resumed on this engine after a move (a worker that died or drained; their
/// streamed tokens given back) cost: of the tokens whose K/V existed before the move (the
/// prompt and every streamed token but the last, which was never computed), how many were
/// computed again, here or by the worker they were pulled from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ResumedCounts {
    /// Requests resumed.
    pub requests: u64,
    /// Their tokens whose K/V existed before the move.
    pub context_tokens: u64,
    /// Of those, the tokens computed again.
    pub recomputed_tokens: u64,
}

impl ResumedCounts {
    /// Counts a resumed sequence of `len` tokens (prompt and streamed) of which `held` leading
    /// ones were found rather than computed.
    pub(crate) fn add(&mut self, len: usize, held: usize) {
        let context = len.saturating_sub(1);
        self.requests += 1;
        self.context_tokens += context as u64;
        self.recomputed_tokens += (context - held.min(context)) as u64;
    }
}

/// Weight of the newest step in [`EngineStats::prefill_tokens_per_s`].
pub(super) const RATE_WEIGHT: f64 = 0.25;

impl EngineStats {
    /// Fraction of looked-up prompt tokens found in the prefix cache (0 before any lookup).
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
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// The model's context in tokens (prompt plus output).
    pub max_context: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the whole pool.
    pub total_blocks: usize,
    /// Tensor-parallel ranks the engine's steps run on.
    pub tensor_parallel: usize,
    /// Bytes of KV one token takes in the cache (every layer, every rank).
    pub kv_bytes_per_token: f64,
}

impl Limits {
    /// A request is accepted only if, alone, it fits the model's context and the whole pool, so
    /// preemption can always make room for the oldest sequence.
    pub fn validate(&self, r: &Request) -> Result<(), EngineError> {
        if r.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let biased = r.params.logit_bias.iter().map(|(t, _)| t);
        let known = r.prompt.iter().chain(&r.resume);
        if let Some(&bad) = known
            .clone()
            .chain(biased)
            .find(|&&t| t as usize >= self.vocab_size)
        {
            return Err(EngineError::BadToken {
                id: bad,
                vocab: self.vocab_size,
            });
        }
        if r.params.grammar.is_some() != r.constraint.is_some() {
            return Err(EngineError::Internal(
                "a request's grammar must come compiled (and only with a grammar)".into(),
            ));
        }
        let Samples { count, first } = r.samples;
        if count == 0 || count > Samples::MAX || first.checked_add(count).is_none() {
            return Err(EngineError::Samples(format!(
                "{count} samples from number {first}: ask for 1 to {}",
                Samples::MAX
            )));
        }
        if count > 1 && !r.resume.is_empty() {
            return Err(EngineError::Samples(
                "a resumed output is one sample: resume each sample on its own".into(),
            ));
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
/// Blocks set aside for a prompt whose KV comes from a prefill worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// Leading prompt tokens already in this engine's prefix cache (a multiple of the block
    /// size): the prefill worker sends only what follows.
    pub cached_tokens: usize,
    /// Destination blocks for tokens `cached_tokens..`, in order (the last may be partial).
    pub blocks: Vec<BlockId>,
}

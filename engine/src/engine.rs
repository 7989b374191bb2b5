//! The engine: admits requests, packs every scheduled sequence's new tokens into one forward per
//! step, samples, and retires finished sequences.
//!
//! Each step decodes one token for every running sequence and fills the rest of the token budget
//! (`max_batched_tokens`) with prompt chunks of waiting sequences, first come first served, up to
//! `max_seqs` sequences. A sequence is admitted only when the pool can hold its whole prompt and
//! output (blocks are reserved up front, so a step never runs out of cache). Its blocks return to
//! the pool when it finishes, even on error, because they are owned by a [`BlockList`].

use std::collections::VecDeque;
use std::time::Instant;

use serde::Serialize;

use crate::kv_cache::{BlockAllocator, BlockList, KvPool};
use crate::model::{LlamaModel, SeqBatch};
use crate::sampler::{Sampled, Sampler, SamplingParams};
use crate::EngineError;

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV pool size in MiB.
    pub kv_cache_mb: usize,
    /// Token budget of one forward (prompt chunks plus decode tokens).
    pub max_batched_tokens: usize,
    /// Most sequences in one step.
    pub max_seqs: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_mb: 1024,
            max_batched_tokens: 2048,
            max_seqs: 256,
        }
    }
}

/// A generation request: prompt token ids and sampling.
#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// Hit max_tokens or the context limit.
    Length,
    /// Produced EOS (not ignored) or a stop token.
    Stop,
}

/// Emitted for every generated token.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    /// Index of the request in the submitted list.
    pub request: usize,
    pub sampled: Sampled,
    pub finish: Option<FinishReason>,
}

/// A finished request.
#[derive(Clone, Debug, Serialize)]
pub struct Output {
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
    /// Seconds from submission to the first token, and to the last.
    pub ttft_s: f64,
    pub e2e_s: f64,
}

/// Timing of one engine step, for benchmarks.
#[derive(Clone, Copy, Debug)]
pub struct StepStats {
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    pub seconds: f64,
}

struct Seq {
    idx: usize,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose K/V is in the cache.
    cached: usize,
    blocks: BlockList,
    sampler: Sampler,
    logprobs: Vec<f32>,
    first_token_at: Option<Instant>,
}

pub struct Engine {
    pub model: LlamaModel,
    pub config: EngineConfig,
    kv: KvPool,
    alloc: BlockAllocator,
    eos: Vec<u32>,
}

impl Engine {
    /// `eos` lists the token ids that end generation unless a request ignores EOS.
    pub fn new(
        model: LlamaModel,
        config: EngineConfig,
        eos: Vec<u32>,
    ) -> Result<Self, EngineError> {
        if config.block_size == 0 || config.max_batched_tokens == 0 || config.max_seqs == 0 {
            return Err(EngineError::InvalidRequest(
                "block size, batch budget and max seqs must be positive".into(),
            ));
        }
        let layout = model.kv_layout(config.block_size);
        let block_bytes =
            KvPool::bytes_per_token(layout, model.config.num_layers) * config.block_size;
        let num_blocks = (config.kv_cache_mb * (1 << 20) / block_bytes).max(1);
        let kv = KvPool::new(layout, model.config.num_layers, num_blocks);
        Ok(Self {
            alloc: BlockAllocator::new(num_blocks),
            kv,
            model,
            config,
            eos,
        })
    }

    pub fn kv_pool(&self) -> &KvPool {
        &self.kv
    }

    pub fn free_blocks(&self) -> usize {
        self.alloc.free_blocks()
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.config.block_size)
    }

    /// Checks a request against the model and the pool before it is queued.
    pub fn validate(&self, r: &Request) -> Result<(), EngineError> {
        r.params.validate()?;
        if r.prompt.is_empty() {
            return Err(EngineError::InvalidRequest("prompt is empty".into()));
        }
        let vocab = self.model.config.vocab_size;
        if let Some(&bad) = r.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::BadToken { id: bad, vocab });
        }
        let max = self.model.config.max_position_embeddings;
        if r.prompt.len() >= max {
            return Err(EngineError::ContextOverflow {
                tokens: r.prompt.len() + 1,
                max,
            });
        }
        let need = self.blocks_for((r.prompt.len() + r.params.max_tokens as usize).min(max));
        if need > self.alloc.total_blocks() {
            return Err(EngineError::TooLargeForCache {
                need,
                total: self.alloc.total_blocks(),
            });
        }
        Ok(())
    }

    /// Runs all requests to completion as one continuous batch; `on_token` sees every token as it
    /// is produced, `on_step` every step's timing. Outputs come back in request order.
    pub fn generate(
        &mut self,
        requests: Vec<Request>,
        mut on_token: impl FnMut(&TokenEvent),
        mut on_step: impl FnMut(&StepStats),
    ) -> Result<Vec<Output>, EngineError> {
        for r in &requests {
            self.validate(r)?;
        }
        let start = Instant::now();
        let n = requests.len();
        let mut waiting: VecDeque<(usize, Request)> = requests.into_iter().enumerate().collect();
        let mut running: Vec<Seq> = Vec::new();
        let mut done: Vec<Option<Output>> = (0..n).map(|_| None).collect();
        let max_ctx = self.model.config.max_position_embeddings;
        while !waiting.is_empty() || !running.is_empty() {
            // Admit in arrival order while the pool can hold a whole request.
            while running.len() < self.config.max_seqs {
                let Some((_, r)) = waiting.front() else { break };
                let need =
                    self.blocks_for((r.prompt.len() + r.params.max_tokens as usize).min(max_ctx));
                let Some(blocks) = self.alloc.allocate(need) else {
                    break;
                };
                let (idx, r) = waiting.pop_front().expect("front exists");
                running.push(Seq {
                    idx,
                    prompt_len: r.prompt.len(),
                    sampler: Sampler::new(r.params, &r.prompt),
                    tokens: r.prompt,
                    cached: 0,
                    blocks,
                    logprobs: Vec::new(),
                    first_token_at: None,
                });
            }
            if running.is_empty() {
                return Err(EngineError::Internal(
                    "no request fits in the KV pool".into(),
                ));
            }
            // Decode tokens first, then prompt chunks within the budget.
            let mut budget = self.config.max_batched_tokens;
            let mut plan: Vec<(usize, usize)> = Vec::new(); // (running index, new tokens)
            for (i, s) in running.iter().enumerate() {
                if s.cached >= s.prompt_len {
                    plan.push((i, 1));
                    budget = budget.saturating_sub(1);
                }
            }
            for (i, s) in running.iter().enumerate() {
                if s.cached < s.prompt_len && budget > 0 {
                    let take = (s.prompt_len - s.cached).min(budget);
                    plan.push((i, take));
                    budget -= take;
                }
            }
            let t0 = Instant::now();
            let batch: Vec<SeqBatch<'_>> = plan
                .iter()
                .map(|&(i, take)| {
                    let s = &running[i];
                    SeqBatch {
                        tokens: &s.tokens[s.cached..s.cached + take],
                        cached: s.cached,
                        block_table: s.blocks.ids(),
                        want_logits: s.cached + take >= s.prompt_len,
                    }
                })
                .collect();
            let logits = self.model.forward(&batch, &mut self.kv)?;
            let (mut prefill_tokens, mut decode_tokens) = (0, 0);
            let vocab = self.model.config.vocab_size;
            let mut row = 0;
            for &(i, take) in &plan {
                let s = &mut running[i];
                if s.cached >= s.prompt_len {
                    decode_tokens += take;
                } else {
                    prefill_tokens += take;
                }
                s.cached += take;
                if s.cached < s.prompt_len {
                    continue;
                }
                let sampled = s.sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
                row += 1;
                s.first_token_at.get_or_insert_with(Instant::now);
                s.tokens.push(sampled.token);
                s.logprobs.push(sampled.logprob);
                let p = s.sampler.params();
                let generated = s.tokens.len() - s.prompt_len;
                let finish = if p.stop_token_ids.contains(&sampled.token)
                    || (!p.ignore_eos && self.eos.contains(&sampled.token))
                {
                    Some(FinishReason::Stop)
                } else if generated >= p.max_tokens as usize || s.tokens.len() >= max_ctx {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                on_token(&TokenEvent {
                    request: s.idx,
                    sampled,
                    finish,
                });
                if let Some(reason) = finish {
                    done[s.idx] = Some(Output {
                        prompt_ids: s.tokens[..s.prompt_len].to_vec(),
                        output_ids: s.tokens[s.prompt_len..].to_vec(),
                        logprobs: std::mem::take(&mut s.logprobs),
                        finish_reason: reason,
                        ttft_s: s.first_token_at.map_or(0.0, |t| (t - start).as_secs_f64()),
                        e2e_s: start.elapsed().as_secs_f64(),
                    });
                }
            }
            on_step(&StepStats {
                prefill_tokens,
                decode_tokens,
                seconds: t0.elapsed().as_secs_f64(),
            });
            // Finished sequences drop here, returning their blocks.
            running.retain(|s| done[s.idx].is_none());
        }
        done.into_iter()
            .map(|o| o.ok_or_else(|| EngineError::Internal("request lost".into())))
            .collect()
    }

    /// Last-position logits of a prompt (one prefill, nothing kept): for checks against a reference.
    pub fn prompt_logits(&mut self, prompt: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.validate(&Request {
            prompt: prompt.to_vec(),
            params: SamplingParams {
                max_tokens: 1,
                ..Default::default()
            },
        })?;
        let need = self.blocks_for(prompt.len());
        let blocks = self
            .alloc
            .allocate(need)
            .ok_or(EngineError::TooLargeForCache {
                need,
                total: self.alloc.total_blocks(),
            })?;
        let batch = [SeqBatch {
            tokens: prompt,
            cached: 0,
            block_table: blocks.ids(),
            want_logits: true,
        }];
        self.model.forward(&batch, &mut self.kv)
    }
}

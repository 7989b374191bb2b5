//! The remote-prefill lifecycle on both sides: a decode engine reserves blocks for a prompt
//! whose KV comes from elsewhere, then joins it to the batch (or prefills it here after a failed
//! transfer); a prefill engine runs a prompt in prefill mode and hands its blocks out as chunks.

use std::time::Instant;

use super::{
    finish_reason, Engine, Event, KvChunk, KvPiece, Request, RequestId, Reservation, Seq,
    TokenEvent,
};
use crate::backend::Backend;
use crate::device::staging::{export_staged, Pinned};
use crate::error::EngineError;
use crate::kv_cache::KvPool;
use crate::sampler::Sampled;
use tandem_types::BlockId;

impl Engine {
    /// The decode side of a remote prefill, step one: allocates blocks for the whole prompt,
    /// reusing this engine's prefix cache, and parks the request until its KV arrives. `None`
    /// when the pool cannot hold it now (prefill it locally with [`Engine::add`] instead).
    /// The returned blocks are the transfer's destination; the engine does not touch them until
    /// [`Engine::join_remote`] or [`Engine::prefill_locally`].
    pub fn reserve_remote(
        &mut self,
        id: RequestId,
        mut r: Request,
    ) -> Result<Option<Reservation>, EngineError> {
        r.compile(self.grammars.as_deref())?;
        self.validate(&r)?;
        self.check_host_cache()?;
        // A resumed request (moved here from a worker that died or drained) takes the KV of its
        // prompt and the tokens already streamed from wherever they are held; see join_remote.
        let mut s = self.new_seq(id, r);
        let hit = if self.config.prefix_caching {
            s.blocks.reuse_prefix(&s.tokens)
        } else {
            0
        };
        if !s.blocks.reserve(s.tokens.len()) {
            return Ok(None);
        }
        // The transfer writes the reserved blocks: what they held goes to the disk tier first.
        self.spill();
        self.stats.prefix_lookup_tokens += s.prompt_len as u64;
        self.stats.prefix_hit_tokens += hit as u64;
        s.computed = hit;
        s.cached_prompt_tokens = Some(hit);
        s.admitted = Some(Instant::now());
        let bs = self.config.block_size;
        let reservation = Reservation {
            cached_tokens: hit,
            blocks: s.blocks.ids()[hit / bs..]
                .iter()
                .map(|&b| BlockId(b))
                .collect(),
        };
        self.remote.push(s);
        Ok(Some(reservation))
    }

    /// Step two: every reserved block holds its K/V and `first` is the token the prefill worker
    /// sampled. The request joins the running batch (decoding from the next step); its prompt
    /// blocks enter the prefix cache. Returns the first token's events.
    ///
    /// `source_cached`: the leading tokens the prefill side found in its caches rather than
    /// computed (what a resumed request's count of recomputed tokens takes from).
    pub fn join_remote(
        &mut self,
        id: RequestId,
        first: Sampled,
        source_cached: usize,
    ) -> Result<Vec<Event>, EngineError> {
        let i = self
            .remote
            .iter()
            .position(|s| s.id == id)
            .ok_or(EngineError::NotParked(id.0))?;
        let mut s = self.remote.remove(i);
        if s.tokens.len() > s.prompt_len {
            // Resumed: the KV of every token streamed before the move is here; the last one is
            // computed again so its logits come from this worker's sampler, which knows the
            // streamed tokens (penalties, seeded draws). The prefill worker's token is not used.
            let here = s.cached_prompt_tokens.unwrap_or(0);
            self.stats
                .resumed
                .add(s.tokens.len(), here.max(source_cached));
            s.computed = s.tokens.len() - 1;
            s.blocks.commit(&s.tokens, s.computed);
            self.run_seq(s);
            return Ok(Vec::new());
        }
        if !s.forks.is_empty() {
            // Parallel samples all draw from the last prompt token's logits, which stayed on
            // the prefill worker: that one token is computed again here (into this request's
            // own block) and the samples fork in that step. The prefill worker's token is not
            // used.
            s.computed = s.prompt_len - 1;
            s.blocks.commit(&s.tokens, s.computed);
            self.run_seq(s);
            return Ok(Vec::new());
        }
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
            index: s.index,
            sampled: first,
            finish,
        })];
        match finish {
            Some(r) => events.push(Event::Finished(s.finished(r))),
            None => {
                self.run_seq(s);
            }
        }
        Ok(events)
    }

    /// The transfer failed: the request is prefilled here, ahead of the queue, in the blocks it
    /// already holds (whatever a broken transfer left in them is recomputed).
    pub fn prefill_locally(&mut self, id: RequestId) -> bool {
        match self.remote.iter().position(|s| s.id == id) {
            Some(i) => {
                let s = self.remote.remove(i);
                if s.tokens.len() > s.prompt_len {
                    self.stats.resumed.add(s.tokens.len(), s.computed);
                }
                self.queue_front(s);
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
        if !r.resume.is_empty() || r.samples.count != 1 {
            return Err(EngineError::BadPlan(
                "a prefill-mode request has no output to resume and samples one first token".into(),
            ));
        }
        r.params = r.params.with_max_tokens(std::num::NonZeroU32::MIN);
        r.compile(self.grammars.as_deref())?;
        self.validate(&r)?;
        let mut s = self.new_seq(id, r);
        s.export = Some((skip_tokens / bs, skip_tokens / bs));
        self.enqueue(s);
        Ok(())
    }

    /// KV transfers read and write the host pools, or a device's pool through staging.
    fn check_host_cache(&self) -> Result<(), EngineError> {
        match self.backend.host_pools().is_empty() && self.backend.device_pools().is_empty() {
            false => Ok(()),
            true => Err(EngineError::Unsupported(format!(
                "KV transfer to or from a {} cache is not supported: run prefill and decode workers that exchange KV with --device cpu",
                self.backend.device()
            ))),
        }
    }

    /// The prompt blocks of a prefill-mode `s` that are complete now and not yet exported, copied
    /// out of every rank's pool, or out of every rank's device pool through its `staging` buffer
    /// (the last, partial block once the whole prompt is computed).
    pub(super) fn export_ready(
        backend: &dyn Backend,
        staging: &mut Vec<Option<Pinned>>,
        bs: usize,
        s: &mut Seq,
    ) -> Result<Option<KvChunk>, EngineError> {
        let Some((skip, next)) = s.export else {
            return Ok(None);
        };
        let upto = if s.computed >= s.prompt_len {
            s.prompt_len.div_ceil(bs)
        } else {
            s.computed / bs
        };
        if upto <= next {
            return Ok(None);
        }
        let ids = &s.blocks.ids()[next..upto];
        let pools = backend.host_pools();
        let mut pieces: Vec<KvPiece> = Vec::with_capacity(pools.len().max(1));
        for rp in &pools {
            let heads = rp.heads.clone();
            // A replicated range goes once.
            if pieces.iter().any(|p| p.heads == heads) {
                continue;
            }
            let kv = rp.pool;
            let frame_len = KvPool::frame_bytes(kv.layout, kv.dtype);
            let layers = (0..kv.num_layers)
                .map(|layer| {
                    let mut out = Vec::with_capacity(frame_len * ids.len());
                    for &b in ids {
                        kv.append_block(layer, b as usize, &mut out);
                    }
                    out
                })
                .collect();
            pieces.push(KvPiece {
                heads,
                layers,
                frame_len,
            });
        }
        if pools.is_empty() {
            let devices = backend.device_pools();
            if devices.is_empty() {
                return Err(EngineError::Internal(
                    "a prefill-mode sequence on a backend without a KV pool to export".into(),
                ));
            }
            staging.resize_with(devices.len(), || None);
            let blocks: Vec<BlockId> = ids.iter().map(|&b| BlockId(b)).collect();
            for ((heads, dev), staging) in devices.into_iter().zip(staging.iter_mut()) {
                // A replicated range goes once.
                if pieces.iter().any(|p| p.heads == heads) {
                    continue;
                }
                pieces.push(KvPiece {
                    heads,
                    layers: export_staged(&*dev, &blocks, staging)?,
                    frame_len: dev.format().frame_bytes(),
                });
            }
        }
        s.export = Some((skip, upto));
        Ok(Some(KvChunk {
            request: s.id,
            first: next - skip,
            blocks: upto - next,
            pieces,
        }))
    }
}

//! Admission: what a call asks for, checked before anything is admitted, and the admission by
//! the queue's expected wait that holds its unsent prompt tokens until they are sent.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tandem_engine::{ErrorKind, ValidSampling};
use tandem_proto::wire::{sampling_from_wire, status as fail};
use tandem_proto::worker as pb;
use tandem_worker::convert::status;
use tandem_worker::InFlight;
use tonic::Status;

use crate::Shared;

/// What a call asks for, checked before anything is admitted.
pub(crate) struct Checked {
    pub(crate) dest: pb::KvDestination,
    pub(crate) cached: usize,
    pub(crate) uncached: usize,
    pub(crate) sampling: ValidSampling,
}

/// One admitted prefill: counted in flight, its unsent tokens counted as queued, until dropped.
pub(crate) struct Admitted {
    shared: Arc<Shared>,
    unsent: u64,
    _in_flight: InFlight,
}

impl Admitted {
    /// `tokens` more of the prompt went out (a chunk's last block may be partly prompt: counted
    /// up to what is left).
    pub(crate) fn sent(&mut self, tokens: u64) {
        let t = tokens.min(self.unsent);
        self.unsent -= t;
        self.shared.queued_tokens.fetch_sub(t, Ordering::SeqCst);
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.shared
            .queued_tokens
            .fetch_sub(self.unsent, Ordering::SeqCst);
    }
}

impl Shared {
    /// Checks a call's destination and sampling against this worker before admitting it.
    pub(crate) fn check(&self, req: &pb::PrefillRequest) -> Result<Checked, Status> {
        let dest = req
            .destination
            .clone()
            .ok_or_else(|| fail(ErrorKind::InvalidRequest, "no KV destination"))?;
        let bs = self.engine.limits().block_size;
        let cached = req.cached_tokens as usize;
        let prompt_len = req.prompt_ids.len();
        if !cached.is_multiple_of(bs) || cached >= prompt_len {
            return Err(fail(ErrorKind::InvalidRequest, format!(
                "cached_tokens {cached} must be a multiple of the block size {bs} below the prompt length {prompt_len}"
            )));
        }
        let want_blocks = prompt_len.div_ceil(bs) - cached / bs;
        if dest.block_ids.len() != want_blocks {
            return Err(fail(
                ErrorKind::InvalidRequest,
                format!(
                "{} destination blocks for {} tokens after {cached} cached: {want_blocks} needed",
                dest.block_ids.len(),
                prompt_len - cached
            ),
            ));
        }
        // A prefill samples the first token and stops.
        let one = pb::Stopping {
            max_tokens: 1,
            ..Default::default()
        };
        let sampling = sampling_from_wire(req.sampling.clone(), Some(one))
            .validate()
            .map_err(|e| status(e.into()))?;
        Ok(Checked {
            dest,
            cached,
            uncached: prompt_len - cached,
            sampling,
        })
    }

    /// Admits `uncached` tokens unless the queue ahead would hold them past the limit; returns
    /// the admission and the tokens queued ahead of it.
    pub(crate) fn admit(self: &Arc<Self>, uncached: usize) -> Result<(Admitted, u64), Status> {
        let in_flight = self
            .drain
            .enter()
            .map_err(|m| fail(ErrorKind::Unavailable, m))?;
        let rate = self.engine.stats().prefill_tokens_per_s;
        let limit = self.limits.max_queue_wait.as_secs_f64();
        let uncached = uncached as u64;
        let mut ahead = self.queued_tokens.load(Ordering::SeqCst);
        loop {
            let wait = ahead as f64 / rate;
            if rate > 0.0 && ahead > 0 && wait > limit {
                self.counts.refused.fetch_add(1, Ordering::Relaxed);
                return Err(fail(ErrorKind::Busy, format!(
                    "prefill queue full: {ahead} prompt tokens ahead, about {wait:.1} s at {rate:.0} tokens/s (limit {limit:.1} s); try another worker"
                )));
            }
            match self.queued_tokens.compare_exchange(
                ahead,
                ahead + uncached,
                Ordering::SeqCst,
                Ordering::SeqCst,
            ) {
                Ok(_) => break,
                Err(now) => ahead = now,
            }
        }
        Ok((
            Admitted {
                shared: self.clone(),
                unsent: uncached,
                _in_flight: in_flight,
            },
            ahead,
        ))
    }
}

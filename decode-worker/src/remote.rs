//! The decode side of a disaggregated prefill (DESIGN.md §2, steps 4-6).
//!
//! The engine has already reserved blocks for the prompt (reusing this worker's prefix cache), so
//! only the uncached tail is asked for. For each candidate prefill worker in the router's order:
//! grant the blocks to a fresh transfer on this worker's [`KvReceiver`], call `Prefill` with the
//! destination, and wait for both the answer (the first token) and every block to arrive intact.
//! A candidate that refuses, dies, stalls past the deadline or sends a bad frame costs that attempt
//! only: the grant is revoked (late frames are rejected) and the next candidate gets a new one.
//! When none succeeds the caller prefills locally in the blocks it holds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_engine::{KvPoolWriter, Reservation, Sampled};
use tandem_kv_transfer::{BlockSink, KvReceiver, Secret, TransferError, TransferGrant};
use tandem_proto::worker::{self as pb, prefill_client::PrefillClient};
use tonic::transport::{Channel, Endpoint};

use crate::kv_sink::PoolSink;

/// How remote prefills ended, counted since start.
#[derive(Debug, Default)]
pub struct RemoteCounts {
    /// Attempts whose blocks all arrived and whose first token came back.
    pub transfers_ok: AtomicU64,
    /// Attempts that failed (prefill worker error, stall, bad frame); the next candidate is tried.
    pub transfers_failed: AtomicU64,
    /// Requests prefilled here after every candidate failed.
    pub fallbacks: AtomicU64,
    /// Remote plans taken locally because the pool had no room to reserve the prompt now.
    pub no_room: AtomicU64,
}

/// This worker's KV ingress: the receiver, the address prefill workers reach it at, and the
/// `Prefill` clients.
pub struct RemotePrefill {
    receiver: KvReceiver,
    endpoint: String,
    sink: Arc<dyn BlockSink>,
    deadline: Duration,
    clients: Mutex<HashMap<String, PrefillClient<Channel>>>,
    pub counts: RemoteCounts,
}

impl RemotePrefill {
    /// Listens for KV on `bind` (`host:port`, port 0 picks one); prefill workers are told to send
    /// to `advertise_host` and the bound port. Each attempt must finish within `deadline`.
    ///
    /// # Safety
    /// `writer` must belong to the engine whose reservations are passed to [`Self::prefill`]:
    /// only reserved (parked) blocks are ever granted, which the engine leaves alone.
    pub async unsafe fn bind(
        bind: &str,
        advertise_host: &str,
        secret: Secret,
        writer: KvPoolWriter,
        deadline: Duration,
    ) -> Result<Self, TransferError> {
        let receiver = KvReceiver::bind(bind, secret).await?;
        let endpoint = format!("{advertise_host}:{}", receiver.local_addr().port());
        Ok(Self {
            receiver,
            endpoint,
            // SAFETY: forwarded to the caller (see above).
            sink: Arc::new(unsafe { PoolSink::new(writer) }),
            deadline,
            clients: Mutex::new(HashMap::new()),
            counts: RemoteCounts::default(),
        })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn receiver(&self) -> &KvReceiver {
        &self.receiver
    }

    fn client(&self, addr: &str) -> Result<PrefillClient<Channel>, String> {
        let mut clients = self.clients.lock().expect("clients");
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("bad prefill worker address {addr:?}: {e}"))?
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(20));
        let c = PrefillClient::new(endpoint.connect_lazy());
        clients.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Fills `reservation` from the candidates in order; the first token on success, `None` when
    /// every candidate failed. `grant` holds the live attempt's grant: the caller keeps it in a
    /// place that drops before the engine request, so blocks are revoked before they are freed.
    pub async fn prefill(
        &self,
        request_id: &str,
        prompt: &[u32],
        sampling: pb::Sampling,
        reservation: &Reservation,
        candidates: &[String],
        grant: &mut Option<TransferGrant>,
    ) -> Option<Sampled> {
        for addr in candidates {
            match self
                .attempt(addr, request_id, prompt, sampling, reservation, grant)
                .await
            {
                Ok(first) => {
                    self.counts.transfers_ok.fetch_add(1, Ordering::Relaxed);
                    return Some(first);
                }
                Err(e) => {
                    self.counts.transfers_failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(request = request_id, prefill = %addr, error = %e, "remote prefill failed; trying the next candidate");
                }
            }
            // Revoke before anything else may touch the blocks.
            *grant = None;
        }
        *grant = None;
        self.counts.fallbacks.fetch_add(1, Ordering::Relaxed);
        None
    }

    async fn attempt(
        &self,
        addr: &str,
        request_id: &str,
        prompt: &[u32],
        sampling: pb::Sampling,
        reservation: &Reservation,
        grant: &mut Option<TransferGrant>,
    ) -> Result<Sampled, String> {
        let mut client = self.client(addr)?;
        let g = grant.insert(self.receiver.grant(
            &reservation.blocks,
            self.sink.clone(),
            self.deadline,
        ));
        let mut call = tonic::Request::new(pb::PrefillRequest {
            request_id: request_id.to_string(),
            prompt_ids: prompt.to_vec(),
            cached_tokens: reservation.cached_tokens as u32,
            destination: Some(pb::KvDestination {
                endpoint: self.endpoint.clone(),
                transfer_id: g.id(),
                block_ids: reservation.blocks.clone(),
            }),
            sampling: Some(sampling),
        });
        call.set_timeout(self.deadline);
        let answer = client.prefill(call);
        tokio::pin!(answer);
        let mut first: Option<Sampled> = None;
        let mut arrived = false;
        let give_up = tokio::time::sleep(self.deadline);
        tokio::pin!(give_up);
        while first.is_none() || !arrived {
            tokio::select! {
                r = &mut answer, if first.is_none() => {
                    let r = r.map_err(|s| format!("{}: {}", s.code(), s.message()))?.into_inner();
                    let t = r.first_token.ok_or("the prefill worker sent no first token")?;
                    first = Some(Sampled {
                        token: t.id,
                        logprob: t.logprob,
                        top: t.top.iter().map(|x| (x.id, x.logprob)).collect(),
                    });
                }
                r = g.wait(), if !arrived => {
                    r.map_err(|e| e.to_string())?;
                    arrived = true;
                }
                _ = &mut give_up => return Err(format!("no answer within {:?}", self.deadline)),
            }
        }
        Ok(first.expect("loop ends with the first token"))
    }
}

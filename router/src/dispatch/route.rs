//! Where a request runs: the decode worker the policy picks (the next one when it is
//! unreachable) and, for a long uncached prompt, the prefill workers it should try.

use std::sync::Arc;
use std::time::Duration;

use tandem_proto::worker as pb;

use crate::client::WorkerStream;
use crate::error::ApiError;
use crate::metrics::RouterMetrics;
use crate::policy::disagg::{self, DisaggConfig, PrefillCandidate};
use crate::policy::RoutingPolicy;
use crate::workers::{InFlightGuard, Worker, WorkerAddr, WorkerPool};

/// Everything needed to (re)open a request's stream on a decode worker.
pub(super) struct Route {
    pub(super) pool: Arc<WorkerPool>,
    pub(super) prefill_pool: Option<Arc<WorkerPool>>,
    pub(super) policy: Arc<dyn RoutingPolicy>,
    pub(super) disagg: DisaggConfig,
    pub(super) metrics: Arc<RouterMetrics>,
    pub(super) stall: Duration,
}

/// A stream opened on a decode worker.
pub(super) struct Opened {
    pub(super) stream: WorkerStream<pb::DecodeResponse>,
    pub(super) guard: InFlightGuard,
    /// Held on the first candidate prefill worker until the first token arrives.
    pub(super) prefill_guard: Option<InFlightGuard>,
}

impl Route {
    /// The prefill plan for `prompt` (run with `lora`) on decode worker `d`: remote with
    /// ordered candidates (those that serve the adapter) when the disaggregation policy says
    /// so, else local.
    pub(super) fn plan(
        &self,
        d: &Worker,
        prompt: &[u32],
        lora: Option<&pb::LoraRef>,
    ) -> (pb::PrefillPlan, Option<InFlightGuard>) {
        let local = pb::PrefillPlan {
            plan: Some(pb::prefill_plan::Plan::Local(pb::LocalPrefill {})),
        };
        let held = d.cached_prefix_tokens(prompt, lora);
        let uncached = prompt.len().saturating_sub(held);
        let here = d.load_report();
        let threshold = here.as_ref().map_or(self.disagg.min_tokens, |l| {
            disagg::min_tokens(
                &self.disagg,
                l.decoding,
                l.itl_target_ms,
                l.prefill_tokens_per_s,
            )
        });
        if uncached < threshold {
            return (local, None);
        }
        let mut ready: Vec<Arc<Worker>> = self
            .prefill_pool
            .as_ref()
            .map_or(Vec::new(), |pp| pp.ready())
            .into_iter()
            .filter(|w| w.serves(lora))
            .collect();
        let mut cands: Vec<PrefillCandidate> = ready
            .iter()
            .map(|w| PrefillCandidate {
                in_flight: w.in_flight(),
                cached_tokens: w.cached_prefix_tokens(prompt, lora),
                estimate_s: None,
            })
            .collect();
        // Decode peers that hold at least `min_tokens` more of the prompt (in their pool or on
        // their disk): the KV is pulled from them (their Prefill service computes what they lack
        // and pushes every block) instead of computed. Their decodes are not prompts queued
        // before this one, so they count as idle. A draining peer counts too: it holds the
        // K/V of the requests it handed over until they are pulled.
        if self.disagg.pull_from_peers {
            for w in self.pool.up() {
                if w.addr == d.addr || !w.serves(lora) {
                    continue;
                }
                let cached = w.cached_prefix_tokens(prompt, lora);
                if cached >= held + self.disagg.min_tokens {
                    cands.push(PrefillCandidate {
                        in_flight: 0,
                        cached_tokens: cached,
                        estimate_s: None,
                    });
                    ready.push(w);
                }
            }
        }
        // The measured crossover: computing here against each candidate's compute and link.
        let local_s = here
            .as_ref()
            .filter(|l| l.prefill_tokens_per_s > 0.0)
            .map(|l| uncached as f64 / l.prefill_tokens_per_s);
        let kv_bytes = here.as_ref().map_or(0.0, |l| l.kv_bytes_per_token);
        for (c, w) in cands.iter_mut().zip(&ready) {
            let link = here.as_ref().and_then(|l| {
                l.kv_links
                    .iter()
                    .find(|k| k.source == w.addr.as_str())
                    .map(|k| k.bytes_per_s)
            });
            let rate = w.load_report().map_or(0.0, |l| l.prefill_tokens_per_s);
            let lacks = prompt.len().saturating_sub(c.cached_tokens);
            c.estimate_s =
                disagg::estimate(lacks, rate, prompt.len(), kv_bytes, link.unwrap_or(0.0));
        }
        let order = disagg::plan(
            &self.disagg,
            threshold,
            prompt.len(),
            uncached,
            &cands,
            local_s,
        );
        let routing = tracing::Span::current();
        if let Some(l) = local_s {
            routing.record("tandem.route.local_estimate_s", l);
        }
        let best = cands
            .iter()
            .filter_map(|c| c.estimate_s)
            .min_by(f64::total_cmp);
        if let Some(r) = best {
            routing.record("tandem.route.remote_estimate_s", r);
        }
        if !cands.is_empty() {
            self.metrics.prefill_estimate(local_s, best);
        }
        let Some(&first) = order.first() else {
            return (local, None);
        };
        let guard = ready[first].start_request();
        let plan = pb::PrefillPlan {
            plan: Some(pb::prefill_plan::Plan::Remote(pb::RemotePrefill {
                prefill_addrs: order.iter().map(|&i| ready[i].addr.to_string()).collect(),
            })),
        };
        (plan, Some(guard))
    }

    /// Loads adapter `l` onto the ready decode worker (not in `tried`) the policy picks for
    /// `prompt`, from the path a worker that serves it read it from: that worker, or None when
    /// no worker is ready. No worker serving it anywhere: the model is not found.
    async fn place_lora(
        &self,
        prompt: &[u32],
        l: &pb::LoraRef,
        tried: &[WorkerAddr],
    ) -> Result<Option<Arc<Worker>>, ApiError> {
        let pools = std::iter::once(&*self.pool).chain(self.prefill_pool.as_deref());
        let Some(known) = crate::workers::served_loras(pools)
            .remove(&l.name)
            .filter(|i| l.content_hash == 0 || i.content_hash == l.content_hash)
        else {
            return Err(ApiError::ModelNotFound(l.name.clone()));
        };
        let Some(w) = self.pool.pick(self.policy.as_ref(), prompt, None, tried) else {
            return Ok(None);
        };
        let req = pb::LoadLoraRequest {
            name: l.name.clone(),
            path: known.path.clone(),
        };
        match w.client().load_lora(req).await {
            Ok(info) if l.content_hash == 0 || info.content_hash == l.content_hash => {
                tracing::info!(adapter = %l.name, worker = %w.addr, "LoRA adapter loaded where the request goes");
                self.metrics.lora_placed();
                w.note_lora(info);
                Ok(Some(w))
            }
            Ok(info) => Err(ApiError::Upstream {
                worker: w.addr.clone(),
                message: format!(
                    "LoRA adapter {:?} at {} has other weights there (content hash {:016x})",
                    l.name, known.path, info.content_hash
                ),
                kind: tandem_types::ErrorKind::Internal,
            }),
            Err(e) => Err(ApiError::Upstream {
                worker: w.addr.clone(),
                message: format!("loading LoRA adapter {:?}: {}", l.name, e.message()),
                kind: tandem_types::ErrorKind::Unavailable,
            }),
        }
    }

    /// Opens `request` (with `resume` as the tokens already streamed) on a ready decode worker
    /// not in `tried`, trying the next one when a worker is unreachable.
    pub(super) async fn open(
        &self,
        mut request: pb::DecodeRequest,
        resume: &[u32],
        tried: &mut Vec<WorkerAddr>,
    ) -> Result<Opened, ApiError> {
        request.resume_ids = resume.to_vec();
        loop {
            let lora = request.lora.as_ref();
            let picked = self
                .pool
                .pick(self.policy.as_ref(), &request.prompt_ids, lora, tried);
            let picked = match (picked, lora) {
                (Some(w), _) => Some(w),
                // No ready worker serves the adapter: load it on the one the policy picks.
                (None, Some(l)) => self.place_lora(&request.prompt_ids, l, tried).await?,
                (None, None) => None,
            };
            let Some(worker) = picked else {
                return Err(match tried.last() {
                    None => ApiError::NoWorker,
                    Some(last) => ApiError::Upstream {
                        worker: last.clone(),
                        message: "no decode worker could take the request".into(),
                        kind: tandem_types::ErrorKind::Unavailable,
                    },
                });
            };
            let guard = worker.start_request();
            // A resumed request's KV (its prompt and the tokens streamed before the move) comes
            // from wherever it is held, as a new prompt's does: the prefill worker that computed
            // the prompt, a peer, the new worker's own caches; what no one holds is computed.
            let tokens: Vec<u32> = request.prompt_ids.iter().chain(resume).copied().collect();
            let (plan, prefill_guard) = self.plan(&worker, &tokens, request.lora.as_ref());
            let remote = prefill_guard.is_some();
            let routing = tracing::Span::current();
            if !routing.is_disabled() {
                routing.record("tandem.route.worker", worker.addr.as_str());
                let cached =
                    worker.cached_prefix_tokens(&request.prompt_ids, request.lora.as_ref()) as i64;
                routing.record("tandem.route.cached_tokens", cached);
                routing.record(
                    "tandem.route.prefill",
                    if remote { "remote" } else { "local" },
                );
                if let Some(pb::prefill_plan::Plan::Remote(r)) = &plan.plan {
                    let n = r.prefill_addrs.len() as i64;
                    routing.record("tandem.route.prefill_candidates", n);
                }
            }
            request.prefill = Some(plan);
            match worker.client().generate(request.clone()).await {
                Ok(stream) => {
                    if resume.is_empty() {
                        self.metrics.prefill(remote);
                    }
                    return Ok(Opened {
                        stream,
                        guard,
                        prefill_guard,
                    });
                }
                Err(s) if tandem_proto::wire::is_draining(&s) => {
                    // Draining, not dead: it may still serve pulls of what it holds.
                    tracing::info!(worker = %worker.addr, "worker draining, trying another");
                    worker.mark_draining();
                    tried.push(worker.addr.clone());
                }
                Err(s) if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown) => {
                    tracing::warn!(worker = %worker.addr, error = %s, "worker unavailable, trying another");
                    worker.mark_down();
                    tried.push(worker.addr.clone());
                }
                Err(s) => return Err(ApiError::from_worker(&worker.addr, &s)),
            }
        }
    }
}

//! `tandem.worker.v1.WorkerControl`: what every worker answers, whatever its role.

use std::sync::Arc;

use tandem_engine::EngineHandle;
use tandem_proto::worker::{self as pb, worker_control_server::WorkerControl};
use tonic::{Request, Response, Status};

use crate::convert::{kv_event_stream, load_report, worker_info, BoxStream};
use crate::{Drain, LinkRates, WorkerIdentity};

/// Info, Load and KvEvents over a worker's engine. Cheap to clone.
#[derive(Clone)]
pub struct ControlService {
    engine: Arc<EngineHandle>,
    identity: WorkerIdentity,
    drain: Arc<Drain>,
    links: Option<Arc<LinkRates>>,
}

impl ControlService {
    /// Answers for `engine`; `drain` supplies the in-flight count and draining flag of `Load`,
    /// and ends the KV-event streams when the worker stops.
    pub fn new(engine: Arc<EngineHandle>, identity: WorkerIdentity, drain: Arc<Drain>) -> Self {
        Self {
            engine,
            identity,
            drain,
            links: None,
        }
    }

    /// Reports `links` (the rates this worker received KV at, by source) in `Load`.
    pub fn with_links(mut self, links: Arc<LinkRates>) -> Self {
        self.links = Some(links);
        self
    }

    /// The worker's requests in flight and graceful stop.
    pub fn drain(&self) -> &Arc<Drain> {
        &self.drain
    }

    /// Who the worker is.
    pub fn identity(&self) -> &WorkerIdentity {
        &self.identity
    }
}

#[tonic::async_trait]
impl WorkerControl for ControlService {
    type KvEventsStream = BoxStream<pb::KvEventBatch>;

    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::WorkerInfo>, Status> {
        Ok(Response::new(worker_info(
            &self.identity,
            self.engine.limits(),
        )))
    }

    async fn load(&self, _: Request<pb::LoadRequest>) -> Result<Response<pb::LoadReport>, Status> {
        let mut r = load_report(
            self.engine.stats(),
            self.drain.in_flight(),
            self.drain.is_draining(),
        );
        r.kv_bytes_per_token = self.engine.limits().kv_bytes_per_token;
        r.loras = self.identity.loras.list();
        if let Some(l) = &self.links {
            r.kv_links = l
                .snapshot()
                .into_iter()
                .map(|(source, bytes_per_s)| pb::KvLink {
                    source,
                    bytes_per_s,
                })
                .collect();
        }
        Ok(Response::new(r))
    }

    async fn load_lora(
        &self,
        req: Request<pb::LoadLoraRequest>,
    ) -> Result<Response<pb::LoraInfo>, Status> {
        let r = req.into_inner();
        let loras = self.identity.loras.clone();
        let path = std::path::PathBuf::from(&r.path);
        let info = tokio::task::spawn_blocking(move || loras.load(&r.name, &path))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        tracing::info!(
            adapter = %info.name,
            path = %info.path,
            rank = info.rank,
            bytes = info.bytes,
            "LoRA adapter loaded"
        );
        Ok(Response::new(info))
    }

    async fn unload_lora(
        &self,
        req: Request<pb::UnloadLoraRequest>,
    ) -> Result<Response<pb::UnloadLoraResponse>, Status> {
        let name = req.into_inner().name;
        self.identity.loras.unload(&name)?;
        tracing::info!(adapter = %name, "LoRA adapter unloaded");
        Ok(Response::new(pb::UnloadLoraResponse {}))
    }

    async fn kv_events(
        &self,
        _: Request<pb::KvEventsRequest>,
    ) -> Result<Response<Self::KvEventsStream>, Status> {
        Ok(Response::new(kv_event_stream(
            &self.engine,
            self.drain.stopped(),
        )?))
    }
}

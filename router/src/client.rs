//! The router's one seam to its workers: what it asks of a worker, whatever carries the call.
//!
//! [`WorkerClient`] is the five calls the router makes (Info, Load and KvEvents of the
//! WorkerControl service every worker serves; Generate and StopSamples of a decode worker). [`Connect`] makes a
//! client for an address. In production both are gRPC ([`GrpcConnect`]: one lazily connected
//! channel per worker); a test puts an in-memory fake behind the same traits and drives the
//! dispatcher's routing, migration and error mapping without a process or a socket.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tandem_proto::worker::{
    self as pb, decode_client::DecodeClient, worker_control_client::WorkerControlClient,
};
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

use crate::workers::WorkerAddr;

/// A stream of a worker's messages; an error ends it.
pub type WorkerStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// The calls the router makes to one worker. Errors are the worker's gRPC statuses (a fake
/// returns the ones a real worker would).
#[tonic::async_trait]
pub trait WorkerClient: Send + Sync {
    /// Who the worker is (constant for its life).
    async fn info(&self) -> Result<pb::WorkerInfo, Status>;
    /// Its load now.
    async fn load(&self) -> Result<pb::LoadReport, Status>;
    /// Its prefix cache: a snapshot, then every change.
    async fn kv_events(&self) -> Result<WorkerStream<pb::KvEventBatch>, Status>;
    /// Serves one request on a decode worker; dropping the stream cancels it.
    async fn generate(
        &self,
        request: pb::DecodeRequest,
    ) -> Result<WorkerStream<pb::DecodeResponse>, Status>;
    /// Finishes some samples of a request a decode worker runs, its other samples going on.
    async fn stop_samples(
        &self,
        request: pb::StopSamplesRequest,
    ) -> Result<pb::StopSamplesResponse, Status>;
    /// Has the worker read a LoRA adapter and serve it.
    async fn load_lora(&self, request: pb::LoadLoraRequest) -> Result<pb::LoraInfo, Status> {
        let _ = request;
        Err(Status::unimplemented("LoadLora"))
    }
    /// Has the worker stop serving a LoRA adapter.
    async fn unload_lora(&self, name: &str) -> Result<(), Status> {
        let _ = name;
        Err(Status::unimplemented("UnloadLora"))
    }
}

/// Makes the client of a worker at an address (called once per address discovery reports).
pub trait Connect: Send + Sync {
    /// A client for `addr`; an error when the address cannot name a worker.
    fn connect(&self, addr: &WorkerAddr) -> Result<Arc<dyn WorkerClient>, String>;
}

/// gRPC over a lazily connected HTTP/2 channel per worker.
#[derive(Clone, Debug)]
pub struct GrpcConnect {
    /// How long opening a connection may take.
    pub connect_timeout: Duration,
    /// The worker plane's credential (`Bearer <token>`, the token derived from the cluster's
    /// KV secret), sent on every call; none when the cluster has no secret.
    pub token: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

impl Connect for GrpcConnect {
    fn connect(&self, addr: &WorkerAddr) -> Result<Arc<dyn WorkerClient>, String> {
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("bad worker address {addr:?}: {e}"))?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(20));
        Ok(Arc::new(GrpcClient {
            channel: endpoint.connect_lazy(),
            token: self.token.clone(),
        }))
    }
}

struct GrpcClient {
    channel: Channel,
    token: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

impl GrpcClient {
    /// `message` as a call that carries the worker plane's credential.
    fn call<T>(&self, message: T) -> tonic::Request<T> {
        let mut call = tonic::Request::new(message);
        if let Some(t) = &self.token {
            call.metadata_mut().insert("authorization", t.clone());
        }
        call
    }
}

#[tonic::async_trait]
impl WorkerClient for GrpcClient {
    async fn info(&self) -> Result<pb::WorkerInfo, Status> {
        let mut c = WorkerControlClient::new(self.channel.clone());
        Ok(c.info(self.call(pb::InfoRequest {})).await?.into_inner())
    }

    async fn load(&self) -> Result<pb::LoadReport, Status> {
        let mut c = WorkerControlClient::new(self.channel.clone());
        Ok(c.load(self.call(pb::LoadRequest {})).await?.into_inner())
    }

    async fn kv_events(&self) -> Result<WorkerStream<pb::KvEventBatch>, Status> {
        let mut c = WorkerControlClient::new(self.channel.clone());
        Ok(Box::pin(
            c.kv_events(self.call(pb::KvEventsRequest {}))
                .await?
                .into_inner(),
        ))
    }

    async fn generate(
        &self,
        request: pb::DecodeRequest,
    ) -> Result<WorkerStream<pb::DecodeResponse>, Status> {
        let mut c = DecodeClient::new(self.channel.clone());
        // The worker's span hangs from the caller's (the routing decision or a migration).
        let mut call = self.call(request);
        tandem_telemetry::inject(&tracing::Span::current(), call.metadata_mut().as_mut());
        Ok(Box::pin(c.generate(call).await?.into_inner()))
    }

    async fn stop_samples(
        &self,
        request: pb::StopSamplesRequest,
    ) -> Result<pb::StopSamplesResponse, Status> {
        let mut c = DecodeClient::new(self.channel.clone());
        Ok(c.stop_samples(self.call(request)).await?.into_inner())
    }

    async fn load_lora(&self, request: pb::LoadLoraRequest) -> Result<pb::LoraInfo, Status> {
        let mut c = WorkerControlClient::new(self.channel.clone());
        Ok(c.load_lora(self.call(request)).await?.into_inner())
    }

    async fn unload_lora(&self, name: &str) -> Result<(), Status> {
        let mut c = WorkerControlClient::new(self.channel.clone());
        let name = name.to_string();
        c.unload_lora(self.call(pb::UnloadLoraRequest { name }))
            .await?;
        Ok(())
    }
}

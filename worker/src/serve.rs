//! The gRPC server every worker role runs, and its graceful stop.

use std::net::SocketAddr;
use std::time::Duration;

use prometheus_client::collector::Collector;
use tandem_proto::worker::worker_control_server::WorkerControlServer;
use tokio::net::TcpListener;

use crate::ControlService;

/// Serves a role's own service (`role`: its routes, `name`: its full gRPC name), the
/// [`ControlService`] (whose [`Drain`](crate::Drain) stops the worker), grpc.health.v1 and `/metrics` (from `metrics`, every
/// sample labelled with the worker's `model_name` and its `role`; plain HTTP/1.1 is accepted
/// on the same port for it) on `listener` until `signal` resolves. Then it drains: health turns
/// NOT_SERVING, new requests are refused, the ones in flight get up to `drain_deadline`, and the
/// KV-event streams end.
///
/// `POST /deregister` from the worker's own host (Kubernetes' preStop hook runs
/// `tandem deregister` in the pod) leaves the cluster ahead of the signal: health turns
/// NOT_SERVING, `Load` reports draining and new requests are refused, while the ones in flight
/// go on; the drain proper still waits for `signal`.
///
/// With a `token`, the worker's own services and `/deregister` need it ([`WorkerToken`]
/// (crate::WorkerToken)); health, reflection and `/metrics` stay open.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    listener: TcpListener,
    role: tonic::service::Routes,
    name: &'static str,
    control: ControlService,
    metrics: impl Collector + Clone,
    signal: impl std::future::Future<Output = ()> + Send,
    drain_deadline: Duration,
    token: Option<crate::WorkerToken>,
) -> Result<(), tonic::transport::Error> {
    let drain = control.drain().clone();
    let control_drain = drain.clone();
    // `tandem.worker.v1.Decode` serves the `decode` role.
    let role_name = name.rsplit('.').next().unwrap_or(name).to_lowercase();
    let model = control.identity().model.clone();
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(name, tonic_health::ServingStatus::Serving)
        .await;
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    let incoming = incoming(listener);
    let leaving = drain.clone();
    let drained = async move {
        let mut signal = std::pin::pin!(signal);
        tokio::select! {
            _ = &mut signal => {}
            _ = leaving.left() => {
                tracing::info!(
                    ?addr,
                    in_flight = leaving.in_flight(),
                    "deregistered: taking no new requests, finishing the ones in flight until told to stop"
                );
                not_serving(&reporter, name).await;
                signal.await;
            }
        }
        tracing::info!(
            ?addr,
            role = name,
            "shutting down: draining in-flight requests"
        );
        not_serving(&reporter, name).await;
        let left = drain.drain(drain_deadline).await;
        if left > 0 {
            tracing::warn!(left, "drain deadline passed with requests still running");
        }
    };
    // Reflection (v1, and v1alpha for grpcurl 1.8) so grpcurl can call a worker directly.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tandem_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let mut routes = role
        .add_service(WorkerControlServer::new(control))
        .add_service(health);
    match (reflection().build_v1(), reflection().build_v1alpha()) {
        (Ok(v1), Ok(v1alpha)) => routes = routes.add_service(v1).add_service(v1alpha),
        (Err(e), _) | (_, Err(e)) => tracing::warn!(error = %e, "no gRPC reflection"),
    }
    let routes = routes
        .into_axum_router()
        .merge(crate::metrics::router(metrics, &model, &role_name))
        .route(
            "/deregister",
            axum::routing::post(deregister).with_state(control_drain),
        )
        .layer(axum::middleware::from_fn_with_state(
            token,
            crate::auth::require,
        ));
    tonic::transport::Server::builder()
        // A panic in any call is that call's INTERNAL status (tandem_proto::guard).
        .layer(tandem_proto::guard::CatchPanicLayer)
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .accept_http1(true)
        .add_routes(tonic::service::Routes::from(routes))
        .serve_with_incoming_shutdown(incoming, drained)
        .await
}

/// The connections `listener` accepts, each with `TCP_NODELAY` set. The builder's own
/// `tcp_nodelay` applies only to a listener it binds itself, not to one handed in, and without
/// it a token's small HTTP/2 frame waited behind an unacknowledged one (a `Load` answer on the
/// same connection) for the peer's delayed acknowledgement: a stream stalled about 45 ms at
/// every load poll, twice a second.
fn incoming(listener: TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Health turns NOT_SERVING for the role's service `name` and the server as a whole.
async fn not_serving(reporter: &tonic_health::server::HealthReporter, name: &str) {
    for service in [name, ""] {
        reporter
            .set_service_status(service, tonic_health::ServingStatus::NotServing)
            .await;
    }
}

/// `POST /deregister`: the worker leaves the cluster (see [`serve`]). Only a caller on the
/// worker's own host may ask: anyone else gets 403.
async fn deregister(
    axum::extract::State(drain): axum::extract::State<std::sync::Arc<crate::Drain>>,
    req: axum::extract::Request,
) -> (axum::http::StatusCode, axum::Json<serde_json::Value>) {
    let local = req
        .extensions()
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(|c| c.remote_addr())
        .is_some_and(|a| a.ip().is_loopback());
    if !local {
        return (
            axum::http::StatusCode::FORBIDDEN,
            axum::Json(serde_json::json!({
                "error": "deregister is accepted only from the worker's own host (127.0.0.1)"
            })),
        );
    }
    let in_flight = drain.leave();
    (
        axum::http::StatusCode::OK,
        axum::Json(serde_json::json!({"deregistered": true, "in_flight": in_flight})),
    )
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    #[tokio::test]
    async fn accepted_connections_send_small_frames_at_once() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut incoming = super::incoming(listener);
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(
            accepted.nodelay().unwrap(),
            "TCP_NODELAY on the worker's side"
        );
        // What a plain accept gives, for contrast: the option is the accept's doing.
        let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _c = tokio::net::TcpStream::connect(plain.local_addr().unwrap())
            .await
            .unwrap();
        let (raw, _) = plain.accept().await.unwrap();
        assert!(!raw.nodelay().unwrap());
        drop(client);
    }
}

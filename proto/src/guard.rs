//! A panic while serving one gRPC call becomes that call's `INTERNAL` status, never a reset stream
//! or a lost connection.
//!
//! [`CatchPanicLayer`] wraps a tonic server's services (`Server::builder().layer(..)`). A panic in
//! a handler, before its response, answers `INTERNAL` with the panic's message. A panic while its
//! response streams (a server-streaming handler's stream is polled as the body is sent) ends the
//! stream with `INTERNAL` trailers after the messages already sent, so a client reads an error,
//! never a clean end of a cut-short stream. Either way the panic is logged and every other call
//! and connection go on. A request that is not gRPC (a worker's `/metrics` or `/deregister` share
//! its port) gets a plain 500.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::FutureExt;
use http_body::Frame;
use tonic::body::Body;
use tonic::codegen::{http, Bytes};

/// The layer: see the module's text.
#[derive(Clone, Copy, Debug, Default)]
pub struct CatchPanicLayer;

impl<S> tower::Layer<S> for CatchPanicLayer {
    type Service = CatchPanic<S>;

    fn layer(&self, inner: S) -> CatchPanic<S> {
        CatchPanic { inner }
    }
}

/// The service [`CatchPanicLayer`] makes.
#[derive(Clone, Debug)]
pub struct CatchPanic<S> {
    inner: S,
}

/// `INTERNAL` with the panic's message, as a gRPC call's status.
fn panicked(what: &str) -> tonic::Status {
    tonic::Status::internal(format!("the server failed this call: {what}"))
}

fn is_grpc<B>(req: &http::Request<B>) -> bool {
    req.headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

/// The answer to a request whose handler panicked (`p`), logged.
fn panic_response(
    grpc: bool,
    path: &str,
    p: Box<dyn std::any::Any + Send>,
) -> http::Response<Body> {
    let what = tandem_types::panic_message(p.as_ref());
    tracing::error!(panic = %what, %path, "a gRPC handler panicked");
    if grpc {
        panicked(&what).into_http()
    } else {
        let mut r = http::Response::new(Body::new(format!(
            "the server failed this request: {what}\n"
        )));
        *r.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
        r
    }
}

impl<S, ReqBody, ResBody> tower::Service<http::Request<ReqBody>> for CatchPanic<S>
where
    S: tower::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: http_body::Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<tonic::codegen::StdError>,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<http::Response<Body>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let grpc = is_grpc(&req);
        let path = req.uri().path().to_owned();
        // The handler may panic as it is called, as its future runs, or as its body is polled.
        let fut = match std::panic::catch_unwind(AssertUnwindSafe(|| self.inner.call(req))) {
            Ok(f) => f,
            Err(p) => return Box::pin(std::future::ready(Ok(panic_response(grpc, &path, p)))),
        };
        Box::pin(async move {
            match AssertUnwindSafe(fut).catch_unwind().await {
                Ok(Ok(resp)) => Ok(resp.map(|b| {
                    Body::new(Guarded {
                        inner: Box::pin(b),
                        grpc,
                        path,
                        done: false,
                    })
                })),
                Ok(Err(e)) => Err(e),
                Err(p) => Ok(panic_response(grpc, &path, p)),
            }
        })
    }
}

/// A response body whose every poll runs under `catch_unwind`: a panic ends it with `INTERNAL`
/// trailers (gRPC) or just ends it (anything else; its status has gone out already).
struct Guarded<B> {
    inner: Pin<Box<B>>,
    grpc: bool,
    path: String,
    done: bool,
}

impl<B> http_body::Body for Guarded<B>
where
    B: http_body::Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let this = &mut *self;
        match std::panic::catch_unwind(AssertUnwindSafe(|| this.inner.as_mut().poll_frame(cx))) {
            Ok(p) => p,
            Err(p) => {
                self.done = true;
                let what = tandem_types::panic_message(p.as_ref());
                tracing::error!(panic = %what, path = %self.path, "a gRPC response stream panicked");
                if !self.grpc {
                    return Poll::Ready(None);
                }
                let mut trailers = http::HeaderMap::new();
                match panicked(&what).add_header(&mut trailers) {
                    Ok(()) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
                    Err(_) => Poll::Ready(None),
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::generation_client::GenerationClient;
    use crate::v1::generation_server::{Generation, GenerationServer};
    use crate::v1::*;
    use futures::Stream;
    use tonic::{Request, Response, Status};

    /// A Generation service whose calls panic where the request's model says: "handler" before
    /// answering, "stream" after one message of its stream; any other model answers normally.
    struct Panicky;

    type Gen = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

    #[tonic::async_trait]
    impl Generation for Panicky {
        type GenerateStream = Gen;

        async fn generate(
            &self,
            request: Request<GenerateRequest>,
        ) -> Result<Response<Gen>, Status> {
            let model = request.into_inner().model;
            if model == "handler" {
                panic!("boom in the handler");
            }
            let msg = |text: &str| GenerateResponse {
                text: text.into(),
                ..Default::default()
            };
            let (first, second) = (msg("one"), msg("two"));
            let boom = model == "stream";
            // The second message waits a turn, as a generated token does, so the first one is
            // sent before the panic.
            let s = futures::stream::iter([0, 1]).then(move |i| {
                let (first, second) = (first.clone(), second.clone());
                async move {
                    if i == 0 {
                        return Ok(first);
                    }
                    tokio::task::yield_now().await;
                    if boom {
                        panic!("boom in the stream");
                    }
                    Ok(second)
                }
            });
            Ok(Response::new(Box::pin(s)))
        }

        async fn tokenize(
            &self,
            _: Request<TokenizeRequest>,
        ) -> Result<Response<TokenizeResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        async fn list_models(
            &self,
            _: Request<ListModelsRequest>,
        ) -> Result<Response<ListModelsResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    use futures::StreamExt;

    async fn serve() -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        tokio::spawn(
            tonic::transport::Server::builder()
                .layer(CatchPanicLayer)
                .add_service(GenerationServer::new(Panicky))
                .serve_with_incoming(incoming),
        );
        format!("http://{addr}")
    }

    /// The texts a call streams, and how it ended.
    async fn call(
        client: &mut GenerationClient<tonic::transport::Channel>,
        model: &str,
    ) -> (Vec<String>, Result<(), Status>) {
        let req = GenerateRequest {
            model: model.into(),
            ..Default::default()
        };
        let mut stream = match client.generate(req).await {
            Ok(r) => r.into_inner(),
            Err(s) => return (Vec::new(), Err(s)),
        };
        let mut texts = Vec::new();
        loop {
            match stream.message().await {
                Ok(Some(m)) => texts.push(m.text),
                Ok(None) => return (texts, Ok(())),
                Err(s) => return (texts, Err(s)),
            }
        }
    }

    #[tokio::test]
    async fn a_panicking_call_is_that_call_s_internal_status_and_the_server_goes_on() {
        let url = serve().await;
        let mut client = GenerationClient::connect(url).await.unwrap();

        let (texts, end) = call(&mut client, "handler").await;
        assert!(texts.is_empty());
        let s = end.expect_err("a panic before the answer is an error");
        assert_eq!(s.code(), tonic::Code::Internal);
        assert!(
            s.message().contains("boom in the handler"),
            "{}",
            s.message()
        );

        // Mid-stream: what was sent arrives, then INTERNAL, not a clean end.
        let (texts, end) = call(&mut client, "stream").await;
        assert_eq!(texts, ["one"]);
        let s = end.expect_err("a panic mid-stream ends it with an error");
        assert_eq!(s.code(), tonic::Code::Internal);
        assert!(
            s.message().contains("boom in the stream"),
            "{}",
            s.message()
        );

        // The same connection serves the next call whole.
        let (texts, end) = call(&mut client, "fine").await;
        assert_eq!(texts, ["one", "two"]);
        assert!(end.is_ok(), "{end:?}");
    }
}

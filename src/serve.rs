//! `tandem decode` and `tandem router`: the long-running roles.
//!
//! Each prints one line to stdout once its ports are open (`tandem decode: listening on ADDR`,
//! `tandem router: http ADDR grpc ADDR`) so a supervisor (`tandem up`, a test) learns the
//! addresses even when it asked for port 0. SIGINT and SIGTERM start a graceful shutdown.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use tandem_decode_worker::{DecodeService, WorkerIdentity};
use tandem_engine::{EngineError, EngineHandle};
use tandem_router::RouterArgs;

use crate::up::{DECODE_READY, ROUTER_READY};
use crate::{fetch, EngineArgs};

#[derive(Args, Clone, Debug)]
pub struct DecodeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, env = "TANDEM_HOST", default_value = "0.0.0.0")]
    pub host: String,
    /// gRPC port (0: any free port).
    #[arg(long, env = "TANDEM_PORT", default_value_t = 50100)]
    pub port: u16,
    /// This worker's name in logs and `Info` (default: decode-<port>).
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Seconds in-flight requests get to finish after SIGTERM before the worker exits anyway.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
}

/// Resolves when the process gets SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The async runtime for the network side. A decode worker gives it one thread: its compute
/// runs on rayon threads that every extra runnable thread would preempt.
fn runtime(threads: usize) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .context("starting the async runtime")
}

pub fn run_decode(a: DecodeArgs) -> Result<()> {
    let model_path = match &a.engine.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model()?,
    };
    let mut engine_args = a.engine.clone();
    engine_args.model = Some(model_path.clone());
    let kv_dtype = format!("{:?}", engine_args.kv_dtype).to_lowercase();
    let (name_tx, name_rx) = std::sync::mpsc::channel();
    let handle = EngineHandle::spawn(move || {
        let (engine, loaded) = engine_args
            .build()
            .map_err(|e| EngineError::Internal(format!("{e:#}")))?;
        let _ = name_tx.send(loaded.name.clone());
        Ok(engine)
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let model = name_rx.recv().unwrap_or_else(|_| "model".into());
    let rt = runtime(1)?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((a.host.as_str(), a.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
        let addr = listener.local_addr()?;
        let identity = WorkerIdentity {
            worker_id: a
                .worker_id
                .clone()
                .unwrap_or_else(|| format!("decode-{}", addr.port())),
            model,
            kv_dtype,
        };
        let (service, shutdown) = DecodeService::new(Arc::new(handle), identity);
        println!("{DECODE_READY} {addr}");
        std::io::stdout().flush()?;
        tandem_decode_worker::serve(
            listener,
            service,
            shutdown,
            shutdown_signal(),
            Duration::from_secs(a.drain_timeout_s),
        )
        .await
        .context("decode worker")?;
        eprintln!("tandem decode: stopped");
        Ok(())
    })
}

pub fn run_router(a: RouterArgs) -> Result<()> {
    let path = match &a.model {
        Some(p) => p.clone(),
        None => fetch::ensure_default_model()?,
    };
    let model = tandem_router::load_model(&path, a.served_model_name.clone())
        .with_context(|| format!("loading the tokenizer from {}", path.display()))?;
    let rt = runtime(2)?;
    rt.block_on(async move {
        tandem_router::serve(
            a,
            model,
            |b| {
                println!("{ROUTER_READY} http {} grpc {}", b.http, b.grpc);
                let _ = std::io::stdout().flush();
            },
            shutdown_signal(),
        )
        .await
        .context("router")
    })
}

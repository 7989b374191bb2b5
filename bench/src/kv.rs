//! `tandem bench kv-transfer`: KV transfer throughput over loopback against a plain TCP copy of
//! the same bytes, in the same run.
//!
//! For each prompt length, the blocks that prompt fills are read out of a source pool, sent with
//! the TCP transport (authenticated, checksummed frames) to a receiver that writes them into a
//! destination pool, and the grant is awaited: the time a decode worker would wait for a remote
//! prefill's KV. The baseline sends the same number of bytes in the same chunk sizes over a plain
//! TCP socket into a buffer. Rounds alternate the two so machine noise hits both.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_decode_worker::kv_sink::PoolSink;
use tandem_engine::{KvDtype, KvPool};
use tandem_kernels::KvLayout;
use tandem_kv_transfer::{KvReceiver, KvTransport, Secret, TcpTransport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::percentile;

#[derive(Clone, Debug, Serialize)]
pub struct KvBenchRow {
    pub prompt_tokens: usize,
    pub blocks: usize,
    pub bytes: usize,
    /// Median seconds for the whole transfer (read out, send, verify, write, grant complete).
    pub transfer_ms: f64,
    pub transfer_gb_s: f64,
    /// Median seconds to move the same bytes over a plain TCP socket.
    pub tcp_ms: f64,
    pub tcp_gb_s: f64,
    pub ratio: f64,
}

async fn one_transfer(
    src: &KvPool,
    rx: &KvReceiver,
    sink: Arc<PoolSink>,
    transport: &TcpTransport,
    blocks: &[u32],
) -> Result<f64, String> {
    let t0 = Instant::now();
    let mut grant = rx.grant(blocks, sink, Duration::from_secs(60));
    let mut s = transport
        .open(&rx.local_addr().to_string())
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    for layer in 0..src.num_layers {
        for (i, &b) in blocks.iter().enumerate() {
            let payload = match src.block_bytes(layer, i) {
                Some(p) => p,
                None => {
                    src.read_block(layer, i, &mut buf);
                    &buf
                }
            };
            s.send_block(grant.id(), layer as u32, b, payload)
                .await
                .map_err(|e| e.to_string())?;
        }
    }
    s.end(grant.id()).await.map_err(|e| e.to_string())?;
    grant.wait().await.map_err(|e| e.to_string())?;
    Ok(t0.elapsed().as_secs_f64())
}

async fn one_plain_copy(bytes: usize, chunk: usize) -> Result<f64, String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.map_err(|e| e.to_string())?;
        let mut buf = vec![0u8; chunk];
        let mut got = 0;
        while got < bytes {
            let n = (bytes - got).min(chunk);
            s.read_exact(&mut buf[..n])
                .await
                .map_err(|e| e.to_string())?;
            got += n;
        }
        Ok::<_, String>(())
    });
    let t0 = Instant::now();
    let mut w = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    w.set_nodelay(true).map_err(|e| e.to_string())?;
    let data = vec![7u8; chunk];
    let mut sent = 0;
    while sent < bytes {
        let n = (bytes - sent).min(chunk);
        w.write_all(&data[..n]).await.map_err(|e| e.to_string())?;
        sent += n;
    }
    w.flush().await.map_err(|e| e.to_string())?;
    reader.await.map_err(|e| e.to_string())??;
    Ok(t0.elapsed().as_secs_f64())
}

/// Runs every prompt length for `rounds` rounds; a row per length.
pub async fn run(
    layout: KvLayout,
    dtype: KvDtype,
    layers: usize,
    prompt_tokens: &[usize],
    rounds: usize,
) -> Result<Vec<KvBenchRow>, String> {
    let max_blocks = prompt_tokens
        .iter()
        .map(|t| t.div_ceil(layout.block_size))
        .max()
        .unwrap_or(1);
    let mut src = KvPool::new(layout, dtype, layers, max_blocks);
    // Non-trivial contents so the checksum does real work on real-looking bytes.
    for l in 0..layers {
        if let tandem_kernels::KvSlabMut::F32(d) = src.layer_mut(l) {
            for (i, x) in d.iter_mut().enumerate() {
                *x = ((i * 31 + l * 7) % 1000) as f32 * 1e-3;
            }
        }
    }
    let dst = KvPool::new(layout, dtype, layers, max_blocks * 2);
    let secret = Secret::random();
    let rx = KvReceiver::bind("127.0.0.1:0", secret.clone())
        .await
        .map_err(|e| e.to_string())?;
    // SAFETY: nothing but this benchmark touches `dst`, and one transfer runs at a time.
    let sink = Arc::new(unsafe { PoolSink::new(dst.writer()) });
    let transport = TcpTransport::new(secret);
    let frame = KvPool::frame_bytes(layout, dtype);
    let mut rows = Vec::new();
    for &tokens in prompt_tokens {
        let n = tokens.div_ceil(layout.block_size);
        // Destination blocks somewhere else than the source's, as in a real pool.
        let blocks: Vec<u32> = (0..n as u32).map(|b| b + max_blocks as u32).collect();
        let bytes = n * layers * frame;
        let (mut kv, mut tcp) = (Vec::new(), Vec::new());
        for _ in 0..rounds.max(1) {
            kv.push(one_transfer(&src, &rx, sink.clone(), &transport, &blocks).await?);
            tcp.push(one_plain_copy(bytes, frame).await?);
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for l in 0..layers {
            for i in 0..n {
                src.read_block(l, i, &mut a);
                dst.read_block(l, i + max_blocks, &mut b);
                if a != b {
                    return Err(format!("layer {l} block {i} arrived different"));
                }
            }
        }
        let (k, t) = (percentile(&mut kv, 0.5), percentile(&mut tcp, 0.5));
        rows.push(KvBenchRow {
            prompt_tokens: tokens,
            blocks: n,
            bytes,
            transfer_ms: k * 1e3,
            transfer_gb_s: bytes as f64 / k / 1e9,
            tcp_ms: t * 1e3,
            tcp_gb_s: bytes as f64 / t / 1e9,
            ratio: t / k,
        });
    }
    if rx.rejections().total() != 0 {
        return Err(format!(
            "frames were rejected: {:?}",
            rx.rejections().snapshot()
        ));
    }
    Ok(rows)
}

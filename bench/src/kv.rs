//! `tandem bench kv-transfer`: KV transfer throughput over loopback against a plain TCP copy of
//! the same bytes, in the same run.
//!
//! For each prompt length, the blocks that prompt fills are sent out of a source pool with the TCP
//! transport (authenticated, checksummed frames) to a receiver that writes them into a
//! destination pool, and the grant is awaited: the time a decode worker would wait for a remote
//! prefill's KV. The baseline is a plain TCP copy of the same bytes: the same frames written from
//! the source pool over a socket and read straight into a destination buffer as large as the
//! transfer. A second, stricter baseline sends one cache-resident frame-sized buffer over and over
//! into another (no memory traffic at either end). Rounds alternate the three so machine noise
//! hits all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_engine::{BlockId, KvDtype, KvPool};
use tandem_kernels::KvLayout;
use tandem_kv_transfer::{BlockFrame, KvReceiver, KvTransport, Secret, TcpTransport};
use tandem_worker::PoolSink;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::percentile;

/// The KV transfer benchmark's figures for one prompt length.
#[derive(Clone, Debug, Serialize)]
pub struct KvBenchRow {
    /// Prompt length whose blocks are sent.
    pub prompt_tokens: usize,
    /// KV blocks that prompt fills.
    pub blocks: usize,
    /// Payload bytes sent: every layer of every block.
    pub bytes: usize,
    /// Median milliseconds for the whole transfer (read out, send, verify, write, grant complete).
    pub transfer_ms: f64,
    /// `bytes` over the median transfer time, in GB/s.
    pub transfer_gb_s: f64,
    /// Median milliseconds to copy the same bytes, memory to memory, over a plain TCP socket.
    pub tcp_ms: f64,
    /// `bytes` over the median plain copy time, in GB/s.
    pub tcp_gb_s: f64,
    /// Plain TCP time / transfer time.
    pub ratio: f64,
    /// Median milliseconds to send as many bytes from one cache-resident frame buffer into
    /// another.
    pub tcp_cached_ms: f64,
    /// Cache-resident TCP time / transfer time.
    pub ratio_cached: f64,
}

/// Frame checksum rates over a buffer larger than the caches, in GB/s.
#[derive(Clone, Debug, Serialize)]
pub struct ChecksumRates {
    /// Bytes per hashed frame.
    pub frame_bytes: usize,
    /// `xxhash-rust` as compiled for a portable x86-64 binary.
    pub crate_gb_s: f64,
    /// The wire format's runtime-dispatched vector loop.
    pub wire_gb_s: f64,
}

/// Hashes 64 MiB frame by frame with the crate and with the wire format's checksum (same values,
/// asserted), best of `rounds` passes each, alternating.
pub fn checksum_rates(frame_bytes: usize, rounds: usize) -> Result<ChecksumRates, String> {
    let frame = frame_bytes.max(1);
    let data: Vec<u8> = (0..(64usize << 20) / frame * frame)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8)
        .collect();
    let pass = |f: &dyn Fn(&[u8]) -> u64| {
        let t0 = Instant::now();
        let sum = data.chunks(frame).fold(0u64, |a, c| a ^ f(c));
        (t0.elapsed().as_secs_f64(), sum)
    };
    let (mut best_crate, mut best_wire) = (f64::MAX, f64::MAX);
    for _ in 0..rounds.max(1) {
        let (tc, sc) = pass(&xxhash_rust::xxh3::xxh3_64);
        let (tw, sw) = pass(&tandem_kv_transfer::wire::checksum);
        if sc != sw {
            return Err("the wire checksum differs from xxh3-64".into());
        }
        best_crate = best_crate.min(tc);
        best_wire = best_wire.min(tw);
    }
    let gb = data.len() as f64 / 1e9;
    Ok(ChecksumRates {
        frame_bytes: frame,
        crate_gb_s: gb / best_crate,
        wire_gb_s: gb / best_wire,
    })
}

async fn one_transfer(
    frames: &[BlockFrame<'_>],
    rx: &KvReceiver,
    sink: Arc<PoolSink>,
    transport: &TcpTransport,
    blocks: &[BlockId],
) -> Result<f64, String> {
    let t0 = Instant::now();
    let mut grant = rx.grant(blocks, sink, Duration::from_secs(60));
    let mut s = transport
        .open(&rx.endpoint(), grant.id())
        .await
        .map_err(|e| e.to_string())?;
    s.send_blocks(grant.id(), frames)
        .await
        .map_err(|e| e.to_string())?;
    s.end(grant.id()).await.map_err(|e| e.to_string())?;
    grant.wait().await.map_err(|e| e.to_string())?;
    Ok(t0.elapsed().as_secs_f64())
}

/// Sends `chunks` in order over a fresh loopback connection to a reader that fills `dst` with
/// them (`cached`: every chunk into the start of `dst`); returns the seconds and `dst`.
async fn one_plain_copy(
    chunks: &[&[u8]],
    mut dst: Vec<u8>,
    cached: bool,
) -> Result<(f64, Vec<u8>), String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let lens: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.map_err(|e| e.to_string())?;
        let mut at = 0;
        for n in lens {
            s.read_exact(&mut dst[at..at + n])
                .await
                .map_err(|e| e.to_string())?;
            if !cached {
                at += n;
            }
        }
        Ok::<_, String>(dst)
    });
    let t0 = Instant::now();
    let mut w = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    w.set_nodelay(true).map_err(|e| e.to_string())?;
    for c in chunks {
        w.write_all(c).await.map_err(|e| e.to_string())?;
    }
    w.flush().await.map_err(|e| e.to_string())?;
    let dst = reader.await.map_err(|e| e.to_string())??;
    Ok((t0.elapsed().as_secs_f64(), dst))
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
    let mut src = KvPool::new(layout, dtype, layers, max_blocks).map_err(|e| e.to_string())?;
    // Non-trivial contents so the checksum does real work on real-looking bytes.
    for l in 0..layers {
        if let tandem_kernels::KvSlabMut::F32(d) = src.layer_mut(l) {
            for (i, x) in d.iter_mut().enumerate() {
                *x = ((i * 31 + l * 7) % 1000) as f32 * 1e-3;
            }
        }
    }
    let dst = KvPool::new(layout, dtype, layers, max_blocks * 2).map_err(|e| e.to_string())?;
    let secret = Secret::random();
    let rx = KvReceiver::bind("127.0.0.1:0", secret.clone())
        .await
        .map_err(|e| e.to_string())?;
    // SAFETY: nothing but this benchmark touches `dst`, and one transfer runs at a time.
    let heads = 0..dst.layout.num_kv_heads as u32;
    let sink = Arc::new(unsafe { PoolSink::new(vec![(heads, dst.writer())]) });
    let transport = TcpTransport::new(secret);
    let frame = KvPool::frame_bytes(layout, dtype);
    // The plain copy's destination, as large as the largest transfer, touched once up front as
    // the pool is.
    let mut copy_dst = vec![1u8; max_blocks * layers * frame];
    let mut rows = Vec::new();
    for &tokens in prompt_tokens {
        let n = tokens.div_ceil(layout.block_size);
        // Destination blocks somewhere else than the source's, as in a real pool.
        let blocks: Vec<BlockId> = (0..n as u32)
            .map(|b| BlockId(b + max_blocks as u32))
            .collect();
        let bytes = n * layers * frame;
        // The frames as a prefill worker's engine chunk holds them: layers of blocks that are
        // not one contiguous range in the pool (int8: values and scales) gathered once.
        let order: Vec<(usize, usize)> = (0..layers)
            .flat_map(|layer| (0..n).map(move |i| (layer, i)))
            .collect();
        let gathered: Vec<Vec<u8>> = order
            .iter()
            .map(|&(layer, i)| {
                let mut buf = Vec::new();
                if src.block_bytes(layer, i).is_none() {
                    src.read_block(layer, i, &mut buf);
                }
                buf
            })
            .collect();
        let frames: Vec<BlockFrame<'_>> = order
            .iter()
            .zip(&gathered)
            .map(|(&(layer, i), g)| BlockFrame {
                layer: layer as u32,
                block: blocks[i],
                heads: 0..0,
                payload: src.block_bytes(layer, i).unwrap_or(g),
            })
            .collect();
        let payloads: Vec<&[u8]> = frames.iter().map(|f| f.payload).collect();
        let cached_chunk = vec![7u8; frame];
        let cached_chunks = vec![&cached_chunk[..]; payloads.len()];
        let (mut kv, mut tcp, mut tcp_cached) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds.max(1) {
            kv.push(one_transfer(&frames, &rx, sink.clone(), &transport, &blocks).await?);
            let (t, d) = one_plain_copy(&payloads, copy_dst, false).await?;
            tcp.push(t);
            let (t, d) = one_plain_copy(&cached_chunks, d, true).await?;
            tcp_cached.push(t);
            copy_dst = d;
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
        let tc = percentile(&mut tcp_cached, 0.5);
        rows.push(KvBenchRow {
            prompt_tokens: tokens,
            blocks: n,
            bytes,
            transfer_ms: k * 1e3,
            transfer_gb_s: bytes as f64 / k / 1e9,
            tcp_ms: t * 1e3,
            tcp_gb_s: bytes as f64 / t / 1e9,
            ratio: t / k,
            tcp_cached_ms: tc * 1e3,
            ratio_cached: tc / k,
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

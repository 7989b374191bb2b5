//! GPU figures for a Llama-3-8B-shaped model with random bf16 weights made on the device (no
//! download): the card's measured copy bandwidth and bf16 GEMM rate, decode step time at several
//! batch sizes against the roofline (weights + KV bytes / measured bandwidth), prefill throughput
//! and its MFU, and paged decode attention's own bandwidth.

use std::time::Instant;

use serde::Serialize;
use tandem_engine::{CudaModel, EngineError, SeqBatch};
use tandem_kernels::cuda::runtime::CudaOps;
use tandem_model::ModelConfig;

/// Llama-3-8B's shape.
pub fn llama3_8b() -> ModelConfig {
    ModelConfig {
        hidden_size: 4096,
        intermediate_size: 14336,
        num_layers: 32,
        num_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        vocab_size: 128_256,
        max_position_embeddings: 8192,
        rms_norm_eps: 1e-5,
        rope_theta: 500_000.0,
        rope_scaling: None,
        tie_word_embeddings: false,
        family: Default::default(),
        sliding_window: None,
        moe: None,
    }
}

/// One decode batch size's step time against its roofline.
#[derive(Clone, Debug, Serialize)]
pub struct DecodePoint {
    /// Sequences decoding one token each.
    pub batch: usize,
    /// Tokens already cached per sequence.
    pub context: usize,
    /// Best milliseconds per decode step (replayed as a CUDA graph where `graph`).
    pub step_ms: f64,
    /// Whether the timed steps replayed a CUDA graph (else a capture failed: the log says why).
    pub graph: bool,
    /// Best milliseconds per decode step with every kernel launched by the host (no graph,
    /// as `--enforce-eager` runs).
    pub eager_ms: f64,
    /// (weights + every sequence's KV) / measured copy bandwidth.
    pub roofline_ms: f64,
    /// roofline_ms / step_ms.
    pub of_roofline: f64,
    /// Tokens generated per second, all sequences together.
    pub tok_s: f64,
    /// Where one step's device time goes, the step queued behind earlier work so that the
    /// device never waits for the host: milliseconds by op (an event around each; the events
    /// cost a little), summed over the layers, in the order the ops first ran. Empty where the
    /// profile failed (said on stderr).
    pub ops_ms: Vec<(String, f64)>,
    /// That step's milliseconds between its ops (the events' own; more where the earlier work
    /// ran out before the host had queued the step).
    pub device_gaps_ms: f64,
    /// That step's device milliseconds, from before its inputs went up to its picks' download.
    pub device_ms: f64,
    /// The same step's milliseconds with the host leading, as the engine runs it: the device
    /// waits for each launch, so the excess over `device_ms` is the host's.
    pub paced_ms: f64,
}

/// One product shape through the pipelined kernels and through the fallback ones.
#[derive(Clone, Debug, Serialize)]
pub struct ProductPoint {
    /// Rows (tokens), output columns, inner dimension.
    pub mnk: (usize, usize, usize),
    /// Best microseconds of the pipelined kernel (the one the engine runs).
    pub us: f64,
    /// Best microseconds of the fallback kernel (k not a multiple of 8), the baseline.
    pub fallback_us: f64,
    /// Weight, input and output bytes over the pipelined time, GB/s.
    pub gb_s: f64,
    /// FLOPs (2·m·n·k) over the pipelined time, TFLOP/s.
    pub tflops: f64,
}

/// Every figure of the GPU benchmark for one device.
#[derive(Clone, Debug, Serialize)]
pub struct GpuReport {
    /// The GPU's name.
    pub device: String,
    /// Device-to-device copy, bytes read plus written per second.
    pub copy_gb_s: f64,
    /// 8192³ bf16 product (f32 accumulation) through the engine's product kernel.
    pub gemm_tflops: f64,
    /// The card's dense bf16 peak (SMs × top clock × the architecture's rate), where known.
    pub peak_tflops: Option<f64>,
    /// `gemm_tflops` over `peak_tflops`.
    pub gemm_of_peak: Option<f64>,
    /// Llama-3-8B's products at decode and prefill row counts, against the fallback kernel.
    pub products: Vec<ProductPoint>,
    /// One point per requested decode batch size, in the order given.
    pub decode: Vec<DecodePoint>,
    /// Tokens in the one prompt the prefill figure is measured on.
    pub prefill_tokens: usize,
    /// Prompt tokens prefilled per second.
    pub prefill_tok_s: f64,
    /// Projection FLOPs (2 per weight per token) per second over the card's peak (MFU); over
    /// the measured GEMM rate where the peak is unknown.
    pub prefill_mfu: f64,
    /// The same FLOPs over the measured GEMM rate: how near prefill comes to its own product.
    pub prefill_of_gemm: f64,
    /// Where the prefill step's device time goes: milliseconds by op (an event around each),
    /// summed over the layers, in the order the ops first ran. Empty where the profile failed
    /// (said on stderr).
    pub prefill_ops_ms: Vec<(String, f64)>,
    /// Paged decode attention alone: K and V bytes read per second.
    pub attention_gb_s: f64,
    /// `attention_gb_s` / `copy_gb_s` (the copy counts reads and writes; attention only reads).
    pub attention_of_copy: f64,
}

/// Best wall time of `reps` runs of `f` after `warm` unmeasured ones; `f` ends with the device
/// idle (it synchronizes, or downloads a result).
fn time<F: FnMut() -> Result<(), EngineError>>(
    warm: usize,
    reps: usize,
    mut f: F,
) -> Result<f64, EngineError> {
    for _ in 0..warm {
        f()?;
    }
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn synced(
    ops: &CudaOps,
    r: Result<(), tandem_kernels::cuda::CudaError>,
) -> Result<(), EngineError> {
    r?;
    Ok(ops.synchronize()?)
}

/// Runs every measurement on device `ordinal`. `batches` are the decode batch sizes (1k-token
/// contexts each).
pub fn run(ordinal: usize, batches: &[usize]) -> Result<GpuReport, EngineError> {
    let c = llama3_8b();
    let context: usize = 1024;
    let block: usize = 16;
    let max_batch = batches.iter().copied().max().unwrap_or(1);
    let prefill_tokens: usize = 2048;
    // Blocks: every decode sequence's context (+1 for the new token), and the prefill prompt.
    let per_seq = (context + 1).div_ceil(block);
    let num_blocks = max_batch * per_seq + prefill_tokens.div_ceil(block);
    let mut g = CudaModel::random(ordinal, &c, 7, block, num_blocks)?;
    g.randomize_cache(11)?;
    let device = g.ops.gpu.to_string();

    // Copy bandwidth: 1 GiB each way.
    let n = 1usize << 29;
    let src = g.ops.alloc_bf16(n)?;
    let mut dst = g.ops.alloc_bf16(n)?;
    let secs = time(2, 10, || synced(&g.ops, g.ops.copy(&src, &mut dst)))?;
    let copy_gb_s = 2.0 * (2 * n) as f64 / secs / 1e9;
    drop((src, dst));

    // bf16 GEMM rate on random data.
    let m = 8192;
    let mut a = g.ops.alloc_bf16(m * m)?;
    let mut b = g.ops.alloc_bf16(m * m)?;
    let mut out = g.ops.alloc_bf16(m * m)?;
    g.ops.fill_random(&mut a, 1, 1.0)?;
    g.ops.fill_random(&mut b, 2, 1.0)?;
    let secs = time(2, 10, || {
        synced(&g.ops, g.ops.gemm(&a, &b, &mut out, (m, m, m)))
    })?;
    let gemm_tflops = 2.0 * (m as f64).powi(3) / secs / 1e12;
    drop((a, b, out));

    // The model's products (fused q|k|v, o, fused gate|up, down) at decode and prefill row
    // counts, each against the fallback kernel on the same buffers.
    let (h, ff) = (c.hidden_size, c.intermediate_size);
    let qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim;
    let mut products = Vec::new();
    for (rows, n, k) in [
        (1, qkv, h),
        (1, h, h),
        (1, 2 * ff, h),
        (1, h, ff),
        (16, 2 * ff, h),
        (64, 2 * ff, h),
        (256, 2 * ff, h),
        (2048, 2 * ff, h),
        // Products in k-segments (gemm_segment) at each tiling's row counts.
        (16, h, h),
        (64, h, h),
        (256, h, h),
        (2048, h, h),
        (2048, h, ff),
    ] {
        let mut x = g.ops.alloc_bf16(rows * k)?;
        let mut w = g.ops.alloc_bf16(n * k)?;
        let mut out = g.ops.alloc_bf16(rows * n)?;
        g.ops.fill_random(&mut x, 8, 1.0)?;
        g.ops.fill_random(&mut w, 9, 0.02)?;
        let mnk = (rows, n, k);
        let us = 1e6 * time(3, 20, || synced(&g.ops, g.ops.gemm(&x, &w, &mut out, mnk)))?;
        let fallback_us = 1e6
            * time(3, 20, || {
                synced(&g.ops, g.ops.gemm_fallback(&x, &w, &mut out, mnk))
            })?;
        let bytes = 2.0 * (rows * k + n * k + rows * n) as f64;
        products.push(ProductPoint {
            mnk,
            us,
            fallback_us,
            gb_s: bytes / us / 1e3,
            tflops: 2.0 * (rows * n * k) as f64 / us / 1e6,
        });
    }

    // Decode steps: every sequence has `context` tokens cached (random KV) and decodes one more.
    let tables: Vec<Vec<u32>> = (0..max_batch)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let tokens: Vec<[u32; 1]> = (0..max_batch)
        .map(|s| [(s * 7919 % c.vocab_size) as u32])
        .collect();
    // Work to queue ahead of a profiled step: copies of 256 MiB, about twice the step's time.
    let lead_n = 1usize << 27;
    let lead_src = g.ops.alloc_bf16(lead_n)?;
    let mut lead_dst = g.ops.alloc_bf16(lead_n)?;
    let lead_copy_ms = 2.0 * (2 * lead_n) as f64 / (copy_gb_s * 1e9) * 1e3;
    let mut decode = Vec::new();
    for &bsz in batches {
        let batch: Vec<SeqBatch> = (0..bsz)
            .map(|s| SeqBatch {
                tokens: &tokens[s],
                cached: context,
                block_table: &tables[s],
                logits: 1,
                lora: None,
            })
            .collect();
        // The step downloads its token ids, so it ends with the device idle. Its graph is
        // captured in the first warm-up round.
        let replays = g.graph_replays();
        let secs = time(2, 10, || g.forward_greedy(&batch).map(|_| ()))?;
        let graph = g.graph_replays() > replays;
        g.set_graphs(false);
        let eager = time(2, 10, || g.forward_greedy(&batch).map(|_| ()));
        g.set_graphs(true);
        let eager_secs = eager?;
        let bytes = g.weight_bytes() as f64 + (bsz * (context + 1) * g.kv_bytes_per_token()) as f64;
        let roofline_ms = bytes / (copy_gb_s * 1e9) * 1e3;
        // Untimed figures first: a profile that fails (its events) costs only its own line.
        let reps = ((2.0 * secs * 1e3 + 5.0) / lead_copy_ms).ceil() as usize;
        let mut lead = |o: &CudaOps| -> Result<(), EngineError> {
            for _ in 0..reps {
                o.copy(&lead_src, &mut lead_dst)?;
            }
            Ok(())
        };
        let device = g.profile_greedy(&batch, Some(&mut lead));
        let paced = g.profile_greedy(&batch, None);
        let (device, paced) = match (device, paced) {
            (Ok(d), Ok(p)) => (d, p),
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("decode batch {bsz}: no profile of a step: {e}");
                Default::default()
            }
        };
        decode.push(DecodePoint {
            batch: bsz,
            context,
            step_ms: secs * 1e3,
            graph,
            eager_ms: eager_secs * 1e3,
            roofline_ms,
            of_roofline: roofline_ms / (secs * 1e3),
            tok_s: bsz as f64 / secs,
            ops_ms: device
                .ops
                .iter()
                .map(|&(n, ms)| (n.to_string(), ms))
                .collect(),
            device_gaps_ms: device.gaps_ms,
            device_ms: device.span_ms,
            paced_ms: paced.span_ms,
        });
    }

    // Prefill: one 2k-token prompt in one step, into its own blocks.
    let base = (max_batch * per_seq) as u32;
    let ptable: Vec<u32> = (base..base + prefill_tokens.div_ceil(block) as u32).collect();
    let prompt: Vec<u32> = (0..prefill_tokens)
        .map(|i| (i * 31 % c.vocab_size) as u32)
        .collect();
    let pbatch = [SeqBatch {
        tokens: &prompt,
        cached: 0,
        block_table: &ptable,
        logits: 1,
        lora: None,
    }];
    let secs = time(1, 5, || g.forward_greedy(&pbatch).map(|_| ()))?;
    let prefill_tok_s = prefill_tokens as f64 / secs;
    let flops = 2.0 * (g.weight_bytes() / 2) as f64 * prefill_tokens as f64;
    let prefill_of_gemm = flops / secs / (gemm_tflops * 1e12);
    let peak_tflops = g.ops.gpu.peak_bf16_tflops();
    let prefill_mfu = flops / secs / (peak_tflops.unwrap_or(gemm_tflops) * 1e12);
    // A step this long leaves the host's queueing far behind: no work needs to lead it.
    let prefill_ops_ms = match g.profile_greedy(&pbatch, None) {
        Ok(p) => p.ops.iter().map(|&(n, ms)| (n.to_string(), ms)).collect(),
        Err(e) => {
            eprintln!("prefill: no profile of the step: {e}");
            Vec::new()
        }
    };

    // Decode attention alone, one layer's worth over the largest batch.
    let (nq, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let o = &g.ops;
    let per_layer = num_blocks * nkv * block * hd;
    let mut kc = o.alloc_bf16(per_layer)?;
    let mut vc = o.alloc_bf16(per_layer)?;
    o.fill_random(&mut kc, 3, 1.0)?;
    o.fill_random(&mut vc, 4, 1.0)?;
    let mut q = o.alloc_bf16(max_batch * nq * hd)?;
    o.fill_random(&mut q, 5, 1.0)?;
    let mut att = o.alloc_bf16(max_batch * nq * hd)?;
    let trefs: Vec<&[u32]> = tables.iter().map(|t| t.as_slice()).collect();
    let mut ab = o.attn_batch(
        &trefs,
        &vec![1; max_batch],
        &vec![context + 1; max_batch],
        (nq, hd),
    )?;
    let secs = time(2, 20, || {
        synced(
            o,
            o.attention(
                &mut ab,
                &q,
                nq * hd,
                &kc,
                &vc,
                &mut att,
                (nq, nkv, hd),
                block,
            ),
        )
    })?;
    let attn_bytes = (max_batch * (context + 1) * nkv * hd * 2 * 2) as f64;
    let attention_gb_s = attn_bytes / secs / 1e9;
    Ok(GpuReport {
        device,
        copy_gb_s,
        gemm_tflops,
        peak_tflops,
        gemm_of_peak: peak_tflops.map(|p| gemm_tflops / p),
        products,
        decode,
        prefill_tokens,
        prefill_tok_s,
        prefill_mfu,
        prefill_of_gemm,
        prefill_ops_ms,
        attention_gb_s,
        // The copy figure counts reads and writes; attention only reads.
        attention_of_copy: attention_gb_s / copy_gb_s,
    })
}

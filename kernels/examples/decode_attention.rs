//! The attention of one batched decode step of a SmolLM2-135M-shaped model (30 layers, 9 query
//! heads over 3 KV heads of 64, blocks of 16 slots, an f32 cache): `SEQS` sequences (32 by
//! default) of `CONTEXT` tokens (64), each layer's cache its own slab and each sequence's blocks
//! scattered over it, as a pool hands them out to sequences growing side by side. Prints the
//! step's attention time, the rate it reads the cache at, and this machine's read rate beside it
//! (measured here). With `QLEN` new tokens per sequence (a prefill: `SEQS=1 CONTEXT=512
//! QLEN=512`) it prints the flop rate instead, and its share of the FMA peak measured beside it.
//! `COLD=1` reads 28 MiB of other memory before each layer's call (untimed), so the cache comes
//! from memory as in a served step. `LAYERS` (30) layers of cache: with `LAYERS=1` a layer's
//! cache stays in the CPU's caches from call to call, a measure of the kernel alone that the
//! machine's memory does not move.
//! `TANDEM_ISA` picks the level:
//! `cargo run --release -p tandem-kernels --example decode_attention`.

use rayon::prelude::*;
use std::time::{Duration, Instant};

mod common;

use common::{env_count, fma_peak, median_timed};
use tandem_kernels::{paged_attention, AttnSpec, KvLayout, KvSlab, SeqAttn};

fn main() {
    // Inside the pool, as the engine's forward runs.
    rayon::ThreadPoolBuilder::new()
        .build()
        .unwrap()
        .install(run);
}

fn run() {
    let (seqs, context, steps) = (
        env_count("SEQS", 32),
        env_count("CONTEXT", 64),
        env_count("STEPS", 20),
    );
    // New tokens per sequence: 1 for a decode step, the context for a prefill.
    let q_len = env_count("QLEN", 1).clamp(1, context);
    let (layers, heads) = (env_count("LAYERS", 30).max(1), 9);
    let layout = KvLayout {
        block_size: 16,
        num_kv_heads: 3,
        head_dim: 64,
    };
    let per_seq = context.div_ceil(layout.block_size);
    let blocks = seqs * per_seq;
    // Block i of sequence s: sequences growing together take turns at the free list.
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| (0..per_seq).map(|i| (i * seqs + s) as u32).collect())
        .collect();
    // One map for every layer, on huge pages where the system gives them, as the engine's pool.
    let slab = blocks * layout.block_floats();
    let mut map = memmap2::MmapMut::map_anon(layers * slab * 4).unwrap();
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    // SAFETY: any bytes are valid f32s; the map is page-aligned.
    let (_, cache, _) = unsafe { map.align_to_mut::<f32>() };
    for (i, v) in cache.iter_mut().enumerate() {
        *v = (i % 101) as f32 / 101.0 - 0.5;
    }
    let slabs: Vec<&[f32]> = cache.chunks_exact(slab).collect();
    let width = heads * layout.head_dim;
    let q: Vec<f32> = (0..seqs * q_len * width)
        .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
        .collect();
    let batch: Vec<SeqAttn<'_>> = tables
        .iter()
        .enumerate()
        .map(|(s, t)| SeqAttn {
            q_start: s * q_len,
            q_len,
            context_len: context,
            block_table: t,
        })
        .collect();
    let spec = AttnSpec {
        n_heads: heads,
        scale: 0.125,
        window: None,
    };
    let mut out = vec![0f32; seqs * q_len * width];
    // `COLD=1`: before each layer's call, read 28 MiB (untimed, on every thread), so the cache
    // comes from memory as in a served step, where 100 MB of weights pass between one step's
    // use of a layer's cache and the next's. Reading just a layer's weights (3.5 MB) left part
    // of the cache in L3 on a Zen 4 (32 MiB): one row over 364 tokens 0.54-1.03 ms, where 28
    // MiB gives 0.99-1.27 ms and the engine's profile 0.98 (`bench engine --profile`).
    let cold = env_count("COLD", 0) > 0;
    let weights: Vec<u64> = match cold {
        true => (0..(7u64 << 19)).collect(),
        false => Vec::new(),
    };
    let sum = |b: &[u64]| b.iter().fold(0u64, |a, &x| a.wrapping_add(x));
    let med = median_timed(steps, || {
        let mut spent = Duration::ZERO;
        for &slab in &slabs {
            if cold {
                // Read by every thread, as the products do (a thread left idle would sleep).
                std::hint::black_box(weights.par_chunks(1 << 14).map(sum).sum::<u64>());
            }
            let t = Instant::now();
            paged_attention(&q, spec, KvSlab::F32(slab), layout, &batch, &mut out).unwrap();
            spent += t.elapsed();
        }
        spent
    });
    let bytes = (layers * seqs * context * 2 * layout.num_kv_heads * layout.head_dim * 4) as f64;
    // The rate every thread at once reads a buffer larger than any cache.
    let threads = rayon::current_num_threads();
    let words = 8 << 20;
    let rates = rayon::broadcast(|_| {
        let buf: Vec<u64> = (0..words as u64).collect();
        let sum = |b: &[u64]| b.iter().fold(0u64, |a, &x| a.wrapping_add(x));
        std::hint::black_box(sum(&buf));
        let t = Instant::now();
        for _ in 0..4 {
            std::hint::black_box(sum(std::hint::black_box(&buf)));
        }
        (4 * words * 8) as f64 / t.elapsed().as_secs_f64()
    });
    let read: f64 = rates.iter().sum::<f64>() / 1e9;
    // The output's bits (FNV-1a of the last layer's): a kernel change meant to keep them can be
    // checked against the binary before it.
    let bits = out.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ u64::from(x.to_bits())).wrapping_mul(0x100_0000_01b3)
    });
    if q_len > 1 {
        // Scores and weighted values: 4 flops per query head, key seen and dimension.
        let seen: usize = (context - q_len + 1..=context).sum();
        let flops = (4 * layers * seqs * heads * seen * layout.head_dim) as f64;
        let peak = fma_peak();
        println!(
            "{seqs} sequences, {q_len} new of {context} tokens, {layers} layers, {threads} threads: attention {:.2} ms (median of {steps}), {:.1} GFLOP/s = {:.0}% of the FMA peak ({peak:.1} GFLOP/s), output bits {bits:016x}",
            med * 1e3,
            flops / med / 1e9,
            100.0 * flops / med / 1e9 / peak
        );
        return;
    }
    println!(
        "{seqs} sequences of {context} tokens, {layers} layers, {threads} threads: attention of a step {:.2} ms (median of {steps}), cache read at {:.1} GB/s, {:.0}% of the read rate ({read:.1} GB/s), output bits {bits:016x}",
        med * 1e3,
        bytes / med / 1e9,
        100.0 * bytes / med / 1e9 / read
    );
}

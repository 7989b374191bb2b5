//! Every CUDA kernel against a CPU reference, on fresh random inputs, with outputs poisoned (NaN)
//! before each launch so an element the kernel never writes fails. bf16 storage: relative L2 error
//! under 1e-2. Without a GPU each test says so on stderr and returns; `scripts/gpu-check` sets
//! TANDEM_REQUIRE_GPU=1, which turns a missing GPU into a failure.

use half::bf16;
use rand::{Rng, SeedableRng};
use tandem_kernels::cuda::runtime::CudaOps;
use tandem_kernels::cuda::{driver_present, gemm_segment, DECODE_SPLIT_LEN};

const NAN16: u16 = 0x7fc1;

/// Says, past the test harness's capture, that a test did not run.
fn report_no_gpu(test: &str, why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "NO GPU: {test} not run ({why})");
}

fn ops(test: &str) -> Option<CudaOps> {
    let required = std::env::var_os("TANDEM_REQUIRE_GPU").is_some();
    if !driver_present() {
        assert!(
            !required,
            "{test}: TANDEM_REQUIRE_GPU is set but there is no CUDA driver"
        );
        report_no_gpu(test, "no CUDA driver on this machine");
        return None;
    }
    match CudaOps::new(0) {
        Ok(o) => Some(o),
        Err(e) => {
            assert!(!required, "{test}: {e}");
            report_no_gpu(test, &e.to_string());
            None
        }
    }
}

fn rng(seed: u64) -> rand_chacha::ChaCha8Rng {
    rand_chacha::ChaCha8Rng::seed_from_u64(seed)
}

/// Random values as bf16 bits, and the f32 values those bits hold.
fn rand_bf16(r: &mut impl Rng, n: usize, scale: f32) -> (Vec<u16>, Vec<f32>) {
    let bits: Vec<u16> = (0..n)
        .map(|_| bf16::from_f32(r.gen_range(-scale..scale)).to_bits())
        .collect();
    let vals = bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
    (bits, vals)
}

fn to_f32(bits: &[u16]) -> Vec<f32> {
    bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect()
}

/// ‖got − want‖ / ‖want‖; NaN anywhere fails.
fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (mut num, mut den) = (0f64, 0f64);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.is_finite(),
            "{what}: element {i} is {g} (unwritten or overflow), want {w}"
        );
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    let rel = (num / den.max(1e-30)).sqrt();
    assert!(rel < 1e-2, "{what}: relative L2 error {rel:.2e}");
    eprintln!("{what}: relative L2 error {rel:.2e}");
}

#[test]
fn norms_match_the_cpu() {
    let Some(o) = ops("norms_match_the_cpu") else {
        return;
    };
    let mut r = rng(1);
    let (rows, d, eps) = (37, 4096, 1e-5f32);
    let (x, xf) = rand_bf16(&mut r, rows * d, 2.0);
    let (dl, dlf) = rand_bf16(&mut r, rows * d, 1.0);
    let (w, wf) = rand_bf16(&mut r, d, 1.5);
    let (xd, dd, wd) = (
        o.upload(&x).unwrap(),
        o.upload(&dl).unwrap(),
        o.upload(&w).unwrap(),
    );
    let mut out = o.upload(&vec![NAN16; rows * d]).unwrap();
    o.rms_norm(&xd, &wd, &mut out, rows, eps).unwrap();
    let mut want = vec![0f32; rows * d];
    tandem_kernels::ops::rms_norm(&xf, &wf, eps, &mut want);
    assert_close("rms_norm", &to_f32(&o.download(&out).unwrap()), &want);

    let mut res = o.upload(&x).unwrap();
    let mut out = o.upload(&vec![NAN16; rows * d]).unwrap();
    o.add_rms_norm(&mut res, &dd, &wd, &mut out, rows, eps)
        .unwrap();
    let sum: Vec<f32> = xf.iter().zip(&dlf).map(|(a, b)| a + b).collect();
    tandem_kernels::ops::rms_norm(&sum, &wf, eps, &mut want);
    assert_close(
        "add_rms_norm residual",
        &to_f32(&o.download(&res).unwrap()),
        &sum,
    );
    assert_close("add_rms_norm", &to_f32(&o.download(&out).unwrap()), &want);
}

#[test]
fn rotary_silu_and_embedding_match_the_cpu() {
    let Some(o) = ops("rotary_silu_and_embedding_match_the_cpu") else {
        return;
    };
    let mut r = rng(2);
    let (t, nq, nkv, hd, max_pos) = (29, 32, 8, 128, 4096);
    let w = (nq + 2 * nkv) * hd;
    let (qkv, qkvf) = rand_bf16(&mut r, t * w, 1.0);
    let positions: Vec<usize> = (0..t).map(|_| r.gen_range(0..max_pos)).collect();
    let inv: Vec<f32> = (0..hd / 2)
        .map(|i| 500000f32.powf(-((2 * i) as f32) / hd as f32))
        .collect();
    let table = tandem_kernels::ops::RopeTable::new(&inv, 1.0, max_pos);
    let (cos, sin) = table_parts(&inv, max_pos);
    let mut qd = o.upload(&qkv).unwrap();
    let pos_d = o
        .upload(&positions.iter().map(|&p| p as i32).collect::<Vec<_>>())
        .unwrap();
    let (cd, sd) = (o.upload(&cos).unwrap(), o.upload(&sin).unwrap());
    o.qkv_rope(&mut qd, &pos_d, &cd, &sd, t, (nq, nkv, hd))
        .unwrap();
    let got = to_f32(&o.download(&qd).unwrap());
    // CPU: rotate q and k, leave v.
    let (mut q, mut k) = (Vec::new(), Vec::new());
    for row in qkvf.chunks_exact(w) {
        q.extend_from_slice(&row[..nq * hd]);
        k.extend_from_slice(&row[nq * hd..(nq + nkv) * hd]);
    }
    tandem_kernels::ops::rope(&mut q, &positions, nq, &table);
    tandem_kernels::ops::rope(&mut k, &positions, nkv, &table);
    let mut want = qkvf.clone();
    for (i, row) in want.chunks_exact_mut(w).enumerate() {
        row[..nq * hd].copy_from_slice(&q[i * nq * hd..(i + 1) * nq * hd]);
        row[nq * hd..(nq + nkv) * hd].copy_from_slice(&k[i * nkv * hd..(i + 1) * nkv * hd]);
    }
    assert_close("qkv_rope", &got, &want);

    let ff = 14336;
    let (gu, guf) = rand_bf16(&mut r, t * 2 * ff, 4.0);
    let gud = o.upload(&gu).unwrap();
    let mut out = o.upload(&vec![NAN16; t * ff]).unwrap();
    o.silu_mul(&gud, &mut out, t, ff).unwrap();
    let mut want = Vec::with_capacity(t * ff);
    for row in guf.chunks_exact(2 * ff) {
        let (mut g, u) = (row[..ff].to_vec(), &row[ff..]);
        tandem_kernels::ops::silu_mul(&mut g, u);
        want.extend(g);
    }
    assert_close("silu_mul", &to_f32(&o.download(&out).unwrap()), &want);

    let (vocab, d) = (1000, 512);
    let (tab, tabf) = rand_bf16(&mut r, vocab * d, 1.0);
    let ids: Vec<i32> = (0..t).map(|_| r.gen_range(0..vocab as i32)).collect();
    let (td, idd) = (o.upload(&tab).unwrap(), o.upload(&ids).unwrap());
    let mut out = o.upload(&vec![NAN16; t * d]).unwrap();
    o.embedding(&idd, &td, &mut out, d).unwrap();
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| tabf[i as usize * d..(i as usize + 1) * d].to_vec())
        .collect();
    assert_eq!(
        to_f32(&o.download(&out).unwrap()),
        want,
        "embedding is a copy"
    );
    // A tensor-parallel rank's lookup: another rank's token (-1) gives a row of zeros.
    let some: Vec<i32> = ids
        .iter()
        .map(|&i| if i % 3 == 0 { -1 } else { i })
        .collect();
    let mut out = o.upload(&vec![NAN16; t * d]).unwrap();
    o.embedding(&o.upload(&some).unwrap(), &td, &mut out, d)
        .unwrap();
    let want: Vec<f32> = some
        .iter()
        .flat_map(|&i| match i {
            -1 => vec![0.0; d],
            i => tabf[i as usize * d..(i as usize + 1) * d].to_vec(),
        })
        .collect();
    assert_eq!(
        to_f32(&o.download(&out).unwrap()),
        want,
        "zeros off the slice"
    );
}

/// Rows copied between strided buffers: a tensor-parallel rank's logits padded for the gather,
/// and the gathered slices laid out row after row.
#[test]
fn strided_rows_copy_exactly() {
    let Some(o) = ops("strided_rows_copy_exactly") else {
        return;
    };
    let (rows, src_ld, dst_ld, cols) = (5, 7, 11, 6);
    let src: Vec<f32> = (0..(2 + rows * src_ld)).map(|i| i as f32 * 0.5).collect();
    let mut dst = o.upload(&vec![f32::NAN; 3 + rows * dst_ld]).unwrap();
    o.copy_cols(
        (&o.upload(&src).unwrap(), 2, src_ld),
        (&mut dst, 3, dst_ld),
        rows,
        cols,
    )
    .unwrap();
    let got = o.download(&dst).unwrap();
    for (i, v) in got.iter().enumerate() {
        let (r, c) = ((i.max(3) - 3) / dst_ld, (i.max(3) - 3) % dst_ld);
        match i >= 3 && c < cols && r < rows {
            true => assert_eq!(*v, src[2 + r * src_ld + c], "at {i}"),
            false => assert!(v.is_nan(), "{i} was written"),
        }
    }
    // A copy past either buffer's end is refused on the host.
    let e = o
        .copy_cols(
            (&o.upload(&src).unwrap(), 4, src_ld),
            (&mut dst, 3, dst_ld),
            rows,
            cols,
        )
        .unwrap_err();
    assert!(e.to_string().contains("bad launch"), "{e}");
}

/// HF's cos/sin tables as the engine builds them (f32 angles, f64 trig).
fn table_parts(inv: &[f32], max_pos: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for p in 0..max_pos {
        for &f in inv {
            let a = (p as f32 * f) as f64;
            c.push(a.cos() as f32);
            s.push(a.sin() as f32);
        }
    }
    (c, s)
}

#[test]
fn products_match_the_cpu() {
    // The segments the shapes below are chosen for.
    for ((n, k), segs) in [
        ((4096usize, 4096usize), 4),
        ((1536, 4096), 4),
        ((512, 2048), 2),
        ((256, 2056), 2),
        ((512, 4096), 4),
        ((1000, 584), 1),
    ] {
        assert_eq!(k.div_ceil(gemm_segment(n, k)), segs, "{n}×{k}");
    }
    let Some(o) = ops("products_match_the_cpu") else {
        return;
    };
    let mut r = rng(3);
    // Each tiling: up to 64 rows (1, 7, 64), up to 128 (100), above (300); k
    // with a partial last tile (584, 200), and k not a multiple of 8 (570: the fallback); k in
    // segments (gemm_segment) through each tiling: 4 of 1024 (1×4096×4096, 300×1536×4096), 2 of
    // 1024 (100×512×2048), 2 of 1152 the second with a partial last tile (33×256×2056).
    for (m, n, k) in [
        (1, 4096, 4096),
        (100, 512, 2048),
        (33, 256, 2056),
        (7, 1000, 576),
        (64, 520, 200),
        (100, 1000, 584),
        (300, 1536, 4096),
        (20, 300, 570),
        (70, 130, 570),
    ] {
        let (x, xf) = rand_bf16(&mut r, m * k, 1.0);
        let (w, wf) = rand_bf16(&mut r, n * k, 0.05);
        let (xd, wd) = (o.upload(&x).unwrap(), o.upload(&w).unwrap());
        let mut want = vec![0f32; m * n];
        // Σ|x·w| per output: the scale an f32 sum's rounding is measured against.
        let mut mag = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let terms = (0..k).map(|t| xf[i * k + t] as f64 * wf[j * k + t] as f64);
                want[i * n + j] = terms.clone().sum::<f64>() as f32;
                mag[i * n + j] = terms.map(f64::abs).sum();
            }
        }
        let mut out = o.upload(&vec![NAN16; m * n]).unwrap();
        o.gemm(&xd, &wd, &mut out, (m, n, k)).unwrap();
        assert_close(
            &format!("gemm {m}×{n}×{k}"),
            &to_f32(&o.download(&out).unwrap()),
            &want,
        );
        let mut out = o.upload(&vec![f32::NAN; m * n]).unwrap();
        o.gemm(&xd, &wd, &mut out, (m, n, k)).unwrap();
        let got = o.download(&out).unwrap();
        assert_close(&format!("gemm f32 out {m}×{n}×{k}"), &got, &want);
        // Every output, not only the whole: f32 accumulation of exact bf16 products is off by
        // far less than 1e-4 of Σ|x·w|; a wrong tile, row or k step is off by about all of it.
        for (e, ((g, w), s)) in got.iter().zip(&want).zip(&mag).enumerate() {
            assert!(
                ((g - w) as f64).abs() <= 1e-4 * s + 1e-12,
                "gemm f32 out {m}×{n}×{k}: output ({}, {}) is {g}, want {w} (Σ|x·w| {s})",
                e / n,
                e % n
            );
        }
    }
}

/// A paged cache filled through `write_kv` with random K/V, and the same values on the host.
struct Cache {
    k: cudarc::driver::CudaSlice<u16>,
    v: cudarc::driver::CudaSlice<u16>,
    /// Per sequence, per position: (k row, v row) of nkv·hd.
    host: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
    tables: Vec<Vec<u32>>,
}

const BS: usize = 16;

fn fill_cache(
    o: &CudaOps,
    r: &mut impl Rng,
    ctx: &[usize],
    (nq, nkv, hd): (usize, usize, usize),
) -> Cache {
    let blocks: usize = ctx.iter().map(|c| c.div_ceil(BS)).sum::<usize>() + 3;
    // Blocks handed out in a shuffled order, as a pool's free list would after a while.
    let mut ids: Vec<u32> = (0..blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, r.gen_range(0..=i));
    }
    let mut next = ids.into_iter();
    let mut k = o.upload(&vec![NAN16; blocks * nkv * BS * hd]).unwrap();
    let mut v = o.upload(&vec![NAN16; blocks * nkv * BS * hd]).unwrap();
    let w = (nq + 2 * nkv) * hd;
    let mut host = Vec::new();
    let mut tables = Vec::new();
    for &c in ctx {
        let table: Vec<u32> = (0..c.div_ceil(BS)).map(|_| next.next().unwrap()).collect();
        let (qkv, qkvf) = rand_bf16(r, c * w, 1.0);
        let slots: Vec<i64> = (0..c)
            .map(|p| table[p / BS] as i64 * BS as i64 + (p % BS) as i64)
            .collect();
        let (qd, sd) = (o.upload(&qkv).unwrap(), o.upload(&slots).unwrap());
        o.write_kv(&qd, &sd, &mut k, &mut v, (nq, nkv, hd), BS)
            .unwrap();
        host.push(
            qkvf.chunks_exact(w)
                .map(|row| {
                    (
                        row[nq * hd..(nq + nkv) * hd].to_vec(),
                        row[(nq + nkv) * hd..].to_vec(),
                    )
                })
                .collect(),
        );
        tables.push(table);
    }
    Cache { k, v, host, tables }
}

/// Causal attention of new tokens (the last `q_len[s]` positions of each sequence) on the host.
fn reference(
    cache: &Cache,
    q: &[f32],
    q_len: &[usize],
    ctx: &[usize],
    (nq, nkv, hd): (usize, usize, usize),
) -> Vec<f32> {
    let mut out = Vec::new();
    let mut row = 0;
    for (s, (&n, &c)) in q_len.iter().zip(ctx).enumerate() {
        for i in 0..n {
            let pos = c - n + i;
            for h in 0..nq {
                let kvh = h / (nq / nkv);
                let qv = &q[(row + i) * nq * hd + h * hd..][..hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let kr = &cache.host[s][j].0[kvh * hd..][..hd];
                        qv.iter().zip(kr).map(|(a, b)| (a * b) as f64).sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    let acc: f64 = (0..=pos)
                        .map(|j| e[j] * cache.host[s][j].1[kvh * hd + d] as f64)
                        .sum();
                    out.push((acc / sum) as f32);
                }
            }
        }
        row += n;
    }
    out
}

fn run_attention(
    o: &CudaOps,
    seed: u64,
    q_len: &[usize],
    ctx: &[usize],
    dims: (usize, usize, usize),
) {
    let mut r = rng(seed);
    let (nq, _, hd) = dims;
    let cache = fill_cache(o, &mut r, ctx, dims);
    let t: usize = q_len.iter().sum();
    let (q, qf) = rand_bf16(&mut r, t * nq * hd, 1.0);
    let tables: Vec<&[u32]> = cache.tables.iter().map(|t| t.as_slice()).collect();
    let mut batch = o.attn_batch(&tables, q_len, ctx, (nq, hd)).unwrap();
    let qd = o.upload(&q).unwrap();
    let mut out = o.upload(&vec![NAN16; t * nq * hd]).unwrap();
    o.attention(
        &mut batch,
        &qd,
        nq * hd,
        &cache.k,
        &cache.v,
        &mut out,
        dims,
        BS,
    )
    .unwrap();
    let want = reference(&cache, &qf, q_len, ctx, dims);
    let what = format!("attention q_len {q_len:?} ctx {ctx:?} dims {dims:?}");
    assert_close(&what, &to_f32(&o.download(&out).unwrap()), &want);
}

#[test]
fn decode_attention_matches_the_cpu_across_splits() {
    let Some(o) = ops("decode_attention_matches_the_cpu_across_splits") else {
        return;
    };
    // Contexts within one split, at its edge, and over several (flash-decoding combine).
    let ctx = [
        1,
        37,
        DECODE_SPLIT_LEN,
        DECODE_SPLIT_LEN + 1,
        3 * DECODE_SPLIT_LEN + 100,
    ];
    run_attention(&o, 4, &[1; 5], &ctx, (32, 8, 128));
    run_attention(&o, 5, &[1; 5], &ctx, (9, 3, 64));
}

#[test]
fn prefill_attention_matches_the_cpu_over_a_cached_prefix() {
    let Some(o) = ops("prefill_attention_matches_the_cpu_over_a_cached_prefix") else {
        return;
    };
    // New tokens from 1 to several tiles, over no prefix or a long one; mixed with decodes.
    let q_len = [40, 1, 16, 17, 3];
    let ctx = [40, 700, 16 + 130, 17, 3 + 1];
    run_attention(&o, 6, &q_len, &ctx, (32, 8, 128));
    run_attention(&o, 7, &q_len, &ctx, (9, 3, 64));
    // Chunks whose tiles straddle the fixed split cuts (multiples of DECODE_SPLIT_LEN): rows of
    // one, two and three splits in one tile, merged by the combine.
    let q_len = [300, 40];
    let ctx = [2 * DECODE_SPLIT_LEN + 200, DECODE_SPLIT_LEN + 20];
    run_attention(&o, 8, &q_len, &ctx, (9, 3, 64));
}

/// The packed step of `seqs` (sequence index into `cache`, new tokens, context) with query rows
/// taken from `q[s]` (one row per position of sequence s); the output rows' bits.
fn attend(
    o: &CudaOps,
    cache: &Cache,
    q: &[Vec<u16>],
    seqs: &[(usize, usize, usize)],
    dims: (usize, usize, usize),
) -> Vec<u16> {
    let (nq, _, hd) = dims;
    let w = nq * hd;
    let tables: Vec<&[u32]> = seqs.iter().map(|&(s, _, _)| &cache.tables[s][..]).collect();
    let q_len: Vec<usize> = seqs.iter().map(|&(_, n, _)| n).collect();
    let ctx: Vec<usize> = seqs.iter().map(|&(_, _, c)| c).collect();
    let rows: Vec<u16> = seqs
        .iter()
        .flat_map(|&(s, n, c)| q[s][(c - n) * w..c * w].iter().copied())
        .collect();
    let mut batch = o.attn_batch(&tables, &q_len, &ctx, (nq, hd)).unwrap();
    let qd = o.upload(&rows).unwrap();
    let mut out = o.upload(&vec![NAN16; rows.len()]).unwrap();
    o.attention(&mut batch, &qd, w, &cache.k, &cache.v, &mut out, dims, BS)
        .unwrap();
    o.download(&out).unwrap()
}

#[test]
fn a_rows_bits_do_not_depend_on_the_batch() {
    let Some(o) = ops("a_rows_bits_do_not_depend_on_the_batch") else {
        return;
    };
    let mut r = rng(11);
    // Products: rows alone and in groups through every tiling (up to 64 and 128 rows, and
    // above), against the same rows among 700; with k in 4 segments (each tiling's own way of
    // taking them: a block each, or in turn); and with k
    // not a multiple of 8 (the fallback's two tilings).
    for (m, n, k) in [(700, 1000, 576), (300, 512, 4096), (300, 1000, 570)] {
        let (x, _) = rand_bf16(&mut r, m * k, 1.0);
        let (w, _) = rand_bf16(&mut r, n * k, 0.05);
        let wd = o.upload(&w).unwrap();
        let product = |rows: std::ops::Range<usize>| {
            let xd = o.upload(&x[rows.start * k..rows.end * k]).unwrap();
            let mut out = o.upload(&vec![f32::NAN; rows.len() * n]).unwrap();
            o.gemm(&xd, &wd, &mut out, (rows.len(), n, k)).unwrap();
            let bits: Vec<u32> = o
                .download(&out)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            bits
        };
        let all = product(0..m);
        for rows in [
            0..1,
            5..6,
            299..300,
            0..7,
            3..20,
            100..164,
            0..100,
            100..300,
            1..258,
            0..300,
        ] {
            assert_eq!(
                product(rows.clone()),
                all[rows.start * n..rows.end * n],
                "product {m}×{n}×{k}, rows {rows:?}"
            );
        }
    }
    // Attention: sequence 0's rows prefilled whole, in chunks (one a single row: the decode
    // kernel), decoded alone, and beside another sequence's prefill or decode; contexts over
    // several splits; SmolLM2's heads (3 per KV head of 64) and Llama's (4 per KV head of 128).
    for dims in [(9, 3, 64), (8, 2, 128)] {
        let (nq, _, hd) = dims;
        let long = 2 * DECODE_SPLIT_LEN + 300;
        let cache = fill_cache(&o, &mut r, &[long, 200], dims);
        let q: Vec<Vec<u16>> = [long, 200]
            .iter()
            .map(|&c| rand_bf16(&mut r, c * nq * hd, 1.0).0)
            .collect();
        let row = nq * hd;
        let whole = attend(&o, &cache, &q, &[(0, long, long)], dims);
        let mut chunked = Vec::new();
        for (a, b) in [(0, 500), (500, 501), (501, long - 1), (long - 1, long)] {
            chunked.extend(attend(&o, &cache, &q, &[(0, b - a, b)], dims));
        }
        assert!(whole == chunked, "chunks of the prefill, heads {dims:?}");
        let last = &whole[(long - 1) * row..];
        let with_prefill = attend(&o, &cache, &q, &[(1, 200, 200), (0, 1, long)], dims);
        assert!(
            &with_prefill[200 * row..] == last,
            "a decode row beside a prefill, heads {dims:?}"
        );
        let with_decode = attend(&o, &cache, &q, &[(1, 1, 37), (0, 1, long)], dims);
        assert!(
            &with_decode[row..] == last,
            "a decode row beside another, heads {dims:?}"
        );
        // A short sequence's rows beside a long one (several splits in the step) or alone (one).
        let short_alone = attend(&o, &cache, &q, &[(1, 200, 200)], dims);
        let beside_long = attend(&o, &cache, &q, &[(0, 1, long), (1, 200, 200)], dims);
        assert!(
            beside_long[row..] == short_alone[..],
            "one split beside several, heads {dims:?}"
        );
    }
}

#[test]
fn sampling_is_greedy_at_zero_and_follows_the_distribution_above() {
    let Some(o) = ops("sampling_is_greedy_at_zero_and_follows_the_distribution_above") else {
        return;
    };
    let mut r = rng(8);
    let (rows, vocab) = (64, 128_256);
    let logits: Vec<f32> = (0..rows * vocab)
        .map(|_| r.gen_range(-10.0..10.0))
        .collect();
    let ld = o.upload(&logits).unwrap();
    let mut out = o.upload(&vec![-1i32; rows]).unwrap();
    let mut lp = o.upload(&vec![f32::NAN; rows]).unwrap();
    o.argmax(&ld, rows, vocab, &mut out, &mut lp).unwrap();
    let want: Vec<i32> = logits
        .chunks_exact(vocab)
        .map(|row| tandem_kernels::ops::argmax(row) as i32)
        .collect();
    assert_eq!(o.download(&out).unwrap(), want);
    // The chosen token's log-probability, against the CPU's log-softmax.
    let mut ls = vec![0f32; vocab];
    for ((row, &t), got) in logits
        .chunks_exact(vocab)
        .zip(&want)
        .zip(o.download(&lp).unwrap())
    {
        tandem_kernels::ops::log_softmax(row, &mut ls);
        let w = ls[t as usize];
        assert!(
            (got - w).abs() <= 1e-4 * w.abs().max(1.0),
            "logprob {got}, want {w}"
        );
    }
    let temps = o.upload(&vec![0f32; rows]).unwrap();
    let seeds = o.upload(&(0..rows as u64).collect::<Vec<_>>()).unwrap();
    let mut out = o.upload(&vec![-1i32; rows]).unwrap();
    o.sample(&ld, vocab, &temps, &seeds, &mut out).unwrap();
    assert_eq!(o.download(&out).unwrap(), want, "temperature 0 is greedy");

    // Two tokens with probabilities 1/4 and 3/4: 4096 draws land near 3/4 on the second.
    let n = 4096;
    let two: Vec<f32> = (0..n).flat_map(|_| [0.0f32, 3f32.ln()]).collect();
    let (ld, temps) = (o.upload(&two).unwrap(), o.upload(&vec![1f32; n]).unwrap());
    let seeds = o
        .upload(&(0..n as u64).map(|i| i * 7919 + 1).collect::<Vec<_>>())
        .unwrap();
    let mut out = o.upload(&vec![-1i32; n]).unwrap();
    o.sample(&ld, 2, &temps, &seeds, &mut out).unwrap();
    let got = o.download(&out).unwrap();
    assert!(got.iter().all(|&t| t == 0 || t == 1), "only valid tokens");
    let frac = got.iter().filter(|&&t| t == 1).count() as f64 / n as f64;
    // 4096 draws: the standard deviation of the fraction is under 0.007.
    assert!(
        (frac - 0.75).abs() < 0.03,
        "second token drawn {frac:.3} of the time"
    );
}

/// A tensor-parallel all-reduce's sum of the gathered partial sums: rank after rank in f32,
/// rounded to bf16 once, whatever the length.
#[test]
fn ranks_sum_in_rank_order_rounded_once() {
    let Some(o) = ops("ranks_sum_in_rank_order_rounded_once") else {
        return;
    };
    let mut r = rng(41);
    for (size, n) in [(2, 1), (3, 1000), (4, 70_001)] {
        let (parts, f) = rand_bf16(&mut r, size * n, 3.0);
        let mut out = o.upload(&vec![NAN16; n]).unwrap();
        o.sum_ranks(&o.upload(&parts).unwrap(), size, &mut out)
            .unwrap();
        let want: Vec<u16> = (0..n)
            .map(|i| {
                let s = (0..size).fold(0f32, |s, k| s + f[k * n + i]);
                half::bf16::from_f32(s).to_bits()
            })
            .collect();
        assert_eq!(o.download(&out).unwrap(), want, "{size} ranks of {n}");
    }
}

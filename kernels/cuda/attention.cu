// Paged attention over the block tables, bf16 storage and f32 arithmetic, one kernel for every
// query row (prefill chunks over a cached prefix and decode rows alike): tiles of up to 16 query
// rows of one sequence and one head walk the keys 32 at a time with an online softmax, so no
// score matrix is ever materialized. Causal by absolute position.
//
// Every product and sum is an explicit round-to-nearest intrinsic (never left to the compiler's
// contraction), so the decode kernel below, written for other loads, repeats a row's arithmetic
// to the bit.
//
// The keys are cut at fixed positions (multiples of split_len) into splits, each split a block
// (flash-decoding, for long contexts); a combine kernel merges a row's splits in order. A row's
// arithmetic is therefore fixed by its own position alone, never by the batch: the same key
// tiles (multiples of 32), the same splits, the same merge (a row of one split is copied, not
// merged), whichever rows share its tile, its step or its chunk. (Before, decode rows took
// another kernel than the same rows in a mixed step, and a split count set by the batch's
// longest context.)

__device__ __forceinline__ const bf16* kv_row(const bf16* cache, const AttnParams& p, int seq,
                                              int key, int kvh) {
    int blk = p.block_tables[(i64)seq * p.max_blocks + key / p.block_size];
    return cache + (((i64)blk * p.nkv + kvh) * p.block_size + key % p.block_size) * p.hd;
}

// q · k over hd dimensions as four running sums, dimension i in sum i mod 4 (in increasing i),
// added as (s0 + s1) + (s2 + s3): four chains of dependent products rather than one. Both
// kernels take every score this way.
__device__ __forceinline__ float dot4(const float* q, const float* k, int hd) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int i = 0;
    for (; i + 4 <= hd; i += 4) {
        s0 = __fmaf_rn(q[i], k[i], s0);
        s1 = __fmaf_rn(q[i + 1], k[i + 1], s1);
        s2 = __fmaf_rn(q[i + 2], k[i + 2], s2);
        s3 = __fmaf_rn(q[i + 3], k[i + 3], s3);
    }
    // Heads of 1 or 2 values (hd divides 128).
    if (i < hd) s0 = __fmaf_rn(q[i], k[i], s0);
    if (i + 1 < hd) s1 = __fmaf_rn(q[i + 1], k[i + 1], s1);
    return __fadd_rn(__fadd_rn(s0, s1), __fadd_rn(s2, s3));
}

#define TQ 16
#define TK 32
#define HD_MAX 128

// grid (tiles, nq, max_splits), 128 threads; hd divides 128. Each thread owns one dimension of
// 16·hd/128 rows. With one split (max_splits 1) rows go straight to the output; otherwise each
// split writes its rows' partial results (output / sum, max, sum) for the combine.
extern "C" __global__ void paged_attention(AttnParams p) {
    __shared__ float qs[TQ][HD_MAX];
    __shared__ float ks[TK][HD_MAX + 1];
    __shared__ float vs[TK][HD_MAX];
    __shared__ float ps[TQ][TK];
    __shared__ float row_max[TQ], row_sum[TQ], row_scale[TQ];
    int s = p.tiles[2 * blockIdx.x], q0 = p.tiles[2 * blockIdx.x + 1];
    int h = blockIdx.y, kvh = h / (p.nq / p.nkv), hd = p.hd;
    int qlen = p.seq_q_len[s], ctx = p.seq_context[s], cached = ctx - qlen;
    int rows = min(TQ, qlen - q0);
    i64 first_row = p.seq_q_start[s] + q0;
    int split = blockIdx.z;
    // Keys of this split that any of the tile's rows sees.
    int k_begin = split * p.split_len;
    int keys = min(cached + q0 + rows, k_begin + p.split_len);
    if (k_begin >= keys) {
        // No row of the tile reaches this split: the combine never reads it.
        return;
    }
    for (int e = threadIdx.x; e < TQ * hd; e += blockDim.x) {
        int r = e / hd, i = e % hd;
        qs[r][i] = r < rows
                       ? __fmul_rn(bf16_to_f32(p.q[(first_row + r) * p.q_stride + h * hd + i]), p.scale)
                       : 0.0f;
    }
    if (threadIdx.x < TQ) {
        row_max[threadIdx.x] = NEG_INF;
        row_sum[threadIdx.x] = 0.0f;
    }
    int d = threadIdx.x % hd;
    int per = TQ * hd / 128;
    int r0 = (threadIdx.x / hd) * per;
    float acc[TQ];
#pragma unroll
    for (int k = 0; k < TQ; k++) acc[k] = 0.0f;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int kt = k_begin; kt < keys; kt += TK) {
        int nk = min(TK, keys - kt);
        __syncthreads();
        for (int e = threadIdx.x; e < TK * hd; e += blockDim.x) {
            int j = e / hd, i = e % hd;
            float kv = 0.0f, vv = 0.0f;
            if (j < nk) {
                kv = bf16_to_f32(kv_row(p.k_cache, p, s, kt + j, kvh)[i]);
                vv = bf16_to_f32(kv_row(p.v_cache, p, s, kt + j, kvh)[i]);
            }
            ks[j][i] = kv;
            vs[j][i] = vv;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < TQ * TK; e += blockDim.x) {
            int r = e / TK, j = e % TK;
            float sc = NEG_INF;
            if (r < rows && j < nk && kt + j <= cached + q0 + r) {
                sc = dot4(qs[r], ks[j], hd);
            }
            ps[r][j] = sc;
        }
        __syncthreads();
        // Online softmax: warp w updates rows 4w..4w+3, a lane per key.
        for (int rr = 0; rr < TQ / 4; rr++) {
            int r = warp * (TQ / 4) + rr;
            float sc = ps[r][lane];
            float m_new = fmaxf(row_max[r], warp_max(sc));
            float e = sc == NEG_INF ? 0.0f : __expf(sc - m_new);
            float sum = warp_sum(e);
            ps[r][lane] = e;
            if (lane == 0) {
                float a = row_max[r] == NEG_INF ? 0.0f : __expf(row_max[r] - m_new);
                row_scale[r] = a;
                row_sum[r] = __fmaf_rn(row_sum[r], a, sum);
                row_max[r] = m_new;
            }
        }
        __syncthreads();
        // Unrolled over the largest row count, so `acc` stays in registers.
#pragma unroll
        for (int k = 0; k < TQ; k++) {
            if (k < per) {
                int r = r0 + k;
                float a = __fmul_rn(acc[k], row_scale[r]);
                for (int j = 0; j < nk; j++) a = __fmaf_rn(ps[r][j], vs[j][d], a);
                acc[k] = a;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < TQ; k++) {
        int r = r0 + k;
        if (k < per && r < rows) {
            float o = row_sum[r] > 0.0f ? acc[k] / row_sum[r] : 0.0f;
            if (gridDim.z == 1) {
                p.out[(first_row + r) * p.nq * hd + h * hd + d] = f32_to_bf16(o);
            } else {
                i64 part = ((first_row + r) * p.nq + h) * p.max_splits + split;
                p.part_out[part * hd + d] = o;
                if (d == 0) {
                    p.part_ml[2 * part] = row_max[r];
                    p.part_ml[2 * part + 1] = row_sum[r];
                }
            }
        }
    }
}

// Query heads per KV head the decode kernel serves (more: the tiled kernel takes the rows).
#define G_MAX 8

// Decode rows (one new token of a sequence): grid (decode tiles, nkv, max_splits), 128 threads.
// A block takes every query head of one KV head (grouped-query attention reads each key once,
// not once per query head), loads the keys and values 16 bytes at a time, and fetches the next
// tile while it works on this one. Warp w takes query heads w and w + 4, lane j key j of the
// tile for the scores and dimensions j, j + 32, ... for the output. Each row's arithmetic is
// the tiled kernel's, operation for operation: the same dot products (dot4's four sums), the
// same tiles of 32 keys at the same positions, the same online softmax and weighted sums.
extern "C" __global__ void __launch_bounds__(128) paged_attention_decode(AttnParams p) {
    __shared__ __align__(16) float qs[G_MAX][HD_MAX];
    // Rows padded by 4 floats: lane j's 16-byte reads of key j fall in distinct bank groups.
    __shared__ __align__(16) float ks[TK][HD_MAX + 4];
    __shared__ __align__(16) float vs[TK][HD_MAX];
    __shared__ float ps[G_MAX][TK];
    const int s = p.tiles[2 * blockIdx.x];
    const int kvh = blockIdx.y, hd = p.hd, group = p.nq / p.nkv;
    const int ctx = p.seq_context[s];
    const i64 row = p.seq_q_start[s];
    const int split = blockIdx.z;
    const int k_begin = split * p.split_len;
    const int keys = min(ctx, k_begin + p.split_len);
    if (k_begin >= keys) {
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int e = threadIdx.x; e < group * hd; e += blockDim.x) {
        int hh = e / hd, i = e % hd;
        qs[hh][i] = __fmul_rn(bf16_to_f32(p.q[row * p.q_stride + (kvh * group + hh) * hd + i]),
                              p.scale);
    }
    // 16-byte chunks of a tile's keys (and as many of its values): TK·hd/8, at most 4 a thread.
    const int chunks_per_key = hd / 8, chunks = TK * chunks_per_key;
    uint4 kreg[TK * HD_MAX / 8 / 128], vreg[TK * HD_MAX / 8 / 128];
    auto fetch = [&](int kt) {
        int nk = min(TK, keys - kt);
#pragma unroll
        for (int u = 0; u < TK * HD_MAX / 8 / 128; u++) {
            int e = threadIdx.x + u * 128;
            int j = e / chunks_per_key, c = (e % chunks_per_key) * 8;
            kreg[u] = make_uint4(0, 0, 0, 0);
            vreg[u] = make_uint4(0, 0, 0, 0);
            if (e < chunks && j < nk) {
                kreg[u] = *(const uint4*)(kv_row(p.k_cache, p, s, kt + j, kvh) + c);
                vreg[u] = *(const uint4*)(kv_row(p.v_cache, p, s, kt + j, kvh) + c);
            }
        }
    };
    float row_max[2] = {NEG_INF, NEG_INF}, row_sum[2] = {0.0f, 0.0f};
    float acc[2][HD_MAX / 32];
#pragma unroll
    for (int hi = 0; hi < 2; hi++)
#pragma unroll
        for (int c = 0; c < HD_MAX / 32; c++) acc[hi][c] = 0.0f;
    const int dims = hd / 32;
    fetch(k_begin);
    for (int kt = k_begin; kt < keys; kt += TK) {
        const int nk = min(TK, keys - kt);
        __syncthreads();
#pragma unroll
        for (int u = 0; u < TK * HD_MAX / 8 / 128; u++) {
            int e = threadIdx.x + u * 128;
            if (e < chunks) {
                int j = e / chunks_per_key, c = (e % chunks_per_key) * 8;
                unpack8(&ks[j][c], kreg[u]);
                unpack8(&vs[j][c], vreg[u]);
            }
        }
        __syncthreads();
        if (kt + TK < keys) fetch(kt + TK);
#pragma unroll
        for (int hi = 0; hi < 2; hi++) {
            const int hh = warp + 4 * hi;
            if (hh >= group) break;
            float sc = NEG_INF;
            if (lane < nk) {
                // dot4's arithmetic (hd is a multiple of 4 here), 16 bytes at a time.
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
                for (int i = 0; i < hd; i += 4) {
                    float4 qv = *(const float4*)&qs[hh][i];
                    float4 kv = *(const float4*)&ks[lane][i];
                    s0 = __fmaf_rn(qv.x, kv.x, s0);
                    s1 = __fmaf_rn(qv.y, kv.y, s1);
                    s2 = __fmaf_rn(qv.z, kv.z, s2);
                    s3 = __fmaf_rn(qv.w, kv.w, s3);
                }
                sc = __fadd_rn(__fadd_rn(s0, s1), __fadd_rn(s2, s3));
            }
            float m_new = fmaxf(row_max[hi], warp_max(sc));
            float e = sc == NEG_INF ? 0.0f : __expf(sc - m_new);
            float sum = warp_sum(e);
            float a = row_max[hi] == NEG_INF ? 0.0f : __expf(row_max[hi] - m_new);
            row_sum[hi] = __fmaf_rn(row_sum[hi], a, sum);
            row_max[hi] = m_new;
            ps[hh][lane] = e;
            __syncwarp();
            // Each output dimension's sum takes the keys in order, as the tiled kernel's; the
            // dimensions' sums run side by side.
#pragma unroll
            for (int c = 0; c < HD_MAX / 32; c++) {
                if (c < dims) acc[hi][c] = __fmul_rn(acc[hi][c], a);
            }
            for (int j = 0; j < nk; j++) {
                const float pj = ps[hh][j];
#pragma unroll
                for (int c = 0; c < HD_MAX / 32; c++) {
                    if (c < dims) acc[hi][c] = __fmaf_rn(pj, vs[j][lane + 32 * c], acc[hi][c]);
                }
            }
            __syncwarp();
        }
    }
#pragma unroll
    for (int hi = 0; hi < 2; hi++) {
        const int hh = warp + 4 * hi;
        if (hh >= group) break;
        const int h = kvh * group + hh;
#pragma unroll
        for (int c = 0; c < HD_MAX / 32; c++) {
            if (c < dims) {
                int d = lane + 32 * c;
                float o = row_sum[hi] > 0.0f ? acc[hi][c] / row_sum[hi] : 0.0f;
                if (gridDim.z == 1) {
                    p.out[row * p.nq * hd + h * hd + d] = f32_to_bf16(o);
                } else {
                    i64 part = (row * p.nq + h) * p.max_splits + split;
                    p.part_out[part * hd + d] = o;
                    if (d == 0) {
                        p.part_ml[2 * part] = row_max[hi];
                        p.part_ml[2 * part + 1] = row_sum[hi];
                    }
                }
            }
        }
    }
}

// grid (tiles, nq), 128 threads: merges each of a tile's rows' splits (those up to its own
// position) in order. A row of one split is copied, so its bits are those of the direct write.
extern "C" __global__ void paged_attention_combine(AttnParams p) {
    int s = p.tiles[2 * blockIdx.x], q0 = p.tiles[2 * blockIdx.x + 1];
    int h = blockIdx.y, hd = p.hd;
    int qlen = p.seq_q_len[s], cached = p.seq_context[s] - qlen;
    int rows = min(TQ, qlen - q0);
    i64 first_row = p.seq_q_start[s] + q0;
    for (int r = 0; r < rows; r++) {
        int pos = cached + q0 + r;
        int splits = pos / p.split_len + 1;
        i64 base = ((first_row + r) * p.nq + h) * p.max_splits;
        bf16* dst = p.out + (first_row + r) * p.nq * hd + h * hd;
        if (splits == 1) {
            for (int d = threadIdx.x; d < hd; d += blockDim.x) {
                dst[d] = f32_to_bf16(p.part_out[base * hd + d]);
            }
            continue;
        }
        float mx = NEG_INF;
        for (int k = 0; k < splits; k++) mx = fmaxf(mx, p.part_ml[2 * (base + k)]);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float num = 0.0f, den = 0.0f;
            for (int k = 0; k < splits; k++) {
                float w = __expf(p.part_ml[2 * (base + k)] - mx) * p.part_ml[2 * (base + k) + 1];
                num += w * p.part_out[(base + k) * hd + d];
                den += w;
            }
            dst[d] = f32_to_bf16(num / den);
        }
    }
}

// Paged attention over the block tables, bf16 storage and f32 arithmetic:
// - decode (one new token per sequence): the context is cut into splits of split_len keys, each
//   split a block that writes a partial result (flash-decoding); a combine kernel merges them.
//   With one split the result goes straight to the output.
// - prefill (packed variable-length chunks over a cached prefix): tiles of 16 query rows of one
//   sequence and one head walk the keys 32 at a time with an online softmax, so no score matrix
//   is ever materialized. Causal by absolute position.

__device__ __forceinline__ const bf16* kv_row(const bf16* cache, const AttnParams& p, int seq,
                                              int key, int kvh) {
    int blk = p.block_tables[(i64)seq * p.max_blocks + key / p.block_size];
    return cache + (((i64)blk * p.nkv + kvh) * p.block_size + key % p.block_size) * p.hd;
}

// grid (seqs, nq, max_splits), 128 threads; dynamic shared memory: (hd + split_len) floats.
extern "C" __global__ void paged_decode_attention(AttnParams p) {
    extern __shared__ float smem[];
    __shared__ float scratch[32];
    float* qs = smem;
    float* sc = smem + p.hd;
    int s = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    int kvh = h / (p.nq / p.nkv);
    int ctx = p.seq_context[s];
    int row = p.seq_q_start[s] + p.seq_q_len[s] - 1;
    int start = split * p.split_len;
    int end = min(ctx, start + p.split_len);
    i64 part = ((i64)s * p.nq + h) * p.max_splits + split;
    if (start >= end) {
        if (gridDim.z > 1 && threadIdx.x == 0) {
            p.part_ml[2 * part] = NEG_INF;
            p.part_ml[2 * part + 1] = 0.0f;
        }
        return;
    }
    const bf16* q = p.q + (i64)row * p.q_stride + h * p.hd;
    for (int i = threadIdx.x; i < p.hd; i += blockDim.x) qs[i] = bf16_to_f32(q[i]) * p.scale;
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int j = start + warp; j < end; j += warps) {
        const bf16* k = kv_row(p.k_cache, p, s, j, kvh);
        float dot = 0.0f;
        for (int i = lane; i < p.hd; i += 32) dot += qs[i] * bf16_to_f32(k[i]);
        dot = warp_sum(dot);
        if (lane == 0) sc[j - start] = dot;
    }
    __syncthreads();
    int n = end - start;
    float m = NEG_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, sc[j]);
    m = block_max(m, scratch);
    float l = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = __expf(sc[j] - m);
        sc[j] = e;
        l += e;
    }
    l = block_sum(l, scratch);
    __syncthreads();
    for (int d = threadIdx.x; d < p.hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; j++) acc += sc[j] * bf16_to_f32(kv_row(p.v_cache, p, s, start + j, kvh)[d]);
        if (gridDim.z == 1) {
            p.out[(i64)row * p.nq * p.hd + h * p.hd + d] = f32_to_bf16(acc / l);
        } else {
            p.part_out[part * p.hd + d] = acc / l;
        }
    }
    if (gridDim.z > 1 && threadIdx.x == 0) {
        p.part_ml[2 * part] = m;
        p.part_ml[2 * part + 1] = l;
    }
}

// grid (seqs, nq), 128 threads: merges the splits of paged_decode_attention.
extern "C" __global__ void paged_decode_combine(AttnParams p) {
    int s = blockIdx.x, h = blockIdx.y;
    int ctx = p.seq_context[s];
    int splits = (ctx + p.split_len - 1) / p.split_len;
    int row = p.seq_q_start[s] + p.seq_q_len[s] - 1;
    i64 base = ((i64)s * p.nq + h) * p.max_splits;
    float mx = NEG_INF;
    for (int k = 0; k < splits; k++) mx = fmaxf(mx, p.part_ml[2 * (base + k)]);
    for (int d = threadIdx.x; d < p.hd; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int k = 0; k < splits; k++) {
            float w = __expf(p.part_ml[2 * (base + k)] - mx) * p.part_ml[2 * (base + k) + 1];
            num += w * p.part_out[(base + k) * p.hd + d];
            den += w;
        }
        p.out[(i64)row * p.nq * p.hd + h * p.hd + d] = f32_to_bf16(num / den);
    }
}

#define TQ 16
#define TK 32
#define HD_MAX 128

// grid (tiles, nq), 128 threads; hd divides 128. Each thread owns one dimension of 16·hd/128 rows.
extern "C" __global__ void paged_prefill_attention(AttnParams p) {
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
    for (int e = threadIdx.x; e < TQ * hd; e += blockDim.x) {
        int r = e / hd, i = e % hd;
        qs[r][i] = r < rows ? bf16_to_f32(p.q[(first_row + r) * p.q_stride + h * hd + i]) * p.scale
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
    int keys = cached + q0 + rows;
    for (int kt = 0; kt < keys; kt += TK) {
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
                sc = 0.0f;
                for (int i = 0; i < hd; i++) sc += qs[r][i] * ks[j][i];
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
                row_sum[r] = row_sum[r] * a + sum;
                row_max[r] = m_new;
            }
        }
        __syncthreads();
        // Unrolled over the largest row count, so `acc` stays in registers.
#pragma unroll
        for (int k = 0; k < TQ; k++) {
            if (k < per) {
                int r = r0 + k;
                float a = acc[k] * row_scale[r];
                for (int j = 0; j < nk; j++) a += ps[r][j] * vs[j][d];
                acc[k] = a;
            }
        }
    }
#pragma unroll
    for (int k = 0; k < TQ; k++) {
        int r = r0 + k;
        if (k < per && r < rows) {
            p.out[(first_row + r) * p.nq * hd + h * hd + d] = f32_to_bf16(acc[k] / row_sum[r]);
        }
    }
}

// Row-wise and element-wise ops of a Llama step, as the CPU path computes them (ops.rs):
// RMS norm (optionally fused with the residual add), rotary embedding of q and k in the fused qkv
// rows, SiLU·mul of the fused gate/up rows, and the embedding gather.

// The norms' vector path: a row of d values (d a multiple of 8, at most 8 · NORM_CHUNKS ·
// blockDim.x) read once, 16 bytes at a time, and kept in registers between the sum of squares
// and the scaling; thread t takes chunks t, t + blockDim.x, ... Otherwise the scalar loops.
// Which path runs, and so the order of the sum, follows from d alone, never from the row count.
#define NORM_CHUNKS 4

__device__ __forceinline__ bool norm_vector(int d) {
    return (d & 7) == 0 && d <= 8 * NORM_CHUNKS * (int)blockDim.x;
}

// f(u, c) for this thread's chunks c of a row of `chunks` (its u-th: chunk threadIdx.x +
// u · blockDim.x), unrolled so that arrays indexed by u stay in registers.
template <typename F>
__device__ __forceinline__ void norm_chunks(int chunks, F f) {
#pragma unroll
    for (int u = 0; u < NORM_CHUNKS; u++) {
        int c = threadIdx.x + u * blockDim.x;
        if (c < chunks) f(u, c);
    }
}

// The vector path's second half: this thread's chunks of the row (in registers) times inv and
// the weights, stored 16 bytes at a time.
__device__ __forceinline__ void norm_scale(const float (&v)[NORM_CHUNKS][8],
                                           const bf16* __restrict__ w, bf16* __restrict__ orow,
                                           int chunks, float inv) {
    norm_chunks(chunks, [&](int u, int c) {
        float wv[8], o[8];
        unpack8(wv, *(const uint4*)(w + 8 * c));
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = wv[i] * (v[u][i] * inv);
        *(uint4*)(orow + 8 * c) = pack8(o);
    });
}

// out = x / sqrt(mean(x²) + eps) · w; one block per row.
extern "C" __global__ void rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                    bf16* __restrict__ out, int d, float eps) {
    __shared__ float scratch[32];
    const bf16* xr = x + (i64)blockIdx.x * d;
    bf16* orow = out + (i64)blockIdx.x * d;
    float ss = 0.0f;
    if (norm_vector(d)) {
        const int chunks = d / 8;
        float v[NORM_CHUNKS][8];
        norm_chunks(chunks, [&](int u, int c) {
            unpack8(v[u], *(const uint4*)(xr + 8 * c));
#pragma unroll
            for (int i = 0; i < 8; i++) ss += v[u][i] * v[u][i];
        });
        norm_scale(v, w, orow, chunks, rsqrtf(block_sum(ss, scratch) / d + eps));
        return;
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = bf16_to_f32(xr[i]);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, scratch) / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        orow[i] = f32_to_bf16(bf16_to_f32(w[i]) * (bf16_to_f32(xr[i]) * inv));
    }
}

// residual += delta, then out = rms_norm(residual); one block per row. The sum is rounded to bf16
// before the norm reads it, as an unfused add then norm would.
extern "C" __global__ void add_rms_norm(bf16* __restrict__ residual, const bf16* __restrict__ delta,
                                        const bf16* __restrict__ w, bf16* __restrict__ out, int d,
                                        float eps) {
    __shared__ float scratch[32];
    bf16* r = residual + (i64)blockIdx.x * d;
    const bf16* dl = delta + (i64)blockIdx.x * d;
    bf16* orow = out + (i64)blockIdx.x * d;
    float ss = 0.0f;
    if (norm_vector(d)) {
        const int chunks = d / 8;
        float v[NORM_CHUNKS][8];
        norm_chunks(chunks, [&](int u, int c) {
            float a[8], b[8];
            unpack8(a, *(const uint4*)(r + 8 * c));
            unpack8(b, *(const uint4*)(dl + 8 * c));
#pragma unroll
            for (int i = 0; i < 8; i++) a[i] = a[i] + b[i];
            const uint4 sum = pack8(a);
            *(uint4*)(r + 8 * c) = sum;
            unpack8(v[u], sum);
#pragma unroll
            for (int i = 0; i < 8; i++) ss += v[u][i] * v[u][i];
        });
        norm_scale(v, w, orow, chunks, rsqrtf(block_sum(ss, scratch) / d + eps));
        return;
    }
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        bf16 s = f32_to_bf16(bf16_to_f32(r[i]) + bf16_to_f32(dl[i]));
        r[i] = s;
        float v = bf16_to_f32(s);
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, scratch) / d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        orow[i] = f32_to_bf16(bf16_to_f32(w[i]) * (bf16_to_f32(r[i]) * inv));
    }
}

// HF's rotate_half rotary embedding, in place, on the q heads and then the k heads at the start of
// each fused qkv row (nq + 2·nkv heads of hd). cos/sin: f32 tables of max_pos × hd/2.
// One block per token; threads over (head, i < hd/2).
extern "C" __global__ void qkv_rope(bf16* __restrict__ qkv, const int* __restrict__ positions,
                                    const float* __restrict__ cos_t,
                                    const float* __restrict__ sin_t, int nq, int nkv, int hd) {
    int half = hd / 2;
    bf16* row = qkv + (i64)blockIdx.x * (nq + 2 * nkv) * hd;
    const float* c = cos_t + (i64)positions[blockIdx.x] * half;
    const float* s = sin_t + (i64)positions[blockIdx.x] * half;
    for (int j = threadIdx.x; j < (nq + nkv) * half; j += blockDim.x) {
        int h = j / half, i = j % half;
        bf16* a = row + h * hd + i;
        float x0 = bf16_to_f32(a[0]), x1 = bf16_to_f32(a[half]);
        a[0] = f32_to_bf16(x0 * c[i] - x1 * s[i]);
        a[half] = f32_to_bf16(x1 * c[i] + x0 * s[i]);
    }
}

// out[t][i] = silu(gate[t][i]) · up[t][i], where row t of gu is [gate (ff) | up (ff)].
extern "C" __global__ void silu_mul(const bf16* __restrict__ gu, bf16* __restrict__ out, int ff,
                                    i64 n) {
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        i64 t = e / ff, i = e % ff;
        float g = bf16_to_f32(gu[t * 2 * ff + i]);
        float u = bf16_to_f32(gu[t * 2 * ff + ff + i]);
        out[e] = f32_to_bf16(g / (1.0f + __expf(-g)) * u);
    }
}

// out[t] = table[ids[t]], or zeros where ids[t] is negative (a token outside a tensor-parallel
// rank's slice of the vocabulary); one block per token. Ids were checked against the vocabulary
// on the host.
extern "C" __global__ void embedding(const int* __restrict__ ids, const bf16* __restrict__ table,
                                     bf16* __restrict__ out, int d) {
    const int id = ids[blockIdx.x];
    bf16* dst = out + (i64)blockIdx.x * d;
    if (id < 0) {
        for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = f32_to_bf16(0.0f);
        return;
    }
    const bf16* src = table + (i64)id * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
}

// out[i] = the sum of parts[r][i] over the ranks r = 0..size in rank order, in f32, rounded to
// bf16 once: a tensor-parallel all-reduce made of an all-gather and this, whose bits are the
// same on every rank and do not depend on the step's row count (NCCL's own reduction may order
// its sums by the message's size).
extern "C" __global__ void sum_ranks(const bf16* __restrict__ parts, int size, i64 n,
                                     bf16* __restrict__ out) {
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int r = 0; r < size; r++) s += bf16_to_f32(parts[(i64)r * n + e]);
        out[e] = f32_to_bf16(s);
    }
}

// dst[r][i] = src[r][i] for i < cols, rows of src_ld and dst_ld f32 values; one block per row.
// Lays a tensor-parallel rank's logits out padded for the gather, and the gathered slices out
// row after row.
extern "C" __global__ void copy_cols_f32(const float* __restrict__ src, int src_ld,
                                         float* __restrict__ dst, int dst_ld, int cols) {
    const float* s = src + (i64)blockIdx.x * src_ld;
    float* o = dst + (i64)blockIdx.x * dst_ld;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = s[i];
}

// x[i] = bf16(scale · u) with u uniform in [-1, 1) from a hash of (seed, i): random weights and
// caches made on the device for benchmarks, with no host-side copy.
extern "C" __global__ void fill_random(bf16* __restrict__ x, i64 n, unsigned long long seed,
                                       float scale) {
    for (i64 e = (i64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (i64)gridDim.x * blockDim.x) {
        unsigned long long z = seed + 0x9e3779b97f4a7c15ull * (unsigned long long)(e + 1);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        float u = (float)(z >> 40) * (1.0f / 8388608.0f) - 1.0f;
        x[e] = f32_to_bf16(scale * u);
    }
}

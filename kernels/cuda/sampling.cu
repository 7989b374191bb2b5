// Next-token choice on the device, one block per row of f32 logits, so only token ids come back.

// Largest (value, index) pair, the first index on ties (as torch.argmax and the CPU path).
__device__ __forceinline__ void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

__device__ int block_argmax(float v, int i) {
    __shared__ float sv[32];
    __shared__ int si[32];
    for (int o = 16; o > 0; o >>= 1) {
        better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < warps ? sv[lane] : NEG_INF;
    i = lane < warps ? si[lane] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        better(v, i, __shfl_xor_sync(0xffffffffu, v, o), __shfl_xor_sync(0xffffffffu, i, o));
    }
    return i;
}

// Greedy: out[row] = argmax(logits[row]), and logprob[row] its log-probability under the row's
// softmax (-log Σ exp(x - max)), so a greedy step downloads two numbers a row, not the logits.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab,
                                       int* __restrict__ out, float* __restrict__ logprob) {
    __shared__ float scratch[32];
    const float* x = logits + (i64)blockIdx.x * vocab;
    float v = NEG_INF;
    int i = 0x7fffffff;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) better(v, i, x[j], j);
    int best = block_argmax(v, i);
    float m = x[best];
    float s = 0.0f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) s += expf(x[j] - m);
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = best;
        logprob[blockIdx.x] = -logf(s);
    }
}

// A uniform in (0, 1) from (seed, index): a 64-bit mix (splitmix64's finalizer).
__device__ __forceinline__ float uniform(unsigned long long seed, int j) {
    unsigned long long z = seed + 0x9e3779b97f4a7c15ull * (unsigned long long)(j + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return ((float)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Sampling at a temperature by the Gumbel-max trick: argmax(logit/T - log(-log(u))) is a draw from
// softmax(logits/T). A temperature of 0 is greedy. seeds[row] makes each draw reproducible.
extern "C" __global__ void sample_rows(const float* __restrict__ logits, int vocab,
                                       const float* __restrict__ temperature,
                                       const unsigned long long* __restrict__ seeds,
                                       int* __restrict__ out) {
    const float* x = logits + (i64)blockIdx.x * vocab;
    float t = temperature[blockIdx.x];
    unsigned long long seed = seeds[blockIdx.x];
    float v = NEG_INF;
    int i = 0x7fffffff;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float s = t > 0.0f ? x[j] / t - __logf(-__logf(uniform(seed, j))) : x[j];
        better(v, i, s, j);
    }
    int best = block_argmax(v, i);
    if (threadIdx.x == 0) out[blockIdx.x] = best;
}

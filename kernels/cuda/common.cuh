// Shared by every Tandem kernel; prepended to each .cu before NVRTC compiles it, so no toolkit
// header is needed. bf16 values are raw 16-bit patterns (the high half of an f32); arithmetic is
// always in f32.

typedef unsigned short bf16;
typedef long long i64;

__device__ __forceinline__ float bf16_to_f32(bf16 v) {
    return __uint_as_float(((unsigned int)v) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

// 8 bf16 values (16 bytes) to f32 and back.
__device__ __forceinline__ void unpack8(float* f, uint4 v) {
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    unsigned u[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u[i] = (unsigned)f32_to_bf16(f[2 * i]) | ((unsigned)f32_to_bf16(f[2 * i + 1]) << 16);
    }
    return make_uint4(u[0], u[1], u[2], u[3]);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
// `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Max over the whole block; every thread gets it. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : -__int_as_float(0x7f800000);
    return warp_max(v);
}

#define NEG_INF (-__int_as_float(0x7f800000))

// Everything the attention kernels read, passed by value. Mirrored field for field by
// `AttnParams` in kernels/src/cuda/mod.rs; the compile check asserts both layouts agree.
struct AttnParams {
    const bf16* q;            // token rows of q_stride values; head h at h·hd
    const bf16* k_cache;      // one layer: [blocks][nkv][block_size][hd]
    const bf16* v_cache;      // same layout
    bf16* out;                // token rows of nq·hd
    const int* block_tables;  // [seqs][max_blocks]
    const int* seq_q_start;   // [seqs] row of the sequence's first new token
    const int* seq_q_len;     // [seqs] new tokens this step
    const int* seq_context;   // [seqs] tokens in the cache, the new ones included
    const int* tiles;         // [tiles][2] = (sequence, first new token of the tile)
    float* part_out;          // splits: [rows][nq][max_splits][hd] (output / sum)
    float* part_ml;           // [rows][nq][max_splits][2] = (max score, sum of exponentials)
    int q_stride;
    int nq;
    int nkv;
    int hd;
    int block_size;
    int max_blocks;
    int split_len;            // keys per split (a multiple of 32), fixed: never set by the batch
    int max_splits;
    float scale;              // 1/sqrt(hd)
    int reserved;
};

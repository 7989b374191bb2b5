// K and V of each new token, from its fused qkv row, into its slot of the paged cache (one layer:
// [blocks][nkv][block_size][hd] for each of K and V). A negative slot is padding and is skipped.
// One block per token.
extern "C" __global__ void write_kv(const bf16* __restrict__ qkv, const i64* __restrict__ slots,
                                    bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int nq,
                                    int nkv, int hd, int block_size) {
    i64 slot = slots[blockIdx.x];
    if (slot < 0) return;
    i64 blk = slot / block_size, off = slot % block_size;
    const bf16* row = qkv + (i64)blockIdx.x * (nq + 2 * nkv) * hd;
    for (int e = threadIdx.x; e < nkv * hd; e += blockDim.x) {
        int h = e / hd, i = e % hd;
        i64 dst = ((blk * nkv + h) * block_size + off) * hd + i;
        k_cache[dst] = row[nq * hd + e];
        v_cache[dst] = row[(nq + nkv) * hd + e];
    }
}

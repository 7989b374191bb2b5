// Products out[m×n] = x[m×k] · Wᵀ (W is n×k, row-major), bf16 in, f32 accumulation, out in bf16
// or f32, on the tensor cores (mma.sync m16n8k16).
//
// Batch-invariant by construction: every output is one accumulator that takes the k columns
// 16 at a time in increasing order through the same instruction, at the same place in its
// 16×8 fragment (tiles start at multiples of 16 rows and 8 columns), whatever the row count and
// whichever of the two tilings runs. No split of k, so no partial sums to merge. (The vendor
// library picks its kernel, and a split of k, by the shape: a row's bits changed with the batch.)
//
// A block is 4 warps over a tile of BM rows × 64 columns, k taken 32 at a time through shared
// memory: WARPS_M warps down the rows (MI fragments of 16 rows each), 4 / WARPS_M across the
// columns (NI fragments of 8 columns each).

#define GEMM_BK 32
// Shared-memory rows are padded by 8 values (16 bytes) so the fragment loads spread over banks.
#define GEMM_LD (GEMM_BK + 8)

__device__ __forceinline__ void mma_bf16_16816(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Rows `r0 ..` of a row-major matrix of `rows` × `k` into shared memory (`TR` rows × GEMM_BK
// values from column k0), zeros outside it.
template <int TR>
__device__ __forceinline__ void gemm_load_tile(bf16 (*dst)[GEMM_LD], const bf16* src, int rows,
                                               int k, int r0, int k0) {
    const bool vec = (k & 7) == 0;
    for (int v = threadIdx.x; v < TR * (GEMM_BK / 8); v += blockDim.x) {
        int r = v / (GEMM_BK / 8), c = (v % (GEMM_BK / 8)) * 8;
        int gr = r0 + r, gc = k0 + c;
        const bf16* p = src + (i64)gr * k + gc;
        if (vec && gr < rows && gc + 8 <= k) {
            *(uint4*)&dst[r][c] = *(const uint4*)p;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) dst[r][c + i] = (gr < rows && gc + i < k) ? p[i] : (bf16)0;
        }
    }
}

template <int WARPS_M, int MI, int NI>
__device__ __forceinline__ void gemm_tile(const bf16* x, const bf16* w, void* out, int m, int n,
                                          int k, int f32_out) {
    const int BM = WARPS_M * MI * 16;
    const int WARPS_N = 4 / WARPS_M;
    const int BN = WARPS_N * NI * 8;
    __shared__ __align__(16) bf16 as[BM][GEMM_LD];
    __shared__ __align__(16) bf16 bs[BN][GEMM_LD];
    int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int wm = warp / WARPS_N, wn = warp % WARPS_N;
    int g = lane >> 2, t = lane & 3;
    float acc[MI][NI][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
    for (int k0 = 0; k0 < k; k0 += GEMM_BK) {
        __syncthreads();
        gemm_load_tile<BM>(as, x, m, k, m0, k0);
        gemm_load_tile<BN>(bs, w, n, k, n0, k0);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            unsigned a[MI][4], b[NI][2];
#pragma unroll
            for (int i = 0; i < MI; i++) {
                int r = wm * MI * 16 + i * 16 + g;
                a[i][0] = *(const unsigned*)&as[r][kk + 2 * t];
                a[i][1] = *(const unsigned*)&as[r + 8][kk + 2 * t];
                a[i][2] = *(const unsigned*)&as[r][kk + 2 * t + 8];
                a[i][3] = *(const unsigned*)&as[r + 8][kk + 2 * t + 8];
            }
#pragma unroll
            for (int j = 0; j < NI; j++) {
                int c = wn * NI * 8 + j * 8 + g;
                b[j][0] = *(const unsigned*)&bs[c][kk + 2 * t];
                b[j][1] = *(const unsigned*)&bs[c][kk + 2 * t + 8];
            }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < NI; j++) mma_bf16_16816(acc[i][j], a[i], b[j]);
        }
    }
    // Fragment element e: row g (e < 2) or g + 8, column 2t + (e & 1).
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = m0 + wm * MI * 16 + i * 16 + g + (e >> 1) * 8;
                int c = n0 + wn * NI * 8 + j * 8 + 2 * t + (e & 1);
                if (r < m && c < n) {
                    if (f32_out) {
                        ((float*)out)[(i64)r * n + c] = acc[i][j][e];
                    } else {
                        ((bf16*)out)[(i64)r * n + c] = f32_to_bf16(acc[i][j][e]);
                    }
                }
            }
}

// Up to 16 rows (decode): tiles of 16 × 64, 128 threads; grid (n / 64, m / 16), rounded up.
extern "C" __global__ void gemm_rows16(const bf16* x, const bf16* w, void* out, int m, int n,
                                       int k, int f32_out) {
    gemm_tile<1, 1, 2>(x, w, out, m, n, k, f32_out);
}

// More rows: tiles of 64 × 64, 128 threads; grid (n / 64, m / 64), rounded up.
extern "C" __global__ void gemm_rows64(const bf16* x, const bf16* w, void* out, int m, int n,
                                       int k, int f32_out) {
    gemm_tile<2, 2, 4>(x, w, out, m, n, k, f32_out);
}

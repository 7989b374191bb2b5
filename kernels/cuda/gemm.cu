// Products out[m×n] = x[m×k] · Wᵀ (W is n×k, row-major), bf16 in, f32 accumulation, out in bf16
// or f32, on the tensor cores (mma.sync m16n8k16).
//
// Batch-invariant by construction: every output is one accumulator that takes the k columns
// 16 at a time in increasing order through the same instruction, at the same place in its
// 16×8 fragment (tiles start at multiples of 16 rows and 8 columns), whatever the row count and
// whichever of the tilings runs. Where k is cut into segments (below, the pipelined kernels) the
// cut is the weight's shape's alone, and every tiling adds the segments' sums in the same order.
// (The vendor library picks its kernel, and a split of k, by the whole shape, m included: a
// row's bits changed with the batch.)
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

// f(i, j, e) for each element e of each of a warp's MI × NI accumulator fragments.
template <int MI, int NI, typename F>
__device__ __forceinline__ void gemm_each(F f) {
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) f(i, j, e);
}

// Each of a warp's accumulator elements (MI × NI fragments from row r0, column c0) inside the
// m × n output: f(i, j, e, offset). Fragment element e: row g (e < 2) or g + 8, column
// 2t + (e & 1).
template <int MI, int NI, typename F>
__device__ __forceinline__ void gemm_frags(int m, int n, int r0, int c0, F f) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    gemm_each<MI, NI>([&](int i, int j, int e) {
        int r = r0 + i * 16 + g + (e >> 1) * 8;
        int c = c0 + j * 8 + 2 * t + (e & 1);
        if (r < m && c < n) f(i, j, e, (i64)r * n + c);
    });
}

// One output value, bf16 or f32.
__device__ __forceinline__ void gemm_put(void* out, i64 o, float v, int f32_out) {
    if (f32_out) {
        ((float*)out)[o] = v;
    } else {
        ((bf16*)out)[o] = f32_to_bf16(v);
    }
}

// A warp's accumulators into out.
template <int MI, int NI>
__device__ __forceinline__ void gemm_store(const float (&acc)[MI][NI][4], void* out, int m, int n,
                                           int r0, int c0, int f32_out) {
    gemm_frags<MI, NI>(m, n, r0, c0, [&](int i, int j, int e, i64 o) {
        gemm_put(out, o, acc[i][j][e], f32_out);
    });
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
    gemm_each<MI, NI>([&](int i, int j, int e) { acc[i][j][e] = 0.0f; });
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
    gemm_store<MI, NI>(acc, out, m, n, m0 + wm * MI * 16, n0 + wn * NI * 8, f32_out);
}

// The fallback for k not a multiple of 8 (rows not 16-byte aligned, so no asynchronous copies):
// up to 16 rows, tiles of 16 × 64, 128 threads; grid (n / 64, m / 16), rounded up.
extern "C" __global__ void gemm_rows16(const bf16* x, const bf16* w, void* out, int m, int n,
                                       int k, int f32_out) {
    gemm_tile<1, 1, 2>(x, w, out, m, n, k, f32_out);
}

// The fallback above 16 rows: tiles of 64 × 64, 128 threads; grid (n / 64, m / 64), rounded up.
extern "C" __global__ void gemm_rows64(const bf16* x, const bf16* w, void* out, int m, int n,
                                       int k, int f32_out) {
    gemm_tile<2, 2, 4>(x, w, out, m, n, k, f32_out);
}

// ---------------------------------------------------------------------------------------------
// The pipelined products, for k a multiple of 8 (every model's): tiles stream through shared
// memory in STAGES asynchronous copies (cp.async) so the next tiles' loads overlap this one's
// products, and each lane takes its operands for two products with one 16-byte read.
//
// One arithmetic for every tiling: k is taken 32 at a time, in increasing order, each 32 through
// two m16n8k16 products. Lane (g, t) holds k 8t..8t+7 of its row and column: the first product
// takes k {8t, 8t+1, 8t+2, 8t+3} (t = 0..3) as its 16, the second the other 16 (the same
// assignment for x and W, so each product still pairs like with like). An output sits at
// fragment row r mod 16 and column c mod 8 in every tiling, so its bits never depend on m.
// (The fallback above takes k in another order: whether it runs is a property of k alone.)

// k in segments (a property of the weight's shape, from the host's gemm_segment, never of m):
// with few column tiles a decode's product is a few hundred blocks on a hundred-odd SMs, too few
// loads in flight to draw the memory's bandwidth, so k is cut into segments of `seg` values (a
// multiple of 128, so of every BK) each summed from zero, and an output is the segments' sums
// added in increasing order to zero: ((0 + s0) + s1) + ... (a single segment's sum is stored as
// it is, whichever tiling). Every tiling computes
// exactly that: the small one, for a few rows, runs a block per segment (grid z) and the last of
// a tile's blocks to finish adds their partial sums, read back from `part`, in order (SEG_SPLIT);
// the others, and the small one for more rows (grid z of 1), walk the segments in turn, folding
// each into a second set of accumulators (SEG_FOLD). SEG_NONE, the
// large tiling's two-blocks-an-SM form, takes one segment only (the host runs its SEG_FOLD twin
// otherwise: the second set does not fit its 128 registers).
#define SEG_SPLIT 0
#define SEG_FOLD 1
#define SEG_NONE 2

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes from global to shared memory, or 16 zero bytes (nothing read) when !valid.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// The 16-byte chunk c of tile row r sits at chunk swz(r, c): with 8 or more chunks a row, odd
// rows swap chunk halves (bit 2), so the 8 lanes of a quarter warp (rows g, g + 1, chunks t)
// read 8 different bank groups. Rows of 4 chunks need no swizzle (two rows fill the 8 groups).
template <int CPR>
__device__ __forceinline__ int swz(int r, int c) {
    return CPR >= 8 ? (c ^ ((r & 1) << 2)) : c;
}

// Rows r0 .. r0 + TR of a row-major matrix of `rows` × `k` (k a multiple of 8), columns
// k0 .. k0 + BK, into one shared buffer (swizzled), as 16-byte asynchronous copies; zeros
// outside the matrix.
template <int TR, int BK, int THREADS>
__device__ __forceinline__ void gemm_stage(bf16* dst, const bf16* __restrict__ src, int rows, int k,
                                           int r0, int k0) {
    constexpr int CPR = BK / 8;
#pragma unroll
    for (int v = threadIdx.x; v < TR * CPR; v += THREADS) {
        int r = v / CPR, c = v % CPR;
        int gr = r0 + r, gc = k0 + c * 8;
        bool ok = gr < rows && gc < k;
        cp_async16(&dst[r * BK + swz<CPR>(r, c) * 8], ok ? src + (i64)gr * k + gc : src, ok);
    }
}

// SEG_SPLIT's end: this block's partial sums (segment blockIdx.z) into part[z][m][n]; the last
// of the tile's gridDim.z blocks to finish (its counter, which it puts back to 0 for the next
// launch) adds the partials in segment order and stores the outputs.
template <int MI, int NI>
__device__ __forceinline__ void gemm_split_finish(const float (&acc)[MI][NI][4], void* out, int m,
                                                  int n, int r0, int c0, int f32_out,
                                                  float* __restrict__ part, unsigned* count) {
    const i64 plane = (i64)m * n;
    float* mine = part + blockIdx.z * plane;
    gemm_frags<MI, NI>(m, n, r0, c0,
                       [&](int i, int j, int e, i64 o) { __stcg(&mine[o], acc[i][j][e]); });
    // The partials visible device-wide before the count says they are there.
    __threadfence();
    __syncthreads();
    int last = 0;
    if (threadIdx.x == 0) {
        const unsigned tile = blockIdx.y * gridDim.x + blockIdx.x;
        last = atomicAdd(&count[tile], 1u) == gridDim.z - 1;
        if (last) count[tile] = 0;
    }
    // (No shared flag: the small tiling's buffers fill the 48 KiB a block holds statically.)
    if (!__syncthreads_or(last)) return;
    __threadfence();
    gemm_frags<MI, NI>(m, n, r0, c0, [&](int, int, int, i64 o) {
        // From zero, as the folding tilings' sum.
        float v = 0.0f;
        for (unsigned z = 0; z < gridDim.z; z++) v += __ldcg(&part[z * plane + o]);
        gemm_put(out, o, v, f32_out);
    });
}

// A block is WARPS_M × WARPS_N warps over a tile of BM = WARPS_M·MI·16 rows and
// BN = WARPS_N·NI·8 columns; k goes BK at a time through STAGES buffers. M_FAST puts the row
// tiles on grid x, so the blocks that share a tile of W run side by side (the second reads it
// from L2).
//
// The buffers, (BM + BN)·BK·2·STAGES bytes, are static shared memory up to 48 KiB, else
// dynamic: the host sets that as the kernel's allowance and passes it at launch (a launch with
// less traps rather than overrun).
template <int WARPS_M, int WARPS_N, int MI, int NI, int BK, int STAGES, bool M_FAST, int SEGS>
__device__ __forceinline__ void gemm_pipe(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          void* out, int m, int n, int k, int f32_out, int seg,
                                          float* __restrict__ part, unsigned* count) {
    constexpr int BM = WARPS_M * MI * 16;
    constexpr int BN = WARPS_N * NI * 8;
    constexpr int CPR = BK / 8;
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int SMEM = (BM + BN) * BK * 2 * STAGES;
    unsigned char* gemm_smem;
    if constexpr (SMEM <= 48 * 1024) {
        __shared__ __align__(16) unsigned char fixed[SMEM];
        gemm_smem = fixed;
    } else {
        extern __shared__ __align__(16) unsigned char dynamic_smem[];
        unsigned have;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
        if (have < (unsigned)SMEM) __trap();
        gemm_smem = dynamic_smem;
    }
    bf16 (*sa)[BM * BK] = (bf16 (*)[BM * BK])gemm_smem;
    bf16 (*sb)[BN * BK] = (bf16 (*)[BN * BK])(gemm_smem + STAGES * BM * BK * 2);
    const int mt = M_FAST ? blockIdx.x : blockIdx.y;
    const int nt = M_FAST ? blockIdx.y : blockIdx.x;
    const int m0 = mt * BM, n0 = nt * BN;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int g = lane >> 2, t = lane & 3;
    const int ktiles = (k + BK - 1) / BK;
    // Tiles a segment; one segment when seg >= k.
    if (seg < k && (seg <= 0 || seg % BK != 0)) __trap();
    const int lt = seg >= k ? ktiles : seg / BK;
    if (SEGS == SEG_NONE && lt < ktiles) __trap();
    // This block's tiles: a segment (SEG_SPLIT over grid z), else all, folding the segments
    // (SEG_SPLIT too where the grid has one z: the host's choice for more than a few rows).
    const bool split = SEGS == SEG_SPLIT && gridDim.z > 1;
    const bool walk = SEGS == SEG_FOLD || (SEGS == SEG_SPLIT && !split);
    // (A split's grid has a block per segment, no more: the partial sums read back are theirs.)
    if (split && (int)gridDim.z != (ktiles + lt - 1) / lt) __trap();
    const int kb = split ? (int)blockIdx.z * lt : 0;
    const int ke = split ? min(ktiles, kb + lt) : ktiles;

    auto load = [&](int stage, int kt) {
        gemm_stage<BM, BK, THREADS>(sa[stage], x, m, k, m0, kt * BK);
        gemm_stage<BN, BK, THREADS>(sb[stage], w, n, k, n0, kt * BK);
    };

    // The accumulators, and the sums of the segments done (from zero, as the split's
    // reduction; never read, so compiled away, where SEG_NONE takes k whole).
    float acc[MI][NI][4], tot[MI][NI][4];
    gemm_each<MI, NI>([&](int i, int j, int e) { acc[i][j][e] = tot[i][j][e] = 0.0f; });
    auto fold = [&]() {
        gemm_each<MI, NI>([&](int i, int j, int e) {
            tot[i][j][e] += acc[i][j][e];
            acc[i][j][e] = 0.0f;
        });
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (kb + s < ke) load(s, kb + s);
        cp_async_commit();
    }
    for (int kt = kb; kt < ke; kt++) {
        if constexpr (SEGS != SEG_NONE) {
            if (walk && kt > 0 && kt % lt == 0) fold();
        }
        // Tile kt has landed (at most STAGES - 2 later groups still in flight), and every warp
        // is done with the buffer the next load overwrites (the one read in step kt - 1).
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        {
            int next = kt + STAGES - 1;
            if (next < ke) load((next - kb) % STAGES, next);
            cp_async_commit();
        }
        const bf16* A = sa[(kt - kb) % STAGES];
        const bf16* B = sb[(kt - kb) % STAGES];
#pragma unroll
        for (int j = 0; j < BK / 32; j++) {
            const int c = 4 * j + t;
            // All of the warp's row fragments, then one column fragment at a time (fewer
            // registers; each accumulator still takes its two products in order).
            uint4 af[MI][2];
#pragma unroll
            for (int i = 0; i < MI; i++) {
                int r = wm * MI * 16 + i * 16 + g;
                af[i][0] = *(const uint4*)&A[r * BK + swz<CPR>(r, c) * 8];
                af[i][1] = *(const uint4*)&A[(r + 8) * BK + swz<CPR>(r + 8, c) * 8];
            }
#pragma unroll
            for (int jn = 0; jn < NI; jn++) {
                int r = wn * NI * 8 + jn * 8 + g;
                const uint4 bfr = *(const uint4*)&B[r * BK + swz<CPR>(r, c) * 8];
                const unsigned b0[2] = {bfr.x, bfr.y};
                const unsigned b1[2] = {bfr.z, bfr.w};
#pragma unroll
                for (int i = 0; i < MI; i++) {
                    const unsigned a0[4] = {af[i][0].x, af[i][1].x, af[i][0].y, af[i][1].y};
                    mma_bf16_16816(acc[i][jn], a0, b0);
                    const unsigned a1[4] = {af[i][0].z, af[i][1].z, af[i][0].w, af[i][1].w};
                    mma_bf16_16816(acc[i][jn], a1, b1);
                }
            }
        }
    }
    const int r0 = m0 + wm * MI * 16, c0 = n0 + wn * NI * 8;
    if constexpr (SEGS == SEG_NONE) {
        gemm_store<MI, NI>(acc, out, m, n, r0, c0, f32_out);
    } else {
        if (lt >= ktiles) {
            // One segment: its sum as it is (0 + x would turn a -0 into +0), as SEG_NONE's.
            gemm_store<MI, NI>(acc, out, m, n, r0, c0, f32_out);
        } else if (split) {
            gemm_split_finish<MI, NI>(acc, out, m, n, r0, c0, f32_out, part, count);
        } else {
            fold();
            gemm_store<MI, NI>(tot, out, m, n, r0, c0, f32_out);
        }
    }
}

// The tilings, each with its shared memory in bytes (the host's GEMM_PIPES lists the same).
// Up to 64 rows (decode: the weights streamed once, the rows riding along): tiles of 16 × 32
// (a warp per 8 columns), k 128 at a time through 4 buffers (48 KiB), 128 threads, grid
// (m / 16, n / 32) rounded up. (Measured on an H100: 8 buffers, or 64-row tiles above 16 rows,
// at 96 KiB a block, were slower: fewer blocks an SM. On an H200, 8 buffers only where the
// weight has few column tiles, one block an SM, were slower too: 1×4096×4096 in 34.1 µs
// against 29.3, 1×4096×14336 in 90.4 against 77.5. And on the H200, 2026-12-04: tiles of 16 × 16
// for up to 16 rows, 64 threads and 6 buffers, twice the blocks, were slower at every shape:
// 1×4096×4096 in 33.8 µs against 29.5, 1×6144×4096 38.4 against 34.8, 1×4096×14336 84.9 against
// 78.8, 1×28672×4096 125.3 against 72.1.)
// k in segments, a block each (grid (m / 16, n / 32, segments)) for up to GEMM_SPLIT_MAX_ROWS
// rows, on the H200 (2026-12-04, 4 segments for o and down, in the segments' first form, the
// split then taken up to 64 rows): 1×4096×4096 in 21.3 µs against 30.8, 1×4096×14336 43.2
// against 78.9, 1×6144×4096 (3 segments; k whole now, see GEMM_SEG_FEWEST) 33.1 against 35.3;
// a Llama-3-8B decode step of 1 row 7.49 ms against 8.85, of 16 rows 8.16 against 9.33. The
// split for 64 rows was slower (a step 23.07 ms against 21.82: the partial sums' traffic grows
// with the rows), hence the walk above 16 rows.
extern "C" __global__ void __launch_bounds__(128)
    gemm_pipe_small(const bf16* x, const bf16* w, void* out, int m, int n, int k, int f32_out,
                    int seg, float* part, unsigned* count) {
    gemm_pipe<1, 4, 1, 1, 128, 4, true, SEG_SPLIT>(x, w, out, m, n, k, f32_out, seg, part, count);
}

// Up to 128 rows: tiles of 64 × 64 (warps 2 × 2 of 32 × 32), k 64 at a time through 4 buffers
// (64 KiB), 128 threads, grid (n / 64, m / 64) rounded up.
extern "C" __global__ void __launch_bounds__(128)
    gemm_pipe_mid(const bf16* x, const bf16* w, void* out, int m, int n, int k, int f32_out,
                    int seg, float* part, unsigned* count) {
    gemm_pipe<2, 2, 2, 4, 64, 4, false, SEG_FOLD>(x, w, out, m, n, k, f32_out, seg, part, count);
}

// More (prefill): tiles of 128 × 128 (warps 2 × 4 of 64 × 32), k 64 at a time through 3 buffers
// (96 KiB), 256 threads (two blocks an SM: at most 128 registers a thread), grid (n / 128,
// m / 128) rounded up.
extern "C" __global__ void __launch_bounds__(256, 2)
    gemm_pipe_large(const bf16* x, const bf16* w, void* out, int m, int n, int k, int f32_out,
                    int seg, float* part, unsigned* count) {
    gemm_pipe<2, 4, 4, 4, 64, 3, false, SEG_NONE>(x, w, out, m, n, k, f32_out, seg, part, count);
}

// The large tiling for k in more than one segment: its second set of accumulators wants more
// than 128 registers a thread (200), so one block an SM. (Its first form, 255 registers and
// spilling, made a 2048-token prefill 6% slower than one segment did, 5 444 tok/s against
// 5 772, a 256-row decode step's products 7%, 29.74 ms against 27.77, and the 8192³ product
// 26%, 167 TFLOP/s against 226, then in 2 segments.)
extern "C" __global__ void __launch_bounds__(256, 1)
    gemm_pipe_large_seg(const bf16* x, const bf16* w, void* out, int m, int n, int k, int f32_out,
                        int seg, float* part, unsigned* count) {
    gemm_pipe<2, 4, 4, 4, 64, 3, false, SEG_FOLD>(x, w, out, m, n, k, f32_out, seg, part, count);
}

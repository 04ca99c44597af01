// A matrix product on Hopper tensor cores (sm_90a) whose epilogue the
// caller writes: D = op(A) op(B) with 16-bit operands and f32
// accumulators, each finished row chunk handed to `Epi`, so that what
// cuBLASLt cannot fuse (an exact, erf-based GELU and its gradient, a
// dropout, a generated elementwise chain) runs while the tile is still in
// registers instead of as a kernel of its own over the whole output.
//
// op(A) is [M, K] and op(B) [K, N]. A_MN / B_MN say how each is stored:
// K-major (A stored [M, K], B stored [N, K]: K contiguous) or MN-major (A
// stored [K, M], B stored [K, N]: M or N contiguous); wgmma reads either
// layout of a 16-bit operand from shared memory. Each operand comes in
// through a tensor map of 4 dimensions, innermost first (contiguous
// axis, 1, the other axis, 1), boxes of 64 elements (128-byte swizzle) by
// the tile's rows, as the attention kernels' (emit/flash/tma.rs).
//
// A block is one producer warpgroup (one thread issues the bulk tensor
// copies) and two consumer warpgroups, each computing 64 rows of the
// block's BM x BN tile with m64nBNk16 products. The launch is persistent:
// grid = min(tiles, multiprocessors), block x taking tiles x, x + grid,
// ..., in groups of GROUP_M row tiles (tile_of) so that the B columns of a
// group stay in L2 while its A rows stream. STAGES buffers of A and B
// k-slices (BK = 64) let the producer run ahead, into the next tile too.
//
// The epilogue: each consumer warp stages its 16 accumulator rows through
// shared memory 32 columns at a time (f32, padded rows), and each lane then
// holds 8 consecutive columns of one row, which Epi::apply takes as
// `v[8]` with the row and first column (columns past N or rows past M are
// never handed over; N must be a multiple of 8). Epi stores them (16 bytes
// of a 16-bit output), adding whatever it reads beside (a bias, an
// auxiliary tensor) with the same 16-byte accesses.
//
// Launch: grid (min(tiles, multiprocessors), 1, 1), THREADS threads,
// SMEM_BYTES of dynamic shared memory; after the kernel's other arguments
// the tensor maps of A and B by value.
#ifndef FS_GEMM_SM90
#define FS_GEMM_SM90
#include "../attention/sm90.cuh"

namespace fs_gemm {

using fs_attn::regs_left;
using fs_attn::SwizzledTile;

// The product's sizes (each below 2^31).
struct Sizes {
    int m, n, k;
};

template <bool C, class T, class F>
struct pick {
    typedef T type;
};
template <class T, class F>
struct pick<false, T, F> {
    typedef F type;
};

// Tile t's row and column tile: groups of GROUP_M row tiles, column by
// column within a group, so that consecutive tiles (on the GPU at one time)
// share B's columns and a few A row tiles.
__host__ __device__ inline void tile_of(int t, int tiles_m, int tiles_n, int& tm, int& tn) {
    constexpr int GROUP_M = 8;
    const int per_group = GROUP_M * tiles_n, g = t / per_group, first = g * GROUP_M;
    const int rows = tiles_m - first < GROUP_M ? tiles_m - first : GROUP_M;
    const int r = t - g * per_group;
    tm = first + r % rows;
    tn = r / rows;
}

template <class E, int BN, bool A_MN, bool B_MN, class Epi>
struct GemmSm90 {
    static constexpr int BM = 128, BK = 64, WGS = 2;
    static_assert(BN % 64 == 0 && BN <= 256, "column tiles of 64 to 256");
    static constexpr int CONSUMERS = 128 * WGS, PRODUCERS = 128, THREADS = CONSUMERS + PRODUCERS;
    static constexpr unsigned PRODUCER_REGS = 40, CONSUMER_REGS = regs_left(THREADS, PRODUCERS, PRODUCER_REGS);
    // A k-slice of A and of B as the copies land them: K-major [rows][BK],
    // MN-major [BK][rows], 64-element boxes, 128-byte swizzle.
    typedef typename pick<A_MN, SwizzledTile<BK, BM>, SwizzledTile<BM, BK>>::type AT;
    typedef typename pick<B_MN, SwizzledTile<BK, BN>, SwizzledTile<BN, BK>>::type BT;
    static constexpr unsigned STAGE_BYTES = AT::BYTES + BT::BYTES;
    // The epilogue's staging: a warp's 16 rows by 32 columns of f32, rows
    // 40 floats apart (two rows 8 apart fall 64 banks apart: the float2
    // stores of a warp's 8 rows by 4 lanes take the two wavefronts their 256
    // bytes need).
    static constexpr int CHUNK = 32, PITCH = 40;
    static constexpr unsigned EPI_BYTES = CONSUMERS / 32 * 16 * PITCH * 4;
    static constexpr int STAGES_FIT = (int)((227u * 1024 - EPI_BYTES - 1024 - 256) / STAGE_BYTES);
    static constexpr int STAGES = STAGES_FIT > 6 ? 6 : STAGES_FIT;
    static_assert(STAGES >= 2, "two k-slices in flight");
    static constexpr unsigned SMEM_BYTES = STAGES * STAGE_BYTES + EPI_BYTES + 2 * STAGES * 8 + 1024;
    static_assert(AT::BYTES % 1024 == 0 && BT::BYTES % 1024 == 0, "swizzled tiles start 1024-byte aligned");

    // The producer (one thread): k-slice n of the block into buffer
    // n % STAGES once the consumers are done with slice n - STAGES.
    static __device__ __noinline__ void produce(Sizes s, const fs_tmap& tm_a, const fs_tmap& tm_b, unsigned char* tiles,
                                                fs_mbar* full) {
        fs_mbar* const empty = full + STAGES;
        const int tiles_m = (s.m + BM - 1) / BM, tiles_n = (s.n + BN - 1) / BN, kb = (s.k + BK - 1) / BK;
        int buf = 0;
        unsigned phase = 0;
        bool reused = false;
        for (int t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {
            int tm, tn;
            tile_of(t, tiles_m, tiles_n, tm, tn);
            const int m0 = tm * BM, n0 = tn * BN;
            for (int x = 0; x < kb; ++x) {
                const int k0 = x * BK;
                if (reused) fs_mbar_wait(&empty[buf], phase ^ 1);
                fs_mbar_expect_tx(&full[buf], STAGE_BYTES);
                unsigned char* const a = tiles + buf * STAGE_BYTES;
                unsigned char* const b = a + AT::BYTES;
                if constexpr (A_MN) {
#pragma unroll
                    for (int i = 0; i < BM / AT::ATOM; ++i) fs_tma_load(a + i * AT::BOX, tm_a, m0 + i * AT::ATOM, 0, k0, 0, &full[buf]);
                } else {
                    fs_tma_load(a, tm_a, k0, 0, m0, 0, &full[buf]);
                }
                if constexpr (B_MN) {
#pragma unroll
                    for (int i = 0; i < BN / BT::ATOM; ++i) fs_tma_load(b + i * BT::BOX, tm_b, n0 + i * BT::ATOM, 0, k0, 0, &full[buf]);
                } else {
                    fs_tma_load(b, tm_b, k0, 0, n0, 0, &full[buf]);
                }
                fs_mbar_tma_issued(&full[buf]);
                if (++buf == STAGES) buf = 0, phase ^= 1, reused = true;
            }
        }
    }

    template <class P>
    static __device__ __forceinline__ void run(const P& p, Sizes s, const fs_tmap& tm_a, const fs_tmap& tm_b) {
        FS_DYNAMIC_SMEM(smem_raw, SMEM_BYTES);
        unsigned char* const smem = fs_align1024(smem_raw);
        unsigned char* const tiles = smem;  // STAGES x (A slice, B slice)
        float* const staging = reinterpret_cast<float*>(smem + STAGES * STAGE_BYTES);
        // full[s] completes when slice s's copies have landed, empty[s] when
        // every consumer warp is done reading it.
        fs_mbar* const full = reinterpret_cast<fs_mbar*>(smem + STAGES * STAGE_BYTES + EPI_BYTES);
        fs_mbar* const empty = full + STAGES;
        if (threadIdx.x == 0) {
            for (int i = 0; i < STAGES; ++i) fs_mbar_init(&full[i], 1), fs_mbar_init(&empty[i], CONSUMERS / 32);
        }
        __syncthreads();
        if (threadIdx.x >= CONSUMERS) {
            fs_setmaxnreg_dec<PRODUCER_REGS>();
            if (threadIdx.x == CONSUMERS) produce(s, tm_a, tm_b, tiles, full);
            return;
        }
        fs_setmaxnreg_inc<CONSUMER_REGS>();
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wg = warp >> 2;
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        float* const stage = staging + warp * 16 * PITCH;  // this warp's rows
        const int tiles_m = (s.m + BM - 1) / BM, tiles_n = (s.n + BN - 1) / BN, kb = (s.k + BK - 1) / BK;
        const fs_desc a0 = A_MN ? AT::mnmajor(tiles) : AT::kmajor(tiles);
        const fs_desc b0 = B_MN ? BT::mnmajor(tiles + AT::BYTES) : BT::kmajor(tiles + AT::BYTES);
        // This warpgroup's 64 rows of an A slice.
        const unsigned a_rows = A_MN ? AT::mnmajor_n(wg * 64) : AT::kmajor_n(wg * 64);
        int buf = 0;
        unsigned phase = 0;
        // acc[j][e]: row 16 warp' + frag_row + 8 (e / 2) of the warpgroup's
        // 64 (warp' = warp % 4), column 8j + frag_col + e % 2.
        float acc[BN / 8][4];
        for (int t = blockIdx.x; t < tiles_m * tiles_n; t += gridDim.x) {
            int tm, tn;
            tile_of(t, tiles_m, tiles_n, tm, tn);
            int last = 0;
            for (int x = 0; x < kb; ++x) {
                fs_mbar_wait(&full[buf], phase);
                const unsigned at = buf * STAGE_BYTES;
                fs_wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    const fs_desc a = fs_desc_at(a0, at + a_rows + (A_MN ? AT::mn_k_step(kk) : AT::k_step(kk)));
                    const fs_desc b = fs_desc_at(b0, at + (B_MN ? BT::mn_k_step(kk) : BT::k_step(kk)));
                    fs_attn::wgmma_ss<E, BT, B_MN, BN, A_MN>(acc, a, b, x > 0 || kk > 0);
                }
                fs_wgmma_commit();
                // The slice before this one is read once only this one's
                // products may still run: hand its buffer back.
                if (x > 0) {
                    fs_wgmma_wait_all_but_1();
                    fs_syncwarp();
                    if (lane == 0) fs_mbar_arrive(&empty[last]);
                }
                last = buf;
                if (++buf == STAGES) buf = 0, phase ^= 1;
            }
            fs_wgmma_wait_all();
            fs_wgmma_hold(acc);
            fs_syncwarp();
            if (lane == 0) fs_mbar_arrive(&empty[last]);

            // The epilogue, 32 columns at a time through the warp's staging rows.
            const fs_i64 row0 = (fs_i64)tm * BM + wg * 64 + (warp & 3) * 16;
            const int n0 = tn * BN;
#pragma unroll
            for (int c = 0; c < BN / CHUNK; ++c) {
                if (n0 + c * CHUNK >= s.n) break;
#pragma unroll
                for (int j = 0; j < CHUNK / 8; ++j) {
                    const int col = j * 8 + frag_col;
                    fs_st_f32x2(&stage[frag_row * PITCH + col], acc[c * 4 + j][0], acc[c * 4 + j][1]);
                    fs_st_f32x2(&stage[(frag_row + 8) * PITCH + col], acc[c * 4 + j][2], acc[c * 4 + j][3]);
                }
                fs_syncwarp();
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = h * 8 + (lane >> 2), col = (lane & 3) * 8;
                    const fs_i64 row = row0 + r;
                    const int n = n0 + c * CHUNK + col;
                    float v[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) v[e] = stage[r * PITCH + col + e];
                    if (row < s.m && n < s.n) Epi::apply(p, row, n, v);
                }
                fs_syncwarp();
            }
        }
    }
};

}  // namespace fs_gemm

#endif

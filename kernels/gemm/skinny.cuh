// fusec skinny GEMM: D[m, n] = A[m, k] B[k, n] for products of few rows
// (a decode step's one new token a batch row: m = B x T of 32 or fewer),
// with the epilogues cuBLASLt would apply (a bias, a residual added, GELU
// with its pre-activation stored beside it). At such m a product reads its
// weights once and does little else, so it is bound by how fast B streams
// in: cuBLASLt's tiled kernels ran gpt2-small's decode products at 50 to
// 200 GB/s on an H100. Here each block takes a tile of columns and a run
// of K (a split), its threads keep several 16-byte loads of B in flight,
// and every row of the tile is multiplied as B passes (A staged in shared
// memory in chunks of KC, as f32).
//
// Two forms, by how B is stored:
// - KN (B stored [K, N], N contiguous): LANES lanes across the tile's
//   columns, V = 16 bytes of columns each (BN = LANES * V columns a tile),
//   the block's other threads taking every slices-th row of the run; the
//   slices' sums are added in shared memory in slice order.
// - NK (B stored [N, K], K contiguous: a tied embedding read transposed):
//   groups of LANES lanes along K, each group CPT columns at once (a tile
//   is NK_COLS columns), the lanes' sums added in shared memory in lane
//   order.
// A tile's splits write f32 partials (`part`, splits x m x n); the last
// split of a tile to finish (counted in done[tile], zero before the first
// launch and put back to zero by that last split, so a replayed graph
// starts from zero) adds them in split order and applies the epilogue.
// With one split the epilogue follows the block's own sums. Deterministic:
// every sum is added in a fixed order; the atomic only counts.
//
// Rows past ROWS run as further passes over the tile (its B from L1 or
// L2). Templates: EI the element type of A and B, EO of D and the
// epilogue's tensors (fs_el::Bf16, F16, F32); VEC: B's rows and base are
// 16-byte aligned (else one element a load). The work items (tile, split)
// are walked grid-stride and the lanes and columns thread-stride, so any
// grid and any block of a power of two up to THREADS threads computes the
// same values (the host tests' one thread too); the wrapper launches
// tiles x SPLITS blocks of THREADS.
//
// Needs the prelude (fusec_prelude.cuh: fs_i64, fs_vload, fs_gelu, fs_ldcg,
// fs_last_to_finish) before it.
#ifndef FS_GEMM_SKINNY
#define FS_GEMM_SKINNY

#include "../elements.cuh"

namespace fs_skinny {

// Threads a block (a power of two), the most any form is written for.
constexpr int THREADS = 256;
// Lanes across a KN tile, or along K in an NK group: a warp on the GPU.
constexpr int LANES = 32;
// Elements of K staged from A at a time.
constexpr int KC = 128;
// Rows of B a KN thread loads before it uses them.
constexpr int KN_UNROLL = 4;
// Columns of an NK tile, and columns an NK thread takes at once.
constexpr int NK_COLS = 16;
constexpr int CPT = 2;
// Loads of each column's B an NK thread issues before it uses them.
constexpr int NK_UNROLL = 4;

// The product and what its epilogue reads and writes. Leading dimensions
// in elements; bias, resid and aux are null where the epilogue has none.
template <class EI, class EO>
struct Problem {
    const typename EI::Storage* a;
    fs_i64 lda;
    const typename EI::Storage* b;
    fs_i64 ldb;
    const typename EO::Storage* bias;
    const typename EO::Storage* resid;
    fs_i64 ldr;
    typename EO::Storage* d;
    fs_i64 ldd;
    typename EO::Storage* aux;
    fs_i64 ldx;
    fs_i64 m, n, k;
    // f32 partials, splits x m x n (unused with one split).
    float* part;
    // A count of finished splits a tile (unused with one split).
    unsigned* done;
};

// Elements in a 16-byte load of B, or one.
template <class E, bool VEC>
struct Width {
    static constexpr int V = VEC ? (int)(16 / sizeof(typename E::Storage)) : 1;
};

// Element (m, n) of D from its product: the bias and residual added in
// f32 and rounded once, as cuBLASLt's epilogue; under GELU the biased
// product is stored in aux and D is its GELU.
template <class EI, class EO, bool BIAS, bool RESID, bool GELU>
__device__ __forceinline__ void finish(const Problem<EI, EO>& p, float v, fs_i64 m, fs_i64 n) {
    if (BIAS) v += EO::load(&p.bias[n]);
    if (RESID) v += EO::load(&p.resid[m * p.ldr + n]);
    if (GELU) {
        p.aux[m * p.ldx + n] = EO::store(v);
        v = fs_gelu(v);
    }
    p.d[m * p.ldd + n] = EO::store(v);
}

// A tile's sum of one row and column: its output with one split, else its
// split's partial.
template <class EI, class EO, int SPLITS, bool BIAS, bool RESID, bool GELU>
__device__ __forceinline__ void put(const Problem<EI, EO>& p, float s, int split, fs_i64 m, fs_i64 n) {
    if (SPLITS == 1)
        finish<EI, EO, BIAS, RESID, GELU>(p, s, m, n);
    else
        p.part[((fs_i64)split * p.m + m) * p.n + n] = s;
}

// Where several splits share tile `tile` of `width` columns: the last to
// finish adds the partials in split order and finishes the tile's outputs,
// then puts the tile's count back to zero.
template <class EI, class EO, int SPLITS, bool BIAS, bool RESID, bool GELU>
__device__ __forceinline__ void join_splits(const Problem<EI, EO>& p, fs_i64 tile, int width) {
    if (SPLITS == 1 || !fs_last_to_finish(&p.done[tile], SPLITS)) return;
    for (fs_i64 o = threadIdx.x; o < p.m * width; o += blockDim.x) {
        const fs_i64 m = o / width, n = tile * width + o % width;
        if (n >= p.n) continue;
        float s = 0.0f;
        for (int sp = 0; sp < SPLITS; ++sp) s += fs_ldcg(&p.part[((fs_i64)sp * p.m + m) * p.n + n]);
        finish<EI, EO, BIAS, RESID, GELU>(p, s, m, n);
    }
    if (threadIdx.x == 0) p.done[tile] = 0u;
}

// Rows r0 .. r0 + ROWS of A, columns c0 .. c1, into a_s[r * KC + (k - c0)]
// as f32 (zeros for rows past m). The caller synchronises around it.
template <class EI, class EO, int ROWS>
__device__ __forceinline__ void stage_a(const Problem<EI, EO>& p, float* a_s, fs_i64 r0, fs_i64 c0, fs_i64 c1) {
    const int len = (int)(c1 - c0);
    for (int o = threadIdx.x; o < ROWS * len; o += blockDim.x) {
        const int r = o / len, kk = o % len;
        a_s[r * KC + kk] = r0 + r < p.m ? EI::load(&p.a[(r0 + r) * p.lda + c0 + kk]) : 0.0f;
    }
}

// Elements n .. n + V of row `row` of B (zeros past `end`), as stored.
template <class EI, int V, bool VEC>
__device__ __forceinline__ void load_b(typename EI::Storage (&v)[V], const typename EI::Storage* row, fs_i64 n, fs_i64 end) {
    if (VEC && n + V <= end) {
        fs_vload<typename EI::Storage, V>(v, row + n);
    } else {
#pragma unroll
        for (int c = 0; c < V; ++c) v[c] = n + c < end ? row[n + c] : EI::store(0.0f);
    }
}

// The KN form (B stored [K, N]).
template <class EI, class EO, int ROWS, int SPLITS, bool VEC, bool BIAS, bool RESID, bool GELU>
__device__ __forceinline__ void kn(const Problem<EI, EO>& p) {
    typedef typename EI::Storage TI;
    constexpr int V = Width<EI, VEC>::V, BN = LANES * V;
    // The slices' sums go through shared memory RR rows at a time.
    constexpr int RR = ROWS < 4 ? ROWS : 4;
    __shared__ float a_s[ROWS * KC];
    __shared__ float red[THREADS * RR * V];
    const int step = (int)blockDim.x < LANES ? (int)blockDim.x : LANES;
    const int slices = (int)blockDim.x / step, slice = (int)threadIdx.x / step;
    const fs_i64 tiles = (p.n + BN - 1) / BN;
    for (fs_i64 w = blockIdx.x; w < tiles * SPLITS; w += gridDim.x) {
        const fs_i64 tile = w / SPLITS;
        const int split = (int)(w % SPLITS);
        const fs_i64 k0 = split * p.k / SPLITS, k1 = (split + 1) * p.k / SPLITS;
        for (fs_i64 r0 = 0; r0 < p.m; r0 += ROWS) {
            // With fewer threads than lanes, each takes its lanes in turns.
            for (int l0 = 0; l0 < LANES; l0 += step) {
                const int lane = l0 + (int)threadIdx.x % step;
                const fs_i64 n0 = tile * BN + (fs_i64)lane * V;
                float acc[ROWS][V];
#pragma unroll
                for (int r = 0; r < ROWS; ++r)
#pragma unroll
                    for (int c = 0; c < V; ++c) acc[r][c] = 0.0f;
                for (fs_i64 c0 = k0; c0 < k1; c0 += KC) {
                    const fs_i64 c1 = c0 + KC < k1 ? c0 + KC : k1;
                    __syncthreads();  // the last chunk's readers are done
                    stage_a<EI, EO, ROWS>(p, a_s, r0, c0, c1);
                    __syncthreads();
                    for (fs_i64 kk = c0 + slice; kk < c1; kk += (fs_i64)KN_UNROLL * slices) {
                        TI bv[KN_UNROLL][V];
#pragma unroll
                        for (int u = 0; u < KN_UNROLL; ++u) {
                            const fs_i64 k = kk + (fs_i64)u * slices;
                            if (k < c1) load_b<EI, V, VEC>(bv[u], p.b + k * p.ldb, n0, p.n);
                        }
#pragma unroll
                        for (int u = 0; u < KN_UNROLL; ++u) {
                            const fs_i64 k = kk + (fs_i64)u * slices;
                            if (k >= c1) break;
                            const float* a_k = a_s + (k - c0);
#pragma unroll
                            for (int r = 0; r < ROWS; ++r) {
                                const float x = a_k[r * KC];
#pragma unroll
                                for (int c = 0; c < V; ++c) acc[r][c] += x * EI::load(&bv[u][c]);
                            }
                        }
                    }
                }
                const int width = step * V;
#pragma unroll
                for (int rr = 0; rr < ROWS; rr += RR) {
                    __syncthreads();  // the last round's readers are done
#pragma unroll
                    for (int r = 0; r < RR; ++r)
#pragma unroll
                        for (int c = 0; c < V; ++c) red[(slice * RR + r) * width + (lane - l0) * V + c] = acc[rr + r][c];
                    __syncthreads();
                    for (int o = threadIdx.x; o < RR * width; o += blockDim.x) {
                        const int r = o / width, col = o % width;
                        float s = 0.0f;
                        for (int sl = 0; sl < slices; ++sl) s += red[(sl * RR + r) * width + col];
                        const fs_i64 m = r0 + rr + r, n = tile * BN + (fs_i64)l0 * V + col;
                        if (m < p.m && n < p.n) put<EI, EO, SPLITS, BIAS, RESID, GELU>(p, s, split, m, n);
                    }
                }
            }
        }
        join_splits<EI, EO, SPLITS, BIAS, RESID, GELU>(p, tile, BN);
        __syncthreads();  // the next item's first chunk waits for this one's readers
    }
}

// The NK form (B stored [N, K], read transposed).
template <class EI, class EO, int ROWS, int SPLITS, bool VEC, bool BIAS, bool RESID, bool GELU>
__device__ __forceinline__ void nk(const Problem<EI, EO>& p) {
    typedef typename EI::Storage TI;
    constexpr int V = Width<EI, VEC>::V;
    __shared__ float a_s[ROWS * KC];
    __shared__ float red[THREADS * CPT * ROWS];
    const int lanes = (int)blockDim.x < LANES ? (int)blockDim.x : LANES;
    const int groups = (int)blockDim.x / lanes, group = (int)threadIdx.x / lanes, lane = (int)threadIdx.x % lanes;
    const fs_i64 tiles = (p.n + NK_COLS - 1) / NK_COLS;
    // Splits of K in whole loads, so every load but the last is aligned.
    const fs_i64 units = (p.k + V - 1) / V;
    for (fs_i64 w = blockIdx.x; w < tiles * SPLITS; w += gridDim.x) {
        const fs_i64 tile = w / SPLITS;
        const int split = (int)(w % SPLITS);
        const fs_i64 k0 = split * units / SPLITS * V;
        const fs_i64 k1_units = (split + 1) * units / SPLITS * V;
        const fs_i64 k1 = k1_units < p.k ? k1_units : p.k;
        for (fs_i64 r0 = 0; r0 < p.m; r0 += ROWS) {
            // The same number of turns for every group (groups * CPT
            // divides NK_COLS), so the barriers below are met by all.
            for (int turn = 0; turn * groups * CPT < NK_COLS; ++turn) {
                const int first = (turn * groups + group) * CPT;
                float acc[CPT][ROWS];
#pragma unroll
                for (int j = 0; j < CPT; ++j)
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[j][r] = 0.0f;
                for (fs_i64 c0 = k0; c0 < k1; c0 += KC) {
                    const fs_i64 c1 = c0 + KC < k1 ? c0 + KC : k1;
                    __syncthreads();
                    stage_a<EI, EO, ROWS>(p, a_s, r0, c0, c1);
                    __syncthreads();
                    for (fs_i64 kk = c0 + (fs_i64)lane * V; kk < c1; kk += (fs_i64)NK_UNROLL * lanes * V) {
                        TI bv[CPT][NK_UNROLL][V];
#pragma unroll
                        for (int j = 0; j < CPT; ++j) {
                            const fs_i64 n = tile * NK_COLS + first + j;
#pragma unroll
                            for (int u = 0; u < NK_UNROLL; ++u) {
                                const fs_i64 k = kk + (fs_i64)u * lanes * V;
                                if (k < c1) {
                                    if (n < p.n)
                                        load_b<EI, V, VEC>(bv[j][u], p.b + n * p.ldb, k, c1);
                                    else
#pragma unroll
                                        for (int c = 0; c < V; ++c) bv[j][u][c] = EI::store(0.0f);
                                }
                            }
                        }
#pragma unroll
                        for (int u = 0; u < NK_UNROLL; ++u) {
                            const fs_i64 k = kk + (fs_i64)u * lanes * V;
                            if (k >= c1) break;
                            const float* a_k = a_s + (k - c0);
#pragma unroll
                            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                                for (int c = 0; c < V; ++c) {
                                    // Past c1 (K's end), B's zeros meet A's next chunk.
                                    const float x = k + c < c1 ? a_k[r * KC + c] : 0.0f;
#pragma unroll
                                    for (int j = 0; j < CPT; ++j) acc[j][r] += x * EI::load(&bv[j][u][c]);
                                }
                        }
                    }
                }
                __syncthreads();  // the last turn's readers are done with red
#pragma unroll
                for (int j = 0; j < CPT; ++j)
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) red[((group * CPT + j) * ROWS + r) * lanes + lane] = acc[j][r];
                __syncthreads();
                for (int o = threadIdx.x; o < groups * CPT * ROWS; o += blockDim.x) {
                    const int gj = o / ROWS, r = o % ROWS;
                    float s = 0.0f;
                    for (int l = 0; l < lanes; ++l) s += red[(gj * ROWS + r) * lanes + l];
                    const fs_i64 m = r0 + r, n = tile * NK_COLS + (fs_i64)turn * groups * CPT + gj;
                    if (m < p.m && n < p.n) put<EI, EO, SPLITS, BIAS, RESID, GELU>(p, s, split, m, n);
                }
            }
        }
        join_splits<EI, EO, SPLITS, BIAS, RESID, GELU>(p, tile, NK_COLS);
        __syncthreads();
    }
}

}  // namespace fs_skinny

#endif

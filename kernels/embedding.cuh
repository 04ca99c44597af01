// fusec embedding backward: the gradient of a [V, C] table from the
// gradients of the rows its tokens picked,
//
//     dW[v] = sum of dY[t] over the tokens t whose id is v,
//
// deterministic (no float atomics: every sum is added in token order); and
// the forward, a gather (`fs_embedding_lookup`, a thread an element).
//
// Work item (group, run): a group of R table rows, their sums in shared
// memory, over one of S runs of the tokens. The block scans its run's ids
// four a thread at a time, a block scan turns the hits into places in a
// shared list in token order, and every thread adds the listed tokens'
// gradient rows to the columns it owns. A table of many rows (a vocabulary)
// has groups enough to fill the GPU, and S = 1: each group's block writes
// its rows. A table of few rows (token types, a small position table) has
// few groups, so the tokens are cut into S runs, each run's sums go to f32
// partials (`part`, S x V x C), and the last run of a group to finish
// (counted with an atomic in `done`, one a group, zero before the first
// launch; the last run resets it, so a graph replay starts from zero) adds
// them in run order. One scan of the ids per group, where a block a row
// would scan them once a row.
//
// D and W are element types (fs_el::Bf16, F16 or F32) of dY and dW; Id is
// the ids' integer type. An id outside [0, V) adds to no row. Blocks of at
// most 256 threads (the list holds four ids a thread). Needs the prelude
// (fusec_prelude.cuh: fs_i64, fs_block_scan, fs_last_to_finish) and elements.cuh before it.
#ifndef FS_EMBEDDING
#define FS_EMBEDDING

#include "elements.cuh"

// The floats of one group's sums in shared memory (40 KiB: with the 4 KiB
// list, under the 48 KiB a block may declare statically); the compiler's
// emit::embedding_grad::SUMS_FLOATS.
#define FS_EMBEDDING_SUMS 10240

template <class D, class W, fs_i64 V, fs_i64 C, int R, int S, class Id>
__device__ __forceinline__ void fs_embedding_grad(const Id* ids, const typename D::Storage* dy,
                                                  typename W::Storage* dw, fs_i64 tokens, float* part,
                                                  unsigned* done) {
    static_assert(R >= 1 && C >= 1 && R * C <= FS_EMBEDDING_SUMS, "a group's sums must fit in shared memory");
    static_assert(S >= 1, "at least one run of the tokens");
    constexpr fs_i64 groups = (V + R - 1) / R;
    __shared__ float acc[R * C];
    __shared__ int list[1024];
    for (fs_i64 item = blockIdx.x; item < groups * S; item += gridDim.x) {
        const fs_i64 grp = item / S, run = item % S, v0 = grp * R;
        const int nr = V - v0 < R ? (int)(V - v0) : R;
        for (fs_i64 i = threadIdx.x; i < R * C; i += blockDim.x) acc[i] = 0.0f;
        __syncthreads();
        const fs_i64 t_lo = run * tokens / S, t_hi = (run + 1) * tokens / S;
        for (fs_i64 t0 = t_lo; t0 < t_hi; t0 += 4 * (fs_i64)blockDim.x) {
            const fs_i64 t = t0 + 4 * (fs_i64)threadIdx.x;
            bool hit[4];
            int mine = 0;
            for (int s = 0; s < 4; ++s) {
                // One unsigned compare: ids below v0 wrap past nr.
                hit[s] = t + s < t_hi && (unsigned long long)(ids[t + s] - v0) < (unsigned long long)nr;
                mine += hit[s];
            }
            int count;
            int at = fs_block_scan(mine, &count);
            for (int s = 0; s < 4; ++s)
                if (hit[s]) list[at++] = (int)(t + s - t0);
            __syncthreads();
            for (int h = 0; h < count; ++h) {
                const fs_i64 tk = t0 + list[h], at_row = (ids[tk] - v0) * C;
                for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) acc[at_row + j] += D::load(&dy[tk * C + j]);
            }
            __syncthreads();  // `list` is refilled by the next tokens
        }
        if constexpr (S == 1) {
            for (fs_i64 i = threadIdx.x; i < nr * C; i += blockDim.x) dw[v0 * C + i] = W::store(acc[i]);
        } else {
            for (fs_i64 i = threadIdx.x; i < nr * C; i += blockDim.x) part[(run * V + v0) * C + i] = acc[i];
            if (fs_last_to_finish(&done[grp], (unsigned)S)) {
                for (fs_i64 i = threadIdx.x; i < nr * C; i += blockDim.x) {
                    float total = 0.0f;
                    for (fs_i64 s = 0; s < S; ++s) total += ((volatile float*)part)[(s * V + v0) * C + i];
                    dw[v0 * C + i] = W::store(total);
                }
                if (threadIdx.x == 0) done[grp] = 0;
            }
        }
        __syncthreads();  // `acc` is cleared for the next item
    }
}

// The forward: element i of y [N, C] is table[ids[i / C], i % C]; an id
// outside [0, V) gives NaN, as the reference does. W and Y are element
// types of the table and y.
template <class W, class Y, class Id>
__device__ __forceinline__ void fs_embedding_lookup(fs_i64 i, fs_i64 C, fs_i64 V, const Id* ids,
                                                    const typename W::Storage* table, typename Y::Storage* y) {
    const fs_i64 r = i / C, j = i % C, id = ids[r];
    y[i] = Y::store((id >= 0 && id < V) ? W::load(&table[id * C + j]) : __int_as_float(0x7fc00000));
}

#endif

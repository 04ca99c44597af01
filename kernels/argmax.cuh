// fusec greedy pick for decoding: the index of the largest of a row's first
// `classes` logits, one block a row, so that a decode step hands back B
// token ids instead of B x N logits. The first index wins a tie and a NaN
// never wins (as the host's greedy pick): each thread keeps its best
// (value, index) over a stride of the row, UNROLL loads in flight at once
// (one at a time, a block took 68 us over gpt2's 50257 logits on an H100:
// a row is one block's, so latency, not bandwidth, bounds it), then the
// block reduces them, warp by warp through shuffles and across warps
// through shared memory.
//
// E is the element type (fs_el::Bf16, F16 or F32). Needs the prelude
// (fusec_prelude.cuh) before it; blockDim.x a multiple of FS_WARP, at most
// 1024 threads.
#ifndef FS_ARGMAX
#define FS_ARGMAX

#include "elements.cuh"

// Whether (v, i) comes before (w, j): larger, or equal and earlier; a NaN
// (v != v) comes after everything.
__device__ __forceinline__ bool fs_argmax_before(float v, int i, float w, int j) {
    if (v != v) return false;
    if (w != w) return true;
    return v > w || (v == w && i < j);
}

template <class E>
__device__ __forceinline__ void fs_argmax_row(const typename E::Storage* x, fs_i64 classes, int* out) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    float v = -__int_as_float(0x7f800000);
    int at = (int)classes;  // past every class: loses to any real one
    constexpr int UNROLL = 16;
    const fs_i64 step = (fs_i64)blockDim.x;
    for (fs_i64 j0 = threadIdx.x; j0 < classes; j0 += UNROLL * step) {
        float w[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const fs_i64 j = j0 + u * step;
            w[u] = j < classes ? E::load(&x[j]) : 0.0f;
        }
        // In index order, so the first of equals stays.
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const fs_i64 j = j0 + u * step;
            if (j < classes && fs_argmax_before(w[u], (int)j, v, at)) {
                v = w[u];
                at = (int)j;
            }
        }
    }
#if FS_WARP > 1
    for (int off = FS_WARP / 2; off > 0; off /= 2) {
        const float w = __shfl_xor_sync(0xffffffffu, v, off);
        const int j = __shfl_xor_sync(0xffffffffu, at, off);
        if (fs_argmax_before(w, j, v, at)) {
            v = w;
            at = j;
        }
    }
#endif
    const int warp = threadIdx.x / FS_WARP, lane = threadIdx.x % FS_WARP;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = at;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const int warps = (int)(blockDim.x / FS_WARP);
        for (int w = 1; w < warps; ++w) {
            if (fs_argmax_before(best_v[w], best_i[w], v, at)) {
                v = best_v[w];
                at = best_i[w];
            }
        }
        // A row of NaNs only: its first class, as the host picks.
        *out = at < classes ? at : 0;
    }
    __syncthreads();
}

#endif

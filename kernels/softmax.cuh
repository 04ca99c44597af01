// fusec softmax over the last axis, a block a row, forward and backward.
//
// Forward:  y = exp(x - max(x)) / sum(exp(x - max(x))), over the C entries
// of one row. Three passes over the row (its maximum, the sum of
// exponentials, the store): rows of any length, nothing held in registers
// or shared memory but the block's two reductions, which every thread gets
// back (fs_block_max, fs_block_sum of the prelude).
//
// Backward: dx = y * (dy - sum(y * dy)), from the forward's output, not its
// input.
//
// X, Y, DY and DX are element types (fs_el::Bf16, F16 or F32; every value
// is f32 in registers); the pointers are the row's first entries, and the
// block's threads take entries threadIdx.x, threadIdx.x + blockDim.x, ...
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_SOFTMAX
#define FS_SOFTMAX

#include "elements.cuh"

// The row's maximum m and the sum of exp(x - m), a pass each: what the
// softmax and the cross-entropy (cross_entropy.cuh) start from.
template <class X>
__device__ __forceinline__ void fs_row_max_sumexp(const typename X::Storage* x, fs_i64 C, float& m, float& sum) {
    m = -__int_as_float(0x7f800000);
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) m = fmaxf(m, X::load(&x[j]));
    m = fs_block_max(m);
    sum = 0.0f;
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) sum += expf(X::load(&x[j]) - m);
    sum = fs_block_sum(sum);
}

template <class X, class Y>
__device__ __forceinline__ void fs_softmax_row(const typename X::Storage* x, typename Y::Storage* y, fs_i64 C) {
    float m, sum;
    fs_row_max_sumexp<X>(x, C, m, sum);
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) y[j] = Y::store(expf(X::load(&x[j]) - m) / sum);
}

template <class Y, class DY, class DX>
__device__ __forceinline__ void fs_softmax_grad_row(const typename Y::Storage* y, const typename DY::Storage* dy,
                                                    typename DX::Storage* dx, fs_i64 C) {
    float dot = 0.0f;
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) dot += Y::load(&y[j]) * DY::load(&dy[j]);
    dot = fs_block_sum(dot);
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x)
        dx[j] = DX::store(Y::load(&y[j]) * (DY::load(&dy[j]) - dot));
}

#endif

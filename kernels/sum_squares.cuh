// fusec global gradient norm, first half: the squares of every gradient
// summed in chunks. The launch has a block a chunk of one tensor, each
// writing its own partial sum (no atomics: every run adds in the same
// order); the partials are then added up by a sum kernel into the squared
// norm. The generated kernel maps its block to a tensor and a chunk and
// calls this.
//
// The block's threads add the squares of x[start, end) (threadIdx.x,
// + blockDim.x, ...), in f32 whatever X stores (fs_el::Bf16, F16 or F32);
// returns the block's total to every thread. Every thread of the block
// calls it (the reduction synchronises the block).
//
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_SUM_SQUARES
#define FS_SUM_SQUARES

#include "elements.cuh"

template <class X>
__device__ __forceinline__ float fs_sum_squares_chunk(const typename X::Storage* x, fs_i64 start,
                                                      fs_i64 end) {
    float acc = 0.0f;
    for (fs_i64 j = start + threadIdx.x; j < end; j += blockDim.x) {
        const float v = X::load(&x[j]);
        acc += v * v;
    }
    return fs_block_sum(acc);
}

#endif

// fusec casts of whole tensors (the master weights to the compute dtype at
// the start of a step), eight elements a thread at a time: two 16-byte
// loads of f32 and one 16-byte store of a 16-bit type. A thread's one
// 4-byte load in flight left the grouped casts at about half the copy
// bandwidth (0.39 ms for gpt2-small's 124M weights on an H100).
//
// `fs_cast_chunk` casts elements [lo, hi) of `in` into `out`; elements at
// or past `logical` (zero rows a padded GEMM reads after a table's last,
// kernel::pitch) are stored as zeros. lo, hi and logical are multiples of
// 8 and both buffers 16-byte aligned (the emitter checks the first, the
// arena's 256-byte alignment gives the second).
//
// I and O are fs_el element types (elements.cuh). Needs the prelude
// (fusec_prelude.cuh) before it.
#ifndef FS_CAST
#define FS_CAST

#include "elements.cuh"

template <class I, class O>
__device__ __forceinline__ void fs_cast_chunk(typename O::Storage* out, const typename I::Storage* in, fs_i64 lo,
                                              fs_i64 hi, fs_i64 logical) {
    for (fs_i64 i = lo + 8 * (fs_i64)threadIdx.x; i < hi; i += 8 * (fs_i64)blockDim.x) {
        typename O::Storage o[8];
        if (i < logical) {
            typename I::Storage v[8];
            fs_vload(v, &in[i]);
            for (int e = 0; e < 8; ++e) o[e] = O::store(I::load(&v[e]));
        } else {
            for (int e = 0; e < 8; ++e) o[e] = O::store(0.0f);
        }
        fs_vstore(&out[i], o);
    }
}

#endif

// fusec causal mask over attention scores x [..., T, S]: entry (q, col)
// keeps x where col <= q and becomes `fill` (usually -inf) past the
// diagonal. A thread an element `i`, row-major; X and Y are element types
// (fs_el::Bf16, F16 or F32).
//
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_MASK
#define FS_MASK

#include "elements.cuh"

template <class X, class Y>
__device__ __forceinline__ void fs_causal_mask(fs_i64 i, fs_i64 t_len, fs_i64 s_len, float fill,
                                               const typename X::Storage* x, typename Y::Storage* y) {
    const fs_i64 col = i % s_len, q = (i / s_len) % t_len;
    y[i] = Y::store(col > q ? fill : X::load(&x[i]));
}

#endif

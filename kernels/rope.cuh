// fusec rotary position embedding (RoPE, the "rotate half" form of GPT-NeoX
// and LLaMA): in each head row of x [..., T, H, D], features f and
// f + D/2 are rotated together by the angle pos * theta^(-2f/D), pos the
// row's position in T, or positions[row] where positions is given (a
// decode step's rows, which start where the cache ends). The gradient is the rotation the other way
// (`inverse`).
//
// A thread a rotated pair: one angle, one sine and cosine for both of its
// elements (a thread an element computed them twice, with powf, and ran at
// a tenth of the memory bandwidth). `i` numbers the pairs, x and y are
// row-major and may be the same buffer. X and Y are element types
// (fs_el::Bf16, F16 or F32).
//
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_ROPE
#define FS_ROPE

#include "elements.cuh"

template <class X, class Y>
__device__ __forceinline__ void fs_rope_pair(fs_i64 i, fs_i64 t_len, fs_i64 heads, fs_i64 D, float log2_theta,
                                             bool inverse, const int* positions, const typename X::Storage* x,
                                             typename Y::Storage* y) {
    const fs_i64 half = D / 2, pair = i / half, f = i % half, row = (pair / heads) % t_len, lo_at = pair * D + f;
    const fs_i64 pos = positions ? (fs_i64)positions[row] : row;
    // theta^(-2f/D) as exp2(-2f/D * log2(theta)).
    const float angle = (float)pos * exp2f(-2.0f * (float)f / (float)D * log2_theta);
    float sn, cs;
    sincosf(angle, &sn, &cs);
    if (inverse) sn = -sn;
    const float lo = X::load(&x[lo_at]), hi = X::load(&x[lo_at + half]);
    y[lo_at] = Y::store(lo * cs - hi * sn);
    y[lo_at + half] = Y::store(lo * sn + hi * cs);
}

#endif

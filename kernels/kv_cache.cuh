// fusec key/value cache write for decoding: a decode step's new keys (or
// values) src [B, S, H, D], any strides (heads straight out of a fused
// projection), into the cache [B, C, H, D] at each row's position. The
// cache is the step's state and this kernel's output is its new value in
// the same storage, so only the S new rows are written; a position outside
// 0..C writes nothing.
//
// A thread an element; `i` numbers src's elements in row-major order. E and
// C are element types (fs_el::Bf16, F16 or F32).
//
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_KV_CACHE
#define FS_KV_CACHE

#include "elements.cuh"

template <class E, class C>
__device__ __forceinline__ void fs_kv_write(fs_i64 i, fs_i64 s_len, fs_i64 heads, fs_i64 D, fs_i64 cache_len,
                                            const int* positions, const typename E::Storage* src, fs_i64 sb,
                                            fs_i64 st, fs_i64 sh, fs_i64 se, typename C::Storage* cache) {
    const fs_i64 e = i % D, h = i / D % heads, s = i / (D * heads) % s_len, b = i / (D * heads * s_len);
    const fs_i64 pos = positions[s];
    if (pos < 0 || pos >= cache_len) return;
    cache[((b * cache_len + pos) * heads + h) * D + e] = C::store(E::load(&src[b * sb + s * st + h * sh + e * se]));
}

#endif

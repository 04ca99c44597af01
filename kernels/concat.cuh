// fusec concatenation along one axis, 16 bytes a thread: where every part
// is a run of whole 16-byte chunks of each output row (the QKV projection's
// gradient from dQ, dK and dV), chunk q of the output lies wholly in one
// part, contiguous there, and is copied with one vector load and store.
// (The element loop, one value a thread, ran at a quarter of the copy
// bandwidth; the emitter falls back to it where a part is not such a run.)
//
// T: the stored element (every part and the output share it); VEC
// elements make 16 bytes; the output, seen as [outer, total, inner] around
// the axis, takes part k along [ends[k-1], ends[k]) of the axis (ends[-1]
// is 0, ends[PARTS-1] is total). The part is picked by comparisons over
// an unrolled loop, so the arrays stay in registers.
//
// Needs the prelude (fusec_prelude.cuh) before it (fs_vload, fs_vstore).
#ifndef FS_CONCAT
#define FS_CONCAT

template <class T, int VEC, int PARTS>
__device__ __forceinline__ void fs_concat_chunk(fs_i64 q, fs_i64 inner, const fs_i64 (&ends)[PARTS],
                                                const T* const (&parts)[PARTS], T* out) {
    const fs_i64 total = ends[PARTS - 1];
    const fs_i64 i = q * VEC;
    const fs_i64 a = (i / inner) % total, outer = i / (inner * total), j = i % inner;
    const T* part = parts[0];
    fs_i64 start = 0, len = ends[0];
#pragma unroll
    for (int k = 1; k < PARTS; ++k) {
        if (a >= ends[k - 1]) {
            part = parts[k];
            start = ends[k - 1];
            len = ends[k] - ends[k - 1];
        }
    }
    T v[VEC];
    fs_vload(v, &part[(outer * len + a - start) * inner + j]);
    fs_vstore(&out[i], v);
}

#endif

// fusec element types for templates that take them as parameters: how a
// stored value reads as f32 and how an f32 is stored (rounded to nearest).
// bf16 and f16 are both 16 raw bits (fs_bf16 and fs_f16 are the same C
// type), so the type says which conversion a buffer takes.
//
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_ELEMENTS
#define FS_ELEMENTS

namespace fs_el {

struct Bf16 {
    typedef fs_bf16 Storage;
    static __device__ __forceinline__ float load(const Storage* p) { return fs_load_bf16(p); }
    static __device__ __forceinline__ Storage store(float x) { return fs_to_bf16(x); }
};

struct F16 {
    typedef fs_f16 Storage;
    static __device__ __forceinline__ float load(const Storage* p) { return fs_load_f16(p); }
    static __device__ __forceinline__ Storage store(float x) { return fs_to_f16(x); }
};

struct F32 {
    typedef float Storage;
    static __device__ __forceinline__ float load(const Storage* p) { return *p; }
    static __device__ __forceinline__ Storage store(float x) { return x; }
};

}  // namespace fs_el

#endif

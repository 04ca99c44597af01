// fusec prelude: what every generated kernel shares. It needs no CUDA
// headers (NVRTC compiles it as it is): 16-bit floats travel as raw bits and
// convert through PTX, and all arithmetic happens in f32.
#pragma once

typedef unsigned short fs_bf16;
typedef unsigned short fs_f16;
typedef long long fs_i64;

__device__ __forceinline__ float fs_load(const float* p) { return *p; }
__device__ __forceinline__ float fs_load(const int* p) { return (float)*p; }
__device__ __forceinline__ float fs_load_bf16(const fs_bf16* p) {
    return __uint_as_float(((unsigned int)*p) << 16);
}
#ifdef __CUDACC__
__device__ __forceinline__ float fs_load_f16(const fs_f16* p) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(*p));
    return f;
}
__device__ __forceinline__ fs_bf16 fs_to_bf16(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ fs_f16 fs_to_f16(float f) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
#else
// The same conversions in portable C++, so a host compiler can run the
// generated kernels in tests.
inline float fs_load_f16(const fs_f16* p) {
    _Float16 h;
    memcpy(&h, p, 2);
    return (float)h;
}
inline fs_bf16 fs_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
    return (fs_bf16)(u >> 16);
}
inline fs_f16 fs_to_f16(float f) {
    _Float16 h = (_Float16)f;
    fs_f16 r;
    memcpy(&r, &h, 2);
    return r;
}
#endif

// The low bits of an address (16-byte alignment checks).
template <typename T>
__device__ __forceinline__ unsigned long long fs_align_bits(const T* p) {
    return (unsigned long long)p;
}

// 16-byte loads and stores: `n` elements of T (n * sizeof(T) a multiple of
// 16, both addresses 16-byte aligned) in ld.global.v4 / st.global.v4.
#ifdef __CUDACC__
template <typename T, int N>
__device__ __forceinline__ void fs_vload(T (&dst)[N], const T* src) {
#pragma unroll
    for (int k = 0; k < (int)(N * sizeof(T) / 16); ++k) reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
}
template <typename T, int N>
__device__ __forceinline__ void fs_vstore(T* dst, const T (&src)[N]) {
#pragma unroll
    for (int k = 0; k < (int)(N * sizeof(T) / 16); ++k) reinterpret_cast<uint4*>(dst)[k] = reinterpret_cast<const uint4*>(src)[k];
}
#else
template <typename T, int N>
inline void fs_vload(T (&dst)[N], const T* src) { memcpy(dst, src, sizeof dst); }
template <typename T, int N>
inline void fs_vstore(T* dst, const T (&src)[N]) { memcpy(dst, src, sizeof src); }
#endif

// Neither infinite nor NaN (the exponent is not all ones).
__device__ __forceinline__ bool fs_isfinite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

// Rounding an f32 to a narrower type and back, where the graph casts.
__device__ __forceinline__ float fs_round_bf16(float f) { return __uint_as_float(((unsigned int)fs_to_bf16(f)) << 16); }
__device__ __forceinline__ float fs_round_f16(float f) {
    fs_f16 h = fs_to_f16(f);
    return fs_load_f16(&h);
}

// Activations and their derivatives, as the CPU reference defines them.
#define FS_SQRT_2_OVER_PI 0.7978845608028654f
#define FS_GELU_C 0.044715f
__device__ __forceinline__ float fs_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float fs_gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(FS_SQRT_2_OVER_PI * (x + FS_GELU_C * x * x * x)));
}
__device__ __forceinline__ float fs_gelu_grad(float x) {
    float t = tanhf(FS_SQRT_2_OVER_PI * (x + FS_GELU_C * x * x * x));
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * FS_SQRT_2_OVER_PI * (1.0f + 3.0f * FS_GELU_C * x * x);
}
// GELU with the exact erf (BERT's); its derivative is Phi(x) + x phi(x).
__device__ __forceinline__ float fs_gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }
__device__ __forceinline__ float fs_gelu_erf_grad(float x) {
    return 0.5f * (1.0f + erff(x * 0.7071067811865476f)) + x * 0.3989422804014327f * expf(-0.5f * x * x);
}
__device__ __forceinline__ float fs_silu(float x) { return x * fs_sigmoid(x); }
__device__ __forceinline__ float fs_silu_grad(float x) {
    float s = fs_sigmoid(x);
    return s + x * s * (1.0f - s);
}

// A load of what other blocks wrote before a fence this block has seen (a
// column sum's partials): through L2, never a stale L1 line, and, unlike a
// volatile load, free to be issued ahead of the adds that use it.
#ifdef __CUDACC__
__device__ __forceinline__ float fs_ldcg(const float* p) { return __ldcg(p); }
#else
inline float fs_ldcg(const float* p) { return *p; }
#endif

// Threads that share a row in the one-warp-a-row kernels (norm_rows.rs):
// a warp on the GPU, the one thread of a block on the host (tests).
#ifdef __CUDACC__
#define FS_WARP 32
#else
#define FS_WARP 1
#endif

// Sums and maxima across a thread block (blockDim.x a multiple of 32, at
// most 1024); every thread gets the result. On the host (tests) a block is
// one thread, so the value is already the total.
#ifdef __CUDACC__
__device__ __forceinline__ float fs_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float fs_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float fs_block_sum(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = fs_warp_sum(v);
    __syncthreads();  // the previous call's readers are done with `part`
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return fs_warp_sum(lane < warps ? part[lane] : 0.0f);
}
__device__ __forceinline__ float fs_block_max(float v) {
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = fs_warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return fs_warp_max(lane < warps ? part[lane] : -__int_as_float(0x7f800000));
}
// Exclusive prefix sum of `v` over the threads of a block (thread i gets
// the sum of threads 0..i-1), the block's total in *total. Call it from
// every thread.
__device__ __forceinline__ int fs_block_scan(int v, int* total) {
    __shared__ int sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();  // the previous call's readers are done with `sums`
    if (lane == 31) sums[warp] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < warps; ++w) {
        const int c = sums[w];
        all += c;
        if (w < warp) before += c;
    }
    *total = all;
    return before + x - v;
}
#else
inline float fs_warp_sum(float v) { return v; }
inline float fs_block_sum(float v) { return v; }
inline float fs_block_max(float v) { return v; }
inline int fs_block_scan(int v, int* total) { *total = v; return 0; }
#endif

// Whether this block is the last of `runs` blocks to finish a shared piece
// of work counted in *done (zero before the first): the block's global
// writes so far are made visible before it is counted, and the last sees
// every other block's. Every thread of the block calls it and gets the same
// answer. The last block resets *done when it has used the others' writes,
// so a replayed graph starts from zero.
__device__ __forceinline__ bool fs_last_to_finish(unsigned* done, unsigned runs) {
    __shared__ bool last;
    __threadfence();  // this block's writes are visible before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == runs - 1;
    __syncthreads();
    if (last) __threadfence();
    return last;
}


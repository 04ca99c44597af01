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

// A gradient's elements as f32: f32 gradients, or bf16 ones where the
// ranks average them in bf16 (`--reduce-dtype bf16`) and the update reads
// the mean as it arrives. fs_grad4 reads four (16 or 8 bytes, aligned).
__device__ __forceinline__ float fs_grad(const float* g) { return *g; }
__device__ __forceinline__ float fs_grad(const fs_bf16* g) { return fs_load_bf16(g); }
__device__ __forceinline__ void fs_grad4(float (&d)[4], const float* g) { fs_vload(d, g); }
__device__ __forceinline__ void fs_grad4(float (&d)[4], const fs_bf16* g) {
    fs_bf16 h[4];
#ifdef __CUDACC__
    *reinterpret_cast<uint2*>(h) = *reinterpret_cast<const uint2*>(g);
#else
    memcpy(h, g, sizeof h);
#endif
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] = fs_load_bf16(h + e);
}

// One parameter's AdamW update (torch.optim.AdamW) over its elements
// [lo, hi), one block's chunk; a group kernel calls it for every chunk of
// every parameter, so the update of a whole model is one launch and one
// copy of this code. Outputs may alias inputs (the update is in place).
template <typename G>
static __device__ __noinline__ void fs_adamw(float* p_out, float* m_out, float* v_out, const float* p, const G* g,
                                      const float* m, const float* v, float lr, float t, float scale, float apply,
                                      fs_i64 lo, fs_i64 hi, float b1, float b2, float eps, float wd,
                                      float one_minus_b1, float one_minus_b2, float log1p_b1, float log1p_b2) {
    // A micro-batch that only accumulates gradients leaves the state as it
    // is (in place, nothing to copy).
    if (apply == 0.0f) {
        if (p_out == p && m_out == m && v_out == v) return;
        for (fs_i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            p_out[i] = p[i];
            m_out[i] = m[i];
            v_out[i] = v[i];
        }
        return;
    }
    // 1 - beta and the bias corrections 1 - beta^t (as -expm1(t * log(beta)),
    // log1p_b = log1p(-(1 - beta))) worked out by the emitter in f64, as
    // AdamW's own kernel (ops/optim.rs) and PyTorch have them: 1.0f - 0.999f
    // in f32 is off by 1.3e-5 relative (0.999f is not 0.999), and so is
    // 1 - powf(0.999f, t), the same way at every step, a drift from an f64
    // run.
    const float bc1 = -expm1f(t * log1p_b1), bc2 = -expm1f(t * log1p_b2);
    // Four elements a thread and step in 16-byte loads and stores where
    // every array is 16-byte aligned at lo (the update reads 16 bytes and
    // writes 12 an element: it is bound by memory), the rest one at a time.
    fs_i64 rest = lo;
    if (((fs_align_bits(p + lo) | fs_align_bits(g + lo) | fs_align_bits(m + lo) | fs_align_bits(v + lo) |
          fs_align_bits(p_out + lo) | fs_align_bits(m_out + lo) | fs_align_bits(v_out + lo)) & 15) == 0) {
        const fs_i64 quads = (hi - lo) / 4;
        for (fs_i64 q = threadIdx.x; q < quads; q += blockDim.x) {
            const fs_i64 i = lo + 4 * q;
            float pp[4], gg[4], mm[4], vv[4];
            fs_vload(pp, p + i);
            fs_grad4(gg, g + i);
            fs_vload(mm, m + i);
            fs_vload(vv, v + i);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float gi = gg[e] * scale;
                mm[e] = b1 * mm[e] + one_minus_b1 * gi;
                vv[e] = b2 * vv[e] + one_minus_b2 * gi * gi;
                pp[e] = pp[e] * (1.0f - lr * wd) - lr * (mm[e] / bc1) / (sqrtf(vv[e] / bc2) + eps);
            }
            fs_vstore(p_out + i, pp);
            fs_vstore(m_out + i, mm);
            fs_vstore(v_out + i, vv);
        }
        rest = lo + 4 * quads;
    }
    for (fs_i64 i = rest + threadIdx.x; i < hi; i += blockDim.x) {
        const float gi = fs_grad(g + i) * scale;
        const float mi = b1 * m[i] + one_minus_b1 * gi;
        const float vi = b2 * v[i] + one_minus_b2 * gi * gi;
        p_out[i] = p[i] * (1.0f - lr * wd) - lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
        m_out[i] = mi;
        v_out[i] = vi;
    }
}

// One parameter's SGD update with momentum (torch.optim.SGD, dampening 0).
template <typename G>
static __device__ __noinline__ void fs_sgd(float* p_out, float* buf_out, const float* p, const G* g, const float* buf,
                                    float lr, float scale, float apply, fs_i64 lo, fs_i64 hi, float momentum, float wd) {
    if (apply == 0.0f) {
        if (p_out == p && buf_out == buf) return;
        for (fs_i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            p_out[i] = p[i];
            buf_out[i] = buf[i];
        }
        return;
    }
    for (fs_i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float b = momentum * buf[i] + fs_grad(g + i) * scale + wd * p[i];
        p_out[i] = p[i] - lr * b;
        buf_out[i] = b;
    }
}

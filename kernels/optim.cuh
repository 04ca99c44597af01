// fusec optimizer updates: AdamW (torch.optim.AdamW) and SGD with momentum
// (torch.optim.SGD, dampening 0), one copy of each update's arithmetic.
//
// `fs_adamw_step` / `fs_sgd_step` update one element in registers; every
// kernel that updates a parameter runs them: the group kernel's chunk
// functions below (`fs_adamw`, `fs_sgd`: one parameter's elements [lo, hi),
// one block's chunk; a group kernel calls them for every chunk of every
// parameter, so the update of a whole model is one launch and one copy of
// this code), and the generated loop of an update whose buffers the chunk
// functions do not take (a 16-bit parameter without an f32 master, or a
// table with zero rows after its end).
//
// The constants derived from the hyper-parameters (1 - beta, and
// log1p(-(1 - beta)) for the bias corrections) come from the emitter, worked
// out in f64 as PyTorch has them: 1.0f - 0.999f in f32 is off by 1.3e-5
// relative (0.999f is not 0.999), and so is 1 - powf(0.999f, t), the same
// way at every step and in every parameter: a steady drift from an f64 run,
// not rounding noise. The bias corrections 1 - beta^t are
// -expm1(t * log1p(-(1 - beta))), within 1.5e-7 (tests/cuda_host.rs).
//
// Needs the prelude (fusec_prelude.cuh: fs_i64, fs_bf16, fs_vload) before
// it, and nothing else: NVRTC compiles it without CUDA's headers.
#ifndef FS_OPTIM
#define FS_OPTIM

// AdamW's bias corrections at step t (from 1).
__device__ __forceinline__ void fs_adamw_corrections(float t, float log1p_b1, float log1p_b2, float& bc1, float& bc2) {
    bc1 = -expm1f(t * log1p_b1);
    bc2 = -expm1f(t * log1p_b2);
}

// One element's AdamW update: the moments m, v and the parameter p, from the
// (scaled) gradient g.
__device__ __forceinline__ void fs_adamw_step(float& p, float& m, float& v, float g, float lr, float bc1, float bc2,
                                              float b1, float b2, float eps, float wd, float one_minus_b1,
                                              float one_minus_b2) {
    m = b1 * m + one_minus_b1 * g;
    v = b2 * v + one_minus_b2 * g * g;
    p = p * (1.0f - lr * wd) - lr * (m / bc1) / (sqrtf(v / bc2) + eps);
}

// One element's SGD update: the momentum buffer and the parameter p, from
// the (scaled) gradient g.
__device__ __forceinline__ void fs_sgd_step(float& p, float& buf, float g, float lr, float momentum, float wd) {
    buf = momentum * buf + g + wd * p;
    p = p - lr * buf;
}

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

// One parameter's AdamW update over its elements [lo, hi), one block's
// chunk. Outputs may alias inputs (the update is in place). G is the
// gradient's element type (float or fs_bf16).
template <typename G>
static __device__ __noinline__ void fs_adamw(float* p_out, float* m_out, float* v_out, const float* p, const G* g,
                                             const float* m, const float* v, float lr, float t, float scale,
                                             float apply, fs_i64 lo, fs_i64 hi, float b1, float b2, float eps,
                                             float wd, float one_minus_b1, float one_minus_b2, float log1p_b1,
                                             float log1p_b2) {
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
    float bc1, bc2;
    fs_adamw_corrections(t, log1p_b1, log1p_b2, bc1, bc2);
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
            for (int e = 0; e < 4; ++e)
                fs_adamw_step(pp[e], mm[e], vv[e], gg[e] * scale, lr, bc1, bc2, b1, b2, eps, wd, one_minus_b1,
                              one_minus_b2);
            fs_vstore(p_out + i, pp);
            fs_vstore(m_out + i, mm);
            fs_vstore(v_out + i, vv);
        }
        rest = lo + 4 * quads;
    }
    for (fs_i64 i = rest + threadIdx.x; i < hi; i += blockDim.x) {
        const float gi = fs_grad(g + i) * scale;
        float mi = m[i], vi = v[i], pi = p[i];
        fs_adamw_step(pi, mi, vi, gi, lr, bc1, bc2, b1, b2, eps, wd, one_minus_b1, one_minus_b2);
        p_out[i] = pi;
        m_out[i] = mi;
        v_out[i] = vi;
    }
}

// One parameter's SGD update over its elements [lo, hi), one block's chunk.
template <typename G>
static __device__ __noinline__ void fs_sgd(float* p_out, float* buf_out, const float* p, const G* g, const float* buf,
                                           float lr, float scale, float apply, fs_i64 lo, fs_i64 hi, float momentum,
                                           float wd) {
    if (apply == 0.0f) {
        if (p_out == p && buf_out == buf) return;
        for (fs_i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            p_out[i] = p[i];
            buf_out[i] = buf[i];
        }
        return;
    }
    for (fs_i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float bi = buf[i];
        const float gi = fs_grad(g + i) * scale;
        float pi = p[i];
        fs_sgd_step(pi, bi, gi, lr, momentum, wd);
        p_out[i] = pi;
        buf_out[i] = bi;
    }
}

#endif

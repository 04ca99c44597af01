// fusec cross-entropy over the last axis, a block a row of logits.
//
// Loss:     logsumexp(x) - x[t], for the row's target t (NaN where t is
//           outside [0, C): a bad target shows, it does not read past the
//           row).
// Gradient: (softmax(x) - the target distribution) * dloss, the
//           probabilities never stored; it may overwrite the logits in
//           place (the loss, where both are made, reads them first).
//
// The rule (fs_ce_rule, the compiler's ops::CeRule) adds PyTorch's two
// options: a row whose target is the ignored index has a zero loss and a
// zero gradient; a label smoothing e gives the target 1 - e and every class
// e / C, so the loss is logsumexp(x) - (1 - e) x[t] - (e / C) sum(x).
//
// X, G and L are element types (fs_el::Bf16, F16 or F32) of the logits,
// the gradient and the loss; every value is f32 in registers. Pointers are
// the row's first entries, and the block's threads take entries threadIdx.x,
// threadIdx.x + blockDim.x, ...; every thread of the block calls the same
// function with the same row (the reductions synchronise the block).
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_CROSS_ENTROPY
#define FS_CROSS_ENTROPY

#include "elements.cuh"
#include "softmax.cuh"

// The emitter passes constants, so the rule's branches fold away: the
// default rule compiles to the plain loss.
struct fs_ce_rule {
    bool ignores;         // rows whose target is ignore_index count for nothing
    fs_i64 ignore_index;  // PyTorch's default is -100
    bool smooths;         // a label smoothing e > 0
    float on_target;      // 1 - e
    float smoothing;      // e
};

__device__ __forceinline__ bool fs_ce_counts(const fs_ce_rule& r, fs_i64 t) {
    return !r.ignores || t != r.ignore_index;
}

// The sum of the row's logits, which only a smoothed loss needs.
template <class X>
__device__ __forceinline__ float fs_ce_sum(const typename X::Storage* x, fs_i64 C, const fs_ce_rule& r) {
    if (!r.smooths) return 0.0f;
    float sx = 0.0f;
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) sx += X::load(&x[j]);
    return fs_block_sum(sx);
}

// The row's loss from its m, sum and (smoothed) logit sum sx.
template <class X>
__device__ __forceinline__ float fs_ce_loss(const typename X::Storage* x, fs_i64 t, fs_i64 C, float m, float sum,
                                            float sx, const fs_ce_rule& r) {
    if (!fs_ce_counts(r, t)) return 0.0f;
    if (!(t >= 0 && t < C)) return __int_as_float(0x7fc00000);
    if (r.smooths) return m + logf(sum) - r.on_target * X::load(&x[t]) - (r.smoothing / (float)C) * sx;
    return m + logf(sum) - X::load(&x[t]);
}

// Logit j's gradient from its probability.
__device__ __forceinline__ float fs_ce_grad(float prob, fs_i64 j, fs_i64 t, fs_i64 C, float scale,
                                            const fs_ce_rule& r) {
    if (r.smooths) return (prob - (j == t ? r.on_target : 0.0f) - r.smoothing / (float)C) * scale;
    return (prob - (j == t ? 1.0f : 0.0f)) * scale;
}

// The loss alone, into *loss (thread 0 stores it).
template <class X, class L>
__device__ __forceinline__ void fs_cross_entropy_row(const typename X::Storage* x, fs_i64 t,
                                                     typename L::Storage* loss, fs_i64 C, fs_ce_rule r) {
    float m, sum;
    fs_row_max_sumexp<X>(x, C, m, sum);
    const float sx = fs_ce_sum<X>(x, C, r);
    if (threadIdx.x == 0) *loss = L::store(fs_ce_loss<X>(x, t, C, m, sum, sx, r));
}

// The gradient into g[0, C), zeros in g[C, end) (the padded columns a GEMM
// at the padded size reads), and where Loss the loss into *loss as well.
template <class X, class G, bool Loss, class L>
__device__ __forceinline__ void fs_cross_entropy_grad_row(const typename X::Storage* x, fs_i64 t, float dloss,
                                                          typename G::Storage* g, fs_i64 C, fs_i64 end,
                                                          typename L::Storage* loss, fs_ce_rule r) {
    float m, sum;
    fs_row_max_sumexp<X>(x, C, m, sum);
    const float sx = Loss ? fs_ce_sum<X>(x, C, r) : 0.0f;
    const float scale = fs_ce_counts(r, t) ? dloss : 0.0f;
    if (Loss) {
        if (threadIdx.x == 0) *loss = L::store(fs_ce_loss<X>(x, t, C, m, sum, sx, r));
        // Every thread has read its logits (thread 0 one more) before any
        // gradient overwrites them in place.
        __syncthreads();
    }
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x)
        g[j] = G::store(fs_ce_grad(expf(X::load(&x[j]) - m) / sum, j, t, C, scale, r));
    for (fs_i64 j = C + threadIdx.x; j < end; j += blockDim.x) g[j] = G::store(0.0f);
}

// The same for 16-bit logits and gradient of one type whose rows start
// 16-byte aligned (the emitter checks): eight logits a load, two passes
// over the row instead of three (the maximum and the sum of exponentials
// together, the sum rescaled when the maximum grows), the gradient stored
// eight at a time up to `end` (a multiple of 8, zeros past C).
template <class X, bool Loss, class L>
__device__ __forceinline__ void fs_cross_entropy_grad_row8(const typename X::Storage* x, fs_i64 t, float dloss,
                                                           typename X::Storage* g, fs_i64 C, fs_i64 end,
                                                           typename L::Storage* loss, fs_ce_rule r) {
    typedef typename X::Storage E;
    const float neg_inf = -__int_as_float(0x7f800000);
    float m = neg_inf, sum = 0.0f;
    for (fs_i64 j0 = (fs_i64)threadIdx.x * 8; j0 < C; j0 += (fs_i64)blockDim.x * 8) {
        E v[8];
        fs_vload(v, &x[j0]);
        float x8[8], vm = neg_inf;
        for (int e = 0; e < 8; ++e) {
            x8[e] = j0 + e < C ? X::load(&v[e]) : neg_inf;
            vm = fmaxf(vm, x8[e]);
        }
        if (vm > m) {
            sum *= expf(m - vm);
            m = vm;
        }
        for (int e = 0; e < 8; ++e) sum += expf(x8[e] - m);
    }
    {
        // A thread that saw no logits has sum 0 at m = -inf.
        const float bm = fs_block_max(m);
        sum = fs_block_sum(m == neg_inf ? 0.0f : sum * expf(m - bm));
        m = bm;
    }
    const float scale = fs_ce_counts(r, t) ? dloss : 0.0f;
    if (Loss) {
        // A smoothed loss sums the row's logits in a pass of its own (the
        // 16-bit rows are short next to the exponentials above).
        const float sx = fs_ce_sum<X>(x, C, r);
        if (threadIdx.x == 0) *loss = L::store(fs_ce_loss<X>(x, t, C, m, sum, sx, r));
        __syncthreads();
    }
    const float inv = 1.0f / sum;
    for (fs_i64 j0 = (fs_i64)threadIdx.x * 8; j0 < end; j0 += (fs_i64)blockDim.x * 8) {
        E v[8], gv[8];
        if (j0 < C) fs_vload(v, &x[j0]);
        for (int e = 0; e < 8; ++e) {
            const fs_i64 j = j0 + e;
            gv[e] = X::store(j < C ? fs_ce_grad(expf(X::load(&v[e]) - m) * inv, j, t, C, scale, r) : 0.0f);
        }
        fs_vstore(&g[j0], gv);
    }
}

// 1 where a target counts toward a mean over the targets, 0 where it is
// the ignored index (the count a cross-entropy with ignored targets
// divides its summed losses by). A thread a target.
template <class T>
__device__ __forceinline__ float fs_counted(T target, long long ignore_index) {
    return (long long)target == ignore_index ? 0.0f : 1.0f;
}

#endif

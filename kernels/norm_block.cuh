// fusec norms over the last axis, a block a row: LayerNorm and RMSNorm,
// forward and backward, for rows of any length and element type. They run
// where norm.cuh's one-warp kernels do not (f32 rows, rows over 1024
// features, padded or mixed-type buffers).
//
// A block's threads stride over the row's C features; the row's sums are
// block reductions (fs_block_sum), so any block size works, the host
// shim's one thread included. x, dy, dx and y are [rows, C] row-major; the
// parameters are [C].
//
// Backward: dx a row at a time (RESIDUAL, a stored residual-stream
// gradient, added as dx is stored); then the parameter gradients by
// `groups` groups of consecutive rows, block b taking groups b,
// b + gridDim.x, ...: each group's rows in chunks of up to 256, the
// chunk's statistics recomputed into shared memory, then a thread a
// feature sums over the chunk's rows into the group's f32 partial
// (dgamma[g * C + j], and dbeta for LayerNorm); a sum over the groups
// finishes them. Deterministic: no atomics.
//
// X, G, B, DY, DX, Y and R are element types (fs_el::Bf16, F16 or F32).
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_NORM_BLOCK
#define FS_NORM_BLOCK

#include "elements.cuh"

// Mean and reciprocal standard deviation of one row.
template <class X>
__device__ __forceinline__ void fs_row_stats(const typename X::Storage* x, fs_i64 C, float eps, float& mean,
                                             float& rstd) {
    float sum = 0.0f;
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) sum += X::load(&x[j]);
    mean = fs_block_sum(sum) / (float)C;
    float sq = 0.0f;
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {
        const float d = X::load(&x[j]) - mean;
        sq += d * d;
    }
    rstd = rsqrtf(fs_block_sum(sq) / (float)C + eps);
}

// 1 / sqrt(mean(x^2) + eps) of one row.
template <class X>
__device__ __forceinline__ float fs_row_rms(const typename X::Storage* x, fs_i64 C, float eps) {
    float sq = 0.0f;
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) sq += X::load(&x[j]) * X::load(&x[j]);
    return rsqrtf(fs_block_sum(sq) / (float)C + eps);
}

// y = (x - mean) * rstd * gamma + beta, one row.
template <class X, class G, class B, class Y>
__device__ __forceinline__ void fs_layer_norm_block_row(const typename X::Storage* x, const typename G::Storage* gamma,
                                                        const typename B::Storage* beta, typename Y::Storage* y,
                                                        fs_i64 C, float eps) {
    float mean, rstd;
    fs_row_stats<X>(x, C, eps, mean, rstd);
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x)
        y[j] = Y::store((X::load(&x[j]) - mean) * rstd * G::load(&gamma[j]) + B::load(&beta[j]));
}

// y = x * rms * gamma, one row.
template <class X, class G, class Y>
__device__ __forceinline__ void fs_rms_norm_block_row(const typename X::Storage* x, const typename G::Storage* gamma,
                                                      typename Y::Storage* y, fs_i64 C, float eps) {
    const float r = fs_row_rms<X>(x, C, eps);
    for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) y[j] = Y::store(X::load(&x[j]) * r * G::load(&gamma[j]));
}

// The whole LayerNorm backward kernel: dx, then dgamma's and dbeta's
// partials by groups of rows.
template <class X, class G, class DY, class DX, class R, bool RESIDUAL>
__device__ __forceinline__ void fs_layer_norm_backward_block(
    const typename X::Storage* x, const typename G::Storage* gamma, const typename DY::Storage* dy,
    const typename R::Storage* residual, typename DX::Storage* dx, float* dgamma, float* dbeta, fs_i64 rows, fs_i64 C,
    float eps, fs_i64 groups) {
    for (fs_i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float mean, rstd;
        fs_row_stats<X>(x + r * C, C, eps, mean, rstd);
        float m1 = 0.0f, m2 = 0.0f;
        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {
            const float d = DY::load(&dy[r * C + j]) * G::load(&gamma[j]);
            m1 += d;
            m2 += d * (X::load(&x[r * C + j]) - mean) * rstd;
        }
        m1 = fs_block_sum(m1) / (float)C;
        m2 = fs_block_sum(m2) / (float)C;
        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {
            float v = rstd * (DY::load(&dy[r * C + j]) * G::load(&gamma[j]) - m1 -
                              (X::load(&x[r * C + j]) - mean) * rstd * m2);
            if (RESIDUAL) v = v + R::load(&residual[r * C + j]);
            dx[r * C + j] = DX::store(v);
        }
    }
    __shared__ float mean_s[256], rstd_s[256];
    const fs_i64 per = (rows + groups - 1) / groups;
    for (fs_i64 grp = blockIdx.x; grp < groups; grp += gridDim.x) {
        const fs_i64 g0 = grp * per, g1 = g0 + per < rows ? g0 + per : rows;
        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {
            dgamma[grp * C + j] = 0.0f;
            dbeta[grp * C + j] = 0.0f;
        }
        for (fs_i64 c0 = g0; c0 < g1; c0 += 256) {
            const fs_i64 c1 = c0 + 256 < g1 ? c0 + 256 : g1;
            for (fs_i64 r = c0; r < c1; ++r) {
                float mean, rstd;
                fs_row_stats<X>(x + r * C, C, eps, mean, rstd);
                if (threadIdx.x == 0) {
                    mean_s[r - c0] = mean;
                    rstd_s[r - c0] = rstd;
                }
            }
            __syncthreads();
            for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {
                float dg = 0.0f, db = 0.0f;
                for (fs_i64 r = c0; r < c1; ++r) {
                    const float d = DY::load(&dy[r * C + j]);
                    dg += d * (X::load(&x[r * C + j]) - mean_s[r - c0]) * rstd_s[r - c0];
                    db += d;
                }
                dgamma[grp * C + j] += dg;
                dbeta[grp * C + j] += db;
            }
            // Every thread is done with the chunk's statistics before the
            // next chunk overwrites them.
            __syncthreads();
        }
    }
}

// The whole RMSNorm backward kernel: dx, then dgamma's partials by groups
// of rows.
template <class X, class G, class DY, class DX, class R, bool RESIDUAL>
__device__ __forceinline__ void fs_rms_norm_backward_block(const typename X::Storage* x,
                                                           const typename G::Storage* gamma,
                                                           const typename DY::Storage* dy,
                                                           const typename R::Storage* residual,
                                                           typename DX::Storage* dx, float* dgamma, fs_i64 rows,
                                                           fs_i64 C, float eps, fs_i64 groups) {
    for (fs_i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float sq = 0.0f, dot = 0.0f;
        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {
            const float v = X::load(&x[r * C + j]);
            sq += v * v;
            dot += DY::load(&dy[r * C + j]) * G::load(&gamma[j]) * v;
        }
        const float rs = rsqrtf(fs_block_sum(sq) / (float)C + eps);
        dot = fs_block_sum(dot) / (float)C;
        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {
            const float xv = X::load(&x[r * C + j]);
            float v = DY::load(&dy[r * C + j]) * G::load(&gamma[j]) * rs - xv * rs * rs * rs * dot;
            if (RESIDUAL) v = v + R::load(&residual[r * C + j]);
            dx[r * C + j] = DX::store(v);
        }
    }
    __shared__ float rs_s[256];
    const fs_i64 per = (rows + groups - 1) / groups;
    for (fs_i64 grp = blockIdx.x; grp < groups; grp += gridDim.x) {
        const fs_i64 g0 = grp * per, g1 = g0 + per < rows ? g0 + per : rows;
        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) dgamma[grp * C + j] = 0.0f;
        for (fs_i64 c0 = g0; c0 < g1; c0 += 256) {
            const fs_i64 c1 = c0 + 256 < g1 ? c0 + 256 : g1;
            for (fs_i64 r = c0; r < c1; ++r) {
                const float rs = fs_row_rms<X>(x + r * C, C, eps);
                if (threadIdx.x == 0) rs_s[r - c0] = rs;
            }
            __syncthreads();
            for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {
                float dg = 0.0f;
                for (fs_i64 r = c0; r < c1; ++r)
                    dg += DY::load(&dy[r * C + j]) * X::load(&x[r * C + j]) * rs_s[r - c0];
                dgamma[grp * C + j] += dg;
            }
            __syncthreads();
        }
    }
}

#endif

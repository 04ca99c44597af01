// fusec norms over the last axis, one warp a row, for 16-bit rows of up to
// 1024 features (every transformer width up to 1024): LayerNorm (LAYER) and
// RMSNorm, forward and backward.
//
// A lane holds its features of the row in registers, features [8q, 8q + 8)
// for q = lane, lane + FS_WARP, ..., read once with 16-byte loads; the
// row's statistics (and, backward, the two means the gradient needs) come
// from warp shuffles, with no block barrier a row.
//
// Forward: `load_row(r, j0, v)` gives the 8 features of row r from j0 as
// f32 (`fs_norm_stored` reads a stored tensor; a fused kernel may compute
// them), and the output is stored eight at a time.
//
// Backward: the rows of group g (GROUPS groups of consecutive rows; block
// b takes groups b, b + gridDim.x, ...) give one f32 partial sum a feature
// of dgamma (and, LAYER, dbeta) in dgamma[g * C + j]; a sum over the
// groups finishes them. Each lane sums its features' dgamma in registers and
// dbeta in its warp's row of shared memory, so the parameter gradients need
// no second pass over the rows; the warps then add their sums in warp order
// (deterministic). RESIDUAL adds `residual` (the residual stream's gradient)
// to dx as it is stored. Blocks of BLOCK threads; two blocks an SM fit 128
// registers (a lane's x, dy and dgamma sums; dbeta's in shared memory).
//
// Shared sums are padded by a float every 32 (feature j0 + e at j0 + j0 / 32
// + e, j0 a multiple of 8): lanes hold features 8 apart, so unpadded their
// stores fell on 4 banks (8-way conflicts).
//
// T is the rows' element type (fs_el::Bf16 or F16), G and BT the
// parameters' (their own dtype, f32 or 16-bit). Needs the prelude
// (fusec_prelude.cuh) before it.
#ifndef FS_NORM
#define FS_NORM

#include "elements.cuh"

// The 8 features of row r from j0 of a stored [rows, C] tensor, as f32.
template <class T, int C>
struct fs_norm_stored {
    const typename T::Storage* x;
    __device__ __forceinline__ void operator()(fs_i64 r, int j0, float* v) const {
        typename T::Storage xv[8];
        fs_vload(xv, &x[r * C + j0]);
        for (int e = 0; e < 8; ++e) v[e] = T::load(&xv[e]);
    }
};

template <class T, class G, class BT, int C, bool LAYER, class LoadRow>
__device__ __forceinline__ void fs_norm_forward(const LoadRow& load_row, const typename G::Storage* gamma,
                                                const typename BT::Storage* beta, typename T::Storage* y, fs_i64 rows,
                                                float eps) {
    static_assert(C % 8 == 0 && (C / 8 + 31) / 32 <= 4, "rows of whole 8-feature chunks, at most 1024 features");
    constexpr int K = (C / 8 + FS_WARP - 1) / FS_WARP;
    const int lane = threadIdx.x % FS_WARP, warp = threadIdx.x / FS_WARP, warps = blockDim.x / FS_WARP;
    for (fs_i64 r = (fs_i64)blockIdx.x * warps + warp; r < rows; r += (fs_i64)gridDim.x * warps) {
        float x[K * 8], s = 0.0f;
        for (int k = 0; k < K; ++k) {
            const int j0 = (k * FS_WARP + lane) * 8;
            if (j0 < C) {
                load_row(r, j0, &x[k * 8]);
                for (int e = 0; e < 8; ++e) s += x[k * 8 + e];
            }
        }
        // LayerNorm: the mean first, then the squares about it (from
        // registers), as the reference computes the variance.
        float mean = 0.0f, scale;
        if constexpr (LAYER) {
            mean = fs_warp_sum(s) / (float)C;
            float sq = 0.0f;
            for (int k = 0; k < K; ++k)
                if ((k * FS_WARP + lane) * 8 < C)
                    for (int e = 0; e < 8; ++e) {
                        const float t = x[k * 8 + e] - mean;
                        sq += t * t;
                    }
            scale = rsqrtf(fs_warp_sum(sq) / (float)C + eps);
        } else {
            float sq = 0.0f;
            for (int k = 0; k < K; ++k)
                if ((k * FS_WARP + lane) * 8 < C)
                    for (int e = 0; e < 8; ++e) sq += x[k * 8 + e] * x[k * 8 + e];
            (void)s;
            scale = rsqrtf(fs_warp_sum(sq) / (float)C + eps);
        }
        for (int k = 0; k < K; ++k) {
            const int j0 = (k * FS_WARP + lane) * 8;
            if (j0 < C) {
                // The parameters 8 features a load (one 2-byte load a
                // feature cost as much L1 traffic as the rows themselves).
                typename G::Storage gv[8];
                fs_vload(gv, &gamma[j0]);
                typename T::Storage yv[8];
                if constexpr (LAYER) {
                    typename BT::Storage bv[8];
                    fs_vload(bv, &beta[j0]);
                    for (int e = 0; e < 8; ++e)
                        yv[e] = T::store((x[k * 8 + e] - mean) * scale * G::load(&gv[e]) + BT::load(&bv[e]));
                } else {
                    for (int e = 0; e < 8; ++e) yv[e] = T::store(x[k * 8 + e] * scale * G::load(&gv[e]));
                }
                fs_vstore(&y[r * C + j0], yv);
            }
        }
    }
}

template <class T, class G, int C, bool LAYER, bool RESIDUAL, int BLOCK, int GROUPS>
__device__ __forceinline__ void fs_norm_backward(const typename T::Storage* x, const typename G::Storage* gamma,
                                                 const typename T::Storage* dy, const typename T::Storage* residual,
                                                 typename T::Storage* dx, float* dgamma, float* dbeta, fs_i64 rows,
                                                 float eps) {
    static_assert(C % 8 == 0 && (C / 8 + 31) / 32 <= 4, "rows of whole 8-feature chunks, at most 1024 features");
    typedef typename T::Storage E;
    constexpr int K = (C / 8 + FS_WARP - 1) / FS_WARP;
    constexpr int CP = C + C / 32;
    __shared__ float sdg[CP], wdb[LAYER ? BLOCK / FS_WARP : 1][LAYER ? CP : 1];
    const int lane = threadIdx.x % FS_WARP, warp = threadIdx.x / FS_WARP, warps = blockDim.x / FS_WARP;
    const fs_i64 groups = GROUPS, per = (rows + groups - 1) / groups;
    for (fs_i64 grp = blockIdx.x; grp < groups; grp += gridDim.x) {
        const fs_i64 g0 = grp * per, g1 = g0 + per < rows ? g0 + per : rows;
        float dg[K * 8];
        for (int e = 0; e < K * 8; ++e) dg[e] = 0.0f;
        if constexpr (LAYER)
            for (int k = 0; k < K; ++k)
                if ((k * FS_WARP + lane) * 8 < C)
                    for (int e = 0; e < 8; ++e) {
                        const int j0 = (k * FS_WARP + lane) * 8;
                        wdb[warp][j0 + j0 / 32 + e] = 0.0f;
                    }
        for (fs_i64 r = g0 + warp; r < g1; r += warps) {
            // The row stays in its 16-bit form, widened where it is read.
            E xv[K][8], dv[K][8];
            float s = 0.0f, ss = 0.0f;
            for (int k = 0; k < K; ++k) {
                const int j0 = (k * FS_WARP + lane) * 8;
                if (j0 < C) {
                    fs_vload(xv[k], &x[r * C + j0]);
                    fs_vload(dv[k], &dy[r * C + j0]);
                    for (int e = 0; e < 8; ++e) {
                        s += T::load(&xv[k][e]);
                        ss += T::load(&xv[k][e]) * T::load(&xv[k][e]);
                    }
                }
            }
            // LayerNorm: mean and rstd (two passes, as the reference), then
            // m1 = mean(dy g) and m2 = mean(dy g xhat); RMSNorm: rs and
            // dot = mean(dy g x).
            float mean = 0.0f, scale, m1 = 0.0f, m2 = 0.0f;
            if constexpr (LAYER) {
                mean = fs_warp_sum(s) / (float)C;
                float sq = 0.0f;
                for (int k = 0; k < K; ++k)
                    if ((k * FS_WARP + lane) * 8 < C)
                        for (int e = 0; e < 8; ++e) {
                            const float t = T::load(&xv[k][e]) - mean;
                            sq += t * t;
                        }
                scale = rsqrtf(fs_warp_sum(sq) / (float)C + eps);
                (void)ss;
                for (int k = 0; k < K; ++k) {
                    const int j0 = (k * FS_WARP + lane) * 8;
                    if (j0 < C) {
                        typename G::Storage gv[8];
                        fs_vload(gv, &gamma[j0]);
                        for (int e = 0; e < 8; ++e) {
                            const float gd = T::load(&dv[k][e]) * G::load(&gv[e]);
                            m1 += gd;
                            m2 += gd * (T::load(&xv[k][e]) - mean) * scale;
                        }
                    }
                }
                m1 = fs_warp_sum(m1) / (float)C;
                m2 = fs_warp_sum(m2) / (float)C;
            } else {
                (void)s;
                scale = rsqrtf(fs_warp_sum(ss) / (float)C + eps);
                for (int k = 0; k < K; ++k) {
                    const int j0 = (k * FS_WARP + lane) * 8;
                    if (j0 < C) {
                        typename G::Storage gv[8];
                        fs_vload(gv, &gamma[j0]);
                        for (int e = 0; e < 8; ++e) m2 += T::load(&dv[k][e]) * G::load(&gv[e]) * T::load(&xv[k][e]);
                    }
                }
                m2 = fs_warp_sum(m2) / (float)C;
            }
            for (int k = 0; k < K; ++k) {
                const int j0 = (k * FS_WARP + lane) * 8;
                if (j0 < C) {
                    E rv[8];
                    if constexpr (RESIDUAL) fs_vload(rv, &residual[r * C + j0]);
                    E o[8];
                    for (int e = 0; e < 8; ++e) {
                        // gamma a feature at a time again: holding its 8
                        // here too took the kernel past 128 registers.
                        const float gd = T::load(&dv[k][e]) * G::load(&gamma[j0 + e]);
                        float v, xh;
                        if constexpr (LAYER) {
                            xh = (T::load(&xv[k][e]) - mean) * scale;
                            v = scale * (gd - m1 - xh * m2);
                        } else {
                            xh = T::load(&xv[k][e]) * scale;
                            v = gd * scale - T::load(&xv[k][e]) * scale * scale * scale * m2;
                        }
                        if constexpr (RESIDUAL) v = v + T::load(&rv[e]);
                        o[e] = T::store(v);
                        dg[k * 8 + e] += T::load(&dv[k][e]) * xh;
                        if constexpr (LAYER) wdb[warp][j0 + j0 / 32 + e] += T::load(&dv[k][e]);
                    }
                    fs_vstore(&dx[r * C + j0], o);
                }
            }
        }
        // The warps' sums into the group's partials, in warp order.
        for (int w = 0; w < warps; ++w) {
            if (warp == w)
                for (int k = 0; k < K; ++k) {
                    const int j0 = (k * FS_WARP + lane) * 8;
                    if (j0 < C)
                        for (int e = 0; e < 8; ++e) {
                            // j0 is a multiple of 8: j0 + e pads as j0 does.
                            sdg[j0 + j0 / 32 + e] = (w == 0 ? 0.0f : sdg[j0 + j0 / 32 + e]) + dg[k * 8 + e];
                        }
                }
            __syncthreads();
        }
        for (fs_i64 j = threadIdx.x; j < C; j += blockDim.x) {
            dgamma[grp * C + j] = sdg[j + j / 32];
            if constexpr (LAYER) {
                float db = 0.0f;
                for (int w = 0; w < warps; ++w) db += wdb[w][j + j / 32];
                dbeta[grp * C + j] = db;
            }
        }
        __syncthreads();
    }
}

#endif

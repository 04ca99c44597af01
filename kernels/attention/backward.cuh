// The FlashAttention-2 backward's small kernels, shared by both tensor-core
// families: delta (first) and, where dQ is summed by atomics, the pass that
// stores it (last), and the pass that sums the dK/dV parts of a Hopper
// dK/dV/dQ kernel split over a group's query heads. The products sit in
// backward_sm80.cuh / backward_sm90.cuh.
//
// With P = exp2(S * scale_log2 - lse * log2 e) recomputed from the forward's
// log-sum-exp, dP = dO V^T and delta = rowsum(dO * O), dS = P * (dP - delta);
// dV = P^T dO, dK = scale * dS^T Q, dQ = scale * dS K.
#ifndef FS_ATTENTION_BACKWARD
#define FS_ATTENTION_BACKWARD
#include "common.cuh"

namespace fs_attn {

// Where delta lies in the scratch: after the f32 dQ sum [B, Hq, T, D], if the
// backward adds dQ up by atomics.
template <int D, bool DQ_SUM, class Args>
__device__ __forceinline__ float* delta_of(const Args& a) {
    return DQ_SUM ? a.scratch + a.batch * a.q_heads * a.q_len * D : a.scratch;
}

// Where the split dK/dV kernels leave their parts (after the dQ sum and
// delta, 16-byte aligned): [B, S, Hkv, SPLIT, D + DV] f32.
template <int D, class Args>
__device__ __forceinline__ float* dkv_parts_of(const Args& a) {
    const fs_i64 rows = a.batch * a.q_heads * a.q_len;
    return a.scratch + (rows * (D + 1) + 3) / 4 * 4;
}

// A split block's part of dK (unscaled) and dV, from the accumulator layout
// of store_dk_dv (features fk0 + 8n + frag_col (+ 1) below D, fv0 + ... below
// DV), into slot `part` of its key rows.
template <int D, int DV, int SPLIT, int NK, int NV>
__device__ __forceinline__ void store_dkv_part(const BackwardArgs& a, const float (&dk_acc)[NK][4], const float (&dv_acc)[NV][4],
                                               fs_i64 b, fs_i64 kv_h, fs_i64 part, fs_i64 k0, int key_row, int frag_col, int fk0,
                                               int fv0) {
    const fs_i64 kv_heads = a.q_heads / a.group;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const fs_i64 j = k0 + key_row + 8 * r;
        if (j < a.kv_len) {
            float* const slot = dkv_parts_of<D>(a) + (((b * a.kv_len + j) * kv_heads + kv_h) * SPLIT + part) * (D + DV);
#pragma unroll
            for (int n = 0; n < NK; ++n) {
                if (fk0 + n * 8 < D) {
                    slot[fk0 + n * 8 + frag_col] = dk_acc[n][2 * r];
                    slot[fk0 + n * 8 + frag_col + 1] = dk_acc[n][2 * r + 1];
                }
            }
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                if (fv0 + n * 8 < DV) {
                    slot[D + fv0 + n * 8 + frag_col] = dv_acc[n][2 * r];
                    slot[D + fv0 + n * 8 + frag_col + 1] = dv_acc[n][2 * r + 1];
                }
            }
        }
    }
}

// dK = scale * the sum of the SPLIT parts, dV = their sum, in their types.
// The block's ROWS key rows are cut into chunks of 8 features (D and DV are
// multiples of 8), one per thread at a time; the parts are added in order
// (deterministic).
// Launch: grid (ceil(S / ROWS), Hkv, B), THREADS threads, no dynamic shared memory.
template <class E, int D, int DV, int SPLIT>
struct DkvStore {
    static constexpr int ROWS = 128, THREADS = 128, SMEM_BYTES = 0;
    static constexpr int CHUNKS = (D + DV) / 8;

    static __device__ __forceinline__ void run(const BackwardArgsOf<typename E::Storage>& a) {
        const fs_i64 kv_len = a.kv_len, kv_heads = a.q_heads / a.group, kv_h = blockIdx.y, b = blockIdx.z;
        for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
            const fs_i64 j = (fs_i64)blockIdx.x * ROWS + idx / CHUNKS;
            if (j >= kv_len) continue;
            const int e0 = (idx % CHUNKS) * 8;
            const float* const slots = dkv_parts_of<D>(a) + ((b * kv_len + j) * kv_heads + kv_h) * SPLIT * (D + DV) + e0;
            float sum[8], x[8];
            fs_vload(sum, slots);
            for (int s = 1; s < SPLIT; ++s) {
                fs_vload(x, slots + s * (D + DV));
#pragma unroll
                for (int e = 0; e < 8; ++e) sum[e] += x[e];
            }
            typename E::Storage out[8];
            if (e0 < D) {
#pragma unroll
                for (int e = 0; e < 8; ++e) out[e] = E::from_float(sum[e] * a.scale);
                fs_vstore(a.dk.row(b, j, kv_h) + e0, out);
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) out[e] = E::from_float(sum[e]);
                fs_vstore(a.dv.row(b, j, kv_h) + e0 - D, out);
            }
        }
    }
};

// delta[b, h, i] = sum_e dO[b, i, h, e] * O[b, i, h, e] into the scratch, and
// with DQ_SUM the same rows of the f32 dQ sum set to zero for the atomics.
// The block's ROWS rows are cut into chunks of 8 features; consecutive
// threads take consecutive chunks (coalesced reads), then one thread per row
// adds its chunks' partial sums in order (deterministic).
// Launch: grid (ceil(T / ROWS), Hq, B), THREADS threads, no dynamic shared memory.
template <class E, int D, int DV, bool DQ_SUM>
struct Delta {
    static constexpr int ROWS = 128, THREADS = 128, SMEM_BYTES = 0;
    static constexpr int CHUNKS = DV / 8;
    static_assert(D % 8 == 0 && DV % 8 == 0, "rows of whole 16-byte chunks");

    static __device__ __forceinline__ void run(const BackwardArgsOf<typename E::Storage>& a) {
        const fs_i64 q_len = a.q_len, h = blockIdx.y, b = blockIdx.z;
        __shared__ float part[ROWS * CHUNKS];
        for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
            const fs_i64 i = (fs_i64)blockIdx.x * ROWS + idx / CHUNKS;
            float acc = 0.0f;
            if (i < q_len) {
                const int e0 = (idx % CHUNKS) * 8;
                typename E::Storage o[8], dout[8];
                fs_vload(o, a.o.row(b, i, h) + e0);
                fs_vload(dout, a.dout.row(b, i, h) + e0);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc += E::to_float(dout + e) * E::to_float(o + e);
            }
            part[idx] = acc;
        }
        __syncthreads();
        const fs_i64 i = (fs_i64)blockIdx.x * ROWS + threadIdx.x;
        if (threadIdx.x < ROWS && i < q_len) {
            float acc = 0.0f;
            for (int c = 0; c < CHUNKS; ++c) acc += part[threadIdx.x * CHUNKS + c];
            delta_of<D, DQ_SUM>(a)[(b * a.q_heads + h) * q_len + i] = acc;
        }
        if (DQ_SUM) {
            // 4 floats per store.
            for (int idx = threadIdx.x; idx < ROWS * (D / 4); idx += THREADS) {
                const fs_i64 i = (fs_i64)blockIdx.x * ROWS + idx / (D / 4);
                if (i < q_len) fs_zero16(&a.scratch[((b * a.q_heads + h) * q_len + i) * D + (idx % (D / 4)) * 4]);
            }
        }
    }
};

// dQ = scale * the f32 sum the dK/dV/dQ kernel added up (scratch [B, Hq, T, D]),
// in dQ's type. The block's ROWS rows are cut into chunks of 8 features, one
// per thread at a time (16- and 32-byte accesses). A batch entry of at most
// one key gets dQ exactly 0 (sees_one_key; causal query 0's dS the dK/dV/dQ
// kernel cleared itself).
// Launch: grid (ceil(T / ROWS), Hq, B), THREADS threads, no dynamic shared memory.
template <class E, int D>
struct DqStore {
    static constexpr int ROWS = 128, THREADS = 128, SMEM_BYTES = 0;
    static constexpr int CHUNKS = D / 8;

    static __device__ __forceinline__ void run(const BackwardArgsOf<typename E::Storage>& a) {
        const fs_i64 q_len = a.q_len, h = blockIdx.y, b = blockIdx.z;
        const float scale = keys_of(a, b) <= 1 ? 0.0f : a.scale;
        for (int idx = threadIdx.x; idx < ROWS * CHUNKS; idx += THREADS) {
            const fs_i64 i = (fs_i64)blockIdx.x * ROWS + idx / CHUNKS;
            if (i >= q_len) continue;
            const int e0 = (idx % CHUNKS) * 8;
            float sum[8];
            fs_vload(sum, &a.scratch[((b * a.q_heads + h) * q_len + i) * D + e0]);
            typename E::Storage out[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) out[e] = E::from_float(sum[e] * scale);
            fs_vstore(a.dq.row(b, i, h) + e0, out);
        }
    }
};

}  // namespace fs_attn

#endif

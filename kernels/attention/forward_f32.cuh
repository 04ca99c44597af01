// FlashAttention-2 forward for f32 inputs on tensor cores (TF32
// mma.sync.m16n8k8, sm_80 and newer; tf32.cuh): O = softmax(Q K^T * scale) V
// and the log-sum-exp of every row, never an N x N matrix in device memory.
//
// The algorithm is forward_sm80.cuh's: a block of warps owns a query tile of
// one (batch, query head), warp w rows 16w .. 16w + 15; keys and values stream
// through shared memory a tile at a time; S = Q K^T in f32 accumulators, the
// online softmax (common.cuh's mask_and_softmax), P kept in registers as the
// A fragment of O += P V (tf32.cuh's a_of_acc: keys taken in pairs, so no
// shuffle). Causal: key tiles after the query tile are never visited.
//
// The queries stay in shared memory (their split operands in registers would
// double their count). Head dims pad to a multiple of 8. Up to 128 padded
// features: 64 queries (4 warps) and 64 keys a tile; wider, 32 and 32 (2
// warps), which keeps the output accumulators (Dv / 2 a thread) in registers
// and every tile within 99 KiB of shared memory (the most a block has on
// sm_86 and sm_89).
//
// Launch: grid (ceil(T / TILE_Q), Hq, B), THREADS threads, SMEM_BYTES of
// dynamic shared memory.
#ifndef FS_ATTENTION_FORWARD_F32
#define FS_ATTENTION_FORWARD_F32
#include "tf32.cuh"

namespace fs_attn {

// D: the head dim of q and k, DV: of v (multiples of 8). CAUSAL,
// SCALE_IN_EXP and DROPOUT as ForwardSm80's. PRECISE: 3xTF32 products
// (about f32's precision) rather than one TF32 mma.
template <int D, int DV, bool CAUSAL, bool SCALE_IN_EXP, bool DROPOUT = false, bool PRECISE = true>
struct ForwardF32 {
    static constexpr int DP = round_up(D, 8), DVP = round_up(DV, 8);  // padded head dims
    static constexpr bool WIDE = DP > 128 || DVP > 128;
    static constexpr int TILE_Q = WIDE ? 32 : 64, TILE_K = WIDE ? 32 : 64, THREADS = TILE_Q * 2;
    static constexpr int ROW = DP + 4, ROW_V = DVP + 4;  // conflict-free fragment reads (tf32.cuh)
    static constexpr int SMEM_BYTES = (TILE_Q * ROW + TILE_K * ROW + TILE_K * ROW_V) * 4;
    static_assert(SMEM_BYTES <= 99 * 1024, "the tiles fit the shared memory of every sm_80+ GPU");

    static __device__ __forceinline__ void run(const ForwardArgsF32& a) {
        const fs_i64 q0 = (fs_i64)blockIdx.x * TILE_Q, h = blockIdx.y, b = blockIdx.z, kv_h = h / a.group;
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        FS_DYNAMIC_SMEM(smem, SMEM_BYTES);
        float* const q_tile = reinterpret_cast<float*>(smem);  // [TILE_Q][ROW]
        float* const k_tile = q_tile + TILE_Q * ROW;            // [TILE_K][ROW]
        float* const v_tile = k_tile + TILE_K * ROW;            // [TILE_K][ROW_V]

        load_rows<TILE_Q, D, DP, ROW, THREADS>(q_tile, a.q, b, q0, h, a.q_len);
        const float* const q_warp = q_tile + warp * 16 * ROW;

        // As ForwardSm80's: the rows' max (log2 units), this thread's part of
        // each row's sum, and o_acc[n][e] = row q_row + 8 * (e / 2), feature
        // 8n + frag_col + e % 2.
        float row_max[2] = {FS_NEG_INF, FS_NEG_INF}, row_sum[2] = {0.0f, 0.0f};
        float o_acc[DVP / 8][4];
#pragma unroll
        for (int n = 0; n < DVP / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[n][e] = 0.0f;
        }
        const fs_i64 i_lo = q0 + warp * 16 + frag_row, i_hi = i_lo + 8;
        const fs_i64 kv_len = keys_of(a, b);
        const fs_i64 kv_end = visited_keys_end<TILE_Q, CAUSAL>(q0, kv_len);
        for (fs_i64 k0 = 0; k0 < kv_end; k0 += TILE_K) {
            __syncthreads();  // every warp is done with the previous tile
            load_rows<TILE_K, D, DP, ROW, THREADS>(k_tile, a.k, b, k0, kv_h, kv_len);
            load_rows<TILE_K, DV, DVP, ROW_V, THREADS>(v_tile, a.v, b, k0, kv_h, kv_len);
            __syncthreads();

            // S = Q K^T: s[n][e] = row i_lo + 8 * (e / 2), key k0 + 8n + frag_col + e % 2.
            float s[TILE_K / 8][4];
#pragma unroll
            for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
            }
#pragma unroll
            for (int kk = 0; kk < DP / 8; ++kk) {
                Tf32Frag<4> qa;
                a_rows<PRECISE>(qa, q_warp + kk * 8, ROW);
                mma_rows<PRECISE>(s, qa, k_tile + kk * 8, ROW);
            }

            float rescale[2];
            mask_and_softmax<TILE_K, CAUSAL, SCALE_IN_EXP>(s, row_max, row_sum, rescale, k0, kv_len, q0 + warp * 16, i_lo,
                                                           i_hi, frag_col, a.scale_log2);
#pragma unroll
            for (int n = 0; n < DVP / 8; ++n) {
                o_acc[n][0] *= rescale[0];
                o_acc[n][1] *= rescale[0];
                o_acc[n][2] *= rescale[1];
                o_acc[n][3] *= rescale[1];
            }
            if (DROPOUT) {
                for_each_draw<TILE_K / 8, false>(a.drop, b * a.q_heads + h, i_lo, k0, frag_col, [&](int n, int e, bool kept) {
                    if (!kept) s[n][e] = 0.0f;
                });
            }

            // O += P V, 8 keys a step: P's accumulators are its A fragment, V's
            // rows 2t and 2t + 1 of the step the B fragment.
#pragma unroll
            for (int kk = 0; kk < TILE_K / 8; ++kk) {
                Tf32Frag<4> pa;
                a_of_acc<PRECISE>(pa, s[kk]);
                mma_cols_pairs<PRECISE>(o_acc, pa, v_tile + kk * 8 * ROW_V, ROW_V);
            }
        }

        if (DROPOUT) {
#pragma unroll
            for (int n = 0; n < DVP / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[n][e] *= a.drop.scale;
            }
        }
        store_output<F32, DV>(a, o_acc, row_max, row_sum, b, h, i_lo, i_hi, frag_col);
    }
};

}  // namespace fs_attn

#endif

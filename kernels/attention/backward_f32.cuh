// FlashAttention-2 backward for f32 inputs on tensor cores (TF32
// mma.sync.m16n8k8, sm_80 and newer; tf32.cuh), in backward_sm80.cuh's two
// schemes around backward.cuh's Delta: atomic (DkDvF32<ATOMIC = true>,
// which adds dQ into the f32 sum, then DqStore: 5 tile products) and
// deterministic (DkDvF32<ATOMIC = false>, then DqF32, query-major: 7
// products, no atomics).
//
// DkDvF32 is DkDvSm80's algorithm: a block owns 64 keys of one
// (batch, key/value head), warp w keys 16w .. 16w + 15, and computes the
// transposed products S^T = K Q^T and dP^T = V dO^T, so that P^T and dS^T
// come out in the accumulator layout, which (keys in pairs, tf32.cuh's
// a_of_acc) is the A fragment of dV += P^T dO and dK += dS^T Q. dK and dV
// stay in registers while the queries of every head of the group stream
// through shared memory TILE_Q rows at a time. With ATOMIC, dS^T goes to
// shared memory, and after a barrier the warps add the tile's dQ += dS K
// into the sum. Every operand keeps f32 (P and dS are not rounded to a
// smaller type).
//
// Up to 256 padded features in all (D + Dv): the query tile is 64 rows up
// to 64 features each, else 32 or 16, whichever keeps the tiles within 99
// KiB of shared memory (the most a block has on sm_86 and sm_89); DqF32's
// key tile likewise.
//
// Launch: DkDvF32 grid (ceil(S / 64), Hkv, B), DqF32 grid (ceil(T / 64),
// Hq, B); 128 threads, SMEM_BYTES of dynamic shared memory.
#ifndef FS_ATTENTION_BACKWARD_F32
#define FS_ATTENTION_BACKWARD_F32
#include "backward.cuh"
#include "tf32.cuh"

namespace fs_attn {

// DkDvF32's shared memory with TQ queries a tile: keys and values, queries
// and dO, with ATOMIC dS^T, the tile's lse and delta.
__host__ __device__ constexpr int dkdv_f32_smem(int dp, int dvp, int tq, bool atomic) {
    return (64 * (dp + dvp + 8) + tq * (dp + dvp + 8) + (atomic ? 64 * (tq + 4) : 0)) * 4 + 2 * tq * 4;
}

// D, DV: head dims (multiples of 8); CAUSAL, ATOMIC, DROPOUT as DkDvSm80's;
// PRECISE: 3xTF32 products.
template <int D, int DV, bool CAUSAL, bool ATOMIC, bool DROPOUT = false, bool PRECISE = true>
struct DkDvF32 {
    static constexpr int DP = round_up(D, 8), DVP = round_up(DV, 8);
    static_assert(DP + DVP <= 256, "dK and dV accumulators for up to 256 features a thread");
    static constexpr int TILE_K = 64, THREADS = 128;
    static constexpr int TILE_Q = DP <= 64 && DVP <= 64                                ? 64
                                  : dkdv_f32_smem(DP, DVP, 32, ATOMIC) <= 99 * 1024 ? 32
                                                                                      : 16;
    static constexpr int ROW = DP + 4, ROW_V = DVP + 4, DS_ROW = TILE_Q + 4;  // conflict-free reads (tf32.cuh)
    static constexpr int SMEM_BYTES = dkdv_f32_smem(DP, DVP, TILE_Q, ATOMIC);
    static_assert(SMEM_BYTES <= 99 * 1024, "the tiles fit the shared memory of every sm_80+ GPU");

    static __device__ __forceinline__ void run(const BackwardArgsF32& a) {
        const fs_i64 k0 = (fs_i64)blockIdx.x * TILE_K, kv_h = blockIdx.y, b = blockIdx.z;
        const fs_i64 q_len = a.q_len, kv_len = a.kv_len, keys = masked_keys_from(a, b);
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        FS_DYNAMIC_SMEM(smem, SMEM_BYTES);
        float* const k_tile = reinterpret_cast<float*>(smem);  // [TILE_K][ROW]
        float* const v_tile = k_tile + TILE_K * ROW;            // [TILE_K][ROW_V]
        float* const q_tile = v_tile + TILE_K * ROW_V;          // [TILE_Q][ROW]
        float* const do_tile = q_tile + TILE_Q * ROW;           // [TILE_Q][ROW_V]
        float* const ds_tile = do_tile + TILE_Q * ROW_V;        // dS^T of the tile: [key][query]
        float* const lse_tile = ds_tile + (ATOMIC ? TILE_K * DS_ROW : 0);  // lse * log2(e)
        float* const delta_tile = lse_tile + TILE_Q;
        const float* const delta = delta_of<D, ATOMIC>(a);

        // The block's keys and values (rows past kv_len zero; their dK, dV are
        // never stored); the query loop's first barrier publishes them.
        load_rows<TILE_K, D, DP, ROW, THREADS>(k_tile, a.k, b, k0, kv_h, kv_len);
        load_rows<TILE_K, DV, DVP, ROW_V, THREADS>(v_tile, a.v, b, k0, kv_h, kv_len);

        // dk_acc[n][e], dv_acc[n][e]: key row key_row + 8 * (e / 2), feature
        // 8n + frag_col + e % 2.
        const int key_row = warp * 16 + frag_row;
        float dk_acc[DP / 8][4], dv_acc[DVP / 8][4];
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[n][e] = 0.0f;
        }
#pragma unroll
        for (int n = 0; n < DVP / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dv_acc[n][e] = 0.0f;
        }
        const fs_i64 i_first = CAUSAL ? (k0 / TILE_Q) * TILE_Q : 0;
        for (fs_i64 hh = 0; hh < a.group; ++hh) {
            const fs_i64 h = kv_h * a.group + hh;
            for (fs_i64 i0 = i_first; i0 < q_len; i0 += TILE_Q) {
                __syncthreads();  // every warp is done with the previous tile
                load_rows<TILE_Q, D, DP, ROW, THREADS>(q_tile, a.q, b, i0, h, q_len);
                load_rows<TILE_Q, DV, DVP, ROW_V, THREADS>(do_tile, a.dout, b, i0, h, q_len);
                if (threadIdx.x < TILE_Q) {
                    const fs_i64 i = i0 + threadIdx.x;
                    lse_tile[threadIdx.x] = i < q_len ? a.lse.at(b, h, i) * LOG2E : 0.0f;
                    delta_tile[threadIdx.x] = i < q_len ? delta[(b * a.q_heads + h) * q_len + i] : 0.0f;
                }
                __syncthreads();

                // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys: s[n][e],
                // dp[n][e] = key key_row + 8 * (e / 2), query i0 + 8n + frag_col + e % 2.
                float s[TILE_Q / 8][4], dp[TILE_Q / 8][4];
#pragma unroll
                for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
                }
#pragma unroll
                for (int kk = 0; kk < DP / 8; ++kk) {
                    Tf32Frag<4> ka;
                    a_rows<PRECISE>(ka, k_tile + warp * 16 * ROW + kk * 8, ROW);
                    mma_rows<PRECISE>(s, ka, q_tile + kk * 8, ROW);
                }
#pragma unroll
                for (int kk = 0; kk < DVP / 8; ++kk) {
                    Tf32Frag<4> va;
                    a_rows<PRECISE>(va, v_tile + warp * 16 * ROW_V + kk * 8, ROW_V);
                    mma_rows<PRECISE>(dp, va, do_tile + kk * 8, ROW_V);
                }

                // P^T (masked), then dS^T = P^T * (dP^T - delta) in place of dp;
                // with dropout's factors Z, dS^T = P^T (Z dP^T - delta) and dV
                // takes (P Z)^T.
                p_of_s<TILE_Q, TILE_K, CAUSAL>(s, lse_tile, i0, k0, q_len, keys, key_row, frag_col, a.scale_log2);
                if (DROPOUT) {
                    for_each_draw<TILE_Q / 8, true>(a.drop, b * a.q_heads + h, k0 + key_row, i0, frag_col,
                                                    [&](int n, int e, bool kept) {
                                                        const float z = kept ? a.drop.scale : 0.0f;
                                                        dp[n][e] = s[n][e] * (dp[n][e] * z - delta_tile[n * 8 + frag_col + (e & 1)]);
                                                        s[n][e] *= z;
                                                    });
                } else {
#pragma unroll
                    for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);
                    }
                }
                clear_first_query<TILE_Q, CAUSAL>(dp, i0, frag_col);

                // With ATOMIC dS^T into the shared tile for dQ; then dV += P^T dO
                // and dK += dS^T Q, 8 queries a step (rows 2t, 2t + 1 of dO / Q the
                // B fragment).
                if (ATOMIC) {
#pragma unroll
                    for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
                        for (int e = 0; e < 4; ++e) ds_tile[(key_row + 8 * (e >> 1)) * DS_ROW + n * 8 + frag_col + (e & 1)] = dp[n][e];
                    }
                }
#pragma unroll
                for (int kk = 0; kk < TILE_Q / 8; ++kk) {
                    Tf32Frag<4> pa, dsa;
                    a_of_acc<PRECISE>(pa, s[kk]);
                    a_of_acc<PRECISE>(dsa, dp[kk]);
                    mma_cols_pairs<PRECISE>(dv_acc, pa, do_tile + kk * 8 * ROW_V, ROW_V);
                    mma_cols_pairs<PRECISE>(dk_acc, dsa, q_tile + kk * 8 * ROW, ROW);
                }
                if (ATOMIC) add_dq(a, k_tile, ds_tile, b, h, i0, warp, frag_row, frag_col);
            }
        }

        clear_dk_of_one_key(a, b, dk_acc);
        store_dk_dv<F32, D, DV>(a, dk_acc, dv_acc, b, kv_h, k0, key_row, frag_col, 0, 0);
    }

    // dQ += dS K for the tile's queries and the block's keys, added into the
    // f32 sum in the scratch ([B, Hq, T, D]) by atomics. A: dS read from the
    // shared dS^T (keys in pairs); B: rows 2t, 2t + 1 of the key tile. SPLIT
    // warps share each 16 queries, warp w taking every SPLIT-th 8 features
    // from w % SPLIT.
    static __device__ __forceinline__ void add_dq(const BackwardArgsF32& a, const float* k_tile, const float* ds_tile, fs_i64 b,
                                                  fs_i64 h, fs_i64 i0, int warp, int frag_row, int frag_col) {
        constexpr int SPLIT = (THREADS / 32) / (TILE_Q / 16), NT = (DP / 8 + SPLIT - 1) / SPLIT;
        __syncthreads();  // dS^T is complete
        const int m0 = (warp / SPLIT) * 16, first = warp % SPLIT;
        float dq_acc[NT][4];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dq_acc[j][e] = 0.0f;
        }
#pragma unroll
        for (int kk = 0; kk < TILE_K / 8; ++kk) {
            Tf32Frag<4> dsa;
            a_cols_pairs<PRECISE>(dsa, ds_tile + kk * 8 * DS_ROW + m0, DS_ROW);
            // A warp whose share is one short (DP / 8 not a multiple of SPLIT)
            // multiplies zeros into its last accumulators, never stored.
            Tf32Frag<2> kb[NT];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int n = first + j * SPLIT;
                if (n < DP / 8) {
                    b_cols_pairs<PRECISE>(kb[j], k_tile + kk * 8 * ROW + n * 8, ROW);
                } else {
                    kb[j].hi[0] = kb[j].hi[1] = kb[j].lo[0] = kb[j].lo[1] = 0u;
                }
            }
            mma_tf32<PRECISE>(dq_acc, dsa, kb);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const fs_i64 i = i0 + m0 + frag_row + 8 * r;
            if (i < a.q_len) {
                float* const sum = &a.scratch[((b * a.q_heads + h) * a.q_len + i) * D + frag_col];
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int n = first + j * SPLIT;
                    if (n * 8 < D) fs_atomic_add2(sum + n * 8, dq_acc[j][2 * r], dq_acc[j][2 * r + 1]);
                }
            }
        }
    }
};

// DqF32's shared memory with TK keys a tile: the query and dO tiles, the key
// and value tiles.
__host__ __device__ constexpr int dq_f32_smem(int dp, int dvp, int tk) { return (64 + tk) * (dp + dvp + 8) * 4; }

// The deterministic scheme's dQ for f32: one block of 4 warps per 64 queries
// of one (batch, query head), warp w rows 16w .. 16w + 15, query-major like
// the forward: S = Q K^T and dP = dO V^T (A fragments of the query and dO
// rows from shared memory, B of the key and value rows), dS = P * (dP -
// delta), dQ += dS K (dS's accumulators its own A fragment, keys in pairs),
// keys and values streaming through shared memory TILE_K rows at a time:
// 64 up to 64 features each, else 32 or 16, whichever fits 99 KiB.
template <int D, int DV, bool CAUSAL, bool DROPOUT = false, bool PRECISE = true>
struct DqF32 {
    static constexpr int DP = round_up(D, 8), DVP = round_up(DV, 8);
    static_assert(DP + DVP <= 256, "the f32 backward holds up to 256 features in all");
    static constexpr int TILE_Q = 64, THREADS = 128;
    static constexpr int TILE_K = DP <= 64 && DVP <= 64                         ? 64
                                  : dq_f32_smem(DP, DVP, 32) <= 99 * 1024 ? 32
                                                                            : 16;
    static constexpr int ROW = DP + 4, ROW_V = DVP + 4;
    static constexpr int SMEM_BYTES = dq_f32_smem(DP, DVP, TILE_K);
    static_assert(SMEM_BYTES <= 99 * 1024, "the tiles fit the shared memory of every sm_80+ GPU");

    static __device__ __forceinline__ void run(const BackwardArgsF32& a) {
        const fs_i64 q0 = (fs_i64)blockIdx.x * TILE_Q, h = blockIdx.y, b = blockIdx.z, kv_h = h / a.group;
        const fs_i64 q_len = a.q_len, kv_len = keys_of(a, b);
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        FS_DYNAMIC_SMEM(smem, SMEM_BYTES);
        float* const q_tile = reinterpret_cast<float*>(smem);  // [TILE_Q][ROW]
        float* const do_tile = q_tile + TILE_Q * ROW;           // [TILE_Q][ROW_V]
        float* const k_tile = do_tile + TILE_Q * ROW_V;         // [TILE_K][ROW]
        float* const v_tile = k_tile + TILE_K * ROW;            // [TILE_K][ROW_V]
        const float* const delta = delta_of<D, false>(a);

        load_rows<TILE_Q, D, DP, ROW, THREADS>(q_tile, a.q, b, q0, h, q_len);
        load_rows<TILE_Q, DV, DVP, ROW_V, THREADS>(do_tile, a.dout, b, q0, h, q_len);
        // lse (log2 units) and delta of rows i_lo (index 0) and i_hi (index 1).
        const fs_i64 i_lo = q0 + warp * 16 + frag_row, i_hi = i_lo + 8;
        float lse2[2], dlt[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const fs_i64 i = r == 0 ? i_lo : i_hi;
            lse2[r] = i < q_len ? a.lse.at(b, h, i) * LOG2E : 0.0f;
            dlt[r] = i < q_len ? delta[(b * a.q_heads + h) * q_len + i] : 0.0f;
        }
        // dq_acc[n][e] = row i_lo + 8 * (e / 2), feature 8n + frag_col + e % 2.
        float dq_acc[DP / 8][4];
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dq_acc[n][e] = 0.0f;
        }
        const fs_i64 kv_end = visited_keys_end<TILE_Q, CAUSAL>(q0, kv_len);
        for (fs_i64 k0 = 0; k0 < kv_end; k0 += TILE_K) {
            __syncthreads();  // every warp is done with the previous tile
            load_rows<TILE_K, D, DP, ROW, THREADS>(k_tile, a.k, b, k0, kv_h, kv_len);
            load_rows<TILE_K, DV, DVP, ROW_V, THREADS>(v_tile, a.v, b, k0, kv_h, kv_len);
            __syncthreads();

            // S = Q K^T and dP = dO V^T: s[n][e], dp[n][e] = row i_lo + 8 *
            // (e / 2), key k0 + 8n + frag_col + e % 2.
            float s[TILE_K / 8][4], dp[TILE_K / 8][4];
#pragma unroll
            for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
            }
            products<DP, ROW>(s, q_tile + warp * 16 * ROW, k_tile);
            products<DVP, ROW_V>(dp, do_tile + warp * 16 * ROW_V, v_tile);
            if (DROPOUT) {
                // Z dP, so that dS = P (Z dP - delta) below.
                for_each_draw<TILE_K / 8, false>(a.drop, b * a.q_heads + h, i_lo, k0, frag_col, [&](int n, int e, bool kept) {
                    dp[n][e] *= kept ? a.drop.scale : 0.0f;
                });
            }

            // P = exp2(S * scale_log2 - lse_log2), masked (keys past kv_len;
            // causal: keys after the query) on the tiles that can need it; dS =
            // P * (dP - delta) in place of dp.
            // With dropout every tile takes the masked path: two copies of
            // the loop below (edge and inner tiles) with the draws' selects
            // need 66 more registers and spill at D = 112 (and clearing the
            // dropped entries by their bits instead spills at D = 64).
            const bool edge = DROPOUT || k0 + TILE_K > kv_len || (CAUSAL && k0 + TILE_K - 1 > q0 + warp * 16);
#pragma unroll
            for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = e >> 1;
                    float p = fs_exp2(s[n][e] * a.scale_log2 - lse2[r]);
                    if (edge) {
                        const fs_i64 j = k0 + n * 8 + frag_col + (e & 1), i = r == 0 ? i_lo : i_hi;
                        if (j >= kv_len || (CAUSAL && j > i)) p = 0.0f;
                    }
                    dp[n][e] = p * (dp[n][e] - dlt[r]);
                }
            }

            // dQ += dS K, 8 keys a step: dS's accumulators its A fragment, rows
            // 2t, 2t + 1 of the key tile the B fragment.
#pragma unroll
            for (int kk = 0; kk < TILE_K / 8; ++kk) {
                Tf32Frag<4> dsa;
                a_of_acc<PRECISE>(dsa, dp[kk]);
                mma_cols_pairs<PRECISE>(dq_acc, dsa, k_tile + kk * 8 * ROW, ROW);
            }
        }

        // dQ = scale * acc, each row once (rows past q_len dropped; a row
        // that sees one key exactly 0, as sees_one_key says why).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const fs_i64 i = r == 0 ? i_lo : i_hi;
            if (i < q_len) {
                float* const dq = a.dq.row(b, i, h);
                const bool zero = sees_one_key<CAUSAL>(i, kv_len);
#pragma unroll
                for (int n = 0; n < DP / 8; ++n) {
                    if (n * 8 < D) {
                        dq[n * 8 + frag_col] = zero ? 0.0f : dq_acc[n][2 * r] * a.scale;
                        dq[n * 8 + frag_col + 1] = zero ? 0.0f : dq_acc[n][2 * r + 1] * a.scale;
                    }
                }
            }
        }
    }

    // acc[TILE_K / 8][4] += A B^T for the warp's 16 rows (`a_rows_at`, pitch
    // P) and the tile's keys over W features, B the key or value rows of
    // `tile` (pitch P).
    template <int W, int P>
    static __device__ __forceinline__ void products(float (&acc)[TILE_K / 8][4], const float* a_rows_at, const float* tile) {
#pragma unroll
        for (int kk = 0; kk < W / 8; ++kk) {
            Tf32Frag<4> fa;
            a_rows<PRECISE>(fa, a_rows_at + kk * 8, P);
            mma_rows<PRECISE>(acc, fa, tile + kk * 8, P);
        }
    }
};

}  // namespace fs_attn

#endif

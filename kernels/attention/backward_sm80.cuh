// FlashAttention-2 backward on tensor cores, mma.sync.m16n8k16 (sm_80 and
// newer): the dK/dV kernel (key-major) in both schemes, and the
// deterministic scheme's dQ kernel (query-major). Every product accumulates
// in f32; P and dS are rounded to the inputs' 16-bit type as mma operands (as
// FlashAttention-2 does); dK and dQ are scaled once at the end.
//
// Atomic scheme (5 tile products, as FlashAttention-2): Delta<DQ_SUM = true>,
// DkDvSm80<ATOMIC = true> (each tile's dS K added into the f32 dQ sum by
// atomics), DqStore. The order of the additions, so dQ's last bits, vary
// between runs. Deterministic scheme (7 tile products, every output element
// written by one thread once): Delta<false>, DkDvSm80<false>, DqSm80.
#ifndef FS_ATTENTION_BACKWARD_SM80
#define FS_ATTENTION_BACKWARD_SM80
#include "backward.cuh"

namespace fs_attn {

// dK and dV (and with ATOMIC dQ's sum) for one block of 64 keys of one
// (batch, key/value head): warp w owns keys 16w .. 16w + 15 and computes the
// *transposed* products S^T = K Q^T and dP^T = V dO^T (A fragments of K and V,
// B fragments of query / dO rows by ldmatrix), so that P^T and dS^T come out
// in the accumulator layout, which is the A-fragment layout of the next
// products dV += P^T dO and dK += dS^T Q (B fragments by ldmatrix.trans): no
// fragment transpose or shuffle. dK and dV stay in registers while the
// queries of every head of the group stream through shared memory TILE_Q
// rows at a time. With ATOMIC, dS^T then goes to shared memory and, after a
// barrier, each warp adds its block of the tile's dQ += dS K into the f32 sum
// with atomics (red.global.add.v2.f32 on sm_90, two scalar atomics before).
//
// Wider heads than 128 padded features (dK plus dV over 256 accumulators a
// thread) take PARTS = 2 blocks per key tile, each accumulating half the
// features of dK, dV (and dQ); both compute the whole S^T and dP^T.
//
// Launch: grid (ceil(S / 64) * PARTS, Hkv, B), 128 threads, SMEM_BYTES of
// dynamic shared memory.
template <class E, int D, int DV, bool CAUSAL, bool ATOMIC, bool DROPOUT = false>
struct DkDvSm80 {
    static constexpr int PARTS = round_up(D, 16) + round_up(DV, 16) > 256 ? 2 : 1;
    static constexpr int DP = round_up(D, 16 * PARTS), DVP = round_up(DV, 16 * PARTS);
    static constexpr int FK = DP / PARTS, FV = DVP / PARTS;  // features of dK, dV per block
    static constexpr int TILE_K = 64, THREADS = 128;
    // Queries per streamed tile: 64 up to 64 features; wider, 32 where dQ is
    // summed and 16 otherwise (the fewer accumulators live, the more queries).
    static constexpr int TILE_Q = PARTS > 1 ? 16 : DP <= 64 && DVP <= 64 ? 64 : ATOMIC ? 32 : 16;
    static constexpr int ROW = DP + 8, ROW_V = DVP + 8, DS_ROW = TILE_Q + 8;
    static constexpr int SMEM_BYTES = (TILE_K * (ROW + ROW_V) + TILE_Q * (ROW + ROW_V) + (ATOMIC ? TILE_K * DS_ROW : 0)) * 2 +
                                      2 * TILE_Q * 4;

    static __device__ __forceinline__ void run(const BackwardArgs& a) {
        const int part = PARTS > 1 ? blockIdx.x % PARTS : 0;
        const fs_i64 k0 = (fs_i64)(blockIdx.x / PARTS) * TILE_K, kv_h = blockIdx.y, b = blockIdx.z;
        const fs_i64 q_len = a.q_len, kv_len = a.kv_len, keys = masked_keys_from(a, b);
        const int fk0 = part * FK, fv0 = part * FV;  // the block's first dK and dV feature
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        FS_DYNAMIC_SMEM(smem, SMEM_BYTES);
        unsigned short* const k_tile = reinterpret_cast<unsigned short*>(smem);  // [TILE_K][ROW]
        unsigned short* const v_tile = k_tile + TILE_K * ROW;                    // [TILE_K][ROW_V]
        unsigned short* const q_tile = v_tile + TILE_K * ROW_V;                  // [TILE_Q][ROW]
        unsigned short* const do_tile = q_tile + TILE_Q * ROW;                   // [TILE_Q][ROW_V]
        unsigned short* const ds_tile = do_tile + TILE_Q * ROW_V;                // dS^T of the tile: [key][query]
        float* const lse_tile = reinterpret_cast<float*>(ds_tile + (ATOMIC ? TILE_K * DS_ROW : 0));  // lse * log2(e)
        float* const delta_tile = lse_tile + TILE_Q;                             // delta of the tile's queries
        const float* const delta = delta_of<D, ATOMIC>(a);

        // 1. The block's keys and values (rows past kv_len zero; their dK, dV
        //    are never stored). The first barrier of the query loop publishes them.
        load_rows<TILE_K, D, DP, ROW, THREADS>(k_tile, a.k, b, k0, kv_h, kv_len);
        load_rows<TILE_K, DV, DVP, ROW_V, THREADS>(v_tile, a.v, b, k0, kv_h, kv_len);

        // dk_acc[n][e], dv_acc[n][e]: key row key_row + 8 * (e / 2), feature
        // fk0 / fv0 + 8n + frag_col + e % 2.
        const int key_row = warp * 16 + frag_row;
        float dk_acc[FK / 8][4], dv_acc[FV / 8][4];
#pragma unroll
        for (int n = 0; n < FK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[n][e] = 0.0f;
        }
#pragma unroll
        for (int n = 0; n < FV / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dv_acc[n][e] = 0.0f;
        }
        // Causal: query tiles before the first that can see key k0 are skipped.
        const fs_i64 i_first = CAUSAL ? (k0 / TILE_Q) * TILE_Q : 0;
        for (fs_i64 hh = 0; hh < a.group; ++hh) {
            const fs_i64 h = kv_h * a.group + hh;
            for (fs_i64 i0 = i_first; i0 < q_len; i0 += TILE_Q) {
                // 2. Queries and dO i0 .. i0 + TILE_Q - 1 of head h (rows past
                //    q_len zero), their lse (log2 units) and delta.
                __syncthreads();  // every warp is done with the previous tile
                load_rows<TILE_Q, D, DP, ROW, THREADS>(q_tile, a.q, b, i0, h, q_len);
                load_rows<TILE_Q, DV, DVP, ROW_V, THREADS>(do_tile, a.dout, b, i0, h, q_len);
                if (threadIdx.x < TILE_Q) {
                    const fs_i64 i = i0 + threadIdx.x;
                    lse_tile[threadIdx.x] = i < q_len ? a.lse.at(b, h, i) * LOG2E : 0.0f;
                    delta_tile[threadIdx.x] = i < q_len ? delta[(b * a.q_heads + h) * q_len + i] : 0.0f;
                }
                __syncthreads();

                // 3. S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys:
                //    s[n][e], dp[n][e] = key key_row + 8 * (e / 2), query i0 + 8n +
                //    frag_col + e % 2. A: the warp's K / V rows; B: query / dO rows
                //    8n .. 8n + 15, one ldmatrix each.
                float s[TILE_Q / 8][4], dp[TILE_Q / 8][4];
#pragma unroll
                for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
                }
#pragma unroll
                for (int kk = 0; kk < DP / 16; ++kk) {
                    unsigned k_frag[4];
                    fs_a_frag(k_frag, &k_tile[warp * 16 * ROW + kk * 16], ROW);
#pragma unroll
                    for (int n = 0; n < TILE_Q / 8; n += 2) {
                        unsigned bq[4];
                        fs_b_frags(bq, &q_tile[n * 8 * ROW + kk * 16], ROW);
                        E::mma(s[n], k_frag, bq[0], bq[1]);
                        E::mma(s[n + 1], k_frag, bq[2], bq[3]);
                    }
                }
#pragma unroll
                for (int kk = 0; kk < DVP / 16; ++kk) {
                    unsigned v_frag[4];
                    fs_a_frag(v_frag, &v_tile[warp * 16 * ROW_V + kk * 16], ROW_V);
#pragma unroll
                    for (int n = 0; n < TILE_Q / 8; n += 2) {
                        unsigned bo[4];
                        fs_b_frags(bo, &do_tile[n * 8 * ROW_V + kk * 16], ROW_V);
                        E::mma(dp[n], v_frag, bo[0], bo[1]);
                        E::mma(dp[n + 1], v_frag, bo[2], bo[3]);
                    }
                }

                // 4. P^T (masked where a key can come after a query or a query lies
                //    past q_len), then dS^T = P^T * (dP^T - delta) in place of dp.
                p_of_s<TILE_Q, TILE_K, CAUSAL>(s, lse_tile, i0, k0, q_len, keys, key_row, frag_col, a.scale_log2);
                if (DROPOUT) {
                    // With the mask's factors Z (0 or 1 / (1 - p)): dS^T = P^T (Z dP^T -
                    // delta), and dV takes (P Z)^T.
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

                // 5. dV += P^T dO and dK += dS^T Q. The accumulators of queries
                //    16kk .. 16kk + 15 are the A fragments; the B fragments of
                //    features 8n .. 8n + 15 come from the dO / Q rows in one
                //    ldmatrix.trans each.
#pragma unroll
                for (int kk = 0; kk < TILE_Q / 16; ++kk) {
                    unsigned p_frag[4], ds_frag[4];
                    a_frag_of<E>(p_frag, s, kk);
                    a_frag_of<E>(ds_frag, dp, kk);
                    if (ATOMIC) {
                        // dS^T into the shared tile (rows key_row and key_row + 8) for dQ below.
                        fs_st32(&ds_tile[key_row * DS_ROW + kk * 16 + frag_col], ds_frag[0]);
                        fs_st32(&ds_tile[(key_row + 8) * DS_ROW + kk * 16 + frag_col], ds_frag[1]);
                        fs_st32(&ds_tile[key_row * DS_ROW + kk * 16 + 8 + frag_col], ds_frag[2]);
                        fs_st32(&ds_tile[(key_row + 8) * DS_ROW + kk * 16 + 8 + frag_col], ds_frag[3]);
                    }
#pragma unroll
                    for (int n = 0; n < FV / 8; n += 2) {
                        unsigned bo[4];
                        fs_b_frags_t(bo, &do_tile[kk * 16 * ROW_V + fv0 + n * 8], ROW_V);
                        E::mma(dv_acc[n], p_frag, bo[0], bo[1]);
                        E::mma(dv_acc[n + 1], p_frag, bo[2], bo[3]);
                    }
#pragma unroll
                    for (int n = 0; n < FK / 8; n += 2) {
                        unsigned bq[4];
                        fs_b_frags_t(bq, &q_tile[kk * 16 * ROW + fk0 + n * 8], ROW);
                        E::mma(dk_acc[n], ds_frag, bq[0], bq[1]);
                        E::mma(dk_acc[n + 1], ds_frag, bq[2], bq[3]);
                    }
                }
                if (ATOMIC) add_dq(a, k_tile, ds_tile, b, h, i0, fk0, warp, frag_row, frag_col);
            }
        }

        // Last, each key row once: dK = scale * acc, dV = acc.
        clear_dk_of_one_key(a, b, dk_acc);
        store_dk_dv<E, D, DV>(a, dk_acc, dv_acc, b, kv_h, k0, key_row, frag_col, fk0, fv0);
    }

    // dQ += dS K for the tile's queries, the block's keys and its dK features,
    // added into the f32 sum in the scratch ([B, Hq, T, D]) by atomics. A: dS
    // from the shared dS^T tile (ldmatrix.trans); B: the key rows. Warp w takes
    // queries 16 * (w / SPLIT) .. + 15 and every SPLIT-th run of PAIRS 16-feature
    // column pairs (fewer registers live than all of them at once).
    static __device__ __forceinline__ void add_dq(const BackwardArgs& a, const unsigned short* k_tile, const unsigned short* ds_tile,
                                                  fs_i64 b, fs_i64 h, fs_i64 i0, int fk0, int warp, int frag_row, int frag_col) {
        constexpr int SPLIT = (THREADS / 32) / (TILE_Q / 16), NP = FK / 16;
        constexpr int PAIRS = NP % (2 * SPLIT) == 0 ? 2 : 1;
        __syncthreads();  // dS^T is complete
        const int m0 = (warp / SPLIT) * 16;
        for (int pp = (warp % SPLIT) * PAIRS; pp < NP; pp += SPLIT * PAIRS) {
            const int c0 = fk0 + pp * 16;
            float dq_acc[2 * PAIRS][4];
#pragma unroll
            for (int n = 0; n < 2 * PAIRS; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) dq_acc[n][e] = 0.0f;
            }
#pragma unroll
            for (int kk = 0; kk < TILE_K / 16; ++kk) {
                unsigned ds_a[4];
                fs_a_frag_t(ds_a, &ds_tile[kk * 16 * DS_ROW + m0], DS_ROW);
#pragma unroll
                for (int n = 0; n < 2 * PAIRS; n += 2) {
                    unsigned bk[4];
                    fs_b_frags_t(bk, &k_tile[kk * 16 * ROW + c0 + n * 8], ROW);
                    E::mma(dq_acc[n], ds_a, bk[0], bk[1]);
                    E::mma(dq_acc[n + 1], ds_a, bk[2], bk[3]);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const fs_i64 i = i0 + m0 + frag_row + 8 * r;
                if (i < a.q_len) {
                    float* const sum = &a.scratch[((b * a.q_heads + h) * a.q_len + i) * D + c0 + frag_col];
#pragma unroll
                    for (int n = 0; n < 2 * PAIRS; ++n)
                        if (c0 + n * 8 < D) fs_atomic_add2(sum + n * 8, dq_acc[n][2 * r], dq_acc[n][2 * r + 1]);
                }
            }
        }
    }
};

// The deterministic scheme's dQ: one block of 4 warps per 64 queries of one
// (batch, query head), warp w owning rows 16w .. 16w + 15, query-major like
// the forward: S = Q K^T and dP = dO V^T (B from the key / value rows), dS =
// P * (dP - delta), dQ += dS K, keys and values streaming through shared
// memory TILE_K rows at a time. Up to 128 padded features Q and dO stay in
// registers as A fragments; wider, in shared memory.
//
// Launch: grid (ceil(T / 64), Hq, B), 128 threads, SMEM_BYTES of dynamic
// shared memory.
template <class E, int D, int DV, bool CAUSAL, bool DROPOUT = false>
struct DqSm80 {
    static constexpr int DP = round_up(D, 16), DVP = round_up(DV, 16);
    static constexpr int TILE_Q = 64, THREADS = 128;
    static constexpr bool IN_REGS = DP <= 128 && DVP <= 128;
    // Keys per tile: fewer as dQ's accumulators (D / 2 registers a thread)
    // grow, and half as many (at least 16) with dropout, whose draws take
    // registers of their own (on sm_90 the full tiles spilled at D = 48, 144
    // and 192).
    static constexpr int TILE_K_FULL = DP <= 64 && DVP <= 64 ? 64 : DP <= 192 ? 32 : 16;
    static constexpr int TILE_K = DROPOUT ? (TILE_K_FULL / 2 > 16 ? TILE_K_FULL / 2 : 16) : TILE_K_FULL;
    static constexpr int ROW = DP + 8, ROW_V = DVP + 8;
    // At 128 features the registers are nearly all taken (Q, dO and dQ stay
    // in them): four fragments at once spill, so K and V are read 32 bits at
    // a time there.
    static constexpr bool BY_WORDS = DP > 64 || DVP > 64;
    // The key tile and the value tile; the query and dO tiles (staged there
    // before the first key tile when they go to registers).
    static constexpr int KV_ELEMS = TILE_K * (ROW + ROW_V), QD_ELEMS = TILE_Q * (ROW + ROW_V);
    static constexpr int SMEM_BYTES = (IN_REGS ? (KV_ELEMS > QD_ELEMS ? KV_ELEMS : QD_ELEMS) : KV_ELEMS + QD_ELEMS) * 2;

    static __device__ __forceinline__ void run(const BackwardArgs& a) {
        const fs_i64 q0 = (fs_i64)blockIdx.x * TILE_Q, h = blockIdx.y, b = blockIdx.z, kv_h = h / a.group;
        // The batch entry's keys: past them, padding (never visited).
        const fs_i64 q_len = a.q_len, kv_len = keys_of(a, b);
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        FS_DYNAMIC_SMEM(smem, SMEM_BYTES);
        unsigned short* const k_tile = reinterpret_cast<unsigned short*>(smem);  // [TILE_K][ROW]
        unsigned short* const v_tile = k_tile + TILE_K * ROW;                    // [TILE_K][ROW_V]
        unsigned short* const q_tile = IN_REGS ? k_tile : v_tile + TILE_K * ROW_V;  // [TILE_Q][ROW]
        unsigned short* const do_tile = q_tile + TILE_Q * ROW;                       // [TILE_Q][ROW_V]
        const float* const delta = delta_of<D, false>(a);

        // 1. Q and dO of the tile (rows past q_len zero) and, up to 128
        //    features, their A fragments: frag[kk] covers features 16kk ..
        //    16kk + 15 of rows q_row and q_row + 8.
        const int q_row = warp * 16 + frag_row;
        load_rows<TILE_Q, D, DP, ROW, THREADS>(q_tile, a.q, b, q0, h, q_len);
        load_rows<TILE_Q, DV, DVP, ROW_V, THREADS>(do_tile, a.dout, b, q0, h, q_len);
        __syncthreads();
        unsigned q_frag[IN_REGS ? DP / 16 : 1][4], do_frag[IN_REGS ? DVP / 16 : 1][4];
        if (IN_REGS) {
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk) fs_a_frag(q_frag[IN_REGS ? kk : 0], &q_tile[warp * 16 * ROW + kk * 16], ROW);
#pragma unroll
            for (int kk = 0; kk < DVP / 16; ++kk) fs_a_frag(do_frag[IN_REGS ? kk : 0], &do_tile[warp * 16 * ROW_V + kk * 16], ROW_V);
        }
        // lse (log2 units) and delta of rows q_row (index 0) and q_row + 8 (index 1).
        const fs_i64 i_lo = q0 + q_row, i_hi = i_lo + 8;
        float lse2[2], dlt[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const fs_i64 i = r == 0 ? i_lo : i_hi;
            lse2[r] = i < q_len ? a.lse.at(b, h, i) * LOG2E : 0.0f;
            dlt[r] = i < q_len ? delta[(b * a.q_heads + h) * q_len + i] : 0.0f;
        }

        // dq_acc[n][e] = row q_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
        float dq_acc[DP / 8][4];
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dq_acc[n][e] = 0.0f;
        }
        // Causal: key tiles after the query tile's last row are never visited.
        const fs_i64 kv_end = visited_keys_end<TILE_Q, CAUSAL>(q0, kv_len);
        for (fs_i64 k0 = 0; k0 < kv_end; k0 += TILE_K) {
            // 2. Keys and values k0 .. k0 + TILE_K - 1 (rows past kv_len zero).
            __syncthreads();  // every warp is done with the previous tile (and the staging)
            load_rows<TILE_K, D, DP, ROW, THREADS>(k_tile, a.k, b, k0, kv_h, kv_len);
            load_rows<TILE_K, DV, DVP, ROW_V, THREADS>(v_tile, a.v, b, k0, kv_h, kv_len);
            __syncthreads();

            // 3. S = Q K^T and dP = dO V^T: s[n][e], dp[n][e] = row q_row + 8 *
            //    (e / 2), key k0 + 8n + frag_col + e % 2.
            float s[TILE_K / 8][4], dp[TILE_K / 8][4];
#pragma unroll
            for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
            }
            products<DP, ROW>(s, q_frag, q_tile, k_tile, warp, frag_row, frag_col);
            products<DVP, ROW_V>(dp, do_frag, do_tile, v_tile, warp, frag_row, frag_col);
            if (DROPOUT) {
                // Z dP, so that dS = P (Z dP - delta) below.
                for_each_draw<TILE_K / 8, false>(a.drop, b * a.q_heads + h, i_lo, k0, frag_col, [&](int n, int e, bool kept) {
                    dp[n][e] *= kept ? a.drop.scale : 0.0f;
                });
            }

            // 4. P = exp2(S * scale_log2 - lse_log2), masked (keys past kv_len;
            //    causal: keys after the query) only on tiles that can need it;
            //    dS = P * (dP - delta), in place of dp.
            const bool edge = k0 + TILE_K > kv_len || (CAUSAL && k0 + TILE_K - 1 > q0 + warp * 16);
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

            // 5. dQ += dS K: the accumulators of keys 16kk .. 16kk + 15 are dS's A
            //    fragment; the B fragments of features 8n .. 8n + 15 come from
            //    the key rows in one ldmatrix.trans.
#pragma unroll
            for (int kk = 0; kk < TILE_K / 16; ++kk) {
                unsigned ds_frag[4];
                a_frag_of<E>(ds_frag, dp, kk);
#pragma unroll
                for (int n = 0; n < DP / 8; n += 2) {
                    unsigned kb[4];
                    fs_b_frags_t(kb, &k_tile[kk * 16 * ROW + n * 8], ROW);
                    E::mma(dq_acc[n], ds_frag, kb[0], kb[1]);
                    E::mma(dq_acc[n + 1], ds_frag, kb[2], kb[3]);
                }
            }
        }

        // 6. dQ = scale * acc, each row once (rows past q_len dropped; a row
        //    that sees one key exactly 0, as sees_one_key says why).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const fs_i64 i = r == 0 ? i_lo : i_hi;
            if (i < q_len) {
                unsigned short* const dq = a.dq.row(b, i, h);
                const bool zero = sees_one_key<CAUSAL>(i, kv_len);
#pragma unroll
                for (int n = 0; n < DP / 8; ++n) {
                    if (n * 8 < D) {
                        dq[n * 8 + frag_col] = E::from_float(zero ? 0.0f : dq_acc[n][2 * r] * a.scale);
                        dq[n * 8 + frag_col + 1] = E::from_float(zero ? 0.0f : dq_acc[n][2 * r + 1] * a.scale);
                    }
                }
            }
        }
    }

    // acc[TILE_K / 8][4] += A B^T for the warp's 16 rows and the tile's keys
    // over W features: A from registers (`frag`) or the shared tile `a_tile`,
    // B the key or value rows of `tile` (pitch P), by ldmatrix or, with
    // BY_WORDS, in 32-bit loads.
    template <int W, int P, int NF>
    static __device__ __forceinline__ void products(float (&acc)[TILE_K / 8][4], const unsigned (&frag)[NF][4], const unsigned short* a_tile,
                                                    const unsigned short* tile, int warp, int frag_row, int frag_col) {
#pragma unroll
        for (int kk = 0; kk < W / 16; ++kk) {
            unsigned fa[4];
            if (IN_REGS) {
#pragma unroll
                for (int x = 0; x < 4; ++x) fa[x] = frag[IN_REGS ? kk : 0][x];
            } else {
                fs_a_frag(fa, &a_tile[warp * 16 * P + kk * 16], P);
            }
#pragma unroll
            for (int n = 0; n < TILE_K / 8; n += 2) {
                if (BY_WORDS) {
#pragma unroll
                    for (int m = n; m < n + 2; ++m) {
                        const unsigned short* row = &tile[(m * 8 + frag_row) * P + kk * 16 + frag_col];
                        E::mma(acc[m], fa, fs_ld32(row), fs_ld32(row + 8));
                    }
                } else {
                    unsigned bk[4];
                    fs_b_frags(bk, &tile[n * 8 * P + kk * 16], P);
                    E::mma(acc[n], fa, bk[0], bk[1]);
                    E::mma(acc[n + 1], fa, bk[2], bk[3]);
                }
            }
        }
    }
};

}  // namespace fs_attn

#endif

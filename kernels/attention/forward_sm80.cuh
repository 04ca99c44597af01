// FlashAttention-2 forward on tensor cores, mma.sync.m16n8k16 (sm_80 and
// newer): O = softmax(Q K^T * scale) V and the log-sum-exp of every row,
// never an N x N matrix in device memory.
//
// One block of 4 warps owns 64 query rows of one (batch, query head); warp w
// owns rows 16w .. 16w + 15. Keys and values stream through shared memory a
// tile at a time (rows padded by 8 elements, so fragment reads are free of
// bank conflicts): S = Q K^T with f32 accumulation, an online softmax per row
// (running max, running sum, accumulator rescale), P rounded to 16 bits in
// registers (the S accumulator layout *is* the A fragment layout of P, so no
// shuffle is needed) and O += P V. Causal: key tiles after the query tile are
// never visited, and only tail and diagonal tiles are masked.
//
// Head dims are padded to a multiple of 16 inside the tiles (zeros), so any
// multiple of 8 runs on tensor cores. Up to 128 padded features the queries
// stay in registers as A fragments and keys come 64 at a time; wider heads
// keep the queries in shared memory and take 32 keys a tile, which keeps the
// output accumulators (Dv / 2 registers a thread) and the scores in registers.
//
// Launch: grid (ceil(T / 64), Hq, B), 128 threads, SMEM_BYTES of dynamic
// shared memory.
#ifndef FS_ATTENTION_FORWARD_SM80
#define FS_ATTENTION_FORWARD_SM80
#include "common.cuh"

namespace fs_attn {

// E: Bf16 or F16. D: the head dim of q and k, DV: of v (multiples of 8).
// CAUSAL: keys j > query i are masked. SCALE_IN_EXP: the scale is positive,
// so it can go into the exponent after the row max. DROPOUT: a.drop's mask
// zeroes probabilities after the row sum takes them (the log-sum-exp is the
// undropped row's) and before P V; O takes the 1 / (1 - p) at the end.
template <class E, int D, int DV, bool CAUSAL, bool SCALE_IN_EXP, bool DROPOUT = false>
struct ForwardSm80 {
    static constexpr int DP = round_up(D, 16), DVP = round_up(DV, 16);  // padded head dims
    static constexpr int TILE_Q = 64, THREADS = 128;
    static constexpr bool Q_IN_REGS = DP <= 128 && DVP <= 128;
    static constexpr int TILE_K = Q_IN_REGS ? 64 : 32;
    // Shared row pitches: 16-byte rows, conflict-free fragment reads.
    static constexpr int ROW = DP + 8, ROW_V = DVP + 8;
    // K^T's fragments by ldmatrix up to 64 features; wider, in 32-bit loads
    // (on an H100 the D = 128 forward ran 26-34% slower with ldmatrix there).
    static constexpr bool K_BY_WORDS = DP > 64;
    static constexpr int SMEM_BYTES = (TILE_K * ROW + TILE_K * ROW_V + (Q_IN_REGS ? 0 : TILE_Q * ROW)) * 2;
    // The queries are staged in the key tile when they go to registers.
    static_assert(!Q_IN_REGS || TILE_K >= TILE_Q, "the key tile holds the query tile");

    static __device__ __forceinline__ void run(const ForwardArgs& a) {
        const fs_i64 q0 = (fs_i64)blockIdx.x * TILE_Q, h = blockIdx.y, b = blockIdx.z, kv_h = h / a.group;
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        FS_DYNAMIC_SMEM(smem, SMEM_BYTES);
        unsigned short* const k_tile = reinterpret_cast<unsigned short*>(smem);  // [TILE_K][ROW]
        unsigned short* const v_tile = k_tile + TILE_K * ROW;                    // [TILE_K][ROW_V]
        unsigned short* const q_tile = Q_IN_REGS ? k_tile : v_tile + TILE_K * ROW_V;  // [TILE_Q][ROW]

        // 1. The tile's queries into shared memory (rows past q_len zero) and,
        //    up to 128 features, each warp's A fragments: q_frag[kk] covers
        //    features 16kk .. 16kk + 15 of rows q_row and q_row + 8.
        load_rows<TILE_Q, D, DP, ROW, THREADS>(q_tile, a.q, b, q0, h, a.q_len);
        __syncthreads();
        const int q_row = warp * 16 + frag_row;
        unsigned q_frag[Q_IN_REGS ? DP / 16 : 1][4];
        if (Q_IN_REGS) {
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk) fs_a_frag(q_frag[Q_IN_REGS ? kk : 0], &q_tile[warp * 16 * ROW + kk * 16], ROW);
        }

        // Running state of this thread's rows q_row (index 0) and q_row + 8
        // (index 1): the max score in log2 units, this thread's part of the row
        // sum, and o_acc[n][e] = row q_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
        float row_max[2] = {FS_NEG_INF, FS_NEG_INF}, row_sum[2] = {0.0f, 0.0f};
        float o_acc[DVP / 8][4];
#pragma unroll
        for (int n = 0; n < DVP / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[n][e] = 0.0f;
        }
        const fs_i64 i_lo = q0 + q_row, i_hi = i_lo + 8;
        // Causal: key tiles after the query tile's last row are never visited.
        const fs_i64 kv_len = keys_of(a, b);
        const fs_i64 kv_end = visited_keys_end<TILE_Q, CAUSAL>(q0, kv_len);
        for (fs_i64 k0 = 0; k0 < kv_end; k0 += TILE_K) {
            // 2. Keys and values k0 .. k0 + TILE_K - 1 into shared memory (rows past kv_len zero).
            __syncthreads();  // every warp is done with the previous tile (and the queries)
            load_rows<TILE_K, D, DP, ROW, THREADS>(k_tile, a.k, b, k0, kv_h, kv_len);
            load_rows<TILE_K, DV, DVP, ROW_V, THREADS>(v_tile, a.v, b, k0, kv_h, kv_len);
            __syncthreads();

            // 3. Scores S = Q K^T of the warp's 16 rows and the tile's keys (not
            //    yet scaled): s[n][e] = row q_row + 8 * (e / 2), key k0 + 8n +
            //    frag_col + e % 2.
            float s[TILE_K / 8][4];
#pragma unroll
            for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
            }
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk) {
                unsigned qa[4];
                if (Q_IN_REGS) {
#pragma unroll
                    for (int x = 0; x < 4; ++x) qa[x] = q_frag[Q_IN_REGS ? kk : 0][x];
                } else {
                    fs_a_frag(qa, &q_tile[warp * 16 * ROW + kk * 16], ROW);
                }
#pragma unroll
                for (int n = 0; n < TILE_K / 8; n += 2) {
                    if (K_BY_WORDS) {
#pragma unroll
                        for (int m = n; m < n + 2; ++m) {
                            const unsigned short* key = &k_tile[(m * 8 + frag_row) * ROW + kk * 16 + frag_col];
                            E::mma(s[m], qa, fs_ld32(key), fs_ld32(key + 8));
                        }
                    } else {
                        // The B fragments (K^T) of keys 8n .. 8n + 15 in one ldmatrix.
                        unsigned kb[4];
                        fs_b_frags(kb, &k_tile[n * 8 * ROW + kk * 16], ROW);
                        E::mma(s[n], qa, kb[0], kb[1]);
                        E::mma(s[n + 1], qa, kb[2], kb[3]);
                    }
                }
            }

            // 4, 5. Masks where a key can be invisible, the online softmax; O
            //    takes the rows' rescale.
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

            // 6. O += P V. The accumulators of keys 16kk .. 16kk + 15 (s[2kk],
            //    s[2kk + 1]) are exactly P's A fragment; the B fragments of
            //    features 8n .. 8n + 15 come from the value rows in one ldmatrix.trans.
#pragma unroll
            for (int kk = 0; kk < TILE_K / 16; ++kk) {
                unsigned p_frag[4];
                a_frag_of<E>(p_frag, s, kk);
#pragma unroll
                for (int n = 0; n < DVP / 8; n += 2) {
                    unsigned vb[4];
                    fs_b_frags_t(vb, &v_tile[kk * 16 * ROW_V + n * 8], ROW_V);
                    E::mma(o_acc[n], p_frag, vb[0], vb[1]);
                    E::mma(o_acc[n + 1], p_frag, vb[2], vb[3]);
                }
            }
        }

        // 7. O and the log-sum-exp.
        if (DROPOUT) {
#pragma unroll
            for (int n = 0; n < DVP / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[n][e] *= a.drop.scale;
            }
        }
        store_output<E, DV>(a, o_acc, row_max, row_sum, b, h, i_lo, i_hi, frag_col);
    }
};

}  // namespace fs_attn

#endif

// FlashAttention forward on Hopper tensor cores (sm_90a): the algorithm of
// forward_sm80.cuh on warpgroup instructions (wgmma.mma_async) fed from
// shared memory by descriptors, with the key and value tiles copied by bulk
// tensor copies (TMA) from one producer thread and handed over by
// shared-memory barriers (mbarrier).
//
// One block owns TILE_Q query rows of one (batch, query head). Its consumer
// warpgroups compute: warpgroup wg owns rows 64wg .. 64wg + 63 and its warp w
// rows 64wg + 16w .. + 15, the rows of wgmma's accumulator fragments. The
// last warpgroup gives its registers to the consumers (setmaxnreg) and only
// copies key and value tiles into STAGES buffers each, from its first
// thread: it waits on a buffer's "empty" mbarrier (every consumer warp
// arrives once its wgmma reading it is done), arrives on its "full" mbarrier
// expecting the tile's bytes, and issues the tile's copies, which complete
// "full" as they land; the consumers wait on "full" before their wgmma read it.
//
// Per key tile t each consumer warpgroup issues S = Q K^T together with tile
// t - 1's O += P V (P rounded to 16 bits in registers: wgmma's register A
// fragment is m16n8k16's), so the masks and the online softmax of tile t
// (common.cuh) run while the tensor cores do the product, and O takes the
// softmax's rescale once that lands. The warpgroups take turns issuing their
// products (FlashAttention-3's ping-pong), so one's softmax also runs while
// the others' products do. Causal blocks run the longest query tiles first.
//
// Q sits in shared memory in wgmma's core-matrix layout (CoreTile, copied once
// by every thread); K and V tiles as the copies land them (SwizzledTile), K
// read K-major (as B of S = Q K^T), V MN-major (as B of O = P V). Head dims
// are padded inside the tiles (the copies read features past D as zeros) to
// a multiple of 16, or of 64 where 16 would leave the 32-byte swizzle and 64
// costs at most a seventh more work (swizzle_pad: 112 -> 128); the swizzle is
// the widest whose box divides them.
//
// Launch: grid (ceil(T / TILE_Q), Hq, B), THREADS threads, SMEM_BYTES of
// dynamic shared memory, after the other arguments the tensor maps of K and V
// (boxes of KT::ATOM / VT::ATOM features by TILE_K rows, swizzled KT::SW /
// VT::SW bytes), by value.
#ifndef FS_ATTENTION_FORWARD_SM90
#define FS_ATTENTION_FORWARD_SM90
#include "sm90.cuh"

namespace fs_attn {

// DROPOUT: as ForwardSm80's (the probabilities zeroed by a.drop's mask after
// the row sum takes them, O scaled by 1 / (1 - p) at the end).
template <class E, int D, int DV, bool CAUSAL, bool SCALE_IN_EXP, bool DROPOUT = false>
struct ForwardSm90 {
    static constexpr int DP = swizzle_pad(D), DVP = swizzle_pad(DV);
    // Three consumer warpgroups (192 query rows) where their registers allow,
    // so that each key and value tile serves 1.5x the queries; two above 64
    // features, and with dropout (whose draws spilled three warpgroups' 128
    // registers a thread at D = 24 to 64).
    static constexpr int WGS = DP <= 64 && DVP <= 64 && !DROPOUT ? 3 : 2;
    static constexpr int TILE_Q = 64 * WGS;
    // 128 keys a tile up to 128 features (on an H100, 7-15% faster than 64:
    // fewer, wider wgmma); 64 above, where the output accumulators take half
    // the registers and the tiles most of shared memory.
    static constexpr int TILE_K = DP <= 128 && DVP <= 128 ? 128 : 64;
    static constexpr int STAGES = 2;  // buffers of key tiles, and of value tiles
    static constexpr int CONSUMERS = 128 * WGS, PRODUCERS = 128, THREADS = CONSUMERS + PRODUCERS;
    // The producer keeps setmaxnreg's least; the consumers take the rest.
    static constexpr unsigned PRODUCER_REGS = 24, CONSUMER_REGS = regs_left(THREADS, PRODUCERS, PRODUCER_REGS);
    typedef CoreTile<DP> QT;
    typedef SwizzledTile<TILE_K, DP> KT;
    typedef SwizzledTile<TILE_K, DVP> VT;
    static constexpr unsigned Q_BYTES = TILE_Q * DP * 2;
    static constexpr unsigned SMEM_BYTES = Q_BYTES + STAGES * (KT::BYTES + VT::BYTES) + 4 * STAGES * 8 + 1024;
    static_assert(Q_BYTES % 1024 == 0 && KT::BYTES % 1024 == 0 && VT::BYTES % 1024 == 0, "swizzled tiles start 1024-byte aligned");

    static __device__ __forceinline__ void run(const ForwardArgs& a, const fs_tmap& tm_k, const fs_tmap& tm_v) {
        // Causal blocks take the longest query tiles first.
        const fs_i64 q0 = (fs_i64)(CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * TILE_Q;
        const fs_i64 h = blockIdx.y, b = blockIdx.z, kv_h = h / a.group;
        const int lane = threadIdx.x & 31;
        FS_DYNAMIC_SMEM(smem_raw, SMEM_BYTES);
        unsigned char* const smem = fs_align1024(smem_raw);  // for the swizzle
        unsigned short* const q_tile = reinterpret_cast<unsigned short*>(smem);  // [TILE_Q][DP], core matrices
        unsigned char* const k_tiles = smem + Q_BYTES;                          // STAGES x KT
        unsigned char* const v_tiles = k_tiles + STAGES * KT::BYTES;             // STAGES x VT
        // Buffer s's k_full[s] / v_full[s] complete when its copies' bytes have
        // landed, k_empty[s] / v_empty[s] when every consumer warp is done reading it.
        fs_mbar* const k_full = reinterpret_cast<fs_mbar*>(v_tiles + STAGES * VT::BYTES);
        fs_mbar* const v_full = k_full + STAGES;
        fs_mbar* const k_empty = k_full + 2 * STAGES;
        fs_mbar* const v_empty = k_full + 3 * STAGES;

        // 1. The tile's queries, by every thread (rows past q_len zero).
        load_core_rows<TILE_Q, D, DP, THREADS>(q_tile, a.q, b, q0, h, a.q_len, threadIdx.x);
        if (threadIdx.x == 0) {
            for (int i = 0; i < 2 * STAGES; ++i) fs_mbar_init(&k_full[i], 1);
            for (int i = 2 * STAGES; i < 4 * STAGES; ++i) fs_mbar_init(&k_full[i], CONSUMERS / 32);
        }
        fs_copy_async_commit();
        fs_copy_async_wait_all();
        fs_fence_async_smem();
        __syncthreads();
        // Causal: key tiles after the query tile's last row are never visited.
        // Padded keys (past the batch entry's length) are never visited either.
        const fs_i64 kv_len = keys_of(a, b);
        const fs_i64 kv_end = visited_keys_end<TILE_Q, CAUSAL>(q0, kv_len);
        const int tiles = (int)((kv_end + TILE_K - 1) / TILE_K);

        if (threadIdx.x >= CONSUMERS) {
            // 2. The producer: key tile t into buffer t % STAGES once the
            //    consumers are done with tile t - STAGES, then its value tile
            //    likewise, each as boxes of TILE_K rows (rows past kv_len zero).
            fs_setmaxnreg_dec<PRODUCER_REGS>();
            if (threadIdx.x != CONSUMERS) return;
            int buf = 0;         // t % STAGES
            unsigned phase = 0;  // (t / STAGES) & 1
            for (int t = 0; t < tiles; ++t) {
                const int k0 = t * TILE_K;
                if (t >= STAGES) fs_mbar_wait(&k_empty[buf], phase ^ 1);
                fs_mbar_expect_tx(&k_full[buf], KT::BYTES);
                unsigned char* const kt = k_tiles + buf * KT::BYTES;
#pragma unroll
                for (int x = 0; x < DP / KT::ATOM; ++x)
                    fs_tma_load(kt + x * KT::BOX, tm_k, x * KT::ATOM, (int)kv_h, k0, (int)b, &k_full[buf]);
                fs_mbar_tma_issued(&k_full[buf]);
                if (t >= STAGES) fs_mbar_wait(&v_empty[buf], phase ^ 1);
                fs_mbar_expect_tx(&v_full[buf], VT::BYTES);
                unsigned char* const vt = v_tiles + buf * VT::BYTES;
#pragma unroll
                for (int x = 0; x < DVP / VT::ATOM; ++x)
                    fs_tma_load(vt + x * VT::BOX, tm_v, x * VT::ATOM, (int)kv_h, k0, (int)b, &v_full[buf]);
                fs_mbar_tma_issued(&v_full[buf]);
                if (++buf == STAGES) buf = 0, phase ^= 1;
            }
            return;
        }

        fs_setmaxnreg_inc<CONSUMER_REGS>();
        const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
        // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        // Running state of this thread's rows q_row (index 0) and q_row + 8
        // (index 1): the max score in log2 units, this thread's part of the row
        // sum, and o_acc[n][e] = row q_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
        const int q_row = wg * 64 + warp * 16 + frag_row;
        float row_max[2] = {FS_NEG_INF, FS_NEG_INF}, row_sum[2] = {0.0f, 0.0f}, o_rescale[2];
        float o_acc[DVP / 8][4];
#pragma unroll
        for (int n = 0; n < DVP / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[n][e] = 0.0f;
        }
        const fs_i64 i_lo = q0 + q_row, i_hi = i_lo + 8, first_row = q0 + wg * 64 + warp * 16;
        // wgmma descriptors of the warpgroup's queries and of the first key and
        // value buffers; a buffer's and a step's are these moved on (fs_desc_at).
        const fs_desc q_desc = QT::kmajor(q_tile + wg * 64 * DP);
        const fs_desc k_desc = KT::kmajor(k_tiles), v_desc = VT::mnmajor(v_tiles);
        // s[n][e]: tile t's scores, row q_row + 8 * (e / 2), key k0 + 8n + frag_col + e % 2;
        // p_frag: tile t - 1's P as wgmma's register A fragments (keys 16kk .. 16kk + 15).
        float s[TILE_K / 8][4];
        unsigned p_frag[TILE_K / 16][4];
        // Turns at the tensor cores: warpgroup wg issues its products once it has
        // passed named barrier 1 + wg, to which the warpgroup before it
        // (cyclically) arrives once it has issued its own; the last warpgroup
        // lets the first start. Every warpgroup issues tiles + 1 times, the last
        // one's final arrival left out so that no barrier is left half-passed.
        constexpr int TURN = 2 * 128;  // a turn barrier's threads: the warpgroup waiting, the one arriving
        const int next_wg = wg + 1 == WGS ? 0 : wg + 1;
        if (tiles > 0 && wg == WGS - 1) fs_bar_arrive(1, TURN);

        // 3. S = Q K^T of the warpgroup's 64 rows and the tile's keys (K-major:
        //    features 16kk .. from each descriptor's k step).
        auto issue_s = [&](fs_desc kt_desc) {
            fs_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk)
                wgmma_ss<E, KT, false, TILE_K, 0>(s, fs_desc_at(q_desc, QT::k_step(kk)), fs_desc_at(kt_desc, KT::k_step(kk)), kk);
        };
        // 6. O += P V of a tile (P's register fragments; V as B read MN-major,
        //    keys 16kk .. at its k step).
        auto issue_pv = [&](fs_desc vt_desc) {
#pragma unroll
            for (int kk = 0; kk < TILE_K / 16; ++kk) wgmma_rs<E, VT, true, DVP>(o_acc, p_frag[kk], fs_desc_at(vt_desc, VT::mn_k_step(kk)), 1);
        };
        // 4, 5. The masks and the online softmax of the scores, then P as the next
        //    product's A fragments.
        auto softmax = [&](fs_i64 k0) {
            mask_and_softmax<TILE_K, CAUSAL, SCALE_IN_EXP>(s, row_max, row_sum, o_rescale, k0, kv_len, first_row, i_lo, i_hi,
                                                           frag_col, a.scale_log2);
            if (DROPOUT) {
                for_each_draw<TILE_K / 8, false>(a.drop, b * a.q_heads + h, i_lo, k0, frag_col, [&](int n, int e, bool kept) {
                    if (!kept) s[n][e] = 0.0f;
                });
            }
        };
        auto pack = [&]() {
#pragma unroll
            for (int kk = 0; kk < TILE_K / 16; ++kk) a_frag_of<E>(p_frag[kk], s, kk);
        };

        // Tile 0's scores alone (no P V yet).
        if (tiles > 0) {
            fs_mbar_wait(&k_full[0], 0);
            fs_bar_sync(1 + wg, TURN);
            issue_s(k_desc);
            fs_wgmma_commit();
            fs_bar_arrive(1 + next_wg, TURN);
            fs_wgmma_wait_all();
            fs_wgmma_hold(s);
            if (lane == 0) fs_mbar_arrive(&k_empty[0]);
            softmax(0);
            pack();
        }
        int buf = 0, prev = 0;  // t % STAGES, (t - 1) % STAGES
        unsigned phase = 0, prev_phase = 0;
        for (int t = 1; t < tiles; ++t) {
            prev = buf, prev_phase = phase;
            if (++buf == STAGES) buf = 0, phase ^= 1;
            const fs_i64 k0 = (fs_i64)t * TILE_K;
            fs_mbar_wait(&k_full[buf], phase);
            fs_mbar_wait(&v_full[prev], prev_phase);

            // Tile t's scores, then O += P V for tile t - 1, as two commit groups.
            fs_bar_sync(1 + wg, TURN);
            issue_s(fs_desc_at(k_desc, buf * KT::BYTES));
            fs_wgmma_commit();
            issue_pv(fs_desc_at(v_desc, prev * VT::BYTES));
            fs_wgmma_commit();
            fs_bar_arrive(1 + next_wg, TURN);

            // The scores land first (O += P V may still run): key tile t is free.
            fs_wgmma_wait_all_but_1();
            fs_wgmma_hold(s);
            if (lane == 0) fs_mbar_arrive(&k_empty[buf]);
            softmax(k0);
            // O += P V of tile t - 1 has landed (value tile t - 1 is free): O takes
            // this tile's rescale, and P becomes the next product's A fragments.
            fs_wgmma_wait_all();
            fs_wgmma_hold(o_acc);
            if (lane == 0) fs_mbar_arrive(&v_empty[prev]);
#pragma unroll
            for (int n = 0; n < DVP / 8; ++n) {
                o_acc[n][0] *= o_rescale[0];
                o_acc[n][1] *= o_rescale[0];
                o_acc[n][2] *= o_rescale[1];
                o_acc[n][3] *= o_rescale[1];
            }
            pack();
        }
        // The last tile's O += P V.
        if (tiles > 0) {
            fs_mbar_wait(&v_full[buf], phase);
            fs_bar_sync(1 + wg, TURN);
            fs_wgmma_fence();
            issue_pv(fs_desc_at(v_desc, buf * VT::BYTES));
            fs_wgmma_commit();
            if (wg + 1 < WGS) fs_bar_arrive(1 + next_wg, TURN);
            fs_wgmma_wait_all();
            fs_wgmma_hold(o_acc);
        }

        // 7. O and the log-sum-exp: O through the warpgroup's query rows, which
        //    no product reads any more, where they are wide enough.
        if (DROPOUT) {
#pragma unroll
            for (int n = 0; n < DVP / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[n][e] *= a.drop.scale;
            }
        }
        if constexpr (DVP <= DP) {
            store_output_staged<E, DV, DVP>(a, o_acc, row_max, row_sum, b, h, q0 + wg * 64, warp * 16 + frag_row, frag_col,
                                            threadIdx.x & 127, q_tile + wg * 64 * DP, 1 + WGS + wg);
        } else {
            store_output<E, DV>(a, o_acc, row_max, row_sum, b, h, i_lo, i_hi, frag_col);
        }
    }
};

}  // namespace fs_attn

#endif

// The attention backward's dK/dV/dQ kernel on Hopper tensor cores for wide
// heads (more than 128 padded features of q/k or of v, up to 256), for the
// atomic scheme (between Delta<DQ_SUM = true> and DqStore of backward.cuh).
//
// At 256 features the narrow kernel's layout (backward_sm90.cuh: each
// consumer warpgroup owning 64 keys and every feature of their dK and dV)
// would need 256 accumulators a thread. Here one block owns 64 keys of one
// (batch, key/value head), and both consumer warpgroups cover all 64 keys,
// splitting the work instead:
//
// 1. S^T = K Q^T and dP^T = V dO^T for the warpgroup's half of the query
//    tile (32 queries: m64n32, both operands in shared memory, K-major), so
//    that P^T = exp2(S^T scale_log2 - lse) and dS^T = P^T (dP^T - delta) of
//    those queries come out in the accumulator layout;
// 2. P^T and dS^T into shared memory ([key][query] core matrices), and a
//    named barrier: both halves are in;
// 3. the warpgroup's half of the features: dV += P^T dO and dK += dS^T Q
//    (A = P^T / dS^T read K-major, B = the dO / Q tile read MN-major, from
//    the warpgroup's first feature), and dQ = dS K (A = dS read MN-major
//    from dS^T, B = the key tile MN-major), added into the f32 dQ sum: each
//    warpgroup stages SW features of its dQ at a time in shared memory
//    (swizzled) and reads them back a row at a time, so that each 16-byte
//    reduction of a warp covers whole rows of the sum.
//
// So each thread holds half of dK's and dV's accumulators (at D = Dv = 256,
// 64 each) and a half of dQ's. The dQ sum takes as many bytes as the step's
// tensor work at D = 256 (64 KiB a 64 x 64 tile) and the reductions were the
// kernel's limit: from the accumulators' fragments each warp reduction
// touched 8 rows of 32 bytes, staged a warp's covers 4 whole 128-byte rows. The memory warpgroup gives its registers to
// the consumers (setmaxnreg) and loads each query tile into
// one of STAGES buffers (Q and dO by the first thread's bulk tensor copies,
// lse and delta by all), handed over by mbarriers as in the forward.
// A second named barrier keeps a warpgroup from overwriting P^T or dS^T
// while the other's products of the previous tile still read them.
//
// Head dims are padded to a multiple of 32 (so that each half is a whole
// number of 16-feature steps), and the query and dO tiles take the widest
// swizzle whose box divides a half (a half starts on a box).
//
// Grouped queries at high ratios: SPLIT > 1 shares a key tile between SPLIT
// blocks, each taking group / SPLIT of its query heads and leaving its dK,
// dV in an f32 slot that DkvStore (backward.cuh) sums, as backward_sm90.cuh.
//
// Launch: grid (ceil(S / 64), Hkv * SPLIT, B), 384 threads (__launch_bounds__(384,
// 1)), SMEM_BYTES of dynamic shared memory, after the scratch the tensor maps
// of Q and dO (boxes of QT::ATOM / DOT::ATOM features by 64 rows), by value.
#ifndef FS_ATTENTION_BACKWARD_SM90_WIDE
#define FS_ATTENTION_BACKWARD_SM90_WIDE
#include "backward.cuh"
#include "sm90.cuh"

namespace fs_attn {

template <class E, int D, int DV, bool CAUSAL, int SPLIT = 1>
struct DkDvDqSm90Wide {
    static constexpr int DP = round_up(D, 32), DVP = round_up(DV, 32);  // padded head dims
    static constexpr int FK = DP / 2, FV = DVP / 2;                     // each warpgroup's features
    // dQ's features a product at a time: a power of two that divides FK, at most 64.
    static constexpr int QC = FK % 64 == 0 ? 64 : FK % 32 == 0 ? 32 : 16;
    // dQ's features staged at a time (a 64 x SW f32 tile a warpgroup, rows of
    // SW / 4 16-byte chunks, chunk c of row r stored at c ^ (r % CPR) so that
    // both the fragments' stores and the rows' loads spread over the banks).
    static constexpr int SW = QC < 32 ? QC : 32, CPR = SW / 4;
    static_assert(DP <= 256 && DVP <= 256, "up to 256 features");
    static constexpr int TILE_K = 64, TILE_Q = 64, HALF_Q = TILE_Q / 2;
    // The whole memory warpgroup loads (as two warps, with the rest returning,
    // it spilled at D = 256).
    static constexpr int CONSUMERS = 256, LOADERS = 128, THREADS = CONSUMERS + LOADERS;
    // The consumers' registers, leaving the memory warpgroup 56.
    static constexpr unsigned CONSUMER_REGS = 224;
    static constexpr unsigned PRODUCER_REGS = regs_left(THREADS, CONSUMERS, CONSUMER_REGS);
    typedef CoreTile<DP> KT;
    typedef CoreTile<DVP> VT;
    typedef CoreTile<TILE_Q> ST;  // P^T and dS^T: [key][query]
    typedef SwizzledTile<TILE_Q, DP, swizzle_for(DP / 2)> QT;
    typedef SwizzledTile<TILE_Q, DVP, swizzle_for(DVP / 2)> DOT;
    static __host__ __device__ constexpr unsigned smem_with(int stages) {
        return TILE_K * (DP + DVP) * 2 + stages * (QT::BYTES + DOT::BYTES) + 2 * TILE_K * TILE_Q * 2 + 2 * TILE_Q * SW * 4 +
               2 * stages * TILE_Q * 4 + 2 * stages * 8 + 1024;
    }
    // Query tile buffers: three where they fit in a block's 227 KiB, else two.
    static constexpr int STAGES = smem_with(3) <= 227 * 1024 ? 3 : 2;
    static constexpr unsigned SMEM_BYTES = smem_with(STAGES);

    static __device__ __forceinline__ void run(const BackwardArgs& a, const fs_tmap& tm_q, const fs_tmap& tm_do) {
        const fs_i64 k0 = (fs_i64)blockIdx.x * TILE_K, kv_h = blockIdx.y / SPLIT, b = blockIdx.z;
        const fs_i64 part = blockIdx.y % SPLIT, heads = a.group / SPLIT;  // this block's share of the group
        const fs_i64 q_len = a.q_len, q_heads = a.q_heads, keys = masked_keys_from(a, b);
        const int lane = threadIdx.x & 31;
        FS_DYNAMIC_SMEM(smem_raw, SMEM_BYTES);
        unsigned char* const smem = fs_align1024(smem_raw);  // for the swizzle
        unsigned short* const k_tile = reinterpret_cast<unsigned short*>(smem);  // [TILE_K][DP], core matrices
        unsigned short* const v_tile = k_tile + TILE_K * DP;                     // [TILE_K][DVP], core matrices
        unsigned char* const q_tiles = reinterpret_cast<unsigned char*>(v_tile + TILE_K * DVP);  // STAGES x QT
        unsigned char* const do_tiles = q_tiles + STAGES * QT::BYTES;                             // STAGES x DOT
        unsigned short* const pt_tile = reinterpret_cast<unsigned short*>(do_tiles + STAGES * DOT::BYTES);  // P^T
        unsigned short* const dst_tile = pt_tile + TILE_K * TILE_Q;                                         // dS^T
        float* const dq_stages = reinterpret_cast<float*>(dst_tile + TILE_K * TILE_Q);  // 2 x [TILE_Q][SW], swizzled
        float* const lse_tiles = dq_stages + 2 * TILE_Q * SW;                           // STAGES x TILE_Q: lse * log2(e)
        float* const delta_tiles = lse_tiles + STAGES * TILE_Q;                       // STAGES x TILE_Q
        // Query buffer s is full (q_full[s]: the copies' bytes and the loaders'
        // stores are in) and empty (q_empty[s]: every consumer warp is done with it).
        fs_mbar* const q_full = reinterpret_cast<fs_mbar*>(delta_tiles + STAGES * TILE_Q);
        fs_mbar* const q_empty = q_full + STAGES;

        // 1. The block's keys and values, by every thread (rows past kv_len zero;
        //    their dK, dV are never stored).
        load_core_rows<TILE_K, D, DP, THREADS>(k_tile, a.k, b, k0, kv_h, a.kv_len, threadIdx.x);
        load_core_rows<TILE_K, DV, DVP, THREADS>(v_tile, a.v, b, k0, kv_h, a.kv_len, threadIdx.x);
        if (threadIdx.x == 0) {
            for (int s = 0; s < STAGES; ++s) {
                fs_mbar_init(&q_full[s], 1 + LOADERS);  // the copies' issuer, then each loader's stores
                fs_mbar_init(&q_empty[s], CONSUMERS / 32);
            }
        }
        fs_copy_async_commit();
        fs_copy_async_wait_all();
        fs_fence_async_smem();
        __syncthreads();
        // Query tiles t = 0 .. tiles - 1: head kv_h * group + part * heads + t / per_head, rows
        // i_first + (t % per_head) * TILE_Q; causal: from the first tile that can see key k0.
        const fs_i64 i_first = CAUSAL ? (k0 / TILE_Q) * TILE_Q : 0;
        const fs_i64 per_head = q_len > i_first ? (q_len - i_first + TILE_Q - 1) / TILE_Q : 0;
        const int tiles = (int)(heads * per_head);

        if (threadIdx.x >= CONSUMERS) {
            // 2. The loaders (the memory warpgroup): query tile
            //    t into buffer t % STAGES once the consumers are done with tile
            //    t - STAGES: Q and dO as boxes from the first loader (rows past
            //    q_len zero), lse in log2 units and delta (rows past q_len zero) from all.
            fs_setmaxnreg_dec<PRODUCER_REGS>();
            const int p = threadIdx.x - CONSUMERS;
            const int len = (int)q_len;
            int h = (int)(kv_h * a.group + part * heads), i0 = (int)i_first;  // tile t's head and first row
            const float* const lse_b = &a.lse.at(b, 0, 0);
            const float* const delta_b = delta_of<D, true>(a) + b * q_heads * q_len;
            int buf = 0;         // t % STAGES
            unsigned phase = 0;  // (t / STAGES) & 1
            for (int t = 0; t < tiles; ++t) {
                if (t >= STAGES) fs_mbar_wait(&q_empty[buf], phase ^ 1);
                const int rows = len - i0 < TILE_Q ? len - i0 : TILE_Q;
                if (p == 0) {
                    unsigned char* const qt = q_tiles + buf * QT::BYTES;
                    unsigned char* const dot = do_tiles + buf * DOT::BYTES;
                    fs_mbar_expect_tx(&q_full[buf], QT::BYTES + DOT::BYTES);
#pragma unroll
                    for (int x = 0; x < DP / QT::ATOM; ++x)
                        fs_tma_load(qt + x * QT::BOX, tm_q, x * QT::ATOM, h, i0, (int)b, &q_full[buf]);
#pragma unroll
                    for (int x = 0; x < DVP / DOT::ATOM; ++x)
                        fs_tma_load(dot + x * DOT::BOX, tm_do, x * DOT::ATOM, h, i0, (int)b, &q_full[buf]);
                    fs_mbar_tma_issued(&q_full[buf]);
                }
                const float* const lse_row = lse_b + h * a.lse.sh + i0 * a.lse.st;
                const float* const delta_row = delta_b + (fs_i64)h * q_len + i0;
                for (int r = p; r < TILE_Q; r += LOADERS) {
                    lse_tiles[buf * TILE_Q + r] = r < rows ? lse_row[r * a.lse.st] * LOG2E : 0.0f;
                    delta_tiles[buf * TILE_Q + r] = r < rows ? delta_row[r] : 0.0f;
                }
                fs_mbar_arrive(&q_full[buf]);
                i0 += TILE_Q;
                if (i0 >= len) i0 = (int)i_first, ++h;
                if (++buf == STAGES) buf = 0, phase ^= 1;
            }
            return;
        }

        // 3. The consumers.
        fs_setmaxnreg_inc<CONSUMER_REGS>();
        const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
        // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        const int key_row = warp * 16 + frag_row;  // of the block's 64, in S^T's and dK's layout
        const int fk0 = wg * FK, fv0 = wg * FV;    // the warpgroup's first dK / dQ and dV feature

        // dk_acc[n][e], dv_acc[n][e]: key row key_row + 8 * (e / 2), feature
        // fk0 / fv0 + 8n + frag_col + e % 2.
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
        // wgmma descriptors: K and V (all 64 keys, K-major), the key tile for dQ
        // (MN-major, from the warpgroup's first feature), P^T and dS^T (K-major as
        // A of dV and dK, MN-major as A of dQ), the first query and dO buffers;
        // a buffer's and a step's are these moved on (fs_desc_at).
        const fs_desc k_desc0 = KT::kmajor(k_tile), v_desc0 = VT::kmajor(v_tile);
        const fs_desc kdq_desc0 = fs_desc_at(KT::mnmajor(k_tile), KT::mnmajor_n(fk0));
        const fs_desc pt_desc = ST::kmajor(pt_tile), dst_desc = ST::kmajor(dst_tile);
        const fs_desc ds_desc = ST::mnmajor(dst_tile);
        const fs_desc q_kdesc = fs_desc_at(QT::kmajor(q_tiles), QT::kmajor_n(wg * HALF_Q));
        const fs_desc do_kdesc = fs_desc_at(DOT::kmajor(do_tiles), DOT::kmajor_n(wg * HALF_Q));
        const fs_desc q_mdesc = fs_desc_at(QT::mnmajor(q_tiles), QT::mnmajor_n(fk0));
        const fs_desc do_mdesc = fs_desc_at(DOT::mnmajor(do_tiles), DOT::mnmajor_n(fv0));
        fs_i64 i0 = i_first, h = kv_h * a.group + part * heads;  // tile t's first row and head
        int buf = 0;                              // t % STAGES
        unsigned phase = 0;                       // (t / STAGES) & 1
        for (int t = 0; t < tiles; ++t) {
            fs_mbar_wait(&q_full[buf], phase);
            const fs_desc k_desc = fs_desc_opaque(k_desc0), v_desc = fs_desc_opaque(v_desc0);
            const fs_desc kdq_desc = fs_desc_opaque(kdq_desc0);
            const fs_desc qk = fs_desc_at(q_kdesc, buf * QT::BYTES), dok = fs_desc_at(do_kdesc, buf * DOT::BYTES);
            const fs_desc qm = fs_desc_at(q_mdesc, buf * QT::BYTES), dom = fs_desc_at(do_mdesc, buf * DOT::BYTES);
            const float* const lse_tile = lse_tiles + buf * TILE_Q + wg * HALF_Q;
            const float* const delta_tile = delta_tiles + buf * TILE_Q + wg * HALF_Q;

            // 4. S^T = K Q^T and dP^T = V dO^T for the block's 64 keys and the
            //    warpgroup's 32 queries: s[n][e], dp[n][e] = key key_row + 8 * (e / 2),
            //    query i0 + 32 wg + 8n + frag_col + e % 2.
            float s[HALF_Q / 8][4], dp[HALF_Q / 8][4];
            fs_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk)
                wgmma_ss<E, QT, false, HALF_Q, 0>(s, fs_desc_at(k_desc, KT::k_step(kk)), fs_desc_at(qk, QT::k_step(kk)), kk);
            fs_wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < DVP / 16; ++kk)
                wgmma_ss<E, DOT, false, HALF_Q, 0>(dp, fs_desc_at(v_desc, VT::k_step(kk)), fs_desc_at(dok, DOT::k_step(kk)), kk);
            fs_wgmma_commit();

            // 5. P^T = exp2(S^T * scale_log2 - lse_log2) while dP^T is still being
            //    computed, masked only on the tiles that can need it; then
            //    dS^T = P^T * (dP^T - delta) in dp.
            fs_wgmma_wait_all_but_1();
            fs_wgmma_hold(s);
            p_of_s<HALF_Q, TILE_K, CAUSAL>(s, lse_tile, i0 + wg * HALF_Q, k0, q_len, keys, key_row, frag_col, a.scale_log2);
            fs_wgmma_wait_all();
            fs_wgmma_hold(dp);
#pragma unroll
            for (int n = 0; n < HALF_Q / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);
            }
            clear_first_query<HALF_Q, CAUSAL>(dp, i0 + wg * HALF_Q, frag_col);

            // 6. P^T and dS^T of the warpgroup's queries into shared memory, once
            //    the other warpgroup's products of tile t - 1 have read them.
            fs_bar_sync(1, CONSUMERS);
#pragma unroll
            for (int kk = 0; kk < HALF_Q / 16; ++kk) {
                unsigned pf[4], df[4];
                a_frag_of<E>(pf, s, kk);
                a_frag_of<E>(df, dp, kk);
                const int qc = wg * HALF_Q + 16 * kk + frag_col;
                fs_st32(&pt_tile[ST::at(key_row, qc)], pf[0]);
                fs_st32(&pt_tile[ST::at(key_row + 8, qc)], pf[1]);
                fs_st32(&pt_tile[ST::at(key_row, qc + 8)], pf[2]);
                fs_st32(&pt_tile[ST::at(key_row + 8, qc + 8)], pf[3]);
                fs_st32(&dst_tile[ST::at(key_row, qc)], df[0]);
                fs_st32(&dst_tile[ST::at(key_row + 8, qc)], df[1]);
                fs_st32(&dst_tile[ST::at(key_row, qc + 8)], df[2]);
                fs_st32(&dst_tile[ST::at(key_row + 8, qc + 8)], df[3]);
            }
            fs_fence_async_smem();
            fs_bar_sync(2, CONSUMERS);

            // 7. The warpgroup's features: dV += P^T dO and dK += dS^T Q over the
            //    tile's 64 queries (A K-major from shared memory, B MN-major from
            //    the warpgroup's first feature).
            fs_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < TILE_Q / 16; ++kk)
                wgmma_ss<E, DOT, true, FV, 0>(dv_acc, fs_desc_at(pt_desc, ST::k_step(kk)), fs_desc_at(dom, DOT::mn_k_step(kk)), 1);
#pragma unroll
            for (int kk = 0; kk < TILE_Q / 16; ++kk)
                wgmma_ss<E, QT, true, FK, 0>(dk_acc, fs_desc_at(dst_desc, ST::k_step(kk)), fs_desc_at(qm, QT::mn_k_step(kk)), 1);
            fs_wgmma_commit();
            // 8. dQ = dS K over the block's keys, QC features at a time (so that
            //    dK's, dV's and dQ's accumulators fit in the registers together):
            //    dq[n][e] = query i0 + 16 warp + frag_row + 8 (e / 2), feature
            //    fk0 + c0 + 8n + frag_col + e % 2, added into the f32 dQ sum in the
            //    scratch ([B, Hq, T, D]) by vector reductions.
#pragma unroll
            for (int c0 = 0; c0 < FK; c0 += QC) {
                float dq[QC / 8][4];
#pragma unroll
                for (int kk = 0; kk < TILE_K / 16; ++kk)
                    wgmma_ss<E, KT, true, QC, 1>(dq, fs_desc_at(ds_desc, ST::mn_k_step(kk)),
                                                 fs_desc_at(kdq_desc, KT::mn_k_step(kk) + KT::mnmajor_n(c0)), kk);
                fs_wgmma_commit();
                fs_wgmma_wait_all();
                fs_wgmma_hold(dq);
                if (c0 + QC >= FK) {
                    // Every product of tile t has landed: its query buffer is free.
                    fs_wgmma_hold(dk_acc);
                    fs_wgmma_hold(dv_acc);
                    if (lane == 0) fs_mbar_arrive(&q_empty[buf]);
                }
                // SW features at a time through the warpgroup's staging tile
                // (barrier 3 + wg: its 128 threads), then into the sum a row
                // of SW features from CPR threads.
                float* const stage = dq_stages + wg * TILE_Q * SW;
                float* const sum = a.scratch + ((b * q_heads + h) * q_len + i0) * D + fk0 + c0;  // row i0
                const int rows = q_len - i0 < TILE_Q ? (int)(q_len - i0) : TILE_Q;
#pragma unroll
                for (int f0 = 0; f0 < QC; f0 += SW) {
                    fs_bar_sync(3 + wg, 128);  // the tile's previous rows are read
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        const int row = warp * 16 + frag_row + 8 * r;
#pragma unroll
                        for (int n = 0; n < SW / 8; ++n) {
                            const int c = (2 * n + (frag_col >> 2)) ^ (row % CPR);
                            fs_st_f32x2(&stage[row * SW + c * 4 + (frag_col & 3)], dq[f0 / 8 + n][2 * r], dq[f0 / 8 + n][2 * r + 1]);
                        }
                    }
                    fs_bar_sync(3 + wg, 128);
                    for (int idx = threadIdx.x & 127; idx < rows * CPR; idx += 128) {
                        const int row = idx / CPR, c = idx % CPR;
                        if (fk0 + c0 + f0 + 4 * c < D)
                            fs_atomic_add4(&sum[(fs_i64)row * D + f0 + 4 * c], &stage[row * SW + (c ^ (row % CPR)) * 4]);
                    }
                }
            }
            i0 += TILE_Q;
            if (i0 >= q_len) i0 = i_first, ++h;
            if (++buf == STAGES) buf = 0, phase ^= 1;
        }

        // Last, each key row once: dK = scale * acc, dV = acc; split, the
        // block's part of them into its f32 slot, for DkvStore to sum.
        // Unsplit, each warpgroup's half of dK's and dV's features goes
        // through the query and dO buffers (free once both warpgroups' last
        // products have landed) as whole 16-byte chunks of rows (stage_rows,
        // as backward_sm90.cuh).
        clear_dk_of_one_key(a, b, dk_acc);
        if constexpr (SPLIT == 1) {
            static_assert(STAGES * (QT::BYTES + DOT::BYTES) >= TILE_K * (DP + DVP) * 2, "dK and dV staged in the query buffers");
            unsigned short* const dk_stage = reinterpret_cast<unsigned short*>(q_tiles) + wg * 64 * FK;
            unsigned short* const dv_stage = reinterpret_cast<unsigned short*>(q_tiles) + TILE_K * DP + wg * 64 * FV;
            fs_bar_sync(1, CONSUMERS);
            store_dk_dv_staged<E, D, DV, FK, FV>(a, dk_acc, dv_acc, dk_stage, dv_stage, b, kv_h, k0, fk0, fv0, key_row, frag_col,
                                                 threadIdx.x & 127, 3 + wg);
        } else {
            store_dkv_part<D, DV, SPLIT>(a, dk_acc, dv_acc, b, kv_h, part, k0, key_row, frag_col, fk0, fv0);
        }
    }
};

}  // namespace fs_attn

#endif

// The attention backward's dK/dV/dQ kernel on Hopper tensor cores (sm_90a),
// for the atomic scheme (between Delta<DQ_SUM = true> and DqStore of
// backward.cuh): wgmma fed from shared memory, K, V and dS^T in wgmma's
// core-matrix layout (CoreTile), the query and dO tiles as bulk tensor copies
// land them (SwizzledTile).
//
// One block owns 128 keys of one (batch, key/value head): two consumer
// warpgroups (wg owns keys 64wg .. 64wg + 63) and a memory warpgroup. K and V
// are loaded once by all; then the queries of every head of the group stream
// through shared memory TILE_Q at a time (128 up to 64 padded features, else
// 64). The memory warpgroup gives its
// registers to the consumers (setmaxnreg) and splits in two:
//
// - loader warps (one, or two at 128 features) fill each query tile into
//   one of STAGES buffers (Q and dO by the first loader's bulk tensor
//   copies, lse and delta by all), handed over by mbarriers as in the
//   forward: "full" as the copies' bytes and the stores are in, "empty" when
//   every consumer warp is done with it;
// - writer warps (three, or two at 128 features) take each tile's dQ from
//   one of two f32 tiles in shared memory and add it into the f32 sum by
//   bulk reductions, a row each (the copy engine does the adding: on an
//   H100 at T = 8192 the kernel took 3.42 ms at D = 64, with 64-query
//   tiles, against 3.60 with 16-byte vector reductions from the writers'
//   lanes).
//
// So the consumers' chain per tile holds only tensor-core work and the
// element-wise step between. Per query tile, each consumer warpgroup:
//
// 1. S^T = K Q^T and dP^T = V dO^T (both operands in shared memory, K-major),
//    so that P^T = exp2(S^T scale_log2 - lse) and dS^T = P^T (dP^T - delta)
//    come out in the accumulator layout, which is wgmma's register A layout;
// 2. dV += P^T dO and dK += dS^T Q (A in registers, B the dO / Q tile read
//    MN-major), accumulators kept across all tiles;
// 3. writes dS^T to shared memory; once both warpgroups have (a named
//    barrier), the tile's dQ = dS K over the block's 128 keys (A = dS read
//    MN-major, B = the key tile MN-major), each warpgroup half the features,
//    goes to the writers.
//
// A second named barrier keeps a warpgroup from overwriting dS^T while the
// other's dQ product still reads it. Causal: query tiles before the first
// that can see the block's first key are skipped; only tiles crossing the
// diagonal or the sequence ends are masked. dK and dV take (D + Dv) / 2
// accumulators a thread: up to 128 padded features each.
//
// Grouped queries at high ratios give few blocks (one per key tile and
// key/value head), unequal under the causal mask; SPLIT > 1 shares a key
// tile between SPLIT blocks, each taking group / SPLIT of its query heads
// and leaving its dK, dV in an f32 slot of the scratch that DkvStore
// (backward.cuh) sums.
//
// Launch: grid (ceil(S / 128), Hkv * SPLIT, B), 384 threads (__launch_bounds__(384,
// 1)), SMEM_BYTES of dynamic shared memory, after the scratch the tensor maps
// of Q and dO (boxes of QT::ATOM / DOT::ATOM features by TILE_Q rows), by value.
#ifndef FS_ATTENTION_BACKWARD_SM90
#define FS_ATTENTION_BACKWARD_SM90
#include "backward.cuh"
#include "sm90.cuh"

namespace fs_attn {

// DROPOUT: dV takes (P Z)^T dO and dS^T = P^T (Z dP^T - delta) for a.drop's
// mask factors Z, drawn key-major as the mma.sync backward draws them.
template <class E, int D, int DV, bool CAUSAL, int SPLIT = 1, bool DROPOUT = false>
struct DkDvDqSm90 {
    static constexpr int DP = round_up(D, 16), DVP = round_up(DV, 16);
    static_assert(DP <= 128 && DVP <= 128, "dK and dV accumulators for up to 128 features each");
    // Query tiles of 128 rows where both head dims fit in 64 padded features,
    // else 64: at 64 features a 64-query tile's products are too short to
    // keep the tensor cores fed (wgmma N = 64 with K = 64), and the
    // accumulators of a 128-query tile (S^T and dP^T 64 registers each, dK and
    // dV 32 each, dQ 32) fit in the 240 registers a consumer can have.
    // 64-query tiles with dropout, whose draws take the registers 128 would need.
    static constexpr int TILE_K = 128, TILE_Q = DP <= 64 && DVP <= 64 && !DROPOUT ? 128 : 64;
    // dQ = dS K: with 64-query tiles each warpgroup takes half the features of
    // all the tile's queries; with 128, all the features of its half of the
    // queries (wgmma's M is 64 a warpgroup).
    static constexpr int DQ_N = TILE_Q == 128 ? DP : DP / 2;
    // The memory warpgroup's warps: three writers and one loader below 128
    // padded features, two and two at 128 (on an H100, T = 8192: dK/dV/dQ at
    // D = 96 3.23 ms against 3.79 with two writers, at D = 112 3.58 against
    // 3.85, at D = 128 3.09 against 2.98; measured when the writers' lanes
    // added dQ themselves, not again since the copy engine does).
    static constexpr int WRITERS = DP < 128 ? 96 : 64, LOADERS = 128 - WRITERS;
    static constexpr int CONSUMERS = 256, THREADS = CONSUMERS + LOADERS + WRITERS;
    // Registers after the hand-over: the consumers' accumulators grow with the
    // head dims; below 232 at D = 128 ptxas serializes their wgmma (and up to
    // 80 features, 208 leaves the memory warpgroup 88, where it spills nothing;
    // at 96, 224 leaves it 64, which the writers needed when they added dQ
    // from their lanes).
    // With 128-query tiles, 224: no spill and no serialized wgmma for any
    // head dims up to 64 (at 232 the memory warpgroup's 40 spill where D !=
    // Dv, at 240 its 24 spill everywhere; at 216 ptxas serializes the wgmma).
    // With dropout (whose draws need registers of their own), one step more
    // up to 192 features in all.
    static constexpr unsigned CONSUMER_REGS = TILE_Q == 128         ? 224
                                              : DP + DVP <= 160     ? (DROPOUT ? 224 : 208)
                                              : DP + DVP <= 192     ? (DROPOUT ? 232 : 224)
                                                                    : 232;
    static constexpr unsigned PRODUCER_REGS = regs_left(THREADS, CONSUMERS, CONSUMER_REGS);
    typedef CoreTile<DP> KT;
    typedef CoreTile<DVP> VT;
    typedef CoreTile<TILE_Q> DST;  // dS^T: [key][query]
    typedef SwizzledTile<TILE_Q, DP> QT;
    typedef SwizzledTile<TILE_Q, DVP> DOT;
    // The f32 dQ tiles' row pitch: 8 floats past a multiple of 32 banks, so
    // that a half warp's 8-byte fragment stores (4 rows x 32 bytes) hit 32
    // distinct banks. At DP + 4 rows r and r + 1 shared 4 banks: ncu (H200,
    // D = 128, T = 8192) counted 2.9-way conflicts over the kernel's shared
    // stores, 35% of their wavefronts.
    static constexpr int DQ_ROW = DP + 8;
    static_assert(D % 4 == 0 && DQ_ROW % 4 == 0, "dQ rows of whole 16-byte chunks for the bulk reductions");
    static __host__ __device__ constexpr unsigned smem_with(int stages) {
        return TILE_K * (DP + DVP) * 2 + stages * (QT::BYTES + DOT::BYTES) + TILE_K * TILE_Q * 2 + 2 * TILE_Q * DQ_ROW * 4 +
               2 * stages * TILE_Q * 4 + (2 * stages + 4) * 8 + 1024;
    }
    // Query tile buffers: three where they fit in a block's 227 KiB, else two.
    static constexpr int STAGES = smem_with(3) <= 227 * 1024 ? 3 : 2;
    static constexpr unsigned SMEM_BYTES = smem_with(STAGES);

    static __device__ __forceinline__ void run(const BackwardArgs& a, const fs_tmap& tm_q, const fs_tmap& tm_do) {
        // SPLIT blocks share a key tile: part `part` takes group / SPLIT of
        // the group's query heads.
        const fs_i64 k0 = (fs_i64)blockIdx.x * TILE_K, kv_h = blockIdx.y / SPLIT, b = blockIdx.z;
        const fs_i64 part = blockIdx.y % SPLIT, heads = a.group / SPLIT;
        const fs_i64 q_len = a.q_len, q_heads = a.q_heads, keys = masked_keys_from(a, b);
        const int lane = threadIdx.x & 31;
        FS_DYNAMIC_SMEM(smem_raw, SMEM_BYTES);
        unsigned char* const smem = fs_align1024(smem_raw);  // for the swizzle
        unsigned short* const k_tile = reinterpret_cast<unsigned short*>(smem);  // [TILE_K][DP], core matrices
        unsigned short* const v_tile = k_tile + TILE_K * DP;                     // [TILE_K][DVP], core matrices
        unsigned char* const q_tiles = reinterpret_cast<unsigned char*>(v_tile + TILE_K * DVP);  // STAGES x QT
        unsigned char* const do_tiles = q_tiles + STAGES * QT::BYTES;                             // STAGES x DOT
        unsigned short* const ds_tile = reinterpret_cast<unsigned short*>(do_tiles + STAGES * DOT::BYTES);  // DST
        float* const dq_tiles = reinterpret_cast<float*>(ds_tile + TILE_K * TILE_Q);  // 2 x [TILE_Q][DQ_ROW]
        float* const lse_tiles = dq_tiles + 2 * TILE_Q * DQ_ROW;                      // STAGES x TILE_Q: lse * log2(e)
        float* const delta_tiles = lse_tiles + STAGES * TILE_Q;                       // STAGES x TILE_Q
        // Query buffer s is full (q_full[s]: the copies' bytes and the loaders'
        // stores are in) and empty (q_empty[s]: every consumer warp is done with
        // it); dQ tile u likewise (dq_full[u]: every consumer warp has stored its
        // part; dq_empty[u]: the writer warps have read it).
        fs_mbar* const q_full = reinterpret_cast<fs_mbar*>(delta_tiles + STAGES * TILE_Q);
        fs_mbar* const q_empty = q_full + STAGES;
        fs_mbar* const dq_full = q_empty + STAGES;
        fs_mbar* const dq_empty = dq_full + 2;

        // 1. The block's keys and values, by every thread (rows past kv_len zero;
        //    their dK, dV are never stored).
        if constexpr (DP == DVP) {
            // One loop for both: as two, the memory warpgroup spilled at D = 128.
            for (int t = threadIdx.x; t < TILE_K * (DP / 8); t += THREADS) {
                int r, c;
                KT::chunk(t, r, c);
                const fs_i64 j = k0 + r;
                if (j < a.kv_len) {
                    if (c < D) fs_copy16_async(&k_tile[t * 8], a.k.row(b, j, kv_h) + c);
                    else fs_zero16(&k_tile[t * 8]);
                    if (c < DV) fs_copy16_async(&v_tile[t * 8], a.v.row(b, j, kv_h) + c);
                    else fs_zero16(&v_tile[t * 8]);
                } else {
                    fs_zero16(&k_tile[t * 8]);
                    fs_zero16(&v_tile[t * 8]);
                }
            }
        } else {
            load_core_rows<TILE_K, D, DP, THREADS>(k_tile, a.k, b, k0, kv_h, a.kv_len, threadIdx.x);
            load_core_rows<TILE_K, DV, DVP, THREADS>(v_tile, a.v, b, k0, kv_h, a.kv_len, threadIdx.x);
        }
        if (threadIdx.x == 0) {
            for (int s = 0; s < STAGES; ++s) {
                fs_mbar_init(&q_full[s], 1 + LOADERS);  // the copies' issuer, then each loader's stores
                fs_mbar_init(&q_empty[s], CONSUMERS / 32);
            }
            for (int u = 0; u < 2; ++u) {
                fs_mbar_init(&dq_full[u], CONSUMERS / 32);
                fs_mbar_init(&dq_empty[u], WRITERS / 32);
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
            // The memory warpgroup runs on the 40-odd registers the consumers
            // leave it: counters in 32 bits, rows found from per-batch bases.
            fs_setmaxnreg_dec<PRODUCER_REGS>();
            const int p = threadIdx.x - CONSUMERS;
            const int len = (int)q_len;
            int h = (int)(kv_h * a.group + part * heads), i0 = (int)i_first;  // tile t's head and first row
            if (p < LOADERS) {
                // 2. The loaders: query tile t into buffer t % STAGES once the
                //    consumers are done with tile t - STAGES: Q and dO as boxes
                //    from the first loader (rows past q_len zero), lse in log2
                //    units and delta (rows past q_len zero) from all.
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
            } else {
                // 3. The writers: tile t's dQ (dq_tiles[t % 2]) into the f32 sum in
                //    the scratch ([B, Hq, T, D]), a row of D features by one
                //    bulk reduction, writer w taking rows w, w + WRITERS, ...
                //    The tile is free again once the copy engine has read it.
                const int w = p - LOADERS;
                float* const sum_b = a.scratch + b * q_heads * q_len * D;
                for (int t = 0; t < tiles; ++t) {
                    const int u = t & 1;
                    fs_mbar_wait(&dq_full[u], (t >> 1) & 1);
                    const float* const dqt = dq_tiles + u * TILE_Q * DQ_ROW;
                    float* const sum = sum_b + ((fs_i64)h * q_len + i0) * D;  // row i0
                    const int rows = len - i0 < TILE_Q ? len - i0 : TILE_Q;
                    for (int r = w; r < rows; r += WRITERS) fs_bulk_add_f32(&sum[r * D], &dqt[r * DQ_ROW], D * 4);
                    fs_bulk_commit();
                    fs_bulk_wait_read();
                    fs_syncwarp();
                    if (lane == 0) fs_mbar_arrive(&dq_empty[u]);
                    i0 += TILE_Q;
                    if (i0 >= len) i0 = (int)i_first, ++h;
                }
                fs_bulk_wait();
            }
            return;
        }

        // 4. The consumers.
        fs_setmaxnreg_inc<CONSUMER_REGS>();
        const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
        // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;

        // dk_acc[n][e], dv_acc[n][e]: key row key_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
        const int key_row = wg * 64 + warp * 16 + frag_row;
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
        // wgmma descriptors of the warpgroup's keys and values, of dS^T, of the
        // key tile for dQ (the warpgroup's half of the features), and of the
        // first query and dO buffers (read K-major and MN-major); a buffer's and
        // a step's are these moved on (fs_desc_at).
        const fs_desc k_desc = KT::kmajor(k_tile + wg * 64 * DP);
        const fs_desc v_desc = VT::kmajor(v_tile + wg * 64 * DVP);
        const fs_desc ds_desc = fs_desc_at(DST::mnmajor(ds_tile), DST::mnmajor_n(wg * (TILE_Q - 64)));
        const fs_desc kdq_desc = fs_desc_at(KT::mnmajor(k_tile), KT::mnmajor_n(wg * (DP - DQ_N)));
        const fs_desc q_kdesc = QT::kmajor(q_tiles), do_kdesc = DOT::kmajor(do_tiles);
        const fs_desc q_mdesc = QT::mnmajor(q_tiles), do_mdesc = DOT::mnmajor(do_tiles);
        fs_i64 i0 = i_first;  // tile t's first row
        fs_i64 h = kv_h * a.group + part * heads;  // tile t's head (the masks' head row)
        int buf = 0;          // t % STAGES
        unsigned phase = 0;   // (t / STAGES) & 1
        for (int t = 0; t < tiles; ++t) {
            const int u = t & 1;
            fs_mbar_wait(&q_full[buf], phase);
            const fs_desc qk = fs_desc_at(q_kdesc, buf * QT::BYTES), dok = fs_desc_at(do_kdesc, buf * DOT::BYTES);
            const fs_desc qm = fs_desc_at(q_mdesc, buf * QT::BYTES), dom = fs_desc_at(do_mdesc, buf * DOT::BYTES);
            const float* const lse_tile = lse_tiles + buf * TILE_Q;
            const float* const delta_tile = delta_tiles + buf * TILE_Q;

            // 5. S^T = K Q^T and dP^T = V dO^T for the warpgroup's 64 keys:
            //    s[n][e], dp[n][e] = key key_row + 8 * (e / 2), query i0 + 8n +
            //    frag_col + e % 2.
            float s[TILE_Q / 8][4], dp[TILE_Q / 8][4];
            fs_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < DP / 16; ++kk)
                wgmma_ss<E, QT, false, TILE_Q, 0>(s, fs_desc_at(k_desc, KT::k_step(kk)), fs_desc_at(qk, QT::k_step(kk)), kk);
            fs_wgmma_commit();
#pragma unroll
            for (int kk = 0; kk < DVP / 16; ++kk)
                wgmma_ss<E, DOT, false, TILE_Q, 0>(dp, fs_desc_at(v_desc, VT::k_step(kk)), fs_desc_at(dok, DOT::k_step(kk)), kk);
            fs_wgmma_commit();

            // 6. P^T = exp2(S^T * scale_log2 - lse_log2) while dP^T is still being
            //    computed, masked only on the tiles that can need it; then
            //    dS^T = P^T * (dP^T - delta) in dp.
            fs_wgmma_wait_all_but_1();
            fs_wgmma_hold(s);
            p_of_s<TILE_Q, TILE_K, CAUSAL>(s, lse_tile, i0, k0, q_len, keys, key_row, frag_col, a.scale_log2);
            fs_wgmma_wait_all();
            fs_wgmma_hold(dp);
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

            // 7. P^T and dS^T as 16-bit A fragments (queries 16kk .. 16kk + 15),
            //    dS^T also into shared memory for dQ once the other warpgroup's dQ
            //    of tile t - 1 has read it; then dV += P^T dO and dK += dS^T Q, B
            //    the dO / Q tile read MN-major (queries 16kk ..).
            fs_bar_sync(1, CONSUMERS);
            unsigned p_frag[TILE_Q / 16][4], ds_frag[TILE_Q / 16][4];
#pragma unroll
            for (int kk = 0; kk < TILE_Q / 16; ++kk) {
                a_frag_of<E>(p_frag[kk], s, kk);
                a_frag_of<E>(ds_frag[kk], dp, kk);
                fs_st32(&ds_tile[DST::at(key_row, 16 * kk + frag_col)], ds_frag[kk][0]);
                fs_st32(&ds_tile[DST::at(key_row + 8, 16 * kk + frag_col)], ds_frag[kk][1]);
                fs_st32(&ds_tile[DST::at(key_row, 16 * kk + 8 + frag_col)], ds_frag[kk][2]);
                fs_st32(&ds_tile[DST::at(key_row + 8, 16 * kk + 8 + frag_col)], ds_frag[kk][3]);
            }
            fs_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < TILE_Q / 16; ++kk) wgmma_rs<E, DOT, true, DVP>(dv_acc, p_frag[kk], fs_desc_at(dom, DOT::mn_k_step(kk)), 1);
#pragma unroll
            for (int kk = 0; kk < TILE_Q / 16; ++kk) wgmma_rs<E, QT, true, DP>(dk_acc, ds_frag[kk], fs_desc_at(qm, QT::mn_k_step(kk)), 1);
            fs_wgmma_commit();

            // 8. dQ = dS K for the tile's queries and the block's keys, once both
            //    warpgroups' dS^T is in: A = dS read MN-major from dS^T (keys
            //    16kk ..), B = the key tile MN-major, warpgroup wg taking queries
            //    q_off = wg * (TILE_Q - 64) .. q_off + 63 and features f_off = wg
            //    * (DP - DQ_N) .. f_off + DQ_N - 1. dq[n][e] = query i0 + q_off +
            //    16 * warp + frag_row + 8 * (e / 2), feature f_off + 8n +
            //    frag_col + e % 2.
            fs_fence_async_smem();
            fs_bar_sync(2, CONSUMERS);
            float dq[DQ_N / 8][4];
            fs_wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < TILE_K / 16; ++kk)
                wgmma_ss<E, KT, true, DQ_N, 1>(dq, fs_desc_at(ds_desc, DST::mn_k_step(kk)), fs_desc_at(kdq_desc, KT::mn_k_step(kk)), kk);
            fs_wgmma_commit();
            fs_wgmma_wait_all();
            fs_wgmma_hold(dq);
            fs_wgmma_hold(dk_acc);
            fs_wgmma_hold(dv_acc);
            // Every product of tile t has landed: its query buffer is free. dQ goes
            // to the writers once they are done with tile t - 2's.
            if (lane == 0) fs_mbar_arrive(&q_empty[buf]);
            if (t >= 2) fs_mbar_wait(&dq_empty[u], ((t >> 1) + 1) & 1);
            float* const dqt = dq_tiles + u * TILE_Q * DQ_ROW;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float* const row = &dqt[(wg * (TILE_Q - 64) + warp * 16 + frag_row + 8 * r) * DQ_ROW + wg * (DP - DQ_N) + frag_col];
#pragma unroll
                for (int n = 0; n < DQ_N / 8; ++n) fs_st_f32x2(row + n * 8, dq[n][2 * r], dq[n][2 * r + 1]);
            }
            // The writers' bulk reductions read the tile through the async
            // proxy: the stores above must be visible to it.
            fs_fence_async_smem();
            fs_syncwarp();
            if (lane == 0) fs_mbar_arrive(&dq_full[u]);
            i0 += TILE_Q;
            if (i0 >= q_len) i0 = i_first, ++h;
            if (++buf == STAGES) buf = 0, phase ^= 1;
        }

        // Last, each key row once: dK = scale * acc, dV = acc; split, the
        // block's part of them into its f32 slot, for DkvStore to sum.
        // Unsplit, dK and dV go through the query and dO buffers (free once
        // both warpgroups' last products have landed; two stages hold the 128
        // key rows' DP + DVP features) as whole 16-byte chunks of rows
        // (stage_rows).
        clear_dk_of_one_key(a, b, dk_acc);
        if constexpr (SPLIT == 1) {
            static_assert(STAGES * (QT::BYTES + DOT::BYTES) >= TILE_K * (DP + DVP) * 2, "dK and dV staged in the query buffers");
            unsigned short* const dk_stage = reinterpret_cast<unsigned short*>(q_tiles) + wg * 64 * DP;
            unsigned short* const dv_stage = reinterpret_cast<unsigned short*>(q_tiles) + TILE_K * DP + wg * 64 * DVP;
            fs_bar_sync(1, CONSUMERS);
            store_dk_dv_staged<E, D, DV, DP, DVP>(a, dk_acc, dv_acc, dk_stage, dv_stage, b, kv_h, k0 + wg * 64, 0, 0,
                                                  warp * 16 + frag_row, frag_col, threadIdx.x & 127, 3 + wg);
        } else {
            store_dkv_part<D, DV, SPLIT>(a, dk_acc, dv_acc, b, kv_h, part, k0, key_row, frag_col, 0, 0);
        }
    }
};

}  // namespace fs_attn

#endif

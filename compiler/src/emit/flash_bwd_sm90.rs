//! CUDA C for the Hopper (sm_90a) dK/dV/dQ kernel of the attention
//! backward's atomic scheme (`flash_bwd.rs`'s `_dkdvdq`, same arguments,
//! scratch and neighbours `_delta` and `_dqstore`), on warpgroup tensor-core
//! instructions (`wgmma.mma_async`) fed from shared memory: K, V and dS^T
//! in the forward's core-matrix layout (`flash_sm90.rs`), Q and dO tiles as
//! bulk tensor copies land them, 128-byte swizzled (`tma.rs`).
//!
//! # Launch contract
//!
//! Compile for `sm_90a`; `grid = (ceil(S / 128), Hkv, B)`, `block = (384, 1,
//! 1)` with `__launch_bounds__(384, 1)`, dynamic shared memory
//! [`smem_bytes`] (over 48 KiB: raise the function's limit first); after
//! the scratch, the tensor maps of Q and dO that
//! `FlashBwdLaunch::tensor_maps` describes, by value. Everything else as
//! `flash_bwd.rs` says.
//!
//! # Design
//!
//! One block owns 128 keys of one (batch, kv head): two consumer warpgroups
//! (`wg` owns keys `64wg .. 64wg + 63`) and a memory warpgroup. K and V are
//! loaded once by all; then the queries of every head of the group stream
//! through shared memory 64 at a time. The memory warpgroup gives up its
//! registers to the consumers (`setmaxnreg`) and splits in two:
//!
//! - two loader warps fill each query tile into one of [`stages`] buffers
//!   (Q and dO by the first loader's bulk tensor copies, lse and delta by
//!   all), handed over by mbarriers as in the forward (`flash_sm90.rs`):
//!   "full" as the copies' bytes and the stores are in, "empty" when every
//!   consumer warp is done with the tile;
//! - two writer warps take each tile's dQ from one of two f32 tiles in
//!   shared memory and add it into the f32 sum with 16-byte reductions
//!   (`red.global.add.v4.f32`), whole rows at a time.
//!
//! So the consumers' chain per tile holds only tensor-core work and the
//! element-wise step between: without the (then per-thread `cp.async`)
//! copies' and the reductions' instructions it ran at about twice the
//! speed on an H100 (`docs/benchmarks.md`). Per query tile, each consumer warpgroup:
//!
//! 1. `S^T = K Q^T` and `dP^T = V dO^T` (both operands in shared memory,
//!    K-major), so that `P^T = exp2(S^T scale_log2 - lse)` and `dS^T = P^T
//!    (dP^T - delta)` come out in the accumulator layout, which is wgmma's
//!    register A layout;
//! 2. `dV += P^T dO` and `dK += dS^T Q` (A in registers, B = the dO / Q
//!    tile read MN-major), accumulators kept across all tiles;
//! 3. writes dS^T to shared memory (`[key][query]` in core matrices); once
//!    both warpgroups have (a named barrier), the tile's `dQ = dS K` over
//!    the block's 128 keys (A = dS read MN-major, B = the key tile
//!    MN-major), each warpgroup half the features, goes to the writers.
//!
//! A second named barrier keeps a warpgroup from overwriting dS^T while the
//! other's dQ product still reads it. Causal: query tiles before the first
//! that can see the block's first key are skipped; only tiles crossing the
//! diagonal or the sequence ends are masked. P and dS are rounded to the
//! input's 16-bit type as operands.

use super::flash::{elem_names, Config};
use super::flash_bwd::{common_subs, dkdv_store_subs, fill, p_subs};
use super::flash_sm90::{regs_left, wgmma_helpers, wgmma_name, Operand, WS_HELPERS};
use super::templates::Ctx;
use super::tma::{self, TensorMap};
use crate::ir::Graph;
use petgraph::stable_graph::NodeIndex;

/// Keys per block (2 warpgroups of 64).
pub const TILE_KEYS: u64 = 128;
/// Queries per streamed tile (wgmma's M for dQ).
pub const TILE_QUERIES: u64 = 64;
/// Consumer threads (two warpgroups).
const CONSUMERS: u32 = 256;
/// Loader and writer threads of the memory warpgroup.
const LOADERS: u32 = 64;
const WRITERS: u32 = 64;
/// Threads per block.
pub const THREADS: u32 = CONSUMERS + LOADERS + WRITERS;
/// Shared memory a block may have on sm_90 (227 KiB).
const SMEM_LIMIT: u64 = 227 * 1024;

/// Registers per thread after the hand-over at head dim `d`, consumers and
/// producers: the producers take what the consumers leave
/// ([`regs_left`]). The consumers' accumulators grow with `d`; below
/// 232 at D = 128 ptxas serializes their wgmma (and at D = 64, 208 leaves
/// the producers 88, where they spill nothing).
fn regs(d: u64) -> (u32, u32) {
    let consumers = if d <= 64 { 208 } else { 232 };
    (consumers, regs_left(THREADS, CONSUMERS, consumers))
}

/// Query tile buffers at head dim `d`: three where they fit, else two.
fn stages(d: u64) -> u64 {
    if smem_with(d, 3) <= SMEM_LIMIT {
        3
    } else {
        2
    }
}

/// Dynamic shared memory at head dim `d`: K and V, [`stages`] Q and dO
/// tiles, dS^T, two f32 dQ tiles (rows padded by 4), the buffers' lse and
/// delta, the mbarriers, and room to align the tiles for the swizzle.
pub fn smem_bytes(d: u64) -> u64 {
    smem_with(d, stages(d))
}

fn smem_with(d: u64, stages: u64) -> u64 {
    (2 * TILE_KEYS + 2 * stages * TILE_QUERIES) * d * 2
        + TILE_KEYS * TILE_QUERIES * 2
        + 2 * TILE_QUERIES * (d + 4) * 4
        + 2 * stages * TILE_QUERIES * 4
        + (2 * stages + 4) * 8
        + tma::ALIGN
}

/// The kernel's tensor maps: query and dO tiles of [`TILE_QUERIES`] rows.
pub(crate) fn tensor_maps(g: &Graph, c: &Ctx, n: NodeIndex) -> Option<Vec<TensorMap>> {
    Some(vec![
        TensorMap::of_input(g, c, n, 0, "tm_q", TILE_QUERIES)?,
        TensorMap::of_input(g, c, n, 5, "tm_do", TILE_QUERIES)?,
    ])
}

/// The wgmma wrappers and warp-specialization helpers the kernel calls at
/// head dim `d`.
pub(crate) fn helpers(d: u64) -> String {
    wgmma_helpers(&shapes(d)) + tma::HELPERS + WS_HELPERS
}

fn shapes(d: u64) -> [(Operand, Operand, u64); 3] {
    [
        (Operand::KMajor, Operand::KMajor, TILE_QUERIES),
        (Operand::Regs, Operand::MnMajor, d),
        (Operand::MnMajor, Operand::MnMajor, d / 2),
    ]
}

pub(crate) fn dkdvdq_body(g: &Graph, c: &Ctx, n: NodeIndex, cfg: &Config, smem: u64) -> String {
    let mut subs = common_subs(g, c, n, cfg, false);
    subs.extend(dkdv_store_subs(g, c, n));
    subs.push(p_subs(8));
    let (elem, _) = elem_names(cfg.dt);
    let [st, acc, dq] = shapes(cfg.head_dim).map(|(a, b, n)| wgmma_name(a, b, n, elem));
    subs.push(("ST_MMA", st));
    subs.push(("ACC_MMA", acc));
    subs.push(("DQ_MMA", dq));
    subs.push(("SMEM_BYTES", smem.to_string()));
    let tq = TILE_QUERIES;
    subs.push(("Q_KMAJOR", tma::desc_kmajor("qk_desc", tq, "kk")));
    subs.push(("DO_KMAJOR", tma::desc_kmajor("dok_desc", tq, "kk")));
    subs.push(("Q_MNMAJOR", tma::desc_mnmajor("qm_desc", "kk")));
    subs.push(("DO_MNMAJOR", tma::desc_mnmajor("dom_desc", "kk")));
    subs.push(("Q_MN_BASE", tma::mnmajor_base("q_tiles", tq)));
    subs.push(("DO_MN_BASE", tma::mnmajor_base("do_tiles", tq)));
    subs.push(("TILE_K", TILE_KEYS.to_string()));
    subs.push(("TILE_Q", TILE_QUERIES.to_string()));
    subs.push(("BLOCK_THREADS", THREADS.to_string()));
    subs.push(("N_CONSUMERS", CONSUMERS.to_string()));
    subs.push(("N_LOADERS", LOADERS.to_string()));
    subs.push(("N_WRITERS", WRITERS.to_string()));
    subs.push(("N_STAGES", stages(cfg.head_dim).to_string()));
    let (consumer_regs, producer_regs) = regs(cfg.head_dim);
    subs.push(("CONSUMER_REGS", consumer_regs.to_string()));
    subs.push(("PRODUCER_REGS", producer_regs.to_string()));
    fill(BODY, &subs)
}

const BODY: &str = r#"    // FlashAttention-2 backward on Hopper tensor cores, kernel 2 of 3: dK, dV and
    // dQ (wgmma, f32 accumulation). Block = (tile of $TILE_K keys, kv head, batch):
    // two consumer warpgroups, warpgroup wg owning keys 64wg .. 64wg + 63, and a
    // memory warpgroup of loader and writer warps. Per query tile the consumers
    // compute S^T = K Q^T and dP^T = V dO^T, so that P^T and dS^T come out in the
    // accumulator layout, wgmma's register A layout for dV += P^T dO and dK +=
    // dS^T Q; dS^T then goes to shared memory for the tile's dQ += dS K (features
    // split between the warpgroups), which the writers add into the f32 sum.
    // Queries of every head of the group stream through shared memory $TILE_Q at
    // a time, copied ahead by the loaders.
    constexpr int TILE_K = $TILE_K, TILE_Q = $TILE_Q, HEAD_DIM = $D, STAGES = $N_STAGES;
    constexpr int CONSUMERS = $N_CONSUMERS, LOADERS = $N_LOADERS, WRITERS = $N_WRITERS;
    constexpr int CHUNKS = HEAD_DIM / 8;   // 16-byte chunks per row
    constexpr int DQ_ROW = HEAD_DIM + 4;   // f32 dQ tile row pitch (fewer bank conflicts)
    constexpr unsigned STAGE_BYTES = TILE_Q * HEAD_DIM * 2;  // a query or dO tile
    // [rows][HEAD_DIM] tiles in core matrices (emit/flash_sm90.rs): CORE bytes
    // apart along the features, ROW8 along the rows. dS^T [key][query] likewise,
    // its core matrices DS_ROW8 bytes apart along the keys.
    constexpr unsigned CORE = 128, ROW8 = CHUNKS * CORE, DS_ROW8 = (TILE_Q / 8) * CORE;
    const fs_i64 q_len = $T, kv_len = $S, group = $GROUP;
    const bool causal = $CAUSAL;  // if so, keys j > query i are masked
    const float scale = $SCALE, scale_log2 = $SCALE_LOG2;  // exp(x * scale) = exp2(x * scale_log2)
    const fs_i64 k0 = (fs_i64)blockIdx.x * TILE_K, kv_h = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x & 31;
    FS_DYNAMIC_SMEM(smem_raw, $SMEM_BYTES);
    unsigned char* const smem = fs_align1024(smem_raw);  // for the swizzle
    $TY* const k_tile = reinterpret_cast<$TY*>(smem);      // [TILE_K][HEAD_DIM]
    $TY* const v_tile = k_tile + TILE_K * HEAD_DIM;         // [TILE_K][HEAD_DIM]
    // Query and dO tiles: 64-feature boxes of 128-byte swizzled rows (emit/tma.rs).
    $TY* const q_tiles = v_tile + TILE_K * HEAD_DIM;        // STAGES x [TILE_Q][HEAD_DIM]
    $TY* const do_tiles = q_tiles + STAGES * TILE_Q * HEAD_DIM;  // STAGES x [TILE_Q][HEAD_DIM]
    $TY* const ds_tile = do_tiles + STAGES * TILE_Q * HEAD_DIM;  // dS^T: [TILE_K][TILE_Q]
    float* const dq_tiles = reinterpret_cast<float*>(ds_tile + TILE_K * TILE_Q);  // 2 x [TILE_Q][DQ_ROW]
    float* const lse_tiles = dq_tiles + 2 * TILE_Q * DQ_ROW;  // STAGES x TILE_Q: lse * log2(e)
    float* const delta_tiles = lse_tiles + STAGES * TILE_Q;   // STAGES x TILE_Q
    // Query buffer s is full (q_full[s]: the copies' bytes and the loaders' stores are in)
    // and empty (q_empty[s]: every consumer warp is done with it); dQ tile u
    // likewise (dq_full[u]: every consumer warp has stored its part; dq_empty[u]:
    // the writer warps have read it).
    fs_mbar* const q_full = reinterpret_cast<fs_mbar*>(delta_tiles + STAGES * TILE_Q);
    fs_mbar* const q_empty = q_full + STAGES;
    fs_mbar* const dq_full = q_empty + STAGES;
    fs_mbar* const dq_empty = dq_full + 2;

    // 1. The block's keys and values, by every thread (rows past kv_len zero;
    //    their dK, dV are never stored). Chunk c is row (c / (8 * CHUNKS)) * 8 +
    //    c % 8, features ((c / 8) % CHUNKS) * 8 .., stored at element 8c.
    for (int c = threadIdx.x; c < TILE_K * CHUNKS; c += $BLOCK_THREADS) {
        const int r = (c / (8 * CHUNKS)) * 8 + (c & 7), e = ((c >> 3) % CHUNKS) * 8;
        const fs_i64 j = k0 + r;
        if (j < kv_len) {
            fs_copy16_async(&k_tile[c * 8], &$KP[$K_AT + e]);
            fs_copy16_async(&v_tile[c * 8], &$VP[$V_AT + e]);
        } else {
            fs_zero16(&k_tile[c * 8]);
            fs_zero16(&v_tile[c * 8]);
        }
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
    // Query tiles t = 0 .. tiles - 1: head kv_h * group + t / per_head, rows
    // i_first + (t % per_head) * TILE_Q; causal: from the first tile that can see key k0.
    const fs_i64 i_first = causal ? (k0 / TILE_Q) * TILE_Q : 0;
    const fs_i64 per_head = q_len > i_first ? (q_len - i_first + TILE_Q - 1) / TILE_Q : 0;
    const int tiles = (int)(group * per_head);

    if (threadIdx.x >= CONSUMERS) {
        fs_setmaxnreg_dec<$PRODUCER_REGS>();
        const int p = threadIdx.x - CONSUMERS;
        fs_i64 h = kv_h * group, i0 = i_first;  // tile t's head and first row
        if (p < LOADERS) {
            // 2. The loaders: query tile t into buffer t % STAGES once the
            //    consumers are done with tile t - STAGES: Q and dO as HEAD_DIM / 64
            //    boxes each from the first loader (rows past q_len zero), lse in
            //    log2 units and delta (rows past q_len zero) from all.
            int buf = 0;         // t % STAGES
            unsigned phase = 0;  // (t / STAGES) & 1
            for (int t = 0; t < tiles; ++t) {
                if (t >= STAGES) fs_mbar_wait(&q_empty[buf], phase ^ 1);
                $TY* const qt = q_tiles + buf * TILE_Q * HEAD_DIM;
                $TY* const dot = do_tiles + buf * TILE_Q * HEAD_DIM;
                const int rows = q_len - i0 < TILE_Q ? (int)(q_len - i0) : TILE_Q;
                if (p == 0) {
                    fs_mbar_expect_tx(&q_full[buf], 2 * TILE_Q * HEAD_DIM * 2);
#pragma unroll
                    for (int a = 0; a < HEAD_DIM / 64; ++a) {
                        fs_tma_load(qt + a * TILE_Q * 64, tm_q, a * 64, (int)h, (int)i0, (int)b, &q_full[buf]);
                        fs_tma_load(dot + a * TILE_Q * 64, tm_do, a * 64, (int)h, (int)i0, (int)b, &q_full[buf]);
                    }
                    fs_mbar_tma_issued(&q_full[buf]);
                }
                for (int r = p; r < TILE_Q; r += LOADERS) {
                    const fs_i64 i = i0 + r;
                    lse_tiles[buf * TILE_Q + r] = r < rows ? $LSE * 1.4426950408889634f : 0.0f;
                    delta_tiles[buf * TILE_Q + r] = r < rows ? $DELTA[(b * $HQ + h) * q_len + i] : 0.0f;
                }
                fs_mbar_arrive(&q_full[buf]);
                i0 += TILE_Q;
                if (i0 >= q_len) i0 = i_first, ++h;
                if (++buf == STAGES) buf = 0, phase ^= 1;
            }
        } else {
            // 3. The writers: tile t's dQ (dq_tiles[t % 2]) into the f32 sum in
            //    the scratch ([B, Hq, T, D]), a row per warp instruction at D = 128.
            for (int t = 0; t < tiles; ++t) {
                const int u = t & 1;
                fs_mbar_wait(&dq_full[u], (t >> 1) & 1);
                const float* const dqt = dq_tiles + u * TILE_Q * DQ_ROW;
                float* const sum = &scratch[((b * $HQ + h) * q_len + i0) * HEAD_DIM];  // row i0
                const int rows = q_len - i0 < TILE_Q ? (int)(q_len - i0) : TILE_Q;
                // Writer w adds features e .. e + 3 of rows w / CPR, + RSTEP, ...
                constexpr int CPR = HEAD_DIM / 4, RSTEP = WRITERS / CPR;
                static_assert(WRITERS % CPR == 0, "every writer takes whole row chunks");
                const int w = p - LOADERS, e = (w % CPR) * 4;
                for (int r = w / CPR; r < rows; r += RSTEP) fs_atomic_add4(&sum[r * HEAD_DIM + e], &dqt[r * DQ_ROW + e]);
                fs_syncwarp();
                if (lane == 0) fs_mbar_arrive(&dq_empty[u]);
                i0 += TILE_Q;
                if (i0 >= q_len) i0 = i_first, ++h;
            }
        }
        return;
    }

    // 4. The consumers.
    fs_setmaxnreg_inc<$CONSUMER_REGS>();
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
    // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
    const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
    // Element (key kr, query qc) of dS^T.
    auto ds_at = [](int kr, int qc) { return ((kr >> 3) * (TILE_Q / 8) + (qc >> 3)) * 64 + (kr & 7) * 8 + (qc & 7); };

    // dk_acc[n][e], dv_acc[n][e]: key row key_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
    const int key_row = wg * 64 + warp * 16 + frag_row;
    float dk_acc[HEAD_DIM / 8][4], dv_acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;
    }
    // wgmma descriptors of the warpgroup's keys and values, of dS^T, of the
    // key tile for dQ, and of the first query buffer (read K-major and
    // MN-major); a buffer's and a step's are these moved on (fs_desc_at).
    const fs_desc k_desc = fs_make_desc(k_tile + wg * 64 * HEAD_DIM, CORE, ROW8);
    const fs_desc v_desc = fs_make_desc(v_tile + wg * 64 * HEAD_DIM, CORE, ROW8);
    const fs_desc ds_desc = fs_make_desc(ds_tile, DS_ROW8, CORE);
    const fs_desc kdq_desc = fs_make_desc(k_tile + wg * 4 * HEAD_DIM, ROW8, CORE);
    const fs_desc q_kdesc = fs_make_desc_sw128(q_tiles), do_kdesc = fs_make_desc_sw128(do_tiles);
    const fs_desc q_mdesc = $Q_MN_BASE, do_mdesc = $DO_MN_BASE;
    fs_i64 i0 = i_first;  // tile t's first row
    int buf = 0;          // t % STAGES
    unsigned phase = 0;   // (t / STAGES) & 1
    for (int t = 0; t < tiles; ++t) {
        const int u = t & 1;
        fs_mbar_wait(&q_full[buf], phase);
        const fs_desc qk_desc = fs_desc_at(q_kdesc, buf * STAGE_BYTES), dok_desc = fs_desc_at(do_kdesc, buf * STAGE_BYTES);
        const fs_desc qm_desc = fs_desc_at(q_mdesc, buf * STAGE_BYTES), dom_desc = fs_desc_at(do_mdesc, buf * STAGE_BYTES);
        const float* const lse_tile = lse_tiles + buf * TILE_Q;
        const float* const delta_tile = delta_tiles + buf * TILE_Q;

        // 5. S^T = K Q^T and dP^T = V dO^T for the warpgroup's 64 keys: s[n][e],
        //    dp[n][e] = key key_row + 8 * (e / 2), query i0 + 8n + frag_col + e % 2.
        //    Features 16kk .. 16kk + 15 start at element 128kk of a K row group.
        float s[TILE_Q / 8][4], dp[TILE_Q / 8][4];
        fs_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            $ST_MMA(s, fs_desc_at(k_desc, kk * 256), $Q_KMAJOR, kk);
        fs_wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            $ST_MMA(dp, fs_desc_at(v_desc, kk * 256), $DO_KMAJOR, kk);
        fs_wgmma_commit();

        // 6. P^T = exp2(S^T * scale_log2 - lse_log2) while dP^T is still being
        //    computed, masked (queries past q_len; causal: keys after the query)
        //    only on the tiles that can need it; then dS^T = P^T * (dP^T - delta) in dp.
        fs_wgmma_wait_all_but_1();
        fs_wgmma_hold(s);
$P_OF_S
        fs_wgmma_wait_all();
        fs_wgmma_hold(dp);
#pragma unroll
        for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);
        }

        // 7. P^T and dS^T as 16-bit A fragments (queries 16kk .. 16kk + 15), dS^T
        //    also into shared memory for dQ once the other warpgroup's dQ of tile
        //    t - 1 has read it; then dV += P^T dO and dK += dS^T Q, B = the dO / Q
        //    tile read MN-major (queries 16kk ..).
        fs_bar_sync(1, CONSUMERS);
        unsigned p_frag[TILE_Q / 16][4], ds_frag[TILE_Q / 16][4];
#pragma unroll
        for (int kk = 0; kk < TILE_Q / 16; ++kk) {
            p_frag[kk][0] = $PACK(s[2 * kk][0], s[2 * kk][1]);
            p_frag[kk][1] = $PACK(s[2 * kk][2], s[2 * kk][3]);
            p_frag[kk][2] = $PACK(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            p_frag[kk][3] = $PACK(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            ds_frag[kk][0] = $PACK(dp[2 * kk][0], dp[2 * kk][1]);
            ds_frag[kk][1] = $PACK(dp[2 * kk][2], dp[2 * kk][3]);
            ds_frag[kk][2] = $PACK(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
            ds_frag[kk][3] = $PACK(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
            fs_st32(&ds_tile[ds_at(key_row, 16 * kk + frag_col)], ds_frag[kk][0]);
            fs_st32(&ds_tile[ds_at(key_row + 8, 16 * kk + frag_col)], ds_frag[kk][1]);
            fs_st32(&ds_tile[ds_at(key_row, 16 * kk + 8 + frag_col)], ds_frag[kk][2]);
            fs_st32(&ds_tile[ds_at(key_row + 8, 16 * kk + 8 + frag_col)], ds_frag[kk][3]);
        }
        fs_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < TILE_Q / 16; ++kk)
            $ACC_MMA(dv_acc, p_frag[kk], $DO_MNMAJOR, 1);
#pragma unroll
        for (int kk = 0; kk < TILE_Q / 16; ++kk)
            $ACC_MMA(dk_acc, ds_frag[kk], $Q_MNMAJOR, 1);
        fs_wgmma_commit();

        // 8. dQ = dS K for the tile's queries and the block's keys, once both
        //    warpgroups' dS^T is in: A = dS read MN-major from dS^T (keys 16kk ..
        //    at row group 2kk), B = the key tile MN-major, warpgroup wg taking
        //    features wg * HEAD_DIM / 2 ... dq[n][e] = query i0 + 16 * warp +
        //    frag_row + 8 * (e / 2), feature wg * HEAD_DIM / 2 + 8n + frag_col + e % 2.
        fs_fence_async_smem();
        fs_bar_sync(2, CONSUMERS);
        float dq[HEAD_DIM / 16][4];
        fs_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; ++kk)
            $DQ_MMA(dq, fs_desc_at(ds_desc, kk * 16 * TILE_Q * 2), fs_desc_at(kdq_desc, kk * 16 * HEAD_DIM * 2), kk);
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
            float* const row = &dqt[(warp * 16 + frag_row + 8 * r) * DQ_ROW + wg * (HEAD_DIM / 2) + frag_col];
#pragma unroll
            for (int n = 0; n < HEAD_DIM / 16; ++n) fs_st_f32x2(row + n * 8, dq[n][2 * r], dq[n][2 * r + 1]);
        }
        fs_syncwarp();
        if (lane == 0) fs_mbar_arrive(&dq_full[u]);
        i0 += TILE_Q;
        if (i0 >= q_len) i0 = i_first;
        if (++buf == STAGES) buf = 0, phase ^= 1;
    }

$STORE_DKDV"#;

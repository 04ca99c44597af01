//! CUDA C for the Hopper (sm_90a) dK/dV/dQ kernel of the attention
//! backward's atomic scheme (`flash_bwd.rs`'s `_dkdvdq`, same arguments,
//! scratch and neighbours `_delta` and `_dqstore`), on warpgroup tensor-core
//! instructions (`wgmma.mma_async`) fed from shared memory in the forward's
//! core-matrix layout (`flash_sm90.rs`).
//!
//! # Launch contract
//!
//! Compile for `sm_90a`; `grid = (ceil(S / 128), Hkv, B)`, `block = (256, 1,
//! 1)`, dynamic shared memory [`smem_bytes`] (over 48 KiB: raise the
//! function's limit first). Everything else as `flash_bwd.rs` says.
//!
//! # Design
//!
//! One block of two warpgroups owns 128 keys of one (batch, kv head);
//! warpgroup `wg` owns keys `64wg .. 64wg + 63`. K and V are loaded once; the
//! queries of every head of the group stream through shared memory 64 at a
//! time (Q, dO, their lse and delta), one tile ahead by `cp.async`. Per
//! query tile, each warpgroup:
//!
//! 1. `S^T = K Q^T` and `dP^T = V dO^T` (both operands in shared memory,
//!    K-major), so that `P^T = exp2(S^T scale_log2 - lse)` and `dS^T = P^T
//!    (dP^T - delta)` come out in the accumulator layout, which is wgmma's
//!    register A layout;
//! 2. `dV += P^T dO` and `dK += dS^T Q` (A in registers, B = the dO / Q
//!    tile read MN-major), accumulators kept across all tiles;
//! 3. writes dS^T to shared memory (`[key][query]` in core matrices); after
//!    a barrier, the tile's `dQ = dS K` over the block's 128 keys (A = dS
//!    read MN-major, B = the key tile MN-major), each warpgroup half the
//!    features, added into the f32 sum with `red.global.add.v2.f32`.
//!
//! Causal: query tiles before the first that can see the block's first key
//! are skipped; only tiles crossing the diagonal or the sequence ends are
//! masked. P and dS are rounded to the input's 16-bit type as operands.

use super::flash::{elem_names, Config};
use super::flash_bwd::{common_subs, dkdv_store_subs, fill, p_masked_subs};
use super::flash_sm90::{wgmma_helpers, wgmma_name, Operand};
use super::templates::Ctx;
use crate::ir::Graph;
use petgraph::stable_graph::NodeIndex;

/// Keys per block (2 warpgroups of 64).
pub const TILE_KEYS: u64 = 128;
/// Queries per streamed tile (wgmma's M for dQ).
pub const TILE_QUERIES: u64 = 64;
/// Threads per block.
pub const THREADS: u32 = 256;

/// Dynamic shared memory at head dim `d`: K and V, two Q and dO tiles, dS^T,
/// and two tiles' lse and delta.
pub fn smem_bytes(d: u64) -> u64 {
    (2 * TILE_KEYS + 4 * TILE_QUERIES) * d * 2 + TILE_KEYS * TILE_QUERIES * 2 + 4 * TILE_QUERIES * 4
}

/// The wgmma wrappers the kernel calls at head dim `d`.
pub(crate) fn helpers(d: u64) -> String {
    wgmma_helpers(&shapes(d))
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
    subs.extend(p_masked_subs(8));
    let (elem, _) = elem_names(cfg.dt);
    let [st, acc, dq] = shapes(cfg.head_dim).map(|(a, b, n)| wgmma_name(a, b, n, elem));
    subs.push(("ST_MMA", st));
    subs.push(("ACC_MMA", acc));
    subs.push(("DQ_MMA", dq));
    subs.push(("SMEM_BYTES", smem.to_string()));
    subs.push(("TILE_K", TILE_KEYS.to_string()));
    subs.push(("TILE_Q", TILE_QUERIES.to_string()));
    subs.push(("WG_THREADS", THREADS.to_string()));
    fill(BODY, &subs)
}

const BODY: &str = r#"    // FlashAttention-2 backward on Hopper tensor cores, kernel 2 of 3: dK, dV and
    // dQ (wgmma, f32 accumulation). Block = (tile of $TILE_K keys, kv head, batch);
    // warpgroup wg owns keys 64wg .. 64wg + 63 and computes S^T = K Q^T and
    // dP^T = V dO^T, so that P^T and dS^T come out in the accumulator layout,
    // wgmma's register A layout for dV += P^T dO and dK += dS^T Q. dS^T then goes
    // to shared memory, and the tile's dQ += dS K (features split between the
    // warpgroups) is added into the f32 sum by atomics. Queries of every head of
    // the group stream through shared memory $TILE_Q at a time, one tile ahead.
    constexpr int TILE_K = $TILE_K, TILE_Q = $TILE_Q, HEAD_DIM = $D;
    constexpr int CHUNKS = HEAD_DIM / 8;   // 16-byte chunks per row
    // [rows][HEAD_DIM] tiles in core matrices (emit/flash_sm90.rs): CORE bytes
    // apart along the features, ROW8 along the rows. dS^T [key][query] likewise,
    // its core matrices DS_ROW8 bytes apart along the keys.
    constexpr unsigned CORE = 128, ROW8 = CHUNKS * CORE, DS_ROW8 = (TILE_Q / 8) * CORE;
    const fs_i64 q_len = $T, kv_len = $S, group = $GROUP;
    const bool causal = $CAUSAL;  // if so, keys j > query i are masked
    const float scale = $SCALE, scale_log2 = $SCALE_LOG2;  // exp(x * scale) = exp2(x * scale_log2)
    const fs_i64 k0 = (fs_i64)blockIdx.x * TILE_K, kv_h = blockIdx.y, b = blockIdx.z;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
    const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
    FS_DYNAMIC_SMEM(smem, $SMEM_BYTES);
    $TY* const k_tile = reinterpret_cast<$TY*>(smem);      // [TILE_K][HEAD_DIM]
    $TY* const v_tile = k_tile + TILE_K * HEAD_DIM;         // [TILE_K][HEAD_DIM]
    $TY* const q_tiles = v_tile + TILE_K * HEAD_DIM;        // 2 x [TILE_Q][HEAD_DIM]
    $TY* const do_tiles = q_tiles + 2 * TILE_Q * HEAD_DIM;  // 2 x [TILE_Q][HEAD_DIM]
    $TY* const ds_tile = do_tiles + 2 * TILE_Q * HEAD_DIM;  // dS^T: [TILE_K][TILE_Q]
    float* const lse_tiles = reinterpret_cast<float*>(ds_tile + TILE_K * TILE_Q);  // 2 x TILE_Q: lse * log2(e)
    float* const delta_tiles = lse_tiles + 2 * TILE_Q;                               // 2 x TILE_Q

    // 1. The block's keys and values (rows past kv_len zero; their dK, dV are
    //    never stored). Chunk c is row (c / (8 * CHUNKS)) * 8 + c % 8, features
    //    ((c / 8) % CHUNKS) * 8 .., stored at element 8c.
    for (int c = threadIdx.x; c < TILE_K * CHUNKS; c += $WG_THREADS) {
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
    // Query tiles t = 0 .. tiles - 1: head kv_h * group + t / per_head, rows
    // i_first + (t % per_head) * TILE_Q; causal: from the first tile that can see key k0.
    const fs_i64 i_first = causal ? (k0 / TILE_Q) * TILE_Q : 0;
    const fs_i64 per_head = q_len > i_first ? (q_len - i_first + TILE_Q - 1) / TILE_Q : 0;
    const fs_i64 tiles = group * per_head;
    // 2. Query tile t into buffer buf: Q and dO (rows past q_len zero), lse (log2 units), delta.
    auto load_queries = [&](int buf, fs_i64 t) {
        const fs_i64 h = kv_h * group + t / per_head, i0 = i_first + (t % per_head) * TILE_Q;
        $TY* const qt = q_tiles + buf * TILE_Q * HEAD_DIM;
        $TY* const dot = do_tiles + buf * TILE_Q * HEAD_DIM;
        for (int c = threadIdx.x; c < TILE_Q * CHUNKS; c += $WG_THREADS) {
            const int r = (c / (8 * CHUNKS)) * 8 + (c & 7), e = ((c >> 3) % CHUNKS) * 8;
            const fs_i64 i = i0 + r;
            if (i < q_len) {
                fs_copy16_async(&qt[c * 8], &$QP[$Q_AT + e]);
                fs_copy16_async(&dot[c * 8], &$DOP[$DO_AT + e]);
            } else {
                fs_zero16(&qt[c * 8]);
                fs_zero16(&dot[c * 8]);
            }
        }
        if (threadIdx.x < TILE_Q) {
            const fs_i64 i = i0 + threadIdx.x;
            lse_tiles[buf * TILE_Q + threadIdx.x] = i < q_len ? $LSE * 1.4426950408889634f : 0.0f;
            delta_tiles[buf * TILE_Q + threadIdx.x] = i < q_len ? $DELTA[(b * $HQ + h) * q_len + i] : 0.0f;
        }
    };
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
    const $TY* const k_wg = k_tile + wg * 64 * HEAD_DIM;
    const $TY* const v_wg = v_tile + wg * 64 * HEAD_DIM;
    if (tiles > 0) load_queries(0, 0);
    fs_copy_async_commit();
    for (fs_i64 t = 0; t < tiles; ++t) {
        const fs_i64 h = kv_h * group + t / per_head, i0 = i_first + (t % per_head) * TILE_Q;
        const int buf = t & 1;
        // Tile t has landed and every warp is done with tile t - 1 (its buffer,
        // and dS^T), so the other buffer takes tile t + 1 meanwhile.
        fs_copy_async_wait_all();
        fs_fence_async_smem();
        __syncthreads();
        if (t + 1 < tiles) load_queries(buf ^ 1, t + 1);
        fs_copy_async_commit();
        const $TY* const qt = q_tiles + buf * TILE_Q * HEAD_DIM;
        const $TY* const dot = do_tiles + buf * TILE_Q * HEAD_DIM;
        const float* const lse_tile = lse_tiles + buf * TILE_Q;
        const float* const delta_tile = delta_tiles + buf * TILE_Q;

        // 3. S^T = K Q^T and dP^T = V dO^T for the warpgroup's 64 keys: s[n][e],
        //    dp[n][e] = key key_row + 8 * (e / 2), query i0 + 8n + frag_col + e % 2.
        //    Features 16kk .. 16kk + 15 start at element 128kk of a row group.
        float s[TILE_Q / 8][4], dp[TILE_Q / 8][4];
        fs_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            $ST_MMA(s, fs_make_desc(k_wg + kk * 128, CORE, ROW8), fs_make_desc(qt + kk * 128, CORE, ROW8), kk);
        fs_wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
            $ST_MMA(dp, fs_make_desc(v_wg + kk * 128, CORE, ROW8), fs_make_desc(dot + kk * 128, CORE, ROW8), kk);
        fs_wgmma_commit();

        // 4. P^T = exp2(S^T * scale_log2 - lse_log2), masked (queries past q_len;
        //    causal: keys after the query) only on tiles that can need it, while
        //    dP^T is still being computed; then dS^T = P^T * (dP^T - delta) in dp.
        fs_wgmma_wait_all_but_1();
        fs_wgmma_hold(s);
$EDGE
#pragma unroll
        for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
$P_MASKED
            }
        }
        fs_wgmma_wait_all();
        fs_wgmma_hold(dp);
#pragma unroll
        for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - delta_tile[n * 8 + frag_col + (e & 1)]);
        }

        // 5. P^T and dS^T as 16-bit A fragments (queries 16kk .. 16kk + 15), dS^T
        //    also into shared memory for dQ; then dV += P^T dO and dK += dS^T Q,
        //    B = the dO / Q tile read MN-major (queries 16kk .. at row group 2kk).
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
            $ACC_MMA(dv_acc, p_frag[kk], fs_make_desc(dot + kk * 16 * HEAD_DIM, ROW8, CORE), 1);
#pragma unroll
        for (int kk = 0; kk < TILE_Q / 16; ++kk)
            $ACC_MMA(dk_acc, ds_frag[kk], fs_make_desc(qt + kk * 16 * HEAD_DIM, ROW8, CORE), 1);
        fs_wgmma_commit();

        // 6. dQ = dS K for the tile's queries and the block's keys: A = dS read
        //    MN-major from dS^T (keys 16kk .. at row group 2kk), B = the key tile
        //    MN-major, warpgroup wg taking features wg * HEAD_DIM / 2 ..; added into
        //    the f32 sum in the scratch ([B, Hq, T, D]) by atomics. dq[n][e] = query
        //    i0 + 16 * warp + frag_row + 8 * (e / 2), feature wg * HEAD_DIM / 2 + 8n + frag_col + e % 2.
        fs_fence_async_smem();
        __syncthreads();  // dS^T is complete
        float dq[HEAD_DIM / 16][4];
        fs_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < TILE_K / 16; ++kk)
            $DQ_MMA(dq, fs_make_desc(ds_tile + kk * 16 * TILE_Q, DS_ROW8, CORE),
                    fs_make_desc(k_tile + kk * 16 * HEAD_DIM + wg * 4 * HEAD_DIM, ROW8, CORE), kk);
        fs_wgmma_commit();
        fs_wgmma_wait_all();
        fs_wgmma_hold(dq);
        fs_wgmma_hold(dk_acc);
        fs_wgmma_hold(dv_acc);
        // (16-byte reductions, lanes trading pairs so that each holds 4 adjacent
        // features, ran this kernel 1-2% slower on an H100: docs/benchmarks.md.)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const fs_i64 i = i0 + warp * 16 + frag_row + 8 * r;
            if (i < q_len) {
                float* sum = &scratch[((b * $HQ + h) * q_len + i) * HEAD_DIM + wg * (HEAD_DIM / 2) + frag_col];
#pragma unroll
                for (int n = 0; n < HEAD_DIM / 16; ++n) fs_atomic_add2(sum + n * 8, dq[n][2 * r], dq[n][2 * r + 1]);
            }
        }
    }
    fs_copy_async_wait_all();

$STORE_DKDV"#;

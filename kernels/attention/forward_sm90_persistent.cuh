// The Hopper forward of forward_sm90.cuh made persistent, for head dims up
// to 64 (three consumer warpgroups, 192 query rows a block): a launch of at
// most one block a multiprocessor walks the work items (one per query tile,
// query head and batch) in ForwardSchedule's order. Block x starts with item
// x; each block's producer then claims the next unclaimed item from a
// counter in global memory (fs_forward_sm90_work, which the last block to
// finish puts back to zero for the next launch), so that blocks with short
// items take more of them, as the hardware's block scheduler would, and
// hands each item to the consumers through a two-slot ring in shared
// memory. The producer runs on into the next item's key and value tiles
// while the consumers finish an item, and each consumer warpgroup copies
// its next query rows while it writes the output of the last, so that
// neither a block's start nor its end leaves the tensor cores idle. On an
// H100 that made the forward at 64 features 6-9% faster at every T from
// 1024 to 8192; with two warpgroups (wider heads) the same scheme ran up to
// 7% slower at T = 1024 than a block a query tile, so those stay there.
//
// Everything inside an item is forward_sm90.cuh's algorithm, its loop kept
// as a copy here (one loop shared by both measured 2-6% slower for this
// kernel at T >= 4096 on an H100): S = Q K^T of
// tile t under O += P V of tile t - 1, the masks and online softmax while
// the tensor cores work, the warpgroups taking turns (ping-pong).
//
// Launch: grid (min(items, multiprocessors), 1, 1), THREADS threads,
// SMEM_BYTES of dynamic shared memory, after the other arguments the tensor
// maps of K and V (boxes of KT::ATOM / VT::ATOM features by TILE_K rows,
// swizzled KT::SW / VT::SW bytes), by value.
#ifndef FS_ATTENTION_FORWARD_SM90_PERSISTENT
#define FS_ATTENTION_FORWARD_SM90_PERSISTENT
#include "sm90.cuh"

namespace fs_attn {

// One item as the producer hands it to the consumers: its first query row
// (-1: no item left), query head and batch.
struct Work {
    int q0, h, b, unused;
};

// [0]: items handed out after each block's first; [1]: blocks done taking
// items. Zero when no launch runs (a module's globals start at zero, and
// the last block of each launch clears them; a launch that faults midway
// leaves them set, but such a fault also ends the CUDA context).
__device__ unsigned fs_forward_sm90_work[2];

// The order in which a persistent forward visits its work items: query
// heads in sections whose keys and values fit in L2 together (32 MiB), and
// within a section tile rank by tile rank, every head of the section at one
// rank before the next (causal: the longest query tiles first). The blocks
// running at one time then read the keys and values of a few heads, each
// from memory once, and the long items start first so the short ones fill
// the end.
// Sizes in 32-bit integers: the kernel keeps a few of them live beside its
// accumulators.
struct ForwardSchedule {
    static constexpr fs_i64 L2_BYTES = 32ll << 20;
    int tiles_q, heads, rows, section, items;
    __device__ __forceinline__ ForwardSchedule(const ForwardArgs& a, int tile_q, int kv_row_bytes) {
        tiles_q = (int)((a.q_len + tile_q - 1) / tile_q);
        heads = (int)a.q_heads;
        rows = (int)(a.q_heads * a.batch);
        const fs_i64 kv_head = a.kv_len * kv_row_bytes;  // one key/value head's keys and values
        const fs_i64 kv_heads = kv_head > 0 && kv_head < L2_BYTES ? L2_BYTES / kv_head : 1;
        section = kv_heads * a.group < rows ? (int)(kv_heads * a.group) : rows;
        if (section < 1) section = 1;
        items = tiles_q * rows;
    }
    // Item i's first query row, query head and batch.
    template <bool CAUSAL>
    __device__ __forceinline__ void at(int i, int tile_q, int& q0, int& h, int& b) const {
        const int per = section * tiles_q, s = i / per, first = s * section;
        const int size = rows - first < section ? rows - first : section;
        const int j = i - s * per, rank = j / size, hb = first + j % size;
        q0 = (CAUSAL ? tiles_q - 1 - rank : rank) * tile_q;
        h = hb % heads;
        b = hb / heads;
    }
};

template <class E, int D, int DV, bool CAUSAL, bool SCALE_IN_EXP>
struct ForwardSm90Persistent {
    static constexpr int DP = swizzle_pad(D), DVP = swizzle_pad(DV);
    // Three consumer warpgroups (192 query rows), as forward_sm90.cuh up to
    // 64 features.
    static_assert(DP <= 64 && DVP <= 64, "the persistent forward is for head dims up to 64");
    static constexpr int WGS = 3;
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
    // Each warpgroup's output rows on their way to global memory
    // (store_output_staged): its query rows hold the next item's by then.
    static constexpr unsigned STAGE_BYTES = (DVP & (DVP - 1)) == 0 ? TILE_Q * DVP * 2 : 0;
    // The tiles, the output's staging rows, the key and value buffers'
    // mbarriers, the item ring's two mbarriers and one Work a slot, and room
    // for alignment.
    static constexpr unsigned SMEM_BYTES =
        Q_BYTES + STAGES * (KT::BYTES + VT::BYTES) + STAGE_BYTES + 4 * STAGES * 8 + 2 * 2 * 8 + 2 * 16 + 1024;
    static_assert(Q_BYTES % 1024 == 0 && KT::BYTES % 1024 == 0 && VT::BYTES % 1024 == 0, "swizzled tiles start 1024-byte aligned");

    // The key tiles of the query tile from row q0 (causal: key tiles after
    // its last row are never visited).
    static __device__ __forceinline__ int key_tiles(fs_i64 kv_len, fs_i64 q0) {
        return (int)((visited_keys_end<TILE_Q, CAUSAL>(q0, kv_len) + TILE_K - 1) / TILE_K);
    }

    // The producer's loop (one thread), a function of its own: its few
    // registers are then allocated apart from the consumers', which need
    // nearly all of theirs (inlined, ptxas spilled 4-40 bytes in every
    // instance). It takes the sizes by value: a reference to the arguments
    // kept them in local memory for the consumers too (a 240-byte stack frame).
    static __device__ __noinline__ void produce(const ForwardSchedule sched, fs_i64 kv_len, int group, const fs_tmap& tm_k,
                                                const fs_tmap& tm_v, unsigned char* k_tiles, unsigned char* v_tiles,
                                                fs_mbar* k_full, Work* items) {
        fs_mbar* const v_full = k_full + STAGES;
        fs_mbar* const k_empty = k_full + 2 * STAGES;
        fs_mbar* const v_empty = k_full + 3 * STAGES;
        fs_mbar* const item_full = k_full + 4 * STAGES;
        fs_mbar* const item_empty = item_full + 2;
        int buf = 0;          // n % STAGES
        unsigned phase = 0;   // (n / STAGES) & 1
        bool reused = false;  // n >= STAGES
        int slot = 0;         // the item ring's, as buf
        unsigned slot_phase = 0;
        bool slot_reused = false;
        // The item after this one is claimed as this one starts, so that the
        // counter's round trip is over before the consumers ask for it.
        auto claim = [&]() { return (int)(fs_atomic_inc(&fs_forward_sm90_work[0]) + gridDim.x); };
        int upcoming = (int)blockIdx.x < sched.items ? claim() : sched.items;
        for (int item = blockIdx.x;;) {
            // The item to the consumers (none left: q0 = -1 tells them to stop).
            int q0 = -1, h = 0, b = 0;
            if (item < sched.items) sched.at<CAUSAL>(item, TILE_Q, q0, h, b);
            if (slot_reused) fs_mbar_wait(&item_empty[slot], slot_phase ^ 1);
            items[slot] = Work{q0, h, b, 0};
            fs_mbar_arrive(&item_full[slot]);
            if (++slot == 2) slot = 0, slot_phase ^= 1, slot_reused = true;
            if (q0 < 0) break;
            const int kv_h = h / group, tiles = key_tiles(kv_len, q0);
            for (int t = 0; t < tiles; ++t) {
                const int k0 = t * TILE_K;
                if (reused) fs_mbar_wait(&k_empty[buf], phase ^ 1);
                fs_mbar_expect_tx(&k_full[buf], KT::BYTES);
                unsigned char* const kt = k_tiles + buf * KT::BYTES;
#pragma unroll
                for (int x = 0; x < DP / KT::ATOM; ++x)
                    fs_tma_load(kt + x * KT::BOX, tm_k, x * KT::ATOM, kv_h, k0, (int)b, &k_full[buf]);
                fs_mbar_tma_issued(&k_full[buf]);
                if (reused) fs_mbar_wait(&v_empty[buf], phase ^ 1);
                fs_mbar_expect_tx(&v_full[buf], VT::BYTES);
                unsigned char* const vt = v_tiles + buf * VT::BYTES;
#pragma unroll
                for (int x = 0; x < DVP / VT::ATOM; ++x)
                    fs_tma_load(vt + x * VT::BOX, tm_v, x * VT::ATOM, kv_h, k0, (int)b, &v_full[buf]);
                fs_mbar_tma_issued(&v_full[buf]);
                if (++buf == STAGES) buf = 0, phase ^= 1, reused = true;
            }
            item = upcoming;
            if (item < sched.items) upcoming = claim();
        }
        // Every block has claimed its last item (one past the end, or none)
        // once all have counted themselves here: the last puts the counters back.
        fs_threadfence();
        if (fs_atomic_inc(&fs_forward_sm90_work[1]) == gridDim.x - 1) {
            fs_atomic_clear(&fs_forward_sm90_work[0]);
            fs_atomic_clear(&fs_forward_sm90_work[1]);
        }
    }

    static __device__ __forceinline__ void run(const ForwardArgs& a, const fs_tmap& tm_k, const fs_tmap& tm_v) {
        const int lane = threadIdx.x & 31;
        FS_DYNAMIC_SMEM(smem_raw, SMEM_BYTES);
        unsigned char* const smem = fs_align1024(smem_raw);  // for the swizzle
        unsigned short* const q_tile = reinterpret_cast<unsigned short*>(smem);  // [TILE_Q][DP], core matrices
        unsigned char* const k_tiles = smem + Q_BYTES;                          // STAGES x KT
        unsigned char* const v_tiles = k_tiles + STAGES * KT::BYTES;             // STAGES x VT
        // Buffer s's k_full[s] / v_full[s] complete when its copies' bytes have
        // landed, k_empty[s] / v_empty[s] when every consumer warp is done reading it.
        // The producer and the consumers walk the same key tiles, item after
        // item, so the n-th tile of the block sits in buffer n % STAGES.
        unsigned short* const stage = reinterpret_cast<unsigned short*>(v_tiles + STAGES * VT::BYTES);  // [TILE_Q][DVP]
        fs_mbar* const k_full = reinterpret_cast<fs_mbar*>(v_tiles + STAGES * VT::BYTES + STAGE_BYTES);
        fs_mbar* const v_full = k_full + STAGES;
        fs_mbar* const k_empty = k_full + 2 * STAGES;
        fs_mbar* const v_empty = k_full + 3 * STAGES;
        // The item ring: slot s holds an item's Work once item_full[s]
        // completes, and is free again once item_empty[s] does.
        fs_mbar* const item_full = k_full + 4 * STAGES;
        fs_mbar* const item_empty = item_full + 2;
        Work* const items = reinterpret_cast<Work*>(item_full + 4);
        if (threadIdx.x == 0) {
            for (int i = 0; i < 2 * STAGES; ++i) fs_mbar_init(&k_full[i], 1);
            for (int i = 2 * STAGES; i < 4 * STAGES; ++i) fs_mbar_init(&k_full[i], CONSUMERS / 32);
            for (int i = 0; i < 2; ++i) fs_mbar_init(&item_full[i], 1), fs_mbar_init(&item_empty[i], CONSUMERS / 32);
        }
        __syncthreads();

        if (threadIdx.x >= CONSUMERS) {
            // 1. The producer: the n-th key tile into buffer n % STAGES once the
            //    consumers are done with tile n - STAGES, then its value tile
            //    likewise, each as boxes of TILE_K rows (rows past kv_len zero).
            fs_setmaxnreg_dec<PRODUCER_REGS>();
            if (threadIdx.x != CONSUMERS) return;
            produce(ForwardSchedule(a, TILE_Q, (D + DV) * 2), a.kv_len, (int)a.group, tm_k, tm_v, k_tiles, v_tiles, k_full,
                    items);
            return;
        }

        fs_setmaxnreg_inc<CONSUMER_REGS>();
        const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, wg_tid = threadIdx.x & 127;
        // PTX fragment coordinates: groupID (a row) and 2 * threadID_in_group (a column pair).
        const int frag_row = lane >> 2, frag_col = (lane & 3) * 2;
        // This thread's rows of an item are q0 + q_row (index 0) and q0 + q_row + 8 (index 1).
        const int q_row = wg * 64 + warp * 16 + frag_row;
        // The warpgroup's own 64 query rows of the tile; it alone reads and
        // writes them, so it copies the next item's behind a barrier of its own.
        unsigned short* const q_rows = q_tile + wg * 64 * DP;
        const unsigned Q_BAR = 1 + WGS + wg;
        // wgmma descriptors of the warpgroup's queries and of the first key and
        // value buffers; a buffer's and a step's are these moved on (fs_desc_at).
        const fs_desc q_desc = QT::kmajor(q_rows);
        const fs_desc k_desc = KT::kmajor(k_tiles), v_desc = VT::mnmajor(v_tiles);
        auto load_q = [&](const Work& w) {
            load_core_rows<64, D, DP, 128>(q_rows, a.q, w.b, w.q0 + wg * 64, w.h, a.q_len, wg_tid);
            fs_copy_async_commit();
        };
        auto q_landed = [&]() {
            fs_copy_async_wait_all();
            fs_fence_async_smem();
            fs_bar_sync(Q_BAR, 128);
        };
        // s[n][e]: tile t's scores, row q_row + 8 * (e / 2), key k0 + 8n + frag_col + e % 2;
        // p_frag: tile t - 1's P as wgmma's register A fragments (keys 16kk .. 16kk + 15).
        float s[TILE_K / 8][4];
        unsigned p_frag[TILE_K / 16][4];
        // Turns at the tensor cores: warpgroup wg issues its products once it has
        // passed named barrier 1 + wg, to which the warpgroup before it
        // (cyclically) arrives once it has issued its own; the last warpgroup
        // lets the first start. Every warpgroup issues tiles + 1 times an
        // item; the turns run on from item to item, and the last warpgroup's
        // final arrival of the block's last item is left out so that no
        // barrier is left half-passed.
        constexpr int TURN = 2 * 128;  // a turn barrier's threads: the warpgroup waiting, the one arriving
        const int next_wg = wg + 1 == WGS ? 0 : wg + 1;

        // Counters of the items taken and of the key tiles passed: each
        // one's slot (n % 2, STAGES = 2) and phase ((n / 2) & 1) follow from it,
        // in one register where the consumers have few to spare.
        static_assert(STAGES == 2, "buffers and phases as a counter's bits");
        // An item's Work stays in its slot until the consumers are done with
        // the item and read from there when it is needed (volatile: read
        // again rather than held in registers).
        unsigned taken = 0, passed = 0;
        auto take = [&]() {
            const int slot = taken & 1;
            fs_mbar_wait(&item_full[slot], (taken >> 1) & 1);
            ++taken;
            return static_cast<volatile Work*>(&items[slot]);
        };
        auto load_q_of = [&](volatile Work* w) { load_q(Work{w->q0, w->h, w->b, 0}); };
        volatile Work* item = take();
        if (item->q0 >= 0) {
            load_q_of(item);
            q_landed();
            if (a.kv_len > 0 && wg == WGS - 1) fs_bar_arrive(1, TURN);
        }
        while (item->q0 >= 0) {
            const int q0 = item->q0, tiles = key_tiles(a.kv_len, q0);
            // Running state of this thread's rows: the max score in log2 units,
            // this thread's part of the row sum, and o_acc[n][e] = row
            // q_row + 8 * (e / 2), feature 8n + frag_col + e % 2.
            float row_max[2] = {FS_NEG_INF, FS_NEG_INF}, row_sum[2] = {0.0f, 0.0f}, o_rescale[2];
            float o_acc[DVP / 8][4];
#pragma unroll
            for (int n = 0; n < DVP / 8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) o_acc[n][e] = 0.0f;
            }
            const int i_lo = q0 + q_row, i_hi = i_lo + 8, first_row = q0 + wg * 64 + warp * 16;

            // 2. S = Q K^T of the warpgroup's 64 rows and the tile's keys (K-major:
            //    features 16kk .. from each descriptor's k step).
            auto issue_s = [&](fs_desc kt_desc) {
                fs_wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < DP / 16; ++kk)
                    wgmma_ss<E, KT, false, TILE_K, 0>(s, fs_desc_at(q_desc, QT::k_step(kk)), fs_desc_at(kt_desc, KT::k_step(kk)), kk);
            };
            // 5. O += P V of a tile (P's register fragments; V as B read MN-major,
            //    keys 16kk .. at its k step).
            auto issue_pv = [&](fs_desc vt_desc) {
#pragma unroll
                for (int kk = 0; kk < TILE_K / 16; ++kk)
                    wgmma_rs<E, VT, true, DVP>(o_acc, p_frag[kk], fs_desc_at(vt_desc, VT::mn_k_step(kk)), 1);
            };
            // 3, 4. The masks and the online softmax of the scores, then P as the next
            //    product's A fragments.
            auto softmax = [&](fs_i64 k0) {
                mask_and_softmax<TILE_K, CAUSAL, SCALE_IN_EXP>(s, row_max, row_sum, o_rescale, k0, a.kv_len, first_row, i_lo,
                                                               i_hi, frag_col, a.scale_log2);
            };
            auto pack = [&]() {
#pragma unroll
                for (int kk = 0; kk < TILE_K / 16; ++kk) a_frag_of<E>(p_frag[kk], s, kk);
            };

            // Tile 0's scores alone (no P V yet).
            if (tiles > 0) {
                const int buf = passed & 1;
                fs_mbar_wait(&k_full[buf], (passed >> 1) & 1);
                fs_bar_sync(1 + wg, TURN);
                issue_s(fs_desc_at(k_desc, buf * KT::BYTES));
                fs_wgmma_commit();
                fs_bar_arrive(1 + next_wg, TURN);
                fs_wgmma_wait_all();
                fs_wgmma_hold(s);
                if (lane == 0) fs_mbar_arrive(&k_empty[buf]);
                softmax(0);
                pack();
            }
            for (int t = 1; t < tiles; ++t) {
                const int prev = passed & 1, buf = prev ^ 1;
                const unsigned prev_phase = (passed >> 1) & 1;
                ++passed;
                const fs_i64 k0 = (fs_i64)t * TILE_K;
                fs_mbar_wait(&k_full[buf], (passed >> 1) & 1);
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
            // Every product reading the queries has landed: the next item's
            // rows copy in under the last O += P V and the output's stores,
            // once every warp of the warpgroup is past its wait (a warp's
            // copies cover the others' rows). The producer has handed the
            // next item over once it has issued this one's last copies.
            volatile Work* const next = take();
            const bool more = next->q0 >= 0;
            if (more) {
                fs_bar_sync(Q_BAR, 128);
                load_q_of(next);
            }
            // The last tile's O += P V.
            if (tiles > 0) {
                const int buf = passed & 1;
                fs_mbar_wait(&v_full[buf], (passed >> 1) & 1);
                fs_bar_sync(1 + wg, TURN);
                fs_wgmma_fence();
                issue_pv(fs_desc_at(v_desc, buf * VT::BYTES));
                fs_wgmma_commit();
                if (more || wg + 1 < WGS) fs_bar_arrive(1 + next_wg, TURN);
                fs_wgmma_wait_all();
                fs_wgmma_hold(o_acc);
                if (lane == 0) fs_mbar_arrive(&v_empty[buf]);
                ++passed;
            }

            // 6. O and the log-sum-exp, O through the warpgroup's staging rows
            //    (q_landed's barrier below keeps the next item's from writing
            //    over them before every thread has read them) where a row is a
            //    power of two of 16-byte chunks: at 48 features the division
            //    by 6 made ptxas spill 20-28 bytes in the consumers.
            if constexpr ((DVP & (DVP - 1)) == 0) {
                store_output_staged<E, DV, DVP>(a, o_acc, row_max, row_sum, item->b, item->h, q0 + wg * 64,
                                                warp * 16 + frag_row, frag_col, wg_tid, stage + wg * 64 * DVP, Q_BAR);
            } else {
                store_output<E, DV>(a, o_acc, row_max, row_sum, item->b, item->h, i_lo, i_hi, frag_col);
            }
            // The item's slot is free for the producer.
            fs_syncwarp();
            if (lane == 0) fs_mbar_arrive(&item_empty[(taken - 2) & 1]);
            if (more) q_landed();
            item = next;
        }
    }
};

}  // namespace fs_attn

#endif

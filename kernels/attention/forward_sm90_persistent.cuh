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
// Everything inside an item is forward_sm90.cuh's algorithm: S = Q K^T of
// tile t under O += P V of tile t - 1, the masks and online softmax while
// the tensor cores work, the warpgroups taking turns (ping-pong).
//
// Launch: grid (min(items, multiprocessors), 1, 1), THREADS threads,
// SMEM_BYTES of dynamic shared memory, after the other arguments the tensor
// maps of K and V (boxes of KT::ATOM / VT::ATOM features by TILE_K rows,
// swizzled KT::SW / VT::SW bytes), by value.
#ifndef FS_ATTENTION_FORWARD_SM90_PERSISTENT
#define FS_ATTENTION_FORWARD_SM90_PERSISTENT
#include "forward_sm90.cuh"

namespace fs_attn {

// One item as the producer hands it to the consumers: its first query row
// (-1: no item left), query head and batch.
struct Work {
    int q0, h, b, unused;
};

// [0]: items handed out after each block's first; [1]: blocks done taking
// items. Zero when no launch runs (a module's globals start at zero).
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
struct ForwardSm90Persistent : ForwardSm90Tiles<E, D, DV, CAUSAL, SCALE_IN_EXP> {
    typedef ForwardSm90Tiles<E, D, DV, CAUSAL, SCALE_IN_EXP> T;
    static_assert(T::WGS == 3, "the persistent forward is for head dims up to 64 (three consumer warpgroups)");
    // After forward_sm90.cuh's tiles and mbarriers, the item ring's two
    // mbarriers and one Work a slot, and room for alignment.
    static constexpr unsigned SMEM_BYTES = T::TILES_BYTES + 2 * 2 * 8 + 2 * 16 + 1024;

    // The producer's loop (one thread), a function of its own: its few
    // registers are then allocated apart from the consumers', which need
    // nearly all of theirs (inlined, ptxas spilled 4-40 bytes in every
    // instance).
    // It takes the sizes by value: a reference to the arguments would keep
    // them in local memory for the consumers too.
    static __device__ __noinline__ void produce(const ForwardSchedule sched, fs_i64 kv_len, int group, const fs_tmap& tm_k,
                                                const fs_tmap& tm_v, unsigned char* k_tiles, unsigned char* v_tiles,
                                                fs_mbar* k_full, Work* items) {
        fs_mbar* const item_full = k_full + 4 * T::STAGES;
        fs_mbar* const item_empty = item_full + 2;
        unsigned copied = 0, posted = 0;  // key tiles copied, items handed over (each slot n % 2, phase (n / 2) & 1)
        // The item after this one is claimed as this one starts, so that the
        // counter's round trip is over before the consumers ask for it.
        auto claim = [&]() { return (int)(fs_atomic_inc(&fs_forward_sm90_work[0]) + gridDim.x); };
        int upcoming = (int)blockIdx.x < sched.items ? claim() : sched.items;
        for (int item = blockIdx.x;;) {
            // The item to the consumers (none left: q0 = -1 tells them to stop).
            int q0 = -1, h = 0, b = 0;
            if (item < sched.items) sched.at<CAUSAL>(item, T::TILE_Q, q0, h, b);
            const int slot = posted & 1;
            if (posted >= 2) fs_mbar_wait(&item_empty[slot], ((posted >> 1) & 1) ^ 1);
            items[slot] = Work{q0, h, b, 0};
            fs_mbar_arrive(&item_full[slot]);
            ++posted;
            if (q0 < 0) break;
            const int kv_h = h / group, tiles = T::key_tiles(kv_len, q0);
            for (int t = 0; t < tiles; ++t) T::load_tile(tm_k, tm_v, k_tiles, v_tiles, k_full, copied++, kv_h, t * T::TILE_K, b);
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
        constexpr int WGS = T::WGS, STAGES = T::STAGES, CONSUMERS = T::CONSUMERS;
        const int lane = threadIdx.x & 31;
        FS_DYNAMIC_SMEM(smem_raw, SMEM_BYTES);
        unsigned char* const smem = fs_align1024(smem_raw);  // for the swizzle
        unsigned short* const q_tile = reinterpret_cast<unsigned short*>(smem);  // [TILE_Q][DP], core matrices
        unsigned char* const k_tiles = smem + T::Q_BYTES;                       // STAGES x KT
        unsigned char* const v_tiles = k_tiles + STAGES * T::KT::BYTES;          // STAGES x VT
        // The key and value buffers' mbarriers as forward_sm90.cuh's; the
        // producer and the consumers walk the same key tiles, item after
        // item, so the n-th tile of the block sits in buffer n % STAGES.
        fs_mbar* const k_full = reinterpret_cast<fs_mbar*>(v_tiles + STAGES * T::VT::BYTES);
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
            // 1. The producer: items, and their key and value tiles.
            fs_setmaxnreg_dec<T::PRODUCER_REGS>();
            if (threadIdx.x != CONSUMERS) return;
            produce(ForwardSchedule(a, T::TILE_Q, (D + DV) * 2), a.kv_len, (int)a.group, tm_k, tm_v, k_tiles, v_tiles, k_full,
                    items);
            return;
        }

        fs_setmaxnreg_inc<T::CONSUMER_REGS>();
        const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, wg_tid = threadIdx.x & 127;
        // The warpgroup's own 64 query rows of the tile; it alone reads and
        // writes them, so it copies the next item's behind a barrier of its own.
        unsigned short* const q_rows = q_tile + wg * 64 * T::DP;
        const unsigned Q_BAR = 1 + WGS + wg;
        // wgmma descriptors of the warpgroup's queries and of the first key and
        // value buffers; a buffer's and a step's are these moved on (fs_desc_at).
        const fs_desc q_desc = T::QT::kmajor(q_rows);
        const fs_desc k_desc = T::KT::kmajor(k_tiles), v_desc = T::VT::mnmajor(v_tiles);
        auto load_q = [&](volatile Work* w) {
            load_core_rows<64, D, T::DP, 128>(q_rows, a.q, w->b, w->q0 + wg * 64, w->h, a.q_len, wg_tid);
            fs_copy_async_commit();
        };
        auto q_landed = [&]() {
            fs_copy_async_wait_all();
            fs_fence_async_smem();
            fs_bar_sync(Q_BAR, 128);
        };

        // Counters of the items taken and of the key tiles passed (each one's
        // slot and phase its bits, in one register where the consumers have
        // few to spare). An item's Work stays in its slot until the consumers
        // are done with the item and is read from there when it is needed
        // (volatile: read again rather than held in registers).
        unsigned taken = 0, passed = 0;
        auto take = [&]() {
            const int slot = taken & 1;
            fs_mbar_wait(&item_full[slot], (taken >> 1) & 1);
            ++taken;
            return static_cast<volatile Work*>(&items[slot]);
        };
        volatile Work* item = take();
        if (item->q0 >= 0) {
            load_q(item);
            q_landed();
            // The turns at the tensor cores run on from item to item.
            if (a.kv_len > 0 && wg == WGS - 1) fs_bar_arrive(1, T::TURN);
        }
        while (item->q0 >= 0) {
            const int q0 = item->q0;
            volatile Work* next = nullptr;
            float o_acc[T::DVP / 8][4], row_max[2], row_sum[2];
            T::consume(a, q_desc, k_desc, v_desc, k_full, passed, T::key_tiles(a.kv_len, q0), q0, o_acc, row_max, row_sum, [&] {
                // Every product reading the queries has landed: the next item's
                // rows copy in under the last O += P V and the output's stores,
                // once every warp of the warpgroup is past its wait (a warp's
                // copies cover the others' rows). The producer has handed the
                // next item over once it has issued this one's last copies.
                next = take();
                const bool more = next->q0 >= 0;
                if (more) {
                    fs_bar_sync(Q_BAR, 128);
                    load_q(next);
                }
                return more;
            });

            // 6. O and the log-sum-exp.
            const int i_lo = q0 + wg * 64 + warp * 16 + (lane >> 2);
            store_output<E, DV>(a, o_acc, row_max, row_sum, item->b, item->h, i_lo, i_lo + 8, (lane & 3) * 2);
            // The item's slot is free for the producer.
            fs_syncwarp();
            if (lane == 0) fs_mbar_arrive(&item_empty[(taken - 2) & 1]);
            if (next->q0 >= 0) q_landed();
            item = next;
        }
    }
};

}  // namespace fs_attn

#endif

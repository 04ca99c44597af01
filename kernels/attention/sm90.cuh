// Hopper (sm_90a) building blocks of the attention kernels: wgmma and its
// shared-memory descriptors, bulk tensor copies (TMA) with their swizzles,
// mbarriers, and the warp-specialization helpers (register hand-over, named
// barriers, 16-byte reductions). A host build makes the fences and copies
// plain and calls the emulation (tests/flash_host/mma_emu.h, block_shim.h)
// for the rest, so the same kernels run on the host.
#ifndef FS_ATTENTION_SM90
#define FS_ATTENTION_SM90
#include "common.cuh"

#ifdef __CUDACC__
typedef unsigned long long fs_desc;
__device__ __forceinline__ unsigned fs_smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 a64; cvta.to.shared.u64 a64, %1; cvt.u32.u64 %0, a64; }" : "=r"(a) : "l"(p));
    return a;
}
// A shared-memory matrix descriptor: `p` at the first core matrix, `lbo` and
// `sbo` its leading and stride byte offsets, `sw` the swizzle's bytes per row
// (0: none; 32, 64, 128: layout types 3, 2, 1).
__device__ __forceinline__ fs_desc fs_make_desc(const void* p, unsigned lbo, unsigned sbo, unsigned sw) {
    const unsigned long long type = sw == 128 ? 1 : sw == 64 ? 2 : sw == 32 ? 3 : 0;
    return (fs_desc)((fs_smem_addr(p) & 0x3FFFFu) >> 4) | ((fs_desc)(lbo >> 4) << 16) | ((fs_desc)(sbo >> 4) << 32) |
           (type << 62);
}
// `d` moved `bytes` (a multiple of 16) further: one add to the address field
// in the low word (shared addresses stay below 2^18, so it cannot carry out).
__device__ __forceinline__ fs_desc fs_desc_at(fs_desc d, unsigned bytes) {
    return (d & 0xFFFFFFFF00000000ull) | (unsigned)((unsigned)d + (bytes >> 4));
}
// `d` as a value the compiler cannot see through: a kernel takes its
// descriptors through it once a tile, so that every step's descriptor is
// made from it where it is used rather than all of them kept live across
// the loop (at 256 features that cost the registers of 16 steps).
__device__ __forceinline__ fs_desc fs_desc_opaque(fs_desc d) {
    fs_desc r;
    asm volatile("mov.b64 %0, %1;" : "=l"(r) : "l"(d));
    return r;
}
// Orders register writes before the next wgmma reads them.
__device__ __forceinline__ void fs_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void fs_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void fs_wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Waits for all but the newest committed group.
__device__ __forceinline__ void fs_wgmma_wait_all_but_1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// Keeps the compiler from touching accumulators across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fs_wgmma_hold(float (&d)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}
// Makes this thread's shared-memory writes visible to wgmma (the async proxy).
__device__ __forceinline__ void fs_fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// 16 bytes from global to shared memory, asynchronously (both 16-byte aligned).
__device__ __forceinline__ void fs_copy16_async(unsigned short* dst, const unsigned short* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(fs_smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void fs_copy_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void fs_copy_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// Shared-memory barriers (mbarrier) with phases: a phase completes when its
// count of arrivals is in; waiting names the parity of the phase awaited.
typedef unsigned long long fs_mbar;
__device__ __forceinline__ void fs_mbar_init(fs_mbar* m, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(fs_smem_addr(m)), "r"(count) : "memory");
}
__device__ __forceinline__ void fs_mbar_arrive(fs_mbar* m) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(fs_smem_addr(m)) : "memory");
}
__device__ __forceinline__ void fs_mbar_wait(fs_mbar* m, unsigned parity) {
    asm volatile("{ .reg .pred done;\nFS_MBAR_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra FS_MBAR_WAIT; }" ::"r"(fs_smem_addr(m)), "r"(parity) : "memory");
}
// The driver's CUtensorMap: 128 opaque bytes, passed by value.
struct alignas(64) fs_tmap {
    unsigned long long opaque[16];
};
#define FS_TMAP_PARAM(name) , const __grid_constant__ fs_tmap name
#define FS_TMAP_HOST(...)
// The box at coordinates (feature, head, row, batch) into dst (1024-byte
// aligned); its bytes complete a transaction of mbarrier `bar`.
__device__ __forceinline__ void fs_tma_load(void* dst, const fs_tmap& map, int c0, int c1, int c2, int c3, fs_mbar* bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                 ::"r"(fs_smem_addr(dst)), "l"(reinterpret_cast<unsigned long long>(&map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                 "r"(fs_smem_addr(bar))
                 : "memory");
}
// Arrives on `m` and expects `bytes` more of copies before its phase completes.
__device__ __forceinline__ void fs_mbar_expect_tx(fs_mbar* m, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(fs_smem_addr(m)), "r"(bytes) : "memory");
}
// After a thread's copies: the GPU counts their bytes (nothing to do).
__device__ __forceinline__ void fs_mbar_tma_issued(fs_mbar*) {}
__device__ __forceinline__ unsigned char* fs_align1024(unsigned char* p) { return p + ((1024u - (fs_smem_addr(p) & 1023u)) & 1023u); }
// Registers handed between warpgroups (the whole warpgroup executes it).
template <unsigned N>
__device__ __forceinline__ void fs_setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N)); }
template <unsigned N>
__device__ __forceinline__ void fs_setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N)); }
// Barrier `id` (1 .. 15; 0 is __syncthreads) for `count` threads.
__device__ __forceinline__ void fs_bar_sync(unsigned id, unsigned count) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory"); }
// Counts the calling threads towards barrier `id` without waiting for it.
__device__ __forceinline__ void fs_bar_arrive(unsigned id, unsigned count) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory"); }
__device__ __forceinline__ void fs_syncwarp() { __syncwarp(); }
// p[0 .. 3] += s[0 .. 3] in global memory, atomically (both 16-byte aligned, s in shared memory).
__device__ __forceinline__ void fs_atomic_add4(float* p, const float* s) {
    const float4 v = *reinterpret_cast<const float4*>(s);
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w) : "memory");
}
// dst[i] += src[i] for `bytes` / 4 floats, global += shared, by the bulk
// copy engine (both 16-byte aligned, bytes a multiple of 16): one
// instruction in place of bytes / 16 vector reductions. The source may be
// written again once fs_bulk_wait_read has returned after the commit.
__device__ __forceinline__ void fs_bulk_add_f32(float* dst, const float* src, unsigned bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(fs_smem_addr(src)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void fs_bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void fs_bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void fs_bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// p[0], p[1] = a, b (p 8-byte aligned).
__device__ __forceinline__ void fs_st_f32x2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
// *p += 1 in global memory, atomically; the value before.
__device__ __forceinline__ unsigned fs_atomic_inc(unsigned* p) { return atomicAdd(p, 1u); }
__device__ __forceinline__ void fs_atomic_clear(unsigned* p) { atomicExch(p, 0u); }
__device__ __forceinline__ void fs_threadfence() { __threadfence(); }
#else
// `sw`: the swizzle's bytes per row (0: none).
struct fs_desc {
    const unsigned char* p;
    unsigned lbo, sbo, sw;
};
inline fs_desc fs_make_desc(const void* p, unsigned lbo, unsigned sbo, unsigned sw) {
    return {static_cast<const unsigned char*>(p), lbo, sbo, sw};
}
inline fs_desc fs_desc_at(fs_desc d, unsigned bytes) {
    d.p += bytes;
    return d;
}
inline fs_desc fs_desc_opaque(fs_desc d) { return d; }
inline void fs_wgmma_fence() {}
inline void fs_wgmma_commit() {}
// A wait is where a warp's lanes have all read their operands (each lane's
// emulated wgmma reads them itself), so that one lane may then hand the
// operands' buffer on.
inline void fs_wgmma_wait_all() { fs_emu_wgmma_wait(); }
inline void fs_wgmma_wait_all_but_1() { fs_emu_wgmma_wait(); }
template <int N>
inline void fs_wgmma_hold(float (&)[N][4]) {}
inline void fs_fence_async_smem() {}
inline void fs_copy16_async(unsigned short* dst, const unsigned short* src) { memcpy(dst, src, 16); }
inline void fs_copy_async_commit() {}
inline void fs_copy_async_wait_all() {}
typedef fs_emu_mbar fs_mbar;
inline void fs_mbar_init(fs_mbar* m, unsigned count) { fs_emu_mbar_init(m, count); }
inline void fs_mbar_arrive(fs_mbar* m) { fs_emu_mbar_arrive(m); }
inline void fs_mbar_wait(fs_mbar* m, unsigned parity) { fs_emu_mbar_wait(m, parity); }
// A tensor map on the host: the view it copies from, and the box.
struct fs_tmap {
    const unsigned short* base;
    fs_i64 dim[4], stride[3];
    int box_feats, box_rows, swizzle;
};
#define FS_TMAP_PARAM(name)
#define FS_TMAP_HOST(name, base, d0, d1, d2, d3, s1, s2, s3, feats, rows, sw) \
    const fs_tmap name = {base, {d0, d1, d2, d3}, {s1, s2, s3}, feats, rows, sw}
// The byte a swizzled tile keeps the byte at `p` in: the 16-byte chunk bits
// (4 and up) XOR the row bits (7 and up), over log2(sw / 16) bits.
inline unsigned char* fs_swizzle(unsigned char* p, int sw) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uintptr_t mask = sw == 128 ? 7 : sw == 64 ? 3 : 1;
    return reinterpret_cast<unsigned char*>(a ^ (((a >> 7) & mask) << 4));
}
inline void fs_tma_load(void* dst, const fs_tmap& m, int c0, int c1, int c2, int c3, fs_mbar*) {
    unsigned char* const out = static_cast<unsigned char*>(dst);
    if (reinterpret_cast<uintptr_t>(out) % 1024 != 0) {
        fprintf(stderr, "tma: a swizzled box does not start 1024-byte aligned\n");
        exit(5);
    }
    for (int r = 0; r < m.box_rows; ++r)
        for (int e = 0; e < m.box_feats; ++e) {
            const fs_i64 x[4] = {(fs_i64)c0 + e, c1, (fs_i64)c2 + r, c3};
            unsigned short v = 0;
            bool in = true;
            for (int i = 0; i < 4; ++i) in = in && x[i] >= 0 && x[i] < m.dim[i];
            if (in) v = m.base[x[0] + x[1] * m.stride[0] + x[2] * m.stride[1] + x[3] * m.stride[2]];
            memcpy(fs_swizzle(out + r * m.box_feats * 2 + e * 2, m.swizzle), &v, 2);
        }
}
// Host copies land at once: the expected bytes are in when the issuing
// thread arrives after them.
inline void fs_mbar_expect_tx(fs_mbar*, unsigned) {}
inline void fs_mbar_tma_issued(fs_mbar* m) { fs_emu_mbar_arrive(m); }
inline unsigned char* fs_align1024(unsigned char* p) { return p + ((1024 - reinterpret_cast<uintptr_t>(p) % 1024) % 1024); }
template <unsigned N>
inline void fs_setmaxnreg_inc() {}
template <unsigned N>
inline void fs_setmaxnreg_dec() {}
inline void fs_bar_sync(unsigned id, unsigned count) { fs_emu_bar_sync(id, count); }
inline void fs_bar_arrive(unsigned id, unsigned count) { fs_emu_bar_arrive(id, count); }
inline void fs_syncwarp() { fs_emu_syncwarp(); }
// A plain sum, as fs_atomic_add2's host version says.
inline void fs_atomic_add4(float* p, const float* s) {
    for (int i = 0; i < 4; ++i) p[i] += s[i];
}
inline void fs_bulk_add_f32(float* dst, const float* src, unsigned bytes) {
    if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0 || bytes % 16 != 0) {
        fprintf(stderr, "bulk reduction: an address or the size is not a multiple of 16 bytes\n");
        exit(5);
    }
    for (unsigned i = 0; i < bytes / 4; ++i) dst[i] += src[i];
}
inline void fs_bulk_commit() {}
inline void fs_bulk_wait_read() {}
inline void fs_bulk_wait() {}
inline void fs_st_f32x2(float* p, float a, float b) {
    p[0] = a;
    p[1] = b;
}
inline unsigned fs_atomic_inc(unsigned* p) { return std::atomic_ref<unsigned>(*p).fetch_add(1); }
inline void fs_atomic_clear(unsigned* p) { std::atomic_ref<unsigned>(*p).store(0); }
inline void fs_threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
#endif

#include "wgmma_ops.cuh"

namespace fs_attn {

// The swizzle of a TMA-copied tile whose rows hold `feats` 16-bit features:
// the widest of 128, 64 and 32 bytes whose box (SW / 2 features) divides them.
__host__ __device__ constexpr int swizzle_for(int feats) { return feats % 64 == 0 ? 128 : feats % 32 == 0 ? 64 : 32; }
// The Hopper forward's padded head dim (templates::swizzle_pad on the
// emitter's side): to a multiple of 16, or of 64 where 16 would leave the
// 32-byte swizzle and 64 costs at most a seventh more work (112 -> 128, 176
// -> 192, 240 -> 256). At D = 112 the 32-byte swizzle's tiles ran the
// forward at 0.68-0.81x SDPA's speed on an H100, 128's at 0.78-1.03x. (The
// narrow backward padded so ran slower at 112: 3.43-3.51 -> 3.70-3.79 ms at
// T = 8192, its 128-feature configuration's two dQ writers.)
__host__ __device__ constexpr int swizzle_pad(int d) {
    return round_up(d, 16) % 32 != 0 && round_up(d, 64) * 7 <= d * 8 ? round_up(d, 64) : round_up(d, 16);
}

// A [ROWS][FEATS] tile as bulk tensor copies land it: FEATS / ATOM boxes of
// ATOM features, box a at byte a * BOX, row r at byte SW_ * r of its box, the
// 16-byte chunk c of a row stored at chunk c ^ (r % (SW_ / 16)) (the swizzle
// is a function of the address bits, so the tile starts 1024-byte aligned).
// The swizzle is the widest whose box divides FEATS, unless a kernel that
// reads parts of the tile asks for a narrower one.
template <int ROWS, int FEATS, int SW_ = swizzle_for(FEATS)>
struct SwizzledTile {
    static constexpr int SW = SW_, ATOM = SW / 2;
    static_assert(FEATS % ATOM == 0, "whole boxes");
    static constexpr unsigned BOX = ROWS * SW, BYTES = ROWS * FEATS * 2;
    static_assert(FEATS % 16 == 0 && ROWS % 8 == 0, "whole core matrices");
    // Read K-major (the features are K, the rows M or N): 8-row groups 8 * SW
    // bytes apart; features 16kk .. 16kk + 15 at box 16kk / ATOM, 32 bytes
    // further per 16 features within it.
    static __device__ __forceinline__ fs_desc kmajor(const void* tile) { return fs_make_desc(tile, 16, 8 * SW, SW); }
    static __host__ __device__ constexpr unsigned k_step(int kk) { return (kk * 16) / ATOM * BOX + (kk * 16) % ATOM * 2; }
    static __host__ __device__ constexpr unsigned kmajor_n(int n0) { return n0 * SW; }
    // Read MN-major (the features are N, the rows K): ATOM features
    // contiguous in a row, the next ATOM a box further (LBO), groups of 8
    // rows 8 * SW bytes apart (SBO); rows 16kk .. at 16kk * SW bytes.
    static __device__ __forceinline__ fs_desc mnmajor(const void* tile) { return fs_make_desc(tile, BOX, 8 * SW, SW); }
    static __host__ __device__ constexpr unsigned mn_k_step(int kk) { return kk * 16 * SW; }
    static __host__ __device__ constexpr unsigned mnmajor_n(int n0) { return n0 / ATOM * BOX; }
};

// A [rows][FEATS] tile written by threads in wgmma's canonical layout without
// swizzling: core matrices of 8 rows by 8 features (128 contiguous bytes),
// row group by row group, so element (r, c) sits at element
// ((r / 8) * (FEATS / 8) + c / 8) * 64 + (r % 8) * 8 + c % 8. A copy's
// 16-byte chunk number t is then its byte offset 16 t (see `chunk`), so every
// store is free of bank conflicts.
template <int FEATS>
struct CoreTile {
    static constexpr unsigned CORE = 128, ROW8 = FEATS / 8 * CORE;  // bytes between core matrices along c, along r
    static_assert(FEATS % 8 == 0, "whole core matrices");
    static __device__ __forceinline__ int at(int r, int c) { return ((r >> 3) * (FEATS / 8) + (c >> 3)) * 64 + (r & 7) * 8 + (c & 7); }
    // The row and first feature of 16-byte chunk t.
    static __device__ __forceinline__ void chunk(int t, int& r, int& c) {
        r = (t / (8 * (FEATS / 8))) * 8 + (t & 7);
        c = ((t >> 3) % (FEATS / 8)) * 8;
    }
    // K-major (the features are K): 16 features a step, two core matrices.
    static __device__ __forceinline__ fs_desc kmajor(const void* tile) { return fs_make_desc(tile, CORE, ROW8, 0); }
    static __host__ __device__ constexpr unsigned k_step(int kk) { return kk * 2 * CORE; }
    static __host__ __device__ constexpr unsigned kmajor_n(int n0) { return n0 / 8 * ROW8; }
    // MN-major (the features are N, the rows K): 16 rows a step.
    static __device__ __forceinline__ fs_desc mnmajor(const void* tile) { return fs_make_desc(tile, ROW8, CORE, 0); }
    static __host__ __device__ constexpr unsigned mn_k_step(int kk) { return kk * 2 * ROW8; }
    static __host__ __device__ constexpr unsigned mnmajor_n(int n0) { return n0 / 8 * CORE; }
};

// Copies rows row0 .. row0 + ROWS - 1 of head h of `x` into a CoreTile<PADDED>
// with cp.async, 16 bytes per thread and step, by the THREADS threads whose
// index among them is `tid` (rows at or past `len` and features past WIDTH
// zero); the caller commits and waits.
template <int ROWS, int WIDTH, int PADDED, int THREADS>
__device__ __forceinline__ void load_core_rows(unsigned short* tile, const In& x, fs_i64 b, fs_i64 row0, fs_i64 h, fs_i64 len,
                                               int tid) {
    for (int t = tid; t < ROWS * (PADDED / 8); t += THREADS) {
        int r, c;
        CoreTile<PADDED>::chunk(t, r, c);
        const fs_i64 i = row0 + r;
        if (i < len && c < WIDTH) fs_copy16_async(&tile[t * 8], x.row(b, i, h) + c);
        else fs_zero16(&tile[t * 8]);
    }
}

// A consumer warpgroup's 64 accumulator rows (W features padded to WP, in
// wgmma's fragments: acc[n][e] = row wg_row + 8 * (e / 2), feature 8n +
// frag_col + e % 2) on their way to global memory as 16-bit values, through
// `stage`, 64 x WP elements of shared memory only this warpgroup uses now.
// Written from the fragments straight to global memory, a warp's store
// covered 8 rows x 4 bytes a lane: a quarter of each 32-byte sector it
// touched (ncu, H200, the forward at D = 128, T = 1024: 8.1 of 32 bytes a
// sector, 262 MB through L2 for 67 MB of output). Staged, every store is a
// whole 16-byte chunk of a row and a warp's cover whole rows.
//
// Chunk c of staged row r sits at chunk (c + r) % CH of its row (CH = WP /
// 8, even): the fragments' writes (8 rows, one chunk) and the rows' reads
// fall in distinct banks. Row r's values are multiplied by scale[r's index].
template <class E, int WP>
__device__ __forceinline__ void stage_rows(const float (&acc)[WP / 8][4], const float (&scale)[2], unsigned short* stage,
                                           int wg_row, int frag_col) {
    constexpr int CH = WP / 8;
    static_assert(WP % 16 == 0, "an even number of 16-byte chunks a row");
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int lr = wg_row + 8 * r;
#pragma unroll
        for (int n = 0; n < CH; ++n) {
            const int p = (n + lr) % CH;
            fs_st32(&stage[lr * WP + p * 8 + frag_col], E::pack(acc[n][2 * r] * scale[r], acc[n][2 * r + 1] * scale[r]));
        }
    }
}

// The first `rows` (at most 64) staged rows of stage_rows into global memory,
// features below `width` (at most WP), row lr at row_at(lr), by the
// warpgroup's 128 threads (wg_tid), after a barrier that follows every
// thread's stage_rows. Consecutive threads take consecutive staged chunks:
// whole rows, read without bank conflicts, written as 16-byte stores where
// the row allows.
template <int WP, class RowAt>
__device__ __forceinline__ void copy_staged_rows(const unsigned short* stage, int wg_tid, fs_i64 rows, int width, RowAt row_at) {
    constexpr int CH = WP / 8;
    for (int t = wg_tid; t < 64 * CH; t += 128) {
        const int lr = t / CH, p = t % CH;
        int c = p - lr % CH;
        if (c < 0) c += CH;
        if (lr >= rows || c * 8 >= width) continue;
        const unsigned short* const src = &stage[lr * WP + p * 8];
        unsigned short* const dst = row_at(lr) + c * 8;
        if (c * 8 + 8 <= width && fs_align_bits(dst) % 16 == 0) {
            fs_copy16(dst, src);
        } else {
            for (int e = 0; e < 8 && c * 8 + e < width; ++e) dst[e] = src[e];
        }
    }
}

// Step 7 of the Hopper forwards for one consumer warpgroup: its 64 rows of O
// (normalised, rounded to E) through `stage` (stage_rows) and their
// log-sum-exp. `bar` is a named barrier of the warpgroup's 128 threads,
// `row0` its first query row, `wg_row` this thread's first row within the
// warpgroup (warp * 16 + fragment row).
template <class E, int DV, int DVP>
__device__ __forceinline__ void store_output_staged(const ForwardArgs& a, const float (&o_acc)[DVP / 8][4], const float (&row_max)[2],
                                                    const float (&row_sum)[2], fs_i64 b, fs_i64 h, fs_i64 row0, int wg_row,
                                                    int frag_col, int wg_tid, unsigned short* stage, unsigned bar) {
    float inv_sum[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += fs_shfl_xor(sum, 1);
        sum += fs_shfl_xor(sum, 2);
        inv_sum[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
        const fs_i64 i = row0 + wg_row + 8 * r;
        if (frag_col == 0 && i < a.q_len) a.lse.at(b, h, i) = sum > 0.0f ? row_max[r] * LN2 + logf(sum) : FS_NEG_INF;
    }
    // Every product that read the staging area (the block forward's queries)
    // has landed in every warp before any warp writes over it.
    fs_bar_sync(bar, 128);
    stage_rows<E, DVP>(o_acc, inv_sum, stage, wg_row, frag_col);
    fs_bar_sync(bar, 128);
    copy_staged_rows<DVP>(stage, wg_tid, a.q_len - row0, DV, [&](int lr) { return a.o.row(b, row0 + lr, h); });
}

// The last step of the unsplit Hopper backwards for one consumer warpgroup:
// dK = scale * dk_acc and dV = dv_acc (64 key rows from j0 of key/value head
// kv_h; features fk0 .. fk0 + FK of dK and fv0 .. fv0 + FV of dV, those at or
// past D and DV padding) through dk_stage and dv_stage (stage_rows) as whole
// 16-byte chunks of rows. The caller has made sure nothing reads the staging
// areas any more; `bar` is a named barrier of the warpgroup's 128 threads.
template <class E, int D, int DV, int FK, int FV>
__device__ __forceinline__ void store_dk_dv_staged(const BackwardArgs& a, const float (&dk_acc)[FK / 8][4], const float (&dv_acc)[FV / 8][4],
                                                   unsigned short* dk_stage, unsigned short* dv_stage, fs_i64 b, fs_i64 kv_h, fs_i64 j0,
                                                   int fk0, int fv0, int wg_row, int frag_col, int wg_tid, unsigned bar) {
    const float k_scale[2] = {a.scale, a.scale}, v_scale[2] = {1.0f, 1.0f};
    stage_rows<E, FK>(dk_acc, k_scale, dk_stage, wg_row, frag_col);
    stage_rows<E, FV>(dv_acc, v_scale, dv_stage, wg_row, frag_col);
    fs_bar_sync(bar, 128);
    // A warpgroup's features can hold fewer real ones than FK (the wide
    // kernel at D = 200: 112 padded features a half, 88 real in the second).
    copy_staged_rows<FK>(dk_stage, wg_tid, a.kv_len - j0, D - fk0 < FK ? D - fk0 : FK,
                         [&](int lr) { return a.dk.row(b, j0 + lr, kv_h) + fk0; });
    copy_staged_rows<FV>(dv_stage, wg_tid, a.kv_len - j0, DV - fv0 < FV ? DV - fv0 : FV,
                         [&](int lr) { return a.dv.row(b, j0 + lr, kv_h) + fv0; });
}

// The widest power of two from 8 to 256 that is at most n.
__host__ __device__ constexpr int wgmma_width(int n) { return n >= 256 ? 256 : n >= 128 ? 128 : n >= 64 ? 64 : n >= 32 ? 32 : n >= 16 ? 16 : 8; }

// d[N / 8][4] (+)= A (64 x 16) B (16 x N) for the warpgroup, N any multiple of
// 8 up to 256: one wgmma where N is a power of two, else issued as wgmma of
// power-of-two widths, B's descriptor moved BL::n(n0) bytes for the columns
// from n0 (BL: the tile layout's kmajor_n or mnmajor_n, through B_MN). A
// through a descriptor (ss) or from registers (rs).
template <class E, int A_MN, int B_MN, int NN>
__device__ __forceinline__ void wgmma_ss_op(float (&d)[NN][4], fs_desc a, fs_desc b, int acc) {
    if constexpr (E::IS_F16) fs_wgmma_ss_f16<A_MN, B_MN>(d, a, b, acc);
    else fs_wgmma_ss_bf16<A_MN, B_MN>(d, a, b, acc);
}
template <class E, int B_MN, int NN>
__device__ __forceinline__ void wgmma_rs_op(float (&d)[NN][4], const unsigned (&a)[4], fs_desc b, int acc) {
    if constexpr (E::IS_F16) fs_wgmma_rs_f16<B_MN>(d, a, b, acc);
    else fs_wgmma_rs_bf16<B_MN>(d, a, b, acc);
}
template <class E, class BL, bool B_MN, int N, int A_MN, int N0 = 0, int NN>
__device__ __forceinline__ void wgmma_ss(float (&d)[NN][4], fs_desc a, fs_desc b, int acc) {
    constexpr int W = wgmma_width(N);
    static_assert(N % 8 == 0 && N0 / 8 + N / 8 <= NN, "columns within the accumulator");
    if constexpr (N0 == 0 && W == N && N / 8 == NN) {
        wgmma_ss_op<E, A_MN, B_MN>(d, a, b, acc);
    } else {
        wgmma_ss_op<E, A_MN, B_MN>(*reinterpret_cast<float(*)[W / 8][4]>(&d[N0 / 8][0]), a,
                                   fs_desc_at(b, B_MN ? BL::mnmajor_n(N0) : BL::kmajor_n(N0)), acc);
        if constexpr (N > W) wgmma_ss<E, BL, B_MN, N - W, A_MN, N0 + W>(d, a, b, acc);
    }
}
template <class E, class BL, bool B_MN, int N, int N0 = 0, int NN>
__device__ __forceinline__ void wgmma_rs(float (&d)[NN][4], const unsigned (&a)[4], fs_desc b, int acc) {
    constexpr int W = wgmma_width(N);
    static_assert(N % 8 == 0 && N0 / 8 + N / 8 <= NN, "columns within the accumulator");
    if constexpr (N0 == 0 && W == N && N / 8 == NN) {
        wgmma_rs_op<E, B_MN>(d, a, b, acc);
    } else {
        wgmma_rs_op<E, B_MN>(*reinterpret_cast<float(*)[W / 8][4]>(&d[N0 / 8][0]), a,
                             fs_desc_at(b, B_MN ? BL::mnmajor_n(N0) : BL::kmajor_n(N0)), acc);
        if constexpr (N > W) wgmma_rs<E, BL, B_MN, N - W, N0 + W>(d, a, b, acc);
    }
}

// The register count a block's threads can be given by setmaxnreg once FIXED
// of its BLOCK threads (launched with __launch_bounds__(BLOCK, 1): the 64K
// register file over the block, in ptxas's steps of 8) keep FIXED_REGS.
__host__ __device__ constexpr unsigned regs_left(unsigned block, unsigned fixed, unsigned fixed_regs) {
    return ((65536 / block / 8 * 8) * block - fixed * fixed_regs) / (block - fixed) / 8 * 8;
}

}  // namespace fs_attn

#endif

// Runs fusec's generated kernels on the host with real thread blocks: every
// thread of a block is an OS thread, `__syncthreads()` is a std::barrier over
// the block, and each warp of 32 threads has its own barrier for the warp-level
// operations that mma_emu.h emulates. Blocks run one after another, so a
// `__shared__` (function-local static) array is one block's shared memory.
#pragma once
#include "host_cuda.h"
#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

static thread_local fs_dim3 blockIdx, threadIdx;
static fs_dim3 blockDim, gridDim;

static std::barrier<>* fs_block_barrier;
// One barrier per warp of the running block.
static std::barrier<>* fs_warp_barrier[32];
// Warp-level operations this thread has issued (mma_emu.h alternates its
// exchange buffers with it).
static thread_local unsigned fs_warp_ops;

static inline void __syncthreads() { fs_block_barrier->arrive_and_wait(); }
// __syncwarp() for the calling thread's warp.
static inline void fs_emu_syncwarp() { fs_warp_barrier[threadIdx.x >> 5]->arrive_and_wait(); }

// Named barriers (bar.sync id, count): the first thread to reach barrier
// `id` in a block creates it for `count` threads; a later use with another
// count ends the run, as it would be undefined on the GPU.
static std::mutex fs_named_mutex;
static std::unique_ptr<std::barrier<>> fs_named_barrier[16];
static unsigned fs_named_count[16];
static inline std::barrier<>* fs_emu_named(unsigned id, unsigned count) {
    std::lock_guard<std::mutex> lock(fs_named_mutex);
    if (!fs_named_barrier[id]) {
        fs_named_barrier[id] = std::make_unique<std::barrier<>>(count);
        fs_named_count[id] = count;
    } else if (fs_named_count[id] != count) {
        fprintf(stderr, "named barrier %u used for %u threads and for %u\n", id, fs_named_count[id], count);
        std::_Exit(3);
    }
    return fs_named_barrier[id].get();
}
static inline void fs_emu_bar_sync(unsigned id, unsigned count) { fs_emu_named(id, count)->arrive_and_wait(); }
// bar.arrive: counts towards the barrier's current phase without waiting.
static inline void fs_emu_bar_arrive(unsigned id, unsigned count) {
    auto token = fs_emu_named(id, count)->arrive();
    (void)token;
}

// An mbarrier in (host) shared memory: the arrivals still missing from the
// current phase (low 16 bits) and the count (high 16 bits), and the number of
// completed phases, whose parity waits compare against.
struct fs_emu_mbar {
    unsigned state, phase;
};
static inline void fs_emu_mbar_init(fs_emu_mbar* m, unsigned count) {
    m->state = count | count << 16;
    m->phase = 0;
}
static inline void fs_emu_mbar_arrive(fs_emu_mbar* m) {
    std::atomic_ref<unsigned> state(m->state);
    const unsigned old = state.fetch_sub(1, std::memory_order_acq_rel);
    if ((old & 0xFFFFu) == 1) {
        state.store((old & 0xFFFF0000u) | (old >> 16), std::memory_order_relaxed);
        std::atomic_ref<unsigned> phase(m->phase);
        phase.fetch_add(1, std::memory_order_release);
        phase.notify_all();
    }
}
// Returns once the phase of this parity has completed.
static inline void fs_emu_mbar_wait(fs_emu_mbar* m, unsigned parity) {
    std::atomic_ref<unsigned> phase(m->phase);
    for (unsigned p = phase.load(std::memory_order_acquire); (p & 1u) == parity; p = phase.load(std::memory_order_acquire))
        phase.wait(p, std::memory_order_acquire);
}

// A block that has not finished after this long waits on a barrier or an
// mbarrier that never completes: the run ends with a message instead of
// hanging the test.
#ifndef FS_BLOCK_TIMEOUT_S
#define FS_BLOCK_TIMEOUT_S 300
#endif

// Runs `f` as the kernel body for every block of `grid` (x fastest), with
// `block` threads per block (a multiple of 32, at most 1024).
template <class F>
static void fs_launch(fs_dim3 grid, unsigned block, F f) {
    if (block % 32 != 0 || block > 1024) {
        fprintf(stderr, "block of %u threads: not a whole number of warps\n", block);
        exit(2);
    }
    gridDim = grid;
    blockDim = {block, 1, 1};
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::barrier<> bar(block);
                fs_block_barrier = &bar;
                std::vector<std::unique_ptr<std::barrier<>>> warps;
                for (unsigned w = 0; w < block / 32; ++w) {
                    warps.push_back(std::make_unique<std::barrier<>>(32));
                    fs_warp_barrier[w] = warps.back().get();
                }
                std::mutex done_mutex;
                std::condition_variable done_cv;
                bool done = false;
                std::thread watchdog([&, x, y, z] {
                    std::unique_lock<std::mutex> lock(done_mutex);
                    if (!done_cv.wait_for(lock, std::chrono::seconds(FS_BLOCK_TIMEOUT_S), [&] { return done; })) {
                        fprintf(stderr, "block (%u, %u, %u) did not finish in %d s: a barrier or mbarrier it waits on never completes\n",
                                x, y, z, FS_BLOCK_TIMEOUT_S);
                        std::_Exit(3);
                    }
                });
                std::vector<std::thread> threads;
                for (unsigned t = 0; t < block; ++t)
                    threads.emplace_back([&, x, y, z, t] {
                        blockIdx = {x, y, z};
                        threadIdx = {t, 0, 0};
                        fs_warp_ops = 0;
                        f();
                    });
                for (auto& t : threads) t.join();
                {
                    std::lock_guard<std::mutex> lock(done_mutex);
                    done = true;
                }
                done_cv.notify_all();
                watchdog.join();
                for (auto& named : fs_named_barrier) named.reset();
            }
}

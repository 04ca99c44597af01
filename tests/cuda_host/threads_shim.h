// A host stand-in for a real thread block, so the kernels' shared memory and
// barriers are exercised too: each block's threads are OS threads meeting at
// a std::barrier for __syncthreads(); blocks run one after another (so a
// __shared__ static is one block's shared memory). Any block size works
// (tests/flash_host/block_shim.h, for warp-level code, wants whole warps).
#pragma once
#include "host_cuda.h"
#include <barrier>
#include <thread>
#include <vector>

static thread_local fs_dim3 blockIdx, threadIdx;
static fs_dim3 blockDim, gridDim;
static std::barrier<>* fs_bar;
static inline void __syncthreads() { fs_bar->arrive_and_wait(); }

template <class F>
static void fs_launch(unsigned grid, unsigned block, F f) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned b = 0; b < grid; ++b) {
        std::barrier<> bar(block);
        fs_bar = &bar;
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; ++t)
            threads.emplace_back([&, b, t] {
                blockIdx = {b, 0, 0};
                threadIdx = {t, 0, 0};
                f();
            });
        for (auto& t : threads) t.join();
    }
}
#define FS_LAUNCH(grid, block, call) fs_launch(grid, block, [&] { call; })

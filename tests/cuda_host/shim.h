// Lets a host C++ compiler build fusec's generated kernels: one thread, one
// block, so each grid-stride loop walks every element in order.
#pragma once
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>

#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __restrict__ __restrict

struct fs_dim3 {
    unsigned x, y, z;
};
static const fs_dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
static const fs_dim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};

static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __uint_as_float(unsigned int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float __int_as_float(int u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    memcpy(&u, &f, 4);
    return u;
}
static inline void __syncthreads() {}
static inline void __threadfence() {}
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
    const unsigned old = *p;
    *p += v;
    return old;
}

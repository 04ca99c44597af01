// What every host build of fusec's generated kernels needs, whichever shim
// decides how threads and blocks run: CUDA's keywords as plain C++, and the
// device intrinsics the prelude and templates call.
#pragma once
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)

struct fs_dim3 {
    unsigned x, y, z;
};

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
// Correct with one thread and with OS threads alike.
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }

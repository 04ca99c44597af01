// fusec 2-D convolution and its two gradients, NHWC, stride and zero
// padding: one thread an output element, each summing over its taps in a
// fixed order in f32, so every result is deterministic and needs no
// atomics. Direct loops, not implicit GEMM: correct first, fast later.
//
// Shapes: x [B, H, W, Cin], w [kH, kW, Cin, Cout], y [B, oH, oW, Cout] with
// y[b, oy, ox, co] = sum over ky, kx, ci of
// x[b, oy * stride + ky - pad, ox * stride + kx - pad, ci] * w[ky, kx, ci, co].
// Inputs are read through 4-D views (any strides); the output is stored
// row-major. X, W, Y (and their gradients) are element types (fs_el::Bf16,
// F16 or F32).
//
// Needs the prelude (fusec_prelude.cuh) before it.
#ifndef FS_CONV
#define FS_CONV

#include "elements.cuh"

namespace fs_conv {

// A 4-D view: (a, b, c, d) at p[a * s0 + b * s1 + c * s2 + d * s3].
template <class E>
struct View {
    const typename E::Storage* p;
    fs_i64 s0, s1, s2, s3;
    __device__ __forceinline__ float at(fs_i64 a, fs_i64 b, fs_i64 c, fs_i64 d) const {
        return E::load(&p[a * s0 + b * s1 + c * s2 + d * s3]);
    }
};

struct Sizes {
    fs_i64 batch, in_h, in_w, c_in;  // x
    fs_i64 k_h, k_w;                 // w's window
    fs_i64 out_h, out_w, c_out;      // y
    fs_i64 stride, pad;
};

// y = conv(x, w): thread i computes y's element i.
template <class X, class W, class Y>
__device__ __forceinline__ void forward(const View<X>& x, const View<W>& w, typename Y::Storage* y, const Sizes& s) {
    const fs_i64 n = s.batch * s.out_h * s.out_w * s.c_out;
    for (fs_i64 i = (fs_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (fs_i64)gridDim.x * blockDim.x) {
        const fs_i64 co = i % s.c_out, ox = (i / s.c_out) % s.out_w, oy = (i / (s.c_out * s.out_w)) % s.out_h,
                     b = i / (s.c_out * s.out_w * s.out_h);
        float acc = 0.0f;
        for (fs_i64 ky = 0; ky < s.k_h; ++ky) {
            const fs_i64 iy = oy * s.stride + ky - s.pad;
            if (iy < 0 || iy >= s.in_h) continue;  // zero padding
            for (fs_i64 kx = 0; kx < s.k_w; ++kx) {
                const fs_i64 ix = ox * s.stride + kx - s.pad;
                if (ix < 0 || ix >= s.in_w) continue;
                for (fs_i64 ci = 0; ci < s.c_in; ++ci) acc += x.at(b, iy, ix, ci) * w.at(ky, kx, ci, co);
            }
        }
        y[i] = Y::store(acc);
    }
}

// dx from dy and w. Output (oy, ox) reads input row oy * stride + ky - pad,
// so input row iy is read by tap ky from output row (iy + pad - ky) / stride
// when that divides exactly.
template <class DY, class W, class DX>
__device__ __forceinline__ void grad_input(const View<DY>& dy, const View<W>& w, typename DX::Storage* dx,
                                           const Sizes& s) {
    const fs_i64 n = s.batch * s.in_h * s.in_w * s.c_in;
    for (fs_i64 i = (fs_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (fs_i64)gridDim.x * blockDim.x) {
        const fs_i64 ci = i % s.c_in, ix = (i / s.c_in) % s.in_w, iy = (i / (s.c_in * s.in_w)) % s.in_h,
                     b = i / (s.c_in * s.in_w * s.in_h);
        float acc = 0.0f;
        for (fs_i64 ky = 0; ky < s.k_h; ++ky) {
            const fs_i64 ty = iy + s.pad - ky, oy = ty / s.stride;
            if (ty < 0 || ty % s.stride != 0 || oy >= s.out_h) continue;
            for (fs_i64 kx = 0; kx < s.k_w; ++kx) {
                const fs_i64 tx = ix + s.pad - kx, ox = tx / s.stride;
                if (tx < 0 || tx % s.stride != 0 || ox >= s.out_w) continue;
                for (fs_i64 co = 0; co < s.c_out; ++co) acc += dy.at(b, oy, ox, co) * w.at(ky, kx, ci, co);
            }
        }
        dx[i] = DX::store(acc);
    }
}

// dw from x and dy: each weight's sum over the batch and every output
// position its tap reaches.
template <class X, class DY, class DW>
__device__ __forceinline__ void grad_weight(const View<X>& x, const View<DY>& dy, typename DW::Storage* dw,
                                            const Sizes& s) {
    const fs_i64 n = s.k_h * s.k_w * s.c_in * s.c_out;
    for (fs_i64 i = (fs_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (fs_i64)gridDim.x * blockDim.x) {
        const fs_i64 co = i % s.c_out, ci = (i / s.c_out) % s.c_in, kx = (i / (s.c_out * s.c_in)) % s.k_w,
                     ky = i / (s.c_out * s.c_in * s.k_w);
        float acc = 0.0f;
        for (fs_i64 b = 0; b < s.batch; ++b) {
            for (fs_i64 oy = 0; oy < s.out_h; ++oy) {
                const fs_i64 iy = oy * s.stride + ky - s.pad;
                if (iy < 0 || iy >= s.in_h) continue;  // zero padding
                for (fs_i64 ox = 0; ox < s.out_w; ++ox) {
                    const fs_i64 ix = ox * s.stride + kx - s.pad;
                    if (ix < 0 || ix >= s.in_w) continue;
                    acc += x.at(b, iy, ix, ci) * dy.at(b, oy, ox, co);
                }
            }
        }
        dw[i] = DW::store(acc);
    }
}

}  // namespace fs_conv

#endif

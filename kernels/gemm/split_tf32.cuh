// The operands of an f32 product split for three TF32 products (3xTF32, as
// CUTLASS's OpMultiplyAddFastF32): x = hi + lo with hi = x rounded to TF32
// (10 mantissa bits) and lo = x - hi (exact in f32, |lo| <= 2^-11 |x|).
//
// One TF32 GEMM over K' = 3K of A' = [hi | lo | hi] and B' = [hi ; hi ; lo]
// (the K axis tripled) sums hi*hi + lo*hi + hi*lo and drops lo*lo (2^-22
// of a product): each product within about 2^-21 of f32's, where one TF32
// product keeps 2^-11. hi is exactly a TF32 value, so the GEMM takes it as
// is whether its conversion of f32 rounds or truncates; lo loses at most
// 2^-10 of itself there.
//
// One launch copies one operand: `batch` matrices of `rows` x `cols`
// (rows `ld` elements apart, matrices `stride` apart) into `out`, packed,
// three times along K. K_INNER: K runs along the rows (A stored [m, k], B
// stored [n, k]), so each row becomes [c0 | c1 | c2]; otherwise K runs down
// the columns and each matrix becomes [c0 ; c1 ; c2]. Copy LO (1 for A, 2
// for B) holds lo, the other two hi. VEC = 4 moves float4s (cols, ld and
// stride multiples of 4, buffers 16-byte aligned).
//
// Blocks take whole rows (grid-stride over batch x rows), threads the
// columns: one division a row, none an element.
//
// Compiles alone with nvcc or NVRTC defaults (and as host C++ through the
// test shim): no library.
#ifndef FS_GEMM_SPLIT_TF32
#define FS_GEMM_SPLIT_TF32

// x rounded to the nearest TF32 value (ties away from zero, as
// cvt.rna.tf32.f32); a value that would round past the largest finite one
// is truncated instead, and inf and NaN are kept.
__device__ __forceinline__ float fs_split_hi(float x) {
    const unsigned bits = __float_as_uint(x);
    if ((bits & 0x7f800000u) == 0x7f800000u) return x;
    const float up = __uint_as_float((bits + 0x1000u) & 0xffffe000u);
    return (__float_as_uint(up) & 0x7f800000u) == 0x7f800000u ? __uint_as_float(bits & 0xffffe000u) : up;
}

// The three copies of one value: (hi, lo, hi) for A, (hi, hi, lo) for B.
// lo of inf or NaN is 0, so a non-finite input stays non-finite.
template <int LO>
__device__ __forceinline__ void fs_split_parts(float x, float (&c)[3]) {
    const float hi = fs_split_hi(x);
    const float lo = (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u ? 0.0f : x - hi;
#pragma unroll
    for (int i = 0; i < 3; ++i) c[i] = i == LO ? lo : hi;
}

template <bool K_INNER, int LO, int VEC>
__device__ void fs_split_tf32(const float* __restrict__ in, float* __restrict__ out, long long batch,
                              long long rows, long long cols, long long ld, long long stride) {
    static_assert(LO == 1 || LO == 2, "A's lo is its second copy, B's its third");
    static_assert(VEC == 1 || VEC == 4, "floats or float4s");
    const long long per = rows * cols;
    const long long lines = batch * rows;
    for (long long line = blockIdx.x; line < lines; line += gridDim.x) {
        const long long b = line / rows, r = line - b * rows;
        const float* src = in + b * stride + r * ld;
        // Where copy 0 of this row starts, and how far each copy is from
        // the one before.
        float* dst = out + 3 * b * per + (K_INNER ? 3 * r * cols : r * cols);
        const long long gap = K_INNER ? cols : per;
        for (long long c = (long long)threadIdx.x * VEC; c < cols; c += (long long)blockDim.x * VEC) {
            if (VEC == 4) {
                const float4 x = *reinterpret_cast<const float4*>(src + c);
                float p0[3], p1[3], p2[3], p3[3];
                fs_split_parts<LO>(x.x, p0);
                fs_split_parts<LO>(x.y, p1);
                fs_split_parts<LO>(x.z, p2);
                fs_split_parts<LO>(x.w, p3);
#pragma unroll
                for (int i = 0; i < 3; ++i) {
                    float4 y;
                    y.x = p0[i];
                    y.y = p1[i];
                    y.z = p2[i];
                    y.w = p3[i];
                    *reinterpret_cast<float4*>(dst + i * gap + c) = y;
                }
            } else {
                float p[3];
                fs_split_parts<LO>(src[c], p);
#pragma unroll
                for (int i = 0; i < 3; ++i) dst[i * gap + c] = p[i];
            }
        }
    }
}

#endif

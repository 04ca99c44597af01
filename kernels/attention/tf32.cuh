// f32 attention on tensor cores: mma.sync.m16n8k8 with TF32 operands
// (sm_80 and newer), and the fragments the f32 kernels read from shared
// memory.
//
// A TF32 operand keeps 10 of f32's 23 mantissa bits. With PRECISE each
// operand x is split into hi = tf32(x) and lo = x - hi (truncated to TF32
// by the mma), and a product takes lo * hi + hi * lo + hi * hi (three mma;
// the small terms first): hi + lo is within 2^-21 of x, and what the
// product drops (lo * lo) is 2^-22 of it, near f32's own 2^-24. This is
// CUTLASS's "3xTF32" (OpMultiplyAddFastF32), which PyTorch's f32 attention
// uses on these GPUs. Without PRECISE one mma of the hi parts, as
// `allow_tf32` gives in PyTorch.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k8" with .tf32), with
// g = lane / 4 and t = lane % 4: A (16x8) a0 = (g, t), a1 = (g + 8, t), a2 =
// (g, t + 4), a3 = (g + 8, t + 4); B (8x8) b0 = (t, g), b1 = (t + 4, g); C
// (16x8) as m16n8k16's: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1).
//
// A contraction may take its k index in any order, the same on both sides.
// The *_pairs readers take k = t as 2t and k = t + 4 as 2t + 1: so an
// accumulator (whose columns 2t, 2t + 1 a thread holds) is its own A
// fragment with no shuffle (a_of_acc), and the B fragment of a [k][n] tile
// reads rows 2t and 2t + 1.
//
// Shared tiles have rows a multiple of 4 but not of 8 floats apart (a head
// dim, a multiple of 8, plus 4): then the 32 lanes' reads of a_rows /
// b_rows (row g, column t) and of the *_pairs readers (row 2t, column g)
// fall in 32 different banks.
#ifndef FS_ATTENTION_TF32
#define FS_ATTENTION_TF32
#include "common.cuh"

#ifdef __CUDACC__
// d += a * b for one warp, m16n8k8, TF32 operands (f32 registers of which
// the tensor cores read the top 19 bits: the low 13 mantissa bits are
// ignored, which truncates), f32 accumulators.
__device__ __forceinline__ void fs_mma_1688_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
inline void fs_mma_1688_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    fs_emu_mma_1688_tf32(d, a, b0, b1);
}
#endif

// x rounded to TF32, to nearest with ties away from zero (cvt.rna.tf32.f32's
// result, in two integer operations where cvt is a slower conversion):
// half of the lowest kept bit added to the magnitude, the rest cut off.
// Infinities and NaNs stay what they are; the largest finite values round
// to infinity, as cvt.rna's do.
__device__ __forceinline__ unsigned fs_to_tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

namespace fs_attn {

// N operand registers of one thread: the TF32 parts hi and (PRECISE) lo.
template <int N>
struct Tf32Frag {
    unsigned hi[N], lo[N];
};

// hi = tf32(x) and lo = x - hi (exact in f32), whose low bits the mma
// ignores: lo truncated to TF32 is within 2^-10 of itself, 2^-21 of x (as
// CUTLASS's 3xTF32 takes its small part, round toward zero).
template <bool PRECISE, int N>
__device__ __forceinline__ void tf32_split(Tf32Frag<N>& f, int i, float x) {
    f.hi[i] = fs_to_tf32(x);
    f.lo[i] = PRECISE ? __float_as_uint(x - __uint_as_float(f.hi[i])) : 0u;
}

// acc[j] += a * b[j] for j < J, in three mma each with PRECISE, one
// without: each pass runs over all J products, so the mma that follow each
// other add into different accumulators (an accumulator's three in a row
// would each wait for the one before).
template <bool PRECISE, int J>
__device__ __forceinline__ void mma_tf32(float (*acc)[4], const Tf32Frag<4>& a, const Tf32Frag<2> (&b)[J]) {
    if (PRECISE) {
#pragma unroll
        for (int j = 0; j < J; ++j) fs_mma_1688_tf32(acc[j], a.lo, b[j].hi[0], b[j].hi[1]);
#pragma unroll
        for (int j = 0; j < J; ++j) fs_mma_1688_tf32(acc[j], a.hi, b[j].lo[0], b[j].lo[1]);
    }
#pragma unroll
    for (int j = 0; j < J; ++j) fs_mma_1688_tf32(acc[j], a.hi, b[j].hi[0], b[j].hi[1]);
}

// How many B fragments a kernel splits at a time for N products sharing an A
// fragment: the largest divisor of N up to 8 (8 fragments are 32 registers
// with their lo parts).
__host__ __device__ constexpr int tf32_chunk(int n) {
    for (int j = 8; j > 1; --j)
        if (n % j == 0) return j;
    return 1;
}

// The A fragment (rows m0 .. m0 + 15, k0 .. k0 + 7) of a row-major [m][k]
// tile whose rows are `row` floats apart, `at` pointing at (m0, k0).
template <bool PRECISE>
__device__ __forceinline__ void a_rows(Tf32Frag<4>& a, const float* at, int row) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    tf32_split<PRECISE>(a, 0, at[g * row + t]);
    tf32_split<PRECISE>(a, 1, at[(g + 8) * row + t]);
    tf32_split<PRECISE>(a, 2, at[g * row + t + 4]);
    tf32_split<PRECISE>(a, 3, at[(g + 8) * row + t + 4]);
}

// The A fragment of a tile stored [k][m] (`at` at (k0, m0)), k in pairs.
template <bool PRECISE>
__device__ __forceinline__ void a_cols_pairs(Tf32Frag<4>& a, const float* at, int row) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    tf32_split<PRECISE>(a, 0, at[2 * t * row + g]);
    tf32_split<PRECISE>(a, 1, at[2 * t * row + g + 8]);
    tf32_split<PRECISE>(a, 2, at[(2 * t + 1) * row + g]);
    tf32_split<PRECISE>(a, 3, at[(2 * t + 1) * row + g + 8]);
}

// An m16n8 accumulator (rows m, columns k0 .. k0 + 7) as the A fragment of
// the next product over k, k in pairs: (g, 2t), (g + 8, 2t), (g, 2t + 1),
// (g + 8, 2t + 1) are c[0], c[2], c[1], c[3].
template <bool PRECISE>
__device__ __forceinline__ void a_of_acc(Tf32Frag<4>& a, const float (&c)[4]) {
    tf32_split<PRECISE>(a, 0, c[0]);
    tf32_split<PRECISE>(a, 1, c[2]);
    tf32_split<PRECISE>(a, 2, c[1]);
    tf32_split<PRECISE>(a, 3, c[3]);
}

// The B fragment (k0 .. k0 + 7, columns n0 .. n0 + 7) of a tile stored
// [n][k] (B transposed, as K is for S = Q K^T), `at` at (n0, k0).
template <bool PRECISE>
__device__ __forceinline__ void b_rows(Tf32Frag<2>& b, const float* at, int row) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    tf32_split<PRECISE>(b, 0, at[g * row + t]);
    tf32_split<PRECISE>(b, 1, at[g * row + t + 4]);
}

// The B fragment of a row-major [k][n] tile (`at` at (k0, n0)), k in pairs.
template <bool PRECISE>
__device__ __forceinline__ void b_cols_pairs(Tf32Frag<2>& b, const float* at, int row) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    tf32_split<PRECISE>(b, 0, at[2 * t * row + g]);
    tf32_split<PRECISE>(b, 1, at[(2 * t + 1) * row + g]);
}

// acc[n] += a * B_n for n < N: B_n is rows 8n .. 8n + 7 of a tile stored
// [n][k] (`at` at (0, k0)), all N fragments read and split, then the
// passes (S = Q K^T and its kin).
template <bool PRECISE, int N>
__device__ __forceinline__ void mma_rows(float (&acc)[N][4], const Tf32Frag<4>& a, const float* at, int row) {
    Tf32Frag<2> b[N];
#pragma unroll
    for (int n = 0; n < N; ++n) b_rows<PRECISE>(b[n], at + n * 8 * row, row);
    mma_tf32<PRECISE>(acc, a, b);
}

// acc[n] += a * B_n for n < N: B_n is columns 8n .. 8n + 7 of a row-major
// [k][n] tile (`at` at (k0, 0)), k in pairs, tf32_chunk(N) fragments split
// at a time (O += P V and its kin).
template <bool PRECISE, int N>
__device__ __forceinline__ void mma_cols_pairs(float (&acc)[N][4], const Tf32Frag<4>& a, const float* at, int row) {
    constexpr int C = tf32_chunk(N);
#pragma unroll
    for (int n0 = 0; n0 < N; n0 += C) {
        Tf32Frag<2> b[C];
#pragma unroll
        for (int j = 0; j < C; ++j) b_cols_pairs<PRECISE>(b[j], at + (n0 + j) * 8, row);
        mma_tf32<PRECISE>(acc + n0, a, b);
    }
}

}  // namespace fs_attn

#endif

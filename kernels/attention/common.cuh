// fusec attention kernels: what every one of them shares.
//
// Needs the prelude (fusec_prelude.cuh: fs_i64, fs_bf16, the conversions)
// before it, and nothing else: NVRTC compiles it without CUDA's headers.
//
// Each GPU-only operation is one small wrapper (one PTX instruction, or a
// 16-byte access). In a host build (no __CUDACC__: a plain C++ compiler) the warp-level ones
// call fs_emu_* functions that an emulation supplies (the tests'
// tests/flash_host/mma_emu.h rebuilds each mma's matrices from the 32
// lanes' fragments with the PTX ISA's layouts), so the same kernel text
// runs on the host against the CPU reference.
#ifndef FS_ATTENTION_COMMON
#define FS_ATTENTION_COMMON

#include "../random/philox.cuh"

#ifdef __CUDACC__
// d += a * b for one warp, m16n8k16: a is 16x16 row-major (4 registers of two
// 16-bit values), b 16x8 column-major (2 registers), d 16x8 in f32.
__device__ __forceinline__ void fs_mma_16816_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void fs_mma_16816_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float fs_shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
__device__ __forceinline__ unsigned fs_shfl_xor_u32(unsigned v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
// 2^x (2 ulp; 2^-inf = 0).
__device__ __forceinline__ float fs_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// Two adjacent 16-bit values (4-byte aligned) as one register, low first.
__device__ __forceinline__ unsigned fs_ld32(const unsigned short* p) { return *reinterpret_cast<const unsigned*>(p); }
// 16 bytes, both addresses 16-byte aligned.
__device__ __forceinline__ void fs_copy16(unsigned short* dst, const unsigned short* src) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ void fs_zero16(unsigned short* dst) { *reinterpret_cast<uint4*>(dst) = uint4{0u, 0u, 0u, 0u}; }
__device__ __forceinline__ void fs_copy16(float* dst, const float* src) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ void fs_zero16(float* dst) { *reinterpret_cast<uint4*>(dst) = uint4{0u, 0u, 0u, 0u}; }
// A kernel's dynamic shared memory, 16-byte aligned, as `unsigned char* name`.
#define FS_DYNAMIC_SMEM(name, bytes) \
    extern __shared__ uint4 name##_words[]; \
    unsigned char* const name = reinterpret_cast<unsigned char*>(name##_words)
// Two adjacent 16-bit values (4-byte aligned) from one register, low first.
__device__ __forceinline__ void fs_st32(unsigned short* p, unsigned v) { *reinterpret_cast<unsigned*>(p) = v; }
// p[0] += a, p[1] += b in global memory, atomically (p 8-byte aligned): one
// vector reduction on sm_90, two scalar ones before.
__device__ __forceinline__ void fs_atomic_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(p, a);
    atomicAdd(p + 1, b);
#endif
}
// ldmatrix.x4: lanes 8i .. 8i + 7 give the rows of 8x8 matrix i (16-byte
// aligned shared memory); r[i] gets this lane's two elements of matrix i:
// (row lane / 4, col 2 * (lane % 4)) low, the next column high.
__device__ __forceinline__ void fs_ldsm_x4(unsigned (&r)[4], const unsigned short* row) {
    asm volatile("{ .reg .u64 a64; .reg .u32 a; cvta.to.shared.u64 a64, %4; cvt.u32.u64 a, a64;\n"
                 "  ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [a]; }"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(row));
}
// ldmatrix.x4.trans: lanes 8i .. 8i + 7 give the rows of 8x8 matrix i (16-byte
// aligned shared memory); r[i] gets this lane's two elements of matrix i
// transposed: (row 2 * (lane % 4), col lane / 4) low, the next row high.
__device__ __forceinline__ void fs_ldsm_x4_t(unsigned (&r)[4], const unsigned short* row) {
    asm volatile("{ .reg .u64 a64; .reg .u32 a; cvta.to.shared.u64 a64, %4; cvt.u32.u64 a, a64;\n"
                 "  ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [a]; }"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(row));
}
#else
inline void fs_mma_16816_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { fs_emu_mma_16816(d, a, b0, b1, true); }
inline void fs_mma_16816_f16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { fs_emu_mma_16816(d, a, b0, b1, false); }
inline float fs_shfl_xor(float v, int lane_mask) { return fs_emu_shfl_xor(v, lane_mask); }
// The bits of v through the float exchange (a copy, no arithmetic).
inline unsigned fs_shfl_xor_u32(unsigned v, int lane_mask) {
    float f;
    memcpy(&f, &v, 4);
    f = fs_emu_shfl_xor(f, lane_mask);
    memcpy(&v, &f, 4);
    return v;
}
inline float fs_exp2(float x) { return exp2f(x); }
inline unsigned fs_ld32(const unsigned short* p) {
    unsigned u;
    memcpy(&u, p, 4);
    return u;
}
inline void fs_copy16(unsigned short* dst, const unsigned short* src) { memcpy(dst, src, 16); }
inline void fs_zero16(unsigned short* dst) { memset(dst, 0, 16); }
inline void fs_copy16(float* dst, const float* src) { memcpy(dst, src, 16); }
inline void fs_zero16(float* dst) { memset(dst, 0, 16); }
inline void fs_st32(unsigned short* p, unsigned v) { memcpy(p, &v, 4); }
// On the host a block's dynamic shared memory is one static array, as its
// `__shared__` arrays are (blocks run one after another).
#define FS_DYNAMIC_SMEM(name, bytes) alignas(1024) static unsigned char name[bytes]
// Host blocks run one after another and a block's warps add into disjoint
// elements, so a plain sum is what the atomics compute.
inline void fs_atomic_add2(float* p, float a, float b) {
    p[0] += a;
    p[1] += b;
}
inline void fs_ldsm_x4(unsigned (&r)[4], const unsigned short* row) { fs_emu_ldsm_x4(r, row, false); }
inline void fs_ldsm_x4_t(unsigned (&r)[4], const unsigned short* row) { fs_emu_ldsm_x4(r, row, true); }
#endif

// One m16n8k16 A fragment (rows r0 .. r0 + 15, columns c0 .. c0 + 15) of a
// row-major tile in shared memory whose rows are `row` elements apart, `at`
// pointing at (r0, c0), in one ldmatrix: the four 8x8 quarters are a[0]
// (rows 0-7, columns 0-7), a[1] (rows 8-15), a[2] (columns 8-15), a[3].
__device__ __forceinline__ void fs_a_frag(unsigned (&a)[4], const unsigned short* at, int row) {
    const int lane = threadIdx.x & 31;
    fs_ldsm_x4(a, at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8);
}
// The same A fragment from a tile stored transposed ([column][row]: element
// (r, c) at at[c * row + r]), in one ldmatrix.trans: `at` points at
// (r0, c0), i.e. stored row c0, column r0.
__device__ __forceinline__ void fs_a_frag_t(unsigned (&a)[4], const unsigned short* at, int row) {
    const int lane = threadIdx.x & 31;
    fs_ldsm_x4_t(a, at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8);
}
// The B fragments (column-major) of two m16n8k16 products from a row-major
// [n][k] tile in shared memory (B transposed, as K is for S = Q K^T), `at`
// pointing at (n0, k0): b[0], b[1] for n0 .. n0 + 7 and b[2], b[3] for
// n0 + 8 .. n0 + 15, k0 .. k0 + 15, in one ldmatrix.
__device__ __forceinline__ void fs_b_frags(unsigned (&b)[4], const unsigned short* at, int row) {
    const int lane = threadIdx.x & 31;
    fs_ldsm_x4(b, at + ((lane & 7) + (lane >> 4) * 8) * row + ((lane >> 3) & 1) * 8);
}
// The B fragments (column-major, two 16-bit values per register) of two
// m16n8k16 products from a row-major [k][n] tile in shared memory whose rows
// are `row` elements apart, `at` pointing at (k0, n0): b[0], b[1] for columns
// n0 .. n0 + 7 and b[2], b[3] for n0 + 8 .. n0 + 15, rows k0 .. k0 + 15. One
// ldmatrix.trans instead of eight 16-bit loads: lane l gives row l % 8 (+ 8
// for lanes 8-15 and 24-31) at column + 8 for lanes 16-31.
__device__ __forceinline__ void fs_b_frags_t(unsigned (&b)[4], const unsigned short* at, int row) {
    const int lane = threadIdx.x & 31;
    fs_ldsm_x4_t(b, at + ((lane & 7) + ((lane >> 3) & 1) * 8) * row + (lane >> 4) * 8);
}
// Two floats rounded to 16 bits and packed into one mma operand, lo in the low half.
__device__ __forceinline__ unsigned fs_pack_bf16(float lo, float hi) { return (unsigned)fs_to_bf16(lo) | ((unsigned)fs_to_bf16(hi) << 16); }
__device__ __forceinline__ unsigned fs_pack_f16(float lo, float hi) { return (unsigned)fs_to_f16(lo) | ((unsigned)fs_to_f16(hi) << 16); }

// -inf as f32 (no CUDA header is included for INFINITY).
#define FS_NEG_INF (-__int_as_float(0x7f800000))

namespace fs_attn {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// `x` rounded up to a multiple of `m`: head dims are padded to whole
// tensor-core steps inside the tiles (the padding holds zeros).
__host__ __device__ constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

// The element types: how a value is stored (`Storage`), and for the 16-bit
// ones (stored as 16 raw bits) packed into an mma operand and multiplied on
// tensor cores. F32's products go through tf32.cuh.
struct Bf16 {
    typedef unsigned short Storage;
    static constexpr bool IS_F16 = false;
    static __device__ __forceinline__ unsigned pack(float lo, float hi) { return fs_pack_bf16(lo, hi); }
    static __device__ __forceinline__ unsigned short from_float(float x) { return fs_to_bf16(x); }
    static __device__ __forceinline__ float to_float(const unsigned short* p) { return fs_load_bf16(p); }
    static __device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        fs_mma_16816_bf16(d, a, b0, b1);
    }
};
struct F16 {
    typedef unsigned short Storage;
    static constexpr bool IS_F16 = true;
    static __device__ __forceinline__ unsigned pack(float lo, float hi) { return fs_pack_f16(lo, hi); }
    static __device__ __forceinline__ unsigned short from_float(float x) { return fs_to_f16(x); }
    static __device__ __forceinline__ float to_float(const unsigned short* p) { return fs_load_f16(p); }
    static __device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
        fs_mma_16816_f16(d, a, b0, b1);
    }
};
struct F32 {
    typedef float Storage;
    static constexpr bool IS_F16 = false;
    static __device__ __forceinline__ float from_float(float x) { return x; }
    static __device__ __forceinline__ float to_float(const float* p) { return *p; }
};

// A [B, T, H, D] view of elements P: (b, i, h, e) at p[b * sb + i * st +
// h * sh + e]. Q, K and V are often strided slices of one fused projection;
// every row starts 16-byte aligned (the emitter checks the strides).
template <class P>
struct Heads {
    P* p;
    fs_i64 sb, st, sh;
    __device__ __forceinline__ P* row(fs_i64 b, fs_i64 i, fs_i64 h) const { return p + b * sb + i * st + h * sh; }
};
typedef Heads<const unsigned short> In;
typedef Heads<unsigned short> Out;
// An f32 [B, H, T] tensor (the log-sum-exp): (b, h, i) at p[b * sb + h * sh + i * st].
template <class P>
struct Rows {
    P* p;
    fs_i64 sb, sh, st;
    __device__ __forceinline__ P& at(fs_i64 b, fs_i64 h, fs_i64 i) const { return p[b * sb + h * sh + i * st]; }
};

// Dropout on the probabilities (kernels instantiated with DROPOUT): the
// step's key, the op's site, draws below `threshold` dropped, kept ones
// multiplied by `scale`, 1 over the share kept (256 / (256 - threshold)).
struct Dropout {
    const int* key = nullptr;
    unsigned site = 0, threshold = 0;
    float scale = 1.0f;
};

// What a forward kernel reads and writes: O [B, T, Hq, Dv] and the
// log-sum-exp [B, Hq, T] of q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv],
// query head h reading key/value head h / group; S: how an element is
// stored (E::Storage).
template <class S>
struct ForwardArgsOf {
    Heads<const S> q, k, v;
    Heads<S> o;
    Rows<float> lse;
    fs_i64 batch, q_heads, q_len, kv_len, group;
    float scale_log2;  // scale * log2(e): exp(x * scale) = exp2(x * scale_log2)
    // Each batch entry's number of keys (the rest are padding), or null:
    // kv_len for every one.
    const int* kv_lens = nullptr;
    Dropout drop;
};
typedef ForwardArgsOf<unsigned short> ForwardArgs;
typedef ForwardArgsOf<float> ForwardArgsF32;

// What the backward kernels read and write: dQ, dK, dV (shaped as q, k, v)
// from q, k, v, the forward's o and lse, and dO. `scratch` is an f32 buffer
// the kernels of one backward share: delta = rowsum(dO * O) [B, Hq, T], after
// the f32 dQ sum [B, Hq, T, D] where dQ is summed by atomics.
template <class S>
struct BackwardArgsOf {
    Heads<const S> q, k, v, o, dout;
    Rows<const float> lse;
    Heads<S> dq, dk, dv;
    float* scratch;
    fs_i64 batch, q_heads, q_len, kv_len, group;
    float scale, scale_log2;
    const int* kv_lens = nullptr;  // as ForwardArgs'
    Dropout drop;
};
typedef BackwardArgsOf<unsigned short> BackwardArgs;
typedef BackwardArgsOf<float> BackwardArgsF32;

// The keys batch entry b sees: its own length where the step gives lengths
// (its keys past that are padding: never visited, their dK and dV zero),
// else kv_len. Layouts keep kv_len.
template <class Args>
__device__ __forceinline__ fs_i64 keys_of(const Args& a, fs_i64 b) {
    if (!a.kv_lens) return a.kv_len;
    const fs_i64 n = a.kv_lens[b];
    return n < 0 ? 0 : n < a.kv_len ? n : a.kv_len;
}

// The keys a key-major backward masks from: the batch entry's length where
// the step gives lengths; otherwise none (keys past kv_len are loaded as
// zeros, so they add nothing to dQ, and their dK, dV rows are never
// stored).
template <class Args>
__device__ __forceinline__ fs_i64 masked_keys_from(const Args& a, fs_i64 b) {
    return a.kv_lens ? keys_of(a, b) : (fs_i64)1 << 62;
}

// Copies rows row0 .. row0 + ROWS - 1 of head h of `x` (features 0 .. WIDTH - 1)
// into a row-major shared tile whose rows are PITCH elements apart, 16 bytes
// per thread and step; rows at or past `len`, and features WIDTH .. PADDED - 1,
// are zeros.
template <int ROWS, int WIDTH, int PADDED, int PITCH, int THREADS, class S>
__device__ __forceinline__ void load_rows(S* tile, const Heads<const S>& x, fs_i64 b, fs_i64 row0, fs_i64 h, fs_i64 len) {
    constexpr int PER = 16 / (int)sizeof(S);  // elements per 16-byte chunk
    constexpr int CHUNKS = PADDED / PER;      // chunks per row
    static_assert(PADDED % PER == 0 && WIDTH % PER == 0, "rows of whole 16-byte chunks");
    for (int c = threadIdx.x; c < ROWS * CHUNKS; c += THREADS) {
        const int r = c / CHUNKS, e = (c % CHUNKS) * PER;
        const fs_i64 i = row0 + r;
        if (i < len && e < WIDTH) fs_copy16(&tile[r * PITCH + e], x.row(b, i, h) + e);
        else fs_zero16(&tile[r * PITCH + e]);
    }
}

// The end of the keys a query tile from row q0 visits: kv_len, or when
// causal no further than its last row (keys after it are all masked).
template <int TILE_Q, bool CAUSAL>
__device__ __forceinline__ fs_i64 visited_keys_end(fs_i64 q0, fs_i64 kv_len) {
    return CAUSAL && q0 + TILE_Q < kv_len ? q0 + TILE_Q : kv_len;
}

// The masks and the online softmax of a forward, on one warp's scores
// s[TILE_K / 8][4] in the accumulator layout of m16n8 (and of wgmma, which
// repeats it): s[n][e] is row i_lo (e < 2) or i_hi = i_lo + 8, key
// k0 + 8n + frag_col + e % 2; `first_row` is the warp's first query row.
//
// Keys past kv_len and, when causal, keys after the query are masked only on
// the tiles where the warp can meet one. The new row max (over the row's 4
// threads) gives `rescale[r]`, the factor by which the row's running sum has
// been and its output accumulator must be multiplied; s becomes
// P = exp2(s * scale_log2 - max), and row_max stays in log2 units. With
// SCALE_IN_EXP (a positive scale) the max is taken of the raw scores and the
// scale goes into the exponent, one fused multiply-add an element.
template <int TILE_K, bool CAUSAL, bool SCALE_IN_EXP>
__device__ __forceinline__ void mask_and_softmax(float (&s)[TILE_K / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                                 float (&rescale)[2], fs_i64 k0, fs_i64 kv_len, fs_i64 first_row,
                                                 fs_i64 i_lo, fs_i64 i_hi, int frag_col, float scale_log2) {
    if (!SCALE_IN_EXP) {
#pragma unroll
        for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] *= scale_log2;
        }
    }
    const float in_exp = SCALE_IN_EXP ? scale_log2 : 1.0f;
    if (k0 + TILE_K > kv_len || (CAUSAL && k0 + TILE_K - 1 > first_row)) {
#pragma unroll
        for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const fs_i64 j = k0 + n * 8 + frag_col + (e & 1), i = e < 2 ? i_lo : i_hi;
                if (j >= kv_len || (CAUSAL && j > i)) s[n][e] = FS_NEG_INF;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float tile_max = FS_NEG_INF;
#pragma unroll
        for (int n = 0; n < TILE_K / 8; ++n) tile_max = fmaxf(tile_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        tile_max = fmaxf(tile_max, fs_shfl_xor(tile_max, 1));
        tile_max = fmaxf(tile_max, fs_shfl_xor(tile_max, 2));
        const float new_max = fmaxf(row_max[r], tile_max * in_exp);
        // No visible key yet: subtract 0, not -inf, so masked scores give 0 and not NaN.
        const float base = new_max == FS_NEG_INF ? 0.0f : new_max;
        rescale[r] = fs_exp2(row_max[r] - base);
        row_max[r] = new_max;
        float tile_sum = 0.0f;
#pragma unroll
        for (int n = 0; n < TILE_K / 8; ++n) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                s[n][e] = fs_exp2(s[n][e] * in_exp - base);
                tile_sum += s[n][e];
            }
        }
        row_sum[r] = row_sum[r] * rescale[r] + tile_sum;
    }
}

// The last step of both forwards: each row's sum over its 4 threads, then
// O = acc / sum (features below DV) and lse = max * ln 2 + ln(sum) stored for
// this thread's rows i_lo and i_hi of head h (output 0 and lse -inf for a row
// without a visible key, kv_len = 0). o_acc[n][e]: row i_lo + 8 * (e / 2),
// feature 8n + frag_col + e % 2.
template <class E, int DV, int NF>
__device__ __forceinline__ void store_output(const ForwardArgsOf<typename E::Storage>& a, const float (&o_acc)[NF][4], const float (&row_max)[2],
                                             const float (&row_sum)[2], fs_i64 b, fs_i64 h, fs_i64 i_lo, fs_i64 i_hi,
                                             int frag_col) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = row_sum[r];
        sum += fs_shfl_xor(sum, 1);
        sum += fs_shfl_xor(sum, 2);
        const fs_i64 i = r == 0 ? i_lo : i_hi;
        if (i < a.q_len) {
            const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
            typename E::Storage* const o = a.o.row(b, i, h);
#pragma unroll
            for (int n = 0; n < NF; ++n) {
                if (n * 8 < DV) {
                    o[n * 8 + frag_col] = E::from_float(o_acc[n][2 * r] * inv_sum);
                    o[n * 8 + frag_col + 1] = E::from_float(o_acc[n][2 * r + 1] * inv_sum);
                }
            }
            if (frag_col == 0) a.lse.at(b, h, i) = sum > 0.0f ? row_max[r] * LN2 + logf(sum) : FS_NEG_INF;
        }
    }
}

// P^T = exp2(S^T * scale_log2 - lse) in place of a key-major backward's
// accumulators s[TILE_Q / 8][4] (key row key_row + 8 * (e / 2) of the block's
// k0 .., query column 8n + frag_col + e % 2 of the tile's i0 ..; lse_tile in
// log2 units). Queries past q_len, keys from `keys` on (masked_keys_from)
// and, when causal, keys after the query are masked in a loop of
// their own on the tiles that can need it, with 32-bit tile-relative
// indices, so the other tiles carry no index arithmetic (as one loop with a
// per-element test, ptxas made it 64-bit compares on every tile). A masked
// P is 0 by selection, never by a product, so dV, dS and through it dK and
// dQ take nothing from a padded key.
template <int TILE_Q, int TILE_K, bool CAUSAL>
__device__ __forceinline__ void p_of_s(float (&s)[TILE_Q / 8][4], const float* lse_tile, fs_i64 i0, fs_i64 k0,
                                       fs_i64 q_len, fs_i64 keys, int key_row, int frag_col, float scale_log2) {
    const int rows = q_len - i0 < TILE_Q ? (int)(q_len - i0) : TILE_Q;  // queries in the tile
    const int key_rows = keys - k0 < TILE_K ? (keys > k0 ? (int)(keys - k0) : 0) : TILE_K;  // keys in the block
    if (rows < TILE_Q || key_rows < TILE_K || (CAUSAL && i0 < k0 + TILE_K)) {
        // Key row kr (of the block) comes after query column qc (of the tile) if kr > qc + diag.
        const int diag = (int)(i0 - k0);
#pragma unroll
        for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int qc = n * 8 + frag_col + (e & 1), kr = key_row + 8 * (e >> 1);
                const float p = fs_exp2(s[n][e] * scale_log2 - lse_tile[qc]);
                s[n][e] = qc >= rows || kr >= key_rows || (CAUSAL && kr > qc + diag) ? 0.0f : p;
            }
        }
    } else {
#pragma unroll
        for (int n = 0; n < TILE_Q / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = fs_exp2(s[n][e] * scale_log2 - lse_tile[n * 8 + frag_col + (e & 1)]);
        }
    }
}

// A query that sees at most one key (a batch entry of one key or none, or
// row 0 when causal: the mask is top-left, key j hidden from query i < j)
// has a constant softmax, so its dS = P (dP - delta) is 0 in real
// arithmetic, with or without dropout. The kernels take dP from a
// tensor-core product and delta = rowsum(dO * O) from another sum of the
// same terms, so there dS would be rounding noise, and in a gradient that
// is zero in real arithmetic (a decoder's queries at T = 2, a one-token
// target) Adam turns noise into a step of a sizeable fraction of the
// learning rate. Such rows' dQ, and their share of dK, are exactly 0
// instead. `keys`: the batch entry's keys (keys_of).
template <bool CAUSAL>
__device__ __forceinline__ bool sees_one_key(fs_i64 i, fs_i64 keys) {
    return keys <= 1 || (CAUSAL && i == 0);
}

// Causal query 0's column of a key-major tile's dS^T (accumulator layout:
// ds[n][e] of query column first_query + 8n + frag_col + e % 2), exactly 0
// (sees_one_key). Only the first query tile takes the branch; a batch
// entry of at most one key is handled after the loop (clear_dk_of_one_key
// and the dQ stores), so no flag stays live through it.
template <int COLS, bool CAUSAL>
__device__ __forceinline__ void clear_first_query(float (&ds)[COLS / 8][4], fs_i64 first_query, int frag_col) {
    if (CAUSAL && first_query == 0 && frag_col == 0) {
        ds[0][0] = 0.0f;  // key row key_row, query 0
        ds[0][2] = 0.0f;  // key row key_row + 8, query 0
    }
}

// A key-major backward's dK accumulators for a batch entry whose queries
// each see at most one key: every dS of the entry is 0 in real arithmetic
// (sees_one_key), so dK is exactly 0. Read after the loop.
template <class Args, int N>
__device__ __forceinline__ void clear_dk_of_one_key(const Args& a, fs_i64 b, float (&dk_acc)[N][4]) {
    if (keys_of(a, b) <= 1) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dk_acc[n][e] = 0.0f;
        }
    }
}

// Dropout's draws for one warp's tile s[N][4] in the m16n8 accumulator
// layout (s[n][e]: row row_lo + 8 * (e / 2), column col0 + 8n + frag_col +
// e % 2; row_lo with bit 3 clear, col0 a multiple of 16): calls
// f(n, e, kept) for each entry, every lane of the warp together. Rows are
// queries and columns keys, or with KEY_MAJOR the other way round.
//
// A Philox block holds the 8-bit draws of queries i, i + 1, i + 8, i + 9 by
// keys j, j + 1, j + 8, j + 9 (fs_attention_block). Of each 16 columns a
// lane holds half a block: query-major its two query rows' words (row
// parity, + 2), key-major its two key rows' bytes of each word. The lane 4
// apart (the other row parity) holds the other half. So of two neighbouring
// 16-column spans each lane draws the block of the span of its row parity
// and trades halves with that lane: one block for every 16 entries (a
// 10-round Philox call costs about 70 integer instructions, a trade two
// shuffles).
template <int N, bool KEY_MAJOR, class F>
__device__ __forceinline__ void for_each_draw(const Dropout& d, fs_i64 bh, fs_i64 row_lo, fs_i64 col0, int frag_col, F f) {
    constexpr int SPANS = N / 2;
    const int par = (int)(row_lo & 1);
    const fs_i64 row_even = row_lo - par;
    auto block = [&](int span) {
        const fs_i64 col = col0 + 16 * span + frag_col;
        return KEY_MAJOR ? fs_attention_block(d.key, d.site, bh, col, row_even)
                         : fs_attention_block(d.key, d.site, bh, row_even, col);
    };
    // The half of block w that the lanes of row parity `which` hold, in two
    // words: query-major words which and which + 2 (query rows 0 and 8 of
    // the pair, a key a byte: (j bit 0) + 2 (j bit 3)); key-major bytes
    // which and which + 2 of words 0 and 1, then of words 2 and 3,
    // interleaved so that entry e of a query pair is byte e.
    auto half = [&](const fs_philox_words& w, int which, unsigned (&h)[2]) {
        if (!KEY_MAJOR) {
            h[0] = which ? w.w[1] : w.w[0];
            h[1] = which ? w.w[3] : w.w[2];
        } else {
            const int sh = 8 * which;
            h[0] = ((w.w[0] >> sh) & 0x00ff00ffu) | (((w.w[1] >> sh) & 0x00ff00ffu) << 8);
            h[1] = ((w.w[2] >> sh) & 0x00ff00ffu) | (((w.w[3] >> sh) & 0x00ff00ffu) << 8);
        }
    };
    // This lane's 8 entries of span `span` (tiles n = 2 span, 2 span + 1).
    auto use = [&](int span, const unsigned (&h)[2]) {
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned x = KEY_MAJOR ? h[nb] : h[e >> 1];
                const int byte = KEY_MAJOR ? e : (e & 1) + 2 * nb;
                f(2 * span + nb, e, ((x >> (8 * byte)) & 0xffu) >= d.threshold);
            }
        }
    };
#pragma unroll
    for (int sp = 0; sp + 1 < SPANS; sp += 2) {
        const fs_philox_words w = block(sp + par);
        unsigned own[2], give[2], got[2];
        half(w, par, own);
        half(w, 1 - par, give);
        got[0] = fs_shfl_xor_u32(give[0], 4);
        got[1] = fs_shfl_xor_u32(give[1], 4);
        // Spans by constant index (a span chosen by the lane's parity would
        // index s[][] at run time and put it in local memory).
        const unsigned first[2] = {par ? got[0] : own[0], par ? got[1] : own[1]};
        const unsigned second[2] = {par ? own[0] : got[0], par ? own[1] : got[1]};
        use(sp, first);
        use(sp + 1, second);
    }
    if (SPANS % 2) {
        // An odd span out: every lane draws its block and keeps its half.
        unsigned own[2];
        half(block(SPANS - 1), par, own);
        use(SPANS - 1, own);
    }
}

// The accumulators of keys (or queries) 16kk .. 16kk + 15 of an m16n8 product
// as the A fragment of the next one (the accumulator layout of two adjacent
// n8 tiles is the A layout of m16n8k16), rounded to 16 bits.
template <class E, int N>
__device__ __forceinline__ void a_frag_of(unsigned (&a)[4], const float (&acc)[N][4], int kk) {
    a[0] = E::pack(acc[2 * kk][0], acc[2 * kk][1]);
    a[1] = E::pack(acc[2 * kk][2], acc[2 * kk][3]);
    a[2] = E::pack(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
    a[3] = E::pack(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

// A key-major backward's last step: dK = scale * acc and dV = acc for this
// thread's key rows key_row and key_row + 8 of the block's k0 .. (rows past
// kv_len dropped), features f0 + 8n + frag_col (+ 1) below D and DV.
template <class E, int D, int DV, int NK, int NV>
__device__ __forceinline__ void store_dk_dv(const BackwardArgsOf<typename E::Storage>& a, const float (&dk_acc)[NK][4], const float (&dv_acc)[NV][4],
                                            fs_i64 b, fs_i64 kv_h, fs_i64 k0, int key_row, int frag_col, int fk0, int fv0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const fs_i64 j = k0 + key_row + 8 * r;
        if (j < a.kv_len) {
            typename E::Storage* const dk = a.dk.row(b, j, kv_h);
            typename E::Storage* const dv = a.dv.row(b, j, kv_h);
#pragma unroll
            for (int n = 0; n < NK; ++n) {
                if (fk0 + n * 8 < D) {
                    dk[fk0 + n * 8 + frag_col] = E::from_float(dk_acc[n][2 * r] * a.scale);
                    dk[fk0 + n * 8 + frag_col + 1] = E::from_float(dk_acc[n][2 * r + 1] * a.scale);
                }
            }
#pragma unroll
            for (int n = 0; n < NV; ++n) {
                if (fv0 + n * 8 < DV) {
                    dv[fv0 + n * 8 + frag_col] = E::from_float(dv_acc[n][2 * r]);
                    dv[fv0 + n * 8 + frag_col + 1] = E::from_float(dv_acc[n][2 * r + 1]);
                }
            }
        }
    }
}

}  // namespace fs_attn

#endif

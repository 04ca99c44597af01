// Host emulation of the warp-level PTX operations the FlashAttention kernel
// uses (compiler/src/emit/flash/ calls them through fs_emu_* in a host
// build): mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32,
// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (the f32 kernels),
// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 and shfl.sync.bfly
// (__shfl_xor_sync), and for the Hopper kernel
// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16} (fs_emu_wgmma, below)
// and wgmma.wait_group (fs_emu_wgmma_wait).
// Needs block_shim.h (real threads, one barrier per warp).
//
// Each operation is collective, as on the GPU: every lane publishes its
// operands in its warp's exchange buffer, the warp meets at its barrier, and
// every lane then computes its own result from all 32 lanes' operands. For
// the mma that means rebuilding the whole A (16x16), B (16x8) and C (16x8)
// matrices from the lanes' fragments with the layouts of the PTX ISA,
// section "Matrix Fragments for mma.m16n8k16 with floating point type":
//
//   groupID = laneid >> 2, threadID_in_group = laneid % 4
//   A (.row, a0..a7 in 4 .b32 registers, 2 elements each, low half first):
//     row = groupID for a0, a1, a4, a5; groupID + 8 for a2, a3, a6, a7
//     col = threadID_in_group * 2 + (i & 1), + 8 for a4..a7
//   B (.col, b0..b3 in 2 .b32 registers):
//     row = threadID_in_group * 2 + (i & 1), + 8 for b2, b3;  col = groupID
//   C, D (.f32, c0..c3):
//     row = groupID for c0, c1; groupID + 8 for c2, c3
//     col = threadID_in_group * 2 + (i & 1)
//
// The products of two 16-bit values are exact in f32; the sum runs over k
// in order in f32 (the hardware's order and rounding inside the tensor core
// are unspecified, which the tests' tolerances absorb).
//
// Two exchange buffers alternate (by the count of warp operations each
// thread has issued), so one barrier per operation is enough: a lane that
// writes buffer p for operation n + 2 has passed the barrier of operation
// n + 1, which every lane reaches only after reading operation n's buffer.
// Each lane also publishes which operation it is in, and a warp whose lanes
// disagree (a divergent mma or shuffle, undefined on the GPU) aborts.
#pragma once
#include <cstdint>

enum fs_emu_op { FS_EMU_MMA_BF16 = 1, FS_EMU_MMA_F16, FS_EMU_SHFL, FS_EMU_LDSM, FS_EMU_LDSM_T, FS_EMU_WGMMA_RS, FS_EMU_MMA_TF32 };

struct fs_emu_exchange {
    int op[2][32];
    unsigned a[2][32][4];
    unsigned b[2][32][2];
    float c[2][32][4];
    float x[2][32];
    const unsigned short* row[2][32];
};
static fs_emu_exchange fs_emu_warps[32];

static inline void fs_emu_a_coord(int lane, int i, int& row, int& col) {
    const int group = lane >> 2, tig = lane % 4;
    row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
    col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
}
static inline void fs_emu_b_coord(int lane, int i, int& row, int& col) {
    const int group = lane >> 2, tig = lane % 4;
    row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
    col = group;
}
static inline void fs_emu_c_coord(int lane, int i, int& row, int& col) {
    const int group = lane >> 2, tig = lane % 4;
    row = i < 2 ? group : group + 8;
    col = tig * 2 + (i & 1);
}

// Each map covers its matrix exactly once (checked once per program).
static bool fs_emu_layouts_are_bijections() {
    int a[16][16] = {}, b[16][8] = {}, c[16][8] = {};
    for (int lane = 0; lane < 32; ++lane) {
        int r, col;
        for (int i = 0; i < 8; ++i) fs_emu_a_coord(lane, i, r, col), ++a[r][col];
        for (int i = 0; i < 4; ++i) fs_emu_b_coord(lane, i, r, col), ++b[r][col];
        for (int i = 0; i < 4; ++i) fs_emu_c_coord(lane, i, r, col), ++c[r][col];
    }
    for (int r = 0; r < 16; ++r) {
        for (int k = 0; k < 16; ++k)
            if (a[r][k] != 1) return false;
        for (int k = 0; k < 8; ++k)
            if (b[r][k] != 1 || c[r][k] != 1) return false;
    }
    return true;
}
static const bool fs_emu_layouts_ok = [] {
    if (!fs_emu_layouts_are_bijections()) {
        fprintf(stderr, "mma_emu.h: a fragment layout does not cover its matrix exactly once\n");
        exit(3);
    }
    return true;
}();

// 16 bits of a register (the low half for `high` = 0) as a float.
static inline float fs_emu_elem(unsigned reg, int high, bool bf16) {
    const unsigned short bits = (unsigned short)(reg >> (16 * high));
    if (bf16) return __uint_as_float((unsigned)bits << 16);
    _Float16 h;
    memcpy(&h, &bits, 2);
    return (float)h;
}

// Publishes this lane's part, waits for the warp, checks the lanes agree.
static inline fs_emu_exchange& fs_emu_meet(int op, int& lane, int& p, void (*publish)(fs_emu_exchange&, int, int, const void*),
                                           const void* arg) {
    const int warp = threadIdx.x >> 5;
    lane = threadIdx.x & 31;
    p = fs_warp_ops++ & 1;
    fs_emu_exchange& w = fs_emu_warps[warp];
    w.op[p][lane] = op;
    publish(w, p, lane, arg);
    fs_warp_barrier[warp]->arrive_and_wait();
    for (int l = 0; l < 32; ++l)
        if (w.op[p][l] != op) {
            fprintf(stderr, "warp %d of block (%u, %u, %u): lanes %d and %d are in different warp operations\n", warp,
                    blockIdx.x, blockIdx.y, blockIdx.z, lane, l);
            exit(4);
        }
    return w;
}

struct fs_emu_mma_args {
    const float* d;
    const unsigned* a;
    unsigned b0, b1;
};

// d = a * b + d for the warp (this lane's fragments in and out).
static void fs_emu_mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, bool bf16) {
    const fs_emu_mma_args args = {d, a, b0, b1};
    int lane, p;
    fs_emu_exchange& w = fs_emu_meet(
        bf16 ? FS_EMU_MMA_BF16 : FS_EMU_MMA_F16, lane, p,
        [](fs_emu_exchange& w, int p, int lane, const void* arg) {
            const fs_emu_mma_args& m = *static_cast<const fs_emu_mma_args*>(arg);
            for (int r = 0; r < 4; ++r) w.a[p][lane][r] = m.a[r], w.c[p][lane][r] = m.d[r];
            w.b[p][lane][0] = m.b0;
            w.b[p][lane][1] = m.b1;
        },
        &args);
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        int r, c;
        for (int i = 0; i < 8; ++i) fs_emu_a_coord(l, i, r, c), A[r][c] = fs_emu_elem(w.a[p][l][i / 2], i & 1, bf16);
        for (int i = 0; i < 4; ++i) fs_emu_b_coord(l, i, r, c), B[r][c] = fs_emu_elem(w.b[p][l][i / 2], i & 1, bf16);
        for (int i = 0; i < 4; ++i) fs_emu_c_coord(l, i, r, c), C[r][c] = w.c[p][l][i];
    }
    for (int i = 0; i < 4; ++i) {
        int r, c;
        fs_emu_c_coord(lane, i, r, c);
        float acc = C[r][c];
        for (int k = 0; k < 16; ++k) acc += A[r][k] * B[k][c];
        d[i] = acc;
    }
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (PTX ISA, "Matrix
// Fragments for mma.m16n8k8", .tf32): A is 16x8 in a0..a3, row groupID
// for a0, a2 and groupID + 8 for a1, a3, col threadID_in_group for a0, a1
// and + 4 for a2, a3; B is 8x8 in b0, b1, row threadID_in_group (+ 4 for
// b1), col groupID; C as m16n8k16's. A TF32 operand is the register's f32
// bits with the low 13 mantissa bits ignored (the hardware reads 19 bits);
// products of two such values are exact in f32.
static inline void fs_emu_tf32_a_coord(int lane, int i, int& row, int& col) {
    row = (lane >> 2) + (i & 1) * 8;
    col = (lane % 4) + (i >> 1) * 4;
}
static inline void fs_emu_tf32_b_coord(int lane, int i, int& row, int& col) {
    row = (lane % 4) + i * 4;
    col = lane >> 2;
}
static inline float fs_emu_tf32(unsigned reg) { return __uint_as_float(reg & 0xffffe000u); }
static const bool fs_emu_tf32_layouts_ok = [] {
    int a[16][8] = {}, b[8][8] = {};
    for (int lane = 0; lane < 32; ++lane) {
        int r, c;
        for (int i = 0; i < 4; ++i) fs_emu_tf32_a_coord(lane, i, r, c), ++a[r][c];
        for (int i = 0; i < 2; ++i) fs_emu_tf32_b_coord(lane, i, r, c), ++b[r][c];
    }
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 8; ++c)
            if (a[r][c] != 1 || (r < 8 && b[r][c] != 1)) {
                fprintf(stderr, "mma_emu.h: a tf32 fragment layout does not cover its matrix exactly once\n");
                exit(3);
            }
    return true;
}();

static void fs_emu_mma_1688_tf32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    const fs_emu_mma_args args = {d, a, b0, b1};
    int lane, p;
    fs_emu_exchange& w = fs_emu_meet(
        FS_EMU_MMA_TF32, lane, p,
        [](fs_emu_exchange& w, int p, int lane, const void* arg) {
            const fs_emu_mma_args& m = *static_cast<const fs_emu_mma_args*>(arg);
            for (int r = 0; r < 4; ++r) w.a[p][lane][r] = m.a[r], w.c[p][lane][r] = m.d[r];
            w.b[p][lane][0] = m.b0;
            w.b[p][lane][1] = m.b1;
        },
        &args);
    float A[16][8], B[8][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        int r, c;
        for (int i = 0; i < 4; ++i) fs_emu_tf32_a_coord(l, i, r, c), A[r][c] = fs_emu_tf32(w.a[p][l][i]);
        for (int i = 0; i < 2; ++i) fs_emu_tf32_b_coord(l, i, r, c), B[r][c] = fs_emu_tf32(w.b[p][l][i]);
        for (int i = 0; i < 4; ++i) fs_emu_c_coord(l, i, r, c), C[r][c] = w.c[p][l][i];
    }
    for (int i = 0; i < 4; ++i) {
        int r, c;
        fs_emu_c_coord(lane, i, r, c);
        float acc = C[r][c];
        for (int k = 0; k < 8; ++k) acc += A[r][k] * B[k][c];
        d[i] = acc;
    }
}

// __shfl_xor_sync(0xffffffff, v, lane_mask): the value of lane (lane ^ lane_mask).
static float fs_emu_shfl_xor(float v, int lane_mask) {
    int lane, p;
    fs_emu_exchange& w = fs_emu_meet(
        FS_EMU_SHFL, lane, p, [](fs_emu_exchange& w, int p, int lane, const void* arg) { w.x[p][lane] = *static_cast<const float*>(arg); },
        &v);
    return w.x[p][(lane ^ lane_mask) & 31];
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i .. 8i + 7 give
// the addresses of rows 0 .. 7 of 8x8 matrix i (M_i[r][c] = row_{8i + r}[c]);
// this lane's r[i] holds M_i at (lane / 4, 2 * (lane % 4)) in the low half
// and the next column in the high half; with .trans, M_i transposed there:
// M_i[2 * (lane % 4)][lane / 4] low, M_i[2 * (lane % 4) + 1][lane / 4] high
// (PTX ISA, "Warp-level matrix load instruction: ldmatrix").
static void fs_emu_ldsm_x4(unsigned (&r)[4], const unsigned short* row, bool trans) {
    int lane, p;
    fs_emu_exchange& w = fs_emu_meet(
        trans ? FS_EMU_LDSM_T : FS_EMU_LDSM, lane, p,
        [](fs_emu_exchange& w, int p, int lane, const void* arg) {
            const unsigned short* at = static_cast<const unsigned short*>(arg);
            if (reinterpret_cast<uintptr_t>(at) % 16 != 0) {
                fprintf(stderr, "ldmatrix: lane %d gives a row that is not 16-byte aligned\n", lane);
                exit(5);
            }
            w.row[p][lane] = at;
        },
        row);
    const int group = lane / 4, pair = 2 * (lane % 4);
    for (int i = 0; i < 4; ++i) {
        const unsigned short* const* m = &w.row[p][8 * i];
        const unsigned lo = trans ? m[pair][group] : m[group][pair];
        const unsigned hi = trans ? m[pair + 1][group] : m[group][pair + 1];
        r[i] = lo | (hi << 16);
    }
}

// Element (mn, k) of a wgmma operand in shared memory, through a descriptor
// without swizzling (PTX ISA, "Shared Memory Matrix Layout"): the matrix is
// made of core matrices of 8 x 8 16-bit elements, each 8 rows of 16
// contiguous bytes; core matrices are `lbo` bytes apart along K and `sbo`
// bytes apart along M or N. K-major: a core matrix's rows are 8 values of
// M/N, its 16 bytes 8 values of K; MN-major the other way round.
//
// With a swizzle (`sw` = 128, 64 or 32 bytes a row: the PTX ISA's layout
// types 1, 2 and 3) rows are `sw` bytes: K-major, row mn % 8 of an 8-row
// group at byte sw * (mn % 8), groups `sbo` apart, K contiguous within the
// row (a start 32 bytes further per 16 of K); MN-major, row k % 8 at
// sw * (k % 8), groups of 8 k `sbo` apart, sw / 2 MN-values contiguous
// within the row and the next sw / 2 `lbo` bytes further. The byte address
// then has its 16-byte chunk bits (4 and up) XORed with its row bits (7 and
// up), over log2(sw / 16) bits, as the TMA copy wrote it.
static float fs_emu_desc_elem(const unsigned char* p, unsigned lbo, unsigned sbo, unsigned sw, int mn, int k, bool mn_major,
                              bool bf16) {
    const unsigned char* at;
    if (sw == 0) {
        at = p + (mn / 8) * sbo + (k / 8) * lbo + (mn_major ? (k % 8) * 16 + (mn % 8) * 2 : (mn % 8) * 16 + (k % 8) * 2);
    } else {
        if ((sw != 128 && sw != 64 && sw != 32) || (reinterpret_cast<uintptr_t>(p) / sw) % 8 != 0) {
            fprintf(stderr, "wgmma: a swizzled descriptor's matrix does not start on an 8-row boundary\n");
            exit(5);
        }
        const int atom = sw / 2;
        const uintptr_t a = reinterpret_cast<uintptr_t>(p) +
                            (mn_major ? (mn / atom) * lbo + (mn % atom) * 2 + (k % 8) * sw + (k / 8) * sbo
                                      : (mn % 8) * sw + (mn / 8) * sbo + k * 2);
        const uintptr_t mask = sw == 128 ? 7 : sw == 64 ? 3 : 1;
        at = reinterpret_cast<const unsigned char*>(a ^ (((a >> 7) & mask) << 4));
    }
    unsigned short bits;
    memcpy(&bits, at, 2);
    return fs_emu_elem(bits, 0, bf16);
}

// wgmma.wait_group: the warp's lanes meet, so every lane's emulated wgmma
// has read its operands (on the GPU, a wait in any lane means the whole
// operation is done).
static inline void fs_emu_wgmma_wait() { fs_warp_barrier[threadIdx.x >> 5]->arrive_and_wait(); }

// wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16} for one
// thread of a warpgroup: d (this thread's N / 2 accumulators) = A B + (acc ?
// d : 0), A 64 x 16, B 16 x N. Warp w of the warpgroup (threadIdx.x / 32 % 4)
// holds rows 16w .. 16w + 15 of D in the m16n8 accumulator layout, repeated
// for each 8 columns (d[4j + i] at column 8j + that layout's column). A
// comes from registers (`a_regs`: this lane's m16n8k16 A fragment of its
// warp's 16 rows, which needs the warp's other lanes) or through a
// descriptor; B through a descriptor; each K-major or MN-major. The GPU runs it
// asynchronously; here it completes at once, which a correct kernel (one
// that waits before reading d or reusing the operands) cannot tell apart.
static void fs_emu_wgmma(float* d, int n, const unsigned* a_regs, const unsigned char* a_p, unsigned a_lbo, unsigned a_sbo,
                         unsigned a_sw, bool a_mn_major, const unsigned char* b_p, unsigned b_lbo, unsigned b_sbo, unsigned b_sw,
                         bool b_mn_major, bool acc, bool bf16) {
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    for (const unsigned char* p : {a_regs ? b_p : a_p, b_p})
        if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
            fprintf(stderr, "wgmma: a descriptor's matrix does not start 16-byte aligned\n");
            exit(5);
        }
    float A[16][16];
    if (a_regs) {
        int l, p;
        fs_emu_exchange& w = fs_emu_meet(
            FS_EMU_WGMMA_RS, l, p,
            [](fs_emu_exchange& w, int p, int lane, const void* arg) {
                for (int r = 0; r < 4; ++r) w.a[p][lane][r] = static_cast<const unsigned*>(arg)[r];
            },
            a_regs);
        for (int from = 0; from < 32; ++from)
            for (int i = 0; i < 8; ++i) {
                int r, c;
                fs_emu_a_coord(from, i, r, c);
                A[r][c] = fs_emu_elem(w.a[p][from][i / 2], i & 1, bf16);
            }
    } else {
        for (int r = 0; r < 16; ++r)
            for (int k = 0; k < 16; ++k) A[r][k] = fs_emu_desc_elem(a_p, a_lbo, a_sbo, a_sw, 16 * warp + r, k, a_mn_major, bf16);
    }
    for (int i = 0; i < n / 2; ++i) {
        int r, c;
        fs_emu_c_coord(lane, i % 4, r, c);
        const int col = 8 * (i / 4) + c;
        float sum = acc ? d[i] : 0.0f;
        for (int k = 0; k < 16; ++k) sum += A[r][k] * fs_emu_desc_elem(b_p, b_lbo, b_sbo, b_sw, col, k, b_mn_major, bf16);
        d[i] = sum;
    }
}

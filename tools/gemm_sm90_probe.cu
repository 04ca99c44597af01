// kernels/gemm/sm90.cuh beside cuBLASLt on one GPU: the same bf16 products
// (f32 accumulation, bf16 output) at the sizes of BERT-large's step (B = 32,
// T = 512: 16384 rows), every operand layout fusec's GEMMs take, each
// checked against cuBLASLt's output and timed with events (median of 20
// after 5 warm-up runs, inputs uniform in [-1, 1]).
//
// On the GPU machine, from the repository root (prelude first, as fusec's
// generated kernels have it):
//   nvcc -std=c++17 -O3 -arch=sm_90a -I kernels -include kernels/prelude.cuh \
//        tools/gemm_sm90_probe.cu -lcublasLt -lcuda -o /tmp/gemm_probe && /tmp/gemm_probe
#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "gemm/sm90.cuh"

#include "probe_check.h"

struct StoreParams {
    unsigned short* d;
    long long ldd;
};
// The plain epilogue: 8 columns rounded to bf16, one 16-byte store.
struct Store {
    static __device__ __forceinline__ void apply(const StoreParams& p, fs_i64 row, int n, float (&v)[8]) {
        unsigned short out[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) out[e] = fs_to_bf16(v[e]);
        fs_vstore(p.d + row * p.ldd + n, out);
    }
};

template <int BN, bool A_MN, bool B_MN>
__global__ void __launch_bounds__(384, 1)
    probe_gemm(StoreParams p, fs_gemm::Sizes s, const __grid_constant__ fs_tmap ta, const __grid_constant__ fs_tmap tb) {
    fs_gemm::GemmSm90<fs_attn::Bf16, BN, A_MN, B_MN, Store>::run(p, s, ta, tb);
}

// A [outer][inner] bf16 matrix as a 4-D map (inner, 1, outer, 1), boxes of
// 64 x rows, 128-byte swizzle.
static fs_tmap tensor_map(const void* base, long long inner, long long outer, int rows) {
    CUtensorMap m;
    cuuint64_t dims[4] = {(cuuint64_t)inner, 1, (cuuint64_t)outer, 1};
    cuuint64_t strides[3] = {(cuuint64_t)inner * 2, (cuuint64_t)inner * 2, (cuuint64_t)inner * 2 * outer};
    cuuint32_t box[4] = {64, 1, (cuuint32_t)rows, 1}, elem[4] = {1, 1, 1, 1};
    CUresult r = cuTensorMapEncodeTiled(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(base), dims, strides, box, elem,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", (int)r);
        exit(1);
    }
    fs_tmap t;
    memcpy(&t, &m, sizeof t);
    return t;
}

__global__ void fill_uniform(unsigned short* x, long long n, unsigned seed) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13, h *= 3266489917u, h ^= h >> 16;
        x[i] = fs_to_bf16((h >> 8) * (2.0f / 16777216.0f) - 1.0f);
    }
}

struct Case {
    const char* what;
    int m, n, k;
    bool a_mn, b_mn;
};

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <int BN, bool A_MN, bool B_MN>
static float run_ours(const Case& c, const unsigned short* a, const unsigned short* b, unsigned short* d, int sms,
                      cudaStream_t st, std::vector<float>* times) {
    typedef fs_gemm::GemmSm90<fs_attn::Bf16, BN, A_MN, B_MN, Store> G;
    const fs_tmap ta = A_MN ? tensor_map(a, c.m, c.k, G::BK) : tensor_map(a, c.k, c.m, G::BM);
    const fs_tmap tb = B_MN ? tensor_map(b, c.n, c.k, G::BK) : tensor_map(b, c.k, c.n, BN);
    CHECK(cudaFuncSetAttribute(probe_gemm<BN, A_MN, B_MN>, cudaFuncAttributeMaxDynamicSharedMemorySize, G::SMEM_BYTES));
    const int tiles = ((c.m + G::BM - 1) / G::BM) * ((c.n + BN - 1) / BN);
    const int grid = std::min(tiles, sms);
    StoreParams p{d, c.n};
    fs_gemm::Sizes s{c.m, c.n, c.k};
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < 25; ++i) {
        CHECK(cudaEventRecord(e0, st));
        probe_gemm<BN, A_MN, B_MN><<<grid, G::THREADS, G::SMEM_BYTES, st>>>(p, s, ta, tb);
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(e1, st));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 5) times->push_back(ms);
    }
    return median(*times);
}

static float run_cublas(cublasLtHandle_t h, const Case& c, const unsigned short* a, const unsigned short* b, unsigned short* d,
                        void* ws, size_t ws_bytes, cudaStream_t st) {
    // Row-major D[M, N] = A B as column-major D^T[N, M] = op(B)^T op(A)^T.
    cublasLtMatmulDesc_t desc;
    CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t ta = c.b_mn ? CUBLAS_OP_N : CUBLAS_OP_T, tb = c.a_mn ? CUBLAS_OP_T : CUBLAS_OP_N;
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    cublasLtMatrixLayout_t la, lb, ld;
    // First operand: B as stored, column-major: [N, K] ld N when MN-major, else [K, N] ld K.
    CHECK_LT(c.b_mn ? cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, c.n, c.k, c.n)
                    : cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, c.k, c.n, c.k));
    CHECK_LT(c.a_mn ? cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, c.m, c.k, c.m)
                    : cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, c.k, c.m, c.k));
    CHECK_LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, c.n, c.m, c.n));
    cublasLtMatmulPreference_t pref;
    CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
    CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    CHECK_LT(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 1, &res, &found));
    if (!found) {
        fprintf(stderr, "no cuBLASLt algorithm\n");
        exit(1);
    }
    const float alpha = 1.0f, beta = 0.0f;
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> times;
    for (int i = 0; i < 25; ++i) {
        CHECK(cudaEventRecord(e0, st));
        CHECK_LT(cublasLtMatmul(h, desc, &alpha, b, la, a, lb, &beta, d, ld, d, ld, &res.algo, ws, ws_bytes, st));
        CHECK(cudaEventRecord(e1, st));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 5) times.push_back(ms);
    }
    return median(times);
}

static double bf16_to_double(unsigned short x) {
    unsigned u = (unsigned)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

template <int BN, bool A_MN, bool B_MN>
static void one(cublasLtHandle_t h, const Case& c, int sms, void* ws, size_t ws_bytes, cudaStream_t st) {
    unsigned short *a, *b, *d, *ref;
    const size_t na = (size_t)c.m * c.k, nb = (size_t)c.k * c.n, nd = (size_t)c.m * c.n;
    CHECK(cudaMalloc(&a, na * 2));
    CHECK(cudaMalloc(&b, nb * 2));
    CHECK(cudaMalloc(&d, nd * 2));
    CHECK(cudaMalloc(&ref, nd * 2));
    fill_uniform<<<1024, 256, 0, st>>>(a, na, 0x1234u + c.m);
    fill_uniform<<<1024, 256, 0, st>>>(b, nb, 0x9876u + c.n);
    CHECK(cudaMemsetAsync(d, 0xff, nd * 2, st));  // NaN: every element must be written
    const float t_ref = run_cublas(h, c, a, b, ref, ws, ws_bytes, st);
    std::vector<float> times;
    const float t = run_ours<BN, A_MN, B_MN>(c, a, b, d, sms, st, &times);
    std::vector<unsigned short> hd(nd), hr(nd);
    CHECK(cudaMemcpy(hd.data(), d, nd * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hr.data(), ref, nd * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0, worst = 0;
    size_t bad = 0;
    for (size_t i = 0; i < nd; ++i) {
        const double x = bf16_to_double(hd[i]), y = bf16_to_double(hr[i]);
        if (!std::isfinite(x)) ++bad;
        num += (x - y) * (x - y), den += y * y;
        worst = std::max(worst, std::fabs(x - y));
    }
    const double rel = std::sqrt(num / den), flop = 2.0 * c.m * c.n * c.k;
    // Both round the same f32 sums to bf16 (2^-9 relative), summed in other
    // orders: their difference is a rounding step here and there, far
    // under 1e-3 of the norm; a wrong tile or layout is O(1).
    const bool ok = bad == 0 && rel < 1e-3;
    printf("%-34s BN=%d %s%s M=%5d N=%5d K=%5d  ours %8.1f us %6.1f TFLOP/s  cuBLASLt %8.1f us %6.1f TFLOP/s  ratio %.3f  rel %.1e max %.1e %s\n",
           c.what, BN, A_MN ? "A:MN " : "A:K  ", B_MN ? "B:MN" : "B:K ", c.m, c.n, c.k, t * 1e3, flop / t / 1e9, t_ref * 1e3,
           flop / t_ref / 1e9, t_ref / t, rel, worst, ok ? "ok" : (bad ? "UNWRITTEN" : "WRONG"));
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
    CHECK(cudaFree(d));
    CHECK(cudaFree(ref));
}

template <int BN>
static void layouts(cublasLtHandle_t h, const Case& c, int sms, void* ws, size_t ws_bytes, cudaStream_t st) {
    if (c.a_mn && c.b_mn) one<BN, true, true>(h, c, sms, ws, ws_bytes, st);
    else if (c.a_mn) one<BN, true, false>(h, c, sms, ws, ws_bytes, st);
    else if (c.b_mn) one<BN, false, true>(h, c, sms, ws, ws_bytes, st);
    else one<BN, false, false>(h, c, sms, ws, ws_bytes, st);
}

int main() {
    CHECK(cudaFree(0));
    int dev, sms;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, dev));
    printf("%s, %d multiprocessors\n", prop.name, sms);
    cublasLtHandle_t h;
    CHECK_LT(cublasLtCreate(&h));
    size_t ws_bytes = 32u << 20;
    void* ws;
    CHECK(cudaMalloc(&ws, ws_bytes));
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st));
    const Case cases[] = {
        {"ffn in: x W1 (W1 [K, N])", 16384, 4096, 1024, false, true},
        {"ffn out: h W2", 16384, 1024, 4096, false, true},
        {"q, k, v, out projections", 16384, 1024, 1024, false, true},
        {"ffn out's input grad: dy W2^T", 16384, 4096, 1024, false, false},
        {"ffn in's input grad: dh W1^T", 16384, 1024, 4096, false, false},
        {"weight grad: x^T dh", 1024, 4096, 16384, true, true},
        {"odd sizes: 1000 x 1048 x 776", 1000, 1048, 776, false, true},
    };
    for (const Case& c : cases) layouts<256>(h, c, sms, ws, ws_bytes, st);
    for (const Case& c : cases) layouts<128>(h, c, sms, ws, ws_bytes, st);
    return 0;
}

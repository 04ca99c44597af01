// How much cuBLASLt's first heuristic choice leaves on the table: for the
// GEMMs of BERT-large's step (B = 32, T = 512: 16384 rows) and gpt2-small's
// (B = 8, T = 1024: 8192 rows), every algorithm cuBLASLt's heuristic offers
// (up to 16, within fusec's 32 MiB workspace) is timed on the same buffers,
// and the first choice (what fusec runs) is put beside the fastest.
//
// Timing: 3 launches to warm, then 7 rounds of 10 back-to-back launches
// between two events; the median round over 10. Inputs uniform in [-1, 1].
//
// On the GPU machine, from the repository root:
//   nvcc -std=c++17 -O3 -arch=sm_90a tools/cublaslt_tuning_probe.cu -lcublasLt -o /tmp/tp && /tmp/tp
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "probe_check.h"

// Row-major D[M, N] = A[M, K] B[K, N]; a_mn: A stored [K, M]; b_nk: B stored
// [N, K] (K-major); f32_out: D in f32 (fusec's weight gradients); bias: a
// bias epilogue over N; calls: how many of it one step runs.
struct Case {
    const char* name;
    long long m, n, k;
    bool a_mn, b_nk, f32_out, bias;
    int calls;
};

static const Case CASES[] = {
    // BERT-large, B = 32, T = 512, 24 layers.
    {"bert qkv fwd", 16384, 3072, 1024, false, false, false, true, 24},
    {"bert out-proj fwd", 16384, 1024, 1024, false, false, false, true, 24},
    {"bert ffn-in fwd", 16384, 4096, 1024, false, false, false, true, 24},
    {"bert ffn-out fwd", 16384, 1024, 4096, false, false, false, true, 24},
    {"bert ffn-out dX", 16384, 4096, 1024, false, true, false, false, 24},
    {"bert ffn-in dX", 16384, 1024, 4096, false, true, false, false, 24},
    {"bert out-proj dX", 16384, 1024, 1024, false, true, false, false, 24},
    {"bert qkv dX", 16384, 1024, 3072, false, true, false, false, 24},
    {"bert ffn-out dW", 4096, 1024, 16384, true, false, true, false, 24},
    {"bert ffn-in dW", 1024, 4096, 16384, true, false, true, false, 24},
    {"bert out-proj dW", 1024, 1024, 16384, true, false, true, false, 24},
    {"bert qkv dW", 1024, 3072, 16384, true, false, true, false, 24},
    // gpt2-small, B = 8, T = 1024, 12 layers; the LM head against wte [V, d].
    {"gpt2 qkv fwd", 8192, 2304, 768, false, false, false, true, 12},
    {"gpt2 proj fwd", 8192, 768, 768, false, false, false, true, 12},
    {"gpt2 fc fwd", 8192, 3072, 768, false, false, false, true, 12},
    {"gpt2 fc-proj fwd", 8192, 768, 3072, false, false, false, true, 12},
    {"gpt2 lm head fwd", 8192, 50304, 768, false, true, false, false, 1},
    {"gpt2 lm head dX", 8192, 768, 50304, false, false, false, false, 1},
    {"gpt2 lm head dW", 50304, 768, 8192, true, false, true, false, 1},
    {"gpt2 fc dX", 8192, 768, 3072, false, true, false, false, 12},
    {"gpt2 fc dW", 768, 3072, 8192, true, false, true, false, 12},
    {"gpt2 qkv dW", 768, 2304, 8192, true, false, true, false, 12},
};

static float time_algo(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                       cublasLtMatrixLayout_t ld, const void* a, const void* b, void* d, const cublasLtMatmulAlgo_t* algo,
                       void* ws, size_t ws_bytes, cudaStream_t st) {
    const float alpha = 1.0f, beta = 0.0f;
    auto launch = [&]() {
        return cublasLtMatmul(h, desc, &alpha, b, la, a, lb, &beta, d, ld, d, ld, algo, ws, ws_bytes, st);
    };
    for (int i = 0; i < 3; ++i)
        if (launch() != CUBLAS_STATUS_SUCCESS) return -1.0f;
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> rounds;
    for (int r = 0; r < 7; ++r) {
        CHECK(cudaEventRecord(e0, st));
        for (int i = 0; i < 10; ++i) CHECK_LT(launch());
        CHECK(cudaEventRecord(e1, st));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        rounds.push_back(ms / 10.0f);
    }
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    std::sort(rounds.begin(), rounds.end());
    return rounds[rounds.size() / 2];
}

__global__ void fill(unsigned short* x, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned v = (unsigned)i * 2654435761u ^ seed;
        v ^= v >> 13;
        v *= 0x5bd1e995u;
        v ^= v >> 15;
        const float f = (float)(v & 0xffffff) / 8388608.0f - 1.0f;
        unsigned u = __float_as_uint(f);
        x[i] = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
}

int main() {
    cublasLtHandle_t h;
    CHECK_LT(cublasLtCreate(&h));
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st));
    const size_t ws_bytes = 32u << 20;
    void* ws;
    CHECK(cudaMalloc(&ws, ws_bytes));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("# %s, cuBLASLt %zu\n", prop.name, cublasLtGetVersion());
    printf("%-20s %6s %6s %6s  %9s %9s %6s %5s  %s\n", "case", "M", "N", "K", "first us", "best us", "gain", "algos", "best's index");
    double first_total = 0.0, best_total = 0.0;
    for (const Case& c : CASES) {
        const size_t na = (size_t)c.m * c.k, nb = (size_t)c.k * c.n, nd = (size_t)c.m * c.n;
        unsigned short *a, *b;
        void* d;
        CHECK(cudaMalloc(&a, na * 2));
        CHECK(cudaMalloc(&b, nb * 2));
        CHECK(cudaMalloc(&d, nd * (c.f32_out ? 4 : 2)));
        void* bias = nullptr;
        CHECK(cudaMalloc(&bias, c.n * 2));
        fill<<<1024, 256, 0, st>>>(a, na, 1);
        fill<<<1024, 256, 0, st>>>(b, nb, 2);
        fill<<<64, 256, 0, st>>>((unsigned short*)bias, c.n, 3);
        cublasLtMatmulDesc_t desc;
        CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        // Column-major D^T[N, M] = op(B) op(A) with our B first.
        cublasOperation_t ta = c.b_nk ? CUBLAS_OP_T : CUBLAS_OP_N, tb = c.a_mn ? CUBLAS_OP_T : CUBLAS_OP_N;
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
        CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        if (c.bias) {
            cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
            CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
            CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
        }
        cublasLtMatrixLayout_t la, lb, ld;
        // B stored [K, N] row-major = column-major [N, K] ld N (op N); stored [N, K] = column-major [K, N] ld K (op T).
        CHECK_LT(c.b_nk ? cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, c.k, c.n, c.k)
                        : cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, c.n, c.k, c.n));
        // A stored [M, K] = column-major [K, M] ld K (op N); stored [K, M] = column-major [M, K] ld M (op T).
        CHECK_LT(c.a_mn ? cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, c.m, c.k, c.m)
                        : cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, c.k, c.m, c.k));
        CHECK_LT(cublasLtMatrixLayoutCreate(&ld, c.f32_out ? CUDA_R_32F : CUDA_R_16BF, c.n, c.m, c.n));
        cublasLtMatmulPreference_t pref;
        CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
        CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
        cublasLtMatmulHeuristicResult_t res[16];
        int found = 0;
        CHECK_LT(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 16, res, &found));
        float first = -1.0f, best = 1e30f;
        int best_i = -1;
        for (int i = 0; i < found; ++i) {
            const float t = time_algo(h, desc, la, lb, ld, a, b, d, &res[i].algo, ws, ws_bytes, st);
            if (i == 0) first = t;
            if (t > 0 && t < best) best = t, best_i = i;
        }
        printf("%-20s %6lld %6lld %6lld  %9.1f %9.1f %5.1f%% %5d  %d\n", c.name, c.m, c.n, c.k, first * 1e3, best * 1e3,
               100.0 * (first - best) / first, found, best_i);
        first_total += (double)first * c.calls;
        best_total += (double)best * c.calls;
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(ld);
        cublasLtMatmulDescDestroy(desc);
        CHECK(cudaFree(a));
        CHECK(cudaFree(b));
        CHECK(cudaFree(d));
        CHECK(cudaFree(bias));
    }
    printf("# weighted by calls a step (both models together): first %.3f ms, best %.3f ms\n", first_total, best_total);
    return 0;
}

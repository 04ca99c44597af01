// Which cuBLASLt epilogues sum a bias gradient inside gpt2-small's backward
// products, in which types, and at what cost (BGRADA on the weight
// gradients x^T @ dy with an f32 or bf16 bias and D; DGELU against
// DGELU_BGRAD on the MLP's input gradient), at B x T = 8192 rows, each the
// best of the heuristic's 8 algorithms. tools/cublaslt_bgrad_probe.cu
// checks BGRADA's sums bit for bit at other shapes. On a GPU machine:
//   nvcc -O2 -arch=sm_90a -I$CUDA/include -L$CUDA/lib -o /tmp/ep \
//     tools/cublaslt_epilogue_types_probe.cu -lcublasLt && /tmp/ep
// docs/benchmarks.md (2026-12-07, second session) has its H100 figures.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cmath>
#define CK(x) do { cudaError_t e = (x); if (e) { printf("cuda %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
static cublasLtHandle_t H;
static void* ws; static size_t WS = 32u << 20;
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned s) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)(i * 2654435761u) ^ s; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f));
  }
}
// col-major: D[m x n] = op(A) op(B), k
static void run(const char* name, int m, int n, int k, cublasOperation_t ta, cublasOperation_t tb,
                cudaDataType_t dtype, cublasLtEpilogue_t epi, cudaDataType_t biastype, bool check_rows_of_A) {
  size_t asz = (size_t)m * k, bsz = (size_t)k * n, dsz = (size_t)m * n;
  __nv_bfloat16 *A, *B, *aux; void *D, *bias;
  CK(cudaMalloc(&A, asz * 2)); CK(cudaMalloc(&B, bsz * 2)); CK(cudaMalloc(&D, dsz * 4)); CK(cudaMalloc(&aux, dsz * 2));
  CK(cudaMalloc(&bias, (size_t)(m > n ? m : n) * 4));
  fill<<<1024, 256>>>(A, asz, 1); fill<<<1024, 256>>>(B, bsz, 2); fill<<<1024, 256>>>(aux, dsz, 3);
  cublasLtMatmulDesc_t desc; cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
  cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi);
  if (epi != CUBLASLT_EPILOGUE_DEFAULT && epi != CUBLASLT_EPILOGUE_DGELU) {
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &biastype, sizeof biastype);
  }
  if (epi == CUBLASLT_EPILOGUE_DGELU || epi == CUBLASLT_EPILOGUE_DGELU_BGRAD) {
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux);
    int64_t ld = m; cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld);
  }
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, ta == CUBLAS_OP_N ? m : k);
  cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, tb == CUBLAS_OP_N ? k : n);
  cublasLtMatrixLayoutCreate(&ld, dtype, m, n, m);
  cublasLtMatmulPreference_t pref; cublasLtMatmulPreferenceCreate(&pref);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &WS, sizeof WS);
  cublasLtMatmulHeuristicResult_t r[8]; int got = 0;
  cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(H, desc, la, lb, ld, ld, pref, 8, r, &got);
  if (st || !got) { printf("%-44s m=%d n=%d k=%d: no algorithm (status %d, %d found)\n", name, m, n, k, (int)st, got); return; }
  float one = 1, zero = 0; float best = 1e9; int bi = -1;
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int a = 0; a < got; ++a) {
    if (cublasLtMatmul(H, desc, &one, A, la, B, lb, &zero, D, ld, D, ld, &r[a].algo, ws, WS, 0)) continue;
    cudaEventRecord(e0);
    for (int i = 0; i < 50; ++i) cublasLtMatmul(H, desc, &one, A, la, B, lb, &zero, D, ld, D, ld, &r[a].algo, ws, WS, 0);
    cudaEventRecord(e1); CK(cudaEventSynchronize(e1)); float ms; cudaEventElapsedTime(&ms, e0, e1);
    if (ms / 50 < best) { best = ms / 50; bi = a; }
  }
  double tf = 2.0 * m * n * k / (best * 1e-3) / 1e12;
  printf("%-44s m=%d n=%d k=%d: %7.1f us (%5.0f TFLOP/s, best of %d algos, #%d)", name, m, n, k, best * 1e3, tf, got, bi);
  if (check_rows_of_A && epi == CUBLASLT_EPILOGUE_BGRADA && biastype == CUDA_R_32F) {
    // bias[i] = sum_k op(A)[i, k]; A stored col-major m x k (ta = N)
    std::vector<__nv_bfloat16> h(asz); std::vector<float> b(m);
    cudaMemcpy(h.data(), A, asz * 2, cudaMemcpyDeviceToHost); cudaMemcpy(b.data(), bias, m * 4, cudaMemcpyDeviceToHost);
    double worst = 0;
    for (int i = 0; i < m; i += 97) { double s = 0; for (int q = 0; q < k; ++q) s += __bfloat162float(h[(size_t)q * m + i]); worst = fmax(worst, fabs(s - b[i])); }
    printf("  bias check max|err| %.3g", worst);
  }
  printf("\n");
  cudaFree(A); cudaFree(B); cudaFree(D); cudaFree(aux); cudaFree(bias);
}
int main() {
  cublasLtCreate(&H); CK(cudaMalloc(&ws, WS));
  int BT = 8192;
  // weight gradients: dW^T[out x in] = dY^T (A: out x BT, stored col-major = row-major dY[BT, out]) . X (B: BT x in, op T of col-major in x BT)
  int outs[4] = {2304, 768, 3072, 768}, ins[4] = {768, 768, 768, 3072};
  for (int c = 0; c < 4; ++c) {
    char nm[64];
    snprintf(nm, 64, "dW out=%d in=%d default f32", outs[c], ins[c]);
    run(nm, outs[c], ins[c], BT, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_32F, CUBLASLT_EPILOGUE_DEFAULT, CUDA_R_32F, false);
    snprintf(nm, 64, "dW out=%d in=%d BGRADA f32 bias f32", outs[c], ins[c]);
    run(nm, outs[c], ins[c], BT, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_32F, CUBLASLT_EPILOGUE_BGRADA, CUDA_R_32F, true);
    snprintf(nm, 64, "dW out=%d in=%d BGRADA f32 bias bf16", outs[c], ins[c]);
    run(nm, outs[c], ins[c], BT, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_32F, CUBLASLT_EPILOGUE_BGRADA, CUDA_R_16BF, false);
    snprintf(nm, 64, "dW out=%d in=%d BGRADA bf16 out", outs[c], ins[c]);
    run(nm, outs[c], ins[c], BT, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_16BF, CUBLASLT_EPILOGUE_BGRADA, CUDA_R_16BF, false);
  }
  // fc1's input gradient: dPre^T[3072 x BT] = W2 (op T of col-major 768 x 3072) . dY^T (768 x BT)
  run("dPre DGELU bf16", 3072, BT, 768, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_16BF, CUBLASLT_EPILOGUE_DGELU, CUDA_R_32F, false);
  run("dPre DGELU_BGRAD bf16 bias f32", 3072, BT, 768, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_16BF, CUBLASLT_EPILOGUE_DGELU_BGRAD, CUDA_R_32F, false);
  run("dPre DGELU_BGRAD bf16 bias bf16", 3072, BT, 768, CUBLAS_OP_T, CUBLAS_OP_N, CUDA_R_16BF, CUBLASLT_EPILOGUE_DGELU_BGRAD, CUDA_R_16BF, false);
  return 0;
}

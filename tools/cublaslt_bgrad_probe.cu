// Probe: whether cuBLASLt's CUBLASLT_EPILOGUE_BGRADA can take the bias
// gradient (dY's column sums, f32) inside the weight-gradient GEMM
// dW[in, out] = X^T dY (row-major, bf16 in, f32 out) the way
// runtime/src/gemm.rs lays it out (our B = cuBLASLt's A, TRANSA = N), how
// much slower that GEMM gets, whether the sums are right and whether they
// repeat bit for bit. On an H200 (2026-11-29, docs/benchmarks.md) the sums
// were exact and repeatable and the products slower, e.g. 768 x 3072 from
// 105.8 to 150.7 us.
//
//   nvcc -O2 -o /tmp/bgrad tools/cublaslt_bgrad_probe.cu -lcublasLt && /tmp/bgrad
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x) do { auto s = (x); if ((int)s) { printf("%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)s); exit(1);} } while (0)
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f));
  }
}
__global__ void colsum(const __nv_bfloat16* y, int rows, int cols, double* out) {
  int c = blockIdx.x * blockDim.x + threadIdx.x; if (c >= cols) return;
  double s = 0; for (int r = 0; r < rows; ++r) s += (double)__bfloat162float(y[(size_t)r * cols + c]); out[c] = s;
}
int main() {
  cublasLtHandle_t h; CK(cublasLtCreate(&h));
  size_t ws_bytes = 32 << 20; void* ws; cudaMalloc(&ws, ws_bytes);
  const long BT = 16384;
  int shapes[][2] = {{1024, 1024}, {1024, 4096}, {4096, 1024}, {1024, 3072}, {768, 768}, {768, 3072}, {3072, 768}};
  for (auto& sh : shapes) {
    long in = sh[0], out = sh[1];
    __nv_bfloat16 *x, *dy; float *dw, *db; double* ref;
    cudaMalloc(&x, BT * in * 2); cudaMalloc(&dy, BT * out * 2); cudaMalloc(&dw, in * out * 4); cudaMalloc(&db, out * 4); cudaMalloc(&ref, out * 8);
    fill<<<1024, 256>>>(x, BT * in, 1); fill<<<1024, 256>>>(dy, BT * out, 2);
    colsum<<<(out + 255) / 256, 256>>>(dy, BT, out, ref);
    for (int mode = 0; mode < 2; ++mode) {
      cublasLtMatmulDesc_t d; CK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
      // column-major: D (out x in) = A (out x BT, dy, N) * B (BT x in, x stored in x BT, T)
      cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_T;
      CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
      CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
      cublasLtEpilogue_t ep = mode == 0 ? CUBLASLT_EPILOGUE_DEFAULT : CUBLASLT_EPILOGUE_BGRADA;
      CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep));
      if (mode) {
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &db, sizeof db));
        cudaDataType bt = CUDA_R_32F;
        CK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
      }
      cublasLtMatrixLayout_t la, lb, lc;
      CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, out, BT, out));
      CK(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, in, BT, in));
      CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, out, in, out));
      cublasLtMatmulPreference_t pref; CK(cublasLtMatmulPreferenceCreate(&pref));
      CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
      cublasLtMatmulHeuristicResult_t res[8]; int n = 0;
      auto st = cublasLtMatmulAlgoGetHeuristic(h, d, la, lb, lc, lc, pref, 8, res, &n);
      if (st || n == 0) { printf("in=%ld out=%ld mode=%d: no algorithm (status %d)\n", in, out, mode, (int)st); continue; }
      float alpha = 1, beta = 0;
      cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
      for (int a = 0; a < (n < 3 ? n : 3); ++a) {
        for (int w = 0; w < 5; ++w) CK(cublasLtMatmul(h, d, &alpha, dy, la, x, lb, &beta, dw, lc, dw, lc, &res[a].algo, ws, ws_bytes, 0));
        cudaEventRecord(e0);
        const int R = 50;
        for (int r = 0; r < R; ++r) CK(cublasLtMatmul(h, d, &alpha, dy, la, x, lb, &beta, dw, lc, dw, lc, &res[a].algo, ws, ws_bytes, 0));
        cudaEventRecord(e1); cudaEventSynchronize(e1);
        float ms; cudaEventElapsedTime(&ms, e0, e1);
        double err = 0, mx = 0;
        if (mode) {
          std::vector<float> hb(out); std::vector<double> hr(out);
          cudaMemcpy(hb.data(), db, out * 4, cudaMemcpyDeviceToHost); cudaMemcpy(hr.data(), ref, out * 8, cudaMemcpyDeviceToHost);
          for (long c = 0; c < out; ++c) { err = fmax(err, fabs(hb[c] - hr[c])); mx = fmax(mx, fabs(hr[c])); }
        }
        // determinism: run twice, compare bias bits
        bool same = true;
        if (mode) {
          std::vector<float> a1(out), a2(out);
          cudaMemcpy(a1.data(), db, out * 4, cudaMemcpyDeviceToHost);
          CK(cublasLtMatmul(h, d, &alpha, dy, la, x, lb, &beta, dw, lc, dw, lc, &res[a].algo, ws, ws_bytes, 0));
          cudaMemcpy(a2.data(), db, out * 4, cudaMemcpyDeviceToHost);
          for (long c = 0; c < out; ++c) same &= a1[c] == a2[c];
        }
        printf("in=%ld out=%ld BT=%ld %s algo%d: %.1f us  %.0f TFLOP/s  bias max err %.3g of max %.3g  repeat-identical %d\n", in, out, BT,
               mode ? "BGRADA f32" : "default   ", a, 1000 * ms / R, 2.0 * BT * in * out / (ms / R * 1e-3) / 1e12, err, mx, (int)same);
      }
      cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(lc);
      cublasLtMatmulPreferenceDestroy(pref); cublasLtMatmulDescDestroy(d);
    }
    cudaFree(x); cudaFree(dy); cudaFree(dw); cudaFree(db); cudaFree(ref);
  }
  printf("done\n");
}

// cublaslt_candidates.cu - diagnostic, not part of the library: which algorithms cuBLASLt's
// heuristic offers for one Linear-fprop GEMM (TN, D[M,N] = X[M,K] W[N,K]^T, bf16 output)
// under four preference settings (workspace only; + reduction scheme; + 256-byte alignment;
// both, as core/cuda/gemm.cpp asks), whether each candidate's output is bit-identical to the
// first's, and how fast each runs (1 ms spin, then 8 back-to-back calls between CUDA events,
// as benchmarks/gpu_harness.time_ms; median of 30, median of 5 rounds over all candidates).
//   nvcc -std=c++17 -O2 -arch=sm_90 benchmarks/cublaslt_candidates.cu -lcublasLt -o /tmp/cand
//   /tmp/cand fp8|bf16 M N K [candidates=8] [B scale offset in floats=64]
// (run_on_device.sh's `candidates` step). The last argument places B's scale pointer: 1 or 2
// (4/8-byte aligned) made cuBLASLt 13.1's FP8 matmul return NOT_SUPPORTED on the H100.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <string>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("cuda %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
#define LT(x) do { cublasStatus_t s = (x); if (s != CUBLAS_STATUS_SUCCESS) { printf("cublas %d line %d\n", (int)s, __LINE__); exit(1);} } while (0)

__device__ float rnd(unsigned long long i, unsigned seed) {
  unsigned long long x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33;
  float u = 0;
  for (int j = 0; j < 4; ++j) { x ^= x >> 29; x *= 0xbf58476d1ce4e5b9ull; x ^= x >> 32; u += (x >> 40) / float(1 << 24); }
  return (u - 2.f) * 1.7320508f;  // mean 0, variance 1
}
__global__ void spin(long long cycles) { long long t0 = clock64(); while (clock64() - t0 < cycles) {} }
__global__ void fill_fp8(__nv_fp8_e4m3 *p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = __nv_fp8_e4m3(2.f * rnd(i, seed));
}
__global__ void fill_bf16(__nv_bfloat16 *p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = __float2bfloat16(rnd(i, seed));
}

struct Cfg { int id, tile, stages, splitk, red, swz, custom, cluster, inner; };
Cfg cfg_of(const cublasLtMatmulAlgo_t &a) {
  Cfg c{}; size_t w;
  auto g = [&](cublasLtMatmulAlgoConfigAttributes_t at, int *v) { uint32_t t = 0; cublasLtMatmulAlgoConfigGetAttribute(&a, at, &t, sizeof(t), &w); *v = (int)t; };
  g(CUBLASLT_ALGO_CONFIG_ID, &c.id); g(CUBLASLT_ALGO_CONFIG_TILE_ID, &c.tile); g(CUBLASLT_ALGO_CONFIG_STAGES_ID, &c.stages);
  g(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &c.splitk); g(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &c.red);
  g(CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &c.swz); g(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &c.custom);
  g(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &c.cluster); g(CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &c.inner);
  return c;
}

int main(int argc, char **argv) {
  bool fp8 = argc > 1 && !strcmp(argv[1], "fp8");
  long M = argc > 2 ? atol(argv[2]) : 8192, N = argc > 3 ? atol(argv[3]) : 4096, K = argc > 4 ? atol(argv[4]) : 16384;
  int top = argc > 5 ? atoi(argv[5]) : 8;
  cublasLtHandle_t h; LT(cublasLtCreate(&h));
  size_t esz = fp8 ? 1 : 2, wsb = 32u << 20;
  const int SETS = 3;
  void *A[SETS], *B[SETS], *D[SETS], *ws; float *sc;
  for (int s = 0; s < SETS; ++s) {
    CK(cudaMalloc(&A[s], N * K * esz)); CK(cudaMalloc(&B[s], M * K * esz)); CK(cudaMalloc(&D[s], M * N * 2));
    if (fp8) { fill_fp8<<<1024, 256>>>((__nv_fp8_e4m3 *)A[s], N * K, 1 + s); fill_fp8<<<1024, 256>>>((__nv_fp8_e4m3 *)B[s], M * K, 7 + s); }
    else { fill_bf16<<<1024, 256>>>((__nv_bfloat16 *)A[s], N * K, 1 + s); fill_bf16<<<1024, 256>>>((__nv_bfloat16 *)B[s], M * K, 7 + s); }
  }
  CK(cudaMalloc(&ws, wsb)); CK(cudaMalloc(&sc, 1024)); { float hs[256]; for (int i = 0; i < 256; ++i) hs[i] = i ? 0.25f : 0.5f; CK(cudaMemcpy(sc, hs, 1024, cudaMemcpyHostToDevice)); }
  cudaDataType_t ti = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasLtMatmulDesc_t desc; LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  int32_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, 4));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, 4));
  if (fp8) {
    int8_t fa = 1; LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, 1));
    float *sa = sc, *sb = sc + (argc > 6 ? atoi(argv[6]) : 64);
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, 8));
    LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, 8));
  }
  cublasLtMatrixLayout_t la, lb, lc;
  LT(cublasLtMatrixLayoutCreate(&la, ti, K, N, K)); LT(cublasLtMatrixLayoutCreate(&lb, ti, K, M, K));
  LT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  float alpha = 1, beta = 0;
  auto run_ok = [&](const cublasLtMatmulAlgo_t *algo) {
    cublasLtMatmulHeuristicResult_t chk{};
    cublasStatus_t st = cublasLtMatmulAlgoCheck(h, desc, la, lb, lc, lc, algo, &chk);
    if (st != CUBLAS_STATUS_SUCCESS) { printf("  algo check failed: %d\n", (int)st); return false; }
    st = cublasLtMatmul(h, desc, &alpha, A[0], la, B[0], lb, &beta, D[0], lc, D[0], lc, algo, ws, wsb, 0);
    if (st != CUBLAS_STATUS_SUCCESS) { printf("  matmul failed: %d (ws needed %zu)\n", (int)st, chk.workspaceSize); return false; }
    CK(cudaDeviceSynchronize()); return true;
  };
  std::vector<unsigned short> ref(M * N), got(M * N);
  auto time_algo = [&](const cublasLtMatmulAlgo_t *algo) {
    const int inner = 8;
    for (int i = 0; i < 10; ++i) LT(cublasLtMatmul(h, desc, &alpha, A[i % SETS], la, B[i % SETS], lb, &beta, D[i % SETS], lc, D[i % SETS], lc, algo, ws, wsb, 0));
    std::vector<float> t;
    for (int r = 0; r < 30; ++r) {
      spin<<<1, 1>>>(2000000);
      CK(cudaEventRecord(e0));
      for (int j = 0; j < inner; ++j) { int i = r * inner + j; LT(cublasLtMatmul(h, desc, &alpha, A[i % SETS], la, B[i % SETS], lb, &beta, D[i % SETS], lc, D[i % SETS], lc, algo, ws, wsb, 0)); }
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms / inner);
    }
    std::sort(t.begin(), t.end()); return t[t.size() / 2];
  };
  const char *modes[4] = {"ws only", "ws+reduction=compute", "ws+align256", "ws+reduction+align256 (ours)"};
  std::vector<cublasLtMatmulAlgo_t> all; std::vector<std::string> from;
  for (int mode = 0; mode < 4; ++mode) {
    cublasLtMatmulPreference_t pref; LT(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t w64 = wsb; LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &w64, 8));
    if (mode & 1) { uint32_t r = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE; LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &r, 4)); }
    if (mode & 2) for (auto at : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) { uint32_t a = 256; LT(cublasLtMatmulPreferenceSetAttribute(pref, at, &a, 4)); }
    std::vector<cublasLtMatmulHeuristicResult_t> res(top); int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lc, lc, pref, top, res.data(), &found));
    printf("== %s: %d results\n", modes[mode], found);
    for (int i = 0; i < found; ++i) {
      Cfg c = cfg_of(res[i].algo);
      printf("  #%d id %d tile %d stages %d splitk %d red %d swz %d custom %d cluster %d inner %d ws %zu waves %.3f\n", i, c.id, c.tile, c.stages, c.splitk, c.red, c.swz, c.custom, c.cluster, c.inner, res[i].workspaceSize, res[i].wavesCount);
      all.push_back(res[i].algo); from.push_back(std::string(modes[mode]) + " #" + std::to_string(i));
    }
    cublasLtMatmulPreferenceDestroy(pref);
  }
  // time each distinct algo, 3 rounds, report median of round medians
  std::vector<int> uniq;
  for (size_t i = 0; i < all.size(); ++i) {
    bool dup = false;
    for (int j : uniq) if (!memcmp(&all[i], &all[j], sizeof(cublasLtMatmulAlgo_t))) dup = true;
    if (!dup) uniq.push_back((int)i);
  }
  std::vector<int> ok;
  for (size_t u = 0; u < uniq.size(); ++u) {
    if (!run_ok(&all[uniq[u]])) continue;
    CK(cudaMemcpy(ok.empty() ? ref.data() : got.data(), D[0], M * N * 2, cudaMemcpyDeviceToHost));
    if (!ok.empty()) { long diff = 0; for (long i = 0; i < M * N; ++i) diff += ref[i] != got[i]; printf("  %s: %ld of %ld outputs differ from the first\n", from[uniq[u]].c_str(), diff, M * N); }
    ok.push_back(uniq[u]);
  }
  uniq = ok;
  std::vector<std::vector<float>> r(uniq.size());
  for (int round = 0; round < 5; ++round) for (size_t u = 0; u < uniq.size(); ++u) r[u].push_back(time_algo(&all[uniq[u]]));
  double flop = 2.0 * M * N * K;
  printf("%s M=%ld N=%ld K=%ld, median of 5 round medians (30 batches of 8 calls each):\n", fp8 ? "fp8" : "bf16", M, N, K);
  for (size_t u = 0; u < uniq.size(); ++u) {
    std::sort(r[u].begin(), r[u].end()); Cfg c = cfg_of(all[uniq[u]]);
    printf("  %-34s %.4f ms %7.1f TFLOP/s  id %d tile %d stages %d splitk %d red %d swz %d custom %d cluster %d\n", from[uniq[u]].c_str(), r[u][2], flop / r[u][2] / 1e9, c.id, c.tile, c.stages, c.splitk, c.red, c.swz, c.custom, c.cluster);
  }
  return 0;
}

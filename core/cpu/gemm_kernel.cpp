// gemm_kernel.cpp - the float32 micro-kernels. Each ISA variant is compiled with a
// function-level target attribute (no -march flag for the whole library) and chosen
// once at run time with __builtin_cpu_supports.
#include "gemm_kernel.h"

#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define NVTE_GEMM_X86 1
#endif

namespace nvte::cpu {
namespace {

// Portable kernel: plain loops the compiler vectorises with the baseline ISA.
constexpr int kGenMR = 4, kGenNR = 16;
template <int M>
void kernel_generic(size_t kc, const float *xp, const float *yp, float *c, size_t ldc, bool add) {
  float acc[M][kGenNR] = {};
  for (size_t k = 0; k < kc; ++k, xp += kGenMR, yp += kGenNR)
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < kGenNR; ++j) acc[i][j] += xp[i] * yp[j];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < kGenNR; ++j) c[i * ldc + j] = add ? c[i * ldc + j] + acc[i][j] : acc[i][j];
}

#ifdef NVTE_GEMM_X86

// AVX2: 6 rows x 16 columns = 12 ymm accumulators + 2 loads + 1 broadcast (of 16 registers).
// M < 6 instances serve the last rows of a block (the packed X panel still has 6 rows).
constexpr int k2MR = 6, k2NR = 16;
template <int M>
__attribute__((target("avx2,fma"))) void kernel_avx2(size_t kc, const float *xp, const float *yp, float *c,
                                                       size_t ldc, bool add) {
  __m256 a0[M], a1[M];
#pragma GCC unroll 6
  for (int i = 0; i < M; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
  for (size_t k = 0; k < kc; ++k, xp += k2MR, yp += k2NR) {
    const __m256 y0 = _mm256_loadu_ps(yp), y1 = _mm256_loadu_ps(yp + 8);
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) {
      const __m256 x = _mm256_broadcast_ss(xp + i);
      a0[i] = _mm256_fmadd_ps(x, y0, a0[i]);
      a1[i] = _mm256_fmadd_ps(x, y1, a1[i]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < M; ++i) {
    float *ci = c + i * ldc;
    if (add) {
      a0[i] = _mm256_add_ps(a0[i], _mm256_loadu_ps(ci));
      a1[i] = _mm256_add_ps(a1[i], _mm256_loadu_ps(ci + 8));
    }
    _mm256_storeu_ps(ci, a0[i]);
    _mm256_storeu_ps(ci + 8, a1[i]);
  }
}

// AVX-512: 12 rows x 32 columns = 24 zmm accumulators + 2 loads + broadcasts (of 32
// registers); 24 independent FMA chains hide the FMA latency on every AVX-512 core.
constexpr int k5MR = 12, k5NR = 32;
template <int M>
__attribute__((target("avx512f,fma"))) void kernel_avx512(size_t kc, const float *xp, const float *yp,
                                                            float *c, size_t ldc, bool add) {
  __m512 a0[M], a1[M];
#pragma GCC unroll 12
  for (int i = 0; i < M; ++i) a0[i] = a1[i] = _mm512_setzero_ps();
  for (size_t k = 0; k < kc; ++k, xp += k5MR, yp += k5NR) {
    const __m512 y0 = _mm512_loadu_ps(yp), y1 = _mm512_loadu_ps(yp + 16);
    _mm_prefetch(reinterpret_cast<const char *>(yp + 8 * k5NR), _MM_HINT_T0);
#pragma GCC unroll 12
    for (int i = 0; i < M; ++i) {
      const __m512 x = _mm512_set1_ps(xp[i]);
      a0[i] = _mm512_fmadd_ps(x, y0, a0[i]);
      a1[i] = _mm512_fmadd_ps(x, y1, a1[i]);
    }
  }
#pragma GCC unroll 12
  for (int i = 0; i < M; ++i) {
    float *ci = c + i * ldc;
    if (add) {
      a0[i] = _mm512_add_ps(a0[i], _mm512_loadu_ps(ci));
      a1[i] = _mm512_add_ps(a1[i], _mm512_loadu_ps(ci + 16));
    }
    _mm512_storeu_ps(ci, a0[i]);
    _mm512_storeu_ps(ci + 16, a1[i]);
  }
}

// Function tables indexed by the number of rows (1..MR) a tile really has.
const GemmKernel::Fn kAvx2Rows[k2MR + 1] = {nullptr,
                                            &kernel_avx2<1>, &kernel_avx2<2>, &kernel_avx2<3>,
                                            &kernel_avx2<4>, &kernel_avx2<5>, &kernel_avx2<6>};
const GemmKernel::Fn kAvx512Rows[k5MR + 1] = {
    nullptr,            &kernel_avx512<1>,  &kernel_avx512<2>,  &kernel_avx512<3>, &kernel_avx512<4>,
    &kernel_avx512<5>,  &kernel_avx512<6>,  &kernel_avx512<7>,  &kernel_avx512<8>, &kernel_avx512<9>,
    &kernel_avx512<10>, &kernel_avx512<11>, &kernel_avx512<12>};

#endif  // NVTE_GEMM_X86

// Blocking: an mc x kc block of X stays in L2 while kc x nr micro-panels of Y stream
// through L1; kc = 256 keeps one Y micro-panel (32 KiB for nr = 32) near L1 size.
const GemmKernel::Fn kGenericRows[kGenMR + 1] = {nullptr, &kernel_generic<1>, &kernel_generic<2>,
                                                  &kernel_generic<3>, &kernel_generic<4>};
const GemmKernel kGeneric{"generic", kGenMR, kGenNR, 128, 256, kGenericRows};
#ifdef NVTE_GEMM_X86
const GemmKernel kAvx2{"avx2", k2MR, k2NR, 144, 256, kAvx2Rows};
const GemmKernel kAvx512{"avx512", k5MR, k5NR, 144, 256, kAvx512Rows};
#endif

const GemmKernel &choose() {
  // A forced kernel the CPU lacks falls back to the next best one.
  const char *env = std::getenv("NVTE_CPU_GEMM_KERNEL");
  const std::string want = env ? env : "";
  const bool force_generic = want == "generic";
  const bool allow512 = !force_generic && want != "avx2";
#ifdef NVTE_GEMM_X86
  __builtin_cpu_init();
  if (allow512 && __builtin_cpu_supports("avx512f")) return kAvx512;
  if (!force_generic && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  (void)allow512;
  return kGeneric;
}

}  // namespace

const GemmKernel &gemm_kernel() {
  static const GemmKernel &k = choose();
  return k;
}

}  // namespace nvte::cpu

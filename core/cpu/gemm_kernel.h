// gemm_kernel.h - register-blocked float32 micro-kernels of the CPU GEMM and their
// runtime selection (AVX-512, AVX2+FMA or portable C++), so one .so runs everywhere.
//
// Packed layouts (written by the packing code in gemm.cpp, zero padded):
//   X micro-panel: kc steps of mr floats   (rows of the output tile, broadcast)
//   Y micro-panel: kc steps of nr floats   (columns of the output tile, vector loads)
// A kernel computes the mr x nr tile  C = X_panel^T-ish product  sum_k x[k][i] * y[k][j]
// and either stores it into C or adds it to C (row stride ldc).
#pragma once

#include <cstddef>

namespace nvte::cpu {

struct GemmKernel {
  using Fn = void (*)(size_t kc, const float *xp, const float *yp, float *c, size_t ldc, bool add);
  const char *name;
  int mr, nr;     // tile shape: mr output rows x nr output columns
  size_t mc, kc;  // cache blocking: rows of X packed per block, k slice length
  // rows[r] computes only the first r (1..mr) rows of the tile (r = mr: the full kernel),
  // so the last rows of a block cost no padded arithmetic.
  const Fn *rows;
};

// The fastest kernel the running CPU supports; NVTE_CPU_GEMM_KERNEL=avx512|avx2|generic
// forces one (used by tests/benchmarks to exercise the fallbacks).
const GemmKernel &gemm_kernel();

}  // namespace nvte::cpu

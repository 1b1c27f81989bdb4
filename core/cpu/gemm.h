// cpu/gemm.h - CPU GEMM with the epilogues of gemm.h, on operands already resolved by
// the API layer (layouts, transposes, FP8 scale_inv) into strided matrix views.
#pragma once

#include <cstddef>
#include <cstdlib>

#include "../common/tensor.h"

namespace nvte::cpu {

// A rows x cols matrix: element (i, j) is data[i * row_stride + j * col_stride], decoded
// to float32 (FP8 values are multiplied by scale_inv).
struct MatView {
  const void *data = nullptr;
  NVTEDType dtype = kNVTEFloat32;
  size_t rows = 0, cols = 0;
  size_t row_stride = 0, col_stride = 1;
  float scale_inv = 1.0f;
};

// D [n, m] = epilogue(alpha * x @ y + beta * c), x = op(B) [n, k], y = op(A) [k, m].
struct GemmProblem {
  MatView x, y;
  float alpha = 1.0f, beta = 0.0f;
  const Tensor *c = nullptr;          // the beta term ([n, m]); read only when beta != 0
  Tensor *d = nullptr;                // output [n, m], any float or FP8 dtype (cpu::OutputRows)
  const Tensor *bias = nullptr;       // forward: bias [m] added to every row
  Tensor *aux = nullptr;              // pre-GELU values: written with gelu, read with dgelu
  bool gelu = false, dgelu = false;
  Tensor *dbias = nullptr;            // backward: column sums of D [m] with dgelu, else row sums of x [n]
};

void gemm(const GemmProblem &p);

// A grow-only 64-byte aligned float buffer. Kept per thread (thread_local) across calls
// so repeated GEMMs do not pay for fresh pages; trim() releases one above 64 MiB.
class AlignedBuf {
 public:
  AlignedBuf() = default;
  AlignedBuf(const AlignedBuf &) = delete;
  AlignedBuf &operator=(const AlignedBuf &) = delete;
  ~AlignedBuf() { std::free(p_); }
  float *get(size_t n);
  void trim();
  static constexpr size_t kKeepFloats = size_t(16) << 20;

 private:
  float *p_ = nullptr;
  size_t cap_ = 0;
};

// out[i] = sum_j x(i, j) in float32, j ascending (bias gradient of op(B)).
void row_sums(const MatView &x, float *out);

// c [n, m] (row stride ldc) = x @ y in float32: packed, cache-blocked and threaded.
void matmul_f32(const MatView &x, const MatView &y, float *c, size_t ldc);

}  // namespace nvte::cpu

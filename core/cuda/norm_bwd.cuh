// norm_bwd.cuh - what the LayerNorm/RMSNorm backward kernels (normalization_bwd.cu,
// normalization_bwd_pipelined.cu) share: their parameters, dx's operation order, the ring size.
#pragma once

#include "norm_common.cuh"

namespace nvte::cuda::norm {

struct BwdParams {
  const void *dz, *x, *add, *gamma;
  const float *mu, *rsigma;  // mu == nullptr: RMSNorm
  void *dx;
  float *ws;  // [parts, H] dgamma partials, then (LayerNorm) [parts, H] dbeta partials
  size_t rows, cols, rows_per_part;  // block c: rows [c * rows_per_part, min(rows, (c + 1) * rows_per_part))
  size_t parts;
  NVTEDType dzt, xt, at, gt, dxt;
  bool zc, ln;
};

// dx of one element with the CPU's operation order: rs * ((dy - mean_dy) - xhat * mean_dyx).
__device__ __forceinline__ float dx_value(float rs, float dy, float xh, float mean_dy, float mean_dyx) {
  return __fmul_rn(rs, __fsub_rn(__fsub_rn(dy, mean_dy), __fmul_rn(xh, mean_dyx)));
}

// ST > 0: x and dz of the block's next ST - 1 rows are in flight in a shared-memory ring (see
// cp_async16; 128 KiB per SM at ST = 4 and one vector per thread); ST == 0: each row is loaded
// into registers when it starts.
template <int TPR, int NV, int ST>
constexpr size_t bwd_ring_bytes() {
  return (size_t)ST * 2 * NV * TPR * sizeof(uint4);
}

// Rows of 2049..4096 elements (H % 8 == 0, 16-byte aligned, x, dz, gamma, dx and add of one
// 16-bit dtype): norm_bwd_row_pipelined, one 512-thread block per part (normalization_bwd_pipelined.cu).
void launch_bwd_rows_upto_4096(const BwdParams &p, cudaStream_t stream);

}  // namespace nvte::cuda::norm

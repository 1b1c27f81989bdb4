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

// Row `row`'s mean (0 for RMSNorm, which stores none) and 1 / sigma; both 0 past the block's
// last row r1 (the row kernels load them one row ahead).
__device__ __forceinline__ void row_stats(const BwdParams &p, size_t row, size_t r1, float &m, float &rs) {
  m = 0.0f;
  rs = 0.0f;
  if (row < r1) {
    m = p.mu ? p.mu[row] : 0.0f;
    rs = p.rsigma[row];
  }
}

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

// dx of vector k of `row` (+ the add input's), stored: the typed 16-bit row kernels (x, dz,
// gamma, dx and add of one dtype TI; nvec = cols / 8 vectors per row).
template <class TI>
__device__ __forceinline__ void store_dx_vec(const BwdParams &p, size_t nvec, size_t row, size_t k,
                                             float (&o)[kVec]) {
  if (p.add) {
    float ad[kVec];
    unpack8<TI>(static_cast<const uint4 *>(p.add)[row * nvec + k], ad);
#pragma unroll
    for (int j = 0; j < kVec; ++j) o[j] = __fadd_rn(o[j], ad[j]);
  }
  store8<TI>(static_cast<TI *>(p.dx) + row * p.cols + k * kVec, o, 1.0f);
}

// This block's dgamma (and, LayerNorm, dbeta) partials of vector k into its workspace rows.
__device__ __forceinline__ void write_partials(const BwdParams &p, size_t k, const float (&pg)[kVec],
                                               const float (&pb)[kVec]) {
  float4 *g4 = reinterpret_cast<float4 *>(p.ws + blockIdx.x * p.cols + k * kVec);
  g4[0] = make_float4(pg[0], pg[1], pg[2], pg[3]);
  g4[1] = make_float4(pg[4], pg[5], pg[6], pg[7]);
  if (p.ln) {
    float4 *b4 = reinterpret_cast<float4 *>(p.ws + (p.parts + blockIdx.x) * p.cols + k * kVec);
    b4[0] = make_float4(pb[0], pb[1], pb[2], pb[3]);
    b4[1] = make_float4(pb[4], pb[5], pb[6], pb[7]);
  }
}

// Rows of 2049..4096 elements (H % 8 == 0, 16-byte aligned, x, dz, gamma, dx and add of one
// 16-bit dtype): norm_bwd_row_pipelined, one 512-thread block per part (normalization_bwd_pipelined.cu).
void launch_bwd_rows_upto_4096(const BwdParams &p, cudaStream_t stream);

}  // namespace nvte::cuda::norm

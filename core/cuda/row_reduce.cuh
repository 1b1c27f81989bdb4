// cuda/row_reduce.cuh - pieces shared by the softmax kernels (softmax.cu, attn_softmax.cu): a
// group of G threads owning one row (a warp, or a whole block) reduces it with these.
#pragma once

#include "common.cuh"

namespace nvte::cuda {

// exp(d) for d <= 0 (a logit minus the row max) as 2^(d * log2(e)) on the special-function
// unit: within ~2 ulp of expf (results below 2^-126 flush to 0), a third of expf's
// instructions; the forward is otherwise compute-bound at long rows.
__device__ __forceinline__ float exp_nonpos(float d) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d * 1.4426950408889634f));
  return r;
}

// Reductions over a group of G threads (a warp, or the whole block); every thread gets the
// result. Block groups go through shared memory `sh` (G / 32 floats), with a barrier after
// so the next call may reuse it.
template <int G>
__device__ __forceinline__ float group_max(float v, float *sh) {
  v = warp_max(v);
  if constexpr (G > 32) {
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sh[0];
#pragma unroll
    for (int k = 1; k < G / 32; ++k) v = fmaxf(v, sh[k]);
    __syncthreads();
  }
  return v;
}
template <int G>
__device__ __forceinline__ float group_sum(float v, float *sh) {
  v = warp_sum(v);
  if constexpr (G > 32) {
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    v = sh[0];
#pragma unroll
    for (int k = 1; k < G / 32; ++k) v += sh[k];
    __syncthreads();
  }
  return v;
}

}  // namespace nvte::cuda

// cuda/softmax_rows.cuh - pieces shared by the softmax kernels (softmax.cu, attn_softmax.cu),
// whose groups of G threads (a warp, or a whole block) each own a row: chunked loads and stores,
// exp of a non-positive argument, and the group's max and sum.
#pragma once

#include <type_traits>

#include "common.cuh"

namespace nvte::cuda {

// V values of T at element `off` of p as floats: one vector access, or V scalar ones.
template <class T, int V>
__device__ __forceinline__ void load_chunk(const void *p, size_t off, float *f) {
  if constexpr (V == 1 || std::is_same_v<T, AnyT>) {
#pragma unroll
    for (int e = 0; e < V; ++e) f[e] = ld<T>(p, off + e, kNVTEFloat32);
  } else {
    const Vec<T, V> v = load_vec<T, V>(static_cast<const T *>(p) + off);
#pragma unroll
    for (int e = 0; e < V; ++e) f[e] = load_f32(v.v[e]);
  }
}
template <class T, int V>
__device__ __forceinline__ void store_chunk(void *p, size_t off, const float *f) {
  if constexpr (V == 1) {
    st<T>(p, off, f[0], kNVTEFloat32);
  } else {
    Vec<T, V> v;
#pragma unroll
    for (int e = 0; e < V; ++e) v.v[e] = store_f32<T>(f[e]);
    store_vec<T, V>(static_cast<T *>(p) + off, v);
  }
}

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

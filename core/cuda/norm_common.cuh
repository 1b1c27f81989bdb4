// norm_common.cuh - what the LayerNorm/RMSNorm forward (normalization_fwd.cu) and backward
// (normalization_bwd.cu) kernels share: vectors of 8 elements, run-time typed and typed 16-bit
// accesses, the unit reduction, and host helpers. See normalization_fwd.cu for the design.
#pragma once

#include <cstring>
#include <type_traits>

#include "common.cuh"
#include "pdl.cuh"

namespace nvte::cuda::norm {

constexpr int kVec = 8;  // elements per vector

// ------------------------------------------------------------ run-time typed access
template <class T>
__device__ __forceinline__ void ld8_t(const void *base, size_t e, float (&o)[kVec]) {
  const T *p = static_cast<const T *>(base) + e;
  constexpr int kPer = 16 / sizeof(T);  // elements per 16-byte access
#pragma unroll
  for (int h = 0; h < kVec / kPer; ++h) {
    const Vec<T, kPer> v = load_vec<T, kPer>(p + h * kPer);
#pragma unroll
    for (int j = 0; j < kPer; ++j) o[h * kPer + j] = load_f32(v.v[j]);
  }
}

// x-like inputs: float32, float16 or bfloat16.
__device__ __forceinline__ void ld8(const void *base, NVTEDType t, size_t e, float (&o)[kVec]) {
  if (t == kNVTEBFloat16) ld8_t<bf16>(base, e, o);
  else if (t == kNVTEFloat16) ld8_t<fp16>(base, e, o);
  else ld8_t<float>(base, e, o);
}

__device__ __forceinline__ float ld1(const void *base, NVTEDType t, size_t e) {
  if (t == kNVTEBFloat16) return load_f32(static_cast<const bf16 *>(base)[e]);
  if (t == kNVTEFloat16) return load_f32(static_cast<const fp16 *>(base)[e]);
  return static_cast<const float *>(base)[e];
}

// Stores v[j] * s (s is 1 unless the output is FP8).
template <class T>
__device__ __forceinline__ void st8_t(void *base, size_t e, const float (&v)[kVec], float s) {
  T *p = static_cast<T *>(base) + e;
  constexpr int kPer = sizeof(T) == 1 ? kVec : 16 / (int)sizeof(T);
#pragma unroll
  for (int h = 0; h < kVec / kPer; ++h) {
    Vec<T, kPer> w;
#pragma unroll
    for (int j = 0; j < kPer; ++j) w.v[j] = store_f32<T>(v[h * kPer + j] * s);
    store_vec<T, kPer>(p + h * kPer, w);
  }
}

__device__ __forceinline__ void st8(void *base, NVTEDType t, size_t e, const float (&v)[kVec], float s) {
  switch (t) {
    case kNVTEBFloat16: st8_t<bf16>(base, e, v, s); break;
    case kNVTEFloat16: st8_t<fp16>(base, e, v, s); break;
    case kNVTEFloat8E4M3: st8_t<fp8e4m3>(base, e, v, s); break;
    case kNVTEFloat8E5M2: st8_t<fp8e5m2>(base, e, v, s); break;
    default: st8_t<float>(base, e, v, s); break;
  }
}

__device__ __forceinline__ void st1(void *base, NVTEDType t, size_t e, float v) {
  switch (t) {
    case kNVTEBFloat16: static_cast<bf16 *>(base)[e] = store_f32<bf16>(v); break;
    case kNVTEFloat16: static_cast<fp16 *>(base)[e] = store_f32<fp16>(v); break;
    case kNVTEFloat8E4M3: static_cast<fp8e4m3 *>(base)[e] = store_f32<fp8e4m3>(v); break;
    case kNVTEFloat8E5M2: static_cast<fp8e5m2 *>(base)[e] = store_f32<fp8e5m2>(v); break;
    default: static_cast<float *>(base)[e] = v; break;
  }
}

// Sums K values over each unit of TPR consecutive threads. Every thread of the block calls
// it (it may hold __syncthreads); every thread of a unit gets the same bits (xor butterfly
// in the warp, then the unit's warps added in warp order). red: CTA / 32 * K floats.
template <int TPR, int K>
__device__ __forceinline__ void unit_sum(float (&v)[K], float *red) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  if constexpr (TPR > 32) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) red[warp * K + k] = v[k];
    }
    __syncthreads();
    const int first = (threadIdx.x / TPR) * (TPR / 32);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = red[first * K + k];
#pragma unroll
      for (int w = 1; w < TPR / 32; ++w) s += red[(first + w) * K + k];
      v[k] = s;
    }
    __syncthreads();  // red is reused by the next call
  }
}

// The sum of W per-warp partials red[0], red[S], ..., red[(W - 1) S] (written before a barrier):
// for many warps each warp adds them with a butterfly (one shared load per thread instead of W),
// for few in a plain loop; either way every thread of the block gets the same bits.
template <int W, int S = 1>
__device__ __forceinline__ float sum_partials(const float *red, int lane) {
  if constexpr (W >= 8) {
    return warp_sum(lane < W ? red[lane * S] : 0.0f);
  } else {
    float v = red[0];
#pragma unroll
    for (int w = 1; w < W; ++w) v += red[w * S];
    return v;
  }
}

// ------------------------------------------------ 16-bit forward with typed storage
// The common case (bf16/fp16 x, gamma and beta of x's dtype, rowwise z of x's dtype or FP8)
// with every storage type known at compile time: 16-byte raw loads decoded two values per
// word with bit operations, paired output conversions (cvt.*x2) packed straight into one
// store per 8 values. ncu on an H200 counted ~30 instructions per element for the run-time
// typed kernel above (decodes, per-element conversions, type switches), which made it
// issue-bound at under half the copy bandwidth.
template <class T>
__device__ __forceinline__ void unpack8(const uint4 &c, float (&f)[kVec]) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, bf16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    } else {
      __half2 hv;
      memcpy(&hv, &w[i], 4);
      const float2 v = __half22float2(hv);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
}

// Stores 8 values (times s for FP8) at dst with one 8-byte (FP8) or 16-byte store.
template <class TO>
__device__ __forceinline__ void store8(TO *dst, const float (&o)[kVec], float s) {
  if constexpr (is_fp8_type<TO>::value) {
    constexpr __nv_fp8_interpretation_t kKind = std::is_same_v<TO, fp8e4m3> ? __NV_E4M3 : __NV_E5M2;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = __nv_cvt_float2_to_fp8x2(make_float2(o[2 * i] * s, o[2 * i + 1] * s), __NV_SATFINITE, kKind);
    *reinterpret_cast<uint2 *>(dst) = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
  } else {
    *reinterpret_cast<uint4 *>(dst) =
        make_uint4(pack2<TO>(o[0], o[1]), pack2<TO>(o[2], o[3]), pack2<TO>(o[4], o[5]), pack2<TO>(o[6], o[7]));
  }
}

// 8 elements of x or dz kept in their storage type (16 bytes of bf16/fp16, 32 of float32):
// registers for the row, decoded again where needed.
template <class T>
struct Raw8 {
  static constexpr int kPer = 16 / sizeof(T);
  Vec<T, kPer> v[kVec / kPer];
  __device__ __forceinline__ void load(const void *base, size_t e) {
    const T *p = static_cast<const T *>(base) + e;
#pragma unroll
    for (int h = 0; h < kVec / kPer; ++h) v[h] = load_vec<T, kPer>(p + h * kPer);
  }
  __device__ __forceinline__ float operator[](int j) const { return load_f32(v[j / kPer].v[j % kPer]); }
  // All 8 values at once (16-bit T: two per 32-bit word with bit operations).
  __device__ __forceinline__ void unpack(float (&f)[kVec]) const {
    if constexpr (sizeof(T) == 2) {
      uint4 c;
      memcpy(&c, &v[0], 16);
      unpack8<T>(c, f);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) f[j] = (*this)[j];
    }
  }
};

// ------------------------------------------------ rows fetched ahead into shared memory
// One ring slot per upcoming row: each thread copies its own 16-byte vectors of a row with
// cp.async (sm_80+) and later reads back only those, so cp.async.wait_group alone orders the
// copy before the read (no barrier). The backward row kernel keeps its next rows in flight this
// way at no register cost: loading a row only when it started left too few bytes in flight per
// SM (the forward measured no gain from it).
__device__ __forceinline__ void cp_async16(uint4 *dst, const uint4 *src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((unsigned)__cvta_generic_to_shared(dst)),
               "l"(src)
               : "memory");
#else
  *dst = *src;
#endif
}

// Closes the group of copies issued since the last commit (one group per row; may be empty).
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// ------------------------------------------------------------------------------ host
inline const void *data_of(const Tensor &t) { return t.params[kNVTERowwiseData].data_ptr; }
inline NVTEDType dtype_of(const Tensor &t) { return t.params[kNVTERowwiseData].dtype; }

inline bool vec_ok(const void *p) { return p == nullptr || aligned(p, 16); }

// Smallest power of two >= v, clamped to [32, 1024].
inline int unit_threads(size_t v) {
  int t = 32;
  while (t < 1024 && (size_t)t < v) t *= 2;
  return t;
}

}  // namespace nvte::cuda::norm

// common.cuh - what every CUDA kernel file of the backend shares: error checks that turn
// CUDA failures into NVTE_ERROR_CUDA statuses, fast device conversions that are
// bit-identical to core/common/numeric.h (the CPU oracle), 16-byte vector access,
// and the amax reduction (warp -> block -> one atomic per block).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../common/error.h"
#include "../common/numeric.h"
#include "../common/tensor.h"
#include "cuda_check.h"


namespace nvte::cuda {

// Multiprocessor count of the current device (cached per device).
int sm_count();

// Resident blocks per SM of `kernel` launched with `threads` threads and `smem` bytes of dynamic
// shared memory on the current device, cached per (kernel, device, threads, smem). It first
// raises the kernel's dynamic shared memory limit to smem (needed on each device before a
// launch with more than 48 KiB in all): call it before launching a kernel with smem > 0.
int resident_blocks(const void *kernel, int threads, size_t smem);
// Lets `kernel` take `max_smem` bytes of dynamic shared memory on the current device (needed past
// 48 KiB); the driver call is made once per kernel and device.
void allow_dynamic_smem(const void *kernel, size_t max_smem);

// An FP8 output with no elements: nothing is converted, but scale_inv (and the columnwise
// scale_inv) still become 1 / *scale, as the CPU backend writes them (amax, a max over no values,
// stays as it is). One single-thread launch on `stream`; null pointers are skipped; noop: device
// flag or null, 1 = write nothing (as the kernels it stands in for).
void write_empty_fp8_scale_inv(const float *scale, float *scale_inv, float *col_scale_inv, const float *noop,
                               cudaStream_t stream);

// Blocks for a grid-stride kernel over n items: enough to fill the device a few times over.
inline unsigned grid_for(size_t n, int threads, int items_per_thread = 1) {
  const size_t want = (n + (size_t)threads * items_per_thread - 1) / ((size_t)threads * items_per_thread);
  const size_t cap = (size_t)sm_count() * 8;
  return (unsigned)(want < 1 ? 1 : (want > cap ? cap : want));
}

// ---------------------------------------------------------------- conversions
// load: storage -> float32; store: float32 -> storage. FP8 stores use the hardware
// satfinite conversion on sm_89+ (same results as numeric.h: RNE, saturate, NaN -> 0x7F,
// checked bit for bit by tests/gpu) and numeric.h elsewhere.
__device__ __forceinline__ float load_f32(float v) { return v; }
__device__ __forceinline__ float load_f32(bf16 v) { return __uint_as_float((uint32_t)v.bits << 16); }
__device__ __forceinline__ float load_f32(fp16 v) { return __half2float(__ushort_as_half(v.bits)); }
__device__ __forceinline__ float load_f32(fp8e4m3 v) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.bits, __NV_E4M3)));
}
__device__ __forceinline__ float load_f32(fp8e5m2 v) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.bits, __NV_E5M2)));
}

template <class T> __device__ __forceinline__ T store_f32(float v);
template <> __device__ __forceinline__ float store_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16 store_f32<bf16>(float v) {
  return bf16{__bfloat16_as_ushort(__float2bfloat16_rn(v))};
}
template <> __device__ __forceinline__ fp16 store_f32<fp16>(float v) {
  return fp16{__half_as_ushort(__float2half_rn(v))};
}
template <> __device__ __forceinline__ fp8e4m3 store_f32<fp8e4m3>(float v) {
  return fp8e4m3{(uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)};
}
template <> __device__ __forceinline__ fp8e5m2 store_f32<fp8e5m2>(float v) {
  return fp8e5m2{(uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2)};
}

// Two values as one 32-bit word of bf16/fp16 storage (low half = a), round to nearest even
// (the hardware pair conversion: as numeric.h for every non-NaN value).
template <class T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  uint32_t r;
  if constexpr (std::is_same_v<T, bf16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    memcpy(&r, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    memcpy(&r, &v, 4);
  }
  return r;
}

// ------------------------------------------------- run-time typed element access
// Rare mixed-dtype calls run one kernel instantiation over AnyT, which converts through a
// run-time dtype switch (scalar access only); ld<T>/st<T> are plain typed accesses otherwise.
struct AnyT {};

template <class T>
__device__ __forceinline__ float ld(const void *p, size_t i, NVTEDType) {
  return load_f32(static_cast<const T *>(p)[i]);
}
template <>
__device__ __forceinline__ float ld<AnyT>(const void *p, size_t i, NVTEDType t) {
  switch (t) {
    case kNVTEFloat16: return load_f32(static_cast<const fp16 *>(p)[i]);
    case kNVTEBFloat16: return load_f32(static_cast<const bf16 *>(p)[i]);
    default: return static_cast<const float *>(p)[i];
  }
}

template <class T>
__device__ __forceinline__ void st(void *p, size_t i, float v, NVTEDType) {
  static_cast<T *>(p)[i] = store_f32<T>(v);
}
template <>
__device__ __forceinline__ void st<AnyT>(void *p, size_t i, float v, NVTEDType t) {
  switch (t) {
    case kNVTEFloat16: st<fp16>(p, i, v, t); break;
    case kNVTEBFloat16: st<bf16>(p, i, v, t); break;
    case kNVTEFloat8E4M3: st<fp8e4m3>(p, i, v, t); break;
    case kNVTEFloat8E5M2: st<fp8e5m2>(p, i, v, t); break;
    default: st<float>(p, i, v, t); break;
  }
}

// ------------------------------------------------------------- vector access
// N elements of T in one aligned access (N * sizeof(T) == 16 for full-width loads).
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T *p) {
  return *reinterpret_cast<const Vec<T, N> *>(p);
}
template <class T, int N>
__device__ __forceinline__ void store_vec(T *p, const Vec<T, N> &v) {
  *reinterpret_cast<Vec<T, N> *>(p) = v;
}


// ---------------------------------------------------------------- reductions
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Non-negative floats order like their bit patterns, so an integer atomicMax is a float max.
__device__ __forceinline__ void atomic_max_nonneg(float *addr, float v) {
  atomicMax(reinterpret_cast<int *>(addr), __float_as_int(v));
}

// Reduces each thread's |x| maximum over the block and folds it into *amax (one atomic per
// block). All threads of the block must call it. NaNs are ignored (fmaxf), as on the CPU.
__device__ __forceinline__ void block_amax_update(float local, float *amax) {
  __shared__ float partial[32];
  local = warp_max(local);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) partial[warp] = local;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = (blockDim.x + 31) >> 5;
    float v = lane < nwarps ? partial[lane] : 0.0f;
    v = warp_max(v);
    if (lane == 0 && amax != nullptr && v > 0.0f) atomic_max_nonneg(amax, v);
  }
}

}  // namespace nvte::cuda

// gemm_epilogue.cu - the small kernels around the cuBLASLt GEMM. cuBLASLt computes the
// product and its fused epilogues itself; what it cannot express of the library's output
// rule is done here on the same stream. Its AMAX_D overwrites its target, so it writes a
// float of scratch and one thread max-accumulates that into D's amax and writes
// scale_inv = 1/scale (a single-thread kernel: one dependent launch, no host sync). A
// non-FP8 D with an amax buffer gets a grid-stride reduction over D (16-byte loads when
// aligned, one atomic per block). FP8 GEMMs whose bias or GELU aux is float32 (cuBLASLt takes
// only bf16/fp16 ones there) get their epilogue here, after a plain GEMM: D = act(D + bias),
// aux = D + bias, elementwise in float32.
#include "../common/activation_math.h"
#include "common.cuh"
#include "gemm.h"

namespace nvte::cuda {
namespace {

__global__ void fp8_output_finalize_kernel(const float *amax_tmp, float *amax, const float *scale,
                                           float *scale_inv, float *col_scale_inv) {
  if (amax != nullptr && amax_tmp != nullptr) *amax = fmaxf(*amax, *amax_tmp);
  const float inv = 1.0f / *scale;
  if (scale_inv != nullptr) *scale_inv = inv;
  if (col_scale_inv != nullptr) *col_scale_inv = inv;
}

template <class T>
__global__ void amax_kernel(const T *__restrict__ d, size_t numel, bool vec, float *amax) {
  constexpr int N = 16 / sizeof(T);
  float m = 0.0f;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (vec) {
    const size_t nv = numel / N;
    for (; i < nv; i += stride) {
      const Vec<T, N> v = load_vec<T, N>(d + i * N);
#pragma unroll
      for (int j = 0; j < N; ++j) m = fmaxf(m, fabsf(load_f32(v.v[j])));
    }
  } else {
    for (; i < numel; i += stride) m = fmaxf(m, fabsf(load_f32(d[i])));
  }
  block_amax_update(m, amax);
}

// D [n, m] row-major: v = D + bias[col]; with gelu: aux = v, D = gelu(v); else D = v.
__global__ void bias_gelu_kernel(void *d, NVTEDType td, const void *bias, NVTEDType tb, void *aux, NVTEDType ta,
                                 size_t m, size_t total, bool gelu) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
    float v = ld<AnyT>(d, i, td);
    if (bias != nullptr) v += ld<AnyT>(bias, i % m, tb);
    if (gelu) {
      if (aux != nullptr) st<AnyT>(aux, i, v, ta);
      v = gelu_f(v);
    }
    st<AnyT>(d, i, v, td);
  }
}

}  // namespace

void launch_bias_gelu(void *d, NVTEDType td, const void *bias, NVTEDType tb, void *aux, NVTEDType ta, size_t m,
                      size_t n, bool gelu, cudaStream_t stream) {
  const size_t total = m * n;
  if (total == 0) return;
  bias_gelu_kernel<<<grid_for(total, 256), 256, 0, stream>>>(d, td, bias, tb, aux, ta, m, total, gelu);
  NVTE_CHECK_LAUNCH();
}

void launch_fp8_output_finalize(const float *amax_tmp, float *amax, const float *scale, float *scale_inv,
                                float *col_scale_inv, cudaStream_t stream) {
  if (amax == nullptr && scale_inv == nullptr && col_scale_inv == nullptr) return;
  fp8_output_finalize_kernel<<<1, 1, 0, stream>>>(amax_tmp, amax, scale, scale_inv, col_scale_inv);
  NVTE_CHECK_LAUNCH();
}

void launch_amax_update(const void *d, NVTEDType dtype, size_t numel, float *amax, cudaStream_t stream) {
  if (numel == 0 || amax == nullptr) return;
  constexpr int kThreads = 256;
  auto go = [&](auto *p) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(p)>>;
    constexpr int N = 16 / sizeof(T);
    const bool vec = aligned(p, 16) && numel % N == 0;
    const unsigned blocks = grid_for(vec ? numel / N : numel, kThreads);
    amax_kernel<T><<<blocks, kThreads, 0, stream>>>(p, numel, vec, amax);
    NVTE_CHECK_LAUNCH();
  };
  switch (dtype) {
    case kNVTEFloat32: go(static_cast<const float *>(d)); break;
    case kNVTEFloat16: go(static_cast<const fp16 *>(d)); break;
    case kNVTEBFloat16: go(static_cast<const bf16 *>(d)); break;
    default: NVTE_FAIL(NVTE_ERROR_INTERNAL, "amax of a GEMM output of dtype ", dtype_name(dtype));
  }
}

}  // namespace nvte::cuda

// recipe.cu - CUDA delayed-scaling updates and current-scaling helpers.
//
// Design: the recipe state is tiny (histories of ~1K rows x a few columns), so the kernels
// optimise launches, not bandwidth: one warp per history column does the column max
// (shuffle reduction), the scale and the in-place roll (the warp reads a 32-row chunk
// before overwriting the rows above it, so aliasing input and output is safe). The bulk
// after-reduction step handles every history in one launch: their descriptors travel by
// value in the kernel parameters, one block per history. All arithmetic is the CPU's
// float32 sequence (fp8_max / amax / 2^margin with IEEE division), so results are
// bit-identical. compute_amax is a memory-bound grid-stride max with one atomic per block.
#include "recipe.h"

#include <cfloat>
#include <cmath>

#include "../common/dtype_switch.h"
#include "cast_tiles.cuh"

namespace nvte::cuda {

namespace {

float margin_factor(float margin) { return static_cast<float>(std::exp2(static_cast<double>(margin))); }

__device__ __forceinline__ float delayed_scale(float amax, float old_scale, float fp8_max, float mf) {
  if (!(amax > 0.0f) || !isfinite(amax)) return old_scale;  // (as cpu/recipe.cpp)
  const float s = fp8_max / amax / mf;
  return isinf(s) ? FLT_MAX : s;
}

// Rolls column j of a [len, n] history by -1 (row len-1 gets `last`) and zeroes row 0. One
// warp; reads of a chunk finish before its writes, so out may alias in.
__device__ __forceinline__ void roll_column(const float *in, float *out, size_t len, size_t n, size_t j,
                                            float last, int lane) {
  for (size_t base = 0; base < len; base += 32) {
    const size_t i = base + lane;
    float val = 0.0f;
    if (i < len) val = i + 1 < len ? in[(i + 1) * n + j] : last;
    __syncwarp();
    if (i < len) out[i * n + j] = i == 0 ? 0.0f : val;
    __syncwarp();
  }
}

constexpr int kRecipeThreads = 128;

__global__ void __launch_bounds__(kRecipeThreads)
    update_kernel(const float *hist, const float *scale, float *out_hist, float *out_scale, size_t len, size_t n,
                  bool use_max, float fp8_max, float mf) {
  const int lane = threadIdx.x & 31;
  const size_t j = (size_t)blockIdx.x * (kRecipeThreads / 32) + (threadIdx.x >> 5);
  if (j >= n) return;
  const float first = hist[j];
  float m = first;
  if (use_max) {
    m = 0.0f;
    for (size_t i = lane; i < len; i += 32) m = fmaxf(m, hist[i * n + j]);
    m = warp_max(m);
  }
  __syncwarp();
  if (lane == 0) out_scale[j] = delayed_scale(m, scale[j], fp8_max, mf);
  roll_column(hist, out_hist, len, n, j, first, lane);
}

struct Entry {
  float *hist;
  float *scale;
  size_t len, n, offset;  // offset of this history's columns in the reduction buffer
};
constexpr int kMaxEntries = 192;  // 40 B each: ~7.5 KB of kernel parameters per launch
struct Batch {
  Entry e[kMaxEntries];
};

__global__ void __launch_bounds__(kRecipeThreads)
    after_reduction_kernel(const Batch batch, const float *buffer, bool use_max, float fp8_max, float mf) {
  const Entry &h = batch.e[blockIdx.x];
  const int lane = threadIdx.x & 31;
  for (size_t j = threadIdx.x >> 5; j < h.n; j += kRecipeThreads / 32) {
    const float b = buffer != nullptr ? buffer[h.offset + j] : 0.0f;
    const float last = b != 0.0f ? b : h.hist[j];  // row 0 holds `last` from here on
    float m = last;
    if (use_max) {
      m = lane == 0 ? fmaxf(0.0f, last) : 0.0f;
      for (size_t i = 1 + lane; i < h.len; i += 32) m = fmaxf(m, h.hist[i * h.n + j]);
      m = warp_max(m);
    }
    __syncwarp();
    if (lane == 0 && last != 0.0f) h.scale[j] = delayed_scale(m, h.scale[j], fp8_max, mf);  // unused: kept
    if (last != 0.0f) roll_column(h.hist, h.hist, h.len, h.n, j, last, lane);
  }
}

constexpr int kAmaxThreads = 256;
constexpr int kAmaxUnroll = 4;

template <class T>
__global__ void __launch_bounds__(kAmaxThreads) amax_kernel(const T *in, size_t n, size_t nvec, float *amax) {
  constexpr int N = 16 / sizeof(T);
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  float m = 0.0f;
  for (size_t base = tid; base < nvec; base += kAmaxUnroll * stride) {
    Vec<T, N> xv[kAmaxUnroll];
#pragma unroll
    for (int u = 0; u < kAmaxUnroll; ++u) {
      const size_t i = base + u * stride;
      if (i < nvec) xv[u] = load_vec<T, N>(in + i * N);
    }
#pragma unroll
    for (int u = 0; u < kAmaxUnroll; ++u) {
      if (base + u * stride < nvec) {
#pragma unroll
        for (int k = 0; k < N; ++k) m = fmaxf(m, fabsf(load_f32(xv[u].v[k])));
      }
    }
  }
  for (size_t i = nvec * N + tid; i < n; i += stride) m = fmaxf(m, fabsf(load_f32(in[i])));
  block_amax_update(m, amax);
}

__global__ void scale_from_amax_kernel(const float *amax_p, float *scale_p, const float *noop, float fp8_max,
                                       bool force_pow2, float epsilon) {
  if (noop != nullptr && *noop == 1.0f) return;
  const float amax = *amax_p;
  const float a = amax < epsilon ? epsilon : amax;
  float s = 1.0f;
  if (a != 0.0f && isfinite(a)) {
    s = fp8_max / a;
    if (isinf(s)) s = FLT_MAX;
  }
  if (force_pow2) s = __uint_as_float(__float_as_uint(s) & 0xFF800000u);
  *scale_p = s;
}

}  // namespace

void amax_and_scale_update(const float *hist, const float *scale, float *out_hist, float *out_scale, size_t len,
                           size_t n, AmaxAlgo algo, float fp8_max, float margin, cudaStream_t stream) {
  if (n == 0 || len == 0) return;
  constexpr size_t kWarps = kRecipeThreads / 32;
  const size_t blocks = (n + kWarps - 1) / kWarps;
  NVTE_CHECK_SUPPORTED(blocks <= 0x7FFFFFFFu, "amax history with ", n, " columns is too wide");
  update_kernel<<<(unsigned)blocks, kRecipeThreads, 0, stream>>>(hist, scale, out_hist, out_scale, len, n,
                                                                 algo == AmaxAlgo::Max, fp8_max, margin_factor(margin));
  NVTE_CHECK_LAUNCH();
}

void amax_and_scale_update_after_reduction(const float *buffer, const std::vector<History> &hs, AmaxAlgo algo,
                                           float fp8_max, float margin, cudaStream_t stream) {
  const float mf = margin_factor(margin);
  Batch batch;
  int count = 0;
  size_t offset = 0;
  auto flush = [&] {
    if (count == 0) return;
    after_reduction_kernel<<<count, kRecipeThreads, 0, stream>>>(batch, buffer, algo == AmaxAlgo::Max, fp8_max, mf);
    NVTE_CHECK_LAUNCH();
    count = 0;
  };
  for (const History &h : hs) {
    if (h.len != 0 && h.n != 0) {
      batch.e[count++] = Entry{h.hist, h.scale, h.len, h.n, offset};
      if (count == kMaxEntries) flush();
    }
    offset += h.n;
  }
  flush();
}

void compute_amax(const Tensor &in, float *amax, cudaStream_t stream) {
  NVTE_CHECK_CUDA(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  const NVTEBasicTensor &b = in.params[kNVTERowwiseData];
  NVTE_CHECK(buffer_set(b), "input needs rowwise data");
  const size_t n = numel(b.shape);
  if (n == 0) return;
  with_float_dtype(b.dtype, "input", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (is_fp8_type<T>::value) {
      NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "input must be float32, float16 or bfloat16");
    } else {
      constexpr int N = 16 / sizeof(T);
      const size_t nvec = aligned(b.data_ptr, 16) ? n / N : 0;
      const unsigned blocks = nvec ? grid_for(nvec, kAmaxThreads, kAmaxUnroll) : grid_for(n, kAmaxThreads, 4);
      amax_kernel<T><<<blocks, kAmaxThreads, 0, stream>>>(static_cast<const T *>(b.data_ptr), n, nvec, amax);
      NVTE_CHECK_LAUNCH();
    }
  });
}

void compute_scale_from_amax(const float *amax, float *scale, const float *noop, float fp8_max, bool force_pow2,
                             float epsilon, cudaStream_t stream) {
  scale_from_amax_kernel<<<1, 1, 0, stream>>>(amax, scale, noop, fp8_max, force_pow2, epsilon);
  NVTE_CHECK_LAUNCH();
}

}  // namespace nvte::cuda

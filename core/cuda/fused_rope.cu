// cuda/fused_rope.cu - rotary position embedding (fused_rope.h) on the GPU.
//
// Design: one block per output row (the h x d elements of one token), which shares one position:
// the block first finds it (THD: a binary search of cu_seqlens by one thread) and puts cos and
// sin of the row's d2 angles in shared memory (sincosf once per angle, not once per head), then
// its threads walk the row's elements, reading the strided input (the partner channel too) and
// writing the dense output in order, so stores coalesce. The op is memory-bound: two reads per
// rotated element (the partner's is a cache hit) and one write. Channels d2..d are copied.
// The index math and the pairing rule are core/common/rope.h's, shared with the CPU reference.
#include "common.cuh"
#include "fused_rope.h"

#include <cmath>

#include "../common/dtype_switch.h"

namespace nvte::cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(rope::RopeParams p, const T *__restrict__ x, const int32_t *__restrict__ cu,
                const float *__restrict__ freqs, const int32_t *__restrict__ start, T *__restrict__ y) {
  extern __shared__ float cs[];  // cos[0..d2), sin[d2..2 d2)
  __shared__ int64_t row_seq, row_pos;
  const int64_t r = blockIdx.x;
  if (threadIdx.x == 0) {
    int64_t seq, pos;
    if (p.thd) {  // the last sequence starting at or before r
      int64_t lo = 0, hi = p.b;  // invariant: cu[lo] <= r, answer in [lo, hi)
      if (p.b == 0 || cu[0] > r) {
        seq = -1;
      } else {
        while (hi - lo > 1) {
          const int64_t mid = (lo + hi) / 2;
          if (cu[mid] <= r) lo = mid; else hi = mid;
        }
        seq = r < cu[lo + 1] ? lo : -1;
      }
      pos = seq >= 0 ? r - cu[seq] : 0;
    } else {
      rope::dense_row(p, r, seq, pos);
    }
    row_seq = seq;
    row_pos = seq >= 0 ? pos + (start ? start[seq] : 0) : -1;
  }
  __syncthreads();
  const int64_t seq = row_seq, pos = row_pos;
  const bool rotate = seq >= 0, valid = rotate && pos >= 0 && pos < p.freq_rows;
  if (rotate) {
    for (int64_t k = threadIdx.x; k < p.d2; k += blockDim.x) {
      float s = __int_as_float(0x7fc00000), c = s;  // NaN: a position past freqs
      if (valid) sincosf(freqs[pos * p.d2 + k], &s, &c);
      cs[k] = c;
      cs[p.d2 + k] = s;
    }
  }
  __syncthreads();
  const int64_t n = p.h * p.d;
  T *out = y + r * n;
  for (int64_t e = threadIdx.x; e < n; e += blockDim.x) {
    const int64_t hh = e / p.d, k = e - hh * p.d;
    float v = load_f32(x[rope::src_offset(p, r, hh, k)]);
    if (rotate && k < p.d2) {
      float sign;
      const int64_t q = rope::partner(p, k, sign);
      const float w = load_f32(x[rope::src_offset(p, r, hh, q)]);
      v = p.backward ? v * cs[k] - sign * w * cs[p.d2 + q] : v * cs[k] + sign * w * cs[p.d2 + k];
    }
    out[e] = store_f32<T>(v);
  }
}

}  // namespace

void fused_rope(const rope::RopeParams &p, const Tensor &x, const Tensor *cu_seqlens, const Tensor &freqs,
                const Tensor *start, Tensor &y, cudaStream_t stream) {
  if (p.rows == 0) return;
  NVTE_CHECK(p.rows <= INT32_MAX, "fused_rope: ", p.rows, " rows exceed the grid (one block per row)");
  const int32_t *cu = cu_seqlens ? static_cast<const int32_t *>(cu_seqlens->params[kNVTERowwiseData].data_ptr)
                                 : nullptr;
  const int32_t *st = start ? static_cast<const int32_t *>(start->params[kNVTERowwiseData].data_ptr) : nullptr;
  const float *f = static_cast<const float *>(freqs.params[kNVTERowwiseData].data_ptr);
  const size_t smem = 2 * (size_t)p.d2 * sizeof(float);
  with_float_dtype(logical_dtype(x), "input", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!is_fp8_type<T>::value) {
      auto kernel = rope_kernel<T>;
      if (smem > 48 * 1024) resident_blocks((const void *)kernel, kThreads, smem);  // (raises the limit)
      kernel<<<(unsigned)p.rows, kThreads, smem, stream>>>(
          p, static_cast<const T *>(x.params[kNVTERowwiseData].data_ptr), cu, f, st,
          static_cast<T *>(y.params[kNVTERowwiseData].data_ptr));
      NVTE_CHECK_LAUNCH();
    }
  });
}

}  // namespace nvte::cuda

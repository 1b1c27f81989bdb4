// cuda/fused_rope.cu - rotary position embedding (fused_rope.h) on the GPU.
//
// Design: one block per output row (the h x d elements of one token), which shares one position:
// each thread finds it (THD: a binary search of cu_seqlens; context parallelism maps it to this
// rank's chunks, core/common/rope.h), the block puts cos and sin of the
// row's d2 angles in shared memory (sincosf once per angle, not once per head; one barrier),
// then a 2D thread grid (x: units of channels, y: heads) walks the row with no index division. A
// unit is W channels and the W channels they pair with (non-interleaved: the same W in the other
// half; interleaved: W adjacent channels, pairs inside), so each input element is read once and
// each output written once. W = 8 for 16-bit types, 4 for float32 (one 16-byte access) when the
// channels are contiguous and every offset is a multiple of W elements, else 4, else 1. The op is
// memory-bound (bf16, h x d = 4096: 2.4 TB/s of the H100's 3.0 TB/s copy rate). Channels d2..d are
// copied. The pairing rule is core/common/rope.h's, shared with the CPU reference.
#include "common.cuh"
#include "fused_rope.h"

#include <cmath>

#include "../common/dtype_switch.h"

namespace nvte::cuda {
namespace {

constexpr int kThreads = 128;

template <class T, int W>
__device__ __forceinline__ void load_w(const T *p, float *v) {
  if constexpr (W == 1) {
    v[0] = load_f32(p[0]);
  } else {
    const Vec<T, W> w = load_vec<T, W>(p);
#pragma unroll
    for (int i = 0; i < W; ++i) v[i] = load_f32(w.v[i]);
  }
}

template <class T, int W>
__device__ __forceinline__ void store_w(T *p, const float *v) {
  if constexpr (W == 1) {
    p[0] = store_f32<T>(v[0]);
  } else {
    Vec<T, W> w;
#pragma unroll
    for (int i = 0; i < W; ++i) w.v[i] = store_f32<T>(v[i]);
    store_vec<T, W>(p, w);
  }
}

template <class T, int W, bool INTER>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(rope::RopeParams p, const T *__restrict__ x, const int32_t *__restrict__ cu,
                const float *__restrict__ freqs, const int32_t *__restrict__ start, T *__restrict__ y) {
  extern __shared__ float cs[];  // cos[0..d2), sin[d2..2 d2)
  const int64_t r = blockIdx.x;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  // Every thread finds the row's sequence and position itself (a few cached loads): no barrier
  // before the angles.
  int64_t seq, pos;
  const bool splittable = rope::row_position(p, cu, r, seq, pos);
  const bool rotate_row = seq >= 0;
  if (rotate_row) {
    pos += start ? start[seq] : 0;
    const bool valid = splittable && pos >= 0 && pos < p.freq_rows;
    for (int64_t k = tid; k < p.d2; k += nthreads) {
      float sn = __int_as_float(0x7fc00000), c = sn;  // NaN: a position past freqs or a bad CP split
      if (valid) sincosf(freqs[pos * p.d2 + k], &sn, &c);
      cs[k] = c;
      cs[p.d2 + k] = sn;
    }
  }
  __syncthreads();
  const int64_t row_base = rope::src_offset(p, r, 0, 0);
  const float *cosv = cs, *sinv = cs + p.d2;
  const T *xr = x + row_base;
  T *yr = y + r * p.h * p.d;
  const int64_t sd = p.stride_d;
  const int64_t first = rotate_row ? p.d2 : 0;  // channels copied: [first, d)
  constexpr int UW = (INTER && W < 2) ? 2 : W;   // channels of one unit (interleaved: whole pairs)
  const int64_t units = rotate_row ? (INTER ? p.d2 / UW : p.d2 / 2 / UW) : 0;
  const int64_t half = p.d2 / 2;
  for (int64_t hh = threadIdx.y; hh < p.h; hh += blockDim.y) {
    const T *xh = xr + hh * p.stride_h;
    T *yh = yr + hh * p.d;
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      const int64_t c = u * UW;
      if constexpr (INTER) {
        float v[UW], o[UW];
        if constexpr (W == 1) {
          v[0] = load_f32(xh[c * sd]);
          v[1] = load_f32(xh[(c + 1) * sd]);
        } else {
          load_w<T, W>(xh + c, v);
        }
#pragma unroll
        for (int i = 0; i < UW; i += 2)
          rope::rotate_pair(p.backward, v[i], v[i + 1], cosv[c + i], sinv[c + i], cosv[c + i + 1], sinv[c + i + 1],
                            o[i], o[i + 1]);
        if constexpr (W == 1) {
          yh[c] = store_f32<T>(o[0]);
          yh[c + 1] = store_f32<T>(o[1]);
        } else {
          store_w<T, W>(yh + c, o);
        }
      } else {
        float a[W], b[W], oa[W], ob[W];
        load_w<T, W>(xh + c * sd, a);  // (W > 1 only with sd = 1)
        load_w<T, W>(xh + (c + half) * sd, b);
#pragma unroll
        for (int i = 0; i < W; ++i)
          rope::rotate_pair(p.backward, a[i], b[i], cosv[c + i], sinv[c + i], cosv[c + half + i], sinv[c + half + i],
                            oa[i], ob[i]);
        store_w<T, W>(yh + c, oa);
        store_w<T, W>(yh + c + half, ob);
      }
    }
    for (int64_t k = first + threadIdx.x; k < p.d; k += blockDim.x) yh[k] = xh[k * sd];
  }
}

// Whether W-wide accesses are aligned for this call (contiguous channels, every offset a multiple of W).
template <class T>
bool vector_ok(const rope::RopeParams &p, const void *x, const void *y, int w) {
  const int64_t unit = p.interleaved ? p.d2 : p.d2 / 2;
  const uintptr_t bytes = (uintptr_t)w * sizeof(T);
  return p.stride_d == 1 && p.stride_t % w == 0 && p.stride_b % w == 0 && p.stride_h % w == 0 && p.d % w == 0 &&
         unit % w == 0 && (uintptr_t)x % bytes == 0 && (uintptr_t)y % bytes == 0;
}

template <class T, int W, bool INTER>
void launch(const rope::RopeParams &p, const T *x, const int32_t *cu, const float *f, const int32_t *st, T *y,
            cudaStream_t stream) {
  const int64_t units = INTER ? p.d2 / ((W < 2) ? 2 : W) : p.d2 / 2 / W;
  int bx = 1;
  while (bx < units && bx < 128) bx *= 2;
  const dim3 block(bx, kThreads / bx);
  const size_t smem = 2 * (size_t)p.d2 * sizeof(float);
  auto kernel = rope_kernel<T, W, INTER>;
  if (smem > 48 * 1024) resident_blocks((const void *)kernel, kThreads, smem);  // (raises the limit)
  kernel<<<(unsigned)p.rows, block, smem, stream>>>(p, x, cu, f, st, y);
  NVTE_CHECK_LAUNCH();
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
  with_float_dtype(logical_dtype(x), "input", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (!is_fp8_type<T>::value) {
      const T *xp = static_cast<const T *>(x.params[kNVTERowwiseData].data_ptr);
      T *yp = static_cast<T *>(y.params[kNVTERowwiseData].data_ptr);
      // 16-byte accesses where they fit (8 x 16-bit, 4 x 32-bit), else 4 wide, else one element
      const bool w8 = sizeof(T) == 2 && vector_ok<T>(p, xp, yp, 8), w4 = vector_ok<T>(p, xp, yp, 4);
      with_bool(p.interleaved, [&](auto kInter) {
        if constexpr (sizeof(T) == 2) {
          if (w8) return launch<T, 8, kInter>(p, xp, cu, f, st, yp, stream);
        }
        if (w4) return launch<T, 4, kInter>(p, xp, cu, f, st, yp, stream);
        launch<T, 1, kInter>(p, xp, cu, f, st, yp, stream);
      });
    }
  });
}

}  // namespace nvte::cuda

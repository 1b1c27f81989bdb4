// cuda/attn_softmax.cu - the unfused attention softmax (nvte_attn_softmax_*, softmax.h) on the GPU.
//
// Design: a group of G threads owns a row (b, h, i): one warp (several rows per block) for rows
// up to 1024 keys, a block of 256 beyond. Each logit is built once from the score, the bias
// element or ALiBi term, and the masks (the rules of common/attn_softmax.h, as the CPU builds
// them) and kept in the group's slice of dynamic shared memory, so the row's score and bias are
// read from global memory once and y written once; rows whose logits do not fit (over ~24k keys)
// rebuild them in each of the three passes (max, sum, write) instead. A thread only touches the
// shared slots it wrote, so only the reductions synchronise. Keys past a causal row's last
// visible one are neither read nor built. Reading the bias through a run-time dtype switch
// costs nothing measurable next to its load; the score and output dtype is a template argument.
// The backward reads dy and y twice (the second time from cache) and writes dx (and the logit
// and sink gradients when asked); dy and the outputs take any float dtype (run-time switch).
#include <climits>

#include "../common/attn_softmax.h"
#include "attn_softmax.h"
#include "common.cuh"
#include "row_reduce.cuh"

namespace nvte::cuda {
namespace {

using attn::SoftmaxArgs;

struct FwdParams {
  SoftmaxArgs a;
  const void *x = nullptr;
  void *y = nullptr;
  float *sink = nullptr;
  size_t rows = 0;
  bool staged = false;  // logits kept in shared memory
};

struct BwdParams {
  SoftmaxArgs a;
  const void *dy = nullptr, *y = nullptr;
  void *dx = nullptr, *lg = nullptr;
  NVTEDType dy_dt = kNVTEFloat32, dx_dt = kNVTEFloat32, lg_dt = kNVTEFloat32;
  const float *sink = nullptr;
  float *dsink = nullptr;
  size_t rows = 0;
};

// What a row needs to build its logits.
struct Row {
  size_t base;         // offset of element (row, 0) in x / y
  size_t bias_base;    // of the bias row
  const uint8_t *mrow;  // explicit mask row or null
  float slope;
  long long u;  // i + ALiBi diagonal
  size_t n;     // keys [0, n) in the row (causal)
  size_t hh;
};

__device__ __forceinline__ Row row_of(const SoftmaxArgs &a, size_t r) {
  Row w;
  const size_t i = r % a.sq, hh = (r / a.sq) % a.h, bb = r / (a.sq * a.h);
  w.base = r * a.sk;
  w.bias_base = attn::broadcast_row(a.bias_sb, a.bias_sh, bb, hh, i, a.sk);
  w.mrow = a.mask ? a.mask + attn::broadcast_row(a.mask_sb, a.mask_sh, bb, hh, i, a.sk) : nullptr;
  const bool alibi = a.bias_type == attn::ScoreBias::Alibi;
  w.slope = alibi ? attn::score_slope(a, bb, hh) : 0.0f;
  w.u = alibi ? (long long)i + a.diag[bb * a.diag_sb] : 0;
  w.n = attn::causal_keys(a, i);
  w.hh = hh;
  return w;
}

template <class T>
__device__ __forceinline__ float logit_at(const FwdParams &p, const Row &w, size_t j) {
  if (w.mrow != nullptr && w.mrow[j]) return attn::kMaskedLogit;
  const float bv = p.a.bias != nullptr ? ld<AnyT>(p.a.bias, w.bias_base + j, p.a.bias_dtype) : 0.0f;
  return attn::score_logit(p.a, p.a.scale * ld<T>(p.x, w.base + j, kNVTEFloat32), bv, w.slope, w.u, j);
}

constexpr int kRowThreads = 128;  // block size of warp-per-row kernels

template <int G>
constexpr int threads_of() {
  return G > 32 ? G : kRowThreads;
}

template <class T, int G>
__global__ void __launch_bounds__(threads_of<G>()) attn_softmax_fwd_kernel(const FwdParams p) {
  extern __shared__ float stage[];
  __shared__ float sh[G > 32 ? G / 32 : 1];
  constexpr int kGroups = threads_of<G>() / G;
  const int t = G > 32 ? (int)threadIdx.x : (int)(threadIdx.x & 31);
  const int grp = G > 32 ? 0 : (int)(threadIdx.x >> 5);
  float *z = stage + (p.staged ? (size_t)grp * p.a.sk : 0);
  const size_t sk = p.a.sk;
  for (size_t r = (size_t)blockIdx.x * kGroups + grp; r < p.rows; r += (size_t)gridDim.x * kGroups) {
    const Row w = row_of(p.a, r);
    float m = p.a.offset ? p.a.offset[w.hh] : -__builtin_huge_valf();
    for (size_t j = t; j < w.n; j += G) {
      const float v = logit_at<T>(p, w, j);
      if (p.staged) z[j] = v;
      m = fmaxf(m, v);
    }
    m = group_max<G>(m, sh);
    float sum = 0.0f;
    for (size_t j = t; j < w.n; j += G) {
      const float e = exp_nonpos((p.staged ? z[j] : logit_at<T>(p, w, j)) - m);
      if (p.staged) z[j] = e;
      sum += e;
    }
    sum = group_sum<G>(sum, sh);
    const float es = p.a.offset ? exp_nonpos(p.a.offset[w.hh] - m) : 0.0f;
    sum += es;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row with nothing in it: zeros
    for (size_t j = t; j < sk; j += G) {
      float v = 0.0f;
      if (j < w.n) v = (p.staged ? z[j] : exp_nonpos(logit_at<T>(p, w, j) - m)) * inv;
      st<T>(p.y, w.base + j, v, kNVTEFloat32);
    }
    if (p.sink != nullptr && t == 0) p.sink[r] = es * inv;
  }
}

template <class T, int G>
__global__ void __launch_bounds__(threads_of<G>()) attn_softmax_bwd_kernel(const BwdParams p) {
  __shared__ float sh[G > 32 ? G / 32 : 1];
  constexpr int kGroups = threads_of<G>() / G;
  const int t = G > 32 ? (int)threadIdx.x : (int)(threadIdx.x & 31);
  const int grp = G > 32 ? 0 : (int)(threadIdx.x >> 5);
  const size_t sk = p.a.sk;
  for (size_t r = (size_t)blockIdx.x * kGroups + grp; r < p.rows; r += (size_t)gridDim.x * kGroups) {
    const Row w = row_of(p.a, r);
    float dot = 0.0f;
    for (size_t j = t; j < sk; j += G) dot += ld<AnyT>(p.dy, w.base + j, p.dy_dt) * ld<T>(p.y, w.base + j, kNVTEFloat32);
    dot = group_sum<G>(dot, sh);
    for (size_t j = t; j < sk; j += G) {
      const float yv = ld<T>(p.y, w.base + j, kNVTEFloat32);
      float g = yv * (ld<AnyT>(p.dy, w.base + j, p.dy_dt) - dot);
      if (w.mrow != nullptr && w.mrow[j]) g = 0.0f;
      if (p.lg != nullptr) st<AnyT>(p.lg, w.base + j, g, p.lg_dt);
      st<AnyT>(p.dx, w.base + j, p.a.scale * g, p.dx_dt);
    }
    if (p.dsink != nullptr && t == 0) p.dsink[r] = -p.sink[r] * dot;
  }
}

unsigned grid_of(size_t rows, int rows_per_block) {
  const size_t want = (rows + rows_per_block - 1) / rows_per_block;
  return (unsigned)(want > (size_t)INT_MAX ? (size_t)INT_MAX : want);
}

constexpr size_t kMaxStageBytes = 96 * 1024;  // dynamic shared memory a block-per-row kernel may stage

template <class T, int G>
void launch_fwd(FwdParams p, cudaStream_t stream) {
  constexpr int threads = threads_of<G>();
  constexpr int rows_per_block = threads / G;
  const size_t bytes = rows_per_block * p.a.sk * sizeof(float);
  p.staged = bytes <= kMaxStageBytes;
  const size_t smem = p.staged ? bytes : 0;
  if (smem > 48 * 1024) {
    NVTE_CHECK_CUDA(cudaFuncSetAttribute(attn_softmax_fwd_kernel<T, G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)kMaxStageBytes));
  }
  attn_softmax_fwd_kernel<T, G><<<grid_of(p.rows, rows_per_block), threads, smem, stream>>>(p);
  NVTE_CHECK_LAUNCH();
}

template <class T, int G>
void launch_bwd(const BwdParams &p, cudaStream_t stream) {
  constexpr int threads = threads_of<G>();
  attn_softmax_bwd_kernel<T, G><<<grid_of(p.rows, threads / G), threads, 0, stream>>>(p);
  NVTE_CHECK_LAUNCH();
}

const NVTEBasicTensor &data(const Tensor &t) { return t.params[kNVTERowwiseData]; }

}  // namespace

void attn_softmax_forward(const SoftmaxArgs &a, const Tensor &in, Tensor &out, Tensor *sink_probs,
                          cudaStream_t stream) {
  FwdParams p;
  p.a = a;
  p.x = data(in).data_ptr;
  p.y = data(out).data_ptr;
  p.sink = sink_probs ? static_cast<float *>(data(*sink_probs).data_ptr) : nullptr;
  p.rows = a.b * a.h * a.sq;
  if (p.rows == 0) return;
  NVTE_CHECK_SUPPORTED(a.sk <= (size_t)INT_MAX, "rows of ", a.sk, " keys are too long");
  const bool warp = a.sk <= 1024;
  switch (data(in).dtype) {
    case kNVTEFloat32: return warp ? launch_fwd<float, 32>(p, stream) : launch_fwd<float, 256>(p, stream);
    case kNVTEFloat16: return warp ? launch_fwd<fp16, 32>(p, stream) : launch_fwd<fp16, 256>(p, stream);
    case kNVTEBFloat16: return warp ? launch_fwd<bf16, 32>(p, stream) : launch_fwd<bf16, 256>(p, stream);
    default: NVTE_FAIL(NVTE_ERROR_INTERNAL, "unexpected attn_softmax dtype ", dtype_name(data(in).dtype));
  }
}

void attn_softmax_backward(const SoftmaxArgs &a, const Tensor &dy, const Tensor &y, const Tensor *sink_probs,
                           Tensor &dx, Tensor *logit_grads, Tensor *offset_grads, cudaStream_t stream) {
  BwdParams p;
  p.a = a;
  p.dy = data(dy).data_ptr;
  p.y = data(y).data_ptr;
  p.dy_dt = data(dy).dtype;
  p.dx = data(dx).data_ptr;
  p.dx_dt = data(dx).dtype;
  p.lg = logit_grads ? data(*logit_grads).data_ptr : nullptr;
  p.lg_dt = logit_grads ? data(*logit_grads).dtype : kNVTEFloat32;
  p.sink = sink_probs ? static_cast<const float *>(data(*sink_probs).data_ptr) : nullptr;
  p.dsink = offset_grads ? static_cast<float *>(data(*offset_grads).data_ptr) : nullptr;
  p.rows = a.b * a.h * a.sq;
  if (p.rows == 0) return;
  NVTE_CHECK_SUPPORTED(a.sk <= (size_t)INT_MAX, "rows of ", a.sk, " keys are too long");
  const bool warp = a.sk <= 1024;
  switch (data(y).dtype) {
    case kNVTEFloat32: return warp ? launch_bwd<float, 32>(p, stream) : launch_bwd<float, 256>(p, stream);
    case kNVTEFloat16: return warp ? launch_bwd<fp16, 32>(p, stream) : launch_bwd<fp16, 256>(p, stream);
    case kNVTEBFloat16: return warp ? launch_bwd<bf16, 32>(p, stream) : launch_bwd<bf16, 256>(p, stream);
    default: NVTE_FAIL(NVTE_ERROR_INTERNAL, "unexpected attn_softmax dtype ", dtype_name(data(y).dtype));
  }
}

}  // namespace nvte::cuda

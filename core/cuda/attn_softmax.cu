// cuda/attn_softmax.cu - the unfused attention softmax (nvte_attn_softmax_*, softmax.h) on the GPU.
//
// Design: a group of G threads owns a row (b, h, i): one warp (several rows per block) for rows
// up to 1024 keys, a block of 256 beyond. Threads take the row in chunks of V contiguous
// elements (16 bytes of the score dtype), loaded and stored as vectors when every buffer is
// aligned and Sk % V == 0, element by element otherwise. Each logit is built once from the
// score, the bias element or ALiBi term, and the masks (the rules of common/attn_softmax.h, as
// the CPU builds them) and kept in the group's slice of dynamic shared memory, so scores and bias
// are read from global memory once and y written once. Rows of vector chunks up to 8 per thread
// (8192 keys of 16-bit scores) keep their logits in registers instead (a compile-time chunk
// count), which spares the shared-memory round trips; rows whose logits do not fit in shared
// memory either (over ~24k keys) rebuild them in each of the three passes (max, sum, write). A thread only
// touches the shared slots it wrote, so only the reductions synchronise. Chunks past a causal
// row's last visible key are neither read nor built. y is written in the score dtype or float32
// (the latter keeps the probabilities exact for a backward that needs them: the sink gradient).
// The backward reads dy and y twice (the second time from cache) and writes dx (and the logit
// and sink gradients when asked); uncommon dtype mixes run one run-time-typed scalar kernel.
#include <climits>
#include <type_traits>

#include "../common/attn_softmax.h"
#include "attn_softmax.h"
#include "common.cuh"
#include "softmax_rows.cuh"

namespace nvte::cuda {
namespace {

using attn::SoftmaxArgs;

struct FwdParams {
  SoftmaxArgs a;
  const void *x = nullptr;
  void *y = nullptr;
  float *sink = nullptr;
  size_t rows = 0;
  bool staged = false;     // logits kept in shared memory
  bool bias_vec = false;   // the bias has the score dtype and vector alignment
};

struct BwdParams {
  SoftmaxArgs a;
  const void *dy = nullptr, *y = nullptr;
  void *dx = nullptr, *lg = nullptr;
  NVTEDType dy_dt = kNVTEFloat32, y_dt = kNVTEFloat32, dx_dt = kNVTEFloat32, lg_dt = kNVTEFloat32;
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

// The additive term of the logits, fixed at compile time on the vector path (the per-element
// switch and the 64-bit ALiBi distance cost the forward a third of its speed): kAnyTerm decides
// per element (attn::score_logit), kNoTerm / kBiasTerm / kAlibiTerm are the bias types' own.
enum TermKind : int { kAnyTerm = -1, kNoTerm = 0, kBiasTerm = 1, kAlibiTerm = 2 };

// Logits of the chunk at j0 (keys >= w.n: -inf; the caller keeps j0 < w.n).
template <class T, int V, int TK>
__device__ __forceinline__ void logits_at(const FwdParams &p, const Row &w, size_t j0, float *z) {
  float x[V], bv[V];
  load_chunk<T, V>(p.x, w.base + j0, x);
  if (TK == kNoTerm || TK == kAlibiTerm || (TK == kAnyTerm && p.a.bias == nullptr)) {
#pragma unroll
    for (int e = 0; e < V; ++e) bv[e] = 0.0f;
  } else if (p.bias_vec) {
    load_chunk<T, V>(p.a.bias, w.bias_base + j0, bv);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) bv[e] = ld<AnyT>(p.a.bias, w.bias_base + j0 + e, p.a.bias_dtype);
  }
  // ALiBi distances |u - j| of the chunk in float: exact while |u - j| < 2^24
  const float d0 = TK == kAlibiTerm ? (float)(w.u - (long long)j0) : 0.0f;
  const float coef = p.a.bias_type == attn::ScoreBias::PreScale ? p.a.scale : 1.0f;
#pragma unroll
  for (int e = 0; e < V; ++e) {
    const size_t j = j0 + e;
    float v;
    if constexpr (TK == kAnyTerm) {
      v = attn::score_logit(p.a, p.a.scale * x[e], bv[e], w.slope, w.u, j);
    } else if constexpr (TK == kBiasTerm) {
      v = p.a.scale * x[e] + coef * bv[e];
    } else if constexpr (TK == kAlibiTerm) {
      v = p.a.scale * x[e] - w.slope * fabsf(d0 - (float)e);
    } else {
      v = p.a.scale * x[e];
    }
    if (w.mrow != nullptr && w.mrow[j]) v = attn::kMaskedLogit;
    z[e] = j < w.n ? v : -__builtin_huge_valf();
  }
}

constexpr int kRowThreads = 128;  // block size of warp-per-row kernels

template <int G>
constexpr int threads_of() {
  return G > 32 ? G : kRowThreads;
}

// Chunks of a row: thread t takes chunks t, t + G, ...; chunk c covers elements [c V, c V + V).
template <class T, class TO, int G, int V, int TK>
__global__ void __launch_bounds__(threads_of<G>()) attn_softmax_fwd_kernel(const FwdParams p) {
  extern __shared__ float stage[];
  __shared__ float sh[G > 32 ? G / 32 : 1];
  constexpr int kGroups = threads_of<G>() / G;
  const int t = G > 32 ? (int)threadIdx.x : (int)(threadIdx.x & 31);
  const int grp = G > 32 ? 0 : (int)(threadIdx.x >> 5);
  const size_t sk = p.a.sk;
  // Element e of chunk c sits at slot e * C + c of the group's C * V floats (C = chunks in a
  // row): consecutive lanes touch consecutive words, free of bank conflicts.
  const size_t C = (sk + V - 1) / V;
  float *zs = stage + (p.staged ? (size_t)grp * C * V : 0);
  for (size_t r = (size_t)blockIdx.x * kGroups + grp; r < p.rows; r += (size_t)gridDim.x * kGroups) {
    const Row w = row_of(p.a, r);
    float m = -__builtin_huge_valf();  // the keys' largest logit, then the row's (with the sink)
    for (size_t j0 = (size_t)t * V; j0 < w.n; j0 += (size_t)G * V) {
      float z[V];
      logits_at<T, V, TK>(p, w, j0, z);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        if (p.staged) zs[e * C + j0 / V] = z[e];
        m = fmaxf(m, z[e]);
      }
    }
    m = group_max<G>(m, sh);
    const bool none = attn::keys_left_out(m, w.mrow != nullptr);  // (then y = 0 for every key)
    if (p.a.offset) m = none ? p.a.offset[w.hh] : fmaxf(m, p.a.offset[w.hh]);
    float sum = 0.0f;
    for (size_t j0 = (size_t)t * V; j0 < w.n; j0 += (size_t)G * V) {
      float z[V];
      if (p.staged) {
#pragma unroll
        for (int e = 0; e < V; ++e) z[e] = zs[e * C + j0 / V];
      } else {
        logits_at<T, V, TK>(p, w, j0, z);
      }
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float ex = none ? 0.0f : exp_nonpos(z[e] - m);  // (keys past n: exp(-inf) = 0)
        if (p.staged) zs[e * C + j0 / V] = ex;
        sum += ex;
      }
    }
    sum = group_sum<G>(sum, sh);
    const float es = p.a.offset ? exp_nonpos(p.a.offset[w.hh] - m) : 0.0f;
    sum += es;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row with nothing in it: zeros
    for (size_t j0 = (size_t)t * V; j0 < sk; j0 += (size_t)G * V) {
      float y[V];
      if (j0 >= w.n) {
#pragma unroll
        for (int e = 0; e < V; ++e) y[e] = 0.0f;
      } else if (p.staged) {
#pragma unroll
        for (int e = 0; e < V; ++e) y[e] = zs[e * C + j0 / V] * inv;
      } else {
        logits_at<T, V, TK>(p, w, j0, y);
#pragma unroll
        for (int e = 0; e < V; ++e) y[e] = none ? 0.0f : exp_nonpos(y[e] - m) * inv;
      }
      store_chunk<TO, V>(p.y, w.base + j0, y);
    }
    if (p.sink != nullptr && t == 0) p.sink[r] = es * inv;
  }
}

// The same with the row in registers: thread t holds chunks t, t + G, ..., NC of them (the
// dispatch picks NC >= the row's chunks per thread; chunks past the row hold -inf, then 0).
template <class T, class TO, int G, int V, int TK, int NC>
__global__ void __launch_bounds__(threads_of<G>()) attn_softmax_fwd_reg_kernel(const FwdParams p) {
  __shared__ float sh[G > 32 ? G / 32 : 1];
  constexpr int kGroups = threads_of<G>() / G;
  const int t = G > 32 ? (int)threadIdx.x : (int)(threadIdx.x & 31);
  const int grp = G > 32 ? 0 : (int)(threadIdx.x >> 5);
  const size_t sk = p.a.sk;
  for (size_t r = (size_t)blockIdx.x * kGroups + grp; r < p.rows; r += (size_t)gridDim.x * kGroups) {
    const Row w = row_of(p.a, r);
    float z[NC][V];
    float m = -__builtin_huge_valf();  // the keys' largest logit, then the row's (with the sink)
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const size_t j0 = ((size_t)c * G + t) * V;
      if (j0 < w.n) {
        logits_at<T, V, TK>(p, w, j0, z[c]);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) z[c][e] = -__builtin_huge_valf();
      }
#pragma unroll
      for (int e = 0; e < V; ++e) m = fmaxf(m, z[c][e]);
    }
    m = group_max<G>(m, sh);
    const bool none = attn::keys_left_out(m, w.mrow != nullptr);  // (then y = 0 for every key)
    if (p.a.offset) m = none ? p.a.offset[w.hh] : fmaxf(m, p.a.offset[w.hh]);
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        z[c][e] = none ? 0.0f : exp_nonpos(z[c][e] - m);  // (-inf - m: 0 for a finite m)
        sum += z[c][e];
      }
    }
    sum = group_sum<G>(sum, sh);
    const float es = p.a.offset ? exp_nonpos(p.a.offset[w.hh] - m) : 0.0f;
    sum += es;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row with nothing in it: zeros
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const size_t j0 = ((size_t)c * G + t) * V;
      if (j0 >= sk) continue;
#pragma unroll
      for (int e = 0; e < V; ++e) z[c][e] = j0 < w.n ? z[c][e] * inv : 0.0f;
      store_chunk<TO, V>(p.y, w.base + j0, z[c]);
    }
    if (p.sink != nullptr && t == 0) p.sink[r] = es * inv;
  }
}

// The chunk at `off` of dy (TG) and y (TY); AnyT: run-time dtypes, V = 1.
template <class TY, class TG, int V>
__device__ __forceinline__ void load_grads(const BwdParams &p, size_t off, float *g, float *y) {
  if constexpr (std::is_same_v<TG, AnyT>) {
    g[0] = ld<AnyT>(p.dy, off, p.dy_dt);
    y[0] = ld<AnyT>(p.y, off, p.y_dt);
  } else {
    load_chunk<TG, V>(p.dy, off, g);
    load_chunk<TY, V>(p.y, off, y);
  }
}

// dy, dx and logit grads in TG, y in TY (AnyT: run-time dtypes, V = 1).
template <class TY, class TG, int G, int V>
__global__ void __launch_bounds__(threads_of<G>()) attn_softmax_bwd_kernel(const BwdParams p) {
  __shared__ float sh[G > 32 ? G / 32 : 1];
  constexpr int kGroups = threads_of<G>() / G;
  constexpr bool kAny = std::is_same_v<TG, AnyT>;
  const int t = G > 32 ? (int)threadIdx.x : (int)(threadIdx.x & 31);
  const int grp = G > 32 ? 0 : (int)(threadIdx.x >> 5);
  const size_t sk = p.a.sk;
  for (size_t r = (size_t)blockIdx.x * kGroups + grp; r < p.rows; r += (size_t)gridDim.x * kGroups) {
    const Row w = row_of(p.a, r);
    float dot = 0.0f;
    for (size_t j0 = (size_t)t * V; j0 < w.n; j0 += (size_t)G * V) {
      float g[V], y[V];
      load_grads<TY, TG, V>(p, w.base + j0, g, y);
#pragma unroll
      for (int e = 0; e < V; ++e) dot += j0 + e < w.n ? g[e] * y[e] : 0.0f;
    }
    dot = group_sum<G>(dot, sh);
    for (size_t j0 = (size_t)t * V; j0 < sk; j0 += (size_t)G * V) {
      float g[V], y[V];
      if (j0 >= w.n) {  // left out of the row: zero, unread
#pragma unroll
        for (int e = 0; e < V; ++e) g[e] = y[e] = 0.0f;
      } else {
        load_grads<TY, TG, V>(p, w.base + j0, g, y);
      }
#pragma unroll
      for (int e = 0; e < V; ++e) {
        g[e] = y[e] * (g[e] - dot);
        if (j0 + e >= w.n || (w.mrow != nullptr && w.mrow[j0 + e])) g[e] = 0.0f;
      }
      if constexpr (kAny) {
        if (p.lg != nullptr) st<AnyT>(p.lg, w.base + j0, g[0], p.lg_dt);
        st<AnyT>(p.dx, w.base + j0, p.a.scale * g[0], p.dx_dt);
      } else {
        if (p.lg != nullptr) store_chunk<TG, V>(p.lg, w.base + j0, g);
#pragma unroll
        for (int e = 0; e < V; ++e) g[e] *= p.a.scale;
        store_chunk<TG, V>(p.dx, w.base + j0, g);
      }
    }
    if (p.dsink != nullptr && t == 0) p.dsink[r] = -p.sink[r] * dot;
  }
}

unsigned grid_of(size_t rows, int rows_per_block) {
  const size_t want = (rows + rows_per_block - 1) / rows_per_block;
  return (unsigned)(want > (size_t)INT_MAX ? (size_t)INT_MAX : want);
}

constexpr size_t kMaxStageBytes = 96 * 1024;  // dynamic shared memory a block-per-row kernel may stage

const NVTEBasicTensor &data(const Tensor &t) { return t.params[kNVTERowwiseData]; }

template <class T>
constexpr NVTEDType data_dtype() {
  if constexpr (std::is_same_v<T, fp16>) return kNVTEFloat16;
  if constexpr (std::is_same_v<T, bf16>) return kNVTEBFloat16;
  return kNVTEFloat32;
}

template <class T, class TO, int G, int V, int TK>
void launch_fwd(FwdParams p, cudaStream_t stream) {
  constexpr int threads = threads_of<G>();
  constexpr int rows_per_block = threads / G;
  const size_t bytes = rows_per_block * ((p.a.sk + V - 1) / V) * V * sizeof(float);
  p.staged = bytes <= kMaxStageBytes;
  const size_t smem = p.staged ? bytes : 0;
  if (smem > 48 * 1024) {
    allow_dynamic_smem(reinterpret_cast<const void *>(attn_softmax_fwd_kernel<T, TO, G, V, TK>), kMaxStageBytes);
  }
  attn_softmax_fwd_kernel<T, TO, G, V, TK><<<grid_of(p.rows, rows_per_block), threads, smem, stream>>>(p);
  NVTE_CHECK_LAUNCH();
}

template <class T, class TO, int G, int V, int TK, int NC>
void launch_fwd_reg(const FwdParams &p, cudaStream_t stream) {
  constexpr int threads = threads_of<G>();
  attn_softmax_fwd_reg_kernel<T, TO, G, V, TK, NC><<<grid_of(p.rows, threads / G), threads, 0, stream>>>(p);
  NVTE_CHECK_LAUNCH();
}

// Vector rows: in registers when a thread's chunks fit NC <= 8 (the smallest of 2, 4, 8 that
// holds them), else staged in shared memory / rebuilt.
template <class T, class TO, int G, int V, int TK>
void launch_fwd_vec(const FwdParams &p, cudaStream_t stream) {
  const size_t per_thread = (p.a.sk + (size_t)G * V - 1) / ((size_t)G * V);
  if (per_thread <= 2) return launch_fwd_reg<T, TO, G, V, TK, 2>(p, stream);
  if (per_thread <= 4) return launch_fwd_reg<T, TO, G, V, TK, 4>(p, stream);
  if (per_thread <= 8) return launch_fwd_reg<T, TO, G, V, TK, 8>(p, stream);
  launch_fwd<T, TO, G, V, TK>(p, stream);
}

// Vector chunks when Sk is a multiple of V and the buffers are aligned to V elements.
template <class T, class TO>
void launch_fwd_typed(FwdParams p, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = p.a.sk % V == 0 && aligned(p.x, V * sizeof(T)) && aligned(p.y, V * sizeof(TO));
  p.bias_vec = vec && p.a.bias != nullptr && p.a.bias_dtype == data_dtype<T>() && aligned(p.a.bias, V * sizeof(T));
  const bool warp = p.a.sk <= 1024;
  if (!vec) {
    return warp ? launch_fwd<T, TO, 32, 1, kAnyTerm>(p, stream) : launch_fwd<T, TO, 256, 1, kAnyTerm>(p, stream);
  }
  if (p.a.bias != nullptr) {
    return warp ? launch_fwd_vec<T, TO, 32, V, kBiasTerm>(p, stream)
                : launch_fwd_vec<T, TO, 256, V, kBiasTerm>(p, stream);
  }
  if (p.a.bias_type == attn::ScoreBias::Alibi) {
    return warp ? launch_fwd_vec<T, TO, 32, V, kAlibiTerm>(p, stream)
                : launch_fwd_vec<T, TO, 256, V, kAlibiTerm>(p, stream);
  }
  return warp ? launch_fwd_vec<T, TO, 32, V, kNoTerm>(p, stream) : launch_fwd_vec<T, TO, 256, V, kNoTerm>(p, stream);
}

template <class T>
void launch_fwd_out(FwdParams p, NVTEDType out_dt, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (out_dt == kNVTEFloat32) return launch_fwd_typed<T, float>(p, stream);
  }
  launch_fwd_typed<T, T>(p, stream);
}

template <class TY, class TG, int G, int V>
void launch_bwd(const BwdParams &p, cudaStream_t stream) {
  constexpr int threads = threads_of<G>();
  attn_softmax_bwd_kernel<TY, TG, G, V><<<grid_of(p.rows, threads / G), threads, 0, stream>>>(p);
  NVTE_CHECK_LAUNCH();
}

template <class TY, class TG>
void launch_bwd_typed(const BwdParams &p, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(TG);
  const bool vec = p.a.sk % V == 0 && aligned(p.dy, V * sizeof(TG)) && aligned(p.y, V * sizeof(TY)) &&
                   aligned(p.dx, V * sizeof(TG)) && (p.lg == nullptr || aligned(p.lg, V * sizeof(TG)));
  const bool warp = p.a.sk <= 1024;
  if (vec) return warp ? launch_bwd<TY, TG, 32, V>(p, stream) : launch_bwd<TY, TG, 256, V>(p, stream);
  return warp ? launch_bwd<TY, TG, 32, 1>(p, stream) : launch_bwd<TY, TG, 256, 1>(p, stream);
}

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
  const NVTEDType out_dt = data(out).dtype;
  switch (data(in).dtype) {
    case kNVTEFloat32: return launch_fwd_out<float>(p, out_dt, stream);
    case kNVTEFloat16: return launch_fwd_out<fp16>(p, out_dt, stream);
    case kNVTEBFloat16: return launch_fwd_out<bf16>(p, out_dt, stream);
    default: NVTE_FAIL(NVTE_ERROR_INTERNAL, "unexpected attn_softmax dtype ", dtype_name(data(in).dtype));
  }
}

void attn_softmax_backward(const SoftmaxArgs &a, const Tensor &dy, const Tensor &y, const Tensor *sink_probs,
                           Tensor &dx, Tensor *logit_grads, Tensor *offset_grads, cudaStream_t stream) {
  BwdParams p;
  p.a = a;
  p.dy = data(dy).data_ptr;
  p.dy_dt = data(dy).dtype;
  p.y = data(y).data_ptr;
  p.y_dt = data(y).dtype;
  p.dx = data(dx).data_ptr;
  p.dx_dt = data(dx).dtype;
  p.lg = logit_grads ? data(*logit_grads).data_ptr : nullptr;
  p.lg_dt = logit_grads ? data(*logit_grads).dtype : p.dx_dt;
  p.sink = sink_probs ? static_cast<const float *>(data(*sink_probs).data_ptr) : nullptr;
  p.dsink = offset_grads ? static_cast<float *>(data(*offset_grads).data_ptr) : nullptr;
  p.rows = a.b * a.h * a.sq;
  if (p.rows == 0) return;
  NVTE_CHECK_SUPPORTED(a.sk <= (size_t)INT_MAX, "rows of ", a.sk, " keys are too long");
  // Typed kernels: dy, dx (and logit grads) of one dtype, y of it or float32; else run-time typed.
  const NVTEDType g = p.dy_dt;
  const bool typed = p.dx_dt == g && p.lg_dt == g && (p.y_dt == g || p.y_dt == kNVTEFloat32);
  const bool y32 = p.y_dt == kNVTEFloat32;
  if (typed && g == kNVTEFloat32) return launch_bwd_typed<float, float>(p, stream);
  if (typed && g == kNVTEFloat16) return y32 ? launch_bwd_typed<float, fp16>(p, stream)
                                             : launch_bwd_typed<fp16, fp16>(p, stream);
  if (typed && g == kNVTEBFloat16) return y32 ? launch_bwd_typed<float, bf16>(p, stream)
                                              : launch_bwd_typed<bf16, bf16>(p, stream);
  return a.sk <= 1024 ? launch_bwd<AnyT, AnyT, 32, 1>(p, stream) : launch_bwd<AnyT, AnyT, 256, 1>(p, stream);
}

}  // namespace nvte::cuda

// cuda/activation.cu - the activations (activation.h) on the GPU.
//
// Design: one elementwise and one gated kernel template, parameterised by the activation
// (nvte::Act: each instantiation inlines one formula of activation_math.h, the float32 code
// the CPU runs too), by forward/backward and by the storage types. Both kernels are
// memory-bound grid-stride loops. When every pointer is 16-byte aligned a thread moves chunks
// of N elements, N chosen so that every access of every tensor is made of whole 16-byte
// vectors (e.g. 16 bf16 in -> 16 FP8 out), with several chunks loaded before the first store;
// otherwise (misaligned pointers, a gated half width that is not a multiple of N, a
// columnwise output) a scalar loop does the work, and the elementwise kernel finishes the
// last n % N elements with it. The FP8 rule of cast.h is applied in-kernel: scale read from
// its device pointer, amax (of the unscaled values) reduced per block into one atomic,
// scale_inv written by one thread. A grad whose dtype differs from the input's (rare) runs
// the one instantiation that converts through a run-time dtype switch.
#include <type_traits>

#include "../common/dtype_switch.h"
#include "activation.h"
#include "common.cuh"
#include "pdl.cuh"

namespace nvte::cuda {
namespace {

constexpr int kThreads = 256;


// Elements per 16 bytes, and the chunk length that makes all the tensors' accesses whole
// 16-byte vectors.
template <class T>
constexpr int per16() {
  return std::is_same_v<T, AnyT> ? 1 : 16 / (int)sizeof(T);
}
template <class A, class B, class C>
constexpr int chunk_elems() {
  constexpr int a = per16<A>(), b = per16<B>(), c = per16<C>();
  return a > b ? (a > c ? a : c) : (b > c ? b : c);
}

// f[0..N) = elements [off, off + N) of p, read as 16-byte vectors (p + off 16-byte aligned).
template <class T, int N>
__device__ __forceinline__ void load_chunk(const void *p, size_t off, float (&f)[N]) {
  constexpr int P = per16<T>();
  static_assert(N % P == 0, "chunk must be whole vectors");
  const T *q = static_cast<const T *>(p) + off;
#pragma unroll
  for (int k = 0; k < N / P; ++k) {
    const Vec<T, P> v = load_vec<T, P>(q + k * P);
#pragma unroll
    for (int e = 0; e < P; ++e) f[k * P + e] = load_f32(v.v[e]);
  }
}
// FP8 values are converted in pairs (cvt.satfinite.*x2: the single conversion's rounding,
// half the instructions).
template <class T, int N>
__device__ __forceinline__ void store_chunk(void *p, size_t off, const float (&f)[N]) {
  constexpr int P = per16<T>();
  static_assert(N % P == 0, "chunk must be whole vectors");
  T *q = static_cast<T *>(p) + off;
#pragma unroll
  for (int k = 0; k < N / P; ++k) {
    if constexpr (is_fp8_type<T>::value) {
      constexpr __nv_fp8_interpretation_t kKind = std::is_same_v<T, fp8e4m3> ? __NV_E4M3 : __NV_E5M2;
      uint32_t w[P / 4];
#pragma unroll
      for (int i = 0; i < P / 4; ++i) {
        const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(f[k * P + 4 * i], f[k * P + 4 * i + 1]),
                                                     __NV_SATFINITE, kKind);
        const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(f[k * P + 4 * i + 2], f[k * P + 4 * i + 3]),
                                                     __NV_SATFINITE, kKind);
        w[i] = lo | (hi << 16);
      }
      *reinterpret_cast<uint4 *>(q + k * P) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
      Vec<T, P> v;
#pragma unroll
      for (int e = 0; e < P; ++e) v.v[e] = store_f32<T>(f[k * P + e]);
      store_vec<T, P>(q + k * P, v);
    }
  }
}

struct ActParams {
  const void *in = nullptr, *grad = nullptr;
  void *out = nullptr, *out_col = nullptr;  // rowwise [rows, ocols] / columnwise [ocols, rows]
  size_t rows = 0, cols = 0;                // elementwise: the 2D view; gated: cols = H
  const float *scale = nullptr;
  float *amax = nullptr, *scale_inv = nullptr, *col_scale_inv = nullptr;
  NVTEDType in_dt = kNVTEFloat32, grad_dt = kNVTEFloat32, out_dt = kNVTEFloat32;
  bool fp8 = false;
  bool vec = false;  // the vector path's alignment conditions hold
};

// Scale of the output (1 unless FP8); one thread writes scale_inv = 1 / scale.
__device__ __forceinline__ float output_scale(const ActParams &p) {
  if (!p.fp8) return 1.0f;
  const float s = *p.scale;
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    if (p.scale_inv) *p.scale_inv = 1.0f / s;
    if (p.col_scale_inv) *p.col_scale_inv = 1.0f / s;
  }
  return s;
}

// Stores one scaled value at (r, j) of an output with ocols columns, in each of its layouts.
template <class TO>
__device__ __forceinline__ void put(const ActParams &p, size_t r, size_t j, size_t ocols, float q) {
  if (p.out) st<TO>(p.out, r * ocols + j, q, p.out_dt);
  if (p.out_col) st<TO>(p.out_col, j * p.rows + r, q, p.out_dt);
}

// ------------------------------------------------------------------ elementwise
// Forward: out = act(in); backward: out = grad * act'(in). Flat over rows * cols.
template <Act A, bool kBwd, class TI, class TG, class TO>
__global__ void __launch_bounds__(kThreads) act_kernel(const ActParams p) {
  pdl_begin();
  const float s = output_scale(p);
  float m = 0.0f;
  const size_t n = p.rows * p.cols;
  const size_t nthreads = (size_t)gridDim.x * blockDim.x;
  size_t scalar_from = 0;
  if constexpr (!std::is_same_v<TI, AnyT>) {
    constexpr int N = chunk_elems<TI, TG, TO>();
    constexpr int PI = per16<TI>(), PG = per16<TG>();
    // Chunks in flight per thread, kept as loaded (decoded when used, so registers hold twice
    // the bytes that float copies would): 128 bytes of input per thread for the forward.
    constexpr int U = kBwd ? 2 : 4;
    if (p.vec) {
      const size_t nch = n / N;
      for (size_t c0 = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x; c0 < nch; c0 += nthreads * U) {
        Vec<TI, PI> xr[U][N / PI];
        Vec<TG, PG> gr[kBwd ? U : 1][N / PG];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const size_t c = c0 + (size_t)u * blockDim.x;
          if (c < nch) {
            const TI *xp = static_cast<const TI *>(p.in) + c * N;
#pragma unroll
            for (int k = 0; k < N / PI; ++k) xr[u][k] = load_vec<TI, PI>(xp + k * PI);
            if constexpr (kBwd) {
              const TG *gp = static_cast<const TG *>(p.grad) + c * N;
#pragma unroll
              for (int k = 0; k < N / PG; ++k) gr[u][k] = load_vec<TG, PG>(gp + k * PG);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const size_t c = c0 + (size_t)u * blockDim.x;
          if (c < nch) {
            float y[N];
#pragma unroll
            for (int e = 0; e < N; ++e) {
              const float x = load_f32(xr[u][e / PI].v[e % PI]);
              float v;
              if constexpr (kBwd) {
                v = load_f32(gr[u][e / PG].v[e % PG]) * dact_f(A, x);
              } else {
                v = act_f(A, x);
              }
              m = fmaxf(m, fabsf(v));
              y[e] = v * s;
            }
            store_chunk<TO, N>(p.out, c * N, y);
          }
        }
      }
      scalar_from = nch * N;
    }
  }
  for (size_t e = scalar_from + (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += nthreads) {
    const float x = ld<TI>(p.in, e, p.in_dt);
    float v;
    if constexpr (kBwd) {
      v = ld<TG>(p.grad, e, p.grad_dt) * dact_f(A, x);
    } else {
      v = act_f(A, x);
    }
    m = fmaxf(m, fabsf(v));
    const size_t r = e / p.cols;
    put<TO>(p, r, e - r * p.cols, p.cols, v * s);
  }
  block_amax_update(m, p.amax);
}

// ------------------------------------------------------------------ gated
// in [rows, 2H] = [x | gate]. Forward: out [rows, H] = act(x) * gate. Backward (grad [rows, H]):
// out [rows, 2H] = [grad * gate * act'(x) | grad * act(x)]. A thread reads both halves of its
// elements before writing them, so the backward output may alias the input.
template <Act A, bool kBwd, class TI, class TG, class TO>
__global__ void __launch_bounds__(kThreads) gated_kernel(const ActParams p) {
  pdl_begin();
  const float s = output_scale(p);
  float m = 0.0f;
  const size_t h = p.cols, ocols = kBwd ? 2 * h : h;
  const size_t nthreads = (size_t)gridDim.x * blockDim.x;
  bool done = false;
  if constexpr (!std::is_same_v<TI, AnyT>) {
    constexpr int N = chunk_elems<TI, TG, TO>();
    constexpr int U = N * sizeof(TI) >= 32 ? 1 : 2;  // >= 4 vectors in flight per thread
    if (p.vec) {  // h % N == 0
      const size_t hn = h / N, nch = p.rows * hn;
      for (size_t c0 = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x; c0 < nch; c0 += nthreads * U) {
        float x[U][N], gate[U][N], g[U][N];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const size_t c = c0 + (size_t)u * blockDim.x;
          if (c < nch) {
            const size_t r = c / hn, j0 = (c - r * hn) * N;
            load_chunk<TI, N>(p.in, r * 2 * h + j0, x[u]);
            load_chunk<TI, N>(p.in, r * 2 * h + h + j0, gate[u]);
            if constexpr (kBwd) load_chunk<TG, N>(p.grad, r * h + j0, g[u]);
          }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const size_t c = c0 + (size_t)u * blockDim.x;
          if (c < nch) {
            const size_t r = c / hn, j0 = (c - r * hn) * N;
            if constexpr (kBwd) {
              float y0[N], y1[N];
#pragma unroll
              for (int e = 0; e < N; ++e) {
                const float v0 = g[u][e] * gate[u][e] * dact_f(A, x[u][e]);
                const float v1 = g[u][e] * act_f(A, x[u][e]);
                m = fmaxf(m, fmaxf(fabsf(v0), fabsf(v1)));
                y0[e] = v0 * s;
                y1[e] = v1 * s;
              }
              store_chunk<TO, N>(p.out, r * ocols + j0, y0);
              store_chunk<TO, N>(p.out, r * ocols + h + j0, y1);
            } else {
              float y[N];
#pragma unroll
              for (int e = 0; e < N; ++e) {
                const float v = act_f(A, x[u][e]) * gate[u][e];
                m = fmaxf(m, fabsf(v));
                y[e] = v * s;
              }
              store_chunk<TO, N>(p.out, r * ocols + j0, y);
            }
          }
        }
      }
      done = true;
    }
  }
  if (!done) {
    const size_t n = p.rows * h;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += nthreads) {
      const size_t r = e / h, j = e - r * h;
      const float x = ld<TI>(p.in, r * 2 * h + j, p.in_dt);
      const float gate = ld<TI>(p.in, r * 2 * h + h + j, p.in_dt);
      if constexpr (kBwd) {
        const float g = ld<TG>(p.grad, e, p.grad_dt);
        const float v0 = g * gate * dact_f(A, x);
        const float v1 = g * act_f(A, x);
        m = fmaxf(m, fmaxf(fabsf(v0), fabsf(v1)));
        put<TO>(p, r, j, ocols, v0 * s);
        put<TO>(p, r, h + j, ocols, v1 * s);
      } else {
        const float v = act_f(A, x) * gate;
        m = fmaxf(m, fabsf(v));
        put<TO>(p, r, j, ocols, v * s);
      }
    }
  }
  block_amax_update(m, p.amax);
}

// ------------------------------------------------------------------ host side

template <class F>
void with_hp_dtype(NVTEDType t, F &&f) {
  switch (t) {
    case kNVTEFloat32: return f(TypeTag<float>{});
    case kNVTEFloat16: return f(TypeTag<fp16>{});
    case kNVTEBFloat16: return f(TypeTag<bf16>{});
    default: NVTE_FAIL(NVTE_ERROR_INTERNAL, "unexpected input dtype ", dtype_name(t));
  }
}

const void *input_data(const Tensor &t, const char *name) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  NVTE_CHECK(buffer_set(b), name, " needs rowwise data");
  return b.data_ptr;
}

// Fills the output fields of p with the checks of cpu::OutputRows (layouts, dtype, scale).
void describe_output(ActParams &p, const Tensor &out, const char *name, size_t rows, size_t cols) {
  const NVTEBasicTensor &rb = out.params[kNVTERowwiseData];
  const NVTEBasicTensor &cb = out.params[kNVTEColumnwiseData];
  NVTE_CHECK(buffer_set(rb) || buffer_set(cb), name, " has no data buffer");
  p.out_dt = buffer_set(rb) ? rb.dtype : cb.dtype;
  NVTE_CHECK(is_high_precision(p.out_dt) || is_fp8(p.out_dt), name, " has dtype ", dtype_name(p.out_dt),
             "; expected float32, float16, bfloat16 or FP8");
  p.fp8 = is_fp8(p.out_dt);
  if (buffer_set(rb)) {
    const Dims2 d = flat2d(rb.shape);
    NVTE_CHECK(d.rows == rows && d.cols == cols, name, " has shape ", shape_str(rb.shape), " (2D view [",
               d.rows, ", ", d.cols, "]); expected [", rows, ", ", cols, "]");
    p.out = rb.data_ptr;
  }
  if (buffer_set(cb)) {
    NVTE_CHECK(cb.dtype == p.out_dt, name, " columnwise dtype ", dtype_name(cb.dtype),
               " differs from rowwise dtype ", dtype_name(p.out_dt));
    NVTE_CHECK(numel(cb.shape) == rows * cols &&
                   (cb.shape.ndim == 0 || rows * cols == 0 || cb.shape.data[0] == cols),
               name, " columnwise data has shape ", shape_str(cb.shape), "; expected [", cols, ", ", rows,
               "] (the transpose)");
    p.out_col = cb.data_ptr;
  }
  p.amax = scalar_param(out, kNVTEAmax, name);
  if (p.fp8) {
    p.scale = scalar_param(out, kNVTEScale, name);
    NVTE_CHECK(p.scale != nullptr, name, " is FP8 (", dtype_name(p.out_dt), ") but has no scale");
    p.scale_inv = scalar_param(out, kNVTERowwiseScaleInv, name);
    p.col_scale_inv = scalar_param(out, kNVTEColumnwiseScaleInv, name);
  }
}

// Everything but the output; returns false when there is nothing to do.
void describe_inputs(ActParams &p, const Tensor *grad, const Tensor &in) {
  p.in = input_data(in, "input");
  p.in_dt = in.params[kNVTERowwiseData].dtype;
  if (grad) {
    p.grad = input_data(*grad, "grad");
    p.grad_dt = grad->params[kNVTERowwiseData].dtype;
  } else {
    p.grad_dt = p.in_dt;
  }
}

// Vector path: one row-major output and every pointer on a 16-byte boundary.
bool vector_ok(const ActParams &p) {
  return p.out && !p.out_col && aligned(p.in, 16) && (!p.grad || aligned(p.grad, 16)) && aligned(p.out, 16);
}

template <class Kernel>
void launch(Kernel kernel, size_t work, int items_per_thread, const ActParams &p, cudaStream_t stream) {
  launch_pdl(kernel, grid_for(work, kThreads, items_per_thread), kThreads, 0, stream, p);
}

}  // namespace

void activation(Act a, const Tensor *grad, const Tensor &in, Tensor &out, cudaStream_t stream) {
  ActParams p;
  describe_inputs(p, grad, in);
  const Dims2 d = flat2d(in.params[kNVTERowwiseData].shape);
  p.rows = d.rows;
  p.cols = d.cols;
  describe_output(p, out, "output", d.rows, d.cols);
  const size_t n = d.rows * d.cols;
  if (n == 0) return write_empty_fp8_scale_inv(p.scale, p.scale_inv, p.col_scale_inv, nullptr, stream);
  with_act<false>(a, [&](auto kAct) {
    constexpr Act A = decltype(kAct)::value;
    if (grad && p.grad_dt != p.in_dt) {
      launch(act_kernel<A, true, AnyT, AnyT, AnyT>, n, 1, p, stream);
      return;
    }
    with_bool(grad != nullptr, [&](auto kBwd) {
      with_hp_dtype(p.in_dt, [&](auto ti) {
        using TI = typename decltype(ti)::type;
        with_float_dtype(p.out_dt, "output", [&](auto to) {
          using TO = typename decltype(to)::type;
          constexpr int N = chunk_elems<TI, TI, TO>();
          p.vec = vector_ok(p);
          constexpr int U = decltype(kBwd)::value ? 2 : 4;  // chunks per thread and step (act_kernel)
          launch(act_kernel<A, decltype(kBwd)::value, TI, TI, TO>, p.vec ? n / N + 1 : n, p.vec ? U : 1, p,
                 stream);
        });
      });
    });
  });
}

void gated_activation(Act a, const Tensor *grad, const Tensor &in, Tensor &out, cudaStream_t stream) {
  ActParams p;
  describe_inputs(p, grad, in);
  const Dims2 d = flat2d(in.params[kNVTERowwiseData].shape);
  const size_t h = d.cols / 2;
  p.rows = d.rows;
  p.cols = h;
  describe_output(p, out, "output", d.rows, grad ? 2 * h : h);
  const size_t n = d.rows * h;
  if (n == 0) return write_empty_fp8_scale_inv(p.scale, p.scale_inv, p.col_scale_inv, nullptr, stream);
  with_act<true>(a, [&](auto kAct) {
    constexpr Act A = decltype(kAct)::value;
    if (grad && p.grad_dt != p.in_dt) {
      launch(gated_kernel<A, true, AnyT, AnyT, AnyT>, n, 1, p, stream);
      return;
    }
    with_bool(grad != nullptr, [&](auto kBwd) {
      with_hp_dtype(p.in_dt, [&](auto ti) {
        using TI = typename decltype(ti)::type;
        with_float_dtype(p.out_dt, "output", [&](auto to) {
          using TO = typename decltype(to)::type;
          constexpr int N = chunk_elems<TI, TI, TO>();
          constexpr int U = N * sizeof(TI) >= 32 ? 1 : 2;
          p.vec = vector_ok(p) && h % N == 0;
          launch(gated_kernel<A, decltype(kBwd)::value, TI, TI, TO>, p.vec ? n / N : n, p.vec ? U : 1, p,
                 stream);
        });
      });
    });
  });
}

}  // namespace nvte::cuda

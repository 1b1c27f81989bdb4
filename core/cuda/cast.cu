// cast.cu - CUDA quantize / dequantize / quantize+dbias.
//
// Design: an output with only a rowwise layout is a flat elementwise map, done by a
// grid-stride kernel that keeps four vectors in flight per thread, each 16 bytes on the narrower
// side, converted with hardware pair instructions (scalar tail, and a scalar path for buffers
// not 16-byte aligned). Anything that needs the columnwise layout or column
// sums (dbias) goes through the tiled one-pass kernel of cast_tiles.cuh. Both reduce amax
// in-kernel (one atomic per block), read the scale and the noop flag from device memory and
// let one thread write scale_inv. dbias is finished by a small kernel that sums the per-tile
// partials of each column in row-tile order, so results do not depend on scheduling.
#include "cast.h"

#include <vector>

#include "../common/dtype_switch.h"
#include "cast_tiles.cuh"

namespace nvte::cuda {

namespace {

constexpr int kCastThreads = 256;
constexpr int kCastUnroll = 4;

// Elements per vector of the flat kernel: 16 bytes of the narrower type (the FP8 side of an
// FP8 cast moves whole 16-byte words; 8-byte accesses measured ~1.3-1.5x a copy's time).
template <class InT, class OutT>
constexpr int flat_vec_elems() {
  return 16 / (sizeof(InT) < sizeof(OutT) ? sizeof(InT) : sizeof(OutT));
}

// N elements at p (16-byte aligned) as whole 16-byte accesses (N * sizeof(T) is a multiple of
// 16 here: two or four words on the wider side of a cast).
template <class T, int N>
__device__ __forceinline__ Vec<T, N> load_words(const T *p) {
  constexpr int W = N * (int)sizeof(T) / 16;
  static_assert(W >= 1 && W * 16 == N * (int)sizeof(T), "whole 16-byte words");
  uint4 w[W];
#pragma unroll
  for (int i = 0; i < W; ++i) w[i] = reinterpret_cast<const uint4 *>(p)[i];
  Vec<T, N> v;
  memcpy(&v, w, sizeof(v));
  return v;
}
template <class T, int N>
__device__ __forceinline__ void store_words(T *p, const Vec<T, N> &v) {
  constexpr int W = N * (int)sizeof(T) / 16;
  static_assert(W >= 1 && W * 16 == N * (int)sizeof(T), "whole 16-byte words");
  uint4 w[W];
  memcpy(w, &v, sizeof(w));
#pragma unroll
  for (int i = 0; i < W; ++i) reinterpret_cast<uint4 *>(p)[i] = w[i];
}

// One element through the exact conversions (the CPU's results, NaN payloads included).
template <class InT, class OutT>
__device__ __forceinline__ OutT convert_exact(InT x, float in_si, float scale, float &amax) {
  float g = ld_exact(x);
  if constexpr (is_fp8_type<InT>::value) g = mul_like_host(g, in_si);
  amax = fmaxf(amax, fabsf(g));
  if constexpr (is_fp8_type<OutT>::value) return st_exact<OutT>(g * scale);
  else return st_exact<OutT>(g);
}

// N elements: hardware pair conversions (fp8x2 -> half2, cvt.rn.bf16x2 / f16x2, cvt.satfinite
// fp8x2), which round as the exact routines do for every non-NaN value; a vector holding a NaN
// (after decoding and input scaling) is redone element by element through convert_exact, so
// results stay bit-identical to the CPU while finite data takes the short path.
template <class InT, class OutT, int N>
__device__ __forceinline__ void convert_vec(const Vec<InT, N> &x, Vec<OutT, N> &y, float in_si, float scale,
                                            float &amax) {
  static_assert(N % 2 == 0, "conversions go in pairs");
  float f[N];
  if constexpr (is_fp8_type<InT>::value) {
    constexpr __nv_fp8_interpretation_t kKind = std::is_same_v<InT, fp8e4m3> ? __NV_E4M3 : __NV_E5M2;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const __nv_fp8x2_storage_t p = (__nv_fp8x2_storage_t)(x.v[2 * i].bits | (x.v[2 * i + 1].bits << 8));
      const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(p, kKind)));
      f[2 * i] = v.x * in_si;
      f[2 * i + 1] = v.y * in_si;
    }
  } else {
    decode_vec(x, f);
  }
  bool nan = false;
#pragma unroll
  for (int k = 0; k < N; ++k) nan |= f[k] != f[k];
  if (nan) {
#pragma unroll
    for (int k = 0; k < N; ++k) y.v[k] = convert_exact<InT, OutT>(x.v[k], in_si, scale, amax);
    return;
  }
#pragma unroll
  for (int k = 0; k < N; ++k) amax = fmaxf(amax, fabsf(f[k]));
  if constexpr (is_fp8_type<OutT>::value) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) tiles::st_pair(f[2 * i] * scale, f[2 * i + 1] * scale, y.v[2 * i], y.v[2 * i + 1]);
  } else if constexpr (std::is_same_v<OutT, bf16> || std::is_same_v<OutT, fp16>) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const uint32_t w = pack2<OutT>(f[2 * i], f[2 * i + 1]);
      y.v[2 * i].bits = (uint16_t)(w & 0xFFFFu);
      y.v[2 * i + 1].bits = (uint16_t)(w >> 16);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) y.v[k] = st_exact<OutT>(f[k]);
  }
}

template <class InT, class OutT>
__global__ void __launch_bounds__(kCastThreads)
    cast_kernel(const InT *in, OutT *out, size_t n, size_t nvec, const float *in_si_p, const float *scale_p,
                float *amax_p, float *si_p, float *csi_p, const float *noop) {
  pdl_begin();
  constexpr int N = flat_vec_elems<InT, OutT>();
  constexpr bool kFp8Out = is_fp8_type<OutT>::value;
  constexpr bool kFp8In = is_fp8_type<InT>::value;
  if (noop != nullptr && *noop == 1.0f) return;
  float scale = 1.0f, in_si = 1.0f;
  if constexpr (kFp8Out) scale = scale_p != nullptr ? *scale_p : 1.0f;
  if constexpr (kFp8In) in_si = *in_si_p;
  float amax = 0.0f;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (size_t base = tid; base < nvec; base += kCastUnroll * stride) {
    Vec<InT, N> xv[kCastUnroll];
#pragma unroll
    for (int u = 0; u < kCastUnroll; ++u) {
      const size_t i = base + u * stride;
      if (i < nvec) xv[u] = load_words<InT, N>(in + i * N);
    }
#pragma unroll
    for (int u = 0; u < kCastUnroll; ++u) {
      const size_t i = base + u * stride;
      if (i < nvec) {
        Vec<OutT, N> yv;
        convert_vec<InT, OutT, N>(xv[u], yv, in_si, scale, amax);
        store_words<OutT, N>(out + i * N, yv);
      }
    }
  }
  for (size_t i = nvec * N + tid; i < n; i += stride) out[i] = convert_exact<InT, OutT>(in[i], in_si, scale, amax);
  if (amax_p != nullptr) block_amax_update(amax, amax_p);
  if constexpr (kFp8Out) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
      const float inv = 1.0f / scale;
      if (si_p != nullptr) *si_p = inv;
      if (csi_p != nullptr) *csi_p = inv;
    }
  }
}

template <class DT>
__global__ void __launch_bounds__(256)
    dbias_reduce_kernel(const float *partial, DT *dbias, size_t ntiles, size_t cols) {
  pdl_begin();
  const size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
#pragma unroll 8
  for (size_t t = 0; t < ntiles; ++t) s += partial[t * cols + c];
  dbias[c] = st_exact<DT>(s);
}

// The output-side pointers every quantizing kernel needs.
struct OutPtrs {
  void *row = nullptr, *col = nullptr;
  NVTEDType dtype = kNVTEFloat32;
  const float *scale = nullptr;
  float *amax = nullptr, *scale_inv = nullptr, *col_scale_inv = nullptr;
};

OutPtrs out_ptrs(const Tensor &out) {
  OutPtrs o;
  o.row = out.params[kNVTERowwiseData].data_ptr;
  o.col = out.params[kNVTEColumnwiseData].data_ptr;
  o.dtype = logical_dtype(out);
  o.amax = scalar_param(out, kNVTEAmax, "output amax");
  if (is_fp8(o.dtype)) {
    o.scale = scalar_param(out, kNVTEScale, "output scale");
    o.scale_inv = scalar_param(out, kNVTERowwiseScaleInv, "output scale_inv");
    o.col_scale_inv = scalar_param(out, kNVTEColumnwiseScaleInv, "output columnwise scale_inv");
  }
  return o;
}

tiles::Args tile_args(const void *in, size_t rows, size_t cols, const float *in_si, const OutPtrs &o,
                      void *direct, void *transposed, const float *noop) {
  tiles::Args a;
  a.in = in;
  a.rows = rows;
  a.cols = cols;
  a.in_scale_inv = in_si;
  a.out_row = direct;
  a.out_col = transposed;
  a.scale = o.scale;
  a.amax = o.amax;
  a.scale_inv = o.scale_inv;
  a.col_scale_inv = o.col_scale_inv;
  a.noop = noop;
  return a;
}

template <class InT, class OutT, bool kDbias>
void launch_plain_tiles(tiles::Args a, cudaStream_t stream) {
  a.col_vec = tiles::col_vec_ok(a.out_col, a.rows, sizeof(OutT));
  if (tiles::vec_ok<InT, InT, OutT>(a))
    tiles::launch<InT, InT, OutT, kNoAct, kDbias, true, false>(a, stream);
  else
    tiles::launch<InT, InT, OutT, kNoAct, kDbias, false, false>(a, stream);
}

// Converts `in` ([rows, cols], dtype in_t) into the layouts of o. src_transposed: in is the
// [cols, rows] transpose of the logical tensor (a columnwise-only FP8 input).
void convert(const void *in, NVTEDType in_t, size_t rows, size_t cols, const float *in_si, const OutPtrs &o,
             const float *noop, cudaStream_t stream) {
  with_float_dtype(in_t, "input", [&](auto itag) {
    using InT = typename decltype(itag)::type;
    with_float_dtype(o.dtype, "output", [&](auto otag) {
      using OutT = typename decltype(otag)::type;
      if constexpr (is_fp8_type<InT>::value && is_fp8_type<OutT>::value) {
        NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "FP8 to FP8 conversion is not supported");
      } else if (o.col != nullptr) {
        launch_plain_tiles<InT, OutT, false>(tile_args(in, rows, cols, in_si, o, o.row, o.col, noop), stream);
      } else {
        constexpr int N = flat_vec_elems<InT, OutT>();
        const size_t n = rows * cols;
        const bool vec = aligned(in, 16) && aligned(o.row, 16);
        const size_t nvec = vec ? n / N : 0;
        const unsigned blocks = nvec ? grid_for(nvec, kCastThreads, kCastUnroll) : grid_for(n, kCastThreads, 4);
        launch_pdl(cast_kernel<InT, OutT>, blocks, kCastThreads, 0, stream, static_cast<const InT *>(in),
                   static_cast<OutT *>(o.row), n, nvec, in_si, o.scale, o.amax, o.scale_inv, o.col_scale_inv, noop);
      }
    });
  });
}

}  // namespace

void quantize(const Tensor &in, Tensor &out, const float *noop, cudaStream_t stream) {
  const NVTEBasicTensor &ib = in.params[kNVTERowwiseData];
  const Dims2 d = flat2d(ib.shape);
  NVTE_CHECK(is_high_precision(ib.dtype), "input must be float32, float16 or bfloat16, got ", dtype_name(ib.dtype));
  const OutPtrs o = out_ptrs(out);
  if (d.rows * d.cols == 0) return write_empty_fp8_scale_inv(o.scale, o.scale_inv, o.col_scale_inv, noop, stream);
  convert(ib.data_ptr, ib.dtype, d.rows, d.cols, nullptr, o, noop, stream);
}

void multi_quantize(size_t n, const Tensor *const *in, Tensor *const *out, cudaStream_t stream) {
  struct Item {
    tiles::Args a;
    NVTEDType in_t, out_t;
  };
  std::vector<Item> items;
  items.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const NVTEBasicTensor &ib = in[i]->params[kNVTERowwiseData];
    NVTE_CHECK(is_high_precision(ib.dtype), "input ", i, " must be float32, float16 or bfloat16, got ",
               dtype_name(ib.dtype));
    const Dims2 d = flat2d(ib.shape);
    const OutPtrs o = out_ptrs(*out[i]);
    if (d.rows * d.cols == 0) {
      write_empty_fp8_scale_inv(o.scale, o.scale_inv, o.col_scale_inv, nullptr, stream);
      continue;
    }
    items.push_back({tile_args(ib.data_ptr, d.rows, d.cols, nullptr, o, o.row, o.col, nullptr), ib.dtype, o.dtype});
  }
  for (size_t i = 0; i < items.size();) {
    with_float_dtype(items[i].in_t, "input", [&](auto itag) {
      using InT = typename decltype(itag)::type;
      with_float_dtype(items[i].out_t, "output", [&](auto otag) {
        using OutT = typename decltype(otag)::type;
        if constexpr (is_fp8_type<InT>::value) {
          NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "input must be float32, float16 or bfloat16");
        } else {
          tiles::Args run[tiles::kMaxMulti];
          int count = 0;
          bool vec = false;
          for (size_t j = i; j < items.size() && count < tiles::kMaxMulti; ++j) {
            tiles::Args a = items[j].a;
            a.col_vec = tiles::col_vec_ok(a.out_col, a.rows, sizeof(OutT));
            const bool v = tiles::vec_ok<InT, InT, OutT>(a);
            if (j == i) vec = v;
            if (items[j].in_t != items[i].in_t || items[j].out_t != items[i].out_t || v != vec) break;
            run[count++] = a;
          }
          if (vec) tiles::launch_multi<InT, OutT, true>(run, count, stream);
          else tiles::launch_multi<InT, OutT, false>(run, count, stream);
          i += count;
        }
      });
    });
  }
}

void dequantize(const Tensor &in, Tensor &out, cudaStream_t stream) {
  const Dims2 d = flat2d(logical_shape(in));
  if (d.rows * d.cols == 0) return;
  OutPtrs o = out_ptrs(out);
  const NVTEBasicTensor &rb = in.params[kNVTERowwiseData];
  if (buffer_set(rb)) {
    const float *si = scalar_param(in, kNVTERowwiseScaleInv, "input scale_inv");
    NVTE_CHECK(si != nullptr, "input is FP8 (", dtype_name(rb.dtype), ") but has no scale_inv");
    return convert(rb.data_ptr, rb.dtype, d.rows, d.cols, si, o, nullptr, stream);
  }
  // Columnwise-only input [cols, rows]: the tiled kernel reads it as its own [cols, rows]
  // matrix, so its "direct" layout is out's columnwise data and its transpose out's rowwise data.
  const NVTEBasicTensor &cb = in.params[kNVTEColumnwiseData];
  const float *si = scalar_param(in, kNVTEColumnwiseScaleInv, "input columnwise scale_inv");
  if (si == nullptr) si = scalar_param(in, kNVTERowwiseScaleInv, "input scale_inv");
  NVTE_CHECK(si != nullptr, "input is FP8 (", dtype_name(cb.dtype), ") but has no scale_inv");
  with_float_dtype(cb.dtype, "input", [&](auto itag) {
    using InT = typename decltype(itag)::type;
    with_float_dtype(o.dtype, "output", [&](auto otag) {
      using OutT = typename decltype(otag)::type;
      if constexpr (is_fp8_type<InT>::value && !is_fp8_type<OutT>::value) {
        launch_plain_tiles<InT, OutT, false>(tile_args(cb.data_ptr, d.cols, d.rows, si, o, o.col, o.row, nullptr),
                                             stream);
      } else {
        NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "dequantize needs an FP8 input and a high-precision output");
      }
    });
  });
}

size_t dbias_workspace_bytes(size_t rows, size_t cols) { return tiles::row_tiles(rows) * cols * sizeof(float); }

void quantize_dbias(const Tensor &in, const Tensor *act_in, std::optional<Act> act, Tensor &out, Tensor &dbias,
                    void *workspace, cudaStream_t stream) {
  const NVTEBasicTensor &ib = in.params[kNVTERowwiseData];
  const NVTEBasicTensor &db = dbias.params[kNVTERowwiseData];
  const Dims2 d = flat2d(ib.shape);
  const OutPtrs o = out_ptrs(out);
  if (d.rows * d.cols == 0) {  // dbias: column sums of nothing
    if (d.cols > 0) NVTE_CHECK_CUDA(cudaMemsetAsync(db.data_ptr, 0, d.cols * dtype_size(db.dtype), stream));
    return write_empty_fp8_scale_inv(o.scale, o.scale_inv, o.col_scale_inv, nullptr, stream);
  }
  NVTE_CHECK(workspace != nullptr && aligned(workspace, sizeof(float)), "workspace must be a 4-byte aligned buffer");
  tiles::Args a = tile_args(ib.data_ptr, d.rows, d.cols, nullptr, o, o.row, o.col, nullptr);
  a.dbias_partial = static_cast<float *>(workspace);
  if (act) {
    const NVTEBasicTensor &ab = act_in->params[kNVTERowwiseData];
    a.act = ab.data_ptr;
    a.act_dtype = ab.dtype;
    a.act_kind = static_cast<int>(*act);
    launch_dact_tiles(ib.dtype, ab.dtype, o.dtype, a.act_kind, a, stream);
  } else {
    with_float_dtype(ib.dtype, "input", [&](auto itag) {
      using InT = typename decltype(itag)::type;
      with_float_dtype(o.dtype, "output", [&](auto otag) {
        using OutT = typename decltype(otag)::type;
        if constexpr (is_fp8_type<InT>::value) {
          NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "input must be float32, float16 or bfloat16");
        } else {
          launch_plain_tiles<InT, OutT, true>(a, stream);
        }
      });
    });
  }
  with_float_dtype(db.dtype, "dbias", [&](auto tag) {
    using DT = typename decltype(tag)::type;
    if constexpr (is_fp8_type<DT>::value) {
      NVTE_FAIL(NVTE_ERROR_INVALID_ARGUMENT, "dbias must be float32, float16 or bfloat16");
    } else {
      const unsigned blocks = (unsigned)((d.cols + 255) / 256);
      launch_pdl(dbias_reduce_kernel<DT>, blocks, 256, 0, stream, (const float *)a.dbias_partial,
                 static_cast<DT *>(db.data_ptr), tiles::row_tiles(d.rows), d.cols);
    }
  });
}

}  // namespace nvte::cuda

// cast_tiles.cuh - device code shared by the cast / cast+transpose / dbias / transpose kernels:
// exact element conversions and the tiled "one pass, two layouts" kernel.
//
// Tiled kernel: a block of 256 threads owns a tile of 128 rows x (8 * N) columns, where N is
// the number of elements in one 16-byte access of the wider of the input/output types. Each
// thread loads a 4-row x N-column micro-tile (4 independent 16-byte loads), converts it once,
// stores the rowwise result straight to global memory (contiguous along the row) and drops
// each column's 4 consecutive-row values as one small word into a shared-memory image of
// the transposed tile. The column-major image is XOR-swizzled on 4-row chunks by the
// thread's vector index, which makes the word stores bank-conflict free while keeping
// every 16-byte unit contiguous; a second phase then streams the image out as 16-byte
// stores along the rows of the [cols, rows] output. The input is read exactly once.
// dbias: per-thread 4-row sums -> fixed-order sum over the 32 row groups in shared memory
// -> one float32 partial per (row tile, column) in the workspace -> a second kernel sums
// the partials of each column over the row tiles in order (deterministic).
#pragma once

#include <cmath>
#include <cstring>
#include <type_traits>

#include "../common/activation_math.h"
#include "common.cuh"
#include "pdl.cuh"

namespace nvte::cuda {

// --------------------------------------------------------- exact conversions
// Bit-identical to the CPU's numeric.h, NaN payloads included: fast paths, with the
// numeric.h routine only where the hardware conversion may differ (NaN bits, bf16/fp16
// rounding of NaN). Finite values never take the slow branches.
template <class T>
__device__ __forceinline__ float ld_exact(T v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, bf16>) {
    return load_f32(v);
  } else {
    const float f = load_f32(v);
    return f == f ? f : nvte::to_f32(v);
  }
}

template <class T>
__device__ __forceinline__ T st_exact(float v) {
  if constexpr (is_fp8_type<T>::value || std::is_same_v<T, float>) {
    return store_f32<T>(v);
  } else {
    return nvte::from_f32<T>(v);
  }
}

// x * si as the CPU computes it (x86: a NaN operand propagates with its payload, the first
// one when both are NaN; an invalid product, 0 * inf, is x86's default NaN 0xFFC00000 where
// the GPU gives 0x7FFFFFFF; multiplying by exactly 1 is skipped).
__device__ __forceinline__ float mul_like_host(float x, float si) {
  if (si == 1.0f) return x;
  if (x != x) return x;
  if (si != si) return si;
  const float r = x * si;
  return r == r ? r : __uint_as_float(0xFFC00000u);
}

// A type marker: "the act input's dtype is only known at run time".
struct AnyFloat {};
// kAct values besides (int)Act: no activation, or the activation chosen at run time.
constexpr int kNoAct = -1;
constexpr int kRuntimeAct = 99;

__device__ __forceinline__ float ld_dyn(const void *p, size_t i, NVTEDType t) {
  switch (t) {
    case kNVTEFloat32: return static_cast<const float *>(p)[i];
    case kNVTEFloat16: return ld_exact(static_cast<const fp16 *>(p)[i]);
    default: return ld_exact(static_cast<const bf16 *>(p)[i]);
  }
}

// All N elements of a vector as float32 (ld_exact for each; bf16 two per 32-bit word with one
// shift or mask each, which the per-element form compiles to twice as many instructions).
template <class T, int N>
__device__ __forceinline__ void decode_vec(const Vec<T, N> &v, float (&f)[N]) {
  if constexpr (std::is_same_v<T, bf16> && N % 2 == 0) {
    uint32_t w[N / 2];
    memcpy(w, &v, sizeof(w));
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) f[k] = ld_exact(v.v[k]);
  }
}

// -------------------------------------------------------------- tiled kernel
namespace tiles {

constexpr int kThreads = 256;
constexpr int kVecCols = 8;     // 16-byte vectors across a tile row
constexpr int kRowGroups = 32;  // groups of 4 rows
constexpr int kTileRows = 4 * kRowGroups;

template <class InT, class OutT>
constexpr int vec_elems() {
  return 16 / (sizeof(InT) > sizeof(OutT) ? sizeof(InT) : sizeof(OutT));
}

template <class InT, class OutT>
constexpr int tile_cols() {
  return kVecCols * vec_elems<InT, OutT>();
}

struct Args {
  const void *in = nullptr;
  const void *act = nullptr;  // activation input (same 2D shape) or null
  void *out_row = nullptr;    // [rows, cols] or null
  void *out_col = nullptr;    // [cols, rows] or null
  const float *in_scale_inv = nullptr;  // FP8 input: decoded as x * scale_inv
  const float *scale = nullptr;         // FP8 output scale
  float *amax = nullptr;
  float *scale_inv = nullptr, *col_scale_inv = nullptr;
  const float *noop = nullptr;
  float *dbias_partial = nullptr;  // [row tiles, cols] float32
  size_t rows = 0, cols = 0;
  unsigned col_tiles = 0;
  size_t tiles = 0;      // row tiles x column tiles (set by launch)
  bool col_vec = false;  // 16-byte stores into out_col are aligned
  NVTEDType act_dtype = kNVTEFloat32;  // for AnyFloat
  int act_kind = 0;                    // for kRuntimeAct
};

template <class T, class ActT>
__device__ __forceinline__ float act_at(const Args &a, size_t i) {
  if constexpr (std::is_same_v<ActT, AnyFloat>) return ld_dyn(a.act, i, a.act_dtype);
  else return ld_exact(static_cast<const ActT *>(a.act)[i]);
}

// Two output values from float32 (pairs halve the FP8 conversions: cvt.satfinite.*x2 on sm_89+,
// the same rounding as the single conversion, low byte = first value).
template <class OutT>
__device__ __forceinline__ void st_pair(float a, float b, OutT &ya, OutT &yb) {
  if constexpr (is_fp8_type<OutT>::value) {
    constexpr __nv_fp8_interpretation_t kKind = std::is_same_v<OutT, fp8e4m3> ? __NV_E4M3 : __NV_E5M2;
    const __nv_fp8x2_storage_t p = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kKind);
    ya.bits = (uint8_t)(p & 0xFFu);
    yb.bits = (uint8_t)(p >> 8);
  } else {
    ya = st_exact<OutT>(a);
    yb = st_exact<OutT>(b);
  }
}

// t[j] = byte j of every r[i] (byte i of t[j] = byte j of r[i]): a 4 x 4 byte matrix, one
// 32-bit word per row, transposed with 8 byte permutes.
__device__ __forceinline__ void transpose_4x4_bytes(const uint32_t (&r)[4], uint32_t (&t)[4]) {
  const uint32_t lo01 = __byte_perm(r[0], r[1], 0x5140), hi01 = __byte_perm(r[0], r[1], 0x7362);
  const uint32_t lo23 = __byte_perm(r[2], r[3], 0x5140), hi23 = __byte_perm(r[2], r[3], 0x7362);
  t[0] = __byte_perm(lo01, lo23, 0x5410);
  t[1] = __byte_perm(lo01, lo23, 0x7632);
  t[2] = __byte_perm(hi01, hi23, 0x5410);
  t[3] = __byte_perm(hi01, hi23, 0x7632);
}

__device__ __forceinline__ uint32_t word_of(const uint4 &q, int w) {
  return w == 0 ? q.x : w == 1 ? q.y : w == 2 ? q.z : q.w;
}

// kVec: every row access of this thread is a whole aligned vector (cols % N == 0 and aligned
// pointers, checked on the host); otherwise elements are read one by one with bounds checks.
// kRaw: a plain bit copy (transpose of any dtype): no conversion, amax or scale.
// One block per tile. (A persistent grid that prefetched each block's next tile into
// registers was measured slower on an H200: the extra registers cost more occupancy than the
// prefetch gained.) tile_body does tile number `tile` of a; every thread of the block calls it.
template <class InT, class ActT, class OutT, int kAct, bool kDbias, bool kVec, bool kRaw>
__device__ __forceinline__ void tile_body(const Args &a, const size_t tile) {
  constexpr int N = vec_elems<InT, OutT>();
  constexpr int kCols = kVecCols * N;
  constexpr int kRowBytes = kTileRows * (int)sizeof(OutT);
  constexpr int kChunk = 4 * (int)sizeof(OutT);
  constexpr bool kFp8Out = is_fp8_type<OutT>::value;
  constexpr bool kFp8In = is_fp8_type<InT>::value;
  constexpr bool kHasAct = kAct != kNoAct;
  static_assert(!(kVec && std::is_same_v<ActT, AnyFloat>), "runtime act dtype has no vector path");
  static_assert(N % 2 == 0, "conversions go in pairs");
  __shared__ __align__(32) unsigned char s_img[kCols * kRowBytes];
  __shared__ float s_db[kDbias ? kRowGroups * kCols : 1];

  if (a.noop != nullptr && *a.noop == 1.0f) return;
  const size_t rows = a.rows, cols = a.cols;
  const int v = threadIdx.x % kVecCols, g = threadIdx.x / kVecCols;
  const InT *in = static_cast<const InT *>(a.in);
  using ActVecT = std::conditional_t<std::is_same_v<ActT, AnyFloat>, InT, ActT>;
  const ActVecT *act_in = static_cast<const ActVecT *>(a.act);

  float scale = 1.0f, in_si = 1.0f;
  if constexpr (!kRaw && kFp8Out) scale = a.scale != nullptr ? *a.scale : 1.0f;
  if constexpr (!kRaw && kFp8In) in_si = *a.in_scale_inv;
  float amax = 0.0f;

  // Loads of one tile's 4 x N micro-tile (the scalar path reads the act input later).
  auto load = [&](size_t tile, Vec<InT, N> (&xx)[4], Vec<ActVecT, N> (&aa)[4]) {
    const size_t m0 = (tile / a.col_tiles) * kTileRows;
    const size_t c0 = (tile % a.col_tiles) * kCols + (size_t)v * N;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const size_t r = m0 + 4 * g + i;
      const bool ok = r < rows && c0 < cols;
      if constexpr (kVec) {
        if (ok) {
          xx[i] = load_vec<InT, N>(in + r * cols + c0);
          if constexpr (kHasAct) aa[i] = load_vec<ActVecT, N>(act_in + r * cols + c0);
        }
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k)
          if (ok && c0 + k < cols) xx[i].v[k] = in[r * cols + c0 + k];
      }
    }
  };

  // Raw transpose of 1-byte elements (FP8 data): the micro-tile is kept as 32-bit words. (Held
  // as 16-element byte vectors, each conditional load was split into 16 byte registers: 90
  // registers, 2 blocks per SM, 0.58 of copy bandwidth on an H100.)
  constexpr bool kRawBytes = kRaw && kVec && sizeof(OutT) == 1;
  Vec<InT, N> x[4];
  Vec<ActVecT, N> ax[4];
  if constexpr (!kRawBytes) load(tile, x, ax);
  {
    const size_t rt = tile / a.col_tiles, ct = tile % a.col_tiles;
    const size_t m0 = rt * kTileRows, n0 = ct * kCols;
    const size_t c0 = n0 + (size_t)v * N;
    // Phase 1: this thread's 4-row chunk of column c of the tile in the swizzled image.
    auto chunk_at = [&](int c) { return s_img + c * kRowBytes + (g ^ (4 * v)) * kChunk; };

    if constexpr (kRawBytes) {
      static_assert(N == 16, "16 bytes per row access");
      const unsigned char *src = static_cast<const unsigned char *>(a.in);
      uint4 q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const size_t r = m0 + 4 * g + i;
        q[i] = r < rows && c0 < cols ? *reinterpret_cast<const uint4 *>(src + r * cols + c0) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint32_t rw[4] = {word_of(q[0], w), word_of(q[1], w), word_of(q[2], w), word_of(q[3], w)};
        uint32_t t[4];
        transpose_4x4_bytes(rw, t);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          *reinterpret_cast<uint32_t *>(chunk_at(v * N + 4 * w + j)) = t[j];
      }
    } else {
    // ---- convert: g = x (* dact), amax, column sums, output values; rowwise stores
    Vec<OutT, N> y[4];
    float csum[N];
#pragma unroll
    for (int k = 0; k < N; ++k) csum[k] = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const size_t r = m0 + 4 * g + i;
      const bool row_ok = r < rows && c0 < cols;
      if constexpr (kRaw) {
        y[i] = x[i];
      } else {
        float gv[N];
        const Act act = kAct == kRuntimeAct ? static_cast<Act>(a.act_kind) : static_cast<Act>(kAct);
        if constexpr (kVec) {
          // Whole vectors: one branch per row (not per element), bf16 decoded two per word.
          if (row_ok) {
            decode_vec(x[i], gv);
            float av[N];
            if constexpr (kHasAct) decode_vec(ax[i], av);
#pragma unroll
            for (int k = 0; k < N; ++k) {
              float t = gv[k];
              if constexpr (kFp8In) t = mul_like_host(t, in_si);
              if constexpr (kHasAct) t = t * dact_f(act, av[k]);
              amax = fmaxf(amax, fabsf(t));
              if constexpr (kDbias) csum[k] += t;
              gv[k] = t;
            }
          } else {
#pragma unroll
            for (int k = 0; k < N; ++k) gv[k] = 0.0f;
          }
        } else {
#pragma unroll
          for (int k = 0; k < N; ++k) {
            const bool ok = row_ok && c0 + k < cols;
            gv[k] = 0.0f;
            if (ok) {
              float t = ld_exact(x[i].v[k]);
              if constexpr (kFp8In) t = mul_like_host(t, in_si);
              if constexpr (kHasAct) t = t * dact_f(act, act_at<InT, ActT>(a, r * cols + c0 + k));
              amax = fmaxf(amax, fabsf(t));
              if constexpr (kDbias) csum[k] += t;
              gv[k] = t;
            }
          }
        }
#pragma unroll
        for (int k = 0; k < N; k += 2) {
          if constexpr (kFp8Out) st_pair<OutT>(gv[k] * scale, gv[k + 1] * scale, y[i].v[k], y[i].v[k + 1]);
          else st_pair<OutT>(gv[k], gv[k + 1], y[i].v[k], y[i].v[k + 1]);
        }
      }
      if (!kRaw && a.out_row != nullptr) {  // (raw mode only transposes)
        OutT *out = static_cast<OutT *>(a.out_row);
        if constexpr (kVec) {
          if (row_ok) store_vec<OutT, N>(out + r * cols + c0, y[i]);
        } else {
#pragma unroll
          for (int k = 0; k < N; ++k)
            if (row_ok && c0 + k < cols) out[r * cols + c0 + k] = y[i].v[k];
        }
      }
    }

    // ---- columnwise layout: swizzled transposed image in shared memory
    if (a.out_col != nullptr) {
      if constexpr (sizeof(OutT) == 1) {
        // 1-byte outputs: each 4 x 4 block of bytes (4 rows x 4 columns, one 32-bit word per row)
        // is transposed with 8 byte permutes. Gathering the chunks byte by byte made the compiler
        // keep every byte in a register of its own (92 registers in the raw byte transpose, 2
        // blocks per SM, 0.58 of copy bandwidth on an H100).
        static_assert(N % 4 == 0, "whole 32-bit words per row");
#pragma unroll
        for (int w = 0; w < N / 4; ++w) {
          uint32_t r[4], t[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) memcpy(&r[i], &y[i].v[4 * w], 4);
          transpose_4x4_bytes(r, t);
#pragma unroll
          for (int j = 0; j < 4; ++j)  // t[j]: column 4w + j, byte i = row i
            *reinterpret_cast<uint32_t *>(chunk_at(v * N + 4 * w + j)) = t[j];
        }
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          Vec<OutT, 4> chunk;
#pragma unroll
          for (int i = 0; i < 4; ++i) chunk.v[i] = y[i].v[k];
          *reinterpret_cast<Vec<OutT, 4> *>(chunk_at(v * N + k)) = chunk;
        }
      }
    }
    if constexpr (kDbias) {
#pragma unroll
      for (int k = 0; k < N; ++k) s_db[g * kCols + v * N + k] = csum[k];
    }
    }  // phase 1 of the converting path
    __syncthreads();

    if (a.out_col != nullptr) {
      constexpr int kUnit = 16 / (int)sizeof(OutT);  // elements per 16-byte unit
      constexpr int kUnitsPerRow = kTileRows / kUnit;
      OutT *out = static_cast<OutT *>(a.out_col);
      // Element (c, r) of the transposed tile in the image, and the 16-byte output unit idx: its
      // column c and first row r0 (false when it lies outside the matrix).
      auto img_at = [&](int c, int r) {
        return s_img + c * kRowBytes + ((r / 4) ^ (4 * (c / N))) * kChunk + (r % 4) * (int)sizeof(OutT);
      };
      auto unit = [&](int idx, int &c, int &r0) {
        c = idx / kUnitsPerRow;
        r0 = (idx % kUnitsPerRow) * kUnit;
        return n0 + c < cols && m0 + r0 < rows;
      };
      if (a.col_vec) {
#pragma unroll
        for (int idx = threadIdx.x; idx < kCols * kUnitsPerRow; idx += kThreads) {
          int c, r0;
          if (!unit(idx, c, r0)) continue;
          const uint4 q = *reinterpret_cast<const uint4 *>(img_at(c, r0));
          *reinterpret_cast<uint4 *>(out + (n0 + c) * rows + m0 + r0) = q;
        }
      } else {
        // Element by element (a misaligned or odd-length output row); not unrolled, so that the
        // compiler does not hoist every unit's loads and size the whole kernel's registers by it.
#pragma unroll 1
        for (int idx = threadIdx.x; idx < kCols * kUnitsPerRow; idx += kThreads) {
          int c, r0;
          if (!unit(idx, c, r0)) continue;
#pragma unroll
          for (int e = 0; e < kUnit; ++e)
            if (m0 + r0 + e < rows)
              out[(n0 + c) * rows + m0 + r0 + e] = *reinterpret_cast<const OutT *>(img_at(c, r0 + e));
        }
      }
    }

    if constexpr (kDbias) {
      for (int c = threadIdx.x; c < kCols; c += kThreads) {
        if (n0 + c >= cols) continue;
        float s = 0.0f;
#pragma unroll 8
        for (int gg = 0; gg < kRowGroups; ++gg) s += s_db[gg * kCols + c];
        a.dbias_partial[rt * cols + n0 + c] = s;
      }
    }
  }

  if constexpr (!kRaw) {
    if (a.amax != nullptr) block_amax_update(amax, a.amax);
    if constexpr (kFp8Out) {
      if (tile == 0 && threadIdx.x == 0) {
        const float inv = 1.0f / scale;
        if (a.scale_inv != nullptr) *a.scale_inv = inv;
        if (a.col_scale_inv != nullptr) *a.col_scale_inv = inv;
      }
    }
  }
}

template <class InT, class ActT, class OutT, int kAct, bool kDbias, bool kVec, bool kRaw>
__global__ void __launch_bounds__(kThreads) tile_kernel(const Args a) {
  pdl_begin();
  tile_body<InT, ActT, OutT, kAct, kDbias, kVec, kRaw>(a, blockIdx.x);
}

// Several tensors in one launch (multi_cast_transpose: many small weights would each be a short
// launch): block b does tile b - first[i] of tensor i, where first[i] <= b < first[i + 1]. The
// list travels in the kernel's parameters (kMaxMulti x ~130 bytes, under the 4 KiB limit).
constexpr int kMaxMulti = 24;
struct MultiArgs {
  Args a[kMaxMulti];
  unsigned first[kMaxMulti + 1];  // prefix sums of the tensors' tile counts
  int count = 0;
};

template <class InT, class OutT, bool kVec>
__global__ void __launch_bounds__(kThreads) multi_tile_kernel(const MultiArgs m) {
  pdl_begin();
  int i = 0;
  while (i + 1 < m.count && blockIdx.x >= m.first[i + 1]) ++i;
  tile_body<InT, InT, OutT, kNoAct, false, kVec, false>(m.a[i], blockIdx.x - m.first[i]);
}

inline size_t row_tiles(size_t rows) { return (rows + kTileRows - 1) / kTileRows; }

// Launches the tiled kernel over a (rows x cols, non-empty) problem, one block per tile.
template <class InT, class ActT, class OutT, int kAct, bool kDbias, bool kVec, bool kRaw>
void launch(Args a, cudaStream_t stream) {
  constexpr int kCols = tile_cols<InT, OutT>();
  const size_t ct = (a.cols + kCols - 1) / kCols;
  a.col_tiles = (unsigned)ct;
  a.tiles = row_tiles(a.rows) * ct;
  NVTE_CHECK_SUPPORTED(ct <= 0xFFFFFFFFu && a.tiles <= 0x7FFFFFFFu, "tensor of ", a.rows, " x ", a.cols,
                       " is too large for one launch");
  launch_pdl(tile_kernel<InT, ActT, OutT, kAct, kDbias, kVec, kRaw>, (unsigned)a.tiles, kThreads, 0, stream, a);
}

// Launches multi_tile_kernel over a[0..count) (count <= kMaxMulti, each non-empty; kVec must
// hold for every one: vec_ok<InT, InT, OutT>, col_vec set per tensor).
template <class InT, class OutT, bool kVec>
void launch_multi(const Args *a, int count, cudaStream_t stream) {
  constexpr int kCols = tile_cols<InT, OutT>();
  NVTE_CHECK(count > 0 && count <= kMaxMulti, "internal: ", count, " tensors in one multi-tensor launch");
  MultiArgs m;
  m.count = count;
  size_t total = 0;
  for (int i = 0; i < count; ++i) {
    m.a[i] = a[i];
    const size_t ct = (a[i].cols + kCols - 1) / kCols;
    m.a[i].col_tiles = (unsigned)ct;
    m.a[i].tiles = row_tiles(a[i].rows) * ct;
    m.first[i] = (unsigned)total;
    total += m.a[i].tiles;
    NVTE_CHECK_SUPPORTED(ct <= 0xFFFFFFFFu && total <= 0x7FFFFFFFu, "tensors of ", total,
                         " tiles in all are too large for one launch");
  }
  m.first[count] = (unsigned)total;
  launch_pdl(multi_tile_kernel<InT, OutT, kVec>, (unsigned)total, kThreads, 0, stream, m);
}

// Host-side choice of the vector path for given pointers (nullptr counts as aligned).
template <class InT, class ActT, class OutT>
bool vec_ok(const Args &a) {
  constexpr int N = vec_elems<InT, OutT>();
  if (a.cols % N != 0) return false;
  if (!aligned(a.in, N * sizeof(InT)) || !aligned(a.out_row, N * sizeof(OutT))) return false;
  if constexpr (std::is_same_v<ActT, AnyFloat>) return a.act == nullptr;
  else return aligned(a.act, N * sizeof(ActT));
}

inline bool col_vec_ok(const void *out_col, size_t rows, size_t elem) {
  return aligned(out_col, 16) && (rows * elem) % 16 == 0;
}

}  // namespace tiles

// Quantize/dequantize with dbias over the tiled kernel (cast.cu / cast_dact.cu). act_kind < 0:
// no activation. act_dtype is the act input's dtype.
void launch_dact_tiles(NVTEDType in_t, NVTEDType act_t, NVTEDType out_t, int act_kind, tiles::Args a,
                       cudaStream_t stream);

}  // namespace nvte::cuda

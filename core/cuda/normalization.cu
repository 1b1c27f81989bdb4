// cuda/normalization.cu - LayerNorm / RMSNorm forward and backward (normalization.h) on the GPU.
//
// Design: a row of H elements is owned by a "unit" of TPR threads (one warp for short rows,
// up to a whole 512-thread block for long ones); a block holds 512 / TPR units. Each thread
// owns up to 4 vectors of 8 elements (16-byte accesses of bf16/fp16, two of float32) at
// vector indices t, t + TPR, ..., so a unit's accesses are coalesced, and keeps them in
// registers. Forward: a grid of two blocks per SM walks the rows; x is loaded once, the mean
// and then the sum of squared deviations are reduced from the registers (two-pass variance,
// float32, warp butterfly then the unit's warps in a fixed order, so every thread of a unit
// holds the same bits), then z is scaled, shifted, quantized and stored; amax is one atomic
// per block. Backward: block c (one per SM) owns a fixed chunk of rows (the chunking depends
// only on N, H and the SM count); its units walk the chunk in lockstep, keep x and dz in
// their storage type, reduce the two row means, write dx, and add dz * xhat and dz into
// per-unit partial sums in shared memory (each thread owns its columns: no atomics). The
// units' partials are then added in unit order into the block's workspace row [c, H], and a
// second kernel adds the workspace rows in row order: dgamma/dbeta are deterministic.
// Dtypes other than the backward's x/dz storage type are run-time values read in uniform
// branches (few instantiations). Rows whose length is not a multiple of 8, misaligned
// pointers, rows over 16384 elements or a dz dtype unlike x's take a scalar path that
// re-reads the row from global memory (L1/L2); its backward accumulates its partials straight
// in its workspace row. Math is float32 with the CPU's operation order for the elementwise
// parts (explicit _rn intrinsics, no FMA contraction) except the vector forward's z (one FMA,
// see norm_fwd_vec), so results differ from the CPU's (double-accumulated row sums) through
// the row sums and, for that z, by a few float32 roundings.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "../common/dtype_switch.h"
#include "common.cuh"
#include "normalization.h"

namespace nvte::cuda {
namespace {

constexpr int kVec = 8;  // elements per vector

// ------------------------------------------------------------ run-time typed access
template <class T>
__device__ __forceinline__ void ld8_t(const void *base, size_t e, float (&o)[kVec]) {
  const T *p = static_cast<const T *>(base) + e;
  constexpr int kPer = 16 / sizeof(T);  // elements per 16-byte access
#pragma unroll
  for (int h = 0; h < kVec / kPer; ++h) {
    const Vec<T, kPer> v = load_vec<T, kPer>(p + h * kPer);
#pragma unroll
    for (int j = 0; j < kPer; ++j) o[h * kPer + j] = load_f32(v.v[j]);
  }
}

// x-like inputs: float32, float16 or bfloat16.
__device__ __forceinline__ void ld8(const void *base, NVTEDType t, size_t e, float (&o)[kVec]) {
  if (t == kNVTEBFloat16) ld8_t<bf16>(base, e, o);
  else if (t == kNVTEFloat16) ld8_t<fp16>(base, e, o);
  else ld8_t<float>(base, e, o);
}

__device__ __forceinline__ float ld1(const void *base, NVTEDType t, size_t e) {
  if (t == kNVTEBFloat16) return load_f32(static_cast<const bf16 *>(base)[e]);
  if (t == kNVTEFloat16) return load_f32(static_cast<const fp16 *>(base)[e]);
  return static_cast<const float *>(base)[e];
}

// Stores v[j] * s (s is 1 unless the output is FP8).
template <class T>
__device__ __forceinline__ void st8_t(void *base, size_t e, const float (&v)[kVec], float s) {
  T *p = static_cast<T *>(base) + e;
  constexpr int kPer = sizeof(T) == 1 ? kVec : 16 / (int)sizeof(T);
#pragma unroll
  for (int h = 0; h < kVec / kPer; ++h) {
    Vec<T, kPer> w;
#pragma unroll
    for (int j = 0; j < kPer; ++j) w.v[j] = store_f32<T>(v[h * kPer + j] * s);
    store_vec<T, kPer>(p + h * kPer, w);
  }
}

__device__ __forceinline__ void st8(void *base, NVTEDType t, size_t e, const float (&v)[kVec], float s) {
  switch (t) {
    case kNVTEBFloat16: st8_t<bf16>(base, e, v, s); break;
    case kNVTEFloat16: st8_t<fp16>(base, e, v, s); break;
    case kNVTEFloat8E4M3: st8_t<fp8e4m3>(base, e, v, s); break;
    case kNVTEFloat8E5M2: st8_t<fp8e5m2>(base, e, v, s); break;
    default: st8_t<float>(base, e, v, s); break;
  }
}

__device__ __forceinline__ void st1(void *base, NVTEDType t, size_t e, float v) {
  switch (t) {
    case kNVTEBFloat16: static_cast<bf16 *>(base)[e] = store_f32<bf16>(v); break;
    case kNVTEFloat16: static_cast<fp16 *>(base)[e] = store_f32<fp16>(v); break;
    case kNVTEFloat8E4M3: static_cast<fp8e4m3 *>(base)[e] = store_f32<fp8e4m3>(v); break;
    case kNVTEFloat8E5M2: static_cast<fp8e5m2 *>(base)[e] = store_f32<fp8e5m2>(v); break;
    default: static_cast<float *>(base)[e] = v; break;
  }
}

// Sums K values over each unit of TPR consecutive threads. Every thread of the block calls
// it (it may hold __syncthreads); every thread of a unit gets the same bits (xor butterfly
// in the warp, then the unit's warps added in warp order). red: CTA / 32 * K floats.
template <int TPR, int K>
__device__ __forceinline__ void unit_sum(float (&v)[K], float *red) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  if constexpr (TPR > 32) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) red[warp * K + k] = v[k];
    }
    __syncthreads();
    const int first = (threadIdx.x / TPR) * (TPR / 32);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = red[first * K + k];
#pragma unroll
      for (int w = 1; w < TPR / 32; ++w) s += red[(first + w) * K + k];
      v[k] = s;
    }
    __syncthreads();  // red is reused by the next call
  }
}

// --------------------------------------------------------------------------- forward
struct FwdParams {
  const void *x, *gamma, *beta;  // beta == nullptr: RMSNorm
  void *z, *zt;                  // rowwise [N, H] and columnwise [H, N] outputs (either may be null)
  float *mu, *rsigma, *amax, *scale_inv, *col_scale_inv;
  const float *scale;  // FP8 z only
  size_t rows, cols;
  float eps;
  NVTEDType xt, gt, bt, zt_dtype;
  bool zc;  // zero-centered gamma: g = 1 + gamma
};

__device__ __forceinline__ float out_scale(const FwdParams &p) { return p.scale ? *p.scale : 1.0f; }

// One z value with the CPU's operation order: ((x - m) * rs) * g (+ beta).
__device__ __forceinline__ float norm_value(float x, float m, float rs, float g, float b, bool ln) {
  const float v = __fmul_rn(__fmul_rn(__fsub_rn(x, m), rs), g);
  return ln ? __fadd_rn(v, b) : v;
}

__device__ __forceinline__ void fwd_finish(const FwdParams &p, float amax) {
  if (p.amax) block_amax_update(amax, p.amax);
  if (blockIdx.x == 0 && threadIdx.x == 0 && p.scale) {
    const float inv = 1.0f / *p.scale;
    if (p.scale_inv) *p.scale_inv = inv;
    if (p.col_scale_inv) *p.col_scale_inv = inv;
  }
}

// Rows held in registers: H % 8 == 0, all row pointers 16-byte aligned, H <= 8 * NV * TPR,
// x of storage type TI, decoded once into float32 registers. The kernel is issue-bound more
// than memory-bound (ncu on an H200: ~34 instructions per element in an earlier version), so
// per-element work is kept to the minimum: zero-centred gamma and beta are per-vector uniform
// branches, z = (x - mu) * (rsigma * gamma) + beta is one subtraction, one multiplication and
// one FMA (the CPU rounds ((x - mu) * rsigma) * gamma + beta: a few float32 ulps apart, inside
// tests/gpu's bound), and addresses are per-row pointers.
template <class TI, int TPR, int NV, int CTA>
__global__ void __launch_bounds__(CTA, 1024 / CTA) norm_fwd_vec(const FwdParams p) {
  constexpr int R = CTA / TPR;
  __shared__ float red[CTA / 32];
  const int t = threadIdx.x % TPR, unit = threadIdx.x / TPR;
  const size_t h = p.cols, nvec = h / kVec;
  const bool ln = p.beta != nullptr;
  const float s = out_scale(p);
  float amax = 0.0f;
  // A grid of a few blocks per SM walks the row groups (one amax atomic per block).
  for (size_t group = blockIdx.x; group * R < p.rows; group += gridDim.x) {
    const size_t row = group * R + unit;
    const bool live = row < p.rows;
    const TI *xrow = static_cast<const TI *>(p.x) + row * h;
    float x[NV][kVec];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const size_t k = t + (size_t)i * TPR;
      if (live && k < nvec) {
        ld8_t<TI>(xrow, k * kVec, x[i]);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) x[i][j] = 0.0f;
      }
    }
    float m = 0.0f;
    if (ln) {
      float a[1] = {0.0f};
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int j = 0; j < kVec; ++j) a[0] += x[i][j];  // padding is 0
      unit_sum<TPR, 1>(a, red);
      m = a[0] / (float)h;
    }
    float q[1] = {0.0f};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (t + (size_t)i * TPR < nvec) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          x[i][j] -= m;  // x now holds x - mu
          q[0] = fmaf(x[i][j], x[i][j], q[0]);
        }
      }
    }
    unit_sum<TPR, 1>(q, red);
    const float rs = 1.0f / sqrtf(q[0] / (float)h + p.eps);
    if (!live) continue;  // (after the unit's last barrier of this row group)
    if (t == 0) {
      if (p.mu) p.mu[row] = m;
      p.rsigma[row] = rs;
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const size_t k = t + (size_t)i * TPR;
      if (k < nvec) {
        float g[kVec], o[kVec];
        ld8(p.gamma, p.gt, k * kVec, g);  // L1/L2: every row reads the same vectors
        if (p.zc) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) g[j] += 1.0f;
        }
        if (ln) {
          float b[kVec];
          ld8(p.beta, p.bt, k * kVec, b);
#pragma unroll
          for (int j = 0; j < kVec; ++j) o[j] = fmaf(x[i][j], rs * g[j], b[j]);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) o[j] = x[i][j] * (rs * g[j]);
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) amax = fmaxf(amax, fabsf(o[j]));
        const size_t e = row * h + k * kVec;
        if (p.z) st8(p.z, p.zt_dtype, e, o, s);  // s == 1 unless z is FP8
        if (p.zt) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) st1(p.zt, p.zt_dtype, (k * kVec + j) * p.rows + row, o[j] * s);
        }
      }
    }
  }  // row groups
  fwd_finish(p, amax);
}

// ------------------------------------------------ 16-bit forward with typed storage
// The common case (bf16/fp16 x, gamma and beta of x's dtype, rowwise z of x's dtype or FP8)
// with every storage type known at compile time: 16-byte raw loads decoded two values per
// word with bit operations, paired output conversions (cvt.*x2) packed straight into one
// store per 8 values. ncu on an H200 counted ~30 instructions per element for the run-time
// typed kernel above (decodes, per-element conversions, type switches), which made it
// issue-bound at under half the copy bandwidth.
template <class T>
__device__ __forceinline__ void unpack8(const uint4 &c, float (&f)[kVec]) {
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, bf16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    } else {
      __half2 hv;
      memcpy(&hv, &w[i], 4);
      const float2 v = __half22float2(hv);
      f[2 * i] = v.x;
      f[2 * i + 1] = v.y;
    }
  }
}

// Two values as one 32-bit word of 16-bit storage (low half = a), round to nearest even.
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

// Stores 8 values (times s for FP8) at dst with one 8-byte (FP8) or 16-byte store.
template <class TO>
__device__ __forceinline__ void store8(TO *dst, const float (&o)[kVec], float s) {
  if constexpr (is_fp8_type<TO>::value) {
    constexpr __nv_fp8_interpretation_t kKind = std::is_same_v<TO, fp8e4m3> ? __NV_E4M3 : __NV_E5M2;
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = __nv_cvt_float2_to_fp8x2(make_float2(o[2 * i] * s, o[2 * i + 1] * s), __NV_SATFINITE, kKind);
    *reinterpret_cast<uint2 *>(dst) = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
  } else {
    *reinterpret_cast<uint4 *>(dst) =
        make_uint4(pack2<TO>(o[0], o[1]), pack2<TO>(o[2], o[3]), pack2<TO>(o[4], o[5]), pack2<TO>(o[6], o[7]));
  }
}

template <class TI, class TO, int TPR, int NV, int CTA>
__global__ void __launch_bounds__(CTA, 1024 / CTA) norm_fwd_fast(const FwdParams p) {
  constexpr int R = CTA / TPR;
  __shared__ float red[CTA / 32];
  const int t = threadIdx.x % TPR, unit = threadIdx.x / TPR;
  const size_t h = p.cols, nvec = h / kVec;
  const bool ln = p.beta != nullptr;
  const float s = out_scale(p);
  const uint4 *gam = static_cast<const uint4 *>(p.gamma);
  const uint4 *bet = static_cast<const uint4 *>(p.beta);
  float amax = 0.0f;
  for (size_t group = blockIdx.x; group * R < p.rows; group += gridDim.x) {
    const size_t row = group * R + unit;
    const bool live = row < p.rows;
    const uint4 *xrow = static_cast<const uint4 *>(p.x) + row * nvec;
    float x[NV][kVec];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const size_t k = t + (size_t)i * TPR;
      if (live && k < nvec) {
        unpack8<TI>(xrow[k], x[i]);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) x[i][j] = 0.0f;
      }
    }
    float m = 0.0f;
    if (ln) {
      float a[1] = {0.0f};
#pragma unroll
      for (int i = 0; i < NV; ++i)
#pragma unroll
        for (int j = 0; j < kVec; ++j) a[0] += x[i][j];  // padding is 0
      unit_sum<TPR, 1>(a, red);
      m = a[0] / (float)h;
    }
    float q[1] = {0.0f};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (t + (size_t)i * TPR < nvec) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          x[i][j] -= m;
          q[0] = fmaf(x[i][j], x[i][j], q[0]);
        }
      }
    }
    unit_sum<TPR, 1>(q, red);
    const float rs = 1.0f / sqrtf(q[0] / (float)h + p.eps);
    if (!live) continue;  // (after the unit's last barrier of this row group)
    if (t == 0) {
      if (p.mu) p.mu[row] = m;
      p.rsigma[row] = rs;
    }
    TO *zrow = static_cast<TO *>(p.z) + row * h;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const size_t k = t + (size_t)i * TPR;
      if (k < nvec) {
        float g[kVec], o[kVec];
        unpack8<TI>(gam[k], g);  // L1/L2: every row reads the same vectors
        if (p.zc) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) g[j] += 1.0f;
        }
        if (ln) {
          float b[kVec];
          unpack8<TI>(bet[k], b);
#pragma unroll
          for (int j = 0; j < kVec; ++j) o[j] = fmaf(x[i][j], rs * g[j], b[j]);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) o[j] = x[i][j] * (rs * g[j]);
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) amax = fmaxf(amax, fabsf(o[j]));
        store8<TO>(zrow + k * kVec, o, s);
      }
    }
  }  // row groups
  fwd_finish(p, amax);
}

// Any H and alignment: one block per row (grid-stride), three passes over the row in global memory.
template <int CTA>
__global__ void __launch_bounds__(CTA) norm_fwd_any(const FwdParams p) {
  __shared__ float red[CTA / 32];
  const size_t h = p.cols;
  const bool ln = p.beta != nullptr;
  const float s = out_scale(p);
  float amax = 0.0f;
  for (size_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const size_t base = row * h;
    float m = 0.0f;
    if (ln && h) {
      float a[1] = {0.0f};
      for (size_t c = threadIdx.x; c < h; c += CTA) a[0] += ld1(p.x, p.xt, base + c);
      unit_sum<CTA, 1>(a, red);
      m = a[0] / (float)h;
    }
    float q[1] = {0.0f};
    for (size_t c = threadIdx.x; c < h; c += CTA) {
      const float d = ld1(p.x, p.xt, base + c) - m;
      q[0] = fmaf(d, d, q[0]);
    }
    unit_sum<CTA, 1>(q, red);
    const float rs = 1.0f / sqrtf((h ? q[0] / (float)h : 0.0f) + p.eps);
    if (threadIdx.x == 0) {
      if (p.mu) p.mu[row] = m;
      p.rsigma[row] = rs;
    }
    for (size_t c = threadIdx.x; c < h; c += CTA) {
      float g = ld1(p.gamma, p.gt, c);
      if (p.zc) g += 1.0f;
      const float v = norm_value(ld1(p.x, p.xt, base + c), m, rs, g, ln ? ld1(p.beta, p.bt, c) : 0.0f, ln);
      amax = fmaxf(amax, fabsf(v));
      if (p.z) st1(p.z, p.zt_dtype, base + c, v * s);
      if (p.zt) st1(p.zt, p.zt_dtype, c * p.rows + row, v * s);
    }
  }
  fwd_finish(p, amax);
}

// -------------------------------------------------------------------------- backward
struct BwdParams {
  const void *dz, *x, *add, *gamma;
  const float *mu, *rsigma;  // mu == nullptr: RMSNorm
  void *dx;
  float *ws;  // [parts, H] dgamma partials, then (LayerNorm) [parts, H] dbeta partials
  size_t rows, cols, rows_per_part;  // block c: rows [c * rows_per_part, min(rows, (c + 1) * rows_per_part))
  size_t parts;
  NVTEDType dzt, xt, at, gt, dxt;
  bool zc, ln;
};

// dx of one element with the CPU's operation order: rs * ((dy - mean_dy) - xhat * mean_dyx).
__device__ __forceinline__ float dx_value(float rs, float dy, float xh, float mean_dy, float mean_dyx) {
  return __fmul_rn(rs, __fsub_rn(__fsub_rn(dy, mean_dy), __fmul_rn(xh, mean_dyx)));
}

// 8 elements of x or dz kept in their storage type (16 bytes of bf16/fp16, 32 of float32):
// registers for the row, decoded again where needed.
template <class T>
struct Raw8 {
  static constexpr int kPer = 16 / sizeof(T);
  Vec<T, kPer> v[kVec / kPer];
  __device__ __forceinline__ void load(const void *base, size_t e) {
    const T *p = static_cast<const T *>(base) + e;
#pragma unroll
    for (int h = 0; h < kVec / kPer; ++h) v[h] = load_vec<T, kPer>(p + h * kPer);
  }
  __device__ __forceinline__ float operator[](int j) const { return load_f32(v[j / kPer].v[j % kPer]); }
  // All 8 values at once (16-bit T: two per 32-bit word with bit operations).
  __device__ __forceinline__ void unpack(float (&f)[kVec]) const {
    if constexpr (sizeof(T) == 2) {
      uint4 c;
      memcpy(&c, &v[0], 16);
      unpack8<T>(c, f);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) f[j] = (*this)[j];
    }
  }
};

// Rows in registers (H % 8 == 0, 16-byte aligned rows, H <= 8 * NV * TPR, x and dz of
// storage type TI). Dynamic shared memory: per unit and output (dgamma, dbeta) [8][NV * TPR]
// float partials (slot k of column k * 8 + j at [j][k]: a warp's accesses hit distinct banks).
// xhat and dy are computed twice (before and after the row reduction) from the stored row,
// with the same operations, so both passes see the same bits. kTyped (16-bit TI, and gamma,
// dx and the add input of TI's dtype, checked on the host): gamma, add and dx are accessed as
// raw 16-byte words decoded / packed in pairs, as in norm_fwd_fast, instead of through the
// run-time dtype switches.
template <class TI, int TPR, int NV, int CTA, bool kTyped>
__global__ void __launch_bounds__(CTA) norm_bwd_vec(const BwdParams p) {
  static_assert(!kTyped || sizeof(TI) == 2, "the typed path is for 16-bit rows");
  constexpr int R = CTA / TPR, S = NV * TPR;
  extern __shared__ float part[];
  __shared__ float red[CTA / 32 * 2];
  const int unit = threadIdx.x / TPR, t = threadIdx.x % TPR;
  const int nout = p.ln ? 2 : 1;
  const size_t h = p.cols, nvec = h / kVec;
  float *mine = part + (size_t)unit * nout * kVec * S;

  // g = gamma (+ 1) stays in registers across rows when NV == 1, else is re-read (L1).
  constexpr bool kKeepG = NV == 1;
  float gk[kKeepG ? NV : 1][kVec];
  auto gamma_of = [&](int i, size_t k, float (&out)[kVec]) {
    if (kKeepG) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = gk[0][j];  // NV == 1: i == 0
    } else {
      if constexpr (kTyped) unpack8<TI>(static_cast<const uint4 *>(p.gamma)[k], out);
      else ld8(p.gamma, p.gt, k * kVec, out);
      if (p.zc) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) out[j] += 1.0f;
      }
    }
  };
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const size_t k = t + (size_t)i * TPR;
    if (kKeepG && k < nvec) {
      ld8(p.gamma, p.gt, k * kVec, gk[0]);
      if (p.zc) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) gk[0][j] += 1.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      mine[j * S + k] = 0.0f;
      if (p.ln) mine[(kVec + j) * S + k] = 0.0f;
    }
  }

  const size_t r0 = blockIdx.x * p.rows_per_part;
  const size_t r1 = min(p.rows, r0 + p.rows_per_part);
  for (size_t rb = r0; rb < r1; rb += R) {  // the same trip count for every unit of the block
    const size_t row = rb + unit;
    const bool live = row < r1;
    Raw8<TI> xr[NV], dr[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const size_t k = t + (size_t)i * TPR;
      if (live && k < nvec) {
        xr[i].load(p.x, row * h + k * kVec);
        dr[i].load(p.dz, row * h + k * kVec);
      }
    }
    const float m = (live && p.mu) ? p.mu[row] : 0.0f;
    const float rs = live ? p.rsigma[row] : 0.0f;
    float sums[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const size_t k = t + (size_t)i * TPR;
      if (live && k < nvec) {
        float g[kVec], xf[kVec], df[kVec];
        gamma_of(i, k, g);
        xr[i].unpack(xf);
        dr[i].unpack(df);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float dz = df[j];
          const float xh = __fmul_rn(__fsub_rn(xf[j], m), rs);
          const float dy = __fmul_rn(dz, g[j]);
          sums[0] += dy;
          sums[1] = fmaf(dy, xh, sums[1]);
          mine[j * S + k] = fmaf(dz, xh, mine[j * S + k]);
          if (p.ln) mine[(kVec + j) * S + k] += dz;
        }
      }
    }
    unit_sum<TPR, 2>(sums, red);
    if (!live) continue;  // (after the unit's last barrier of this row)
    const float mean_dy = p.ln ? sums[0] / (float)h : 0.0f;
    const float mean_dyx = sums[1] / (float)h;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const size_t k = t + (size_t)i * TPR;
      if (k < nvec) {
        float g[kVec], o[kVec], xf[kVec], df[kVec];
        gamma_of(i, k, g);
        xr[i].unpack(xf);
        dr[i].unpack(df);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          const float xh = __fmul_rn(__fsub_rn(xf[j], m), rs);
          const float dy = __fmul_rn(df[j], g[j]);
          o[j] = dx_value(rs, dy, xh, mean_dy, mean_dyx);
        }
        if (p.add) {
          float a[kVec];
          if constexpr (kTyped) unpack8<TI>(static_cast<const uint4 *>(p.add)[row * nvec + k], a);
          else ld8(p.add, p.at, row * h + k * kVec, a);
#pragma unroll
          for (int j = 0; j < kVec; ++j) o[j] = __fadd_rn(o[j], a[j]);
        }
        if constexpr (kTyped) store8<TI>(static_cast<TI *>(p.dx) + row * h + k * kVec, o, 1.0f);
        else st8(p.dx, p.dxt, row * h + k * kVec, o, 1.0f);
      }
    }
  }

  // The units' partials, added in unit order, become this block's workspace row.
  __syncthreads();
  for (int o = 0; o < nout; ++o) {
    float *dst = p.ws + (o * p.parts + blockIdx.x) * h;
    for (int j = 0; j < kVec; ++j) {
      for (size_t k = threadIdx.x; k < nvec; k += CTA) {
        float acc = part[(o * kVec + j) * S + k];
#pragma unroll
        for (int u = 1; u < R; ++u) acc += part[((size_t)(u * nout + o) * kVec + j) * S + k];
        dst[k * kVec + j] = acc;
      }
    }
  }
}

// Any H and alignment: block c walks its rows one at a time with two passes over each row,
// accumulating its partials in its own workspace row.
template <int CTA>
__global__ void __launch_bounds__(CTA) norm_bwd_any(const BwdParams p) {
  __shared__ float red[CTA / 32 * 2];
  const size_t h = p.cols;
  float *pg = p.ws + blockIdx.x * h;
  float *pb = p.ln ? p.ws + (p.parts + blockIdx.x) * h : nullptr;
  for (size_t c = threadIdx.x; c < h; c += CTA) {
    pg[c] = 0.0f;
    if (pb) pb[c] = 0.0f;
  }
  const size_t r0 = blockIdx.x * p.rows_per_part;
  const size_t r1 = min(p.rows, r0 + p.rows_per_part);
  for (size_t row = r0; row < r1; ++row) {
    const size_t base = row * h;
    const float m = p.mu ? p.mu[row] : 0.0f;
    const float rs = p.rsigma[row];
    float sums[2] = {0.0f, 0.0f};
    for (size_t c = threadIdx.x; c < h; c += CTA) {
      float g = ld1(p.gamma, p.gt, c);
      if (p.zc) g += 1.0f;
      const float xh = __fmul_rn(__fsub_rn(ld1(p.x, p.xt, base + c), m), rs);
      const float dy = __fmul_rn(ld1(p.dz, p.dzt, base + c), g);
      sums[0] += dy;
      sums[1] = fmaf(dy, xh, sums[1]);
    }
    unit_sum<CTA, 2>(sums, red);
    const float mean_dy = p.ln ? sums[0] / (float)h : 0.0f;
    const float mean_dyx = sums[1] / (float)h;
    for (size_t c = threadIdx.x; c < h; c += CTA) {
      float g = ld1(p.gamma, p.gt, c);
      if (p.zc) g += 1.0f;
      const float dz = ld1(p.dz, p.dzt, base + c);
      const float xh = __fmul_rn(__fsub_rn(ld1(p.x, p.xt, base + c), m), rs);
      float o = dx_value(rs, __fmul_rn(dz, g), xh, mean_dy, mean_dyx);
      if (p.add) o = __fadd_rn(o, ld1(p.add, p.at, base + c));
      st1(p.dx, p.dxt, base + c, o);
      pg[c] = fmaf(dz, xh, pg[c]);
      if (pb) pb[c] += dz;
    }
  }
}

// out[col] = sum over parts (in part order) of ws[part, col]; blockIdx.y: 0 dgamma, 1 dbeta.
// Block (32, 8): the 8 rows of threads add contiguous slices of the parts, then row 0 adds
// the 8 slice sums in order.
__global__ void __launch_bounds__(256) norm_bwd_finalize(const float *ws, size_t parts, size_t h, void *dgamma,
                                                         NVTEDType gt, void *dbeta, NVTEDType bt) {
  __shared__ float acc[8][33];
  const int o = blockIdx.y;
  const size_t col = (size_t)blockIdx.x * 32 + threadIdx.x;
  const float *w = ws + o * parts * h;
  const size_t per = (parts + 7) / 8;
  const size_t c0 = threadIdx.y * per, c1 = min(parts, c0 + per);
  float s = 0.0f;
  if (col < h) {
#pragma unroll 8
    for (size_t c = c0; c < c1; ++c) s += w[c * h + col];
  }
  acc[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && col < h) {
    float tot = acc[0][threadIdx.x];
#pragma unroll
    for (int y = 1; y < 8; ++y) tot += acc[y][threadIdx.x];
    if (o == 0) st1(dgamma, gt, col, tot);
    else st1(dbeta, bt, col, tot);
  }
}

// ------------------------------------------------------------------------------ host
const void *data_of(const Tensor &t) { return t.params[kNVTERowwiseData].data_ptr; }
NVTEDType dtype_of(const Tensor &t) { return t.params[kNVTERowwiseData].dtype; }

bool vec_ok(const void *p) { return p == nullptr || aligned(p, 16); }

// The backward's split of N rows into parts (blocks): a function of (n, h, sm) only.
struct Plan {
  size_t parts, rows_per_part;
};
Plan bwd_plan(size_t n, size_t h, int sm) {
  if (n == 0 || h == 0) return {0, 0};
  // One resident 512-thread block per SM (its shared partials take up to 128 KiB).
  const size_t want = (size_t)std::max(sm, 1);
  const size_t rpp = (n + std::min(n, want) - 1) / std::min(n, want);
  return {(n + rpp - 1) / rpp, rpp};
}

// Smallest power of two >= v, clamped to [32, 1024].
int unit_threads(size_t v) {
  int t = 32;
  while (t < 1024 && (size_t)t < v) t *= 2;
  return t;
}

template <class TI, class TO, int TPR, int NV, int CTA>
void launch_fast(const FwdParams &p, size_t grid, cudaStream_t stream) {
  norm_fwd_fast<TI, TO, TPR, NV, CTA><<<(unsigned)grid, CTA, 0, stream>>>(p);
  NVTE_CHECK_LAUNCH();
}

template <int TPR, int NV, int CTA>
void launch_fwd(const FwdParams &p, cudaStream_t stream) {
  constexpr int R = CTA / TPR;
  const size_t groups = (p.rows + R - 1) / R;
  const size_t grid = std::min<size_t>(groups, (size_t)sm_count() * (1024 / CTA));
  // Typed fast kernel: 16-bit x with gamma/beta of the same dtype, rowwise z only, of x's
  // dtype or FP8.
  const bool fast = (p.xt == kNVTEBFloat16 || p.xt == kNVTEFloat16) && p.gt == p.xt &&
                    (p.beta == nullptr || p.bt == p.xt) && p.z != nullptr && p.zt == nullptr &&
                    (p.zt_dtype == p.xt || p.zt_dtype == kNVTEFloat8E4M3 || p.zt_dtype == kNVTEFloat8E5M2);
  if (fast) {
    const bool b16 = p.xt == kNVTEBFloat16;
    switch (p.zt_dtype) {
      case kNVTEFloat8E4M3:
        return b16 ? launch_fast<bf16, fp8e4m3, TPR, NV, CTA>(p, grid, stream)
                   : launch_fast<fp16, fp8e4m3, TPR, NV, CTA>(p, grid, stream);
      case kNVTEFloat8E5M2:
        return b16 ? launch_fast<bf16, fp8e5m2, TPR, NV, CTA>(p, grid, stream)
                   : launch_fast<fp16, fp8e5m2, TPR, NV, CTA>(p, grid, stream);
      default:
        return b16 ? launch_fast<bf16, bf16, TPR, NV, CTA>(p, grid, stream)
                   : launch_fast<fp16, fp16, TPR, NV, CTA>(p, grid, stream);
    }
  }
  auto *k = p.xt == kNVTEBFloat16 ? norm_fwd_vec<bf16, TPR, NV, CTA>
            : p.xt == kNVTEFloat16 ? norm_fwd_vec<fp16, TPR, NV, CTA>
                                   : norm_fwd_vec<float, TPR, NV, CTA>;
  k<<<(unsigned)grid, CTA, 0, stream>>>(p);
  NVTE_CHECK_LAUNCH();
}

template <int TPR, int NV, int CTA>
void launch_bwd(const BwdParams &p, cudaStream_t stream) {
  const size_t smem = (size_t)CTA * NV * kVec * (p.ln ? 2 : 1) * sizeof(float);
  const bool typed = (p.xt == kNVTEBFloat16 || p.xt == kNVTEFloat16) && p.gt == p.xt && p.dxt == p.xt &&
                     (p.add == nullptr || p.at == p.xt);
  auto *k = p.xt == kNVTEBFloat16 ? (typed ? norm_bwd_vec<bf16, TPR, NV, CTA, true> : norm_bwd_vec<bf16, TPR, NV, CTA, false>)
            : p.xt == kNVTEFloat16 ? (typed ? norm_bwd_vec<fp16, TPR, NV, CTA, true> : norm_bwd_vec<fp16, TPR, NV, CTA, false>)
                                   : norm_bwd_vec<float, TPR, NV, CTA, false>;
  if (smem > 48 * 1024) NVTE_CHECK_CUDA(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  k<<<(unsigned)p.parts, CTA, smem, stream>>>(p);
  NVTE_CHECK_LAUNCH();
}

// Checks the output rule of cast.h that the CPU backend's OutputRows applies (dtype, shapes, scale).
void check_z(const Tensor &z, size_t rows, size_t cols) {
  const NVTEBasicTensor &rb = z.params[kNVTERowwiseData];
  const NVTEBasicTensor &cb = z.params[kNVTEColumnwiseData];
  NVTE_CHECK(buffer_set(rb) || buffer_set(cb), "z has no data buffer");
  const NVTEDType dt = buffer_set(rb) ? rb.dtype : cb.dtype;
  NVTE_CHECK(is_high_precision(dt) || is_fp8(dt), "z has dtype ", dtype_name(dt),
             "; expected float32, float16, bfloat16 or FP8");
  if (buffer_set(cb)) {
    NVTE_CHECK(cb.dtype == dt, "z columnwise dtype ", dtype_name(cb.dtype), " differs from rowwise dtype ",
               dtype_name(dt));
    NVTE_CHECK(numel(cb.shape) == rows * cols && (cb.shape.ndim == 0 || rows * cols == 0 || cb.shape.data[0] == cols),
               "z columnwise data has shape ", shape_str(cb.shape), "; expected [", cols, ", ", rows,
               "] (the transpose)");
  }
  if (is_fp8(dt)) NVTE_CHECK(scalar_param(z, kNVTEScale, "z") != nullptr, "z is FP8 (", dtype_name(dt), ") but has no scale");
}

}  // namespace

int norm_sm(int hint) { return hint > 0 ? hint : sm_count(); }

size_t norm_bwd_workspace_bytes(size_t n, size_t h, int sm) {
  return bwd_plan(n, h, sm).parts * h * 2 * sizeof(float);
}

void norm_fwd(const Tensor &x, const Tensor &gamma, const Tensor *beta, float epsilon, Tensor &z, Tensor *mu,
              Tensor &rsigma, bool zero_centered_gamma, cudaStream_t stream) {
  const Dims2 d = flat2d(logical_shape(x));
  check_z(z, d.rows, d.cols);
  FwdParams p{};
  p.x = data_of(x);
  p.gamma = data_of(gamma);
  p.beta = beta ? data_of(*beta) : nullptr;
  p.z = z.params[kNVTERowwiseData].data_ptr;
  p.zt = z.params[kNVTEColumnwiseData].data_ptr;
  p.zt_dtype = buffer_set(z.params[kNVTERowwiseData]) ? z.params[kNVTERowwiseData].dtype
                                                       : z.params[kNVTEColumnwiseData].dtype;
  p.mu = mu ? static_cast<float *>(mu->params[kNVTERowwiseData].data_ptr) : nullptr;
  p.rsigma = static_cast<float *>(rsigma.params[kNVTERowwiseData].data_ptr);
  p.amax = scalar_param(z, kNVTEAmax, "z");
  if (is_fp8(p.zt_dtype)) {
    p.scale = scalar_param(z, kNVTEScale, "z");
    p.scale_inv = scalar_param(z, kNVTERowwiseScaleInv, "z");
    p.col_scale_inv = scalar_param(z, kNVTEColumnwiseScaleInv, "z");
  }
  p.rows = d.rows;
  p.cols = d.cols;
  p.eps = epsilon;
  p.xt = dtype_of(x);
  p.gt = dtype_of(gamma);
  p.bt = beta ? dtype_of(*beta) : kNVTEFloat32;
  p.zc = zero_centered_gamma;
  if (p.rows == 0) return;

  const size_t h = p.cols, nvec = h / kVec;
  const bool vec = h > 0 && h % kVec == 0 && nvec <= 2048 && vec_ok(p.x) && vec_ok(p.gamma) && vec_ok(p.beta) &&
                   vec_ok(p.z);
  if (!vec) {
    const size_t grid = std::min<size_t>(p.rows, (size_t)sm_count() * 4);
    norm_fwd_any<512><<<(unsigned)grid, 512, 0, stream>>>(p);
    NVTE_CHECK_LAUNCH();
    return;
  }
  // Four vectors per thread (64 bytes of bf16 x in flight), 512-thread blocks.
  if (nvec <= 32) return launch_fwd<32, 1, 256>(p, stream);
  switch (unit_threads((nvec + 3) / 4)) {
    case 32: return launch_fwd<32, 4, 512>(p, stream);
    case 64: return launch_fwd<64, 4, 512>(p, stream);
    case 128: return launch_fwd<128, 4, 512>(p, stream);
    case 256: return launch_fwd<256, 4, 512>(p, stream);
    default: return launch_fwd<512, 4, 512>(p, stream);
  }
}

void norm_bwd(const Tensor &dz, const Tensor &x, const Tensor *add, const Tensor *mu, const Tensor &rsigma,
              const Tensor &gamma, Tensor &dx, Tensor &dgamma, Tensor *dbeta, bool zero_centered_gamma,
              void *workspace, int sm, cudaStream_t stream) {
  const Dims2 d = flat2d(logical_shape(x));
  const size_t n = d.rows, h = d.cols;
  if (h == 0) return;  // dx, dgamma and dbeta are empty
  const Plan plan = bwd_plan(n, h, sm);
  BwdParams p{};
  p.dz = data_of(dz);
  p.x = data_of(x);
  p.add = add ? data_of(*add) : nullptr;
  p.gamma = data_of(gamma);
  p.mu = mu ? static_cast<const float *>(data_of(*mu)) : nullptr;
  p.rsigma = static_cast<const float *>(data_of(rsigma));
  p.dx = dx.params[kNVTERowwiseData].data_ptr;
  p.ws = static_cast<float *>(workspace);
  p.rows = n;
  p.cols = h;
  p.rows_per_part = plan.rows_per_part;
  p.parts = plan.parts;
  p.dzt = dtype_of(dz);
  p.xt = dtype_of(x);
  p.at = add ? dtype_of(*add) : kNVTEFloat32;
  p.gt = dtype_of(gamma);
  p.dxt = dtype_of(dx);
  p.zc = zero_centered_gamma;
  p.ln = dbeta != nullptr;
  NVTE_CHECK(plan.parts == 0 || (workspace != nullptr && aligned(workspace, 4)),
             "the normalization backward needs a 4-byte aligned workspace of ",
             norm_bwd_workspace_bytes(n, h, sm), " bytes");

  if (plan.parts > 0) {
    const size_t nvec = h / kVec;
    const bool vec = h % kVec == 0 && nvec <= 2048 && p.xt == p.dzt && vec_ok(p.dz) && vec_ok(p.x) && vec_ok(p.add) &&
                     vec_ok(p.gamma) && vec_ok(p.dx);
    if (!vec) {
      norm_bwd_any<512><<<(unsigned)plan.parts, 512, 0, stream>>>(p);
      NVTE_CHECK_LAUNCH();
    } else {
      // Four vectors per thread (x and dz kept as stored), 512-thread blocks, 64 or 128 KiB of partials.
      switch (unit_threads((nvec + 3) / 4)) {
        case 32: launch_bwd<32, 4, 512>(p, stream); break;
        case 64: launch_bwd<64, 4, 512>(p, stream); break;
        case 128: launch_bwd<128, 4, 512>(p, stream); break;
        case 256: launch_bwd<256, 4, 512>(p, stream); break;
        default: launch_bwd<512, 4, 512>(p, stream); break;
      }
    }
  }
  const dim3 grid((unsigned)((h + 31) / 32), p.ln ? 2 : 1);
  norm_bwd_finalize<<<grid, dim3(32, 8), 0, stream>>>(p.ws, plan.parts, h, dgamma.params[kNVTERowwiseData].data_ptr, dtype_of(dgamma),
                                                       dbeta ? dbeta->params[kNVTERowwiseData].data_ptr : nullptr,
                                                       dbeta ? dtype_of(*dbeta) : kNVTEFloat32);
  NVTE_CHECK_LAUNCH();
}

}  // namespace nvte::cuda

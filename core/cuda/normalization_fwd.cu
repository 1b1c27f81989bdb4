// cuda/normalization_fwd.cu - LayerNorm / RMSNorm forward (normalization.h) on the GPU, and the
// design of both directions (the backward is in normalization_bwd.cu).
//
// Design: a row of H elements is owned by a "unit" of TPR threads (one warp for short rows,
// up to a whole 512-thread block for long ones); a block holds 512 / TPR units. Each thread
// owns up to 4 vectors of 8 elements (16-byte accesses of bf16/fp16, two of float32) at
// vector indices t, t + TPR, ..., so a unit's accesses are coalesced, and keeps them in
// registers. Forward: x is loaded once, the mean and then the sum of squared deviations are
// reduced from the registers (two-pass variance, float32, warp butterfly then the unit's warps
// in a fixed order, so every thread of a unit holds the same bits), then z is scaled, shifted,
// quantized and stored; amax is one atomic per block. The common 16-bit case runs
// norm_fwd_row (one row per small block, see there); other dtypes run norm_fwd_vec (a grid of
// two 512-thread blocks per SM walking groups of rows). Backward: block c owns a fixed chunk of
// rows (the chunking depends only on N, H and the SM count); in the common 16-bit case
// (norm_bwd_row) each thread keeps its columns' dz * xhat and dz sums in registers over the
// chunk, reduces the two row means and writes dx; other cases (norm_bwd_vec) keep per-unit
// partials in shared memory. Each block's partials become its workspace row [c, H], and a
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
#include <utility>

#include "norm_common.cuh"
#include "normalization.h"
#include "transpose.h"

namespace nvte::cuda {
namespace {
using namespace norm;

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

// Mean (LayerNorm; 0 for RMSNorm) and 1/sqrt(var + eps) of a unit's row held in x (padding
// slots 0), two-pass in float32; x is left holding x - mean. Every thread of the block calls it.
template <int TPR, int NV>
__device__ __forceinline__ void row_stats(float (&x)[NV][kVec], int t, size_t nvec, size_t h, float eps, bool ln,
                                          float *red, float &m, float &rs) {
  m = 0.0f;
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
  rs = 1.0f / sqrtf(q[0] / (float)h + eps);
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
    float m, rs;
    row_stats<TPR, NV>(x, t, nvec, h, p.eps, ln, red, m, rs);  // x now holds x - mu
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

// The common case with every storage type known at compile time: 16-bit x, gamma and beta of
// x's dtype, rowwise z of x's dtype or FP8. One row per block of TPR threads (blocks of a
// few warps, many per SM, so one row's reductions stall only its own warps), each thread
// holding NV vectors of 8 (kExact: H == 8 * NV * TPR, no bounds checks). Per element this is
// about a dozen instructions (decode, mean and variance terms, one FMA for z, amax, the
// scaled paired FP8 conversion): zero-centred gamma folds into the row factor
// (g * rs + rs, one FFMA either way) and RMSNorm is beta = 0, so neither branches per element.
// The mean and 1 / sigma use 1 / H and rsqrtf: a few float32 ulps from the CPU's, inside
// tests/gpu's bound. Partial sums go through two shared-memory slots (sum, squares): the
// second barrier of a row also orders the first slot's reads before the next row's writes.
template <class TI, class TO, int TPR, int NV, bool kExact>
__global__ void __launch_bounds__(TPR) norm_fwd_row(const FwdParams p) {
  pdl_begin();
  constexpr int W = TPR / 32;
  __shared__ float red[2][W];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int nvec = (int)(p.cols / kVec);
  const bool ln = p.beta != nullptr;
  const float s = out_scale(p), inv_h = 1.0f / (float)p.cols;
  const uint4 *gam = static_cast<const uint4 *>(p.gamma);
  const uint4 *bet = static_cast<const uint4 *>(p.beta);
  float amax = 0.0f;
  for (size_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const uint4 *xrow = static_cast<const uint4 *>(p.x) + row * (size_t)nvec;
    float x[NV][kVec];
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int k = t + i * TPR;
      if (kExact || k < nvec) {
        unpack8<TI>(xrow[k], x[i]);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) x[i][j] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) a += x[i][j];
    }
    float m = 0.0f;
    if (ln) {
      a = warp_sum(a);
      if constexpr (W > 1) {
        if (lane == 0) red[0][warp] = a;
        __syncthreads();
        a = sum_partials<W>(red[0], lane);
      }
      m = a * inv_h;
    }
    float q = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      if (kExact || t + i * TPR < nvec) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          x[i][j] -= m;
          q = fmaf(x[i][j], x[i][j], q);
        }
      }
    }
    q = warp_sum(q);
    if constexpr (W > 1) {
      if (lane == 0) red[1][warp] = q;
      __syncthreads();
      q = sum_partials<W>(red[1], lane);
    }
    const float rs = rsqrtf(q * inv_h + p.eps);
    const float rz = p.zc ? rs : 0.0f;  // row factor rs * g (+ rs when gamma is zero-centred)
    if (t == 0) {
      if (p.mu) p.mu[row] = m;
      p.rsigma[row] = rs;
    }
    TO *zrow = static_cast<TO *>(p.z) + row * p.cols;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int k = t + i * TPR;
      if (kExact || k < nvec) {
        float g[kVec], b[kVec], o[kVec];
        unpack8<TI>(__ldg(gam + k), g);  // L1: every row reads the same vectors
        if (ln) {
          unpack8<TI>(__ldg(bet + k), b);
        } else {
#pragma unroll
          for (int j = 0; j < kVec; ++j) b[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          o[j] = fmaf(x[i][j], fmaf(g[j], rs, rz), b[j]);
          amax = fmaxf(amax, fabsf(o[j]));
        }
        store8<TO>(zrow + (size_t)k * kVec, o, s);
      }
    }
  }
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

// One norm_fwd_row instantiation.
template <class TI, class TO, int TPR, bool kExact>
void launch_row_kernel_of(const FwdParams &p, cudaStream_t stream) {
  constexpr auto k = norm_fwd_row<TI, TO, TPR, 4, kExact>;
  // One block per row (the kernel's row loop only matters past 2^31 - 1 rows), scheduled by the
  // hardware as blocks finish. A persistent grid of the resident blocks, each taking every
  // grid-th row, measured slower on an H100 (0.825 / 0.888 / 0.917 of copy bandwidth against
  // 0.900 / 0.956 / 0.945 at 8192 x 4096 / 8192 / 16384): with fixed shares, SMs that get
  // their rows faster sit idle at the end (ncu: SMs active 83% of the kernel's time).
  const size_t grid = std::min<size_t>(p.rows, 0x7fffffff);
  launch_pdl(k, (unsigned)grid, TPR, 0, stream, p);
}

template <class TI, class TO, int TPR>
void launch_row(const FwdParams &p, cudaStream_t stream) {
  if (p.cols == (size_t)kVec * 4 * TPR) launch_row_kernel_of<TI, TO, TPR, true>(p, stream);
  else launch_row_kernel_of<TI, TO, TPR, false>(p, stream);
}

template <class TI, class TO>
void launch_row_for(const FwdParams &p, cudaStream_t stream) {
  switch (unit_threads((p.cols / kVec + 3) / 4)) {
    case 32: return launch_row<TI, TO, 32>(p, stream);
    case 64: return launch_row<TI, TO, 64>(p, stream);
    case 128: return launch_row<TI, TO, 128>(p, stream);
    case 256: return launch_row<TI, TO, 256>(p, stream);
    default: return launch_row<TI, TO, 512>(p, stream);
  }
}

// The typed row kernel's conditions: 16-bit x with gamma/beta of the same dtype, rowwise z
// only, of x's dtype or FP8 (vector conditions checked by the caller).
bool row_kernel_applies(const FwdParams &p) {
  return (p.xt == kNVTEBFloat16 || p.xt == kNVTEFloat16) && p.gt == p.xt && (p.beta == nullptr || p.bt == p.xt) &&
         p.z != nullptr && p.zt == nullptr &&
         (p.zt_dtype == p.xt || p.zt_dtype == kNVTEFloat8E4M3 || p.zt_dtype == kNVTEFloat8E5M2);
}

void launch_row_kernel(const FwdParams &p, cudaStream_t stream) {
  const bool b16 = p.xt == kNVTEBFloat16;
  switch (p.zt_dtype) {
    case kNVTEFloat8E4M3:
      return b16 ? launch_row_for<bf16, fp8e4m3>(p, stream) : launch_row_for<fp16, fp8e4m3>(p, stream);
    case kNVTEFloat8E5M2:
      return b16 ? launch_row_for<bf16, fp8e5m2>(p, stream) : launch_row_for<fp16, fp8e5m2>(p, stream);
    default:
      return b16 ? launch_row_for<bf16, bf16>(p, stream) : launch_row_for<fp16, fp16>(p, stream);
  }
}

template <int TPR, int NV, int CTA>
void launch_fwd(const FwdParams &p, cudaStream_t stream) {
  constexpr int R = CTA / TPR;
  const size_t groups = (p.rows + R - 1) / R;
  const size_t grid = std::min<size_t>(groups, (size_t)sm_count() * (1024 / CTA));
  auto *k = p.xt == kNVTEBFloat16 ? norm_fwd_vec<bf16, TPR, NV, CTA>
            : p.xt == kNVTEFloat16 ? norm_fwd_vec<fp16, TPR, NV, CTA>
                                   : norm_fwd_vec<float, TPR, NV, CTA>;
  k<<<(unsigned)grid, CTA, 0, stream>>>(p);
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

// Runs the forward kernel that fits p (rowwise z and/or columnwise zt as p holds them).
void launch_norm_fwd(const FwdParams &p, cudaStream_t stream) {
  const size_t h = p.cols, nvec = h / kVec;
  const bool vec = h > 0 && h % kVec == 0 && nvec <= 2048 && vec_ok(p.x) && vec_ok(p.gamma) && vec_ok(p.beta) &&
                   vec_ok(p.z);
  if (!vec) {
    const size_t grid = std::min<size_t>(p.rows, (size_t)sm_count() * 4);
    norm_fwd_any<512><<<(unsigned)grid, 512, 0, stream>>>(p);
    NVTE_CHECK_LAUNCH();
    return;
  }
  if (row_kernel_applies(p)) return launch_row_kernel(p, stream);
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

}  // namespace

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
  if (p.rows == 0) return write_empty_fp8_scale_inv(p.scale, p.scale_inv, p.col_scale_inv, nullptr, stream);
  // Both layouts of z: the row kernels write the rowwise z, then the tiled transpose copies its
  // elements into the columnwise buffer (bit for bit). That reads z once more (1 byte per element
  // for FP8) but keeps the fast row kernels and writes both layouts with 16-byte stores; storing
  // the transpose from the row kernel itself is one strided byte store per element.
  void *zt = nullptr;
  if (p.z != nullptr && p.zt != nullptr) std::swap(zt, p.zt);
  launch_norm_fwd(p, stream);
  if (zt != nullptr) transpose_raw(p.z, zt, p.rows, p.cols, dtype_size(p.zt_dtype), stream);
}

}  // namespace nvte::cuda

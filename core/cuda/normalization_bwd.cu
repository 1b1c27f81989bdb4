// cuda/normalization_bwd.cu - LayerNorm / RMSNorm backward (normalization.h) on the GPU: per-row
// dx from registers, deterministic dgamma/dbeta through per-block partials and a fixed-order
// reduce. The design (units of TPR threads per row, typed 16-bit paths) is described at the top
// of normalization_fwd.cu; shared pieces are in norm_common.cuh and norm_bwd.cuh, the kernel for
// rows of 2049..4096 elements in normalization_bwd_pipelined.cu.
#include <algorithm>

#include "norm_bwd.cuh"
#include "normalization.h"

namespace nvte::cuda {
namespace {
using namespace norm;

// Rows in registers (H % 8 == 0, 16-byte aligned rows, H <= 8 * NV * TPR, x and dz of
// storage type TI). Dynamic shared memory: per unit and output (dgamma, dbeta) [8][NV * TPR]
// float partials (slot k of column k * 8 + j at [j][k]: a warp's accesses hit distinct banks).
// xhat and dy are computed twice (before and after the row reduction) from the stored row,
// with the same operations, so both passes see the same bits. kTyped (16-bit TI, and gamma,
// dx and the add input of TI's dtype, checked on the host): gamma, add and dx are accessed as
// raw 16-byte words decoded / packed in pairs, as in norm_fwd_row, instead of through the
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

// The common 16-bit case for rows of up to 8 * NV * TPR elements (x, dz, gamma, dx and add of
// one dtype TI): one row at a time per block of TPR threads, each thread owning the same NV
// vectors of columns in every row, so its dgamma / dbeta partials stay in registers for the
// block's whole chunk of rows (no shared-memory read-modify-write per element, which made
// norm_bwd_vec issue-bound at one resident block per SM). The row reduction of the two means
// uses double-buffered shared slots: one barrier per row. At the end each thread writes its
// columns of the block's workspace row; norm_bwd_finalize adds the rows in order.
template <int TPR, int NV>
constexpr int bwd_row_blocks_per_sm() {  // NV > 1 needs up to 128 registers (partials of 8 NV columns)
  return NV == 1 ? 1024 / TPR : 1;
}

// Rows of 2049..4096 elements (one vector per thread of 512) take norm_bwd_row_pipelined, one
// block per SM: it keeps pass 1's terms in registers and overlaps the row reductions (the kernel
// was instruction- and latency-bound there, not short of parallelism: 128 and 256 blocks ran
// equally fast). H100, 8192 x 4096: 0.79 (norm_bwd_row) -> 0.82 (terms kept) -> 0.86 (pipelined).
constexpr bool bwd_rows_pipelined(size_t h) { return h > 2048 && h <= 4096; }

template <class TI, int TPR, int NV, int ST>
__global__ void __launch_bounds__(TPR, bwd_row_blocks_per_sm<TPR, NV>()) norm_bwd_row(const BwdParams p) {
  pdl_begin();
  constexpr int W = TPR / 32;
  __shared__ float red[2][W][2];
  extern __shared__ uint4 ring[];  // [ST][x, dz][NV][TPR]
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int nvec = (int)(p.cols / kVec);
  const float inv_h = 1.0f / (float)p.cols;
  const uint4 *gam = static_cast<const uint4 *>(p.gamma);
  float pg[NV][kVec], pb[NV][kVec];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int j = 0; j < kVec; ++j) pg[i][j] = pb[i][j] = 0.0f;

  const size_t r0 = blockIdx.x * p.rows_per_part;
  const size_t r1 = min(p.rows, r0 + p.rows_per_part);
  auto at = [&](int slot, int which, int i) -> uint4 & { return ring[((slot * 2 + which) * NV + i) * TPR + t]; };
  auto fetch = [&](size_t row, int slot) {
    if (ST > 0 && row < r1) {
      const uint4 *xrow = static_cast<const uint4 *>(p.x) + row * (size_t)nvec;
      const uint4 *drow = static_cast<const uint4 *>(p.dz) + row * (size_t)nvec;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int k = t + i * TPR;
        if (k < nvec) {
          cp_async16(&at(slot, 0, i), xrow + k);
          cp_async16(&at(slot, 1, i), drow + k);
        }
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st + 1 < ST; ++st) fetch(r0 + st, st);
  // mu and rsigma: one row ahead in registers.
  float m, rs;
  row_stats(p, r0, r1, m, rs);
  int buf = 0, slot = 0;
  for (size_t row = r0; row < r1; ++row, buf ^= 1, slot = slot == ST - 1 ? 0 : slot + 1) {
    uint4 xr[NV], dr[NV];  // ST == 0
    if constexpr (ST > 0) {
      fetch(row + ST - 1, slot == 0 ? ST - 1 : slot - 1);  // the slot read in the previous row
    } else {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int k = t + i * TPR;
        if (k < nvec) {
          xr[i] = static_cast<const uint4 *>(p.x)[row * (size_t)nvec + k];
          dr[i] = static_cast<const uint4 *>(p.dz)[row * (size_t)nvec + k];
        }
      }
    }
    float mn, rsn;
    row_stats(p, row + 1, r1, mn, rsn);
    if constexpr (ST > 0) cp_async_wait<ST - 1>();
    // xhat, dz and dy = dz * g of vector i, with the CPU's operation order; computed in both
    // passes from the stored row (the same operations give the same bits).
    auto terms = [&](int i, int k, float (&xh)[kVec], float (&dz)[kVec], float (&dy)[kVec]) {
      float g[kVec], xf[kVec];
      unpack8<TI>(__ldg(gam + k), g);
      unpack8<TI>(ST > 0 ? at(slot, 0, i) : xr[i], xf);
      unpack8<TI>(ST > 0 ? at(slot, 1, i) : dr[i], dz);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        xh[j] = __fmul_rn(__fsub_rn(xf[j], m), rs);
        dy[j] = __fmul_rn(dz[j], p.zc ? g[j] + 1.0f : g[j]);
      }
    };
    float a = 0.0f, b = 0.0f;  // sums of dy and dy * xhat
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int k = t + i * TPR;
      if (k < nvec) {
        float xh[kVec], dz[kVec], dy[kVec];
        terms(i, k, xh, dz, dy);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          a += dy[j];
          b = fmaf(dy[j], xh[j], b);
          pg[i][j] = fmaf(dz[j], xh[j], pg[i][j]);
          pb[i][j] += dz[j];
        }
      }
    }
    a = warp_sum(a);
    b = warp_sum(b);
    if constexpr (W > 1) {
      if (lane == 0) {
        red[buf][warp][0] = a;
        red[buf][warp][1] = b;
      }
      __syncthreads();
      a = sum_partials<W, 2>(&red[buf][0][0], lane);
      b = sum_partials<W, 2>(&red[buf][0][1], lane);
    }
    const float mean_dy = p.ln ? a * inv_h : 0.0f;
    const float mean_dyx = b * inv_h;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int k = t + i * TPR;
      if (k < nvec) {
        float o[kVec], xh[kVec], dz[kVec], dy[kVec];
        terms(i, k, xh, dz, dy);
#pragma unroll
        for (int j = 0; j < kVec; ++j) o[j] = dx_value(rs, dy[j], xh[j], mean_dy, mean_dyx);
        store_dx_vec<TI>(p, (size_t)nvec, row, k, o);
      }
    }
    m = mn;
    rs = rsn;
  }
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int k = t + i * TPR;
    if (k < nvec) write_partials(p, k, pg[i], pb[i]);
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
// Block (32, kFinRows): the kFinRows rows of threads add contiguous slices of the parts, then
// row 0 adds the slice sums in order. 16 rows keep ~32 KiB of loads in flight per SM (with 8,
// the ~6 us pass over 264 x 4096 x 2 partials ran at a third of copy bandwidth on an H200).
constexpr int kFinRows = 16;
__global__ void __launch_bounds__(32 * kFinRows) norm_bwd_finalize(const float *ws, size_t parts, size_t h,
                                                                  void *dgamma, NVTEDType gt, void *dbeta,
                                                                  NVTEDType bt) {
  pdl_begin();
  __shared__ float acc[kFinRows][33];
  const int o = blockIdx.y;
  const size_t col = (size_t)blockIdx.x * 32 + threadIdx.x;
  const float *w = ws + o * parts * h;
  const size_t per = (parts + kFinRows - 1) / kFinRows;
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
    for (int y = 1; y < kFinRows; ++y) tot += acc[y][threadIdx.x];
    if (o == 0) st1(dgamma, gt, col, tot);
    else st1(dbeta, bt, col, tot);
  }
}

// Rows up to this long (H % 8 == 0) can take norm_bwd_row; its block size for a row length.
constexpr size_t kRowMaxH = 16 * 1024;
int row_threads(size_t h) { return h / kVec <= 512 ? unit_threads(h / kVec) : 512; }

// The backward's split of N rows into parts (blocks): a function of (n, h, sm) only, so the
// workspace query agrees with the launch whichever kernel runs.
struct Plan {
  size_t parts, rows_per_part;
};
Plan bwd_plan(size_t n, size_t h, int sm) {
  if (n == 0 || h == 0) return {0, 0};
  // norm_bwd_row's lengths: as many parts as resident row blocks (1024 / TPR per SM, its
  // launch bound). Longer rows: one resident 512-thread block per SM (norm_bwd_vec's shared
  // partials take up to 128 KiB).
  size_t per_sm = 1;
  if (h % kVec == 0 && h <= kRowMaxH)
    per_sm = h <= (size_t)kVec * row_threads(h) ? 1024 / row_threads(h) : bwd_row_blocks_per_sm<512, 2>();
  if (h % kVec == 0 && bwd_rows_pipelined(h)) per_sm = 1;
  const size_t want = (size_t)std::max(sm, 1) * per_sm;
  size_t rpp = (n + std::min(n, want) - 1) / std::min(n, want);
  // Whole multiples of 8 rows per part. Measured on an H100 (132 SMs, 8192 rows, one block per
  // SM): 64 rows per part (128 blocks) ran at 0.882 of copy bandwidth at 8192 columns against
  // 0.825 for 63 (131 blocks), and 0.875 against 0.860 at 16384; 66 rows gave 0.846, 68 0.876.
  // Not understood (DRAM address mapping of the blocks' row streams is the guess); re-measure
  // when the row kernel changes.
  if (rpp > 8) rpp = (rpp + 7) / 8 * 8;
  return {(n + rpp - 1) / rpp, rpp};
}

template <class TI, int TPR, int NV, int ST>
void launch_bwd_row_st(const BwdParams &p, cudaStream_t stream) {
  constexpr auto k = norm_bwd_row<TI, TPR, NV, ST>;
  constexpr size_t smem = bwd_ring_bytes<TPR, NV, ST>();
  if (smem > 0) resident_blocks(reinterpret_cast<const void *>(k), TPR, smem);  // allows the ring's shared memory
  launch_pdl(k, (unsigned)p.parts, TPR, smem, stream, p);
}

// Ring depth by vectors per thread, measured on an H200 (fraction of copy bandwidth, 8192 rows):
// one vector (H <= 4096), 4 stages: 0.61 -> 0.70 at 4096 columns; two (H <= 8192), 3 stages
// (96 KiB): 0.62 -> 0.74 at 8192; four (H <= 16384): no ring (3 stages measured 0.709 against
// 0.723 without at 16384).
template <class TI, int TPR, int NV>
void launch_bwd_row_nv(const BwdParams &p, cudaStream_t stream) {
  launch_bwd_row_st<TI, TPR, NV, NV == 1 ? 4 : (NV == 2 ? 3 : 0)>(p, stream);
}

template <class TI, int TPR>
void launch_bwd_row(const BwdParams &p, cudaStream_t stream) {
  if constexpr (TPR == 512) {  // rows of 4096 < H <= 16384 elements: two or four vectors per thread
    if (p.cols > (size_t)kVec * TPR) {
      if (p.cols <= (size_t)2 * kVec * TPR) launch_bwd_row_nv<TI, TPR, 2>(p, stream);
      else launch_bwd_row_nv<TI, TPR, 4>(p, stream);
      return;
    }
  }
  launch_bwd_row_nv<TI, TPR, 1>(p, stream);
}

template <class TI>
void launch_bwd_row_for(const BwdParams &p, cudaStream_t stream) {
  if (bwd_rows_pipelined(p.cols)) {
    launch_bwd_rows_upto_4096(p, stream);
    return;
  }
  switch (row_threads(p.cols)) {
    case 32: return launch_bwd_row<TI, 32>(p, stream);
    case 64: return launch_bwd_row<TI, 64>(p, stream);
    case 128: return launch_bwd_row<TI, 128>(p, stream);
    case 256: return launch_bwd_row<TI, 256>(p, stream);
    default: return launch_bwd_row<TI, 512>(p, stream);
  }
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
}  // namespace

int norm_sm(int hint) { return hint > 0 ? hint : sm_count(); }

size_t norm_bwd_workspace_bytes(size_t n, size_t h, int sm) {
  return bwd_plan(n, h, sm).parts * h * 2 * sizeof(float);
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
    const bool row = vec && h <= kRowMaxH && (p.xt == kNVTEBFloat16 || p.xt == kNVTEFloat16) && p.gt == p.xt &&
                     p.dxt == p.xt && (p.add == nullptr || p.at == p.xt);
    if (!vec) {
      norm_bwd_any<512><<<(unsigned)plan.parts, 512, 0, stream>>>(p);
      NVTE_CHECK_LAUNCH();
    } else if (row) {
      if (p.xt == kNVTEBFloat16) launch_bwd_row_for<bf16>(p, stream);
      else launch_bwd_row_for<fp16>(p, stream);
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
  launch_pdl(norm_bwd_finalize, grid, dim3(32, kFinRows), 0, stream, (const float *)p.ws, p.parts, h,
             dgamma.params[kNVTERowwiseData].data_ptr, dtype_of(dgamma),
             dbeta ? dbeta->params[kNVTERowwiseData].data_ptr : nullptr, dbeta ? dtype_of(*dbeta) : kNVTEFloat32);
}

}  // namespace nvte::cuda

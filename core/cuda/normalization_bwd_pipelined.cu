// cuda/normalization_bwd_pipelined.cu - the LayerNorm / RMSNorm backward for rows of 2049..4096
// 16-bit elements (one 16-byte vector per thread of a 512-thread block, one block per SM), where
// the row kernel of normalization_bwd.cu was bound by instruction issue and by the latency of its
// two row reductions rather than by memory: this kernel keeps each row's terms in registers and
// finishes the row one iteration later, so the reductions overlap other work.
#include "norm_bwd.cuh"
#include "pdl.cuh"

namespace nvte::cuda::norm {
namespace {

// Rows of 2049..4096 elements (one vector per thread of 512), software-pipelined across rows:
// iteration r runs pass 1 of row r (xhat, dy, the two local sums, the dgamma/dbeta partials),
// then, before its one barrier, the block-level sums of row r - 1 (written before the previous
// barrier) and pass 2 of row r - 1, whose xhat and dy stayed in registers. The two shuffle
// chains (row r's warp sums, row r - 1's partials) and row r - 1's dx arithmetic are
// independent, so the scheduler overlaps them (norm_bwd_row waits on each chain in turn, the
// whole block at the barrier between them). Same operations in the same order as norm_bwd_row,
// so the same bits (checked bit for bit against it on an H100).
template <class TI>
__global__ void __launch_bounds__(512, 1) norm_bwd_row_pipelined(const BwdParams p) {
  pdl_begin();
  constexpr int TPR = 512, W = TPR / 32, ST = 4;
  __shared__ float red[2][W][2];
  extern __shared__ uint4 ring[];  // [ST][x, dz][TPR]
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int nvec = (int)(p.cols / kVec);
  const bool mine = t < nvec;
  const float inv_h = 1.0f / (float)p.cols;
  float pg[kVec], pb[kVec], g[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) pg[j] = pb[j] = g[j] = 0.0f;
  if (mine) {
    unpack8<TI>(__ldg(static_cast<const uint4 *>(p.gamma) + t), g);
#pragma unroll
    for (int j = 0; j < kVec; ++j) g[j] = p.zc ? g[j] + 1.0f : g[j];
  }
  const size_t r0 = blockIdx.x * p.rows_per_part;
  const size_t r1 = min(p.rows, r0 + p.rows_per_part);
  auto at = [&](int slot, int which) -> uint4 & { return ring[(slot * 2 + which) * TPR + t]; };
  auto fetch = [&](size_t row, int slot) {
    if (row < r1 && mine) {
      cp_async16(&at(slot, 0), static_cast<const uint4 *>(p.x) + row * (size_t)nvec + t);
      cp_async16(&at(slot, 1), static_cast<const uint4 *>(p.dz) + row * (size_t)nvec + t);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int st = 0; st + 1 < ST; ++st) fetch(r0 + st, st);
  float m, rs;
  row_stats(p, r0, r1, m, rs);
  if (t < 2 * W) (&red[1][0][0])[t] = 0.0f;
  __syncthreads();
  float px[kVec], py[kVec], prs = 0.0f;  // xhat, dy and rsigma of the previous row (pass 2 pending)
#pragma unroll
  for (int j = 0; j < kVec; ++j) px[j] = py[j] = 0.0f;
  // pass 2 of row `row`: dx from its kept terms and means (+ the add input), stored.
  auto finish = [&](size_t row, float mean_dy, float mean_dyx) {
    if (!mine) return;
    float o[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) o[j] = dx_value(prs, py[j], px[j], mean_dy, mean_dyx);
    store_dx_vec<TI>(p, (size_t)nvec, row, t, o);
  };
  int buf = 0, slot = 0;
  for (size_t row = r0; row < r1; ++row, buf ^= 1, slot = slot == ST - 1 ? 0 : slot + 1) {
    fetch(row + ST - 1, slot == 0 ? ST - 1 : slot - 1);  // the slot row - 1 was read from
    float mn, rsn;
    row_stats(p, row + 1, r1, mn, rsn);
    cp_async_wait<ST - 1>();
    float xh[kVec], dy[kVec], a = 0.0f, b = 0.0f;
    {
      float xf[kVec], dz[kVec];
      unpack8<TI>(at(slot, 0), xf);
      unpack8<TI>(at(slot, 1), dz);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (!mine) xf[j] = dz[j] = 0.0f;  // (ring slots this thread never filled)
        xh[j] = __fmul_rn(__fsub_rn(xf[j], m), rs);
        dy[j] = __fmul_rn(dz[j], g[j]);
        a += dy[j];
        b = fmaf(dy[j], xh[j], b);
        pg[j] = fmaf(dz[j], xh[j], pg[j]);
        pb[j] += dz[j];
      }
    }
    // The previous row's block sums (as sum_partials: warp partials in warp order through one
    // butterfly) and this row's warp sums: four independent shuffle chains, no branches between
    // them. On the first iteration red[1] holds the zeros written below (unused).
    const float2 pw = reinterpret_cast<const float2 *>(&red[buf ^ 1][0][0])[lane & (W - 1)];
    float sa = lane < W ? pw.x : 0.0f, sb = lane < W ? pw.y : 0.0f;
    sa = warp_sum(sa);
    sb = warp_sum(sb);
    a = warp_sum(a);
    b = warp_sum(b);
    if (row > r0) finish(row - 1, p.ln ? sa * inv_h : 0.0f, sb * inv_h);
    if (lane == 0) {
      red[buf][warp][0] = a;
      red[buf][warp][1] = b;
    }
    __syncthreads();  // red[buf] complete; every read of red[buf ^ 1] above is done
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      px[j] = xh[j];
      py[j] = dy[j];
    }
    prs = rs;
    m = mn;
    rs = rsn;
  }
  if (r0 < r1) {  // the last row's pass 2
    const int last = (int)((r1 - r0) & 1) ^ 1;  // the red buffer its iteration wrote
    const float sa = sum_partials<W, 2>(&red[last][0][0], lane);
    const float sb = sum_partials<W, 2>(&red[last][0][1], lane);
    finish(r1 - 1, p.ln ? sa * inv_h : 0.0f, sb * inv_h);
  }
  if (mine) write_partials(p, t, pg, pb);
}

}  // namespace

void launch_bwd_rows_upto_4096(const BwdParams &p, cudaStream_t stream) {
  constexpr size_t smem = bwd_ring_bytes<512, 1, 4>();
  auto *k = p.xt == kNVTEBFloat16 ? norm_bwd_row_pipelined<bf16> : norm_bwd_row_pipelined<fp16>;
  resident_blocks(reinterpret_cast<const void *>(k), 512, smem);  // allows the ring's shared memory
  launch_pdl(k, (unsigned)p.parts, 512, smem, stream, p);
}

}  // namespace nvte::cuda::norm

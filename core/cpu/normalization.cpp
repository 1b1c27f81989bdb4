// cpu/normalization.cpp - LayerNorm / RMSNorm forward and backward: float32 row loops.
//
// Per-row sums (mean, variance, the two backward means) are accumulated in double:
// the float32 terms are what the kernels compute, and the double sum keeps the
// statistics accurate to float32 rounding for any row length. Results are float32.
#include "normalization.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "parallel.h"
#include "rows.h"

namespace nvte::cpu {
namespace {

// A gamma-like [H] vector as float32; plus_one gives zero-centered gamma's g = 1 + gamma.
std::vector<float> load_vec(const Tensor &t, size_t n, bool plus_one) {
  std::vector<float> v(n);
  if (n) load_row(t.params[kNVTERowwiseData].data_ptr, t.params[kNVTERowwiseData].dtype, 0, n, v.data());
  if (plus_one)
    for (float &e : v) e += 1.0f;
  return v;
}

void store_vec(Tensor &t, const std::vector<float> &v) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  with_float_dtype(b.dtype, "output", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T *dst = static_cast<T *>(b.data_ptr);
    for (size_t i = 0; i < v.size(); ++i) dst[i] = from_f32<T>(v[i]);
  });
}

float *stats_ptr(Tensor *t) { return t ? static_cast<float *>(t->params[kNVTERowwiseData].data_ptr) : nullptr; }

// Rows per chunk so that one chunk holds a few thousand elements.
size_t row_grain(size_t cols) { return std::max<size_t>(1, 4096 / std::max<size_t>(cols, 1)); }

}  // namespace

void norm_fwd(const Tensor &x, const Tensor &gamma, const Tensor *beta, float epsilon, Tensor &z,
              Tensor *mu, Tensor &rsigma, bool zero_centered_gamma) {
  const InputRows in = input_rows(x, "x");
  const size_t n = in.rows, h = in.cols;
  const std::vector<float> g = load_vec(gamma, h, zero_centered_gamma);
  const std::vector<float> b = beta ? load_vec(*beta, h, false) : std::vector<float>();
  OutputRows out(z, "z", n, h);
  float *mu_p = stats_ptr(mu);
  float *rs_p = stats_ptr(&rsigma);
  const bool center = mu != nullptr;
  parallel_for(n, row_grain(h), [&](size_t r0, size_t r1) {
    std::vector<float> row(h), res(h);
    for (size_t r = r0; r < r1; ++r) {
      in.load(r, row.data());
      // A zero-width row has mean 0 and variance 0 (rsigma = 1/sqrt(epsilon)).
      float m = 0.0f;
      if (center && h) {
        double s = 0.0;
        for (size_t i = 0; i < h; ++i) s += row[i];
        m = static_cast<float>(s / static_cast<double>(h));
      }
      // Two-pass variance: mean of squared deviations from the float32 mean.
      double ss = 0.0;
      for (size_t i = 0; i < h; ++i) {
        const float d = row[i] - m;
        ss += static_cast<double>(d) * d;
      }
      const float var = h ? static_cast<float>(ss / static_cast<double>(h)) : 0.0f;
      const float rs = 1.0f / std::sqrt(var + epsilon);
      for (size_t i = 0; i < h; ++i) {
        const float v = (row[i] - m) * rs * g[i];
        res[i] = beta ? v + b[i] : v;
      }
      out.store(r, res.data());
      if (mu_p) mu_p[r] = m;
      rs_p[r] = rs;
    }
  });
  out.finish();
}

namespace {

// Row blocks of the backward's dgamma/dbeta partial sums. The split depends only on
// the problem size (never on the thread count), and partials are added in block
// order, so the result is bit-identical for any NVTE_CPU_THREADS.
struct Blocks {
  size_t rows_per_block, count;
};
Blocks row_blocks(size_t n, size_t h) {
  const size_t min_rows = std::max<size_t>(1, 16384 / std::max<size_t>(h, 1));
  // At most 256 blocks and ~32 MiB of double partials (two vectors of h each).
  const size_t max_blocks =
      std::max<size_t>(1, std::min<size_t>(256, (size_t{32} << 20) / (16 * std::max<size_t>(h, 1))));
  const size_t rpb = std::max(min_rows, (n + max_blocks - 1) / max_blocks);
  return {rpb, (n + rpb - 1) / rpb};
}

// out[i] = sum over blocks (in block order) of partial[blk * h + i].
std::vector<float> reduce_blocks(const std::vector<double> &partial, size_t nblocks, size_t h) {
  std::vector<float> out(h);
  parallel_for(h, 1024, [&](size_t c0, size_t c1) {
    for (size_t i = c0; i < c1; ++i) {
      double s = 0.0;
      for (size_t blk = 0; blk < nblocks; ++blk) s += partial[blk * h + i];
      out[i] = static_cast<float>(s);
    }
  });
  return out;
}

}  // namespace

void norm_bwd(const Tensor &dz, const Tensor &x, const Tensor *add, const Tensor *mu,
              const Tensor &rsigma, const Tensor &gamma, Tensor &dx, Tensor &dgamma, Tensor *dbeta,
              bool zero_centered_gamma) {
  const InputRows xs = input_rows(x, "x");
  const InputRows dzs = input_rows(dz, "dz");
  InputRows adds;
  if (add) adds = input_rows(*add, "add");
  const size_t n = xs.rows, h = xs.cols;
  const std::vector<float> g = load_vec(gamma, h, zero_centered_gamma);
  OutputRows out(dx, "dx", n, h);
  const float *mu_p = mu ? static_cast<const float *>(mu->params[kNVTERowwiseData].data_ptr) : nullptr;
  const float *rs_p = static_cast<const float *>(rsigma.params[kNVTERowwiseData].data_ptr);
  const bool center = mu != nullptr;

  const Blocks blocks = row_blocks(n, h);
  std::vector<double> pg(blocks.count * h, 0.0);
  std::vector<double> pb(dbeta ? blocks.count * h : 0, 0.0);
  parallel_for(blocks.count, 1, [&](size_t b0, size_t b1) {
    std::vector<float> xr(h), dzr(h), xhat(h), dy(h), res(h), ar(add ? h : 0);
    for (size_t blk = b0; blk < b1; ++blk) {
      double *pgb = pg.data() + blk * h;
      double *pbb = dbeta ? pb.data() + blk * h : nullptr;
      const size_t r_end = std::min(n, (blk + 1) * blocks.rows_per_block);
      for (size_t r = blk * blocks.rows_per_block; r < r_end; ++r) {
        xs.load(r, xr.data());
        dzs.load(r, dzr.data());
        const float m = center ? mu_p[r] : 0.0f;
        const float rs = rs_p[r];
        double s_dy = 0.0, s_dyx = 0.0;
        for (size_t i = 0; i < h; ++i) {
          xhat[i] = (xr[i] - m) * rs;
          dy[i] = dzr[i] * g[i];
          s_dy += dy[i];
          s_dyx += static_cast<double>(dy[i]) * xhat[i];
          pgb[i] += static_cast<double>(dzr[i]) * xhat[i];
          if (pbb) pbb[i] += dzr[i];
        }
        const double inv_h = h ? 1.0 / static_cast<double>(h) : 0.0;
        const float mean_dy = center ? static_cast<float>(s_dy * inv_h) : 0.0f;
        const float mean_dyx = static_cast<float>(s_dyx * inv_h);
        for (size_t i = 0; i < h; ++i) res[i] = rs * (dy[i] - mean_dy - xhat[i] * mean_dyx);
        if (add) {
          adds.load(r, ar.data());
          for (size_t i = 0; i < h; ++i) res[i] += ar[i];
        }
        out.store(r, res.data());
      }
    }
  });
  out.finish();
  // Zero rows still define dgamma = dbeta = 0 (an empty sum), so they are written.
  store_vec(dgamma, reduce_blocks(pg, blocks.count, h));
  if (dbeta) store_vec(*dbeta, reduce_blocks(pb, blocks.count, h));
}

}  // namespace nvte::cpu

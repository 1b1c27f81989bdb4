// cpu/gemm.cpp - the float32 matmul engine behind the CPU GEMM: operands of any float
// dtype and either layout are decoded into packed float32 panels (this absorbs FP8/bf16/
// fp16 decoding and transposes), then a register-blocked micro-kernel runs over
// cache-sized blocks spread across the thread pool.
#include "gemm.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <new>

#include "../common/dtype_switch.h"
#include "gemm_kernel.h"
#include "parallel.h"

namespace nvte::cpu {
namespace {


// Element decoder: FP8 through a 256-entry table that already holds value * scale_inv.
template <class T>
struct Decode {
  const float *lut;
  float operator()(T v) const {
    if constexpr (is_fp8_type<T>::value) {
      return lut[v.bits];
    } else {
      return to_f32(v);
    }
  }
};

using Lut = std::array<float, 256>;

Lut make_lut(const MatView &v) {
  Lut t{};
  if (v.dtype == kNVTEFloat8E4M3)
    for (int b = 0; b < 256; ++b) t[b] = e4m3_to_float(static_cast<uint8_t>(b)) * v.scale_inv;
  if (v.dtype == kNVTEFloat8E5M2)
    for (int b = 0; b < 256; ++b) t[b] = e5m2_to_float(static_cast<uint8_t>(b)) * v.scale_inv;
  return t;
}

// Y panels: np panels of nr columns from column j0, k-slice [k0, k0 + kc) of y; panel q is
// stored at dst + q * kc * nr as kc rows of nr floats (columns beyond y are zero).
template <class T>
void pack_y_panels(const MatView &y, Decode<T> dec, size_t j0, size_t nr, size_t np, size_t k0, size_t kc,
                   float *dst) {
  const T *base = static_cast<const T *>(y.data);
  if (y.col_stride == 1) {  // rows of y contiguous: read each row's run across all panels
    for (size_t kk = 0; kk < kc; ++kk) {
      const T *s = base + (k0 + kk) * y.row_stride;
      for (size_t q = 0; q < np; ++q) {
        const size_t jq = j0 + q * nr, nv = jq < y.cols ? std::min(nr, y.cols - jq) : 0;
        float *d = dst + q * kc * nr + kk * nr;
        for (size_t j = 0; j < nv; ++j) d[j] = dec(s[jq + j]);
        for (size_t j = nv; j < nr; ++j) d[j] = 0.0f;
      }
    }
    return;
  }
  // Columns of y contiguous (a transposed operand): read each column as a run.
  for (size_t q = 0; q < np; ++q) {
    const size_t jq = j0 + q * nr, nv = jq < y.cols ? std::min(nr, y.cols - jq) : 0;
    float *d = dst + q * kc * nr;
    for (size_t kk = 0; kk < kc; ++kk)
      for (size_t j = nv; j < nr; ++j) d[kk * nr + j] = 0.0f;
    for (size_t j = 0; j < nv; ++j) {
      const T *s = base + (jq + j) * y.col_stride + k0 * y.row_stride;
      for (size_t kk = 0; kk < kc; ++kk) d[kk * nr + j] = dec(s[kk * y.row_stride]);
    }
  }
}

// X block: rows [i0, i0 + mc) x k-slice [k0, k0 + kc) as micro-panels of mr rows,
// each kc steps of mr floats.
template <class T>
void pack_x_block(const MatView &x, Decode<T> dec, size_t i0, size_t mc, size_t k0, size_t kc,
                  size_t mr, float *dst) {
  const T *base = static_cast<const T *>(x.data);
  for (size_t ir = 0; ir < mc; ir += mr) {
    float *d = dst + ir * kc;
    const size_t nv = std::min(mr, mc - ir);
    if (x.col_stride == 1) {  // rows of x contiguous along k
      for (size_t i = 0; i < nv; ++i) {
        const T *s = base + (i0 + ir + i) * x.row_stride + k0;
        for (size_t kk = 0; kk < kc; ++kk) d[kk * mr + i] = dec(s[kk]);
      }
    } else {
      for (size_t kk = 0; kk < kc; ++kk) {
        const T *s = base + (k0 + kk) * x.col_stride + (i0 + ir) * x.row_stride;
        for (size_t i = 0; i < nv; ++i) d[kk * mr + i] = dec(s[i * x.row_stride]);
      }
    }
    for (size_t i = nv; i < mr; ++i)
      for (size_t kk = 0; kk < kc; ++kk) d[kk * mr + i] = 0.0f;
  }
}

// Pack functions bound to the operand's dtype once per call.
using PackY = void (*)(const MatView &, const float *, size_t, size_t, size_t, size_t, size_t, float *);
using PackX = void (*)(const MatView &, const float *, size_t, size_t, size_t, size_t, size_t, float *);

PackY pack_y_for(NVTEDType t) {
  return with_float_dtype(t, "op(A)", [](auto tag) -> PackY {
    using T = typename decltype(tag)::type;
    return [](const MatView &y, const float *lut, size_t j0, size_t nr, size_t np, size_t k0, size_t kc,
              float *dst) { pack_y_panels<T>(y, Decode<T>{lut}, j0, nr, np, k0, kc, dst); };
  });
}
PackX pack_x_for(NVTEDType t) {
  return with_float_dtype(t, "op(B)", [](auto tag) -> PackX {
    using T = typename decltype(tag)::type;
    return [](const MatView &x, const float *lut, size_t i0, size_t mc, size_t k0, size_t kc, size_t mr,
              float *dst) { pack_x_block<T>(x, Decode<T>{lut}, i0, mc, k0, kc, mr, dst); };
  });
}

size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

}  // namespace

float *AlignedBuf::get(size_t n) {
  if (n > cap_) {
    std::free(p_);
    p_ = nullptr;
    cap_ = 0;
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    p_ = static_cast<float *>(std::aligned_alloc(64, bytes ? bytes : 64));
    if (p_ == nullptr) throw std::bad_alloc();
    cap_ = n;
  }
  return p_;
}

void AlignedBuf::trim() {
  if (cap_ > kKeepFloats) {
    std::free(p_);
    p_ = nullptr;
    cap_ = 0;
  }
}

void matmul_f32(const MatView &x, const MatView &y, float *c, size_t ldc) {
  const size_t n = x.rows, k = x.cols, m = y.cols;
  if (n == 0 || m == 0) return;
  if (k == 0) {
    for (size_t i = 0; i < n; ++i) std::memset(c + i * ldc, 0, m * sizeof(float));
    return;
  }
  const GemmKernel &kr = gemm_kernel();
  const size_t mr = kr.mr, nr = kr.nr;
  const Lut xlut = make_lut(x), ylut = make_lut(y);
  const PackX pack_x = pack_x_for(x.dtype);
  const PackY pack_y = pack_y_for(y.dtype);
  const size_t threads = static_cast<size_t>(num_threads());
  const bool small = 2.0 * n * m * k < 4.0e6;  // thread hand-off would cost more than it saves

  // k slices of (nearly) equal length, at most kr.kc.
  const size_t k_slices = ceil_div(k, kr.kc), kc_max = ceil_div(k, k_slices);

  // Row blocks: whole micro-panels spread evenly; a multiple of the thread count when
  // there are enough of them, so equal-cost tasks keep every thread busy to the end.
  const size_t row_panels = ceil_div(n, mr);
  size_t n_rb = std::min(row_panels, ceil_div(n, kr.mc));
  if (!small && n_rb >= threads) n_rb = std::min(row_panels, ceil_div(n_rb, threads) * threads);
  const size_t max_rb_rows = ceil_div(row_panels, n_rb) * mr;

  // Column chunks bound the packed copy of y (all of k x chunk columns).
  const size_t col_panels = ceil_div(m, nr);
  const size_t chunk_panels = std::max<size_t>(1, AlignedBuf::kKeepFloats / 2 / (k * nr));
  static thread_local AlignedBuf ybuf;

  // With a single row block every Y micro-panel is used by one task only: pack groups of
  // kInlinePanels right before use (they stay in L2) instead of packing all of y up front.
  const bool inline_y = n_rb == 1;
  constexpr size_t kInlinePanels = 8;

  for (size_t cp0 = 0; cp0 < col_panels; cp0 += chunk_panels) {
    const size_t np = std::min(chunk_panels, col_panels - cp0);
    float *yp = nullptr;
    if (!inline_y) {
      yp = ybuf.get(np * k * nr);
      parallel_for(np, small ? np : 1, [&](size_t b, size_t e) {
        for (size_t p = b; p < e; ++p) pack_y(y, ylut.data(), (cp0 + p) * nr, nr, 1, 0, k, yp + p * k * nr);
      });
    }

    // Too few row blocks for the pool: split the columns too.
    size_t n_cg = 1;
    if (!small && n_rb < 2 * threads) n_cg = std::min(np, ceil_div(2 * threads, n_rb));
    const size_t tasks = n_rb * n_cg;
    parallel_for(tasks, small ? tasks : 1, [&](size_t tb, size_t te) {
      static thread_local AlignedBuf xbuf, ytile;
      float *xp = xbuf.get(max_rb_rows * kc_max);
      float *yt = inline_y ? ytile.get(kInlinePanels * kc_max * nr) : nullptr;
      alignas(64) float tile[64 * 64];  // one right-edge tile (mr * nr <= 4096)
      for (size_t t = tb; t < te; ++t) {
        const size_t rb = t / n_cg, cg = t % n_cg;
        const size_t i0 = rb * row_panels / n_rb * mr;
        const size_t i1 = std::min(n, (rb + 1) * row_panels / n_rb * mr);
        const size_t p0 = cg * np / n_cg, p1 = (cg + 1) * np / n_cg;
        const size_t mc = i1 - i0;
        for (size_t k0 = 0; k0 < k; k0 += kc_max) {
          const size_t kc = std::min(kc_max, k - k0);
          pack_x(x, xlut.data(), i0, mc, k0, kc, mr, xp);
          for (size_t p = p0; p < p1; ++p) {
            const size_t j0 = (cp0 + p) * nr, nv = std::min(nr, m - j0);
            const float *ypanel;
            if (inline_y) {
              const size_t q = (p - p0) % kInlinePanels;
              if (q == 0) pack_y(y, ylut.data(), j0, nr, std::min(kInlinePanels, p1 - p), k0, kc, yt);
              ypanel = yt + q * kc * nr;
            } else {
              ypanel = yp + p * k * nr + k0 * nr;
            }
            for (size_t ir = 0; ir < mc; ir += mr) {
              const size_t mv = std::min(mr, mc - ir);
              float *cij = c + (i0 + ir) * ldc + j0;
              if (nv == nr) {
                kr.rows[mv](kc, xp + ir * kc, ypanel, cij, ldc, k0 > 0);
                continue;
              }
              // Right edge: compute the padded tile, keep the valid columns.
              kr.rows[mv](kc, xp + ir * kc, ypanel, tile, nr, false);
              for (size_t i = 0; i < mv; ++i)
                for (size_t j = 0; j < nv; ++j)
                  cij[i * ldc + j] = k0 > 0 ? cij[i * ldc + j] + tile[i * nr + j] : tile[i * nr + j];
            }
          }
        }
      }
      xbuf.trim();
    });
  }
  ybuf.trim();
}

void row_sums(const MatView &x, float *out) {
  with_float_dtype(x.dtype, "op(B)", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const Lut lut = make_lut(x);
    const Decode<T> dec{lut.data()};
    const T *base = static_cast<const T *>(x.data);
    const size_t grain = std::max<size_t>(16, (size_t(1) << 16) / (x.cols + 1));
    parallel_for(x.rows, grain, [&](size_t r0, size_t r1) {
      if (x.col_stride == 1 || x.row_stride != 1) {
        for (size_t i = r0; i < r1; ++i) {
          float s = 0.0f;
          for (size_t j = 0; j < x.cols; ++j) s += dec(base[i * x.row_stride + j * x.col_stride]);
          out[i] = s;
        }
        return;
      }
      // Transposed storage: walk memory in order; each out[i] still sums j ascending.
      for (size_t i = r0; i < r1; ++i) out[i] = 0.0f;
      for (size_t j = 0; j < x.cols; ++j)
        for (size_t i = r0; i < r1; ++i) out[i] += dec(base[i + j * x.col_stride]);
    });
  });
}

}  // namespace nvte::cpu

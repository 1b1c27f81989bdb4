// cpu/softmax.cpp - CPU reference of the fused scale + mask + softmax: row-parallel float32
// loops, numerically stable (the row max is subtracted before expf).
#include "softmax.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/attn_softmax.h"
#include "parallel.h"
#include "rows.h"

namespace nvte::cpu {
namespace {

size_t grain_rows(size_t cols) { return cols ? (16384 + cols - 1) / cols : 1024; }

// In place: v[0..n) = softmax(v[0..n)). n may be 0.
void softmax_inplace(float *v, size_t n) {
  if (n == 0) return;
  float m = v[0];
  for (size_t j = 1; j < n; ++j) m = v[j] > m ? v[j] : m;
  if (attn::keys_left_out(m, false)) {  // every logit -inf: zeros, not NaN (as the GPU)
    std::fill(v, v + n, 0.0f);
    return;
  }
  double sum = 0.0;  // (in double: a float sum stalls over very long rows)
  for (size_t j = 0; j < n; ++j) {
    v[j] = expf(v[j] - m);
    sum += v[j];
  }
  const float inv = static_cast<float>(1.0 / sum);
  for (size_t j = 0; j < n; ++j) v[j] *= inv;
}

}  // namespace

void softmax_forward(SoftmaxMask kind, const Tensor &in, const Tensor *mask, Tensor &out, float scale) {
  const InputRows x = input_rows(in, "input");
  OutputRows dst(out, "softmax_results", x.rows, x.cols);
  const NVTEShape s = in.params[kNVTERowwiseData].shape;
  const size_t sk = x.cols;
  // Query length and rows per batch entry (H * Sq) for the masked families.
  const size_t sq = kind == SoftmaxMask::None ? 1 : s.data[s.ndim - 2];
  const size_t heads = s.ndim == 4 ? s.data[1] : 1;
  const uint8_t *mask_data = nullptr;
  bool mask_per_batch = false;
  if (kind == SoftmaxMask::Explicit) {
    const NVTEBasicTensor &mb = mask->params[kNVTERowwiseData];
    mask_data = static_cast<const uint8_t *>(mb.data_ptr);
    mask_per_batch = mb.shape.data[0] != 1;
  }
  parallel_for(x.rows, grain_rows(sk), [&](size_t r0, size_t r1) {
    std::vector<float> v(sk);
    for (size_t r = r0; r < r1; ++r) {
      x.load(r, v.data());
      for (size_t j = 0; j < sk; ++j) v[j] *= scale;
      const size_t i = r % sq;  // query index
      switch (kind) {
        case SoftmaxMask::None: softmax_inplace(v.data(), sk); break;
        case SoftmaxMask::Explicit: {
          // The mask broadcasts over heads (and over batch when its first dim is 1).
          const size_t b = mask_per_batch ? r / (heads * sq) : 0;
          const uint8_t *m = mask_data + (b * sq + i) * sk;
          float mx = -INFINITY;
          for (size_t j = 0; j < sk; ++j) {
            if (m[j]) v[j] = attn::kMaskedLogit;
            mx = v[j] > mx ? v[j] : mx;
          }
          if (attn::keys_left_out(mx, true)) {  // a wholly masked row: zeros (TE's kernel rule)
            std::fill(v.begin(), v.end(), 0.0f);
          } else {
            softmax_inplace(v.data(), sk);
          }
          break;
        }
        case SoftmaxMask::UpperTriang:
        case SoftmaxMask::AlignedCausal: {
          // Columns [0, valid) are visible: j <= i + (Sk - Sq) (Sq == Sk for UpperTriang).
          // When Sk < Sq the first Sq - Sk rows see nothing; we define their output as all
          // zeros (no probability mass), which also makes their backward gradient zero.
          const long long last = static_cast<long long>(i) + static_cast<long long>(sk) -
                                 static_cast<long long>(sq);
          const size_t valid = last < 0 ? 0 : (last + 1 >= (long long)sk ? sk : (size_t)(last + 1));
          softmax_inplace(v.data(), valid);
          for (size_t j = valid; j < sk; ++j) v[j] = 0.0f;
          break;
        }
      }
      dst.store(r, v.data());
    }
  });
  dst.finish();
}

void softmax_backward(const Tensor &dy, const Tensor &y, Tensor &dx, float scale) {
  const InputRows g = input_rows(dy, "incoming_grads");
  const InputRows p = input_rows(y, "softmax_results");
  OutputRows dst(dx, "output_grads", p.rows, p.cols);
  const size_t sk = p.cols;
  parallel_for(p.rows, grain_rows(sk), [&](size_t r0, size_t r1) {
    std::vector<float> gv(sk), pv(sk);
    for (size_t r = r0; r < r1; ++r) {
      // Both rows are read completely before the store, so dx may alias dy or y.
      g.load(r, gv.data());
      p.load(r, pv.data());
      double acc = 0.0;  // (in double: a float sum stalls over very long rows)
      for (size_t j = 0; j < sk; ++j) acc += static_cast<double>(gv[j]) * pv[j];
      const float dot = static_cast<float>(acc);
      for (size_t j = 0; j < sk; ++j) gv[j] = scale * pv[j] * (gv[j] - dot);
      dst.store(r, gv.data());
    }
  });
  dst.finish();
}

}  // namespace nvte::cpu

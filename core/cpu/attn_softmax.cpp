// cpu/attn_softmax.cpp - CPU reference of the unfused attention softmax: one row (b, h, i) at a
// time in float32, logits built by the shared rules of common/attn_softmax.h, rows in parallel.
#include "attn_softmax.h"

#include <cmath>
#include <optional>
#include <vector>

#include "parallel.h"
#include "rows.h"

namespace nvte::cpu {
namespace {

size_t grain_rows(size_t cols) { return cols ? (16384 + cols - 1) / cols : 1024; }

float *f32_data(Tensor *t) {
  return t == nullptr ? nullptr : static_cast<float *>(t->params[kNVTERowwiseData].data_ptr);
}

}  // namespace

void attn_softmax_forward(const attn::SoftmaxArgs &a, const Tensor &in, Tensor &out, Tensor *sink_probs) {
  const InputRows x = input_rows(in, "input");
  OutputRows dst(out, "softmax_results", x.rows, x.cols);
  float *sink = f32_data(sink_probs);
  const size_t sk = a.sk;
  parallel_for(x.rows, grain_rows(sk), [&](size_t r0, size_t r1) {
    std::vector<float> v(sk), bias(sk, 0.0f);
    for (size_t r = r0; r < r1; ++r) {
      const size_t i = r % a.sq, hh = (r / a.sq) % a.h, bb = r / (a.sq * a.h);
      x.load(r, v.data());
      if (a.bias != nullptr)
        load_row(a.bias, a.bias_dtype, attn::broadcast_row(a.bias_sb, a.bias_sh, bb, hh, i, sk), sk, bias.data());
      const bool alibi = a.bias_type == attn::ScoreBias::Alibi;
      const float slope = alibi ? attn::score_slope(a, bb, hh) : 0.0f;
      const long long u = alibi ? (long long)i + a.diag[bb * a.diag_sb] : 0;
      const uint8_t *m = a.mask ? a.mask + attn::broadcast_row(a.mask_sb, a.mask_sh, bb, hh, i, sk) : nullptr;
      const size_t n = attn::causal_keys(a, i);  // keys [0, n) stay in the row
      float km = -INFINITY;  // the keys' largest logit
      for (size_t j = 0; j < n; ++j) {
        v[j] = m && m[j] ? attn::kMaskedLogit : attn::score_logit(a, a.scale * v[j], bias[j], slope, u, j);
        km = v[j] > km ? v[j] : km;
      }
      const bool none = attn::keys_left_out(km, m != nullptr);
      const float mx = a.offset ? (none || a.offset[hh] > km ? a.offset[hh] : km) : km;
      double sum = 0.0;  // (in double: a float sum stalls over very long rows)
      for (size_t j = 0; j < n; ++j) {
        v[j] = none ? 0.0f : expf(v[j] - mx);
        sum += v[j];
      }
      const float es = a.offset ? expf(a.offset[hh] - mx) : 0.0f;
      sum += es;
      // A row with nothing in it (and no sink) has sum 0: all zeros.
      const float inv = sum > 0.0 ? static_cast<float>(1.0 / sum) : 0.0f;
      for (size_t j = 0; j < n; ++j) v[j] *= inv;
      for (size_t j = n; j < sk; ++j) v[j] = 0.0f;
      if (sink != nullptr) sink[r] = es * inv;
      dst.store(r, v.data());
    }
  });
  dst.finish();
}

void attn_softmax_backward(const attn::SoftmaxArgs &a, const Tensor &dy, const Tensor &y, const Tensor *sink_probs,
                           Tensor &dx, Tensor *logit_grads, Tensor *offset_grads) {
  const InputRows g = input_rows(dy, "incoming_grads");
  const InputRows p = input_rows(y, "softmax_results");
  OutputRows dst(dx, "output_grads", p.rows, p.cols);
  std::optional<OutputRows> lg;  // (OutputRows holds an atomic: not movable)
  if (logit_grads != nullptr) lg.emplace(*logit_grads, "logit_grads", p.rows, p.cols);
  const float *sink = sink_probs ? static_cast<const float *>(sink_probs->params[kNVTERowwiseData].data_ptr) : nullptr;
  float *dsink = f32_data(offset_grads);
  const size_t sk = a.sk;
  parallel_for(p.rows, grain_rows(sk), [&](size_t r0, size_t r1) {
    std::vector<float> gv(sk), pv(sk);
    for (size_t r = r0; r < r1; ++r) {
      const size_t i = r % a.sq, hh = (r / a.sq) % a.h, bb = r / (a.sq * a.h);
      // Both rows are read completely before the stores, so outputs may alias dy or y.
      g.load(r, gv.data());
      p.load(r, pv.data());
      const size_t n = attn::causal_keys(a, i);  // keys [0, n) are in the row
      double acc = 0.0;
      for (size_t j = 0; j < n; ++j) acc += static_cast<double>(gv[j]) * pv[j];
      const float dot = static_cast<float>(acc);
      const uint8_t *m = a.mask ? a.mask + attn::broadcast_row(a.mask_sb, a.mask_sh, bb, hh, i, sk) : nullptr;
      for (size_t j = 0; j < sk; ++j) gv[j] = j >= n || (m && m[j]) ? 0.0f : pv[j] * (gv[j] - dot);
      if (dsink != nullptr) dsink[r] = -sink[r] * dot;
      if (lg) lg->store(r, gv.data());
      for (size_t j = 0; j < sk; ++j) gv[j] *= a.scale;
      dst.store(r, gv.data());
    }
  });
  if (lg) lg->finish();
  dst.finish();
}

}  // namespace nvte::cpu

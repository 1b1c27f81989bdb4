// cpu/recipe.cpp - delayed-scaling updates and current-scaling helpers on the CPU (float32).
#include "recipe.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>

#include "../common/numeric.h"
#include "parallel.h"
#include "rows.h"

namespace nvte::cpu {

namespace {

// updated scale = fp8_max / amax / 2^margin; the old scale is kept unless amax is finite and
// positive (0, inf, NaN or a negative value carry no usable information, as in TE), and an
// overflowing quotient is clamped to FLT_MAX.
float delayed_scale(float amax, float old_scale, float fp8_max, float margin_factor) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return old_scale;
  const float s = fp8_max / amax / margin_factor;
  return std::isinf(s) ? FLT_MAX : s;
}

// 2^margin rounded once to float32 (exact for integer margins).
float margin_factor(float margin) { return static_cast<float>(std::exp2(static_cast<double>(margin))); }

// Column-wise max of a [len, n] history, from 0, by comparison (NaN entries are ignored, as by
// fmaxf; std::fmax itself is avoided, see rows.cpp),
// so an all-NaN (or all-zero) column gives 0 and keeps its scale.
void column_max(const float *hist, size_t len, size_t n, float *amax) {
  std::fill(amax, amax + n, 0.0f);
  for (size_t i = 0; i < len; ++i)
    for (size_t j = 0; j < n; ++j) amax[j] = hist[i * n + j] > amax[j] ? hist[i * n + j] : amax[j];
}

}  // namespace

void amax_and_scale_update(const float *hist, const float *scale, float *out_hist, float *out_scale,
                           size_t len, size_t n, AmaxAlgo algo, float fp8_max, float margin) {
  if (n == 0 || len == 0) return;
  std::vector<float> amax(n);
  const std::vector<float> first(hist, hist + n);  // row 0, saved before any aliasing write
  if (algo == AmaxAlgo::Max) column_max(hist, len, n, amax.data());
  else std::copy(first.begin(), first.end(), amax.begin());
  const float mf = margin_factor(margin);
  for (size_t j = 0; j < n; ++j) out_scale[j] = delayed_scale(amax[j], scale[j], fp8_max, mf);
  // Roll by -1 along rows (new[i] = old[(i + 1) % len]), then zero row 0.
  std::memmove(out_hist, hist + n, (len - 1) * n * sizeof(float));
  std::copy(first.begin(), first.end(), out_hist + (len - 1) * n);
  std::fill(out_hist, out_hist + n, 0.0f);
}

void amax_and_scale_update_after_reduction(const float *buffer, const std::vector<History> &hs,
                                           AmaxAlgo algo, float fp8_max, float margin) {
  const float mf = margin_factor(margin);
  size_t offset = 0;
  for (const History &h : hs) {
    const size_t len = h.len, n = h.n;
    if (len == 0) {
      offset += n;
      continue;
    }
    std::vector<float> last(n), amax(n);
    for (size_t j = 0; j < n; ++j) {
      const float b = buffer ? buffer[offset + j] : 0.0f;
      last[j] = b != 0.0f ? b : h.hist[j];
      if (last[j] != 0.0f) h.hist[j] = last[j];
    }
    if (algo == AmaxAlgo::Max) column_max(h.hist, len, n, amax.data());
    else amax = last;
    // a column unused this step (last == 0) keeps its scale, as in TE
    for (size_t j = 0; j < n; ++j)
      if (last[j] != 0.0f) h.scale[j] = delayed_scale(amax[j], h.scale[j], fp8_max, mf);
    // Columns that saw an amax this step roll by -1 (last lands in the final row), then
    // row 0 is zeroed; columns with last == 0 were unused this step and stay as they are.
    for (size_t i = 0; i + 1 < len; ++i)
      for (size_t j = 0; j < n; ++j)
        if (last[j] != 0.0f) h.hist[i * n + j] = h.hist[(i + 1) * n + j];
    for (size_t j = 0; j < n; ++j) {
      if (last[j] == 0.0f) continue;
      h.hist[(len - 1) * n + j] = last[j];
      h.hist[j] = 0.0f;
    }
    offset += n;
  }
}

void compute_amax(const Tensor &in, float *amax) {
  const InputRows src = input_rows(in, "input");
  std::atomic<float> acc{0.0f};
  parallel_for(src.cols ? src.rows : 0, std::max<size_t>(1, 16384 / std::max<size_t>(src.cols, 1)),
               [&](size_t r0, size_t r1) {  // ([rows, 0]: no work)
    std::vector<float> row(src.cols);
    float m = 0.0f;
    for (size_t r = r0; r < r1; ++r) {
      src.load(r, row.data());
      for (float v : row) m = std::fabs(v) > m ? std::fabs(v) : m;  // not std::fmax: see rows.cpp
    }
    atomic_fmax(acc, m);
  });
  *amax = acc.load();
}

float scale_from_amax(float amax, float fp8_max, bool force_pow2, float epsilon) {
  const float a = amax < epsilon ? epsilon : amax;  // a NaN amax stays NaN (-> scale 1)
  float s = 1.0f;
  if (a != 0.0f && std::isfinite(a)) {
    s = fp8_max / a;
    if (std::isinf(s)) s = FLT_MAX;
  }
  if (force_pow2) s = bits_f32(f32_bits(s) & 0xFF800000u);  // keep sign and exponent only
  return s;
}

}  // namespace nvte::cpu

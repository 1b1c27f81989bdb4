// cpu/recipe.h - CPU reference of the FP8 scaling recipes (recipe.h), float32 math.
#pragma once

#include <cstddef>
#include <vector>

#include "../common/tensor.h"

namespace nvte::cpu {

enum class AmaxAlgo { Max, MostRecent };

// One history: `len` rows of `n` float32 amaxes (row-major [len, n]) and its n scales.
struct History {
  float *hist;
  float *scale;
  size_t len, n;
};

// One delayed-scaling step (recipe.h); out_hist / out_scale may alias hist / scale.
void amax_and_scale_update(const float *hist, const float *scale, float *out_hist, float *out_scale,
                           size_t len, size_t n, AmaxAlgo algo, float fp8_max, float margin);

// The bulk step after an amax reduction, in place; buffer is null when empty, else it
// holds sum(n) values, one per history column in order.
void amax_and_scale_update_after_reduction(const float *buffer, const std::vector<History> &hs,
                                           AmaxAlgo algo, float fp8_max, float margin);

// *amax = max |in| (NaN ignored; 0 for an empty input).
void compute_amax(const Tensor &in, float *amax);

// Current-scaling scale from amax (recipe.h).
float scale_from_amax(float amax, float fp8_max, bool force_pow2, float epsilon);

}  // namespace nvte::cpu

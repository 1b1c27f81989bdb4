// cuda/recipe.h - CUDA backend of the FP8 scaling recipes (recipe.h): the same float32
// operations as core/cpu/recipe.h, so results are bit-identical. Pointers are device memory;
// validation happens in the API layer; everything is asynchronous on `stream`.
#pragma once

#include <cstddef>
#include <vector>

#include "../common/tensor.h"
#include "../cpu/recipe.h"

namespace nvte::cuda {

using cpu::AmaxAlgo;
using cpu::History;

// One delayed-scaling step; out_hist / out_scale may alias hist / scale.
void amax_and_scale_update(const float *hist, const float *scale, float *out_hist, float *out_scale,
                           size_t len, size_t n, AmaxAlgo algo, float fp8_max, float margin,
                           cudaStream_t stream);

// The bulk step after an amax reduction, in place, for all histories in one launch (several
// only beyond a few hundred histories). buffer is null when empty.
void amax_and_scale_update_after_reduction(const float *buffer, const std::vector<History> &hs,
                                           AmaxAlgo algo, float fp8_max, float margin, cudaStream_t stream);

// *amax = max |in| (overwritten: zeroed on the stream, then reduced).
void compute_amax(const Tensor &in, float *amax, cudaStream_t stream);

// *scale = current-scaling scale from *amax (recipe.h); skipped when noop (may be null) holds 1.
void compute_scale_from_amax(const float *amax, float *scale, const float *noop, float fp8_max,
                             bool force_pow2, float epsilon, cudaStream_t stream);

}  // namespace nvte::cuda

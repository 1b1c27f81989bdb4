/*
 * recipe.h - FP8 scaling recipes: the delayed-scaling state machine and
 * current-scaling helpers. Every framework adapter calls these, so the same
 * amax history gives the same scales everywhere.
 */
#ifndef TRANSFORMER_ENGINE_RECIPE_H_
#define TRANSFORMER_ENGINE_RECIPE_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/** \brief One delayed-scaling step for n FP8 tensors.
 *
 *  amax = max over the history rows ("max") or row 0 ("most_recent"), per column;
 *  updated_amax_history = amax_history rolled by -1 along rows, then row 0 zeroed
 *  (new[i] = old[(i + 1) % len], new[0] = 0);
 *  updated_scale = fp8_max / amax / 2^margin, except: the old scale is kept unless amax
 *  is finite and positive (0, inf, NaN, negative), and an infinite result becomes FLT_MAX.
 *  fp8_max = 448 (kNVTEFloat8E4M3) or 57344 (kNVTEFloat8E5M2). margin: finite, within
 *  [-126, 126] (INVALID_ARGUMENT otherwise).
 *
 *  \param[in] amax_history  float32 [len, n] (or [len] for n = 1).
 *  \param[in] scale         float32 [n].
 *  \param[out] updated_amax_history  float32, same shape; may alias amax_history.
 *  \param[out] updated_scale         float32 [n]; may alias scale.
 *  \param[in] amax_compute_algo "max" or "most_recent" (anything else is an error). */
NVTE_API NVTEStatus nvte_delayed_scaling_recipe_amax_and_scale_update(
    const NVTETensor amax_history, const NVTETensor scale, NVTETensor updated_amax_history,
    NVTETensor updated_scale, const char *amax_compute_algo, NVTEDType fp8_dtype, float margin,
    cudaStream_t stream);

/** \brief Bulk delayed-scaling step after an amax all-reduce, in place.
 *
 *  amax_reduction_buffer (float32) is the concatenation of every group's reduced amaxes
 *  (group i contributes n_i values, in order; it may be empty). For each column:
 *  last = buffer value if the buffer is non-empty and the value is non-zero, else
 *  history[0]. If last != 0: history[0] = last, the history is rolled by -1 and row 0
 *  zeroed (so last ends in the final row); amax ("max" over the rows, or last for
 *  "most_recent") and the scale follow nvte_delayed_scaling_recipe_amax_and_scale_update.
 *  If last == 0 (the tensor was not used this step) history and scale are left as they are. */
NVTE_API NVTEStatus nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction(
    const NVTETensor amax_reduction_buffer, const NVTETensor *amax_histories,
    const NVTETensor *scales, size_t num_tensors, const char *amax_compute_algo,
    NVTEDType fp8_dtype, float margin, cudaStream_t stream);

/** \brief Current scaling, step 1: output.amax = max |input| (overwritten, not accumulated).
 *  \param[in] input   high-precision tensor.
 *  \param[in,out] output  FP8 tensor handle whose amax buffer is written. */
NVTE_API NVTEStatus nvte_compute_amax(const NVTETensor input, NVTETensor output, cudaStream_t stream);

/** \brief Current scaling, step 2: output.scale = fp8_max(output dtype) / max(amax, epsilon).
 *  If the clamped amax is 0 or not finite the scale is 1; an infinite quotient becomes
 *  FLT_MAX; with force_pow2_scales the scale is rounded down to a power of two (mantissa
 *  bits cleared). Only scale is written (quantize writes scale_inv). A noop tensor in the
 *  config holding 1 skips the op. config may be NULL (defaults). */
NVTE_API NVTEStatus nvte_compute_scale_from_amax(NVTETensor output,
                                                 const NVTEQuantizationConfig config,
                                                 cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */

#include <vector>
/** TE 2.x spelling with std::vector, kept so C++ call sites compile unchanged. */
inline NVTEStatus nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction(
    const NVTETensor amax_reduction_buffer, std::vector<NVTETensor> amax_histories,
    std::vector<NVTETensor> scales, const char *amax_compute_algo, NVTEDType fp8_dtype,
    float margin, cudaStream_t stream) {
  if (amax_histories.size() != scales.size()) return NVTE_ERROR_INVALID_ARGUMENT;
  return nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction(
      amax_reduction_buffer, amax_histories.data(), scales.data(), amax_histories.size(),
      amax_compute_algo, fp8_dtype, margin, stream);
}
#endif

#endif /* TRANSFORMER_ENGINE_RECIPE_H_ */

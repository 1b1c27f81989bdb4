/*
 * cast.h - quantization (high precision -> FP8) and dequantization.
 *
 * FP8 conversion rule, identical on every backend: y = fp8(float(x) * scale),
 * rounded to nearest even; values beyond the format's range saturate to
 * +-448 (E4M3) / +-57344 (E5M2), infinities included; NaN stays NaN.
 * Ops that produce an FP8 tensor with delayed scaling also
 *   - raise its amax (if set) to max(amax, max |x|) over the unscaled values
 *     (max-accumulation: several producers of one tensor share one amax slot),
 *   - write its scale_inv (rowwise and columnwise, if set) = 1 / scale.
 * An output with both rowwise and columnwise data gets both (data and its transpose).
 * Tensors are viewed as 2D [product of leading dims, last dim].
 */
#ifndef TRANSFORMER_ENGINE_CAST_H_
#define TRANSFORMER_ENGINE_CAST_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/** \brief Cast input to output's dtype. FP8 output: scaled as above (needs scale;
 *  amax and scale_inv optional). Non-FP8 output: a plain conversion.
 *  \param[in] input   high-precision tensor (float32, float16, bfloat16).
 *  \param[in,out] output  same shape; rowwise and/or columnwise data. */
NVTE_API NVTEStatus nvte_quantize(const NVTETensor input, NVTETensor output, cudaStream_t stream);

/** \brief nvte_quantize, skipped entirely when noop (float32[1]) holds 1.0. */
NVTE_API NVTEStatus nvte_quantize_noop(const NVTETensor input, NVTETensor output, NVTETensor noop,
                                       cudaStream_t stream);

/** \brief nvte_quantize with options (noop tensor; see NVTEQuantizationConfigAttribute). */
NVTE_API NVTEStatus nvte_quantize_v2(const NVTETensor input, NVTETensor output,
                                     const NVTEQuantizationConfig quant_config, cudaStream_t stream);

/** \brief Quantize a gradient and reduce it over rows: dbias[j] = sum_i input[i, j]
 *  (float32 accumulation, stored in dbias's dtype, shape [last dim]).
 *  \param[in,out] workspace  TE convention: if its data pointer is NULL and the op needs
 *  scratch memory, only its shape/dtype are set and nothing is computed. The CPU backend
 *  needs none. See nvte_quantize_dbias_workspace_size. */
NVTE_API NVTEStatus nvte_quantize_dbias(const NVTETensor input, NVTETensor output, NVTETensor dbias,
                                        NVTETensor workspace, cudaStream_t stream);

/** \brief Bytes of workspace nvte_quantize_dbias* / nvte_cast_transpose_dbias* need for input. */
NVTE_API NVTEStatus nvte_quantize_dbias_workspace_size(const NVTETensor input, size_t *bytes);

/** \brief Fused activation backward + quantize + dbias:
 *  g = input * dact(act_input); output = quantize(g); dbias = column sums of g. */
NVTE_API NVTEStatus nvte_quantize_dbias_dgelu(const NVTETensor input, const NVTETensor act_input,
                                              NVTETensor output, NVTETensor dbias,
                                              NVTETensor workspace, cudaStream_t stream);
NVTE_API NVTEStatus nvte_quantize_dbias_drelu(const NVTETensor input, const NVTETensor act_input,
                                              NVTETensor output, NVTETensor dbias,
                                              NVTETensor workspace, cudaStream_t stream);
NVTE_API NVTEStatus nvte_quantize_dbias_dsilu(const NVTETensor input, const NVTETensor act_input,
                                              NVTETensor output, NVTETensor dbias,
                                              NVTETensor workspace, cudaStream_t stream);
NVTE_API NVTEStatus nvte_quantize_dbias_dqgelu(const NVTETensor input, const NVTETensor act_input,
                                               NVTETensor output, NVTETensor dbias,
                                               NVTETensor workspace, cudaStream_t stream);
NVTE_API NVTEStatus nvte_quantize_dbias_dsrelu(const NVTETensor input, const NVTETensor act_input,
                                               NVTETensor output, NVTETensor dbias,
                                               NVTETensor workspace, cudaStream_t stream);

/** \brief output = float(input) * input.scale_inv, in output's (high-precision) dtype.
 *  Reads input's rowwise data (or columnwise data, transposed back, when only that is set). */
NVTE_API NVTEStatus nvte_dequantize(const NVTETensor input, NVTETensor output, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_CAST_H_ */

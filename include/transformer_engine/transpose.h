/*
 * transpose.h - transposes and the fused cast + transpose family.
 *
 * Inputs are viewed as 2D [M, N] (M = product of leading dims, N = last dim).
 * "Columnwise" data is the [N, M] transpose, stored row-major. Quantization
 * follows the rule in cast.h (same scale for both layouts, amax max-accumulated,
 * scale_inv written).
 */
#ifndef TRANSFORMER_ENGINE_TRANSPOSE_H_
#define TRANSFORMER_ENGINE_TRANSPOSE_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/** \brief Quantize input into output's rowwise [M, N] and columnwise [N, M] FP8 data in one pass.
 *  Either layout may be omitted (null data pointer), but not both. */
NVTE_API NVTEStatus nvte_cast_transpose(const NVTETensor input, NVTETensor output, cudaStream_t stream);

/** \brief transposed_output[N, M] = input[M, N]^T, any dtype (same dtype in and out). */
NVTE_API NVTEStatus nvte_transpose(const NVTETensor input, NVTETensor transposed_output,
                                   cudaStream_t stream);

/** \brief nvte_cast_transpose plus dbias[N] = column sums of input (float32 accumulation).
 *  Workspace convention as in nvte_quantize_dbias. */
NVTE_API NVTEStatus nvte_cast_transpose_dbias(const NVTETensor input, NVTETensor output,
                                              NVTETensor dbias, NVTETensor workspace,
                                              cudaStream_t stream);

/** \brief g = input * dact(act_input); rowwise + columnwise quantize of g; dbias = column sums of g. */
NVTE_API NVTEStatus nvte_cast_transpose_dbias_dgelu(const NVTETensor input, const NVTETensor act_input,
                                                    NVTETensor output, NVTETensor dbias,
                                                    NVTETensor workspace, cudaStream_t stream);
NVTE_API NVTEStatus nvte_cast_transpose_dbias_drelu(const NVTETensor input, const NVTETensor act_input,
                                                    NVTETensor output, NVTETensor dbias,
                                                    NVTETensor workspace, cudaStream_t stream);
NVTE_API NVTEStatus nvte_cast_transpose_dbias_dsilu(const NVTETensor input, const NVTETensor act_input,
                                                    NVTETensor output, NVTETensor dbias,
                                                    NVTETensor workspace, cudaStream_t stream);
NVTE_API NVTEStatus nvte_cast_transpose_dbias_dqgelu(const NVTETensor input,
                                                     const NVTETensor act_input, NVTETensor output,
                                                     NVTETensor dbias, NVTETensor workspace,
                                                     cudaStream_t stream);
NVTE_API NVTEStatus nvte_cast_transpose_dbias_dsrelu(const NVTETensor input,
                                                     const NVTETensor act_input, NVTETensor output,
                                                     NVTETensor dbias, NVTETensor workspace,
                                                     cudaStream_t stream);

/** \brief nvte_cast_transpose on num_tensors independent (input, output) pairs. */
NVTE_API NVTEStatus nvte_multi_cast_transpose(size_t num_tensors, const NVTETensor *input_list,
                                              NVTETensor *output_list, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_TRANSPOSE_H_ */

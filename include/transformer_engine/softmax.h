/*
 * softmax.h - fused scale + mask + softmax over the last dimension, forward and backward.
 *
 * forward:  y = softmax(scale_factor * x) along the last dim, masked positions excluded.
 *   scaled_masked: masked logits are replaced by -10000 before the softmax (TE's rule; a
 *   fully masked row becomes uniform). The causal families give masked positions y = 0.
 * backward: output_grads = scale_factor * y * (dy - sum(dy * y, last dim)); output_grads
 *   may alias incoming_grads. Math is float32; inputs/outputs float32, float16 or bfloat16.
 */
#ifndef TRANSFORMER_ENGINE_SOFTMAX_H_
#define TRANSFORMER_ENGINE_SOFTMAX_H_

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/** scaled_softmax: input [B, H, Sq, Sk] (any rank >= 2; last dim is the softmax axis). */
NVTE_API NVTEStatus nvte_scaled_softmax_forward(const NVTETensor input, NVTETensor softmax_results,
                                                     float scale_factor, cudaStream_t stream);
NVTE_API NVTEStatus nvte_scaled_softmax_backward(const NVTETensor incoming_grads,
                                                      const NVTETensor softmax_results,
                                                      NVTETensor output_grads, float scale_factor,
                                                      cudaStream_t stream);

/** scaled_masked_softmax: input [B, H, Sq, Sk]; mask uint8 [B or 1, 1, Sq, Sk], 1 = masked. */
NVTE_API NVTEStatus nvte_scaled_masked_softmax_forward(const NVTETensor input, const NVTETensor mask,
                                                     NVTETensor softmax_results, float scale_factor,
                                                     cudaStream_t stream);
NVTE_API NVTEStatus nvte_scaled_masked_softmax_backward(const NVTETensor incoming_grads,
                                                      const NVTETensor softmax_results,
                                                      NVTETensor output_grads, float scale_factor,
                                                      cudaStream_t stream);

/** scaled_upper_triang_masked_softmax: input [batches, S, S]; position (i, j) masked when j > i. */
NVTE_API NVTEStatus nvte_scaled_upper_triang_masked_softmax_forward(const NVTETensor input, NVTETensor softmax_results,
                                                     float scale_factor, cudaStream_t stream);
NVTE_API NVTEStatus nvte_scaled_upper_triang_masked_softmax_backward(const NVTETensor incoming_grads,
                                                      const NVTETensor softmax_results,
                                                      NVTETensor output_grads, float scale_factor,
                                                      cudaStream_t stream);

/** scaled_aligned_causal_masked_softmax: input [B, H, Sq, Sk]; (i, j) masked when j > i + (Sk - Sq) (bottom-right causal). */
NVTE_API NVTEStatus nvte_scaled_aligned_causal_masked_softmax_forward(const NVTETensor input, NVTETensor softmax_results,
                                                     float scale_factor, cudaStream_t stream);
NVTE_API NVTEStatus nvte_scaled_aligned_causal_masked_softmax_backward(const NVTETensor incoming_grads,
                                                      const NVTETensor softmax_results,
                                                      NVTETensor output_grads, float scale_factor,
                                                      cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_SOFTMAX_H_ */

/*
 * softmax.h - fused scale + mask + softmax over the last dimension, forward and backward.
 *
 * forward:  y = softmax(scale_factor * x) along the last dim, masked positions excluded.
 *   scaled_masked: masked logits (mask byte != 0) are replaced by -10000 before the softmax, and
 *   a wholly masked row (its maximum is that fill) is all zeros, as TE's kernel makes it. The
 *   causal families give masked positions y = 0. A row whose logits are all -inf is zeros too.
 * backward: output_grads = scale_factor * y * (dy - sum(dy * y, last dim)); output_grads
 *   may alias incoming_grads. Math is float32; inputs/outputs float32, float16 or bfloat16.
 */
#ifndef TRANSFORMER_ENGINE_SOFTMAX_H_
#define TRANSFORMER_ENGINE_SOFTMAX_H_

#include "fused_attn.h" /* NVTE_Bias_Type, NVTE_Mask_Type */
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

/** attn_softmax: the score softmax of unfused attention (the unfused path of
 *  DotProductAttention), with fused attention's bias, ALiBi and sink conventions (fused_attn.h),
 *  so that a call gives the probabilities of nvte_fused_attn_fwd. All math is float32.
 *
 *  For the unscaled scores x = Q K^T [B, H, Sq, Sk] and row (b, h, i), each key j gets the logit
 *    z_j = scale_factor * x_j + t_j, where t_j is, by bias_type:
 *      NVTE_NO_BIAS:          0;
 *      NVTE_PRE_SCALE_BIAS:   scale_factor * bias[b, h, i, j];
 *      NVTE_POST_SCALE_BIAS:  bias[b, h, i, j];
 *      NVTE_ALIBI:            -slope[b, h] * |i + alibi_diagonal[b] - j|.
 *  Keys hidden by mask_type are left out of the row: NVTE_NO_MASK hides none, NVTE_CAUSAL_MASK
 *  those with j > i, NVTE_CAUSAL_BOTTOM_RIGHT_MASK those with j > i + Sk - Sq; they get y = 0, and a
 *  row with no key left is all zeros. Keys hidden by the explicit `mask` get z_j = -10000 (the rule
 *  of nvte_scaled_masked_softmax_forward: a row it hides wholly, i.e. whose keys' maximum is that
 *  fill, leaves all its keys out). A bias of -inf leaves its key out as well; a row whose keys are
 *  all left out has y = 0 (never NaN) and, with a sink, sink share 1. Then
 *  y = exp(z_j - m) / (sum_k exp(z_k - m) + [exp(offset[h] - m)]) over the row's keys, with m the
 *  row max (including offset[h]); the bracketed term (the attention sink of TE's softmax_type)
 *  only when softmax_offset is given.
 *
 *  \param[in]  input           x, [B, H, Sq, Sk], float32, float16 or bfloat16.
 *  \param[in]  bias            pre/post-scale bias [1 or B, 1 or H, Sq, Sk], float32, float16 or
 *                              bfloat16 (broadcast over size-1 dims); null for other bias types.
 *  \param[in]  alibi_slopes    ALiBi only: float32 [H] or [B, H]; null for TE's default slopes.
 *  \param[in]  alibi_diagonal  ALiBi only (required): int64 [1] or [B], the diagonal offset of
 *                              each batch entry (fused_attn.h: 0 for top-left alignment,
 *                              len_kv - len_q for bottom-right).
 *  \param[in]  mask            null, or uint8 [1 or B, 1 or H, Sq, Sk], 1 = hidden.
 *  \param[in]  softmax_offset  null, or float32 [H]: the sink logit of each head.
 *  \param[out] softmax_results y, the shape of input, its dtype or float32 (exact probabilities for
 *                              a backward that sums over many rows: the sink gradient); may alias
 *                              input when it has input's dtype.
 *  \param[out] sink_probs      null, or (only with softmax_offset) float32 [B, H, Sq]: each row's
 *                              sink share exp(offset[h] - m) / denominator, for the backward.
 *  \param[in]  scale_factor    the softmax scale.
 *  \param[in]  bias_type       NVTE_NO_BIAS, NVTE_PRE_SCALE_BIAS, NVTE_POST_SCALE_BIAS or NVTE_ALIBI.
 *  \param[in]  mask_type       NVTE_NO_MASK, NVTE_CAUSAL_MASK or NVTE_CAUSAL_BOTTOM_RIGHT_MASK
 *                              (padding and other masks come as the explicit `mask`).
 *  \param[in]  stream          CUDA stream of the call (ignored on the CPU). */
NVTE_API NVTEStatus nvte_attn_softmax_forward(const NVTETensor input, const NVTETensor bias,
                                              const NVTETensor alibi_slopes, const NVTETensor alibi_diagonal,
                                              const NVTETensor mask, const NVTETensor softmax_offset,
                                              NVTETensor softmax_results, NVTETensor sink_probs,
                                              float scale_factor, NVTE_Bias_Type bias_type,
                                              NVTE_Mask_Type mask_type, cudaStream_t stream);

/** Backward of nvte_attn_softmax_forward. Per row, with d = sum_j dy_j * y_j over the keys in
 *  the row:
 *    g_j = y_j * (dy_j - d), and g_j = 0 where the explicit `mask` hides key j (masked logits are
 *    constants: this matters for the rows it hides wholly) or mask_type leaves it out;
 *    output_grads = scale_factor * g (the gradient of x; also that of a pre-scale bias, before
 *    summing over the bias's broadcast dims);
 *    logit_grads = g (the gradient of a post-scale bias, before that sum);
 *    offset_grads[b, h, i] = -sink_probs[b, h, i] * d (the sink logit's gradient from this row;
 *    softmax_offset's gradient is the sum over b and i).
 *
 *  \param[in]  incoming_grads  dy, [B, H, Sq, Sk], float32, float16 or bfloat16.
 *  \param[in]  softmax_results y, the forward's output (the shape of dy).
 *  \param[in]  mask            the forward's explicit mask, or null.
 *  \param[in]  sink_probs      the forward's sink_probs; required with offset_grads (else unused).
 *  \param[out] output_grads    scale_factor * g, the shape of dy, a float dtype (may alias dy
 *                              or y when it has their dtype).
 *  \param[out] logit_grads     null, or g: the shape of dy, a float dtype.
 *  \param[out] offset_grads    null, or float32 [B, H, Sq].
 *  \param[in]  scale_factor    the forward's scale.
 *  \param[in]  mask_type       the forward's: keys it leaves out of a row get zero gradients
 *                              (their dy and y do not enter the result and are in general not read).
 *  \param[in]  stream          CUDA stream of the call (ignored on the CPU). */
NVTE_API NVTEStatus nvte_attn_softmax_backward(const NVTETensor incoming_grads, const NVTETensor softmax_results,
                                               const NVTETensor mask, const NVTETensor sink_probs,
                                               NVTETensor output_grads, NVTETensor logit_grads,
                                               NVTETensor offset_grads, float scale_factor,
                                               NVTE_Mask_Type mask_type, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_SOFTMAX_H_ */

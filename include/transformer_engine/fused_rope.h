/*
 * fused_rope.h - rotary position embedding (RoPE) of attention queries / keys, forward and
 * backward (TE's fused_rope.h signatures).
 *
 * Tensors: input (forward) / output_grads (backward) [s, b, h, d] (NVTE_SBHD), [b, s, h, d]
 * (NVTE_BSHD) or [t, h, d] (NVTE_THD), float32, float16 or bfloat16, read at the element strides
 * given (stride_s_or_t, stride_b, stride_h, stride_d; stride_b unused for THD), so the handle's
 * data may be a strided view: its element count must cover the largest offset read. output /
 * input_grads: the same dtype, dense in the same format ([s, b, h, d], [b, s, h, d], [t, h, d]).
 * freqs: float32, contiguous, its last dim d2 (even, <= d), its other dims rows of angles: row p
 * holds the angles of position p (TE's RotaryPositionEmbedding gives [max_s, 1, 1, d2]).
 *
 * Positions: element (s_i, b_i) of SBHD/BSHD is at position s_i + start_positions[b_i]; THD
 * token j of sequence i (cu_seqlens int32 [b + 1], required) at j + start_positions[i];
 * start_positions (int32 [b]) may be NULL (all 0). THD rows outside every sequence are copied.
 *
 * forward, for k < d2 with angle a_k = freqs[position][k], partner p(k) and sign s(k):
 *   not interleaved: p(k) = k + d2/2, s(k) = -1 for k < d2/2;  p(k) = k - d2/2, s(k) = +1 else;
 *   interleaved:     p(k) = k + 1, s(k) = -1 for even k;       p(k) = k - 1, s(k) = +1 odd;
 *   out_k = x_k cos(a_k) + s(k) x_p(k) sin(a_k);   out_k = x_k for d2 <= k < d.
 * backward (the transpose): dx_k = g_k cos(a_k) - s(k) g_p(k) sin(a_p(k)); dx_k = g_k beyond d2.
 * Math in float32 on the GPU (sincosf), float64 on the CPU reference; results rounded to the
 * output dtype. A position past the last row of freqs is an error on the CPU; the GPU cannot see
 * device-side lengths and writes NaN for such elements (so they cannot pass unnoticed).
 * Context parallelism (cp_size > 1, 0 <= cp_rank < cp_size; TE's load-balanced split): every
 * sequence of n tokens is cut into 2 cp_size chunks of n / (2 cp_size) and this rank holds chunks
 * cp_rank and 2 cp_size - 1 - cp_rank, back to back, so its local row j of len = n / cp_size is at
 * position cp_rank len/2 + j for j < len/2, else (2 cp_size - 1 - cp_rank) len/2 + j - len/2.
 * SBHD/BSHD: s is the local length (even); freqs must cover s cp_size positions. THD: cu_seqlens
 * gives the whole sequences (TE's cu_seqlens_padded: each length a multiple of 2 cp_size), and this
 * rank's rows of sequence i are [cu_seqlens[i] / cp_size, cu_seqlens[i + 1] / cp_size); another
 * length is an error on the CPU and NaN rows on the GPU. start_positions with cp_size > 1:
 * NVTE_ERROR_NOT_SUPPORTED (as in TE, they serve inference).
 * For SBHD/BSHD, s and b are the input's sequence and batch sizes; for THD, s is ignored (the
 * token count is the input's first dim) and b must be cu_seqlens' length - 1.
 */
#ifndef TRANSFORMER_ENGINE_FUSED_ROPE_H_
#define TRANSFORMER_ENGINE_FUSED_ROPE_H_

#include <stdbool.h>

#include "fused_attn.h"
#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Applies RoPE to input; output as described above.
 *  \param[in]  input           [s, b, h, d] / [b, s, h, d] / [t, h, d] at the given strides.
 *  \param[in]  cu_seqlens      THD: int32 [b + 1]; otherwise ignored (may be NULL).
 *  \param[in]  freqs           float32 angles, last dim d2.
 *  \param[in]  start_positions int32 [b] position of each sequence's first row, or NULL.
 *  \param[out] output          dense, input's dtype and format.
 *  \param[in]  stream          CUDA stream (ignored for host data). */
NVTE_API NVTEStatus nvte_fused_rope_forward(const NVTETensor input, const NVTETensor cu_seqlens,
                                            const NVTETensor freqs, const NVTETensor start_positions,
                                            NVTETensor output, NVTE_QKV_Format qkv_format, bool interleaved,
                                            int cp_size, int cp_rank, int s, int b, int h, int d, int d2,
                                            int stride_s_or_t, int stride_b, int stride_h, int stride_d,
                                            cudaStream_t stream);

/** The gradient of nvte_fused_rope_forward: output_grads (strided as the forward's input) in,
 *  input_grads (dense) out; the other arguments as in the forward. */
NVTE_API NVTEStatus nvte_fused_rope_backward(const NVTETensor output_grads, const NVTETensor cu_seqlens,
                                             const NVTETensor freqs, const NVTETensor start_positions,
                                             NVTETensor input_grads, NVTE_QKV_Format qkv_format,
                                             bool interleaved, int cp_size, int cp_rank, int s, int b, int h,
                                             int d, int d2, int stride_s_or_t, int stride_b, int stride_h,
                                             int stride_d, cudaStream_t stream);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // TRANSFORMER_ENGINE_FUSED_ROPE_H_

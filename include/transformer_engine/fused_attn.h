/*
 * fused_attn.h - fused dot-product attention, forward and backward.
 *
 * Computes, per batch entry b and query head h (K/V head h / (H_q / H_kv) for GQA/MQA):
 *   L = attn_scale * Q K^T  (+ bias, see NVTE_Bias_Type)      logits    [sq, skv]
 *   P = softmax(L) over the visible keys of each row           (NVTE_Mask_Type, windows)
 *   O = dropout(P) V                                           keep-prob 1 - dropout, scale 1/(1-dropout)
 * Masked logits are excluded (not replaced by a large negative number); a row that sees no key
 * (fully masked, or a padded query position) gives O = 0 and zero gradients, never NaN. A bias
 * entry of -inf also excludes its key, so an arbitrary boolean mask can be passed as a
 * post-scale bias of 0 / -inf.
 *
 * Source-compatible with NVIDIA Transformer Engine 2.13: the same enum names and values, and the
 * same argument order for nvte_get_fused_attn_backend, nvte_fused_attn_fwd and nvte_fused_attn_bwd
 * (the separate-Q/K/V entry points; packed QKV/KV are passed as three views into one buffer and
 * described by qkv_layout). Differences, none of which breaks a TE call site:
 *  - the compute entry points return NVTEStatus (see transformer_engine.h);
 *  - workspace sizes have explicit queries (nvte_fused_attn_{fwd,bwd}_workspace_size); TE's
 *    convention also works: a call whose workspace has a NULL data pointer while scratch is
 *    needed only sets the workspace's shape/dtype ([bytes], kNVTEByte) and computes nothing.
 *    The CPU backend needs no workspace (pass NULL or an empty tensor);
 *  - NVTE_ARBITRARY_MASK is an extra, appended value: TE's fused attention has no arbitrary mask
 *    (TE routes such masks to unfused attention); this library rejects it with
 *    NVTE_ERROR_NOT_SUPPORTED and documents the -inf bias route above instead;
 *  - ALiBi slopes may be given through Bias (float32 [H_q] or [B, H_q]); TE's fused path only
 *    has the default slopes.
 *
 * Tensors (all row-major, logical shapes; the layout decides the strides):
 *   format SBHD: [s, b, h, d]; BSHD: [b, s, h, d]; THD: [t, h, d] with t the total number of
 *   tokens (sequences given by cu_seqlens, their start offsets by cu_seqlens_*_padded).
 *   Packed layouts (3HD, H3D, 2HD, H2D): Q, K, V (and dQ, dK, dV) are three handles with the
 *   logical shape above whose data pointers point at their first element inside one packed
 *   buffer (e.g. BS3HD: buffer [b, s, 3, h, d], K = Q + h*d elements, V = Q + 2*h*d); the
 *   library checks these offsets. O and dO are always plain tensors in Q's format.
 *
 * Auxiliary tensors (Aux_CTX_Tensors), in TE's order:
 *   [0] softmax statistics: float32 [b, h_q, max_seqlen_q, 1], the natural log of the softmax
 *       denominator of each row (logsumexp of the visible logits, plus the sink term of the
 *       off-by-one / learnable softmax); -inf for positions past a sequence's length and for
 *       rows with neither a visible key nor a sink term;
 *   [+] only when return_max_logit: float32 [b, h_q, max_seqlen_q, 1], the largest visible logit
 *       of each row (-inf for empty rows);
 *   [+] rng_state: int64 [2] (seed, offset), a copy of the rng_state argument;
 *   [+] only for NVTE_PRE/POST_SCALE_BIAS: the Bias tensor (same shape and dtype); for NVTE_ALIBI
 *       only when slopes were given: the slopes;
 *   [+] only for NVTE_LEARNABLE / OFF_BY_ONE softmax: float32 [1, h_q, 1, 1] softmax offset.
 * Protocol (as in TE): call the forward with Aux_CTX_Tensors->size == 0 and it only describes
 * the aux tensors (shape and dtype of each, data NULL, size set) and computes nothing; allocate
 * their buffers, then call again with the filled pack to compute. The rng/bias/offset slots are
 * filled by copying into the buffer given, or by pointing the slot at the input when its data
 * pointer is NULL. Aux_CTX_Tensors may be NULL for an inference call (no statistics kept).
 * The backward takes the pack in the same order; a Max slot, if present, is skipped.
 *
 * FP8 attention (NVTE_FP8; Transformer Engine's FP8 DPA with per-tensor scaling). Q, K, V are
 * float8_e4m3 and carry scale_inv (an FP8 input x means x * scale_inv). S and dP are metadata
 * handles (no data needed) carrying the quantization of two intermediates; every FP8 output value
 * v is stored as fp8(float32(v) * scale) (round to nearest even, saturating to +-max; the rule of
 * cast.h), its amax is max-accumulated (*amax = max(*amax, max |v|), when the tensor has an amax
 * buffer) and its scale_inv is written as 1 / scale (when it has one). Per query row:
 *   forward   z = attn_scale * Q K^T (decoded inputs), masked as above; m = max z, l = sum exp(z - m)
 *             (lse = m + log l kept as for float inputs); U = dropout(exp(z - m)) (unnormalized,
 *             as cuDNN's flash kernel quantizes it);
 *             S:  amax_S = max U (1 without dropout);  U~ = fp8_E4M3(U * scale_S), used as U~ / scale_S;
 *             O = (U~ / scale_S) V / l;  O: FP8 (E4M3 or E5M2) with scale, or float16/bfloat16
 *             stored unscaled (TE's current scaling; amax still recorded).
 *   backward  P = exp(z - lse) (normalized), Pd = dropout(P), P~ = fp8_E4M3(Pd * scale_S)
 *             recomputed from the stored lse; D = dO . O (decoded with their
 *             scale_inv; a float16/bfloat16 O is taken as is);
 *             dS = attn_scale * P * (dropout(dO V^T) - D);
 *             dP: amax_dP = max |dS|;  dS~ = fp8_{dO's format}(dS * scale_dP), used as dS~ / scale_dP;
 *             dQ = dS~ K,  dK = dS~^T Q,  dV = (P~ / scale_S)^T dO (dK, dV summed over each K/V
 *             head's Q heads); dQ, dK, dV: one dtype, FP8 (E4M3 or E5M2) with scale, or
 *             float16/bfloat16. dO is FP8 (E5M2 under TE's HYBRID recipe) with scale_inv.
 * This follows cuDNN's sdpa_fp8 graphs, which TE's FP8 path builds. Where a choice was needed:
 * P~ and dS~ are decoded with 1 / scale (their scale_inv buffers receive the same value: the
 * forward writes S's scale_inv and amax, the backward dP's; the backward's S is only read), and
 * amax_S is taken after dropout. FP8 has no bias and no max logit (NOT_SUPPORTED, as in TE); the
 * aux pack is the one of float inputs (statistics, rng_state, softmax offset). The CPU backend
 * implements it as the reference; the CUDA backend runs cuDNN's FP8 graphs (BSHD/SBHD, no mask /
 * causal / padding, GQA; no dropout, bias or window, and for training max_seqlen_q/kv multiples of
 * 128: NOT_SUPPORTED otherwise; cuDNN's own limits, e.g. head dim 128 for the backward on Hopper,
 * are reported the same way). cuDNN's own amax of S is that of the normalized P; the CUDA backend
 * records the amax of U (1), the tensor it quantizes, as the CPU does. Scales and scale_invs
 * must be finite and positive: the CPU backend refuses others (INVALID_ARGUMENT, naming the
 * tensor) before writing any output; the CUDA backend reads them on the device only, so there
 * they give NaN or zero outputs without an error.
 *
 * Paged K/V caches (layouts NVTE_Paged_KV_*, forward only: the backward takes no page tables and
 * returns NOT_SUPPORTED for them, as paged caches serve inference). K and V are caches of
 * num_pages pages of page_size tokens, in the layout's K/V format: BSHD [num_pages, page_size,
 * h_kv, d], SBHD [page_size, num_pages, h_kv, d] (K and V of equal page count and size). Q and O
 * keep Q's format (BSHD, SBHD or THD). page_table_k and page_table_v (int32 [b, pages_per_seq],
 * equal shapes, may differ in content) name the pages of each sequence: key j of sequence b is
 * slot j % page_size of page page_table[b][j / page_size]. The K/V lengths come from
 * cu_seqlens_kv, so the mask must be a padding type; max_seqlen_kv <= pages_per_seq * page_size.
 * Only the entries a sequence's keys use matter; the CPU backend checks that they name a page of
 * the cache, the CUDA backend (cuDNN's paged attention) clamps them into the cache on the device,
 * as it clamps cu_seqlens. Not with FP8 inputs.
 *
 * Dropout (applied only when is_training in the forward, always in the backward when
 * dropout > 0) keeps element (b, h, i, j) when a counter-based Philox-4x32-10 draw keyed by
 * rng_state (seed, offset) is >= dropout; forward and backward regenerate the same mask. The CPU
 * backend's mask is reproducible across runs and thread counts; other backends may draw a
 * different (equally distributed) mask.
 */
#ifndef TRANSFORMER_ENGINE_FUSED_ATTN_H_
#define TRANSFORMER_ENGINE_FUSED_ATTN_H_

#include <stdbool.h>
#include <stdint.h>

#include "transformer_engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/** Memory layouts of Q, K, V. Numbering as in TE. S, B, H, D, T: sequence, batch, heads, head
 *  size, total tokens. Mixed layouts give Q and K/V different formats. Paged layouts (19..24)
 *  hold K and V in page caches ("Paged K/V caches" above); forward only. */
typedef enum NVTE_QKV_Layout {
  NVTE_SB3HD = 0,
  NVTE_SBH3D = 1,
  NVTE_SBHD_SB2HD = 2,
  NVTE_SBHD_SBH2D = 3,
  NVTE_SBHD_SBHD_SBHD = 4,
  NVTE_BS3HD = 5,
  NVTE_BSH3D = 6,
  NVTE_BSHD_BS2HD = 7,
  NVTE_BSHD_BSH2D = 8,
  NVTE_BSHD_BSHD_BSHD = 9,
  NVTE_T3HD = 10,
  NVTE_TH3D = 11,
  NVTE_THD_T2HD = 12,
  NVTE_THD_TH2D = 13,
  NVTE_THD_THD_THD = 14,
  NVTE_SBHD_BSHD_BSHD = 15,
  NVTE_BSHD_SBHD_SBHD = 16,
  NVTE_THD_BSHD_BSHD = 17,
  NVTE_THD_SBHD_SBHD = 18,
  NVTE_Paged_KV_BSHD_BSHD_BSHD = 19,
  NVTE_Paged_KV_BSHD_SBHD_SBHD = 20,
  NVTE_Paged_KV_SBHD_BSHD_BSHD = 21,
  NVTE_Paged_KV_SBHD_SBHD_SBHD = 22,
  NVTE_Paged_KV_THD_BSHD_BSHD = 23,
  NVTE_Paged_KV_THD_SBHD_SBHD = 24
} NVTE_QKV_Layout;

/** How Q, K, V share buffers. Numbering as in TE. */
typedef enum NVTE_QKV_Layout_Group {
  NVTE_3HD = 0,              /**< one buffer [.., 3, h, d]: SB3HD, BS3HD, T3HD */
  NVTE_H3D = 1,              /**< one buffer [.., h, 3, d]: SBH3D, BSH3D, TH3D */
  NVTE_HD_2HD = 2,           /**< Q, then KV in [.., 2, h, d] */
  NVTE_HD_H2D = 3,           /**< Q, then KV in [.., h, 2, d] */
  NVTE_HD_HD_HD = 4,         /**< three separate buffers (also the mixed layouts) */
  NVTE_Paged_KV_HD_HD_HD = 5 /**< separate buffers, K/V in pages */
} NVTE_QKV_Layout_Group;

/** Token order of a layout. Numbering as in TE; the 2-format values name Q's format first. */
typedef enum NVTE_QKV_Format {
  NVTE_SBHD = 0,
  NVTE_BSHD = 1,
  NVTE_THD = 2,
  NVTE_BSHD_2SBHD = 3, /**< Q BSHD, K/V SBHD */
  NVTE_SBHD_2BSHD = 4, /**< Q SBHD, K/V BSHD */
  NVTE_THD_2BSHD = 5,  /**< Q THD, K/V BSHD */
  NVTE_THD_2SBHD = 6   /**< Q THD, K/V SBHD */
} NVTE_QKV_Format;

/** Bias added to the logits. Numbering as in TE. */
typedef enum NVTE_Bias_Type {
  NVTE_NO_BIAS = 0,
  NVTE_PRE_SCALE_BIAS = 1,  /**< L = attn_scale * (Q K^T + Bias) */
  NVTE_POST_SCALE_BIAS = 2, /**< L = attn_scale * Q K^T + Bias */
  NVTE_ALIBI = 3            /**< L = attn_scale * Q K^T - slope_h * |i + diag - j| (diag: see masks) */
} NVTE_Bias_Type;

/** Which keys each query sees. Numbering as in TE (NVTE_ARBITRARY_MASK is this library's
 *  appended value, always rejected). With diag = 0 (top-left) or diag = len_kv - len_q
 *  (bottom-right, per sequence), query i sees key j when j < len_kv, i < len_q, the causal
 *  rule j <= i + diag holds (causal types) and the window rule holds:
 *  i + diag - window_size_left <= j <= i + diag + window_size_right (-1 = unbounded side). */
typedef enum NVTE_Mask_Type {
  NVTE_NO_MASK = 0,
  NVTE_PADDING_MASK = 1,                     /**< lengths from cu_seqlens */
  NVTE_CAUSAL_MASK = 2,                      /**< causal, top-left diagonal */
  NVTE_PADDING_CAUSAL_MASK = 3,
  NVTE_CAUSAL_BOTTOM_RIGHT_MASK = 4,         /**< causal, bottom-right diagonal */
  NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK = 5,
  NVTE_ARBITRARY_MASK = 6                    /**< not in TE's fused API: NOT_SUPPORTED here */
} NVTE_Mask_Type;

/** Softmax variant. Numbering as in TE. With z_j the visible logits of a row:
 *  vanilla exp(z_j) / sum exp(z); off-by-one exp(z_j) / (1 + sum exp(z));
 *  learnable exp(z_j) / (exp(alpha_h) + sum exp(z)), alpha = SoftmaxOffset [1, h_q, 1, 1]. */
typedef enum NVTE_Softmax_Type {
  NVTE_VANILLA_SOFTMAX = 0,
  NVTE_OFF_BY_ONE_SOFTMAX = 1,
  NVTE_LEARNABLE_SOFTMAX = 2
} NVTE_Softmax_Type;

/** Backend answer of nvte_get_fused_attn_backend. Numbering as in TE. */
typedef enum NVTE_Fused_Attn_Backend {
  NVTE_No_Backend = -1,          /**< configuration not supported (reason in nvte_get_last_error) */
  NVTE_F16_max512_seqlen = 0,    /**< TE's legacy <= 512 path; never returned by this library */
  NVTE_F16_arbitrary_seqlen = 1, /**< the high-precision path (float32/float16/bfloat16) */
  NVTE_FP8 = 2                   /**< FP8 inputs */
} NVTE_Fused_Attn_Backend;

/** \brief Layout group of a layout; on an unknown value returns (NVTE_QKV_Layout_Group)-1 and sets
 *  nvte_get_last_error. Same for the three format queries below. */
NVTE_API NVTE_QKV_Layout_Group nvte_get_qkv_layout_group(NVTE_QKV_Layout qkv_layout);
/** \brief Format of a layout (a 2-format value for the mixed layouts). */
NVTE_API NVTE_QKV_Format nvte_get_qkv_format(NVTE_QKV_Layout qkv_layout);
/** \brief Format of Q (SBHD, BSHD or THD). */
NVTE_API NVTE_QKV_Format nvte_get_q_format(NVTE_QKV_Layout qkv_layout);
/** \brief Format of K and V (SBHD, BSHD or THD). */
NVTE_API NVTE_QKV_Format nvte_get_kv_format(NVTE_QKV_Layout qkv_layout);

/** \brief Whether this library can run a configuration, without touching any tensor.
 *
 *  The query has no tensors: when the library has its CUDA backend with cuDNN and a CUDA device
 *  is visible it answers for the GPU (cuDNN's rules: bfloat16/float16, BSHD/SBHD layouts, THD ones
 *  (no bias or ALiBi, no FP8; THD queries over BSHD/SBHD K/V for inference only), paged K/V
 *  caches (forward), no pre-scale bias, ALiBi only causal with default slopes, FP8 without
 *  dropout/bias/max logit, no bottom-right causal mask with bias, ALiBi or dropout, the off-by-one /
 *  learnable softmax for BSHD/SBHD queries without max logit or FP8 (paged caches and max_seqlen_q 1:
 *  forward only), ...); otherwise for the
 *  CPU reference backend, which runs every valid configuration. cuDNN may still reject a
 *  concrete shape at the call (NVTE_ERROR_NOT_SUPPORTED with its reason). Returns
 *  NVTE_F16_arbitrary_seqlen (float inputs) or NVTE_FP8 (float8_e4m3 inputs) when supported and
 *  NVTE_No_Backend otherwise, with the reason in nvte_get_last_error(). Argument order as in
 *  TE 2.13.
 *  \param[in] is_training       training (statistics and dropout) or inference.
 *  \param[in] q_dtype, kv_dtype element types of Q and of K/V.
 *  \param[in] dropout           dropout probability, in [0, 1).
 *  \param[in] num_attn_heads    heads of Q; num_gqa_groups: heads of K/V (divides it).
 *  \param[in] max_seqlen_q, max_seqlen_kv  padded sequence lengths.
 *  \param[in] head_dim_qk, head_dim_v      head sizes of Q/K and of V (may differ).
 *  \param[in] window_size_left, window_size_right  sliding window, -1 = unbounded.
 *  \param[in] return_max_logit, cuda_graph, deterministic  TE flags; the CPU backend is always
 *             deterministic and ignores cuda_graph. */
NVTE_API NVTE_Fused_Attn_Backend nvte_get_fused_attn_backend(
    bool is_training, NVTEDType q_dtype, NVTEDType kv_dtype, NVTE_QKV_Layout qkv_layout,
    NVTE_Bias_Type bias_type, NVTE_Mask_Type attn_mask_type, NVTE_Softmax_Type softmax_type,
    float dropout, size_t num_attn_heads, size_t num_gqa_groups, size_t max_seqlen_q,
    size_t max_seqlen_kv, size_t head_dim_qk, size_t head_dim_v, int64_t window_size_left,
    int64_t window_size_right, bool return_max_logit, bool cuda_graph, bool deterministic);

/** \brief Attention forward with Q, K, V (see the top of this file for the math and layouts).
 *
 *  All tensors are borrowed (never freed); all must live on one device (host memory: CPU
 *  backend; CUDA memory: CUDA backend, running on `stream`). Optional tensors may be NULL.
 *  \param[in]  Q, K, V        float32/float16/bfloat16, one dtype, or float8_e4m3 with scale_inv
 *                             (FP8 attention); shapes by qkv_layout:
 *                             Q [.., h_q, d_qk], K [.., h_kv, d_qk], V [.., h_kv, d_v].
 *  \param[in]  Bias           PRE/POST_SCALE_BIAS: [1 or b, 1 or h_q, max_seqlen_q, max_seqlen_kv]
 *                             (float dtype); ALIBI: NULL (TE's default slopes) or float32 slopes
 *                             [h_q] or [b, h_q]; otherwise ignored.
 *  \param[in]  SoftmaxOffset  LEARNABLE_SOFTMAX: float32 [1, h_q, 1, 1]; otherwise ignored.
 *  \param[in,out] S           FP8 only (ignored otherwise): the softmax-output quantization; reads
 *                             scale (float32 [1], required), max-accumulates amax and writes
 *                             scale_inv = 1 / scale when those buffers are set. No data needed.
 *  \param[out] O              Q's format, [.., h_q, d_v], Q's dtype; for FP8 inputs float8_e4m3 or
 *                             float8_e5m2 with scale (amax, scale_inv written), or float16 /
 *                             bfloat16. Every element is written (padding positions and THD
 *                             gaps get 0).
 *  \param[in,out] Aux_CTX_Tensors  see "Auxiliary tensors" above.
 *  \param[in]  cu_seqlens_q, cu_seqlens_kv  int32 [b + 1], cumulative valid lengths. Needed for
 *                             THD and for padding masks; ignored for other BSHD/SBHD masks.
 *  \param[in]  cu_seqlens_q_padded, cu_seqlens_kv_padded  int32 [b + 1], THD only: token offset
 *                             of each sequence (NULL: same as cu_seqlens).
 *  \param[in]  page_table_k, page_table_v   paged layouts only ("Paged K/V caches"): int32
 *                             [b, pages_per_seq]; NULL for other layouts.
 *  \param[in]  rng_state      int64 [2] (seed, offset); needed when is_training and dropout > 0.
 *  \param[in]  max_seqlen_q, max_seqlen_kv  padded lengths: the s dimension for BSHD/SBHD; for
 *                             THD at least the longest sequence.
 *  \param[in]  is_training    keep statistics and apply dropout.
 *  \param[in]  return_max_logit  also store the row maxima in the aux pack.
 *  \param[in]  cuda_graph     TE flag, ignored on the CPU.
 *  \param[in]  attn_scale     scale of Q K^T (typically 1/sqrt(d_qk)).
 *  \param[in]  dropout        probability of dropping, in [0, 1).
 *  \param[in]  window_size_left, window_size_right  >= -1; -1 = unbounded (so is any window of
 *              2^31 - 1 or more: it reaches every key of an int32-indexed sequence).
 *  \param[in]  bottom_right_diagonal  align windows and ALiBi to the bottom-right diagonal for the
 *                             non-causal masks; the causal types fix the alignment themselves.
 *  \param[in,out] workspace   scratch (see nvte_fused_attn_fwd_workspace_size); may be NULL on CPU.
 *  \param[in]  stream         CUDA stream (ignored for host data). */
NVTE_API NVTEStatus nvte_fused_attn_fwd(
    const NVTETensor Q, const NVTETensor K, const NVTETensor V, const NVTETensor Bias,
    const NVTETensor SoftmaxOffset, NVTETensor S, NVTETensor O, NVTETensorPack *Aux_CTX_Tensors,
    const NVTETensor cu_seqlens_q, const NVTETensor cu_seqlens_kv,
    const NVTETensor cu_seqlens_q_padded, const NVTETensor cu_seqlens_kv_padded,
    const NVTETensor page_table_k, const NVTETensor page_table_v, const NVTETensor rng_state,
    size_t max_seqlen_q, size_t max_seqlen_kv, bool is_training, bool return_max_logit,
    bool cuda_graph, float attn_scale, float dropout, NVTE_QKV_Layout qkv_layout,
    NVTE_Bias_Type bias_type, NVTE_Mask_Type attn_mask_type, NVTE_Softmax_Type softmax_type,
    int64_t window_size_left, int64_t window_size_right, bool bottom_right_diagonal,
    NVTETensor workspace, cudaStream_t stream);

/** \brief Attention backward: dQ, dK, dV (and dBias, dSoftmaxOffset) from O, dO and the aux pack.
 *
 *  Arguments mean what they mean in nvte_fused_attn_fwd and must match the forward call.
 *  \param[in]  O, dO          Q's format, [.., h_q, d_v], Q's dtype. FP8 attention: O as the forward
 *                             wrote it (FP8 with scale_inv, or float16/bfloat16), dO float8_e4m3
 *                             or float8_e5m2 with scale_inv.
 *  \param[in]     S           FP8 only: the forward's S; scale read (required).
 *  \param[in,out] dP          FP8 only: the quantization of dS (format of dO); reads scale
 *                             (required), max-accumulates amax, writes scale_inv = 1 / scale.
 *  \param[in]  Aux_CTX_Tensors the pack filled by the forward (statistics, rng_state, bias,
 *                             softmax offset); the Bias comes from it (TE has no Bias argument).
 *  \param[out] dQ, dK, dV     same layout, shapes and dtype as Q, K, V (packed layouts: views
 *                             into one packed gradient buffer); FP8 attention: one dtype,
 *                             float8_e4m3/e5m2 with scale (amax, scale_inv written per tensor) or
 *                             float16/bfloat16. Every element is written.
 *  \param[out] dBias          PRE/POST_SCALE_BIAS: the bias shape (broadcast dims summed);
 *                             NULL skips it. Ignored for other bias types.
 *  \param[out] dSoftmaxOffset LEARNABLE_SOFTMAX: float32 [1, h_q, 1, 1]; NULL skips it.
 *  \param[in]  deterministic  the CUDA backend runs cuDNN's deterministic backward (no atomics in dQ;
 *              the workspace query must be asked with the same value); the CPU backend always is.
 *  \param[in,out] workspace   scratch (see nvte_fused_attn_bwd_workspace_size); may be NULL on CPU. */
NVTE_API NVTEStatus nvte_fused_attn_bwd(
    const NVTETensor Q, const NVTETensor K, const NVTETensor V, const NVTETensor O,
    const NVTETensor dO, const NVTETensor S, NVTETensor dP, const NVTETensorPack *Aux_CTX_Tensors,
    NVTETensor dQ, NVTETensor dK, NVTETensor dV, NVTETensor dBias, NVTETensor dSoftmaxOffset,
    const NVTETensor cu_seqlens_q, const NVTETensor cu_seqlens_kv,
    const NVTETensor cu_seqlens_q_padded, const NVTETensor cu_seqlens_kv_padded,
    size_t max_seqlen_q, size_t max_seqlen_kv, float attn_scale, float dropout,
    NVTE_QKV_Layout qkv_layout, NVTE_Bias_Type bias_type, NVTE_Mask_Type attn_mask_type,
    NVTE_Softmax_Type softmax_type, int64_t window_size_left, int64_t window_size_right,
    bool bottom_right_diagonal, bool deterministic, bool cuda_graph, NVTETensor workspace,
    cudaStream_t stream);

/** \brief Bytes of workspace nvte_fused_attn_fwd needs for these arguments (same meaning as
 *  there; only shapes, dtypes and where the data lives are read). 0 on the CPU. THD: the size
 *  holds for every batch size and cu_seqlens (it depends on the token counts and max_seqlen).
 *  \param[out] bytes  the size; allocate it on the tensors' device. */
NVTE_API NVTEStatus nvte_fused_attn_fwd_workspace_size(
    const NVTETensor Q, const NVTETensor K, const NVTETensor V, const NVTETensor Bias,
    size_t max_seqlen_q, size_t max_seqlen_kv, bool is_training, bool return_max_logit,
    float dropout, NVTE_QKV_Layout qkv_layout, NVTE_Bias_Type bias_type,
    NVTE_Mask_Type attn_mask_type, NVTE_Softmax_Type softmax_type, int64_t window_size_left,
    int64_t window_size_right, bool bottom_right_diagonal, size_t *bytes);

/** \brief Bytes of workspace nvte_fused_attn_bwd needs for these arguments. 0 on the CPU.
 *  \param[in] dBias  the dBias the backward will get; for PRE/POST_SCALE_BIAS without a bias
 *             gradient, the forward's Bias (its shape describes the bias; the size covers the
 *             backward with and without dBias); NULL only without a bias. Only its shape is read. */
NVTE_API NVTEStatus nvte_fused_attn_bwd_workspace_size(
    const NVTETensor Q, const NVTETensor K, const NVTETensor V, const NVTETensor dBias,
    size_t max_seqlen_q, size_t max_seqlen_kv, float dropout, NVTE_QKV_Layout qkv_layout,
    NVTE_Bias_Type bias_type, NVTE_Mask_Type attn_mask_type, NVTE_Softmax_Type softmax_type,
    int64_t window_size_left, int64_t window_size_right, bool bottom_right_diagonal,
    bool deterministic, size_t *bytes);

/** \brief Writes the new tokens' keys and values of one step into a K/V cache (TE's argument list).
 *
 *  Sequence i (i < b) brings n_i = cu_new_lens[i + 1] - cu_new_lens[i] new tokens and holds
 *  c_i = cu_cached_lens[i + 1] - cu_cached_lens[i] tokens after the step (the new ones included,
 *  so c_i >= n_i): its new token j goes to position c_i - n_i + j of the sequence. Rows are copied
 *  byte for byte (any dtype; FP8 caches keep their scales outside this call).
 *
 *  \param[in]  new_k, new_v  the step's keys [.., h_kv, d_k] and values [.., h_kv, d_v], dense:
 *                            NVTE_BSHD [b, max_ctx_len, h, d] (token j of sequence i in row j of
 *                            batch i), NVTE_SBHD [max_ctx_len, b, h, d], NVTE_THD [t, h, d]
 *                            (sequence i's tokens in rows cu_new_lens[i] ..); other rows unread.
 *  \param[in,out] k_cache, v_cache  dense caches, new_k's / new_v's dtype, heads and head dims.
 *                            Paged: [num_pages, page_size, h, d], position p of sequence i in
 *                            page page_table[i][p / page_size], slot p % page_size. Non-paged:
 *                            [slots, max_seq_len, h, d], sequence i in slot page_table[i][0] (no
 *                            page_table: slot i), position p in row p; nothing is moved (TE's
 *                            non-paged cache may reorder slots: here the table says where each
 *                            sequence lives).
 *  \param[in]  page_table    int32 [>= b, max_pages_per_seq]; required when paged.
 *  \param[in]  cu_new_lens, cu_cached_lens  int32 [>= b + 1], non-decreasing from 0.
 *  \param[in]  max_ctx_len   BSHD/SBHD: new_k's sequence dimension (n_i <= max_ctx_len).
 *  \param[in]  max_seq_len   the longest sequence the cache holds (c_i <= max_seq_len; paged:
 *                            at most max_pages_per_seq * page_size).
 *  \param[in]  is_non_paged  non-zero: the non-paged cache above.
 *
 *  Lengths, positions and page ids live on the device with the data. The CPU backend checks
 *  them and fails with the offending sequence; the CUDA kernel cannot report them and skips
 *  every row whose target lies outside the cache (so it never writes out of bounds). */
NVTE_API NVTEStatus nvte_copy_to_kv_cache(NVTETensor new_k, NVTETensor new_v, NVTETensor k_cache,
                                          NVTETensor v_cache, NVTETensor page_table, NVTETensor cu_new_lens,
                                          NVTETensor cu_cached_lens, NVTE_QKV_Format qkv_format, int b,
                                          int max_ctx_len, int max_seq_len, int max_pages_per_seq,
                                          int is_non_paged, cudaStream_t stream);

/** \brief Folds a partial attention result into a running one, in place: the merge of attention
 *  over disjoint sets of keys (context parallelism's ring steps, split keys).
 *
 *  Per token and head, with a = lse and b = lse_part (natural logs of the softmax denominators):
 *    lse' = log(exp(a) + exp(b)),  out = exp(a - lse') out + exp(b - lse') out_part,  lse = lse'.
 *  A row whose a and b are both -inf (no key on either side) is left unchanged; a NaN statistic
 *  gives NaN in the row and its statistic.
 *
 *  \param[in,out] out     float32, in qkv_format: NVTE_BSHD [b, s, h, d], NVTE_SBHD [s, b, h, d],
 *                         NVTE_THD [t, h, d].
 *  \param[in,out] lse     float32 statistics of out's rows: BSHD / SBHD [b, h, s] or [b, h, s, 1]
 *                         (nvte_fused_attn_fwd's aux [0] layout), THD [t, h] (token-major).
 *  \param[in]  out_part   float32, bfloat16 or float16, out's shape except in the sequence (BSHD /
 *                         SBHD) or token (THD) dimension, where it has s_p rows: its row j is out's
 *                         row row_offset + j (row_offset + s_p <= out's rows).
 *  \param[in]  lse_part   float32 statistics of out_part's rows, laid out as lse.
 *  \param[in]  row_offset see out_part.
 *  \param[in]  qkv_format NVTE_BSHD, NVTE_SBHD or NVTE_THD.
 *  \param[in]  stream     CUDA stream (ignored for host data). All four tensors on one device, in
 *                         memory of their own (no two overlap). */
NVTE_API NVTEStatus nvte_attn_merge(NVTETensor out, NVTETensor lse, const NVTETensor out_part,
                                    const NVTETensor lse_part, size_t row_offset, NVTE_QKV_Format qkv_format,
                                    cudaStream_t stream);

/** \brief Folds an attention sink into a running result: nvte_attn_merge with a term of value zero
 *  and statistic sink[h] in every row (the extra softmax term of the off-by-one / learnable
 *  softmax, added once after the key blocks' merges).
 *  \param[in,out] out, lse  as in nvte_attn_merge.
 *  \param[in]  sink       float32 [h], the sink's logit per head.
 *  \param[in]  qkv_format, stream  as in nvte_attn_merge. */
NVTE_API NVTEStatus nvte_attn_merge_sink(NVTETensor out, NVTETensor lse, const NVTETensor sink,
                                         NVTE_QKV_Format qkv_format, cudaStream_t stream);

/** \brief Gradient of the sink logits of a result that nvte_attn_merge_sink folded:
 *    dsink[h] = -sum over rows (tokens) of exp(sink[h] - lse) * (dO . O)
 *  (the sink's probability times the row's softmax_sum D; the sink's value is zero). Rows whose
 *  lse is -inf contribute nothing. Deterministic: fixed-order sums.
 *  \param[in]  dout, out  the merged output and its gradient: out's layout in nvte_attn_merge,
 *                         one dtype, float32, bfloat16 or float16.
 *  \param[in]  lse        float32 statistics of the rows after the sink's fold (nvte_attn_merge's
 *                         layouts).
 *  \param[in]  sink       float32 [h].
 *  \param[out] dsink      float32 [h], written (not accumulated).
 *  \param[in]  qkv_format, stream  as in nvte_attn_merge. */
NVTE_API NVTEStatus nvte_attn_merge_sink_grad(const NVTETensor dout, const NVTETensor out, const NVTETensor lse,
                                              const NVTETensor sink, NVTETensor dsink, NVTE_QKV_Format qkv_format,
                                              cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* TRANSFORMER_ENGINE_FUSED_ATTN_H_ */

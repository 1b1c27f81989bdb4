// attn_checks.h - argument checks of the fused attention entry points (api/fused_attn.cpp).
//
// Two levels: check_config validates the scalar configuration (layout, mask, bias, softmax,
// dropout, windows, head counts and sizes, the FP8 restrictions) and is also what nvte_get_fused_attn_backend
// answers with; describe() reads Q, K, V and the optional tensors' shapes and dtypes, checks
// them against the layout and returns the AttnParams a backend runs from.
#pragma once

#include <cstdint>

#include "../common/attn_params.h"

namespace nvte::api {

// The scalar arguments shared by the forward, the backward and the queries.
struct AttnScalars {
  size_t max_sq = 0, max_skv = 0;
  bool is_training = true, return_max_logit = false;
  float scale = 1.0f, dropout = 0.0f;
  NVTE_QKV_Layout layout = NVTE_BSHD_BSHD_BSHD;
  NVTE_Bias_Type bias_type = NVTE_NO_BIAS;
  NVTE_Mask_Type mask_type = NVTE_NO_MASK;
  NVTE_Softmax_Type softmax_type = NVTE_VANILLA_SOFTMAX;
  int64_t window_left = -1, window_right = -1;
  bool bottom_right_diagonal = false;
  bool deterministic = false;  // backward: a deterministic algorithm only (TE's flag)
};

// Sizes and dtypes that tensors imply (or a backend query states).
struct AttnDims {
  NVTEDType q_dtype = kNVTEFloat32, kv_dtype = kNVTEFloat32;
  size_t h_q = 0, h_kv = 0, d_qk = 0, d_v = 0;
};

// Which keys a query sees for s's mask type, bottom-right flag and window (the one rule the
// backends and the backend query share).
attn::MaskRule mask_rule(const AttnScalars &s);
bool is_padding(NVTE_Mask_Type m);

// Throws INVALID_ARGUMENT / NOT_SUPPORTED with a message naming the offending value.
attn::LayoutInfo check_config(const AttnScalars &s, const AttnDims &d);

// Sizes and dtypes of Q, K, V after checking their ranks against the layout and K against V.
AttnDims qkv_dims(const AttnScalars &s, const Tensor &q, const Tensor &k, const Tensor &v);

// Optional tensors of describe(); null when not passed.
struct AttnSideTensors {
  const Tensor *bias = nullptr;  // bias (PRE/POST_SCALE_BIAS) or ALiBi slopes
  const Tensor *softmax_offset = nullptr;
  const Tensor *cu_q = nullptr, *cu_kv = nullptr, *cu_q_padded = nullptr, *cu_kv_padded = nullptr;
  const Tensor *page_k = nullptr, *page_v = nullptr;  // paged layouts (forward only)
};

// Full check of Q, K, V and the side tensors. Q/K/V of packed layouts must be views at the
// right offsets of one buffer. with_cu == false (the workspace queries, which get no cu_seqlens)
// skips the cu_seqlens checks and the learnable softmax's SoftmaxOffset (which they do not get
// either); a pure THD layout then has batch 0 (unknown) and the batch dimension of a Bias is not
// checked.
attn::AttnParams describe(const AttnScalars &s, const Tensor &q, const Tensor &k, const Tensor &v,
                          const AttnSideTensors &side, bool with_cu = true);

// A tensor shaped like Q but with d_v (O, dO): Q's format and p.dtype (or the dtype given).
void check_out_like(const Tensor &t, const char *name, const attn::AttnParams &p);
void check_out_like(const Tensor &t, const char *name, const attn::AttnParams &p, NVTEDType dtype);

// Gradients dQ, dK, dV: the shapes of Q, K, V, the given dtype, and the same packing.
void check_qkv_grads(const Tensor &dq, const Tensor &dk, const Tensor &dv, const Tensor &q,
                     const Tensor &k, const Tensor &v, const attn::AttnParams &p, NVTEDType dtype);

// FP8 attention (p.dtype float8_e4m3): the scaling metadata and output dtypes of fused_attn.h
// "FP8 attention". Forward: Q/K/V scale_inv, S (a handle, data not needed) with scale, O FP8 with
// scale or float16/bfloat16, O's shape. Backward: Q/K/V scale_inv, O (FP8 with scale_inv, or
// float16/bfloat16), dO FP8 with scale_inv, S and dP with scale, dQ/dK/dV one dtype (FP8 with
// scale, or float16/bfloat16) and the shapes/packing of Q/K/V.
void check_fp8_fwd(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor *s,
                   const Tensor &o, const attn::AttnParams &p);
void check_fp8_bwd(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &o,
                   const Tensor &d_o, const Tensor *s, const Tensor *dp, const Tensor &dq,
                   const Tensor &dk, const Tensor &dv, const attn::AttnParams &p);

// Softmax statistics / max logit: float32 [b, h_q, max_sq, 1].
NVTEShape stats_shape(const attn::AttnParams &p);

// A handle's rowwise buffer must be exactly this dtype and shape (data may be required).
void check_exact(const Tensor &t, const char *name, NVTEDType dtype, const NVTEShape &shape,
                 bool need_data);

NVTEShape make_shape(std::initializer_list<size_t> dims);

}  // namespace nvte::api

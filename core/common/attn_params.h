// attn_params.h - the validated description of one fused attention call, handed from the API
// layer (api/fused_attn.cpp) to a backend (cpu/fused_attn.h, cuda/fused_attn.h).
//
// The API layer checks shapes, dtypes and flags and resolves the mask rule; backends only
// read these fields and the tensors' buffers. Tensor values (cu_seqlens contents) are not
// checked there: they live on the device, so each backend checks what it can read.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attn_layout.h"
#include "attn_mask.h"
#include "tensor.h"

namespace nvte::attn {

struct AttnParams {
  LayoutInfo layout;
  QKVPlacement qkv;       // Q, K, V and equally dQ, dK, dV
  TensorPlacement out;    // O and dO
  size_t batch = 0, h_q = 0, h_kv = 0, d_qk = 0, d_v = 0;
  size_t max_sq = 0, max_skv = 0;   // padded lengths (the S dimension for BSHD/SBHD)
  size_t rows_q = 0, rows_kv = 0;   // token rows of the Q and K/V tensors (b * s, or t)
  NVTEDType dtype = kNVTEFloat32;   // Q, K, V; also O, dO and the gradients unless FP8 (below)
  NVTE_Bias_Type bias_type = NVTE_NO_BIAS;
  NVTE_Mask_Type mask_type = NVTE_NO_MASK;
  NVTE_Softmax_Type softmax_type = NVTE_VANILLA_SOFTMAX;
  bool padding = false;   // a padding mask type (THD sides take lengths from cu_seqlens anyway)
  MaskRule rule{};        // causal / alignment / window, resolved from the mask type
  float scale = 1.0f;
  float dropout = 0.0f;   // effective probability (0 in inference forward calls)
  bool is_training = false;
  bool return_max_logit = false;
  bool deterministic = false;     // backward: cuDNN's deterministic algorithm only
  size_t bias_b = 0, bias_h = 0;  // PRE/POST_SCALE_BIAS: broadcast dims (1 or b, 1 or h_q)
  size_t slopes_b = 0;            // ALIBI slopes: 0 default, 1 for [h_q], b for [b, h_q]
  // Paged layouts: K and V are caches of num_pages pages of page_size token rows ([num_pages,
  // page_size, h, d] for BSHD, [page_size, num_pages, h, d] for SBHD); key j of sequence b sits
  // at slot j % page_size of page page_table[b][j / page_size] (int32 [b, pages_per_seq]).
  size_t page_size = 0, num_pages = 0, pages_per_seq = 0;
};

// Tensors of a forward call; optional ones are null. Aux slots that alias an input are
// left null by the API layer (nothing to copy).
//
// FP8 calls (dtype float8_e4m3, fused_attn.h "FP8 attention"): Q, K, V carry scale_inv; `s` is
// the S tensor (scale of the softmax output; its amax and scale_inv are written); O is FP8 with
// scale (amax, scale_inv written) or float16/bfloat16. The backward's `s` is read only (scale),
// `dp` carries the quantization of dS (scale; amax, scale_inv written); O and dO carry
// scale_inv; dQ, dK, dV are FP8 with scale (amax, scale_inv written) or float16/bfloat16.
struct AttnFwdTensors {
  const Tensor *q = nullptr, *k = nullptr, *v = nullptr;
  const Tensor *bias = nullptr;           // bias or ALiBi slopes
  const Tensor *softmax_offset = nullptr; // learnable softmax
  const Tensor *cu_q = nullptr, *cu_kv = nullptr, *cu_q_padded = nullptr, *cu_kv_padded = nullptr;
  const Tensor *rng_state = nullptr;      // needed when dropout > 0
  const Tensor *page_k = nullptr, *page_v = nullptr;  // paged layouts: the page tables
  Tensor *o = nullptr;
  Tensor *s = nullptr;                    // FP8 only: softmax-output quantization
  Tensor *stats = nullptr, *max_logit = nullptr;        // aux outputs (training)
  Tensor *aux_rng = nullptr, *aux_bias = nullptr, *aux_offset = nullptr;  // copies to make
};

struct AttnBwdTensors {
  const Tensor *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *d_o = nullptr;
  const Tensor *stats = nullptr, *rng_state = nullptr;
  const Tensor *bias = nullptr, *softmax_offset = nullptr;
  const Tensor *cu_q = nullptr, *cu_kv = nullptr, *cu_q_padded = nullptr, *cu_kv_padded = nullptr;
  const Tensor *s = nullptr;              // FP8 only: softmax-output quantization (read)
  Tensor *dp = nullptr;                   // FP8 only: dS quantization
  Tensor *dq = nullptr, *dk = nullptr, *dv = nullptr;
  Tensor *dbias = nullptr, *dsoftmax_offset = nullptr;
};

}  // namespace nvte::attn

// cpu/fused_attn.h - CPU reference of fused attention (fused_attn.h): every layout, mask,
// window, bias and softmax type, GQA/MQA and dropout, computed in float64 from
// float32/float16/bfloat16 inputs and rounded once when stored; FP8 inputs (E4M3 Q/K/V) run
// TE's quantized FP8 dataflow (cpu/fused_attn_fp8.cpp).
//
// Shapes and dtypes are validated by the API layer (api/attn_checks.h); these functions check
// the values the API layer cannot read (cu_seqlens contents) and compute.
#pragma once

#include <cstddef>

#include "../common/attn_params.h"

namespace nvte::cpu {

// O, and when training the softmax statistics (+ max logit) and the aux copies (rng_state,
// bias, softmax offset) into the slots given in t.
void fused_attn_fwd(const attn::AttnParams &p, const attn::AttnFwdTensors &t);

// dQ, dK, dV and the optional dBias / dSoftmaxOffset from O, dO and the statistics.
void fused_attn_bwd(const attn::AttnParams &p, const attn::AttnBwdTensors &t);

// FP8 attention (dtype float8_e4m3; called by the two above): the dataflow of fused_attn.h
// "FP8 attention", with t.s / t.dp holding the quantization of the softmax output and of dS.
void fused_attn_fp8_fwd(const attn::AttnParams &p, const attn::AttnFwdTensors &t);
void fused_attn_fp8_bwd(const attn::AttnParams &p, const attn::AttnBwdTensors &t);

// The CPU backend needs no workspace (scratch comes from the host heap).
inline size_t fused_attn_workspace_bytes(const attn::AttnParams &) { return 0; }

}  // namespace nvte::cpu

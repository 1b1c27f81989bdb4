// cuda/fused_attn.h - CUDA backend of fused attention (fused_attn.h): the same entry points as
// cpu/fused_attn.h, run on `stream` with caller-provided workspace.
//
// Implemented with cuDNN in cuda/cudnn/fused_attn_cudnn.cpp, compiled when the cuDNN and
// cuDNN-frontend headers are found (NVTE_WITH_CUDNN); the API layer calls these only then.
#pragma once

#include <string>

#include "../common/attn_params.h"

namespace nvte::cuda {

// Whether the CUDA backend's static rules accept p (dtype, layout, mask, bias, window); when
// not, *why says which part. cuDNN may still reject a concrete shape when its graph is built.
bool fused_attn_supported(const attn::AttnParams &p, std::string *why);

// Bytes of device workspace the forward / backward of p needs.
size_t fused_attn_fwd_workspace_bytes(const attn::AttnParams &p);
size_t fused_attn_bwd_workspace_bytes(const attn::AttnParams &p);

void fused_attn_fwd(const attn::AttnParams &p, const attn::AttnFwdTensors &t, Tensor *workspace,
                    cudaStream_t stream);

void fused_attn_bwd(const attn::AttnParams &p, const attn::AttnBwdTensors &t, Tensor *workspace,
                    cudaStream_t stream);

}  // namespace nvte::cuda

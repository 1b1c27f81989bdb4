// cuda/attn_softmax.h - CUDA backend of nvte_attn_softmax_{forward,backward}: the routines of
// cpu/attn_softmax.h, run on `stream`.
#pragma once

#include "../common/attn_softmax.h"
#include "../common/tensor.h"

namespace nvte::cuda {

void attn_softmax_forward(const attn::SoftmaxArgs &a, const Tensor &in, Tensor &out, Tensor *sink_probs,
                          cudaStream_t stream);

void attn_softmax_backward(const attn::SoftmaxArgs &a, const Tensor &dy, const Tensor &y, const Tensor *sink_probs,
                           Tensor &dx, Tensor *logit_grads, Tensor *offset_grads, cudaStream_t stream);

}  // namespace nvte::cuda

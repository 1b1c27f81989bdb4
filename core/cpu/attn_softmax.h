// cpu/attn_softmax.h - CPU reference of nvte_attn_softmax_{forward,backward} (softmax.h).
#pragma once

#include "../common/attn_softmax.h"
#include "../common/tensor.h"

namespace nvte::cpu {

// y (and sink_probs, when not null) of the score softmax; arguments validated by the api layer.
void attn_softmax_forward(const attn::SoftmaxArgs &a, const Tensor &in, Tensor &out, Tensor *sink_probs);

// output_grads = scale * g, logit_grads = g, offset_grads = -sink * dot (the last two optional).
void attn_softmax_backward(const attn::SoftmaxArgs &a, const Tensor &dy, const Tensor &y, const Tensor *sink_probs,
                           Tensor &dx, Tensor *logit_grads, Tensor *offset_grads);

}  // namespace nvte::cpu

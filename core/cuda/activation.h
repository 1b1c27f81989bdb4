// cuda/activation.h - CUDA backend of activation.h: the same two routines as
// cpu/activation.h (elementwise and gated, forward when grad is null), run on `stream`.
#pragma once

#include "../common/activation_math.h"
#include "../common/tensor.h"

namespace nvte::cuda {

// grad == nullptr: out = act(in).  Otherwise: out = grad * act'(in).  All [rows, cols].
void activation(Act a, const Tensor *grad, const Tensor &in, Tensor &out, cudaStream_t stream);

// in [rows, 2H].  grad == nullptr: out [rows, H] = act(in[:, :H]) * in[:, H:].
// Otherwise grad [rows, H], out [rows, 2H] = [grad * gate * act'(x), grad * act(x)].
void gated_activation(Act a, const Tensor *grad, const Tensor &in, Tensor &out, cudaStream_t stream);

}  // namespace nvte::cuda

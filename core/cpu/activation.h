// cpu/activation.h - CPU reference of activation.h: one elementwise and one gated routine,
// both parameterised by the activation (nvte::Act), forward when grad is null.
#pragma once

#include "../common/activation_math.h"
#include "../common/tensor.h"

namespace nvte::cpu {

// grad == nullptr: out = act(in).  Otherwise: out = grad * act'(in).  All [rows, cols].
// Shapes and dtypes are validated by the api layer.
void activation(Act a, const Tensor *grad, const Tensor &in, Tensor &out);

// in [rows, 2H].  grad == nullptr: out [rows, H] = act(in[:, :H]) * in[:, H:].
// Otherwise grad [rows, H], out [rows, 2H] = [grad * gate * act'(x), grad * act(x)].
void gated_activation(Act a, const Tensor *grad, const Tensor &in, Tensor &out);

}  // namespace nvte::cpu

// cpu/softmax.h - CPU reference of softmax.h: one forward routine for the four mask
// families and one backward routine shared by all of them.
#pragma once

#include "../common/tensor.h"

namespace nvte::cpu {

enum class SoftmaxMask {
  None,           // any rank >= 2
  Explicit,       // [B, H, Sq, Sk] with a uint8 mask [B or 1, 1, Sq, Sk]; masked logit = -10000
  UpperTriang,    // [batches, S, S]; (i, j) masked when j > i; masked y = 0
  AlignedCausal,  // [B, H, Sq, Sk]; (i, j) masked when j > i + (Sk - Sq); masked y = 0
};

// out = softmax(scale * in) over the last dim with the given mask. Shapes and dtypes are
// validated by the api layer; out may alias in (same dtype and shape).
void softmax_forward(SoftmaxMask kind, const Tensor &in, const Tensor *mask, Tensor &out, float scale);

// dx = scale * y * (dy - sum(dy * y)) over the last dim; dx may alias dy (or y).
void softmax_backward(const Tensor &dy, const Tensor &y, Tensor &dx, float scale);

}  // namespace nvte::cpu

// cuda/softmax.h - CUDA backend of softmax.h: the same forward (four mask families) and
// backward routines as cpu/softmax.h, run on `stream`.
#pragma once

#include "../common/tensor.h"
#include "../cpu/softmax.h"  // SoftmaxMask (plain C++)

namespace nvte::cuda {

using cpu::SoftmaxMask;

// out = softmax(scale * in) over the last dim with the given mask; out may alias in.
void softmax_forward(SoftmaxMask kind, const Tensor &in, const Tensor *mask, Tensor &out, float scale,
                     cudaStream_t stream);

// dx = scale * y * (dy - sum(dy * y)) over the last dim; dx may alias dy (or y).
void softmax_backward(const Tensor &dy, const Tensor &y, Tensor &dx, float scale, cudaStream_t stream);

}  // namespace nvte::cuda

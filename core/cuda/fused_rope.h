// cuda/fused_rope.h - CUDA backend of fused_rope.h, the same routine as cpu/fused_rope.h on `stream`.
#pragma once

#include "../common/rope.h"
#include "../common/tensor.h"

namespace nvte::cuda {

// y (dense) = RoPE of x (read at p's strides), or its transpose for p.backward. Elements whose
// position lies past freqs' rows are written as NaN (the host cannot see device-side lengths).
void fused_rope(const rope::RopeParams &p, const Tensor &x, const Tensor *cu_seqlens, const Tensor &freqs,
                const Tensor *start, Tensor &y, cudaStream_t stream);

}  // namespace nvte::cuda

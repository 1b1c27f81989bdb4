// cpu/fused_rope.h - CPU reference of fused_rope.h (forward and backward: p.backward).
#pragma once

#include "../common/rope.h"
#include "../common/tensor.h"

namespace nvte::cpu {

// y (dense) = RoPE of x (read at p's strides), or its transpose for p.backward. cu_seqlens: THD
// only; start: optional int32 [b]. Validated by the api layer except the device-side values
// (cu_seqlens, start positions), checked here.
void fused_rope(const rope::RopeParams &p, const Tensor &x, const Tensor *cu_seqlens, const Tensor &freqs,
                const Tensor *start, Tensor &y);

}  // namespace nvte::cpu

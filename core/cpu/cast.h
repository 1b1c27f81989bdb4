// cpu/cast.h - CPU reference of the quantize / dequantize family (cast.h).
#pragma once

#include "../common/tensor.h"

namespace nvte::cpu {

// out = quantize(in) into out's rowwise and/or columnwise layouts (rule of cast.h).
void quantize(const Tensor &in, Tensor &out);
// out = float(in) * in.scale_inv, in out's high-precision dtype.
void dequantize(const Tensor &in, Tensor &out);

}  // namespace nvte::cpu

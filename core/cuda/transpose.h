// cuda/transpose.h - CUDA transposes (transpose.h). The cast + transpose family runs through
// cuda::quantize / cuda::quantize_dbias (core/cuda/cast.h): a columnwise layout is part of
// the quantized output there. Validation happens in the API layer.
#pragma once

#include "../common/tensor.h"

namespace nvte::cuda {

// out's rowwise data [cols, rows] = in's rowwise data [rows, cols]^T, bit for bit (elements of
// 1, 2, 4 or 8 bytes).
void transpose(const Tensor &in, Tensor &out, cudaStream_t stream);

}  // namespace nvte::cuda

// cuda/transpose.h - CUDA transposes (transpose.h). The cast + transpose family runs through
// cuda::quantize / cuda::quantize_dbias (core/cuda/cast.h): a columnwise layout is part of
// the quantized output there. Validation happens in the API layer.
#pragma once

#include "../common/tensor.h"

namespace nvte::cuda {

// out's rowwise data [cols, rows] = in's rowwise data [rows, cols]^T, bit for bit (elements of
// 1, 2, 4 or 8 bytes).
void transpose(const Tensor &in, Tensor &out, cudaStream_t stream);

// dst [cols, rows] = src [rows, cols]^T for elements of elem_bytes (1, 2, 4 or 8) bytes, bit for
// bit; nothing is launched for an empty matrix. For kernels that write a transposed copy of their
// own rowwise output (the norm forward's columnwise FP8 z).
void transpose_raw(const void *src, void *dst, size_t rows, size_t cols, size_t elem_bytes, cudaStream_t stream);

}  // namespace nvte::cuda

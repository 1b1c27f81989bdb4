// cpu/transpose.h - CPU transposes: a blocked element copy usable for any dtype.
#pragma once

#include <cstddef>

#include "../common/tensor.h"

namespace nvte::cpu {

// dst[c * rows + r] = src[r * cols + c] for a row-major [rows, cols] matrix of
// elem_size-byte elements (1, 2, 4 or 8). Works in 32x32 tiles so that reads and
// writes both stay within a few cache lines.
void transpose_bytes(const void *src, void *dst, size_t rows, size_t cols, size_t elem_size);

// out's rowwise data [cols, rows] = in's rowwise data [rows, cols]^T, bit for bit.
void transpose(const Tensor &in, Tensor &out);

}  // namespace nvte::cpu

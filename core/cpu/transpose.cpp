// cpu/transpose.cpp - blocked transposes on the CPU (plain element copies, so any dtype works).
#include "transpose.h"

#include <algorithm>
#include <cstdint>

#include "parallel.h"

namespace nvte::cpu {

namespace {

constexpr size_t kTile = 32;

template <class T>
void transpose_tiles(const T *src, T *dst, size_t rows, size_t cols) {
  const size_t row_tiles = (rows + kTile - 1) / kTile;
  // Roughly 64K elements per task keeps thread hand-off cheap next to the copying.
  const size_t grain = std::max<size_t>(1, (size_t{1} << 16) / (kTile * std::max<size_t>(cols, 1)));
  parallel_for(row_tiles, grain, [&](size_t t0, size_t t1) {
    for (size_t t = t0; t < t1; ++t) {
      const size_t r0 = t * kTile, r1 = std::min(rows, r0 + kTile);
      for (size_t c0 = 0; c0 < cols; c0 += kTile) {
        const size_t c1 = std::min(cols, c0 + kTile);
        for (size_t c = c0; c < c1; ++c) {
          T *d = dst + c * rows;
          for (size_t r = r0; r < r1; ++r) d[r] = src[r * cols + c];
        }
      }
    }
  });
}

}  // namespace

void transpose_bytes(const void *src, void *dst, size_t rows, size_t cols, size_t elem_size) {
  if (rows == 0 || cols == 0) return;
  switch (elem_size) {
    case 1:
      return transpose_tiles(static_cast<const uint8_t *>(src), static_cast<uint8_t *>(dst), rows, cols);
    case 2:
      return transpose_tiles(static_cast<const uint16_t *>(src), static_cast<uint16_t *>(dst), rows, cols);
    case 4:
      return transpose_tiles(static_cast<const uint32_t *>(src), static_cast<uint32_t *>(dst), rows, cols);
    case 8:
      return transpose_tiles(static_cast<const uint64_t *>(src), static_cast<uint64_t *>(dst), rows, cols);
    default:
      NVTE_FAIL(NVTE_ERROR_INTERNAL, "transpose of ", elem_size, "-byte elements is not implemented");
  }
}

void transpose(const Tensor &in, Tensor &out) {
  const NVTEBasicTensor &src = in.params[kNVTERowwiseData];
  const NVTEBasicTensor &dst = out.params[kNVTERowwiseData];
  const Dims2 d = flat2d(src.shape);
  transpose_bytes(src.data_ptr, dst.data_ptr, d.rows, d.cols, dtype_size(src.dtype));
}

}  // namespace nvte::cpu

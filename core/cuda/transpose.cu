// transpose.cu - CUDA plain transpose of any 1/2/4/8-byte element type.
//
// Design: the same tiled one-pass kernel as the FP8 cast+transpose (cast_tiles.cuh) in its
// raw mode: elements are moved as unsigned integers of their width, so every dtype
// transposes bit for bit; 16-byte loads along the input rows, a swizzled transposed image
// in shared memory, 16-byte stores along the output rows (scalar paths for misaligned or
// odd-sized matrices).
#include "transpose.h"

#include "cast_tiles.cuh"

namespace nvte::cuda {

namespace {

template <class T>
void launch_raw(const void *src, void *dst, size_t rows, size_t cols, cudaStream_t stream) {
  tiles::Args a;
  a.in = src;
  a.out_col = dst;
  a.rows = rows;
  a.cols = cols;
  a.col_vec = tiles::col_vec_ok(dst, rows, sizeof(T));
  if (tiles::vec_ok<T, T, T>(a))
    tiles::launch<T, T, T, kNoAct, false, true, true>(a, stream);
  else
    tiles::launch<T, T, T, kNoAct, false, false, true>(a, stream);
}

}  // namespace

void transpose_raw(const void *src, void *dst, size_t rows, size_t cols, size_t elem_bytes, cudaStream_t stream) {
  if (rows * cols == 0) return;
  switch (elem_bytes) {
    case 1: return launch_raw<uint8_t>(src, dst, rows, cols, stream);
    case 2: return launch_raw<uint16_t>(src, dst, rows, cols, stream);
    case 4: return launch_raw<uint32_t>(src, dst, rows, cols, stream);
    case 8: return launch_raw<uint64_t>(src, dst, rows, cols, stream);
    default: NVTE_FAIL(NVTE_ERROR_NOT_SUPPORTED, "transpose of ", elem_bytes, "-byte elements is not supported");
  }
}

void transpose(const Tensor &in, Tensor &out, cudaStream_t stream) {
  const NVTEBasicTensor &src = in.params[kNVTERowwiseData];
  const NVTEBasicTensor &dst = out.params[kNVTERowwiseData];
  const Dims2 d = flat2d(src.shape);
  transpose_raw(src.data_ptr, dst.data_ptr, d.rows, d.cols, dtype_size(src.dtype), stream);
}

}  // namespace nvte::cuda

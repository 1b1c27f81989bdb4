// cpu/cast.cpp - CPU reference of quantize / dequantize / fused dbias: row-parallel float32 loops.
#include "cast.h"

#include <algorithm>
#include <vector>

#include "parallel.h"
#include "rows.h"
#include "transpose.h"

namespace nvte::cpu {

void write_output(Tensor &out, size_t rows, size_t cols, const RowFn &fill) {
  { OutputRows check(out, "output", rows, cols); }  // validates both layouts under out's own name
  const NVTEBasicTensor col = out.params[kNVTEColumnwiseData];
  const bool has_col = buffer_set(col);
  // The columnwise layout is filled afterwards by a tiled byte transpose of the rowwise
  // result: cache-friendly, and bit-identical to quantizing the transposed values.
  Tensor view = out;
  std::vector<unsigned char> scratch;
  if (has_col) {
    view.params[kNVTEColumnwiseData] = NVTEBasicTensor{};
    NVTEBasicTensor &row = view.params[kNVTERowwiseData];
    if (!buffer_set(row)) {
      scratch.resize(rows * cols * dtype_size(col.dtype));
      row.data_ptr = scratch.data();
      row.dtype = col.dtype;
      row.shape.ndim = 2;
      row.shape.data[0] = rows;
      row.shape.data[1] = cols;
    }
  }
  OutputRows dst(view, "output", rows, cols);
  // (an empty [rows, 0] tensor: no row to visit, however many rows it names)
  parallel_for(cols ? rows : 0, std::max<size_t>(1, 16384 / std::max<size_t>(cols, 1)), [&](size_t r0, size_t r1) {
    std::vector<float> buf(cols);
    for (size_t r = r0; r < r1; ++r) {
      fill(r, buf.data());
      dst.store(r, buf.data());
    }
  });
  dst.finish();
  if (has_col)
    transpose_bytes(view.params[kNVTERowwiseData].data_ptr, col.data_ptr, rows, cols, dtype_size(col.dtype));
}

void quantize(const Tensor &in, Tensor &out) {
  const InputRows src = input_rows(in, "input");
  write_output(out, src.rows, src.cols, [&](size_t r, float *row) { src.load(r, row); });
}

void dequantize(const Tensor &in, Tensor &out) {
  NVTE_CHECK(is_high_precision(logical_dtype(out)), "output must be float32, float16 or bfloat16, got ",
             dtype_name(logical_dtype(out)));
  std::vector<unsigned char> scratch;
  InputRows src;
  if (buffer_set(in.params[kNVTERowwiseData])) {
    src = input_rows(in, "input");
  } else {
    // Columnwise-only input [N, M]: transpose the bytes back to [M, N] once, then decode rows.
    const NVTEBasicTensor &cb = in.params[kNVTEColumnwiseData];
    NVTE_CHECK(is_fp8(cb.dtype), "input columnwise data must be FP8, got ", dtype_name(cb.dtype));
    const float *si = scalar_param(in, kNVTEColumnwiseScaleInv, "input columnwise scale_inv");
    if (si == nullptr) si = scalar_param(in, kNVTERowwiseScaleInv, "input scale_inv");
    NVTE_CHECK(si != nullptr, "input is FP8 (", dtype_name(cb.dtype), ") but has no scale_inv");
    const Dims2 d = flat2d(logical_shape(in));
    scratch.resize(d.rows * d.cols);
    transpose_bytes(cb.data_ptr, scratch.data(), d.cols, d.rows, 1);
    src.data = scratch.data();
    src.dtype = cb.dtype;
    src.rows = d.rows;
    src.cols = d.cols;
    src.scale_inv = *si;
  }
  write_output(out, src.rows, src.cols, [&](size_t r, float *row) { src.load(r, row); });
}

namespace {

// dbias[j] = sum_i g[i, j] with i ascending: deterministic for any thread count.
void column_sums(const std::vector<float> &g, size_t rows, size_t cols, const NVTEBasicTensor &db) {
  with_float_dtype(db.dtype, "dbias", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T *dst = static_cast<T *>(db.data_ptr);
    const size_t grain = std::max<size_t>(16, 65536 / std::max<size_t>(rows, 1));
    parallel_for(cols, grain, [&](size_t c0, size_t c1) {
      std::vector<float> acc(c1 - c0, 0.0f);
      for (size_t i = 0; i < rows; ++i) {
        const float *gr = g.data() + i * cols + c0;
        for (size_t j = 0; j < c1 - c0; ++j) acc[j] += gr[j];
      }
      for (size_t j = c0; j < c1; ++j) dst[j] = from_f32<T>(acc[j - c0]);
    });
  });
}

}  // namespace

void quantize_dbias(const Tensor &in, const Tensor *act_in, std::optional<Act> act, Tensor &out,
                    Tensor &dbias) {
  const InputRows grad = input_rows(in, "input");
  InputRows a;
  if (act) a = input_rows(*act_in, "act_input");
  const size_t rows = grad.rows, cols = grad.cols;
  std::vector<float> g(rows * cols);  // kept for the column sums
  write_output(out, rows, cols, [&](size_t r, float *row) {
    float *gr = g.data() + r * cols;
    grad.load(r, row);
    if (act) {
      a.load(r, gr);  // act_input row, overwritten by g just below
      for (size_t j = 0; j < cols; ++j) row[j] = row[j] * dact_f(*act, gr[j]);
    }
    std::copy(row, row + cols, gr);
  });
  column_sums(g, rows, cols, dbias.params[kNVTERowwiseData]);
}

}  // namespace nvte::cpu

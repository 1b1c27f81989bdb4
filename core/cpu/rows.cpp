// rows.cpp - typed row conversion and the output rule shared by all CPU ops.
#include "rows.h"

#include <cmath>

#include "parallel.h"

namespace nvte::cpu {

void load_row(const void *base, NVTEDType t, size_t offset, size_t n, float *out) {
  with_float_dtype(t, "input", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T *p = static_cast<const T *>(base) + offset;
    for (size_t i = 0; i < n; ++i) out[i] = to_f32(p[i]);
  });
}

void InputRows::load(size_t r, float *out) const {
  load_row(data, dtype, r * cols, cols, out);
  if (scale_inv != 1.0f)
    for (size_t i = 0; i < cols; ++i) out[i] *= scale_inv;
}

InputRows input_rows(const Tensor &t, const char *name) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  NVTE_CHECK(buffer_set(b), name, " needs rowwise data");
  InputRows in;
  in.data = b.data_ptr;
  in.dtype = b.dtype;
  NVTE_CHECK(is_high_precision(b.dtype) || is_fp8(b.dtype), name, " has dtype ", dtype_name(b.dtype),
             "; expected a float or FP8 dtype");
  const Dims2 d = flat2d(b.shape);
  in.rows = d.rows;
  in.cols = d.cols;
  if (is_fp8(b.dtype)) {
    const float *si = scalar_param(t, kNVTERowwiseScaleInv, name);
    NVTE_CHECK(si != nullptr, name, " is FP8 (", dtype_name(b.dtype), ") but has no scale_inv");
    in.scale_inv = *si;
  }
  return in;
}

OutputRows::OutputRows(const Tensor &out, const char *name, size_t rows, size_t cols)
    : rows_(rows), cols_(cols) {
  const NVTEBasicTensor &rb = out.params[kNVTERowwiseData];
  const NVTEBasicTensor &cb = out.params[kNVTEColumnwiseData];
  NVTE_CHECK(buffer_set(rb) || buffer_set(cb), name, " has no data buffer");
  dtype_ = buffer_set(rb) ? rb.dtype : cb.dtype;
  NVTE_CHECK(is_high_precision(dtype_) || nvte::is_fp8(dtype_), name, " has dtype ", dtype_name(dtype_),
             "; expected float32, float16, bfloat16 or FP8");
  fp8_ = nvte::is_fp8(dtype_);
  if (buffer_set(rb)) {
    const Dims2 d = flat2d(rb.shape);
    NVTE_CHECK(d.rows == rows && d.cols == cols, name, " has shape ", shape_str(rb.shape),
               " (2D view [", d.rows, ", ", d.cols, "]); expected [", rows, ", ", cols, "]");
    row_ = rb.data_ptr;
  }
  if (buffer_set(cb)) {
    NVTE_CHECK(cb.dtype == dtype_, name, " columnwise dtype ", dtype_name(cb.dtype),
               " differs from rowwise dtype ", dtype_name(dtype_));
    NVTE_CHECK(numel(cb.shape) == rows * cols && (cb.shape.ndim == 0 || rows * cols == 0 || cb.shape.data[0] == cols),
               name, " columnwise data has shape ", shape_str(cb.shape), "; expected [", cols, ", ", rows,
               "] (the transpose)");
    col_ = cb.data_ptr;
  }
  amax_ = scalar_param(out, kNVTEAmax, name);
  if (fp8_) {
    const float *s = scalar_param(out, kNVTEScale, name);
    NVTE_CHECK(s != nullptr, name, " is FP8 (", dtype_name(dtype_), ") but has no scale");
    scale_ = *s;
    scale_inv_ = scalar_param(out, kNVTERowwiseScaleInv, name);
    col_scale_inv_ = scalar_param(out, kNVTEColumnwiseScaleInv, name);
  }
}

void OutputRows::store(size_t r, const float *vals) {
  // NaN-ignoring max written as a comparison: GCC vectorises std::fmax here with min/max
  // instructions that let a NaN win (seen: amax 0 for a row holding inf then NaNs).
  float m = 0.0f;
  for (size_t j = 0; j < cols_; ++j) {
    const float a = std::fabs(vals[j]);
    m = a > m ? a : m;
  }
  atomic_fmax(amax_acc_, m);
  with_float_dtype(dtype_, "output", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const float s = fp8_ ? scale_ : 1.0f;
    if (row_) {
      T *dst = static_cast<T *>(row_) + r * cols_;
      for (size_t j = 0; j < cols_; ++j) dst[j] = from_f32<T>(vals[j] * s);
    }
    if (col_) {
      T *dst = static_cast<T *>(col_) + r;
      for (size_t j = 0; j < cols_; ++j) dst[j * rows_] = from_f32<T>(vals[j] * s);
    }
  });
}

void OutputRows::finish() {
  if (amax_) *amax_ = std::fmax(*amax_, amax_acc_.load());
  if (fp8_) {
    const float inv = 1.0f / scale_;
    if (scale_inv_) *scale_inv_ = inv;
    if (col_scale_inv_) *col_scale_inv_ = inv;
  }
}

}  // namespace nvte::cpu

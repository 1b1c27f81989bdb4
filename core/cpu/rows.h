// rows.h - reading rows of any float dtype as float32, and writing float32 results
// into an op's output tensor with the library's quantization rule.
//
// Every CPU op computes in float32 row by row: load_row -> math -> OutputRows::store.
// OutputRows applies the FP8 rule of cast.h (scale, round-to-nearest-even with
// saturation, amax max-accumulated, scale_inv = 1/scale) to whichever layouts the
// output has (rowwise [rows, cols] and/or columnwise [cols, rows]).
#pragma once

#include <atomic>
#include <cstddef>

#include "../common/dtype_switch.h"
#include "../common/tensor.h"

namespace nvte::cpu {

// out[0..n) = float(element[offset + i]) of a buffer of dtype t.
void load_row(const void *base, NVTEDType t, size_t offset, size_t n, float *out);

// Description of an input's 2D view, checked to be a readable float tensor.
struct InputRows {
  const void *data = nullptr;
  NVTEDType dtype = kNVTEFloat32;
  size_t rows = 0, cols = 0;
  float scale_inv = 1.0f;  // FP8 inputs are decoded as float(x) * scale_inv
  void load(size_t r, float *out) const;  // one row of `cols` values
};
// Reads input's rowwise data (FP8 inputs need scale_inv, applied by load()).
InputRows input_rows(const Tensor &t, const char *name);

class OutputRows {
 public:
  // Validates out (float/FP8 dtype, shape rows x cols in its 2D view, FP8 needs scale).
  OutputRows(const Tensor &out, const char *name, size_t rows, size_t cols);
  // Stores row r (cols values); folds |v| into the running amax.
  void store(size_t r, const float *vals);
  // Writes amax (max-accumulated) and scale_inv. Call once after all stores.
  void finish();
  bool is_fp8() const { return fp8_; }
  NVTEDType dtype() const { return dtype_; }

 private:
  NVTEDType dtype_;
  bool fp8_;
  float scale_ = 1.0f;
  void *row_ = nullptr;
  void *col_ = nullptr;
  size_t rows_, cols_;
  float *amax_ = nullptr, *scale_inv_ = nullptr, *col_scale_inv_ = nullptr;
  std::atomic<float> amax_acc_{0.0f};
};

}  // namespace nvte::cpu

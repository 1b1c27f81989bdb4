// cpu/attn_fp8_io.h - the quantization points of the CPU FP8 attention (cpu/fused_attn_fp8.cpp):
// an FP8 intermediate (the softmax output P~ and the score gradient dS~), scaled outputs
// (O, dQ, dK, dV) and scaled inputs (O, dO of the backward).
//
// Every point applies the library's FP8 rule (core/common/numeric.h, the same as cast.h and
// cpu/rows.h): a float64 value is first rounded to float32 (x), then x * scale is computed in
// float32 and encoded round-to-nearest-even, saturating to +-max (NaN stays NaN); amax is the
// max of |x| (before scaling), max-accumulated into the tensor's amax buffer; scale_inv is
// written as 1.0f / scale. A dequantized value is the FP8 number times (double)(1.0f / scale),
// exact in float64.
#pragma once

#include <atomic>
#include <cstddef>

#include "../common/tensor.h"

namespace nvte::cpu::attn_fp8 {

// v, a per-tensor scale or scale_inv read from the tensor `name`, when it is finite and positive;
// otherwise an error naming it. (A zero, negative, infinite or NaN scale turns every value into
// zero / NaN, with an amax that still looks valid: the recipe would go on with it silently.)
float checked_scale(float v, const char *name, const char *field);

// The FP8 number (as float) that x becomes under `scale` in format t (E4M3 or E5M2).
float fp8_round(double x, float scale, NVTEDType t);

// An FP8 intermediate of the dataflow whose scale comes from a metadata tensor (S or dP): the
// values are quantized, then immediately dequantized for the next matmul; amax is tracked.
class Fp8Point {
 public:
  // meta: the tensor holding the scale (float32 [1], required); t: the FP8 format.
  Fp8Point(const Tensor &meta, const char *name, NVTEDType t);
  // Quantize-dequantize: fp8_round(x, scale, t) * descale.
  double qdq(double x) const {
    return static_cast<double>(fp8_round(x, scale_, dtype_)) * descale_;
  }
  // Folds a (thread-local) max |x| into the running amax.
  void fold_amax(float local);
  // Writes meta's amax (max-accumulated, when it has one) and scale_inv (= 1/scale, when it
  // has one). Call once after all folds.
  void record(Tensor &meta) const;

 private:
  NVTEDType dtype_;
  float scale_;
  double descale_;
  std::atomic<float> amax_{0.0f};
};

// A scaled output tensor (O, dQ, dK, dV): FP8 with scale (amax and scale_inv written), or
// float16/bfloat16 stored directly (TE's current-scaling outputs; amax still recorded when the
// tensor has an amax buffer). Elements are addressed by offset from the tensor's data pointer,
// so strided views into packed buffers work. store() is thread-safe for disjoint ranges.
class ScaledOutput {
 public:
  ScaledOutput(Tensor &t, const char *name);
  void store(size_t offset, size_t n, const double *vals);
  void finish();  // amax and scale_inv; call once after all stores
  NVTEDType dtype() const { return dtype_; }
  void *data() const { return data_; }

 private:
  Tensor &t_;
  void *data_;
  NVTEDType dtype_;
  bool fp8_;
  float scale_ = 1.0f;
  std::atomic<float> amax_{0.0f};
};

// A scaled input (O, dO of the backward): n elements at offset, decoded and multiplied by the
// tensor's scale_inv when FP8 (checked present by the API layer).
struct ScaledInput {
  ScaledInput(const Tensor &t, const char *name);
  void load(size_t offset, size_t n, double *out) const;
  const void *data;
  NVTEDType dtype;
  double descale = 1.0;
};

}  // namespace nvte::cpu::attn_fp8

// cpu/attn_fp8_io.cpp - FP8 quantization points of the CPU FP8 attention (attn_fp8_io.h).
#include "attn_fp8_io.h"

#include <cmath>

#include "../common/dtype_switch.h"
#include "attn_rows.h"
#include "parallel.h"

namespace nvte::cpu::attn_fp8 {

float fp8_round(double x, float scale, NVTEDType t) {
  const float v = static_cast<float>(x) * scale;  // float32 product, as cpu/rows.cpp
  return t == kNVTEFloat8E4M3 ? e4m3_to_float(float_to_e4m3(v)) : e5m2_to_float(float_to_e5m2(v));
}

float checked_scale(float v, const char *name, const char *field) {
  NVTE_CHECK(std::isfinite(v) && v > 0.0f, "FP8 attention: ", name, " has ", field, " ", v,
             "; FP8 scales must be finite and positive");
  return v;
}

namespace {

float required_scale(const Tensor &t, const char *name) {
  const float *s = scalar_param(t, kNVTEScale, name);
  NVTE_CHECK(s != nullptr, name, " has no scale");
  return checked_scale(*s, name, "scale");
}

// NaN-ignoring max of |float(v)| over n values (see cpu/rows.cpp on why not std::fmax).
float abs_max(const double *v, size_t n) {
  float m = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float a = std::fabs(static_cast<float>(v[i]));
    m = a > m ? a : m;
  }
  return m;
}

void write_amax_and_scale_inv(Tensor &t, float amax, bool fp8, float scale, const char *name) {
  if (float *a = scalar_param(t, kNVTEAmax, name)) *a = std::fmax(*a, amax);
  if (!fp8) return;
  if (float *si = scalar_param(t, kNVTERowwiseScaleInv, name)) *si = 1.0f / scale;
}

}  // namespace

Fp8Point::Fp8Point(const Tensor &meta, const char *name, NVTEDType t)
    : dtype_(t), scale_(required_scale(meta, name)), descale_(static_cast<double>(1.0f / scale_)) {}

void Fp8Point::fold_amax(float local) { atomic_fmax(amax_, local); }

void Fp8Point::record(Tensor &meta) const {
  write_amax_and_scale_inv(meta, amax_.load(), true, scale_, "FP8 attention metadata");
}

ScaledOutput::ScaledOutput(Tensor &t, const char *name)
    : t_(t), data_(t.params[kNVTERowwiseData].data_ptr), dtype_(t.params[kNVTERowwiseData].dtype),
      fp8_(is_fp8(dtype_)) {
  if (fp8_) scale_ = required_scale(t, name);
}

void ScaledOutput::store(size_t offset, size_t n, const double *vals) {
  atomic_fmax(amax_, abs_max(vals, n));
  with_float_dtype(dtype_, "attention output", [&](auto tag) {
    using T = typename decltype(tag)::type;
    T *dst = static_cast<T *>(data_) + offset;
    for (size_t i = 0; i < n; ++i) dst[i] = from_f32<T>(static_cast<float>(vals[i]) * scale_);
  });
}

void ScaledOutput::finish() { write_amax_and_scale_inv(t_, amax_.load(), fp8_, scale_, "output"); }

ScaledInput::ScaledInput(const Tensor &t, const char *name)
    : data(t.params[kNVTERowwiseData].data_ptr), dtype(t.params[kNVTERowwiseData].dtype) {
  if (is_fp8(dtype)) {
    const float *si = scalar_param(t, kNVTERowwiseScaleInv, name);
    NVTE_CHECK(si != nullptr, name, " is FP8 but has no scale_inv");
    descale = checked_scale(*si, name, "scale_inv");
  }
}

void ScaledInput::load(size_t offset, size_t n, double *out) const {
  attn_rows::load_f64(data, dtype, offset, n, out);
  if (descale != 1.0)
    for (size_t i = 0; i < n; ++i) out[i] *= descale;
}

}  // namespace nvte::cpu::attn_fp8

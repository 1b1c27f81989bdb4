// tensor.h - the internal layout of a tensor handle and the checks every op uses.
#pragma once

#include <string>

#include "error.h"
#include "transformer_engine/transformer_engine.h"

struct NVTETensor_ {
  NVTEScalingMode scaling_mode = NVTE_DELAYED_TENSOR_SCALING;
  NVTEBasicTensor params[kNVTENumTensorParams] = {};
};

namespace nvte {

using Tensor = NVTETensor_;

size_t numel(const NVTEShape &s);
std::string shape_str(const NVTEShape &s);
size_t dtype_size(NVTEDType t);
const char *dtype_name(NVTEDType t);
bool is_fp8(NVTEDType t);
bool is_high_precision(NVTEDType t);  // float32, float16, bfloat16
float fp8_max(NVTEDType t);           // 448 or 57344

// A buffer is set when it has memory or is legitimately empty (numel 0 with a shape).
bool buffer_set(const NVTEBasicTensor &b);

// The logical tensor: rowwise buffer if set, else columnwise buffer with its shape
// rotated back ([N, rest...] -> [rest..., N]).
NVTEShape logical_shape(const Tensor &t);
NVTEDType logical_dtype(const Tensor &t);

// 2D view [product of leading dims, last dim] of a shape (scalars are [1, 1]).
struct Dims2 {
  size_t rows, cols;
};
Dims2 flat2d(const NVTEShape &s);

// True when the handle is non-null and has data (rowwise or columnwise).
bool present(const NVTETensor t);

// Handle checks used by the entry points. `name` appears in messages.
const Tensor &require(const NVTETensor t, const char *name);
Tensor &require_mut(NVTETensor t, const char *name);

// Reads a float32[1] buffer parameter (scale, amax, scale_inv) pointer; null if unset.
float *scalar_param(const Tensor &t, NVTETensorParam p, const char *name);

}  // namespace nvte

// tensor.cpp - tensor handles, dtype table and the exported tensor accessors.
#include "tensor.h"

#include <cstdint>
#include <cstring>
#include <new>

namespace nvte {

size_t numel(const NVTEShape &s) {
  size_t n = 1;
  for (size_t i = 0; i < s.ndim; ++i) n *= s.data[i];
  return n;
}

std::string shape_str(const NVTEShape &s) {
  std::string r = "[";
  for (size_t i = 0; i < s.ndim; ++i) r += (i ? ", " : "") + std::to_string(s.data[i]);
  return r + "]";
}

size_t dtype_size(NVTEDType t) {
  switch (t) {
    case kNVTEByte: case kNVTEFloat8E4M3: case kNVTEFloat8E5M2: case kNVTEFloat8E8M0:
    case kNVTEFloat4E2M1: return 1;
    case kNVTEInt16: case kNVTEFloat16: case kNVTEBFloat16: return 2;
    case kNVTEInt32: case kNVTEFloat32: return 4;
    case kNVTEInt64: return 8;
    default: return 0;
  }
}

const char *dtype_name(NVTEDType t) {
  switch (t) {
    case kNVTEByte: return "uint8";
    case kNVTEInt16: return "int16";
    case kNVTEInt32: return "int32";
    case kNVTEInt64: return "int64";
    case kNVTEFloat32: return "float32";
    case kNVTEFloat16: return "float16";
    case kNVTEBFloat16: return "bfloat16";
    case kNVTEFloat8E4M3: return "float8_e4m3";
    case kNVTEFloat8E5M2: return "float8_e5m2";
    case kNVTEFloat8E8M0: return "float8_e8m0";
    case kNVTEFloat4E2M1: return "float4_e2m1";
    default: return "invalid";
  }
}

bool is_fp8(NVTEDType t) { return t == kNVTEFloat8E4M3 || t == kNVTEFloat8E5M2; }
bool is_high_precision(NVTEDType t) {
  return t == kNVTEFloat32 || t == kNVTEFloat16 || t == kNVTEBFloat16;
}
float fp8_max(NVTEDType t) {
  NVTE_CHECK(is_fp8(t), "expected an FP8 dtype, got ", dtype_name(t));
  return t == kNVTEFloat8E4M3 ? 448.0f : 57344.0f;
}

bool buffer_set(const NVTEBasicTensor &b) {
  return b.data_ptr != nullptr || (b.shape.ndim > 0 && numel(b.shape) == 0);
}

NVTEShape logical_shape(const Tensor &t) {
  const NVTEBasicTensor &row = t.params[kNVTERowwiseData];
  const NVTEBasicTensor &col = t.params[kNVTEColumnwiseData];
  if (buffer_set(row) || !buffer_set(col) || col.shape.ndim < 2) return buffer_set(row) ? row.shape : col.shape;
  NVTEShape s = col.shape;
  for (size_t i = 0; i + 1 < s.ndim; ++i) s.data[i] = col.shape.data[i + 1];
  s.data[s.ndim - 1] = col.shape.data[0];
  return s;
}

NVTEDType logical_dtype(const Tensor &t) {
  const NVTEBasicTensor &row = t.params[kNVTERowwiseData];
  return buffer_set(row) ? row.dtype : t.params[kNVTEColumnwiseData].dtype;
}

Dims2 flat2d(const NVTEShape &s) {
  if (s.ndim == 0) return {1, 1};
  const size_t cols = s.data[s.ndim - 1];
  size_t rows = 1;
  for (size_t i = 0; i + 1 < s.ndim; ++i) rows *= s.data[i];
  return {rows, cols};
}

bool present(const NVTETensor t) {
  return t != nullptr &&
         (buffer_set(t->params[kNVTERowwiseData]) || buffer_set(t->params[kNVTEColumnwiseData]));
}

const Tensor &require(const NVTETensor t, const char *name) {
  NVTE_CHECK(t != nullptr, name, " is a NULL tensor handle");
  NVTE_CHECK_SUPPORTED(t->scaling_mode == NVTE_DELAYED_TENSOR_SCALING, name,
                       " uses scaling mode ", (int)t->scaling_mode,
                       "; only per-tensor (delayed/current) scaling is implemented");
  for (int p : {kNVTERowwiseData, kNVTEColumnwiseData}) {
    const NVTEBasicTensor &b = t->params[p];
    NVTE_CHECK(b.data_ptr != nullptr || numel(b.shape) == 0 || b.shape.ndim == 0, name,
               p == kNVTERowwiseData ? " rowwise" : " columnwise", " data pointer is NULL but shape ",
               shape_str(b.shape), " has ", numel(b.shape), " elements");
  }
  NVTE_CHECK(present(t), name, " has no data (neither rowwise nor columnwise buffer is set)");
  return *t;
}

Tensor &require_mut(NVTETensor t, const char *name) { return const_cast<Tensor &>(require(t, name)); }

static const char *scalar_param_name(NVTETensorParam p) {
  switch (p) {
    case kNVTEScale: return "scale";
    case kNVTEAmax: return "amax";
    case kNVTERowwiseScaleInv: return "scale_inv";
    case kNVTEColumnwiseScaleInv: return "columnwise scale_inv";
    default: return "scalar";
  }
}

float *scalar_param(const Tensor &t, NVTETensorParam p, const char *name) {
  const NVTEBasicTensor &b = t.params[p];
  if (b.data_ptr == nullptr) return nullptr;
  // Per-tensor scaling: exactly one float32 (a longer buffer would have its first element used
  // silently, as if it were per-row scales).
  NVTE_CHECK(b.dtype == kNVTEFloat32, name, "'s ", scalar_param_name(p), " must be float32, got ",
             dtype_name(b.dtype));
  NVTE_CHECK(numel(b.shape) == 1, name, "'s ", scalar_param_name(p),
             " must hold exactly one element (per-tensor scaling), shape ", shape_str(b.shape));
  return static_cast<float *>(b.data_ptr);
}

}  // namespace nvte

using namespace nvte;

extern "C" {

NVTEShape nvte_make_shape(const size_t *data, size_t ndim) {
  NVTEShape s{};
  if (ndim > NVTE_MAX_DIMS) {
    set_last_error("nvte_make_shape", concat(ndim, " dims requested, at most ", NVTE_MAX_DIMS).c_str());
    ndim = NVTE_MAX_DIMS;
  }
  s.ndim = ndim;
  for (size_t i = 0; i < ndim; ++i) s.data[i] = data ? data[i] : 0;
  return s;
}

NVTETensor nvte_create_tensor(NVTEScalingMode scaling_mode) {
  Tensor *t = new (std::nothrow) Tensor();
  if (t == nullptr) {
    set_last_error("nvte_create_tensor", "out of host memory");
    return nullptr;
  }
  t->scaling_mode = scaling_mode;
  return t;
}

void nvte_destroy_tensor(NVTETensor tensor) { delete tensor; }

NVTEStatus nvte_set_tensor_param(NVTETensor *tensor, NVTETensorParam param_name,
                                 const NVTEBasicTensor *param) {
  return api_call("nvte_set_tensor_param", [&] {
    NVTE_CHECK(tensor != nullptr && *tensor != nullptr, "tensor handle is NULL");
    NVTE_CHECK(param != nullptr, "param is NULL");
    NVTE_CHECK(param_name >= 0 && param_name < kNVTENumTensorParams, "unknown tensor param ",
               (int)param_name);
    NVTE_CHECK(param->dtype >= 0 && param->dtype < kNVTENumTypes, "unknown dtype ", (int)param->dtype);
    NVTE_CHECK(param->shape.ndim <= NVTE_MAX_DIMS, "shape has ", param->shape.ndim, " dims, at most ",
               NVTE_MAX_DIMS);
    // Element and byte counts must fit size_t: a count that wrapped (to 0, say) would pass every
    // later size check and send kernels past the buffer.
    size_t bytes = dtype_size(param->dtype);
    bool empty = false;
    for (size_t i = 0; i < param->shape.ndim; ++i) empty = empty || param->shape.data[i] == 0;
    for (size_t i = 0; i < param->shape.ndim && !empty; ++i) {
      const size_t d = param->shape.data[i];
      NVTE_CHECK(bytes <= SIZE_MAX / d, "shape ", shape_str(param->shape), " of ", dtype_name(param->dtype),
                 " has more bytes than size_t can count");
      bytes *= d;
    }
    (*tensor)->params[param_name] = *param;
  });
}

NVTEStatus nvte_set_tensor_param_v2(NVTETensor tensor, NVTETensorParam param, const void *buf,
                                    size_t size_in_bytes) {
  if (size_in_bytes != sizeof(NVTEBasicTensor)) {
    set_last_error("nvte_set_tensor_param_v2",
                   concat("size_in_bytes must be sizeof(NVTEBasicTensor) = ", sizeof(NVTEBasicTensor),
                          ", got ", size_in_bytes).c_str());
    return NVTE_ERROR_INVALID_ARGUMENT;
  }
  return nvte_set_tensor_param(&tensor, param, static_cast<const NVTEBasicTensor *>(buf));
}

NVTEBasicTensor nvte_get_tensor_param(const NVTETensor tensor, NVTETensorParam param_name) {
  if (tensor == nullptr || param_name < 0 || param_name >= kNVTENumTensorParams) return NVTEBasicTensor{};
  return tensor->params[param_name];
}

NVTEStatus nvte_get_tensor_param_v2(const NVTETensor tensor, NVTETensorParam param, void *buf,
                                    size_t size_in_bytes, size_t *size_written) {
  return api_call("nvte_get_tensor_param_v2", [&] {
    NVTE_CHECK(tensor != nullptr, "tensor handle is NULL");
    NVTE_CHECK(param >= 0 && param < kNVTENumTensorParams, "unknown tensor param ", (int)param);
    if (size_written) *size_written = sizeof(NVTEBasicTensor);
    if (buf == nullptr) return;  // a size query (TE's documented use of a NULL buf)
    NVTE_CHECK(size_in_bytes >= sizeof(NVTEBasicTensor),
               "buf must point to an NVTEBasicTensor (", sizeof(NVTEBasicTensor), " bytes)");
    std::memcpy(buf, &tensor->params[param], sizeof(NVTEBasicTensor));
  });
}

NVTEDType nvte_tensor_type(const NVTETensor tensor) {
  return tensor ? logical_dtype(*tensor) : kNVTEFloat32;
}
NVTEShape nvte_tensor_shape(const NVTETensor tensor) { return tensor ? logical_shape(*tensor) : NVTEShape{}; }
NVTEShape nvte_tensor_columnwise_shape(const NVTETensor tensor) {
  return tensor ? tensor->params[kNVTEColumnwiseData].shape : NVTEShape{};
}
size_t nvte_tensor_ndims(const NVTETensor tensor) { return nvte_tensor_shape(tensor).ndim; }
size_t nvte_tensor_size(const NVTETensor tensor, size_t dim) {
  const NVTEShape s = nvte_tensor_shape(tensor);
  if (dim >= s.ndim) {
    set_last_error("nvte_tensor_size", concat("dim ", dim, " out of range for shape ", shape_str(s)).c_str());
    return 0;
  }
  return s.data[dim];
}
size_t nvte_tensor_numel(const NVTETensor tensor) { return tensor ? numel(logical_shape(*tensor)) : 0; }
size_t nvte_tensor_element_size(const NVTETensor tensor) {
  return tensor ? dtype_size(logical_dtype(*tensor)) : 0;
}
size_t nvte_tensor_size_bytes(const NVTETensor tensor) {
  return nvte_tensor_numel(tensor) * nvte_tensor_element_size(tensor);
}
void *nvte_tensor_data(const NVTETensor tensor) {
  return tensor ? tensor->params[kNVTERowwiseData].data_ptr : nullptr;
}
void *nvte_tensor_columnwise_data(const NVTETensor tensor) {
  return tensor ? tensor->params[kNVTEColumnwiseData].data_ptr : nullptr;
}
float *nvte_tensor_amax(const NVTETensor tensor) {
  return tensor ? static_cast<float *>(tensor->params[kNVTEAmax].data_ptr) : nullptr;
}
float *nvte_tensor_scale(const NVTETensor tensor) {
  return tensor ? static_cast<float *>(tensor->params[kNVTEScale].data_ptr) : nullptr;
}
float *nvte_tensor_scale_inv(const NVTETensor tensor) {
  return tensor ? static_cast<float *>(tensor->params[kNVTERowwiseScaleInv].data_ptr) : nullptr;
}
float *nvte_tensor_columnwise_scale_inv(const NVTETensor tensor) {
  return tensor ? static_cast<float *>(tensor->params[kNVTEColumnwiseScaleInv].data_ptr) : nullptr;
}
NVTEShape nvte_tensor_scale_inv_shape(const NVTETensor tensor) {
  return tensor ? tensor->params[kNVTERowwiseScaleInv].shape : NVTEShape{};
}
NVTEScalingMode nvte_tensor_scaling_mode(const NVTETensor tensor) {
  return tensor ? tensor->scaling_mode : NVTE_INVALID_SCALING;
}
size_t nvte_dtype_size(NVTEDType dtype) { return dtype_size(dtype); }
const char *nvte_dtype_name(NVTEDType dtype) { return dtype_name(dtype); }

NVTEStatus nvte_tensor_pack_create(NVTETensorPack *pack) {
  return api_call("nvte_tensor_pack_create", [&] {
    NVTE_CHECK(pack != nullptr, "pack is NULL");
    for (auto &t : pack->tensors) t = new Tensor();
    pack->size = 0;
  });
}

NVTEStatus nvte_tensor_pack_destroy(NVTETensorPack *pack) {
  return api_call("nvte_tensor_pack_destroy", [&] {
    NVTE_CHECK(pack != nullptr, "pack is NULL");
    for (auto &t : pack->tensors) {
      delete t;
      t = nullptr;
    }
    pack->size = 0;
  });
}

}  // extern "C"

// module.cpp - the _nvte extension module: enums, the Tensor class, errors, and
// registration of every domain's functions.
#include <memory>
#include <optional>
#include <string>

#include "binding.h"

namespace nvte_py {

namespace {
py::object g_error_type;

// numpy dtype -> NVTEDType; ml_dtypes' bfloat16 / float8 types are recognised by name.
NVTEDType dtype_of(const py::array &a) {
  const std::string name = py::str(a.dtype().attr("name"));
  if (name == "float32") return kNVTEFloat32;
  if (name == "float16") return kNVTEFloat16;
  if (name == "bfloat16") return kNVTEBFloat16;
  if (name == "float8_e4m3fn") return kNVTEFloat8E4M3;
  if (name == "float8_e5m2") return kNVTEFloat8E5M2;
  if (name == "uint8" || name == "bool" || name == "int8") return kNVTEByte;
  if (name == "int16") return kNVTEInt16;
  if (name == "int32") return kNVTEInt32;
  if (name == "int64") return kNVTEInt64;
  throw py::type_error("unsupported numpy dtype for an NVTE tensor: " + name);
}

using OptShape = std::optional<std::vector<size_t>>;

// Tensor.make: every buffer of an FP8 (or plain) handle in one Python call instead of one
// set_param round trip each.
std::unique_ptr<Tensor> make_raw(uintptr_t data, const OptShape &shape, NVTEDType dtype, uintptr_t scale_inv,
                                 uintptr_t columnwise, const OptShape &columnwise_shape, uintptr_t scale,
                                 uintptr_t amax) {
  static const std::vector<size_t> kOne{1};
  auto t = std::make_unique<Tensor>(0);
  if (shape) t->set_raw(kNVTERowwiseData, data, *shape, dtype);
  if (columnwise_shape) t->set_raw(kNVTEColumnwiseData, columnwise, *columnwise_shape, dtype);
  if (scale_inv) {
    if (shape || !columnwise_shape) t->set_raw(kNVTERowwiseScaleInv, scale_inv, kOne, kNVTEFloat32);
    if (columnwise_shape) t->set_raw(kNVTEColumnwiseScaleInv, scale_inv, kOne, kNVTEFloat32);
  }
  if (scale) t->set_raw(kNVTEScale, scale, kOne, kNVTEFloat32);
  if (amax) t->set_raw(kNVTEAmax, amax, kOne, kNVTEFloat32);
  return t;
}
}  // namespace

Tensor::Tensor(int scaling_mode) : h_(nvte_create_tensor(static_cast<NVTEScalingMode>(scaling_mode))) {
  if (!h_) throw std::bad_alloc();
}

Tensor::~Tensor() { nvte_destroy_tensor(h_); }

void Tensor::set_raw(NVTETensorParam p, uintptr_t ptr, const std::vector<size_t> &shape, NVTEDType dtype) {
  NVTEBasicTensor b{};
  b.data_ptr = reinterpret_cast<void *>(ptr);
  b.dtype = dtype;
  b.shape = nvte_make_shape(shape.data(), shape.size());
  check(shape.size() <= NVTE_MAX_DIMS ? nvte_set_tensor_param(&h_, p, &b) : NVTE_ERROR_INVALID_ARGUMENT);
  if (static_cast<int>(p) >= 0 && p < kNVTENumTensorParams) keep_[p] = py::none();
}

void Tensor::set_array(NVTETensorParam p, py::array arr, py::object dtype) {
  if (!(arr.flags() & py::array::c_style))
    throw py::value_error("NVTE tensors need C-contiguous arrays (use numpy.ascontiguousarray)");
  std::vector<size_t> shape(arr.shape(), arr.shape() + arr.ndim());
  const NVTEDType t = dtype.is_none() ? dtype_of(arr) : dtype.cast<NVTEDType>();
  if (nvte_dtype_size(t) != static_cast<size_t>(arr.itemsize()))
    throw py::value_error(std::string("array itemsize ") + std::to_string(arr.itemsize()) +
                          " does not match dtype " + nvte_dtype_name(t));
  set_raw(p, reinterpret_cast<uintptr_t>(arr.data()), shape, t);  // not request(): ml_dtypes lack buffer formats
  keep_[p] = arr;
}

std::vector<NVTETensor> tensor_handles(const py::list &l, const char *what, bool allow_none) {
  std::vector<NVTETensor> r;
  for (size_t i = 0; i < l.size(); ++i) {
    if (allow_none && l[i].is_none()) {
      r.push_back(nullptr);
      continue;
    }
    if (!py::isinstance<Tensor>(l[i]))
      throw py::type_error(std::string(what) + "[" + std::to_string(i) + "] is not a Tensor");
    r.push_back(l[i].cast<const Tensor &>().handle());
  }
  return r;
}

void check(NVTEStatus status) {
  if (status == NVTE_SUCCESS) return;
  std::string msg = nvte_get_last_error();
  if (msg.empty()) msg = "call failed with status " + std::to_string(static_cast<int>(status));
  PyErr_SetObject(g_error_type.ptr(), py::make_tuple(msg, static_cast<int>(status)).ptr());
  throw py::error_already_set();
}

}  // namespace nvte_py

using namespace nvte_py;

PYBIND11_MODULE(_nvte, m) {
  m.doc() = "Framework-neutral binding of the transformer_engine C API (nvte_*).";

  py::module_ builtins = py::module_::import("builtins");
  g_error_type = py::reinterpret_borrow<py::object>(
      PyErr_NewExceptionWithDoc("transformer_engine._nvte.Error",
                                "A failed nvte_* call: args = (message, status code).",
                                PyExc_RuntimeError, nullptr));
  m.attr("Error") = g_error_type;

  py::enum_<NVTEDType>(m, "DType")
      .value("kByte", kNVTEByte).value("kInt16", kNVTEInt16).value("kInt32", kNVTEInt32)
      .value("kInt64", kNVTEInt64).value("kFloat32", kNVTEFloat32).value("kFloat16", kNVTEFloat16)
      .value("kBFloat16", kNVTEBFloat16).value("kFloat8E4M3", kNVTEFloat8E4M3)
      .value("kFloat8E5M2", kNVTEFloat8E5M2).value("kFloat8E8M0", kNVTEFloat8E8M0)
      .value("kFloat4E2M1", kNVTEFloat4E2M1);
  py::enum_<NVTETensorParam>(m, "Param")
      .value("kRowwiseData", kNVTERowwiseData).value("kColumnwiseData", kNVTEColumnwiseData)
      .value("kScale", kNVTEScale).value("kAmax", kNVTEAmax)
      .value("kRowwiseScaleInv", kNVTERowwiseScaleInv)
      .value("kColumnwiseScaleInv", kNVTEColumnwiseScaleInv)
      .value("kColumnwiseAmax", kNVTEColumnwiseAmax);
  py::enum_<NVTEStatus>(m, "Status")
      .value("SUCCESS", NVTE_SUCCESS).value("INVALID_ARGUMENT", NVTE_ERROR_INVALID_ARGUMENT)
      .value("NOT_SUPPORTED", NVTE_ERROR_NOT_SUPPORTED).value("CUDA", NVTE_ERROR_CUDA)
      .value("OUT_OF_MEMORY", NVTE_ERROR_OUT_OF_MEMORY).value("INTERNAL", NVTE_ERROR_INTERNAL);
  py::enum_<NVTEBackend>(m, "Backend").value("CPU", kNVTEBackendCPU).value("CUDA", kNVTEBackendCUDA);

  m.attr("VERSION") = NVTE_VERSION;
  m.def("get_version", &nvte_get_version, "NVTE_VERSION of the loaded libtransformer_engine.so");
  m.def("get_last_error", &nvte_get_last_error);
  m.def("cuda_backend_available", [] { return nvte_cuda_backend_available() != 0; });
  m.def("dtype_size", &nvte_dtype_size);

  // dynamic_attr: callers may attach the framework tensors a handle borrows (handle._refs = ...)
  // so that the handle alone keeps them alive.
  py::class_<Tensor>(m, "Tensor", py::dynamic_attr(),
                     "An NVTETensor handle. Buffers are borrowed: numpy arrays are kept alive by the "
                     "handle; raw pointers must be kept alive by the caller.")
      .def(py::init([](py::object data, py::object dtype, py::object scale, py::object amax,
                       py::object scale_inv, py::object columnwise_data,
                       py::object columnwise_scale_inv, int scaling_mode) {
             auto t = std::make_unique<Tensor>(scaling_mode);
             auto put = [&](NVTETensorParam p, py::object a, py::object dt) {
               if (!a.is_none()) t->set_array(p, a.cast<py::array>(), dt);
             };
             put(kNVTERowwiseData, data, dtype);
             put(kNVTEColumnwiseData, columnwise_data, dtype);
             put(kNVTEScale, scale, py::none());
             put(kNVTEAmax, amax, py::none());
             put(kNVTERowwiseScaleInv, scale_inv, py::none());
             put(kNVTEColumnwiseScaleInv, columnwise_scale_inv, py::none());
             return t;
           }),
           py::arg("data") = py::none(), py::arg("dtype") = py::none(), py::arg("scale") = py::none(),
           py::arg("amax") = py::none(), py::arg("scale_inv") = py::none(),
           py::arg("columnwise_data") = py::none(), py::arg("columnwise_scale_inv") = py::none(),
           py::arg("scaling_mode") = 0,
           "Build from numpy arrays; `dtype` overrides the element type of data/columnwise_data "
           "(e.g. DType.kFloat8E4M3 for uint8 arrays).")
      .def_static("make", &make_raw, py::arg("data"), py::arg("shape").none(true), py::arg("dtype"),
                  py::arg("scale_inv") = 0, py::arg("columnwise") = 0,
                  py::arg("columnwise_shape").none(true) = py::none(), py::arg("scale") = 0, py::arg("amax") = 0,
                  "A handle from raw pointers in one call (the per-op hot path of framework adapters): "
                  "data / shape (None: no rowwise buffer), columnwise / columnwise_shape (None: none), "
                  "both of `dtype`; scale_inv, scale, amax: float32 [1] (0: absent). scale_inv goes with "
                  "each data buffer given (the rowwise one when there is none). Memory is borrowed.")
      .def("set_param", &Tensor::set_raw, py::arg("param"), py::arg("ptr"), py::arg("shape"),
           py::arg("dtype"), "Set a buffer from a raw pointer (int), shape and dtype.")
      .def("set_array", &Tensor::set_array, py::arg("param"), py::arg("array"),
           py::arg("dtype") = py::none())
      .def_property_readonly("shape", [](const Tensor &t) {
        const NVTEShape s = nvte_tensor_shape(t.handle());
        return std::vector<size_t>(s.data, s.data + s.ndim);
      })
      .def_property_readonly("dtype", [](const Tensor &t) { return nvte_tensor_type(t.handle()); })
      .def_property_readonly("numel", [](const Tensor &t) { return nvte_tensor_numel(t.handle()); })
      .def_property_readonly("scaling_mode",
                             [](const Tensor &t) { return static_cast<int>(nvte_tensor_scaling_mode(t.handle())); })
      .def("param_ptr", [](const Tensor &t, NVTETensorParam p) {
        return reinterpret_cast<uintptr_t>(nvte_get_tensor_param(t.handle(), p).data_ptr);
      })
      .def("param_shape", [](const Tensor &t, NVTETensorParam p) {
        const NVTEShape s = nvte_get_tensor_param(t.handle(), p).shape;
        return std::vector<size_t>(s.data, s.data + s.ndim);
      })
      .def("param_dtype", [](const Tensor &t, NVTETensorParam p) {
        return nvte_get_tensor_param(t.handle(), p).dtype;
      })
      .def_property_readonly("handle", [](const Tensor &t) { return reinterpret_cast<uintptr_t>(t.handle()); });

  bind_cast(m);
  bind_transpose(m);
  bind_recipe(m);
  bind_gemm(m);
  bind_normalization(m);
  bind_activation(m);
  bind_fused_attn(m);
  bind_softmax(m);  // (after bind_fused_attn: its attention softmax takes the mask-type enum)
  bind_fused_rope(m);
}

// binding.h - shared pieces of the framework-neutral Python binding (module _nvte).
//
// Python holds an nvte::py::Tensor: an NVTETensor handle plus references to the
// Python objects (numpy arrays) whose memory it borrows, so they outlive the handle.
// Op bindings take Tensor* (None -> NULL handle), scalars and a stream as an int,
// make one nvte_* call and turn a failed status into a Python exception.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "transformer_engine/transformer_engine.h"

namespace nvte_py {

namespace py = pybind11;

class Tensor {
 public:
  explicit Tensor(int scaling_mode);
  ~Tensor();
  Tensor(const Tensor &) = delete;
  Tensor &operator=(const Tensor &) = delete;

  // Raw memory: pointer, shape, dtype (no ownership; the caller keeps memory alive).
  void set_raw(NVTETensorParam p, uintptr_t ptr, const std::vector<size_t> &shape, NVTEDType dtype);
  // A numpy array (C-contiguous); dtype defaults to the array's; keeps a reference.
  void set_array(NVTETensorParam p, py::array arr, py::object dtype);

  NVTETensor handle() const { return h_; }

 private:
  NVTETensor h_;
  py::object keep_[kNVTENumTensorParams];
};

// Handle of an optional tensor argument (None -> NULL).
inline NVTETensor handle(const Tensor *t) { return t ? t->handle() : nullptr; }

inline cudaStream_t to_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Handles of a Python list of Tensor; None entries become NULL when allow_none, else a TypeError.
std::vector<NVTETensor> tensor_handles(const py::list &l, const char *what, bool allow_none = false);

// Raises transformer_engine._nvte.Error (a RuntimeError) with the library's message.
void check(NVTEStatus status);

// Builds a temporary NVTEQuantizationConfig from keyword arguments and passes it to f
// (defined in cast.cpp; used by the cast and recipe bindings).
void with_quant_config(bool force_pow2_scales, float amax_epsilon, const Tensor *noop,
                       const std::function<void(NVTEQuantizationConfig)> &f);

// Registers one fused dact + dbias + quantize function (signature of nvte_quantize_dbias_dgelu and
// nvte_cast_transpose_dbias_dgelu) under `name` (defined in cast.cpp; used by cast and transpose).
using DActDbiasFn = NVTEStatus (*)(const NVTETensor, const NVTETensor, NVTETensor, NVTETensor, NVTETensor,
                                   cudaStream_t);
void def_dact_dbias(py::module_ &m, const char *name, DActDbiasFn fn);

// Per-domain registration; each lives in its own file.
void bind_cast(py::module_ &m);
void bind_transpose(py::module_ &m);
void bind_recipe(py::module_ &m);
void bind_gemm(py::module_ &m);
void bind_normalization(py::module_ &m);
void bind_activation(py::module_ &m);
void bind_softmax(py::module_ &m);
void bind_fused_rope(py::module_ &m);
void bind_fused_attn(py::module_ &m);

}  // namespace nvte_py

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

// Raises transformer_engine._nvte.Error (a RuntimeError) with the library's message.
void check(NVTEStatus status);

// Per-domain registration; each lives in its own file.
void bind_cast(py::module_ &m);
void bind_transpose(py::module_ &m);
void bind_recipe(py::module_ &m);
void bind_gemm(py::module_ &m);
void bind_normalization(py::module_ &m);
void bind_activation(py::module_ &m);
void bind_softmax(py::module_ &m);

}  // namespace nvte_py

// cast.cpp - Python functions for cast.h.
#include "transformer_engine/cast.h"

#include "binding.h"

namespace nvte_py {

void bind_cast(py::module_ &m) {
  m.def("quantize", [](const Tensor &in, Tensor &out, uintptr_t stream) {
    check(nvte_quantize(in.handle(), out.handle(), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("stream") = 0);
  m.def("quantize_noop", [](const Tensor &in, Tensor &out, const Tensor *noop, uintptr_t stream) {
    check(nvte_quantize_noop(in.handle(), out.handle(), handle(noop), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("noop").none(true), py::arg("stream") = 0);
  m.def("dequantize", [](const Tensor &in, Tensor &out, uintptr_t stream) {
    check(nvte_dequantize(in.handle(), out.handle(), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("stream") = 0);
}

}  // namespace nvte_py

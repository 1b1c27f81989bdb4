// transpose.cpp - Python functions for transpose.h.
#include "transformer_engine/transpose.h"

#include <string>
#include <vector>

#include "binding.h"

namespace nvte_py {

void bind_transpose(py::module_ &m) {
  m.def("cast_transpose", [](const Tensor &in, Tensor &out, uintptr_t stream) {
    check(nvte_cast_transpose(in.handle(), out.handle(), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("stream") = 0);
  m.def("transpose", [](const Tensor &in, Tensor &out, uintptr_t stream) {
    check(nvte_transpose(in.handle(), out.handle(), to_stream(stream)));
  }, py::arg("input"), py::arg("transposed_output"), py::arg("stream") = 0);
  m.def("cast_transpose_dbias", [](const Tensor &in, Tensor &out, Tensor &dbias, const Tensor *ws,
                                   uintptr_t stream) {
    check(nvte_cast_transpose_dbias(in.handle(), out.handle(), dbias.handle(), handle(ws), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("dbias"), py::arg("workspace") = py::none(),
     py::arg("stream") = 0);
  const std::pair<const char *, DActDbiasFn> dact_fns[] = {
      {"cast_transpose_dbias_dgelu", nvte_cast_transpose_dbias_dgelu},
      {"cast_transpose_dbias_drelu", nvte_cast_transpose_dbias_drelu},
      {"cast_transpose_dbias_dsilu", nvte_cast_transpose_dbias_dsilu},
      {"cast_transpose_dbias_dqgelu", nvte_cast_transpose_dbias_dqgelu},
      {"cast_transpose_dbias_dsrelu", nvte_cast_transpose_dbias_dsrelu}};
  for (const auto &[name, fn] : dact_fns) def_dact_dbias(m, name, fn);
  m.def("multi_cast_transpose", [](const py::list &inputs, const py::list &outputs, uintptr_t stream) {
    if (inputs.size() != outputs.size())
      throw py::value_error("inputs and outputs differ in length: " + std::to_string(inputs.size()) + " vs " +
                            std::to_string(outputs.size()));
    std::vector<NVTETensor> in = tensor_handles(inputs, "inputs"), out = tensor_handles(outputs, "outputs");
    check(nvte_multi_cast_transpose(in.size(), in.data(), out.data(), to_stream(stream)));
  }, py::arg("inputs"), py::arg("outputs"), py::arg("stream") = 0);
}

}  // namespace nvte_py

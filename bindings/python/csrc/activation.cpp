// activation.cpp - Python functions for activation.h, generated from one table:
// name(input, output, stream=0) and dname(grad, input, output, stream=0).
#include "transformer_engine/activation.h"

#include <string>

#include "binding.h"

namespace nvte_py {

namespace {
using ForwardFn = NVTEStatus (*)(const NVTETensor, NVTETensor, cudaStream_t);
using BackwardFn = NVTEStatus (*)(const NVTETensor, const NVTETensor, NVTETensor, cudaStream_t);

struct ActEntry {
  const char *name;
  ForwardFn forward;
  BackwardFn backward;
};

const ActEntry kActs[] = {
    {"gelu", nvte_gelu, nvte_dgelu},       {"relu", nvte_relu, nvte_drelu},
    {"silu", nvte_silu, nvte_dsilu},       {"qgelu", nvte_qgelu, nvte_dqgelu},
    {"srelu", nvte_srelu, nvte_dsrelu},    {"glu", nvte_glu, nvte_dglu},
    {"geglu", nvte_geglu, nvte_dgeglu},    {"reglu", nvte_reglu, nvte_dreglu},
    {"swiglu", nvte_swiglu, nvte_dswiglu}, {"qgeglu", nvte_qgeglu, nvte_dqgeglu},
    {"sreglu", nvte_sreglu, nvte_dsreglu},
};
}  // namespace

void bind_activation(py::module_ &m) {
  for (const ActEntry &e : kActs) {
    const ForwardFn f = e.forward;
    const BackwardFn b = e.backward;
    m.def(e.name, [f](const Tensor &in, Tensor &out, uintptr_t stream) {
      check(f(in.handle(), out.handle(), to_stream(stream)));
    }, py::arg("input"), py::arg("output"), py::arg("stream") = 0);
    m.def((std::string("d") + e.name).c_str(),
          [b](const Tensor *grad, const Tensor &in, Tensor &out, uintptr_t stream) {
            check(b(handle(grad), in.handle(), out.handle(), to_stream(stream)));
          },
          py::arg("grad").none(true), py::arg("input"), py::arg("output"), py::arg("stream") = 0);
  }
}

}  // namespace nvte_py

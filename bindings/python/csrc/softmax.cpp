// softmax.cpp - Python functions for softmax.h.
#include "transformer_engine/softmax.h"

#include "binding.h"

namespace nvte_py {

namespace {
using ForwardFn = NVTEStatus (*)(const NVTETensor, NVTETensor, float, cudaStream_t);
using BackwardFn = NVTEStatus (*)(const NVTETensor, const NVTETensor, NVTETensor, float, cudaStream_t);

// The families without an explicit mask share one signature each way.
struct SoftmaxEntry {
  const char *forward_name, *backward_name;
  ForwardFn forward;
  BackwardFn backward;
};

const SoftmaxEntry kSoftmaxes[] = {
    {"scaled_softmax_forward", "scaled_softmax_backward", nvte_scaled_softmax_forward,
     nvte_scaled_softmax_backward},
    {"scaled_upper_triang_masked_softmax_forward", "scaled_upper_triang_masked_softmax_backward",
     nvte_scaled_upper_triang_masked_softmax_forward, nvte_scaled_upper_triang_masked_softmax_backward},
    {"scaled_aligned_causal_masked_softmax_forward", "scaled_aligned_causal_masked_softmax_backward",
     nvte_scaled_aligned_causal_masked_softmax_forward, nvte_scaled_aligned_causal_masked_softmax_backward},
    {nullptr, "scaled_masked_softmax_backward", nullptr, nvte_scaled_masked_softmax_backward},
};
}  // namespace

void bind_softmax(py::module_ &m) {
  for (const SoftmaxEntry &e : kSoftmaxes) {
    if (e.forward) {
      const ForwardFn f = e.forward;
      m.def(e.forward_name, [f](const Tensor &in, Tensor &out, float scale, uintptr_t stream) {
        check(f(in.handle(), out.handle(), scale, to_stream(stream)));
      }, py::arg("input"), py::arg("output"), py::arg("scale"), py::arg("stream") = 0);
    }
    const BackwardFn b = e.backward;
    m.def(e.backward_name,
          [b](const Tensor &dy, const Tensor &y, Tensor &dx, float scale, uintptr_t stream) {
            check(b(dy.handle(), y.handle(), dx.handle(), scale, to_stream(stream)));
          },
          py::arg("incoming_grads"), py::arg("softmax_results"), py::arg("output_grads"), py::arg("scale"),
          py::arg("stream") = 0);
  }
  m.def("scaled_masked_softmax_forward",
        [](const Tensor &in, const Tensor *mask, Tensor &out, float scale, uintptr_t stream) {
          check(nvte_scaled_masked_softmax_forward(in.handle(), handle(mask), out.handle(), scale,
                                                   to_stream(stream)));
        },
        py::arg("input"), py::arg("mask").none(true), py::arg("output"), py::arg("scale"), py::arg("stream") = 0);
}

}  // namespace nvte_py

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
  m.def("attn_softmax_forward",
        [](const Tensor &in, const Tensor *bias, const Tensor *slopes, const Tensor *diag, const Tensor *mask,
           const Tensor *offset, Tensor &out, Tensor *sink_probs, float scale, NVTE_Bias_Type bias_type,
           NVTE_Mask_Type mask_type, uintptr_t stream) {
          check(nvte_attn_softmax_forward(in.handle(), handle(bias), handle(slopes), handle(diag), handle(mask),
                                          handle(offset), out.handle(), handle(sink_probs), scale, bias_type,
                                          mask_type, to_stream(stream)));
        },
        py::arg("input"), py::arg("bias").none(true), py::arg("alibi_slopes").none(true),
        py::arg("alibi_diagonal").none(true), py::arg("mask").none(true), py::arg("softmax_offset").none(true),
        py::arg("softmax_results"), py::arg("sink_probs").none(true), py::arg("scale"), py::arg("bias_type"),
        py::arg("mask_type"), py::arg("stream") = 0);
  m.def("attn_softmax_backward",
        [](const Tensor &dy, const Tensor &y, const Tensor *mask, const Tensor *sink_probs, Tensor &dx,
           Tensor *logit_grads, Tensor *offset_grads, float scale, NVTE_Mask_Type mask_type, uintptr_t stream) {
          check(nvte_attn_softmax_backward(dy.handle(), y.handle(), handle(mask), handle(sink_probs), dx.handle(),
                                           handle(logit_grads), handle(offset_grads), scale, mask_type,
                                           to_stream(stream)));
        },
        py::arg("incoming_grads"), py::arg("softmax_results"), py::arg("mask").none(true),
        py::arg("sink_probs").none(true), py::arg("output_grads"), py::arg("logit_grads").none(true),
        py::arg("offset_grads").none(true), py::arg("scale"), py::arg("mask_type") = NVTE_NO_MASK,
        py::arg("stream") = 0);
}

}  // namespace nvte_py

// cast.cpp - Python functions for cast.h (and nvte_zero_tensor).
#include "transformer_engine/cast.h"

#include <functional>
#include <memory>

#include "binding.h"

namespace nvte_py {

void with_quant_config(bool force_pow2_scales, float amax_epsilon, const Tensor *noop,
                       const std::function<void(NVTEQuantizationConfig)> &f) {
  std::unique_ptr<NVTEQuantizationConfig_, void (*)(NVTEQuantizationConfig)> c(
      nvte_create_quantization_config(), nvte_destroy_quantization_config);
  if (!c) throw std::bad_alloc();
  const NVTETensor noop_h = handle(noop);
  check(nvte_set_quantization_config_attribute(c.get(), kNVTEQuantizationConfigForcePow2Scales,
                                               &force_pow2_scales, sizeof(force_pow2_scales)));
  check(nvte_set_quantization_config_attribute(c.get(), kNVTEQuantizationConfigAmaxEpsilon, &amax_epsilon,
                                               sizeof(amax_epsilon)));
  check(nvte_set_quantization_config_attribute(c.get(), kNVTEQuantizationConfigNoopTensor, &noop_h,
                                               sizeof(noop_h)));
  f(c.get());
}

void def_dact_dbias(py::module_ &m, const char *name, DActDbiasFn fn) {
  m.def(name, [fn](const Tensor &in, const Tensor &act_in, Tensor &out, Tensor &dbias, const Tensor *ws,
                   uintptr_t stream) {
    check(fn(in.handle(), act_in.handle(), out.handle(), dbias.handle(), handle(ws), to_stream(stream)));
  }, py::arg("input"), py::arg("act_input"), py::arg("output"), py::arg("dbias"),
     py::arg("workspace") = py::none(), py::arg("stream") = 0);
}

void bind_cast(py::module_ &m) {
  m.def("quantize", [](const Tensor &in, Tensor &out, uintptr_t stream) {
    check(nvte_quantize(in.handle(), out.handle(), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("stream") = 0);
  m.def("quantize_noop", [](const Tensor &in, Tensor &out, const Tensor *noop, uintptr_t stream) {
    check(nvte_quantize_noop(in.handle(), out.handle(), handle(noop), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("noop").none(true), py::arg("stream") = 0);
  m.def("quantize_v2", [](const Tensor &in, Tensor &out, bool pow2, float eps, const Tensor *noop,
                          uintptr_t stream) {
    with_quant_config(pow2, eps, noop, [&](NVTEQuantizationConfig c) {
      check(nvte_quantize_v2(in.handle(), out.handle(), c, to_stream(stream)));
    });
  }, py::arg("input"), py::arg("output"), py::arg("force_pow2_scales") = false, py::arg("amax_epsilon") = 0.0f,
     py::arg("noop") = py::none(), py::arg("stream") = 0,
     "nvte_quantize_v2 with an NVTEQuantizationConfig built from the keyword arguments.");
  m.def("dequantize", [](const Tensor &in, Tensor &out, uintptr_t stream) {
    check(nvte_dequantize(in.handle(), out.handle(), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("stream") = 0);
  m.def("quantize_dbias", [](const Tensor &in, Tensor &out, Tensor &dbias, const Tensor *ws, uintptr_t stream) {
    check(nvte_quantize_dbias(in.handle(), out.handle(), dbias.handle(), handle(ws), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("dbias"), py::arg("workspace") = py::none(),
     py::arg("stream") = 0);
  m.def("quantize_dbias_workspace_size", [](const Tensor &in) {
    size_t bytes = 0;
    check(nvte_quantize_dbias_workspace_size(in.handle(), &bytes));
    return bytes;
  }, py::arg("input"));
  const std::pair<const char *, DActDbiasFn> dact_fns[] = {
      {"quantize_dbias_dgelu", nvte_quantize_dbias_dgelu}, {"quantize_dbias_drelu", nvte_quantize_dbias_drelu},
      {"quantize_dbias_dsilu", nvte_quantize_dbias_dsilu}, {"quantize_dbias_dqgelu", nvte_quantize_dbias_dqgelu},
      {"quantize_dbias_dsrelu", nvte_quantize_dbias_dsrelu}};
  for (const auto &[name, fn] : dact_fns) def_dact_dbias(m, name, fn);
  m.def("zero_tensor", [](Tensor &t, uintptr_t stream) {
    check(nvte_zero_tensor(t.handle(), to_stream(stream)));
  }, py::arg("tensor"), py::arg("stream") = 0,
     "Zero data, columnwise data, amax and scale_inv (scale is left alone).");
}

}  // namespace nvte_py

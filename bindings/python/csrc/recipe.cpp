// recipe.cpp - Python functions for recipe.h.
#include "transformer_engine/recipe.h"

#include <functional>
#include <string>
#include <vector>

#include "binding.h"

namespace nvte_py {

void bind_recipe(py::module_ &m) {
  m.def("delayed_scaling_recipe_amax_and_scale_update",
        [](const Tensor &hist, const Tensor &scale, Tensor &new_hist, Tensor &new_scale, const std::string &algo,
           NVTEDType fp8_dtype, float margin, uintptr_t stream) {
          check(nvte_delayed_scaling_recipe_amax_and_scale_update(hist.handle(), scale.handle(), new_hist.handle(),
                                                                  new_scale.handle(), algo.c_str(), fp8_dtype,
                                                                  margin, to_stream(stream)));
        },
        py::arg("amax_history"), py::arg("scale"), py::arg("updated_amax_history"), py::arg("updated_scale"),
        py::arg("amax_compute_algo"), py::arg("fp8_dtype"), py::arg("margin"), py::arg("stream") = 0);
  m.def("delayed_scaling_recipe_amax_and_scale_update_after_reduction",
        [](const Tensor *buffer, const py::list &hists, const py::list &scales, const std::string &algo,
           NVTEDType fp8_dtype, float margin, uintptr_t stream) {
          if (hists.size() != scales.size())
            throw py::value_error("amax_histories and scales differ in length: " + std::to_string(hists.size()) +
                                  " vs " + std::to_string(scales.size()));
          std::vector<NVTETensor> h = tensor_handles(hists, "amax_histories"), s = tensor_handles(scales, "scales");
          check(nvte_delayed_scaling_recipe_amax_and_scale_update_after_reduction(
              handle(buffer), h.data(), s.data(), h.size(), algo.c_str(), fp8_dtype, margin, to_stream(stream)));
        },
        py::arg("amax_reduction_buffer").none(true), py::arg("amax_histories"), py::arg("scales"),
        py::arg("amax_compute_algo"), py::arg("fp8_dtype"), py::arg("margin"), py::arg("stream") = 0);
  m.def("compute_amax", [](const Tensor &in, Tensor &out, uintptr_t stream) {
    check(nvte_compute_amax(in.handle(), out.handle(), to_stream(stream)));
  }, py::arg("input"), py::arg("output"), py::arg("stream") = 0);
  m.def("compute_scale_from_amax", [](Tensor &out, bool pow2, float eps, const Tensor *noop, uintptr_t stream) {
    with_quant_config(pow2, eps, noop, [&](NVTEQuantizationConfig c) {
      check(nvte_compute_scale_from_amax(out.handle(), c, to_stream(stream)));
    });
  }, py::arg("output"), py::arg("force_pow2_scales") = false, py::arg("amax_epsilon") = 0.0f,
     py::arg("noop") = py::none(), py::arg("stream") = 0);
}

}  // namespace nvte_py

// normalization.cpp - Python functions for normalization.h.
#include "transformer_engine/normalization.h"

#include "binding.h"

namespace nvte_py {

void bind_normalization(py::module_ &m) {
  m.def("layernorm_fwd", [](const Tensor &x, const Tensor &gamma, const Tensor &beta, float epsilon, Tensor &z,
                            Tensor &mu, Tensor &rsigma, Tensor *workspace, int sm_count,
                            bool zero_centered_gamma, uintptr_t stream) {
    check(nvte_layernorm_fwd(x.handle(), gamma.handle(), beta.handle(), epsilon, z.handle(), mu.handle(),
                             rsigma.handle(), handle(workspace), sm_count, zero_centered_gamma,
                             to_stream(stream)));
  }, py::arg("x"), py::arg("gamma"), py::arg("beta"), py::arg("epsilon"), py::arg("z"), py::arg("mu"),
     py::arg("rsigma"), py::arg("workspace").none(true) = nullptr, py::arg("sm_count") = 0,
     py::arg("zero_centered_gamma") = false, py::arg("stream") = 0);

  m.def("layernorm_bwd", [](const Tensor &dz, const Tensor &x, const Tensor &mu, const Tensor &rsigma,
                            const Tensor &gamma, Tensor &dx, Tensor &dgamma, Tensor &dbeta, Tensor *workspace,
                            int sm_count, bool zero_centered_gamma, uintptr_t stream) {
    check(nvte_layernorm_bwd(dz.handle(), x.handle(), mu.handle(), rsigma.handle(), gamma.handle(),
                             dx.handle(), dgamma.handle(), dbeta.handle(), handle(workspace), sm_count,
                             zero_centered_gamma, to_stream(stream)));
  }, py::arg("dz"), py::arg("x"), py::arg("mu"), py::arg("rsigma"), py::arg("gamma"), py::arg("dx"),
     py::arg("dgamma"), py::arg("dbeta"), py::arg("workspace").none(true) = nullptr, py::arg("sm_count") = 0,
     py::arg("zero_centered_gamma") = false, py::arg("stream") = 0);

  m.def("rmsnorm_fwd", [](const Tensor &x, const Tensor &gamma, float epsilon, Tensor &z, Tensor &rsigma,
                          Tensor *workspace, int sm_count, bool zero_centered_gamma, uintptr_t stream) {
    check(nvte_rmsnorm_fwd(x.handle(), gamma.handle(), epsilon, z.handle(), rsigma.handle(),
                           handle(workspace), sm_count, zero_centered_gamma, to_stream(stream)));
  }, py::arg("x"), py::arg("gamma"), py::arg("epsilon"), py::arg("z"), py::arg("rsigma"),
     py::arg("workspace").none(true) = nullptr, py::arg("sm_count") = 0,
     py::arg("zero_centered_gamma") = false, py::arg("stream") = 0);

  m.def("rmsnorm_bwd", [](const Tensor &dz, const Tensor &x, const Tensor &rsigma, const Tensor &gamma,
                          Tensor &dx, Tensor &dgamma, Tensor *workspace, int sm_count, bool zero_centered_gamma,
                          uintptr_t stream) {
    check(nvte_rmsnorm_bwd(dz.handle(), x.handle(), rsigma.handle(), gamma.handle(), dx.handle(),
                           dgamma.handle(), handle(workspace), sm_count, zero_centered_gamma,
                           to_stream(stream)));
  }, py::arg("dz"), py::arg("x"), py::arg("rsigma"), py::arg("gamma"), py::arg("dx"), py::arg("dgamma"),
     py::arg("workspace").none(true) = nullptr, py::arg("sm_count") = 0,
     py::arg("zero_centered_gamma") = false, py::arg("stream") = 0);

  m.def("rmsnorm_bwd_add", [](const Tensor &dz, const Tensor &x, const Tensor &add, const Tensor &rsigma,
                              const Tensor &gamma, Tensor &dx, Tensor &dgamma, Tensor *workspace, int sm_count,
                              bool zero_centered_gamma, uintptr_t stream) {
    check(nvte_rmsnorm_bwd_add(dz.handle(), x.handle(), add.handle(), rsigma.handle(), gamma.handle(),
                               dx.handle(), dgamma.handle(), handle(workspace), sm_count, zero_centered_gamma,
                               to_stream(stream)));
  }, py::arg("dz"), py::arg("x"), py::arg("add"), py::arg("rsigma"), py::arg("gamma"), py::arg("dx"),
     py::arg("dgamma"), py::arg("workspace").none(true) = nullptr, py::arg("sm_count") = 0,
     py::arg("zero_centered_gamma") = false, py::arg("stream") = 0);

  m.def("normalization_workspace_size", [](const Tensor &x, bool is_forward) {
    size_t bytes = 0;
    check(nvte_normalization_workspace_size(x.handle(), is_forward, &bytes));
    return bytes;
  }, py::arg("x"), py::arg("is_forward"), "Bytes of workspace a norm of x needs (0 on the CPU backend).");
}

}  // namespace nvte_py

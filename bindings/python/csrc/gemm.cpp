// gemm.cpp - Python functions for gemm.h.
#include "transformer_engine/gemm.h"

#include <memory>
#include <string>

#include "binding.h"

namespace nvte_py {

namespace {

// An NVTEMatmulConfig owned for the duration of one call.
struct MatmulConfig {
  NVTEMatmulConfig c = nvte_create_matmul_config();
  MatmulConfig() {
    if (!c) throw std::bad_alloc();
  }
  ~MatmulConfig() { nvte_destroy_matmul_config(c); }
  template <class T>
  void set(NVTEMatmulConfigAttribute a, const T &v) {
    check(nvte_set_matmul_config_attribute(c, a, &v, sizeof(T)));
  }
};

// Handles of a list argument of the expected length; None entries become NULL where allowed.
std::vector<NVTETensor> handles(const py::list &l, const char *what, size_t expect, bool allow_none) {
  if (l.size() != expect)
    throw py::value_error(std::string(what) + " has " + std::to_string(l.size()) + " entries; expected " +
                          std::to_string(expect));
  return tensor_handles(l, what, allow_none);
}

}  // namespace

void bind_gemm(py::module_ &m) {
  m.def("gemm",
        [](const Tensor &A, const Tensor &B, Tensor &D, const Tensor *bias, Tensor *pre_gelu_out, bool transa,
           bool transb, bool grad, Tensor *workspace, bool accumulate, bool use_split_accumulator,
           int math_sm_count, uintptr_t stream) {
          NVTEStatus s;
          {
            py::gil_scoped_release nogil;
            s = nvte_cublas_gemm(A.handle(), B.handle(), D.handle(), handle(bias), handle(pre_gelu_out),
                                 transa, transb, grad, handle(workspace), accumulate, use_split_accumulator,
                                 math_sm_count, to_stream(stream));
          }
          check(s);
        },
        py::arg("A"), py::arg("B"), py::arg("D"), py::arg("bias") = py::none(),
        py::arg("pre_gelu_out") = py::none(), py::arg("transa") = false, py::arg("transb") = false,
        py::arg("grad") = false, py::arg("workspace") = py::none(), py::arg("accumulate") = false,
        py::arg("use_split_accumulator") = false, py::arg("math_sm_count") = 0, py::arg("stream") = 0,
        "nvte_cublas_gemm: D = op(B) @ op(A) with the epilogues of gemm.h (row-major view).");

  m.def("batched_gemm",
        [](const Tensor &A, const Tensor &B, Tensor &D, bool transa, bool transb, bool accumulate, Tensor *workspace,
           uintptr_t stream) {
          NVTEStatus s;
          {
            py::gil_scoped_release nogil;
            s = nvte_batched_gemm(A.handle(), B.handle(), D.handle(), transa, transb, accumulate, handle(workspace),
                                  to_stream(stream));
          }
          check(s);
        },
        py::arg("A"), py::arg("B"), py::arg("D"), py::arg("transa") = false, py::arg("transb") = false,
        py::arg("accumulate") = false, py::arg("workspace") = py::none(), py::arg("stream") = 0,
        "nvte_batched_gemm: D[i] = op(B[i]) @ op(A[i]) over dense [batch, rows, cols] stacks.");

  m.def("gemm_v2",
        [](bool transa, bool transb, float alpha, const Tensor &A, const Tensor &B, float beta, const Tensor *C,
           Tensor &D, Tensor *workspace, const Tensor *bias, Tensor *dbias, bool gelu, bool dgelu, Tensor *aux,
           bool use_split_accumulator, int sm_count, uintptr_t stream) {
          MatmulConfig cfg;
          cfg.set(kNVTEMatmulConfigBiasTensor, handle(bias));
          cfg.set(kNVTEMatmulConfigDBiasTensor, handle(dbias));
          cfg.set(kNVTEMatmulConfigWithGELUEpilogue, gelu);
          cfg.set(kNVTEMatmulConfigWithDGELUEpilogue, dgelu);
          cfg.set(kNVTEMatmulConfigEpilogueAuxTensor, handle(aux));
          cfg.set(kNVTEMatmulConfigUseSplitAccumulator, use_split_accumulator);
          cfg.set(kNVTEMatmulConfigSMCount, sm_count);
          NVTEStatus s;
          {
            py::gil_scoped_release nogil;
            s = nvte_cublas_gemm_v2(transa, transb, &alpha, A.handle(), B.handle(), &beta, handle(C), D.handle(),
                                    handle(workspace), cfg.c, to_stream(stream));
          }
          check(s);
        },
        py::arg("transa"), py::arg("transb"), py::arg("alpha"), py::arg("A"), py::arg("B"), py::arg("beta"),
        py::arg("C").none(true), py::arg("D"), py::arg("workspace") = py::none(), py::arg("bias") = py::none(),
        py::arg("dbias") = py::none(), py::arg("gelu") = false, py::arg("dgelu") = false,
        py::arg("aux") = py::none(), py::arg("use_split_accumulator") = true, py::arg("sm_count") = 0,
        py::arg("stream") = 0,
        "nvte_cublas_gemm_v2: D = alpha * op(B) @ op(A) + beta * C with epilogues from an NVTEMatmulConfig "
        "built from the keyword arguments.");

  m.def("multi_tensor_gemm",
        [](const py::list &A, const py::list &B, const py::list &D, const py::list &bias,
           const py::list &pre_gelu_out, bool transa, bool transb, bool grad, py::object workspace,
           bool accumulate, bool use_split_accumulator, int math_sm_count, uintptr_t stream) {
          const size_t n = A.size();
          std::vector<NVTETensor> a = handles(A, "A", n, false), b = handles(B, "B", n, false),
                                  d = handles(D, "D", n, false), bi = handles(bias, "bias", n, true),
                                  pg = handles(pre_gelu_out, "pre_gelu_out", n, true), ws;
          if (!workspace.is_none()) {
            const py::list wl = workspace.cast<py::list>();
            ws = handles(wl, "workspace", wl.size(), false);
          }
          NVTEStatus s;
          {
            py::gil_scoped_release nogil;
            s = nvte_multi_tensor_gemm(a.data(), b.data(), d.data(), bi.data(), pg.data(), static_cast<int>(n),
                                       transa, transb, grad, ws.empty() ? nullptr : ws.data(), accumulate,
                                       use_split_accumulator, math_sm_count, to_stream(stream));
          }
          check(s);
        },
        py::arg("A"), py::arg("B"), py::arg("D"), py::arg("bias"), py::arg("pre_gelu_out"),
        py::arg("transa") = false, py::arg("transb") = false, py::arg("grad") = false,
        py::arg("workspace") = py::none(), py::arg("accumulate") = false,
        py::arg("use_split_accumulator") = false, py::arg("math_sm_count") = 0, py::arg("stream") = 0,
        "nvte_multi_tensor_gemm: independent GEMMs sharing the flags (bias / pre_gelu_out entries may be None).");

  m.def("gemm_workspace_size",
        [](NVTEBackend backend) {
          size_t bytes = 0;
          check(nvte_cublas_gemm_workspace_size(backend, &bytes));
          return bytes;
        },
        py::arg("backend") = kNVTEBackendCPU, "Bytes of workspace one GEMM wants on the backend (0 on the CPU).");
}

}  // namespace nvte_py

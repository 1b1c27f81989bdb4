// fused_rope.cpp - Python functions for fused_rope.h.
#include "transformer_engine/fused_rope.h"

#include "binding.h"

namespace nvte_py {

namespace {
using RopeFn = NVTEStatus (*)(const NVTETensor, const NVTETensor, const NVTETensor, const NVTETensor, NVTETensor,
                              NVTE_QKV_Format, bool, int, int, int, int, int, int, int, int, int, int, int,
                              cudaStream_t);

// forward(input, ...) and backward(output_grads, ...) share the argument list.
void def_rope(py::module_ &m, const char *name, RopeFn fn, const char *x_name, const char *y_name) {
  m.def(name,
        [fn](const Tensor &x, const Tensor *cu_seqlens, const Tensor &freqs, const Tensor *start_positions,
             Tensor &y, NVTE_QKV_Format qkv_format, bool interleaved, int cp_size, int cp_rank, int s, int b, int h,
             int d, int d2, int stride_s_or_t, int stride_b, int stride_h, int stride_d, uintptr_t stream) {
          check(fn(x.handle(), handle(cu_seqlens), freqs.handle(), handle(start_positions), y.handle(), qkv_format,
                   interleaved, cp_size, cp_rank, s, b, h, d, d2, stride_s_or_t, stride_b, stride_h, stride_d,
                   to_stream(stream)));
        },
        py::arg(x_name), py::arg("cu_seqlens").none(true), py::arg("freqs"), py::arg("start_positions").none(true),
        py::arg(y_name), py::arg("qkv_format"), py::arg("interleaved"), py::arg("cp_size"), py::arg("cp_rank"),
        py::arg("s"), py::arg("b"), py::arg("h"), py::arg("d"), py::arg("d2"), py::arg("stride_s_or_t"),
        py::arg("stride_b"), py::arg("stride_h"), py::arg("stride_d"), py::arg("stream") = 0);
}
}  // namespace

void bind_fused_rope(py::module_ &m) {
  def_rope(m, "fused_rope_forward", nvte_fused_rope_forward, "input", "output");
  def_rope(m, "fused_rope_backward", nvte_fused_rope_backward, "output_grads", "input_grads");
}

}  // namespace nvte_py

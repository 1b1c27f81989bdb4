// gemm.cpp - Python functions for gemm.h.
#include "binding.h"

namespace nvte_py {

void bind_gemm(py::module_ &m) { (void)m; }

}  // namespace nvte_py

// normalization.cpp - Python functions for normalization.h.
#include "binding.h"

namespace nvte_py {

void bind_normalization(py::module_ &m) { (void)m; }

}  // namespace nvte_py

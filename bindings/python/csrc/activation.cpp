// activation.cpp - Python functions for activation.h.
#include "binding.h"

namespace nvte_py {

void bind_activation(py::module_ &m) { (void)m; }

}  // namespace nvte_py

// transpose.cpp - Python functions for transpose.h.
#include "binding.h"

namespace nvte_py {

void bind_transpose(py::module_ &m) { (void)m; }

}  // namespace nvte_py

// softmax.cpp - Python functions for softmax.h.
#include "binding.h"

namespace nvte_py {

void bind_softmax(py::module_ &m) { (void)m; }

}  // namespace nvte_py

// recipe.cpp - Python functions for recipe.h.
#include "binding.h"

namespace nvte_py {

void bind_recipe(py::module_ &m) { (void)m; }

}  // namespace nvte_py

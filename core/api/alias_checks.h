// alias_checks.h - output operands that share an input's buffer (defined in api/attn_softmax.cpp).
#pragma once

#include "../common/tensor.h"

namespace nvte::api {

// Two operands share a buffer (an empty one shares nothing: frameworks give every empty tensor
// the same null address).
bool same_buffer(const Tensor &a, const Tensor &b);

// An output that is exactly an input's buffer must hold the input's dtype, else rows overlap.
void check_alias(const Tensor &out, const char *out_name, const Tensor &in, const char *in_name);

}  // namespace nvte::api

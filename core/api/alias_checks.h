// alias_checks.h - output operands that share an input's buffer (defined in api/attn_softmax.cpp).
#pragma once

#include "../common/tensor.h"

namespace nvte::api {

// Two operands share a buffer (an empty one shares nothing: frameworks give every empty tensor
// the same null address).
bool same_buffer(const Tensor &a, const Tensor &b);

// Two operands' rowwise bytes (numel x element size from their data pointers) intersect; an
// empty or data-less one intersects nothing. For a tensor inside a packed buffer this is a part
// of its extent, so a true answer is never a false alarm.
bool bytes_overlap(const Tensor &a, const Tensor &b);

// An output may be exactly an input's buffer (in place) with the input's dtype; an output of
// another dtype there, or one that overlaps the input only partly, is an error (rows would be
// read after another row's result overwrote them).
void check_alias(const Tensor &out, const char *out_name, const Tensor &in, const char *in_name);

}  // namespace nvte::api

// alias_checks.h - output operands that share memory with an input (defined in api/alias_checks.cpp).
//
// The entry points check every output against the inputs it is computed from, before anything is
// written. Two rules:
//  - check_alias: the elementwise / row-by-row rule. An output's rowwise data may be exactly an
//    input's rowwise data (in place: same start, same dtype, same element count; each element is
//    read before its own address is written); any other shared byte is an error.
//  - check_disjoint: the output shares no byte with the input at all (transposes, GEMM operands,
//    reductions, outputs of different shapes).
// Both look at the rowwise and the columnwise data buffers of both tensors.
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

// An output may be exactly an input's rowwise buffer (in place) with the input's dtype and element
// count; an output of another dtype or size there, one that overlaps the input only partly, or a
// columnwise buffer of either that shares bytes with the other's data, is an error (rows would be
// read after another row's result overwrote them).
void check_alias(const Tensor &out, const char *out_name, const Tensor &in, const char *in_name);

// Whether any byte of a's rowwise / columnwise data is one of b's (empty buffers share none).
bool any_overlap(const Tensor &a, const Tensor &b);

// No data buffer of `out` (rowwise or columnwise) shares a byte with one of `other`. `why` ends the
// message (e.g. "a transpose cannot run in place"); NULL gives a generic reason.
void check_disjoint(const Tensor &out, const char *out_name, const Tensor &other, const char *other_name,
                    const char *why = nullptr);

}  // namespace nvte::api

// runners.h - validation + dispatch shared by several entry-point files (defined in api/cast.cpp):
// cast+transpose ops are quantizations into an output with a columnwise layout, and the
// recipe's current-scaling ops honour the same noop flag, so they all validate alike.
#pragma once

#include <optional>

#include "../common/activation_math.h"
#include "../common/backend.h"

namespace nvte::api {

// True when a noop flag tensor (float32[1]) holds 1: TE's "skip this op" signal.
bool noop_set(const NVTETensor noop, Backend b);

void run_quantize(const char *op, const NVTETensor input, NVTETensor output, const NVTETensor noop);

// act empty: plain dbias; otherwise g = input * dact(act_input) first.
void run_quantize_dbias(const char *op, const NVTETensor input, const NVTETensor act_input,
                        NVTETensor output, NVTETensor dbias, NVTETensor workspace,
                        std::optional<Act> act);

}  // namespace nvte::api
